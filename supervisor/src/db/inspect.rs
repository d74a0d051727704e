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

use super::blobs::{blob_ref, BlobRef, BLOB_COLUMNS};
use super::{redact_url, Ctx, Db, DbConn, DbError, Scope};

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
    #[serde(serialize_with = "crate::json::utc_micros_opt")]
    pub executor_at: Option<DateTime<Utc>>,
    /// When the supervisor stored it (the database clock).
    #[serde(serialize_with = "crate::json::utc_micros")]
    pub at: DateTime<Utc>,
}

/// The latest `progress` event of a step (its newest attempt's last).
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    pub attempt: i32,
    pub sequence: i64,
    pub fraction: Option<f64>,
    pub message: String,
    #[serde(serialize_with = "crate::json::utc_micros")]
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
    /// Only runs listed after this one (older: `created_at`, then id): the
    /// next page, keyed by the last run of the one before.
    pub before: Option<Uuid>,
}

/// One line of `supervisor runs`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub run_id: Uuid,
    pub name: String,
    pub state: String,
    pub cancel_requested: bool,
    #[serde(serialize_with = "crate::json::utc_micros")]
    pub created_at: DateTime<Utc>,
    #[serde(serialize_with = "crate::json::utc_micros_opt")]
    pub finished_at: Option<DateTime<Utc>>,
    /// Step counts by state; `waiting` counts the steps not created yet
    /// (their dependencies have not all succeeded). States with no step are left out.
    pub steps: BTreeMap<String, i64>,
}

/// Why a connection to the database could not be made, in the words an
/// operator needs: what is wrong and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("the database URL {url:?} is not a valid PostgreSQL URL ({message}). Fix DATABASE_URL (or --database-url, or a worker config's database_url and its DURABLE_DATABASE_URL override); the form is postgres://user[:password]@host[:port]/database")]
    BadUrl { url: String, message: String },
    #[error("cannot reach the database at {url}: {cause}. Is PostgreSQL running and accepting connections there? Check DATABASE_URL (or --database-url)")]
    Unreachable { url: String, cause: String },
    #[error("the database at {url} refused the login: {cause}. Check the user and password in DATABASE_URL (or --database-url)")]
    Login { url: String, cause: String },
    #[error("the database server at {url} has no such database: {cause}. Create it (createdb), or fix the database name in DATABASE_URL (or --database-url)")]
    NoSuchDatabase { url: String, cause: String },
    #[error("the TLS connection to the database at {url} failed: {cause}. With sslmode=verify-ca or verify-full the server's certificate must be signed by a CA in the system's store or in sslrootcert=FILE (a URL parameter); sslmode=require encrypts without checking it; the server must have ssl = on")]
    Tls { url: String, cause: String },
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
        // read lossily from an environment variable that is not UTF-8
        if url.contains(char::REPLACEMENT_CHARACTER) {
            return Err(ConnectError::BadUrl {
                url: redact_url(url),
                message: "it is not valid UTF-8 (each byte that is not text shows as \u{fffd})"
                    .into(),
            });
        }
        if let Some((scheme, _)) = url.split_once("://") {
            if !matches!(scheme, "postgres" | "postgresql") {
                return Err(ConnectError::BadUrl {
                    url: redact_url(url),
                    message: format!(
                        "the scheme is {scheme:?}: a PostgreSQL URL starts with postgres:// or postgresql://"
                    ),
                });
            }
        }
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
    pub async fn events(
        &self,
        run_id: Uuid,
        step: Option<&str>,
        last: Option<u32>,
    ) -> Result<Vec<EventRow>, DbError> {
        self.connection("reading a run")
            .await?
            .conn()
            .events(run_id, step, last)
            .await
    }

    /// Every progress event of a run (or of its step `step`), in the order
    /// of [`Db::events`], handed to `each` as it comes from the server
    /// (until `each` says stop): a run of 600,000 events was read whole
    /// into memory first (526 MB; `events | head` waited for all of it;
    /// audit of the operator's tools). Returns how many were handed.
    pub async fn for_each_event(
        &self,
        run_id: Uuid,
        step: Option<&str>,
        each: impl FnMut(EventRow) -> bool,
    ) -> Result<u64, DbError> {
        self.connection("reading a run")
            .await?
            .conn()
            .for_each_event(run_id, step, each)
            .await
    }

    /// Each step's latest `progress` event (of its newest attempt that sent
    /// one), by step_run_id. Steps that never reported progress are absent.
    pub async fn latest_progress(&self, run_id: Uuid) -> Result<BTreeMap<Uuid, Progress>, DbError> {
        self.connection("reading a run's latest progress")
            .await?
            .conn()
            .latest_progress(run_id)
            .await
    }

    /// Runs, newest first, with their step counts by state.
    pub async fn runs(&self, filter: &RunFilter) -> Result<(Vec<RunSummary>, bool), DbError> {
        self.connection("listing runs")
            .await?
            .conn()
            .runs(filter)
            .await
    }
}

impl DbConn<'_> {
    /// The progress events of a run (or of its step `step`), in order per
    /// (step, attempt, sequence); steps in their spec order; with `last`,
    /// only the last that many of that order. `NotFound` names an unknown
    /// run or step.
    pub async fn events(
        &mut self,
        run_id: Uuid,
        step: Option<&str>,
        last: Option<u32>,
    ) -> Result<Vec<EventRow>, DbError> {
        let Some(last) = last else {
            let mut all = Vec::new();
            self.for_each_event(run_id, step, |e| {
                all.push(e);
                true
            })
            .await?;
            return Ok(all);
        };
        let mut s = Scope::enter(self.conn).await?;
        check_step_named(&mut s, run_id, step).await?;
        // the newest `last` read backwards (by the index of each step's
        // events), then put in order
        let rows = sqlx::query(
            "SELECT * FROM (
                 SELECT s.name, s.position, e.step_run_id, e.attempt, e.sequence, e.kind, e.message,
                        e.fraction, e.checkpoint, e.executor_at, e.at
                   FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id
                  WHERE s.run_id = $1 AND ($2::text IS NULL OR s.name = $2)
                  ORDER BY s.position DESC, e.attempt DESC, e.sequence DESC
                  LIMIT $3) x
              ORDER BY x.position, x.attempt, x.sequence",
        )
        .bind(run_id)
        .bind(step)
        .bind(i64::from(last))
        .fetch_all(&mut *s)
        .await
        .ctx("reading a run's events")?;
        s.done().await?;
        Ok(rows.iter().map(event_row).collect())
    }

    /// See [`Db::for_each_event`].
    pub async fn for_each_event(
        &mut self,
        run_id: Uuid,
        step: Option<&str>,
        mut each: impl FnMut(EventRow) -> bool,
    ) -> Result<u64, DbError> {
        use futures::TryStreamExt;
        let mut s = Scope::enter(self.conn).await?;
        check_step_named(&mut s, run_id, step).await?;
        let mut handed = 0;
        {
            let mut rows = sqlx::query(
                "SELECT s.name, s.position, e.step_run_id, e.attempt, e.sequence, e.kind, e.message,
                        e.fraction, e.checkpoint, e.executor_at, e.at
                   FROM durable.step_events e JOIN durable.step_runs s ON s.id = e.step_run_id
                  WHERE s.run_id = $1 AND ($2::text IS NULL OR s.name = $2)
                  ORDER BY s.position, e.attempt, e.sequence",
            )
            .bind(run_id)
            .bind(step)
            .fetch(&mut *s);
            while let Some(r) = rows.try_next().await.ctx("reading a run's events")? {
                handed += 1;
                if !each(event_row(&r)) {
                    return Ok(handed);
                }
            }
        }
        s.done().await?;
        Ok(handed)
    }

    /// Each step's latest `progress` event (of its newest attempt that sent
    /// one), by step_run_id. Steps that never reported progress are absent.
    pub async fn latest_progress(
        &mut self,
        run_id: Uuid,
    ) -> Result<BTreeMap<Uuid, Progress>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let rows = sqlx::query(
            // per step, its newest progress event read backwards by the
            // (step, attempt, sequence) index: a DISTINCT ON over the run's
            // events sorted all of them (0.9 s, on disk, at 600,000 events;
            // operator's tools audit)
            "SELECT s.id AS step_run_id, e.attempt, e.sequence, e.fraction, e.message, e.at
               FROM durable.step_runs s
               CROSS JOIN LATERAL (
                     SELECT e.attempt, e.sequence, e.fraction, e.message, e.at
                       FROM durable.step_events e
                      WHERE e.step_run_id = s.id AND e.kind = 'progress'
                      ORDER BY e.attempt DESC, e.sequence DESC
                      LIMIT 1) e
              WHERE s.run_id = $1",
        )
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("reading a run's latest progress")?;
        s.done().await?;
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
    /// The runs the filter names, newest first, at most `limit` of them,
    /// and whether more match (the next page: `before` the last of these).
    pub async fn runs(&mut self, filter: &RunFilter) -> Result<(Vec<RunSummary>, bool), DbError> {
        let since_ms: Option<i64> = filter
            .since
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let mut s = Scope::enter(self.conn).await?;
        if let Some(before) = filter.before {
            let known: Option<bool> =
                sqlx::query_scalar("SELECT true FROM durable.workflow_runs WHERE id = $1")
                    .bind(before)
                    .fetch_optional(&mut *s)
                    .await
                    .ctx("listing runs")?;
            if known.is_none() {
                return Err(DbError::NotFound(format!(
                    "unknown run {before} (--before takes a run id `runs` listed; one removed \
                     since, by `gc` or a worker's retention, marks no place any more: list from \
                     the first page again, or narrow with --since)"
                )));
            }
        }
        // one more than the page: whether another follows
        let mut rows = sqlx::query(RUNS_QUERY)
            .bind(filter.state.as_deref())
            .bind(filter.name.as_deref())
            .bind(since_ms)
            .bind(i64::from(filter.limit) + 1)
            .bind(filter.before)
            .fetch_all(&mut *s)
            .await
            .ctx("listing runs")?;
        s.done().await?;
        let more = rows.len() > filter.limit as usize;
        rows.truncate(filter.limit as usize);
        let runs = rows
            .into_iter()
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
            .collect::<Result<Vec<_>, DbError>>()?;
        Ok((runs, more))
    }
}

/// `runs`: the newest runs that pass the filter ($1 state, $2 name, $3 the
/// age in milliseconds, $4 the limit, $5 the run the page follows), each with its step counts by state
/// and its definitions still waiting for their dependencies. The page is
/// chosen first and its steps counted in one pass: counted per run by
/// correlated subqueries, a plan made on stale statistics (taken while a
/// few big runs filled the table, before a batch of small ones) scanned all
/// of `step_runs` once per listed run, and `runs --limit 5000` ran into the
/// statement timeout.
const RUNS_QUERY: &str = "
    WITH page AS MATERIALIZED (
        SELECT r.id, r.name, r.state, r.cancel_requested, r.created_at, r.finished_at
          FROM durable.workflow_runs r
         WHERE ($1::text IS NULL OR r.state = $1)
           AND ($2::text IS NULL OR r.name = $2)
           AND ($3::bigint IS NULL OR r.created_at >= now() - $3::bigint * interval '1 millisecond')
           -- the next page: after the given run in this order
           AND ($5::uuid IS NULL OR (r.created_at, r.id) < (SELECT b.created_at, b.id
                                                            FROM durable.workflow_runs b
                                                           WHERE b.id = $5))
           -- a run retention has taken part of is gone already
           AND r.id <> ALL (ARRAY(SELECT durable.runs_being_removed_ids()))
         ORDER BY r.created_at DESC, r.id DESC
         LIMIT $4
    ), ids AS MATERIALIZED (
        SELECT array_agg(id) AS ids FROM page
    ), counts AS (
        SELECT c.run_id, jsonb_object_agg(c.state, c.n) AS steps
          FROM (SELECT s.run_id, s.state, count(*) AS n
                  FROM durable.step_runs s
                 WHERE s.run_id = ANY ((SELECT ids FROM ids)::uuid[])
                 GROUP BY s.run_id, s.state) c
         GROUP BY c.run_id
    ), waiting AS (
        SELECT d.run_id, count(*) AS n
          FROM durable.step_defs d
         WHERE d.run_id = ANY ((SELECT ids FROM ids)::uuid[])
           AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                            WHERE s.run_id = d.run_id AND s.name = d.name)
         GROUP BY d.run_id
    )
    SELECT p.id, p.name, p.state, p.cancel_requested, p.created_at, p.finished_at,
           coalesce(c.steps, '{}'::jsonb) AS steps, coalesce(w.n, 0) AS waiting
      FROM page p
      LEFT JOIN counts c ON c.run_id = p.id
      LEFT JOIN waiting w ON w.run_id = p.id
     ORDER BY p.created_at DESC, p.id DESC";

/// The names of a run's steps (created or waiting), in spec order, or
/// `NotFound` for an unknown run.
/// "its steps are: a, b" for a message naming a step a run does not have
/// (the first 20 of them: a 1,000-step run named all of them, 7 KB).
pub fn its_steps_are(run_id: Uuid, steps: &[String]) -> String {
    const NAMED: usize = 20;
    let more = match steps.len().saturating_sub(NAMED) {
        0 => String::new(),
        n => format!(" and {n} more (`supervisor status {run_id}` lists them)"),
    };
    format!(
        "its steps are: {}{more}",
        steps
            .iter()
            .take(NAMED)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

impl Db {
    /// A run's step names in spec order (also those not created yet), or
    /// `NotFound`.
    pub async fn step_names(&self, run_id: Uuid) -> Result<Vec<String>, DbError> {
        let mut c = self.connection("reading a run's step names").await?;
        step_names(c.conn().conn, run_id).await
    }
}

async fn step_names(conn: &mut sqlx::PgConnection, run_id: Uuid) -> Result<Vec<String>, DbError> {
    let removing: Option<bool> = sqlx::query_scalar(
        "SELECT durable.run_being_removed(id) FROM durable.workflow_runs WHERE id = $1",
    )
    .bind(run_id)
    .fetch_optional(&mut *conn)
    .await
    .ctx("reading a run")?;
    match removing {
        None => return Err(DbError::NotFound(format!("unknown run {run_id}"))),
        Some(true) => return Err(DbError::being_removed(run_id)),
        Some(false) => {}
    }
    sqlx::query_scalar(
        "SELECT name FROM durable.step_defs WHERE run_id = $1 ORDER BY position, name",
    )
    .bind(run_id)
    .fetch_all(&mut *conn)
    .await
    .ctx("reading a run's step names")
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

fn is_tls_failure(cause: &str) -> bool {
    let c = cause.to_ascii_lowercase();
    c.contains("certificate") || c.contains("tls")
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
        sqlx::Error::Tls(_) => ConnectError::Tls { url, cause },
        // rustls's refusals (an untrusted certificate, a name that does not
        // match) reach sqlx as I/O errors
        _ if is_tls_failure(&cause) => ConnectError::Tls { url, cause },
        _ => ConnectError::Unreachable { url, cause },
    }
}

// ---------------------------------------------------------------------------
// `supervisor watch`: a light snapshot of a run, polled a few times a second

/// What `supervisor watch` draws of a run, read in one snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct WatchRun {
    pub run_id: Uuid,
    pub name: String,
    pub state: String,
    pub cancel_requested: bool,
    /// Since the run was created, by the database clock.
    pub elapsed_ms: i64,
    /// The created steps in spec order, then the ones still waiting.
    pub steps: Vec<WatchStep>,
}

/// One step of [`WatchRun`].
#[derive(Debug, Clone, Serialize)]
pub struct WatchStep {
    pub name: String,
    /// A step state, or `waiting` for a step not created yet.
    pub state: String,
    pub attempt: i32,
    /// How long the current attempt has run (or the last one ran), when it started.
    pub elapsed_ms: Option<i64>,
    /// The latest progress of the current attempt.
    pub fraction: Option<f64>,
    pub message: Option<String>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    /// The steps a waiting step waits on.
    pub depends_on: Vec<String>,
    /// A created step's id.
    pub step_run_id: Option<Uuid>,
    /// The id of the step's newest history row (the transition into its
    /// current state), read in the same snapshot.
    pub last_transition: Option<i64>,
    /// That row's reason (`DEMO_FAILURE: retry in 50 ms` for a retry).
    pub last_reason: Option<String>,
}

/// One transition of a step, as `watch --plain` prints the changes a poll
/// missed (a retry that failed and started again between two reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepHop {
    pub step_run_id: Uuid,
    /// The history row's id: a step's rows are in its order by id (each is
    /// written under the step row's lock).
    pub id: i64,
    pub to_state: String,
    pub attempt: Option<i32>,
    pub reason: Option<String>,
}

impl Db {
    /// A snapshot of a run for `watch`, in one read-only transaction (so the
    /// run's state and its steps agree). `NotFound` for an unknown run.
    pub async fn watch_snapshot(&self, run_id: Uuid) -> Result<WatchRun, DbError> {
        self.connection("starting a read")
            .await?
            .conn()
            .watch_snapshot(run_id)
            .await
    }

    /// The history rows of each asked step `(step, after, upto)` with
    /// `after < id <= upto`, by step and in order. Rows up to an id a
    /// snapshot saw are committed and never change: no snapshot is needed
    /// to agree with the one that named `upto`.
    pub async fn step_hops(&self, asks: &[(Uuid, i64, i64)]) -> Result<Vec<StepHop>, DbError> {
        if asks.is_empty() {
            return Ok(Vec::new());
        }
        let steps: Vec<Uuid> = asks.iter().map(|a| a.0).collect();
        let after: Vec<i64> = asks.iter().map(|a| a.1).collect();
        let upto: Vec<i64> = asks.iter().map(|a| a.2).collect();
        let rows = sqlx::query(
            "SELECT t.step_run_id, t.id, t.to_state, t.attempt, t.reason
               FROM unnest($1::uuid[], $2::bigint[], $3::bigint[]) AS a(step, after, upto)
               JOIN durable.transitions t
                 ON t.step_run_id = a.step AND t.id > a.after AND t.id <= a.upto
              ORDER BY t.step_run_id, t.id",
        )
        .bind(&steps)
        .bind(&after)
        .bind(&upto)
        .fetch_all(self.pool())
        .await
        .ctx("reading a run's history")?;
        Ok(rows
            .into_iter()
            .map(|r| StepHop {
                step_run_id: r.get("step_run_id"),
                id: r.get("id"),
                to_state: r.get("to_state"),
                attempt: r.get("attempt"),
                reason: r.get("reason"),
            })
            .collect())
    }
}

/// Begins a read of several statements that must agree: REPEATABLE READ,
/// READ ONLY when it is the connection's own transaction; inside a caller's
/// transaction a savepoint that reads with the caller's isolation (which
/// cannot be changed there).
pub(super) async fn begin_read(
    conn: &mut sqlx::PgConnection,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, DbError> {
    let own = !conn.is_in_transaction();
    let mut tx = super::begin(conn).await.ctx("starting a read")?;
    if own {
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .ctx("starting a read")?;
    }
    Ok(tx)
}

impl DbConn<'_> {
    /// See [`Db::watch_snapshot`]. Inside a caller's transaction it reads with
    /// the caller's isolation (see the module documentation).
    pub async fn watch_snapshot(&mut self, run_id: Uuid) -> Result<WatchRun, DbError> {
        let mut tx = begin_read(self.conn).await?;
        let run = sqlx::query(
            "SELECT id, name, state, cancel_requested,
                    (extract(epoch FROM coalesce(finished_at, now()) - created_at) * 1000)::bigint AS elapsed_ms,
                    durable.run_being_removed(id) AS removing
               FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await
        .ctx("reading a run")?
        .ok_or_else(|| DbError::NotFound(format!("unknown run {run_id}")))?;
        if run.get::<bool, _>("removing") {
            return Err(DbError::being_removed(run_id));
        }
        // the latest progress event of the step's current attempt only: a
        // retry starts from an empty bar, not from the last attempt's 90%
        let rows = sqlx::query(
            "SELECT s.id, s.name, s.state, s.attempt, s.error_code, s.error_message,
                    lt.id AS last_transition, lt.reason AS last_reason,
                    CASE WHEN s.started_at IS NULL OR s.state IN ('pending', 'leased', 'retryable_failed') THEN NULL
                         ELSE (extract(epoch FROM coalesce(s.finished_at, now()) - s.started_at) * 1000)::bigint
                    END AS elapsed_ms,
                    p.fraction, p.message
               FROM durable.step_runs s
               LEFT JOIN LATERAL (
                    SELECT t.id, t.reason FROM durable.transitions t WHERE t.step_run_id = s.id
                     ORDER BY t.id DESC LIMIT 1) lt ON true
               LEFT JOIN LATERAL (
                    SELECT e.fraction, e.message FROM durable.step_events e
                     WHERE e.step_run_id = s.id AND e.attempt = s.attempt AND e.kind = 'progress'
                     ORDER BY e.sequence DESC LIMIT 1) p ON true
              WHERE s.run_id = $1
              ORDER BY s.position",
        )
        .bind(run_id)
        .fetch_all(&mut *tx)
        .await
        .ctx("reading a run's steps")?;
        let waiting = sqlx::query(
            "SELECT d.name, d.depends_on FROM durable.step_defs d
              WHERE d.run_id = $1
                AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)
              ORDER BY d.position",
        )
        .bind(run_id)
        .fetch_all(&mut *tx)
        .await
        .ctx("reading a run's waiting steps")?;
        tx.commit().await.ctx("ending a read")?;
        let mut steps: Vec<WatchStep> = rows
            .into_iter()
            .map(|r| WatchStep {
                name: r.get("name"),
                state: r.get("state"),
                attempt: r.get("attempt"),
                elapsed_ms: r.get("elapsed_ms"),
                fraction: r.get("fraction"),
                message: r.get("message"),
                error_code: r.get("error_code"),
                error_message: r.get("error_message"),
                depends_on: Vec::new(),
                step_run_id: Some(r.get("id")),
                last_transition: r.get("last_transition"),
                last_reason: r.get("last_reason"),
            })
            .collect();
        steps.extend(waiting.into_iter().map(|r| WatchStep {
            name: r.get("name"),
            state: "waiting".into(),
            attempt: 0,
            elapsed_ms: None,
            fraction: None,
            message: None,
            error_code: None,
            error_message: None,
            depends_on: r.get("depends_on"),
            step_run_id: None,
            last_transition: None,
            last_reason: None,
        }));
        Ok(WatchRun {
            run_id: run.get("id"),
            name: run.get("name"),
            state: run.get("state"),
            cancel_requested: run.get("cancel_requested"),
            elapsed_ms: run.get("elapsed_ms"),
            steps,
        })
    }
}

// ---------------------------------------------------------------------------
// `supervisor artifact`: an artifact's bytes, in chunks, and its lineage

/// One artifact as `artifact lineage` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ArtifactInfo {
    pub id: Uuid,
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
    pub step: String,
    pub step_run_id: Uuid,
    pub attempt: i32,
    pub run_id: Uuid,
    #[serde(serialize_with = "crate::json::utc_micros")]
    pub created_at: DateTime<Utc>,
}

/// An artifact and everything it was derived from, transitively:
/// `nodes` by id (the artifact itself included), `derived_from` its direct
/// inputs by id, in a stable order (creation, then name).
#[derive(Debug, Clone)]
pub struct Lineage {
    pub root: Uuid,
    pub nodes: BTreeMap<Uuid, ArtifactInfo>,
    pub derived_from: BTreeMap<Uuid, Vec<Uuid>>,
}

fn artifact_info(r: &sqlx::postgres::PgRow) -> ArtifactInfo {
    ArtifactInfo {
        id: r.get("id"),
        name: r.get("name"),
        sha256: r.get("sha256"),
        size: r.get("size"),
        media_type: r.get("media_type"),
        step: r.get("step"),
        step_run_id: r.get("step_run_id"),
        attempt: r.get("attempt"),
        run_id: r.get("run_id"),
        created_at: r.get("created_at"),
    }
}

const ARTIFACT_COLUMNS: &str = "a.id, a.name, a.sha256, a.size, a.media_type, s.name AS step,
    a.step_run_id, a.attempt, a.run_id, a.created_at";

impl Db {
    /// An artifact and where its blob's bytes are (read them with
    /// `crate::artifacts::ArtifactStore`); `NotFound` for an unknown id.
    pub async fn artifact_blob(&self, id: Uuid) -> Result<(ArtifactInfo, BlobRef), DbError> {
        self.connection("reading an artifact")
            .await?
            .conn()
            .artifact_blob(id)
            .await
    }

    /// The artifact `id` and its lineage back to the first inputs, through
    /// every step and attempt (`durable.artifact_lineage`, recursively).
    /// `NotFound` for an unknown id.
    pub async fn artifact_lineage(&self, id: Uuid) -> Result<Lineage, DbError> {
        self.connection("starting a read")
            .await?
            .conn()
            .artifact_lineage(id)
            .await
    }
}

impl DbConn<'_> {
    /// See [`Db::artifact_blob`].
    pub async fn artifact_blob(&mut self, id: Uuid) -> Result<(ArtifactInfo, BlobRef), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let row = sqlx::query(&format!(
            "SELECT {ARTIFACT_COLUMNS}, {BLOB_COLUMNS}, durable.run_being_removed(a.run_id) AS removing
               FROM durable.artifacts a
               JOIN durable.step_runs s ON s.id = a.step_run_id
               JOIN durable.artifact_blobs b ON b.sha256 = a.sha256
              WHERE a.id = $1"
        ))
        .bind(id)
        .fetch_optional(&mut *s)
        .await
        .ctx("reading an artifact")?
        .ok_or_else(|| DbError::NotFound(format!("unknown artifact {id}")))?;
        s.done().await?;
        let info = artifact_info(&row);
        if row.get::<bool, _>("removing") {
            // its run reads as gone: so does what it made
            return Err(DbError::being_removed(info.run_id));
        }
        Ok((info, blob_ref(&row)?))
    }

    /// See [`Db::artifact_lineage`]. Inside a caller's transaction it reads
    /// with the caller's isolation (see the module documentation).
    pub async fn artifact_lineage(&mut self, id: Uuid) -> Result<Lineage, DbError> {
        let mut tx = begin_read(self.conn).await?;
        // UNION (not ALL) stops at artifacts already reached: a diamond is
        // visited once, and even a cycle (which the writes cannot make) ends
        let nodes = sqlx::query(&format!(
            "WITH RECURSIVE reach(id) AS (
                 SELECT $1::uuid
                 UNION
                 SELECT l.derived_from_id FROM durable.artifact_lineage l JOIN reach r ON l.artifact_id = r.id)
             SELECT {ARTIFACT_COLUMNS}, durable.run_being_removed(a.run_id) AS removing
               FROM reach JOIN durable.artifacts a ON a.id = reach.id
               JOIN durable.step_runs s ON s.id = a.step_run_id"
        ))
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .ctx("reading an artifact's lineage")?;
        // a run retention has taken part of has lost artifacts and their
        // edges already: a tree through it would name a derived artifact as
        // a first input (re-check audit)
        if let Some(r) = nodes.iter().find(|r| r.get::<bool, _>("removing")) {
            let run: Uuid = r.get("run_id");
            let a: Uuid = r.get("id");
            return Err(if a == id {
                DbError::being_removed(run)
            } else {
                DbError::NotFound(format!(
                    "the lineage of artifact {id} reaches run {run}, which is being removed by \
                     retention: it can no longer be read whole"
                ))
            });
        }
        let nodes: BTreeMap<Uuid, ArtifactInfo> = nodes
            .iter()
            .map(|r| {
                let a = artifact_info(r);
                (a.id, a)
            })
            .collect();
        if !nodes.contains_key(&id) {
            return Err(DbError::NotFound(format!("unknown artifact {id}")));
        }
        let ids: Vec<Uuid> = nodes.keys().copied().collect();
        let edges = sqlx::query(
            "SELECT l.artifact_id, l.derived_from_id FROM durable.artifact_lineage l
               JOIN durable.artifacts a ON a.id = l.derived_from_id
              WHERE l.artifact_id = ANY ($1)
              ORDER BY l.artifact_id, l.position NULLS LAST, a.created_at, a.name, a.id",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await
        .ctx("reading an artifact's lineage")?;
        tx.commit().await.ctx("ending a read")?;
        let mut derived_from: BTreeMap<Uuid, Vec<Uuid>> = BTreeMap::new();
        for e in edges {
            derived_from
                .entry(e.get("artifact_id"))
                .or_default()
                .push(e.get("derived_from_id"));
        }
        Ok(Lineage {
            root: id,
            nodes,
            derived_from,
        })
    }
}

/// An event row of [`DbConn::events`]' columns.
fn event_row(r: &sqlx::postgres::PgRow) -> EventRow {
    EventRow {
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
    }
}

/// `NotFound` (naming the run's steps) unless the run exists and, with
/// `step`, has a step of that name.
async fn check_step_named(
    conn: &mut sqlx::PgConnection,
    run_id: Uuid,
    step: Option<&str>,
) -> Result<(), DbError> {
    let steps: Vec<String> = step_names(conn, run_id).await?;
    if let Some(name) = step {
        if !steps.iter().any(|s| s == name) {
            return Err(DbError::NotFound(format!(
                "run {run_id} has no step named {name:?}; {}",
                its_steps_are(run_id, &steps)
            )));
        }
    }
    Ok(())
}
