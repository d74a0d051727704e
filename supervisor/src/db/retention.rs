//! Retention: the removal of finished runs older than an age, with their
//! steps, events, transitions, artifacts and the artifact bytes no other
//! artifact references (migration `20261203000002_retention.sql` has the
//! reasoning and the one batch function). A pass removes in batches, each its
//! own short transaction (at most `batch_runs` runs and `batch_steps` steps),
//! one batch at a time across every worker and `supervisor gc` (an advisory
//! lock inside the batch), then VACUUMs the tables it removed rows from.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, Executor, Row};
use tokio_util::sync::CancellationToken;

use super::{Ctx, Db, DbConn, DbError, Scope};

/// The tables a pass removes rows from, children first: what VACUUM visits.
pub const RETENTION_TABLES: &[&str] = &[
    "durable.step_events",
    "durable.transitions",
    "durable.artifact_lineage",
    "durable.artifacts",
    "durable.artifact_blobs",
    "durable.artifact_chunks",
    "durable.step_runs",
    "durable.step_dependents",
    "durable.step_defs",
    "durable.workflow_runs",
    "durable.workers",
];

/// How one retention pass runs.
#[derive(Debug, Clone)]
pub struct RetentionOptions {
    /// Finished runs older than this (on the database clock) are removed.
    pub older_than: Duration,
    /// At most this many runs per transaction.
    pub batch_runs: u32,
    /// At most this many steps per transaction.
    pub batch_steps: u32,
    /// VACUUM the tables after a pass that removed anything.
    pub vacuum: bool,
}

/// What one batch (one transaction) removed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RetentionBatch {
    pub runs: u64,
    pub steps: u64,
    /// Artifact rows removed with their steps.
    pub artifacts: u64,
    pub blobs: u64,
    pub workers: u64,
    /// Old runs are left for the next batch.
    pub more: bool,
    /// From BEGIN to COMMIT, as the client saw it.
    #[serde(rename = "elapsed_ms", serialize_with = "as_ms")]
    pub elapsed: Duration,
}

/// What one pass removed, and how long its transactions were.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RetentionReport {
    /// Runs finished before this were removed.
    #[serde(serialize_with = "crate::json::utc_micros_opt")]
    pub cutoff: Option<DateTime<Utc>>,
    pub runs: u64,
    pub steps: u64,
    /// Artifact rows removed with their steps (their blobs go when no other
    /// artifact references them: `blobs`).
    pub artifacts: u64,
    pub blobs: u64,
    pub workers: u64,
    pub batches: u32,
    /// The longest batch transaction, BEGIN to COMMIT.
    #[serde(rename = "longest_batch_ms", serialize_with = "as_ms")]
    pub longest_batch: Duration,
    pub vacuumed: bool,
    #[serde(rename = "vacuum_ms", serialize_with = "as_ms")]
    pub vacuum_time: Duration,
    /// The pass stopped early (shutdown): old runs may be left.
    pub interrupted: bool,
    /// Unreferenced blobs nobody claimed for `BLOB_GARBAGE_AGE` (uploads
    /// whose attempt never committed), and staged chunks of uploads that
    /// never became a blob.
    pub garbage_blobs: u64,
    pub garbage_chunks: u64,
}

/// Pins of ended attempts one retention pass prunes at most.
pub const PIN_PRUNE_LIMIT: u32 = 50_000;

/// How long an unreferenced blob (or a staged chunk) is left alone before it
/// is garbage: far longer than any upload takes to commit (its lease).
pub const BLOB_GARBAGE_AGE: Duration = Duration::from_secs(24 * 3600);

impl RetentionReport {
    pub fn removed_anything(&self) -> bool {
        self.runs
            + self.steps
            + self.blobs
            + self.workers
            + self.garbage_blobs
            + self.garbage_chunks
            > 0
    }
}

/// What a pass would remove now (`supervisor gc --dry-run`).
#[derive(Debug, Clone, Serialize)]
pub struct RetentionPreview {
    #[serde(serialize_with = "crate::json::utc_micros")]
    pub cutoff: DateTime<Utc>,
    pub runs: i64,
    pub steps: i64,
    pub artifacts: i64,
    /// Artifact blobs that only those runs reference.
    pub blobs: i64,
}

/// Milliseconds to the microsecond (`508.597`, not `508.59692599999994`).
fn as_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1_000_000.0).round() / 1000.0)
}

impl Db {
    /// `now() - older_than` on the database clock: lease and finish times
    /// are the database's, so is the cutoff.
    pub async fn retention_cutoff(&self, older_than: Duration) -> Result<DateTime<Utc>, DbError> {
        self.connection("computing the retention cutoff")
            .await?
            .conn()
            .retention_cutoff(older_than)
            .await
    }

    /// One batch in one transaction: at most `max_runs` runs finished before
    /// `cutoff` and `max_steps` steps, with everything they hold. Waits for
    /// a batch another process is running (one at a time); lock waits are
    /// bounded by a 5 s lock_timeout (a transient error).
    pub async fn retention_batch(
        &self,
        cutoff: DateTime<Utc>,
        max_runs: u32,
        max_steps: u32,
    ) -> Result<RetentionBatch, DbError> {
        self.connection("beginning a retention batch")
            .await?
            .conn()
            .retention_batch(cutoff, max_runs, max_steps)
            .await
    }

    /// Plain VACUUM (no FULL: no exclusive lock; readers and writers go on)
    /// of the tables retention removes rows from, so their space is reused
    /// at once. SKIP_LOCKED: a table another VACUUM is working on is left to
    /// it. A role that does not own the tables gets a warning per table from
    /// PostgreSQL and nothing is done (autovacuum still is). Pool-only:
    /// VACUUM cannot run inside a transaction block.
    pub async fn retention_vacuum(&self) -> Result<bool, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .ctx("acquiring a connection to VACUUM")?;
        // only the tables' owner may VACUUM them: PostgreSQL skips them for
        // anyone else with a warning only its log shows, and `gc` as the
        // worker's role reported a VACUUM that never ran (retention faults
        // audit). Not the owner: no VACUUM, autovacuum does it.
        let owner: Option<bool> = sqlx::query_scalar(
            "SELECT pg_has_role(current_user, c.relowner, 'MEMBER')
               FROM pg_class c WHERE c.oid = 'durable.workflow_runs'::regclass",
        )
        .fetch_optional(&mut *conn)
        .await
        .ctx("checking who may VACUUM")?;
        if owner != Some(true) {
            return Ok(false);
        }
        // VACUUM of a large table may take longer than the pool's statement
        // timeout; it holds no lock that blocks the queue
        conn.execute("SET statement_timeout = 0")
            .await
            .ctx("lifting the statement timeout for VACUUM")?;
        let sql = format!("VACUUM (SKIP_LOCKED) {}", RETENTION_TABLES.join(", "));
        let res = conn.execute(sql.as_str()).await.ctx("vacuuming");
        let reset = conn
            .execute("RESET statement_timeout")
            .await
            .ctx("restoring the statement timeout");
        if reset.is_err() {
            // never hand a connection without its timeout back to the pool
            let _ = conn.close().await;
        }
        res?;
        reset?;
        Ok(true)
    }

    /// One pass: the cutoff once (so the pass ends), batches until no run
    /// finished before it is left (or `stop`), then VACUUM if anything went.
    /// An error stops the pass; what earlier batches removed stays removed.
    /// Pool-only: a pass is a series of short transactions by design (and
    /// ends with VACUUM); compose [`DbConn::retention_batch`] instead.
    pub async fn retention_pass(
        &self,
        opts: &RetentionOptions,
        stop: &CancellationToken,
    ) -> Result<RetentionReport, DbError> {
        let cutoff = self.retention_cutoff(opts.older_than).await?;
        let mut report = RetentionReport {
            cutoff: Some(cutoff),
            ..RetentionReport::default()
        };
        loop {
            if stop.is_cancelled() {
                report.interrupted = true;
                break;
            }
            let b = self
                .retention_batch(cutoff, opts.batch_runs.max(1), opts.batch_steps.max(1))
                .await?;
            report.batches += 1;
            report.runs += b.runs;
            report.steps += b.steps;
            report.artifacts += b.artifacts;
            report.blobs += b.blobs;
            report.workers += b.workers;
            report.longest_batch = report.longest_batch.max(b.elapsed);
            if !b.more || (b.runs == 0 && b.steps == 0) {
                break;
            }
        }
        if !stop.is_cancelled() {
            let (blobs, chunks) = self
                .collect_blob_garbage(BLOB_GARBAGE_AGE, opts.batch_runs.max(1) * 10)
                .await?;
            report.garbage_blobs = blobs;
            report.garbage_chunks = chunks;
            self.prune_blob_pins(PIN_PRUNE_LIMIT).await?;
        }
        if opts.vacuum && report.removed_anything() && !stop.is_cancelled() {
            let started = Instant::now();
            report.vacuumed = self.retention_vacuum().await?;
            report.vacuum_time = started.elapsed();
        }
        Ok(report)
    }

    /// Deletes up to `limit` pins of attempts that no longer hold their
    /// lease (their step ended or was leased again). Such a pin protects
    /// nothing, but it stayed as long as its step's row: a blob that many
    /// steps produced had one pin per step, and every "is it pinned" probe
    /// walked them all (`gc --dry-run` took 2-4 s at 1,800 artifacts of one
    /// content; audit of the operator's tools). A live attempt's pin is
    /// never touched. Returns how many went.
    pub async fn prune_blob_pins(&self, limit: u32) -> Result<u64, DbError> {
        let mut c = self.connection("pruning ended attempts' blob pins").await?;
        let done = sqlx::query(
            "DELETE FROM durable.blob_pins p
              WHERE (p.sha256, p.step_run_id, p.lease_token) IN (
                    SELECT q.sha256, q.step_run_id, q.lease_token FROM durable.blob_pins q
                     WHERE NOT EXISTS (SELECT 1 FROM durable.step_runs s
                                        WHERE s.id = q.step_run_id AND s.lease_token = q.lease_token
                                          AND s.state IN ('leased', 'running'))
                     LIMIT $1)",
        )
        .bind(i64::from(limit))
        .execute(c.conn().conn)
        .await
        .ctx("pruning ended attempts' blob pins")?;
        Ok(done.rows_affected())
    }

    /// Removes up to `limit` unreferenced blobs nobody claimed for `age`,
    /// and staged chunks of uploads that never became a blob, older than
    /// `age` (one transaction). Returns (blobs, chunks).
    pub async fn collect_blob_garbage(
        &self,
        age: Duration,
        limit: u32,
    ) -> Result<(u64, u64), DbError> {
        self.connection("collecting unreferenced artifact blobs")
            .await?
            .conn()
            .collect_blob_garbage(age, limit)
            .await
    }

    /// Files of removed directory-store blobs still to delete: those no blob
    /// row names again, with the time their blob was removed.
    pub async fn removed_blob_files(
        &self,
        limit: u32,
    ) -> Result<Vec<(String, DateTime<Utc>)>, DbError> {
        self.connection("reading removed blob files")
            .await?
            .conn()
            .removed_blob_files(limit)
            .await
    }

    /// The removed files are dealt with (deleted, or kept as a re-upload).
    pub async fn forget_removed_blob_files(&self, shas: &[String]) -> Result<(), DbError> {
        self.connection("dequeuing removed blob files")
            .await?
            .conn()
            .forget_removed_blob_files(shas)
            .await
    }

    /// What a pass with this age would remove now; removes nothing.
    pub async fn retention_preview(
        &self,
        older_than: Duration,
    ) -> Result<RetentionPreview, DbError> {
        self.connection("computing the retention cutoff")
            .await?
            .conn()
            .retention_preview(older_than)
            .await
    }
}

impl DbConn<'_> {
    /// See [`Db::retention_cutoff`].
    pub async fn retention_cutoff(
        &mut self,
        older_than: Duration,
    ) -> Result<DateTime<Utc>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let cutoff = sqlx::query_scalar(
            "SELECT now() - make_interval(secs => $1::double precision / 1000.0)",
        )
        .bind(older_than.as_millis() as f64)
        .fetch_one(&mut *s)
        .await
        .ctx("computing the retention cutoff")?;
        s.done().await?;
        Ok(cutoff)
    }

    /// See [`Db::retention_batch`]. Inside a caller's transaction the batch
    /// is a savepoint, its advisory lock is held until the caller's
    /// transaction ends, and the caller's `lock_timeout` is restored before
    /// it returns (a `SET LOCAL` would outlive the savepoint).
    pub async fn retention_batch(
        &mut self,
        cutoff: DateTime<Utc>,
        max_runs: u32,
        max_steps: u32,
    ) -> Result<RetentionBatch, DbError> {
        let started = Instant::now();
        let nested = self.conn.is_in_transaction();
        let mut tx = super::begin(self.conn)
            .await
            .ctx("beginning a retention batch")?;
        let callers_timeout: Option<String> = if nested {
            Some(
                sqlx::query_scalar("SELECT current_setting('lock_timeout')")
                    .fetch_one(&mut *tx)
                    .await
                    .ctx("reading the caller's lock timeout")?,
            )
        } else {
            None
        };
        tx.execute("SET LOCAL lock_timeout = '5s'")
            .await
            .ctx("bounding the retention batch's lock waits")?;
        let row = sqlx::query(
            "SELECT runs, steps, artifacts, blobs, workers, more FROM durable.retention_batch($1, $2, $3)",
        )
        .bind(cutoff)
        .bind(max_runs.min(i32::MAX as u32) as i32)
        .bind(max_steps.min(i32::MAX as u32) as i32)
        .fetch_one(&mut *tx)
        .await
        .ctx("removing a batch of old runs")?;
        if let Some(t) = callers_timeout {
            sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                .bind(t)
                .execute(&mut *tx)
                .await
                .ctx("restoring the caller's lock timeout")?;
        }
        tx.commit().await.ctx("committing a retention batch")?;
        let n = |c: &str| row.get::<i32, _>(c).max(0) as u64;
        Ok(RetentionBatch {
            runs: n("runs"),
            steps: n("steps"),
            artifacts: n("artifacts"),
            blobs: n("blobs"),
            workers: n("workers"),
            more: row.get("more"),
            elapsed: started.elapsed(),
        })
    }

    /// See [`Db::collect_blob_garbage`].
    pub async fn collect_blob_garbage(
        &mut self,
        age: Duration,
        limit: u32,
    ) -> Result<(u64, u64), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let row = sqlx::query(
            "SELECT blobs, chunks FROM durable.collect_blob_garbage(
                 now() - make_interval(secs => $1::double precision), $2)",
        )
        .bind(age.as_secs_f64())
        .bind(limit.min(i32::MAX as u32) as i32)
        .fetch_one(&mut *s)
        .await
        .ctx("collecting unreferenced artifact blobs")?;
        s.done().await?;
        Ok((
            row.get::<i32, _>("blobs").max(0) as u64,
            row.get::<i32, _>("chunks").max(0) as u64,
        ))
    }

    /// See [`Db::removed_blob_files`].
    pub async fn removed_blob_files(
        &mut self,
        limit: u32,
    ) -> Result<Vec<(String, DateTime<Utc>)>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let rows = sqlx::query(
            "SELECT r.sha256, r.removed_at FROM durable.artifact_files_removed r
              WHERE NOT EXISTS (SELECT 1 FROM durable.artifact_blobs b WHERE b.sha256 = r.sha256)
              ORDER BY r.removed_at LIMIT $1",
        )
        .bind(limit as i64)
        .fetch_all(&mut *s)
        .await
        .ctx("reading removed blob files")?;
        s.done().await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get("sha256"), r.get("removed_at")))
            .collect())
    }

    /// See [`Db::forget_removed_blob_files`].
    pub async fn forget_removed_blob_files(&mut self, shas: &[String]) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query("DELETE FROM durable.artifact_files_removed WHERE sha256 = ANY ($1)")
            .bind(shas)
            .execute(&mut *s)
            .await
            .ctx("dequeuing removed blob files")?;
        s.done().await
    }

    /// See [`Db::retention_preview`].
    pub async fn retention_preview(
        &mut self,
        older_than: Duration,
    ) -> Result<RetentionPreview, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let cutoff = DbConn::new(&mut s).retention_cutoff(older_than).await?;
        let row = sqlx::query(
            "WITH m AS MATERIALIZED (
                 SELECT ARRAY(SELECT durable.runs_being_removed_ids()) AS ids
             ), r AS (
                 -- a run retention has taken part of: what is left of it
                 -- (re-check audit: its counter counted the removed steps)
                 SELECT id, CASE WHEN w.id = ANY ((SELECT ids FROM m)::uuid[])
                                 THEN (SELECT count(*) FROM durable.step_runs s WHERE s.run_id = w.id)
                                 ELSE steps_total END AS steps_total
                   FROM durable.workflow_runs w
                  WHERE (finished_at < $1 AND state IN ('succeeded', 'failed', 'cancelled'))
                     -- one a batch began goes first, whatever the cutoff
                     OR w.id = ANY ((SELECT ids FROM m)::uuid[])
             ), a AS (
                 SELECT a.sha256, a.created_at FROM durable.artifacts a
                  WHERE a.run_id IN (SELECT id FROM r)
             )
             SELECT (SELECT count(*) FROM r) AS runs,
                    (SELECT coalesce(sum(steps_total), 0)::bigint FROM r) AS steps,
                    (SELECT count(*) FROM a) AS artifacts,
                    -- as durable.retention_batch: no other reference, and
                    -- not claimed since the last of these committed
                    -- (the pin, a probe per pin of the blob, last: on the
                    -- blobs left, not on every artifact row, where the
                    -- planner put it once inlined; OFFSET 0 keeps it out)
                    (SELECT count(*)
                       FROM (SELECT x.sha256
                               FROM (SELECT a.sha256, max(a.created_at) AS last FROM a GROUP BY a.sha256) x
                               JOIN durable.artifact_blobs b ON b.sha256 = x.sha256
                              WHERE b.claimed_at <= x.last
                                AND NOT EXISTS (SELECT 1 FROM durable.artifacts k
                                                 WHERE k.sha256 = x.sha256
                                                   AND k.run_id NOT IN (SELECT id FROM r))
                             OFFSET 0) y
                      WHERE NOT durable.blob_is_pinned(y.sha256)) AS blobs",
        )
        .bind(cutoff)
        .fetch_one(&mut *s)
        .await
        .ctx("counting what retention would remove")?;
        s.done().await?;
        Ok(RetentionPreview {
            cutoff,
            runs: row.get("runs"),
            steps: row.get("steps"),
            artifacts: row.get("artifacts"),
            blobs: row.get("blobs"),
        })
    }
}
