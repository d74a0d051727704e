//! What a cancel writes into a run's history (cancellation audit): a run in
//! which nothing started does not pass through `running` because of a cancel,
//! and a run closed by a cancel request says so, whichever step ended last.

use serde_json::json;
use tests::TestDb;
use uuid::Uuid;

/// The run's own hops, (from, to, reason), in order.
async fn run_hops(t: &TestDb, run: Uuid) -> Vec<(Option<String>, String, String)> {
    sqlx::query_as(
        "SELECT from_state, to_state, reason FROM durable.transitions
          WHERE run_id = $1 AND step_run_id IS NULL ORDER BY id",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("history")
}

async fn sql(t: &TestDb, q: &str, run: Uuid) {
    sqlx::query(q)
        .bind(run)
        .execute(t.db.pool())
        .await
        .unwrap_or_else(|e| panic!("{q}: {e}"));
}

/// Step `name` leased, as a worker's lease would.
async fn lease(t: &TestDb, run: Uuid, name: &str) {
    sqlx::query(
        "UPDATE durable.step_runs SET state = 'leased', lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute', attempt = 1
          WHERE run_id = $1 AND name = $2",
    )
    .bind(run)
    .bind(name)
    .execute(t.db.pool())
    .await
    .expect("lease");
}

fn hop(from: Option<&str>, to: &str, why: &str) -> (Option<String>, String, String) {
    (from.map(str::to_owned), to.to_owned(), why.to_owned())
}

/// A pending run whose step is leased but not started: the cancel leaves it
/// pending (it said "running"), and when the worker gives the step up the
/// run goes pending → cancelled.
#[tokio::test]
async fn cancelling_a_run_whose_step_is_only_leased_leaves_it_pending() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "leased", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k"},
            {"name": "t", "executor_kind": "go", "kind": "k", "depends_on": ["s"]}]}))
        .await;
    lease(&t, run, "s").await;
    let state = t.db.cancel(run, None).await.expect("cancel");
    assert_eq!(state.as_str(), "pending", "nothing of the run started");
    assert_eq!(t.status(run).await.state, "pending");
    // the worker hears of the cancel before it sent the job
    sql(
        &t,
        "UPDATE durable.step_runs SET state = 'cancelled', transition_reason = 'CANCELLED'
          WHERE run_id = $1 AND name = 's'",
        run,
    )
    .await;
    assert_eq!(t.status(run).await.state, "cancelled");
    assert_eq!(
        run_hops(&t, run).await,
        vec![
            hop(None, "pending", "SUBMITTED"),
            hop(Some("pending"), "cancelled", "cancel requested"),
        ]
    );
}

/// A step that started after all (its job was on its way as the cancel
/// committed) still moves the run to running, and a result kept within the
/// cancel's grace closes it: the run's hop to cancelled names the cancel,
/// not the step that succeeded.
#[tokio::test]
async fn a_run_closed_by_a_cancel_request_says_so() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "kept", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k"},
            {"name": "t", "executor_kind": "go", "kind": "k", "depends_on": ["s"]}]}))
        .await;
    lease(&t, run, "s").await;
    t.db.cancel(run, None).await.expect("cancel");
    for q in [
        "UPDATE durable.step_runs SET state = 'running', started_at = now(), transition_reason = 'ACCEPTED'
          WHERE run_id = $1 AND name = 's'",
        "UPDATE durable.step_runs SET state = 'succeeded', output = '{}', transition_reason = 'SUCCEEDED'
          WHERE run_id = $1 AND name = 's'",
    ] {
        sql(&t, q, run).await;
    }
    assert_eq!(t.status(run).await.state, "cancelled");
    assert_eq!(
        run_hops(&t, run).await,
        vec![
            hop(None, "pending", "SUBMITTED"),
            hop(Some("pending"), "running", "step s running"),
            hop(Some("running"), "cancelled", "cancel requested"),
        ]
    );
}

/// A run cancelled because one of its steps was cancelled by name (no cancel
/// of the run) still names that step.
#[tokio::test]
async fn a_run_ended_by_a_step_cancelled_by_name_names_the_step() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "by-name", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k"}]}))
        .await;
    t.db.cancel(run, Some("s")).await.expect("cancel s");
    assert_eq!(
        run_hops(&t, run).await,
        vec![
            hop(None, "pending", "SUBMITTED"),
            hop(Some("pending"), "cancelled", "step s cancelled"),
        ]
    );
}

/// A run closed by another step's end, when what makes it cancelled is a
/// step cancelled by name earlier, names the cancelled step: it named the
/// step that ended last ("step s succeeded" on a run that ended cancelled:
/// operator race audit).
#[tokio::test]
async fn a_run_closed_later_names_the_step_cancelled_by_name() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "later", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k"},
            {"name": "c", "executor_kind": "go", "kind": "k"}]}))
        .await;
    lease(&t, run, "s").await;
    sql(
        &t,
        "UPDATE durable.step_runs SET state = 'running', started_at = now(), transition_reason = 'ACCEPTED'
          WHERE run_id = $1 AND name = 's'",
        run,
    )
    .await;
    t.db.cancel(run, Some("c")).await.expect("cancel c");
    assert_eq!(t.status(run).await.state, "running", "s still runs");
    sql(
        &t,
        "UPDATE durable.step_runs SET state = 'succeeded', output = '{}', transition_reason = 'SUCCEEDED'
          WHERE run_id = $1 AND name = 's'",
        run,
    )
    .await;
    assert_eq!(t.status(run).await.state, "cancelled");
    assert_eq!(
        run_hops(&t, run).await,
        vec![
            hop(None, "pending", "SUBMITTED"),
            hop(Some("pending"), "running", "step s running"),
            hop(Some("running"), "cancelled", "step c cancelled"),
        ]
    );
}

/// `durable.cancel_run`'s reason is one bounded line: it runs as the
/// schema's owner and wrote any text it was given, of any length, into the
/// history (cancellation audit). A code or a few words are recorded; NULL
/// is CANCEL_REQUESTED.
#[tokio::test]
async fn a_cancel_reason_is_one_bounded_line() {
    let t = TestDb::new().await;
    let one =
        || json!({"name": "why", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]});
    let run = t.submit(one()).await;
    let long = "x".repeat(201);
    for bad in [
        "",
        " \t ",
        "two\nlines",
        "esc \u{1b}[2J",
        "line\u{2028}separator",
        "bidi \u{202e}override",
        long.as_str(),
    ] {
        let err = sqlx::query("SELECT durable.cancel_run($1, NULL, $2)")
            .bind(run)
            .bind(bad)
            .execute(t.db.pool())
            .await
            .expect_err(bad);
        assert!(
            err.to_string().contains("a line of at most 200 characters"),
            "{bad:?}: {err}"
        );
    }
    // a long one is quoted cut short, its length said
    let err = sqlx::query("SELECT durable.cancel_run($1, NULL, $2)")
        .bind(run)
        .bind(&long)
        .execute(t.db.pool())
        .await
        .expect_err("long");
    assert!(err.to_string().contains("…\" (201 characters)"), "{err}");
    assert_eq!(
        t.status(run).await.state,
        "pending",
        "nothing was cancelled"
    );
    let reason = |run: Uuid| {
        let pool = t.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT transition_reason FROM durable.step_runs WHERE run_id = $1",
            )
            .bind(run)
            .fetch_one(&pool)
            .await
            .expect("reason")
        }
    };
    sqlx::query("SELECT durable.cancel_run($1, NULL, 'user requested')")
        .bind(run)
        .execute(t.db.pool())
        .await
        .expect("a few words, as callers passed before");
    assert_eq!(reason(run).await, "user requested");
    let run = t.submit(one()).await;
    sqlx::query("SELECT durable.cancel_run($1, NULL, NULL)")
        .bind(run)
        .execute(t.db.pool())
        .await
        .expect("null");
    assert_eq!(reason(run).await, "CANCEL_REQUESTED");
}
