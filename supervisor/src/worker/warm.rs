//! Warm pools: a persistent executor with `warm_processes = N` keeps N of its
//! processes started and handshaken ahead of jobs, so that no job waits for a
//! process start (an interpreter's import time, a JVM's warm-up) while fewer
//! than N are busy — the first jobs after the worker starts included.
//!
//! One keeper task per such executor owns the top-up: whenever the idle
//! sessions plus the slots in use fall below N (a slot whose process serves
//! its last job, `max_jobs_per_process`, is not counted: its replacement is
//! started while it runs) (at start; after a process was
//! retired at `max_jobs_per_process`, killed after a violation, or found dead
//! while idle), it starts one more, reads its hello, and puts it in the pool.
//! It never starts more than that: an attempt that finds the pool empty
//! waits for a start of the keeper's in flight (one attempt per start:
//! [`WarmStarts`]), else starts its own process, as without a warm pool, and
//! the pool never keeps
//! more idle sessions than the executor's concurrency. A process that cannot
//! be started (or says no usable hello) is logged, and the keeper tries again
//! after a back-off that doubles up to [`MAX_BACKOFF`]; jobs are unaffected
//! (they start their own process and fail or refuse as they would anyway).
//! When the worker starts draining, the keeper stops; a process it was
//! starting is stopped, the idle ones are retired with the rest of the pool.
//!
//! A second task per persistent executor with `idle_timeout_ms > 0` retires
//! the processes idle that long beyond the `warm_processes` kept warm. A
//! third, per persistent executor, looks at the idle processes every
//! [`IDLE_CHECK`]: one that ended (or wrote, or was stopped by a signal)
//! between jobs is reaped and taken out of the pool, and the keeper replaces
//! it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info_span, warn, Instrument};

use super::session::Session;
use super::{ExecutorRuntime, Shared};
use crate::wire;

/// The first wait after a failed start; doubled after each further failure.
const MIN_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait between two failed starts.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the idle processes of a persistent executor are looked at.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Starts one keeper per executor with `warm_processes > 0`. They end when
/// `stop` is cancelled; join them before the pools are drained.
pub(crate) fn start(
    shared: &Arc<Shared>,
    executors: &[Arc<ExecutorRuntime>],
    stop: &CancellationToken,
) -> JoinSet<()> {
    let mut keepers = JoinSet::new();
    for exec in executors
        .iter()
        .filter(|e| e.cfg.persistent && e.cfg.warm_processes > 0)
    {
        let span = info_span!("warm_pool", executor = %exec.cfg.name);
        keepers.spawn(keep_warm(shared.clone(), exec.clone(), stop.clone()).instrument(span));
    }
    for exec in executors.iter().filter(|e| e.cfg.persistent) {
        let span = info_span!("idle_health", executor = %exec.cfg.name);
        keepers.spawn(reap_dead_idle(shared.clone(), exec.clone(), stop.clone()).instrument(span));
    }
    for exec in executors
        .iter()
        .filter(|e| e.cfg.persistent && e.cfg.idle_timeout_ms > 0)
    {
        let span = info_span!("idle_pool", executor = %exec.cfg.name);
        keepers.spawn(retire_idle(shared.clone(), exec.clone(), stop.clone()).instrument(span));
    }
    keepers
}

/// Takes the idle processes that ended (or wrote, or were stopped) between
/// jobs out of the pool, ends and reaps each apart ([`end_each_apart`]), and
/// wakes the keeper to replace each once it is gone.
async fn reap_dead_idle(shared: Arc<Shared>, exec: Arc<ExecutorRuntime>, stop: CancellationToken) {
    let taken_from = exec.clone();
    end_each_apart(
        &stop,
        IDLE_CHECK,
        move || taken_from.pool.take_unhealthy(),
        move |s| end_unhealthy(shared.clone(), exec.clone(), s),
    )
    .await;
}

/// Every `every` until `stop`, ends each session `take` hands out in a task
/// of its own (`end`), and waits for the ends still running at `stop`. One
/// after another, each process that ignored its Shutdown or SIGTERM held the
/// next one's end by its graces, and the next look waited for them all
/// (stop audit: 2 s apart; outside audit: six idle processes retired so
/// took a worker with nothing running 24 s to stop).
async fn end_each_apart<Fut>(
    stop: &CancellationToken,
    every: Duration,
    mut take: impl FnMut() -> Vec<Session>,
    end: impl Fn(Session) -> Fut,
) where
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut ending = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
            Some(_) = ending.join_next(), if !ending.is_empty() => continue,
        }
        for s in take() {
            ending.spawn(end(s).in_current_span());
        }
    }
    while ending.join_next().await.is_some() {}
}

/// Ends an idle process found unhealthy, then wakes the keeper.
async fn end_unhealthy(shared: Arc<Shared>, exec: Arc<ExecutorRuntime>, mut s: Session) {
    // one that wrote between jobs, or was stopped by a signal, was named as
    // it was found (and is ended here); only one that ended on its own is
    // news: the stop's own SIGTERM read as a second, different reason (audit)
    let ended_on_its_own = s.child.has_exited();
    let status = super::attempt::stop_child(&mut s.child, &shared.cfg)
        .await
        .map(|r| r.status.to_string())
        .unwrap_or_else(|| "unknown status".into());
    if ended_on_its_own {
        warn!(pid = s.child.pid, jobs = s.jobs, %status, "an idle executor process ended between jobs; it is replaced");
    } else {
        debug!(pid = s.child.pid, jobs = s.jobs, %status, "the unhealthy idle executor process is ended");
    }
    exec.slot_back.notify_one();
}

/// Retires the processes idle for `idle_timeout_ms` beyond the
/// `warm_processes` kept warm: after a burst the pool shrinks back instead
/// of keeping `concurrency` processes (and their memory) for ever.
async fn retire_idle(shared: Arc<Shared>, exec: Arc<ExecutorRuntime>, stop: CancellationToken) {
    let idle_for = Duration::from_millis(exec.cfg.idle_timeout_ms);
    let every = (idle_for / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let keep = exec.cfg.warm_processes as usize;
    end_each_apart(
        &stop,
        every,
        move || exec.pool.expired(keep, idle_for),
        move |s| {
            debug!(pid = s.child.pid, "retiring an idle executor process");
            let shared = shared.clone();
            async move { s.retire(&shared.cfg, "idle for idle_timeout_ms").await }
        },
    )
    .await;
}

/// The keeper's starts in flight, and the jobs waiting for them. A job
/// that finds the pool empty while the keeper is starting a process waits
/// for that one instead of starting its own: the keeper's started earlier,
/// so it is ready sooner, and a second start wasted a process (the
/// keeper's, retired unused as surplus; outside audit: 5 processes where 4
/// served). Only as many jobs wait as starts are in flight; the others
/// start their own at once.
#[derive(Debug, Default)]
pub(crate) struct WarmStarts {
    in_flight: std::sync::atomic::AtomicU32,
    waiting: std::sync::atomic::AtomicU32,
    /// told when a start in flight ends (its process in the pool, or failed)
    ended: tokio::sync::Notify,
}

/// One start of the keeper's, in flight while it lives.
struct InFlight<'a>(&'a WarmStarts);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.ended.notify_waiters();
    }
}

/// A job's claim on a start in flight.
struct Waiting<'a>(&'a WarmStarts);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl WarmStarts {
    fn begin(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self)
    }

    /// A session of `pool` (one that served no job where `fresh`) once a
    /// start in flight put it there, waiting up to `bound` or until
    /// `stopped` resolves (the job's cancel); `None` at once when no start
    /// is in flight or as many jobs wait for those as there are, and when
    /// the starts ended and another job took their process.
    pub(crate) async fn wait_for(
        &self,
        pool: &super::session::Pool,
        fresh: bool,
        bound: Duration,
        stopped: impl std::future::Future<Output = ()>,
    ) -> Option<Session> {
        let claimed = self
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
                (w < self.in_flight.load(Ordering::SeqCst)).then_some(w + 1)
            })
            .is_ok();
        if !claimed {
            return None;
        }
        let _claim = Waiting(self);
        let until = tokio::time::Instant::now() + bound;
        tokio::pin!(stopped);
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            // registered before the look: an end between the two is not missed
            ended.as_mut().enable();
            let taken = if fresh {
                pool.take_unused()
            } else {
                pool.take()
            };
            if taken.is_some() {
                return taken;
            }
            if self.in_flight.load(Ordering::SeqCst) == 0 {
                return None;
            }
            tokio::select! {
                _ = ended => {}
                _ = tokio::time::sleep_until(until) => return None,
                _ = &mut stopped => return None,
            }
        }
    }
}

/// How long no warm process may be lost before its back-off starts over.
const LOSS_QUIET: Duration = Duration::from_secs(60);

/// The keeper's wait after warm processes were lost before serving any job
/// (ended, stopped, or wrote after their hello): [`MIN_BACKOFF`] doubling to
/// [`MAX_BACKOFF`] with each loss, back to the start only after
/// [`LOSS_QUIET`] without one. The keeper also wakes for every slot that
/// comes back; that once reset the back-off, so under steady job traffic a
/// pool that kept losing its processes waited no more than a second or so
/// (stop re-check audit).
#[derive(Debug, Default)]
struct LossBackoff {
    next: Option<Duration>,
    last_loss: Option<std::time::Instant>,
}

impl LossBackoff {
    /// `lost` processes were found since the last wake: the wait before the
    /// next start, if any.
    fn on_wake(&mut self, lost: u32, now: std::time::Instant) -> Option<Duration> {
        if lost == 0 {
            return None;
        }
        let quiet = self
            .last_loss
            .is_none_or(|t| now.saturating_duration_since(t) >= LOSS_QUIET);
        let wait = match self.next {
            Some(w) if !quiet => w,
            _ => MIN_BACKOFF,
        };
        self.next = Some((wait * 2).min(MAX_BACKOFF));
        self.last_loss = Some(now);
        Some(wait)
    }
}

/// Processes to start now: `want` minus the idle ones and the slots in use.
fn missing(want: u32, idle: usize, busy: u32) -> u32 {
    want.saturating_sub(u32::try_from(idle).unwrap_or(u32::MAX).saturating_add(busy))
}

async fn keep_warm(shared: Arc<Shared>, exec: Arc<ExecutorRuntime>, stop: CancellationToken) {
    let want = exec.cfg.warm_processes;
    let mut backoff = MIN_BACKOFF;
    // for processes that say their hello and then end, stop or write before
    // any job: restarted at once, one such executor churned a process a
    // second per warm slot, each with a warning (stop audit)
    let mut losses = LossBackoff::default();
    loop {
        let lost = exec.pool.take_lost_unused();
        if let Some(wait) = losses.on_wake(lost, std::time::Instant::now()) {
            warn!(
                lost,
                retry_in_ms = wait.as_millis() as u64,
                "warm executor processes ended, were stopped or wrote before serving any job; the next warm start waits (jobs start their own processes meanwhile)"
            );
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // a busy process on its last job will not come back: not counted
        while missing(
            want,
            exec.pool.idle(),
            exec.running
                .load(Ordering::SeqCst)
                .saturating_sub(exec.last_jobs.get()),
        ) > 0
        {
            // ends once its process is in the pool (or the start failed)
            let in_flight = exec.warm_starts.begin();
            let started = tokio::select! {
                _ = stop.cancelled() => return,
                s = start_one(&shared, &exec) => s,
            };
            match started {
                Ok(session) => {
                    backoff = MIN_BACKOFF;
                    debug!(pid = session.child.pid, "warm executor process ready");
                    if stop.is_cancelled() {
                        drop(in_flight);
                        session.retire(&shared.cfg, "the worker is stopping").await;
                        return;
                    }
                    exec.pool.put(session, &shared.cfg).await;
                    drop(in_flight);
                }
                Err(why) => {
                    drop(in_flight);
                    warn!(error = %why, retry_in_ms = backoff.as_millis() as u64,
                          "cannot start a warm executor process; jobs start their own meanwhile");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = exec.slot_back.notified() => {}
        }
    }
}

/// One process of `exec`, started and handshaken, with a hello this
/// supervisor can speak to. A process whose hello is unusable is stopped.
async fn start_one(shared: &Shared, exec: &ExecutorRuntime) -> Result<Session, String> {
    // a persistent process runs in a session directory of its own: no
    // attempt directory to give it
    let session = exec
        .start_process(shared, shared.work.base(), "warm")
        .await
        .map_err(|e| e.to_string())?;
    match handshake(shared, session).await {
        Ok((hello, session)) => {
            exec.process_started(shared);
            // a new process's hello may offer more than the routes (kinds
            // added to the program): as a job's own new process widens them
            // (audit 89: a warm pool's replacements never did, and the new
            // kinds waited for a worker restart)
            exec.widen_routes(shared, &hello);
            Ok(session)
        }
        Err((why, gone)) => {
            // gone before its hello: the executor cannot be started here,
            // and its breaker opens as for a command that cannot run (a
            // job's start does the same); a hello closes it
            if gone {
                exec.process_failed(
                    shared,
                    Duration::from_millis(shared.cfg.refusal_delay_ms),
                    &why,
                );
            }
            Err(why)
        }
    }
}

/// The probe of a persistent executor whose breaker asks for one before
/// more is leased for it (`routes_to_lease`): a process of the pool's own,
/// started and handshaken, which the caller keeps for the next job when its
/// hello offers something. A probe that was stopped after its hello left
/// the next job to start a process of its own: an executor whose starts
/// failed every other time had every probe succeed and every job's start
/// fail, and its steps waited for ever. The breaker is left to the caller,
/// which judges the hello.
pub(crate) async fn probe_process(
    shared: &Shared,
    exec: &ExecutorRuntime,
) -> Result<(wire::Hello, Session), String> {
    let session = Session::start(
        &shared.spawner,
        &shared.cfg,
        &shared.work,
        &exec.cfg,
        shared.work.base(),
    )
    .await
    .map_err(|e| e.to_string())?;
    crate::metrics::executor_process_started(&exec.cfg.name, "warm");
    handshake(shared, session).await.map_err(|(why, _)| why)
}

/// Reads a started process's hello (kept in the session too). An unusable
/// one (or none) stops the process: why, and whether it was gone before its
/// hello.
async fn handshake(
    shared: &Shared,
    mut session: Session,
) -> Result<(wire::Hello, Session), (String, bool)> {
    let read = wire::read_hello(
        &mut session.frames,
        Duration::from_millis(shared.cfg.handshake_timeout_ms),
    )
    .await;
    let gone = read
        .as_ref()
        .is_err_and(wire::HandshakeError::gone_before_hello);
    let usable = match read {
        Ok(h) => super::usable_hello(h, shared.cfg.max_frame_bytes),
        Err(e) => Err(format!("{e}{}", e.stdout_hint())),
    };
    match usable {
        Ok(h) => {
            session.hello = Some(h.clone());
            Ok((h, session))
        }
        Err(why) => {
            let tail = session.child.stderr().tail_string();
            // its exit status is part of why (audit 86: "exited before its
            // hello; stderr: ." said nothing of its exit code 3)
            let ended = super::attempt::stop_child(&mut session.child, &shared.cfg).await;
            let how = super::how_it_ended(ended.as_ref(), &tail);
            Err((why + &how, gone))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{missing, LossBackoff, WarmStarts, LOSS_QUIET, MAX_BACKOFF, MIN_BACKOFF};
    use crate::worker::session::Pool;
    use std::time::{Duration, Instant};

    /// Only as many jobs wait as the keeper has starts in flight; a waiter
    /// is let go when the start ends (here: its process went to another
    /// job), and none waits when no start is in flight.
    #[tokio::test]
    async fn as_many_jobs_wait_as_starts_are_in_flight() {
        let starts = WarmStarts::default();
        let pool = Pool::new("x", 2);
        let long = Duration::from_secs(30);
        let t0 = Instant::now();
        assert!(starts.wait_for(&pool, false, long, never()).await.is_none());
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "none in flight: no wait"
        );

        let in_flight = starts.begin();
        let first = starts.wait_for(&pool, false, long, never());
        tokio::pin!(first);
        // the first claims the start and waits
        assert!(
            tokio::time::timeout(Duration::from_millis(50), first.as_mut())
                .await
                .is_err(),
            "the first waits for the start in flight"
        );
        // a second finds it claimed
        let t1 = Instant::now();
        assert!(starts.wait_for(&pool, false, long, never()).await.is_none());
        assert!(t1.elapsed() < Duration::from_secs(1), "claimed: no wait");
        // the start ends, its process taken by someone else: let go
        drop(in_flight);
        let t2 = Instant::now();
        assert!(first.await.is_none());
        assert!(t2.elapsed() < Duration::from_secs(1), "let go at the end");
        // and the claim is given back
        let _again = starts.begin();
        let waiter = starts.wait_for(&pool, false, Duration::from_millis(100), never());
        let t3 = Instant::now();
        assert!(waiter.await.is_none());
        assert!(
            t3.elapsed() >= Duration::from_millis(100),
            "waited its bound"
        );
        // a stop (the job's cancel) ends the wait at once
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let cancelled = async move {
            let _ = rx.await;
        };
        let waiter = starts.wait_for(&pool, false, long, cancelled);
        tokio::pin!(waiter);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), waiter.as_mut())
                .await
                .is_err(),
            "waits until the stop"
        );
        let _ = tx.send(());
        let t4 = Instant::now();
        assert!(waiter.await.is_none());
        assert!(t4.elapsed() < Duration::from_secs(1), "let go at the stop");
    }

    fn never() -> std::future::Pending<()> {
        std::future::pending()
    }

    /// Losses double the wait; wakes without a loss (a slot that came back,
    /// a job done) leave it as it is; only a quiet spell starts it over.
    #[test]
    fn the_loss_back_off_doubles_and_starts_over_only_after_a_quiet_spell() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut b = LossBackoff::default();
        // (seconds since t0, processes lost) -> the wait
        let steps: &[(u64, u32, Option<u64>)] = &[
            (0, 0, None),
            (1, 1, Some(500)),
            (2, 0, None), // a slot came back: no wait, no reset
            (3, 0, None),
            (4, 2, Some(1_000)),
            (5, 0, None),
            (6, 1, Some(2_000)),
            (7, 1, Some(4_000)),
            (8, 1, Some(8_000)),
            (9, 1, Some(16_000)),
            (10, 1, Some(30_000)),
            (11, 1, Some(30_000)),
            (40, 0, None),
            (70, 1, Some(30_000)), // 59 s after the last loss: not quiet yet
            (131, 1, Some(500)),   // 61 s: quiet, starts over
            (132, 1, Some(1_000)),
        ];
        for &(at, lost, want) in steps {
            assert_eq!(
                b.on_wake(lost, s(at)),
                want.map(Duration::from_millis),
                "at {at} s, {lost} lost"
            );
        }
        assert_eq!(MIN_BACKOFF, Duration::from_millis(500));
        assert_eq!(MAX_BACKOFF, Duration::from_secs(30));
        assert_eq!(LOSS_QUIET, Duration::from_secs(60));
    }

    #[test]
    fn tops_up_to_the_wanted_count_of_idle_and_busy_processes() {
        // (want, idle, busy) -> to start
        for (want, idle, busy, expect) in [
            (2, 0, 0, 2),
            (2, 1, 0, 1),
            (2, 0, 1, 1),
            (2, 1, 1, 0),
            (2, 2, 0, 0),
            (2, 0, 4, 0),
            (2, 3, 0, 0),
            (0, 0, 0, 0),
            (1, usize::MAX, u32::MAX, 0),
        ] {
            assert_eq!(
                missing(want, idle, busy),
                expect,
                "want {want}, idle {idle}, busy {busy}"
            );
        }
    }
}
