//! Retention (issue 8, item 9): finished runs older than the configured age
//! are removed with everything they hold, in short batches; open and young
//! runs and shared artifact bytes still referenced are kept; the tables stay
//! bounded under churn; a worker does it on its own; `supervisor gc` does it
//! on demand.

use std::time::{Duration, Instant};

use serde_json::json;
use sha2::Digest;
use supervisor::db::{
    Batch, CompleteWrite, Db, LeasedStep, NewArtifact, OwnedEvent, RetentionOptions, StartWrite,
    RETENTION_TABLES,
};
use tests::TestDb;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn worker(db: &Db) -> Uuid {
    let id = Uuid::new_v4();
    db.register_worker(id, "w", "test", &json!([]))
        .await
        .expect("register");
    id
}

async fn lease(db: &Db, wid: Uuid, n: u32) -> Vec<LeasedStep> {
    db.lease(wid, "w", &tests::route_go_k(), n, Duration::from_secs(30))
        .await
        .expect("lease")
}

/// An artifact of a result and its bytes (stored as a blob before the commit,
/// as the worker's artifact store does).
struct Art {
    meta: NewArtifact,
    content: Vec<u8>,
}

fn artifact(name: &str, content: &[u8], derived_from: Vec<Uuid>) -> Art {
    Art {
        meta: NewArtifact {
            name: name.into(),
            sha256: hex(&sha2::Sha256::digest(content)),
            size: content.len() as i64,
            media_type: "application/octet-stream".into(),
            derived_from,
        },
        content: content.to_vec(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `s` to success with `artifacts`; returns the artifact ids.
async fn succeed(db: &Db, s: &LeasedStep, artifacts: &[Art]) -> Vec<Uuid> {
    db.mark_running(&s.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");
    for a in artifacts {
        db.record_inline_blob(&a.meta.sha256, &a.content)
            .await
            .expect("blob");
    }
    let metas: Vec<NewArtifact> = artifacts.iter().map(|a| a.meta.clone()).collect();
    db.complete(&s.lease, "w", &json!({"ok": true}), &metas, Some(2))
        .await
        .expect("complete")
}

fn options(older_than: Duration) -> RetentionOptions {
    RetentionOptions {
        older_than,
        batch_runs: 100,
        batch_steps: 1000,
        vacuum: true,
    }
}

async fn count(db: &Db, sql: &str, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .bind(ids)
        .fetch_one(db.pool())
        .await
        .expect(sql)
}

/// Every row a run has, table by table.
async fn rows_of_run(
    db: &Db,
    run: Uuid,
    steps: &[Uuid],
    artifacts: &[Uuid],
) -> Vec<(&'static str, i64)> {
    let r = [run];
    vec![
        ("workflow_runs", count(db, "SELECT count(*) FROM durable.workflow_runs WHERE id = ANY($1)", &r).await),
        ("step_defs", count(db, "SELECT count(*) FROM durable.step_defs WHERE run_id = ANY($1)", &r).await),
        ("step_dependents", count(db, "SELECT count(*) FROM durable.step_dependents WHERE run_id = ANY($1)", &r).await),
        ("step_runs", count(db, "SELECT count(*) FROM durable.step_runs WHERE run_id = ANY($1)", &r).await),
        ("transitions", count(db, "SELECT count(*) FROM durable.transitions WHERE run_id = ANY($1)", &r).await),
        ("step_events", count(db, "SELECT count(*) FROM durable.step_events WHERE step_run_id = ANY($1)", steps).await),
        ("artifacts", count(db, "SELECT count(*) FROM durable.artifacts WHERE id = ANY($1)", artifacts).await),
        ("artifact_lineage", count(db, "SELECT count(*) FROM durable.artifact_lineage WHERE artifact_id = ANY($1) OR derived_from_id = ANY($1)", artifacts).await),
    ]
}

async fn blob_exists(db: &Db, content: &[u8]) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM durable.artifact_blobs WHERE sha256 = $1)")
        .bind(hex(&sha2::Sha256::digest(content)))
        .fetch_one(db.pool())
        .await
        .expect("blob")
}

/// Old finished runs (one succeeded `a → b` with artifacts and lineage, one
/// failed, one cancelled) go with all their rows; a young finished run, an
/// open run, and the bytes the old run shared with the young one stay.
/// An upload of bytes an old run stored claims its blob and skips writing
/// them; a retention pass between that claim and the commit deleted the
/// blob with the old run, and the commit failed for good (COMMIT_REJECTED,
/// a succeeded step recorded terminal_failed: retention audit). A blob
/// claimed since its removed references committed stays, and the commit
/// that claimed it references it.
#[tokio::test]
async fn a_blob_claimed_by_an_upload_in_flight_outlives_the_old_runs_removal() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let bytes = b"the daily report, the same as a week ago";
    let old = t.submit(tests::one_step("old", "go", "k", json!({}))).await;
    let o = lease(db, wid, 10).await.remove(0);
    succeed(db, &o, &[artifact("report", bytes, vec![])]).await;
    assert_eq!(t.status(old).await.state, "succeeded");
    let other = t
        .submit(tests::one_step("other", "go", "k", json!({})))
        .await;
    let n = lease(db, wid, 10).await.remove(0);
    db.mark_running(&n.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // the new attempt's upload finds the bytes stored and claims them
    let a = artifact("report", bytes, vec![]);
    assert!(
        db.claim_blob(&a.meta.sha256)
            .await
            .expect("claim")
            .is_some(),
        "the old run's blob is there to claim"
    );
    let preview = db
        .retention_preview(Duration::from_secs(1))
        .await
        .expect("preview");
    let report = db
        .retention_pass(&options(Duration::from_secs(1)), &CancellationToken::new())
        .await
        .expect("pass");
    assert_eq!((report.runs, report.artifacts), (1, 1), "{report:?}");
    assert_eq!(report.blobs, 0, "the claimed blob stays: {report:?}");
    assert_eq!(preview.blobs, 0, "the preview agrees: {preview:?}");
    assert!(blob_exists(db, bytes).await);
    // and the claiming commit references it
    db.complete(
        &n.lease,
        "w",
        &json!({"ok": true}),
        std::slice::from_ref(&a.meta),
        Some(2),
    )
    .await
    .expect("the commit finds the bytes it claimed");
    assert_eq!(t.status(other).await.state, "succeeded");
}

/// An attempt pins the bytes it stores: an earlier upload still waiting
/// for its commit keeps them while a later run that claimed the same bytes
/// commits and is removed (faults audit: the claim's time alone kept only
/// the latest claimer's bytes, and the earlier attempt's success was
/// recorded COMMIT_REJECTED).
#[tokio::test]
async fn a_pinned_blob_outlives_the_removal_of_a_later_claimer() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let bytes = b"bytes two runs produce";
    let a = artifact("out", bytes, vec![]);
    let waiting = t
        .submit(tests::one_step("waiting", "go", "k", json!({})))
        .await;
    let w = lease(db, wid, 10).await.remove(0);
    db.mark_running(&w.lease, "w", 1, &tests::accepted_event())
        .await
        .expect("running");
    // its upload: pinned, then stored; its commit is held up (its run's row
    // in another session's hands, say)
    db.pin_blob(&a.meta.sha256, &w.lease).await.expect("pin");
    db.record_inline_blob(&a.meta.sha256, bytes)
        .await
        .expect("upload");
    // a later run claims the same bytes, commits, and is old enough to go
    let later = t
        .submit(tests::one_step("later", "go", "k", json!({})))
        .await;
    let l = lease(db, wid, 10).await.remove(0);
    succeed(db, &l, &[artifact("out", bytes, vec![])]).await;
    assert_eq!(t.status(later).await.state, "succeeded");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = db
        .retention_pass(&options(Duration::from_secs(1)), &CancellationToken::new())
        .await
        .expect("pass");
    assert_eq!((report.runs, report.artifacts), (1, 1), "{report:?}");
    assert_eq!(report.blobs, 0, "the pinned blob stays: {report:?}");
    assert!(blob_exists(db, bytes).await);
    db.complete(
        &w.lease,
        "w",
        &json!({"ok": true}),
        std::slice::from_ref(&a.meta),
        Some(2),
    )
    .await
    .expect("the waiting commit finds its bytes");
    assert_eq!(t.status(waiting).await.state, "succeeded");
}

#[tokio::test]
async fn gc_removes_exactly_the_old_finished_runs() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let (shared, own, derived) = (
        b"shared bytes".as_slice(),
        b"old run's own".as_slice(),
        b"derived".as_slice(),
    );

    // old, succeeded: a (shared + own) → b (derived from own)
    let old = t
        .submit(json!({"name": "old", "steps": [
        {"name": "a", "executor_kind": "go", "kind": "k"},
        {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await;
    let a = lease(db, wid, 10).await.remove(0);
    let a_arts = succeed(
        db,
        &a,
        &[
            artifact("shared", shared, vec![]),
            artifact("own", own, vec![]),
        ],
    )
    .await;
    let b = lease(db, wid, 10).await.remove(0);
    let b_arts = succeed(db, &b, &[artifact("derived", derived, vec![a_arts[1]])]).await;
    assert_eq!(t.status(old).await.state, "succeeded");
    let old_steps = vec![a.lease.step_run_id(), b.lease.step_run_id()];
    let old_arts: Vec<Uuid> = a_arts.iter().chain(&b_arts).copied().collect();
    assert_eq!(
        count(
            db,
            "SELECT count(*) FROM durable.artifact_lineage WHERE artifact_id = ANY($1)",
            &old_arts
        )
        .await,
        1
    );

    // old, failed
    let failed = t
        .submit(tests::one_step("failed", "go", "k", json!({})))
        .await;
    let f = lease(db, wid, 10).await.remove(0);
    db.fail(
        &f.lease,
        "w",
        &supervisor::db::FailureReport {
            failure: supervisor::state::Failure {
                code: "X".into(),
                retryable: false,
                next_retry_delay: None,
            },
            message: "x".into(),
            details: None,
            sequence: None,
        },
        0.5,
    )
    .await
    .expect("fail");
    assert_eq!(t.status(failed).await.state, "failed");
    // old, cancelled before it ran
    let cancelled = t
        .submit(tests::one_step("cancelled", "go", "k", json!({})))
        .await;
    db.cancel(cancelled, None).await.expect("cancel");
    assert_eq!(t.status(cancelled).await.state, "cancelled");
    // open, created long enough ago: never removed, whatever its age
    let open = t
        .submit(json!({"name": "open", "steps": [
        {"name": "x", "executor_kind": "go", "kind": "other"}]}))
        .await;

    tokio::time::sleep(Duration::from_millis(1500)).await;
    // young, succeeded, sharing the old run's bytes
    let young = t
        .submit(tests::one_step("young", "go", "k", json!({})))
        .await;
    let y = lease(db, wid, 10).await.remove(0);
    let y_arts = succeed(db, &y, &[artifact("shared", shared, vec![])]).await;
    let young_before = rows_of_run(db, young, &[y.lease.step_run_id()], &y_arts).await;

    let preview = db
        .retention_preview(Duration::from_secs(1))
        .await
        .expect("preview");
    assert_eq!(
        (
            preview.runs,
            preview.steps,
            preview.artifacts,
            preview.blobs
        ),
        (3, 4, 3, 2),
        "{preview:?}"
    );
    // the preview removed nothing
    assert_eq!(t.status(old).await.state, "succeeded");

    let report = db
        .retention_pass(&options(Duration::from_secs(1)), &CancellationToken::new())
        .await
        .expect("pass");
    // the pass removed what its preview said it would, artifacts included
    assert_eq!(
        (report.runs, report.steps, report.artifacts, report.blobs),
        (3, 4, 3, 2),
        "{report:?}"
    );
    assert!(report.vacuumed, "{report:?}");

    for (table, n) in rows_of_run(db, old, &old_steps, &old_arts).await {
        assert_eq!(n, 0, "the old run still has {n} rows in durable.{table}");
    }
    for run in [failed, cancelled] {
        for (table, n) in rows_of_run(db, run, &[], &[]).await {
            assert_eq!(n, 0, "run {run} still has {n} rows in durable.{table}");
        }
    }
    assert!(matches!(
        db.status(old).await,
        Err(supervisor::db::DbError::NotFound(_))
    ));
    // bytes only the old run referenced are gone; the shared ones stay
    assert!(!blob_exists(db, own).await && !blob_exists(db, derived).await);
    assert!(
        blob_exists(db, shared).await,
        "a blob the young run references was removed"
    );
    // the young and the open run are untouched, row for row
    assert_eq!(
        rows_of_run(db, young, &[y.lease.step_run_id()], &y_arts).await,
        young_before
    );
    assert_eq!(t.status(young).await.state, "succeeded");
    let st = t.status(open).await;
    assert_eq!(
        (st.state.as_str(), tests::step(&st, "x").state.as_str()),
        ("pending", "pending")
    );
    // the kept run's bytes are still readable
    let read: Vec<u8> = sqlx::query_scalar(
        "SELECT b.content FROM durable.artifacts a JOIN durable.artifact_blobs b USING (sha256) WHERE a.id = $1")
        .bind(y_arts[0]).fetch_one(db.pool()).await.expect("read");
    assert_eq!(read, shared);

    // a second pass finds nothing, and the run counters of the rest are exact
    let again = db
        .retention_pass(&options(Duration::from_secs(1)), &CancellationToken::new())
        .await
        .expect("again");
    assert_eq!(
        (again.runs, again.steps, again.blobs, again.vacuumed),
        (0, 0, 0, false)
    );
    let young_counts: (i32, i32) = sqlx::query_as(
        "SELECT steps_total, steps_succeeded FROM durable.workflow_runs WHERE id = $1",
    )
    .bind(young)
    .fetch_one(db.pool())
    .await
    .expect("counters");
    assert_eq!(young_counts, (1, 1));
}

/// A run larger than a batch goes over several transactions (its steps
/// first, then the run), each within `batch_steps`.
#[tokio::test]
async fn a_run_larger_than_a_batch_goes_in_several() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let steps: Vec<_> = (0..25)
        .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "k"}))
        .collect();
    let run = t.submit(json!({"name": "wide", "steps": steps})).await;
    let small = t
        .submit(tests::one_step("small", "go", "k", json!({})))
        .await;
    let leased = lease(db, wid, 100).await;
    assert_eq!(leased.len(), 26);
    finish_batch(db, &leased).await;
    assert_eq!(t.status(run).await.state, "succeeded");
    assert_eq!(t.status(small).await.state, "succeeded");
    let r = pass_in_batches_of_10(db).await;
    // 10 + 10 + 5 steps of the wide run (the last batch takes the run), then the small run
    assert_eq!((r.runs, r.steps, r.batches), (2, 26, 4), "{r:?}");
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs").await,
        0
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        0
    );
}

/// Between the batches that remove a run larger than a batch, the run is
/// not read: `status`, `events` and `watch` say it is being removed (not
/// found), `runs` leaves it out; a run beside it reads as before. Before,
/// a finished run showed its removed steps as "waiting" on nothing, and an
/// interrupted `gc` left it so (scale audit).
#[tokio::test]
async fn a_run_partly_removed_is_not_read_as_a_half() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let steps: Vec<_> = (0..25)
        .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "k"}))
        .collect();
    let run = t.submit(json!({"name": "wide", "steps": steps})).await;
    finish_batch(db, &lease(db, wid, 100).await).await;
    // finished after it: the first batch takes the wide run's steps
    let small = t
        .submit(tests::one_step("small", "go", "k", json!({})))
        .await;
    finish_batch(db, &lease(db, wid, 100).await).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let cutoff = db
        .retention_cutoff(Duration::from_secs(1))
        .await
        .expect("cutoff");
    let b = db.retention_batch(cutoff, 100, 10).await.expect("batch");
    assert_eq!((b.runs, b.steps, b.more), (0, 10, true), "{b:?}");

    let gone = |e: supervisor::db::DbError, what: &str| {
        let msg = e.to_string();
        assert!(
            matches!(e, supervisor::db::DbError::NotFound(_)) && msg.contains("being removed"),
            "{what}: {msg}"
        );
    };
    gone(db.status(run).await.expect_err("status"), "status");
    gone(
        db.events(run, None, None).await.expect_err("events"),
        "events",
    );
    gone(
        db.watch_snapshot(run).await.expect_err("watch"),
        "watch snapshot",
    );
    let listed: Vec<Uuid> = db
        .runs(&supervisor::db::RunFilter {
            state: None,
            name: None,
            since: None,
            limit: 50,
            before: None,
        })
        .await
        .expect("runs")
        .0
        .into_iter()
        .map(|r| r.run_id)
        .collect();
    assert_eq!(listed, vec![small], "only the run that is whole is listed");
    assert_eq!(t.status(small).await.state, "succeeded");
    gone(db.run_state(run).await.expect_err("run state"), "run state");
    // a dry run counts what is left of it (it counted its 25)
    let preview = db
        .retention_preview(Duration::from_secs(1))
        .await
        .expect("preview");
    assert_eq!((preview.runs, preview.steps), (2, 16), "{preview:?}");

    // the next pass ends it whatever its cutoff (a week here: it stayed
    // half removed until it was older than that; re-check audit), and
    // leaves the young run alone: unknown from then on, the mark gone
    let week = Duration::from_secs(7 * 86_400);
    let preview = db.retention_preview(week).await.expect("preview");
    assert_eq!((preview.runs, preview.steps), (1, 15), "{preview:?}");
    let mut opts = options(week);
    opts.batch_steps = 10;
    let r = db
        .retention_pass(&opts, &CancellationToken::new())
        .await
        .expect("pass");
    assert_eq!((r.runs, r.steps), (1, 15), "{r:?}");
    assert_eq!(t.status(small).await.state, "succeeded");
    let msg = db.status(run).await.expect_err("gone").to_string();
    assert!(msg.contains("unknown run"), "{msg}");
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.runs_being_removed")
            .await,
        0
    );
}

/// Whatever reads a run retention is removing treats it as gone, as
/// `status` does: its artifacts (`artifact get`), a lineage through it (it
/// named a derived artifact as a first input once its parents were gone),
/// a submit of its idempotency key (it answered with the run about to
/// vanish, the work never run; re-check audit). The mark is set here as the
/// first batch of a larger run sets it.
#[tokio::test]
async fn what_reads_a_run_being_removed_treats_it_as_gone() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let spec = json!({"name": "old", "idempotency_key": "nightly-1", "steps": [
        {"name": "s", "executor_kind": "go", "kind": "k"}]});
    let old = t.submit(spec.clone()).await;
    let s = lease(db, wid, 1).await.remove(0);
    let parent = succeed(db, &s, &[artifact("in.txt", b"parent", vec![])]).await[0];
    let young = t
        .submit(tests::one_step("young", "go", "k", json!({})))
        .await;
    let s = lease(db, wid, 1).await.remove(0);
    let child = succeed(db, &s, &[artifact("out.txt", b"child", vec![parent])]).await[0];
    let whole = db.artifact_lineage(child).await.expect("whole lineage");
    assert_eq!(whole.nodes.len(), 2);

    sqlx::query("INSERT INTO durable.runs_being_removed (run_id) VALUES ($1)")
        .bind(old)
        .execute(db.pool())
        .await
        .expect("mark");
    let said = |e: supervisor::db::DbError| e.to_string();
    let msg = said(db.artifact_blob(parent).await.expect_err("its artifact"));
    assert!(
        msg.contains(&format!("run {old} is being removed")),
        "{msg}"
    );
    let msg = said(db.artifact_lineage(parent).await.expect_err("its lineage"));
    assert!(
        msg.contains(&format!("run {old} is being removed")),
        "{msg}"
    );
    let msg = said(
        db.artifact_lineage(child)
            .await
            .expect_err("a lineage through it"),
    );
    assert!(
        msg.contains(&format!("reaches run {old}, which is being removed")),
        "{msg}"
    );
    let err = db.submit(&spec).await.expect_err("its key");
    assert!(
        matches!(err, supervisor::db::DbError::KeyBeingFreed(_)),
        "{err:?}"
    );
    let msg = said(err);
    assert!(
        msg.contains("\"nightly-1\"") && msg.contains("retention is removing"),
        "{msg}"
    );
    // the other run reads as before
    db.artifact_blob(child)
        .await
        .expect("the young run's artifact");
    assert_eq!(t.status(young).await.state, "succeeded");
}

/// Several runs larger than a batch all go in one pass (soak audit: the
/// batch that removed the last piece of one said there was no more, so a
/// pass, and a worker's retention interval, removed one such run at most).
#[tokio::test]
async fn several_runs_larger_than_a_batch_go_in_one_pass() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let wide = |name: &str| {
        let steps: Vec<_> = (0..25)
            .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "k"}))
            .collect();
        json!({"name": name, "steps": steps})
    };
    let mut runs = Vec::new();
    for name in ["w1", "w2", "w3"] {
        runs.push(t.submit(wide(name)).await);
        // each finishes after the one before
        let leased = lease(db, wid, 100).await;
        assert_eq!(leased.len(), 25);
        finish_batch(db, &leased).await;
    }
    let r = pass_in_batches_of_10(db).await;
    // 10 + 10 + 5 steps of each run, the last piece taking its run
    assert_eq!((r.runs, r.steps, r.batches), (3, 75, 9), "{r:?}");
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        0
    );
}

/// An artifact that names bytes retention removed while its write was in
/// flight is a retryable conflict (40001), not a permanent foreign-key
/// violation: the worker retries the write, which stores the bytes again.
#[tokio::test]
async fn an_artifact_whose_blob_is_gone_is_a_retryable_conflict() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let run = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let s = lease(db, wid, 1).await.remove(0);
    succeed(db, &s, &[]).await;
    let err = sqlx::query(
        "INSERT INTO durable.artifacts (id, run_id, step_run_id, attempt, name, sha256, size, media_type)
         VALUES (gen_random_uuid(), $1, $2, 1, 'x', repeat('0', 64), 1, 'text/plain')",
    )
    .bind(run)
    .bind(s.lease.step_run_id())
    .execute(db.pool())
    .await
    .expect_err("no blob");
    let code = err
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("40001"), "{err}");
    assert!(supervisor::db::sqlstate_is_transient("40001"));
}

fn ev(seq: u64, kind: &'static str) -> OwnedEvent {
    OwnedEvent {
        sequence: seq,
        kind,
        message: String::new(),
        fraction: None,
        executor_at: None,
    }
}

/// A second later, one retention pass of runs older than a second, in
/// batches of 10 steps.
async fn pass_in_batches_of_10(db: &Db) -> supervisor::db::RetentionReport {
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut opts = options(Duration::from_secs(1));
    opts.batch_steps = 10;
    db.retention_pass(&opts, &CancellationToken::new())
        .await
        .expect("pass")
}

/// Starts and completes `leased` in one ledger batch (what a worker's ledger
/// writes), except every twentieth step, which completes on its own with an
/// artifact of its own bytes.
async fn finish_batch(db: &Db, leased: &[LeasedStep]) {
    let mut sorted: Vec<&LeasedStep> = leased.iter().collect();
    sorted.sort_by_key(|s| (s.run_id, s.lease.step_run_id()));
    let with_artifact = |i: usize| i % 20 == 19;
    let batch = Batch {
        starts: sorted
            .iter()
            .map(|s| StartWrite {
                run_id: s.run_id,
                lease: s.lease.clone(),
                pid: 1,
                event: ev(1, "accepted"),
            })
            .collect(),
        events: Vec::new(),
        completes: sorted
            .iter()
            .enumerate()
            .filter(|(i, _)| !with_artifact(*i))
            .map(|(_, s)| CompleteWrite {
                run_id: s.run_id,
                lease: s.lease.clone(),
                output: json!({"n": 1}),
                sequence: Some(2),
            })
            .collect(),
    };
    let out = db.write_batch("w", &batch).await.expect("batch");
    assert!(
        out.starts
            .iter()
            .chain(&out.completes)
            .all(|o| *o == supervisor::db::RowOutcome::Ok),
        "{out:?}"
    );
    for (i, s) in sorted.iter().enumerate().filter(|(i, _)| with_artifact(*i)) {
        let bytes = format!(
            "artifact of {} ({i}) {}",
            s.lease.step_run_id(),
            "x".repeat(512)
        );
        let a = artifact("out", bytes.as_bytes(), vec![]);
        db.record_inline_blob(&a.meta.sha256, &a.content)
            .await
            .expect("blob");
        db.complete(&s.lease, "w", &json!({"n": 1}), &[a.meta], Some(2))
            .await
            .expect("complete with artifact");
    }
}

/// The durable tables with their indexes and TOAST, in bytes.
async fn footprint(db: &Db) -> i64 {
    let names: Vec<String> = RETENTION_TABLES.iter().map(|s| s.to_string()).collect();
    sqlx::query_scalar(
        "SELECT sum(pg_total_relation_size(t::regclass))::bigint FROM unnest($1::text[]) AS t",
    )
    .bind(&names)
    .fetch_one(db.pool())
    .await
    .expect("sizes")
}

/// Churn: 20,000 steps (2,000 runs of 10, every twentieth step with an
/// artifact of its own) in ten waves, with a retention age of half a second
/// and its pass (batches, then VACUUM, as a worker runs it) after each wave.
/// The tables and indexes when the last 2,000 steps have finished are within
/// 2× of their size when the first 2,000 had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_keeps_the_tables_bounded() {
    const AGE: Duration = Duration::from_millis(500);
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let spec = |w: usize, r: usize| {
        let steps: Vec<_> = (0..10)
            .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "k"}))
            .collect();
        json!({"name": format!("churn-{w}-{r}"), "steps": steps})
    };
    let started = Instant::now();
    let mut after_first = 0;
    let mut at_end = 0;
    let mut longest_batch = Duration::ZERO;
    let mut removed = 0;
    for wave in 0..10 {
        let wave_start = Instant::now();
        let specs: Vec<_> = (0..200).map(|r| spec(wave, r)).collect();
        let submits = specs.iter().map(|s| db.submit(s));
        for id in futures::future::join_all(submits).await {
            id.expect("submit");
        }
        let submitted = wave_start.elapsed();
        let mut done = 0;
        while done < 2000 {
            let leased = lease(db, wid, 200).await;
            assert!(
                !leased.is_empty(),
                "wave {wave}: {done} of 2000 steps done and nothing to lease"
            );
            finish_batch(db, &leased).await;
            done += leased.len();
        }
        assert_eq!(
            t.scalar_i64("SELECT count(*) FROM durable.workflow_runs WHERE state <> 'succeeded'")
                .await,
            0
        );
        let worked = started.elapsed();
        let ran = wave_start.elapsed() - submitted;
        if wave == 0 {
            after_first = footprint(db).await;
        }
        if wave == 9 {
            // the end: the last 2,000 steps just finished, as the first had
            at_end = footprint(db).await;
        }
        // the wave is older than the retention age, then a pass
        tokio::time::sleep(AGE + Duration::from_millis(50)).await;
        let r = db
            .retention_pass(&options(AGE), &CancellationToken::new())
            .await
            .expect("pass");
        assert_eq!(
            (r.runs, r.steps, r.artifacts),
            (200, 2000, 100),
            "wave {wave}: {r:?}"
        );
        assert_eq!(
            r.blobs, 100,
            "wave {wave}: every artifact's bytes were its own: {r:?}"
        );
        longest_batch = longest_batch.max(r.longest_batch);
        removed += r.runs;
        println!(
            "wave {wave}: at {:.1} s (submit {:.1} s, lease and finish {:.1} s), footprint after its pass {} KiB, pass {r:?}",
            worked.as_secs_f64(),
            submitted.as_secs_f64(),
            ran.as_secs_f64(),
            footprint(db).await / 1024
        );
    }
    let end = at_end;
    println!(
        "churn: 20000 steps in {:.1} s; footprint after the first 2000: {} KiB, at the end: {} KiB ({:.2}x); {removed} runs removed; longest retention batch {:.1} ms (100 runs, 1000 steps)",
        started.elapsed().as_secs_f64(),
        after_first / 1024,
        end / 1024,
        end as f64 / after_first as f64,
        longest_batch.as_secs_f64() * 1000.0
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs").await,
        0
    );
    assert!(
        end <= 2 * after_first,
        "the tables grew from {after_first} to {end} bytes under churn with retention on"
    );
}

/// A worker with `retention = "1s"` removes a finished run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removes_old_runs_on_its_own() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.retention = "1s".into();
    cfg.retention_interval_ms = 200;
    let w = tests::RunningWorker::start(t.connect(6).await, cfg).await;
    let run = t
        .submit(tests::one_step("r", "go", "demo.echo", json!({"x": 1})))
        .await;
    assert_eq!(
        t.wait_terminal(run, Duration::from_secs(20)).await.state,
        "succeeded"
    );
    let until = Instant::now() + Duration::from_secs(20);
    while t
        .scalar_i64(&format!(
            "SELECT count(*) FROM durable.workflow_runs WHERE id = '{run}'"
        ))
        .await
        > 0
    {
        assert!(
            Instant::now() < until,
            "the worker did not remove the finished run within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.step_runs").await,
        0
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.transitions")
            .await,
        0
    );
    w.shutdown().await;
}

/// `supervisor gc` from the installed binary: a dry run counts and keeps,
/// the real one removes, a bad age is exit 2 naming the fix.
#[tokio::test]
async fn the_gc_command() {
    let t = TestDb::new().await;
    let wid = worker(&t.db).await;
    let run = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let s = lease(&t.db, wid, 1).await.remove(0);
    succeed(&t.db, &s, &[artifact("report", b"bytes", vec![])]).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let gc = |args: &[&str]| {
        std::process::Command::new(tests::supervisor_bin())
            .arg("gc")
            .args(args)
            .env("DATABASE_URL", &t.url)
            .output()
            .expect("run supervisor gc")
    };
    let dry = gc(&["--older-than", "1s", "--dry-run", "--json"]);
    assert!(dry.status.success(), "{dry:?}");
    let v: serde_json::Value = serde_json::from_slice(&dry.stdout).expect("json");
    assert_eq!(
        (
            v["runs"].as_i64(),
            v["steps"].as_i64(),
            v["artifacts"].as_i64()
        ),
        (Some(1), Some(1), Some(1)),
        "{v}"
    );
    assert_eq!(t.status(run).await.state, "succeeded");
    // the default age (7d) keeps a run that finished a second ago
    let default = gc(&[]);
    assert!(default.status.success(), "{default:?}");
    assert!(
        String::from_utf8_lossy(&default.stdout).starts_with("removed 0 runs"),
        "{default:?}"
    );
    let real = gc(&["--older-than", "1s", "--json"]);
    assert!(real.status.success(), "{real:?}");
    let v: serde_json::Value = serde_json::from_slice(&real.stdout).expect("json");
    // the real pass says what went as its dry run said what would go
    assert_eq!(
        (
            v["runs"].as_i64(),
            v["steps"].as_i64(),
            v["artifacts"].as_i64(),
            v["blobs"].as_i64()
        ),
        (Some(1), Some(1), Some(1), Some(1)),
        "{v}"
    );
    let again = gc(&["--older-than", "1s"]);
    assert!(again.status.success(), "{again:?}");
    let out = String::from_utf8_lossy(&again.stdout);
    assert!(
        out.starts_with("removed 0 runs")
            && out.contains("(0 steps, 0 artifacts, 0 artifact blobs"),
        "{out}"
    );
    assert!(matches!(
        t.db.status(run).await,
        Err(supervisor::db::DbError::NotFound(_))
    ));
    assert!(
        String::from_utf8_lossy(&again.stderr).is_empty(),
        "{again:?}"
    );
    // files of removed directory-store blobs wait for a process that mounts
    // the directory: a gc without --artifact-dir says so (retention audit:
    // it said "0 files" and nothing of them)
    sqlx::query("INSERT INTO durable.artifact_files_removed (sha256) VALUES ($1)")
        .bind("ab".repeat(32))
        .execute(t.db.pool())
        .await
        .expect("queue a file");
    let waiting = gc(&["--older-than", "1s"]);
    assert!(waiting.status.success(), "{waiting:?}");
    assert!(
        String::from_utf8_lossy(&waiting.stderr)
            .contains("1 removed blobs' files wait in the shared artifact directory"),
        "{waiting:?}"
    );
    let bad = gc(&["--older-than", "7x"]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("like 30s, 10m, 2h, 3d"),
        "{bad:?}"
    );
}

/// Removing a chunked blob removes its chunk rows too (retention deletes
/// blob rows no artifact references; before this the chunks stayed forever).
#[tokio::test]
async fn a_deleted_chunked_blob_takes_its_chunks_with_it() {
    let t = TestDb::new().await;
    let (kept, gone) = (Uuid::new_v4(), Uuid::new_v4());
    for (upload, sha) in [(kept, "a".repeat(64)), (gone, "b".repeat(64))] {
        sqlx::query(
            "INSERT INTO durable.artifact_blobs (sha256, size, store, upload_id, chunks)
             VALUES ($1, 6, 'chunks', $2, 2)",
        )
        .bind(&sha)
        .bind(upload)
        .execute(t.db.pool())
        .await
        .expect("blob");
        for n in 0..2 {
            sqlx::query(
                "INSERT INTO durable.artifact_chunks (upload_id, n, data) VALUES ($1, $2, 'abc')",
            )
            .bind(upload)
            .bind(n)
            .execute(t.db.pool())
            .await
            .expect("chunk");
        }
    }
    sqlx::query("DELETE FROM durable.artifact_blobs WHERE sha256 = $1")
        .bind("b".repeat(64))
        .execute(t.db.pool())
        .await
        .expect("delete");
    let left: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT upload_id, count(*) FROM durable.artifact_chunks GROUP BY upload_id",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("chunks");
    assert_eq!(left, vec![(kept, 2)]);
}

async fn exec(db: &Db, sql: &str) {
    sqlx::raw_sql(sql).execute(db.pool()).await.expect(sql);
}

async fn shas(db: &Db) -> Vec<String> {
    sqlx::query_scalar("SELECT sha256 FROM durable.artifact_blobs ORDER BY sha256")
        .fetch_all(db.pool())
        .await
        .expect("blobs")
}

/// Uploads whose attempt never committed leave unreferenced blobs and staged
/// chunks: those nobody claimed for a day are garbage, younger ones are an
/// upload in flight and stay. A removed directory-store blob's file is
/// deleted by whoever mounts the directory, unless it is newer than the
/// removal (the same bytes uploaded again since): that one stays.
#[tokio::test]
async fn unreferenced_uploads_are_collected_and_removed_files_follow_their_rows() {
    let t = TestDb::new().await;
    let (c, d, e, f) = (
        "c".repeat(64),
        "d".repeat(64),
        "e".repeat(64),
        "f".repeat(64),
    );
    let (old_upload, young_upload) = (Uuid::new_v4(), Uuid::new_v4());
    exec(
        &t.db,
        &format!(
            "INSERT INTO durable.artifact_blobs (sha256, size, content, claimed_at)
                  VALUES ('{c}', 1, 'x', now() - interval '2 days'), ('{d}', 1, 'y', now());
             INSERT INTO durable.artifact_blobs (sha256, size, store, claimed_at)
                  VALUES ('{e}', 3, 'directory', now() - interval '2 days'),
                         ('{f}', 3, 'directory', now() - interval '2 days');
             INSERT INTO durable.artifact_chunks (upload_id, n, data, created_at)
                  VALUES ('{old_upload}', 0, 'abc', now() - interval '2 days'),
                         ('{old_upload}', 1, 'abc', now() - interval '2 days'),
                         ('{young_upload}', 0, 'abc', now());"
        ),
    )
    .await;
    let (blobs, chunks) =
        t.db.collect_blob_garbage(supervisor::db::BLOB_GARBAGE_AGE, 100)
            .await
            .expect("garbage");
    assert_eq!(
        (blobs, chunks),
        (3, 2),
        "c, e, f and the old upload's two chunks"
    );
    assert_eq!(shas(&t.db).await, vec![d.clone()]);
    let left: Vec<Uuid> =
        sqlx::query_scalar("SELECT DISTINCT upload_id FROM durable.artifact_chunks")
            .fetch_all(t.db.pool())
            .await
            .expect("chunks");
    assert_eq!(left, vec![young_upload]);

    // the shared directory: e's file is old, f's was written again since
    let dir = tempfile::tempdir().expect("dir");
    for sha in [&e, &f] {
        std::fs::create_dir_all(dir.path().join(&sha[..2])).expect("shard");
        std::fs::write(dir.path().join(&sha[..2]).join(sha), b"abc").expect("file");
    }
    let old = std::time::SystemTime::now() - Duration::from_secs(3 * 24 * 3600);
    std::fs::File::options()
        .write(true)
        .open(dir.path().join(&e[..2]).join(&e))
        .and_then(|file| file.set_modified(old))
        .expect("mtime");
    // a directory that is not the store's (a typo, a volume not mounted)
    // deletes nothing and drops nothing from the queue (retention audit:
    // every entry was dropped as "already deleted", the real files kept
    // for ever)
    let queue = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM durable.artifact_files_removed")
            .fetch_one(t.db.pool())
            .await
            .expect("queue")
    };
    let missing = dir.path().join("not-mounted");
    let err = supervisor::artifacts::remove_deleted_files(&t.db, &missing)
        .await
        .expect_err("a directory that is not there");
    assert!(err.to_string().contains("not-mounted"), "{err}");
    assert_eq!(queue().await, 2, "nothing dropped for a missing directory");
    let empty = tempfile::tempdir().expect("empty dir");
    let deleted = supervisor::artifacts::remove_deleted_files(&t.db, empty.path())
        .await
        .expect("an empty directory");
    assert_eq!(deleted, 0);
    assert_eq!(queue().await, 2, "nothing dropped for an empty directory");
    let deleted = supervisor::artifacts::remove_deleted_files(&t.db, dir.path())
        .await
        .expect("remove files");
    assert_eq!(deleted, 1);
    assert!(
        !dir.path().join(&e[..2]).join(&e).exists(),
        "e's old file is deleted"
    );
    assert!(
        dir.path().join(&f[..2]).join(&f).exists(),
        "f's newer file is kept"
    );
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM durable.artifact_files_removed")
        .fetch_one(t.db.pool())
        .await
        .expect("queue");
    // f's file is newer than its removal and no row names it: a re-upload
    // whose row is on its way, or the blob's own file if it lived less than
    // a minute. It stays queued (it was dropped here, and such a file then
    // stayed for good), and goes once nobody has claimed it for 10 minutes.
    assert_eq!(queued, 1, "e is dealt with, f waits");
    std::fs::File::options()
        .write(true)
        .open(dir.path().join(&f[..2]).join(&f))
        .and_then(|file| file.set_modified(std::time::SystemTime::now() - Duration::from_secs(601)))
        .expect("mtime");
    let deleted = supervisor::artifacts::remove_deleted_files(&t.db, dir.path())
        .await
        .expect("remove files");
    assert_eq!(deleted, 1, "f, unclaimed for 10 minutes");
    assert!(!dir.path().join(&f[..2]).join(&f).exists());
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM durable.artifact_files_removed")
        .fetch_one(t.db.pool())
        .await
        .expect("queue");
    assert_eq!(queued, 0, "both are dealt with");
}

/// History has no foreign keys (their per-row checks cost ~80 µs a row:
/// migration 20261205000002): a run or a step deleted
/// by hand, outside retention, still takes its transitions and events with
/// it, by the delete triggers that replaced the cascades; other runs'
/// history stays.
#[tokio::test]
async fn a_run_deleted_by_hand_takes_its_history_with_it() {
    let t = TestDb::new().await;
    let wid = worker(&t.db).await;
    let spec = |name: &str| {
        json!({"name": name, "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]})
    };
    let gone = t.submit(spec("gone")).await;
    let kept = t.submit(spec("kept")).await;
    for s in lease(&t.db, wid, 2).await {
        succeed(&t.db, &s, &[]).await;
    }
    let steps = |run: Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query_scalar::<_, Uuid>("SELECT id FROM durable.step_runs WHERE run_id = $1")
                .bind(run)
                .fetch_all(db.pool())
                .await
                .expect("steps")
        }
    };
    let (gone_steps, kept_steps) = (steps(gone).await, steps(kept).await);
    assert_eq!(
        (gone_steps.len(), kept_steps.len()),
        (2, 2),
        "b was created"
    );
    let kept_before = rows_of_run(&t.db, kept, &kept_steps, &[]).await;
    let before = rows_of_run(&t.db, gone, &gone_steps, &[]).await;
    assert!(
        before
            .iter()
            .all(|(table, n)| *n > 0 || table.starts_with("artifact")),
        "{before:?}"
    );
    // one step alone first (of a run that ended and is marked for removal,
    // as retention marks it: 20261228000002): its events and transitions
    // go, the run's stay
    t.db.cancel(gone, None).await.expect("cancel");
    sqlx::query("INSERT INTO durable.runs_being_removed (run_id) VALUES ($1)")
        .bind(gone)
        .execute(t.db.pool())
        .await
        .expect("mark the run");
    let a = gone_steps[0];
    sqlx::query("DELETE FROM durable.step_runs WHERE id = $1")
        .bind(a)
        .execute(t.db.pool())
        .await
        .expect("delete a step");
    let of_step = |sql: &'static str| {
        let db = t.db.clone();
        async move { count(&db, sql, &[a]).await }
    };
    assert_eq!(
        of_step("SELECT count(*) FROM durable.transitions WHERE step_run_id = ANY($1)").await,
        0
    );
    assert_eq!(
        of_step("SELECT count(*) FROM durable.step_events WHERE step_run_id = ANY($1)").await,
        0
    );
    let run_rows = count(
        &t.db,
        "SELECT count(*) FROM durable.transitions WHERE run_id = ANY($1) AND step_run_id IS NULL",
        &[gone],
    )
    .await;
    assert!(run_rows > 0, "the run's own transitions stay");
    sqlx::query("DELETE FROM durable.workflow_runs WHERE id = $1")
        .bind(gone)
        .execute(t.db.pool())
        .await
        .expect("delete the run");
    let after = rows_of_run(&t.db, gone, &gone_steps, &[]).await;
    assert!(after.iter().all(|(_, n)| *n == 0), "left behind: {after:?}");
    assert_eq!(
        rows_of_run(&t.db, kept, &kept_steps, &[]).await,
        kept_before,
        "another run's rows"
    );
}

/// `gc` stopped by SIGINT after a batch says so and exits 130: it exited 0,
/// so `gc && …` went on as if every old run were gone (operator audit).
#[tokio::test]
async fn an_interrupted_gc_exits_130() {
    let t = TestDb::new().await;
    for i in 0..400 {
        let run = t
            .submit(tests::one_step(&format!("r{i}"), "go", "k", json!({})))
            .await;
        t.db.cancel(run, None).await.expect("cancel");
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let child = std::process::Command::new(tests::supervisor_bin())
        .args([
            "gc",
            "--older-than",
            "1s",
            "--batch-runs",
            "1",
            "--no-vacuum",
        ])
        .env("DATABASE_URL", &t.url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("gc");
    // once it has removed some, and long before the 400th batch
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while t
        .scalar_i64("SELECT count(*) FROM durable.workflow_runs")
        .await
        == 400
    {
        assert!(std::time::Instant::now() < until, "gc removed nothing");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let out = child.wait_with_output().expect("wait");
    let text = String::from_utf8_lossy(&out.stdout);
    let left = t
        .scalar_i64("SELECT count(*) FROM durable.workflow_runs")
        .await;
    if left == 0 {
        // the signal came after the last batch: done, and said so
        assert_eq!(out.status.code(), Some(0), "{text}");
        return;
    }
    assert_eq!(out.status.code(), Some(130), "{text}");
    assert!(text.contains("interrupted: run it again"), "{text}");
}

/// History and results go only with their whole run (deployment audit): a
/// role that may DELETE (the worker's, for retention) deleted a finished
/// run's transitions and events while the run stayed. Now each of
/// transitions, step_events, artifacts and step_runs refuses a DELETE of
/// rows of a run that stays, unless the run is finished and marked for
/// removal (as retention marks it; readers then treat it as gone); an open
/// run cannot be marked. Retention still removes the finished run whole.
#[tokio::test]
async fn history_is_removed_only_with_its_whole_run() {
    let t = TestDb::new().await;
    let wid = worker(&t.db).await;
    let done = t
        .submit(
            json!({"name": "done", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"}]}),
        )
        .await;
    let open = t
        .submit(
            json!({"name": "open", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}),
        )
        .await;
    for s in lease(&t.db, wid, 2).await {
        succeed(&t.db, &s, &[artifact("out.txt", b"result", vec![])]).await;
    }
    assert_eq!(t.status(done).await.state, "succeeded");
    assert_eq!(t.status(open).await.state, "running");
    let statements = [
        "DELETE FROM durable.transitions WHERE run_id = $1",
        "DELETE FROM durable.step_events WHERE step_run_id IN (SELECT id FROM durable.step_runs WHERE run_id = $1)",
        "DELETE FROM durable.artifacts WHERE run_id = $1",
        "DELETE FROM durable.step_runs WHERE run_id = $1",
        "DELETE FROM durable.step_defs WHERE run_id = $1",
    ];
    let counts = |run: Uuid| {
        let db = t.db.clone();
        async move {
            let mut v = Vec::new();
            for sql in [
                "SELECT count(*) FROM durable.transitions WHERE run_id = $1",
                "SELECT count(*) FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id WHERE s.run_id = $1",
                "SELECT count(*) FROM durable.artifacts WHERE run_id = $1",
                "SELECT count(*) FROM durable.step_runs WHERE run_id = $1",
            ] {
                v.push(
                    sqlx::query_scalar::<_, i64>(sql)
                        .bind(run)
                        .fetch_one(db.pool())
                        .await
                        .expect("count"),
                );
            }
            v
        }
    };
    let before = (counts(done).await, counts(open).await);
    assert!(before.0.iter().all(|n| *n > 0), "{before:?}");
    for run in [done, open] {
        for sql in statements {
            let err = sqlx::query(sql)
                .bind(run)
                .execute(t.db.pool())
                .await
                .expect_err(sql);
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("of run {run} are removed only with the whole run")),
                "{sql}: {msg}"
            );
        }
    }
    // nor an open run's edges (its waiting step would never be made), nor
    // can a result move to another run (to be deleted as that one's), nor a
    // mark be taken back (a run stripped while marked read as whole again)
    let err = sqlx::query("DELETE FROM durable.step_dependents WHERE run_id = $1")
        .bind(open)
        .execute(t.db.pool())
        .await
        .expect_err("an open run's edges");
    assert!(
        err.to_string().contains("removed only with the whole run"),
        "{err}"
    );
    let err = sqlx::query("UPDATE durable.artifacts SET run_id = $1 WHERE run_id = $2")
        .bind(done)
        .bind(open)
        .execute(t.db.pool())
        .await
        .expect_err("moving a result");
    assert!(err.to_string().contains("append-only"), "{err}");
    let mut tx = t.db.pool().begin().await.expect("begin");
    sqlx::query("INSERT INTO durable.runs_being_removed (run_id) VALUES ($1)")
        .bind(done)
        .execute(&mut *tx)
        .await
        .expect("mark a finished run");
    let err = sqlx::query("DELETE FROM durable.runs_being_removed WHERE run_id = $1")
        .bind(done)
        .execute(&mut *tx)
        .await
        .expect_err("unmarking");
    assert!(
        err.to_string().contains("the mark goes only with the run"),
        "{err}"
    );
    tx.rollback().await.expect("rollback");
    // an open run cannot even be marked for removal (re-check audit: a
    // marked run's rows could be deleted, and readers called it gone)
    let err = sqlx::query("INSERT INTO durable.runs_being_removed (run_id) VALUES ($1)")
        .bind(open)
        .execute(t.db.pool())
        .await
        .expect_err("marking an open run");
    assert!(
        err.to_string().contains(&format!(
            "run {open} is not finished: retention removes only finished runs"
        )),
        "{err}"
    );
    assert_eq!(
        (counts(done).await, counts(open).await),
        before,
        "nothing was deleted"
    );

    // retention removes the finished run whole; the open one keeps all
    let removed =
        t.db.retention_pass(&options(Duration::ZERO), &CancellationToken::new())
            .await
            .expect("retention");
    assert_eq!(removed.runs, 1, "{removed:?}");
    assert_eq!(counts(done).await, vec![0, 0, 0, 0]);
    assert_eq!(counts(open).await, before.1);
}

/// A retention pass prunes the pins of attempts that ended: they protect
/// nothing, but stayed as long as their steps, so a blob many steps produced
/// had one pin per step and every "is it pinned" probe walked them all
/// (`gc --dry-run` took 2-4 s at 1,800 artifacts of one content; operator's
/// tools audit). A pin of an attempt that still holds its lease stays, and
/// still keeps its blob.
#[tokio::test]
async fn a_pass_prunes_the_pins_of_ended_attempts_and_keeps_live_ones() {
    let t = TestDb::new().await;
    let db = &t.db;
    let wid = worker(db).await;
    let one = json!({"name": "p", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"}]});
    for _ in 0..3 {
        t.submit(one.clone()).await;
    }
    let bytes = b"the same bytes";
    let art = artifact("same.txt", bytes, vec![]);
    let leased = lease(db, wid, 3).await;
    for s in &leased {
        db.pin_blob(&art.meta.sha256, &s.lease).await.expect("pin");
    }
    // two attempts end with the artifact; the third still runs
    for s in &leased[..2] {
        succeed(db, s, &[artifact("same.txt", bytes, vec![])]).await;
    }
    let pins = || async {
        sqlx::query_scalar::<_, Uuid>("SELECT step_run_id FROM durable.blob_pins")
            .fetch_all(db.pool())
            .await
            .expect("pins")
    };
    assert_eq!(pins().await.len(), 3);
    let report = db
        .retention_pass(
            &options(Duration::from_secs(3600)),
            &CancellationToken::new(),
        )
        .await
        .expect("pass");
    assert_eq!(report.runs, 0, "nothing is old enough: {report:?}");
    assert_eq!(
        pins().await,
        vec![leased[2].lease.step_run_id()],
        "only the live attempt's pin is left"
    );
    // and it still keeps the blob when the two runs that reference it go
    let report = db
        .retention_pass(&options(Duration::ZERO), &CancellationToken::new())
        .await
        .expect("pass");
    assert_eq!((report.runs, report.blobs), (2, 0), "{report:?}");
    assert!(blob_exists(db, bytes).await, "the live pin keeps the bytes");
}
