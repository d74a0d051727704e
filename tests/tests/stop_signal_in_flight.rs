//! A lease already on its way when the stop signal is noted: its steps may
//! have been submitted after the signal (the lease's statement runs after
//! their commit), and the drain starts no attempt, so they are given back at
//! once, uncounted, before any attempt of theirs started. Before, such a step
//! was run by the draining worker (stop_signal.rs failed ~2 in 60 runs with
//! three CPU hogs beside it, and once in CI: the worker polls every 100 ms,
//! and a poll's lease could be in flight at the signal).
//!
//! Its own test binary: the stop flag is process-wide, as a signal is.

use std::time::{Duration, Instant};

use serde_json::json;
use tests::{fast_config, go_demo, one_step, RunningWorker, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_on_its_way_at_the_stop_signal_gives_its_steps_back_unstarted() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], Some(&["demo.echo"]))]);
    cfg.name = Some("in-flight".into());
    let w = RunningWorker::start(t.connect(cfg.db_max_connections).await, cfg).await;
    let before = t
        .submit(one_step("before", "go", "demo.echo", json!({})))
        .await;
    let st = t.wait_terminal(before, Duration::from_secs(30)).await;
    assert_eq!(st.state, "succeeded");

    // every lease now waits 600 ms between its stop check and its statement
    supervisor::fault::delay_leases_of(Some(("in-flight", Duration::from_millis(600))));
    let entered = supervisor::fault::delayed_leases();
    let until = Instant::now() + Duration::from_secs(5);
    while supervisor::fault::delayed_leases() == entered {
        assert!(Instant::now() < until, "no lease entered the delay");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // a lease is on its way: the signal, then a step its statement will see
    supervisor::worker::note_stop_signal();
    let late = t
        .submit(one_step("late", "go", "demo.echo", json!({})))
        .await;
    let ended = tokio::time::timeout(Duration::from_secs(10), w.handle).await;
    assert!(
        matches!(ended, Ok(Ok(()))),
        "the worker ends once the signal is noted: {ended:?}"
    );
    supervisor::fault::delay_leases_of(None);

    let late_step: (String, i32, i32, Option<String>, bool, i64, Option<String>) = sqlx::query_as(
        "SELECT s.state, s.attempt, s.uncounted_attempts, s.error_code, s.started_at IS NULL,
                (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id),
                s.error_message
           FROM durable.step_runs s WHERE s.run_id = $1",
    )
    .bind(late)
    .fetch_one(t.db.pool())
    .await
    .expect("the late step");
    assert_eq!(
        late_step.0, "retryable_failed",
        "leased by the lease on its way, then given back: {late_step:?}"
    );
    assert_eq!(
        (
            late_step.1,
            late_step.2,
            late_step.3.as_deref(),
            late_step.4,
            late_step.5
        ),
        (1, 1, Some("WORKER_SHUTDOWN"), true, 0),
        "given back uncounted, never started, no event: {late_step:?}"
    );
    assert!(
        late_step.6.as_deref().unwrap_or("").contains("stop signal"),
        "the reason names the stop signal: {late_step:?}"
    );
    // and it is ready for another worker at once
    let ready: bool = sqlx::query_scalar(
        "SELECT next_attempt_at <= now() FROM durable.step_runs WHERE run_id = $1",
    )
    .bind(late)
    .fetch_one(t.db.pool())
    .await
    .expect("next attempt");
    assert!(ready, "the given-back step is due at once");
}
