//! Whether an executor is leased for while its processes cannot be started.
//!
//! A worker whose executor command is gone (a redeploy half done, a volume
//! not mounted, permissions) can't run that executor's steps, and it fails
//! fast: it would lease more than its share and fail every step it took,
//! while a healthy worker waits beside it. So a failed start is "this
//! worker can't" (the attempt is a refusal, `SPAWN_FAILED`, not counted),
//! and the executor's breaker opens: nothing more is leased for it until a
//! backoff has passed (the worker's `refusal_delay_ms`, doubling up to
//! [`MAX_BACKOFF`]); then one process is started as a probe before any
//! step is leased, and only a probe that starts closes the breaker. A
//! started process of the executor (a job's or a warm one) closes it too.
//! Steps are not refused while the command stays broken: they wait for a
//! worker that can run them, or for this one once it can.
//!
//! A pure state machine with the clock as an input; [`ExecutorRuntime`]
//! (`worker/mod.rs`) owns one per executor, and the worker one for its
//! `work_dir` (a directory that cannot be made there: nothing is leased
//! until a probe directory can be).
//!
//! [`ExecutorRuntime`]: super::ExecutorRuntime

use std::time::Duration;

use tokio::time::Instant;

/// The longest pause between two probes of a broken executor.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What the lease loop may do for an executor now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lease {
    /// Lease as usual.
    Yes,
    /// Its processes could not be started lately: lease nothing yet.
    NotYet,
    /// The pause is over: start one process first, lease only if it starts.
    ProbeFirst,
}

#[derive(Debug, Default)]
pub(crate) struct SpawnBreaker {
    /// Failed starts since the last process that started.
    failures: u32,
    /// Set while open: when the next probe may run.
    retry_at: Option<Instant>,
}

impl SpawnBreaker {
    pub fn lease(&self, now: Instant) -> Lease {
        match self.retry_at {
            None => Lease::Yes,
            Some(t) if now < t => Lease::NotYet,
            Some(_) => Lease::ProbeFirst,
        }
    }

    /// A process of the executor could not be started: the breaker opens
    /// (again) for the returned pause. While it is open, a failure of a
    /// start begun before it opened (a burst of attempts that all hit the
    /// same fault) leaves the pause as it is: only a failed probe doubles it
    /// (resource audit: six failures of one burst paused for 30 s at once).
    pub fn failed(&mut self, now: Instant, base: Duration) -> Duration {
        if let Some(t) = self.retry_at.filter(|t| now < *t) {
            return t - now;
        }
        self.failures = self.failures.saturating_add(1);
        let pause = backoff(base, self.failures);
        self.retry_at = Some(now + pause);
        pause
    }

    /// A process of the executor started: lease as usual.
    pub fn started(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }
}

/// `base` doubled for each failure after the first, at most [`MAX_BACKOFF`]
/// (and never less than `base`, however large).
fn backoff(base: Duration, failures: u32) -> Duration {
    let doubled = base.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    doubled.min(MAX_BACKOFF.max(base))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_cap() {
        let s = Duration::from_secs;
        let table = [
            (s(1), 1, s(1)),
            (s(1), 2, s(2)),
            (s(1), 3, s(4)),
            (s(1), 5, s(16)),
            (s(1), 6, s(30)),
            (s(1), 1000, s(30)),
            (Duration::from_millis(50), 1, Duration::from_millis(50)),
            (Duration::from_millis(50), 4, Duration::from_millis(400)),
            // a base over the cap is kept as it is
            (s(60), 1, s(60)),
            (s(60), 9, s(60)),
        ];
        for (base, failures, want) in table {
            assert_eq!(backoff(base, failures), want, "{base:?} × {failures}");
        }
    }

    #[test]
    fn a_failed_start_pauses_leasing_then_a_probe_decides() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut b = SpawnBreaker::default();
        assert_eq!(b.lease(t0), Lease::Yes);

        // (event, at, expected lease answer right after)
        assert_eq!(b.failed(t0, ms(100)), ms(100));
        assert_eq!(b.lease(t0), Lease::NotYet);
        assert_eq!(b.lease(t0 + ms(99)), Lease::NotYet);
        assert_eq!(b.lease(t0 + ms(100)), Lease::ProbeFirst);

        // the probe fails: a longer pause
        assert_eq!(b.failed(t0 + ms(100), ms(100)), ms(200));
        assert_eq!(b.lease(t0 + ms(299)), Lease::NotYet);
        assert_eq!(b.lease(t0 + ms(300)), Lease::ProbeFirst);

        // failures of starts begun before it opened do not lengthen it
        assert_eq!(b.failed(t0 + ms(150), ms(100)), ms(150));
        assert_eq!(b.failed(t0 + ms(150), ms(100)), ms(150));
        assert_eq!(b.lease(t0 + ms(300)), Lease::ProbeFirst);

        // the probe starts: lease as usual, and the next failure starts over
        b.started();
        assert_eq!(b.lease(t0 + ms(300)), Lease::Yes);
        assert_eq!(b.failed(t0 + ms(400), ms(100)), ms(100));
        assert_eq!(b.lease(t0 + ms(450)), Lease::NotYet);
    }
}
