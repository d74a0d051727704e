//! S06, the persistence half: progress events delivered to the persistence
//! layer out of order and duplicated (as a retried batch or a confused
//! executor would) are stored once each, listed in sequence order, with the
//! terminal last; an event that arrives after the terminal is refused.

use std::time::Duration;

use serde_json::json;
use supervisor::db::{DbError, NewEvent};
use tests::TestDb;
use uuid::Uuid;

fn ev(sequence: u64, message: &'static str) -> NewEvent<'static> {
    NewEvent {
        sequence,
        kind: "progress",
        message,
        fraction: Some(sequence as f64 / 10.0),
        checkpoint: None,
        executor_at: None,
    }
}

#[tokio::test]
async fn out_of_order_and_duplicated_events_are_stored_once_in_order_terminal_last() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "e", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let s =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, Duration::from_secs(30))
            .await
            .expect("lease")
            .remove(0);
    t.db.mark_running(&s.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");
    // fault injection: batches out of order, with duplicates, one retried whole
    let batches: Vec<Vec<NewEvent<'static>>> = vec![
        vec![ev(5, "five"), ev(3, "three")],
        vec![ev(2, "two"), ev(5, "five"), ev(4, "four")],
        vec![ev(2, "two"), ev(5, "five"), ev(4, "four")],
        vec![ev(3, "three"), ev(6, "six")],
    ];
    for b in &batches {
        t.db.record_events(&s.lease, b).await.expect("events");
    }
    t.db.complete(&s.lease, "w", &json!({"ok": true}), &[], Some(7))
        .await
        .expect("complete");
    // a straggler after the terminal is refused, not stored after it
    let late = t.db.record_events(&s.lease, &[ev(8, "late")]).await;
    assert!(matches!(late, Err(DbError::LeaseLost { .. })), "{late:?}");

    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT sequence, kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
    )
    .bind(s.lease.step_run_id())
    .fetch_all(t.db.pool())
    .await
    .expect("events");
    let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 4, 5, 6, 7],
        "stored once each, in order"
    );
    assert_eq!(rows.first().map(|r| r.1.as_str()), Some("accepted"));
    assert_eq!(
        rows.last().map(|r| r.1.as_str()),
        Some("succeeded"),
        "the terminal is last"
    );
    let st = t.status(run).await;
    assert_eq!(tests::step(&st, "s").events, 7);
    // the CLI lists them the same way
    let out = std::process::Command::new(tests::supervisor_bin())
        .args(["events", &run.to_string(), "--json"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("supervisor events");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let listed: Vec<i64> = listed
        .as_array()
        .expect("array")
        .iter()
        .map(|e| e["sequence"].as_i64().expect("sequence"))
        .collect();
    assert_eq!(listed, seqs);
}

/// The kinds and messages of a step's events, in order, for one attempt.
async fn events_of(t: &TestDb, step: Uuid, attempt: i32) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT kind, message FROM durable.step_events
          WHERE step_run_id = $1 AND attempt = $2 ORDER BY sequence",
    )
    .bind(step)
    .bind(attempt)
    .fetch_all(t.db.pool())
    .await
    .expect("events")
}

/// An attempt the supervisor ends still ends with a terminal event (the
/// seed design's evidence for `cancelled` and `terminal_failed`): a cancel
/// and an attempt timeout are recorded after the executor's own events, with
/// the state the attempt ended in and why. Before, only an executor's own
/// result or error left one, and `events` of a cancelled step stopped at its
/// last progress.
#[tokio::test]
async fn an_attempt_the_supervisor_ended_has_a_terminal_event() {
    let t = TestDb::new().await;
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;

    // cancelled while it runs
    let run = t
        .submit(tests::one_step(
            "cancel-me",
            "go",
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
        ))
        .await;
    let st = t
        .wait_run(run, Duration::from_secs(30), |s| {
            s.steps
                .first()
                .is_some_and(|x| x.state == "running" && x.events >= 3)
        })
        .await;
    let step = st.steps[0].step_run_id;
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, Duration::from_secs(30)).await;
    assert_eq!(st.steps[0].state, "cancelled");
    let ev = events_of(&t, step, 1).await;
    let (kind, message) = ev.last().expect("events");
    assert_eq!(kind, "cancelled", "{ev:?}");
    assert!(message.contains("cancel"), "{ev:?}");
    assert_eq!(ev[0].0, "accepted", "{ev:?}");

    // an executor that goes silent, ended by the attempt's timeout
    let run = t
        .submit(
            json!({"name": "timeout", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.misbehave", "input": {"mode": "hang"}, "timeout_ms": 1000,
            "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(30)).await;
    let s = &st.steps[0];
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(s.error.as_ref().expect("error").code, "ATTEMPT_TIMEOUT");
    let ev = events_of(&t, s.step_run_id, 1).await;
    let (kind, message) = ev.last().expect("events");
    assert_eq!(kind, "terminal_failed", "{ev:?}");
    assert!(message.starts_with("ATTEMPT_TIMEOUT: "), "{ev:?}");
    w.shutdown().await;
}

/// A reclaimed attempt (its worker stopped renewing) ends with a terminal
/// event too, written by the worker that reclaims it; an attempt that never
/// started gets none.
#[tokio::test]
async fn a_reclaimed_attempt_ends_with_a_terminal_event() {
    let t = TestDb::new().await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    for name in ["started", "leased-only"] {
        t.submit(tests::one_step(name, "go", "k", json!({}))).await;
    }
    let leased =
        t.db.lease(w, "w", &tests::route_go_k(), 2, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 2);
    t.db.mark_running(&leased[0].lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");
    sqlx::query("UPDATE durable.step_runs SET lease_expires_at = now() - interval '1 second'")
        .execute(t.db.pool())
        .await
        .expect("expire");
    assert_eq!(t.db.reclaim_expired("r", 10).await.expect("reclaim"), 2);
    let ev = events_of(&t, leased[0].lease.step_run_id(), 1).await;
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(ev[1].0, "retryable_failed", "{ev:?}");
    assert!(ev[1].1.starts_with("LEASE_EXPIRED: "), "{ev:?}");
    assert!(
        events_of(&t, leased[1].lease.step_run_id(), 1)
            .await
            .is_empty(),
        "an attempt that never started has no events"
    );
}
