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

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::{FutureExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn, Instrument};
use uuid::Uuid;

mod machine;

use machine::*;

use super::jobdir::JobDir;
use super::ledger::Pending;
use super::workdir::WorkDir;
use super::{Control, ExecutorRuntime, LeaseView, Shared, DB_CALL_TIMEOUT};
use crate::artifacts::{ArtifactStore, StoreError};
use crate::db::{
    bounded, CancelWrite, CheckpointEvent, CheckpointWrite, CompleteStoredWrite, CompleteWrite,
    DbError, EventsWrite, FailWrite, FailureReport, GiveBackWrite, Lease, LeasedStep, NewArtifact,
    OwnedEvent, RefuseWrite, ReleaseWrite, StartWrite,
};
use crate::process::{Child, StopStep};
use crate::state::Failure;
use crate::wire::{self, FromExecutor, HandshakeError, Hello, JobResult, ToExecutor, WireError};

/// After the leader exited, how long stdout may stay idle before we stop
/// reading (a grandchild may hold the pipe open, so EOF may never come) ...
const EXIT_DRAIN_IDLE: Duration = Duration::from_millis(150);
/// ... and its bound in time: a grandchild that keeps writing must not keep
/// the attempt open. The drain goes on past it until it has read as many
/// bytes as the pipe and the reader's buffer held when it began: all that
/// the leader wrote before it exited, its terminal among them. It stopped
/// at 1,024 frames: an SDK that exits right after its N-th job
/// (`max_jobs_per_process`) behind a burst of heartbeats had its result
/// (~1,100-1,450 small frames fill a 64 KiB pipe) thrown away and the step
/// recorded `EXECUTOR_CRASHED` (SDK audit).
const EXIT_DRAIN_MAX: Duration = Duration::from_secs(2);
/// How long an unfinished frame may sit on stdout, not growing, before the
/// worker says so (once per attempt): text printed to stdout reads as a frame
/// that never completes, and with no heartbeat timeout the step stayed
/// `running` for ever with nothing in the log (new developer's audit).
const STALL_WARN_AFTER: Duration = Duration::from_secs(10);
/// How often a grace looks whether its process is stopped by a signal (it
/// waits for no answer from one).
const STOP_CHECK: Duration = Duration::from_millis(100);
/// A frame begun whose bytes grew this recently is on its way, not stuck.
const FRAME_ARRIVING_WITHIN: Duration = Duration::from_millis(250);
/// A pipe's capacity when it cannot be asked (Linux's default).
const PIPE_CAPACITY_DEFAULT: u64 = 64 * 1024;
/// Intents queued between the attempt's loop and its writer task.
const WRITER_QUEUE: usize = 256;
/// Checkpoint bytes an attempt may have queued or in flight to the ledger
/// (not yet answered) before its loop stops reading frames, so that the
/// executor waits in its pipe (volume audit: four executors sending 7 MiB
/// checkpoints back to back took the worker to 548 MB).
const WRITER_QUEUE_BYTES: usize = 32 << 20;
/// ... and all the attempts of a worker together: the per-attempt bound let
/// each flooding attempt hold its own 32 MiB (and the copies around it), so
/// ten of them took a worker past a gigabyte. An attempt may always queue
/// while the worker is below this (one checkpoint may take it over), so the
/// ledger, which frees them, always has work and none waits for ever.
pub(crate) const WORKER_QUEUE_BYTES: usize = 64 << 20;

/// Checkpoint bytes of writes not yet answered: an attempt's, counted in
/// its worker's too (`parent`).
pub(crate) struct QueuedBytes {
    n: std::sync::atomic::AtomicUsize,
    freed: tokio::sync::Notify,
    limit: usize,
    parent: Option<Arc<QueuedBytes>>,
}

impl QueuedBytes {
    /// A worker's: every attempt's bytes, below `limit`.
    pub(crate) fn worker(limit: usize) -> QueuedBytes {
        QueuedBytes {
            n: Default::default(),
            freed: Default::default(),
            limit,
            parent: None,
        }
    }

    /// An attempt's, below `limit` and below its worker's.
    fn attempt(limit: usize, worker: Arc<QueuedBytes>) -> QueuedBytes {
        QueuedBytes {
            parent: Some(worker),
            ..QueuedBytes::worker(limit)
        }
    }

    fn below_own(&self) -> bool {
        self.n.load(std::sync::atomic::Ordering::Acquire) < self.limit
    }

    fn under_budget(&self) -> bool {
        self.below_own() && self.parent.as_ref().is_none_or(|p| p.below_own())
    }

    fn add(&self, n: usize) {
        self.n.fetch_add(n, std::sync::atomic::Ordering::AcqRel);
        if let Some(p) = &self.parent {
            p.add(n);
        }
    }

    fn free(&self, n: usize) {
        if n > 0 {
            self.n.fetch_sub(n, std::sync::atomic::Ordering::AcqRel);
            self.freed.notify_waiters();
            if let Some(p) = &self.parent {
                p.free(n);
            }
        }
    }

    /// Resolves once under budget (or at once if it is).
    async fn below_budget(&self) {
        loop {
            let own = self.freed.notified();
            tokio::pin!(own);
            own.as_mut().enable();
            let parent = self.parent.as_ref().map(|p| p.freed.notified());
            tokio::pin!(parent);
            if let Some(p) = parent.as_mut().as_pin_mut() {
                p.enable();
            }
            if self.under_budget() {
                return;
            }
            match parent.as_mut().as_pin_mut() {
                Some(p) => {
                    tokio::select! {
                        _ = own => {}
                        _ = p => {}
                    }
                }
                None => own.await,
            }
        }
    }
}

fn checkpoint_of(intent: &Intent) -> Option<&Vec<u8>> {
    match intent {
        Intent::Start { event, .. } | Intent::Event(event) => event.checkpoint.as_ref(),
    }
}

fn checkpoint_bytes(intent: &Intent) -> usize {
    checkpoint_of(intent).map_or(0, Vec::len)
}

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
    /// A started attempt ended by its process in a way that is not the
    /// step's doing (a warm process answering this job under its previous
    /// job's id): back to the queue at once, the attempt not counted, under
    /// `code` (`EXECUTOR_CRASHED`: the next attempt takes a process that
    /// served no job).
    GivenBack {
        code: String,
        message: String,
    },
    /// The lease is gone (or its clock ran out): nothing may be written.
    Abandoned {
        why: String,
    },
}

impl Outcome {
    /// The outcome with `note` added to its message: a failure's, a
    /// cancellation's or a release's (the others' messages are not stored).
    fn noted(mut self, note: &str) -> Outcome {
        match &mut self {
            Outcome::Failed { message, .. }
            | Outcome::Cancelled { message }
            | Outcome::Released { message }
            | Outcome::GivenBack { message, .. } => message.push_str(note),
            _ => {}
        }
        self
    }

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
            Outcome::GivenBack { code, .. } => format!("given back ({code})"),
            Outcome::Abandoned { .. } => "abandoned (lease lost)".into(),
        }
    }
}

/// Runs one attempt to the end and commits its outcome. A panic inside the
/// attempt fails it with `SUPERVISOR_PANIC` (its child is killed by `Child`'s
/// drop); the executor slot is given back once the outcome is known, the
/// caller's guard drops the lease once it is committed, whatever happens.
pub(crate) async fn run(
    shared: Arc<Shared>,
    exec: Arc<ExecutorRuntime>,
    step: LeasedStep,
    control: watch::Receiver<LeaseView>,
    slot: super::ExecSlot,
) {
    let started = Instant::now();
    let redactor = Arc::new(Redact::default());
    let mut handed = None;
    let outcome = match AssertUnwindSafe(execute(
        &shared,
        &exec,
        &step,
        control.clone(),
        redactor.clone(),
        slot,
        &mut handed,
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
    // execute gave the executor's slot back as soon as the executor was free
    // (or on any earlier return, or its unwinding); the lease stays in the
    // renewal set until this outcome commits
    let outcome = redactor.outcome(outcome);
    if let Outcome::Failed { code, message, .. } = &outcome {
        crate::metrics::attempt_failed(code);
        warn!(code = %code, error = %message, "the attempt failed");
    }
    let label = outcome.label();
    // from here the commit's own fence, not the heartbeat, says whether the
    // lease held: a heartbeat that no longer finds the step leased has most
    // likely raced this commit
    shared.committing(&step.lease);
    let recorded = commit(&shared, &step, outcome, handed, control, &redactor).await;
    if recorded == Recorded::GaveUp {
        shared
            .unrecorded
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    crate::metrics::attempt_finished(&step.kind, &label, started.elapsed());
    info!(outcome = %label, recorded = recorded.as_str(), elapsed_ms = started.elapsed().as_millis() as u64, "attempt finished");
}

/// The executor's stderr lines are logged through the attempt's redactor.
impl crate::process::RedactLine for Redact {
    fn redact_line(&self, line: &str) -> String {
        self.text(line)
    }
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
    /// Redacts every secret its process was handed, by this job or an
    /// earlier one (warned about once, when handed).
    fn widen(&self, handed: &[(String, String)]) {
        let r = crate::secrets::Redactor::from_pairs(
            handed.iter().map(|(n, v)| (n.as_str(), v.as_str())),
        );
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
            Outcome::GivenBack { code, message } => Outcome::GivenBack {
                code,
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
    slot: super::ExecSlot,
    handed: &mut Option<Handed>,
) -> Outcome {
    crate::fault::maybe_panic(&step.kind);
    if let Some(o) = too_late_to_start(step, &mut control) {
        return o;
    }
    if let Some(why) = &step.input_error {
        return Outcome::failed("INPUT_UNDECODABLE", false, why.clone());
    }
    let secrets = match resolve_secrets(shared, exec, step) {
        Ok(s) => s,
        Err(o) => return o,
    };
    redactor.set(&secrets);
    let mut workdir = match attempt_workdir(shared, exec, step) {
        Ok(d) => d,
        Err(o) => return o,
    };
    let out_dir = workdir.out().to_path_buf();
    let inputs = match materialize_inputs(shared, step, &mut workdir).await {
        Ok(v) => v,
        Err(o) => return o,
    };
    // a step whose last attempt or refusal crashed a process goes to one
    // that served no job, where a crash is its own and counts: given back
    // uncounted each time it crashed a warm process, a step that crashes
    // every process it meets went round for as long as other steps kept
    // the warm processes busy (re-check audit: 111 refusals in 2 minutes)
    let fresh = step.last_error.as_deref() == Some("EXECUTOR_CRASHED");
    let mut session = match session_for(shared, exec, step, &workdir, fresh, &mut control).await {
        Ok(s) => s,
        Err(o) => return o,
    };
    // a persistent process may echo what an earlier job of it was handed
    // (the redactor already covers this job's own)
    let ever_handed = session.hand_out(&secrets);
    if ever_handed.len() > secrets.len() {
        redactor.widen(ever_handed);
    }
    let job = job_for(step, inputs, &out_dir, secrets);
    let _stderr_log = session.child.log_stderr_here(redactor.clone());
    let conversed = converse(
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
    // done with the executor (stopped and reaped, or back in its pool): its
    // slot goes to the next job while this one's writes finish
    drop(slot);
    let outcome = match conversed {
        Conversed::Decided(o) => o,
        Conversed::Ran(ran) => {
            let (o, h) = conclude(shared, step, &job, *ran, &control, &redactor).await;
            *handed = Some(h);
            o
        }
    };
    // the job's directory goes with the attempt: never handed to another
    drop(workdir);
    outcome
}

/// An attempt that must not start: its step or run asked for a cancel, or
/// its deadline passed while it was leased.
fn too_late_to_start(
    step: &LeasedStep,
    control: &mut watch::Receiver<LeaseView>,
) -> Option<Outcome> {
    let view = *control.borrow_and_update();
    if step.cancel_requested || view.control == Control::Cancel {
        return Some(Outcome::Cancelled {
            message: "cancellation was requested before the attempt started".into(),
        });
    }
    deadline_passed(step, "started")
}

/// `DEADLINE_EXCEEDED` if the step's deadline has passed: the attempt is
/// not begun (`before`: what it did not get to do).
fn deadline_passed(step: &LeasedStep, before: &str) -> Option<Outcome> {
    let deadline = step.deadline.filter(|d| *d <= Utc::now())?;
    Some(Outcome::failed(
        "DEADLINE_EXCEEDED",
        false,
        format!(
            "the step deadline {deadline} passed before attempt {} {before}",
            step.lease.attempt()
        ),
    ))
}

/// [`deadline_passed`]'s outcome once the step's deadline passes (never
/// without a deadline).
async fn deadline_during(step: &LeasedStep, before: &str) -> Outcome {
    let Some(deadline) = step.deadline else {
        return std::future::pending().await;
    };
    loop {
        if let Some(o) = deadline_passed(step, before) {
            return o;
        }
        let left = (deadline - Utc::now()).to_std().unwrap_or_default();
        tokio::time::sleep(left + Duration::from_millis(1)).await;
    }
}

/// The attempt's own directory: out/ for results, in/ for input artifacts
/// (made only when there are any: most steps have none, and every directory
/// made and removed costs the filesystem an inode). A one-shot process runs
/// in it; a persistent executor's job gets one of its own too, never an
/// earlier job's (worker/jobdir.rs). Failing to make it is "this worker
/// can't", not the step's failure.
fn attempt_workdir(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
) -> Result<JobDir, Outcome> {
    let workdir = if exec.cfg.persistent {
        exec.job_dirs.take(&shared.work)
    } else {
        fresh_attempt_dir(&shared.work, step.lease.step_run_id()).map(JobDir::attempt)
    };
    workdir.map_err(|e| Outcome::Refused {
        code: "WORK_DIR_UNAVAILABLE".into(),
        message: format!(
            "cannot create a working directory in {}: {e}",
            shared.work.base().display()
        ),
    })
}

/// A job's id: its step and attempt, and a number this worker gives each
/// job it sends. The step and attempt alone are not unique: a refusal gives
/// its attempt number back, and the same step's next job on the same
/// persistent process had the id of the job the process had just refused,
/// whose frames are dropped as the previous job's: its answer was thrown
/// away, and the step hung or timed out (pool audit).
fn job_id(step: &LeasedStep) -> String {
    static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    format!("{}:{}:{n}", step.lease.step_run_id(), step.lease.attempt())
}

/// The job frame of this attempt (before protocol 1.1's agreement is added).
fn job_for(
    step: &LeasedStep,
    inputs: Vec<wire::InputArtifact>,
    out_dir: &Path,
    secrets: BTreeMap<String, String>,
) -> wire::Job {
    let now_ms = Utc::now().timestamp_millis();
    wire::Job {
        job_id: job_id(step),
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
    }
}

/// A warm process of a persistent executor, or a new one (a one-shot
/// process runs in the attempt's directory; a persistent one in its own).
/// `fresh`: a process that served no job (a new one, when the pool has none).
async fn session_for(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    workdir: &JobDir,
    fresh: bool,
    control: &mut watch::Receiver<LeaseView>,
) -> Result<Session, Outcome> {
    if exec.cfg.persistent {
        let mut taken = idle_session_for(shared, exec, step, fresh);
        if taken.is_none() && exec.cfg.warm_processes > 0 {
            // the keeper's start in flight is ready sooner than one of our
            // own; a cancel or a lost lease ends the wait, and the attempt
            // with it (re-check audit: a cancel waited for the keeper's
            // slow start, up to handshake_timeout_ms)
            let bound = Duration::from_millis(shared.cfg.handshake_timeout_ms);
            let stopped = async {
                while control.borrow().control == Control::Run {
                    if control.changed().await.is_err() {
                        // the worker forgot the lease: nothing will say more
                        std::future::pending::<()>().await;
                    }
                }
            };
            taken = exec
                .warm_starts
                .wait_for(&exec.pool, fresh, bound, stopped)
                .await;
            let now = control.borrow().control;
            if now != Control::Run {
                if let Some(s) = taken {
                    // back, unused by this job
                    exec.pool.put(s, &shared.cfg).await;
                }
                return Err(before_job_outcome(now));
            }
        }
        if let Some(mut s) = taken {
            debug!(pid = s.child.pid, jobs = s.jobs, "warm executor reused");
            if s.jobs.saturating_add(1) >= s.job_limit(exec.cfg.max_jobs_per_process) {
                // its last job: the keeper starts its replacement now
                s.last_job_mark = Some(exec.last_jobs.mark());
                exec.slot_back.notify_one();
            }
            return Ok(s);
        }
    }
    exec.start_process(shared, workdir.path(), "job")
        .await
        .map_err(start_failed)
}

/// An idle process of the pool whose hello offers the step. One whose hello
/// does not is out of date (the executor's routes are a later probe's, and
/// the step was leased by them) and is retired, not handed the job: it
/// refused it (EXECUTOR_REFUSED, counted toward `max_refusals`) while a new
/// process would have run it (audit 86: a probe process kept idle from a
/// narrowed hello refused a step after the executor offered its kind again).
fn idle_session_for(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    fresh: bool,
) -> Option<Session> {
    loop {
        let s = if fresh {
            exec.pool.take_unused()
        } else {
            exec.pool.take()
        }?;
        let offers = s.hello.as_ref().is_some_and(|h| {
            super::routing::check(h, &exec.cfg, &step.executor_kind, &step.kind, &step.labels)
                .is_ok()
        });
        if offers {
            return Some(s);
        }
        info!(
            pid = s.child.pid,
            "an idle executor process's hello does not offer this step (it is older than the executor's routes): retired, not handed the job"
        );
        let cfg = shared.cfg.clone();
        tokio::spawn(async move {
            s.retire(
                &cfg,
                "its hello does not offer what the executor is leased for now",
            )
            .await;
        });
    }
}

/// A new directory `durable-<step_run_id>-…` in `work_dir`, with an empty `out/`.
fn fresh_attempt_dir(work: &WorkDir, step_run_id: Uuid) -> std::io::Result<tempfile::TempDir> {
    let d = work.tempdir(&format!("durable-{step_run_id}-"))?;
    std::fs::create_dir(d.path().join("out"))?;
    Ok(d)
}

/// A process that could not be started is "this worker can't": a refusal
/// (not an attempt), so another worker may run the step, or this one once
/// it can. A session directory it cannot create is `WORK_DIR_UNAVAILABLE`;
/// a command it cannot start `SPAWN_FAILED` (and the executor's breaker
/// opens: see `breaker.rs`).
fn start_failed(e: StartError) -> Outcome {
    let code = match e {
        StartError::WorkDir { .. } => "WORK_DIR_UNAVAILABLE",
        StartError::Spawn(_) | StartError::NoPipes => "SPAWN_FAILED",
    };
    Outcome::Refused {
        code: code.into(),
        message: e.to_string(),
    }
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
        // (not its last job after all: the keeper counts it again)
        session.last_job_mark = None;
        exec.pool.put(session, &shared.cfg).await;
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

/// How long an attempt keeps trying to read its input artifacts' rows
/// through transient database errors before it gives the step back.
const INPUT_READ_PATIENCE: Duration = Duration::from_secs(60);
const INPUT_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(250);
const INPUT_RETRY_MAX_PAUSE: Duration = Duration::from_secs(5);

/// Streams the input artifacts from the artifact store to
/// `<inputs>/<step>/<name>` (the job directory's inputs, made for them),
/// chunk by chunk, checked against their size and sha256, read-only.
async fn materialize_inputs(
    shared: &Shared,
    step: &LeasedStep,
    workdir: &mut JobDir,
) -> Result<Vec<wire::InputArtifact>, Outcome> {
    if !step.has_dependencies {
        // no dependency, no input artifact: no query
        return Ok(Vec::new());
    }
    // a transient error (a lock held on the table, a connection lost) is
    // tried again for a while: given up at once, it was a refusal each time,
    // and five of them (a minute of an operator's lock) failed the run
    // EXECUTOR_REFUSED though no executor was ever asked
    let started = tokio::time::Instant::now();
    let mut pause = INPUT_RETRY_FIRST_PAUSE;
    let arts = loop {
        match bounded(
            DB_CALL_TIMEOUT,
            "reading input artifacts",
            shared.db.input_artifacts(step.run_id, &step.name),
        )
        .await
        {
            Ok(arts) => break arts,
            Err(e) if e.is_transient() && started.elapsed() + pause < INPUT_READ_PATIENCE => {
                warn!(error = %e, retry_in_ms = pause.as_millis() as u64,
                      "reading the input artifacts failed; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(INPUT_RETRY_MAX_PAUSE);
            }
            Err(e) => {
                return Err(Outcome::Refused {
                    code: "INPUT_UNAVAILABLE".into(),
                    message: format!("cannot read input artifacts: {e}"),
                })
            }
        }
    };
    if arts.is_empty() {
        return Ok(Vec::new());
    }
    // made now, for this job alone (0700)
    let in_dir = match workdir.make_inputs(&shared.work) {
        Ok(d) => d,
        Err(e) => {
            return Err(Outcome::Refused {
                code: "WORK_DIR_UNAVAILABLE".into(),
                message: format!(
                    "cannot make a directory for input artifacts in {}: {e}",
                    shared.work.base().display()
                ),
            })
        }
    };
    let in_dir = in_dir.as_path();
    let store = ArtifactStore::new(shared.db.clone(), &shared.cfg);
    let mut out = Vec::with_capacity(arts.len());
    let paths = input_paths(
        in_dir,
        arts.iter().map(|a| (a.step_name.as_str(), a.name.as_str())),
    );
    for (a, path) in arts.into_iter().zip(paths) {
        let dir = path.parent().unwrap_or(in_dir).to_path_buf();
        if let Err(e) = tokio::fs::create_dir_all(&dir).await {
            return Err(Outcome::Refused {
                code: "WORK_DIR_UNAVAILABLE".into(),
                message: format!("cannot write input artifact {}: {e}", a.name),
            });
        }
        if let Err(e) = store.copy_to_file(&a.blob, &path).await {
            let code = match e {
                StoreError::Write { .. } => "WORK_DIR_UNAVAILABLE",
                _ => "INPUT_UNAVAILABLE",
            };
            return Err(Outcome::Refused {
                code: code.into(),
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

/// Where each input artifact (step, name) is written, in order: a name and
/// step that need no sanitizing keep `in/<step>/<name>` whatever comes
/// before them (DAG audit: a real `x_y.txt` became `x_y~3.txt` behind `x
/// y.txt` and `x?y.txt`); the others get theirs by [`input_path`].
pub(super) fn input_paths<'a>(
    in_dir: &Path,
    inputs: impl Iterator<Item = (&'a str, &'a str)> + Clone,
) -> Vec<PathBuf> {
    let mut taken = std::collections::HashSet::new();
    let natural: Vec<Option<PathBuf>> = inputs
        .clone()
        .map(|(step, name)| {
            let path = in_dir.join(step).join(name);
            (sanitize(step) == step && sanitize(name) == name && taken.insert(path.clone()))
                .then_some(path)
        })
        .collect();
    inputs
        .zip(natural)
        .map(|((step, name), path)| {
            path.unwrap_or_else(|| input_path(in_dir, &mut taken, step, name))
        })
        .collect()
}

/// Where an input artifact is written: `in/<step>/<name>`, both sanitized
/// (see [`sanitize`]). Distinct names can sanitize alike (`x/y` and `x_y`,
/// `ü` and `é`), and so can step names; a path already `taken` by an
/// earlier input gets `~2`, `~3`… before its extension, so every input has
/// a file of its own (the job names each one's path).
pub(super) fn input_path(
    in_dir: &Path,
    taken: &mut std::collections::HashSet<PathBuf>,
    step_name: &str,
    name: &str,
) -> PathBuf {
    let dir = in_dir.join(sanitize(step_name));
    let file = sanitize(name);
    let mut path = dir.join(&file);
    let mut n = 1;
    while taken.contains(&path) {
        n += 1;
        let (stem, ext) = match file.rfind('.') {
            Some(i) if i > 0 => file.split_at(i),
            _ => (file.as_str(), ""),
        };
        path = dir.join(format!("{stem}~{n}{ext}"));
    }
    taken.insert(path.clone());
    path
}

/// The longest file name [`sanitize`] gives (bytes, all ASCII): well
/// under the 255 of common file systems, with room for the `~N` that tells
/// apart names that come out alike.
const MAX_FILE_NAME: usize = 200;

/// An extension longer than this is cut with the rest of the name.
const MAX_KEPT_EXTENSION: usize = 16;

pub(super) fn sanitize(name: &str) -> String {
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
    let s = if s.is_empty() || s.starts_with('.') {
        format!("_{s}")
    } else {
        s
    };
    if s.len() <= MAX_FILE_NAME {
        return s;
    }
    // a name the file system would refuse (ENAMETOOLONG) failed every step
    // downstream of the artifact: cut, keeping a short extension (the
    // characters are ASCII, so any byte is a boundary)
    let ext = match s.rfind('.') {
        Some(i) if i > 0 && s.len() - i <= MAX_KEPT_EXTENSION => &s[i..],
        _ => "",
    };
    format!("{}{ext}", &s[..MAX_FILE_NAME - ext.len()])
}

use super::session::{Frames, Session, StartError};

/// How long one frame may take to go into the child's stdin. A child that
/// does not read its stdin must not block the attempt's event loop.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Writes the job frame like [`write_frame`], but gives up (and closes
/// stdin) as soon as the attempt must stop: its time is up ([`Clocks`]), or
/// [`until_stopped`] (a cancel, a lost lease, the lease clock). The
/// conversation then ends the attempt as usual, within its graces.
async fn write_job(
    stdin: &mut Option<ChildStdin>,
    m: &ToExecutor,
    clocks: &Clocks,
    mut control: watch::Receiver<LeaseView>,
    budget: Duration,
) {
    let given_up = tokio::select! {
        _ = write_frame(stdin, m) => None,
        _ = sleep_opt(clocks.time_up()) => Some("the attempt's time ran out"),
        _ = until_stopped(&mut control, budget) => Some("the attempt was told to stop"),
    };
    if let Some(why) = given_up {
        warn!(
            why,
            "the job was not taken from the executor's stdin in time; closing it"
        );
        *stdin = None;
    }
}

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

// ---------------------------------------------------------------------------
// the writer: one task per attempt, the only one that writes its progress

/// The attempt's writer task and the bounded queue to it.
struct Writer {
    tx: mpsc::Sender<Intent>,
    task: tokio::task::JoinHandle<()>,
    /// intents queued (sent) so far
    pushed: u64,
    /// what the task has handed to the ledger (first tries, in order)
    handed: watch::Receiver<HandedSoFar>,
    /// checkpoint bytes queued and not yet answered
    bytes: Arc<QueuedBytes>,
    /// the newest checkpoint that found no room during a stop's grace: it
    /// is queued before anything later, or at the hand-off
    held: Option<Intent>,
}

/// What a writer task has handed to the ledger so far.
#[derive(Clone, Copy, Default)]
struct HandedSoFar {
    intents: u64,
    /// one of them carried a checkpoint (a write the ledger puts after a
    /// batch's completions: nothing may be handed behind it)
    checkpoint: bool,
}

/// A writer whose queue is closed and whose intents are all handed to the
/// ledger (their answers may still be on their way).
struct Handed {
    task: tokio::task::JoinHandle<()>,
    /// a success may be handed right behind these writes: the ledger
    /// writes a lease's start, its events and its completion in that order,
    /// in one batch or in batches one after the other
    completion_may_follow: bool,
}

impl Handed {
    /// Lets the writer persist what is queued, so events are stored before
    /// the terminal that follows them: for as long as the lease clock runs
    /// (renewals move it on). A fixed 10 s bound dropped the checkpoints of
    /// an attempt whose run row another transaction held past it, its lease
    /// renewed all along, and stored the outcome behind an older checkpoint
    /// (throughput-core audit).
    async fn finish(self, control: &watch::Receiver<LeaseView>) {
        let mut task = self.task;
        let mut control = control.clone();
        loop {
            let until = control.borrow_and_update().valid_until;
            tokio::select! {
                _ = &mut task => return,
                changed = control.changed() => {
                    if changed.is_err() {
                        break; // the worker forgot the lease: nothing renews it
                    }
                }
                _ = tokio::time::sleep_until(until) => break,
            }
        }
        warn!("progress writes did not finish before the lease clock ran out; the rest is dropped");
        task.abort();
    }
}

impl Writer {
    fn spawn(
        shared: Arc<Shared>,
        run_id: Uuid,
        lease: Lease,
        control: watch::Receiver<LeaseView>,
    ) -> Writer {
        let (tx, rx) = mpsc::channel(WRITER_QUEUE);
        let (handed_tx, handed) = watch::channel(HandedSoFar::default());
        let bytes = Arc::new(QueuedBytes::attempt(
            WRITER_QUEUE_BYTES,
            shared.checkpoint_bytes.clone(),
        ));
        let task = tokio::spawn(
            write_loop(shared, run_id, lease, rx, control, handed_tx, bytes.clone())
                .in_current_span(),
        );
        Writer {
            tx,
            task,
            pushed: 0,
            handed,
            bytes,
            held: None,
        }
    }

    /// Room for another intent: a free place in the queue, and the
    /// checkpoint bytes not yet answered under their budget. A writer that
    /// is gone (lease lost) always has room: what is pushed then is dropped.
    fn has_room(&self) -> bool {
        self.tx.is_closed() || (self.tx.capacity() > 0 && self.bytes.under_budget())
    }

    /// Resolves once [`Writer::has_room`] (never, if the writer is gone).
    async fn room(&self) {
        self.bytes.below_budget().await;
        match self.tx.reserve().await {
            Ok(permit) => drop(permit),
            Err(_) => std::future::pending().await,
        }
    }

    /// Queues an intent; the caller checked `has_room` (only this attempt sends).
    fn push(&mut self, intent: Intent) {
        let bytes = checkpoint_bytes(&intent);
        match self.tx.try_send(intent) {
            Ok(()) => {
                self.pushed += 1;
                self.bytes.add(bytes);
            }
            Err(e) => debug!(error = %e, "the writer is gone (lease lost); intent dropped"),
        }
    }

    /// Queues an intent if there is room, without waiting (progress during a
    /// stop's grace must not delay the stop). Plain progress without room is
    /// dropped; a checkpoint is held, the newest in place of an older, and
    /// queued before anything later or at the hand-off: the next attempt
    /// resumes from the last checkpoint reported (re-check audit: 435
    /// checkpoints reported in a timeout's grace were dropped, and the retry
    /// resumed from an older one).
    fn push_if_room(&mut self, intent: Intent) {
        if self.has_room() {
            if let Some(h) = self.held.take() {
                self.push(h);
            }
        }
        if self.has_room() {
            self.push(intent);
        } else if carries_checkpoint(&intent) {
            self.held = Some(intent);
        }
    }

    /// Queues an intent, waiting for room in the queue (after the child
    /// exited: nothing else needs the loop then; its bytes are not waited for).
    async fn push_wait(&mut self, intent: Intent) {
        let bytes = checkpoint_bytes(&intent);
        if self.tx.send(intent).await.is_ok() {
            self.pushed += 1;
            self.bytes.add(bytes);
        }
    }

    /// Closes the queue and waits (bounded by `until`) until every queued
    /// intent is handed to the ledger, not until it is answered: what is
    /// handed next is written after them. A writer that ended early (a lost
    /// lease) hands nothing more; nothing may follow it then.
    async fn hand_off(self, until: Instant) -> Handed {
        let Writer {
            tx,
            task,
            mut pushed,
            mut handed,
            held,
            bytes,
        } = self;
        if let Some(h) = held {
            let n = checkpoint_bytes(&h);
            bytes.add(n);
            match tokio::time::timeout_at(until, tx.send(h)).await {
                Ok(Ok(())) => pushed += 1,
                _ => bytes.free(n),
            }
        }
        drop(tx);
        let all = tokio::time::timeout_at(until, handed.wait_for(|h| h.intents >= pushed))
            .await
            .ok()
            .and_then(|r| r.ok().map(|h| *h));
        Handed {
            task,
            completion_may_follow: all.is_some_and(|h| !h.checkpoint),
        }
    }
}

fn carries_checkpoint(intent: &Intent) -> bool {
    checkpoint_of(intent).is_some()
}

/// One write of a queued run of intents, in order.
enum Write {
    Start(StartWrite),
    Plain(EventsWrite),
    /// A checkpoint rewrites the step row: a write of its own (in the
    /// ledger's batch, after the set-based part).
    Checkpointed(CheckpointWrite),
}

async fn write_loop(
    shared: Arc<Shared>,
    run_id: Uuid,
    lease: Lease,
    mut rx: mpsc::Receiver<Intent>,
    control: watch::Receiver<LeaseView>,
    handed_count: watch::Sender<HandedSoFar>,
    bytes: Arc<QueuedBytes>,
) {
    let mut buf = Vec::with_capacity(64);
    let mut h = Handing {
        shared: &shared,
        run_id,
        lease: &lease,
        pending: VecDeque::new(),
        count: handed_count,
        bytes,
    };
    let mut open = true;
    loop {
        if h.pending.is_empty() {
            // what was held back behind the start (below) goes first
            if buf.is_empty() && (!open || rx.recv_many(&mut buf, 64).await == 0) {
                return;
            }
            h.hand(&mut buf).await;
            continue;
        }
        // While a start's first try is in flight, what queues behind it (the
        // SDKs' RUNNING, early progress) is handed too: it lands in that
        // start's batch or the next one, and a success may follow it at once
        // (`Writer::hand_off`). Starts and plain events are idempotent and
        // fenced on a live lease, so their retries may land in any order;
        // nothing is handed behind a checkpoint (its retry must not land
        // after a later write), and after the start, what queues during a
        // write waits for it and is coalesced, as before. (A checkpoint
        // that arrives then is held back until the start is answered: its
        // fence needs the start, and nothing is received behind it.)
        let more =
            open && buf.is_empty() && h.pending.iter().any(|(w, ..)| matches!(w, Write::Start(_)));
        // no write outlives the lease clock: once it ran out the attempt is
        // abandoned, and a drain with the database away waited a pool
        // timeout (10 s) per write still queued, 50–70 s in all
        let until = control.borrow().valid_until;
        let next = match h.pending.front_mut().map(|(_, first, ..)| first) {
            Some(Ok(p)) => {
                tokio::select! {
                    biased;
                    n = rx.recv_many(&mut buf, 64), if more => Next::Queued(n),
                    answer = p.answer_mut() => Next::Answered(answer),
                    () = tokio::time::sleep_until(until) => Next::ClockRanOut,
                }
            }
            // a first try that could not be handed: its error is its answer
            Some(Err(_)) | None => Next::Answered(Ok(())),
        };
        match next {
            Next::ClockRanOut => {
                // a renewal may have moved the clock on meanwhile
                if Instant::now() >= control.borrow().valid_until {
                    warn!(
                        dropped = h.pending.len() + buf.len(),
                        "the lease clock ran out: the attempt's progress writes still waiting are dropped"
                    );
                    return;
                }
            }
            Next::Queued(0) => open = false,
            Next::Queued(_) if buf.iter().any(carries_checkpoint) => {}
            Next::Queued(_) => h.hand(&mut buf).await,
            Next::Answered(answer) => {
                let Some((w, first, bytes, handed_at)) = h.pending.pop_front() else {
                    continue;
                };
                h.bytes.free(bytes);
                let first = first.and(answer);
                let renews = matches!(w, Write::Checkpointed(_));
                match retry_if_transient(&shared, &control, w, first).await {
                    Ok(()) if renews => {
                        // the checkpoint renewed the lease from its
                        // transaction's start, after `handed_at`: the clock
                        // need not wait for a heartbeat to find the row free
                        // (re-check audit: 7 MiB checkpoints at the smallest
                        // margin the config allows ran it out)
                        let ttl = Duration::from_millis(shared.cfg.lease_ttl_ms);
                        shared.leases.renewed_by_write(&lease, handed_at + ttl);
                    }
                    Ok(()) => {}
                    Err(DbError::LeaseLost { .. }) => {
                        shared.lease_lost(&lease);
                        return;
                    }
                    Err(e) => {
                        error!(error = %e, "a progress write failed for good; it is dropped (the outcome is written on its own, and says so if it cannot be)")
                    }
                }
            }
        }
    }
}

/// What the writer waited for: more intents (0: the queue is closed), or
/// the answer of its oldest write in flight.
enum Next {
    /// The lease clock's end as it was when the wait began.
    ClockRanOut,
    Queued(usize),
    Answered(Result<(), DbError>),
}

/// The writer's first tries in flight: handed to the ledger, answered in
/// order.
struct Handing<'a> {
    shared: &'a Shared,
    run_id: Uuid,
    lease: &'a Lease,
    /// each first try with the checkpoint bytes freed once it is answered,
    /// and when it was handed
    pending: VecDeque<(Write, Result<Pending, DbError>, usize, Instant)>,
    /// what is handed so far (`Writer::hand_off` waits on it)
    count: watch::Sender<HandedSoFar>,
    bytes: Arc<QueuedBytes>,
}

impl Handing<'_> {
    /// Hands the first try of every write of `buf` to the ledger, in order:
    /// a start and the events right behind it (the SDKs' RUNNING) land in
    /// one batch, with no round trip of their own.
    async fn hand(&mut self, buf: &mut Vec<Intent>) {
        let ttl = Duration::from_millis(self.shared.cfg.lease_ttl_ms);
        let writes = plan_writes(buf, self.run_id, self.lease, ttl);
        let intents = buf.len() as u64;
        let checkpoint = buf.iter().any(carries_checkpoint);
        // the intents' bytes are freed with the last of their writes' answers
        let mut bytes: usize = buf.iter().map(checkpoint_bytes).sum();
        buf.clear();
        if writes.is_empty() {
            self.bytes.free(std::mem::take(&mut bytes));
        }
        let last = writes.len().saturating_sub(1);
        let handed_at = Instant::now();
        for (i, w) in writes.into_iter().enumerate() {
            let first = match &w {
                Write::Start(s) => self.shared.ledger.submit_start(s.clone()).await,
                Write::Plain(e) => self.shared.ledger.submit_events(e.clone()).await,
                Write::Checkpointed(c) => self.shared.ledger.submit_checkpoint(c.clone()).await,
            };
            let freed = if i == last {
                std::mem::take(&mut bytes)
            } else {
                0
            };
            self.pending.push_back((w, first, freed, handed_at));
        }
        self.count.send_modify(|h| {
            h.intents += intents;
            h.checkpoint |= checkpoint;
        });
    }
}

/// The writes of a run of queued intents, in order: each start alone, and
/// the events between two starts as one write (plain progress coalesced;
/// with a checkpoint among them, a checkpoint write).
fn plan_writes(buf: &[Intent], run_id: Uuid, lease: &Lease, ttl: Duration) -> Vec<Write> {
    let mut writes = Vec::new();
    let mut i = 0;
    while i < buf.len() {
        match &buf[i] {
            Intent::Start { pid, event } => {
                i += 1;
                writes.push(Write::Start(StartWrite {
                    run_id,
                    lease: lease.clone(),
                    pid: *pid,
                    event: owned_event(event),
                }));
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
                let kept = coalesce(&run);
                i = end;
                // only the last checkpoint is stored (the step row keeps
                // one); an earlier one's event says it carried one, and its
                // bytes are not copied along (volume audit: a write of a
                // few events of 7 MiB checkpoints held all of them, twice)
                let last_checkpoint = kept.iter().rposition(|e| e.checkpoint.is_some());
                writes.push(if let Some(last) = last_checkpoint {
                    Write::Checkpointed(CheckpointWrite {
                        lease: lease.clone(),
                        renew_for: ttl,
                        events: kept
                            .into_iter()
                            .enumerate()
                            .map(|(n, e)| CheckpointEvent {
                                event: owned_event(e),
                                checkpoint: if n == last {
                                    e.checkpoint.clone()
                                } else {
                                    e.checkpoint.as_ref().map(|_| Vec::new())
                                },
                            })
                            .collect(),
                    })
                } else {
                    Write::Plain(EventsWrite {
                        lease: lease.clone(),
                        events: kept.into_iter().map(owned_event).collect(),
                    })
                });
            }
        }
    }
    writes
}

/// A write's first answer, or, when that failed for a passing reason, the
/// answer of retrying it on its own while the lease allows.
async fn retry_if_transient(
    shared: &Arc<Shared>,
    control: &watch::Receiver<LeaseView>,
    w: Write,
    first: Result<(), DbError>,
) -> Result<(), DbError> {
    match (w, first) {
        (Write::Checkpointed(c), Err(e)) if e.is_transient() => {
            warn!(error = %e, "recording progress events failed; retrying");
            retrying(control, "recording progress events", || {
                shared.ledger.checkpoint(c.clone())
            })
            .await
        }
        (Write::Start(s), Err(e)) if e.is_transient() => {
            warn!(error = %e, "recording the start failed; retrying");
            retrying(control, "recording the start", || {
                shared.ledger.start(s.clone())
            })
            .await
        }
        (Write::Plain(ev), Err(e)) if e.is_transient() => {
            warn!(error = %e, "recording progress events failed; retrying");
            retrying(control, "recording progress events", || {
                shared.ledger.events(ev.clone())
            })
            .await
        }
        (_, r) => r,
    }
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
        // each try within what is left of the lease clock, too
        let left = control
            .borrow()
            .valid_until
            .saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DbError::Timeout {
                context: what,
                ms: 0,
            });
        }
        match bounded(DB_CALL_TIMEOUT.min(left), what, f()).await {
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

/// The executor's hello: the one a warm process said, or read now from a
/// new one (the executor speaks first). A cancel, a lost lease, the step's
/// deadline or the worker's abort during the read, or a failed read, stops
/// the child; the error is then the attempt's outcome.
async fn hello_of(
    shared: &Shared,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    session: &mut Session,
    control: &mut watch::Receiver<LeaseView>,
    redactor: &Redact,
) -> Result<Hello, Outcome> {
    if let Some(h) = &session.hello {
        return Ok(h.clone());
    }
    let cfg = &shared.cfg;
    let child = &mut session.child;
    let handshake = wire::read_hello(
        &mut session.frames,
        Duration::from_millis(cfg.handshake_timeout_ms),
    );
    let read = tokio::select! {
        biased;
        _ = shared.abort.cancelled() => {
            return Err(stop_now(child, cfg, Outcome::Released {
                message: "the worker shut down while the executor started; no job was sent".into(),
            }).await);
        }
        // a drain sends no job: the step goes back now, not once the
        // executor's hello comes (re-check audit: up to handshake_timeout_ms)
        _ = shared.draining.cancelled() => {
            return Err(stop_now(child, cfg, Outcome::Released {
                message: "the worker began to stop while the executor started; no job was sent".into(),
            }).await);
        }
        c = until_stopped(control, shared.stop_budget()) => {
            return Err(stop_now(child, cfg, before_job_outcome(c)).await);
        }
        // the deadline ends the start as a cancel does, not once the hello
        // came (time audit: a hello 8 s slow overshot a deadline by 7 s)
        o = deadline_during(step, "was sent (while its executor started)") => {
            return Err(stop_now(child, cfg, o).await);
        }
        r = handshake => r,
    };
    match read {
        Ok(h) => {
            session.hello = Some(h.clone());
            exec.process_started(shared);
            Ok(h)
        }
        Err(e) => {
            // no job was sent, and what ended it is not the step's (the job
            // comes after the hello; a banner printed before a crash is a
            // cut frame): a start that failed here, as a command that cannot
            // be run is — a refusal, and the executor's breaker opens
            // (resource audit: a process limit used a step's attempts in two
            // seconds). So is a process that gives no valid hello at all (none
            // within handshake_timeout_ms, another frame first, bytes that
            // are no frame): it counted as an attempt (HANDSHAKE_FAILED) and
            // one broken deploy failed the queue's steps in seconds, where
            // one that exited first paused the executor (third-party audit).
            // The raw bytes stay in the log.
            let gone = e.gone_before_hello();
            let msg = match &e {
                HandshakeError::Wire(w) => wire_failure(w).1,
                other => other.stored_message(),
            } + e.stdout_hint();
            let tail = one_line(&redactor.text(&child.stderr().tail_marked()));
            let what = if gone {
                "exited or closed its stdout before its hello"
            } else {
                "gave no valid hello"
            };
            // stopped first: how it ended is part of why (audit 86: an
            // exit code 3 with nothing on stderr was said nowhere)
            let how = super::how_it_ended(stop_child(child, cfg).await.as_ref(), "");
            warn!(error = %redactor.text(&e.to_string()), stderr_tail = %tail,
                  "the executor {what}{how}: it cannot be started here (SPAWN_FAILED)");
            exec.process_failed(
                shared,
                Duration::from_millis(cfg.refusal_delay_ms),
                &if tail.is_empty() {
                    format!("{msg}{how}")
                } else {
                    format!("{msg}{how} (stderr: {tail})")
                },
            );
            Err(Outcome::Refused {
                code: "SPAWN_FAILED".into(),
                message: format!(
                    "{msg}{how}: the executor could not be started here (the worker's log has its stderr)"
                ),
            })
        }
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
) -> Conversed {
    let hello = match hello_of(shared, exec, step, session, control, redactor).await {
        Ok(h) => h,
        Err(outcome) => return Conversed::Decided(outcome),
    };
    if session.jobs == 0 {
        // a new process: its hello may offer what a narrowed executor lost
        exec.widen_routes(shared, &hello);
    }
    let cfg = &shared.cfg;
    let budget = shared.stop_budget();
    let persistent = exec.cfg.persistent;
    let mut stdin = session.stdin.take();
    let child = &mut session.child;
    let frames = &mut session.frames;
    let reused = session.jobs > 0;

    let prepared = match negotiate_job(shared, exec, step, &hello, job, control) {
        Ok(prepared) => prepared,
        Err(outcome) => return Conversed::Decided(decline(child, stdin, cfg, outcome).await),
    };

    // --- the job
    // the job sent carries the agreement; what follows needs only its id and
    // directories, the same in `job`
    // the attempt's clocks start as the job is sent, not once it is written:
    // a child that does not read its stdin must not stretch them
    let clocks = Clocks::start(step, cfg.cancel_grace_ms, cfg.handshake_timeout_ms);
    let job_frame = ToExecutor::Job(Box::new(prepared));
    write_job(&mut stdin, &job_frame, &clocks, control.clone(), budget).await;
    let machine = Machine::new(
        &job.job_id,
        child.pid,
        persistent,
        Limits {
            timeout_ms: step.timeout_ms,
            silence_ms: clocks.silence,
        },
    )
    .reused(reused);
    let (previous, earlier) = super::session::sent(
        &mut session.last_job,
        &mut session.earlier_jobs,
        &job.job_id,
    );
    let machine = machine.after_jobs(previous, earlier);
    let writer = Writer::spawn(
        shared.clone(),
        step.run_id,
        step.lease.clone(),
        control.clone(),
    );
    let mut conv = Conversation {
        shared,
        child,
        frames,
        stdin,
        control,
        budget,
        redactor,
        writer,
        clocks,
        cancel_grace_ms: cfg.cancel_grace_ms,
        job_id: &job.job_id,
    };
    let (machine, finish) = conv.drive(machine).await;
    let Conversation { stdin, writer, .. } = conv;
    if machine.stale_frames() > 0 {
        warn!(
            pid = session.child.pid,
            frames = machine.stale_frames(),
            "the executor wrote frames of its previous job during this one (after that job's terminal): the process is replaced after this job"
        );
    }

    // --- keep the process, or make sure it is gone; then decide
    if machine.answered() {
        session.jobs += 1;
    }
    let (exit_text, stderr_tail) = release_process(session, stdin, &finish, cfg).await;
    Conversed::Ran(Box::new(Ran {
        machine,
        writer,
        exit_text,
        stderr_tail,
    }))
}

/// Whether this executor may be sent this job, and the job as sent: its
/// routes still offer the step, protocol 1.1's agreement with its hello
/// holds (the revision, features and frame limits are stated in the job),
/// and no cancel or lost lease arrived during spawn and handshake. The
/// outcome otherwise, with no job sent.
fn negotiate_job(
    shared: &Arc<Shared>,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    hello: &wire::Hello,
    job: &wire::Job,
    control: &mut watch::Receiver<LeaseView>,
) -> Result<wire::Job, Outcome> {
    let offer = wire::SupervisorOffer::new(shared.cfg.max_frame_bytes);
    if hello.protocol_version != wire::PROTOCOL_VERSION {
        // not a refusal (those are re-queued as no attempt): the binary
        // changed since its probe. No revision in common fails as below;
        // otherwise the hello itself is wrong (PROTOCOL.md: HANDSHAKE_FAILED)
        let out = match wire::prepare_job(hello, &offer, job) {
            Err(e) if e.code() == "PROTOCOL_VERSION_MISMATCH" => {
                exec.hello_changed(shared, "a process's hello says another protocol version");
                Outcome::failed(e.code(), false, e.to_string())
            }
            _ => Outcome::failed(
                "HANDSHAKE_FAILED",
                true,
                format!(
                    "the hello says protocol version {}, the supervisor speaks {}",
                    hello.protocol_version,
                    wire::PROTOCOL_VERSION
                ),
            ),
        };
        warn!("the executor's hello has another protocol version; no job was sent");
        return Err(out);
    }
    if let Err(why) = super::routing::check(
        hello,
        &exec.cfg,
        &step.executor_kind,
        &step.kind,
        &step.labels,
    ) {
        // the executor's binary may have changed since its probe, or this
        // one process is broken: a probe process says which, and its hello
        // gives the routes from then on (one process's hello never does:
        // one saying no kinds left the executor unleased for good)
        exec.hello_changed(shared, &why);
        warn!(%why, "executor refused before any job was sent; it is probed again before more is leased for it");
        return Err(Outcome::Refused {
            code: "EXECUTOR_REFUSED".into(),
            message: why,
        });
    }
    // a job over the executor's limit is not sent
    let prepared = wire::prepare_job(hello, &offer, job).map_err(|e| {
        warn!(error = %e, "protocol negotiation refused this executor; no job was sent");
        if e.code() == "PROTOCOL_VERSION_MISMATCH" {
            // the binary changed since its probe: nothing more is leased
            // for it until a probe process speaks a compatible version
            exec.hello_changed(
                shared,
                "a process's hello has no protocol revision in common",
            );
        }
        Outcome::failed(e.code(), false, e.to_string())
    })?;
    // the step is still only leased, so a stop now means the job is never sent
    let before_job = control.borrow_and_update().control;
    if before_job != Control::Run {
        return Err(before_job_outcome(before_job));
    }
    // nor once the worker began to drain while the executor started: the
    // job would start work after the stop signal, likely to be cut by the
    // drain's timeout (upgrade audit); another worker takes the step now
    if shared.draining.is_cancelled() || shared.abort.is_cancelled() {
        return Err(Outcome::Released {
            message: "the worker began to stop before the job was sent".into(),
        });
    }
    // nor is it once the deadline passed while the executor started or the
    // inputs were fetched: sent anyway, the handler ran past the deadline
    // and its result was thrown away, or even kept (retry audit)
    if let Some(o) = deadline_passed(
        step,
        "was sent (while its executor started or its inputs were fetched)",
    ) {
        return Err(o);
    }
    Ok(prepared)
}

/// After a job: keep the process for the next one (a clean end of a
/// persistent session), or make sure it is gone — SIGTERM → grace → SIGKILL
/// to the group if the leader still runs, always SIGKILL the group at the
/// end (grandchildren), then reap. The exit as text, and the stderr tail.
async fn release_process(
    session: &mut Session,
    stdin: Option<ChildStdin>,
    finish: &Finish,
    cfg: &crate::config::WorkerConfig,
) -> (String, String) {
    if finish.reusable {
        session.stdin = stdin;
        session.reusable = true;
        return ("still serving".into(), String::new());
    }
    drop(stdin);
    let child = &mut session.child;
    if finish.wait_exit_first {
        let _ = wait_exit(child, Duration::from_millis(cfg.cancel_grace_ms)).await;
    }
    let stopped = if finish.kill_at_once {
        kill_unanswered(child).await
    } else {
        stop_child(child, cfg).await
    };
    match stopped {
        Some(r) => {
            debug!(status = %r.status, escalated = r.escalated_to_kill, stderr_bytes = r.stderr_total_bytes, "executor reaped");
            // marked when cut at its start, for the redactor
            (r.status.to_string(), child.stderr().tail_marked())
        }
        None => ("unknown status".into(), String::new()),
    }
}

/// How a conversation with the executor ended: decided before any job ran
/// (a stop during the handshake, a refusal, a failed negotiation), or a job
/// that ran, whose outcome is concluded once the executor is free again.
enum Conversed {
    Decided(Outcome),
    Ran(Box<Ran>),
}

/// A job that ran: its machine, its writer, and how its process ended (kept
/// warm, or stopped and reaped).
struct Ran {
    machine: Machine,
    writer: Writer,
    exit_text: String,
    stderr_tail: String,
}

/// The outcome of a job that ran. It needs no executor: the slot is free by
/// now, so the next job starts while this one's writes finish (the terminal
/// is committed after them) and its result is verified.
async fn conclude(
    shared: &Arc<Shared>,
    step: &LeasedStep,
    job: &wire::Job,
    ran: Ran,
    control: &watch::Receiver<LeaseView>,
    redactor: &Redact,
) -> (Outcome, Handed) {
    let cfg = &shared.cfg;
    let Ran {
        machine,
        writer,
        exit_text,
        stderr_tail,
    } = ran;
    // the writer hands the ledger what it has; the terminal is committed
    // after those writes (handed behind them, or once they are answered)
    let valid_until = control.borrow().valid_until;
    let handed = writer
        .hand_off(valid_until.min(Instant::now() + DB_CALL_TIMEOUT))
        .await;

    let own_cancel = step.cancel_requested || control.borrow().control == Control::Cancel;
    if machine.ended_without_terminal() {
        warn!(status = %exit_text, stderr_tail = %one_line(&redactor.text(&stderr_tail)),
              "executor ended without a terminal");
    }
    let accepted = machine.accepted();
    let outcome = match machine.verdict(own_cancel, &exit_text) {
        Verdict::Outcome(o) => o,
        Verdict::Verify(r) => {
            let uploads = !r.artifacts.is_empty();
            let store = ArtifactStore::new(shared.db.clone(), cfg);
            let verify = verify_result(
                &store,
                (&shared.db, &step.lease),
                job,
                r,
                accepted,
                cfg.max_artifact_bytes,
                cfg.max_result_bytes,
            );
            // storing the artifacts is still the attempt's running time, not
            // its outcome's write: the drain's timeout and a second stop
            // signal end it as they stop an executor, and the step goes
            // back uncounted. A 1.28 GB upload ran 15 s past a drain's
            // timeout, past the stop budget the README gives a worker's
            // supervisor, and on a second signal the worker exited with the
            // step still `running`, charged LEASE_EXPIRED later (redeploy
            // audit). A result with no artifact (its output only checked)
            // is kept, also one answering the stop.
            tokio::select! {
                biased;
                o = verify => o,
                _ = shared.abort.cancelled(), if uploads => {
                    warn!("the worker stopped while this result's artifacts were being stored: the upload is abandoned and the step given back");
                    Outcome::Released {
                        message: "the worker stopped while the result's artifacts were being stored; the upload was abandoned".into(),
                    }
                }
            }
        }
    };
    (outcome, handed)
}

/// The timers of a running job.
struct Clocks {
    attempt_end: Option<Instant>,
    deadline_at: Option<Instant>,
    silence: Option<i64>,
    silence_at: Option<Instant>,
    grace: Duration,
    grace_until: Option<Instant>,
    /// A second stop signal ended the grace (or left none).
    grace_forced: bool,
    /// A drain of stdout in progress.
    drain: Option<Drain>,
    /// The next stall check: one timer for the attempt, reset as it fires
    /// (a fresh one per frame read was a timer-wheel entry per frame); the
    /// unfinished frame's bytes at the last check (0 after any input);
    /// whether the stall was said.
    stall_check: std::pin::Pin<Box<tokio::time::Sleep>>,
    stall_len: usize,
    stall_said: bool,
    /// The process was found stopped by the stall check, and it was said.
    stopped_said: bool,
    /// Until the job's first frame: when its silence means a stuck process
    /// (`handshake_timeout_ms` after the job is sent), and that bound.
    answer_at: Option<Instant>,
    answer_ms: u64,
}

/// The reading of stdout after the leader exited (see [`EXIT_DRAIN_MAX`]).
#[derive(Debug, Clone, Copy)]
struct Drain {
    /// Past this, the drain ends once `owed` bytes were read.
    until: Instant,
    /// The decoder's consumed bytes when the drain began.
    from: u64,
    /// What was written before the exit and not yet decoded, at most: the
    /// pipe's capacity and the reader's buffer.
    owed: u64,
}

impl Drain {
    /// Whether the drain may stop: past its time, with what was owed read.
    fn done(&self, consumed: u64, now: Instant) -> bool {
        now >= self.until && consumed.saturating_sub(self.from) >= self.owed
    }
}

/// The capacity of the pipe behind `fd` (F_GETPIPE_SZ; an executor may
/// have raised it), or Linux's default when it cannot be asked.
fn pipe_capacity(fd: std::os::fd::RawFd) -> u64 {
    // SAFETY: F_GETPIPE_SZ only reads the pipe's size; an fd that is not a
    // pipe gives -1 (EBADF/EINVAL), taken as the default
    let n = unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
    u64::try_from(n)
        .ok()
        .filter(|&n| n > 0)
        .unwrap_or(PIPE_CAPACITY_DEFAULT)
}

impl Clocks {
    /// The timers of `step`'s job, started now (as the job is sent).
    fn start(step: &LeasedStep, cancel_grace_ms: u64, answer_ms: u64) -> Clocks {
        let silence = step.heartbeat_timeout_ms.filter(|&ms| ms > 0);
        Clocks {
            answer_at: instant_in(answer_ms.min(i64::MAX as u64) as i64),
            answer_ms,
            attempt_end: step.timeout_ms.and_then(instant_in),
            deadline_at: step
                .deadline
                .and_then(|d| instant_in((d - Utc::now()).num_milliseconds())),
            silence,
            silence_at: silence.and_then(instant_in),
            grace: Duration::from_millis(cancel_grace_ms),
            grace_until: None,
            grace_forced: false,
            drain: None,
            stall_check: Box::pin(tokio::time::sleep(STALL_WARN_AFTER)),
            stall_len: 0,
            stall_said: false,
            stopped_said: false,
        }
    }

    /// When the attempt's time runs out: its timeout or its deadline.
    fn time_up(&self) -> Option<Instant> {
        [self.attempt_end, self.deadline_at]
            .into_iter()
            .flatten()
            .min()
    }
}

/// The driver of one attempt's machine: it owns the I/O (the child, its
/// pipes, the clocks, the writer) and only translates between it and the
/// pure `Machine`, which decides everything.
struct Conversation<'a> {
    shared: &'a Arc<Shared>,
    child: &'a mut Child,
    frames: &'a mut Frames,
    stdin: Option<ChildStdin>,
    control: &'a mut watch::Receiver<LeaseView>,
    budget: Duration,
    redactor: &'a Redact,
    writer: Writer,
    clocks: Clocks,
    cancel_grace_ms: u64,
    job_id: &'a str,
}

impl Conversation<'_> {
    /// Feeds the machine until it finishes; returns it with how to end.
    async fn drive(&mut self, mut machine: Machine) -> (Machine, Finish) {
        // a stream that broke (a malformed frame) left its rest in the
        // buffer: that is not a frame begun and never finished
        let mut broke = false;
        loop {
            let input = self.next_input(&machine).await;
            // the stall check compares two reads with no input between
            self.clocks.stall_len = 0;
            broke |= matches!(input, Input::StreamError { .. });
            // growing lately, and whether it is no text a print left (that
            // grows too, audit 95: a progress line printed every 200 ms)
            let growing = self
                .frames
                .decoder()
                .unchanged_for()
                .is_some_and(|d| d < FRAME_ARRIVING_WITHIN);
            let buffered = self.frames.read_buffer();
            machine.saw_unfinished(
                if broke { 0 } else { buffered.len() },
                growing,
                wire::may_begin_an_executor_frame(buffered),
            );
            machine.saw_binary(wire::looks_binary(buffered));
            if matches!(
                input,
                Input::Silent
                    | Input::AttemptTimedOut
                    | Input::Unanswered { .. }
                    | Input::GraceEnded
            ) {
                machine.saw_stopped(self.child.is_stopped());
            }
            let stale_before = machine.stale_frames();
            for action in machine.on(input) {
                if let Some(finish) = self.act(action).await {
                    if !broke {
                        self.log_unfinished_frame(machine.frame_cut_off());
                    }
                    if self.clocks.grace_forced {
                        // for the outcome's message (the verdict comes next)
                        machine.saw_no_grace();
                    }
                    return (machine, finish);
                }
            }
            if stale_before == 0 && machine.stale_frames() > 0 {
                // said as it happens: an executor answering this job with
                // the previous one's id leaves this one waiting, and the
                // warning came only once the job ended (third-party audit:
                // after a cancel 20 s later)
                warn!(
                    previous_job = machine.previous_job().unwrap_or_default(),
                    "the executor wrote a frame of its previous job during this one: it is dropped (is the executor answering this job with the previous one's job_id?)"
                );
            }
        }
    }

    /// The evidence of a frame begun and never completed when the attempt
    /// ends (at EOF the stream error shows it; a timeout, a cancel or a
    /// kill said nothing of it): most often text printed to stdout.
    /// A frame that was on its way when the job was stopped (`cut_off`)
    /// is the stop's doing, said as such (audit 93: a large checkpoint cut
    /// by a timeout's SIGTERM read as a print).
    fn log_unfinished_frame(&self, cut_off: bool) {
        let buffered = self.frames.read_buffer();
        if buffered.is_empty() {
            return;
        }
        if cut_off {
            info!(
                bytes = buffered.len(),
                "the stop cut off a frame the executor was writing"
            );
            return;
        }
        if wire::may_begin_an_executor_frame(buffered) {
            // a frame's start whose rest never came (audit 97)
            warn!(
                bytes = buffered.len(),
                first_bytes = %self.redactor.text(&wire::first_bytes(buffered, 64)),
                "the executor's stdout holds the start of a frame it never completed: it stopped writing in the middle of it"
            );
            return;
        }
        let what = if wire::looks_binary(buffered) {
            "bytes that never became a frame, neither text nor the start of one"
        } else {
            "a frame it never completed: did it print something there? stdout carries frames only (logs go to stderr)"
        };
        warn!(
            bytes = buffered.len(),
            first_bytes = %self.redactor.text(&wire::first_bytes(buffered, 64)),
            "the executor's stdout holds {what}"
        );
    }

    /// Waits for the next input the machine's phase listens to. Biased:
    /// control inputs first, frames last, so a chatty executor can never
    /// starve a cancel, a timeout, the deadline or the shutdown.
    async fn next_input(&mut self, machine: &Machine) -> Input {
        match machine.phase() {
            Phase::Running => self.running_input(machine).await,
            Phase::DrainingAfterExit | Phase::DrainingAfterTerminal => self.draining_input().await,
            Phase::AfterTerminal { .. } | Phase::Cancelling { .. } => {
                self.stopping_input(machine).await
            }
            Phase::Finished => Input::DrainEnded,
        }
    }

    /// While the job runs: control, clocks, the exit, then frames.
    async fn running_input(&mut self, machine: &Machine) -> Input {
        loop {
            let room = self.writer.has_room();
            let c = &mut self.clocks;
            tokio::select! {
                biased;
                _ = self.shared.abort.cancelled() => return Input::Abort,
                ctl = until_stopped(self.control, self.budget) => match ctl {
                    Control::Run => continue,
                    Control::Cancel => return Input::Cancel,
                    Control::LeaseLost => return Input::LeaseLost,
                },
                _ = sleep_opt(c.deadline_at) => return Input::DeadlinePassed,
                _ = sleep_opt(c.attempt_end) => return Input::AttemptTimedOut,
                _ = sleep_opt(c.silence_at) => return Input::Silent,
                _ = sleep_opt(c.answer_at) => {
                    c.answer_at = None;
                    return Input::Unanswered { after_ms: c.answer_ms };
                }
                res = self.child.exited(), if !machine.exited() => {
                    if let Err(e) = res { error!(error = %e, "cannot watch the executor's exit"); }
                    return Input::Exited;
                }
                // while it was not read, stdout could not move: the
                // stall check starts again
                _ = self.writer.room(), if !room => {
                    c.stall_len = 0;
                    continue;
                }
                _ = c.stall_check.as_mut(), if !c.stall_said => {
                    if let Some(stalled) = self.check_stall(room) {
                        return stalled;
                    }
                    continue;
                }
                frame = self.frames.next(), if room => {
                    let frame = frame.map(|r| r.map(FromExecutor::from));
                    // a frame of an earlier job neither answers this
                    // one nor keeps it alive: a process whose every
                    // frame for a job named the job before held the
                    // step leased for ever (re-check audit)
                    let stale = matches!(&frame, Some(Ok(f)) if machine.names_a_served_job(f));
                    if !stale {
                        if let (Some(Ok(_)), Some(s)) = (&frame, c.silence) {
                            c.silence_at = instant_in(s);
                        }
                        c.answer_at = None;
                    }
                    return self.frame_input(frame);
                }
            }
        }
    }

    /// The periodic look at a job that may not move: a stopped process is
    /// said once; a frame begun that did not grow while stdout was read is
    /// a stall (the machine decides what it costs).
    fn check_stall(&mut self, room: bool) -> Option<Input> {
        let c = &mut self.clocks;
        c.stall_check
            .as_mut()
            .reset(Instant::now() + STALL_WARN_AFTER);
        // said once: with no heartbeat_timeout_ms nothing else tells of a
        // job that cannot move (stop audit: 40 s and more without a line)
        if !c.stopped_said && self.child.is_stopped() {
            c.stopped_said = true;
            warn!(
                pid = self.child.pid,
                "the executor's process is stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger: the job cannot move until it is continued; its timeout_ms or heartbeat_timeout_ms, a cancel or the deadline still end it"
            );
        }
        let buffered = self.frames.read_buffer();
        // only while stdout was read (the writer had room) is a buffer that
        // did not grow a stall
        if room && !buffered.is_empty() && buffered.len() == c.stall_len {
            c.stall_said = true;
            let what = if wire::looks_binary(buffered) {
                "bytes that are neither text nor the start of a frame"
            } else {
                "did it print something there? stdout carries frames only (logs go to stderr)"
            };
            warn!(
                bytes = buffered.len(),
                first_bytes = %self.redactor.text(&wire::first_bytes(buffered, 64)),
                "the executor's stdout has held a frame that does not complete for {} s: {what}; a warm process's job that began answering goes back to the queue uncounted, any other waits for its timeout (heartbeat_timeout_ms)",
                STALL_WARN_AFTER.as_secs()
            );
            return Some(Input::Stalled {
                bytes: buffered.len(),
            });
        }
        c.stall_len = if room { buffered.len() } else { 0 };
        None
    }

    /// After the exit or the terminal: what is left in the pipe, briefly.
    async fn draining_input(&mut self) -> Input {
        let Some(drain) = self.clocks.drain else {
            return Input::DrainEnded;
        };
        let consumed = self.frames.decoder().consumed();
        if drain.done(consumed, Instant::now()) {
            warn!(
                bytes = consumed - drain.from,
                "stdout still busy after the executor exited; not reading further"
            );
            return Input::DrainEnded;
        }
        // what is in the pipe comes at once: a silence means the writers
        // are done (or a grandchild holds it, silent)
        match tokio::time::timeout(EXIT_DRAIN_IDLE, self.frames.next()).await {
            Ok(frame) => self.frame_input(frame),
            Err(_) => Input::DrainEnded,
        }
    }

    /// During a stop (a cancel's, or after the terminal): its grace, the
    /// exit, the first answer's bound, a stopped process, frames.
    async fn stopping_input(&mut self, machine: &Machine) -> Input {
        let reading = machine.wants_frames();
        let grace_until = self.clocks.grace_until;
        loop {
            tokio::select! {
                biased;
                _ = sleep_opt(grace_until) => return Input::GraceEnded,
                // a second stop signal ends a grace that runs
                _ = super::until_forced(), if grace_until.is_some() && !self.clocks.grace_forced => {
                    self.clocks.grace_forced = true;
                    return Input::GraceEnded;
                }
                res = self.child.exited(), if !machine.exited() => {
                    if let Err(e) = res { error!(error = %e, "cannot watch the executor's exit"); }
                    return Input::Exited;
                }
                // the first answer's bound runs on during a stop
                _ = sleep_opt(self.clocks.answer_at) => {
                    self.clocks.answer_at = None;
                    return Input::Unanswered { after_ms: self.clocks.answer_ms };
                }
                // a stopped process answers nothing within its grace: it
                // ends at once (re-check audit: a cancel of one waited the
                // whole grace)
                _ = tokio::time::sleep(STOP_CHECK), if !machine.exited() => {
                    if self.child.is_stopped() {
                        return Input::GraceEnded;
                    }
                }
                frame = self.frames.next(), if reading => return self.frame_input(frame),
            }
        }
    }

    fn frame_input<F>(&self, frame: Option<Result<F, WireError>>) -> Input
    where
        FromExecutor: From<F>,
    {
        match frame {
            None => Input::StdoutClosed,
            Some(Ok(f)) => Input::Frame(FromExecutor::from(f)),
            Some(Err(e)) => {
                let (code, message) = wire_failure(&e);
                warn!(error = %self.redactor.text(&e.to_string()), stderr_tail = %one_line(&self.redactor.text(&self.child.stderr().tail_marked())), code, "protocol violation");
                Input::StreamError { code, message }
            }
        }
    }

    /// Carries out one action; `Some` when the conversation is over.
    async fn act(&mut self, action: Action) -> Option<Finish> {
        match action {
            Action::Persist(i) => {
                let i = redact_intent(self.redactor, i);
                if self.writer.has_room() {
                    self.writer.push(i);
                } else {
                    self.writer.push_wait(i).await;
                }
            }
            Action::PersistIfRoom(i) => {
                self.writer.push_if_room(redact_intent(self.redactor, i));
            }
            Action::SendCancel { reason, message } => {
                write_frame(
                    &mut self.stdin,
                    &ToExecutor::Cancel {
                        job_id: self.job_id.to_owned(),
                        reason,
                        grace_ms: self.cancel_grace_ms.min(u32::MAX as u64) as u32,
                        message,
                    },
                )
                .await;
            }
            Action::CloseStdin => drop(self.stdin.take()),
            Action::ArmGrace => {
                // a second stop signal: no grace
                self.clocks.grace_forced = super::forced();
                let grace = if self.clocks.grace_forced {
                    Duration::ZERO
                } else {
                    self.clocks.grace
                };
                self.clocks.grace_until = Instant::now().checked_add(grace)
            }
            Action::StartDrain => {
                let capacity = pipe_capacity(self.frames.get_ref().as_raw_fd());
                self.clocks.drain = Some(Drain {
                    until: Instant::now() + EXIT_DRAIN_MAX,
                    from: self.frames.decoder().consumed(),
                    owed: capacity + self.frames.read_buffer().len() as u64,
                });
            }
            Action::Finish(f) => return Some(f),
        }
        None
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

/// What became of an attempt's outcome at its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recorded {
    /// The database took it.
    Yes,
    /// The database refused it for good and took a `COMMIT_REJECTED`
    /// failure that names the cause instead.
    Instead,
    /// Another owner or the reclaimer had moved the step on: not this
    /// attempt's to record.
    LeaseLost,
    /// The database did not take it while the lease was valid, or the lease
    /// could not be renewed in time (the attempt stopped on its own lease
    /// clock), or the database refused even the COMMIT_REJECTED failure:
    /// the step runs again elsewhere once its lease expires.
    GaveUp,
}

impl Recorded {
    fn as_str(self) -> &'static str {
        match self {
            Recorded::Yes => "yes",
            Recorded::Instead => "no: refused, COMMIT_REJECTED recorded instead",
            Recorded::LeaseLost => "no (lease lost)",
            Recorded::GaveUp => "no (gave up)",
        }
    }
}

/// Logs an outcome given up when the lease clock ran out, with why the tries
/// before the last failed when the last was only cut off by the clock.
fn gave_up(e: &DbError, earlier: Option<String>, outcome: &str, tried: Duration) {
    let tried_ms = tried.as_millis() as u64;
    match earlier {
        Some(earlier) => {
            error!(error = %e, earlier_tries = %earlier, outcome = %outcome, tried_ms, "commit failed and the lease clock ran out; the step will be reclaimed")
        }
        None => {
            error!(error = %e, outcome = %outcome, tried_ms, "commit failed and the lease clock ran out; the step will be reclaimed")
        }
    }
}

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
    handed: Option<Handed>,
    control: watch::Receiver<LeaseView>,
    redactor: &Redact,
) -> Recorded {
    let mut outcome = match to_record(outcome, &control) {
        Ok(o) => o,
        Err(lost) => return lost,
    };
    if let Some(h) = handed {
        if behind_progress(shared, step, &outcome, h, &control).await {
            crate::metrics::committed(&outcome.label());
            return Recorded::Yes;
        }
    }
    let mut delay = Duration::from_millis(50);
    let committing_since = Instant::now();
    // why the tries before the last failed, when the last was only cut
    // off by what was left of the lease clock (re-check audit: behind a
    // lock the give-up read "did not answer within 1000 ms", the lock
    // named by the retries alone)
    let mut earlier_cause: Option<String> = None;
    // the outcome is a COMMIT_REJECTED failure that replaced the attempt's own
    let mut instead = false;
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
            Ok(()) => {
                crate::metrics::committed(&outcome.label());
                return if instead {
                    Recorded::Instead
                } else {
                    Recorded::Yes
                };
            }
            Err(DbError::LeaseLost { .. }) => {
                crate::metrics::committed("abandoned (lease lost)");
                warn!(outcome = %outcome.label(), "lease lost before commit; the outcome is discarded (another owner or the reclaimer moved the step on)");
                return Recorded::LeaseLost;
            }
            Err(e) if e.is_transient() => {
                if Instant::now() + delay >= valid_until {
                    crate::metrics::committed("abandoned (lease clock ran out)");
                    // the last try's bound is in the error; how long the
                    // commit was tried in all is what says why (DB fault
                    // audit: "within 1000 ms" after 23 s of trying)
                    let earlier = earlier_cause.filter(|_| e.is_timeout());
                    gave_up(&e, earlier, &outcome.label(), committing_since.elapsed());
                    return Recorded::GaveUp;
                }
                warn!(error = %e, "commit failed; retrying");
                if !e.is_timeout() {
                    earlier_cause = Some(e.to_string());
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                error!(error = %redactor.text(&e.to_string()), sqlstate = ?e.sqlstate(), outcome = %outcome.label(), "the database refused the outcome for good");
                // even the COMMIT_REJECTED failure that replaced it
                if instead {
                    crate::metrics::committed("abandoned (commit rejected)");
                    return Recorded::GaveUp;
                }
                let cause: String = redactor
                    .text(&e.to_string())
                    .replace('\0', "\u{fffd}")
                    .chars()
                    .take(1000)
                    .collect();
                instead = true;
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

/// What [`commit`] records of `outcome`: itself, but for an abandoned
/// attempt: nothing when the database said its lease is gone
/// (`Err(LeaseLost)`), `LEASE_LOST` when it stopped on its own lease clock.
fn to_record(outcome: Outcome, control: &watch::Receiver<LeaseView>) -> Result<Outcome, Recorded> {
    let Outcome::Abandoned { why } = &outcome else {
        return Ok(outcome);
    };
    if control.borrow().control == Control::LeaseLost {
        // the database said the lease is gone (a renewal or a write
        // found it moved on)
        warn!(%why, "outcome discarded: this worker no longer owns the step");
        crate::metrics::committed(&outcome.label());
        return Err(Recorded::LeaseLost);
    }
    // this attempt stopped on its own lease clock: no renewal came in
    // time (the database did not answer, or this worker was paused). The
    // lease may well still be ours — after a pause shorter than the TTL
    // a renewal even lands as the worker wakes — and the step was then
    // left running with no process for up to one TTL more, and charged
    // LEASE_EXPIRED "for not renewing". If the database answers now, the
    // fenced write fails this attempt at once, retryably and counted as
    // the reclaim would; if not, the step is reclaimed when its lease
    // expires, as before
    warn!(%why, "the attempt stopped on its lease clock: recording it as LEASE_LOST if the database answers");
    crate::metrics::attempt_failed("LEASE_LOST");
    Ok(Outcome::failed(
        "LEASE_LOST",
        true,
        "this worker's lease clock ran out before a renewal came (the worker or its host was paused, or the database did not answer in time): the attempt was stopped before its lease could expire",
    ))
}

/// The first try of a success without artifacts, handed to the ledger right
/// behind the attempt's progress writes instead of after their answers: a
/// no-op job's start and completion then go in one flush, not two in a row.
/// The ledger writes a lease's start, events and completion in that order
/// (one batch, or batches one after the other), and a completion that finds
/// its step still leased writes the start with it (leased → running →
/// succeeded, one write), so the step's history is whole either way. Should
/// the start or events fail in a batch, the ledger does not write this
/// success but answers it with a transient error (it must not land ahead of
/// their retries, which would find the step finished and drop their events).
/// Every other outcome, and this one after any failure of its first try,
/// waits for the progress writes' answers and goes through the retrying
/// commit, as before. True when the success is committed.
async fn behind_progress(
    shared: &Shared,
    step: &LeasedStep,
    outcome: &Outcome,
    h: Handed,
    control: &watch::Receiver<LeaseView>,
) -> bool {
    let first = match outcome {
        Outcome::Succeeded {
            output,
            artifacts,
            sequence,
        } if artifacts.is_empty() && h.completion_may_follow => Some(
            shared
                .ledger
                .submit_complete_behind(complete_write(step, output, *sequence))
                .await,
        ),
        _ => None,
    };
    h.finish(control).await;
    match first {
        Some(Ok(pending)) => match pending.answer().await {
            Ok(()) => true,
            Err(e) => {
                debug!(error = %e, "the success handed behind the progress writes was not taken; committing it again");
                false
            }
        },
        _ => false,
    }
}

/// The write of a success without artifacts.
fn complete_write(step: &LeasedStep, output: &serde_json::Value, sequence: u64) -> CompleteWrite {
    CompleteWrite {
        run_id: step.run_id,
        lease: step.lease.clone(),
        output: output.clone(),
        sequence: Some(sequence),
    }
}

/// An executor's retry delay (ms) as a duration, saturated.
fn retry_delay(ms: u64) -> chrono::Duration {
    chrono::Duration::try_milliseconds(ms.min(i64::MAX as u64) as i64)
        .unwrap_or(chrono::Duration::MAX)
}

/// A refusal that ended its step says so (the usual one leaves it ready).
/// How many refusals of this kind a step may get: `max_refusals`, but for
/// refusals nothing of the step can have caused, for which a step is not
/// failed (they are still counted in `refusals`):
/// - a fault of this worker's host (an executor that cannot be started, a
///   work_dir that takes nothing), paced by the breakers (nothing is leased
///   while one is open; re-check audit: an executor that failed every other
///   start failed the first step in line EXECUTOR_REFUSED);
/// - `EXECUTOR_CRASHED`, a warm process that ended, or broke the protocol,
///   before its first frame for a job after serving an earlier one: what
///   the earlier job left (bytes written after its terminal) fell on a later
///   step, which ended EXECUTOR_REFUSED once such leftovers had met it
///   `max_refusals` times (re-check audit: 1 step in 30 with an executor
///   printing after every result). It cannot repeat for ever: the process
///   is replaced each time, and a job a fresh process takes is its first,
///   whose violations and crashes count as the attempt's.
fn refusals_allowed(code: &str, max_refusals: u32) -> u32 {
    if not_the_steps_doing(code) {
        i32::MAX as u32
    } else {
        max_refusals
    }
}

/// A refusal nothing of the step can have caused (see [`refusals_allowed`]):
/// it never fails the step, nor leaves it to other workers, nor counts
/// beside a later refusal that does (the same codes are left out of the
/// count in `db::writes`' `refuse`).
fn not_the_steps_doing(code: &str) -> bool {
    matches!(
        code,
        "SPAWN_FAILED" | "WORK_DIR_UNAVAILABLE" | "EXECUTOR_CRASHED"
    )
}

fn log_refusal_end(state: &str, code: &str, max_refusals: u32) {
    match state {
        "terminal_failed" => {
            warn!(code = %code, max_refusals, "refused too often: the step failed")
        }
        "cancelled" => {
            info!(code = %code, "refused after a cancel request: the step is cancelled")
        }
        _ => {}
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
        } => write_success(shared, step, output, artifacts, *sequence).await,
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
                    next_retry_delay: next_retry_delay_ms.map(retry_delay),
                },
                message: message.clone(),
                details: details.clone(),
                sequence: *sequence,
            };
            write_failure(shared, step, report).await
        }
        Outcome::Cancelled { message } => {
            shared
                .ledger
                .confirm_cancelled(CancelWrite {
                    lease: lease.clone(),
                    message: message.clone(),
                })
                .await
        }
        Outcome::Refused { code, message } => write_refusal(shared, step, code, message).await,
        Outcome::Released { message } => {
            shared
                .ledger
                .release(ReleaseWrite {
                    lease: lease.clone(),
                    message: message.clone(),
                })
                .await
        }
        Outcome::GivenBack { code, message } => {
            shared
                .ledger
                .give_back(GiveBackWrite {
                    lease: lease.clone(),
                    code: code.clone(),
                    message: message.clone(),
                })
                .await
        }
        // commit() never writes it (nothing may be written without the lease)
        Outcome::Abandoned { .. } => Ok(()),
    }
}

/// A success's write: plain, or with its artifacts' rows (stored by the
/// attempt before, attached here under the lease).
async fn write_success(
    shared: &Shared,
    step: &LeasedStep,
    output: &serde_json::Value,
    artifacts: &[NewArtifact],
    sequence: u64,
) -> Result<(), DbError> {
    if artifacts.is_empty() {
        return shared
            .ledger
            .complete(complete_write(step, output, sequence))
            .await;
    }
    shared
        .ledger
        .complete_stored(CompleteStoredWrite {
            lease: step.lease.clone(),
            output: output.clone(),
            artifacts: artifacts.to_vec(),
            sequence: Some(sequence),
        })
        .await
        .map(|_| ())
}

/// A refusal's write: the database decides back to the queue after
/// `refusal_delay_ms` or ended (`max_refusals`, a cancel request); the
/// worker wakes its leasing when it is due, and leaves the step to other
/// workers when the refusal says this one cannot run it.
async fn write_refusal(
    shared: &Shared,
    step: &LeasedStep,
    code: &str,
    message: &str,
) -> Result<(), DbError> {
    if code == "WORK_DIR_UNAVAILABLE" {
        shared.work_dir_failed(message);
    }
    let state = shared
        .ledger
        .refuse(RefuseWrite {
            lease: step.lease.clone(),
            code: code.to_owned(),
            message: message.to_owned(),
            delay: Duration::from_millis(shared.cfg.refusal_delay_ms),
            max_refusals: refusals_allowed(code, shared.cfg.max_refusals),
        })
        .await?;
    log_refusal_end(&state, code, shared.cfg.max_refusals);
    if state == "retryable_failed" {
        // leasable again after the refusal's delay (by the database's
        // clock; a little late here is a little late for all)
        let due = Utc::now() + retry_delay(shared.cfg.refusal_delay_ms);
        shared.due_at(&step.executor_kind, due);
    }
    // a warm process that died between jobs is no reason to leave
    // the step to others, nor is a host fault: its breaker keeps
    // this worker from leasing for the executor until a probe
    // starts one (other workers take the step meanwhile), and a
    // persistent executor's probe process waits in the pool for
    // the next job; held off past the pool's idle_timeout_ms (5 s
    // at least), the step came back after the probe was retired
    // and met a failing start again, for ever (re-check audit).
    // Any other refusal says this worker can't.
    if !not_the_steps_doing(code) {
        shared.leave_to_others(step.lease.step_run_id());
    }
    Ok(())
}

/// A failure's write: the database decides retry or terminal (the state
/// machine's decision, applied under the lease), and the metrics and the log
/// say which.
async fn write_failure(
    shared: &Shared,
    step: &LeasedStep,
    report: FailureReport,
) -> Result<(), DbError> {
    let lease = &step.lease;
    let d = shared
        .ledger
        .fail(FailWrite {
            lease: lease.clone(),
            report,
            jitter: rand::random(),
        })
        .await?;
    crate::metrics::failure_decided(d.to.as_str());
    info!(to = %d.to, reason = %d.reason, "failure committed");
    if let Some(at) = d.next_attempt_at {
        shared.due_at(&step.executor_kind, at);
    }
    Ok(())
}

/// An executor's text as one log line: line breaks and other control
/// characters escaped (`\n`, `\u{1b}`), so that a child's stderr cannot
/// forge log lines of its own or drive the terminal of whoever reads them.
fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if crate::terminal::is_unsafe(c) && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn owned_event(e: &wire::Event) -> OwnedEvent {
    OwnedEvent {
        sequence: e.sequence,
        kind: e.kind.as_str(),
        message: e.message.clone(),
        fraction: e.fraction,
        executor_at: chrono::DateTime::from_timestamp_millis(e.at_unix_ms)
            .filter(|_| e.at_unix_ms > 0),
    }
}

/// Outputs up to this size, of results without artifacts, are checked on the
/// runtime's thread (`verify_result`).
const INLINE_RESULT_CHECK_BYTES: usize = 64 * 1024;

/// Turns a result into an outcome: the output must be JSON and every artifact
/// must be where the manifest says (`finish_result`, off the runtime threads
/// unless there is no artifact and the output is small), then each artifact
/// streams into the artifact store, its size and sha256 checked against the
/// manifest on the way (`ARTIFACT_DIGEST_MISMATCH` otherwise; nothing of it
/// stays stored). The commit then only references the stored blobs.
async fn verify_result(
    store: &ArtifactStore,
    (db, lease): (&crate::db::Db, &Lease),
    job: &wire::Job,
    r: JobResult,
    accepted: bool,
    max_artifact_bytes: u64,
    max_result_bytes: u64,
) -> Outcome {
    // no artifact (nothing on disk to check) and a small output: checked
    // here, as parsing a few KiB of JSON costs less than the hand-off to
    // the blocking pool (~9 % of the worker's CPU at 64 no-op jobs at once)
    let inline = r.artifacts.is_empty() && r.output.len() <= INLINE_RESULT_CHECK_BYTES;
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
    let checked = if inline {
        Ok(check())
    } else {
        tokio::task::spawn_blocking(check).await
    };
    let checked = match checked {
        Ok(Ok(c)) => c,
        Ok(Err(outcome)) => return outcome,
        Err(e) => {
            return Outcome::failed(
                "ARTIFACT_INVALID",
                true,
                format!("verifying the result failed: {e}"),
            )
        }
    };
    let mut artifacts = checked.artifacts;
    for (a, (path, declared_sha)) in artifacts.iter_mut().zip(checked.files) {
        // pinned first, so no removal can take the bytes between their
        // upload (or claim) and this attempt's commit (faults audit)
        if let Err(e) = db.pin_blob(&declared_sha.to_ascii_lowercase(), lease).await {
            return Outcome::failed(
                "ARTIFACT_STORE_FAILED",
                true,
                format!("artifact {:?}: pinning its bytes failed: {e}", a.name),
            );
        }
        match store
            .put_file(&a.name, &path, a.size.max(0) as u64, &declared_sha)
            .await
        {
            Ok(sha) => a.sha256 = sha,
            Err(e) if e.is_mismatch() => {
                return Outcome::failed("ARTIFACT_DIGEST_MISMATCH", false, e.to_string())
            }
            Err(e @ StoreError::Read { .. }) => {
                return Outcome::failed("ARTIFACT_INVALID", false, e.to_string())
            }
            Err(e) => {
                return Outcome::failed(
                    "ARTIFACT_STORE_FAILED",
                    true,
                    format!("artifact {:?}: storing it failed: {e}", a.name),
                )
            }
        }
    }
    Outcome::Succeeded {
        output: checked.output,
        artifacts,
        sequence: checked.sequence,
    }
}

/// A result whose output and manifest passed the checks; its files are not
/// read yet.
struct Checked {
    output: serde_json::Value,
    /// The artifacts as the commit will name them (`sha256` is replaced by
    /// the stored digest once uploaded).
    artifacts: Vec<NewArtifact>,
    /// Per artifact: the file and the manifest's sha256.
    files: Vec<(std::path::PathBuf, String)>,
    sequence: u64,
}

fn finish_result(
    out_dir: &Path,
    input_artifacts: &[wire::InputArtifact],
    r: JobResult,
    accepted: bool,
    max_artifact_bytes: u64,
    max_result_bytes: u64,
) -> Result<Checked, Outcome> {
    if !accepted {
        return Err(Outcome::failed(
            "PROTOCOL_UNEXPECTED_FRAME",
            false,
            "a result before accepted",
        ));
    }
    let output = result_output(&r.output)?;
    // all artifacts of one result together are capped (storage, not memory:
    // each streams to the artifact store)
    let declared: u64 = r
        .artifacts
        .iter()
        .map(|m| m.size)
        .fold(0, u64::saturating_add);
    if declared > max_result_bytes {
        return Err(Outcome::failed(
            "RESULT_TOO_LARGE",
            false,
            format!(
                "the result's artifacts declare {declared} bytes together; max_result_bytes is {max_result_bytes}"
            ),
        ));
    }
    if r.artifacts.is_empty() {
        // most results: nothing on disk to check (no path to resolve)
        return Ok(Checked {
            output,
            artifacts: Vec::new(),
            files: Vec::new(),
            sequence: r.sequence,
        });
    }
    let inputs: std::collections::HashMap<&str, &wire::InputArtifact> =
        input_artifacts.iter().map(|a| (a.id.as_str(), a)).collect();
    let real_out = std::fs::canonicalize(out_dir).unwrap_or_else(|_| out_dir.to_owned());
    let mut total: u64 = 0;
    let mut artifacts = Vec::with_capacity(r.artifacts.len());
    let mut files = Vec::with_capacity(r.artifacts.len());
    let mut names = std::collections::HashSet::new();
    for m in &r.artifacts {
        artifact_fields(m, &mut names)?;
        let (real, on_disk) = artifact_file(out_dir, &real_out, m, max_artifact_bytes)?;
        total = total.saturating_add(on_disk);
        if total > max_result_bytes {
            return Err(Outcome::failed(
                "RESULT_TOO_LARGE",
                false,
                format!(
                    "the result's artifacts hold more than max_result_bytes = {max_result_bytes} bytes together"
                ),
            ));
        }
        // a file that is not what the manifest says is refused before a
        // byte is uploaded; the digest is checked while streaming
        if on_disk != m.size {
            return Err(Outcome::failed(
                "ARTIFACT_DIGEST_MISMATCH",
                false,
                format!(
                    "artifact {:?}: manifest says {} bytes, file has {on_disk}",
                    m.name, m.size
                ),
            ));
        }
        let derived = derived_ids(m, &inputs)?;
        files.push((real, m.sha256.clone()));
        artifacts.push(new_artifact(m, derived));
    }
    Ok(Checked {
        output,
        artifacts,
        files,
        sequence: r.sequence,
    })
}

/// The ids of the input artifacts an artifact derives from; each name must
/// be an input of this step.
fn derived_ids(
    m: &wire::ManifestEntry,
    inputs: &std::collections::HashMap<&str, &wire::InputArtifact>,
) -> Result<Vec<Uuid>, Outcome> {
    m.derived_from
        .iter()
        .map(|d| {
            inputs
                .get(d.as_str())
                .and_then(|a| Uuid::parse_str(&a.id).ok())
                .ok_or_else(|| {
                    artifact_invalid(format!(
                        "artifact {:?} derives from {d:?}, which is not an input artifact of this step",
                        m.name
                    ))
                })
        })
        .collect()
}

/// The artifact row of a checked manifest entry.
fn new_artifact(m: &wire::ManifestEntry, derived_from: Vec<Uuid>) -> NewArtifact {
    NewArtifact {
        name: m.name.clone(),
        sha256: m.sha256.to_ascii_lowercase(),
        size: i64::try_from(m.size).unwrap_or(i64::MAX),
        media_type: if m.media_type.is_empty() {
            "application/octet-stream".into()
        } else {
            m.media_type.clone()
        },
        derived_from,
    }
}

fn artifact_invalid(message: String) -> Outcome {
    Outcome::failed("ARTIFACT_INVALID", false, message)
}

/// The result's output: JSON (empty is null) that PostgreSQL can store.
fn result_output(raw: &[u8]) -> Result<serde_json::Value, Outcome> {
    let output = if raw.is_empty() {
        serde_json::Value::Null
    } else {
        crate::json::parse_bounded(raw, crate::json::MAX_VALUE_DEPTH).map_err(|e| {
            Outcome::failed(
                "OUTPUT_INVALID",
                false,
                format!("the result's output is not JSON the runtime can store: {e}"),
            )
        })?
    };
    // stored, the last value of such a key would stand without a word
    // (audit 94: `{"a":1,"a":2}` became `{"a":2}`); a spec is refused alike
    if let Some(dup) = crate::json::duplicate_key(raw) {
        return Err(Outcome::failed(
            "OUTPUT_INVALID",
            false,
            format!(
                "the result's output gives a key twice in one object ({dup}): stored, only its last value would be kept"
            ),
        ));
    }
    match crate::json::unstorable(&output, "output") {
        None => {}
        Some((_, crate::json::Unstorable::Nul)) => {
            return Err(Outcome::failed(
                "OUTPUT_INVALID",
                false,
                "the result's output contains a NUL character (\\u0000), which cannot be stored",
            ))
        }
        Some((path, crate::json::Unstorable::Number(number))) => {
            return Err(Outcome::failed(
                "OUTPUT_INVALID",
                false,
                format!(
                    "the result's {path} is the number {}, which PostgreSQL's numeric \
                     cannot hold (at most 131072 digits before the point and 16383 after it): \
                     return it as a string",
                    crate::json::short(&number)
                ),
            ))
        }
    }
    Ok(output)
}

/// A manifest entry's fields can be stored (no NUL) and its name is given
/// and not one of an earlier entry (`names`).
fn artifact_fields<'m>(
    m: &'m wire::ManifestEntry,
    names: &mut std::collections::HashSet<&'m str>,
) -> Result<(), Outcome> {
    if [&m.name, &m.path, &m.media_type, &m.sha256]
        .iter()
        .any(|t| t.contains('\0'))
    {
        return Err(artifact_invalid(format!(
            "artifact {:?}: a field contains a NUL character",
            m.name.replace('\0', "\u{fffd}")
        )));
    }
    if m.name.is_empty() || !names.insert(m.name.as_str()) {
        return Err(artifact_invalid(format!(
            "artifact name {:?} is empty or repeated",
            m.name
        )));
    }
    Ok(())
}

/// A manifest entry's file, checked before a byte of it is read: a path
/// inside `out_dir` (`real_out`, resolved) even through links, within
/// `max_artifact_bytes`. Its resolved path and size on disk.
fn artifact_file(
    out_dir: &Path,
    real_out: &Path,
    m: &wire::ManifestEntry,
    max_artifact_bytes: u64,
) -> Result<(std::path::PathBuf, u64), Outcome> {
    let rel = Path::new(&m.path);
    // what is wrong with it, said as such (audit 94: "." was told it
    // had a '..')
    let wrong = if m.path.is_empty() {
        Some("is empty: it names the file, relative to output_dir")
    } else if rel.is_absolute() {
        Some("is absolute: it must be relative to output_dir")
    } else if rel.components().any(|c| c == Component::ParentDir) {
        Some("must stay below output_dir, without '..'")
    } else if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        Some("must name a file below output_dir, not '.'")
    } else {
        None
    };
    if let Some(wrong) = wrong {
        return Err(artifact_invalid(format!(
            "artifact {:?}: path {:?} {wrong}",
            m.name, m.path
        )));
    }
    let real = std::fs::canonicalize(out_dir.join(rel))
        .map_err(|e| artifact_invalid(format!("artifact {:?}: {}: {e}", m.name, m.path)))?;
    if !real.starts_with(real_out) {
        return Err(artifact_invalid(format!(
            "artifact {:?} escapes output_dir",
            m.name
        )));
    }
    let meta = std::fs::metadata(&real)
        .map_err(|e| artifact_invalid(format!("artifact {:?}: {}: {e}", m.name, m.path)))?;
    if !meta.is_file() {
        return Err(artifact_invalid(format!(
            "artifact {:?}: {} is not a regular file",
            m.name, m.path
        )));
    }
    let on_disk = meta.len();
    if on_disk > max_artifact_bytes || m.size > max_artifact_bytes {
        return Err(artifact_invalid(format!(
            "artifact {:?} has {} bytes; max_artifact_bytes is {max_artifact_bytes}",
            m.name,
            on_disk.max(m.size)
        )));
    }
    Ok((real, on_disk))
}

/// Waits up to `grace` for the child to exit; whether it did. A child
/// stopped by a signal (or a debugger) is not waited for: it reads no
/// Shutdown and acts on no cancel until it runs again (re-check audit: a
/// start-up probe that stopped itself after its hello held the worker's
/// start `cancel_grace_ms` per executor).
pub(crate) async fn wait_exit(child: &mut Child, grace: Duration) -> bool {
    let until = Instant::now() + grace;
    loop {
        if child.has_exited() {
            return true;
        }
        if child.is_stopped() {
            debug!(
                pid = child.pid,
                "the executor is stopped by a signal or a debugger: no grace is waited for it"
            );
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        if tokio::time::timeout(left.min(STOP_CHECK), child.exited())
            .await
            .is_ok()
        {
            return true;
        }
    }
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

/// The stop escalation of CONTRACT §6 after the cancel frame
/// ([`crate::process::Child::stop`]): SIGTERM to the group if the leader
/// still runs, the `term_grace_ms` (none in a forced stop, and a second stop
/// signal ends it), SIGKILL to the group (always: grandchildren go too),
/// reap; a leader stopped by a signal or a debugger gets the SIGKILL at once.
/// Says in the log what it did and why.
pub(crate) async fn stop_child(
    child: &mut Child,
    cfg: &crate::config::WorkerConfig,
) -> Option<crate::process::ExitReport> {
    let grace = if super::forced() {
        Duration::ZERO
    } else {
        Duration::from_millis(cfg.term_grace_ms)
    };
    let res = child
        .stop(grace, super::until_forced(), |child, step| {
            stop_step(child, step)
        })
        .await;
    reaped_or_logged(res)
}

/// The log line and the metric of a step of a stop.
fn stop_step(child: &Child, step: StopStep) {
    match step {
        StopStep::KillStopped => {
            // it acts on no SIGTERM while stopped, and woken (SIGCONT) one
            // that ignores SIGTERM read the job it had been sent and never
            // answered and ran its handler, while that attempt was given
            // back as never run (re-check audit: the side effect twice)
            info!(
                pid = child.pid,
                "the executor is stopped by a signal (SIGSTOP, SIGTSTP) or a debugger: SIGKILL to its process group, without waking it"
            );
            crate::metrics::executor_signal("SIGKILL");
        }
        StopStep::Term => {
            // the metric counted these without a word in the log (soak
            // audit: six SIGTERMs, none of them traceable to a process or a
            // step)
            info!(
                pid = child.pid,
                "the executor is still running: SIGTERM to its process group"
            );
            crate::metrics::executor_signal("SIGTERM");
        }
        StopStep::KillAfterGrace { cut_short } => {
            crate::metrics::executor_signal("SIGKILL");
            if cut_short || super::forced() {
                // a second stop signal (audit 83): no grace was given,
                // nothing ignored
                info!(
                    pid = child.pid,
                    "forced stop: SIGKILL to the executor's process group without a grace"
                );
            } else if let Some(tracer) = child.tracer().filter(|_| child.is_stopped()) {
                // not the executor's doing (re-check audit: a gdb attached
                // read as an executor that ignored SIGTERM); a tracer that
                // lets it run (strace) holds nothing: the executor's own
                // doing then
                warn!(
                    pid = child.pid,
                    tracer,
                    "the executor is held by a debugger or tracer (pid {tracer}) and did not act on SIGTERM; sending SIGKILL to its group"
                );
            } else {
                warn!(
                    pid = child.pid,
                    "executor ignored SIGTERM; sending SIGKILL to its group"
                );
            }
        }
        // the wait said nothing (re-check audit: a drain stood 20 s,
        // silent, behind a gdb attached to an idle process)
        StopStep::HeldByTracer(tracer) => warn!(
            pid = child.pid,
            tracer,
            "the executor's process is held by a debugger or tracer (pid {tracer}): killed, it ends when the tracer lets it go; waiting for that"
        ),
    }
}

fn reaped_or_logged(
    res: Result<crate::process::ExitReport, crate::process::ProcessError>,
) -> Option<crate::process::ExitReport> {
    match res {
        Ok(r) => Some(r),
        Err(e) => {
            error!(error = %e, "cannot reap the executor");
            None
        }
    }
}

/// The process of a job given back as never run: SIGKILL to its group at
/// once, with no SIGTERM grace in which it could still read the job and run
/// it while the next attempt does too.
async fn kill_unanswered(child: &mut Child) -> Option<crate::process::ExitReport> {
    if !child.has_exited() {
        info!(
            pid = child.pid,
            "the executor never answered its job, which goes back to the queue as never run: SIGKILL to its process group at once, so that it cannot read the job later"
        );
        crate::metrics::executor_signal("SIGKILL");
    }
    reaped_or_logged(child.kill_now(stop_step).await)
}

#[cfg(test)]
mod tests;
