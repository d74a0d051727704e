//! Process-group bookkeeping: the live-group registry, signalling, exit
//! detection without reaping, reaping, and `/proc` scans.
//!
//! The invariant everything here protects: **a process group id is only ever
//! signalled while its leader is still un-reaped** (alive or a zombie). The
//! zombie pins the pid, so the id cannot have been reused by an unrelated
//! process. Reaping happens strictly after the last signal: the registry entry
//! turns from `Live` (signalled by [`kill_all_groups`]) to `Reaping` under the
//! registry lock before the reap, and is only released after `waitpid`
//! returned.
//!
//! The registry also tells the orphan reaper ([`super::reaper`]) which of our
//! children it must leave alone: every registered pid (`Live` or `Reaping`)
//! belongs to a [`GroupGuard`] that reaps it itself, and while a spawn is in
//! flight (forked, not yet registered) the reaper leaves group leaders alone.
//! See [`super::reaper`] for the argument.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::cgroup::ChildCgroup;
use super::spawner::KeepAlive;
use super::{ExitStatusKind, ProcessError};

/// State of one registered child (a process-group leader spawned by us).
#[derive(Debug)]
enum Entry {
    /// Spawned, not yet reaped: its group may be signalled.
    Live { cgroup: Option<Arc<ChildCgroup>> },
    /// Its `GroupGuard` is reaping it right now: never signal it again, and
    /// the orphan reaper must not reap it either.
    Reaping,
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    groups: BTreeMap<i32, Entry>,
    /// Spawns between fork and registration (see [`SpawnTicket`]).
    spawns_in_flight: usize,
}

impl Registry {
    /// Whether `pid` is one of our tracked children (live or being reaped).
    pub(crate) fn owns(&self, pid: i32) -> bool {
        self.groups.contains_key(&pid)
    }

    pub(crate) fn spawns_in_flight(&self) -> usize {
        self.spawns_in_flight
    }

    pub(crate) fn is_live_group(&self, pgid: i32) -> bool {
        matches!(self.groups.get(&pgid), Some(Entry::Live { .. }))
    }
}

/// Process groups (== leader pids) that are spawned and not yet reaped.
static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    groups: BTreeMap::new(),
    spawns_in_flight: 0,
});

pub(crate) fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Taken by the spawner thread before it forks; turned into a registration
/// ([`SpawnTicket::register`]) once the pid is known, under the same lock
/// acquisition that ends the "in flight" state. Dropping it unregistered
/// (the spawn failed) just ends the "in flight" state.
#[derive(Debug)]
pub(crate) struct SpawnTicket {
    done: bool,
}

pub(crate) fn begin_spawn() -> SpawnTicket {
    registry().spawns_in_flight += 1;
    SpawnTicket { done: false }
}

impl SpawnTicket {
    fn register(mut self, pid: i32, cgroup: Option<Arc<ChildCgroup>>) {
        let mut reg = registry();
        reg.groups.insert(pid, Entry::Live { cgroup });
        reg.spawns_in_flight = reg.spawns_in_flight.saturating_sub(1);
        self.done = true;
    }
}

impl Drop for SpawnTicket {
    fn drop(&mut self) {
        if !self.done {
            let mut reg = registry();
            reg.spawns_in_flight = reg.spawns_in_flight.saturating_sub(1);
        }
    }
}

/// Live → Reaping. Must be called before the leader is reaped (see module docs).
fn mark_reaping(pgid: i32) {
    if let Some(entry) = registry().groups.get_mut(&pgid) {
        *entry = Entry::Reaping;
    }
}

/// Test hook: records `pid` as a leader being reaped right now (the state a
/// dropped spawn's killed leader is in until its reaper thread reaps it).
#[cfg(test)]
pub(crate) fn mark_reaping_for_test(pid: i32) {
    registry().groups.insert(pid, Entry::Reaping);
}

/// Test hook: forgets `pid` (see [`mark_reaping_for_test`]).
#[cfg(test)]
pub(crate) fn release_for_test(pid: i32) {
    release(pid);
}

/// Forgets `pgid` entirely. Called after the leader was reaped, or when a
/// killed leader is handed over to the orphan reaper.
fn release(pgid: i32) {
    registry().groups.remove(&pgid);
}

/// Sends SIGKILL to every live (spawned, not yet reaped) process group, and,
/// where children have their own cgroup, writes `cgroup.kill` (which also ends
/// processes that left the group with `setsid`).
///
/// For worker shutdown and fatal-error paths. Holds the registry lock while
/// signalling, so no group can be reaped (and its id reused) concurrently.
/// Not async-signal-safe (it takes a mutex): call it from a normal thread or
/// task, e.g. one that listens for signals with `tokio::signal`, not from a
/// raw signal handler. Groups whose spawn is still in flight (forked but not
/// yet registered) are not covered.
pub fn kill_all_groups() {
    let reg = registry();
    let mut live = 0usize;
    for (&pgid, entry) in reg.groups.iter() {
        let Entry::Live { cgroup } = entry else {
            continue;
        };
        live += 1;
        match killpg(Pid::from_raw(pgid), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => tracing::warn!(pgid, error = %e, "kill_all_groups: SIGKILL failed"),
        }
        if let Some(cg) = cgroup {
            cg.kill_logged();
        }
    }
    if live > 0 {
        tracing::info!(
            groups = live,
            "sent SIGKILL to all live child process groups"
        );
    }
}

/// Process groups currently registered as live (spawned and not yet reaped).
pub fn live_groups() -> Vec<i32> {
    registry()
        .groups
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Live { .. }))
        .map(|(&pid, _)| pid)
        .collect()
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
    // A process may vanish between readdir and read: it is just skipped.
    let procs: Vec<(i32, StatFields)> = proc_pids()
        .into_iter()
        .filter_map(|pid| Some((pid, read_stat(pid)?)))
        .filter(|(_, s)| s.pgrp == pgid)
        .collect();
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
    pub(crate) session: i32,
    /// Start time in clock ticks after boot: with the pid, identifies a
    /// process across pid reuse.
    pub(crate) starttime: u64,
}

impl StatFields {
    pub(crate) fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }

    /// Stopped by a signal (`T`: SIGSTOP, SIGTSTP, SIGTTIN/OU) or by a
    /// tracer at a stop (`t`): it runs no code until a SIGCONT.
    pub(crate) fn is_stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// Parses `pid (comm) state ppid pgrp session ... starttime ...`; `comm` may
/// contain spaces and parentheses.
pub(crate) fn parse_stat(stat: &str) -> Option<StatFields> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 of proc(5) (state); starttime is field 22.
    let state = fields.first()?.chars().next()?;
    let ppid = fields.get(1)?.parse().ok()?;
    let pgrp = fields.get(2)?.parse().ok()?;
    let session = fields.get(3)?.parse().ok()?;
    let starttime = fields.get(19)?.parse().ok()?;
    Some(StatFields {
        state,
        ppid,
        pgrp,
        session,
        starttime,
    })
}

/// `/proc/<pid>/stat`, parsed; `None` if the process is gone or unreadable.
pub(crate) fn read_stat(pid: i32) -> Option<StatFields> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| parse_stat(&s))
}

/// Pids listed under `/proc`, in no particular order.
pub(crate) fn proc_pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .collect()
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
    Ok(leader_exit(pid)?.is_some())
}

/// How the leader `pid` ended, if it has (it stays a zombie: `WNOWAIT`
/// neither reaps it nor blocks), from the `siginfo_t` `waitid` fills.
pub(crate) fn leader_exit(pid: i32) -> io::Result<Option<ExitStatusKind>> {
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
            if unsafe { info.si_pid() } == 0 {
                return Ok(None);
            }
            // SAFETY: as above; si_status is the exit code or the signal
            let status = unsafe { info.si_status() };
            return Ok(Some(match info.si_code {
                libc::CLD_EXITED => ExitStatusKind::Exited(status),
                _ => ExitStatusKind::Signaled(signal_name(status)),
            }));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// `waitpid(pid, 0)`, retrying on EINTR. Blocks until `pid` exits.
pub(crate) fn waitpid_raw(pid: i32, flags: libc::c_int) -> io::Result<Option<libc::c_int>> {
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
/// (and its cgroup, if it has one) and reaps the leader on a detached thread.
#[derive(Debug)]
pub(crate) struct GroupGuard {
    pub(crate) pid: i32,
    pub(crate) program: PathBuf,
    reaped: bool,
    /// The child's own cgroup (cgroup v2 mode only), removed once empty.
    cgroup: Option<Arc<ChildCgroup>>,
    /// Keeps the spawner thread (the children's PDEATHSIG parent) alive until reaped.
    keepalive: Option<KeepAlive>,
}

impl GroupGuard {
    /// To be created right after a successful spawn: registers the group,
    /// ending the "in flight" state of `ticket` under the same lock.
    pub(crate) fn new(
        pid: i32,
        program: PathBuf,
        keepalive: KeepAlive,
        cgroup: Option<Arc<ChildCgroup>>,
        ticket: SpawnTicket,
    ) -> Self {
        ticket.register(pid, cgroup.clone());
        Self {
            pid,
            program,
            reaped: false,
            cgroup,
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

    /// The final kill: SIGKILL to the group, then `cgroup.kill` for whatever
    /// left the group but not the cgroup (`setsid` escapees). Refused once
    /// reaped, like [`signal`](Self::signal).
    pub(crate) fn kill_everything(&self) -> Result<(), ProcessError> {
        self.signal(Signal::SIGKILL)?;
        if let Some(cg) = &self.cgroup {
            cg.kill_logged();
        }
        Ok(())
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
        mark_reaping(self.pid);
        // Whatever happens below, never signal this id again.
        self.reaped = true;
        self.keepalive = None;
        let result = waitpid_raw(self.pid, 0);
        release(self.pid);
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

    /// After the reap: the child's cgroup, to be removed once empty. The
    /// guard keeps it until [`cgroup_removed`](Self::cgroup_removed), so a
    /// caller dropped while waiting for it to empty still gets it removed
    /// (by `Drop`).
    pub(crate) fn cgroup_to_remove(&self) -> Option<Arc<ChildCgroup>> {
        if self.reaped {
            self.cgroup.clone()
        } else {
            None
        }
    }

    /// The removal of the cgroup was attempted (successfully or not: a
    /// cgroup left over is logged and left to a later garbage collection).
    pub(crate) fn cgroup_removed(&mut self) {
        self.cgroup = None;
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if self.reaped {
            if let Some(cg) = self.cgroup.take() {
                // Reaped, but the caller's removal never finished (its future
                // was dropped): remove it now, or once empty on a thread.
                if !matches!(cg.try_remove(), Ok(true)) {
                    let spawned = std::thread::Builder::new()
                        .name("cgroup-rmdir".into())
                        .spawn(move || {
                            cg.remove_blocking_logged(super::cgroup::EMPTY_GRACE);
                        });
                    if let Err(e) = spawned {
                        tracing::debug!(error = %e, "cgroup left for a later garbage collection");
                    }
                }
            }
            return;
        }
        self.reaped = true;
        let pid = self.pid;
        // The leader is un-reaped, so the pgid is still ours.
        match killpg(Pid::from_raw(pid), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => tracing::warn!(pid, error = %e, "drop: SIGKILL to child group failed"),
        }
        let cgroup = self.cgroup.take();
        if let Some(cg) = &cgroup {
            cg.kill_logged();
        }
        let keepalive = self.keepalive.take();
        let reaper = move || {
            mark_reaping(pid);
            match waitpid_raw(pid, 0) {
                Ok(Some(status)) => {
                    tracing::debug!(pid, status = %decode_status(status), "reaped dropped child")
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(pid, error = %e, "failed to reap dropped child"),
            }
            release(pid);
            if let Some(cg) = cgroup {
                cg.remove_blocking_logged(super::cgroup::EMPTY_GRACE);
            }
            drop(keepalive);
        };
        let spawned = std::thread::Builder::new()
            .name(format!("reap-{pid}"))
            .spawn(reaper);
        if let Err(e) = spawned {
            // No thread available: reap now if it is already dead; else hand
            // the killed leader over to the orphan reaper (if it runs) rather
            // than block in Drop. Its cgroup is then left for a later sweep.
            mark_reaping(pid);
            let reaped = matches!(waitpid_raw(pid, libc::WNOHANG), Ok(Some(_)));
            release(pid);
            if !reaped {
                tracing::warn!(pid, error = %e, "could not start a reaper thread; the killed child is left to the orphan reaper");
            }
        }
    }
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let s =
            "1234 (we) ird (name) S 1 777 777 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123456 1000 10";
        assert_eq!(
            parse_stat(s),
            Some(StatFields {
                state: 'S',
                ppid: 1,
                pgrp: 777,
                session: 777,
                starttime: 123456
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
