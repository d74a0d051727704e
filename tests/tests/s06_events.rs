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
