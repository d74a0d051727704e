//! The attempt machine: one attempt's protocol as a pure state machine, with
//! no I/O. Its inputs are what can happen to a running job (a frame, a stream
//! error or EOF, the child's exit, a timer, a cancel, a lost lease, the
//! worker's shutdown); its outputs are what the driver must do (persist an
//! intent, send a cancel frame, close stdin, arm the grace timer, drain what is
//! left on stdout, finish: keep the process or stop it). The driver
//! (`attempt.rs`) owns the child, the pipes, the clocks and the writer, and
//! only translates between them and this machine. What the attempt's outcome
//! is once the child is gone is `precedence`, one pure function. Both are
//! table-tested (`tests.rs`).

use crate::wire::{self, CancelReason, EventKind, FromExecutor, JobError, JobResult, WireError};

use super::Outcome;

/// Codes that mean "this executor cannot run this job" (not "the job failed").
pub(crate) const REFUSAL_CODES: [&str; 3] =
    ["UNSUPPORTED_KIND", "EXECUTOR_REFUSED", "EXECUTOR_BUSY"];
/// Frames read during a cancel's grace at most (a flood cannot hold the stop).
pub(crate) const GRACE_MAX_FRAMES: usize = 16 * 1024;

/// The terminal frame a job ended with.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Terminal {
    Result(JobResult),
    Error(JobError),
}

/// The job's outcome when its warm process `what` (after "the warm
/// process") since the job began answering: most likely an earlier job's
/// stray (see `Machine::strays_may_be_read`), so the job goes back to the
/// queue uncounted, for a process that served no job, and this one is
/// replaced.
fn given_back_for_stray(what: &str) -> Outcome {
    Outcome::GivenBack {
        code: "EXECUTOR_CRASHED".into(),
        message: format!(
            "the warm process{what} since this job began answering: on a process that served earlier jobs, \
             most likely bytes one of them wrote after its terminal (stdout carries frames only; logs go to \
             stderr), read with or hiding this job's own frames; the worker's log shows their first bytes. The \
             job goes back to the queue, uncounted, for a process that served no job, and this one is replaced"
        ),
    }
}

pub(crate) fn wire_failure(e: &WireError) -> (&'static str, String) {
    match e {
        WireError::TooLarge {
            len,
            cap,
            printed: true,
        } => (
            "PROTOCOL_FRAME_TOO_LARGE",
            format!(
                "the executor announced a frame of {len} bytes (the cap is {cap}) with bytes that are text: \
                 did it print something there (stdout carries frames only; logs go to stderr)? The \
                 worker's log shows their first bytes"
            ),
        ),
        WireError::TooLarge { len, cap, .. } => (
            "PROTOCOL_FRAME_TOO_LARGE",
            format!("the executor announced a frame of {len} bytes; the cap is {cap}"),
        ),
        WireError::Truncated { buffered, .. } => (
            "PROTOCOL_MALFORMED_FRAME",
            format!("the executor's stdout ended inside a frame ({buffered} bytes buffered)"),
        ),
        // lines printed now and then fill the "frame" their first byte
        // announced, which then fails to decode (audit 99: a print every
        // 200 ms read as a malformed frame alone)
        WireError::Malformed {
            reason,
            printed: true,
            ..
        } => (
            "PROTOCOL_MALFORMED_FRAME",
            format!(
                "the executor wrote text to its stdout, which carries frames only (logs go to stderr): \
                 did it print something there? Read as a frame, it is not one ({reason}); the worker's \
                 log shows its first bytes"
            ),
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

/// What the attempt's loop asks its writer to persist, in order.
#[derive(Debug)]
pub(crate) enum Intent {
    Start { pid: i32, event: wire::Event },
    Event(wire::Event),
}

/// What of a run of queued events is written: every event that carries a
/// checkpoint or is not plain progress, and of the plain progress events
/// (no checkpoint) only the latest — when the database is slower than the
/// executor, progress is coalesced instead of queued without end. In order.
pub(crate) fn coalesce<'a>(events: &[&'a wire::Event]) -> Vec<&'a wire::Event> {
    let plain = |e: &wire::Event| e.kind == EventKind::Progress && e.checkpoint.is_none();
    let last_plain = events.iter().rposition(|e| plain(e));
    events
        .iter()
        .enumerate()
        .filter(|(i, e)| !plain(e) || Some(*i) == last_plain)
        .map(|(_, e)| *e)
        .collect()
}

/// What the attempt's loop knows of the job's frames so far.
#[derive(Debug, Default)]
pub(crate) struct FrameState {
    pub(crate) accepted: bool,
    pub(crate) last_seq: u64,
}

#[derive(Debug)]
pub(crate) enum FrameVerdict {
    Continue,
    Write(Intent),
    Terminal(Terminal),
    Impose(Outcome),
}

/// A protocol violation (logged, redacted, with the attempt's outcome).
pub(crate) fn violation(code: &str, msg: String) -> FrameVerdict {
    FrameVerdict::Impose(Outcome::failed(code, false, msg))
}

pub(crate) use crate::wire::MAX_SEQUENCE;

/// The job id and sequence of a job's frame (an event or a terminal).
fn job_frame(frame: &FromExecutor) -> Option<(&str, u64)> {
    match frame {
        FromExecutor::Event(e) => Some((e.job_id.as_str(), e.sequence)),
        FromExecutor::Result(r) => Some((r.job_id.as_str(), r.sequence)),
        FromExecutor::Error(e) => Some((e.job_id.as_str(), e.sequence)),
        _ => None,
    }
}

/// Checks one frame of a running job. Pure: what to write is returned, not done.
pub(crate) fn on_frame(
    st: &mut FrameState,
    job_id: &str,
    pid: i32,
    frame: FromExecutor,
) -> FrameVerdict {
    let Some((frame_job, seq)) = job_frame(&frame) else {
        return violation(
            "PROTOCOL_UNEXPECTED_FRAME",
            format!("unexpected {} during a job", frame.name()),
        );
    };
    if frame_job != job_id {
        return violation(
            "PROTOCOL_UNEXPECTED_FRAME",
            format!("frame for job {frame_job:?} while running job {job_id:?}"),
        );
    }
    if seq == 0 && st.last_seq == 0 {
        // the first frame: nothing came before it to regress from
        // (third-party audit: an ACCEPTED at 0 was a "regression", where
        // PROTOCOL.md's table says out of range)
        return violation(
            "PROTOCOL_SEQUENCE_OUT_OF_RANGE",
            "sequence 0: a job's frames count from 1, accepted first".into(),
        );
    }
    if seq <= st.last_seq {
        return violation(
            "PROTOCOL_SEQUENCE_REGRESSION",
            match st.last_seq {
                0 => format!("sequence {seq}: an attempt's frames count from 1"),
                last => format!("sequence {seq} after {last}: sequences must increase"),
            },
        );
    }
    // the database stores sequences as bigint and the supervisor writes an
    // ending event after the last one: a sequence near 2^63 overflowed there
    // (and above it was stored negative)
    if seq > MAX_SEQUENCE {
        return violation(
            "PROTOCOL_SEQUENCE_OUT_OF_RANGE",
            format!("sequence {seq} is above {MAX_SEQUENCE} (2^53 - 1); an attempt's frames count from 1"),
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
                if seq != 1 {
                    // PROTOCOL.md: ACCEPTED, sequence 1 (the conformance kit
                    // fails it too: what it passes, the worker runs)
                    return violation(
                        "PROTOCOL_SEQUENCE_OUT_OF_RANGE",
                        format!("accepted has sequence {seq}; a job's frames count from 1, accepted first"),
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
pub(crate) enum Verdict {
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
pub(crate) fn precedence(
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
        // a drain's stop answered by a result: the work is done, and given
        // back it would only run again (redeploy audit). One with artifacts
        // is given back still: storing them could outlast the stop budget
        (Some(Outcome::Released { .. }), Some(Terminal::Result(r))) if r.artifacts.is_empty() => {
            Verdict::Verify(r)
        }
        (Some(o), _) => Verdict::Outcome(o),
        (None, Some(Terminal::Result(r))) => Verdict::Verify(r),
        (None, Some(Terminal::Error(e))) => {
            if !accepted {
                if REFUSAL_CODES.contains(&e.code.as_str()) || e.code.is_empty() || e.retryable {
                    // a refusal's code is checked as a failure's is: an
                    // empty, reserved or not UPPER_SNAKE_CASE one is
                    // EXECUTOR_REFUSED, the code sent named in the message
                    // (re-check audit: an escape sequence, or
                    // DEADLINE_EXCEEDED, was stored as sent)
                    let (code, message) = if e.code.is_empty() {
                        ("EXECUTOR_REFUSED".into(), e.message)
                    } else if !is_executors_code(&e.code) {
                        (
                            "EXECUTOR_REFUSED".into(),
                            format!("(refused with the code {:?}) {}", e.code, e.message),
                        )
                    } else {
                        (e.code, e.message)
                    };
                    Verdict::Outcome(Outcome::Refused { code, message })
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

/// A `CANCELLED` answer's `details.handler_error` (PROTOCOL.md): what the
/// handler raised or panicked with after the cancel.
fn handler_error(details: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(details).ok()?;
    v.get("handler_error")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
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
    "INPUT_UNDECODABLE",
    "ARTIFACT_DIGEST_MISMATCH",
    "ARTIFACT_STORE_FAILED",
    "COMMIT_REJECTED",
    "SUPERVISOR_PANIC",
    "EXECUTOR_ERROR",
    "PROTOCOL_MALFORMED_FRAME",
    "PROTOCOL_FRAME_TOO_LARGE",
    "PROTOCOL_SEQUENCE_REGRESSION",
    "PROTOCOL_SEQUENCE_OUT_OF_RANGE",
    "PROTOCOL_FRAME_AFTER_TERMINAL",
    "PROTOCOL_UNEXPECTED_FRAME",
    "PROTOCOL_INVALID_TEXT",
    "PROTOCOL_VERSION_MISMATCH",
    "JOB_TOO_LARGE",
];

pub(crate) fn is_reserved(code: &str) -> bool {
    RESERVED_CODES.contains(&code)
}

/// Whether a code an executor sent may be stored as its own: one
/// (PROTOCOL.md: UPPER_SNAKE_CASE, capital letters, digits and `_`, as a
/// step's `non_retryable_codes` are), and not one the supervisor reserves.
/// A refusal's and a failure's codes are judged alike.
pub(crate) fn is_executors_code(code: &str) -> bool {
    !code.is_empty()
        && code
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        && !is_reserved(code)
}

/// An executor's error as a failed outcome. An empty code is
/// `EXECUTOR_ERROR`; a code the supervisor reserves, or one that is not
/// UPPER_SNAKE_CASE (no step's `non_retryable_codes` could name it; it may
/// hold an escape sequence), is rewritten to `EXECUTOR_ERROR`, the reported
/// code kept in `details.reported_code`.
pub(crate) fn executor_failure(e: JobError) -> Outcome {
    let mut details = parse_details(&e.details);
    let code = if e.code.is_empty() {
        "EXECUTOR_ERROR".to_string()
    } else if !is_executors_code(&e.code) {
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

pub(crate) fn parse_details(bytes: &[u8]) -> Option<serde_json::Value> {
    if bytes.is_empty() {
        return None;
    }
    let v = match crate::json::parse_bounded(bytes, crate::json::MAX_VALUE_DEPTH) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        // details are an object (PROTOCOL.md): other JSON is kept under a key
        Ok(serde_json::Value::Null) => return None,
        Ok(other) => serde_json::json!({ "value": other }),
        Err(_) => serde_json::json!({
            "unparsed": String::from_utf8_lossy(&bytes[..bytes.len().min(4096)])
        }),
    };
    // jsonb cannot hold a NUL, nor a number beyond numeric: details are
    // evidence, so they are kept, cleaned
    Some(crate::json::storable(v))
}

// ---------------------------------------------------------------------------
// the attempt machine

/// Where a job is in its life, once it was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Frames flow until a terminal, a violation, the exit or a reason to stop.
    Running,
    /// The leader exited while the job ran: what is left on stdout counts
    /// (read until EOF or idle, bounded), then the attempt is decided.
    DrainingAfterExit,
    /// The terminal came and the process is not kept: stdin is closed and the
    /// executor must exit within the grace, writing nothing more.
    AfterTerminal { stdout_closed: bool },
    /// After the terminal, the leader gone: any frame still on stdout is a
    /// violation.
    DrainingAfterTerminal,
    /// A cancel frame was sent: exactly one terminal is owed within the grace.
    Cancelling { reason: CancelReason },
    /// Nothing more to read: the driver keeps or stops the process.
    Finished,
}

/// What can happen to an attempt whose job was sent.
#[derive(Debug)]
pub(crate) enum Input {
    /// The worker's drain timeout passed: running children are stopped.
    Abort,
    /// The step (or its run) was cancel-requested.
    Cancel,
    /// The lease is gone, or its clock is about to run out.
    LeaseLost,
    DeadlinePassed,
    AttemptTimedOut,
    /// No frame for `heartbeat_timeout_ms`.
    Silent,
    /// No frame at all for this job within `after_ms`
    /// (`handshake_timeout_ms`) of sending it (the SDKs accept at once): the
    /// process is stuck.
    Unanswered {
        after_ms: u64,
    },
    /// The executor's stdout has held `bytes` of a frame that does not
    /// complete, with no byte more while the supervisor read, for the stall
    /// check's time (10 s at least).
    Stalled {
        bytes: usize,
    },
    /// The process group's leader exited.
    Exited,
    Frame(FromExecutor),
    /// The stream broke (a malformed or oversized frame, an I/O error).
    StreamError {
        code: &'static str,
        message: String,
    },
    /// EOF on stdout.
    StdoutClosed,
    /// A drain reached its idle time or its bounds.
    DrainEnded,
    /// The grace armed by `Action::ArmGrace` passed.
    GraceEnded,
}

/// How the driver ends the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Finish {
    /// A persistent process that served its job cleanly goes back to its pool.
    pub reusable: bool,
    /// Give the leader the grace to exit on its own (stdin closed) before the
    /// group is signalled: it answered its cancel and is winding down.
    pub wait_exit_first: bool,
    /// SIGKILL the group at once, no SIGTERM and no grace: the job went back
    /// as never run, so its process must not read it afterwards (one that
    /// was only slow and ignored SIGTERM read it in that grace and ran it,
    /// and so did the next attempt).
    pub kill_at_once: bool,
}

/// What the driver must do, in order.
#[derive(Debug)]
pub(crate) enum Action {
    /// Queue for the writer (waiting for room if the queue is full).
    Persist(Intent),
    /// Queue if there is room, without waiting (progress during a cancel's
    /// grace must not delay the stop): plain progress without room is
    /// dropped, the newest checkpoint held for the hand-off.
    PersistIfRoom(Intent),
    /// Write a cancel frame (a grace follows: `ArmGrace`).
    SendCancel {
        reason: CancelReason,
        message: String,
    },
    /// No more jobs: close the executor's stdin.
    CloseStdin,
    /// Start the grace timer (`cancel_grace_ms` from now).
    ArmGrace,
    /// Start a bounded drain of stdout (idle time, time and frame bounds).
    StartDrain,
    Finish(Finish),
}

/// The limits of the step that shape the supervisor's own verdicts.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Limits {
    pub timeout_ms: Option<i64>,
    pub silence_ms: Option<i64>,
}

/// One attempt's protocol from the job frame to the end, without I/O.
#[derive(Debug)]
pub(crate) struct Machine {
    job_id: String,
    pid: i32,
    persistent: bool,
    limits: Limits,
    frames: FrameState,
    phase: Phase,
    terminal: Option<Terminal>,
    /// The outcome the supervisor imposes (timeout, cancel, lost lease,
    /// shutdown, violation).
    imposed: Option<Outcome>,
    after_terminal_violation: bool,
    exited: bool,
    grace_frames: usize,
    /// A warm process that served jobs before this one.
    reused: bool,
    /// The imposed outcome is a protocol violation on stdout (bytes that
    /// are no frame, a frame out of place), not the supervisor's stop.
    violated: bool,
    /// The job this process served before this one: a frame of it is the
    /// process's fault, not this job's.
    previous_job: Option<String>,
    /// The jobs it served before the previous one (its latest few): a
    /// late frame of one of them is the process's fault too.
    earlier_jobs: Vec<String>,
    /// Frames of the previous job seen during this one (dropped; the
    /// process is not trusted with another job).
    stale_frames: u32,
    /// Bytes of an unfinished frame on stdout ([`Machine::saw_unfinished`]).
    unfinished: usize,
    /// The unfinished bytes begin with no text and no frame's start
    /// ([`wire::looks_binary`]): not asked about as a print.
    unfinished_binary: bool,
    /// That frame was still growing (on its way, not stuck).
    arriving: bool,
    /// Its first bytes can begin a frame (else: most likely printed text).
    frame_like: bool,
    /// A frame was on its way when the job last ran (before a stop began),
    /// or when its process ended: one left unfinished at the end was cut
    /// off, not stuck.
    arriving_while_running: bool,
    /// The executor closed its stdout while its process still ran, with
    /// no terminal.
    closed_stdout: bool,
    /// The process was stopped by a signal or a debugger when a bound ran
    /// out ([`Machine::saw_stopped`]).
    stopped: bool,
    /// The imposed outcome's message already names the stop
    /// ([`Machine::stopped_note`]): the stop's own note does not again.
    stop_named: bool,
    /// The supervisor sent the job a cancel (its imposed outcome waits for
    /// the owed terminal, or the grace).
    asked_to_stop: bool,
    /// A second stop signal left the stop no grace
    /// ([`Machine::saw_no_grace`]).
    no_grace: bool,
}

impl Machine {
    pub(crate) fn new(job_id: &str, pid: i32, persistent: bool, limits: Limits) -> Machine {
        Machine {
            job_id: job_id.to_owned(),
            pid,
            persistent,
            limits,
            frames: FrameState::default(),
            phase: Phase::Running,
            terminal: None,
            imposed: None,
            after_terminal_violation: false,
            exited: false,
            grace_frames: 0,
            reused: false,
            violated: false,
            previous_job: None,
            earlier_jobs: Vec::new(),
            stale_frames: 0,
            unfinished: 0,
            unfinished_binary: false,
            arriving: false,
            frame_like: false,
            arriving_while_running: false,
            closed_stdout: false,
            stopped: false,
            stop_named: false,
            asked_to_stop: false,
            no_grace: false,
        }
    }

    /// The job this process served last, if any. A late frame of it that
    /// arrives during this job (written after its terminal, once this job
    /// was already sent) is dropped and retires the process after this job,
    /// which is not failed for it: the frame is not this job's doing.
    #[cfg(test)]
    pub(crate) fn after_job(mut self, previous: Option<String>) -> Machine {
        self.previous_job = previous;
        self
    }

    /// [`after_job`](Self::after_job), with the jobs the process served
    /// before that one: a late frame of any of them is treated as one of the
    /// previous job's (persistent-pool audit: one that reached the job after
    /// next failed it for good, PROTOCOL_UNEXPECTED_FRAME).
    pub(crate) fn after_jobs(mut self, previous: Option<String>, earlier: Vec<String>) -> Machine {
        self.previous_job = previous;
        self.earlier_jobs = earlier;
        self
    }

    /// Whether `job` is one this process served before this one.
    fn served_before(&self, job: &str) -> bool {
        Some(job) == self.previous_job.as_deref() || self.earlier_jobs.iter().any(|j| j == job)
    }

    /// How many bytes of a frame begun and never completed the executor's
    /// stdout holds now, and whether they still grow (the driver says so
    /// before each input).
    /// `growing`: its bytes grew lately; `frame_like`: they can begin a
    /// frame (`wire::may_begin_an_executor_frame`), where printed text
    /// most likely cannot.
    pub(crate) fn saw_unfinished(&mut self, bytes: usize, growing: bool, frame_like: bool) {
        self.unfinished = bytes;
        self.unfinished_binary = false;
        self.frame_like = bytes > 0 && frame_like;
        self.arriving = self.frame_like && growing;
        if self.phase == Phase::Running {
            self.arriving_while_running = self.arriving;
        }
    }

    /// The unfinished bytes last seen begin with no text and no frame's
    /// start (after [`Machine::saw_unfinished`]).
    pub(crate) fn saw_binary(&mut self, binary: bool) {
        self.unfinished_binary = self.unfinished > 0 && binary;
    }

    /// The frame left unfinished at the end was on its way when the job
    /// was stopped: the stop cut it off, the executor printed nothing.
    pub(crate) fn frame_cut_off(&self) -> bool {
        // or arriving now, as the process is about to be stopped (audit 97:
        // one begun in the cancel grace, still growing when it ended)
        self.arriving_while_running || self.arriving
    }

    /// Whether the process is stopped (SIGSTOP, SIGTSTP, a debugger), as
    /// read when a bound runs out: its silence is no hang of the executor's
    /// (stop audit: a stopped busy process's HEARTBEAT_TIMEOUT did not say
    /// so).
    pub(crate) fn saw_stopped(&mut self, stopped: bool) {
        self.stopped = stopped;
    }

    /// A second stop signal (the worker's forced stop) left the stop no
    /// grace, or ended the one that ran: an executor that gave no terminal
    /// was not given its grace (audit 81: "within its grace" read as if it
    /// had been, after a forced stop that sent no cancel and waited nothing).
    pub(crate) fn saw_no_grace(&mut self) {
        self.no_grace = true;
    }

    /// What a bound's message adds when the process was stopped.
    fn stopped_note(&mut self) -> &'static str {
        if self.stopped {
            self.stop_named = true;
            "; its process was stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger"
        } else {
            ""
        }
    }

    /// What a timeout's message adds when a frame was begun and never
    /// completed: most often text printed to stdout, whose first bytes read
    /// as a length (third-party audit: "no frame … for 3000 ms" after the
    /// executor had written its result behind a console.log; re-check
    /// audit: "answered nothing", then EXECUTOR_REFUSED). The bytes
    /// themselves go to the log, not into the message.
    fn unfinished_note(&self) -> String {
        match self.unfinished {
            0 => String::new(),
            // a large frame on its way when the bound ran out is no stray
            // text (audit 93: a 200 KB checkpoint cut by a timeout read as
            // a print)
            // (how many bytes came by then is in the log at the end: by
            // then more had come, audit 95)
            _ if self.arriving => "; a frame was still arriving".into(),
            // a frame's start whose rest never came is no print (audit 97)
            _ if self.frame_like => "; the executor stopped writing in the middle of a frame (its stdout holds the start of one that never completed)".into(),
            _ if self.unfinished_binary => "; bytes that never became a frame are on its stdout, neither text nor the start of a frame (the worker's log shows their first bytes)".into(),
            // no byte count: the log's, taken at the end, has more (audit 97)
            _ => "; bytes that never became a frame are on its stdout: did it print something there (stdout carries frames only; logs go to stderr)? The worker's log shows their first bytes".into(),
        }
    }

    /// The job this process served before this one.
    pub(crate) fn previous_job(&self) -> Option<&str> {
        self.previous_job.as_deref()
    }

    /// Whether `f` is a frame of a job this process served before this one
    /// (it says nothing of this job: no answer, no sign of life).
    pub(crate) fn names_a_served_job(&self, f: &FromExecutor) -> bool {
        job_frame(f).is_some_and(|(job, _)| self.served_before(job))
    }

    /// Frames of the previous job seen during this one.
    pub(crate) fn stale_frames(&self) -> u32 {
        self.stale_frames
    }

    /// Checks one frame: a frame of the previous job is counted and
    /// dropped; any other goes through [`on_frame`]. A terminal of the
    /// previous job once this job has begun answering (its first frame came)
    /// is not dropped: that job had its terminal already, and an executor
    /// that answers each job under the job before's id wrote exactly this,
    /// its real answer, which would never come under this job's id (the
    /// step stayed `running` until a timeout or a cancel; third-party audit,
    /// 4 of 4 such jobs). Either way the process broke the protocol and is
    /// not this job's doing: the job goes back to the queue uncounted, for a
    /// process that served no job, and this one is replaced.
    fn check(&mut self, f: FromExecutor) -> FrameVerdict {
        let job = job_frame(&f).map(|(job, _)| job);
        if let Some(stale) = job.filter(|j| self.served_before(j)) {
            self.stale_frames += 1;
            if self.frames.last_seq > 0
                && matches!(f, FromExecutor::Result(_) | FromExecutor::Error(_))
            {
                let previous = stale;
                return FrameVerdict::Impose(Outcome::GivenBack {
                    code: "EXECUTOR_CRASHED".into(),
                    message: format!(
                        "the warm process wrote a terminal ({}) of its previous job {previous:?} after its first frame for this job {:?}: \
                         is the executor answering each job with the previous one's job_id? The job goes back to the queue, \
                         uncounted, for a process that served no job, and this one is replaced",
                        f.name(),
                        self.job_id
                    ),
                });
            }
            return FrameVerdict::Continue;
        }
        on_frame(&mut self.frames, &self.job_id, self.pid, f)
    }

    /// What a timeout's (or an unanswered stop's) message adds when the
    /// process wrote frames of its previous job during this one (dropped):
    /// it was not silent, it answered under another job's id.
    fn stale_note(&self) -> String {
        match (self.stale_frames, self.previous_job.as_deref()) {
            (0, _) | (_, None) => String::new(),
            (n, Some(previous)) => format!(
                "; it wrote {n} frame(s) of its previous job {previous:?} meanwhile, which were dropped: is the executor answering this job with the previous one's job_id?"
            ),
        }
    }

    /// Whether a frame names this job (job ids are never reused: a frame
    /// that breaks the protocol under this job's id is this job's doing).
    fn names_this_job(&self, f: &FromExecutor) -> bool {
        job_frame(f).is_some_and(|(job, _)| job == self.job_id)
    }

    /// The job runs on a warm process that served jobs before it.
    pub(crate) fn reused(mut self, reused: bool) -> Machine {
        self.reused = reused;
        self
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the driver should read frames now (a cancel's grace reads a
    /// bounded number of them).
    pub(crate) fn wants_frames(&self) -> bool {
        match self.phase {
            Phase::Cancelling { .. } => self.grace_frames < GRACE_MAX_FRAMES,
            Phase::AfterTerminal { stdout_closed } => !stdout_closed,
            Phase::Finished => false,
            _ => true,
        }
    }

    pub(crate) fn accepted(&self) -> bool {
        self.frames.accepted
    }

    /// Whether the machine was told that the leader exited. The driver
    /// watches the exit until it was, also when it already happened: asking
    /// the process instead ("has it exited?") would miss an exit that came
    /// before the question, and the attempt would wait for the cancel grace.
    pub(crate) fn exited(&self) -> bool {
        self.exited
    }

    /// The executor ended the job with a terminal (it served a job).
    pub(crate) fn answered(&self) -> bool {
        self.terminal.is_some()
    }

    /// Whether anything but the executor decided the outcome or it ended
    /// without a terminal (for the driver's log).
    pub(crate) fn ended_without_terminal(&self) -> bool {
        self.terminal.is_none() && self.imposed.is_none()
    }

    /// The label of the imposed outcome, if any (the cancel frame's message).
    fn imposed_label(&self) -> String {
        self.imposed.as_ref().map(|o| o.label()).unwrap_or_default()
    }

    /// Feeds one input; returns what to do.
    pub(crate) fn on(&mut self, input: Input) -> Vec<Action> {
        if matches!(input, Input::Exited) && self.arriving {
            // a frame growing up to the process's end was cut off by it
            // (audit 95: one begun during the cancel grace, then SIGTERM)
            self.arriving_while_running = true;
        }
        match self.phase {
            Phase::Running => self.running(input),
            Phase::DrainingAfterExit => self.draining_after_exit(input),
            Phase::AfterTerminal { stdout_closed } => self.after_terminal(input, stdout_closed),
            Phase::DrainingAfterTerminal => self.draining_after_terminal(input),
            Phase::Cancelling { reason } => self.cancelling(input, reason),
            Phase::Finished => Vec::new(),
        }
    }

    /// A process that answers nothing to its job (frozen, deadlocked,
    /// stopped) within `bound` is replaced, and the job, which never
    /// started, goes back to the queue uncounted, as a refusal does; a
    /// frozen warm process held its job leased for ever when the step set
    /// no heartbeat_timeout_ms (throughput-core audit).
    fn unanswered(&mut self, bound: &str) -> Vec<Action> {
        if self.reused && self.unfinished > 0 {
            // bytes came, but no frame: on a warm process most likely what
            // an earlier job printed after its terminal, not this job's
            // silence, so it is not counted toward max_refusals either
            // (re-check audit: such strays refused an innocent step until
            // REFUSALS_EXHAUSTED); the next attempt takes a process that
            // served no job, where bytes so are its own
            self.imposed = Some(Outcome::Refused {
                code: "EXECUTOR_CRASHED".into(),
                message: format!(
                    "the warm process wrote {} bytes to stdout that never became a frame within {bound}, before any frame of this job: \
                     most likely what an earlier job wrote after its terminal (stdout carries frames only; logs go to stderr); \
                     the worker's log shows their first bytes. Its process is replaced and the job goes back to the queue, uncounted, \
                     for a process that served no job",
                    self.unfinished
                ),
            });
            return self.kill_unanswered();
        }
        let what = match self.unfinished {
            0 => format!("answered nothing to the job within {bound}"),
            n if self.unfinished_binary => format!(
                "wrote {n} bytes to stdout that never became a frame within {bound}, neither text nor \
                 the start of a frame; the worker's log shows their first bytes"
            ),
            n => format!(
                "wrote {n} bytes to stdout that never became a frame within {bound}: \
                 did it print something there (stdout carries frames only; logs go to stderr)? \
                 The worker's log shows their first bytes"
            ),
        };
        let stale = self.stale_note() + self.stopped_note();
        self.imposed = Some(Outcome::Refused {
            code: "EXECUTOR_UNRESPONSIVE".into(),
            message: format!(
                "the executor {what}{stale}; its process is replaced and the job goes back to the queue as a refusal (no attempt counted)"
            ),
        });
        self.kill_unanswered()
    }

    /// A warm process's stdout holds an unfinished "frame" after this job
    /// began answering: as with [`Input::Stalled`], most likely bytes an
    /// earlier job printed, whose length swallowed this job's own frames.
    fn hidden_by_stray(&self) -> bool {
        self.unfinished > 0 && self.strays_may_be_read()
    }

    /// After this job's first frame and before its terminal, on a process
    /// that served jobs before: what it writes then may be bytes an earlier
    /// job printed after its terminal, arriving only now. Each violation
    /// that bytes so can cause ([`Input::Stalled`], [`Machine::stream_failure`],
    /// [`Machine::not_named`], [`Machine::give_back_hidden`]) gives the job
    /// back uncounted ([`given_back_for_stray`]) rather than failing it.
    fn strays_may_be_read(&self) -> bool {
        self.reused && self.terminal.is_none() && self.frames.last_seq > 0
    }

    /// A bound ran out while [`Machine::hidden_by_stray`]: the job's frames
    /// may be what is hidden, so it goes back to the queue uncounted (not
    /// HEARTBEAT_TIMEOUT or ATTEMPT_TIMEOUT, counted: re-check audit, an
    /// innocent step failed so with `heartbeat_timeout_ms` under the 10–20 s
    /// a stall takes to be found), for a process that served no job.
    fn give_back_hidden(&mut self, bound: &str) -> Vec<Action> {
        self.imposed = Some(given_back_for_stray(&format!(
            "'s stdout held {} bytes of a frame that never completed when {bound} ran out",
            self.unfinished
        )));
        self.finish(false, false)
    }

    /// No frame of this job came (nor its terminal): the process has not
    /// read it, or is frozen. It is SIGKILLed at once, with no SIGTERM grace
    /// in which a process that was only slow could still read the job and
    /// run its handler after the attempt ended (given back, cancelled or
    /// released: re-check audit, a drain's job ran in the old process
    /// during that grace and again in the next attempt).
    fn kill_unanswered(&mut self) -> Vec<Action> {
        self.phase = Phase::Finished;
        vec![Action::Finish(Finish {
            reusable: false,
            wait_exit_first: false,
            kill_at_once: true,
        })]
    }

    /// Nothing of this job came from the executor: no frame, no terminal.
    fn unanswered_yet(&self) -> bool {
        self.frames.last_seq == 0 && self.terminal.is_none()
    }

    fn finish(&mut self, reusable: bool, wait_exit_first: bool) -> Vec<Action> {
        self.phase = Phase::Finished;
        vec![Action::Finish(Finish {
            reusable: reusable && self.stale_frames == 0,
            wait_exit_first,
            kill_at_once: false,
        })]
    }

    /// The supervisor stops the job: impose `outcome`, ask for the owed
    /// terminal, escalate after the grace.
    fn impose_and_cancel(&mut self, outcome: Outcome, reason: CancelReason) -> Vec<Action> {
        self.imposed = Some(outcome);
        self.asked_to_stop = true;
        self.phase = Phase::Cancelling { reason };
        vec![
            Action::SendCancel {
                reason,
                message: self.imposed_label(),
            },
            Action::ArmGrace,
        ]
    }

    fn running(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Abort => self.impose_and_cancel(
                Outcome::Released {
                    message: "the worker shut down while the attempt ran".into(),
                },
                CancelReason::Shutdown,
            ),
            Input::Cancel => self.impose_and_cancel(
                Outcome::Cancelled {
                    message: "cancelled on request".into(),
                },
                CancelReason::Requested,
            ),
            Input::LeaseLost => self.impose_and_cancel(
                Outcome::Abandoned {
                    why: "the lease was lost (or could not be renewed in time) while the executor ran"
                        .into(),
                },
                CancelReason::LeaseLost,
            ),
            Input::DeadlinePassed => self.impose_and_cancel(
                Outcome::failed(
                    "DEADLINE_EXCEEDED",
                    false,
                    "the step deadline passed during the attempt",
                ),
                CancelReason::Deadline,
            ),
            Input::AttemptTimedOut if self.hidden_by_stray() => {
                let ms = self.limits.timeout_ms.unwrap_or(0);
                self.give_back_hidden(&format!("timeout_ms = {ms}"))
            }
            Input::AttemptTimedOut => {
                let ms = self.limits.timeout_ms.unwrap_or(0);
                let why = self.unfinished_note() + self.stopped_note();
                self.impose_and_cancel(
                    Outcome::failed(
                        "ATTEMPT_TIMEOUT",
                        true,
                        format!("the attempt ran past timeout_ms = {ms}{why}"),
                    ),
                    CancelReason::AttemptTimeout,
                )
            }
            // a job that got no frame at all when the step's heartbeat
            // timeout runs out is the same unanswered job, whichever bound
            // comes first (third-party audit: HEARTBEAT_TIMEOUT, counted,
            // with heartbeat_timeout_ms at or below handshake_timeout_ms;
            // EXECUTOR_UNRESPONSIVE, uncounted, above it)
            Input::Silent if self.frames.last_seq == 0 && self.terminal.is_none() => {
                let ms = self.limits.silence_ms.unwrap_or(0);
                self.unanswered(&format!("heartbeat_timeout_ms = {ms}"))
            }
            Input::Silent if self.hidden_by_stray() => {
                let ms = self.limits.silence_ms.unwrap_or(0);
                self.give_back_hidden(&format!("heartbeat_timeout_ms = {ms}"))
            }
            Input::Silent => {
                let ms = self.limits.silence_ms.unwrap_or(0);
                let why = self.unfinished_note() + &self.stale_note() + self.stopped_note();
                self.impose_and_cancel(
                    Outcome::failed(
                        "HEARTBEAT_TIMEOUT",
                        true,
                        format!("no frame from the executor for {ms} ms{why}"),
                    ),
                    CancelReason::AttemptTimeout,
                )
            }
            // see `unanswered`
            Input::Unanswered { after_ms } if self.unanswered_yet() => {
                self.unanswered(&format!("handshake_timeout_ms = {after_ms}"))
            }
            Input::Unanswered { .. } => Vec::new(),
            // a warm process's stdout stuck inside a "frame" after this job
            // began answering: most often bytes an earlier job left (a print
            // after its terminal) that arrived once this job ran, read as a
            // length that swallowed this job's own frames, its terminal too
            // (persistent-pool audit: the job stayed running for 7 minutes,
            // six others queued behind it). The job goes back uncounted for
            // a process that served no job; on a process's first job the
            // bytes are its own (a timeout, if the step has one, decides)
            Input::Stalled { bytes } if self.strays_may_be_read() => {
                self.imposed = Some(given_back_for_stray(&format!(
                    "'s stdout has held {bytes} bytes of a frame that never completed"
                )));
                self.finish(false, false)
            }
            Input::Stalled { .. } => Vec::new(),
            Input::Exited => {
                // its last frames may still be in the pipe: those before a
                // stream error count, then the error does
                self.exited = true;
                self.phase = Phase::DrainingAfterExit;
                vec![Action::StartDrain]
            }
            Input::Frame(f) => {
                let own = self.names_this_job(&f);
                match self.check(f) {
                    FrameVerdict::Continue => Vec::new(),
                    FrameVerdict::Write(i) => vec![Action::Persist(i)],
                    FrameVerdict::Terminal(t) => {
                        self.terminal = Some(t);
                        self.job_done()
                    }
                    FrameVerdict::Impose(o) => {
                        self.imposed = Some(self.not_named(o, own));
                        // a frame naming this job is this job's doing
                        self.violated = !own;
                        self.finish(false, false)
                    }
                }
            }
            Input::StreamError { code, message } => {
                self.imposed = Some(self.stream_failure(code, message));
                self.violated = true;
                self.finish(false, false)
            }
            // stdout closed while the leader runs: no terminal can come. The
            // leader gets the grace to exit on its own first: one that closes
            // stdout is usually exiting, and its own exit status is the
            // evidence (signalled at once, it read "killed by SIGTERM")
            Input::StdoutClosed => {
                self.closed_stdout = true;
                self.finish(false, true)
            }
            Input::DrainEnded | Input::GraceEnded => Vec::new(),
        }
    }

    /// What bytes on stdout that are no frame make of this job. On a warm
    /// process, after this job's first frame and before its terminal, they
    /// may as well be what an earlier job printed after its terminal: a
    /// short stray (`\x05GARB`) is completed by this job's own next frame
    /// and the two read as one malformed frame (outside audit: the next job,
    /// innocent, failed for good, PROTOCOL_MALFORMED_FRAME, and its run with
    /// it). The job goes back to the queue uncounted, for a process that
    /// served no job, where such bytes are the job's own and count; so a
    /// handler that prints to stdout costs one attempt more, never a
    /// failure of a job that did nothing wrong. Before the first frame the
    /// verdict gives the job back (as a refusal); elsewhere they count.
    fn stream_failure(&self, code: &'static str, message: String) -> Outcome {
        if self.strays_may_be_read() && code.starts_with("PROTOCOL_") {
            return given_back_for_stray(&format!(" wrote what is no frame ({code}: {message})"));
        }
        Outcome::failed(code, code == "EXECUTOR_CRASHED", message)
    }

    /// What a violation by a frame that does not name this job makes of it.
    /// On a warm process, after this job's first frame and before its
    /// terminal, such a frame may as well be bytes an earlier job printed
    /// that happen to decode (`\x00` is an empty frame "of no known kind";
    /// re-check audit: the next job, innocent, failed for good,
    /// PROTOCOL_UNEXPECTED_FRAME): given back uncounted, as bytes that are
    /// no frame are ([`Machine::stream_failure`]), for a process that served
    /// no job, where it counts.
    fn not_named(&self, o: Outcome, own: bool) -> Outcome {
        let Outcome::Failed { code, message, .. } = &o else {
            return o;
        };
        if own || !self.strays_may_be_read() {
            return o;
        }
        given_back_for_stray(&format!(
            " wrote a frame that is not this job's ({code}: {message})"
        ))
    }

    /// The terminal came while the process runs: a persistent process waits
    /// for its next job (a frame it writes between jobs is caught when the
    /// session is taken again); any other gets EOF and must exit cleanly.
    fn job_done(&mut self) -> Vec<Action> {
        if self.persistent && !self.exited {
            return self.finish(true, false);
        }
        self.phase = Phase::AfterTerminal {
            stdout_closed: false,
        };
        vec![Action::CloseStdin, Action::ArmGrace]
    }

    fn draining_after_exit(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Frame(f) => {
                if self.terminal.is_some() {
                    self.after_terminal_violation = true;
                    return self.finish(false, false);
                }
                if self.imposed.is_some() {
                    // a violation decided it; the rest is not looked at
                    return Vec::new();
                }
                let own = self.names_this_job(&f);
                match self.check(f) {
                    FrameVerdict::Continue => Vec::new(),
                    FrameVerdict::Write(i) => vec![Action::Persist(i)],
                    FrameVerdict::Terminal(t) => {
                        self.terminal = Some(t);
                        Vec::new()
                    }
                    FrameVerdict::Impose(o) => {
                        self.imposed = Some(self.not_named(o, own));
                        self.violated = !own;
                        Vec::new()
                    }
                }
            }
            Input::StreamError { code, message } => {
                if self.terminal.is_some() {
                    self.after_terminal_violation = true;
                } else if self.imposed.is_none() {
                    self.imposed = Some(self.stream_failure(code, message));
                    self.violated = true;
                }
                self.finish(false, false)
            }
            Input::StdoutClosed | Input::DrainEnded => {
                if self.terminal.is_some() && self.imposed.is_none() {
                    // what a grandchild may still write after the terminal
                    self.phase = Phase::DrainingAfterTerminal;
                    return vec![Action::StartDrain];
                }
                self.finish(false, false)
            }
            // the drain is bounded; control inputs wait for its end
            _ => Vec::new(),
        }
    }

    fn after_terminal(&mut self, input: Input, stdout_closed: bool) -> Vec<Action> {
        match input {
            Input::Frame(_) | Input::StreamError { .. } => {
                self.after_terminal_violation = true;
                self.finish(false, false)
            }
            Input::StdoutClosed => {
                self.phase = Phase::AfterTerminal {
                    stdout_closed: true,
                };
                Vec::new()
            }
            Input::Exited => {
                self.exited = true;
                if stdout_closed {
                    return self.finish(false, false);
                }
                self.phase = Phase::DrainingAfterTerminal;
                vec![Action::StartDrain]
            }
            // did not exit after its terminal: it is stopped
            Input::GraceEnded => self.finish(false, false),
            _ => Vec::new(),
        }
    }

    fn draining_after_terminal(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Frame(_) | Input::StreamError { .. } => {
                self.after_terminal_violation = true;
                self.finish(false, false)
            }
            Input::StdoutClosed | Input::DrainEnded => self.finish(false, false),
            _ => Vec::new(),
        }
    }

    fn cancelling(&mut self, input: Input, reason: CancelReason) -> Vec<Action> {
        match input {
            // the bound of the first answer runs on during a stop: one that
            // ran out with nothing answered ends the stop's grace at once
            Input::Unanswered { .. } if self.unanswered_yet() => self.kill_unanswered(),
            Input::GraceEnded | Input::StdoutClosed | Input::StreamError { .. } => {
                self.cancel_done(reason)
            }
            Input::Exited => {
                self.exited = true;
                self.cancel_done(reason)
            }
            Input::Frame(f) => {
                self.grace_frames += 1;
                match self.check(f) {
                    FrameVerdict::Terminal(t) => {
                        self.terminal = Some(t);
                        self.cancel_done(reason)
                    }
                    FrameVerdict::Write(i) => vec![Action::PersistIfRoom(i)],
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        }
    }

    /// The grace is over (or the terminal came): a persistent process that
    /// answered a cancel or an imposed timeout in time may serve again; one
    /// that did not is killed and replaced.
    fn cancel_done(&mut self, reason: CancelReason) -> Vec<Action> {
        if !self.exited && self.unanswered_yet() {
            return self.kill_unanswered();
        }
        let answered = self.terminal.is_some() && !self.exited;
        let may_serve = matches!(
            reason,
            CancelReason::Requested | CancelReason::AttemptTimeout | CancelReason::Deadline
        );
        if self.persistent && answered && may_serve {
            return self.finish(true, false);
        }
        self.finish(false, answered)
    }

    /// The attempt's verdict once the child is gone (or kept).
    pub(crate) fn verdict(self, own_cancel: bool, exit_text: &str) -> Verdict {
        // how it ended says nothing of the stdout it closed first (audit
        // 93: "ended without a terminal (killed by SIGTERM)" for a handler
        // that closed its frames' descriptor and ran on)
        let closed;
        let exit_text = if self.closed_stdout {
            closed = format!("{exit_text}, after it closed its stdout while it still ran");
            closed.as_str()
        } else {
            exit_text
        };
        // a warm process that ended without one frame for this job ended
        // on its own (it may have been on its way out as it was taken): the
        // job is not to blame, so it goes back to the queue uncounted, as a
        // refusal does (PROTOCOL.md: never an innocent job's failure)
        if self.reused
            && self.imposed.is_none()
            && self.terminal.is_none()
            && self.frames.last_seq == 0
            && !self.after_terminal_violation
        {
            return Verdict::Outcome(Outcome::Refused {
                code: "EXECUTOR_CRASHED".into(),
                message: format!(
                    "the warm process ended before it answered this job ({exit_text}); the job goes back to the queue, uncounted, for a new process"
                ),
            });
        }
        // a warm process whose stdout broke the protocol before one frame of
        // this job (bytes that are no frame, a frame out of place): what it
        // wrote after its previous job's terminal, once this job was already
        // sent, reads as this job's first bytes. It is not this job's doing:
        // the job goes back to the queue uncounted, as above, and the
        // process is replaced (audit: a stray print 20 ms after a terminal
        // failed the next job for good, PROTOCOL_MALFORMED_FRAME). A job
        // that starts a fresh process meets no such leftover: its own
        // violations count.
        if self.reused && self.violated && self.terminal.is_none() && self.frames.last_seq == 0 {
            let what = match &self.imposed {
                Some(Outcome::Failed { code, message, .. }) => format!("{code}: {message}"),
                Some(o) => o.label(),
                None => String::new(),
            };
            return Verdict::Outcome(Outcome::Refused {
                code: "EXECUTOR_CRASHED".into(),
                message: format!(
                    "the warm process wrote what is no frame of this job before its first frame for it ({what}): most likely left on its stdout after its previous job's terminal; the job goes back to the queue, uncounted, for a new process"
                ),
            });
        }
        // how the executor took the stop, for the imposed outcome's message:
        // what it answered (other than CANCELLED), or that it gave nothing
        // (the cancellation audit found both in no record: an answer of
        // its own was dropped, an executor killed at the grace's end read
        // like one that stopped at once)
        let note =
            (self.asked_to_stop && !self.after_terminal_violation).then(|| match &self.terminal {
                // whole: the redactor sees it before it is stored (a cut
                // could leave a secret's first bytes where it cannot)
                Some(Terminal::Error(e)) if e.code != "CANCELLED" => {
                    Some(format!("; the executor answered {}: {}", e.code, e.message))
                }
                // a confirmation, with what the handler did meanwhile when
                // the SDK says it (`details.handler_error`: the handler's own
                // error or panic after the cancel; SDK audit: it was in no
                // table and no log)
                Some(Terminal::Error(e)) => handler_error(&e.details)
                    .map(|h| format!("; the handler's own error after the stop: {h}")),
                Some(_) => None,
                // frames of the job before, dropped, may have been this
                // job's answer under the wrong id (re-check audit: the
                // message alone read like a hang)
                // no grace is waited for a stopped process (re-check audit:
                // "within its grace" read as if one had been)
                // said once (stop audit: a heartbeat timeout's message named
                // the stop twice)
                None if self.stopped && self.stop_named => {
                    Some(format!("; the executor gave no terminal ({exit_text}){}", self.stale_note()))
                }
                None if self.stopped => Some(format!(
                    "; the executor gave no terminal: its process was stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger ({exit_text}){}",
                    self.stale_note()
                )),
                None if self.no_grace => Some(format!(
                    "; the executor gave no terminal before a second stop signal ended its grace ({exit_text}){}",
                    self.stale_note()
                )),
                None => Some(format!(
                    "; the executor gave no terminal within its grace ({exit_text}){}",
                    self.stale_note()
                )),
            });
        let verdict = precedence(
            self.imposed,
            self.terminal,
            self.frames.accepted,
            own_cancel,
            self.after_terminal_violation,
            exit_text,
        );
        match (verdict, note.flatten()) {
            (Verdict::Outcome(o), Some(note)) => Verdict::Outcome(o.noted(&note)),
            (v, _) => v,
        }
    }
}
