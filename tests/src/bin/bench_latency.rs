//! Benchmark (not a test): submit → `accepted` latency on an idle worker
//! (issue 7, figure (e)). One run at a time is submitted to an idle
//! in-process worker with one executor; the latency is read from the
//! database's own clock: the run's `SUBMITTED` transition to the step's
//! `ACCEPTED` transition (leased → running), both `clock_timestamp()`.
//! Prints p50/p95/p99/max per executor with the setup.
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
async fn main() -> Result<()> {
    let args = Args::parse();
    let admin = Db::connect(&args.database_url, 1).await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(admin.pool())
        .await?;
    println!("== bench_latency: submit → accepted on an idle worker (database clock)");
    let mut report = tests::bench::Report::new("bench_latency");
    report.set_setup(tests::bench::setup_json(&admin, &args.database_url).await?);
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
        "{:<18} {:>5} {:>8} {:>8} {:>8} {:>8}",
        "executor", "runs", "p50 ms", "p95 ms", "p99 ms", "max ms"
    );
    for which in &args.executors {
        let name = format!("bench_l_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(admin.pool())
            .await?;
        let url = tests::db_url(&args.database_url, &name);
        let res = measure(&url, which, args.runs).await;
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(admin.pool())
            .await;
        let mut lat = res?;
        lat.sort_by(|a, b| a.total_cmp(b));
        println!(
            "{:<18} {:>5} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
            which,
            lat.len(),
            pct(&lat, 50.0),
            pct(&lat, 95.0),
            pct(&lat, 99.0),
            lat.last().copied().unwrap_or(f64::NAN)
        );
        let setup = serde_json::json!({"executor": which, "runs": lat.len(), "concurrency": 1,
            "worker": "tests::fast_config (poll 100 ms, LISTEN wake-up)", "idle": true});
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
    println!();
    report.print_targets();
    report.write(args.json_out.as_deref())?;
    Ok(())
}

async fn measure(url: &str, which: &str, runs: u32) -> Result<Vec<f64>> {
    let db = Db::connect(url, 4).await?;
    db.migrate().await?;
    let base = which.trim_end_matches("-persistent");
    let mut e = match base {
        "go" => go_demo("go", &[], Some(&["demo.echo"])),
        "python" => python_demo("python", &[], Some(&["demo.echo"])),
        other => bail!("unknown executor {other}"),
    };
    e.persistent = which.ends_with("-persistent");
    e.concurrency = 1;
    let w = RunningWorker::start(Db::connect(url, 4).await?, fast_config(vec![e])).await;
    let mut out = Vec::with_capacity(runs as usize);
    for i in 0..runs + 5 {
        let spec = tests::one_step(&format!("l{i}"), base, "demo.echo", serde_json::json!(i));
        let run = db.submit(&spec).await?;
        // wait until it is done, so the worker is idle again
        loop {
            let st: String =
                sqlx::query_scalar("SELECT state FROM durable.workflow_runs WHERE id = $1")
                    .bind(run)
                    .fetch_one(db.pool())
                    .await?;
            if st == "succeeded" {
                break;
            }
            if st == "failed" || st == "cancelled" {
                bail!("run {run} ended {st}");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        if i < 5 {
            continue; // warm-up: connections open, the warm process started
        }
        let ms: f64 = sqlx::query_scalar(
            "SELECT (extract(epoch FROM (a.at - s.at)) * 1000)::float8
               FROM durable.transitions s, durable.transitions a
              WHERE s.run_id = $1 AND s.step_run_id IS NULL AND s.reason = 'SUBMITTED'
                AND a.run_id = $1 AND a.to_state = 'running' AND a.step_run_id IS NOT NULL",
        )
        .bind(run)
        .fetch_one(db.pool())
        .await?;
        out.push(ms);
    }
    w.shutdown().await;
    Ok(out)
}
