//! One attempt of one step: spawn, handshake, stream, enforce, stop, commit.
//!
//! One event loop per attempt over: the worker's abort, the lease (cancel,
//! lost, or its clock running out), the step deadline, the attempt timeout,
//! the silence (heartbeat) timer, the child's exit and its frames — polled in
//! that order, so no stream of frames can starve a control input. The loop
//! never awaits the database: starts and progress events go to the attempt's
//! writer task through a bounded queue (when it is full the loop stops reading
//! frames, which back-pressures the executor through its pipe, and still
//! serves every control input). Cancel, deadline, lost lease and shutdown all
//! end a child the same way (CONTRACT §6): a cancel frame, a grace, SIGTERM to
//! the process group, a second grace, SIGKILL to the group, reap. Only then is
//! the outcome committed, fenced by the lease token, while the lease is still
//! in the worker's renewal set.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::panic::AssertUnwindSafe;
use std::path::{Component, Path};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::{FutureExt, StreamExt};
use nix::sys::signal::Signal;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn, Instrument};
use uuid::Uuid;

use super::{Control, ExecutorRuntime, LeaseView, Shared, DB_CALL_TIMEOUT};
use crate::db::{bounded, DbError, FailureReport, Lease, LeasedStep, NewArtifact, NewEvent};
use crate::process::Child;
use crate::state::Failure;
use crate::wire::{
    self, CancelReason, EventKind, FromExecutor, HandshakeError, Hello, JobError, JobResult,
    ToExecutor, WireError,
};

/// After the leader exited, how long stdout may stay idle before we stop
/// reading (a grandchild may hold the pipe open, so EOF may never come) ...
const EXIT_DRAIN_IDLE: Duration = Duration::from_millis(150);
/// ... and the bounds of that drain in time and in frames: a grandchild that
/// keeps writing must not keep the attempt open.
const EXIT_DRAIN_MAX: Duration = Duration::from_secs(2);
const EXIT_DRAIN_MAX_FRAMES: usize = 1024;
/// Intents queued between the attempt's loop and its writer task.
const WRITER_QUEUE: usize = 256;
/// Codes that mean "this executor cannot run this job" (not "the job failed").
const REFUSAL_CODES: [&str; 3] = ["UNSUPPORTED_KIND", "EXECUTOR_REFUSED", "EXECUTOR_BUSY"];

/// How an attempt ended, before it is committed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    Succeeded {
        output: serde_json::Value,
        artifacts: Vec<NewArtifact>,
        sequence: u64,
    },
    Failed {
        code: String,
        message: String,
        retryable: bool,
        details: Option<serde_json::Value>,
        next_retry_delay_ms: Option<u64>,
        sequence: Option<u64>,
    },
    Cancelled {
        message: String,
    },
    /// Refused before execution: back to the queue, the attempt given back,
    /// the refusal counted (capped by `max_refusals`).
    Refused {
        code: String,
        message: String,
    },
    /// Stopped by a draining worker: back to the queue at once, the attempt
    /// not counted (a redeploy must not burn attempts).
    Released {
        message: String,
    },
    /// The lease is gone (or its clock ran out): nothing may be written.
    Abandoned {
        why: String,
    },
}

impl Outcome {
    fn failed(code: &str, retryable: bool, message: impl Into<String>) -> Outcome {
        Outcome::Failed {
            code: code.to_owned(),
            message: message.into(),
            retryable,
            details: None,
            next_retry_delay_ms: None,
            sequence: None,
        }
    }

    fn label(&self) -> String {
        match self {
            Outcome::Succeeded { .. } => "succeeded".into(),
            Outcome::Failed { code, .. } => format!("failed ({code})"),
            Outcome::Cancelled { .. } => "cancelled".into(),
            Outcome::Refused { code, .. } => format!("refused ({code})"),
            Outcome::Released { .. } => "released (worker shutdown)".into(),
            Outcome::Abandoned { .. } => "abandoned (lease lost)".into(),
        }
    }
}

/// The terminal frame a job ended with.
#[derive(Debug, Clone, PartialEq)]
enum Terminal {
    Result(JobResult),
    Error(JobError),
}

/// Runs one attempt to the end and commits its outcome. A panic inside the
/// attempt fails it with `SUPERVISOR_PANIC` (its child is killed by `Child`'s
/// drop); the caller's guard frees the slot whatever happens.
pub(crate) async fn run(
    shared: Arc<Shared>,
    exec: Arc<ExecutorRuntime>,
    step: LeasedStep,
    control: watch::Receiver<LeaseView>,
) {
    let started = Instant::now();
    let redactor = Arc::new(Redact::default());
    let outcome = match AssertUnwindSafe(execute(
        &shared,
        &exec,
        &step,
        control.clone(),
        redactor.clone(),
    ))
    .catch_unwind()
    .await
    {
        Ok(o) => o,
        Err(_) => {
            error!("the attempt panicked; its child was killed");
            Outcome::failed(
                "SUPERVISOR_PANIC",
                true,
                "the supervisor's attempt task panicked; its executor was stopped",
            )
        }
    };
    let outcome = redactor.outcome(outcome);
    if let Outcome::Failed { code, message, .. } = &outcome {
        warn!(code = %code, %message, "the attempt failed");
    }
    let label = outcome.label();
    commit(&shared, &step, outcome, control, &redactor).await;
    info!(outcome = %label, elapsed_ms = started.elapsed().as_millis() as u64, "attempt finished");
}

/// Redaction of what an attempt persists or logs: the secret values it
/// handed out, and credentials in connection strings (always, even before
/// any secret is resolved).
#[derive(Default)]
pub(crate) struct Redact {
    inner: std::sync::RwLock<crate::secrets::Redactor>,
}

impl Redact {
    fn set(&self, secrets: &BTreeMap<String, String>) {
        let r = crate::secrets::Redactor::new(secrets);
        if !r.short_names().is_empty() {
            warn!(secrets = ?r.short_names(), "secret values shorter than {} bytes are redacted only where they are a whole string", crate::secrets::MIN_REDACT_LEN);
        }
        *self.inner.write().unwrap_or_else(|p| p.into_inner()) = r;
    }
    fn text(&self, s: &str) -> String {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .redact_str(s)
            .into_owned()
    }
    fn json(&self, v: &mut serde_json::Value) {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .redact_json(v);
    }
    fn bytes(&self, b: Vec<u8>) -> Vec<u8> {
        match self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .redact_bytes(&b)
        {
            std::borrow::Cow::Borrowed(_) => b,
            std::borrow::Cow::Owned(o) => o,
        }
    }
    fn outcome(&self, o: Outcome) -> Outcome {
        match o {
            Outcome::Succeeded {
                mut output,
                mut artifacts,
                sequence,
            } => {
                self.json(&mut output);
                for a in &mut artifacts {
                    a.name = self.text(&a.name);
                    a.media_type = self.text(&a.media_type);
                }
                Outcome::Succeeded {
                    output,
                    artifacts,
                    sequence,
                }
            }
            Outcome::Failed {
                code,
                message,
                retryable,
                mut details,
                next_retry_delay_ms,
                sequence,
            } => {
                if let Some(d) = details.as_mut() {
                    self.json(d);
                }
                Outcome::Failed {
                    code: self.text(&code),
                    message: self.text(&message),
                    retryable,
                    details,
                    next_retry_delay_ms,
                    sequence,
                }
            }
            Outcome::Cancelled { message } => Outcome::Cancelled {
                message: self.text(&message),
            },
            Outcome::Refused { code, message } => Outcome::Refused {
                code: self.text(&code),
                message: self.text(&message),
            },
            other => other,
        }
    }
}

async fn execute(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    mut control: watch::Receiver<LeaseView>,
    redactor: Arc<Redact>,
) -> Outcome {
    crate::fault::maybe_panic(&step.kind);
    let view = *control.borrow_and_update();
    if step.cancel_requested || view.control == Control::Cancel {
        return Outcome::Cancelled {
            message: "cancellation was requested before the attempt started".into(),
        };
    }
    if let Some(deadline) = step.deadline {
        if deadline <= Utc::now() {
            return Outcome::failed(
                "DEADLINE_EXCEEDED",
                false,
                format!(
                    "the step deadline {deadline} passed before attempt {} started",
                    step.lease.attempt()
                ),
            );
        }
    }
    let secrets = match resolve_secrets(shared, exec, step) {
        Ok(s) => s,
        Err(o) => return o,
    };
    redactor.set(&secrets);

    // the attempt's own directory: in/ for input artifacts, out/ for results.
    // Failing to make it is "this worker can't", not the step's failure.
    let base = shared
        .cfg
        .work_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir);
    let workdir = match tempfile::Builder::new()
        .prefix(&format!("durable-{}-", step.lease.step_run_id()))
        .tempdir_in(&base)
    {
        Ok(d) => d,
        Err(e) => {
            return Outcome::Refused {
                code: "WORK_DIR_UNAVAILABLE".into(),
                message: format!(
                    "cannot create a working directory in {}: {e}",
                    base.display()
                ),
            }
        }
    };
    let out_dir = workdir.path().join("out");
    let in_dir = workdir.path().join("in");
    if let Err(e) = std::fs::create_dir(&out_dir).and_then(|_| std::fs::create_dir(&in_dir)) {
        return Outcome::Refused {
            code: "WORK_DIR_UNAVAILABLE".into(),
            message: format!("cannot prepare the working directory: {e}"),
        };
    }
    let inputs = match materialize_inputs(shared, step, &in_dir).await {
        Ok(v) => v,
        Err(o) => return o,
    };

    let now_ms = Utc::now().timestamp_millis();
    let job = wire::Job {
        job_id: format!("{}:{}", step.lease.step_run_id(), step.lease.attempt()),
        workflow_run_id: step.run_id.to_string(),
        step_run_id: step.lease.step_run_id().to_string(),
        idempotency_key: step.idempotency_key.clone(),
        executor_kind: step.executor_kind.clone(),
        kind: step.kind.clone(),
        attempt: step.lease.attempt(),
        deadline_unix_ms: step.deadline.map(|d| d.timestamp_millis()).unwrap_or(0),
        attempt_deadline_unix_ms: step
            .timeout_ms
            .map(|t| now_ms.saturating_add(t))
            .unwrap_or(0),
        heartbeat_timeout_ms: step
            .heartbeat_timeout_ms
            .unwrap_or(0)
            .clamp(0, u32::MAX as i64) as u32,
        input: serde_json::to_vec(&step.input).unwrap_or_else(|_| b"null".to_vec()),
        input_artifacts: inputs,
        checkpoint: step.checkpoint.clone(),
        output_dir: out_dir.to_string_lossy().into_owned(),
        secrets,
        labels: step.labels.clone(),
        agreement: None,
    };

    // a warm process of a persistent executor, or a new one (a one-shot
    // process runs in the attempt's directory; a persistent one in its own)
    let reused = if exec.cfg.persistent {
        exec.pool.take()
    } else {
        None
    };
    let mut session = match reused {
        Some(s) => {
            debug!(pid = s.child.pid, jobs = s.jobs, "warm executor reused");
            s
        }
        None => match spawn_session(shared, exec, workdir.path()).await {
            Ok(s) => s,
            Err(o) => return o,
        },
    };
    let outcome = converse(
        shared,
        exec,
        step,
        &mut session,
        &job,
        &mut control,
        &redactor,
    )
    .await;
    finish_session(shared, exec, session).await;
    drop(workdir);
    outcome
}

/// Starts a process of `exec`: in `attempt_dir` (one-shot) or in a directory
/// of its own that lives as long as the process (persistent).
pub(crate) async fn spawn_session(
    shared: &Shared,
    exec: &ExecutorRuntime,
    attempt_dir: &Path,
) -> Result<Session, Outcome> {
    let dir = if exec.cfg.persistent {
        let base = shared
            .cfg
            .work_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir);
        match tempfile::Builder::new()
            .prefix(&format!("durable-session-{}-", sanitize(&exec.cfg.name)))
            .tempdir_in(&base)
        {
            Ok(d) => Some(d),
            Err(e) => {
                return Err(Outcome::Refused {
                    code: "WORK_DIR_UNAVAILABLE".into(),
                    message: format!(
                        "cannot create a session directory in {}: {e}",
                        base.display()
                    ),
                })
            }
        }
    } else {
        None
    };
    let cwd = dir.as_ref().map(|d| d.path()).unwrap_or(attempt_dir);
    let spec = exec.cfg.spawn_spec(cwd, shared.cfg.stderr_tail_bytes);
    let child = shared
        .spawner
        .spawn(spec)
        .await
        .map_err(|e| Outcome::failed("SPAWN_FAILED", true, e.to_string()))?;
    debug!(
        pid = child.pid,
        persistent = exec.cfg.persistent,
        "executor spawned"
    );
    Session::new(child, shared.cfg.max_frame_bytes, dir)
        .ok_or_else(|| Outcome::failed("SPAWN_FAILED", true, "the executor's pipes are missing"))
}

/// After a job: a clean persistent session goes back to its pool (unless it
/// served its `max_jobs_per_process` or the worker is stopping: then it is
/// retired in order); anything else was stopped by the attempt already.
async fn finish_session(shared: &Shared, exec: &ExecutorRuntime, session: Session) {
    if !session.reusable {
        return;
    }
    let mut session = session;
    session.reusable = false;
    let limit = session.job_limit(exec.cfg.max_jobs_per_process);
    if shared.abort.is_cancelled() || shared.draining.is_cancelled() {
        session.retire(&shared.cfg, "the worker is stopping").await;
    } else if session.jobs >= limit {
        session
            .retire(&shared.cfg, "max_jobs_per_process served")
            .await;
    } else {
        exec.pool.put(session);
    }
}

/// The secrets the step names, as this worker may hand them out: only names
/// the executor's config lists (`SECRET_NOT_ALLOWED`, non-retryable, before
/// spawn), from `secrets_dir` or the environment; a value this worker cannot
/// find is "this worker can't" (`SECRET_UNAVAILABLE`, a refusal).
fn resolve_secrets(
    shared: &Shared,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
) -> Result<BTreeMap<String, String>, Outcome> {
    crate::secrets::resolve_for(&exec.cfg, &step.secrets, shared.cfg.secrets_dir.as_deref())
        .map_err(|e| {
            warn!(error = %e, code = e.code(), "the step's secrets cannot be handed out");
            if e.is_refusal() {
                Outcome::Refused {
                    code: e.code().into(),
                    message: e.to_string(),
                }
            } else {
                Outcome::failed(e.code(), false, e.to_string())
            }
        })
}

/// Writes the input artifacts under `in/<step>/<name>`, read-only.
async fn materialize_inputs(
    shared: &Shared,
    step: &LeasedStep,
    in_dir: &Path,
) -> Result<Vec<wire::InputArtifact>, Outcome> {
    let arts = bounded(
        DB_CALL_TIMEOUT,
        "reading input artifacts",
        shared.db.input_artifacts(step.run_id, &step.name),
    )
    .await
    .map_err(|e| Outcome::Refused {
        code: "INPUT_UNAVAILABLE".into(),
        message: format!("cannot read input artifacts: {e}"),
    })?;
    let mut out = Vec::with_capacity(arts.len());
    for a in arts {
        let dir = in_dir.join(sanitize(&a.step_name));
        let path = dir.join(sanitize(&a.name));
        let written = async {
            tokio::fs::create_dir_all(&dir).await?;
            tokio::fs::write(&path, &a.content).await?;
            tokio::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).await
        }
        .await;
        if let Err(e) = written {
            return Err(Outcome::Refused {
                code: "WORK_DIR_UNAVAILABLE".into(),
                message: format!("cannot write input artifact {}: {e}", a.name),
            });
        }
        out.push(wire::InputArtifact {
            id: a.id.to_string(),
            name: a.name,
            sha256: a.sha256,
            size: a.size.max(0) as u64,
            media_type: a.media_type,
            path: path.to_string_lossy().into_owned(),
            step_name: a.step_name,
        });
    }
    Ok(out)
}

fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        format!("_{s}")
    } else {
        s
    }
}

use super::session::{Frames, Session};

/// How long one frame may take to go into the child's stdin. A child that
/// does not read its stdin must not block the attempt's event loop.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

async fn write_frame(stdin: &mut Option<ChildStdin>, m: &ToExecutor) {
    if let Some(w) = stdin.as_mut() {
        let bytes = wire::encode_to_executor(m);
        let res = tokio::time::timeout(WRITE_TIMEOUT, async {
            w.write_all(&bytes).await?;
            w.flush().await
        })
        .await;
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // the child closed stdin or died; its exit tells the rest
                debug!(error = %e, "cannot write to the executor's stdin");
                *stdin = None;
            }
            Err(_) => {
                warn!("the executor does not read its stdin; closing it");
                *stdin = None;
            }
        }
    }
}

/// Resolves once the attempt must stop: a cancel, a lost lease, or the lease
/// clock about to run out (`budget` before it: the time a stop takes). The
/// lease clock only advances on successful renewals, so a worker cut off from
/// the database stops its children before another worker can reclaim them.
async fn until_stopped(control: &mut watch::Receiver<LeaseView>, budget: Duration) -> Control {
    loop {
        let v = *control.borrow_and_update();
        if v.control != Control::Run {
            return v.control;
        }
        let stop_at = v
            .valid_until
            .checked_sub(budget)
            .unwrap_or_else(Instant::now);
        tokio::select! {
            changed = control.changed() => {
                if changed.is_err() {
                    // the worker forgot this lease: nothing will renew it
                    tokio::time::sleep_until(stop_at).await;
                    return Control::LeaseLost;
                }
            }
            _ = tokio::time::sleep_until(stop_at) => {
                warn!(budget_ms = budget.as_millis() as u64,
                      "the lease could not be renewed in time: stopping the executor before the lease can expire");
                return Control::LeaseLost;
            }
        }
    }
}

async fn sleep_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// `ms` from now; None when that is beyond the clock's range (never).
fn instant_in(ms: i64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(ms.max(0) as u64))
}

fn wire_failure(e: &WireError) -> (&'static str, String) {
    match e {
        WireError::TooLarge { len, cap } => (
            "PROTOCOL_FRAME_TOO_LARGE",
            format!("the executor announced a frame of {len} bytes; the cap is {cap}"),
        ),
        WireError::Truncated { buffered, .. } => (
            "PROTOCOL_MALFORMED_FRAME",
            format!("the executor's stdout ended inside a frame ({buffered} bytes buffered)"),
        ),
        WireError::Malformed { reason, .. } => (
            "PROTOCOL_MALFORMED_FRAME",
            format!("the executor wrote bytes that are not a valid frame: {reason}"),
        ),
        WireError::Io(e) => (
            "EXECUTOR_CRASHED",
            format!("reading the executor's stdout failed: {e}"),
        ),
    }
}

// ---------------------------------------------------------------------------
// the writer: one task per attempt, the only one that writes its progress

/// What the attempt's loop asks its writer to persist, in order.
#[derive(Debug)]
enum Intent {
    Start { pid: i32, event: wire::Event },
    Event(wire::Event),
}

/// The attempt's writer task and the bounded queue to it.
struct Writer {
    tx: mpsc::Sender<Intent>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    fn spawn(shared: Arc<Shared>, lease: Lease, control: watch::Receiver<LeaseView>) -> Writer {
        let (tx, rx) = mpsc::channel(WRITER_QUEUE);
        let task = tokio::spawn(write_loop(shared, lease, rx, control).in_current_span());
        Writer { tx, task }
    }

    fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }

    /// Resolves once the queue has room again (never, if the writer is gone).
    async fn room(&self) {
        match self.tx.reserve().await {
            Ok(permit) => drop(permit),
            Err(_) => std::future::pending().await,
        }
    }

    /// Queues an intent; the caller checked `has_room` (only this attempt sends).
    fn push(&self, intent: Intent) {
        if let Err(e) = self.tx.try_send(intent) {
            debug!(error = %e, "the writer is gone (lease lost); intent dropped");
        }
    }

    /// Queues an intent, waiting for room (after the child exited: nothing
    /// else needs the loop then).
    async fn push_wait(&self, intent: Intent) {
        let _ = self.tx.send(intent).await;
    }

    /// Lets the writer persist what is queued (bounded by `until`), so events
    /// are stored before the terminal that follows them.
    async fn finish(self, until: Instant) {
        drop(self.tx);
        let mut task = self.task;
        if tokio::time::timeout_at(until, &mut task).await.is_err() {
            warn!("progress writes did not finish before the lease clock ran out; the rest is dropped");
            task.abort();
        }
    }
}

async fn write_loop(
    shared: Arc<Shared>,
    lease: Lease,
    mut rx: mpsc::Receiver<Intent>,
    control: watch::Receiver<LeaseView>,
) {
    let mut buf = Vec::with_capacity(64);
    while rx.recv_many(&mut buf, 64).await > 0 {
        let mut i = 0;
        while i < buf.len() {
            let res = match &buf[i] {
                Intent::Start { pid, event } => {
                    i += 1;
                    let ev = new_event(event);
                    retrying(&control, "recording the start", || {
                        shared.db.mark_running(&lease, &shared.name, *pid, &ev)
                    })
                    .await
                }
                Intent::Event(_) => {
                    let end = buf[i..]
                        .iter()
                        .position(|x| matches!(x, Intent::Start { .. }))
                        .map(|p| i + p)
                        .unwrap_or(buf.len());
                    let run: Vec<&wire::Event> = buf[i..end]
                        .iter()
                        .filter_map(|x| match x {
                            Intent::Event(e) => Some(e),
                            Intent::Start { .. } => None,
                        })
                        .collect();
                    let evs: Vec<NewEvent<'_>> =
                        coalesce(&run).into_iter().map(new_event).collect();
                    i = end;
                    retrying(&control, "recording progress events", || {
                        shared.db.record_events(&lease, &evs)
                    })
                    .await
                }
            };
            match res {
                Ok(()) => {}
                Err(DbError::LeaseLost { .. }) => {
                    shared.lease_lost(lease.step_run_id());
                    return;
                }
                Err(e) => {
                    error!(error = %e, "a progress write failed for good; it is dropped (the outcome still commits)")
                }
            }
        }
        buf.clear();
    }
}

/// What of a run of queued events is written: every event that carries a
/// checkpoint or is not plain progress, and of the plain progress events
/// (no checkpoint) only the latest — when the database is slower than the
/// executor, progress is coalesced instead of queued without end. In order.
fn coalesce<'a>(events: &[&'a wire::Event]) -> Vec<&'a wire::Event> {
    let plain = |e: &wire::Event| e.kind == EventKind::Progress && e.checkpoint.is_none();
    let last_plain = events.iter().rposition(|e| plain(e));
    events
        .iter()
        .enumerate()
        .filter(|(i, e)| !plain(e) || Some(*i) == last_plain)
        .map(|(_, e)| *e)
        .collect()
}

/// Runs a write, retrying transient errors while the lease clock says the
/// lease can still be valid.
async fn retrying<'a, F, Fut>(
    control: &watch::Receiver<LeaseView>,
    what: &'static str,
    mut f: F,
) -> Result<(), DbError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), DbError>> + 'a,
{
    let mut delay = Duration::from_millis(50);
    loop {
        match bounded(DB_CALL_TIMEOUT, what, f()).await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() && Instant::now() + delay < control.borrow().valid_until => {
                warn!(error = %e, "{what} failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e),
        }
    }
}

// ---------------------------------------------------------------------------
// frames: pure checks

/// What the attempt's loop knows of the job's frames so far.
#[derive(Debug, Default)]
struct FrameState {
    accepted: bool,
    last_seq: u64,
}

#[derive(Debug)]
enum FrameVerdict {
    Continue,
    Write(Intent),
    Terminal(Terminal),
    Impose(Outcome),
}

/// A protocol violation (logged, redacted, with the attempt's outcome).
fn violation(code: &str, msg: String) -> FrameVerdict {
    FrameVerdict::Impose(Outcome::failed(code, false, msg))
}

/// Checks one frame of a running job. Pure: what to write is returned, not done.
fn on_frame(st: &mut FrameState, job: &wire::Job, pid: i32, frame: FromExecutor) -> FrameVerdict {
    let (job_id, seq) = match &frame {
        FromExecutor::Event(e) => (e.job_id.as_str(), e.sequence),
        FromExecutor::Result(r) => (r.job_id.as_str(), r.sequence),
        FromExecutor::Error(e) => (e.job_id.as_str(), e.sequence),
        other => {
            return violation(
                "PROTOCOL_UNEXPECTED_FRAME",
                format!("unexpected {} during a job", other.name()),
            )
        }
    };
    if job_id != job.job_id {
        return violation(
            "PROTOCOL_UNEXPECTED_FRAME",
            format!(
                "frame for job {job_id:?} while running job {:?}",
                job.job_id
            ),
        );
    }
    if seq <= st.last_seq {
        return violation(
            "PROTOCOL_SEQUENCE_REGRESSION",
            format!("sequence {seq} after {}", st.last_seq),
        );
    }
    // text the database cannot store (a NUL) is refused here, at the wire,
    // with its own code, instead of failing the commit later
    if let Some(field) = wire::text_problem(&frame) {
        return violation(
            "PROTOCOL_INVALID_TEXT",
            format!("{field} contains a NUL character, which cannot be stored"),
        );
    }
    st.last_seq = seq;
    match frame {
        FromExecutor::Event(e) => {
            if !st.accepted {
                if e.kind != EventKind::Accepted {
                    return violation(
                        "PROTOCOL_UNEXPECTED_FRAME",
                        format!("{} event before accepted", e.kind.as_str()),
                    );
                }
                st.accepted = true;
                return FrameVerdict::Write(Intent::Start { pid, event: e });
            }
            if e.kind == EventKind::Accepted {
                return violation(
                    "PROTOCOL_UNEXPECTED_FRAME",
                    "a second accepted event".into(),
                );
            }
            if e.kind == EventKind::Heartbeat && e.checkpoint.is_none() {
                // liveness only: the worker's batched heartbeat keeps the lease
                return FrameVerdict::Continue;
            }
            FrameVerdict::Write(Intent::Event(e))
        }
        FromExecutor::Result(r) => {
            if !st.accepted {
                return violation(
                    "PROTOCOL_UNEXPECTED_FRAME",
                    "a result before accepted".into(),
                );
            }
            FrameVerdict::Terminal(Terminal::Result(r))
        }
        FromExecutor::Error(e) => FrameVerdict::Terminal(Terminal::Error(e)),
        _ => FrameVerdict::Continue,
    }
}

/// What decides an attempt once its child is gone.
#[derive(Debug, PartialEq)]
enum Verdict {
    Outcome(Outcome),
    /// A result to verify (artifacts on disk) before it becomes the outcome.
    Verify(JobResult),
}

/// The precedence of outcomes, in one pure function:
/// 1. a frame after the terminal overrides everything;
/// 2. an outcome the supervisor imposed (timeout, deadline, lost lease,
///    shutdown, violation) wins over the executor's terminal — except a
///    cancel answered by a result within the grace: the work was done, the
///    result is kept;
/// 3. a result is verified;
/// 4. an error before `accepted` is a refusal when it says "this executor
///    can't" (a refusal code, or retryable), else a failure (a non-retryable
///    error is terminal: respawning will not fix it);
/// 5. `CANCELLED` confirms our own cancel; without one it is a failure;
/// 6. no terminal at all: the executor crashed.
fn precedence(
    imposed: Option<Outcome>,
    terminal: Option<Terminal>,
    accepted: bool,
    own_cancel: bool,
    after_terminal_violation: bool,
    exit_text: &str,
) -> Verdict {
    if after_terminal_violation {
        return Verdict::Outcome(Outcome::failed(
            "PROTOCOL_FRAME_AFTER_TERMINAL",
            false,
            "the executor wrote a frame after its terminal",
        ));
    }
    match (imposed, terminal) {
        (Some(Outcome::Cancelled { .. }), Some(Terminal::Result(r))) => Verdict::Verify(r),
        (Some(o), _) => Verdict::Outcome(o),
        (None, Some(Terminal::Result(r))) => Verdict::Verify(r),
        (None, Some(Terminal::Error(e))) => {
            if !accepted {
                if REFUSAL_CODES.contains(&e.code.as_str()) || e.code.is_empty() || e.retryable {
                    Verdict::Outcome(Outcome::Refused {
                        code: if e.code.is_empty() {
                            "EXECUTOR_REFUSED".into()
                        } else {
                            e.code
                        },
                        message: e.message,
                    })
                } else {
                    Verdict::Outcome(executor_failure(e))
                }
            } else if e.code == "CANCELLED" && own_cancel {
                Verdict::Outcome(Outcome::Cancelled { message: e.message })
            } else {
                // includes CANCELLED without a cancel request: an executor may
                // not cancel on its own, so that is a failure with its code
                Verdict::Outcome(executor_failure(e))
            }
        }
        (None, None) => Verdict::Outcome(Outcome::failed(
            "EXECUTOR_CRASHED",
            true,
            format!("the executor ended without a terminal ({exit_text})"),
        )),
    }
}

/// Codes only the supervisor (or the reclaimer) gives: its own verdicts. An
/// executor that reports one is not believed (it cannot make its failure look
/// like a lease expiry, a timeout or a shutdown).
pub(crate) const RESERVED_CODES: &[&str] = &[
    "LEASE_EXPIRED",
    "LEASE_LOST",
    "HEARTBEAT_TIMEOUT",
    "ATTEMPT_TIMEOUT",
    "DEADLINE_EXCEEDED",
    "WORKER_SHUTDOWN",
    "EXECUTOR_CRASHED",
    "HANDSHAKE_FAILED",
    "SPAWN_FAILED",
    "SECRET_UNAVAILABLE",
    "SECRET_NOT_ALLOWED",
    "WORK_DIR_UNAVAILABLE",
    "INPUT_UNAVAILABLE",
    "COMMIT_REJECTED",
    "SUPERVISOR_PANIC",
    "EXECUTOR_ERROR",
    "PROTOCOL_MALFORMED_FRAME",
    "PROTOCOL_FRAME_TOO_LARGE",
    "PROTOCOL_SEQUENCE_REGRESSION",
    "PROTOCOL_FRAME_AFTER_TERMINAL",
    "PROTOCOL_UNEXPECTED_FRAME",
    "PROTOCOL_INVALID_TEXT",
];

fn is_reserved(code: &str) -> bool {
    RESERVED_CODES.contains(&code)
}

/// An executor's error as a failed outcome. An empty code is
/// `EXECUTOR_ERROR`; a code the supervisor reserves is rewritten to
/// `EXECUTOR_ERROR`, the reported code kept in `details.reported_code`.
fn executor_failure(e: JobError) -> Outcome {
    let mut details = parse_details(&e.details);
    let code = if e.code.is_empty() {
        "EXECUTOR_ERROR".to_string()
    } else if is_reserved(&e.code) {
        let mut d = match details.take() {
            Some(serde_json::Value::Object(m)) => m,
            Some(other) => {
                let mut m = serde_json::Map::new();
                m.insert("details".into(), other);
                m
            }
            None => serde_json::Map::new(),
        };
        d.insert(
            "reported_code".into(),
            serde_json::Value::String(e.code.clone()),
        );
        details = Some(serde_json::Value::Object(d));
        "EXECUTOR_ERROR".to_string()
    } else {
        e.code
    };
    Outcome::Failed {
        code,
        message: e.message,
        retryable: e.retryable,
        details,
        next_retry_delay_ms: e.next_retry_delay_ms,
        sequence: Some(e.sequence),
    }
}

fn parse_details(bytes: &[u8]) -> Option<serde_json::Value> {
    if bytes.is_empty() {
        return None;
    }
    let v = serde_json::from_slice(bytes).unwrap_or_else(|_| {
        serde_json::json!({"unparsed": String::from_utf8_lossy(&bytes[..bytes.len().min(4096)])})
    });
    // jsonb cannot hold a NUL: details are evidence, so they are kept, cleaned
    Some(without_nul(v))
}

/// A JSON value with every NUL character replaced (U+FFFD).
fn without_nul(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(s.replace('\0', "\u{fffd}")),
        Value::Array(a) => Value::Array(a.into_iter().map(without_nul).collect()),
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, x)| (k.replace('\0', "\u{fffd}"), without_nul(x)))
                .collect(),
        ),
        other => other,
    }
}

fn has_nul(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(has_nul),
        Value::Object(m) => m.iter().any(|(k, x)| k.contains('\0') || has_nul(x)),
        _ => false,
    }
}

/// The outcome of stopping before any job was sent.
fn before_job_outcome(c: Control) -> Outcome {
    match c {
        Control::LeaseLost => Outcome::Abandoned {
            why: "the lease was lost (or could not be renewed) before the job was sent".into(),
        },
        _ => Outcome::Cancelled {
            message: "cancellation was requested before the job was sent".into(),
        },
    }
}

/// The conversation with one child, from hello to reaped.
async fn converse(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    session: &mut Session,
    job: &wire::Job,
    control: &mut watch::Receiver<LeaseView>,
    redactor: &Redact,
) -> Outcome {
    let cfg = &shared.cfg;
    let budget = shared.stop_budget();
    let persistent = exec.cfg.persistent;
    let mut stdin = session.stdin.take();
    let known_hello = session.hello.clone();
    let child = &mut session.child;
    let frames = &mut session.frames;

    // --- handshake (a new process only): the executor speaks first; a
    // cancel, a lost lease or the worker's abort during it stops the child
    let hello: Hello = if let Some(h) = known_hello {
        h
    } else {
        let handshake = wire::read_hello(frames, Duration::from_millis(cfg.handshake_timeout_ms));
        let read = tokio::select! {
            biased;
            _ = shared.abort.cancelled() => {
                return stop_now(child, cfg, Outcome::Released {
                    message: "the worker shut down while the executor started; no job was sent".into(),
                }).await;
            }
            c = until_stopped(control, budget) => {
                return stop_now(child, cfg, before_job_outcome(c)).await;
            }
            r = handshake => r,
        };
        let h = match read {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %redactor.text(&e.to_string()), stderr_tail = %redactor.text(&child.stderr().tail_string()), "handshake failed");
                // the raw evidence stays in the log; the stored message describes it
                let msg = match &e {
                    HandshakeError::Wire(w) => wire_failure(w).1,
                    other => other.to_string(),
                };
                return stop_now(child, cfg, Outcome::failed("HANDSHAKE_FAILED", true, msg)).await;
            }
        };
        session.hello = Some(h.clone());
        h
    };
    if let Err(why) = super::routing::check(
        &hello,
        &exec.cfg,
        &step.executor_kind,
        &step.kind,
        &step.labels,
    ) {
        // this hello is a fresh probe: lease only what it offers from now on
        exec.set_routes(super::routing::routes(&hello, &exec.cfg));
        warn!(%why, "executor refused before any job was sent; its routes are re-read from this hello");
        let outcome = Outcome::Refused {
            code: "EXECUTOR_REFUSED".into(),
            message: why,
        };
        return decline(child, stdin, cfg, outcome).await;
    }
    // protocol 1.1: the revision, features and frame limits agreed with this
    // hello are stated in the job; a job over the executor's limit is not sent
    let offer = wire::SupervisorOffer::new(cfg.max_frame_bytes);
    let job = &match wire::prepare_job(&hello, &offer, job) {
        Ok(job) => job,
        Err(e) => {
            warn!(error = %e, "protocol negotiation refused this executor; no job was sent");
            let outcome = Outcome::failed(e.code(), false, e.to_string());
            return decline(child, stdin, cfg, outcome).await;
        }
    };

    // a cancel or a lost lease that arrived during spawn and handshake: the
    // step is still only leased, so the job is never sent
    let before_job = control.borrow_and_update().control;
    if before_job != Control::Run {
        return decline(child, stdin, cfg, before_job_outcome(before_job)).await;
    }

    // --- the job
    write_frame(&mut stdin, &ToExecutor::Job(Box::new(job.clone()))).await;

    let silence = step.heartbeat_timeout_ms.filter(|&ms| ms > 0);
    let mut silence_at = silence.and_then(instant_in);
    let attempt_end = step.timeout_ms.and_then(instant_in);
    let deadline_at = step
        .deadline
        .and_then(|d| instant_in((d - Utc::now()).num_milliseconds()));

    let writer = Writer::spawn(shared.clone(), step.lease.clone(), control.clone());
    let mut fs = FrameState::default();
    let mut terminal: Option<Terminal> = None;
    // the outcome the supervisor imposes (timeout, cancel, lost lease, violation)
    let mut imposed: Option<Outcome> = None;
    let mut cancel_reason: Option<CancelReason> = None;
    let mut after_terminal_violation = false;
    let pid = child.pid;

    // --- phase 1: until a terminal, a violation, or a reason to stop.
    // Biased: control inputs first, frames last, so a chatty executor can
    // never starve a cancel, a timeout, the deadline or the shutdown.
    loop {
        let room = writer.has_room();
        tokio::select! {
            biased;
            _ = shared.abort.cancelled() => {
                imposed = Some(Outcome::Released { message: "the worker shut down while the attempt ran".into() });
                cancel_reason = Some(CancelReason::Shutdown);
                break;
            }
            c = until_stopped(control, budget) => {
                match c {
                    Control::Run => continue,
                    Control::Cancel => {
                        imposed = Some(Outcome::Cancelled { message: "cancelled on request".into() });
                        cancel_reason = Some(CancelReason::Requested);
                    }
                    Control::LeaseLost => {
                        imposed = Some(Outcome::Abandoned { why: "the lease was lost (or could not be renewed in time) while the executor ran".into() });
                        cancel_reason = Some(CancelReason::LeaseLost);
                    }
                }
                break;
            }
            _ = sleep_opt(deadline_at) => {
                imposed = Some(Outcome::failed("DEADLINE_EXCEEDED", false, "the step deadline passed during the attempt"));
                cancel_reason = Some(CancelReason::Deadline);
                break;
            }
            _ = sleep_opt(attempt_end) => {
                imposed = Some(Outcome::failed("ATTEMPT_TIMEOUT", true,
                    format!("the attempt ran past timeout_ms = {}", step.timeout_ms.unwrap_or(0))));
                cancel_reason = Some(CancelReason::AttemptTimeout);
                break;
            }
            _ = sleep_opt(silence_at) => {
                imposed = Some(Outcome::failed("HEARTBEAT_TIMEOUT", true,
                    format!("no frame from the executor for {} ms", silence.unwrap_or(0))));
                cancel_reason = Some(CancelReason::AttemptTimeout);
                break;
            }
            res = child.exited(), if !child.has_exited() => {
                if let Err(e) = res { error!(error = %e, "cannot watch the executor's exit"); }
                // its last frames may still be in the pipe: those before a
                // stream error count, then the error does
                let (rest, stream_error) = match drain_after_exit(frames).await {
                    Drained::Frames(v) => (v, None),
                    Drained::Error(v, e) => (v, Some(e)),
                };
                let mut rest = rest.into_iter();
                for f in rest.by_ref() {
                    match on_frame(&mut fs, job, pid, f) {
                        FrameVerdict::Continue => {}
                        FrameVerdict::Write(i) => writer.push_wait(redact_intent(redactor, i)).await,
                        FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                        FrameVerdict::Impose(o) => { imposed = Some(o); break; }
                    }
                }
                if terminal.is_some() && (rest.next().is_some() || stream_error.is_some()) {
                    warn!("frame after the terminal");
                    after_terminal_violation = true;
                } else if let (Some(e), None) = (stream_error, &imposed) {
                    let (code, msg) = wire_failure(&e);
                    warn!(error = %redactor.text(&e.to_string()), code, "protocol violation at exit");
                    imposed = Some(Outcome::failed(code, code == "EXECUTOR_CRASHED", msg));
                }
                break;
            }
            _ = writer.room(), if !room => {}
            frame = frames.next(), if room => {
                match frame {
                    None => break,
                    Some(Err(e)) => {
                        let (code, msg) = wire_failure(&e);
                        warn!(error = %redactor.text(&e.to_string()), stderr_tail = %redactor.text(&child.stderr().tail_string()), code, "protocol violation");
                        imposed = Some(Outcome::failed(code, code == "EXECUTOR_CRASHED", msg));
                        break;
                    }
                    Some(Ok(frame)) => {
                        if let Some(s) = silence { silence_at = instant_in(s); }
                        match on_frame(&mut fs, job, pid, FromExecutor::from(frame)) {
                            FrameVerdict::Continue => {}
                            FrameVerdict::Write(i) => writer.push(redact_intent(redactor, i)),
                            FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                            FrameVerdict::Impose(o) => { imposed = Some(o); break; }
                        }
                    }
                }
            }
        }
    }

    // --- phase 2: make sure the child is gone, then decide
    let mut reusable = false;
    if terminal.is_some() && imposed.is_none() && persistent && !child.has_exited() {
        // a persistent process: it waits for the next job (a frame written
        // between jobs is caught when the session is taken again)
        reusable = !after_terminal_violation;
    } else if terminal.is_some() && imposed.is_none() {
        // the job is done: no more jobs, the executor exits on EOF
        drop(stdin.take());
        match watch_after_terminal(child, frames, Duration::from_millis(cfg.cancel_grace_ms)).await
        {
            AfterTerminal::Clean => {}
            AfterTerminal::Violation(what) => {
                warn!(what = %redactor.text(&what), "frame after the terminal");
                after_terminal_violation = true;
            }
            AfterTerminal::StillRunning => {
                debug!("executor did not exit after its terminal; stopping it");
            }
        }
    } else if let Some(reason) = cancel_reason {
        // ask nicely (exactly one terminal is owed), then escalate
        let grace = Duration::from_millis(cfg.cancel_grace_ms);
        write_frame(
            &mut stdin,
            &ToExecutor::Cancel {
                job_id: job.job_id.clone(),
                reason,
                grace_ms: cfg.cancel_grace_ms.min(u32::MAX as u64) as u32,
                message: imposed.as_ref().map(|o| o.label()).unwrap_or_default(),
            },
        )
        .await;
        let until = Instant::now() + grace;
        let mut read = 0usize;
        loop {
            tokio::select! {
                biased;
                _ = tokio::time::sleep_until(until) => break,
                _ = child.exited(), if !child.has_exited() => break,
                frame = frames.next(), if read < EXIT_DRAIN_MAX_FRAMES * 16 => match frame {
                    Some(Ok(f)) => {
                        read += 1;
                        match on_frame(&mut fs, job, pid, FromExecutor::from(f)) {
                            FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                            // progress during the grace is best effort: a full
                            // queue drops it rather than delay the stop
                            FrameVerdict::Write(i) if writer.has_room() => writer.push(redact_intent(redactor, i)),
                            _ => {}
                        }
                    }
                    _ => break,
                },
            }
        }
        // a persistent process that answered a cancel (or an imposed
        // timeout) within its grace may serve again; one that did not is
        // killed and replaced
        let answered = terminal.is_some() && !child.has_exited();
        if persistent
            && answered
            && matches!(
                reason,
                CancelReason::Requested | CancelReason::AttemptTimeout | CancelReason::Deadline
            )
        {
            reusable = true;
        } else {
            drop(stdin.take());
            if terminal.is_some() && !child.has_exited() {
                let _ = wait_exit(child, grace).await;
            }
        }
    }
    if terminal.is_some() {
        session.jobs += 1;
    }
    let report = if reusable {
        session.stdin = stdin;
        session.reusable = true;
        None
    } else {
        drop(stdin);
        // SIGTERM → grace → SIGKILL to the group if the leader still runs;
        // always SIGKILL the group at the end (grandchildren), then reap.
        stop_child(&mut session.child, cfg).await
    };
    if let Some(r) = &report {
        debug!(status = %r.status, escalated = r.escalated_to_kill, stderr_bytes = r.stderr_total_bytes, "executor reaped");
    }
    let exit_text = report
        .as_ref()
        .map(|r| r.status.to_string())
        .unwrap_or_else(|| {
            if reusable {
                "still serving".into()
            } else {
                "unknown status".into()
            }
        });
    // the writer persists what it has (the terminal comes after its events)
    let valid_until = control.borrow().valid_until;
    writer
        .finish(valid_until.min(Instant::now() + DB_CALL_TIMEOUT))
        .await;

    let own_cancel = step.cancel_requested || control.borrow().control == Control::Cancel;
    if terminal.is_none() && imposed.is_none() {
        warn!(status = %exit_text, stderr_tail = %redactor.text(report.as_ref().map(|r| r.stderr_tail.as_str()).unwrap_or("")),
              "executor ended without a terminal");
    }
    match precedence(
        imposed,
        terminal,
        fs.accepted,
        own_cancel,
        after_terminal_violation,
        &exit_text,
    ) {
        Verdict::Outcome(o) => o,
        Verdict::Verify(r) => {
            verify_result(
                job,
                r,
                fs.accepted,
                cfg.max_artifact_bytes,
                cfg.max_result_bytes,
            )
            .await
        }
    }
}

/// Event messages are persisted: secrets handed to this attempt never are.
fn redact_intent(r: &Redact, i: Intent) -> Intent {
    match i {
        Intent::Start { pid, mut event } => {
            event.message = r.text(&event.message);
            event.checkpoint = event.checkpoint.map(|c| r.bytes(c));
            Intent::Start { pid, event }
        }
        Intent::Event(mut e) => {
            e.message = r.text(&e.message);
            e.checkpoint = e.checkpoint.map(|c| r.bytes(c));
            Intent::Event(e)
        }
    }
}

// ---------------------------------------------------------------------------
// commit

/// Commits an outcome, fenced by the lease (which stays in the renewal set
/// until this returns). Transient database errors are retried while the lease
/// clock says the lease can be valid; a lost lease discards the outcome; a
/// permanent error (the database will never take this outcome) commits a
/// terminal failure that names the cause instead, so the real cause is not
/// replaced by a `LEASE_EXPIRED` and the step is not run again for nothing.
async fn commit(
    shared: &Shared,
    step: &LeasedStep,
    outcome: Outcome,
    control: watch::Receiver<LeaseView>,
    redactor: &Redact,
) {
    let mut outcome = outcome;
    let mut delay = Duration::from_millis(50);
    loop {
        let valid_until = control.borrow().valid_until;
        let limit = valid_until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let res = bounded(
            limit,
            "committing an outcome",
            write_outcome(shared, step, &outcome),
        )
        .await;
        match res {
            Ok(()) => return,
            Err(DbError::LeaseLost { .. }) => {
                warn!(outcome = %outcome.label(), "lease lost before commit; the outcome is discarded (another owner or the reclaimer moved the step on)");
                return;
            }
            Err(e) if e.is_transient() => {
                if Instant::now() + delay >= valid_until {
                    error!(error = %e, outcome = %outcome.label(), "commit failed and the lease clock ran out; the step will be reclaimed");
                    return;
                }
                warn!(error = %e, "commit failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                let rejected =
                    matches!(&outcome, Outcome::Failed { code, .. } if code == "COMMIT_REJECTED");
                error!(error = %redactor.text(&e.to_string()), sqlstate = ?e.sqlstate(), outcome = %outcome.label(), "the database refused the outcome for good");
                if rejected {
                    return;
                }
                let cause: String = redactor
                    .text(&e.to_string())
                    .replace('\0', "\u{fffd}")
                    .chars()
                    .take(1000)
                    .collect();
                outcome = Outcome::failed(
                    "COMMIT_REJECTED",
                    false,
                    format!(
                        "the database refused to store this attempt's outcome ({}): {cause}",
                        outcome.label()
                    ),
                );
            }
        }
    }
}

async fn write_outcome(
    shared: &Shared,
    step: &LeasedStep,
    outcome: &Outcome,
) -> Result<(), DbError> {
    let lease = &step.lease;
    match outcome {
        Outcome::Succeeded {
            output,
            artifacts,
            sequence,
        } => shared
            .db
            .complete(lease, &shared.name, output, artifacts, Some(*sequence))
            .await
            .map(|_| ()),
        Outcome::Failed {
            code,
            message,
            retryable,
            details,
            next_retry_delay_ms,
            sequence,
        } => {
            let report = FailureReport {
                failure: Failure {
                    code: code.clone(),
                    retryable: *retryable,
                    next_retry_delay: next_retry_delay_ms.map(|ms| {
                        chrono::Duration::try_milliseconds(ms.min(i64::MAX as u64) as i64)
                            .unwrap_or(chrono::Duration::MAX)
                    }),
                },
                message: message.clone(),
                details: details.clone(),
                sequence: *sequence,
            };
            let d = shared
                .db
                .fail(lease, &shared.name, &report, rand::random())
                .await?;
            info!(to = %d.to, reason = %d.reason, "failure committed");
            Ok(())
        }
        Outcome::Cancelled { message } => {
            shared
                .db
                .confirm_cancelled(lease, &shared.name, message)
                .await
        }
        Outcome::Refused { code, message } => {
            let terminal = shared
                .db
                .refuse(
                    lease,
                    &shared.name,
                    code,
                    message,
                    Duration::from_millis(shared.cfg.refusal_delay_ms),
                    shared.cfg.max_refusals,
                )
                .await?;
            if terminal {
                warn!(code = %code, max_refusals = shared.cfg.max_refusals, "refused too often: the step failed");
            }
            Ok(())
        }
        Outcome::Released { message } => shared.db.release(lease, &shared.name, message).await,
        Outcome::Abandoned { why } => {
            warn!(%why, "outcome discarded: this worker no longer owns the step");
            Ok(())
        }
    }
}

fn new_event(e: &wire::Event) -> NewEvent<'_> {
    NewEvent {
        sequence: e.sequence,
        kind: e.kind.as_str(),
        message: &e.message,
        fraction: e.fraction,
        checkpoint: e.checkpoint.as_deref(),
        executor_at: chrono::DateTime::from_timestamp_millis(e.at_unix_ms)
            .filter(|_| e.at_unix_ms > 0),
    }
}

/// Turns a result into an outcome: the output must be JSON and every artifact
/// must be where the manifest says, with its size and hash.
/// Verifies a result off the runtime threads: reading and hashing artifacts
/// (up to `max_artifact_bytes` each) must not stall other attempts or the heartbeat.
async fn verify_result(
    job: &wire::Job,
    r: JobResult,
    accepted: bool,
    max_artifact_bytes: u64,
    max_result_bytes: u64,
) -> Outcome {
    let (out_dir, inputs) = (job.output_dir.clone(), job.input_artifacts.clone());
    let check = move || {
        finish_result(
            Path::new(&out_dir),
            &inputs,
            r,
            accepted,
            max_artifact_bytes,
            max_result_bytes,
        )
    };
    match tokio::task::spawn_blocking(check).await {
        Ok(outcome) => outcome,
        Err(e) => Outcome::failed(
            "ARTIFACT_INVALID",
            true,
            format!("verifying the result failed: {e}"),
        ),
    }
}

fn finish_result(
    out_dir: &Path,
    input_artifacts: &[wire::InputArtifact],
    r: JobResult,
    accepted: bool,
    max_artifact_bytes: u64,
    max_result_bytes: u64,
) -> Outcome {
    if !accepted {
        return Outcome::failed(
            "PROTOCOL_UNEXPECTED_FRAME",
            false,
            "a result before accepted",
        );
    }
    let output = if r.output.is_empty() {
        serde_json::Value::Null
    } else {
        match serde_json::from_slice(&r.output) {
            Ok(v) => v,
            Err(e) => {
                return Outcome::failed(
                    "OUTPUT_INVALID",
                    false,
                    format!("the result's output is not JSON: {e}"),
                )
            }
        }
    };
    if has_nul(&output) {
        return Outcome::failed(
            "OUTPUT_INVALID",
            false,
            "the result's output contains a NUL character (\\u0000), which cannot be stored",
        );
    }
    // all artifacts of one result travel to the database in one message:
    // their sum is capped below PostgreSQL's 1 GiB message limit
    let declared: u64 = r
        .artifacts
        .iter()
        .map(|m| m.size)
        .fold(0, u64::saturating_add);
    if declared > max_result_bytes {
        return Outcome::failed(
            "RESULT_TOO_LARGE",
            false,
            format!(
                "the result's artifacts declare {declared} bytes together; max_result_bytes is {max_result_bytes}"
            ),
        );
    }
    let mut total: u64 = 0;
    let inputs: std::collections::HashMap<&str, &wire::InputArtifact> =
        input_artifacts.iter().map(|a| (a.id.as_str(), a)).collect();
    let mut artifacts = Vec::with_capacity(r.artifacts.len());
    let mut names = std::collections::HashSet::new();
    for m in &r.artifacts {
        let rel = Path::new(&m.path);
        if [&m.name, &m.path, &m.media_type, &m.sha256]
            .iter()
            .any(|t| t.contains('\0'))
        {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!(
                    "artifact {:?}: a field contains a NUL character",
                    m.name.replace('\0', "\u{fffd}")
                ),
            );
        }
        if m.name.is_empty() || !names.insert(m.name.clone()) {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!("artifact name {:?} is empty or repeated", m.name),
            );
        }
        if m.path.is_empty()
            || rel.is_absolute()
            || rel.components().any(|c| !matches!(c, Component::Normal(_)))
        {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!(
                    "artifact {:?}: path {:?} must be relative to output_dir, without '..'",
                    m.name, m.path
                ),
            );
        }
        let full = out_dir.join(rel);
        let real = match std::fs::canonicalize(&full) {
            Ok(p) => p,
            Err(e) => {
                return Outcome::failed(
                    "ARTIFACT_INVALID",
                    false,
                    format!("artifact {:?}: {}: {e}", m.name, m.path),
                )
            }
        };
        let real_out = std::fs::canonicalize(out_dir).unwrap_or_else(|_| out_dir.to_owned());
        if !real.starts_with(&real_out) {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!("artifact {:?} escapes output_dir", m.name),
            );
        }
        // checked before reading: artifacts are held in memory and stored in PostgreSQL
        let on_disk = std::fs::metadata(&real).map(|m| m.len()).unwrap_or(0);
        if on_disk > max_artifact_bytes || m.size > max_artifact_bytes {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!(
                    "artifact {:?} has {} bytes; max_artifact_bytes is {max_artifact_bytes}",
                    m.name,
                    on_disk.max(m.size)
                ),
            );
        }
        total = total.saturating_add(on_disk);
        if total > max_result_bytes {
            return Outcome::failed(
                "RESULT_TOO_LARGE",
                false,
                format!(
                    "the result's artifacts hold more than max_result_bytes = {max_result_bytes} bytes together"
                ),
            );
        }
        let content = match std::fs::read(&real) {
            Ok(c) => c,
            Err(e) => {
                return Outcome::failed(
                    "ARTIFACT_INVALID",
                    false,
                    format!("artifact {:?}: {e}", m.name),
                )
            }
        };
        if content.len() as u64 != m.size {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!(
                    "artifact {:?}: manifest says {} bytes, file has {}",
                    m.name,
                    m.size,
                    content.len()
                ),
            );
        }
        let sha = hex::encode(Sha256::digest(&content));
        if !sha.eq_ignore_ascii_case(&m.sha256) {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                false,
                format!(
                    "artifact {:?}: sha256 mismatch (manifest {}, file {sha})",
                    m.name, m.sha256
                ),
            );
        }
        let mut derived = Vec::with_capacity(m.derived_from.len());
        for d in &m.derived_from {
            match inputs.get(d.as_str()).and_then(|a| Uuid::parse_str(&a.id).ok()) {
                Some(id) => derived.push(id),
                None => {
                    return Outcome::failed(
                        "ARTIFACT_INVALID",
                        false,
                        format!("artifact {:?} derives from {d:?}, which is not an input artifact of this step", m.name),
                    )
                }
            }
        }
        artifacts.push(NewArtifact {
            name: m.name.clone(),
            sha256: sha,
            media_type: if m.media_type.is_empty() {
                "application/octet-stream".into()
            } else {
                m.media_type.clone()
            },
            content,
            derived_from: derived,
        });
    }
    Outcome::Succeeded {
        output,
        artifacts,
        sequence: r.sequence,
    }
}

enum Drained {
    Frames(Vec<FromExecutor>),
    /// The frames before a stream error, and the error.
    Error(Vec<FromExecutor>, WireError),
}

/// After the leader exited: read what is left on stdout until EOF or until it
/// stays idle (a grandchild may hold the pipe open).
async fn drain_after_exit(frames: &mut Frames) -> Drained {
    let mut out = Vec::new();
    let until = Instant::now() + EXIT_DRAIN_MAX;
    loop {
        if out.len() >= EXIT_DRAIN_MAX_FRAMES || Instant::now() >= until {
            warn!(
                frames = out.len(),
                "stdout still busy after the executor exited; not reading further"
            );
            return Drained::Frames(out);
        }
        let idle = EXIT_DRAIN_IDLE.min(until.saturating_duration_since(Instant::now()));
        match tokio::time::timeout(idle, frames.next()).await {
            Ok(Some(Ok(f))) => out.push(FromExecutor::from(f)),
            Ok(Some(Err(e))) => return Drained::Error(out, e),
            Ok(None) | Err(_) => return Drained::Frames(out),
        }
    }
}

enum AfterTerminal {
    Clean,
    Violation(String),
    StillRunning,
}

/// After the terminal and EOF on stdin: the executor should exit, writing nothing more.
async fn watch_after_terminal(
    child: &mut Child,
    frames: &mut Frames,
    grace: Duration,
) -> AfterTerminal {
    if child.has_exited() {
        // the leader is gone; a grandchild may hold stdout open, so only drain
        return match drain_after_exit(frames).await {
            Drained::Frames(v) if v.is_empty() => AfterTerminal::Clean,
            Drained::Frames(v) => AfterTerminal::Violation(format!("a {} frame", v[0].name())),
            Drained::Error(_, e) => AfterTerminal::Violation(e.to_string()),
        };
    }
    let until = Instant::now() + grace;
    tokio::select! {
        biased;
        f = frames.next() => match f {
            Some(Ok(f)) => AfterTerminal::Violation(format!("a {} frame", FromExecutor::from(f).name())),
            Some(Err(e)) => AfterTerminal::Violation(e.to_string()),
            None => {
                // stdout closed; wait for the exit itself
                match tokio::time::timeout_at(until, child.exited()).await {
                    Ok(_) => AfterTerminal::Clean,
                    Err(_) => AfterTerminal::StillRunning,
                }
            }
        },
        _ = child.exited(), if !child.has_exited() => {
            match drain_after_exit(frames).await {
                Drained::Frames(v) if v.is_empty() => AfterTerminal::Clean,
                Drained::Frames(v) => AfterTerminal::Violation(format!("a {} frame", v[0].name())),
                Drained::Error(_, e) => AfterTerminal::Violation(e.to_string()),
            }
        }
        _ = tokio::time::sleep_until(until) => AfterTerminal::StillRunning,
    }
}

async fn wait_exit(child: &mut Child, grace: Duration) -> bool {
    if child.has_exited() {
        return true;
    }
    tokio::time::timeout(grace, child.exited()).await.is_ok()
}

/// Sends no job after all: asks the executor to shut down, gives it the
/// cancel grace to exit, stops what is left, and returns `outcome`.
async fn decline(
    child: &mut Child,
    mut stdin: Option<ChildStdin>,
    cfg: &crate::config::WorkerConfig,
    outcome: Outcome,
) -> Outcome {
    write_frame(
        &mut stdin,
        &ToExecutor::Shutdown {
            reason: outcome.label(),
        },
    )
    .await;
    drop(stdin);
    let _ = wait_exit(child, Duration::from_millis(cfg.cancel_grace_ms)).await;
    stop_now(child, cfg, outcome).await
}

/// Stops a child whose outcome is already known, then returns that outcome.
async fn stop_now(
    child: &mut Child,
    cfg: &crate::config::WorkerConfig,
    outcome: Outcome,
) -> Outcome {
    let _ = stop_child(child, cfg).await;
    outcome
}

/// SIGTERM to the group if the leader still runs, a grace, SIGKILL to the
/// group (always: grandchildren go too), reap. Signals the group before
/// reaping its leader, never after.
pub(crate) async fn stop_child(
    child: &mut Child,
    cfg: &crate::config::WorkerConfig,
) -> Option<crate::process::ExitReport> {
    let res = if child.has_exited() {
        kill_and_reap(child).await
    } else {
        if let Err(e) = child.signal_group(Signal::SIGTERM) {
            debug!(error = %e, "SIGTERM to the group failed");
        }
        let grace = Duration::from_millis(cfg.term_grace_ms);
        if tokio::time::timeout(grace, child.exited()).await.is_err() {
            warn!(
                pid = child.pid,
                "executor ignored SIGTERM; sending SIGKILL to its group"
            );
        }
        kill_and_reap(child).await
    };
    match res {
        Ok(r) => Some(r),
        Err(e) => {
            error!(error = %e, "cannot reap the executor");
            None
        }
    }
}

async fn kill_and_reap(
    child: &mut Child,
) -> Result<crate::process::ExitReport, crate::process::ProcessError> {
    if let Err(e) = child.signal_group(Signal::SIGKILL) {
        debug!(error = %e, "SIGKILL to the group failed");
    }
    child.reap().await
}

#[cfg(test)]
mod tests;
