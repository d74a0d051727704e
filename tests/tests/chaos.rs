//! S07 chaos: three real `supervisor worker` processes run a few hundred mixed
//! demo steps (echo, short sleeps, flaky fails, artifact chains, effects with a
//! sink file per step; Go and Python) on a PostgreSQL cluster of the test's
//! own, while the test kills workers with SIGKILL (each comes back as a new
//! incarnation of the same name), freezes them with SIGSTOP for longer than
//! the lease TTL, restarts PostgreSQL (fast and immediate), cancels runs and
//! steps (CLI and SQL), and submits one wide run (60 parallel steps and a
//! fan-in). Then, with the chaos over, every run must reach a terminal state
//! and the audit (tests/src/chaos.rs) must find: legal histories, one
//! completion per step by the owner of its latest lease, no lost result,
//! effects bounded by their checkpoints, no executor left, no deadlock in the
//! server log. The recovery time (kill -9 → the orphan's next accepted) is
//! measured against the TTL.
//!
//! DURABLE_CHAOS_SEED=N replays the workload and the chaos schedule (the
//! interleavings still depend on timing); DURABLE_CHAOS_SOAK=1 runs ~10x
//! longer. DURABLE_CHAOS_KEEP=1 keeps the session directory even on success.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use supervisor::db::Db;
use tests::chaos::*;
use uuid::Uuid;

const TTL_MS: u64 = 2_000;
const HEARTBEAT_MS: u64 = 300;
const WORKERS: usize = 3;

struct Params {
    seed: u64,
    soak: bool,
    /// Steps in the ordinary runs (the wide runs come on top).
    regular_steps: usize,
    wide_runs: usize,
    wide_steps: usize,
    kills: usize,
    pg_restarts: usize,
    pauses: usize,
    cancels: usize,
    /// Submissions and chaos are spread over about this long.
    window: Duration,
    /// How long the runs may take to finish once the chaos stopped.
    settle: Duration,
}

impl Params {
    fn from_env() -> Params {
        let seed = std::env::var("DURABLE_CHAOS_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| u64::from(rand::random::<u32>()));
        let soak = std::env::var("DURABLE_CHAOS_SOAK").is_ok_and(|v| !v.is_empty() && v != "0");
        let k = if soak { 10 } else { 1 };
        Params {
            seed,
            soak,
            regular_steps: 240 * k,
            wide_runs: if soak { 4 } else { 1 },
            wide_steps: 60,
            kills: 16 * k,
            pg_restarts: 3 * k,
            pauses: 4 * k,
            cancels: 10 * k,
            window: Duration::from_secs(50 * k as u64),
            settle: Duration::from_secs(if soak { 600 } else { 180 }),
        }
    }
}

/// A run to submit, and what it should end as when nobody cancels it.
#[derive(Clone, Debug)]
struct Planned {
    name: String,
    spec: Value,
    steps: Vec<String>,
    /// A step fails on purpose (retryable: false): the run must end `failed`.
    expect_fail: bool,
}

fn retry_policy() -> Value {
    // chaos costs attempts (every kill or freeze is a LEASE_EXPIRED): plenty of them
    json!({"max_attempts": 25, "initial_interval_ms": 100, "backoff_coefficient": 1.5, "max_interval_ms": 1000})
}

fn word(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| (b'a' + rng.random_range(0..26u8)) as char)
        .collect()
}

/// A run of 1–6 steps of random kinds and languages; each step depends on up
/// to two earlier ones.
fn random_run(rng: &mut StdRng, seed: u64, idx: usize, sinks: &Path) -> Planned {
    let n = rng.random_range(1..=6usize);
    let fail_at = rng.random_bool(0.05).then(|| rng.random_range(0..n));
    let mut steps = Vec::new();
    let mut names = Vec::new();
    for i in 0..n {
        let name = format!("s{i}");
        let lang = *tests::LANGS.choose(rng).expect("langs");
        let mut deps = Vec::new();
        for j in 0..i {
            if deps.len() < 2 && rng.random_bool(0.3) {
                deps.push(format!("s{j}"));
            }
        }
        let (kind, input) = if fail_at == Some(i) {
            (
                "demo.fail",
                json!({"code": "DEMO_FATAL", "retryable": false, "message": "fails on purpose"}),
            )
        } else {
            match rng.random_range(0..100) {
                0..20 => (
                    "demo.echo",
                    json!({"run": idx, "step": i, "payload": word(rng, 12)}),
                ),
                20..50 => (
                    "demo.sleep",
                    json!({"ms": rng.random_range(200..2500), "steps": rng.random_range(4..16)}),
                ),
                50..63 => (
                    "demo.fail",
                    json!({"fail_attempts": rng.random_range(1..=2), "message": "flaky"}),
                ),
                63..80 => {
                    let len = rng.random_range(4..40);
                    (
                        "demo.artifact",
                        json!({"name": format!("{name}.txt"), "content": word(rng, len),
                               "repeat": rng.random_range(1..300)}),
                    )
                }
                _ => {
                    let sink = sinks.join(format!("r{idx}-{name}.txt"));
                    let mut input = json!({"sink": sink});
                    match rng.random_range(0..10) {
                        0..3 => input["fail_after_effect"] = json!(true),
                        3..5 => input["crash_after_effect"] = json!(true),
                        _ => {}
                    }
                    ("demo.effect", input)
                }
            }
        };
        steps.push(
            json!({"name": name, "executor_kind": lang, "kind": kind, "input": input,
                          "depends_on": deps, "retry": retry_policy()}),
        );
        names.push(name);
    }
    let run = format!("chaos-{idx}");
    Planned {
        spec: json!({"name": run, "idempotency_key": format!("chaos-{seed}-{idx}"), "steps": steps}),
        name: run,
        steps: names,
        expect_fail: fail_at.is_some(),
    }
}

/// `width` parallel steps (echo and short sleeps, both languages) and a fan-in.
fn wide_run(rng: &mut StdRng, seed: u64, idx: usize, width: usize) -> Planned {
    let mut steps = Vec::new();
    let mut names = Vec::new();
    for i in 0..width {
        let name = format!("w{i:02}");
        let lang = tests::LANGS[i % 2];
        let (kind, input) = if rng.random_bool(0.5) {
            ("demo.echo", json!({"wide": idx, "i": i}))
        } else {
            (
                "demo.sleep",
                json!({"ms": rng.random_range(100..600), "steps": 4}),
            )
        };
        steps.push(
            json!({"name": name, "executor_kind": lang, "kind": kind, "input": input,
                          "retry": retry_policy()}),
        );
        names.push(name);
    }
    steps.push(json!({"name": "join", "executor_kind": "go", "kind": "demo.echo",
                      "input": {"joined": width}, "depends_on": names.clone(), "retry": retry_policy()}));
    names.push("join".into());
    let run = format!("wide-{idx}");
    Planned {
        spec: json!({"name": run, "idempotency_key": format!("chaos-{seed}-{run}"), "steps": steps}),
        name: run,
        steps: names,
        expect_fail: false,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Kill,
    PgRestart,
    Pause,
    Cancel,
    Wide,
}

struct PgRestartRec {
    mode: &'static str,
    down: Duration,
    running: i64,
    /// When the server went down and came back (wall clock, as the database's).
    window: (chrono::DateTime<Utc>, chrono::DateTime<Utc>),
}

struct CancelRec {
    run: Uuid,
    run_name: String,
    step: Option<String>,
    how: &'static str,
    result: String,
}

type Submitted = Arc<Mutex<Vec<(Planned, Uuid)>>>;

struct Chaos {
    t0: Instant,
    rng: StdRng,
    db: Db,
    pg: PrivatePg,
    slots: Vec<WorkerSlot>,
    restarts_due: Vec<(usize, Instant)>,
    /// (slot, when, the outage whose pause ends then)
    resumes_due: Vec<(usize, Instant, usize)>,
    outages: Vec<Outage>,
    restarts: usize,
    pg_restarts: Vec<PgRestartRec>,
    pg_windows: Vec<(Instant, Instant)>,
    cancels: Vec<CancelRec>,
    startup_failures: Vec<String>,
    unexpected_exits: Vec<String>,
    cancel_errors: Vec<String>,
    submitted: Submitted,
    wide: Vec<Planned>,
}

impl Chaos {
    fn say(&self, msg: impl AsRef<str>) {
        println!("[{:>6.1}s] {}", secs(self.t0), msg.as_ref());
    }

    /// Due restarts and resumes; workers that exited on their own.
    async fn tick(&mut self) {
        let now = Instant::now();
        let due: Vec<(usize, usize)> = self
            .resumes_due
            .iter()
            .filter(|(_, t, _)| *t <= now)
            .map(|(i, _, o)| (*i, *o))
            .collect();
        self.resumes_due.retain(|(_, t, _)| *t > now);
        for (i, o) in due {
            self.slots[i].resume();
            // the pause ends now (at the end of the chaos, earlier than planned)
            self.outages[o].paused_until = Some(Utc::now());
            self.say(format!("SIGCONT {}", self.slots[i].name));
        }
        let due: Vec<usize> = self
            .restarts_due
            .iter()
            .filter(|(_, t)| *t <= now)
            .map(|(i, _)| *i)
            .collect();
        self.restarts_due.retain(|(_, t)| *t > now);
        for i in due {
            if !self.slots[i].is_up() {
                self.slots[i].spawn();
                self.restarts += 1;
                self.say(format!(
                    "restarted {} as incarnation {} (pid {})",
                    self.slots[i].name,
                    self.slots[i].incarnation,
                    self.slots[i].pid.unwrap_or(0)
                ));
            }
        }
        for i in 0..self.slots.len() {
            if self.slots[i].paused || !self.slots[i].is_up() {
                continue;
            }
            if let Some(status) = self.slots[i].exited() {
                let s = &self.slots[i];
                let spawned = s.spawned_at.unwrap_or(self.t0);
                let pg_overlap = self
                    .pg_windows
                    .iter()
                    .any(|(a, b)| *b >= spawned && *a <= Instant::now());
                let what = format!(
                    "{} incarnation {} exited on its own ({status}); log {}",
                    s.name,
                    s.incarnation,
                    s.logs
                        .last()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                );
                if !s.started() && pg_overlap {
                    // a worker cannot start (migrations check, probe, register)
                    // while PostgreSQL is down: it exits, and is started again
                    self.say(format!(
                        "{what} — while starting during a PostgreSQL restart"
                    ));
                    self.startup_failures.push(what);
                } else {
                    let tail: String = s
                        .current_log()
                        .lines()
                        .rev()
                        .take(15)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join("\n      ");
                    self.say(format!("UNEXPECTED: {what}"));
                    self.unexpected_exits
                        .push(format!("{what}; last lines:\n      {tail}"));
                }
                self.restarts_due
                    .push((i, Instant::now() + Duration::from_millis(300)));
            }
        }
    }

    async fn idle(&mut self, d: Duration) {
        let until = Instant::now() + d;
        loop {
            self.tick().await;
            if Instant::now() >= until {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50).min(until - Instant::now())).await;
        }
    }

    /// An up, unpaused worker (while at least one other stays up), preferably
    /// one running steps right now, so the outage hits steps in the middle.
    async fn pick_target(&mut self) -> Option<usize> {
        let patient = Instant::now() + Duration::from_secs(4);
        let give_up = Instant::now() + Duration::from_secs(20);
        loop {
            self.tick().await;
            let up: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].is_up() && !self.slots[i].paused)
                .collect();
            if up.len() >= 2 {
                let running = running_by_worker(&self.db).await;
                let mut busy = Vec::new();
                for &i in &up {
                    if let Some(w) = self.slots[i].worker_id(&self.db).await {
                        if running.get(&w).copied().unwrap_or(0) > 0 {
                            busy.push(i);
                        }
                    }
                }
                if let Some(&i) = busy.choose(&mut self.rng) {
                    return Some(i);
                }
                if Instant::now() > patient {
                    return up.choose(&mut self.rng).copied();
                }
            } else if Instant::now() > give_up {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn kill(&mut self) {
        let Some(i) = self.pick_target().await else {
            self.say("kill -9 skipped: fewer than two workers up");
            return;
        };
        let wid = self.slots[i].worker_id(&self.db).await;
        let (name, inc, pid) = (
            self.slots[i].name.clone(),
            self.slots[i].incarnation,
            self.slots[i].pid.unwrap_or(0),
        );
        let at = Utc::now();
        self.slots[i].kill9();
        let orphans = match wid {
            Some(w) => owned_steps(&self.db, w).await,
            None => Vec::new(),
        };
        let ready_backlog = ready_backlog(&self.db).await;
        let ttl = Duration::from_millis(TTL_MS);
        let delay = *[
            Duration::ZERO,
            ttl / 2,
            ttl + Duration::from_millis(300),
            ttl * 2,
        ]
        .choose(&mut self.rng)
        .expect("delays");
        self.restarts_due.push((i, Instant::now() + delay));
        self.say(format!(
            "kill -9 {name}#{inc} (pid {pid}): {} orphaned [{}]; restart in {} ms",
            orphans.len(),
            orphans
                .iter()
                .map(|o| format!("{} {} #{}", o.kind, o.state, o.attempt))
                .collect::<Vec<_>>()
                .join(", "),
            delay.as_millis()
        ));
        self.outages.push(Outage {
            slot: name,
            incarnation: inc,
            worker_id: wid,
            at,
            paused_until: None,
            orphans,
            ready_backlog,
        });
    }

    async fn pause(&mut self) {
        let Some(i) = self.pick_target().await else {
            self.say("pause skipped: fewer than two workers up");
            return;
        };
        let wid = self.slots[i].worker_id(&self.db).await;
        let pause_for = Duration::from_millis(TTL_MS + self.rng.random_range(400..1500));
        let at = Utc::now();
        self.slots[i].pause();
        let orphans = match wid {
            Some(w) => owned_steps(&self.db, w).await,
            None => Vec::new(),
        };
        let ready_backlog = ready_backlog(&self.db).await;
        self.resumes_due
            .push((i, Instant::now() + pause_for, self.outages.len()));
        self.say(format!(
            "SIGSTOP {}#{} for {} ms (TTL {TTL_MS} ms) holding {} steps",
            self.slots[i].name,
            self.slots[i].incarnation,
            pause_for.as_millis(),
            orphans.len()
        ));
        self.outages.push(Outage {
            slot: self.slots[i].name.clone(),
            incarnation: self.slots[i].incarnation,
            worker_id: wid,
            at,
            paused_until: Some(at + chrono::Duration::milliseconds(pause_for.as_millis() as i64)),
            orphans,
            ready_backlog,
        });
    }

    async fn pg_restart(&mut self) {
        // in the middle of a run: wait (a little) for running steps
        let until = Instant::now() + Duration::from_secs(5);
        let mut running = 0;
        while Instant::now() < until {
            running = running_by_worker(&self.db).await.values().sum::<i64>();
            if running > 0 {
                break;
            }
            self.idle(Duration::from_millis(200)).await;
        }
        let mode = if self.pg_restarts.len() % 2 == 0 {
            "fast"
        } else {
            "immediate"
        };
        let start = Instant::now();
        self.say(format!(
            "PostgreSQL restart (-m {mode}) with {running} steps running"
        ));
        let from = Utc::now();
        let down = self.pg.restart(mode).await.expect("restart PostgreSQL");
        self.pg_windows.push((start, Instant::now()));
        let window = (from, Utc::now());
        self.say(format!("PostgreSQL is back after {}", fmt_secs(down)));
        self.pg_restarts.push(PgRestartRec {
            mode,
            down,
            running,
            window,
        });
    }

    async fn cancel(&mut self) {
        let subs: Vec<(Planned, Uuid)> = self.submitted.lock().expect("submitted").clone();
        let ids: Vec<Uuid> = subs.iter().map(|(_, id)| *id).collect();
        let open: Vec<Uuid> = retry(Duration::from_secs(30), || {
            sqlx::query_scalar(
                "SELECT id FROM durable.workflow_runs WHERE id = ANY($1) AND state IN ('pending', 'running')",
            )
            .bind(&ids)
            .fetch_all(self.db.pool())
        })
        .await
        .unwrap_or_default();
        let Some(&run) = open.choose(&mut self.rng) else {
            self.say("cancel skipped: no open run");
            return;
        };
        let planned = subs
            .iter()
            .find(|(_, id)| *id == run)
            .map(|(p, _)| p.clone())
            .expect("planned run");
        let how = *["sql", "cli", "cli --step"]
            .choose(&mut self.rng)
            .expect("how");
        let step = (how == "cli --step").then(|| {
            planned
                .steps
                .choose(&mut self.rng)
                .cloned()
                .expect("a step")
        });
        let result = match how {
            "sql" => retry(Duration::from_secs(30), || {
                sqlx::query_scalar::<_, String>("SELECT durable.cancel_run($1)")
                    .bind(run)
                    .fetch_one(self.db.pool())
            })
            .await
            .map(|s| format!("run is {s}"))
            .unwrap_or_else(|e| format!("error: {e}")),
            _ => {
                let mut cmd = tokio::process::Command::new(worker_bin());
                cmd.arg("cancel")
                    .arg(run.to_string())
                    .env("DATABASE_URL", &self.pg.url);
                if let Some(s) = &step {
                    cmd.args(["--step", s]);
                }
                match cmd.output().await {
                    Ok(o) if o.status.success() => {
                        String::from_utf8_lossy(&o.stderr).trim().to_string()
                    }
                    other => {
                        let what = match other {
                            Ok(o) => format!(
                                "exit {}: {}",
                                o.status,
                                String::from_utf8_lossy(&o.stderr).trim()
                            ),
                            Err(e) => format!("cannot run supervisor cancel: {e}"),
                        };
                        self.cancel_errors.push(format!(
                            "supervisor cancel {run}{} failed: {what}",
                            step.as_deref()
                                .map(|s| format!(" --step {s}"))
                                .unwrap_or_default()
                        ));
                        what
                    }
                }
            }
        };
        self.say(format!(
            "cancel ({how}) {}{}: {result}",
            planned.name,
            step.as_deref()
                .map(|s| format!(" step {s}"))
                .unwrap_or_default()
        ));
        self.cancels.push(CancelRec {
            run,
            run_name: planned.name,
            step,
            how,
            result,
        });
    }

    async fn submit_wide(&mut self) {
        let Some(p) = self.wide.pop() else { return };
        let id = submit(&self.db, &p).await;
        self.say(format!(
            "submitted the wide run {} ({} steps)",
            p.name,
            p.steps.len()
        ));
        self.submitted.lock().expect("submitted").push((p, id));
    }
}

async fn submit(db: &Db, p: &Planned) -> Uuid {
    // the idempotency key makes a retry after a lost answer return the same run
    retry(Duration::from_secs(60), || db.submit(&p.spec))
        .await
        .unwrap_or_else(|e| panic!("submit {}: {e}", p.name))
}

fn stats(mut v: Vec<Duration>) -> String {
    if v.is_empty() {
        return "n=0".into();
    }
    v.sort();
    let ttl = Duration::from_millis(TTL_MS);
    format!(
        "n={} min {} median {} max {}",
        v.len(),
        vs_ttl(v[0], ttl),
        vs_ttl(v[v.len() / 2], ttl),
        vs_ttl(v[v.len() - 1], ttl)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    let p = Params::from_env();
    println!(
        "chaos: DURABLE_CHAOS_SEED={} DURABLE_CHAOS_SOAK={} (replay: DURABLE_CHAOS_SEED={} cargo test -p tests --test chaos -- --nocapture)",
        p.seed,
        u8::from(p.soak),
        p.seed
    );
    let t0 = Instant::now();
    let dir = RunDir::new("durable-chaos-");
    println!("session directory {}", dir.path.display());
    let mut rng = StdRng::seed_from_u64(p.seed);

    // the workload, fixed by the seed
    let sinks = dir.join("sinks");
    std::fs::create_dir_all(&sinks).expect("sinks dir");
    let mut planned = Vec::new();
    let mut regular_steps = 0;
    while regular_steps < p.regular_steps {
        let r = random_run(&mut rng, p.seed, planned.len(), &sinks);
        regular_steps += r.steps.len();
        planned.push(r);
    }
    let wide: Vec<Planned> = (0..p.wide_runs)
        .map(|i| wide_run(&mut rng, p.seed, i, p.wide_steps))
        .collect();
    let planned_steps = regular_steps + wide.iter().map(|w| w.steps.len()).sum::<usize>();
    assert!(
        planned_steps >= 200,
        "the workload has {planned_steps} steps"
    );
    let mut actions: Vec<Action> = std::iter::repeat_n(Action::Kill, p.kills)
        .chain(std::iter::repeat_n(Action::PgRestart, p.pg_restarts))
        .chain(std::iter::repeat_n(Action::Pause, p.pauses))
        .chain(std::iter::repeat_n(Action::Cancel, p.cancels))
        .chain(std::iter::repeat_n(Action::Wide, p.wide_runs))
        .collect();
    actions.shuffle(&mut rng);
    // the first action comes once some work runs; cancels need a submitted run
    let avg_gap = p.window.as_millis() as u64 / actions.len().max(1) as u64;
    println!(
        "workload: {} runs + {} wide, {planned_steps} steps; chaos: {} kill -9, {} PostgreSQL restarts, {} pauses, {} cancels over ~{} s",
        planned.len(),
        wide.len(),
        p.kills,
        p.pg_restarts,
        p.pauses,
        p.cancels,
        p.window.as_secs()
    );

    // PostgreSQL of our own, migrated before any worker starts
    let pg = PrivatePg::start(&dir.join("pg"))
        .await
        .expect("private PostgreSQL");
    println!(
        "private PostgreSQL at {} (log {})",
        pg.url,
        pg.log.display()
    );
    let db = Db::connect(&pg.url, 8).await.expect("connect");
    db.migrate().await.expect("migrate");

    let marker = Uuid::new_v4().to_string();
    let work = dir.join("work");
    let cfg = chaos_worker_config(&marker, &work, TTL_MS, HEARTBEAT_MS);
    let mut slots: Vec<WorkerSlot> = (1..=WORKERS)
        .map(|i| WorkerSlot::new(&format!("chaos-w{i}"), &cfg, &dir.path, &pg.url))
        .collect();
    tests::go_executor(); // built before the workers probe it
    for s in slots.iter_mut() {
        s.spawn();
    }
    wait_started(&mut slots, Duration::from_secs(60))
        .await
        .expect("workers start");
    println!("[{:>6.1}s] {WORKERS} workers up", secs(t0));

    // submissions: a third at once, the rest spread over the window
    let submitted: Submitted = Arc::new(Mutex::new(Vec::new()));
    let submitter = {
        let (db, submitted, planned) = (db.clone(), submitted.clone(), planned.clone());
        let window = p.window;
        tokio::spawn(async move {
            let first = planned.len() / 3;
            let gap = window / (planned.len() - first).max(1) as u32;
            for (i, r) in planned.into_iter().enumerate() {
                if i >= first {
                    tokio::time::sleep(gap).await;
                }
                let id = submit(&db, &r).await;
                submitted.lock().expect("submitted").push((r, id));
            }
        })
    };

    let mut chaos = Chaos {
        t0,
        rng,
        db: db.clone(),
        pg,
        slots,
        restarts_due: Vec::new(),
        resumes_due: Vec::new(),
        outages: Vec::new(),
        restarts: 0,
        pg_restarts: Vec::new(),
        pg_windows: Vec::new(),
        cancels: Vec::new(),
        startup_failures: Vec::new(),
        unexpected_exits: Vec::new(),
        cancel_errors: Vec::new(),
        submitted: submitted.clone(),
        wide,
    };
    chaos.idle(Duration::from_millis(1500)).await;
    let chaos_start = Instant::now();
    for a in actions {
        let gap = chaos.rng.random_range(avg_gap / 2..=avg_gap * 3 / 2);
        chaos.idle(Duration::from_millis(gap)).await;
        match a {
            Action::Kill => chaos.kill().await,
            Action::PgRestart => chaos.pg_restart().await,
            Action::Pause => chaos.pause().await,
            Action::Cancel => chaos.cancel().await,
            Action::Wide => chaos.submit_wide().await,
        }
    }
    // the chaos stops: resume the frozen, restart the killed, finish submitting
    for r in chaos.resumes_due.iter_mut() {
        r.1 = Instant::now();
    }
    for r in chaos.restarts_due.iter_mut() {
        r.1 = Instant::now();
    }
    chaos.tick().await;
    submitter.await.expect("submitter");
    let chaos_took = chaos_start.elapsed();
    chaos.say("chaos over; waiting for every run to finish");

    // every run terminal, within a generous bound
    // (a run whose steps are all terminal cannot move any more: once that
    // lasts STALL, waiting longer would only delay the report)
    const STALL: Duration = Duration::from_secs(15);
    let settle_start = Instant::now();
    let mut open = i64::MAX;
    let mut stalled_since: Option<Instant> = None;
    while settle_start.elapsed() < p.settle {
        chaos.idle(Duration::from_millis(500)).await;
        let (runs, steps) = retry(Duration::from_secs(30), || {
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT (SELECT count(*) FROM durable.workflow_runs WHERE state IN ('pending', 'running')),
                        (SELECT count(*) FROM durable.step_runs
                          WHERE state IN ('pending', 'leased', 'running', 'retryable_failed'))",
            )
            .fetch_one(db.pool())
        })
        .await
        .unwrap_or((i64::MAX, i64::MAX));
        open = runs;
        if open == 0 {
            break;
        }
        if steps == 0 {
            let since = *stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() > STALL {
                chaos.say(format!(
                    "{open} runs are open but none of their steps is: they cannot finish"
                ));
                break;
            }
        } else {
            stalled_since = None;
        }
    }
    let settle_took = settle_start.elapsed();
    chaos.say(format!(
        "{} ({} open runs after {})",
        if open == 0 {
            "all runs terminal"
        } else {
            "NOT all runs terminal"
        },
        open,
        fmt_secs(settle_took)
    ));

    // stop the workers (drain), then nothing of theirs may be left
    let mut failures: Vec<String> = Vec::new();
    for s in chaos.slots.iter_mut() {
        match s.stop(Duration::from_secs(20)).await {
            Some((st, true)) if st.success() => {}
            Some((st, drained)) => failures.push(format!(
                "{} incarnation {} did not stop cleanly on SIGTERM ({st}, drained in time: {drained}); log {}",
                s.name,
                s.incarnation,
                s.logs.last().map(|p| p.display().to_string()).unwrap_or_default()
            )),
            None => {}
        }
    }
    let leftovers = wait_no_leftovers(&marker, &work, Duration::from_secs(5)).await;
    for l in &leftovers {
        failures.push(format!(
            "executor process left after every worker stopped: pid {} cwd {} cmd {}",
            l.pid, l.cwd, l.cmdline
        ));
        // ours (marked by this session): do not leave it running
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(l.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }

    // the audit
    let audit = audit(
        &db,
        &AuditInput {
            outages: chaos.outages.clone(),
            lease_ttl: Duration::from_millis(TTL_MS),
            db_outages: chaos.pg_restarts.iter().map(|r| r.window).collect(),
        },
    )
    .await
    .expect("audit");
    failures.extend(audit.failures.iter().cloned());
    let recs = recoveries(&db, &chaos.outages).await;
    check_recoveries(&recs, &mut failures);
    failures.extend(chaos.unexpected_exits.iter().cloned());
    failures.extend(chaos.cancel_errors.iter().cloned());
    // the chaos itself must have happened (actions are skipped when no
    // target is available, e.g. fewer than two workers up)
    let done = |pred: fn(&Outage) -> bool| chaos.outages.iter().filter(|o| pred(o)).count();
    let (kills_done, pauses_done) = (
        done(|o| o.paused_until.is_none()),
        done(|o| o.paused_until.is_some()),
    );
    for (what, got, want) in [
        ("kill -9", kills_done, p.kills.min(10)),
        (
            "PostgreSQL restarts",
            chaos.pg_restarts.len(),
            p.pg_restarts.min(2),
        ),
        ("pauses", pauses_done, 1),
        ("cancels", chaos.cancels.len(), 1),
    ] {
        if got < want {
            failures.push(format!(
                "only {got} {what} happened (at least {want} planned)"
            ));
        }
    }

    // what each run should have ended as
    let cancelled: std::collections::HashSet<Uuid> = chaos.cancels.iter().map(|c| c.run).collect();
    let subs = submitted.lock().expect("submitted").clone();
    for (plan, id) in &subs {
        let state = audit
            .run_states
            .get(id)
            .map(String::as_str)
            .unwrap_or("missing");
        let want = if plan.expect_fail {
            "failed"
        } else {
            "succeeded"
        };
        if !cancelled.contains(id) && state != want {
            let steps: Vec<String> = audit
                .histories
                .values()
                .filter(|h| h.run_id == *id)
                .map(|h| {
                    format!(
                        "{} {} {} {} #{} err={:?}: {}",
                        h.name,
                        h.executor_kind,
                        h.kind,
                        h.state,
                        h.attempts,
                        h.error_code,
                        h.history
                    )
                })
                .collect();
            failures.push(format!(
                "run {id} ({}) ended {state}, expected {want} (no cancel was requested):\n      {}",
                plan.name,
                steps.join("\n      ")
            ));
        }
    }

    // the server log and the workers' logs
    let server_log = chaos.pg.server_log();
    let (deadlocks, lock_waits) = server_log_findings(&server_log);
    for d in &deadlocks {
        failures.push(format!(
            "deadlock in the server log ({}):\n    {d}",
            chaos.pg.log.display()
        ));
    }
    let logs: Vec<std::path::PathBuf> = chaos.slots.iter().flat_map(|s| s.logs.clone()).collect();
    for l in grep_logs(&logs, "panicked") {
        failures.push(format!("a worker panicked: {l}"));
    }
    let log_counts: BTreeMap<&str, usize> = [
        "lease lost",
        "outcome discarded",
        "commit failed",
        "cannot record",
        "heartbeat failed",
        "lease failed",
        "reclaim failed",
        "reclaimed expired leases",
        "LISTEN connection lost",
    ]
    .into_iter()
    .map(|p| (p, grep_logs(&logs, p).len()))
    .collect();

    // --- the summary
    let ttl = Duration::from_millis(TTL_MS);
    let kills: Vec<&Outage> = chaos
        .outages
        .iter()
        .filter(|o| o.paused_until.is_none())
        .collect();
    let pauses = chaos.outages.len() - kills.len();
    let kill_recovery: Vec<Duration> = recs
        .iter()
        .filter(|r| !r.paused)
        .filter_map(Recovery::recovery)
        .collect();
    let pause_recovery: Vec<Duration> = recs
        .iter()
        .filter(|r| r.paused)
        .filter_map(Recovery::recovery)
        .collect();
    let by_how = chaos
        .cancels
        .iter()
        .fold(BTreeMap::new(), |mut m: BTreeMap<&str, usize>, c| {
            *m.entry(c.how).or_default() += 1;
            m
        });
    println!();
    println!(
        "== chaos summary: seed {} soak {} | {WORKERS} workers, lease_ttl_ms {TTL_MS}, heartbeat {HEARTBEAT_MS} ms",
        p.seed,
        u8::from(p.soak)
    );
    let rows: Vec<Vec<String>> = vec![
        vec!["what".into(), "count".into(), "detail".into()],
        vec![
            "runs".into(),
            audit.runs_total.to_string(),
            counts(&audit.runs_by_state),
        ],
        vec![
            "steps".into(),
            audit.steps_total.to_string(),
            format!(
                "{} ({planned_steps} planned; the rest never became ready)",
                counts(&audit.steps_by_state)
            ),
        ],
        vec![
            "steps by kind".into(),
            String::new(),
            counts(&audit.steps_by_kind),
        ],
        vec![
            "attempts".into(),
            audit.attempts.to_string(),
            format!(
                "{} moved on by LEASE_EXPIRED, {} of them on a worker neither killed nor paused, with PostgreSQL up",
                audit.lease_expired,
                audit.expired_on_live_workers.len()
            ),
        ],
        vec![
            "attempt endings".into(),
            String::new(),
            counts(&audit.failure_reasons),
        ],
        vec![
            "kill -9".into(),
            kills.len().to_string(),
            format!(
                "{} orphaned steps; {} restarts; {} start failures during a PostgreSQL restart",
                kills.iter().map(|o| o.orphans.len()).sum::<usize>(),
                chaos.restarts,
                chaos.startup_failures.len()
            ),
        ],
        vec![
            "PostgreSQL restarts".into(),
            chaos.pg_restarts.len().to_string(),
            chaos
                .pg_restarts
                .iter()
                .map(|r| {
                    format!(
                        "-m {} down {} ({} running)",
                        r.mode,
                        fmt_secs(r.down),
                        r.running
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        ],
        vec![
            "pauses (SIGSTOP > TTL)".into(),
            pauses.to_string(),
            format!(
                "{} steps held while frozen",
                chaos
                    .outages
                    .iter()
                    .filter(|o| o.paused_until.is_some())
                    .map(|o| o.orphans.len())
                    .sum::<usize>()
            ),
        ],
        vec![
            "cancels".into(),
            chaos.cancels.len().to_string(),
            counts(&by_how),
        ],
        vec![
            "recovery kill -9 → accepted".into(),
            String::new(),
            stats(kill_recovery.clone()),
        ],
        vec![
            "recovery SIGSTOP → accepted".into(),
            String::new(),
            stats(pause_recovery),
        ],
        vec![
            "  with nothing queued".into(),
            String::new(),
            stats(
                recs.iter()
                    .filter(|r| r.ready_backlog == 0)
                    .filter_map(Recovery::recovery)
                    .collect(),
            ),
        ],
        vec![
            "outage → reclaimed".into(),
            String::new(),
            stats(recs.iter().filter_map(Recovery::reclaimed).collect()),
        ],
        vec![
            "demo.effect".into(),
            audit.effect_steps.to_string(),
            format!(
                "{} repeated (allowed: no checkpoint stored before the next attempt)",
                audit.effect_repeats.len()
            ),
        ],
        vec![
            "artifacts verified".into(),
            audit.artifacts_checked.to_string(),
            String::new(),
        ],
        vec![
            "server log".into(),
            deadlocks.len().to_string(),
            format!("deadlocks; {lock_waits} lock waits over deadlock_timeout"),
        ],
        vec![
            "leftover processes".into(),
            leftovers.len().to_string(),
            String::new(),
        ],
        vec![
            "worker log lines".into(),
            String::new(),
            counts(&log_counts),
        ],
        vec![
            "time".into(),
            String::new(),
            format!(
                "chaos {}, settle {}, total {}",
                fmt_secs(chaos_took),
                fmt_secs(settle_took),
                fmt_secs(t0.elapsed())
            ),
        ],
    ];
    print!("{}", table(&rows));
    if let Some(r) = recs
        .iter()
        .filter(|r| !r.paused)
        .max_by_key(|r| r.recovery())
        .filter(|r| r.recovery().is_some())
    {
        println!(
            "max recovery after kill -9: {} ({} of {}; {} steps were ready to run at the kill, queued ahead of it)",
            vs_ttl(r.recovery().unwrap_or_default(), ttl),
            r.name,
            r.slot,
            r.ready_backlog
        );
    }
    println!("\nrecoveries:");
    print!("{}", recovery_table(&recs, ttl));
    if !chaos.cancels.is_empty() {
        println!("\ncancels:");
        for c in &chaos.cancels {
            println!(
                "  {} {}{} via {}: {} → {}",
                c.run,
                c.run_name,
                c.step
                    .as_deref()
                    .map(|s| format!(" --step {s}"))
                    .unwrap_or_default(),
                c.how,
                c.result,
                audit
                    .run_states
                    .get(&c.run)
                    .map(String::as_str)
                    .unwrap_or("?")
            );
        }
    }
    for r in &audit.effect_repeats {
        println!(
            "effect repeated (allowed): {} — {} lines, first checkpoint by attempt {:?}, attempts {:?}",
            r.step, r.lines, r.first_checkpoint_attempt, r.attempts
        );
    }
    for e in audit.expired_on_live_workers.iter().take(5) {
        println!("lease expired on a live worker (information): {e}");
    }
    for w in lock_wait_samples(&server_log, 3) {
        println!("lock wait (information):\n    {w}");
    }
    for s in &chaos.startup_failures {
        println!("start failure (tolerated): {s}");
    }

    let ok = failures.is_empty();
    if !ok {
        println!(
            "\n== {} invariant violations (seed {}):",
            failures.len(),
            p.seed
        );
        for f in &failures {
            println!("  - {f}");
        }
        println!("worker logs:");
        for l in &logs {
            println!("  {}", l.display());
        }
        println!("server log: {}", chaos.pg.log.display());
    }
    let _ = chaos.pg.stop("fast").await;
    drop(chaos);
    dir.finish(ok);
    assert!(
        ok,
        "{} chaos invariant violations (DURABLE_CHAOS_SEED={}); first: {}",
        failures.len(),
        p.seed,
        failures.first().map(String::as_str).unwrap_or("")
    );
}
