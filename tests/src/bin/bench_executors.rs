//! Benchmark (not a test; run through `scripts/bench`): `demo.echo` steps per
//! second through the whole worker (an in-process `RunningWorker` with one
//! executor; K one-step runs submitted first, timed from the moment the worker
//! is started until all K runs succeeded), with the Go and with the Python
//! demo executor, beside the bare cost of one executor round trip with no
//! database, measured in the same run: spawn through `process::Spawner` (the
//! worker's spawn spec: cleared environment, own process group, per-attempt
//! directory with out/ and in/), read the hello, send the `Job`, read events
//! until the terminal, close stdin, wait for stdout EOF and the exit, reap.
//!
//! A fresh database `bench_e_*` is created, migrated, and dropped at the end
//! (also on error and on Ctrl-C).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use futures::StreamExt;
use supervisor::config::{ExecutorConfig, WorkerConfig};
use supervisor::db::Db;
use supervisor::process::Spawner;
use supervisor::wire::{self, EventKind, FromExecutor, ToExecutor};
use tests::bench::*;
use tests::{fast_config, go_demo, one_step, python_demo, RunningWorker};
use tokio::io::AsyncWriteExt;
use tokio_util::codec::FramedRead;
use uuid::Uuid;

#[derive(Parser, Debug, Clone)]
#[command(about = "demo.echo through the whole worker vs bare executor round trips")]
struct Args {
    /// Server where the benchmark may create and drop a database (bench_e_*).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// One-step runs submitted per worker measurement.
    #[arg(long, default_value_t = 200)]
    steps: u32,
    /// Bare round trips per measurement.
    #[arg(long, default_value_t = 100)]
    rounds: u32,
    /// Executor concurrency of the worker (and parallel bare round trips).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    concurrency: Vec<u32>,
    /// Which demo executors: go, python.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "go,python,go-persistent,python-persistent"
    )]
    executors: Vec<String>,
    /// Extra cells beyond the grid, EXECUTOR:CONCURRENCY (e.g.
    /// go-persistent:64, where a persistent pool's batches are full): that
    /// executor's bare and worker measurements and the plain-SQL baseline at
    /// that concurrency, each with max(--steps, 64 × concurrency) runs. The
    /// targets of (a)–(d) use each executor's largest concurrency measured.
    #[arg(long, value_delimiter = ',', value_parser = parse_extra)]
    extra: Vec<(String, u32)>,
    /// Give up on one worker measurement after this long.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,
    /// Write this benchmark's part of the JSON summary here.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

fn parse_extra(s: &str) -> Result<(String, u32), String> {
    let (ex, c) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("--extra {s:?}: expected EXECUTOR:CONCURRENCY"))?;
    let c: u32 = c
        .parse()
        .map_err(|_| format!("--extra {s:?}: {c:?} is not a concurrency"))?;
    if c == 0 {
        return Err(format!("--extra {s:?}: the concurrency must be positive"));
    }
    Ok((ex.to_string(), c))
}

/// Runs per worker measurement of an --extra cell at concurrency `c`.
fn extra_steps(steps: u32, c: u32) -> u32 {
    steps.max(64 * c)
}

const WARMUP_ROUNDS: u32 = 3;
/// Jobs per bare-exchange cell at least: a warm process answers a no-op
/// job in ~50 µs, so the quick sizes' 40–200 jobs took a few ms, too short
/// to time (left open two stops ago).
const EXCHANGE_MIN_JOBS: u32 = 3000;
const POLL: Duration = Duration::from_millis(10);

/// Runs done before the clock starts in a worker measurement.
fn warmup_runs(concurrency: u32) -> u32 {
    (2 * concurrency).max(5)
}

fn executor_config(which: &str) -> Result<ExecutorConfig> {
    match which {
        "go" => Ok(go_demo("go", &[], Some(&["demo.echo"]))),
        "python" => Ok(python_demo("python", &[], Some(&["demo.echo"]))),
        // the same executors kept warm between jobs (persistent sessions)
        "go-persistent" | "python-persistent" => {
            let mut c = executor_config(which.trim_end_matches("-persistent"))?;
            c.persistent = true;
            Ok(c)
        }
        other => bail!("unknown executor {other:?} (go, python, go-persistent, python-persistent)"),
    }
}

/// One bare round trip, split in phases.
#[derive(Debug, Clone, Copy)]
struct Trip {
    total: Duration,
    /// directory + spawn until the hello is read
    startup: Duration,
    /// job written until the terminal is read
    job: Duration,
    /// terminal read until the child is reaped and its directory removed
    exit: Duration,
}

async fn round_trip(spawner: &Spawner, cfg: &ExecutorConfig, n: u64) -> Result<Trip> {
    let t0 = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("durable-bench-")
        .tempdir()?;
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir)?;
    std::fs::create_dir(dir.path().join("in"))?;
    let Started {
        child,
        mut stdin,
        mut frames,
        executor_kind,
    } = start(spawner, cfg, dir.path()).await?;
    let t_hello = t0.elapsed();
    exchange(&mut stdin, &mut frames, &executor_kind, n, &out_dir).await?;
    let t_term = t0.elapsed();
    // as the worker does: close stdin, the executor exits; stdout EOF, exit, reap
    end(child, stdin, frames).await?;
    drop(dir);
    let total = t0.elapsed();
    Ok(Trip {
        total,
        startup: t_hello,
        job: t_term - t_hello,
        exit: total - t_term,
    })
}

/// A started executor process whose hello was read.
struct Started {
    child: supervisor::process::Child,
    stdin: tokio::process::ChildStdin,
    frames: wire::ExecutorFrames<tokio::process::ChildStdout>,
    executor_kind: String,
}

/// Spawns `cfg` in `dir` with the worker's spawn spec and reads its hello.
async fn start(spawner: &Spawner, cfg: &ExecutorConfig, dir: &std::path::Path) -> Result<Started> {
    let wcfg = WorkerConfig::default();
    let mut child = spawner
        .spawn(cfg.spawn_spec(dir, wcfg.stderr_tail_bytes))
        .await?;
    let stdout = child.take_stdout().context("no stdout pipe")?;
    let stdin = child.take_stdin().context("no stdin pipe")?;
    let mut frames = FramedRead::new(stdout, wire::executor_decoder(wcfg.max_frame_bytes));
    let hello = wire::read_hello(&mut frames, Duration::from_secs(30))
        .await
        .with_context(|| {
            format!(
                "reading the hello; stderr: {}",
                child.stderr().tail_string()
            )
        })?;
    Ok(Started {
        child,
        stdin,
        frames,
        executor_kind: hello.executor_kind,
    })
}

/// Ends a process as the worker does: close stdin, the executor exits;
/// stdout EOF (no frame after the last terminal), exit, reap.
async fn end(
    mut child: supervisor::process::Child,
    stdin: tokio::process::ChildStdin,
    mut frames: wire::ExecutorFrames<tokio::process::ChildStdout>,
) -> Result<()> {
    drop(stdin);
    if let Some(f) = frames.next().await {
        bail!(
            "a frame after the terminal: {:?}",
            f.map(|f| FromExecutor::from(f).name())
        );
    }
    child.exited().await?;
    let report = child.finish().await?;
    if !report.status.success() {
        bail!(
            "the executor {}; stderr: {}",
            report.status,
            report.stderr_tail
        );
    }
    Ok(())
}

/// One `demo.echo` job on an executor whose hello was read: the Job, then
/// its frames until the terminal (an ACCEPTED first, the input echoed back).
async fn exchange<W, R>(
    stdin: &mut W,
    frames: &mut wire::ExecutorFrames<R>,
    executor_kind: &str,
    n: u64,
    out_dir: &std::path::Path,
) -> Result<()>
where
    W: tokio::io::AsyncWrite + Unpin,
    R: tokio::io::AsyncRead + Unpin,
{
    let input = format!("{{\"i\": {n}}}").into_bytes();
    let job = wire::Job {
        job_id: format!("bench-{n}:1"),
        workflow_run_id: Uuid::new_v4().to_string(),
        step_run_id: Uuid::new_v4().to_string(),
        idempotency_key: format!("bench/{n}"),
        executor_kind: executor_kind.to_string(),
        kind: "demo.echo".into(),
        attempt: 1,
        deadline_unix_ms: 0,
        attempt_deadline_unix_ms: 0,
        heartbeat_timeout_ms: 0,
        input: input.clone(),
        input_artifacts: Vec::new(),
        checkpoint: None,
        output_dir: out_dir.to_string_lossy().into_owned(),
        secrets: BTreeMap::new(),
        labels: BTreeMap::new(),
        agreement: None,
    };
    stdin
        .write_all(&wire::encode_to_executor(&ToExecutor::Job(Box::new(job))))
        .await?;
    stdin.flush().await?;
    let mut accepted = false;
    loop {
        match frames.next().await {
            Some(Ok(f)) => match FromExecutor::from(f) {
                FromExecutor::Event(e) => accepted |= e.kind == EventKind::Accepted,
                FromExecutor::Result(r) => {
                    if !accepted {
                        bail!("result before accepted");
                    }
                    let got: serde_json::Value = serde_json::from_slice(&r.output)?;
                    let want: serde_json::Value = serde_json::from_slice(&input)?;
                    if got != want {
                        bail!("echo returned {got}, expected {want}");
                    }
                    return Ok(());
                }
                FromExecutor::Error(e) => bail!("job failed: {} {}", e.code, e.message),
                other => bail!("unexpected {} during the job", other.name()),
            },
            Some(Err(e)) => bail!("reading the job's frames: {e}"),
            None => bail!("stdout closed without a terminal"),
        }
    }
}

struct BareCell {
    executor: String,
    concurrency: u32,
    trips: Vec<Trip>,
    secs: f64,
    child_cpu: f64,
    bench_cpu: f64,
    busy: Option<f64>,
}

impl BareCell {
    /// Round trips per second of wall time.
    fn rate(&self) -> f64 {
        self.trips.len() as f64 / self.secs
    }

    /// Two measurements of the same cell as one: their trips, times and
    /// CPU added up (the machine's busy share weighted by time).
    fn merge(mut self, other: BareCell) -> BareCell {
        self.busy = match (self.busy, other.busy) {
            (Some(a), Some(b)) => Some((a * self.secs + b * other.secs) / (self.secs + other.secs)),
            (a, b) => a.or(b),
        };
        self.trips.extend(other.trips);
        self.secs += other.secs;
        self.child_cpu += other.child_cpu;
        self.bench_cpu += other.bench_cpu;
        self
    }
}

async fn bare(
    spawner: &Spawner,
    cfg: &ExecutorConfig,
    which: &str,
    conc: u32,
    rounds: u32,
) -> Result<BareCell> {
    let cpu_c0 = rusage(libc::RUSAGE_CHILDREN);
    let cpu_s0 = self_cpu();
    let stat0 = machine_cpu();
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for w in 0..conc {
        let n = rounds / conc + u32::from(w < rounds % conc);
        let (spawner, cfg) = (spawner.clone(), cfg.clone());
        handles.push(tokio::spawn(async move {
            let mut trips = Vec::with_capacity(n as usize);
            for i in 0..n {
                trips.push(round_trip(&spawner, &cfg, (w as u64) << 32 | i as u64).await?);
            }
            anyhow::Ok(trips)
        }));
    }
    let mut trips = Vec::new();
    for h in handles {
        trips.extend(h.await??);
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(BareCell {
        executor: which.into(),
        concurrency: conc,
        trips,
        secs,
        child_cpu: rusage(libc::RUSAGE_CHILDREN) - cpu_c0,
        bench_cpu: self_cpu() - cpu_s0,
        busy: stat0.zip(machine_cpu()).map(|(a, b)| busy_fraction(a, b)),
    })
}

/// The executors' own limit for a persistent pool (no database): `conc`
/// processes started and handshaken first, as a persistent pool holds them
/// (untimed), then each fed its share of `jobs` back to back, one at a
/// time, as a persistent session serves them; the clock runs from the first
/// job to the last terminal. What a worker over the same pool could reach if
/// the database cost nothing.
struct ExchangeCell {
    executor: String,
    concurrency: u32,
    jobs: Vec<Duration>,
    secs: f64,
    child_cpu: f64,
    bench_cpu: f64,
    busy: Option<f64>,
}

async fn bare_exchange(
    spawner: &Spawner,
    cfg: &ExecutorConfig,
    which: &str,
    conc: u32,
    jobs: u32,
) -> Result<ExchangeCell> {
    let dir = tempfile::Builder::new()
        .prefix("durable-bench-")
        .tempdir()?;
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir)?;
    let mut children = Vec::new();
    let mut ends = Vec::new();
    for _ in 0..conc {
        let p = start(spawner, cfg, dir.path()).await?;
        children.push(p.child);
        ends.push((p.stdin, p.frames, p.executor_kind));
    }
    // a few untimed jobs per process first (the first job of a process
    // pays for its lazy initialisation)
    for (w, (stdin, frames, ek)) in ends.iter_mut().enumerate() {
        for i in 0..WARMUP_ROUNDS {
            exchange(
                stdin,
                frames,
                ek,
                ((2_000_000 + w as u64) << 32) | i as u64,
                &out_dir,
            )
            .await?;
        }
    }
    let live0 = live_children_cpu();
    let cpu_c0 = rusage(libc::RUSAGE_CHILDREN);
    let cpu_s0 = self_cpu();
    let stat0 = machine_cpu();
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for (w, (mut stdin, mut frames, ek)) in ends.into_iter().enumerate() {
        let n = jobs / conc + u32::from((w as u32) < jobs % conc);
        let out_dir = out_dir.clone();
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(n as usize);
            for i in 0..n {
                let t = Instant::now();
                exchange(
                    &mut stdin,
                    &mut frames,
                    &ek,
                    (w as u64) << 32 | i as u64,
                    &out_dir,
                )
                .await?;
                lat.push(t.elapsed());
            }
            anyhow::Ok((lat, stdin, frames))
        }));
    }
    let mut lat = Vec::new();
    let mut ends = Vec::new();
    for h in handles {
        let (l, stdin, frames) = h.await??;
        lat.extend(l);
        ends.push((stdin, frames));
    }
    let secs = t0.elapsed().as_secs_f64();
    let live1 = live_children_cpu();
    let child_cpu = children_cpu_between(cpu_c0, &live0, rusage(libc::RUSAGE_CHILDREN), &live1);
    let bench_cpu = self_cpu() - cpu_s0;
    let busy = stat0.zip(machine_cpu()).map(|(a, b)| busy_fraction(a, b));
    // as the worker retires a process: close stdin, stdout EOF, exit, reap
    for ((stdin, frames), child) in ends.into_iter().zip(children) {
        end(child, stdin, frames).await?;
    }
    drop(dir);
    Ok(ExchangeCell {
        executor: which.into(),
        concurrency: conc,
        jobs: lat,
        secs,
        child_cpu,
        bench_cpu,
        busy,
    })
}

struct WorkerCell {
    executor: String,
    concurrency: u32,
    steps: u32,
    submit_secs: f64,
    secs: f64,
    lease_to_started: Vec<Duration>,
    started_to_finished: Vec<Duration>,
    finished_to_next: Vec<Duration>,
    db_cpu: Option<f64>,
    child_cpu: f64,
    bench_cpu: f64,
    busy: Option<f64>,
}

/// CPU seconds of every backend connected to the current database, by pid,
/// except the asking connection (the benchmark's own polling).
async fn db_backends(db: &Db) -> Result<Vec<(i32, Option<f64>)>> {
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()
            AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
    )
    .fetch_all(db.pool())
    .await?;
    Ok(pids.into_iter().map(|p| (p, proc_cpu(p))).collect())
}

/// CPU used by the backends between two snapshots (new backends count from 0).
fn db_cpu_between(before: &[(i32, Option<f64>)], after: &[(i32, Option<f64>)]) -> Option<f64> {
    let mut sum = 0.0;
    for (pid, cpu) in after {
        let now = (*cpu)?;
        let then = before
            .iter()
            .find(|(p, _)| p == pid)
            .map(|(_, c)| *c)
            .unwrap_or(Some(0.0))?;
        sum += now - then;
    }
    Some(sum)
}

/// Waits until every run of `ids` is finished. Runs are leased oldest first,
/// so the last one submitted is among the last to end: it is polled by its
/// key every POLL (microseconds; a scan for open runs, a count or an ordered
/// probe of the open-runs index, costs milliseconds at tens of thousands of
/// runs, taken from the cores the worker measured here runs on), and only
/// once it is finished are all of them checked.
async fn wait_finished(db: &Db, ids: &[Uuid], timeout: Duration) -> Result<()> {
    let Some(last) = ids.last() else {
        return Ok(());
    };
    let t = Instant::now();
    loop {
        let finished: bool = sqlx::query_scalar(
            "SELECT finished_at IS NOT NULL FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(last)
        .fetch_one(db.pool())
        .await?;
        if finished {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM durable.workflow_runs WHERE id = ANY($1) AND finished_at IS NULL",
            )
            .bind(ids)
            .fetch_one(db.pool())
            .await?;
            if open == 0 {
                return Ok(());
            }
        }
        if t.elapsed() > timeout {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM durable.workflow_runs WHERE id = ANY($1) AND finished_at IS NULL",
            )
            .bind(ids)
            .fetch_one(db.pool())
            .await?;
            bail!("{open} of {} runs still open after {timeout:?}", ids.len());
        }
        tokio::time::sleep(POLL).await;
    }
}

async fn through_worker(
    url: &str,
    which: &str,
    conc: u32,
    steps: u32,
    timeout: Duration,
) -> Result<WorkerCell> {
    // one connection: submits, polling, and excluded from the db CPU
    let db = Db::connect(url, 1).await?;
    let mut ecfg = executor_config(which)?;
    ecfg.concurrency = conc;
    let ek = which.trim_end_matches("-persistent").to_string();
    // warm-up runs first (FIFO: leased first), so the measured runs find the
    // worker's connections open and its statements prepared
    let warm = warmup_runs(conc);
    let mut all_ids = Vec::new();
    for i in 0..warm {
        let spec = one_step(
            &format!("warm-{which}-{conc}-{i}"),
            &ek,
            "demo.echo",
            serde_json::json!({"warm": i}),
        );
        all_ids.push(db.submit(&spec).await?);
    }
    let t = Instant::now();
    let mut ids = Vec::with_capacity(steps as usize);
    for i in 0..steps {
        let spec = one_step(
            &format!("bench-{which}-{conc}-{i}"),
            &ek,
            "demo.echo",
            serde_json::json!({"i": i}),
        );
        ids.push(db.submit(&spec).await?);
    }
    let submit_secs = t.elapsed().as_secs_f64();
    // statistics as a database that has been in use has them (autovacuum
    // analyzes within a minute; the worker's plans are made on first use)
    sqlx::query("ANALYZE").execute(db.pool()).await?;

    let mut wcfg = fast_config(vec![ecfg]);
    // the pool a worker's config must have at this concurrency (the config
    // refuses less); connections open only when used: a no-op step uses none
    wcfg.db_max_connections = wcfg.db_max_connections.max(wcfg.min_db_connections());
    let wdb = Db::connect(url, wcfg.db_max_connections).await?;
    let worker = RunningWorker::start(wdb, wcfg).await;
    // the clock starts once the warm-up runs are done
    if let Err(e) = wait_finished(&db, &all_ids, timeout).await {
        worker.shutdown().await;
        return Err(e.context("the warm-up runs"));
    }
    all_ids.extend(ids.iter().copied());
    let db_cpu0 = db_backends(&db).await?;
    let live0 = live_children_cpu();
    let cpu_c0 = rusage(libc::RUSAGE_CHILDREN);
    let cpu_s0 = self_cpu();
    let stat0 = machine_cpu();
    let db_t0: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(db.pool())
        .await?;
    if let Err(e) = wait_finished(&db, &ids, timeout).await {
        worker.shutdown().await;
        return Err(e);
    }
    // from the clock's start to the last run's end, both on the database's
    // clock (the poll's own delay is not counted)
    let db_t1: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(finished_at))::float8 FROM durable.workflow_runs WHERE id = ANY($1)",
    )
    .bind(&ids)
    .fetch_one(db.pool())
    .await?;
    let secs = db_t1 - db_t0;
    let db_cpu1 = db_backends(&db).await?;
    // reaped executors, and the persistent ones still live
    let child_cpu = children_cpu_between(
        cpu_c0,
        &live0,
        rusage(libc::RUSAGE_CHILDREN),
        &live_children_cpu(),
    );
    let bench_cpu = self_cpu() - cpu_s0;
    let stat1 = machine_cpu();
    worker.shutdown().await;

    let bad: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, state FROM durable.workflow_runs WHERE id = ANY($1) AND state <> 'succeeded'",
    )
    .bind(&all_ids)
    .fetch_all(db.pool())
    .await?;
    if let Some((id, state)) = bad.first() {
        let st = db.status(*id).await?;
        bail!(
            "{} of {} runs did not succeed; e.g. {id} is {state}: {}",
            bad.len(),
            all_ids.len(),
            serde_json::to_string(&st).unwrap_or_default()
        );
    }
    // the gap to the next lease is the complete transaction, the attempt's end
    // and the worker loop; meaningful only when one attempt runs at a time
    let phases: Vec<(f64, f64, Option<f64>)> = sqlx::query_as(
        "SELECT extract(epoch FROM started_at - leased_at)::float8,
                extract(epoch FROM finished_at - started_at)::float8,
                extract(epoch FROM lead(leased_at) OVER (ORDER BY leased_at) - finished_at)::float8
           FROM durable.step_runs WHERE run_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(db.pool())
    .await?;
    db.pool().close().await;
    Ok(WorkerCell {
        executor: which.into(),
        concurrency: conc,
        steps,
        submit_secs,
        secs,
        lease_to_started: phases
            .iter()
            .map(|p| Duration::from_secs_f64(p.0.max(0.0)))
            .collect(),
        started_to_finished: phases
            .iter()
            .map(|p| Duration::from_secs_f64(p.1.max(0.0)))
            .collect(),
        finished_to_next: phases
            .iter()
            .filter_map(|p| p.2)
            .map(|g| Duration::from_secs_f64(g.max(0.0)))
            .collect(),
        db_cpu: db_cpu_between(&db_cpu0, &db_cpu1),
        child_cpu,
        bench_cpu,
        busy: stat0.zip(stat1).map(|(a, b)| busy_fraction(a, b)),
    })
}

// ---------------------------------------------------------------------------
// the database's limit: the same transitions as plain SQL, batched the same way

const PLAIN_DDL: &str = "CREATE TABLE IF NOT EXISTS public.plain_jobs (
    id          uuid PRIMARY KEY,
    state       text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    lease_token uuid,
    input       jsonb NOT NULL,
    output      jsonb
)";
const PLAIN_INDEX: &str = "CREATE INDEX IF NOT EXISTS plain_jobs_pending
    ON public.plain_jobs (created_at) WHERE state = 'pending'";
const PLAIN_INSERT: &str =
    "INSERT INTO public.plain_jobs (id, state, input) VALUES ($1, 'pending', $2)";
const PLAIN_CLAIM: &str = "UPDATE public.plain_jobs j
    SET state = 'leased', lease_token = gen_random_uuid()
  WHERE j.id IN (SELECT id FROM public.plain_jobs WHERE state = 'pending'
                  ORDER BY created_at LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING j.id, j.lease_token";
const PLAIN_START: &str = "UPDATE public.plain_jobs SET state = 'running'
  WHERE id = $1 AND lease_token = $2 AND state = 'leased'";
const PLAIN_COMPLETE: &str = "UPDATE public.plain_jobs SET state = 'succeeded', output = input
  WHERE id = $1 AND lease_token = $2 AND state = 'running'";
// set-based: the claimed jobs' starts in one statement, then their
// completions in one, each row fenced by its token and state, as the
// worker's ledger writes a batch over arrays
const PLAIN_START_SET: &str = "UPDATE public.plain_jobs j SET state = 'running'
   FROM unnest($1::uuid[], $2::uuid[]) AS x(id, token)
  WHERE j.id = x.id AND j.lease_token = x.token AND j.state = 'leased'";
const PLAIN_COMPLETE_SET: &str =
    "UPDATE public.plain_jobs j SET state = 'succeeded', output = j.input
   FROM unnest($1::uuid[], $2::uuid[]) AS x(id, token)
  WHERE j.id = x.id AND j.lease_token = x.token AND j.state = 'running'";

/// How the plain baseline writes its claimed jobs' starts and completions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PlainMode {
    /// one statement per job and transition, `c` jobs at once on their own
    /// connections
    PerRow,
    /// one statement per transition for all the claimed jobs, on one
    /// connection (the database's limit for these transitions)
    SetBased,
}

impl PlainMode {
    fn label(self) -> &'static str {
        match self {
            PlainMode::PerRow => "per row",
            PlainMode::SetBased => "set-based",
        }
    }
}

struct PlainCell {
    mode: PlainMode,
    concurrency: u32,
    jobs: u32,
    insert_secs: f64,
    secs: f64,
    claims: u32,
}

/// K jobs inserted one statement each (as runs are submitted), then one loop
/// claims up to `conc` pending jobs per statement (SKIP LOCKED, as the worker
/// leases up to its free slots) and the claimed jobs are started and
/// completed, each row fenced by its token and state: per row, each job on
/// its own connection, `conc` at once; set-based, one statement for all the
/// claimed jobs' starts and one for their completions.
async fn plain_cycle(url: &str, mode: PlainMode, conc: u32, jobs: u32) -> Result<PlainCell> {
    let db = plain_db(url, conc + 1).await?;
    sqlx::query(PLAIN_DDL).execute(db.pool()).await?;
    sqlx::query(PLAIN_INDEX).execute(db.pool()).await?;
    sqlx::query("TRUNCATE public.plain_jobs")
        .execute(db.pool())
        .await?;
    // warm every connection (and its prepared statements) with one job each
    let warm_ids: Vec<Uuid> = (0..conc).map(|_| Uuid::new_v4()).collect();
    for id in &warm_ids {
        sqlx::query(PLAIN_INSERT)
            .bind(id)
            .bind(serde_json::json!({"warm": true}))
            .execute(db.pool())
            .await?;
    }
    plain_drain(&db, mode, conc).await?;
    let t = Instant::now();
    for i in 0..jobs {
        sqlx::query(PLAIN_INSERT)
            .bind(Uuid::new_v4())
            .bind(serde_json::json!({"i": i}))
            .execute(db.pool())
            .await?;
    }
    let insert_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (done, claims) = plain_drain(&db, mode, conc).await?;
    let secs = t.elapsed().as_secs_f64();
    db.pool().close().await;
    if done != jobs as u64 {
        bail!("plain baseline completed {done} of {jobs} jobs");
    }
    Ok(PlainCell {
        mode,
        concurrency: conc,
        jobs,
        insert_secs,
        secs,
        claims,
    })
}

/// Claims, starts and completes jobs until none is pending: (jobs, claims).
async fn plain_drain(db: &Db, mode: PlainMode, conc: u32) -> Result<(u64, u32)> {
    let mut done = 0u64;
    let mut claims = 0u32;
    loop {
        let rows: Vec<(Uuid, Uuid)> = sqlx::query_as(PLAIN_CLAIM)
            .bind(conc as i64)
            .fetch_all(db.pool())
            .await?;
        claims += 1;
        if rows.is_empty() {
            return Ok((done, claims));
        }
        let n = rows.len() as u64;
        if mode == PlainMode::SetBased {
            let (ids, tokens): (Vec<Uuid>, Vec<Uuid>) = rows.into_iter().unzip();
            for sql in [PLAIN_START_SET, PLAIN_COMPLETE_SET] {
                let got = sqlx::query(sql)
                    .bind(&ids)
                    .bind(&tokens)
                    .execute(db.pool())
                    .await?
                    .rows_affected();
                if got != n {
                    bail!("plain jobs: a fenced set write updated {got} of {n} rows");
                }
            }
            done += n;
            continue;
        }
        futures::future::try_join_all(rows.into_iter().map(|(id, token)| async move {
            for sql in [PLAIN_START, PLAIN_COMPLETE] {
                let n = sqlx::query(sql)
                    .bind(id)
                    .bind(token)
                    .execute(db.pool())
                    .await?
                    .rows_affected();
                if n != 1 {
                    bail!("plain job {id}: a fenced write updated {n} rows");
                }
            }
            anyhow::Ok(())
        }))
        .await?;
        done += n;
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    tests::init_tracing();
    run_and_clean_up("bench_executors", &args.database_url, |created| {
        run(&args, created)
    })
    .await;
}

async fn run(args: &Args, created: Arc<Mutex<Vec<String>>>) -> Result<()> {
    if args.steps == 0
        || args.rounds == 0
        || args.concurrency.is_empty()
        || args.concurrency.contains(&0)
    {
        bail!("--steps, --rounds and --concurrency must be positive");
    }
    let mut names = args.executors.clone();
    for (ex, _) in &args.extra {
        if !names.contains(ex) {
            names.push(ex.clone());
        }
    }
    let configs: Vec<(String, ExecutorConfig)> = names
        .iter()
        .map(|w| executor_config(w).map(|c| (w.clone(), c)))
        .collect::<Result<_>>()?;
    // (concurrency, runs) per executor: the grid for the executors asked
    // for, then the extra cells
    let cells = |which: &str| -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = if args.executors.iter().any(|e| e == which) {
            args.concurrency.iter().map(|&c| (c, args.steps)).collect()
        } else {
            Vec::new()
        };
        for (ex, c) in &args.extra {
            if ex == which && !v.iter().any(|(have, _)| have == c) {
                v.push((*c, extra_steps(args.steps, *c)));
            }
        }
        v
    };
    let mut plain_cells: Vec<(u32, u32)> =
        args.concurrency.iter().map(|&c| (c, args.steps)).collect();
    for (_, c) in &args.extra {
        if !plain_cells.iter().any(|(have, _)| have == c) {
            plain_cells.push((*c, extra_steps(args.steps, *c)));
        }
    }
    let admin = Db::connect(&args.database_url, 1)
        .await
        .context("connecting to DATABASE_URL")?;
    println!("== bench_executors: demo.echo through the whole worker vs bare executor round trips and plain SQL");
    let mut report = Report::new("bench_executors");
    report.set_setup(print_setup(&admin, &args.database_url).await?);
    report.set_params(
        serde_json::json!({"steps": args.steps, "rounds": args.rounds,
        "concurrency": args.concurrency, "executors": args.executors,
        "extra": args.extra.iter().map(|(e, c)| format!("{e}:{c}")).collect::<Vec<_>>()}),
    );
    for (w, c) in &configs {
        println!("executor    : {w}: {} {}", c.command, c.args.join(" "));
    }
    println!(
        "parameters  : {} runs per worker measurement, {} bare round trips per measurement, concurrency {:?}",
        args.steps, args.rounds, args.concurrency
    );
    for (ex, c) in &args.extra {
        println!(
            "extra cell  : {ex} at concurrency {c}, {} runs",
            extra_steps(args.steps, *c)
        );
    }
    println!(
        "method      : bare = spawn (Spawner, the worker's spawn spec, fresh directory with out/ and in/) → hello →\n\
         \x20             Job → events until the terminal → close stdin → stdout EOF → exit → reap; no database;\n\
         \x20             {WARMUP_ROUNDS} untimed warm-up trips per executor first; with concurrency c, c loops run at once;\n\
         \x20             half of a cell's round trips run right before its worker measurement and half right after,\n\
         \x20             merged (trips over their summed time): a bracket against the host's drift.\n\
         \x20             worker = submit max(5, 2c) warm-up runs and then K one-step demo.echo runs (untimed,\n\
         \x20             reported), start an in-process RunningWorker (tests::fast_config, one executor with\n\
         \x20             concurrency c; startup untimed); the clock runs from the end of the warm-up runs until no\n\
         \x20             run is open (the last run polled by its key every {} ms, then all; the time is the\n\
         \x20             database clock's, to the last run's finished_at); the runs are ANALYZEd before the worker\n\
         \x20             starts (as autovacuum would); then all runs are checked to have succeeded.\n\
         \x20             plain SQL = the same transitions on a plain table (no triggers, history, events): K jobs\n\
         \x20             inserted one statement each (untimed, reported), then one loop claims up to c pending jobs\n\
         \x20             per statement (UPDATE … IN (SELECT … LIMIT c FOR UPDATE SKIP LOCKED), as the worker leases\n\
         \x20             up to its free slots) and starts and completes them, every row fenced by token and state:\n\
         \x20             per row = each job on its own connection, c at once, a statement per transition; set-based\n\
         \x20             = one statement over arrays for all the claimed jobs' starts, then one for their\n\
         \x20             completions (as the ledger writes a batch; the database's limit, which target (a) uses);\n\
         \x20             clock from the first claim until none is pending.\n\
         \x20             bare exchange (persistent executors) = c processes started and handshaken (untimed), then\n\
         \x20             each fed its share of max(K, 3000) jobs back to back (fewer took a few ms: too short to\n\
         \x20             time); no database.\n\
         \x20             CPU: children = executors (reaped: getrusage RUSAGE_CHILDREN; live persistent ones: their\n\
         \x20             threads' /proc/<pid>/task/*/schedstat), bench = this process (incl.\n\
         \x20             the in-process worker), db = backends connected to the bench database (/proc/<pid>/stat).",
        POLL.as_millis()
    );
    println!();

    let name = format!("bench_e_{}", &Uuid::new_v4().simple().to_string()[..12]);
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin.pool())
        .await?;
    created.lock().unwrap().push(name.clone());
    let url = db_url(&args.database_url, &name);
    {
        let db = Db::connect(&url, 1).await?;
        db.migrate().await?;
        db.pool().close().await;
    }
    let mut plains = Vec::new();
    for &(c, steps) in &plain_cells {
        for mode in [PlainMode::PerRow, PlainMode::SetBased] {
            let p = plain_cycle(&url, mode, c, steps).await?;
            eprintln!(
                "[plain SQL, {}] c={c}: {} jobs in {:.3} s = {:.0} jobs/s",
                mode.label(),
                p.jobs,
                p.secs,
                p.jobs as f64 / p.secs
            );
            plains.push(p);
        }
    }
    let spawner = Spawner::start()?;
    let mut bares = Vec::new();
    let mut exchanges: Vec<ExchangeCell> = Vec::new();
    let mut workers = Vec::new();
    for (which, cfg) in &configs {
        for i in 0..WARMUP_ROUNDS {
            round_trip(&spawner, cfg, 1_000_000 + i as u64).await?;
        }
        for (c, steps) in cells(which) {
            // the bare rate brackets the worker's measurement: half of the
            // round trips before it, half after, merged (the host's speed
            // drifts within seconds here; one bare burst before a worker
            // measurement several times its length put the ratio anywhere
            // in 55–91 % over three runs of the same build)
            let before = bare(&spawner, cfg, which, c, args.rounds.div_ceil(2)).await?;
            if cfg.persistent {
                let x =
                    bare_exchange(&spawner, cfg, which, c, steps.max(EXCHANGE_MIN_JOBS)).await?;
                eprintln!(
                    "[{which}] bare exchange c={c}: {} jobs in {:.2} s = {:.0} jobs/s",
                    x.jobs.len(),
                    x.secs,
                    x.jobs.len() as f64 / x.secs
                );
                exchanges.push(x);
            }
            let w = through_worker(
                &url,
                which,
                c,
                steps,
                Duration::from_secs(args.timeout_secs),
            )
            .await?;
            eprintln!(
                "[{which}] worker c={c}: {} steps in {:.2} s = {:.1} steps/s",
                w.steps,
                w.secs,
                w.steps as f64 / w.secs
            );
            workers.push(w);
            let after = bare(&spawner, cfg, which, c, (args.rounds / 2).max(1)).await?;
            eprintln!(
                "[{which}] bare c={c}: {:.1} round trips/s before the worker, {:.1} after",
                before.rate(),
                after.rate()
            );
            let b = before.merge(after);
            eprintln!(
                "[{which}] bare c={c}: {} round trips in {:.2} s, mean {} ms",
                b.trips.len(),
                b.secs,
                fmt_ms(mean(&b.trips.iter().map(|t| t.total).collect::<Vec<_>>()))
            );
            bares.push(b);
        }
    }
    drop_databases(&args.database_url, std::slice::from_ref(&name)).await;
    created.lock().unwrap().clear();
    admin.pool().close().await;

    println!("-- plain SQL baseline: insert, claim (SKIP LOCKED, up to c per statement), start, complete (fenced)");
    let rows: Vec<Vec<String>> = plains
        .iter()
        .map(|p| {
            vec![
                p.mode.label().to_string(),
                p.concurrency.to_string(),
                p.jobs.to_string(),
                format!("{:.3}", p.secs),
                format!("{:.0}", p.jobs as f64 / p.secs),
                format!("{:.1}", p.jobs as f64 / p.claims.max(1) as f64),
                format!("{:.2}", p.insert_secs * 1e3 / p.jobs.max(1) as f64),
            ]
        })
        .collect();
    print_table(
        &[
            "writes",
            "conc",
            "jobs",
            "secs",
            "jobs/s",
            "jobs/claim",
            "insert ms/job",
        ],
        1,
        &rows,
    );
    println!();
    for p in &plains {
        report.figure(
            "plain SQL job cycle",
            p.jobs as f64 / p.secs,
            "steps/s",
            serde_json::json!({"writes": p.mode.label(), "concurrency": p.concurrency, "jobs": p.jobs,
                "insert_ms_per_job": p.insert_secs * 1e3 / p.jobs.max(1) as f64}),
        );
    }

    println!("-- bare executor round trips, no database (ms per round trip)");
    let mut rows = Vec::new();
    for b in &bares {
        let tot: Vec<Duration> = b.trips.iter().map(|t| t.total).collect();
        let st: Vec<Duration> = b.trips.iter().map(|t| t.startup).collect();
        let jb: Vec<Duration> = b.trips.iter().map(|t| t.job).collect();
        let ex: Vec<Duration> = b.trips.iter().map(|t| t.exit).collect();
        let n = b.trips.len().max(1) as f64;
        let cpu_per = (b.child_cpu + b.bench_cpu) / n;
        rows.push(vec![
            b.executor.clone(),
            b.concurrency.to_string(),
            b.trips.len().to_string(),
            fmt_ms(mean(&tot)),
            fmt_ms(pct(&tot, 50.0)),
            fmt_ms(pct(&tot, 95.0)),
            fmt_ms(pct(&st, 50.0)),
            fmt_ms(pct(&jb, 50.0)),
            fmt_ms(pct(&ex, 50.0)),
            format!("{:.1}", n / b.secs),
            format!("{:.2}", b.child_cpu * 1e3 / n),
            format!("{:.2}", b.bench_cpu * 1e3 / n),
            format!("{:.0}", 1.0 / cpu_per),
            b.busy
                .map(|x| format!("{:.0}%", x * 100.0))
                .unwrap_or("n/a".into()),
        ]);
    }
    print_table(
        &[
            "executor",
            "conc",
            "trips",
            "mean",
            "p50",
            "p95",
            "spawn→hello p50",
            "job→terminal p50",
            "terminal→reaped p50",
            "trips/s (wall)",
            "child CPU ms/trip",
            "bench CPU ms/trip",
            "max trips/s per core",
            "machine busy",
        ],
        1,
        &rows,
    );
    println!("   max trips/s per core = 1 / (child + bench CPU per trip): the CPU-bound ceiling of one core.");
    println!();

    if !exchanges.is_empty() {
        println!("-- bare persistent exchange, no database: c processes started and handshaken first (untimed),");
        println!("   then each fed its share of the jobs back to back (the executors' own limit for a persistent pool)");
        let mut rows = Vec::new();
        for x in &exchanges {
            let n = x.jobs.len().max(1) as f64;
            rows.push(vec![
                x.executor.clone(),
                x.concurrency.to_string(),
                x.jobs.len().to_string(),
                format!("{:.2}", x.secs),
                format!("{:.0}", n / x.secs),
                fmt_ms(pct(&x.jobs, 50.0)),
                fmt_ms(pct(&x.jobs, 99.0)),
                format!("{:.1}", x.child_cpu * 1e6 / n),
                format!("{:.1}", x.bench_cpu * 1e6 / n),
                format!("{:.0}", n / (x.child_cpu + x.bench_cpu)),
                x.busy
                    .map(|b| format!("{:.0}%", b * 100.0))
                    .unwrap_or("n/a".into()),
            ]);
            report.figure(
                "bare persistent exchange",
                n / x.secs,
                "jobs/s",
                serde_json::json!({"executor": x.executor, "concurrency": x.concurrency, "jobs": x.jobs.len(),
                    "child_cpu_us_per_job": x.child_cpu * 1e6 / n, "bench_cpu_us_per_job": x.bench_cpu * 1e6 / n}),
            );
        }
        print_table(
            &[
                "executor",
                "conc",
                "jobs",
                "secs",
                "jobs/s",
                "job p50",
                "job p99",
                "child CPU µs/job",
                "bench CPU µs/job",
                "max jobs/s per core",
                "machine busy",
            ],
            1,
            &rows,
        );
        println!("   child CPU: every thread of the live executors (/proc/<pid>/task/*/schedstat); bench = this process.");
        println!();
    }

    println!("-- demo.echo through the whole worker (PostgreSQL, lease → spawn → … → complete)");
    let mut rows = Vec::new();
    for w in &workers {
        let bare = bares
            .iter()
            .find(|b| b.executor == w.executor && b.concurrency == w.concurrency);
        let exch = exchanges
            .iter()
            .find(|x| x.executor == w.executor && x.concurrency == w.concurrency)
            .map(|x| x.jobs.len() as f64 / x.secs);
        let plain = plain_at(&plains, PlainMode::PerRow, w.concurrency);
        let set = plain_at(&plains, PlainMode::SetBased, w.concurrency);
        let rate = w.steps as f64 / w.secs;
        let n = w.steps.max(1) as f64;
        report.figure(
            "demo.echo through the worker",
            rate,
            "steps/s",
            serde_json::json!({"executor": w.executor, "concurrency": w.concurrency, "steps": w.steps,
                "bare_trips_per_s": bare.map(|b| b.trips.len() as f64 / b.secs),
                "bare_exchange_jobs_per_s": exch,
                "plain_sql_steps_per_s": plain.map(|p| p.jobs as f64 / p.secs),
                "plain_sql_set_based_steps_per_s": set.map(|p| p.jobs as f64 / p.secs),
                // every other number of the table's row, so the summary holds what it prints
                "leased_to_started_mean_ms": mean(&w.lease_to_started).as_secs_f64() * 1e3,
                "started_to_finished_mean_ms": mean(&w.started_to_finished).as_secs_f64() * 1e3,
                "finished_to_next_leased_mean_ms": (w.concurrency == 1)
                    .then(|| mean(&w.finished_to_next).as_secs_f64() * 1e3),
                "db_cpu_ms_per_step": w.db_cpu.map(|c| c * 1e3 / n),
                "child_cpu_ms_per_step": w.child_cpu * 1e3 / n,
                "bench_cpu_ms_per_step": w.bench_cpu * 1e3 / n,
                "machine_busy": w.busy,
                "submit_ms_per_run": w.submit_secs * 1e3 / n}),
        );
        rows.push(vec![
            w.executor.clone(),
            w.concurrency.to_string(),
            w.steps.to_string(),
            format!("{:.2}", w.secs),
            format!("{rate:.1}"),
            format!("{:.2}", w.secs * 1e3 / n),
            bare.map(|b| format!("{:.1}", b.trips.len() as f64 / b.secs))
                .unwrap_or_default(),
            bare.map(|b| format!("{:.0}%", 100.0 * rate / (b.trips.len() as f64 / b.secs)))
                .unwrap_or_default(),
            exch.map(|x| format!("{x:.0}")).unwrap_or("-".into()),
            exch.map(|x| format!("{:.1}%", 100.0 * rate / x))
                .unwrap_or("-".into()),
            plain
                .map(|p| format!("{:.0}", p.jobs as f64 / p.secs))
                .unwrap_or_default(),
            plain
                .map(|p| format!("{:.1}%", 100.0 * rate / (p.jobs as f64 / p.secs)))
                .unwrap_or_default(),
            set.map(|p| format!("{:.0}", p.jobs as f64 / p.secs))
                .unwrap_or_default(),
            set.map(|p| format!("{:.1}%", 100.0 * rate / (p.jobs as f64 / p.secs)))
                .unwrap_or_default(),
            fmt_ms(mean(&w.lease_to_started)),
            fmt_ms(mean(&w.started_to_finished)),
            if w.concurrency == 1 {
                fmt_ms(mean(&w.finished_to_next))
            } else {
                "-".into()
            },
            w.db_cpu
                .map(|c| format!("{:.2}", c * 1e3 / n))
                .unwrap_or("n/a".into()),
            format!("{:.2}", w.child_cpu * 1e3 / n),
            format!("{:.2}", w.bench_cpu * 1e3 / n),
            w.db_cpu
                .map(|d| format!("{:.0}", n / (d + w.child_cpu + w.bench_cpu)))
                .unwrap_or("n/a".into()),
            w.busy
                .map(|x| format!("{:.0}%", x * 100.0))
                .unwrap_or("n/a".into()),
            format!("{:.2}", w.submit_secs * 1e3 / n),
        ]);
    }
    print_table(
        &[
            "executor",
            "conc",
            "steps",
            "secs",
            "steps/s",
            "wall ms/step",
            "bare trips/s",
            "worker/bare",
            "bare exchange jobs/s",
            "worker/exchange",
            "plain SQL per row steps/s",
            "worker/per row",
            "plain SQL set-based steps/s",
            "worker/set-based",
            "leased→started mean",
            "started→finished mean",
            "finished→next leased mean",
            "db CPU ms/step",
            "child CPU ms/step",
            "bench CPU ms/step",
            "max steps/s per core",
            "machine busy",
            "submit ms/run",
        ],
        1,
        &rows,
    );
    println!("   leased→started / started→finished: step_runs.leased_at, started_at (mark_running) and finished_at");
    println!("   (complete), each the start time of its transaction on the database clock; finished→next leased");
    println!("   (concurrency 1 only) = the complete transaction + the attempt's end + the worker loop until the next lease.");
    println!("   db CPU: the worker's backends (the benchmark's polling connection is left out), including the");
    println!("   worker's fixed-rate heartbeat / reclaim / poll statements. max steps/s per core = 1 / (db + child + bench");
    println!("   CPU per step).");
    println!("   submit ms/run: Db::submit (durable.submit_run) one run at a time before the worker starts (untimed above).");
    println!();
    for b in &bares {
        report.figure(
            "bare executor round trips",
            b.trips.len() as f64 / b.secs,
            "trips/s",
            serde_json::json!({"executor": b.executor, "concurrency": b.concurrency, "trips": b.trips.len()}),
        );
    }
    executor_targets(&mut report, &workers, &bares, &plains);
    report.print_targets();
    println!("load average at the end: {}", loadavg());
    report.write(args.json_out.as_deref())
}

/// Issue 7's targets for (a)–(d), each at the largest concurrency measured
/// for the executors it names.
fn executor_targets(
    report: &mut Report,
    workers: &[WorkerCell],
    bares: &[BareCell],
    plains: &[PlainCell],
) {
    let top = |ex: &str| {
        workers
            .iter()
            .filter(|w| w.executor == ex)
            .max_by_key(|w| w.concurrency)
    };
    let rate = |w: &WorkerCell| w.steps as f64 / w.secs;
    if let Some(w) = top("go-persistent") {
        let setup = serde_json::json!({"executor": "go-persistent", "concurrency": w.concurrency, "steps": w.steps});
        report.target(
            "a.persistent_go_steps_per_s",
            &format!(
                "persistent Go no-op end to end ≥ 20,000 steps/s (concurrency {})",
                w.concurrency
            ),
            rate(w),
            Want::AtLeast,
            20_000.0,
            "steps/s",
            setup.clone(),
        );
        if let Some(p) = plain_at(plains, PlainMode::SetBased, w.concurrency) {
            report.target(
                "a.persistent_go_vs_plain_sql",
                &format!(
                    "persistent Go ≥ 40% of the set-based plain-SQL job cycle (concurrency {})",
                    w.concurrency
                ),
                100.0 * rate(w) / (p.jobs as f64 / p.secs),
                Want::AtLeast,
                40.0,
                "%",
                setup,
            );
        }
    }
    if let Some(w) = top("go") {
        if let Some(b) = bares
            .iter()
            .find(|b| b.executor == "go" && b.concurrency == w.concurrency)
        {
            report.target(
                "b.one_shot_go_vs_bare",
                &format!(
                    "one-shot Go ≥ 80% of bare start-and-exchange (concurrency {})",
                    w.concurrency
                ),
                100.0 * rate(w) / (b.trips.len() as f64 / b.secs),
                Want::AtLeast,
                80.0,
                "%",
                serde_json::json!({"executor": "go", "concurrency": w.concurrency, "steps": w.steps, "trips": b.trips.len()}),
            );
        }
    }
    // (c) has no target of its own: one-shot Python beside its bare
    // start-and-exchange, as (b) is for Go, and the denominator of (d)
    if let Some(w) = top("python") {
        if let Some(b) = bares
            .iter()
            .find(|b| b.executor == "python" && b.concurrency == w.concurrency)
        {
            report.figure(
                "c.one_shot_python_vs_bare",
                100.0 * rate(w) / (b.trips.len() as f64 / b.secs),
                "%",
                serde_json::json!({"executor": "python", "concurrency": w.concurrency, "steps": w.steps,
                    "trips": b.trips.len(), "steps_per_s": rate(w),
                    "bare_trips_per_s": b.trips.len() as f64 / b.secs,
                    "target": "none in issue 7 (c is a figure; (d) compares persistent Python with it)"}),
            );
            println!(
                "(c) one-shot Python through the worker: {:.1} steps/s = {:.0}% of its bare start-and-exchange ({:.1} trips/s), concurrency {} (a figure; issue 7 sets no target for it)",
                rate(w),
                100.0 * rate(w) / (b.trips.len() as f64 / b.secs),
                b.trips.len() as f64 / b.secs,
                w.concurrency
            );
        }
    }
    if let (Some(p), Some(o)) = (top("python-persistent"), top("python")) {
        if p.concurrency == o.concurrency {
            report.target(
                "d.persistent_python_vs_one_shot",
                &format!(
                    "persistent Python ≥ 20× one-shot Python (concurrency {})",
                    p.concurrency
                ),
                rate(p) / rate(o),
                Want::AtLeast,
                20.0,
                "x",
                serde_json::json!({"concurrency": p.concurrency, "steps": p.steps}),
            );
        }
    }
}

fn plain_at(plains: &[PlainCell], mode: PlainMode, concurrency: u32) -> Option<&PlainCell> {
    plains
        .iter()
        .find(|p| p.mode == mode && p.concurrency == concurrency)
}

fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.iter().sum::<Duration>() / v.len() as u32
}

// ---------------------------------------------------------------------------
// measurement helpers (as in bench_queue.rs)
