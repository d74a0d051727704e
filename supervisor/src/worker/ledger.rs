//! The ledger: the one writer of a worker. Attempts hand it every write of
//! a lease holder: starts, progress events (plain or with a checkpoint),
//! completions (with or without artifacts), failures, cancellations,
//! refusals and releases. It writes them in batches (group commit: a batch is
//! flushed as soon as the ledger is idle, and what arrives during a flush
//! waits for the next one), one transaction per batch, every row fenced by
//! its lease. Starts, plain events and completions without artifacts are
//! written by set-based statements over arrays, starts and completions sorted
//! by (run, step); the other writes follow them in the same transaction, in
//! the order they arrived, each in a savepoint of its own (its `DbConn` form),
//! after the batch's runs were locked in id order. A batch ends before a set
//! write of a lease that arrived after one of its other writes, so one
//! lease's writes always land in the order the attempt handed them (its
//! start, its events and checkpoints, its terminal write).
//!
//! Each intent gets its own answer, only after the batch committed: `Ok`
//! (with what the write returns: a failure's decision, a refusal's resulting
//! state, the artifacts' ids), `LeaseLost` for that intent alone, or the
//! error the database gave for that intent alone. An error of the whole batch
//! (the connection, the commit) is every intent's answer; transient errors
//! are retried by the caller while its lease clock allows, as for a single
//! write, and a batch refused as a whole is written again intent by intent.
//! Plain progress of one lease is coalesced within a batch (the latest
//! kept). Artifact blobs are uploaded before their completion is handed
//! over, outside any transaction. The heartbeat is not in the ledger: it has
//! its own connection, so that no batch can delay a renewal and run the
//! lease clock out.
//!
//! No batch waits longer than [`LOCK_WAIT`] for a row lock: one that gives
//! up on a row another transaction holds sets the writes of the held steps
//! aside (`aside`: written per run, in order, once the rows are free) and
//! writes the rest at once.

mod aside;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use crate::db::{
    Batch, CancelWrite, CheckpointWrite, CompleteStoredWrite, CompleteWrite, Db, DbConnection,
    DbError, EventsWrite, FailWrite, GiveBackWrite, Lease, LedgerWrite, OwnedEvent, RefuseWrite,
    ReleaseWrite, StartWrite, Written,
};
use crate::state::FailureDecision;

/// Requests per batch at most. The set writes (starts, events, plain
/// completions) are written by one set form per kind, a subtransaction
/// each, so they may fill a batch: at 64 concurrent no-op steps a batch of
/// 64 requests held ~21 steps (start, the SDK's running, completion), and a
/// write_sets call of 21 steps cost ~1.5–1.7× per step what one of 64 does.
pub(crate) const MAX_BATCH: usize = 256;
/// The other writes (checkpoints, failures, cancels, refusals, releases,
/// completions with artifacts) per batch at most: each takes a
/// subtransaction of its own, and PostgreSQL caches 64 per transaction
/// (past that, every snapshot taken meanwhile looks them up in pg_subtrans).
pub(crate) const MAX_SINGLES: usize = 64;
/// How long a batch waits at most for a row lock another transaction holds
/// (the runs of its steps, their rows). Writers of the runtime hold these
/// for milliseconds; past this, the rows' writes are set aside (`aside`).
pub(crate) const LOCK_WAIT: Duration = Duration::from_millis(250);
/// How long a start (with the events behind it) waits at most for its
/// lease's ending, from its arrival, before it is written, while other
/// attempts hold leases: a short job's completion arrives within it, and
/// its start and completion are then one write of the step and one of its
/// run (the fused start) instead of two of each. The wait ends as soon as
/// the endings of the batch's starts are in it ([`Gathering`]). At 4
/// concurrent one-shot Go no-op steps, where a start's completion followed
/// it by ~2.8 ms (p50; p90 ~5.3, p99 ~10 ms on a loaded host), 96 % of the
/// starts were fused with it against ~50 % with a 1 ms wait for starts-only
/// batches, and the database's CPU per step fell by ~a fifth
/// (`bench_executors`). A worker with one attempt writes its start at once.
/// Meanwhile the step is still `leased`: a worker killed then leaves it so,
/// and the reclaim counts it as it counts a `running` one (`LEASE_EXPIRED`).
pub(crate) const START_LINGER: Duration = Duration::from_millis(5);

/// How long the first write to reach an idle ledger waits for more while
/// other attempts run (PostgreSQL's `commit_delay` with `commit_siblings`,
/// for the batch): a write of one step costs the database nearly what a
/// write of a few does (the run rows locked once, each set form one
/// statement and its triggers, one commit). At 4 concurrent one-shot Go
/// no-op steps, where writes arrive one at a time, it took the database's
/// CPU per step from 2.16 to 1.90 ms (`bench_executors`, 4 alternating runs
/// each; 2 / 4 / 8 ms gave 2.28 / 2.01 / 1.89 ms). A ledger with writes
/// queued behind a flush does not wait: its batches fill while it writes.
/// An idle worker (one attempt) writes at once: submit → `accepted` is not
/// delayed. Nor does a ledger whose waits have stopped paying
/// ([`Company`]).
pub(crate) const IDLE_LINGER: Duration = Duration::from_millis(4);

/// No batch waits longer than this for more writes ([`Gathering`]).
pub(crate) const MAX_LINGER: Duration = Duration::from_millis(10);

/// How many leases the worker holds now (attempts running or committing).
pub(crate) type LiveLeases = Box<dyn Fn() -> usize + Send>;

/// Why a batch just taken from the queue waits for more writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The ledger was idle: for other leases' writes ([`IDLE_LINGER`]).
    Company,
    /// A batch holding a start without its ending: for it
    /// ([`START_LINGER`]).
    Starts,
}

/// Whether an idle ledger's wait for company ([`IDLE_LINGER`]) has paid
/// lately: whether other leases' writes joined the batches that waited. A
/// worker whose other leases are long quiet steps (a chain of short steps
/// beside one that sleeps for minutes) gains nothing by waiting, and each of
/// its short steps paid the wait (audit: a 20-step chain of no-op steps
/// beside a long sleep took 295 ms instead of 158). The score is a moving
/// average of the waits that paid (each wait counts 1/8); below a quarter
/// the ledger writes at once, and waits one idle batch in 8 to see whether
/// company has come back.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Company {
    /// In 1/256: 256 = every recent wait paid.
    score: u32,
    /// Idle batches seen since the score last allowed a wait.
    skipped: u32,
}

impl Company {
    const FULL: u32 = 256;
    const WORTH: u32 = Company::FULL / 4;
    const PROBE_EVERY: u32 = 8;

    fn new() -> Company {
        Company {
            score: Company::FULL,
            skipped: 0,
        }
    }

    /// Whether the idle batch at hand should wait.
    fn worth_waiting(&mut self) -> bool {
        if self.score >= Company::WORTH {
            self.skipped = 0;
            return true;
        }
        self.skipped += 1;
        if self.skipped >= Company::PROBE_EVERY {
            self.skipped = 0;
            return true;
        }
        false
    }

    /// A wait ended: `paid` — another lease's write joined the batch.
    fn waited(&mut self, paid: bool) {
        self.score = self.score - self.score / 8 + if paid { Company::FULL / 8 } else { 0 };
    }

    /// Whether a batch just taken from the queue waits for more writes:
    /// `waited` — the ledger was idle (the queue empty when it looked);
    /// `open_start` — the batch holds a start whose ending is not in it;
    /// `live` — the worker's leases. Only a wait for company is counted.
    fn linger(&mut self, waited: bool, open_start: bool, live: usize) -> Option<Wait> {
        if live < 2 {
            None
        } else if waited && self.worth_waiting() {
            Some(Wait::Company)
        } else if open_start {
            Some(Wait::Starts)
        } else {
            None
        }
    }
}

/// What a waiting batch waits for, and until when. A start waits for its
/// lease's ending (a completion, a failure, a cancel, a refusal, a release)
/// at most [`START_LINGER`] from its arrival, so that a short job's start
/// and completion are one write; a start that arrives while the batch
/// waits is waited for too (without it, a third of the starts at 4
/// concurrent one-shot Go steps missed their completion by arriving during
/// another start's wait). A wait for company lasts [`IDLE_LINGER`] from its
/// beginning unless every lease the worker holds has a write in the batch
/// first. No wait lasts longer than [`MAX_LINGER`]. The wait ends as soon as
/// nothing it waits for can still come.
struct Gathering {
    wait: Wait,
    live: usize,
    began: Instant,
    /// The leases of the batch's writes when the wait began.
    first: usize,
    /// The leases with a write in the batch.
    leases: HashSet<LeaseKey>,
    /// The starts whose ending has not come, each with when it arrived.
    open: HashMap<LeaseKey, Instant>,
}

impl Gathering {
    fn new(wait: Wait, live: usize, batch: &[Request], now: Instant) -> Gathering {
        let mut g = Gathering {
            wait,
            live,
            began: now,
            first: 0,
            leases: HashSet::new(),
            open: HashMap::new(),
        };
        for r in batch {
            g.add(r, now);
        }
        g.first = g.leases.len();
        g
    }

    fn add(&mut self, r: &Request, now: Instant) {
        let key = r.lease_key();
        if matches!(r, Request::Start(..)) {
            self.open.insert(key, now);
        } else if r.ends_lease() {
            self.open.remove(&key);
        }
        self.leases.insert(key);
    }

    /// When the wait ends unless something it waits for arrives first;
    /// `None`: nothing it waits for can still come (or its time is up at
    /// `now`).
    fn until(&self, now: Instant) -> Option<Instant> {
        let starts = self.open.values().max().map(|&at| at + START_LINGER);
        let company = (self.wait == Wait::Company && self.leases.len() < self.live)
            .then_some(self.began + IDLE_LINGER);
        let end = starts.max(company)?.min(self.began + MAX_LINGER);
        (end > now).then_some(end)
    }

    /// Another lease's write joined the batch while it waited.
    fn paid(&self) -> bool {
        self.leases.len() > self.first
    }
}

/// Requests queued at most: a full queue back-pressures the attempts.
const QUEUE: usize = 4096;
/// The ledger keeps its connection between batches (the pool checks every
/// connection given back with a round trip) until it has had nothing to
/// write for this long. Short, so that a small pool's other users (the
/// lease, the reclaim, artifact transfers) find it free while the ledger
/// idles: a busy ledger writes every few milliseconds.
const KEEP_CONNECTION_IDLE: Duration = Duration::from_secs(1);

type Reply<T = ()> = oneshot::Sender<Result<T, DbError>>;

/// A lease: its step and its token.
type LeaseKey = (Uuid, Uuid);

enum Request {
    Start(StartWrite, Reply),
    Events(EventsWrite, Reply),
    /// A success without artifacts; `behind`: handed right behind its
    /// lease's start and events, before their answers came.
    Complete {
        write: CompleteWrite,
        behind: bool,
        reply: Reply,
    },
    Checkpoint(CheckpointWrite, Reply),
    CompleteStored(CompleteStoredWrite, Reply<Vec<Uuid>>),
    Fail(FailWrite, Reply<FailureDecision>),
    Cancel(CancelWrite, Reply),
    Refuse(RefuseWrite, Reply<String>),
    Release(ReleaseWrite, Reply),
    GiveBack(GiveBackWrite, Reply),
}

impl Request {
    fn lease(&self) -> &Lease {
        match self {
            Request::Start(w, _) => &w.lease,
            Request::Events(w, _) => &w.lease,
            Request::Complete { write, .. } => &write.lease,
            Request::Checkpoint(w, _) => &w.lease,
            Request::CompleteStored(w, _) => &w.lease,
            Request::Fail(w, _) => &w.lease,
            Request::Cancel(w, _) => &w.lease,
            Request::Refuse(w, _) => &w.lease,
            Request::Release(w, _) => &w.lease,
            Request::GiveBack(w, _) => &w.lease,
        }
    }

    fn lease_key(&self) -> LeaseKey {
        Tainted::key(self.lease())
    }

    /// Its writer gave up on it (the attempt's time bound fired, its lease
    /// clock ran out): nobody waits for its answer, and the attempt counts
    /// it as not written. Written anyway, it landed later behind the
    /// progress the attempt had dropped: a success stored beside an older
    /// checkpoint, the events between them missing (re-check audit: a run
    /// and step row held past the lease TTL).
    fn abandoned(&self) -> bool {
        match self {
            Request::Start(_, r)
            | Request::Events(_, r)
            | Request::Complete { reply: r, .. }
            | Request::Checkpoint(_, r)
            | Request::Cancel(_, r)
            | Request::Release(_, r)
            | Request::GiveBack(_, r) => r.is_closed(),
            Request::CompleteStored(_, r) => r.is_closed(),
            Request::Fail(_, r) => r.is_closed(),
            Request::Refuse(_, r) => r.is_closed(),
        }
    }

    /// The run, for the requests that name it.
    fn run_id(&self) -> Option<Uuid> {
        match self {
            Request::Start(w, _) => Some(w.run_id),
            Request::Complete { write, .. } => Some(write.run_id),
            _ => None,
        }
    }

    /// Written by one of the set forms: a start, plain events, a success
    /// without artifacts.
    fn is_set_form(&self) -> bool {
        matches!(
            self,
            Request::Start(..) | Request::Events(..) | Request::Complete { .. }
        )
    }

    /// The step of a write that is not one of the set forms'.
    fn single_step(&self) -> Option<Uuid> {
        (!self.is_set_form()).then(|| self.lease().step_run_id())
    }

    /// The step of a set form's write.
    fn set_step(&self) -> Option<Uuid> {
        self.is_set_form().then(|| self.lease().step_run_id())
    }

    /// A write that ends its lease's attempt: its completion, failure,
    /// cancel, refusal or release.
    fn ends_lease(&self) -> bool {
        !matches!(
            self,
            Request::Start(..) | Request::Events(..) | Request::Checkpoint(..)
        )
    }

    /// The lease of a terminal write that waited for its lease's progress
    /// answers (every terminal write but a success handed behind them).
    fn answered_terminal(&self) -> Option<&Lease> {
        match self {
            Request::Start(..) | Request::Events(..) | Request::Checkpoint(..) => None,
            Request::Complete { behind: true, .. } => None,
            r => Some(r.lease()),
        }
    }
}

/// Leases whose start or events failed in a batch (their writers retry
/// them), each with when it last failed. A success handed behind such a
/// lease's progress writes must not commit ahead of their retries: it would
/// write the start with it (leased → running → succeeded) and the retries
/// would find the step finished, their events dropped. It is answered with a
/// transient error instead, and the attempt commits it again once its
/// progress writes are answered. A lease leaves the set when one of its
/// terminal writes that waited for those answers arrives, or an hour on
/// (its retries ended with its lease clock long before).
#[derive(Default)]
struct Tainted {
    leases: HashMap<LeaseKey, Instant>,
    prune_at: usize,
}

impl Tainted {
    const KEEP: Duration = Duration::from_secs(3600);
    const PRUNE_AT: usize = 4096;

    fn key(lease: &Lease) -> LeaseKey {
        (lease.step_run_id(), lease.token())
    }

    fn mark(&mut self, lease: &Lease) {
        if self.leases.len() >= self.prune_at.max(Self::PRUNE_AT) {
            let now = Instant::now();
            self.leases
                .retain(|_, at| now.duration_since(*at) < Self::KEEP);
            self.prune_at = (2 * self.leases.len()).max(Self::PRUNE_AT);
        }
        self.leases.insert(Self::key(lease), Instant::now());
    }

    fn holds(&self, lease: &Lease) -> bool {
        self.leases.contains_key(&Self::key(lease))
    }

    /// Whether a success must not be written now: it was handed behind its
    /// lease's progress writes and one of them failed.
    fn holds_back(&self, write: &CompleteWrite, behind: bool) -> bool {
        behind && self.holds(&write.lease)
    }

    /// Answers, and takes out of `buf`, each success handed behind the
    /// progress writes of a tainted lease; clears the leases whose answered
    /// terminal writes arrived.
    fn admit(&mut self, buf: &mut Vec<Request>) {
        if self.leases.is_empty() {
            return;
        }
        let mut kept = Vec::with_capacity(buf.len());
        for r in buf.drain(..) {
            match r {
                Request::Complete {
                    write,
                    behind,
                    reply,
                } if self.holds_back(&write, behind) => {
                    debug!(step_run_id = %write.lease.step_run_id(), "a success handed behind progress writes that failed waits for their retries");
                    let _ = reply.send(Err(behind_failed()));
                }
                r => {
                    if let Some(lease) = r.answered_terminal() {
                        self.leases.remove(&Self::key(lease));
                    }
                    kept.push(r);
                }
            }
        }
        *buf = kept;
    }
}

/// The answer of a success handed behind progress writes that failed.
fn behind_failed() -> DbError {
    DbError::Retry {
        context: "the start or events this success was handed behind failed; it is committed after their retries",
    }
}

/// The typed answer of a [`LedgerWrite`].
enum WriteReply {
    Unit(Reply),
    Ids(Reply<Vec<Uuid>>),
    Decision(Reply<FailureDecision>),
    State(Reply<String>),
}

impl WriteReply {
    fn send(self, res: Result<Written, DbError>) {
        // a mismatch cannot happen (each request kind is paired with its
        // write here); should it, the caller gets an error, not a wrong value
        let wrong = |w: &Written| {
            DbError::Corrupt(format!(
                "the ledger answered {w:?} to a write of another kind"
            ))
        };
        match self {
            WriteReply::Unit(r) => {
                let _ = r.send(res.and_then(|w| match w {
                    Written::Checkpoint | Written::Cancel | Written::Release => Ok(()),
                    w => Err(wrong(&w)),
                }));
            }
            WriteReply::Ids(r) => {
                let _ = r.send(res.and_then(|w| match w {
                    Written::CompleteStored(ids) => Ok(ids),
                    w => Err(wrong(&w)),
                }));
            }
            WriteReply::Decision(r) => {
                let _ = r.send(res.and_then(|w| match w {
                    Written::Fail(d) => Ok(d),
                    w => Err(wrong(&w)),
                }));
            }
            WriteReply::State(r) => {
                let _ = r.send(res.and_then(|w| match w {
                    Written::Refuse(s) => Ok(s),
                    w => Err(wrong(&w)),
                }));
            }
        }
    }

    /// Its writer gave up on it (see [`Request::abandoned`]).
    fn is_closed(&self) -> bool {
        match self {
            WriteReply::Unit(r) => r.is_closed(),
            WriteReply::Ids(r) => r.is_closed(),
            WriteReply::Decision(r) => r.is_closed(),
            WriteReply::State(r) => r.is_closed(),
        }
    }

    fn fail(self, e: DbError) {
        match self {
            WriteReply::Unit(r) => drop(r.send(Err(e))),
            WriteReply::Ids(r) => drop(r.send(Err(e))),
            WriteReply::Decision(r) => drop(r.send(Err(e))),
            WriteReply::State(r) => drop(r.send(Err(e))),
        }
    }
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
pub(crate) struct Pending<T = ()>(oneshot::Receiver<Result<T, DbError>>);

impl<T> Pending<T> {
    pub(crate) async fn answer(mut self) -> Result<T, DbError> {
        self.answer_mut().await
    }

    /// The answer, without giving the handle up (cancel-safe: in a
    /// `select!`); not to be awaited again once it resolved.
    pub(crate) async fn answer_mut(&mut self) -> Result<T, DbError> {
        (&mut self.0).await.map_err(|_| gone())?
    }
}

impl Ledger {
    async fn submit<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Request,
    ) -> Result<Pending<T>, DbError> {
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

    /// Events of which at least one carries a checkpoint.
    pub(crate) async fn submit_checkpoint(&self, w: CheckpointWrite) -> Result<Pending, DbError> {
        self.submit(|r| Request::Checkpoint(w, r)).await
    }

    pub(crate) async fn start(&self, w: StartWrite) -> Result<(), DbError> {
        self.submit_start(w).await?.answer().await
    }

    pub(crate) async fn events(&self, w: EventsWrite) -> Result<(), DbError> {
        self.submit_events(w).await?.answer().await
    }

    pub(crate) async fn checkpoint(&self, w: CheckpointWrite) -> Result<(), DbError> {
        self.submit_checkpoint(w).await?.answer().await
    }

    /// A success without artifacts.
    pub(crate) async fn complete(&self, w: CompleteWrite) -> Result<(), DbError> {
        self.submit(|reply| Request::Complete {
            write: w,
            behind: false,
            reply,
        })
        .await?
        .answer()
        .await
    }

    /// Hands a success without artifacts to the ledger right behind its
    /// lease's start and events, before their answers: should one of those
    /// fail, the success is not written and its answer is a transient error
    /// (to be committed again once they are answered), so that it never
    /// lands ahead of their retries.
    pub(crate) async fn submit_complete_behind(
        &self,
        w: CompleteWrite,
    ) -> Result<Pending, DbError> {
        self.submit(|reply| Request::Complete {
            write: w,
            behind: true,
            reply,
        })
        .await
    }

    /// A success with artifacts (their blobs already stored): their ids.
    pub(crate) async fn complete_stored(
        &self,
        w: CompleteStoredWrite,
    ) -> Result<Vec<Uuid>, DbError> {
        self.submit(|r| Request::CompleteStored(w, r))
            .await?
            .answer()
            .await
    }

    /// A failure: where it took the step.
    pub(crate) async fn fail(&self, w: FailWrite) -> Result<FailureDecision, DbError> {
        self.submit(|r| Request::Fail(w, r)).await?.answer().await
    }

    pub(crate) async fn confirm_cancelled(&self, w: CancelWrite) -> Result<(), DbError> {
        self.submit(|r| Request::Cancel(w, r)).await?.answer().await
    }

    /// A refusal: the state the step is in now.
    pub(crate) async fn refuse(&self, w: RefuseWrite) -> Result<String, DbError> {
        self.submit(|r| Request::Refuse(w, r)).await?.answer().await
    }

    pub(crate) async fn release(&self, w: ReleaseWrite) -> Result<(), DbError> {
        self.submit(|r| Request::Release(w, r))
            .await?
            .answer()
            .await
    }

    pub(crate) async fn give_back(&self, w: GiveBackWrite) -> Result<(), DbError> {
        self.submit(|r| Request::GiveBack(w, r))
            .await?
            .answer()
            .await
    }
}

/// Runs until `stop` is cancelled and every queued request is written.
pub(crate) async fn run(
    db: Db,
    worker: String,
    mut queue: LedgerQueue,
    stop: CancellationToken,
    live: LiveLeases,
) {
    // what a batch's end left behind goes first in the next one
    let mut carried: Vec<Request> = Vec::new();
    let mut tainted = Tainted::default();
    // the connection batches are written on, kept between them while the
    // ledger is busy (given back after an error, or once idle)
    let mut held: Option<DbConnection> = None;
    let mut aside = aside::Aside::start(db.clone(), worker.clone());
    let mut company = Company::new();
    loop {
        let mut buf = std::mem::take(&mut carried);
        if buf.is_empty() {
            buf.reserve(MAX_BATCH);
            let waited = queue.rx.is_empty();
            let n = tokio::select! {
                biased;
                n = queue.rx.recv_many(&mut buf, MAX_BATCH) => n,
                _ = stop.cancelled() => {
                    // what is still queued is written before the ledger ends
                    queue.rx.close();
                    queue.rx.recv_many(&mut buf, MAX_BATCH).await
                }
                _ = tokio::time::sleep(KEEP_CONNECTION_IDLE), if held.is_some() => {
                    held = None;
                    continue;
                }
            };
            if n == 0 {
                aside.close().await;
                return;
            }
            let live = live();
            // (a worker with one lease never waits: nothing to gather)
            let now = Instant::now();
            let mut gathering = (live >= 2).then(|| Gathering::new(Wait::Starts, live, &buf, now));
            // a start whose ending is not in the batch (yet)
            let open_start = gathering.as_ref().is_some_and(|g| g.until(now).is_some());
            if let (Some(wait), Some(gathering)) =
                (company.linger(waited, open_start, live), gathering.as_mut())
            {
                gathering.wait = wait;
                gather(&mut queue, &stop, &mut buf, gathering).await;
                // (only a wait for company asks whose writes joined)
                if wait == Wait::Company {
                    company.waited(gathering.paid());
                }
            }
        } else {
            // and what is queued already joins it, without waiting
            while buf.len() < MAX_BATCH {
                match queue.rx.try_recv() {
                    Ok(r) => buf.push(r),
                    Err(_) => break,
                }
            }
        }
        let dropped = drop_abandoned(&mut buf);
        if dropped > 0 {
            debug!(
                dropped,
                "ledger writes whose writers gave up are not written"
            );
        }
        tainted.admit(&mut buf);
        aside.route(&mut buf);
        if buf.is_empty() {
            continue;
        }
        let end = batch_end(&buf);
        carried = buf.split_off(end);
        flush(
            &db,
            &mut held,
            &worker,
            shape(buf),
            &mut tainted,
            &mut aside,
        )
        .await;
    }
}

/// Takes writes from the queue into `buf` (up to [`MAX_BATCH`]) until the
/// wait of `gathering` ends (early once nothing it waits for can still
/// come) or the ledger is stopped, then what is queued already.
async fn gather(
    queue: &mut LedgerQueue,
    stop: &CancellationToken,
    buf: &mut Vec<Request>,
    gathering: &mut Gathering,
) {
    while buf.len() < MAX_BATCH {
        let Some(until) = gathering.until(Instant::now()) else {
            break;
        };
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            r = queue.rx.recv() => match r {
                Some(r) => {
                    gathering.add(&r, Instant::now());
                    buf.push(r);
                }
                None => break,
            },
            _ = tokio::time::sleep_until(until.into()) => break,
        }
    }
    while buf.len() < MAX_BATCH {
        match queue.rx.try_recv() {
            Ok(r) => {
                gathering.add(&r, Instant::now());
                buf.push(r);
            }
            Err(_) => break,
        }
    }
}

/// Takes out the requests whose writers gave up ([`Request::abandoned`]);
/// how many.
fn drop_abandoned(buf: &mut Vec<Request>) -> usize {
    let before = buf.len();
    buf.retain(|r| !r.abandoned());
    before - buf.len()
}

/// Where a batch of these requests (in arrival order) must end so that one
/// lease's writes land in the order they came: the set-based part is written
/// before the other writes, so a set write (start, events, plain completion)
/// of a step that arrived after another write of that step waits for the
/// next batch, and so does everything behind it. A batch also ends before
/// its `MAX_SINGLES + 1`-th write of its own (a subtransaction each). Never
/// 0 for a non-empty slice.
fn batch_end(requests: &[Request]) -> usize {
    let mut singles: HashSet<Uuid> = HashSet::new();
    let mut n_singles = 0;
    for (i, r) in requests.iter().enumerate() {
        if let Some(id) = r.set_step() {
            if singles.contains(&id) {
                return i;
            }
        }
        if let Some(id) = r.single_step() {
            if n_singles == MAX_SINGLES {
                return i;
            }
            n_singles += 1;
            singles.insert(id);
        }
    }
    requests.len()
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

/// One batch, shaped: the set-based part (starts and completions sorted by
/// (run, step), the lock order; events merged per lease) and the other
/// writes in arrival order, each with its replies.
struct Shaped {
    batch: Batch,
    start_replies: Vec<Reply>,
    event_replies: Vec<Vec<Reply>>,
    complete_replies: Vec<Reply>,
    /// per completion: handed behind its lease's progress writes
    complete_behind: Vec<bool>,
    writes: Vec<LedgerWrite>,
    write_replies: Vec<WriteReply>,
}

impl Shaped {
    fn empty() -> Shaped {
        Shaped {
            batch: Batch::default(),
            start_replies: Vec::new(),
            event_replies: Vec::new(),
            complete_replies: Vec::new(),
            complete_behind: Vec::new(),
            writes: Vec::new(),
            write_replies: Vec::new(),
        }
    }

    /// The steps it writes, once each.
    fn steps(&self) -> Vec<Uuid> {
        let mut ids: Vec<Uuid> = self.leases().into_iter().map(|(id, _)| id).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The leases it writes, once per write.
    fn leases(&self) -> Vec<LeaseKey> {
        let b = &self.batch;
        b.starts
            .iter()
            .map(|w| &w.lease)
            .chain(b.events.iter().map(|w| &w.lease))
            .chain(b.completes.iter().map(|w| &w.lease))
            .chain(self.writes.iter().map(|w| w.lease()))
            .map(Tainted::key)
            .collect()
    }

    /// Takes out the writes of the steps `pick` names (with their replies,
    /// in the order they had), leaving the others.
    fn take(&mut self, pick: impl Fn(Uuid) -> bool) -> Shaped {
        let mut out = Shaped::empty();
        let step = |l: &Lease| pick(l.step_run_id());
        (out.batch.starts, out.start_replies) = split(
            &mut self.batch.starts,
            &mut self.start_replies,
            |w: &StartWrite| step(&w.lease),
        );
        (out.batch.events, out.event_replies) = split(
            &mut self.batch.events,
            &mut self.event_replies,
            |w: &EventsWrite| step(&w.lease),
        );
        let mut tails: Vec<(bool, Reply)> = std::mem::take(&mut self.complete_behind)
            .into_iter()
            .zip(std::mem::take(&mut self.complete_replies))
            .collect();
        let taken_tails;
        (out.batch.completes, taken_tails) = split(
            &mut self.batch.completes,
            &mut tails,
            |w: &CompleteWrite| step(&w.lease),
        );
        (self.complete_behind, self.complete_replies) = tails.into_iter().unzip();
        (out.complete_behind, out.complete_replies) = taken_tails.into_iter().unzip();
        (out.writes, out.write_replies) = split(
            &mut self.writes,
            &mut self.write_replies,
            |w: &LedgerWrite| step(w.lease()),
        );
        out
    }

    /// Answers its writers from how its write ended: each intent its own
    /// answer; a batch refused as a whole is written again intent by intent;
    /// an error of the whole batch is every intent's.
    async fn settle(
        self,
        res: Result<crate::db::LedgerOutcome, DbError>,
        db: &Db,
        worker: &str,
        tainted: &mut Tainted,
    ) {
        let size = self.size();
        match res {
            Ok(out) => self.answer(out, tainted),
            Err(e) if !e.is_transient() && size > 1 => {
                // one intent the database refuses must not take the others
                // with it: each is written on its own, and only its own error
                // is its
                warn!(error = %e, size, "a ledger batch was refused as a whole; writing its intents one by one");
                self.write_one_by_one(db, worker, tainted).await;
            }
            Err(e) => {
                // the whole batch failed and nothing of it committed: every
                // intent gets the error; each caller retries a transient one
                // while its lease clock allows
                let why = db
                    .server_reason(&e, std::time::Duration::from_secs(1))
                    .await;
                warn!(error = %e, server_says = why.as_deref(), size, "a ledger batch failed; its writers retry");
                self.fail(&e, tainted);
            }
        }
    }

    /// Takes out the intents whose writers gave up since the batch was
    /// shaped ([`Request::abandoned`]), while it waited for its connection
    /// (a server that came back after a writer's lease clock ran out wrote
    /// an outcome its attempt had logged as not recorded, 6 s after it gave
    /// up; redeploy audit). Merged events stay while one of their writers
    /// waits. How many were taken out.
    fn drop_abandoned(&mut self) -> usize {
        let before = self.size();
        let gone = |r: &Reply| r.is_closed();
        let _ = split(&mut self.start_replies, &mut self.batch.starts, gone);
        let _ = split(&mut self.event_replies, &mut self.batch.events, |rs| {
            rs.iter().all(gone)
        });
        let mut tails: Vec<(Reply, bool)> = std::mem::take(&mut self.complete_replies)
            .into_iter()
            .zip(std::mem::take(&mut self.complete_behind))
            .collect();
        let _ = split(&mut tails, &mut self.batch.completes, |(r, _)| gone(r));
        (self.complete_replies, self.complete_behind) = tails.into_iter().unzip();
        let _ = split(
            &mut self.write_replies,
            &mut self.writes,
            WriteReply::is_closed,
        );
        before - self.size()
    }

    fn size(&self) -> usize {
        self.batch.starts.len()
            + self.batch.events.len()
            + self.batch.completes.len()
            + self.writes.len()
    }
}

fn shape(requests: Vec<Request>) -> Shaped {
    let mut starts: Vec<(StartWrite, Reply)> = Vec::new();
    let mut completes: Vec<(CompleteWrite, bool, Reply)> = Vec::new();
    let mut events: Vec<(EventsWrite, Vec<Reply>)> = Vec::new();
    let mut by_lease: HashMap<(Uuid, Uuid), usize> = HashMap::new();
    let mut writes = Vec::new();
    let mut write_replies = Vec::new();
    for r in requests {
        match r {
            Request::Start(w, reply) => starts.push((w, reply)),
            Request::Complete {
                write,
                behind,
                reply,
            } => completes.push((write, behind, reply)),
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
            Request::Checkpoint(w, reply) => {
                writes.push(LedgerWrite::Checkpoint(w));
                write_replies.push(WriteReply::Unit(reply));
            }
            Request::CompleteStored(w, reply) => {
                writes.push(LedgerWrite::CompleteStored(w));
                write_replies.push(WriteReply::Ids(reply));
            }
            Request::Fail(w, reply) => {
                writes.push(LedgerWrite::Fail(w));
                write_replies.push(WriteReply::Decision(reply));
            }
            Request::Cancel(w, reply) => {
                writes.push(LedgerWrite::Cancel(w));
                write_replies.push(WriteReply::Unit(reply));
            }
            Request::Refuse(w, reply) => {
                writes.push(LedgerWrite::Refuse(w));
                write_replies.push(WriteReply::State(reply));
            }
            Request::Release(w, reply) => {
                writes.push(LedgerWrite::Release(w));
                write_replies.push(WriteReply::Unit(reply));
            }
            Request::GiveBack(w, reply) => {
                writes.push(LedgerWrite::GiveBack(w));
                write_replies.push(WriteReply::Unit(reply));
            }
        }
    }
    starts.sort_by_key(|(w, _)| (w.run_id, w.lease.step_run_id()));
    completes.sort_by_key(|(w, _, _)| (w.run_id, w.lease.step_run_id()));
    let (starts, start_replies): (Vec<_>, Vec<_>) = starts.into_iter().unzip();
    let n = completes.len();
    let (mut complete_writes, mut complete_behind, mut complete_replies) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (w, behind, reply) in completes {
        complete_writes.push(w);
        complete_behind.push(behind);
        complete_replies.push(reply);
    }
    let completes = complete_writes;
    let (mut events, event_replies): (Vec<_>, Vec<_>) = events.into_iter().unzip();
    for e in &mut events {
        let evs = std::mem::take(&mut e.events);
        e.events = coalesce(evs);
    }
    Shaped {
        batch: Batch {
            starts,
            events,
            completes,
        },
        start_replies,
        event_replies,
        complete_replies,
        complete_behind,
        writes,
        write_replies,
    }
}

/// Writes one batch. Should it give up on a row another transaction holds,
/// the writes of the held steps are set aside and the rest written at once.
async fn flush(
    db: &Db,
    held: &mut Option<DbConnection>,
    worker: &str,
    mut s: Shaped,
    tainted: &mut Tainted,
    aside: &mut aside::Aside,
) {
    loop {
        let size = s.size();
        crate::metrics::ledger_batch(size);
        let res = crate::db::bounded(super::DB_CALL_TIMEOUT, "writing a ledger batch", async {
            let conn = match held {
                Some(c) => c,
                None => held.insert(db.connection("beginning a ledger batch").await?),
            };
            // a connection can take long to come (a server restarting):
            // what its writers gave up on meanwhile is not written
            let dropped = s.drop_abandoned();
            if dropped > 0 {
                debug!(
                    dropped,
                    "ledger writes whose writers gave up while the batch waited are not written"
                );
            }
            if s.size() == 0 {
                return Ok(None);
            }
            conn.conn()
                .write_ledger_within(worker, &s.batch, &s.writes, Some(LOCK_WAIT))
                .await
                .map(Some)
        })
        .await;
        let res = match res {
            Ok(None) => return,
            Ok(Some(out)) => Ok(out),
            Err(e) => Err(e),
        };
        // a failed call, or a write of it that failed alone (each is a few
        // statements of its own: the connection may have broken in one of
        // them): back to the pool, whose check clears or closes it; but
        // one that gave up on a lock is sound, and finds the rows it
        // waited for (`probe_held`)
        let gave_up_on_a_lock = matches!(&res, Err(e) if aside::is_lock_wait(e));
        if !gave_up_on_a_lock
            && res
                .as_ref()
                .map_or(true, |out| out.writes.iter().any(Result::is_err))
        {
            *held = None;
        }
        // nor is the pool's last free connection kept: the lease, the reclaim
        // and the attempts' artifact transfers would wait for it
        if !gave_up_on_a_lock && held.is_some() && !db.has_spare_connection() {
            *held = None;
        }
        match res {
            Err(e) if gave_up_on_a_lock => {
                let held_steps = probe_held(db, held, &s.steps()).await;
                let held_steps: HashMap<Uuid, Uuid> = match held_steps {
                    Ok(h) => h.into_iter().collect(),
                    Err(probe) if aside::is_lock_wait(&probe) => {
                        // not a row: the probe itself waited for a table
                        warn!(error = %e, size, "a ledger batch waits for a lock another session holds on a whole table (a LOCK TABLE, or a long transaction a lock waits behind: see pg_stat_activity and pg_blocking_pids); its writers retry");
                        s.fail(&e, tainted);
                        return;
                    }
                    Err(probe) => {
                        warn!(error = %probe, "could not find which rows a ledger batch waited for");
                        HashMap::new()
                    }
                };
                let rest = aside.set_aside(s, &held_steps);
                if rest.size() == 0 {
                    return;
                }
                if rest.size() == size {
                    // nothing held now (the holder let go, or it held another
                    // row): its writers retry, as for any transient error
                    warn!(error = %e, size, "a ledger batch waited too long for a lock (a row's, or a whole table's: see pg_stat_activity and pg_blocking_pids); its writers retry");
                    rest.fail(&e, tainted);
                    return;
                }
                s = rest;
            }
            res => return s.settle(res, db, worker, tainted).await,
        }
    }
}

/// Of `steps`, those whose rows another transaction holds, found on the
/// batch's own connection where it kept one (from the pool, the probe
/// waited behind every other user of it held up by the same lock:
/// database-chaos audit 97), which is then kept as after a batch.
async fn probe_held(
    db: &Db,
    held: &mut Option<DbConnection>,
    steps: &[Uuid],
) -> Result<Vec<(Uuid, Uuid)>, crate::db::DbError> {
    let found = crate::db::bounded(
        super::DB_CALL_TIMEOUT,
        "finding the rows another transaction holds",
        async {
            match held.as_mut() {
                Some(c) => c.conn().held_steps(steps, LOCK_WAIT).await,
                None => db.held_steps(steps, LOCK_WAIT).await,
            }
        },
    )
    .await;
    if found.is_err() || !db.has_spare_connection() {
        *held = None;
    }
    found
}

impl Shaped {
    /// The batch committed: each intent gets its own answer (written, or its
    /// lease lost, or its own error).
    fn answer(self, out: crate::db::LedgerOutcome, tainted: &mut Tainted) {
        let size = self.size();
        let Shaped {
            batch,
            start_replies,
            event_replies,
            complete_replies,
            complete_behind: _,
            writes,
            write_replies,
        } = self;
        debug!(
            size,
            starts = batch.starts.len(),
            events = batch.events.len(),
            completes = batch.completes.len(),
            writes = writes.len(),
            "ledger batch committed"
        );
        let sets = out.batch;
        for ((w, reply), o) in batch.starts.iter().zip(start_replies).zip(sets.starts) {
            let res = o.into_result(w.lease.step_run_id());
            if res.is_err() {
                tainted.mark(&w.lease);
            }
            let _ = reply.send(res);
        }
        for ((w, replies), o) in batch.events.iter().zip(event_replies).zip(sets.events) {
            for reply in replies {
                let res = o.clone().into_result(w.lease.step_run_id());
                if res.is_err() {
                    tainted.mark(&w.lease);
                }
                let _ = reply.send(res);
            }
        }
        for ((w, reply), o) in batch
            .completes
            .iter()
            .zip(complete_replies)
            .zip(sets.completes)
        {
            let _ = reply.send(o.into_result(w.lease.step_run_id()));
        }
        for ((w, reply), o) in writes.iter().zip(write_replies).zip(out.writes) {
            if let Err(e) = &o {
                debug!(error = %e, write = w.kind(), step_run_id = %w.lease().step_run_id(), "a ledger write failed alone; the rest of its batch committed");
            }
            reply.send(o);
        }
    }

    /// The batch was refused as a whole: each intent is written in a
    /// transaction of its own, in the batch's order, and answered alone.
    /// A success handed behind a lease's progress writes is not written
    /// when one of them failed here.
    async fn write_one_by_one(self, db: &Db, worker: &str, tainted: &mut Tainted) {
        let Shaped {
            batch,
            start_replies,
            event_replies,
            complete_replies,
            complete_behind,
            writes,
            write_replies,
        } = self;
        // each goes on its own, a connection wait each: what its writer gave
        // up on meanwhile is not written (see Shaped::drop_abandoned)
        for (w, reply) in batch.starts.into_iter().zip(start_replies) {
            if reply.is_closed() {
                continue;
            }
            let id = w.lease.step_run_id();
            let lease = w.lease.clone();
            let one = Batch {
                starts: vec![w],
                ..Batch::default()
            };
            let res = single(db, worker, &one, id).await;
            if res.is_err() {
                tainted.mark(&lease);
            }
            let _ = reply.send(res);
        }
        for (w, replies) in batch.events.into_iter().zip(event_replies) {
            if replies.iter().all(|r| r.is_closed()) {
                continue;
            }
            let id = w.lease.step_run_id();
            let lease = w.lease.clone();
            let one = Batch {
                events: vec![w],
                ..Batch::default()
            };
            let res = single(db, worker, &one, id).await;
            if res.is_err() {
                tainted.mark(&lease);
            }
            for reply in replies {
                let _ = reply.send(clone_result(&res));
            }
        }
        for ((w, reply), behind) in batch
            .completes
            .into_iter()
            .zip(complete_replies)
            .zip(complete_behind)
        {
            if reply.is_closed() {
                continue;
            }
            if tainted.holds_back(&w, behind) {
                let _ = reply.send(Err(behind_failed()));
                continue;
            }
            let id = w.lease.step_run_id();
            let one = Batch {
                completes: vec![w],
                ..Batch::default()
            };
            let _ = reply.send(single(db, worker, &one, id).await);
        }
        for (w, reply) in writes.iter().zip(write_replies) {
            if reply.is_closed() {
                continue;
            }
            reply.send(single_write(db, worker, w).await);
        }
    }

    /// Nothing of the batch committed: every intent gets the batch's error.
    fn fail(self, e: &DbError, tainted: &mut Tainted) {
        for w in &self.batch.starts {
            tainted.mark(&w.lease);
        }
        for w in &self.batch.events {
            tainted.mark(&w.lease);
        }
        for r in self.start_replies.into_iter().chain(self.complete_replies) {
            let _ = r.send(Err(as_each(e)));
        }
        for r in self.event_replies.into_iter().flatten() {
            let _ = r.send(Err(as_each(e)));
        }
        for r in self.write_replies {
            r.fail(as_each(e));
        }
    }
}

/// Moves the pairs of `items` and `replies` (parallel) whose item `pick`
/// names out, in order: (taken items, their replies).
fn split<A, B>(
    items: &mut Vec<A>,
    replies: &mut Vec<B>,
    pick: impl Fn(&A) -> bool,
) -> (Vec<A>, Vec<B>) {
    let (mut taken, mut taken_replies) = (Vec::new(), Vec::new());
    let (mut kept, mut kept_replies) = (Vec::new(), Vec::new());
    for (a, b) in std::mem::take(items)
        .into_iter()
        .zip(std::mem::take(replies))
    {
        if pick(&a) {
            taken.push(a);
            taken_replies.push(b);
        } else {
            kept.push(a);
            kept_replies.push(b);
        }
    }
    *items = kept;
    *replies = kept_replies;
    (taken, taken_replies)
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

/// One write on its own (its own transaction), answered as that write.
async fn single_write(db: &Db, worker: &str, w: &LedgerWrite) -> Result<Written, DbError> {
    let res = crate::db::bounded(
        super::DB_CALL_TIMEOUT,
        "writing a ledger intent",
        db.write_ledger(worker, &Batch::default(), std::slice::from_ref(w)),
    )
    .await?;
    res.writes
        .into_iter()
        .next()
        .unwrap_or(Err(DbError::LeaseLost {
            step_run_id: w.lease().step_run_id(),
        }))
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
        // the cause a writer's retries name (they said only "failed as a
        // whole" behind a LOCK TABLE: database-chaos audit 97)
        e if aside::is_lock_wait(e) => DbError::Retry {
            context:
                "a ledger batch waited for a lock another session holds (a LOCK TABLE, or a long \
                      transaction a lock waits behind: see pg_stat_activity and pg_blocking_pids)",
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

    pub(super) fn ev(seq: u64, kind: &'static str) -> OwnedEvent {
        OwnedEvent {
            sequence: seq,
            kind,
            message: String::new(),
            fraction: None,
            executor_at: None,
        }
    }

    pub(super) fn lease(n: u128) -> crate::db::Lease {
        crate::db::Lease::for_test(Uuid::from_u128(n), Uuid::from_u128(n + 1000), 1)
    }

    pub(super) fn events(n: u128) -> Request {
        let (r, _) = oneshot::channel();
        Request::Events(
            EventsWrite {
                lease: lease(n),
                events: vec![ev(2, "progress")],
            },
            r,
        )
    }

    fn checkpoint(n: u128) -> Request {
        let (r, _) = oneshot::channel();
        Request::Checkpoint(
            CheckpointWrite {
                lease: lease(n),
                events: vec![],
                renew_for: std::time::Duration::from_secs(2),
            },
            r,
        )
    }

    pub(super) fn release(n: u128) -> Request {
        let (r, _) = oneshot::channel();
        Request::Release(
            ReleaseWrite {
                lease: lease(n),
                message: String::new(),
            },
            r,
        )
    }

    fn complete_as(n: u128, behind: bool) -> (Request, oneshot::Receiver<Result<(), DbError>>) {
        let (reply, answer) = oneshot::channel();
        let r = Request::Complete {
            write: CompleteWrite {
                run_id: Uuid::from_u128(n + 2000),
                lease: lease(n),
                output: serde_json::Value::Null,
                sequence: None,
            },
            behind,
            reply,
        };
        (r, answer)
    }

    fn complete(n: u128) -> Request {
        complete_as(n, false).0
    }

    /// A success handed behind progress writes that failed is answered with
    /// a transient error and not written; every other write goes on, and a
    /// lease's answered terminal write takes it out of the set.
    #[test]
    fn a_success_behind_failed_progress_writes_is_held_back() {
        let mut t = Tainted::default();
        let (behind1, mut a1) = complete_as(1, true);
        let mut buf = vec![events(1), behind1];
        t.admit(&mut buf);
        assert_eq!(buf.len(), 2, "nothing failed: nothing held back");
        assert!(a1.try_recv().is_err(), "not answered yet");

        t.mark(&lease(1));
        let (behind1, mut a1) = complete_as(1, true);
        let (behind2, mut a2) = complete_as(2, true);
        let mut buf = vec![events(1), behind1, behind2, release(3)];
        t.admit(&mut buf);
        let kinds: Vec<Option<Uuid>> = buf
            .iter()
            .map(|r| r.set_step().or(r.single_step()))
            .collect();
        assert_eq!(
            kinds,
            [
                Some(lease(1).step_run_id()),
                Some(lease(2).step_run_id()),
                Some(lease(3).step_run_id())
            ],
            "only the success behind the failed lease is taken out"
        );
        match a1.try_recv() {
            Ok(Err(e)) => assert!(e.is_transient(), "{e}"),
            other => panic!("the held-back success is answered with a transient error: {other:?}"),
        }
        assert!(a2.try_recv().is_err(), "another lease's success goes on");

        // the retrying commit (not behind) goes through, and clears the lease
        let (again, _) = complete_as(1, false);
        let mut buf = vec![again];
        t.admit(&mut buf);
        assert_eq!(buf.len(), 1);
        assert!(!t.holds(&lease(1)));
        let (behind1, _) = complete_as(1, true);
        let mut buf = vec![behind1];
        t.admit(&mut buf);
        assert_eq!(buf.len(), 1);
    }

    /// When a batch waits for more writes before it is flushed
    /// (`Company::linger`).
    #[test]
    fn a_batch_lingers_for_company_only_where_it_can_find_some() {
        // a ledger whose waits for company paid, and one whose did not
        let paying = Company::new();
        let fruitless = Company {
            score: 0,
            skipped: 0,
        };
        // (the ledger was idle, the batch holds a start without its
        // ending, the worker's leases, waiting paid lately) → why it waits
        let table: &[(bool, bool, usize, bool, Option<Wait>)] = &[
            // one attempt: nobody else can write, so nothing is waited for
            // (submit → accepted is not delayed)
            (true, true, 1, true, None),
            (true, false, 1, true, None),
            (false, true, 1, true, None),
            (false, false, 0, true, None),
            // an idle ledger waits for the other attempts' writes
            (true, false, 2, true, Some(Wait::Company)),
            (true, true, 64, true, Some(Wait::Company)),
            // ... unless waiting has stopped paying: then a batch with a
            // start still waits for its ending
            (true, false, 2, false, None),
            (true, true, 2, false, Some(Wait::Starts)),
            // writes queued behind a flush fill the batch already: only a
            // batch with a start waits, for the ending behind it
            (false, true, 2, true, Some(Wait::Starts)),
            (false, false, 2, true, None),
            (false, false, 128, true, None),
        ];
        for &(waited, open_start, live, worth, want) in table {
            let mut c = if worth { paying } else { fruitless };
            assert_eq!(
                c.linger(waited, open_start, live),
                want,
                "waited {waited}, open start {open_start}, {live} leases, worth {worth}"
            );
        }
    }

    /// Waits that bring no other lease's write stop within a dozen, one in
    /// eight idle batches still waits to look again, and waits that pay
    /// bring waiting back.
    #[test]
    fn waiting_for_company_stops_when_it_does_not_pay_and_comes_back_when_it_does() {
        let mut c = Company::new();
        // fruitless waits: the score falls below a quarter after 11
        let mut waits = 0;
        while c.worth_waiting() {
            c.waited(false);
            waits += 1;
            assert!(waits < 100, "never stops waiting: {c:?}");
        }
        assert_eq!(waits, 11, "{c:?}");
        // then one idle batch in 8 waits (the first refusal above was 1)
        let pattern: Vec<bool> = (0..16)
            .map(|_| {
                let w = c.worth_waiting();
                if w {
                    c.waited(false);
                }
                w
            })
            .collect();
        let probes: Vec<usize> = (0..16).filter(|&i| pattern[i]).collect();
        assert_eq!(probes, [6, 14], "{pattern:?}");
        // probes that pay raise the score until waiting is the rule again
        let mut batches = 0;
        loop {
            batches += 1;
            assert!(batches < 100, "never waits again: {c:?}");
            if c.worth_waiting() {
                c.waited(true);
                if c.score >= Company::WORTH {
                    break;
                }
            }
        }
        assert!(c.worth_waiting() && c.worth_waiting(), "{c:?}");
        // a wait that pays half the time keeps waiting on
        let mut c = Company::new();
        for i in 0..200 {
            assert!(c.worth_waiting(), "wait {i} refused: {c:?}");
            c.waited(i % 2 == 0);
        }
    }

    /// A wait ends once nothing it waits for can still come, and at its
    /// time at the latest (`Gathering`): a start waits for its ending up to
    /// START_LINGER from its arrival (a start arriving during the wait is
    /// waited for too), company up to IDLE_LINGER unless every lease the
    /// worker holds has written, no wait past MAX_LINGER.
    #[test]
    fn a_wait_ends_once_nothing_it_waits_for_can_still_come() {
        const MS: Duration = Duration::from_millis(1);
        type Make = fn(u128) -> Request;
        // (why it waits, the worker's leases, the batch when the wait
        // began, what arrives and when after the wait began) → when the
        // wait ends after its beginning if nothing more arrives (None: at
        // once), and whether it paid (another lease's write joined)
        type Case = (
            Wait,
            usize,
            &'static [(Make, u128)],
            &'static [(Make, u128, u64)],
            Option<Duration>,
            bool,
        );
        const S: Wait = Wait::Starts;
        const C: Wait = Wait::Company;
        let cases: &[Case] = &[
            // a start alone waits START_LINGER for its ending
            (S, 4, &[(start, 1)], &[], Some(START_LINGER), false),
            // its events are no ending; its completion is
            (
                S,
                4,
                &[(start, 1)],
                &[(events, 1, 1), (complete, 1, 2)],
                None,
                false,
            ),
            // every start of the batch, each by its own ending: a release
            // counts, a checkpoint does not
            (
                S,
                4,
                &[(start, 1), (events, 1), (start, 2)],
                &[(complete, 1, 1), (checkpoint, 2, 1), (release, 2, 2)],
                None,
                false,
            ),
            (
                S,
                4,
                &[(start, 1), (start, 2)],
                &[(complete, 1, 1), (checkpoint, 2, 1)],
                Some(START_LINGER),
                false,
            ),
            // a start that arrives during the wait is waited for, from its
            // own arrival
            (
                S,
                4,
                &[(start, 1)],
                &[(start, 3, 2), (complete, 1, 3)],
                Some(2 * MS + START_LINGER),
                true,
            ),
            // ... but no wait lasts past MAX_LINGER
            (
                S,
                4,
                &[(start, 1)],
                &[(start, 3, 4), (start, 4, 8)],
                Some(MAX_LINGER),
                true,
            ),
            // another lease's ending does not end the wait
            (
                S,
                4,
                &[(start, 1)],
                &[(complete, 2, 1), (complete, 3, 1)],
                Some(START_LINGER),
                true,
            ),
            // a batch that holds its start's ending already
            (S, 2, &[(start, 1), (complete, 1)], &[], None, false),
            // company: IDLE_LINGER ...
            (
                C,
                3,
                &[(complete, 1)],
                &[(events, 2, 1)],
                Some(IDLE_LINGER),
                true,
            ),
            // ... unless every lease has written and no start is open
            (
                C,
                3,
                &[(complete, 1)],
                &[(events, 2, 1), (complete, 3, 2)],
                None,
                true,
            ),
            (
                C,
                2,
                &[(start, 1)],
                &[(complete, 2, 1)],
                Some(START_LINGER),
                true,
            ),
            (
                C,
                2,
                &[(start, 1)],
                &[(complete, 2, 1), (complete, 1, 2)],
                None,
                true,
            ),
            // the start's own completion is no company
            (
                C,
                2,
                &[(start, 1)],
                &[(complete, 1, 1)],
                Some(IDLE_LINGER),
                false,
            ),
        ];
        let t0 = Instant::now();
        for (i, &(wait, live, first, then, ends, paid)) in cases.iter().enumerate() {
            let first: Vec<Request> = first.iter().map(|(f, n)| f(*n)).collect();
            let mut g = Gathering::new(wait, live, &first, t0);
            let mut at = t0;
            for (f, n, ms) in then {
                at = t0 + *ms as u32 * MS;
                assert!(g.until(at).is_some(), "case {i}: ended before {ms} ms");
                g.add(&f(*n), at);
            }
            assert_eq!(
                g.until(at).map(|u| u - t0),
                ends,
                "case {i}: when the wait ends"
            );
            assert_eq!(g.paid(), paid, "case {i}");
        }
        // a wait whose time has come ends
        let g = Gathering::new(Wait::Starts, 2, &[start(1)], t0);
        assert_eq!(g.until(t0 + START_LINGER), None);
        assert!(g.until(t0 + START_LINGER - MS).is_some());
    }

    /// A request whose writer gave up waiting (its answer's receiver is
    /// gone) is not written; one still awaited is (re-check audit: a
    /// success given up on landed later, behind dropped checkpoints).
    #[test]
    fn a_request_nobody_waits_for_is_not_written() {
        let (live, _waiting) = oneshot::channel();
        let mut buf = vec![
            release(1), // its receiver is dropped at once
            Request::Release(
                ReleaseWrite {
                    lease: lease(2),
                    message: String::new(),
                },
                live,
            ),
            events(3),
        ];
        assert_eq!(drop_abandoned(&mut buf), 2);
        assert_eq!(
            buf.iter().map(|r| r.lease_key().0).collect::<Vec<_>>(),
            [lease(2).step_run_id()]
        );
    }

    /// The set-based part is written before the other writes: a set write of
    /// a step behind another write of that step ends the batch, so the
    /// step's writes keep their order; other steps' writes do not.
    #[test]
    fn a_batch_ends_before_a_set_write_that_follows_a_write_of_its_step() {
        assert_eq!(batch_end(&[]), 0);
        // events before a checkpoint and a release of the same step: in order as it is
        assert_eq!(batch_end(&[events(1), checkpoint(1), release(1)]), 3);
        // another step's set writes after a single write are not held back
        assert_eq!(batch_end(&[release(1), events(2), complete(2)]), 3);
        // events behind a checkpoint of their step wait for the next batch,
        // and so does everything behind them
        assert_eq!(
            batch_end(&[events(1), checkpoint(1), events(2), events(1), release(2)]),
            3
        );
        assert_eq!(batch_end(&[checkpoint(1), complete(1)]), 1);
        let shaped = shape(vec![release(1), events(2), checkpoint(2), complete(3)]);
        assert_eq!(shaped.size(), 4);
        let kinds: Vec<&str> = shaped.writes.iter().map(|w| w.kind()).collect();
        assert_eq!(
            kinds,
            ["release", "checkpoint"],
            "the other writes keep their order"
        );
    }

    #[test]
    fn a_batch_holds_at_most_max_singles_writes_of_their_own() {
        // at most MAX_SINGLES writes of their own, set writes around them
        // do not count
        let mut many = vec![events(1000)];
        many.extend((0..MAX_SINGLES as u128 + 5).map(release));
        assert_eq!(batch_end(&many), MAX_SINGLES + 1);
        let sets: Vec<_> = (0..MAX_BATCH as u128).map(events).collect();
        assert_eq!(batch_end(&sets), MAX_BATCH);
    }

    fn start(n: u128) -> Request {
        let (r, _) = oneshot::channel();
        Request::Start(
            StartWrite {
                run_id: Uuid::from_u128(n + 2000),
                lease: lease(n),
                pid: 1,
                event: ev(1, "accepted"),
            },
            r,
        )
    }

    /// Setting the writes of some steps aside takes each of them with its
    /// replies, in the order they had, and leaves the others as they were.
    #[test]
    fn take_moves_the_writes_of_the_steps_named_with_their_replies() {
        let (c2, mut a2) = complete_as(2, true);
        let (c3, mut a3) = complete_as(3, false);
        let mut s = shape(vec![
            start(1),
            start(2),
            events(2),
            events(1),
            c2,
            c3,
            checkpoint(2),
            release(1),
        ]);
        let step = |n: u128| lease(n).step_run_id();
        let aside = s.take(|id| id == step(2));
        let steps =
            |s: &Shaped| -> Vec<Uuid> { s.leases().into_iter().map(|(id, _)| id).collect() };
        assert_eq!(steps(&aside), [step(2), step(2), step(2), step(2)]);
        assert_eq!(steps(&s), [step(1), step(1), step(3), step(1)]);
        assert_eq!(aside.complete_behind, [true]);
        assert_eq!(s.complete_behind, [false]);
        let kinds = |s: &Shaped| -> Vec<&str> { s.writes.iter().map(|w| w.kind()).collect() };
        assert_eq!(kinds(&aside), ["checkpoint"]);
        assert_eq!(kinds(&s), ["release"]);
        assert_eq!(
            (
                aside.start_replies.len(),
                aside.event_replies.len(),
                aside.write_replies.len()
            ),
            (1, 1, 1)
        );
        // each completion kept its own reply
        aside.fail(
            &DbError::LeaseLost {
                step_run_id: step(2),
            },
            &mut Tainted::default(),
        );
        assert!(matches!(a2.try_recv(), Ok(Err(DbError::LeaseLost { .. }))));
        assert!(
            a3.try_recv().is_err(),
            "the other completion is not answered"
        );
        assert_eq!(s.steps(), {
            let mut v = vec![step(1), step(3)];
            v.sort_unstable();
            v
        });
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
