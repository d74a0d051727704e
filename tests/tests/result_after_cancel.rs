//! A result after a cancel (PROTOCOL.md, Conversation step 5): the terminal
//! reflects what the handler did. `demo.finish_on_cancel` answers the cancel
//! with a result within the grace; the SDK sends that `JobResult` (not
//! `CANCELLED`) and the supervisor keeps it: the step ends `succeeded` with the
//! handler's output, for the Go and the Python demo executors, and no process
//! of the attempt is left.

use std::time::Duration;

use serde_json::json;
use supervisor::config::WorkerConfig;
use tests::{
    demo, executor_pid, fast_config, one_step, only_step_id, step, step_transitions, RunningWorker,
    TestDb,
};
use uuid::Uuid;

/// Generous bound for anything that should take seconds on an idle machine.
const LONG: Duration = Duration::from_secs(120);

tests::for_each_lang!(result_within_the_grace_is_kept);

/// Two steps, `b` after `a`; the run is cancelled while `a` waits, and `a`
/// finishes anyway. `a` keeps its result, `b` never runs, and the run is
/// terminal: `cancelled`, since `b` will now never exist (it is closed as
/// cancelled). Before the run-level cancel closed waiting definitions, the run
/// stayed `running` forever (issue 6, item 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_after_cancel_with_a_dependent_step() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![demo("go", "go", &[], None)]);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "result-after-cancel-dag", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.finish_on_cancel", "input": {}},
            {"name": "b", "executor_kind": "go", "kind": "demo.echo", "input": 1, "depends_on": ["a"]},
        ]}))
        .await;
    wait_waiting(&t, run).await;
    let id = only_step_id(&t, run).await;
    let pgid = executor_pid(&t.db, id).await.expect("executor pid");

    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, Duration::from_secs(20)).await;
    tests::assert_no_survivors(id, Some(pgid), bound).await;
    let a = step(&st, "a");
    assert_eq!(a.state, "succeeded");
    assert_eq!(a.output, Some(json!({"finished_after_cancel": true})));
    assert_eq!(st.state, "cancelled", "b was never run");
    assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    if let Some(b) = st.steps.iter().find(|s| s.name == "b") {
        assert_eq!(b.state, "cancelled");
        let history = step_transitions(&t.db, b.step_run_id).await;
        assert!(
            history.iter().all(|h| h.to_state != "running"),
            "{history:?}"
        );
    }
    w.shutdown().await;
}

/// The bound within which no process of a finished attempt may remain.
fn stop_bound(cfg: &WorkerConfig) -> Duration {
    Duration::from_millis(cfg.cancel_grace_ms + cfg.term_grace_ms) + Duration::from_secs(1)
}

/// Waits until the run's step `s` is running and its handler waits for the
/// cancel: ACCEPTED, RUNNING and the kind's "waiting for a cancel" PROGRESS.
async fn wait_waiting(t: &TestDb, run: Uuid) {
    t.wait_run(run, LONG, |s| {
        s.steps
            .first()
            .is_some_and(|st| st.state == "running" && st.events >= 3)
    })
    .await;
}

/// A running step whose handler finishes when cancelled: `succeeded` with its
/// output. The run has no other step, so it is `succeeded` too: a run is
/// terminal once every step is, and `cancelled` only if a step was cancelled
/// (`state::aggregate_run`); the cancel request stays recorded on the run.
async fn result_within_the_grace_is_kept(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![demo(lang, lang, &[], None)]);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(one_step(
            "result-after-cancel",
            lang,
            "demo.finish_on_cancel",
            json!({"wait_ms": 30000}),
        ))
        .await;
    wait_waiting(&t, run).await;
    let id = only_step_id(&t, run).await;
    let pgid = executor_pid(&t.db, id).await.expect("executor pid");

    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    tests::assert_no_survivors(id, Some(pgid), bound).await;

    let s = step(&st, "s");
    assert_eq!(
        s.state,
        "succeeded",
        "the result that arrived within the grace is kept: {}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    assert_eq!(s.output, Some(json!({"finished_after_cancel": true})));
    assert!(s.error.is_none(), "{:?}", s.error);
    assert_eq!(s.attempt, 1, "the finished work is not repeated");
    assert!(s.cancel_requested, "the cancel reached the step");
    assert_eq!(st.state, "succeeded", "the only step succeeded");
    assert!(st.cancel_requested, "the cancel request stays recorded");

    let history = step_transitions(&t.db, id).await;
    let last = history.last().expect("history");
    assert_eq!(
        (last.from_state.as_deref(), last.to_state.as_str()),
        (Some("running"), "succeeded"),
        "{history:?}"
    );
    assert!(
        history.iter().all(|h| h.to_state != "cancelled"),
        "{history:?}"
    );
    w.shutdown().await;
}
