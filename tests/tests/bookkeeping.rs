//! Issue 7 item 2: bookkeeping in O(1) per transition. The run counters, the
//! dependency counters and the history written once per statement are checked
//! against a full recount after every operation of random runs (leases,
//! starts, completions, retryable and terminal failures with sibling
//! cancellation, refusals, releases, cancels, reclaims, heartbeats, events);
//! a 1,000-step fan-out/fan-in creates its sink exactly once; the lease writes
//! no run row and a plain event no step row.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::Row;
use supervisor::db::{Db, DbError, LeasedStep, NewEvent};
use supervisor::state::{aggregate_run, RunState, StepState};
use tests::TestDb;
use uuid::Uuid;

async fn worker(db: &Db, name: &str) -> Uuid {
    let id = Uuid::new_v4();
    db.register_worker(id, name, "test", &json!([]))
        .await
        .expect("register");
    id
}

/// Every run's counters, every definition's dependency counter and every
/// step's history against a full recount; the counters' decision against the
/// array form and against `state::aggregate_run`. Panics naming the first
/// difference, after `what`.
async fn check_books(db: &Db, what: &str) {
    let runs = sqlx::query(
        "SELECT r.id, r.state, r.steps_total, r.steps_succeeded, r.steps_failed, r.steps_cancelled,
                r.defs_waiting, durable.run_state_from_counters(r) AS from_counters,
                c.total, c.succeeded, c.failed, c.cancelled, c.states, w.waiting,
                durable.aggregate_run_state(r.state, c.states, w.waiting > 0) AS from_recount
           FROM durable.workflow_runs r
           CROSS JOIN LATERAL (
               SELECT count(*)::int AS total,
                      count(*) FILTER (WHERE s.state = 'succeeded')::int AS succeeded,
                      count(*) FILTER (WHERE s.state = 'terminal_failed')::int AS failed,
                      count(*) FILTER (WHERE s.state = 'cancelled')::int AS cancelled,
                      coalesce(array_agg(s.state), '{}') AS states
                 FROM durable.step_runs s WHERE s.run_id = r.id) c
           CROSS JOIN LATERAL (
               SELECT count(*)::int AS waiting FROM durable.step_defs d
                WHERE d.run_id = r.id
                  AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)) w",
    )
    .fetch_all(db.pool())
    .await
    .expect("recount runs");
    for r in &runs {
        let id: Uuid = r.get("id");
        for (counter, recount) in [
            ("steps_total", "total"),
            ("steps_succeeded", "succeeded"),
            ("steps_failed", "failed"),
            ("steps_cancelled", "cancelled"),
            ("defs_waiting", "waiting"),
        ] {
            assert_eq!(
                r.get::<i32, _>(counter),
                r.get::<i32, _>(recount),
                "{what}: run {id}: {counter} differs from the recount"
            );
        }
        let state: String = r.get("state");
        let from_counters: String = r.get("from_counters");
        let from_recount: String = r.get("from_recount");
        assert_eq!(
            from_counters, from_recount,
            "{what}: run {id} ({state}): the counters decide differently from the recount"
        );
        let states: Vec<StepState> = r
            .get::<Vec<String>, _>("states")
            .iter()
            .map(|s| s.parse().expect("step state"))
            .collect();
        let spec = aggregate_run(
            state.parse().expect("run state"),
            &states,
            r.get::<i32, _>("waiting") > 0,
        );
        assert_eq!(
            from_recount,
            spec.as_str(),
            "{what}: run {id}: SQL and state::aggregate_run disagree"
        );
    }
    let bad_deps: Vec<(Uuid, String, i32, i64)> = sqlx::query_as(
        "SELECT d.run_id, d.name, d.deps_remaining, x.n FROM durable.step_defs d
          CROSS JOIN LATERAL (
              SELECT count(*) AS n FROM unnest(d.depends_on) AS dep(name)
               WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                  WHERE s.run_id = d.run_id AND s.name = dep.name AND s.state = 'succeeded')) x
         WHERE d.deps_remaining <> x.n",
    )
    .fetch_all(db.pool())
    .await
    .expect("recount dependencies");
    assert!(
        bad_deps.is_empty(),
        "{what}: deps_remaining differs: {bad_deps:?}"
    );
    // a ready definition (all dependencies succeeded) of a run without a
    // failure or cancel request has its step
    let missing: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT d.run_id, d.name FROM durable.step_defs d JOIN durable.workflow_runs r ON r.id = d.run_id
          WHERE d.deps_remaining = 0 AND NOT r.cancel_requested AND r.steps_failed = 0
            AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)",
    )
    .fetch_all(db.pool())
    .await
    .expect("ready definitions");
    assert!(
        missing.is_empty(),
        "{what}: ready definitions without a step: {missing:?}"
    );
    // history: per step, a chain from creation to its current state, each
    // change exactly once
    let rows: Vec<(Uuid, String, Option<String>, String)> = sqlx::query_as(
        "SELECT s.id, s.state, t.from_state, t.to_state FROM durable.step_runs s
           JOIN durable.transitions t ON t.step_run_id = s.id ORDER BY s.id, t.id",
    )
    .fetch_all(db.pool())
    .await
    .expect("history");
    let mut chains: BTreeMap<Uuid, (String, Vec<Change>)> = BTreeMap::new();
    for (id, state, from, to) in rows {
        chains
            .entry(id)
            .or_insert_with(|| (state, Vec::new()))
            .1
            .push((from, to));
    }
    let steps = tests_step_count(db).await;
    assert_eq!(chains.len() as i64, steps, "{what}: a step without history");
    for (id, (state, chain)) in chains {
        assert_eq!(
            chain[0],
            (None, "pending".to_string()),
            "{what}: step {id}: history does not start with its creation: {chain:?}"
        );
        for w in chain.windows(2) {
            assert_eq!(
                w[1].0.as_deref(),
                Some(w[0].1.as_str()),
                "{what}: step {id}: history is not one chain: {chain:?}"
            );
        }
        assert_eq!(
            chain.last().map(|c| c.1.as_str()),
            Some(state.as_str()),
            "{what}: step {id}: history ends elsewhere than its state: {chain:?}"
        );
    }
}

/// A step of a run still open: (run state, step state, attempt, cancel requested, next attempt at).
type OpenStep = (
    String,
    String,
    i32,
    bool,
    Option<chrono::DateTime<chrono::Utc>>,
);

/// One history row of a step: (from, to).
type Change = (Option<String>, String);

async fn tests_step_count(db: &Db) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable.step_runs")
        .fetch_one(db.pool())
        .await
        .expect("count")
}

/// A random DAG of 1..=8 steps, edges only to earlier steps; retries at once.
fn random_spec(rng: &mut StdRng, i: usize) -> serde_json::Value {
    let n = rng.random_range(1..=8);
    let steps: Vec<serde_json::Value> = (0..n)
        .map(|j| {
            let deps: Vec<String> = (0..j)
                .filter(|_| rng.random_bool(0.3))
                .map(|d| format!("s{d}"))
                .collect();
            json!({"name": format!("s{j}"), "executor_kind": "go", "kind": "k", "depends_on": deps,
                   "retry": {"max_attempts": 3, "initial_interval_ms": 0}})
        })
        .collect();
    json!({"name": format!("random-{i}"), "steps": steps})
}

/// A lease write's outcome: Ok, or the lease is gone (another path moved the step on).
fn lost_is_fine<T>(r: Result<T, DbError>, what: &str) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(DbError::LeaseLost { .. }) => None,
        Err(e) => panic!("{what}: {e}"),
    }
}

#[tokio::test]
async fn counters_equal_a_full_recount_after_random_transitions() {
    let t = TestDb::new().await;
    let seed = std::env::var("BOOKKEEPING_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(rand::random::<u32>()));
    println!("seed {seed} (BOOKKEEPING_SEED={seed} repeats it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let wid = worker(&t.db, "w").await;
    let mut runs = Vec::new();
    for i in 0..24 {
        runs.push((t.submit(random_spec(&mut rng, i)).await, i));
    }
    check_books(&t.db, "after submit").await;
    let ttl = Duration::from_secs(30);
    let mut held: Vec<(LeasedStep, bool)> = Vec::new(); // (lease, running)
    let mut ops: BTreeMap<&str, u32> = BTreeMap::new();
    for op_no in 0..500 {
        let pick = rng.random_range(0..100);
        let op = if held.is_empty() || pick < 25 {
            "lease"
        } else if pick < 38 {
            "start"
        } else if pick < 58 {
            "complete"
        } else if pick < 66 {
            "fail_retryable"
        } else if pick < 71 {
            "fail_terminal"
        } else if pick < 75 {
            "refuse"
        } else if pick < 78 {
            "release"
        } else if pick < 81 {
            "confirm_cancelled"
        } else if pick < 85 {
            "reclaim"
        } else if pick < 90 {
            "heartbeat"
        } else if pick < 94 {
            "event"
        } else if pick < 98 {
            "cancel_step"
        } else {
            "cancel_run"
        };
        *ops.entry(op).or_default() += 1;
        let k = if held.is_empty() {
            0
        } else {
            rng.random_range(0..held.len())
        };
        match op {
            "lease" => {
                let n = rng.random_range(1..=4);
                for l in
                    t.db.lease(wid, "w", &tests::route_go_k(), n, ttl)
                        .await
                        .expect("lease")
                {
                    held.push((l, false));
                }
            }
            "start" => {
                let (l, running) = &mut held[k];
                if lost_is_fine(
                    t.db.mark_running(&l.lease, "w", 1, &tests::accepted_event())
                        .await,
                    "start",
                )
                .is_some()
                {
                    *running = true;
                }
            }
            "complete" => {
                let (l, _) = held.swap_remove(k);
                lost_is_fine(
                    t.db.complete(&l.lease, "w", &json!({"ok": 1}), &[], Some(9))
                        .await,
                    "complete",
                );
            }
            "fail_retryable" | "fail_terminal" => {
                let (l, _) = held.swap_remove(k);
                lost_is_fine(
                    t.db.fail(
                        &l.lease,
                        "w",
                        &tests::failure_x(op == "fail_retryable"),
                        0.5,
                    )
                    .await,
                    "fail",
                );
            }
            "refuse" => {
                // a cancel-requested step's refusal cancels it (it would
                // never be leased again): the drain below checks every run ends
                if !held[k].1 {
                    let (l, _) = held.swap_remove(k);
                    lost_is_fine(
                        t.db.refuse(&l.lease, "w", "ROUTE", "no", Duration::ZERO, 2)
                            .await,
                        "refuse",
                    );
                }
            }
            "release" => {
                let (l, _) = held.swap_remove(k);
                lost_is_fine(t.db.release(&l.lease, "w", "drain").await, "release");
            }
            "confirm_cancelled" => {
                let (l, _) = held.swap_remove(k);
                lost_is_fine(
                    t.db.confirm_cancelled(&l.lease, "w", "stopped").await,
                    "confirm_cancelled",
                );
            }
            "reclaim" => {
                let (l, _) = held.swap_remove(k);
                sqlx::query(
                    "UPDATE durable.step_runs SET lease_expires_at = now() - interval '1 second'
                      WHERE id = $1 AND state IN ('leased', 'running')",
                )
                .bind(l.lease.step_run_id())
                .execute(t.db.pool())
                .await
                .expect("expire");
                t.db.reclaim_expired("reclaimer", 10)
                    .await
                    .expect("reclaim");
            }
            "heartbeat" => {
                let leases: Vec<_> = held.iter().map(|(l, _)| l.lease.clone()).collect();
                let before = tests_transition_count(&t.db).await;
                t.db.heartbeat(wid, &leases, ttl).await.expect("heartbeat");
                assert_eq!(
                    tests_transition_count(&t.db).await,
                    before,
                    "a heartbeat writes no history"
                );
            }
            "event" => {
                let (l, _) = &held[k];
                let cp = [1u8, 2, 3];
                let ev = NewEvent {
                    sequence: 100 + op_no,
                    kind: "progress",
                    message: "p",
                    fraction: Some(0.5),
                    checkpoint: rng.random_bool(0.5).then_some(&cp[..]),
                    executor_at: None,
                };
                lost_is_fine(t.db.record_event(&l.lease, &ev).await, "event");
            }
            "cancel_step" | "cancel_run" => {
                let (run, i) = runs[rng.random_range(0..runs.len())];
                let names: Vec<String> = sqlx::query_scalar(
                    "SELECT name FROM durable.step_defs WHERE run_id = $1 ORDER BY position",
                )
                .bind(run)
                .fetch_all(t.db.pool())
                .await
                .expect("names");
                let name = &names[rng.random_range(0..names.len())];
                let step = (op == "cancel_step").then_some(name.as_str());
                t.db.cancel(run, step)
                    .await
                    .unwrap_or_else(|e| panic!("cancel run {i}: {e}"));
            }
            _ => unreachable!(),
        }
        check_books(&t.db, &format!("op {op_no} ({op})")).await;
    }
    // drain: everything runs to its end; every run ends terminal, as the
    // aggregation says
    for round in 0.. {
        assert!(round < 200, "runs did not finish");
        for (l, _) in held.drain(..) {
            lost_is_fine(
                t.db.complete(&l.lease, "w", &json!({}), &[], None).await,
                "drain",
            );
        }
        let open: i64 = t.db.open_runs().await.expect("open runs");
        if open == 0 {
            break;
        }
        for l in
            t.db.lease(wid, "w", &tests::route_go_k(), 50, ttl)
                .await
                .expect("lease")
        {
            held.push((l, false));
        }
        check_books(&t.db, &format!("drain round {round}")).await;
    }
    check_books(&t.db, "at the end").await;
    for (run, i) in runs {
        let st = t.status(run).await;
        let states: Vec<StepState> = st.steps.iter().map(|s| s.state.parse().unwrap()).collect();
        let want = aggregate_run(RunState::Running, &states, !st.waiting.is_empty());
        assert_eq!(st.state, want.as_str(), "run {i}: {states:?}");
    }
    println!("operations: {ops:?}");
}

async fn tests_transition_count(db: &Db) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable.transitions")
        .fetch_one(db.pool())
        .await
        .expect("count")
}

/// root → 998 parallel steps → sink: the sink is created exactly once, when
/// the last of its 998 dependencies succeeds, and the books hold.
#[tokio::test]
async fn a_thousand_step_fan_out_fan_in_creates_its_sink_once() {
    let t = TestDb::new().await;
    let mid: Vec<String> = (0..998).map(|i| format!("m{i}")).collect();
    let mut steps = vec![json!({"name": "root", "executor_kind": "go", "kind": "k"})];
    steps.extend(
        mid.iter().map(
            |m| json!({"name": m, "executor_kind": "go", "kind": "k", "depends_on": ["root"]}),
        ),
    );
    steps.push(json!({"name": "sink", "executor_kind": "go", "kind": "k", "depends_on": mid}));
    let run = t.submit(json!({"name": "fan", "steps": steps})).await;
    let wid = worker(&t.db, "w").await;
    let ttl = Duration::from_secs(60);
    let mut completed = 0usize;
    let mut times = Vec::new();
    loop {
        let leased =
            t.db.lease(wid, "w", &tests::route_go_k(), 100, ttl)
                .await
                .expect("lease");
        if leased.is_empty() {
            break;
        }
        for l in leased {
            let sink_before: i64 = t
                .scalar_i64(&format!(
                    "SELECT count(*) FROM durable.step_runs WHERE run_id = '{run}' AND name = 'sink'"
                ))
                .await;
            assert_eq!(
                sink_before,
                i64::from(l.name == "sink"),
                "the sink exists exactly when all 998 dependencies succeeded ({completed} done)"
            );
            t.db.mark_running(&l.lease, "w", 1, &tests::accepted_event())
                .await
                .expect("start");
            let t0 = Instant::now();
            t.db.complete(&l.lease, "w", &json!({}), &[], Some(2))
                .await
                .expect("complete");
            times.push(t0.elapsed());
            completed += 1;
        }
    }
    assert_eq!(completed, 1000);
    let st = t.status(run).await;
    assert_eq!(st.state, "succeeded");
    let sink_created = t
        .scalar_i64(&format!(
            "SELECT count(*) FROM durable.transitions t JOIN durable.step_runs s ON s.id = t.step_run_id
              WHERE s.run_id = '{run}' AND s.name = 'sink' AND t.to_state = 'pending'"
        ))
        .await;
    assert_eq!(sink_created, 1, "the sink is created once");
    check_books(&t.db, "fan-out/fan-in").await;
    let ms = |d: &[Duration]| d.iter().map(|d| d.as_secs_f64() * 1e3).sum::<f64>() / d.len() as f64;
    println!(
        "complete round trip: root {:.2} ms (creates 998 steps), first 100 middles {:.2} ms, last 100 middles {:.2} ms, sink {:.2} ms",
        ms(&times[..1]),
        ms(&times[1..101]),
        ms(&times[899..999]),
        ms(&times[999..])
    );
}

/// The lease writes no run row (and so takes no run lock: it goes through
/// while another transaction holds the run FOR NO KEY UPDATE), the heartbeat
/// writes no history, a plain event does not rewrite the step row, a
/// checkpoint does but records no transition; a multi-row statement writes
/// one history row per changed step.
#[tokio::test]
async fn each_write_touches_only_what_it_changes() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "touch", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k"},
            {"name": "c", "executor_kind": "go", "kind": "k"},
            {"name": "d", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await;
    let wid = worker(&t.db, "w").await;
    let run_xmin = |db: Db| async move {
        sqlx::query_scalar::<_, String>(
            "SELECT xmin::text FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(run)
        .fetch_one(db.pool())
        .await
        .expect("xmin")
    };
    let x0 = run_xmin(t.db.clone()).await;
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM durable.workflow_runs WHERE id = $1 FOR NO KEY UPDATE")
        .bind(run)
        .execute(&mut *holder)
        .await
        .expect("hold the run");
    let leased = tokio::time::timeout(
        Duration::from_secs(10),
        t.db.lease(wid, "w", &tests::route_go_k(), 2, Duration::from_secs(30)),
    )
    .await
    .expect("the lease does not wait on the run's lock")
    .expect("lease");
    assert_eq!(leased.len(), 2);
    holder.rollback().await.expect("release the run");
    assert_eq!(
        run_xmin(t.db.clone()).await,
        x0,
        "the lease wrote the run row"
    );
    for l in &leased {
        let n: Vec<(Option<String>, String)> = sqlx::query_as(
            "SELECT from_state, to_state FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
        )
        .bind(l.lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("history");
        assert_eq!(
            n,
            vec![
                (None, "pending".into()),
                (Some("pending".into()), "leased".into())
            ]
        );
    }
    let leases: Vec<_> = leased.iter().map(|l| l.lease.clone()).collect();
    let h0 = tests_transition_count(&t.db).await;
    t.db.heartbeat(wid, &leases, Duration::from_secs(30))
        .await
        .expect("heartbeat");
    assert_eq!(tests_transition_count(&t.db).await, h0, "heartbeat history");

    let first = &leased[0];
    let step_xmin = || async {
        sqlx::query_scalar::<_, String>("SELECT xmin::text FROM durable.step_runs WHERE id = $1")
            .bind(first.lease.step_run_id())
            .fetch_one(t.db.pool())
            .await
            .expect("xmin")
    };
    let s0 = step_xmin().await;
    let plain = NewEvent {
        sequence: 5,
        kind: "progress",
        message: "half",
        fraction: Some(0.5),
        checkpoint: None,
        executor_at: None,
    };
    t.db.record_event(&first.lease, &plain)
        .await
        .expect("event");
    assert_eq!(step_xmin().await, s0, "a plain event rewrote the step row");
    let cp = NewEvent {
        sequence: 6,
        checkpoint: Some(b"cp"),
        ..plain
    };
    t.db.record_event(&first.lease, &cp)
        .await
        .expect("checkpoint");
    assert_ne!(step_xmin().await, s0, "a checkpoint is stored on the step");
    assert_eq!(tests_transition_count(&t.db).await, h0, "event history");

    // one statement cancels the pending root and the waiting `d` (created
    // for it) and flags the two leased ones: a history row per changed step
    let last: i64 = sqlx::query_scalar("SELECT max(id) FROM durable.transitions")
        .fetch_one(t.db.pool())
        .await
        .expect("max id");
    t.db.cancel(run, None).await.expect("cancel");
    let rows: Vec<(String, Option<String>, String)> = sqlx::query_as(
        "SELECT s.name, t.from_state, t.to_state FROM durable.transitions t
           JOIN durable.step_runs s ON s.id = t.step_run_id
          WHERE t.id > $1 ORDER BY t.id",
    )
    .bind(last)
    .fetch_all(t.db.pool())
    .await
    .expect("cancel history");
    let leased_names: Vec<&str> = leased.iter().map(|l| l.name.as_str()).collect();
    let root = ["a", "b", "c"]
        .into_iter()
        .find(|n| !leased_names.contains(n))
        .expect("one root left pending");
    let mut cancelled: Vec<&str> = rows
        .iter()
        .filter(|r| r.1.as_deref() == Some("pending") && r.2 == "cancelled")
        .map(|r| r.0.as_str())
        .collect();
    cancelled.sort();
    let mut want = vec![root, "d"];
    want.sort();
    assert_eq!(cancelled, want, "{rows:?}");
    assert_eq!(rows.len(), 3, "d's creation and two cancels: {rows:?}");
    check_books(&t.db, "after the cancel").await;
}

/// The ledger's batches write starts and completions as set-based statements
/// (one UPDATE per batch, the step triggers once per batch): random batches of
/// random runs, some completions with their start in the same batch, some
/// whose start never was written, some fenced out (a stale token), interleaved
/// with cancels. After every batch the counters, dependency counters and the
/// history match a full recount, and every answer is the one the fence says.
#[tokio::test]
async fn counters_equal_a_full_recount_after_batched_writes() {
    use supervisor::db::{Batch, CompleteWrite, EventsWrite, OwnedEvent, RowOutcome, StartWrite};
    let t = TestDb::new().await;
    let seed = std::env::var("BOOKKEEPING_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(rand::random::<u32>()));
    println!("seed {seed} (BOOKKEEPING_SEED={seed} repeats it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let wid = worker(&t.db, "w").await;
    let mut runs = Vec::new();
    for i in 0..16 {
        runs.push(t.submit(random_spec(&mut rng, i)).await);
    }
    let ttl = Duration::from_secs(30);
    let ev = |seq: u64, kind: &'static str| OwnedEvent {
        sequence: seq,
        kind,
        message: String::new(),
        fraction: None,
        executor_at: None,
    };
    let mut held: Vec<(LeasedStep, bool)> = Vec::new(); // (lease, started)
    for round in 0.. {
        if round >= 300 {
            let open: Vec<OpenStep> = sqlx::query_as(
                "SELECT r.state, s.state, s.attempt, s.cancel_requested, s.next_attempt_at FROM durable.step_runs s
                   JOIN durable.workflow_runs r ON r.id = s.run_id
                  WHERE NOT durable.run_state_is_terminal(r.state) ORDER BY r.id, s.position",
            )
            .fetch_all(t.db.pool())
            .await
            .expect("open steps");
            panic!(
                "runs did not finish: held {}, open steps {open:?}",
                held.len()
            );
        }
        if t.db.open_runs().await.expect("open runs") == 0 {
            break;
        }
        let n = rng.random_range(1..=8);
        for l in
            t.db.lease(wid, "w", &tests::route_go_k(), n, ttl)
                .await
                .expect("lease")
        {
            held.push((l, false));
        }
        if rng.random_bool(0.05) {
            let run = runs[rng.random_range(0..runs.len())];
            t.db.cancel(run, None).await.expect("cancel");
        }
        // a random part of what is held: started, completed, or both; a
        // few leases taken over by another owner first (fenced out)
        let mut batch = Batch::default();
        let mut keep = Vec::new();
        let mut stolen = Vec::new();
        for (l, started) in held.drain(..) {
            if rng.random_bool(0.05) {
                sqlx::query("UPDATE durable.step_runs SET lease_token = gen_random_uuid() WHERE id = $1 AND state IN ('leased', 'running')")
                    .bind(l.lease.step_run_id())
                    .execute(t.db.pool())
                    .await
                    .expect("steal");
                stolen.push(l.lease.step_run_id());
            }
            let start = !started && rng.random_bool(0.7);
            let complete = rng.random_bool(0.6);
            if start {
                batch.starts.push(StartWrite {
                    run_id: l.run_id,
                    lease: l.lease.clone(),
                    pid: 1,
                    event: ev(1, "accepted"),
                });
                if rng.random_bool(0.5) {
                    batch.events.push(EventsWrite {
                        lease: l.lease.clone(),
                        events: vec![ev(2, "running")],
                    });
                }
            }
            if complete {
                batch.completes.push(CompleteWrite {
                    run_id: l.run_id,
                    lease: l.lease.clone(),
                    output: json!({"round": round}),
                    sequence: Some(3),
                });
            } else {
                keep.push((l, started || start));
            }
        }
        held = keep;
        // the ledger's order: by (run, step)
        batch
            .starts
            .sort_by_key(|s| (s.run_id, s.lease.step_run_id()));
        batch
            .completes
            .sort_by_key(|c| (c.run_id, c.lease.step_run_id()));
        let mut exp_s = Vec::new();
        for s in &batch.starts {
            exp_s.push(fence_holds(&t.db, &s.lease).await);
        }
        let mut exp_c = Vec::new();
        for c in &batch.completes {
            exp_c.push(fence_holds(&t.db, &c.lease).await);
        }
        let out = t.db.write_batch("w", &batch).await.expect("batch");
        let ok = |f: bool| if f { RowOutcome::Ok } else { RowOutcome::Lost };
        assert_eq!(
            out.starts,
            exp_s.iter().map(|&f| ok(f)).collect::<Vec<_>>(),
            "round {round}: the starts' answers"
        );
        assert_eq!(
            out.completes,
            exp_c.iter().map(|&f| ok(f)).collect::<Vec<_>>(),
            "round {round}: the completions' answers"
        );
        for c in batch.completes.iter().zip(&exp_c).filter(|(_, f)| **f) {
            let state: String =
                sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE id = $1")
                    .bind(c.0.lease.step_run_id())
                    .fetch_one(t.db.pool())
                    .await
                    .expect("state");
            assert_eq!(state, "succeeded", "round {round}: a completion that held");
        }
        check_books(&t.db, &format!("batch round {round}")).await;
        // what was taken over or cancelled meanwhile moves on by the reclaim
        let mut still = Vec::new();
        for (l, started) in held.drain(..) {
            if fence_holds(&t.db, &l.lease).await {
                still.push((l, started));
            }
        }
        held = still;
        for id in stolen {
            sqlx::query(
                "UPDATE durable.step_runs SET lease_expires_at = now() - interval '1 second'
                  WHERE id = $1 AND state IN ('leased', 'running')",
            )
            .bind(id)
            .execute(t.db.pool())
            .await
            .expect("expire");
        }
        t.db.reclaim_expired("reclaimer", 100)
            .await
            .expect("reclaim");
        check_books(&t.db, &format!("after the reclaim of round {round}")).await;
    }
    for run in runs {
        let st = t.status(run).await;
        let states: Vec<StepState> = st.steps.iter().map(|s| s.state.parse().unwrap()).collect();
        let want = aggregate_run(RunState::Running, &states, !st.waiting.is_empty());
        assert_eq!(st.state, want.as_str(), "run {run}: {states:?}");
    }
}

/// Whether a write with `lease` would be fenced in right now.
async fn fence_holds(db: &Db, lease: &supervisor::db::Lease) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM durable.step_runs WHERE id = $1 AND lease_token = $2
                           AND state IN ('leased', 'running'))",
    )
    .bind(lease.step_run_id())
    .bind(lease.token())
    .fetch_one(db.pool())
    .await
    .expect("fence")
}

/// A renewal writes the lease clock, not the step row: the lease expiry
/// moves, updated_at does not, and no history is written; but the guard still
/// sees every update of the row it must: a renewal-shaped update of a
/// terminal row or one that also changes an identity column is refused, and
/// no transition is recorded twice when the step moves on.
#[tokio::test]
async fn a_renewal_leaves_the_step_row_alone_and_a_hand_edit_is_still_guarded() {
    let t = TestDb::new().await;
    let wid = worker(&t.db, "w").await;
    let run = t.submit(tests::one_step("r", "go", "k", json!({}))).await;
    let ttl = Duration::from_secs(30);
    let l =
        t.db.lease(wid, "w", &tests::route_go_k(), 1, ttl)
            .await
            .expect("lease");
    let lease = l[0].lease.clone();
    t.db.mark_running(&lease, "w", 1, &tests::accepted_event())
        .await
        .expect("start");
    let row = |db: Db, id: Uuid| async move {
        sqlx::query_as::<
            _,
            (
                chrono::DateTime<chrono::Utc>,
                chrono::DateTime<chrono::Utc>,
                Option<String>,
            ),
        >(
            "SELECT updated_at, durable.lease_expiry(id), prev_state FROM durable.step_runs WHERE id = $1"
        )
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect("row")
    };
    let id = lease.step_run_id();
    let (upd0, exp0, prev0) = row(t.db.clone(), id).await;
    assert_eq!(prev0.as_deref(), Some("leased"), "the start set prev_state");
    // a renewal writes the lease clock, not the step row: the expiry moves,
    // the row (updated_at, prev_state) stays as the start left it
    tokio::time::sleep(Duration::from_millis(20)).await;
    t.db.heartbeat(wid, std::slice::from_ref(&lease), ttl)
        .await
        .expect("hb 1");
    let (upd1, exp1, prev1) = row(t.db.clone(), id).await;
    assert!(exp1 > exp0, "the first renewal moved the expiry");
    assert_eq!(upd1, upd0, "a renewal does not move updated_at");
    assert_eq!(prev1.as_deref(), Some("leased"));
    tokio::time::sleep(Duration::from_millis(20)).await;
    t.db.heartbeat(wid, std::slice::from_ref(&lease), ttl)
        .await
        .expect("hb 2");
    let (upd2, exp2, prev2) = row(t.db.clone(), id).await;
    assert!(exp2 > exp1, "the renewal moved the expiry");
    assert_eq!(upd2, upd1, "a renewal does not move updated_at");
    assert_eq!(prev2.as_deref(), Some("leased"));
    // a renewal-shaped update that also changes an identity column is refused
    let err = sqlx::query(
        "UPDATE durable.step_runs SET lease_expires_at = now() + interval '1 hour', name = 'other' WHERE id = $1",
    )
    .bind(id)
    .execute(t.db.pool())
    .await
    .expect_err("identity change refused");
    assert!(
        err.to_string().contains("identity columns never change"),
        "{err}"
    );
    t.db.complete(&lease, "w", &json!({}), &[], Some(2))
        .await
        .expect("complete");
    // one history row per change, none twice
    let history: Vec<(Option<String>, String)> = sqlx::query_as(
        "SELECT from_state, to_state FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    let history: Vec<(Option<&str>, &str)> = history
        .iter()
        .map(|(f, s)| (f.as_deref(), s.as_str()))
        .collect();
    assert_eq!(
        history,
        vec![
            (None, "pending"),
            (Some("pending"), "leased"),
            (Some("leased"), "running"),
            (Some("running"), "succeeded")
        ]
    );
    // a renewal-shaped update of a terminal row is refused
    let err = sqlx::query(
        "UPDATE durable.step_runs SET lease_expires_at = now() + interval '1 hour' WHERE id = $1",
    )
    .bind(id)
    .execute(t.db.pool())
    .await
    .expect_err("a terminal step never changes");
    assert!(
        err.to_string().contains("a terminal step never changes"),
        "{err}"
    );
    assert_eq!(t.status(run).await.state, "succeeded");
}

/// Run and step ids are time-ordered (UUID version 7): a run submitted later
/// has larger run and step ids, so the indexes keyed by them take new entries
/// on their newest leaves (the FIFO queue's next pages) instead of a random
/// leaf each. (Within one millisecond the order is random.)
#[tokio::test]
async fn run_and_step_ids_are_time_ordered() {
    let t = TestDb::new().await;
    let mut ids: Vec<(Uuid, Uuid)> = Vec::new();
    for i in 0..3 {
        let run = t
            .submit(tests::one_step(&format!("r{i}"), "go", "k", json!({})))
            .await;
        ids.push((run, tests::only_step_id(&t, run).await));
        // the ids' time part counts milliseconds
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for (run, step) in &ids {
        assert_eq!(run.get_version_num(), 7, "run id {run}");
        assert_eq!(step.get_version_num(), 7, "step id {step}");
    }
    for w in ids.windows(2) {
        assert!(w[1].0 > w[0].0, "run ids in submission order: {ids:?}");
        assert!(w[1].1 > w[0].1, "step ids in submission order: {ids:?}");
    }
}

/// Rows of the runs table updated so far by the transaction of `tx`.
async fn run_rows_updated(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(n_tup_upd, 0) FROM pg_stat_xact_user_tables
          WHERE relid = 'durable.workflow_runs'::regclass",
    )
    .fetch_one(tx)
    .await
    .expect("updates of the runs table")
}

/// A start writes its run once, and only while the run is pending; a
/// completion that cascades to nothing (a leaf's success) writes its run
/// once, counters and state together; a batch writes each of its runs once.
/// (Before, a completion wrote its run twice: the counters, then the state.)
#[tokio::test]
async fn each_transition_writes_its_run_once() {
    use supervisor::db::{Batch, CompleteWrite, DbConn, OwnedEvent, StartWrite};
    let t = TestDb::new().await;
    let wid = worker(&t.db, "w").await;
    let step = |name: &str| json!({"name": name, "executor_kind": "go", "kind": "k"});
    let mut singles = Vec::new();
    for i in 0..3 {
        singles.push(
            t.submit(json!({"name": format!("single-{i}"), "steps": [step("s")]}))
                .await,
        );
    }
    let pair = t
        .submit(json!({"name": "pair", "steps": [step("a"), step("b")]}))
        .await;
    let leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 10, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 5);
    let of =
        |run: Uuid| -> Vec<&LeasedStep> { leased.iter().filter(|l| l.run_id == run).collect() };
    let start = |l: &LeasedStep| StartWrite {
        run_id: l.run_id,
        lease: l.lease.clone(),
        pid: 1,
        event: OwnedEvent {
            sequence: 1,
            kind: "accepted",
            message: String::new(),
            fraction: None,
            executor_at: None,
        },
    };
    let complete = |l: &LeasedStep| CompleteWrite {
        run_id: l.run_id,
        lease: l.lease.clone(),
        output: json!({"ok": l.name}),
        sequence: Some(2),
    };
    // the batch in one transaction; the rows of the runs table it updated
    let write = |mut b: Batch| {
        let db = t.db.clone();
        async move {
            b.starts.sort_by_key(|s| (s.run_id, s.lease.step_run_id()));
            b.completes
                .sort_by_key(|c| (c.run_id, c.lease.step_run_id()));
            let mut tx = db.pool().begin().await.expect("begin");
            let n0 = run_rows_updated(&mut tx).await;
            let out = DbConn::new(&mut tx)
                .write_batch("w", &b)
                .await
                .expect("batch");
            assert!(
                out.starts
                    .iter()
                    .chain(&out.completes)
                    .all(|o| *o == supervisor::db::RowOutcome::Ok),
                "{out:?}"
            );
            let n = run_rows_updated(&mut tx).await - n0;
            tx.commit().await.expect("commit");
            n
        }
    };
    let run_state = |run: Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query_as::<_, (String, i32)>(
                "SELECT state, steps_succeeded FROM durable.workflow_runs WHERE id = $1",
            )
            .bind(run)
            .fetch_one(db.pool())
            .await
            .expect("run")
        }
    };

    let s0 = of(singles[0])[0];
    let mut b = Batch::default();
    b.starts.push(start(s0));
    assert_eq!(write(b).await, 1, "the first start of a pending run");
    assert_eq!(run_state(singles[0]).await, ("running".into(), 0));

    let mut b = Batch::default();
    b.starts.extend(of(pair).into_iter().map(start));
    assert_eq!(write(b).await, 1, "two starts of one pending run");

    let mut b = Batch::default();
    b.starts.push(start(of(singles[1])[0]));
    b.starts.push(start(of(singles[2])[0]));
    assert_eq!(write(b).await, 2, "the starts of two pending runs");

    let mut b = Batch::default();
    b.completes.push(complete(s0));
    assert_eq!(write(b).await, 1, "a run's last step succeeds");
    assert_eq!(run_state(singles[0]).await, ("succeeded".into(), 1));

    let pair_steps = of(pair);
    let mut b = Batch::default();
    b.completes.push(complete(pair_steps[0]));
    assert_eq!(write(b).await, 1, "a step succeeds, its run goes on");
    assert_eq!(run_state(pair).await, ("running".into(), 1));

    let mut b = Batch::default();
    b.completes.push(complete(pair_steps[1]));
    b.completes.push(complete(of(singles[1])[0]));
    b.completes.push(complete(of(singles[2])[0]));
    assert_eq!(write(b).await, 3, "three runs' last steps in one batch");
    for run in [pair, singles[1], singles[2]] {
        assert_eq!(run_state(run).await.0, "succeeded");
    }
    let history: Vec<(Option<String>, String, String)> = sqlx::query_as(
        "SELECT from_state, to_state, reason FROM durable.transitions
          WHERE run_id = $1 AND step_run_id IS NULL ORDER BY id",
    )
    .bind(pair)
    .fetch_all(t.db.pool())
    .await
    .expect("run history");
    let history: Vec<(Option<&str>, &str)> = history
        .iter()
        .map(|(f, to, _)| (f.as_deref(), to.as_str()))
        .collect();
    assert_eq!(
        history,
        vec![
            (None, "pending"),
            (Some("pending"), "running"),
            (Some("running"), "succeeded")
        ]
    );
    check_books(&t.db, "after the writes").await;
}

/// Rows of `table` updated so far by the transaction of `tx`.
async fn rows_updated(tx: &mut sqlx::PgConnection, table: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(n_tup_upd, 0) FROM pg_stat_xact_user_tables WHERE relid = $1::regclass",
    )
    .bind(table)
    .fetch_one(tx)
    .await
    .expect("updates of the table")
}

/// The start of a lease as the ledger writes it: executor 4242, its
/// ACCEPTED event (sequence 1).
fn start_write(l: &LeasedStep) -> supervisor::db::StartWrite {
    supervisor::db::StartWrite {
        run_id: l.run_id,
        lease: l.lease.clone(),
        pid: 4242,
        event: supervisor::db::OwnedEvent {
            sequence: 1,
            kind: "accepted",
            message: String::new(),
            fraction: None,
            executor_at: None,
        },
    }
}

/// The success of a lease with `output`, its terminal event sequence 2.
fn complete_write(l: &LeasedStep, output: serde_json::Value) -> supervisor::db::CompleteWrite {
    supervisor::db::CompleteWrite {
        run_id: l.run_id,
        lease: l.lease.clone(),
        output,
        sequence: Some(2),
    }
}

/// Writes `b` as worker "w" in the transaction of `tx`; every start and
/// completion of it must be written.
async fn write_batch_ok(tx: &mut sqlx::PgConnection, b: &supervisor::db::Batch) {
    let out = supervisor::db::DbConn::new(tx)
        .write_batch("w", b)
        .await
        .expect("batch");
    assert!(
        out.starts
            .iter()
            .chain(&out.completes)
            .all(|o| *o == supervisor::db::RowOutcome::Ok),
        "{out:?}"
    );
}

/// One history row: from, to, reason, worker.
type HopRow = (Option<String>, String, Option<String>, Option<String>);
type HopRef<'a> = (Option<&'a str>, &'a str, Option<&'a str>, Option<&'a str>);

/// A start and the completion of the same lease in one batch (a no-op job
/// ends before its start's flush is sent) are one write of the step, from
/// leased through running to succeeded, and one write of its run, from
/// pending through running to succeeded. The history still has a row per
/// hop, in order, with the start's reason; the start's fields are written.
/// (Before, the pair was two writes of the step and, for a one-step run,
/// two of the run.) A run with more to do goes running in that one write.
#[tokio::test]
async fn a_start_and_its_completion_in_one_batch_are_one_write() {
    use supervisor::db::Batch;
    let t = TestDb::new().await;
    let wid = worker(&t.db, "w").await;
    let step = |name: &str| json!({"name": name, "executor_kind": "go", "kind": "k"});
    let single = t
        .submit(json!({"name": "single", "steps": [step("s")]}))
        .await;
    let pair = t
        .submit(json!({"name": "pair", "steps": [step("a"), step("b")]}))
        .await;
    let leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 10, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 3);
    let start = start_write;
    let complete = |l: &LeasedStep| complete_write(l, json!({"ok": l.name}));
    // a one-step run's pair, and the pair of the first step of a two-step run
    let s = leased.iter().find(|l| l.run_id == single).expect("s");
    let a = leased
        .iter()
        .find(|l| l.run_id == pair && l.name == "a")
        .expect("a");
    let mut b = Batch {
        starts: vec![start(s), start(a)],
        completes: vec![complete(s), complete(a)],
        ..Default::default()
    };
    b.starts.sort_by_key(|s| (s.run_id, s.lease.step_run_id()));
    b.completes
        .sort_by_key(|c| (c.run_id, c.lease.step_run_id()));
    let mut tx = t.db.pool().begin().await.expect("begin");
    let steps0 = rows_updated(&mut tx, "durable.step_runs").await;
    let runs0 = rows_updated(&mut tx, "durable.workflow_runs").await;
    write_batch_ok(&mut tx, &b).await;
    let steps = rows_updated(&mut tx, "durable.step_runs").await - steps0;
    let runs = rows_updated(&mut tx, "durable.workflow_runs").await - runs0;
    tx.commit().await.expect("commit");
    assert_eq!(steps, 2, "one write of each step");
    assert_eq!(runs, 2, "one write of each run");

    for l in [s, a] {
        let row = sqlx::query(
            "SELECT state, executor_pid, started_at = finished_at AS one_write, output
               FROM durable.step_runs WHERE id = $1",
        )
        .bind(l.lease.step_run_id())
        .fetch_one(t.db.pool())
        .await
        .expect("step");
        assert_eq!(row.get::<String, _>("state"), "succeeded");
        assert_eq!(row.get::<Option<i32>, _>("executor_pid"), Some(4242));
        assert!(row.get::<bool, _>("one_write"));
        assert_eq!(
            row.get::<serde_json::Value, _>("output"),
            json!({"ok": l.name})
        );
        let history: Vec<HopRow> = sqlx::query_as(
            "SELECT from_state, to_state, reason, worker FROM durable.transitions
                  WHERE step_run_id = $1 ORDER BY id",
        )
        .bind(l.lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("step history");
        let history: Vec<HopRef> = history
            .iter()
            .map(|(f, to, r, w)| (f.as_deref(), to.as_str(), r.as_deref(), w.as_deref()))
            .collect();
        assert_eq!(
            &history[history.len() - 2..],
            &[
                (Some("leased"), "running", Some("ACCEPTED"), Some("w")),
                (Some("running"), "succeeded", Some("SUCCEEDED"), Some("w")),
            ],
            "{history:?}"
        );
        let kinds: Vec<String> = sqlx::query_scalar(
            "SELECT kind FROM durable.step_events WHERE step_run_id = $1 ORDER BY sequence",
        )
        .bind(l.lease.step_run_id())
        .fetch_all(t.db.pool())
        .await
        .expect("events");
        assert_eq!(kinds, ["accepted", "succeeded"]);
    }
    let run_history = |run: Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query_as::<_, (Option<String>, String, Option<String>)>(
                "SELECT from_state, to_state, reason FROM durable.transitions
                  WHERE run_id = $1 AND step_run_id IS NULL ORDER BY id",
            )
            .bind(run)
            .fetch_all(db.pool())
            .await
            .expect("run history")
        }
    };
    let h = run_history(single).await;
    let h: Vec<(Option<&str>, &str, Option<&str>)> = h
        .iter()
        .map(|(f, to, r)| (f.as_deref(), to.as_str(), r.as_deref()))
        .collect();
    assert_eq!(
        &h[1..],
        &[
            (Some("pending"), "running", Some("step s running")),
            (Some("running"), "succeeded", Some("step s succeeded")),
        ],
        "{h:?}"
    );
    let h = run_history(pair).await;
    let h: Vec<(Option<&str>, &str, Option<&str>)> = h
        .iter()
        .map(|(f, to, r)| (f.as_deref(), to.as_str(), r.as_deref()))
        .collect();
    assert_eq!(
        &h[1..],
        &[(Some("pending"), "running", Some("step a running"))],
        "{h:?}"
    );
    let (state, succeeded): (String, i32) =
        sqlx::query_as("SELECT state, steps_succeeded FROM durable.workflow_runs WHERE id = $1")
            .bind(pair)
            .fetch_one(t.db.pool())
            .await
            .expect("pair");
    assert_eq!((state.as_str(), succeeded), ("running", 1));
    check_books(&t.db, "after the fused writes").await;
}

/// The database refuses a write through a state when either hop is
/// illegal, as it refuses the hop itself, and a pass-through that does not
/// end in a terminal state: `via_state` is no way around the transition
/// table, for steps and for runs.
#[tokio::test]
async fn a_write_through_a_state_is_refused_when_either_hop_is_illegal() {
    let t = TestDb::new().await;
    let wid = worker(&t.db, "w").await;
    let run = t
        .submit(json!({"name": "r", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 10, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 1);
    let step = leased[0].lease.step_run_id();
    let refused = |sql: &'static str, id: Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query(sql)
                .bind(id)
                .execute(db.pool())
                .await
                .expect_err(sql)
                .to_string()
        }
    };
    // leased -> leased is no transition
    let err = refused(
        "UPDATE durable.step_runs SET state = 'succeeded', via_state = 'leased' WHERE id = $1",
        step,
    )
    .await;
    assert!(
        err.contains("illegal step transition leased -> leased -> succeeded"),
        "{err}"
    );
    // both hops legal, but the write would not end the step
    let err = refused(
        "UPDATE durable.step_runs SET state = 'retryable_failed', via_state = 'running' WHERE id = $1",
        step,
    )
    .await;
    assert!(err.contains("step_runs_via_state_check"), "{err}");
    // pending -> pending is no run transition
    let err = refused(
        "UPDATE durable.workflow_runs SET state = 'succeeded', via_state = 'pending' WHERE id = $1",
        run,
    )
    .await;
    assert!(
        err.contains("illegal run transition pending -> pending -> succeeded"),
        "{err}"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE id = $1")
        .bind(step)
        .fetch_one(t.db.pool())
        .await
        .expect("state");
    assert_eq!(state, "leased");
    let state: String = sqlx::query_scalar("SELECT state FROM durable.workflow_runs WHERE id = $1")
        .bind(run)
        .fetch_one(t.db.pool())
        .await
        .expect("state");
    assert_eq!(state, "pending");
}

/// Counts the PL/pgSQL functions called in the transaction of `tx` from now on.
async fn track_functions(tx: &mut sqlx::PgConnection) {
    sqlx::query("SET LOCAL track_functions = 'pl'")
        .execute(tx)
        .await
        .expect("track functions");
}

/// A run's `steps_total` and `defs_waiting`, as the transaction of `tx` sees them.
async fn run_counters(tx: &mut sqlx::PgConnection, run: Uuid) -> (i32, i32) {
    sqlx::query_as("SELECT steps_total, defs_waiting FROM durable.workflow_runs WHERE id = $1")
        .bind(run)
        .fetch_one(tx)
        .await
        .expect("counters")
}

/// Calls of each PL/pgSQL function so far in the transaction of `tx`
/// (after [`track_functions`]).
async fn function_calls(tx: &mut sqlx::PgConnection) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "SELECT funcname::text, calls FROM pg_stat_xact_user_functions WHERE schemaname = 'durable'",
    )
    .fetch_all(tx)
    .await
    .expect("function calls")
    .into_iter()
    .collect()
}

/// A submit writes its run once, with the counters its steps give it, its
/// definitions in one statement and its roots in one statement: the count
/// triggers run once each, whatever the number of steps, and the run row is
/// never updated. (Before, each definition and each root was an INSERT of
/// its own, each with a trigger call and an UPDATE of the run: a run of 100
/// parallel steps cost 30 ms to submit, now 9-10.) The setting that tells
/// the triggers which run is being submitted is gone when the submit ends,
/// also when it fails inside the caller's savepoint, and the next submit in
/// the same transaction is counted as usual.
#[tokio::test]
async fn a_submit_writes_its_run_once_and_each_kind_of_row_in_one_statement() {
    let t = TestDb::new().await;
    let step = |name: &str, deps: &[&str]| json!({"name": name, "executor_kind": "go", "kind": "k", "depends_on": deps});
    let mut tx = t.db.pool().begin().await.expect("begin");
    track_functions(&mut tx).await;
    let mut steps: Vec<_> = (0..40).map(|i| step(&format!("root-{i}"), &[])).collect();
    steps.push(step("join", &["root-0", "root-1"]));
    steps.push(step("last", &["join"]));
    let spec = json!({"name": "fan", "steps": steps});
    let run: Uuid = sqlx::query_scalar("SELECT durable.submit_run($1)")
        .bind(&spec)
        .fetch_one(&mut *tx)
        .await
        .expect("submit");
    assert_eq!(
        run_rows_updated(&mut tx).await,
        0,
        "the run row is written once"
    );
    let (total, waiting) = run_counters(&mut tx, run).await;
    assert_eq!(
        (total, waiting),
        (40, 2),
        "40 roots are steps, 2 definitions wait"
    );
    let calls = function_calls(&mut tx).await;
    let called = |f: &str| calls.get(f).copied().unwrap_or(0);
    assert_eq!(
        called("on_steps_created"),
        1,
        "one INSERT of the roots: {calls:?}"
    );
    assert_eq!(
        called("on_step_defs_inserted"),
        1,
        "one INSERT of the definitions: {calls:?}"
    );
    assert_eq!(
        called("materialize_step"),
        0,
        "no INSERT per root: {calls:?}"
    );
    assert_eq!(
        called("guard_step_insert"),
        0,
        "the guard runs only to refuse: {calls:?}"
    );
    let setting = || {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT nullif(current_setting('durable.submitting_run', true), '')",
        )
    };
    assert_eq!(setting().fetch_one(&mut *tx).await.expect("setting"), None);

    // a submit refused after its run row was written, inside a savepoint
    sqlx::query("SAVEPOINT s")
        .execute(&mut *tx)
        .await
        .expect("savepoint");
    let bad = json!({"name": "bad", "steps": [
        step("a", &[]),
        {"name": "b", "executor_kind": "go", "kind": "k", "retry": {"max_attempts": 0}}]});
    let err = sqlx::query_scalar::<_, Uuid>("SELECT durable.submit_run($1)")
        .bind(&bad)
        .fetch_one(&mut *tx)
        .await
        .expect_err("max_attempts 0 is refused");
    assert!(err.to_string().contains("max_attempts"), "{err}");
    sqlx::query("ROLLBACK TO SAVEPOINT s")
        .execute(&mut *tx)
        .await
        .expect("rollback to savepoint");
    assert_eq!(setting().fetch_one(&mut *tx).await.expect("setting"), None);

    // a definition of the first run materialized later, in the same
    // transaction, is counted by the trigger again
    let sid: Uuid = sqlx::query_scalar(
        "SELECT durable.materialize_step(d, 'k') FROM durable.step_defs d
          WHERE d.run_id = $1 AND d.name = 'join'",
    )
    .bind(run)
    .fetch_one(&mut *tx)
    .await
    .expect("materialize");
    let (total, waiting) = run_counters(&mut tx, run).await;
    assert_eq!(
        (total, waiting),
        (41, 1),
        "step {sid} counted, one definition left"
    );
    tx.rollback().await.expect("rollback");

    // and committed submits agree with a full recount
    t.submit(spec.clone()).await;
    t.submit(json!({"name": "one", "steps": [step("s", &[])]}))
        .await;
    check_books(&t.db, "after submits").await;
}

/// A success creates all its ready dependents in one statement: the insert
/// trigger runs once for a fan-out of 300, which is counted on the run and
/// each step gets its history row. (Before, each dependent was an INSERT of
/// its own inside the completion's statement: a fan-out of 999 behind one
/// step made its completion ~145 ms, now ~30.) A dependent with another
/// dependency still open is not created.
#[tokio::test]
async fn a_success_creates_its_ready_dependents_in_one_statement() {
    let t = TestDb::new().await;
    let mut steps = vec![
        json!({"name": "root", "executor_kind": "go", "kind": "k"}),
        json!({"name": "other", "executor_kind": "go", "kind": "k"}),
    ];
    steps.extend((0..300).map(|i| {
        json!({"name": format!("fan-{i}"), "executor_kind": "go", "kind": "k", "depends_on": ["root"]})
    }));
    steps.push(json!({"name": "join", "executor_kind": "go", "kind": "k",
                      "depends_on": ["root", "other"]}));
    let run = t.submit(json!({"name": "fan", "steps": steps})).await;
    let mut tx = t.db.pool().begin().await.expect("begin");
    for (state, token) in [("leased", "gen_random_uuid()"), ("running", "lease_token")] {
        sqlx::query(&format!(
            "UPDATE durable.step_runs SET state = '{state}', lease_token = {token}
              WHERE run_id = $1 AND name = 'root'"
        ))
        .bind(run)
        .execute(&mut *tx)
        .await
        .expect("move the root on");
    }
    track_functions(&mut tx).await;
    sqlx::query(
        "UPDATE durable.step_runs SET state = 'succeeded' WHERE run_id = $1 AND name = 'root'",
    )
    .bind(run)
    .execute(&mut *tx)
    .await
    .expect("the root succeeds");
    let calls = function_calls(&mut tx).await;
    let called = |f: &str| calls.get(f).copied().unwrap_or(0);
    assert_eq!(
        called("on_steps_created"),
        1,
        "one INSERT of the dependents: {calls:?}"
    );
    assert_eq!(
        called("materialize_step"),
        0,
        "no INSERT per dependent: {calls:?}"
    );
    let (total, waiting) = run_counters(&mut tx, run).await;
    assert_eq!(
        (total, waiting),
        (302, 1),
        "300 created and counted, the join waits"
    );
    let (created, history): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE EXISTS (
                    SELECT 1 FROM durable.transitions h
                     WHERE h.step_run_id = s.id AND h.to_state = 'pending'
                       AND h.reason = 'DEPENDENCIES_SUCCEEDED'))
           FROM durable.step_runs s WHERE s.run_id = $1 AND s.name LIKE 'fan-%' AND s.state = 'pending'",
    )
    .bind(run)
    .fetch_one(&mut *tx)
    .await
    .expect("dependents");
    assert_eq!((created, history), (300, 300));
    tx.commit().await.expect("commit");
    check_books(&t.db, "after a fan-out").await;
}

/// Cancelling a run creates the steps of its waiting definitions, cancelled,
/// in one statement: the insert trigger runs once for 200 of them, and the
/// counters and history agree with a recount. (Before, each was an INSERT of
/// its own: cancelling a run of one step and 999 dependents took ~190 ms,
/// now ~60.)
#[tokio::test]
async fn a_cancel_creates_the_waiting_steps_in_one_statement() {
    let t = TestDb::new().await;
    let mut steps = vec![json!({"name": "root", "executor_kind": "go", "kind": "k"})];
    steps.extend((0..200).map(|i| {
        json!({"name": format!("dep-{i}"), "executor_kind": "go", "kind": "k", "depends_on": ["root"]})
    }));
    let run = t.submit(json!({"name": "cancel", "steps": steps})).await;
    let mut tx = t.db.pool().begin().await.expect("begin");
    track_functions(&mut tx).await;
    let state: String = sqlx::query_scalar("SELECT durable.cancel_run($1)")
        .bind(run)
        .fetch_one(&mut *tx)
        .await
        .expect("cancel");
    assert_eq!(state, "cancelled");
    let calls = function_calls(&mut tx).await;
    let called = |f: &str| calls.get(f).copied().unwrap_or(0);
    assert_eq!(
        called("on_steps_created"),
        1,
        "one INSERT of the waiting steps: {calls:?}"
    );
    assert_eq!(
        called("materialize_step"),
        0,
        "no INSERT per step: {calls:?}"
    );
    let (total, cancelled, waiting): (i32, i32, i32) = sqlx::query_as(
        "SELECT steps_total, steps_cancelled, defs_waiting FROM durable.workflow_runs WHERE id = $1",
    )
    .bind(run)
    .fetch_one(&mut *tx)
    .await
    .expect("counters");
    assert_eq!((total, cancelled, waiting), (201, 201, 0));
    tx.commit().await.expect("commit");
    check_books(&t.db, "after a cancel").await;
}

/// The successes of one statement create their ready dependents together:
/// twenty dependencies of a fan-in and the first steps of two chains succeed
/// in one statement, and the fan-in's counter is written once (not once per
/// dependency), each dependent once, and the three new steps are one INSERT
/// (one insert-trigger call, not one per success). (Before, each success was
/// its own read of the run, UPDATE of its dependents and INSERT.)
#[tokio::test]
async fn the_successes_of_a_statement_create_their_dependents_together() {
    let t = TestDb::new().await;
    let step = |name: &str, deps: &[&str]| json!({"name": name, "executor_kind": "go", "kind": "k", "depends_on": deps});
    let roots: Vec<String> = (0..20).map(|i| format!("in-{i}")).collect();
    let mut fan: Vec<_> = roots.iter().map(|r| step(r, &[])).collect();
    let deps: Vec<&str> = roots.iter().map(String::as_str).collect();
    fan.push(step("join", &deps));
    let mut runs = vec![t.submit(json!({"name": "fan-in", "steps": fan})).await];
    for name in ["chain-a", "chain-b"] {
        runs.push(
            t.submit(
                json!({"name": name, "steps": [step("first", &[]), step("second", &["first"])]}),
            )
            .await,
        );
    }
    let mut tx = t.db.pool().begin().await.expect("begin");
    for (state, token) in [("leased", "gen_random_uuid()"), ("running", "lease_token")] {
        sqlx::query(&format!(
            "UPDATE durable.step_runs SET state = '{state}', lease_token = {token}
              WHERE run_id = ANY ($1)"
        ))
        .bind(&runs)
        .execute(&mut *tx)
        .await
        .expect("move the first steps on");
    }
    track_functions(&mut tx).await;
    let before = rows_updated(&mut tx, "durable.step_defs").await;
    let done =
        sqlx::query("UPDATE durable.step_runs SET state = 'succeeded' WHERE run_id = ANY ($1)")
            .bind(&runs)
            .execute(&mut *tx)
            .await
            .expect("the first steps succeed");
    assert_eq!(done.rows_affected(), 22);
    assert_eq!(
        rows_updated(&mut tx, "durable.step_defs").await - before,
        3,
        "each dependent's counter written once"
    );
    let calls = function_calls(&mut tx).await;
    let called = |f: &str| calls.get(f).copied().unwrap_or(0);
    assert_eq!(
        called("on_steps_created"),
        1,
        "one INSERT of the dependents: {calls:?}"
    );
    let created: Vec<(String,)> = sqlx::query_as(
        "SELECT name FROM durable.step_runs WHERE run_id = ANY ($1) AND state = 'pending' ORDER BY name",
    )
    .bind(&runs)
    .fetch_all(&mut *tx)
    .await
    .expect("dependents");
    assert_eq!(
        created,
        vec![("join".into(),), ("second".into(),), ("second".into(),)]
    );
    tx.commit().await.expect("commit");
    check_books(&t.db, "after successes with dependents").await;
}

/// Reads of the two rules tables (sequential and index scans) so far in the
/// transaction of `tx`.
async fn rules_reads(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)), 0)::int8
           FROM pg_stat_xact_user_tables
          WHERE relid IN ('durable.step_transition_rules'::regclass,
                          'durable.run_transition_rules'::regclass)",
    )
    .fetch_one(tx)
    .await
    .expect("reads of the rules tables")
}

/// The leases of `n` one-step runs, and a batch of their starts and
/// completions (as a busy persistent pool's flush carries them), in the
/// order the ledger sends them.
async fn start_and_complete_batch(t: &TestDb, n: usize) -> supervisor::db::Batch {
    use supervisor::db::Batch;
    let wid = worker(&t.db, "w").await;
    for i in 0..n {
        t.submit(json!({"name": format!("r{i}"), "steps": [
            {"name": "s", "executor_kind": "go", "kind": "k"}]}))
            .await;
    }
    let leased =
        t.db.lease(
            wid,
            "w",
            &tests::route_go_k(),
            n as u32,
            Duration::from_secs(30),
        )
        .await
        .expect("lease");
    assert_eq!(leased.len(), n);
    let mut b = Batch {
        starts: leased.iter().map(start_write).collect(),
        completes: leased
            .iter()
            .map(|l| complete_write(l, json!({})))
            .collect(),
        ..Default::default()
    };
    b.starts.sort_by_key(|s| (s.run_id, s.lease.step_run_id()));
    b.completes
        .sort_by_key(|c| (c.run_id, c.lease.step_run_id()));
    b
}

/// The guards judge each state change by an expression, not a query: a
/// batch that moves 20 steps (leased -> running -> succeeded) and their 20
/// runs (pending -> running -> succeeded) reads neither rules table.
/// (Before, each of those 40 row writes read the rules table once per hop,
/// a query through the executor each: 80 reads.) The database still refuses
/// every illegal transition (the S01 matrix, and the test above).
#[tokio::test]
async fn the_guards_judge_a_transition_without_reading_the_rules_tables() {
    let t = TestDb::new().await;
    let b = start_and_complete_batch(&t, 20).await;
    let mut tx = t.db.pool().begin().await.expect("begin");
    let reads0 = rules_reads(&mut tx).await;
    write_batch_ok(&mut tx, &b).await;
    let reads = rules_reads(&mut tx).await - reads0;
    let succeeded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durable.workflow_runs WHERE state = 'succeeded'")
            .fetch_one(&mut *tx)
            .await
            .expect("runs");
    tx.commit().await.expect("commit");
    assert_eq!(succeeded, 20);
    assert_eq!(reads, 0, "reads of the rules tables by the guards");
    check_books(&t.db, "after the batch").await;
}

/// The rules tables stay the source of what the guards allow: a rule taken
/// out of a table is refused from the next statement on, and allowed again
/// once it is put back (the checks are regenerated from the tables).
#[tokio::test]
async fn a_change_to_the_rules_tables_changes_what_the_guards_allow() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "r", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let step: Uuid = sqlx::query_scalar("SELECT id FROM durable.step_runs WHERE run_id = $1")
        .bind(run)
        .fetch_one(t.db.pool())
        .await
        .expect("step");
    let cancel = "UPDATE durable.step_runs SET state = 'cancelled' WHERE id = $1";
    let start = "UPDATE durable.workflow_runs SET state = 'running' WHERE id = $1";
    let mut tx = t.db.pool().begin().await.expect("begin");
    run_sql(
        &mut tx,
        "DELETE FROM durable.step_transition_rules WHERE from_state = 'pending' AND to_state = 'cancelled'",
    )
    .await;
    run_sql(&mut tx, "SAVEPOINT s").await;
    let err = write_one_row(&mut tx, cancel, step)
        .await
        .expect_err("a transition no rule allows");
    assert!(
        err.contains("illegal step transition pending -> cancelled"),
        "{err}"
    );
    run_sql(&mut tx, "ROLLBACK TO SAVEPOINT s").await;
    run_sql(
        &mut tx,
        "INSERT INTO durable.step_transition_rules (from_state, to_state) VALUES ('pending', 'cancelled')",
    )
    .await;
    assert_eq!(write_one_row(&mut tx, cancel, step).await, Ok(1));
    tx.rollback().await.expect("rollback");
    // the same for the runs' table; nothing of the above stayed
    let mut tx = t.db.pool().begin().await.expect("begin");
    run_sql(&mut tx, "TRUNCATE durable.run_transition_rules").await;
    let err = write_one_row(&mut tx, start, run)
        .await
        .expect_err("no run transition is allowed by an empty table");
    assert!(
        err.contains("illegal run transition pending -> running"),
        "{err}"
    );
    tx.rollback().await.expect("rollback");
    let mut conn = t.db.pool().acquire().await.expect("connection");
    assert_eq!(write_one_row(&mut conn, start, run).await, Ok(1));
}

/// Runs one statement without parameters.
async fn run_sql(conn: &mut sqlx::PgConnection, sql: &str) {
    sqlx::query(sql)
        .execute(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Runs `sql` with `id` as `$1`: the rows it changed, or the error's text.
async fn write_one_row(conn: &mut sqlx::PgConnection, sql: &str, id: Uuid) -> Result<u64, String> {
    sqlx::query(sql)
        .bind(id)
        .execute(conn)
        .await
        .map(|r| r.rows_affected())
        .map_err(|e| e.to_string())
}

/// A batch of starts and completions locks its runs once, up front, in id
/// order: the set forms do not lock them again. (Before, durable.lock_runs_of
/// ran three times per batch, the same runs each time.) The setting that
/// tells them is gone when the batch returns, so a later lock in the same
/// transaction locks.
#[tokio::test]
async fn a_batch_of_starts_and_completions_locks_its_runs_once() {
    let t = TestDb::new().await;
    let b = start_and_complete_batch(&t, 5).await;
    let mut tx = t.db.pool().begin().await.expect("begin");
    track_functions(&mut tx).await;
    write_batch_ok(&mut tx, &b).await;
    let calls = function_calls(&mut tx).await;
    assert_eq!(calls.get("lock_runs_of"), Some(&1), "{calls:?}");
    let flag: String = sqlx::query_scalar(
        "SELECT coalesce(current_setting('durable.batch_runs_locked', true), '')",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("setting");
    assert_eq!(flag, "", "the setting outlived the batch");
    tx.commit().await.expect("commit");
    check_books(&t.db, "after the batch").await;
}
