//! S03, executor half, and S07: a side effect guarded by the idempotency key
//! and a checkpoint happens once however often the step is attempted — after
//! a retryable failure, after a crash, and after the whole worker is killed
//! (the orphaned step is reclaimed once its lease expires and completed by
//! another worker; the killed worker's executor dies with it).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tests::{
    demo, executor_pid, fast_config, only_step_id, step_transitions, RunningWorker, TestDb,
};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

tests::for_each_lang!(
    effect_once_after_a_retryable_failure,
    effect_once_after_a_crash,
    killed_worker_step_is_reclaimed_and_completed,
);

fn effect_spec(name: &str, lang: &str, input: Value) -> Value {
    json!({"name": name, "steps": [{"name": "s", "executor_kind": lang, "kind": "demo.effect",
        "input": input, "retry": {"max_attempts": 3, "initial_interval_ms": 0}}]})
}

/// The sink holds exactly one line, the step's idempotency key; attempt 1
/// failed with `code` after checkpointing the effect, attempt 2 carried the
/// checkpoint and skipped the effect.
async fn assert_effect_once(t: &TestDb, run: Uuid, sink: &Path, code: &str) {
    let st = t.wait_terminal(run, LONG).await;
    let s = &st.steps[0];
    assert_eq!(st.state, "succeeded", "{:?}", s.error);
    assert_eq!(s.attempt, 2);
    let key = &s.idempotency_key;
    let lines = std::fs::read_to_string(sink).expect("sink");
    assert_eq!(
        lines,
        format!("{key}\n"),
        "the effect happened exactly once, keyed by the step's idempotency key"
    );
    // attempt 2 skipped the effect because its job's checkpoint equals
    // `effect-done:<its idempotency key>`, written by attempt 1 with attempt
    // 1's key: the key is the same on both attempts
    assert_eq!(s.output, Some(json!({"effect_performed": false})));
    let checkpoint: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(s.step_run_id)
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    assert_eq!(
        checkpoint.as_deref(),
        Some(format!("effect-done:{key}").as_bytes())
    );
    let checkpointed: Vec<i32> = sqlx::query_scalar(
        "SELECT attempt FROM durable.step_events WHERE step_run_id = $1 AND checkpoint ORDER BY id",
    )
    .bind(s.step_run_id)
    .fetch_all(t.db.pool())
    .await
    .expect("checkpoint events");
    assert_eq!(
        checkpointed,
        vec![1],
        "only attempt 1 performed and checkpointed the effect"
    );

    let history = step_transitions(&t.db, s.step_run_id).await;
    let ends: Vec<(Option<i32>, &str)> = history
        .iter()
        .filter(|h| matches!(h.to_state.as_str(), "retryable_failed" | "succeeded"))
        .map(|h| (h.attempt, h.to_state.as_str()))
        .collect();
    assert_eq!(
        ends,
        vec![(Some(1), "retryable_failed"), (Some(2), "succeeded")]
    );
    let failed = history
        .iter()
        .find(|h| h.to_state == "retryable_failed")
        .expect("attempt 1 failed");
    assert!(
        failed.reason.as_deref().unwrap_or("").starts_with(code),
        "attempt 1 ended with {code}: {failed:?}"
    );
}

/// (a) demo.effect {fail_after_effect}: EFFECT_FAILED (retryable) after the
/// effect and its checkpoint; attempt 2 skips the effect and succeeds.
async fn effect_once_after_a_retryable_failure(lang: &str) {
    effect_once(lang, "fail_after_effect", "EFFECT_FAILED").await
}

/// (b) demo.effect {crash_after_effect}: the process exits 3 after the effect
/// and its checkpoint (EXECUTOR_CRASHED); attempt 2 skips the effect.
async fn effect_once_after_a_crash(lang: &str) {
    effect_once(lang, "crash_after_effect", "EXECUTOR_CRASHED").await
}

async fn effect_once(lang: &str, flag: &str, code: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let sink = dir.path().join("sink.txt");
    let w = RunningWorker::start(
        t.connect(5).await,
        fast_config(vec![demo(lang, lang, &[], None)]),
    )
    .await;
    let run = t
        .submit(effect_spec(
            &format!("effect-{flag}"),
            lang,
            json!({"sink": sink, flag: true}),
        ))
        .await;
    assert_effect_once(&t, run, &sink, code).await;
    w.shutdown().await;
}

/// (c) S07: `supervisor worker` is killed with SIGKILL while its demo.sleep
/// runs. Its executor dies with it (PDEATHSIG); once the lease expires another
/// worker reclaims the step (LEASE_EXPIRED) and completes it.
async fn killed_worker_step_is_reclaimed_and_completed(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fast_config(vec![demo(lang, lang, &[], None)]);
    cfg.name = Some("doomed".into());
    let ttl = Duration::from_millis(cfg.lease_ttl_ms);
    let config = dir.path().join("worker.toml");
    std::fs::write(&config, tests::worker_toml(&cfg)).expect("write config");
    let log = dir.path().join("worker.log");
    let mut doomed = tokio::process::Command::new(tests::supervisor_bin())
        .arg("worker")
        .arg("--config")
        .arg(&config)
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::create(dir.path().join("worker.err")).expect("log"))
        .kill_on_drop(true)
        .spawn()
        .expect("start supervisor worker");

    let run = t
        .submit(
            json!({"name": "orphan", "steps": [{"name": "s", "executor_kind": lang,
            "kind": "demo.sleep", "input": {"ms": 4000, "steps": 40},
            "retry": {"max_attempts": 3, "initial_interval_ms": 0}}]}),
        )
        .await;
    let st = t
        .wait_run(run, LONG, |s| {
            s.steps
                .first()
                .is_some_and(|st| st.state == "running" && st.events >= 3)
        })
        .await;
    let step = only_step_id(&t, run).await;
    assert_eq!(st.steps[0].attempt, 1);
    let pgid = executor_pid(&t.db, step).await.expect("executor pid");
    assert!(
        !supervisor::process::group_members(pgid).is_empty(),
        "the doomed worker's executor runs"
    );

    doomed.start_kill().expect("SIGKILL the worker");
    let status = doomed.wait().await.expect("reap the worker");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{status}"
    );
    // the executor was the killed worker's child: PDEATHSIG ends it too
    tests::assert_no_survivors(step, Some(pgid), Duration::from_secs(10)).await;
    let st = t.status(run).await;
    assert_eq!(
        st.steps[0].state, "running",
        "nobody touched the orphan yet"
    );

    let mut cfg = fast_config(vec![demo(lang, lang, &[], None)]);
    cfg.name = Some("rescuer".into());
    let rescuer = RunningWorker::start(t.connect(5).await, cfg).await;
    let st = t.wait_terminal(run, LONG + ttl).await;
    let s = &st.steps[0];
    assert_eq!(st.state, "succeeded", "{:?}", s.error);
    assert_eq!(s.attempt, 2);
    assert_eq!(s.output, Some(json!({"slept_ms": 4000})));

    let history = step_transitions(&t.db, step).await;
    let summary: Vec<(Option<i32>, &str, Option<&str>, &str)> = history
        .iter()
        .map(|h| {
            (
                h.attempt,
                h.to_state.as_str(),
                h.worker.as_deref(),
                h.reason.as_deref().unwrap_or(""),
            )
        })
        .collect();
    let expired = history
        .iter()
        .find(|h| h.to_state == "retryable_failed")
        .expect("reclaimed");
    assert!(
        expired
            .reason
            .as_deref()
            .unwrap_or("")
            .starts_with("LEASE_EXPIRED"),
        "{summary:?}"
    );
    assert_eq!(expired.attempt, Some(1));
    assert_eq!(expired.worker.as_deref(), Some("rescuer"), "{summary:?}");
    let runs: Vec<(Option<i32>, Option<&str>)> = history
        .iter()
        .filter(|h| h.to_state == "running")
        .map(|h| (h.attempt, h.worker.as_deref()))
        .collect();
    assert_eq!(
        runs,
        vec![(Some(1), Some("doomed")), (Some(2), Some("rescuer"))]
    );
    let done = history.last().expect("history");
    assert_eq!(
        (done.to_state.as_str(), done.worker.as_deref()),
        ("succeeded", Some("rescuer"))
    );
    println!(
        "{lang}: {}",
        summary
            .iter()
            .map(|(a, to, w, why)| format!(
                "#{} {to} by {} ({why})",
                a.unwrap_or(0),
                w.unwrap_or("-")
            ))
            .collect::<Vec<_>>()
            .join(" → ")
    );
    rescuer.shutdown().await;
}
