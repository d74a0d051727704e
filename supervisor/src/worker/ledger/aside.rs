//! Writes set aside: those of steps whose run row (or own row) another
//! transaction holds for longer than the ledger's lock wait.
//!
//! The ledger writes every batch with a bounded lock wait ([`LOCK_WAIT`]). A
//! batch that gives up on a held row asks the database which of its steps'
//! rows are held right now; their writes come here, each under its run, and
//! the rest of the batch is written at once. So an operator's open
//! transaction on one run (or a long cancel of a large run) delays the
//! writes of that run alone, not every step of the worker.
//!
//! Here the writes of one run are written in the order they came, each on
//! its own, with the same bounded wait; a run whose row is still held is
//! tried again after a pause (doubling to [`MAX_PAUSE`]), so no connection
//! of the pool is kept waiting on a lock. Every later write of a lease with
//! a write here, and every start of a run with one, comes here too (the
//! ledger routes them: [`Aside::route`]) until this writer answered them all,
//! so one lease's writes still land in order. The attempts wait for their
//! answers as for any write, while the heartbeat (its own connection, which
//! skips rows it cannot lock) keeps their leases.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn, Instrument};
use uuid::Uuid;

use super::{shape, LeaseKey, Request, Shaped, Tainted, LOCK_WAIT};
use crate::db::{Db, DbError};

/// The first pause before a run whose row is held is tried again.
const FIRST_PAUSE: Duration = Duration::from_millis(25);
/// The longest pause between two tries of a held run.
const MAX_PAUSE: Duration = Duration::from_millis(500);
/// How often a run still held is logged again (a drain waits for its writes).
const STILL_HELD_EVERY: Duration = Duration::from_secs(15);

/// The writes aside of one run, in the order they came.
struct RunQueue {
    units: VecDeque<(Item, Vec<LeaseKey>)>,
    /// When its first write came (the row has been held about as long).
    since: Instant,
    /// When it was last said to be still held.
    told: Instant,
    /// Whether it was said to be held (its release is said then too).
    said: bool,
}

impl RunQueue {
    fn new() -> RunQueue {
        let now = Instant::now();
        RunQueue {
            units: VecDeque::new(),
            since: now,
            told: now,
            said: false,
        }
    }

    /// Its row was still held at a try: said every `STILL_HELD_EVERY`.
    fn still_held(&mut self, run: Uuid) {
        if self.told.elapsed() >= STILL_HELD_EVERY {
            self.told = Instant::now();
            self.said = true;
            warn!(%run, writes = self.units.len(), held_for_s = self.since.elapsed().as_secs(), "this run's row is still held by another transaction; its writes wait (and a drain waits for them): look for a long transaction in pg_stat_activity");
        }
    }
}

/// What the ledger hands over: a part of a batch, or one request that came
/// after its lease's (or its run's) writes were set aside.
enum Item {
    Unit(Shaped),
    Request(Request),
}

/// An item on its way to the writer: its run, and the leases the ledger
/// counted for it (given back in [`Answered`] once it is answered).
struct Queued {
    run: Uuid,
    leases: Vec<LeaseKey>,
    item: Item,
}

impl Item {
    /// The item as a unit to write, made when its turn comes (every earlier
    /// write of its run, its lease's among them, answered): a request is
    /// admitted then, so a success handed behind its lease's progress
    /// writes that failed here is answered (not written) and leaves an
    /// empty unit.
    fn into_unit(self, tainted: &mut Tainted) -> Shaped {
        match self {
            Item::Unit(s) => s,
            // its writer gave up waiting (see Request::abandoned)
            Item::Request(r) if r.abandoned() => {
                debug!("a ledger write set aside whose writer gave up is not written");
                shape(Vec::new())
            }
            Item::Request(r) => {
                let mut one = vec![r];
                tainted.admit(&mut one);
                shape(one)
            }
        }
    }
}

/// One write set aside was answered: its run, and the leases it held.
struct Answered {
    run: Uuid,
    leases: Vec<LeaseKey>,
}

/// The ledger's side of the writer: which runs and leases have writes
/// aside (how many each), to route their later writes the same way.
pub(super) struct Aside {
    tx: Option<mpsc::UnboundedSender<Queued>>,
    answered: mpsc::UnboundedReceiver<Answered>,
    runs: HashMap<Uuid, usize>,
    leases: HashMap<LeaseKey, (Uuid, usize)>,
    task: JoinHandle<()>,
}

impl Aside {
    /// Starts the writer: it writes through the pool of `db`.
    pub(super) fn start(db: Db, worker: String) -> Aside {
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, answered) = mpsc::unbounded_channel();
        // in the worker's span (its name and id), as every ledger line
        // (outside audit: the "still held" warning had none)
        let task = tokio::spawn(writer(db, worker, rx, done_tx).in_current_span());
        Aside {
            tx: Some(tx),
            answered,
            runs: HashMap::new(),
            leases: HashMap::new(),
            task,
        }
    }

    /// Whether nothing is aside (then nothing needs routing).
    fn is_idle(&mut self) -> bool {
        self.take_answers();
        self.runs.is_empty()
    }

    fn take_answers(&mut self) {
        while let Ok(a) = self.answered.try_recv() {
            if let Some(n) = self.runs.get_mut(&a.run) {
                *n -= 1;
                if *n == 0 {
                    self.runs.remove(&a.run);
                }
            }
            for l in a.leases {
                if let Some((_, n)) = self.leases.get_mut(&l) {
                    *n -= 1;
                    if *n == 0 {
                        self.leases.remove(&l);
                    }
                }
            }
        }
    }

    /// Takes out of `buf` the requests that must follow writes aside: a
    /// lease's with writes aside, and a start (or a success) of a run with
    /// writes aside.
    pub(super) fn route(&mut self, buf: &mut Vec<Request>) {
        if self.is_idle() {
            return;
        }
        let mut kept = Vec::with_capacity(buf.len());
        for r in buf.drain(..) {
            let run = self
                .leases
                .get(&r.lease_key())
                .map(|(run, _)| *run)
                .or_else(|| r.run_id().filter(|run| self.runs.contains_key(run)));
            match run {
                Some(run) => {
                    debug!(%run, step_run_id = %r.lease_key().0, "a write follows its run's writes aside");
                    let leases = vec![r.lease_key()];
                    self.send(run, leases, Item::Request(r));
                }
                None => kept.push(r),
            }
        }
        *buf = kept;
    }

    /// Sets aside the writes of `held` steps (step → run) of `s`, a batch
    /// that gave up on a held row; returns the rest of it.
    pub(super) fn set_aside(&mut self, mut s: Shaped, held: &HashMap<Uuid, Uuid>) -> Shaped {
        let mut runs: Vec<Uuid> = held.values().copied().collect();
        runs.sort_unstable();
        runs.dedup();
        for run in runs {
            let unit = s.take(|step| held.get(&step) == Some(&run));
            if unit.size() == 0 {
                continue;
            }
            crate::metrics::ledger_set_aside(unit.size());
            info!(%run, writes = unit.size(), wait_ms = LOCK_WAIT.as_millis() as u64, "another transaction holds this run's row (or its steps'): its writes wait aside, the worker's other writes go on");
            let leases = unit.leases();
            self.send(run, leases, Item::Unit(unit));
        }
        s
    }

    fn send(&mut self, run: Uuid, leases: Vec<LeaseKey>, item: Item) {
        *self.runs.entry(run).or_default() += 1;
        for l in &leases {
            self.leases.entry(*l).or_insert((run, 0)).1 += 1;
        }
        if let Some(tx) = &self.tx {
            // the writer ends only once this sender is gone; should it have
            // died, the item's replies are dropped with it: its writers get
            // "the ledger stopped", a transient error
            let _ = tx.send(Queued { run, leases, item });
        }
    }

    /// The ledger ends: what is aside is tried once more, what is still held
    /// then is answered with a transient error.
    pub(super) async fn close(mut self) {
        self.tx = None;
        if let Err(e) = self.task.await {
            warn!(error = %e, "the writer of writes aside ended abnormally");
        }
    }
}

/// Writes aside, per run in the order they came; a run whose row is held is
/// tried again after a pause. Ends once the ledger is gone and everything
/// was tried since.
async fn writer(
    db: Db,
    worker: String,
    mut rx: mpsc::UnboundedReceiver<Queued>,
    answered: mpsc::UnboundedSender<Answered>,
) {
    let mut queues: BTreeMap<Uuid, RunQueue> = BTreeMap::new();
    let mut tainted = Tainted::default();
    let mut pause = FIRST_PAUSE;
    let mut open = true;
    loop {
        if queues.is_empty() {
            if !open {
                return;
            }
            match rx.recv().await {
                Some(q) => take_in(&mut queues, q),
                None => return,
            }
        }
        while let Ok(q) = rx.try_recv() {
            take_in(&mut queues, q);
        }
        let mut wrote = false;
        for (run, rq) in queues.iter_mut() {
            while let Some((item, leases)) = rq.units.pop_front() {
                let unit = item.into_unit(&mut tainted);
                if unit.size() == 0 {
                    // a success held back (and answered): nothing to write
                    let _ = answered.send(Answered { run: *run, leases });
                    continue;
                }
                let res = crate::db::bounded(
                    super::super::DB_CALL_TIMEOUT,
                    "writing a ledger batch set aside",
                    db.write_ledger_within(&worker, &unit.batch, &unit.writes, Some(LOCK_WAIT)),
                )
                .await;
                match res {
                    // still held: tried again after a pause; once the ledger
                    // is gone, this was the last try (answered below)
                    Err(e) if is_lock_wait(&e) => {
                        rq.units.push_front((Item::Unit(unit), leases));
                        rq.still_held(*run);
                        break;
                    }
                    res => {
                        wrote = true;
                        unit.settle(res, &db, &worker, &mut tainted).await;
                        let _ = answered.send(Answered { run: *run, leases });
                        debug!(%run, "a write set aside was answered");
                    }
                }
            }
        }
        queues.retain(|run, q| {
            if q.units.is_empty() && q.said {
                // the warning said it was held: say it is over
                info!(%run, held_for_s = q.since.elapsed().as_secs(), "this run's row is free again: its writes set aside are made");
            }
            !q.units.is_empty()
        });
        if !open {
            // the last try was made: what is left is answered as not written
            for (run, q) in std::mem::take(&mut queues) {
                warn!(%run, writes = q.units.len(), "the worker stopped while this run's row was still held by another transaction: these writes were not made");
                for (item, _) in q.units {
                    item.into_unit(&mut tainted)
                        .fail(&stopped_while_held(), &mut tainted);
                }
            }
            return;
        }
        if queues.is_empty() || wrote {
            pause = FIRST_PAUSE;
            continue;
        }
        // every run left is still held: a pause, cut short by a new write
        tokio::select! {
            got = rx.recv() => match got {
                Some(q) => take_in(&mut queues, q),
                None => open = false,
            },
            _ = tokio::time::sleep(pause) => pause = (pause * 2).min(MAX_PAUSE),
        }
    }
}

fn take_in(queues: &mut BTreeMap<Uuid, RunQueue>, Queued { run, leases, item }: Queued) {
    queues
        .entry(run)
        .or_insert_with(RunQueue::new)
        .units
        .push_back((item, leases));
}

/// The batch gave up waiting for a row lock (`lock_timeout`).
pub(super) fn is_lock_wait(e: &DbError) -> bool {
    e.sqlstate().as_deref() == Some("55P03")
}

fn stopped_while_held() -> DbError {
    DbError::Retry {
        context: "the worker stopped while another transaction held this step's run row",
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{ev, events, lease, release};
    use super::*;
    use crate::db::{CompleteWrite, StartWrite};
    use tokio::sync::oneshot;

    fn run_of(n: u128) -> Uuid {
        Uuid::from_u128(n + 2000)
    }

    fn start(n: u128, run: Uuid) -> Request {
        let (r, _) = oneshot::channel();
        Request::Start(
            StartWrite {
                run_id: run,
                lease: lease(n),
                pid: 1,
                event: ev(1, "accepted"),
            },
            r,
        )
    }

    fn complete(n: u128, run: Uuid) -> (Request, oneshot::Receiver<Result<(), DbError>>) {
        let (reply, answer) = oneshot::channel();
        let r = Request::Complete {
            write: CompleteWrite {
                run_id: run,
                lease: lease(n),
                output: serde_json::Value::Null,
                sequence: None,
            },
            behind: false,
            reply,
        };
        (r, answer)
    }

    fn steps(buf: &[Request]) -> Vec<Uuid> {
        buf.iter().map(|r| r.lease_key().0).collect()
    }

    /// What follows writes aside goes aside too: later writes of their
    /// leases, and starts and successes of their runs; the rest stays. Once
    /// every write aside is answered, nothing is routed any more.
    #[tokio::test]
    async fn later_writes_of_leases_and_runs_aside_follow_them() {
        // nothing listens there: the writer's tries fail at once, and their
        // writers get that (transient) error as their answer
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("lazy pool");
        let mut aside = Aside::start(Db::from_pool(pool), "w".into());
        let held_run = run_of(1);
        let mut buf = vec![events(1), start(2, held_run)];
        aside.route(&mut buf);
        assert_eq!(buf.len(), 2, "nothing is aside: nothing is routed");

        let (c1, mut answer) = complete(1, held_run);
        let held: HashMap<Uuid, Uuid> = [(lease(1).step_run_id(), held_run)].into();
        let rest = aside.set_aside(shape(vec![c1, events(3)]), &held);
        assert_eq!(steps_of(&rest), [lease(3).step_run_id()]);

        let (c5, _) = complete(5, held_run);
        let (c6, _) = complete(6, run_of(6));
        let mut buf = vec![
            events(1),           // its lease is aside
            start(2, held_run),  // its run is
            events(2),           // and so now is its lease
            start(4, run_of(4)), // another run
            c5,                  // a success of the held run
            c6,                  // of another run
            release(7),          // names no run: stays (it would wait, then go aside)
        ];
        aside.route(&mut buf);
        assert_eq!(
            steps(&buf),
            [
                lease(4).step_run_id(),
                lease(6).step_run_id(),
                lease(7).step_run_id()
            ]
        );

        // the writer answers them (here with the pool's error); once all are
        // answered, nothing more goes aside
        let got = tokio::time::timeout(Duration::from_secs(10), &mut answer)
            .await
            .expect("answered")
            .expect("a reply");
        assert!(got.is_err_and(|e| e.is_transient()));
        let until = Instant::now() + Duration::from_secs(10);
        while !aside.is_idle() {
            assert!(
                Instant::now() < until,
                "the writes aside were never all answered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(aside.leases.is_empty() && aside.runs.is_empty());
        let mut buf = vec![events(1), start(9, held_run)];
        aside.route(&mut buf);
        assert_eq!(buf.len(), 2, "all answered: nothing is routed");
        aside.close().await;
    }

    /// A write set aside whose writer gave up waiting is not written when
    /// its turn comes (re-check audit: a success the attempt had given up
    /// on landed when the held rows were let go).
    #[test]
    fn a_write_aside_nobody_waits_for_is_not_written() {
        let (given_up, answer) = complete(1, run_of(1));
        drop(answer);
        let (awaited, _answer) = complete(2, run_of(2));
        let mut tainted = Tainted::default();
        assert_eq!(Item::Request(given_up).into_unit(&mut tainted).size(), 0);
        assert_eq!(Item::Request(awaited).into_unit(&mut tainted).size(), 1);
    }

    fn steps_of(s: &Shaped) -> Vec<Uuid> {
        s.leases().into_iter().map(|(id, _)| id).collect()
    }
}
