//! S02: competing workers and a short lease — lease, heartbeat, expiry. Each
//! step completes exactly once; an owner that stops heartbeating loses its
//! lease, the step is reclaimed and completed by another, and the stale
//! owner's late completion is refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use supervisor::db::{Db, DbError};
use tests::TestDb;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_complete_each_step_exactly_once() {
    let t = TestDb::new().await;
    const STEPS: usize = 240;
    for i in 0..STEPS {
        t.submit(json!({"name": format!("r{i}"), "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
                        "input": {"i": i}}]}))
            .await;
    }
    let completions: Arc<Mutex<HashMap<Uuid, Vec<usize>>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..8usize {
        let db = t.connect(2).await; // a separate pool: a separate worker host
        let completions = completions.clone();
        tasks.push(tokio::spawn(async move {
            let id = Uuid::new_v4();
            let name = format!("w{w}");
            db.register_worker(id, &name, "test", &json!([]))
                .await
                .expect("register");
            let mut idle = 0;
            while idle < 5 {
                let steps = db
                    .lease(
                        id,
                        &name,
                        &tests::route_go_k(),
                        3,
                        Duration::from_millis(800),
                    )
                    .await
                    .expect("lease");
                if steps.is_empty() {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                idle = 0;
                for s in steps {
                    db.mark_running(&s.lease, &name, 1, &tests::accepted_event())
                        .await
                        .expect("running");
                    match db
                        .complete(&s.lease, &name, &json!({"by": name}), &[], Some(2))
                        .await
                    {
                        Ok(_) => completions
                            .lock()
                            .expect("lock")
                            .entry(s.lease.step_run_id())
                            .or_default()
                            .push(w),
                        Err(DbError::LeaseLost { .. }) => {}
                        Err(e) => panic!("complete: {e}"),
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("worker task");
    }
    let completions = completions.lock().expect("lock").clone();
    assert_eq!(completions.len(), STEPS, "every step completed");
    let twice: Vec<_> = completions.iter().filter(|(_, v)| v.len() != 1).collect();
    assert!(
        twice.is_empty(),
        "steps completed more than once: {twice:?}"
    );
    let mut per_worker = [0usize; 8];
    for v in completions.values() {
        per_worker[v[0]] += 1;
    }
    println!("completions per worker: {per_worker:?}");
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs WHERE state = 'succeeded'")
            .await,
        STEPS as i64
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs WHERE state = 'succeeded'")
            .await,
        STEPS as i64
    );
}

#[tokio::test]
async fn a_silent_owner_loses_its_lease_and_its_late_completion_is_refused() {
    let t = TestDb::new().await;
    let run = t
        .submit(
            json!({"name": "expiry", "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
                       "retry": {"initial_interval_ms": 0, "max_attempts": 3}}]}),
        )
        .await;
    let (a, b): (Db, Db) = (t.connect(2).await, t.connect(2).await);
    let (ida, idb) = (Uuid::new_v4(), Uuid::new_v4());
    a.register_worker(ida, "stale", "test", &json!([]))
        .await
        .expect("register");
    b.register_worker(idb, "fresh", "test", &json!([]))
        .await
        .expect("register");

    let leased = a
        .lease(
            ida,
            "stale",
            &tests::route_go_k(),
            1,
            Duration::from_millis(300),
        )
        .await
        .expect("lease");
    assert_eq!(leased.len(), 1);
    let stale = leased[0].lease.clone();
    a.mark_running(&stale, "stale", 1, &tests::accepted_event())
        .await
        .expect("running");
    // no other worker can take it while the lease lives
    assert!(b
        .lease(
            idb,
            "fresh",
            &tests::route_go_k(),
            1,
            Duration::from_millis(300)
        )
        .await
        .expect("lease")
        .is_empty());
    assert_eq!(
        b.reclaim_expired("fresh", 10).await.expect("reclaim"),
        0,
        "not expired yet"
    );

    // the owner stops heartbeating; the lease expires on the database clock
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(b.reclaim_expired("fresh", 10).await.expect("reclaim"), 1);
    let st = t.status(run).await;
    assert_eq!(st.steps[0].state, "retryable_failed");
    assert_eq!(
        st.steps[0].error.as_ref().map(|e| e.code.as_str()),
        Some("LEASE_EXPIRED")
    );

    let again = b
        .lease(
            idb,
            "fresh",
            &tests::route_go_k(),
            1,
            Duration::from_millis(5_000),
        )
        .await
        .expect("lease");
    assert_eq!(again.len(), 1);
    let fresh = again[0].lease.clone();
    assert_eq!(fresh.attempt(), 2);
    assert_ne!(fresh.token(), stale.token());
    assert_eq!(
        again[0].idempotency_key, leased[0].idempotency_key,
        "same key on every attempt"
    );

    // the stale owner's heartbeat reports the loss; its writes are refused
    let hb = a
        .heartbeat(
            ida,
            std::slice::from_ref(&stale),
            Duration::from_millis(300),
        )
        .await
        .expect("heartbeat");
    assert_eq!(hb.lost, vec![stale.step_run_id()]);
    b.mark_running(&fresh, "fresh", 1, &tests::accepted_event())
        .await
        .expect("running");
    let late = a
        .complete(&stale, "stale", &json!({"by": "stale"}), &[], Some(9))
        .await;
    assert!(matches!(late, Err(DbError::LeaseLost { .. })), "{late:?}");
    let late_event = a.record_event(&stale, &tests::accepted_event()).await;
    assert!(
        matches!(late_event, Err(DbError::LeaseLost { .. })),
        "{late_event:?}"
    );
    b.complete(&fresh, "fresh", &json!({"by": "fresh"}), &[], Some(2))
        .await
        .expect("complete");
    let late = a
        .complete(&stale, "stale", &json!({"by": "stale"}), &[], Some(9))
        .await;
    assert!(
        matches!(late, Err(DbError::LeaseLost { .. })),
        "after success too: {late:?}"
    );

    let st = t.status(run).await;
    assert_eq!(st.state, "succeeded");
    assert_eq!(st.steps[0].output, Some(json!({"by": "fresh"})));
    let reasons: Vec<(String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT to_state, reason, worker FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(stale.step_run_id())
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    let expired = reasons
        .iter()
        .find(|(to, _, _)| to == "retryable_failed")
        .expect("reclaim recorded");
    assert!(
        expired
            .1
            .as_deref()
            .unwrap_or("")
            .starts_with("LEASE_EXPIRED"),
        "{reasons:?}"
    );
    assert_eq!(
        expired.2.as_deref(),
        Some("fresh"),
        "recorded as done by the reclaimer"
    );
}

#[tokio::test]
async fn heartbeats_keep_a_short_lease_alive_in_one_statement() {
    let t = TestDb::new().await;
    for i in 0..20 {
        t.submit(json!({"name": format!("hb{i}"), "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]}))
            .await;
    }
    let w = t.connect(2).await;
    let reclaimer = t.connect(2).await;
    let id = Uuid::new_v4();
    w.register_worker(id, "hb", "test", &json!([]))
        .await
        .expect("register");
    let steps = w
        .lease(
            id,
            "hb",
            &tests::route_go_k(),
            20,
            Duration::from_millis(400),
        )
        .await
        .expect("lease");
    assert_eq!(steps.len(), 20);
    let leases: Vec<_> = steps.iter().map(|s| s.lease.clone()).collect();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let r = w
            .heartbeat(id, &leases, Duration::from_millis(400))
            .await
            .expect("heartbeat");
        assert_eq!(r.renewed, 20, "one statement renews all twenty");
        assert!(r.lost.is_empty());
        assert_eq!(
            reclaimer.reclaim_expired("r", 100).await.expect("reclaim"),
            0
        );
    }
    // a cancel request shows up in the next heartbeat
    let run = t.status_of_step(steps[3].lease.step_run_id()).await;
    t.db.cancel(run, None).await.expect("cancel");
    let r = w
        .heartbeat(id, &leases, Duration::from_millis(400))
        .await
        .expect("heartbeat");
    assert_eq!(r.cancel_requested, vec![steps[3].lease.step_run_id()]);
    for s in &steps {
        w.confirm_cancelled(&s.lease, "hb", "test")
            .await
            .expect("cancel");
    }
}

trait StepRun {
    async fn status_of_step(&self, step: Uuid) -> Uuid;
}

impl StepRun for TestDb {
    async fn status_of_step(&self, step: Uuid) -> Uuid {
        sqlx::query_scalar("SELECT run_id FROM durable.step_runs WHERE id = $1")
            .bind(step)
            .fetch_one(self.db.pool())
            .await
            .expect("run of step")
    }
}

/// A worker paused past its TTL (SIGSTOP, a frozen VM) wakes with leases
/// the database has let expire but no reclaimer has seen yet. Its renewal
/// must not bring them back: its own lease clock has run out and given the
/// attempt up, and a renewed row stayed `running` with no process for one
/// TTL more before anyone reclaimed it.
#[tokio::test]
async fn an_expired_lease_is_not_renewed_before_a_reclaimer_sees_it() {
    let t = TestDb::new().await;
    t.submit(
        json!({"name": "paused", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]}),
    )
    .await;
    let w = t.connect(2).await;
    let id = Uuid::new_v4();
    w.register_worker(id, "paused", "test", &json!([]))
        .await
        .expect("register");
    let steps = w
        .lease(
            id,
            "paused",
            &tests::route_go_k(),
            1,
            Duration::from_millis(300),
        )
        .await
        .expect("lease");
    assert_eq!(steps.len(), 1);
    let lease = steps[0].lease.clone();
    w.mark_running(&lease, "paused", 1, &tests::accepted_event())
        .await
        .expect("running");
    tokio::time::sleep(Duration::from_millis(450)).await;
    let hb = w
        .heartbeat(
            id,
            std::slice::from_ref(&lease),
            Duration::from_millis(5_000),
        )
        .await
        .expect("heartbeat");
    assert_eq!(hb.lost, vec![lease.step_run_id()], "{hb:?}");
    assert_eq!(hb.renewed, 0);
    let still_expired: bool = sqlx::query_scalar(
        "SELECT durable.lease_expiry(id) < now() FROM durable.step_runs WHERE id = $1",
    )
    .bind(lease.step_run_id())
    .fetch_one(t.db.pool())
    .await
    .expect("row");
    assert!(still_expired, "the renewal moved an expired lease's expiry");
    assert_eq!(
        t.connect(2)
            .await
            .reclaim_expired("reclaimer", 10)
            .await
            .expect("reclaim"),
        1,
        "reclaimed at once, not one TTL later"
    );
}
