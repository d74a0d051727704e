//! Read-only queries of the operator's commands (`events`, `runs`, the
//! progress column of `status`) and a connection that explains why it cannot
//! be made. Nothing here writes: these run on any database a user can read.

use std::collections::BTreeMap;
use std::time::Duration as StdDuration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, Row};
use uuid::Uuid;

use super::{redact_url, Ctx, Db, DbError};

/// One progress event of a step attempt, as `supervisor events` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct EventRow {
    pub step: String,
    pub step_run_id: Uuid,
    pub attempt: i32,
    pub sequence: i64,
    pub kind: String,
    pub message: String,
    pub fraction: Option<f64>,
    pub checkpoint: bool,
    /// The executor's own clock, when it sent one.
    pub executor_at: Option<DateTime<Utc>>,
    /// When the supervisor stored it (the database clock).
    pub at: DateTime<Utc>,
}

/// The latest `progress` event of a step (its newest attempt's last).
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub attempt: i32,
    pub sequence: i64,
    pub fraction: Option<f64>,
    pub message: String,
    pub at: DateTime<Utc>,
}

/// What `supervisor runs` selects.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub state: Option<String>,
    pub name: Option<String>,
    /// Only runs created at most this long ago (by the database clock).
    pub since: Option<StdDuration>,
    pub limit: u32,
}

/// One line of `supervisor runs`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub run_id: Uuid,
    pub name: String,
    pub state: String,
    pub cancel_requested: bool,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Step counts by state; `waiting` counts the steps not created yet
    /// (their dependencies have not all succeeded). States with no step are left out.
    pub steps: BTreeMap<String, i64>,
}

/// Why a connection to the database could not be made, in the words an
/// operator needs: what is wrong and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("the database URL {url:?} is not a valid PostgreSQL URL ({message}). Fix DATABASE_URL (or --database-url); the form is postgres://user[:password]@host[:port]/database")]
    BadUrl { url: String, message: String },
    #[error("cannot reach the database at {url}: {cause}. Is PostgreSQL running and accepting connections there? Check DATABASE_URL (or --database-url)")]
    Unreachable { url: String, cause: String },
    #[error("the database at {url} refused the login: {cause}. Check the user and password in DATABASE_URL (or --database-url)")]
    Login { url: String, cause: String },
    #[error("the database server at {url} has no such database: {cause}. Create it (createdb), or fix the database name in DATABASE_URL (or --database-url)")]
    NoSuchDatabase { url: String, cause: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl ConnectError {
    /// A malformed URL is bad input (exit 2); everything else is a runtime error.
    pub fn is_bad_input(&self) -> bool {
        matches!(self, ConnectError::BadUrl { .. })
    }
}

/// How long a diagnostic connection may take before the server counts as unreachable.
const PROBE_TIMEOUT: StdDuration = StdDuration::from_secs(5);

impl Db {
    /// Connects like [`Db::connect`], and when that fails says why in terms
    /// of the URL: unreachable, login refused, no such database, malformed.
    /// With `fail_fast` (the short commands) one direct connection is tried
    /// first, so a server that is down is reported at once instead of after
    /// the pool's acquire timeout; without it (worker, dev) the pool's own
    /// patience is kept and the diagnosis runs only after it gave up.
    pub async fn connect_explained(
        url: &str,
        max_connections: u32,
        fail_fast: bool,
    ) -> Result<Db, ConnectError> {
        let opts: PgConnectOptions =
            url.parse().map_err(|e: sqlx::Error| ConnectError::BadUrl {
                url: redact_url(url),
                message: e.to_string(),
            })?;
        if fail_fast {
            probe(url, &opts).await?;
        }
        match Db::connect(url, max_connections).await {
            Ok(db) => Ok(db),
            Err(e @ DbError::Connect { .. }) => {
                probe(url, &opts).await?;
                Err(ConnectError::Db(e))
            }
            Err(e) => Err(ConnectError::Db(e)),
        }
    }

    /// The progress events of a run (or of its step `step`), in order per
    /// (step, attempt, sequence); steps in their spec order. `NotFound`
    /// names an unknown run or step.
    pub async fn events(&self, run_id: Uuid, step: Option<&str>) -> Result<Vec<EventRow>, DbError> {
        let steps: Vec<String> = self.step_names(run_id).await?;
        if let Some(name) = step {
            if !steps.iter().any(|s| s == name) {
                return Err(DbError::NotFound(format!(
                    "run {run_id} has no step {name:?}; its steps are: {}",
                    steps.join(", ")
                )));
            }
        }
        let rows = sqlx::query(
            "SELECT s.name, e.step_run_id, e.attempt, e.sequence, e.kind, e.message, e.fraction,
                    e.checkpoint, e.executor_at, e.at
               FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id
              WHERE s.run_id = $1 AND ($2::text IS NULL OR s.name = $2)
              ORDER BY s.position, e.attempt, e.sequence",
        )
        .bind(run_id)
        .bind(step)
        .fetch_all(self.pool())
        .await
        .ctx("reading a run's events")?;
        Ok(rows
            .into_iter()
            .map(|r| EventRow {
                step: r.get("name"),
                step_run_id: r.get("step_run_id"),
                attempt: r.get("attempt"),
                sequence: r.get("sequence"),
                kind: r.get("kind"),
                message: r.get("message"),
                fraction: r.get("fraction"),
                checkpoint: r.get("checkpoint"),
                executor_at: r.get("executor_at"),
                at: r.get("at"),
            })
            .collect())
    }

    /// The names of a run's steps (created or waiting), in spec order, or
    /// `NotFound` for an unknown run.
    async fn step_names(&self, run_id: Uuid) -> Result<Vec<String>, DbError> {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM durable.workflow_runs WHERE id = $1)")
                .bind(run_id)
                .fetch_one(self.pool())
                .await
                .ctx("reading a run")?;
        if !exists {
            return Err(DbError::NotFound(format!("unknown run {run_id}")));
        }
        sqlx::query_scalar(
            "SELECT name FROM durable.step_defs WHERE run_id = $1 ORDER BY position, name",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await
        .ctx("reading a run's step names")
    }

    /// Each step's latest `progress` event (of its newest attempt that sent
    /// one), by step_run_id. Steps that never reported progress are absent.
    pub async fn latest_progress(&self, run_id: Uuid) -> Result<BTreeMap<Uuid, Progress>, DbError> {
        let rows = sqlx::query(
            "SELECT DISTINCT ON (e.step_run_id)
                    e.step_run_id, e.attempt, e.sequence, e.fraction, e.message, e.at
               FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id
              WHERE s.run_id = $1 AND e.kind = 'progress'
              ORDER BY e.step_run_id, e.attempt DESC, e.sequence DESC",
        )
        .bind(run_id)
        .fetch_all(self.pool())
        .await
        .ctx("reading a run's latest progress")?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    r.get("step_run_id"),
                    Progress {
                        attempt: r.get("attempt"),
                        sequence: r.get("sequence"),
                        fraction: r.get("fraction"),
                        message: r.get("message"),
                        at: r.get("at"),
                    },
                )
            })
            .collect())
    }

    /// Runs, newest first, with their step counts by state.
    pub async fn runs(&self, filter: &RunFilter) -> Result<Vec<RunSummary>, DbError> {
        let since_ms: Option<i64> = filter
            .since
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let rows = sqlx::query(
            "SELECT r.id, r.name, r.state, r.cancel_requested, r.created_at, r.finished_at,
                    coalesce((SELECT jsonb_object_agg(c.state, c.n)
                                FROM (SELECT s.state, count(*) AS n FROM durable.step_runs s
                                       WHERE s.run_id = r.id GROUP BY s.state) c), '{}'::jsonb) AS steps,
                    (SELECT count(*) FROM durable.step_defs d
                      WHERE d.run_id = r.id
                        AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                         WHERE s.run_id = d.run_id AND s.name = d.name)) AS waiting
               FROM durable.workflow_runs r
              WHERE ($1::text IS NULL OR r.state = $1)
                AND ($2::text IS NULL OR r.name = $2)
                AND ($3::bigint IS NULL OR r.created_at >= now() - $3::bigint * interval '1 millisecond')
              ORDER BY r.created_at DESC, r.id DESC
              LIMIT $4",
        )
        .bind(filter.state.as_deref())
        .bind(filter.name.as_deref())
        .bind(since_ms)
        .bind(i64::from(filter.limit))
        .fetch_all(self.pool())
        .await
        .ctx("listing runs")?;
        rows.into_iter()
            .map(|r| {
                let mut steps: BTreeMap<String, i64> = serde_json::from_value(r.get("steps"))
                    .map_err(|e| DbError::Corrupt(format!("step counts: {e}")))?;
                let waiting: i64 = r.get("waiting");
                if waiting > 0 {
                    steps.insert("waiting".into(), waiting);
                }
                Ok(RunSummary {
                    run_id: r.get("id"),
                    name: r.get("name"),
                    state: r.get("state"),
                    cancel_requested: r.get("cancel_requested"),
                    created_at: r.get("created_at"),
                    finished_at: r.get("finished_at"),
                    steps,
                })
            })
            .collect()
    }
}

/// One direct connection, bounded, to learn why the pool cannot connect.
async fn probe(url: &str, opts: &PgConnectOptions) -> Result<(), ConnectError> {
    let url = redact_url(url);
    let opts = opts
        .clone()
        .log_statements(tracing::log::LevelFilter::Trace);
    match tokio::time::timeout(PROBE_TIMEOUT, sqlx::PgConnection::connect_with(&opts)).await {
        Err(_) => Err(ConnectError::Unreachable {
            url,
            cause: format!("no answer within {} s", PROBE_TIMEOUT.as_secs()),
        }),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(classify(url, e)),
    }
}

fn classify(url: String, e: sqlx::Error) -> ConnectError {
    let cause = e.to_string();
    match &e {
        sqlx::Error::Database(d) => match d.code().as_deref() {
            // invalid_password, invalid_authorization_specification
            Some("28P01") | Some("28000") => ConnectError::Login { url, cause },
            // invalid_catalog_name
            Some("3D000") => ConnectError::NoSuchDatabase { url, cause },
            _ => ConnectError::Unreachable { url, cause },
        },
        sqlx::Error::Configuration(_) => ConnectError::BadUrl {
            url,
            message: cause,
        },
        _ => ConnectError::Unreachable { url, cause },
    }
}
