//! The `supervisor` command (CONTRACT §2). Exit codes: 0 ok; 1 a run failed
//! (watch) or a runtime error; 2 bad input (invalid spec, bad config, usage);
//! 3 a run was cancelled (watch); 4 unknown run or step.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{ConfigError, ExecutorConfig, WorkerConfig};
use crate::db::{Db, DbError};
use crate::worker::{Worker, WorkerError};

#[derive(Debug, Parser)]
#[command(
    name = "supervisor",
    version,
    about = "Durable workflow runtime: leases steps from PostgreSQL and runs them in Go/Python executors"
)]
pub struct Cli {
    /// PostgreSQL URL (or DATABASE_URL).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Log format on stderr.
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the migrations (safe to run again).
    Migrate,
    /// Run one worker until SIGTERM/SIGINT, then drain.
    Worker {
        #[arg(long)]
        config: PathBuf,
    },
    /// Validate and submit a workflow spec (a file, or - for stdin).
    Submit {
        file: String,
        #[arg(long)]
        json: bool,
    },
    /// Show a run and its steps.
    Status {
        run_id: String,
        #[arg(long)]
        json: bool,
    },
    /// Request cancellation of a run, or of one step (durable).
    Cancel {
        run_id: String,
        #[arg(long)]
        step: Option<String>,
    },
    /// Local development.
    Dev {
        /// Print the worker config (TOML) for the bundled demo executors, and exit.
        #[arg(long)]
        print_config: bool,
        /// Submit this spec (a file, or -) once the worker runs.
        #[arg(long)]
        submit: Option<String>,
        /// Stop (after draining) once no run is pending or running.
        #[arg(long)]
        exit_when_idle: bool,
        /// Port of the local cluster started under ./.dev/ when DATABASE_URL is unset.
        #[arg(long, default_value_t = 54330)]
        dev_port: u16,
    },
    /// Start each configured executor, handshake, print its capabilities, stop it.
    Executors {
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Dev(#[from] crate::dev::DevError),
    #[error(
        "no database: pass --database-url or set DATABASE_URL (e.g. postgres://user@localhost/db)"
    )]
    NoDatabase,
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid spec: not JSON: {0}")]
    NotJson(String),
    #[error("{0:?} is not a run id (a UUID)")]
    BadRunId(String),
    #[error("{0}")]
    Other(String),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Db(DbError::InvalidSpec(_)) | CliError::NotJson(_) => 2,
            CliError::Config(_) | CliError::NoDatabase | CliError::Read { .. } => 2,
            CliError::Db(DbError::NotFound(_)) | CliError::BadRunId(_) => 4,
            _ => 1,
        }
    }
}

fn init_tracing(format: &str) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

pub async fn main_with(cli: Cli) -> ExitCode {
    init_tracing(&cli.log_format);
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

async fn connect(url: &Option<String>, conns: u32) -> Result<Db, CliError> {
    let url = url.as_deref().ok_or(CliError::NoDatabase)?;
    Ok(Db::connect(url, conns).await?)
}

fn parse_run_id(s: &str) -> Result<Uuid, CliError> {
    Uuid::parse_str(s.trim()).map_err(|_| CliError::BadRunId(s.to_owned()))
}

async fn run(cli: Cli) -> Result<u8, CliError> {
    match cli.command {
        Command::Migrate => {
            let db = connect(&cli.database_url, 2).await?;
            db.migrate().await?;
            eprintln!("migrations applied");
            Ok(0)
        }
        Command::Submit { file, json } => {
            let text = read_input(&file)?;
            let spec: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| CliError::NotJson(e.to_string()))?;
            let db = connect(&cli.database_url, 2).await?;
            // no DDL here: a submitter needs no schema rights, and an older
            // CLI never migrates a newer schema; it only checks the version
            db.check_schema().await?;
            let id = db.submit(&spec).await?;
            if json {
                println!("{}", serde_json::json!({ "run_id": id }));
            } else {
                println!("{id}");
            }
            Ok(0)
        }
        Command::Status { run_id, json } => {
            let id = parse_run_id(&run_id)?;
            let db = connect(&cli.database_url, 2).await?;
            let status = db.status(id).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&status).unwrap_or_default()
                );
            } else {
                println!("run {} {:?}: {}", status.run_id, status.name, status.state);
                for s in &status.steps {
                    let err = s
                        .error
                        .as_ref()
                        .map(|e| format!("  {}: {}", e.code, e.message))
                        .unwrap_or_default();
                    println!(
                        "  {:<24} {:<17} attempt {:<3}{}",
                        s.name, s.state, s.attempt, err
                    );
                }
                for w in &status.waiting {
                    println!("  {:<24} waiting on {}", w.name, w.depends_on.join(", "));
                }
            }
            Ok(0)
        }
        Command::Cancel { run_id, step } => {
            let id = parse_run_id(&run_id)?;
            let db = connect(&cli.database_url, 2).await?;
            let state = db.cancel(id, step.as_deref()).await?;
            eprintln!("cancellation requested; run is {state}");
            Ok(0)
        }
        Command::Worker { config } => {
            let cfg = WorkerConfig::load(&config)?;
            let url = cli.database_url.clone().or(cfg.database_url.clone());
            // SIGTERM during start-up (probes, the sweep) is a clean stop too
            let shutdown = CancellationToken::new();
            spawn_signal_handler(shutdown.clone());
            let db = connect(&url, cfg.db_max_connections).await?;
            let worker = Worker::start(db, cfg).await?;
            let res = worker.run(shutdown).await;
            // the last line of defence: no child outlives the worker process
            crate::process::kill_all_groups();
            res?;
            Ok(0)
        }
        Command::Dev {
            print_config,
            submit,
            exit_when_idle,
            dev_port,
        } => {
            let cfg = dev_config(&repo_root());
            if print_config {
                print!(
                    "{}",
                    toml::to_string_pretty(&cfg).map_err(|e| CliError::Other(e.to_string()))?
                );
                return Ok(0);
            }
            crate::dev::check_executors(&cfg)?;
            let spec = submit
                .as_deref()
                .map(|f| {
                    let text = read_input(f)?;
                    serde_json::from_str::<serde_json::Value>(&text)
                        .map_err(|e| CliError::NotJson(e.to_string()))
                })
                .transpose()?;
            let cluster = match &cli.database_url {
                Some(_) => None,
                None => Some(crate::dev::DevCluster::ensure(
                    &std::env::current_dir().unwrap_or_default().join(".dev"),
                    dev_port,
                )?),
            };
            let url = cli
                .database_url
                .clone()
                .or_else(|| cluster.as_ref().map(|c| c.url.clone()));
            let result = dev_session(url, cfg, spec, exit_when_idle).await;
            if let Some(c) = cluster {
                c.stop();
            }
            result
        }
        Command::Executors { config } => {
            let cfg = WorkerConfig::load(&config)?;
            let spawner = crate::process::Spawner::start().map_err(WorkerError::Spawner)?;
            let mut all_ok = true;
            for e in &cfg.executors {
                match crate::worker::probe(&spawner, e, &cfg).await {
                    Ok(h) => {
                        let routes = crate::worker::routing::routes(&h, e);
                        println!(
                            "{}",
                            serde_json::json!({
                                "executor": e.name,
                                "executor_kind": h.executor_kind,
                                "kinds": h.kinds,
                                "labels": crate::worker::routing::effective_labels(&h, e),
                                "sdk": format!("{} {}", h.sdk_name, h.sdk_version),
                                "protocol_version": h.protocol_version,
                                "routes": routes.len(),
                            })
                        );
                    }
                    Err(err) => {
                        all_ok = false;
                        eprintln!("error: {err}");
                    }
                }
            }
            Ok(if all_ok { 0 } else { 1 })
        }
    }
}

/// Runs a worker with the bundled executors; optionally submits a spec and
/// stops once nothing is left to do.
async fn dev_session(
    url: Option<String>,
    cfg: WorkerConfig,
    spec: Option<serde_json::Value>,
    exit_when_idle: bool,
) -> Result<u8, CliError> {
    let db = connect(&url, cfg.db_max_connections).await?;
    // dev owns its database: it migrates (a plain worker does not)
    db.migrate().await?;
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let worker = Worker::start(db.clone(), cfg).await?;
    let mut run_id = None;
    if let Some(spec) = spec {
        let id = db.submit(&spec).await?;
        println!("{}", serde_json::json!({ "run_id": id }));
        run_id = Some(id);
    }
    if exit_when_idle {
        let (db2, stop) = (db.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                match db2.open_runs().await {
                    Ok(0) => {
                        tracing::info!("no run is pending or running: stopping");
                        stop.cancel();
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "cannot count open runs"),
                }
            }
        });
    }
    let res = worker.run(shutdown).await;
    crate::process::kill_all_groups();
    res?;
    if let Some(id) = run_id {
        let st = db.status(id).await?;
        eprintln!("run {} {:?}: {}", st.run_id, st.name, st.state);
        for s in &st.steps {
            eprintln!("  {:<24} {:<17} attempt {}", s.name, s.state, s.attempt);
        }
    }
    Ok(0)
}

fn read_input(file: &str) -> Result<String, CliError> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|source| CliError::Read {
                path: "stdin".into(),
                source,
            })?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).map_err(|source| CliError::Read {
            path: file.to_owned(),
            source,
        })
    }
}

fn spawn_signal_handler(token: CancellationToken) {
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = int.recv() => tracing::info!("SIGINT: draining"),
        }
        token.cancel();
        // a second signal stops children at once
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal: stopping all executors now");
        crate::process::kill_all_groups();
        std::process::exit(1);
    });
}

/// The repository root: where the bundled executors live. The build's own
/// source tree when it still exists, else the working directory.
pub fn repo_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if built.join("executors-go").is_dir() {
        built.canonicalize().unwrap_or(built)
    } else {
        std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
    }
}

/// The worker config of `supervisor dev`: the two bundled demo executors.
pub fn dev_config(root: &Path) -> WorkerConfig {
    let mut cfg = WorkerConfig {
        name: Some("dev".into()),
        ..WorkerConfig::default()
    };
    let go = ExecutorConfig {
        name: "go-demo".into(),
        command: root
            .join("target/executors/demo-executor-go")
            .to_string_lossy()
            .into_owned(),
        // the bundled executors stay warm between jobs
        persistent: true,
        ..ExecutorConfig::default()
    };
    let py = ExecutorConfig {
        name: "python-demo".into(),
        command: root.join(".venv/bin/python").to_string_lossy().into_owned(),
        args: vec![root
            .join("executors-python/demo_executor.py")
            .to_string_lossy()
            .into_owned()],
        persistent: true,
        ..ExecutorConfig::default()
    };
    cfg.executors = vec![go, py];
    cfg
}
