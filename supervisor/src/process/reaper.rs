//! Child subreaper and orphan reaper.
//!
//! When an executor exits before a process it forked, that grandchild is
//! re-parented to the nearest *child subreaper* among its ancestors, or to
//! init. A worker that is PID 1 of a container *is* init; a worker elsewhere
//! becomes a subreaper ([`become_subreaper`]) so that orphans of its children
//! stay below it (visible, and ended by their group's SIGKILL, and not left to
//! an init that may not reap). Either way the worker then has children it
//! never spawned, and each of them becomes a zombie when it dies unless
//! somebody waits for it: the orphan reaper ([`start_orphan_reaper`]) does,
//! on every SIGCHLD and on a slow tick.
//!
//! # What it may reap
//!
//! Reaping the wrong child is worse than a zombie: reaping a tracked leader
//! early frees its pid, and [`super::Child`] would signal a process group id
//! that may have been reused (group.rs's invariant); reaping a child some
//! other code waits for makes that code's `waitpid` fail. The reaper reaps a
//! zombie child `c` of ours only if, **under the registry lock**:
//!
//! 1. `c` is not registered — neither `Live` nor `Reaping`. Every executor
//!    leader is registered by the spawner thread before anybody learns its
//!    pid and stays registered until its own `waitpid` has returned (the
//!    entry turns `Reaping` before that wait and is released only after it).
//!    So a tracked leader is never taken, whether or not its reap is under way.
//! 2. its process group is not ours. Anything forked in this process other
//!    than through [`super::Spawner`] (`std::process::Command`,
//!    `tokio::process`, the dev cluster's `pg_ctl`) stays in our process
//!    group, and its owner waits for it by pid: the reaper never touches it.
//!    Orphans, on the other hand, are never in our group: they descend from
//!    an executor, which leads its own group (set before exec), and a
//!    descendant can only stay in that group or make a new one. (A
//!    descendant that deliberately joins our group with `setpgid` is left a
//!    zombie until we exit; that is the price of rule 2.)
//! 3. if a spawn is in flight, `c` is not a group leader (`pgid != pid`). A
//!    spawn is "in flight" from just before the fork until the spawner thread
//!    registers the pid (both under the registry lock, see
//!    `group::SpawnTicket`). The only child of ours that can be unregistered
//!    without being an orphan is such a fresh fork — and it is either still
//!    in our group (before its `setpgid`; rule 2) or the leader of its own
//!    group (after it). So rule 3 covers it, including a fork that failed to
//!    exec and is reaped by `std` itself. A leader-orphan (a `setsid`
//!    escapee) that dies meanwhile is merely deferred to a retry shortly
//!    after.
//!
//! The check and the `waitpid(c, WNOHANG)` happen under one lock
//! acquisition, and `c` cannot change identity in between: it is our
//! un-reaped zombie, and nothing else in the process reaps unregistered
//! children outside our group. Candidates are found with a non-reaping peek
//! (`waitid(P_ALL, WEXITED | WNOHANG | WNOWAIT)`: is any child exited at
//! all?) and then listed from `/proc/self/task/*/children` (every thread's
//! children; a full `/proc` scan where that file does not exist), because
//! the peek alone keeps returning the same zombie while that one is not ours
//! to reap.
//!
//! Code in a process that runs the orphan reaper must therefore not fork
//! children *outside our process group* (`process_group(0)`, `setsid`)
//! other than through [`super::Spawner`] and then wait for them by pid: the
//! reaper may take their status first (their `wait` then fails with
//! `ECHILD`). Nothing in the supervisor does.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::group::{self, decode_status, waitpid_raw};
use super::{ExitStatusKind, ProcessError};

/// The slow tick that backs up SIGCHLD (signals coalesce; deferrals retry).
const REAP_TICK: Duration = Duration::from_secs(5);

/// Retry delay when a candidate was deferred because a spawn was in flight.
const DEFER_RETRY: Duration = Duration::from_millis(50);

/// How long the reaper thread waits for a tracing subscriber before its
/// start-up log line (the CLI installs one right after starting it).
const LOG_READY_WAIT: Duration = Duration::from_secs(2);

/// How long the start-up line then waits for [`announce_reaper`]: a
/// command that never calls it still says that its reaper runs.
const ANNOUNCE_WAIT: Duration = Duration::from_secs(30);

/// Set by [`announce_reaper`].
static ANNOUNCED: AtomicBool = AtomicBool::new(false);

/// The command's configuration is accepted: the reaper's start-up line may
/// be logged now. Before, a worker refused for its configuration logged
/// "orphan reaper running" first, as if it had started (audit 79).
pub fn announce_reaper() {
    ANNOUNCED.store(true, Ordering::Release);
}

/// Total orphans reaped by this process.
static REAPED: AtomicU64 = AtomicU64::new(0);

/// `prctl(PR_SET_CHILD_SUBREAPER, 1)`: orphaned descendants are re-parented
/// to this process instead of init. Run [`start_orphan_reaper`] too, or they
/// stay zombies.
pub fn become_subreaper() -> Result<(), ProcessError> {
    // SAFETY: plain prctl with integer arguments.
    let ret = unsafe {
        libc::prctl(
            libc::PR_SET_CHILD_SUBREAPER,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if ret != 0 {
        return Err(ProcessError::Subreaper(io::Error::last_os_error()));
    }
    Ok(())
}

/// Whether this process is a child subreaper (or PID 1, which always is).
pub fn is_subreaper() -> bool {
    if std::process::id() == 1 {
        return true;
    }
    let mut flag: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer.
    let ret = unsafe {
        libc::prctl(
            libc::PR_GET_CHILD_SUBREAPER,
            &mut flag as *mut libc::c_int as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    ret == 0 && flag != 0
}

/// How many orphans this process has reaped so far.
pub fn orphans_reaped() -> u64 {
    REAPED.load(Ordering::Relaxed)
}

/// What one [`reap_orphans`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReapPass {
    /// The orphans reaped, with how they ended.
    pub reaped: Vec<(i32, ExitStatusKind)>,
    /// Exited group leaders left for later because a spawn was in flight.
    pub deferred: usize,
}

/// Reaps every exited child that is not ours to leave alone (see the module
/// docs for the rules), now. Never blocks. The orphan reaper calls this; it
/// is public for diagnostics and tests.
pub fn reap_orphans() -> ReapPass {
    // SAFETY: getpgrp never fails.
    let our_pgid = unsafe { libc::getpgrp() };
    let mut pass = ReapPass::default();
    // Bounded: each round either reaps something or ends the loop.
    for _ in 0..64 {
        if !any_child_exited() {
            pass.deferred = 0;
            break;
        }
        let candidates = zombie_children();
        let mut progress = false;
        let mut deferred = 0;
        {
            let reg = group::registry();
            for pid in candidates {
                // Re-read under the lock; a zombie's stat stays until it is reaped.
                let Some(st) = group::read_stat(pid) else {
                    continue;
                };
                if st.state != 'Z' || reg.owns(pid) || st.pgrp == our_pgid {
                    continue;
                }
                if reg.spawns_in_flight() > 0 && st.pgrp == pid {
                    deferred += 1;
                    continue;
                }
                match waitpid_raw(pid, libc::WNOHANG) {
                    Ok(Some(status)) => {
                        progress = true;
                        REAPED.fetch_add(1, Ordering::Relaxed);
                        pass.reaped.push((pid, decode_status(status)));
                    }
                    Ok(None) => {}
                    Err(e) => tracing::debug!(pid, error = %e, "could not reap orphan"),
                }
            }
        }
        pass.deferred = deferred;
        if !progress {
            break;
        }
    }
    pass
}

/// Non-reaping peek: has any child of ours exited (and not been reaped)?
fn any_child_exited() -> bool {
    loop {
        // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer to a siginfo_t we own.
        let ret = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if ret == 0 {
            // SAFETY: waitid filled (or left zeroed) the structure.
            return unsafe { info.si_pid() } != 0;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return false; // ECHILD: no children at all
        }
    }
}

/// Our children that are zombies.
fn zombie_children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut children = Vec::new();
    let mut listed = false;
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(task.path().join("children")) {
                listed = true;
                children.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    if !listed {
        // No CONFIG_PROC_CHILDREN: scan everything.
        children = group::proc_pids()
            .into_iter()
            .filter(|&pid| group::read_stat(pid).is_some_and(|s| s.ppid == me))
            .collect();
    }
    children.sort_unstable();
    children.dedup();
    children.retain(|&pid| group::read_stat(pid).is_some_and(|s| s.state == 'Z'));
    children
}

/// Starts the orphan reaper: a dedicated thread (with its own small Tokio
/// runtime, so it does not depend on the caller's) that runs
/// [`reap_orphans`] on every SIGCHLD, every few seconds, and shortly after a
/// deferral. Idempotent: later calls return `Ok` without starting another.
/// Callable from anywhere (async or not). Call [`become_subreaper`] first to
/// receive orphans at all (PID 1 receives them anyway).
pub fn start_orphan_reaper() -> Result<(), ProcessError> {
    static STARTED: Mutex<bool> = Mutex::new(false);
    let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
    if *started {
        return Ok(());
    }
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
    std::thread::Builder::new()
        .name("orphan-reaper".into())
        .spawn(move || reaper_thread(ready_tx))
        .map_err(ProcessError::ReaperStart)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {
            *started = true;
            Ok(())
        }
        Ok(Err(e)) => Err(ProcessError::ReaperStart(e)),
        Err(_) => Err(ProcessError::ReaperStart(io::Error::other(
            "the orphan reaper thread exited during start-up",
        ))),
    }
}

fn reaper_thread(ready: std::sync::mpsc::Sender<io::Result<()>>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    rt.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigchld = match signal(SignalKind::child()) {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        tokio::spawn(async {
            // Started before the CLI sets up logging: wait for it (bounded).
            let until = tokio::time::Instant::now() + LOG_READY_WAIT;
            while !tracing::dispatcher::has_been_set() && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let until = tokio::time::Instant::now() + ANNOUNCE_WAIT;
            while !ANNOUNCED.load(Ordering::Acquire) && tokio::time::Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if is_subreaper() {
                tracing::info!("orphan reaper running: this process is a child subreaper and reaps every orphan");
            } else {
                tracing::warn!("orphan reaper running, but this process is not a child subreaper: orphans of executors go to init");
            }
        });
        let mut tick = tokio::time::interval(REAP_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let pass = reap_orphans();
            for (pid, status) in &pass.reaped {
                tracing::debug!(pid, %status, "reaped orphan");
            }
            tokio::select! {
                _ = sigchld.recv() => {}
                _ = tick.tick() => {}
                _ = tokio::time::sleep(DEFER_RETRY), if pass.deferred > 0 => {}
            }
        }
    });
}
