//! Table-driven tests of the attempt's pure parts: frame checks and the
//! precedence of outcomes.

use super::*;

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
            .map(|f| kind_of(&on_frame(&mut st, &job(), 7, f)))
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
fn sanitizes_names() {
    assert_eq!(sanitize("report.csv"), "report.csv");
    assert_eq!(sanitize("../etc/passwd"), "_.._etc_passwd");
    assert_eq!(sanitize(""), "_");
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
