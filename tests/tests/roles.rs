//! Least-privilege roles (README "Database roles"), found by an audit of
//! production set-ups:
//! - a submitter needs USAGE on the schema and EXECUTE on submit_run and
//!   cancel_run, nothing more: it needed SELECT, INSERT and UPDATE on five
//!   tables, with which it could rewrite anyone's queued steps directly;
//! - a worker whose role lacks a grant is refused at start, naming it: it
//!   ran, and every outcome was refused, its steps leased for good;
//! - `migrate` on an up-to-date schema needs no rights (it ran CREATE SCHEMA
//!   IF NOT EXISTS, which checks CREATE on the database anyway: a deploy
//!   script running migrate as the worker's role failed);
//! - the first `migrate` of an empty schema a DBA made for the deploy role
//!   needs no CREATE on the database;
//! - the runtime's connections are READ COMMITTED whatever the database's
//!   default (SERIALIZABLE failed ~40% of concurrent submits with 40001).

use std::time::Duration;

use serde_json::json;
use supervisor::db::{Db, DbError};
use tests::TestDb;
use uuid::Uuid;

/// `url` with its user replaced by `role` (the test cluster trusts local
/// connections).
fn as_role(url: &str, role: &str) -> String {
    let scheme_end = url.find("://").map(|i| i + 3).unwrap_or(0);
    let at = url[scheme_end..].find('@').map(|i| i + scheme_end);
    match at {
        Some(at) => format!("{}{role}{}", &url[..scheme_end], &url[at..]),
        None => format!("{}{role}@{}", &url[..scheme_end], &url[scheme_end..]),
    }
}

async fn exec(db: &Db, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(db.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test]
async fn a_submitter_needs_execute_only_and_a_worker_is_told_what_it_lacks() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let (sub, wrk) = (format!("sub_{tag}"), format!("wrk_{tag}"));
    exec(
        &t.db,
        &format!(
            "CREATE ROLE {sub} LOGIN; GRANT USAGE ON SCHEMA durable TO {sub};
             CREATE ROLE {wrk} LOGIN; GRANT USAGE ON SCHEMA durable TO {wrk};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA durable TO {wrk};
             GRANT USAGE ON ALL SEQUENCES IN SCHEMA durable TO {wrk};
             REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON durable._sqlx_migrations,
               durable.step_transition_rules, durable.run_transition_rules FROM {wrk};
             REVOKE INSERT ON durable.step_events FROM {wrk};"
        ),
    )
    .await;

    // the submitter: submit and cancel through SQL and the CLI …
    let submitter = Db::connect(&as_role(&t.url, &sub), 2)
        .await
        .expect("connect as the submitter");
    let spec = tests::one_step("by-sub", "go", "demo.echo", json!({"a": 1}));
    let run = submitter
        .submit(&spec)
        .await
        .expect("submit with EXECUTE only");
    submitter
        .cancel(run, None)
        .await
        .expect("cancel with EXECUTE only");
    let out = tests::submit_stdin(&as_role(&t.url, &sub), &spec.to_string());
    assert_eq!(
        out.status.code(),
        Some(0),
        "supervisor submit as the submitter: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // … and nothing around the validator
    let write = sqlx::query("UPDATE durable.step_runs SET input = '{}'")
        .execute(submitter.pool())
        .await;
    assert!(write.is_err(), "the submitter wrote the queue directly");

    // the worker role without INSERT on step_events: refused at start
    let worker_db = Db::connect(&as_role(&t.url, &wrk), 4)
        .await
        .expect("connect as the worker");
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let err = supervisor::worker::Worker::start(worker_db, cfg.clone())
        .await
        .err()
        .expect("a worker that cannot record events is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("INSERT on durable.step_events") && msg.contains("GRANT"),
        "{msg}"
    );
    // granted, it starts
    exec(
        &t.db,
        &format!("GRANT INSERT ON durable.step_events TO {wrk}"),
    )
    .await;
    let worker_db = Db::connect(&as_role(&t.url, &wrk), 4)
        .await
        .expect("connect as the worker");
    let w = supervisor::worker::Worker::start(worker_db, cfg)
        .await
        .expect("a worker with every grant starts");
    drop(w);
}

#[tokio::test]
async fn migrate_again_needs_no_rights_and_sessions_are_read_committed() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let reader = format!("rd_{tag}");
    // a role with USAGE on the schema and no CREATE anywhere (a worker's or a
    // submitter's, in a deploy script that runs migrate first)
    exec(
        &t.db,
        &format!(
            "CREATE ROLE {reader} LOGIN; GRANT USAGE ON SCHEMA durable TO {reader};
             REVOKE CREATE ON DATABASE {name} FROM PUBLIC;
             ALTER DATABASE {name} SET default_transaction_isolation = 'serializable';",
            name = t.name
        ),
    )
    .await;
    let db = Db::connect(&as_role(&t.url, &reader), 1)
        .await
        .expect("connect as the reader");
    let v = db
        .migrate()
        .await
        .expect("migrate on an up-to-date schema: nothing to apply, no rights needed");
    assert_eq!(v, Db::schema_version_needed());

    let iso: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(db.pool())
        .await
        .expect("isolation");
    assert_eq!(iso, "read committed", "the database's default overrode it");
}

/// A deploy role given only the empty schema a DBA made for it (`CREATE
/// SCHEMA durable AUTHORIZATION …`, no CREATE on the database) migrates it
/// from nothing: the first migration's `CREATE SCHEMA IF NOT EXISTS` is
/// checked against the database before PostgreSQL finds the schema there,
/// so it failed "permission denied for database". The ledger records each
/// migration with the checksum a migrate by a superuser records.
#[tokio::test]
async fn the_owner_of_a_schema_a_dba_made_migrates_it_from_nothing() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let owner = format!("own_{tag}");
    exec(
        &t.db,
        &format!(
            "DROP SCHEMA durable CASCADE;
             CREATE ROLE {owner} LOGIN;
             REVOKE CREATE ON DATABASE {name} FROM PUBLIC;
             CREATE SCHEMA durable AUTHORIZATION {owner};",
            name = t.name
        ),
    )
    .await;
    let db = Db::connect(&as_role(&t.url, &owner), 1)
        .await
        .expect("connect as the schema's owner");
    let v = db
        .migrate()
        .await
        .expect("migrate an empty schema the role owns, without CREATE on the database");
    assert_eq!(v, Db::schema_version_needed());
    let ledger = |db: &Db| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_as::<_, (i64, Vec<u8>)>(
                "SELECT version, checksum FROM durable._sqlx_migrations ORDER BY version",
            )
            .fetch_all(&pool)
            .await
            .expect("ledger")
        }
    };
    // the same ledger as a schema migrated from scratch by a superuser
    let reference = TestDb::new().await;
    assert_eq!(ledger(&db).await, ledger(&reference.db).await);
    // and the schema works: a run goes in
    let run = db
        .submit(&tests::one_step("dba", "go", "k", json!({})))
        .await
        .expect("submit as the owner");
    assert_eq!(t.status(run).await.state, "pending");
}

/// A role that may only use an empty schema it does not own is told what to
/// do, not only "permission denied for schema durable" (re-check audit).
#[tokio::test]
async fn migrate_without_create_on_the_schema_says_what_to_do() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let user = format!("use_{tag}");
    exec(
        &t.db,
        &format!(
            "DROP SCHEMA durable CASCADE;
             CREATE ROLE {user} LOGIN;
             REVOKE CREATE ON DATABASE {name} FROM PUBLIC;
             CREATE SCHEMA durable;
             GRANT USAGE ON SCHEMA durable TO {user};",
            name = t.name
        ),
    )
    .await;
    let db = Db::connect(&as_role(&t.url, &user), 1)
        .await
        .expect("connect");
    let msg = db
        .migrate()
        .await
        .expect_err("no CREATE on the schema")
        .to_string();
    assert!(
        msg.contains("permission denied for schema durable")
            && msg.contains("migrate as the owner of schema durable"),
        "{msg}"
    );
}

/// `migrate` says what it did: how many migrations it applied, or that the
/// schema was up to date. Before, a run that applied nothing (a second one,
/// or the loser of two at once) said "migrations applied" too (upgrade audit).
#[tokio::test]
async fn migrate_says_whether_it_applied_anything() {
    let t = TestDb::new().await;
    exec(&t.db, "DROP SCHEMA durable CASCADE").await;
    let migrate = || {
        let out = std::process::Command::new(tests::supervisor_bin())
            .args(["migrate"])
            .env("DATABASE_URL", &t.url)
            .env("RUST_LOG", "error")
            .output()
            .expect("migrate");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let version = supervisor::db::Db::schema_version_needed();
    let first = migrate();
    assert!(
        first.starts_with("applied ")
            && first.contains(&format!("migrations (schema version {version})")),
        "{first}"
    );
    assert_eq!(
        migrate().trim(),
        format!("the schema is up to date (version {version}): nothing to apply")
    );
    // and `--version` names the schema it needs: two builds of one release
    // number told themselves apart only by a worker's log line
    let out = std::process::Command::new(tests::supervisor_bin())
        .arg("--version")
        .output()
        .expect("--version");
    let v = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        v.starts_with("supervisor ") && v.ends_with(&format!(" (schema {version})")),
        "{v}"
    );
}

/// A connection the server refuses is named by the server's own words
/// (DB fault audit): a pool retries `too many clients` and a role's
/// connection limit until its timeout and then says only that it timed
/// out, which read like the worker's own pool size. The heartbeat's failure
/// log now carries `Db::connect_error`'s answer.
#[tokio::test]
async fn a_refused_connection_is_named_by_the_servers_reason() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let role = format!("lim_{tag}");
    exec(&t.db, &format!("CREATE ROLE {role} LOGIN")).await;
    let db = Db::connect(&as_role(&t.url, &role), 1)
        .await
        .expect("connect as the role");
    assert_eq!(
        db.connect_error(Duration::from_secs(5)).await,
        None,
        "a connection can be opened"
    );
    exec(&t.db, &format!("ALTER ROLE {role} CONNECTION LIMIT 0")).await;
    let why = db
        .connect_error(Duration::from_secs(5))
        .await
        .expect("the server refuses a new connection");
    assert!(why.contains("too many connections for role"), "{why}");
    db.pool().close().await;
    exec(&t.db, &format!("DROP ROLE {role}")).await;
}

/// `/readyz`'s report names the server's refusal too: the pool retries a
/// role's connection limit until the readiness check's second runs out, and
/// the report said only that the database "did not answer within 1000 ms"
/// (resource audit).
#[tokio::test]
async fn readiness_names_the_servers_refusal() {
    let t = TestDb::new().await;
    let role = format!("lim_{}", Uuid::new_v4().simple());
    exec(&t.db, &format!("CREATE ROLE {role} LOGIN")).await;
    let db = Db::connect(&as_role(&t.url, &role), 1)
        .await
        .expect("connect as the role");
    // the server takes no more of the role's connections, and ends the one
    // the pool holds
    exec(
        &t.db,
        &format!(
            "ALTER ROLE {role} CONNECTION LIMIT 0;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
        ),
    )
    .await;
    // the first check may meet the ended connection; the next opens one
    let mut reports = Vec::new();
    for _ in 0..3 {
        let (ready, report) = supervisor::metrics::readiness(&db).await;
        assert!(!ready, "{report}");
        if report.contains("database: unreachable: ")
            && report.contains("too many connections for role")
        {
            break;
        }
        reports.push(report);
        assert!(reports.len() < 3, "{reports:?}");
    }
    // the worker's background statements (reclaim, LISTEN, the heartbeat)
    // log the same reason beside a pool's "timed out"
    let timed_out = DbError::Query {
        context: "reclaiming expired leases",
        source: sqlx::Error::PoolTimedOut,
    };
    let why = db
        .server_reason(&timed_out, Duration::from_secs(2))
        .await
        .expect("a reason for a pool that timed out");
    assert!(why.contains("too many connections for role"), "{why}");
    // any other error already says what the server did
    let refused = DbError::Query {
        context: "reclaiming expired leases",
        source: sqlx::Error::RowNotFound,
    };
    assert_eq!(
        db.server_reason(&refused, Duration::from_secs(2)).await,
        None
    );
    db.pool().close().await;
    exec(&t.db, &format!("DROP ROLE {role}")).await;
}

/// A database that takes connections but does not answer the readiness
/// check in time (here: the pool's one connection is held) is "slow or
/// blocked", not "unreachable" (observability audit: a held table lock
/// read as a network fault).
#[tokio::test]
async fn readiness_calls_a_busy_database_slow_not_unreachable() {
    let t = TestDb::new().await;
    let db = Db::connect(&t.url, 1).await.expect("connect");
    let held = db
        .pool()
        .acquire()
        .await
        .expect("the pool's one connection");
    let (ready, report) = supervisor::metrics::readiness(&db).await;
    assert!(!ready, "{report}");
    assert!(report.contains("database: slow or blocked: "), "{report}");
    assert!(!report.contains("unreachable"), "{report}");
    drop(held);
    let (ready, report) = supervisor::metrics::readiness(&db).await;
    assert!(report.contains("database: ok"), "{report}");
    // the worker's other checks (not started here) keep it unready
    let _ = ready;
    db.pool().close().await;
}

/// The connection the readiness check keeps, ended by the server
/// (`pg_terminate_backend`, as a restart does), is not reported as an
/// unreachable database while the server answers: the check tries once
/// more on a new connection (audit 96: `/readyz` said "unreachable:
/// terminating connection due to administrator command").
#[tokio::test]
async fn readiness_is_not_fooled_by_its_own_connection_ended() {
    let t = TestDb::new().await;
    let db = Db::connect(&t.url, 1).await.expect("connect");
    let (_, report) = supervisor::metrics::readiness(&db).await;
    assert!(report.contains("database: ok"), "{report}");
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(db.pool())
        .await
        .expect("pid");
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(t.db.pool())
        .await
        .expect("terminate");
    assert!(ended);
    let (_, report) = supervisor::metrics::readiness(&db).await;
    assert!(report.contains("database: ok"), "{report}");
    db.pool().close().await;
}

/// The README's reader and submitter, granted as it says: a reader reads
/// (`status`) and may not cancel; a submitter submits and cancels; a role
/// with SELECT but not USAGE on the schema is told which GRANTs it needs
/// (security audit: the recipe left USAGE out, said nothing of EXECUTE
/// being PUBLIC's, and the error was only "permission denied for schema").
#[tokio::test]
async fn the_readmes_reader_reads_and_its_submitter_submits_and_cancels() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let (reader, app, bare) = (
        format!("rd_{tag}"),
        format!("app_{tag}"),
        format!("bare_{tag}"),
    );
    exec(
        &t.db,
        &format!(
            "CREATE ROLE {app} LOGIN; GRANT USAGE ON SCHEMA durable TO {app};
             REVOKE EXECUTE ON FUNCTION durable.submit_run(jsonb), durable.cancel_run(uuid, text, text) FROM PUBLIC;
             GRANT EXECUTE ON FUNCTION durable.submit_run(jsonb), durable.cancel_run(uuid, text, text) TO {app};
             CREATE ROLE {reader} LOGIN; GRANT USAGE ON SCHEMA durable TO {reader};
             GRANT SELECT ON ALL TABLES IN SCHEMA durable TO {reader};
             CREATE ROLE {bare} LOGIN; GRANT SELECT ON ALL TABLES IN SCHEMA durable TO {bare};"
        ),
    )
    .await;
    let cli = |role: &str, args: &[&str]| {
        let o = std::process::Command::new(tests::supervisor_bin())
            .args(args)
            .env("DATABASE_URL", as_role(&t.url, role))
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("supervisor");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.code(), said)
    };
    let spec = tempfile::NamedTempFile::new().expect("spec");
    std::fs::write(
        spec.path(),
        json!({"name": "r", "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]})
            .to_string(),
    )
    .expect("write");
    let path = spec.path().to_string_lossy().into_owned();
    let (code, said) = cli(&app, &["submit", &path, "--json"]);
    assert_eq!(code, Some(0), "{said}");
    let run = serde_json::from_str::<serde_json::Value>(said.trim()).expect("json")["run_id"]
        .as_str()
        .expect("run_id")
        .to_owned();

    let (code, said) = cli(&reader, &["status", &run]);
    assert_eq!(code, Some(0), "{said}");
    // each refusal names the grant that command needs, not every role's
    // (audit 98)
    let (code, said) = cli(&reader, &["cancel", &run]);
    assert_eq!(code, Some(1), "a reader may not cancel: {said}");
    assert!(said.contains("permission denied"), "{said}");
    assert!(
        said.contains("GRANT EXECUTE ON FUNCTION durable.submit_run(jsonb), durable.cancel_run(uuid, text, text) TO <role>")
            && !said.contains("SELECT ON ALL TABLES"),
        "{said}"
    );
    let (code, said) = cli(&reader, &["submit", &path]);
    assert_eq!(code, Some(1), "a reader may not submit: {said}");
    assert!(said.contains("GRANT EXECUTE ON FUNCTION"), "{said}");

    // a submitter may not read the run: watch cannot follow it (5, not the
    // run's 1), and its hint names the grants, not the database
    let (code, said) = cli(&app, &["watch", &run, "--plain"]);
    assert_eq!(code, Some(5), "{said}");
    assert!(
        said.contains("this command reads: its role needs USAGE on the schema and SELECT")
            && !said.contains("DATABASE_URL")
            && !said.contains("EXECUTE"),
        "{said}"
    );

    let (code, said) = cli(&bare, &["status", &run]);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("permission denied") && said.contains("USAGE ON SCHEMA durable"),
        "{said}"
    );

    let (code, said) = cli(&app, &["cancel", &run]);
    assert_eq!(code, Some(0), "{said}");
    assert_eq!(
        t.status(run.parse().expect("uuid")).await.state,
        "cancelled"
    );
}

/// `supervisor migrate` as a role that may not create the schema (no CREATE
/// on the database, no schema made for it) says that migrate is the owner's
/// (README "Database roles", steps 1 and 2). Its hint listed the grants of
/// readers, submitters and workers, none of which migrates (deployment
/// audit).
#[tokio::test]
async fn migrate_denied_by_the_database_names_the_owners_step() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let user = format!("mig_{tag}");
    exec(
        &t.db,
        &format!(
            "DROP SCHEMA durable CASCADE;
             CREATE ROLE {user} LOGIN;
             REVOKE CREATE ON DATABASE {name} FROM PUBLIC;",
            name = t.name
        ),
    )
    .await;
    let out = std::process::Command::new(tests::supervisor_bin())
        .arg("migrate")
        .env("DATABASE_URL", as_role(&t.url, &user))
        .output()
        .expect("migrate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    assert!(
        stderr.contains(
            "hint: migrate creates and changes the durable schema: run it as the schema's owner"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("readers need"), "{stderr}");
}

/// `gc` as the worker's role (README "Database roles") removes what it
/// should and reports no VACUUM: only the tables' owner may VACUUM them,
/// PostgreSQL skipped every table with a warning only its log showed, and
/// gc said "VACUUM 1.0 ms", `"vacuumed": true` (retention faults audit).
#[tokio::test]
async fn gc_as_the_worker_role_does_not_claim_a_vacuum() {
    let t = TestDb::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let wrk = format!("gcw_{tag}");
    exec(
        &t.db,
        &format!(
            "CREATE ROLE {wrk} LOGIN; GRANT USAGE ON SCHEMA durable TO {wrk};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA durable TO {wrk};
             GRANT USAGE ON ALL SEQUENCES IN SCHEMA durable TO {wrk};"
        ),
    )
    .await;
    let run = t
        .submit(
            json!({"name": "old", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"}]}),
        )
        .await;
    t.db.cancel(run, None).await.expect("cancel");
    let gc = |url: String| {
        std::process::Command::new(tests::supervisor_bin())
            .args(["gc", "--older-than", "0s", "--json"])
            .env("DATABASE_URL", url)
            .output()
            .expect("gc")
    };
    let out = gc(as_role(&t.url, &wrk));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        (v["runs"].as_u64(), v["vacuumed"].as_bool()),
        (Some(1), Some(false)),
        "{v}"
    );
    // the owner's does
    let run = t
        .submit(
            json!({"name": "old2", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"}]}),
        )
        .await;
    t.db.cancel(run, None).await.expect("cancel");
    let out = gc(t.url.clone());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        (v["runs"].as_u64(), v["vacuumed"].as_bool()),
        (Some(1), Some(true)),
        "{v}"
    );
}
