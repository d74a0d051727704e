//! The worker: probes its executors, leases steps it can route, runs each in a
//! child, heartbeats all leases in one statement, reclaims expired leases, and
//! drains on shutdown (detect → tell → wait).

mod attempt;
mod breaker;
mod jobdir;
mod leases;
mod ledger;
mod pauses;
pub mod routing;
mod session;
pub(crate) use session::job_limit;
mod warm;
mod workdir;

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::config::{ExecutorConfig, WorkerConfig};
use crate::db::{bounded, Db, DbError, Lease, Route};
use crate::process::{ProcessError, Spawner};
use crate::wire::{self, Hello, ToExecutor};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("cannot start the process spawner: {0}")]
    Spawner(#[source] ProcessError),
    #[error("executor {name:?} ({command}) failed its handshake: {why}. {}", probe_advice(.why))]
    Probe {
        name: String,
        command: String,
        why: String,
    },
    #[error("invalid worker setup: {0}")]
    Setup(String),
    /// The host cannot give the worker what it needs now (a full disk).
    #[error("{0}")]
    Host(String),
    #[error("the worker's {0} loop stopped unexpectedly; its children were stopped and the worker exits so that no step runs without a renewed lease")]
    LoopDied(&'static str),
    #[error("the drain ended with {0} step outcome(s) not recorded: the database did not take them before their leases ran out (is it reachable?). Those steps are run again once their leases expire, so their side effects may repeat; the worker's log names each one")]
    Unrecorded(u64),
}

/// What to do about a probe that failed: a limit of the host's, where its
/// message names one (resource audit: "too many open files" was answered
/// with "check its command"), else the command and the protocol.
fn probe_advice(why: &str) -> &'static str {
    if why.contains("os error 24") || why.contains("Too many open files") {
        "The worker is out of file descriptors: raise its open-file limit (`ulimit -n`, systemd's LimitNOFILE=, docker's --ulimit nofile=) or lower the executors' concurrency"
    } else if why.contains("os error 11")
        || why.contains("failed to create new OS thread")
        || why.contains("can't start new thread")
    {
        "The host refused a process or thread: raise the worker user's process limit (`ulimit -u`, systemd's TasksMax=/LimitNPROC=, a container's pids limit) or lower the executors' concurrency"
    } else if why.contains("os error 28") {
        "A filesystem it needs is full: free space (or inodes) there, or set work_dir elsewhere"
    } else if why.contains("print something to stdout") {
        "Its stdout carries frames only, the hello first: write banners and logs to stderr"
    } else if why.contains("before its hello") {
        "It exited or closed its stdout before its hello: its stderr, where it wrote any, says why — a crash at start, a missing library or module, a host limit"
    } else {
        "Check its command and that it speaks the executor protocol (proto/PROTOCOL.md)"
    }
}

/// How long any single database call of the worker may take (the heartbeat
/// has its own bound: see `heartbeat_timeout`).
pub(crate) const DB_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The first pause before an executor whose routes narrowed is probed
/// again (at least; `refusal_delay_ms` if longer), doubled after each
/// probe up to [`REPROBE_MAX`].
const REPROBE_FIRST: Duration = Duration::from_secs(1);
const REPROBE_MAX: Duration = Duration::from_secs(60);

/// How long a lease call in flight when the stop signal arrives may still
/// take before the drain starts without it.
const LEASE_GRACE_AT_STOP: Duration = Duration::from_secs(1);

/// How long the worker's loops may take to end once every attempt has.
const LOOPS_STOP_GRACE: Duration = Duration::from_secs(2);

/// How long the last write of a stopping worker (its `stopped_at`) may take.
const STOPPED_MARK_TIMEOUT: Duration = Duration::from_secs(3);

/// What the heartbeat tells a running attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    Run,
    Cancel,
    LeaseLost,
}

/// What the worker tells a running attempt about its lease: whether to go
/// on, and until when the lease is certainly valid (the lease clock: the send
/// time of the last successful renewal + TTL, advanced only on success).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseView {
    pub control: Control,
    pub valid_until: Instant,
}

/// A probed executor: its config and the lease routes its hello offered.
#[derive(Debug)]
pub struct ExecutorRuntime {
    pub cfg: ExecutorConfig,
    routes: RwLock<Vec<Route>>,
    /// Attempts using an executor slot (preparing, running the job).
    running: AtomicU32,
    /// Attempts holding a lease: running ones, and those whose outcome is
    /// being committed (their slot already went to the next job).
    held: AtomicU32,
    /// Idle warm processes (persistent executors).
    pool: session::Pool,
    /// Clean job directories for the next jobs (persistent executors).
    job_dirs: jobdir::JobDirs,
    /// Told whenever a slot is given back: the warm pool's keeper then
    /// replaces a process that was retired or killed (`warm_processes`).
    slot_back: Notify,
    /// Busy processes serving their last job (see [`session::LastJobs`]).
    last_jobs: session::LastJobs,
    /// The warm keeper's starts in flight, which a job may wait for.
    warm_starts: warm::WarmStarts,
    /// The routes its probe at start gave.
    initial_routes: Vec<Route>,
    /// While the routes are narrower than at start (a hello that dropped a
    /// kind: an upgrade), when to probe again and the pause after that.
    /// They widened only when a new process said more, and none was started
    /// unless a step of a kind still offered came: after a rollback, the
    /// dropped kinds' steps waited until the worker restarted (re-check
    /// audit).
    reprobe: std::sync::Mutex<Option<(Instant, Duration)>>,
    /// Open while this executor's processes cannot be started: nothing is
    /// leased for it (see `breaker.rs`).
    breaker: std::sync::Mutex<breaker::SpawnBreaker>,
}

impl ExecutorRuntime {
    /// The routes this executor is leased for now.
    pub fn routes(&self) -> Vec<Route> {
        self.routes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the routes with those of a probe process's hello (after a
    /// process's hello differed from them: [`Self::hello_changed`]), and
    /// says so in the worker's registered capabilities.
    pub(crate) fn set_routes(&self, shared: &Shared, routes: Vec<Route>) {
        let mut now = self.routes.write().unwrap_or_else(|p| p.into_inner());
        if *now == routes {
            return;
        }
        *now = routes.clone();
        drop(now);
        // narrower than at start: probed again now and then (see `reprobe`)
        let narrowed = !self.initial_routes.iter().all(|r| routes.contains(r));
        let mut reprobe = self.reprobe.lock().unwrap_or_else(|p| p.into_inner());
        match (narrowed, *reprobe) {
            (false, _) => *reprobe = None,
            (true, None) => {
                let pause = Duration::from_millis(shared.cfg.refusal_delay_ms).max(REPROBE_FIRST);
                *reprobe = Some((Instant::now() + pause, pause));
            }
            (true, Some(_)) => {}
        }
        drop(reprobe);
        self.publish_routes(shared, routes);
    }

    /// Whether the routes are narrower than at start and a probe is due to
    /// see whether the executor offers them again.
    fn reprobe_due(&self) -> bool {
        self.reprobe
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|(at, _)| Instant::now() >= at)
    }

    /// A re-probe ran: the next one after twice the pause (at most
    /// [`REPROBE_MAX`]), unless the routes are whole again.
    fn reprobed(&self) {
        let mut reprobe = self.reprobe.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, pause)) = *reprobe {
            let pause = (pause * 2).min(REPROBE_MAX);
            *reprobe = Some((Instant::now() + pause, pause));
        }
    }

    /// A process's hello (a job's or a warm one's) offers more than the
    /// routes, and all of them: the routes widen to it. Narrowed once (a
    /// refusal, then a probe, after an executor's upgrade dropped a kind or a
    /// label), they never widened again, and the steps the executor offered
    /// again waited for a worker restart.
    pub(crate) fn widen_routes(&self, shared: &Shared, hello: &wire::Hello) {
        let offered = routing::routes(hello, &self.cfg);
        let before = self.routes();
        if offered.len() <= before.len() || !before.iter().all(|r| offered.contains(r)) {
            return;
        }
        info!(executor = %self.cfg.name, routes = offered.len(), before = before.len(),
              "a process's hello offers more than this executor was leased for: leasing for all of it again");
        self.set_routes(shared, offered);
    }

    /// Writes the routes into the worker's registered capabilities, in the
    /// background (a failure only leaves `status`'s explanation stale).
    fn publish_routes(&self, shared: &Shared, routes: Vec<Route>) {
        let (db, id, name) = (shared.db.clone(), shared.id, self.cfg.name.clone());
        tokio::spawn(async move {
            let write = bounded(
                DB_CALL_TIMEOUT,
                "updating the worker's routes",
                db.set_worker_routes(id, &name, &routes),
            );
            if let Err(e) = write.await {
                warn!(executor = %name, error = %e, "cannot record the executor's new routes; status may name them wrongly until the worker restarts");
            }
        });
    }

    /// Starts a process of this executor in `dir` ([`session::Session::start`]),
    /// counted under `metric_kind` (`job`, `warm`), and tells the breaker
    /// of a command that cannot be started: that opens it (a session
    /// directory that cannot be made is not the executor's fault). A process
    /// started closes it only once it says its hello ([`Self::process_started`]):
    /// one that dies before it is a failed start too (re-check audit: each
    /// spawn closed the breaker, and steps were leased, and refused, while no
    /// process could say hello).
    pub(crate) async fn start_process(
        &self,
        shared: &Shared,
        dir: &std::path::Path,
        metric_kind: &'static str,
    ) -> Result<session::Session, session::StartError> {
        let res =
            session::Session::start(&shared.spawner, &shared.cfg, &shared.work, &self.cfg, dir)
                .await;
        match &res {
            Ok(_) => {
                crate::metrics::executor_process_started(&self.cfg.name, metric_kind);
            }
            Err(e @ (session::StartError::Spawn(_) | session::StartError::NoPipes)) => {
                let base = Duration::from_millis(shared.cfg.refusal_delay_ms);
                self.process_failed(shared, base, &e.to_string());
            }
            Err(session::StartError::WorkDir { .. }) => {}
        }
        res
    }

    /// A process of this executor said its hello: it is leased for as usual.
    pub(crate) fn process_started(&self, shared: &Shared) {
        self.breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .started();
        shared.pauses.clear(&self.cfg.name);
    }

    /// A process's hello no longer matches what this executor's routes say
    /// (another protocol version, other kinds, none): nothing more is leased
    /// for it until a pause has passed and a probe process's hello gives the
    /// routes again, whatever one process said.
    pub(crate) fn hello_changed(&self, shared: &Shared, why: &str) {
        let pause = self.pause_leasing(
            shared,
            Duration::from_millis(shared.cfg.refusal_delay_ms),
            &format!("a process's hello differs from its probe's: {why}"),
        );
        warn!(executor = %self.cfg.name, why, retry_in_ms = pause.as_millis() as u64,
              "a process's hello differs from the executor's probe: nothing is leased for it until a probe process's hello says what it offers");
    }

    /// A probe process's hello offers nothing this worker leases (no kinds,
    /// or none the config's `kinds` allows): probed again after a pause that
    /// doubles up to 30 s, as for a process that cannot start.
    fn offers_nothing(&self, shared: &Shared, hello: &wire::Hello) {
        let pause = self.pause_leasing(
            shared,
            Duration::from_millis(shared.cfg.refusal_delay_ms),
            &format!(
                "its probe's hello offers no kind this worker leases (offered {:?}, allowed {:?})",
                hello.kinds, self.cfg.kinds
            ),
        );
        warn!(executor = %self.cfg.name, offered = ?hello.kinds, allowed = ?self.cfg.kinds,
              retry_in_ms = pause.as_millis() as u64,
              "the executor offers no kind this worker leases (its hello's kinds, filtered by the config's kinds): nothing is leased for it; probed again after the pause");
    }

    /// A process of this executor could not be started: nothing more is
    /// leased for it until a pause has passed and a probe process starts.
    pub(crate) fn process_failed(&self, shared: &Shared, base: Duration, why: &str) {
        let pause = self.pause_leasing(shared, base, &format!("cannot be started: {why}"));
        warn!(executor = %self.cfg.name, error = %why, retry_in_ms = pause.as_millis() as u64,
              "the executor cannot be started here: no step is leased for it until a probe process starts");
    }

    /// Opens the spawn breaker (or lengthens its pause): the pause.
    fn pause_leasing(&self, shared: &Shared, base: Duration, why: &str) -> Duration {
        let pause = self
            .breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failed(Instant::now(), base);
        shared.pauses.set(&self.cfg.name, why);
        pause
    }

    /// The probe the breaker asks for before more is leased: the hello,
    /// and for a persistent executor the probe's process, kept for the
    /// next job (see `warm::probe_process`); a one-shot one is stopped.
    async fn probe_for_leasing(
        &self,
        shared: &Shared,
    ) -> Result<(wire::Hello, Option<session::Session>), String> {
        if !self.cfg.persistent {
            return probe_in(&shared.spawner, &self.cfg, &shared.cfg, Some(&shared.work))
                .await
                .map(|h| (h, None))
                .map_err(|e| e.to_string());
        }
        warm::probe_process(shared, self)
            .await
            .map(|(h, s)| (h, Some(s)))
            .map_err(|why| {
                WorkerError::Probe {
                    name: self.cfg.name.clone(),
                    command: self.cfg.command.clone(),
                    why: why + &self.cfg.relative_args_note(),
                }
                .to_string()
            })
    }

    fn lease_now(&self) -> breaker::Lease {
        self.breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lease(Instant::now())
    }
}

/// State shared by the loops and the attempts of one worker.
pub(crate) struct Shared {
    pub db: Db,
    /// The heartbeat's own connection: a busy pool never delays a renewal.
    pub hb_db: Db,
    /// The one writer of the worker's hot writes (starts, plain events,
    /// plain completions), batched.
    pub ledger: ledger::Ledger,
    pub cfg: Arc<WorkerConfig>,
    pub id: Uuid,
    pub name: String,
    pub spawner: Spawner,
    /// Cancelled when the drain timeout passes: running children are stopped.
    pub abort: CancellationToken,
    /// Cancelled when the drain starts: no session goes back to a pool.
    pub draining: CancellationToken,
    leases: leases::LeaseSet,
    /// This worker's share of `work_dir` (its tag and lock).
    pub work: Arc<workdir::WorkDir>,
    /// Wakes the lease loop (NOTIFY, a freed slot, a retry coming due).
    wake: Arc<Notify>,
    /// Outcomes (results, failures, releases) this worker gave up on because
    /// the database did not take them while their leases were valid: those
    /// steps run again elsewhere. A drain that adds to it is not clean.
    unrecorded: AtomicU64,
    /// `unrecorded` when the stop signal arrived (u64::MAX until then).
    unrecorded_at_stop: AtomicU64,
    /// The last renewal failed: nothing is leased until one succeeds. A
    /// worker whose heartbeat could not connect (its own connection, say
    /// max_connections reached) went on leasing, and every step it leased
    /// lost its lease within seconds, attempt after attempt, until its run
    /// failed LEASE_EXPIRED.
    renewals_failing: AtomicBool,
    /// Steps this worker refused a moment ago ("this worker can't": a
    /// secret it lacks, an executor that said no), each until the time this
    /// worker may lease it again: other workers get it first. The refusing
    /// worker leased it again as soon as it was due, every time, and its
    /// refusals failed the step while a worker that could run it idled.
    refused: std::sync::Mutex<std::collections::HashMap<Uuid, Instant>>,
    /// Executor kinds and times (in 10 ms) of steps coming due that are
    /// to be announced ([`Shared::due_at`]).
    announcing: Arc<std::sync::Mutex<HashSet<(String, i64)>>>,
    /// The worker's lease epoch: a lease call names it, and leases nothing
    /// once the worker moved it on (`revoke_lost_leases`).
    lease_epoch: AtomicI64,
    /// A lease call failed: it may have leased steps this worker never
    /// received; they are given back before the next lease.
    lease_cut_off: AtomicBool,
    /// The work_dir refused a directory (full, read-only): nothing is
    /// leased until a pause has passed and a probe directory can be made.
    /// Every step leased meanwhile was refused WORK_DIR_UNAVAILABLE, and a
    /// disk full for 20 s failed a worker's whole backlog EXECUTOR_REFUSED
    /// (resource audit).
    work_breaker: std::sync::Mutex<breaker::SpawnBreaker>,
    /// What leases nothing now and why, recorded for `status`.
    pauses: pauses::Pauses,
    /// The checkpoint bytes of every attempt's writes not yet answered.
    checkpoint_bytes: Arc<attempt::QueuedBytes>,
}

impl Shared {
    /// No directory could be made in the work_dir: leasing pauses (see
    /// `work_breaker`).
    pub(crate) fn work_dir_failed(&self, why: &str) {
        let pause = self
            .work_breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failed(
                Instant::now(),
                Duration::from_millis(self.cfg.refusal_delay_ms),
            );
        crate::metrics::work_dir(false);
        self.pauses.set(
            pauses::WHOLE_WORKER,
            &format!(
                "its work_dir {} takes no new directory: {why}",
                self.work.base().display()
            ),
        );
        warn!(work_dir = %self.work.base().display(), error = %why, retry_in_ms = pause.as_millis() as u64,
              "an attempt could not write in the work_dir: nothing is leased until a probe can (free space or inodes on its filesystem, or fix its permissions)");
    }

    /// Whether steps may be leased as far as the work_dir goes: after a
    /// failure, once its pause has passed, a probe directory is made (and
    /// removed) first.
    fn work_dir_usable(&self) -> bool {
        let now = self
            .work_breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .lease(Instant::now());
        match now {
            breaker::Lease::Yes => true,
            breaker::Lease::NotYet => false,
            breaker::Lease::ProbeFirst => match self.work.probe() {
                Ok(()) => {
                    self.work_breaker
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .started();
                    crate::metrics::work_dir(true);
                    self.pauses.clear(pauses::WHOLE_WORKER);
                    info!(work_dir = %self.work.base().display(), "the work_dir can be written again: leasing");
                    true
                }
                Err(e) => {
                    self.work_dir_failed(&e.to_string());
                    false
                }
            },
        }
    }

    /// The attempt's commit resolved (or it was abandoned): its lease leaves
    /// the renewal set. Until then the heartbeat keeps renewing it, so a
    /// commit that waits on a busy database does not lose a valid lease.
    fn forget(&self, lease: &Lease) {
        self.leases.forget(lease);
    }

    /// This worker refused the step: other workers get it first, for
    /// [`Shared::left_for`]; after that it may lease it again (and refuse
    /// it again, towards `max_refusals`, if no other worker took it).
    pub(crate) fn leave_to_others(&self, step_run_id: Uuid) {
        let until = Instant::now() + self.left_for();
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(step_run_id, until);
    }

    /// The steps left to other workers now (the expired ones are dropped).
    fn left_to_others(&self) -> Vec<Uuid> {
        let now = Instant::now();
        let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        refused.retain(|_, until| *until > now);
        refused.keys().copied().collect()
    }

    /// How long a refused step is left to other workers: five of their
    /// polls, and at least 5 s.
    fn left_for(&self) -> Duration {
        Duration::from_millis(self.cfg.poll_interval_ms.saturating_mul(5))
            .max(Duration::from_secs(5))
    }

    /// A step of `executor_kind` this worker wrote back for a later attempt
    /// (a retry, a reclaimed lease's retry, a refusal's delay) comes due at
    /// `at`: the lease loop is woken then, and the workers listening for
    /// that kind are (a NOTIFY, [`Db::announce_steps`]). The NOTIFY a step's
    /// move sends goes out when it becomes leasable by its state, not when
    /// its retry time comes, so without this a retry waited for the next
    /// poll (up to `poll_interval_ms` late): a reclaimed step's retry after
    /// its worker died waited for a poll of the reclaimer, and a refused
    /// step for the other workers' polls (time audit). Steps due in the
    /// same 10 ms are announced once; retries further off than a minute
    /// are left to the polls, as is everything when this worker stops.
    pub(crate) fn due_at(&self, executor_kind: &str, at: chrono::DateTime<chrono::Utc>) {
        let delay = (at - chrono::Utc::now()).to_std().unwrap_or_default();
        if delay > Duration::from_secs(60) {
            return;
        }
        let key = (executor_kind.to_owned(), at.timestamp_millis() / 10);
        if !self
            .announcing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone())
        {
            return;
        }
        let (wake, stop, db) = (self.wake.clone(), self.draining.clone(), self.db.clone());
        let announcing = self.announcing.clone();
        tokio::spawn(async move {
            // a few milliseconds late: the database's clock decides `<= now()`
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(delay + Duration::from_millis(5)) => {
                    wake.notify_one();
                    let announce = bounded(
                        DB_CALL_TIMEOUT,
                        "announcing steps coming due",
                        db.announce_steps(&key.0),
                    );
                    if let Err(e) = announce.await {
                        debug!(error = %e, executor_kind = %key.0, "steps coming due were not announced; other workers find them on their polls");
                    }
                }
            }
            announcing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
        });
    }

    /// The attempt decided its outcome and commits it now (see
    /// [`leases::LeaseSet::committing`]).
    pub(crate) fn committing(&self, lease: &Lease) {
        self.leases.committing(lease);
    }

    /// A write learned that the lease is gone: tell the attempt.
    pub(crate) fn lease_lost(&self, lease: &Lease) {
        self.leases.lease_lost(lease);
    }

    /// Time the attempt needs to stop its child (cancel grace, SIGTERM grace)
    /// plus a margin: a child is stopped this long before its lease can expire.
    pub(crate) fn stop_budget(&self) -> Duration {
        Duration::from_millis(
            self.cfg.cancel_grace_ms + self.cfg.term_grace_ms + self.cfg.heartbeat_interval_ms / 2,
        )
    }

    /// How long a lease call may take: half of what a lease clock has
    /// beyond the stop budget, at most [`DB_CALL_TIMEOUT`]. A lease clock
    /// starts when its call is sent; a call that waited longer (behind a
    /// `LOCK TABLE`, a lock a long transaction holds up) brought steps
    /// whose clocks had less than the stop budget left, and each attempt
    /// was stopped as it began and counted (`LEASE_LOST`: re-check audit,
    /// an 8 s lock inside a 10 s lease failed a step of `max_attempts` 1).
    /// Cut off, the call leases nothing that counts: what it leased late is
    /// given back uncounted ([`revoke_lost_leases`]).
    pub(crate) fn lease_call_bound(&self) -> Duration {
        lease_call_bound(
            Duration::from_millis(self.cfg.lease_ttl_ms),
            self.stop_budget(),
        )
    }
}

/// The context of a lease statement sent and not answered within the
/// lease call's bound (not a wait for a connection).
const LEASE_STATEMENT: &str = "waiting for the lease statement's answer";

/// See [`Shared::lease_call_bound`].
fn lease_call_bound(ttl: Duration, stop_budget: Duration) -> Duration {
    (ttl.saturating_sub(stop_budget) / 2).clamp(Duration::from_millis(100), DB_CALL_TIMEOUT)
}

/// An attempt's executor slot. Given back as soon as the attempt is done
/// with its executor (the process stopped and reaped, or back in the pool),
/// before the attempt's writes finish, its result is verified and its
/// outcome committed: the next job waits on none of these. Given back
/// whatever happens (a panic included).
pub(crate) struct ExecSlot {
    exec: Arc<ExecutorRuntime>,
    freed: Arc<Notify>,
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        self.exec.running.fetch_sub(1, Ordering::SeqCst);
        self.exec.slot_back.notify_one();
        self.freed.notify_one();
    }
}

/// An attempt's lease: it leaves the renewal set when the attempt's task
/// ends (its commit resolved), whatever happens to the task.
struct LeaseGuard {
    shared: Arc<Shared>,
    exec: Arc<ExecutorRuntime>,
    lease: Lease,
    freed: Arc<Notify>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.shared.forget(&self.lease);
        self.exec.held.fetch_sub(1, Ordering::SeqCst);
        self.freed.notify_one();
    }
}

/// How many steps an executor may lease now: its free slots, while its
/// attempts still committing (slot given back, lease held) number no more
/// than its concurrency again. A slow database therefore holds at most twice
/// the concurrency in leases.
fn leasable(concurrency: u32, running: u32, held: u32) -> u32 {
    concurrency
        .saturating_sub(running)
        .min(concurrency.saturating_mul(2).saturating_sub(held))
}

/// Probes one executor: spawn, read its hello, ask it to shut down, reap
/// (the `executors` command's probe, outside a worker).
pub async fn probe(
    spawner: &Spawner,
    cfg: &ExecutorConfig,
    wcfg: &WorkerConfig,
) -> Result<Hello, WorkerError> {
    probe_in(spawner, cfg, wcfg, None).await
}

/// [`probe`], in a directory of `work` when a worker probes: it carries the
/// worker's tag, so the sweep of a worker killed during a probe removes it
/// (audit 83).
async fn probe_in(
    spawner: &Spawner,
    cfg: &ExecutorConfig,
    wcfg: &WorkerConfig,
    work: Option<&workdir::WorkDir>,
) -> Result<Hello, WorkerError> {
    let fail = |why: String| WorkerError::Probe {
        name: cfg.name.clone(),
        command: cfg.command.clone(),
        why: why + &cfg.relative_args_note(),
    };
    // in work_dir, as every attempt's directory (it went to /tmp whatever
    // work_dir said), for this worker's user alone (audit 83: it was 0755,
    // listable by any user of a shared work_dir)
    let dir = match work {
        Some(w) => w.tempdir("durable-probe-"),
        None => tempfile::Builder::new()
            .prefix("durable-probe-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .tempdir_in(wcfg.work_base()),
    }
    .map_err(|e| fail(format!("cannot create a temp dir: {e}")))?;
    let spec = cfg.spawn_spec(dir.path(), wcfg.stderr_tail_bytes);
    let mut child = spawner.spawn(spec).await.map_err(|e| fail(e.to_string()))?;
    let stdout = child.take_stdout();
    let mut stdin = child.take_stdin();
    let hello = match stdout {
        None => Err("no stdout pipe".to_string()),
        Some(out) => {
            let mut frames = FramedRead::new(out, wire::executor_decoder(wcfg.max_frame_bytes));
            wire::read_hello(
                &mut frames,
                Duration::from_millis(wcfg.handshake_timeout_ms),
            )
            .await
            .map_err(|e| e.to_string() + e.stdout_hint())
        }
    };
    if let Some(w) = stdin.as_mut() {
        use tokio::io::AsyncWriteExt;
        let _ = w
            .write_all(&wire::encode_to_executor(&ToExecutor::Shutdown {
                reason: "probe".into(),
            }))
            .await;
    }
    drop(stdin);
    let grace = Duration::from_millis(wcfg.cancel_grace_ms);
    let report = if attempt::wait_exit(&mut child, grace).await {
        child.finish().await
    } else {
        child
            .terminate(Duration::from_millis(wcfg.term_grace_ms))
            .await
    };
    match (hello, report) {
        (Ok(h), _) => usable_hello(h, wcfg.max_frame_bytes).map_err(fail),
        (Err(why), Ok(r)) => Err(fail(why + &how_it_ended(Some(&r), &r.stderr_tail))),
        (Err(why), Err(_)) => Err(fail(why)),
    }
}

/// How a process that gave no hello ended (when it was reaped), and its
/// stderr where it wrote any, to follow why: "; then it exited with code
/// 3", "; then it was killed by SIGTERM; stderr: …".
pub(crate) fn how_it_ended(r: Option<&crate::process::ExitReport>, stderr_tail: &str) -> String {
    let end = r.map(|r| match r.status {
        crate::process::ExitStatusKind::Exited(_) => format!("; then it {}", r.status),
        crate::process::ExitStatusKind::Signaled(_) => format!("; then it was {}", r.status),
    });
    match stderr_tail.trim() {
        "" => end.unwrap_or_default(),
        tail => format!("{}; stderr: {tail}", end.unwrap_or_default()),
    }
}

/// The smallest frame limit an executor's hello may announce (PROTOCOL.md).
const MIN_EXECUTOR_FRAME_BYTES: u64 = 64 * 1024;

/// `h` if this supervisor can speak to the executor that said it: its
/// protocol version, and an agreement on revision, features and frame limits.
pub(crate) fn usable_hello(h: Hello, max_frame_bytes: usize) -> Result<Hello, String> {
    if h.protocol_version != wire::PROTOCOL_VERSION {
        return Err(format!(
            "it speaks protocol version {}; this supervisor speaks {}. Upgrade the executor's SDK or the supervisor",
            h.protocol_version,
            wire::PROTOCOL_VERSION
        ));
    }
    // a step names its executor_kind, never an empty one (`submit` refuses
    // it): such an executor could run nothing, and was "ready" all the same
    // (third-party audit; `conformance` failed it)
    if h.executor_kind.trim().is_empty() {
        return Err(
            "its hello has an empty or blank executor_kind, which no step can name: set it in the executor's hello (the SDKs' executor_kind)".into(),
        );
    }
    // PROTOCOL.md: announce at least 64 KiB. Below it no job would fit (a
    // job with its identity, deadlines and input is hundreds of bytes at
    // least), so every attempt would fail JOB_TOO_LARGE, not retried
    if h.max_frame_bytes != 0 && h.max_frame_bytes < MIN_EXECUTOR_FRAME_BYTES {
        return Err(format!(
            "its hello announces max_frame_bytes = {}; PROTOCOL.md asks for at least {MIN_EXECUTOR_FRAME_BYTES} (64 KiB), or 0 for the default 8 MiB",
            h.max_frame_bytes
        ));
    }
    match wire::negotiate(&h, &wire::SupervisorOffer::new(max_frame_bytes)) {
        Ok(_) => Ok(h),
        Err(e) => Err(format!("{} ({e})", e.code())),
    }
}

/// Raises the process's soft open-file limit to its hard one
/// ([`crate::process::raise_open_file_limit`]), and says what it did.
fn raise_open_file_limit() {
    match crate::process::raise_open_file_limit() {
        crate::process::OpenFileLimit::Raised { from, to } => {
            info!(from, to, "raised the open-file limit (soft) to the hard limit; executors start with the one the worker was given")
        }
        crate::process::OpenFileLimit::AlreadyAtMost(at) => {
            debug!(limit = at, "the open-file limit is the hard limit already")
        }
        crate::process::OpenFileLimit::Refused { at, errno } => warn!(
            limit = at,
            error = %std::io::Error::from_raw_os_error(errno),
            "cannot raise the open-file limit; each running step needs about three open files"
        ),
    }
}

/// A running worker.
pub struct Worker {
    shared: Arc<Shared>,
    executors: Vec<Arc<ExecutorRuntime>>,
    heartbeat_now: Arc<Notify>,
    ledger_queue: ledger::LedgerQueue,
}

/// Ends what a killed predecessor of the same slot left behind (found by
/// its marker in /proc; a live worker's children are spared).
async fn sweep_previous_incarnations(slot: String, id: Uuid) {
    let (s2, i2) = (slot.clone(), id.to_string());
    match tokio::task::spawn_blocking(move || crate::process::sweep_previous_incarnations(&s2, &i2))
        .await
    {
        Ok(r) if r.processes_killed > 0 || r.cgroups_killed > 0 => {
            warn!(slot = %slot, report = ?r, "ended what a previous incarnation of this worker left running")
        }
        Ok(r) => debug!(slot = %slot, report = ?r, "no leftovers of a previous incarnation"),
        Err(e) => warn!(error = %e, "the sweep of previous incarnations failed"),
    }
}

impl ExecutorRuntime {
    /// Probes the executor (its hello), checks what it offers against its
    /// config, and makes its runtime: routes, pool, job directories.
    async fn probed(
        spawner: &Spawner,
        ecfg: &ExecutorConfig,
        cfg: &WorkerConfig,
        work: &workdir::WorkDir,
    ) -> Result<ExecutorRuntime, WorkerError> {
        let hello = probe_in(spawner, ecfg, cfg, Some(work)).await?;
        let routes = routing::routes(&hello, ecfg);
        check_kinds(ecfg, &hello, &routes)?;
        info!(executor = %ecfg.name, executor_kind = %hello.executor_kind, kinds = ?hello.kinds,
              leased_kinds = ?routes.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(),
              labels = ?routing::effective_labels(&hello, ecfg), sdk = %hello.sdk_name, "executor ready");
        Ok(ExecutorRuntime {
            cfg: ecfg.clone(),
            routes: RwLock::new(routes.clone()),
            running: AtomicU32::new(0),
            held: AtomicU32::new(0),
            pool: session::Pool::new(&ecfg.name, ecfg.concurrency as usize),
            job_dirs: jobdir::JobDirs::new(&ecfg.name),
            slot_back: Notify::new(),
            last_jobs: Default::default(),
            warm_starts: Default::default(),
            initial_routes: routes,
            reprobe: Default::default(),
            breaker: Default::default(),
        })
    }
}

impl Worker {
    /// Checks the schema and the setup, probes every executor, registers the
    /// worker. It does not migrate: `supervisor migrate` does (rolling
    /// upgrades: an older worker runs against a newer compatible schema).
    pub async fn start(db: Db, cfg: WorkerConfig) -> Result<Worker, WorkerError> {
        db.end_idle_transactions_after(Duration::from_millis(cfg.lease_ttl_ms))
            .await;
        let version = db.check_schema().await?;
        check_privileges(&db).await?;
        check_setup(&db, &cfg)?;
        crate::process::set_stderr_log_rate(cfg.stderr_log_lines_per_sec);
        raise_open_file_limit();
        let id = Uuid::new_v4();
        let host = hostname();
        // every child carries this worker's slot (its name, or the host) and
        // incarnation; a restarted worker ends what a killed predecessor of
        // the same slot left behind, found by that marker in /proc, never by
        // a stored pid (a live worker's children are spared)
        let slot = cfg.name.clone().unwrap_or_else(|| format!("host:{host}"));
        let spawner = Spawner::start_with_marker(crate::process::Marker {
            slot: slot.clone(),
            instance: id.to_string(),
        })
        .map_err(WorkerError::Spawner)?;
        sweep_previous_incarnations(slot, id).await;
        let work = open_work_dir(&cfg, id).await?;
        let mut executors = Vec::with_capacity(cfg.executors.len());
        for ecfg in &cfg.executors {
            executors.push(Arc::new(
                ExecutorRuntime::probed(&spawner, ecfg, &cfg, &work).await?,
            ));
        }
        let name = cfg
            .name
            .clone()
            .unwrap_or_else(|| format!("{host}:{}", std::process::id()));
        register(&db, &cfg, &executors, id, &name, &host).await?;
        if cfg.name.is_some() {
            stop_dead_predecessors(&db, id, &name, &host).await;
        }
        info!(schema_version = version, "schema checked");
        let hb_db = db.dedicated(heartbeat_timeout(&cfg));
        let (ledger, ledger_queue) = ledger::channel();
        let shared = Arc::new(Shared {
            db,
            hb_db,
            ledger,
            cfg: Arc::new(cfg),
            id,
            name,
            spawner,
            abort: CancellationToken::new(),
            draining: CancellationToken::new(),
            leases: leases::LeaseSet::default(),
            work,
            wake: Arc::new(Notify::new()),
            unrecorded: AtomicU64::new(0),
            unrecorded_at_stop: AtomicU64::new(u64::MAX),
            renewals_failing: AtomicBool::new(false),
            refused: Default::default(),
            announcing: Default::default(),
            lease_epoch: AtomicI64::new(0),
            lease_cut_off: AtomicBool::new(false),
            work_breaker: Default::default(),
            pauses: Default::default(),
            checkpoint_bytes: Arc::new(attempt::QueuedBytes::worker(attempt::WORKER_QUEUE_BYTES)),
        });
        {
            let mut workers = WORKERS
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            workers.retain(|w| w.strong_count() > 0);
            workers.push(Arc::downgrade(&shared));
        }
        Ok(Worker {
            shared,
            executors,
            heartbeat_now: Arc::new(Notify::new()),
            ledger_queue,
        })
    }

    pub fn id(&self) -> Uuid {
        self.shared.id
    }

    /// Runs until `shutdown` is cancelled, then drains: no new leases; running
    /// attempts get `drain_timeout_ms` to finish, then are stopped (and fail
    /// retryably with WORKER_SHUTDOWN); leases keep being renewed meanwhile.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let span = info_span!("worker", worker = %self.shared.name, worker_id = %self.shared.id);
        self.run_inner(shutdown).instrument(span).await
    }

    async fn run_inner(self, shutdown: CancellationToken) -> Result<(), WorkerError> {
        let shared = self.shared.clone();
        let cfg = shared.cfg.clone();
        let loops_stop = CancellationToken::new();
        let mut vital =
            spawn_vital_loops(&shared, &self.heartbeat_now, self.ledger_queue, &loops_stop);
        let mut background = JoinSet::new();
        spawn_retention_loop(&mut background, &shared, &loops_stop);
        background
            .spawn(pauses::publish_loop(shared.clone(), loops_stop.clone()).in_current_span());
        background.spawn(
            listen_loop(
                shared.clone(),
                self.heartbeat_now.clone(),
                loops_stop.clone(),
            )
            .in_current_span(),
        );

        let mut attempts: JoinSet<()> = JoinSet::new();
        let slot_freed = Arc::new(Notify::new());
        background.spawn(
            note_unrecorded_at_stop(shared.clone(), shutdown.clone(), loops_stop.clone())
                .in_current_span(),
        );
        info!(executors = self.executors.len(), "worker running");
        crate::metrics::worker_running(&cfg);
        // warm pools: processes started ahead of jobs, until the drain starts
        let mut keepers = warm::start(&shared, &self.executors, &shared.draining);
        let mut died = lease_until_stopped(
            &shared,
            &self.executors,
            &shutdown,
            &mut vital,
            &slot_freed,
            &mut attempts,
        )
        .await;

        // outcomes given up on between the stop signal and the drain's start
        // belong to this stop as well
        let unrecorded_before = shared
            .unrecorded
            .load(Ordering::Relaxed)
            .min(shared.unrecorded_at_stop.load(Ordering::Relaxed));
        // the idle processes are retired while the attempts drain, not
        // after them: one that does not end on its Shutdown added its graces
        // to the drain's (re-check audit: a stop past the README's budget)
        shared.draining.cancel();
        tokio::join!(
            drain(&shared, &mut attempts, &mut vital, &mut died),
            retire_idle(&self.executors, &cfg)
        );
        // warm processes: Shutdown, EOF, their grace, then the usual stop
        // (the keepers stopped with the drain; none puts a process back now)
        while keepers.join_next().await.is_some() {}
        // and those the drain's attempts put back
        retire_idle(&self.executors, &cfg).await;
        loops_stop.cancel();
        stop_loops(&mut vital, &mut background).await;
        mark_stopped(&shared).await;
        if let Some(name) = died {
            return Err(WorkerError::LoopDied(name));
        }
        // every attempt, job and session directory is gone with its
        // attempt or process
        shared.work.release();
        let unrecorded = shared.unrecorded.load(Ordering::Relaxed) - unrecorded_before;
        if unrecorded > 0 {
            error!(unrecorded, "worker stopped; the drain was not clean");
            return Err(WorkerError::Unrecorded(unrecorded));
        }
        // every attempt of this worker has reaped its child by now; the
        // process-wide safety net (kill_all_groups) belongs to the command's
        // exit path, since other workers may share this process
        info!("worker stopped");
        Ok(())
    }
}

/// Leases and reaps ended attempt tasks until the stop (a signal or
/// `shutdown`); the name of a vital loop that ended before it, if one did.
async fn lease_until_stopped(
    shared: &Arc<Shared>,
    executors: &[Arc<ExecutorRuntime>],
    shutdown: &CancellationToken,
    vital: &mut JoinSet<&'static str>,
    slot_freed: &Arc<Notify>,
    attempts: &mut JoinSet<()>,
) -> Option<&'static str> {
    let poll = Duration::from_millis(shared.cfg.poll_interval_ms);
    let ttl = Duration::from_millis(shared.cfg.lease_ttl_ms);
    while !shutdown.is_cancelled() && !stop_signalled() {
        // a vital loop that ended is noticed on every pass, also while a
        // backlog keeps the loop from ever waiting below
        if let Some(res) = vital.try_join_next() {
            return Some(vital_loop_died(res, shared));
        }
        let pass = lease_pass(shared, executors, slot_freed, attempts, ttl);
        let leased_any_full = unless_stopped_for_long(shutdown, pass).await;
        // reap finished attempt tasks (a panic in one is logged, never fatal)
        while let Some(res) = attempts.try_join_next() {
            if let Err(e) = res {
                error!(error = %e, "an attempt task panicked");
            }
        }
        if leased_any_full {
            continue; // backlog: lease again right away
        }
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = shared.wake.notified() => {}
            _ = slot_freed.notified() => {}
            _ = tokio::time::sleep(poll) => {}
            Some(res) = vital.join_next() => {
                return Some(vital_loop_died(res, shared));
            }
        }
    }
    None
}

/// Retires every idle process of every pool, all at once: one at a time,
/// each that does not end on its Shutdown (a stopped one, a hung one) added
/// its graces to the worker's stop.
async fn retire_idle(executors: &[Arc<ExecutorRuntime>], cfg: &WorkerConfig) {
    let idle: Vec<_> = executors.iter().flat_map(|e| e.pool.drain()).collect();
    futures::future::join_all(
        idle.into_iter()
            .map(|s| s.retire(cfg, "the worker is stopping")),
    )
    .await;
}

/// Starts the loops a worker cannot run without: the heartbeat, the reclaim
/// and the ledger (which writes until the attempts are done — it is stopped
/// with the other loops, after the drain — and then empties its queue). If
/// one ends before it is told to, the worker stops its children and exits
/// non-zero.
fn spawn_vital_loops(
    shared: &Arc<Shared>,
    heartbeat_now: &Arc<Notify>,
    queue: ledger::LedgerQueue,
    loops_stop: &CancellationToken,
) -> JoinSet<&'static str> {
    let mut vital: JoinSet<&'static str> = JoinSet::new();
    let (s1, n1, t1) = (shared.clone(), heartbeat_now.clone(), loops_stop.clone());
    // each loop logs in the worker's span (its name and id): several
    // workers' logs in one place named no worker for a lost lease
    vital.spawn(
        async move {
            heartbeat_loop(s1, n1, t1).await;
            "heartbeat"
        }
        .in_current_span(),
    );
    let (s2, t2) = (shared.clone(), loops_stop.clone());
    vital.spawn(
        async move {
            reclaim_loop(s2, t2).await;
            "reclaim"
        }
        .in_current_span(),
    );
    let (db3, name3, t3) = (shared.db.clone(), shared.name.clone(), loops_stop.clone());
    let s3 = Arc::downgrade(shared);
    let live: ledger::LiveLeases = Box::new(move || s3.upgrade().map_or(0, |s| s.leases.len()));
    vital.spawn(
        async move {
            ledger::run(db3, name3, queue, t3, live).await;
            "ledger"
        }
        .in_current_span(),
    );
    vital
}

/// Waits for the worker's loops, told to stop, for [`LOOPS_STOP_GRACE`],
/// then aborts them. Every attempt has ended: what the loops still do (a
/// ledger batch of abandoned attempts, a LISTEN reconnect) waits on nobody,
/// and with the database away each waited a pool timeout (10 s), past the
/// stop budget the README gives a worker's supervisor.
async fn stop_loops(vital: &mut JoinSet<&'static str>, background: &mut JoinSet<()>) {
    let loops_ended = tokio::time::timeout(LOOPS_STOP_GRACE, async {
        while vital.join_next().await.is_some() {}
        while background.join_next().await.is_some() {}
    })
    .await;
    if loops_ended.is_err() {
        warn!(
            grace_ms = LOOPS_STOP_GRACE.as_millis() as u64,
            "the worker's loops did not stop within their grace (the database is slow or away): stopped"
        );
        vital.abort_all();
        background.abort_all();
    }
}

/// The worker's row: its executors' routes (what `status` reads to say
/// that no live worker offers a step) with the secret names each may hand
/// out (what other workers' leases read to leave it a step naming them),
/// and its heartbeat interval (how long it counts as live).
async fn register(
    db: &Db,
    cfg: &WorkerConfig,
    executors: &[Arc<ExecutorRuntime>],
    id: Uuid,
    name: &str,
    host: &str,
) -> Result<(), DbError> {
    let caps = serde_json::to_value(
        executors
            .iter()
            .map(|e| {
                serde_json::json!({"executor": e.cfg.name, "routes": e.routes(),
                                   "secrets": e.cfg.secrets})
            })
            .collect::<Vec<_>>(),
    )
    .unwrap_or_default();
    let interval = Duration::from_millis(cfg.heartbeat_interval_ms);
    bounded(
        DB_CALL_TIMEOUT,
        "registering the worker",
        db.register_worker_beating(id, name, host, &caps, Some(interval)),
    )
    .await
}

/// Marks stopped the rows of this worker's slot (its name, on this host)
/// whose process is gone: a killed predecessor's row counted as live for
/// up to 30 s after its last heartbeat, and other workers left it steps
/// naming secrets only it could hand out (re-check audit). A process of the
/// row's pid that still exists (a namesake running on, or the pid taken by
/// another process) is left to the liveness window; this very process's pid
/// is a predecessor's that is gone (a container restarted as pid 1).
async fn stop_dead_predecessors(db: &Db, id: Uuid, name: &str, host: &str) {
    let rows = match bounded(
        DB_CALL_TIMEOUT,
        "reading the worker's predecessors",
        db.unstopped_namesakes(id, name, host),
    )
    .await
    {
        Ok(rows) => rows,
        Err(e) => {
            warn!(error = %e, "cannot look for the rows of this worker's dead predecessors: status counts them live until their heartbeats are old");
            return;
        }
    };
    let own = std::process::id() as i32;
    let dead: Vec<Uuid> = rows
        .into_iter()
        .filter(|(_, pid)| *pid == own || !std::path::Path::new(&format!("/proc/{pid}")).exists())
        .map(|(id, _)| id)
        .collect();
    if dead.is_empty() {
        return;
    }
    match bounded(
        DB_CALL_TIMEOUT,
        "marking dead workers stopped",
        db.mark_workers_stopped(&dead),
    )
    .await
    {
        Ok(n) => info!(
            predecessors = n,
            "marked this worker's dead predecessors stopped"
        ),
        Err(e) => {
            warn!(error = %e, "cannot mark this worker's dead predecessors stopped: status counts them live until their heartbeats are old")
        }
    }
}

/// Every worker of this process, for the last word of a forced exit.
static WORKERS: std::sync::Mutex<Vec<std::sync::Weak<Shared>>> = std::sync::Mutex::new(Vec::new());

/// Logs the steps whose attempts a forced exit abandons: those whose outcome
/// was decided but not recorded, and those still running. Both run again
/// once their leases expire.
pub fn log_abandoned_attempts() {
    let workers = WORKERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for shared in workers.iter().filter_map(std::sync::Weak::upgrade) {
        // the run and the step's name, as `status` shows them (audit 81:
        // the step run's id alone named nothing a person could look up)
        for h in shared.leases.attempts() {
            let (run_id, step, step_run_id) = (h.step.run_id, &h.step.name, h.step_run_id);
            if h.committing {
                error!(worker = %shared.name, %run_id, step = %step, %step_run_id, "exiting with this step's outcome not recorded: it runs again once its lease expires");
            } else {
                error!(worker = %shared.name, %run_id, step = %step, %step_run_id, "exiting with this step's attempt unfinished: it runs again once its lease expires");
            }
        }
    }
}

/// Set by the process's SIGTERM/SIGINT handler itself ([`note_stop_signal`]).
/// The task that turns the signal into the shutdown token runs later, in
/// whatever order the runtime polls it against a wake-up that arrived in the
/// meantime (a NOTIFY for a step submitted after the signal was sent). The
/// lease loop reads this flag right before every lease, so such a step is not
/// leased in that gap. Process-wide, as a signal is: every worker of the
/// process stops leasing.
static STOP_SIGNALLED: AtomicBool = AtomicBool::new(false);

/// Notes that a stop signal arrived: from then on no worker of this process
/// leases, and its loop goes on to the drain. One atomic store, so it is
/// async-signal-safe: meant to be called from a signal handler.
pub fn note_stop_signal() {
    STOP_SIGNALLED.store(true, Ordering::SeqCst);
}

fn stop_signalled() -> bool {
    STOP_SIGNALLED.load(Ordering::SeqCst)
}

/// Set by a second stop signal: the drain stops running attempts at once
/// and their children get no grace (the cancel frame, then SIGTERM and
/// SIGKILL to the group straight away). Their steps are still given back
/// through the ledger, uncounted (`WORKER_SHUTDOWN`), as at the drain
/// timeout: before, a second signal SIGKILLed every child and exited, and
/// the steps stayed `running` until their leases expired, each counted as a
/// failed attempt (`LEASE_EXPIRED`). Process-wide, as a signal is.
static FORCE: std::sync::OnceLock<tokio::sync::watch::Sender<bool>> = std::sync::OnceLock::new();

fn force_channel() -> &'static tokio::sync::watch::Sender<bool> {
    FORCE.get_or_init(|| tokio::sync::watch::channel(false).0)
}

/// A second stop signal: stop every running attempt now (see [`FORCE`]).
pub fn force_stop() {
    force_channel().send_replace(true);
}

/// Whether a second stop signal asked for children to be stopped without grace.
pub(crate) fn forced() -> bool {
    *force_channel().borrow()
}

/// Resolves once a second stop signal came (at once if one did): a grace
/// already running ends then, not when it would have (audit 83: a cancel's
/// grace armed by the drain timeout ran its whole length after the second
/// signal, and past the forced exit's 10 s the step was left running).
pub(crate) async fn until_forced() {
    let mut rx = force_channel().subscribe();
    // the sender lives in a static: it is never dropped
    let _ = rx.wait_for(|forced| *forced).await;
}

/// One pass of the lease loop: each executor leases up to its free slots
/// and its leased steps' attempts start. True when a lease filled every free
/// slot it asked for (a backlog: lease again right away). A failed lease
/// ends the pass; the loop tries again after the poll interval.
async fn lease_pass(
    shared: &Arc<Shared>,
    executors: &[Arc<ExecutorRuntime>],
    slot_freed: &Arc<Notify>,
    attempts: &mut JoinSet<()>,
    ttl: Duration,
) -> bool {
    let mut leased_any_full = false;
    // first, also while renewals fail: a heartbeat stalled for a lease's
    // length let the steps a cut-off call leased expire, and the reclaim
    // counted them (re-check audit)
    if shared.lease_cut_off.load(Ordering::SeqCst) && !revoke_lost_leases(shared).await {
        return false;
    }
    if shared.renewals_failing.load(Ordering::SeqCst) {
        // woken again by the first renewal that succeeds
        return false;
    }
    if !shared.work_dir_usable() {
        // looked at again at the next poll
        return false;
    }
    for exec in executors {
        if stop_signalled() {
            // the drain is on its way: not one lease more
            return false;
        }
        let free = leasable(
            exec.cfg.concurrency,
            exec.running.load(Ordering::SeqCst),
            exec.held.load(Ordering::SeqCst),
        );
        if free == 0 {
            continue;
        }
        // (`idle_only`: leased for idle processes alone, which the attempts
        // take from the pool after this pass: not leased again at once)
        let Some((routes, free, idle_only)) = routes_to_lease(shared, exec, free).await else {
            continue;
        };
        // beside other executors of this worker, or of another live
        // worker, serving the same kinds, a step goes to one that may hand
        // out its secrets
        let others: Vec<(Vec<Route>, Vec<String>)> = executors
            .iter()
            .filter(|x| !Arc::ptr_eq(x, exec))
            .map(|x| (x.routes(), x.cfg.secrets.clone()))
            .collect();
        let filters = routing::secret_filters(&routes, &exec.cfg.secrets, &others);
        let (steps, sent) = match lease_for(shared, &routes, &filters, free, ttl).await {
            Ok(Some(leased)) => {
                crate::metrics::lease_call(true);
                leased
            }
            Ok(None) => return false,
            Err(e) => {
                lease_failed(shared, &e).await;
                crate::metrics::lease_call(false);
                // unless the server answered with an error (the statement
                // did not run), it may have reached the server all the same,
                // and run there once a stalled server goes on: its steps are
                // given back before anything more is leased
                if !e.answered_by_the_server() {
                    shared.lease_cut_off.store(true, Ordering::SeqCst);
                }
                break;
            }
        };
        crate::metrics::leased(&exec.cfg.name, steps.len());
        if stop_signalled() {
            // the signal was noted while this lease was on its way: its
            // steps may have been submitted after it, and the drain starts
            // no attempt. They go back to the queue at once, uncounted, for
            // another worker (as a drain gives back what it stops)
            give_back(shared, steps).await;
            return false;
        }
        if steps.len() as u32 == free && !idle_only {
            leased_any_full = true;
        }
        for step in steps {
            start_attempt(shared, exec, slot_freed, attempts, step, sent + ttl);
        }
    }
    leased_any_full
}

/// After a lease call that failed (it may still have run, or run later,
/// on the server: its steps would be leased to this worker, which never
/// learned of them, and reclaimed a lease later as counted attempts): moves
/// the worker's lease epoch on, so that no such call leases anything any
/// more, and gives back, uncounted, the steps leased to it that it does not
/// hold ([`Db::revoke_lost_leases`]). Runs in the lease loop, so no lease
/// call of this worker is in flight. False while it cannot (nothing is
/// leased until it could).
async fn revoke_lost_leases(shared: &Arc<Shared>) -> bool {
    let held: Vec<Uuid> = shared
        .leases
        .snapshot()
        .iter()
        .map(Lease::step_run_id)
        .collect();
    let revoke = bounded(
        DB_CALL_TIMEOUT,
        "giving back lost leases",
        shared.db.revoke_lost_leases(shared.id, &shared.name, &held),
    );
    match revoke.await {
        Ok((epoch, given_back)) => {
            shared.lease_epoch.store(epoch, Ordering::SeqCst);
            shared.lease_cut_off.store(false, Ordering::SeqCst);
            if given_back > 0 {
                warn!(given_back, "gave back, uncounted, steps that a lease call cut off before its answer had leased to this worker (LEASE_NOT_RECEIVED)");
            }
            true
        }
        Err(e) => {
            warn!(error = %e, "cannot yet give back what a lease call cut off before its answer may have leased; nothing is leased until it can");
            false
        }
    }
}

/// What an executor may lease with now, and how many of its `free` slots:
/// none while its breaker holds it back, or while its last hello (a
/// probe's, when the breaker asks for one first) offers nothing this worker
/// can lease. While the breaker holds new processes back, a persistent
/// executor's idle processes (each said its hello) still serve a step each
/// (the third value says the count is theirs):
/// an executor of which one process may run at a time (a lock, a device, a
/// fixed port) failed every probe beside its idle process, and its steps
/// waited for ever.
async fn routes_to_lease(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    free: u32,
) -> Option<(Vec<Route>, u32, bool)> {
    let idle_only = || {
        let idle = if exec.cfg.persistent {
            exec.pool.idle() as u32
        } else {
            0
        };
        let routes = exec.routes();
        let some = (idle > 0 && !routes.is_empty()).then(|| (routes, free.min(idle), true));
        if some.is_some() {
            // its steps do not wait for a resume: status must not say so
            // (re-check audit); a start that fails again says it again
            shared.pauses.clear(&exec.cfg.name);
        }
        some
    };
    match exec.lease_now() {
        breaker::Lease::Yes if exec.reprobe_due() => {
            // narrowed routes: does a new process offer more again?
            let base = Duration::from_millis(shared.cfg.refusal_delay_ms);
            match probe_in(&shared.spawner, &exec.cfg, &shared.cfg, Some(&shared.work)).await {
                Ok(hello) => {
                    let routes = routing::routes(&hello, &exec.cfg);
                    if !routes.is_empty() {
                        let (before, after) = (exec.routes().len(), routes.len());
                        exec.set_routes(shared, routes);
                        if after > before {
                            info!(executor = %exec.cfg.name, routes = after, before,
                                  "a probe of the narrowed executor offers more again: leasing for all of it");
                        }
                    }
                    exec.reprobed();
                }
                Err(e) => {
                    exec.reprobed();
                    exec.process_failed(shared, base, &e.to_string());
                    return idle_only();
                }
            }
        }
        breaker::Lease::Yes => {}
        breaker::Lease::NotYet => return idle_only(),
        breaker::Lease::ProbeFirst => {
            if let Some(idle) = idle_only() {
                // no probe: a new process would meet what the last one met,
                // and an idle one is there
                return Some(idle);
            }
            let base = Duration::from_millis(shared.cfg.refusal_delay_ms);
            match exec.probe_for_leasing(shared).await {
                Ok((hello, session)) => {
                    // the probe's hello says what the executor offers now
                    let routes = routing::routes(&hello, &exec.cfg);
                    let none = routes.is_empty();
                    exec.set_routes(shared, routes);
                    if none {
                        // not a start that went well: the pause keeps
                        // doubling while the executor offers nothing
                        if let Some(s) = session {
                            s.retire(&shared.cfg, "its hello offers nothing this worker leases")
                                .await;
                        }
                        exec.offers_nothing(shared, &hello);
                        return None;
                    }
                    info!(executor = %exec.cfg.name, routes = exec.routes().len(), "the executor starts again: leasing for it");
                    exec.process_started(shared);
                    if let Some(s) = session {
                        exec.pool.put(s, &shared.cfg).await;
                    }
                }
                Err(why) => {
                    exec.process_failed(shared, base, &why);
                    return None;
                }
            }
        }
    }
    let routes = exec.routes();
    if routes.is_empty() {
        // nothing to lease with; probed again after a pause (backing off)
        exec.hello_changed(
            shared,
            "its last probe offers nothing this worker can lease",
        );
        return None;
    }
    Some((routes, free, false))
}

/// Logs a failed lease call with why, as far as the worker can tell.
async fn lease_failed(shared: &Shared, e: &DbError) {
    let why = match e {
        // sent, and no answer: not the pool's doing (re-check audit 105: a
        // LOCK TABLE read "the pool's connections are all in use")
        DbError::Timeout {
            context: LEASE_STATEMENT,
            ..
        } => "the statement waits on the server: most likely for a lock (a LOCK TABLE, or a long transaction a lock waits behind: see pg_stat_activity and pg_blocking_pids), or the server is overloaded; what it leases late is given back uncounted".into(),
        // the server's own word on why, where it refuses connections (the
        // pool's error says "timed out")
        e if e.is_pool_timeout() || e.is_timeout() => shared
            .db
            .connect_error(Duration::from_secs(1))
            .await
            .unwrap_or_else(|| "a new connection opens: the pool's connections are all in use".into()),
        _ => {
            error!(error = %e, "lease failed; retrying after the poll interval");
            return;
        }
    };
    error!(error = %e, why = %why, "lease failed; retrying after the poll interval");
}

/// One lease call of at most `free` steps over `routes`, with the time it
/// was sent (the start of its steps' lease clocks); `None` when the stop
/// signal came first.
async fn lease_for(
    shared: &Arc<Shared>,
    routes: &[Route],
    filters: &[Option<crate::db::SecretFilter>],
    free: u32,
    ttl: Duration,
) -> Result<Option<(Vec<crate::db::LeasedStep>, Instant)>, DbError> {
    match lease_once(shared, routes, filters, free, ttl).await {
        // the server ended the connection before the statement ran (a
        // restart, pg_terminate_backend: it said so, so nothing was
        // leased): once more on a new one, not a poll interval later with
        // an error logged (audit 99)
        Err(e) if e.answered_by_the_server() && e.connection_ended() => {
            debug!(error = %e, "lease call on an ended connection: once more on a new one");
            lease_once(shared, routes, filters, free, ttl).await
        }
        other => other,
    }
}

async fn lease_once(
    shared: &Arc<Shared>,
    routes: &[Route],
    filters: &[Option<crate::db::SecretFilter>],
    free: u32,
    ttl: Duration,
) -> Result<Option<(Vec<crate::db::LeasedStep>, Instant)>, DbError> {
    bounded(DB_CALL_TIMEOUT, "leasing steps", async {
        let mut conn = shared.db.connection("leasing steps").await?;
        // the flag again once the connection is here (acquiring it is a
        // round trip of its own): a step submitted after the signal was
        // noted must not be leased by a lease decided before it
        if stop_signalled() {
            return Ok(None);
        }
        crate::fault::maybe_delay_lease(&shared.name).await;
        // the lease clock starts at the send time: the database's expiry
        // (its now() + TTL) is never earlier than this + TTL
        let sent = Instant::now();
        let except = shared.left_to_others();
        // the statement, once sent, within the lease call's own bound (the
        // wait for a connection above is no part of any lease clock)
        let steps = bounded(
            shared.lease_call_bound(),
            LEASE_STATEMENT,
            conn.conn().lease_routed(
                shared.id,
                &shared.name,
                routes,
                filters,
                free,
                ttl,
                &except,
                Some(shared.lease_epoch.load(Ordering::SeqCst)),
            ),
        )
        .await?;
        if crate::fault::lease_answer_lost(&shared.name, steps.len()) {
            return Err(DbError::Timeout {
                context: "leasing steps",
                ms: shared.lease_call_bound().as_millis() as u64,
            });
        }
        Ok(Some((steps, sent)))
    })
    .await
}

/// Gives back steps leased as the stop signal arrived, before any attempt
/// of theirs started: released at once and uncounted, through the ledger as
/// every step write of the worker (the releases of one lease share a
/// flush). One that cannot be given back now is reclaimed when its lease
/// expires.
async fn give_back(shared: &Arc<Shared>, steps: Vec<crate::db::LeasedStep>) {
    let releases = steps.into_iter().map(|step| async move {
        let id = step.lease.step_run_id();
        let w = crate::db::ReleaseWrite {
            lease: step.lease,
            message: "leased as the worker got its stop signal; given back before it started"
                .to_owned(),
        };
        if let Err(e) = shared.ledger.release(w).await {
            warn!(error = %e, step_run_id = %id, "cannot give back a step leased as the worker stopped; it is reclaimed when its lease expires");
        }
    });
    futures::future::join_all(releases).await;
}

/// The drain: nothing more is leased; running attempts get
/// `drain_timeout_ms` to finish, then they are stopped. A vital loop that
/// dies meanwhile is noted in `died`.
async fn drain(
    shared: &Arc<Shared>,
    attempts: &mut JoinSet<()>,
    vital: &mut JoinSet<&'static str>,
    died: &mut Option<&'static str>,
) {
    shared.draining.cancel();
    crate::metrics::worker_draining();
    let drain_ms = shared.cfg.drain_timeout_ms;
    info!(
        running = attempts.len(),
        drain_timeout_ms = drain_ms,
        "draining"
    );
    let drain_until = Instant::now() + Duration::from_millis(drain_ms);
    let mut force = force_channel().subscribe();
    loop {
        tokio::select! {
            _ = force.wait_for(|forced| *forced), if !shared.abort.is_cancelled() => {
                warn!(
                    running = attempts.len(),
                    "second stop signal: stopping running attempts now"
                );
                shared.abort.cancel();
            }
            next = attempts.join_next() => match next {
                None => break,
                Some(Err(e)) => error!(error = %e, "an attempt task panicked"),
                Some(Ok(())) => {}
            },
            _ = tokio::time::sleep_until(drain_until), if !shared.abort.is_cancelled() => {
                // an attempt whose outcome is decided only waits for its write
                let recording = shared.leases.attempts().iter().filter(|h| h.committing).count();
                let running = attempts.len().saturating_sub(recording);
                warn!(running, recording, "drain timeout: stopping running attempts; those recording their outcome go on");
                shared.abort.cancel();
            }
            Some(res) = vital.join_next(), if died.is_none() => {
                *died = Some(vital_loop_died(res, shared));
            }
        }
    }
}

/// Starts the attempt of a step just leased for `exec`, whose lease is
/// certainly valid until `valid_until`: the lease joins the renewal set, the
/// attempt takes one of the executor's slots, and its task gives both back
/// whatever happens to it (a panic included).
fn start_attempt(
    shared: &Arc<Shared>,
    exec: &Arc<ExecutorRuntime>,
    slot_freed: &Arc<Notify>,
    attempts: &mut JoinSet<()>,
    step: crate::db::LeasedStep,
    valid_until: Instant,
) {
    let name = leases::StepName {
        run_id: step.run_id,
        name: step.name.clone(),
    };
    let rx = shared.leases.insert(step.lease.clone(), name, valid_until);
    exec.running.fetch_add(1, Ordering::SeqCst);
    exec.held.fetch_add(1, Ordering::SeqCst);
    let span = info_span!("attempt", run_id = %step.run_id, step = %step.name,
        step_run_id = %step.lease.step_run_id(), attempt = step.lease.attempt(), kind = %step.kind);
    let guard = LeaseGuard {
        shared: shared.clone(),
        exec: exec.clone(),
        lease: step.lease.clone(),
        freed: slot_freed.clone(),
    };
    let slot = ExecSlot {
        exec: exec.clone(),
        freed: slot_freed.clone(),
    };
    let (shared, exec) = (shared.clone(), exec.clone());
    let slow_release = crate::fault::release_delay(&step.kind, step.lease.attempt());
    attempts.spawn(
        async move {
            // the guards give the slot and the lease back even if the
            // attempt panics
            let _guard = guard;
            let res = std::panic::AssertUnwindSafe(attempt::run(shared, exec, step, rx, slot))
                .catch_unwind()
                .await;
            if res.is_err() {
                error!("the attempt task panicked; its lease is dropped and the step will be reclaimed");
            }
            if let Some(delay) = slow_release {
                tokio::time::sleep(delay).await;
            }
        }
        .instrument(span),
    );
}

/// How long one renewal may take. A renewal counts from its send time, so a
/// slow one that succeeds is still worth having: cutting it at one interval
/// (as first built) threw valid renewals away on a loaded host and let lease
/// clocks run out. Half the TTL still leaves the lease clock to stop children
/// in time when the database is really gone.
fn heartbeat_timeout(cfg: &WorkerConfig) -> Duration {
    Duration::from_millis(cfg.heartbeat_interval_ms.max(cfg.lease_ttl_ms / 2))
}

/// A vital loop (heartbeat, reclaim) ended before it was told to: log it and
/// stop every attempt (no child may run on without renewed leases).
fn vital_loop_died(
    res: Result<&'static str, tokio::task::JoinError>,
    shared: &Shared,
) -> &'static str {
    let name = match res {
        Ok(name) => name,
        Err(e) => {
            error!(error = %e, "a vital worker loop panicked");
            "heartbeat, reclaim or ledger"
        }
    };
    error!(
        loop_name = name,
        "a vital worker loop stopped: stopping every attempt"
    );
    crate::metrics::vital_loop_died(name);
    shared.abort.cancel();
    name
}

/// The role's grants: a worker without one of them ran, leased, and had
/// every outcome refused, its steps leased for good.
async fn check_privileges(db: &Db) -> Result<(), WorkerError> {
    let missing = db.missing_worker_privileges().await?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(WorkerError::Setup(format!(
        "the database role lacks what a worker needs: {}. Grant it (as the schema's owner): GRANT USAGE ON SCHEMA durable TO <role>; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA durable TO <role>; GRANT USAGE ON ALL SEQUENCES IN SCHEMA durable TO <role> (and ALTER DEFAULT PRIVILEGES so later migrations' tables are granted too); a worker only reads the owner's tables: REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON durable._sqlx_migrations, durable.step_transition_rules, durable.run_transition_rules FROM <role>",
        missing.join(", ")
    )))
}

/// An executor's `kinds` list against what its probe's hello offers: none of
/// them is a config error (the worker ran, leasing nothing for it); some of
/// them are named in a warning.
pub(crate) fn check_kinds(
    ecfg: &ExecutorConfig,
    hello: &wire::Hello,
    routes: &[crate::db::Route],
) -> Result<(), WorkerError> {
    let Some(only) = &ecfg.kinds else {
        return Ok(());
    };
    if routes.is_empty() && !hello.kinds.is_empty() {
        return Err(WorkerError::Setup(format!(
            "executor {:?}: kinds = {only:?} matches none of the kinds it offers ({:?}): fix the kinds list (or remove it to lease every kind the executor offers)",
            ecfg.name, hello.kinds
        )));
    }
    let unknown: Vec<&String> = only.iter().filter(|k| !hello.kinds.contains(k)).collect();
    if !unknown.is_empty() {
        warn!(executor = %ecfg.name, unknown = ?unknown, offered = ?hello.kinds,
              "the config's kinds names kinds this executor does not offer: no step of those kinds is leased by it");
    }
    Ok(())
}

/// Checks at start what would otherwise surface as the steps' failures:
/// the stop budget fits in the lease, the pool is not smaller than what the
/// concurrency needs (the work directory's check is taking this worker's lock
/// there, [`open_work_dir`]).
fn check_setup(db: &Db, cfg: &WorkerConfig) -> Result<(), WorkerError> {
    cfg.check_stop_budget().map_err(WorkerError::Setup)?;
    let conns = db.pool().options().get_max_connections();
    if conns < 2 {
        return Err(WorkerError::Setup(format!(
            "the database pool has {conns} connection(s); a worker needs at least 2 (lease and reclaim, writes). Raise db_max_connections"
        )));
    }
    if conns < cfg.min_db_connections() {
        warn!(
            pool = conns,
            concurrency = cfg.total_concurrency(),
            "the database pool is smaller than the executors' total concurrency + 1: attempts will queue for connections"
        );
    }
    Ok(())
}

/// Takes this worker's lock in `work_dir` (which also shows the directory is
/// writable) and removes what dead workers left there (worker/workdir.rs).
async fn open_work_dir(cfg: &WorkerConfig, id: Uuid) -> Result<Arc<workdir::WorkDir>, WorkerError> {
    let base = cfg.work_base();
    let work = workdir::WorkDir::open(base.clone(), id)
        .and_then(|w| w.probe().map(|()| w))
        .map_err(|e| {
        let what = format!(
            "work_dir {} is not writable ({e}): attempts could not create their directories",
            base.display()
        );
        // a full filesystem is the host's state, not the config's: a
        // runtime error (1), with the fix that fits (resource audit: "fix
        // its permissions", exit 2, for a disk without free inodes)
        match e.raw_os_error() {
            Some(nix::libc::ENOSPC) | Some(nix::libc::EDQUOT) => WorkerError::Host(format!(
                "{what}. Free space (or inodes) on its filesystem, or set work_dir elsewhere"
            )),
            Some(nix::libc::EMFILE) | Some(nix::libc::ENFILE) => WorkerError::Host(format!(
                "{what}. The worker is out of file descriptors: raise its open-file limit (`ulimit -n`, systemd's LimitNOFILE=)"
            )),
            Some(nix::libc::EROFS) => WorkerError::Setup(format!(
                "{what}. Its filesystem is read-only: set work_dir to a writable directory"
            )),
            _ => WorkerError::Setup(format!("{what}. Fix its permissions or set work_dir")),
        }
    })?;
    let work = Arc::new(work);
    let w = work.clone();
    match tokio::task::spawn_blocking(move || w.sweep()).await {
        Ok(s) if s.workers > 0 => {
            info!(work_dir = %base.display(), workers = s.workers, removed = s.entries, "removed what dead workers left in work_dir")
        }
        Ok(_) => {}
        Err(e) => warn!(error = %e, "the sweep of work_dir failed"),
    }
    Ok(work)
}

/// One batched statement per interval renews every lease this worker holds
/// and learns of cancel requests and lost leases. The lease clock of a lease
/// advances only when a renewal succeeds (to its send time + TTL); an
/// attempt stops its child before that clock runs out, so a blackholed
/// network never lets two workers run the same step at once.
async fn heartbeat_loop(shared: Arc<Shared>, now: Arc<Notify>, stop: CancellationToken) {
    let interval = Duration::from_millis(shared.cfg.heartbeat_interval_ms);
    let ttl = Duration::from_millis(shared.cfg.lease_ttl_ms);
    // a fixed schedule from each send time: a slow renewal does not add its
    // own duration to the gap between renewals (the lease clock's slack)
    let mut next = Instant::now() + interval;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
            _ = now.notified() => {}
        }
        crate::fault::maybe_kill_heartbeat(&shared.name);
        let leases: Vec<Lease> = shared.leases.snapshot();
        let sent = Instant::now();
        next = sent + interval;
        // locks are waited for within four fifths of the call's bound: a
        // lock then ends it with the server's word, not a silence (audit 96)
        let bound = heartbeat_timeout(&shared.cfg);
        let renew = || {
            bounded(
                bound,
                "renewing leases",
                shared
                    .hb_db
                    .heartbeat_within(shared.id, &leases, ttl, Some(bound * 4 / 5)),
            )
        };
        // at the stop every attempt has ended (and left the renewal set):
        // a renewal still in flight is not waited for
        let Some(mut res) = unless_stopped(&stop, renew()).await else {
            return;
        };
        if let Err(e) = &res {
            // the heartbeat's connection was ended (a restarted server,
            // pg_terminate_backend): the pool drops it, and a renewal on a
            // new one at once spares the worker an interval of leasing
            // nothing (audit 96: 2–3.5 s of failing renewals after each).
            // A renewal is idempotent, so one that may have run is no harm
            if e.connection_ended() {
                debug!(error = %e, "renewal failed on a broken connection: trying once more on a new one");
                let Some(again) = unless_stopped(&stop, renew()).await else {
                    return;
                };
                res = again;
            }
        }
        let res = match res {
            Ok(_) if crate::fault::renewals_fail(&shared.name) => Err(DbError::Timeout {
                context: "renewing leases (fault injection)",
                ms: 0,
            }),
            other => other,
        };
        match res {
            Ok(report) => {
                crate::metrics::heartbeat_renewed(sent.elapsed());
                if shared.renewals_failing.swap(false, Ordering::SeqCst) {
                    info!("leases are renewed again: leasing resumes");
                    shared.wake.notify_one();
                }
                let applied = shared.leases.apply(&leases, &report, sent, ttl);
                crate::metrics::heartbeat_lost_leases(applied.lost.len());
                for id in &applied.lost {
                    warn!(step_run_id = %id, "lease lost: another worker or the reclaimer moved the step on; its executor is stopped and its outcome will not be committed");
                }
                debug!(
                    renewed = applied.renewed,
                    ended_while_committing = applied.ended.len(),
                    cancels_delivered = applied.cancelled,
                    busy = report.busy.len(),
                    held_by_writes = applied.held,
                    "heartbeat"
                );
            }
            Err(e) => renewal_failed(&shared, &e, leases.len()).await,
        }
    }
}

/// A renewal that failed: the lease clocks stand still (each attempt stops
/// its child before its own clock runs out), and leasing pauses until one
/// succeeds. Logged with the server's reason where it gives one.
async fn renewal_failed(shared: &Shared, e: &DbError, leases: usize) {
    crate::metrics::heartbeat_failed();
    // a pool that timed out says nothing of why: the server's
    // reason, from one connection attempt of its own
    let why = shared.hb_db.server_reason(e, Duration::from_secs(2)).await;
    let locked = e.sqlstate().as_deref() == Some("55P03");
    match why {
        Some(why) => {
            error!(error = %e, server_says = %why, leases, "heartbeat failed: no connection could be opened")
        }
        None if locked => {
            error!(error = %e, leases, "heartbeat failed: it waited for a lock another session holds (a LOCK TABLE, or a long transaction a lock waits behind: see pg_stat_activity and pg_blocking_pids)")
        }
        None => error!(error = %e, leases, "heartbeat failed"),
    }
    if !shared.renewals_failing.swap(true, Ordering::SeqCst) {
        if locked {
            error!("no step is leased until a renewal succeeds: a step leased now would lose its lease (the renewals wait for a lock: end the session that holds it)");
        } else {
            error!("no step is leased until a renewal succeeds: a step leased now would lose its lease (is the database reachable from this host, with a connection free for the heartbeat? db_max_connections + 3 per worker (+ 1 with metrics_addr) must fit in max_connections)");
        }
    }
}

/// The worker's row says it stopped. A database that did not answer the
/// drain's writes will most likely not answer this one either: the exit is
/// not held up by a full DB_CALL_TIMEOUT for a row no lease depends on.
async fn mark_stopped(shared: &Shared) {
    if let Err(e) = bounded(
        STOPPED_MARK_TIMEOUT,
        "marking the worker stopped",
        shared.db.worker_stopped(shared.id),
    )
    .await
    {
        warn!(error = %e, "cannot mark the worker stopped");
    }
}

/// A lease pass that a stop signal does not wait on for long: once `stop` is
/// cancelled the pass in flight gets [`LEASE_GRACE_AT_STOP`] to land (its
/// steps then run and drain as usual); a database that does not answer does
/// not hold up the drain. True when the pass leased a full batch somewhere.
async fn unless_stopped_for_long(
    stop: &CancellationToken,
    pass: impl Future<Output = bool>,
) -> bool {
    tokio::pin!(pass);
    tokio::select! {
        full = &mut pass => full,
        _ = stop.cancelled() => match tokio::time::timeout(LEASE_GRACE_AT_STOP, &mut pass).await {
            Ok(full) => full,
            Err(_) => {
                warn!(grace_ms = LEASE_GRACE_AT_STOP.as_millis() as u64,
                      "a lease in flight did not return after the stop signal; the drain starts without it (steps it leased come back when their leases expire)");
                false
            }
        },
    }
}

/// Keeps `unrecorded` as it was when the stop signal arrived, for the
/// drain's verdict: an outcome given up on between the signal and the
/// drain's start belongs to this stop too. Ends with the loops.
async fn note_unrecorded_at_stop(
    shared: Arc<Shared>,
    stop: CancellationToken,
    loops_stop: CancellationToken,
) {
    tokio::select! {
        _ = stop.cancelled() => {
            let n = shared.unrecorded.load(Ordering::Relaxed);
            shared.unrecorded_at_stop.store(n, Ordering::Relaxed);
        }
        _ = loops_stop.cancelled() => {}
    }
}

/// `f`'s output, or None once `stop` is cancelled (`f` is then dropped).
async fn unless_stopped<T>(stop: &CancellationToken, f: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        _ = stop.cancelled() => None,
        out = f => Some(out),
    }
}

async fn reclaim_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let interval = Duration::from_millis(shared.cfg.reclaim_interval_ms);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        // at the stop, a pass in flight is dropped: the next worker's does
        // the same, and a database that does not answer does not hold up
        // this one's exit
        let reclaim = bounded(
            DB_CALL_TIMEOUT,
            "reclaiming expired leases",
            shared.db.reclaim_expired_due(&shared.name, 100),
        );
        let Some(res) = unless_stopped(&stop, reclaim).await else {
            return;
        };
        match res {
            Ok(r) if r.count == 0 => {}
            Ok(r) => {
                crate::metrics::reclaimed(r.count);
                info!(reclaimed = r.count, "reclaimed expired leases");
                // their retries come due with no worker waiting for them
                // (theirs is gone): announced then, not left to the polls
                for (kind, at) in &r.due {
                    shared.due_at(kind, *at);
                }
            }
            Err(e) => {
                let why = shared.db.server_reason(&e, Duration::from_secs(1)).await;
                error!(error = %e, server_says = why.as_deref(), "reclaim failed")
            }
        }
        let overdue = bounded(
            DB_CALL_TIMEOUT,
            "failing overdue steps",
            shared.db.fail_overdue(shared.id, &shared.name, 100),
        );
        let Some(res) = unless_stopped(&stop, overdue).await else {
            return;
        };
        match res {
            Ok(0) => {}
            Ok(n) => info!(
                failed = n,
                "failed steps whose deadline passed before any attempt"
            ),
            Err(e) => {
                let why = shared.db.server_reason(&e, Duration::from_secs(1)).await;
                error!(error = %e, server_says = why.as_deref(), "failing overdue steps failed")
            }
        }
    }
}

/// Retention without an operator: every `retention_interval_ms` (plus up to
/// 10% jitter, so workers started together spread out) a pass removes the
/// finished runs older than `retention`. On a connection of its own (opened
/// lazily), so a pass never takes one the attempts need. Not vital: a failed
/// pass is logged and tried again next interval. Concurrent passes of several
/// workers are harmless (one batch at a time, in the database).
fn spawn_retention_loop(
    background: &mut JoinSet<()>,
    shared: &Arc<Shared>,
    stop: &CancellationToken,
) {
    let cfg = &shared.cfg;
    // validated at load; a config built in code with a bad value keeps its runs
    let older_than = match cfg.retention_age() {
        Ok(Some(age)) => age,
        Ok(None) => return,
        Err(e) => {
            warn!(error = %e, "retention is off");
            return;
        }
    };
    let opts = crate::db::RetentionOptions {
        older_than,
        batch_runs: cfg.retention_batch_runs,
        batch_steps: cfg.retention_batch_steps,
        vacuum: cfg.retention_vacuum,
    };
    let interval = Duration::from_millis(cfg.retention_interval_ms.max(1));
    let db = shared.db.dedicated(RETENTION_STATEMENT_TIMEOUT);
    let artifact_dir = cfg.artifact_dir.clone();
    let stop = stop.clone();
    background.spawn(async move {
        loop {
            let jitter = interval.mul_f64(rand::random::<f64>() * 0.1);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval + jitter) => {}
            }
            let res = tokio::select! {
                _ = stop.cancelled() => return,
                r = db.retention_pass(&opts, &stop) => r,
            };
            if let Some(dir) = &artifact_dir {
                // files of removed directory-store blobs (the database queued them)
                match crate::artifacts::remove_deleted_files(&db, dir).await {
                    Ok(0) => {}
                    Ok(n) => info!(files = n, "retention deleted the files of removed artifact blobs"),
                    Err(e) => warn!(error = %e, "cannot delete removed artifact files; trying again next interval"),
                }
            }
            match res {
                Ok(r) if r.removed_anything() => info!(
                    runs = r.runs,
                    steps = r.steps,
                    artifacts = r.artifacts,
                    blobs = r.blobs,
                    workers = r.workers,
                    batches = r.batches,
                    longest_batch_ms = r.longest_batch.as_millis() as u64,
                    vacuum_ms = r.vacuum_time.as_millis() as u64,
                    "retention removed old finished runs"
                ),
                Ok(_) => debug!("retention: nothing old enough"),
                Err(e) => warn!(error = %e, "retention pass failed; trying again next interval"),
            }
        }
    }.in_current_span());
}

/// The retention connection's statement timeout (a batch is far shorter;
/// VACUUM lifts it for itself).
const RETENTION_STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);

/// LISTEN/NOTIFY is only a wake-up hint; polling and the heartbeat remain the
/// paths that always work, so a lost notification costs latency, never a cancel.
async fn listen_loop(shared: Arc<Shared>, heartbeat_now: Arc<Notify>, stop: CancellationToken) {
    // LISTEN holds its connection for as long as it listens: one of its
    // own, as the heartbeat's, not one of the pool's (which the config sizes
    // for the attempts, the lease and the ledger)
    let listen_db = shared.db.dedicated(DB_CALL_TIMEOUT);
    if let Some(delay) = crate::fault::listen_delay(&shared.name) {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
    let mut backoff = Duration::from_millis(200);
    let mut reconnecting = false;
    loop {
        let mut listener = match listen_db.listener().await {
            Ok(l) => l,
            Err(e) => {
                let why = listen_db.server_reason(&e, Duration::from_secs(1)).await;
                warn!(error = %e, server_says = why.as_deref(), "LISTEN unavailable; polling only");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        // a step that became leasable before LISTEN took effect (the worker
        // was starting, or the connection was being replaced) sent its
        // NOTIFY to nobody: one lease pass now finds it, instead of the poll;
        // after a loss, one renewal too, for the cancels missed likewise
        shared.wake.notify_one();
        if reconnecting {
            heartbeat_now.notify_one();
            info!("LISTEN is back: one lease pass and one renewal for what was notified meanwhile");
        }
        reconnecting = true;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                // try_recv, not recv: recv reconnects on its own and says
                // nothing, and the NOTIFYs sent meanwhile were missed without
                // a word or a lease pass (outside audit: a lost LISTEN was
                // silent); a new listener (above) makes up for them
                n = listener.try_recv() => match n {
                    Ok(Some(n)) if n.channel() == crate::db::CHANNEL_CANCEL => heartbeat_now.notify_one(),
                    Ok(Some(_)) => shared.wake.notify_one(),
                    Ok(None) => {
                        warn!("LISTEN connection lost (closed by the server or the network); reconnecting");
                        break;
                    }
                    Err(e) => {
                        let e = DbError::Query { context: "listening for wake-ups", source: e };
                        let why = listen_db.server_reason(&e, Duration::from_secs(1)).await;
                        warn!(error = %e, server_says = why.as_deref(), "LISTEN connection lost; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into())
}

#[cfg(test)]
mod tests {
    use super::{leasable, lease_call_bound, probe_advice, usable_hello, DB_CALL_TIMEOUT};
    use std::time::Duration;

    /// A lease call gets half of what a lease clock has beyond the stop
    /// budget (so a lease that arrives still has more than the budget plus
    /// half the room for its first renewal), never more than a database
    /// call's bound, never less than 100 ms.
    #[test]
    fn a_lease_call_leaves_its_steps_more_than_the_stop_budget() {
        let ms = Duration::from_millis;
        for (ttl, budget, bound) in [
            (10_000, 4_500, 2_750),
            (10_000, 1_500, 4_250),
            (30_000, 10_000, 10_000),
            (300_000, 20_000, DB_CALL_TIMEOUT.as_millis() as u64),
            (1_000, 990, 100),
        ] {
            let got = lease_call_bound(ms(ttl), ms(budget));
            assert_eq!(got, ms(bound), "ttl {ttl} budget {budget}");
            if ttl - budget >= 200 {
                assert!(ms(ttl) - got > ms(budget), "ttl {ttl} budget {budget}");
            }
        }
    }

    /// A probe that failed on a host limit is answered with that limit's
    /// fix, not "check its command" (resource audit).
    #[test]
    fn a_failed_probe_is_answered_by_its_cause() {
        let table = [
            (
                "failed to spawn: Too many open files (os error 24)",
                "open-file limit",
            ),
            (
                "exited with code 2; stderr: runtime: failed to create new OS thread",
                "process limit",
            ),
            (
                "failed to spawn: Resource temporarily unavailable (os error 11)",
                "process limit",
            ),
            (
                "cannot create a directory: No space left on device (os error 28)",
                "free space",
            ),
            (
                "the executor exited or closed stdout before its hello",
                "its stderr",
            ),
            (
                "the executor's first frame was a job, not a hello",
                "Check its command",
            ),
            // text before the hello, then an exit 0 once stdin closed: no
            // crash (re-check audit: it read "a crash at start")
            (
                "no hello within 3000 ms (83 bytes of an incomplete frame arrived); did the executor print something to stdout before its hello? stdout carries frames only (logs go to stderr); then it exited with code 0",
                "write banners and logs to stderr",
            ),
        ];
        for (why, fix) in table {
            assert!(
                probe_advice(why).contains(fix),
                "{why}: {}",
                probe_advice(why)
            );
        }
    }
    use crate::wire::Hello;

    /// A hello's frame limit: 0 (the default) or at least 64 KiB.
    #[test]
    fn a_hello_must_announce_a_frame_limit_a_job_fits_in() {
        for (announced, usable) in [
            (0, true),
            (10, false),
            (65_535, false),
            (65_536, true),
            (8 << 20, true),
        ] {
            let h = Hello {
                max_frame_bytes: announced,
                ..crate::worker::routing::tests::hello("go", &["k"], &[])
            };
            let got = usable_hello(h, 8 << 20);
            assert_eq!(got.is_ok(), usable, "{announced}: {got:?}");
            if let Err(why) = got {
                assert!(why.contains("at least 65536"), "{why}");
            }
        }
    }

    #[test]
    fn a_hello_must_name_its_executor_kind() {
        for ek in ["", "  "] {
            let h = crate::worker::routing::tests::hello(ek, &["k"], &[]);
            let why = usable_hello(h, 8 << 20).expect_err("an empty executor_kind");
            assert!(why.contains("empty or blank executor_kind"), "{why}");
        }
        let h = crate::worker::routing::tests::hello("go", &["k"], &[]);
        assert!(usable_hello(h, 8 << 20).is_ok());
    }

    /// (concurrency, running, held) → how many steps may be leased now.
    #[test]
    fn an_executor_leases_for_free_slots_while_its_commits_stay_bounded() {
        let rows = [
            (4, 0, 0, 4, "idle: every slot"),
            (4, 3, 3, 1, "three running: one slot"),
            (4, 4, 4, 0, "all running: none"),
            (
                4,
                0,
                4,
                4,
                "four committing, none running: every slot again",
            ),
            (4, 1, 6, 2, "five committing, one running: two more leases"),
            (
                4,
                0,
                8,
                0,
                "eight leases held (a slow database): none until a commit resolves",
            ),
            (4, 5, 9, 0, "more than the bounds (never happens): none"),
            (
                1,
                0,
                1,
                1,
                "concurrency 1: the next job while the last commits",
            ),
            (0, 0, 0, 0, "no concurrency: nothing"),
        ];
        for (c, running, held, want, what) in rows {
            assert_eq!(leasable(c, running, held), want, "{what}");
        }
    }
}
