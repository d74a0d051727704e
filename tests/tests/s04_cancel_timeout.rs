//! S04: cancel, attempt timeout and step deadline, for the Go and the Python
//! demo executors. A cancel of a leased step never starts it; a cancel of a
//! running step ends it `cancelled` and leaves no process behind; a
//! start-to-close timeout fails the attempt with ATTEMPT_TIMEOUT (retried while
//! attempts remain); a passed deadline fails the step with DEADLINE_EXCEEDED;
//! an executor that ignores the cancel and SIGTERM is ended with SIGKILL.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use supervisor::config::WorkerConfig;
use supervisor::db::Route;
use tests::{
    attempt_processes, demo, event_count, executor_pid, fast_config, logged, only_step_id,
    step_transitions, wrap_in_shell, RunningWorker, TestDb,
};
use uuid::Uuid;

/// Generous bound for anything that should take seconds on an idle machine.
const LONG: Duration = Duration::from_secs(120);

tests::for_each_lang!(
    cancel_leased_step_through_the_db,
    cancel_leased_step_through_a_worker,
    cancel_running_step,
    attempt_timeout,
    step_deadline,
    ignore_cancel_escalates_to_sigkill,
);

/// A one-step run of `kind` for `lang`, with extra step fields merged in.
fn spec(name: &str, lang: &str, kind: &str, input: Value, extra: Value) -> Value {
    let mut step = json!({"name": "s", "executor_kind": lang, "kind": kind, "input": input});
    if let (Some(s), Some(e)) = (step.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    json!({"name": name, "steps": [step]})
}

fn worker_config(lang: &str) -> WorkerConfig {
    fast_config(vec![demo(lang, lang, &[], None)])
}

/// The bound within which no process of a stopped attempt may remain.
fn stop_bound(cfg: &WorkerConfig) -> Duration {
    Duration::from_millis(cfg.cancel_grace_ms + cfg.term_grace_ms) + Duration::from_secs(1)
}

/// Waits until the run's only step is running and has at least `events` events.
async fn wait_running(t: &TestDb, run: Uuid, events: i64) {
    t.wait_run(run, LONG, |s| {
        s.steps
            .first()
            .is_some_and(|st| st.state == "running" && st.events >= events)
    })
    .await;
}

/// Waits until the run is terminal, then checks that nothing of the attempt
/// is alive within `bound` of that moment.
async fn assert_gone_after(step: Uuid, pgid: Option<i32>, bound: Duration) {
    let at = Instant::now();
    tests::assert_no_survivors(step, pgid, bound).await;
    assert!(
        at.elapsed() <= bound,
        "processes of {step} outlived the bound {bound:?}"
    );
}

/// a. A step that is leased (owned, not running): the owner learns of the
/// cancel from its heartbeat and confirms it; the step never runs.
async fn cancel_leased_step_through_the_db(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let run = t
        .submit(spec(
            "cancel-leased-db",
            lang,
            "demo.sleep",
            json!({"ms": 60000}),
            json!({}),
        ))
        .await;
    let me = Uuid::new_v4();
    t.db.register_worker(me, "fake", "test", &json!([]))
        .await
        .expect("register");
    let routes = vec![Route {
        executor_kind: lang.into(),
        kind: "demo.sleep".into(),
        labels: Default::default(),
    }];
    let leased =
        t.db.lease(me, "fake", &routes, 1, Duration::from_secs(30))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 1, "the fake worker leases the step");
    let lease = leased[0].lease.clone();
    assert!(!leased[0].cancel_requested);
    assert_eq!(t.status(run).await.steps[0].state, "leased");

    let after = t.db.cancel(run, None).await.expect("cancel");
    assert!(
        !after.is_terminal(),
        "the run waits for the owner to confirm: {after:?}"
    );
    let st = t.status(run).await;
    assert_eq!(
        st.steps[0].state, "leased",
        "only the owner ends a leased step"
    );
    assert!(st.steps[0].cancel_requested);

    let hb =
        t.db.heartbeat(me, std::slice::from_ref(&lease), Duration::from_secs(30))
            .await
            .expect("heartbeat");
    assert_eq!(hb.cancel_requested, vec![lease.step_run_id()]);
    assert!(hb.lost.is_empty());
    t.db.confirm_cancelled(&lease, "fake", "cancelled before it started")
        .await
        .expect("confirm");

    let st = t.status(run).await;
    assert_eq!(st.state, "cancelled");
    assert_eq!(st.steps[0].state, "cancelled");
    let history = step_transitions(&t.db, lease.step_run_id()).await;
    assert!(
        history.iter().all(|h| h.to_state != "running"),
        "{history:?}"
    );
    assert_eq!(
        history.last().map(|h| h.from_state.as_deref()),
        Some(Some("leased"))
    );
}

/// a. The same through a real worker. The executor is started through a shell
/// that waits three seconds first, so the step stays `leased` (spawned, not
/// handshaken) long enough to be cancelled there: the job must never be sent.
async fn cancel_leased_step_through_a_worker(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let slow = wrap_in_shell(demo(lang, lang, &[], None), "sleep 3; exec \"$0\" \"$@\"");
    let cfg = fast_config(vec![slow]);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;

    let run = t
        .submit(spec(
            "cancel-leased",
            lang,
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
            json!({}),
        ))
        .await;
    let st = t
        .wait_run(run, LONG, |s| {
            s.steps.first().is_some_and(|st| st.state != "pending")
        })
        .await;
    assert_eq!(
        st.steps[0].state, "leased",
        "the slow executor cannot have accepted yet"
    );
    let step = st.steps[0].step_run_id;
    t.db.cancel(run, None).await.expect("cancel");

    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.state, "cancelled");
    assert_eq!(st.steps[0].state, "cancelled");
    assert_gone_after(step, None, bound).await;
    let history = step_transitions(&t.db, step).await;
    assert!(
        history.iter().all(|h| h.to_state != "running"),
        "a step cancelled while leased never runs: {history:?}"
    );
    assert_eq!(event_count(&t.db, step).await, 0, "no job was executed");
    assert_eq!(executor_pid(&t.db, step).await, None);
    w.shutdown().await;
}

/// b. A running demo.sleep, cancelled: `cancelled`, and every process of the
/// attempt is gone within cancel_grace + term_grace + 1 s of the commit.
async fn cancel_running_step(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = worker_config(lang);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let run = t
        .submit(spec(
            "cancel-running",
            lang,
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
            json!({}),
        ))
        .await;
    // accepted, running and at least one progress event
    wait_running(&t, run, 3).await;
    let step = only_step_id(&t, run).await;
    let pgid = executor_pid(&t.db, step).await.expect("executor pid");
    assert!(
        !attempt_processes(step, Some(pgid)).is_empty(),
        "the executor runs"
    );

    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    assert_gone_after(step, Some(pgid), bound).await;
    assert_eq!(st.state, "cancelled");
    assert_eq!(st.steps[0].state, "cancelled");
    assert_eq!(
        st.steps[0].error.as_ref().map(|e| e.code.as_str()),
        Some("CANCELLED")
    );
    let history = step_transitions(&t.db, step).await;
    let last = history.last().expect("history");
    assert_eq!(
        (last.from_state.as_deref(), last.to_state.as_str()),
        (Some("running"), "cancelled")
    );
    // the attempt's ending event is `CODE: why`, as every other ending's
    let (kind, message): (String, String) = sqlx::query_as(
        "SELECT kind, message FROM durable.step_events WHERE step_run_id = $1
          ORDER BY attempt DESC, sequence DESC LIMIT 1",
    )
    .bind(step)
    .fetch_one(t.db.pool())
    .await
    .expect("ending event");
    assert_eq!(kind, "cancelled");
    assert_eq!(message, "CANCELLED: cancelled on request");
    assert!(
        logged(&[&step.to_string(), "ignored SIGTERM"]).is_empty(),
        "the demo honours the cancel: no escalation was needed"
    );
    w.shutdown().await;
}

/// c. timeout_ms bounds one attempt: ATTEMPT_TIMEOUT, terminal when no attempt
/// is left, retried (retryable_failed in between) while one is.
async fn attempt_timeout(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = worker_config(lang);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let input = json!({"ms": 60000, "steps": 600});
    let once = t
        .submit(spec(
            "timeout-once",
            lang,
            "demo.sleep",
            input.clone(),
            json!({"timeout_ms": 1000, "retry": {"max_attempts": 1}}),
        ))
        .await;
    let twice = t
        .submit(spec(
            "timeout-twice",
            lang,
            "demo.sleep",
            input,
            json!({"timeout_ms": 1000, "retry": {"max_attempts": 2, "initial_interval_ms": 0}}),
        ))
        .await;

    for (run, attempts) in [(once, 1), (twice, 2)] {
        let st = t.wait_terminal(run, LONG).await;
        assert_eq!(st.state, "failed");
        let s = &st.steps[0];
        assert_eq!(s.state, "terminal_failed");
        assert_eq!(s.attempt, attempts);
        let err = s.error.as_ref().expect("error");
        assert_eq!(err.code, "ATTEMPT_TIMEOUT", "{}", err.message);
        let pgid = executor_pid(&t.db, s.step_run_id).await;
        assert_gone_after(s.step_run_id, pgid, bound).await;

        let history = step_transitions(&t.db, s.step_run_id).await;
        let failures: Vec<(Option<i32>, &str, &str)> = history
            .iter()
            .filter(|h| h.to_state.ends_with("failed"))
            .map(|h| {
                (
                    h.attempt,
                    h.to_state.as_str(),
                    h.reason.as_deref().unwrap_or(""),
                )
            })
            .collect();
        let expected: Vec<(Option<i32>, &str)> = if attempts == 1 {
            vec![(Some(1), "terminal_failed")]
        } else {
            vec![(Some(1), "retryable_failed"), (Some(2), "terminal_failed")]
        };
        assert_eq!(
            failures.iter().map(|f| (f.0, f.1)).collect::<Vec<_>>(),
            expected,
            "{history:?}"
        );
        assert!(
            failures.iter().all(|f| f.2.starts_with("ATTEMPT_TIMEOUT")),
            "{failures:?}"
        );
        let runs = history.iter().filter(|h| h.to_state == "running").count();
        assert_eq!(runs, attempts as usize, "each attempt ran: {history:?}");
    }
    w.shutdown().await;
}

/// d. A deadline bounds the whole step: DEADLINE_EXCEEDED, not retried, no
/// process left.
async fn step_deadline(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = worker_config(lang);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let deadline = (chrono::Utc::now() + chrono::Duration::milliseconds(1500)).to_rfc3339();
    let run = t
        .submit(spec(
            "deadline",
            lang,
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
            json!({"deadline": deadline, "retry": {"max_attempts": 5, "initial_interval_ms": 0}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.state, "failed");
    let s = &st.steps[0];
    assert_eq!(s.state, "terminal_failed");
    let err = s.error.as_ref().expect("error");
    assert_eq!(err.code, "DEADLINE_EXCEEDED", "{}", err.message);
    assert!(!err.retryable);
    assert_eq!(s.attempt, 1, "a passed deadline is not retried");
    let pgid = executor_pid(&t.db, s.step_run_id).await;
    assert_gone_after(s.step_run_id, pgid, bound).await;
    w.shutdown().await;
}

/// e. demo.misbehave ignore_cancel ignores the cancel frame and SIGTERM: the
/// escalation reaches SIGKILL; the step still ends `cancelled`, nothing survives.
async fn ignore_cancel_escalates_to_sigkill(lang: &str) {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = worker_config(lang);
    let graces = Duration::from_millis(cfg.cancel_grace_ms + cfg.term_grace_ms);
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let run = t
        .submit(spec(
            "ignore-cancel",
            lang,
            "demo.misbehave",
            json!({"mode": "ignore_cancel"}),
            json!({}),
        ))
        .await;
    // the PROGRESS event after accepted/running says the SIGTERM handler is installed
    wait_running(&t, run, 3).await;
    let step = only_step_id(&t, run).await;
    let pgid = executor_pid(&t.db, step).await.expect("executor pid");

    let asked = Instant::now();
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    let took = asked.elapsed();
    assert_gone_after(step, Some(pgid), bound).await;
    assert_eq!(st.state, "cancelled");
    assert_eq!(st.steps[0].state, "cancelled");
    assert!(
        took >= graces,
        "cancel frame and SIGTERM were both ignored, so the end took at least both graces ({took:?})"
    );
    let escalated = logged(&[&step.to_string(), "ignored SIGTERM; sending SIGKILL"]);
    assert!(
        !escalated.is_empty(),
        "the worker escalated to SIGKILL for step {step}"
    );
    println!("{lang}: cancel → cancelled in {took:?}; {}", escalated[0]);
    w.shutdown().await;
}

/// A deadline bounds the whole step also when no worker can run it: a step
/// of a label no worker offers, and one of an executor kind nobody runs, fail
/// `DEADLINE_EXCEEDED` once their deadline passed (any worker's reclaim pass
/// ends them), and their runs fail; a step whose deadline is still ahead is
/// left pending. Before, such a step stayed `pending` for ever.
#[tokio::test]
async fn a_step_no_worker_can_run_fails_by_its_deadline() {
    let t = TestDb::new().await;
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let soon = (chrono::Utc::now() + chrono::Duration::milliseconds(800)).to_rfc3339();
    let later = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let gpu = t
        .submit(json!({"name": "gpu", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.echo",
            "labels": {"gpu": "yes"}, "deadline": soon}]}))
        .await;
    let rust = t
        .submit(
            json!({"name": "rust", "steps": [{"name": "s", "executor_kind": "rust", "kind": "x",
            "deadline": soon}, {"name": "after", "executor_kind": "go", "kind": "demo.echo",
            "depends_on": ["s"]}]}),
        )
        .await;
    let ahead = t
        .submit(
            json!({"name": "ahead", "steps": [{"name": "s", "executor_kind": "rust", "kind": "x",
            "deadline": later}]}),
        )
        .await;
    for run in [gpu, rust] {
        let st = t.wait_terminal(run, Duration::from_secs(30)).await;
        assert_eq!(st.state, "failed", "{st:?}");
        let s = tests::step(&st, "s");
        assert_eq!(s.state, "terminal_failed");
        let err = s.error.as_ref().expect("error");
        assert_eq!(err.code, "DEADLINE_EXCEEDED", "{}", err.message);
        assert!(!err.retryable);
        assert!(
            err.message.contains("before a worker could start it"),
            "{}",
            err.message
        );
        assert!(st.waiting.is_empty(), "{:?}", st.waiting);
    }
    let st = t.status(ahead).await;
    assert_eq!(st.steps[0].state, "pending");
    w.shutdown().await;
}

/// A running executor stopped by a signal (SIGSTOP) is ended by the step's
/// heartbeat_timeout_ms like a hung one, and the error says it was stopped
/// (stop audit: the message read like the executor's own hang); it is
/// SIGKILLed where it stands, within the graces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_executors_heartbeat_timeout_says_it_was_stopped() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = worker_config("go");
    let bound = stop_bound(&cfg);
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let run = t
        .submit(spec(
            "stopped",
            "go",
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
            json!({"heartbeat_timeout_ms": 1000, "retry": {"max_attempts": 1}}),
        ))
        .await;
    wait_running(&t, run, 2).await;
    let st = t.status(run).await;
    let s = &st.steps[0];
    let pid = executor_pid(&t.db, s.step_run_id)
        .await
        .expect("the executor's pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("stop the executor");

    let st = t.wait_terminal(run, LONG).await;
    let s = &st.steps[0];
    assert_eq!(s.state, "terminal_failed");
    let err = s.error.as_ref().expect("error");
    assert_eq!(err.code, "HEARTBEAT_TIMEOUT", "{}", err.message);
    assert!(
        err.message.contains(
            "its process was stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger"
        ),
        "{}",
        err.message
    );
    assert_gone_after(s.step_run_id, Some(pid), bound).await;
    w.shutdown().await;
}

/// A cancel of a step whose executor is stopped by a signal waits no cancel
/// grace (a stopped process answers nothing within it), and the step's
/// message says the process was stopped: "gave no terminal within its
/// grace" alone blamed the executor (re-check audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_a_stopped_executor_waits_no_grace_and_says_it_was_stopped() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = worker_config("go");
    // far above what the cancel takes without a grace
    cfg.cancel_grace_ms = 5_000;
    cfg.lease_ttl_ms = 10_000;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let run = t
        .submit(spec(
            "cancel-stopped",
            "go",
            "demo.sleep",
            json!({"ms": 60000, "steps": 600}),
            json!({}),
        ))
        .await;
    wait_running(&t, run, 2).await;
    let step = only_step_id(&t, run).await;
    let pid = executor_pid(&t.db, step).await.expect("executor pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("stop the executor");

    let asked = Instant::now();
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    let took = asked.elapsed();
    assert_eq!(st.state, "cancelled");
    let s = &st.steps[0];
    let err = s.error.as_ref().expect("the cancel's message");
    assert!(
        err.message.contains(
            "its process was stopped by a signal (SIGSTOP, SIGTSTP) or held by a debugger"
        ),
        "{}",
        err.message
    );
    assert!(
        took < Duration::from_secs(4),
        "the cancel took {took:?}: the grace was waited for a stopped process"
    );
    tests::assert_no_survivors(step, Some(pid), Duration::from_secs(2)).await;
    w.shutdown().await;
}
