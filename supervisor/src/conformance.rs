//! `supervisor conformance`: the protocol's behaviour scenarios
//! (proto/PROTOCOL.md) played against a configured executor binary, with the
//! supervisor's own spawner and wire code. Each scenario starts a fresh
//! process (persistent reuse keeps one for two jobs), has a bounded time, and
//! ends `pass`, `FAIL` or `not checked` (the executor offers no kind that
//! would exercise it).
//!
//! Which kinds a scenario uses: the demo kinds of PROTOCOL.md when the hello
//! offers them, or the kinds named with `--kind-echo`, `--kind-sleep`,
//! `--kind-artifact` and `--kind-effect`, which must then behave as the demo
//! kind of the same name (input and output as in PROTOCOL.md's table).

use std::collections::BTreeSet;
use std::path::{Component, Path};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::process::{ChildStdin, ChildStdout};
use tokio::time::Instant;
use tokio_util::codec::FramedRead;
use uuid::Uuid;

use crate::config::{ExecutorConfig, WorkerConfig};
use crate::process::{Child, Spawner};
use crate::wire::{
    self, CancelReason, Event, EventKind, ExecutorFrames, FromExecutor, Hello, JobError, JobResult,
    ToExecutor,
};

/// The longest any one scenario may take, whatever happens.
const SCENARIO_BUDGET: Duration = Duration::from_secs(60);
/// How long a short job (echo, artifact, effect) may take to its terminal.
const JOB_WITHIN: Duration = Duration::from_secs(10);
/// How long an executor may take to exit after EOF on its stdin.
const EXIT_WITHIN: Duration = Duration::from_secs(5);
/// How far in the future the deadline scenario puts the attempt's end.
const DEADLINE_IN: Duration = Duration::from_millis(1500);
/// The input of the long job of the cancel and deadline scenarios.
const LONG_SLEEP_MS: u64 = 30_000;

/// The kinds the scenarios use, when not the demo kinds.
#[derive(Debug, Clone, Default)]
pub struct Kinds {
    /// Output = input (as `demo.echo`).
    pub echo: Option<String>,
    /// `{ms, steps}`: sleeps, one PROGRESS per slice, ends on a cancel (as `demo.sleep`).
    pub sleep: Option<String>,
    /// `{name, content, repeat}`: writes a file below output_dir (as `demo.artifact`).
    pub artifact: Option<String>,
    /// `{sink}`: an effect skipped when the checkpoint says it is done (as `demo.effect`).
    pub effect: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    #[error("no executor named {name:?} in the config (it has: {known}). Pass one of those to --executor")]
    UnknownExecutor { name: String, known: String },
    #[error("the config has no [[executors]] entry to check")]
    NoExecutors,
    #[error("cannot start the process spawner: {0}")]
    Spawner(String),
}

/// How a scenario ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    NotChecked,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "FAIL",
            Verdict::NotChecked => "not checked",
        }
    }

    /// The name in `--json` output.
    pub fn json_name(&self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::NotChecked => "not_checked",
        }
    }
}

/// One scenario's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: &'static str,
    pub verdict: Verdict,
    pub detail: String,
    pub elapsed: Duration,
}

/// Every scenario's outcome for one executor.
#[derive(Debug, Clone)]
pub struct ExecutorReport {
    pub executor: String,
    pub outcomes: Vec<Outcome>,
}

impl ExecutorReport {
    pub fn passed(&self) -> bool {
        self.outcomes.iter().all(|o| o.verdict != Verdict::Fail)
    }
}

/// The scenarios, in the order they run.
pub const SCENARIOS: [&str; 12] = [
    "hello",
    "negotiation",
    "echo",
    "result too large",
    "cancel",
    "deadline",
    "progress order",
    "checkpoint",
    "artifacts",
    "eof when idle",
    "unknown kind",
    "persistent reuse",
];

/// Runs every scenario against each configured executor, or only `only`.
pub async fn run(
    wcfg: &WorkerConfig,
    only: Option<&str>,
    kinds: &Kinds,
) -> Result<Vec<ExecutorReport>, ConformanceError> {
    if wcfg.executors.is_empty() {
        return Err(ConformanceError::NoExecutors);
    }
    let selected: Vec<&ExecutorConfig> = match only {
        None => wcfg.executors.iter().collect(),
        Some(name) => {
            let found: Vec<_> = wcfg.executors.iter().filter(|e| e.name == name).collect();
            if found.is_empty() {
                return Err(ConformanceError::UnknownExecutor {
                    name: name.to_owned(),
                    known: wcfg
                        .executors
                        .iter()
                        .map(|e| e.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
            found
        }
    };
    let spawner = Spawner::start().map_err(|e| ConformanceError::Spawner(e.to_string()))?;
    let mut reports = Vec::new();
    for cfg in selected {
        let ctx = Ctx {
            spawner: &spawner,
            cfg,
            wcfg,
        };
        reports.push(ExecutorReport {
            executor: cfg.name.clone(),
            outcomes: check_executor(&ctx, kinds).await,
        });
    }
    Ok(reports)
}

/// The pass/fail table, one row per executor and scenario, and a summary line each.
pub fn render(reports: &[ExecutorReport]) -> String {
    let width = reports
        .iter()
        .map(|r| r.executor.len())
        .max()
        .unwrap_or(0)
        .max("EXECUTOR".len());
    let mut out = format!(
        "{:<width$}  {:<16}  {:<11}  {:>7}  DETAIL\n",
        "EXECUTOR", "SCENARIO", "RESULT", "MS"
    );
    for r in reports {
        for o in &r.outcomes {
            out.push_str(&format!(
                "{:<width$}  {:<16}  {:<11}  {:>7}  {}\n",
                r.executor,
                o.scenario,
                o.verdict.as_str(),
                o.elapsed.as_millis(),
                o.detail.replace('\n', " ")
            ));
        }
    }
    for r in reports {
        let count = |v: Verdict| r.outcomes.iter().filter(|o| o.verdict == v).count();
        out.push_str(&format!(
            "{}: {} passed, {} failed, {} not checked\n",
            r.executor,
            count(Verdict::Pass),
            count(Verdict::Fail),
            count(Verdict::NotChecked)
        ));
    }
    out
}

/// The results as one JSON document (`--json`): per executor whether it
/// passed, the counts, and each scenario's result (`pass`, `fail`,
/// `not_checked`), time and detail; `passed` is the exit status's verdict.
pub fn render_json(reports: &[ExecutorReport]) -> Value {
    let executors: Vec<Value> = reports
        .iter()
        .map(|r| {
            let count = |v: Verdict| r.outcomes.iter().filter(|o| o.verdict == v).count();
            json!({
                "executor": r.executor,
                "passed": r.passed(),
                "counts": {
                    "pass": count(Verdict::Pass),
                    "fail": count(Verdict::Fail),
                    "not_checked": count(Verdict::NotChecked),
                },
                "scenarios": r.outcomes.iter().map(|o| json!({
                    "scenario": o.scenario,
                    "result": o.verdict.json_name(),
                    "ms": o.elapsed.as_millis() as u64,
                    "detail": o.detail,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "passed": reports.iter().all(ExecutorReport::passed),
        "scenarios": SCENARIOS,
        "executors": executors,
    })
}

// ---------------------------------------------------------------------------

struct Ctx<'a> {
    spawner: &'a Spawner,
    cfg: &'a ExecutorConfig,
    wcfg: &'a WorkerConfig,
}

impl Ctx<'_> {
    fn handshake(&self) -> Duration {
        Duration::from_millis(self.wcfg.handshake_timeout_ms)
    }
    fn grace(&self) -> Duration {
        Duration::from_millis(self.wcfg.cancel_grace_ms)
    }
    /// A start that said no valid hello, with the worker probe's note on a
    /// relative path among the args.
    fn start_failed(&self, why: String) -> String {
        why + &self.cfg.relative_args_note()
    }
}

/// The kinds of one executor's hello that the scenarios use.
struct Chosen {
    echo: Option<String>,
    sleep: Option<String>,
    artifact: Option<String>,
    effect: Option<String>,
}

fn choose(flag: &Option<String>, demo: &str, hello: &Hello) -> Option<String> {
    let want = flag.as_deref().unwrap_or(demo);
    hello
        .kinds
        .iter()
        .any(|k| k == want)
        .then(|| want.to_owned())
}

/// A scenario's result before it is timed: pass / fail with a detail, or not checked.
type Res = Result<Checked, String>;

enum Checked {
    Pass(String),
    NotChecked(String),
}

fn not_offered(what: &str, demo: &str, flag: &str) -> Res {
    Ok(Checked::NotChecked(format!(
        "the executor offers no {what} kind ({demo}, or name one with {flag})"
    )))
}

async fn check_executor(ctx: &Ctx<'_>, kinds: &Kinds) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let started = Instant::now();
    let hello = bounded(scenario_hello(ctx)).await;
    let (res, hello) = match hello {
        Ok((detail, h)) => (Ok(Checked::Pass(detail)), Some(h)),
        Err(e) => (Err(e), None),
    };
    outcomes.push(outcome("hello", res, started.elapsed()));
    let Some(hello) = hello else {
        for s in &SCENARIOS[1..] {
            outcomes.push(Outcome {
                scenario: s,
                verdict: Verdict::NotChecked,
                detail: "no valid hello".into(),
                elapsed: Duration::ZERO,
            });
        }
        return outcomes;
    };
    // a kind named on the command line that the hello does not offer is a
    // mistake of the run, not a kind to skip: a typo in --kind-sleep passed
    // the cancel and deadline scenarios as "not checked", exit 0
    let misnamed: Vec<String> = [
        ("--kind-echo", &kinds.echo),
        ("--kind-sleep", &kinds.sleep),
        ("--kind-artifact", &kinds.artifact),
        ("--kind-effect", &kinds.effect),
    ]
    .into_iter()
    .filter_map(|(flag, k)| {
        let k = k.as_deref()?;
        (!hello.kinds.iter().any(|o| o == k)).then(|| format!("{flag} {k:?}"))
    })
    .collect();
    if !misnamed.is_empty() {
        let detail = format!(
            "{} is not among the kinds the executor offers ({}): name one it offers",
            misnamed.join(" and "),
            hello.kinds.join(", ")
        );
        for s in &SCENARIOS[1..] {
            outcomes.push(Outcome {
                scenario: s,
                verdict: Verdict::Fail,
                detail: detail.clone(),
                elapsed: Duration::ZERO,
            });
        }
        return outcomes;
    }
    let chosen = Chosen {
        echo: choose(&kinds.echo, "demo.echo", &hello),
        sleep: choose(&kinds.sleep, "demo.sleep", &hello),
        artifact: choose(&kinds.artifact, "demo.artifact", &hello),
        effect: choose(&kinds.effect, "demo.effect", &hello),
    };
    for scenario in &SCENARIOS[1..] {
        let started = Instant::now();
        let res = bounded(async {
            match *scenario {
                "negotiation" => scenario_negotiation(ctx, &chosen).await,
                "echo" => scenario_echo(ctx, &chosen).await,
                "result too large" => scenario_result_too_large(ctx, &chosen).await,
                "cancel" => scenario_cancel(ctx, &chosen).await,
                "deadline" => scenario_deadline(ctx, &chosen).await,
                "progress order" => scenario_progress(ctx, &chosen).await,
                "checkpoint" => scenario_checkpoint(ctx, &chosen).await,
                "artifacts" => scenario_artifacts(ctx, &chosen).await,
                "eof when idle" => scenario_eof(ctx).await,
                "unknown kind" => scenario_unknown_kind(ctx).await,
                _ => scenario_persistent(ctx, &chosen, &hello).await,
            }
        })
        .await;
        outcomes.push(outcome(scenario, res, started.elapsed()));
    }
    outcomes
}

async fn bounded<T>(f: impl std::future::Future<Output = Result<T, String>>) -> Result<T, String> {
    tokio::time::timeout(SCENARIO_BUDGET, f)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "the scenario did not end within {} s",
                SCENARIO_BUDGET.as_secs()
            ))
        })
}

fn outcome(scenario: &'static str, res: Res, elapsed: Duration) -> Outcome {
    let (verdict, detail) = match res {
        Ok(Checked::Pass(d)) => (Verdict::Pass, d),
        Ok(Checked::NotChecked(d)) => (Verdict::NotChecked, d),
        Err(d) => (Verdict::Fail, d),
    };
    Outcome {
        scenario,
        verdict,
        detail,
        elapsed,
    }
}

// ---------------------------------------------------------------------------
// one executor process

enum Next {
    Frame(FromExecutor),
    Eof,
    Timeout,
}

struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    frames: ExecutorFrames<ChildStdout>,
    dir: tempfile::TempDir,
    /// What the supervisor offers (its frame cap is the decoder's).
    offer: wire::SupervisorOffer,
    /// Negotiated from the hello; every job is sent with it, as a worker does.
    agreement: Option<wire::Agreement>,
}

impl Proc {
    async fn spawn(ctx: &Ctx<'_>) -> Result<Proc, String> {
        let dir = tempfile::Builder::new()
            .prefix("durable-conformance-")
            .tempdir()
            .map_err(|e| format!("cannot create a temp dir: {e}"))?;
        let spec = ctx.cfg.spawn_spec(dir.path(), ctx.wcfg.stderr_tail_bytes);
        let mut child = ctx
            .spawner
            .spawn(spec)
            .await
            .map_err(|e| format!("cannot start the executor: {e}"))?;
        let stdout = child.take_stdout().ok_or("no stdout pipe")?;
        let stdin = child.take_stdin();
        Ok(Proc {
            child,
            stdin,
            frames: FramedRead::new(stdout, wire::executor_decoder(ctx.wcfg.max_frame_bytes)),
            dir,
            offer: wire::SupervisorOffer::new(ctx.wcfg.max_frame_bytes),
            agreement: None,
        })
    }

    /// A fresh process that said a valid hello.
    async fn ready(ctx: &Ctx<'_>) -> Result<(Proc, Hello), String> {
        let mut p = Proc::spawn(ctx).await?;
        let hello = p
            .hello(ctx.handshake())
            .await
            .map_err(|e| ctx.start_failed(e))?;
        Ok((p, hello))
    }

    async fn hello(&mut self, within: Duration) -> Result<Hello, String> {
        let h = wire::read_hello(&mut self.frames, within)
            .await
            .map_err(|e| format!("{e}{}", self.stderr_note()))?;
        if h.protocol_version != wire::PROTOCOL_VERSION {
            return Err(format!(
                "hello says protocol_version {}, expected {} (PROTOCOL_VERSION_1)",
                h.protocol_version,
                wire::PROTOCOL_VERSION
            ));
        }
        let agreement =
            wire::negotiate(&h, &self.offer).map_err(|e| format!("{}: {e}", e.code()))?;
        self.agreement = Some(agreement);
        Ok(h)
    }

    fn stderr_note(&self) -> String {
        let tail = self.child.stderr().tail_string();
        let tail = last_chars(tail.trim(), 300);
        if tail.is_empty() {
            String::new()
        } else {
            format!("; stderr: …{tail}")
        }
    }

    /// A directory for one job's output, absolute and empty.
    fn output_dir(&self, name: &str) -> Result<String, String> {
        let d = self.dir.path().join(name);
        std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        Ok(d.to_string_lossy().into_owned())
    }

    async fn send(&mut self, m: &ToExecutor) -> Result<(), String> {
        let Some(w) = self.stdin.as_mut() else {
            return Err("stdin already closed".into());
        };
        // a job goes with the agreement (unless the scenario states its own)
        // and never over the executor's announced frame limit
        let negotiated;
        let m = match (m, &self.agreement) {
            (ToExecutor::Job(job), Some(a)) => {
                let mut job = job.clone();
                job.agreement.get_or_insert_with(|| a.clone());
                let len = wire::frame_body_len(&ToExecutor::Job(job.clone()));
                if len > a.executor_max_frame_bytes {
                    return Err(format!(
                        "the scenario's job frame ({len} bytes) is over the executor's announced \
                         max_frame_bytes {}",
                        a.executor_max_frame_bytes
                    ));
                }
                negotiated = ToExecutor::Job(job);
                &negotiated
            }
            _ => m,
        };
        let bytes = wire::encode_to_executor(m);
        w.write_all(&bytes)
            .await
            .map_err(|e| format!("cannot write to the executor's stdin: {e}"))?;
        w.flush()
            .await
            .map_err(|e| format!("cannot write to the executor's stdin: {e}"))
    }

    async fn next(&mut self, until: Instant) -> Result<Next, String> {
        match tokio::time::timeout_at(until, self.frames.next()).await {
            Err(_) => Ok(Next::Timeout),
            Ok(None) => Ok(Next::Eof),
            Ok(Some(Ok(f))) => Ok(Next::Frame(f.into())),
            Ok(Some(Err(e))) => Err(format!("broken frame stream: {e}")),
        }
    }

    /// Closes stdin; the executor must send nothing more, close stdout and
    /// exit 0 within [`EXIT_WITHIN`]. Returns how long it took.
    async fn finish(mut self, grace: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        self.stdin = None;
        let until = started + EXIT_WITHIN;
        let mut stray: Option<&'static str> = None;
        let mut exited = false;
        loop {
            tokio::select! {
                f = self.frames.next() => match f {
                    None => break,
                    Some(Ok(f)) => { stray.get_or_insert(FromExecutor::from(f).name()); }
                    Some(Err(e)) => return Err(format!("broken frame stream after EOF on stdin: {e}")),
                },
                r = self.child.exited(), if !exited => match r {
                    Ok(()) => exited = true,
                    Err(e) => return Err(e.to_string()),
                },
                _ = tokio::time::sleep_until(until) => break,
                // stdout held open by a grandchild after the exit: stop waiting
                _ = tokio::time::sleep(Duration::from_millis(300)), if exited => break,
            }
        }
        if !exited
            && tokio::time::timeout_at(until, self.child.exited())
                .await
                .is_err()
        {
            let note = self.stderr_note();
            let _ = self.child.terminate(grace).await;
            return Err(format!(
                "still running {} ms after EOF on stdin (stopped with SIGTERM){note}",
                EXIT_WITHIN.as_millis()
            ));
        }
        let took = started.elapsed();
        let report = self.child.finish().await.map_err(|e| e.to_string())?;
        if let Some(name) = stray {
            return Err(format!(
                "{} frame after the job's terminal / EOF on stdin",
                wire::a(name)
            ));
        }
        if !report.status.success() {
            let tail = report.stderr_tail.trim();
            return Err(format!(
                "{} after EOF on stdin, expected exit 0; stderr: {}",
                report.status,
                last_chars(tail, 300)
            ));
        }
        Ok(took)
    }
}

/// The last `n` characters of `s`.
fn last_chars(s: &str, n: usize) -> &str {
    let start = s.char_indices().rev().nth(n).map_or(0, |(i, _)| i);
    &s[start..]
}

// ---------------------------------------------------------------------------
// one job's frames, checked as they arrive

enum Terminal {
    Result(JobResult),
    Error(JobError),
}

#[derive(Default)]
struct JobCheck {
    job_id: String,
    last_seq: u64,
    accepted: bool,
    events: Vec<Event>,
    terminal: Option<Terminal>,
    /// An error before ACCEPTED.
    refused: bool,
}

impl JobCheck {
    fn new(job_id: &str) -> JobCheck {
        JobCheck {
            job_id: job_id.to_owned(),
            ..JobCheck::default()
        }
    }

    /// The protocol's rules on one frame (PROTOCOL.md, Conversation 3-4).
    fn feed(&mut self, f: FromExecutor) -> Result<(), String> {
        if self.terminal.is_some() {
            return Err(format!(
                "{} frame after the job's terminal (PROTOCOL_FRAME_AFTER_TERMINAL)",
                wire::a(f.name())
            ));
        }
        let (job_id, seq) = match &f {
            FromExecutor::Event(e) => (&e.job_id, e.sequence),
            FromExecutor::Result(r) => (&r.job_id, r.sequence),
            FromExecutor::Error(e) => (&e.job_id, e.sequence),
            other => {
                return Err(format!(
                    "{} frame during a job (PROTOCOL_UNEXPECTED_FRAME)",
                    wire::a(other.name())
                ))
            }
        };
        if *job_id != self.job_id {
            return Err(format!(
                "{} frame with job_id {job_id:?}, expected {:?}",
                wire::a(f.name()),
                self.job_id
            ));
        }
        // what the worker fails a job for, the kit fails too
        if let Some(field) = wire::text_problem(&f) {
            return Err(format!(
                "{field} contains a NUL character, which cannot be stored (PROTOCOL_INVALID_TEXT)"
            ));
        }
        if seq > wire::MAX_SEQUENCE {
            return Err(format!(
                "{} with sequence {seq}, above {} (PROTOCOL_SEQUENCE_OUT_OF_RANGE)",
                f.name(),
                wire::MAX_SEQUENCE
            ));
        }
        if let FromExecutor::Error(e) = &f {
            if !self.accepted {
                self.refused = true;
                self.terminal = Some(Terminal::Error(e.clone()));
                return Ok(());
            }
        }
        if !self.accepted {
            return match f {
                FromExecutor::Event(e) if e.kind == EventKind::Accepted && e.sequence == 1 => {
                    self.accepted = true;
                    self.last_seq = 1;
                    self.events.push(e);
                    Ok(())
                }
                FromExecutor::Event(e) => Err(format!(
                    "first frame is {} event with sequence {}, expected ACCEPTED with sequence 1",
                    wire::a(e.kind.as_str()),
                    e.sequence
                )),
                other => Err(format!(
                    "{} before ACCEPTED (only an error may come before it)",
                    wire::a(other.name())
                )),
            };
        }
        if seq <= self.last_seq {
            return Err(format!(
                "{} with sequence {seq} after sequence {} (PROTOCOL_SEQUENCE_REGRESSION)",
                f.name(),
                self.last_seq
            ));
        }
        self.last_seq = seq;
        match f {
            FromExecutor::Event(e) if e.kind == EventKind::Accepted => {
                Err("a second ACCEPTED event".into())
            }
            FromExecutor::Event(e) if e.kind == EventKind::Unspecified => {
                Err(format!("an event of unspecified kind (sequence {seq})"))
            }
            FromExecutor::Event(e) => {
                self.events.push(e);
                Ok(())
            }
            FromExecutor::Result(r) => {
                self.terminal = Some(Terminal::Result(r));
                Ok(())
            }
            FromExecutor::Error(e) => {
                self.terminal = Some(Terminal::Error(e));
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn last_checkpoint(&self) -> Option<Vec<u8>> {
        self.events.iter().rev().find_map(|e| e.checkpoint.clone())
    }
}

/// How [`read_until`]'s error for "nothing in time" starts.
const TIMED_OUT: &str = "timed out";

/// Reads frames until `stop` holds for the check (or the terminal arrives).
async fn read_until(
    p: &mut Proc,
    check: &mut JobCheck,
    until: Instant,
    stop: impl Fn(&JobCheck) -> bool,
) -> Result<(), String> {
    while check.terminal.is_none() && !stop(check) {
        match p.next(until).await? {
            Next::Frame(f) => check.feed(f)?,
            Next::Timeout => {
                return Err(format!(
                    "{TIMED_OUT} after {} event(s), last sequence {}",
                    check.events.len(),
                    check.last_seq
                ))
            }
            Next::Eof => {
                return Err(format!(
                    "stdout closed without a terminal (EXECUTOR_CRASHED){}",
                    p.stderr_note()
                ))
            }
        }
    }
    Ok(())
}

async fn to_terminal(p: &mut Proc, check: &mut JobCheck, within: Duration) -> Result<(), String> {
    let until = Instant::now() + within;
    read_until(p, check, until, |_| false).await.map_err(|e| {
        if e.starts_with(TIMED_OUT) {
            format!("no terminal within {} ms ({e})", within.as_millis())
        } else {
            e
        }
    })
}

fn new_job(hello: &Hello, kind: &str, input: &Value, output_dir: String) -> wire::Job {
    wire::Job {
        job_id: format!("conformance-{}", Uuid::new_v4()),
        workflow_run_id: Uuid::new_v4().to_string(),
        step_run_id: Uuid::new_v4().to_string(),
        idempotency_key: Uuid::new_v4().to_string(),
        executor_kind: hello.executor_kind.clone(),
        kind: kind.to_owned(),
        attempt: 1,
        deadline_unix_ms: 0,
        attempt_deadline_unix_ms: 0,
        heartbeat_timeout_ms: 0,
        input: input.to_string().into_bytes(),
        input_artifacts: Vec::new(),
        checkpoint: None,
        output_dir,
        secrets: Default::default(),
        labels: Default::default(),
        agreement: None,
    }
}

fn output_json(r: &JobResult) -> Result<Value, String> {
    crate::json::parse_bounded(&r.output, crate::json::MAX_VALUE_DEPTH)
        .map_err(|e| format!("the result's output is not JSON: {e}"))
}

fn expect_result(check: &JobCheck) -> Result<&JobResult, String> {
    match &check.terminal {
        Some(Terminal::Result(r)) => Ok(r),
        Some(Terminal::Error(e)) if check.refused => {
            Err(format!("refused the job: {} {:?}", e.code, e.message))
        }
        Some(Terminal::Error(e)) => Err(format!("failed: {} {:?}", e.code, e.message)),
        None => Err("no terminal".into()),
    }
}

fn unix_ms_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn cancel(job_id: &str, reason: CancelReason, grace: Duration, message: &str) -> ToExecutor {
    ToExecutor::Cancel {
        job_id: job_id.to_owned(),
        reason,
        grace_ms: grace.as_millis().min(u32::MAX as u128) as u32,
        message: message.to_owned(),
    }
}

fn terminal_name(check: &JobCheck) -> String {
    match &check.terminal {
        Some(Terminal::Result(_)) => "a result".into(),
        Some(Terminal::Error(e)) => format!("error {}", e.code),
        None => "nothing".into(),
    }
}

// ---------------------------------------------------------------------------
// the scenarios

async fn scenario_hello(ctx: &Ctx<'_>) -> Result<(String, Hello), String> {
    let started = Instant::now();
    let mut p = Proc::spawn(ctx).await?;
    let h = p
        .hello(ctx.handshake())
        .await
        .map_err(|e| ctx.start_failed(e))?;
    let took = started.elapsed();
    if h.executor_kind.is_empty() {
        return Err("hello has an empty executor_kind".into());
    }
    if h.kinds.is_empty() {
        return Err("hello lists no kinds".into());
    }
    if let Some(k) = h.kinds.iter().find(|k| k.is_empty()) {
        return Err(format!("hello lists an empty kind {k:?}"));
    }
    let distinct: BTreeSet<&String> = h.kinds.iter().collect();
    if distinct.len() != h.kinds.len() {
        return Err(format!("hello lists a kind twice: {:?}", h.kinds));
    }
    p.send(&ToExecutor::Shutdown {
        reason: "conformance: hello only".into(),
    })
    .await?;
    p.finish(ctx.grace())
        .await
        .map_err(|e| format!("after Shutdown: {e}"))?;
    let sdk = if h.sdk_name.is_empty() {
        String::new()
    } else {
        format!(", sdk {} {}", h.sdk_name, h.sdk_version)
            .trim_end()
            .to_owned()
    };
    Ok((
        format!(
            "executor_kind {:?}, {} kind(s), max_jobs_per_process {}{sdk}, in {} ms",
            h.executor_kind,
            h.kinds.len(),
            h.max_jobs_per_process,
            took.as_millis()
        ),
        h,
    ))
}

/// The smallest `Hello.max_frame_bytes` an executor may announce (PROTOCOL.md).
const MIN_ANNOUNCED_FRAME_BYTES: u64 = 64 * 1024;

/// Protocol 1.1: the hello's revisions and features are well-formed, one
/// revision is common, the announced frame limit is usable, and a job that
/// states the agreement runs.
async fn scenario_negotiation(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let (mut p, hello) = Proc::ready(ctx).await?;
    let Some(a) = p.agreement.clone() else {
        return Err("no agreement after the hello".into());
    };
    if hello.protocol_versions.is_empty() {
        p.finish(ctx.grace()).await?;
        return Ok(Checked::NotChecked(
            "the hello lists no protocol_versions: a 1.0 executor (it negotiates 1.0 with no \
             features; its jobs carry no 1.1 fields)"
                .into(),
        ));
    }
    if let Some(bad) = hello
        .protocol_versions
        .iter()
        .find(|v| wire::negotiate::Revision::parse(v).is_none())
    {
        return Err(format!(
            "protocol_versions lists {bad:?}, not \"MAJOR.MINOR\" (e.g. \"1.1\")"
        ));
    }
    let twice = |v: &[String]| v.iter().collect::<BTreeSet<_>>().len() != v.len();
    if twice(&hello.protocol_versions) || twice(&hello.features) {
        return Err(format!(
            "a revision or feature listed twice: {:?} {:?}",
            hello.protocol_versions, hello.features
        ));
    }
    if hello.features.iter().any(|f| f.is_empty()) {
        return Err(format!("an empty feature name in {:?}", hello.features));
    }
    if hello.max_frame_bytes != 0 && hello.max_frame_bytes < MIN_ANNOUNCED_FRAME_BYTES {
        return Err(format!(
            "max_frame_bytes {} is below the {MIN_ANNOUNCED_FRAME_BYTES} bytes an executor must accept",
            hello.max_frame_bytes
        ));
    }
    let ran = match &k.echo {
        Some(kind) => {
            echo_job(&mut p, &hello, kind, 1).await?;
            format!("; a {kind} job stating it ran")
        }
        None => String::new(),
    };
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "revision {} agreed from {:?}, features {:?}, frames to the executor up to {} bytes{ran}",
        a.revision, hello.protocol_versions, a.features, a.executor_max_frame_bytes
    )))
}

/// Protocol 1.1, feature frame_limits: a result over the job's
/// `max_frame_bytes` is `RESULT_TOO_LARGE` (not retryable), never an
/// oversized frame; a small result under the same limit still goes.
async fn scenario_result_too_large(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    const LIMIT: u64 = 2048;
    let Some(kind) = &k.echo else {
        return not_offered("echo", "demo.echo", "--kind-echo");
    };
    let (mut p, hello) = Proc::ready(ctx).await?;
    let Some(mut a) = p.agreement.clone() else {
        return Err("no agreement after the hello".into());
    };
    if !a.has_feature(wire::negotiate::FEATURE_FRAME_LIMITS) {
        p.finish(ctx.grace()).await?;
        return Ok(Checked::NotChecked(format!(
            "the executor does not announce the {} feature (protocol 1.1)",
            wire::negotiate::FEATURE_FRAME_LIMITS
        )));
    }
    a.supervisor_max_frame_bytes = LIMIT;
    let input = json!({"conformance": "result too large", "pad": "x".repeat(3 * LIMIT as usize)});
    let mut job = new_job(&hello, kind, &input, p.output_dir("out-big")?);
    job.agreement = Some(a.clone());
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN).await?;
    match &check.terminal {
        Some(Terminal::Error(e)) if check.refused => {
            return Err(format!("refused the job: {} {:?}", e.code, e.message))
        }
        Some(Terminal::Error(e)) if e.code == "RESULT_TOO_LARGE" && !e.retryable => {}
        Some(Terminal::Error(e)) => {
            return Err(format!(
                "error {} (retryable {}), expected RESULT_TOO_LARGE, not retryable",
                e.code, e.retryable
            ))
        }
        // a result small enough: the echo did not echo its input (third-
        // party audit: 11 bytes were called an "oversized frame")
        Some(Terminal::Result(r)) if (r.output.len() as u64) < LIMIT => {
            return Err(format!(
                "a result of {} output bytes for an echo of more than {} input bytes: the echo kind must \
                 return its input as its output (here too large for the job's max_frame_bytes \
                 of {LIMIT}, so RESULT_TOO_LARGE was expected)",
                r.output.len(),
                3 * LIMIT
            ))
        }
        Some(Terminal::Result(r)) => {
            return Err(format!(
                "a result with {} output bytes although the job's max_frame_bytes is {LIMIT}: \
                 expected RESULT_TOO_LARGE instead of an oversized frame",
                r.output.len()
            ))
        }
        None => return Err("no terminal".into()),
    }
    // a one-shot process has served its job: the small one goes to a new one
    if matches!(hello.max_jobs_per_process, 0 | 1) {
        p.finish(ctx.grace()).await?;
        (p, _) = Proc::ready(ctx).await?;
    }
    let small = echo_input(2);
    let mut job = new_job(&hello, kind, &small, p.output_dir("out-small")?);
    job.agreement = Some(a);
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN).await?;
    let out = output_json(
        expect_result(&check)
            .map_err(|e| format!("a small result under the same {LIMIT}-byte limit: {e}"))?,
    )?;
    if out != small {
        return Err(format!("output {out} differs from the input {small}"));
    }
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: a {}-byte echo under a {LIMIT}-byte limit is RESULT_TOO_LARGE (not retryable); a small one is a result",
        input.to_string().len()
    )))
}

fn echo_input(n: u32) -> Value {
    json!({
        "conformance": "echo",
        "n": n,
        "text": "héllo, wörld ✓",
        "nested": {"list": [1, 2.5, "three", null, true], "empty": {}},
    })
}

/// One echo job on `p`: ACCEPTED at 1, increasing sequences, a result equal to the input.
async fn echo_job(p: &mut Proc, hello: &Hello, kind: &str, n: u32) -> Result<(), String> {
    let input = echo_input(n);
    let job = new_job(hello, kind, &input, p.output_dir(&format!("out-{n}"))?);
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(p, &mut check, JOB_WITHIN).await?;
    let out = output_json(expect_result(&check)?)?;
    if out != input {
        return Err(format!("output {out} differs from the input {input}"));
    }
    Ok(())
}

async fn scenario_echo(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let Some(kind) = &k.echo else {
        return Err(
            "the executor offers no echo kind: offer demo.echo or name one with --kind-echo".into(),
        );
    };
    let (mut p, hello) = Proc::ready(ctx).await?;
    echo_job(&mut p, &hello, kind, 1).await?;
    let exit = p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: output = input, one terminal, exit 0 {} ms after EOF",
        exit.as_millis()
    )))
}

/// Starts a long job and waits for its first event after ACCEPTED (or a short while).
async fn start_long(
    ctx: &Ctx<'_>,
    kind: &str,
    deadline: Option<i64>,
) -> Result<(Proc, JobCheck), String> {
    let (mut p, hello) = Proc::ready(ctx).await?;
    let input = json!({"ms": LONG_SLEEP_MS, "steps": LONG_SLEEP_MS / 100});
    let mut job = new_job(&hello, kind, &input, p.output_dir("out")?);
    if let Some(d) = deadline {
        job.attempt_deadline_unix_ms = d;
    }
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    read_until(&mut p, &mut check, Instant::now() + JOB_WITHIN, |c| {
        c.accepted
    })
    .await?;
    if check.refused {
        return Err(format!("refused the job: {}", terminal_name(&check)));
    }
    // give the handler a moment to start (its first event, at most 500 ms)
    let _ = read_until(
        &mut p,
        &mut check,
        Instant::now() + Duration::from_millis(500),
        |c| c.events.len() > 1,
    )
    .await;
    Ok((p, check))
}

async fn scenario_cancel(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let Some(kind) = &k.sleep else {
        return not_offered("long-running", "demo.sleep", "--kind-sleep");
    };
    let (mut p, mut check) = start_long(ctx, kind, None).await?;
    if check.terminal.is_some() {
        return Err(format!(
            "a {LONG_SLEEP_MS} ms job ended at once with {}",
            terminal_name(&check)
        ));
    }
    let job_id = check.job_id.clone();
    let sent = Instant::now();
    p.send(&cancel(
        &job_id,
        CancelReason::Requested,
        ctx.grace(),
        "conformance: cancel",
    ))
    .await?;
    to_terminal(&mut p, &mut check, ctx.grace())
        .await
        .map_err(|e| format!("after the cancel: {e}"))?;
    let took = sent.elapsed();
    let what = terminal_name(&check);
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: {what} {} ms after the cancel (grace {} ms), then exit 0",
        took.as_millis(),
        ctx.grace().as_millis()
    )))
}

async fn scenario_deadline(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let Some(kind) = &k.sleep else {
        return not_offered("long-running", "demo.sleep", "--kind-sleep");
    };
    let deadline_at = Instant::now() + DEADLINE_IN;
    let deadline_ms = unix_ms_now() + DEADLINE_IN.as_millis() as i64;
    let (mut p, mut check) = start_long(ctx, kind, Some(deadline_ms)).await?;
    // the executor may end the job itself before the deadline...
    let mut how = "ended it itself before the deadline";
    if check.terminal.is_none() {
        match read_until(&mut p, &mut check, deadline_at, |_| false).await {
            Ok(()) => {}
            Err(e) if e.starts_with(TIMED_OUT) => {}
            Err(e) => return Err(e),
        }
    }
    // ...or, as the supervisor does at the deadline, it is told to stop
    if check.terminal.is_none() {
        how = "ended it on the supervisor's ATTEMPT_TIMEOUT cancel at the deadline";
        let job_id = check.job_id.clone();
        p.send(&cancel(
            &job_id,
            CancelReason::AttemptTimeout,
            ctx.grace(),
            "conformance: the attempt's deadline passed",
        ))
        .await?;
        to_terminal(&mut p, &mut check, ctx.grace())
            .await
            .map_err(|e| format!("past the deadline, after the timeout cancel: {e}"))?;
    }
    let what = terminal_name(&check);
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: {how} ({what}), within deadline + grace"
    )))
}

async fn scenario_progress(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let Some(kind) = &k.sleep else {
        return not_offered("long-running", "demo.sleep", "--kind-sleep");
    };
    let (mut p, hello) = Proc::ready(ctx).await?;
    let input = json!({"ms": 500, "steps": 5});
    let job = new_job(&hello, kind, &input, p.output_dir("out")?);
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN).await?;
    expect_result(&check)?;
    let progress: Vec<&Event> = check
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Progress)
        .collect();
    if progress.is_empty() {
        return Err(format!(
            "no PROGRESS event for {{\"ms\": 500, \"steps\": 5}} (events: {})",
            check
                .events
                .iter()
                .map(|e| e.kind.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut last = 0.0f64;
    for e in &progress {
        if let Some(f) = e.fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(format!(
                    "fraction {f} out of 0..=1 at sequence {}",
                    e.sequence
                ));
            }
            if f < last {
                return Err(format!(
                    "fraction went back from {last} to {f} at sequence {}",
                    e.sequence
                ));
            }
            last = f;
        }
    }
    let n = check.events.len();
    let terminal_seq = check.last_seq;
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: ACCEPTED at 1, {n} event(s) ({} PROGRESS) strictly increasing, terminal at {terminal_seq}, fractions in order",
        progress.len()
    )))
}

async fn scenario_checkpoint(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    let Some(echo) = &k.echo else {
        return not_offered("echo", "demo.echo", "--kind-echo");
    };
    // any kind: a job carrying a checkpoint (attempt 2) runs as any other
    let (mut p, hello) = Proc::ready(ctx).await?;
    let input = echo_input(2);
    let mut job = new_job(&hello, echo, &input, p.output_dir("out")?);
    job.attempt = 2;
    job.checkpoint = Some(b"conformance-checkpoint:\x00\xff opaque bytes".to_vec());
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN)
        .await
        .map_err(|e| format!("{echo} with a checkpoint: {e}"))?;
    let out = output_json(expect_result(&check)?)?;
    if out != input {
        return Err(format!(
            "{echo} with a checkpoint: output {out} differs from the input"
        ));
    }
    p.finish(ctx.grace()).await?;
    let Some(effect) = &k.effect else {
        return Ok(Checked::Pass(format!(
            "{echo} with a checkpoint ran (no effect kind offered: demo.effect or --kind-effect, so the skip is not checked)"
        )));
    };
    // the effect: attempt 1 performs it and reports a checkpoint; attempt 2,
    // handed that checkpoint, skips it
    let sink_dir = tempfile::Builder::new()
        .prefix("durable-conformance-sink-")
        .tempdir()
        .map_err(|e| format!("cannot create a temp dir: {e}"))?;
    let sink = sink_dir.path().join("sink.txt");
    let input = json!({"sink": sink.to_string_lossy()});
    let key = format!("conformance-{}", Uuid::new_v4());
    let mut handed: Option<Vec<u8>> = None;
    for attempt in [1u32, 2] {
        let (mut p, hello) = Proc::ready(ctx).await?;
        let mut job = new_job(&hello, effect, &input, p.output_dir("out")?);
        job.idempotency_key = key.clone();
        job.attempt = attempt;
        job.checkpoint = handed.clone();
        let mut check = JobCheck::new(&job.job_id);
        p.send(&ToExecutor::Job(Box::new(job))).await?;
        to_terminal(&mut p, &mut check, JOB_WITHIN)
            .await
            .map_err(|e| format!("{effect} attempt {attempt}: {e}"))?;
        expect_result(&check).map_err(|e| format!("{effect} attempt {attempt}: {e}"))?;
        p.finish(ctx.grace()).await?;
        let text = std::fs::read_to_string(&sink).unwrap_or_default();
        let lines = text.lines().filter(|l| *l == key).count();
        if lines != 1 {
            // a line that names the key with more on it is the effect
            // written in another form (third-party audit: "0 time(s)" for a
            // sink whose line had text after the key)
            let near = text
                .lines()
                .filter(|l| *l != key && l.contains(&key))
                .count();
            return Err(format!(
                "{effect} attempt {attempt}: the sink holds the effect {lines} time(s), expected once{}{}",
                if attempt == 2 { " (the checkpoint of attempt 1 was handed over)" } else { "" },
                if near > 0 {
                    format!(
                        "; {near} line(s) hold the idempotency key with more on them: the effect is one line that is exactly the job's idempotency_key"
                    )
                } else {
                    String::new()
                }
            ));
        }
        if attempt == 1 {
            handed = check.last_checkpoint();
            if handed.is_none() {
                return Err(format!(
                    "{effect} attempt 1 performed the effect but reported no checkpoint"
                ));
            }
        }
    }
    Ok(Checked::Pass(format!(
        "{echo} with a checkpoint ran; {effect} handed attempt 1's checkpoint skipped the effect"
    )))
}

fn is_lower_hex_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

async fn scenario_artifacts(ctx: &Ctx<'_>, k: &Chosen) -> Res {
    use sha2::Digest;
    let Some(kind) = &k.artifact else {
        return not_offered("artifact", "demo.artifact", "--kind-artifact");
    };
    let (mut p, hello) = Proc::ready(ctx).await?;
    let out_dir = p.output_dir("out")?;
    let input = json!({"name": "conformance.txt", "content": "conformance ✓\n", "repeat": 1000});
    let job = new_job(&hello, kind, &input, out_dir.clone());
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN).await?;
    let result = expect_result(&check)?;
    if result.artifacts.is_empty() {
        return Err("the result lists no artifact".into());
    }
    let root = Path::new(&out_dir)
        .canonicalize()
        .map_err(|e| format!("output_dir: {e}"))?;
    let mut names = BTreeSet::new();
    let mut bytes_total = 0u64;
    for a in &result.artifacts {
        if !names.insert(a.name.as_str()) {
            return Err(format!("two artifacts named {:?}", a.name));
        }
        let rel = Path::new(&a.path);
        if a.path.is_empty()
            || rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(format!(
                "artifact {:?}: path {:?} is not relative to output_dir without `..`",
                a.name, a.path
            ));
        }
        let file = root
            .join(rel)
            .canonicalize()
            .map_err(|e| format!("artifact {:?}: {} is missing: {e}", a.name, a.path))?;
        if !file.starts_with(&root) {
            return Err(format!(
                "artifact {:?}: {} escapes output_dir",
                a.name, a.path
            ));
        }
        let data =
            std::fs::read(&file).map_err(|e| format!("artifact {:?}: cannot read: {e}", a.name))?;
        if data.len() as u64 != a.size {
            return Err(format!(
                "artifact {:?}: manifest size {} but the file has {} bytes",
                a.name,
                a.size,
                data.len()
            ));
        }
        let sha = hex::encode(sha2::Sha256::digest(&data));
        if !is_lower_hex_sha256(&a.sha256) || sha != a.sha256 {
            return Err(format!(
                "artifact {:?}: manifest sha256 {:?} but the file's is {sha} (lower-case hex)",
                a.name, a.sha256
            ));
        }
        bytes_total += a.size;
    }
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "{kind}: {} artifact(s), {bytes_total} bytes, size and sha256 match the files",
        result.artifacts.len()
    )))
}

async fn scenario_eof(ctx: &Ctx<'_>) -> Res {
    let (p, _) = Proc::ready(ctx).await?;
    let took = p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "exit 0 {} ms after EOF on stdin, no frame",
        took.as_millis()
    )))
}

async fn scenario_unknown_kind(ctx: &Ctx<'_>) -> Res {
    let (mut p, hello) = Proc::ready(ctx).await?;
    let kind = "conformance.no-such-kind";
    if hello.kinds.iter().any(|k| k == kind) {
        return Ok(Checked::NotChecked(format!("the executor offers {kind}")));
    }
    let job = new_job(&hello, kind, &json!({}), p.output_dir("out")?);
    let mut check = JobCheck::new(&job.job_id);
    p.send(&ToExecutor::Job(Box::new(job))).await?;
    to_terminal(&mut p, &mut check, JOB_WITHIN).await?;
    let code = match &check.terminal {
        Some(Terminal::Error(e)) if check.refused => e.code.clone(),
        _ => {
            return Err(format!(
                "a kind it does not offer was accepted and ended with {}; expected an UNSUPPORTED_KIND error before ACCEPTED",
                terminal_name(&check)
            ))
        }
    };
    if code != "UNSUPPORTED_KIND" {
        return Err(format!(
            "refused with code {code:?}; expected UNSUPPORTED_KIND"
        ));
    }
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(
        "UNSUPPORTED_KIND before ACCEPTED, then exit 0".into(),
    ))
}

async fn scenario_persistent(ctx: &Ctx<'_>, k: &Chosen, hello: &Hello) -> Res {
    if matches!(hello.max_jobs_per_process, 0 | 1) {
        return Ok(Checked::NotChecked(format!(
            "one job per process (max_jobs_per_process {})",
            hello.max_jobs_per_process
        )));
    }
    let Some(kind) = &k.echo else {
        return not_offered("echo", "demo.echo", "--kind-echo");
    };
    let (mut p, hello) = Proc::ready(ctx).await?;
    echo_job(&mut p, &hello, kind, 1)
        .await
        .map_err(|e| format!("job 1: {e}"))?;
    echo_job(&mut p, &hello, kind, 2)
        .await
        .map_err(|e| format!("job 2 in the same process: {e}"))?;
    p.finish(ctx.grace()).await?;
    Ok(Checked::Pass(format!(
        "two {kind} jobs in one process, sequences restarting at 1"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, kind: EventKind) -> FromExecutor {
        FromExecutor::Event(Event {
            job_id: "j".into(),
            sequence: seq,
            kind,
            message: String::new(),
            fraction: None,
            checkpoint: None,
            at_unix_ms: 0,
        })
    }

    fn result(seq: u64) -> FromExecutor {
        FromExecutor::Result(JobResult {
            job_id: "j".into(),
            sequence: seq,
            output: b"{}".to_vec(),
            artifacts: vec![],
        })
    }

    #[test]
    fn job_check_accepts_a_proper_job() {
        let mut c = JobCheck::new("j");
        for f in [
            event(1, EventKind::Accepted),
            event(2, EventKind::Running),
            event(5, EventKind::Progress),
            result(6),
        ] {
            c.feed(f).expect("valid frame");
        }
        assert!(matches!(c.terminal, Some(Terminal::Result(_))));
        assert!(
            c.feed(event(7, EventKind::Progress)).is_err(),
            "after terminal"
        );
    }

    #[test]
    fn job_check_refuses_protocol_breaks() {
        let mut c = JobCheck::new("j");
        assert!(
            c.feed(event(2, EventKind::Accepted)).is_err(),
            "ACCEPTED not at 1"
        );
        let mut c = JobCheck::new("j");
        assert!(c.feed(result(1)).is_err(), "result before ACCEPTED");
        let mut c = JobCheck::new("j");
        c.feed(event(1, EventKind::Accepted)).expect("accepted");
        c.feed(event(3, EventKind::Progress)).expect("progress");
        assert!(c.feed(event(3, EventKind::Progress)).is_err(), "regression");
        let mut c = JobCheck::new("j");
        c.feed(event(1, EventKind::Accepted)).expect("accepted");
        assert!(
            c.feed(result(1)).is_err(),
            "terminal not after the last event"
        );
        let mut c = JobCheck::new("other");
        assert!(
            c.feed(event(1, EventKind::Accepted)).is_err(),
            "wrong job_id"
        );
    }

    #[test]
    fn an_error_before_accepted_is_a_refusal() {
        let mut c = JobCheck::new("j");
        c.feed(FromExecutor::Error(JobError {
            job_id: "j".into(),
            sequence: 1,
            code: "UNSUPPORTED_KIND".into(),
            message: String::new(),
            retryable: false,
            details: vec![],
            next_retry_delay_ms: None,
        }))
        .expect("refusal");
        assert!(c.refused);
    }

    #[test]
    fn render_has_a_row_per_scenario_and_a_summary() {
        let r = ExecutorReport {
            executor: "go".into(),
            outcomes: vec![
                outcome(
                    "hello",
                    Ok(Checked::Pass("ok".into())),
                    Duration::from_millis(3),
                ),
                outcome("echo", Err("bad".into()), Duration::ZERO),
            ],
        };
        assert!(!r.passed());
        let t = render(&[r]);
        assert!(t.contains("go        hello"), "{t}");
        assert!(t.contains("FAIL"), "{t}");
        assert!(t.contains("go: 1 passed, 1 failed, 0 not checked"), "{t}");
    }
}
