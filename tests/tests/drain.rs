//! `supervisor worker` runs until SIGTERM/SIGINT, then drains: no new leases,
//! running attempts may finish within drain_timeout_ms, then they are stopped
//! (WORKER_SHUTDOWN, retryable) — exit 0 either way, and no child survives;
//! exit 1 when an outcome could not be recorded during the drain.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::json;
use tests::{fast_config, go_demo, python_demo, TestDb, WorkerProcess};

async fn wait_running(t: &TestDb, run: uuid::Uuid) -> uuid::Uuid {
    let st = t
        .wait_run(run, Duration::from_secs(30), |s| {
            s.steps.first().is_some_and(|s| s.state == "running")
        })
        .await;
    st.steps[0].step_run_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_running_attempt_finish_then_exits_zero() {
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![go_demo("go", &[], None)]));
    let run = t
        .submit(tests::one_step(
            "drain",
            "go",
            "demo.sleep",
            json!({"ms": 1500, "steps": 3}),
        ))
        .await;
    let step = wait_running(&t, run).await;
    w.signal(Signal::SIGTERM);
    // a step submitted during the drain is not taken
    let late = t
        .submit(tests::one_step("late", "go", "demo.echo", json!({})))
        .await;
    let code = w.wait(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "clean drain exits 0; stderr: {}", w.stderr());
    assert_eq!(
        t.status(run).await.state,
        "succeeded",
        "the running attempt finished"
    );
    assert_eq!(
        t.status(late).await.steps[0].state,
        "pending",
        "nothing new was leased while draining"
    );
    tests::assert_no_survivors(step, None, Duration::from_secs(1)).await;
    let stopped = t
        .scalar_i64("SELECT count(*) FROM durable.workers WHERE stopped_at IS NOT NULL")
        .await;
    assert_eq!(stopped, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_timeout_stops_the_child_and_the_step_goes_back_to_the_queue() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![python_demo("py", &[], None)]);
    cfg.drain_timeout_ms = 300;
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(json!({"name": "long", "steps": [{"name": "s", "executor_kind": "python", "kind": "demo.sleep",
            "input": {"ms": 60000, "steps": 600}, "retry": {"max_attempts": 3, "initial_interval_ms": 0}}]}))
        .await;
    let step = wait_running(&t, run).await;
    let pgid = tests::executor_pid(&t.db, step).await;
    assert!(pgid.is_some(), "the executor pid is recorded");
    w.signal(Signal::SIGINT);
    let code = w.wait(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "stderr: {}", w.stderr());
    let st = t.status(run).await;
    assert_eq!(st.steps[0].state, "retryable_failed");
    assert_eq!(
        st.steps[0].error.as_ref().map(|e| e.code.as_str()),
        Some("WORKER_SHUTDOWN")
    );
    // the released attempt ends with its event, as every attempt the
    // supervisor ends (it stopped at its last progress before)
    let last: (String, String) = sqlx::query_as(
        "SELECT kind, message FROM durable.step_events
          WHERE step_run_id = $1 AND attempt = 1 ORDER BY sequence DESC LIMIT 1",
    )
    .bind(step)
    .fetch_one(t.db.pool())
    .await
    .expect("events");
    assert_eq!(last.0, "retryable_failed", "{last:?}");
    assert!(last.1.starts_with("WORKER_SHUTDOWN: "), "{last:?}");
    // the history names it as the events and status do (DAG audit: it
    // said RELEASED there, WORKER_SHUTDOWN here)
    let reason: String = sqlx::query_scalar(
        "SELECT reason FROM durable.transitions WHERE step_run_id = $1 ORDER BY id DESC LIMIT 1",
    )
    .bind(step)
    .fetch_one(t.db.pool())
    .await
    .expect("history");
    assert_eq!(reason, "WORKER_SHUTDOWN: given back uncounted");
    tests::assert_no_survivors(step, pgid, Duration::from_secs(1)).await;
}

/// A worker (20 s graces, a 60 s lease, the given drain timeout) running a
/// step whose executor ignores cancels: the worker, the run, the step and
/// the executor's process group.
async fn ignoring_cancels(
    t: &TestDb,
    drain_timeout_ms: u64,
) -> (WorkerProcess, uuid::Uuid, uuid::Uuid, Option<i32>) {
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.drain_timeout_ms = drain_timeout_ms;
    cfg.lease_ttl_ms = 60_000;
    cfg.cancel_grace_ms = 20_000;
    cfg.term_grace_ms = 20_000;
    let w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(
            json!({"name": "long", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.misbehave", "input": {"mode": "ignore_cancel"},
            "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let step = wait_running(t, run).await;
    let pgid = tests::executor_pid(&t.db, step).await;
    (w, run, step, pgid)
}

/// A second SIGTERM stops running attempts at once, without the graces, and
/// still gives their steps back (uncounted, WORKER_SHUTDOWN) before the
/// worker exits 0; no child survives. Before, the second signal SIGKILLed
/// every child and exited 1, leaving the steps `running` until their leases
/// expired, each then counted as a failed attempt (LEASE_EXPIRED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_stops_attempts_at_once_and_gives_their_steps_back() {
    let t = TestDb::new().await;
    let (mut w, run, step, pgid) = ignoring_cancels(&t, 60_000).await;
    let asked = std::time::Instant::now();
    w.signal(Signal::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(30)).await;
    let took = asked.elapsed();
    assert_eq!(code, Some(0), "stderr: {}", w.stderr());
    assert!(
        took < Duration::from_secs(15),
        "stopped without waiting out the 20 s graces: {took:?}"
    );
    let st = t.status(run).await;
    let s = &st.steps[0];
    assert_eq!(s.state, "retryable_failed", "given back, not failed: {s:?}");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("WORKER_SHUTDOWN")
    );
    // no grace was given, and the message does not say one was (audit 81)
    let message = s
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    assert!(
        message
            .contains("the executor gave no terminal before a second stop signal ended its grace")
            && !message.contains("within its grace"),
        "{message}"
    );
    tests::assert_no_survivors(step, pgid, Duration::from_secs(1)).await;
}

/// A second SIGTERM also ends a grace that already runs: here the drain
/// timeout stopped the attempt first and its 20 s cancel grace was running
/// (audit 83: the grace ran on, and past the forced exit's 10 s the worker
/// exited 1 with the step left `running` until its lease expired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_a_grace_the_drain_timeout_started() {
    let t = TestDb::new().await;
    let (mut w, run, step, pgid) = ignoring_cancels(&t, 500).await;
    w.signal(Signal::SIGTERM);
    // the drain timeout passes and the attempt's cancel grace starts
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !w.stderr().contains("drain timeout") {
        assert!(std::time::Instant::now() < until, "{}", w.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = std::time::Instant::now();
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(30)).await;
    let took = asked.elapsed();
    assert_eq!(code, Some(0), "stderr: {}", w.stderr());
    assert!(
        took < Duration::from_secs(5),
        "the running grace was not ended: {took:?}"
    );
    let st = t.status(run).await;
    let s = &st.steps[0];
    assert_eq!(
        s.state, "retryable_failed",
        "given back, not left running: {s:?}"
    );
    let message = s
        .error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default();
    assert!(
        message.contains("before a second stop signal ended its grace"),
        "{message}"
    );
    tests::assert_no_survivors(step, pgid, Duration::from_secs(1)).await;
}

/// A drain whose outcomes the database cannot take is not a clean drain: the
/// network to PostgreSQL is cut while a step runs, then the worker is told
/// to stop. Its step's outcome cannot be recorded, so the step will run
/// again elsewhere (its side effects may repeat): the worker exits non-zero
/// with a message that says so, instead of 0 as after a clean drain (which
/// is what it did before). Once the database is back, the step is still
/// the queue's (nothing recorded it as done), and no child survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_cannot_record_an_outcome_exits_non_zero_and_says_so() {
    let t = TestDb::new().await;
    let hole = tests::blackhole::Blackhole::start(&t.url).await;
    let mut w = WorkerProcess::spawn(
        &hole.url(&t.url),
        &fast_config(vec![go_demo("go", &[], None)]),
    );
    let run = t
        .submit(tests::one_step(
            "cut",
            "go",
            "demo.sleep",
            json!({"ms": 1000, "steps": 2}),
        ))
        .await;
    let step = wait_running(&t, run).await;
    let pgid = tests::executor_pid(&t.db, step).await;
    hole.cut();
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(60)).await;
    let stderr = w.stderr();
    assert_eq!(code, Some(1), "an unclean drain exits 1; stderr: {stderr}");
    assert!(
        stderr.contains("1 step outcome(s) not recorded"),
        "the message says what was lost: {stderr}"
    );
    hole.heal();
    let st = t.status(run).await;
    assert_eq!(
        st.steps[0].state, "running",
        "nothing recorded the step as done; its lease expires and it runs again"
    );
    tests::assert_no_survivors(step, pgid, Duration::from_secs(1)).await;
}

/// A forced exit (10 s after the second signal) names the steps whose
/// outcomes it leaves unrecorded: here a success that waits for its run's
/// row, which another transaction holds. They run again once their leases
/// expire; before, nothing said which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_exit_names_the_outcomes_it_leaves_unrecorded() {
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![go_demo("go", &[], None)]));
    let run = t
        .submit(tests::one_step(
            "held",
            "go",
            "demo.sleep",
            json!({"ms": 300, "steps": 1}),
        ))
        .await;
    let step = wait_running(&t, run).await;
    let holder = t.hold_run(run).await;
    // the step's executor ends; its success waits for the row
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !w.stderr().contains("its writes wait aside") {
        assert!(std::time::Instant::now() < until, "{}", w.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.signal(Signal::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(30)).await;
    let err = w.stderr();
    holder.rollback().await.expect("let go");
    assert_eq!(code, Some(1), "{err}");
    // the line names the step as `status` shows it: its run and its name
    // (audit 81: the step run's id alone)
    let line = err
        .lines()
        .find(|l| l.contains("exiting with this step's outcome not recorded"))
        .unwrap_or_else(|| panic!("no such line: {err}"));
    assert!(
        line.contains(&step.to_string())
            && line.contains(&run.to_string())
            && line.contains("step=s "),
        "{line}"
    );
}

/// A drain with the database gone ends once the lease clocks ran out: no
/// attempt's progress write outlives its lease clock. Each write still queued
/// waited a pool timeout (10 s) of its own, so such a drain took 50–70 s,
/// past the stop budget the README gives a worker's supervisor
/// (database-failure audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_with_the_database_gone_ends_with_the_lease_clocks() {
    tests::init_tracing();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pg = tests::chaos::PrivatePg::start(dir.path())
        .await
        .expect("a private cluster");
    let db = supervisor::db::Db::connect(&pg.url, 10)
        .await
        .expect("connect");
    db.migrate().await.expect("migrate");
    let worker = supervisor::worker::Worker::start(
        db.clone(),
        tests::fast_config(vec![tests::go_demo("go", &[], None)]),
    )
    .await
    .expect("start");
    let stop = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(worker.run(stop.clone()));
    let mut runs = Vec::new();
    for i in 0..4 {
        runs.push(
            db.submit(&json!({"name": format!("r{i}"), "steps": [
                {"name": "s", "executor_kind": "go", "kind": "demo.resume",
                 "input": {"items": 400, "ms": 25}}]}))
                .await
                .expect("submit"),
        );
    }
    // checkpoints are streaming
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durable.step_runs WHERE checkpoint IS NOT NULL",
        )
        .fetch_one(db.pool())
        .await
        .expect("count");
        if n >= 4 {
            break;
        }
        assert!(Instant::now() < until, "no checkpoints");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pg.stop("immediate").await.expect("stop the cluster");
    let t0 = Instant::now();
    stop.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .expect("the drain ended")
        .expect("the worker task");
    let took = t0.elapsed();
    assert!(ended.is_err(), "outcomes could not be recorded: {ended:?}");
    // the lease clock (2 s) and the last write's bound (3 s), not a pool
    // timeout per queued write
    assert!(took < Duration::from_secs(15), "the drain took {took:?}");
    supervisor::process::kill_all_groups();
}

/// A worker paused (SIGSTOP: a frozen VM, a host under heavy steal) for
/// less than the lease TTL but past its lease clock wakes up, stops the
/// attempt and records it at once as a retryable LEASE_LOST failure through
/// the fenced write (stall audit). It wrote nothing: its heartbeat renewed
/// the lease as it woke, so the step stayed `running` with no process for a
/// whole TTL more, and was then charged LEASE_EXPIRED, "the owning worker
/// stopped renewing its lease", which it had just renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_paused_past_its_lease_clock_records_the_attempt_at_once() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    // the lease clock stops the child 2,250 ms before the TTL (the graces
    // and half a heartbeat): a 4,500 ms pause outlasts the clock (3,750 ms)
    // while the lease itself (6,000 ms from the last renewal, at most one
    // interval before the pause) still holds when the worker wakes
    cfg.lease_ttl_ms = 6_000;
    cfg.heartbeat_interval_ms = 500;
    cfg.cancel_grace_ms = 1_000;
    cfg.term_grace_ms = 1_000;
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(json!({"name": "stall", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.sleep",
            "input": {"ms": 8000, "steps": 80}, "retry": {"max_attempts": 3, "initial_interval_ms": 0}}]}))
        .await;
    let step = wait_running(&t, run).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    w.signal(Signal::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    w.signal(Signal::SIGCONT);
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.steps[0].state, "succeeded", "{:?}", st.steps[0].error);
    let first: (String, Option<String>) = sqlx::query_as(
        "SELECT to_state, reason FROM durable.transitions
          WHERE step_run_id = $1 AND from_state = 'running' ORDER BY id LIMIT 1",
    )
    .bind(step)
    .fetch_one(t.db.pool())
    .await
    .expect("history");
    assert_eq!(first.0, "retryable_failed", "{first:?}");
    assert!(
        first.1.as_deref().unwrap_or("").starts_with("LEASE_LOST"),
        "attempt 1 ended {first:?}; worker log: {}",
        w.stderr()
    );
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(30)).await, Some(0));
}

/// A drain's stop answered by a result within the grace keeps the result:
/// the step succeeds (redeploy audit). It was given back as
/// WORKER_SHUTDOWN, and the finished work ran again from scratch on the
/// next worker, side effects included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_answering_the_drains_stop_is_kept() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.drain_timeout_ms = 300;
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(
            json!({"name": "finish", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.finish_on_cancel", "input": {"wait_ms": 60000}}]}),
        )
        .await;
    let step = wait_running(&t, run).await;
    // the handler waits for its cancel once it reported progress
    let until = Instant::now() + Duration::from_secs(30);
    while tests::event_count(&t.db, step).await < 2 {
        assert!(Instant::now() < until, "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.signal(Signal::SIGTERM);
    assert_eq!(
        w.wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        w.stderr()
    );
    let st = t.status(run).await;
    assert_eq!(st.steps[0].state, "succeeded", "{:?}", st.steps[0].error);
    assert_eq!(
        st.steps[0].output,
        Some(json!({"finished_after_cancel": true}))
    );
    assert_eq!(st.state, "succeeded");
}

/// A step whose executor was still starting when the stop signal came is
/// given back unstarted, uncounted, at once: neither sent to the executor
/// once it is ready (upgrade audit: a job was accepted 3 s after SIGTERM and
/// released 1 s later) nor held until its hello comes (re-check audit: the
/// drain waited up to handshake_timeout_ms for a process that would never
/// get the job).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_executor_was_starting_at_the_signal_is_not_sent() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let slow_now = dir.path().join("slow");
    let mut slow = go_demo("go", &[], None);
    // the worker's probe starts at once; the attempt's process takes 20 s
    slow.args = vec![
        "-c".into(),
        format!(
            "if [ -e '{}' ]; then sleep 20; fi; exec '{}'",
            slow_now.display(),
            slow.command
        ),
    ];
    slow.command = "/bin/sh".into();
    let mut cfg = fast_config(vec![slow]);
    cfg.handshake_timeout_ms = 60_000;
    // a drain long enough that only the hello's wait could end it late
    cfg.drain_timeout_ms = 60_000;
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    // the worker has started (its probe answered) once it leases a step
    let before = t
        .submit(tests::one_step("before", "go", "demo.echo", json!({})))
        .await;
    assert_eq!(
        t.wait_terminal(before, Duration::from_secs(30)).await.state,
        "succeeded"
    );
    std::fs::write(&slow_now, b"").expect("flag");
    let run = t
        .submit(tests::one_step("starting", "go", "demo.echo", json!({})))
        .await;
    t.wait_run(run, Duration::from_secs(30), |s| {
        s.steps.first().is_some_and(|s| s.state == "leased")
    })
    .await;
    let signalled = Instant::now();
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{}", w.stderr());
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "the drain waited for the starting executor's hello: {:?}",
        signalled.elapsed()
    );
    let (state, code, uncounted, unstarted, events): (String, Option<String>, i32, bool, i64) =
        sqlx::query_as(
            "SELECT s.state, s.error_code, s.uncounted_attempts, s.started_at IS NULL,
                    (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id)
               FROM durable.step_runs s WHERE s.run_id = $1",
        )
        .bind(run)
        .fetch_one(t.db.pool())
        .await
        .expect("the step");
    assert_eq!(
        (
            state.as_str(),
            code.as_deref(),
            uncounted,
            unstarted,
            events
        ),
        ("retryable_failed", Some("WORKER_SHUTDOWN"), 1, true, 0),
        "given back uncounted, never started; stderr: {}",
        w.stderr()
    );
}

/// A worker whose log reader went away (`supervisor worker 2>&1 | head -3`,
/// a log collector that died) still drains on SIGTERM and exits 0, its
/// attempt finished and recorded. Before, its next log line failed with
/// EPIPE, tracing's fallback `eprintln!` panicked on the same closed pipe,
/// and the worker died with exit 101: its running steps came back only when
/// their leases expired, each counted as a failed attempt (deployment audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_log_pipe_does_not_stop_the_drain() {
    use std::io::Read;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![go_demo("go", &[], None)]);
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("worker.toml");
    std::fs::write(&cfg_path, toml::to_string(&cfg).expect("config")).expect("write config");
    let mut child = std::process::Command::new(tests::supervisor_bin())
        .args(["worker", "--config"])
        .arg(&cfg_path)
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn worker");
    // read its first line, then close the pipe, as `head -1` does
    let mut stderr = child.stderr.take().expect("stderr");
    let mut first = [0u8; 1];
    stderr.read_exact(&mut first).expect("the worker logs");
    drop(stderr);
    let run = t
        .submit(tests::one_step(
            "drain",
            "go",
            "demo.sleep",
            json!({"ms": 1500, "steps": 3}),
        ))
        .await;
    let step = wait_running(&t, run).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < until, "the worker did not exit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.code(), Some(0), "a clean drain exits 0: {status:?}");
    let st = t.status(run).await;
    assert_eq!(st.steps[0].step_run_id, step);
    assert_eq!(
        (st.steps[0].state.as_str(), st.steps[0].attempt),
        ("succeeded", 1),
        "the attempt finished during the drain: {st:?}"
    );
    let stopped = t
        .scalar_i64("SELECT count(*) FROM durable.workers WHERE stopped_at IS NOT NULL")
        .await;
    assert_eq!(stopped, 1, "the worker marked itself stopped");
}

/// A worker's sessions say whose they are in `pg_stat_activity`
/// (`application_name` "durable worker NAME"): every session of every
/// worker and command was nameless (operator's tools audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_sessions_carry_its_name() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("named-sessions".into());
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = 'durable worker named-sessions'",
        )
        .fetch_one(t.db.pool())
        .await
        .expect("pg_stat_activity");
        if n > 0 {
            break;
        }
        assert!(Instant::now() < until, "no session of the worker is named");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.signal(Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(30)).await, Some(0));
}

/// Storing a result's artifacts is still the attempt's running time: the
/// drain's timeout ends it as it stops an executor, and the step goes back
/// uncounted (WORKER_SHUTDOWN). Here the upload cannot go on (the test holds
/// `durable.blob_pins`, which every artifact is pinned in first); with a
/// drain timeout of 300 ms the worker exits 0 at once instead of waiting
/// out the upload (redeploy audit: a 1.28 GB upload ran 15 s past the
/// drain's timeout, past the stop budget the README gives a worker's
/// supervisor, and on a second signal the worker exited with its step still
/// `running`, charged LEASE_EXPIRED later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_in_progress_is_stopped_by_the_drain_timeout_and_its_step_given_back() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.drain_timeout_ms = 300;
    cfg.lease_ttl_ms = 60_000;
    let mut hold = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.blob_pins IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .expect("hold the pins");
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(
            json!({"name": "upload", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.artifact", "input": {"name": "a.txt", "content": "abc", "repeat": 1000},
            "retry": {"max_attempts": 3, "initial_interval_ms": 0}}]}),
        )
        .await;
    // the result is in and its artifact's pin waits on the held table
    let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                    WHERE c.relname = 'blob_pins' AND NOT l.granted";
    let until = Instant::now() + Duration::from_secs(30);
    while t.scalar_i64(waiting).await == 0 {
        assert!(
            Instant::now() < until,
            "the upload never began; stderr: {}",
            w.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let step = t.status(run).await.steps[0].step_run_id;
    let asked = Instant::now();
    w.signal(Signal::SIGTERM);
    let code = w.wait(Duration::from_secs(30)).await;
    let took = asked.elapsed();
    hold.rollback().await.expect("release the pins");
    assert_eq!(code, Some(0), "stderr: {}", w.stderr());
    assert!(
        took < Duration::from_secs(5),
        "the drain waited for the upload (the pin waits out its 10 s lock timeout): {took:?}"
    );
    let (state, code, uncounted): (String, Option<String>, i32) = sqlx::query_as(
        "SELECT state, error_code, uncounted_attempts FROM durable.step_runs WHERE id = $1",
    )
    .bind(step)
    .fetch_one(t.db.pool())
    .await
    .expect("step");
    assert_eq!(state, "retryable_failed");
    assert_eq!(code.as_deref(), Some("WORKER_SHUTDOWN"));
    assert_eq!(uncounted, 1, "given back uncounted");
    tests::assert_no_survivors(step, None, Duration::from_secs(1)).await;
}
