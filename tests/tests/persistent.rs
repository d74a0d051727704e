//! Persistent executors (issue 7, the executor pool): a warm process serves
//! many jobs, one at a time; it is recycled after `max_jobs_per_process`, and
//! killed and replaced when a cancelled job does not end within its grace or
//! it breaks the protocol. Nothing of it survives the worker.

use std::time::Duration;

use serde_json::json;
use tests::{demo, executor_pid, fast_config, step, RunningWorker, TestDb};

const LONG: Duration = Duration::from_secs(60);

async fn run_one(
    t: &TestDb,
    lang: &str,
    kind: &str,
    input: serde_json::Value,
) -> (String, Option<i32>) {
    let run = t
        .submit(
            json!({"name": kind, "steps": [{"name": "s", "executor_kind": lang, "kind": kind,
                       "input": input, "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    (s.state.clone(), executor_pid(&t.db, s.step_run_id).await)
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

async fn warm_process_serves_many_jobs(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut e = demo(lang, lang, &[], None);
    e.persistent = true;
    e.concurrency = 1;
    e.max_jobs_per_process = Some(4);
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;

    // four jobs in one process, then a new one
    let mut pids = Vec::new();
    for i in 0..6 {
        let (state, pid) = run_one(&t, lang, "demo.echo", json!({"i": i})).await;
        assert_eq!(state, "succeeded");
        pids.push(pid.expect("pid"));
    }
    assert!(pids[..4].iter().all(|p| *p == pids[0]), "{pids:?}");
    assert_ne!(
        pids[4], pids[0],
        "max_jobs_per_process = 4 was not honoured: {pids:?}"
    );
    assert_eq!(pids[5], pids[4]);
    assert!(!alive(pids[0]), "the recycled process is still alive");

    // a cancel answered within the grace keeps the process
    let run = t
        .submit(
            json!({"name": "c", "steps": [{"name": "s", "executor_kind": lang, "kind": "demo.sleep",
                       "input": {"ms": 20000, "steps": 200}}]}),
        )
        .await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(step(&st, "s").state, "cancelled");
    let cancelled_pid = executor_pid(&t.db, step(&st, "s").step_run_id)
        .await
        .expect("pid");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(1)).await;
    assert_eq!(state, "succeeded");
    assert_eq!(
        pid,
        Some(cancelled_pid),
        "a process that answered its cancel was replaced"
    );

    // one that ignores the cancel is killed and replaced
    let run = t
        .submit(json!({"name": "i", "steps": [{"name": "s", "executor_kind": lang, "kind": "demo.misbehave",
                       "input": {"mode": "ignore_cancel"}}]}))
        .await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    let stubborn = executor_pid(&t.db, step(&st, "s").step_run_id)
        .await
        .expect("pid");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(2)).await;
    assert_eq!(state, "succeeded");
    assert_ne!(
        pid,
        Some(stubborn),
        "a process that ignored its cancel was reused"
    );
    assert!(!alive(stubborn));

    // a protocol violation retires the process too
    let (state, bad) = run_one(&t, lang, "demo.misbehave", json!({"mode": "backwards"})).await;
    assert_eq!(state, "terminal_failed");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(3)).await;
    assert_eq!(state, "succeeded");
    assert_ne!(pid, bad);

    let last = pid.expect("pid");
    w.shutdown().await;
    assert!(!alive(last), "a warm process outlived its worker");
    tests::assert_no_survivors(uuid::Uuid::nil(), Some(last), Duration::from_secs(5)).await;
}

tests::for_each_lang!(warm_process_serves_many_jobs);

/// The live processes whose working directory is a session directory under
/// `work_dir` (persistent sessions run in `durable-session-<executor>-…`).
fn session_processes(work_dir: &std::path::Path) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) {
            let session = cwd
                .strip_prefix(work_dir)
                .is_ok_and(|rest| rest.to_string_lossy().starts_with("durable-session-"));
            if session && alive(pid) {
                pids.push(pid);
            }
        }
    }
    pids.sort_unstable();
    pids
}

/// Waits until exactly `n` session processes run under `work_dir` and
/// `settled` holds for them; returns them.
async fn wait_sessions(
    work_dir: &std::path::Path,
    n: usize,
    settled: impl Fn(&[i32]) -> bool,
    what: &str,
) -> Vec<i32> {
    let until = std::time::Instant::now() + LONG;
    loop {
        let pids = session_processes(work_dir);
        if pids.len() == n && settled(&pids) {
            return pids;
        }
        assert!(
            std::time::Instant::now() < until,
            "{what}: session processes are {pids:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The warm processes of executor `name` idle in its pool, ready for a job
/// (`durable_executor_idle_processes`).
fn idle_processes(name: &str) -> f64 {
    tests::metric(
        &supervisor::metrics::render(),
        &format!("durable_executor_idle_processes{{executor=\"{name}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Waits until `n` warm processes of `name` are ready in its pool.
async fn wait_ready(name: &str, n: f64, what: &str) {
    let until = std::time::Instant::now() + LONG;
    while idle_processes(name) != n {
        assert!(
            std::time::Instant::now() < until,
            "{what}: {} idle processes, not {n}",
            idle_processes(name)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `warm_processes`: the worker starts that many processes of a persistent
/// executor before any job arrives, jobs run in them, and one retired after
/// its `max_jobs_per_process` is replaced without waiting for the next job.
/// Nothing of the pool survives the worker.
async fn warm_processes_are_started_ahead_and_replaced(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let name = format!("warm-{lang}");
    let mut e = demo(lang, &name, &[], None);
    e.persistent = true;
    e.concurrency = 2;
    e.warm_processes = 2;
    e.max_jobs_per_process = Some(1);
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work.path().to_path_buf());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    // before any job: two processes, started by the worker on its own
    let warm = wait_sessions(work.path(), 2, |_| true, "two warm processes at start").await;
    wait_ready(&name, 2.0, "two warm processes at start").await;

    // a job runs in one of them; that process served its one job and is
    // retired, and a new one takes its place with no job waiting for it
    let (state, pid) = run_one(&t, lang, "demo.echo", json!({"i": 1})).await;
    assert_eq!(state, "succeeded");
    let used = pid.expect("pid");
    assert!(
        warm.contains(&used),
        "the job ran in {used}, not in a warm process {warm:?}"
    );
    let refilled = wait_sessions(
        work.path(),
        2,
        |p| !p.contains(&used) && p.iter().any(|x| !warm.contains(x)),
        "the retired process replaced",
    )
    .await;
    wait_ready(&name, 2.0, "the retired process replaced").await;
    assert!(!alive(used), "the retired process {used} is still alive");

    // the next jobs run in warm processes too, one after the other and two at once
    let (state, pid) = run_one(&t, lang, "demo.echo", json!({"i": 2})).await;
    assert_eq!(state, "succeeded");
    let second = pid.expect("pid");
    assert!(refilled.contains(&second), "{second} not in {refilled:?}");
    let now = wait_sessions(
        work.path(),
        2,
        |p| !p.contains(&second),
        "the second retired process replaced",
    )
    .await;
    wait_ready(&name, 2.0, "the second retired process replaced").await;
    // two at once (long enough that both run together even on a loaded
    // host): each in one of the two warm processes
    let mut runs = Vec::new();
    for name in ["a", "b"] {
        runs.push(
            t.submit(
                json!({"name": name, "steps": [{"name": "s", "executor_kind": lang,
                  "kind": "demo.sleep", "input": {"ms": 3000, "steps": 3}}]}),
            )
            .await,
        );
    }
    let mut pair = Vec::new();
    for run in &runs {
        let st = t
            .wait_run(*run, LONG, |s| {
                s.steps.first().is_some_and(|s| s.state == "running")
            })
            .await;
        pair.push(
            executor_pid(&t.db, step(&st, "s").step_run_id)
                .await
                .expect("pid"),
        );
    }
    for run in runs {
        assert_eq!(
            step(&t.wait_terminal(run, LONG).await, "s").state,
            "succeeded"
        );
    }
    pair.sort_unstable();
    assert_eq!(pair, now, "both jobs ran in the two warm processes");
    let last = wait_sessions(
        work.path(),
        2,
        |p| p.iter().all(|x| !now.contains(x)),
        "both replaced",
    )
    .await;
    wait_ready(&name, 2.0, "both replaced").await;

    w.shutdown().await;
    for pid in &last {
        tests::assert_no_survivors(uuid::Uuid::nil(), Some(*pid), Duration::from_secs(5)).await;
    }
    assert_eq!(
        session_processes(work.path()),
        Vec::<i32>::new(),
        "a warm process outlived its worker"
    );

    // what an operator sees: every process was started ahead (2 at start,
    // then one per retired process), none by a job
    let text = supervisor::metrics::render();
    let started = |by: &str| {
        tests::metric(
            &text,
            &format!("durable_executor_processes_started_total{{executor=\"{name}\",by=\"{by}\"}}"),
        )
    };
    assert_eq!(started("warm"), Some(6.0), "{text}");
    assert_eq!(
        started("job"),
        None,
        "a job started its own process: {text}"
    );
}

tests::for_each_lang!(warm_processes_are_started_ahead_and_replaced);

/// Two one-step `demo.echo` runs and a worker with one persistent Go slot,
/// the first `accepted` event's insert sleeping 3 s (a slow database): the
/// second job starts and ends while the first one's start is being written.
async fn slow_first_start_pair(t: &TestDb) -> (Vec<uuid::Uuid>, RunningWorker) {
    sqlx::raw_sql(
        "CREATE TABLE public.slowed (at timestamptz NOT NULL DEFAULT now());
         CREATE FUNCTION public.slow_first_start() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.kind = 'accepted' AND NOT EXISTS (SELECT 1 FROM public.slowed) THEN
                 INSERT INTO public.slowed DEFAULT VALUES;
                 PERFORM pg_sleep(3);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow_first_start BEFORE INSERT ON durable.step_events
             FOR EACH ROW EXECUTE FUNCTION public.slow_first_start();",
    )
    .execute(t.db.pool())
    .await
    .expect("slow trigger");
    let mut runs = Vec::new();
    for i in 0..2 {
        runs.push(
            t.submit(
                json!({"name": "pair", "steps": [{"name": "s", "executor_kind": "go",
                     "kind": "demo.echo", "input": {"i": i}, "retry": {"max_attempts": 1}}]}),
            )
            .await,
        );
    }
    let mut e = demo("go", "go", &[], None);
    e.persistent = true;
    e.concurrency = 1;
    let mut cfg = fast_config(vec![e]);
    // a row under a slow write cannot be renewed (the heartbeat skips locked
    // rows): the lease must outlast the 3 s
    cfg.lease_ttl_ms = 20_000;
    (runs, RunningWorker::start(t.connect(10).await, cfg).await)
}

/// The executor is free as soon as its job ended: the next job does not wait
/// for the previous one's writes. The first `accepted` event's insert sleeps
/// 3 s (a slow database); with one slot, the second step is leased while the
/// first one's start is still being written. Before the fix the slot came
/// back only after the attempt's writer had finished, so the second lease
/// waited the whole 3 s (and every persistent job waited for the one before
/// it to be written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_job_does_not_wait_for_the_previous_ones_writes() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (runs, w) = slow_first_start_pair(&t).await;
    for run in &runs {
        let st = t.wait_terminal(*run, LONG).await;
        assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    }
    let slowed: i64 = t.scalar_i64("SELECT count(*) FROM public.slowed").await;
    assert_eq!(slowed, 1, "the first start was written slowly");
    let leased: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM leased_at)::float8 FROM durable.step_runs ORDER BY leased_at",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("lease times");
    assert_eq!(leased.len(), 2);
    let gap = leased[1] - leased[0];
    assert!(
        gap < 1.5,
        "the second job was leased {gap:.2} s after the first: it waited for the first one's slow start write"
    );
    w.shutdown().await;
}

/// A success without artifacts is handed to the ledger right behind its
/// start, not after the start's answer: a no-op job's start and completion
/// go in one flush. The first `accepted` insert sleeps 3 s, so the ledger is
/// busy while the second job (one slot) starts and ends; its start and its
/// completion then wait in the same batch, and commit in one transaction
/// (its `started_at` and `finished_at` are that transaction's `now()`).
/// Before, the completion was handed only once the start was answered: a
/// transaction of its own, later. Its history and events keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_rides_in_the_flush_of_its_start() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (runs, w) = slow_first_start_pair(&t).await;
    let mut ids = Vec::new();
    for run in &runs {
        let st = t.wait_terminal(*run, LONG).await;
        let s = step(&st, "s");
        assert_eq!(s.state, "succeeded", "{st:?}");
        assert_eq!(s.output, Some(json!({"i": ids.len()})), "{st:?}");
        ids.push(s.step_run_id);
    }
    w.shutdown().await;
    let slowed: i64 = t.scalar_i64("SELECT count(*) FROM public.slowed").await;
    assert_eq!(slowed, 1, "the first start was written slowly");
    let (started, finished): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT started_at, finished_at FROM durable.step_runs WHERE id = $1")
            .bind(ids[1])
            .fetch_one(t.db.pool())
            .await
            .expect("times");
    assert_eq!(
        started, finished,
        "the second job's completion was not written in its start's transaction"
    );
    for id in &ids {
        let hist: Vec<(Option<String>, String)> = sqlx::query_as(
            "SELECT from_state, to_state FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
        )
        .bind(id)
        .fetch_all(t.db.pool())
        .await
        .expect("history");
        let hist: Vec<String> = hist
            .into_iter()
            .map(|(f, to)| format!("{}>{to}", f.unwrap_or_default()))
            .collect();
        assert_eq!(
            hist,
            [
                ">pending",
                "pending>leased",
                "leased>running",
                "running>succeeded"
            ],
            "{id}"
        );
        let kinds: Vec<String> = sqlx::query_scalar(
            "SELECT kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
        )
        .bind(id)
        .fetch_all(t.db.pool())
        .await
        .expect("events");
        assert_eq!(kinds, ["accepted", "running", "succeeded"], "{id}");
    }
}

/// A persistent executor's jobs get clean job directories: artifacts and
/// input artifacts come out right job after job (nothing of an earlier
/// job's output_dir or inputs reaches a later one), and no job's directory
/// stays in `work_dir` after it (at most one per lease while one runs, each
/// empty).
async fn persistent_jobs_get_clean_job_directories(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let mut e = demo(lang, lang, &[], None);
    e.persistent = true;
    e.concurrency = 1;
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work.path().to_path_buf());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    for (raw, more) in [("abc", "XYZ"), ("de", "UV"), ("f", "W")] {
        let run = t
            .submit(json!({"name": "chain", "steps": [
                {"name": "make", "executor_kind": lang, "kind": "demo.artifact",
                 "input": {"name": "raw.txt", "content": raw}},
                {"name": "derive", "executor_kind": lang, "kind": "demo.artifact",
                 "input": {"name": "derived.txt", "content": more}, "depends_on": ["make"]}]}))
            .await;
        let st = t.wait_terminal(run, LONG).await;
        assert_eq!(st.state, "succeeded", "{st:?}");
        let made = &step(&st, "make").artifacts;
        let derived = &step(&st, "derive").artifacts;
        assert_eq!((made.len(), derived.len()), (1, 1), "{st:?}");
        assert_eq!(made[0].size, raw.len() as i64);
        assert_eq!(
            derived[0].size,
            (raw.len() + more.len()) as i64,
            "derived = this run's input bytes + content, nothing older"
        );
        let (state, _) = run_one(&t, lang, "demo.echo", json!({"after": raw})).await;
        assert_eq!(state, "succeeded");
    }

    let job_dirs: Vec<std::path::PathBuf> = std::fs::read_dir(work.path())
        .expect("work dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("durable-job-"))
        })
        .collect();
    assert!(
        job_dirs.len() <= 2,
        "more spares than leases can hold: {job_dirs:?}"
    );
    for d in &job_dirs {
        let names: Vec<String> = std::fs::read_dir(d)
            .expect("job dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.is_empty(), "{}: {names:?}", d.display());
    }
    w.shutdown().await;
    let left: Vec<_> = std::fs::read_dir(work.path())
        .expect("work dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "left in work_dir by the stopped worker: {left:?}"
    );
}

tests::for_each_lang!(persistent_jobs_get_clean_job_directories);

/// No two jobs of a warm process share a job directory path or an `out/`:
/// a thread an earlier job left running, writing into that job's
/// `output_dir` by its path after the job ended, or a child it started in
/// that directory or in its parent, writes nowhere, not into the next job's
/// results (outside audits 77 #1, 79 #1, 80 #1: the next job's artifact was
/// replaced and the step failed for good with ARTIFACT_DIGEST_MISMATCH).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_jobs_late_writer_cannot_touch_the_next_jobs_output() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let e = supervisor::config::ExecutorConfig {
        name: "leftover".into(),
        command: tests::python().to_string_lossy().into_owned(),
        args: vec![tests::repo_root()
            .join("tests/executors/leftover.py")
            .to_string_lossy()
            .into_owned()],
        persistent: true,
        concurrency: 1,
        ..supervisor::config::ExecutorConfig::default()
    };
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work.path().to_path_buf());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    for (i, how) in ["path", "cwd", "parent", "path"].iter().enumerate() {
        let run = t
            .submit(json!({"name": format!("late-{i}"), "steps": [
                {"name": "leave", "executor_kind": "leftover", "kind": "leftover.leave",
                 "input": {"after_ms": 300, "how": how}},
                {"name": "victim", "executor_kind": "leftover", "kind": "leftover.victim",
                 "input": {"hold_ms": 900}, "depends_on": ["leave"]}]}))
            .await;
        let st = t.wait_terminal(run, LONG).await;
        assert_eq!(st.state, "succeeded", "{how}: {st:?}");
        let (leave, victim) = (step(&st, "leave"), step(&st, "victim"));
        let dir = |s: &supervisor::db::StepStatus| {
            s.output
                .as_ref()
                .and_then(|o| o["dir"].as_str())
                .map(str::to_owned)
                .expect("dir")
        };
        assert_ne!(dir(leave), dir(victim), "one path for two jobs");
        assert_eq!(victim.artifacts.len(), 1, "{st:?}");
        assert_eq!(
            victim.artifacts[0].size, 4,
            "the artifact is not the job's own"
        );
    }
    w.shutdown().await;
}

/// `idle_timeout_ms`: after a burst, the processes idle that long beyond
/// `warm_processes` are retired, so the pool shrinks back instead of keeping
/// `concurrency` processes for ever; the warm one stays and serves the next
/// job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_processes_beyond_the_warm_ones_are_retired() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let mut e = demo("go", "shrink-go", &[], None);
    e.persistent = true;
    e.concurrency = 3;
    e.warm_processes = 1;
    e.idle_timeout_ms = 500;
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work.path().to_path_buf());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    // a burst of three at once: three processes
    let mut runs = Vec::new();
    for name in ["a", "b", "c"] {
        runs.push(
            t.submit(
                json!({"name": name, "steps": [{"name": "s", "executor_kind": "go",
                "kind": "demo.sleep", "input": {"ms": 1500, "steps": 3}}]}),
            )
            .await,
        );
    }
    wait_sessions(work.path(), 3, |_| true, "three processes for the burst").await;
    for run in &runs {
        assert_eq!(t.wait_terminal(*run, LONG).await.state, "succeeded");
    }
    // then back to the one kept warm
    let left = wait_sessions(work.path(), 1, |_| true, "the idle surplus retired").await;
    let (state, pid) = run_one(&t, "go", "demo.echo", json!({"after": "burst"})).await;
    assert_eq!(state, "succeeded");
    assert_eq!(pid, Some(left[0]), "the warm process served the next job");
    w.shutdown().await;
}

/// A warm process that dies while idle (an OOM kill, a stray signal) is
/// reaped, taken out of the pool and replaced without waiting for a job:
/// before, it stayed a zombie counted as ready (`idle_processes`), and the
/// next job paid a cold start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_process_that_dies_while_idle_is_reaped_and_replaced() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let name = "warm-dies";
    let mut e = demo("go", name, &[], None);
    e.persistent = true;
    e.concurrency = 2;
    e.warm_processes = 1;
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work.path().to_path_buf());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let warm = wait_sessions(work.path(), 1, |_| true, "one warm process").await;
    wait_ready(name, 1.0, "one warm process").await;

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(warm[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the idle process");
    let now = wait_sessions(
        work.path(),
        1,
        |p| !p.contains(&warm[0]),
        "the dead idle process replaced",
    )
    .await;
    wait_ready(name, 1.0, "the dead idle process replaced").await;
    let until = std::time::Instant::now() + LONG;
    while std::path::Path::new(&format!("/proc/{}", warm[0])).exists() {
        assert!(
            std::time::Instant::now() < until,
            "the dead process {} is not reaped",
            warm[0]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // and the next job runs in the replacement
    let (state, pid) = run_one(&t, "go", "demo.echo", json!({"i": 1})).await;
    assert_eq!(state, "succeeded");
    assert_eq!(pid, Some(now[0]));
    w.shutdown().await;
}

/// A worker whose Go executor `name` keeps two warm processes (concurrency
/// 2, `tweak` applied to its config), both SIGSTOPped once ready; their pids.
async fn stopped_warm_pool(
    t: &TestDb,
    work_dir: &std::path::Path,
    name: &str,
    tweak: impl FnOnce(&mut supervisor::config::WorkerConfig),
) -> (RunningWorker, Vec<i32>) {
    let mut e = demo("go", name, &[], None);
    e.persistent = true;
    e.concurrency = 2;
    e.warm_processes = 2;
    let mut cfg = fast_config(vec![e]);
    cfg.work_dir = Some(work_dir.to_path_buf());
    tweak(&mut cfg);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let warm = wait_sessions(work_dir, 2, |_| true, "two warm processes").await;
    wait_ready(name, 2.0, "two warm processes").await;
    for pid in &warm {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .expect("stop an idle process");
    }
    (w, warm)
}

/// Warm processes stopped by a signal while idle (SIGSTOP, SIGTSTP, a
/// debugger) are not handed a job: each is taken out of the pool, ended and
/// replaced. Before, a job went to a stopped process, waited there for
/// `handshake_timeout_ms` and the stop's graces, and was given back; two such
/// processes kept a step waiting 34 s (persistent-pool audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_idle_warm_processes_are_replaced_not_handed_a_job() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let name = "warm-stopped";
    let (w, warm) = stopped_warm_pool(&t, work.path(), name, |cfg| {
        cfg.handshake_timeout_ms = 1_000;
    })
    .await;

    let run = t
        .submit(
            json!({"name": "after-stop", "steps": [{"name": "s", "executor_kind": "go",
                       "kind": "demo.echo", "input": {"i": 1}, "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded");
    let (attempt, refusals, uncounted): (i32, i32, i32) = sqlx::query_as(
        "SELECT attempt, refusals, uncounted_attempts FROM durable.step_runs WHERE id = $1",
    )
    .bind(s.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("the step's counters");
    assert_eq!(
        (attempt, refusals, uncounted),
        (1, 0, 0),
        "the job went to a process that could answer it at once"
    );
    let pid = executor_pid(&t.db, s.step_run_id).await.expect("its pid");
    assert!(
        !warm.contains(&pid),
        "a stopped process ({pid}) took the job"
    );
    // the stopped ones are ended and reaped, the pool refilled
    let until = std::time::Instant::now() + LONG;
    while warm
        .iter()
        .any(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
    {
        assert!(
            std::time::Instant::now() < until,
            "a stopped idle process is left: {warm:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_ready(name, 2.0, "the pool refilled").await;
    w.shutdown().await;
}

/// A worker stopping with idle warm processes stopped by a signal ends them
/// at once: a stopped process reads no `Shutdown`, so no grace is waited for
/// it, and the idle processes are retired together. Before, each one added
/// its `cancel_grace_ms` to the stop, one after the other (re-check audit:
/// 4 stopped processes, 8 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_worker_waits_no_grace_for_stopped_idle_processes() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    let (w, warm) = stopped_warm_pool(&t, work.path(), "warm-stopped-at-stop", |cfg| {
        // far above what the stop takes without a grace
        cfg.cancel_grace_ms = 5_000;
        cfg.lease_ttl_ms = 10_000;
    })
    .await;
    let started = std::time::Instant::now();
    w.shutdown().await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "the stop took {took:?}: a cancel grace was waited for a stopped process"
    );
    for pid in &warm {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "the stopped process {pid} outlived the worker"
        );
    }
}

/// With `max_jobs_per_process = 1` and a warm process, a chain of jobs
/// longer than a process start never waits for one: a process serving its
/// last job is not counted as coming back, so the keeper starts its
/// replacement while it runs (persistent-pool audit: 4 of a chain of 10
/// steps started their own process, the replacement being started only once the
/// last one was retired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_on_its_last_job_is_replaced_while_it_runs() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut py = tests::python_demo("python", &[], None);
    py.persistent = true;
    py.max_jobs_per_process = Some(1);
    py.warm_processes = 1;
    py.concurrency = 1;
    let mut cfg = fast_config(vec![py]);
    cfg.metrics_addr = Some("127.0.0.1:0".into());
    let mut w = tests::WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let addr = w.metrics_addr(Duration::from_secs(30)).await;
    // the pool is warm before the backlog arrives
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, text) = tests::http_get(addr, "/metrics").await;
        if tests::metric(
            &text,
            "durable_executor_idle_processes{executor=\"python\"}",
        ) == Some(1.0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the pool did not warm up:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // a chain: each job is leased a moment after the one before ended
    let steps: Vec<serde_json::Value> = (0..6)
        .map(|i| {
            let mut s = json!({"name": format!("s{i}"), "executor_kind": "python",
                               "kind": "demo.sleep", "input": {"ms": 300, "steps": 1}});
            if i > 0 {
                s["depends_on"] = json!([format!("s{}", i - 1)]);
            }
            s
        })
        .collect();
    t.submit(json!({"name": "chain", "steps": steps})).await;
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while t
        .scalar_i64("SELECT count(*) FROM durable.step_runs WHERE state <> 'succeeded'")
        .await
        > 0
    {
        assert!(std::time::Instant::now() < until, "the steps did not end");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, text) = tests::http_get(addr, "/metrics").await;
    let by = |how: &str| {
        tests::metric(
            &text,
            &format!(
                "durable_executor_processes_started_total{{executor=\"python\",by=\"{how}\"}}"
            ),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        by("job"),
        0.0,
        "a job waited for a start of its own:\n{text}"
    );
    assert!(by("warm") >= 6.0, "{text}");
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(30)).await, Some(0));
}
