//! `supervisor worker` runs until SIGTERM/SIGINT, then drains: no new leases,
//! running attempts may finish within drain_timeout_ms, then they are stopped
//! (WORKER_SHUTDOWN, retryable) — exit 0 either way, and no child survives.

use std::time::Duration;

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
    tests::assert_no_survivors(step, pgid, Duration::from_secs(1)).await;
}
