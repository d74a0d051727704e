//! A worker started with a low soft open-file limit (a service manager's
//! 1,024; here 64) runs its whole concurrency: each running child costs the
//! worker three pipe ends, so before the worker raised its soft limit to its
//! hard one, spawns failed `EMFILE` from a few dozen steps on, and the spawn
//! breaker paused it while the hard limit allowed far more. Its executors
//! still start with the limit the worker was given.

use std::time::{Duration, Instant};

use serde_json::json;
use tests::{fast_config, go_demo, wrap_in_shell, TestDb, WorkerProcess};

const SOFT: u64 = 64;
const HARD: u64 = 4096;
const STEPS: i64 = 40;

fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("the open-files line");
    let mut n = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .map(|v| v.parse::<u64>().expect("a number"));
    (n.next().expect("soft"), n.next().expect("hard"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_given_a_low_open_file_limit_runs_its_whole_concurrency() {
    let t = TestDb::new().await;
    let seen = tempfile::tempdir().expect("tempdir");
    // each executor notes the soft limit it was started with
    let mut e = wrap_in_shell(
        go_demo("go", &[], None),
        &format!(
            "ulimit -Sn > {}/limit.$$; exec \"$0\" \"$@\"",
            seen.path().display()
        ),
    );
    e.concurrency = STEPS as u32;
    let mut cfg = fast_config(vec![e]);
    cfg.db_max_connections = STEPS as u32 + 1;
    // (the shell's ulimit, as a service manager's LimitNOFILE=SOFT:HARD)
    let mut w = WorkerProcess::spawn_with(
        &[
            "/bin/sh".to_string(),
            "-c".to_string(),
            format!("ulimit -Sn {SOFT} && ulimit -Hn {HARD} && exec \"$0\" \"$@\""),
        ],
        &t.url,
        &cfg,
    );
    for i in 0..STEPS {
        t.submit(json!({"name": format!("r{i}"), "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 4000, "steps": 1}}]}))
            .await;
    }
    // every step runs at once: the worker's descriptors are not the bound
    let until = Instant::now() + Duration::from_secs(30);
    let mut most = 0;
    loop {
        let running = t
            .scalar_i64("SELECT count(*) FROM durable.step_runs WHERE state = 'running'")
            .await;
        most = most.max(running);
        if running == STEPS {
            break;
        }
        assert!(
            Instant::now() < until,
            "at most {most} of {STEPS} steps ran at once; worker log:\n{}",
            w.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        open_file_limits(w.child.id()),
        (HARD, HARD),
        "the worker raised its soft limit to its hard one"
    );
    let log = w.stderr();
    assert!(log.contains("raised the open-file limit"), "{log}");
    let refused = t
        .scalar_i64("SELECT coalesce(sum(refusals), 0)::int8 FROM durable.step_runs")
        .await;
    assert_eq!(refused, 0, "no start was refused for want of descriptors");

    // the executors were started with the limit the worker was given
    let limits: Vec<String> = std::fs::read_dir(seen.path())
        .expect("read dir")
        .map(|f| std::fs::read_to_string(f.expect("entry").path()).expect("limit file"))
        .collect();
    assert!(limits.len() as i64 >= STEPS, "{} executors", limits.len());
    for l in &limits {
        assert_eq!(l.trim(), SOFT.to_string(), "an executor's soft limit");
    }

    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(30)).await, Some(0));
    let left = t
        .scalar_i64("SELECT count(*) FROM durable.step_runs WHERE state <> 'succeeded'")
        .await;
    assert_eq!(left, 0, "every step succeeded");
}
