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

/// A clean batch is written by the set form whole (one statement per table,
/// the step triggers once per batch), not intent by intent: called directly,
/// the set forms fence in every lease and raise nothing; and their writes are
/// what the intent-by-intent form writes (history, events, the runs' state).
#[tokio::test]
async fn a_clean_batch_is_written_by_the_set_form() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 3).await;
    let ids: Vec<Uuid> = s.iter().map(|x| x.lease.step_run_id()).collect();
    let tokens: Vec<Uuid> = s.iter().map(|x| x.lease.token()).collect();
    // s[2]'s start is never written: its completion records it first
    let fenced: Vec<i32> = sqlx::query_scalar(
        "SELECT unnest(durable.start_steps_set('w', $1, $2, '{7,7}', '{1,1}', '{accepted,accepted}',
                 '{\"\",\"\"}', '{NULL,NULL}', '{NULL,NULL}'))",
    )
    .bind(&ids[..2])
    .bind(&tokens[..2])
    .fetch_all(t.db.pool())
    .await
    .expect("the set form of the starts");
    assert_eq!(fenced.len(), 2);
    let fenced: Vec<i32> = sqlx::query_scalar(
        "SELECT unnest(durable.complete_steps_set('w', $1, $2, ARRAY['{\"a\":1}', '{\"a\":2}', '{\"a\":3}']::jsonb[], '{2,2,2}'))",
    )
    .bind(&ids)
    .bind(&tokens)
    .fetch_all(t.db.pool())
    .await
    .expect("the set form of the completions");
    let mut fenced = fenced;
    fenced.sort();
    assert_eq!(fenced, vec![1, 2, 3]);
    for (i, x) in s.iter().enumerate() {
        let history: Vec<(Option<String>, String, Option<String>)> = sqlx::query_as(
            "SELECT from_state, to_state, reason FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
        )
        .bind(x.lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("history");
        let changes: Vec<(Option<&str>, &str)> = history
            .iter()
            .map(|(f, to, _)| (f.as_deref(), to.as_str()))
            .collect();
        assert_eq!(
            changes,
            vec![
                (None, "pending"),
                (Some("pending"), "leased"),
                (Some("leased"), "running"),
                (Some("running"), "succeeded")
            ],
            "step {i}: one history row per change, in order"
        );
        let st = t.status(x.run_id).await;
        assert_eq!(st.state, "succeeded", "run {i}");
        assert_eq!(
            st.steps[0].output,
            Some(json!({"a": i + 1})),
            "step {i}: its own output"
        );
        let events: Vec<String> = sqlx::query_scalar(
            "SELECT kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
        )
        .bind(x.lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("events");
        let want: &[&str] = if i < 2 {
            &["accepted", "succeeded"]
        } else {
            &["succeeded"]
        };
        assert_eq!(events, want, "step {i}: its events");
    }
}

/// A batch that names one lease twice (no ledger builds one, but the
/// database does not rely on that): the first completion wins, the second is
/// fenced out, as when they come one by one.
#[tokio::test]
async fn a_batch_naming_a_lease_twice_answers_as_one_by_one() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 1).await;
    let batch = Batch {
        completes: vec![complete(&s[0], 2), complete(&s[0], 3)],
        ..Batch::default()
    };
    let out = t.db.write_batch("w", &batch).await.expect("batch");
    assert_eq!(out.completes, vec![RowOutcome::Ok, RowOutcome::Lost]);
    let st = t.status(s[0].run_id).await;
    assert_eq!(st.steps[0].output, Some(json!({"n": 2})));
}
