//! The worker: probes its executors, leases steps it can route, runs each in a
//! child, heartbeats all leases in one statement, reclaims expired leases, and
//! drains on shutdown (detect → tell → wait).

mod attempt;
pub mod routing;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::config::{ExecutorConfig, WorkerConfig};
use crate::db::{Db, DbError, Lease, Route};
use crate::process::{ProcessError, Spawner};
use crate::wire::{self, Hello, ToExecutor};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("cannot start the process spawner: {0}")]
    Spawner(#[source] ProcessError),
    #[error("executor {name:?} ({command}) did not answer the handshake: {why}. Check its command and that it speaks protocol v1")]
    Probe {
        name: String,
        command: String,
        why: String,
    },
}

/// What the heartbeat tells a running attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Control {
    Run,
    Cancel,
    LeaseLost,
}

/// A probed executor: its config and the lease routes its hello offered.
#[derive(Debug)]
pub struct ExecutorRuntime {
    pub cfg: ExecutorConfig,
    pub routes: Vec<Route>,
    running: AtomicU32,
}

/// State shared by the loops and the attempts of one worker.
pub(crate) struct Shared {
    pub db: Db,
    pub cfg: Arc<WorkerConfig>,
    pub id: Uuid,
    pub name: String,
    pub spawner: Spawner,
    /// Cancelled when the drain timeout passes: running children are stopped.
    pub abort: CancellationToken,
    leases: Mutex<HashMap<Uuid, (Lease, watch::Sender<Control>)>>,
}

impl Shared {
    /// The attempt stops executing: its lease leaves the heartbeat set. The
    /// commit that follows is fenced, so if the lease expires meanwhile the
    /// outcome is refused, as it must be.
    fn forget(&self, step_run_id: Uuid) {
        self.leases().remove(&step_run_id);
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, (Lease, watch::Sender<Control>)>> {
        // a panic while holding this lock cannot leave the map inconsistent
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Probes one executor: spawn, read its hello, ask it to shut down, reap.
pub async fn probe(
    spawner: &Spawner,
    cfg: &ExecutorConfig,
    wcfg: &WorkerConfig,
) -> Result<Hello, WorkerError> {
    let fail = |why: String| WorkerError::Probe {
        name: cfg.name.clone(),
        command: cfg.command.clone(),
        why,
    };
    let dir = tempfile::Builder::new()
        .prefix("durable-probe-")
        .tempdir()
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
            .map_err(|e| e.to_string())
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
    let report = if tokio::time::timeout(grace, child.exited()).await.is_ok() {
        child.finish().await
    } else {
        child
            .terminate(Duration::from_millis(wcfg.term_grace_ms))
            .await
    };
    match (hello, report) {
        (Ok(h), _) => Ok(h),
        (Err(why), Ok(r)) => Err(fail(format!(
            "{why}; exit {}; stderr: {}",
            r.status,
            r.stderr_tail.trim()
        ))),
        (Err(why), Err(_)) => Err(fail(why)),
    }
}

/// A running worker.
pub struct Worker {
    shared: Arc<Shared>,
    executors: Vec<Arc<ExecutorRuntime>>,
    wake: Arc<Notify>,
    heartbeat_now: Arc<Notify>,
}

impl Worker {
    /// Migrates, probes every executor, registers the worker.
    pub async fn start(db: Db, cfg: WorkerConfig) -> Result<Worker, WorkerError> {
        db.migrate().await?;
        let spawner = Spawner::start().map_err(WorkerError::Spawner)?;
        let mut executors = Vec::with_capacity(cfg.executors.len());
        for ecfg in &cfg.executors {
            let hello = probe(&spawner, ecfg, &cfg).await?;
            let routes = routing::routes(&hello, ecfg);
            info!(executor = %ecfg.name, executor_kind = %hello.executor_kind, kinds = ?hello.kinds,
                  labels = ?routing::effective_labels(&hello, ecfg), sdk = %hello.sdk_name, "executor ready");
            executors.push(Arc::new(ExecutorRuntime {
                cfg: ecfg.clone(),
                routes,
                running: AtomicU32::new(0),
            }));
        }
        let id = Uuid::new_v4();
        let host = hostname();
        let name = cfg
            .name
            .clone()
            .unwrap_or_else(|| format!("{host}:{}", std::process::id()));
        let caps = serde_json::to_value(
            executors
                .iter()
                .map(|e| serde_json::json!({"executor": e.cfg.name, "routes": e.routes}))
                .collect::<Vec<_>>(),
        )
        .unwrap_or_default();
        db.register_worker(id, &name, &host, &caps).await?;
        Ok(Worker {
            shared: Arc::new(Shared {
                db,
                cfg: Arc::new(cfg),
                id,
                name,
                spawner,
                abort: CancellationToken::new(),
                leases: Mutex::new(HashMap::new()),
            }),
            executors,
            wake: Arc::new(Notify::new()),
            heartbeat_now: Arc::new(Notify::new()),
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
        let mut background = JoinSet::new();
        background.spawn(heartbeat_loop(
            shared.clone(),
            self.heartbeat_now.clone(),
            loops_stop.clone(),
        ));
        background.spawn(reclaim_loop(shared.clone(), loops_stop.clone()));
        background.spawn(listen_loop(
            shared.clone(),
            self.wake.clone(),
            self.heartbeat_now.clone(),
            loops_stop.clone(),
        ));

        let mut attempts: JoinSet<()> = JoinSet::new();
        let slot_freed = Arc::new(Notify::new());
        info!(executors = self.executors.len(), "worker running");
        let poll = Duration::from_millis(cfg.poll_interval_ms);
        while !shutdown.is_cancelled() {
            let mut leased_any_full = false;
            for exec in &self.executors {
                let running = exec.running.load(Ordering::SeqCst);
                let free = exec.cfg.concurrency.saturating_sub(running);
                if free == 0 || exec.routes.is_empty() {
                    continue;
                }
                let steps = match shared
                    .db
                    .lease(
                        shared.id,
                        &shared.name,
                        &exec.routes,
                        free,
                        Duration::from_millis(cfg.lease_ttl_ms),
                    )
                    .await
                {
                    Ok(s) => s,
                    Err(e) => {
                        error!(error = %e, "lease failed; retrying after the poll interval");
                        break;
                    }
                };
                if steps.len() as u32 == free {
                    leased_any_full = true;
                }
                for step in steps {
                    let (tx, rx) = watch::channel(Control::Run);
                    shared
                        .leases()
                        .insert(step.lease.step_run_id(), (step.lease.clone(), tx));
                    exec.running.fetch_add(1, Ordering::SeqCst);
                    let span = info_span!("attempt", run_id = %step.run_id, step = %step.name,
                        step_run_id = %step.lease.step_run_id(), attempt = step.lease.attempt(), kind = %step.kind);
                    let (shared2, exec2, freed) =
                        (shared.clone(), exec.clone(), slot_freed.clone());
                    attempts.spawn(
                        async move {
                            let id = step.lease.step_run_id();
                            attempt::run(shared2.clone(), exec2.clone(), step, rx).await;
                            shared2.forget(id);
                            exec2.running.fetch_sub(1, Ordering::SeqCst);
                            freed.notify_one();
                        }
                        .instrument(span),
                    );
                }
            }
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
                _ = self.wake.notified() => {}
                _ = slot_freed.notified() => {}
                _ = tokio::time::sleep(poll) => {}
            }
        }

        // --- drain
        let running = attempts.len();
        info!(running, drain_timeout_ms = cfg.drain_timeout_ms, "draining");
        let drain_until = Instant::now() + Duration::from_millis(cfg.drain_timeout_ms);
        loop {
            tokio::select! {
                next = attempts.join_next() => match next {
                    None => break,
                    Some(Err(e)) => error!(error = %e, "an attempt task panicked"),
                    Some(Ok(())) => {}
                },
                _ = tokio::time::sleep_until(drain_until), if !shared.abort.is_cancelled() => {
                    warn!(running = attempts.len(), "drain timeout: stopping running attempts");
                    shared.abort.cancel();
                }
            }
        }
        loops_stop.cancel();
        while background.join_next().await.is_some() {}
        if let Err(e) = shared.db.worker_stopped(shared.id).await {
            warn!(error = %e, "cannot mark the worker stopped");
        }
        // every attempt of this worker has reaped its child by now; the
        // process-wide safety net (kill_all_groups) belongs to the command's
        // exit path, since other workers may share this process
        info!("worker stopped");
        Ok(())
    }
}

/// One batched statement per interval renews every lease this worker holds
/// and learns of cancel requests and lost leases. If heartbeats keep failing
/// for a whole TTL, every lease is treated as lost (others may reclaim them).
async fn heartbeat_loop(shared: Arc<Shared>, now: Arc<Notify>, stop: CancellationToken) {
    let interval = Duration::from_millis(shared.cfg.heartbeat_interval_ms);
    let ttl = Duration::from_millis(shared.cfg.lease_ttl_ms);
    let mut last_ok = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
            _ = now.notified() => {}
        }
        let leases: Vec<Lease> = shared.leases().values().map(|(l, _)| l.clone()).collect();
        match shared.db.heartbeat(shared.id, &leases, ttl).await {
            Ok(report) => {
                last_ok = Instant::now();
                let map = shared.leases();
                for id in &report.cancel_requested {
                    if let Some((_, tx)) = map.get(id) {
                        tx.send_if_modified(|c| {
                            if *c == Control::Run {
                                *c = Control::Cancel;
                                true
                            } else {
                                false
                            }
                        });
                    }
                }
                for id in &report.lost {
                    if let Some((_, tx)) = map.get(id) {
                        warn!(step_run_id = %id, "lease lost");
                        let _ = tx.send(Control::LeaseLost);
                    }
                }
                debug!(renewed = report.renewed, "heartbeat");
            }
            Err(e) => {
                error!(error = %e, "heartbeat failed");
                if last_ok.elapsed() >= ttl {
                    warn!("no successful heartbeat for a whole lease TTL: treating every lease as lost");
                    for (_, tx) in shared.leases().values() {
                        let _ = tx.send(Control::LeaseLost);
                    }
                }
            }
        }
    }
}

async fn reclaim_loop(shared: Arc<Shared>, stop: CancellationToken) {
    let interval = Duration::from_millis(shared.cfg.reclaim_interval_ms);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match shared.db.reclaim_expired(&shared.name, 100).await {
            Ok(0) => {}
            Ok(n) => info!(reclaimed = n, "reclaimed expired leases"),
            Err(e) => error!(error = %e, "reclaim failed"),
        }
    }
}

/// LISTEN/NOTIFY is only a wake-up hint; polling and the heartbeat remain the
/// paths that always work, so a lost notification costs latency, never a cancel.
async fn listen_loop(
    shared: Arc<Shared>,
    wake: Arc<Notify>,
    heartbeat_now: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        let mut listener = match shared.db.listener().await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "LISTEN unavailable; polling only");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                n = listener.recv() => match n {
                    Ok(n) if n.channel() == crate::db::CHANNEL_CANCEL => heartbeat_now.notify_one(),
                    Ok(_) => wake.notify_one(),
                    Err(e) => { warn!(error = %e, "LISTEN connection lost; reconnecting"); break; }
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
