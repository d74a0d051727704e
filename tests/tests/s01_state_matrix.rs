//! S01: every (from, to) pair of both state machines, tried against the code
//! and against the database; runs whose steps end in every combination of
//! terminal states reach only allowed run states.

use std::collections::VecDeque;

use serde_json::json;
use sqlx::{Postgres, Transaction};
use supervisor::state::{aggregate_run, RunState, StepState};
use tests::TestDb;
use uuid::Uuid;

/// A path of allowed transitions from `pending` to `target` (BFS on the code's table).
fn path_to(target: StepState) -> Vec<StepState> {
    let mut prev = std::collections::HashMap::new();
    let mut q = VecDeque::from([StepState::Pending]);
    while let Some(s) = q.pop_front() {
        if s == target {
            break;
        }
        for t in StepState::ALL {
            if s.can_transition_to(t) && !prev.contains_key(&t) && t != StepState::Pending {
                prev.insert(t, s);
                q.push_back(t);
            }
        }
    }
    let mut path = vec![target];
    let mut cur = target;
    while cur != StepState::Pending {
        cur = prev[&cur];
        path.push(cur);
    }
    path.reverse();
    path
}

/// Tries one state update inside a savepoint; the error text if refused.
async fn try_update(
    tx: &mut Transaction<'_, Postgres>,
    table: &str,
    id: Uuid,
    to: &str,
) -> Result<(), String> {
    sqlx::query("SAVEPOINT sp")
        .execute(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
    let r = sqlx::query(&format!(
        "UPDATE durable.{table} SET state = $2 WHERE id = $1"
    ))
    .bind(id)
    .bind(to)
    .execute(&mut **tx)
    .await;
    let end = if r.is_ok() {
        "RELEASE SAVEPOINT sp"
    } else {
        "ROLLBACK TO SAVEPOINT sp"
    };
    sqlx::query(end)
        .execute(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
    r.map(|_| ()).map_err(|e| e.to_string())
}

async fn try_step_update(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    to: StepState,
) -> Result<(), String> {
    try_update(tx, "step_runs", id, to.as_str()).await
}

async fn try_run_update(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    to: RunState,
) -> Result<(), String> {
    try_update(tx, "workflow_runs", id, to.as_str()).await
}

fn spec() -> serde_json::Value {
    json!({"name": "matrix", "steps": [{"name": "a", "executor_kind": "go", "kind": "demo.echo"}]})
}

#[tokio::test]
async fn step_transition_matrix_code_and_database_agree() {
    let t = TestDb::new().await;
    let mut table = String::from("step transitions (row = from, column = to; Y allowed, . refused; code and database agree)\n");
    table.push_str(&format!("{:>17}", ""));
    for to in StepState::ALL {
        table.push_str(&format!(" {:>4}", &to.as_str()[..4]));
    }
    table.push('\n');
    let mut disagreements = Vec::new();
    for from in StepState::ALL {
        table.push_str(&format!("{:>17}", from.as_str()));
        for to in StepState::ALL {
            let mut tx = t.db.pool().begin().await.expect("begin");
            let run: Uuid = sqlx::query_scalar("SELECT durable.submit_run($1)")
                .bind(spec())
                .fetch_one(&mut *tx)
                .await
                .expect("submit");
            let id: Uuid = sqlx::query_scalar("SELECT id FROM durable.step_runs WHERE run_id = $1")
                .bind(run)
                .fetch_one(&mut *tx)
                .await
                .expect("step");
            for s in path_to(from).into_iter().skip(1) {
                try_step_update(&mut tx, id, s).await.unwrap_or_else(|e| {
                    panic!("database refused the allowed path step to {s}: {e}")
                });
            }
            let db_ok = try_step_update(&mut tx, id, to).await;
            tx.rollback().await.expect("rollback");
            let code_ok = from.can_transition_to(to);
            if from == to {
                // not a transition: the database refuses any write to a terminal row
                if from.is_terminal() {
                    assert!(
                        db_ok.is_err(),
                        "the database let terminal {from} be rewritten"
                    );
                }
                table.push_str(&format!(" {:>4}", "-"));
                continue;
            }
            if code_ok != db_ok.is_ok() {
                disagreements.push(format!(
                    "{from} -> {to}: code {code_ok}, database {db_ok:?}"
                ));
            }
            table.push_str(&format!(" {:>4}", if code_ok { "Y" } else { "." }));
        }
        table.push('\n');
    }
    println!("{table}");
    assert!(
        disagreements.is_empty(),
        "code and database disagree: {disagreements:#?}"
    );
}

#[tokio::test]
async fn run_transition_matrix_code_and_database_agree() {
    let t = TestDb::new().await;
    let paths: &[(RunState, &[RunState])] = &[
        (RunState::Pending, &[]),
        (RunState::Running, &[RunState::Running]),
        (
            RunState::Succeeded,
            &[RunState::Running, RunState::Succeeded],
        ),
        (RunState::Failed, &[RunState::Running, RunState::Failed]),
        (RunState::Cancelled, &[RunState::Cancelled]),
    ];
    let mut table = String::from("run transitions (row = from, column = to)\n");
    let mut disagreements = Vec::new();
    for (from, path) in paths {
        table.push_str(&format!("{:>10}", from.as_str()));
        for to in RunState::ALL {
            let mut tx = t.db.pool().begin().await.expect("begin");
            let run: Uuid = sqlx::query_scalar("SELECT durable.submit_run($1)")
                .bind(spec())
                .fetch_one(&mut *tx)
                .await
                .expect("submit");
            for s in *path {
                try_run_update(&mut tx, run, *s)
                    .await
                    .expect("allowed run path");
            }
            let db_ok = try_run_update(&mut tx, run, to).await;
            tx.rollback().await.expect("rollback");
            if *from == to {
                if from.is_terminal() {
                    assert!(db_ok.is_err(), "terminal run {from} rewritten");
                }
                table.push_str(&format!(" {:>9}", "-"));
                continue;
            }
            let code_ok = from.can_transition_to(to);
            if code_ok != db_ok.is_ok() {
                disagreements.push(format!(
                    "{from} -> {to}: code {code_ok}, database {db_ok:?}"
                ));
            }
            table.push_str(&format!(" {:>9}", if code_ok { to.as_str() } else { "." }));
        }
        table.push('\n');
    }
    println!("{table}");
    assert!(disagreements.is_empty(), "{disagreements:#?}");
}

/// Drives a step along allowed transitions to a terminal state, as a worker would.
async fn drive(t: &TestDb, id: Uuid, to: StepState) -> bool {
    let cur: String = sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE id = $1")
        .bind(id)
        .fetch_one(t.db.pool())
        .await
        .expect("state");
    let cur: StepState = cur.parse().expect("state");
    if cur.is_terminal() {
        return false;
    }
    let path: Vec<StepState> = match to {
        StepState::Succeeded => vec![StepState::Leased, StepState::Running, StepState::Succeeded],
        StepState::TerminalFailed => vec![
            StepState::Leased,
            StepState::Running,
            StepState::TerminalFailed,
        ],
        StepState::Cancelled => vec![StepState::Cancelled],
        other => panic!("not terminal: {other}"),
    };
    for s in path
        .into_iter()
        .filter(|s| cur.can_transition_to(*s) || *s != StepState::Leased)
    {
        if s == cur {
            continue;
        }
        sqlx::query("UPDATE durable.step_runs SET state = $2 WHERE id = $1")
            .bind(id)
            .bind(s.as_str())
            .execute(t.db.pool())
            .await
            .unwrap_or_else(|e| panic!("drive to {s}: {e}"));
    }
    true
}

#[tokio::test]
async fn every_combination_of_step_outcomes_reaches_only_allowed_run_states() {
    let t = TestDb::new().await;
    let outcomes = [
        StepState::Succeeded,
        StepState::TerminalFailed,
        StepState::Cancelled,
    ];
    let mut lines = Vec::new();
    for a in outcomes {
        for b in outcomes {
            for c in outcomes {
                let run = t
                    .submit(json!({"name": "combo", "steps": [
                        {"name": "a", "executor_kind": "go", "kind": "k"},
                        {"name": "b", "executor_kind": "go", "kind": "k"},
                        {"name": "c", "executor_kind": "go", "kind": "k"},
                        {"name": "d", "executor_kind": "go", "kind": "k", "depends_on": ["a", "b"]}
                    ]}))
                    .await;
                let st = t.status(run).await;
                for (name, to) in [("a", a), ("b", b), ("c", c)] {
                    let id = tests::step(&st, name).step_run_id;
                    drive(&t, id, to).await;
                    let now = t.status(run).await;
                    assert!(
                        !matches!(now.state.as_str(), "succeeded")
                            || now.steps.iter().all(|s| s.state == "succeeded")
                    );
                }
                // d exists only if a and b succeeded; finish it as succeeded
                let st = t.status(run).await;
                if let Some(d) = st.steps.iter().find(|s| s.name == "d") {
                    drive(&t, d.step_run_id, StepState::Succeeded).await;
                }
                let st = t.status(run).await;
                let states: Vec<StepState> = st
                    .steps
                    .iter()
                    .map(|s| s.state.parse().expect("state"))
                    .collect();
                let expected = aggregate_run(RunState::Running, &states, !st.waiting.is_empty());
                assert!(
                    states.iter().all(|s| s.is_terminal()),
                    "{a} {b} {c}: open steps remain: {states:?}"
                );
                assert_eq!(st.state, expected.as_str(), "{a} {b} {c}: steps {states:?}");
                // every run transition recorded is in the table
                let rows: Vec<(Option<String>, String)> = sqlx::query_as(
                    "SELECT from_state, to_state FROM durable.transitions WHERE run_id = $1 AND step_run_id IS NULL ORDER BY id",
                )
                .bind(run)
                .fetch_all(t.db.pool())
                .await
                .expect("transitions");
                for (from, to) in &rows {
                    if let Some(from) = from {
                        let (f, to2): (RunState, RunState) =
                            (from.parse().expect("from"), to.parse().expect("to"));
                        assert!(
                            f.can_transition_to(to2),
                            "illegal recorded run transition {f} -> {to2}"
                        );
                    }
                }
                let path: Vec<&str> = rows.iter().map(|(_, to)| to.as_str()).collect();
                lines.push(format!(
                    "a={a:<15} b={b:<15} c={c:<15} -> run {:<9} via {}",
                    st.state,
                    path.join(" → ")
                ));
            }
        }
    }
    println!("{}", lines.join("\n"));
}

#[tokio::test]
async fn terminal_rows_never_change_and_history_is_recorded() {
    let t = TestDb::new().await;
    let run = t.submit(spec()).await;
    let id = t.status(run).await.steps[0].step_run_id;
    drive(&t, id, StepState::Succeeded).await;
    let err = sqlx::query("UPDATE durable.step_runs SET output = '{}' WHERE id = $1")
        .bind(id)
        .execute(t.db.pool())
        .await
        .expect_err("a terminal row must refuse any change");
    assert!(
        err.to_string().contains("terminal step never changes"),
        "{err}"
    );
    let err = sqlx::query("UPDATE durable.workflow_runs SET name = 'x' WHERE id = $1")
        .bind(run)
        .execute(t.db.pool())
        .await
        .expect_err("a terminal run must refuse any change");
    assert!(
        err.to_string().contains("terminal run never changes"),
        "{err}"
    );
    let n = t
        .scalar_i64(&format!(
            "SELECT count(*) FROM durable.transitions WHERE step_run_id = '{id}'"
        ))
        .await;
    assert_eq!(n, 4, "pending, leased, running, succeeded");
}
