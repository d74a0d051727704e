//! The dedicated spawner thread.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not
//! the process. Tokio's blocking pool (and any short-lived thread) would
//! therefore kill children at random. All forks happen on one long-lived
//! `std::thread`; requests arrive over a channel and are answered on a
//! oneshot. The thread lives as long as any [`Spawner`] handle or any
//! un-reaped child spawned by it (each child holds a [`KeepAlive`]).
//!
//! The thread also stamps the spawner's [`Marker`] on every child's
//! environment and, in cgroup mode, creates each child's cgroup before the
//! fork; the child joins it itself before exec.

use std::ffi::OsString;
use std::io;
use std::process::{ChildStderr, ChildStdin, ChildStdout};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::oneshot;

use super::cgroup::{self, ChildCgroup};
use super::group::{self, GroupGuard};
use super::marker::{self, Marker};
use super::vfork;
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
    /// Starts the dedicated spawner thread, without a marker: children get
    /// no `DURABLE_SUPERVISOR_*` variables, so no sweep will ever find them.
    ///
    /// Usually called once per process; every call starts its own thread.
    pub fn start() -> Result<Spawner, ProcessError> {
        Self::start_thread(None)
    }

    /// Starts the dedicated spawner thread; every child it spawns carries
    /// `marker` (and the identity of this process) in its environment —
    /// overriding any variable of the same name in the spawn spec — so that
    /// a later incarnation's [`sweep_previous_incarnations`] can find what
    /// this one leaves behind. The instance is remembered for the life of
    /// the process: a sweep here never touches it.
    ///
    /// [`sweep_previous_incarnations`]: super::sweep_previous_incarnations
    pub fn start_with_marker(marker: Marker) -> Result<Spawner, ProcessError> {
        marker
            .validate()
            .map_err(|reason| ProcessError::InvalidMarker { reason })?;
        marker::register_instance(&marker.instance);
        Self::start_thread(Some(marker))
    }

    fn start_thread(marker: Option<Marker>) -> Result<Spawner, ProcessError> {
        let ctx = ThreadCtx {
            cgroup_tag: marker
                .as_ref()
                .map_or_else(|| "anon".to_string(), |m| marker::slot_tag(&m.slot)),
            marker_env: marker.map(|m| Arc::new(m.env())),
        };
        let (tx, rx) = mpsc::channel::<Msg>();
        std::thread::Builder::new()
            .name("process-spawner".into())
            .spawn(move || run(rx, ctx))
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

/// What the spawner thread knows about its children.
struct ThreadCtx {
    /// The marker's variables, set last (they win over the spec's).
    marker_env: Option<Arc<Vec<(String, String)>>>,
    /// Slot tag in cgroup names ("anon" without a marker).
    cgroup_tag: String,
}

fn run(rx: mpsc::Receiver<Msg>, ctx: ThreadCtx) {
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Spawn {
                spec,
                reply,
                keepalive,
            } => {
                let result = spawn_on_this_thread(*spec, keepalive, &ctx);
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

fn spawn_on_this_thread(
    spec: SpawnSpec,
    keepalive: KeepAlive,
    ctx: &ThreadCtx,
) -> Result<RawChild, ProcessError> {
    let SpawnSpec {
        program,
        args,
        cwd,
        env,
        env_allowlist,
        stderr_tail_bytes,
    } = spec;

    // The child's whole environment: the allowlisted variables of this
    // process, then the spec's, then the marker's (later ones win).
    let mut child_env: Vec<(OsString, OsString)> = Vec::new();
    for name in &env_allowlist {
        if let Some(value) = std::env::var_os(name) {
            child_env.push((name.into(), value));
        }
    }
    for (name, value) in &env {
        child_env.push((name.into(), value.into()));
    }
    if let Some(marker_env) = &ctx.marker_env {
        for (name, value) in marker_env.iter() {
            child_env.push((name.into(), value.into()));
        }
    }

    // The child's own cgroup, created before the clone so that the child
    // can join it before exec: nothing it forks is ever outside.
    let cgroup = new_child_cgroup(ctx);
    let cgroup_procs = match cgroup.as_ref().map(|cg| cg.procs_path()).transpose() {
        Ok(path) => path,
        Err(e) => {
            tracing::warn!(error = %e, "unusable cgroup path; spawning without a cgroup");
            None
        }
    };
    let cgroup = if cgroup_procs.is_some() {
        cgroup
    } else {
        discard_cgroup(cgroup);
        None
    };

    let spawn_error = |source: io::Error, cgroup: Option<ChildCgroup>| {
        discard_cgroup(cgroup);
        ProcessError::Spawn {
            program: program.clone(),
            cwd: cwd.clone(),
            source,
        }
    };
    let prepared = match vfork::Prepared::new(&program, &args, &cwd, &child_env, cgroup_procs) {
        Ok(p) => p,
        Err(source) => return Err(spawn_error(source, cgroup)),
    };
    // From before the clone until the pid is registered, the orphan reaper
    // leaves unregistered group leaders alone (see reaper.rs).
    let ticket = group::begin_spawn();
    // returns once the child has exec'd (or failed to), so setpgid has
    // happened by the time we see the pid
    let child = match vfork::spawn(&prepared) {
        Ok(child) => child,
        Err(source) => {
            drop(ticket);
            return Err(spawn_error(source, cgroup));
        }
    };
    let pid = child.pid;
    // The exec has happened, so the pre-exec join has too. A child that
    // already exited cannot be checked; it keeps its (soon empty) cgroup.
    let cgroup = match cgroup {
        Some(cg) if cg.contains(pid) || matches!(group::leader_exited(pid), Ok(true)) => {
            Some(Arc::new(cg))
        }
        Some(cg) => {
            cgroup::disable(format!(
                "child {pid} could not join its cgroup {}",
                cg.dir().display()
            ));
            cg.remove_now_logged();
            None
        }
        None => None,
    };
    // From here on, dropping `guard` kills and reaps the child.
    let guard = GroupGuard::new(pid, program, keepalive, cgroup, ticket);
    let stdin = Some(ChildStdin::from(child.stdin));
    let stdout = Some(ChildStdout::from(child.stdout));
    let stderr = Some(ChildStderr::from(child.stderr));

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

/// A fresh cgroup for the next child, in cgroup mode. A failure to create it
/// switches cgroups off (the child still runs, with its process group).
fn new_child_cgroup(ctx: &ThreadCtx) -> Option<ChildCgroup> {
    // One sequence for the whole process: every Spawner (thread) of it names
    // its children's cgroups with the same supervisor identity.
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let h = cgroup::hierarchy()?;
    let seq = SEQ.fetch_add(1, Ordering::Relaxed) + 1;
    let name = cgroup::child_name(&ctx.cgroup_tag, &marker::self_identity(), seq);
    match ChildCgroup::create(&h, &name) {
        Ok(cg) => Some(cg),
        Err(e) => {
            cgroup::disable(format!(
                "cannot create the cgroup {}/{name}: {e}",
                h.own_dir().display()
            ));
            None
        }
    }
}

/// Removes a cgroup no child ever joined.
fn discard_cgroup(cgroup: Option<ChildCgroup>) {
    if let Some(cg) = cgroup {
        cg.remove_now_logged();
    }
}
