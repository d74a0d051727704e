//! Issue 7 item 2, checked by what the database reads: every hot write (the
//! lease, a batch of starts, a batch of completions with a cascade, a single
//! start, a retryable failure, a terminal failure with its run's end, a
//! heartbeat, a cancel) reads as many rows with a backlog of 1,500 open runs
//! as with one of 10. The rows are the backend's own counters of the write's
//! transaction (`pg_stat_xact_user_tables`: rows fetched by sequential and
//! index scans, triggers included), so the check is exact and does not time
//! anything. The backlog is added after the statistics were taken on the
//! small one, as when a queue fills faster than autovacuum analyzes it: a
//! plan that turns a per-row probe into a scan of every open run (a hashed
//! subplan) shows here as a read count that grows with the backlog.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use supervisor::db::{Batch, CompleteWrite, Db, DbConn, LeasedStep, OwnedEvent, StartWrite};
use tests::TestDb;
use uuid::Uuid;

const TTL: Duration = Duration::from_secs(30);

/// Rows read per table (sequential + index fetches) by this backend since
/// its statistics were last reported.
async fn reads(c: &mut sqlx::PgConnection) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, (coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))::int8
           FROM pg_stat_xact_user_tables WHERE schemaname = 'durable'",
    )
    .fetch_all(c)
    .await
    .expect("pg_stat_xact_user_tables");
    rows.into_iter().filter(|r| r.1 > 0).collect()
}

/// What was read after `before` (the counters are the backend's since its
/// last report, which never happens inside a transaction).
fn since(before: &BTreeMap<String, i64>, after: BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    after
        .into_iter()
        .map(|(t, n)| {
            let d = n - before.get(&t).copied().unwrap_or(0);
            (t, d)
        })
        .filter(|r| r.1 > 0)
        .collect()
}

fn ev(sequence: u64, kind: &'static str) -> OwnedEvent {
    OwnedEvent {
        sequence,
        kind,
        message: String::new(),
        fraction: None,
        executor_at: None,
    }
}

/// `n` open runs nobody here can lease: a root and a step waiting on it.
async fn backlog(db: &Db, n: i64) {
    sqlx::query(
        "SELECT count(durable.submit_run(jsonb_build_object('name', 'bg', 'steps', jsonb_build_array(
                    jsonb_build_object('name', 'x', 'executor_kind', 'go', 'kind', 'bg'),
                    jsonb_build_object('name', 'y', 'executor_kind', 'go', 'kind', 'bg',
                                       'depends_on', jsonb_build_array('x'))))))
           FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(db.pool())
    .await
    .expect("backlog");
}

type Reads = BTreeMap<&'static str, BTreeMap<String, i64>>;

/// One measured run through every hot write; each write in its own
/// transaction, its reads taken before the commit.
async fn measure(db: &Db, wid: Uuid) -> Reads {
    let run = db
        .submit(&json!({"name": "m", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "c", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await
        .expect("submit");
    let other = db
        .submit(&tests::one_step("o", "go", "k2", json!({})))
        .await
        .expect("submit");
    let mut out = Reads::new();

    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let mut c = DbConn::new(&mut tx);
    let leased: Vec<LeasedStep> = c
        .lease(wid, "w", &tests::route_go_k(), 2, TTL)
        .await
        .expect("lease");
    assert_eq!(leased.len(), 2, "a and c");
    out.insert("lease", since(&r0, reads(&mut tx).await));
    tx.commit().await.expect("commit");
    let mut leased = leased;
    leased.sort_by_key(|l| l.lease.step_run_id());

    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let mut c = DbConn::new(&mut tx);
    let starts = Batch {
        starts: leased
            .iter()
            .map(|l| StartWrite {
                run_id: run,
                lease: l.lease.clone(),
                pid: 1,
                event: ev(1, "accepted"),
            })
            .collect(),
        ..Batch::default()
    };
    let o = c.write_batch("w", &starts).await.expect("starts");
    assert!(
        o.starts
            .iter()
            .all(|r| *r == supervisor::db::RowOutcome::Ok),
        "{o:?}"
    );
    out.insert(
        "start batch (the run starts)",
        since(&r0, reads(&mut tx).await),
    );
    tx.commit().await.expect("commit");

    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let mut c = DbConn::new(&mut tx);
    let completes = Batch {
        completes: leased
            .iter()
            .map(|l| CompleteWrite {
                run_id: run,
                lease: l.lease.clone(),
                output: json!({"ok": true}),
                sequence: Some(2),
            })
            .collect(),
        ..Batch::default()
    };
    let o = c.write_batch("w", &completes).await.expect("completes");
    assert!(o
        .completes
        .iter()
        .all(|r| *r == supervisor::db::RowOutcome::Ok));
    out.insert(
        "complete batch (b is created)",
        since(&r0, reads(&mut tx).await),
    );
    tx.commit().await.expect("commit");

    // b: a single start, a retryable failure, a second lease, a terminal
    // failure (the run fails)
    for (what, retryable) in [("retryable failure", true), ("terminal failure", false)] {
        let b = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let got = db
                    .lease(wid, "w", &tests::route_go_k(), 1, TTL)
                    .await
                    .expect("lease b");
                if let Some(s) = got.into_iter().next() {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("b is leasable");
        let mut tx = db.pool().begin().await.expect("begin");
        let r0 = reads(&mut tx).await;
        let mut c = DbConn::new(&mut tx);
        c.mark_running(&b.lease, "w", 1, &tests::accepted_event())
            .await
            .expect("start b");
        out.insert(
            if retryable {
                "single start"
            } else {
                "single start (again)"
            },
            since(&r0, reads(&mut tx).await),
        );
        tx.commit().await.expect("commit");
        let mut tx = db.pool().begin().await.expect("begin");
        let r0 = reads(&mut tx).await;
        let mut c = DbConn::new(&mut tx);
        // no jitter, no delay: the retry is leasable at once
        c.fail(&b.lease, "w", &tests::failure_x(retryable), 0.0)
            .await
            .expect("fail b");
        out.insert(what, since(&r0, reads(&mut tx).await));
        tx.commit().await.expect("commit");
        if retryable {
            sqlx::query("UPDATE durable.step_runs SET next_attempt_at = now() WHERE id = $1")
                .bind(b.lease.step_run_id())
                .execute(db.pool())
                .await
                .expect("retry now");
        }
    }

    let route_k2 = vec![supervisor::db::Route {
        executor_kind: "go".into(),
        kind: "k2".into(),
        labels: Default::default(),
    }];
    let o = db
        .lease(wid, "w", &route_k2, 1, TTL)
        .await
        .expect("lease o");
    assert_eq!(o.len(), 1);
    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let mut c = DbConn::new(&mut tx);
    c.heartbeat(wid, &[o[0].lease.clone()], TTL)
        .await
        .expect("heartbeat");
    out.insert("heartbeat", since(&r0, reads(&mut tx).await));
    tx.commit().await.expect("commit");
    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let mut c = DbConn::new(&mut tx);
    c.cancel(other, None).await.expect("cancel");
    out.insert("cancel", since(&r0, reads(&mut tx).await));
    tx.commit().await.expect("commit");
    out
}

/// Each phase on connections of its own, opened after its backlog: a
/// session plans its statements (and PostgreSQL its foreign-key checks) once
/// and keeps the plan until the table's statistics change, so connections
/// that planned against 10 runs would still scan them sequentially at 1,510.
/// That is PostgreSQL's plan cache, gone at the next ANALYZE; what this test
/// is after is a plan made with the table at its size and still reading
/// every open run.
async fn phase(t: &TestDb, wid: Uuid) -> [Reads; 2] {
    let db = t.connect(2).await;
    // the first pass also warms the connections' caches; both must be bounded
    let first = measure(&db, wid).await;
    let second = measure(&db, wid).await;
    db.pool().close().await;
    [first, second]
}

#[tokio::test]
async fn hot_writes_read_the_same_rows_whatever_the_backlog() {
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    backlog(&t.db, 10).await;
    sqlx::query("ANALYZE")
        .execute(t.db.pool())
        .await
        .expect("analyze");
    let [_, small] = phase(&t, wid).await;
    // the statistics still say 10 runs, as when a queue fills faster than
    // autovacuum analyzes it
    backlog(&t.db, 1_500).await;
    let stale = phase(&t, wid).await;
    sqlx::query("ANALYZE")
        .execute(t.db.pool())
        .await
        .expect("analyze");
    let analyzed = phase(&t, wid).await;
    let big = [
        ("stale statistics", &stale[0]),
        ("stale statistics", &stale[1]),
        ("analyzed", &analyzed[0]),
        ("analyzed", &analyzed[1]),
    ];
    for (label, big) in big {
        for (op, tables) in big {
            for (table, n) in tables {
                let before = small
                    .get(op)
                    .and_then(|m| m.get(table))
                    .copied()
                    .unwrap_or(0);
                assert!(
                    *n <= before + 8,
                    "{op} read {n} rows of {table} with 1,510 open runs ({label}), \
                     {before} with 10: its cost grows with the backlog\n\
                     small: {small:#?}\nbig: {big:#?}"
                );
            }
        }
    }
}

/// The worker's statements are planned once per connection, not once per
/// call. PostgreSQL's default plan cache re-plans a prepared statement with
/// its parameters' values for as long as the generic plan looks costlier
/// than those custom plans, and with arrays as parameters it always does:
/// the lease was planned anew on every call (0.86 ms of planning on top of
/// 2.1 ms of execution at 16 concurrent steps, pg_stat_statements with
/// track_planning), and so was every statement inside the triggers that
/// takes an array. The runtime's connections ask for generic plans
/// (`plan_cache_mode`), which its statements are written for: key probes
/// whose plan does not depend on the values (the test above checks that
/// those plans read the same rows at any backlog). Checked on the
/// connection itself: `pg_prepared_statements` counts the generic and the
/// custom plans each prepared statement was executed with.
#[tokio::test]
async fn the_hot_statements_are_planned_once_per_connection() {
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let db = t.connect(1).await;
    const CALLS: usize = 8;
    for i in 0..CALLS {
        let run = db
            .submit(&tests::one_step(
                &format!("p{i}"),
                "go",
                "k",
                json!({"i": i}),
            ))
            .await
            .expect("submit");
        let leased = db
            .lease(wid, "w", &tests::route_go_k(), 4, TTL)
            .await
            .expect("lease");
        assert_eq!(leased.len(), 1, "call {i}");
        let lease = leased[0].lease.clone();
        db.heartbeat(wid, std::slice::from_ref(&lease), TTL)
            .await
            .expect("heartbeat");
        for batch in [
            Batch {
                starts: vec![StartWrite {
                    run_id: run,
                    lease: lease.clone(),
                    pid: 1,
                    event: ev(1, "accepted"),
                }],
                ..Batch::default()
            },
            Batch {
                completes: vec![CompleteWrite {
                    run_id: run,
                    lease: lease.clone(),
                    output: json!({"ok": true}),
                    sequence: Some(2),
                }],
                ..Batch::default()
            },
        ] {
            let mut tx = db.pool().begin().await.expect("begin");
            let o = DbConn::new(&mut tx)
                .write_batch("w", &batch)
                .await
                .expect("batch");
            assert!(
                o.starts
                    .iter()
                    .chain(&o.completes)
                    .all(|r| *r == supervisor::db::RowOutcome::Ok),
                "{o:?}"
            );
            tx.commit().await.expect("commit");
        }
        assert_eq!(t.status(run).await.state, "succeeded");
    }
    let plans: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
            .fetch_all(db.pool())
            .await
            .expect("pg_prepared_statements");
    let lease = plans
        .iter()
        .find(|p| {
            p.0.contains("UPDATE durable.step_runs s") && p.0.contains("SET state = 'leased'")
        })
        .unwrap_or_else(|| panic!("the lease is a prepared statement: {plans:#?}"));
    assert_eq!(
        (lease.1, lease.2),
        (CALLS as i64, 0),
        "the lease ran {CALLS} times on one plan (generic, custom)"
    );
    let replanned: Vec<_> = plans.iter().filter(|p| p.2 > 0).collect();
    assert!(
        replanned.is_empty(),
        "statements planned with their parameters' values on every call: {replanned:#?}"
    );
    // and never compiled: a generic plan's estimate over a million pending
    // rows crosses jit_above_cost (280 ms of compiling for a 0.1 ms lease)
    let jit: String = sqlx::query_scalar("SHOW jit")
        .fetch_one(db.pool())
        .await
        .expect("jit");
    assert_eq!(jit, "off");
}

/// `n` one-step runs of `go`/`k` (what `tests::route_go_k` leases).
async fn leasable_runs(db: &Db, n: i64) {
    sqlx::query(
        "SELECT count(durable.submit_run(jsonb_build_object('name', 'k', 'steps', jsonb_build_array(
                    jsonb_build_object('name', 'x', 'executor_kind', 'go', 'kind', 'k')))))
           FROM generate_series(1, $1)",
    )
    .bind(n)
    .execute(db.pool())
    .await
    .expect("runs");
}

async fn analyze(db: &Db) {
    sqlx::query("ANALYZE")
        .execute(db.pool())
        .await
        .expect("analyze");
}

/// Leases all `n` leasable steps.
async fn lease_all(db: &Db, wid: Uuid, n: i64) -> Vec<LeasedStep> {
    let leased = db
        .lease(wid, "w", &tests::route_go_k(), n as u32, TTL)
        .await
        .expect("lease");
    assert_eq!(leased.len(), n as usize);
    leased
}

/// Runs `write` in a transaction of its own on `db` and returns the rows it
/// read per table.
async fn measured<F>(db: &Db, write: F) -> BTreeMap<String, i64>
where
    F: for<'c> FnOnce(
        DbConn<'c>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'c>>,
{
    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    write(DbConn::new(&mut tx)).await;
    let read = since(&r0, reads(&mut tx).await);
    tx.commit().await.expect("commit");
    read
}

fn starts_of(steps: &[&LeasedStep]) -> Batch {
    Batch {
        starts: steps
            .iter()
            .map(|l| StartWrite {
                run_id: l.run_id,
                lease: l.lease.clone(),
                pid: 1,
                event: ev(1, "accepted"),
            })
            .collect(),
        ..Batch::default()
    }
}

fn completes_of(steps: &[&LeasedStep]) -> Batch {
    Batch {
        completes: steps
            .iter()
            .map(|l| CompleteWrite {
                run_id: l.run_id,
                lease: l.lease.clone(),
                output: json!({"ok": true}),
                sequence: Some(2),
            })
            .collect(),
        ..Batch::default()
    }
}

/// Writes `batch` and checks that every intent of it was written.
async fn write_all(mut c: DbConn<'_>, batch: Batch) {
    let o = c.write_batch("w", &batch).await.expect("batch");
    assert!(
        o.starts
            .iter()
            .chain(o.completes.iter())
            .all(|r| *r == supervisor::db::RowOutcome::Ok),
        "{o:?}"
    );
}

/// A fenced write names its steps by id and token, and reads those steps
/// alone, however many entries the index of live steps holds. The write's
/// condition (`state IN ('leased', 'running')`) was the predicate of that
/// partial index, so the planner could read the whole index instead of
/// probing the primary key: after an ANALYZE taken while few steps were
/// live the index looks nearly empty, and a generic plan made then scanned
/// all of it on every call (live entries, and the dead ones every finished
/// step leaves until vacuum). Here 300 steps are leased after such an
/// ANALYZE (with 2,000 other runs waiting), and a batch of starts, a batch
/// of completions and a heartbeat for two of them must each read a handful
/// of step rows, not 300.
#[tokio::test]
async fn fenced_writes_probe_their_own_steps_whatever_the_live_index_holds() {
    const LIVE: i64 = 300;
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    // the queue is large enough that reading a whole table costs more than
    // a probe per step (on a small one the planner rightly scans it)
    backlog(&t.db, 2_000).await;
    leasable_runs(&t.db, LIVE).await;
    // the statistics say no step is live
    analyze(&t.db).await;
    let leased = lease_all(&t.db, wid, LIVE).await;
    let two: Vec<&LeasedStep> = leased.iter().take(2).collect();
    let leases: Vec<_> = two.iter().map(|l| l.lease.clone()).collect();
    // a connection of its own: its plans are made now, with those statistics
    let db = t.connect(1).await;
    let mut read = Reads::new();
    read.insert(
        "heartbeat",
        measured(&db, |mut c| {
            Box::pin(async move {
                c.heartbeat(wid, &leases, TTL).await.expect("heartbeat");
            })
        })
        .await,
    );
    let starts = starts_of(&two);
    read.insert(
        "start batch",
        measured(&db, |c| Box::pin(write_all(c, starts))).await,
    );
    let completes = completes_of(&two);
    read.insert(
        "complete batch",
        measured(&db, |c| Box::pin(write_all(c, completes))).await,
    );
    db.pool().close().await;

    for (op, tables) in &read {
        let steps = tables.get("step_runs").copied().unwrap_or(0);
        assert!(
            steps <= 12,
            "{op} for 2 steps read {steps} step rows with {LIVE} live: it scanned the \
             index of live steps instead of probing its own\n{read:#?}"
        );
    }
}

/// A start locks its own run, however many entries the index of open runs
/// holds. The lock's condition (`w.state = 'pending'`) implied that partial
/// index's predicate (`state IN ('pending', 'running')`), so after an
/// ANALYZE taken while few runs were open (a drained queue, its finished
/// runs kept) a generic plan read every open run's entry for each run a
/// batch started. Here 2,000 finished runs are analyzed, 300 runs are then
/// submitted and leased, and a batch starting two of them must read a
/// handful of run rows, not 300.
#[tokio::test]
async fn a_start_locks_its_own_run_whatever_the_open_runs_index_holds() {
    const OPEN: i64 = 300;
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    backlog(&t.db, 2_000).await;
    sqlx::query("SELECT count(durable.cancel_run(id)) FROM durable.workflow_runs")
        .execute(t.db.pool())
        .await
        .expect("finish them");
    // the statistics say no run is open
    analyze(&t.db).await;
    leasable_runs(&t.db, OPEN).await;
    let leased = lease_all(&t.db, wid, OPEN).await;
    let two: Vec<&LeasedStep> = leased.iter().take(2).collect();
    // a connection of its own: its plans are made now, with those statistics
    let db = t.connect(1).await;
    let starts = starts_of(&two);
    let read = measured(&db, |c| Box::pin(write_all(c, starts))).await;
    db.pool().close().await;
    let runs = read.get("workflow_runs").copied().unwrap_or(0);
    assert!(
        runs <= 12,
        "a start batch of 2 read {runs} run rows with {OPEN} open: it scanned the index \
         of open runs instead of probing its own\n{read:#?}"
    );
}

/// `runs` reads each step row of the runs it lists at most once, whatever
/// the statistics say (scale audit): its step counts were correlated
/// subqueries, and a plan made on statistics taken while two big runs
/// filled the table (a run id there stands for hundreds of steps) scanned
/// all of `step_runs` once per listed run; with 30,000 small runs added
/// after that ANALYZE, `runs --limit 100000` ran into the statement timeout.
#[tokio::test]
async fn listing_runs_reads_each_step_once_whatever_the_statistics() {
    let t = TestDb::new().await;
    let db = &t.db;
    for table in ["step_runs", "step_defs", "workflow_runs"] {
        sqlx::query(&format!(
            "ALTER TABLE durable.{table} SET (autovacuum_enabled = false)"
        ))
        .execute(db.pool())
        .await
        .expect("autovacuum off");
    }
    sqlx::query(
        "SELECT durable.submit_run(jsonb_build_object('name', 'big', 'steps',
                (SELECT jsonb_agg(jsonb_build_object('name', 's' || i, 'executor_kind', 'go', 'kind', 'k'))
                   FROM generate_series(1, 300) i)))
           FROM generate_series(1, 2)",
    )
    .execute(db.pool())
    .await
    .expect("big runs");
    analyze(db).await;
    leasable_runs(db, 1_000).await;
    let steps: i64 = sqlx::query_scalar("SELECT count(*) FROM durable.step_runs")
        .fetch_one(db.pool())
        .await
        .expect("count");
    assert_eq!(steps, 1_600);
    let read = measured(db, |mut c| {
        Box::pin(async move {
            let (runs, more) = c
                .runs(&supervisor::db::RunFilter {
                    limit: 5_000,
                    ..Default::default()
                })
                .await
                .expect("runs");
            assert!(!more, "every run on one page");
            assert_eq!(runs.len(), 1_002);
            assert_eq!(
                runs.iter()
                    .map(|r| r.steps.values().sum::<i64>())
                    .sum::<i64>(),
                1_600
            );
        })
    })
    .await;
    for table in ["step_runs", "step_defs"] {
        let rows = read.get(table).copied().unwrap_or(0);
        assert!(
            rows <= 2 * steps,
            "listing 1,002 runs read {rows} rows of {table} for {steps} steps: {read:?}"
        );
    }
}

/// What this backend read of step_runs in its transaction: rows of its
/// sequential scans and entries of its index scans (index-only ones
/// included).
async fn index_fetches(c: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT (pg_stat_get_xact_tuples_returned('durable.step_runs'::regclass)
                 + coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0))::int8
           FROM pg_index i WHERE i.indrelid = 'durable.step_runs'::regclass",
    )
    .fetch_one(c)
    .await
    .expect("rows or index entries read")
}

/// Ready steps whose labels no live worker offers (a typo in a spec, a pool
/// not started yet) lie in front of every later step of their kind for
/// ever: the lease read through all of them on every call (audit: 50,000
/// such steps, 58 ms a lease). It reads the same rows with 600 of them as
/// with 10, for a route without labels and for one with labels, and still
/// takes what it may in queue order: steps with no labels or with a subset
/// of the route's.
#[tokio::test]
async fn steps_of_labels_nobody_offers_are_not_read_by_the_lease() {
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let stuck = |n: i64| {
        let db = t.db.clone();
        async move {
            sqlx::query(
                "SELECT count(durable.submit_run(jsonb_build_object('name', 'stuck', 'steps', jsonb_build_array(
                            jsonb_build_object('name', 'x', 'executor_kind', 'go', 'kind', 'k',
                                               'labels', jsonb_build_object('gpu', 'a10O', 'zone', 'a'))))))
                   FROM generate_series(1, $1)",
            )
            .bind(n)
            .execute(db.pool())
            .await
            .expect("stuck steps");
            // the entries of the steps earlier measurements cancelled go
            sqlx::query("VACUUM ANALYZE durable.step_runs")
                .execute(db.pool())
                .await
                .expect("vacuum");
        }
    };
    let zone_a = vec![supervisor::db::Route {
        executor_kind: "go".into(),
        kind: "k".into(),
        labels: [("zone".to_string(), "a".to_string())].into(),
    }];
    // one lease of each route after `stuck` steps: what it read of
    // step_runs, and the names of the runs it took
    let lease = |routes: Vec<supervisor::db::Route>| {
        let db = t.db.clone();
        async move {
            let mut names = Vec::new();
            for (name, labels) in [("plain", json!({})), ("zoned", json!({"zone": "a"}))] {
                db.submit(&json!({"name": name, "steps": [
                    {"name": "s", "executor_kind": "go", "kind": "k", "labels": labels}]}))
                    .await
                    .expect("submit");
            }
            let mut tx = db.pool().begin().await.expect("begin");
            let r0 = index_fetches(&mut tx).await;
            let leased = DbConn::new(&mut tx)
                .lease(wid, "w", &routes, 5, TTL)
                .await
                .expect("lease");
            let read = index_fetches(&mut tx).await - r0;
            for l in &leased {
                let name: String = sqlx::query_scalar(
                    "SELECT r.name FROM durable.workflow_runs r WHERE r.id = $1",
                )
                .bind(l.run_id)
                .fetch_one(&mut *tx)
                .await
                .expect("run name");
                names.push(name);
            }
            tx.commit().await.expect("commit");
            // what this route did not take goes, for the next measurement
            sqlx::query(
                "UPDATE durable.step_runs SET state = 'cancelled', transition_reason = 'test'
                  WHERE state = 'pending' AND labels <> '{\"gpu\": \"a10O\", \"zone\": \"a\"}'",
            )
            .execute(db.pool())
            .await
            .expect("clear");
            (read, names)
        }
    };
    // a table of some size (steps of another kind), so that finding a
    // handful of rows by their keys is cheaper than reading it whole
    backlog(&t.db, 3_000).await;
    // more labels than the worker lists the subsets of
    let many = vec![supervisor::db::Route {
        executor_kind: "go".into(),
        kind: "k".into(),
        labels: (1..=6)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .chain([("zone".to_string(), "a".to_string())])
            .collect(),
    }];
    stuck(10).await;
    let (many_small, names) = lease(many.clone()).await;
    assert_eq!(
        names,
        ["plain", "zoned"],
        "a route of 7 labels takes what it offers"
    );
    let (plain_small, names) = lease(tests::route_go_k()).await;
    assert_eq!(
        names,
        ["plain"],
        "a route without labels takes unlabelled steps only"
    );
    let (zoned_small, names) = lease(zone_a.clone()).await;
    assert_eq!(
        names,
        ["plain", "zoned"],
        "a route takes every subset of its labels, in order"
    );
    stuck(600).await;
    let (plain_big, _) = lease(tests::route_go_k()).await;
    let (zoned_big, _) = lease(zone_a).await;
    let (many_big, _) = lease(many).await;
    // a handful of probes, where reading the steps it cannot take is 610
    for (route, small, big) in [
        ("no labels", plain_small, plain_big),
        ("zone a", zoned_small, zoned_big),
        ("7 labels", many_small, many_big),
    ] {
        assert!(
            big <= 60,
            "a route with {route} read {small} rows or index entries of step_runs with 10 steps \
             of labels nobody offers, {big} with 610: it reads the steps it cannot take"
        );
    }
}

/// A lease probes the steps it picked by key on a small queue too. It
/// joined its picks (~10 rows to the planner) to `step_runs`, which with a
/// few hundred rows the planner read whole and hashed instead, and kept that
/// generic plan until the next ANALYZE: every lease read every step, dead
/// versions included (at 4 concurrent one-shot Go steps on 800 runs, one
/// lease per step). Here 400 one-step runs are analyzed and a lease of 2
/// must read a handful of step and run rows, not 400.
#[tokio::test]
async fn a_lease_on_a_small_queue_probes_its_picks_by_key() {
    const RUNS: i64 = 400;
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    leasable_runs(&t.db, RUNS).await;
    analyze(&t.db).await;
    // a connection of its own: its plans are made now, with those statistics
    let db = t.connect(1).await;
    let mut tx = db.pool().begin().await.expect("begin");
    let r0 = reads(&mut tx).await;
    let leased = DbConn::new(&mut tx)
        .lease(wid, "w", &tests::route_go_k(), 2, TTL)
        .await
        .expect("lease");
    let read = since(&r0, reads(&mut tx).await);
    tx.commit().await.expect("commit");
    db.pool().close().await;
    assert_eq!(leased.len(), 2);
    for table in ["step_runs", "workflow_runs"] {
        let rows = read.get(table).copied().unwrap_or(0);
        assert!(
            rows <= 12,
            "a lease of 2 read {rows} rows of {table} among {RUNS} runs: it read the table \
             whole instead of probing its picks\n{read:#?}"
        );
    }
}

/// The ledger's batches probe the rows they name on a small queue too: the
/// fenced completion joined its arrays (~10 rows to the planner) to
/// `step_runs`, and the runs' bookkeeping its runs to `workflow_runs`, and
/// with a few hundred rows the planner hashed a scan of each whole table
/// for those joins, at every flush until the next ANALYZE (a batch of 2
/// completions read 404 step rows among 400 runs). Here 400 one-step runs
/// are analyzed, 2 leased, and the batch of their starts and the batch of
/// their completions (each ending its run) must each read a handful of step
/// and run rows.
#[tokio::test]
async fn batches_on_a_small_queue_probe_their_rows_by_key() {
    const RUNS: i64 = 400;
    let t = TestDb::new().await;
    let wid = Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    leasable_runs(&t.db, RUNS).await;
    analyze(&t.db).await;
    let leased =
        t.db.lease(wid, "w", &tests::route_go_k(), 2, TTL)
            .await
            .expect("lease");
    assert_eq!(leased.len(), 2);
    let two: Vec<&LeasedStep> = leased.iter().collect();
    // a connection of its own: its plans are made now, with those statistics
    let db = t.connect(1).await;
    let mut read = Reads::new();
    let starts = starts_of(&two);
    read.insert(
        "start batch",
        measured(&db, |c| Box::pin(write_all(c, starts))).await,
    );
    let completes = completes_of(&two);
    read.insert(
        "complete batch",
        measured(&db, |c| Box::pin(write_all(c, completes))).await,
    );
    db.pool().close().await;
    for (op, tables) in &read {
        for table in ["step_runs", "workflow_runs"] {
            let rows = tables.get(table).copied().unwrap_or(0);
            assert!(
                rows <= 12,
                "{op} of 2 read {rows} rows of {table} among {RUNS} runs: it read the table \
                 whole instead of probing its keys\n{read:#?}"
            );
        }
    }
    let ended = t
        .scalar_i64("SELECT count(*) FROM durable.workflow_runs WHERE state = 'succeeded'")
        .await;
    assert_eq!(ended, 2, "both runs ended with their steps");
}
