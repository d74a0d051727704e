//! Issue 6, the worker's half: hostile executors, a hostile database, and the
//! worker's own failures. Each test pins a failure that was reachable before
//! its fix (the item number of the issue is in its doc comment). The hostile
//! executor (`tests/executors/hostile.py`) speaks the protocol at the frame
//! level, the way an executor written from PROTOCOL.md alone might.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use supervisor::config::WorkerConfig;
use supervisor::worker::Worker;
use tests::blackhole::Blackhole;
use tests::{fast_config, go_demo, hostile, step, RunningWorker, TestDb};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);

fn spec(kind: &str, extra: Value) -> Value {
    let mut s = json!({"name": "s", "executor_kind": "hostile", "kind": kind, "input": {"x": 1},
                       "retry": {"max_attempts": 1}});
    if let (Some(o), Some(e)) = (s.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    json!({"name": kind, "steps": [s]})
}

fn spawns(log: &PathBuf) -> usize {
    std::fs::read_to_string(log)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// 4: text PostgreSQL cannot store (a NUL in an error message, an event
/// message, the output JSON; a number beyond numeric in the output or an
/// error's details) and a result too large for one message: each
/// ends the first attempt with its own stable code. Before the fix the commit
/// failed, was retried for a TTL, the step re-ran and ended LEASE_EXPIRED
/// with the real cause gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_outcomes_end_with_their_own_code() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![
        hostile("hostile", None, &[]),
        go_demo("go", &[], None),
    ]);
    cfg.max_result_bytes = 1_000;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let cases = [
        ("hostile.nul_error", "PROTOCOL_INVALID_TEXT"),
        ("hostile.nul_event", "PROTOCOL_INVALID_TEXT"),
        ("hostile.nul_output", "OUTPUT_INVALID"),
        // a number beyond numeric: jsonb refused the whole commit
        ("hostile.huge_number_output", "OUTPUT_INVALID"),
        ("hostile.huge_number_details", "BIG"),
        // stored, only the last value would have stood (audit 94)
        ("hostile.duplicate_key_output", "OUTPUT_INVALID"),
    ];
    let mut runs = Vec::new();
    for (kind, code) in cases {
        runs.push((kind, code, t.submit(spec(kind, json!({}))).await));
    }
    let big = t
        .submit(json!({"name": "big", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.artifact",
            "input": {"content": "x", "repeat": 2000}, "retry": {"max_attempts": 3}}]}))
        .await;
    runs.push(("demo.artifact", "RESULT_TOO_LARGE", big));
    for (kind, code, run) in runs {
        let st = t.wait_terminal(run, LONG).await;
        let s = step(&st, "s");
        assert_eq!(s.state, "terminal_failed", "{kind}: {s:?}");
        let e = s.error.as_ref().expect("error");
        assert_eq!(e.code, code, "{kind}: {}", e.message);
        assert_eq!(s.attempt, 1, "{kind} ran again");
        assert!(!e.message.contains('\0'));
        match kind {
            "hostile.huge_number_output" => {
                assert!(
                    e.message.contains("output.n[1] is the number 1e+999999"),
                    "{}",
                    e.message
                )
            }
            "hostile.duplicate_key_output" => assert!(
                e.message
                    .contains("gives a key twice in one object (duplicate key \"x\" at line 1"),
                "{}",
                e.message
            ),
            // evidence is kept: the number as its text
            "hostile.huge_number_details" => assert_eq!(
                e.details,
                Some(json!({"n": "1e+999999", "ok": 2})),
                "{}",
                e.message
            ),
            _ => {}
        }
    }
    w.shutdown().await;
}

/// 4: a permanent database error on commit (a constraint of the user's own,
/// raising 22023) commits a terminal failure that names the cause, at once.
/// Before the fix it was retried for a whole TTL and ended LEASE_EXPIRED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_commit_error_is_a_terminal_failure_naming_it() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    tests::refuse_poisoned_successes(&t.db).await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let started = Instant::now();
    let run = t
        .submit(
            json!({"name": "p", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.echo",
                       "input": {"poison": true}}]}),
        )
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    let e = s.error.as_ref().expect("error");
    assert_eq!(e.code, "COMMIT_REJECTED", "{}", e.message);
    assert!(e.message.contains("poisoned output"), "{}", e.message);
    assert_eq!(s.attempt, 1);
    println!(
        "permanent commit error → COMMIT_REJECTED in {:?}",
        started.elapsed()
    );
    w.shutdown().await;
}

/// 5: the start write fails transiently (a restart, raised once as
/// admin_shutdown 57P01); the worker retries it and the result commits.
/// Before the fix the failure was logged and ignored, the completion found
/// the row `leased` and the result was discarded as "lease lost".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_of_the_start_write_loses_nothing() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE SEQUENCE public.start_faults;
         CREATE FUNCTION public.fail_first_start() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.state = 'leased' AND NEW.state = 'running' AND nextval('public.start_faults') = 1 THEN
                 RAISE EXCEPTION 'terminating connection due to administrator command' USING ERRCODE = '57P01';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail_first_start BEFORE UPDATE ON durable.step_runs FOR EACH ROW EXECUTE FUNCTION public.fail_first_start();",
    )
    .execute(t.db.pool())
    .await
    .expect("fault trigger");
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let run = t
        .submit(
            json!({"name": "p", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.echo",
                       "input": {"kept": 1}, "retry": {"max_attempts": 1}}]}),
        )
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{:?}", s.error);
    assert_eq!(s.output, Some(json!({"kept": 1})));
    assert_eq!(s.attempt, 1);
    let faults = t
        .scalar_i64("SELECT last_value FROM public.start_faults")
        .await;
    assert!(faults >= 2, "the start write was not retried ({faults})");
    w.shutdown().await;
}

/// 6: an executor that floods progress events while every event write is
/// slow (a trigger sleeps per row). Cancel and the attempt timeout must still
/// end it within the graces. Before the fix the loop awaited each event's
/// write inside its frame arm, biased to frames: the cancel never won.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chatty_executor_and_a_slow_database_cannot_starve_control() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.slow_events() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(0.05); RETURN NEW; END $$;
         CREATE TRIGGER slow_events BEFORE INSERT ON durable.step_events FOR EACH ROW EXECUTE FUNCTION public.slow_events();",
    )
    .execute(t.db.pool())
    .await
    .expect("slow trigger");
    let cfg = fast_config(vec![hostile("hostile", None, &[])]);
    let bound =
        Duration::from_millis(cfg.cancel_grace_ms + cfg.term_grace_ms) + Duration::from_secs(3);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    // cancel
    let run = t.submit(spec("hostile.chatty", json!({}))).await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = Instant::now();
    t.db.cancel(run, None).await.expect("cancel");
    let st = t.wait_terminal(run, LONG).await;
    let took = asked.elapsed();
    assert_eq!(step(&st, "s").state, "cancelled");
    assert!(took < bound, "cancel took {took:?} (bound {bound:?})");
    tests::assert_no_survivors(step(&st, "s").step_run_id, None, Duration::from_secs(5)).await;

    // attempt timeout
    let run = t
        .submit(spec("hostile.chatty", json!({"timeout_ms": 1500})))
        .await;
    let started = Instant::now();
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("ATTEMPT_TIMEOUT")
    );
    assert!(
        started.elapsed() < Duration::from_millis(1500) + bound,
        "{:?}",
        started.elapsed()
    );
    println!(
        "chatty: cancel confirmed in {took:?}, timeout ended in {:?}",
        started.elapsed()
    );
    w.shutdown().await;
}

/// Each write of a checkpoint (it rewrites its step's row) takes `secs`
/// more, holding the row meanwhile, as a large checkpoint's write does.
async fn slow_checkpoint_writes(t: &TestDb, secs: f64) {
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.slow_checkpoints() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep({secs}); RETURN NEW; END $$;
         CREATE TRIGGER slow_checkpoints BEFORE UPDATE OF checkpoint ON durable.step_runs
           FOR EACH ROW EXECUTE FUNCTION public.slow_checkpoints();"
    ))
    .execute(t.db.pool())
    .await
    .expect("slow checkpoint trigger");
}

/// A step whose executor sends 4 KiB checkpoints back to back for `ms`,
/// then succeeds: it must do so in its first attempt (no lease lost).
async fn flood_succeeds_in_one_attempt(t: &TestDb, ms: u64) -> supervisor::db::StepStatus {
    let run = t
        .submit(json!({"name": "flood", "steps": [
            {"name": "s", "executor_kind": "hostile", "kind": "hostile.checkpoint_flood",
             "input": {"ms": ms, "size": 4096}, "retry": {"max_attempts": 1}}]}))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s").clone();
    assert_eq!(
        (s.state.as_str(), s.attempt),
        ("succeeded", 1),
        "{:?}",
        s.error
    );
    s
}

/// An executor that sends checkpoints without pause keeps its lease (volume
/// audit: 7 MiB checkpoints back to back ended every attempt LEASE_LOST,
/// "the lease clock ran out", with the database answering all along). Each
/// checkpoint rewrites its step's row; a trigger here makes each such write
/// hold the row for 150 ms, as a large checkpoint does, so the heartbeat
/// (which waits 20 ms for a held row, then skips it) finds the row held at
/// nearly every renewal, for three lease TTLs. Before the fix the lease
/// clock ran out; now each checkpoint write renews the lease it proves alive
/// and the heartbeat reads how long that holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_checkpointing_without_pause_keeps_its_lease() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    slow_checkpoint_writes(&t, 0.15).await;
    let cfg = fast_config(vec![hostile("hostile", None, &[])]);
    let ttl = cfg.lease_ttl_ms;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let s = flood_succeeds_in_one_attempt(&t, 3 * ttl).await;
    let checkpoints: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM durable.step_events WHERE step_run_id = $1 AND checkpoint",
    )
    .bind(s.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("count");
    assert!(checkpoints > 0, "no checkpoint was stored");
    w.shutdown().await;
}

/// At the smallest lease margin the configuration allows (graces and two
/// heartbeats fill the TTL), checkpoints whose writes each take an eighth of
/// the TTL keep their lease too (re-check audit: 7 MiB checkpoints, TTL 4 s,
/// graces 1 s + 1 s, heartbeat 1 s, ended every attempt LEASE_LOST: a busy
/// answer moved the clock only to the last committed renewal, a write or two
/// and a heartbeat interval behind). The clock now also moves when a
/// checkpoint write is answered, to when it was handed + TTL: it dips to TTL
/// minus two writes' time before the next answer, so writes shorter than
/// half of (TTL − the graces) keep the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_checkpoints_keep_their_lease_at_the_smallest_margin() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    slow_checkpoint_writes(&t, 0.25).await;
    let mut cfg = fast_config(vec![hostile("hostile", None, &[])]);
    cfg.lease_ttl_ms = 2_000;
    cfg.heartbeat_interval_ms = 500;
    cfg.cancel_grace_ms = 500;
    cfg.term_grace_ms = 500;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    flood_succeeds_in_one_attempt(&t, 6000).await;
    w.shutdown().await;
}

/// A checkpoint read during a stop's grace is stored even when the writer's
/// queue is full: the next attempt resumes from the last one reported
/// (re-check audit: an attempt ended by its timeout reported 5,108
/// checkpoints, 4,674 were stored, and the retry resumed from that one; the
/// grace dropped progress that found no room, checkpoints included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_checkpoint_read_in_a_grace_is_stored() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    slow_checkpoint_writes(&t, 0.1).await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![hostile("hostile", None, &[])]),
    )
    .await;
    const COUNT: usize = 3000;
    let run = t
        .submit(json!({"name": "burst", "steps": [
            {"name": "s", "executor_kind": "hostile", "kind": "hostile.checkpoint_flood",
             "input": {"ms": 60000, "size": 4096, "count": COUNT}, "timeout_ms": 1500,
             "retry": {"max_attempts": 1}}]}))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("ATTEMPT_TIMEOUT"),
        "{s:?}"
    );
    let stored: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
            .bind(s.step_run_id)
            .fetch_one(t.db.pool())
            .await
            .expect("checkpoint");
    let head = stored
        .as_deref()
        .map(|c| String::from_utf8_lossy(&c[..8.min(c.len())]).into_owned());
    assert_eq!(head.as_deref(), Some(format!("{COUNT:08}").as_str()));
    w.shutdown().await;
}

/// The checkpoints an attempt has not had answered are bounded in bytes, not
/// only in number (volume audit: four executors sending 7 MiB checkpoints
/// back to back took the worker to 548 MB; the queue held up to 256 of them
/// per attempt). Each checkpoint write here takes 100 ms more, so the
/// executor outpaces the database; the worker (in this process) must make it
/// wait in its pipe instead of holding its frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_waiting_for_the_database_are_bounded_in_bytes() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    slow_checkpoint_writes(&t, 0.1).await;
    let rss_kib = || {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .unwrap_or(0)
    };
    // a lease long enough that 6 MiB writes cannot run its clock out
    let mut cfg = fast_config(vec![hostile("hostile", None, &[])]);
    cfg.lease_ttl_ms = 10_000;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let before = rss_kib();
    let run = t
        .submit(json!({"name": "flood", "steps": [
            {"name": "s", "executor_kind": "hostile", "kind": "hostile.checkpoint_flood",
             "input": {"ms": 4000, "size": 6 << 20}, "retry": {"max_attempts": 1}}]}))
        .await;
    let mut peak = before;
    let st = loop {
        peak = peak.max(rss_kib());
        let st = t.status(run).await;
        if st.state == "succeeded" || st.state == "failed" {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        step(&st, "s").state,
        "succeeded",
        "{:?}",
        step(&st, "s").error
    );
    let grew_mib = peak.saturating_sub(before) / 1024;
    println!(
        "checkpoint flood: RSS {} MiB before, peak {} MiB",
        before / 1024,
        peak / 1024
    );
    // at most 32 MiB of checkpoints queued, one of them copied to the
    // ledger, a frame being read: 73-103 MiB of growth measured; without the
    // bound and with every checkpoint's bytes carried along, 199-289 MiB
    assert!(grew_mib < 180, "the worker grew by {grew_mib} MiB");
    w.shutdown().await;
}

/// 7: a non-retryable error before ACCEPTED is a terminal failure (before
/// the fix: refused and respawned every second without end); retryable
/// refusals are counted and capped by max_refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_do_not_loop_forever() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("spawns");
    let mut cfg = fast_config(vec![hostile("hostile", Some(&log), &[])]);
    cfg.max_refusals = 3;
    cfg.executors[0].concurrency = 1;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let probe_spawns = spawns(&log);

    let run = t
        .submit(spec(
            "hostile.refuse_bad_input",
            json!({"retry": {"max_attempts": 5}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(s.error.as_ref().map(|e| e.code.as_str()), Some("BAD_INPUT"));
    assert_eq!(
        spawns(&log) - probe_spawns,
        1,
        "a non-retryable refusal was respawned"
    );

    let before = spawns(&log);
    let run = t
        .submit(spec(
            "hostile.refuse_retryable",
            json!({"retry": {"max_attempts": 5}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    let e = s.error.as_ref().expect("error");
    assert_eq!(e.code, "EXECUTOR_REFUSED");
    assert!(e.message.contains("refused 3 times"), "{}", e.message);
    assert_eq!(spawns(&log) - before, 3);
    assert_eq!(s.attempt, 0, "refusals are not attempts");
    w.shutdown().await;
}

/// 7: a protocol-version mismatch is caught at the probe, with a message
/// that names both versions, before the worker leases anything.
#[tokio::test]
async fn a_protocol_mismatch_is_caught_at_the_probe() {
    let t = TestDb::new().await;
    let cfg = fast_config(vec![hostile(
        "hostile",
        None,
        &[("HOSTILE_PROTOCOL_VERSION", "2")],
    )]);
    let err = Worker::start(t.connect(4).await, cfg)
        .await
        .err()
        .expect("refused at start");
    let msg = err.to_string();
    assert!(msg.contains("protocol version 2"), "{msg}");
}

/// 8: an executor's next_retry_delay of 2^64-1 ms is clamped to the policy's
/// max_interval_ms (before: chrono overflow, a panic in the worker), and a
/// panic inside an attempt fails that attempt with a code and frees its slot
/// (before: the slot leaked and the lease stayed renewed with no child).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executor_values_and_panics_cannot_take_the_worker_down() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![hostile("hostile", None, &[])]);
    cfg.executors[0].concurrency = 1;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;

    let run = t
        .submit(spec(
            "hostile.huge_retry_delay",
            json!({"retry": {"max_attempts": 2, "initial_interval_ms": 100, "max_interval_ms": 500}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(s.attempt, 2, "the retry came after max_interval_ms");

    supervisor::fault::panic_in_attempts_of_kind(Some("hostile.panic"));
    let panicked = t.submit(spec("hostile.panic", json!({}))).await;
    let st = t.wait_terminal(panicked, LONG).await;
    supervisor::fault::panic_in_attempts_of_kind(None);
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("SUPERVISOR_PANIC")
    );
    // concurrency 1: this runs only if the panicked attempt gave its slot back
    let after = t.submit(spec("hostile.echo", json!({}))).await;
    let st = t.wait_terminal(after, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded");
    w.shutdown().await;
}

/// 9: the worker's network to PostgreSQL is blackholed mid-step. Its lease
/// clock stops advancing, so it stops its child before the lease can have
/// expired; only then does another worker reclaim and run the step — never
/// two children of the same step at once. Before the fix the heartbeat had
/// no timeout and the child kept running while another worker ran the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_worker_stops_its_child_before_its_lease_can_expire() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let hole = Blackhole::start(&t.url).await;
    let via_proxy = hole.url(&t.url);
    let proxied = supervisor::db::Db::connect(&via_proxy, 10)
        .await
        .expect("connect via proxy");
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("cut-off".into());
    let ttl = Duration::from_millis(cfg.lease_ttl_ms);
    let interval = Duration::from_millis(cfg.heartbeat_interval_ms);
    let a = RunningWorker::start(proxied, cfg.clone()).await;
    let run = t
        .submit(json!({"name": "p", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.sleep",
                       "input": {"ms": 3000, "steps": 30}, "retry": {"initial_interval_ms": 100}}]}))
        .await;
    let sid = tests::only_step_id(&t, run).await;
    t.wait_run(run, LONG, |s| s.steps[0].state == "running")
        .await;
    let pid = tests::executor_pid(&t.db, sid).await.expect("pid");
    tokio::time::sleep(Duration::from_millis(300)).await;
    hole.cut();
    let cut = Instant::now();
    // the other worker, with a direct connection, can reclaim the step
    let mut cfg_b = cfg.clone();
    cfg_b.name = Some("rescuer".into());
    let b = RunningWorker::start(t.connect(10).await, cfg_b).await;
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(") Z ") {
            break;
        }
        assert!(
            cut.elapsed() < Duration::from_secs(10),
            "the cut-off worker's child kept running"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped = cut.elapsed();
    // the database's expiry is at least the last renewal + TTL, and the last
    // renewal was at most one interval before the cut
    assert!(
        stopped < ttl - interval,
        "the child was stopped {stopped:?} after the cut; the lease could have expired at {:?}",
        ttl - interval
    );
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{:?}", s.error);
    let hist = tests::step_transitions(&t.db, sid).await;
    let expired = hist
        .iter()
        .position(|h| {
            h.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("LEASE_EXPIRED"))
        })
        .expect("the step was reclaimed after its lease expired");
    assert!(hist[expired..]
        .iter()
        .all(|h| h.worker.as_deref() != Some("cut-off")));
    println!("cut off: child stopped {stopped:?} after the cut (TTL {ttl:?}); reclaimed and completed by the rescuer");
    hole.heal();
    b.shutdown().await;
    a.shutdown().await;
}

/// 9: the stop budget must fit in the lease, checked at start; and a vital
/// loop that dies makes the worker stop its children and fail, instead of
/// running on without renewed leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_refuses_an_unsafe_setup_and_fails_when_its_heartbeat_dies() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut bad = fast_config(vec![go_demo("go", &[], None)]);
    bad.cancel_grace_ms = 5_000;
    let err = Worker::start(t.connect(4).await, bad.clone())
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("lease_ttl_ms"), "{err}");
    assert!(bad.validate().is_err());
    let mut unwritable = fast_config(vec![go_demo("go", &[], None)]);
    unwritable.work_dir = Some(PathBuf::from("/proc"));
    let err = Worker::start(t.connect(4).await, unwritable)
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("work_dir"), "{err}");

    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    let name = format!("doomed-{}", Uuid::new_v4().simple());
    cfg.name = Some(name.clone());
    let worker = Worker::start(t.connect(10).await, cfg)
        .await
        .expect("start");
    let stop = CancellationToken::new();
    let task = tokio::spawn(worker.run(stop.clone()));
    let run = t
        .submit(
            json!({"name": "p", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.sleep",
                       "input": {"ms": 30000}}]}),
        )
        .await;
    let sid = tests::only_step_id(&t, run).await;
    t.wait_run(run, LONG, |s| s.steps[0].state == "running")
        .await;
    supervisor::fault::kill_heartbeat_of(&name);
    let res = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the worker exited")
        .expect("join");
    let err = res.expect_err("the worker failed");
    assert!(err.to_string().contains("heartbeat"), "{err}");
    tests::assert_no_survivors(sid, None, Duration::from_secs(5)).await;
}

/// 11: a routine redeploy (SIGTERM, drain timeout) does not burn attempts:
/// a `max_attempts = 1` step stopped by the drain goes back at once and the
/// next worker completes it. Before the fix it ended terminal_failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_step_keeps_its_attempts() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.drain_timeout_ms = 300;
    let w = RunningWorker::start(t.connect(10).await, cfg.clone()).await;
    let run = t
        .submit(
            json!({"name": "p", "steps": [{"name": "s", "executor_kind": "go", "kind": "demo.sleep",
                       "input": {"ms": 2000, "steps": 4}, "retry": {"max_attempts": 1}}]}),
        )
        .await;
    t.wait_run(run, LONG, |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    w.shutdown().await;
    let st = t.status(run).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "retryable_failed", "{:?}", s.error);
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("WORKER_SHUTDOWN")
    );
    let w2 = RunningWorker::start(t.connect(10).await, cfg).await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(
        step(&st, "s").state,
        "succeeded",
        "{:?}",
        step(&st, "s").error
    );
    w2.shutdown().await;
}

/// 10: a step receives only secrets its executor's config allows. Naming the
/// worker's own DATABASE_URL fails before spawn, non-retryably; an allowed
/// secret (from secrets_dir) reaches the executor, and whatever the executor
/// echoes of it — and any DSN or URL password — is redacted from everything
/// stored: event messages, error message and details.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_allowlisted_and_never_stored() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let value = "tok-abcdef123456";
    std::fs::write(dir.path().join("API_TOKEN"), format!("{value}\n")).expect("secret file");
    let log = dir.path().join("spawns");
    let mut e = hostile("hostile", Some(&log), &[]);
    e.secrets = vec!["API_TOKEN".into()];
    let mut cfg: WorkerConfig = fast_config(vec![e]);
    cfg.secrets_dir = Some(dir.path().to_owned());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let probes = spawns(&log);

    let run = t
        .submit(spec(
            "hostile.echo",
            json!({"secrets": ["DATABASE_URL"], "retry": {"max_attempts": 3}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("SECRET_NOT_ALLOWED")
    );
    assert_eq!(
        spawns(&log),
        probes,
        "the executor was started for a forbidden secret"
    );

    let run = t
        .submit(spec(
            "hostile.secret_echo",
            json!({"secrets": ["API_TOKEN"]}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.error.as_ref().map(|e| e.code.as_str()), Some("LEAK"));
    let stored: String = sqlx::query_scalar(
        "SELECT concat_ws(' ', s.error_message, s.error_details::text, s.output::text,
                          (SELECT string_agg(message, ' ') FROM durable.step_events e WHERE e.step_run_id = s.id))
           FROM durable.step_runs s WHERE s.id = $1",
    )
    .bind(s.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("stored text");
    assert!(stored.contains("REDACTED"), "{stored}");
    for leaked in [value, "hunter2x", "pw123456"] {
        assert!(!stored.contains(leaked), "{leaked} was stored: {stored}");
    }
    w.shutdown().await;
}

/// A secret an executor writes into a frame that is not protobuf never
/// reaches the log: the frame's evidence (its first bytes, escaped) showed a
/// non-ASCII value in full (`p\xc3\xa4ssw…`), since the redactor looked only
/// for the value as is, and the start of a value cut by the 32-byte window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_in_a_malformed_frame_is_redacted_from_its_evidence() {
    let _serial = tests::exclusive().await;
    tests::init_tracing();
    let t = TestDb::new().await;
    // 39 bytes: the frame's 32-byte evidence window cuts it
    let value = "pässwörd-Geheimnis-42-and-a-long-tail";
    let (_secrets, cfg) = tests::with_api_token(hostile("hostile", None, &[]), value);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(spec(
            "hostile.garbage_secret",
            json!({"secrets": ["API_TOKEN"]}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("PROTOCOL_MALFORMED_FRAME")
    );
    let lines = tests::logged(&[&s.step_run_id.to_string(), "protocol violation"]);
    assert!(!lines.is_empty(), "the violation was logged");
    let escaped = supervisor::wire::escape_bytes(value.as_bytes());
    for line in &lines {
        assert!(line.contains("[REDACTED:API_TOKEN]"), "{line}");
        // no 8 bytes of the value, as is or escaped, survive
        for text in [value.to_owned(), escaped.clone()] {
            for start in 0..text.len().saturating_sub(8) {
                if let Some(piece) = text.get(start..start + 8) {
                    assert!(!line.contains(piece), "{piece:?} of the secret in {line}");
                }
            }
        }
    }
}

/// A retry of a step can be leased by the same worker while the previous
/// attempt's task is still winding down (its failure is committed, its slot
/// not yet freed). The old attempt's cleanup used to drop the retry from the
/// renewal set (it was keyed by step, not by lease), so the retry lost its
/// lease mid-run and the step needed a third attempt (CI saw it in
/// `checkpoint_resume`). The fault holds attempt 1's slot for a moment after
/// its failure committed, which makes that window certain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_leased_while_the_last_attempt_winds_down_keeps_its_lease() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let kind = "demo.resume";
    supervisor::fault::delay_first_attempt_release_of_kind(Some((
        kind,
        Duration::from_millis(500),
    )));
    let w = RunningWorker::start(
        t.connect(6).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    // 20 items of 150 ms: a retry from item 2 on runs about 2.7 s, longer than
    // the 2 s lease it would have without renewals
    let run = t
        .submit(json!({"name": "retry-lease", "steps": [{
            "name": "s", "executor_kind": "go", "kind": kind,
            "input": {"items": 20, "ms": 150},
            "retry": {"max_attempts": 3, "initial_interval_ms": 0},
        }]}))
        .await;
    let sid = tests::only_step_id(&t, run).await;
    let t0 = Instant::now();
    loop {
        let next: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT checkpoint FROM durable.step_runs WHERE id = $1")
                .bind(sid)
                .fetch_one(t.db.pool())
                .await
                .expect("checkpoint");
        let next = next
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["next"].as_i64());
        if next.is_some_and(|n| n >= 2) {
            break;
        }
        assert!(t0.elapsed() < LONG, "no checkpoint stored");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = tests::executor_pid(&t.db, sid).await.expect("executor pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL attempt 1's executor");
    let st = t.wait_terminal(run, LONG).await;
    supervisor::fault::delay_first_attempt_release_of_kind(None);
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{st:?}");
    assert_eq!(
        s.attempt, 2,
        "the retry kept its lease: no third attempt ({s:?})"
    );
    let reasons: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT reason FROM durable.transitions WHERE step_run_id = $1 ORDER BY id",
    )
    .bind(sid)
    .fetch_all(t.db.pool())
    .await
    .expect("transitions");
    assert!(
        !reasons
            .iter()
            .flatten()
            .any(|r| r.contains("LEASE_EXPIRED")),
        "no attempt expired: {reasons:?}"
    );
    w.shutdown().await;
}

/// Processes whose hello offers no kinds (a broken build, a bad deploy) are
/// refusals; once the executor's processes offer its kinds again, its steps
/// run again, without a restart of the worker. Before the fix one such hello
/// replaced the executor's routes with its own (none), so nothing was ever
/// leased for it again: the step stayed pending for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_whose_processes_offered_no_kinds_is_leased_for_once_they_do() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let log = dir.path().join("spawns");
    let cfg = fast_config(vec![hostile(
        "hostile",
        Some(&log),
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    )]);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    // from now on every process's hello offers nothing
    std::fs::write(&kinds, "").expect("kinds");
    let first = t.submit(spec("hostile.echo", json!({}))).await;
    let started = spawns(&log);
    let until = Instant::now() + Duration::from_secs(20);
    while spawns(&log) < started + 2 {
        assert!(
            Instant::now() < until,
            "the executor was not tried again after a hello with no kinds"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting = t.status(first).await.steps[0].state.clone();
    assert!(
        waiting == "pending" || waiting == "retryable_failed",
        "refused, given back to the queue: {waiting}"
    );
    // the executor offers its kinds again
    std::fs::remove_file(&kinds).expect("heal");
    let st = t.wait_terminal(first, Duration::from_secs(30)).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let st = t
        .wait_terminal(
            t.submit(spec("hostile.echo", json!({}))).await,
            Duration::from_secs(30),
        )
        .await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    w.shutdown().await;
}

/// An executor whose probes offer nothing this worker leases is probed
/// again after a pause that doubles, as one that cannot start: the pause
/// stayed at refusal_delay_ms (a process started and a WARN every second,
/// for ever), because the probe's start reset the breaker. And a config whose
/// kinds match none the executor offers is refused at start (exit 2 through
/// the CLI), naming both lists: it ran, leasing nothing, silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_offering_nothing_is_probed_less_and_less_often() {
    tests::init_tracing();
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let mut e = hostile(
        "offers-nothing",
        None,
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    );
    let mut cfg = fast_config(vec![e.clone()]);
    cfg.refusal_delay_ms = 50;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    std::fs::write(&kinds, "").expect("kinds");
    // a process whose hello offers nothing: the routes are probed again
    let _run = t.submit(spec("hostile.echo", json!({}))).await;
    let pauses = || -> Vec<u64> {
        tests::logged(&["offers-nothing", "offers no kind this worker leases"])
            .iter()
            .filter_map(|l| {
                let at = l.find("retry_in_ms=")? + "retry_in_ms=".len();
                l[at..]
                    .split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .collect()
    };
    let until = Instant::now() + Duration::from_secs(20);
    while pauses().len() < 4 {
        assert!(Instant::now() < until, "probes: {:?}", pauses());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.shutdown().await;
    let p = pauses();
    assert!(
        p.windows(2).take(3).all(|w| w[1] > w[0]),
        "the pause grows: {p:?}"
    );

    // kinds that match nothing the executor offers: refused at start
    std::fs::remove_file(&kinds).expect("heal");
    e.kinds = Some(vec!["hostile.nope".into()]);
    let err = supervisor::worker::Worker::start(t.connect(10).await, fast_config(vec![e]))
        .await
        .err()
        .expect("refused at start");
    let msg = err.to_string();
    assert!(
        msg.contains("kinds = [\"hostile.nope\"] matches none of the kinds it offers")
            && msg.contains("hostile.echo"),
        "{msg}"
    );
}

/// A transient database error while an attempt reads its input artifacts
/// (here: an operator's lock on the table, longer than the 10 s lock
/// timeout) is tried again: it was a refusal at once (INPUT_UNAVAILABLE),
/// and five of them, a minute of such a lock, failed the run
/// EXECUTOR_REFUSED though no executor was ever asked (database-failure
/// audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_artifacts_table_delays_the_input_read_instead_of_refusing() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let mut lock = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.artifacts IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock");
    let run = t
        .submit(json!({"name": "locked-inputs", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1}},
            {"name": "b", "executor_kind": "go", "kind": "demo.echo", "input": {"y": 2},
             "depends_on": ["a"]}]}))
        .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    lock.rollback().await.expect("unlock");
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    let reasons: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT t.reason FROM durable.transitions t JOIN durable.step_runs s ON s.id = t.step_run_id
          WHERE s.run_id = $1 AND s.name = 'b' ORDER BY t.id",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    assert!(
        !reasons
            .iter()
            .flatten()
            .any(|r| r.contains("INPUT_UNAVAILABLE")),
        "the lock was a refusal: {reasons:?}"
    );
}

/// An outcome whose attempt gave up committing it (its lease clock ran out
/// while the ledger's batch waited for a connection) is not written when
/// the connection comes: the attempt logged it as not recorded and counted
/// it so, and the step is reclaimed (`LEASE_EXPIRED`). Before, the batch
/// shaped before the writer gave up was written once the connection came:
/// an outcome landing seconds after its attempt said "the step will be
/// reclaimed" (redeploy audit: a PostgreSQL restart of 15 s; here the
/// worker's pool is held instead). The outcome is a timeout, which goes
/// through the retrying commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_given_up_while_its_batch_waited_for_a_connection_is_not_written() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("gives-up".into());
    cfg.lease_ttl_ms = 4_000;
    cfg.executors[0].concurrency = 1;
    let db = t.connect(4).await;
    let w = RunningWorker::start(db.clone(), cfg).await;
    let run = t
        .submit(json!({"name": "late", "steps": [{
            "name": "s", "executor_kind": "go", "kind": "demo.sleep",
            "input": {"ms": 30_000, "steps": 1},
            "timeout_ms": 2_000, "retry": {"max_attempts": 1}}]}))
        .await;
    let until = Instant::now() + LONG;
    loop {
        let state: String =
            sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE run_id = $1")
                .bind(run)
                .fetch_one(t.db.pool())
                .await
                .expect("the step");
        if state == "running" {
            break;
        }
        assert!(Instant::now() < until, "never started: {state}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // from here the lease clock runs out 4 s after the last renewal
    supervisor::fault::fail_renewals_of("gives-up", true);
    // the ledger gives its connection back once idle (1 s after the start
    // it wrote); then every connection of the worker's pool is held
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let mut held = Vec::new();
    while let Ok(Ok(c)) =
        tokio::time::timeout(Duration::from_millis(300), db.pool().acquire()).await
    {
        held.push(c);
    }
    assert!(!held.is_empty(), "no connection of the pool could be held");
    // the attempt times out at ~2 s and its commit waits for a connection;
    // the clock runs out at ~4 s and the attempt gives up; the connections
    // come back at ~6 s, within the batch's bound
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    drop(held);
    supervisor::fault::fail_renewals_of("gives-up", false);
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    let reasons: Vec<(i32, String, Option<String>)> = sqlx::query_as(
        "SELECT attempt, to_state, reason FROM durable.transitions
          WHERE run_id = $1 AND step_run_id IS NOT NULL ORDER BY id",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    assert_eq!(st.state, "failed", "{st:?} {reasons:?}");
    let last = reasons.last().expect("a history");
    assert_eq!(last.1, "terminal_failed", "{reasons:?}");
    assert!(
        last.2
            .as_deref()
            .is_some_and(|r| r.starts_with("LEASE_EXPIRED")),
        "the timeout given up on landed: {reasons:?}"
    );
}

/// A worker whose renewals fail (its heartbeat's own connection cannot be
/// opened: max_connections reached) leases nothing until one succeeds. It
/// went on leasing, and each step it leased lost its lease within seconds,
/// attempt after attempt, until its run failed LEASE_EXPIRED while the
/// database was up (database-failure audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_renewals_fail_leases_nothing_until_one_succeeds() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("renewals-fail".into());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    supervisor::fault::fail_renewals_of("renewals-fail", true);
    // a failed renewal is noted within a heartbeat interval
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let run = t
        .submit(tests::one_step("waits", "go", "demo.echo", json!({"x": 1})))
        .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (state, attempt): (String, i32) =
        sqlx::query_as("SELECT state, attempt FROM durable.step_runs WHERE run_id = $1")
            .bind(run)
            .fetch_one(t.db.pool())
            .await
            .expect("the step");
    supervisor::fault::fail_renewals_of("renewals-fail", false);
    assert_eq!(
        (state.as_str(), attempt),
        ("pending", 0),
        "leased while no lease could be renewed"
    );
    // renewals succeed again: it is leased and runs, attempt 1
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
    assert_eq!(step(&st, "s").attempt, 1, "{st:?}");
}

/// A step's input reaches its executor with its numbers as they were
/// written, and the executor's output is stored and shown the same way:
/// integers beyond 64 bits and decimals with more digits than a double holds
/// are not rounded, whether the spec came through `supervisor submit` or SQL.
/// Before, the CLI and the worker read JSON numbers as 64-bit floats, so
/// 123456789012345678901234567890 arrived as 123456789012345680000000000000
/// (and `max_attempts: 3.0000000000000001` passed the CLI as 3 while SQL
/// refused it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_pass_through_unchanged() {
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![hostile("hostile", None, &[])]),
    )
    .await;
    let input = r#"{"big": 123456789012345678901234567890, "dec": 12345678901234567.890123456789, "small": 1e-30}"#;
    let spec = format!(
        r#"{{"name": "numbers", "steps": [{{"name": "s", "executor_kind": "hostile", "kind": "hostile.echo", "input": {input}}}]}}"#
    );
    let out = tests::submit_stdin(&t.url, &spec);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run: Uuid = serde_json::from_slice::<Value>(&out.stdout).expect("json")["run_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("run id");
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let (stored_in, stored_out): (String, String) =
        sqlx::query_as("SELECT input::text, output::text FROM durable.step_runs WHERE run_id = $1")
            .bind(run)
            .fetch_one(t.db.pool())
            .await
            .expect("row");
    for text in [&stored_in, &stored_out] {
        assert!(text.contains("123456789012345678901234567890"), "{text}");
        assert!(text.contains("12345678901234567.890123456789"), "{text}");
    }
    // and `status --json` shows the output as stored
    let shown = std::process::Command::new(tests::supervisor_bin())
        .args(["status", &run.to_string(), "--json"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("status");
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("123456789012345678901234567890"), "{shown}");
    assert!(shown.contains("12345678901234567.890123456789"), "{shown}");
    w.shutdown().await;
}

/// An integral field written with more digits than a double holds is the
/// same spec error through the CLI as through SQL.
#[tokio::test]
async fn a_near_integer_is_refused_alike_by_the_cli_and_sql() {
    let t = TestDb::new().await;
    let spec = r#"{"name": "n", "steps": [{"name": "s", "executor_kind": "go", "kind": "k", "retry": {"max_attempts": 3.0000000000000001}}]}"#;
    let out = tests::submit_stdin(&t.url, spec);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("steps[0].retry.max_attempts"), "{stderr}");
    let sql: Result<Uuid, _> = sqlx::query_scalar("SELECT durable.submit_run($1::text::jsonb)")
        .bind(spec)
        .fetch_one(t.db.pool())
        .await;
    let err = sql.expect_err("SQL refuses it too").to_string();
    assert!(err.contains("steps[0].retry.max_attempts"), "{err}");
}

/// An executor that never reads its stdin does not stretch its step's
/// timeout: the job frame (larger than a pipe holds) is given up on when the
/// timeout passes, and the attempt ends within timeout + cancel grace + term
/// grace. Before the fix the job's write waited its own 5 s first, and only
/// then did the attempt's clocks start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_does_not_read_its_job_does_not_stretch_the_timeout() {
    let t = TestDb::new().await;
    let cfg = fast_config(vec![hostile("hostile", None, &[("HOSTILE_DEAF", "1")])]);
    let (timeout_ms, graces_ms) = (1_000, cfg.cancel_grace_ms + cfg.term_grace_ms);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(spec(
            "hostile.echo",
            json!({"timeout_ms": timeout_ms, "input": {"pad": "x".repeat(600_000)}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("ATTEMPT_TIMEOUT"),
        "{s:?}"
    );
    let took_ms: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM finished_at - leased_at)::float8 * 1000
           FROM durable.step_runs WHERE run_id = $1",
    )
    .bind(run)
    .fetch_one(t.db.pool())
    .await
    .expect("times");
    // timeout + both graces, with 2.5 s for spawning and scheduling; the
    // stall alone was 5 s before
    let bound = (timeout_ms + graces_ms + 2_500) as f64;
    assert!(
        took_ms < bound,
        "the attempt took {took_ms} ms (bound {bound})"
    );
    w.shutdown().await;
}

/// A child that leaves its attempt's process group and cgroup (setsid, then
/// into the cgroup v2 root, as an executor running as root may) survives its
/// attempt: neither the group's nor the cgroup's kill reaches it. It does not
/// survive the worker: the worker's exit kills the processes it adopted as
/// their subreaper. Before the fix it lived on until the next worker's
/// start-up sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_left_its_cgroup_does_not_outlive_the_worker() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("escaped");
    let cfg = fast_config(vec![hostile(
        "hostile",
        None,
        &[("HOSTILE_ESCAPE_LOG", log.to_str().expect("utf-8 path"))],
    )]);
    let mut w = tests::WorkerProcess::spawn(&t.url, &cfg);
    let st = t
        .wait_terminal(t.submit(spec("hostile.escape", json!({}))).await, LONG)
        .await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let pid: i32 = std::fs::read_to_string(&log)
        .expect("the escaped child's pid")
        .trim()
        .parse()
        .expect("a pid");
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
    };
    if !alive(pid) {
        // this host did not let it leave its cgroup (not root, no cgroup v2
        // root to write to): the attempt's kill took it, nothing to check
        println!("the child could not leave its cgroup here; skipped");
        w.signal(nix::sys::signal::Signal::SIGTERM);
        w.wait(Duration::from_secs(30)).await;
        return;
    }
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        w.wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        w.stderr()
    );
    let until = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        if Instant::now() > until {
            // ours: do not leave it running
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("the escaped child {pid} outlived the worker");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A run row another transaction holds (an operator's open session, a long
/// cancel of a large run) delays that run's writes alone: the worker's other
/// runs go on meanwhile, and the held run's outcome lands, once, when the row
/// is free. Before, every batch of the worker that held one of its writes
/// waited for the row (the pool's 10 s lock timeout, then again on retry):
/// 20 echo runs took 17.6 s, not 0.35 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_row_held_by_another_transaction_delays_that_run_alone() {
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let held = t
        .submit(
            json!({"name": "held", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.sleep", "input": {"ms": 1200, "steps": 1}}]}),
        )
        .await;
    t.wait_run(held, LONG, |s| step(s, "s").state == "running")
        .await;
    let holder = t.hold_run(held).await;
    // the step's executor ends meanwhile, and its success waits for the row
    let until = Instant::now() + LONG;
    while t
        .scalar_i64(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
        == 0
    {
        assert!(Instant::now() < until, "nothing waited for the held row");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let began = Instant::now();
    let mut others = Vec::new();
    for i in 0..5 {
        others.push(
            t.submit(json!({"name": format!("other-{i}"), "steps": [{"name": "s",
                "executor_kind": "go", "kind": "demo.echo", "input": {"i": i}}]}))
                .await,
        );
    }
    for (i, run) in others.iter().enumerate() {
        let st = t.wait_terminal(*run, LONG).await;
        let s = step(&st, "s");
        assert_eq!(s.state, "succeeded", "{:?}", s.error);
        assert_eq!(s.output, Some(json!({"i": i})));
    }
    let took = began.elapsed();
    // the bound is half the pool's lock timeout (10 s), which every batch
    // that held the success of the held run waited before the fix
    assert!(
        took < Duration::from_secs(5),
        "the other runs waited for the held row: {took:?}"
    );
    let st = t.status(held).await;
    assert_eq!(
        step(&st, "s").state,
        "running",
        "the held run was written while its row was held"
    );

    holder.rollback().await.expect("let the row go");
    let st = t.wait_terminal(held, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{:?}", s.error);
    assert_eq!(s.attempt, 1, "the held run's success was not lost");
    let successes = t
        .scalar_i64(&format!(
            "SELECT count(*) FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id
              WHERE s.run_id = '{held}' AND e.kind = 'succeeded'"
        ))
        .await;
    assert_eq!(successes, 1, "one success event");
    w.shutdown().await;
}

/// A run row held past 15 s is said in the worker's span (its name), and so
/// is its release (outside audit 79 #5: the warning carried no worker, and
/// nothing said when the row was free again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_held_run_row_and_its_release_are_said_in_the_workers_span() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("row-holder-watch".into());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let held = t
        .submit(
            json!({"name": "held", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.sleep", "input": {"ms": 300, "steps": 1}}]}),
        )
        .await;
    t.wait_run(held, LONG, |s| step(s, "s").state == "running")
        .await;
    let holder = t.hold_run(held).await;
    let run = held.to_string();
    let until = Instant::now() + Duration::from_secs(30);
    while tests::logged(&[
        "row-holder-watch",
        &run,
        "still held by another transaction",
    ])
    .is_empty()
    {
        assert!(
            Instant::now() < until,
            "the held row was never said, in the worker's span"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    holder.rollback().await.expect("let the row go");
    let st = t.wait_terminal(held, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded");
    let until = Instant::now() + Duration::from_secs(10);
    while tests::logged(&["row-holder-watch", &run, "row is free again"]).is_empty() {
        assert!(Instant::now() < until, "the release was never said");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.shutdown().await;
}

/// An executor that closes its stdout without a terminal and exits 0 on its
/// own is a crash (no terminal can come), and its evidence is its own exit:
/// the leader gets the cancel grace to exit before its group is signalled.
/// Before, the group was signalled at once, and the evidence said "killed by
/// SIGTERM" for a process that was about to exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_closes_stdout_and_exits_is_a_crash_with_its_own_exit_status() {
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![hostile("hostile", None, &[])]),
    )
    .await;
    let run = t.submit(spec("hostile.close_stdout", json!({}))).await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{s:?}");
    let e = s.error.as_ref().expect("error");
    assert_eq!(e.code, "EXECUTOR_CRASHED", "{}", e.message);
    let evidence = format!("{} {:?}", e.message, e.details);
    assert!(
        evidence.contains("exited with code 0") && !evidence.contains("SIGTERM"),
        "{evidence}"
    );
    w.shutdown().await;
}

/// A worker whose hostile executor starts in `start_secs` from now on (its
/// probe was quick), and a step of it submitted with a deadline 1 s away:
/// the worker, the run, the deadline and the executor's job log.
async fn slow_start_due_in_1_s(
    t: &TestDb,
    dir: &std::path::Path,
    start_secs: u32,
) -> (RunningWorker, Uuid, chrono::DateTime<chrono::Utc>, PathBuf) {
    let slow = dir.join("slow");
    let jobs = dir.join("jobs");
    let e = tests::wrap_in_shell(
        hostile(
            "hostile",
            None,
            &[("HOSTILE_JOB_LOG", &jobs.to_string_lossy())],
        ),
        &format!(
            "[ -f '{}' ] && sleep {start_secs}; exec \"$0\" \"$@\"",
            slow.display()
        ),
    );
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;
    std::fs::write(&slow, b"").expect("slow");
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(1_000);
    let run = t
        .submit(spec(
            "hostile.echo",
            json!({"deadline": deadline.to_rfc3339(), "retry": {"max_attempts": 3}}),
        ))
        .await;
    (w, run, deadline, jobs)
}

/// A step whose deadline passes while its executor starts (or its inputs are
/// fetched) ends DEADLINE_EXCEEDED with no job sent (retry audit): the
/// deadline was checked only before the spawn, so the job went out anyway,
/// its handler ran past the deadline, and its result was thrown away, or
/// even kept when it raced the deadline's timer. Here the executor takes
/// 2 s to start and the deadline is 1 s away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_job_is_sent_once_the_deadline_passed_during_the_executor_start() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (w, run, _, jobs) = slow_start_due_in_1_s(&t, dir.path(), 2).await;
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{:?}", s.error);
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("DEADLINE_EXCEEDED")
    );
    let received = std::fs::read_to_string(&jobs).unwrap_or_default();
    assert!(
        received.is_empty(),
        "the executor received a job after the deadline: {received}"
    );
}

/// The deadline ends an executor's start as a cancel does (time audit): it
/// was checked only once the hello came, so a start 8 s slow overshot a
/// deadline 1 s away by 7 s. Here the start would take 6 s (within the
/// handshake timeout): the step must end at its deadline, on the database's
/// clock well before the hello could have come, with nothing of the
/// starting executor left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_ends_a_start_that_would_outlast_it() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (w, run, deadline, jobs) = slow_start_due_in_1_s(&t, dir.path(), 6).await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("DEADLINE_EXCEEDED"),
        "{:?}",
        s.error
    );
    // the ending, on the database's clock, against the deadline: the hello
    // would have come 6 s after the lease
    let (late_ms, leased_to_end_ms): (f64, f64) = sqlx::query_as(
        "SELECT (extract(epoch FROM (s.finished_at - $2)) * 1000)::float8,
                (extract(epoch FROM (s.finished_at - s.leased_at)) * 1000)::float8
           FROM durable.step_runs s WHERE s.id = $1",
    )
    .bind(s.step_run_id)
    .bind(deadline)
    .fetch_one(t.db.pool())
    .await
    .expect("times");
    assert!(
        late_ms < 4_000.0 && leased_to_end_ms < 5_500.0,
        "the step ended {late_ms} ms after its deadline, {leased_to_end_ms} ms after its lease: the start was waited for"
    );
    // the starting process (the shell sleeping before the executor) is gone
    tests::assert_no_survivors(s.step_run_id, None, Duration::from_secs(5)).await;
    w.shutdown().await;
    let received = std::fs::read_to_string(&jobs).unwrap_or_default();
    assert!(
        received.is_empty(),
        "the executor received a job after the deadline: {received}"
    );
}

/// A step whose deadline passed before any attempt of it is ended by the
/// deadline pass at attempt 0 (README, Deadlines: "a step that never ran
/// ends at attempt 0"), though a worker that can run it is idle (time
/// audit): the lease took it first, counted attempt 1 and failed it
/// "before attempt 1 started", no job ever sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_overdue_before_its_first_attempt_ends_at_attempt_0() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let jobs = dir.path().join("jobs");
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![hostile(
            "hostile",
            None,
            &[("HOSTILE_JOB_LOG", &jobs.to_string_lossy())],
        )]),
    )
    .await;
    let run = t
        .submit(spec(
            "hostile.echo",
            json!({"deadline": "2020-01-01T00:00:00Z", "retry": {"max_attempts": 3}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(
        (
            s.state.as_str(),
            s.error.as_ref().map(|e| e.code.as_str()),
            s.attempt
        ),
        ("terminal_failed", Some("DEADLINE_EXCEEDED"), 0),
        "{:?}",
        s.error
    );
    let counted: Vec<i32> = tests::step_transitions(&t.db, s.step_run_id)
        .await
        .iter()
        .filter_map(|h| h.attempt)
        .filter(|a| *a > 0)
        .collect();
    assert!(counted.is_empty(), "no hop counted an attempt: {counted:?}");
    let received = std::fs::read_to_string(&jobs).unwrap_or_default();
    assert!(received.is_empty(), "a job was sent: {received}");
}

/// A reclaimed lease's retry is leased when it comes due, not at the next
/// poll of a worker that can run it (time audit: after a worker died, its
/// step's "retry in 429 ms" was leased 10 s later, at the poll). Here the
/// worker that can run the step never reclaims and polls every 30 s; a
/// second worker, which cannot run it, reclaims the dead worker's lease and
/// announces the retry when it comes due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaimed_steps_retry_is_leased_when_it_comes_due() {
    let t = TestDb::new().await;
    let run = t
        .submit(spec(
            "hostile.echo",
            json!({"retry": {"max_attempts": 3, "initial_interval_ms": 300}}),
        ))
        .await;
    // a worker that leased the step and died at once
    let ghost = Uuid::new_v4();
    t.db.register_worker(ghost, "ghost", "test", &json!([]))
        .await
        .expect("register");
    let route = supervisor::db::Route {
        executor_kind: "hostile".into(),
        kind: "hostile.echo".into(),
        labels: Default::default(),
    };
    let leased =
        t.db.lease(ghost, "ghost", &[route], 1, Duration::from_millis(300))
            .await
            .expect("lease");
    assert_eq!(leased.len(), 1, "the ghost leased the step");
    let runner = RunningWorker::start(
        t.connect(10).await,
        WorkerConfig {
            poll_interval_ms: 30_000,
            reclaim_interval_ms: 3_600_000,
            ..fast_config(vec![hostile("hostile", None, &[])])
        },
    )
    .await;
    let reclaimer = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let st = t.wait_terminal(run, LONG).await;
    runner.shutdown().await;
    reclaimer.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(
        (s.state.as_str(), s.attempt),
        ("succeeded", 2),
        "{:?}",
        s.error
    );
    // from the reclaim to the next lease, on the database's clock
    let gap_ms: f64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM
                   (SELECT at FROM durable.transitions WHERE step_run_id = $1 AND to_state = 'leased'
                     ORDER BY id DESC LIMIT 1)
                 - (SELECT at FROM durable.transitions WHERE step_run_id = $1 AND reason LIKE 'LEASE_EXPIRED%'))
                 * 1000)::float8",
    )
    .bind(s.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("the gap");
    assert!(
        gap_ms < 10_000.0,
        "the retry (due in ~300 ms) was leased {gap_ms} ms after the reclaim: it waited for a poll"
    );
}

/// A worker whose lease call timed out, but ran on the server all the same
/// (a server stalled past the call's bound: DB fault audit), gives back
/// uncounted the steps it never received before it leases again: they ran
/// at attempt 1. Before, they sat leased to it until their lease expired
/// and the reclaim counted the attempt: with `max_attempts` 1 the step
/// failed `LEASE_EXPIRED: attempts exhausted (1/1)`, never having run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_of_a_lease_whose_answer_was_lost_run_uncounted() {
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("lost-lease-answer".into());
    supervisor::fault::lose_next_lease_answer_of("lost-lease-answer");
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "lost", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1},
             "retry": {"max_attempts": 1}}]}))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    w.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(
        (s.state.as_str(), s.attempt),
        ("succeeded", 1),
        "{:?}",
        s.error
    );
    let reasons: Vec<Option<String>> = tests::step_transitions(&t.db, s.step_run_id)
        .await
        .into_iter()
        .map(|h| h.reason)
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.as_deref() == Some("LEASE_NOT_RECEIVED")),
        "the lost lease was given back: {reasons:?}"
    );
}

/// Waits (20 s at most) until `status` says that no live worker offers a
/// step of `run`: the executor's routes narrowed to a probe's hello.
async fn until_no_live_worker_offers(t: &TestDb, run: Uuid) {
    let until = Instant::now() + Duration::from_secs(20);
    while t
        .db
        .unroutable_steps(run)
        .await
        .expect("unroutable")
        .is_empty()
    {
        assert!(
            Instant::now() < until,
            "the routes never narrowed: status never said that no live worker offers the dropped kind"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An executor upgrade that drops a kind, then a rollback that brings it
/// back (routing and redeploy audits): the dropped kind's step is refused
/// and the routes narrow to what a probe offers, and `status` says that no
/// live worker offers the step; once a new process's hello offers the kind
/// again the routes widen and the step runs, without a worker restart.
/// Before, narrowed routes never widened (the step waited until the worker
/// restarted), and the worker's registered capabilities kept the kind, so
/// `status` gave no reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_narrowed_by_an_upgrade_widen_again_after_a_rollback() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let log = dir.path().join("spawns");
    let cfg = fast_config(vec![hostile(
        "hostile",
        Some(&log),
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    )]);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    // the upgrade: its processes offer only hostile.sleep
    std::fs::write(&kinds, "hostile.sleep").expect("kinds");
    let echo = t
        .submit(spec("hostile.echo", json!({"retry": {"max_attempts": 3}})))
        .await;
    until_no_live_worker_offers(&t, echo).await;
    // the rollback: a new process's hello offers every kind again
    std::fs::remove_file(&kinds).expect("rollback");
    let sleep = t
        .submit(spec("hostile.sleep", json!({"input": {"ms": 10}})))
        .await;
    let st = t.wait_terminal(sleep, Duration::from_secs(30)).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let st = t.wait_terminal(echo, Duration::from_secs(30)).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    assert!(t
        .db
        .unroutable_steps(echo)
        .await
        .expect("unroutable")
        .is_empty());
    w.shutdown().await;
}

/// Narrowed routes widen again after a rollback with no step of a kind
/// still offered to start a new process (re-check audit: they widened only
/// when a new process said more, and none was started unless such a step
/// came, so the dropped kind's steps waited until the worker restarted):
/// a narrowed executor is probed again now and then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narrowed_routes_are_probed_again_without_other_work() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let cfg = fast_config(vec![hostile(
        "hostile",
        None,
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    )]);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    std::fs::write(&kinds, "hostile.sleep").expect("kinds");
    let echo = t
        .submit(spec("hostile.echo", json!({"retry": {"max_attempts": 3}})))
        .await;
    until_no_live_worker_offers(&t, echo).await;
    // the rollback, and nothing else submitted
    std::fs::remove_file(&kinds).expect("rollback");
    let st = t.wait_terminal(echo, Duration::from_secs(30)).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    w.shutdown().await;
}

/// An idle process of a persistent executor whose hello is older than the
/// executor's routes is retired, not handed a step its hello does not offer
/// (audit 86): the probe process kept idle while the routes were narrowed
/// (its hello offered only `hostile.sleep`) took the `hostile.echo` step
/// once a later probe widened the routes again, and refused it: a second
/// EXECUTOR_REFUSED, counted toward `max_refusals`, where a new process ran
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_process_older_than_the_routes_is_not_handed_a_step_it_does_not_offer() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let mut e = hostile(
        "hostile",
        None,
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    );
    // one job per process (HOSTILE_JOBS' default): the start's probe
    // process, which offers every kind, serves the first step and retires
    e.persistent = true;
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;
    let first = t
        .submit(spec("hostile.sleep", json!({"input": {"ms": 10}})))
        .await;
    let st = t.wait_terminal(first, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    // the upgrade: new processes offer only hostile.sleep; the echo step's
    // process refuses it, the routes narrow to a probe's, and that probe's
    // process stays idle in the pool
    std::fs::write(&kinds, "hostile.sleep").expect("kinds");
    let echo = t
        .submit(spec("hostile.echo", json!({"retry": {"max_attempts": 3}})))
        .await;
    until_no_live_worker_offers(&t, echo).await;
    // the rollback: the next probe widens the routes, and the step runs on
    // a process whose hello offers it
    std::fs::remove_file(&kinds).expect("rollback");
    let st = t.wait_terminal(echo, Duration::from_secs(30)).await;
    w.shutdown().await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{st:?}");
    let refusals = t
        .scalar_i64(&format!(
            "SELECT refusals::int8 FROM durable.step_runs WHERE id = '{}'",
            s.step_run_id
        ))
        .await;
    assert_eq!(
        refusals, 1,
        "refused by the upgraded process alone, not again by an idle one older than the routes"
    );
}

/// Kinds added to a persistent executor's program are leased once a warm
/// process started after the change says them in its hello (audit 89: the
/// warm pool's replacements never widened the routes, only a job's own new
/// process did, and with a warm process always idle none was started: the
/// new kinds waited for a worker restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_a_warm_replacement_offers_are_leased_without_a_restart() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kinds = dir.path().join("kinds");
    let log = dir.path().join("spawns");
    std::fs::write(&kinds, "hostile.sleep").expect("kinds");
    let mut e = hostile(
        "hostile",
        Some(&log),
        &[("HOSTILE_KINDS_FILE", kinds.to_str().expect("utf-8 path"))],
    );
    // one job per process (HOSTILE_JOBS' default), one kept warm
    e.persistent = true;
    e.warm_processes = 1;
    let w = RunningWorker::start(t.connect(10).await, fast_config(vec![e])).await;
    let sleep = || t.submit(spec("hostile.sleep", json!({"input": {"ms": 10}})));
    // the first warm process serves a step and retires; its replacement
    // (the third process, after the worker's probe) says the old hello
    let st = t.wait_terminal(sleep().await, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let until = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .count()
        < 3
    {
        assert!(Instant::now() < until, "no replacement was started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // (its hello read the kinds file)
    tokio::time::sleep(Duration::from_millis(700)).await;
    // the release: processes started from now on offer every kind
    std::fs::remove_file(&kinds).expect("release");
    // served by that replacement, which retires: the keeper's next one
    // says the new hello
    let st = t.wait_terminal(sleep().await, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let echo = t.submit(spec("hostile.echo", json!({}))).await;
    let st = t.wait_terminal(echo, Duration::from_secs(30)).await;
    w.shutdown().await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
}

/// A secret that straddles a cut is not logged in part (observability
/// audit): a stderr line is cut at 1024 bytes and a crashed executor's tail
/// to its last `stderr_tail_bytes`, and each was cut before the redactor
/// read it, so the first (or last) bytes of a value that crossed the cut
/// were logged as they are. Now the cut is marked (`…`) first, and the
/// redactor replaces the part of a value it finds against the mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_cut_by_a_stderr_limit_is_not_logged_in_part() {
    let _serial = tests::exclusive().await;
    tests::init_tracing();
    let t = TestDb::new().await;
    let value = "Qv7x9Lm2Pw4Kt8Zr";
    let (_secrets, mut cfg) = tests::with_api_token(hostile("hostile", None, &[]), value);
    cfg.stderr_tail_bytes = 64;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(spec(
            "hostile.stderr_cut_secret",
            json!({"secrets": ["API_TOKEN"], "input": {"tail": 64}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    let id = s.step_run_id.to_string();
    // the stderr line and the crash's tail are logged in the attempt's span
    let until = Instant::now() + Duration::from_secs(10);
    while tests::logged(&[&id, "without a terminal"]).is_empty()
        || tests::logged(&[&id, "AAAA"]).is_empty()
    {
        assert!(Instant::now() < until, "the lines were not logged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.shutdown().await;
    let lines: Vec<String> = tests::logged(&[&id]);
    let cut = lines.iter().find(|l| l.contains("AAAA")).expect("cut line");
    assert!(cut.contains("[REDACTED:API_TOKEN]…"), "{cut}");
    let crash = lines
        .iter()
        .find(|l| l.contains("without a terminal"))
        .expect("crash line");
    assert!(crash.contains("…[REDACTED:API_TOKEN]YYYY"), "{crash}");
    for line in &lines {
        for start in 0..=value.len() - 4 {
            let piece = &value[start..start + 4];
            assert!(!line.contains(piece), "{piece:?} of the secret in {line}");
        }
    }
}

/// A secret of several lines (a PEM key) written to stderr is logged line
/// by line, and no log line held the whole value: each of its lines was
/// logged in clear (security audit). Now each line of such a value is
/// redacted wherever it occurs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_of_several_lines_is_not_logged_line_by_line() {
    let _serial = tests::exclusive().await;
    tests::init_tracing();
    let t = TestDb::new().await;
    let lines = [
        "-----BEGIN TEST KEY-----",
        "Kq81mZ7xPw4Lt9RvZz02Ab5c",
        "Hn3Jw8Qe6Tu1Yi9Op4As7Df2",
        "-----END TEST KEY-----",
    ];
    let value = lines.join("\n");
    let (_secrets, cfg) = tests::with_api_token(hostile("hostile", None, &[]), &value);
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(spec(
            "hostile.stderr_chatty",
            json!({"secrets": ["API_TOKEN"], "input": {"lines": 1}}),
        ))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{st:?}");
    let id = s.step_run_id.to_string();
    let until = Instant::now() + Duration::from_secs(10);
    while tests::logged(&[&id, "chatter 1"]).is_empty() {
        assert!(Instant::now() < until, "the stderr lines were not logged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.shutdown().await;
    let logged = tests::logged(&[&id]);
    assert!(
        logged
            .iter()
            .any(|l| l.contains("secret [REDACTED:API_TOKEN]")),
        "the first line is redacted: {logged:#?}"
    );
    for line in &logged {
        for part in &lines[1..3] {
            assert!(!line.contains(part), "{part:?} of the secret in {line}");
        }
    }
}

/// Once `run`'s one step runs (and `after` more), another session holds its
/// run row, and with `step_too` its step's row, until the transaction
/// returned is ended.
async fn hold_once_running(
    t: &TestDb,
    run: Uuid,
    after: Duration,
    step_too: bool,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let started = Instant::now();
    while t.status(run).await.steps[0].state != "running" {
        assert!(started.elapsed() < LONG, "the step never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(after).await;
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM durable.workflow_runs WHERE id = $1 FOR UPDATE")
        .bind(run)
        .execute(&mut *holder)
        .await
        .expect("hold the run row");
    if step_too {
        sqlx::query("SELECT 1 FROM durable.step_runs WHERE run_id = $1 FOR NO KEY UPDATE")
            .bind(run)
            .execute(&mut *holder)
            .await
            .expect("hold the step row");
    }
    holder
}

/// An attempt whose run row another transaction holds past the end of its
/// job still stores every checkpoint, in order, before its outcome: its
/// writes wait as long as its lease is renewed. A fixed 10 s bound after the
/// terminal dropped the checkpoints still queued (6 of 20 stored) and stored
/// the success beside an older checkpoint, the lease renewed all along
/// (throughput-core audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_wait_for_a_held_run_row_as_long_as_the_lease_is_renewed() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    const ITEMS: i64 = 20;
    let run = t
        .submit(
            json!({"name": "held", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.resume", "input": {"items": ITEMS, "ms": 50},
            "retry": {"max_attempts": 1}}]}),
        )
        .await;
    // once it runs, another session holds the run row for 13 s: the job ends
    // (1 s) long before, its checkpoints still to be written
    let holder = hold_once_running(&t, run, Duration::ZERO, false).await;
    tokio::time::sleep(Duration::from_secs(13)).await;
    holder.commit().await.expect("let go");
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "succeeded", "{st:?}");
    let (stored, last): (i64, Option<Value>) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM durable.step_events e
                  WHERE e.step_run_id = s.id AND e.checkpoint),
                convert_from(s.checkpoint, 'UTF8')::jsonb
           FROM durable.step_runs s WHERE s.id = $1",
    )
    .bind(s.step_run_id)
    .fetch_one(t.db.pool())
    .await
    .expect("checkpoints");
    assert_eq!(stored, ITEMS, "checkpoint events stored");
    assert_eq!(last, Some(json!({"next": ITEMS})), "the stored checkpoint");
    w.shutdown().await;
}

/// A process that answers nothing to its job (frozen, deadlocked) is
/// replaced once `handshake_timeout_ms` passes, and the job, which never
/// started, goes back to the queue uncounted, as a refusal; a persistent
/// pool's next process serves again. Before, a frozen warm process held its
/// job leased for as long as the worker lived when the step set no
/// heartbeat_timeout_ms (throughput-core audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_answered_by_nothing_is_given_back_and_its_process_replaced() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("spawns.txt");
    let mut e = hostile("hostile", Some(&log), &[]);
    e.persistent = true;
    let mut cfg = fast_config(vec![e]);
    cfg.handshake_timeout_ms = 1_000;
    cfg.max_refusals = 1;
    let graces_ms = cfg.cancel_grace_ms + cfg.term_grace_ms;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t.submit(spec("hostile.mute", json!({}))).await;
    let st = t.wait_terminal(run, LONG).await;
    let s = step(&st, "s");
    assert_eq!(s.state, "terminal_failed", "{st:?}");
    let e = s.error.as_ref().expect("error");
    assert_eq!(e.code, "EXECUTOR_REFUSED", "{e:?}");
    assert!(e.message.contains("EXECUTOR_UNRESPONSIVE"), "{e:?}");
    assert_eq!(s.attempt, 0, "no attempt is counted: {s:?}");
    let took_ms: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM finished_at - leased_at)::float8 * 1000
           FROM durable.step_runs WHERE run_id = $1",
    )
    .bind(run)
    .fetch_one(t.db.pool())
    .await
    .expect("times");
    assert!(
        took_ms < (1_000 + graces_ms + 2_500) as f64,
        "the unanswered job took {took_ms} ms"
    );
    // the pool replaced the process: the next job runs on a new one
    let before = spawns(&log);
    let next = t.submit(spec("hostile.echo", json!({}))).await;
    assert_eq!(t.wait_terminal(next, LONG).await.state, "succeeded");
    assert!(spawns(&log) > 1, "spawns {before} then {}", spawns(&log));
    w.shutdown().await;
}

/// When another session holds both an attempt's run row and its own row
/// past the lease TTL, the attempt gives up on its writes, and what it gave
/// up on is not written later: each attempt's stored events run without a
/// gap from its first to its last (every event of `demo.resume` carries a
/// checkpoint, so none may be coalesced away). Before, a success the attempt
/// had given up on waited among the writes set aside and landed when the
/// rows were let go, after the checkpoints it had dropped: events 19–42
/// missing, the success stored beside checkpoint 16 (re-check audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_an_attempt_gave_up_on_are_not_written_later() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    // a reclaim slower than the ledger's retries of writes set aside (as
    // the default config's is): the late write comes first
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.reclaim_interval_ms = 3_000;
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(
            json!({"name": "held", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.resume", "input": {"items": 40, "ms": 20},
            "retry": {"max_attempts": 3, "initial_interval_ms": 100}}]}),
        )
        .await;
    // both rows held for three lease TTLs (2 s each): the job ends within
    // the first, its success and its last checkpoints wait
    let holder = hold_once_running(&t, run, Duration::from_millis(200), true).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    holder.commit().await.expect("let go");
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    let attempts: Vec<(i32, Vec<i64>)> = sqlx::query_as(
        "SELECT attempt, array_agg(sequence ORDER BY sequence) FROM durable.step_events
          WHERE step_run_id = $1 GROUP BY attempt ORDER BY attempt",
    )
    .bind(step(&st, "s").step_run_id)
    .fetch_all(t.db.pool())
    .await
    .expect("events");
    for (attempt, seqs) in &attempts {
        let want: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, &want, "attempt {attempt}: a gap in its stored events");
    }
    w.shutdown().await;
}

/// A worker started under a name marks stopped the rows of that name on its
/// host whose process is gone (re-check audit: a killed predecessor's row
/// counted as live for 30 s more, and the other workers left it a step
/// naming a secret only it could hand out). A row whose process still
/// exists, another name's, and another host's are left as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_marks_its_dead_predecessors_stopped() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let host = nix::unistd::gethostname()
        .expect("hostname")
        .into_string()
        .expect("utf-8 hostname");
    let mut gone = std::process::Command::new("true").spawn().expect("true");
    let gone_pid = gone.id() as i32;
    gone.wait().expect("wait");
    let mut live = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("sleep");
    let rows = [
        ("dead", "slot-1", host.as_str(), gone_pid),
        ("running", "slot-1", host.as_str(), live.id() as i32),
        ("other-name", "slot-2", host.as_str(), gone_pid),
        ("other-host", "slot-1", "elsewhere", gone_pid),
    ];
    let mut ids = Vec::new();
    for (_, name, h, pid) in rows {
        let id = Uuid::new_v4();
        sqlx::query("INSERT INTO durable.workers (id, name, host, pid) VALUES ($1, $2, $3, $4)")
            .bind(id)
            .bind(name)
            .bind(h)
            .bind(pid)
            .execute(t.db.pool())
            .await
            .expect("a worker row");
        ids.push(id);
    }
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("slot-1".into());
    let w = RunningWorker::start(t.connect(10).await, cfg).await;
    let stopped = |id: Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT stopped_at IS NOT NULL FROM durable.workers WHERE id = $1",
            )
            .bind(id)
            .fetch_one(db.pool())
            .await
            .expect("row")
        }
    };
    let mut seen = Vec::new();
    for (i, (what, ..)) in rows.iter().enumerate() {
        seen.push((*what, stopped(ids[i]).await));
    }
    let me = stopped(w.id).await;
    w.shutdown().await;
    let _ = live.kill();
    let _ = live.wait();
    assert_eq!(
        seen,
        vec![
            ("dead", true),
            ("running", false),
            ("other-name", false),
            ("other-host", false)
        ]
    );
    assert!(!me, "the worker itself is live");
}
