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
    256 * 1024 * 1024
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
    512 * 1024 * 1024
}
fn d_concurrency() -> u32 {
    4
}
fn d_allowlist() -> Vec<String> {
    ["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// `supervisor worker --config FILE`.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// The largest artifact accepted (held in memory, stored in PostgreSQL).
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
    /// The most bytes all artifacts of one result may hold together (they
    /// reach PostgreSQL in one message, whose limit is 1 GiB).
    #[serde(default = "d_max_result")]
    pub max_result_bytes: u64,
    /// Where per-attempt working directories are created (default: the system temp dir).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_dir: Option<PathBuf>,
    /// Where secret values are read from: the file `<secrets_dir>/<NAME>` (one
    /// trailing newline stripped, as Docker and Kubernetes mount secrets).
    /// Unset: from the worker's environment. Which names an executor may
    /// receive at all is its `secrets` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_dir: Option<PathBuf>,
    #[serde(default)]
    pub executors: Vec<ExecutorConfig>,
}

/// One executor: a plain binary or script speaking the executor protocol.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// Caps the jobs one persistent process serves (default: what its hello says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_jobs_per_process: Option<u32>,
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
            work_dir: None,
            secrets_dir: None,
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
        }
    }
}

impl ExecutorConfig {
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
    pub fn load(path: &Path) -> Result<WorkerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut cfg: WorkerConfig = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        cfg.resolve_paths(
            &std::env::current_dir().map_err(|source| ConfigError::Read {
                path: PathBuf::from("."),
                source,
            })?,
        );
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn resolve_paths(&mut self, base: &Path) {
        for e in &mut self.executors {
            let p = Path::new(&e.command);
            if e.command.contains('/') && p.is_relative() {
                e.command = base.join(p).to_string_lossy().into_owned();
            }
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.lease_ttl_ms < 200 {
            return bad(format!("lease_ttl_ms = {} is below 200", self.lease_ttl_ms));
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms * 2 > self.lease_ttl_ms {
            return bad(format!(
                "heartbeat_interval_ms = {} must be positive and at most half of lease_ttl_ms = {}, so one late heartbeat does not lose the lease",
                self.heartbeat_interval_ms, self.lease_ttl_ms
            ));
        }
        if self.poll_interval_ms == 0 || self.reclaim_interval_ms == 0 {
            return bad("poll_interval_ms and reclaim_interval_ms must be positive".into());
        }
        if self.max_frame_bytes < 1024 {
            return bad("max_frame_bytes must be at least 1024".into());
        }
        if self.executors.is_empty() {
            return bad("no [[executors]]: a worker needs at least one".into());
        }
        let stop = self.cancel_grace_ms + self.term_grace_ms + 2 * self.heartbeat_interval_ms;
        if stop > self.lease_ttl_ms {
            return bad(format!(
                "cancel_grace_ms ({}) + term_grace_ms ({}) + 2 * heartbeat_interval_ms ({}) = {stop} must fit in lease_ttl_ms ({}): a child must be stopped before its lease can expire. Raise lease_ttl_ms or shorten the graces",
                self.cancel_grace_ms, self.term_grace_ms, self.heartbeat_interval_ms, self.lease_ttl_ms
            ));
        }
        let concurrency: u32 = self.executors.iter().map(|e| e.concurrency).sum();
        if self.db_max_connections < concurrency + 1 {
            return bad(format!(
                "db_max_connections = {} is smaller than the executors' total concurrency ({concurrency}) + 1: every running attempt may need a connection for its writes, plus one for leasing. Raise db_max_connections to at least {}",
                self.db_max_connections,
                concurrency + 1
            ));
        }
        if self.max_refusals == 0 {
            return bad("max_refusals must be at least 1".into());
        }
        if self.max_artifact_bytes > self.max_result_bytes
            || self.max_result_bytes > 900 * 1024 * 1024
        {
            return bad(format!(
                "max_artifact_bytes ({}) must be at most max_result_bytes ({}), which must be at most 900 MiB (PostgreSQL's message limit is 1 GiB)",
                self.max_artifact_bytes, self.max_result_bytes
            ));
        }
        if let Some(dir) = &self.secrets_dir {
            if !dir.is_dir() {
                return bad(format!(
                    "secrets_dir = {:?} is not an existing directory: create it (one file per secret, named like the secret) or remove secrets_dir to read secrets from the worker's environment",
                    dir.display().to_string()
                ));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for e in &self.executors {
            if e.name.is_empty() || !names.insert(e.name.clone()) {
                return bad(format!(
                    "executor names must be unique and non-empty: {:?}",
                    e.name
                ));
            }
            if e.command.is_empty() {
                return bad(format!("executor {:?} has no command", e.name));
            }
            if e.concurrency == 0 {
                return bad(format!(
                    "executor {:?}: concurrency must be at least 1",
                    e.name
                ));
            }
            if let Some(s) = e.secrets.iter().find(|s| !crate::secrets::is_valid_name(s)) {
                return bad(format!(
                    "executor {:?}: secrets entry {s:?} is not a secret name: use letters, digits and _, not starting with a digit, at most 128 characters (like REPORT_API_TOKEN)",
                    e.name
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
