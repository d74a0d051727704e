//! Persistent executors (issue 7, the executor pool): a warm process serves
//! many jobs, one at a time; it is recycled after `max_jobs_per_process`, and
//! killed and replaced when a cancelled job does not end within its grace or
//! it breaks the protocol. Nothing of it survives the worker.

use std::time::Duration;

use serde_json::json;
use tests::{demo, executor_pid, fast_config, step, RunningWorker, TestDb};

const LONG: Duration = Duration::from_secs(60);

async fn run_one(
    t: &TestDb,
    lang: &str,
    kind: &str,
    input: serde_json::Value,
) -> (String, Option<i32>) {
    let run = t
        .submit(
            json!({"name": kind, "steps": [{"name": "s", "executor_kind": lang, "kind": kind,
                       "input": input, "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    (s.state.clone(), executor_pid(&t.db, s.step_run_id).await)
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

async fn warm_process_serves_many_jobs(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut e = demo(lang, lang, &[], None);
    e.persistent = true;
    e.concurrency = 1;
    e.max_jobs_per_process = Some(4);
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;

    // four jobs in one process, then a new one
    let mut pids = Vec::new();
    for i in 0..6 {
        let (state, pid) = run_one(&t, lang, "demo.echo", json!({"i": i})).await;
        assert_eq!(state, "succeeded");
        pids.push(pid.expect("pid"));
    }
    assert!(pids[..4].iter().all(|p| *p == pids[0]), "{pids:?}");
    assert_ne!(
        pids[4], pids[0],
        "max_jobs_per_process = 4 was not honoured: {pids:?}"
    );
    assert_eq!(pids[5], pids[4]);
    assert!(!alive(pids[0]), "the recycled process is still alive");

    // a cancel answered within the grace keeps the process
    let run = t
        .submit(
            json!({"name": "c", "steps": [{"name": "s", "executor_kind": lang, "kind": "demo.sleep",
                       "input": {"ms": 20000, "steps": 200}}]}),
        )
        .await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(step(&st, "s").state, "cancelled");
    let cancelled_pid = executor_pid(&t.db, step(&st, "s").step_run_id)
        .await
        .expect("pid");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(1)).await;
    assert_eq!(state, "succeeded");
    assert_eq!(
        pid,
        Some(cancelled_pid),
        "a process that answered its cancel was replaced"
    );

    // one that ignores the cancel is killed and replaced
    let run = t
        .submit(json!({"name": "i", "steps": [{"name": "s", "executor_kind": lang, "kind": "demo.misbehave",
                       "input": {"mode": "ignore_cancel"}}]}))
        .await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    let stubborn = executor_pid(&t.db, step(&st, "s").step_run_id)
        .await
        .expect("pid");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(2)).await;
    assert_eq!(state, "succeeded");
    assert_ne!(
        pid,
        Some(stubborn),
        "a process that ignored its cancel was reused"
    );
    assert!(!alive(stubborn));

    // a protocol violation retires the process too
    let (state, bad) = run_one(&t, lang, "demo.misbehave", json!({"mode": "backwards"})).await;
    assert_eq!(state, "terminal_failed");
    let (state, pid) = run_one(&t, lang, "demo.echo", json!(3)).await;
    assert_eq!(state, "succeeded");
    assert_ne!(pid, bad);

    let last = pid.expect("pid");
    w.shutdown().await;
    assert!(!alive(last), "a warm process outlived its worker");
    tests::assert_no_survivors(uuid::Uuid::nil(), Some(last), Duration::from_secs(5)).await;
}

tests::for_each_lang!(warm_process_serves_many_jobs);
