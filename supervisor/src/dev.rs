//! `supervisor dev`: local development in one command. With no DATABASE_URL it
//! runs its own PostgreSQL cluster under `./.dev/` (data kept between runs,
//! server stopped at exit), migrates, and runs a worker with the bundled Go and
//! Python demo executors.

use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error("no PostgreSQL server binaries found in /usr/lib/postgresql/*/bin: install them (Debian: apt-get install postgresql) or set DATABASE_URL")]
    NoPostgres,
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    #[error("port {0} on 127.0.0.1 is in use by another server: pass --dev-port N to run the dev PostgreSQL on another port, or set DATABASE_URL to use that server")]
    PortInUse(u16),
    #[error(
        "the bundled executor {0} is missing: run scripts/setup from the repository root first"
    )]
    MissingExecutor(PathBuf),
    #[error("building the bundled executors with {script} failed ({status}): it needs Go and Python 3.11 with venv and pip (Debian: apt-get install golang python3-venv); see the output above, fix it and run scripts/setup")]
    Setup { script: PathBuf, status: String },
}

/// A local cluster under `dir`, started on `port`. Every dev session using
/// it holds a shared lock on `dir/sessions.lock`; the last one to leave stops
/// the server, and only when a dev session started it (`dir/started-by-dev`):
/// a second session in the same directory stopped the first one's database
/// when it exited, and a server the user started was stopped too.
#[derive(Debug)]
pub struct DevCluster {
    bin: PathBuf,
    dir: PathBuf,
    pub url: String,
    session: std::fs::File,
}

const SESSIONS_LOCK: &str = "sessions.lock";
const STARTED_BY_DEV: &str = "started-by-dev";

fn flock(f: &std::fs::File, op: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this File owns
    if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Runs a PostgreSQL tool as the cluster's owner: as root that is the
/// `postgres` system user, since initdb refuses to run as root.
fn pg_tool(bin: &Path, tool: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin.join(tool));
        c
    } else {
        Command::new(bin.join(tool))
    }
}

fn run(mut c: Command, what: &str) -> Result<(), DevError> {
    let out = c.output().map_err(|e| DevError::Command {
        what: what.into(),
        detail: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DevError::Command {
            what: what.into(),
            detail: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
            .trim()
            .to_owned(),
        })
    }
}

fn find_bin() -> Result<PathBuf, DevError> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| DevError::NoPostgres)?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b).ok_or(DevError::NoPostgres)
}

impl DevCluster {
    /// Creates the cluster if needed and starts it if it is not running.
    pub fn ensure(dir: &Path, port: u16) -> Result<DevCluster, DevError> {
        let bin = find_bin()?;
        std::fs::create_dir_all(dir).map_err(|e| DevError::Command {
            what: format!("creating {}", dir.display()),
            detail: e.to_string(),
        })?;
        let session = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(SESSIONS_LOCK))
            .and_then(|f| flock(&f, libc::LOCK_SH).map(|()| f))
            .map_err(|e| DevError::Command {
                what: format!("locking {}", dir.join(SESSIONS_LOCK).display()),
                detail: e.to_string(),
            })?;
        if is_root() {
            let mut c = Command::new("chown");
            c.arg("postgres:").arg(dir);
            run(c, "chown of the dev cluster directory to postgres")?;
        }
        let data = dir.join("data");
        if !data.join("PG_VERSION").exists() {
            let mut c = pg_tool(&bin, "initdb");
            c.arg("-D").arg(&data).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
            ]);
            run(c, "initdb").map_err(|e| unreachable_as_postgres(e, dir))?;
        }
        let mut status = pg_tool(&bin, "pg_ctl");
        status.arg("-D").arg(&data).arg("status");
        let running = status.output().map(|o| o.status.success()).unwrap_or(false);
        let mut port = port;
        if running {
            // another session's server: on the port it was started with,
            // whatever --dev-port says now (new-user audit: a second session
            // given another port printed that port's URL and failed to
            // connect, blaming DATABASE_URL)
            if let Some(actual) = running_port(&data).filter(|p| *p != port) {
                eprintln!(
                    "the dev PostgreSQL of {} already runs on port {actual} (not --dev-port {port}): using it",
                    dir.display()
                );
                port = actual;
            }
        } else {
            if std::net::TcpStream::connect_timeout(
                &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                std::time::Duration::from_millis(300),
            )
            .is_ok()
            {
                return Err(DevError::PortInUse(port));
            }
            // TCP only (dev connects over it): no Unix socket, whose path
            // in ./.dev broke a directory with a space in its name (the -o
            // string is split on blanks) or one deeper than PostgreSQL's
            // 107-byte socket path limit
            let mut c = pg_tool(&bin, "pg_ctl");
            c.arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(dir.join("server.log"))
                .args(["-w", "-t", "60", "start", "-o"])
                .arg(format!(
                    "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''"
                ));
            run(c, "starting the dev PostgreSQL (see .dev/server.log)")?;
            let _ = std::fs::write(dir.join(STARTED_BY_DEV), std::process::id().to_string());
        }
        Ok(DevCluster {
            bin,
            dir: dir.to_owned(),
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            session,
        })
    }

    /// Stops the server when this is the last dev session using it and a
    /// dev session started it; the data stays for the next run.
    pub fn stop(self) {
        if flock(&self.session, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            tracing::info!("another dev session uses the dev PostgreSQL: left running");
            return;
        }
        let marker = self.dir.join(STARTED_BY_DEV);
        if !marker.exists() {
            tracing::info!("the dev PostgreSQL was running before dev started: left running");
            return;
        }
        let mut c = pg_tool(&self.bin, "pg_ctl");
        c.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "stop"]);
        match run(c, "stopping the dev PostgreSQL") {
            Ok(()) => {
                let _ = std::fs::remove_file(marker);
            }
            Err(e) => tracing::warn!(error = %e, "dev cluster did not stop cleanly"),
        }
    }
}

/// The port a running server of `data` listens on: the fourth line of its
/// `postmaster.pid`.
fn running_port(data: &Path) -> Option<u16> {
    std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()?
        .lines()
        .nth(3)?
        .trim()
        .parse()
        .ok()
}

/// initdb runs as the `postgres` user when dev runs as root: a directory that
/// user cannot enter (anything under /root) fails it with a bare
/// "Permission denied". Say why, and what to do.
fn unreachable_as_postgres(e: DevError, dir: &Path) -> DevError {
    match e {
        DevError::Command { what, detail } if is_root() && detail.contains("Permission denied") => {
            DevError::Command {
                what,
                detail: format!(
                    "{detail}\nhint: as root, dev runs PostgreSQL as the `postgres` user (initdb refuses root), which cannot reach {}: run dev from a directory every user can enter (not under /root), or set DATABASE_URL to a server of yours",
                    dir.display()
                ),
            }
        }
        other => other,
    }
}

/// Checks that the bundled executors of `cfg` exist.
/// Like [`check_executors`], but builds the bundled executors first when they
/// are missing and the repository's `scripts/setup` is there (a fresh clone:
/// `cargo run -p supervisor -- dev` is then the one command to run). Its
/// output goes to stderr.
pub fn ensure_executors(cfg: &crate::config::WorkerConfig, root: &Path) -> Result<(), DevError> {
    if check_executors(cfg).is_ok() {
        return Ok(());
    }
    let script = root.join("scripts/setup");
    if !script.exists() {
        return check_executors(cfg);
    }
    eprintln!(
        "the bundled demo executors are not built yet: running {} (once)",
        script.display()
    );
    // through bash (the script is a bash script): nothing execs a file that
    // may have just been written
    let status = Command::new("bash")
        .arg(&script)
        .current_dir(root)
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| DevError::Setup {
            script: script.clone(),
            status: e.to_string(),
        })?;
    if !status.success() {
        return Err(DevError::Setup {
            script,
            status: status.to_string(),
        });
    }
    check_executors(cfg)
}

pub fn check_executors(cfg: &crate::config::WorkerConfig) -> Result<(), DevError> {
    for e in &cfg.executors {
        let p = PathBuf::from(&e.command);
        if !p.exists() {
            return Err(DevError::MissingExecutor(p));
        }
        for a in e.args.iter().filter(|a| a.ends_with(".py")) {
            if !Path::new(a).exists() {
                return Err(DevError::MissingExecutor(a.into()));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod ensure_tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn root_with_setup(script: &str) -> (tempfile::TempDir, crate::config::WorkerConfig) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("scripts")).expect("scripts");
        let setup = dir.path().join("scripts/setup");
        std::fs::write(&setup, script).expect("write setup");
        std::fs::set_permissions(&setup, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let cfg = crate::config::WorkerConfig {
            executors: vec![crate::config::ExecutorConfig {
                name: "x".into(),
                command: dir.path().join("bin/x").to_string_lossy().into_owned(),
                ..Default::default()
            }],
            ..Default::default()
        };
        (dir, cfg)
    }

    #[test]
    fn missing_executors_are_built_by_the_setup_script() {
        let (dir, cfg) = root_with_setup("#!/bin/sh\nmkdir -p bin && touch bin/x\n");
        assert!(check_executors(&cfg).is_err());
        ensure_executors(&cfg, dir.path()).expect("built");
        assert!(check_executors(&cfg).is_ok());
    }

    #[test]
    fn a_failing_setup_says_what_to_install() {
        let (dir, cfg) = root_with_setup("#!/bin/sh\nexit 3\n");
        let err = ensure_executors(&cfg, dir.path()).expect_err("setup failed");
        let msg = err.to_string();
        assert!(msg.contains("Go") && msg.contains("Python"), "{msg}");
    }
}
