//! Every demo.misbehave mode, for the Go and the Python demo executor, in one
//! worker at the same time: each ends with its stable code from PROTOCOL.md
//! (or succeeds), no process of any attempt is left, and meanwhile a stream of
//! demo.echo steps in the same worker keeps completing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tests::{demo, executor_pid, fast_config, RunningWorker, TestDb, LANGS};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(180);

/// (mode, extra step fields, expected code; None = succeeded)
fn modes() -> Vec<(&'static str, serde_json::Value, Option<&'static str>)> {
    vec![
        ("crash", json!({}), Some("EXECUTOR_CRASHED")),
        ("garbage", json!({}), Some("PROTOCOL_MALFORMED_FRAME")),
        ("oversize", json!({}), Some("PROTOCOL_FRAME_TOO_LARGE")),
        ("backwards", json!({}), Some("PROTOCOL_SEQUENCE_REGRESSION")),
        (
            "after_terminal",
            json!({}),
            Some("PROTOCOL_FRAME_AFTER_TERMINAL"),
        ),
        (
            "hang",
            json!({"heartbeat_timeout_ms": 1000}),
            Some("HEARTBEAT_TIMEOUT"),
        ),
        (
            "ignore_cancel",
            json!({"timeout_ms": 1500}),
            Some("ATTEMPT_TIMEOUT"),
        ),
        ("grandchild", json!({}), None),
        ("stdout_print", json!({}), None),
        ("stderr_flood", json!({}), None),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_misbehaviour_has_its_code_and_the_worker_keeps_serving() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut executors: Vec<_> = LANGS.iter().map(|l| demo(l, l, &[], None)).collect();
    for e in &mut executors {
        e.concurrency = 16; // ten misbehaving attempts, room for the echo stream
    }
    // a 10 s lease: twenty misbehaving attempts (floods, hangs, garbage) on a
    // loaded two-core machine could delay renewals past fast_config's 2 s
    // TTL (CI saw LEASE_EXPIRED once); no mode here is about lease expiry
    let mut cfg = fast_config(executors);
    cfg.lease_ttl_ms = 10_000;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    let mut cases: Vec<(&str, &str, Option<&str>, Uuid)> = Vec::new();
    for lang in LANGS {
        for (mode, extra, expected) in modes() {
            let mut step = json!({"name": "s", "executor_kind": lang, "kind": "demo.misbehave",
                                  "input": {"mode": mode}, "retry": {"max_attempts": 1}});
            if let (Some(s), Some(e)) = (step.as_object_mut(), extra.as_object()) {
                for (k, v) in e {
                    s.insert(k.clone(), v.clone());
                }
            }
            let run = t
                .submit(json!({"name": format!("misbehave-{lang}-{mode}"), "steps": [step]}))
                .await;
            cases.push((lang, mode, expected, run));
        }
    }

    // then the echo stream, while those run: one run every 100 ms, alternating
    // languages, until told to stop
    let stop = Arc::new(AtomicBool::new(false));
    let echo_db = t.connect(2).await;
    let echo_stop = stop.clone();
    let echoes = tokio::spawn(async move {
        let mut runs = Vec::new();
        let mut i = 0usize;
        while !echo_stop.load(Ordering::SeqCst) {
            let lang = LANGS[i % 2];
            let run = echo_db
                .submit(&json!({"name": format!("echo-{i}"), "steps": [{"name": "s",
                    "executor_kind": lang, "kind": "demo.echo", "input": {"i": i}}]}))
                .await
                .expect("submit echo");
            runs.push(run);
            i += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        runs
    });

    let mut table: BTreeMap<&str, BTreeMap<&str, String>> = BTreeMap::new();
    let mut last_finish = None;
    for &(lang, mode, expected, run) in &cases {
        let st = t.wait_terminal(run, LONG).await;
        let s = &st.steps[0];
        let what = format!("{lang} {mode}");
        let got = match (&s.state[..], &s.error) {
            ("succeeded", _) => "succeeded".to_string(),
            (_, Some(e)) => e.code.clone(),
            (state, None) => state.to_string(),
        };
        match expected {
            Some(code) => {
                assert_eq!(s.state, "terminal_failed", "{what}: {:?}", s.error);
                let e = s.error.as_ref().expect("error");
                assert_eq!(e.code, code, "{what}: {}", e.message);
                assert_eq!(st.state, "failed", "{what}");
            }
            None => {
                assert_eq!(s.state, "succeeded", "{what}: {:?}", s.error);
                assert_eq!(st.state, "succeeded", "{what}");
            }
        }
        assert_eq!(s.attempt, 1, "{what}");
        // nothing of the attempt is left: not the executor, not its group
        // (the grandchild `sleep 300`), not anything in its directory
        let pgid = executor_pid(&t.db, s.step_run_id).await;
        assert!(pgid.is_some(), "{what}: the executor accepted the job");
        tests::assert_no_survivors(s.step_run_id, pgid, Duration::from_secs(10)).await;
        if mode == "grandchild" {
            let gc = s
                .output
                .as_ref()
                .and_then(|o| o["grandchild_pid"].as_i64())
                .expect("grandchild pid in the output") as i32;
            assert_eq!(
                supervisor::process::group_members(pgid.unwrap_or(0)),
                Vec::<i32>::new()
            );
            let alive = std::fs::read_to_string(format!("/proc/{gc}/stat"))
                .map(|s| {
                    // state is the field after the ")" of the command name
                    !s.rsplit_once(')')
                        .map(|(_, r)| r.trim_start().starts_with('Z'))
                        .unwrap_or(false)
                })
                .unwrap_or(false);
            assert!(
                !alive,
                "{what}: the grandchild {gc} was killed with its group"
            );
        }
        last_finish = last_finish.max(st.finished_at);
        table.entry(mode).or_default().insert(lang, got);
    }

    // stop the echo stream; every echo completed, many while the misbehaving ran
    stop.store(true, Ordering::SeqCst);
    let echo_runs = echoes.await.expect("echo task");
    let last_finish = last_finish.expect("finish times");
    let mut during = 0;
    for run in &echo_runs {
        let st = t.wait_terminal(*run, LONG).await;
        assert_eq!(
            st.state, "succeeded",
            "echo run {run}: {:?}",
            st.steps[0].error
        );
        if st.finished_at.is_some_and(|f| f < last_finish) {
            during += 1;
        }
    }
    println!(
        "echo runs: {} submitted after the misbehaving ones, all succeeded, {during} finished before the last misbehaving step",
        echo_runs.len()
    );
    assert!(
        during >= 3,
        "the worker kept serving echo steps meanwhile ({during} finished before the last misbehaving step)"
    );

    let mut lines = vec![format!("{:<16} {:<32} {}", "mode", "go", "python")];
    for (mode, _, _) in modes() {
        let row = &table[mode];
        lines.push(format!("{:<16} {:<32} {}", mode, row["go"], row["python"]));
    }
    println!(
        "demo.misbehave: mode × language → outcome\n{}",
        lines.join("\n")
    );
    w.shutdown().await;
}

/// An executor that writes its result behind more frames than its stdout
/// pipe holds and exits at once (as both SDKs do after their
/// `max_jobs_per_process`-th job) has its result read and recorded: the
/// drain after the exit stopped at 1,024 frames, ~1,100-1,450 heartbeats
/// fill a 64 KiB pipe, and the step was recorded `EXECUTOR_CRASHED` ("ended
/// without a terminal") though its result had been written (SDK audit: 6 of
/// 8 steps with 3,000 heartbeats).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_written_behind_a_full_pipe_before_the_exit_is_kept() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut e = tests::hostile("hostile", None, &[]);
    e.concurrency = 2;
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;
    let n = 6000;
    let mut runs = Vec::new();
    for i in 0..6 {
        runs.push(
            t.submit(json!({"name": format!("burst-{i}"), "steps": [
                {"name": "s", "executor_kind": "hostile", "kind": "hostile.burst_exit",
                 "input": {"heartbeats": n}, "retry": {"max_attempts": 1}}]}))
                .await,
        );
    }
    for run in runs {
        let st = t.wait_terminal(run, LONG).await;
        let s = &st.steps[0];
        assert_eq!(
            (st.state.as_str(), s.state.as_str()),
            ("succeeded", "succeeded"),
            "the result written before the exit is the outcome: {:?}",
            s.error
        );
        assert_eq!(s.output, Some(json!({"burst": n})));
    }
    w.shutdown().await;
}
