//! The worker configuration (TOML). `supervisor dev --print-config` prints a
//! complete one for the bundled demo executors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the worker config {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid worker config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid worker config: {0}")]
    Invalid(String),
    #[error("invalid environment variable {var}: {message}")]
    Env { var: String, message: String },
}

impl ConfigError {
    /// The error with every URL's password masked: a message quotes the
    /// value it is about, and a database URL put in the wrong key or
    /// variable (`metrics_addr`, `DURABLE_WORK_DIR`) was printed with its
    /// password (re-check audit).
    fn without_passwords(self) -> ConfigError {
        match self {
            ConfigError::Parse { path, message } => ConfigError::Parse {
                path,
                message: mask_url_passwords(&message),
            },
            ConfigError::Invalid(m) => ConfigError::Invalid(mask_url_passwords(&m)),
            ConfigError::Env { var, message } => ConfigError::Env {
                var,
                message: mask_url_passwords(&message),
            },
            read @ ConfigError::Read { .. } => read,
        }
    }
}

/// `text` with the password of every `scheme://user:password@` in it as
/// `***`.
fn mask_url_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // the authority ends at the first character no URL has there
        let end = tail
            .find(|c: char| c.is_whitespace() || "\"'`/?#,;)".contains(c))
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match (authority.rfind('@'), authority.find(':')) {
            (Some(at), Some(colon)) if colon < at => {
                out.push_str(&authority[..colon]);
                out.push_str(":***");
                out.push_str(&authority[at..]);
            }
            _ => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn d_lease_ttl() -> u64 {
    10_000
}
fn d_heartbeat() -> u64 {
    2_000
}
fn d_poll() -> u64 {
    1_000
}
fn d_reclaim() -> u64 {
    1_000
}
fn d_cancel_grace() -> u64 {
    2_000
}
fn d_term_grace() -> u64 {
    2_000
}
fn d_drain() -> u64 {
    30_000
}
fn d_handshake() -> u64 {
    10_000
}
fn d_max_frame() -> usize {
    crate::wire::DEFAULT_MAX_FRAME_BYTES
}
fn d_stderr_tail() -> usize {
    64 * 1024
}
fn d_max_artifact() -> u64 {
    4 * 1024 * 1024 * 1024
}
fn d_artifact_chunk() -> usize {
    1024 * 1024
}
fn d_db_conns() -> u32 {
    10
}
fn d_refusal_delay() -> u64 {
    1_000
}
fn d_max_refusals() -> u32 {
    5
}
fn d_max_result() -> u64 {
    16 * 1024 * 1024 * 1024
}
fn d_stderr_log_rate() -> u32 {
    20
}
fn d_concurrency() -> u32 {
    4
}
fn d_retention() -> String {
    "7d".into()
}
fn d_retention_interval() -> u64 {
    60_000
}
fn d_retention_batch_runs() -> u32 {
    100
}
fn d_retention_batch_steps() -> u32 {
    1_000
}
fn d_true() -> bool {
    true
}
fn d_allowlist() -> Vec<String> {
    ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// `supervisor worker --config FILE`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Overridden by `--database-url` and by `DATABASE_URL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
    /// A readable name for logs and the transition history (default: host:pid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// How long a lease lasts without renewal (seconds, not hours: a crashed
    /// worker's steps are reclaimed quickly).
    #[serde(default = "d_lease_ttl")]
    pub lease_ttl_ms: u64,
    /// How often the one batched heartbeat statement renews all leases.
    #[serde(default = "d_heartbeat")]
    pub heartbeat_interval_ms: u64,
    /// Polling fallback when no NOTIFY arrives.
    #[serde(default = "d_poll")]
    pub poll_interval_ms: u64,
    /// How often expired leases are looked for.
    #[serde(default = "d_reclaim")]
    pub reclaim_interval_ms: u64,
    /// After a cancel frame, how long to wait for the terminal before SIGTERM.
    #[serde(default = "d_cancel_grace")]
    pub cancel_grace_ms: u64,
    /// After SIGTERM, how long before SIGKILL.
    #[serde(default = "d_term_grace")]
    pub term_grace_ms: u64,
    /// On SIGTERM/SIGINT: how long running attempts may finish before they are stopped.
    #[serde(default = "d_drain")]
    pub drain_timeout_ms: u64,
    /// How long an executor has to say hello.
    #[serde(default = "d_handshake")]
    pub handshake_timeout_ms: u64,
    #[serde(default = "d_max_frame")]
    pub max_frame_bytes: usize,
    /// The largest artifact accepted (streamed to the artifact store, never
    /// held in memory: a limit on storage, not on the worker's RSS).
    #[serde(default = "d_max_artifact")]
    pub max_artifact_bytes: u64,
    /// How much of each child's stderr is kept (the tail) for failures.
    #[serde(default = "d_stderr_tail")]
    pub stderr_tail_bytes: usize,
    #[serde(default = "d_db_conns")]
    pub db_max_connections: u32,
    /// Delay before a refused step can be leased again.
    #[serde(default = "d_refusal_delay")]
    pub refusal_delay_ms: u64,
    /// How many times a step may be refused (handed back without running)
    /// before it fails `terminal_failed` with `EXECUTOR_REFUSED`.
    #[serde(default = "d_max_refusals")]
    pub max_refusals: u32,
    /// The most bytes all artifacts of one result may hold together.
    #[serde(default = "d_max_result")]
    pub max_result_bytes: u64,
    /// Where artifact bytes go: `postgres` (chunks in the database; works
    /// across hosts with no other service) or `directory` (files in
    /// `artifact_dir`, a volume every worker host mounts).
    #[serde(default)]
    pub artifact_store: ArtifactBackend,
    /// The shared directory of the `directory` store. A `postgres` worker
    /// with it set can also read blobs that `directory` workers stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_dir: Option<PathBuf>,
    /// Bytes per chunk, up and down (one database row of the `postgres`
    /// store; one read of a file): what an artifact costs in memory.
    #[serde(default = "d_artifact_chunk")]
    pub artifact_chunk_bytes: usize,
    /// Where per-attempt working directories are created (default: the system temp dir).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_dir: Option<PathBuf>,
    /// Where secret values are read from: the file `<secrets_dir>/<NAME>` (one
    /// trailing newline stripped, as Docker and Kubernetes mount secrets).
    /// Unset: from the worker's environment. Which names an executor may
    /// receive at all is its `secrets` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_dir: Option<PathBuf>,
    /// Where `/metrics` (Prometheus), `/healthz` and `/readyz` are served,
    /// as `IP:PORT` (port 0: any free port, logged). Unset: not served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
    /// How many stderr lines of one attempt's executor are logged per second
    /// (in the attempt's span, redacted); the rest are counted and reported
    /// as suppressed. 0: none are logged (the tail is still kept).
    #[serde(default = "d_stderr_log_rate")]
    pub stderr_log_lines_per_sec: u32,
    /// Finished runs older than this are removed with everything they hold
    /// (`30s`, `10m`, `2h`, `7d`, `1h30m`), or `off`.
    #[serde(default = "d_retention")]
    pub retention: String,
    /// How often this worker's retention pass looks for old runs.
    #[serde(default = "d_retention_interval")]
    pub retention_interval_ms: u64,
    /// At most this many runs are removed per transaction.
    #[serde(default = "d_retention_batch_runs")]
    pub retention_batch_runs: u32,
    /// At most this many steps are removed per transaction.
    #[serde(default = "d_retention_batch_steps")]
    pub retention_batch_steps: u32,
    /// VACUUM the durable tables after a pass that removed anything.
    #[serde(default = "d_true")]
    pub retention_vacuum: bool,
    #[serde(default)]
    pub executors: Vec<ExecutorConfig>,
}

/// The artifact store's backend (`artifact_store`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArtifactBackend {
    /// Chunks in `durable.artifact_chunks` (the default).
    #[default]
    Postgres,
    /// Content-addressed files in `artifact_dir`.
    Directory,
}

/// The smallest and largest `artifact_chunk_bytes`.
pub const MIN_ARTIFACT_CHUNK_BYTES: usize = 4 * 1024;
pub const MAX_ARTIFACT_CHUNK_BYTES: usize = 64 * 1024 * 1024;

/// One executor: a plain binary or script speaking the executor protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorConfig {
    pub name: String,
    /// The program. A relative path with a `/` is resolved against the
    /// worker's working directory at load time; a bare name is looked up in PATH.
    pub command: String,
    /// Passed verbatim. The child runs in a fresh per-attempt directory, so
    /// give file arguments as absolute paths.
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables copied from the worker's environment (the rest is cleared).
    #[serde(default = "d_allowlist")]
    pub env_allowlist: Vec<String>,
    /// Variables set explicitly.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The secrets a step run by this executor may receive, by name (default:
    /// none). A step naming any other fails before spawn with
    /// `SECRET_NOT_ALLOWED`; values come from `secrets_dir` or the worker's
    /// environment.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Host capabilities this worker adds to the executor's own hello labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Restricts the kinds leased for this executor (default: all it offers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kinds: Option<Vec<String>>,
    /// Attempts run at once with this executor.
    #[serde(default = "d_concurrency")]
    pub concurrency: u32,
    /// Keep processes warm between jobs (persistent executors, as Bazel's
    /// persistent workers): a process serves jobs one at a time until it has
    /// served `max_jobs_per_process` (the smaller of its hello's and this
    /// setting), breaks the protocol, or does not end a cancelled job within
    /// its grace; then it is replaced. Default: one process per job.
    #[serde(default)]
    pub persistent: bool,
    /// Caps the jobs one persistent process serves (default, or -1: what its
    /// hello says).
    #[serde(
        default,
        deserialize_with = "jobs_cap",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_jobs_per_process: Option<u32>,
    /// Persistent executors: processes kept started and handshaken ahead of
    /// jobs, at most `concurrency`. The worker starts them when it starts and
    /// replaces each one that is retired or killed, so no job (the first ones
    /// included) waits for a process start while fewer are busy. 0: processes
    /// start when a job needs one.
    #[serde(default)]
    pub warm_processes: u32,
    /// Persistent executors: an idle process beyond `warm_processes` is
    /// retired after this long without a job, so a burst does not leave
    /// `concurrency` processes running for ever. 0: idle processes are kept.
    #[serde(default = "d_idle_timeout")]
    pub idle_timeout_ms: u64,
}

fn d_idle_timeout() -> u64 {
    60_000
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            database_url: None,
            name: None,
            lease_ttl_ms: d_lease_ttl(),
            heartbeat_interval_ms: d_heartbeat(),
            poll_interval_ms: d_poll(),
            reclaim_interval_ms: d_reclaim(),
            cancel_grace_ms: d_cancel_grace(),
            term_grace_ms: d_term_grace(),
            drain_timeout_ms: d_drain(),
            handshake_timeout_ms: d_handshake(),
            max_frame_bytes: d_max_frame(),
            max_artifact_bytes: d_max_artifact(),
            stderr_tail_bytes: d_stderr_tail(),
            db_max_connections: d_db_conns(),
            refusal_delay_ms: d_refusal_delay(),
            max_refusals: d_max_refusals(),
            max_result_bytes: d_max_result(),
            artifact_store: ArtifactBackend::default(),
            artifact_dir: None,
            artifact_chunk_bytes: d_artifact_chunk(),
            work_dir: None,
            secrets_dir: None,
            metrics_addr: None,
            stderr_log_lines_per_sec: d_stderr_log_rate(),
            retention: d_retention(),
            retention_interval_ms: d_retention_interval(),
            retention_batch_runs: d_retention_batch_runs(),
            retention_batch_steps: d_retention_batch_steps(),
            retention_vacuum: true,
            executors: Vec::new(),
        }
    }
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            name: String::new(),
            command: String::new(),
            args: Vec::new(),
            env_allowlist: d_allowlist(),
            env: BTreeMap::new(),
            secrets: Vec::new(),
            labels: BTreeMap::new(),
            kinds: None,
            concurrency: d_concurrency(),
            persistent: false,
            max_jobs_per_process: None,
            warm_processes: 0,
            idle_timeout_ms: d_idle_timeout(),
        }
    }
}

impl WorkerConfig {
    /// Where attempt, session and job directories are made: `work_dir`, or
    /// the system's temporary directory.
    pub fn work_base(&self) -> PathBuf {
        self.work_dir.clone().unwrap_or_else(std::env::temp_dir)
    }
}

impl ExecutorConfig {
    /// A note for a failed start whose args name a file by a relative path:
    /// args are handed over as they are, and the child runs in a directory
    /// of its own, where such a path names nothing (new-user audit: only
    /// "can't open file '/tmp/durable-probe-…/pyexec/x.py'"). Only an arg
    /// that is a file where the supervisor runs counts: one that merely
    /// holds a slash ("application/json") is not a path. Empty when there
    /// is none. The worker's probe and `conformance` add it to their errors.
    pub fn relative_args_note(&self) -> String {
        self.args
            .iter()
            .find(|a| !a.starts_with('/') && !a.starts_with('-') && Path::new(a).exists())
            .map(|a| {
                format!(
                    " (note: its args are passed as they are and it runs in a directory of its own, \
                     where a relative path such as {a:?} names nothing: give an absolute path)"
                )
            })
            .unwrap_or_default()
    }

    /// How to start this executor in `cwd`.
    pub fn spawn_spec(&self, cwd: &Path, stderr_tail_bytes: usize) -> crate::process::SpawnSpec {
        crate::process::SpawnSpec {
            program: PathBuf::from(&self.command),
            args: self.args.clone(),
            cwd: cwd.to_owned(),
            env: self
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            env_allowlist: self.env_allowlist.clone(),
            stderr_tail_bytes,
        }
    }
}

impl WorkerConfig {
    /// The executors' total concurrency.
    pub fn total_concurrency(&self) -> u32 {
        self.executors
            .iter()
            .fold(0u32, |n, e| n.saturating_add(e.concurrency))
    }

    /// The smallest `db_max_connections` this config is valid with: one
    /// connection per concurrent attempt (its artifacts) plus one for leasing.
    pub fn min_db_connections(&self) -> u32 {
        self.total_concurrency().saturating_add(1)
    }

    /// Settings that are valid but do nothing here, each as a sentence for a
    /// warning at start: a persistent executor's settings on a one-shot one
    /// (`warm_processes` there is an error: it would promise warm processes).
    pub fn ignored_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in self.executors.iter().filter(|e| !e.persistent) {
            let mut keys = Vec::new();
            if let Some(n) = e.max_jobs_per_process {
                keys.push(format!("max_jobs_per_process = {n}"));
            }
            if e.idle_timeout_ms != d_idle_timeout() {
                keys.push(format!("idle_timeout_ms = {}", e.idle_timeout_ms));
            }
            if !keys.is_empty() {
                out.push(format!(
                    "executor {:?}: {} {} no effect, as the executor is one-shot (persistent = false: a process serves one job); set persistent = true to keep processes between jobs, or remove {}",
                    e.name,
                    keys.join(" and "),
                    if keys.len() == 1 { "has" } else { "have" },
                    if keys.len() == 1 { "it" } else { "them" },
                ));
            }
        }
        out
    }

    /// What the worker warns of at start about the host, not the config's
    /// keys:
    /// - a `work_dir` every user may write to without the sticky bit lets
    ///   another user rename this worker's directories there and put links
    ///   to its own in their place, which the worker then writes a job's
    ///   inputs and outputs into (audit 83). Not refused: a directory shared
    ///   on purpose is the operator's call;
    /// - a `work_dir` on ext4 without a journal makes each job's directory
    ///   slower to make than the last at a high job rate ([`crate::hostfs`]).
    pub fn host_warnings(&self) -> Vec<String> {
        use std::os::unix::fs::PermissionsExt;
        let base = self.work_base();
        let Ok(meta) = std::fs::metadata(&base) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mode = meta.permissions().mode();
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            out.push(format!(
                "work_dir {} is writable by every user and not sticky (mode {:o}): another user can replace this worker's directories there with links of its own; chmod +t it (as /tmp is) or 0700, or set work_dir to a directory of the worker's user",
                base.display(),
                mode & 0o7777
            ));
        }
        if let Some(fs) = crate::hostfs::Filesystem::of(&base) {
            if fs.slow_to_remake_directories() {
                out.push(format!(
                    "work_dir {} is on ext4 without a journal ({} on {}): there each job directory made and removed makes the next one slower to make (the kernel steps over recently freed inodes), which costs a busy worker much of its CPU; for many short jobs set work_dir to a tmpfs (e.g. /dev/shm, if job outputs fit in memory) or a journaled filesystem",
                    base.display(),
                    fs.source,
                    fs.mount_point.display()
                ));
            }
        }
        out
    }

    /// Reads, overrides from the environment (`DURABLE_<KEY>`, see
    /// [`WorkerConfig::apply_env`]), resolves and validates a worker config.
    pub fn load(path: &Path) -> Result<WorkerConfig, ConfigError> {
        Self::load_with_env(path, std::env::vars_os())
    }

    /// [`WorkerConfig::load`] for the commands that start the executors
    /// without a database (`executors`, `conformance`): the pool's size is
    /// not checked (SDK audit: a developer checking an executor had to raise
    /// `db_max_connections`, a setting those commands never use).
    pub fn load_for_probe(path: &Path) -> Result<WorkerConfig, ConfigError> {
        Self::load_checked(path, std::env::vars_os(), true)
    }

    /// [`WorkerConfig::load`] with the environment given explicitly.
    pub fn load_with_env(
        path: &Path,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    ) -> Result<WorkerConfig, ConfigError> {
        Self::load_checked(path, vars, false)
    }

    fn load_checked(
        path: &Path,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
        probe_only: bool,
    ) -> Result<WorkerConfig, ConfigError> {
        Self::load_unmasked(path, vars, probe_only).map_err(ConfigError::without_passwords)
    }

    fn load_unmasked(
        path: &Path,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
        probe_only: bool,
    ) -> Result<WorkerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        // the file alone first: its errors carry line numbers and name the key
        let parsed: WorkerConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: parse_error(&text, &e),
        })?;
        let mut table: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: parse_error(&text, &e),
        })?;
        let applied = apply_env(&mut table, vars)?;
        let mut cfg = if applied.is_empty() {
            parsed
        } else {
            toml::Value::Table(table)
                .try_into::<WorkerConfig>()
                .map_err(|e| ConfigError::Env {
                    var: applied.join(", "),
                    message: env_type_error(&e),
                })?
        };
        cfg.resolve_paths(
            &std::env::current_dir().map_err(|source| ConfigError::Read {
                path: PathBuf::from("."),
                source,
            })?,
        );
        if probe_only {
            cfg.db_max_connections = cfg.db_max_connections.max(cfg.min_db_connections());
        }
        cfg.validate().map_err(|e| match e {
            ConfigError::Invalid(m) => {
                let involved = env_involved(&applied, &m);
                if involved.is_empty() {
                    ConfigError::Invalid(format!("{m} (in {})", path.display()))
                } else {
                    ConfigError::Invalid(format!(
                        "{m} (in {}, with {} from the environment)",
                        path.display(),
                        involved.join(", ")
                    ))
                }
            }
            other => other,
        })?;
        cfg.check_commands()
            .map_err(|m| ConfigError::Invalid(format!("{m} (in {})", path.display())))?;
        Ok(cfg)
    }

    /// This config with the environment's `DURABLE_<KEY>` overrides (as
    /// [`WorkerConfig::load`] gives a file's), validated when any applied:
    /// `supervisor dev`'s built-in config, so that two of them on one host
    /// can be given names (process slots) of their own.
    pub fn with_env(
        self,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    ) -> Result<WorkerConfig, ConfigError> {
        self.with_env_unmasked(vars)
            .map_err(ConfigError::without_passwords)
    }

    fn with_env_unmasked(
        self,
        vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    ) -> Result<WorkerConfig, ConfigError> {
        let mut table = toml::Table::try_from(&self)
            .map_err(|e| ConfigError::Invalid(format!("the built-in config: {e}")))?;
        let applied = apply_env(&mut table, vars)?;
        if applied.is_empty() {
            return Ok(self);
        }
        let cfg: WorkerConfig =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Env {
                    var: applied.join(", "),
                    message: e.to_string(),
                })?;
        cfg.validate().map_err(|e| match e {
            ConfigError::Invalid(m) => {
                let involved = env_involved(&applied, &m);
                if involved.is_empty() {
                    ConfigError::Invalid(m)
                } else {
                    ConfigError::Invalid(format!(
                        "{m} (with {} from the environment)",
                        involved.join(", ")
                    ))
                }
            }
            other => other,
        })?;
        Ok(cfg)
    }

    /// Every executor's command names a program that exists and may be run:
    /// a path (absolute, or relative to the working directory, as
    /// `resolve_paths` made it), or a name found on PATH. Checked when a
    /// config file is loaded, so a wrong command is a config error (exit 2,
    /// naming the key) rather than a handshake that fails at start.
    pub fn check_commands(&self) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let runnable = |p: &Path| {
            std::fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        };
        for e in &self.executors {
            let what = format!("[[executors]] {:?}: command = {:?}", e.name, e.command);
            if e.command.contains('/') {
                let p = Path::new(&e.command);
                match std::fs::metadata(p) {
                    Err(err) => {
                        return Err(format!(
                            "{what} cannot be run: {err}. Give the executor's program: an absolute path, a path relative to the worker's working directory, or a name on PATH"
                        ))
                    }
                    Ok(m) if !m.is_file() => {
                        return Err(format!("{what} is not a file"))
                    }
                    Ok(_) if !runnable(p) => {
                        return Err(format!(
                            "{what} is not executable: chmod +x it, or run it through its interpreter (command = \"/usr/bin/python3\", args = [\"{}\"])",
                            e.command
                        ))
                    }
                    Ok(_) => {}
                }
            } else {
                let found = std::env::var_os("PATH")
                    .map(|paths| {
                        std::env::split_paths(&paths).any(|d| runnable(&d.join(&e.command)))
                    })
                    .unwrap_or(false);
                if !found {
                    return Err(format!(
                        "{what} is not found on PATH: give the program's absolute path, or install it"
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn resolve_paths(&mut self, base: &Path) {
        for e in &mut self.executors {
            let p = Path::new(&e.command);
            if e.command.contains('/') && p.is_relative() {
                e.command = base.join(p).to_string_lossy().into_owned();
            }
        }
    }

    /// Checks every range and cross-field rule; the message names the key,
    /// its value and what to change.
    /// The rule that lets the lease clock stop a child before its lease can
    /// expire: `cancel_grace_ms + term_grace_ms + 2 * heartbeat_interval_ms`
    /// must fit in `lease_ttl_ms`. Checked by `validate` and again by
    /// `Worker::start` (a config built in code is not validated).
    pub fn check_stop_budget(&self) -> Result<(), String> {
        let stop = self
            .cancel_grace_ms
            .saturating_add(self.term_grace_ms)
            .saturating_add(self.heartbeat_interval_ms.saturating_mul(2));
        if stop > self.lease_ttl_ms {
            return Err(format!(
                "cancel_grace_ms ({}) + term_grace_ms ({}) + 2 * heartbeat_interval_ms ({}) = {stop} must fit in lease_ttl_ms ({}): a child must be stopped before its lease can expire. Raise lease_ttl_ms or shorten the graces",
                self.cancel_grace_ms, self.term_grace_ms, self.heartbeat_interval_ms, self.lease_ttl_ms
            ));
        }
        Ok(())
    }

    /// The retention age: `None` when `retention = "off"`. At least one
    /// second (a finished run stays readable for at least that long).
    pub fn retention_age(&self) -> Result<Option<std::time::Duration>, String> {
        let text = self.retention.trim();
        if text.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let age = crate::cli::parse_duration(text).map_err(|e| {
            format!("retention = {text:?}: {e}, or \"off\" to keep every finished run")
        })?;
        if age < std::time::Duration::from_secs(1) {
            return Err(format!(
                "retention = {text:?} is below 1s: finished runs must stay readable a while. Give an age like 7d, or \"off\""
            ));
        }
        Ok(Some(age))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_durations()?;
        self.check_frames()?;
        self.check_capacity()?;
        self.check_artifacts()?;
        self.check_paths()?;
        let mut names = std::collections::BTreeSet::new();
        for e in &self.executors {
            if e.name.is_empty() || !names.insert(e.name.clone()) {
                return Err(ConfigError::Invalid(format!(
                    "executor names must be unique and non-empty: {:?}",
                    e.name
                )));
            }
            e.check().map_err(ConfigError::Invalid)?;
        }
        Ok(())
    }

    /// The intervals, timeouts and graces: milliseconds within a day, the
    /// heartbeat within the lease, the loops' intervals positive.
    fn check_durations(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        for (key, value) in [
            ("lease_ttl_ms", self.lease_ttl_ms),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("poll_interval_ms", self.poll_interval_ms),
            ("reclaim_interval_ms", self.reclaim_interval_ms),
            ("cancel_grace_ms", self.cancel_grace_ms),
            ("term_grace_ms", self.term_grace_ms),
            ("drain_timeout_ms", self.drain_timeout_ms),
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("refusal_delay_ms", self.refusal_delay_ms),
            ("retention_interval_ms", self.retention_interval_ms),
        ] {
            if value > MAX_MS {
                return bad(format!(
                    "{key} = {value} is above {MAX_MS} (one day); give milliseconds, like 10000 for 10 s"
                ));
            }
        }
        if self.lease_ttl_ms < 200 {
            return bad(format!(
                "lease_ttl_ms = {} is below 200; give milliseconds, like 10000 for 10 s",
                self.lease_ttl_ms
            ));
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms * 2 > self.lease_ttl_ms {
            return bad(format!(
                "heartbeat_interval_ms = {} must be positive and at most half of lease_ttl_ms = {}, so one late heartbeat does not lose the lease",
                self.heartbeat_interval_ms, self.lease_ttl_ms
            ));
        }
        for (key, value) in [
            ("poll_interval_ms", self.poll_interval_ms),
            ("reclaim_interval_ms", self.reclaim_interval_ms),
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("retention_interval_ms", self.retention_interval_ms),
            ("retention_batch_runs", u64::from(self.retention_batch_runs)),
            (
                "retention_batch_steps",
                u64::from(self.retention_batch_steps),
            ),
        ] {
            if value == 0 {
                return bad(format!("{key} = 0 must be positive"));
            }
        }
        self.retention_age().map_err(ConfigError::Invalid)?;
        Ok(())
    }

    /// Frame and stderr-tail sizes.
    fn check_frames(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.max_frame_bytes < 1024 || self.max_frame_bytes > MAX_FRAME_BYTES {
            return bad(format!(
                "max_frame_bytes = {} must be at least 1024 and at most {MAX_FRAME_BYTES} (1 GiB)",
                self.max_frame_bytes
            ));
        }
        if self.stderr_tail_bytes > MAX_STDERR_TAIL_BYTES {
            return bad(format!(
                "stderr_tail_bytes = {} is above {MAX_STDERR_TAIL_BYTES} (64 MiB): the tail is held in memory for every running attempt",
                self.stderr_tail_bytes
            ));
        }
        Ok(())
    }

    /// At least one executor, a stop budget that fits in the lease, enough
    /// connections, refusals bounded.
    fn check_capacity(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.executors.is_empty() {
            return bad("no [[executors]]: a worker needs at least one".into());
        }
        self.check_stop_budget().map_err(ConfigError::Invalid)?;
        if self.min_db_connections() > MAX_DB_CONNECTIONS {
            return bad(format!(
                "the executors' total concurrency ({}) is above {}, the most one worker can run (each running attempt may need a connection, and db_max_connections is at most {MAX_DB_CONNECTIONS}): lower concurrency, or run more workers",
                self.total_concurrency(),
                MAX_DB_CONNECTIONS - 1
            ));
        }
        if self.db_max_connections < self.min_db_connections() {
            return bad(format!(
                "db_max_connections = {} is smaller than the executors' total concurrency ({}) + 1: every running attempt may need a connection at once for its artifacts (reading its inputs, storing its outputs' bytes), and the worker's one writer and its leasing share one more. Raise db_max_connections to at least {}",
                self.db_max_connections,
                self.total_concurrency(),
                self.min_db_connections()
            ));
        }
        if self.db_max_connections > MAX_DB_CONNECTIONS {
            return bad(format!(
                "db_max_connections = {} is above {MAX_DB_CONNECTIONS}: the pool sets aside room for every connection at start, and PostgreSQL's own max_connections is far smaller (100 by default); give what the executors' concurrency needs, like {}",
                self.db_max_connections,
                self.min_db_connections().max(8)
            ));
        }
        if self.max_refusals == 0 {
            return bad("max_refusals = 0 must be at least 1".into());
        }
        Ok(())
    }

    /// Artifact sizes, chunks and the store.
    fn check_artifacts(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.max_artifact_bytes > self.max_result_bytes {
            return bad(format!(
                "max_artifact_bytes ({}) must be at most max_result_bytes ({}): one artifact cannot be larger than a whole result",
                self.max_artifact_bytes, self.max_result_bytes
            ));
        }
        if !(MIN_ARTIFACT_CHUNK_BYTES..=MAX_ARTIFACT_CHUNK_BYTES)
            .contains(&self.artifact_chunk_bytes)
        {
            return bad(format!(
                "artifact_chunk_bytes = {} must be at least {MIN_ARTIFACT_CHUNK_BYTES} (4 KiB) and at most {MAX_ARTIFACT_CHUNK_BYTES} (64 MiB); 1048576 (1 MiB) is the default",
                self.artifact_chunk_bytes
            ));
        }
        match (&self.artifact_store, &self.artifact_dir) {
            (ArtifactBackend::Directory, None) => {
                return bad(
                    "artifact_store = \"directory\" needs artifact_dir: the shared directory every worker host mounts (or use artifact_store = \"postgres\")".into(),
                )
            }
            // a postgres worker only reads from it (blobs stored there by
            // directory workers): a missing one fails those reads, by name
            (ArtifactBackend::Directory, Some(dir)) if !dir.is_dir() => {
                return bad(format!(
                    "artifact_dir = {:?} is not an existing directory: create it (on a volume all worker hosts share) or remove artifact_dir",
                    dir.display().to_string()
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// Directories that must exist, the metrics address, the stderr log rate.
    fn check_paths(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if let Some(name) = &self.name {
            if name.trim().is_empty() {
                return bad(format!(
                    "name = {name:?} is blank: give the worker a name of its own (it is its process slot on this host), or remove name to use host:pid"
                ));
            }
            // the name is logged and put in every child's environment: a
            // database URL set in the wrong place must not carry its
            // password there (outside re-check), nor a newline forge a line
            let shown = crate::db::redact_url(name);
            if shown != *name {
                return bad(format!(
                    "name = {shown:?} holds a password (it reads as a URL with credentials): the name is logged and given to every executor; give a plain name like ingest-1"
                ));
            }
            if name.chars().count() > MAX_NAME_CHARS || name.chars().any(char::is_control) {
                return bad(format!(
                    "name = {name:?} must be at most {MAX_NAME_CHARS} characters with no control characters (like ingest-1)"
                ));
            }
        }
        if let Some(dir) = &self.work_dir {
            if !dir.is_dir() {
                return bad(format!(
                    "work_dir = {:?} is not an existing directory: create it (attempts make their directories there) or remove work_dir to use the system's temporary directory",
                    dir.display().to_string()
                ));
            }
        }
        if let Some(dir) = &self.secrets_dir {
            if !dir.is_dir() {
                return bad(format!(
                    "secrets_dir = {:?} is not an existing directory: create it (one file per secret, named like the secret) or remove secrets_dir to read secrets from the worker's environment",
                    dir.display().to_string()
                ));
            }
        }
        if let Some(addr) = &self.metrics_addr {
            if let Err(e) = parse_metrics_addr(addr) {
                return bad(e);
            }
        }
        if self.stderr_log_lines_per_sec > MAX_STDERR_LOG_LINES_PER_SEC {
            return bad(format!(
                "stderr_log_lines_per_sec = {} is above {MAX_STDERR_LOG_LINES_PER_SEC}: give the lines per second of one attempt's stderr to log, like 20 (0 logs none)",
                self.stderr_log_lines_per_sec
            ));
        }
        Ok(())
    }
}

impl ExecutorConfig {
    /// One executor entry on its own (names are checked across entries by
    /// [`WorkerConfig::validate`]).
    fn check(&self) -> Result<(), String> {
        if self.command.is_empty() {
            return Err(format!("executor {:?} has no command", self.name));
        }
        if self.concurrency == 0 {
            return Err(format!(
                "executor {:?}: concurrency = 0 must be at least 1",
                self.name
            ));
        }
        if self.max_jobs_per_process == Some(0) {
            return Err(format!(
                "executor {:?}: max_jobs_per_process = 0 must be at least 1 (or leave it out to follow the executor's hello)",
                self.name
            ));
        }
        if self.idle_timeout_ms > MAX_MS {
            return Err(format!(
                "executor {:?}: idle_timeout_ms = {} is above {MAX_MS} (one day); give milliseconds, like 60000 for a minute, or 0 to keep idle processes",
                self.name, self.idle_timeout_ms
            ));
        }
        if self.warm_processes > 0 && !self.persistent {
            return Err(format!(
                "executor {:?}: warm_processes = {} needs persistent = true (a one-shot process serves one job, so none can be kept warm): set persistent = true or remove warm_processes",
                self.name, self.warm_processes
            ));
        }
        if self.warm_processes > self.concurrency {
            return Err(format!(
                "executor {:?}: warm_processes = {} is more than its concurrency = {}: no more than {} of its processes are ever busy; lower warm_processes or raise concurrency",
                self.name, self.warm_processes, self.concurrency, self.concurrency
            ));
        }
        // as a step's labels are checked at submit: the worker's
        // registration stored a NUL as a raw database error (exit 1), and a
        // blank name could match no step's
        for (k, v) in &self.labels {
            if k.trim().is_empty() || k.contains('\0') || v.contains('\0') {
                return Err(format!(
                    "executor {:?}: label {:?} = {:?}: a label name must not be blank, and neither name nor value may hold a NUL character",
                    self.name,
                    k.escape_default().to_string(),
                    v.escape_default().to_string()
                ));
            }
        }
        if let Some(s) = self
            .secrets
            .iter()
            .find(|s| !crate::secrets::is_valid_name(s))
        {
            return Err(format!(
                "executor {:?}: secrets entry {s:?} is not a secret name: use letters, digits and _, not starting with a digit, at most 128 characters (like REPORT_API_TOKEN)",
                self.name
            ));
        }
        Ok(())
    }
}

/// `metrics_addr` as a socket address: `IP:PORT` (`127.0.0.1:9464`,
/// `0.0.0.0:9464`, `[::1]:9464`); the error names the key and what to write.
/// `max_jobs_per_process`: a number of jobs, or -1 for no cap of the
/// config's (as the SDKs and the hello say "unlimited"; it read "invalid
/// value: integer -1, expected u32", persistent-pool audit). 0 is refused
/// by `validate`, with the executor's name.
fn jobs_cap<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    use serde::de::Error;
    match Option::<i64>::deserialize(d)? {
        None | Some(-1) => Ok(None),
        Some(n) if n >= 0 => u32::try_from(n).map(Some).map_err(|_| {
            D::Error::custom(format!(
                "max_jobs_per_process = {n} is more than {}: leave it out (or -1) for no cap but the executor's hello",
                u32::MAX
            ))
        }),
        Some(n) => Err(D::Error::custom(format!(
            "max_jobs_per_process = {n}: give a number of jobs (at least 1), or -1 (or leave it out) for no cap but the executor's hello"
        ))),
    }
}

pub fn parse_metrics_addr(addr: &str) -> Result<std::net::SocketAddr, String> {
    addr.trim().parse().map_err(|_| {
        format!(
            "metrics_addr = {addr:?} is not an IP:PORT address: write it like \"127.0.0.1:9464\" (\"0.0.0.0:9464\" for every interface, port 0 for any free port), or remove metrics_addr to serve no metrics"
        )
    })
}

/// The most stderr lines per second `stderr_log_lines_per_sec` may allow.
pub const MAX_STDERR_LOG_LINES_PER_SEC: u32 = 10_000;

/// The longest any `_ms` setting may be: one day.
pub const MAX_MS: u64 = 86_400_000;
/// The longest worker name (its process slot, logged and in every child's
/// environment).
pub const MAX_NAME_CHARS: usize = 128;
/// The largest `db_max_connections`: sqlx sets aside a slot per connection
/// when the pool is made (4294967295 aborted the worker on a 200 GB
/// allocation; outside re-check).
pub const MAX_DB_CONNECTIONS: u32 = 10_000;
/// The largest `max_frame_bytes`: 1 GiB.
pub const MAX_FRAME_BYTES: usize = 1024 * 1024 * 1024;
/// The largest `stderr_tail_bytes`: 64 MiB.
pub const MAX_STDERR_TAIL_BYTES: usize = 64 * 1024 * 1024;

/// The prefix of the environment variables that override top-level keys of
/// the worker config: `DURABLE_LEASE_TTL_MS=30000` sets `lease_ttl_ms`.
pub const ENV_PREFIX: &str = "DURABLE_";

/// The top-level settings, in the order `--print-default-config` prints them,
/// with their comment and, for those with no default, an example value.
const WORKER_KEYS: &[(&str, &str, Option<&str>)] = &[
    (
        "database_url",
        "The PostgreSQL URL. --database-url and DATABASE_URL take precedence over it.",
        Some("\"postgres://user@localhost/db\""),
    ),
    (
        "name",
        "A readable name for logs and the transition history (default: host:pid).",
        Some("\"worker-1\""),
    ),
    (
        "lease_ttl_ms",
        "How long a lease lasts without renewal. Seconds, not hours: a crashed worker's steps are reclaimed this soon.",
        None,
    ),
    (
        "heartbeat_interval_ms",
        "How often one batched statement renews every lease this worker holds; at most half of lease_ttl_ms.",
        None,
    ),
    (
        "poll_interval_ms",
        "Polling fallback behind LISTEN/NOTIFY: how often the queue is looked at when no wake-up arrives.",
        None,
    ),
    (
        "reclaim_interval_ms",
        "How often expired leases (of any worker) are looked for and moved on (LEASE_EXPIRED).",
        None,
    ),
    (
        "cancel_grace_ms",
        "After a cancel frame, how long the executor has to end the job before SIGTERM to its process group.",
        None,
    ),
    (
        "term_grace_ms",
        "After SIGTERM, how long before SIGKILL. cancel_grace_ms + term_grace_ms + 2 * heartbeat_interval_ms must fit in lease_ttl_ms.",
        None,
    ),
    (
        "drain_timeout_ms",
        "On SIGTERM/SIGINT: how long running attempts may finish before they are stopped (WORKER_SHUTDOWN, the attempt is not counted).",
        None,
    ),
    (
        "handshake_timeout_ms",
        "How long an executor has to say hello after it is started, and to answer a job (ACCEPTED, a refusal, any frame) after it is sent: a process that answers nothing is replaced and the job goes back to the queue uncounted (EXECUTOR_UNRESPONSIVE, counted as a refusal).",
        None,
    ),
    (
        "max_frame_bytes",
        "The largest protocol frame accepted from an executor (checked before allocating); 1024 to 1 GiB.",
        None,
    ),
    (
        "max_artifact_bytes",
        "The largest artifact accepted (ARTIFACT_INVALID above it, checked before it is read); at most max_result_bytes. Artifacts stream to the artifact store in chunks: this limits storage, not memory.",
        None,
    ),
    (
        "stderr_tail_bytes",
        "How much of each child's stderr is kept (the tail) for failure reports; the rest is drained and counted. At most 64 MiB.",
        None,
    ),
    (
        "db_max_connections",
        "The worker's connection pool; at least the executors' total concurrency + 1 (the heartbeat has a connection of its own); at most 10000.",
        None,
    ),
    (
        "refusal_delay_ms",
        "How long a refused step (handed back without running) waits before it can be leased again, by another worker: the worker that refused it leaves it to the others for five poll_interval_ms, at least 5 s.",
        None,
    ),
    (
        "max_refusals",
        "How many refusals a step may get before it fails terminal_failed with EXECUTOR_REFUSED; at least 1.",
        None,
    ),
    (
        "max_result_bytes",
        "All artifacts of one result together (RESULT_TOO_LARGE above it).",
        None,
    ),
    (
        "artifact_store",
        "Where artifact bytes are stored: \"postgres\" (chunks in the database, works across hosts with no other service) or \"directory\" (content-addressed files <artifact_dir>/<sha[0..2]>/<sha> on a volume every worker host mounts).",
        None,
    ),
    (
        "artifact_dir",
        "The shared directory of artifact_store = \"directory\" (must exist). With the postgres store it is optional and only lets this worker read blobs that directory workers stored.",
        Some("\"/mnt/durable-artifacts\""),
    ),
    (
        "artifact_chunk_bytes",
        "Bytes per chunk when artifacts are uploaded and read back (one database row of the postgres store): an artifact's memory cost, whatever its size. 4 KiB to 64 MiB.",
        None,
    ),
    (
        "work_dir",
        "Where per-attempt working directories are created, and removed (default: the system temp directory).",
        Some("\"/var/lib/durable/work\""),
    ),
    (
        "secrets_dir",
        "Read secret values from the file <secrets_dir>/<NAME> (one trailing newline stripped, as Docker and Kubernetes mount them) instead of the worker's environment. Must be an existing directory (default: unset, the environment).",
        Some("\"/run/secrets\""),
    ),
    (
        "metrics_addr",
        "Serve Prometheus /metrics, /healthz (the worker's vital loops run) and /readyz (the database answers and the executors were probed) over HTTP on this IP:PORT; port 0 picks a free one (logged). Default: unset, nothing is served.",
        Some("\"127.0.0.1:9464\""),
    ),
    (
        "stderr_log_lines_per_sec",
        "How many lines of an executor's stderr are logged per second and attempt (in the attempt's span, secrets redacted); the rest are counted in one \"suppressed\" line. 0 logs none; at most 10000.",
        None,
    ),
    (
        "retention",
        "Finished runs (succeeded, failed, cancelled) older than this are removed, with their steps, events, transitions, artifacts and the artifact bytes nothing else references: 30s, 10m, 2h, 7d, 1h30m, or \"off\" to keep them all. Every worker runs the removal; one batch at a time across all of them. `supervisor gc` does the same on demand.",
        None,
    ),
    (
        "retention_interval_ms",
        "How often this worker looks for finished runs older than retention (with up to 10% jitter).",
        None,
    ),
    (
        "retention_batch_runs",
        "At most this many runs are removed per transaction (short transactions, short locks).",
        None,
    ),
    (
        "retention_batch_steps",
        "At most this many steps are removed per transaction; a larger run is removed over several.",
        None,
    ),
    (
        "retention_vacuum",
        "VACUUM the durable tables after a pass that removed anything, so their space is reused at once instead of when autovacuum comes (needs the tables' owner, or the MAINTAIN privilege; skipped with a warning otherwise).",
        None,
    ),
];

/// The fields of one `[[executors]]` entry, with their comment and the value
/// of the printed example (`None`: the default is printed).
const EXECUTOR_KEYS: &[(&str, &str, Option<&str>)] = &[
    (
        "name",
        "Required. A name for logs and `supervisor executors`; unique in this file.",
        Some("\"go-main\""),
    ),
    (
        "command",
        "Required. The program: an absolute path, a relative path with a / (resolved against the worker's working directory at load time) or a bare name looked up in PATH.",
        Some("\"/opt/durable/bin/demo-executor-go\""),
    ),
    (
        "args",
        "Arguments, passed verbatim (default: none). The child runs in a fresh per-attempt directory: give file arguments as absolute paths.",
        Some("[\"--log-level\", \"info\"]"),
    ),
    (
        "env_allowlist",
        "Variables copied from the worker's environment; the rest is cleared.",
        None,
    ),
    (
        "env",
        "Variables set explicitly (default: none).",
        Some("{ GOMAXPROCS = \"2\" }"),
    ),
    (
        "secrets",
        "The secret names a step run by this executor may receive (default: none); a step naming another fails SECRET_NOT_ALLOWED. Values come from secrets_dir or the worker's environment.",
        Some("[\"REPORT_API_TOKEN\"]"),
    ),
    (
        "labels",
        "Host capabilities this worker adds to the executor's own hello labels; steps route by labels (default: none).",
        Some("{ region = \"eu-west\" }"),
    ),
    (
        "kinds",
        "Restricts the kinds leased for this executor (default: every kind its hello offers).",
        Some("[\"demo.echo\", \"demo.sleep\"]"),
    ),
    ("concurrency", "Attempts run at once with this executor; the executors' total is at most 9999 (each may need a connection of db_max_connections).", None),
    (
        "persistent",
        "Keep processes warm between jobs: one process serves jobs one at a time until max_jobs_per_process, a protocol violation or an unanswered cancel; then it is replaced. Default: false, one process per job.",
        // the example's: with the persistent-only keys below, uncommented
        // as it is, it warns of nothing (audit 90 #6)
        Some("true"),
    ),
    (
        "max_jobs_per_process",
        "Persistent executors: caps the jobs one process serves (default, or -1: what its hello says).",
        Some("100"),
    ),
    (
        "warm_processes",
        "Persistent executors: processes kept started and handshaken ahead of jobs, at most concurrency; started with the worker, and each one retired or killed is replaced. 0: a process starts when a job needs one.",
        None,
    ),
    (
        "idle_timeout_ms",
        "Persistent executors: an idle process beyond warm_processes is retired after this long without a job (default 60 s), so a burst does not leave concurrency processes running for ever. 0: idle processes are kept.",
        None,
    ),
];

/// A setting's value in words, for the comment: `10000` ms is "10 s".
fn in_words(key: &str, value: &toml::Value) -> Option<String> {
    let n = value.as_integer()?;
    if key.ends_with("_ms") {
        return Some(if n >= 1000 && n % 1000 == 0 {
            format!("{} s", n / 1000)
        } else {
            format!("{n} ms")
        });
    }
    if key.ends_with("_bytes") {
        for (unit, size) in [("GiB", 1i64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
            if n >= size && n % size == 0 {
                return Some(format!("{} {unit}", n / size));
            }
        }
    }
    None
}

fn comment(out: &mut String, text: &str, indent: &str) {
    // wrapped at about 100 columns
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + word.len() + 1 > 96 {
            out.push_str(&format!("{indent}# {line}\n"));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        out.push_str(&format!("{indent}# {line}\n"));
    }
}

fn setting(
    out: &mut String,
    key: &str,
    doc: &str,
    defaults: &toml::Table,
    example: Option<&str>,
    commented: bool,
) {
    let value = defaults.get(key);
    comment(out, doc, "");
    if let Some(v) = value {
        match in_words(key, v) {
            Some(words) => out.push_str(&format!("# Default: {v} ({words}).\n")),
            None if commented => out.push_str(&format!("# Default: {v}.\n")),
            None => {}
        }
    }
    match (value, example) {
        (Some(v), _) if !commented => out.push_str(&format!("{key} = {v}\n\n")),
        (Some(v), None) => out.push_str(&format!("#{key} = {v}\n\n")),
        (_, Some(e)) => out.push_str(&format!("#{key} = {e}\n\n")),
        (None, None) => out.push_str(&format!("#{key} =\n\n")),
    }
}

impl WorkerConfig {
    /// Every worker setting with a comment and its default, as TOML: what
    /// `supervisor worker --print-default-config` prints. Settings without a
    /// default, and the example `[[executors]]` entry, are commented out
    /// (`#key = value`, no space), so the text parses back to
    /// `WorkerConfig::default()`; uncommented it is a complete example.
    pub fn default_config_toml() -> String {
        let empty = toml::Table::new();
        let defaults = toml::Table::try_from(WorkerConfig::default()).unwrap_or_default();
        let exec_defaults = toml::Table::try_from(ExecutorConfig::default()).unwrap_or_default();
        let mut out = String::new();
        comment(
            &mut out,
            "The durable worker's configuration (TOML): every setting with its default. \
             `supervisor worker --config FILE` reads it. An environment variable DURABLE_<KEY> \
             overrides a top-level key (DURABLE_LEASE_TTL_MS=30000 sets lease_ttl_ms; an empty one \
             is ignored). Unknown keys are refused. Lines `#key = value` are settings left at their \
             default; remove the # to set them.",
            "",
        );
        out.push('\n');
        for (key, doc, example) in WORKER_KEYS {
            setting(&mut out, key, doc, &defaults, *example, example.is_some());
        }
        comment(
            &mut out,
            "One [[executors]] entry per executor program; a worker needs at least one. \
             `supervisor dev --print-config` prints entries for the bundled demo executors. \
             An example with every field:",
            "",
        );
        out.push_str("#[[executors]]\n");
        for (key, doc, example) in EXECUTOR_KEYS {
            let defaults = if example.is_some() {
                &empty
            } else {
                &exec_defaults
            };
            setting(&mut out, key, doc, defaults, *example, true);
        }
        out
    }
}

/// A non-negative integer that TOML can hold.
fn whole_number(text: &str) -> Option<i64> {
    text.parse::<u64>().ok().and_then(|n| i64::try_from(n).ok())
}

/// The largest value an integer setting takes: its own bound where it has
/// one (a day of milliseconds, 1 GiB frames), else its type's. Checked
/// where a `DURABLE_*` value is read, so a number too large names it; the
/// config's own checks name the same bounds (a test holds them together).
fn integer_limit(key: &str) -> u64 {
    match key {
        "max_frame_bytes" => MAX_FRAME_BYTES as u64,
        "stderr_tail_bytes" => MAX_STDERR_TAIL_BYTES as u64,
        "artifact_chunk_bytes" => MAX_ARTIFACT_CHUNK_BYTES as u64,
        "stderr_log_lines_per_sec" => u64::from(MAX_STDERR_LOG_LINES_PER_SEC),
        "db_max_connections" => u64::from(MAX_DB_CONNECTIONS),
        "max_refusals" | "retention_batch_runs" | "retention_batch_steps" => u64::from(u32::MAX),
        k if k.ends_with("_ms") => MAX_MS,
        _ => i64::MAX as u64,
    }
}

/// What [`integer_limit`] is, where it is not a plain count.
fn limit_in_words(key: &str) -> &'static str {
    match key {
        "max_frame_bytes" => " (1 GiB)",
        "stderr_tail_bytes" | "artifact_chunk_bytes" => " (64 MiB)",
        k if k.ends_with("_ms") => " (one day of milliseconds)",
        _ => "",
    }
}

/// Applies `DURABLE_<KEY>` overrides to the top-level keys of a parsed
/// config file; returns the variables applied. A variable whose key is not a
/// top-level setting is left alone (other `DURABLE_*` variables exist); one
/// that names a setting but does not parse is an error naming the variable.
/// An empty value is ignored.
/// `DURABLE_*` variables the runtime reads that are not worker settings.
const OTHER_ENV: &[&str] = &[
    "DURABLE_LOG_FORMAT",
    "DURABLE_CGROUPS",
    "DURABLE_ARTIFACT_DIR",
    "DURABLE_SUPERVISOR_SLOT",
    "DURABLE_SUPERVISOR_PROCESS",
    "DURABLE_SUPERVISOR_INSTANCE",
];

/// The `DURABLE_*` variables of `vars` that name no worker setting (nor
/// another variable the runtime reads), each with the setting it most likely
/// meant: a misspelt override (`DURABLE_LEASE_TLL_MS`) is otherwise ignored
/// without a word, while the same typo in the file is refused.
pub fn unknown_env_settings(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<(String, Option<String>)> {
    let mut out: Vec<(String, Option<String>)> = vars
        .into_iter()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with(ENV_PREFIX) && !OTHER_ENV.contains(&k.as_str()))
        .filter(|k| !k.starts_with("DURABLE_CHAOS_") && !k.starts_with("DURABLE_TEST_"))
        .filter_map(|var| {
            let key = var[ENV_PREFIX.len()..].to_ascii_lowercase();
            if key == "executors" || WORKER_KEYS.iter().any(|(k, _, _)| *k == key) {
                return None;
            }
            let near = WORKER_KEYS
                .iter()
                .map(|(k, _, _)| (edit_distance(&key, k), *k))
                .min()
                .filter(|(d, _)| *d <= 3)
                .map(|(_, k)| format!("{ENV_PREFIX}{}", k.to_ascii_uppercase()));
            Some((var, near))
        })
        .collect();
    out.sort();
    out
}

/// Levenshtein distance (a misspelt setting's nearest key).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

pub fn apply_env(
    table: &mut toml::Table,
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<String>, ConfigError> {
    let defaults = toml::Table::try_from(WorkerConfig::default()).unwrap_or_default();
    let mut applied = Vec::new();
    let mut vars: Vec<(String, std::ffi::OsString)> = vars
        .into_iter()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v)))
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    vars.sort();
    for (var, value) in vars {
        let key = var[ENV_PREFIX.len()..].to_ascii_lowercase();
        if key == "executors" {
            return Err(ConfigError::Env {
                var,
                message: "executors cannot be set from the environment: list them as [[executors]] in the config file".into(),
            });
        }
        if !WORKER_KEYS.iter().any(|(k, _, _)| *k == key) {
            continue;
        }
        let Ok(value) = value.into_string() else {
            return Err(ConfigError::Env {
                var,
                message: "the value is not UTF-8".into(),
            });
        };
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        // typed like the default: whole numbers, booleans; the settings
        // with no default are strings (URLs, names, paths)
        let parsed = match defaults.get(&key) {
            None | Some(toml::Value::String(_)) => toml::Value::String(value.to_owned()),
            Some(toml::Value::Boolean(_)) => match value {
                "true" => toml::Value::Boolean(true),
                "false" => toml::Value::Boolean(false),
                _ => {
                    return Err(ConfigError::Env {
                        var,
                        message: format!(
                            "{:?} is not a boolean: {key} takes true or false",
                            crate::db::redact_url(value)
                        ),
                    })
                }
            },
            Some(toml::Value::Integer(_)) => match whole_number(value) {
                Some(n) if n.unsigned_abs() <= integer_limit(&key) => toml::Value::Integer(n),
                // a number too large for the key names the key's largest
                // value (outside re-check: "is not a whole number" for
                // 18446744073709551615, "expected a whole number, 0 or
                // more" for 4294967296)
                _ if value.bytes().all(|b| b.is_ascii_digit()) => {
                    let limit = integer_limit(&key);
                    return Err(ConfigError::Env {
                        var,
                        message: format!(
                            "{value} is above {limit}, the largest {key} takes{}",
                            limit_in_words(&key)
                        ),
                    });
                }
                _ => {
                    let unit = if key.ends_with("_ms") {
                        " of milliseconds, like 5000 for 5 s"
                    } else if key.ends_with("_bytes") {
                        " of bytes, like 8388608 for 8 MiB"
                    } else {
                        ", like 10"
                    };
                    // a URL set in the wrong variable is shown without its
                    // password (re-check audit: printed as it was)
                    let message = format!(
                        "{:?} is not a whole number: {key} takes a non-negative integer{unit}",
                        crate::db::redact_url(value)
                    );
                    return Err(ConfigError::Env { var, message });
                }
            },
            Some(_) => {
                return Err(ConfigError::Env {
                    var,
                    message: format!(
                        "{key} cannot be set from the environment: set it in the config file"
                    ),
                })
            }
        };
        table.insert(key, parsed);
        applied.push(var);
    }
    Ok(applied)
}

/// A config file's parse error by its line and column, without the excerpt
/// of the file that toml's own message quotes: the line of an error may hold
/// a `database_url` with its password or a secret in `env` (re-check audit:
/// printed as it was).
fn parse_error(text: &str, e: &toml::de::Error) -> String {
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            // the key of that line (a key is no secret; its value may be)
            let key = text
                .lines()
                .nth(line - 1)
                .and_then(|l| l.split_once('='))
                .map(|(k, _)| k.trim())
                .filter(|k| {
                    !k.is_empty()
                        && k.len() <= 100
                        && k.chars()
                            .all(|c| c.is_ascii_alphanumeric() || "_-.\" ".contains(c))
                });
            let message = e.message().trim_end();
            let message = key
                .and_then(|k| out_of_range_for(k.trim_matches('"'), message))
                .unwrap_or_else(|| plain_types(message));
            let key = key.map(|k| format!(" (key {k})")).unwrap_or_default();
            format!("line {line}, column {column}{key}: {message}")
        }
        None => plain_types(e.message().trim_end()),
    }
}

/// toml's message for a number out of `key`'s range, in words that name the
/// largest `key` takes where it has a bound of its own: too large (outside
/// re-check: the file's `db_max_connections = 4294967296` named the type's
/// 4294967295, and a number above 2^63 only "number too large to fit in
/// target type"), or negative for a count.
fn out_of_range_for(key: &str, message: &str) -> Option<String> {
    let limit = match key {
        // an executor's concurrency (and its warm processes, at most it) is
        // bounded by the worker's connections: total + 1 ≤ db_max_connections
        "concurrency" | "warm_processes" => u64::from(MAX_DB_CONNECTIONS - 1),
        "max_jobs_per_process" => u64::from(u32::MAX),
        k if WORKER_KEYS.iter().any(|(w, _, _)| *w == k) || k.ends_with("_ms") => integer_limit(k),
        _ => return None,
    };
    let words = limit_in_words(key);
    if message.contains("number too large to fit in target type") {
        return Some(format!(
            "the number is above {limit}, the largest {key} takes{words}"
        ));
    }
    let (raw, rest) = message
        .strip_prefix("invalid value: integer `")?
        .split_once('`')?;
    // a negative number for a count: what the key takes, without a
    // smallest value that its own check (after) may contradict (audit 80:
    // `db_max_connections = -1` said "0 or more", and 0 is refused after)
    if raw.starts_with('-') && rest.starts_with(", expected u") {
        return Some(format!(
            "{raw} is negative: {key} takes a whole number, at most {limit}{words}"
        ));
    }
    let n: u64 = raw.parse().ok()?;
    (n > limit).then(|| format!("{n} is above {limit}, the largest {key} takes{words}"))
}

/// A config built from the file and the environment that does not fit its
/// types, on one line: toml's message (in words, [`plain_types`]) and the
/// key it names ("expected u32" and "in `max_refusals`" on a line of its
/// own; re-check audit).
fn env_type_error(e: &toml::de::Error) -> String {
    let text = e.to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = plain_types(lines.next().unwrap_or_default());
    let rest: Vec<&str> = lines.collect();
    if rest.is_empty() {
        first
    } else {
        format!("{first} ({})", rest.join(", "))
    }
}

/// serde's Rust type names in a parse error, in words an operator reads:
/// `warm_processes = -1` said "expected u32" (outside audit).
fn plain_types(message: &str) -> String {
    // a number too large for its type names the type's largest value
    // (outside re-check: `max_refusals = 4294967296` said "expected a whole
    // number, 0 or more"); the keys' own, smaller bounds are checked after
    if let Some((n, rust)) = message
        .strip_prefix("invalid value: integer `")
        .and_then(|rest| rest.split_once("`, expected "))
    {
        let largest = match rust {
            "u8" => Some(u64::from(u8::MAX)),
            "u16" => Some(u64::from(u16::MAX)),
            "u32" => Some(u64::from(u32::MAX)),
            _ => None,
        };
        if let (Some(largest), Ok(n)) = (largest, n.parse::<u64>()) {
            if n > largest {
                return format!("{n} is above {largest}, the largest this setting takes");
            }
        }
    }
    const WORDS: [(&str, &str); 8] = [
        ("u8", "a whole number from 0 to 255"),
        ("u16", "a whole number from 0 to 65535"),
        // the keys' own limits (a day of milliseconds, a concurrency above
        // 0) are checked after, each named: no range here that contradicts
        // them (re-check audit)
        ("u32", "a whole number, 0 or more"),
        ("u64", "a whole number, 0 or more"),
        ("usize", "a whole number, 0 or more"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        ("i64", "a whole number"),
        ("f64", "a number"),
    ];
    for (rust, words) in WORDS {
        if let Some(head) = message.strip_suffix(&format!("expected {rust}")) {
            return format!("{head}expected {words}");
        }
    }
    message.to_owned()
}

/// The `DURABLE_<KEY>` variables of `applied` whose key a validation
/// message names: a config error listed every variable set, as if each were
/// to blame (`with DURABLE_METRICS_ADDR, DURABLE_NAME, DURABLE_WORK_DIR from
/// the environment` of a work_dir error; deployment audit).
fn env_involved(applied: &[String], message: &str) -> Vec<String> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    applied
        .iter()
        .filter(|var| {
            let key = var
                .get(ENV_PREFIX.len()..)
                .unwrap_or_default()
                .to_ascii_lowercase();
            !key.is_empty()
                && message.match_indices(key.as_str()).any(|(i, _)| {
                    let before = message[..i].chars().next_back();
                    let after = message[i + key.len()..].chars().next();
                    !before.is_some_and(is_word) && !after.is_some_and(is_word)
                })
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value of the wrong type or range names what the key takes in
    /// words, not as a Rust type.
    #[test]
    fn a_parse_error_names_the_type_in_words() {
        let exec = "[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\npersistent = true\n";
        for (line, want) in [
            (
                "warm_processes = -1",
                "(key warm_processes): -1 is negative: warm_processes takes a whole number, at most 9999",
            ),
            (
                "idle_timeout_ms = -5",
                "(key idle_timeout_ms): -5 is negative: idle_timeout_ms takes a whole number, at most 86400000 (one day of milliseconds)",
            ),
            (
                "concurrency = 4294967296",
                "(key concurrency): 4294967296 is above 9999, the largest concurrency takes",
            ),
            (
                "concurrency = \"4\"",
                "(key concurrency): invalid type: string \"4\", expected a whole number, 0 or more",
            ),
        ] {
            let text = format!("{exec}{line}\n");
            let e = toml::from_str::<WorkerConfig>(&text).expect_err(line);
            let got = parse_error(&text, &e);
            assert!(got.ends_with(want), "{line}: {got}");
            assert!(!got.contains(" u32") && !got.contains(" u64"), "{got}");
        }
        // no smallest value that its own check contradicts (audit 80: "0
        // or more", and 0 is refused after)
        let text = format!("db_max_connections = -1\n{exec}");
        let e = toml::from_str::<WorkerConfig>(&text).expect_err("negative");
        assert!(
            parse_error(&text, &e).ends_with(
                "(key db_max_connections): -1 is negative: db_max_connections takes a whole number, at most 10000"
            ),
            "{}",
            parse_error(&text, &e)
        );
        assert_eq!(plain_types("expected a boolean"), "expected a boolean");
        assert_eq!(
            plain_types("invalid value: integer `4294967296`, expected u32"),
            "4294967296 is above 4294967295, the largest this setting takes"
        );
    }

    #[test]
    fn passwords_of_urls_in_a_message_are_masked() {
        for (text, want) in [
            (
                "metrics_addr = \"postgres://u:pw@h/db\" is not an IP:PORT address",
                "metrics_addr = \"postgres://u:***@h/db\" is not an IP:PORT address",
            ),
            (
                "a postgres://u:p:w@h:5432 and b http://x:y@z?q",
                "a postgres://u:***@h:5432 and b http://x:***@z?q",
            ),
            (
                "no user postgres://h:5432/db",
                "no user postgres://h:5432/db",
            ),
            ("user only postgres://u@h/db", "user only postgres://u@h/db"),
            ("not a url: a:b@c", "not a url: a:b@c"),
            ("ends ://", "ends ://"),
        ] {
            assert_eq!(mask_url_passwords(text), want, "{text}");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "metrics_addr = \"postgres://u:hunter2@h/db\"\n[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n",
        )
        .expect("config");
        let file = WorkerConfig::load_with_env(
            &path,
            Vec::<(std::ffi::OsString, std::ffi::OsString)>::new(),
        )
        .expect_err("a URL for metrics_addr")
        .to_string();
        assert!(
            !file.contains("hunter2") && file.contains("metrics_addr"),
            "{file}"
        );
        std::fs::write(
            &path,
            "[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n",
        )
        .expect("config");
        for var in [
            "DURABLE_METRICS_ADDR",
            "DURABLE_WORK_DIR",
            "DURABLE_RETENTION",
        ] {
            let e = WorkerConfig::load_with_env(
                &path,
                [(var.into(), "postgres://u:hunter2@h/db".into())],
            );
            if let Err(e) = e {
                let e = e.to_string();
                assert!(!e.contains("hunter2"), "{var}: {e}");
            }
        }
    }

    /// A minimal config file (kept by the returned directory) and a loader of
    /// it with one `DURABLE_*` variable set: its error, if any.
    fn minimal_config_with_env() -> (tempfile::TempDir, impl Fn(&str, &str) -> Option<String>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("w.toml");
        std::fs::write(
            &path,
            "database_url = \"postgres://u@h/db\"\n[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n",
        )
        .expect("config");
        let load = move |var: &str, value: &str| {
            WorkerConfig::load_with_env(&path, [(var.into(), value.into())])
                .err()
                .map(|e| e.to_string())
        };
        (dir, load)
    }

    /// From the environment: the same words, the key on the same line, and
    /// a URL set in the wrong variable without its password.
    #[test]
    fn an_environment_error_names_the_type_in_words_and_hides_passwords() {
        let (_dir, load) = minimal_config_with_env();
        let err = |var: &str, value: &str| load(var, value).expect(var);
        let big = err("DURABLE_MAX_REFUSALS", "4294967296");
        assert!(
            big.contains("4294967296 is above 4294967295, the largest max_refusals takes"),
            "{big}"
        );
        assert!(!big.contains("u32") && !big.contains('\n'), "{big}");
        let url = err("DURABLE_DB_MAX_CONNECTIONS", "postgres://u:hunter2@h/db");
        assert!(!url.contains("hunter2") && url.contains("u:***@h"), "{url}");
        let flag = err("DURABLE_RETENTION_VACUUM", "postgres://u:hunter2@h/db");
        assert!(!flag.contains("hunter2"), "{flag}");
    }

    #[test]
    fn a_number_too_large_names_the_largest_its_setting_takes() {
        let (_dir, load) = minimal_config_with_env();
        let defaults = toml::Table::try_from(WorkerConfig::default()).expect("defaults");
        let mut checked = 0;
        for (key, value) in &defaults {
            if !matches!(value, toml::Value::Integer(_)) {
                continue;
            }
            let var = format!("{ENV_PREFIX}{}", key.to_ascii_uppercase());
            let limit = integer_limit(key);
            // one above the limit is refused, naming the limit
            for above in [u128::from(limit) + 1, u128::from(u64::MAX) + 1] {
                let e = load(&var, &above.to_string()).expect("above the limit");
                assert!(
                    e.contains(&format!(
                        "{above} is above {limit}, the largest {key} takes"
                    )),
                    "{key}: {e}"
                );
            }
            // the limit itself fits the key's type (a list that forgot a
            // u32 key would name a limit toml then refuses), and the
            // config's own checks name no smaller bound for it (it may
            // still break a rule between keys, like heartbeat < lease / 2)
            if let Some(e) = load(&var, &limit.to_string()) {
                assert!(!e.contains("expected"), "{key}: {e}");
                assert!(
                    !e.contains(&format!("{key} = {limit} is above")),
                    "{key}: {e}"
                );
            }
            checked += 1;
        }
        assert!(checked >= 15, "{checked} integer keys");
        let many = load("DURABLE_DB_MAX_CONNECTIONS", "4294967295").expect("too many");
        assert!(many.contains("is above 10000"), "{many}");
    }

    /// In the file too, a number too large names the largest its key takes
    /// (its own bound, not its type's), also above 2^63.
    #[test]
    fn a_number_too_large_in_the_file_names_its_keys_limit() {
        let exec = "\n[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n";
        for (line, want) in [
            (
                "db_max_connections = 4294967296",
                "4294967296 is above 10000, the largest db_max_connections takes",
            ),
            (
                "lease_ttl_ms = 18446744073709551616",
                "the number is above 86400000, the largest lease_ttl_ms takes (one day of milliseconds)",
            ),
            (
                "max_frame_bytes = 18446744073709551615",
                "the number is above 1073741824, the largest max_frame_bytes takes (1 GiB)",
            ),
            (
                "max_refusals = 4294967296",
                "4294967296 is above 4294967295, the largest max_refusals takes",
            ),
        ] {
            let text = format!("{line}{exec}");
            let e = toml::from_str::<WorkerConfig>(&text).expect_err(line);
            let got = parse_error(&text, &e);
            assert!(got.ends_with(want), "{line}: {got}");
        }
        // an executor's keys too: concurrency is bounded by the connections
        for (line, want) in [
            (
                "concurrency = 4294967296",
                "4294967296 is above 9999, the largest concurrency takes",
            ),
            (
                "warm_processes = 9223372036854775808",
                "the number is above 9999, the largest warm_processes takes",
            ),
        ] {
            let text = format!("[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n{line}\n");
            let e = toml::from_str::<WorkerConfig>(&text).expect_err(line);
            let got = parse_error(&text, &e);
            assert!(got.ends_with(want), "{line}: {got}");
        }
    }

    /// A concurrency no worker can serve says so, not "raise
    /// db_max_connections" past its own limit (outside audit 80 #2).
    #[test]
    fn a_concurrency_beyond_any_pool_says_so() {
        let cfg = WorkerConfig {
            database_url: Some("postgres://u@h/db".into()),
            executors: vec![ExecutorConfig {
                name: "x".into(),
                command: "/bin/true".into(),
                concurrency: 4_294_967_295,
                ..ExecutorConfig::default()
            }],
            ..WorkerConfig::default()
        };
        let e = cfg.validate().expect_err("too many").to_string();
        assert!(
            e.contains("total concurrency (4294967295) is above 9999")
                && !e.contains("at least 4294967"),
            "{e}"
        );
    }

    #[test]
    fn a_worker_name_is_plain() {
        let base = || WorkerConfig {
            database_url: Some("postgres://u@h/db".into()),
            executors: vec![ExecutorConfig {
                name: "x".into(),
                command: "/bin/true".into(),
                ..ExecutorConfig::default()
            }],
            ..WorkerConfig::default()
        };
        let named = |name: String| {
            let cfg = WorkerConfig {
                name: Some(name),
                ..base()
            };
            cfg.validate().err().map(|e| e.to_string())
        };
        assert_eq!(named("ingest-1".into()), None);
        assert_eq!(named("host:1234".into()), None);
        assert_eq!(named("é".repeat(MAX_NAME_CHARS)), None);
        let url = named("postgres://u:hunter2@db/x".into()).expect("a URL with a password");
        assert!(
            !url.contains("hunter2") && url.contains("u:***@db") && url.contains("password"),
            "{url}"
        );
        for bad in ["a\nb".to_string(), "x".repeat(MAX_NAME_CHARS + 1)] {
            let e = named(bad.clone()).expect("refused");
            assert!(
                e.contains("at most 128 characters with no control"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_config_error_names_only_the_variables_it_is_about() {
        let applied: Vec<String> = ["DURABLE_METRICS_ADDR", "DURABLE_NAME", "DURABLE_WORK_DIR"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            env_involved(&applied, "work_dir \"/x\" does not exist"),
            vec!["DURABLE_WORK_DIR"]
        );
        assert_eq!(
            env_involved(&applied, "db_max_connections = 10 is smaller than 12"),
            Vec::<String>::new(),
            "no variable named: none"
        );
        // a key inside a longer word is not that key
        assert_eq!(
            env_involved(&applied, "work_dir_mode is bad; rename it"),
            Vec::<String>::new()
        );
        assert_eq!(
            env_involved(&applied, "name and metrics_addr clash"),
            vec!["DURABLE_METRICS_ADDR", "DURABLE_NAME"]
        );
    }

    /// `max_jobs_per_process`: -1 is "no cap of the config's", as the SDKs
    /// say unlimited; other negative or too large values name the key.
    #[test]
    fn max_jobs_per_process_takes_minus_one_for_no_cap() {
        let with = |v: &str| {
            toml::from_str::<WorkerConfig>(&format!(
                "[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\npersistent = true\n{v}"
            ))
        };
        let cap = |v: &str| with(v).expect("parses").executors[0].max_jobs_per_process;
        assert_eq!(cap(""), None);
        assert_eq!(cap("max_jobs_per_process = -1"), None);
        assert_eq!(cap("max_jobs_per_process = 7"), Some(7));
        for bad in ["-2", "99999999999"] {
            let e = with(&format!("max_jobs_per_process = {bad}"))
                .expect_err("refused")
                .to_string();
            assert!(
                e.contains(&format!("max_jobs_per_process = {bad}")) && e.contains("-1"),
                "{e}"
            );
        }
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let cfg: WorkerConfig = toml::from_str(
            r#"
            [[executors]]
            name = "go"
            command = "bin/x"
            "#,
        )
        .expect("parse");
        assert_eq!(cfg.lease_ttl_ms, 10_000);
        assert_eq!(cfg.executors[0].concurrency, 4);
        assert!(cfg.executors[0].env_allowlist.contains(&"PATH".to_string()));
        // no secrets unless listed, and none read from files unless configured
        assert!(cfg.executors[0].secrets.is_empty());
        assert_eq!(cfg.secrets_dir, None);
        assert!(ExecutorConfig::default().secrets.is_empty());
        assert_eq!(WorkerConfig::default().secrets_dir, None);
        cfg.validate().expect("valid");
        let err = toml::from_str::<WorkerConfig>("lease_ttl = 5").expect_err("unknown field");
        assert!(err.to_string().contains("lease_ttl"), "{err}");
        let err = toml::from_str::<WorkerConfig>(
            "[[executors]]\nname = \"a\"\ncommand = \"a\"\nsecret = [\"X\"]\n",
        )
        .expect_err("unknown executor field");
        assert!(err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn artifact_store_settings_are_checked_by_name() {
        let base = "[[executors]]\nname = \"a\"\ncommand = \"a\"\n";
        let cfg: WorkerConfig = toml::from_str(base).expect("parse");
        assert_eq!(cfg.artifact_store, ArtifactBackend::Postgres);
        assert_eq!(cfg.artifact_chunk_bytes, 1 << 20);
        let invalid = |toml_text: &str| -> String {
            let cfg: WorkerConfig = toml::from_str(&format!("{toml_text}\n{base}")).expect("parse");
            cfg.validate().expect_err("invalid").to_string()
        };
        assert!(invalid("artifact_store = \"directory\"").contains("needs artifact_dir"));
        assert!(invalid(
            "artifact_store = \"directory\"\nartifact_dir = \"/nonexistent/durable-artifacts\""
        )
        .contains(
            "artifact_dir = \"/nonexistent/durable-artifacts\" is not an existing directory"
        ));
        assert!(invalid("artifact_chunk_bytes = 100").contains("artifact_chunk_bytes = 100"));
        let err = toml::from_str::<WorkerConfig>(&format!("artifact_store = \"s3\"\n{base}"))
            .expect_err("unknown backend");
        assert!(err.to_string().contains("postgres"), "{err}");
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg: WorkerConfig = toml::from_str(&format!(
            "artifact_store = \"directory\"\nartifact_dir = {:?}\n{base}",
            dir.path().display().to_string()
        ))
        .expect("parse");
        cfg.validate()
            .expect("a directory store with its directory");
    }

    #[test]
    fn heartbeat_must_fit_in_the_lease() {
        let mut cfg: WorkerConfig =
            toml::from_str("[[executors]]\nname = \"a\"\ncommand = \"a\"\n").expect("parse");
        cfg.heartbeat_interval_ms = 6_000;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn relative_commands_resolve_against_the_base() {
        let mut cfg: WorkerConfig = toml::from_str(
            "[[executors]]\nname = \"a\"\ncommand = \"target/x\"\n[[executors]]\nname = \"b\"\ncommand = \"sh\"\n",
        )
        .expect("parse");
        cfg.resolve_paths(Path::new("/repo"));
        assert_eq!(cfg.executors[0].command, "/repo/target/x");
        assert_eq!(cfg.executors[1].command, "sh");
    }

    #[test]
    fn secret_names_are_validated() {
        let long = format!("T{}", "_".repeat(127));
        let too_long = format!("T{}", "_".repeat(128));
        for (names, ok) in [
            (vec![], true),
            (vec!["REPORT_API_TOKEN", "_x", "a1"], true),
            (vec![long.as_str()], true),
            (vec!["OK", ""], false),
            (vec!["1ST"], false),
            (vec!["API-TOKEN"], false),
            (vec!["../etc/passwd"], false),
            (vec!["A B"], false),
            (vec![too_long.as_str()], false),
        ] {
            let toml =
                format!("[[executors]]\nname = \"go\"\ncommand = \"x\"\nsecrets = {names:?}\n");
            let cfg: WorkerConfig = toml::from_str(&toml).expect("parse");
            assert_eq!(cfg.executors[0].secrets, names, "{toml}");
            match cfg.validate() {
                Ok(()) => assert!(ok, "{names:?} accepted"),
                Err(e) => {
                    assert!(!ok, "{names:?}: {e}");
                    let msg = e.to_string();
                    assert!(
                        msg.contains("executor \"go\": secrets entry")
                            && msg.contains("REPORT_API_TOKEN"),
                        "{msg}"
                    );
                }
            }
        }
    }

    #[test]
    fn secrets_dir_must_be_a_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").expect("write");
        let missing = dir.path().join("missing");
        for (secrets_dir, ok) in [
            (None, true),
            (Some(dir.path().to_owned()), true),
            (Some(file), false),
            (Some(missing), false),
        ] {
            let cfg = WorkerConfig {
                secrets_dir: secrets_dir.clone(),
                executors: vec![ExecutorConfig {
                    name: "a".into(),
                    command: "a".into(),
                    ..ExecutorConfig::default()
                }],
                ..WorkerConfig::default()
            };
            match cfg.validate() {
                Ok(()) => assert!(ok, "{secrets_dir:?} accepted"),
                Err(e) => {
                    assert!(!ok, "{secrets_dir:?}: {e}");
                    let msg = e.to_string();
                    assert!(
                        msg.contains("secrets_dir = ")
                            && msg.contains("is not an existing directory")
                            && msg.contains("remove secrets_dir"),
                        "{msg}"
                    );
                }
            }
        }
    }

    #[test]
    fn secrets_survive_print_and_parse() {
        let mut cfg = WorkerConfig {
            secrets_dir: Some(PathBuf::from("/run/secrets")),
            ..WorkerConfig::default()
        };
        let mut e = ExecutorConfig {
            name: "go".into(),
            command: "/bin/x".into(),
            secrets: vec!["REPORT_API_TOKEN".into()],
            ..ExecutorConfig::default()
        };
        e.env.insert("K".into(), "v".into());
        cfg.executors.push(e);
        let text = toml::to_string(&cfg).expect("print");
        let back: WorkerConfig = toml::from_str(&text).expect("parse");
        assert_eq!(back.secrets_dir, cfg.secrets_dir, "{text}");
        assert_eq!(
            back.executors[0].secrets,
            ["REPORT_API_TOKEN".to_string()],
            "{text}"
        );
    }

    fn vars(v: &[(&str, &str)]) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
        v.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    #[test]
    fn environment_overrides_are_typed_like_their_setting() {
        let mut t = toml::Table::new();
        let applied = apply_env(
            &mut t,
            vars(&[
                ("DURABLE_LEASE_TTL_MS", "5000"),
                ("DURABLE_NAME", "w-1"),
                ("DURABLE_SECRETS_DIR", "/run/secrets"),
                ("DURABLE_POLL_INTERVAL_MS", ""),
                ("DURABLE_CGROUPS", "0"),
                ("LEASE_TTL_MS", "1"),
            ]),
        )
        .expect("apply");
        assert_eq!(
            applied,
            [
                "DURABLE_LEASE_TTL_MS",
                "DURABLE_NAME",
                "DURABLE_SECRETS_DIR"
            ]
        );
        assert_eq!(t.get("lease_ttl_ms"), Some(&toml::Value::Integer(5000)));
        assert_eq!(t.get("name"), Some(&toml::Value::String("w-1".into())));
        assert!(!t.contains_key("poll_interval_ms") && !t.contains_key("cgroups"));
        let cfg: WorkerConfig = toml::Value::Table(t).try_into().expect("config");
        assert_eq!(cfg.lease_ttl_ms, 5000);
        assert_eq!(cfg.secrets_dir, Some(PathBuf::from("/run/secrets")));

        for (var, value) in [
            ("DURABLE_LEASE_TTL_MS", "5s"),
            ("DURABLE_MAX_REFUSALS", "-1"),
            ("DURABLE_MAX_RESULT_BYTES", "99999999999999999999"),
            ("DURABLE_EXECUTORS", "[]"),
        ] {
            let e = apply_env(&mut toml::Table::new(), vars(&[(var, value)]))
                .expect_err(value)
                .to_string();
            assert!(e.contains(var), "{e}");
        }
    }

    #[test]
    fn metrics_addr_and_the_stderr_rate_are_validated_naming_the_key() {
        let mut cfg: WorkerConfig =
            toml::from_str("[[executors]]\nname = \"a\"\ncommand = \"a\"\n").expect("parse");
        assert_eq!(cfg.metrics_addr, None, "no metrics unless asked");
        assert_eq!(cfg.stderr_log_lines_per_sec, 20);
        for (addr, ok) in [
            ("127.0.0.1:9464", true),
            ("0.0.0.0:0", true),
            ("[::1]:9464", true),
            ("localhost:9464", false),
            ("9464", false),
            ("127.0.0.1", false),
            ("", false),
        ] {
            cfg.metrics_addr = Some(addr.into());
            match cfg.validate() {
                Ok(()) => assert!(ok, "{addr:?} accepted"),
                Err(e) => {
                    assert!(!ok, "{addr:?}: {e}");
                    let m = e.to_string();
                    assert!(
                        m.contains("metrics_addr = ") && m.contains("IP:PORT"),
                        "{m}"
                    );
                }
            }
        }
        cfg.metrics_addr = None;
        cfg.stderr_log_lines_per_sec = MAX_STDERR_LOG_LINES_PER_SEC + 1;
        let m = cfg.validate().expect_err("too many lines").to_string();
        assert!(m.contains("stderr_log_lines_per_sec"), "{m}");
        cfg.stderr_log_lines_per_sec = 0;
        cfg.validate().expect("0 logs none");

        let mut t = toml::Table::new();
        let applied = apply_env(
            &mut t,
            vars(&[
                ("DURABLE_METRICS_ADDR", "127.0.0.1:9100"),
                ("DURABLE_STDERR_LOG_LINES_PER_SEC", "7"),
                ("DURABLE_LOG_FORMAT", "json"),
            ]),
        )
        .expect("apply");
        assert_eq!(
            applied,
            ["DURABLE_METRICS_ADDR", "DURABLE_STDERR_LOG_LINES_PER_SEC"],
            "the log format is the command's, not the config's"
        );
        let cfg: WorkerConfig = toml::Value::Table(t).try_into().expect("config");
        assert_eq!(cfg.metrics_addr.as_deref(), Some("127.0.0.1:9100"));
        assert_eq!(cfg.stderr_log_lines_per_sec, 7);
    }

    #[test]
    fn the_default_config_text_parses_back_to_the_defaults() {
        let text = WorkerConfig::default_config_toml();
        let cfg: WorkerConfig = toml::from_str(&text).expect("parse");
        assert_eq!(cfg, WorkerConfig::default());
        assert!(text.contains("#[[executors]]"));
    }

    #[test]
    fn ranges_are_checked_before_arithmetic() {
        let mut cfg: WorkerConfig =
            toml::from_str("[[executors]]\nname = \"a\"\ncommand = \"a\"\n").expect("parse");
        cfg.heartbeat_interval_ms = u64::MAX;
        let e = cfg.validate().expect_err("huge").to_string();
        assert!(
            e.contains("heartbeat_interval_ms") && e.contains("one day"),
            "{e}"
        );
        cfg.heartbeat_interval_ms = 2_000;
        cfg.executors[0].concurrency = u32::MAX;
        let e = cfg.validate().expect_err("huge concurrency").to_string();
        assert!(e.contains("db_max_connections"), "{e}");
    }
}
