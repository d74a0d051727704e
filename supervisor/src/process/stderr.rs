//! Continuous, bounded draining of a child's stderr.
//!
//! A child that writes more than a pipe buffer (64 KiB on Linux) to stderr
//! blocks forever if nobody reads it. Every child therefore gets a task that
//! reads its stderr until EOF, keeps only the **last** `cap` bytes in a ring
//! buffer, counts the total, and forwards complete lines (truncated when
//! long) to `tracing` at info under [`STDERR_TARGET`]: inside the span of the
//! attempt the process serves ([`StderrTail::log_in`]; before that, the span
//! it was started in; between jobs of a persistent process, none), through
//! that attempt's redactor, and at most [`log_rate`] lines per second and
//! attempt — the rest are counted and reported in one "suppressed" line per
//! window. Memory use never grows with the amount of output.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::process::ChildStderr;

/// `tracing` target under which stderr lines of children are logged (info level).
pub const STDERR_TARGET: &str = "supervisor::process::stderr";

/// Lines longer than this are truncated before being forwarded to `tracing`.
const MAX_LOG_LINE: usize = 1024;

/// Size of the read buffer used by the drain task.
const READ_CHUNK: usize = 64 * 1024;

/// The default of [`log_rate`] (the worker config's `stderr_log_lines_per_sec`).
pub const DEFAULT_LOG_LINES_PER_SEC: u32 = 20;

static LOG_LINES_PER_SEC: AtomicU32 = AtomicU32::new(DEFAULT_LOG_LINES_PER_SEC);

/// Sets how many stderr lines per second and attempt are logged (0: none).
/// Process-wide: the worker sets it from its config at start.
pub fn set_log_rate(lines_per_sec: u32) {
    LOG_LINES_PER_SEC.store(lines_per_sec, Ordering::Relaxed);
}

/// How many stderr lines per second and attempt are logged.
pub fn log_rate() -> u32 {
    LOG_LINES_PER_SEC.load(Ordering::Relaxed)
}

/// What a logged line goes through first: the attempt's redactor.
pub trait RedactLine: Send + Sync {
    fn redact_line(&self, line: &str) -> String;
}

type LineFilter = Arc<dyn RedactLine>;

/// A fixed one-second window: up to `per_sec` lines pass, the rest are
/// counted and reported once the window is over (or the attempt ends).
#[derive(Debug)]
pub(crate) struct RateLimit {
    per_sec: u32,
    window: Option<Instant>,
    used: u32,
    suppressed: u64,
}

const WINDOW: Duration = Duration::from_secs(1);

impl RateLimit {
    pub(crate) fn new(per_sec: u32) -> Self {
        RateLimit {
            per_sec,
            window: None,
            used: 0,
            suppressed: 0,
        }
    }

    /// Whether the line arriving `now` is logged, and how many lines of the
    /// window that just ended were suppressed (to report first).
    pub(crate) fn admit(&mut self, now: Instant) -> (bool, u64) {
        let mut ended = 0;
        match self.window {
            Some(start) if now.saturating_duration_since(start) < WINDOW => {}
            _ => {
                ended = std::mem::take(&mut self.suppressed);
                self.window = Some(now);
                self.used = 0;
            }
        }
        if self.used < self.per_sec {
            self.used += 1;
            (true, ended)
        } else {
            self.suppressed += 1;
            (false, ended)
        }
    }

    /// The lines suppressed in the current window, not reported yet.
    pub(crate) fn take_suppressed(&mut self) -> u64 {
        std::mem::take(&mut self.suppressed)
    }
}

/// Where the lines of one child go now.
struct LogSink {
    span: tracing::Span,
    filter: Option<LineFilter>,
    /// The [`LogGuard`] that attached this sink (0: none).
    owner: u64,
    limit: RateLimit,
}

static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

impl LogSink {
    fn line(&mut self, pid: i32, line: &[u8], truncated: bool) {
        let (admit, ended) = self.limit.admit(Instant::now());
        if ended > 0 {
            self.suppressed(pid, ended);
        }
        if !admit {
            return;
        }
        let mut text = String::from_utf8_lossy(line);
        if truncated {
            // marked cut before the redactor reads it: a value that straddles
            // the cut is still found by its first bytes (it was logged in part)
            text.to_mut().push('…');
        }
        let text = match &self.filter {
            Some(f) => f.redact_line(&text),
            None => crate::secrets::Redactor::none()
                .redact_str(&text)
                .into_owned(),
        };
        self.span.in_scope(|| {
            if truncated {
                tracing::info!(target: STDERR_TARGET, pid, truncated, "{text}");
            } else {
                tracing::info!(target: STDERR_TARGET, pid, "{text}");
            }
        });
    }

    fn suppressed(&self, pid: i32, lines: u64) {
        crate::metrics::stderr_lines_suppressed(lines);
        let per_sec = self.limit.per_sec;
        self.span.in_scope(|| {
            tracing::info!(target: STDERR_TARGET, pid, suppressed = lines, per_sec,
                "executor stderr: {lines} more lines suppressed (at most {per_sec} lines per second are logged)")
        });
    }

    fn flush(&mut self, pid: i32) {
        let n = self.limit.take_suppressed();
        if n > 0 {
            self.suppressed(pid, n);
        }
    }
}

/// Ends the logging of a child's stderr in an attempt's span (see
/// [`StderrTail::log_in`]): the suppressed lines are reported, and the rate
/// window starts anew. Later lines stay in that attempt's span, with its
/// filter, until the next job's: a line a persistent process wrote just
/// before its terminal may be read from the pipe after the attempt ended
/// (one in ten of a short job's lines were logged outside any attempt), and
/// an idle process may still print what its last job was handed.
pub struct LogGuard {
    tail: StderrTail,
    owner: u64,
    pid: i32,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let mut sink = self.tail.sink();
        if sink.owner == self.owner {
            sink.flush(self.pid);
            sink.owner = 0;
            sink.limit = RateLimit::new(log_rate());
        }
    }
}

#[derive(Debug)]
struct TailState {
    buf: VecDeque<u8>,
    cap: usize,
    total: u64,
    closed: bool,
}

impl TailState {
    fn push(&mut self, data: &[u8]) {
        self.total = self.total.saturating_add(data.len() as u64);
        if self.cap == 0 {
            return;
        }
        if data.len() >= self.cap {
            self.buf.clear();
            self.buf.extend(&data[data.len() - self.cap..]);
            return;
        }
        let overflow = (self.buf.len() + data.len()).saturating_sub(self.cap);
        self.buf.drain(..overflow);
        self.buf.extend(data);
    }
}

/// Cheaply clonable handle on the retained tail of a child's stderr.
///
/// The drain task keeps updating it until the pipe reaches EOF; clones stay
/// valid after the [`Child`](super::Child) is gone.
#[derive(Clone)]
pub struct StderrTail {
    inner: Arc<Mutex<TailState>>,
    log: Arc<Mutex<LogSink>>,
}

impl std::fmt::Debug for StderrTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StderrTail")
            .field("state", &*self.lock())
            .finish_non_exhaustive()
    }
}

impl StderrTail {
    /// Lines are logged in the current span until [`log_in`](Self::log_in).
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(TailState {
                // Grows on demand up to `cap`; children that print little cost little.
                buf: VecDeque::new(),
                cap,
                total: 0,
                closed: false,
            })),
            log: Arc::new(Mutex::new(LogSink {
                span: tracing::Span::current(),
                filter: None,
                owner: 0,
                limit: RateLimit::new(log_rate()),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, TailState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sink(&self) -> MutexGuard<'_, LogSink> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// From now on (until the guard drops) the child's stderr lines are
    /// logged inside `span` (an attempt's), through `filter` (its
    /// redactor), at most [`log_rate`] lines per second. The rate window
    /// starts anew unless `span` is the one lines already went to (a
    /// one-shot process is started inside its attempt's span).
    pub fn log_in(&self, pid: i32, span: tracing::Span, filter: LineFilter) -> LogGuard {
        let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
        let mut sink = self.sink();
        let same = span.id().is_some() && sink.span.id() == span.id();
        if !same {
            sink.flush(pid);
            sink.limit = RateLimit::new(log_rate());
        }
        sink.span = span;
        sink.filter = Some(filter);
        sink.owner = owner;
        drop(sink);
        LogGuard {
            tail: self.clone(),
            owner,
            pid,
        }
    }

    pub(crate) fn push(&self, data: &[u8]) {
        self.lock().push(data);
    }

    pub(crate) fn mark_closed(&self) {
        self.lock().closed = true;
    }

    /// The retained last bytes (at most [`capacity`](Self::capacity)).
    pub fn tail_bytes(&self) -> Vec<u8> {
        let state = self.lock();
        let (a, b) = state.buf.as_slices();
        let mut out = Vec::with_capacity(a.len() + b.len());
        out.extend_from_slice(a);
        out.extend_from_slice(b);
        out
    }

    /// The retained last bytes as lossy UTF-8 (a multi-byte character cut at
    /// the start of the window shows as U+FFFD).
    pub fn tail_string(&self) -> String {
        String::from_utf8_lossy(&self.tail_bytes()).into_owned()
    }

    /// [`Self::tail_string`] for a redactor: `…` first when its start was
    /// cut, so that the end of a value that straddled the cut is found (it
    /// was logged in part).
    pub fn tail_marked(&self) -> String {
        let bytes = self.tail_bytes();
        let text = String::from_utf8_lossy(&bytes);
        // bytes written since the copy only add a mark to an uncut tail
        if self.total_bytes() > bytes.len() as u64 {
            format!("…{text}")
        } else {
            text.into_owned()
        }
    }

    /// Total number of bytes the child wrote to stderr so far.
    pub fn total_bytes(&self) -> u64 {
        self.lock().total
    }

    /// Whether the drain has finished (EOF or read error): no more bytes will come.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Maximum number of bytes retained.
    pub fn capacity(&self) -> usize {
        self.lock().cap
    }
}

/// Splits a byte stream into lines, truncating each at `max` bytes, with a
/// bounded amount of buffered state.
#[derive(Debug)]
pub(crate) struct LineSplitter {
    line: Vec<u8>,
    truncated: bool,
    max: usize,
}

impl LineSplitter {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            line: Vec::new(),
            truncated: false,
            max,
        }
    }

    /// Feeds bytes; calls `on_line(line, truncated)` for every completed line
    /// (without the trailing `\n`).
    pub(crate) fn feed(&mut self, data: &[u8], mut on_line: impl FnMut(&[u8], bool)) {
        for piece in data.split_inclusive(|b| *b == b'\n') {
            let (content, ends) = match piece.split_last() {
                Some((b'\n', rest)) => (rest, true),
                _ => (piece, false),
            };
            let room = self.max.saturating_sub(self.line.len());
            if content.len() > room {
                self.line.extend_from_slice(&content[..room]);
                self.truncated = true;
            } else {
                self.line.extend_from_slice(content);
            }
            if ends {
                self.emit(&mut on_line);
            }
        }
    }

    /// Flushes a final unterminated line, if any.
    pub(crate) fn finish(&mut self, mut on_line: impl FnMut(&[u8], bool)) {
        if !self.line.is_empty() || self.truncated {
            self.emit(&mut on_line);
        }
    }

    fn emit(&mut self, on_line: &mut impl FnMut(&[u8], bool)) {
        let line = match self.line.split_last() {
            Some((b'\r', rest)) => rest,
            _ => &self.line[..],
        };
        on_line(line, self.truncated);
        self.line.clear();
        self.truncated = false;
    }
}

/// Whether lines are logged at all (the rate is not 0 and the target is on).
fn logging() -> bool {
    log_rate() > 0 && tracing::enabled!(target: STDERR_TARGET, tracing::Level::INFO)
}

/// Reads `pipe` until EOF into `tail`. Runs as its own task for the whole life
/// of the child (and possibly a little longer, until the last writer closes).
pub(crate) async fn drain(mut pipe: ChildStderr, tail: StderrTail, pid: i32) {
    let mut buf = vec![0u8; READ_CHUNK];
    let mut lines = LineSplitter::new(MAX_LOG_LINE);
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                let chunk = &buf[..n];
                tail.push(chunk);
                if logging() {
                    let mut sink = tail.sink();
                    lines.feed(chunk, |l, t| sink.line(pid, l, t));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(pid, error = %e, "reading child stderr failed; stopping drain");
                break;
            }
        }
    }
    if logging() {
        let mut sink = tail.sink();
        lines.finish(|l, t| sink.line(pid, l, t));
        sink.flush(pid);
    }
    tail.mark_closed();
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn ring_keeps_last_bytes() {
        let tail = StderrTail::new(8);
        tail.push(b"0123");
        assert_eq!(tail.tail_bytes(), b"0123");
        tail.push(b"4567");
        assert_eq!(tail.tail_bytes(), b"01234567");
        tail.push(b"89");
        assert_eq!(tail.tail_bytes(), b"23456789");
        tail.push(b"abcdefghijkl");
        assert_eq!(tail.tail_bytes(), b"efghijkl");
        tail.push(b"");
        assert_eq!(tail.tail_string(), "efghijkl");
        assert_eq!(tail.total_bytes(), 4 + 4 + 2 + 12);
        assert!(!tail.is_closed());
        tail.mark_closed();
        assert!(tail.is_closed());
    }

    struct Plain;
    impl RedactLine for Plain {
        fn redact_line(&self, line: &str) -> String {
            line.to_owned()
        }
    }

    /// A line read after its attempt ended (the pipe is drained on its own
    /// task) is still logged in that attempt's span, until the next job's.
    #[test]
    fn lines_stay_in_the_last_attempts_span_until_the_next() {
        let subscriber = tracing_subscriber::registry();
        tracing::subscriber::with_default(subscriber, || {
            let tail = StderrTail::new(64);
            let first = tracing::info_span!("attempt", n = 1);
            let guard = tail.log_in(7, first.clone(), Arc::new(Plain));
            drop(guard);
            assert_eq!(tail.sink().span.id(), first.id(), "kept after the attempt");
            assert_eq!(tail.sink().owner, 0);
            let second = tracing::info_span!("attempt", n = 2);
            let _g = tail.log_in(7, second.clone(), Arc::new(Plain));
            assert_eq!(tail.sink().span.id(), second.id());
        });
    }

    #[test]
    fn ring_with_zero_capacity_only_counts() {
        let tail = StderrTail::new(0);
        tail.push(b"hello");
        assert!(tail.tail_bytes().is_empty());
        assert_eq!(tail.total_bytes(), 5);
    }

    #[test]
    fn ring_memory_is_bounded() {
        let tail = StderrTail::new(1024);
        let chunk = vec![b'x'; 4096];
        for _ in 0..1000 {
            tail.push(&chunk);
            tail.push(b"y");
        }
        assert_eq!(tail.tail_bytes().len(), 1024);
        assert!(tail.lock().buf.capacity() <= 4096);
        assert_eq!(tail.total_bytes(), 1000 * 4097);
    }

    #[test]
    fn lossy_tail() {
        let tail = StderrTail::new(3);
        tail.push("aé€".as_bytes()); // 1 + 2 + 3 bytes; last 3 bytes are the euro sign
        assert_eq!(tail.tail_string(), "€");
        tail.push(b"z");
        assert!(tail.tail_string().ends_with('z'));
        assert!(tail.tail_string().contains('\u{FFFD}'));
    }

    #[test]
    fn the_rate_limit_passes_n_lines_a_second_and_counts_the_rest() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(3);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(r.admit(at(0)), (true, 0));
        assert_eq!(r.admit(at(10)), (true, 0));
        assert_eq!(r.admit(at(20)), (true, 0));
        assert_eq!(r.admit(at(30)), (false, 0));
        assert_eq!(r.admit(at(999)), (false, 0));
        // the next window reports what the last one suppressed, once
        assert_eq!(r.admit(at(1000)), (true, 2));
        assert_eq!(r.admit(at(1001)), (true, 0));
        assert_eq!(r.admit(at(1002)), (true, 0));
        assert_eq!(r.admit(at(1003)), (false, 0));
        assert_eq!(r.take_suppressed(), 1);
        assert_eq!(r.take_suppressed(), 0);
        // a quiet gap starts a fresh window
        assert_eq!(r.admit(at(5000)), (true, 0));
        // 0 lines a second: nothing passes, everything is counted
        let mut none = RateLimit::new(0);
        for i in 0..10 {
            assert_eq!(none.admit(at(i)), (false, 0));
        }
        assert_eq!(none.take_suppressed(), 10);
    }

    fn split(max: usize, chunks: &[&[u8]]) -> Vec<(String, bool)> {
        let mut out = Vec::new();
        let mut s = LineSplitter::new(max);
        for c in chunks {
            s.feed(c, |l, t| {
                out.push((String::from_utf8_lossy(l).into_owned(), t))
            });
        }
        s.finish(|l, t| out.push((String::from_utf8_lossy(l).into_owned(), t)));
        out
    }

    #[test]
    fn splitter_joins_and_truncates() {
        assert_eq!(
            split(100, &[b"ab", b"c\nde", b"f\r\n", b"\n", b"tail"]),
            vec![
                ("abc".to_string(), false),
                ("def".to_string(), false),
                (String::new(), false),
                ("tail".to_string(), false)
            ]
        );
        assert_eq!(
            split(4, &[b"0123456789", b"abc\nxy\n"]),
            vec![("0123".to_string(), true), ("xy".to_string(), false)]
        );
        assert_eq!(split(4, &[b"0123456789"]), vec![("0123".to_string(), true)]);
        assert!(split(4, &[]).is_empty());
    }
}
