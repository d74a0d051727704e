//! An executor command that cannot be started (gone mid-deploy, say) is
//! "this worker can't", not a failed attempt: the step is refused
//! (`SPAWN_FAILED`, uncounted) and the worker leases nothing more for that
//! executor until a probe process starts again. Before, every start that
//! failed counted as an attempt, so a worker with a broken executor failed
//! each step it took, fast, and more than its share while a healthy worker
//! waited beside it (an outside audit: 12 of 20 runs failed).

use std::time::Duration;

use serde_json::json;
use tests::{fast_config, go_demo, RunningWorker, TestDb};

/// The one-step run `run` (its step `a`) waits, its step refused once or
/// twice and no attempt counted: the breaker held the rest back.
async fn waits_refused_uncounted(t: &TestDb, run: uuid::Uuid) -> supervisor::db::StepStatus {
    let st = t.status(run).await;
    let a = tests::step(&st, "a").clone();
    assert_eq!(
        st.state,
        "pending",
        "the run waits for a worker that can start its executor: {}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    let (attempts, uncounted, refusals): (i32, i32, i32) = sqlx::query_as(
        "SELECT attempt, uncounted_attempts, refusals FROM durable.step_runs WHERE id = $1",
    )
    .bind(a.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("step");
    assert_eq!(
        attempts - uncounted,
        0,
        "no counted attempt ({attempts} attempts, {uncounted} uncounted)"
    );
    assert!(
        (1..=2).contains(&refusals),
        "refused once, then not leased while the breaker is open: {refusals} refusals"
    );
    a
}

/// A worker config whose one executor is a copy of the Go demo in `dir`
/// (the copy's path, to remove and restore it), refusal_delay_ms 300.
fn removable_go_demo(
    dir: &std::path::Path,
) -> (std::path::PathBuf, supervisor::config::WorkerConfig) {
    let exe = dir.join("demo-go");
    std::fs::copy(tests::go_executor(), &exe).expect("copy the demo executor");
    let mut ecfg = go_demo("go", &[], None);
    ecfg.command = exe.to_string_lossy().into_owned();
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 300;
    (exe, cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_executor_command_refuses_and_pauses_instead_of_failing_steps() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (exe, cfg) = removable_go_demo(dir.path());
    let t = TestDb::new().await;
    // the worker probes its executor at start: the command is there then
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    std::fs::remove_file(&exe).expect("remove the command");

    let run = t
        .submit(json!({"name": "broken", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1},
             "retry": {"max_attempts": 2, "initial_interval_ms": 50}}]}))
        .await;
    // long enough for a counted failure to have used both attempts many
    // times over, and for several probes to have failed
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let a = waits_refused_uncounted(&t, run).await;
    let codes: Vec<String> = sqlx::query_scalar(
        "SELECT reason FROM durable.transitions WHERE step_run_id = $1 AND from_state = 'leased'
            AND to_state = 'retryable_failed'",
    )
    .bind(a.step_run_id)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    assert!(
        !codes.is_empty() && codes.iter().all(|c| c.contains("SPAWN_FAILED")),
        "each refusal says why: {codes:?}"
    );

    // the command is back: a probe starts, the step runs, one counted attempt
    std::fs::copy(tests::go_executor(), &exe).expect("restore the command");
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(
        st.state,
        "succeeded",
        "{}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    let (attempts, uncounted): (i32, i32) =
        sqlx::query_as("SELECT attempt, uncounted_attempts FROM durable.step_runs WHERE id = $1")
            .bind(a.step_run_id)
            .fetch_one(t.db.pool())
            .await
            .expect("step");
    assert_eq!(
        attempts - uncounted,
        1,
        "one counted attempt: the one that ran"
    );
    w.shutdown().await;
}

/// `status` says why a step waits when every live worker that offers it
/// has paused the executor that would run it: who, since when, and why
/// (left open by the routing audit: it read only "due since …: waiting for
/// a worker to lease it"); the pause is cleared once the executor starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_workers_that_paused_a_steps_executor_and_why() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (exe, mut cfg) = removable_go_demo(dir.path());
    cfg.name = Some("w-paused".into());
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    std::fs::remove_file(&exe).expect("remove the command");
    let run = t
        .submit(json!({"name": "paused", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1}}]}))
        .await;

    let status = |json: bool| {
        let mut args = vec!["status".to_string(), run.to_string()];
        if json {
            args.push("--json".into());
        }
        let o = std::process::Command::new(tests::supervisor_bin())
            .args(&args)
            .env("DATABASE_URL", &t.url)
            .env("RUST_LOG", "error")
            .output()
            .expect("status");
        assert_eq!(o.status.code(), Some(0), "{o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = status(false);
        if text.contains("has paused it") {
            break text;
        }
        assert!(std::time::Instant::now() < until, "{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        text.contains(
            "a: every live worker that offers executor_kind \"go\", kind \"demo.echo\" has paused it (worker w-paused executor go since "
        ) && text.contains(": cannot be started: ")
            && text.contains("it waits for one to resume"),
        "{text}"
    );
    assert!(!text.contains("no live worker offers"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&status(true)).expect("json");
    let by = &v["steps"][0]["offering_workers_paused"][0];
    assert_eq!(by["worker"], "w-paused", "{v}");
    assert_eq!(by["executor"], "go", "{v}");
    assert!(
        by["why"]
            .as_str()
            .is_some_and(|w| w.starts_with("cannot be started: ")),
        "{v}"
    );

    // the command is back: the probe starts it, the pause is cleared
    std::fs::copy(tests::go_executor(), &exe).expect("restore the command");
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let paused: serde_json::Value =
            sqlx::query_scalar("SELECT paused FROM durable.workers WHERE name = 'w-paused'")
                .fetch_one(t.db.pool())
                .await
                .expect("paused");
        if paused == json!({}) {
            break;
        }
        assert!(std::time::Instant::now() < until, "still paused: {paused}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.shutdown().await;
}

/// An executor that exits before its hello (a host limit: no thread for its
/// runtime, `ulimit -u`) has not been sent a job: the attempt is "this
/// worker can't" (SPAWN_FAILED, uncounted) and the executor's breaker
/// opens, as for a command that cannot be started. It counted as an attempt
/// (HANDSHAKE_FAILED, retryable) and used a step's attempts in two seconds,
/// failing its run (resource audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_exits_before_its_hello_refuses_and_pauses() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let flag = dir.path().join("broken");
    let ecfg = go_demo_after(&format!(
        "[ -e '{}' ] && {{ echo 'runtime: failed to create new OS thread' >&2; exit 2; }}",
        flag.display()
    ));
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 300;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    std::fs::write(&flag, "").expect("flag");

    let run = t
        .submit(json!({"name": "no-hello", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1},
             "retry": {"max_attempts": 2, "initial_interval_ms": 50}}]}))
        .await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    waits_refused_uncounted(&t, run).await;
    std::fs::remove_file(&flag).expect("unflag");
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    w.shutdown().await;
}

/// An executor whose processes give no valid hello once the worker runs (a
/// banner printed to stdout before it, or no hello at all within
/// handshake_timeout_ms) has not been sent a job either: as for one that
/// exits first, the step is refused uncounted (SPAWN_FAILED) and the
/// executor paused until a probe process says a valid hello. It counted as
/// an attempt (HANDSHAKE_FAILED, retryable): one broken deploy failed a
/// run's steps in seconds (third-party audit: an 8-step run failed in 4 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_gives_no_valid_hello_refuses_and_pauses() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mode = dir.path().join("mode");
    let ecfg = go_demo_after(&format!(
        "m=$(cat '{f}' 2>/dev/null)\n\
         [ \"$m\" = banner ] && printf 'starting up...\\n'\n\
         [ \"$m\" = silent ] && exec sleep 30",
        f = mode.display()
    ));
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 300;
    cfg.handshake_timeout_ms = 700;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    for (n, how) in ["banner", "silent"].into_iter().enumerate() {
        std::fs::write(&mode, how).expect("mode");
        let run = t
            .submit(json!({"name": format!("no valid hello: {how}"), "steps": [
                {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"x": n},
                 "retry": {"max_attempts": 2, "initial_interval_ms": 50}}]}))
            .await;
        tokio::time::sleep(Duration::from_millis(3_000)).await;
        let a = waits_refused_uncounted(&t, run).await;
        let e = a.error.as_ref().expect("the refusal's error");
        assert_eq!(e.code, "SPAWN_FAILED", "{how}: {e:?}");
        std::fs::remove_file(&mode).expect("a valid hello again");
        let st = t.wait_terminal(run, Duration::from_secs(60)).await;
        assert_eq!(st.state, "succeeded", "{how}");
        assert_eq!(tests::step(&st, "a").output, Some(json!({"x": n})), "{how}");
    }
    w.shutdown().await;
}

/// A work_dir that takes no directory (full, read-only, gone) pauses the
/// worker's leasing until a probe directory can be made: only the steps in
/// flight are refused (WORK_DIR_UNAVAILABLE, uncounted), the rest wait.
/// Before, every step the worker leased was refused, again every few
/// seconds, and a disk full for 20 s failed its whole backlog
/// EXECUTOR_REFUSED (resource audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_dir_that_takes_no_directory_pauses_leasing() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let real = dir.path().join("real");
    std::fs::create_dir(&real).expect("work dir");
    let link = dir.path().join("work");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.work_dir = Some(link.clone());
    cfg.refusal_delay_ms = 300;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    // the work_dir is gone (a volume unmounted): no directory can be made
    std::fs::remove_file(&link).expect("unlink");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &link).expect("dangling symlink");

    let one = |i: u32| {
        json!({"name": format!("r{i}"), "steps": [
        {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"i": i}}]})
    };
    let first = t.submit(one(0)).await;
    let id = tests::only_step_id(&t, first).await;
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while t
        .scalar_i64(&format!(
            "SELECT refusals::int8 FROM durable.step_runs WHERE id = '{id}'"
        ))
        .await
        == 0
    {
        assert!(
            std::time::Instant::now() < until,
            "the step was never refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut runs = vec![first];
    for i in 1..=4 {
        runs.push(t.submit(one(i)).await);
    }
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let leased = t
        .scalar_i64(
            "SELECT count(DISTINCT step_run_id) FROM durable.transitions WHERE to_state = 'leased'",
        )
        .await;
    assert_eq!(
        leased, 1,
        "nothing more was leased while the work_dir took no directory"
    );
    let reason: String = sqlx::query_scalar(
        "SELECT reason FROM durable.transitions WHERE step_run_id = $1 AND to_state = 'retryable_failed'",
    )
    .bind(id)
    .fetch_one(t.db.pool())
    .await
    .expect("history");
    assert!(reason.contains("WORK_DIR_UNAVAILABLE"), "{reason}");

    // the volume is back: a probe directory is made, and everything runs
    std::fs::remove_file(&link).expect("unlink");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    for run in runs {
        let st = t.wait_terminal(run, Duration::from_secs(60)).await;
        assert_eq!(st.state, "succeeded", "{run}");
    }
    w.shutdown().await;
}

/// The Go demo, started after `script` (a shell script that may exit
/// first, as a start that fails before its hello).
fn go_demo_after(script: &str) -> supervisor::config::ExecutorConfig {
    tests::wrap_in_shell(
        go_demo("go", &[], None),
        &format!("{script}\nexec \"$0\" \"$@\""),
    )
}

/// An executor that fails before its hello on every `nth` start (a counter
/// in `dir`), and otherwise runs the Go demo.
fn flaky_executor(dir: &std::path::Path, nth: u32) -> supervisor::config::ExecutorConfig {
    let count = dir.join("starts");
    go_demo_after(&format!(
        "n=$(cat '{c}' 2>/dev/null || echo 0); n=$((n + 1)); echo $n > '{c}'\n\
         [ $((n % {nth})) -eq 0 ] && {{ echo 'crashed at start' >&2; exit 2; }}",
        c = count.display()
    ))
}

/// Refusals that are the host's (SPAWN_FAILED here) never fail a step: an
/// executor that failed every third start had the first step in line
/// refused until `max_refusals` and failed EXECUTOR_REFUSED, with its run
/// (re-check audit). They are still counted in `refusals`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_failing_every_third_start_fails_no_step() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ecfg = flaky_executor(dir.path(), 3);
    ecfg.concurrency = 2;
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 100;
    cfg.max_refusals = 1;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let steps: Vec<serde_json::Value> = (0..6)
        .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "demo.echo", "input": {"i": i}}))
        .collect();
    let run = t.submit(json!({"name": "flaky", "steps": steps})).await;
    let st = t.wait_terminal(run, Duration::from_secs(90)).await;
    w.shutdown().await;
    for s in &st.steps {
        assert_eq!(s.state, "succeeded", "{}: {:?}", s.name, s.error);
    }
    let refused = t
        .scalar_i64(&format!(
            "SELECT sum(refusals)::int8 FROM durable.step_runs WHERE run_id = '{run}'"
        ))
        .await;
    assert!(refused > 0, "the failed starts were refusals, counted");
}

/// A persistent executor whose starts fail every other time, one job per
/// process, one at a time: the breaker's probe took every good start and was
/// stopped after its hello, so every job's own start was a bad one, refused
/// (uncounted) and the breaker opened again: the steps waited for ever. The
/// probe's process is now kept for the next job, and a step refused for a
/// failed start is not held off from this worker (5 s at least), past the
/// pool's idle timeout that retired the kept probe (re-check audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_executor_failing_every_other_start_runs_every_step() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ecfg = flaky_executor(dir.path(), 2);
    ecfg.persistent = true;
    ecfg.warm_processes = 0;
    ecfg.max_jobs_per_process = Some(1);
    ecfg.concurrency = 1;
    ecfg.idle_timeout_ms = 1_000;
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 100;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let steps: Vec<serde_json::Value> = (0..3)
        .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "demo.echo", "input": {"i": i}}))
        .collect();
    let run = t
        .submit(json!({"name": "every-other", "steps": steps}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(30)).await;
    w.shutdown().await;
    for s in &st.steps {
        assert_eq!(s.state, "succeeded", "{}: {:?}", s.name, s.error);
    }
    let starts: u32 = std::fs::read_to_string(dir.path().join("starts"))
        .expect("the start counter")
        .trim()
        .parse()
        .expect("a count");
    assert!(
        starts >= 4,
        "starts failed and were probed: {starts} starts"
    );
}

/// A persistent executor whose processes die before their hello: neither a
/// job's start nor the warm pool's closes the breaker by spawning a process
/// (only a hello does), so nothing more is leased while no process can say
/// hello. Each spawn closed it, and the step was leased and refused again
/// after every warm start (re-check audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_executor_that_cannot_say_hello_is_not_leased_for() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let flag = dir.path().join("broken");
    let mut ecfg = go_demo_after(&format!("[ -e '{}' ] && exit 1", flag.display()));
    ecfg.persistent = true;
    ecfg.warm_processes = 1;
    ecfg.max_jobs_per_process = Some(1);
    ecfg.concurrency = 2;
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 500;
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    std::fs::write(&flag, "").expect("flag");
    // no process can say hello from now on (a warm one started before may
    // serve one job); the warm pool keeps trying, with its own backoff
    let run = t
        .submit(json!({"name": "r", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {}}]}))
        .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let refusals = t
        .scalar_i64(&format!(
            "SELECT refusals::int8 FROM durable.step_runs WHERE run_id = '{run}'"
        ))
        .await;
    assert!(
        refusals <= 1,
        "leased and refused again while no process could say hello: {refusals} refusals"
    );
    std::fs::remove_file(&flag).expect("unflag");
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    w.shutdown().await;
}

/// A persistent executor of which only one process may run at a time (it
/// takes a lock at start: a device, a fixed port) and whose warm process is
/// alive and idle: a second process exits before its hello, which opens the
/// breaker, and every probe after that (a new process) failed the same way
/// while the idle process that could serve the jobs sat in the pool: the
/// executor was paused for good and its steps waited for ever. An idle
/// process that said its hello is a started process: the breaker closes on
/// it, and every step runs on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_warm_process_closes_the_breaker_its_probes_cannot() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = dir.path().join("one-at-a-time");
    let mut ecfg = tests::wrap_in_shell(
        go_demo("go", &[], None),
        &format!("exec flock -n '{}' \"$0\" \"$@\"", lock.display()),
    );
    ecfg.persistent = true;
    ecfg.warm_processes = 1;
    ecfg.concurrency = 2;
    let mut cfg = fast_config(vec![ecfg]);
    cfg.db_max_connections = 4;
    cfg.refusal_delay_ms = 200;
    let t = TestDb::new().await;
    // in the queue before the worker starts: its first lease takes two, so
    // a second process is started beside the warm one
    let mut runs = Vec::new();
    for i in 0..6 {
        runs.push(
            t.submit(json!({"name": format!("r{i}"), "steps": [
                {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"i": i}}]}))
                .await,
        );
    }
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    for run in runs {
        let st = t.wait_terminal(run, Duration::from_secs(45)).await;
        assert_eq!(
            st.state,
            "succeeded",
            "{}",
            serde_json::to_string_pretty(&st).unwrap_or_default()
        );
    }
    w.shutdown().await;
}

/// A persistent executor's process that exits before its hello with
/// nothing on stderr: the pause says how it ended (audit 86: "exited or
/// closed stdout before its hello; stderr: ." gave no exit status, where
/// the worker's start-up probe's message did), the step's start and the
/// breaker's probes alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_that_exits_before_its_hello_says_how_it_ended() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let count = dir.path().join("starts");
    // the worker's probe (the first start) says its hello; every later
    // start exits 3 first, silently
    let mut ecfg = go_demo_after(&format!(
        "n=$(cat '{c}' 2>/dev/null || echo 0); n=$((n + 1)); echo $n > '{c}'\n\
         [ $n -ge 2 ] && exit 3",
        c = count.display()
    ));
    ecfg.persistent = true;
    let mut cfg = fast_config(vec![ecfg]);
    cfg.name = Some("w-exit3".into());
    let t = TestDb::new().await;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    // its start exits 3 (a refusal: SPAWN_FAILED), the breaker's probes too
    t.submit(json!({"name": "one", "steps": [
        {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {}}]}))
        .await;
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let why = loop {
        let paused: serde_json::Value =
            sqlx::query_scalar("SELECT paused FROM durable.workers WHERE name = 'w-exit3'")
                .fetch_one(t.db.pool())
                .await
                .expect("paused");
        let text = paused.to_string();
        if text.contains("then it exited with code 3") {
            break text;
        }
        assert!(std::time::Instant::now() < until, "never paused: {paused}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    w.shutdown().await;
    assert!(why.contains("before its hello"), "{why}");
    assert!(!why.contains("stderr: ."), "{why}");
}
