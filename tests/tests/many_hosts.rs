//! Many hosts (issue 8, item 10): two real `supervisor worker` processes, each
//! on a "host" of its own, against one PostgreSQL.
//!
//! A host is a network namespace and a UTS namespace (`unshare -n -u`: its
//! own loopback, its own hostname) where the machine allows it; the worker is
//! started inside with `nsenter`, so it can reach nothing but its own
//! loopback. The database is reached the way a separate machine would reach
//! it, through a network path: a TCP forwarder whose listening socket lives
//! in the host's namespace (made there with setns on a thread of this test)
//! and whose connections to PostgreSQL leave from a source address of the
//! host's own (127.0.0.2 for host-a, 127.0.0.3 for host-b), so the server's
//! `pg_stat_activity.client_addr` tells the hosts apart. Where namespaces are
//! not permitted, the hosts are only those two loopback addresses (the
//! workers connect to forwarders listening on 127.0.0.2 / 127.0.0.3); the
//! test prints which it used. The database side is the same either way.
//!
//! It checks from the database that both hosts' workers served steps of one
//! batch of runs, from their own addresses and within their connection
//! budget; that every step succeeded exactly once; and that after one worker
//! is SIGKILLed, its children are gone at once and the other worker runs its
//! steps again only after their leases expired (fencing by lease token and
//! expiry on the database clock), so no step ran twice at once.

use std::io::BufRead;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use tests::{TestDb, WorkerProcess};
use tokio::net::{TcpListener, TcpSocket};
use uuid::Uuid;

const RUNS: usize = 40;
const DB_MAX_CONNECTIONS: u32 = 5;

/// One "host": where its worker connects, and the address its database
/// connections come from.
struct Host {
    name: &'static str,
    worker: String,
    /// The namespace holder (`unshare … sleep`), when namespaces are used.
    holder: Option<std::process::Child>,
    /// What starts the worker inside the host (empty: no namespace).
    wrapper: Vec<String>,
    listen: SocketAddr,
    forwarder: tokio::task::JoinHandle<()>,
}

impl Drop for Host {
    fn drop(&mut self) {
        self.forwarder.abort();
        if let Some(h) = &mut self.holder {
            let _ = h.kill();
            let _ = h.wait();
        }
    }
}

/// A process in new network and UTS namespaces with `hostname` and its
/// loopback up; `None` where the machine does not allow it.
fn namespace_holder(hostname: &str) -> Option<std::process::Child> {
    let mut child = std::process::Command::new("unshare")
        .args(["--net", "--uts", "sh", "-c"])
        .arg(format!(
            "hostname {hostname} && ip link set lo up && echo ready && exec sleep 600"
        ))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let mut line = String::new();
    let out = child.stdout.take()?;
    let _ = std::io::BufReader::new(out).read_line(&mut line);
    if line.trim() == "ready" {
        Some(child)
    } else {
        let _ = child.kill();
        let _ = child.wait();
        None
    }
}

/// A listening socket made inside the network namespace of `pid` (on a
/// thread of its own that enters it; the socket stays in that namespace).
fn listener_in_namespace_of(pid: u32, addr: SocketAddr) -> std::net::TcpListener {
    std::thread::spawn(move || {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).expect("open netns");
        // SAFETY: setns on a valid fd; it changes only this thread's namespace
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        let l = std::net::TcpListener::bind(addr).expect("bind in the host's namespace");
        l.set_nonblocking(true).expect("nonblocking");
        l
    })
    .join()
    .expect("namespace thread")
}

/// Forwards every connection to `upstream`, from `source`.
async fn forward(listener: TcpListener, source: Ipv4Addr, upstream: SocketAddr) {
    while let Ok((mut down, _)) = listener.accept().await {
        tokio::spawn(async move {
            let Ok(sock) = TcpSocket::new_v4() else {
                return;
            };
            if sock.bind(SocketAddr::from((source, 0))).is_err() {
                return;
            }
            let Ok(mut up) = sock.connect(upstream).await else {
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
        });
    }
}

/// Whether the server accepts logins from `source` (its pg_hba.conf may
/// allow 127.0.0.1 only): one connection through a forwarder in this
/// namespace.
async fn server_accepts_from(source: Ipv4Addr, upstream: SocketAddr, db: &str) -> bool {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("probe listener");
    let port = l.local_addr().expect("addr").port();
    let f = tokio::spawn(forward(l, source, upstream));
    let ok = supervisor::db::Db::connect(&format!("postgres://postgres@127.0.0.1:{port}/{db}"), 1)
        .await
        .is_ok();
    f.abort();
    ok
}

async fn start_host(
    name: &'static str,
    source: Ipv4Addr,
    upstream: SocketAddr,
    namespaces: bool,
) -> Host {
    let worker = format!("worker-{}", name.trim_start_matches("host-"));
    if namespaces {
        if let Some(holder) = namespace_holder(name) {
            let pid = holder.id();
            let listen: SocketAddr = "127.0.0.1:5432".parse().expect("addr");
            let l = TcpListener::from_std(listener_in_namespace_of(pid, listen))
                .expect("tokio listener");
            return Host {
                name,
                worker,
                wrapper: vec![
                    "nsenter".into(),
                    format!("--net=/proc/{pid}/ns/net"),
                    format!("--uts=/proc/{pid}/ns/uts"),
                    "--".into(),
                ],
                holder: Some(holder),
                listen,
                forwarder: tokio::spawn(forward(l, source, upstream)),
            };
        }
    }
    // no namespaces: the host is its loopback address
    let l = TcpListener::bind(SocketAddr::from((source, 0)))
        .await
        .expect("bind loopback address");
    let listen = l.local_addr().expect("addr");
    Host {
        name,
        worker,
        wrapper: Vec::new(),
        holder: None,
        listen,
        forwarder: tokio::spawn(forward(l, source, upstream)),
    }
}

#[derive(Debug, sqlx::FromRow)]
struct Transition {
    step_run_id: Uuid,
    from_state: Option<String>,
    to_state: String,
    worker: Option<String>,
    reason: Option<String>,
    at: DateTime<Utc>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_share_one_database() {
    let t = TestDb::new().await;
    let opts: PgConnectOptions = t.url.parse().expect("url");
    let upstream = tokio::net::lookup_host((opts.get_host(), opts.get_port()))
        .await
        .expect("resolve the database host")
        .find(|a| a.is_ipv4())
        .expect("the test database has an IPv4 address");

    // each host's connections leave from its own address, if the server's
    // pg_hba.conf allows them (scripts/pg allows 127.0.0.0/8)
    let own_sources = server_accepts_from(Ipv4Addr::new(127, 0, 0, 2), upstream, &t.name).await;
    let sources = if own_sources {
        [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)]
    } else {
        [Ipv4Addr::LOCALHOST; 2]
    };
    let hosts = [
        start_host("host-a", sources[0], upstream, true).await,
        start_host("host-b", sources[1], upstream, true).await,
    ];
    let namespaces = hosts.iter().all(|h| h.holder.is_some());
    println!(
        "hosts: {}; database connections from {}",
        if namespaces {
            "separate network and UTS namespaces (unshare -n -u), worker started with nsenter"
        } else {
            "separate loopback addresses (network namespaces not permitted here)"
        },
        if own_sources {
            "127.0.0.2 (host-a) and 127.0.0.3 (host-b)"
        } else {
            "127.0.0.1 for both: the server's pg_hba.conf refuses other loopback addresses (restart it with scripts/pg)"
        }
    );

    let mut cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.db_max_connections = DB_MAX_CONNECTIONS;
    let mut workers: Vec<WorkerProcess> = hosts
        .iter()
        .map(|h| {
            let mut c = cfg.clone();
            c.name = Some(h.worker.clone());
            let url = format!(
                "postgres://postgres@{}/{}?application_name={}",
                h.listen, t.name, h.worker
            );
            WorkerProcess::spawn_with(&h.wrapper, &url, &c)
        })
        .collect();

    let runs: Vec<Uuid> = {
        let mut v = Vec::new();
        for i in 0..RUNS {
            v.push(
                t.submit(tests::one_step(
                    &format!("r{i}"),
                    "go",
                    "demo.sleep",
                    json!({"ms": 1500, "steps": 3}),
                ))
                .await,
            );
        }
        v
    };

    // both hosts serve the batch; host-a is killed while it runs steps
    let until = Instant::now() + Duration::from_secs(60);
    let a_id = loop {
        assert!(
            Instant::now() < until,
            "both workers did not get to work within 60 s: {}\n{}",
            workers[0].stderr(),
            workers[1].stderr()
        );
        let done: Vec<(String, i64)> = sqlx::query_as(
            "SELECT worker, count(*) FROM durable.transitions WHERE to_state = 'succeeded' AND step_run_id IS NOT NULL GROUP BY worker")
            .fetch_all(t.db.pool()).await.expect("done");
        let a: Option<Uuid> =
            sqlx::query_scalar("SELECT id FROM durable.workers WHERE name = 'worker-a'")
                .fetch_optional(t.db.pool())
                .await
                .expect("a");
        let running: Vec<(Uuid, Option<i32>)> = match a {
            // a step that has most of its 1.5 s still to run: it is held
            // when the kill lands, not completing at that very moment
            Some(a) => sqlx::query_as("SELECT id, executor_pid FROM durable.step_runs WHERE owner_worker_id = $1 AND state = 'running'
                                         AND started_at > clock_timestamp() - interval '500 milliseconds'")
                .bind(a).fetch_all(t.db.pool()).await.expect("running"),
            None => Vec::new(),
        };
        let served = |w: &str| done.iter().any(|(n, c)| n == w && *c > 0);
        if served("worker-a") && served("worker-b") && !running.is_empty() {
            break a.expect("worker-a registered");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    // the connections, as the server sees them
    let conns: Vec<(String, Option<String>, i64)> = sqlx::query_as(
        "SELECT application_name, host(client_addr), count(*) FROM pg_stat_activity
          WHERE datname = $1 AND application_name LIKE 'worker-%' GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(&t.name)
    .fetch_all(t.db.pool())
    .await
    .expect("pg_stat_activity");
    println!("connections (application_name, client_addr, count): {conns:?}");
    for (h, src) in hosts.iter().zip(sources) {
        let mine: Vec<_> = conns.iter().filter(|c| c.0 == h.worker).collect();
        assert_eq!(
            mine.len(),
            1,
            "{}'s connections come from one address: {conns:?}",
            h.worker
        );
        assert_eq!(
            mine[0].1.as_deref(),
            Some(src.to_string().as_str()),
            "{}: {conns:?}",
            h.name
        );
        // the budget: the pool, plus the heartbeat's and LISTEN's own
        assert!(
            mine[0].2 <= i64::from(DB_MAX_CONNECTIONS) + 2,
            "{} uses {} connections: {conns:?}",
            h.worker,
            mine[0].2
        );
    }
    if namespaces {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT name, host FROM durable.workers ORDER BY name")
                .fetch_all(t.db.pool())
                .await
                .expect("workers");
        assert_eq!(
            rows,
            vec![
                ("worker-a".into(), "host-a".into()),
                ("worker-b".into(), "host-b".into())
            ]
        );
    }

    let killed_at: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(t.db.pool())
        .await
        .expect("now");
    workers[0].signal(nix::sys::signal::Signal::SIGKILL);
    workers[0].wait(Duration::from_secs(10)).await;
    // a statement it sent before it died may still be running on the server,
    // and commit (it holds its lease): what it held is read once its backends
    // are gone (a completion of its own in flight at the kill is legitimate)
    let gone_by = Instant::now() + Duration::from_secs(10);
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
        )
        .bind(&t.name)
        .bind(&hosts[0].worker)
        .fetch_one(t.db.pool())
        .await
        .expect("pg_stat_activity");
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < gone_by,
            "{left} backend(s) of the killed worker still there 10 s after its death"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // what it held when it died (its leases are still unexpired now)
    let a_running: Vec<(Uuid, Option<i32>)> = sqlx::query_as(
        "SELECT id, executor_pid FROM durable.step_runs WHERE owner_worker_id = $1 AND state IN ('leased', 'running')")
        .bind(a_id).fetch_all(t.db.pool()).await.expect("orphans");
    assert!(!a_running.is_empty(), "the killed worker held no step");
    // its children die with it (PDEATHSIG), long before its leases expire
    for (step, pid) in &a_running {
        tests::assert_no_survivors(*step, *pid, Duration::from_millis(1000)).await;
    }

    for run in &runs {
        let st = t.wait_terminal(*run, Duration::from_secs(60)).await;
        assert_eq!(st.state, "succeeded", "{st:?}");
    }

    let history: Vec<Transition> = sqlx::query_as(
        "SELECT step_run_id, from_state, to_state, worker, reason, at FROM durable.transitions
          WHERE step_run_id IS NOT NULL ORDER BY step_run_id, id",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("history");
    let steps: std::collections::BTreeSet<Uuid> = history.iter().map(|h| h.step_run_id).collect();
    assert_eq!(steps.len(), RUNS);
    let mut by_worker = std::collections::BTreeMap::<String, usize>::new();
    for s in &steps {
        let h: Vec<&Transition> = history.iter().filter(|h| h.step_run_id == *s).collect();
        let successes: Vec<_> = h.iter().filter(|x| x.to_state == "succeeded").collect();
        assert_eq!(
            successes.len(),
            1,
            "step {s} succeeded {} times: {h:?}",
            successes.len()
        );
        *by_worker
            .entry(successes[0].worker.clone().unwrap_or_default())
            .or_default() += 1;
        // one attempt at a time: every lease starts from a state no one holds
        for x in h.iter().filter(|x| x.to_state == "leased") {
            assert!(
                matches!(
                    x.from_state.as_deref(),
                    Some("pending") | Some("retryable_failed")
                ),
                "{h:?}"
            );
        }
    }
    println!("steps completed by worker: {by_worker:?}");
    assert!(
        by_worker.get("worker-a").is_some_and(|n| *n > 0)
            && by_worker.get("worker-b").is_some_and(|n| *n > 0),
        "{by_worker:?}"
    );

    // host-a's steps at the kill: expired on the database clock, then run
    // again by host-b, never before the lease could have expired
    // the last renewal was at most one interval before the kill (two, if one
    // found the row busy), so the lease lasted at least this long after it
    let cfg_ttl = chrono::Duration::milliseconds(
        cfg.lease_ttl_ms as i64 - 2 * cfg.heartbeat_interval_ms as i64,
    );
    for (step, _) in &a_running {
        let h: Vec<&Transition> = history.iter().filter(|h| h.step_run_id == *step).collect();
        let expired = h
            .iter()
            .find(|x| {
                x.reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("LEASE_EXPIRED"))
            })
            .unwrap_or_else(|| panic!("step {step} of the killed worker did not expire: {h:?}"));
        assert!(
            expired.at - killed_at >= cfg_ttl,
            "reclaimed {} after the kill, before the lease could expire: {h:?}",
            expired.at - killed_at
        );
        let rerun = h
            .iter()
            .find(|x| x.to_state == "leased" && x.at > expired.at)
            .expect("leased again");
        assert_eq!(rerun.worker.as_deref(), Some("worker-b"), "{h:?}");
        let last = h.last().expect("history");
        assert_eq!(
            (last.to_state.as_str(), last.worker.as_deref()),
            ("succeeded", Some("worker-b")),
            "{h:?}"
        );
    }
    let a_left: i64 = sqlx::query_scalar("SELECT count(*) FROM durable.step_runs WHERE owner_worker_id = $1 AND state IN ('leased', 'running')")
        .bind(a_id).fetch_one(t.db.pool()).await.expect("left");
    assert_eq!(a_left, 0);

    workers[1].signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        workers[1].wait(Duration::from_secs(30)).await,
        Some(0),
        "{}",
        workers[1].stderr()
    );
}
