//! Observability: the worker's Prometheus metrics and its `/metrics`,
//! `/healthz` and `/readyz` endpoints.
//!
//! One registry per process (a process runs one worker; workers run inside
//! one test process add up). The worker's loops and attempts record through
//! the typed functions below, one line per call site; nothing here blocks or
//! touches the database on their path. [`serve`] (started by the command when
//! `metrics_addr` is set) answers HTTP on its own tasks, with its own
//! one-connection pool for the readiness probe and the queue-depth query, so
//! a busy worker pool never makes a probe flap and a scrape never takes a
//! connection an attempt needs.
//!
//! Label values are bounded: outcomes and signals are fixed sets; codes and
//! kinds are cleaned (at most 64 characters of `[A-Za-z0-9_.:/-]`) and each
//! family keeps at most [`MAX_SERIES`] label sets, after which new values
//! count under `other` (an executor cannot grow the registry without end).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};

use crate::config::WorkerConfig;
use crate::db::{bounded, Db};

/// Label sets per family at most; further values count under `other`.
pub const MAX_SERIES: usize = 200;
/// How often the queue depth is read (only while metrics are served).
pub const QUEUE_DEPTH_EVERY: Duration = Duration::from_secs(5);
/// Distinct (executor_kind, kind) routes the queue depth reports at most ...
pub const QUEUE_DEPTH_MAX_KINDS: u32 = 100;
/// ... and the ready steps counted per route at most (the gauge saturates).
pub const QUEUE_DEPTH_CAP: u32 = 10_000;
/// How long the readiness probe waits for the database.
const READY_DB_TIMEOUT: Duration = Duration::from_secs(1);
/// Connections answered at once; more are closed unanswered.
const MAX_CONNECTIONS: usize = 32;
/// One request's whole life: reading the head, answering.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may take to send its request head: an idle
/// client holds one of the MAX_CONNECTIONS slots no longer (operator audit:
/// 32 idle connections took /healthz down for 10 s).
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest request head read.
const MAX_HEAD: usize = 8 * 1024;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExecutorLabel {
    executor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignalLabel {
    signal: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessStartLabels {
    executor: String,
    by: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    kind: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    executor_kind: String,
    kind: String,
}

fn step_histogram() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        600.0, 1800.0, 3600.0,
    ])
}

struct Metrics {
    registry: Registry,
    leases: Capped<ExecutorLabel, Counter>,
    completions: Family<OutcomeLabel, Counter>,
    failures: Capped<CodeLabel, Counter>,
    retries: Counter,
    reclaims: Counter,
    refusals: Capped<CodeLabel, Counter>,
    signals: Family<SignalLabel, Counter>,
    process_starts: Capped<ProcessStartLabels, Counter>,
    idle_processes: Capped<ExecutorLabel, Gauge>,
    step_duration: Capped<StepLabels, Histogram>,
    frame_errors: Capped<CodeLabel, Counter>,
    heartbeat_duration: Histogram,
    heartbeat_failures: Counter,
    leases_lost: Counter,
    heartbeat_lag: Gauge<f64, AtomicU64>,
    ledger_batch: Histogram,
    queue_depth: Family<QueueLabels, Gauge>,
    queue_depth_cut: Gauge,
    queue_depth_keys: Mutex<HashSet<QueueLabels>>,
    stderr_suppressed: Counter,
    ledger_aside: Counter,
}

impl Metrics {
    fn new() -> Metrics {
        let m = Metrics::unregistered();
        let mut registry = Registry::with_prefix("durable");
        m.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// Every metric, zero, with an empty registry.
    fn unregistered() -> Metrics {
        Metrics {
            leases: Capped::new(Family::new_with_constructor(Counter::default)),
            completions: Family::default(),
            failures: Capped::new(Family::new_with_constructor(Counter::default)),
            retries: Counter::default(),
            reclaims: Counter::default(),
            refusals: Capped::new(Family::new_with_constructor(Counter::default)),
            signals: Family::default(),
            process_starts: Capped::new(Family::new_with_constructor(Counter::default)),
            idle_processes: Capped::new(Family::new_with_constructor(Gauge::default)),
            step_duration: Capped::new(Family::new_with_constructor(step_histogram)),
            frame_errors: Capped::new(Family::new_with_constructor(Counter::default)),
            heartbeat_duration: Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            heartbeat_failures: Counter::default(),
            leases_lost: Counter::default(),
            heartbeat_lag: Gauge::default(),
            ledger_batch: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
            queue_depth: Family::default(),
            queue_depth_cut: Gauge::default(),
            queue_depth_keys: Mutex::new(HashSet::new()),
            stderr_suppressed: Counter::default(),
            ledger_aside: Counter::default(),
            registry: Registry::default(),
        }
    }

    /// Registers every metric, with its help text, in `r`.
    fn register(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "leases",
            "Steps leased by this worker, by executor (its config name)",
            m.leases.family.clone(),
        );
        r.register(
            "attempts_completed",
            "Attempt outcomes committed (or discarded: abandoned), by outcome: succeeded, failed, cancelled, refused, released, abandoned",
            m.completions.clone(),
        );
        r.register(
            "attempt_failures",
            "Failed attempts committed, by error code",
            m.failures.family.clone(),
        );
        r.register(
            "retries",
            "Failures the state machine decided to retry (the step went to retryable_failed)",
            m.retries.clone(),
        );
        r.register(
            "reclaims",
            "Expired leases (of any worker) this worker's reclaim loop moved on (LEASE_EXPIRED)",
            m.reclaims.clone(),
        );
        r.register(
            "refusals",
            "Steps handed back without running (refused), by code",
            m.refusals.family.clone(),
        );
        r.register(
            "executor_processes_started",
            "Executor processes started, by executor (its config name) and by whom: job (an attempt found no warm process), warm (the warm pool started it ahead)",
            m.process_starts.family.clone(),
        );
        r.register(
            "executor_idle_processes",
            "Processes of a persistent executor idle in its pool, started and handshaken, ready for a job, by executor (its config name)",
            m.idle_processes.family.clone(),
        );
        r.register(
            "executor_signals",
            "Signals sent to stop an executor's process group: SIGTERM to a leader still running, SIGKILL when it outlived term_grace_ms",
            m.signals.clone(),
        );
        r.register(
            "step_duration_seconds",
            "An attempt's whole life in this worker (lease to committed outcome), by step kind and outcome",
            m.step_duration.family.clone(),
        );
        r.register(
            "frame_errors",
            "Attempts failed for a protocol violation (PROTOCOL_* codes: malformed or oversized frames, bad sequences, frames after the terminal), by code",
            m.frame_errors.family.clone(),
        );
        r.register(
            "heartbeat_duration_seconds",
            "Round trip of the one batched lease renewal",
            m.heartbeat_duration.clone(),
        );
        r.register(
            "heartbeat_failures",
            "Lease renewals that failed (database error or timeout)",
            m.heartbeat_failures.clone(),
        );
        r.register(
            "heartbeat_lost_leases",
            "Leases the heartbeat found taken from a running attempt (reclaimed after an expiry, or moved on by someone else); the attempt stops its executor",
            m.leases_lost.clone(),
        );
        r.register(
            "heartbeat_lag_seconds",
            "Time since the send time of the last successful lease renewal (the lease clock's age; the interval when healthy)",
            m.heartbeat_lag.clone(),
        );
        r.register(
            "ledger_batch_intents",
            "Intents written per ledger batch (starts, event runs, completions, checkpoints, failures, cancels, refusals, releases)",
            m.ledger_batch.clone(),
        );
        r.register(
            "queue_depth",
            "Ready steps (pending or retryable_failed, due now) per executor_kind and kind, whoever can run them; counted up to 10000",
            m.queue_depth.clone(),
        );
        r.register(
            "queue_depth_cut",
            "1 when more routes have open steps than durable_queue_depth reports (the first 100 by executor_kind and kind): the routes after them are not in it",
            m.queue_depth_cut.clone(),
        );
        r.register(
            "stderr_lines_suppressed",
            "Executor stderr lines not logged because of stderr_log_lines_per_sec",
            m.stderr_suppressed.clone(),
        );
        r.register(
            "ledger_writes_set_aside",
            "Ledger writes set aside because another transaction held their run's row (or their step's) longer than the ledger's lock wait",
            m.ledger_aside.clone(),
        );
    }
}

fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// A label value fit for a series: at most 64 characters of
/// `[A-Za-z0-9_.:/-]` (others become `_`); empty is `none`.
fn clean(v: &str) -> String {
    let s: String = v
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.:/-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "none".into()
    } else {
        s
    }
}

/// A family whose label sets are capped at [`MAX_SERIES`]: further values
/// count under the `other` label set.
struct Capped<S, M, C = fn() -> M> {
    family: Family<S, M, C>,
    series: AtomicUsize,
}

impl<S, M, C> Capped<S, M, C>
where
    S: Clone + std::hash::Hash + Eq,
    M: Clone,
    C: MetricConstructor<M>,
{
    fn new(family: Family<S, M, C>) -> Self {
        Capped {
            family,
            series: AtomicUsize::new(0),
        }
    }

    /// The series of `labels` if it has one or there is room, else `other`'s.
    fn get(&self, labels: S, other: impl FnOnce() -> S) -> impl std::ops::Deref<Target = M> + '_ {
        let known = self.family.get(&labels).is_some();
        let labels = if known || self.series.fetch_add(1, Ordering::Relaxed) < MAX_SERIES {
            labels
        } else {
            self.series.fetch_sub(1, Ordering::Relaxed);
            other()
        };
        self.family.get_or_create(&labels)
    }
}

fn code(value: &str) -> CodeLabel {
    CodeLabel { code: clean(value) }
}

fn other_code() -> CodeLabel {
    CodeLabel {
        code: "other".into(),
    }
}

/// The outcome word of an attempt outcome's label (`Outcome::label` in the
/// attempt: "succeeded", "failed (CODE)", "refused (CODE)", "released
/// (worker shutdown)", "abandoned (lease lost)") and its code, if any.
fn split_label(label: &str) -> (&'static str, Option<&str>) {
    let (word, rest) = match label.split_once(' ') {
        Some((w, r)) => (w, Some(r)),
        None => (label, None),
    };
    let outcome = match word {
        "succeeded" => "succeeded",
        "failed" => "failed",
        "cancelled" => "cancelled",
        "refused" => "refused",
        "released" => "released",
        "abandoned" => "abandoned",
        _ => "other",
    };
    let code = rest
        .and_then(|r| r.strip_prefix('('))
        .and_then(|r| r.strip_suffix(')'))
        .filter(|_| matches!(outcome, "failed" | "refused"));
    (outcome, code)
}

// ---------------------------------------------------------------------------
// what the worker records (one line per call site)

/// `n` steps were leased for `executor`.
pub fn leased(executor: &str, n: usize) {
    if n == 0 {
        return;
    }
    let l = ExecutorLabel {
        executor: clean(executor),
    };
    metrics()
        .leases
        .get(l, || ExecutorLabel {
            executor: "other".into(),
        })
        .inc_by(n as u64);
}

/// An attempt's outcome was committed (or discarded), given by its label.
pub fn committed(outcome_label: &str) {
    let m = metrics();
    let (outcome, with_code) = split_label(outcome_label);
    m.completions
        .get_or_create(&OutcomeLabel {
            outcome: outcome.into(),
        })
        .inc();
    match (outcome, with_code) {
        ("failed", Some(c)) => m.failures.get(code(c), other_code).inc(),
        ("refused", Some(c)) => m.refusals.get(code(c), other_code).inc(),
        _ => 0,
    };
}

/// An attempt ended, after its commit: its duration by kind and outcome.
pub fn attempt_finished(kind: &str, outcome_label: &str, elapsed: Duration) {
    let (outcome, _) = split_label(outcome_label);
    let labels = StepLabels {
        kind: clean(kind),
        outcome: outcome.into(),
    };
    metrics()
        .step_duration
        .get(labels, || StepLabels {
            kind: "other".into(),
            outcome: outcome.into(),
        })
        .observe(elapsed.as_secs_f64());
}

/// An attempt failed with `code` (decided, before its commit): protocol
/// violations are counted as frame errors.
pub fn attempt_failed(code: &str) {
    if code.starts_with("PROTOCOL_") {
        metrics()
            .frame_errors
            .get(self::code(code), other_code)
            .inc();
    }
}

/// A failure was committed and sent the step to `to` (a state name).
pub fn failure_decided(to: &str) {
    if to == "retryable_failed" {
        metrics().retries.inc();
    }
}

/// The reclaim loop moved `n` expired leases on.
pub fn reclaimed(n: usize) {
    if n > 0 {
        metrics().reclaims.inc_by(n as u64);
    }
}

/// A signal was sent to stop an executor's group ("SIGTERM", "SIGKILL").
pub fn executor_signal(signal: &'static str) {
    metrics()
        .signals
        .get_or_create(&SignalLabel {
            signal: signal.into(),
        })
        .inc();
}

/// A process of `executor` was started, by an attempt (`"job"`) or by its
/// warm pool ahead of jobs (`"warm"`).
pub fn executor_process_started(executor: &str, by: &'static str) {
    let l = ProcessStartLabels {
        executor: clean(executor),
        by: by.into(),
    };
    metrics()
        .process_starts
        .get(l, || ProcessStartLabels {
            executor: "other".into(),
            by: by.into(),
        })
        .inc();
}

/// `delta` processes of `executor` went into (+) or out of (-) its pool of idle ones.
pub fn idle_processes(executor: &str, delta: i64) {
    if delta == 0 {
        // no series for an executor that never had an idle process (audit
        // 90: a one-shot executor's showed up, at 0, when the health pass
        // found none to take)
        return;
    }
    let l = ExecutorLabel {
        executor: clean(executor),
    };
    metrics()
        .idle_processes
        .get(l, || ExecutorLabel {
            executor: "other".into(),
        })
        .inc_by(delta);
}

/// A ledger batch of `intents` was written.
pub fn ledger_batch(intents: usize) {
    metrics().ledger_batch.observe(intents as f64);
}

/// `writes` ledger writes were set aside: their rows were held.
pub fn ledger_set_aside(writes: usize) {
    metrics().ledger_aside.inc_by(writes as u64);
}

/// Executor stderr lines were suppressed by the rate limit.
pub fn stderr_lines_suppressed(n: u64) {
    metrics().stderr_suppressed.inc_by(n);
}

/// A renewal sent `rtt` ago succeeded.
pub fn heartbeat_renewed(rtt: Duration) {
    let now = now_ms();
    metrics().heartbeat_duration.observe(rtt.as_secs_f64());
    let h = health();
    h.hb_tick_ms.store(now, Ordering::Relaxed);
    h.hb_ok_ms.store(
        now.saturating_sub(rtt.as_millis() as u64),
        Ordering::Relaxed,
    );
    h.renewals_failing.store(false, Ordering::Relaxed);
}

/// The heartbeat found `n` leases of running attempts lost.
pub fn heartbeat_lost_leases(n: usize) {
    metrics().leases_lost.inc_by(n as u64);
}

/// A renewal failed (the loop still runs: liveness is fine, readiness tells).
pub fn heartbeat_failed() {
    metrics().heartbeat_failures.inc();
    let h = health();
    h.hb_tick_ms.store(now_ms(), Ordering::Relaxed);
    h.renewals_failing.store(true, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------
// health

const STARTING: u8 = 0;
const RUNNING: u8 = 1;
const DRAINING: u8 = 2;

struct Health {
    phase: AtomicU8,
    died: Mutex<Option<String>>,
    /// Milliseconds since [`epoch`] of the heartbeat loop's last pass ...
    hb_tick_ms: AtomicU64,
    /// ... of the send time of its last successful renewal ...
    hb_ok_ms: AtomicU64,
    /// ... and how long it may go without a pass before it counts as stuck.
    hb_stale_ms: AtomicU64,
    /// The last renewal failed.
    renewals_failing: AtomicBool,
    /// When lease calls began to fail, + 1 (0: the last one succeeded).
    leases_failing_since_ms: AtomicU64,
    /// When the work_dir stopped taking new directories, + 1 (0: it takes them).
    work_dir_failing_since_ms: AtomicU64,
}

fn health() -> &'static Health {
    static H: OnceLock<Health> = OnceLock::new();
    H.get_or_init(|| Health {
        phase: AtomicU8::new(STARTING),
        died: Mutex::new(None),
        hb_tick_ms: AtomicU64::new(0),
        hb_ok_ms: AtomicU64::new(0),
        hb_stale_ms: AtomicU64::new(u64::MAX),
        renewals_failing: AtomicBool::new(false),
        leases_failing_since_ms: AtomicU64::new(0),
        work_dir_failing_since_ms: AtomicU64::new(0),
    })
}

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

/// The worker finished its start (executors probed) and its loops run.
pub fn worker_running(cfg: &WorkerConfig) {
    let h = health();
    let now = now_ms();
    h.hb_tick_ms.store(now, Ordering::Relaxed);
    h.hb_ok_ms.store(now, Ordering::Relaxed);
    // a pass may take the renewal's own timeout (half the TTL) on top of
    // its interval; twice both, and a margin, is a loop that no longer runs
    let stale = 2 * (cfg.heartbeat_interval_ms + cfg.lease_ttl_ms.max(1)) + 5_000;
    h.hb_stale_ms.store(stale, Ordering::Relaxed);
    h.phase.store(RUNNING, Ordering::Relaxed);
}

/// The worker drains: it takes no new work (not ready), but is alive.
pub fn worker_draining() {
    health().phase.store(DRAINING, Ordering::Relaxed);
}

/// A vital loop (heartbeat, reclaim, ledger) ended before it was told to.
pub fn vital_loop_died(name: &str) {
    let mut died = health().died.lock().unwrap_or_else(|p| p.into_inner());
    died.get_or_insert_with(|| name.to_owned());
}

/// `/healthz`: alive, and the vital loops run. `(healthy, why)`.
pub fn liveness() -> (bool, String) {
    let h = health();
    if let Some(name) = h.died.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        return (
            false,
            format!(
                "the worker's {name} loop stopped; the worker is stopping its children and exiting"
            ),
        );
    }
    let phase = h.phase.load(Ordering::Relaxed);
    if phase == RUNNING {
        let since = now_ms().saturating_sub(h.hb_tick_ms.load(Ordering::Relaxed));
        if since > h.hb_stale_ms.load(Ordering::Relaxed) {
            return (
                false,
                format!("the heartbeat loop has not run for {since} ms"),
            );
        }
    }
    let what = match phase {
        STARTING => "starting",
        RUNNING => "running",
        _ => "draining",
    };
    (true, format!("ok: {what}"))
}

/// `/readyz`: the database answers and the worker finished its start (its
/// executors were probed) and is not draining. `(ready, report)`.
pub async fn readiness(db: &Db) -> (bool, String) {
    let mut ready = true;
    let mut report = String::new();
    let mut pinged = bounded(READY_DB_TIMEOUT, "checking readiness", db.ping()).await;
    if let Err(e) = &pinged {
        // the connection the check keeps was ended (a restarted server,
        // pg_terminate_backend): the pool drops it, and one new connection
        // tells how the server is now (audit 96: "unreachable: terminating
        // connection due to administrator command" of a server that
        // answered again)
        if e.connection_ended() {
            pinged = bounded(READY_DB_TIMEOUT, "checking readiness", db.ping()).await;
        }
    }
    match pinged {
        Ok(()) => report.push_str("database: ok\n"),
        Err(e) => {
            ready = false;
            // a server that refuses connections answers at once, but the
            // pool retries until the wait runs out: say what it said
            // (resource audit: "did not answer within 1000 ms" for "too
            // many connections for role")
            // a server that takes connections but does not answer in time
            // is slow or blocked (a lock, a full pool), not unreachable
            // (observability audit: a held table lock read "unreachable")
            let (state, text) = if e.is_timeout() || e.is_pool_timeout() {
                match db.connect_error(READY_DB_TIMEOUT).await {
                    Some(w) => ("unreachable", format!("a new connection fails: {w}")),
                    None => (
                        "slow or blocked",
                        format!(
                            "{e} (a new connection opens: the pool's connections are busy, or the server is slow to answer: a lock, a long statement, an overloaded host)"
                        ),
                    ),
                }
            } else {
                ("unreachable", e.to_string())
            };
            report.push_str(&format!(
                "database: {state}: {}\n",
                crate::secrets::Redactor::none().redact_str(&text)
            ));
        }
    }
    match health().phase.load(Ordering::Relaxed) {
        // one line per check (README), so that `grep '^worker: draining'` works
        RUNNING => report.push_str("executors: probed\nworker: running\n"),
        STARTING => {
            ready = false;
            report.push_str("executors: not probed yet\nworker: starting\n");
        }
        _ => {
            ready = false;
            report.push_str("executors: probed\nworker: draining (takes no new work)\n");
        }
    }
    // a worker whose renewals fail leases nothing (a step leased now would
    // lose its lease): it takes no work, though its database answers a
    // SELECT 1 (operator audit: a role without UPDATE on step_runs, or a
    // heartbeat that cannot open its connection, read as ready)
    if health().renewals_failing.load(Ordering::Relaxed) {
        // since the last success (the first failure is known only once its
        // own timeout ran out: re-check audit)
        let h = health();
        let ms = now_ms().saturating_sub(h.hb_ok_ms.load(Ordering::Relaxed));
        ready = false;
        report.push_str(&format!(
            "leases: renewals failing, the last succeeded {ms} ms ago: nothing is leased until one succeeds (the worker's log says why)\n"
        ));
    } else if let Some(ms) = failing_for(&health().leases_failing_since_ms) {
        // a lease call that keeps failing (a privilege, a lock) leases
        // nothing either (re-check audit)
        ready = false;
        report.push_str(&format!(
            "leases: lease calls failing for {ms} ms: nothing is leased (the worker's log says why)\n"
        ));
    }
    // a work_dir that takes no directory (full, read-only) leases nothing
    // until a probe directory can be made (resource audit: it read as ready
    // while every step it leased was refused)
    if let Some(ms) = failing_for(&health().work_dir_failing_since_ms) {
        ready = false;
        report.push_str(&format!(
            "work_dir: attempts cannot write in it for {ms} ms: nothing is leased until a probe can (the worker's log says why)\n"
        ));
    }
    let (alive, why) = liveness();
    if !alive {
        ready = false;
        report.push_str(&format!("loops: {why}\n"));
    }
    (ready, report)
}

/// How long something has been failing, by its `…_failing_since_ms`.
fn failing_for(since: &AtomicU64) -> Option<u64> {
    match since.load(Ordering::Relaxed) {
        0 => None,
        since => Some(now_ms().saturating_sub(since - 1)),
    }
}

/// A lease call failed (`ok = false`) or succeeded: readiness says when they
/// keep failing.
pub fn lease_call(ok: bool) {
    let since = &health().leases_failing_since_ms;
    if ok {
        since.store(0, Ordering::Relaxed);
    } else {
        let _ = since.compare_exchange(0, now_ms() + 1, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The work_dir took a directory (`ok`) or refused one: readiness says
/// while it refuses.
pub fn work_dir(ok: bool) {
    let since = &health().work_dir_failing_since_ms;
    if ok {
        since.store(0, Ordering::Relaxed);
    } else {
        let _ = since.compare_exchange(0, now_ms() + 1, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The metrics in the Prometheus text format (version 0.0.4).
pub fn render() -> String {
    let m = metrics();
    let h = health();
    if h.phase.load(Ordering::Relaxed) != STARTING {
        let lag = now_ms().saturating_sub(h.hb_ok_ms.load(Ordering::Relaxed));
        m.heartbeat_lag.set(lag as f64 / 1000.0);
    }
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &m.registry) {
        warn!(error = %e, "cannot encode the metrics");
    }
    out
}

fn set_queue_depth(rows: Vec<crate::db::QueueDepth>) {
    let m = metrics();
    let mut keys = m.queue_depth_keys.lock().unwrap_or_else(|p| p.into_inner());
    // kinds that clean to the same label value (cut at 64 characters, or
    // differing only in characters a label cannot hold) are one series: it
    // counts them all (the last row's count replaced the others')
    let mut depth: HashMap<QueueLabels, i64> = HashMap::with_capacity(rows.len());
    for r in rows {
        let l = QueueLabels {
            executor_kind: clean(&r.executor_kind),
            kind: clean(&r.kind),
        };
        *depth.entry(l).or_default() += r.ready;
    }
    let mut now = HashSet::with_capacity(depth.len());
    for (l, ready) in depth {
        m.queue_depth.get_or_create(&l).set(ready);
        now.insert(l);
    }
    for gone in keys.difference(&now) {
        m.queue_depth.remove(gone);
    }
    *keys = now;
}

// ---------------------------------------------------------------------------
// the HTTP server

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot serve metrics on metrics_addr {addr}: {source}. Choose a free address or port (metrics_addr, or DURABLE_METRICS_ADDR), or remove metrics_addr")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` for the rest of the
/// process, and reads the queue depth every [`QUEUE_DEPTH_EVERY`]. Returns
/// the address bound (port 0 picks one).
pub async fn serve(addr: SocketAddr, db: &Db) -> Result<SocketAddr, MetricsError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let _ = metrics();
    let _ = epoch();
    // its own connection: probes and scrapes never wait for the worker's pool
    let db = db.dedicated(Duration::from_secs(2));
    let db2 = db.clone();
    tokio::spawn(async move {
        loop {
            match bounded(
                Duration::from_secs(3),
                "reading the queue depth",
                // one route more than reported: whether the list was cut
                db2.queue_depth(QUEUE_DEPTH_MAX_KINDS + 1, QUEUE_DEPTH_CAP),
            )
            .await
            {
                Ok(mut rows) => {
                    let cut = rows.len() > QUEUE_DEPTH_MAX_KINDS as usize;
                    rows.truncate(QUEUE_DEPTH_MAX_KINDS as usize);
                    metrics().queue_depth_cut.set(i64::from(cut));
                    set_queue_depth(rows);
                }
                Err(e) => debug!(error = %e, "cannot read the queue depth"),
            }
            tokio::time::sleep(QUEUE_DEPTH_EVERY).await;
        }
    });
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    debug!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                // too many at once: closed unanswered, and said (once a
                // minute): a liveness probe that fails for it is not the
                // worker's health
                let now = now_ms() + 1;
                let last = TURNED_AWAY_LOGGED_MS.load(Ordering::Relaxed);
                if last == 0 || now.saturating_sub(last) >= 60_000 {
                    TURNED_AWAY_LOGGED_MS.store(now, Ordering::Relaxed);
                    warn!(
                        max = MAX_CONNECTIONS,
                        "metrics: a connection was closed unanswered, {MAX_CONNECTIONS} are open at once (an idle one is closed {} s after it opened without a request)",
                        HEAD_TIMEOUT.as_secs()
                    );
                }
                continue;
            };
            let db = db.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &db)).await;
            });
        }
    });
    info!(addr = %bound, "serving /metrics, /healthz and /readyz");
    Ok(bound)
}

/// When a connection turned away was last logged (+ 1; 0: never).
static TURNED_AWAY_LOGGED_MS: AtomicU64 = AtomicU64::new(0);

/// Reads one request head (within [`HEAD_TIMEOUT`]) and answers it; the
/// connection is closed after.
async fn answer(mut stream: TcpStream, db: &Db) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let head_until = tokio::time::Instant::now() + HEAD_TIMEOUT;
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        if head.len() >= MAX_HEAD {
            let _ = respond(
                &mut stream,
                false,
                431,
                "text/plain",
                "request head too large\n",
            )
            .await;
            return;
        }
        match tokio::time::timeout_at(head_until, stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => return,
            Ok(Ok(n)) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let mut parts = text.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        let _ = respond(&mut stream, false, 405, "text/plain", "only GET and HEAD\n").await;
        return;
    }
    let (status, ctype, body) = match path {
        "/metrics" => (
            200,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            render(),
        ),
        "/healthz" => {
            let (ok, why) = liveness();
            (if ok { 200 } else { 503 }, "text/plain", format!("{why}\n"))
        }
        "/readyz" => {
            let (ok, report) = readiness(db).await;
            (if ok { 200 } else { 503 }, "text/plain", report)
        }
        _ => (
            404,
            "text/plain",
            "not found: /metrics, /healthz and /readyz are served\n".into(),
        ),
    };
    let _ = respond(&mut stream, head_only, status, ctype, &body).await;
}

async fn respond(
    stream: &mut TcpStream,
    head_only: bool,
    status: u16,
    ctype: &str,
    body: &str,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out).await?;
    stream.flush().await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An executor whose pool never held an idle process (a one-shot one,
    /// looked at by the health pass) has no idle-processes series; one that
    /// did has it, back at 0 when the pool is empty (audit 90).
    #[test]
    fn an_idle_processes_series_appears_with_the_first_idle_process() {
        let line = |name: &str| format!("durable_executor_idle_processes{{executor=\"{name}\"}}");
        idle_processes("metrics-test-one-shot", 0);
        assert!(!render().contains(&line("metrics-test-one-shot")));
        idle_processes("metrics-test-pool", 1);
        idle_processes("metrics-test-pool", 0);
        idle_processes("metrics-test-pool", -1);
        assert!(render().contains(&format!("{} 0", line("metrics-test-pool"))));
    }

    #[test]
    fn outcome_labels_split_into_outcome_and_code() {
        assert_eq!(split_label("succeeded"), ("succeeded", None));
        assert_eq!(
            split_label("failed (DEMO_FAILURE)"),
            ("failed", Some("DEMO_FAILURE"))
        );
        assert_eq!(
            split_label("refused (SECRET_UNAVAILABLE)"),
            ("refused", Some("SECRET_UNAVAILABLE"))
        );
        assert_eq!(split_label("cancelled"), ("cancelled", None));
        assert_eq!(
            split_label("released (worker shutdown)"),
            ("released", None)
        );
        assert_eq!(split_label("abandoned (lease lost)"), ("abandoned", None));
        assert_eq!(split_label("weird"), ("other", None));
    }

    /// Kinds that clean to one label value are one series counting them
    /// all (routing audit: the last row's count replaced the others').
    #[test]
    fn kinds_that_clean_alike_add_up_in_the_queue_depth() {
        let row = |kind: &str, ready| crate::db::QueueDepth {
            executor_kind: "qd-test".into(),
            kind: kind.into(),
            ready,
        };
        let long = "k".repeat(70);
        set_queue_depth(vec![
            row("demo echo", 2),
            row("demo\necho", 3),
            row(&format!("{long}_pdf"), 4),
            row(&format!("{long}_csv"), 1),
        ]);
        let depth = |kind: &str| {
            metrics()
                .queue_depth
                .get_or_create(&QueueLabels {
                    executor_kind: "qd-test".into(),
                    kind: clean(kind),
                })
                .get()
        };
        assert_eq!(depth("demo echo"), 5);
        assert_eq!(depth(&long), 5);
    }

    #[test]
    fn label_values_are_clean_and_bounded() {
        assert_eq!(clean("demo.echo"), "demo.echo");
        assert_eq!(clean("a\"b\nc{d}"), "a_b_c_d_");
        assert_eq!(clean(""), "none");
        assert_eq!(clean(&"x".repeat(500)).len(), 64);
        let f: Capped<CodeLabel, Counter> =
            Capped::new(Family::new_with_constructor(Counter::default));
        for i in 0..(MAX_SERIES + 50) {
            f.get(code(&format!("CODE_{i}")), other_code).inc();
        }
        // a value that has a series keeps it
        f.get(code("CODE_3"), other_code).inc();
        let mut registry = Registry::default();
        registry.register("c", "c", f.family.clone());
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        let series = text.lines().filter(|l| l.starts_with("c_total{")).count();
        assert_eq!(
            series,
            MAX_SERIES + 1,
            "MAX_SERIES values and other:\n{text}"
        );
        assert!(text.contains("c_total{code=\"other\"} 50"), "{text}");
        assert!(text.contains("c_total{code=\"CODE_3\"} 2"), "{text}");
    }

    #[test]
    fn the_registry_renders_every_family_by_name() {
        committed("failed (PROTOCOL_MALFORMED_FRAME)");
        attempt_failed("PROTOCOL_MALFORMED_FRAME");
        attempt_finished("demo.echo", "succeeded", Duration::from_millis(30));
        leased("go", 2);
        executor_signal("SIGTERM");
        ledger_batch(3);
        let text = render();
        for needle in [
            "durable_leases_total{executor=\"go\"}",
            "durable_attempts_completed_total{outcome=\"failed\"}",
            "durable_attempt_failures_total{code=\"PROTOCOL_MALFORMED_FRAME\"}",
            "durable_frame_errors_total{code=\"PROTOCOL_MALFORMED_FRAME\"}",
            "durable_step_duration_seconds_bucket{",
            "durable_executor_signals_total{signal=\"SIGTERM\"}",
            "durable_ledger_batch_intents_count",
            "# TYPE durable_retries_total counter",
            "# TYPE durable_heartbeat_lag_seconds gauge",
        ] {
            assert!(text.contains(needle), "{needle} missing:\n{text}");
        }
    }
}
