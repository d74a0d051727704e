//! Fault injection for tests of the worker's own failure paths (a panic in an
//! attempt). Inert unless a test in the same process turns a fault on; the
//! `supervisor` binary never does.

use std::sync::Mutex;

static PANIC_KIND: Mutex<Option<String>> = Mutex::new(None);

/// Makes every attempt of steps of `kind` panic at its start (None: off).
pub fn panic_in_attempts_of_kind(kind: Option<&str>) {
    *PANIC_KIND.lock().unwrap_or_else(|p| p.into_inner()) = kind.map(str::to_owned);
}

/// Panics if a test asked attempts of `kind` to.
pub(crate) fn maybe_panic(kind: &str) {
    let hit = PANIC_KIND
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_deref()
        == Some(kind);
    if hit {
        panic!("fault injection: a panic in an attempt of kind {kind}");
    }
}

static DOOMED_HEARTBEATS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Makes the heartbeat loop of the worker named `worker` panic at its next
/// beat (a vital loop dying).
pub fn kill_heartbeat_of(worker: &str) {
    DOOMED_HEARTBEATS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(worker.to_owned());
}

/// Panics if a test doomed this worker's heartbeat.
pub(crate) fn maybe_kill_heartbeat(worker: &str) {
    let hit = DOOMED_HEARTBEATS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|w| w == worker);
    if hit {
        panic!("fault injection: the heartbeat loop of {worker} dies");
    }
}

static FAILING_RENEWALS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Makes every renewal of the worker named `worker` fail as if its
/// heartbeat connection could not be opened (`on = false`: they succeed
/// again).
pub fn fail_renewals_of(worker: &str, on: bool) {
    let mut w = FAILING_RENEWALS.lock().unwrap_or_else(|p| p.into_inner());
    w.retain(|x| x != worker);
    if on {
        w.push(worker.to_owned());
    }
}

/// Whether a test made this worker's renewals fail.
pub(crate) fn renewals_fail(worker: &str) -> bool {
    FAILING_RENEWALS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|w| w == worker)
}

static SLOW_RELEASE: Mutex<Option<(String, std::time::Duration)>> = Mutex::new(None);

/// Makes the first attempt of steps of `kind` hold its place in the renewal
/// set for `delay` after its outcome resolved (None: off): the
/// window in which a retry of the same step can be leased while the previous
/// attempt's task is still winding down.
pub fn delay_first_attempt_release_of_kind(fault: Option<(&str, std::time::Duration)>) {
    *SLOW_RELEASE.lock().unwrap_or_else(|p| p.into_inner()) = fault.map(|(k, d)| (k.to_owned(), d));
}

/// How long a test asked this attempt to hold on to its slot.
pub(crate) fn release_delay(kind: &str, attempt: u32) -> Option<std::time::Duration> {
    match &*SLOW_RELEASE.lock().unwrap_or_else(|p| p.into_inner()) {
        Some((k, d)) if k == kind && attempt == 1 => Some(*d),
        _ => None,
    }
}

static SLOW_LEASE: Mutex<Option<(String, std::time::Duration)>> = Mutex::new(None);
static SLOW_LEASES_ENTERED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Makes every lease of the worker named `worker` wait `delay` after its
/// connection is acquired and the stop flag checked, before the statement is
/// sent (None: off): a lease on its way while a stop signal is noted.
pub fn delay_leases_of(fault: Option<(&str, std::time::Duration)>) {
    *SLOW_LEASE.lock().unwrap_or_else(|p| p.into_inner()) = fault.map(|(w, d)| (w.to_owned(), d));
}

/// How many leases have entered the delay of [`delay_leases_of`] so far.
pub fn delayed_leases() -> u64 {
    SLOW_LEASES_ENTERED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Waits as long as a test asked the leases of `worker` to.
pub(crate) async fn maybe_delay_lease(worker: &str) {
    let delay = SLOW_LEASE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|(w, _)| w == worker)
        .map(|(_, d)| *d);
    if let Some(d) = delay {
        SLOW_LEASES_ENTERED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(d).await;
    }
}

static LATE_LISTEN: Mutex<Option<(String, std::time::Duration)>> = Mutex::new(None);

/// Makes the LISTEN connection of the worker named `worker` start `delay`
/// late (None: off): the window in which a step becomes leasable while its
/// NOTIFY reaches nobody.
pub fn delay_listen_of(fault: Option<(&str, std::time::Duration)>) {
    *LATE_LISTEN.lock().unwrap_or_else(|p| p.into_inner()) = fault.map(|(w, d)| (w.to_owned(), d));
}

/// How long a test asked this worker's LISTEN to wait before it starts.
pub(crate) fn listen_delay(worker: &str) -> Option<std::time::Duration> {
    LATE_LISTEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .filter(|(w, _)| w == worker)
        .map(|(_, d)| *d)
}

static SLOW_STATUS: Mutex<Option<(uuid::Uuid, std::time::Duration)>> = Mutex::new(None);
static SLOW_STATUS_ENTERED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Makes a `status` read of run `run` wait `delay` between reading the run
/// and reading its steps (None: off): a run that changes while it is read.
pub fn delay_status_reads_of(fault: Option<(uuid::Uuid, std::time::Duration)>) {
    *SLOW_STATUS.lock().unwrap_or_else(|p| p.into_inner()) = fault;
}

/// How many `status` reads have entered the delay of
/// [`delay_status_reads_of`] so far.
pub fn delayed_status_reads() -> u64 {
    SLOW_STATUS_ENTERED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Waits as long as a test asked the status reads of `run` to.
pub(crate) async fn maybe_delay_status_read(run: uuid::Uuid) {
    let delay = SLOW_STATUS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .filter(|(r, _)| *r == run)
        .map(|(_, d)| d);
    if let Some(d) = delay {
        SLOW_STATUS_ENTERED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(d).await;
    }
}

static LOST_LEASE_ANSWERS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Makes the next lease call of the worker named `worker` that leases
/// something lose its answer: the steps are leased in the database, and the
/// worker is told the call timed out (a server that stalled past the call's
/// bound and ran it once it went on).
pub fn lose_next_lease_answer_of(worker: &str) {
    LOST_LEASE_ANSWERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(worker.to_owned());
}

/// Whether a test asked this worker's lease answer (one that leased
/// something) to be lost; the fault is spent by it.
pub(crate) fn lease_answer_lost(worker: &str, leased: usize) -> bool {
    if leased == 0 {
        return false;
    }
    let mut w = LOST_LEASE_ANSWERS.lock().unwrap_or_else(|p| p.into_inner());
    match w.iter().position(|x| x == worker) {
        Some(i) => {
            w.remove(i);
            true
        }
        None => false,
    }
}
