//! The queue: worker registration, the lease, the heartbeat, the reclaim of
//! expired leases, LISTEN.

use super::*;
use std::collections::HashSet;

/// How long the heartbeat's renewal waits on a row a step writer holds
/// before it gives way and skips what is held (see `durable.renew_leases`).
/// A writer's batch commits within milliseconds; the deadlock detector only
/// looks after a second, so a wait cycle with a writer ends here first.
const HEARTBEAT_ROW_WAIT: &str = "20ms";

impl Db {
    pub async fn register_worker(
        &self,
        id: Uuid,
        name: &str,
        host: &str,
        capabilities: &serde_json::Value,
    ) -> Result<(), DbError> {
        self.register_worker_beating(id, name, host, capabilities, None)
            .await
    }

    /// [`Db::register_worker`] with the interval of its heartbeats: it is
    /// live while its last one is within three of them (at least 30 s).
    pub async fn register_worker_beating(
        &self,
        id: Uuid,
        name: &str,
        host: &str,
        capabilities: &serde_json::Value,
        heartbeat_interval: Option<StdDuration>,
    ) -> Result<(), DbError> {
        self.connection("registering the worker")
            .await?
            .conn()
            .register_worker(id, name, host, capabilities, heartbeat_interval)
            .await
    }

    /// The routes one executor of a live worker is leased for now, in its
    /// registered capabilities (what `status` reads to say a step waits for
    /// a worker that no live one offers).
    pub async fn set_worker_routes(
        &self,
        id: Uuid,
        executor: &str,
        routes: &[Route],
    ) -> Result<(), DbError> {
        self.connection("updating the worker's routes")
            .await?
            .conn()
            .set_worker_routes(id, executor, routes)
            .await
    }

    /// What the worker `id` leases nothing for now and why
    /// (`durable.workers.paused`: executor name, or `*` for the whole
    /// worker, to `{"why", "since"}`).
    pub async fn set_worker_paused(
        &self,
        id: Uuid,
        paused: &serde_json::Value,
    ) -> Result<(), DbError> {
        sqlx::query("UPDATE durable.workers SET paused = $2 WHERE id = $1")
            .bind(id)
            .bind(paused)
            .execute(self.pool())
            .await
            .ctx("recording what the worker paused")
            .map(drop)
    }

    /// The other rows of workers named `name` on `host` not marked stopped:
    /// (id, pid). A restarted worker's predecessors of the same slot.
    pub async fn unstopped_namesakes(
        &self,
        id: Uuid,
        name: &str,
        host: &str,
    ) -> Result<Vec<(Uuid, i32)>, DbError> {
        sqlx::query_as(
            "SELECT id, pid FROM durable.workers
              WHERE name = $1 AND host = $2 AND id <> $3 AND stopped_at IS NULL",
        )
        .bind(name)
        .bind(host)
        .bind(id)
        .fetch_all(self.pool())
        .await
        .ctx("reading the worker's predecessors")
    }

    /// Marks workers stopped that are known dead (a restarted worker's
    /// predecessors whose process is gone): no longer live for `status` nor
    /// for other workers' leases. Their leases still expire as leases do.
    pub async fn mark_workers_stopped(&self, ids: &[Uuid]) -> Result<u64, DbError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let r = sqlx::query(
            "UPDATE durable.workers SET stopped_at = now() WHERE id = ANY ($1) AND stopped_at IS NULL",
        )
        .bind(ids)
        .execute(self.pool())
        .await
        .ctx("marking dead workers stopped")?;
        Ok(r.rows_affected())
    }

    pub async fn worker_stopped(&self, id: Uuid) -> Result<(), DbError> {
        self.connection("marking the worker stopped")
            .await?
            .conn()
            .worker_stopped(id)
            .await
    }

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
        self.connection("leasing steps")
            .await?
            .conn()
            .lease(worker_id, worker_name, routes, limit, ttl)
            .await
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
        self.heartbeat_within(worker_id, leases, ttl, None).await
    }

    /// [`Db::heartbeat`] that waits for any lock at most `lock_bound`: a
    /// lock another session holds then ends the call with the server's own
    /// `lock_not_available` (55P03), not a silence the caller's time bound
    /// cuts off (the worker passes one below its own bound).
    pub async fn heartbeat_within(
        &self,
        worker_id: Uuid,
        leases: &[Lease],
        ttl: StdDuration,
        lock_bound: Option<StdDuration>,
    ) -> Result<HeartbeatReport, DbError> {
        self.connection("renewing leases")
            .await?
            .conn()
            .heartbeat_within(worker_id, leases, ttl, lock_bound)
            .await
    }

    /// Moves expired leases on: `retryable_failed`, `terminal_failed` when
    /// attempts are spent (or no retry fits before the deadline), `cancelled`
    /// when cancellation was requested — reason `LEASE_EXPIRED`. Returns how
    /// many were reclaimed. Each reclaim is its own transaction.
    pub async fn reclaim_expired(&self, worker_name: &str, limit: u32) -> Result<usize, DbError> {
        self.reclaim_expired_due(worker_name, limit)
            .await
            .map(|r| r.count)
    }

    /// [`Db::reclaim_expired`], with when each step it gave a retry comes
    /// due (a worker announces them then: see [`Db::announce_steps`]).
    pub async fn reclaim_expired_due(
        &self,
        worker_name: &str,
        limit: u32,
    ) -> Result<Reclaimed, DbError> {
        self.connection("finding expired leases")
            .await?
            .conn()
            .reclaim_expired(worker_name, limit)
            .await
    }

    /// After a lease call this worker gave up waiting for (it may still run
    /// when a stalled server goes on): moves the worker's lease epoch on, so
    /// that such a call leases nothing from now on, and gives back uncounted
    /// (`LEASE_NOT_RECEIVED`) every step still leased to the worker that it
    /// does not hold (`held`: the step ids of its leases) and whose lease has
    /// not expired. Returns the new epoch and how many steps were given back.
    /// Call it with no lease call of the worker in flight.
    pub async fn revoke_lost_leases(
        &self,
        worker_id: Uuid,
        worker_name: &str,
        held: &[Uuid],
    ) -> Result<(i64, i32), DbError> {
        let mut conn = self.connection("giving back lost leases").await?;
        let mut tx = super::begin(conn.conn().conn)
            .await
            .ctx("beginning to give back lost leases")?;
        let row: (i64, i32) =
            sqlx::query_as("SELECT epoch, given_back FROM durable.revoke_lost_leases($1, $2, $3)")
                .bind(worker_id)
                .bind(worker_name)
                .bind(held)
                .fetch_one(&mut *tx)
                .await
                .ctx("giving back lost leases")?;
        tx.commit().await.ctx("committing lost leases given back")?;
        Ok(row)
    }

    /// Wakes the workers that listen for steps of `executor_kind` (the
    /// NOTIFY a step's move to a leasable state sends). A retry or a
    /// refusal's delay makes a step leasable later than its move: the
    /// worker that wrote it announces it again when it comes due, so that
    /// no worker waits for its next poll to find it.
    pub async fn announce_steps(&self, executor_kind: &str) -> Result<(), DbError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(CHANNEL_STEPS)
            .bind(executor_kind)
            .execute(&self.pool)
            .await
            .ctx("announcing steps coming due")?;
        Ok(())
    }

    /// Ends the steps whose deadline passed while they waited to be leased
    /// (`pending`, or `retryable_failed` waiting for a retry): each is taken
    /// by this worker (a lease, reason `DEADLINE_EXCEEDED`) and failed
    /// terminally with `DEADLINE_EXCEEDED` in the same transaction, the legal
    /// way out of `pending` besides a cancel. Any worker does it, whether or
    /// not it could run the step: a step that no live worker can run (a label
    /// or kind nobody offers) still ends by its deadline, and its run with
    /// it. A step still waiting for its dependencies when its deadline
    /// passed is created and ended the same way, in one transaction: it can
    /// no longer start in time, and its run need not wait for the
    /// dependencies to find that out. Returns how many were ended; each is
    /// its own transaction.
    pub async fn fail_overdue(
        &self,
        worker_id: Uuid,
        worker_name: &str,
        limit: u32,
    ) -> Result<usize, DbError> {
        self.connection("finding overdue steps")
            .await?
            .conn()
            .fail_overdue(worker_id, worker_name, limit)
            .await
    }

    /// A dedicated listener for the wake-up channels. Pool-only: LISTEN
    /// needs a connection of its own (see the module documentation).
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

/// A route's labels up to which the lease lists the label sets it may take
/// (`2^n` of them, one index probe each); a route with more finds the sets
/// its kind's ready steps have by a skip scan of the index instead (one
/// probe per distinct set, those it cannot take included).
const LISTED_LABELS: usize = 6;

/// The label sets a route with `labels` may lease (every step's labels
/// must be offered: each subset of them, `{}` included), as a JSON array of
/// objects, or JSON null past [`LISTED_LABELS`].
fn label_sets(labels: &std::collections::BTreeMap<String, String>) -> serde_json::Value {
    if labels.len() > LISTED_LABELS {
        return serde_json::Value::Null;
    }
    let pairs: Vec<(&String, &String)> = labels.iter().collect();
    let sets = (0u32..1 << pairs.len())
        .map(|mask| {
            let set: serde_json::Map<String, serde_json::Value> = pairs
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, (k, v))| ((*k).clone(), serde_json::Value::String((*v).clone())))
                .collect();
            serde_json::Value::Object(set)
        })
        .collect();
    serde_json::Value::Array(sets)
}

/// The lease statement (see [`DbConn::lease_routed`]), made once: it reads
/// other live workers' routes as `status` does ([`super::runs::routes_of`]).
static LEASE_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r#"WITH others_live AS (
                 -- the routes other live workers registered (inlined where
                 -- read: only for a candidate naming a secret its executor
                 -- may not hand out)
                 {others_live}
             ), routes AS (
                 -- a route's own secrets as an array once, not per candidate
                 SELECT u.*, ARRAY(SELECT jsonb_array_elements_text(u.secrets -> 'mine')) AS mine
                   FROM unnest($3::text[], $4::text[], $5::jsonb[], $10::jsonb[], $11::jsonb[])
                     AS u(executor_kind, kind, labels, secrets, label_sets)
             ), candidates AS (
                 -- one ordered scan of the routing index per route and label
                 -- set it offers, stopping after `limit` rows: the cost does
                 -- not grow with the backlog, nor with ready steps of kinds or
                 -- labels this worker cannot run
                 SELECT c.id FROM routes r
                 CROSS JOIN LATERAL (
                 -- a route's label sets merged in queue order, `limit` rows
                 -- at most (so the plan expects as many rows per route as
                 -- before: with a hundred per label set it joined the
                 -- candidates to a sequential scan of every step)
                 SELECT p.id, p.next_attempt_at FROM (
                     -- the label sets: every subset of the route's labels
                     -- (`label_sets`), or, for a route with too many labels
                     -- to list them (null), the distinct sets of its kind's
                     -- ready steps that it offers, found by a skip scan of
                     -- the index (one probe per set, not per step)
                     SELECT l.value AS labels
                       FROM jsonb_array_elements(CASE WHEN jsonb_typeof(r.label_sets) = 'array'
                                                      THEN r.label_sets ELSE '[]' END) AS l
                     UNION ALL
                     SELECT d.labels FROM (
                         WITH RECURSIVE d(labels) AS (
                             (SELECT s.labels FROM durable.step_runs s
                               WHERE jsonb_typeof(r.label_sets) IS DISTINCT FROM 'array'
                                 AND s.executor_kind = r.executor_kind AND s.kind = r.kind
                                 AND s.state IN ('pending', 'retryable_failed')
                               ORDER BY s.labels LIMIT 1)
                             UNION ALL
                             SELECT (SELECT s.labels FROM durable.step_runs s
                                      WHERE s.executor_kind = r.executor_kind AND s.kind = r.kind
                                        AND s.state IN ('pending', 'retryable_failed')
                                        AND s.labels > d.labels
                                      ORDER BY s.labels LIMIT 1)
                               FROM d WHERE d.labels IS NOT NULL
                         )
                         SELECT d.labels FROM d WHERE d.labels IS NOT NULL AND r.labels @> d.labels
                     ) d
                 ) l
                 CROSS JOIN LATERAL (
                     SELECT s.id, s.next_attempt_at FROM durable.step_runs s
                      WHERE s.executor_kind = r.executor_kind AND s.kind = r.kind
                        AND s.labels = l.labels
                        AND s.state IN ('pending', 'retryable_failed')
                        AND s.next_attempt_at <= now()
                        AND r.labels @> s.labels
                        AND NOT s.cancel_requested
                        -- a step past its deadline is the deadline pass's:
                        -- ended by it at the attempt it had (time audit: a
                        -- lease counted an attempt that never ran)
                        AND (s.deadline IS NULL OR s.deadline > now())
                        AND s.id <> ALL ($8::uuid[])
                        -- a step whose secrets this executor may hand
                        -- out, or that no other executor, of this worker or
                        -- of another live one, may run either (see
                        -- SecretFilter): it is left to the one that may
                        AND (jsonb_typeof(r.secrets) = 'null' OR cardinality(s.secrets) = 0
                             OR s.secrets <@ r.mine
                             OR (NOT EXISTS (
                                     SELECT 1 FROM jsonb_array_elements(r.secrets -> 'others') AS o
                                      WHERE (o -> 'labels') @> s.labels
                                        AND s.secrets <@ ARRAY(SELECT jsonb_array_elements_text(o -> 'secrets')))
                                 AND NOT EXISTS (
                                     SELECT 1 FROM others_live o
                                      WHERE o.executor_kind = s.executor_kind AND o.kind = s.kind
                                        AND o.labels @> s.labels
                                        AND s.secrets <@ ARRAY(SELECT jsonb_array_elements_text(o.secrets)))))
                        -- a scalar subquery, one primary-key probe per
                        -- candidate: as NOT EXISTS the planner could make it
                        -- an anti-join over a seq scan of every run (it
                        -- expects few cancelled ones), O(runs) per lease.
                        -- A run already terminal (made so by hand) runs no
                        -- step again: its side effects would run for a run
                        -- that is over, every outcome refused (re-check audit)
                        AND NOT coalesce((SELECT wr.cancel_requested
                                                 OR durable.run_state_is_terminal(wr.state)
                                            FROM durable.workflow_runs wr
                                           WHERE wr.id = s.run_id), false)
                      ORDER BY s.next_attempt_at
                      LIMIT $6
                      FOR NO KEY UPDATE OF s SKIP LOCKED
                 ) p
                 ORDER BY p.next_attempt_at
                 LIMIT $6
                 ) c
                 -- the worker's lease epoch (NULL: not fenced), once per
                 -- call: a call cut off and run late leases nothing
                 WHERE (SELECT durable.lease_epoch_ok($1, $9))
                 ORDER BY c.next_attempt_at
                 LIMIT $6
             )
             UPDATE durable.step_runs s
                SET state = 'leased', owner_worker_id = $1, lease_token = gen_random_uuid(),
                    lease_expires_at = now() + make_interval(secs => $7::double precision / 1000.0),
                    leased_at = now(), started_at = NULL, executor_pid = NULL, attempt = s.attempt + 1,
                    transition_reason = 'LEASED', transition_by = $2
              -- the picks' keys probed (as a join with the picks the
              -- planner read a small step_runs whole and hashed it)
              WHERE s.id = ANY (ARRAY(SELECT c.id FROM candidates c))
          RETURNING s.id, s.run_id, s.name, s.executor_kind, s.kind, s.labels, s.input::text AS input, s.idempotency_key,
                    s.attempt, s.lease_token, s.retry, s.timeout_ms, s.heartbeat_timeout_ms, s.deadline,
                    s.secrets, s.checkpoint, s.cancel_requested, s.error_code AS last_error,
                    -- a probe per row: as EXISTS the planner may hash a
                    -- scan of every definition when it expects many rows
                    coalesce((SELECT true FROM durable.step_defs d
                               WHERE d.run_id = s.run_id AND d.name = s.name
                                 AND cardinality(d.depends_on) > 0
                               LIMIT 1), false) AS has_dependencies"#,
        others_live =
            super::runs::routes_of(&format!("{} AND w.id <> $1", super::runs::LIVE_WORKER))
    )
});

impl DbConn<'_> {
    /// See [`Db::register_worker`].
    pub async fn register_worker(
        &mut self,
        id: Uuid,
        name: &str,
        host: &str,
        capabilities: &serde_json::Value,
        heartbeat_interval: Option<StdDuration>,
    ) -> Result<(), DbError> {
        let interval_ms =
            heartbeat_interval.map(|d| i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1));
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query(
            "INSERT INTO durable.workers (id, name, host, pid, capabilities, heartbeat_interval_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(name)
        .bind(host)
        .bind(std::process::id() as i32)
        .bind(capabilities)
        .bind(interval_ms)
        .execute(&mut *s)
        .await
        .ctx("registering the worker")?;
        s.done().await
    }

    /// See [`Db::set_worker_routes`].
    pub async fn set_worker_routes(
        &mut self,
        id: Uuid,
        executor: &str,
        routes: &[Route],
    ) -> Result<(), DbError> {
        let routes = serde_json::to_value(routes)
            .map_err(|e| DbError::Corrupt(format!("routes as JSON: {e}")))?;
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query(
            "UPDATE durable.workers w
                SET capabilities = (SELECT jsonb_agg(CASE WHEN e ->> 'executor' = $2
                                                         THEN jsonb_set(e, '{routes}', $3)
                                                         ELSE e END ORDER BY n)
                                      FROM jsonb_array_elements(w.capabilities) WITH ORDINALITY AS x(e, n))
              WHERE w.id = $1",
        )
        .bind(id)
        .bind(executor)
        .bind(routes)
        .execute(&mut *s)
        .await
        .ctx("updating the worker's routes")?;
        s.done().await
    }

    /// See [`Db::worker_stopped`].
    pub async fn worker_stopped(&mut self, id: Uuid) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query("UPDATE durable.workers SET stopped_at = now() WHERE id = $1")
            .bind(id)
            .execute(&mut *s)
            .await
            .ctx("marking the worker stopped")?;
        s.done().await
    }

    // -----------------------------------------------------------------------
    // the queue

    /// See [`Db::lease`].
    pub async fn lease(
        &mut self,
        worker_id: Uuid,
        worker_name: &str,
        routes: &[Route],
        limit: u32,
        ttl: StdDuration,
    ) -> Result<Vec<LeasedStep>, DbError> {
        self.lease_except(worker_id, worker_name, routes, limit, ttl, &[], None)
            .await
    }

    /// [`DbConn::lease`], passing over the steps `except` (the ones this
    /// worker refused a moment ago, left to other workers first), in the
    /// worker's lease `epoch` (`None`: not fenced; see
    /// [`Db::revoke_lost_leases`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn lease_except(
        &mut self,
        worker_id: Uuid,
        worker_name: &str,
        routes: &[Route],
        limit: u32,
        ttl: StdDuration,
        except: &[Uuid],
        epoch: Option<i64>,
    ) -> Result<Vec<LeasedStep>, DbError> {
        self.lease_routed(
            worker_id,
            worker_name,
            routes,
            &[],
            limit,
            ttl,
            except,
            epoch,
        )
        .await
    }

    /// [`DbConn::lease_except`], each route with its [`SecretFilter`] (by
    /// position; a route without one takes steps whatever secrets they name).
    #[allow(clippy::too_many_arguments)]
    pub async fn lease_routed(
        &mut self,
        worker_id: Uuid,
        worker_name: &str,
        routes: &[Route],
        filters: &[Option<super::SecretFilter>],
        limit: u32,
        ttl: StdDuration,
        except: &[Uuid],
        epoch: Option<i64>,
    ) -> Result<Vec<LeasedStep>, DbError> {
        if routes.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let filters = filter_params(routes.len(), filters);
        let eks: Vec<&str> = routes.iter().map(|r| r.executor_kind.as_str()).collect();
        let kinds: Vec<&str> = routes.iter().map(|r| r.kind.as_str()).collect();
        let labels: Vec<serde_json::Value> = routes
            .iter()
            .map(|r| serde_json::to_value(&r.labels).unwrap_or_default())
            .collect();
        let label_sets: Vec<serde_json::Value> =
            routes.iter().map(|r| label_sets(&r.labels)).collect();
        let mut s = Scope::enter(self.conn).await?;
        let rows = sqlx::query(&LEASE_SQL)
            .bind(worker_id)
            .bind(worker_name)
            .bind(&eks)
            .bind(&kinds)
            .bind(&labels)
            .bind(limit as i64)
            .bind(ttl.as_millis() as f64)
            .bind(except)
            .bind(epoch)
            .bind(&filters)
            .bind(&label_sets)
            .fetch_all(&mut *s)
            .await
            .ctx("leasing steps")?;
        s.done().await?;
        rows.into_iter().map(leased_from_row).collect()
    }

    /// See [`Db::heartbeat`].
    pub async fn heartbeat(
        &mut self,
        worker_id: Uuid,
        leases: &[Lease],
        ttl: StdDuration,
    ) -> Result<HeartbeatReport, DbError> {
        self.heartbeat_within(worker_id, leases, ttl, None).await
    }

    /// See [`Db::heartbeat_within`].
    pub async fn heartbeat_within(
        &mut self,
        worker_id: Uuid,
        leases: &[Lease],
        ttl: StdDuration,
        lock_bound: Option<StdDuration>,
    ) -> Result<HeartbeatReport, DbError> {
        let ids: Vec<Uuid> = leases.iter().map(|l| l.step_run_id).collect();
        let tokens: Vec<Uuid> = leases.iter().map(|l| l.token).collect();
        let bound = lock_bound.map(|d| format!("{}ms", d.as_millis().max(1)));
        let mut s = Scope::enter(self.conn).await?;
        let rows = sqlx::query(
            "SELECT step_run_id, outcome, valid_ms FROM durable.renew_leases($1, $2, $3, $4, $5, $6)",
        )
        .bind(worker_id)
        .bind(&ids)
        .bind(&tokens)
        .bind(ttl.as_millis() as f64)
        .bind(HEARTBEAT_ROW_WAIT)
        .bind(bound)
        .fetch_all(&mut *s)
        .await
        .ctx("renewing leases")?;
        s.done().await?;
        let mut report = HeartbeatReport::default();
        let mut not_renewed = HashSet::new();
        for r in rows {
            let id: Uuid = r.get("step_run_id");
            match r.get::<&str, _>("outcome") {
                "cancel_requested" => report.cancel_requested.push(id),
                "busy" => {
                    not_renewed.insert(id);
                    report.busy.push(id);
                    let ms: Option<f64> = r.get("valid_ms");
                    if let Some(ms) = ms.filter(|ms| ms.is_finite() && *ms > 0.0) {
                        report
                            .busy_valid_for
                            .insert(id, StdDuration::from_secs_f64(ms / 1000.0));
                    }
                }
                "lost" => {
                    not_renewed.insert(id);
                    report.lost.push(id);
                }
                other => {
                    return Err(DbError::Corrupt(format!(
                        "renew_leases answered {other:?} for step {id}"
                    )))
                }
            }
        }
        report.renewed_ids = if not_renewed.is_empty() {
            ids
        } else {
            ids.into_iter()
                .filter(|id| !not_renewed.contains(id))
                .collect()
        };
        report.renewed = report.renewed_ids.len();
        Ok(report)
    }

    /// See [`Db::reclaim_expired_due`]. Inside a caller's transaction the
    /// whole call is one savepoint and each reclaim a savepoint within it.
    pub async fn reclaim_expired(
        &mut self,
        worker_name: &str,
        limit: u32,
    ) -> Result<Reclaimed, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let candidates: Vec<(Uuid, Uuid)> = sqlx::query_as(
            "SELECT s.id, s.run_id FROM durable.step_runs s
               LEFT JOIN durable.lease_clock c ON c.step_run_id = s.id AND c.lease_token = s.lease_token
              WHERE durable.step_is_live(s.state) AND coalesce(c.expires_at, s.lease_expires_at) < now()
                -- rows no fenced write can fail (changed by hand: a live
                -- step without a token, or under a run already terminal)
                -- are left out: skipped at every pass, a limit's worth of
                -- them kept every other lease from being reclaimed
                AND s.lease_token IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM durable.workflow_runs w
                                 WHERE w.id = s.run_id AND durable.run_state_is_terminal(w.state))
              ORDER BY coalesce(c.expires_at, s.lease_expires_at)
              LIMIT $1",
        )
        .bind(limit as i64)
        .fetch_all(&mut *s)
        .await
        .ctx("finding expired leases")?;
        let mut reclaimed = Reclaimed::default();
        let mut held = HeldRuns::default();
        for (id, run) in candidates {
            // run lock first, like every step write (a run another
            // transaction holds is left for a later pass); then the step,
            // skipping one another worker is reclaiming or its owner is
            // writing right now
            let Some(mut tx) = held.begin(&mut s, id, run).await? else {
                continue;
            };
            let row = sqlx::query(
                "SELECT id, lease_token, attempt, attempt - uncounted_attempts AS counted, uncounted_attempts AS uncounted, retry, deadline,
                        cancel_requested, now() AS db_now, executor_kind,
                        durable.run_failed_it(run_id) AS run_failed
                   FROM durable.step_runs s
                  WHERE id = $1 AND state IN ('leased', 'running')
                    AND coalesce((SELECT c.expires_at FROM durable.lease_clock c
                                   WHERE c.step_run_id = s.id AND c.lease_token = s.lease_token),
                                 lease_expires_at) < now()
                  FOR NO KEY UPDATE SKIP LOCKED",
            )
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .ctx("locking an expired lease")?;
            let Some(row) = row else {
                continue;
            };
            // the lease clock's row too, once a renewal in flight has
            // committed: a heartbeat that renewed the lease meanwhile keeps
            // it; a row held longer (by hand) leaves the step for a later pass
            let token: Option<Uuid> = row.try_get("lease_token").ctx("reading a lease")?;
            let clock: String = sqlx::query_scalar("SELECT durable.lock_lease_clock($1, $2, $3)")
                .bind(id)
                .bind(token)
                .bind(super::writes::PASS_LOCK_WAIT)
                .fetch_one(&mut *tx)
                .await
                .ctx("locking an expired lease's clock")?;
            match clock.as_str() {
                "renewed" => continue,
                "held" => {
                    tracing::info!(step_run_id = %id, "another transaction holds this lease's clock row: the step is left for a later pass, the others go on");
                    continue;
                }
                _ => {}
            }
            let failure = Failure {
                code: "LEASE_EXPIRED".into(),
                retryable: true,
                next_retry_delay: None,
            };
            let why = "the owning worker stopped renewing its lease".to_owned();
            match fail_locked_row(&mut tx, id, &row, worker_name, failure, why).await {
                Ok(retry_at) => {
                    tx.commit().await.ctx("committing a reclaim")?;
                    reclaimed.count += 1;
                    if let (Some(at), Ok(kind)) = (retry_at, row.try_get("executor_kind")) {
                        reclaimed.due.push((kind, at));
                    }
                }
                Err(e) => skip_unless_transient(e, id, run, "an expired lease")?,
            }
        }
        s.done().await?;
        Ok(reclaimed)
    }
}

impl DbConn<'_> {
    /// See [`Db::fail_overdue`]. Inside a caller's transaction the whole
    /// call is one savepoint and each step a savepoint within it.
    pub async fn fail_overdue(
        &mut self,
        worker_id: Uuid,
        worker_name: &str,
        limit: u32,
    ) -> Result<usize, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        // the partial index step_runs_overdue holds exactly these rows
        let candidates: Vec<(Uuid, Uuid)> = sqlx::query_as(
            "SELECT s.id, s.run_id FROM durable.step_runs s
              WHERE s.state IN ('pending', 'retryable_failed') AND s.deadline IS NOT NULL
                AND s.deadline < now()
                -- as the reclaim: a run made terminal by hand is left out
                AND NOT EXISTS (SELECT 1 FROM durable.workflow_runs w
                                 WHERE w.id = s.run_id AND durable.run_state_is_terminal(w.state))
              ORDER BY s.deadline
              LIMIT $1",
        )
        .bind(limit as i64)
        .fetch_all(&mut *s)
        .await
        .ctx("finding overdue steps")?;
        // and steps still waiting for their dependencies (the partial index
        // step_defs_waiting_deadline): they can no longer start in time
        let waiting: Vec<(Uuid, String)> = sqlx::query_as(
            "SELECT d.run_id, d.name FROM durable.step_defs d
              WHERE d.deadline IS NOT NULL AND d.deadline < now() AND d.deps_remaining > 0
                AND NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                 WHERE s.run_id = d.run_id AND s.name = d.name)
              ORDER BY d.deadline
              LIMIT $1",
        )
        .bind(limit as i64)
        .fetch_all(&mut *s)
        .await
        .ctx("finding overdue waiting steps")?;
        let mut ended = 0;
        let mut held = HeldRuns::default();
        for (id, run) in candidates {
            // run lock first, like every step write (a run another
            // transaction holds is left for a later pass); a step being
            // leased or cancelled right now is skipped (the lease fails it at
            // once, a cancel ends it anyway)
            let Some(tx) = held.begin(&mut s, id, run).await? else {
                continue;
            };
            match take_and_fail_overdue(tx, id, worker_id, worker_name, Overdue::Queued).await {
                Ok(took) => ended += usize::from(took),
                Err(e) => skip_unless_transient(e, id, run, "an overdue step")?,
            }
        }
        for (run, name) in waiting {
            if held.0.contains(&run) {
                continue;
            }
            let mut tx = super::begin(&mut s)
                .await
                .ctx("beginning an overdue waiting step's failure")?;
            let id: Option<Uuid> =
                sqlx::query_scalar("SELECT durable.create_overdue_waiting_step($1, $2, $3)")
                    .bind(run)
                    .bind(&name)
                    .bind(super::writes::PASS_LOCK_WAIT)
                    .fetch_one(&mut *tx)
                    .await
                    .ctx("creating an overdue waiting step")?;
            let Some(id) = id else {
                continue;
            };
            match take_and_fail_overdue(tx, id, worker_id, worker_name, Overdue::Waiting).await {
                Ok(took) => ended += usize::from(took),
                Err(e) => skip_unless_transient(e, id, run, "an overdue waiting step")?,
            }
        }
        s.done().await?;
        Ok(ended)
    }
}

/// Takes an overdue step this transaction's run lock covers (a lease,
/// reason `DEADLINE_EXCEEDED`, that is no attempt: the attempt number stays
/// that of the last attempt that ran, 0 for a step that never ran), fails it
/// terminally `DEADLINE_EXCEEDED`, its
/// message saying when the deadline passed (see [`Overdue`]), and commits; `false` (nothing
/// committed) when it was no longer one to take (leased, cancelled, its
/// deadline moved).
async fn take_and_fail_overdue(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    id: Uuid,
    worker_id: Uuid,
    worker_name: &str,
    overdue: Overdue,
) -> Result<bool, DbError> {
    let row = sqlx::query(
        "UPDATE durable.step_runs s
            SET state = 'leased', owner_worker_id = $2, lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute', leased_at = now(),
                started_at = NULL,
                transition_reason = 'DEADLINE_EXCEEDED', transition_by = $3
          WHERE s.id = (SELECT c.id FROM durable.step_runs c
                         WHERE c.id = $1 AND c.state IN ('pending', 'retryable_failed')
                           AND c.deadline < now() AND NOT c.cancel_requested
                           AND NOT coalesce((SELECT wr.cancel_requested FROM durable.workflow_runs wr
                                              WHERE wr.id = c.run_id), false)
                           FOR NO KEY UPDATE SKIP LOCKED)
      RETURNING s.lease_token, s.attempt, s.attempt - s.uncounted_attempts AS counted, s.uncounted_attempts AS uncounted,
                s.retry, s.deadline, false AS cancel_requested, now() AS db_now",
    )
    .bind(id)
    .bind(worker_id)
    .bind(worker_name)
    .fetch_optional(&mut *tx)
    .await
    .ctx("taking an overdue step")?;
    let Some(row) = row else {
        return Ok(false);
    };
    let failure = Failure {
        code: "DEADLINE_EXCEEDED".into(),
        retryable: false,
        next_retry_delay: None,
    };
    let when = match overdue {
        Overdue::Waiting => "while it waited for its dependencies",
        // a step that ran before and waits for its retry missed its next
        // attempt, not its start (re-check audit)
        Overdue::Queued if row.try_get::<i32, _>("attempt").is_ok_and(|n| n > 0) => {
            "before its next attempt could start"
        }
        Overdue::Queued => "before a worker could start it",
    };
    let why = match row.get::<Option<DateTime<Utc>>, _>("deadline") {
        Some(d) => format!("the step deadline {d} passed {when}"),
        None => format!("the step deadline passed {when}"),
    };
    fail_locked_row(&mut tx, id, &row, worker_name, failure, why).await?;
    tx.commit()
        .await
        .ctx("committing an overdue step's failure")?;
    Ok(true)
}

/// Where an overdue step was when its deadline passed.
#[derive(Clone, Copy)]
enum Overdue {
    /// In the queue: pending, or waiting for its retry.
    Queued,
    /// Still waiting for its dependencies (created just now to be failed).
    Waiting,
}

/// A pass's step that could not be failed: a transient error (the
/// connection, a lock wait) ends the pass, which the next one repeats; any
/// other (a row the guards refuse to change, a row that does not decode) is
/// this step's alone: it is logged and skipped, and the pass goes on. One
/// such row, first by expiry, stopped every reclaim of every worker
/// (throughput-core audit: a run made terminal by hand under a running step).
fn skip_unless_transient(e: DbError, step: Uuid, run: Uuid, what: &str) -> Result<(), DbError> {
    if e.is_transient() {
        return Err(e);
    }
    tracing::error!(step_run_id = %step, run_id = %run, error = %e,
        "{what} cannot be failed: it is skipped and the pass goes on (its row or its run's is \
         not as the runtime leaves them; cancel the run, or repair the rows by hand)");
    Ok(())
}

/// The runs a pass found held by another transaction: their other steps are
/// not tried again in that pass (each try waits its lock wait).
#[derive(Default)]
struct HeldRuns(HashSet<Uuid>);

impl HeldRuns {
    /// Begins the write of step `id` of run `run` with its run locked, or
    /// `None` when that run is held (now, or earlier in this pass).
    async fn begin<'c>(
        &mut self,
        conn: &'c mut PgConnection,
        id: Uuid,
        run: Uuid,
    ) -> Result<Option<sqlx::Transaction<'c, sqlx::Postgres>>, DbError> {
        if self.0.contains(&run) {
            return Ok(None);
        }
        let tx = begin_step_write_unless_held(conn, id).await?;
        if tx.is_none() {
            tracing::info!(%run, step_run_id = %id, "another transaction holds this run's row: its step is left for a later pass, the others go on");
            self.0.insert(run);
        }
        Ok(tx)
    }
}

/// Fails the attempt of a step this transaction locked (or just took), read
/// as `row` (its lease token, attempt, counted attempts, retry policy,
/// deadline, cancel flag and the database's now), with `failure`: the state
/// machine decides retry or terminal, the attempt's ending event (if it
/// started) and the fenced write follow. The reclaim and the overdue steps.
async fn fail_locked_row(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    step_run_id: Uuid,
    row: &sqlx::postgres::PgRow,
    worker_name: &str,
    failure: Failure,
    message: String,
) -> Result<Option<DateTime<Utc>>, DbError> {
    // read without panicking: a row changed by hand (a live step without a
    // lease token) made every worker's reclaim panic, and the workers exit
    let col = |c: &str, e: sqlx::Error| DbError::Corrupt(format!("step {step_run_id}: {c}: {e}"));
    let lease = Lease {
        step_run_id,
        token: row
            .try_get("lease_token")
            .map_err(|e| col("lease_token", e))?,
        attempt: row
            .try_get::<i32, _>("attempt")
            .map_err(|e| col("attempt", e))?
            .max(0) as u32,
    };
    let policy: RetryPolicy =
        serde_json::from_value(row.try_get("retry").map_err(|e| col("retry", e))?)
            .map_err(|e| DbError::Corrupt(format!("retry policy: {e}")))?;
    let facts = StepFacts {
        attempt: row
            .try_get::<i32, _>("counted")
            .map_err(|e| col("counted", e))?
            .max(0) as u32,
        uncounted: row
            .try_get::<i32, _>("uncounted")
            .map_err(|e| col("uncounted", e))?
            .max(0) as u32,
        policy: &policy,
        deadline: row.try_get("deadline").map_err(|e| col("deadline", e))?,
        cancel_requested: row
            .try_get("cancel_requested")
            .map_err(|e| col("cancel_requested", e))?,
    };
    let report = FailureReport {
        failure,
        message,
        details: None,
        sequence: None,
    };
    let now = row.try_get("db_now").map_err(|e| col("db_now", e))?;
    // (the deadline pass's rows have no cancel request, nor this column)
    let run_failed = row.try_get("run_failed").unwrap_or(false);
    let decision = state::decide_failure(&facts, &report.failure, now, rand::random())
        .by_run_failure(run_failed, &report.failure.code);
    let ending = format!("{}: {}", report.failure.code, report.message);
    insert_ending_event(tx, &lease, decision.to.as_str(), &ending).await?;
    write_failure(tx, &lease, worker_name, &report, &decision).await?;
    Ok(decision.next_attempt_at)
}

/// What a reclaim pass did: how many expired leases it moved on, and the
/// executor kind and retry time of each it gave a retry.
#[derive(Debug, Default)]
pub struct Reclaimed {
    pub count: usize,
    pub due: Vec<(String, DateTime<Utc>)>,
}

/// The deepest input the worker decodes. Submit refuses input nested more
/// than 128 levels (`durable.check_secret_keys`), one more than serde_json's
/// default recursion limit takes, and a step submitted through SQL at that
/// depth made the worker panic on the row, at every lease. A deeper row
/// (stored before submit checked) fails its step.
const MAX_INPUT_DEPTH: usize = 256;

/// A step's input from its `jsonb` text (see [`crate::json::parse_bounded`]:
/// a lease pays no depth scan).
fn decode_input(text: &str) -> Result<serde_json::Value, String> {
    crate::json::parse_bounded(text.as_bytes(), MAX_INPUT_DEPTH).map_err(|e| e.to_string())
}

/// The lease statement's per-route secret filters (JSON, `null` for a route
/// without one), by position.
fn filter_params(routes: usize, filters: &[Option<super::SecretFilter>]) -> Vec<serde_json::Value> {
    (0..routes)
        .map(|i| {
            filters
                .get(i)
                .and_then(Option::as_ref)
                .map(|f| serde_json::to_value(f).unwrap_or_default())
                .unwrap_or(serde_json::Value::Null)
        })
        .collect()
}

pub(super) fn leased_from_row(r: sqlx::postgres::PgRow) -> Result<LeasedStep, DbError> {
    let retry: RetryPolicy = serde_json::from_value(r.get("retry"))
        .map_err(|e| DbError::Corrupt(format!("retry policy: {e}")))?;
    // never a panic on a row the decoder refuses: the step fails instead
    let (input, input_error) = match r
        .try_get::<String, _>("input")
        .map_err(|e| e.to_string())
        .and_then(|t| decode_input(&t))
    {
        Ok(v) => (v, None),
        Err(e) => (
            serde_json::Value::Null,
            Some(format!("the step's input cannot be decoded: {e}")),
        ),
    };
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
        input,
        idempotency_key: r.get("idempotency_key"),
        retry,
        timeout_ms: r.get("timeout_ms"),
        heartbeat_timeout_ms: r.get("heartbeat_timeout_ms"),
        deadline: r.get("deadline"),
        secrets: r.get("secrets"),
        checkpoint: r.get("checkpoint"),
        cancel_requested: r.get("cancel_requested"),
        has_dependencies: r.get("has_dependencies"),
        last_error: r.get("last_error"),
        input_error,
    })
}

#[cfg(test)]
mod input_tests {
    use super::{decode_input, MAX_INPUT_DEPTH};

    fn nested(depth: usize) -> String {
        format!("{}{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn input_as_deep_as_submit_allows_is_decoded_and_deeper_is_an_error_not_a_panic() {
        // 128 levels: what durable.submit_run accepts; serde_json's default
        // limit refuses it
        assert!(serde_json::from_str::<serde_json::Value>(&nested(128)).is_err());
        assert!(decode_input(&nested(128)).is_ok());
        assert!(decode_input(&nested(MAX_INPUT_DEPTH)).is_ok());
        let err = decode_input(&nested(MAX_INPUT_DEPTH + 1)).expect_err("too deep");
        assert!(err.contains("levels deep"), "{err}");
        assert!(decode_input("{\"a\": 1} x").is_err(), "trailing text");
        assert_eq!(
            decode_input(r#"{"a": [1, 2]}"#).expect("plain"),
            serde_json::json!({"a": [1, 2]})
        );
    }
}

#[cfg(test)]
mod label_set_tests {
    use super::{label_sets, LISTED_LABELS};
    use serde_json::json;
    use std::collections::BTreeMap;

    fn labels(n: usize) -> BTreeMap<String, String> {
        (0..n).map(|i| (format!("k{i}"), format!("v{i}"))).collect()
    }

    #[test]
    fn a_route_offers_every_subset_of_its_labels_up_to_the_listed_count() {
        assert_eq!(label_sets(&BTreeMap::new()), json!([{}]));
        let two: BTreeMap<String, String> =
            [("gpu".into(), "a100".into()), ("zone".into(), "a".into())].into();
        let sets = label_sets(&two);
        let mut got: Vec<String> = sets
            .as_array()
            .expect("a list")
            .iter()
            .map(|s| s.to_string())
            .collect();
        got.sort();
        let mut want = vec![
            json!({}).to_string(),
            json!({"gpu": "a100"}).to_string(),
            json!({"zone": "a"}).to_string(),
            json!({"gpu": "a100", "zone": "a"}).to_string(),
        ];
        want.sort();
        assert_eq!(got, want);
        assert_eq!(
            label_sets(&labels(LISTED_LABELS)).as_array().map(Vec::len),
            Some(1 << LISTED_LABELS)
        );
        assert_eq!(label_sets(&labels(LISTED_LABELS + 1)), json!(null));
    }
}
