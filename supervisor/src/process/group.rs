//! Process-group bookkeeping: the live-group registry, signalling, exit
//! detection without reaping, reaping, and `/proc` scans.
//!
//! The invariant everything here protects: **a process group id is only ever
//! signalled while its leader is still un-reaped** (alive or a zombie). The
//! zombie pins the pid, so the id cannot have been reused by an unrelated
//! process. Reaping happens strictly after the last signal, and the registry
//! entry is removed (under the registry lock) before the reap.

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::spawner::KeepAlive;
use super::{ExitStatusKind, ProcessError};

/// Process groups (== leader pids) that are spawned and not yet reaped.
static LIVE_GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn registry() -> MutexGuard<'static, BTreeSet<i32>> {
    LIVE_GROUPS.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn register(pgid: i32) {
    registry().insert(pgid);
}

/// Must be called before the leader is reaped (see module docs).
pub(crate) fn unregister(pgid: i32) {
    registry().remove(&pgid);
}

/// Sends SIGKILL to every live (spawned, not yet reaped) process group.
///
/// For worker shutdown and fatal-error paths. Holds the registry lock while
/// signalling, so no group can be reaped (and its id reused) concurrently.
/// Not async-signal-safe (it takes a mutex): call it from a normal thread or
/// task, e.g. one that listens for signals with `tokio::signal`, not from a
/// raw signal handler. Groups whose spawn is still in flight (forked but not
/// yet registered) are not covered.
pub fn kill_all_groups() {
    let live = registry();
    for &pgid in live.iter() {
        match killpg(Pid::from_raw(pgid), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => tracing::warn!(pgid, error = %e, "kill_all_groups: SIGKILL failed"),
        }
    }
    if !live.is_empty() {
        tracing::info!(
            groups = live.len(),
            "sent SIGKILL to all live child process groups"
        );
    }
}

/// Process groups currently registered as live (spawned and not yet reaped).
pub fn live_groups() -> Vec<i32> {
    registry().iter().copied().collect()
}

/// Pids of processes whose process group is `pgid`, from a scan of `/proc/*/stat`.
///
/// Running (and stopped, sleeping, ...) members are always listed. Zombies are
/// listed only while someone is still expected to reap them: when their parent
/// is this process (our un-reaped leader) or another member of the group.
/// Orphaned zombies — already dead, re-parented to an init that may never reap
/// them (as in some containers) — are not listed. Returns an empty list if
/// `/proc` cannot be read. Sorted ascending.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut procs = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // The process may vanish between readdir and read: just skip it.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(s) = parse_stat(&stat) {
            if s.pgrp == pgid {
                procs.push((pid, s));
            }
        }
    }
    let members: HashSet<i32> = procs.iter().map(|(pid, _)| *pid).collect();
    let mut out: Vec<i32> = procs
        .into_iter()
        .filter(|(_, s)| !s.is_dead() || s.ppid == me || members.contains(&s.ppid))
        .map(|(pid, _)| pid)
        .collect();
    out.sort_unstable();
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StatFields {
    pub(crate) state: char,
    pub(crate) ppid: i32,
    pub(crate) pgrp: i32,
}

impl StatFields {
    fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses `pid (comm) state ppid pgrp ...`; `comm` may contain spaces and parentheses.
pub(crate) fn parse_stat(stat: &str) -> Option<StatFields> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut it = rest.split_whitespace();
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    let pgrp = it.next()?.parse().ok()?;
    Some(StatFields { state, ppid, pgrp })
}

/// Opens a pidfd for `pid` (CLOEXEC is implied by the kernel).
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0 as libc::c_uint) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(ret)
        .map_err(|_| io::Error::other(format!("pidfd_open returned out-of-range fd {ret}")))?;
    // SAFETY: the kernel just handed us this fd and nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether child `pid` has exited (is a zombie), WITHOUT reaping it (`WNOWAIT`).
pub(crate) fn leader_exited(pid: i32) -> io::Result<bool> {
    loop {
        // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer to a siginfo_t we own.
        let ret = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if ret == 0 {
            // With WNOHANG, si_pid stays 0 when the child has not exited.
            // SAFETY: waitid filled (or left zeroed) the structure.
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// `waitpid(pid, 0)`, retrying on EINTR. Blocks until `pid` exits.
fn waitpid_raw(pid: i32, flags: libc::c_int) -> io::Result<Option<libc::c_int>> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: valid pointer to a c_int we own.
        let ret = unsafe { libc::waitpid(pid, &mut status, flags) };
        if ret == pid {
            return Ok(Some(status));
        }
        if ret == 0 {
            return Ok(None);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

pub(crate) fn decode_status(status: libc::c_int) -> ExitStatusKind {
    if libc::WIFEXITED(status) {
        ExitStatusKind::Exited(libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        ExitStatusKind::Signaled(signal_name(libc::WTERMSIG(status)))
    } else {
        ExitStatusKind::Signaled(format!("unknown wait status {status:#x}"))
    }
}

pub(crate) fn signal_name(signo: libc::c_int) -> String {
    match Signal::try_from(signo) {
        Ok(sig) => sig.as_str().to_string(),
        Err(_) => format!("SIG{signo}"),
    }
}

/// Owns the "is this group still un-reaped" state of one child. Its `Drop`
/// guarantees that a child never outlives its handle: it SIGKILLs the group
/// and reaps the leader on a detached thread.
#[derive(Debug)]
pub(crate) struct GroupGuard {
    pub(crate) pid: i32,
    pub(crate) program: PathBuf,
    reaped: bool,
    /// Keeps the spawner thread (the children's PDEATHSIG parent) alive until reaped.
    keepalive: Option<KeepAlive>,
}

impl GroupGuard {
    /// To be created right after a successful spawn (registers the group).
    pub(crate) fn new(pid: i32, program: PathBuf, keepalive: KeepAlive) -> Self {
        register(pid);
        Self {
            pid,
            program,
            reaped: false,
            keepalive: Some(keepalive),
        }
    }

    pub(crate) fn is_reaped(&self) -> bool {
        self.reaped
    }

    /// `kill(-pgid, sig)`; ESRCH (nobody left) is success; refused once reaped.
    pub(crate) fn signal(&self, sig: Signal) -> Result<(), ProcessError> {
        if self.reaped {
            return Err(ProcessError::AlreadyReaped {
                program: self.program.clone(),
                pid: self.pid,
            });
        }
        match killpg(Pid::from_raw(self.pid), sig) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(source) => Err(ProcessError::Signal {
                program: self.program.clone(),
                pid: self.pid,
                signal: sig,
                source,
            }),
        }
    }

    /// Reaps the leader. Call only once the leader is known to have exited
    /// (then this does not block) and after the last signal to the group.
    pub(crate) fn reap_exited(&mut self) -> Result<ExitStatusKind, ProcessError> {
        if self.reaped {
            return Err(ProcessError::AlreadyReaped {
                program: self.program.clone(),
                pid: self.pid,
            });
        }
        unregister(self.pid);
        // Whatever happens below, never signal this id again.
        self.reaped = true;
        self.keepalive = None;
        let result = waitpid_raw(self.pid, 0);
        match result {
            Ok(Some(status)) => Ok(decode_status(status)),
            Ok(None) => Err(ProcessError::Wait {
                program: self.program.clone(),
                pid: self.pid,
                source: io::Error::other("waitpid returned no status"),
            }),
            Err(source) => Err(ProcessError::Wait {
                program: self.program.clone(),
                pid: self.pid,
                source,
            }),
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        self.reaped = true;
        let pid = self.pid;
        // The leader is un-reaped, so the pgid is still ours.
        match killpg(Pid::from_raw(pid), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => tracing::warn!(pid, error = %e, "drop: SIGKILL to child group failed"),
        }
        let keepalive = self.keepalive.take();
        let reaper = move || {
            unregister(pid);
            match waitpid_raw(pid, 0) {
                Ok(Some(status)) => {
                    tracing::debug!(pid, status = %decode_status(status), "reaped dropped child")
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(pid, error = %e, "failed to reap dropped child"),
            }
            drop(keepalive);
        };
        let spawned = std::thread::Builder::new()
            .name(format!("reap-{pid}"))
            .spawn(reaper);
        if let Err(e) = spawned {
            // No thread available: reap now if it is already dead, else leave
            // a (killed, unregistered) zombie rather than block in Drop.
            unregister(pid);
            if !matches!(waitpid_raw(pid, libc::WNOHANG), Ok(Some(_))) {
                tracing::warn!(pid, error = %e, "could not start a reaper thread; child left unreaped");
            }
        }
    }
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let s = "1234 (we) ird (name) S 1 777 777 0 -1 4194560 0 0";
        assert_eq!(
            parse_stat(s),
            Some(StatFields {
                state: 'S',
                ppid: 1,
                pgrp: 777
            })
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) Z"), None);
    }

    #[test]
    fn own_group_is_listed() {
        // SAFETY: getpgrp never fails.
        let pgrp = unsafe { libc::getpgrp() };
        assert!(group_members(pgrp).contains(&(std::process::id() as i32)));
    }

    #[test]
    fn decodes_statuses() {
        assert_eq!(decode_status(3 << 8), ExitStatusKind::Exited(3));
        assert_eq!(
            decode_status(libc::SIGKILL),
            ExitStatusKind::Signaled("SIGKILL".into())
        );
        assert_eq!(signal_name(40), "SIG40");
    }
}
