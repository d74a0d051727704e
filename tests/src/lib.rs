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

pub mod bench;
pub mod blackhole;
pub mod chaos;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

pub fn init_tracing() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    // what the test prints (RUST_LOG, default warn) ...
    let shown = tracing_subscriber::fmt::layer()
        .with_test_writer()
        // colours only on a terminal (a benchmark's output redirected to a
        // file carried escape codes)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        );
    // ... and, whatever RUST_LOG says, the supervisor's own info and above,
    // kept in memory so a test can assert on what the worker logged
    let kept = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(|| LogCapture)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target("supervisor", tracing::Level::INFO),
        );
    let _ = tracing_subscriber::registry()
        .with(shown)
        .with(kept)
        .try_init();
}

/// Lines the supervisor logged in this test process (info and above), newest last.
static CAPTURED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
const CAPTURED_MAX: usize = 200_000;

struct LogCapture;

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let mut kept = CAPTURED.lock().unwrap_or_else(|p| p.into_inner());
        for line in text.lines().filter(|l| !l.is_empty()) {
            kept.push(line.to_owned());
        }
        if kept.len() > CAPTURED_MAX {
            let extra = kept.len() - CAPTURED_MAX;
            kept.drain(..extra);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The captured supervisor log lines (see [`init_tracing`]) that contain every
/// one of `needles`, e.g. a step_run_id and a message.
pub fn logged(needles: &[&str]) -> Vec<String> {
    CAPTURED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .cloned()
        .collect()
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

/// `admin` with its database name replaced by `name`.
pub fn db_url(admin: &str, name: &str) -> String {
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

    /// Holds `run`'s row (`FOR UPDATE`) in a transaction of its own, as an
    /// operator's open session would, until the transaction is ended.
    pub async fn hold_run(&self, run: Uuid) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.db.pool().begin().await.expect("begin");
        sqlx::query("SELECT 1 FROM durable.workflow_runs WHERE id = $1 FOR UPDATE")
            .bind(run)
            .execute(&mut *tx)
            .await
            .expect("hold the run's row");
        tx
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
    // a test: target/<profile>/deps/<test> -> target/<profile>/supervisor;
    // a benchmark binary: target/<profile>/<bench> -> target/<profile>/supervisor
    let mut dir = exe.parent().expect("target dir");
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().expect("target dir");
    }
    let bin = dir.join("supervisor");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build --workspace --bins`, done by scripts/test)",
        bin.display()
    );
    bin
}

// ---------------------------------------------------------------------------
// helpers for the end-to-end tests of the worker (S03-S05, misbehaviour)

/// The demo executors' languages, as `executor_kind`.
pub const LANGS: [&str; 2] = ["go", "python"];

/// The demo executor of `lang` ("go" or "python").
pub fn demo(
    lang: &str,
    name: &str,
    labels: &[(&str, &str)],
    kinds: Option<&[&str]>,
) -> ExecutorConfig {
    match lang {
        "go" => go_demo(name, labels, kinds),
        "python" => python_demo(name, labels, kinds),
        other => panic!("no demo executor for {other:?}"),
    }
}

/// Runs the executor through `/bin/sh -c SCRIPT`, where the script ends with
/// `exec "$0" "$@"` (the program and its arguments): the executor keeps the
/// shell's pid. `PATH` stays available (it is in the default allowlist).
pub fn wrap_in_shell(mut cfg: ExecutorConfig, script: &str) -> ExecutorConfig {
    let mut args = vec!["-c".to_string(), script.to_string(), cfg.command.clone()];
    args.append(&mut cfg.args);
    cfg.command = "/bin/sh".into();
    cfg.args = args;
    cfg
}

/// Serialises the tests of one test binary that run workers in this process.
/// Workers are independent (each reaps only its own children), but on a
/// two-core machine several workers with their executors at once make the
/// process tests' grace bounds a measure of CPU contention instead.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// One row of a step's transition history.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StepTransition {
    pub from_state: Option<String>,
    pub to_state: String,
    pub attempt: Option<i32>,
    pub worker: Option<String>,
    pub reason: Option<String>,
}

/// The transition history of one step, oldest first.
pub async fn step_transitions(db: &Db, step_run_id: Uuid) -> Vec<StepTransition> {
    sqlx::query_as::<_, StepTransition>(
        "SELECT from_state, to_state, attempt, worker, reason FROM durable.transitions
          WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(step_run_id)
    .fetch_all(db.pool())
    .await
    .expect("step transitions")
}

/// How many progress events a step has (all attempts).
/// A site constraint of the operator's (a trigger raising SQLSTATE 22023)
/// that refuses every success whose output has a `poison` key: a demo echo
/// of the input `{"poison": true}` is an outcome the database refuses for good.
pub async fn refuse_poisoned_successes(db: &Db) {
    sqlx::raw_sql(
        "CREATE FUNCTION public.poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.state = 'succeeded' AND NEW.output ? 'poison' THEN
                 RAISE EXCEPTION 'poisoned output refused by a site constraint' USING ERRCODE = '22023';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER poison BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.poison();",
    )
    .execute(db.pool())
    .await
    .expect("poison trigger");
}

pub async fn event_count(db: &Db, step_run_id: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durable.step_events WHERE step_run_id = $1")
        .bind(step_run_id)
        .fetch_one(db.pool())
        .await
        .expect("event count")
}

/// The step_run_id of the only step of a run, waiting until it exists.
pub async fn only_step_id(t: &TestDb, run: Uuid) -> Uuid {
    t.wait_run(run, Duration::from_secs(30), |s| !s.steps.is_empty())
        .await
        .steps[0]
        .step_run_id
}

/// The worker config as TOML, for `supervisor worker --config FILE`.
pub fn worker_toml(cfg: &WorkerConfig) -> String {
    toml::to_string(cfg).expect("worker config as TOML")
}

/// A `supervisor worker` process (the real binary) with `cfg`, logging to a file.
pub struct WorkerProcess {
    pub child: std::process::Child,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl WorkerProcess {
    pub fn spawn(url: &str, cfg: &WorkerConfig) -> WorkerProcess {
        Self::spawn_with(&[], url, cfg)
    }

    /// [`WorkerProcess::spawn`] under a wrapper that ends by exec'ing its
    /// arguments (like `nsenter --net=… --`), so the child is the worker.
    pub fn spawn_with(wrapper: &[String], url: &str, cfg: &WorkerConfig) -> WorkerProcess {
        Self::spawn_full(wrapper, url, cfg, &[], &[])
    }

    /// [`WorkerProcess::spawn`] with more arguments (`--log-format json`)
    /// and environment variables.
    pub fn spawn_args(
        url: &str,
        cfg: &WorkerConfig,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> WorkerProcess {
        Self::spawn_full(&[], url, cfg, args, env)
    }

    fn spawn_full(
        wrapper: &[String],
        url: &str,
        cfg: &WorkerConfig,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> WorkerProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg_path = dir.path().join("worker.toml");
        std::fs::write(&cfg_path, toml::to_string(cfg).expect("config to TOML"))
            .expect("write config");
        let log = dir.path().join("worker.log");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = std::process::Command::new(program);
                c.args(args).arg(supervisor_bin());
                c
            }
            None => std::process::Command::new(supervisor_bin()),
        };
        let child = cmd
            .args(["worker", "--config"])
            .arg(&cfg_path)
            .args(args)
            .envs(env.iter().copied())
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "info")
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::File::create(dir.path().join("worker.err")).expect("log"))
            .spawn()
            .expect("spawn supervisor worker");
        WorkerProcess {
            child,
            log,
            _dir: dir,
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig)
            .expect("signal worker");
    }

    /// Waits for the process to exit (bounded) and returns its exit code.
    pub async fn wait(&mut self, within: Duration) -> Option<i32> {
        let until = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(
                std::time::Instant::now() < until,
                "worker did not exit within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("worker.err")).unwrap_or_default()
    }

    /// The worker's stderr (its log) as JSON lines (`--log-format json`);
    /// panics on a line that is not a JSON object.
    pub fn json_log(&self) -> Vec<Value> {
        self.stderr()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str::<Value>(l)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| panic!("a log line that is not a JSON object: {l}"))
            })
            .collect()
    }

    /// The address of `/metrics` (logged as the server starts; `metrics_addr`
    /// may give port 0), waiting for it; needs `--log-format json`.
    pub async fn metrics_addr(&self, within: Duration) -> std::net::SocketAddr {
        let until = std::time::Instant::now() + within;
        loop {
            let found = self.stderr().lines().find_map(|l| {
                let v: Value = serde_json::from_str(l).ok()?;
                (v["fields"]["message"] == "serving /metrics, /healthz and /readyz")
                    .then(|| v["fields"]["addr"].as_str()?.parse().ok())
                    .flatten()
            });
            if let Some(addr) = found {
                return addr;
            }
            assert!(
                std::time::Instant::now() < until,
                "the worker did not serve metrics within {within:?}: {}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One HTTP/1.1 GET to a local address: the status and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let go = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\n\r\n").as_bytes(),
        )
        .await
        .expect("send");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.expect("read");
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("a status code");
        (status, body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .expect("the HTTP answer within 10 s")
}

/// The value of one series in a Prometheus text exposition: `name{labels}`
/// exactly as printed (labels in their order), or a bare name.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Defines, for each named `async fn name(lang: &str)`, a module with one
/// test per demo executor language (`name::go`, `name::python`).
#[macro_export]
macro_rules! for_each_lang {
    ($($name:ident),* $(,)?) => { $(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn go() {
                super::$name("go").await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python() {
                super::$name("python").await
            }
        }
    )* };
}

/// The route of the queue-only tests: executor_kind "go", kind "k", no labels.
pub fn route_go_k() -> Vec<supervisor::db::Route> {
    vec![supervisor::db::Route {
        executor_kind: "go".into(),
        kind: "k".into(),
        labels: Default::default(),
    }]
}

/// An `accepted` event with sequence 1, as an executor's first.
pub fn accepted_event() -> supervisor::db::NewEvent<'static> {
    supervisor::db::NewEvent {
        sequence: 1,
        kind: "accepted",
        message: "",
        fraction: None,
        checkpoint: None,
        executor_at: None,
    }
}

/// An attempt's failure with code `X`, message `x`, no retry delay: what the
/// database-level tests report when only the failure's retryability matters.
pub fn failure_x(retryable: bool) -> supervisor::db::FailureReport {
    supervisor::db::FailureReport {
        failure: supervisor::state::Failure {
            code: "X".into(),
            retryable,
            next_retry_delay: None,
        },
        message: "x".into(),
        details: None,
        sequence: None,
    }
}

/// `supervisor submit - --json` with `text` on its stdin.
/// The `supervisor` binary with a clean environment as far as the runtime
/// goes: no database URL and no `DURABLE_*` variable (a caller sets what it
/// needs), `RUST_LOG` at `log`, stdin empty.
pub fn supervisor_clean(log: &str) -> std::process::Command {
    let mut c = std::process::Command::new(supervisor_bin());
    c.env_remove("DATABASE_URL")
        .env("RUST_LOG", log)
        .stdin(std::process::Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("DURABLE_") {
            c.env_remove(k);
        }
    }
    c
}

pub fn submit_stdin(url: &str, text: &str) -> std::process::Output {
    use std::io::Write;
    let mut child = std::process::Command::new(supervisor_bin())
        .args(["submit", "-", "--json"])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn supervisor");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write spec");
    child.wait_with_output().expect("supervisor submit")
}

/// The hostile executor (`tests/executors/hostile.py`: its modes are the
/// kinds `hostile.<mode>`), with its spawn log and environment.
pub fn hostile(
    name: &str,
    spawn_log: Option<&std::path::PathBuf>,
    env: &[(&str, &str)],
) -> ExecutorConfig {
    let mut e = std::collections::BTreeMap::new();
    if let Some(p) = spawn_log {
        e.insert(
            "HOSTILE_SPAWN_LOG".to_string(),
            p.to_string_lossy().into_owned(),
        );
    }
    for (k, v) in env {
        e.insert(k.to_string(), v.to_string());
    }
    ExecutorConfig {
        name: name.into(),
        command: python().to_string_lossy().into_owned(),
        args: vec![repo_root()
            .join("tests/executors/hostile.py")
            .to_string_lossy()
            .into_owned()],
        env: e,
        concurrency: 4,
        ..ExecutorConfig::default()
    }
}

/// A worker config running `e`, which may hand out the secret `API_TOKEN`
/// = `value`, read from a `secrets_dir` (the directory returned: keep it
/// while the worker runs).
pub fn with_api_token(mut e: ExecutorConfig, value: &str) -> (tempfile::TempDir, WorkerConfig) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("API_TOKEN"), format!("{value}\n")).expect("secret file");
    e.secrets = vec!["API_TOKEN".into()];
    let mut cfg = fast_config(vec![e]);
    cfg.secrets_dir = Some(dir.path().to_owned());
    (dir, cfg)
}
