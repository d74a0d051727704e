//! The ledger's batched writes (issue 7), against the database: one
//! transaction per batch, every intent fenced and answered on its own; the
//! writes that no set form carries (checkpoints, completions with artifacts,
//! failures, cancellations, refusals, releases) in the same transaction,
//! each in a savepoint of its own.

use std::time::Duration;

use serde_json::json;
use supervisor::db::{
    Batch, CancelWrite, CheckpointEvent, CheckpointWrite, CompleteStoredWrite, CompleteWrite, Db,
    DbError, EventsWrite, FailWrite, FailureReport, LeasedStep, LedgerWrite, NewArtifact,
    OwnedEvent, RefuseWrite, ReleaseWrite, RowOutcome, StartWrite, Written,
};
use supervisor::state::Failure;
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

/// Another owner takes `s`'s lease over (a new token): its writes are fenced out.
async fn steal(t: &TestDb, s: &LeasedStep) {
    sqlx::query("UPDATE durable.step_runs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(s.lease.step_run_id())
        .execute(t.db.pool())
        .await
        .expect("steal");
}

/// A site rule (a trigger of the operator's) refuses `s`'s update into
/// `state`, and only that one, with SQLSTATE 22023 and `message`.
async fn refuse_entering(t: &TestDb, s: &LeasedStep, state: &str, message: &str) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.refuse_{state}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{id}' AND NEW.state = '{state}' THEN
                 RAISE EXCEPTION '{message}' USING ERRCODE = '22023';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse_{state} BEFORE UPDATE ON durable.step_runs
             FOR EACH ROW EXECUTE FUNCTION public.refuse_{state}();",
        id = s.lease.step_run_id()
    ))
    .execute(t.db.pool())
    .await
    .expect("site trigger");
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
    steal(&t, d).await;
    // the database refuses c's success, and only c's
    refuse_entering(&t, c, "succeeded", "refused by a site rule").await;

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

// ---------------------------------------------------------------------------
// every other write of a lease holder, in the same batch (LedgerWrite)

async fn lease_specs(t: &TestDb, specs: Vec<serde_json::Value>) -> Vec<LeasedStep> {
    let mut ids = Vec::new();
    for spec in specs {
        ids.push(t.submit(spec).await);
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
            ids.len() as u32,
            Duration::from_secs(30),
        )
        .await
        .expect("lease");
    assert_eq!(steps.len(), ids.len());
    steps.sort_by_key(|s| ids.iter().position(|r| *r == s.run_id));
    steps
}

/// One step of executor kind go / kind k, at most `max_attempts` attempts.
fn attempts(name: &str, max_attempts: u32) -> serde_json::Value {
    json!({
        "name": name,
        "steps": [{"name": "s", "executor_kind": "go", "kind": "k", "input": {},
                   "retry": {"max_attempts": max_attempts}}]
    })
}

fn failure(s: &LeasedStep, code: &str, retryable: bool, sequence: Option<u64>) -> LedgerWrite {
    LedgerWrite::Fail(FailWrite {
        lease: s.lease.clone(),
        report: FailureReport {
            failure: Failure {
                code: code.into(),
                retryable,
                next_retry_delay: None,
            },
            message: format!("{code} happened"),
            details: None,
            sequence,
        },
        jitter: 0.5,
    })
}

fn checkpointed(s: &LeasedStep, from: u64, bytes: &[u8]) -> LedgerWrite {
    LedgerWrite::Checkpoint(CheckpointWrite {
        lease: s.lease.clone(),
        renew_for: Duration::from_secs(30),
        events: vec![
            CheckpointEvent {
                event: ev(from, "progress"),
                checkpoint: Some(bytes.to_vec()),
            },
            CheckpointEvent {
                event: ev(from + 1, "running"),
                checkpoint: None,
            },
        ],
    })
}

fn sha_hex(content: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(content)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

async fn history(db: &Db, id: Uuid) -> Vec<(Option<String>, String, Option<String>)> {
    tests::step_transitions(db, id)
        .await
        .into_iter()
        .map(|h| (h.from_state, h.to_state, h.reason))
        .collect()
}

fn changes(h: &[(Option<String>, String, Option<String>)]) -> Vec<(Option<&str>, &str)> {
    h.iter()
        .map(|(f, to, _)| (f.as_deref(), to.as_str()))
        .collect()
}

/// A site trigger that, the first time a step row's update matches `when`
/// (SQL over OLD and NEW), pauses `pause_s` seconds and then ends its own
/// backend: the ledger's batch loses its connection in the middle. How many
/// times the condition matched is `public.cut_seq` (nextval is not undone by
/// the rollback, so the connection is cut once).
async fn cut_connection_once(t: &TestDb, when: &str, pause_s: f64) {
    sqlx::raw_sql(&format!(
        "CREATE SEQUENCE public.cut_seq;
         CREATE FUNCTION public.cut_connection() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF {when} AND nextval('public.cut_seq') = 1 THEN
                 PERFORM pg_sleep({pause_s});
                 PERFORM pg_terminate_backend(pg_backend_pid());
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER cut_connection BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.cut_connection();"
    ))
    .execute(t.db.pool())
    .await
    .expect("trigger");
}

async fn events_of(db: &Db, id: Uuid) -> Vec<(i64, String, bool)> {
    sqlx::query_as(
        "SELECT sequence, kind, checkpoint FROM durable.step_events WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(db.pool())
    .await
    .expect("events")
}

async fn error_code(db: &Db, id: Uuid) -> Option<String> {
    sqlx::query_scalar("SELECT error_code FROM durable.step_runs WHERE id = $1")
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect("error code")
}

/// A failure (retried and final), a refusal, a release, a cancellation, a
/// checkpoint and a completion with artifacts, in one batch behind the
/// starts: each commits with its own answer (the failure's decision, the
/// refusal's state, the artifacts' ids), its end state and its history.
#[tokio::test]
async fn every_write_of_a_lease_holder_commits_in_one_batch_with_its_answer() {
    let t = TestDb::new().await;
    let s = lease_specs(
        &t,
        vec![
            attempts("retried", 3),
            attempts("final", 1),
            attempts("refused", 3),
            attempts("released", 3),
            attempts("cancelled", 3),
            attempts("artifacts", 3),
        ],
    )
    .await;
    let (retried, last, refused, released, cancelled, arts) =
        (&s[0], &s[1], &s[2], &s[3], &s[4], &s[5]);
    let content = b"the bytes of an artifact";
    let sha = sha_hex(content);
    t.db.record_inline_blob(&sha, content).await.expect("blob");
    // every lease but the refused one starts (a refusal comes before `accepted`)
    let batch = Batch {
        starts: [retried, last, released, cancelled, arts]
            .into_iter()
            .map(start)
            .collect(),
        ..Batch::default()
    };
    let writes = vec![
        failure(retried, "FLAKY", true, Some(2)),
        failure(last, "FLAKY", true, Some(2)),
        LedgerWrite::Refuse(RefuseWrite {
            lease: refused.lease.clone(),
            code: "KIND_UNSUPPORTED".into(),
            message: "not here".into(),
            delay: Duration::from_millis(10),
            max_refusals: 5,
        }),
        LedgerWrite::Release(ReleaseWrite {
            lease: released.lease.clone(),
            message: "draining".into(),
        }),
        LedgerWrite::Cancel(CancelWrite {
            lease: cancelled.lease.clone(),
            message: "cancelled by the executor".into(),
        }),
        checkpointed(arts, 2, b"cp-1"),
        LedgerWrite::CompleteStored(CompleteStoredWrite {
            lease: arts.lease.clone(),
            output: json!({"done": true}),
            artifacts: vec![NewArtifact {
                name: "out.bin".into(),
                sha256: sha.clone(),
                size: content.len() as i64,
                media_type: "application/octet-stream".into(),
                derived_from: vec![],
            }],
            sequence: Some(4),
        }),
    ];
    let out =
        t.db.write_ledger("w", &batch, &writes)
            .await
            .expect("batch");
    assert_eq!(out.batch.starts, vec![RowOutcome::Ok; 5]);
    let answers: Vec<Written> = out
        .writes
        .into_iter()
        .map(|r| r.expect("every write commits"))
        .collect();
    match &answers[0] {
        Written::Fail(d) => {
            assert_eq!(d.to.as_str(), "retryable_failed");
            assert!(d.next_attempt_at.is_some(), "a retry has its time");
        }
        other => panic!("a failure's answer is its decision, got {other:?}"),
    }
    match &answers[1] {
        Written::Fail(d) => {
            assert_eq!(d.to.as_str(), "terminal_failed");
            assert!(d.next_attempt_at.is_none());
        }
        other => panic!("a failure's answer is its decision, got {other:?}"),
    }
    assert_eq!(answers[2], Written::Refuse("retryable_failed".into()));
    assert_eq!(answers[3], Written::Release);
    assert_eq!(answers[4], Written::Cancel);
    assert_eq!(answers[5], Written::Checkpoint);
    let ids = match &answers[6] {
        Written::CompleteStored(ids) => ids.clone(),
        other => panic!("a completion's answer is its artifacts' ids, got {other:?}"),
    };
    assert_eq!(ids.len(), 1);

    // end states and history, as the single writes leave them
    let id = |x: &LeasedStep| x.lease.step_run_id();
    let run_path = |last: &'static str| {
        vec![
            (None, "pending"),
            (Some("pending"), "leased"),
            (Some("leased"), "running"),
            (Some("running"), last),
        ]
    };
    assert_eq!(
        changes(&history(&t.db, id(retried)).await),
        run_path("retryable_failed")
    );
    assert_eq!(
        changes(&history(&t.db, id(last)).await),
        run_path("terminal_failed")
    );
    assert_eq!(
        changes(&history(&t.db, id(released)).await),
        run_path("retryable_failed")
    );
    assert_eq!(
        changes(&history(&t.db, id(cancelled)).await),
        run_path("cancelled")
    );
    assert_eq!(
        changes(&history(&t.db, id(arts)).await),
        run_path("succeeded")
    );
    assert_eq!(
        changes(&history(&t.db, id(refused)).await),
        vec![
            (None, "pending"),
            (Some("pending"), "leased"),
            (Some("leased"), "retryable_failed")
        ]
    );
    assert_eq!(
        error_code(&t.db, id(retried)).await.as_deref(),
        Some("FLAKY")
    );
    assert_eq!(error_code(&t.db, id(last)).await.as_deref(), Some("FLAKY"));
    assert_eq!(
        error_code(&t.db, id(refused)).await.as_deref(),
        Some("KIND_UNSUPPORTED")
    );
    assert_eq!(
        error_code(&t.db, id(released)).await.as_deref(),
        Some("WORKER_SHUTDOWN")
    );
    assert_eq!(
        error_code(&t.db, id(cancelled)).await.as_deref(),
        Some("CANCELLED")
    );
    // the refusal gave its attempt back, the release did not count its own
    let (attempt, refusals, uncounted): (i32, i32, i32) = sqlx::query_as(
        "SELECT attempt, refusals, uncounted_attempts FROM durable.step_runs WHERE id = $1",
    )
    .bind(id(refused))
    .fetch_one(t.db.pool())
    .await
    .expect("refused row");
    assert_eq!((attempt, refusals, uncounted), (0, 1, 0));
    let uncounted: i32 =
        sqlx::query_scalar("SELECT uncounted_attempts FROM durable.step_runs WHERE id = $1")
            .bind(id(released))
            .fetch_one(t.db.pool())
            .await
            .expect("released row");
    assert_eq!(uncounted, 1);
    // the failures' terminal events
    assert_eq!(
        events_of(&t.db, id(retried)).await,
        vec![
            (1, "accepted".into(), false),
            (2, "retryable_failed".into(), false)
        ]
    );
    assert_eq!(
        events_of(&t.db, id(last)).await,
        vec![
            (1, "accepted".into(), false),
            (2, "terminal_failed".into(), false)
        ]
    );
    // the checkpoint, then the completion with its artifact
    assert_eq!(
        events_of(&t.db, id(arts)).await,
        vec![
            (1, "accepted".into(), false),
            (2, "progress".into(), true),
            (3, "running".into(), false),
            (4, "succeeded".into(), false)
        ]
    );
    let cp: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(id(arts))
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    assert_eq!(cp.as_deref(), Some(&b"cp-1"[..]));
    let st = t.status(arts.run_id).await;
    assert_eq!(st.state, "succeeded");
    assert_eq!(st.steps[0].output, Some(json!({"done": true})));
    assert_eq!(st.steps[0].artifacts.len(), 1);
    assert_eq!(st.steps[0].artifacts[0].id, ids[0]);
    assert_eq!(st.steps[0].artifacts[0].sha256, sha);
    // the runs follow their steps
    assert_eq!(t.status(retried.run_id).await.state, "running");
    assert_eq!(t.status(last.run_id).await.state, "failed");
    assert_eq!(t.status(cancelled.run_id).await.state, "cancelled");
}

/// In one batch: a failure and a checkpoint of a lease taken over by another
/// owner (a stale token), a failure the database refuses (a site trigger,
/// 22023) and, behind them, a release and a cancellation of other leases.
/// The stale ones are `LeaseLost` and the refused one its own permanent
/// error, each alone: the writes after them, and the batch's starts and
/// events, commit.
#[tokio::test]
async fn a_write_fenced_out_or_refused_fails_alone_and_the_batch_commits() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 4).await;
    let (stale, refused, released, cancelled) = (&s[0], &s[1], &s[2], &s[3]);
    steal(&t, stale).await;
    refuse_entering(
        &t,
        refused,
        "retryable_failed",
        "failures refused by a site rule",
    )
    .await;

    let batch = Batch {
        starts: [refused, released, cancelled]
            .into_iter()
            .map(start)
            .collect(),
        events: vec![EventsWrite {
            lease: refused.lease.clone(),
            events: vec![ev(2, "running")],
        }],
        completes: vec![],
    };
    let writes = vec![
        failure(stale, "FLAKY", true, Some(2)),
        checkpointed(stale, 2, b"stale"),
        failure(refused, "FLAKY", true, Some(3)),
        LedgerWrite::Release(ReleaseWrite {
            lease: released.lease.clone(),
            message: "draining".into(),
        }),
        LedgerWrite::Cancel(CancelWrite {
            lease: cancelled.lease.clone(),
            message: "cancelled".into(),
        }),
    ];
    let out =
        t.db.write_ledger("w", &batch, &writes)
            .await
            .expect("batch");
    assert_eq!(out.batch.starts, vec![RowOutcome::Ok; 3]);
    assert_eq!(out.batch.events, vec![RowOutcome::Ok]);
    let mut w = out.writes.into_iter();
    for what in ["the stale failure", "the stale checkpoint"] {
        match w.next() {
            Some(Err(DbError::LeaseLost { step_run_id })) => {
                assert_eq!(step_run_id, stale.lease.step_run_id(), "{what}")
            }
            other => panic!("{what} is LeaseLost, got {other:?}"),
        }
    }
    match w.next() {
        Some(Err(e)) => {
            assert_eq!(e.sqlstate().as_deref(), Some("22023"), "{e}");
            assert!(!e.is_transient(), "a site rule's refusal is permanent: {e}");
            assert!(
                e.to_string().contains("failures refused by a site rule"),
                "{e}"
            );
        }
        other => panic!("the refused failure fails alone, got {other:?}"),
    }
    assert_eq!(
        w.next().map(|r| r.expect("release")),
        Some(Written::Release)
    );
    assert_eq!(w.next().map(|r| r.expect("cancel")), Some(Written::Cancel));
    assert!(w.next().is_none());

    // the stale lease: nothing of its writes; its new owner's row untouched
    assert_eq!(state_of(&t.db, stale.lease.step_run_id()).await, "leased");
    assert_eq!(
        tests::event_count(&t.db, stale.lease.step_run_id()).await,
        0
    );
    let cp: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(stale.lease.step_run_id())
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    assert_eq!(cp, None);
    // the refused failure undid only itself: its start and events stay, its
    // terminal event is gone with it
    assert_eq!(
        state_of(&t.db, refused.lease.step_run_id()).await,
        "running"
    );
    assert_eq!(
        events_of(&t.db, refused.lease.step_run_id()).await,
        vec![(1, "accepted".into(), false), (2, "running".into(), false)]
    );
    assert_eq!(
        state_of(&t.db, released.lease.step_run_id()).await,
        "retryable_failed"
    );
    assert_eq!(
        state_of(&t.db, cancelled.lease.step_run_id()).await,
        "cancelled"
    );
    assert_eq!(t.status(cancelled.run_id).await.state, "cancelled");
}

/// One lease's writes in the order handed: its start, its plain events, a
/// checkpoint, then its failure. The checkpoint's events land before the
/// failure's terminal event (sequence and insertion order) and before its
/// transition; handed the other way round, the checkpoint comes after the
/// failure and is fenced out alone.
#[tokio::test]
async fn a_leases_checkpoint_lands_before_its_failure() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 2).await;
    let (a, b) = (&s[0], &s[1]);
    let batch = Batch {
        starts: vec![start(a), start(b)],
        events: vec![EventsWrite {
            lease: a.lease.clone(),
            events: vec![ev(2, "running")],
        }],
        completes: vec![],
    };
    let writes = vec![
        checkpointed(a, 3, b"cp-a"),
        failure(a, "BOOM", false, Some(5)),
        // b: the same two, the other way round
        failure(b, "BOOM", false, Some(2)),
        checkpointed(b, 3, b"cp-b"),
    ];
    let out =
        t.db.write_ledger("w", &batch, &writes)
            .await
            .expect("batch");
    let mut w = out.writes.into_iter();
    assert_eq!(
        w.next().map(|r| r.expect("checkpoint")),
        Some(Written::Checkpoint)
    );
    match w.next() {
        Some(Ok(Written::Fail(d))) => assert_eq!(d.to.as_str(), "terminal_failed"),
        other => panic!("a's failure commits, got {other:?}"),
    }
    match w.next() {
        Some(Ok(Written::Fail(d))) => assert_eq!(d.to.as_str(), "terminal_failed"),
        other => panic!("b's failure commits, got {other:?}"),
    }
    assert!(
        matches!(w.next(), Some(Err(DbError::LeaseLost { .. }))),
        "b's checkpoint came after its failure: fenced out"
    );

    let ida = a.lease.step_run_id();
    // insertion order (id) is sequence order, the failure's terminal event last
    assert_eq!(
        events_of(&t.db, ida).await,
        vec![
            (1, "accepted".into(), false),
            (2, "running".into(), false),
            (3, "progress".into(), true),
            (4, "running".into(), false),
            (5, "terminal_failed".into(), false)
        ]
    );
    // the checkpoint's events are older than the failure's transition
    let before: bool = sqlx::query_scalar(
        "SELECT max(e.at) FILTER (WHERE e.sequence IN (3, 4))
                < (SELECT t.at FROM durable.transitions t
                    WHERE t.step_run_id = $1 AND t.to_state = 'terminal_failed')
           FROM durable.step_events e WHERE e.step_run_id = $1",
    )
    .bind(ida)
    .fetch_one(t.db.pool())
    .await
    .expect("order");
    assert!(before, "the checkpoint landed before the failure");
    assert_eq!(
        changes(&history(&t.db, ida).await),
        vec![
            (None, "pending"),
            (Some("pending"), "leased"),
            (Some("leased"), "running"),
            (Some("running"), "terminal_failed")
        ]
    );
    let cp: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(ida)
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    assert_eq!(cp.as_deref(), Some(&b"cp-a"[..]));
    // b: no checkpoint, no event of it
    let idb = b.lease.step_run_id();
    assert_eq!(
        events_of(&t.db, idb).await,
        vec![
            (1, "accepted".into(), false),
            (2, "terminal_failed".into(), false)
        ]
    );
}

/// An error of the whole batch (its connection terminated in the middle of
/// it) is the batch's answer: transient, and nothing of the batch committed
/// — not its starts, nor the writes before the one that broke it. Sent
/// again, the same batch commits whole.
#[tokio::test]
async fn a_batch_error_is_every_writes_and_nothing_commits() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 3).await;
    let (a, b, c) = (&s[0], &s[1], &s[2]);
    // c's release ends the batch's own connection, once
    sqlx::raw_sql(&format!(
        "CREATE TABLE public.cut_once (done boolean);
         CREATE FUNCTION public.cut_connection() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.id = '{}' AND NEW.state = 'retryable_failed'
                AND NOT EXISTS (SELECT 1 FROM public.cut_once) THEN
                 PERFORM pg_terminate_backend(pg_backend_pid());
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER cut_connection BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.cut_connection();",
        c.lease.step_run_id()
    ))
    .execute(t.db.pool())
    .await
    .expect("trigger");
    let batch = Batch {
        starts: vec![start(a), start(b), start(c)],
        ..Batch::default()
    };
    let writes = vec![
        failure(a, "FLAKY", true, Some(2)),
        LedgerWrite::Cancel(CancelWrite {
            lease: b.lease.clone(),
            message: "cancelled".into(),
        }),
        LedgerWrite::Release(ReleaseWrite {
            lease: c.lease.clone(),
            message: "draining".into(),
        }),
    ];
    let err =
        t.db.write_ledger("w", &batch, &writes)
            .await
            .expect_err("the batch's connection was terminated");
    assert!(err.is_transient(), "a lost connection is retried: {err}");
    for x in &s {
        assert_eq!(state_of(&t.db, x.lease.step_run_id()).await, "leased");
        assert_eq!(tests::event_count(&t.db, x.lease.step_run_id()).await, 0);
    }
    sqlx::query("INSERT INTO public.cut_once VALUES (true)")
        .execute(t.db.pool())
        .await
        .expect("once");
    let out =
        t.db.write_ledger("w", &batch, &writes)
            .await
            .expect("again");
    assert_eq!(out.batch.starts, vec![RowOutcome::Ok; 3]);
    let answers: Vec<Written> = out
        .writes
        .into_iter()
        .map(|r| r.expect("commits"))
        .collect();
    assert!(matches!(answers[0], Written::Fail(_)));
    assert_eq!(answers[1..], [Written::Cancel, Written::Release]);
    assert_eq!(
        state_of(&t.db, a.lease.step_run_id()).await,
        "retryable_failed"
    );
    assert_eq!(state_of(&t.db, b.lease.step_run_id()).await, "cancelled");
    assert_eq!(
        state_of(&t.db, c.lease.step_run_id()).await,
        "retryable_failed"
    );
}

/// Through a running worker: an attempt's failure goes to the ledger; the
/// first time it is written, the ledger's connection is terminated in the
/// middle of it (a site trigger). The failure's answer is that transient
/// error, the attempt's commit writes it again, and it commits once: one
/// `running → retryable_failed`, then the second attempt succeeds.
#[tokio::test]
async fn a_failure_whose_batch_lost_its_connection_is_written_again_once() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    cut_connection_once(
        &t,
        "OLD.state = 'running' AND NEW.state = 'retryable_failed'",
        0.0,
    )
    .await;
    let w = tests::RunningWorker::start(
        t.connect(5).await,
        tests::fast_config(vec![tests::demo("go", "go", &[], None)]),
    )
    .await;
    let run = t
        .submit(json!({"name": "cut", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.fail",
            "input": {"fail_attempts": 1},
            "retry": {"max_attempts": 3, "initial_interval_ms": 50, "backoff_coefficient": 1.0, "max_interval_ms": 50}}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    assert_eq!(st.steps[0].attempt, 2);
    assert_eq!(st.steps[0].output, Some(json!({"attempt": 2})));
    // the failure was written twice (cut, then committed)
    assert_eq!(
        t.scalar_i64("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.cut_seq")
            .await,
        2
    );
    let h = history(&t.db, st.steps[0].step_run_id).await;
    let failed: Vec<_> = h
        .iter()
        .filter(|(f, to, _)| f.as_deref() == Some("running") && to == "retryable_failed")
        .collect();
    assert_eq!(failed.len(), 1, "the failure committed once: {h:?}");
}

/// Counts the statements sqlx sends (its `sqlx::query` log events, one per
/// statement executed; its own BEGIN and COMMIT are not among them) while it
/// is the thread's subscriber.
#[derive(Clone, Default)]
struct Statements(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if e.metadata().target() == "sqlx::query" {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl Statements {
    fn take(&self) -> usize {
        self.0.swap(0, std::sync::atomic::Ordering::SeqCst)
    }
}

/// A flush of the ledger's set forms is one statement: starts, their
/// progress events and other leases' completions, with the up-front run
/// lock, in one call (`durable.write_sets`), in autocommit on a bare
/// connection. It was BEGIN, the run lock, one statement per part and
/// COMMIT: six round trips, each a full protocol cycle on both sides, for
/// one transaction (four of them statements this test counts). Inside a
/// caller's transaction it is a savepoint around that one call, and the
/// caller's transaction goes on. What it writes is what the parts wrote.
#[tokio::test(flavor = "current_thread")]
async fn a_flush_of_set_writes_is_one_statement() {
    use tracing_subscriber::layer::SubscriberExt;
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 4).await;
    let db = t.connect(1).await;
    // both halves of the batch in flight: s[0], s[1] starting, s[2], s[3]
    // already running and finishing
    let warm = Batch {
        starts: vec![start(&s[2]), start(&s[3])],
        ..Batch::default()
    };
    db.write_batch("w", &warm)
        .await
        .expect("the earlier starts");

    let count = Statements::default();
    let _scope =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(count.clone()));
    let running = |seq: u64| EventsWrite {
        lease: s[0].lease.clone(),
        events: vec![ev(seq, "running")],
    };
    let batch = Batch {
        starts: vec![start(&s[0]), start(&s[1])],
        events: vec![running(2)],
        completes: vec![complete(&s[2], 2), complete(&s[3], 2)],
    };
    count.take();
    let out = db.write_batch("w", &batch).await.expect("the batch");
    assert_eq!(count.take(), 1, "one statement for the whole batch");
    assert_eq!(out.starts, vec![RowOutcome::Ok, RowOutcome::Ok]);
    assert_eq!(out.events, vec![RowOutcome::Ok]);
    assert_eq!(out.completes, vec![RowOutcome::Ok, RowOutcome::Ok]);
    for (x, want) in [
        (0, "running"),
        (1, "running"),
        (2, "succeeded"),
        (3, "succeeded"),
    ] {
        assert_eq!(
            state_of(&db, s[x].lease.step_run_id()).await,
            want,
            "step {x}"
        );
    }
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
    )
    .bind(s[0].lease.step_run_id())
    .fetch_all(db.pool())
    .await
    .expect("events");
    assert_eq!(kinds, ["accepted", "running"]);
    count.take();

    // inside a caller's transaction: a savepoint around the one call
    let mut tx = db.pool().begin().await.expect("begin");
    let more = Batch {
        events: vec![running(3)],
        ..Batch::default()
    };
    let out = supervisor::db::DbConn::new(&mut tx)
        .write_batch("w", &more)
        .await
        .expect("in a transaction");
    assert_eq!(out.events, vec![RowOutcome::Ok]);
    let mine: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durable.step_events WHERE step_run_id = $1")
            .bind(s[0].lease.step_run_id())
            .fetch_one(&mut *tx)
            .await
            .expect("the caller's transaction goes on");
    assert_eq!(mine, 3);
    tx.commit().await.expect("commit");
    assert_eq!(tests::event_count(&db, s[0].lease.step_run_id()).await, 3);
}

/// A transaction that counts its calls of PL/pgSQL functions
/// ([`function_calls`]).
async fn tracked_transaction(db: &Db) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = db.pool().begin().await.expect("begin");
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(&mut *tx)
        .await
        .expect("track functions");
    tx
}

/// Calls of `durable.<name>` so far in the transaction of `tx` (with
/// `track_functions` on for it).
async fn function_calls(tx: &mut sqlx::PgConnection, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions
          WHERE schemaname = 'durable' AND funcname = $1",
    )
    .bind(name)
    .fetch_one(tx)
    .await
    .expect("function calls")
}

/// A start's plain events in the same batch are written by the start: one
/// INSERT under its fence, answered as the start is, no call of their own;
/// the events of a lease whose start is elsewhere are written as before. A
/// lost start writes none of its events. (Before, every events write was a
/// `record_plain_events` call of its own, after the start had fenced the
/// same row.)
#[tokio::test]
async fn a_starts_events_in_the_same_batch_go_with_the_start() {
    use supervisor::db::DbConn;
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 4).await;
    // s[3] is already running: its events have no start in the batch
    t.db.write_batch(
        "w",
        &Batch {
            starts: vec![start(&s[3])],
            ..Batch::default()
        },
    )
    .await
    .expect("s[3] starts");
    // s[2]'s lease was taken over: its start and events are lost
    sqlx::query("UPDATE durable.step_runs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(s[2].lease.step_run_id())
        .execute(t.db.pool())
        .await
        .expect("take over s[2]");
    let events = |x: usize, seqs: &[u64]| EventsWrite {
        lease: s[x].lease.clone(),
        events: seqs.iter().map(|&q| ev(q, "progress")).collect(),
    };
    let batch = Batch {
        starts: vec![start(&s[0]), start(&s[1]), start(&s[2])],
        events: vec![
            events(0, &[2, 3]),
            events(3, &[2]),
            events(2, &[2]),
            events(1, &[2]),
        ],
        completes: vec![],
    };
    for (one, b) in [
        (
            true,
            Batch {
                starts: vec![start(&s[0])],
                events: vec![events(0, &[2, 3])],
                completes: vec![],
            },
        ),
        (false, batch),
    ] {
        let mut tx = tracked_transaction(&t.db).await;
        let out = DbConn::new(&mut tx)
            .write_batch("w", &b)
            .await
            .expect("the batch");
        let plain_calls = function_calls(&mut tx, "record_plain_events").await;
        tx.rollback().await.expect("rollback");
        if one {
            // one start (the intent-by-intent form) with its events
            assert_eq!(out.starts, vec![RowOutcome::Ok]);
            assert_eq!(out.events, vec![RowOutcome::Ok]);
            assert_eq!(plain_calls, 0, "the start wrote its events");
            continue;
        }
        assert_eq!(
            out.starts,
            vec![RowOutcome::Ok, RowOutcome::Ok, RowOutcome::Lost]
        );
        assert_eq!(
            out.events,
            vec![
                RowOutcome::Ok,
                RowOutcome::Ok,
                RowOutcome::Lost,
                RowOutcome::Ok
            ],
            "each events write answered as its start, or on its own"
        );
        assert_eq!(
            plain_calls, 1,
            "only s[3]'s events have a call of their own"
        );
    }
    // the batch again, committed: the rows it wrote
    let batch = Batch {
        starts: vec![start(&s[0]), start(&s[1]), start(&s[2])],
        events: vec![
            events(0, &[2, 3]),
            events(3, &[2]),
            events(2, &[2]),
            events(1, &[2]),
        ],
        completes: vec![],
    };
    t.db.write_batch("w", &batch).await.expect("the batch");
    for (x, want) in [
        (0, vec!["accepted", "progress", "progress"]),
        (1, vec!["accepted", "progress"]),
        (2, vec![]),
        (3, vec!["accepted", "progress"]),
    ] {
        let rows: Vec<(i64, String)> = sqlx::query_as(
            "SELECT sequence, kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY id",
        )
        .bind(s[x].lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("events");
        let kinds: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
        assert_eq!(kinds, want, "step {x}");
        let seqs: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let mut sorted = seqs.clone();
        sorted.sort_unstable();
        assert_eq!(seqs, sorted, "step {x}: inserted in sequence order");
    }
    assert_eq!(state_of(&t.db, s[0].lease.step_run_id()).await, "running");
    assert_eq!(state_of(&t.db, s[2].lease.step_run_id()).await, "leased");
}

/// Through a running worker: a no-op job's start is written in a batch of
/// its own, and that batch loses its connection half a second in (a site
/// trigger sleeps, then ends its own backend), while the job's success,
/// handed right behind the start, waits in the ledger's queue. The start's
/// batch fails as a whole; the success must not commit ahead of the start's
/// retry: it would write the start with it (leased → running → succeeded)
/// and the retry would find the step finished, dropping the start's events.
/// The step's history and events are whole: accepted, then succeeded.
#[tokio::test]
async fn a_success_handed_behind_a_start_whose_batch_failed_waits_for_its_retry() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    cut_connection_once(&t, "OLD.state = 'leased' AND NEW.state = 'running'", 0.5).await;
    let w = tests::RunningWorker::start(
        t.connect(5).await,
        tests::fast_config(vec![tests::demo("go", "go", &[], None)]),
    )
    .await;
    let run = t
        .submit(tests::one_step(
            "behind",
            "go",
            "demo.echo",
            json!({"x": 1}),
        ))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    let id = st.steps[0].step_run_id;
    assert_eq!(
        t.scalar_i64("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.cut_seq")
            .await,
        2,
        "the start was written on its own twice: its batch cut, then its retry"
    );
    let h = history(&t.db, id).await;
    assert_eq!(
        changes(&h),
        [
            (None, "pending"),
            (Some("pending"), "leased"),
            (Some("leased"), "running"),
            (Some("running"), "succeeded"),
        ],
        "{h:?}"
    );
    // in the order a reader sees them (`supervisor events`: by sequence);
    // the SDK's running event, written in a batch of its own, may be
    // inserted before the start's retry
    let mut evs = events_of(&t.db, id).await;
    evs.sort_by_key(|(seq, _, _)| *seq);
    let kinds: Vec<String> = evs.into_iter().map(|(_, k, _)| k).collect();
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("accepted"),
        "the start's event survived its batch's failure: {kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("succeeded"),
        "{kinds:?}"
    );
}

/// The ledger keeps its pool connection while it writes (the pool would
/// check each one given back with a round trip), but never the pool's last
/// free one: the lease of the next step would wait for it. Here the worker's
/// pool has two connections and the test holds one (as an artifact transfer
/// would), so the ledger, the lease and the reclaim share the other; a chain
/// runs, and right after it ends that connection is free (the ledger keeps
/// one otherwise for 1 s after its last write, and each lease of the chain
/// waits for that).
#[tokio::test]
async fn the_ledger_never_keeps_the_pools_last_free_connection() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::demo("go", "go", &[], None)]);
    cfg.executors[0].concurrency = 1;
    let db = t.connect(2).await;
    let w = tests::RunningWorker::start(db.clone(), cfg).await;
    let held = db.pool().acquire().await.expect("a connection of the pool");
    let run = t
        .submit(json!({"name": "tight", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"n": 1}},
            {"name": "b", "executor_kind": "go", "kind": "demo.echo", "input": {"n": 2}, "depends_on": ["a"]},
            {"name": "c", "executor_kind": "go", "kind": "demo.echo", "input": {"n": 3}, "depends_on": ["b"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(30)).await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    let until = std::time::Instant::now() + Duration::from_millis(600);
    let mut spare = false;
    while !spare && std::time::Instant::now() < until {
        spare = db.has_spare_connection();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (size, idle) = (db.pool().size(), db.pool().num_idle());
    drop(held);
    w.shutdown().await;
    assert!(
        spare,
        "no connection of the pool's {size} was free after the run ({idle} idle)"
    );
}

/// With a lock wait, a batch that meets a run row another transaction holds
/// gives up at its first statement, before anything of it is written, even
/// when it holds one intent alone (a lone failure, or starts of several runs
/// of which one is held); `held_steps` then names the held step and its run,
/// and only it. Without one it waited the connection's lock timeout.
#[tokio::test]
async fn a_batch_with_a_lock_wait_gives_up_on_a_held_run_and_names_it() {
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 3).await;
    let (a, b, c) = (&s[0], &s[1], &s[2]);
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM durable.workflow_runs WHERE id = $1 FOR NO KEY UPDATE")
        .bind(b.run_id)
        .execute(&mut *holder)
        .await
        .expect("hold b's run");

    let wait = Some(Duration::from_millis(100));
    let starts = Batch {
        starts: vec![start(a), start(b), start(c)],
        ..Batch::default()
    };
    let err =
        t.db.write_ledger_within("w", &starts, &[], wait)
            .await
            .expect_err("b's run is held");
    assert_eq!(err.sqlstate().as_deref(), Some("55P03"), "{err}");
    let lone = [LedgerWrite::Release(ReleaseWrite {
        lease: b.lease.clone(),
        message: "shutdown".into(),
    })];
    let err =
        t.db.write_ledger_within("w", &Batch::default(), &lone, wait)
            .await
            .expect_err("b's run is held");
    assert_eq!(err.sqlstate().as_deref(), Some("55P03"), "{err}");
    for x in [a, b, c] {
        assert_eq!(
            state_of(&t.db, x.lease.step_run_id()).await,
            "leased",
            "nothing of a batch that gave up is written"
        );
    }

    let held =
        t.db.held_steps(
            &[
                a.lease.step_run_id(),
                b.lease.step_run_id(),
                c.lease.step_run_id(),
            ],
            Duration::from_millis(250),
        )
        .await
        .expect("held steps");
    assert_eq!(held, vec![(b.lease.step_run_id(), b.run_id)]);

    // the others alone go through at once; b's once its row is free
    let others = Batch {
        starts: vec![start(a), start(c)],
        ..Batch::default()
    };
    let out =
        t.db.write_ledger_within("w", &others, &[], wait)
            .await
            .expect("a and c");
    assert_eq!(out.batch.starts, vec![RowOutcome::Ok, RowOutcome::Ok]);
    holder.rollback().await.expect("let go");
    assert!(t
        .db
        .held_steps(&[b.lease.step_run_id()], Duration::from_millis(250))
        .await
        .expect("held steps")
        .is_empty());
    let out =
        t.db.write_ledger_within("w", &Batch::default(), &lone, wait)
            .await
            .expect("b");
    assert!(
        matches!(out.writes[..], [Ok(Written::Release)]),
        "{:?}",
        out.writes
    );
    assert_eq!(
        state_of(&t.db, b.lease.step_run_id()).await,
        "retryable_failed"
    );
}

/// A run's first terminal failure asks its live siblings to cancel, and
/// says so on `durable_cancel` at once, as `cancel` does: their workers
/// stop them now, not at their next heartbeat (up to heartbeat_interval_ms
/// later, measured 9.8 s with a 10 s heartbeat).
#[tokio::test]
async fn a_failing_run_notifies_the_workers_of_its_live_steps() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "r", "steps": [
            {"name": "f", "executor_kind": "go", "kind": "k", "input": {}, "retry": {"max_attempts": 1}},
            {"name": "sib", "executor_kind": "go", "kind": "k", "input": {}}]}))
        .await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 2, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 2);
    let f = leased.iter().find(|s| s.name == "f").expect("f");
    let mut listener = sqlx::postgres::PgListener::connect(&t.url)
        .await
        .expect("listen");
    listener.listen("durable_cancel").await.expect("listen");

    let out =
        t.db.write_ledger("w", &Batch::default(), &[failure(f, "BOOM", false, None)])
            .await
            .expect("fail f");
    assert!(matches!(out.writes[..], [Ok(_)]), "{:?}", out.writes);
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a durable_cancel notification")
        .expect("recv");
    assert_eq!(n.payload(), run.to_string());
    let sib = leased.iter().find(|s| s.name == "sib").expect("sib");
    let requested: bool =
        sqlx::query_scalar("SELECT cancel_requested FROM durable.step_runs WHERE id = $1")
            .bind(sib.lease.step_run_id())
            .fetch_one(t.db.pool())
            .await
            .expect("sib");
    assert!(requested);
}

/// A start whose completion is in the same batch has its state change
/// deferred to that completion (leased → running → succeeded as one row
/// version): the starts' UPDATE runs only for the starts that are not
/// deferred. It ran over no row at all for a batch of fused starts alone,
/// and its statement trigger with it, once per batch — nearly every batch
/// since a start waits for its completion (`START_LINGER`). The history is
/// whole either way.
#[tokio::test]
async fn a_batch_of_fused_starts_runs_no_update_of_its_own() {
    use supervisor::db::DbConn;
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 4).await;
    // (the batch, the step transition trigger's calls it makes)
    let cases = [
        // every start fused: only the completions' UPDATE
        (
            Batch {
                starts: vec![start(&s[0]), start(&s[1])],
                events: vec![],
                completes: vec![complete(&s[0], 2), complete(&s[1], 2)],
            },
            1,
        ),
        // s[2]'s start alone is not deferred: both UPDATEs
        (
            Batch {
                starts: vec![start(&s[2]), start(&s[3])],
                events: vec![],
                completes: vec![complete(&s[3], 2)],
            },
            2,
        ),
    ];
    for (b, triggers) in cases {
        let mut tx = tracked_transaction(&t.db).await;
        let out = DbConn::new(&mut tx)
            .write_batch("w", &b)
            .await
            .expect("the batch");
        assert!(out.starts.iter().all(|o| *o == RowOutcome::Ok), "{out:?}");
        assert!(
            out.completes.iter().all(|o| *o == RowOutcome::Ok),
            "{out:?}"
        );
        assert_eq!(
            function_calls(&mut tx, "on_step_transition").await,
            triggers,
            "{} starts, {} completions",
            b.starts.len(),
            b.completes.len()
        );
        tx.commit().await.expect("commit");
    }
    let hops = |to: &[&str]| -> Vec<String> { to.iter().map(|x| x.to_string()).collect() };
    for (x, want) in [
        (0, hops(&["pending", "leased", "running", "succeeded"])),
        (1, hops(&["pending", "leased", "running", "succeeded"])),
        (2, hops(&["pending", "leased", "running"])),
        (3, hops(&["pending", "leased", "running", "succeeded"])),
    ] {
        let h = history(&t.db, s[x].lease.step_run_id()).await;
        let states: Vec<String> = h.iter().map(|(_, to, _)| to.clone()).collect();
        assert_eq!(states, want, "step {x}: {h:?}");
        assert_eq!(
            h.iter()
                .find(|(_, to, _)| to == "running")
                .map(|r| r.2.as_deref()),
            Some(Some("ACCEPTED")),
            "step {x}: the start's reason"
        );
    }
}

/// A batch whose every start is fused with its completion is written in one
/// pass (`complete_fused_set`: one fence, one INSERT of the starts', the
/// queued and the completions' events, one UPDATE), not a pass of starts
/// (`start_steps`) and one of completions (`complete_steps`) fencing the same
/// rows twice. A start is answered as its completion's fence is: a lease
/// taken over is lost for both. Each step's events stay in sequence order,
/// also by id. A pass that fails (a completion refused by a site rule) is
/// rolled back and the batch written in two passes as before: the refusal
/// is its completion's alone and its start is written on its own.
#[tokio::test]
async fn a_batch_whose_every_start_is_fused_is_written_in_one_pass() {
    use supervisor::db::DbConn;
    let t = TestDb::new().await;
    let s = lease_one_each(&t, 6).await;
    // s[2]'s lease is another owner's now
    steal(&t, &s[2]).await;
    // s[5]'s success is refused by the database
    refuse_entering(&t, &s[5], "succeeded", "refused by a site rule").await;
    let queued = EventsWrite {
        lease: s[0].lease.clone(),
        events: vec![ev(2, "running"), ev(3, "progress")],
    };
    let one_pass = Batch {
        starts: vec![start(&s[0]), start(&s[1]), start(&s[2])],
        events: vec![queued],
        completes: vec![complete(&s[0], 4), complete(&s[1], 2), complete(&s[2], 2)],
    };
    let refused = Batch {
        starts: vec![start(&s[3]), start(&s[4]), start(&s[5])],
        events: vec![],
        completes: vec![complete(&s[3], 2), complete(&s[4], 2), complete(&s[5], 2)],
    };
    // (the batch, whether its one pass held, the answers of its starts and completions)
    let cases = [
        (
            one_pass,
            true,
            [RowOutcome::Ok, RowOutcome::Ok, RowOutcome::Lost],
        ),
        (
            refused,
            false,
            [RowOutcome::Ok, RowOutcome::Ok, RowOutcome::Ok],
        ),
    ];
    for (b, held, starts) in cases {
        let mut tx = tracked_transaction(&t.db).await;
        let out = DbConn::new(&mut tx)
            .write_batch("w", &b)
            .await
            .expect("the batch");
        assert_eq!(out.starts, starts, "{out:?}");
        assert_eq!(
            out.events.iter().filter(|o| **o != RowOutcome::Ok).count(),
            0
        );
        // the one pass held: no other pass, one fence. (A pass that failed
        // is not counted: PostgreSQL counts a function's call when it
        // returns; the batch then took both passes.)
        let (fused, passes) = if held { (1, 0) } else { (0, 1) };
        assert_eq!(function_calls(&mut tx, "complete_fused_set").await, fused);
        assert_eq!(function_calls(&mut tx, "start_steps").await, passes);
        assert_eq!(function_calls(&mut tx, "complete_steps").await, passes);
        if held {
            assert_eq!(function_calls(&mut tx, "lock_batch").await, 1);
        }
        if held {
            assert_eq!(out.completes, starts, "{out:?}");
        } else {
            assert_eq!(out.completes[..2], [RowOutcome::Ok, RowOutcome::Ok]);
            assert!(
                matches!(&out.completes[2], RowOutcome::Refused { sqlstate, .. } if sqlstate == "22023"),
                "{out:?}"
            );
        }
        tx.commit().await.expect("commit");
    }
    for (x, want) in [
        (0, "succeeded"),
        (1, "succeeded"),
        (2, "leased"),
        (3, "succeeded"),
        (4, "succeeded"),
        (5, "running"),
    ] {
        assert_eq!(
            state_of(&t.db, s[x].lease.step_run_id()).await,
            want,
            "step {x}"
        );
    }
    // every hop recorded, the start's reason first
    for x in [0, 1, 3, 4] {
        let h = history(&t.db, s[x].lease.step_run_id()).await;
        let states: Vec<&str> = h.iter().map(|(_, to, _)| to.as_str()).collect();
        assert_eq!(
            states,
            ["pending", "leased", "running", "succeeded"],
            "step {x}"
        );
        assert_eq!(h[2].2.as_deref(), Some("ACCEPTED"), "step {x}: {h:?}");
    }
    // a step's events in sequence order by id too; nothing for the lost lease
    let events: Vec<(i64, String)> = sqlx::query_as(
        "SELECT sequence, kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(s[0].lease.step_run_id())
    .fetch_all(t.db.pool())
    .await
    .expect("events");
    let events: Vec<(i64, &str)> = events.iter().map(|(n, k)| (*n, k.as_str())).collect();
    assert_eq!(
        events,
        [
            (1, "accepted"),
            (2, "running"),
            (3, "progress"),
            (4, "succeeded")
        ]
    );
    assert_eq!(tests::event_count(&t.db, s[2].lease.step_run_id()).await, 0);
    // the refused completion's start is written, its completion event is not
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(s[5].lease.step_run_id())
    .fetch_all(t.db.pool())
    .await
    .expect("events");
    assert_eq!(kinds, ["accepted"]);
}
