//! Continuous, bounded draining of a child's stderr.
//!
//! A child that writes more than a pipe buffer (64 KiB on Linux) to stderr
//! blocks forever if nobody reads it. Every child therefore gets a task that
//! reads its stderr until EOF, keeps only the **last** `cap` bytes in a ring
//! buffer, counts the total, and (when `debug` is enabled for
//! [`STDERR_TARGET`]) forwards complete lines to `tracing`, truncating long
//! ones. Memory use never grows with the amount of output.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::AsyncReadExt;
use tokio::process::ChildStderr;

/// `tracing` target under which stderr lines of children are logged (debug level).
pub const STDERR_TARGET: &str = "supervisor::process::stderr";

/// Lines longer than this are truncated before being forwarded to `tracing`.
const MAX_LOG_LINE: usize = 1024;

/// Size of the read buffer used by the drain task.
const READ_CHUNK: usize = 64 * 1024;

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
#[derive(Debug, Clone)]
pub struct StderrTail {
    inner: Arc<Mutex<TailState>>,
}

impl StderrTail {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(TailState {
                // Grows on demand up to `cap`; children that print little cost little.
                buf: VecDeque::new(),
                cap,
                total: 0,
                closed: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, TailState> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
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

fn log_line(pid: i32, line: &[u8], truncated: bool) {
    let text = String::from_utf8_lossy(line);
    tracing::debug!(target: STDERR_TARGET, pid, truncated, "{text}");
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
                if tracing::enabled!(target: STDERR_TARGET, tracing::Level::DEBUG) {
                    lines.feed(chunk, |l, t| log_line(pid, l, t));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(pid, error = %e, "reading child stderr failed; stopping drain");
                break;
            }
        }
    }
    if tracing::enabled!(target: STDERR_TARGET, tracing::Level::DEBUG) {
        lines.finish(|l, t| log_line(pid, l, t));
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
