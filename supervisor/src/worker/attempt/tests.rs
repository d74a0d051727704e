//! Table-driven tests of the attempt's pure parts: frame checks, the attempt
//! machine, and the precedence of outcomes.

use super::*;
use crate::wire::{EventKind, JobError};

fn job() -> wire::Job {
    wire::Job {
        job_id: "j".into(),
        workflow_run_id: String::new(),
        step_run_id: String::new(),
        idempotency_key: String::new(),
        executor_kind: "go".into(),
        kind: "k".into(),
        attempt: 1,
        deadline_unix_ms: 0,
        attempt_deadline_unix_ms: 0,
        heartbeat_timeout_ms: 0,
        input: vec![],
        input_artifacts: vec![],
        checkpoint: None,
        output_dir: String::new(),
        secrets: Default::default(),
        labels: Default::default(),
        agreement: None,
    }
}

fn ev(seq: u64, kind: EventKind, message: &str) -> FromExecutor {
    FromExecutor::Event(wire::Event {
        job_id: "j".into(),
        sequence: seq,
        kind,
        message: message.into(),
        fraction: None,
        checkpoint: None,
        at_unix_ms: 0,
    })
}

fn err(seq: u64, code: &str, retryable: bool) -> JobError {
    JobError {
        job_id: "j".into(),
        sequence: seq,
        code: code.into(),
        message: "m".into(),
        retryable,
        details: vec![],
        next_retry_delay_ms: None,
    }
}

fn res(seq: u64) -> JobResult {
    JobResult {
        job_id: "j".into(),
        sequence: seq,
        output: b"{}".to_vec(),
        artifacts: vec![],
    }
}

fn kind_of(v: &FrameVerdict) -> String {
    match v {
        FrameVerdict::Continue => "continue".into(),
        FrameVerdict::Write(Intent::Start { .. }) => "start".into(),
        FrameVerdict::Write(Intent::Event(_)) => "event".into(),
        FrameVerdict::Terminal(Terminal::Result(_)) => "result".into(),
        FrameVerdict::Terminal(Terminal::Error(_)) => "error".into(),
        FrameVerdict::Impose(Outcome::Failed { code, .. }) => code.clone(),
        FrameVerdict::Impose(o) => o.label(),
    }
}

#[test]
fn frame_sequences() {
    use EventKind::*;
    // each row: the frames of one job, and what each one leads to
    let rows: Vec<(Vec<FromExecutor>, Vec<&str>)> = vec![
        (
            vec![
                ev(1, Accepted, ""),
                ev(2, Progress, "p"),
                FromExecutor::Result(res(3)),
            ],
            vec!["start", "event", "result"],
        ),
        (vec![ev(1, Progress, "")], vec!["PROTOCOL_UNEXPECTED_FRAME"]),
        (
            vec![ev(1, Accepted, ""), ev(1, Progress, "")],
            vec!["start", "PROTOCOL_SEQUENCE_REGRESSION"],
        ),
        (
            vec![ev(1, Accepted, ""), ev((1 << 53) - 1, Progress, "")],
            vec!["start", "event"],
        ),
        (
            vec![ev(1, Accepted, ""), ev(1 << 53, Progress, "")],
            vec!["start", "PROTOCOL_SEQUENCE_OUT_OF_RANGE"],
        ),
        // PROTOCOL.md: ACCEPTED, sequence 1 (the conformance kit fails it too)
        (
            vec![ev(5, Accepted, "")],
            vec!["PROTOCOL_SEQUENCE_OUT_OF_RANGE"],
        ),
        // ...0 too, as PROTOCOL.md's table says (it was a "regression" from
        // no frame at all), and a first frame of any kind at 0
        (
            vec![ev(0, Accepted, "")],
            vec!["PROTOCOL_SEQUENCE_OUT_OF_RANGE"],
        ),
        (
            vec![FromExecutor::Error(err(0, "EXECUTOR_BUSY", true))],
            vec!["PROTOCOL_SEQUENCE_OUT_OF_RANGE"],
        ),
        (
            vec![ev(1, Accepted, ""), FromExecutor::Result(res(u64::MAX))],
            vec!["start", "PROTOCOL_SEQUENCE_OUT_OF_RANGE"],
        ),
        (
            vec![ev(1, Accepted, ""), ev(2, Accepted, "")],
            vec!["start", "PROTOCOL_UNEXPECTED_FRAME"],
        ),
        (
            vec![ev(1, Accepted, ""), ev(2, Heartbeat, "")],
            vec!["start", "continue"],
        ),
        (
            vec![FromExecutor::Result(res(1))],
            vec!["PROTOCOL_UNEXPECTED_FRAME"],
        ),
        (vec![FromExecutor::Error(err(1, "X", true))], vec!["error"]),
        // a NUL anywhere the database stores text: refused at the wire
        (
            vec![ev(1, Accepted, ""), ev(2, Progress, "a\0b")],
            vec!["start", "PROTOCOL_INVALID_TEXT"],
        ),
        (
            vec![
                ev(1, Accepted, ""),
                FromExecutor::Error(JobError {
                    message: "x\0".into(),
                    ..err(2, "E", true)
                }),
            ],
            vec!["start", "PROTOCOL_INVALID_TEXT"],
        ),
        (
            vec![FromExecutor::Error(err(1, "E\0", true))],
            vec!["PROTOCOL_INVALID_TEXT"],
        ),
    ];
    for (frames, want) in rows {
        let mut st = FrameState::default();
        let got: Vec<String> = frames
            .into_iter()
            .map(|f| kind_of(&on_frame(&mut st, &job().job_id, 7, f)))
            .collect();
        assert_eq!(got, want);
    }
}

fn label(v: &Verdict) -> String {
    match v {
        Verdict::Outcome(o) => o.label(),
        Verdict::Verify(_) => "verify".into(),
    }
}

#[test]
fn precedence_of_outcomes() {
    let cancelled = || Outcome::Cancelled {
        message: "c".into(),
    };
    let timeout = || Outcome::failed("ATTEMPT_TIMEOUT", true, "t");
    let lost = || Outcome::Abandoned { why: "l".into() };
    let released = || Outcome::Released {
        message: "r".into(),
    };
    // (imposed, terminal, accepted, own_cancel, after_terminal) -> verdict
    type Row = (
        Option<Outcome>,
        Option<Terminal>,
        bool,
        bool,
        bool,
        &'static str,
    );
    let rows: Vec<Row> = vec![
        (
            None,
            Some(Terminal::Result(res(2))),
            true,
            false,
            false,
            "verify",
        ),
        (
            None,
            Some(Terminal::Result(res(2))),
            true,
            false,
            true,
            "failed (PROTOCOL_FRAME_AFTER_TERMINAL)",
        ),
        // a cancel answered by a result within the grace keeps the result
        (
            Some(cancelled()),
            Some(Terminal::Result(res(2))),
            true,
            true,
            false,
            "verify",
        ),
        (
            Some(cancelled()),
            Some(Terminal::Error(err(2, "CANCELLED", false))),
            true,
            true,
            false,
            "cancelled",
        ),
        (Some(cancelled()), None, true, true, false, "cancelled"),
        // the supervisor's own verdicts win over the executor's terminal
        (
            Some(timeout()),
            Some(Terminal::Result(res(2))),
            true,
            false,
            false,
            "failed (ATTEMPT_TIMEOUT)",
        ),
        (
            Some(lost()),
            Some(Terminal::Result(res(2))),
            true,
            false,
            false,
            "abandoned (lease lost)",
        ),
        (
            Some(released()),
            None,
            true,
            false,
            false,
            "released (worker shutdown)",
        ),
        // a drain's stop answered by a result within the grace keeps it,
        // unless it has artifacts to store (the stop budget)
        (
            Some(released()),
            Some(Terminal::Result(res(2))),
            true,
            false,
            false,
            "verify",
        ),
        (
            Some(released()),
            Some(Terminal::Result(JobResult {
                artifacts: vec![wire::ManifestEntry {
                    name: "a".into(),
                    path: "a".into(),
                    sha256: String::new(),
                    size: 0,
                    media_type: String::new(),
                    derived_from: vec![],
                }],
                ..res(2)
            })),
            true,
            false,
            false,
            "released (worker shutdown)",
        ),
        // errors before accepted: refusal or terminal failure
        (
            None,
            Some(Terminal::Error(err(1, "UNSUPPORTED_KIND", false))),
            false,
            false,
            false,
            "refused (UNSUPPORTED_KIND)",
        ),
        (
            None,
            Some(Terminal::Error(err(1, "BUSY_NOW", true))),
            false,
            false,
            false,
            "refused (BUSY_NOW)",
        ),
        (
            None,
            Some(Terminal::Error(err(1, "", false))),
            false,
            false,
            false,
            "refused (EXECUTOR_REFUSED)",
        ),
        // a refusal's code is checked as a failure's (re-check audit)
        (
            None,
            Some(Terminal::Error(err(1, "DEADLINE_EXCEEDED", true))),
            false,
            false,
            false,
            "refused (EXECUTOR_REFUSED)",
        ),
        (
            None,
            Some(Terminal::Error(err(1, "X\u{1b}]0;T\u{7}", true))),
            false,
            false,
            false,
            "refused (EXECUTOR_REFUSED)",
        ),
        (
            None,
            Some(Terminal::Error(err(1, "BAD_INPUT", false))),
            false,
            false,
            false,
            "failed (BAD_INPUT)",
        ),
        // CANCELLED is a cancel only when we asked for one
        (
            None,
            Some(Terminal::Error(err(2, "CANCELLED", false))),
            true,
            true,
            false,
            "cancelled",
        ),
        (
            None,
            Some(Terminal::Error(err(2, "CANCELLED", false))),
            true,
            false,
            false,
            "failed (CANCELLED)",
        ),
        (
            None,
            Some(Terminal::Error(err(2, "E", true))),
            true,
            false,
            false,
            "failed (E)",
        ),
        (None, None, true, false, false, "failed (EXECUTOR_CRASHED)"),
    ];
    for (imposed, terminal, accepted, own_cancel, after, want) in rows {
        let got = precedence(
            imposed.clone(),
            terminal.clone(),
            accepted,
            own_cancel,
            after,
            "exit 0",
        );
        assert_eq!(
            label(&got),
            want,
            "imposed {imposed:?}, terminal {terminal:?}"
        );
    }
}

#[test]
fn redaction_of_outcomes() {
    let r = Redact::default();
    r.set(&std::collections::BTreeMap::from([(
        "TOKEN".to_string(),
        "s3cr3t-value".to_string(),
    )]));
    let o = r.outcome(Outcome::Failed {
        code: "E".into(),
        message: "token s3cr3t-value leaked".into(),
        retryable: true,
        details: Some(serde_json::json!({"k": ["x s3cr3t-value"], "s3cr3t-value": 1})),
        next_retry_delay_ms: None,
        sequence: None,
    });
    let text = format!("{o:?}");
    assert!(!text.contains("s3cr3t-value"), "{text}");
}

#[test]
fn inputs_whose_names_sanitize_alike_get_files_of_their_own() {
    let in_dir = std::path::Path::new("/w/in");
    let mut taken = std::collections::HashSet::new();
    let mut p = |step: &str, name: &str| {
        input_path(in_dir, &mut taken, step, name)
            .to_string_lossy()
            .into_owned()
    };
    assert_eq!(p("a", "x/y"), "/w/in/a/x_y");
    assert_eq!(p("a", "x_y"), "/w/in/a/x_y~2");
    assert_eq!(p("a", "x?y"), "/w/in/a/x_y~3");
    assert_eq!(p("a", "ü.csv"), "/w/in/a/_.csv");
    assert_eq!(p("a", "é.csv"), "/w/in/a/_~2.csv");
    assert_eq!(p("a", ".hidden"), "/w/in/a/_.hidden");
    assert_eq!(p("a", "_.hidden"), "/w/in/a/_~2.hidden");
    // steps whose names sanitize alike share a directory, not a file
    assert_eq!(p("b/c", "out"), "/w/in/b_c/out");
    assert_eq!(p("b_c", "out"), "/w/in/b_c/out~2");
    assert_eq!(p("b_c", "other"), "/w/in/b_c/other");
}

#[test]
fn a_name_that_needs_no_change_keeps_its_path() {
    let in_dir = std::path::Path::new("/w/in");
    let paths: Vec<String> = input_paths(
        in_dir,
        [
            ("p", "x y.txt"),
            ("p", "x?y.txt"),
            ("p", "x_y.txt"),
            ("b/c", "out"),
            ("b_c", "out"),
            ("p", "x_y.txt"),
        ]
        .into_iter(),
    )
    .iter()
    .map(|p| p.to_string_lossy().into_owned())
    .collect();
    assert_eq!(
        paths,
        [
            "/w/in/p/x_y~2.txt",
            "/w/in/p/x_y~3.txt",
            "/w/in/p/x_y.txt",
            "/w/in/b_c/out~2",
            "/w/in/b_c/out",
            "/w/in/p/x_y~4.txt",
        ]
    );
}

#[test]
fn sanitizes_names() {
    assert_eq!(sanitize("report.csv"), "report.csv");
    assert_eq!(sanitize("../etc/passwd"), "_.._etc_passwd");
    assert_eq!(sanitize(""), "_");
    // a name the file system would refuse is cut, its extension kept; names
    // cut alike still get files of their own (security and DAG audits: a
    // 300-byte artifact name failed every downstream step ENAMETOOLONG)
    let long = format!("{}.csv", "n".repeat(300));
    assert_eq!(sanitize(&long), format!("{}.csv", "n".repeat(196)));
    assert_eq!(sanitize(&"é".repeat(300)), "_".repeat(200));
    let no_ext = format!("{}.{}", "a".repeat(250), "x".repeat(40));
    assert_eq!(sanitize(&no_ext), "a".repeat(200));
    let mut taken = std::collections::HashSet::new();
    let in_dir = std::path::Path::new("/w/in");
    let first = input_path(in_dir, &mut taken, "up", &long);
    let second = input_path(
        in_dir,
        &mut taken,
        "up",
        &format!("{}x.csv", "n".repeat(300)),
    );
    assert_ne!(first, second);
    for p in [first, second] {
        assert!(p.file_name().expect("name").len() < 255, "{p:?}");
    }
}

#[test]
fn plain_progress_is_coalesced_and_the_rest_kept_in_order() {
    let mk = |seq: u64, kind: EventKind, cp: bool| wire::Event {
        job_id: "j".into(),
        sequence: seq,
        kind,
        message: String::new(),
        fraction: None,
        checkpoint: cp.then(|| b"c".to_vec()),
        at_unix_ms: 0,
    };
    use EventKind::*;
    let evs = [
        mk(2, Progress, false),
        mk(3, Progress, true),
        mk(4, Running, false),
        mk(5, Progress, false),
        mk(6, Progress, false),
        mk(7, Heartbeat, true),
    ];
    let refs: Vec<&wire::Event> = evs.iter().collect();
    let kept: Vec<u64> = coalesce(&refs).iter().map(|e| e.sequence).collect();
    assert_eq!(kept, vec![3, 4, 6, 7]);
    assert!(coalesce(&[]).is_empty());
}

#[test]
fn an_executor_cannot_forge_the_supervisors_verdicts() {
    for (reported, want) in [
        ("LEASE_EXPIRED", "EXECUTOR_ERROR"),
        ("HEARTBEAT_TIMEOUT", "EXECUTOR_ERROR"),
        ("PROTOCOL_MALFORMED_FRAME", "EXECUTOR_ERROR"),
        ("WORKER_SHUTDOWN", "EXECUTOR_ERROR"),
        ("", "EXECUTOR_ERROR"),
        ("MY_OWN_CODE", "MY_OWN_CODE"),
        ("CANCELLED", "CANCELLED"),
        ("E2BIG_2", "E2BIG_2"),
        // not UPPER_SNAKE_CASE: no policy could name it (re-check audit)
        ("lower_code", "EXECUTOR_ERROR"),
        ("X\u{1b}[31mY", "EXECUTOR_ERROR"),
        ("BAD-INPUT", "EXECUTOR_ERROR"),
    ] {
        let mut e = err(2, reported, true);
        e.details = br#"{"k": 1}"#.to_vec();
        match executor_failure(e) {
            Outcome::Failed { code, details, .. } => {
                assert_eq!(code, want, "{reported}");
                let d = details.expect("details kept");
                assert_eq!(d["k"], 1);
                if want != reported && !reported.is_empty() {
                    assert_eq!(d["reported_code"], reported);
                }
            }
            other => panic!("{other:?}"),
        }
    }
}

/// What a sequence of inputs makes the machine do: its actions (short
/// names), the phase it ends in and, once finished, the verdict.
/// A frame of the job `id` (the table's own job is "j", the one before it "prev").
fn of_job(id: &str, mut f: FromExecutor) -> Input {
    match &mut f {
        FromExecutor::Event(e) => e.job_id = id.into(),
        FromExecutor::Result(r) => r.job_id = id.into(),
        FromExecutor::Error(e) => e.job_id = id.into(),
        _ => {}
    }
    Input::Frame(f)
}

fn run_machine(persistent: bool, inputs: Vec<Input>) -> (Vec<String>, Phase, Option<String>) {
    let mut m = Machine::new(
        "j",
        7,
        persistent,
        Limits {
            timeout_ms: Some(1000),
            silence_ms: Some(500),
        },
    )
    .after_job(Some("prev".into()));
    let mut actions = Vec::new();
    let mut finished = false;
    for i in inputs {
        for a in m.on(i) {
            actions.push(match a {
                Action::Persist(Intent::Start { .. }) => "persist start".to_string(),
                Action::Persist(Intent::Event(_)) => "persist event".into(),
                Action::PersistIfRoom(_) => "persist if room".into(),
                Action::SendCancel { reason, .. } => format!("cancel {reason:?}"),
                Action::CloseStdin => "close stdin".into(),
                Action::ArmGrace => "grace".into(),
                Action::StartDrain => "drain".into(),
                Action::Finish(f) => {
                    finished = true;
                    format!(
                        "finish{}{}",
                        if f.reusable { " keep" } else { "" },
                        if f.wait_exit_first { " wait" } else { "" }
                    )
                }
            });
        }
    }
    let phase = m.phase();
    let verdict = finished.then(|| label(&m.verdict(false, "exit status: 0")));
    (actions, phase, verdict)
}

fn accepted() -> Input {
    Input::Frame(ev(1, EventKind::Accepted, ""))
}
fn progress(seq: u64) -> Input {
    Input::Frame(ev(seq, EventKind::Progress, "p"))
}
fn result_frame(seq: u64) -> Input {
    Input::Frame(FromExecutor::Result(res(seq)))
}
fn error_frame(seq: u64, code: &str) -> Input {
    Input::Frame(FromExecutor::Error(err(seq, code, false)))
}

#[test]
fn attempt_machine_table() {
    use Input::*;
    type Row = (
        &'static str,
        bool,
        Vec<Input>,
        Vec<&'static str>,
        Phase,
        Option<&'static str>,
    );
    let rows: Vec<Row> = vec![
        (
            "one-shot success: EOF on stdin, a clean exit after the terminal",
            false,
            vec![
                accepted(),
                progress(2),
                result_frame(3),
                StdoutClosed,
                Exited,
            ],
            vec![
                "persist start",
                "persist event",
                "close stdin",
                "grace",
                "finish",
            ],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "persistent success: the process is kept for the next job",
            true,
            vec![accepted(), result_frame(2)],
            vec!["persist start", "finish keep"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "a frame after the terminal overrides the result",
            false,
            vec![accepted(), result_frame(2), progress(3)],
            vec!["persist start", "close stdin", "grace", "finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_FRAME_AFTER_TERMINAL)"),
        ),
        (
            "no exit within the grace after the terminal: stopped, the result kept",
            false,
            vec![accepted(), result_frame(2), GraceEnded],
            vec!["persist start", "close stdin", "grace", "finish"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "exit after the terminal: a grandchild's late frame is a violation",
            false,
            vec![accepted(), result_frame(2), Exited, progress(3)],
            vec!["persist start", "close stdin", "grace", "drain", "finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_FRAME_AFTER_TERMINAL)"),
        ),
        (
            "exit first, then the frames still in the pipe count",
            false,
            vec![Exited, accepted(), result_frame(2), DrainEnded, DrainEnded],
            vec!["drain", "persist start", "drain", "finish"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "exit with a frame after the terminal in the pipe",
            false,
            vec![Exited, accepted(), result_frame(2), progress(3)],
            vec!["drain", "persist start", "finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_FRAME_AFTER_TERMINAL)"),
        ),
        (
            "exit without a terminal: crashed",
            false,
            vec![accepted(), Exited, DrainEnded],
            vec!["persist start", "drain", "finish"],
            Phase::Finished,
            Some("failed (EXECUTOR_CRASHED)"),
        ),
        (
            "a stream error in the pipe after exit is the outcome",
            false,
            vec![
                accepted(),
                Exited,
                StreamError {
                    code: "PROTOCOL_MALFORMED_FRAME",
                    message: "bad".into(),
                },
            ],
            vec!["persist start", "drain", "finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_MALFORMED_FRAME)"),
        ),
        (
            "stdout closed while the leader runs: no terminal can come; it may exit on its own first",
            false,
            vec![accepted(), StdoutClosed],
            vec!["persist start", "finish wait"],
            Phase::Finished,
            Some("failed (EXECUTOR_CRASHED)"),
        ),
        (
            "cancel answered within the grace by a persistent process: kept",
            true,
            vec![accepted(), Cancel, error_frame(2, "CANCELLED")],
            vec!["persist start", "cancel Requested", "grace", "finish keep"],
            Phase::Finished,
            Some("cancelled"),
        ),
        (
            "cancel answered by a one-shot process: it may exit on its own first",
            false,
            vec![accepted(), Cancel, error_frame(2, "CANCELLED")],
            vec!["persist start", "cancel Requested", "grace", "finish wait"],
            Phase::Finished,
            Some("cancelled"),
        ),
        (
            "cancel answered by a result: the work was done, the result kept",
            false,
            vec![accepted(), Cancel, result_frame(2)],
            vec!["persist start", "cancel Requested", "grace", "finish wait"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "cancel not answered within the grace: killed, cancelled",
            true,
            vec![accepted(), Cancel, progress(2), GraceEnded],
            vec![
                "persist start",
                "cancel Requested",
                "grace",
                "persist if room",
                "finish",
            ],
            Phase::Finished,
            Some("cancelled"),
        ),
        (
            "a lost lease: the persistent process is not reused, nothing is written",
            true,
            vec![accepted(), LeaseLost, error_frame(2, "CANCELLED")],
            vec!["persist start", "cancel LeaseLost", "grace", "finish wait"],
            Phase::Finished,
            Some("abandoned (lease lost)"),
        ),
        (
            "the worker's abort: released, not counted",
            false,
            vec![accepted(), Abort, Exited],
            vec!["persist start", "cancel Shutdown", "grace", "finish"],
            Phase::Finished,
            Some("released (worker shutdown)"),
        ),
        (
            "deadline: non-retryable, its own code",
            false,
            vec![accepted(), DeadlinePassed, GraceEnded],
            vec!["persist start", "cancel Deadline", "grace", "finish"],
            Phase::Finished,
            Some("failed (DEADLINE_EXCEEDED)"),
        ),
        (
            "attempt timeout answered by a persistent process: kept, still a timeout",
            true,
            vec![accepted(), AttemptTimedOut, error_frame(2, "CANCELLED")],
            vec![
                "persist start",
                "cancel AttemptTimeout",
                "grace",
                "finish keep",
            ],
            Phase::Finished,
            Some("failed (ATTEMPT_TIMEOUT)"),
        ),
        (
            "silence: a heartbeat timeout",
            false,
            vec![accepted(), Silent, Exited],
            vec!["persist start", "cancel AttemptTimeout", "grace", "finish"],
            Phase::Finished,
            Some("failed (HEARTBEAT_TIMEOUT)"),
        ),
        (
            "a violation ends it at once, no cancel",
            false,
            vec![progress(1)],
            vec!["finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_UNEXPECTED_FRAME)"),
        ),
        (
            "a cancel during the drain after exit waits for the drain's end",
            false,
            vec![
                Exited,
                Cancel,
                accepted(),
                result_frame(2),
                StdoutClosed,
                DrainEnded,
            ],
            vec!["drain", "persist start", "drain", "finish"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "still running: control inputs are what it waits for",
            false,
            vec![accepted(), progress(2), GraceEnded, DrainEnded],
            vec!["persist start", "persist event"],
            Phase::Running,
            None,
        ),
        (
            "after finishing, inputs do nothing",
            false,
            vec![accepted(), StdoutClosed, Cancel, result_frame(2)],
            vec!["persist start", "finish wait"],
            Phase::Finished,
            Some("failed (EXECUTOR_CRASHED)"),
        ),
        (
            "persistent: late frames of the previous job are dropped (its terminal too, before this job's first frame); this job is not failed for them, the process is not kept",
            true,
            vec![
                of_job("prev", ev(9, EventKind::Progress, "late")),
                of_job("prev", FromExecutor::Result(res(10))),
                accepted(),
                of_job("prev", ev(11, EventKind::Progress, "late")),
                result_frame(2),
            ],
            vec!["persist start", "finish"],
            Phase::Finished,
            Some("verify"),
        ),
        (
            "persistent: a terminal of the previous job after this job's first frame (this job's answer under the previous id?) gives the job back uncounted, the process not kept",
            true,
            vec![
                accepted(),
                of_job("prev", FromExecutor::Result(res(2))),
                result_frame(3),
            ],
            vec!["persist start", "finish"],
            Phase::Finished,
            Some("given back (EXECUTOR_CRASHED)"),
        ),
        (
            "persistent: so does the previous job's error terminal",
            true,
            vec![
                accepted(),
                progress(2),
                of_job("prev", FromExecutor::Error(err(3, "BOOM", false))),
            ],
            vec!["persist start", "persist event", "finish"],
            Phase::Finished,
            Some("given back (EXECUTOR_CRASHED)"),
        ),
        (
            "no frame at all when the heartbeat timeout runs out: the job was never answered, given back uncounted",
            false,
            vec![Silent],
            vec!["finish"],
            Phase::Finished,
            Some("refused (EXECUTOR_UNRESPONSIVE)"),
        ),
        (
            "the same on a warm process, after late frames of its previous job",
            true,
            vec![of_job("prev", ev(9, EventKind::Progress, "late")), Silent],
            vec!["finish"],
            Phase::Finished,
            Some("refused (EXECUTOR_UNRESPONSIVE)"),
        ),
        (
            "a frame of a job this process did not serve last is a violation",
            true,
            vec![accepted(), of_job("other", ev(2, EventKind::Progress, "?"))],
            vec!["persist start", "finish"],
            Phase::Finished,
            Some("failed (PROTOCOL_UNEXPECTED_FRAME)"),
        ),
    ];
    for (name, persistent, inputs, want_actions, want_phase, want_verdict) in rows {
        let (actions, phase, verdict) = run_machine(persistent, inputs);
        assert_eq!(actions, want_actions, "{name}: actions");
        assert_eq!(phase, want_phase, "{name}: phase");
        assert_eq!(verdict.as_deref(), want_verdict, "{name}: verdict");
    }
}

/// A heartbeat timeout with a frame begun and never completed on stdout
/// says so (text printed to stdout reads as a frame's length): the message
/// names the bytes, not what they are (those go to the log).
/// A late frame of a job the process served before the previous one (it
/// reached the job after next) is the process's fault as the previous
/// job's is: dropped (its terminal after this job's first frame gives the
/// job back uncounted), never this job's violation; a job the process never
/// served is one.
#[test]
fn a_late_frame_of_an_earlier_job_is_the_processs_fault() {
    let run = |inputs: Vec<Input>| {
        let mut m = Machine::new(
            "j",
            7,
            true,
            Limits {
                timeout_ms: None,
                silence_ms: None,
            },
        )
        .after_jobs(Some("prev".into()), vec!["older".into(), "oldest".into()]);
        for i in inputs {
            m.on(i);
        }
        label(&m.verdict(false, "exit status: 0"))
    };
    assert_eq!(
        run(vec![
            accepted(),
            of_job("oldest", ev(99, EventKind::Progress, "late")),
            result_frame(2)
        ]),
        "verify"
    );
    assert_eq!(
        run(vec![
            accepted(),
            of_job("older", FromExecutor::Result(res(5)))
        ]),
        "given back (EXECUTOR_CRASHED)"
    );
    assert_eq!(
        run(vec![
            accepted(),
            of_job("never", ev(2, EventKind::Progress, "?"))
        ]),
        "failed (PROTOCOL_UNEXPECTED_FRAME)"
    );
}

/// A warm process's stdout stuck inside a "frame" once its job began
/// answering (bytes an earlier job printed, read as a length that hid this
/// job's frames) gives the job back uncounted; on a process's first job the
/// stall is the job's own and changes nothing (its timeout decides).
#[test]
fn a_stalled_stdout_gives_a_warm_processs_job_back() {
    let run = |reused: bool, inputs: Vec<Input>| {
        let mut m = Machine::new(
            "j",
            7,
            true,
            Limits {
                timeout_ms: None,
                silence_ms: None,
            },
        )
        .reused(reused)
        .after_jobs(reused.then(|| "prev".to_string()), Vec::new());
        let mut finished = false;
        for i in inputs {
            finished |= m.on(i).iter().any(|a| matches!(a, Action::Finish(_)));
        }
        (
            finished,
            m.phase(),
            label(&m.verdict(false, "exit status: 0")),
        )
    };
    let stalled = || Input::Stalled { bytes: 468 };
    assert_eq!(
        run(true, vec![accepted(), stalled()]),
        (
            true,
            Phase::Finished,
            "given back (EXECUTOR_CRASHED)".into()
        )
    );
    let (finished, phase, _) = run(false, vec![accepted(), stalled()]);
    assert!(
        !finished && phase == Phase::Running,
        "a first job's own stall waits"
    );
    let (finished, phase, _) = run(true, vec![stalled()]);
    assert!(
        !finished && phase == Phase::Running,
        "before any frame the unanswered-job clock decides"
    );
}

/// A job that got no frame at all says which bound ran out, and names the
/// dropped frames of the previous job when there were some.
#[test]
fn an_unanswered_job_names_its_bound_and_stale_frames() {
    let limits = Limits {
        timeout_ms: None,
        silence_ms: Some(3000),
    };
    let mut m = Machine::new("j", 7, true, limits).after_job(Some("prev".into()));
    m.on(of_job("prev", ev(9, EventKind::Progress, "late")));
    m.on(Input::Silent);
    match m.verdict(false, "exited with code 0") {
        Verdict::Outcome(Outcome::Refused { code, message }) => {
            assert_eq!(code, "EXECUTOR_UNRESPONSIVE");
            assert!(
                message.contains("within heartbeat_timeout_ms = 3000")
                    && message.contains("1 frame(s) of its previous job \"prev\""),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// A stop (cancel, drain) of a job whose every frame named the job before,
/// its terminal too: "no terminal within its grace" alone sent its author
/// looking for a hang (re-check audit); the dropped frames are named.
#[test]
fn a_stop_unanswered_but_under_an_earlier_id_names_the_dropped_frames() {
    let limits = Limits {
        timeout_ms: None,
        silence_ms: None,
    };
    let mut m = Machine::new("j", 7, true, limits).after_job(Some("prev".into()));
    m.on(of_job("prev", ev(1, EventKind::Accepted, "")));
    m.on(Input::Cancel);
    m.on(of_job(
        "prev",
        FromExecutor::Error(err(2, "CANCELLED", false)),
    ));
    m.on(Input::GraceEnded);
    m.on(Input::Exited);
    let message = match m.verdict(false, "killed by SIGKILL") {
        Verdict::Outcome(Outcome::Cancelled { message }) => message,
        other => panic!("{other:?}"),
    };
    assert!(
        message.contains("gave no terminal within its grace (killed by SIGKILL)")
            && message.contains("2 frame(s) of its previous job \"prev\""),
        "{message}"
    );
}

/// A bound that ran out on a process stopped by a signal says so: its
/// silence is not the executor's hang (stop audit).
#[test]
fn a_bound_run_out_on_a_stopped_process_says_it_was_stopped() {
    let limits = Limits {
        timeout_ms: Some(9000),
        silence_ms: Some(3000),
    };
    let message = |input: Input, stopped: bool| {
        let mut m = Machine::new("j", 7, false, limits);
        m.on(accepted());
        m.saw_stopped(stopped);
        m.on(input);
        m.on(Input::Exited);
        match m.verdict(false, "killed by SIGTERM") {
            Verdict::Outcome(Outcome::Failed { message, .. }) => message,
            other => panic!("{other:?}"),
        }
    };
    let said = "its process was stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger";
    for input in [|| Input::Silent, || Input::AttemptTimedOut] {
        // once (stop audit: the bound's message and the stop's note both
        // named it)
        assert_eq!(
            message(input(), true).matches(said).count(),
            1,
            "{}",
            message(input(), true)
        );
        assert!(
            !message(input(), false).contains("stopped"),
            "{}",
            message(input(), false)
        );
    }
    // a cancel's grace that ended on a stopped process (re-check audit:
    // "gave no terminal within its grace" alone blamed the executor)
    let cancelled = |stopped: bool| {
        let mut m = Machine::new("j", 7, false, limits);
        m.on(accepted());
        m.on(Input::Cancel);
        m.saw_stopped(stopped);
        m.on(Input::GraceEnded);
        m.on(Input::Exited);
        match m.verdict(false, "killed by SIGTERM") {
            Verdict::Outcome(Outcome::Cancelled { message }) => message,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        cancelled(true).matches(said).count(),
        1,
        "{}",
        cancelled(true)
    );
    assert!(
        !cancelled(false).contains("stopped"),
        "{}",
        cancelled(false)
    );
}

/// A large frame still on its way when a bound runs out is no stray text
/// (audit 93: a 200 KB checkpoint cut by a timeout was blamed on a print),
/// and one left unfinished by the stop was cut off by it; the start of a
/// frame that stopped growing is no print either (audit 97); bytes that
/// cannot begin a frame are named as a possible print, growing or not
/// (audit 95: a progress line printed every 200 ms).
#[test]
fn a_frame_on_its_way_when_the_job_is_stopped_is_not_called_a_print() {
    let limits = Limits {
        timeout_ms: Some(7000),
        silence_ms: None,
    };
    let print = "; bytes that never became a frame are on its stdout: did it print something there";
    let stalled = "; the executor stopped writing in the middle of a frame";
    for (growing, frame_like, note, cut_off) in [
        (true, true, "; a frame was still arriving", true),
        (false, true, stalled, false),
        (false, false, print, false),
        (true, false, print, false),
    ] {
        let case = format!("growing {growing}, frame-like {frame_like}");
        let mut m = Machine::new("j", 7, false, limits);
        m.on(accepted());
        m.saw_unfinished(61440, growing, frame_like);
        m.on(Input::AttemptTimedOut);
        // during the grace the bytes stop growing: the process is killed
        m.saw_unfinished(61440, false, frame_like);
        m.on(Input::GraceEnded);
        m.on(Input::Exited);
        assert_eq!(m.frame_cut_off(), cut_off, "{case}");
        match m.verdict(false, "killed by SIGTERM") {
            Verdict::Outcome(Outcome::Failed { code, message, .. }) => {
                assert_eq!(code, "ATTEMPT_TIMEOUT");
                assert!(
                    message.starts_with(&format!("the attempt ran past timeout_ms = 7000{note}")),
                    "{case}: {message}"
                );
                assert_eq!(
                    message.contains("did it print"),
                    !frame_like,
                    "{case}: {message}"
                );
                // no count the log's, taken later, would contradict
                assert!(!message.contains("61440"), "{case}: {message}");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A frame begun after the stop began (during the cancel grace) and growing
/// when the grace ends (the process is then stopped) or until the process
/// ended was cut off by the stop, not printed (audits 95, 97); one that
/// stopped growing long before was not.
#[test]
fn a_frame_growing_until_the_process_ends_was_cut_off() {
    let limits = Limits {
        timeout_ms: Some(1500),
        silence_ms: None,
    };
    for (arriving_at_end, cut_off) in [(true, true), (false, false)] {
        let mut m = Machine::new("j", 7, false, limits);
        m.on(accepted());
        m.saw_unfinished(0, false, false);
        m.on(Input::AttemptTimedOut);
        m.saw_unfinished(1_966_080, true, true);
        m.on(progress(2));
        // the grace ends with the frame still growing, or stalled
        m.saw_unfinished(2_228_224, arriving_at_end, true);
        m.on(Input::GraceEnded);
        assert_eq!(
            m.frame_cut_off(),
            cut_off,
            "at the grace's end {arriving_at_end}"
        );
        m.saw_unfinished(2_228_224, arriving_at_end, true);
        m.on(Input::Exited);
        assert_eq!(m.frame_cut_off(), cut_off, "at the exit {arriving_at_end}");
    }
}

/// An executor that closes its stdout and runs on is said to have done so,
/// not only how it was ended (audit 93).
#[test]
fn a_stdout_closed_while_the_process_runs_is_named() {
    let mut m = Machine::new("j", 7, false, Limits::default());
    m.on(accepted());
    m.on(Input::StdoutClosed);
    m.on(Input::Exited);
    match m.verdict(false, "killed by SIGTERM") {
        Verdict::Outcome(Outcome::Failed { code, message, .. }) => {
            assert_eq!(code, "EXECUTOR_CRASHED");
            assert_eq!(
                message,
                "the executor ended without a terminal (killed by SIGTERM, after it closed its stdout while it still ran)"
            );
        }
        other => panic!("{other:?}"),
    }
    // one that exits and so closes stdout is told as before
    let mut m = Machine::new("j", 7, false, Limits::default());
    m.on(accepted());
    m.on(Input::Exited);
    m.on(Input::StdoutClosed);
    match m.verdict(false, "exited with code 3") {
        Verdict::Outcome(Outcome::Failed { message, .. }) => assert_eq!(
            message,
            "the executor ended without a terminal (exited with code 3)"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_silence_behind_an_unfinished_frame_says_what_may_have_printed() {
    let limits = Limits {
        timeout_ms: None,
        silence_ms: Some(3000),
    };
    let message_of = |unfinished, binary| {
        let mut m = Machine::new("j", 7, false, limits);
        m.on(accepted());
        m.saw_unfinished(unfinished, false, false);
        m.saw_binary(binary);
        m.on(Input::Silent);
        m.on(Input::Exited);
        match m.verdict(false, "exited with code 0") {
            Verdict::Outcome(Outcome::Failed { code, message, .. }) => {
                assert_eq!(code, "HEARTBEAT_TIMEOUT");
                message
            }
            other => panic!("{other:?}"),
        }
    };
    let message = |unfinished| message_of(unfinished, false);
    assert!(!message(0).contains("never became"), "{}", message(0));
    let m = message(89);
    assert!(
        m.starts_with(
            "no frame from the executor for 3000 ms; bytes that never became a frame are on its stdout"
        ) && m.contains("did it print something there"),
        "{m}"
    );
    // bytes that are no text are not asked about as a print (audit 105)
    let m = message_of(64, true);
    assert!(
        m.starts_with(
            "no frame from the executor for 3000 ms; bytes that never became a frame are on its stdout, neither text nor the start of a frame"
        ) && !m.contains("print"),
        "{m}"
    );
}

#[test]
fn a_cancels_grace_reads_a_bounded_number_of_frames() {
    let mut m = Machine::new("j", 7, false, Limits::default());
    m.on(accepted());
    m.on(Input::Cancel);
    for seq in 2..(2 + GRACE_MAX_FRAMES as u64) {
        assert!(m.wants_frames());
        m.on(progress(seq));
    }
    assert!(
        !m.wants_frames(),
        "a flood during the grace cannot hold the stop"
    );
    assert!(matches!(m.phase(), Phase::Cancelling { .. }));
}

#[test]
fn an_artifact_derives_only_from_this_steps_inputs() {
    let input = wire::InputArtifact {
        id: "0190f5c4-0000-7000-8000-000000000001".into(),
        name: "raw".into(),
        sha256: String::new(),
        size: 0,
        media_type: String::new(),
        path: String::new(),
        step_name: "fetch".into(),
    };
    let inputs: std::collections::HashMap<&str, &wire::InputArtifact> =
        [(input.id.as_str(), &input)].into_iter().collect();
    let entry = |derived: &[&str]| wire::ManifestEntry {
        name: "clean".into(),
        path: "clean.csv".into(),
        sha256: "AB".into(),
        size: 2,
        media_type: String::new(),
        derived_from: derived.iter().map(|d| d.to_string()).collect(),
    };
    let ok = derived_ids(&entry(&[input.id.as_str()]), &inputs).map_err(|o| o.label());
    assert_eq!(ok, Ok(vec![Uuid::parse_str(&input.id).unwrap()]));
    assert_eq!(
        derived_ids(&entry(&[]), &inputs).map_err(|o| o.label()),
        Ok(vec![])
    );
    // a name that is not one of this step's inputs (here: the input's name,
    // not its id) fails the result
    let bad = derived_ids(&entry(&["raw"]), &inputs).map_err(|o| o.label());
    assert_eq!(bad, Err("failed (ARTIFACT_INVALID)".to_string()));
    // the row: digest in lower case, the default media type
    let row = new_artifact(&entry(&[]), vec![]);
    assert_eq!(row.sha256, "ab");
    assert_eq!(row.media_type, "application/octet-stream");
    assert_eq!(row.size, 2);
}

/// A child's stderr logged as one line: a traceback's line breaks and a
/// terminal escape are escaped, so it cannot forge log lines of its own.
#[test]
fn an_executors_text_is_logged_as_one_line() {
    use super::one_line;
    assert_eq!(one_line("plain\ttext"), "plain\ttext");
    assert_eq!(
        one_line("Traceback:\n  File x\r\n2026-12-04T00:00:00Z  INFO forged"),
        "Traceback:\\n  File x\\r\\n2026-12-04T00:00:00Z  INFO forged"
    );
    assert_eq!(one_line("\u{1b}[2Jgone"), "\\u{1b}[2Jgone");
    assert_eq!(one_line("héllo ✓"), "héllo ✓");
}

/// Details are a JSON object: other JSON is kept under "value", text that
/// is not JSON under "unparsed", and a JSON null is no details at all.
#[test]
fn error_details_are_always_an_object() {
    use super::machine::parse_details;
    use serde_json::json;
    assert_eq!(parse_details(b""), None);
    assert_eq!(parse_details(b"null"), None);
    assert_eq!(parse_details(br#"{"a":1}"#), Some(json!({"a": 1})));
    assert_eq!(parse_details(b"[1,2,3]"), Some(json!({"value": [1, 2, 3]})));
    assert_eq!(parse_details(b"\"text\""), Some(json!({"value": "text"})));
    assert_eq!(
        parse_details(b"not json"),
        Some(json!({"unparsed": "not json"}))
    );
}

#[test]
fn an_artifact_path_that_is_not_a_regular_file_is_invalid_whatever_its_declared_size() {
    let out = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(out.path().join("sub")).expect("sub");
    std::fs::write(out.path().join("f.txt"), b"abc").expect("file");
    let real_out = std::fs::canonicalize(out.path()).expect("canonical");
    let entry = |path: &str, size: u64| wire::ManifestEntry {
        name: path.into(),
        path: path.into(),
        sha256: String::new(),
        size,
        media_type: String::new(),
        derived_from: vec![],
    };
    for size in [1, 4096] {
        let got = artifact_file(out.path(), &real_out, &entry("sub", size), 1 << 20)
            .map(|(_, n)| n)
            .map_err(|o| o.label());
        assert_eq!(
            got,
            Err("failed (ARTIFACT_INVALID)".to_string()),
            "size {size}"
        );
    }
    let got = artifact_file(out.path(), &real_out, &entry("f.txt", 3), 1 << 20)
        .map(|(_, n)| n)
        .map_err(|o| o.label());
    assert_eq!(got, Ok(3));
}

/// A manifest path that names no file below the output directory is refused
/// saying what is wrong with it (audit 94: "." was told it had a '..').
#[test]
fn a_manifest_path_that_names_no_file_below_the_output_dir_says_why() {
    let out = tempfile::tempdir().expect("tempdir");
    let real_out = std::fs::canonicalize(out.path()).expect("canonical");
    for (path, says) in [
        ("", "is empty"),
        ("/etc/passwd", "is absolute"),
        ("../x", "without '..'"),
        ("a/../../x", "without '..'"),
        (".", "not '.'"),
    ] {
        let entry = wire::ManifestEntry {
            name: "n".into(),
            path: path.into(),
            sha256: String::new(),
            size: 1,
            media_type: String::new(),
            derived_from: vec![],
        };
        match artifact_file(out.path(), &real_out, &entry, 1 << 20) {
            Err(Outcome::Failed { code, message, .. }) => {
                assert_eq!(code, "ARTIFACT_INVALID", "{path:?}");
                assert!(
                    message.starts_with(&format!("artifact \"n\": path {path:?} "))
                        && message.contains(says),
                    "{path:?}: {message}"
                );
            }
            other => panic!("{path:?}: {other:?}"),
        }
    }
}

/// A warm process that ends without a frame for its job is not the job's
/// fault: a refusal (uncounted), where a fresh process's end is a crash; once
/// the process answered the job, its end is the job's crash either way.
#[test]
fn a_reused_process_that_ends_before_answering_is_a_refusal() {
    let limits = || Limits {
        timeout_ms: None,
        silence_ms: None,
    };
    let run = |reused: bool, inputs: Vec<Input>| {
        let mut m = Machine::new("j", 7, true, limits()).reused(reused);
        for i in inputs {
            m.on(i);
        }
        label(&m.verdict(false, "exit status: 0"))
    };
    assert_eq!(run(true, vec![Input::Exited]), "refused (EXECUTOR_CRASHED)");
    assert_eq!(run(false, vec![Input::Exited]), "failed (EXECUTOR_CRASHED)");
    assert_eq!(
        run(true, vec![accepted(), Input::Exited]),
        "failed (EXECUTOR_CRASHED)"
    );
}

/// A warm process that breaks the protocol before one frame of its job
/// (bytes left from its previous job) gives the job back uncounted, as a
/// refusal; bytes that are no frame after its first frame, before its
/// terminal, give it back uncounted too (they may be an earlier job's); a
/// fresh process's violations are the job's.
#[test]
fn a_reused_process_that_breaks_the_protocol_before_answering_is_a_refusal() {
    let limits = || Limits {
        timeout_ms: None,
        silence_ms: None,
    };
    let malformed = || Input::StreamError {
        code: "PROTOCOL_MALFORMED_FRAME",
        message: "malformed frame".into(),
    };
    let wrong_job = || of_job("other", ev(1, EventKind::Accepted, ""));
    let run = |reused: bool, inputs: Vec<Input>| {
        let mut m = Machine::new("j", 7, true, limits()).reused(reused);
        for i in inputs {
            m.on(i);
        }
        label(&m.verdict(false, "exit status: 0"))
    };
    for (reused, inputs, want) in [
        (true, vec![malformed()], "refused (EXECUTOR_CRASHED)"),
        (true, vec![wrong_job()], "refused (EXECUTOR_CRASHED)"),
        (
            false,
            vec![malformed()],
            "failed (PROTOCOL_MALFORMED_FRAME)",
        ),
        (
            false,
            vec![wrong_job()],
            "failed (PROTOCOL_UNEXPECTED_FRAME)",
        ),
        // after its first frame: bytes an earlier job printed may have
        // been read with this job's own frame (outside audit), so the job
        // goes back uncounted for a process that served no job
        (
            true,
            vec![accepted(), malformed()],
            "given back (EXECUTOR_CRASHED)",
        ),
        (
            true,
            vec![accepted(), Input::Exited, malformed()],
            "given back (EXECUTOR_CRASHED)",
        ),
        // where a fresh process's are the job's own
        (
            false,
            vec![accepted(), malformed()],
            "failed (PROTOCOL_MALFORMED_FRAME)",
        ),
        // so is a frame that is not this job's (a stray `\x00` decodes as
        // an empty frame; re-check audit)
        (
            true,
            vec![accepted(), wrong_job()],
            "given back (EXECUTOR_CRASHED)",
        ),
        (
            true,
            vec![accepted(), Input::Exited, wrong_job()],
            "given back (EXECUTOR_CRASHED)",
        ),
        (
            false,
            vec![accepted(), wrong_job()],
            "failed (PROTOCOL_UNEXPECTED_FRAME)",
        ),
        // a reused process's after the job's terminal: the job stands
        (
            true,
            vec![accepted(), result_frame(2), Input::Exited, malformed()],
            "verify",
        ),
        (
            true,
            vec![Input::Exited, malformed()],
            "refused (EXECUTOR_CRASHED)",
        ),
        // a frame under this job's own id is this job's (ids are unique)
        (
            true,
            vec![of_job("j", ev(0, EventKind::Accepted, ""))],
            "failed (PROTOCOL_SEQUENCE_OUT_OF_RANGE)",
        ),
    ] {
        assert_eq!(run(reused, inputs), want, "reused {reused}");
    }
}

/// An imposed outcome says how the executor took the stop: what it
/// answered (not CANCELLED), or that it gave no terminal and how it ended.
/// Before, an answer of its own was dropped and an executor killed at the
/// end of its grace read like one that stopped at once (cancellation audit).
#[test]
fn a_stop_records_how_the_executor_took_it() {
    let message = |inputs: Vec<Input>, exit_text: &str| {
        let mut m = Machine::new(
            "j",
            7,
            false,
            Limits {
                timeout_ms: Some(1000),
                silence_ms: None,
            },
        );
        for i in inputs {
            m.on(i);
        }
        match m.verdict(true, exit_text) {
            Verdict::Outcome(Outcome::Cancelled { message }) => message,
            Verdict::Outcome(Outcome::Released { message }) => format!("released: {message}"),
            Verdict::Outcome(Outcome::Failed { code, message, .. }) => format!("{code}: {message}"),
            v => panic!("{v:?}"),
        }
    };
    assert_eq!(
        message(
            vec![accepted(), Input::Cancel, error_frame(2, "FLAKY")],
            "exit status: 0"
        ),
        "cancelled on request; the executor answered FLAKY: m"
    );
    assert_eq!(
        message(
            vec![accepted(), Input::Cancel, error_frame(2, "CANCELLED")],
            "exit status: 0"
        ),
        "cancelled on request"
    );
    // a confirmation that says what the handler raised meanwhile keeps it
    // (SDK audit: the handler's own error was in no table and no log)
    let mut confirmed = err(2, "CANCELLED", false);
    confirmed.details =
        br#"{"reason": "REQUESTED", "handler_error": "ExecutorError: OTHER: other error"}"#
            .to_vec();
    assert_eq!(
        message(
            vec![
                accepted(),
                Input::Cancel,
                Input::Frame(FromExecutor::Error(confirmed))
            ],
            "exit status: 0"
        ),
        "cancelled on request; the handler's own error after the stop: ExecutorError: OTHER: other error"
    );
    assert_eq!(
        message(
            vec![accepted(), Input::Cancel, Input::GraceEnded],
            "killed by SIGKILL"
        ),
        "cancelled on request; the executor gave no terminal within its grace (killed by SIGKILL)"
    );
    // a forced stop (a second stop signal) gives no grace, and says so
    // (audit 81)
    let mut m = Machine::new(
        "j",
        7,
        false,
        Limits {
            timeout_ms: None,
            silence_ms: None,
        },
    );
    m.on(accepted());
    m.on(Input::Abort);
    m.saw_no_grace();
    m.on(Input::Exited);
    match m.verdict(false, "exit status: 0") {
        Verdict::Outcome(Outcome::Released { message }) => assert!(
            message.ends_with(
                "; the executor gave no terminal before a second stop signal ended its grace (exit status: 0)"
            ),
            "{message}"
        ),
        v => panic!("{v:?}"),
    }
    assert_eq!(
        message(
            vec![accepted(), Input::AttemptTimedOut, error_frame(2, "BUSY")],
            "exit status: 1"
        ),
        "ATTEMPT_TIMEOUT: the attempt ran past timeout_ms = 1000; the executor answered BUSY: m"
    );
    // a drain's stop too
    assert_eq!(
        message(
            vec![accepted(), Input::Abort, error_frame(2, "MY_STOP")],
            "exit status: 0"
        ),
        "released: the worker shut down while the attempt ran; the executor answered MY_STOP: m"
    );
    // no stop asked: an executor's own failure is as it said
    assert_eq!(
        message(vec![accepted(), error_frame(2, "BUSY")], "exit status: 1"),
        "BUSY: m"
    );
}

/// A job answered by nothing within `handshake_timeout_ms` (a frozen or
/// deadlocked process) is given back uncounted and its process replaced,
/// SIGKILLed at once (it must not read the job later); once any frame of the
/// job came, the bound no longer applies.
#[test]
fn a_job_answered_by_nothing_is_given_back_and_its_process_replaced() {
    let run = |persistent: bool, inputs: Vec<Input>| {
        let mut m = Machine::new("j", 7, persistent, Limits::default());
        let mut actions = Vec::new();
        for i in inputs {
            actions.extend(m.on(i));
        }
        let replaced = actions.iter().any(|a| {
            matches!(
                a,
                Action::Finish(Finish {
                    reusable: false,
                    wait_exit_first: false,
                    kill_at_once: true,
                })
            )
        });
        (label(&m.verdict(false, "killed by SIGKILL")), replaced)
    };
    for persistent in [true, false] {
        assert_eq!(
            run(persistent, vec![Input::Unanswered { after_ms: 1000 }]),
            ("refused (EXECUTOR_UNRESPONSIVE)".to_owned(), true),
            "persistent {persistent}"
        );
    }
    // a job that was answered, then stopped, gets the SIGTERM and its grace
    let mut m = Machine::new("j", 7, false, Limits::default());
    m.on(accepted());
    m.on(Input::Cancel);
    let finish = m.on(Input::GraceEnded);
    assert!(
        matches!(
            finish.as_slice(),
            [Action::Finish(Finish {
                kill_at_once: false,
                ..
            })]
        ),
        "{finish:?}"
    );
    // a stop (cancel, drain, lease lost, timeout) of a job with no answer
    // kills it at once too, at the bound or at the end of the stop's grace:
    // a slow process read the job in the SIGTERM grace and ran it while the
    // attempt ended without it (re-check audit: a drain's job ran twice)
    let kills_at_once = |actions: &[Action]| {
        matches!(
            actions,
            [Action::Finish(Finish {
                reusable: false,
                wait_exit_first: false,
                kill_at_once: true,
            })]
        )
    };
    type Stop = fn() -> Input;
    let stops: [(&str, Stop); 4] = [
        ("cancel", || Input::Cancel),
        ("drain", || Input::Abort),
        ("lease lost", || Input::LeaseLost),
        ("timeout", || Input::AttemptTimedOut),
    ];
    for (stop, input) in stops {
        for persistent in [true, false] {
            let mut m = Machine::new("j", 7, persistent, Limits::default());
            m.on(input());
            let finish = m.on(Input::Unanswered { after_ms: 1000 });
            assert!(kills_at_once(&finish), "{stop}, bound: {finish:?}");
            let mut m = Machine::new("j", 7, persistent, Limits::default());
            m.on(input());
            let finish = m.on(Input::GraceEnded);
            assert!(kills_at_once(&finish), "{stop}, grace: {finish:?}");
        }
    }
    // answered during the stop's grace: the bound is over
    let mut m = Machine::new("j", 7, true, Limits::default());
    m.on(Input::Abort);
    m.on(accepted());
    assert!(m.on(Input::Unanswered { after_ms: 1000 }).is_empty());
    // accepted first: the bound is over, the job runs on
    let mut m = Machine::new("j", 7, true, Limits::default());
    m.on(accepted());
    assert!(m.on(Input::Unanswered { after_ms: 1000 }).is_empty());
    assert_eq!(m.phase(), Phase::Running);
    // bytes that never became a frame (text printed to stdout) are named,
    // not called "answered nothing" (re-check audit)
    let mut m = Machine::new("j", 7, false, Limits::default());
    m.saw_unfinished(113, false, false);
    m.on(Input::Unanswered { after_ms: 3000 });
    match m.verdict(false, "killed by SIGKILL") {
        Verdict::Outcome(Outcome::Refused { code, message }) => {
            assert_eq!(code, "EXECUTOR_UNRESPONSIVE");
            assert!(
                message.starts_with(
                    "the executor wrote 113 bytes to stdout that never became a frame within handshake_timeout_ms = 3000: did it print something there"
                ),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// Bytes of an unfinished frame pending on a warm process when a bound runs
/// out are most likely an earlier job's stray, not this job's doing: before
/// the job's first frame the job is refused as EXECUTOR_CRASHED (which
/// `max_refusals` does not count), after it given back uncounted; on a
/// process's first job, and with nothing pending, the bounds count as
/// before (re-check audit: strays refused an innocent step until
/// REFUSALS_EXHAUSTED, or failed it with HEARTBEAT_TIMEOUT).
#[test]
fn a_bound_run_out_on_a_warm_process_holding_stray_bytes_is_no_fault_of_the_job() {
    let limits = || Limits {
        timeout_ms: Some(5000),
        silence_ms: Some(3000),
    };
    let run = |reused: bool, pending: usize, answered: bool, bound: Input| {
        let mut m = Machine::new("j", 7, true, limits()).reused(reused);
        if answered {
            m.on(accepted());
        }
        m.saw_unfinished(pending, false, false);
        m.on(bound);
        if m.phase() != Phase::Finished {
            // a cancel's grace: the executor gives nothing more
            m.on(Input::GraceEnded);
        }
        label(&m.verdict(false, "killed by SIGKILL"))
    };
    let unanswered = || Input::Unanswered { after_ms: 3000 };
    for (reused, pending, answered, bound, want) in [
        (true, 117, false, unanswered(), "refused (EXECUTOR_CRASHED)"),
        (
            true,
            117,
            false,
            Input::Silent,
            "refused (EXECUTOR_CRASHED)",
        ),
        (
            true,
            0,
            false,
            unanswered(),
            "refused (EXECUTOR_UNRESPONSIVE)",
        ),
        (
            false,
            117,
            false,
            unanswered(),
            "refused (EXECUTOR_UNRESPONSIVE)",
        ),
        (
            true,
            117,
            true,
            Input::Silent,
            "given back (EXECUTOR_CRASHED)",
        ),
        (
            true,
            117,
            true,
            Input::AttemptTimedOut,
            "given back (EXECUTOR_CRASHED)",
        ),
        (true, 0, true, Input::Silent, "failed (HEARTBEAT_TIMEOUT)"),
        (
            false,
            117,
            true,
            Input::Silent,
            "failed (HEARTBEAT_TIMEOUT)",
        ),
        (
            false,
            117,
            true,
            Input::AttemptTimedOut,
            "failed (ATTEMPT_TIMEOUT)",
        ),
    ] {
        assert_eq!(
            run(reused, pending, answered, bound),
            want,
            "reused {reused}, {pending} bytes pending, answered {answered}"
        );
    }
}

/// An attempt's checkpoint bytes count against its own budget and its
/// worker's: one attempt below its own is held back while the worker's is
/// used up by others, and goes on once another attempt's bytes are freed.
#[tokio::test]
async fn checkpoint_bytes_are_bounded_per_attempt_and_per_worker() {
    let worker = Arc::new(QueuedBytes::worker(100));
    let a = QueuedBytes::attempt(60, worker.clone());
    let b = QueuedBytes::attempt(60, worker.clone());
    a.add(59);
    assert!(a.under_budget() && b.under_budget());
    // one write may take an attempt over its own limit: then it waits
    a.add(10);
    assert!(!a.under_budget());
    b.add(20);
    assert!(b.under_budget(), "b at 20 of 60, the worker at 89 of 100");
    // the worker over its limit: b waits although below its own
    b.add(20);
    assert!(!b.under_budget(), "b at 40 of 60, the worker at 109 of 100");
    assert!(!QueuedBytes::attempt(60, worker.clone()).under_budget());
    let waiting = tokio::spawn(async move {
        b.below_budget().await;
        b
    });
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished());
    // woken by another attempt's bytes freed
    a.free(69);
    let b = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
        .await
        .expect("woken by another attempt's freed bytes")
        .expect("task");
    assert!(b.under_budget());
    b.free(40);
    assert_eq!(worker.n.load(std::sync::atomic::Ordering::SeqCst), 0);
}

/// A malformed frame that is all text is said to be a print, with the
/// usual question and where its bytes are (audit 99: a line printed every
/// 200 ms completed a "frame" and the step read only "bytes that are not a
/// valid frame"); other bytes keep the plain message.
#[test]
fn a_malformed_frame_of_text_asks_whether_it_printed() {
    let malformed = |printed| WireError::Malformed {
        reason: "invalid wire type".into(),
        first_bytes: "step 1 of 40".into(),
        printed,
    };
    let (code, message) = wire_failure(&malformed(true));
    assert_eq!(code, "PROTOCOL_MALFORMED_FRAME");
    assert!(
        message.contains("wrote text to its stdout")
            && message.contains("did it print something there")
            && message.contains("invalid wire type")
            && message.contains("the worker's log shows its first bytes"),
        "{message}"
    );
    // a length read from text (`✓ done` announces 67 MB)
    let (code, message) = wire_failure(&WireError::TooLarge {
        len: 67_423_842,
        cap: 8 << 20,
        printed: true,
    });
    assert_eq!(code, "PROTOCOL_FRAME_TOO_LARGE");
    assert!(
        message.contains("67423842") && message.contains("did it print something there"),
        "{message}"
    );
    let (code, message) = wire_failure(&malformed(false));
    assert_eq!(code, "PROTOCOL_MALFORMED_FRAME");
    assert!(
        message.starts_with("the executor wrote bytes that are not a valid frame")
            && !message.contains("print"),
        "{message}"
    );
}
