//! Single fenced writes of one step by its lease holder: start, events,
//! completion, failure, cancel, refusal, release; and the helpers every step
//! writer shares (the run lock first, the fence, the failure write). The
//! worker writes them through its ledger (`ledger.rs`), which runs the
//! `DbConn` forms of these inside its batch's transaction, each in a
//! savepoint of its own; the `Db` forms are for every other caller.

use super::*;

impl Db {
    /// The executor accepted the job: `leased → running`, with its event.
    pub async fn mark_running(
        &self,
        lease: &Lease,
        worker_name: &str,
        executor_pid: i32,
        event: &NewEvent<'_>,
    ) -> Result<(), DbError> {
        self.connection("marking a step running")
            .await?
            .conn()
            .mark_running(lease, worker_name, executor_pid, event)
            .await
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
        self.connection("recording progress events")
            .await?
            .conn()
            .record_events(lease, events)
            .await
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
        self.connection("completing a step")
            .await?
            .conn()
            .complete(lease, worker_name, output, artifacts, sequence)
            .await
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
        self.connection("beginning a step write")
            .await?
            .conn()
            .fail(lease, worker_name, report, jitter)
            .await
    }

    /// Cancellation is confirmed and the executor has exited: `→ cancelled`.
    pub async fn confirm_cancelled(
        &self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        self.connection("beginning a step write")
            .await?
            .conn()
            .confirm_cancelled(lease, worker_name, message)
            .await
    }

    /// The executor refused the job before executing it (routing mismatch, or
    /// a retryable error before `accepted`): nothing ran, so the attempt is
    /// given back (also when the refusal ends the step) and the step goes
    /// back to the queue after `delay`. Refusals
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
        self.connection("beginning a step write")
            .await?
            .conn()
            .refuse(lease, worker_name, code, message, delay, max_refusals)
            .await
    }

    /// A draining worker stopped the attempt (drain timeout): the step goes
    /// back to the queue at once, in its place (its due time is left as it
    /// was: it is leased before steps that became due after it), and the
    /// attempt does not count against
    /// `max_attempts` (a routine redeploy must not burn attempts). A step with
    /// a cancel request (its own or its run's) is cancelled instead. Fenced.
    pub async fn release(
        &self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        self.connection("beginning a step write")
            .await?
            .conn()
            .release(lease, worker_name, message)
            .await
    }
}

/// The same writes on a caller's connection. The ones that take the run lock
/// begin a transaction of their own (`conn.begin()`: a SAVEPOINT inside a
/// caller's transaction); the single statements get a savepoint there too
/// (`Scope`). Either way a lost fence or a refused write undoes only its own
/// work and leaves the caller's transaction usable.
impl DbConn<'_> {
    /// The executor accepted the job: `leased → running`, with its event.
    pub async fn mark_running(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        executor_pid: i32,
        event: &NewEvent<'_>,
    ) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
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
                .fetch_one(&mut *s)
                .await
                .ctx("marking a step running")?;
        fenced(u64::from(started), lease)?;
        s.done().await
    }

    /// Persists a progress event (and its checkpoint, if any), fenced.
    pub async fn record_event(
        &mut self,
        lease: &Lease,
        event: &NewEvent<'_>,
    ) -> Result<(), DbError> {
        self.record_events(lease, std::slice::from_ref(event)).await
    }

    /// Persists a batch of one attempt's progress events in one statement,
    /// fenced by the lease. Idempotent (a retried batch inserts nothing twice).
    /// The step row is rewritten only when the batch carries a checkpoint (the
    /// last one wins); plain events only read it for the fence.
    pub async fn record_events(
        &mut self,
        lease: &Lease,
        events: &[NewEvent<'_>],
    ) -> Result<(), DbError> {
        self.record_events_renewing(lease, events, None).await
    }

    /// [`DbConn::record_events`]; a write that carries a checkpoint also
    /// renews the lease for `renew` (to its transaction's start + `renew`,
    /// never shorter than it was, never once expired). Its row lock makes
    /// the heartbeat skip the lease while it is held: an executor sending
    /// checkpoints without pause would otherwise run its lease clock out.
    pub async fn record_events_renewing(
        &mut self,
        lease: &Lease,
        events: &[NewEvent<'_>],
        renew: Option<StdDuration>,
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
            // the renewal goes to the lease clock (never shorter, never once
            // expired); the step row stays locked by this write, so a
            // heartbeat's first renewal of the lease skips it meanwhile
            "UPDATE durable.step_runs s SET checkpoint = $3
              WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')
          RETURNING id, attempt, lease_token,
                    coalesce((SELECT c.expires_at FROM durable.lease_clock c
                               WHERE c.step_run_id = s.id AND c.lease_token = s.lease_token),
                             s.lease_expires_at) AS expiry
         ), renewal AS (
             INSERT INTO durable.lease_clock (step_run_id, lease_token, expires_at)
             SELECT s.id, s.lease_token, greatest(s.expiry, now() + make_interval(secs => $10::float8 / 1000.0))
               FROM s
              WHERE $10::float8 IS NOT NULL AND s.expiry > now()
             ON CONFLICT (step_run_id) DO UPDATE SET expires_at = greatest(lease_clock.expires_at, excluded.expires_at)
              WHERE lease_clock.lease_token = excluded.lease_token AND lease_clock.expires_at > now()"
        } else {
            // (no row lock: no renewal; $10 is only typed)
            "SELECT id, attempt, $10::float8 AS renew_ms FROM durable.step_runs
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
        let mut s = Scope::enter(self.conn).await?;
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
            .bind(renew.map(|d| d.as_millis() as f64))
            .fetch_one(&mut *s)
            .await
            .ctx("recording progress events")?;
        fenced(n.max(0) as u64, lease)?;
        s.done().await
    }

    /// The attempt succeeded: records its artifacts (whose blobs are already
    /// stored: no bytes travel here), lineage, the terminal event and the
    /// output, and moves `running → succeeded` — one short transaction,
    /// fenced (`durable.complete_step_stored`). The run is recomputed (and
    /// dependents created) by the database in the same transaction.
    pub async fn complete(
        &mut self,
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
        let mut s = Scope::enter(self.conn).await?;
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
        .fetch_one(&mut *s)
        .await
        .ctx("completing a step")?;
        let ids = ids.ok_or(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })?;
        s.done().await?;
        Ok(ids)
    }

    /// The attempt failed: the state module decides retry, terminal failure or
    /// cancellation from the row's current facts; fenced.
    pub async fn fail(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        report: &FailureReport,
        jitter: f64,
    ) -> Result<FailureDecision, DbError> {
        let mut tx = begin_step_write(self.conn, lease.step_run_id).await?;
        let row = sqlx::query(
            "SELECT attempt - uncounted_attempts AS counted, uncounted_attempts AS uncounted, retry, deadline, cancel_requested, now() AS db_now,
                    durable.run_failed_it(run_id) AS run_failed
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
            uncounted: row.get::<i32, _>("uncounted").max(0) as u32,
            policy: &policy,
            deadline: row.get("deadline"),
            cancel_requested: row.get("cancel_requested"),
        };
        let decision = state::decide_failure(&facts, &report.failure, row.get("db_now"), jitter)
            .by_run_failure(row.get("run_failed"), &report.failure.code);
        match report.sequence {
            Some(seq) => {
                // `CODE: message`, as every ending the supervisor writes:
                // `events` showed an executor's message without its code
                // (operator audit)
                let message = if report.message.is_empty() {
                    report.failure.code.clone()
                } else {
                    format!("{}: {}", report.failure.code, report.message)
                };
                insert_terminal_event(&mut tx, lease, seq, decision.to.as_str(), &message).await?
            }
            None => {
                let message = format!("{}: {}", report.failure.code, report.message);
                insert_ending_event(&mut tx, lease, decision.to.as_str(), &message).await?
            }
        }
        write_failure(&mut tx, lease, worker_name, report, &decision).await?;
        tx.commit().await.ctx("committing a failure")?;
        Ok(decision)
    }

    /// Cancellation is confirmed and the executor has exited: `→ cancelled`.
    pub async fn confirm_cancelled(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        let mut tx = begin_step_write(self.conn, lease.step_run_id).await?;
        // a step whose run failed was cancelled because of it, not on
        // anyone's request (the worker only learns that a cancel was asked):
        // the message names the step that failed the run
        let stored: Option<String> = sqlx::query_scalar(
            "UPDATE durable.step_runs s
                SET state = 'cancelled', error_code = 'CANCELLED',
                    error_message = coalesce(
                        (SELECT 'cancelled because the run failed: step ' || f.name || ' ended '
                                || coalesce(f.error_code, 'terminal_failed')
                           FROM durable.step_runs f
                          WHERE f.run_id = s.run_id AND f.state = 'terminal_failed'
                            AND NOT (SELECT wr.cancel_requested FROM durable.workflow_runs wr
                                      WHERE wr.id = s.run_id)
                          ORDER BY f.finished_at, f.id LIMIT 1),
                        $4),
                    error_retryable = false,
                    transition_reason = CASE WHEN durable.run_failed_it(s.run_id) THEN 'RUN_FAILED' ELSE 'CANCELLED' END,
                    transition_by = $3
              WHERE s.id = $1 AND s.lease_token = $2 AND s.state IN ('leased', 'running')
          RETURNING s.error_message",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(message)
        .fetch_optional(&mut *tx)
        .await
        .ctx("confirming a cancellation")?;
        let Some(stored) = stored else {
            return Err(DbError::LeaseLost {
                step_run_id: lease.step_run_id,
            });
        };
        // `CODE: why`, as every ending the supervisor writes (README, events)
        insert_ending_event(&mut tx, lease, "cancelled", &format!("CANCELLED: {stored}")).await?;
        tx.commit().await.ctx("committing a cancellation")
    }

    /// The executor refused the job before executing it (routing mismatch, or
    /// a retryable error before `accepted`): nothing ran, so the attempt is
    /// given back (also when the refusal ends the step) and the step goes
    /// back to the queue after `delay`. Refusals
    /// are counted; the `max_refusals`-th ends the step `terminal_failed`
    /// (`EXECUTOR_REFUSED`) instead of looping forever. A step with a cancel
    /// request (its own or its run's) is never leased again, so its refusal
    /// ends it `cancelled`. Returns the state the step is in now.
    pub async fn refuse(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        code: &str,
        message: &str,
        delay: StdDuration,
        max_refusals: u32,
    ) -> Result<String, DbError> {
        let mut tx = begin_step_write(self.conn, lease.step_run_id).await?;
        // a step with a cancel request (its own or its run's) is never leased
        // again: a refusal ends it cancelled instead of back in the queue
        let state: Option<String> = sqlx::query_scalar(
            "UPDATE durable.step_runs s
                SET state = CASE WHEN c.cancel THEN 'cancelled'
                                 WHEN s.refusals - c.exempt + 1 >= $7 THEN 'terminal_failed' ELSE 'retryable_failed' END,
                    refusals = s.refusals + 1,
                    attempt = s.attempt - 1,
                    next_attempt_at = now() + make_interval(secs => $6::double precision / 1000.0),
                    error_code = CASE WHEN c.cancel THEN 'CANCELLED'
                                      WHEN s.refusals - c.exempt + 1 >= $7 THEN 'EXECUTOR_REFUSED' ELSE $4 END,
                    error_message = CASE WHEN c.cancel
                        THEN 'cancellation was requested; the executor refused the job before running it (' || $4 || ': ' || $5 || ')'
                        WHEN s.refusals - c.exempt + 1 >= $7
                        THEN 'refused ' || (s.refusals - c.exempt + 1) || ' times (max_refusals = ' || $7
                             || CASE WHEN c.exempt > 0 THEN '; and ' || c.exempt || ' more the step cannot have caused, not counted' ELSE '' END
                             || '); last: ' || $4 || ': ' || $5
                        ELSE $5 END,
                    error_retryable = NOT c.cancel AND s.refusals - c.exempt + 1 < $7, error_details = NULL,
                    owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
                    lease_token = CASE WHEN c.cancel THEN s.lease_token END,
                    transition_reason = CASE WHEN c.cancel AND c.run_failed THEN 'RUN_FAILED (' || $4 || ')'
                                             WHEN c.cancel THEN 'CANCEL_REQUESTED (' || $4 || ')'
                                             WHEN s.refusals - c.exempt + 1 >= $7 THEN 'REFUSALS_EXHAUSTED' ELSE $4 END,
                    transition_by = $3
               FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel,
                            durable.run_failed_it(s2.run_id) AS run_failed,
                            -- the refusals nothing of the step can have
                            -- caused never count toward max_refusals, not
                            -- even beside a later one that does (re-check
                            -- audit: an EXECUTOR_CRASHED left by an earlier
                            -- job, then one refusal of the step's own,
                            -- ended it at max_refusals = 2)
                            (SELECT count(*) FROM durable.transitions t
                              WHERE t.step_run_id = s2.id AND t.from_state = 'leased'
                                AND t.to_state = 'retryable_failed'
                                AND t.reason IN ('SPAWN_FAILED', 'WORK_DIR_UNAVAILABLE', 'EXECUTOR_CRASHED'))::integer AS exempt
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
    /// back to the queue at once, in its place (its due time is left as it
    /// was: it is leased before steps that became due after it), and the
    /// attempt does not count against
    /// `max_attempts` (a routine redeploy must not burn attempts). A step with
    /// a cancel request (its own or its run's) is cancelled instead. Fenced.
    pub async fn release(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        message: &str,
    ) -> Result<(), DbError> {
        self.give_back(lease, worker_name, "WORKER_SHUTDOWN", message)
            .await
    }

    /// A release under another code than a drain's: a started attempt
    /// whose process failed it in a way that is not the step's doing
    /// (`EXECUTOR_CRASHED`: a warm process that answered this job under its
    /// previous job's id). The step goes back uncounted, as a drained one,
    /// and the code is its `error_code` (after `EXECUTOR_CRASHED` the next
    /// attempt takes a process that served no job). Fenced.
    pub async fn give_back(
        &mut self,
        lease: &Lease,
        worker_name: &str,
        code: &str,
        message: &str,
    ) -> Result<(), DbError> {
        let mut tx = begin_step_write(self.conn, lease.step_run_id).await?;
        let ended: Option<(String, String)> = sqlx::query_as(
            "UPDATE durable.step_runs s
                SET state = CASE WHEN c.cancel THEN 'cancelled' ELSE 'retryable_failed' END,
                    uncounted_attempts = s.uncounted_attempts + CASE WHEN c.cancel THEN 0 ELSE 1 END,
                    error_code = CASE WHEN c.cancel THEN 'CANCELLED' ELSE $5 END,
                    error_message = $4, error_retryable = NOT c.cancel, error_details = NULL,
                    owner_worker_id = CASE WHEN c.cancel THEN s.owner_worker_id END,
                    lease_token = CASE WHEN c.cancel THEN s.lease_token END,
                    transition_reason = CASE WHEN c.cancel AND c.run_failed THEN 'RUN_FAILED (' || $5 || ')'
                                             WHEN c.cancel THEN 'CANCEL_REQUESTED (' || $5 || ')'
                                             ELSE $5 || ': given back uncounted' END,
                    transition_by = $3
               FROM (SELECT s2.id, s2.cancel_requested OR r.cancel_requested AS cancel,
                            durable.run_failed_it(s2.run_id) AS run_failed
                       FROM durable.step_runs s2 JOIN durable.workflow_runs r ON r.id = s2.run_id
                      WHERE s2.id = $1) c
              WHERE s.id = c.id AND s.lease_token = $2 AND s.state IN ('leased', 'running')
          RETURNING s.state, s.error_code",
        )
        .bind(lease.step_run_id)
        .bind(lease.token)
        .bind(worker_name)
        .bind(message)
        .bind(code)
        .fetch_optional(&mut *tx)
        .await
        .ctx("releasing a step")?;
        let Some((state, code)) = ended else {
            return Err(DbError::LeaseLost {
                step_run_id: lease.step_run_id,
            });
        };
        // an attempt that started ends with its event, as every other
        // attempt the supervisor ends (none for one that never ran)
        insert_ending_event(&mut tx, lease, &state, &format!("{code}: {message}")).await?;
        tx.commit().await.ctx("committing a release")
    }
}

/// Begins a single-step write: locks the step's run row first. Every writer
/// that changes a step's state takes the run lock before the step lock (the
/// triggers recompute the run), so concurrent completions, cancels and reclaims
/// in one run serialise instead of deadlocking.
pub(super) async fn begin_step_write(
    conn: &mut PgConnection,
    step_run_id: Uuid,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, DbError> {
    let mut tx = super::begin(conn).await.ctx("beginning a step write")?;
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

/// How long the reclaim and the deadline pass wait for a row another
/// transaction holds (a run's, a lease clock's) before they leave its steps
/// for a later pass, as the database functions they call take it.
pub(super) const PASS_LOCK_WAIT: &str = "250ms";

/// [`begin_step_write`] for the reclaim and the deadline pass: `None` when
/// another transaction held the run row for over [`PASS_LOCK_WAIT`] (the
/// transaction is rolled back; the caller goes on with other runs' steps).
pub(super) async fn begin_step_write_unless_held(
    conn: &mut PgConnection,
    step_run_id: Uuid,
) -> Result<Option<sqlx::Transaction<'_, sqlx::Postgres>>, DbError> {
    let mut tx = super::begin(conn).await.ctx("beginning a step write")?;
    let locked: bool = sqlx::query_scalar("SELECT durable.lock_run_of_step($1, $2)")
        .bind(step_run_id)
        .bind(PASS_LOCK_WAIT)
        .fetch_one(&mut *tx)
        .await
        .ctx("locking the step's run")?;
    if locked {
        return Ok(Some(tx));
    }
    tx.rollback().await.ctx("leaving a held run")?;
    Ok(None)
}

pub(super) fn fenced(rows: u64, lease: &Lease) -> Result<(), DbError> {
    if rows == 0 {
        Err(DbError::LeaseLost {
            step_run_id: lease.step_run_id,
        })
    } else {
        Ok(())
    }
}

pub(super) async fn insert_terminal_event(
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

/// The terminal event of an attempt the supervisor ended without the
/// executor's own terminal (a cancel, a timeout, a deadline, a silent
/// executor, an expired lease): the attempt's next sequence, the state it
/// ended in as the kind, why as the message. Only for an attempt that
/// started (its executor's events are there): one that never ran has no
/// events at all.
pub(super) async fn insert_ending_event(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    lease: &Lease,
    kind: &str,
    message: &str,
) -> Result<(), DbError> {
    sqlx::query("SELECT durable.record_ending_event($1, $2, $3, $4)")
        .bind(lease.step_run_id)
        .bind(lease.attempt as i32)
        .bind(kind)
        .bind(message)
        .execute(&mut **tx)
        .await
        .ctx("recording how the supervisor ended an attempt")?;
    Ok(())
}

pub(super) async fn write_failure(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    lease: &Lease,
    worker_name: &str,
    report: &FailureReport,
    decision: &FailureDecision,
) -> Result<(), DbError> {
    let conn: &mut PgConnection = tx;
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
