//! Child-process supervision.
//!
//! Every child is spawned so that it, and everything it forks, can be found
//! and killed reliably:
//!
//! * **Own process group.** The child runs `setpgid(0, 0)` before exec and is
//!   signalled as a group (`kill(-pgid, sig)`), so grandchildren go down with
//!   it (signalling only the direct child lets grandchildren survive).
//! * **Dedicated spawner thread + `PR_SET_PDEATHSIG`.** The death signal fires
//!   when the *thread* that forked exits, so all forks happen on one
//!   long-lived thread ([`Spawner`]); before exec the child arms
//!   `PR_SET_PDEATHSIG=SIGKILL` and exits if its parent already changed.
//! * **No copy of the worker.** The child is started with
//!   `clone(CLONE_VM | CLONE_VFORK)`, as `posix_spawn` does, not `fork()`:
//!   the worker's page tables are never copied nor its pages write-protected
//!   (`vfork.rs` says what runs between clone and exec, and why).
//! * **Signal before reap.** The leader's exit is detected *without* reaping it
//!   (a pidfd, readable once the leader is a zombie; `waitid(WNOWAIT)` to
//!   confirm). While the zombie pins the pid, the group id cannot be reused,
//!   so the group is SIGKILLed (grandchildren) and only then reaped. After the
//!   reap the group is never signalled again ([`ProcessError::AlreadyReaped`]).
//!   `tokio::process` is not used because it reaps on its own.
//! * **Bounded stderr.** stderr is drained continuously on its own task into a
//!   ring buffer of the last `stderr_tail_bytes` bytes ([`StderrTail`]), so a
//!   chatty child never blocks on a full pipe and memory never grows.
//! * **Exit independent of stdout EOF.** A grandchild may keep stdout open
//!   forever; [`Child::exited`] reports the leader's exit regardless, after
//!   which the caller can drain stdout with an idle timeout and
//!   [`Child::finish`] the group.
//! * **Clean environment.** The environment is cleared; only allowlisted
//!   variables (copied from this process if set) and explicit pairs are passed.
//! * **No orphans.** Dropping an un-reaped [`Child`] SIGKILLs its group and
//!   reaps it on a detached thread; [`kill_all_groups`] SIGKILLs every live
//!   group (shutdown / fatal paths).
//! * **Subreaper, no zombies.** The worker registers as child subreaper
//!   ([`become_subreaper`]; as PID 1 of a container it is init anyway), so
//!   orphaned grandchildren are re-parented to it, and the orphan reaper
//!   ([`start_orphan_reaper`]) reaps every exited child that is not a
//!   tracked leader (rules and argument in `reaper.rs`).
//! * **Marker and sweep.** A [`Spawner`] started with a [`Marker`] stamps
//!   every child's environment with the worker's slot (its name) and
//!   instance; a restarted worker ends what a dead previous incarnation left
//!   with [`sweep_previous_incarnations`], finding processes by that marker
//!   in `/proc/<pid>/environ` as it is now, never by a stored pid.
//! * **cgroup v2 where allowed.** Each child runs in a cgroup of its own and
//!   stopping it also writes `cgroup.kill`, which ends `setsid` escapees; where
//!   the host does not allow it, process groups alone ([`cgroup_mode`] and
//!   `cgroup.rs` say what is detected and what changes).

mod cgroup;
mod group;
mod limits;
mod marker;
mod reaper;
mod spawner;
mod stderr;
mod sweep;
#[cfg(test)]
mod tests;
mod vfork;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::process::{ChildStdin, ChildStdout};
use tokio::task::JoinHandle;

pub use cgroup::{cgroup_mode, CgroupMode, CGROUPS_ENV};
pub use group::{group_members, kill_all_groups, live_groups};
pub use limits::{raise_open_file_limit, return_large_frees_to_the_system, OpenFileLimit};
pub use marker::{Marker, INSTANCE_ENV, SLOT_ENV, SUPERVISOR_ENV};
pub use reaper::{
    announce_reaper, become_subreaper, is_subreaper, orphans_reaped, reap_orphans,
    start_orphan_reaper, ReapPass,
};
pub use spawner::Spawner;
pub use stderr::{
    log_rate as stderr_log_rate, set_log_rate as set_stderr_log_rate, LogGuard, RedactLine,
    StderrTail, STDERR_TARGET,
};
pub use sweep::{kill_adopted_orphans, sweep_previous_incarnations, SweepReport, MAX_SWEEP_PASSES};

use group::GroupGuard;
use spawner::RawChild;

/// Default for [`SpawnSpec::stderr_tail_bytes`]: 64 KiB.
pub const DEFAULT_STDERR_TAIL_BYTES: usize = 64 * 1024;

/// How long reaping waits for the stderr drain to hit EOF (after the whole
/// group was SIGKILLed) so the report contains the final bytes. Only an
/// escaped process (one that left the group) holding stderr makes it wait
/// this long; the drain is then abandoned.
const STDERR_DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Poll interval when no pidfd is available (kernel < 5.3) or it misbehaves.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How long a SIGKILLed process may take to end before a stop says which
/// tracer holds it.
const TRACED_REAP_NOTE: Duration = Duration::from_secs(1);

/// A step of a child's stop escalation ([`Child::stop`], [`Child::kill_now`]),
/// told to its caller as it is taken: the caller's log and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopStep {
    /// The leader is stopped by a signal or a debugger: SIGKILL to its group
    /// at once, without waking it.
    KillStopped,
    /// The leader runs: SIGTERM to its group; the grace begins.
    Term,
    /// The grace ran out, or was cut short (a forced stop), with the leader
    /// still running: SIGKILL to its group.
    KillAfterGrace { cut_short: bool },
    /// SIGKILLed, the leader has not ended within a second: this tracer (a
    /// debugger) holds it, and it ends once let go; the stop waits for that.
    HeldByTracer(i32),
}

/// Errors of the process-supervision module.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The dedicated spawner thread could not be started.
    #[error("failed to start the process spawner thread: {0}")]
    SpawnerStart(#[source] std::io::Error),

    /// The spawner thread is gone (should not happen while a `Spawner` exists).
    #[error("cannot spawn {}: the process spawner thread is gone", .program.display())]
    SpawnerGone { program: PathBuf },

    /// fork/exec failed: missing program, bad cwd, not executable, ...
    #[error("failed to spawn {} (cwd {}): {source}", .program.display(), .cwd.display())]
    Spawn {
        program: PathBuf,
        cwd: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The child was spawned but wiring it to the runtime failed; it has been
    /// killed and is reaped in the background.
    #[error("failed to set up {what} for {} (pid {pid}): {source}", .program.display())]
    Setup {
        program: PathBuf,
        pid: i32,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// Sending a signal to the process group failed (other than ESRCH).
    #[error("failed to send {signal} to process group {pid} ({}): {source}", .program.display())]
    Signal {
        program: PathBuf,
        pid: i32,
        signal: Signal,
        #[source]
        source: nix::errno::Errno,
    },

    /// The leader was already reaped: its id may have been reused, so the
    /// group is never signalled again.
    #[error("process group {pid} ({}) was already reaped; refusing to signal a possibly reused id", .program.display())]
    AlreadyReaped { program: PathBuf, pid: i32 },

    /// Watching for or reaping the leader's exit failed.
    #[error("waiting for {} (pid {pid}) failed: {source}", .program.display())]
    Wait {
        program: PathBuf,
        pid: i32,
        #[source]
        source: std::io::Error,
    },

    /// `prctl(PR_SET_CHILD_SUBREAPER)` failed (Linux < 3.4?).
    #[error("cannot become a child subreaper (prctl PR_SET_CHILD_SUBREAPER): {0}")]
    Subreaper(#[source] std::io::Error),

    /// The orphan reaper thread could not be started.
    #[error("failed to start the orphan reaper: {0}")]
    ReaperStart(#[source] std::io::Error),

    /// A spawner marker that cannot be put in an environment.
    #[error("invalid supervisor marker: {reason}")]
    InvalidMarker { reason: String },
}

/// What to run and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnSpec {
    /// Program to execute. A bare name is looked up in the child's `PATH`
    /// (i.e. only if `PATH` is allowlisted or set explicitly); prefer absolute paths.
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Working directory of the child.
    pub cwd: PathBuf,
    /// Explicit variables; they override allowlisted ones of the same name.
    pub env: Vec<(String, String)>,
    /// Names of variables copied from this process's environment, if set.
    pub env_allowlist: Vec<String>,
    /// How many trailing stderr bytes to keep (0 keeps none, but still drains
    /// and counts). See [`DEFAULT_STDERR_TAIL_BYTES`].
    pub stderr_tail_bytes: usize,
}

impl SpawnSpec {
    /// A spec with no args, no environment and the default stderr tail.
    pub fn new(program: impl Into<PathBuf>, cwd: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            cwd: cwd.into(),
            env: Vec::new(),
            env_allowlist: Vec::new(),
            stderr_tail_bytes: DEFAULT_STDERR_TAIL_BYTES,
        }
    }
}

/// How the leader ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitStatusKind {
    /// Exited normally with this code.
    Exited(i32),
    /// Killed by a signal; the name, e.g. `"SIGKILL"` (`"SIG<n>"` if unnamed).
    Signaled(String),
}

impl ExitStatusKind {
    /// `Exited(0)`.
    pub fn success(&self) -> bool {
        matches!(self, ExitStatusKind::Exited(0))
    }

    /// The exit code, if it exited normally.
    pub fn code(&self) -> Option<i32> {
        match self {
            ExitStatusKind::Exited(code) => Some(*code),
            ExitStatusKind::Signaled(_) => None,
        }
    }

    /// The signal name, if it was killed by a signal.
    pub fn signal_name(&self) -> Option<&str> {
        match self {
            ExitStatusKind::Exited(_) => None,
            ExitStatusKind::Signaled(name) => Some(name),
        }
    }
}

impl std::fmt::Display for ExitStatusKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatusKind::Exited(code) => write!(f, "exited with code {code}"),
            ExitStatusKind::Signaled(name) => write!(f, "killed by {name}"),
        }
    }
}

/// Outcome of a reaped child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub status: ExitStatusKind,
    /// True when we had to SIGKILL a leader that was still running: the
    /// `term_grace` of [`Child::terminate`] expired, or [`Child::kill`] was
    /// used on a running child. (The group-wide SIGKILL that always follows
    /// the leader's exit, for grandchildren, does not count.)
    pub escalated_to_kill: bool,
    /// Lossy UTF-8 of the last retained stderr bytes.
    pub stderr_tail: String,
    /// Total bytes the child wrote to stderr.
    pub stderr_total_bytes: u64,
}

enum ExitWatch {
    PidFd(AsyncFd<OwnedFd>),
    Poll,
}

/// A spawned child: leader of its own process group (`pgid == pid`).
///
/// Dropping a `Child` that was not reaped SIGKILLs its group and reaps it in
/// the background: a child never outlives its handle.
pub struct Child {
    /// Pid of the leader, which is also the process group id. (Informational:
    /// the handle keeps its own copy, so changing this field changes nothing.)
    pub pid: i32,
    guard: GroupGuard,
    stdin: Option<ChildStdin>,
    stdout: Option<ChildStdout>,
    stderr: StderrTail,
    drain: Option<JoinHandle<()>>,
    watch: ExitWatch,
    exited: AtomicBool,
    report: Option<ExitReport>,
}

impl std::fmt::Debug for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Child")
            .field("pid", &self.guard.pid)
            .field("program", &self.guard.program)
            .field("exited", &self.exited.load(Ordering::Relaxed))
            .field("reaped", &self.guard.is_reaped())
            .finish_non_exhaustive()
    }
}

impl Child {
    /// Wires a freshly spawned child to the current runtime. On error the
    /// partially built `Child` is dropped, which kills and reaps the group.
    fn from_raw(raw: RawChild) -> Result<Child, ProcessError> {
        let RawChild {
            guard,
            stdin,
            stdout,
            stderr,
            pidfd,
            stderr_tail_bytes,
        } = raw;
        let pid = guard.pid;
        let mut child = Child {
            pid,
            guard,
            stdin: None,
            stdout: None,
            stderr: StderrTail::new(stderr_tail_bytes),
            drain: None,
            watch: ExitWatch::Poll,
            exited: AtomicBool::new(false),
            report: None,
        };
        if let Some(fd) = pidfd {
            // SAFETY: the OwnedFd is moved into the AsyncFd and owned by it
            // until the AsyncFd is dropped; nothing else can close or replace it.
            match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(fd) => child.watch = ExitWatch::PidFd(fd),
                Err(e) => {
                    tracing::warn!(pid, error = %e, "cannot register pidfd; polling for exit instead")
                }
            }
        }
        if let Some(pipe) = stdin {
            let pipe = ChildStdin::from_std(pipe).map_err(|e| child.setup_error("stdin", e))?;
            child.stdin = Some(pipe);
        }
        if let Some(pipe) = stdout {
            let pipe = ChildStdout::from_std(pipe).map_err(|e| child.setup_error("stdout", e))?;
            child.stdout = Some(pipe);
        }
        if let Some(pipe) = stderr {
            let pipe = tokio::process::ChildStderr::from_std(pipe)
                .map_err(|e| child.setup_error("stderr", e))?;
            child.drain = Some(tokio::spawn(stderr::drain(pipe, child.stderr.clone(), pid)));
        } else {
            child.stderr.mark_closed();
        }
        Ok(child)
    }

    fn setup_error(&self, what: &'static str, source: std::io::Error) -> ProcessError {
        ProcessError::Setup {
            program: self.guard.program.clone(),
            pid: self.guard.pid,
            what,
            source,
        }
    }

    fn wait_error(&self, source: std::io::Error) -> ProcessError {
        ProcessError::Wait {
            program: self.guard.program.clone(),
            pid: self.guard.pid,
            source,
        }
    }

    /// The program this child runs.
    pub fn program(&self) -> &Path {
        &self.guard.program
    }

    /// Takes the write end of the child's stdin (dropping it closes stdin).
    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.stdin.take()
    }

    /// Takes the read end of the child's stdout. It may never reach EOF if a
    /// grandchild keeps it open; use [`exited`](Self::exited) to learn of the
    /// exit, then drain with an idle timeout.
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.stdout.take()
    }

    /// Until the guard drops, this child's stderr lines are logged in the
    /// current span (an attempt's), through `redact` (see [`StderrTail::log_in`]).
    pub fn log_stderr_here(&self, redact: std::sync::Arc<dyn RedactLine>) -> LogGuard {
        self.stderr
            .log_in(self.guard.pid, tracing::Span::current(), redact)
    }

    /// Handle on the retained tail of stderr (drained continuously).
    pub fn stderr(&self) -> StderrTail {
        self.stderr.clone()
    }

    /// Whether the leader is stopped (SIGSTOP, SIGTSTP, a debugger): alive,
    /// but it reads, writes and answers nothing until a SIGCONT. False once
    /// it exited, or when its `/proc` entry cannot be read.
    pub fn is_stopped(&self) -> bool {
        !self.has_exited() && group::read_stat(self.guard.pid).is_some_and(|s| s.is_stopped())
    }

    /// The pid of the process tracing the leader (a debugger, `strace`), if
    /// one does: it holds the leader at each stop, SIGTERM and SIGCONT
    /// included, until it lets go. `None` when none does, or once it exited.
    pub fn tracer(&self) -> Option<i32> {
        if self.has_exited() {
            return None;
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.guard.pid)).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .and_then(|v| v.trim().parse::<i32>().ok())
            .filter(|&p| p != 0)
    }

    /// Whether the leader has exited (is a zombie or reaped). Never blocks, never reaps.
    pub fn has_exited(&self) -> bool {
        if self.guard.is_reaped() || self.exited.load(Ordering::Acquire) {
            return true;
        }
        match group::leader_exited(self.guard.pid) {
            Ok(true) => {
                self.exited.store(true, Ordering::Release);
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(pid = self.guard.pid, error = %e, "waitid(WNOWAIT) failed");
                false
            }
        }
    }

    /// How the leader ended, if it has and is not reaped yet (a zombie's
    /// status, read without reaping it); `None` while it runs. Never blocks.
    pub fn exit_status_if_ended(&self) -> Option<ExitStatusKind> {
        if self.guard.is_reaped() {
            return None;
        }
        group::leader_exit(self.guard.pid).ok().flatten()
    }

    fn check_exited(&self) -> Result<bool, ProcessError> {
        if self.guard.is_reaped() || self.exited.load(Ordering::Acquire) {
            return Ok(true);
        }
        let exited = group::leader_exited(self.guard.pid).map_err(|e| self.wait_error(e))?;
        if exited {
            self.exited.store(true, Ordering::Release);
        }
        Ok(exited)
    }

    /// Resolves once the leader has exited (it stays a zombie: not reaped, so
    /// the group can still be signalled safely). Independent of stdout/stderr
    /// EOF. Returns immediately if the exit is already known. Cancel-safe.
    pub async fn exited(&mut self) -> Result<(), ProcessError> {
        loop {
            if self.check_exited()? {
                return Ok(());
            }
            let spurious = match &self.watch {
                ExitWatch::PidFd(fd) => {
                    let mut ready = fd.readable().await.map_err(|e| self.wait_error(e))?;
                    if self.check_exited()? {
                        return Ok(());
                    }
                    ready.clear_ready();
                    true
                }
                ExitWatch::Poll => {
                    tokio::time::sleep(EXIT_POLL_INTERVAL).await;
                    false
                }
            };
            if spurious {
                // Readable without an exit (should not happen on current
                // kernels): do not trust the edge-triggered watch any more.
                tracing::debug!(
                    pid = self.guard.pid,
                    "spurious pidfd readiness; polling instead"
                );
                self.watch = ExitWatch::Poll;
            }
        }
    }

    /// `kill(-pgid, sig)`. A group with no processes left (ESRCH) is success.
    /// Errors with [`ProcessError::AlreadyReaped`] once the leader was reaped.
    pub fn signal_group(&self, sig: Signal) -> Result<(), ProcessError> {
        self.guard.signal(sig)
    }

    /// Graceful stop: SIGTERM to the group, wait up to `term_grace` for the
    /// leader to exit, then SIGKILL the group (always, for grandchildren) and
    /// reap. `escalated_to_kill` tells whether the leader outlived the grace.
    /// A leader stopped by a signal or a debugger acts on no SIGTERM: it is
    /// SIGKILLed at once, not woken (woken, it would run what it was sent).
    pub async fn terminate(mut self, term_grace: Duration) -> Result<ExitReport, ProcessError> {
        self.stop(term_grace, std::future::pending(), |_, _| {})
            .await
    }

    /// The one stop escalation of a child (CONTRACT §6 after the cancel
    /// frame), for [`terminate`](Self::terminate) and the worker alike: a
    /// leader that already exited is reaped (its group SIGKILLed first); a
    /// leader stopped by a signal or a debugger is SIGKILLed with its group
    /// at once, without waking it; a running one gets SIGTERM to its group,
    /// `term_grace` to exit (ended early by `cut_short`: a forced stop), then
    /// SIGKILL to the group. Always signals the group before reaping its
    /// leader, never after. `on` hears each step as it is taken, for the
    /// caller's log and metrics. Keeps the handle, as [`reap`](Self::reap).
    pub async fn stop(
        &mut self,
        term_grace: Duration,
        cut_short: impl std::future::Future<Output = ()>,
        mut on: impl FnMut(&Child, StopStep),
    ) -> Result<ExitReport, ProcessError> {
        if let Some(report) = &self.report {
            return Ok(report.clone());
        }
        let escalated = if self.has_exited() {
            false
        } else if self.is_stopped() {
            on(self, StopStep::KillStopped);
            true
        } else {
            on(self, StopStep::Term);
            self.signal_quietly(Signal::SIGTERM);
            let mut cut = false;
            let exited = tokio::select! {
                res = tokio::time::timeout(term_grace, self.exited()) => match res {
                    Ok(r) => { r?; true }
                    Err(_elapsed) => false,
                },
                _ = cut_short, if !term_grace.is_zero() => { cut = true; false }
            };
            if !exited {
                on(self, StopStep::KillAfterGrace { cut_short: cut });
            }
            !exited
        };
        self.kill_group_and_reap(escalated, &mut on).await
    }

    /// SIGKILL to the group at once, without a SIGTERM grace, and reap
    /// (keeps the handle, as [`reap`](Self::reap)); `on` hears a tracer that
    /// holds the killed leader.
    pub async fn kill_now(
        &mut self,
        mut on: impl FnMut(&Child, StopStep),
    ) -> Result<ExitReport, ProcessError> {
        if let Some(report) = &self.report {
            return Ok(report.clone());
        }
        let was_running = !self.has_exited();
        self.kill_group_and_reap(was_running, &mut on).await
    }

    /// SIGKILL the group and reap.
    pub async fn kill(mut self) -> Result<ExitReport, ProcessError> {
        self.kill_now(|_, _| {}).await
    }

    /// A signal to the group whose failure is only logged: the reap that
    /// follows finds out how the process ended whatever the signal did.
    fn signal_quietly(&self, sig: Signal) {
        if let Err(e) = self.guard.signal(sig) {
            tracing::debug!(pid = self.guard.pid, error = %e, signal = %sig, "signal to the group failed");
        }
    }

    async fn kill_group_and_reap(
        &mut self,
        escalated: bool,
        on: &mut impl FnMut(&Child, StopStep),
    ) -> Result<ExitReport, ProcessError> {
        self.signal_quietly(Signal::SIGKILL);
        // a traced process's end reaches its parent once the tracer lets it
        // go: a wait that said nothing stood silent behind a debugger
        if tokio::time::timeout(TRACED_REAP_NOTE, self.exited())
            .await
            .is_err()
        {
            if let Some(tracer) = self.tracer() {
                on(self, StopStep::HeldByTracer(tracer));
            }
        }
        self.exited().await?;
        self.reap_after_exit(escalated).await
    }

    /// Wait for the leader to exit (if it has not yet), SIGKILL what is left
    /// of the group (grandchildren), reap.
    pub async fn finish(mut self) -> Result<ExitReport, ProcessError> {
        self.reap().await
    }

    /// Like [`finish`](Self::finish) but keeps the handle: afterwards
    /// [`signal_group`](Self::signal_group) refuses, and further calls of
    /// `reap`/`finish`/`kill`/`terminate` return the same report.
    pub async fn reap(&mut self) -> Result<ExitReport, ProcessError> {
        if let Some(report) = &self.report {
            return Ok(report.clone());
        }
        self.exited().await?;
        self.reap_after_exit(false).await
    }

    /// Precondition: the leader has exited (zombie). SIGKILL the group while
    /// the zombie still pins the id (and `cgroup.kill` its cgroup, for
    /// escapees), then reap, then remove the cgroup once empty, then collect
    /// stderr.
    async fn reap_after_exit(&mut self, escalated: bool) -> Result<ExitReport, ProcessError> {
        self.guard.kill_everything()?;
        let status = self.guard.reap_exited()?;
        tracing::debug!(pid = self.guard.pid, %status, escalated, "reaped child");
        if let Some(cg) = self.guard.cgroup_to_remove() {
            cg.remove_when_empty(cgroup::EMPTY_GRACE).await;
            self.guard.cgroup_removed();
        }
        if let Some(mut drain) = self.drain.take() {
            if tokio::time::timeout(STDERR_DRAIN_GRACE, &mut drain)
                .await
                .is_err()
            {
                tracing::debug!(
                    pid = self.guard.pid,
                    "stderr still open after the group was killed (escaped process?); abandoning it"
                );
                drain.abort();
            }
        }
        let report = ExitReport {
            status,
            escalated_to_kill: escalated,
            stderr_tail: self.stderr.tail_string(),
            stderr_total_bytes: self.stderr.total_bytes(),
        };
        self.report = Some(report.clone());
        Ok(report)
    }
}
