//! The only module that holds SQL.
//!
//! Every write a worker makes is fenced by its lease token
//! (`WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')`):
//! zero rows means the lease is lost, and the caller discards its outcome
//! (`DbError::LeaseLost`) instead of retrying the write. Only [`Db::lease`]
//! produces a [`Lease`], and only a `Lease` can complete, fail or cancel a step
//! (typestate, as in underway). Transactions are short: none is held while a
//! child runs. Times for leases come from the database clock (`now()`).

mod blobs;
mod inspect;
mod ledger;
mod observe;
mod retention;
pub use blobs::{BlobPlace, BlobRef, Recorded};
pub use inspect::{
    ArtifactInfo, ConnectError, EventRow, Lineage, Progress, RunFilter, RunSummary, WatchRun,
    WatchStep,
};
pub use ledger::{
    Batch, BatchOutcome, CompleteWrite, EventsWrite, OwnedEvent, RowOutcome, StartWrite,
};
pub use observe::QueueDepth;
pub use retention::{
    RetentionBatch, RetentionOptions, RetentionPreview, RetentionReport, BLOB_GARBAGE_AGE,
    RETENTION_TABLES,
};

use std::collections::BTreeMap;
use std::time::Duration as StdDuration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Acquire, ConnectOptions, Executor, PgPool, Row};
use uuid::Uuid;

use crate::retry::RetryPolicy;
use crate::state::{self, Failure, FailureDecision, RunState, StepFacts};

/// NOTIFY channel: a step became leasable (payload: executor_kind).
pub const CHANNEL_STEPS: &str = "durable_steps";
/// NOTIFY channel: cancellation was requested (payload: run id). A hint only:
/// the heartbeat is the path that always sees a cancel.
pub const CHANNEL_CANCEL: &str = "durable_cancel";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to PostgreSQL at {url}: {source}. Is the server running and DATABASE_URL right?")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("database error while {context}: {source}")]
    Query {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    #[error("{0}")]
    NotFound(String),
    #[error("the lease on step {step_run_id} is lost (another owner, expired, or the step moved on); the outcome is discarded")]
    LeaseLost { step_run_id: Uuid },
    /// The database refused one row of a batch (its own subtransaction).
    #[error("the database refused this write ({sqlstate}): {message}")]
    Refused { sqlstate: String, message: String },
    /// A write that could not be done now and may be tried again (the
    /// worker's ledger stopped, or a batch failed as a whole).
    #[error("{context}; the write is retried while the lease allows")]
    Retry { context: &'static str },
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("the database did not answer within {ms} ms while {context}")]
    Timeout { context: &'static str, ms: u64 },
    #[error("the database schema is at version {have}; this binary needs at least {need}. Run `supervisor migrate` with a binary at least this new, then start the worker again")]
    SchemaTooOld { have: i64, need: i64 },
    #[error("the database has no durable schema (no migrations applied). Run `supervisor migrate` first")]
    SchemaMissing,
}

impl DbError {
    /// The SQLSTATE of a database error, if this is one.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            DbError::Query {
                source: sqlx::Error::Database(d),
                ..
            } => d.code().map(|c| c.into_owned()),
            DbError::Refused { sqlstate, .. } => Some(sqlstate.clone()),
            _ => None,
        }
    }

    /// Whether trying the same write again can succeed: lost connections,
    /// timeouts, a server restarting, serialization failures and deadlocks,
    /// lock timeouts, exhausted resources. Everything else (data exceptions,
    /// constraint violations, program limits such as a message too large, our
    /// own raised errors) fails the same way every time: permanent.
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Connect { source, .. } | DbError::Query { source, .. } => {
                sqlx_is_transient(source)
            }
            DbError::Timeout { .. } | DbError::Retry { .. } => true,
            DbError::Refused { sqlstate, .. } => sqlstate_is_transient(sqlstate),
            _ => false,
        }
    }
}

fn sqlx_is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|c| sqlstate_is_transient(&c)),
        _ => false,
    }
}

/// SQLSTATE classes worth a retry: 08 connection, 40 transaction rollback
/// (serialization, deadlock), 53 insufficient resources, 57 operator
/// intervention (admin shutdown, statement timeout), 58 system error, and
/// 55P03 lock_not_available (lock_timeout), 55006 object in use.
pub fn sqlstate_is_transient(code: &str) -> bool {
    ["08", "40", "53", "57", "58"]
        .iter()
        .any(|c| code.starts_with(c))
        || code == "55P03"
        || code == "55006"
}

/// Runs a database call with a bound: no call may wait forever (a blackholed
/// network must not stall the worker past its lease).
pub async fn bounded<T>(
    limit: StdDuration,
    context: &'static str,
    fut: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(DbError::Timeout {
            context,
            ms: limit.as_millis() as u64,
        }),
    }
}

trait Ctx<T> {
    fn ctx(self, context: &'static str) -> Result<T, DbError>;
}

impl<T> Ctx<T> for Result<T, sqlx::Error> {
    fn ctx(self, context: &'static str) -> Result<T, DbError> {
        self.map_err(|source| DbError::Query { context, source })
    }
}

/// A handle on the runtime's database.
#[derive(Clone, Debug)]
pub struct Db {
    pool: PgPool,
}

/// A routing entry: this worker can run steps of `executor_kind` / `kind`
/// whose labels are all offered in `labels`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    pub executor_kind: String,
    pub kind: String,
    pub labels: BTreeMap<String, String>,
}

/// Proof of ownership of one step attempt. Only [`Db::lease`] creates one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    step_run_id: Uuid,
    token: Uuid,
    attempt: u32,
}

impl Lease {
    pub fn step_run_id(&self) -> Uuid {
        self.step_run_id
    }
    pub fn token(&self) -> Uuid {
        self.token
    }
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// A step this worker now owns, with everything needed to run it.
#[derive(Debug, Clone)]
pub struct LeasedStep {
    pub lease: Lease,
    pub run_id: Uuid,
    pub name: String,
    pub executor_kind: String,
    pub kind: String,
    pub labels: BTreeMap<String, String>,
    pub input: serde_json::Value,
    pub idempotency_key: String,
    pub retry: RetryPolicy,
    pub timeout_ms: Option<i64>,
    pub heartbeat_timeout_ms: Option<i64>,
    pub deadline: Option<DateTime<Utc>>,
    pub secrets: Vec<String>,
    pub checkpoint: Option<Vec<u8>>,
    pub cancel_requested: bool,
    /// Whether the step's definition names dependencies (only then can it
    /// have input artifacts to fetch).
    pub has_dependencies: bool,
}

/// What one batched heartbeat learned.
#[derive(Debug, Default)]
pub struct HeartbeatReport {
    /// Leases renewed whose step has a cancel request.
    pub cancel_requested: Vec<Uuid>,
    /// Leases this worker no longer holds.
    pub lost: Vec<Uuid>,
    /// Leases still held but locked by a write in flight: not renewed this time.
    pub busy: Vec<Uuid>,
    /// Leases renewed by this heartbeat (valid until its send time + TTL).
    pub renewed_ids: Vec<Uuid>,
    pub renewed: usize,
}

/// A progress event, as persisted.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub sequence: u64,
    pub kind: &'a str,
    pub message: &'a str,
    pub fraction: Option<f64>,
    pub checkpoint: Option<&'a [u8]>,
    pub executor_at: Option<DateTime<Utc>>,
}

/// An artifact of a successful result whose blob is already stored (see
/// `crate::artifacts`): the commit references it by sha256 and size.
#[derive(Debug, Clone, PartialEq)]
pub struct NewArtifact {
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
    pub derived_from: Vec<Uuid>,
}

/// An input artifact for a step: the output of one of its dependencies.
#[derive(Debug, Clone)]
pub struct InputArtifact {
    pub id: Uuid,
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
    pub step_name: String,
    /// Where its bytes are (read them with `crate::artifacts::ArtifactStore`).
    pub blob: BlobRef,
}

/// A failure as the worker observed it, with the evidence to store.
#[derive(Debug, Clone)]
pub struct FailureReport {
    pub failure: Failure,
    pub message: String,
    pub details: Option<serde_json::Value>,
    pub sequence: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepError {
    pub code: String,
    pub message: String,
    pub retryable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ArtifactSummary {
    pub id: Uuid,
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepStatus {
    pub name: String,
    pub step_run_id: Uuid,
    pub state: String,
    pub attempt: i32,
    pub executor_kind: String,
    pub kind: String,
    pub idempotency_key: String,
    pub cancel_requested: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<StepError>,
    pub events: i64,
    pub artifacts: Vec<ArtifactSummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct WaitingStep {
    pub name: String,
    pub depends_on: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunStatus {
    pub run_id: Uuid,
    pub name: String,
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub cancel_requested: bool,
    pub created_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    pub steps: Vec<StepStatus>,
    /// Steps not created yet: they wait for their dependencies to succeed.
    pub waiting: Vec<WaitingStep>,
}

fn parse_labels(v: serde_json::Value) -> Result<BTreeMap<String, String>, DbError> {
    serde_json::from_value(v).map_err(|e| DbError::Corrupt(format!("labels: {e}")))
}

impl Db {
    /// Connects with a pool of `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Db, DbError> {
        let opts: PgConnectOptions = url.parse().map_err(|source| DbError::Connect {
            url: redact_url(url),
            source,
        })?;
        // no statement waits forever on a lock or runs away (a transient
        // error the callers retry); the heartbeat's own connection is tighter
        let opts = opts
            .log_statements(tracing::log::LevelFilter::Trace)
            .options([("statement_timeout", "60000"), ("lock_timeout", "10000")]);
        // No ping before every acquire (sqlx's default): it costs a round trip
        // per statement batch (~3 per step, measured by bench_queue); a dead
        // connection surfaces as an error on the next statement instead, which
        // every caller already handles (commit retries, the loops retry).
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .test_before_acquire(false)
            .acquire_timeout(StdDuration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(|source| DbError::Connect {
                url: redact_url(url),
                source,
            })?;
        Ok(Db { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A separate pool of one connection to the same database, with
    /// `statement_timeout` and `lock_timeout` of `timeout`: the heartbeat's
    /// own, so a busy pool never delays a renewal. Connects lazily, so a
    /// database that is away at this moment is not an error here.
    pub fn dedicated(&self, timeout: StdDuration) -> Db {
        let ms = timeout.as_millis().max(1).to_string();
        let opts = (*self.pool.connect_options()).clone().options([
            ("statement_timeout", ms.as_str()),
            ("lock_timeout", ms.as_str()),
        ]);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(timeout)
            .connect_lazy_with(opts);
        Db { pool }
    }

    /// The newest migration this binary knows.
    pub fn schema_version_needed() -> i64 {
        MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
    }

    /// Checks that the schema is at least the version this binary needs. A
    /// newer schema is accepted (migrations are additive: rolling upgrades run
    /// new workers and old ones against one database). Returns the version found.
    pub async fn check_schema(&self) -> Result<i64, DbError> {
        let res = sqlx::query_scalar::<_, Option<i64>>(
            "SELECT max(version) FROM durable._sqlx_migrations WHERE success",
        )
        .fetch_one(&self.pool)
        .await;
        let have = match res {
            Ok(v) => v.ok_or(DbError::SchemaMissing)?,
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("42P01") | Some("3F000")) =>
            {
                return Err(DbError::SchemaMissing)
            }
            Err(e) => {
                return Err(DbError::Query {
                    context: "reading the schema version",
                    source: e,
                })
            }
        };
        let need = Self::schema_version_needed();
        if have < need {
            return Err(DbError::SchemaTooOld { have, need });
        }
        Ok(have)
    }

    /// Applies the migrations; safe to run again and from several processes at
    /// once (sqlx takes an advisory lock). The bookkeeping table lives in the
    /// runtime's schema too, not in `public`.
    pub async fn migrate(&self) -> Result<(), DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .ctx("acquiring a connection to migrate")?;
        conn.execute("CREATE SCHEMA IF NOT EXISTS durable")
            .await
            .ctx("creating schema durable")?;
        conn.execute("SET search_path TO durable")
            .await
            .ctx("setting search_path")?;
        let res = MIGRATOR.run(&mut *conn).await;
        // the connection goes back to the pool: restore the default path
        conn.execute("RESET search_path")
            .await
            .ctx("resetting search_path")?;
        res?;
        Ok(())
    }

    // -----------------------------------------------------------------------
    // submit, cancel, status

    /// Validates and submits a spec through `durable.submit_run`. An invalid
    /// spec is `DbError::InvalidSpec` with a message that names the field;
    /// nothing is written then.
    pub async fn submit(&self, spec: &serde_json::Value) -> Result<Uuid, DbError> {
        let res = sqlx::query_scalar::<_, Uuid>("SELECT durable.submit_run($1)")
            .bind(spec)
            .fetch_one(&self.pool)
            .await;
        match res {
            Ok(id) => Ok(id),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22023") => {
                Err(DbError::InvalidSpec(e.message().to_owned()))
            }
            Err(e) => Err(DbError::Query {
                context: "submitting a run",
                source: e,
            }),
        }
    }

    /// Requests cancellation of a run or one of its steps; returns the run's
    /// state afterwards.
    pub async fn cancel(&self, run_id: Uuid, step: Option<&str>) -> Result<RunState, DbError> {
        let res = sqlx::query_scalar::<_, String>("SELECT durable.cancel_run($1, $2)")
            .bind(run_id)
            .bind(step)
            .fetch_one(&self.pool)
            .await;
        match res {
            Ok(s) => s
                .parse()
                .map_err(|e| DbError::Corrupt(format!("run state: {e}"))),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("P0D04") => {
                Err(DbError::NotFound(e.message().to_owned()))
            }
            Err(e) => Err(DbError::Query {
                context: "cancelling",
                source: e,
            }),
        }
    }

    /// The run and its steps, or `NotFound`.
    pub async fn status(&self, run_id: Uuid) -> Result<RunStatus, DbError> {
        let run = sqlx::query(
            "SELECT id, name, state, idempotency_key, cancel_requested, created_at, finished_at
               FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(run_id)
        .fetch_optional(&self.pool)
        .await
        .ctx("reading a run")?
        .ok_or_else(|| DbError::NotFound(format!("unknown run {run_id}")))?;

        let rows = sqlx::query(
            "SELECT s.id, s.name, s.state, s.attempt, s.executor_kind, s.kind, s.idempotency_key,
                    s.cancel_requested, s.next_attempt_at, s.output, s.error_code, s.error_message,
                    s.error_retryable, s.error_details,
                    (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id) AS events
               FROM durable.step_runs s WHERE s.run_id = $1 ORDER BY s.position",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await
        .ctx("reading a run's steps")?;
        let arts = sqlx::query(
            "SELECT id, step_run_id, name, sha256, size, media_type FROM durable.artifacts
              WHERE run_id = $1 ORDER BY created_at, name",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await
        .ctx("reading a run's artifacts")?;

        let mut steps = Vec::with_capacity(rows.len());
        for r in rows {
            let id: Uuid = r.get("id");
            let state: String = r.get("state");
            let code: Option<String> = r.get("error_code");
            let error = code.map(|code| StepError {
                code,
                message: r
                    .get::<Option<String>, _>("error_message")
                    .unwrap_or_default(),
                retryable: r.get::<Option<bool>, _>("error_retryable").unwrap_or(false),
                details: r.get("error_details"),
            });
            let next: Option<DateTime<Utc>> = if state == "retryable_failed" {
                r.get("next_attempt_at")
            } else {
                None
            };
            steps.push(StepStatus {
                name: r.get("name"),
                step_run_id: id,
                state,
                attempt: r.get("attempt"),
                executor_kind: r.get("executor_kind"),
                kind: r.get("kind"),
                idempotency_key: r.get("idempotency_key"),
                cancel_requested: r.get("cancel_requested"),
                next_attempt_at: next,
                output: r.get("output"),
                error,
                events: r.get("events"),
                artifacts: arts
                    .iter()
                    .filter(|a| a.get::<Uuid, _>("step_run_id") == id)
                    .map(|a| ArtifactSummary {
                        id: a.get("id"),
                        name: a.get("name"),
                        sha256: a.get("sha256"),
                        size: a.get("size"),
                        media_type: a.get("media_type"),
                    })
                    .collect(),
            });
        }
        let waiting = sqlx::query(
            "SELECT d.name, d.depends_on FROM durable.step_defs d
              WHERE d.run_id = $1
                AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)
              ORDER BY d.position",
        )
        .bind(run_id)
        .fetch_all(&self.pool)
        .await
        .ctx("reading a run's waiting steps")?
        .into_iter()
        .map(|r| WaitingStep {
            name: r.get("name"),
            depends_on: r.get("depends_on"),
        })
        .collect();

        Ok(RunStatus {
            run_id: run.get("id"),
            name: run.get("name"),
            state: run.get("state"),
            idempotency_key: run.get("idempotency_key"),
            cancel_requested: run.get("cancel_requested"),
            created_at: run.get("created_at"),
            finished_at: run.get("finished_at"),
            steps,
            waiting,
        })
    }

    // -----------------------------------------------------------------------
    // workers

    pub async fn register_worker(
        &self,
        id: Uuid,
        name: &str,
        host: &str,
        capabilities: &serde_json::Value,
    ) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO durable.workers (id, name, host, pid, capabilities) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(id)
        .bind(name)
        .bind(host)
        .bind(std::process::id() as i32)
        .bind(capabilities)
        .execute(&self.pool)
        .await
        .ctx("registering the worker")?;
        Ok(())
    }

    pub async fn worker_stopped(&self, id: Uuid) -> Result<(), DbError> {
        sqlx::query("UPDATE durable.workers SET stopped_at = now() WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .ctx("marking the worker stopped")?;
        Ok(())
    }

    // -----------------------------------------------------------------------
    // the queue

    /// Leases up to `limit` steps this worker can route, in one statement:
    /// `pending` ones, and `retryable_failed` ones whose time has come. Sets the
    /// owner, a fresh lease token and an expiry on the database clock, and
    /// counts the attempt.
    pub async fn lease(
        &self,
        worker_id: Uuid,
        worker_name: &str,
        routes: &[Route],
        limit: u32,
        ttl: StdDuration,
    ) -> Result<Vec<LeasedStep>, DbError> {
        if routes.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let eks: Vec<&str> = routes.iter().map(|r| r.executor_kind.as_str()).collect();
        let kinds: Vec<&str> = routes.iter().map(|r| r.kind.as_str()).collect();
        let labels: Vec<serde_json::Value> = routes
            .iter()
            .map(|r| serde_json::to_value(&r.labels).unwrap_or_default())
            .collect();
        let rows = sqlx::query(
            "WITH routes AS (
                 SELECT * FROM unnest($3::text[], $4::text[], $5::jsonb[]) AS r(executor_kind, kind, labels)
             ), candidates AS (
                 -- one ordered scan of the routing index per route, stopping
                 -- after `limit` rows: the cost does not grow with the backlog
                 -- nor with ready steps of kinds this worker cannot run
                 SELECT c.id FROM routes r
                 CROSS JOIN LATERAL (
                     SELECT s.id, s.next_attempt_at FROM durable.step_runs s
                      WHERE s.executor_kind = r.executor_kind AND s.kind = r.kind
                        AND s.state IN ('pending', 'retryable_failed')
                        AND s.next_attempt_at <= now()
                        AND r.labels @> s.labels
                        AND NOT s.cancel_requested
                        AND NOT EXISTS (SELECT 1 FROM durable.workflow_runs wr
                                         WHERE wr.id = s.run_id AND wr.cancel_requested)
                      ORDER BY s.next_attempt_at
                      LIMIT $6
                      FOR NO KEY UPDATE OF s SKIP LOCKED
                 ) c
                 ORDER BY c.next_attempt_at
                 LIMIT $6
             )
             UPDATE durable.step_runs s
                SET state = 'leased', owner_worker_id = $1, lease_token = gen_random_uuid(),
                    lease_expires_at = now() + make_interval(secs => $7::double precision / 1000.0),
                    leased_at = now(), started_at = NULL, attempt = s.attempt + 1,
                    transition_reason = 'LEASED', transition_by = $2
               FROM candidates c
              WHERE s.id = c.id
          RETURNING s.id, s.run_id, s.name, s.executor_kind, s.kind, s.labels, s.input, s.idempotency_key,
                    s.attempt, s.lease_token, s.retry, s.timeout_ms, s.heartbeat_timeout_ms, s.deadline,
                    s.secrets, s.checkpoint, s.cancel_requested,
                    EXISTS (SELECT 1 FROM durable.step_defs d
                             WHERE d.run_id = s.run_id AND d.name = s.name
                               AND cardinality(d.depends_on) > 0) AS has_dependencies",
        )
        .bind(worker_id)
        .bind(worker_name)
        .bind(&eks)
        .bind(&kinds)
        .bind(&labels)
        .bind(limit as i64)
        .bind(ttl.as_millis() as f64)
        .fetch_all(&self.pool)
        .await
        .ctx("leasing steps")?;
        rows.into_iter().map(leased_from_row).collect()
    }

    /// One statement per worker per interval, however many leases it holds:
    /// renews every live lease, reports which were cancel-requested (the step's
    /// flag or its run's) and which are lost, and stamps the worker's own
    /// heartbeat. Rows locked by a writer right now are skipped (SKIP LOCKED,
    /// in id order), so the heartbeat never waits on a lock and is never part
    /// of a deadlock; such a lease is `busy`: neither renewed nor lost this
    /// time (its owner's write is in flight; the next heartbeat renews it).
    pub async fn heartbeat(
        &self,
        worker_id: Uuid,
        leases: &[Lease],
        ttl: StdDuration,
    ) -> Result<HeartbeatReport, DbError> {
        let ids: Vec<Uuid> = leases.iter().map(|l| l.step_run_id).collect();
        let tokens: Vec<Uuid> = leases.iter().map(|l| l.token).collect();
        let rows = sqlx::query(
            "WITH w AS (
                 UPDATE durable.workers SET last_heartbeat_at = now() WHERE id = $1
             ), h AS (
                 SELECT * FROM unnest($2::uuid[], $3::uuid[]) AS h(id, token)
             ), locked AS (
                 SELECT s.id FROM durable.step_runs s JOIN h ON h.id = s.id AND h.token = s.lease_token
                  WHERE s.state IN ('leased', 'running')
                  ORDER BY s.id
                  FOR NO KEY UPDATE OF s SKIP LOCKED
             ), renewed AS (
                 UPDATE durable.step_runs s
                    SET lease_expires_at = now() + make_interval(secs => $4::double precision / 1000.0)
                   FROM locked
                  WHERE s.id = locked.id
              RETURNING s.id, s.run_id, s.cancel_requested
             )
             SELECT h.id,
                    r.id IS NOT NULL AS renewed,
                    coalesce(r.cancel_requested OR wr.cancel_requested, false) AS cancel_requested,
                    (r.id IS NULL AND EXISTS (SELECT 1 FROM durable.step_runs s
                                               WHERE s.id = h.id AND s.lease_token = h.token
                                                 AND s.state IN ('leased', 'running'))) AS busy
               FROM h
               LEFT JOIN renewed r ON r.id = h.id
               LEFT JOIN durable.workflow_runs wr ON wr.id = r.run_id",
        )
        .bind(worker_id)
        .bind(&ids)
        .bind(&tokens)
        .bind(ttl.as_millis() as f64)
        .fetch_all(&self.pool)
        .await
        .ctx("renewing leases")?;
        let mut report = HeartbeatReport::default();
        for r in rows {
            let id: Uuid = r.get("id");
            if r.get::<bool, _>("renewed") {
                report.renewed_ids.push(id);
                if r.get::<bool, _>("cancel_requested") {
                    report.cancel_requested.push(id);
                }
            } else if r.get::<bool, _>("busy") {
                report.busy.push(id);
            } else {
                report.lost.push(id);
            }
        }
        report.renewed = report.renewed_ids.len();
        Ok(report)
    }

    /// The executor accepted the job: `leased → running`, with its event.
    pub async fn mark_running(
        &self,
        lease: &Lease,
        worker_name: &str,
        executor_pid: i32,
        event: &NewEvent<'_>,
    ) -> Result<(), DbError> {
        let started: bool =
            sqlx::query_scalar("SELECT durable.start_step($1, $2, $3, $4, $5, $6, $7, $8, $9)")
                .bind(lease.step_run_id)
                .bind(lease.token)
                .bind(worker_name)
                .bind(executor_pid)
                .bind(event.sequence as i64)
                .bind(event.kind)
                .bind(event.message)
                .bind(event.fraction)
                .bind(event.executor_at)
                .fetch_one(&self.pool)
                .await
                .ctx("marking a step running")?;
        fenced(u64::from(started), lease)
    }

    /// Persists a progress event (and its checkpoint, if any), fenced.
    pub async fn record_event(&self, lease: &Lease, event: &NewEvent<'_>) -> Result<(), DbError> {
        self.record_events(lease, std::slice::from_ref(event)).await
    }

    /// Persists a batch of one attempt's progress events in one statement,
    /// fenced by the lease. Idempotent (a retried batch inserts nothing twice).
    /// The step row is rewritten only when the batch carries a checkpoint (the
    /// last one wins); plain events only read it for the fence.
    pub async fn record_events(
        &self,
        lease: &Lease,
        events: &[NewEvent<'_>],
    ) -> Result<(), DbError> {
        if events.is_empty() {
            return Ok(());
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.sequence as i64).collect();
        let kinds: Vec<&str> = events.iter().map(|e| e.kind).collect();
        let msgs: Vec<&str> = events.iter().map(|e| e.message).collect();
        let fracs: Vec<Option<f64>> = events.iter().map(|e| e.fraction).collect();
        let cps: Vec<bool> = events.iter().map(|e| e.checkpoint.is_some()).collect();
        let ats: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.executor_at).collect();
        let checkpoint = events.iter().rev().find_map(|e| e.checkpoint);
        let fence = if checkpoint.is_some() {
            "UPDATE durable.step_runs SET checkpoint = $3
              WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')
          RETURNING id, attempt"
        } else {
            "SELECT id, attempt FROM durable.step_runs
              WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running') AND $3::bytea IS NULL"
        };
        let sql = format!(
            "WITH s AS ({fence}), ins AS (
                 INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint, executor_at)
                 SELECT s.id, s.attempt, e.seq, e.kind, e.msg, e.frac, e.cp, e.at
                   FROM s, unnest($4::bigint[], $5::text[], $6::text[], $7::float8[], $8::bool[], $9::timestamptz[])
                        AS e(seq, kind, msg, frac, cp, at)
                 ON CONFLICT DO NOTHING
             )
             SELECT count(*) FROM s"
        );
        let n: i64 = sqlx::query_scalar(&sql)
            .bind(lease.step_run_id)
            .bind(lease.token)
            .bind(checkpoint)
            .bind(&seqs)
            .bind(&kinds)
            .bind(&msgs)
            .bind(&fracs)
            .bind(&cps)
            .bind(&ats)
            .fetch_one(&self.pool)
            .await
            .ctx("recording progress events")?;
        fenced(n.max(0) as u64, lease)
    }

    /// The attempt succeeded: records its artifacts (whose blobs are already
    /// stored: no bytes travel here), lineage, the terminal event and the
    /// output, and moves `running → succeeded` — one short transaction,
    /// fenced (`durable.complete_step_stored`). The run is recomputed (and
    /// dependents created) by the database in the same transaction.
    pub async fn complete(
        &self,
        lease: &Lease,
        worker_name: &str,
        output: &serde_json::Value,
        artifacts: &[NewArtifact],
        sequence: Option<u64>,
    ) -> Result<Vec<Uuid>, DbError> {
        let names: Vec<&str> = artifacts.iter().map(|a| a.name.as_str()).collect();
        let shas: Vec<&str> = artifacts.iter().map(|a| a.sha256.as_str()).collect();
        let media: Vec<&str> = artifacts.iter().map(|a| a.media_type.as_str()).collect();
        let sizes: Vec<i64> = artifacts.iter().map(|a| a.size).collect();
        let derived = serde_json::Value::Array(
            artifacts
                .iter()
                .map(|a| serde_json::json!(a.derived_from))
                .collect(),
        );
        let ids: Option<Vec<Uuid>> = sqlx::query_scalar(
            "SELECT durable.complete_step_stored($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(output)
        .bind(sequence.map(|s| s as i64))
        .bind(&names)
        .bind(&shas)
        .bind(&sizes)
        .bind(&media)
        .bind(&derived)
        .fetch_one(&self.pool)
        .await
        .ctx("completing a step")?;
        ids.ok_or(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })
    }

    /// The attempt failed: the state module decides retry, terminal failure or
    /// cancellation from the row's current facts; fenced.
    pub async fn fail(
        &self,
        lease: &Lease,
        worker_name: &str,
        report: &FailureReport,
        jitter: f64,
    ) -> Result<FailureDecision, DbError> {
        let mut tx = begin_step_write(&self.pool, lease.step_run_id).await?;
        let row = sqlx::query(
            "SELECT attempt - uncounted_attempts AS counted, retry, deadline, cancel_requested, now() AS db_now
               FROM durable.step_runs
              WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running') FOR NO KEY UPDATE",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .fetch_optional(&mut *tx)
        .await
        .ctx("locking a step to fail it")?
        .ok_or(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })?;
        let policy: RetryPolicy = serde_json::from_value(row.get("retry"))
            .map_err(|e| DbError::Corrupt(format!("retry policy: {e}")))?;
        let facts = StepFacts {
            attempt: row.get::<i32, _>("counted").max(0) as u32,
            policy: &policy,
            deadline: row.get("deadline"),
            cancel_requested: row.get("cancel_requested"),
        };
        let decision = state::decide_failure(&facts, &report.failure, row.get("db_now"), jitter);
        if let Some(seq) = report.sequence {
            insert_terminal_event(&mut tx, lease, seq, decision.to.as_str(), &report.message)
                .await?;
        }
        write_failure(&mut tx, lease, worker_name, report, &decision).await?;
        tx.commit().await.ctx("committing a failure")?;
        Ok(decision)
    }

    /// Cancellation is confirmed and the executor has exited: `→ cancelled`.
    pub async fn confirm_cancelled(
        &self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        let mut tx = begin_step_write(&self.pool, lease.step_run_id).await?;
        let n = sqlx::query(
            "UPDATE durable.step_runs
                SET state = 'cancelled', error_code = 'CANCELLED', error_message = $4,
                    error_retryable = false, transition_reason = 'CANCELLED', transition_by = $3
              WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(message)
        .execute(&mut *tx)
        .await
        .ctx("confirming a cancellation")?
        .rows_affected();
        fenced(n, lease)?;
        tx.commit().await.ctx("committing a cancellation")
    }

    /// The executor refused the job before executing it (routing mismatch, or
    /// a retryable error before `accepted`): nothing ran, so the attempt is
    /// given back and the step goes back to the queue after `delay`. Refusals
    /// are counted; the `max_refusals`-th ends the step `terminal_failed`
    /// (`EXECUTOR_REFUSED`) instead of looping forever. A step with a cancel
    /// request (its own or its run's) is never leased again, so its refusal
    /// ends it `cancelled`. Returns the state the step is in now.
    pub async fn refuse(
        &self,
        lease: &Lease,
        worker_name: &str,
        code: &str,
        message: &str,
        delay: StdDuration,
        max_refusals: u32,
    ) -> Result<String, DbError> {
        let mut tx = begin_step_write(&self.pool, lease.step_run_id).await?;
        // a step with a cancel request (its own or its run's) is never leased
        // again: a refusal ends it cancelled instead of back in the queue
        let state: Option<String> = sqlx::query_scalar(
            "UPDATE durable.step_runs s
                SET state = CASE WHEN c.cancel THEN 'cancelled'
                                 WHEN s.refusals + 1 >= $7 THEN 'terminal_failed' ELSE 'retryable_failed' END,
                    refusals = s.refusals + 1,
                    attempt = CASE WHEN c.cancel THEN s.attempt ELSE s.attempt - 1 END,
                    next_attempt_at = now() + make_interval(secs => $6::double precision / 1000.0),
                    error_code = CASE WHEN c.cancel THEN 'CANCELLED'
                                      WHEN s.refusals + 1 >= $7 THEN 'EXECUTOR_REFUSED' ELSE $4 END,
                    error_message = CASE WHEN c.cancel
                        THEN 'cancellation was requested; the executor refused the job before running it (' || $4 || ': ' || $5 || ')'
                        WHEN s.refusals + 1 >= $7
                        THEN 'refused ' || (s.refusals + 1) || ' times (max_refusals = ' || $7 || '); last: ' || $4 || ': ' || $5
                        ELSE $5 END,
                    error_retryable = NOT c.cancel AND s.refusals + 1 < $7, error_details = NULL,
                    owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
                    lease_token = CASE WHEN c.cancel THEN s.lease_token END,
                    transition_reason = CASE WHEN c.cancel THEN 'CANCEL_REQUESTED (' || $4 || ')'
                                             WHEN s.refusals + 1 >= $7 THEN 'REFUSALS_EXHAUSTED' ELSE $4 END,
                    transition_by = $3
               FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel
                       FROM durable.step_runs s2 JOIN durable.workflow_runs r ON r.id = s2.run_id
                      WHERE s2.id = $1) c
              WHERE s.id = c.id AND s.lease_token = $2 AND s.state = 'leased'
          RETURNING s.state",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(code)
        .bind(message)
        .bind(delay.as_millis() as f64)
        .bind(max_refusals.max(1) as i32)
        .fetch_optional(&mut *tx)
        .await
        .ctx("returning a refused step")?;
        let state = state.ok_or(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })?;
        tx.commit().await.ctx("committing a refusal")?;
        Ok(state)
    }

    /// A draining worker stopped the attempt (drain timeout): the step goes
    /// back to the queue at once and the attempt does not count against
    /// `max_attempts` (a routine redeploy must not burn attempts). A step with
    /// a cancel request (its own or its run's) is cancelled instead. Fenced.
    pub async fn release(
        &self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        let mut tx = begin_step_write(&self.pool, lease.step_run_id).await?;
        let n = sqlx::query(
            "UPDATE durable.step_runs s
                SET state = CASE WHEN c.cancel THEN 'cancelled' ELSE 'retryable_failed' END,
                    uncounted_attempts = s.uncounted_attempts + CASE WHEN c.cancel THEN 0 ELSE 1 END,
                    next_attempt_at = now(),
                    error_code = CASE WHEN c.cancel THEN 'CANCELLED' ELSE 'WORKER_SHUTDOWN' END,
                    error_message = $4, error_retryable = NOT c.cancel, error_details = NULL,
                    owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
                    lease_token = CASE WHEN c.cancel THEN s.lease_token END,
                    transition_reason = CASE WHEN c.cancel THEN 'CANCEL_REQUESTED (WORKER_SHUTDOWN)' ELSE 'RELEASED' END,
                    transition_by = $3
               FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel
                       FROM durable.step_runs s2 JOIN durable.workflow_runs r ON r.id = s2.run_id
                      WHERE s2.id = $1) c
              WHERE s.id = c.id AND s.lease_token = $2 AND s.state IN ('leased', 'running')",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(message)
        .execute(&mut *tx)
        .await
        .ctx("releasing a step")?
        .rows_affected();
        fenced(n, lease)?;
        tx.commit().await.ctx("committing a release")
    }

    /// Moves expired leases on: `retryable_failed`, `terminal_failed` when
    /// attempts are spent (or no retry fits before the deadline), `cancelled`
    /// when cancellation was requested — reason `LEASE_EXPIRED`. Returns how
    /// many were reclaimed.
    pub async fn reclaim_expired(&self, worker_name: &str, limit: u32) -> Result<usize, DbError> {
        let candidates: Vec<Uuid> = sqlx::query_scalar(
            "SELECT id FROM durable.step_runs
              WHERE state IN ('leased', 'running') AND lease_expires_at < now()
              ORDER BY lease_expires_at
              LIMIT $1",
        )
        .bind(limit as i64)
        .fetch_all(&self.pool)
        .await
        .ctx("finding expired leases")?;
        let mut reclaimed = 0;
        for id in candidates {
            // run lock first, like every step write; then the step, skipping
            // one another worker is reclaiming or its owner is writing right now
            let mut tx = begin_step_write(&self.pool, id).await?;
            let row = sqlx::query(
                "SELECT id, lease_token, attempt, attempt - uncounted_attempts AS counted, retry, deadline,
                        cancel_requested, now() AS db_now
                   FROM durable.step_runs
                  WHERE id = $1 AND state IN ('leased', 'running') AND lease_expires_at < now()
                  FOR NO KEY UPDATE SKIP LOCKED",
            )
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .ctx("locking an expired lease")?;
            let Some(row) = row else {
                continue;
            };
            let lease = Lease {
                step_run_id: row.get("id"),
                token: row.get("lease_token"),
                attempt: row.get::<i32, _>("attempt").max(0) as u32,
            };
            let policy: RetryPolicy = serde_json::from_value(row.get("retry"))
                .map_err(|e| DbError::Corrupt(format!("retry policy: {e}")))?;
            let facts = StepFacts {
                attempt: row.get::<i32, _>("counted").max(0) as u32,
                policy: &policy,
                deadline: row.get("deadline"),
                cancel_requested: row.get("cancel_requested"),
            };
            let report = FailureReport {
                failure: Failure {
                    code: "LEASE_EXPIRED".into(),
                    retryable: true,
                    next_retry_delay: None,
                },
                message: "the owning worker stopped renewing its lease".into(),
                details: None,
                sequence: None,
            };
            let decision =
                state::decide_failure(&facts, &report.failure, row.get("db_now"), rand::random());
            write_failure(&mut tx, &lease, worker_name, &report, &decision).await?;
            tx.commit().await.ctx("committing a reclaim")?;
            reclaimed += 1;
        }
        Ok(reclaimed)
    }

    /// The artifacts a step receives as input: those of its dependencies, in
    /// `depends_on` order.
    pub async fn input_artifacts(
        &self,
        run_id: Uuid,
        step_name: &str,
    ) -> Result<Vec<InputArtifact>, DbError> {
        let rows = sqlx::query(&format!(
            "SELECT a.id, a.name, a.sha256, a.size, a.media_type, s.name AS step_name, {}
               FROM durable.step_defs d
               JOIN durable.step_runs s ON s.run_id = d.run_id AND s.name = ANY (d.depends_on)
               JOIN durable.artifacts a ON a.step_run_id = s.id
               JOIN durable.artifact_blobs b ON b.sha256 = a.sha256
              WHERE d.run_id = $1 AND d.name = $2
              ORDER BY array_position(d.depends_on, s.name), a.name",
            blobs::BLOB_COLUMNS
        ))
        .bind(run_id)
        .bind(step_name)
        .fetch_all(&self.pool)
        .await
        .ctx("reading input artifacts")?;
        rows.iter()
            .map(|r| {
                Ok(InputArtifact {
                    id: r.get("id"),
                    name: r.get("name"),
                    sha256: r.get("sha256"),
                    size: r.get("size"),
                    media_type: r.get("media_type"),
                    step_name: r.get("step_name"),
                    blob: blobs::blob_ref(r)?,
                })
            })
            .collect()
    }

    /// How many runs are pending or running.
    pub async fn open_runs(&self) -> Result<i64, DbError> {
        sqlx::query_scalar(
            "SELECT count(*) FROM durable.workflow_runs WHERE state IN ('pending', 'running')",
        )
        .fetch_one(&self.pool)
        .await
        .ctx("counting open runs")
    }

    /// A dedicated listener for the wake-up channels.
    pub async fn listener(&self) -> Result<sqlx::postgres::PgListener, DbError> {
        let mut l = sqlx::postgres::PgListener::connect_with(&self.pool)
            .await
            .ctx("opening a LISTEN connection")?;
        l.listen_all([CHANNEL_STEPS, CHANNEL_CANCEL])
            .await
            .ctx("listening for wake-ups")?;
        Ok(l)
    }
}

/// Begins a single-step write: locks the step's run row first. Every writer
/// that changes a step's state takes the run lock before the step lock (the
/// triggers recompute the run), so concurrent completions, cancels and reclaims
/// in one run serialise instead of deadlocking.
async fn begin_step_write(
    pool: &PgPool,
    step_run_id: Uuid,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, DbError> {
    let mut tx = pool.begin().await.ctx("beginning a step write")?;
    sqlx::query(
        "SELECT 1 FROM durable.workflow_runs
          WHERE id = (SELECT run_id FROM durable.step_runs WHERE id = $1) FOR NO KEY UPDATE",
    )
    .bind(step_run_id)
    .execute(&mut *tx)
    .await
    .ctx("locking the step's run")?;
    Ok(tx)
}

fn fenced(rows: u64, lease: &Lease) -> Result<(), DbError> {
    if rows == 0 {
        Err(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })
    } else {
        Ok(())
    }
}

async fn insert_terminal_event(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    lease: &Lease,
    sequence: u64,
    kind: &str,
    message: &str,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind(lease.step_run_id)
    .bind(lease.attempt as i32)
    .bind(sequence as i64)
    .bind(kind)
    .bind(message)
    .execute(&mut **tx)
    .await
    .ctx("recording a terminal event")?;
    Ok(())
}

async fn write_failure(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    lease: &Lease,
    worker_name: &str,
    report: &FailureReport,
    decision: &FailureDecision,
) -> Result<(), DbError> {
    let conn = tx.acquire().await.ctx("using the transaction")?;
    let n = sqlx::query(
        "UPDATE durable.step_runs
            SET state = $3, next_attempt_at = coalesce($4, next_attempt_at),
                error_code = $5, error_message = $6, error_retryable = $7, error_details = $8,
                owner_worker_id = CASE WHEN $3 = 'retryable_failed' THEN NULL ELSE owner_worker_id END,
                transition_reason = $9, transition_by = $10
          WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')",
    )
    .bind(lease.step_run_id)
    .bind(lease.token)
    .bind(decision.to.as_str())
    .bind(decision.next_attempt_at)
    .bind(&report.failure.code)
    .bind(&report.message)
    .bind(report.failure.retryable)
    .bind(&report.details)
    .bind(&decision.reason)
    .bind(worker_name)
    .execute(&mut *conn)
    .await
    .ctx("failing a step")?
    .rows_affected();
    fenced(n, lease)
}

fn leased_from_row(r: sqlx::postgres::PgRow) -> Result<LeasedStep, DbError> {
    let retry: RetryPolicy = serde_json::from_value(r.get("retry"))
        .map_err(|e| DbError::Corrupt(format!("retry policy: {e}")))?;
    Ok(LeasedStep {
        lease: Lease {
            step_run_id: r.get("id"),
            token: r.get("lease_token"),
            attempt: r.get::<i32, _>("attempt").max(0) as u32,
        },
        run_id: r.get("run_id"),
        name: r.get("name"),
        executor_kind: r.get("executor_kind"),
        kind: r.get("kind"),
        labels: parse_labels(r.get("labels"))?,
        input: r.get("input"),
        idempotency_key: r.get("idempotency_key"),
        retry,
        timeout_ms: r.get("timeout_ms"),
        heartbeat_timeout_ms: r.get("heartbeat_timeout_ms"),
        deadline: r.get("deadline"),
        secrets: r.get("secrets"),
        checkpoint: r.get("checkpoint"),
        cancel_requested: r.get("cancel_requested"),
        has_dependencies: r.get("has_dependencies"),
    })
}

/// A database URL with its password replaced, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(super::redact_url("postgres://u@h/db"), "postgres://u@h/db");
    }
}
