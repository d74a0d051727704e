//! Steps that will never run are created cancelled, so that a run that has
//! ended lists every step of its spec with a terminal state (CONTRACT §4:
//! "failed when any step is terminal_failed (the others are then
//! cancelled)"). Before, a run failed by one step kept its dependents as
//! definitions "waiting" forever, and so did the dependents of a step
//! cancelled on its own.

use std::time::Duration;

use serde_json::json;
use supervisor::db::{Batch, CompleteWrite, OwnedEvent, StartWrite};
use tests::TestDb;
use uuid::Uuid;

/// (name, state, transition_reason) of every step of a run, in spec order.
async fn steps(t: &TestDb, run: Uuid) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT name, state, transition_reason FROM durable.step_runs WHERE run_id = $1 ORDER BY position",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("steps")
}

/// a -> c -> d and b -> d, with b a root of its own.
fn diamond() -> serde_json::Value {
    json!({"name": "never", "steps": [
        {"name": "a", "executor_kind": "go", "kind": "k"},
        {"name": "b", "executor_kind": "go", "kind": "k"},
        {"name": "c", "executor_kind": "go", "kind": "k", "depends_on": ["a"]},
        {"name": "d", "executor_kind": "go", "kind": "k", "depends_on": ["c", "b"]}]})
}

async fn sql(t: &TestDb, q: &str, run: Uuid) {
    sqlx::query(q)
        .bind(run)
        .execute(t.db.pool())
        .await
        .unwrap_or_else(|e| panic!("{q}: {e}"));
}

/// Step a leased (by SQL, as a worker's lease would).
async fn lease_a(t: &TestDb, run: Uuid) {
    sql(
        t,
        "UPDATE durable.step_runs SET state = 'leased', lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute', attempt = 1
          WHERE run_id = $1 AND name = 'a'",
        run,
    )
    .await;
}

#[tokio::test]
async fn a_cancelled_step_cancels_its_waiting_dependents_and_theirs() {
    let t = TestDb::new().await;
    let run = t.submit(diamond()).await;
    t.db.cancel(run, Some("a")).await.expect("cancel a");
    let got = steps(&t, run).await;
    let want = |n: &str, s: &str, r: &str| (n.to_owned(), s.to_owned(), Some(r.to_owned()));
    assert_eq!(
        got,
        vec![
            want("a", "cancelled", "CANCEL_REQUESTED"),
            want("b", "pending", "SUBMITTED"),
            want("c", "cancelled", "DEPENDENCY_CANCELLED"),
            want("d", "cancelled", "DEPENDENCY_CANCELLED"),
        ]
    );
    let st = t.status(run).await;
    assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    assert_eq!(st.state, "pending", "b is still to run");
    // their creation does not claim that their dependencies succeeded
    let created: Vec<String> = sqlx::query_scalar(
        "SELECT t.reason FROM durable.transitions t JOIN durable.step_runs s ON s.id = t.step_run_id
          WHERE s.run_id = $1 AND s.name IN ('c', 'd') AND t.from_state IS NULL ORDER BY s.position",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    assert_eq!(created, ["DEPENDENCY_NOT_SUCCEEDED"; 2]);
    // the counters agree with the rows
    let (total, cancelled, waiting): (i32, i32, i32) = sqlx::query_as(
        "SELECT steps_total, steps_cancelled, defs_waiting FROM durable.workflow_runs WHERE id = $1",
    )
    .bind(run)
    .fetch_one(t.db.pool())
    .await
    .expect("run");
    assert_eq!((total, cancelled, waiting), (4, 3, 0));
}

#[tokio::test]
async fn a_step_whose_cancel_is_only_requested_keeps_its_dependents_waiting() {
    let t = TestDb::new().await;
    let run = t.submit(diamond()).await;
    // a is running: its cancel is a request, and it may still succeed
    lease_a(&t, run).await;
    t.db.cancel(run, Some("a")).await.expect("cancel a");
    let st = t.status(run).await;
    let waiting: Vec<&str> = st.waiting.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(waiting, ["c", "d"]);
}

#[tokio::test]
async fn a_terminal_failure_creates_the_waiting_steps_cancelled() {
    let t = TestDb::new().await;
    let run = t.submit(diamond()).await;
    lease_a(&t, run).await;
    sql(
        &t,
        "UPDATE durable.step_runs SET state = 'terminal_failed', error_code = 'BAD_INPUT'
          WHERE run_id = $1 AND name = 'a'",
        run,
    )
    .await;
    let got = steps(&t, run).await;
    let states: Vec<(&str, &str)> = got
        .iter()
        .map(|(n, s, _)| (n.as_str(), s.as_str()))
        .collect();
    assert_eq!(
        states,
        [
            ("a", "terminal_failed"),
            ("b", "cancelled"),
            ("c", "cancelled"),
            ("d", "cancelled")
        ]
    );
    let st = t.status(run).await;
    assert_eq!(st.state, "failed");
    assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    // the run's hop to failed names the step that failed it, not the
    // sibling whose cancellation closed the run
    let why: String = sqlx::query_scalar(
        "SELECT reason FROM durable.transitions
          WHERE run_id = $1 AND step_run_id IS NULL AND to_state = 'failed'",
    )
    .bind(run)
    .fetch_one(t.db.pool())
    .await
    .expect("the run's hop to failed");
    assert_eq!(why, "step a terminal_failed");
}

/// Through a real worker and the CLI's view: a failing step's dependents are
/// listed as cancelled steps of the failed run, nothing is left waiting.
#[tokio::test]
async fn a_failed_run_lists_every_step_terminal() {
    let t = TestDb::new().await;
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "fails", "steps": [
            {"name": "boom", "executor_kind": "go", "kind": "demo.fail",
             "input": {"code": "BAD_INPUT", "retryable": false}},
            {"name": "after", "executor_kind": "go", "kind": "demo.echo", "depends_on": ["boom"]},
            {"name": "after2", "executor_kind": "go", "kind": "demo.echo", "depends_on": ["after"]}
        ]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(st.state, "failed");
    assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    let states: Vec<(&str, &str)> = st
        .steps
        .iter()
        .map(|s| (s.name.as_str(), s.state.as_str()))
        .collect();
    assert_eq!(
        states,
        [
            ("boom", "terminal_failed"),
            ("after", "cancelled"),
            ("after2", "cancelled")
        ]
    );
}

/// A running sibling cancelled because a step failed the run says so (the
/// step that failed and its code), in its error and its ending event: it
/// said "cancelled on request", as if someone had asked.
#[tokio::test]
async fn a_sibling_cancelled_by_a_failure_says_which_step_failed_the_run() {
    let t = TestDb::new().await;
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "fails-late", "steps": [
            {"name": "boom", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 60000, "steps": 600}, "timeout_ms": 1500, "retry": {"max_attempts": 1}},
            {"name": "sibling", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 60000, "steps": 600}}
        ]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(st.state, "failed");
    let sibling = tests::step(&st, "sibling");
    assert_eq!(sibling.state, "cancelled");
    let e = sibling.error.as_ref().expect("the cancellation's error");
    assert_eq!(
        e.message, "cancelled because the run failed: step boom ended ATTEMPT_TIMEOUT",
        "{e:?}"
    );
    let last: String = sqlx::query_scalar(
        "SELECT message FROM durable.step_events WHERE step_run_id = $1 ORDER BY attempt DESC, sequence DESC LIMIT 1",
    )
    .bind(sibling.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("ending event");
    // `CODE: why`, as the other endings' events (it lacked the code)
    assert_eq!(last, format!("CANCELLED: {}", e.message));
}

/// The steps a cancel creates only to cancel them (still waiting on their
/// dependencies) are created with DEPENDENCY_NOT_SUCCEEDED, whether the whole
/// run is cancelled or one waiting step by name. Before the fix their history
/// began `NULL → pending` with DEPENDENCIES_SUCCEEDED while their dependencies
/// were still pending.
#[tokio::test]
async fn the_steps_a_cancel_creates_do_not_claim_their_dependencies_succeeded() {
    let t = TestDb::new().await;
    let created = |run: Uuid, names: &'static [&'static str]| {
        let pool = t.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT t.reason FROM durable.transitions t JOIN durable.step_runs s ON s.id = t.step_run_id
                  WHERE s.run_id = $1 AND s.name = ANY ($2) AND t.from_state IS NULL ORDER BY s.position",
            )
            .bind(run)
            .bind(names)
            .fetch_all(&pool)
            .await
            .expect("history")
        }
    };
    // the whole run: c and d were waiting on a (pending)
    let run = t.submit(diamond()).await;
    t.db.cancel(run, None).await.expect("cancel run");
    assert_eq!(
        created(run, &["c", "d"]).await,
        ["DEPENDENCY_NOT_SUCCEEDED"; 2]
    );
    // one waiting step by name (d waits on b and c)
    let run = t.submit(diamond()).await;
    t.db.cancel(run, Some("d")).await.expect("cancel d");
    assert_eq!(created(run, &["d"]).await, ["DEPENDENCY_NOT_SUCCEEDED"]);
    assert_eq!(tests::step(&t.status(run).await, "d").state, "cancelled");
}

/// A run whose only runnable step starts and ends in one write (the worker's
/// fused start and completion) while its other steps were cancelled by name
/// passes through running: its history is pending → running → cancelled, as
/// the step's is leased → running → succeeded. Before the fix the run went
/// pending → cancelled, as if nothing had run.
#[tokio::test]
async fn a_run_whose_step_ran_in_one_write_passes_through_running() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "chain", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]},
            {"name": "c", "executor_kind": "go", "kind": "k", "depends_on": ["b"]}]}))
        .await;
    t.db.cancel(run, Some("b")).await.expect("cancel b");
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let a =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, Duration::from_secs(30))
            .await
            .expect("lease")
            .remove(0);
    // the start and the completion in one ledger batch: one write of the
    // step (leased -> running -> succeeded)
    let batch = Batch {
        starts: vec![StartWrite {
            run_id: run,
            lease: a.lease.clone(),
            pid: 1,
            event: OwnedEvent {
                sequence: 1,
                kind: "accepted",
                message: String::new(),
                fraction: None,
                executor_at: None,
            },
        }],
        events: vec![],
        completes: vec![CompleteWrite {
            run_id: run,
            lease: a.lease.clone(),
            output: json!({}),
            sequence: Some(2),
        }],
    };
    t.db.write_batch("w", &batch).await.expect("batch");
    let hops: Vec<(Option<String>, String)> = sqlx::query_as(
        "SELECT from_state, to_state FROM durable.transitions
          WHERE run_id = $1 AND step_run_id IS NULL ORDER BY id",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    let hop = |f: Option<&str>, to: &str| (f.map(str::to_owned), to.to_owned());
    assert_eq!(
        hops,
        vec![
            hop(None, "pending"),
            hop(Some("pending"), "running"),
            hop(Some("running"), "cancelled"),
        ]
    );
    assert_eq!(t.status(run).await.state, "cancelled");
}
