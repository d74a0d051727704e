//! Tests with real processes. Every test that spawns asserts, within a bounded
//! wait, that nothing of the child's process group survives.

use std::collections::BTreeSet;
use std::future::Future;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::task::Poll;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::RwLock;

use super::*;

/// `kill_all_groups` hits every child of this test binary: that test takes
/// the write side, every other spawning test the read side.
static KILL_ALL_LOCK: RwLock<()> = RwLock::const_new(());

fn spawner() -> Spawner {
    Spawner::start().expect("start spawner")
}

fn sh(script: &str) -> SpawnSpec {
    let mut spec = SpawnSpec::new("/bin/sh", "/");
    spec.args = vec!["-c".into(), script.into()];
    spec.env_allowlist = vec!["PATH".into()];
    spec
}

/// Waits until `pgid` has no members left; returns the survivors on timeout.
async fn wait_group_empty(pgid: i32, within: Duration) -> Vec<i32> {
    let deadline = Instant::now() + within;
    loop {
        let members = group_members(pgid);
        if members.is_empty() || Instant::now() >= deadline {
            return members;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn assert_group_empty(pgid: i32) {
    let left = wait_group_empty(pgid, Duration::from_secs(3)).await;
    assert!(left.is_empty(), "group {pgid} still has members {left:?}");
    assert!(
        !live_groups().contains(&pgid),
        "group {pgid} still registered"
    );
}

/// Waits until the group has at least `n` members (so backgrounded children
/// really exist before we test killing them).
async fn wait_group_size(pgid: i32, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let members = group_members(pgid);
        if members.len() >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "group {pgid} never reached {n} members: {members:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn is_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| group::parse_stat(&s))
        .is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

#[test]
fn handles_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Spawner>();
    check::<Child>();
    check::<StderrTail>();
    check::<ProcessError>();
}

#[tokio::test]
async fn terminate_kills_whole_group() {
    let _shared = KILL_ALL_LOCK.read().await;
    let child = spawner().spawn(sh("sleep 60 & sleep 60")).await.unwrap();
    let pid = child.pid;
    wait_group_size(pid, 3).await;
    let start = Instant::now();
    let report = child.terminate(Duration::from_secs(5)).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGTERM".into()));
    assert!(!report.escalated_to_kill);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn terminate_escalates_when_term_is_ignored() {
    let _shared = KILL_ALL_LOCK.read().await;
    // The ignored disposition is inherited by the background sleep too.
    let child = spawner()
        .spawn(sh(r#"trap "" TERM; sleep 60 & wait"#))
        .await
        .unwrap();
    let pid = child.pid;
    wait_group_size(pid, 2).await;
    let grace = Duration::from_millis(300);
    let start = Instant::now();
    let report = child.terminate(grace).await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert!(report.escalated_to_kill);
    let left = wait_group_empty(pid, Duration::from_secs(1)).await;
    assert!(left.is_empty(), "survivors {left:?}");
    assert!(start.elapsed() < grace + Duration::from_secs(1));
    assert_group_empty(pid).await;
}

/// `stop` tells its caller each step it takes, and a forced stop ends the
/// grace there and then: SIGTERM, then SIGKILL as soon as `cut_short`
/// resolves, not after the grace, grandchildren included.
#[tokio::test]
async fn stop_tells_its_steps_and_a_forced_stop_cuts_the_grace_short() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner()
        .spawn(sh(r#"trap "" TERM; sleep 60 & wait"#))
        .await
        .unwrap();
    let pid = child.pid;
    wait_group_size(pid, 2).await;
    let mut steps = Vec::new();
    let start = Instant::now();
    let report = child
        .stop(
            Duration::from_secs(30),
            tokio::time::sleep(Duration::from_millis(300)),
            |_, step| steps.push(step),
        )
        .await
        .unwrap();
    assert_eq!(
        steps,
        vec![StopStep::Term, StopStep::KillAfterGrace { cut_short: true }]
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert!(report.escalated_to_kill);
    assert_group_empty(pid).await;
    // the handle is kept: a second stop answers the same report, no step
    let mut again = Vec::new();
    let second = child
        .stop(Duration::from_secs(1), std::future::pending(), |_, s| {
            again.push(s)
        })
        .await
        .unwrap();
    assert_eq!(second, report);
    assert!(again.is_empty(), "{again:?}");
}

/// A stopped child (SIGSTOP, SIGTSTP) is seen as stopped, and `terminate`
/// kills it where it stands, without its grace and without waking it: woken
/// (SIGCONT), one that handles SIGTERM ran code it had been sent while
/// stopped (re-check audit: a handler ran for a job given back as never run).
#[tokio::test]
async fn terminate_kills_a_stopped_child_without_waking_it() {
    let _shared = KILL_ALL_LOCK.read().await;
    let dir = tempfile::tempdir().unwrap();
    let woke = dir.path().join("woke");
    let child = spawner()
        // no short-lived member: the exit of one while the group is stopped
        // (an orphaned group: the child has a session of its own) makes the
        // kernel send the group SIGHUP and SIGCONT
        .spawn(sh(&format!(
            r#"trap "touch {}; exit 5" TERM; sleep 60 & wait"#,
            woke.display()
        )))
        .await
        .unwrap();
    let pid = child.pid;
    wait_group_size(pid, 2).await; // the trap is set: its sleep runs
    assert!(!child.is_stopped(), "a running child is not stopped");
    child.signal_group(Signal::SIGSTOP).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while !child.is_stopped() {
        assert!(Instant::now() < until, "the child never read as stopped");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let grace = Duration::from_secs(5);
    let start = Instant::now();
    let report = child.terminate(grace).await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert!(start.elapsed() < grace, "the grace was waited");
    assert!(!woke.exists(), "the stopped child ran its SIGTERM trap");
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn exited_does_not_need_stdout_eof() {
    let _shared = KILL_ALL_LOCK.read().await;
    // The background sleep inherits stdout, so stdout never reaches EOF.
    let mut child = spawner().spawn(sh("sleep 60 & exit 0")).await.unwrap();
    let pid = child.pid;
    let mut stdout = child.take_stdout().unwrap();
    tokio::time::timeout(Duration::from_secs(2), child.exited())
        .await
        .expect("exited() should resolve promptly")
        .unwrap();
    assert!(child.has_exited());
    // The leader is a zombie, not reaped: its group (the sleep) is still there.
    assert!(group_members(pid).contains(&pid));
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_millis(200), stdout.read(&mut buf)).await;
    assert!(read.is_err(), "stdout should still be held open: {read:?}");
    // exited() again returns immediately.
    child.exited().await.unwrap();

    let report = child.finish().await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Exited(0));
    assert!(!report.escalated_to_kill);
    assert_group_empty(pid).await;
    let n = tokio::time::timeout(Duration::from_secs(2), stdout.read(&mut buf))
        .await
        .expect("stdout EOF after the grandchild died")
        .unwrap();
    assert_eq!(n, 0);
}

#[tokio::test]
async fn stderr_flood_is_drained_and_bounded() {
    let _shared = KILL_ALL_LOCK.read().await;
    let child = spawner()
        .spawn(sh(
            r#"head -c 50000000 /dev/zero | tr '\0' x >&2; echo done >&2"#,
        ))
        .await
        .unwrap();
    let pid = child.pid;
    let tail = child.stderr();
    let report = tokio::time::timeout(Duration::from_secs(15), child.finish())
        .await
        .expect("no deadlock on a full stderr pipe")
        .unwrap();
    assert_eq!(report.status, ExitStatusKind::Exited(0));
    assert_eq!(report.stderr_total_bytes, 50_000_005);
    assert!(report.stderr_tail.ends_with("xxxxdone\n"));
    assert_eq!(report.stderr_tail.len(), DEFAULT_STDERR_TAIL_BYTES);
    assert_eq!(tail.total_bytes(), 50_000_005);
    assert!(tail.is_closed());
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn stderr_tail_respects_small_cap() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut spec = sh("printf 0123456789abcdef >&2");
    spec.stderr_tail_bytes = 8;
    let child = spawner().spawn(spec).await.unwrap();
    let pid = child.pid;
    let report = child.finish().await.unwrap();
    assert_eq!(report.stderr_tail, "89abcdef");
    assert_eq!(report.stderr_total_bytes, 16);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn environment_is_cleared_to_allowlist_and_explicit_pairs() {
    let _shared = KILL_ALL_LOCK.read().await;
    let parent_path = std::env::var("PATH").expect("tests need PATH");
    let mut spec = SpawnSpec::new("/usr/bin/env", "/");
    spec.env_allowlist = vec![
        "PATH".into(),
        "HOME".into(),
        "PROCESS_TEST_SURELY_UNSET_VARIABLE".into(),
    ];
    spec.env = vec![
        ("HOME".into(), "/explicit-home".into()),
        ("FOO".into(), "bar baz".into()),
    ];
    let mut child = spawner().spawn(spec).await.unwrap();
    let pid = child.pid;
    let mut out = String::new();
    child
        .take_stdout()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    let report = child.finish().await.unwrap();
    assert!(report.status.success(), "{report:?}");
    let got: BTreeSet<&str> = out.lines().collect();
    let path_line = format!("PATH={parent_path}");
    let want: BTreeSet<&str> = [path_line.as_str(), "HOME=/explicit-home", "FOO=bar baz"]
        .into_iter()
        .collect();
    assert_eq!(got, want);
    assert_group_empty(pid).await;
}

/// A descriptor this process holds without close-on-exec (inherited from
/// whoever started the worker) does not reach the child: only its three
/// pipes do (security audit: a secret file the worker's parent had open).
#[tokio::test]
async fn the_child_gets_no_fd_but_its_three_pipes() {
    let _shared = KILL_ALL_LOCK.read().await;
    // SAFETY: open and dup2 on a path and fd numbers this test owns; the
    // duplicate (no O_CLOEXEC, as an inherited fd is) is closed below.
    let leaked = unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        assert!(fd >= 0);
        let high = libc::dup2(fd, 987);
        libc::close(fd);
        high
    };
    assert_eq!(leaked, 987);
    let mut child = spawner()
        // stat only: a listing would show the directory fd it reads with
        .spawn(sh(
            "n=0; while [ $n -lt 1024 ]; do [ -e /proc/$$/fd/$n ] && echo $n; n=$((n+1)); done; true",
        ))
        .await
        .unwrap();
    let pid = child.pid;
    let mut out = String::new();
    child
        .take_stdout()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    let report = child.finish().await.unwrap();
    // SAFETY: the fd dup2 made above.
    unsafe { libc::close(leaked) };
    assert!(report.status.success(), "{report:?}");
    let fds: BTreeSet<&str> = out.lines().collect();
    assert!(
        !fds.contains("987"),
        "the inherited fd reached the child: {fds:?}"
    );
    assert_eq!(fds, ["0", "1", "2"].into_iter().collect(), "{out}");
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn cwd_is_set_and_stdin_stdout_work() {
    let _shared = KILL_ALL_LOCK.read().await;
    let dir = std::env::temp_dir().canonicalize().unwrap();
    let mut spec = sh("pwd -P; cat");
    spec.cwd = dir.clone();
    let mut child = spawner().spawn(spec).await.unwrap();
    let pid = child.pid;
    let mut stdin = child.take_stdin().unwrap();
    stdin.write_all(b"hello through stdin\n").await.unwrap();
    drop(stdin);
    let mut out = String::new();
    child
        .take_stdout()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    assert_eq!(out, format!("{}\nhello through stdin\n", dir.display()));
    assert!(child.finish().await.unwrap().status.success());
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn child_survives_exit_of_the_thread_that_called_spawn() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spawner = spawner();
    let main_rt = tokio::runtime::Handle::current();
    let temp_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .thread_keep_alive(Duration::from_millis(10))
        .build()
        .unwrap();
    let (caller_tid, child) = {
        let spawner = spawner.clone();
        temp_rt
            .spawn_blocking(move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                let child = main_rt.block_on(spawner.spawn(sh("exec sleep 60")));
                (tid, child)
            })
            .await
            .unwrap()
    };
    let child = child.unwrap();
    let pid = child.pid;
    // Shut down the runtime whose blocking thread called spawn(); make sure
    // that thread is really gone.
    tokio::task::spawn_blocking(move || temp_rt.shutdown_timeout(Duration::from_secs(2)))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while std::path::Path::new(&format!("/proc/self/task/{caller_tid}")).exists() {
        assert!(Instant::now() < deadline, "calling thread never exited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(is_alive(pid), "child died with the calling thread");
    assert!(!child.has_exited());
    let report = child.kill().await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert!(report.escalated_to_kill);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn pdeathsig_kills_child_when_spawner_thread_dies() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spawner = spawner();
    let mut child = spawner.spawn(sh("exec sleep 60")).await.unwrap();
    let pid = child.pid;
    assert!(!child.has_exited());
    spawner.exit_thread_for_test();
    tokio::time::timeout(Duration::from_secs(5), child.exited())
        .await
        .expect("PR_SET_PDEATHSIG should kill the child when its forking thread exits")
        .unwrap();
    let report = child.finish().await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert!(!report.escalated_to_kill);
    assert_group_empty(pid).await;
    // The thread is gone: spawning now reports it.
    let err = spawner.spawn(sh("true")).await.unwrap_err();
    assert!(matches!(err, ProcessError::SpawnerGone { .. }), "{err}");
}

#[tokio::test]
async fn spawn_of_missing_program_names_it() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spec = SpawnSpec::new("/nonexistent/definitely-not-a-program", "/");
    let err = spawner().spawn(spec).await.unwrap_err();
    match &err {
        ProcessError::Spawn {
            program, source, ..
        } => {
            assert_eq!(
                program,
                &PathBuf::from("/nonexistent/definitely-not-a-program")
            );
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(err
        .to_string()
        .contains("/nonexistent/definitely-not-a-program"));

    let mut spec = sh("true");
    spec.cwd = "/nonexistent/cwd".into();
    let err = spawner().spawn(spec).await.unwrap_err();
    assert!(matches!(err, ProcessError::Spawn { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/cwd"), "{err}");
}

#[tokio::test]
async fn dropping_an_unreaped_child_kills_its_group() {
    let _shared = KILL_ALL_LOCK.read().await;
    let child = spawner().spawn(sh("sleep 60 & sleep 60")).await.unwrap();
    let pid = child.pid;
    wait_group_size(pid, 3).await;
    assert!(live_groups().contains(&pid));
    drop(child);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn dropping_an_exited_child_kills_grandchildren_and_reaps() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner().spawn(sh("sleep 60 & exit 7")).await.unwrap();
    let pid = child.pid;
    child.exited().await.unwrap();
    drop(child);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn signal_group_after_reap_is_refused() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner().spawn(sh("exit 3")).await.unwrap();
    let pid = child.pid;
    child.signal_group(Signal::SIGCONT).unwrap(); // alive or zombie: fine
    let report = child.reap().await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Exited(3));
    assert!(child.has_exited());
    let err = child.signal_group(Signal::SIGTERM).unwrap_err();
    assert!(
        matches!(err, ProcessError::AlreadyReaped { pid: p, .. } if p == pid),
        "{err}"
    );
    // Reaping is idempotent and never signals again.
    assert_eq!(child.reap().await.unwrap(), report);
    assert_eq!(child.finish().await.unwrap(), report);
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn signal_group_reaches_grandchildren() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner().spawn(sh("sleep 60 & wait")).await.unwrap();
    let pid = child.pid;
    wait_group_size(pid, 2).await;
    child.signal_group(Signal::SIGKILL).unwrap();
    child.exited().await.unwrap();
    let report = child.finish().await.unwrap();
    assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn exited_is_cancel_safe_and_has_exited_polls() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner().spawn(sh("sleep 0.3")).await.unwrap();
    let pid = child.pid;
    assert!(!child.has_exited());
    let mut cancelled = 0;
    loop {
        match tokio::time::timeout(Duration::from_millis(20), child.exited()).await {
            Ok(result) => break result.unwrap(),
            Err(_) => cancelled += 1,
        }
    }
    assert!(cancelled > 3, "{cancelled}");
    assert!(child.has_exited());
    assert!(child.finish().await.unwrap().status.success());
    assert_group_empty(pid).await;
}

#[tokio::test]
async fn cancelled_spawn_does_not_leak_the_child() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spawner = spawner();
    // Poll the spawn future exactly once (the request is sent), then drop it
    // before the spawner thread can reply.
    let mut attempts = 0;
    loop {
        attempts += 1;
        let mut fut = std::pin::pin!(spawner.spawn(sh("exec sleep 60")));
        let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        match first {
            Poll::Pending => break,
            // The thread replied within the first poll (practically never): retry.
            Poll::Ready(result) => assert!(attempts < 5, "{:?}", result.map(|c| c.pid)),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let pid = loop {
        let orphan = spawner::orphaned_for_test()
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        if let Some(pid) = orphan {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "the spawner never saw the cancelled reply"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert_group_empty(pid).await;
    assert!(!is_alive(pid));
}

#[tokio::test]
async fn kill_all_groups_kills_every_live_group() {
    let _exclusive = KILL_ALL_LOCK.write().await;
    let spawner = spawner();
    let mut a = spawner.spawn(sh("sleep 60 & sleep 60")).await.unwrap();
    let mut b = spawner.spawn(sh("exec sleep 60")).await.unwrap();
    wait_group_size(a.pid, 3).await;
    assert!(live_groups().contains(&a.pid) && live_groups().contains(&b.pid));
    kill_all_groups();
    for child in [&mut a, &mut b] {
        tokio::time::timeout(Duration::from_secs(2), child.exited())
            .await
            .expect("killed")
            .unwrap();
    }
    let (pa, pb) = (a.pid, b.pid);
    for child in [a, b] {
        let report = child.finish().await.unwrap();
        assert_eq!(report.status, ExitStatusKind::Signaled("SIGKILL".into()));
    }
    assert_group_empty(pa).await;
    assert_group_empty(pb).await;
}

// ---------------------------------------------------------------------------
// marker, cgroups, orphan reaping, sweep

fn marked_spawner(slot: &str, instance: &str) -> Spawner {
    Spawner::start_with_marker(Marker {
        slot: slot.into(),
        instance: instance.into(),
    })
    .expect("start marked spawner")
}

/// Reads the first line of the child's stdout (a pid printed by the script).
async fn read_pid_line(child: &mut Child) -> i32 {
    use tokio::io::AsyncBufReadExt;
    let stdout = child.take_stdout().unwrap();
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .expect("the script prints a pid")
    .unwrap();
    line.trim()
        .parse()
        .unwrap_or_else(|_| panic!("not a pid: {line:?}"))
}

async fn wait_dead(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while is_alive(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[tokio::test]
async fn marker_is_set_on_every_child_and_overrides_the_spec() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spawner = marked_spawner("unit-slot", "unit-instance-1");
    let mut spec = SpawnSpec::new("/usr/bin/env", "/");
    spec.env = vec![
        (SLOT_ENV.into(), "forged".into()),
        (INSTANCE_ENV.into(), "forged".into()),
        ("OTHER".into(), "kept".into()),
    ];
    for _ in 0..2 {
        let mut child = spawner.spawn(spec.clone()).await.unwrap();
        let pid = child.pid;
        let mut out = String::new();
        child
            .take_stdout()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        assert!(child.finish().await.unwrap().status.success());
        let got: BTreeSet<&str> = out.lines().collect();
        let me = marker::self_identity().to_string();
        let sup = format!("{SUPERVISOR_ENV}={me}");
        let want: BTreeSet<&str> = [
            "DURABLE_SUPERVISOR_SLOT=unit-slot",
            "DURABLE_SUPERVISOR_INSTANCE=unit-instance-1",
            sup.as_str(),
            "OTHER=kept",
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want);
        assert_group_empty(pid).await;
    }
    let err = Spawner::start_with_marker(Marker {
        slot: String::new(),
        instance: "x".into(),
    })
    .unwrap_err();
    assert!(matches!(err, ProcessError::InvalidMarker { .. }), "{err}");
}

#[tokio::test]
async fn setsid_escapee_is_ended_by_cgroup_kill_where_cgroups_are_available() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut child = spawner()
        .spawn(sh("setsid sleep 300 & echo $!; exit 0"))
        .await
        .unwrap();
    let pid = child.pid;
    let escapee = read_pid_line(&mut child).await;
    // $! is printed as soon as the background job is forked, maybe before
    // it ran setsid.
    let deadline = Instant::now() + Duration::from_secs(3);
    while group::read_stat(escapee).expect("escapee runs").pgrp == pid {
        assert!(
            Instant::now() < deadline,
            "the escapee never left the group"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mode = cgroup_mode();
    assert_eq!(mode, cgroup::detected_mode(), "cgroups were switched off");
    let cgroup_dir = match &mode {
        CgroupMode::PerChild { parent } => {
            let rel = cgroup::v2_path(
                &std::fs::read_to_string(format!("/proc/{escapee}/cgroup")).unwrap(),
            )
            .unwrap();
            let name = rel.rsplit('/').next().unwrap().to_string();
            assert!(name.starts_with("durable-anon-"), "{rel}");
            let dir = parent.join(&name);
            assert!(dir.is_dir(), "{}", dir.display());
            Some(dir)
        }
        CgroupMode::ProcessGroupsOnly { .. } => None,
    };
    let report = child.finish().await.unwrap();
    assert!(report.status.success());
    assert_group_empty(pid).await;
    match cgroup_dir {
        Some(dir) => {
            assert!(
                wait_dead(escapee, Duration::from_secs(3)).await,
                "cgroup.kill ended the setsid escapee"
            );
            assert!(!dir.exists(), "{} was removed", dir.display());
        }
        None => {
            println!("SKIP cgroup assertion: {mode}; the setsid escapee survives its group, as documented");
            assert!(is_alive(escapee));
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(escapee), Signal::SIGKILL);
        }
    }
}

#[tokio::test]
async fn reap_orphans_never_takes_tracked_or_foreign_children() {
    let _shared = KILL_ALL_LOCK.read().await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hammer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut reaped = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                reaped.extend(reap_orphans().reaped.into_iter().map(|(pid, _)| pid));
                std::thread::sleep(Duration::from_micros(200));
            }
            reaped
        })
    };
    let spawner = spawner();
    let mut tracked = Vec::new();
    for i in 0..20 {
        let spec = sh(&format!("sleep 0.0{}; exit {}", i % 5, i + 1));
        tracked.push((i + 1, spawner.spawn(spec).await.unwrap()));
    }
    // Foreign children in our own process group, waited for by their owner.
    let foreign = tokio::task::spawn_blocking(|| {
        (0..20)
            .map(|_| {
                std::process::Command::new("/bin/sh")
                    .args(["-c", "exit 5"])
                    .status()
                    .map(|s| s.code())
            })
            .collect::<Vec<_>>()
    });
    // An untracked child outside our group, nobody waits for: an orphan's case.
    let loose = std::process::Command::new("/bin/sh")
        .args(["-c", "exit 0"])
        .process_group(0)
        .spawn()
        .unwrap();
    let loose_pid = loose.id() as i32;
    drop(loose);
    for (code, child) in tracked {
        let pid = child.pid;
        let report = child
            .finish()
            .await
            .expect("tracked child reaped by its owner");
        assert_eq!(report.status, ExitStatusKind::Exited(code));
        assert_group_empty(pid).await;
    }
    for status in foreign.await.unwrap() {
        assert_eq!(status.expect("std's wait was not robbed"), Some(5));
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while std::path::Path::new(&format!("/proc/{loose_pid}")).exists()
        && group::read_stat(loose_pid).is_some_and(|s| s.ppid == std::process::id() as i32)
    {
        assert!(
            Instant::now() < deadline,
            "the loose child was never reaped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reaped = hammer.join().unwrap();
    assert!(reaped.contains(&loose_pid), "{reaped:?}");
}

#[tokio::test]
async fn exited_leaders_are_deferred_while_a_spawn_is_in_flight() {
    let _shared = KILL_ALL_LOCK.read().await;
    let ticket = group::begin_spawn();
    // Looks exactly like a fresh fork that exited before registration.
    let child = std::process::Command::new("/bin/sh")
        .args(["-c", "exit 0"])
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    drop(child);
    let deadline = Instant::now() + Duration::from_secs(3);
    while group::read_stat(pid).is_some_and(|s| s.state != 'Z') {
        assert!(Instant::now() < deadline, "child never exited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for _ in 0..3 {
        let pass = reap_orphans();
        assert!(!pass.reaped.iter().any(|(p, _)| *p == pid), "{pass:?}");
    }
    assert_eq!(group::read_stat(pid).map(|s| s.state), Some('Z'));
    drop(ticket);
    let deadline = Instant::now() + Duration::from_secs(3);
    // Whoever runs reap_orphans now (this test or another) reaps it.
    while group::read_stat(pid).is_some_and(|s| s.state == 'Z') {
        reap_orphans();
        assert!(
            Instant::now() < deadline,
            "never reaped after the spawn ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn sweep_ends_a_stale_cgroup_of_the_slot_even_without_a_marker() {
    let _shared = KILL_ALL_LOCK.read().await;
    let Some(h) = cgroup::hierarchy() else {
        println!("SKIP: {}", cgroup_mode());
        return;
    };
    let slot = format!("unit-stale-cgroup-{}", std::process::id());
    let me = marker::self_identity();
    let dead = marker::ProcessIdentity {
        starttime: me.starttime + 1,
        ..me
    };
    let name = cgroup::child_name(&marker::slot_tag(&slot), &dead, 1);
    let cg = cgroup::ChildCgroup::create(&h, &name).unwrap();
    // A previous incarnation's descendant that cleared its environment.
    let mut child = std::process::Command::new("/usr/bin/env")
        .args(["-i", "/bin/sleep", "300"])
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    std::fs::write(cg.dir().join("cgroup.procs"), pid.to_string()).unwrap();
    // An empty leftover of the same dead incarnation (garbage: removed)...
    let empty =
        cgroup::ChildCgroup::create(&h, &cgroup::child_name(&marker::slot_tag(&slot), &dead, 2))
            .unwrap();
    // ... and a populated one of another slot's dead incarnation: not ours
    // to kill (that slot's own next sweep does).
    let other = cgroup::ChildCgroup::create(
        &h,
        &cgroup::child_name(&marker::slot_tag("another"), &dead, 3),
    )
    .unwrap();
    let mut bystander = std::process::Command::new("/usr/bin/env")
        .args(["-i", "/bin/sleep", "300"])
        .process_group(0)
        .spawn()
        .unwrap();
    let bystander_pid = bystander.id() as i32;
    std::fs::write(other.dir().join("cgroup.procs"), bystander_pid.to_string()).unwrap();

    let report = tokio::task::spawn_blocking({
        let slot = slot.clone();
        move || sweep_previous_incarnations(&slot, "unit-me")
    })
    .await
    .unwrap();
    assert!(report.converged, "{report}");
    // (another process's garbage collection may remove `empty` first)
    assert!((1..=2).contains(&report.cgroups_killed), "{report}");
    assert!(report.cgroups_removed >= 1, "{report}");
    assert!(wait_dead(pid, Duration::from_secs(3)).await);
    assert!(!cg.dir().exists() && !empty.dir().exists());
    assert!(other.dir().exists(), "another slot's cgroup is not touched");
    assert!(is_alive(bystander_pid), "nor what runs in it");
    other.kill().unwrap();
    assert!(wait_dead(bystander_pid, Duration::from_secs(3)).await);
    assert!(other.remove_blocking_logged(Duration::from_secs(2)));
    let _ = child.try_wait();
    let _ = bystander.try_wait();
}

/// `proc_cgroup` (a child's `/proc/self/cgroup`) names a cgroup of its own,
/// and cgroups are still on.
fn assert_in_a_cgroup_of_its_own(proc_cgroup: &str) {
    let rel = cgroup::v2_path(proc_cgroup).expect("a v2 cgroup line");
    let name = rel.rsplit('/').next().unwrap_or_default();
    assert!(name.starts_with("durable-anon-"), "{proc_cgroup}");
    assert_eq!(
        cgroup_mode(),
        cgroup::detected_mode(),
        "cgroups were switched off"
    );
}

/// Where the kernel allows `clone3`, a child starts in its cgroup through
/// `CLONE_INTO_CGROUP` instead of writing its own `cgroup.procs` before exec
/// (a write that waits for an RCU grace period: ~10 ms of an idle worker's
/// submit → accepted), and it is in that cgroup from its first instruction.
#[tokio::test]
async fn a_child_is_cloned_into_its_cgroup_where_clone3_is_allowed() {
    let _shared = KILL_ALL_LOCK.read().await;
    let CgroupMode::PerChild { .. } = cgroup_mode() else {
        eprintln!("skipped: no cgroup per child on this host");
        return;
    };
    if !super::vfork::clone3_exists() {
        eprintln!("skipped: clone3 is not available here");
        return;
    }
    let before = super::vfork::clone3_joins();
    let out = output_of(sh("cat /proc/self/cgroup")).await;
    assert!(
        super::vfork::clone3_joins() > before,
        "the child was not started by clone3 into its cgroup"
    );
    assert_in_a_cgroup_of_its_own(&out);
}

/// Where `clone3` is refused (an older kernel, a seccomp filter), the child
/// joins its cgroup by writing `cgroup.procs` before exec, and is in it all
/// the same.
#[tokio::test]
async fn without_clone3_a_child_joins_its_cgroup_before_exec() {
    let _exclusive = KILL_ALL_LOCK.write().await;
    let CgroupMode::PerChild { .. } = cgroup_mode() else {
        eprintln!("skipped: no cgroup per child on this host");
        return;
    };
    let was = super::vfork::set_clone3_usable(false);
    let before = super::vfork::clone3_joins();
    let out = output_of(sh("cat /proc/self/cgroup")).await;
    let joins = super::vfork::clone3_joins();
    super::vfork::set_clone3_usable(was);
    assert_eq!(joins, before, "clone3 was used while switched off");
    assert_in_a_cgroup_of_its_own(&out);
}

#[tokio::test]
async fn cgroups_stay_on_with_many_spawners_at_once() {
    let _shared = KILL_ALL_LOCK.read().await;
    let spawners: Vec<Spawner> = (0..4).map(|_| spawner()).collect();
    let mut tasks = Vec::new();
    for (i, s) in spawners.iter().enumerate() {
        for j in 0..5 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let child = s.spawn(sh(&format!("exit {}", i * 5 + j))).await.unwrap();
                let pid = child.pid;
                let report = child.finish().await.unwrap();
                assert_eq!(report.status, ExitStatusKind::Exited((i * 5 + j) as i32));
                pid
            }));
        }
    }
    for t in tasks {
        let pid = t.await.unwrap();
        assert_group_empty(pid).await;
    }
    assert_eq!(
        cgroup_mode(),
        cgroup::detected_mode(),
        "cgroups were switched off"
    );
    if let CgroupMode::PerChild { parent } = cgroup_mode() {
        // Every child's cgroup is removed once it is reaped.
        let tag = format!("-{}-", marker::self_identity());
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let mine: Vec<String> = std::fs::read_dir(&parent)
                .unwrap()
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("durable-anon") && n.contains(&tag))
                .collect();
            // Other tests may have children running right now; ours are gone
            // when no cgroup is left that no live group accounts for.
            if mine.len() <= live_groups().len() {
                break;
            }
            assert!(Instant::now() < deadline, "cgroups left: {mine:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// What a child printed on stdout, once it has exited successfully.
async fn output_of(spec: SpawnSpec) -> String {
    let mut child = spawner().spawn(spec).await.expect("spawn");
    let pid = child.pid;
    let mut out = String::new();
    child
        .take_stdout()
        .expect("stdout")
        .read_to_string(&mut out)
        .await
        .expect("read stdout");
    let report = child.finish().await.expect("finish");
    assert!(report.status.success(), "{report:?}");
    assert_group_empty(pid).await;
    out
}

/// A bare program name is looked up along the child's `PATH`, entry by
/// entry (an entry without it is skipped, as `execvp` does); with no entry
/// holding it the spawn fails as not found, naming the program.
#[tokio::test]
async fn a_bare_program_name_is_found_along_the_childs_path() {
    let _shared = KILL_ALL_LOCK.read().await;
    let empty = tempfile::tempdir().expect("tempdir");
    let mut spec = SpawnSpec::new("echo", "/");
    spec.args = vec!["found".into()];
    spec.env = vec![(
        "PATH".into(),
        format!("{}:/usr/bin:/bin", empty.path().display()),
    )];
    assert_eq!(output_of(spec).await, "found\n");

    let mut spec = SpawnSpec::new("echo", "/");
    spec.env = vec![("PATH".into(), empty.path().display().to_string())];
    match spawner().spawn(spec).await {
        Err(ProcessError::Spawn {
            program, source, ..
        }) => {
            assert_eq!(program, PathBuf::from("echo"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected a spawn error, got {other:?}"),
    }
}

/// A child starts with no signal blocked and SIGPIPE at its default, whatever
/// this process blocks, ignores or catches (the test harness ignores
/// SIGPIPE, as every Rust program does): the spawner thread blocks every
/// signal around the clone, and the child resets them before exec.
#[tokio::test]
async fn a_child_starts_with_no_signal_blocked_or_ignored() {
    let _shared = KILL_ALL_LOCK.read().await;
    let mut spec = SpawnSpec::new("/bin/cat", "/");
    spec.args = vec!["/proc/self/status".into()];
    let status = output_of(spec).await;
    let mask = |name: &str| -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in {status}"));
        u64::from_str_radix(line[name.len()..].trim(), 16).expect("hex mask")
    };
    assert_eq!(mask("SigBlk:"), 0, "blocked signals:\n{status}");
    let sigpipe = 1u64 << (libc::SIGPIPE - 1);
    assert_eq!(mask("SigIgn:") & sigpipe, 0, "SIGPIPE ignored:\n{status}");
    assert_eq!(mask("SigCgt:"), 0, "caught signals:\n{status}");
}

/// A leader this process is reaping (a cancelled spawn's, SIGKILLed and
/// handed to its reaper thread) is not an orphan that left its group, even
/// in the instant before it is a zombie: the exit sweep neither kills nor
/// counts it (before, only live registrations were excluded, and a stop
/// during the executors' start-up probes logged a killed "escaped" process).
/// An unregistered child is still one.
#[test]
fn a_child_being_reaped_is_not_counted_as_an_adopted_orphan() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let pid = child.id() as i32;
    let me = std::process::id() as i32;
    let unregistered = sweep::is_unaccounted_child(pid, me);
    group::mark_reaping_for_test(pid);
    let reaping = sweep::is_unaccounted_child(pid, me);
    group::release_for_test(pid);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        unregistered,
        "an unregistered live child is unaccounted for"
    );
    assert!(!reaping, "a child being reaped was counted as an orphan");
    assert!(
        !sweep::is_unaccounted_child(pid, me),
        "a reaped child is nobody's"
    );
}
