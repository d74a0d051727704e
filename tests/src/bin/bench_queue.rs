//! Benchmark (not a test; run through `scripts/bench`): lease→complete
//! throughput and lease latency of the durable queue through the real `Db` API
//! (`Db::lease` with a route, `Db::mark_running`, `Db::complete`), beside a
//! plain-SQL baseline run in the same process against a minimal table
//! `(id, state, next_attempt_at, lease_token)` without triggers, history or
//! fencing beyond the token.
//!
//! For each backlog a fresh database `bench_q_*` is created, migrated and
//! filled, and dropped at the end (also on error and on Ctrl-C).
//!
//! What one "step" costs in each implementation:
//! * runtime: its share of one `Db::lease(limit = batch)` statement, then
//!   `Db::mark_running` (tx: run lock, UPDATE … RETURNING + INSERT event) and
//!   `Db::complete` (tx: run lock, SELECT … FOR UPDATE, INSERT terminal event,
//!   UPDATE), each firing the transition triggers (history rows, run recompute);
//! * plain: its share of one `UPDATE … WHERE id IN (SELECT … FOR UPDATE SKIP
//!   LOCKED LIMIT batch)` and one `UPDATE … SET state = 'succeeded' WHERE id AND
//!   lease_token`, autocommit.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use supervisor::db::{Db, Route};
use tests::bench::*;
use uuid::Uuid;

#[derive(Parser, Debug, Clone)]
#[command(about = "Queue throughput and lease latency: the runtime's Db API vs plain SQL")]
struct Args {
    /// Server where the benchmark may create and drop databases (bench_q_*).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Measurement time per cell (a cell also stops early once it has taken
    /// half of the backlog, so the backlog never falls below half its size).
    #[arg(long, default_value_t = 10.0)]
    duration_secs: f64,
    /// Pending rows before each cell (topped up between cells).
    #[arg(long, value_delimiter = ',', default_value = "10000,1000000")]
    backlogs: Vec<u64>,
    /// Concurrent workers, each with its own pool of one connection.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    workers: Vec<u32>,
    /// Rows asked for per lease statement.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    batches: Vec<u32>,
    /// Steps per workflow run in the backlog (1 = one-step runs).
    #[arg(long, default_value_t = 1)]
    steps_per_run: u64,
    /// After the cells of the largest backlog, mark this percentage of all rows
    /// finished and measure lease latency again with one worker (0 = skip).
    #[arg(long, default_value_t = 90)]
    finished_pct: u32,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

const EXECUTOR_KIND: &str = "bench";
const KIND: &str = "bench.noop";
const LEASE_TTL: Duration = Duration::from_secs(300);
const FILL_CHUNK: u64 = 100_000;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Imp {
    Runtime,
    Plain,
}

impl Imp {
    fn name(self) -> &'static str {
        match self {
            Imp::Runtime => "runtime",
            Imp::Plain => "plain",
        }
    }
}

const PLAIN_DDL: &str = "CREATE TABLE public.plain_queue (
    id              uuid PRIMARY KEY,
    state           text NOT NULL,
    next_attempt_at timestamptz NOT NULL,
    lease_token     uuid
)";
const PLAIN_INDEX: &str =
    "CREATE INDEX plain_queue_pending ON public.plain_queue (next_attempt_at) WHERE state = 'pending'";
const PLAIN_LEASE: &str = "UPDATE public.plain_queue q
    SET state = 'leased', lease_token = gen_random_uuid()
  WHERE q.id IN (SELECT id FROM public.plain_queue
                  WHERE state = 'pending' AND next_attempt_at <= now()
                  ORDER BY next_attempt_at
                  LIMIT $1
                  FOR UPDATE SKIP LOCKED)
RETURNING q.id, q.lease_token";
const PLAIN_COMPLETE: &str =
    "UPDATE public.plain_queue SET state = 'succeeded' WHERE id = $1 AND lease_token = $2";

/// One measured cell.
#[derive(Debug, Clone)]
struct Cell {
    imp: Imp,
    label: String,
    rows_at_start: i64,
    pending_at_start: i64,
    workers: u32,
    batch: u32,
    steps: u64,
    secs: f64,
    capped: bool,
    leases: Vec<Duration>,
    leased_rows: u64,
    short_leases: u64,
    mark: Vec<Duration>,
    complete: Vec<Duration>,
    db_cpu: Option<f64>,
    /// Wall time inside the step_runs trigger functions (seconds), if known.
    trigger_time: Option<f64>,
    bench_cpu: f64,
    busy: Option<f64>,
}

impl Cell {
    fn steps_per_sec(&self) -> f64 {
        self.steps as f64 / self.secs
    }
    fn leases_ms(&self, p: f64) -> f64 {
        pct(&self.leases, p).as_secs_f64() * 1e3
    }
}

#[derive(Default)]
struct WorkerStats {
    leases: Vec<Duration>,
    leased_rows: u64,
    short_leases: u64,
    mark: Vec<Duration>,
    complete: Vec<Duration>,
    done: u64,
}

struct Ctl {
    stop: AtomicBool,
    claimed: AtomicU64,
    cap: u64,
}

fn routes() -> Vec<Route> {
    vec![Route {
        executor_kind: EXECUTOR_KIND.into(),
        kind: KIND.into(),
        labels: BTreeMap::new(),
    }]
}

/// A worker of the runtime: lease a batch, then mark_running + complete each
/// step (output = input, like demo.echo; terminal event sequence 2).
async fn runtime_worker(db: Db, ix: u32, batch: u32, ctl: Arc<Ctl>) -> Result<WorkerStats> {
    let id = Uuid::new_v4();
    let name = format!("bench-worker-{ix}");
    let routes = routes();
    let pid = std::process::id() as i32;
    let mut st = WorkerStats::default();
    loop {
        if ctl.stop.load(Ordering::Relaxed)
            || ctl.claimed.fetch_add(batch as u64, Ordering::Relaxed) >= ctl.cap
        {
            break;
        }
        let t = Instant::now();
        let leased = db.lease(id, &name, &routes, batch, LEASE_TTL).await?;
        st.leases.push(t.elapsed());
        st.leased_rows += leased.len() as u64;
        if leased.len() < batch as usize {
            st.short_leases += 1;
        }
        if leased.is_empty() {
            break;
        }
        for s in leased {
            let t = Instant::now();
            db.mark_running(&s.lease, &name, pid, &tests::accepted_event())
                .await?;
            st.mark.push(t.elapsed());
            let t = Instant::now();
            db.complete(&s.lease, &name, &s.input, &[], Some(2)).await?;
            st.complete.push(t.elapsed());
            st.done += 1;
        }
    }
    Ok(st)
}

/// A worker of the plain baseline: the same two statements, no triggers.
async fn plain_worker(db: Db, batch: u32, ctl: Arc<Ctl>) -> Result<WorkerStats> {
    let mut st = WorkerStats::default();
    loop {
        if ctl.stop.load(Ordering::Relaxed)
            || ctl.claimed.fetch_add(batch as u64, Ordering::Relaxed) >= ctl.cap
        {
            break;
        }
        let t = Instant::now();
        let rows: Vec<(Uuid, Uuid)> = sqlx::query_as(PLAIN_LEASE)
            .bind(batch as i64)
            .fetch_all(db.pool())
            .await?;
        st.leases.push(t.elapsed());
        st.leased_rows += rows.len() as u64;
        if rows.len() < batch as usize {
            st.short_leases += 1;
        }
        if rows.is_empty() {
            break;
        }
        for (id, token) in rows {
            let t = Instant::now();
            let n = sqlx::query(PLAIN_COMPLETE)
                .bind(id)
                .bind(token)
                .execute(db.pool())
                .await?
                .rows_affected();
            if n != 1 {
                bail!("plain complete of {id} updated {n} rows");
            }
            st.complete.push(t.elapsed());
            st.done += 1;
        }
    }
    Ok(st)
}

async fn backend_pid(db: &Db) -> Result<i32> {
    Ok(sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(db.pool())
        .await?)
}

/// Runs one cell: `workers` pools of one connection, a warm-up step each (not
/// counted), then all start together and run until `duration` or the cap.
async fn run_cell(
    url: &str,
    imp: Imp,
    label: &str,
    workers: u32,
    batch: u32,
    duration: Duration,
    cap: u64,
) -> Result<Cell> {
    let (rows_at_start, pending_at_start) = counts(url, imp).await?;
    let mut dbs = Vec::new();
    let mut pids = Vec::new();
    for _ in 0..workers {
        let db = match imp {
            Imp::Runtime => Db::connect(url, 1).await?,
            Imp::Plain => plain_db(url, 1).await?,
        };
        pids.push(backend_pid(&db).await?);
        // time spent in plpgsql functions, read from pg_stat_user_functions
        sqlx::query("SET track_functions = 'pl'")
            .execute(db.pool())
            .await?;
        dbs.push(db);
    }
    // warm-up: prepares each statement on each connection
    let warm = Arc::new(Ctl {
        stop: AtomicBool::new(false),
        claimed: AtomicU64::new(0),
        cap: 1,
    });
    for (i, db) in dbs.iter().enumerate() {
        warm.claimed.store(0, Ordering::Relaxed);
        match imp {
            Imp::Runtime => runtime_worker(db.clone(), i as u32, 1, warm.clone()).await?,
            Imp::Plain => plain_worker(db.clone(), 1, warm.clone()).await?,
        };
    }

    let ctl = Arc::new(Ctl {
        stop: AtomicBool::new(false),
        claimed: AtomicU64::new(0),
        cap,
    });
    let barrier = Arc::new(tokio::sync::Barrier::new(workers as usize + 1));
    let mut handles = Vec::new();
    for (i, db) in dbs.iter().enumerate() {
        let (db, ctl, barrier) = (db.clone(), ctl.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            match imp {
                Imp::Runtime => runtime_worker(db, i as u32, batch, ctl).await,
                Imp::Plain => plain_worker(db, batch, ctl).await,
            }
        }));
    }
    let trig0 = trigger_seconds(url, &dbs).await;
    let cpu0 = backend_cpu(&pids);
    let rus0 = self_cpu();
    let stat0 = machine_cpu();
    barrier.wait().await;
    let t0 = Instant::now();
    let timer = {
        let ctl = ctl.clone();
        tokio::spawn(async move {
            tokio::time::sleep(duration).await;
            ctl.stop.store(true, Ordering::Relaxed);
        })
    };
    let mut all = WorkerStats::default();
    for h in handles {
        let st = h.await.context("worker task")??;
        all.leases.extend(st.leases);
        all.leased_rows += st.leased_rows;
        all.short_leases += st.short_leases;
        all.mark.extend(st.mark);
        all.complete.extend(st.complete);
        all.done += st.done;
    }
    let secs = t0.elapsed().as_secs_f64();
    timer.abort();
    let cpu1 = backend_cpu(&pids);
    let rus1 = self_cpu();
    let stat1 = machine_cpu();
    let trig1 = trigger_seconds(url, &dbs).await;
    for db in dbs {
        db.pool().close().await;
    }
    Ok(Cell {
        imp,
        label: label.to_owned(),
        rows_at_start,
        pending_at_start,
        workers,
        batch,
        steps: all.done,
        secs,
        capped: !ctl.stop.load(Ordering::Relaxed),
        leases: all.leases,
        leased_rows: all.leased_rows,
        short_leases: all.short_leases,
        mark: all.mark,
        complete: all.complete,
        db_cpu: cpu0.zip(cpu1).map(|(a, b)| b - a),
        trigger_time: trig0.zip(trig1).map(|(a, b)| b - a),
        bench_cpu: rus1 - rus0,
        busy: stat0.zip(stat1).map(|(a, b)| busy_fraction(a, b)),
    })
}

/// Cumulative time (s) spent in the step_runs trigger functions of the
/// database: `on_step_transition` (history row, run recompute, dependents) and
/// `guard_step_update` (transition rules). Asks every worker connection to
/// flush its function statistics first. None if unavailable (PostgreSQL < 15).
async fn trigger_seconds(url: &str, dbs: &[Db]) -> Option<f64> {
    for db in dbs {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(db.pool())
            .await
            .ok()?;
        // the flush happens when the backend goes idle after the statement above
        sqlx::query("SELECT 1").execute(db.pool()).await.ok()?;
    }
    let reader = Db::connect(url, 1).await.ok()?;
    let ms: Option<f64> = sqlx::query_scalar(
        "SELECT coalesce(sum(total_time), 0)::float8 FROM pg_stat_user_functions
          WHERE schemaname = 'durable' AND funcname IN ('on_step_transition', 'guard_step_update')",
    )
    .fetch_one(reader.pool())
    .await
    .ok();
    reader.pool().close().await;
    ms.map(|ms| ms / 1e3)
}

// ---------------------------------------------------------------------------
// fixtures

/// (all rows, pending rows) of the implementation's table.
async fn counts(url: &str, imp: Imp) -> Result<(i64, i64)> {
    let db = Db::connect(url, 1).await?;
    let sql = match imp {
        Imp::Runtime => {
            "SELECT (SELECT count(*) FROM durable.step_runs),
                    (SELECT count(*) FROM durable.step_runs WHERE state IN ('pending', 'retryable_failed'))"
        }
        Imp::Plain => {
            "SELECT (SELECT count(*) FROM public.plain_queue),
                    (SELECT count(*) FROM public.plain_queue WHERE state = 'pending')"
        }
    };
    let r: (i64, i64) = sqlx::query_as(sql).fetch_one(db.pool()).await?;
    db.pool().close().await;
    Ok(r)
}

/// Adds `count` pending steps the way `durable.submit_run` leaves them
/// (a workflow_runs row per run with its SUBMITTED transition, step_defs,
/// step_runs rows with their creation transition), in one INSERT … SELECT
/// generate_series per table and chunk. Triggers are bypassed
/// (`session_replication_role = replica`) and the creation transitions they
/// would write are inserted explicitly: same rows, no per-row plpgsql, no
/// NOTIFY. `next_attempt_at` rises by 1 µs per row (FIFO order), and the
/// run and step ids are time-ordered like `durable.time_ordered_uuid()`'s
/// (UUID version 7, from the same times), as if submitted at those times.
async fn fill_runtime(db: &Db, count: u64, spr: u64) -> Result<()> {
    let tag = Uuid::new_v4().simple().to_string();
    let spec = serde_json::json!({
        "name": "bench",
        "steps": (0..spr).map(|i| serde_json::json!({
            "name": format!("s{i}"), "executor_kind": EXECUTOR_KIND, "kind": KIND, "input": {"n": i}
        })).collect::<Vec<_>>()
    });
    let retry = serde_json::json!({"max_attempts": 3, "initial_interval_ms": 1000,
        "backoff_coefficient": 2.0, "max_interval_ms": 60000, "non_retryable_codes": []});
    let t0: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT now() - make_interval(secs => $1::double precision / 1e6 + 1)")
            .bind(count as f64)
            .fetch_one(db.pool())
            .await?;
    let chunk = (FILL_CHUNK / spr).max(1) * spr;
    let mut g0 = 0u64;
    while g0 < count {
        let n = chunk.min(count - g0);
        let mut tx = db.pool().begin().await?;
        sqlx::query("SET LOCAL session_replication_role = replica")
            .execute(&mut *tx)
            .await?;
        sqlx::query(&format!(
            "CREATE TEMP TABLE bench_fill ON COMMIT DROP AS
             SELECT g,
                    (lpad(to_hex(floor(extract(epoch FROM '{t0}'::timestamptz
                                 + (g / {spr}) * {spr} * interval '1 microsecond') * 1000)::bigint), 12, '0')
                     || '7' || substr(md5('{tag}-' || (g / {spr})), 14, 3)
                     || '8' || substr(md5('{tag}-' || (g / {spr})), 18, 15))::uuid AS run_id,
                    (g % {spr})::int AS pos,
                    (lpad(to_hex(floor(extract(epoch FROM '{t0}'::timestamptz + g * interval '1 microsecond') * 1000)::bigint), 12, '0')
                     || '7' || substr(md5(random()::text), 14, 3)
                     || '8' || substr(md5(random()::text), 18, 15))::uuid AS sid,
                    '{t0}'::timestamptz + g * interval '1 microsecond' AS t
               FROM generate_series({g0}::bigint, {end}::bigint) g",
            t0 = t0.to_rfc3339(),
            end = g0 + n - 1
        ))
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO durable.workflow_runs (id, name, spec, created_at, updated_at)
             SELECT run_id, 'bench', $1, t, t FROM bench_fill WHERE pos = 0",
        )
        .bind(&spec)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO durable.transitions (run_id, from_state, to_state, reason, at)
             SELECT run_id, NULL, 'pending', 'SUBMITTED', t FROM bench_fill WHERE pos = 0",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO durable.step_defs (run_id, name, position, executor_kind, kind, input,
                                            depends_on, labels, retry, secrets)
             SELECT run_id, 's' || pos, pos, $1, $2, jsonb_build_object('n', g), '{}', '{}', $3, '{}'
               FROM bench_fill",
        )
        .bind(EXECUTOR_KIND)
        .bind(KIND)
        .bind(&retry)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO durable.step_runs (id, run_id, name, position, executor_kind, kind, labels, input,
                                            idempotency_key, retry, secrets, next_attempt_at, created_at,
                                            updated_at, transition_reason)
             SELECT sid, run_id, 's' || pos, pos, $1, $2, '{}', jsonb_build_object('n', g),
                    run_id::text || '/s' || pos, $3, '{}', t, t, t, 'SUBMITTED'
               FROM bench_fill",
        )
        .bind(EXECUTOR_KIND)
        .bind(KIND)
        .bind(&retry)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO durable.transitions (run_id, step_run_id, from_state, to_state, attempt, reason, at)
             SELECT run_id, sid, NULL, 'pending', 0, 'SUBMITTED', t FROM bench_fill",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        g0 += n;
    }
    Ok(())
}

async fn fill_plain(db: &Db, count: u64) -> Result<()> {
    let mut g0 = 0u64;
    while g0 < count {
        let n = FILL_CHUNK.min(count - g0);
        sqlx::query(
            "INSERT INTO public.plain_queue (id, state, next_attempt_at)
             SELECT gen_random_uuid(), 'pending',
                    now() - make_interval(secs => $3::double precision / 1e6 + 1) + g * interval '1 microsecond'
               FROM generate_series($1::bigint, $2::bigint) g",
        )
        .bind(g0 as i64)
        .bind((g0 + n - 1) as i64)
        .bind(count as f64)
        .execute(db.pool())
        .await?;
        g0 += n;
    }
    Ok(())
}

/// Tops the implementation's pending rows back up to `backlog`, then VACUUM
/// ANALYZE its queue table(s) so every cell starts from the same clean state.
async fn prepare(url: &str, imp: Imp, backlog: u64, spr: u64) -> Result<()> {
    let (_, pending) = counts(url, imp).await?;
    let db = Db::connect(url, 1).await?;
    let missing = backlog.saturating_sub(pending.max(0) as u64);
    // whole runs only
    let missing = missing.div_ceil(spr) * spr;
    if missing > 0 {
        match imp {
            Imp::Runtime => fill_runtime(&db, missing, spr).await?,
            Imp::Plain => fill_plain(&db, missing).await?,
        }
    }
    let vac = match imp {
        Imp::Runtime => "VACUUM (ANALYZE) durable.step_runs, durable.workflow_runs",
        Imp::Plain => "VACUUM (ANALYZE) public.plain_queue",
    };
    sqlx::query(vac).execute(db.pool()).await?;
    db.pool().close().await;
    Ok(())
}

/// Marks finished (succeeded) the oldest pending rows until `pct`% of all
/// rows are finished: one UPDATE with triggers bypassed (no history rows are
/// written for them), then VACUUM ANALYZE, as autovacuum would eventually.
async fn finish_share(url: &str, imp: Imp, pct: u32) -> Result<(i64, i64)> {
    let db = Db::connect(url, 1).await?;
    let (total_sql, done_sql) = match imp {
        Imp::Runtime => (
            "SELECT count(*) FROM durable.step_runs",
            "SELECT count(*) FROM durable.step_runs WHERE state IN ('succeeded', 'terminal_failed', 'cancelled')",
        ),
        Imp::Plain => (
            "SELECT count(*) FROM public.plain_queue",
            "SELECT count(*) FROM public.plain_queue WHERE state = 'succeeded'",
        ),
    };
    let total: i64 = sqlx::query_scalar(total_sql).fetch_one(db.pool()).await?;
    let done: i64 = sqlx::query_scalar(done_sql).fetch_one(db.pool()).await?;
    let need = (total * pct as i64 / 100 - done).max(0);
    let mut tx = db.pool().begin().await?;
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *tx)
        .await?;
    let sql = match imp {
        Imp::Runtime => {
            "UPDATE durable.step_runs s
                SET state = 'succeeded', attempt = 1, lease_token = gen_random_uuid(),
                    leased_at = now(), started_at = now(), finished_at = now(), updated_at = now(),
                    output = s.input, transition_reason = 'SUCCEEDED', transition_by = 'bench-fixture'
              WHERE s.id IN (SELECT id FROM durable.step_runs WHERE state = 'pending'
                              ORDER BY next_attempt_at LIMIT $1)"
        }
        Imp::Plain => {
            "UPDATE public.plain_queue SET state = 'succeeded', lease_token = gen_random_uuid()
              WHERE id IN (SELECT id FROM public.plain_queue WHERE state = 'pending'
                            ORDER BY next_attempt_at LIMIT $1)"
        }
    };
    sqlx::query(sql).bind(need).execute(&mut *tx).await?;
    tx.commit().await?;
    let vac = match imp {
        Imp::Runtime => "VACUUM (ANALYZE) durable.step_runs",
        Imp::Plain => "VACUUM (ANALYZE) public.plain_queue",
    };
    sqlx::query(vac).execute(db.pool()).await?;
    db.pool().close().await;
    Ok((total, need))
}

struct TableSize {
    name: String,
    rows: i64,
    total: i64,
    heap: i64,
    indexes: i64,
}

async fn table_sizes(url: &str) -> Result<Vec<TableSize>> {
    let db = Db::connect(url, 1).await?;
    let mut out = Vec::new();
    for t in [
        "durable.step_runs",
        "durable.transitions",
        "durable.step_events",
        "durable.workflow_runs",
        "durable.step_defs",
        "public.plain_queue",
    ] {
        let (rows, total, heap, indexes): (i64, i64, i64, i64) = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {t}), pg_total_relation_size('{t}'),
                    pg_relation_size('{t}'), pg_indexes_size('{t}')"
        ))
        .fetch_one(db.pool())
        .await?;
        out.push(TableSize {
            name: t.into(),
            rows,
            total,
            heap,
            indexes,
        });
    }
    db.pool().close().await;
    Ok(out)
}

// ---------------------------------------------------------------------------
// main

#[tokio::main]
async fn main() {
    let args = Args::parse();
    run_and_clean_up("bench_queue", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: Arc<Mutex<Vec<String>>>) -> Result<()> {
    if args.backlogs.is_empty() || args.workers.is_empty() || args.batches.is_empty() {
        bail!("--backlogs, --workers and --batches need at least one value");
    }
    if args.steps_per_run == 0 || args.batches.contains(&0) || args.workers.contains(&0) {
        bail!("--steps-per-run, --workers and --batches must be positive");
    }
    let duration = Duration::from_secs_f64(args.duration_secs);
    let admin = Db::connect(&args.database_url, 1)
        .await
        .context("connecting to DATABASE_URL")?;

    println!("== bench_queue: lease→complete throughput and lease latency");
    let mut report = Report::new("bench_queue");
    report.set_setup(print_setup(&admin, &args.database_url).await?);
    report.set_params(
        serde_json::json!({"backlogs": args.backlogs, "workers": args.workers,
        "batches": args.batches, "duration_secs": args.duration_secs,
        "steps_per_run": args.steps_per_run, "finished_pct": args.finished_pct}),
    );
    println!(
        "parameters  : backlogs {:?}, workers {:?}, batch sizes {:?}, {} s per cell, {} step(s) per run, \
         finished share for the last phase {}%",
        args.backlogs, args.workers, args.batches, args.duration_secs, args.steps_per_run, args.finished_pct
    );
    println!(
        "method      : every cell runs `runtime` (Db::lease with one route → Db::mark_running → Db::complete,\n\
         \x20             output = input, terminal event) and then `plain` (UPDATE … IN (SELECT … FOR UPDATE SKIP\n\
         \x20             LOCKED LIMIT b) RETURNING, then UPDATE … SET state='succeeded' WHERE id AND token), in\n\
         \x20             this process, N workers each with its own pool of 1 connection, after one warm-up step\n\
         \x20             per worker. Before each cell the pending rows are topped up to the backlog (untimed) and\n\
         \x20             the queue tables are VACUUM ANALYZEd (untimed). A cell ends after the duration or once it\n\
         \x20             has taken half the backlog (marked `cap`). Backlog rows are inserted with triggers\n\
         \x20             bypassed but with the transition rows the triggers would write; 1 µs apart in\n\
         \x20             next_attempt_at. `db CPU` = user+sys CPU of the workers' PostgreSQL backends\n\
         \x20             (/proc/<pid>/stat), `in triggers` = wall time inside the step_runs trigger functions\n\
         \x20             on_step_transition + guard_step_update (pg_stat_user_functions, track_functions = pl\n\
         \x20             on the worker connections; a part of the statements' time), `bench CPU` = this process\n\
         \x20             (getrusage), `machine busy` = all CPUs (/proc/stat; other users of the machine included)."
    );
    println!();

    let mut cells: Vec<Cell> = Vec::new();
    let mut sizes_by_backlog = Vec::new();
    let mut finished_cells: Vec<Cell> = Vec::new();
    let mut finished_info = None;
    let largest = *args.backlogs.iter().max().unwrap();
    for (bi, &backlog) in args.backlogs.iter().enumerate() {
        let name = format!("bench_q_{}", &Uuid::new_v4().simple().to_string()[..12]);
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(admin.pool())
            .await?;
        created.lock().unwrap().push(name.clone());
        let url = db_url(&args.database_url, &name);
        {
            let db = Db::connect(&url, 1).await?;
            db.migrate().await?;
            sqlx::query(PLAIN_DDL).execute(db.pool()).await?;
            sqlx::query(PLAIN_INDEX).execute(db.pool()).await?;
            let t = Instant::now();
            fill_runtime(&db, backlog, args.steps_per_run).await?;
            let rt = t.elapsed();
            let t = Instant::now();
            fill_plain(&db, backlog).await?;
            let pt = t.elapsed();
            eprintln!(
                "[backlog {backlog}] filled: runtime {:.1} s, plain {:.1} s",
                rt.as_secs_f64(),
                pt.as_secs_f64()
            );
            db.pool().close().await;
        }
        let cap = (backlog / 2).max(1);
        for &w in &args.workers {
            for &b in &args.batches {
                for imp in [Imp::Runtime, Imp::Plain] {
                    prepare(&url, imp, backlog, args.steps_per_run).await?;
                    let cell =
                        run_cell(&url, imp, &fmt_count(backlog), w, b, duration, cap).await?;
                    eprintln!(
                        "[backlog {backlog}] {:<7} N={w:<2} batch={b:<3} {:>8} steps in {:>5.2} s = {:>8.0} steps/s, lease p50 {}",
                        imp.name(),
                        cell.steps,
                        cell.secs,
                        cell.steps_per_sec(),
                        fmt_ms(pct(&cell.leases, 50.0))
                    );
                    cells.push(cell);
                }
            }
        }
        sizes_by_backlog.push((backlog, table_sizes(&url).await?));

        if backlog == largest
            && args.finished_pct > 0
            && !args.backlogs[bi + 1..].contains(&largest)
        {
            let mut info = Vec::new();
            for imp in [Imp::Runtime, Imp::Plain] {
                let t = Instant::now();
                let (total, finished_now) = finish_share(&url, imp, args.finished_pct).await?;
                eprintln!(
                    "[finished phase] {}: marked {finished_now} of {total} rows finished in {:.1} s (+ VACUUM)",
                    imp.name(),
                    t.elapsed().as_secs_f64()
                );
                info.push((imp, total, finished_now));
                for &b in &args.batches {
                    let cap = (counts(&url, imp).await?.1.max(2) / 2) as u64;
                    let cell = run_cell(
                        &url,
                        imp,
                        &format!("{}% finished", args.finished_pct),
                        1,
                        b,
                        duration,
                        cap,
                    )
                    .await?;
                    eprintln!(
                        "[finished phase] {:<7} N=1 batch={b:<3} {:>8} steps in {:>5.2} s, lease p50 {}",
                        imp.name(),
                        cell.steps,
                        cell.secs,
                        fmt_ms(pct(&cell.leases, 50.0))
                    );
                    finished_cells.push(cell);
                }
            }
            finished_info = Some(info);
        }
        drop_databases(&args.database_url, std::slice::from_ref(&name)).await;
        created.lock().unwrap().retain(|n| n != &name);
    }
    admin.pool().close().await;

    // --- report
    println!("-- throughput (steps/s = completed steps / wall time of the cell)");
    let mut rows = Vec::new();
    for c in &cells {
        let plain = (c.imp == Imp::Runtime)
            .then(|| {
                cells.iter().find(|p| {
                    p.imp == Imp::Plain
                        && p.label == c.label
                        && p.workers == c.workers
                        && p.batch == c.batch
                })
            })
            .flatten();
        rows.push(vec![
            c.label.clone(),
            c.imp.name().into(),
            c.workers.to_string(),
            c.batch.to_string(),
            fmt_count(c.pending_at_start as u64),
            c.steps.to_string(),
            format!("{:.2}{}", c.secs, if c.capped { " cap" } else { "" }),
            format!("{:.0}", c.steps_per_sec()),
            plain
                .map(|p| format!("{:.1}x", p.steps_per_sec() / c.steps_per_sec()))
                .unwrap_or_default(),
            c.db_cpu
                .map(|v| format!("{:.0}", v * 1e6 / c.steps.max(1) as f64))
                .unwrap_or("n/a".into()),
            match (c.imp, c.trigger_time) {
                (Imp::Plain, _) => "-".into(),
                (_, Some(t)) => format!("{:.0}", t * 1e6 / c.steps.max(1) as f64),
                (_, None) => "n/a".into(),
            },
            format!("{:.0}", c.bench_cpu * 1e6 / c.steps.max(1) as f64),
            c.busy
                .map(|b| format!("{:.0}%", b * 100.0))
                .unwrap_or("n/a".into()),
        ]);
    }
    print_table(
        &[
            "backlog",
            "impl",
            "N",
            "batch",
            "pending@start",
            "steps",
            "secs",
            "steps/s",
            "plain/runtime",
            "db CPU µs/step",
            "in triggers µs/step",
            "bench CPU µs/step",
            "machine busy",
        ],
        2,
        &rows,
    );
    println!();

    println!("-- latency per statement (ms; all workers' calls in the cell)");
    let mut rows = Vec::new();
    for c in cells.iter().chain(finished_cells.iter()) {
        rows.push(latency_row(c));
    }
    print_table(
        &[
            "backlog",
            "impl",
            "N",
            "batch",
            "rows",
            "lease p50",
            "lease p95",
            "lease p99",
            "rows/lease",
            "short",
            "mark_running p50",
            "p95",
            "complete p50",
            "p95",
        ],
        2,
        &rows,
    );
    println!("   rows = rows in the queue table at the start of the cell (pending + finished);");
    println!("   short = lease statements that returned fewer rows than asked for.");
    println!();

    if let Some(info) = &finished_info {
        println!(
            "-- lease latency vs finished rows (N = 1; the `{}% finished` rows above; rows marked finished by the fixture:{})",
            args.finished_pct,
            info.iter()
                .map(|(imp, total, n)| format!(" {} {n} of {total}", imp.name()))
                .collect::<String>()
        );
        let mut rows = Vec::new();
        for c in cells
            .iter()
            .filter(|c| c.workers == 1)
            .chain(finished_cells.iter())
        {
            rows.push(vec![
                c.label.clone(),
                c.imp.name().into(),
                c.batch.to_string(),
                fmt_count(c.pending_at_start as u64),
                fmt_count((c.rows_at_start - c.pending_at_start).max(0) as u64),
                fmt_ms(pct(&c.leases, 50.0)),
                fmt_ms(pct(&c.leases, 95.0)),
                fmt_ms(pct(&c.leases, 99.0)),
            ]);
        }
        print_table(
            &[
                "backlog",
                "impl",
                "batch",
                "pending",
                "finished",
                "lease p50",
                "p95",
                "p99",
            ],
            2,
            &rows,
        );
        println!();
    }

    for (backlog, sizes) in &sizes_by_backlog {
        println!(
            "-- table sizes after the cells of backlog {} (before any finished-phase fixture)",
            fmt_count(*backlog)
        );
        let rows: Vec<Vec<String>> = sizes
            .iter()
            .map(|s| {
                vec![
                    s.name.clone(),
                    s.rows.to_string(),
                    fmt_bytes(s.total),
                    fmt_bytes(s.heap),
                    fmt_bytes(s.indexes),
                    if s.rows > 0 {
                        format!("{:.0}", s.total as f64 / s.rows as f64)
                    } else {
                        "-".into()
                    },
                ]
            })
            .collect();
        print_table(
            &[
                "table",
                "rows",
                "total",
                "heap",
                "indexes",
                "total bytes/row",
            ],
            1,
            &rows,
        );
        println!();
    }
    for c in cells.iter().chain(finished_cells.iter()) {
        let setup = serde_json::json!({"impl": c.imp.name(), "backlog": c.label,
            "pending_at_start": c.pending_at_start, "rows_at_start": c.rows_at_start,
            "workers": c.workers, "batch": c.batch, "steps": c.steps, "secs": c.secs});
        report.figure(
            "lease→complete throughput",
            c.steps_per_sec(),
            "steps/s",
            setup.clone(),
        );
        report.figure("lease p50", c.leases_ms(50.0), "ms", setup.clone());
        report.figure("lease p99", c.leases_ms(99.0), "ms", setup);
    }
    // (f): lease latency at the largest backlog vs the smallest, one worker
    let smallest = *args.backlogs.iter().min().unwrap();
    if largest > smallest {
        for &b in &args.batches {
            let at = |backlog: u64| {
                cells.iter().find(|c| {
                    c.imp == Imp::Runtime
                        && c.workers == 1
                        && c.batch == b
                        && c.label == fmt_count(backlog)
                })
            };
            if let (Some(lo), Some(hi)) = (at(smallest), at(largest)) {
                report.target(
                    &format!("f.lease_latency_ratio_batch{b}"),
                    &format!(
                        "lease p50 at {} pending ≤ 1.3× at {} (issue: 1,000,000 vs 10,000); 1 worker, batch {b}",
                        fmt_count(largest),
                        fmt_count(smallest)
                    ),
                    hi.leases_ms(50.0) / lo.leases_ms(50.0),
                    Want::AtMost,
                    1.3,
                    "x",
                    serde_json::json!({"small_backlog": smallest, "large_backlog": largest, "batch": b,
                        "p50_ms_small": lo.leases_ms(50.0), "p50_ms_large": hi.leases_ms(50.0)}),
                );
            }
        }
    }
    report.print_targets();
    println!("load average at the end: {}", loadavg());
    report.write(args.json_out.as_deref())
}

fn latency_row(c: &Cell) -> Vec<String> {
    let opt = |v: &Vec<Duration>, p: f64| {
        if v.is_empty() {
            "-".to_string()
        } else {
            fmt_ms(pct(v, p))
        }
    };
    vec![
        c.label.clone(),
        c.imp.name().into(),
        c.workers.to_string(),
        c.batch.to_string(),
        fmt_count(c.rows_at_start as u64),
        fmt_ms(pct(&c.leases, 50.0)),
        fmt_ms(pct(&c.leases, 95.0)),
        fmt_ms(pct(&c.leases, 99.0)),
        format!("{:.1}", c.leased_rows as f64 / c.leases.len().max(1) as f64),
        c.short_leases.to_string(),
        opt(&c.mark, 50.0),
        opt(&c.mark, 95.0),
        opt(&c.complete, 50.0),
        opt(&c.complete, 95.0),
    ]
}

// ---------------------------------------------------------------------------
// measurement helpers (the same in bench_executors.rs)

/// Sum of the CPU seconds of these PostgreSQL backends (None if any is not
/// visible, e.g. a remote server).
fn backend_cpu(pids: &[i32]) -> Option<f64> {
    pids.iter().map(|&p| proc_cpu(p)).sum()
}

fn fmt_count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn fmt_bytes(b: i64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}
