//! The worker's renewal set: the leases its heartbeat renews, each with the
//! channel that tells its attempt about cancel requests, lost leases and the
//! lease clock.
//!
//! An entry belongs to one *attempt*, not to a step: a retry of a step can be
//! leased by this worker while the previous attempt's task is still winding
//! down (its failure is committed, so the step is leasable again, but its slot
//! is not yet freed). Every operation therefore matches the lease token, so
//! the old attempt's cleanup cannot drop the retry from the renewal set and a
//! heartbeat answer about the old token cannot reach the retry.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use super::{Control, LeaseView};
use crate::db::{HeartbeatReport, Lease};

struct Entry {
    lease: Lease,
    /// The step's run and name, for the last word of a forced exit.
    step: StepName,
    tx: watch::Sender<LeaseView>,
    /// The attempt's outcome is decided and being committed: its own fenced
    /// write, not the heartbeat, says whether the lease still held.
    committing: bool,
}

impl Entry {
    /// Moves the lease clock on to `until`, never back; with `running_at`,
    /// only if the clock had not run out by then.
    fn move_clock_on(&self, until: Instant, running_at: Option<Instant>) {
        self.tx.send_if_modified(|v| {
            let later = v.valid_until < until && running_at.is_none_or(|now| v.valid_until > now);
            if later {
                v.valid_until = until;
            }
            later
        });
    }
}

/// What applying one heartbeat answer did (the heartbeat logs it).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Leases of this set the database renewed.
    pub renewed: usize,
    /// Busy leases (a write held their row) whose clock moved to what their
    /// last committed renewal holds.
    pub held: usize,
    /// Attempts told of a cancel request for the first time.
    pub cancelled: usize,
    /// Steps whose attempt was told its lease is lost.
    pub lost: Vec<Uuid>,
    /// Steps the database no longer had leased to this worker while their
    /// attempt was committing its outcome: most often that commit itself,
    /// which landed between the heartbeat's snapshot and its statement. Not a
    /// lost lease: the commit's own fence tells the attempt (and logs a
    /// real loss).
    pub ended: Vec<Uuid>,
}

/// A step as a person finds it: its run and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepName {
    pub run_id: Uuid,
    pub name: String,
}

/// An attempt that holds a lease (see [`LeaseSet::attempts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Held {
    pub step_run_id: Uuid,
    pub step: StepName,
    /// Its outcome is decided and being committed.
    pub committing: bool,
}

/// One entry per step: the newest attempt of it that this worker holds.
#[derive(Default)]
pub(crate) struct LeaseSet {
    map: Mutex<HashMap<Uuid, Entry>>,
}

impl LeaseSet {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Entry>> {
        // no operation can leave the map inconsistent if it panics
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new lease joins the set; its attempt watches the returned receiver.
    /// An older attempt of the same step still in the set has already
    /// resolved its outcome (the step could not be leased again otherwise),
    /// so the new lease takes its place.
    pub fn insert(
        &self,
        lease: Lease,
        step: StepName,
        valid_until: Instant,
    ) -> watch::Receiver<LeaseView> {
        let (tx, rx) = watch::channel(LeaseView {
            control: Control::Run,
            valid_until,
        });
        self.map().insert(
            lease.step_run_id(),
            Entry {
                lease,
                step,
                tx,
                committing: false,
            },
        );
        rx
    }

    /// The attempt holding `lease` decided its outcome and commits it now:
    /// the lease stays in the set (renewed while the commit waits), but a
    /// heartbeat that no longer finds it is not reported as a lost lease.
    pub fn committing(&self, lease: &Lease) {
        let mut map = self.map();
        if let Some(e) = map
            .get_mut(&lease.step_run_id())
            .filter(|e| e.lease.token() == lease.token())
        {
            e.committing = true;
        }
    }

    /// The attempt holding `lease` is done with it. A newer attempt of the
    /// same step (another token) keeps its place.
    pub fn forget(&self, lease: &Lease) {
        let mut map = self.map();
        if map
            .get(&lease.step_run_id())
            .is_some_and(|e| e.lease.token() == lease.token())
        {
            map.remove(&lease.step_run_id());
        }
    }

    /// How many attempts hold a lease.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// Each attempt's step, and whether its outcome is being committed.
    pub fn attempts(&self) -> Vec<Held> {
        self.map()
            .values()
            .map(|e| Held {
                step_run_id: e.lease.step_run_id(),
                step: e.step.clone(),
                committing: e.committing,
            })
            .collect()
    }

    /// The leases to renew now.
    pub fn snapshot(&self) -> Vec<Lease> {
        self.map().values().map(|e| e.lease.clone()).collect()
    }

    /// A write of the attempt holding `lease` renewed it (a checkpoint, from
    /// its transaction's start, which came after `until - TTL`): its clock
    /// moves on to `until`, if it still runs. A clock still running means
    /// the database's lease was valid when the write ran (the clock never
    /// runs past it), so the write did renew it.
    pub fn renewed_by_write(&self, lease: &Lease, until: Instant) {
        if let Some(e) = self.current(&self.map(), lease) {
            e.move_clock_on(until, Some(Instant::now()));
        }
    }

    /// A write of the attempt holding `lease` learned that it is gone.
    pub fn lease_lost(&self, lease: &Lease) {
        if let Some(e) = self.current(&self.map(), lease) {
            e.tx.send_modify(|v| v.control = Control::LeaseLost);
        }
    }

    fn current<'m>(&self, map: &'m HashMap<Uuid, Entry>, lease: &Lease) -> Option<&'m Entry> {
        map.get(&lease.step_run_id())
            .filter(|e| e.lease.token() == lease.token())
    }

    /// Applies the answer to a heartbeat that renewed `sent` at `sent_at`:
    /// renewed leases' clocks move to `sent_at + ttl`, cancel requests and
    /// lost leases reach their attempts. An answer about a lease that has
    /// since left the set, or been replaced by a newer attempt, is ignored.
    pub fn apply(
        &self,
        sent: &[Lease],
        report: &HeartbeatReport,
        sent_at: Instant,
        ttl: Duration,
    ) -> Applied {
        let sent: HashMap<Uuid, &Lease> = sent.iter().map(|l| (l.step_run_id(), l)).collect();
        let map = self.map();
        let entry = |id: &Uuid| sent.get(id).and_then(|l| self.current(&map, l));
        let mut applied = Applied::default();
        let extend = |e: &Entry, until: Instant| e.move_clock_on(until, None);
        for e in report.renewed_ids.iter().filter_map(entry) {
            applied.renewed += 1;
            extend(e, sent_at + ttl);
        }
        // a lease held by a write (its own checkpoints, most often) holds as
        // long as its last committed renewal says, counted from the send
        // time: no later than the database's own expiry
        for (id, valid_for) in &report.busy_valid_for {
            if let Some(e) = entry(id) {
                applied.held += 1;
                extend(e, sent_at + (*valid_for).min(ttl));
            }
        }
        for e in report.cancel_requested.iter().filter_map(entry) {
            let moved = e.tx.send_if_modified(|v| {
                let run = v.control == Control::Run;
                if run {
                    v.control = Control::Cancel;
                }
                run
            });
            applied.cancelled += usize::from(moved);
        }
        for e in report.lost.iter().filter_map(entry) {
            if e.committing {
                applied.ended.push(e.lease.step_run_id());
                continue;
            }
            // told once: an attempt whose executor takes longer than an
            // interval to stop stays in the set, and each heartbeat since
            // counted (and logged) its lost lease again
            let told = e.tx.send_if_modified(|v| {
                let first = v.control != Control::LeaseLost;
                v.control = Control::LeaseLost;
                first
            });
            if told {
                applied.lost.push(e.lease.step_run_id());
            }
        }
        applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(2);

    fn lease(step: u128, token: u128) -> Lease {
        Lease::for_test(Uuid::from_u128(step), Uuid::from_u128(token), 1)
    }

    fn named(step: u128) -> StepName {
        StepName {
            run_id: Uuid::from_u128(1000 + step),
            name: format!("s{step}"),
        }
    }

    fn report(renewed: &[u128], cancel: &[u128], lost: &[u128]) -> HeartbeatReport {
        let ids = |v: &[u128]| v.iter().map(|&s| Uuid::from_u128(s)).collect::<Vec<_>>();
        HeartbeatReport {
            renewed_ids: ids(renewed),
            cancel_requested: ids(cancel),
            lost: ids(lost),
            busy: vec![],
            busy_valid_for: Default::default(),
            renewed: renewed.len(),
        }
    }

    fn steps(set: &LeaseSet) -> Vec<(Uuid, Uuid)> {
        let mut v: Vec<_> = set
            .snapshot()
            .iter()
            .map(|l| (l.step_run_id(), l.token()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_old_attempts_cleanup_keeps_the_retry_in_the_renewal_set() {
        let set = LeaseSet::default();
        let (old, retry) = (lease(1, 10), lease(1, 11));
        let t0 = Instant::now();
        let _rx_old = set.insert(old.clone(), named(1), t0 + TTL);
        let _rx_retry = set.insert(retry.clone(), named(1), t0 + TTL);
        set.forget(&old);
        assert_eq!(steps(&set), vec![(Uuid::from_u128(1), Uuid::from_u128(11))]);
        set.forget(&retry);
        assert!(set.snapshot().is_empty());
    }

    /// Rows: what the heartbeat sent (step, token), what the database
    /// answered (renewed, cancel, lost step ids), and what the retry of step
    /// 1 (token 11, inserted after the send) and step 2 (token 20) see.
    #[test]
    fn heartbeat_answers_reach_only_the_attempt_they_are_about() {
        struct Row {
            name: &'static str,
            sent: &'static [(u128, u128)],
            answer: (&'static [u128], &'static [u128], &'static [u128]),
            retry: (bool, Control),
            other: (bool, Control),
        }
        let rows = [
            Row {
                name: "a renewal of the old token does not move the retry's clock",
                sent: &[(1, 10), (2, 20)],
                answer: (&[1, 2], &[], &[]),
                retry: (false, Control::Run),
                other: (true, Control::Run),
            },
            Row {
                name: "the old token reported lost does not stop the retry",
                sent: &[(1, 10), (2, 20)],
                answer: (&[2], &[], &[1]),
                retry: (false, Control::Run),
                other: (true, Control::Run),
            },
            Row {
                name: "a cancel about the old token does not cancel the retry",
                sent: &[(1, 10), (2, 20)],
                answer: (&[1, 2], &[1, 2], &[]),
                retry: (false, Control::Run),
                other: (true, Control::Cancel),
            },
            Row {
                name: "the retry's own renewal moves its clock",
                sent: &[(1, 11), (2, 20)],
                answer: (&[1, 2], &[], &[]),
                retry: (true, Control::Run),
                other: (true, Control::Run),
            },
            Row {
                name: "the retry's own loss stops it",
                sent: &[(1, 11), (2, 20)],
                answer: (&[2], &[], &[1]),
                retry: (false, Control::LeaseLost),
                other: (true, Control::Run),
            },
            Row {
                name: "an answer about a step no longer held is ignored, the rest applies",
                sent: &[(3, 30), (2, 20)],
                answer: (&[3], &[3], &[2]),
                retry: (false, Control::Run),
                other: (false, Control::LeaseLost),
            },
        ];
        for row in rows {
            let set = LeaseSet::default();
            let t0 = Instant::now();
            let _old = set.insert(lease(1, 10), named(1), t0 + TTL);
            let rx_other = set.insert(lease(2, 20), named(2), t0 + TTL);
            let sent: Vec<Lease> = row.sent.iter().map(|&(s, t)| lease(s, t)).collect();
            // the old attempt resolves and the retry is leased while the
            // heartbeat is in flight
            set.forget(&lease(1, 10));
            let rx_retry = set.insert(lease(1, 11), named(1), t0 + TTL);
            let sent_at = t0 + Duration::from_millis(300);
            let (renewed, cancel, lost) = row.answer;
            set.apply(&sent, &report(renewed, cancel, lost), sent_at, TTL);
            for (who, rx, (moved, control)) in [
                ("retry", &rx_retry, row.retry),
                ("other", &rx_other, row.other),
            ] {
                let v = *rx.borrow();
                assert_eq!(v.control, control, "{}: {who}'s control", row.name);
                let want = if moved { sent_at + TTL } else { t0 + TTL };
                assert_eq!(v.valid_until, want, "{}: {who}'s lease clock", row.name);
            }
        }
    }

    /// The heartbeat snapshots the set, the attempt's outcome commits, then
    /// the heartbeat's statement runs and no longer finds the step leased:
    /// that is the commit, not a lost lease. A running attempt's loss still is.
    /// A lost lease is reported once, however many heartbeats find it lost
    /// before its attempt leaves the set (observability audit: the metric
    /// counted it once per heartbeat while the executor took its time).
    #[test]
    fn a_lost_lease_is_reported_once() {
        let set = LeaseSet::default();
        let l = lease(1, 10);
        let _rx = set.insert(l.clone(), named(3), Instant::now() + TTL);
        let sent = set.snapshot();
        let first = set.apply(&sent, &report(&[], &[], &[1]), Instant::now(), TTL);
        assert_eq!(first.lost.len(), 1);
        let again = set.apply(&sent, &report(&[], &[], &[1]), Instant::now(), TTL);
        assert!(again.lost.is_empty(), "{again:?}");
    }

    #[test]
    fn a_step_gone_while_its_outcome_commits_is_not_a_lost_lease() {
        let set = LeaseSet::default();
        let t0 = Instant::now();
        let rx_done = set.insert(lease(1, 10), named(1), t0 + TTL);
        let rx_running = set.insert(lease(2, 20), named(2), t0 + TTL);
        let sent = set.snapshot();
        set.committing(&lease(1, 10));
        // a stale token's call changes nothing
        set.committing(&lease(2, 21));
        let applied = set.apply(&sent, &report(&[], &[], &[1, 2]), t0, TTL);
        assert_eq!(applied.lost, vec![Uuid::from_u128(2)]);
        assert_eq!(applied.ended, vec![Uuid::from_u128(1)]);
        assert_eq!(rx_done.borrow().control, Control::Run);
        assert_eq!(rx_running.borrow().control, Control::LeaseLost);
        // a committing lease is still renewed: its commit may wait on the database
        let later = t0 + Duration::from_millis(500);
        let applied = set.apply(&sent, &report(&[1], &[], &[]), later, TTL);
        assert_eq!(applied.renewed, 1);
        assert_eq!(rx_done.borrow().valid_until, later + TTL);
    }

    #[test]
    fn a_write_that_lost_the_old_lease_does_not_stop_the_retry() {
        let set = LeaseSet::default();
        let t0 = Instant::now();
        let _old = set.insert(lease(1, 10), named(1), t0 + TTL);
        let rx = set.insert(lease(1, 11), named(1), t0 + TTL);
        set.lease_lost(&lease(1, 10));
        assert_eq!(rx.borrow().control, Control::Run);
        set.lease_lost(&lease(1, 11));
        assert_eq!(rx.borrow().control, Control::LeaseLost);
    }

    /// A lease whose row a write held (its own checkpoints) moves its clock
    /// to what its last committed renewal holds, counted from the send time,
    /// never beyond a TTL and never backwards; the other leases of the
    /// answer are as before.
    #[test]
    fn a_busy_lease_holds_as_long_as_its_committed_renewal() {
        let set = LeaseSet::default();
        let (held, quiet) = (lease(1, 10), lease(2, 20));
        let t0 = Instant::now();
        let rx_held = set.insert(held.clone(), named(4), t0 + Duration::from_millis(100));
        let rx_quiet = set.insert(quiet.clone(), named(5), t0 + Duration::from_millis(100));
        let mut r = report(&[], &[], &[]);
        r.busy = vec![held.step_run_id()];
        r.busy_valid_for
            .insert(held.step_run_id(), Duration::from_millis(1500));
        let sent = t0 + Duration::from_millis(50);
        let applied = set.apply(&[held.clone(), quiet.clone()], &r, sent, TTL);
        assert_eq!((applied.renewed, applied.held), (0, 1));
        assert_eq!(
            rx_held.borrow().valid_until,
            sent + Duration::from_millis(1500)
        );
        assert_eq!(rx_held.borrow().control, Control::Run);
        // untouched: not in the answer's busy set, not renewed
        assert_eq!(
            rx_quiet.borrow().valid_until,
            t0 + Duration::from_millis(100)
        );
        // a shorter hold later does not move the clock back
        r.busy_valid_for
            .insert(held.step_run_id(), Duration::from_millis(10));
        set.apply(std::slice::from_ref(&held), &r, sent, TTL);
        assert_eq!(
            rx_held.borrow().valid_until,
            sent + Duration::from_millis(1500)
        );
        // nor beyond a TTL, whatever the database said
        r.busy_valid_for
            .insert(held.step_run_id(), Duration::from_secs(3600));
        set.apply(std::slice::from_ref(&held), &r, sent, TTL);
        assert_eq!(rx_held.borrow().valid_until, sent + TTL);
    }

    /// A checkpoint's renewal moves a running clock on, never back, and
    /// never one that ran out, nor another attempt's.
    #[test]
    fn a_checkpoint_write_moves_a_running_clock_on() {
        let set = LeaseSet::default();
        let (l, retry) = (lease(1, 10), lease(1, 11));
        let t0 = Instant::now();
        let rx = set.insert(l.clone(), named(6), t0 + Duration::from_secs(1));
        set.renewed_by_write(&l, t0 + Duration::from_secs(5));
        assert_eq!(rx.borrow().valid_until, t0 + Duration::from_secs(5));
        set.renewed_by_write(&l, t0 + Duration::from_secs(3));
        assert_eq!(rx.borrow().valid_until, t0 + Duration::from_secs(5));
        // a token this set does not hold changes nothing
        set.renewed_by_write(&retry, t0 + Duration::from_secs(9));
        assert_eq!(rx.borrow().valid_until, t0 + Duration::from_secs(5));
        // a clock that ran out stays out: the write may not have renewed
        let out = lease(2, 20);
        let past = Instant::now();
        let rx_out = set.insert(out.clone(), named(7), past);
        set.renewed_by_write(&out, past + Duration::from_secs(9));
        assert_eq!(rx_out.borrow().valid_until, past);
    }
}
