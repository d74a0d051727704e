//! Observability (issue 8, item 8): a real `supervisor worker` serves
//! Prometheus `/metrics`, `/healthz` and `/readyz` on `metrics_addr`; after a
//! run of steps that succeed, fail, retry, break the protocol, ignore a
//! cancel, get refused, and a lease that expires, every counter moved (by
//! name and label), the queue depth shows the steps nobody runs, and the
//! probes tell a live, ready worker — and one whose database is gone (alive,
//! not ready).

use std::time::Duration;

use serde_json::{json, Value};
use tests::{http_get, metric, TestDb, WorkerProcess};
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

fn run(steps: Value) -> Value {
    json!({"name": "metrics", "steps": steps})
}

/// Scrapes until `pred` holds on the exposition (bounded), returning it.
async fn scrape_until(
    addr: std::net::SocketAddr,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let until = std::time::Instant::now() + LONG;
    loop {
        let (status, body) = http_get(addr, "/metrics").await;
        assert_eq!(status, 200, "{body}");
        if pred(&body) {
            return body;
        }
        assert!(
            std::time::Instant::now() < until,
            "{what} within {LONG:?}:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn at_least(text: &str, series: &str, n: f64) -> bool {
    metric(text, series).is_some_and(|v| v >= n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_after_a_run_finds_the_counters_moved() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut go = tests::go_demo("go", &[], None);
    // a secret this worker cannot produce: its steps are refused
    go.secrets = vec!["DURABLE_METRICS_TEST_ABSENT".into()];
    let mut cfg = fast_config(vec![go]);
    cfg.metrics_addr = Some("127.0.0.1:0".into());
    cfg.max_refusals = 2;
    let w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let addr = w.metrics_addr(LONG).await;

    // ready once the executors are probed and the worker runs
    let until = std::time::Instant::now() + LONG;
    loop {
        let (status, body) = http_get(addr, "/readyz").await;
        if status == 200 {
            assert!(body.contains("database: ok"), "{body}");
            // one line per check (observability audit: two shared one)
            assert!(body.lines().any(|l| l == "worker: running"), "{body}");
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(std::time::Instant::now() < until, "never ready: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!((status, body.trim()), (200, "ok: running"));
    let (status, _) = http_get(addr, "/nope").await;
    assert_eq!(status, 404);

    let ok = t
        .submit(run(json!([
            {"name": "echo", "executor_kind": "go", "kind": "demo.echo", "input": {"x": 1}}
        ])))
        .await;
    let failing = t
        .submit(run(json!([
            {"name": "fail", "executor_kind": "go", "kind": "demo.fail",
             "input": {"code": "METRICS_BOOM"},
             "retry": {"max_attempts": 2, "initial_interval_ms": 10, "backoff_coefficient": 1.0, "max_interval_ms": 10}}
        ])))
        .await;
    let garbage = t
        .submit(run(json!([
            {"name": "garbage", "executor_kind": "go", "kind": "demo.misbehave",
             "input": {"mode": "garbage"}, "retry": {"max_attempts": 1}}
        ])))
        .await;
    let refused = t
        .submit(run(json!([
            {"name": "refused", "executor_kind": "go", "kind": "demo.echo",
             "secrets": ["DURABLE_METRICS_TEST_ABSENT"]}
        ])))
        .await;
    let stubborn = t
        .submit(run(json!([
            {"name": "stubborn", "executor_kind": "go", "kind": "demo.misbehave",
             "input": {"mode": "ignore_cancel"}}
        ])))
        .await;
    // steps nobody here runs: one stays queued, one is leased by a "worker"
    // that never renews, so this worker's reclaim loop moves it on
    t.submit(run(json!([
        {"name": "q1", "executor_kind": "elsewhere", "kind": "far.away"},
        {"name": "q2", "executor_kind": "elsewhere", "kind": "far.away"}
    ])))
    .await;
    let ghost_run = t
        .submit(run(json!([
            {"name": "ghost", "executor_kind": "ghost", "kind": "ghost.k",
             "retry": {"max_attempts": 1}}
        ])))
        .await;
    let ghost = Uuid::new_v4();
    t.db.register_worker(ghost, "ghost", "nowhere", &json!([]))
        .await
        .expect("register the ghost worker");
    let route = supervisor::db::Route {
        executor_kind: "ghost".into(),
        kind: "ghost.k".into(),
        labels: Default::default(),
    };
    let leased =
        t.db.lease(ghost, "ghost", &[route], 1, Duration::from_millis(300))
            .await
            .expect("lease as the ghost");
    assert_eq!(leased.len(), 1);

    // the stubborn step ignores the cancel frame and SIGTERM (its PROGRESS
    // event after accepted and running says the handler is installed):
    // SIGTERM, then SIGKILL ends it
    let stubborn_step = tests::only_step_id(&t, stubborn).await;
    let until = std::time::Instant::now() + LONG;
    while tests::event_count(&t.db, stubborn_step).await < 3 {
        assert!(
            std::time::Instant::now() < until,
            "the stubborn step never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t.db.cancel(stubborn, None).await.expect("cancel");

    for (id, want) in [
        (ok, "succeeded"),
        (failing, "failed"),
        (garbage, "failed"),
        (refused, "failed"),
        (stubborn, "cancelled"),
        (ghost_run, "failed"),
    ] {
        let st = t.wait_terminal(id, LONG).await;
        assert_eq!(st.state.to_string(), want, "{st:?}");
    }
    let st = t.status(failing).await;
    assert_eq!(st.steps[0].attempt, 2, "{st:?}");

    // a counter moves just after its commit: the database can show the step
    // terminal a moment before the scrape shows its count
    let expected = [
        ("durable_leases_total{executor=\"go\"}", 7.0),
        ("durable_attempts_completed_total{outcome=\"succeeded\"}", 1.0),
        ("durable_attempts_completed_total{outcome=\"failed\"}", 3.0),
        ("durable_attempts_completed_total{outcome=\"cancelled\"}", 1.0),
        ("durable_attempts_completed_total{outcome=\"refused\"}", 2.0),
        ("durable_attempt_failures_total{code=\"METRICS_BOOM\"}", 2.0),
        ("durable_attempt_failures_total{code=\"PROTOCOL_MALFORMED_FRAME\"}", 1.0),
        ("durable_retries_total", 1.0),
        ("durable_reclaims_total", 1.0),
        ("durable_refusals_total{code=\"SECRET_UNAVAILABLE\"}", 2.0),
        ("durable_executor_signals_total{signal=\"SIGTERM\"}", 1.0),
        ("durable_executor_signals_total{signal=\"SIGKILL\"}", 1.0),
        ("durable_frame_errors_total{code=\"PROTOCOL_MALFORMED_FRAME\"}", 1.0),
        ("durable_step_duration_seconds_count{kind=\"demo.echo\",outcome=\"succeeded\"}", 1.0),
        ("durable_step_duration_seconds_count{kind=\"demo.fail\",outcome=\"failed\"}", 2.0),
        ("durable_step_duration_seconds_bucket{kind=\"demo.echo\",outcome=\"succeeded\",le=\"+Inf\"}", 1.0),
        ("durable_heartbeat_duration_seconds_count", 1.0),
        ("durable_ledger_batch_intents_count", 1.0),
        ("durable_ledger_batch_intents_sum", 2.0),
        ("durable_queue_depth{executor_kind=\"elsewhere\",kind=\"far.away\"}", 2.0),
    ];
    let text = scrape_until(addr, "every counter moved", |m| {
        expected.iter().all(|(series, n)| at_least(m, series, *n))
    })
    .await;
    for (series, n) in expected {
        assert!(
            at_least(&text, series, n),
            "{series} should be at least {n}, is {:?}:\n{text}",
            metric(&text, series)
        );
    }
    assert_eq!(
        metric(
            &text,
            "durable_attempts_completed_total{outcome=\"succeeded\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "durable_heartbeat_failures_total").is_some(),
        "{text}"
    );
    // renewed every 300 ms: the last success is recent (a loaded machine
    // may miss one or two)
    let lag = metric(&text, "durable_heartbeat_lag_seconds").expect("heartbeat lag");
    assert!((0.0..5.0).contains(&lag), "heartbeat lag {lag} s");
    assert!(
        text.contains("# TYPE durable_step_duration_seconds histogram"),
        "{text}"
    );

    // the database goes away: still alive (its loops run), no longer ready
    sqlx::query(&format!("DROP DATABASE \"{}\" WITH (FORCE)", t.name))
        .execute(&admin().await)
        .await
        .expect("drop the worker's database");
    let until = std::time::Instant::now() + LONG;
    loop {
        let (status, body) = http_get(addr, "/readyz").await;
        if status == 503 {
            assert!(body.contains("database: unreachable"), "{body}");
            assert!(body.contains("executors: probed"), "{body}");
            break;
        }
        assert!(std::time::Instant::now() < until, "still ready: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!(status, 200, "alive without its database: {body}");
    let text = scrape_until(addr, "a failed renewal", |m| {
        at_least(m, "durable_heartbeat_failures_total", 1.0)
    })
    .await;
    assert!(text.contains("durable_leases_total"), "{text}");
    drop(w);
}

async fn admin() -> sqlx::PgPool {
    sqlx::PgPool::connect(&std::env::var("DATABASE_URL").expect("DATABASE_URL"))
        .await
        .expect("admin connection")
}

/// A bad `metrics_addr` is a config error naming the key (and the variable
/// that set it), before anything runs.
#[test]
fn a_bad_metrics_addr_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("w.toml");
    let mut cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.metrics_addr = Some("localhost:http".into());
    std::fs::write(&cfg_path, tests::worker_toml(&cfg)).expect("write");
    let o = std::process::Command::new(tests::supervisor_bin())
        .args(["worker", "--config"])
        .arg(&cfg_path)
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("metrics_addr = \"localhost:http\"") && err.contains("127.0.0.1:9464"),
        "{err}"
    );
    // the environment names the variable
    let o = std::process::Command::new(tests::supervisor_bin())
        .args(["worker", "--config"])
        .arg(&cfg_path)
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("DURABLE_METRICS_ADDR", "nonsense")
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("metrics_addr = \"nonsense\"") && err.contains("DURABLE_METRICS_ADDR"),
        "{err}"
    );
}

/// A taken port: the worker exits 1 before it starts, naming the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_metrics_port_stops_the_worker_naming_it() {
    let t = TestDb::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let mut cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.metrics_addr = Some(addr.to_string());
    let mut w = WorkerProcess::spawn(&t.url, &cfg);
    let code = w.wait(LONG).await;
    let err = w.stderr();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot serve metrics on metrics_addr {addr}")),
        "{err}"
    );
}

/// Waits (bounded) until `path` answers `status` with a body that holds
/// `needle`, returning the body.
async fn probe_until(addr: std::net::SocketAddr, path: &str, status: u16, needle: &str) -> String {
    let until = std::time::Instant::now() + LONG;
    loop {
        let (s, body) = http_get(addr, path).await;
        if s == status && body.contains(needle) {
            return body;
        }
        assert!(
            std::time::Instant::now() < until,
            "{path} never answered {status} with {needle:?}: {s} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What an operator's probes and gauges say of a worker that takes no work
/// though its database answers (operator audit): `/readyz` said ready while
/// every renewal failed (nothing is leased then); and `durable_queue_depth`
/// dropped the routes after its first 100 without a sign. Now `/readyz`
/// fails while renewals fail and `durable_queue_depth_cut` says the list was
/// cut; an idle client no longer holds a probe's slot for 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_renewals_fail_and_a_cut_queue_depth_says_so() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.metrics_addr = Some("127.0.0.1:0".into());
    let w = WorkerProcess::spawn_args(&t.url, &cfg, &["--log-format", "json"], &[]);
    let addr = w.metrics_addr(LONG).await;
    probe_until(addr, "/readyz", 200, "worker: running").await;

    // 101 routes with open steps: the gauge reports 100 and says it is cut
    let steps: Vec<Value> = (0..=100)
        .map(|i| json!({"name": format!("s{i}"), "executor_kind": "nobody", "kind": format!("k.{i:03}")}))
        .collect();
    t.submit(run(Value::Array(steps))).await;
    let text = scrape_until(addr, "the cut queue depth", |m| {
        metric(m, "durable_queue_depth_cut") == Some(1.0)
    })
    .await;
    assert!(
        metric(
            &text,
            "durable_queue_depth{executor_kind=\"nobody\",kind=\"k.100\"}"
        )
        .is_none(),
        "{text}"
    );

    // idle connections hold their slots for 2 s at most
    let idle: Vec<std::net::TcpStream> = (0..40)
        .filter_map(|_| std::net::TcpStream::connect(addr).ok())
        .collect();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (status, body) = http_get(addr, "/healthz").await;
    assert_eq!(status, 200, "the probe after idle clients: {body}");
    drop(idle);

    // the heartbeat cannot renew (its table is locked): not ready, and why
    let admin = admin_of(&t).await;
    let mut lock = admin.begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.step_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock");
    let body = probe_until(addr, "/readyz", 503, "leases: renewals failing").await;
    assert!(body.contains("database: ok"), "{body}");
    lock.rollback().await.expect("unlock");
    probe_until(addr, "/readyz", 200, "worker: running").await;

    // its lease calls fail (here: they wait past lock_timeout for the
    // worker's lease lock), its renewals do not: not ready either
    let worker: Uuid =
        sqlx::query_scalar("SELECT id FROM durable.workers WHERE stopped_at IS NULL")
            .fetch_one(&admin)
            .await
            .expect("the worker");
    let mut held = admin.acquire().await.expect("a connection");
    sqlx::query("SELECT pg_advisory_lock(72546103, hashtext($1::text))")
        .bind(worker)
        .execute(&mut *held)
        .await
        .expect("the lease lock");
    let body = probe_until(addr, "/readyz", 503, "leases: lease calls failing").await;
    assert!(!body.contains("renewals failing"), "{body}");
    sqlx::query("SELECT pg_advisory_unlock(72546103, hashtext($1::text))")
        .bind(worker)
        .execute(&mut *held)
        .await
        .expect("unlock");
    drop(held);
    probe_until(addr, "/readyz", 200, "worker: running").await;
    drop(w);
}

async fn admin_of(t: &TestDb) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&t.url)
        .await
        .expect("admin connection")
}
