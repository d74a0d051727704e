//! Executor sessions and pools.
//!
//! A *session* is one child process and its framed stdio: the hello it said,
//! the jobs it served. A *pool* per configured executor keeps the idle
//! sessions of a persistent executor (Bazel's persistent workers): a warm
//! process serves many jobs, one at a time. A session goes back to the pool
//! only after a clean job (its terminal received, no violation, nothing
//! imposed but a cancel it answered within its grace); it is retired after
//! `max_jobs_per_process` jobs (the smaller of the hello's and the config's),
//! and killed on anything else. One-shot executors use a session for one job.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use futures::StreamExt;
use tokio::process::ChildStdin;
use tokio_util::codec::FramedRead;
use tracing::{debug, warn};

use super::workdir::WorkDir;
use crate::config::{ExecutorConfig, WorkerConfig};
use crate::process::{Child, ProcessError, Spawner};
use crate::wire::{self, Hello, ToExecutor};

/// Replaces an empty buffer with a new one (which grows again as a frame
/// needs). Whatever its capacity reads: a frame split off the front leaves
/// a buffer of small capacity that still holds the whole allocation the
/// frame was read into (re-check audit: an idle process kept ~8 MiB after an
/// output near the frame limit, its buffer's capacity reading a few KiB).
fn shrink_if_empty(buf: &mut bytes::BytesMut) {
    if buf.is_empty() {
        *buf = bytes::BytesMut::new();
    }
}

pub(crate) type Frames = wire::ExecutorFrames<tokio::process::ChildStdout>;

/// One executor process and its framed stdio.
pub(crate) struct Session {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub frames: Frames,
    /// The hello, once read (a new session has not said it yet).
    pub hello: Option<Hello>,
    /// Jobs this process has served (terminal received).
    pub jobs: u32,
    /// The id of the last job it was sent.
    pub last_job: Option<String>,
    /// The ids of the jobs it was sent before that one, the latest
    /// [`EARLIER_JOBS`] of them: a late frame of any of them is the
    /// process's fault, not the current job's.
    pub earlier_jobs: std::collections::VecDeque<String>,
    /// The session's own working directory (persistent sessions; a one-shot
    /// session runs in its attempt's directory).
    pub _dir: Option<tempfile::TempDir>,
    /// Set by the attempt: the job ended cleanly and the process may serve another.
    pub reusable: bool,
    /// Every secret (name, value) this process was handed, over all its
    /// jobs: a persistent process may keep a value from one job and echo it
    /// in a later one that named no secret, so each job's redaction covers
    /// them all.
    handed_secrets: Vec<(String, String)>,
    /// Set while the process serves its last job (`max_jobs_per_process`):
    /// counted in its executor's [`LastJobs`] until the session is gone.
    pub last_job_mark: Option<LastJobMark>,
}

/// How many job ids before its last a session remembers (a late frame of
/// an older job than these is a violation of the job it lands in).
pub(crate) const EARLIER_JOBS: usize = 32;

/// Records `job` as sent to a session (its `last_job` and `earlier_jobs`,
/// borrowed apart from its child): the previous job, and the ones before
/// it, for the attempt machine.
pub(crate) fn sent(
    last_job: &mut Option<String>,
    earlier_jobs: &mut std::collections::VecDeque<String>,
    job: &str,
) -> (Option<String>, Vec<String>) {
    let earlier: Vec<String> = earlier_jobs.iter().cloned().collect();
    let previous = last_job.replace(job.to_owned());
    if let Some(p) = &previous {
        if earlier_jobs.len() == EARLIER_JOBS {
            earlier_jobs.pop_front();
        }
        earlier_jobs.push_back(p.clone());
    }
    (previous, earlier)
}

/// How many of an executor's busy processes serve their last job: they
/// will not come back to the pool, so the warm pool's keeper starts their
/// replacements while they still run (persistent-pool audit: with
/// `max_jobs_per_process = 1` a backlog waited for a start at every job,
/// the replacement being started only once the last one was retired).
#[derive(Debug, Default, Clone)]
pub(crate) struct LastJobs(std::sync::Arc<std::sync::atomic::AtomicU32>);

impl LastJobs {
    pub fn get(&self) -> u32 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// One more process serves its last job, until the mark is dropped.
    pub fn mark(&self) -> LastJobMark {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        LastJobMark(self.clone())
    }
}

/// See [`LastJobs::mark`].
#[derive(Debug)]
pub(crate) struct LastJobMark(LastJobs);

impl Drop for LastJobMark {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Why a process of an executor could not be started.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// A persistent session's own directory could not be created.
    #[error("cannot create a session directory in {}: {source}", base.display())]
    WorkDir {
        base: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(#[from] ProcessError),
    #[error("the executor's pipes are missing")]
    NoPipes,
}

/// How many jobs a persistent process serves: its hello's
/// `max_jobs_per_process` (1 or 0 or none: one; negative: unlimited, as
/// `u32::MAX`) capped by the config's.
pub(crate) fn job_limit(from_hello: Option<i32>, configured: Option<u32>) -> u32 {
    let from_hello = match from_hello {
        Some(n) if n < 0 => u32::MAX,
        Some(n) if n > 1 => n as u32,
        _ => 1,
    };
    configured
        .map(|c| c.max(1))
        .unwrap_or(u32::MAX)
        .min(from_hello)
}

impl Session {
    /// Starts a process of `ecfg`: a one-shot one in `attempt_dir`, a
    /// persistent one in a directory of its own (under `work_dir`) that lives
    /// as long as the process.
    pub async fn start(
        spawner: &Spawner,
        cfg: &WorkerConfig,
        work: &WorkDir,
        ecfg: &ExecutorConfig,
        attempt_dir: &Path,
    ) -> Result<Session, StartError> {
        let dir = if ecfg.persistent {
            let prefix = format!("durable-session-{}-", super::attempt::sanitize(&ecfg.name));
            match work.tempdir(&prefix) {
                Ok(d) => Some(d),
                Err(source) => {
                    return Err(StartError::WorkDir {
                        base: work.base().to_owned(),
                        source,
                    })
                }
            }
        } else {
            None
        };
        let cwd = dir.as_ref().map(|d| d.path()).unwrap_or(attempt_dir);
        let child = spawner
            .spawn(ecfg.spawn_spec(cwd, cfg.stderr_tail_bytes))
            .await?;
        debug!(
            pid = child.pid,
            persistent = ecfg.persistent,
            "executor spawned"
        );
        Session::new(child, cfg.max_frame_bytes, dir).ok_or(StartError::NoPipes)
    }

    /// Wraps a freshly spawned child; `None` if its pipes are missing.
    pub fn new(
        mut child: Child,
        max_frame_bytes: usize,
        dir: Option<tempfile::TempDir>,
    ) -> Option<Session> {
        let stdout = child.take_stdout()?;
        let stdin = child.take_stdin();
        Some(Session {
            child,
            stdin,
            frames: FramedRead::new(stdout, wire::executor_decoder(max_frame_bytes)),
            hello: None,
            jobs: 0,
            last_job: None,
            earlier_jobs: Default::default(),
            _dir: dir,
            reusable: false,
            handed_secrets: Vec::new(),
            last_job_mark: None,
        })
    }

    /// Notes the secrets about to be handed to this process with its next
    /// job; returns all it has been handed so far, these included.
    pub fn hand_out(
        &mut self,
        secrets: &std::collections::BTreeMap<String, String>,
    ) -> &[(String, String)] {
        for (name, value) in secrets {
            if !self
                .handed_secrets
                .iter()
                .any(|(n, v)| n == name && v == value)
            {
                self.handed_secrets.push((name.clone(), value.clone()));
            }
        }
        &self.handed_secrets
    }

    /// How many jobs this process may serve: the hello's `max_jobs_per_process`
    /// (1 or 0: one; negative: unlimited) capped by the config's.
    pub fn job_limit(&self, configured: Option<u32>) -> u32 {
        job_limit(
            self.hello.as_ref().map(|h| h.max_jobs_per_process),
            configured,
        )
    }

    /// Whether an idle session can take a job: still running (not exited,
    /// not stopped by a signal), and it wrote nothing while idle (a frame between jobs is a protocol violation; the
    /// session is not trusted with another job).
    fn healthy(&mut self, executor: &str) -> bool {
        if self.child.has_exited() {
            return false;
        }
        if self.child.is_stopped() {
            // handed a job, it answered nothing until `handshake_timeout_ms`
            // and the stop's graces ran out, and the job was given back: two
            // such processes kept a step waiting 34 s (persistent-pool audit)
            warn!(
                executor = %executor,
                pid = self.child.pid,
                jobs = self.jobs,
                "an idle executor process is stopped (SIGSTOP, SIGTSTP or a debugger) and cannot take a job; it is replaced"
            );
            return false;
        }
        match self.frames.next().now_or_never() {
            // no whole frame; but a part of one (a stray print, bytes that
            // announce a frame longer than what follows) is a write between
            // jobs too: left in the buffer, the next job's frames were read
            // after it and that innocent job failed, or waited for ever
            None if self.frames.read_buffer().is_empty() => true,
            Some(None) if self.frames.read_buffer().is_empty() => {
                warn!(
                    executor = %executor,
                    pid = self.child.pid,
                    jobs = self.jobs,
                    "an idle executor closed its stdout between jobs; it is replaced"
                );
                false
            }
            _ => {
                warn!(
                    executor = %executor,
                    pid = self.child.pid,
                    jobs = self.jobs,
                    "an idle executor wrote to its stdout between jobs; it is replaced"
                );
                false
            }
        }
    }

    /// Gives back the memory of the frames read for the last job: the read
    /// buffer kept the allocation of the largest frame the process wrote
    /// (up to `max_frame_bytes`, twice over as it grew), per idle process,
    /// until its next job (persistent-pool audit: worker RSS
    /// ~250 MB after outputs near the frame limit). An unread byte (a write
    /// between jobs) keeps the buffer as it is, for `healthy` to see.
    fn shrink_read_buffer(&mut self) {
        shrink_if_empty(self.frames.read_buffer_mut());
    }

    /// Ends the session in order: `Shutdown`, EOF on stdin, the cancel grace
    /// to exit (none for a process stopped by a signal), then the usual stop
    /// (SIGTERM, grace, SIGKILL to the group, reap; SIGKILL at once for a
    /// stopped one).
    pub async fn retire(mut self, cfg: &WorkerConfig, why: &str) {
        if let Some(w) = self.stdin.as_mut() {
            use tokio::io::AsyncWriteExt;
            let bytes = wire::encode_to_executor(&ToExecutor::Shutdown { reason: why.into() });
            let _ = tokio::time::timeout(Duration::from_millis(500), w.write_all(&bytes)).await;
        }
        drop(self.stdin.take());
        // a stopped process reads no Shutdown: its grace would only delay
        // the SIGTERM (re-check audit: stopped idle processes took the worker
        // 2 s each to stop)
        let _ =
            super::attempt::wait_exit(&mut self.child, Duration::from_millis(cfg.cancel_grace_ms))
                .await;
        let _ = super::attempt::stop_child(&mut self.child, cfg).await;
        debug!(jobs = self.jobs, why, "executor session retired");
    }
}

/// The idle sessions of one persistent executor (counted in
/// `durable_executor_idle_processes` under its name).
pub(crate) struct Pool {
    executor: String,
    /// The most idle sessions kept: the executor's concurrency (a warm start
    /// and an attempt's own start can race, and more never serve).
    cap: usize,
    /// Idle sessions with the time each was put back, the most recent last.
    idle: Mutex<Vec<(Session, std::time::Instant)>>,
    /// Sessions found unhealthy before they served a job (ended, stopped
    /// or wrote right after their hello), since the keeper last asked
    /// ([`Pool::take_lost_unused`]).
    lost_unused: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("idle", &self.idle()).finish()
    }
}

impl Pool {
    pub fn new(executor: &str, cap: usize) -> Pool {
        Pool {
            executor: executor.to_owned(),
            cap,
            idle: Mutex::new(Vec::new()),
            lost_unused: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// An idle, healthy session, if there is one (unhealthy ones are dropped:
    /// `Child`'s drop kills and reaps their group).
    pub fn take(&self) -> Option<Session> {
        loop {
            // the most recently used: the others age, and retire when idle
            // long enough (`expired`); where none has served a job yet (a
            // fresh pool, or one of a process per job), the one waiting
            // longest (the keeper may start a replacement while its
            // predecessor's last job runs: it is not taken before the older
            // ones). Taken from anywhere, the rest stay in the order they
            // were put, oldest first, as `expired` reads them.
            let (mut s, _) = {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                match idle.iter().rposition(|(s, _)| s.jobs > 0) {
                    Some(i) => idle.remove(i),
                    None if idle.is_empty() => return None,
                    None => idle.remove(0),
                }
            };
            crate::metrics::idle_processes(&self.executor, -1);
            if s.healthy(&self.executor) {
                return Some(s);
            }
            self.found_unhealthy(s);
        }
    }

    /// An idle, healthy session that has served no job (a warm pool's
    /// process, a kept probe), the one waiting longest, if there is one.
    pub fn take_unused(&self) -> Option<Session> {
        loop {
            let (mut s, _) = {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                let i = idle.iter().position(|(s, _)| s.jobs == 0)?;
                idle.remove(i)
            };
            crate::metrics::idle_processes(&self.executor, -1);
            if s.healthy(&self.executor) {
                return Some(s);
            }
            self.found_unhealthy(s);
        }
    }

    /// Keeps `s` idle, unless `cap` sessions already are: then it is retired.
    pub async fn put(&self, mut s: Session, cfg: &WorkerConfig) {
        s.shrink_read_buffer();
        let surplus = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() >= self.cap {
                Some(s)
            } else {
                idle.push((s, std::time::Instant::now()));
                crate::metrics::idle_processes(&self.executor, 1);
                None
            }
        };
        if let Some(s) = surplus {
            s.retire(cfg, "as many processes are idle as can serve")
                .await;
        }
    }

    /// The idle sessions that cannot take a job any more (their process
    /// ended, or wrote between jobs), taken out of the pool: an idle process
    /// that crashed (an OOM kill, a stray signal) would otherwise stay a
    /// zombie counted as ready until a job took it.
    pub fn take_unhealthy(&self) -> Vec<Session> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        let mut i = 0;
        while i < idle.len() {
            if idle[i].0.healthy(&self.executor) {
                i += 1;
            } else {
                let (s, _) = idle.remove(i);
                self.lost(&s);
                out.push(s);
            }
        }
        crate::metrics::idle_processes(&self.executor, -(out.len() as i64));
        out
    }

    /// Drops `s`, found unhealthy as a job was about to be handed to it
    /// (`Child`'s drop kills and reaps its group): one that ended on its own
    /// is said so here, with how it ended (the sweep, `take_unhealthy`, says
    /// it for those it finds first; one that was stopped or wrote between
    /// jobs was named by `healthy`). Without it, an idle process killed by
    /// the OOM killer was replaced without a word (soak audit).
    fn found_unhealthy(&self, s: Session) {
        self.lost(&s);
        if let Some(status) = s.child.exit_status_if_ended() {
            warn!(
                executor = %self.executor,
                pid = s.child.pid,
                jobs = s.jobs,
                %status,
                "an idle executor process ended between jobs (found as a job was handed to it); it is replaced"
            );
        }
    }

    /// Counts `s`, found unhealthy, if it served no job.
    fn lost(&self, s: &Session) {
        if s.jobs == 0 {
            self.lost_unused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// How many sessions were found unhealthy before they served a job since
    /// the last call: processes that end, stop or write right after their
    /// hello, which the warm keeper must not restart at once for ever.
    pub fn take_lost_unused(&self) -> u32 {
        self.lost_unused
            .swap(0, std::sync::atomic::Ordering::Relaxed)
    }

    /// Every idle session, for retirement at shutdown.
    pub fn drain(&self) -> Vec<Session> {
        let all = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        crate::metrics::idle_processes(&self.executor, -(all.len() as i64));
        all.into_iter().map(|(s, _)| s).collect()
    }

    /// The idle sessions that have had no job for `idle_for`, oldest first,
    /// leaving at least `keep` idle (the warm ones): for retirement.
    pub fn expired(&self, keep: usize, idle_for: std::time::Duration) -> Vec<Session> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        // oldest first: the front of the list
        let n = idle
            .iter()
            .take(idle.len().saturating_sub(keep))
            .take_while(|(_, since)| now.duration_since(*since) >= idle_for)
            .count();
        let out: Vec<Session> = idle.drain(..n).map(|(s, _)| s).collect();
        crate::metrics::idle_processes(&self.executor, -(out.len() as i64));
        out
    }

    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `MakeWriter` into a shared buffer: what the pool logged.
    #[derive(Clone, Default)]
    struct Logged(std::sync::Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logged {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logged {
        type Writer = Logged;
        fn make_writer(&'a self) -> Logged {
            self.clone()
        }
    }

    /// Puts `s`, unusable, alone in a pool of executor `ex` and takes from
    /// it, as a job does: nothing is handed out; what the pool logged.
    fn taken_from_a_pool_of(s: Session) -> String {
        let pool = Pool::new("ex", 4);
        pool.idle
            .lock()
            .unwrap()
            .push((s, std::time::Instant::now()));
        let logged = Logged::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logged.clone())
            .with_ansi(false)
            .finish();
        let taken = tracing::subscriber::with_default(subscriber, || pool.take());
        assert!(taken.is_none(), "an unusable process is not handed a job");
        assert_eq!(pool.idle(), 0);
        let text = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
        text
    }

    /// An idle process that ended between jobs and is found so as a job is
    /// handed to it (before the periodic sweep saw it) is replaced with a
    /// warning that says how it ended: it was dropped without a word (soak
    /// audit), so an executor killed by the OOM killer while idle left no
    /// trace in the worker's log.
    #[tokio::test]
    async fn an_idle_process_found_dead_as_a_job_is_handed_to_it_is_logged() {
        let spawner = crate::process::Spawner::start().expect("start spawner");
        let mut spec = crate::process::SpawnSpec::new("/bin/sh", "/");
        spec.args = vec!["-c".into(), "exit 3".into()];
        let mut child = spawner.spawn(spec).await.expect("spawn");
        child.exited().await.expect("exit");
        let pid = child.pid;
        let mut s = Session::new(child, 1 << 20, None).expect("pipes");
        s.jobs = 2;
        let text = taken_from_a_pool_of(s);
        assert!(
            text.contains(
                "an idle executor process ended between jobs (found as a job was handed to it)"
            ) && text.contains("exited with code 3")
                && text.contains(&format!("pid={pid}"))
                && text.contains("executor=ex")
                && text.contains("jobs=2"),
            "{text}"
        );
        // nothing of its group is left (the drop kills and reaps it)
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !crate::process::group_members(pid).is_empty() {
            assert!(std::time::Instant::now() < until, "group {pid} left");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An idle process that closed its stdout (and runs on) is named with
    /// its executor and the jobs it served, as one that ended is (re-check
    /// audit: its line had the pid alone).
    #[tokio::test]
    async fn an_idle_process_that_closed_its_stdout_is_named_with_its_executor() {
        let spawner = crate::process::Spawner::start().expect("start spawner");
        let mut spec = crate::process::SpawnSpec::new("/bin/sh", "/");
        spec.args = vec!["-c".into(), "exec 1>&-; sleep 30".into()];
        let child = spawner.spawn(spec).await.expect("spawn");
        let mut s = Session::new(child, 1 << 20, None).expect("pipes");
        // its stdout's EOF, read
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while s.frames.next().now_or_never().is_none() {
            assert!(std::time::Instant::now() < until, "no EOF");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        s.jobs = 3;
        let text = taken_from_a_pool_of(s);
        assert!(
            text.contains("closed its stdout between jobs")
                && text.contains("executor=ex")
                && text.contains("jobs=3"),
            "{text}"
        );
    }

    #[test]
    fn an_idle_sessions_read_buffer_gives_back_a_large_frames_allocation() {
        // what a large result left: its frame split off (and since freed),
        // the rest empty, of small capacity, on the frame's allocation
        let mut buf = bytes::BytesMut::with_capacity(8 << 20);
        buf.extend_from_slice(&vec![7; (8 << 20) - 100]);
        drop(buf.split_to((8 << 20) - 100));
        assert!(
            buf.is_empty() && buf.capacity() <= 100,
            "{}",
            buf.capacity()
        );
        let held = buf.as_ptr();
        shrink_if_empty(&mut buf);
        assert_eq!(buf.capacity(), 0, "a new, unallocated buffer");
        assert_ne!(buf.as_ptr(), held, "off the frame's allocation");

        // bytes written between jobs stay for `healthy` to see
        let mut stray = bytes::BytesMut::with_capacity(8 << 20);
        stray.extend_from_slice(b"stray");
        shrink_if_empty(&mut stray);
        assert_eq!(&stray[..], b"stray");
    }
}
