//! Orphans (issue 6, item 12). A worker is a child subreaper and reaps every
//! orphan (no zombies); every child carries a marker (`DURABLE_SUPERVISOR_*`
//! in its environment); a restarted worker ends what its killed predecessor
//! left, found by that marker as `/proc` shows it now; where the host allows
//! cgroup v2, stopping a child also writes `cgroup.kill`, which ends `setsid`
//! escapees.
//!
//! This test binary is itself a subreaper with the orphan reaper running,
//! like `supervisor worker`. So every child it forks outside the Spawner and
//! outside its own process group is reaped by the reaper, not waited for here.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use serde_json::json;
use supervisor::process::{
    self, CgroupMode, Marker, SpawnSpec, Spawner, INSTANCE_ENV, SLOT_ENV, SUPERVISOR_ENV,
};
use tests::{fast_config, go_demo, wrap_in_shell, TestDb, WorkerProcess};
use uuid::Uuid;

fn reaping() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        tests::init_tracing();
        process::become_subreaper().expect("become a child subreaper");
        process::start_orphan_reaper().expect("start the orphan reaper");
    });
}

fn me() -> i32 {
    std::process::id() as i32
}

#[derive(Debug, Clone, Copy)]
struct Stat {
    state: char,
    ppid: i32,
    pgrp: i32,
    starttime: u64,
}

fn stat(pid: i32) -> Option<Stat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = s.get(s.rfind(')')? + 2..)?.split_whitespace().collect();
    Some(Stat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        starttime: f.get(19)?.parse().ok()?,
    })
}

fn alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| !matches!(s.state, 'Z' | 'X'))
}

/// Alive and still the same process (pid + start time).
fn still(pid: i32, starttime: u64) -> bool {
    stat(pid).is_some_and(|s| !matches!(s.state, 'Z' | 'X') && s.starttime == starttime)
}

fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn env_var(pid: i32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ.split(|&b| b == 0).find_map(|var| {
        let s = std::str::from_utf8(var).ok()?;
        s.strip_prefix(name)?.strip_prefix('=').map(str::to_string)
    })
}

/// Live processes carrying the marker of `slot` (zombies have no environ).
fn marked(slot: &str) -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|&p| env_var(p, SLOT_ENV).as_deref() == Some(slot))
        .collect()
}

fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Zombies whose parent is this process, in process group `pgid`.
fn our_zombies_in(pgid: i32) -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|&p| stat(p).is_some_and(|s| s.state == 'Z' && s.ppid == me() && s.pgrp == pgid))
        .collect()
}

/// Zombie children of ours among `pids`.
fn our_zombies_among(pids: &[i32]) -> Vec<i32> {
    pids.iter()
        .copied()
        .filter(|&p| stat(p).is_some_and(|s| s.state == 'Z' && s.ppid == me()))
        .collect()
}

async fn eventually(within: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn sh(script: &str) -> SpawnSpec {
    let mut spec = SpawnSpec::new("/bin/sh", "/");
    spec.args = vec!["-c".into(), script.into()];
    spec.env_allowlist = vec!["PATH".into()];
    spec
}

async fn first_line_pid(child: &mut process::Child) -> i32 {
    use tokio::io::AsyncBufReadExt;
    let out = child.take_stdout().expect("stdout");
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::BufReader::new(out).read_line(&mut line),
    )
    .await
    .expect("the script prints a pid")
    .expect("read stdout");
    line.trim().parse().expect("a pid")
}

/// `pid.starttime.pidns` of a process, as the marker spells a supervisor.
fn identity(pid: i32) -> String {
    let st = stat(pid).expect("process exists");
    let ns = std::fs::read_link(format!("/proc/{pid}/ns/pid")).expect("pid namespace");
    let ns = ns.to_string_lossy();
    let ino = ns
        .trim_start_matches("pid:[")
        .trim_end_matches(']')
        .to_string();
    format!("{pid}.{}.{ino}", st.starttime)
}

/// A supervisor identity that names no live process: our pid with another start time.
fn dead_identity() -> String {
    let mut parts: Vec<String> = identity(me()).split('.').map(str::to_string).collect();
    parts[1] = (parts[1].parse::<u64>().unwrap() + 1).to_string();
    parts.join(".")
}

/// A "previous incarnation" process started outside the Spawner: its own
/// process group, a cleared environment with a marker. Not waited for (the
/// orphan reaper reaps it once killed).
fn launch(slot: &str, instance: &str, supervisor: Option<&str>, script: &str) -> i32 {
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", script])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env(SLOT_ENV, slot)
        .env(INSTANCE_ENV, instance)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .process_group(0);
    if let Some(s) = supervisor {
        cmd.env(SUPERVISOR_ENV, s);
    }
    let child = cmd.spawn().expect("launch");
    let pid = child.id() as i32;
    drop(child);
    pid
}

/// Waits until `n` live processes carry the marker of `slot` and `instance`.
async fn wait_marked(slot: &str, instance: &str, n: usize) -> Vec<i32> {
    let mut found = Vec::new();
    eventually(Duration::from_secs(5), "marked processes start", || {
        found = marked(slot)
            .into_iter()
            .filter(|&p| env_var(p, INSTANCE_ENV).as_deref() == Some(instance))
            .collect();
        found.len() >= n
    })
    .await;
    found
}

async fn sweep(slot: &str, mine: &str) -> process::SweepReport {
    let (slot, mine) = (slot.to_string(), mine.to_string());
    tokio::task::spawn_blocking(move || process::sweep_previous_incarnations(&slot, &mine))
        .await
        .expect("sweep")
}

/// An executor's grandchild that outlives it is re-parented to us (subreaper),
/// dies with the group's SIGKILL and is reaped by the orphan reaper: no
/// process with the marker is left, and no zombie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphaned_grandchild_dies_with_its_group_and_is_reaped() {
    reaping();
    let slot = format!("orphans-{}", Uuid::new_v4());
    let spawner = Spawner::start_with_marker(Marker {
        slot: slot.clone(),
        instance: Uuid::new_v4().to_string(),
    })
    .expect("spawner");
    let reaped_before = process::orphans_reaped();
    let mut child = spawner
        .spawn(sh("sleep 300 & echo $!; exit 0"))
        .await
        .expect("spawn");
    let leader = child.pid;
    let grandchild = first_line_pid(&mut child).await;
    child.exited().await.expect("leader exits");
    // The leader is an un-reaped zombie; its orphan is now our child.
    eventually(
        Duration::from_secs(3),
        "grandchild re-parented to us",
        || stat(grandchild).is_some_and(|s| s.ppid == me()),
    )
    .await;
    assert!(alive(grandchild), "the grandchild outlives the leader");
    // (the forked shell may still be in its exec of sleep, whose environment
    // reads empty until the new image is set up)
    eventually(
        Duration::from_secs(3),
        "the grandchild carries the slot's marker",
        || env_var(grandchild, SLOT_ENV).as_deref() == Some(slot.as_str()),
    )
    .await;

    let report = child.finish().await.expect("finish");
    assert!(report.status.success(), "{report:?}");
    eventually(
        Duration::from_secs(5),
        "nothing marked, no zombie left",
        || {
            marked(&slot).is_empty()
                && our_zombies_in(leader).is_empty()
                && stat(grandchild).is_none_or(|s| s.ppid != me())
        },
    )
    .await;
    assert!(process::orphans_reaped() > reaped_before);
}

/// A `setsid` escapee leaves the process group: in cgroup mode `cgroup.kill`
/// ends it when its attempt stops; with process groups only it survives (the
/// documented limit) until something else ends it — here the test, after
/// which the orphan reaper reaps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setsid_escapee_is_ended_by_cgroup_kill_where_available() {
    reaping();
    let slot = format!("orphans-{}", Uuid::new_v4());
    let spawner = Spawner::start_with_marker(Marker {
        slot: slot.clone(),
        instance: Uuid::new_v4().to_string(),
    })
    .expect("spawner");
    let mut child = spawner
        .spawn(sh("setsid sleep 300 & echo $!; exit 0"))
        .await
        .expect("spawn");
    let leader = child.pid;
    let escapee = first_line_pid(&mut child).await;
    eventually(Duration::from_secs(3), "escapee left the group", || {
        stat(escapee).is_some_and(|s| s.pgrp != leader)
    })
    .await;
    let report = child.finish().await.expect("finish");
    assert!(report.status.success());
    match process::cgroup_mode() {
        CgroupMode::PerChild { .. } => {
            eventually(Duration::from_secs(5), "escapee killed and reaped", || {
                !alive(escapee) && our_zombies_among(&[escapee]).is_empty()
            })
            .await;
        }
        mode @ CgroupMode::ProcessGroupsOnly { .. } => {
            println!("SKIP cgroup assertion: {mode}");
            assert!(alive(escapee), "without cgroups the escapee survives");
            kill(Pid::from_raw(escapee), Signal::SIGKILL).expect("kill escapee");
            eventually(Duration::from_secs(5), "escapee reaped", || {
                !alive(escapee) && our_zombies_among(&[escapee]).is_empty()
            })
            .await;
        }
    }
    assert!(marked(&slot).is_empty(), "{:?}", marked(&slot));
}

/// The sweep ends every process of a previous incarnation of the slot —
/// group members that cleared their environment and `setsid` escapees too —
/// and spares ours, another slot's, and those of a supervisor still alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_ends_a_previous_incarnation_and_spares_the_rest() {
    reaping();
    let slot = format!("sweep-{}", Uuid::new_v4());
    let other_slot = format!("sweep-other-{}", Uuid::new_v4());
    let dead = dead_identity();

    // previous incarnation "A": a group with a marked background sleep, an
    // unmarked one (env -i), and a setsid escapee
    let a = launch(
        &slot,
        "A",
        Some(&dead),
        "sleep 300 & env -i /bin/sleep 300 & setsid sleep 300 & wait",
    );
    // previous incarnation "A2", started before markers named their supervisor
    let a2 = launch(&slot, "A2", None, "exec sleep 300");
    // a live supervisor's processes (another worker with the same name)
    let mut live_sup = std::process::Command::new("/bin/sleep")
        .arg("300")
        .spawn()
        .expect("live supervisor stand-in");
    let live_id = identity(live_sup.id() as i32);
    let l = launch(&slot, "L", Some(&live_id), "exec sleep 300");
    // ours (the instance passed to the sweep) and another slot's
    let b = launch(&slot, "B", Some(&dead), "exec sleep 300");
    let other = launch(&other_slot, "A", Some(&dead), "exec sleep 300");
    // and an instance a Spawner of this process uses
    let spawner = Spawner::start_with_marker(Marker {
        slot: slot.clone(),
        instance: "C".into(),
    })
    .expect("spawner");
    let c = spawner.spawn(sh("exec sleep 300")).await.expect("spawn");

    let stale_marked = wait_marked(&slot, "A", 3).await; // sh, sleep, setsid sleep
    wait_marked(&slot, "A2", 1).await;
    for (inst, n) in [("L", 1), ("B", 1), ("C", 1)] {
        wait_marked(&slot, inst, n).await;
    }
    wait_marked(&other_slot, "A", 1).await;
    let mut unmarked = Vec::new();
    eventually(Duration::from_secs(5), "unmarked member starts", || {
        unmarked = pids()
            .into_iter()
            .filter(|&p| stat(p).is_some_and(|s| s.pgrp == a) && env_var(p, SLOT_ENV).is_none())
            .filter(|&p| cmdline(p).contains("sleep"))
            .collect();
        !unmarked.is_empty()
    })
    .await;
    let stale: Vec<(i32, u64)> = stale_marked
        .iter()
        .chain(&unmarked)
        .chain(&[a2])
        .map(|&p| (p, stat(p).expect("running").starttime))
        .collect();

    let report = sweep(&slot, "B").await;
    println!("sweep: {report}");
    assert!(report.converged, "{report:?}");
    // A's group is killed at its first member found; members that are
    // already dead when the scan reaches them are not counted again
    assert!((3..=4).contains(&report.processes_killed), "{report:?}");
    assert_eq!(report.groups_killed, 3, "{report:?}"); // A, A2, the escapee
    assert_eq!(report.spared_live, 1, "{report:?}");
    eventually(
        Duration::from_secs(5),
        "the previous incarnation is gone",
        || stale.iter().all(|&(p, t)| !still(p, t)),
    )
    .await;
    for (who, pid) in [("L", l), ("B", b), ("other slot", other), ("C", c.pid)] {
        assert!(alive(pid), "{who} ({pid}) was spared");
    }

    // once its supervisor is gone, L is a previous incarnation too
    live_sup.kill().expect("kill the live supervisor stand-in");
    live_sup.wait().expect("reap it");
    let report = sweep(&slot, "B").await;
    assert_eq!(
        (report.processes_killed, report.spared_live),
        (1, 0),
        "{report:?}"
    );
    eventually(Duration::from_secs(5), "L is gone", || !alive(l)).await;

    for pgid in [b, other] {
        killpg(Pid::from_raw(pgid), Signal::SIGKILL).expect("clean up");
    }
    c.kill().await.expect("kill C");
    eventually(Duration::from_secs(5), "nothing marked is left", || {
        marked(&slot).is_empty() && marked(&other_slot).is_empty()
    })
    .await;
    eventually(Duration::from_secs(5), "no zombie is left", || {
        our_zombies_among(&[a, a2, l, b, other]).is_empty()
    })
    .await;
}

/// A previous incarnation that keeps forking escapees while the sweep runs:
/// one snapshot would miss the ones forked during it; the sweep repeats until
/// a pass finds nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_repeats_until_a_forking_incarnation_is_gone() {
    reaping();
    let slot = format!("sweep-fork-{}", Uuid::new_v4());
    launch(
        &slot,
        "A",
        Some(&dead_identity()),
        "while :; do setsid sleep 300 & sleep 0.002; done",
    );
    wait_marked(&slot, "A", 20).await;
    let report = sweep(&slot, "B").await;
    println!("sweep: {report}");
    assert!(report.converged, "{report:?}");
    assert!(report.processes_killed >= 10, "{report:?}");
    eventually(Duration::from_secs(5), "nothing marked is left", || {
        marked(&slot).is_empty()
    })
    .await;
}

/// End to end: `supervisor worker` runs a step whose executor started a
/// long-lived grandchild; the worker is killed with SIGKILL (the executor dies
/// by PDEATHSIG, the grandchild survives); a new worker with the same `name`
/// ends it at start, by its marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_worker_ends_the_grandchild_its_killed_predecessor_left() {
    reaping();
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let name = format!("orphans-e2e-{}", Uuid::new_v4().simple());
    let executor = wrap_in_shell(
        go_demo("go", &[], None),
        "sleep 300 </dev/null >/dev/null 2>&1 & exec \"$0\" \"$@\"",
    );
    let mut cfg = fast_config(vec![executor]);
    cfg.name = Some(name.clone());

    let mut first = WorkerProcess::spawn(&t.url, &cfg);
    let first_pid = first.child.id() as i32;
    let run = t
        .submit(
            json!({"name": "orphan", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.sleep", "input": {"ms": 60000, "steps": 60},
            "retry": {"max_attempts": 1}}]}),
        )
        .await;
    t.wait_run(run, Duration::from_secs(30), |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    let mut grandchild = None;
    eventually(
        Duration::from_secs(10),
        "the attempt's grandchild runs",
        || {
            grandchild = marked(&name)
                .into_iter()
                .find(|&p| cmdline(p).starts_with("sleep 300"));
            grandchild.is_some()
        },
    )
    .await;
    let grandchild = grandchild.expect("grandchild");
    let born = stat(grandchild).expect("grandchild").starttime;
    assert_eq!(
        env_var(grandchild, SUPERVISOR_ENV).map(|s| s.split('.').next().map(str::to_string)),
        Some(Some(first_pid.to_string())),
        "the grandchild carries the first worker's marker"
    );

    first.signal(Signal::SIGKILL);
    first.wait(Duration::from_secs(10)).await;
    // its executor dies with it (PDEATHSIG); the grandchild does not
    eventually(Duration::from_secs(10), "the executor is gone", || {
        marked(&name).into_iter().all(|p| p == grandchild)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        still(grandchild, born),
        "without a sweep the grandchild survives"
    );

    let mut second = WorkerProcess::spawn(&t.url, &cfg);
    let second_pid = second.child.id() as i32;
    eventually(
        Duration::from_secs(30),
        "the new worker's start sweep ends the grandchild",
        || !still(grandchild, born),
    )
    .await;
    eventually(Duration::from_secs(5), "and it is reaped", || {
        our_zombies_among(&[grandchild]).is_empty()
    })
    .await;
    assert!(
        marked(&name).into_iter().all(|p| env_var(p, SUPERVISOR_ENV)
            .is_some_and(|s| s.starts_with(&format!("{second_pid}.")))),
        "only the new worker's children carry the slot's marker"
    );

    // SIGTERM drains only once the worker runs (its handler is installed
    // right after it registered); before, it would just kill it
    let registered = format!("SELECT count(*) FROM durable.workers WHERE pid = {second_pid}");
    let until = Instant::now() + Duration::from_secs(30);
    while t.scalar_i64(&registered).await == 0 {
        assert!(Instant::now() < until, "the second worker never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    second.signal(Signal::SIGTERM);
    let code = second.wait(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "stderr: {}", second.stderr());
    for line in second.stderr().lines() {
        if line.contains("incarnation") || line.contains("containment") {
            println!("second worker: {line}");
        }
    }
    eventually(
        Duration::from_secs(5),
        "nothing of the slot is left",
        || marked(&name).is_empty(),
    )
    .await;
    if let CgroupMode::PerChild { parent } = process::cgroup_mode() {
        let left: Vec<PathBuf> = std::fs::read_dir(&parent)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let needle = |pid: i32| format!("-{pid}.");
        let leftovers: Vec<&PathBuf> = left
            .iter()
            .filter(|p| {
                let n = p.file_name().unwrap_or_default().to_string_lossy();
                n.starts_with("durable-")
                    && (n.contains(&needle(first_pid)) || n.contains(&needle(second_pid)))
            })
            .collect();
        assert!(leftovers.is_empty(), "cgroups left: {leftovers:?}");
    }
}

/// The entries of `work` (names), sorted.
fn entries(work: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(work)
        .expect("work dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// End to end: `supervisor worker` runs a one-shot and a persistent attempt,
/// each in its directories in `work_dir` (the attempt's `durable-<id>-…`,
/// the session's `durable-session-…`, the job's `durable-job-…`), and is
/// killed with SIGKILL: the directories stay (before, nothing ever removed
/// them). A new worker of another name with the same `work_dir` removes
/// them at its start, as soon as the dead worker's lock is free, and
/// leaves what is not a dead worker's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_removes_the_directories_a_killed_worker_left() {
    reaping();
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let work = tempfile::tempdir().expect("work dir");
    std::fs::create_dir(work.path().join("durable-kept-by-an-operator")).expect("foreign dir");
    std::fs::write(work.path().join("notes.txt"), b"mine").expect("foreign file");
    // one slot each: one step runs in each
    let mut one_shot = go_demo("go", &[], None);
    one_shot.concurrency = 1;
    let mut persistent = go_demo("go-warm", &[], None);
    persistent.persistent = true;
    persistent.concurrency = 1;
    let mut cfg = fast_config(vec![one_shot, persistent]);
    cfg.work_dir = Some(work.path().to_path_buf());
    cfg.name = Some(format!("workdir-first-{}", Uuid::new_v4().simple()));

    let mut first = WorkerProcess::spawn(&t.url, &cfg);
    let sleep = |n: &str| {
        json!({"name": n, "executor_kind": "go", "kind": "demo.sleep",
               "input": {"ms": 60000, "steps": 60}, "retry": {"max_attempts": 1}})
    };
    let run = t
        .submit(json!({"name": "dirs", "steps": [sleep("a"), sleep("b")]}))
        .await;
    t.wait_run(run, Duration::from_secs(30), |s| {
        s.steps.len() == 2 && s.steps.iter().all(|s| s.state == "running")
    })
    .await;
    let before = entries(work.path());
    let has = |p: &str| before.iter().any(|n| n.starts_with(p));
    assert!(
        has("durable-session-go-warm-") && has("durable-job-go-warm-"),
        "the persistent attempt's directories: {before:?}"
    );
    let attempt_dirs = before
        .iter()
        .filter(|n| {
            n.strip_prefix("durable-")
                .and_then(|r| r.get(..36))
                .is_some_and(|id| Uuid::parse_str(id).is_ok())
        })
        .count();
    assert!(
        attempt_dirs >= 1,
        "the one-shot attempt's directory: {before:?}"
    );

    first.signal(Signal::SIGKILL);
    first.wait(Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        entries(work.path()),
        before,
        "a killed worker's directories stay until someone removes them"
    );

    let mut cfg2 = cfg.clone();
    cfg2.name = Some(format!("workdir-second-{}", Uuid::new_v4().simple()));
    let second = tests::RunningWorker::start(t.connect(6).await, cfg2).await;
    let after = entries(work.path());
    let left: Vec<&String> = before.iter().filter(|n| after.contains(n)).collect();
    assert_eq!(
        left,
        vec!["durable-kept-by-an-operator", "notes.txt"],
        "what the new worker left of the old entries: {after:?}"
    );
    second.shutdown().await;
    assert_eq!(
        entries(work.path()),
        vec!["durable-kept-by-an-operator", "notes.txt"],
        "a stopped worker leaves nothing of its own"
    );
}
