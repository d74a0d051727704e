//! The ledger's batched writes: one transaction per batch, one statement per
//! kind of intent, every row fenced by its lease (id, token, state) and
//! answered on its own (`ok`, `lost`, or the error the database gave for that
//! row alone: see migrations/20261202000002_ledger.sql).

use chrono::{DateTime, Utc};
use sqlx::{Connection, Row};
use uuid::Uuid;

use super::{Ctx, Db, DbConn, DbError, Lease};

/// An owned progress event (the ledger's queue outlives the attempt's frame).
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedEvent {
    pub sequence: u64,
    pub kind: &'static str,
    pub message: String,
    pub fraction: Option<f64>,
    pub executor_at: Option<DateTime<Utc>>,
}

/// `leased → running` with its accepted event.
#[derive(Debug, Clone)]
pub struct StartWrite {
    pub run_id: Uuid,
    pub lease: Lease,
    pub pid: i32,
    pub event: OwnedEvent,
}

/// Plain events (no checkpoint) of one lease, in sequence order.
#[derive(Debug, Clone)]
pub struct EventsWrite {
    pub lease: Lease,
    pub events: Vec<OwnedEvent>,
}

/// A success without artifacts.
#[derive(Debug, Clone)]
pub struct CompleteWrite {
    pub run_id: Uuid,
    pub lease: Lease,
    pub output: serde_json::Value,
    pub sequence: Option<u64>,
}

/// One flush: what a worker's writers asked for since the last one.
#[derive(Debug, Default)]
pub struct Batch {
    pub starts: Vec<StartWrite>,
    pub events: Vec<EventsWrite>,
    pub completes: Vec<CompleteWrite>,
}

/// How one intent of a committed batch ended.
#[derive(Debug, Clone, PartialEq)]
pub enum RowOutcome {
    Ok,
    /// The fence did not hold: this intent alone is `LeaseLost`.
    Lost,
    /// The database refused this row alone (its own subtransaction).
    Refused {
        sqlstate: String,
        message: String,
    },
}

impl RowOutcome {
    /// As the result a caller of a single write would have seen.
    pub fn into_result(self, step_run_id: Uuid) -> Result<(), DbError> {
        match self {
            RowOutcome::Ok => Ok(()),
            RowOutcome::Lost => Err(DbError::LeaseLost { step_run_id }),
            RowOutcome::Refused { sqlstate, message } => {
                Err(DbError::Refused { sqlstate, message })
            }
        }
    }
}

/// Per intent, in the batch's order.
#[derive(Debug, Default)]
pub struct BatchOutcome {
    pub starts: Vec<RowOutcome>,
    pub events: Vec<RowOutcome>,
    pub completes: Vec<RowOutcome>,
}

fn row_outcomes(rows: Vec<sqlx::postgres::PgRow>, n: usize) -> Result<Vec<RowOutcome>, DbError> {
    let mut out = vec![RowOutcome::Lost; n];
    for r in rows {
        let idx: i32 = r.get("idx");
        let status: String = r.get("status");
        let slot = usize::try_from(idx - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or_else(|| DbError::Corrupt(format!("batch row index {idx} out of range")))?;
        *slot = match status.as_str() {
            "ok" => RowOutcome::Ok,
            "lost" => RowOutcome::Lost,
            _ => RowOutcome::Refused {
                sqlstate: r.get::<Option<String>, _>("err_state").unwrap_or_default(),
                message: r
                    .get::<Option<String>, _>("err_message")
                    .unwrap_or_default(),
            },
        };
    }
    Ok(out)
}

impl Db {
    /// Writes one batch in one transaction: the starts, then the plain
    /// events, then the completions (so one lease's start, events and
    /// terminal in the same batch land in that order). Starts and
    /// completions are sorted by (run, step) by the caller: run rows are
    /// locked in ascending id order. An error of the whole batch (the
    /// connection, the commit) is returned as such; a row's own refusal is in
    /// its `RowOutcome`. Nothing is acknowledged before the commit.
    pub async fn write_batch(&self, worker: &str, b: &Batch) -> Result<BatchOutcome, DbError> {
        self.acquire("beginning a ledger batch")
            .await?
            .db()
            .write_batch(worker, b)
            .await
    }
}

impl DbConn<'_> {
    /// See [`Db::write_batch`]. The batch's transaction is `conn.begin()`: a
    /// SAVEPOINT inside a caller's transaction, so a batch that fails as a
    /// whole undoes only itself; a row refused alone stays in its outcome.
    pub async fn write_batch(&mut self, worker: &str, b: &Batch) -> Result<BatchOutcome, DbError> {
        let mut tx = self.conn.begin().await.ctx("beginning a ledger batch")?;
        let mut out = BatchOutcome::default();
        if !b.starts.is_empty() {
            let ids: Vec<Uuid> = b.starts.iter().map(|s| s.lease.step_run_id).collect();
            let tokens: Vec<Uuid> = b.starts.iter().map(|s| s.lease.token).collect();
            let pids: Vec<i32> = b.starts.iter().map(|s| s.pid).collect();
            let seqs: Vec<i64> = b.starts.iter().map(|s| s.event.sequence as i64).collect();
            let kinds: Vec<&str> = b.starts.iter().map(|s| s.event.kind).collect();
            let msgs: Vec<&str> = b.starts.iter().map(|s| s.event.message.as_str()).collect();
            let fracs: Vec<Option<f64>> = b.starts.iter().map(|s| s.event.fraction).collect();
            let ats: Vec<Option<DateTime<Utc>>> =
                b.starts.iter().map(|s| s.event.executor_at).collect();
            let rows = sqlx::query(
                "SELECT idx, status, err_state, err_message
                   FROM durable.start_steps($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            )
            .bind(worker)
            .bind(&ids)
            .bind(&tokens)
            .bind(&pids)
            .bind(&seqs)
            .bind(&kinds)
            .bind(&msgs)
            .bind(&fracs)
            .bind(&ats)
            .fetch_all(&mut *tx)
            .await
            .ctx("recording starts (batch)")?;
            out.starts = row_outcomes(rows, b.starts.len())?;
        }
        if !b.events.is_empty() {
            let ids: Vec<Uuid> = b.events.iter().map(|e| e.lease.step_run_id).collect();
            let tokens: Vec<Uuid> = b.events.iter().map(|e| e.lease.token).collect();
            let (mut lease_n, mut seqs, mut kinds, mut msgs, mut fracs, mut ats) =
                (vec![], vec![], vec![], vec![], vec![], vec![]);
            for (n, w) in b.events.iter().enumerate() {
                for e in &w.events {
                    lease_n.push(n as i32 + 1);
                    seqs.push(e.sequence as i64);
                    kinds.push(e.kind);
                    msgs.push(e.message.as_str());
                    fracs.push(e.fraction);
                    ats.push(e.executor_at);
                }
            }
            let rows = sqlx::query(
                "SELECT idx, status, err_state, err_message
                   FROM durable.record_plain_events($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(&ids)
            .bind(&tokens)
            .bind(&lease_n)
            .bind(&seqs)
            .bind(&kinds)
            .bind(&msgs)
            .bind(&fracs)
            .bind(&ats)
            .fetch_all(&mut *tx)
            .await
            .ctx("recording progress events (batch)")?;
            out.events = row_outcomes(rows, b.events.len())?;
        }
        if !b.completes.is_empty() {
            let ids: Vec<Uuid> = b.completes.iter().map(|c| c.lease.step_run_id).collect();
            let tokens: Vec<Uuid> = b.completes.iter().map(|c| c.lease.token).collect();
            let outputs: Vec<&serde_json::Value> = b.completes.iter().map(|c| &c.output).collect();
            let seqs: Vec<Option<i64>> = b
                .completes
                .iter()
                .map(|c| c.sequence.map(|s| s as i64))
                .collect();
            let rows = sqlx::query(
                "SELECT idx, status, err_state, err_message
                   FROM durable.complete_steps($1, $2, $3, $4::jsonb[], $5)",
            )
            .bind(worker)
            .bind(&ids)
            .bind(&tokens)
            .bind(&outputs)
            .bind(&seqs)
            .fetch_all(&mut *tx)
            .await
            .ctx("completing steps (batch)")?;
            out.completes = row_outcomes(rows, b.completes.len())?;
        }
        tx.commit().await.ctx("committing a ledger batch")?;
        Ok(out)
    }
}
