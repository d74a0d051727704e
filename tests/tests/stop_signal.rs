//! A stop signal stops the lease loop from the moment its handler ran, not
//! from the moment the task that cancels the shutdown token gets polled.
//! Before, a step submitted just after SIGTERM was sent could be leased in
//! that gap (drain.rs's `sigterm_lets_a_running_attempt_finish_then_exits_zero`
//! failed 2 times in 20 with two CPU hogs beside it, and once in CI).
//!
//! A lease already on its way when the signal is noted (the worker polls
//! every 100 ms) is given back before any of its attempts starts (~2 in 60
//! runs with three CPU hogs beside it ran the late step before).
//!
//! Its own test binary: the flag is process-wide, as a signal is, and would
//! stop the workers of any other test in the same process.

use std::time::Duration;

use serde_json::json;
use tests::{fast_config, go_demo, one_step, RunningWorker, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noted_stop_signal_ends_leasing_before_the_shutdown_token_is_cancelled() {
    let t = TestDb::new().await;
    let cfg = fast_config(vec![go_demo("go", &[], Some(&["demo.echo"]))]);
    let w = RunningWorker::start(t.connect(cfg.db_max_connections).await, cfg).await;
    // the worker leases and runs steps
    let before = t
        .submit(one_step("before", "go", "demo.echo", json!({})))
        .await;
    let st = t.wait_terminal(before, Duration::from_secs(30)).await;
    assert_eq!(st.state, "succeeded");

    // what the SIGTERM handler does, and nothing else: the token stays as is
    supervisor::worker::note_stop_signal();
    let late = t
        .submit(one_step("late", "go", "demo.echo", json!({})))
        .await;
    // the worker's loop drains and ends on its own, without the token
    let ended = tokio::time::timeout(Duration::from_secs(10), w.handle).await;
    assert!(
        matches!(ended, Ok(Ok(()))),
        "the worker ends once the signal is noted: {ended:?}"
    );
    assert!(!w.stop.is_cancelled(), "nobody cancelled the token");
    // a NOTIFY and many poll intervals later, the late step never started
    // here: untouched, or, when a lease was already on its way as the signal
    // was noted (a poll every 100 ms), given back at once, uncounted, before
    // any attempt of it started
    tokio::time::sleep(Duration::from_millis(500)).await;
    let late_step: (String, i32, i32, Option<String>, bool, i64) = sqlx::query_as(
        "SELECT s.state, s.attempt, s.uncounted_attempts, s.error_code, s.started_at IS NULL,
                (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id)
           FROM durable.step_runs s WHERE s.run_id = $1",
    )
    .bind(late)
    .fetch_one(t.db.pool())
    .await
    .expect("the late step");
    let given_back = (
        "retryable_failed".to_owned(),
        1,
        1,
        Some("WORKER_SHUTDOWN".to_owned()),
        true,
        0,
    );
    let untouched = ("pending".to_owned(), 0, 0, None, true, 0);
    assert!(
        late_step == untouched || late_step == given_back,
        "nothing started after the signal: {late_step:?}"
    );
    let stopped = t
        .scalar_i64("SELECT count(*) FROM durable.workers WHERE stopped_at IS NOT NULL")
        .await;
    assert_eq!(stopped, 1, "the worker marked itself stopped");
}
