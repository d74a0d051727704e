//! The worker's connection budget (README, "Many hosts"): its pool
//! (`db_max_connections`) is for the attempts, the lease, the reclaim and the
//! ledger; the heartbeat and LISTEN, which hold theirs, have connections of
//! their own beside it.

use std::time::{Duration, Instant};

use tests::TestDb;

/// An idle worker whose LISTEN is up holds no connection of its pool: every
/// connection the pool opened is idle (LISTEN used to take one of the pool's
/// for good, so a pool of concurrency + 1 had one fewer to share than the
/// config promises).
#[tokio::test]
async fn listen_holds_a_connection_of_its_own_not_one_of_the_pools() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::demo("go", "go", &[], None)]);
    cfg.executors[0].concurrency = 1;
    cfg.db_max_connections = cfg.min_db_connections();
    let db = t.connect(cfg.db_max_connections).await;
    let w = tests::RunningWorker::start(db.clone(), cfg).await;
    // LISTEN is up once a backend of this database last ran it
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&t.name)
        .fetch_one(t.db.pool())
        .await
        .expect("pg_stat_activity");
        if listening > 0 {
            break;
        }
        assert!(Instant::now() < until, "the worker never ran LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the lease and the reclaim loops take a pool connection for a moment
    // now and then: some moment finds all of them idle
    let pool = db.pool();
    let until = Instant::now() + Duration::from_secs(3);
    let mut all_idle = false;
    while !all_idle && Instant::now() < until {
        all_idle = pool.size() > 0 && pool.num_idle() == pool.size() as usize;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (size, idle) = (pool.size(), pool.num_idle());
    w.shutdown().await;
    assert!(
        all_idle,
        "an idle worker kept {} of its pool's {size} connections busy",
        size as usize - idle
    );
}

/// A LISTEN connection the server closes is said in the log, replaced, and
/// followed by a lease pass: before, sqlx reconnected on its own without a
/// word, and a NOTIFY sent meanwhile was missed until the next poll
/// (outside audit 79 #4). With a 30 s poll, a run submitted after the loss is
/// leased at once.
#[tokio::test]
async fn a_lost_listen_connection_is_said_and_replaced() {
    let t = TestDb::new().await;
    let mut cfg = tests::fast_config(vec![tests::demo("go", "go", &[], None)]);
    cfg.poll_interval_ms = 30_000;
    cfg.name = Some("listen-lost".into());
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    let listening = || async {
        sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&t.name)
        .fetch_optional(t.db.pool())
        .await
        .expect("pg_stat_activity")
    };
    let until = Instant::now() + Duration::from_secs(10);
    let pid = loop {
        if let Some(pid) = listening().await {
            break pid;
        }
        assert!(Instant::now() < until, "the worker never ran LISTEN");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let before = tests::logged(&["listen-lost", "LISTEN connection lost"]).len();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(t.db.pool())
        .await
        .expect("terminate");
    assert!(ended);
    let until = Instant::now() + Duration::from_secs(10);
    while tests::logged(&["listen-lost", "LISTEN is back"]).is_empty() {
        assert!(Instant::now() < until, "LISTEN was never replaced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        tests::logged(&["listen-lost", "LISTEN connection lost"]).len(),
        before + 1,
        "the loss was not logged"
    );
    assert_ne!(listening().await, Some(pid));
    let run = t
        .submit(tests::one_step(
            "after",
            "go",
            "demo.echo",
            serde_json::json!(1),
        ))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(10)).await;
    w.shutdown().await;
    assert_eq!(st.state, "succeeded", "{st:?}");
}
