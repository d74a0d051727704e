//! The heartbeat's report of lost leases. It is a test binary of its own:
//! it reads the process-wide `durable_heartbeat_lost_leases_total` counter
//! and turns on a process-wide fault, so no other test may share its process.

use std::time::{Duration, Instant};

use serde_json::json;
use tests::{fast_config, go_demo, step, RunningWorker, TestDb};

const LONG: Duration = Duration::from_secs(60);

fn lost_leases() -> u64 {
    let text = supervisor::metrics::render();
    text.lines()
        .find_map(|l| l.strip_prefix("durable_heartbeat_lost_leases_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no durable_heartbeat_lost_leases_total in:\n{text}"))
}

/// A heartbeat snapshots the leases it renews, then sends its statement. An
/// outcome that commits in between leaves the step no longer leased when
/// the statement runs, and the heartbeat used to call that a lost lease: a
/// "lease lost" warning for a step that had just succeeded (a busy
/// benchmark worker logged about one per 600 steps). The fault holds the
/// committed attempt in the renewal set for 1.5 s, so every heartbeat of
/// that window (300 ms apart) sees the step already succeeded: before the
/// fix each one counted a lost lease. A lease really taken from a running
/// attempt (the reclaimer moved the step on after its expiry) is still
/// reported, and its attempt stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_own_outcome_just_committed_is_not_a_lost_lease() {
    let t = TestDb::new().await;
    supervisor::fault::delay_first_attempt_release_of_kind(Some((
        "demo.echo",
        Duration::from_millis(1_500),
    )));
    let w = RunningWorker::start(
        t.connect(6).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let before = lost_leases();

    let run = t
        .submit(tests::one_step("echo", "go", "demo.echo", json!({"x": 1})))
        .await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(step(&st, "s").state, "succeeded", "{st:?}");
    // the attempt holds its place in the renewal set for 1.5 s after its
    // commit: about five heartbeats find the step succeeded
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(
        lost_leases(),
        before,
        "a heartbeat counted the step that had just succeeded as a lost lease"
    );
    supervisor::fault::delay_first_attempt_release_of_kind(None);

    // a real loss: the step's lease is made to expire and the reclaimer
    // moves it on while its executor still sleeps
    let run = t
        .submit(json!({"name": "stolen", "steps": [{
            "name": "s", "executor_kind": "go", "kind": "demo.sleep",
            "input": {"ms": 30_000, "steps": 30},
            "retry": {"max_attempts": 2, "initial_interval_ms": 60_000},
        }]}))
        .await;
    let sid = tests::only_step_id(&t, run).await;
    let t0 = Instant::now();
    let pid = loop {
        if let Some(pid) = tests::executor_pid(&t.db, sid).await {
            break pid;
        }
        assert!(t0.elapsed() < LONG, "the sleep never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // the worker's heartbeat may renew the lease between the two statements:
    // expire it again until the reclaimer gets it
    loop {
        sqlx::query(
            "UPDATE durable.step_runs SET lease_expires_at = now() - interval '1 second'
              WHERE id = $1 AND state IN ('leased', 'running')",
        )
        .bind(sid)
        .execute(t.db.pool())
        .await
        .expect("expire the lease");
        let reclaimed =
            t.db.reclaim_expired("reclaimer", 10)
                .await
                .expect("reclaim");
        if reclaimed == 1 {
            break;
        }
        assert!(t0.elapsed() < LONG, "the expired lease was never reclaimed");
    }
    while lost_leases() == before {
        assert!(
            t0.elapsed() < LONG,
            "no heartbeat reported the reclaimed lease as lost"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(lost_leases(), before + 1, "one lease was lost");
    // the attempt stopped its executor's process group (the group's id is
    // the executor's pid)
    let group_alive = || {
        nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            None::<nix::sys::signal::Signal>,
        )
        .is_ok()
    };
    let t1 = Instant::now();
    while group_alive() {
        assert!(
            t1.elapsed() < Duration::from_secs(10),
            "the executor of the lost lease still runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.shutdown().await;
}
