//! Database operations composed in a caller's transaction (issue 7): every
//! `Db` method has a `DbConn` form that runs on the caller's connection, so
//! several of them commit or roll back together, and one that fails inside
//! the caller's transaction undoes only its own work (a savepoint) instead of
//! aborting the caller's transaction.

use std::time::Duration;

use serde_json::json;
use supervisor::db::{
    Batch, Db, DbConn, DbError, EventsWrite, FailureReport, LeasedStep, OwnedEvent, RowOutcome,
    StartWrite,
};
use supervisor::state::{Failure, RunState};
use tests::TestDb;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(30);

async fn register(db: &Db) -> Uuid {
    let wid = Uuid::new_v4();
    db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    wid
}

async fn count(db: &Db, sql: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect(sql)
}

/// (state, attempt) of a step, as the pool (any other session) sees it.
async fn step_row(db: &Db, id: Uuid) -> (String, i32) {
    sqlx::query_as("SELECT state, attempt FROM durable.step_runs WHERE id = $1")
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect("step row")
}

/// A step's history, without ids and times: what must be the same whether
/// its writes were made one by one or composed in one transaction.
async fn history(
    db: &Db,
    step_run_id: Uuid,
) -> Vec<(Option<String>, String, Option<i32>, Option<String>)> {
    sqlx::query_as(
        "SELECT from_state, to_state, attempt, reason FROM durable.transitions
          WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(step_run_id)
    .fetch_all(db.pool())
    .await
    .expect("transitions")
}

async fn events(db: &Db, step_run_id: Uuid) -> Vec<(i32, i64, String)> {
    sqlx::query_as(
        "SELECT attempt, sequence, kind FROM durable.step_events
          WHERE step_run_id = $1 ORDER BY attempt, sequence",
    )
    .bind(step_run_id)
    .fetch_all(db.pool())
    .await
    .expect("events")
}

/// Lease, mark running, complete: one attempt's writes, on one connection.
async fn run_attempt(c: &mut DbConn<'_>, wid: Uuid) -> Result<LeasedStep, DbError> {
    let mut leased = c.lease(wid, "w", &tests::route_go_k(), 1, TTL).await?;
    assert_eq!(leased.len(), 1, "one step to lease");
    let s = leased.remove(0);
    c.mark_running(&s.lease, "w", 1, &tests::accepted_event())
        .await?;
    c.complete(&s.lease, "w", &json!({"ok": true}), &[], Some(2))
        .await?;
    Ok(s)
}

/// Submit and cancel in one transaction: inside it the run exists and is
/// cancelled; no other session sees it; rolled back, it never existed.
#[tokio::test]
async fn submit_and_cancel_rolled_back_leave_nothing() {
    let t = TestDb::new().await;
    let mut tx = t.db.begin().await.expect("begin");
    let run = tx
        .conn()
        .submit(&tests::one_step("r", "go", "k", json!({})))
        .await
        .expect("submit");
    let state = tx.conn().cancel(run, None).await.expect("cancel");
    assert_eq!(state, RunState::Cancelled);
    let inside = tx.conn().status(run).await.expect("status inside");
    assert!(inside.cancel_requested);
    assert_eq!(inside.state, "cancelled");
    // the pool's sessions see nothing before the commit: the writes were
    // made on the transaction's connection, not on the pool
    assert!(matches!(t.db.status(run).await, Err(DbError::NotFound(_))));
    tx.rollback().await.expect("rollback");
    assert!(matches!(t.db.status(run).await, Err(DbError::NotFound(_))));
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        0
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs").await,
        0
    );
}

/// Lease, mark running and complete in one transaction whose closure fails
/// afterwards: everything is rolled back. The step is pending again, its
/// attempt unchanged, and no history row or event was added.
#[tokio::test]
async fn an_attempt_rolled_back_leaves_the_step_pending() {
    let t = TestDb::new().await;
    let run = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let step = t.status(run).await.steps[0].step_run_id;
    let wid = register(&t.db).await;
    let before = history(&t.db, step).await;
    assert_eq!(step_row(&t.db, step).await, ("pending".into(), 0));

    let res: Result<(), DbError> =
        t.db.transaction(async |c| {
            let s = run_attempt(c, wid).await?;
            assert_eq!(s.lease.step_run_id(), step);
            // inside the transaction the step is done ...
            let st = c.status(run).await?;
            assert_eq!(st.steps[0].state, "succeeded");
            assert_eq!(st.state, "succeeded");
            // ... and the caller gives up: everything goes
            Err(DbError::NotFound("the caller changed its mind".into()))
        })
        .await;
    assert!(matches!(res, Err(DbError::NotFound(_))), "{res:?}");

    assert_eq!(step_row(&t.db, step).await, ("pending".into(), 0));
    assert_eq!(history(&t.db, step).await, before);
    assert!(events(&t.db, step).await.is_empty());
    assert_eq!(t.status(run).await.state, "pending");
    // and it can be leased again, as attempt 1
    let again =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, TTL)
            .await
            .expect("lease");
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].lease.attempt(), 1);
}

/// The same attempt composed in one committed transaction (with the submit)
/// leaves exactly what the calls made one by one on the pool leave: the
/// same history, events, states and output.
#[tokio::test]
async fn an_attempt_committed_is_the_same_as_one_by_one() {
    let t = TestDb::new().await;
    let wid = register(&t.db).await;

    // one by one, each call its own transaction on the pool
    let run_a = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let mut la =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, TTL)
            .await
            .expect("lease a");
    let a = la.remove(0);
    t.db.mark_running(&a.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running a");
    t.db.complete(&a.lease, "w", &json!({"ok": true}), &[], Some(2))
        .await
        .expect("complete a");

    // the same writes, and the submit, in one transaction
    let mut tx = t.db.begin().await.expect("begin");
    let run_b = tx
        .conn()
        .submit(&tests::one_step("r", "go", "k", json!({})))
        .await
        .expect("submit b");
    let b = run_attempt(&mut tx.conn(), wid).await.expect("attempt b");
    assert_eq!(b.run_id, run_b);
    tx.commit().await.expect("commit");

    let (sa, sb) = (t.status(run_a).await, t.status(run_b).await);
    assert_eq!(sa.state, "succeeded");
    assert_eq!(sb.state, sa.state);
    assert_eq!(sb.finished_at.is_some(), sa.finished_at.is_some());
    let (stepa, stepb) = (&sa.steps[0], &sb.steps[0]);
    assert_eq!(stepb.state, stepa.state);
    assert_eq!(stepb.attempt, stepa.attempt);
    assert_eq!(stepb.output, stepa.output);
    assert_eq!(stepb.events, stepa.events);
    let ha = history(&t.db, stepa.step_run_id).await;
    assert_eq!(ha.len(), 4, "{ha:?}"); // created, leased, running, succeeded
    assert_eq!(history(&t.db, stepb.step_run_id).await, ha);
    assert_eq!(
        events(&t.db, stepb.step_run_id).await,
        events(&t.db, stepa.step_run_id).await
    );
    let runs = |id| {
        count(
            &t.db,
            "SELECT count(*) FROM durable.transitions WHERE run_id = $1 AND step_run_id IS NULL",
            id,
        )
    };
    assert_eq!(runs(run_b).await, runs(run_a).await);
}

/// Failures inside the caller's transaction undo only themselves: a write the
/// database refuses (a site trigger), an invalid spec, a fenced write whose
/// lease is gone, a failure write refused inside the step write's own
/// transaction. After each the caller goes on on the same transaction and
/// commits the rest: without savepoints the first refusal would abort it.
#[tokio::test]
async fn a_failed_operation_does_not_poison_the_callers_transaction() {
    let t = TestDb::new().await;
    let run_a = t.submit(tests::one_step("a", "go", "k", json!({}))).await;
    let run_b = t.submit(tests::one_step("b", "go", "k", json!({}))).await;
    let step_a = t.status(run_a).await.steps[0].step_run_id;
    let step_b = t.status(run_b).await.steps[0].step_run_id;
    let wid = register(&t.db).await;
    // the database refuses a's success and a's terminal failure, only a's
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.refuse_a() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{step_a}' AND NEW.state IN ('succeeded', 'terminal_failed') THEN
                 RAISE EXCEPTION 'refused by a site rule' USING ERRCODE = '22023';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_a BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.refuse_a();"
    ))
    .execute(t.db.pool())
    .await
    .expect("site trigger");

    let mut tx = t.db.begin().await.expect("begin");
    let mut c = tx.conn();
    let leased = c
        .lease(wid, "w", &tests::route_go_k(), 2, TTL)
        .await
        .expect("lease");
    let a = leased.iter().find(|s| s.run_id == run_a).expect("a leased");
    let b = leased.iter().find(|s| s.run_id == run_b).expect("b leased");

    // 1. a single statement the database refuses
    let err = c
        .complete(&a.lease, "w", &json!({}), &[], None)
        .await
        .expect_err("a's success is refused");
    assert_eq!(err.sqlstate().as_deref(), Some("22023"), "{err}");
    // 2. an invalid spec (the database raises)
    let err = c
        .submit(&json!({"name": "bad", "steps": "not a list"}))
        .await
        .expect_err("invalid spec");
    assert!(matches!(err, DbError::InvalidSpec(_)), "{err}");
    // 3. a write that begins its own transaction (run lock first), refused
    //    inside it: that transaction is a savepoint of the caller's
    let report = FailureReport {
        failure: Failure {
            code: "BOOM".into(),
            retryable: false,
            next_retry_delay: None,
        },
        message: "permanent".into(),
        details: None,
        sequence: None,
    };
    let err = c
        .fail(&a.lease, "w", &report, 0.0)
        .await
        .expect_err("a's terminal failure is refused");
    assert_eq!(err.sqlstate().as_deref(), Some("22023"), "{err}");
    // the caller's transaction still works: b completes ...
    c.complete(&b.lease, "w", &json!({"b": 1}), &[], None)
        .await
        .expect("complete b after the refusals");
    // 4. ... and a fenced write with b's lease, now stale, is LeaseLost
    let err = c
        .release(&b.lease, "w", "too late")
        .await
        .expect_err("b's lease is gone");
    assert!(matches!(err, DbError::LeaseLost { step_run_id } if step_run_id == step_b));
    // a goes back to the queue, in the same transaction
    c.release(&a.lease, "w", "drained")
        .await
        .expect("release a after the refusals");
    tx.commit().await.expect("commit after the refusals");

    assert_eq!(t.status(run_b).await.state, "succeeded");
    assert_eq!(
        step_row(&t.db, step_a).await,
        ("retryable_failed".into(), 1)
    );
    // a's history has the lease and the release, none of the refused writes
    let ha: Vec<String> = history(&t.db, step_a)
        .await
        .into_iter()
        .map(|h| h.1)
        .collect();
    assert_eq!(ha, ["pending", "leased", "retryable_failed"]);
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        2
    );
}

/// The ledger's batch inside a caller's transaction: its own transaction is
/// a savepoint, so the caller's rollback takes the batch with it.
#[tokio::test]
async fn a_ledger_batch_rolls_back_with_the_callers_transaction() {
    let t = TestDb::new().await;
    let run = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let wid = register(&t.db).await;
    let mut leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, TTL)
            .await
            .expect("lease");
    let s = leased.remove(0);
    let ev = |sequence, kind| OwnedEvent {
        sequence,
        kind,
        message: String::new(),
        fraction: None,
        executor_at: None,
    };
    let batch = Batch {
        starts: vec![StartWrite {
            run_id: run,
            lease: s.lease.clone(),
            pid: 1,
            event: ev(1, "accepted"),
        }],
        events: vec![EventsWrite {
            lease: s.lease.clone(),
            events: vec![ev(2, "progress")],
        }],
        completes: vec![],
    };
    // an sqlx transaction of the caller's own, with DbConn::new
    let mut tx = t.db.pool().begin().await.expect("begin");
    let out = DbConn::new(&mut tx)
        .write_batch("w", &batch)
        .await
        .expect("batch");
    assert_eq!(out.starts, vec![RowOutcome::Ok]);
    assert_eq!(out.events, vec![RowOutcome::Ok]);
    assert_eq!(step_row(&t.db, s.lease.step_run_id()).await.0, "leased");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        step_row(&t.db, s.lease.step_run_id()).await,
        ("leased".into(), 1)
    );
    assert!(events(&t.db, s.lease.step_run_id()).await.is_empty());
}
