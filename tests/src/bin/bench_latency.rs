//! Benchmark (not a test): submit → `accepted` latency on an idle worker
//! (issue 7, figure (e)). One run at a time is submitted to an idle
//! in-process worker with one executor; the latency is read from the
//! database's own clock: the run's `SUBMITTED` transition to the step's
//! `ACCEPTED` transition (leased → running), both `clock_timestamp()`.
//! Prints p50/p95/p99/max per executor with the setup, beside the
//! database's limit measured in the same run: the same transitions as plain
//! SQL on a plain table (insert + NOTIFY in one statement; a LISTENing
//! session wakes, claims with SKIP LOCKED and marks the job running), no
//! executor, no history, no triggers.
//!
//! Then, for each persistent executor, the *first* job of a freshly started
//! worker (`--first-runs` workers, each idle for 2 s after it started, then
//! one run submitted): submit → accepted with `warm_processes = 0` (the job
//! starts its process) beside `warm_processes = 1` (the worker started one
//! ahead), the two interleaved.
//!
//! Each one-shot executor (`go`, `python`) is also measured *prestarted*
//! (`<x>-prestarted`): `persistent = true`, `max_jobs_per_process = 1`,
//! `warm_processes = 1`, so every job still gets a fresh process of its own
//! but the worker starts and handshakes it ahead of the job. There "idle"
//! means the worker has its next process ready (the pool's idle gauge is 1)
//! before a run is submitted. The cold one-shot figure stays beside it: it is
//! what a job waits when no process was started ahead.
//!
//!   cargo run --release -p tests --bin bench_latency -- --runs 200 --executors go-persistent,go

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Parser;
use supervisor::db::Db;
use tests::{fast_config, go_demo, python_demo, RunningWorker};

#[derive(Parser)]
struct Args {
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Runs per executor (one at a time).
    #[arg(long, default_value_t = 200)]
    runs: u32,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "go-persistent,python-persistent,go,python"
    )]
    executors: Vec<String>,
    /// Also measure each one-shot executor of --executors prestarted
    /// (`<x>-prestarted`: one job per process, one process started ahead).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prestarted: bool,
    /// Fresh workers per persistent executor and warm_processes setting for
    /// the first-job figure (0: skip it).
    #[arg(long, default_value_t = 10)]
    first_runs: u32,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    // its databases are dropped on an error or Ctrl-C too (benchmark audit:
    // an interrupted run left one behind)
    tests::bench::run_and_clean_up("bench_latency", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: std::sync::Arc<std::sync::Mutex<Vec<String>>>) -> Result<()> {
    let admin = Db::connect(&args.database_url, 1).await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(admin.pool())
        .await?;
    println!("== bench_latency: submit → accepted on an idle worker (database clock)");
    let mut report = tests::bench::Report::new("bench_latency");
    // the machine, PostgreSQL, sessions and build, as every bench prints them
    report.set_setup(tests::bench::print_setup(&admin, &args.database_url).await?);
    report.set_params(
        serde_json::json!({"runs": args.runs, "executors": args.executors,
        "worker": "tests::fast_config, concurrency 1"}),
    );
    println!(
        "setup: PostgreSQL {version} at {}; {} runs per executor, one at a time; worker = tests::fast_config (poll 100 ms, LISTEN/NOTIFY wake-up), concurrency 1; nproc {}",
        supervisor::db::redact_url(&args.database_url),
        args.runs,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    println!(
        "{:<26} {:>5} {:>8} {:>8} {:>8} {:>8} {:>12}",
        "executor", "runs", "p50 ms", "p95 ms", "p99 ms", "max ms", "p50/baseline"
    );
    // the baseline first, in a database of its own
    let mut base = in_own_database(&admin, &args.database_url, &created, |url| async move {
        plain_baseline(&url, args.runs).await
    })
    .await?;
    base.sort_by(|a, b| a.total_cmp(b));
    let base_p50 = pct(&base, 50.0);
    println!(
        "{:<26} {:>5} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>12}",
        "plain SQL (LISTEN/NOTIFY)",
        base.len(),
        base_p50,
        pct(&base, 95.0),
        pct(&base, 99.0),
        base.last().copied().unwrap_or(f64::NAN),
        "1.00"
    );
    let base_setup = serde_json::json!({"baseline": "plain SQL", "runs": base.len(), "concurrency": 1,
        "what": "INSERT + pg_notify in one statement; a LISTENing session wakes, claims the job \
                 (UPDATE … FOR UPDATE SKIP LOCKED) and marks it running; submitted_at and accepted_at \
                 are clock_timestamp(); no executor, history or triggers"});
    for p in [50.0, 95.0, 99.0] {
        report.figure(
            &format!("plain SQL submit→accepted p{p}"),
            pct(&base, p),
            "ms",
            base_setup.clone(),
        );
    }
    let mut cells = args.executors.clone();
    if args.prestarted {
        cells.extend(
            args.executors
                .iter()
                .filter(|w| matches!(w.as_str(), "go" | "python"))
                .map(|w| format!("{w}-prestarted")),
        );
    }
    let mut breakdown = Vec::new();
    for which in &cells {
        let (mut lat, parts) =
            in_own_database(&admin, &args.database_url, &created, |url| async move {
                measure(&url, which, args.runs).await
            })
            .await?;
        lat.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{:<26} {:>5} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>12.2}",
            which,
            lat.len(),
            pct(&lat, 50.0),
            pct(&lat, 95.0),
            pct(&lat, 99.0),
            lat.last().copied().unwrap_or(f64::NAN),
            pct(&lat, 50.0) / base_p50
        );
        let process = if which.ends_with("-prestarted") {
            "a fresh process per job, started ahead (persistent = true, max_jobs_per_process = 1, warm_processes = 1)"
        } else if which.ends_with("-persistent") {
            "a warm process serves every job (persistent = true)"
        } else {
            "a fresh process per job, started by the job (one-shot)"
        };
        let setup = serde_json::json!({"executor": which, "runs": lat.len(), "concurrency": 1,
            "worker": "tests::fast_config (poll 100 ms, LISTEN wake-up)", "idle": true,
            "process": process, "plain_sql_p50_ms": base_p50});
        report.figure(
            "submit→accepted p50 / plain SQL p50",
            pct(&lat, 50.0) / base_p50,
            "ratio",
            setup.clone(),
        );
        report.figure("submit→accepted p95", pct(&lat, 95.0), "ms", setup.clone());
        for (name, v) in [
            ("submit call (client) p50", &parts.submit_call),
            ("SUBMITTED→leased p50", &parts.to_leased),
            ("leased→running p50", &parts.to_running),
        ] {
            report.figure(name, pct(v, 50.0), "ms", setup.clone());
        }
        breakdown.push((which.clone(), parts));
        for (p, limit) in [(50.0, 5.0), (99.0, 25.0)] {
            report.figure(
                &format!("submit→accepted p{p}"),
                pct(&lat, p),
                "ms",
                setup.clone(),
            );
            report.target(
                &format!("e.submit_accepted_p{p}_{which}"),
                &format!("submit → accepted p{p} ≤ {limit} ms on an idle worker ({which})"),
                pct(&lat, p),
                tests::bench::Want::AtMost,
                limit,
                "ms",
                setup.clone(),
            );
        }
    }
    println!("   p50/baseline = the cell's p50 over the plain-SQL p50 of this run");
    println!();
    println!("-- where the time goes (p50 of each part, ms; the parts' p50s need not add up to the whole's)");
    println!(
        "{:<26} {:>14} {:>18} {:>16}",
        "executor", "submit call", "SUBMITTED→leased", "leased→running"
    );
    for (which, parts) in &breakdown {
        println!(
            "{:<26} {:>14.2} {:>18.2} {:>16.2}",
            which,
            pct(&parts.submit_call, 50.0),
            pct(&parts.to_leased, 50.0),
            pct(&parts.to_running, 50.0)
        );
    }
    println!("   submit call: Db::submit as the client timed it (durable.submit_run; its history row SUBMITTED,");
    println!("   where the figure starts, is written partway through it). SUBMITTED→leased: the rest of the");
    println!("   submit, its commit and NOTIFY, the worker's wake-up and its lease statement (each history row's");
    println!("   time is clock_timestamp() when its statement's trigger ran). leased→running: the lease's commit,");
    println!("   the job to the executor (a process started for it, one-shot), its answer, the ledger's start write.");
    first_jobs(args, &admin, &mut report, &created).await?;
    println!();
    report.print_targets();
    report.write(args.json_out.as_deref())?;
    Ok(())
}

/// Runs `f` on the URL of an empty database of its own, dropped afterwards
/// whatever `f` returned.
async fn in_own_database<T, F, Fut>(
    admin: &Db,
    admin_url: &str,
    created: &std::sync::Mutex<Vec<String>>,
    f: F,
) -> Result<T>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let (name, url) = tests::bench::empty_database(admin, admin_url, "bench_l", created).await?;
    let res = f(url).await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(admin.pool())
        .await;
    res
}

/// The first job of a fresh worker, without and with a warm process.
async fn first_jobs(
    args: &Args,
    admin: &Db,
    report: &mut tests::bench::Report,
    created: &std::sync::Mutex<Vec<String>>,
) -> Result<()> {
    let persistent: Vec<&String> = args
        .executors
        .iter()
        .filter(|w| w.ends_with("-persistent"))
        .collect();
    if args.first_runs == 0 || persistent.is_empty() {
        return Ok(());
    }
    println!();
    println!(
        "-- the first job of a fresh worker: {} workers per cell, each idle 2 s after its start, then one run; warm_processes 0 and 1 interleaved",
        args.first_runs
    );
    println!(
        "{:<18} {:>14} {:>5} {:>8} {:>8}",
        "executor", "warm_processes", "runs", "p50 ms", "max ms"
    );
    for which in persistent {
        let mut lat: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..args.first_runs {
            for warm in [0u32, 1] {
                let ms = in_own_database(admin, &args.database_url, created, |url| async move {
                    first_job(&url, which, warm).await
                })
                .await?;
                lat[warm as usize].push(ms);
            }
        }
        for (warm, l) in lat.iter_mut().enumerate() {
            l.sort_by(|a, b| a.total_cmp(b));
            println!(
                "{:<18} {:>14} {:>5} {:>8.2} {:>8.2}",
                which,
                warm,
                l.len(),
                pct(l, 50.0),
                l.last().copied().unwrap_or(f64::NAN)
            );
            report.figure(
                "first job submit→accepted p50",
                pct(l, 50.0),
                "ms",
                serde_json::json!({"executor": which, "warm_processes": warm, "workers": l.len(),
                    "idle_after_start_ms": 2000, "concurrency": 1}),
            );
        }
    }
    Ok(())
}

/// A fresh worker, idle for 2 s, then one run: its submit → accepted.
async fn first_job(url: &str, which: &str, warm: u32) -> Result<f64> {
    let (db, w) = start(url, which, warm).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spec = tests::one_step(
        "first",
        which.trim_end_matches("-persistent"),
        "demo.echo",
        serde_json::json!(0),
    );
    let run = db.submit(&spec).await?;
    wait_succeeded(&db, run).await?;
    let ms = accepted_after_submit(&db, run).await?;
    w.shutdown().await;
    Ok(ms)
}

/// A migrated database and a worker with one executor of `which`, concurrency 1.
async fn start(url: &str, which: &str, warm: u32) -> Result<(Db, RunningWorker)> {
    let db = Db::connect(url, 4).await?;
    db.migrate().await?;
    let mut e = match base_of(which) {
        "go" => go_demo("go", &[], Some(&["demo.echo"])),
        "python" => python_demo("python", &[], Some(&["demo.echo"])),
        other => bail!("unknown executor {other}"),
    };
    e.persistent = which.ends_with("-persistent");
    e.concurrency = 1;
    e.warm_processes = warm;
    if which.ends_with("-prestarted") {
        // a fresh process per job, started ahead of it
        e.persistent = true;
        e.max_jobs_per_process = Some(1);
        e.warm_processes = 1;
    }
    let w = RunningWorker::start(Db::connect(url, 4).await?, fast_config(vec![e])).await;
    Ok((db, w))
}

async fn wait_succeeded(db: &Db, run: uuid::Uuid) -> Result<()> {
    loop {
        let st: String =
            sqlx::query_scalar("SELECT state FROM durable.workflow_runs WHERE id = $1")
                .bind(run)
                .fetch_one(db.pool())
                .await?;
        if st == "succeeded" {
            return Ok(());
        }
        if st == "failed" || st == "cancelled" {
            bail!("run {run} ended {st}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The run's SUBMITTED transition to its step's ACCEPTED one, by the database's clock.
async fn accepted_after_submit(db: &Db, run: uuid::Uuid) -> Result<f64> {
    Ok(sqlx::query_scalar(
        "SELECT (extract(epoch FROM (a.at - s.at)) * 1000)::float8
           FROM durable.transitions s, durable.transitions a
          WHERE s.run_id = $1 AND s.step_run_id IS NULL AND s.reason = 'SUBMITTED'
            AND a.run_id = $1 AND a.to_state = 'running' AND a.step_run_id IS NOT NULL",
    )
    .bind(run)
    .fetch_one(db.pool())
    .await?)
}

/// The demo executor of a cell: `go` or `python`.
fn base_of(which: &str) -> &str {
    which
        .trim_end_matches("-persistent")
        .trim_end_matches("-prestarted")
}

/// Waits (at most 5 s) until a prestarted cell's next process is ready.
async fn next_process_ready(which: &str) -> Result<()> {
    if !which.ends_with("-prestarted") {
        return Ok(());
    }
    let gauge = format!(
        "durable_executor_idle_processes{{executor=\"{}\"}}",
        base_of(which)
    );
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while tests::metric(&supervisor::metrics::render(), &gauge).unwrap_or(0.0) < 1.0 {
        if std::time::Instant::now() > until {
            bail!("{which}: no process was started ahead within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}

/// Where one run's submit → accepted went, in ms: the submit call as its
/// client timed it, then by the database clock its `SUBMITTED` history row →
/// the step's `leased` row (the rest of the submit, its commit, the worker's
/// wake-up and its lease statement), and `leased` → `running` (the job to
/// the executor, its answer, the ledger's start write).
#[derive(Default)]
struct Parts {
    submit_call: Vec<f64>,
    to_leased: Vec<f64>,
    to_running: Vec<f64>,
}

impl Parts {
    fn sort(&mut self) {
        for v in [
            &mut self.submit_call,
            &mut self.to_leased,
            &mut self.to_running,
        ] {
            v.sort_by(|a, b| a.total_cmp(b));
        }
    }
}

async fn measure(url: &str, which: &str, runs: u32) -> Result<(Vec<f64>, Parts)> {
    let (db, w) = start(url, which, 0).await?;
    let base = base_of(which);
    let mut out = Vec::with_capacity(runs as usize);
    let mut parts = Parts::default();
    for i in 0..runs + 5 {
        next_process_ready(which).await?;
        let spec = tests::one_step(&format!("l{i}"), base, "demo.echo", serde_json::json!(i));
        let called = std::time::Instant::now();
        let run = db.submit(&spec).await?;
        let submit_call = called.elapsed().as_secs_f64() * 1e3;
        // wait until it is done, so the worker is idle again
        wait_succeeded(&db, run).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if i < 5 {
            continue; // warm-up: connections open, the warm process started
        }
        out.push(accepted_after_submit(&db, run).await?);
        let (to_leased, to_running): (f64, f64) = sqlx::query_as(
            "SELECT (extract(epoch FROM (l.at - s.at)) * 1000)::float8,
                    (extract(epoch FROM (a.at - l.at)) * 1000)::float8
               FROM durable.transitions s, durable.transitions l, durable.transitions a
              WHERE s.run_id = $1 AND s.step_run_id IS NULL AND s.reason = 'SUBMITTED'
                AND l.run_id = $1 AND l.to_state = 'leased' AND l.step_run_id IS NOT NULL
                AND a.run_id = $1 AND a.to_state = 'running' AND a.step_run_id IS NOT NULL",
        )
        .bind(run)
        .fetch_one(db.pool())
        .await?;
        parts.submit_call.push(submit_call);
        parts.to_leased.push(to_leased);
        parts.to_running.push(to_running);
    }
    w.shutdown().await;
    parts.sort();
    Ok((out, parts))
}

/// The database's limit for submit → accepted, measured the same way: one
/// job at a time on a plain table, inserted with its NOTIFY in one statement;
/// a session LISTENing wakes, claims it (`FOR UPDATE SKIP LOCKED`) and marks
/// it running. Milliseconds from `submitted_at` to `accepted_at`, both
/// `clock_timestamp()` on the database.
async fn plain_baseline(url: &str, runs: u32) -> Result<Vec<f64>> {
    let db = tests::bench::plain_db(url, 2).await?;
    sqlx::query(
        "CREATE TABLE public.plain_latency (id bigint PRIMARY KEY, state text NOT NULL,
             submitted_at timestamptz NOT NULL DEFAULT clock_timestamp(), accepted_at timestamptz)",
    )
    .execute(db.pool())
    .await?;
    let claimer = tests::bench::plain_db(url, 1).await?;
    let mut listener = sqlx::postgres::PgListener::connect(url).await?;
    listener.listen("plain_latency").await?;
    let worker = tokio::spawn(async move {
        loop {
            let n = listener.recv().await?;
            let ids: Vec<i64> = sqlx::query_scalar(
                "UPDATE public.plain_latency j SET state = 'leased'
                  WHERE j.id IN (SELECT id FROM public.plain_latency WHERE state = 'pending'
                                  ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
                 RETURNING j.id",
            )
            .fetch_all(claimer.pool())
            .await?;
            for id in ids {
                sqlx::query(
                    "UPDATE public.plain_latency SET state = 'running', accepted_at = clock_timestamp()
                      WHERE id = $1 AND state = 'leased'",
                )
                .bind(id)
                .execute(claimer.pool())
                .await?;
            }
            if n.payload() == "stop" {
                return anyhow::Ok(());
            }
        }
    });
    let mut out = Vec::with_capacity(runs as usize);
    for i in 0..i64::from(runs) + 5 {
        sqlx::query(
            "WITH j AS (INSERT INTO public.plain_latency (id, state) VALUES ($1, 'pending') RETURNING id)
             SELECT pg_notify('plain_latency', j.id::text) FROM j",
        )
        .bind(i)
        .execute(db.pool())
        .await?;
        // as the worker cells: wait until it is accepted, then idle again
        let until = std::time::Instant::now() + Duration::from_secs(10);
        let ms = loop {
            let ms: Option<f64> = sqlx::query_scalar(
                "SELECT (extract(epoch FROM (accepted_at - submitted_at)) * 1000)::float8
                   FROM public.plain_latency WHERE id = $1",
            )
            .bind(i)
            .fetch_one(db.pool())
            .await?;
            if let Some(ms) = ms {
                break ms;
            }
            if std::time::Instant::now() > until || worker.is_finished() {
                bail!("plain baseline: job {i} was not accepted within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        if i >= 5 {
            out.push(ms); // the first five warm the connections up
        }
    }
    sqlx::query("SELECT pg_notify('plain_latency', 'stop')")
        .execute(db.pool())
        .await?;
    match tokio::time::timeout(Duration::from_secs(10), worker).await {
        Ok(joined) => joined??,
        Err(_) => bail!("plain baseline: the listening session did not stop"),
    }
    db.pool().close().await;
    Ok(out)
}
