//! The ledger's batched writes (issue 7), against the database: one
//! transaction per batch, every intent fenced and answered on its own.

use std::time::Duration;

use serde_json::json;
use supervisor::db::{
    Batch, CompleteWrite, Db, EventsWrite, LeasedStep, OwnedEvent, RowOutcome, StartWrite,
};
use tests::TestDb;
use uuid::Uuid;

async fn lease_one_each(t: &TestDb, runs: usize) -> Vec<LeasedStep> {
    let mut ids = Vec::new();
    for i in 0..runs {
        ids.push(
            t.submit(tests::one_step(&format!("r{i}"), "go", "k", json!({})))
                .await,
        );
    }
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let mut steps =
        t.db.lease(
            wid,
            "w",
            &tests::route_go_k(),
            runs as u32,
            Duration::from_secs(30),
        )
        .await
        .expect("lease");
    assert_eq!(steps.len(), runs);
    steps.sort_by_key(|s| ids.iter().position(|r| *r == s.run_id));
    steps
}

fn ev(seq: u64, kind: &'static str) -> OwnedEvent {
    OwnedEvent {
        sequence: seq,
        kind,
        message: format!("{kind} {seq}"),
        fraction: None,
        executor_at: None,
    }
}

fn start(s: &LeasedStep) -> StartWrite {
    StartWrite {
        run_id: s.run_id,
        lease: s.lease.clone(),
        pid: 1,
        event: ev(1, "accepted"),
    }
}

fn complete(s: &LeasedStep, seq: u64) -> CompleteWrite {
    CompleteWrite {
        run_id: s.run_id,
        lease: s.lease.clone(),
        output: json!({"n": seq}),
        sequence: Some(seq),
    }
}

async fn state_of(db: &Db, id: Uuid) -> String {
    sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE id = $1")
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect("state")
}

/// Four leases in one batch: two succeed, one's completion is refused by the
/// database (a site trigger raising 22023 for that row alone), one lost its
/// lease to another owner. Each intent gets its own answer; the refusal and
/// the loss take nothing else with them; one lease's start, events and
/// completion land in that order.
#[tokio::test]
async fn a_batch_answers_each_intent_on_its_own() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 4).await;
    let (a, b, c, d) = (&s[0], &s[1], &s[2], &s[3]);
    // d's lease is taken over (another owner's token)
    sqlx::query("UPDATE durable.step_runs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(d.lease.step_run_id())
        .execute(t.db.pool())
        .await
        .expect("steal");
    // the database refuses c's success, and only c's
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.refuse_c() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{}' AND NEW.state = 'succeeded' THEN
                 RAISE EXCEPTION 'refused by a site rule' USING ERRCODE = '22023';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_c BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.refuse_c();",
        c.lease.step_run_id()
    ))
    .execute(t.db.pool())
    .await
    .expect("site trigger");

    let batch = Batch {
        starts: s.iter().map(start).collect(),
        events: vec![EventsWrite {
            lease: a.lease.clone(),
            events: vec![ev(2, "running"), ev(3, "progress")],
        }],
        completes: vec![
            complete(a, 4),
            complete(b, 2),
            complete(c, 2),
            complete(d, 2),
        ],
    };
    let out = t.db.write_batch("w", &batch).await.expect("batch");
    assert_eq!(
        out.starts,
        vec![
            RowOutcome::Ok,
            RowOutcome::Ok,
            RowOutcome::Ok,
            RowOutcome::Lost
        ]
    );
    assert_eq!(out.events, vec![RowOutcome::Ok]);
    assert_eq!(out.completes[0], RowOutcome::Ok);
    assert_eq!(out.completes[1], RowOutcome::Ok);
    match &out.completes[2] {
        RowOutcome::Refused { sqlstate, message } => {
            assert_eq!(sqlstate, "22023");
            assert!(message.contains("refused by a site rule"), "{message}");
        }
        other => panic!("c's completion should be refused, got {other:?}"),
    }
    assert_eq!(out.completes[3], RowOutcome::Lost);
    // as a single write's caller would see them
    let err = out.completes[2]
        .clone()
        .into_result(c.lease.step_run_id())
        .expect_err("refused");
    assert!(!err.is_transient(), "22023 is permanent: {err}");
    assert_eq!(err.sqlstate().as_deref(), Some("22023"));
    assert!(matches!(
        out.completes[3].clone().into_result(d.lease.step_run_id()),
        Err(supervisor::db::DbError::LeaseLost { .. })
    ));

    assert_eq!(state_of(&t.db, a.lease.step_run_id()).await, "succeeded");
    assert_eq!(state_of(&t.db, b.lease.step_run_id()).await, "succeeded");
    // c's start committed, its refused completion did not
    assert_eq!(state_of(&t.db, c.lease.step_run_id()).await, "running");
    assert_eq!(state_of(&t.db, d.lease.step_run_id()).await, "leased");
    let kinds: Vec<(i64, String)> = sqlx::query_as(
        "SELECT sequence, kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
    )
    .bind(a.lease.step_run_id())
    .fetch_all(t.db.pool())
    .await
    .expect("events");
    let kinds: Vec<(i64, &str)> = kinds.iter().map(|(s, k)| (*s, k.as_str())).collect();
    assert_eq!(
        kinds,
        vec![
            (1, "accepted"),
            (2, "running"),
            (3, "progress"),
            (4, "succeeded")
        ]
    );
    assert_eq!(t.status(a.run_id).await.state, "succeeded");
    // nothing at all for d: its writes were fenced out
    assert_eq!(tests::event_count(&t.db, d.lease.step_run_id()).await, 0);
}

/// A retried batch (its first commit's answer was lost) writes nothing twice:
/// starts and events are idempotent, a second completion is fenced out.
#[tokio::test]
async fn a_retried_batch_writes_nothing_twice() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 2).await;
    let batch = Batch {
        starts: s.iter().map(start).collect(),
        events: s
            .iter()
            .map(|x| EventsWrite {
                lease: x.lease.clone(),
                events: vec![ev(2, "running")],
            })
            .collect(),
        completes: vec![],
    };
    let first = t.db.write_batch("w", &batch).await.expect("first");
    let again = t.db.write_batch("w", &batch).await.expect("again");
    assert_eq!(first.starts, again.starts);
    assert_eq!(again.events, vec![RowOutcome::Ok, RowOutcome::Ok]);
    for x in &s {
        assert_eq!(tests::event_count(&t.db, x.lease.step_run_id()).await, 2);
        assert_eq!(state_of(&t.db, x.lease.step_run_id()).await, "running");
    }
    let done = Batch {
        completes: s.iter().map(|x| complete(x, 3)).collect(),
        ..Batch::default()
    };
    let first = t.db.write_batch("w", &done).await.expect("complete");
    assert_eq!(first.completes, vec![RowOutcome::Ok, RowOutcome::Ok]);
    let again = t.db.write_batch("w", &done).await.expect("complete again");
    assert_eq!(again.completes, vec![RowOutcome::Lost, RowOutcome::Lost]);
    for x in &s {
        assert_eq!(tests::event_count(&t.db, x.lease.step_run_id()).await, 3);
    }
}
