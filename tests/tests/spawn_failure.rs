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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_executor_command_refuses_and_pauses_instead_of_failing_steps() {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = dir.path().join("demo-go");
    std::fs::copy(tests::go_executor(), &exe).expect("copy the demo executor");
    let mut ecfg = go_demo("go", &[], None);
    ecfg.command = exe.to_string_lossy().into_owned();
    let mut cfg = fast_config(vec![ecfg]);
    cfg.refusal_delay_ms = 300;
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
    let st = t.status(run).await;
    let a = tests::step(&st, "a");
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
