//! Benchmark (not a test; run through `scripts/bench`): the supervisor's
//! memory (issue 7, figure (h)). A real `supervisor worker` process (the
//! binary built beside this one, `target/<profile>/supervisor`) with the
//! worker's default timings and one Go demo executor of concurrency C (500):
//!
//! 1. idle: RSS of the started worker with nothing to do (the baseline);
//! 2. C concurrent sleeping steps: C one-step `demo.sleep` runs submitted at
//!    once; RSS (VmRSS, VmHWM from /proc/PID/status) sampled while all C are
//!    running, until they all succeed;
//! 3. soak: for `--soak-secs`, runs of shorter sleeps are submitted so that
//!    about 1.5·C are always open (C running, the rest pending); RSS printed
//!    at the start, every `--report-secs` and at the end (growth).
//!
//! RSS is the supervisor's own (its executor children are separate
//! processes and not counted). A fresh database `bench_r_*` is created and
//! dropped at the end (also on error and on Ctrl-C).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use supervisor::config::WorkerConfig;
use supervisor::db::Db;
use tests::bench::*;
use tests::{go_demo, WorkerProcess};

#[derive(Parser, Debug, Clone)]
#[command(about = "Supervisor RSS: idle, with C concurrent sleeping steps, and over a soak")]
struct Args {
    /// Server where the benchmark may create and drop a database (bench_r_*).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Concurrent sleeping steps (the executor's concurrency).
    #[arg(long, default_value_t = 500)]
    concurrency: u32,
    /// go-persistent (warm processes, one job at a time each) or go (one process per attempt).
    #[arg(long, default_value = "go-persistent")]
    executor: String,
    /// How long each step of phase 2 sleeps: long enough for all C to be
    /// running at once.
    #[arg(long, default_value_t = 40_000)]
    sleep_ms: u64,
    /// Soak duration (0 skips the soak).
    #[arg(long, default_value_t = 600)]
    soak_secs: u64,
    /// How long each soak step sleeps.
    #[arg(long, default_value_t = 5_000)]
    soak_sleep_ms: u64,
    /// RSS lines during the soak every this many seconds.
    #[arg(long, default_value_t = 60)]
    report_secs: u64,
    /// Idle time before the baseline reading.
    #[arg(long, default_value_t = 3)]
    idle_secs: u64,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

const POLL: Duration = Duration::from_millis(250);
/// Soak: the RSS at the end may exceed the RSS at the start by this share.
const SOAK_GROWTH_ALLOWED: f64 = 0.10;

#[derive(Clone, Copy, Debug, Default)]
struct Mem {
    rss_kb: u64,
    hwm_kb: u64,
}

fn mem(pid: i32) -> Result<Mem> {
    Ok(Mem {
        rss_kb: proc_status_kb(pid, "VmRSS").context("the worker's VmRSS (has it exited?)")?,
        hwm_kb: proc_status_kb(pid, "VmHWM").unwrap_or(0),
    })
}

/// /proc's kB (KiB) as MB of 10^6 bytes, the unit the targets are stated
/// in (benchmark audit: KiB / 1024 is MiB, 4.9 % lenient against "64 MB").
fn mb(kb: u64) -> f64 {
    kb as f64 * 1024.0 / 1e6
}

async fn counts(db: &Db) -> Result<(i64, i64, i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state IN ('leased', 'running')),
                count(*) FILTER (WHERE state = 'running'),
                count(*) FILTER (WHERE state IN ('pending', 'retryable_failed')),
                count(*) FILTER (WHERE state IN ('terminal_failed', 'cancelled'))
           FROM durable.step_runs",
    )
    .fetch_one(db.pool())
    .await?)
}

async fn submit_sleeps(db: &Db, n: i64, ms: u64, tag: &str) -> Result<()> {
    let spec = json!({"name": tag, "steps": [{"name": "s", "executor_kind": "go",
        "kind": "demo.sleep", "input": {"ms": ms, "steps": 1}}]});
    sqlx::query("SELECT durable.submit_run($1) FROM generate_series(1, $2)")
        .bind(&spec)
        .bind(n)
        .execute(db.pool())
        .await?;
    Ok(())
}

fn check_alive(w: &mut WorkerProcess) -> Result<()> {
    if let Some(st) = w.child.try_wait()? {
        bail!("the worker exited ({st}); stderr: {}", w.stderr());
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    run_and_clean_up("bench_rss", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: Arc<Mutex<Vec<String>>>) -> Result<()> {
    let c = args.concurrency;
    if c == 0 {
        bail!("--concurrency must be positive");
    }
    let mut ecfg = go_demo("go", &[], Some(&["demo.sleep"]));
    ecfg.concurrency = c;
    ecfg.persistent = match args.executor.as_str() {
        "go-persistent" => true,
        "go" => false,
        other => bail!("--executor {other:?}: go-persistent or go"),
    };
    let mut wcfg = WorkerConfig {
        executors: vec![ecfg],
        ..WorkerConfig::default()
    };
    wcfg.db_max_connections = c + 1;
    let admin = Db::connect(&args.database_url, 1)
        .await
        .context("connecting to DATABASE_URL")?;
    let mut report = Report::new("bench_rss");
    println!(
        "== bench_rss: supervisor RSS, idle / {c} concurrent sleeping steps / soak (issue 7 (h))"
    );
    report.set_setup(print_setup(&admin, &args.database_url).await?);
    let bin = tests::supervisor_bin();
    let setup = json!({
        "supervisor": bin.display().to_string(), "executor": args.executor, "concurrency": c,
        "db_max_connections": wcfg.db_max_connections, "lease_ttl_ms": wcfg.lease_ttl_ms,
        "heartbeat_interval_ms": wcfg.heartbeat_interval_ms, "poll_interval_ms": wcfg.poll_interval_ms,
        "sleep_ms": args.sleep_ms, "soak_secs": args.soak_secs, "soak_sleep_ms": args.soak_sleep_ms,
    });
    report.set_params(setup.clone());
    println!(
        "parameters  : {} worker (WorkerConfig defaults: lease TTL {} ms, heartbeat {} ms, poll {} ms), db_max_connections {},\n\
         \x20             one executor `{}` (Go demo, demo.sleep) with concurrency {c}; phase 2 steps sleep {} ms;\n\
         \x20             soak {} s of {} ms sleeps kept at ~1.5·{c} open runs, RSS every {} s",
        bin.display(),
        wcfg.lease_ttl_ms,
        wcfg.heartbeat_interval_ms,
        wcfg.poll_interval_ms,
        wcfg.db_max_connections,
        args.executor,
        args.sleep_ms,
        args.soak_secs,
        args.soak_sleep_ms,
        args.report_secs
    );
    println!(
        "method      : RSS = VmRSS of the supervisor process (/proc/PID/status; its executor children not\n\
         \x20             included), peak = VmHWM; sampled every {} ms. Runs are submitted with\n\
         \x20             `SELECT durable.submit_run(spec) FROM generate_series(1, n)`.",
        POLL.as_millis()
    );
    println!();

    let (name, url) = fresh_database(&admin, &args.database_url, "bench_r", &created).await?;
    let db = Db::connect(&url, 2).await?;
    let mut worker = WorkerProcess::spawn(&url, &wcfg);
    let pid = worker.child.id() as i32;

    // 1. idle
    let t = Instant::now();
    loop {
        check_alive(&mut worker)?;
        let up: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durable.workers WHERE pid = $1 AND stopped_at IS NULL",
        )
        .bind(pid)
        .fetch_one(db.pool())
        .await?;
        if up > 0 {
            break;
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!(
                "the worker did not register within 60 s; stderr: {}",
                worker.stderr()
            );
        }
        tokio::time::sleep(POLL).await;
    }
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let idle = mem(pid)?;
    eprintln!("[idle] RSS {:.1} MB", mb(idle.rss_kb));

    // 2. C concurrent sleeping steps
    let t0 = Instant::now();
    submit_sleeps(&db, c as i64, args.sleep_ms, "rss").await?;
    let mut all_running_after = None;
    let mut max_live = 0i64;
    let mut during: Vec<Mem> = Vec::new();
    let timeout = Duration::from_millis(args.sleep_ms) + Duration::from_secs(300);
    loop {
        check_alive(&mut worker)?;
        let m = mem(pid)?;
        let (live, running, pending, bad) = counts(&db).await?;
        if bad > 0 {
            bail!(
                "{bad} steps failed or were cancelled; worker stderr: {}",
                worker.stderr()
            );
        }
        // the samples at the most steps running at once (all C, unless
        // some were still starting or finishing at every sample)
        if running > max_live {
            max_live = running;
            during.clear();
        }
        if running == max_live && running > 0 {
            during.push(m);
        }
        if running >= c as i64 {
            all_running_after.get_or_insert(t0.elapsed());
        }
        if live == 0 && pending == 0 {
            break;
        }
        if t0.elapsed() > timeout {
            bail!("phase 2 did not finish within {timeout:?} ({live} live, {pending} pending)");
        }
        tokio::time::sleep(POLL).await;
    }
    let phase2_secs = t0.elapsed().as_secs_f64();
    let after2 = mem(pid)?;
    let peak_running = during.iter().map(|m| m.rss_kb).max();
    eprintln!(
        "[{c} sleeping] all running after {}, max running {max_live}, RSS max while all ran {} KiB, HWM {} KiB",
        all_running_after.map_or("never".to_string(), |d| format!("{:.2} s", d.as_secs_f64())),
        peak_running.map_or("-".to_string(), |k| k.to_string()),
        after2.hwm_kb
    );

    // 3. soak
    let mut soak: Vec<(f64, Mem, i64)> = Vec::new();
    let done_before: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durable.step_runs WHERE state = 'succeeded'")
            .fetch_one(db.pool())
            .await?;
    if args.soak_secs > 0 {
        println!("-- soak: RSS of the supervisor over {} s", args.soak_secs);
        let keep_open = (c as i64 * 3 + 1) / 2;
        let t0 = Instant::now();
        let mut next_report = 0.0;
        let mut first = true;
        loop {
            check_alive(&mut worker)?;
            let el = t0.elapsed().as_secs_f64();
            let end = el >= args.soak_secs as f64;
            let (live, _, pending, bad) = counts(&db).await?;
            if bad > 0 {
                bail!(
                    "{bad} steps failed or were cancelled during the soak; worker stderr: {}",
                    worker.stderr()
                );
            }
            if !end && live + pending < keep_open {
                submit_sleeps(&db, keep_open - live - pending, args.soak_sleep_ms, "soak").await?;
            }
            if first || el >= next_report || end {
                let m = mem(pid)?;
                let done: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM durable.step_runs WHERE state = 'succeeded'",
                )
                .fetch_one(db.pool())
                .await?;
                println!(
                    "  t = {el:>5.0} s  RSS {:>6.1} MB  peak {:>6.1} MB  live {live:>4}  pending {pending:>4}  succeeded so far {}",
                    mb(m.rss_kb),
                    mb(m.hwm_kb),
                    done - done_before
                );
                soak.push((el, m, done - done_before));
                first = false;
                next_report += args.report_secs as f64;
            }
            if end {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        println!();
    }

    worker.signal(nix::sys::signal::Signal::SIGTERM);
    let code = worker.wait(Duration::from_secs(120)).await;
    db.pool().close().await;
    drop_databases(&args.database_url, std::slice::from_ref(&name)).await;
    created.lock().unwrap().clear();
    admin.pool().close().await;

    println!("-- supervisor RSS (MB; the supervisor process alone)");
    let mut rows = vec![vec![
        "idle worker (baseline)".to_string(),
        format!("{:.1}", mb(idle.rss_kb)),
        format!("{:.1}", mb(idle.hwm_kb)),
        "-".into(),
    ]];
    rows.push(vec![
        format!(
            "{max_live} of {c} concurrent sleeping steps ({})",
            args.executor
        ),
        peak_running
            .map(|k| format!("{:.1}", mb(k)))
            .unwrap_or_else(|| "n/a".into()),
        format!("{:.1}", mb(after2.hwm_kb)),
        peak_running
            .map(|k| format!("+{:.1}", mb(k) - mb(idle.rss_kb)))
            .unwrap_or_default(),
    ]);
    if let (Some(a), Some(b)) = (soak.first(), soak.last()) {
        rows.push(vec![
            format!("soak start (t = {:.0} s)", a.0),
            format!("{:.1}", mb(a.1.rss_kb)),
            format!("{:.1}", mb(a.1.hwm_kb)),
            format!("+{:.1}", mb(a.1.rss_kb) - mb(idle.rss_kb)),
        ]);
        rows.push(vec![
            format!("soak end (t = {:.0} s, {} steps)", b.0, b.2),
            format!("{:.1}", mb(b.1.rss_kb)),
            format!("{:.1}", mb(b.1.hwm_kb)),
            format!("+{:.1}", mb(b.1.rss_kb) - mb(idle.rss_kb)),
        ]);
    }
    print_table(&["phase", "RSS", "peak (VmHWM)", "over idle"], 1, &rows);
    println!(
        "   {c} sleeping steps: all {c} running {:.1} s after the submit, max running at once {max_live}; RSS = the\n\
         \x20  largest sample while all ran ({} samples); phase took {phase2_secs:.1} s; worker exit code after SIGTERM {}",
        all_running_after.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN),
        during.len(),
        code.map_or("none (killed by a signal)".to_string(), |c| c.to_string())
    );
    println!();

    report.figure("idle worker RSS", mb(idle.rss_kb), "MB", setup.clone());
    if let Some(k) = peak_running {
        report.figure(
            &format!("RSS with {c} concurrent sleeping steps"),
            mb(k),
            "MB",
            setup.clone(),
        );
    }
    report.figure(
        "VmHWM after the concurrent phase",
        mb(after2.hwm_kb),
        "MB",
        setup.clone(),
    );
    report.target(
        "h.rss_concurrent_mb",
        &format!(
            "supervisor RSS with {max_live} of {c} steps running at once ≤ 64 MB (issue: 500)"
        ),
        peak_running.map(mb).unwrap_or(f64::NAN),
        Want::AtMost,
        64.0,
        "MB",
        setup.clone(),
    );
    if let (Some(a), Some(b)) = (soak.first(), soak.last()) {
        for (el, m, done) in &soak {
            report.figure(
                "soak RSS",
                mb(m.rss_kb),
                "MB",
                json!({"t_s": el, "succeeded_so_far": done, "peak_mb": mb(m.hwm_kb)}),
            );
        }
        let growth = mb(b.1.rss_kb) - mb(a.1.rss_kb);
        report.figure("soak RSS growth (end − start)", growth, "MB", setup.clone());
        // the first sample is taken before the soak's load exists (nothing
        // live yet): end − start is the working set of that load plus any
        // growth. Growth is judged from the sample nearest a third of the
        // soak (the load established) to the end.
        let third = b.0 / 3.0;
        let w = soak
            .iter()
            .min_by(|x, y| (x.0 - third).abs().total_cmp(&(y.0 - third).abs()))
            .unwrap_or(a);
        let after_warmup = mb(b.1.rss_kb) - mb(w.1.rss_kb);
        report.figure(
            "soak RSS growth after the warm-up (end − the sample at a third of the soak)",
            after_warmup,
            "MB",
            json!({"from_t_s": w.0, "from_mb": mb(w.1.rss_kb), "end_mb": mb(b.1.rss_kb)}),
        );
        println!(
            "   soak: {:+.1} MB from its start (t = {:.0} s, nothing live yet) to its end; {:+.1} MB from t = {:.0} s
             \x20  (a third of the soak, its load established) to its end, over {} steps",
            growth,
            a.0,
            after_warmup,
            w.0,
            b.2.saturating_sub(w.2)
        );
        report.target(
            "h.soak_rss_growth_mb",
            &format!(
                "no RSS growth over a {:.0} s soak (end − the sample at a third of it ≤ {:.0}% of that sample)",
                b.0,
                SOAK_GROWTH_ALLOWED * 100.0
            ),
            after_warmup,
            Want::AtMost,
            mb(w.1.rss_kb) * SOAK_GROWTH_ALLOWED,
            "MB",
            json!({"soak_secs": b.0, "steps": b.2, "start_mb": mb(a.1.rss_kb), "from_t_s": w.0,
                   "from_mb": mb(w.1.rss_kb), "end_mb": mb(b.1.rss_kb)}),
        );
    }
    report.print_targets();
    println!("load average at the end: {}", loadavg());
    report.write(args.json_out.as_deref())
}
