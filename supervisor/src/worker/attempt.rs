//! One attempt of one step: spawn, handshake, stream, enforce, stop, commit.
//!
//! One event loop per attempt over: frames from the child, the child's exit,
//! the silence (heartbeat) timer, the attempt timeout, the step deadline, the
//! cancel/lease-lost signal from the heartbeat, and the worker's abort. Cancel,
//! deadline, lost lease and shutdown all end a child the same way (CONTRACT §6):
//! a cancel frame, a grace, SIGTERM to the process group, a second grace,
//! SIGKILL to the group, reap. Only then is the outcome committed, fenced by
//! the lease token.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use nix::sys::signal::Signal;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use super::{Control, ExecutorRuntime, Shared};
use crate::db::{DbError, FailureReport, LeasedStep, NewArtifact, NewEvent};
use crate::process::Child;
use crate::state::Failure;
use crate::wire::{
    self, CancelReason, EventKind, FromExecutor, HandshakeError, Hello, JobError, JobResult,
    ToExecutor, WireError,
};

/// How long to keep reading stdout after the child exited (a grandchild may
/// hold the pipe open, so EOF may never come).
const EXIT_DRAIN_IDLE: Duration = Duration::from_millis(150);

/// How an attempt ended, before it is committed.
#[derive(Debug)]
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
    /// Refused before execution: back to the queue, the attempt given back.
    Refused {
        code: String,
        message: String,
    },
    /// The lease is gone: nothing may be written.
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
            Outcome::Abandoned { .. } => "abandoned (lease lost)".into(),
        }
    }
}

/// The terminal frame a job ended with.
#[derive(Debug)]
enum Terminal {
    Result(JobResult),
    Error(JobError),
}

/// Runs one attempt to the end and commits its outcome.
pub(crate) async fn run(
    shared: Arc<Shared>,
    exec: Arc<ExecutorRuntime>,
    step: LeasedStep,
    control: watch::Receiver<Control>,
) {
    let started = Instant::now();
    let outcome = execute(&shared, &exec, &step, control).await;
    let label = outcome.label();
    shared.forget(step.lease.step_run_id());
    commit(&shared, &step, outcome).await;
    info!(outcome = %label, elapsed_ms = started.elapsed().as_millis() as u64, "attempt finished");
}

async fn execute(
    shared: &Shared,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    mut control: watch::Receiver<Control>,
) -> Outcome {
    if step.cancel_requested || *control.borrow_and_update() == Control::Cancel {
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
    let mut secrets = BTreeMap::new();
    for name in &step.secrets {
        match std::env::var(name) {
            Ok(v) => {
                secrets.insert(name.clone(), v);
            }
            Err(_) => {
                return Outcome::failed(
                    "SECRET_UNAVAILABLE",
                    true,
                    format!("secret {name} is not set in this worker's environment"),
                )
            }
        }
    }

    // the attempt's own directory: in/ for input artifacts, out/ for results
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
            return Outcome::failed(
                "SPAWN_FAILED",
                true,
                format!(
                    "cannot create a working directory in {}: {e}",
                    base.display()
                ),
            )
        }
    };
    let out_dir = workdir.path().join("out");
    let in_dir = workdir.path().join("in");
    if let Err(e) = std::fs::create_dir(&out_dir).and_then(|_| std::fs::create_dir(&in_dir)) {
        return Outcome::failed(
            "SPAWN_FAILED",
            true,
            format!("cannot prepare the working directory: {e}"),
        );
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
        attempt_deadline_unix_ms: step.timeout_ms.map(|t| now_ms + t).unwrap_or(0),
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
    };

    let spec = exec
        .cfg
        .spawn_spec(workdir.path(), shared.cfg.stderr_tail_bytes);
    let mut child = match shared.spawner.spawn(spec).await {
        Ok(c) => c,
        Err(e) => return Outcome::failed("SPAWN_FAILED", true, e.to_string()),
    };
    debug!(pid = child.pid, "executor spawned");
    let outcome = converse(shared, exec, step, &mut child, &job, &mut control).await;
    drop(workdir);
    outcome
}

/// Writes the input artifacts under `in/<step>/<name>`, read-only.
async fn materialize_inputs(
    shared: &Shared,
    step: &LeasedStep,
    in_dir: &Path,
) -> Result<Vec<wire::InputArtifact>, Outcome> {
    let arts = shared
        .db
        .input_artifacts(step.run_id, &step.name)
        .await
        .map_err(|e| {
            Outcome::failed(
                "SPAWN_FAILED",
                true,
                format!("cannot read input artifacts: {e}"),
            )
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
            return Err(Outcome::failed(
                "SPAWN_FAILED",
                true,
                format!("cannot write input artifact {}: {e}", a.name),
            ));
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

type Frames = wire::ExecutorFrames<tokio::process::ChildStdout>;

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

/// Resolves with the control value once it is no longer `Run`.
async fn until_stopped(control: &mut watch::Receiver<Control>) -> Control {
    loop {
        let c = *control.borrow_and_update();
        if c != Control::Run {
            return c;
        }
        if control.changed().await.is_err() {
            // the heartbeat side is gone: nothing will ever stop us from here
            std::future::pending::<()>().await;
        }
    }
}

async fn sleep_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

fn instant_in(ms: i64) -> Instant {
    Instant::now() + Duration::from_millis(ms.max(0) as u64)
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

/// The conversation with one child, from hello to reaped.
async fn converse(
    shared: &Shared,
    exec: &ExecutorRuntime,
    step: &LeasedStep,
    child: &mut Child,
    job: &wire::Job,
    control: &mut watch::Receiver<Control>,
) -> Outcome {
    let cfg = &shared.cfg;
    let (Some(stdout), stdin) = (child.take_stdout(), child.take_stdin()) else {
        return Outcome::failed("SPAWN_FAILED", true, "the executor's pipes are missing");
    };
    let mut stdin = stdin;
    let mut frames: Frames = FramedRead::new(stdout, wire::executor_decoder(cfg.max_frame_bytes));

    // --- handshake: the executor speaks first; a cancel, a lost lease or the
    // worker's abort during it stops the child at once
    let handshake = wire::read_hello(&mut frames, Duration::from_millis(cfg.handshake_timeout_ms));
    let read = tokio::select! {
        r = handshake => r,
        c = until_stopped(control) => {
            let outcome = match c {
                Control::LeaseLost => Outcome::Abandoned {
                    why: "the lease was lost while the executor started".into(),
                },
                _ => Outcome::Cancelled {
                    message: "cancelled while the executor started; no job was sent".into(),
                },
            };
            return stop_now(child, cfg, outcome).await;
        }
        _ = shared.abort.cancelled() => {
            return stop_now(
                child,
                cfg,
                Outcome::failed("WORKER_SHUTDOWN", true, "the worker shut down while the executor started"),
            )
            .await;
        }
    };
    let hello: Hello = match read {
        Ok(h) => h,
        Err(e) => {
            warn!(error = %e, stderr_tail = %child.stderr().tail_string(), "handshake failed");
            // the raw evidence stays in the log; the stored message describes it
            let msg = match &e {
                HandshakeError::Wire(w) => wire_failure(w).1,
                other => other.to_string(),
            };
            return stop_now(child, cfg, Outcome::failed("HANDSHAKE_FAILED", true, msg)).await;
        }
    };
    if let Err(why) = super::routing::check(
        &hello,
        &exec.cfg,
        &step.executor_kind,
        &step.kind,
        &step.labels,
    ) {
        warn!(%why, "executor refused before any job was sent");
        let outcome = Outcome::Refused {
            code: "EXECUTOR_REFUSED".into(),
            message: why,
        };
        return decline(child, stdin, cfg, outcome).await;
    }

    // a cancel or a lost lease that arrived during spawn and handshake: the
    // step is still only leased, so the job is never sent
    let before_job = *control.borrow_and_update();
    if before_job != Control::Run {
        let outcome = if before_job == Control::Cancel {
            Outcome::Cancelled {
                message: "cancellation was requested before the job was sent".into(),
            }
        } else {
            Outcome::Abandoned {
                why: "the lease was lost before the job was sent".into(),
            }
        };
        return decline(child, stdin, cfg, outcome).await;
    }

    // --- the job
    write_frame(&mut stdin, &ToExecutor::Job(Box::new(job.clone()))).await;

    let silence = step.heartbeat_timeout_ms.filter(|&ms| ms > 0);
    let mut silence_at = silence.map(instant_in);
    let attempt_end = step.timeout_ms.map(instant_in);
    let deadline_at = step
        .deadline
        .map(|d| instant_in((d - Utc::now()).num_milliseconds()));

    let mut accepted = false;
    let mut last_seq: u64 = 0;
    let mut terminal: Option<Terminal> = None;
    // the outcome the supervisor imposes (timeout, cancel, lost lease, violation)
    let mut imposed: Option<Outcome> = None;
    let mut cancel_reason: Option<CancelReason> = None;
    let mut control_open = true;
    let mut after_terminal_violation = false;

    // --- phase 1: until a terminal, a violation, or a reason to stop
    loop {
        tokio::select! {
            biased;
            frame = frames.next() => {
                match frame {
                    None => break,
                    Some(Err(e)) => {
                        let (code, msg) = wire_failure(&e);
                        warn!(error = %e, stderr_tail = %child.stderr().tail_string(), code, "protocol violation");
                        imposed = Some(Outcome::failed(code, code == "EXECUTOR_CRASHED", msg));
                        break;
                    }
                    Some(Ok(frame)) => {
                        if let Some(s) = silence { silence_at = Some(instant_in(s)); }
                        match on_frame(shared, step, job, child.pid, FromExecutor::from(frame), &mut accepted, &mut last_seq).await {
                            FrameVerdict::Continue => {}
                            FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                            FrameVerdict::Impose(o) => {
                                let lost = matches!(o, Outcome::Abandoned { .. });
                                imposed = Some(o);
                                if lost { cancel_reason = Some(CancelReason::LeaseLost); }
                                break;
                            }
                        }
                    }
                }
            }
            res = child.exited(), if !child.has_exited() => {
                if let Err(e) = res { error!(error = %e, "cannot watch the executor's exit"); }
                // its last frames may still be in the pipe
                match drain_after_exit(&mut frames).await {
                    Drained::Frames(rest) => {
                        let mut rest = rest.into_iter();
                        for f in rest.by_ref() {
                            match on_frame(shared, step, job, child.pid, f, &mut accepted, &mut last_seq).await {
                                FrameVerdict::Continue => {}
                                FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                                FrameVerdict::Impose(o) => { imposed = Some(o); break; }
                            }
                        }
                        if terminal.is_some() && rest.next().is_some() {
                            warn!("frame after the terminal");
                            after_terminal_violation = true;
                        }
                    }
                    Drained::Error(e) => {
                        let (code, msg) = wire_failure(&e);
                        warn!(error = %e, code, "protocol violation at exit");
                        imposed = Some(Outcome::failed(code, code == "EXECUTOR_CRASHED", msg));
                    }
                }
                break;
            }
            _ = sleep_opt(silence_at) => {
                imposed = Some(Outcome::failed("HEARTBEAT_TIMEOUT", true,
                    format!("no frame from the executor for {} ms", silence.unwrap_or(0))));
                cancel_reason = Some(CancelReason::AttemptTimeout);
                break;
            }
            _ = sleep_opt(attempt_end) => {
                imposed = Some(Outcome::failed("ATTEMPT_TIMEOUT", true,
                    format!("the attempt ran past timeout_ms = {}", step.timeout_ms.unwrap_or(0))));
                cancel_reason = Some(CancelReason::AttemptTimeout);
                break;
            }
            _ = sleep_opt(deadline_at) => {
                imposed = Some(Outcome::failed("DEADLINE_EXCEEDED", false, "the step deadline passed during the attempt"));
                cancel_reason = Some(CancelReason::Deadline);
                break;
            }
            changed = control.changed(), if control_open => {
                if changed.is_err() { control_open = false; continue; }
                let c = *control.borrow_and_update();
                match c {
                    Control::Run => {}
                    Control::Cancel => {
                        imposed = Some(Outcome::Cancelled { message: "cancelled on request".into() });
                        cancel_reason = Some(CancelReason::Requested);
                        break;
                    }
                    Control::LeaseLost => {
                        imposed = Some(Outcome::Abandoned { why: "the lease was lost while the executor ran".into() });
                        cancel_reason = Some(CancelReason::LeaseLost);
                        break;
                    }
                }
            }
            _ = shared.abort.cancelled() => {
                imposed = Some(Outcome::failed("WORKER_SHUTDOWN", true, "the worker shut down while the attempt ran"));
                cancel_reason = Some(CancelReason::Shutdown);
                break;
            }
        }
    }

    // --- phase 2: make sure the child is gone, then decide
    if terminal.is_some() && imposed.is_none() {
        // the job is done: no more jobs, the executor exits on EOF
        drop(stdin.take());
        match watch_after_terminal(
            child,
            &mut frames,
            Duration::from_millis(cfg.cancel_grace_ms),
        )
        .await
        {
            AfterTerminal::Clean => {}
            AfterTerminal::Violation(what) => {
                warn!(%what, "frame after the terminal");
                after_terminal_violation = true;
            }
            AfterTerminal::StillRunning => {
                debug!("executor did not exit after its terminal; stopping it");
            }
        }
    } else if let Some(reason) = cancel_reason {
        // ask nicely, then escalate
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
        loop {
            tokio::select! {
                frame = frames.next() => match frame {
                    Some(Ok(f)) => {
                        match on_frame(shared, step, job, child.pid, FromExecutor::from(f), &mut accepted, &mut last_seq).await {
                            FrameVerdict::Terminal(t) => { terminal = Some(t); break; }
                            FrameVerdict::Continue => {}
                            FrameVerdict::Impose(_) => {}
                        }
                    }
                    _ => break,
                },
                _ = child.exited(), if !child.has_exited() => break,
                _ = tokio::time::sleep_until(until) => break,
            }
        }
        drop(stdin.take());
        if terminal.is_some() && !child.has_exited() {
            let _ = wait_exit(child, grace).await;
        }
    }
    drop(stdin);

    // SIGTERM → grace → SIGKILL to the group if the leader still runs; always
    // SIGKILL the group at the end (grandchildren), then reap.
    let report = stop_child(child, cfg).await;
    if let Some(r) = &report {
        debug!(status = %r.status, escalated = r.escalated_to_kill, stderr_bytes = r.stderr_total_bytes, "executor reaped");
    }
    let exit_text = report
        .as_ref()
        .map(|r| r.status.to_string())
        .unwrap_or_else(|| "unknown status".into());

    if after_terminal_violation {
        return Outcome::failed(
            "PROTOCOL_FRAME_AFTER_TERMINAL",
            false,
            "the executor wrote a frame after its terminal",
        );
    }

    match (imposed, terminal) {
        // a cancelled job that completed anyway keeps its result
        (Some(Outcome::Cancelled { .. }), Some(Terminal::Result(r))) => {
            verify_result(job, r, accepted, cfg.max_artifact_bytes).await
        }
        (Some(Outcome::Cancelled { message }), _) => Outcome::Cancelled { message },
        (Some(o), _) => o,
        (None, Some(Terminal::Result(r))) => {
            verify_result(job, r, accepted, cfg.max_artifact_bytes).await
        }
        (None, Some(Terminal::Error(e))) => {
            let own_cancel = step.cancel_requested || *control.borrow() == Control::Cancel;
            if !accepted {
                Outcome::Refused {
                    code: if e.code.is_empty() {
                        "EXECUTOR_REFUSED".into()
                    } else {
                        e.code
                    },
                    message: e.message,
                }
            } else if e.code == "CANCELLED" && own_cancel {
                Outcome::Cancelled { message: e.message }
            } else {
                // includes CANCELLED without a cancel request: an executor may
                // not cancel on its own, so that is a failure with its code
                executor_failure(e)
            }
        }
        (None, None) => {
            warn!(status = %exit_text, stderr_tail = %report.as_ref().map(|r| r.stderr_tail.as_str()).unwrap_or(""),
                  "executor ended without a terminal");
            Outcome::failed(
                "EXECUTOR_CRASHED",
                true,
                format!("the executor ended without a terminal ({exit_text})"),
            )
        }
    }
}

/// An executor's error as a failed outcome.
fn executor_failure(e: JobError) -> Outcome {
    Outcome::Failed {
        code: if e.code.is_empty() {
            "EXECUTOR_ERROR".into()
        } else {
            e.code
        },
        message: e.message,
        retryable: e.retryable,
        details: parse_details(&e.details),
        next_retry_delay_ms: e.next_retry_delay_ms,
        sequence: Some(e.sequence),
    }
}

fn parse_details(bytes: &[u8]) -> Option<serde_json::Value> {
    if bytes.is_empty() {
        return None;
    }
    Some(serde_json::from_slice(bytes).unwrap_or_else(|_| {
        serde_json::json!({"unparsed": String::from_utf8_lossy(&bytes[..bytes.len().min(4096)])})
    }))
}

enum FrameVerdict {
    Continue,
    Terminal(Terminal),
    Impose(Outcome),
}

fn violation(code: &str, msg: String) -> FrameVerdict {
    warn!(code, %msg, "protocol violation");
    FrameVerdict::Impose(Outcome::failed(code, false, msg))
}

async fn on_frame(
    shared: &Shared,
    step: &LeasedStep,
    job: &wire::Job,
    pid: i32,
    frame: FromExecutor,
    accepted: &mut bool,
    last_seq: &mut u64,
) -> FrameVerdict {
    let lease = &step.lease;
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
    if seq <= *last_seq {
        return violation(
            "PROTOCOL_SEQUENCE_REGRESSION",
            format!("sequence {seq} after {}", *last_seq),
        );
    }
    *last_seq = seq;
    match frame {
        FromExecutor::Event(e) => {
            if !*accepted {
                if e.kind != EventKind::Accepted {
                    return violation(
                        "PROTOCOL_UNEXPECTED_FRAME",
                        format!("{} event before accepted", e.kind.as_str()),
                    );
                }
                *accepted = true;
                let ev = new_event(&e);
                return match shared.db.mark_running(lease, &shared.name, pid, &ev).await {
                    Ok(()) => FrameVerdict::Continue,
                    Err(DbError::LeaseLost { .. }) => FrameVerdict::Impose(Outcome::Abandoned {
                        why: "the lease was lost before the executor started".into(),
                    }),
                    Err(err) => {
                        error!(error = %err, "cannot record the start of execution");
                        FrameVerdict::Continue
                    }
                };
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
            let ev = new_event(&e);
            match shared.db.record_event(lease, &ev).await {
                Ok(()) => FrameVerdict::Continue,
                Err(DbError::LeaseLost { .. }) => FrameVerdict::Impose(Outcome::Abandoned {
                    why: "the lease was lost while the executor ran".into(),
                }),
                Err(err) => {
                    error!(error = %err, "cannot record a progress event");
                    FrameVerdict::Continue
                }
            }
        }
        FromExecutor::Result(r) => {
            if !*accepted {
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
) -> Outcome {
    let (out_dir, inputs) = (job.output_dir.clone(), job.input_artifacts.clone());
    let check = move || {
        finish_result(
            Path::new(&out_dir),
            &inputs,
            r,
            accepted,
            max_artifact_bytes,
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
    let inputs: std::collections::HashMap<&str, &wire::InputArtifact> =
        input_artifacts.iter().map(|a| (a.id.as_str(), a)).collect();
    let mut artifacts = Vec::with_capacity(r.artifacts.len());
    let mut names = std::collections::HashSet::new();
    for m in &r.artifacts {
        let rel = Path::new(&m.path);
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
    Error(WireError),
}

/// After the leader exited: read what is left on stdout until EOF or until it
/// stays idle (a grandchild may hold the pipe open).
async fn drain_after_exit(frames: &mut Frames) -> Drained {
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(EXIT_DRAIN_IDLE, frames.next()).await {
            Ok(Some(Ok(f))) => out.push(FromExecutor::from(f)),
            Ok(Some(Err(e))) => return Drained::Error(e),
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
            Drained::Error(e) => AfterTerminal::Violation(e.to_string()),
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
                Drained::Error(e) => AfterTerminal::Violation(e.to_string()),
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
async fn stop_child(
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

/// Commits an outcome, fenced by the lease. Transient database errors are
/// retried for up to one lease TTL; a lost lease discards the outcome.
async fn commit(shared: &Shared, step: &LeasedStep, outcome: Outcome) {
    let lease = &step.lease;
    let budget = Instant::now() + Duration::from_millis(shared.cfg.lease_ttl_ms);
    let mut delay = Duration::from_millis(50);
    loop {
        let res: Result<(), DbError> = match &outcome {
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
                            chrono::Duration::milliseconds(ms.min(i64::MAX as u64) as i64)
                        }),
                    },
                    message: message.clone(),
                    details: details.clone(),
                    sequence: *sequence,
                };
                match shared
                    .db
                    .fail(lease, &shared.name, &report, rand::random())
                    .await
                {
                    Ok(d) => {
                        info!(to = %d.to, reason = %d.reason, "failure committed");
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Outcome::Cancelled { message } => {
                shared
                    .db
                    .confirm_cancelled(lease, &shared.name, message)
                    .await
            }
            Outcome::Refused { code, message } => {
                shared
                    .db
                    .refuse(
                        lease,
                        &shared.name,
                        code,
                        message,
                        Duration::from_millis(shared.cfg.refusal_delay_ms),
                    )
                    .await
            }
            Outcome::Abandoned { why } => {
                warn!(%why, "outcome discarded: this worker no longer owns the step");
                return;
            }
        };
        match res {
            Ok(()) => return,
            Err(DbError::LeaseLost { .. }) => {
                warn!(outcome = %outcome.label(), "lease lost before commit; the outcome is discarded (another owner or the reclaimer moved the step on)");
                return;
            }
            Err(e) if Instant::now() + delay < budget => {
                warn!(error = %e, "commit failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                error!(error = %e, outcome = %outcome.label(), "commit failed; the lease will expire and the step will be reclaimed");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sanitize;

    #[test]
    fn sanitizes_names() {
        assert_eq!(sanitize("report.csv"), "report.csv");
        assert_eq!(sanitize("../etc/passwd"), "_.._etc_passwd");
        assert_eq!(sanitize(""), "_");
    }
}
