//! Field smoke (not a test; run through `scripts/field-smoke`): the runtime as
//! it is deployed — a PostgreSQL server and two `supervisor worker` processes
//! with the Go and Python demo executors — taken through the three accidents
//! of the field, one after the other:
//!
//! 1. a worker is killed with SIGKILL in the middle of its steps;
//! 2. it is started again (same name, a new incarnation) only after the
//!    leases it held expired;
//! 3. PostgreSQL restarts (`pg_ctl stop -m fast` + start) while steps run.
//!
//! Then it prints what happened to every step (state, attempts, who completed
//! it, its history) and, for each orphaned step, the recovery time (kill →
//! its next attempt accepted) against the lease TTL, and runs the same audit
//! as the chaos test (tests/src/chaos.rs). Exit 0 when every invariant held.
//!
//! It starts its own PostgreSQL cluster (a temporary directory, a free port),
//! so it needs no DATABASE_URL and disturbs nothing else.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chrono::Utc;
use clap::Parser;
use serde_json::{json, Value};
use supervisor::db::Db;
use tests::chaos::*;
use uuid::Uuid;

#[derive(Parser, Debug)]
#[command(about = "Field smoke: kill -9, restart after lease expiry, PostgreSQL restart")]
struct Args {
    /// The workers' lease TTL.
    #[arg(long, default_value_t = 3000)]
    lease_ttl_ms: u64,
    /// The workers' heartbeat interval (at most half the TTL).
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// How long every run may take to finish at the end.
    #[arg(long, default_value_t = 120)]
    settle_secs: u64,
    /// Keep the session directory (PostgreSQL log, worker logs) even on success.
    #[arg(long)]
    keep: bool,
}

fn retry_policy() -> Value {
    json!({"max_attempts": 10, "initial_interval_ms": 200, "backoff_coefficient": 1.5, "max_interval_ms": 2000})
}

fn step(name: &str, lang: &str, kind: &str, input: Value, deps: &[&str]) -> Value {
    json!({"name": name, "executor_kind": lang, "kind": kind, "input": input,
           "depends_on": deps, "retry": retry_policy()})
}

/// Both languages, every demo kind the runtime guarantees something about.
fn workflow(name: &str, sinks: &std::path::Path, sleep_ms: u64) -> Value {
    let sink = |s: &str| sinks.join(format!("{name}-{s}.txt"));
    json!({"name": name, "idempotency_key": format!("field-{name}"), "steps": [
        step("sleep-go", "go", "demo.sleep", json!({"ms": sleep_ms, "steps": 20}), &[]),
        step("sleep-py", "python", "demo.sleep", json!({"ms": sleep_ms, "steps": 20}), &[]),
        step("effect-go", "go", "demo.effect", json!({"sink": sink("effect-go")}), &[]),
        step("effect-py", "python", "demo.effect", json!({"sink": sink("effect-py"), "fail_after_effect": true}), &[]),
        step("flaky-py", "python", "demo.fail", json!({"fail_attempts": 1}), &[]),
        step("artifact-go", "go", "demo.artifact", json!({"name": "a.txt", "content": "field ", "repeat": 1000}), &[]),
        step("artifact-py", "python", "demo.artifact", json!({"name": "b.txt", "content": "smoke", "repeat": 10}), &["artifact-go"]),
        step("after-sleep", "go", "demo.effect", json!({"sink": sink("after-sleep")}), &["sleep-go", "sleep-py"]),
        step("report", "python", "demo.echo", json!({"report": name}), &["after-sleep", "artifact-py", "effect-go", "effect-py", "flaky-py"]),
    ]})
}

struct Session {
    t0: Instant,
    db: Db,
}

impl Session {
    fn say(&self, msg: impl AsRef<str>) {
        println!("[{:>6.1}s] {}", secs(self.t0), msg.as_ref());
    }

    async fn submit(&self, spec: &Value) -> Result<Uuid> {
        let id = retry(Duration::from_secs(60), || self.db.submit(spec)).await?;
        self.say(format!(
            "submitted {} → run {id}",
            spec["name"].as_str().unwrap_or("")
        ));
        Ok(id)
    }

    /// Waits until one of `slots` runs a demo.sleep step that has made
    /// progress (so a kill hits it in the middle); returns the slot's index
    /// and its worker id.
    async fn wait_sleeping(
        &self,
        slots: &mut [WorkerSlot],
        within: Duration,
    ) -> Result<(usize, Uuid)> {
        let until = Instant::now() + within;
        loop {
            let busy: Option<Uuid> = retry(Duration::from_secs(30), || {
                sqlx::query_scalar(
                    "SELECT s.owner_worker_id FROM durable.step_runs s
                      WHERE s.state = 'running' AND s.kind = 'demo.sleep'
                        AND (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id) >= 3
                      LIMIT 1",
                )
                .fetch_optional(self.db.pool())
            })
            .await?
            .flatten();
            if let Some(w) = busy {
                for (i, slot) in slots.iter_mut().enumerate() {
                    if slot.worker_id(&self.db).await == Some(w) {
                        return Ok((i, w));
                    }
                }
            }
            if Instant::now() > until {
                bail!("no worker ran a demo.sleep step within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn open_runs(&self) -> i64 {
        retry(Duration::from_secs(30), || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM durable.workflow_runs WHERE state IN ('pending', 'running')",
            )
            .fetch_one(self.db.pool())
        })
        .await
        .unwrap_or(i64::MAX)
    }

    async fn running(&self) -> i64 {
        running_by_worker(&self.db).await.values().sum()
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let ttl = Duration::from_millis(args.lease_ttl_ms);
    let t0 = Instant::now();
    let dir = RunDir::new("durable-field-");
    let sinks = dir.join("sinks");
    std::fs::create_dir_all(&sinks)?;

    let mut pg = PrivatePg::start(&dir.join("pg")).await?;
    let db = Db::connect(&pg.url, 5).await.context("connect")?;
    db.migrate().await.context("migrate")?;
    let s = Session { t0, db: db.clone() };
    s.say(format!(
        "PostgreSQL at {} (private cluster in {}); lease_ttl_ms {} heartbeat {} ms",
        pg.url,
        dir.path.display(),
        args.lease_ttl_ms,
        args.heartbeat_ms
    ));

    let marker = Uuid::new_v4().to_string();
    let work = dir.join("work");
    tests::go_executor();
    let cfg = chaos_worker_config(&marker, &work, args.lease_ttl_ms, args.heartbeat_ms);
    let mut slots = vec![
        WorkerSlot::new("field-a", &cfg, &dir.path, &pg.url),
        WorkerSlot::new("field-b", &cfg, &dir.path, &pg.url),
    ];
    for w in slots.iter_mut() {
        w.spawn();
    }
    wait_started(&mut slots, Duration::from_secs(60)).await?;
    s.say(format!(
        "workers up: field-a (pid {}), field-b (pid {})",
        slots[0].pid.unwrap_or(0),
        slots[1].pid.unwrap_or(0)
    ));

    // --- 1. kill -9 of a worker in the middle of its steps
    let sleep_ms = args.lease_ttl_ms * 2;
    let mut runs = vec![s.submit(&workflow("kill", &sinks, sleep_ms)).await?];
    let (v, wid) = s.wait_sleeping(&mut slots, Duration::from_secs(60)).await?;
    let victim = slots[v].name.clone();
    let kill_at = Utc::now();
    let status = slots[v].kill9();
    let orphans = owned_steps(&db, wid).await;
    let ready_backlog = ready_backlog(&db).await;
    s.say(format!(
        "kill -9 {victim} ({}) while it held {} steps: {}",
        status.map(|s| s.to_string()).unwrap_or_default(),
        orphans.len(),
        orphans
            .iter()
            .map(|o| format!("{} ({} #{})", o.name, o.state, o.attempt))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let outage = Outage {
        slot: victim.clone(),
        incarnation: 1,
        worker_id: Some(wid),
        at: kill_at,
        paused_until: None,
        orphans: orphans.clone(),
        ready_backlog,
    };
    let left = wait_no_leftovers_of(&marker, &work, &slots[1 - v], Duration::from_secs(5)).await;
    if !left.is_empty() {
        s.say(format!("the killed worker's executors still run: {left:?}"));
    }

    // --- 2. restart after the lease expired
    let latest = orphans.iter().filter_map(|o| o.lease_expires_at).max();
    if let Some(exp) = latest {
        loop {
            let now: chrono::DateTime<Utc> = retry(Duration::from_secs(30), || {
                sqlx::query_scalar("SELECT now()").fetch_one(db.pool())
            })
            .await?;
            if now > exp {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        s.say(format!(
            "the orphans' leases expired ({:+.2} s after the kill); restarting {victim}",
            (exp - kill_at).num_milliseconds() as f64 / 1e3
        ));
    }
    slots[v].spawn();
    wait_started(&mut slots[v..=v], Duration::from_secs(60)).await?;
    s.say(format!(
        "{victim} incarnation {} up (pid {})",
        slots[v].incarnation,
        slots[v].pid.unwrap_or(0)
    ));

    // --- 3. PostgreSQL restart in the middle of a run
    runs.push(s.submit(&workflow("pg-restart", &sinks, sleep_ms)).await?);
    let until = Instant::now() + Duration::from_secs(60);
    while s.running().await < 2 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let running = s.running().await;
    s.say(format!(
        "PostgreSQL restart (-m fast) with {running} steps running"
    ));
    let pg_start = Instant::now();
    let pg_from = Utc::now();
    let down = pg.restart("fast").await?;
    let pg_window = (pg_from, Utc::now());
    s.say(format!("PostgreSQL back after {}", fmt_secs(down)));

    // --- the end: every run terminal
    let until = Instant::now() + Duration::from_secs(args.settle_secs);
    let mut unexpected = Vec::new();
    loop {
        for w in slots.iter_mut() {
            if let Some(st) = w.exited() {
                let during_pg = !w.started() && w.spawned_at.is_some_and(|t| t <= pg_start + down);
                unexpected.push(format!(
                    "{} incarnation {} exited on its own ({st}){}; log {}",
                    w.name,
                    w.incarnation,
                    if during_pg {
                        " while starting during the PostgreSQL restart"
                    } else {
                        ""
                    },
                    w.logs
                        .last()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                ));
                w.spawn();
            }
        }
        if s.open_runs().await == 0 {
            break;
        }
        if Instant::now() > until {
            s.say("NOT every run finished in time");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.say("every run is terminal; stopping the workers (SIGTERM)");
    let mut failures = unexpected;
    for w in slots.iter_mut() {
        if let Some((st, drained)) = w.stop(Duration::from_secs(30)).await {
            if !st.success() || !drained {
                failures.push(format!("{} did not stop cleanly: {st}", w.name));
            }
        }
    }
    for l in wait_no_leftovers(&marker, &work, Duration::from_secs(5)).await {
        failures.push(format!(
            "executor left: pid {} cwd {} {}",
            l.pid, l.cwd, l.cmdline
        ));
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(l.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }

    // --- what happened
    let outages = vec![outage];
    let audit = audit(
        &db,
        &AuditInput {
            outages: outages.clone(),
            lease_ttl: ttl,
            db_outages: vec![pg_window],
        },
    )
    .await?;
    failures.extend(audit.failures.iter().cloned());
    let recs = recoveries(&db, &outages).await;
    check_recoveries(&recs, &mut failures);
    let (deadlocks, _) = server_log_findings(&pg.server_log());
    failures.extend(deadlocks.into_iter().map(|d| format!("deadlock: {d}")));
    let logs: Vec<_> = slots.iter().flat_map(|w| w.logs.clone()).collect();
    failures.extend(
        grep_logs(&logs, "panicked")
            .into_iter()
            .map(|l| format!("panic: {l}")),
    );

    let recovery_of = |id: Uuid| recs.iter().find(|r| r.step_run_id == id);
    let mut rows = vec![vec![
        "run".to_string(),
        "step".into(),
        "exec".into(),
        "kind".into(),
        "state".into(),
        "attempts".into(),
        "completed by".into(),
        "recovery (kill → accepted) vs TTL".into(),
    ]];
    let mut history = Vec::new();
    for run in &runs {
        for (id, h) in audit.histories.iter().filter(|(_, h)| h.run_id == *run) {
            rows.push(vec![
                h.run_name.clone(),
                h.name.clone(),
                h.executor_kind.clone(),
                h.kind.clone(),
                h.state.clone(),
                h.attempts.to_string(),
                h.completed_by.clone().unwrap_or_else(|| "-".into()),
                recovery_of(*id)
                    .map(|r| {
                        r.recovery()
                            .map(|d| vs_ttl(d, ttl))
                            .unwrap_or_else(|| "orphaned, not re-run".into())
                    })
                    .unwrap_or_default(),
            ]);
            history.push(format!("  {}/{}: {}", h.run_name, h.name, h.history));
        }
    }
    println!(
        "\n== field smoke: what happened to each step (lease TTL {} ms)",
        args.lease_ttl_ms
    );
    print!("{}", table(&rows));
    println!("\nhistories (L#n@w leased to w, R running, S@w succeeded by w, F/T/C(reason@by) failed/terminal/cancelled):");
    for h in &history {
        println!("{h}");
    }
    println!("\norphans of the kill -9 (times relative to the kill):");
    print!("{}", recovery_table(&recs, ttl));
    println!(
        "\nPostgreSQL restart: down {} with {running} steps running; runs {}; steps {}",
        fmt_secs(down),
        counts(&audit.runs_by_state),
        counts(&audit.steps_by_state)
    );
    for e in &audit.expired_on_live_workers {
        println!("lease expired on a live worker (information): {e}");
    }
    if !audit.run_states.values().all(|s| s == "succeeded") {
        failures.push(format!(
            "not every run succeeded: {}",
            counts(&audit.runs_by_state)
        ));
    }
    let ok = failures.is_empty();
    if ok {
        println!("invariants: all held (legal histories, one completion by the lease owner, no lost result, effects once per checkpoint, no executor left, no deadlock)");
    } else {
        println!("\n== {} invariant violations:", failures.len());
        for f in &failures {
            println!("  - {f}");
        }
        println!("worker logs:");
        for l in &logs {
            println!("  {}", l.display());
        }
        println!("server log: {}", pg.log.display());
    }
    drop(slots);
    let _ = pg.stop("fast").await;
    drop(pg);
    dir.finish(ok && !args.keep);
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Leftover processes of the session other than those of `alive` (whose
/// executors legitimately run).
async fn wait_no_leftovers_of(
    marker: &str,
    work: &std::path::Path,
    alive: &WorkerSlot,
    within: Duration,
) -> Vec<Leftover> {
    let alive_dir = work.join(&alive.name);
    let until = Instant::now() + within;
    loop {
        let left: Vec<Leftover> = leftover_processes(marker, work)
            .into_iter()
            .filter(|l| !l.cwd.starts_with(&*alive_dir.to_string_lossy()))
            .filter(|l| !is_descendant_of(l.pid, alive.pid.unwrap_or(-1)))
            .collect();
        if left.is_empty() || Instant::now() > until {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn is_descendant_of(mut pid: i32, ancestor: i32) -> bool {
    for _ in 0..64 {
        if pid == ancestor {
            return true;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            return false;
        };
        let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()) else {
            return false;
        };
        if ppid <= 1 {
            return false;
        }
        pid = ppid;
    }
    false
}
