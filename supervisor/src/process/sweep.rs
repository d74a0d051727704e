//! The start-up sweep: end what a previous incarnation of this worker left.
//!
//! A worker killed with SIGKILL cannot clean up. Its executors die with it
//! (PDEATHSIG), but what they forked survives: re-parented to init (or a
//! subreaper above us), still in the dead executor's process group, or in a
//! session of its own. Nobody ends it. The next incarnation — same slot (the
//! worker's name), new instance — does, at start:
//! [`sweep_previous_incarnations`] finds processes by the marker in their
//! environment ([`super::marker`]) as `/proc` shows it *now*, never by a pid
//! stored somewhere, and SIGKILLs them and their process groups; in cgroup
//! mode it also writes `cgroup.kill` of the previous incarnation's cgroups
//! (which catches descendants that cleared their environment) and removes
//! them.
//!
//! A process started while a pass scans `/proc` may be missed by it (a
//! sweep from one snapshot misses processes forked during it — actions/runner
//! #4601), so the sweep repeats until a pass finds nothing new, at most
//! [`MAX_SWEEP_PASSES`] times.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::cgroup::{self, ChildCgroup};
use super::group::{self, StatFields};
use super::marker::{self, FoundMarker, Liveness};

/// Upper bound on sweep passes.
pub const MAX_SWEEP_PASSES: u32 = 10;

/// Pause between passes: killed processes exit, racing forks show up.
const PASS_PAUSE: Duration = Duration::from_millis(20);

/// Total time the sweep waits for killed cgroups to empty before removing them.
const CGROUP_REMOVE_BUDGET: Duration = Duration::from_secs(2);

/// What a sweep did, for one log line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Passes over `/proc` (the last one found nothing new when `converged`).
    pub passes: u32,
    /// Marked processes of a previous incarnation sent SIGKILL.
    pub processes_killed: usize,
    /// Distinct process groups sent SIGKILL.
    pub groups_killed: usize,
    /// Cgroups of a previous incarnation whose `cgroup.kill` was written.
    pub cgroups_killed: usize,
    /// Cgroups removed: those killed, and empty leftovers of dead
    /// supervisors of any slot.
    pub cgroups_removed: usize,
    /// Marked processes of this slot left alone because their supervisor is
    /// still alive (another live worker with the same name) or lives in
    /// another pid namespace.
    pub spared_live: usize,
    /// Whether the last pass found nothing new (false: gave up after
    /// [`MAX_SWEEP_PASSES`]).
    pub converged: bool,
}

impl std::fmt::Display for SweepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} processes and {} process groups of previous incarnations killed, {} cgroups killed, {} removed, {} spared (live supervisor), {} passes{}",
            self.processes_killed,
            self.groups_killed,
            self.cgroups_killed,
            self.cgroups_removed,
            self.spared_live,
            self.passes,
            if self.converged { "" } else { " (did not converge)" }
        )
    }
}

/// Ends every process that carries the marker of `slot` with an instance
/// other than `my_instance` (and other than any instance a spawner of this
/// process uses), whose supervisor process is gone: SIGKILL to its process
/// group (if that group is not ours and its leader is gone or carries the
/// same kind of stale marker) and to the process itself. Repeats until a
/// pass finds nothing new. Blocking (reads `/proc`, sleeps briefly between
/// passes): from async code run it with `spawn_blocking`.
///
/// Never kills: this process, our own process group, a group registered as
/// one of our live children, a process whose marker is ours, a process whose
/// supervisor is alive (pid + start time) or unverifiable (another pid
/// namespace). Processes that are not readable (another user's) are not seen.
pub fn sweep_previous_incarnations(slot: &str, my_instance: &str) -> SweepReport {
    let mut sweep = Sweep::new(slot, my_instance);
    for pass in 1..=MAX_SWEEP_PASSES {
        sweep.report.passes = pass;
        let new = sweep.kill_stale_processes() + sweep.kill_stale_cgroups();
        if new == 0 {
            sweep.report.converged = true;
            break;
        }
        std::thread::sleep(PASS_PAUSE);
    }
    sweep.finish()
}

/// One sweep's state across its passes.
struct Sweep<'a> {
    slot: &'a str,
    my_instance: &'a str,
    my_pid: i32,
    my_pgid: i32,
    tag: String,
    hierarchy: Option<cgroup::Hierarchy>,
    report: SweepReport,
    /// (pid, start time) signalled in a pass, maybe still dying.
    killed: HashSet<(i32, u64)>,
    /// (pid, start time) left alone: their supervisor is alive or unknown.
    spared: HashSet<(i32, u64)>,
    /// Process groups a kill went to.
    groups: BTreeSet<i32>,
    /// Stale cgroup directory -> whether its cgroup.kill was written.
    stale_cgroups: BTreeMap<PathBuf, bool>,
}

impl<'a> Sweep<'a> {
    fn new(slot: &'a str, my_instance: &'a str) -> Sweep<'a> {
        Sweep {
            slot,
            my_instance,
            my_pid: std::process::id() as i32,
            // SAFETY: getpgrp never fails.
            my_pgid: unsafe { libc::getpgrp() },
            tag: marker::slot_tag(slot),
            hierarchy: cgroup::hierarchy(),
            report: SweepReport::default(),
            killed: HashSet::new(),
            spared: HashSet::new(),
            groups: BTreeSet::new(),
            stale_cgroups: BTreeMap::new(),
        }
    }

    /// A process of this slot whose supervisor is gone.
    fn is_stale(&self, m: &FoundMarker) -> bool {
        m.slot == self.slot
            && m.instance != self.my_instance
            && !marker::is_our_instance(&m.instance)
            && m.supervisor.is_none_or(|s| s.liveness() == Liveness::Dead)
    }

    /// One pass over `/proc`: each stale process not signalled before is
    /// killed (with its group, where that is safe). How many were new.
    fn kill_stale_processes(&mut self) -> usize {
        let mut new = 0usize;
        for pid in group::proc_pids() {
            if pid == self.my_pid {
                continue;
            }
            let Some(m) = marker::read_marker(pid) else {
                continue;
            };
            if m.slot != self.slot
                || m.instance == self.my_instance
                || marker::is_our_instance(&m.instance)
            {
                continue;
            }
            let Some(st) = group::read_stat(pid) else {
                continue;
            };
            if st.is_dead() {
                continue;
            }
            let key = (pid, st.starttime);
            if self.killed.contains(&key) {
                continue; // signalled in an earlier pass, still dying
            }
            if !self.is_stale(&m) {
                if self.spared.insert(key) {
                    tracing::debug!(pid, instance = %m.instance, supervisor = ?m.supervisor,
                        "spared: its supervisor is alive or in another pid namespace");
                }
                continue;
            }
            new += 1;
            self.killed.insert(key);
            if let Some(h) = &self.hierarchy {
                if let Some(dir) = cgroup::stale_cgroup_of(h, pid, &self.tag) {
                    self.stale_cgroups.entry(dir).or_insert(false);
                }
            }
            let is_stale = |m: &FoundMarker| self.is_stale(m);
            if let Some(group_killed) = kill_verified(pid, &m, &is_stale, self.my_pid, self.my_pgid)
            {
                self.report.processes_killed += 1;
                if let Some(pgid) = group_killed {
                    self.groups.insert(pgid);
                }
                tracing::debug!(pid, pgid = st.pgrp, instance = %m.instance, "killed a process of a previous incarnation");
            }
        }
        new
    }

    /// Every stale cgroup of this slot found so far gets its cgroup.kill
    /// written, once. How many were new.
    fn kill_stale_cgroups(&mut self) -> usize {
        if let Some(h) = &self.hierarchy {
            for dir in cgroup::stale_children(h, &self.tag) {
                self.stale_cgroups.entry(dir).or_insert(false);
            }
        }
        let mut new = 0usize;
        for (dir, done) in self.stale_cgroups.iter_mut() {
            if *done {
                continue;
            }
            *done = true;
            new += 1;
            match ChildCgroup::existing(dir.clone()).kill() {
                Ok(()) => self.report.cgroups_killed += 1,
                Err(e) => {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot write cgroup.kill of a previous incarnation")
                }
            }
        }
        new
    }

    /// The stale cgroups removed (within a budget), and the report.
    fn finish(mut self) -> SweepReport {
        let deadline = Instant::now() + CGROUP_REMOVE_BUDGET;
        for dir in self.stale_cgroups.keys() {
            let left = deadline.saturating_duration_since(Instant::now());
            if ChildCgroup::existing(dir.clone()).remove_blocking_logged(left) {
                self.report.cgroups_removed += 1;
            }
        }
        if let Some(h) = &self.hierarchy {
            self.report.cgroups_removed += cgroup::collect_garbage(h);
        }
        self.report.groups_killed = self.groups.len();
        self.report.spared_live = self.spared.len();
        if self.report.spared_live > 0 {
            tracing::warn!(
                slot = self.slot,
                processes = self.report.spared_live,
                "processes of this worker's slot belong to a supervisor that is still alive (or in another pid namespace) and were left alone: is another worker on this host configured with the same name?"
            );
        }
        self.report
    }
}

/// Pins `pid` (pidfd), re-verifies its marker and stat through `/proc` while
/// it is pinned, then SIGKILLs its group (when [`group_is_stale`]) and the
/// process. `None` if it vanished or changed before it could be verified.
/// `Some(Some(pgid))` when the group was signalled too.
fn kill_verified(
    pid: i32,
    seen: &FoundMarker,
    is_stale: &dyn Fn(&FoundMarker) -> bool,
    my_pid: i32,
    my_pgid: i32,
) -> Option<Option<i32>> {
    let pidfd = group::pidfd_open(pid).ok();
    // With a pidfd, the reads below are of the pinned process if it is still
    // alive after them. Without one (kernel < 5.3) the reads are as fresh as
    // they can be and the kill follows immediately.
    let m = marker::read_marker(pid)?;
    let st = group::read_stat(pid)?;
    if &m != seen || st.is_dead() {
        return None;
    }
    if let Some(fd) = &pidfd {
        if !pidfd_alive(fd) {
            return None;
        }
    }
    let mut group_killed = None;
    if group_is_stale(&st, is_stale, my_pid, my_pgid) {
        match killpg(Pid::from_raw(st.pgrp), Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => group_killed = Some(st.pgrp),
            Err(e) => {
                tracing::warn!(pgid = st.pgrp, error = %e, "cannot SIGKILL a stale process group")
            }
        }
    }
    let sent = match &pidfd {
        Some(fd) => pidfd_kill(fd),
        None => nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL)
            .map_err(std::io::Error::from),
    };
    match sent {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
        Err(e) => tracing::warn!(pid, error = %e, "cannot SIGKILL a stale process"),
    }
    Some(group_killed)
}

/// Whether the process group of a stale process may be killed as a whole:
/// not ours, not one of our live children's, and its leader is gone (the
/// dead executor's group) or itself carries a stale marker of the slot.
fn group_is_stale(
    st: &StatFields,
    is_stale: &dyn Fn(&FoundMarker) -> bool,
    my_pid: i32,
    my_pgid: i32,
) -> bool {
    let pgid = st.pgrp;
    if pgid <= 1 || pgid == my_pgid || pgid == my_pid {
        return false;
    }
    if group::registry().is_live_group(pgid) {
        return false;
    }
    match group::read_stat(pgid) {
        None => true,
        Some(leader) if leader.is_dead() => true,
        // The pid is alive but no longer leads that group: judge by member only.
        Some(leader) if leader.pgrp != pgid => false,
        Some(_) => marker::read_marker(pgid).is_some_and(|m| is_stale(&m)),
    }
}

/// Whether the process behind a pidfd is still running (not readable yet).
fn pidfd_alive(fd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let ret = unsafe { libc::poll(&mut pfd, 1, 0) };
    ret == 0
}

fn pidfd_kill(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: plain syscall on a pidfd we own; null siginfo is allowed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0 as libc::c_uint,
        )
    };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `pid` is a child of `me` that no spawn of this process accounts
/// for: alive (not a zombie) and neither a registered group leader nor one
/// this process is reaping right now. A cancelled spawn's leader is
/// SIGKILLed and handed to a reaper thread (`Reaping`) before it is a
/// zombie; in that window it is still ours, not an orphan that left its
/// group (redeploy audit: a stop during the executors' start-up probes
/// reported such a child as an escaped process).
pub(crate) fn is_unaccounted_child(pid: i32, me: i32) -> bool {
    if group::registry().owns(pid) {
        return false;
    }
    group::read_stat(pid).is_some_and(|s| s.ppid == me && !s.is_dead())
}

/// Kills this process's children that no spawn registered: orphans the
/// subreaper adopted after they left their attempt's process group and
/// cgroup (`setsid`, then a write to another cgroup's `cgroup.procs`, which
/// a root executor may do). The group and cgroup kills cannot reach them, so
/// the worker's exit does (CONTRACT §6: a child never outlives its worker).
/// Each is signalled through a pidfd opened while it is still our child
/// (checked after the open), so a reused pid is never signalled. A killed
/// process's own children are adopted in turn: a few passes take them too.
/// Returns how many were killed. Call it when no executor is running.
pub fn kill_adopted_orphans() -> usize {
    let me = std::process::id() as i32;
    let mut killed = 0;
    for _pass in 0..MAX_SWEEP_PASSES {
        let mut this_pass = 0;
        for pid in group::proc_pids() {
            if !is_unaccounted_child(pid, me) {
                continue;
            }
            let Ok(fd) = group::pidfd_open(pid) else {
                continue;
            };
            // still our un-reaped, unaccounted child once the pidfd is held:
            // it is that process
            if !is_unaccounted_child(pid, me) {
                continue;
            }
            if pidfd_kill(&fd).is_ok() {
                this_pass += 1;
            }
        }
        if this_pass == 0 {
            break;
        }
        killed += this_pass;
        // let the kills land (and the reaper reap) before looking again
        std::thread::sleep(Duration::from_millis(50));
    }
    if killed > 0 {
        tracing::warn!(
            killed,
            "killed processes that had left their attempt's process group and cgroup (adopted by this worker)"
        );
    }
    killed
}
