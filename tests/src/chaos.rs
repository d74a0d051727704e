//! Chaos and field-smoke helpers (S07): a private PostgreSQL cluster that can
//! be restarted under running workers, `supervisor worker` processes in named
//! slots that can be killed (-9), paused (SIGSTOP) and restarted as new
//! incarnations of the same name, /proc scans for leftover executors, and the
//! audit of what the database recorded afterwards.
//!
//! The audit reads only the database (and the demo.effect sink files), so it
//! holds for any mix of demo steps: `tests/tests/chaos.rs` and the field smoke
//! (`tests/src/bin/field_smoke.rs`) share it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::Row;
use supervisor::config::{ExecutorConfig, WorkerConfig};
use supervisor::db::Db;
use supervisor::state::StepState;
use uuid::Uuid;

/// The environment variable every executor of a chaos/field worker carries
/// (value: the session's marker), so leftover processes can be found in /proc.
pub const MARKER_ENV: &str = "DURABLE_CHAOS_MARKER";

fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Seconds since `t0`, for log lines.
pub fn secs(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

/// The `supervisor` binary next to the running executable: a test runs from
/// `target/<profile>/deps/`, a binary of this crate from `target/<profile>/`.
pub fn worker_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        let bin = d.join("supervisor");
        if bin.is_file() {
            return bin;
        }
        if d.file_name().is_some_and(|n| n == "target") {
            break;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    panic!(
        "no `supervisor` binary next to {}: build it first (`cargo build --workspace --bins`)",
        exe.display()
    );
}

// ---------------------------------------------------------------------------
// a directory for one session: kept when something failed

/// The session's directory (PostgreSQL data and log, worker configs and logs,
/// attempt directories, effect sinks). Removed by [`RunDir::finish`] when
/// everything held, kept (and its path printed) otherwise.
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    pub fn new(prefix: &str) -> RunDir {
        let path = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("session directory")
            .keep();
        // the postgres user must be able to reach its data directory below
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .expect("chmod session directory");
        RunDir { path }
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path.join(p)
    }

    /// Removes the directory when `ok` (unless DURABLE_CHAOS_KEEP is set);
    /// otherwise says where the evidence is.
    pub fn finish(&self, ok: bool) {
        if ok && std::env::var_os("DURABLE_CHAOS_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.path);
        } else {
            println!(
                "session directory kept: {} (server log pg/server.log, worker logs logs/*.log)",
                self.path.display()
            );
        }
    }
}

// ---------------------------------------------------------------------------
// a private PostgreSQL cluster

fn pg_bin() -> Result<PathBuf> {
    if let Some(b) = std::env::var_os("PGBIN") {
        return Ok(PathBuf::from(b));
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no /usr/lib/postgresql: install the PostgreSQL server binaries")?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, b)| b)
        .context("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free TCP port")
}

/// A PostgreSQL cluster of its own (data, port, socket and log under `dir`),
/// so it can be restarted without disturbing anything else. As root, its
/// tools run as the `postgres` user (initdb refuses root). Durability: fsync
/// is off (the OS does not crash here) but `synchronous_commit` stays on, so
/// an immediate (crash-like) stop loses no committed transaction.
pub struct PrivatePg {
    bin: PathBuf,
    dir: PathBuf,
    pub port: u16,
    pub url: String,
    pub log: PathBuf,
    running: bool,
}

impl PrivatePg {
    pub async fn start(dir: &Path) -> Result<PrivatePg> {
        let bin = pg_bin()?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        if is_root() {
            let pg = nix::unistd::User::from_name("postgres")
                .ok()
                .flatten()
                .context("running as root but there is no `postgres` user to own the cluster")?;
            std::os::unix::fs::chown(dir, Some(pg.uid.as_raw()), Some(pg.gid.as_raw()))
                .with_context(|| format!("chown postgres {}", dir.display()))?;
        }
        let port = free_port();
        let mut pg = PrivatePg {
            bin,
            dir: dir.to_owned(),
            port,
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            log: dir.join("server.log"),
            running: false,
        };
        let data = pg.dir.join("data");
        pg.run(
            pg.tool("initdb").arg("-D").arg(&data).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
            ]),
            "initdb",
        )
        .await?;
        pg.start_server().await?;
        Ok(pg)
    }

    fn tool(&self, name: &str) -> tokio::process::Command {
        let mut c = if is_root() {
            let mut c = tokio::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bin.join(name));
            c
        } else {
            tokio::process::Command::new(self.bin.join(name))
        };
        c.stdin(Stdio::null()).kill_on_drop(true);
        c
    }

    async fn run(&self, cmd: &mut tokio::process::Command, what: &str) -> Result<()> {
        let out = cmd
            .output()
            .await
            .with_context(|| format!("running {what}"))?;
        if !out.status.success() {
            bail!(
                "{what} failed ({}): {}{}\n(server log {})",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log.display()
            );
        }
        Ok(())
    }

    pub async fn start_server(&mut self) -> Result<()> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off \
             -c full_page_writes=off -c shared_buffers=128MB -c log_lock_waits=on",
            self.port,
            self.dir.display()
        );
        let data = self.dir.join("data");
        let log = self.log.clone();
        self.run(
            self.tool("pg_ctl")
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", "60", "start", "-o"])
                .arg(opts),
            "pg_ctl start",
        )
        .await?;
        self.running = true;
        Ok(())
    }

    /// `mode`: fast (clean: sessions are ended, a checkpoint is written) or
    /// immediate (like a crash: crash recovery at the next start).
    pub async fn stop(&mut self, mode: &str) -> Result<()> {
        let data = self.dir.join("data");
        self.run(
            self.tool("pg_ctl")
                .arg("-D")
                .arg(&data)
                .args(["-m", mode, "-w", "-t", "60", "stop"]),
            "pg_ctl stop",
        )
        .await?;
        self.running = false;
        Ok(())
    }

    /// Stops and starts the server; returns how long it was down.
    pub async fn restart(&mut self, mode: &str) -> Result<Duration> {
        let t = Instant::now();
        self.stop(mode).await?;
        self.start_server().await?;
        Ok(t.elapsed())
    }

    pub fn server_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        if self.running {
            let mut c = if is_root() {
                let mut c = std::process::Command::new("runuser");
                c.args(["-u", "postgres", "--"])
                    .arg(self.bin.join("pg_ctl"));
                c
            } else {
                std::process::Command::new(self.bin.join("pg_ctl"))
            };
            let _ = c
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

// ---------------------------------------------------------------------------
// worker slots

/// A worker config for chaos: the harness's fast settings (lease_ttl_ms 2000,
/// heartbeat 300 ms, ...), the Go and Python demo executors carrying the
/// session marker, attempt directories under `work_dir`.
pub fn chaos_worker_config(marker: &str, work_dir: &Path, ttl_ms: u64, hb_ms: u64) -> WorkerConfig {
    let mark = |mut e: ExecutorConfig, concurrency: u32| {
        e.env.insert(MARKER_ENV.into(), marker.into());
        e.concurrency = concurrency;
        e
    };
    let mut cfg = crate::fast_config(vec![
        mark(crate::go_demo("go", &[], None), 3),
        mark(crate::python_demo("python", &[], None), 2),
    ]);
    cfg.lease_ttl_ms = ttl_ms;
    cfg.heartbeat_interval_ms = hb_ms;
    cfg.work_dir = Some(work_dir.to_owned());
    cfg
}

/// One named worker slot: `supervisor worker --config FILE` with a fixed
/// `name`, restarted as new incarnations (new process, new worker id, same
/// name). Each incarnation logs (stdout and stderr) to `logs/<name>.<n>.log`.
pub struct WorkerSlot {
    pub name: String,
    cfg_path: PathBuf,
    logs_dir: PathBuf,
    url: String,
    pub incarnation: u32,
    child: Option<std::process::Child>,
    pub pid: Option<i32>,
    worker_id: Option<Uuid>,
    pub spawned_at: Option<Instant>,
    pub paused: bool,
    pub logs: Vec<PathBuf>,
}

impl WorkerSlot {
    pub fn new(name: &str, cfg: &WorkerConfig, dir: &Path, url: &str) -> WorkerSlot {
        let mut cfg = cfg.clone();
        cfg.name = Some(name.to_owned());
        if let Some(w) = cfg.work_dir.as_mut() {
            *w = w.join(name);
            std::fs::create_dir_all(&*w).expect("work dir");
        }
        let logs_dir = dir.join("logs");
        std::fs::create_dir_all(&logs_dir).expect("logs dir");
        let cfg_path = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg_path, crate::worker_toml(&cfg)).expect("write worker config");
        WorkerSlot {
            name: name.to_owned(),
            cfg_path,
            logs_dir,
            url: url.to_owned(),
            incarnation: 0,
            child: None,
            pid: None,
            worker_id: None,
            spawned_at: None,
            paused: false,
            logs: Vec::new(),
        }
    }

    /// Starts the next incarnation.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} is still running", self.name);
        self.incarnation += 1;
        let log = self
            .logs_dir
            .join(format!("{}.{}.log", self.name, self.incarnation));
        let out = std::fs::File::create(&log).expect("worker log");
        let err = out.try_clone().expect("worker log");
        let child = std::process::Command::new(worker_bin())
            .args(["worker", "--config"])
            .arg(&self.cfg_path)
            .env("DATABASE_URL", &self.url)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn supervisor worker");
        self.pid = Some(child.id() as i32);
        self.child = Some(child);
        self.worker_id = None;
        self.spawned_at = Some(Instant::now());
        self.paused = false;
        self.logs.push(log);
    }

    pub fn is_up(&self) -> bool {
        self.child.is_some()
    }

    fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
    }

    /// The exit status if the process ended on its own (not reaped yet by us).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        let status = child.wait().ok();
        self.paused = false;
        status
    }

    pub fn pause(&mut self) {
        self.signal(Signal::SIGSTOP);
        self.paused = true;
    }

    pub fn resume(&mut self) {
        self.signal(Signal::SIGCONT);
        self.paused = false;
    }

    /// SIGTERM (drain), waits up to `within`; SIGKILL after that. Returns the
    /// exit status and whether it drained in time.
    pub async fn stop(&mut self, within: Duration) -> Option<(ExitStatus, bool)> {
        if self.paused {
            self.resume();
        }
        self.signal(Signal::SIGTERM);
        let until = Instant::now() + within;
        loop {
            let child = self.child.as_mut()?;
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some((status, true));
            }
            if Instant::now() > until {
                return self.kill9().map(|s| (s, false));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The current incarnation's `durable.workers` id (it registers after probing its executors).
    pub async fn worker_id(&mut self, db: &Db) -> Option<Uuid> {
        if self.worker_id.is_none() {
            let pid = self.pid?;
            self.worker_id = sqlx::query_scalar(
                "SELECT id FROM durable.workers WHERE pid = $1 AND name = $2 ORDER BY started_at DESC LIMIT 1",
            )
            .bind(pid)
            .bind(&self.name)
            .fetch_optional(db.pool())
            .await
            .ok()
            .flatten();
        }
        self.worker_id
    }

    pub fn current_log(&self) -> String {
        self.logs
            .last()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// The current incarnation got past its start (probe, register) and runs its loops.
    pub fn started(&self) -> bool {
        self.current_log().contains("worker running")
    }
}

impl Drop for WorkerSlot {
    fn drop(&mut self) {
        if self.paused {
            self.signal(Signal::SIGCONT);
        }
        let _ = self.kill9();
    }
}

/// Waits until every slot's current incarnation logged "worker running".
pub async fn wait_started(slots: &mut [WorkerSlot], within: Duration) -> Result<()> {
    let until = Instant::now() + within;
    loop {
        for s in slots.iter_mut() {
            if let Some(status) = s.exited() {
                bail!(
                    "worker {} exited at start ({status}); log {}:\n{}",
                    s.name,
                    s.logs
                        .last()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    s.current_log()
                );
            }
        }
        if slots.iter().all(|s| s.started()) {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("workers did not start within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Retries `f` (a database call) until it succeeds or `within` passes: the
/// server may be restarting.
pub async fn retry<T, E, Fut>(within: Duration, mut f: impl FnMut() -> Fut) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let until = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > until => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A step a worker held when it was killed or paused.
#[derive(Debug, Clone)]
pub struct Orphan {
    pub step_run_id: Uuid,
    pub name: String,
    pub kind: String,
    pub state: String,
    pub attempt: i32,
    pub lease_expires_at: Option<DateTime<Utc>>,
}

/// The leased and running steps of worker `id`, as the database has them.
pub async fn owned_steps(db: &Db, id: Uuid) -> Vec<Orphan> {
    let rows = retry(Duration::from_secs(30), || {
        sqlx::query(
            "SELECT id, name, kind, state, attempt, durable.lease_expiry(id) AS lease_expires_at FROM durable.step_runs
              WHERE owner_worker_id = $1 AND state IN ('leased', 'running') ORDER BY id",
        )
        .bind(id)
        .fetch_all(db.pool())
    })
    .await
    .unwrap_or_default();
    rows.into_iter()
        .map(|r| Orphan {
            step_run_id: r.get("id"),
            name: r.get("name"),
            kind: r.get("kind"),
            state: r.get("state"),
            attempt: r.get("attempt"),
            lease_expires_at: r.get("lease_expires_at"),
        })
        .collect()
}

/// How many steps each worker (by id) is running now.
pub async fn running_by_worker(db: &Db) -> HashMap<Uuid, i64> {
    retry(Duration::from_secs(30), || {
        sqlx::query_as::<_, (Uuid, i64)>(
            "SELECT owner_worker_id, count(*) FROM durable.step_runs
              WHERE state = 'running' AND owner_worker_id IS NOT NULL GROUP BY 1",
        )
        .fetch_all(db.pool())
    })
    .await
    .unwrap_or_default()
    .into_iter()
    .collect()
}

/// A worker taken out: kill -9 (`paused_until: None`) or SIGSTOP until a time.
#[derive(Debug, Clone)]
pub struct Outage {
    pub slot: String,
    pub incarnation: u32,
    pub worker_id: Option<Uuid>,
    pub at: DateTime<Utc>,
    pub paused_until: Option<DateTime<Utc>>,
    pub orphans: Vec<Orphan>,
    /// Steps ready to be leased at that moment (pending, or due to retry):
    /// a reclaimed orphan queues behind them (the lease takes the oldest
    /// `next_attempt_at` first).
    pub ready_backlog: i64,
}

/// How many steps are ready to be leased now.
pub async fn ready_backlog(db: &Db) -> i64 {
    retry(Duration::from_secs(30), || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM durable.step_runs
              WHERE state IN ('pending', 'retryable_failed') AND next_attempt_at <= now()",
        )
        .fetch_one(db.pool())
    })
    .await
    .unwrap_or(-1)
}

/// What happened to one orphan after its worker went away.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub step_run_id: Uuid,
    pub name: String,
    pub slot: String,
    pub paused: bool,
    pub outage_at: DateTime<Utc>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The first transition out of the orphaned attempt: (at, to_state, reason, by).
    pub released: Option<(DateTime<Utc>, String, String, String)>,
    /// The next attempt's lease: (at, attempt, worker).
    pub leased: Option<(DateTime<Utc>, i32, String)>,
    /// The next attempt's `running` (reason ACCEPTED): (at, attempt, worker).
    pub accepted: Option<(DateTime<Utc>, i32, String)>,
    pub ready_backlog: i64,
}

impl Recovery {
    /// Outage → the orphaned attempt moved on by LEASE_EXPIRED (the part
    /// that does not depend on the queue).
    pub fn reclaimed(&self) -> Option<Duration> {
        self.released
            .as_ref()
            .filter(|(_, _, why, _)| why.starts_with("LEASE_EXPIRED"))
            .and_then(|(at, _, _, _)| (*at - self.outage_at).to_std().ok())
    }

    /// Outage → the next attempt's accepted.
    pub fn recovery(&self) -> Option<Duration> {
        self.accepted
            .as_ref()
            .and_then(|(at, _, _)| (*at - self.outage_at).to_std().ok())
    }
}

/// Outage → next accepted for every orphan, from durable.transitions.
pub async fn recoveries(db: &Db, outages: &[Outage]) -> Vec<Recovery> {
    let mut out = Vec::new();
    for o in outages {
        for orphan in &o.orphans {
            let rows = retry(Duration::from_secs(30), || {
                sqlx::query(
                    "SELECT from_state, to_state, attempt, worker, reason, at FROM durable.transitions
                      WHERE step_run_id = $1 ORDER BY id",
                )
                .bind(orphan.step_run_id)
                .fetch_all(db.pool())
            })
            .await
            .unwrap_or_default();
            let mut released = None;
            let mut leased = None;
            let mut accepted = None;
            for r in rows {
                let at: DateTime<Utc> = r.get("at");
                let to: String = r.get("to_state");
                let from: Option<String> = r.get("from_state");
                let attempt: Option<i32> = r.get("attempt");
                let worker: Option<String> = r.get("worker");
                let reason: Option<String> = r.get("reason");
                // the orphaned attempt leaving leased/running (not its own start)
                if released.is_none()
                    && matches!(from.as_deref(), Some("leased" | "running"))
                    && to != "running"
                    && attempt == Some(orphan.attempt)
                    && at >= o.at - chrono::Duration::milliseconds(500)
                {
                    released = Some((
                        at,
                        to.clone(),
                        reason.clone().unwrap_or_default(),
                        worker.clone().unwrap_or_default(),
                    ));
                }
                if leased.is_none() && to == "leased" && attempt.unwrap_or(0) > orphan.attempt {
                    leased = Some((at, attempt.unwrap_or(0), worker.clone().unwrap_or_default()));
                }
                // the next attempt's leased → running (reason ACCEPTED)
                if accepted.is_none()
                    && from.as_deref() == Some("leased")
                    && to == "running"
                    && attempt.unwrap_or(0) > orphan.attempt
                {
                    accepted = Some((at, attempt.unwrap_or(0), worker.unwrap_or_default()));
                }
            }
            out.push(Recovery {
                step_run_id: orphan.step_run_id,
                name: orphan.name.clone(),
                slot: o.slot.clone(),
                paused: o.paused_until.is_some(),
                outage_at: o.at,
                lease_expires_at: orphan.lease_expires_at,
                released,
                leased,
                accepted,
                ready_backlog: o.ready_backlog,
            });
        }
    }
    out
}

/// Checks on the recoveries: an orphan's attempt may be moved on (reclaimed)
/// and re-executed only after its lease expired.
pub fn check_recoveries(recs: &[Recovery], failures: &mut Vec<String>) {
    for r in recs {
        let Some(exp) = r.lease_expires_at else {
            continue;
        };
        if let Some((at, to, reason, by)) = &r.released {
            if reason.starts_with("LEASE_EXPIRED") && *at < exp {
                failures.push(format!(
                    "step {} ({}) of {} was reclaimed ({to}, by {by}) at {at}, before its lease expired at {exp}",
                    r.step_run_id, r.name, r.slot
                ));
            }
        }
        if let Some((at, attempt, by)) = &r.accepted {
            if *at < exp
                && r.released
                    .as_ref()
                    .is_some_and(|x| x.2.starts_with("LEASE_EXPIRED"))
            {
                failures.push(format!(
                    "step {} ({}): attempt {attempt} started on {by} at {at}, while the orphaned attempt's lease (of {}) ran until {exp}",
                    r.step_run_id, r.name, r.slot
                ));
            }
        }
    }
}

pub fn fmt_secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// "2.41 s (1.21×TTL)".
pub fn vs_ttl(d: Duration, ttl: Duration) -> String {
    format!(
        "{:.2} s ({:.2}×TTL)",
        d.as_secs_f64(),
        d.as_secs_f64() / ttl.as_secs_f64()
    )
}

/// One line per orphan: when its lease ran out, when it was reclaimed, how
/// many steps were ready to run at the outage (the orphan queues behind
/// them), when its next attempt was leased and accepted (all relative to the
/// outage), and the recovery against the TTL.
pub fn recovery_table(recs: &[Recovery], ttl: Duration) -> String {
    let rel = |t: DateTime<Utc>, o: DateTime<Utc>| {
        let ms = (t - o).num_milliseconds();
        format!("{:+.2} s", ms as f64 / 1e3)
    };
    let mut rows = vec![vec![
        "outage".to_string(),
        "step".into(),
        "lease expired".into(),
        "released (by, reason)".into(),
        "ready".into(),
        "next leased".into(),
        "next accepted (attempt, on)".into(),
        "recovery vs TTL".into(),
    ]];
    for r in recs {
        rows.push(vec![
            format!("{} {}", if r.paused { "pause" } else { "kill -9" }, r.slot),
            r.name.clone(),
            r.lease_expires_at
                .map(|e| rel(e, r.outage_at))
                .unwrap_or_else(|| "-".into()),
            r.released
                .as_ref()
                .map(|(at, to, why, by)| {
                    let why: String = why.split([':', ' ']).next().unwrap_or("").to_string();
                    format!("{} {to} ({by}, {why})", rel(*at, r.outage_at))
                })
                .unwrap_or_else(|| "-".into()),
            r.ready_backlog.to_string(),
            r.leased
                .as_ref()
                .map(|(at, _, _)| rel(*at, r.outage_at))
                .unwrap_or_else(|| "-".into()),
            r.accepted
                .as_ref()
                .map(|(at, a, by)| format!("{} (#{a}, {by})", rel(*at, r.outage_at)))
                .unwrap_or_else(|| "- (not re-run)".into()),
            r.recovery()
                .map(|d| vs_ttl(d, ttl))
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    table(&rows)
}

/// A plain aligned text table; the first row is the header.
pub fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut w = vec![0usize; cols];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut s = String::new();
    for (n, r) in rows.iter().enumerate() {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        let _ = writeln!(s, "  {}", line.join("  ").trim_end());
        if n == 0 {
            let _ = writeln!(
                s,
                "  {}",
                w.iter()
                    .map(|&x| "-".repeat(x))
                    .collect::<Vec<_>>()
                    .join("  ")
            );
        }
    }
    s
}

// ---------------------------------------------------------------------------
// leftover processes

/// A live process that belongs to a session: its cwd is an attempt directory
/// (`durable-…`) under `work_root`, or its environment carries the marker.
#[derive(Debug, Clone)]
pub struct Leftover {
    pub pid: i32,
    pub cwd: String,
    pub cmdline: String,
}

pub fn leftover_processes(marker: &str, work_root: &Path) -> Vec<Leftover> {
    let me = std::process::id() as i32;
    let needle = format!("{MARKER_ENV}={marker}");
    let root = work_root.to_string_lossy().into_owned();
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let cwd = std::fs::read_link(e.path().join("cwd"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let in_attempt_dir = cwd.starts_with(&root) && cwd.contains("durable-");
        let marked = std::fs::read(e.path().join("environ"))
            .map(|b| b.split(|&c| c == 0).any(|kv| kv == needle.as_bytes()))
            .unwrap_or(false);
        if in_attempt_dir || marked {
            let cmdline = std::fs::read(e.path().join("cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            found.push(Leftover { pid, cwd, cmdline });
        }
    }
    found
}

/// Waits up to `within` for the session's processes to disappear; returns
/// those that did not.
pub async fn wait_no_leftovers(marker: &str, work_root: &Path, within: Duration) -> Vec<Leftover> {
    let until = Instant::now() + within;
    loop {
        let left = leftover_processes(marker, work_root);
        if left.is_empty() || Instant::now() > until {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lines of `files` that contain `pattern`, with their file.
pub fn grep_logs(files: &[PathBuf], pattern: &str) -> Vec<String> {
    let mut out = Vec::new();
    for f in files {
        if let Ok(text) = std::fs::read_to_string(f) {
            for l in text.lines().filter(|l| l.contains(pattern)) {
                out.push(format!("{}: {l}", f.display()));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------
// the audit

#[derive(Debug, Clone)]
struct StepRow {
    id: Uuid,
    run_id: Uuid,
    name: String,
    state: String,
    kind: String,
    executor_kind: String,
    attempt: i32,
    input: Value,
    output: Option<Value>,
    idempotency_key: String,
    owner_worker_id: Option<Uuid>,
    error_code: Option<String>,
}

#[derive(Debug, Clone)]
struct TransitionRow {
    step_run_id: Option<Uuid>,
    run_id: Uuid,
    from_state: Option<String>,
    to_state: String,
    attempt: Option<i32>,
    worker: Option<String>,
    reason: Option<String>,
    at: DateTime<Utc>,
}

/// (run_id, name, depends_on) of a step definition.
type DefRow = (Uuid, String, Vec<String>);

#[derive(Debug, Clone)]
struct ArtifactRow {
    id: Uuid,
    step_run_id: Uuid,
    attempt: i32,
    name: String,
    sha256: String,
    size: i64,
    content: Vec<u8>,
}

/// What the audit needs besides the database.
#[derive(Debug, Default, Clone)]
pub struct AuditInput {
    /// Kill -9s and pauses (for "completed by a worker that was dead or frozen").
    pub outages: Vec<Outage>,
    /// The workers' lease TTL: a statement a worker sent just before it was
    /// killed or frozen may still be executed by the server afterwards (it
    /// does not know its client is gone, and may wait on a lock first), but a
    /// completion that lands more than a TTL later did not come from it.
    pub lease_ttl: Duration,
    /// When PostgreSQL was down (restarts): a lease cannot be renewed then,
    /// so one that expires across such a window lost nothing unexplained.
    pub db_outages: Vec<(DateTime<Utc>, DateTime<Utc>)>,
}

/// One demo.effect step whose effect happened more than once, legitimately.
#[derive(Debug, Clone)]
pub struct EffectRepeat {
    pub step: String,
    pub lines: usize,
    pub first_checkpoint_attempt: Option<i32>,
    pub attempts: Vec<i32>,
}

/// The audit's verdicts and counts.
#[derive(Debug, Default)]
pub struct Audit {
    pub failures: Vec<String>,
    pub runs_by_state: BTreeMap<String, usize>,
    pub steps_by_state: BTreeMap<String, usize>,
    pub steps_by_kind: BTreeMap<String, usize>,
    pub attempts: usize,
    /// Steps moved on because their lease expired.
    pub lease_expired: usize,
    /// Why attempts failed (code before the first ':'), counted.
    pub failure_reasons: BTreeMap<String, usize>,
    pub effect_steps: usize,
    pub effect_repeats: Vec<EffectRepeat>,
    pub artifacts_checked: usize,
    pub steps_total: usize,
    pub runs_total: usize,
    /// Attempts moved on by LEASE_EXPIRED although the worker holding them
    /// was neither killed nor paused meanwhile, and PostgreSQL was up
    /// (information, not asserted: a live worker
    /// lost a lease — a starved heartbeat, or a write that failed while
    /// PostgreSQL restarted and left the attempt unable to commit).
    pub expired_on_live_workers: Vec<String>,
    /// run id → final state, for the caller's own expectations.
    pub run_states: HashMap<Uuid, String>,
    /// step id → (run name, step name, compact history, completed by).
    pub histories: BTreeMap<Uuid, StepSummary>,
}

#[derive(Debug, Clone)]
pub struct StepSummary {
    pub run_id: Uuid,
    pub run_name: String,
    pub name: String,
    pub kind: String,
    pub executor_kind: String,
    pub state: String,
    pub attempts: i32,
    pub completed_by: Option<String>,
    pub history: String,
    pub error_code: Option<String>,
}

/// Reads everything back and checks the invariants that must hold whatever
/// the chaos was (every run terminal, legal histories, one completion by the
/// lease owner, no lost result, effects bounded by their checkpoints).
pub async fn audit(db: &Db, input: &AuditInput) -> Result<Audit> {
    let pool = db.pool();
    let mut a = Audit::default();
    let f = &mut a.failures;

    // --- the transition tables: the database's and state.rs's must agree
    let rules: BTreeSet<(String, String)> =
        sqlx::query_as("SELECT from_state, to_state FROM durable.step_transition_rules")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
    for from in StepState::ALL {
        for to in StepState::ALL {
            let db_says = rules.contains(&(from.as_str().to_owned(), to.as_str().to_owned()));
            if db_says != from.can_transition_to(to) {
                f.push(format!(
                    "transition {from} -> {to}: durable.step_transition_rules says {db_says}, supervisor::state says {}",
                    !db_says
                ));
            }
        }
    }
    let run_rules: BTreeSet<(String, String)> =
        sqlx::query_as("SELECT from_state, to_state FROM durable.run_transition_rules")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();

    // --- everything
    let runs: Vec<(Uuid, String, String, bool)> = sqlx::query_as(
        "SELECT id, name, state, cancel_requested FROM durable.workflow_runs ORDER BY created_at",
    )
    .fetch_all(pool)
    .await?;
    let run_names: HashMap<Uuid, String> = runs.iter().map(|r| (r.0, r.1.clone())).collect();
    let steps: Vec<StepRow> = sqlx::query(
        "SELECT id, run_id, name, state, kind, executor_kind, attempt, input, output, idempotency_key,
                owner_worker_id, error_code
           FROM durable.step_runs ORDER BY run_id, position",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| StepRow {
        id: r.get("id"),
        run_id: r.get("run_id"),
        name: r.get("name"),
        state: r.get("state"),
        kind: r.get("kind"),
        executor_kind: r.get("executor_kind"),
        attempt: r.get("attempt"),
        input: r.get("input"),
        output: r.get("output"),
        idempotency_key: r.get("idempotency_key"),
        owner_worker_id: r.get("owner_worker_id"),
        error_code: r.get("error_code"),
    })
    .collect();
    let transitions: Vec<TransitionRow> = sqlx::query(
        "SELECT step_run_id, run_id, from_state, to_state, attempt, worker, reason, at
           FROM durable.transitions ORDER BY id",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| TransitionRow {
        step_run_id: r.get("step_run_id"),
        run_id: r.get("run_id"),
        from_state: r.get("from_state"),
        to_state: r.get("to_state"),
        attempt: r.get("attempt"),
        worker: r.get("worker"),
        reason: r.get("reason"),
        at: r.get("at"),
    })
    .collect();
    let defs: Vec<DefRow> =
        sqlx::query_as("SELECT run_id, name, depends_on FROM durable.step_defs")
            .fetch_all(pool)
            .await?;
    let checkpoints: Vec<(Uuid, i32)> = sqlx::query_as(
        "SELECT step_run_id, min(attempt) FROM durable.step_events WHERE checkpoint GROUP BY 1",
    )
    .fetch_all(pool)
    .await?;
    let first_checkpoint: HashMap<Uuid, i32> = checkpoints.into_iter().collect();
    let succeeded_events: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT step_run_id, count(*) FROM durable.step_events WHERE kind = 'succeeded' GROUP BY 1",
    )
    .fetch_all(pool)
    .await?;
    let artifacts: Vec<ArtifactRow> = sqlx::query(
        "SELECT a.id, a.step_run_id, a.attempt, a.name, a.sha256, a.size, b.content
           FROM durable.artifacts a JOIN durable.artifact_blobs b ON b.sha256 = a.sha256",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| ArtifactRow {
        id: r.get("id"),
        step_run_id: r.get("step_run_id"),
        attempt: r.get("attempt"),
        name: r.get("name"),
        sha256: r.get("sha256"),
        size: r.get("size"),
        content: r.get("content"),
    })
    .collect();
    let lineage: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT artifact_id, derived_from_id FROM durable.artifact_lineage")
            .fetch_all(pool)
            .await?;
    let workers: Vec<(Uuid, String, DateTime<Utc>)> =
        sqlx::query_as("SELECT id, name, started_at FROM durable.workers")
            .fetch_all(pool)
            .await?;
    let workers: HashMap<Uuid, (String, DateTime<Utc>)> =
        workers.into_iter().map(|(i, n, s)| (i, (n, s))).collect();

    a.runs_total = runs.len();
    a.steps_total = steps.len();

    // --- runs: terminal, legal run history, succeeded runs complete
    let mut run_hist: HashMap<Uuid, Vec<&TransitionRow>> = HashMap::new();
    let mut step_hist: HashMap<Uuid, Vec<&TransitionRow>> = HashMap::new();
    for t in &transitions {
        match t.step_run_id {
            Some(s) => step_hist.entry(s).or_default().push(t),
            None => run_hist.entry(t.run_id).or_default().push(t),
        }
    }
    let steps_of_run: HashMap<Uuid, Vec<&StepRow>> =
        steps.iter().fold(HashMap::new(), |mut m, s| {
            m.entry(s.run_id).or_default().push(s);
            m
        });
    let defs_of_run: HashMap<Uuid, Vec<&DefRow>> = defs.iter().fold(HashMap::new(), |mut m, d| {
        m.entry(d.0).or_default().push(d);
        m
    });
    for (id, name, state, cancel) in &runs {
        *a.runs_by_state.entry(state.clone()).or_default() += 1;
        a.run_states.insert(*id, state.clone());
        if !matches!(state.as_str(), "succeeded" | "failed" | "cancelled") {
            let created = steps_of_run.get(id).cloned().unwrap_or_default();
            let open: Vec<String> = created
                .iter()
                .map(|s| format!("{}={}#{}", s.name, s.state, s.attempt))
                .collect();
            let never: Vec<String> = defs_of_run
                .get(id)
                .cloned()
                .unwrap_or_default()
                .iter()
                .filter(|d| !created.iter().any(|s| s.name == d.1))
                .map(|d| format!("{} (depends on {:?})", d.1, d.2))
                .collect();
            f.push(format!(
                "run {id} ({name}) is not terminal: {state}, cancel_requested {cancel}; steps {open:?}; never created: {never:?}"
            ));
        }
        let hist = run_hist.get(id).cloned().unwrap_or_default();
        check_chain(
            &format!("run {id} ({name})"),
            &hist,
            state,
            |from, to| run_rules.contains(&(from.to_owned(), to.to_owned())),
            f,
        );
        if state == "succeeded" {
            let created: BTreeMap<&str, &str> = steps_of_run
                .get(id)
                .map(|v| {
                    v.iter()
                        .map(|s| (s.name.as_str(), s.state.as_str()))
                        .collect()
                })
                .unwrap_or_default();
            for d in defs_of_run.get(id).cloned().unwrap_or_default() {
                if created.get(d.1.as_str()) != Some(&"succeeded") {
                    f.push(format!(
                        "run {id} ({name}) succeeded but its step {} is {:?}",
                        d.1,
                        created.get(d.1.as_str())
                    ));
                }
            }
        }
    }

    // --- steps
    let arts_of: HashMap<Uuid, Vec<&ArtifactRow>> =
        artifacts.iter().fold(HashMap::new(), |mut m, x| {
            m.entry(x.step_run_id).or_default().push(x);
            m
        });
    let succeeded_events: HashMap<Uuid, i64> = succeeded_events.into_iter().collect();
    let lineage_of: HashMap<Uuid, BTreeSet<Uuid>> =
        lineage.iter().fold(HashMap::new(), |mut m, (a, d)| {
            m.entry(*a).or_default().insert(*d);
            m
        });
    let by_name: HashMap<(Uuid, &str), &StepRow> = steps
        .iter()
        .map(|s| ((s.run_id, s.name.as_str()), s))
        .collect();
    let deps_of: HashMap<(Uuid, &str), &Vec<String>> =
        defs.iter().map(|d| ((d.0, d.1.as_str()), &d.2)).collect();
    let dead: Vec<&Outage> = input.outages.iter().collect();

    for s in &steps {
        let label = format!(
            "step {} ({}/{}, {} {})",
            s.id,
            run_names.get(&s.run_id).map(String::as_str).unwrap_or("?"),
            s.name,
            s.executor_kind,
            s.kind
        );
        *a.steps_by_state.entry(s.state.clone()).or_default() += 1;
        *a.steps_by_kind.entry(s.kind.clone()).or_default() += 1;
        let hist = step_hist.get(&s.id).cloned().unwrap_or_default();
        if !matches!(
            s.state.as_str(),
            "succeeded" | "terminal_failed" | "cancelled"
        ) {
            f.push(format!("{label} is not terminal: {}", s.state));
        }
        check_chain(
            &label,
            &hist,
            &s.state,
            |from, to| rules.contains(&(from.to_owned(), to.to_owned())),
            f,
        );

        // attempts, reasons
        let leased: Vec<&TransitionRow> = hist
            .iter()
            .copied()
            .filter(|t| t.to_state == "leased")
            .collect();
        let attempts: BTreeSet<i32> = leased.iter().filter_map(|t| t.attempt).collect();
        a.attempts += attempts.len();
        for w in leased.windows(2) {
            if w[1].attempt < w[0].attempt {
                f.push(format!(
                    "{label}: attempt numbers went backwards between leases ({:?} then {:?})",
                    w[0].attempt, w[1].attempt
                ));
            }
        }
        for (i, t) in hist.iter().enumerate() {
            let released = matches!(t.from_state.as_deref(), Some("leased" | "running"))
                && t.to_state != "running";
            if !released
                || !t
                    .reason
                    .as_deref()
                    .unwrap_or("")
                    .starts_with("LEASE_EXPIRED")
            {
                continue;
            }
            let Some(lease) = hist[..i].iter().rev().find(|x| x.to_state == "leased") else {
                continue;
            };
            let holder = lease.worker.clone().unwrap_or_default();
            let ttl = chrono::Duration::milliseconds(input.lease_ttl.as_millis() as i64);
            let outage = input
                .outages
                .iter()
                .any(|o| o.slot == holder && o.at >= lease.at - ttl && o.at <= t.at);
            // the database was down while the lease ran out (plus a TTL
            // for the pools to reconnect and the renewals to resume)
            let db_down = input
                .db_outages
                .iter()
                .any(|(from, to)| *from <= t.at && *to + ttl >= lease.at);
            if !outage && !db_down {
                a.expired_on_live_workers.push(format!(
                    "{label}: attempt {:?} leased to {holder} at {}, expired (reclaimed by {:?} at {}); history {}",
                    lease.attempt,
                    lease.at,
                    t.worker,
                    t.at,
                    compact_history(&hist)
                ));
            }
        }
        for t in hist
            .iter()
            .filter(|t| matches!(t.from_state.as_deref(), Some("leased" | "running")))
        {
            let reason = t.reason.clone().unwrap_or_default();
            let code = reason.split([':', ' ']).next().unwrap_or("").to_string();
            if !matches!(t.to_state.as_str(), "succeeded" | "running") {
                if code == "LEASE_EXPIRED" {
                    a.lease_expired += 1;
                }
                let from = t.from_state.as_deref().unwrap_or("");
                *a.failure_reasons
                    .entry(format!("{from}→{} {code}", t.to_state))
                    .or_default() += 1;
            }
        }

        // --- one completion, by the owner of the latest lease, while it was alive
        let successes: Vec<(usize, &TransitionRow)> = hist
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, t)| t.to_state == "succeeded")
            .collect();
        if successes.len() > 1 {
            f.push(format!(
                "{label} succeeded {} times: {:?}",
                successes.len(),
                successes
                    .iter()
                    .map(|(_, t)| (t.attempt, t.worker.clone(), t.at))
                    .collect::<Vec<_>>()
            ));
        }
        if let Some(n) = succeeded_events.get(&s.id).filter(|&&n| n > 1) {
            f.push(format!(
                "{label} has {n} `succeeded` events (one completion expected)"
            ));
        }
        let mut completed_by = None;
        if let Some((i, done)) = successes.first() {
            completed_by = done.worker.clone();
            let last_lease = hist[..*i].iter().rev().find(|t| t.to_state == "leased");
            match last_lease {
                None => f.push(format!("{label} succeeded without ever being leased")),
                Some(l) => {
                    if l.attempt != done.attempt {
                        f.push(format!(
                            "{label} succeeded as attempt {:?} but the latest lease was attempt {:?} (a stale attempt completed)",
                            done.attempt, l.attempt
                        ));
                    }
                    if l.worker != done.worker {
                        f.push(format!(
                            "{label} was completed by {:?} but attempt {:?} was leased to {:?}",
                            done.worker, l.attempt, l.worker
                        ));
                    }
                }
            }
            if done.attempt != Some(s.attempt) {
                f.push(format!(
                    "{label}: succeeded transition has attempt {:?}, the row says {}",
                    done.attempt, s.attempt
                ));
            }
            // the owning incarnation must have been alive (not killed, not frozen)
            if let Some(owner) = s.owner_worker_id {
                match workers.get(&owner) {
                    None => f.push(format!("{label}: owner worker {owner} is not registered")),
                    Some((wname, started)) => {
                        if Some(wname) != done.worker.as_ref() {
                            f.push(format!(
                                "{label}: owner worker {owner} is {wname:?} but {:?} completed it",
                                done.worker
                            ));
                        }
                        if done.at < *started {
                            f.push(format!("{label} completed at {} before its owner {owner} started at {started}", done.at));
                        }
                    }
                }
                let slack = chrono::Duration::milliseconds(input.lease_ttl.as_millis() as i64);
                for o in dead.iter().filter(|o| o.worker_id == Some(owner)) {
                    let frozen = match o.paused_until {
                        None => done.at > o.at + slack,
                        Some(until) => done.at > o.at + slack && done.at < until,
                    };
                    if frozen {
                        f.push(format!(
                            "{label} was completed at {} by incarnation {} of {} ({owner}), which was {} at {}",
                            done.at,
                            o.incarnation,
                            o.slot,
                            if o.paused_until.is_some() { "paused (SIGSTOP)" } else { "killed (-9)" },
                            o.at
                        ));
                    }
                }
            }
        }
        if s.state == "succeeded" && successes.is_empty() {
            f.push(format!(
                "{label} is succeeded but its history has no succeeded transition"
            ));
        }

        // --- results: nothing stored for steps that did not succeed; a
        // succeeded step has its output (and artifacts) of its final attempt
        let arts = arts_of.get(&s.id).cloned().unwrap_or_default();
        if s.state != "succeeded" {
            if !arts.is_empty() {
                f.push(format!(
                    "{label} is {} but has {} artifacts stored",
                    s.state,
                    arts.len()
                ));
            }
        } else {
            for x in &arts {
                if x.attempt != s.attempt {
                    f.push(format!(
                        "{label}: artifact {} is of attempt {}, the step succeeded as attempt {}",
                        x.name, x.attempt, s.attempt
                    ));
                }
                let sha = hex(&Sha256::digest(&x.content));
                if sha != x.sha256 || x.size != x.content.len() as i64 {
                    f.push(format!(
                        "{label}: artifact {} says sha256 {} size {} but its blob has {sha} / {}",
                        x.name,
                        x.sha256,
                        x.size,
                        x.content.len()
                    ));
                }
            }
            check_result(
                s,
                &label,
                &arts,
                &by_name,
                &deps_of,
                &arts_of,
                &lineage_of,
                f,
            );
            if s.kind == "demo.artifact" {
                a.artifacts_checked += 1;
            }
        }

        // --- demo.effect: the effect is keyed by the checkpoint
        if s.kind == "demo.effect" {
            a.effect_steps += 1;
            let sink = s.input.get("sink").and_then(Value::as_str).unwrap_or("");
            let text = std::fs::read_to_string(sink).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            if let Some(bad) = lines.iter().find(|l| **l != s.idempotency_key) {
                f.push(format!(
                    "{label}: sink {sink} has a line {bad:?} that is not the step's idempotency key {:?}",
                    s.idempotency_key
                ));
            }
            let first_cp = first_checkpoint.get(&s.id).copied();
            // An attempt performs the effect iff the job it was handed carries
            // no `effect-done` checkpoint. The checkpoint is stored (fenced by
            // the lease) in the same statement as its event, and the next
            // attempt is leased only after that attempt's lease is gone, so
            // every attempt after the first one that recorded a checkpoint
            // (attempt `first_cp`) was handed it and must skip the effect.
            // Attempts up to `first_cp` may each have performed it: a crash,
            // kill or freeze between the append and the stored checkpoint
            // (or a checkpoint write that failed while PostgreSQL restarted)
            // is an at-least-once re-execution the demo cannot detect.
            let may_perform = attempts
                .iter()
                .filter(|&&n| first_cp.is_none_or(|c| n <= c))
                .count();
            if lines.len() > may_perform {
                f.push(format!(
                    "{label}: the effect happened {} times but at most {may_perform} attempts ran without its checkpoint \
                     (first checkpoint by attempt {first_cp:?}; attempts {attempts:?}); sink {sink}",
                    lines.len()
                ));
            }
            if s.state == "succeeded" {
                if lines.is_empty() {
                    f.push(format!(
                        "{label} succeeded but its effect is not in the sink {sink}"
                    ));
                }
                let performed = s
                    .output
                    .as_ref()
                    .and_then(|o| o.get("effect_performed"))
                    .and_then(Value::as_bool);
                match (performed, first_cp) {
                    (Some(true), Some(c)) if c < s.attempt => f.push(format!(
                        "{label}: attempt {} performed the effect again although attempt {c} had checkpointed it",
                        s.attempt
                    )),
                    (Some(false), None) => f.push(format!(
                        "{label}: attempt {} skipped the effect but no checkpoint was ever recorded",
                        s.attempt
                    )),
                    (Some(false), Some(c)) if c >= s.attempt => f.push(format!(
                        "{label}: attempt {} skipped the effect but the first checkpoint is attempt {c}'s",
                        s.attempt
                    )),
                    _ => {}
                }
            }
            if lines.len() > 1 {
                a.effect_repeats.push(EffectRepeat {
                    step: label.clone(),
                    lines: lines.len(),
                    first_checkpoint_attempt: first_cp,
                    attempts: attempts.iter().copied().collect(),
                });
            }
        }

        a.histories.insert(
            s.id,
            StepSummary {
                run_id: s.run_id,
                run_name: run_names.get(&s.run_id).cloned().unwrap_or_default(),
                name: s.name.clone(),
                kind: s.kind.clone(),
                executor_kind: s.executor_kind.clone(),
                state: s.state.clone(),
                attempts: attempts.len() as i32,
                completed_by,
                history: compact_history(&hist),
                error_code: s.error_code.clone(),
            },
        );
    }
    Ok(a)
}

/// Checks a history: starts with NULL → pending, each row continues the
/// previous one, each pair is allowed, and it ends in the current state.
fn check_chain(
    label: &str,
    hist: &[&TransitionRow],
    state: &str,
    allowed: impl Fn(&str, &str) -> bool,
    f: &mut Vec<String>,
) {
    let summary = || {
        hist.iter()
            .map(|t| format!("{}→{}", t.from_state.as_deref().unwrap_or("∅"), t.to_state))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(first) = hist.first() else {
        f.push(format!("{label} has no history"));
        return;
    };
    if first.from_state.is_some() || first.to_state != "pending" {
        f.push(format!(
            "{label}: history does not start with ∅→pending: {}",
            summary()
        ));
    }
    for w in hist.windows(2) {
        let (prev, t) = (w[0], w[1]);
        let from = t.from_state.as_deref().unwrap_or("∅");
        if from != prev.to_state {
            f.push(format!(
                "{label}: history breaks: {}→{} followed by {from}→{} ({})",
                prev.from_state.as_deref().unwrap_or("∅"),
                prev.to_state,
                t.to_state,
                summary()
            ));
        }
        if !allowed(from, &t.to_state) {
            f.push(format!(
                "{label}: illegal transition {from}→{} (reason {:?}, by {:?}); history {}",
                t.to_state,
                t.reason,
                t.worker,
                summary()
            ));
        }
    }
    if let Some(last) = hist.last() {
        if last.to_state != state {
            f.push(format!(
                "{label}: history ends in {} but the row is {state}: {}",
                last.to_state,
                summary()
            ));
        }
    }
}

fn compact_history(hist: &[&TransitionRow]) -> String {
    hist.iter()
        .skip(1)
        .map(|t| {
            let who = t.worker.as_deref().unwrap_or("");
            let why = t.reason.as_deref().unwrap_or("");
            let code = why.split([':', ' ']).next().unwrap_or("");
            match t.to_state.as_str() {
                "leased" => format!("L#{}@{who}", t.attempt.unwrap_or(0)),
                "running" => "R".to_string(),
                "succeeded" => format!("S@{who}"),
                other => {
                    let tag = match other {
                        "retryable_failed" => "F",
                        "terminal_failed" => "T",
                        "cancelled" => "C",
                        o => o,
                    };
                    if who.is_empty() {
                        format!("{tag}({code})")
                    } else {
                        format!("{tag}({code}@{who})")
                    }
                }
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The output (and artifacts) of a succeeded demo step, from its input.
#[allow(clippy::too_many_arguments)]
fn check_result(
    s: &StepRow,
    label: &str,
    arts: &[&ArtifactRow],
    by_name: &HashMap<(Uuid, &str), &StepRow>,
    deps_of: &HashMap<(Uuid, &str), &Vec<String>>,
    arts_of: &HashMap<Uuid, Vec<&ArtifactRow>>,
    lineage_of: &HashMap<Uuid, BTreeSet<Uuid>>,
    f: &mut Vec<String>,
) {
    let Some(out) = &s.output else {
        f.push(format!("{label} succeeded without an output (lost result)"));
        return;
    };
    let int = |k: &str, d: i64| s.input.get(k).and_then(Value::as_i64).unwrap_or(d);
    match s.kind.as_str() {
        "demo.echo" if out != &s.input => {
            f.push(format!(
                "{label}: echo output {out} differs from its input {}",
                s.input
            ));
        }
        "demo.sleep" => {
            let want = json!({"slept_ms": int("ms", 1000)});
            if out != &want {
                f.push(format!("{label}: output {out}, expected {want}"));
            }
        }
        "demo.fail" => {
            let want = json!({"attempt": s.attempt});
            if out != &want {
                f.push(format!(
                    "{label}: output {out}, expected {want} (the final attempt)"
                ));
            }
            if let Some(n) = s.input.get("fail_attempts").and_then(Value::as_i64) {
                if i64::from(s.attempt) <= n {
                    f.push(format!(
                        "{label} succeeded on attempt {} although fail_attempts = {n}",
                        s.attempt
                    ));
                }
            } else {
                f.push(format!(
                    "{label}: a demo.fail without fail_attempts cannot succeed"
                ));
            }
        }
        "demo.artifact" => {
            let name = s
                .input
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("artifact.txt");
            let content = s.input.get("content").and_then(Value::as_str).unwrap_or("");
            let repeat = int("repeat", 1).max(0) as usize;
            // inputs: the dependencies' artifacts, in depends_on order, by name
            let mut expected = Vec::new();
            let mut derived = BTreeSet::new();
            for dep in deps_of
                .get(&(s.run_id, s.name.as_str()))
                .map(|v| v.as_slice())
                .unwrap_or(&[])
            {
                if let Some(d) = by_name.get(&(s.run_id, dep.as_str())) {
                    let mut da = arts_of.get(&d.id).cloned().unwrap_or_default();
                    da.sort_by(|x, y| x.name.cmp(&y.name));
                    for x in da {
                        expected.extend_from_slice(&x.content);
                        derived.insert(x.id);
                    }
                }
            }
            expected.extend_from_slice(content.repeat(repeat).as_bytes());
            let sha = hex(&Sha256::digest(&expected));
            match arts {
                [x] if x.name == name => {
                    if x.sha256 != sha || x.size != expected.len() as i64 || x.content != expected {
                        f.push(format!(
                            "{label}: artifact {name} has sha256 {} size {}, expected {sha} size {}",
                            x.sha256,
                            x.size,
                            expected.len()
                        ));
                    }
                    let got = lineage_of.get(&x.id).cloned().unwrap_or_default();
                    if got != derived {
                        f.push(format!(
                            "{label}: artifact {name} derives from {got:?}, expected {derived:?}"
                        ));
                    }
                }
                other => f.push(format!(
                    "{label}: expected one artifact {name:?}, found {:?} (lost result)",
                    other.iter().map(|x| x.name.as_str()).collect::<Vec<_>>()
                )),
            }
            let want = json!({"name": name, "size": expected.len(), "sha256": sha});
            if out != &want {
                f.push(format!("{label}: output {out}, expected {want}"));
            }
        }
        "demo.effect"
            if out
                .get("effect_performed")
                .and_then(Value::as_bool)
                .is_none() =>
        {
            f.push(format!("{label}: output {out} lacks effect_performed"));
        }
        _ => {}
    }
}

/// Up to `n` lock waits logged by the server (log_lock_waits), each with
/// the lines that follow it (DETAIL, CONTEXT, STATEMENT).
pub fn lock_wait_samples(log: &str, n: usize) -> Vec<String> {
    let lines: Vec<&str> = log.lines().collect();
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("still waiting for"))
        .take(n)
        .map(|(i, _)| lines[i..(i + 4).min(lines.len())].join("\n    "))
        .collect()
}

/// `deadlock detected` (and a count of lock waits) in a server log.
pub fn server_log_findings(log: &str) -> (Vec<String>, usize) {
    let deadlocks: Vec<String> = log
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("deadlock detected"))
        .map(|(i, _)| {
            // the error line and the DETAIL/CONTEXT lines after it
            log.lines()
                .skip(i)
                .take(8)
                .collect::<Vec<_>>()
                .join("\n    ")
        })
        .collect();
    let waits = log
        .lines()
        .filter(|l| l.contains("still waiting for"))
        .count();
    (deadlocks, waits)
}

/// "a=1 b=2".
pub fn counts<K: std::fmt::Display>(m: &BTreeMap<K, usize>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}
