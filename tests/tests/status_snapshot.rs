//! `status` reads a run and its steps in one snapshot: read one statement
//! at a time, a busy run showed itself pending beside a running step, or a
//! step in neither `steps` nor `waiting` (operator audit: 2–5 % of polls of
//! a two-step run).
//!
//! Its own test binary: the delay it injects is process-wide.

use std::time::{Duration, Instant};

use serde_json::json;
use tests::TestDb;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_a_run_and_its_steps_in_one_snapshot() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "snap", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "w", "test", &json!([]))
        .await
        .expect("register");
    let a =
        t.db.lease(w, "w", &tests::route_go_k(), 1, Duration::from_secs(30))
            .await
            .expect("lease")
            .remove(0);
    t.db.mark_running(&a.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");

    // a status read that waits between the run and its steps …
    supervisor::fault::delay_status_reads_of(Some((run, Duration::from_millis(800))));
    let entered = supervisor::fault::delayed_status_reads();
    let db = t.db.clone();
    let read = tokio::spawn(async move { db.status(run).await });
    let until = Instant::now() + Duration::from_secs(5);
    while supervisor::fault::delayed_status_reads() == entered {
        assert!(Instant::now() < until, "the read did not reach the delay");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // … while a succeeds and b is created, in one transaction
    t.db.complete(&a.lease, "w", &json!({}), &[], None)
        .await
        .expect("complete a");
    let st = read.await.expect("join").expect("status");
    supervisor::fault::delay_status_reads_of(None);

    // what it shows is one moment: before the completion, whole
    let states: Vec<(&str, &str)> = st
        .steps
        .iter()
        .map(|s| (s.name.as_str(), s.state.as_str()))
        .collect();
    let waiting: Vec<&str> = st.waiting.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        (st.state.as_str(), states, waiting),
        ("running", vec![("a", "running")], vec!["b"]),
        "{st:?}"
    );
    // and afterwards, the moment after
    let st = t.status(run).await;
    let states: Vec<(&str, &str)> = st
        .steps
        .iter()
        .map(|s| (s.name.as_str(), s.state.as_str()))
        .collect();
    assert_eq!(states, [("a", "succeeded"), ("b", "pending")]);
    assert!(st.waiting.is_empty());
}
