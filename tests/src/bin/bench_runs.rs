//! Benchmark (not a test; run through `scripts/bench`): big runs (issue 7,
//! figure (i)). One in-process worker (`tests::RunningWorker`,
//! `tests::fast_config`) with the persistent Go demo executor runs, one after
//! the other:
//!
//! * one run of N parallel `demo.echo` steps (no dependencies), beside M
//!   one-step runs submitted together (the same work as separate runs);
//! * one run of a chain of N steps (each `depends_on` the previous), beside
//!   L one-step runs submitted one at a time, each after the previous
//!   succeeded (the same sequence as separate runs).
//!
//! Times are on the database clock: a run's `created_at` (its submit
//! transaction) to its `finished_at` (the transaction of its last step's
//! terminal). Cost per step = that time / steps; for the M runs submitted
//! together, first `created_at` to last `finished_at`, / M.
//!
//! A fresh database `bench_i_*` is created and dropped at the end (also on
//! error and on Ctrl-C).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use supervisor::db::Db;
use tests::bench::*;
use tests::{fast_config, go_demo, one_step, RunningWorker};
use uuid::Uuid;

#[derive(Parser, Debug, Clone)]
#[command(about = "A run of N parallel steps and a chain of N steps vs one-step runs")]
struct Args {
    /// Server where the benchmark may create and drop a database (bench_i_*).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Steps of the parallel run and of the chain.
    #[arg(long, default_value_t = 1000)]
    steps: u32,
    /// One-step runs submitted together (the parallel run's baseline).
    #[arg(long, default_value_t = 1000)]
    bulk_runs: u32,
    /// One-step runs submitted one after the other (the chain's baseline).
    #[arg(long, default_value_t = 200)]
    sequential_runs: u32,
    /// Executor concurrency of the worker.
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Give up on one measurement after this long.
    #[arg(long, default_value_t = 900)]
    timeout_secs: u64,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

const POLL: Duration = Duration::from_millis(5);

fn many_steps(name: &str, n: u32, chain: bool) -> Value {
    let steps: Vec<Value> = (0..n)
        .map(|i| {
            let mut s = json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "demo.echo",
                               "input": {"i": i}});
            if chain && i > 0 {
                s["depends_on"] = json!([format!("s{}", i - 1)]);
            }
            s
        })
        .collect();
    json!({"name": name, "steps": steps})
}

/// Waits until every run of `ids` is terminal; fails unless all succeeded.
async fn wait_all(db: &Db, ids: &[Uuid], timeout: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        let (open, bad): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state IN ('pending', 'running')),
                    count(*) FILTER (WHERE state IN ('failed', 'cancelled'))
               FROM durable.workflow_runs WHERE id = ANY($1)",
        )
        .bind(ids)
        .fetch_one(db.pool())
        .await?;
        if bad > 0 {
            bail!("{bad} of {} runs did not succeed", ids.len());
        }
        if open == 0 {
            return Ok(());
        }
        if t.elapsed() > timeout {
            bail!("{open} of {} runs still open after {timeout:?}", ids.len());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// First created_at to last finished_at of the runs, in seconds (database clock).
async fn span(db: &Db, ids: &[Uuid]) -> Result<f64> {
    Ok(sqlx::query_scalar(
        "SELECT extract(epoch FROM max(finished_at) - min(created_at))::float8
           FROM durable.workflow_runs WHERE id = ANY($1)",
    )
    .bind(ids)
    .fetch_one(db.pool())
    .await?)
}

struct Measured {
    what: String,
    runs: u32,
    steps: u32,
    secs: f64,
    /// per-run times (sequential one-step runs only)
    per_run: Vec<Duration>,
    submit_secs: f64,
}

impl Measured {
    fn per_step_ms(&self) -> f64 {
        self.secs * 1e3 / self.steps.max(1) as f64
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    tests::init_tracing();
    run_and_clean_up("bench_runs", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: Arc<Mutex<Vec<String>>>) -> Result<()> {
    if args.steps < 2 || args.bulk_runs == 0 || args.sequential_runs == 0 || args.concurrency == 0 {
        bail!("--steps must be at least 2; --bulk-runs, --sequential-runs, --concurrency positive");
    }
    let timeout = Duration::from_secs(args.timeout_secs);
    let admin = Db::connect(&args.database_url, 1)
        .await
        .context("connecting to DATABASE_URL")?;
    let mut report = Report::new("bench_runs");
    println!(
        "== bench_runs: a run of {n} parallel steps and a chain of {n} steps vs one-step runs (issue 7 (i))",
        n = args.steps
    );
    report.set_setup(print_setup(&admin, &args.database_url).await?);
    let mut ecfg = go_demo("go", &[], Some(&["demo.echo"]));
    ecfg.persistent = true;
    ecfg.concurrency = args.concurrency;
    let mut wcfg = fast_config(vec![ecfg]);
    // the pool a worker's config must have at this concurrency
    wcfg.db_max_connections = wcfg.db_max_connections.max(wcfg.min_db_connections());
    let setup = json!({"executor": "go-persistent", "kind": "demo.echo", "concurrency": args.concurrency,
        "worker": "in-process RunningWorker, tests::fast_config", "poll_interval_ms": wcfg.poll_interval_ms,
        "steps": args.steps, "bulk_runs": args.bulk_runs, "sequential_runs": args.sequential_runs});
    report.set_params(setup.clone());
    println!(
        "parameters  : {} steps per big run; baselines {} one-step runs submitted together and {} one after the\n\
         \x20             other; one in-process worker (tests::fast_config, poll {} ms, LISTEN wake-up) with the\n\
         \x20             persistent Go demo executor, concurrency {}, demo.echo",
        args.steps, args.bulk_runs, args.sequential_runs, wcfg.poll_interval_ms, args.concurrency
    );
    println!(
        "method      : time = run created_at (submit transaction) → finished_at (last terminal), database\n\
         \x20             clock; for runs submitted together (one statement, unnest of the specs) first created_at\n\
         \x20             → last finished_at. Cost per step\n\
         \x20             = time / steps. Each measurement starts with the worker idle and its executors warm."
    );
    println!();

    let (name, url) = fresh_database(&admin, &args.database_url, "bench_i", &created).await?;
    let db = Db::connect(&url, 2).await?;
    let worker =
        RunningWorker::start(Db::connect(&url, wcfg.db_max_connections).await?, wcfg).await;
    let res = measure_all(&db, args, timeout).await;
    worker.shutdown().await;
    db.pool().close().await;
    drop_databases(&args.database_url, std::slice::from_ref(&name)).await;
    created.lock().unwrap().clear();
    admin.pool().close().await;
    let m = res?;

    println!("-- submit → run succeeded (database clock)");
    let rows: Vec<Vec<String>> = m
        .iter()
        .map(|x| {
            vec![
                x.what.clone(),
                x.runs.to_string(),
                x.steps.to_string(),
                format!("{:.2}", x.secs),
                format!("{:.0}", x.steps as f64 / x.secs),
                format!("{:.2}", x.per_step_ms()),
                if x.per_run.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{} / {}",
                        fmt_ms(pct(&x.per_run, 50.0)),
                        fmt_ms(pct(&x.per_run, 99.0))
                    )
                },
                format!("{:.1}", x.submit_secs * 1e3),
            ]
        })
        .collect();
    print_table(
        &[
            "workload",
            "runs",
            "steps",
            "secs",
            "steps/s",
            "ms/step",
            "per run p50 / p99 ms",
            "submit ms (client, all)",
        ],
        1,
        &rows,
    );
    println!("   targets below: each big run's ms/step ÷ the ms/step of its one-step-run baseline (≤ 2).");
    println!();
    for x in &m {
        report.figure(
            &format!("{} ms/step", x.what),
            x.per_step_ms(),
            "ms",
            json!({"runs": x.runs, "steps": x.steps, "secs": x.secs, "concurrency": args.concurrency}),
        );
    }
    let (par, bulk, chain, seq) = (&m[0], &m[1], &m[2], &m[3]);
    report.target(
        "i.parallel_cost_ratio",
        &format!(
            "run of {} parallel steps: cost per step ≤ 2× that of {} one-step runs submitted together",
            par.steps, bulk.runs
        ),
        par.per_step_ms() / bulk.per_step_ms(),
        Want::AtMost,
        2.0,
        "x",
        json!({"run_ms_per_step": par.per_step_ms(), "baseline_ms_per_step": bulk.per_step_ms()}),
    );
    report.target(
        "i.chain_cost_ratio",
        &format!(
            "chain of {} steps: cost per step ≤ 2× a one-step run's (of {} one after the other)",
            chain.steps, seq.runs
        ),
        chain.per_step_ms() / seq.per_step_ms(),
        Want::AtMost,
        2.0,
        "x",
        json!({"run_ms_per_step": chain.per_step_ms(), "baseline_ms_per_step": seq.per_step_ms()}),
    );
    report.print_targets();
    println!("load average at the end: {}", loadavg());
    report.write(args.json_out.as_deref())
}

async fn measure_all(db: &Db, args: &Args, timeout: Duration) -> Result<Vec<Measured>> {
    // warm-up: connections, prepared statements, every warm executor process
    let mut warm = Vec::new();
    for i in 0..(4 * args.concurrency).max(8) {
        warm.push(
            db.submit(&one_step(&format!("warm-{i}"), "go", "demo.echo", json!(i)))
                .await?,
        );
    }
    wait_all(db, &warm, timeout).await?;
    let mut out = Vec::new();

    // the run of N parallel steps
    let t = Instant::now();
    let id = db
        .submit(&many_steps("parallel", args.steps, false))
        .await?;
    let submit_secs = t.elapsed().as_secs_f64();
    wait_all(db, &[id], timeout).await?;
    out.push(Measured {
        what: format!("one run of {} parallel steps", args.steps),
        runs: 1,
        steps: args.steps,
        secs: span(db, &[id]).await?,
        per_run: Vec::new(),
        submit_secs,
    });
    eprintln!("[parallel] {:.2} s", out[0].secs);

    // baseline: M one-step runs submitted together, in one statement (as the
    // big run is one submit_run call)
    let specs: Vec<Value> = (0..args.bulk_runs)
        .map(|i| one_step(&format!("bulk-{i}"), "go", "demo.echo", json!({"i": i})))
        .collect();
    let t = Instant::now();
    let ids: Vec<Uuid> =
        sqlx::query_scalar("SELECT durable.submit_run(s) FROM unnest($1::jsonb[]) AS s")
            .bind(&specs)
            .fetch_all(db.pool())
            .await?;
    let submit_secs = t.elapsed().as_secs_f64();
    wait_all(db, &ids, timeout).await?;
    out.push(Measured {
        what: format!("{} one-step runs submitted together", args.bulk_runs),
        runs: args.bulk_runs,
        steps: args.bulk_runs,
        secs: span(db, &ids).await?,
        per_run: Vec::new(),
        submit_secs,
    });
    eprintln!("[bulk] {:.2} s", out[1].secs);

    // the chain of N steps
    let t = Instant::now();
    let id = db.submit(&many_steps("chain", args.steps, true)).await?;
    let submit_secs = t.elapsed().as_secs_f64();
    wait_all(db, &[id], timeout).await?;
    out.push(Measured {
        what: format!("one chain of {} steps", args.steps),
        runs: 1,
        steps: args.steps,
        secs: span(db, &[id]).await?,
        per_run: Vec::new(),
        submit_secs,
    });
    eprintln!("[chain] {:.2} s", out[2].secs);

    // baseline: L one-step runs, each after the previous succeeded
    let mut per_run = Vec::with_capacity(args.sequential_runs as usize);
    let mut submit_secs = 0.0;
    for i in 0..args.sequential_runs {
        let t = Instant::now();
        let id = db
            .submit(&one_step(
                &format!("seq-{i}"),
                "go",
                "demo.echo",
                json!({"i": i}),
            ))
            .await?;
        submit_secs += t.elapsed().as_secs_f64();
        wait_all(db, &[id], timeout).await?;
        per_run.push(Duration::from_secs_f64(span(db, &[id]).await?.max(0.0)));
    }
    let total: Duration = per_run.iter().sum();
    out.push(Measured {
        what: format!("{} one-step runs one after the other", args.sequential_runs),
        runs: args.sequential_runs,
        steps: args.sequential_runs,
        secs: total.as_secs_f64(),
        per_run,
        submit_secs,
    });
    eprintln!("[sequential] {:.2} s", out[3].secs);
    Ok(out)
}
