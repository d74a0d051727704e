//! Issue 8, item 3: an attempt killed mid-way is resumed by the next one from
//! its checkpoint. `demo.resume` (both demo executors, written with the SDKs'
//! typed checkpoint helpers) processes items one by one and checkpoints
//! `{"next": i + 1}` after each; the test SIGKILLs the executor once a
//! checkpoint past the first items is stored, and the retry must start at the
//! checkpointed item, not at 0, and finish the rest exactly once.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;
use tests::{demo, executor_pid, fast_config, only_step_id, RunningWorker, TestDb};

const ITEMS: i64 = 12;

tests::for_each_lang!(a_killed_attempt_resumes_from_its_checkpoint);

/// The step's stored checkpoint, decoded (`{"next": n}` → n).
async fn stored_next(t: &TestDb, step: uuid::Uuid) -> Option<i64> {
    let cp: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(step)
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    let v: serde_json::Value = serde_json::from_slice(&cp?).ok()?;
    v["next"].as_i64()
}

async fn a_killed_attempt_resumes_from_its_checkpoint(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = dir.path().join("items.txt");
    let w = RunningWorker::start(
        t.connect(6).await,
        fast_config(vec![demo(lang, lang, &[], None)]),
    )
    .await;
    let run = t
        .submit(json!({"name": "resume", "steps": [{
            "name": "s", "executor_kind": lang, "kind": "demo.resume",
            "input": {"items": ITEMS, "ms": 150, "sink": sink},
            "retry": {"max_attempts": 3, "initial_interval_ms": 0},
        }]}))
        .await;
    let step = only_step_id(&t, run).await;

    // mid-way: a checkpoint of at least 4 items is stored, well before the end
    let t0 = Instant::now();
    let killed_at = loop {
        match stored_next(&t, step).await {
            Some(n) if n >= 4 => break n,
            _ if t0.elapsed() > Duration::from_secs(60) => panic!("no checkpoint >= 4 stored"),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    assert!(killed_at < ITEMS, "the attempt finished before the kill");
    let pid = executor_pid(&t.db, step).await.expect("the executor's pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the executor");

    let st = t.wait_terminal(run, Duration::from_secs(120)).await;
    let s = &st.steps[0];
    assert_eq!(s.state, "succeeded", "{st:?}");
    assert_eq!(s.attempt, 2, "one retry after the kill: {s:?}");
    let out = s.output.clone().expect("output");
    let started_at = out["started_at"].as_i64().expect("started_at");
    assert_eq!(out["attempt"], json!(2));
    assert_eq!(out["items"], json!(ITEMS));
    // the retry started where the stored checkpoint said: at least where it
    // was when the executor was killed (a later one may have been stored
    // before the kill landed), never at 0
    assert!(
        started_at >= killed_at && started_at < ITEMS,
        "attempt 2 started at {started_at}, the checkpoint said {killed_at}"
    );

    // what each attempt processed: attempt 1 every item below started_at
    // (and perhaps the one it was on when killed), attempt 2 exactly the rest
    let lines = std::fs::read_to_string(&sink).expect("sink");
    let mut by_attempt: [BTreeSet<i64>; 2] = Default::default();
    for line in lines.lines() {
        let (a, i) = line.split_once(' ').expect("<attempt> <item>");
        let (a, i): (usize, i64) = (a.parse().expect("attempt"), i.parse().expect("item"));
        assert!(
            by_attempt[a - 1].insert(i),
            "attempt {a} processed item {i} twice"
        );
    }
    let first: BTreeSet<i64> = (0..started_at).collect();
    assert!(
        by_attempt[0].is_superset(&first) && by_attempt[0].len() as i64 <= started_at + 1,
        "attempt 1 processed {:?}, the retry started at {started_at}",
        by_attempt[0]
    );
    assert_eq!(
        by_attempt[1],
        (started_at..ITEMS).collect::<BTreeSet<_>>(),
        "attempt 2 processed exactly the items from the checkpoint on"
    );
    w.shutdown().await;
}
