//! The dedicated spawner thread.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not
//! the process. Tokio's blocking pool (and any short-lived thread) would
//! therefore kill children at random. All forks happen on one long-lived
//! `std::thread`; requests arrive over a channel and are answered on a
//! oneshot. The thread lives as long as any [`Spawner`] handle or any
//! un-reaped child spawned by it (each child holds a [`KeepAlive`]).

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;

use tokio::sync::oneshot;

use super::group::{self, GroupGuard};
use super::{Child, ProcessError, SpawnSpec};

pub(crate) enum Msg {
    Spawn {
        spec: Box<SpawnSpec>,
        reply: oneshot::Sender<Result<RawChild, ProcessError>>,
        keepalive: KeepAlive,
    },
    /// Test hook: make the thread return so PDEATHSIG can be observed.
    #[cfg(test)]
    Exit,
}

/// A clone of the request sender, held by every un-reaped child: the spawner
/// thread only exits once all of these (and all [`Spawner`]s) are gone.
#[derive(Clone)]
pub(crate) struct KeepAlive(#[allow(dead_code)] mpsc::Sender<Msg>);

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepAlive")
    }
}

/// What the spawner thread hands back; turned into a [`Child`] on the caller's
/// runtime. Dropping it (e.g. the caller's `spawn` future was cancelled) kills
/// and reaps the child through [`GroupGuard`].
pub(crate) struct RawChild {
    pub(crate) guard: GroupGuard,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) stdout: Option<ChildStdout>,
    pub(crate) stderr: Option<ChildStderr>,
    pub(crate) pidfd: Option<std::os::fd::OwnedFd>,
    pub(crate) stderr_tail_bytes: usize,
}

/// Handle on the dedicated spawner thread. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Spawner {
    tx: mpsc::Sender<Msg>,
}

impl std::fmt::Debug for Spawner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spawner").finish_non_exhaustive()
    }
}

impl Spawner {
    /// Starts the dedicated spawner thread.
    ///
    /// Usually called once per process; every call starts its own thread.
    pub fn start() -> Result<Spawner, ProcessError> {
        let (tx, rx) = mpsc::channel::<Msg>();
        std::thread::Builder::new()
            .name("process-spawner".into())
            .spawn(move || run(rx))
            .map_err(ProcessError::SpawnerStart)?;
        Ok(Spawner { tx })
    }

    /// Spawns `spec` as the leader of a new process group, with piped
    /// stdin/stdout/stderr, a cleared environment and `PR_SET_PDEATHSIG=SIGKILL`.
    ///
    /// Must be called from within a Tokio runtime with IO and time enabled
    /// (the pipes and the exit watcher are registered with it, and stderr is
    /// drained on a task spawned onto it). Cancel-safe: if this future is
    /// dropped before it completes, a child that was already forked is killed
    /// and reaped.
    pub async fn spawn(&self, spec: SpawnSpec) -> Result<Child, ProcessError> {
        let program = spec.program.clone();
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Spawn {
                spec: Box::new(spec),
                reply,
                keepalive: KeepAlive(self.tx.clone()),
            })
            .map_err(|_| ProcessError::SpawnerGone {
                program: program.clone(),
            })?;
        let raw = rx
            .await
            .map_err(|_| ProcessError::SpawnerGone { program })??;
        Child::from_raw(raw)
    }

    /// Test hook: asks the thread to exit even though handles are alive.
    #[cfg(test)]
    pub(crate) fn exit_thread_for_test(&self) {
        let _ = self.tx.send(Msg::Exit);
    }
}

/// Test hook: pids of children whose `spawn` future was dropped before the reply.
#[cfg(test)]
pub(crate) fn orphaned_for_test() -> &'static std::sync::Mutex<Vec<i32>> {
    static ORPHANED: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());
    &ORPHANED
}

fn run(rx: mpsc::Receiver<Msg>) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Spawn {
                spec,
                reply,
                keepalive,
            } => {
                let result = spawn_on_this_thread(*spec, keepalive);
                // On failure the receiver is gone (the spawn future was
                // dropped); dropping the returned RawChild kills and reaps the
                // orphaned child.
                if let Err(Ok(orphan)) = reply.send(result) {
                    tracing::debug!(
                        pid = orphan.guard.pid,
                        "spawn was cancelled; killing the new child"
                    );
                    #[cfg(test)]
                    orphaned_for_test()
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(orphan.guard.pid);
                }
            }
            #[cfg(test)]
            Msg::Exit => return,
        }
    }
    tracing::debug!("process spawner thread exiting: no handles and no live children left");
}

fn spawn_on_this_thread(spec: SpawnSpec, keepalive: KeepAlive) -> Result<RawChild, ProcessError> {
    let SpawnSpec {
        program,
        args,
        cwd,
        env,
        env_allowlist,
        stderr_tail_bytes,
    } = spec;

    let mut cmd = Command::new(&program);
    cmd.args(&args)
        .current_dir(&cwd)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for name in &env_allowlist {
        if let Some(value) = std::env::var_os(name) {
            cmd.env(name, value);
        }
    }
    for (name, value) in &env {
        cmd.env(name, value);
    }

    // Captured before fork: the child compares its parent against it.
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (setpgid, prctl, getppid, _exit) and
    // builds an io::Error from errno (no allocation).
    unsafe {
        cmd.pre_exec(move || {
            // Leader of its own group, so the whole tree can be signalled.
            if libc::setpgid(0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Die with the spawner thread (and so with the process).
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent died before PDEATHSIG was armed: nobody will kill us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }

    // std waits for exec to succeed (or pre_exec/exec to fail) before
    // returning, so setpgid has happened by the time we see the pid.
    let mut child = cmd.spawn().map_err(|source| ProcessError::Spawn {
        program: program.clone(),
        cwd: cwd.clone(),
        source,
    })?;
    let pid = child.id() as i32;
    // From here on, dropping `guard` kills and reaps the child.
    let guard = GroupGuard::new(pid, program, keepalive);
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    // Dropping std's Child neither kills nor reaps; we never call its wait().
    drop(child);

    let pidfd = match group::pidfd_open(pid) {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!(pid, error = %e, "pidfd_open failed; falling back to polling for exit");
            None
        }
    };
    tracing::debug!(
        pid,
        program = %guard.program.display(),
        ?args,
        "spawned child process group"
    );
    Ok(RawChild {
        guard,
        stdin,
        stdout,
        stderr,
        pidfd,
        stderr_tail_bytes,
    })
}
