//! S03, queue half: a retryable failure raises the attempt, delays grow as the
//! policy says (within the jitter), the idempotency key is the same on every
//! attempt, exhausted attempts end terminal_failed; a second submit with the
//! same run key creates nothing new.

use std::time::Duration;

use serde_json::json;
use supervisor::db::FailureReport;
use supervisor::retry::JITTER;
use supervisor::state::{Failure, StepState};
use tests::TestDb;
use uuid::Uuid;

fn failure(code: &str, retryable: bool, next_ms: Option<i64>) -> FailureReport {
    FailureReport {
        failure: Failure {
            code: code.into(),
            retryable,
            next_retry_delay: next_ms.map(chrono::Duration::milliseconds),
        },
        message: format!("{code} for the test"),
        details: Some(json!({"why": "test"})),
        sequence: Some(2),
    }
}

/// Leases the step once it is due, and starts it as an executor's `accepted` would.
async fn lease_and_start(t: &TestDb, w: Uuid) -> supervisor::db::LeasedStep {
    for _ in 0..400 {
        let mut got =
            t.db.lease(w, "w", &tests::route_go_k(), 1, Duration::from_secs(30))
                .await
                .expect("lease");
        if let Some(s) = got.pop() {
            t.db.mark_running(&s.lease, "w", 1, &tests::accepted_event())
                .await
                .expect("running");
            return s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing became leasable");
}

#[tokio::test]
async fn retries_back_off_and_exhaust() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let run = t
        .submit(json!({"name": "retry", "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
            "retry": {"max_attempts": 4, "initial_interval_ms": 200, "backoff_coefficient": 2.0, "max_interval_ms": 500}}]}))
        .await;
    let mut keys = Vec::new();
    let mut lines = Vec::new();
    for attempt in 1..=4u32 {
        let s = lease_and_start(&t, w).await;
        assert_eq!(s.lease.attempt(), attempt);
        keys.push(s.idempotency_key.clone());
        let d =
            t.db.fail(&s.lease, "w", &failure("FLAKY", true, None), 0.5)
                .await
                .expect("fail");
        if attempt < 4 {
            assert_eq!(d.to, StepState::RetryableFailed);
            let next = d.next_attempt_at.expect("next attempt time");
            let row: (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
                sqlx::query_as(
                    "SELECT next_attempt_at, updated_at FROM durable.step_runs WHERE id = $1",
                )
                .bind(s.lease.step_run_id())
                .fetch_one(t.db.pool())
                .await
                .expect("row");
            assert_eq!(row.0, next);
            let delay = (row.0 - row.1).num_milliseconds() as f64;
            let base = (200.0 * 2f64.powi(attempt as i32 - 1)).min(500.0);
            assert!(
                delay >= base * (1.0 - JITTER) - 5.0
                    && delay <= (base * (1.0 + JITTER)).min(500.0) + 5.0,
                "attempt {attempt}: delay {delay} ms not within the jitter of {base} ms"
            );
            lines.push(format!(
                "attempt {attempt} failed -> retry in {delay:.0} ms (base {base} ms)"
            ));
        } else {
            assert_eq!(d.to, StepState::TerminalFailed, "attempts exhausted");
            lines.push(format!(
                "attempt {attempt} failed -> terminal_failed ({})",
                d.reason
            ));
        }
    }
    println!("{}", lines.join("\n"));
    assert!(
        keys.windows(2).all(|w| w[0] == w[1]),
        "idempotency key changed: {keys:?}"
    );
    let st = t.status(run).await;
    assert_eq!(st.state, "failed");
    assert_eq!(st.steps[0].state, "terminal_failed");
    assert_eq!(st.steps[0].attempt, 4);
    let err = st.steps[0].error.as_ref().expect("error");
    assert_eq!((err.code.as_str(), err.retryable), ("FLAKY", true));
    assert_eq!(err.details, Some(json!({"why": "test"})));
}

#[tokio::test]
async fn non_retryable_codes_own_delays_and_deadlines() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let spec = |name: &str, extra: serde_json::Value| {
        let mut s = json!({"name": "s", "executor_kind": "go", "kind": "k",
                           "retry": {"max_attempts": 5, "non_retryable_codes": ["BAD_INPUT"]}});
        if let (Some(o), Some(e)) = (s.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                o.insert(k.clone(), v.clone());
            }
        }
        json!({"name": name, "steps": [s]})
    };

    // a code the policy lists as non-retryable ends the step at once
    let r1 = t.submit(spec("nonretryable", json!({}))).await;
    let s = lease_and_start(&t, w).await;
    let d =
        t.db.fail(&s.lease, "w", &failure("BAD_INPUT", true, None), 0.5)
            .await
            .expect("fail");
    assert_eq!(d.to, StepState::TerminalFailed);
    assert_eq!(t.status(r1).await.state, "failed");

    // the error's own next_retry_delay overrides the backoff
    let r2 = t.submit(spec("own-delay", json!({}))).await;
    let s = lease_and_start(&t, w).await;
    let d =
        t.db.fail(&s.lease, "w", &failure("LATER", true, Some(3_000)), 0.0)
            .await
            .expect("fail");
    let (next, upd): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT next_attempt_at, updated_at FROM durable.step_runs WHERE id = $1")
            .bind(s.lease.step_run_id())
            .fetch_one(t.db.pool())
            .await
            .expect("row");
    assert_eq!(d.to, StepState::RetryableFailed);
    assert_eq!((next - upd).num_milliseconds(), 3_000);
    t.db.cancel(r2, None).await.expect("cancel");
    assert_eq!(
        t.status(r2).await.state,
        "cancelled",
        "cancelling a waiting retry ends the run"
    );

    // no retry is scheduled past the step deadline
    let deadline = (chrono::Utc::now() + chrono::Duration::seconds(2)).to_rfc3339();
    let r3 = t.submit(spec("deadline", json!({"deadline": deadline, "retry": {"max_attempts": 5, "initial_interval_ms": 5000}}))).await;
    let s = lease_and_start(&t, w).await;
    let d =
        t.db.fail(&s.lease, "w", &failure("FLAKY", true, None), 0.5)
            .await
            .expect("fail");
    assert_eq!(d.to, StepState::TerminalFailed, "{}", d.reason);
    assert!(d.reason.contains("deadline"), "{}", d.reason);
    assert_eq!(t.status(r3).await.state, "failed");
}

#[tokio::test]
async fn the_same_run_key_submits_once() {
    let t = TestDb::new().await;
    let spec = json!({"name": "nightly", "idempotency_key": "nightly-2026-11-29",
                      "steps": [{"name": "a", "executor_kind": "go", "kind": "k"},
                                {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]});
    let first = t.submit(spec.clone()).await;
    // concurrent submits with the same key
    let mut handles = Vec::new();
    for _ in 0..8 {
        let db = t.connect(1).await;
        let spec = spec.clone();
        handles.push(tokio::spawn(async move {
            db.submit(&spec).await.expect("submit")
        }));
    }
    for h in handles {
        assert_eq!(h.await.expect("task"), first);
    }
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        1
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs").await,
        1,
        "b waits for a"
    );
    let st = t.status(first).await;
    assert_eq!(st.steps[0].idempotency_key, "nightly-2026-11-29/a");
    assert_eq!(st.waiting.len(), 1);
}

#[tokio::test]
async fn a_dependent_step_is_created_when_its_last_dependency_succeeds() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let run = t
        .submit(json!({"name": "dag", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k"},
            {"name": "c", "executor_kind": "go", "kind": "k", "depends_on": ["a", "b"]}]}))
        .await;
    for expected_created in [2, 2, 3] {
        assert_eq!(t.status(run).await.steps.len(), expected_created);
        let s = lease_and_start(&t, w).await;
        t.db.complete(&s.lease, "w", &json!({"step": s.name}), &[], Some(2))
            .await
            .expect("complete");
    }
    let st = t.status(run).await;
    assert_eq!(st.state, "succeeded");
    assert!(st.waiting.is_empty());
}

/// A retry is leased when it comes due, not at the worker's next poll: the
/// worker that wrote the retryable failure wakes its lease loop at the
/// retry's time (no NOTIFY marks a retry coming due). With a 30 s poll the
/// second attempt used to start ~30 s after the first failed.
#[tokio::test]
async fn a_retry_is_leased_when_it_comes_due_not_at_the_next_poll() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.poll_interval_ms = 30_000;
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "due", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.fail",
            "input": {"code": "FLAKY", "retryable": true, "fail_attempts": 1},
            "retry": {"max_attempts": 2, "initial_interval_ms": 300, "backoff_coefficient": 1.0}}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(20)).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    // the second lease against the first failure's retry time
    let (due, leased): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "SELECT (SELECT t.at FROM durable.transitions t WHERE t.run_id = $1
                       AND t.to_state = 'retryable_failed') + interval '300 milliseconds',
                    (SELECT t.at FROM durable.transitions t WHERE t.run_id = $1
                       AND t.to_state = 'leased' AND t.attempt = 2)",
        )
        .bind(run)
        .fetch_one(t.db.pool())
        .await
        .expect("history");
    let late = (leased - due).num_milliseconds();
    assert!(
        late < 10_000,
        "the retry was leased {late} ms after it came due: it waited for the 30 s poll"
    );
}

/// A run submitted while the worker starts is leased at once, not at the
/// worker's first poll: once LISTEN is in place the worker makes a lease
/// pass, since a NOTIFY sent before that reached nobody. Here LISTEN starts
/// a second late (a fault injected for this worker) and the run is
/// submitted after the worker's first lease pass, with a 30 s poll.
#[tokio::test]
async fn a_run_submitted_before_listen_took_effect_is_not_left_to_the_poll() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.poll_interval_ms = 30_000;
    cfg.name = Some("late-listen".into());
    supervisor::fault::delay_listen_of(Some(("late-listen", Duration::from_secs(1))));
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let run = t
        .submit(tests::one_step("early", "go", "demo.echo", json!({"a": 1})))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(15)).await;
    w.shutdown().await;
    supervisor::fault::delay_listen_of(None);
    assert_eq!(st.state, "succeeded", "{st:?}");
}

/// A step still waiting for its dependencies when its deadline passes fails
/// then, DEADLINE_EXCEEDED, and fails its run: the running dependency is
/// asked to stop, not waited for (DAG audit: it failed only once its
/// dependencies had ended, hours after a deadline that had sealed it). No
/// other transaction sees it pending, and its history is a chain.
#[tokio::test]
async fn a_waiting_step_whose_deadline_passes_fails_its_run_then() {
    let t = TestDb::new().await;
    let deadline = (chrono::Utc::now() + chrono::Duration::milliseconds(600)).to_rfc3339();
    let run = t
        .submit(json!({"name": "late", "steps": [
            {"name": "up", "executor_kind": "go", "kind": "k"},
            {"name": "down", "executor_kind": "go", "kind": "k", "depends_on": ["up"],
             "deadline": deadline}]}))
        .await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let up = lease_and_start(&t, w).await;
    // before the deadline: nothing to end
    assert_eq!(t.db.fail_overdue(w, "w", 10).await.expect("pass"), 0);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(t.db.fail_overdue(w, "w", 10).await.expect("pass"), 1);
    let st = t.status(run).await;
    let down = tests::step(&st, "down");
    assert_eq!(down.state, "terminal_failed");
    let e = down.error.as_ref().expect("error");
    assert_eq!(e.code, "DEADLINE_EXCEEDED");
    assert!(
        e.message
            .ends_with("passed while it waited for its dependencies"),
        "{e:?}"
    );
    // the running dependency is asked to stop; the run ends with it
    assert!(tests::step(&st, "up").cancel_requested, "{st:?}");
    assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    t.db.confirm_cancelled(&up.lease, "w", "stopped")
        .await
        .expect("cancelled");
    assert_eq!(t.status(run).await.state, "failed");
    let hops: Vec<(Option<String>, String)> = tests::step_transitions(&t.db, down.step_run_id)
        .await
        .into_iter()
        .map(|h| (h.from_state, h.to_state))
        .collect();
    let hop = |f: Option<&str>, to: &str| (f.map(str::to_owned), to.to_owned());
    assert_eq!(
        hops,
        vec![
            hop(None, "pending"),
            hop(Some("pending"), "leased"),
            hop(Some("leased"), "terminal_failed"),
        ]
    );
    // a second pass finds nothing more
    assert_eq!(t.db.fail_overdue(w, "w", 10).await.expect("pass"), 0);
}

/// A deadline that ends a step before it runs again counts no attempt: a
/// step that never ran ends `terminal_failed` at attempt 0, and one waiting
/// for its retry keeps the number of its last real attempt. The deadline
/// pass takes the step through `leased` (the table has no edge from `pending`
/// or `retryable_failed` to `terminal_failed`), but that hop is no attempt
/// (contract audit: the history showed attempt 1 for a step no worker could
/// run).
#[tokio::test]
async fn a_deadline_that_ends_a_step_before_it_runs_counts_no_attempt() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let soon = (chrono::Utc::now() + chrono::Duration::milliseconds(1500)).to_rfc3339();
    // one never leased, one that fails once and is not leased again before
    // its deadline (its retry is due before it: no worker here takes it)
    let never = t
        .submit(json!({"name": "never", "steps": [
            {"name": "s", "executor_kind": "nobody", "kind": "k", "deadline": soon}]}))
        .await;
    let retried = t
        .submit(json!({"name": "retried", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k", "deadline": soon,
             "retry": {"max_attempts": 5}}]}))
        .await;
    let s = lease_and_start(&t, w).await;
    t.db.fail(&s.lease, "w", &failure("FLAKY", true, Some(200)), 0.0)
        .await
        .expect("fail");
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert_eq!(t.db.fail_overdue(w, "w", 10).await.expect("pass"), 2);
    for (run, attempts, when) in [
        (never, 0, "before a worker could start it"),
        (retried, 1, "before its next attempt could start"),
    ] {
        let st = t.status(run).await;
        let step = tests::step(&st, "s");
        assert_eq!(step.state, "terminal_failed", "{st:?}");
        let e = step.error.as_ref().expect("error");
        assert_eq!(e.code, "DEADLINE_EXCEEDED");
        assert!(e.message.ends_with(when), "{e:?}");
        assert_eq!(step.attempt, attempts, "{st:?}");
        let hops = tests::step_transitions(&t.db, step.step_run_id).await;
        let last_two: Vec<(String, Option<i32>)> = hops[hops.len() - 2..]
            .iter()
            .map(|h| (h.to_state.clone(), h.attempt))
            .collect();
        assert_eq!(
            last_two,
            vec![
                ("leased".to_owned(), Some(attempts)),
                ("terminal_failed".to_owned(), Some(attempts))
            ],
            "{hops:?}"
        );
    }
}

/// A retry's lease forgets the previous attempt's process: until the new
/// attempt's executor accepts its job, `executor_pid` and `started_at` say
/// nothing (they named the previous attempt's process, long gone).
#[tokio::test]
async fn a_retrys_lease_forgets_the_previous_attempts_process() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    t.submit(
        json!({"name": "pid", "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
        "retry": {"max_attempts": 3, "initial_interval_ms": 1, "max_interval_ms": 1}}]}),
    )
    .await;
    let s = lease_and_start(&t, w).await;
    let id = s.lease.step_run_id();
    assert_eq!(tests::executor_pid(&t.db, id).await, Some(1));
    t.db.fail(&s.lease, "w", &failure("FLAKY", true, Some(0)), 0.0)
        .await
        .expect("fail");
    let again = loop {
        let mut got =
            t.db.lease(w, "w", &tests::route_go_k(), 1, Duration::from_secs(30))
                .await
                .expect("lease");
        if let Some(s) = got.pop() {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(again.lease.attempt(), 2);
    let (state, pid, started): (String, Option<i32>, bool) = sqlx::query_as(
        "SELECT state, executor_pid, started_at IS NOT NULL FROM durable.step_runs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(t.db.pool())
    .await
    .expect("row");
    assert_eq!((state.as_str(), pid, started), ("leased", None, false));
}
