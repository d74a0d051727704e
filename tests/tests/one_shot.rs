//! One-shot executors (issue 7, the executor session): a process that sends
//! its terminal and exits ends its attempt at once. The worker must not wait
//! for the cancel grace of an executor that is already gone.

use std::time::Duration;

use serde_json::json;
use tests::{demo, fast_config, RunningWorker, TestDb};

/// Before the fix, the exit watch was armed only while the process "had not
/// exited yet" when asked: an executor that exited between its terminal and
/// the worker's next look at it was never seen exiting, and its attempt
/// stayed open until the cancel grace ran out (500 ms in the benchmark, 13 %
/// of the bare rate at concurrency 1; about one attempt in ten on two cores).
/// With a grace of 30 s, any attempt that waited for it shows plainly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_exits_after_its_terminal_does_not_wait_for_the_grace() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut e = demo("go", "go", &[], None);
    e.persistent = false;
    e.concurrency = 2;
    let mut cfg = fast_config(vec![e]);
    cfg.cancel_grace_ms = 30_000;
    cfg.lease_ttl_ms = 40_000;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    const STEPS: usize = 40;
    let mut runs = Vec::new();
    for i in 0..STEPS {
        runs.push(
            t.submit(
                json!({"name": "one-shot", "steps": [{"name": "s", "executor_kind": "go",
                     "kind": "demo.echo", "input": {"i": i}, "retry": {"max_attempts": 1}}]}),
            )
            .await,
        );
    }
    for run in &runs {
        let st = t.wait_terminal(*run, Duration::from_secs(300)).await;
        assert_eq!(st.steps[0].state, "succeeded", "{st:?}");
    }
    // from the start (the executor's ACCEPTED) to the committed success: the
    // exchange and the exit take milliseconds; a wait for the grace takes 30 s
    let slow: Vec<(uuid::Uuid, f64)> = sqlx::query_as(
        "SELECT id, extract(epoch FROM finished_at - started_at)::float8 FROM durable.step_runs
          WHERE extract(epoch FROM finished_at - started_at) > 15 ORDER BY id",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("attempt durations");
    let done: i64 = t
        .scalar_i64(
            "SELECT count(*) FROM durable.step_runs WHERE state = 'succeeded' AND finished_at IS NOT NULL AND started_at IS NOT NULL",
        )
        .await;
    assert_eq!(done, STEPS as i64);
    assert!(
        slow.is_empty(),
        "{} of {STEPS} attempts stayed open for the cancel grace after their executor exited: {slow:?}",
        slow.len()
    );
    w.shutdown().await;
}
