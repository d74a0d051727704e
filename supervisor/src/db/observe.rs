//! The read-only queries behind `/readyz` and the queue-depth gauge of
//! `/metrics` (see `crate::metrics`). Both are cheap and bounded whatever the
//! backlog: a `SELECT 1`, and a walk of the routing index that touches at
//! most `max_kinds` distinct routes and counts at most `cap` rows of each.

use super::{Ctx, Db, DbConn, DbError, Scope};

/// Ready steps of one (executor_kind, kind): leasable now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueDepth {
    pub executor_kind: String,
    pub kind: String,
    /// Ready steps, counted up to the cap given to [`DbConn::queue_depth`].
    pub ready: i64,
}

impl Db {
    /// Whether the database answers at all (readiness).
    pub async fn ping(&self) -> Result<(), DbError> {
        self.connection("checking that the database answers")
            .await?
            .conn()
            .ping()
            .await
    }

    /// Ready steps per (executor_kind, kind), whoever can run them: see
    /// [`DbConn::queue_depth`].
    pub async fn queue_depth(&self, max_kinds: u32, cap: u32) -> Result<Vec<QueueDepth>, DbError> {
        self.connection("counting ready steps per kind")
            .await?
            .conn()
            .queue_depth(max_kinds, cap)
            .await
    }
}

impl DbConn<'_> {
    /// See [`Db::ping`].
    pub async fn ping(&mut self) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query_scalar::<_, i32>("SELECT 1")
            .fetch_one(&mut *s)
            .await
            .ctx("checking that the database answers")?;
        s.done().await
    }

    /// Ready steps per (executor_kind, kind), whoever can run them. A skip
    /// scan of the partial routing index (`step_runs_route_labels`, led by
    /// `executor_kind, kind`) finds the distinct
    /// routes that have open steps (at most `max_kinds`, one index probe
    /// each), then each route's ready steps (`next_attempt_at <= now()`) are
    /// counted up to `cap` (an index range scan that stops there). Steps of
    /// a cancel-requested run still count until the run's cancel reaches them.
    pub async fn queue_depth(
        &mut self,
        max_kinds: u32,
        cap: u32,
    ) -> Result<Vec<QueueDepth>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "WITH RECURSIVE routes AS (
                 (SELECT s.executor_kind, s.kind, 1 AS n FROM durable.step_runs s
                   WHERE s.state IN ('pending', 'retryable_failed')
                   ORDER BY s.executor_kind, s.kind LIMIT 1)
                 UNION ALL
                 SELECT nx.executor_kind, nx.kind, r.n + 1 FROM routes r
                 CROSS JOIN LATERAL (
                     SELECT s.executor_kind, s.kind FROM durable.step_runs s
                      WHERE s.state IN ('pending', 'retryable_failed')
                        AND (s.executor_kind, s.kind) > (r.executor_kind, r.kind)
                      ORDER BY s.executor_kind, s.kind LIMIT 1
                 ) nx
                 WHERE r.n < $1
             )
             SELECT r.executor_kind, r.kind,
                    (SELECT count(*) FROM (
                        SELECT 1 FROM durable.step_runs s
                         WHERE s.executor_kind = r.executor_kind AND s.kind = r.kind
                           AND s.state IN ('pending', 'retryable_failed')
                           AND s.next_attempt_at <= now()
                         LIMIT $2) c) AS ready
               FROM routes r",
        )
        .bind(max_kinds.max(1) as i32)
        .bind(cap as i64)
        .fetch_all(&mut *s)
        .await
        .ctx("counting ready steps per kind")?;
        s.done().await?;
        Ok(rows
            .into_iter()
            .map(|(executor_kind, kind, ready)| QueueDepth {
                executor_kind,
                kind,
                ready,
            })
            .collect())
    }
}
