//! Logs (issue 8, item 8): a real `supervisor worker` logs JSON lines
//! (`--log-format json` or `DURABLE_LOG_FORMAT=json`) or text, and every
//! line of an attempt carries its run, step, step_run_id and attempt; an
//! executor's stderr reaches the log inside the attempt's span, redacted and
//! rate-limited (`stderr_log_lines_per_sec`), with the rest counted.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use tests::{TestDb, WorkerProcess};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);

/// The tests' fast settings with a roomier lease: on a loaded two-core
/// machine a lease statement can take most of a 2 s TTL, and the attempt
/// would then (rightly) give up before sending its job.
fn fast_config(
    executors: Vec<supervisor::config::ExecutorConfig>,
) -> supervisor::config::WorkerConfig {
    supervisor::config::WorkerConfig {
        lease_ttl_ms: 10_000,
        heartbeat_interval_ms: 1_000,
        ..tests::fast_config(executors)
    }
}

fn one(name: &str, executor_kind: &str, kind: &str, extra: Value) -> Value {
    let mut s = json!({"name": name, "executor_kind": executor_kind, "kind": kind,
                       "retry": {"max_attempts": 1}});
    if let (Some(s), Some(extra)) = (s.as_object_mut(), extra.as_object()) {
        s.extend(extra.clone());
    }
    json!({"name": name, "steps": [s]})
}

/// The fields of the innermost span named `attempt` of a JSON line, if any.
fn attempt_span(line: &Value) -> Option<&Value> {
    line["spans"]
        .as_array()?
        .iter()
        .rev()
        .find(|s| s["name"] == "attempt")
}

/// Stops the worker (SIGTERM, drained) so every line is written.
/// Waits until the worker's log has `what`.
async fn until_logged(w: &WorkerProcess, what: &str) {
    let until = std::time::Instant::now() + LONG;
    while !w.stderr().contains(what) {
        assert!(
            std::time::Instant::now() < until,
            "no {what:?}: {}",
            w.stderr()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A step submitted now succeeds (the worker leases and commits).
async fn runs_a_step(t: &TestDb) {
    let run = t
        .submit(one("after", "go", "demo.echo", json!({"input": {"x": 1}})))
        .await;
    assert_eq!(t.wait_terminal(run, LONG).await.state, "succeeded");
}

async fn stop(w: &mut WorkerProcess) {
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(LONG).await, Some(0), "{}", w.stderr());
}

/// An outcome the database refuses for good is recorded as a
/// `COMMIT_REJECTED` failure instead, and the attempt's last line says so:
/// it said `recorded="yes"` beside `outcome=succeeded` for a step stored
/// `terminal_failed` (audit 63).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_outcome_is_logged_as_not_recorded() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    tests::refuse_poisoned_successes(&t.db).await;
    let cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let bad = t
        .submit(one(
            "bad",
            "go",
            "demo.echo",
            json!({"input": {"poison": true}}),
        ))
        .await;
    let ok = t
        .submit(one("ok", "go", "demo.echo", json!({"input": {"x": 1}})))
        .await;
    let bad_st = t.wait_terminal(bad, LONG).await;
    let ok_st = t.wait_terminal(ok, LONG).await;
    stop(&mut w).await;
    assert_eq!(bad_st.steps[0].state, "terminal_failed");
    let lines = w.json_log();
    for (st, recorded) in [
        (&bad_st, "no: refused, COMMIT_REJECTED recorded instead"),
        (&ok_st, "yes"),
    ] {
        let id = st.steps[0].step_run_id.to_string();
        let finished: Vec<&Value> = lines
            .iter()
            .filter(|l| {
                l["fields"]["message"] == "attempt finished"
                    && attempt_span(l).is_some_and(|a| a["step_run_id"] == id.as_str())
            })
            .collect();
        assert_eq!(finished.len(), 1, "{finished:?}");
        assert_eq!(
            finished[0]["fields"]["outcome"], "succeeded",
            "{finished:?}"
        );
        assert_eq!(finished[0]["fields"]["recorded"], recorded, "{finished:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_lines_carry_the_attempts_ids() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    // the format from the environment this time
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &[], &[("DURABLE_LOG_FORMAT", "json")]);
    let ok = t
        .submit(one("ok", "go", "demo.echo", json!({"input": {"x": 1}})))
        .await;
    let bad = t
        .submit(one(
            "bad",
            "go",
            "demo.fail",
            json!({"input": {"code": "LOGS_BOOM", "retryable": false}}),
        ))
        .await;
    let ok_st = t.wait_terminal(ok, LONG).await;
    let bad_st = t.wait_terminal(bad, LONG).await;
    stop(&mut w).await;

    // every line is a JSON object with a level, a target and a message
    let lines = w.json_log();
    assert!(!lines.is_empty());
    for l in &lines {
        assert!(
            l["level"].is_string() && l["target"].is_string() && l["timestamp"].is_string(),
            "{l}"
        );
        assert!(l["fields"]["message"].is_string(), "{l}");
    }
    for (st, outcome) in [(&ok_st, "succeeded"), (&bad_st, "failed (LOGS_BOOM)")] {
        let s = &st.steps[0];
        let id = s.step_run_id.to_string();
        let mine: Vec<&Value> = lines
            .iter()
            .filter(|l| attempt_span(l).is_some_and(|a| a["step_run_id"] == id.as_str()))
            .collect();
        // the attempt logs a few lines (at least its end), each with every id
        assert!(!mine.is_empty(), "no line in the span of {id}");
        for l in &mine {
            let a = attempt_span(l).expect("attempt span");
            assert_eq!(a["run_id"], st.run_id.to_string(), "{l}");
            assert_eq!(a["step"], s.name.as_str(), "{l}");
            assert_eq!(a["attempt"], 1, "{l}");
            assert_eq!(a["kind"], s.kind.as_str(), "{l}");
            // the current span is the attempt, inside the worker's
            assert_eq!(l["span"]["step_run_id"], id.as_str(), "{l}");
            assert_eq!(l["spans"][0]["name"], "worker", "{l}");
        }
        assert!(
            mine.iter()
                .any(|l| l["fields"]["message"] == "attempt finished"
                    && l["fields"]["outcome"] == outcome),
            "no `attempt finished` {outcome} line for {id}: {mine:?}"
        );
        // and no line of the attempt's code is logged outside an attempt span
        // while the step ran: every line of the attempt module has one
        for l in &lines {
            if l["target"] == "supervisor::worker::attempt" {
                assert!(
                    attempt_span(l).is_some(),
                    "an attempt line without its ids: {l}"
                );
            }
        }
    }
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "the attempt failed"
                && l["fields"]["code"] == "LOGS_BOOM"
                && attempt_span(l).is_some()),
        "the failure's warning carries the ids"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_lines_carry_the_attempts_ids() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "text"], &[]);
    let run = t.submit(one("ok", "go", "demo.echo", json!({}))).await;
    let st = t.wait_terminal(run, LONG).await;
    stop(&mut w).await;
    let log = w.stderr();
    let id = st.steps[0].step_run_id;
    let line = log
        .lines()
        .find(|l| l.contains("attempt finished") && l.contains(&id.to_string()))
        .unwrap_or_else(|| panic!("no `attempt finished` line for {id}:\n{log}"));
    for field in [
        format!("run_id={}", st.run_id),
        "step=ok".to_string(),
        format!("step_run_id={id}"),
        "attempt=1".to_string(),
        "kind=demo.echo".to_string(),
    ] {
        assert!(line.contains(&field), "{field} missing: {line}");
    }
    assert!(
        serde_json::from_str::<Value>(line).is_err(),
        "text, not JSON"
    );
}

/// The worker's own loops log in its span (observability audit): the
/// reclaim, heartbeat, LISTEN and ledger loops were spawned outside it, so
/// their lines ("lease lost", "reclaimed expired leases", "heartbeat
/// failed") named no worker, and with several workers logging to one place
/// none could be told apart. Here a lease another (silent) worker left
/// expires and this worker's reclaim loop logs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_loops_log_in_the_workers_span() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    t.submit(one("stale", "go", "stale.kind", json!({}))).await;
    let silent = uuid::Uuid::new_v4();
    t.db.register_worker(silent, "silent", "test", &json!([]))
        .await
        .expect("register");
    let route = supervisor::db::Route {
        executor_kind: "go".into(),
        kind: "stale.kind".into(),
        labels: Default::default(),
    };
    let leased =
        t.db.lease(silent, "silent", &[route], 1, Duration::from_millis(200))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 1);
    let mut cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.name = Some("loops-span".into());
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let until = std::time::Instant::now() + LONG;
    while !w.stderr().contains("reclaimed expired leases") {
        assert!(std::time::Instant::now() < until, "{}", w.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(&mut w).await;
    let log = w.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("reclaimed expired leases"))
        .expect("reclaim line");
    let v: Value = serde_json::from_str(line).expect("json");
    let spans = v["spans"].as_array().cloned().unwrap_or_default();
    assert!(
        spans.iter().any(|s| s["worker"] == "loops-span"),
        "no worker span: {line}"
    );
}

/// An executor's error message with newlines cannot start a log line of
/// its own (observability audit): the text format wrote it as it is, and a
/// `demo.fail` message forged a whole "attempt finished outcome=succeeded"
/// line. Each event stays on one line, its newlines escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executors_message_cannot_forge_a_log_line() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "text"], &[]);
    let forged = "2026-12-05T09:30:00.000000Z  INFO FORGED attempt finished outcome=succeeded";
    let run = t
        .submit(one(
            "fail",
            "go",
            "demo.fail",
            json!({"input": {"code": "BOOM", "retryable": false,
                             "message": format!("oops\n{forged}\r\nmore")}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.steps[0].state, "terminal_failed");
    stop(&mut w).await;
    let log = w.stderr();
    assert!(log.contains("FORGED"), "the message was logged: {log}");
    for line in log.lines() {
        assert!(
            !line.starts_with("2026-12-05T09:30:00"),
            "a forged line: {line}"
        );
        if line.contains("FORGED") {
            assert!(line.contains("oops\\n2026-12-05T09:30:00"), "{line}");
        }
    }
}

/// An executor's error message with terminal escape sequences (set the
/// window's title, clear the screen) reaches the text log escaped: no
/// control character of it is written (security audit: they were written
/// as they came, to the operator's terminal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executors_message_cannot_drive_the_terminal() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "text"], &[]);
    let run = t
        .submit(one(
            "fail",
            "go",
            "demo.fail",
            json!({"input": {"code": "BOOM", "retryable": false,
                             "message": "ESCAPED\u{1b}]0;TITLE\u{7}\u{1b}[2J\u{85}end"}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.steps[0].state, "terminal_failed");
    stop(&mut w).await;
    let log = w.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("ESCAPED"))
        .unwrap_or_else(|| panic!("the message was logged: {log}"));
    assert!(
        line.contains("ESCAPED\\x1b]0;TITLE\\x07\\x1b[2J\\u0085end"),
        "{line}"
    );
    for c in log.chars() {
        assert!(
            c == '\n' || c == '\t' || !(c.is_control() || c == '\u{2028}'),
            "{c:?} in the log: {log}"
        );
    }
}

fn hostile() -> supervisor::config::ExecutorConfig {
    supervisor::config::ExecutorConfig {
        name: "hostile".into(),
        command: tests::python().to_string_lossy().into_owned(),
        args: vec![tests::repo_root()
            .join("tests/executors/hostile.py")
            .to_string_lossy()
            .into_owned()],
        secrets: vec!["API_TOKEN".into()],
        ..Default::default()
    }
}

/// 2,001 stderr lines in well under a second (the first one echoes the
/// step's secret): the log has at most `stderr_log_lines_per_sec` of them
/// per second in the attempt's span, the secret redacted, and "suppressed"
/// lines that account for every other line; the counter of suppressed lines
/// agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_stderr_is_logged_in_the_attempt_redacted_and_rate_limited() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = "tok-logs-9f8e7d6c5b";
    std::fs::write(dir.path().join("API_TOKEN"), format!("{secret}\n")).expect("secret file");
    let mut cfg = fast_config(vec![hostile()]);
    cfg.secrets_dir = Some(PathBuf::from(dir.path()));
    cfg.stderr_log_lines_per_sec = 5;
    cfg.metrics_addr = Some("127.0.0.1:0".into());
    let mut w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let addr = w.metrics_addr(LONG).await;
    let run = t
        .submit(one(
            "chatty",
            "hostile",
            "hostile.stderr_chatty",
            json!({"input": {"lines": 2000}, "secrets": ["API_TOKEN"]}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.steps[0].state, "succeeded", "{:?}", st.steps[0].error);
    let (_, metrics) = tests::http_get(addr, "/metrics").await;
    stop(&mut w).await;

    let raw = w.stderr();
    assert!(!raw.contains(secret), "the secret reached the log");
    let id: Uuid = st.steps[0].step_run_id;
    let lines = w.json_log();
    let stderr_lines: Vec<&Value> = lines
        .iter()
        .filter(|l| l["target"] == supervisor::process::STDERR_TARGET)
        .collect();
    for l in &stderr_lines {
        let a = attempt_span(l).unwrap_or_else(|| panic!("a stderr line outside the attempt: {l}"));
        assert_eq!(a["step_run_id"], id.to_string(), "{l}");
        assert_eq!(a["run_id"], st.run_id.to_string(), "{l}");
        assert_eq!(a["attempt"], 1, "{l}");
    }
    let (summaries, logged): (Vec<&Value>, Vec<&Value>) = stderr_lines
        .iter()
        .partition(|l| l["fields"]["suppressed"].is_u64());
    let suppressed: u64 = summaries
        .iter()
        .map(|l| l["fields"]["suppressed"].as_u64().unwrap_or(0))
        .sum();
    let first = logged
        .first()
        .and_then(|l| l["fields"]["message"].as_str())
        .unwrap_or_default();
    assert_eq!(first, "secret [REDACTED:API_TOKEN]", "{logged:?}");
    assert!(!summaries.is_empty(), "no suppressed-lines report");
    assert_eq!(
        logged.len() as u64 + suppressed,
        2001,
        "every line is logged or counted: {} logged, {suppressed} suppressed",
        logged.len()
    );
    // 5 a second: the flood lasts about one window; a slow machine a few more
    assert!(
        (5..=25).contains(&logged.len()),
        "{} lines logged at 5 a second",
        logged.len()
    );
    assert_eq!(
        tests::metric(&metrics, "durable_stderr_lines_suppressed_total"),
        Some(suppressed as f64),
        "{metrics}"
    );
}

/// Text an executor printed to its stdout reads as a frame that never
/// completes: with no heartbeat timeout the step stayed `running` for ever
/// and the log said nothing (new developer's audit). Now the worker says
/// so, once, while the attempt waits, with the bytes' start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_that_never_completes_is_said_while_the_attempt_waits() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = fast_config(vec![tests::hostile("hostile", None, &[])]);
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let run = t
        .submit(one("printed", "hostile", "hostile.print_hang", json!({})))
        .await;
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let said = loop {
        let log = w.stderr();
        if let Some(l) = log
            .lines()
            .find(|l| l.contains("has held a frame that does not complete"))
        {
            break l.to_owned();
        }
        assert!(
            std::time::Instant::now() < until,
            "no word of the unfinished frame: {log}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(said.contains("did it print something there"), "{said}");
    assert!(said.contains("debug: hello"), "its first bytes: {said}");
    assert_eq!(t.status(run).await.steps[0].state, "running");
    t.db.cancel(run, None).await.expect("cancel");
    t.wait_terminal(run, LONG).await;
    stop(&mut w).await;
    assert_eq!(
        w.stderr()
            .matches("has held a frame that does not complete")
            .count(),
        1,
        "once"
    );
}

/// A heartbeat held up by a lock another session holds (here a LOCK TABLE
/// on the steps) says so, with the server's own words, and leasing resumes
/// once the lock goes: it was cut off by the worker's own bound and logged
/// as "the database did not answer within 5000 ms", with a hint about the
/// database's reachability, while the server answered everything else
/// (database-chaos audit 96).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_held_up_by_a_lock_says_so() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    // the heartbeat's bound is 5 s (half the 10 s TTL): locks are waited
    // for 4 s of it
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![tests::go_demo("go", &[], None)]));
    until_logged(&w, "worker running").await;
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.step_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let said = loop {
        let log = w.stderr();
        if let Some(l) = log.lines().find(|l| l.contains("heartbeat failed")) {
            break l.to_owned();
        }
        assert!(
            std::time::Instant::now() < until,
            "no failed heartbeat: {log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    holder.rollback().await.expect("rollback");
    assert!(
        said.contains("waited for a lock another session holds") && said.contains("lock timeout"),
        "{said}"
    );
    assert!(!said.contains("did not answer"), "{said}");
    let log = w.stderr();
    assert!(
        log.contains("the renewals wait for a lock: end the session that holds it"),
        "{log}"
    );
    // it recovers without a restart, and runs a step
    runs_a_step(&t).await;
    assert!(
        w.stderr().contains("leases are renewed again"),
        "{}",
        w.stderr()
    );
    stop(&mut w).await;
}

/// Once `w` runs: a run of one `demo.sleep` step of `ms`, running, and a
/// transaction holding `LOCK TABLE durable.step_runs` (roll it back to let
/// go).
async fn running_behind_a_table_lock(
    t: &TestDb,
    w: &WorkerProcess,
    ms: u64,
) -> (uuid::Uuid, sqlx::Transaction<'static, sqlx::Postgres>) {
    until_logged(w, "worker running").await;
    let run = t
        .submit(one(
            "slow",
            "go",
            "demo.sleep",
            json!({"input": {"ms": ms, "steps": 1}}),
        ))
        .await;
    let until = std::time::Instant::now() + LONG;
    while t.status(run).await.steps[0].state != "running" {
        assert!(std::time::Instant::now() < until, "never running");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.step_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock");
    (run, holder)
}

/// An outcome whose write waits behind a lock on a whole table (a LOCK
/// TABLE on the steps) is said to wait for a lock, and is written once the
/// lock goes: the ledger's probe for the rows it waited for waited the
/// pool's 10 s for the table itself, past the commit's own bound, and the
/// outcome's retries read "the database did not answer within … ms while
/// committing an outcome" (database-chaos audit 97).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_behind_a_table_lock_says_it_waits_for_a_lock() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![tests::go_demo("go", &[], None)]));
    let (run, holder) = running_behind_a_table_lock(&t, &w, 1500).await;
    // the attempt's writes (its progress, then its outcome) are retried,
    // each saying why
    until_logged(&w, "failed; retrying").await;
    holder.rollback().await.expect("rollback");
    let ended = t.wait_terminal(run, LONG).await.state;
    let log = w.stderr();
    assert_eq!(ended, "succeeded", "{log}");
    let said = log
        .lines()
        .find(|l| l.contains("failed; retrying") && l.contains("attempt{"))
        .unwrap_or_default();
    assert!(
        said.contains("waited for a lock another session holds"),
        "{said}"
    );
    assert!(
        !log.lines().any(|l| l.contains("did not answer")
            && (l.contains("committing an outcome") || l.contains("finding the rows"))),
        "{log}"
    );
    assert!(
        log.contains("a ledger batch waits for a lock another session holds on a whole table"),
        "{log}"
    );
    stop(&mut w).await;
}

/// An outcome whose write waits behind a table lock past its lease clock
/// gives up naming the lock its tries waited for, beside the last try's
/// cut-off: it read only "the database did not answer within 1000 ms while
/// committing an outcome" (re-check audit 103).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_given_up_behind_a_lock_names_the_lock() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![tests::go_demo("go", &[], None)]));
    let (run, holder) = running_behind_a_table_lock(&t, &w, 300).await;
    until_logged(&w, "commit failed and the lease clock ran out").await;
    holder.rollback().await.expect("rollback");
    let log = w.stderr();
    let said = log
        .lines()
        .find(|l| l.contains("commit failed and the lease clock ran out"))
        .unwrap_or_default();
    assert!(
        said.contains("waited for a lock another session holds"),
        "{said}"
    );
    t.wait_terminal(run, LONG).await;
    stop(&mut w).await;
}

/// A lease call held up by a table lock for most of a lease's time does
/// not bring steps whose lease clocks are nearly spent: it is cut off at
/// half of what a clock has beyond the stop budget, and what it leased
/// late is given back uncounted. It waited the pool's 10 s, and a step it
/// brought with less than the stop budget left was stopped as its attempt
/// began and counted (`LEASE_LOST`: one of `max_attempts` 1 failed its run;
/// re-check audit 103).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_call_behind_a_table_lock_costs_no_attempt() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut exec = tests::go_demo("go", &[], None);
    exec.concurrency = 1;
    // stop budget 4.5 s (graces 2 s + 2 s, half a heartbeat): a lease call
    // may take 2.75 s of the 10 s
    let cfg = supervisor::config::WorkerConfig {
        cancel_grace_ms: 2_000,
        term_grace_ms: 2_000,
        ..fast_config(vec![exec])
    };
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    until_logged(&w, "worker running").await;
    let run = t
        .submit(json!({"name": "three", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 1500, "steps": 1}, "retry": {"max_attempts": 1}},
            {"name": "b", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 100, "steps": 1}, "retry": {"max_attempts": 1}},
            {"name": "c", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 100, "steps": 1}, "retry": {"max_attempts": 1}}]}))
        .await;
    let until = std::time::Instant::now() + LONG;
    while !t
        .status(run)
        .await
        .steps
        .iter()
        .any(|s| s.state == "running")
    {
        assert!(std::time::Instant::now() < until, "never running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // the one slot frees after ~1.5 s: the next lease call waits behind
    // the lock until it goes, 8 s after it was taken
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.step_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock");
    tokio::time::sleep(Duration::from_secs(8)).await;
    holder.rollback().await.expect("rollback");
    let ended = t.wait_terminal(run, LONG).await;
    let log = w.stderr();
    assert_eq!(ended.state, "succeeded", "{log}");
    assert!(
        !log.contains("the lease could not be renewed in time"),
        "{log}"
    );
    let cut_off = log
        .lines()
        .find(|l| l.contains("lease failed"))
        .unwrap_or_default();
    assert!(
        cut_off.contains("most likely for a lock") && !cut_off.contains("pool"),
        "the call was cut off, and says why: {log}"
    );
    stop(&mut w).await;
}

/// A heartbeat whose connection the server ended (a restart,
/// `pg_terminate_backend`) renews on a new connection at once: each such
/// end cost a failed renewal, and an interval of leasing nothing
/// (database-chaos audit 96).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_whose_connection_was_ended_renews_on_a_new_one() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![tests::go_demo("go", &[], None)]));
    let until = std::time::Instant::now() + LONG;
    let heartbeat_backend = loop {
        let pid: Option<i32> = sqlx::query_scalar(
            // the worker's sessions only: another connection of this
            // test's pool, whose last query was this one, matches the
            // pattern too (it was terminated instead, once, in CI)
            "SELECT pid FROM pg_stat_activity
              WHERE datname = current_database() AND query LIKE '%durable.renew_leases(%'
                AND application_name LIKE 'durable worker%'
                AND pid <> pg_backend_pid() LIMIT 1",
        )
        .fetch_optional(t.db.pool())
        .await
        .expect("pg_stat_activity");
        if let Some(pid) = pid {
            break pid;
        }
        assert!(
            std::time::Instant::now() < until,
            "no heartbeat: {}",
            w.stderr()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(heartbeat_backend)
        .fetch_one(t.db.pool())
        .await
        .expect("terminate");
    assert!(ended);
    // three heartbeats later (1 s apart), none failed
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let log = w.stderr();
    assert!(!log.contains("heartbeat failed"), "{log}");
    runs_a_step(&t).await;
    stop(&mut w).await;
}

/// A lease call on a connection the server ended (a restart,
/// `pg_terminate_backend`: the server says so, so nothing was leased) is
/// made again at once on a new one: it was logged as "lease failed" and
/// the worker leased nothing for a poll interval (audit 99).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_call_on_an_ended_connection_is_made_again_at_once() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut w = WorkerProcess::spawn(&t.url, &fast_config(vec![tests::go_demo("go", &[], None)]));
    until_logged(&w, "worker running").await;
    // every session of the worker, idle between its calls
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name LIKE 'durable worker%'",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("terminate");
    assert!(!ended.is_empty() && ended.iter().all(|e| *e), "{ended:?}");
    // a step makes the lease loop lease at once (LISTEN too was ended)
    runs_a_step(&t).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let log = w.stderr();
    assert!(!log.contains("lease failed"), "{log}");
    assert!(!log.contains("heartbeat failed"), "{log}");
    stop(&mut w).await;
}
