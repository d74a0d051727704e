//! Benchmark (not a test; run through `scripts/bench`): the heartbeat's cost
//! with many live leases (issue 7, figure (g)). Steps are submitted through
//! `durable.submit_run`, leased through `Db::lease` by one registered worker,
//! and then `Db::heartbeat` (the worker's one renewal statement per interval)
//! is timed with 1 … 1,000 of those leases, beside a plain-SQL baseline: one
//! `UPDATE durable.lease_clock SET expires_at = … WHERE step_run_id = ANY($1)`
//! of the same leases (the table that holds a live lease's expiry: the
//! renewal alone, without the runtime's fences and reports), each on a pool
//! of one connection.
//!
//! Statements per call are counted on the server: with pg_stat_statements
//! loaded, its `calls`; otherwise the database's committed transactions
//! (`pg_stat_database.xact_commit`, each autocommit statement is one) over
//! the calls, minus the same reading taken around zero calls.
//!
//! A fresh database `bench_h_*` is created and dropped at the end (also on
//! error and on Ctrl-C).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use supervisor::db::{Db, Lease, Route};
use tests::bench::*;
use uuid::Uuid;

#[derive(Parser, Debug, Clone)]
#[command(about = "Heartbeat cost with many live leases: Db::heartbeat vs one plain UPDATE")]
struct Args {
    /// Server where the benchmark may create and drop a database (bench_h_*).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Live leases renewed per call (the largest is the number leased).
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000")]
    leases: Vec<u32>,
    /// Timed calls per cell (after 5 untimed ones).
    #[arg(long, default_value_t = 200)]
    calls: u32,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

const EXECUTOR_KIND: &str = "bench";
const KIND: &str = "bench.noop";
const TTL: Duration = Duration::from_secs(600);
const WARMUP: u32 = 5;
/// The renewal alone, on the table that holds a live lease's expiry (the
/// lease clock: its rows exist from the runtime cell's calls, which run
/// first for each size).
const PLAIN_RENEW: &str = "UPDATE durable.lease_clock
    SET expires_at = now() + make_interval(secs => $2::double precision / 1000.0)
  WHERE step_run_id = ANY($1)";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Imp {
    Runtime,
    Plain,
}

impl Imp {
    fn name(self) -> &'static str {
        match self {
            Imp::Runtime => "runtime Db::heartbeat",
            Imp::Plain => "plain UPDATE … = ANY($1)",
        }
    }
}

struct Cell {
    imp: Imp,
    leases: u32,
    times: Vec<Duration>,
    statements_per_call: Option<f64>,
}

/// How statements are counted on the server.
#[derive(Clone, Copy)]
enum Counter {
    PgStatStatements,
    XactCommit,
}

async fn pg_stat_statements(db: &Db) -> bool {
    // needs shared_preload_libraries; the reset fails otherwise
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(db.pool())
        .await
        .is_ok()
        && sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(db.pool())
            .await
            .is_ok()
}

/// The server's statement count of this database now (see [`Counter`]); the
/// benchmark's pools flush their statistics first.
async fn statement_count(counter: Counter, reader: &Db, measured: &Db) -> Result<i64> {
    match counter {
        Counter::PgStatStatements => Ok(sqlx::query_scalar(
            "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                -- statements the client sent: with pg_stat_statements.track
                -- = all, those run inside renew_leases are counted too, and
                -- one call read as two statements (audit)
                AND toplevel
                AND (query LIKE '%UPDATE durable.workers SET last_heartbeat_at%'
                     OR query LIKE '%SET expires_at = now()%'
                     OR query LIKE '%durable.renew_leases(%')",
        )
        .fetch_one(reader.pool())
        .await?),
        Counter::XactCommit => {
            // each backend flushes its pending statistics (this call
            // included) once it is idle after the call
            for db in [measured, reader] {
                sqlx::query("SELECT pg_stat_force_next_flush()")
                    .execute(db.pool())
                    .await?;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            Ok(sqlx::query_scalar(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
            )
            .fetch_one(reader.pool())
            .await?)
        }
    }
}

async fn call(imp: Imp, db: &Db, worker: Uuid, leases: &[Lease], ids: &[Uuid]) -> Result<()> {
    match imp {
        Imp::Runtime => {
            let r = db.heartbeat(worker, leases, TTL).await?;
            if r.renewed != leases.len() {
                bail!(
                    "heartbeat renewed {} of {} leases (lost {}, busy {})",
                    r.renewed,
                    leases.len(),
                    r.lost.len(),
                    r.busy.len()
                );
            }
        }
        Imp::Plain => {
            let n = sqlx::query(PLAIN_RENEW)
                .bind(ids)
                .bind(TTL.as_millis() as f64)
                .execute(db.pool())
                .await?
                .rows_affected();
            if n != ids.len() as u64 {
                bail!("plain renewal updated {n} of {} rows", ids.len());
            }
        }
    }
    Ok(())
}

async fn run_cell(
    imp: Imp,
    url: &str,
    counter: Counter,
    worker: Uuid,
    leases: &[Lease],
    calls: u32,
) -> Result<Cell> {
    let db = match imp {
        Imp::Runtime => Db::connect(url, 1).await?,
        Imp::Plain => plain_db(url, 1).await?,
    };
    let reader = Db::connect(url, 1).await?;
    let ids: Vec<Uuid> = leases.iter().map(|l| l.step_run_id()).collect();
    for _ in 0..WARMUP {
        call(imp, &db, worker, leases, &ids).await?;
    }
    // statements per call = the slope between a block of `calls` calls and a
    // block of a quarter as many, each between two readings: whatever the
    // readings themselves add (a constant per block) cancels out. The first
    // reading only settles what the warm-up left pending.
    statement_count(counter, &reader, &db).await?;
    let c0 = statement_count(counter, &reader, &db).await?;
    let mut times = Vec::with_capacity(calls as usize);
    for _ in 0..calls {
        let t = Instant::now();
        call(imp, &db, worker, leases, &ids).await?;
        times.push(t.elapsed());
    }
    let c1 = statement_count(counter, &reader, &db).await?;
    let short = calls / 4;
    let d0 = statement_count(counter, &reader, &db).await?;
    for _ in 0..short {
        call(imp, &db, worker, leases, &ids).await?;
    }
    let d1 = statement_count(counter, &reader, &db).await?;
    db.pool().close().await;
    reader.pool().close().await;
    let n = (c1 - c0) - (d1 - d0);
    let per_call = (calls > short).then(|| n as f64 / (calls - short) as f64);
    Ok(Cell {
        imp,
        leases: leases.len() as u32,
        times,
        statements_per_call: per_call.filter(|s| *s >= 0.0),
    })
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    run_and_clean_up("bench_heartbeat", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: Arc<Mutex<Vec<String>>>) -> Result<()> {
    if args.leases.is_empty() || args.leases.contains(&0) || args.calls == 0 {
        bail!("--leases and --calls must be positive");
    }
    let total = *args.leases.iter().max().unwrap();
    let admin = Db::connect(&args.database_url, 1)
        .await
        .context("connecting to DATABASE_URL")?;
    let mut report = Report::new("bench_heartbeat");
    println!("== bench_heartbeat: heartbeat cost with many live leases (issue 7 (g))");
    report.set_setup(print_setup(&admin, &args.database_url).await?);
    report.set_params(json!({"leases": args.leases, "calls": args.calls, "ttl_s": TTL.as_secs()}));
    let (name, url) = fresh_database(&admin, &args.database_url, "bench_h", &created).await?;
    let db = Db::connect(&url, 1).await?;

    // fixtures: `total` one-step runs, leased by one registered worker
    let t = Instant::now();
    let spec = json!({"name": "hb", "steps": [
        {"name": "s", "executor_kind": EXECUTOR_KIND, "kind": KIND, "input": {}}]});
    sqlx::query("SELECT durable.submit_run($1) FROM generate_series(1, $2)")
        .bind(&spec)
        .bind(total as i32)
        .execute(db.pool())
        .await?;
    let worker = Uuid::new_v4();
    let wname = "bench-heartbeat";
    db.register_worker(worker, wname, "bench", &json!({}))
        .await?;
    let routes = vec![Route {
        executor_kind: EXECUTOR_KIND.into(),
        kind: KIND.into(),
        labels: Default::default(),
    }];
    let mut leases: Vec<Lease> = Vec::new();
    while leases.len() < total as usize {
        let got = db
            .lease(
                worker,
                wname,
                &routes,
                (total as usize - leases.len()).min(100) as u32,
                TTL,
            )
            .await?;
        if got.is_empty() {
            bail!("only {} of {total} steps could be leased", leases.len());
        }
        leases.extend(got.into_iter().map(|s| s.lease));
    }
    // order as the worker's renewal set might be: not sorted by id
    eprintln!(
        "[fixtures] {total} runs submitted and leased in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    sqlx::query("VACUUM (ANALYZE) durable.step_runs")
        .execute(db.pool())
        .await?;
    let counter = if pg_stat_statements(&db).await {
        Counter::PgStatStatements
    } else {
        Counter::XactCommit
    };
    let counter_name = match counter {
        Counter::PgStatStatements => "pg_stat_statements calls",
        Counter::XactCommit => "pg_stat_database.xact_commit (pg_stat_statements not loaded)",
    };
    println!(
        "parameters  : leases per call {:?} (of {total} leased by one worker, state leased, TTL {} s), {} timed calls per cell after {WARMUP} untimed",
        args.leases, TTL.as_secs(), args.calls
    );
    println!(
        "method      : runtime = Db::heartbeat(worker, leases, ttl) (renews, reports cancel/lost/busy, stamps the\n\
         \x20             worker); plain = {PLAIN_RENEW:?}\n\
         \x20             of the same rows; each on its own pool of 1 connection, one call at a time, timed in this\n\
         \x20             process (client round trip included). Statements per call counted on the server by\n\
         \x20             {counter_name}: the slope between a block of the calls and one of a quarter as many."
    );
    println!();

    let mut cells = Vec::new();
    for &k in &args.leases {
        let subset = &leases[..k as usize];
        for imp in [Imp::Runtime, Imp::Plain] {
            let c = run_cell(imp, &url, counter, worker, subset, args.calls).await?;
            eprintln!(
                "[{k} leases] {:<26} p50 {} ms",
                imp.name(),
                fmt_ms(pct(&c.times, 50.0))
            );
            cells.push(c);
        }
    }
    db.pool().close().await;
    drop_databases(&args.database_url, std::slice::from_ref(&name)).await;
    created.lock().unwrap().clear();
    admin.pool().close().await;

    println!("-- heartbeat latency per call (ms) and server statements per call");
    let mut rows = Vec::new();
    for c in &cells {
        let plain = cells
            .iter()
            .find(|p| p.imp == Imp::Plain && p.leases == c.leases);
        let p50 = pct(&c.times, 50.0);
        rows.push(vec![
            c.imp.name().into(),
            c.leases.to_string(),
            c.times.len().to_string(),
            fmt_ms(p50),
            fmt_ms(pct(&c.times, 95.0)),
            fmt_ms(pct(&c.times, 99.0)),
            fmt_ms(*c.times.iter().max().unwrap_or(&Duration::ZERO)),
            c.statements_per_call
                .map(|s| format!("{s:.2}"))
                .unwrap_or("n/a".into()),
            match (c.imp, plain) {
                (Imp::Runtime, Some(p)) => format!(
                    "{:.1}x",
                    p50.as_secs_f64() / pct(&p.times, 50.0).as_secs_f64().max(1e-9)
                ),
                _ => String::new(),
            },
        ]);
        let setup = json!({"impl": c.imp.name(), "leases": c.leases, "calls": c.times.len(),
                           "connections": 1, "counter": counter_name});
        report.figure("heartbeat p50", ms(p50), "ms", setup.clone());
        report.figure(
            "heartbeat p99",
            ms(pct(&c.times, 99.0)),
            "ms",
            setup.clone(),
        );
        if let Some(s) = c.statements_per_call {
            report.figure("heartbeat statements per call", s, "statements", setup);
        }
    }
    print_table(
        &[
            "impl",
            "leases",
            "calls",
            "p50",
            "p95",
            "p99",
            "max",
            "statements/call",
            "runtime/plain p50",
        ],
        1,
        &rows,
    );
    println!();

    let runtime: Vec<&Cell> = cells.iter().filter(|c| c.imp == Imp::Runtime).collect();
    let most = runtime.iter().max_by_key(|c| c.leases).unwrap();
    // rounded: the server's counters are flushed per backend, a reading that
    // lands before a flush shifts a block by a few transactions
    let stmts = runtime
        .iter()
        .map(|c| c.statements_per_call.unwrap_or(f64::NAN).round())
        .fold(f64::NEG_INFINITY, f64::max);
    report.target(
        "g.heartbeat_statements_per_call",
        &format!(
            "heartbeat: one statement per call whatever the number of leases (largest, rounded, over {:?} leases)",
            args.leases
        ),
        stmts,
        Want::AtMost,
        1.0,
        "statements",
        json!({"leases": args.leases, "counter": counter_name}),
    );
    report.target(
        "g.heartbeat_p50_ms",
        &format!(
            "heartbeat p50 with {} live leases ≤ 5 ms (issue: at 1,000)",
            most.leases
        ),
        ms(pct(&most.times, 50.0)),
        Want::AtMost,
        5.0,
        "ms",
        json!({"leases": most.leases, "calls": most.times.len()}),
    );
    report.print_targets();
    println!("load average at the end: {}", loadavg());
    report.write(args.json_out.as_deref())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
