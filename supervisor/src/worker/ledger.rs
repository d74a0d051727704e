//! The ledger: the one writer of a worker's hot writes. Attempts hand it
//! their starts, plain progress events and completions without artifacts;
//! it writes them in batches (group commit: a batch is flushed as soon as the
//! ledger is idle, and what arrives during a flush waits for the next one),
//! one transaction per batch, set-based statements over arrays, every row
//! fenced by its lease. Each intent gets its own answer, only after the
//! batch committed: `Ok`, `LeaseLost` for that intent alone, or the error the
//! database gave for that row (transient ones are retried by the caller while
//! its lease clock allows, as for a single write). Plain progress of one lease
//! is coalesced within a batch (the latest kept). Writes that lock more than
//! one step or carry bytes (checkpoints, artifacts, failures, cancels,
//! refusals, releases) stay single writes; the heartbeat has its own
//! connection so that no batch can delay a renewal.

use std::collections::HashMap;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use crate::db::{Batch, CompleteWrite, Db, DbError, EventsWrite, OwnedEvent, StartWrite};

/// Intents per batch at most (a subtransaction each; PostgreSQL caches 64).
pub(crate) const MAX_BATCH: usize = 64;
/// Requests queued at most: a full queue back-pressures the attempts.
const QUEUE: usize = 4096;

type Reply = oneshot::Sender<Result<(), DbError>>;

enum Request {
    Start(StartWrite, Reply),
    Events(EventsWrite, Reply),
    Complete(CompleteWrite, Reply),
}

/// The handle attempts write through.
#[derive(Clone, Debug)]
pub(crate) struct Ledger {
    tx: mpsc::Sender<Request>,
}

/// The ledger's queue, consumed by [`run`].
pub(crate) struct LedgerQueue {
    rx: mpsc::Receiver<Request>,
}

pub(crate) fn channel() -> (Ledger, LedgerQueue) {
    let (tx, rx) = mpsc::channel(QUEUE);
    (Ledger { tx }, LedgerQueue { rx })
}

/// The ledger stopped: a transient error (the caller's retry ends with its
/// lease clock; the worker exits when a vital loop dies).
fn gone() -> DbError {
    DbError::Retry {
        context: "the worker's ledger stopped before the write was done",
    }
}

/// A write handed to the ledger, its answer still to come.
pub(crate) struct Pending(oneshot::Receiver<Result<(), DbError>>);

impl Pending {
    pub(crate) async fn answer(self) -> Result<(), DbError> {
        self.0.await.map_err(|_| gone())?
    }
}

impl Ledger {
    async fn submit(&self, make: impl FnOnce(Reply) -> Request) -> Result<Pending, DbError> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| gone())?;
        Ok(Pending(answer))
    }

    /// Hands a start to the ledger without waiting for its commit: what is
    /// handed right after it (the events behind it) goes in the same batch.
    pub(crate) async fn submit_start(&self, w: StartWrite) -> Result<Pending, DbError> {
        self.submit(|r| Request::Start(w, r)).await
    }

    /// Plain events only (none carries a checkpoint).
    pub(crate) async fn submit_events(&self, w: EventsWrite) -> Result<Pending, DbError> {
        self.submit(|r| Request::Events(w, r)).await
    }

    pub(crate) async fn start(&self, w: StartWrite) -> Result<(), DbError> {
        self.submit_start(w).await?.answer().await
    }

    pub(crate) async fn events(&self, w: EventsWrite) -> Result<(), DbError> {
        self.submit_events(w).await?.answer().await
    }

    pub(crate) async fn complete(&self, w: CompleteWrite) -> Result<(), DbError> {
        self.submit(|r| Request::Complete(w, r))
            .await?
            .answer()
            .await
    }
}

/// Runs until `stop` is cancelled and every queued request is written.
pub(crate) async fn run(db: Db, worker: String, mut queue: LedgerQueue, stop: CancellationToken) {
    let mut buf = Vec::with_capacity(MAX_BATCH);
    loop {
        let n = tokio::select! {
            biased;
            n = queue.rx.recv_many(&mut buf, MAX_BATCH) => n,
            _ = stop.cancelled() => {
                // what is still queued is written before the ledger ends
                queue.rx.close();
                queue.rx.recv_many(&mut buf, MAX_BATCH).await
            }
        };
        if n == 0 {
            return;
        }
        flush(&db, &worker, std::mem::take(&mut buf)).await;
    }
}

/// Plain progress is coalesced (latest per lease); other events are kept, in order.
fn coalesce(events: Vec<OwnedEvent>) -> Vec<OwnedEvent> {
    let plain = |e: &OwnedEvent| e.kind == "progress";
    let last = events.iter().rposition(plain);
    events
        .into_iter()
        .enumerate()
        .filter(|(i, e)| !plain(e) || Some(*i) == last)
        .map(|(_, e)| e)
        .collect()
}

/// Shapes one batch from queued requests: starts and completions sorted by
/// (run, step) (the lock order), events merged per lease.
fn shape(requests: Vec<Request>) -> (Batch, Vec<Reply>, Vec<Vec<Reply>>, Vec<Reply>) {
    let mut starts: Vec<(StartWrite, Reply)> = Vec::new();
    let mut completes: Vec<(CompleteWrite, Reply)> = Vec::new();
    let mut events: Vec<(EventsWrite, Vec<Reply>)> = Vec::new();
    let mut by_lease: HashMap<(Uuid, Uuid), usize> = HashMap::new();
    for r in requests {
        match r {
            Request::Start(w, reply) => starts.push((w, reply)),
            Request::Complete(w, reply) => completes.push((w, reply)),
            Request::Events(w, reply) => {
                let key = (w.lease.step_run_id(), w.lease.token());
                match by_lease.get(&key) {
                    Some(&i) => {
                        events[i].0.events.extend(w.events);
                        events[i].1.push(reply);
                    }
                    None => {
                        by_lease.insert(key, events.len());
                        events.push((w, vec![reply]));
                    }
                }
            }
        }
    }
    starts.sort_by_key(|(w, _)| (w.run_id, w.lease.step_run_id()));
    completes.sort_by_key(|(w, _)| (w.run_id, w.lease.step_run_id()));
    let (starts, start_replies): (Vec<_>, Vec<_>) = starts.into_iter().unzip();
    let (completes, complete_replies): (Vec<_>, Vec<_>) = completes.into_iter().unzip();
    let (mut events, event_replies): (Vec<_>, Vec<_>) = events.into_iter().unzip();
    for e in &mut events {
        let evs = std::mem::take(&mut e.events);
        e.events = coalesce(evs);
    }
    (
        Batch {
            starts,
            events,
            completes,
        },
        start_replies,
        event_replies,
        complete_replies,
    )
}

async fn flush(db: &Db, worker: &str, requests: Vec<Request>) {
    let (batch, start_replies, event_replies, complete_replies) = shape(requests);
    let size = batch.starts.len() + batch.events.len() + batch.completes.len();
    crate::metrics::ledger_batch(size);
    let res = crate::db::bounded(
        super::DB_CALL_TIMEOUT,
        "writing a ledger batch",
        db.write_batch(worker, &batch),
    )
    .await;
    match res {
        Ok(out) => {
            debug!(
                size,
                starts = batch.starts.len(),
                events = batch.events.len(),
                completes = batch.completes.len(),
                "ledger batch committed"
            );
            for ((w, reply), o) in batch.starts.iter().zip(start_replies).zip(out.starts) {
                let _ = reply.send(o.into_result(w.lease.step_run_id()));
            }
            for ((w, replies), o) in batch.events.iter().zip(event_replies).zip(out.events) {
                for reply in replies {
                    let _ = reply.send(o.clone().into_result(w.lease.step_run_id()));
                }
            }
            for ((w, reply), o) in batch
                .completes
                .iter()
                .zip(complete_replies)
                .zip(out.completes)
            {
                let _ = reply.send(o.into_result(w.lease.step_run_id()));
            }
        }
        Err(e) if !e.is_transient() && size > 1 => {
            // one intent the database refuses must not take the others with
            // it: each is written on its own, and only its own error is its
            warn!(error = %e, size, "a ledger batch was refused as a whole; writing its intents one by one");
            for (w, reply) in batch.starts.into_iter().zip(start_replies) {
                let id = w.lease.step_run_id();
                let one = Batch {
                    starts: vec![w],
                    ..Batch::default()
                };
                let _ = reply.send(single(db, worker, &one, id).await);
            }
            for (w, replies) in batch.events.into_iter().zip(event_replies) {
                let id = w.lease.step_run_id();
                let one = Batch {
                    events: vec![w],
                    ..Batch::default()
                };
                let res = single(db, worker, &one, id).await;
                for reply in replies {
                    let _ = reply.send(clone_result(&res));
                }
            }
            for (w, reply) in batch.completes.into_iter().zip(complete_replies) {
                let id = w.lease.step_run_id();
                let one = Batch {
                    completes: vec![w],
                    ..Batch::default()
                };
                let _ = reply.send(single(db, worker, &one, id).await);
            }
        }
        Err(e) => {
            // the whole batch failed and nothing of it committed: every intent
            // gets the error; each caller retries a transient one while its
            // lease clock allows
            warn!(error = %e, size, "a ledger batch failed; its writers retry");
            for r in start_replies.into_iter().chain(complete_replies) {
                let _ = r.send(Err(as_each(&e)));
            }
            for r in event_replies.into_iter().flatten() {
                let _ = r.send(Err(as_each(&e)));
            }
        }
    }
}

/// A batch of one intent, answered as that intent.
async fn single(db: &Db, worker: &str, one: &Batch, id: Uuid) -> Result<(), DbError> {
    let res = crate::db::bounded(
        super::DB_CALL_TIMEOUT,
        "writing a ledger intent",
        db.write_batch(worker, one),
    )
    .await?;
    res.starts
        .into_iter()
        .chain(res.events)
        .chain(res.completes)
        .next()
        .map(|o| o.into_result(id))
        .unwrap_or(Err(DbError::LeaseLost { step_run_id: id }))
}

fn clone_result(r: &Result<(), DbError>) -> Result<(), DbError> {
    match r {
        Ok(()) => Ok(()),
        Err(e) => Err(as_each(e)),
    }
}

/// The error one intent of a failed batch reports (`DbError` is not `Clone`):
/// same transience, same SQLSTATE, same text.
fn as_each(e: &DbError) -> DbError {
    match e {
        DbError::LeaseLost { step_run_id } => DbError::LeaseLost {
            step_run_id: *step_run_id,
        },
        e if e.is_transient() => DbError::Retry {
            context: "a ledger batch failed as a whole",
        },
        e => DbError::Refused {
            sqlstate: e.sqlstate().unwrap_or_else(|| "XX000".into()),
            message: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, kind: &'static str) -> OwnedEvent {
        OwnedEvent {
            sequence: seq,
            kind,
            message: String::new(),
            fraction: None,
            executor_at: None,
        }
    }

    #[test]
    fn plain_progress_is_coalesced_within_a_batch_the_rest_kept_in_order() {
        let got: Vec<(u64, &str)> = coalesce(vec![
            ev(2, "running"),
            ev(3, "progress"),
            ev(4, "progress"),
            ev(5, "heartbeat"),
            ev(6, "progress"),
        ])
        .into_iter()
        .map(|e| (e.sequence, e.kind))
        .collect();
        assert_eq!(got, vec![(2, "running"), (5, "heartbeat"), (6, "progress")]);
    }
}
