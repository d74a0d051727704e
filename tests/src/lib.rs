//! Test harness: a fresh database per test, the demo executors, an in-process
//! worker, and /proc scans that prove no child process survives.
//!
//! Needs `DATABASE_URL` naming a PostgreSQL server where the user may create
//! databases; `scripts/test` starts a throwaway cluster when it is unset.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use supervisor::config::{ExecutorConfig, WorkerConfig};
use supervisor::db::{Db, RunStatus};
use supervisor::worker::Worker;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use supervisor;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A database of its own for one test. Test databases (`t_*`) are left for
/// `scripts/test` to drop before the next run: dropping them from `Drop` would
/// block the test's runtime on its own sockets.
pub struct TestDb {
    pub db: Db,
    pub url: String,
    pub name: String,
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests through scripts/test, which starts a throwaway PostgreSQL",
    )
}

fn db_url(admin: &str, name: &str) -> String {
    // replace the path (database name) of the URL, keep the query
    let (base, query) = match admin.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..]
        .find('/')
        .map(|i| i + scheme_end)
        .unwrap_or(base.len());
    let mut url = format!("{}/{}", &base[..path_start], name);
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    url
}

impl TestDb {
    pub async fn new() -> TestDb {
        init_tracing();
        let admin = admin_url();
        let name = format!("t_{}", Uuid::new_v4().simple());
        let root = Db::connect(&admin, 1)
            .await
            .expect("connect to DATABASE_URL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(root.pool())
            .await
            .expect("create test database");
        root.pool().close().await;
        let url = db_url(&admin, &name);
        let db = Db::connect(&url, 20)
            .await
            .expect("connect to the test database");
        db.migrate().await.expect("migrate");
        TestDb { db, url, name }
    }

    /// Another pool on the same database (a separate "worker host").
    pub async fn connect(&self, conns: u32) -> Db {
        Db::connect(&self.url, conns).await.expect("connect")
    }

    pub async fn submit(&self, spec: Value) -> Uuid {
        self.db.submit(&spec).await.expect("submit")
    }

    pub async fn status(&self, run: Uuid) -> RunStatus {
        self.db.status(run).await.expect("status")
    }

    /// Polls until `pred` holds for the run's status, or panics after `timeout`.
    pub async fn wait_run(
        &self,
        run: Uuid,
        timeout: Duration,
        pred: impl Fn(&RunStatus) -> bool,
    ) -> RunStatus {
        let until = std::time::Instant::now() + timeout;
        loop {
            let st = self.status(run).await;
            if pred(&st) {
                return st;
            }
            if std::time::Instant::now() > until {
                panic!(
                    "timed out after {timeout:?} waiting on run {run}; last status: {}",
                    serde_json::to_string_pretty(&st).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    pub async fn wait_terminal(&self, run: Uuid, timeout: Duration) -> RunStatus {
        self.wait_run(run, timeout, |s| {
            matches!(s.state.as_str(), "succeeded" | "failed" | "cancelled")
        })
        .await
    }

    pub async fn scalar_i64(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(self.db.pool())
            .await
            .expect(sql)
    }
}

/// The Go demo executor, built once per test process (go build is cached).
pub fn go_executor() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = repo_root();
            let out = root.join("target/executors/demo-executor-go");
            let status = std::process::Command::new("go")
                .args(["build", "-o"])
                .arg(&out)
                .arg("./cmd/demo-executor")
                .current_dir(root.join("executors-go"))
                .status()
                .expect("run go build (is Go installed?)");
            assert!(status.success(), "go build of the demo executor failed");
            out
        })
        .clone()
}

/// The Python interpreter of the repository's virtual environment.
pub fn python() -> PathBuf {
    let p = repo_root().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup (creates .venv with the Python SDK)",
        p.display()
    );
    p
}

/// An executor config for the Go demo, with `labels` offered through DEMO_LABELS.
pub fn go_demo(name: &str, labels: &[(&str, &str)], kinds: Option<&[&str]>) -> ExecutorConfig {
    demo_config(name, go_executor(), vec![], labels, kinds)
}

/// An executor config for the Python demo.
pub fn python_demo(name: &str, labels: &[(&str, &str)], kinds: Option<&[&str]>) -> ExecutorConfig {
    let script = repo_root().join("executors-python/demo_executor.py");
    demo_config(
        name,
        python(),
        vec![script.to_string_lossy().into_owned()],
        labels,
        kinds,
    )
}

fn demo_config(
    name: &str,
    program: PathBuf,
    args: Vec<String>,
    labels: &[(&str, &str)],
    kinds: Option<&[&str]>,
) -> ExecutorConfig {
    let mut env = BTreeMap::new();
    if !labels.is_empty() {
        env.insert(
            "DEMO_LABELS".to_string(),
            labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    if let Some(kinds) = kinds {
        env.insert("DEMO_KINDS".to_string(), kinds.join(","));
    }
    ExecutorConfig {
        name: name.into(),
        command: program.to_string_lossy().into_owned(),
        args,
        env,
        concurrency: 4,
        ..ExecutorConfig::default()
    }
}

/// Worker settings fit for tests: short leases and graces.
pub fn fast_config(executors: Vec<ExecutorConfig>) -> WorkerConfig {
    WorkerConfig {
        lease_ttl_ms: 2_000,
        heartbeat_interval_ms: 300,
        poll_interval_ms: 100,
        reclaim_interval_ms: 200,
        cancel_grace_ms: 500,
        term_grace_ms: 500,
        drain_timeout_ms: 5_000,
        handshake_timeout_ms: 10_000,
        refusal_delay_ms: 200,
        executors,
        ..WorkerConfig::default()
    }
}

/// A worker running in this process.
pub struct RunningWorker {
    pub id: Uuid,
    pub stop: CancellationToken,
    pub handle: JoinHandle<()>,
}

impl RunningWorker {
    pub async fn start(db: Db, cfg: WorkerConfig) -> RunningWorker {
        let worker = Worker::start(db, cfg).await.expect("worker start");
        let id = worker.id();
        let stop = CancellationToken::new();
        let s = stop.clone();
        let handle = tokio::spawn(async move {
            worker.run(s).await.expect("worker run");
        });
        RunningWorker { id, stop, handle }
    }

    /// Drains and waits for the worker to stop.
    pub async fn shutdown(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("worker drained within 30 s")
            .expect("worker task");
    }
}

/// Every live process whose working directory is an attempt directory of
/// `step_run_id` (the supervisor names them `durable-<step_run_id>-…`), and
/// every member of `pgid` if given. Zombies count as alive.
pub fn attempt_processes(step_run_id: Uuid, pgid: Option<i32>) -> Vec<i32> {
    let needle = format!("durable-{step_run_id}-");
    let mut pids = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) {
                if cwd.to_string_lossy().contains(&needle) {
                    pids.push(pid);
                }
            }
        }
    }
    if let Some(g) = pgid {
        pids.extend(supervisor::process::group_members(g));
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Waits (bounded) until no process of the attempt or group is alive.
pub async fn assert_no_survivors(step_run_id: Uuid, pgid: Option<i32>, within: Duration) {
    let until = std::time::Instant::now() + within;
    loop {
        let alive = attempt_processes(step_run_id, pgid);
        if alive.is_empty() {
            return;
        }
        if std::time::Instant::now() > until {
            let desc: Vec<String> = alive
                .iter()
                .map(|p| {
                    let cmd = std::fs::read(format!("/proc/{p}/cmdline"))
                        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                        .unwrap_or_default();
                    format!("{p}: {cmd}")
                })
                .collect();
            panic!("processes of step {step_run_id} survived: {desc:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The executor pid the worker recorded when the attempt started.
pub async fn executor_pid(db: &Db, step_run_id: Uuid) -> Option<i32> {
    sqlx::query_scalar::<_, Option<i32>>("SELECT executor_pid FROM durable.step_runs WHERE id = $1")
        .bind(step_run_id)
        .fetch_one(db.pool())
        .await
        .expect("executor_pid")
}

/// A one-step spec.
pub fn one_step(name: &str, executor_kind: &str, kind: &str, input: Value) -> Value {
    serde_json::json!({
        "name": name,
        "steps": [{"name": "s", "executor_kind": executor_kind, "kind": kind, "input": input}]
    })
}

/// The step named `name` of a status.
pub fn step<'a>(st: &'a RunStatus, name: &str) -> &'a supervisor::db::StepStatus {
    st.steps.iter().find(|s| s.name == name).unwrap_or_else(|| {
        panic!(
            "no step {name} in {}",
            serde_json::to_string(st).unwrap_or_default()
        )
    })
}

/// The `supervisor` binary of this build (scripts/test builds it first).
pub fn supervisor_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test> -> target/<profile>/supervisor
    let dir = exe.parent().and_then(|p| p.parent()).expect("target dir");
    let bin = dir.join("supervisor");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build --workspace --bins`, done by scripts/test)",
        bin.display()
    );
    bin
}
