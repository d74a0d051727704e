//! The ledger's batched writes: one transaction per batch, every row fenced
//! by its lease (id, token, state) and answered on its own. Starts, plain
//! events and completions without artifacts are written by one set-based
//! statement per kind (`ok`, `lost`, or the error the database gave for that
//! row alone: see migrations/20261202000002_ledger.sql,
//! 20261204000001_hot_path.sql and 20261209000002_start_with_events.sql: a
//! start writes the plain events of its lease in the same batch); every
//! other write of a lease holder
//! ([`LedgerWrite`]: checkpoints, completions with artifacts, failures,
//! cancellations, refusals, releases) follows them in the same transaction,
//! in the order given, each in a savepoint of its own (its `DbConn` form).

use std::collections::HashMap;
use std::time::Duration as StdDuration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::{Ctx, Db, DbConn, DbError, FailureReport, Lease, NewArtifact, NewEvent, Scope};
use crate::state::FailureDecision;

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

/// A progress event that may carry a checkpoint (owned, as [`OwnedEvent`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointEvent {
    pub event: OwnedEvent,
    pub checkpoint: Option<Vec<u8>>,
}

/// Events of one lease of which at least one carries a checkpoint (the step
/// row is rewritten: `DbConn::record_events`).
#[derive(Debug, Clone)]
pub struct CheckpointWrite {
    pub lease: Lease,
    pub events: Vec<CheckpointEvent>,
    /// The lease TTL: the write renews the lease it proves alive (a
    /// checkpoint holds its step's row, which the heartbeat then skips).
    pub renew_for: std::time::Duration,
}

/// A success with artifacts whose blobs are already stored
/// (`DbConn::complete`); answered with the artifacts' ids.
#[derive(Debug, Clone)]
pub struct CompleteStoredWrite {
    pub lease: Lease,
    pub output: serde_json::Value,
    pub artifacts: Vec<NewArtifact>,
    pub sequence: Option<u64>,
}

/// A failure (`DbConn::fail`); answered with the decision.
#[derive(Debug, Clone)]
pub struct FailWrite {
    pub lease: Lease,
    pub report: FailureReport,
    pub jitter: f64,
}

/// A confirmed cancellation (`DbConn::confirm_cancelled`).
#[derive(Debug, Clone)]
pub struct CancelWrite {
    pub lease: Lease,
    pub message: String,
}

/// A refusal before execution (`DbConn::refuse`); answered with the state
/// the step is in now.
#[derive(Debug, Clone)]
pub struct RefuseWrite {
    pub lease: Lease,
    pub code: String,
    pub message: String,
    pub delay: StdDuration,
    pub max_refusals: u32,
}

/// A drain's release (`DbConn::release`).
#[derive(Debug, Clone)]
pub struct ReleaseWrite {
    pub lease: Lease,
    pub message: String,
}

/// A started attempt given back uncounted for a fault of its process, not of
/// the step (`DbConn::give_back`): a release under `code`.
#[derive(Debug, Clone)]
pub struct GiveBackWrite {
    pub lease: Lease,
    pub code: String,
    pub message: String,
}

/// A write of one lease that no set form carries: in a batch, each runs after
/// the set-based part, in the order given, in a savepoint of its own.
#[derive(Debug, Clone)]
pub enum LedgerWrite {
    Checkpoint(CheckpointWrite),
    CompleteStored(CompleteStoredWrite),
    Fail(FailWrite),
    Cancel(CancelWrite),
    Refuse(RefuseWrite),
    Release(ReleaseWrite),
    GiveBack(GiveBackWrite),
}

impl LedgerWrite {
    pub fn lease(&self) -> &Lease {
        match self {
            LedgerWrite::Checkpoint(w) => &w.lease,
            LedgerWrite::CompleteStored(w) => &w.lease,
            LedgerWrite::Fail(w) => &w.lease,
            LedgerWrite::Cancel(w) => &w.lease,
            LedgerWrite::Refuse(w) => &w.lease,
            LedgerWrite::Release(w) => &w.lease,
            LedgerWrite::GiveBack(w) => &w.lease,
        }
    }

    /// For logs.
    pub fn kind(&self) -> &'static str {
        match self {
            LedgerWrite::Checkpoint(_) => "checkpoint",
            LedgerWrite::CompleteStored(_) => "completion with artifacts",
            LedgerWrite::Fail(_) => "failure",
            LedgerWrite::Cancel(_) => "cancellation",
            LedgerWrite::Refuse(_) => "refusal",
            LedgerWrite::Release(_) => "release",
            LedgerWrite::GiveBack(_) => "give-back",
        }
    }
}

/// What a [`LedgerWrite`] that committed returned.
#[derive(Debug, Clone, PartialEq)]
pub enum Written {
    Checkpoint,
    /// The artifacts' ids, in the order given.
    CompleteStored(Vec<Uuid>),
    Fail(FailureDecision),
    Cancel,
    /// The state the step is in now.
    Refuse(String),
    Release,
}

/// One flush's answers: the set-based part's per row, then one per
/// [`LedgerWrite`], in the order given (its own error, if it failed alone).
#[derive(Debug, Default)]
pub struct LedgerOutcome {
    pub batch: BatchOutcome,
    pub writes: Vec<Result<Written, DbError>>,
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
        self.connection("beginning a ledger batch")
            .await?
            .conn()
            .write_batch(worker, b)
            .await
    }

    /// Writes one flush of the ledger in one transaction: the set-based part
    /// (`b`, as [`Db::write_batch`]), then `writes` in the order given, each
    /// in a savepoint of its own, so a write that fails (`LeaseLost`, a
    /// refusal, any error of its own) fails alone and the rest commits. The
    /// batch's runs are locked first, in id order. An error of the whole
    /// batch (the connection, the commit) is returned as such: nothing of it
    /// committed. One write alone (no set part) is its own transaction.
    pub async fn write_ledger(
        &self,
        worker: &str,
        b: &Batch,
        writes: &[LedgerWrite],
    ) -> Result<LedgerOutcome, DbError> {
        self.write_ledger_within(worker, b, writes, None).await
    }

    /// [`Db::write_ledger`], waiting at most `lock_wait` for any row lock
    /// (see [`DbConn::write_ledger_within`]).
    pub async fn write_ledger_within(
        &self,
        worker: &str,
        b: &Batch,
        writes: &[LedgerWrite],
        lock_wait: Option<StdDuration>,
    ) -> Result<LedgerOutcome, DbError> {
        self.connection("beginning a ledger batch")
            .await?
            .conn()
            .write_ledger_within(worker, b, writes, lock_wait)
            .await
    }

    /// See [`DbConn::held_steps`].
    pub async fn held_steps(
        &self,
        steps: &[Uuid],
        lock_wait: StdDuration,
    ) -> Result<Vec<(Uuid, Uuid)>, DbError> {
        self.connection("finding the rows another transaction holds")
            .await?
            .conn()
            .held_steps(steps, lock_wait)
            .await
    }
}

impl DbConn<'_> {
    /// Of these steps, those whose run row or own row another transaction
    /// holds right now, each with its run (no row lock is waited for:
    /// `SKIP LOCKED`). What a batch that gave up on a held row asks to set
    /// its writes aside. A lock on a whole table (a `LOCK TABLE`) is waited
    /// for `lock_wait` at most, as the batch waited: it then fails with
    /// `lock_not_available` (55P03), the batch's own error (it waited the
    /// pool's 10 s, and an outcome waiting for the batch read "the
    /// database did not answer" after its lease clock: database-chaos
    /// audit 97).
    pub async fn held_steps(
        &mut self,
        steps: &[Uuid],
        lock_wait: StdDuration,
    ) -> Result<Vec<(Uuid, Uuid)>, DbError> {
        let what = "finding the rows another transaction holds";
        // a transaction (or a savepoint) of its own: the setting is local to it
        let mut tx = super::begin(self.conn).await.ctx(what)?;
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{}ms", lock_wait.as_millis().max(1)))
            .execute(&mut *tx)
            .await
            .ctx(what)?;
        let rows = sqlx::query("SELECT step_run_id, run_id FROM durable.held_steps($1)")
            .bind(steps)
            .fetch_all(&mut *tx)
            .await
            .ctx(what)?;
        tx.commit().await.ctx(what)?;
        Ok(rows
            .iter()
            .map(|r| (r.get("step_run_id"), r.get("run_id")))
            .collect())
    }

    /// See [`Db::write_batch`]. The batch is one statement: on a bare
    /// connection its own transaction, inside a caller's transaction a
    /// savepoint, so a batch that fails as a whole undoes only itself; a row
    /// refused alone stays in its outcome.
    pub async fn write_batch(&mut self, worker: &str, b: &Batch) -> Result<BatchOutcome, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        // starts and completions together: each set form locks its own
        // runs in id order, but the completions' after the starts', so the
        // batch as a whole locks its runs up front, once, in id order
        let lock = if !b.starts.is_empty() && !b.completes.is_empty() {
            steps_to_lock(b, &[])
        } else {
            Vec::new()
        };
        let out = write_sets(&mut s, worker, b, &lock, None).await?;
        s.done().await?;
        Ok(out)
    }

    /// See [`Db::write_ledger`].
    pub async fn write_ledger(
        &mut self,
        worker: &str,
        b: &Batch,
        writes: &[LedgerWrite],
    ) -> Result<LedgerOutcome, DbError> {
        self.write_ledger_within(worker, b, writes, None).await
    }

    /// [`DbConn::write_ledger`]; with `lock_wait`, no statement of it waits
    /// longer than that for a row lock held by another transaction: the
    /// runs of all its locking writes are locked up front (one intent alone
    /// too), so a held run fails the whole batch at its first statement, with
    /// `lock_not_available` (55P03), before anything of it is written.
    pub async fn write_ledger_within(
        &mut self,
        worker: &str,
        b: &Batch,
        writes: &[LedgerWrite],
        lock_wait: Option<StdDuration>,
    ) -> Result<LedgerOutcome, DbError> {
        if writes.is_empty() {
            let batch = match lock_wait {
                None => self.write_batch(worker, b).await?,
                Some(wait) => {
                    let mut s = Scope::enter(self.conn).await?;
                    let out =
                        write_sets(&mut s, worker, b, &steps_to_lock(b, &[]), Some(wait)).await?;
                    s.done().await?;
                    out
                }
            };
            return Ok(LedgerOutcome {
                batch,
                writes: Vec::new(),
            });
        }
        let sets = b.starts.len() + b.events.len() + b.completes.len();
        if sets == 0 && writes.len() == 1 && lock_wait.is_none() {
            // one write alone is its own transaction (the statements a
            // single write always sent: no batch around it, no savepoint)
            let one = self.write_one(worker, &writes[0]).await;
            return Ok(LedgerOutcome {
                batch: BatchOutcome::default(),
                writes: vec![one],
            });
        }
        let mut tx = super::begin(self.conn)
            .await
            .ctx("beginning a ledger batch")?;
        // The writes below lock their runs in the order given, after the set
        // forms locked theirs: the batch's runs are locked first, once, in
        // id order (by the set part's statement), so that the batch as a
        // whole takes its run locks in ascending order (and a checkpoint's
        // step lock is never taken before a run lock), as every other
        // multi-run writer does. (Plain events lock nothing. One locking
        // intent alone needs no lock taken ahead of it.)
        let mut locking = steps_to_lock(b, writes);
        if locking.len() < 2 && lock_wait.is_none() {
            locking.clear();
        }
        let batch = write_sets(&mut tx, worker, b, &locking, lock_wait).await?;
        let mut out = Vec::with_capacity(writes.len());
        for w in writes {
            // its own savepoint: a failure undoes only this write (and rolls
            // back to it before the next statement)
            out.push(DbConn::new(&mut tx).write_one(worker, w).await);
        }
        tx.commit().await.ctx("committing a ledger batch")?;
        Ok(LedgerOutcome { batch, writes: out })
    }

    /// One [`LedgerWrite`] by its `DbConn` form: inside a transaction it runs
    /// in a savepoint of its own.
    async fn write_one(&mut self, worker: &str, w: &LedgerWrite) -> Result<Written, DbError> {
        match w {
            LedgerWrite::Checkpoint(c) => {
                let events: Vec<NewEvent<'_>> = c
                    .events
                    .iter()
                    .map(|e| NewEvent {
                        sequence: e.event.sequence,
                        kind: e.event.kind,
                        message: &e.event.message,
                        fraction: e.event.fraction,
                        checkpoint: e.checkpoint.as_deref(),
                        executor_at: e.event.executor_at,
                    })
                    .collect();
                self.record_events_renewing(&c.lease, &events, Some(c.renew_for))
                    .await?;
                Ok(Written::Checkpoint)
            }
            LedgerWrite::CompleteStored(c) => self
                .complete(&c.lease, worker, &c.output, &c.artifacts, c.sequence)
                .await
                .map(Written::CompleteStored),
            LedgerWrite::Fail(f) => self
                .fail(&f.lease, worker, &f.report, f.jitter)
                .await
                .map(Written::Fail),
            LedgerWrite::Cancel(c) => {
                self.confirm_cancelled(&c.lease, worker, &c.message).await?;
                Ok(Written::Cancel)
            }
            LedgerWrite::Refuse(r) => self
                .refuse(
                    &r.lease,
                    worker,
                    &r.code,
                    &r.message,
                    r.delay,
                    r.max_refusals,
                )
                .await
                .map(Written::Refuse),
            LedgerWrite::Release(r) => {
                self.release(&r.lease, worker, &r.message).await?;
                Ok(Written::Release)
            }
            LedgerWrite::GiveBack(r) => {
                self.give_back(&r.lease, worker, &r.code, &r.message)
                    .await?;
                Ok(Written::Release)
            }
        }
    }
}

/// The steps of a batch whose runs its writes lock (starts, completions and
/// the other writes; plain events lock nothing), in id order, once each.
fn steps_to_lock(b: &Batch, writes: &[LedgerWrite]) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = b
        .starts
        .iter()
        .map(|s| s.lease.step_run_id)
        .chain(b.completes.iter().map(|c| c.lease.step_run_id))
        .chain(writes.iter().map(|w| w.lease().step_run_id))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Events as the parallel arrays `durable.write_sets` takes: per event the
/// 1-based index of the write it belongs to (a start's, or an events
/// write's), and its fields.
#[derive(Default)]
struct EventArrays<'a> {
    of: Vec<i32>,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    msgs: Vec<&'a str>,
    fracs: Vec<Option<f64>>,
    ats: Vec<Option<DateTime<Utc>>>,
}

impl<'a> EventArrays<'a> {
    /// The events of `w`, which belong to the write at 0-based index `n`.
    fn push(&mut self, n: usize, w: &'a EventsWrite) {
        for e in &w.events {
            self.of.push(n as i32 + 1);
            self.seqs.push(e.sequence as i64);
            self.kinds.push(e.kind);
            self.msgs.push(e.message.as_str());
            self.fracs.push(e.fraction);
            self.ats.push(e.executor_at);
        }
    }
}

/// A start's plain events in the same batch (the SDKs' RUNNING right behind
/// ACCEPTED) go with the start: one INSERT under its fence, and the start's
/// answer (migration 20261209000002). The other events writes as they are.
struct StartEvents<'a> {
    /// Per events write of the batch: the index of the start it goes with.
    folded: Vec<Option<usize>>,
    /// The events that go with a start, as `write_sets`' `x_*` arrays
    /// (`x_start` is the start's 1-based index).
    with_starts: EventArrays<'a>,
    /// The events writes whose start is not in the batch, in order.
    rest: Vec<&'a EventsWrite>,
}

impl<'a> StartEvents<'a> {
    fn of(b: &'a Batch) -> Self {
        let start_of: HashMap<(Uuid, Uuid), usize> = b
            .starts
            .iter()
            .enumerate()
            .map(|(j, s)| ((s.lease.step_run_id, s.lease.token), j))
            .collect();
        let mut out = StartEvents {
            folded: Vec::with_capacity(b.events.len()),
            with_starts: EventArrays::default(),
            rest: vec![],
        };
        for w in &b.events {
            let j = start_of.get(&(w.lease.step_run_id, w.lease.token)).copied();
            out.folded.push(j);
            match j {
                Some(j) => out.with_starts.push(j, w),
                None => out.rest.push(w),
            }
        }
        out
    }
}

/// The starts of a batch as `write_sets`' `s_*` arrays.
struct StartArrays<'a> {
    ids: Vec<Uuid>,
    tokens: Vec<Uuid>,
    pids: Vec<i32>,
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    msgs: Vec<&'a str>,
    fracs: Vec<Option<f64>>,
    ats: Vec<Option<DateTime<Utc>>>,
}

impl<'a> StartArrays<'a> {
    fn of(starts: &'a [StartWrite]) -> Self {
        StartArrays {
            ids: starts.iter().map(|s| s.lease.step_run_id).collect(),
            tokens: starts.iter().map(|s| s.lease.token).collect(),
            pids: starts.iter().map(|s| s.pid).collect(),
            seqs: starts.iter().map(|s| s.event.sequence as i64).collect(),
            kinds: starts.iter().map(|s| s.event.kind).collect(),
            msgs: starts.iter().map(|s| s.event.message.as_str()).collect(),
            fracs: starts.iter().map(|s| s.event.fraction).collect(),
            ats: starts.iter().map(|s| s.event.executor_at).collect(),
        }
    }
}

/// The set-based part of a batch in one statement (`durable.write_sets`):
/// the runs of `lock` locked first, in id order (none when empty), then the
/// starts (each with the plain events of its lease in the batch, answered
/// as the start is), the other plain events and the completions. No
/// statement at all when there is nothing to write. With `lock_wait`
/// (`durable.write_sets_bounded`), the transaction waits at most that long
/// for any row lock from this statement on.
async fn write_sets(
    conn: &mut PgConnection,
    worker: &str,
    b: &Batch,
    lock: &[Uuid],
    lock_wait: Option<StdDuration>,
) -> Result<BatchOutcome, DbError> {
    if lock.is_empty() && b.starts.is_empty() && b.events.is_empty() && b.completes.is_empty() {
        return Ok(BatchOutcome::default());
    }
    let s = StartArrays::of(&b.starts);
    let StartEvents {
        folded,
        with_starts: x,
        rest,
    } = StartEvents::of(b);
    let e_ids: Vec<Uuid> = rest.iter().map(|e| e.lease.step_run_id).collect();
    let e_tokens: Vec<Uuid> = rest.iter().map(|e| e.lease.token).collect();
    let mut e = EventArrays::default();
    for (n, w) in rest.iter().enumerate() {
        e.push(n, w);
    }
    let c_ids: Vec<Uuid> = b.completes.iter().map(|c| c.lease.step_run_id).collect();
    let c_tokens: Vec<Uuid> = b.completes.iter().map(|c| c.lease.token).collect();
    let c_outputs: Vec<&serde_json::Value> = b.completes.iter().map(|c| &c.output).collect();
    let c_seqs: Vec<Option<i64>> = b
        .completes
        .iter()
        .map(|c| c.sequence.map(|s| s as i64))
        .collect();

    // the same arguments either way; the bounded form takes the lock wait first
    macro_rules! write_sets_sql {
        ($call:literal) => {
            concat!(
                "SELECT part, idx, status, err_state, err_message FROM ",
                $call,
                "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                 $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27::jsonb[], $28)"
            )
        };
    }
    let sql = if lock_wait.is_some() {
        write_sets_sql!("durable.write_sets_bounded($29, ")
    } else {
        write_sets_sql!("durable.write_sets(")
    };
    let query = sqlx::query(sql)
        .bind(worker)
        .bind(lock)
        .bind(&s.ids)
        .bind(&s.tokens)
        .bind(&s.pids)
        .bind(&s.seqs)
        .bind(&s.kinds)
        .bind(&s.msgs)
        .bind(&s.fracs)
        .bind(&s.ats)
        .bind(&x.of)
        .bind(&x.seqs)
        .bind(&x.kinds)
        .bind(&x.msgs)
        .bind(&x.fracs)
        .bind(&x.ats)
        .bind(&e_ids)
        .bind(&e_tokens)
        .bind(&e.of)
        .bind(&e.seqs)
        .bind(&e.kinds)
        .bind(&e.msgs)
        .bind(&e.fracs)
        .bind(&e.ats)
        .bind(&c_ids)
        .bind(&c_tokens)
        .bind(&c_outputs)
        .bind(&c_seqs);
    let query = match lock_wait {
        Some(wait) => query.bind(format!("{}ms", wait.as_millis().max(1))),
        None => query,
    };
    let rows = query
        .fetch_all(&mut *conn)
        .await
        .ctx("writing a ledger batch (starts, progress events, completions)")?;
    batch_answers(rows, b, &folded, rest.len())
}

/// `write_sets`' rows as the batch's answers: each start and completion its
/// own; an events write folded into a start that start's, the rest theirs,
/// in order.
fn batch_answers(
    rows: Vec<sqlx::postgres::PgRow>,
    b: &Batch,
    folded: &[Option<usize>],
    rest: usize,
) -> Result<BatchOutcome, DbError> {
    let (mut starts, mut events, mut completes) = (vec![], vec![], vec![]);
    for r in rows {
        let part: String = r.get("part");
        match part.as_str() {
            "start" => starts.push(r),
            "event" => events.push(r),
            "complete" => completes.push(r),
            other => {
                return Err(DbError::Corrupt(format!(
                    "ledger batch answered for an unknown part {other:?}"
                )))
            }
        }
    }
    let starts = row_outcomes(starts, b.starts.len())?;
    let mut rest_answers = row_outcomes(events, rest)?.into_iter();
    let mut event_answers = Vec::with_capacity(b.events.len());
    for j in folded {
        event_answers.push(match j {
            Some(j) => starts[*j].clone(),
            None => rest_answers.next().ok_or_else(|| {
                DbError::Corrupt("ledger batch answered fewer events than it was given".into())
            })?,
        });
    }
    Ok(BatchOutcome {
        starts,
        events: event_answers,
        completes: row_outcomes(completes, b.completes.len())?,
    })
}
