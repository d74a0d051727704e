//! Protocol 1.1 negotiation (issue 9, item 2), end to end in a real worker,
//! with the frame-level hostile executor (`tests/executors/hostile.py`) whose
//! hello is read from a file at every start: a 1.1 hello gets a job stating
//! the agreement, a 1.0 hello (no new fields) still works and gets a 1.0 job,
//! a hello with no revision in common ends the step with
//! PROTOCOL_VERSION_MISMATCH on its first attempt (not retried) and is caught
//! at the probe, and a job over the executor's announced frame limit is never
//! sent (JOB_TOO_LARGE, not retried).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use supervisor::config::ExecutorConfig;
use supervisor::worker::Worker;
use tests::{fast_config, step, RunningWorker, TestDb};

const LONG: Duration = Duration::from_secs(60);

fn hostile(versions: &Path, jobs: &Path, extra: &[(&str, &str)]) -> ExecutorConfig {
    let mut env = std::collections::BTreeMap::new();
    env.insert(
        "HOSTILE_VERSIONS_FILE".to_string(),
        versions.to_string_lossy().into_owned(),
    );
    env.insert(
        "HOSTILE_JOB_LOG".to_string(),
        jobs.to_string_lossy().into_owned(),
    );
    for (k, v) in extra {
        env.insert(k.to_string(), v.to_string());
    }
    ExecutorConfig {
        name: "hostile".into(),
        command: tests::python().to_string_lossy().into_owned(),
        args: vec![tests::repo_root()
            .join("tests/executors/hostile.py")
            .to_string_lossy()
            .into_owned()],
        env,
        concurrency: 2,
        ..ExecutorConfig::default()
    }
}

/// One echo step that may be retried (so "not retryable" is observable).
fn echo(input: Value) -> Value {
    json!({"name": "negotiation", "steps": [{
        "name": "s", "executor_kind": "hostile", "kind": "hostile.echo", "input": input,
        "retry": {"max_attempts": 3, "initial_interval_ms": 50, "max_interval_ms": 100},
    }]})
}

/// The lines of the executor's job log: `<kind> <max_frame_bytes> <negotiated_version>`.
fn jobs_seen(log: &PathBuf) -> Vec<String> {
    std::fs::read_to_string(log)
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default()
}

fn paths() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let versions = dir.path().join("versions");
    let jobs = dir.path().join("jobs.log");
    (dir, versions, jobs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_mismatch_fails_once_and_a_v1_hello_still_works() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (_dir, versions, jobs) = paths();
    std::fs::write(&versions, "1.0,1.1").expect("versions");
    let mut cfg = fast_config(vec![hostile(&versions, &jobs, &[])]);
    cfg.max_frame_bytes = 1 << 20;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    // 1.1: the job states the chosen revision and the supervisor's frame limit
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 1}))).await, LONG)
        .await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{s:?}");
    assert_eq!(s.output, Some(json!({"n": 1})));
    assert_eq!(jobs_seen(&jobs), vec!["hostile.echo 1048576 1.1"]);

    // 1.0: a hello without the new fields still runs, and its job is a 1.0 job
    std::fs::remove_file(&versions).expect("remove versions");
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 2}))).await, LONG)
        .await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{s:?}");
    assert_eq!(s.output, Some(json!({"n": 2})));
    assert_eq!(jobs_seen(&jobs)[1], "hostile.echo 0 -");

    // no revision in common: its own code, on the first attempt, not retried,
    // and the executor never got the job
    std::fs::write(&versions, "1.9").expect("versions");
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 3}))).await, LONG)
        .await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{s:?}");
    assert_eq!(s.attempt, 1, "not retried: {s:?}");
    let e = s.error.as_ref().expect("an error");
    assert_eq!(e.code, "PROTOCOL_VERSION_MISMATCH", "{e:?}");
    assert!(
        e.message.contains("1.9") && e.message.contains("1.0, 1.1"),
        "{e:?}"
    );
    assert_eq!(jobs_seen(&jobs).len(), 2, "the job was not sent");
    w.shutdown().await;
}

#[tokio::test]
async fn a_version_mismatch_is_caught_at_the_probe() {
    let t = TestDb::new().await;
    let (_dir, versions, jobs) = paths();
    std::fs::write(&versions, "2.0,2.1").expect("versions");
    let err = Worker::start(
        t.connect(4).await,
        fast_config(vec![hostile(&versions, &jobs, &[])]),
    )
    .await
    .err()
    .expect("refused at start");
    let msg = err.to_string();
    assert!(msg.contains("PROTOCOL_VERSION_MISMATCH"), "{msg}");
    assert!(msg.contains("2.0, 2.1"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_the_executors_frame_limit_is_never_sent() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (_dir, versions, jobs) = paths();
    std::fs::write(&versions, "1.1").expect("versions");
    let cfg = fast_config(vec![hostile(
        &versions,
        &jobs,
        &[("HOSTILE_MAX_FRAME_BYTES", "65536")],
    )]);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    let big = json!({"pad": "x".repeat(70_000)});
    let st = t.wait_terminal(t.submit(echo(big)).await, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{s:?}");
    assert_eq!(s.attempt, 1, "not retried: {s:?}");
    let e = s.error.as_ref().expect("an error");
    assert_eq!(e.code, "JOB_TOO_LARGE", "{e:?}");
    assert!(e.message.contains("65536"), "{e:?}");
    assert!(jobs_seen(&jobs).is_empty(), "the big job was sent");

    // a job within the limit goes
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 1}))).await, LONG)
        .await;
    assert_eq!(step(&st, "s").state, "succeeded");
    assert_eq!(jobs_seen(&jobs).len(), 1);
    w.shutdown().await;
}

/// A binary replaced after its probe whose hello says another protocol
/// version is not a refusal (those are re-queued without an attempt, five
/// times, and end EXECUTOR_REFUSED): with no revision in common it is
/// PROTOCOL_VERSION_MISMATCH on the first attempt, not retried; a hello
/// whose version contradicts its own revisions is HANDSHAKE_FAILED
/// (retryable, PROTOCOL.md). No job is sent either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_hello_of_another_protocol_version_is_not_a_refusal() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (dir, versions, jobs) = paths();
    let version = dir.path().join("protocol_version");
    std::fs::write(&version, "1").expect("version");
    // the hello's version is read from `version` at each start
    let start = || async {
        let cfg = fast_config(vec![hostile(
            &versions,
            &jobs,
            &[(
                "HOSTILE_PROTOCOL_VERSION_FILE",
                version.to_str().expect("utf-8 path"),
            )],
        )]);
        RunningWorker::start(t.connect(10).await, cfg).await
    };
    let w = start().await;

    // version 2 and only revision 2.0: nothing in common
    std::fs::write(&version, "2").expect("version");
    std::fs::write(&versions, "2.0").expect("versions");
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 1}))).await, LONG)
        .await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{s:?}");
    assert_eq!(s.attempt, 1, "not retried: {s:?}");
    let e = s.error.as_ref().expect("an error");
    assert_eq!(e.code, "PROTOCOL_VERSION_MISMATCH", "{e:?}");
    w.shutdown().await;

    // version 2 but revisions 1.0 and 1.1: the hello is wrong, retryable
    std::fs::write(&version, "1").expect("version");
    std::fs::write(&versions, "1.0,1.1").expect("versions");
    let w = start().await;
    std::fs::write(&version, "2").expect("version");
    let st = t
        .wait_terminal(t.submit(echo(json!({"n": 2}))).await, LONG)
        .await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{s:?}");
    assert_eq!(s.attempt, 3, "retried to the policy's end: {s:?}");
    let e = s.error.as_ref().expect("an error");
    assert_eq!(e.code, "HANDSHAKE_FAILED", "{e:?}");
    assert!(e.message.contains("protocol version 2"), "{e:?}");
    assert!(jobs_seen(&jobs).is_empty(), "no job was sent");
    w.shutdown().await;
}
