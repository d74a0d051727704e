//! Runs: submit, cancel, status (the CLI's writes and reads of a whole run).

use super::*;
use std::collections::HashMap;

use sqlx::postgres::PgRow;

/// What a submit did: the run's id, and whether it is new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    pub id: Uuid,
    /// `None` from a schema older than 20261228000001, which does not say.
    pub outcome: Option<SubmitOutcome>,
}

/// Whether a submit made a run or found one by its idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitOutcome {
    /// A new run, made from this spec.
    Created,
    /// The key named a run made from this very spec (a retried submit).
    KnownSameSpec,
    /// The key named a run made from another spec: this one was valid but
    /// not submitted; the id is the other run's.
    KnownOtherSpec,
}

impl SubmitOutcome {
    /// From `durable.submit_outcome`'s value.
    fn from_setting(s: &str) -> Option<SubmitOutcome> {
        match s {
            "created" => Some(SubmitOutcome::Created),
            "known, same spec" => Some(SubmitOutcome::KnownSameSpec),
            "known, other spec" => Some(SubmitOutcome::KnownOtherSpec),
            _ => None,
        }
    }
}

impl Db {
    /// Validates and submits a spec through `durable.submit_run`. An invalid
    /// spec is `DbError::InvalidSpec` with a message that names the field;
    /// nothing is written then.
    pub async fn submit(&self, spec: &serde_json::Value) -> Result<Uuid, DbError> {
        Ok(self.submit_telling(spec).await?.id)
    }

    /// [`Db::submit`], saying whether the run is new or one its idempotency
    /// key already named.
    pub async fn submit_telling(&self, spec: &serde_json::Value) -> Result<Submitted, DbError> {
        self.connection("submitting a run")
            .await?
            .conn()
            .submit_telling(spec)
            .await
    }

    /// Requests cancellation of a run or one of its steps; returns the run's
    /// state afterwards.
    pub async fn cancel(&self, run_id: Uuid, step: Option<&str>) -> Result<RunState, DbError> {
        self.connection("cancelling")
            .await?
            .conn()
            .cancel(run_id, step)
            .await
    }

    /// The run and its steps, or `NotFound`.
    pub async fn status(&self, run_id: Uuid) -> Result<RunStatus, DbError> {
        self.connection("reading a run")
            .await?
            .conn()
            .status(run_id)
            .await
    }

    /// What is left for the worker `worker_id` (by the routes it registered):
    /// steps leased or running anywhere, and steps ready or waiting for a
    /// retry that it can run. Open steps it cannot run are no work of its;
    /// a few of them are returned so that the caller can name them.
    pub async fn work_for(&self, worker_id: Uuid) -> Result<WorkFor, DbError> {
        self.connection("counting the work left")
            .await?
            .conn()
            .work_for(worker_id)
            .await
    }

    /// The run's steps waiting to be leased (pending, or retrying) whose
    /// executor_kind, kind and labels no live worker offers (by the routes
    /// the workers registered; live: not stopped, a heartbeat within three
    /// of its heartbeat intervals, at least the last 30 s), in spec order: a step that waits for a worker, not for
    /// its turn.
    pub async fn unroutable_steps(&self, run_id: Uuid) -> Result<Vec<StuckStep>, DbError> {
        self.connection("finding steps no worker offers")
            .await?
            .conn()
            .unroutable_steps(run_id)
            .await
    }

    /// The run's steps waiting to be leased that live workers offer, each
    /// of those workers having paused the executor that would run it (it
    /// cannot be started there, its hello changed) or itself (its work_dir
    /// takes no directory), in spec order, with who paused and why.
    pub async fn steps_paused_for(&self, run_id: Uuid) -> Result<Vec<PausedStep>, DbError> {
        self.connection("finding steps whose workers paused")
            .await?
            .conn()
            .steps_paused_for(run_id)
            .await
    }

    /// A run's state alone, or `NotFound`.
    pub async fn run_state(&self, run_id: Uuid) -> Result<RunState, DbError> {
        self.connection("reading a run's state")
            .await?
            .conn()
            .run_state(run_id)
            .await
    }

    /// How many runs are pending or running.
    pub async fn open_runs(&self) -> Result<i64, DbError> {
        self.connection("counting open runs")
            .await?
            .conn()
            .open_runs()
            .await
    }
}

/// See [`Db::work_for`].
#[derive(Debug, Clone)]
pub struct WorkFor {
    /// Steps leased or running, and steps this worker could lease now or
    /// after their retry delay.
    pub steps: i64,
    /// Up to five open steps no executor of this worker offers a route for.
    pub stuck: Vec<StuckStep>,
}

/// A live worker, a row `w` of `durable.workers`: not stopped, its last
/// heartbeat within three of its intervals, at least 30 s (README,
/// `status`). Other workers' leases and `status` judge by it alike.
pub(super) const LIVE_WORKER: &str = "w.stopped_at IS NULL
     AND w.last_heartbeat_at > now() - greatest(interval '30 seconds',
             3 * coalesce(w.heartbeat_interval_ms, 0) * interval '1 millisecond')";

/// The routes the workers `which` selects (a condition on `w`, a row of
/// `durable.workers`) registered: rows of (executor_kind, kind, labels,
/// secrets: the names the route's executor may hand out, a JSON array).
pub(super) fn routes_of(which: &str) -> String {
    format!(
        "SELECT r->>'executor_kind' AS executor_kind, r->>'kind' AS kind,
                coalesce(r->'labels', '{{}}'::jsonb) AS labels,
                coalesce(e->'secrets', '[]'::jsonb) AS secrets
           FROM durable.workers w
          CROSS JOIN LATERAL jsonb_array_elements(w.capabilities) e
          CROSS JOIN LATERAL jsonb_array_elements(e->'routes') r
          WHERE {which}"
    )
}

/// Whether one of the CTE `routes` ([`routes_of`]) can run the step `s`.
const OFFERED: &str = "EXISTS (SELECT 1 FROM routes r
                                WHERE r.executor_kind = s.executor_kind AND r.kind = s.kind
                                  AND r.labels @> s.labels)";

/// The columns of a [`StuckStep`] from the step `s`.
const STUCK_COLUMNS: &str = "s.run_id, s.name AS step, s.executor_kind, s.kind, s.labels";

/// An open step that a given worker cannot run.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StuckStep {
    pub run_id: Uuid,
    pub step: String,
    pub executor_kind: String,
    pub kind: String,
    pub labels: serde_json::Value,
}

/// A live worker's executor that offers a step and leases nothing now
/// (`durable.workers.paused`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PausedBy {
    pub worker: String,
    pub executor: String,
    /// Why: `cannot be started: …`, `its work_dir … takes no new directory`.
    pub why: String,
    /// Since when (RFC 3339), as the worker wrote it.
    pub since: String,
}

/// An open step that live workers offer, every one of them paused for it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PausedStep {
    #[sqlx(flatten)]
    pub step: StuckStep,
    /// The offering workers' executors, each with why it is paused.
    pub paused_by: sqlx::types::Json<Vec<PausedBy>>,
}

impl StuckStep {
    /// What the step needs of a worker, for a message:
    /// `executor_kind "go", kind "demo.echo", labels {"gpu":"a100"}` (no labels part when it has none).
    pub fn needs(&self) -> String {
        let labels = match self.labels.as_object() {
            Some(m) if !m.is_empty() => format!(", labels {}", self.labels),
            _ => String::new(),
        };
        format!(
            "executor_kind {:?}, kind {:?}{labels}",
            self.executor_kind, self.kind
        )
    }
}

impl DbConn<'_> {
    /// See [`Db::submit`].
    pub async fn submit(&mut self, spec: &serde_json::Value) -> Result<Uuid, DbError> {
        Ok(self.submit_telling(spec).await?.id)
    }

    /// See [`Db::submit_telling`].
    pub async fn submit_telling(&mut self, spec: &serde_json::Value) -> Result<Submitted, DbError> {
        // what jsonb cannot hold would fail the whole value, naming nothing
        if let Some((path, what)) = crate::json::unstorable(spec, "") {
            let path = if path.is_empty() { "spec" } else { &path };
            return Err(DbError::InvalidSpec(match what {
                crate::json::Unstorable::Nul => format!(
                    "{path}: contains a NUL character (\\u0000), which PostgreSQL cannot store; \
                     remove it, or pass binary data as an artifact"
                ),
                crate::json::Unstorable::Number(number) => format!(
                    "{path}: the number {} cannot be stored (PostgreSQL's numeric holds at \
                     most 131072 digits before the point and 16383 after it); pass it as a string",
                    crate::json::short(&number)
                ),
            }));
        }
        let mut s = Scope::enter(self.conn).await?;
        // the outcome is the call's transaction-local setting
        // (20261228000001), read in the same statement after the call: the
        // CTE is evaluated before the outer row that reads it. A schema
        // before it sets none: `None`.
        let res = sqlx::query_as::<_, (Uuid, Option<String>)>(
            "WITH s AS MATERIALIZED (SELECT durable.submit_run($1) AS id)
             SELECT id, current_setting('durable.submit_outcome', true) FROM s",
        )
        .bind(spec)
        .fetch_one(&mut *s)
        .await;
        let res = match res {
            Ok((id, outcome)) => Ok(Submitted {
                id,
                outcome: outcome.as_deref().and_then(SubmitOutcome::from_setting),
            }),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("22023") => {
                Err(DbError::InvalidSpec(e.message().to_owned()))
            }
            // a refusal by design, not a database error (upgrade audit)
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("P0D05") => {
                Err(DbError::KeyBeingFreed(e.message().to_owned()))
            }
            Err(e) => Err(DbError::Query {
                context: "submitting a run",
                source: e,
            }),
        }?;
        s.done().await?;
        Ok(res)
    }

    /// See [`Db::cancel`].
    pub async fn cancel(&mut self, run_id: Uuid, step: Option<&str>) -> Result<RunState, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let res = sqlx::query_scalar::<_, String>("SELECT durable.cancel_run($1, $2)")
            .bind(run_id)
            .bind(step)
            .fetch_one(&mut *s)
            .await;
        let state = match res {
            Ok(st) => st
                .parse()
                .map_err(|e| DbError::Corrupt(format!("run state: {e}"))),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("P0D04") => {
                Err(DbError::NotFound(e.message().to_owned()))
            }
            Err(e) => Err(DbError::Query {
                context: "cancelling",
                source: e,
            }),
        }?;
        s.done().await?;
        Ok(state)
    }

    /// See [`Db::status`]. Its statements read one snapshot: read one by
    /// one, a busy run showed a run pending beside a running step, or a step
    /// in neither `steps` nor `waiting` (operator audit).
    pub async fn status(&mut self, run_id: Uuid) -> Result<RunStatus, DbError> {
        let mut s = super::inspect::begin_read(self.conn).await?;
        let run = sqlx::query(
            "SELECT id, name, state, idempotency_key, cancel_requested, created_at, finished_at,
                    durable.run_being_removed(id) AS removing
               FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(run_id)
        .fetch_optional(&mut *s)
        .await
        .ctx("reading a run")?
        .ok_or_else(|| DbError::NotFound(format!("unknown run {run_id}")))?;
        if run.get::<bool, _>("removing") {
            return Err(DbError::being_removed(run_id));
        }
        crate::fault::maybe_delay_status_read(run_id).await;

        let rows = sqlx::query(
            "SELECT s.id, s.name, s.state, s.attempt, s.executor_kind, s.kind, s.idempotency_key,
                    s.cancel_requested, s.next_attempt_at, s.output::text AS output,
                    s.error_code, s.error_message, s.error_retryable,
                    s.error_details::text AS error_details, s.transition_reason,
                    (SELECT count(*) FROM durable.step_events e WHERE e.step_run_id = s.id) AS events,
                    (SELECT w.name FROM durable.workers w WHERE w.id = s.owner_worker_id) AS worker
               FROM durable.step_runs s WHERE s.run_id = $1 ORDER BY s.position",
        )
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("reading a run's steps")?;
        let arts = sqlx::query(
            "SELECT id, step_run_id, name, sha256, size, media_type FROM durable.artifacts
              WHERE run_id = $1 ORDER BY created_at, name",
        )
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("reading a run's artifacts")?;

        let mut by_step = artifacts_by_step(&arts);
        let steps = rows
            .iter()
            .map(|r| {
                let id: Uuid = r.get("id");
                step_status(r, by_step.remove(&id).unwrap_or_default())
            })
            .collect();
        let waiting = sqlx::query(
            "SELECT d.name, d.depends_on FROM durable.step_defs d
              WHERE d.run_id = $1
                AND NOT EXISTS (SELECT 1 FROM durable.step_runs s WHERE s.run_id = d.run_id AND s.name = d.name)
              ORDER BY d.position",
        )
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("reading a run's waiting steps")?
        .into_iter()
        .map(|r| WaitingStep {
            name: r.get("name"),
            depends_on: r.get("depends_on"),
        })
        .collect();

        s.commit().await.ctx("ending a read")?;
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

    /// See [`Db::work_for`].
    pub async fn work_for(&mut self, worker_id: Uuid) -> Result<WorkFor, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let routes = routes_of("w.id = $1");
        let steps: i64 = sqlx::query_scalar(&format!(
            "WITH routes AS ({routes})
             SELECT (SELECT count(*) FROM durable.step_runs WHERE durable.step_is_live(state))
                  + (SELECT count(*) FROM durable.step_runs s
                      WHERE s.state IN ('pending', 'retryable_failed') AND {OFFERED})"
        ))
        .bind(worker_id)
        .fetch_one(&mut *s)
        .await
        .ctx("counting the work left")?;
        let stuck = sqlx::query_as::<_, StuckStep>(&format!(
            "WITH routes AS ({routes})
             SELECT {STUCK_COLUMNS} FROM durable.step_runs s
              WHERE s.state IN ('pending', 'retryable_failed') AND NOT {OFFERED}
              ORDER BY s.created_at
              LIMIT 5"
        ))
        .bind(worker_id)
        .fetch_all(&mut *s)
        .await
        .ctx("finding steps no executor of this worker runs")?;
        s.done().await?;
        Ok(WorkFor { steps, stuck })
    }

    /// See [`Db::unroutable_steps`].
    pub async fn unroutable_steps(&mut self, run_id: Uuid) -> Result<Vec<StuckStep>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let routes = routes_of(LIVE_WORKER);
        let rows = sqlx::query_as::<_, StuckStep>(&format!(
            "WITH routes AS ({routes})
             SELECT {STUCK_COLUMNS} FROM durable.step_runs s
              WHERE s.run_id = $1 AND s.state IN ('pending', 'retryable_failed') AND NOT {OFFERED}
              ORDER BY s.position"
        ))
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("finding steps no worker offers")?;
        s.done().await?;
        Ok(rows)
    }

    /// See [`Db::steps_paused_for`].
    pub async fn steps_paused_for(&mut self, run_id: Uuid) -> Result<Vec<PausedStep>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        // the live workers' routes with what each paused: its executor (by
        // its name) or itself ("*": its work_dir)
        let rows = sqlx::query_as::<_, PausedStep>(&format!(
            "WITH routes AS (
                 SELECT r->>'executor_kind' AS executor_kind, r->>'kind' AS kind,
                        coalesce(r->'labels', '{{}}'::jsonb) AS labels,
                        w.name AS worker, e->>'executor' AS executor,
                        coalesce(w.paused->'*', w.paused->(e->>'executor')) AS pause
                   FROM durable.workers w
                  CROSS JOIN LATERAL jsonb_array_elements(w.capabilities) e
                  CROSS JOIN LATERAL jsonb_array_elements(e->'routes') r
                  WHERE {LIVE_WORKER})
             SELECT {STUCK_COLUMNS}, p.paused_by
               FROM durable.step_runs s
              CROSS JOIN LATERAL (
                    SELECT bool_and(r.pause IS NOT NULL) AS all_paused,
                           jsonb_agg(DISTINCT jsonb_build_object(
                               'worker', r.worker, 'executor', coalesce(r.executor, ''),
                               'why', coalesce(r.pause->>'why', ''),
                               'since', coalesce(r.pause->>'since', ''))) AS paused_by
                      FROM routes r
                     WHERE r.executor_kind = s.executor_kind AND r.kind = s.kind
                       AND r.labels @> s.labels) p
              WHERE s.run_id = $1 AND s.state IN ('pending', 'retryable_failed') AND p.all_paused
              ORDER BY s.position"
        ))
        .bind(run_id)
        .fetch_all(&mut *s)
        .await
        .ctx("finding steps whose workers paused")?;
        s.done().await?;
        Ok(rows)
    }

    /// See [`Db::run_state`].
    pub async fn run_state(&mut self, run_id: Uuid) -> Result<RunState, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let state: Option<(String, bool)> = sqlx::query_as(
            "SELECT state, durable.run_being_removed(id) FROM durable.workflow_runs WHERE id = $1",
        )
        .bind(run_id)
        .fetch_optional(&mut *s)
        .await
        .ctx("reading a run's state")?;
        s.done().await?;
        let (state, removing) =
            state.ok_or_else(|| DbError::NotFound(format!("unknown run {run_id}")))?;
        if removing {
            return Err(DbError::being_removed(run_id));
        }
        state
            .parse()
            .map_err(|e| DbError::Corrupt(format!("run state: {e}")))
    }

    /// See [`Db::open_runs`].
    pub async fn open_runs(&mut self) -> Result<i64, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let n = sqlx::query_scalar(
            "SELECT count(*) FROM durable.workflow_runs WHERE durable.run_is_open(state)",
        )
        .fetch_one(&mut *s)
        .await
        .ctx("counting open runs")?;
        s.done().await?;
        Ok(n)
    }
}

/// A run's artifacts, per step run (in the order read).
fn artifacts_by_step(arts: &[PgRow]) -> HashMap<Uuid, Vec<ArtifactSummary>> {
    let mut by_step: HashMap<Uuid, Vec<ArtifactSummary>> = HashMap::new();
    for a in arts {
        by_step
            .entry(a.get("step_run_id"))
            .or_default()
            .push(ArtifactSummary {
                id: a.get("id"),
                name: a.get("name"),
                sha256: a.get("sha256"),
                size: a.get("size"),
                media_type: a.get("media_type"),
            });
    }
    by_step
}

/// A `jsonb` column read as text (`col::text AS col`) and decoded as deep as
/// the runtime stores (an output or an error's details nest 128 levels,
/// more than sqlx's decoder, serde_json's 127, takes: `status` panicked on
/// such a step). Deeper, written by hand, it is shown as its text.
fn stored_json(r: &PgRow, col: &str) -> Option<serde_json::Value> {
    let text: Option<String> = r.get(col);
    text.map(
        |t| match crate::json::parse_bounded(t.as_bytes(), STORED_JSON_DEPTH) {
            Ok(v) => v,
            Err(_) => serde_json::Value::String(t),
        },
    )
}

/// See [`stored_json`]: deeper than any value the runtime writes, shallow
/// enough for any thread's stack.
const STORED_JSON_DEPTH: usize = 256;

/// One step of `status`' step query, with its artifacts.
fn step_status(r: &PgRow, artifacts: Vec<ArtifactSummary>) -> StepStatus {
    let state: String = r.get("state");
    let code: Option<String> = r.get("error_code");
    let error = code.map(|code| StepError {
        code,
        message: r
            .get::<Option<String>, _>("error_message")
            .unwrap_or_default(),
        retryable: r.get::<Option<bool>, _>("error_retryable").unwrap_or(false),
        details: stored_json(r, "error_details"),
        earlier_attempt: matches!(state.as_str(), "leased" | "running"),
    });
    // when it is retried next: only a step waiting for its retry has one
    let next_attempt_at: Option<DateTime<Utc>> = if state == "retryable_failed" {
        r.get("next_attempt_at")
    } else {
        None
    };
    // why an ended step ended as it did: what its error alone does not say
    // (a retryable error not retried: the deadline, the attempts; a cancel)
    let reason = if matches!(state.as_str(), "terminal_failed" | "cancelled") {
        r.get("transition_reason")
    } else {
        None
    };
    StepStatus {
        name: r.get("name"),
        step_run_id: r.get("id"),
        state,
        reason,
        attempt: r.get("attempt"),
        executor_kind: r.get("executor_kind"),
        kind: r.get("kind"),
        idempotency_key: r.get("idempotency_key"),
        cancel_requested: r.get("cancel_requested"),
        next_attempt_at,
        output: stored_json(r, "output"),
        error,
        events: r.get("events"),
        artifacts,
        worker: r.get("worker"),
    }
}
