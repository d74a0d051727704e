//! `supervisor watch RUN_ID`: a run's steps until the run is terminal.
//!
//! On a terminal: one live line per step (a progress bar fed by the step's
//! latest progress event, its state, attempt, elapsed time and message),
//! redrawn in place every poll. Anywhere else (a pipe, a file, CI logs): one
//! plain line per change of a step, and the final state. Either way the
//! database is only read ([`Db::watch_snapshot`], a few times a second).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::db::{Db, DbError, StepHop, WatchRun, WatchStep};
use crate::terminal::cell;

/// How `watch` draws.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// Redraw in place with bars (a terminal), or print plain lines.
    pub live: bool,
    /// ANSI colours for the states (live only).
    pub color: bool,
    /// Full block characters for the bar (a UTF-8 terminal), else `#` and `-`.
    pub unicode: bool,
    /// How often the database is read.
    pub interval: Duration,
    /// How long the database may stay unreachable before `watch` gives up.
    pub patience: Duration,
    /// The longest one read of the run may take before it counts as a
    /// failed read (those are tried again until `patience` runs out).
    pub read_bound: Duration,
}

impl WatchOptions {
    /// The options for stdout as it is: live when it is a terminal; colour
    /// unless `NO_COLOR` is set; Unicode when the locale says UTF-8.
    pub fn for_stdout(force_plain: bool) -> WatchOptions {
        use std::io::IsTerminal;
        let live = !force_plain && std::io::stdout().is_terminal();
        let color = live && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        WatchOptions {
            live,
            color,
            unicode: utf8_locale(),
            interval: Duration::from_millis(250),
            patience: Duration::from_secs(30),
            read_bound: Duration::from_secs(10),
        }
    }
}

fn utf8_locale() -> bool {
    ["LC_ALL", "LC_CTYPE", "LANG"]
        .iter()
        .filter_map(|k| std::env::var(k).ok())
        .find(|v| !v.is_empty())
        .map(|v| {
            let v = v.to_ascii_lowercase();
            v.contains("utf-8") || v.contains("utf8")
        })
        .unwrap_or(false)
}

/// How a watch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEnd {
    /// The run reached this terminal state.
    Terminal(String),
    /// Stopped by this signal (SIGINT: Ctrl-C, SIGTERM, SIGHUP), or by its
    /// caller (0): the run goes on; only the watch stopped.
    Interrupted(i32),
    /// Its output could not be written (a full disk; not a closed pipe,
    /// which ends it as `cat`): the run goes on. It exited 0 with every
    /// line lost (re-check audit).
    OutputFailed(String),
}

impl WatchEnd {
    /// CONTRACT §2: 0 succeeded, 1 failed, 3 cancelled; 128 + the signal's
    /// number when one stopped the watch (130 for Ctrl-C).
    pub fn exit_code(&self) -> u8 {
        match self {
            WatchEnd::Terminal(s) if s == "succeeded" => 0,
            WatchEnd::Terminal(s) if s == "cancelled" => 3,
            WatchEnd::Terminal(_) => 1,
            WatchEnd::Interrupted(sig) => u8::try_from(128 + sig).unwrap_or(130),
            // as any watch that could not follow the run (CONTRACT §2's 1
            // is the run's failure)
            WatchEnd::OutputFailed(_) => 5,
        }
    }
}

/// The first of SIGINT, SIGTERM and SIGHUP to arrive (its number): what
/// stops a `watch` (each used to end it without showing the cursor again,
/// but Ctrl-C). Never resolves when the handlers cannot be installed.
pub async fn stop_signal() -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => libc::SIGINT,
        _ = term.recv() => libc::SIGTERM,
        _ = hup.recv() => libc::SIGHUP,
    }
}

/// Whether a step state read as text is terminal (the state module decides).
pub(crate) fn step_ended(state: &str) -> bool {
    state
        .parse::<crate::state::StepState>()
        .is_ok_and(crate::state::StepState::is_terminal)
}

/// Whether a run state read as text is terminal.
pub(crate) fn run_is_terminal(state: &str) -> bool {
    state
        .parse::<crate::state::RunState>()
        .is_ok_and(crate::state::RunState::is_terminal)
}

/// Watches `run_id` until it is terminal or `stop` resolves (with the signal
/// that stopped it: [`stop_signal`], or 0), writing to `out`; the view is
/// closed either way (the cursor shown again). `NotFound` for an unknown run
/// (before anything is drawn).
pub async fn watch<W: Write>(
    db: &Db,
    run_id: Uuid,
    out: &mut W,
    opts: &WatchOptions,
    stop: impl std::future::Future<Output = i32>,
) -> Result<WatchEnd, DbError> {
    let mut view = View::new(opts.clone());
    let interrupted = stop;
    tokio::pin!(interrupted);
    let mut failing_since: Option<Instant> = None;
    let mut first = true;
    let mut stuck_asked: Option<Instant> = None;
    let end = loop {
        // each read bounded (a92: a server that hangs, stopped or cut off
        // by the network, answered nothing and the watch waited for ever),
        // and a stop signal heard while it is on its way
        let polled = tokio::select! {
            r = tokio::time::timeout(opts.read_bound, read(db, run_id, &view)) => {
                r.unwrap_or_else(|_| Err(DbError::Timeout {
                    context: "reading the run",
                    ms: opts.read_bound.as_millis() as u64,
                }))
            }
            sig = &mut interrupted => {
                let _ = write_all(out, &view.abandon());
                break WatchEnd::Interrupted(sig);
            }
        };
        match polled {
            Ok((snap, hops)) => {
                failing_since = None;
                first = false;
                let done = run_is_terminal(&snap.state);
                let waits = snap
                    .steps
                    .iter()
                    .any(|s| s.state == "pending" || s.state == "retryable_failed");
                if done || !waits {
                    view.stuck.clear();
                } else if stuck_asked.is_none_or(|t| t.elapsed() >= STUCK_EVERY) {
                    stuck_asked = Some(Instant::now());
                    // a failed ask keeps what the last one said
                    if let Ok(Ok(stuck)) =
                        tokio::time::timeout(opts.read_bound, db.unroutable_steps(run_id)).await
                    {
                        view.stuck = stuck.iter().map(|s| (s.step.clone(), s.needs())).collect();
                    }
                }
                let (width, rows) = if opts.live {
                    terminal_size()
                } else {
                    (0, None)
                };
                view.rows = rows;
                let text = view.frame(&snap, &hops, width, done);
                if let Err(e) = write_all(out, &text) {
                    let _ = write_all(out, &view.abandon());
                    break WatchEnd::OutputFailed(e);
                }
                if done {
                    break WatchEnd::Terminal(snap.state.clone());
                }
            }
            // an unknown run, or a schema that is not there, is the answer
            Err(e) if first || !e.is_transient() => {
                let _ = write_all(out, &view.abandon());
                return Err(e);
            }
            // a database restart is not the end of the run: keep trying
            Err(e) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() > opts.patience {
                    let _ = write_all(out, &view.abandon());
                    return Err(e);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.interval) => {}
            sig = &mut interrupted => {
                let _ = write_all(out, &view.abandon());
                break WatchEnd::Interrupted(sig);
            }
        }
    };
    Ok(end)
}

/// One poll: the run's snapshot and, for a plain watch, the history rows
/// the steps passed through since the last poll (the changes between two
/// reads: a retry that failed and started again within one interval).
async fn read(db: &Db, run_id: Uuid, view: &View) -> Result<(WatchRun, Vec<StepHop>), DbError> {
    let snap = db.watch_snapshot(run_id).await?;
    let hops = db.step_hops(&view.hops_to_read(&snap)).await?;
    Ok((snap, hops))
}

/// Writes and flushes; a closed pipe (`watch … | head`) is not an error worth
/// stopping for: the exit code still tells the run's end. Any other failure
/// (a full disk) is the error.
fn write_all<W: Write>(out: &mut W, text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Ok(());
    }
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.to_string()),
        _ => Ok(()),
    }
}

/// The width of the terminal on stdout (80 when it cannot be asked), and
/// its height when it can.
fn terminal_size() -> (usize, Option<usize>) {
    // SAFETY: TIOCGWINSZ writes a winsize into the struct we own; fd 1 is
    // only queried, never closed
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    if rc != 0 {
        return (80, None);
    }
    let cols = if ws.ws_col > 0 {
        usize::from(ws.ws_col)
    } else {
        80
    };
    (cols, (ws.ws_row > 0).then(|| usize::from(ws.ws_row)))
}

/// What one step looked like when last shown (plain mode prints on change).
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    state: String,
    attempt: i32,
    percent: Option<u32>,
    message: Option<String>,
}

/// The drawing state between frames.
struct View {
    opts: WatchOptions,
    /// Live: how many lines the last frame drew (to move back over them).
    drawn: usize,
    /// Plain: what was last printed per step.
    seen: BTreeMap<String, Seen>,
    /// Plain: each created step's newest history row printed (or passed
    /// over at the first frame: a watch starts from the run as it is).
    known: HashMap<Uuid, i64>,
    /// Plain: a frame was drawn (steps seen later are new: all their
    /// history is printed).
    drawn_once: bool,
    /// Live: the cursor is hidden and must be shown again.
    cursor_hidden: bool,
    /// Live: the terminal's height, when known. A frame is kept shorter: one
    /// taller than the screen scrolls at every redraw, leaving a stale copy
    /// in the scrollback each time.
    rows: Option<usize>,
    /// The steps waiting for a worker that no live worker offers, with
    /// what they need (as `status` says it), as last asked.
    stuck: BTreeMap<String, String>,
    /// Plain: the stuck steps whose line was printed (again once a step
    /// stopped being stuck and is again).
    stuck_said: BTreeMap<String, String>,
}

/// How often a watch asks which waiting steps no live worker offers (a
/// query over the workers' routes): a step stuck for that reason looked
/// `pending` for ever, and only `status` said why (operator's tools audit).
const STUCK_EVERY: Duration = Duration::from_secs(5);

const HIDE_CURSOR: &str = "\x1b[?25l";
const SHOW_CURSOR: &str = "\x1b[?25h";

impl View {
    fn new(opts: WatchOptions) -> View {
        View {
            opts,
            drawn: 0,
            seen: BTreeMap::new(),
            known: HashMap::new(),
            drawn_once: false,
            cursor_hidden: false,
            rows: None,
            stuck: BTreeMap::new(),
            stuck_said: BTreeMap::new(),
        }
    }

    /// The text of one frame: live, the whole screen of bars drawn over the
    /// last; plain, a line per step that changed. `done`: the last frame.
    fn frame(&mut self, run: &WatchRun, hops: &[StepHop], width: usize, done: bool) -> String {
        if self.opts.live {
            self.live_frame(run, width, done)
        } else {
            self.plain_frame(run, hops, done)
        }
    }

    /// Plain: the history to read before drawing `run`, `(step, after,
    /// upto)`: each created step's rows since the last frame, up to the one
    /// `run` saw (a step first seen after the first frame: all of them).
    fn hops_to_read(&self, run: &WatchRun) -> Vec<(Uuid, i64, i64)> {
        if self.opts.live || !self.drawn_once {
            return Vec::new();
        }
        run.steps
            .iter()
            .filter_map(|s| {
                let (id, upto) = (s.step_run_id?, s.last_transition?);
                let after = self.known.get(&id).copied().unwrap_or(0);
                (upto > after).then_some((id, after, upto))
            })
            .collect()
    }

    /// What to write when the watch stops early: the cursor back.
    fn abandon(&mut self) -> String {
        if self.cursor_hidden {
            self.cursor_hidden = false;
            SHOW_CURSOR.into()
        } else {
            String::new()
        }
    }

    fn plain_frame(&mut self, run: &WatchRun, hops: &[StepHop], done: bool) -> String {
        // lines keyed by the history row they tell of, so that the changes
        // of several steps since the last frame come in the order they were
        // made (a step's own rows are in its order by id; across steps, by
        // id is the order they were written in, near enough for a reader);
        // a line of progress alone, and every line of the first frame, come
        // last, in spec order
        let mut lines: Vec<(i64, String)> = Vec::new();
        for s in &run.steps {
            let now = Seen {
                state: s.state.clone(),
                attempt: s.attempt,
                percent: shown_fraction(s).map(|f| (f * 100.0).round() as u32),
                message: s.message.as_deref().map(|m| cell(m, 200)),
            };
            // the states passed through since the last frame, before the
            // one the step is in (its own line, with its progress)
            let mut passed = false;
            let mut key = i64::MAX;
            // a step that ended without running (created only to be
            // cancelled or failed with its run, or past its deadline) is
            // told by its end alone: its momentary `pending` was never a
            // step ready to run (DAG audit: "d: pending,
            // DEPENDENCY_NOT_SUCCEEDED", then "d: cancelled")
            let never_ran = s.attempt == 0 && step_ended(&s.state);
            if let (Some(id), Some(upto)) = (s.step_run_id, s.last_transition) {
                for h in hops.iter().filter(|h| h.step_run_id == id && h.id < upto) {
                    if !never_ran {
                        lines.push((h.id, hop_line(&s.name, h)));
                    }
                    passed = true;
                }
                if self.drawn_once && self.known.get(&id) != Some(&upto) {
                    key = upto;
                }
                self.known.insert(id, upto);
            }
            if passed || self.seen.get(&s.name) != Some(&now) {
                lines.push((key, plain_line(s)));
                self.seen.insert(s.name.clone(), now);
            }
        }
        // stable: equal keys keep spec order
        lines.sort_by_key(|(k, _)| *k);
        let mut out = String::new();
        for (_, l) in lines {
            out.push_str(&l);
            out.push('\n');
        }
        // a waiting step no live worker offers: said once, as it starts
        self.stuck_said
            .retain(|name, _| self.stuck.contains_key(name));
        for (name, needs) in &self.stuck {
            if self.stuck_said.get(name) != Some(needs) {
                out.push_str(&format!(
                    "{}: waits: no live worker offers {needs}\n",
                    cell(name, 40)
                ));
                self.stuck_said.insert(name.clone(), needs.clone());
            }
        }
        self.drawn_once = true;
        if done {
            out.push_str(&summary(run));
        }
        out
    }

    fn live_frame(&mut self, run: &WatchRun, width: usize, done: bool) -> String {
        let width = width.max(20);
        let mut lines = Vec::with_capacity(run.steps.len() + 1);
        lines.push(self.header(run));
        let name_w = run
            .steps
            .iter()
            .map(|s| s.name.chars().count().min(24))
            .max()
            .unwrap_or(4);
        let room = match self.rows {
            // the last frame is drawn whole: nothing is drawn over it
            Some(rows) if !done && rows >= 4 => rows - 1,
            _ => usize::MAX,
        };
        if run.steps.len() < room {
            for s in &run.steps {
                lines.push(self.step_line(s, name_w, width));
            }
        } else {
            // the header, the steps that matter most now, and what is left out
            let (shown, left_out) = pick_steps(&run.steps, room - 2);
            for s in shown {
                lines.push(self.step_line(s, name_w, width));
            }
            lines.push(left_out);
        }
        let mut out = String::new();
        if !self.cursor_hidden && !done {
            out.push_str(HIDE_CURSOR);
            self.cursor_hidden = true;
        }
        if self.drawn > 0 {
            // back to the first line of the last frame
            out.push_str(&format!("\r\x1b[{}A", self.drawn));
        }
        for l in &lines {
            out.push_str("\x1b[2K");
            out.push_str(&fit(l, width.saturating_sub(1)));
            out.push('\n');
        }
        // a frame shorter than the last leaves no stale lines below it
        out.push_str("\x1b[J");
        self.drawn = lines.len();
        if done {
            out.push_str(&summary(run));
            out.push_str(&self.abandon());
        }
        out
    }

    fn header(&self, run: &WatchRun) -> String {
        let cancel = if run.cancel_requested && !run_is_terminal(&run.state) {
            "  (cancel requested)"
        } else {
            ""
        };
        format!(
            "run {}  {}  {}  {}{}",
            run.run_id,
            cell(&run.name, 60),
            self.paint_state(&run.state),
            elapsed(run.elapsed_ms),
            cancel
        )
    }

    fn step_line(&self, s: &WatchStep, name_w: usize, width: usize) -> String {
        let name = pad(&cell(&s.name, name_w), name_w);
        if s.state == "waiting" {
            let on = if s.depends_on.is_empty() {
                String::new()
            } else {
                format!(" on {}", cell(&s.depends_on.join(", "), 120))
            };
            return format!(
                "  {name}  {}  {}{on}",
                self.bar(None, bar_width(width)),
                self.paint_state("waiting")
            );
        }
        let fraction = shown_fraction(s);
        let pct = fraction
            .map(|f| format!("{:>3.0}%", f * 100.0))
            .unwrap_or_else(|| "    ".into());
        let mut line = format!(
            "  {name}  {}  {pct}  {}",
            self.bar(fraction, bar_width(width)),
            pad_painted(&self.paint_state(&s.state), &s.state, 15),
        );
        if s.attempt > 0 {
            line.push_str(&format!("  attempt {}", s.attempt));
        }
        if let Some(ms) = s.elapsed_ms {
            line.push_str(&format!("  {}", elapsed(ms)));
        }
        if let Some(why) = why_text(s).filter(|_| s.error_code.is_some() || s.state == "cancelled")
        {
            line.push_str(&format!("  {why}"));
        } else if self.stuck.contains_key(&s.name) {
            line.push_str("  no live worker offers it (status says what it needs)");
        } else if let Some(m) = s.message.as_deref().filter(|m| !m.trim().is_empty()) {
            line.push_str(&format!("  {}", cell(m, 200)));
        }
        line
    }

    fn bar(&self, fraction: Option<f64>, cells: usize) -> String {
        let (full, empty) = if self.opts.unicode {
            ('█', '░')
        } else {
            ('#', '-')
        };
        let filled = fraction
            .map(|f| ((f * cells as f64).round() as usize).min(cells))
            .unwrap_or(0);
        let mut b = String::with_capacity(cells * 3 + 2);
        b.push('[');
        b.extend(std::iter::repeat_n(full, filled));
        b.extend(std::iter::repeat_n(empty, cells - filled));
        b.push(']');
        b
    }

    fn paint_state(&self, state: &str) -> String {
        if !self.opts.color {
            return state.to_owned();
        }
        let code = match state {
            "succeeded" => "32",                     // green
            "failed" | "terminal_failed" => "31",    // red
            "cancelled" => "33",                     // yellow
            "running" => "36",                       // cyan
            "retryable_failed" => "35",              // magenta
            "waiting" | "pending" | "leased" => "2", // dim
            _ => "0",
        };
        format!("\x1b[{code}m{state}\x1b[0m")
    }
}

/// The fraction to show: a succeeded step is full whatever it last reported.
fn shown_fraction(s: &WatchStep) -> Option<f64> {
    if s.state == "succeeded" {
        return Some(1.0);
    }
    s.fraction
        .filter(|f| f.is_finite())
        .map(|f| f.clamp(0.0, 1.0))
}

/// Bars get what the terminal can spare, between 10 and 30 cells.
fn bar_width(width: usize) -> usize {
    (width / 4).clamp(10, 30)
}

/// A plain line: `step: state, attempt N, 40%, message`.
fn plain_line(s: &WatchStep) -> String {
    let mut line = format!("{}: {}", cell(&s.name, 80), s.state);
    if s.state == "waiting" {
        if !s.depends_on.is_empty() {
            line.push_str(&format!(" on {}", cell(&s.depends_on.join(", "), 200)));
        }
        return line;
    }
    if s.attempt > 0 {
        line.push_str(&format!(", attempt {}", s.attempt));
    }
    if let Some(f) = shown_fraction(s) {
        line.push_str(&format!(", {:.0}%", f * 100.0));
    }
    if let Some(ms) = s.elapsed_ms {
        line.push_str(&format!(", {}", elapsed(ms)));
    }
    if let Some(m) = s.message.as_deref().filter(|m| !m.trim().is_empty()) {
        line.push_str(&format!(", {}", cell(m, 200)));
    }
    if let Some(why) = why_text(s) {
        line.push_str(&format!(", {why}"));
    }
    line
}

/// Why a step is where it is, when that says more than its state (both
/// views): a retry's reason, with when (docs audit: the same retry read
/// "HANDLER_ERROR" or "HANDLER_ERROR: retry in 80 ms" depending on whether
/// a read saw it or the history between two reads); an error; and why a
/// cancelled step was cancelled, as `status` says it: a step that never ran
/// its reason (RUN_FAILED, DEPENDENCY_CANCELLED), one whose last attempt had
/// failed that error and then the cancel (DAG audit: "cancelled, attempt 1,
/// DEMO_FAILURE" read as cancelled by its failure). An attempt that ended
/// `CANCELLED` was the cancel itself (re-check audit: "CANCELLED (then
/// cancelled: RUN_FAILED)").
fn why_text(s: &WatchStep) -> Option<String> {
    let reason = s.last_reason.as_deref().filter(|r| !r.trim().is_empty());
    if s.state == "retryable_failed" {
        if let Some(r) = reason {
            return Some(cell(r, 200));
        }
    }
    let cancel_reason = reason.filter(|_| s.state == "cancelled");
    match &s.error_code {
        Some(code) => {
            let mut why = error_label(&s.state, &cell(code, 40));
            if let Some(r) =
                cancel_reason.filter(|r| code != "CANCELLED" && !r.starts_with(code.as_str()))
            {
                why.push_str(&format!(" (then cancelled: {})", cell(r, 200)));
            }
            Some(why)
        }
        None => cancel_reason.map(|r| cell(r, 200)),
    }
}

/// A state a step passed through between two frames: its attempt, and why
/// it got there where that says more than the state (a failure, a release,
/// an expiry; not a lease or a start).
fn hop_line(name: &str, h: &StepHop) -> String {
    let mut line = format!("{}: {}", cell(name, 80), h.to_state);
    if let Some(a) = h.attempt.filter(|a| *a > 0) {
        line.push_str(&format!(", attempt {a}"));
    }
    if let Some(r) = h.reason.as_deref().filter(|r| !r.trim().is_empty()) {
        if !matches!(h.to_state.as_str(), "leased" | "running") {
            line.push_str(&format!(", {}", cell(r, 200)));
        }
    }
    line
}

/// A step's error code as shown beside its state: the error of a step that
/// is leased or running again is an earlier attempt's (operator audit:
/// "running, attempt 2, … LEASE_LOST" read as a failure of the attempt that
/// runs).
pub fn error_label(state: &str, code: &str) -> String {
    if matches!(state, "leased" | "running") {
        format!("{code} (earlier attempt)")
    } else {
        code.to_owned()
    }
}

/// The end: each failed step's error, then the run's final state.
fn summary(run: &WatchRun) -> String {
    let mut out = String::new();
    for s in &run.steps {
        if let (Some(code), "terminal_failed") = (&s.error_code, s.state.as_str()) {
            out.push_str(&format!(
                "{}: {}: {}\n",
                cell(&s.name, 80),
                cell(code, 40),
                cell(s.error_message.as_deref().unwrap_or(""), 400)
            ));
        }
    }
    out.push_str(&format!(
        "run {} {}: {} in {}\n",
        run.run_id,
        cell(&run.name, 80),
        run.state,
        elapsed(run.elapsed_ms)
    ));
    out
}

/// A duration for people: `4.2s`, `3m05s`, `2h04m`.
fn elapsed(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    if s < 60 {
        // tenths rounded, not cut (88 ms is 0.1s, not 0.0s), short of a minute
        let tenths = ((ms + 50) / 100).min(599);
        format!("{}.{}s", tenths / 10, tenths % 10)
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

fn pad(s: &str, w: usize) -> String {
    let n = s.chars().count();
    format!("{s}{}", " ".repeat(w.saturating_sub(n)))
}

/// At most `n` of `steps` for a screen too short for all: running ones
/// first, then failed, pending, waiting, and finished ones last, shown in
/// spec order; and a line that counts the others by state.
fn pick_steps(steps: &[WatchStep], n: usize) -> (Vec<&WatchStep>, String) {
    let rank = |s: &WatchStep| match s.state.as_str() {
        "running" | "leased" => 0,
        "retryable_failed" | "terminal_failed" => 1,
        "pending" => 2,
        "waiting" => 3,
        _ => 4,
    };
    let mut order: Vec<usize> = (0..steps.len()).collect();
    order.sort_by_key(|&i| (rank(&steps[i]), i));
    let mut chosen: Vec<usize> = order.iter().copied().take(n).collect();
    chosen.sort_unstable();
    let mut hidden: BTreeMap<&str, usize> = BTreeMap::new();
    for &i in order.iter().skip(n) {
        *hidden.entry(steps[i].state.as_str()).or_default() += 1;
    }
    let counts: Vec<String> = hidden.iter().map(|(s, n)| format!("{n} {s}")).collect();
    let left_out = format!(
        "… {} more steps ({}): a taller terminal shows them",
        steps.len() - chosen.len(),
        counts.join(", ")
    );
    (chosen.into_iter().map(|i| &steps[i]).collect(), left_out)
}

/// Pads a painted value by the width of its plain text.
fn pad_painted(painted: &str, plain: &str, w: usize) -> String {
    format!(
        "{painted}{}",
        " ".repeat(w.saturating_sub(plain.chars().count()))
    )
}

/// Cuts a line to `width` visible characters (escape sequences take no
/// room), so a line never wraps and the redraw stays in place.
fn fit(line: &str, width: usize) -> String {
    let mut out = String::with_capacity(line.len());
    let mut visible = 0;
    let mut chars = line.chars().peekable();
    let mut cut = false;
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ params final-byte
            out.push(c);
            if chars.peek() == Some(&'[') {
                for c in chars.by_ref() {
                    out.push(c);
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        if visible >= width {
            cut = true;
            break;
        }
        out.push(c);
        visible += 1;
    }
    if cut && out.contains('\x1b') {
        out.push_str("\x1b[0m");
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, state: &str, attempt: i32, f: Option<f64>, m: Option<&str>) -> WatchStep {
        WatchStep {
            name: name.into(),
            state: state.into(),
            attempt,
            elapsed_ms: Some(1_500),
            fraction: f,
            message: m.map(str::to_owned),
            error_code: None,
            error_message: None,
            depends_on: vec![],
            step_run_id: None,
            last_transition: None,
            last_reason: None,
        }
    }

    fn run(state: &str, steps: Vec<WatchStep>) -> WatchRun {
        WatchRun {
            run_id: Uuid::nil(),
            name: "r".into(),
            state: state.into(),
            cancel_requested: false,
            elapsed_ms: 2_000,
            steps,
        }
    }

    fn opts(live: bool) -> WatchOptions {
        WatchOptions {
            live,
            color: false,
            unicode: false,
            interval: Duration::from_millis(1),
            patience: Duration::from_secs(1),
            read_bound: Duration::from_secs(10),
        }
    }

    /// A waiting step that no live worker offers is said to be so, once in
    /// the plain view (again when it is stuck anew), and on its line in the
    /// live view: it looked `pending` for ever (operator's tools audit).
    #[test]
    fn a_step_no_worker_offers_is_said_to_wait_for_one() {
        let needs = r#"executor_kind "go", kind "demo.nope""#.to_owned();
        let r = run("running", vec![step("a", "pending", 0, None, None)]);
        let mut v = View::new(opts(false));
        v.stuck.insert("a".into(), needs.clone());
        let f = v.frame(&r, &[], 0, false);
        let line = format!("a: waits: no live worker offers {needs}");
        assert!(f.contains(&line), "{f}");
        assert!(!v.frame(&r, &[], 0, false).contains("waits"), "once");
        v.stuck.clear();
        assert!(!v.frame(&r, &[], 0, false).contains("waits"));
        v.stuck.insert("a".into(), needs.clone());
        assert!(v.frame(&r, &[], 0, false).contains(&line), "stuck anew");

        let mut live = View::new(opts(true));
        live.stuck.insert("a".into(), needs);
        let f = live.frame(&r, &[], 120, false);
        assert!(f.contains("no live worker offers it"), "{f}");
    }

    #[test]
    fn plain_prints_a_line_per_change_and_the_end() {
        let mut v = View::new(opts(false));
        let a = run(
            "running",
            vec![step("a", "running", 1, Some(0.4), Some("slice 4/10"))],
        );
        assert_eq!(
            v.frame(&a, &[], 0, false),
            "a: running, attempt 1, 40%, 1.5s, slice 4/10\n"
        );
        assert_eq!(v.frame(&a, &[], 0, false), "", "no change, no line");
        let mut b = run(
            "succeeded",
            vec![step("a", "succeeded", 1, Some(0.9), None)],
        );
        b.steps[0].elapsed_ms = Some(61_000);
        let text = v.frame(&b, &[], 0, true);
        assert_eq!(
            text,
            "a: succeeded, attempt 1, 100%, 1m01s\nrun 00000000-0000-0000-0000-000000000000 r: succeeded in 2.0s\n"
        );
    }

    /// A plain watch prints the states a step passed through between two
    /// reads, from the history: a retry that failed and started again
    /// within one interval showed as one clean success (artifacts audit).
    /// The first frame starts from the run as it is; a step first seen
    /// later shows all its history. The lines of several steps come in the
    /// order of their history rows (re-check audit: they came step by step).
    #[test]
    fn plain_prints_the_states_passed_between_two_reads() {
        let id = Uuid::from_u128(7);
        let late = Uuid::from_u128(8);
        let hop = |step: Uuid, id: i64, to: &str, attempt: i32, reason: &str| StepHop {
            step_run_id: step,
            id,
            to_state: to.into(),
            attempt: Some(attempt),
            reason: Some(reason.into()),
        };
        let mut v = View::new(opts(false));
        let mut a = step("f", "running", 1, None, None);
        (a.step_run_id, a.last_transition) = (Some(id), Some(3));
        let first = run("running", vec![a.clone()]);
        assert!(
            v.hops_to_read(&first).is_empty(),
            "history before the watch is not read"
        );
        assert_eq!(
            v.frame(&first, &[], 0, false),
            "f: running, attempt 1, 1.5s\n"
        );

        // attempts 1 and 2 failed and 3 started between the reads
        a.attempt = 3;
        a.last_transition = Some(10);
        let mut b = step("g", "succeeded", 1, Some(1.0), None);
        (b.step_run_id, b.last_transition) = (Some(late), Some(12));
        let second = run("running", vec![a, b]);
        assert_eq!(v.hops_to_read(&second), vec![(id, 3, 10), (late, 0, 12)]);
        let hops = vec![
            hop(id, 4, "retryable_failed", 1, "DEMO_FAILURE: retry in 50 ms"),
            hop(id, 5, "leased", 2, "LEASED"),
            hop(id, 6, "running", 2, "ACCEPTED"),
            hop(id, 8, "retryable_failed", 2, "DEMO_FAILURE: retry in 50 ms"),
            hop(id, 9, "leased", 3, "LEASED"),
            hop(id, 10, "running", 3, "ACCEPTED"),
            hop(late, 7, "pending", 0, "SUBMITTED"),
            hop(late, 11, "running", 1, "ACCEPTED"),
            hop(late, 12, "succeeded", 1, "SUCCEEDED"),
        ];
        assert_eq!(
            v.frame(&second, &hops, 0, false),
            "f: retryable_failed, attempt 1, DEMO_FAILURE: retry in 50 ms\n\
             f: leased, attempt 2\n\
             f: running, attempt 2\n\
             g: pending, SUBMITTED\n\
             f: retryable_failed, attempt 2, DEMO_FAILURE: retry in 50 ms\n\
             f: leased, attempt 3\n\
             f: running, attempt 3, 1.5s\n\
             g: running, attempt 1\n\
             g: succeeded, attempt 1, 100%, 1.5s\n"
        );
        assert!(v.hops_to_read(&second).is_empty(), "nothing new since");
        assert_eq!(v.frame(&second, &[], 0, false), "", "no change, no line");
    }

    /// A step that ended without running is told by its end, with why; a
    /// cancelled step whose attempt had failed says both (DAG audit: "d:
    /// pending, DEPENDENCY_NOT_SUCCEEDED", then "d: cancelled"; "g:
    /// cancelled, attempt 1, DEMO_FAILURE").
    #[test]
    fn a_cancelled_step_says_why_and_one_that_never_ran_no_pending() {
        let (d_id, g_id) = (Uuid::from_u128(9), Uuid::from_u128(10));
        let mut v = View::new(opts(false));
        let mut g = step("g", "retryable_failed", 1, None, None);
        g.elapsed_ms = None;
        g.error_code = Some("DEMO_FAILURE".into());
        g.last_reason = Some("DEMO_FAILURE: retry in 2000 ms".into());
        (g.step_run_id, g.last_transition) = (Some(g_id), Some(4));
        let mut w = step("d", "waiting", 0, None, None);
        w.depends_on = vec!["g".into()];
        assert_eq!(
            v.frame(&run("running", vec![g.clone(), w]), &[], 0, false),
            "g: retryable_failed, attempt 1, DEMO_FAILURE: retry in 2000 ms\n\
             d: waiting on g\n"
        );
        g.state = "cancelled".into();
        g.last_reason = Some("CANCEL_REQUESTED".into());
        g.last_transition = Some(6);
        let mut d = step("d", "cancelled", 0, None, None);
        d.elapsed_ms = None;
        d.last_reason = Some("DEPENDENCY_CANCELLED".into());
        (d.step_run_id, d.last_transition) = (Some(d_id), Some(8));
        let hops = vec![StepHop {
            step_run_id: d_id,
            id: 7,
            to_state: "pending".into(),
            attempt: Some(0),
            reason: Some("DEPENDENCY_CANCELLED".into()),
        }];
        // an attempt that ended CANCELLED was the cancel itself
        let mut l = step("long", "cancelled", 1, None, None);
        l.elapsed_ms = None;
        l.error_code = Some("CANCELLED".into());
        l.last_reason = Some("RUN_FAILED (CANCELLED)".into());
        let end = run("cancelled", vec![g, d, l]);
        assert_eq!(
            v.frame(&end, &hops, 0, false),
            "g: cancelled, attempt 1, DEMO_FAILURE (then cancelled: CANCEL_REQUESTED)\n\
             d: cancelled, DEPENDENCY_CANCELLED\n\
             long: cancelled, attempt 1, CANCELLED\n"
        );
        // the live view says the same (re-check audit: only --plain did)
        let mut live = View::new(opts(true));
        let frame = live.frame(&end, &[], 200, true);
        for want in [
            "DEMO_FAILURE (then cancelled: CANCEL_REQUESTED)",
            "cancelled        DEPENDENCY_CANCELLED",
            "attempt 1  CANCELLED",
        ] {
            assert!(frame.contains(want), "{want:?} in {frame}");
        }
        assert!(!frame.contains("then cancelled: RUN_FAILED"), "{frame}");
    }

    #[test]
    fn a_retry_read_directly_says_when_as_its_history_row_does() {
        let mut v = View::new(opts(false));
        let mut a = step("ex", "retryable_failed", 1, None, None);
        a.elapsed_ms = None;
        a.error_code = Some("HANDLER_ERROR".into());
        a.last_reason = Some("HANDLER_ERROR: retry in 80 ms".into());
        assert_eq!(
            v.frame(&run("running", vec![a.clone()]), &[], 0, false),
            "ex: retryable_failed, attempt 1, HANDLER_ERROR: retry in 80 ms\n"
        );
        // a terminal failure keeps its code (its reason is the run's story)
        a.state = "terminal_failed".into();
        a.last_reason = Some("HANDLER_ERROR: attempts exhausted (3/3)".into());
        assert_eq!(
            v.frame(&run("running", vec![a]), &[], 0, false),
            "ex: terminal_failed, attempt 1, HANDLER_ERROR\n"
        );
    }

    #[test]
    fn live_draws_bars_over_the_last_frame() {
        let mut v = View::new(opts(true));
        let mut w = step("b", "waiting", 0, None, None);
        w.depends_on = vec!["a".into()];
        let r = run(
            "running",
            vec![step("a", "running", 2, Some(0.5), Some("half")), w],
        );
        let first = v.frame(&r, &[], 80, false);
        assert!(first.starts_with(HIDE_CURSOR), "{first:?}");
        assert!(
            first.contains(
                "a  [##########----------]   50%  running          attempt 2  1.5s  half"
            ),
            "{first:?}"
        );
        assert!(
            first.contains("b  [--------------------]  waiting on a"),
            "{first:?}"
        );
        let second = v.frame(&r, &[], 80, true);
        assert!(
            second.starts_with("\r\x1b[3A"),
            "moves back over 3 lines: {second:?}"
        );
        assert!(second.ends_with(SHOW_CURSOR), "{second:?}");
    }

    /// A run with more steps than the terminal has rows is drawn in fewer
    /// lines than the screen (a taller frame scrolls at every redraw, and
    /// the scrollback fills with stale copies): the running steps first,
    /// the others counted. The last frame is drawn whole.
    #[test]
    fn live_frames_fit_the_terminals_height() {
        let mut steps: Vec<WatchStep> = (0..30)
            .map(|i| step(&format!("s{i:02}"), "succeeded", 1, None, None))
            .collect();
        steps[27].state = "running".into();
        steps[5].state = "pending".into();
        let r = run("running", steps);
        let mut v = View::new(opts(true));
        v.rows = Some(10);
        let f = v.frame(&r, &[], 80, false);
        assert_eq!(f.matches('\n').count(), 9, "{f}");
        assert!(f.contains("s27") && f.contains("s05"), "{f}");
        assert!(f.find("s05") < f.find("s27"), "in spec order: {f}");
        assert!(
            f.contains("… 23 more steps (23 succeeded): a taller terminal shows them"),
            "{f}"
        );
        let again = v.frame(&r, &[], 80, false);
        assert!(
            again.contains("\r\x1b[9A"),
            "moves back over 9 lines: {again:?}"
        );
        let last = v.frame(&r, &[], 80, true);
        assert!(
            last.contains("s29") && !last.contains("more steps"),
            "{last}"
        );
        // a screen tall enough shows every step
        let mut v = View::new(opts(true));
        v.rows = Some(40);
        let f = v.frame(&r, &[], 80, false);
        assert_eq!(f.matches('\n').count(), 31, "{f}");
    }

    #[test]
    fn lines_fit_the_terminal_and_hostile_text_is_cleaned() {
        assert_eq!(fit("abcdef", 4), "abcd");
        assert_eq!(fit("\x1b[32mabcdef\x1b[0m", 3), "\x1b[32mabc\x1b[0m");
        assert_eq!(cell("a\x1b[2Jb\nc", 10), "a [2Jb c");
        assert_eq!(elapsed(59_999), "59.9s");
        assert_eq!(elapsed(88), "0.1s");
        assert_eq!(elapsed(49), "0.0s");
        assert_eq!(elapsed(4_250), "4.3s");
        assert_eq!(elapsed(7_260_000), "2h01m");
        assert_eq!(WatchEnd::Terminal("failed".into()).exit_code(), 1);
        assert_eq!(WatchEnd::Terminal("cancelled".into()).exit_code(), 3);
        assert_eq!(WatchEnd::Terminal("succeeded".into()).exit_code(), 0);
    }
}
