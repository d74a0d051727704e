//! `supervisor dev` with its own PostgreSQL (no DATABASE_URL), through the
//! real binary, from a directory of its own (found by a walk-through of the
//! README as a new user):
//! - a directory whose path has a space, or is longer than PostgreSQL's
//!   107-byte socket path allows, could not start the server;
//! - a second dev session in the same directory stopped the first one's
//!   server when it exited;
//! - a port already taken failed with "could not start server", the port
//!   and `--dev-port` named only in `.dev/server.log`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn listening(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

/// A working directory the `postgres` user can enter (dev runs the server as
/// that user when it runs as root), with a space in its name and a path
/// longer than a Unix socket's 107 bytes once `/.dev/.s.PGSQL.NNNNN` is added.
fn scratch(root: &Path) -> PathBuf {
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let dir = root.join(format!("a dev dir {}", "x".repeat(90)));
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

fn dev(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = tests::supervisor_clean("warn");
    c.arg("dev").args(args).current_dir(dir);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

fn spec() -> String {
    tests::repo_root()
        .join("examples/nightly-report.json")
        .to_string_lossy()
        .into_owned()
}

fn text(o: &Output) -> String {
    format!(
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let until = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("dev did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A first dev session in `dir` on `port` (named dev-1), running until
/// stopped, once its server listens.
fn first_session(dir: &Path, port: u16) -> Child {
    let mut first = dev(
        dir,
        &["--dev-port", &port.to_string()],
        &[("DURABLE_NAME", "dev-1")],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn dev");
    let until = Instant::now() + Duration::from_secs(90);
    while !listening(port) {
        if let Some(st) = first.try_wait().expect("wait") {
            let mut err = String::new();
            use std::io::Read;
            let _ = first.stderr.take().map(|mut e| e.read_to_string(&mut err));
            panic!("the first dev session ended ({st}) before its server listened: {err}");
        }
        assert!(Instant::now() < until, "the dev server never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    first
}

#[test]
fn dev_runs_its_own_server_shares_it_between_sessions_and_names_a_taken_port() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = scratch(root.path());
    let port = free_port();
    let p = port.to_string();

    // a first session that runs until stopped
    let mut first = first_session(&dir, port);

    // a second session in the same directory runs the example to its end …
    let out = dev(
        &dir,
        &["--dev-port", &p, "--submit", &spec(), "--exit-when-idle"],
        &[("DURABLE_NAME", "dev-2")],
    )
    .output()
    .expect("second dev session");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "dev PostgreSQL: postgres://postgres@127.0.0.1:{port}/postgres"
        )),
        "dev says where its database is: {stderr}"
    );
    assert!(stderr.contains("succeeded"), "{}", text(&out));
    // … and leaves the server to the first, which still runs
    assert!(
        listening(port),
        "the second session stopped the first one's server"
    );
    assert!(
        first.try_wait().expect("wait").is_none(),
        "the first session ended"
    );

    // the last session to leave stops the server it started
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let st = wait_exit(&mut first, Duration::from_secs(60));
    assert_eq!(st.code(), Some(0));
    assert!(!listening(port), "the server outlived the last dev session");

    // a port another server holds is named, with the way out
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_port = taken.local_addr().expect("addr").port().to_string();
    let out = dev(&dir, &["--dev-port", &taken_port, "--exit-when-idle"], &[])
        .output()
        .expect("dev on a taken port");
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("port {taken_port} on 127.0.0.1 is in use"))
            && err.contains("--dev-port"),
        "{err}"
    );
}

/// A second session in the same directory given another `--dev-port` uses
/// the server that already runs there, on its own port, and says so
/// (new-user audit: it printed the other port's URL, waited 10 s and failed
/// to connect, blaming DATABASE_URL, which the user never set).
#[test]
fn a_second_session_given_another_port_uses_the_running_server() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = scratch(root.path());
    let port = free_port();
    let mut first = first_session(&dir, port);
    let other = free_port().to_string();
    let out = dev(
        &dir,
        &[
            "--dev-port",
            &other,
            "--submit",
            &spec(),
            "--exit-when-idle",
        ],
        &[("DURABLE_NAME", "dev-2")],
    )
    .output()
    .expect("second dev session");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let st = wait_exit(&mut first, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "already runs on port {port} (not --dev-port {other})"
        )) && stderr.contains(&format!(
            "dev PostgreSQL: postgres://postgres@127.0.0.1:{port}/postgres"
        )),
        "the second session names the server's real port: {stderr}"
    );
    assert_eq!(st.code(), Some(0));
}
