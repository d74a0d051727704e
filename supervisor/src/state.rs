//! The state machines of steps and runs: the only place that decides transitions.
//!
//! Pure functions, no I/O. The database mirrors the same tables
//! (`durable.step_transition_rules`, `durable.run_transition_rules`,
//! `durable.aggregate_run_state`) and refuses anything else whoever writes; the
//! S01 test proves the two agree on every pair.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Duration, Utc};

use crate::retry::RetryPolicy;

/// The state of one step run (a queue row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepState {
    Pending,
    Leased,
    Running,
    RetryableFailed,
    Succeeded,
    TerminalFailed,
    Cancelled,
}

impl StepState {
    pub const ALL: [StepState; 7] = [
        StepState::Pending,
        StepState::Leased,
        StepState::Running,
        StepState::RetryableFailed,
        StepState::Succeeded,
        StepState::TerminalFailed,
        StepState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Leased => "leased",
            StepState::Running => "running",
            StepState::RetryableFailed => "retryable_failed",
            StepState::Succeeded => "succeeded",
            StepState::TerminalFailed => "terminal_failed",
            StepState::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            StepState::Succeeded | StepState::TerminalFailed | StepState::Cancelled
        )
    }

    /// The seed design's step transition table.
    pub fn can_transition_to(self, to: StepState) -> bool {
        use StepState::*;
        matches!(
            (self, to),
            (Pending, Leased)
                | (Pending, Cancelled)
                | (Leased, Running)
                | (Leased, RetryableFailed)
                | (Leased, TerminalFailed)
                | (Leased, Cancelled)
                | (Running, Succeeded)
                | (Running, RetryableFailed)
                | (Running, TerminalFailed)
                | (Running, Cancelled)
                | (RetryableFailed, Leased)
                | (RetryableFailed, Cancelled)
        )
    }
}

/// The aggregate state of a workflow run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RunState {
    Pending,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl RunState {
    pub const ALL: [RunState; 5] = [
        RunState::Pending,
        RunState::Running,
        RunState::Succeeded,
        RunState::Failed,
        RunState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Pending => "pending",
            RunState::Running => "running",
            RunState::Succeeded => "succeeded",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Succeeded | RunState::Failed | RunState::Cancelled
        )
    }

    /// CONTRACT §4: pending → running → succeeded | failed | cancelled; pending → cancelled.
    pub fn can_transition_to(self, to: RunState) -> bool {
        use RunState::*;
        matches!(
            (self, to),
            (Pending, Running)
                | (Pending, Cancelled)
                | (Running, Succeeded)
                | (Running, Failed)
                | (Running, Cancelled)
        )
    }
}

/// An unknown state name read from the database or the command line.
#[derive(Debug, thiserror::Error)]
#[error("unknown state {0:?}")]
pub struct UnknownState(pub String);

impl FromStr for StepState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StepState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl FromStr for RunState {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The run's state given its current state, the states of its materialised
/// steps, and whether step definitions are still waiting for dependencies.
///
/// Hatchet's rule, made strict: a run is terminal only when every step that
/// will ever exist for it is terminal; then `failed` if any step failed, else
/// `cancelled` if any was cancelled, else `succeeded`. A pending run goes
/// `running` once a step has started (running, or an attempt of it ended): a
/// step merely leased has not. A terminal run never changes.
/// (`durable.aggregate_run_state` is the SQL twin.)
pub fn aggregate_run(current: RunState, steps: &[StepState], waiting: bool) -> RunState {
    if current.is_terminal() {
        return current;
    }
    let open = steps.iter().filter(|s| !s.is_terminal()).count();
    let failed = steps
        .iter()
        .filter(|s| **s == StepState::TerminalFailed)
        .count();
    let cancelled = steps.iter().filter(|s| **s == StepState::Cancelled).count();
    // a step merely leased has not started: a pending run goes running at
    // a step's start (as the worker's start write moves it), and a cancel
    // of a run whose step is only leased must not move it to running
    let started = steps
        .iter()
        .filter(|s| {
            !matches!(
                s,
                StepState::Pending | StepState::Leased | StepState::Cancelled
            )
        })
        .count();
    if open > 0 || (waiting && failed == 0 && cancelled == 0) {
        if current == RunState::Pending && started > 0 {
            return RunState::Running;
        }
        return current;
    }
    if failed > 0 {
        RunState::Failed
    } else if cancelled > 0 {
        RunState::Cancelled
    } else if steps.is_empty() {
        current
    } else {
        RunState::Succeeded
    }
}

/// What the owner of a lease knows about an attempt that did not succeed.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: String,
    pub retryable: bool,
    /// The error's own `next_retry_delay`, which overrides the backoff.
    pub next_retry_delay: Option<Duration>,
}

/// The step's retry-relevant facts at the moment of a failure.
#[derive(Debug, Clone)]
pub struct StepFacts<'a> {
    /// The attempts counted against `max_attempts`.
    pub attempt: u32,
    /// Attempts given back uncounted (a drain): only named in the reason.
    pub uncounted: u32,
    pub policy: &'a RetryPolicy,
    pub deadline: Option<DateTime<Utc>>,
    pub cancel_requested: bool,
}

/// Where a failed attempt takes the step.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureDecision {
    pub to: StepState,
    /// When the next attempt may start (only for `retryable_failed`).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Why, for the transition history.
    pub reason: String,
}

impl FailureDecision {
    /// The decision, its reason naming the run's failure when that is what
    /// asked for the cancel that ended the step: a sibling's terminal failure
    /// asks every open step of its run to stop, and an attempt that failed on
    /// its own meanwhile read `CANCEL_REQUESTED (CODE)`, though nobody asked
    /// (time audit). `RUN_FAILED (CODE)`, as a pending sibling's `RUN_FAILED`.
    pub fn by_run_failure(mut self, run_failed: bool, code: &str) -> FailureDecision {
        if run_failed && self.to == StepState::Cancelled {
            self.reason = format!("RUN_FAILED ({code})");
        }
        self
    }
}

/// Decides the transition after a failed attempt (an executor error, a crash, a
/// timeout, or a lease that expired). `jitter` is in `[0, 1)`.
pub fn decide_failure(
    facts: &StepFacts<'_>,
    failure: &Failure,
    now: DateTime<Utc>,
    jitter: f64,
) -> FailureDecision {
    if facts.cancel_requested {
        return FailureDecision {
            to: StepState::Cancelled,
            next_attempt_at: None,
            reason: format!("CANCEL_REQUESTED ({})", failure.code),
        };
    }
    if !failure.retryable || facts.policy.is_non_retryable(&failure.code) {
        // the step's own list, when that is why: the error itself said
        // retryable, and "not retryable" beside it read as a contradiction
        let why = if failure.retryable {
            "in the step's non_retryable_codes"
        } else {
            "not retryable"
        };
        return FailureDecision {
            to: StepState::TerminalFailed,
            next_attempt_at: None,
            reason: format!("{}: {why}", failure.code),
        };
    }
    if facts.attempt >= facts.policy.max_attempts {
        return FailureDecision {
            to: StepState::TerminalFailed,
            next_attempt_at: None,
            // "attempt 2 … (1/1)" read as a miscount (DAG audit)
            reason: format!(
                "{}: attempts exhausted ({}/{}){}",
                failure.code,
                facts.attempt,
                facts.policy.max_attempts,
                match facts.uncounted {
                    0 => String::new(),
                    n => format!(" after {n} given back uncounted"),
                }
            ),
        };
    }
    // an executor's own delay is honoured up to the policy's maximum interval
    // (a huge value must neither overflow the clock nor park a step for ages)
    let max = Duration::milliseconds(facts.policy.max_interval_ms.min(i64::MAX as u64 / 2) as i64);
    let delay = failure
        .next_retry_delay
        .map(|d| d.clamp(Duration::zero(), max))
        .unwrap_or_else(|| facts.policy.backoff(facts.attempt, jitter));
    let next = now.checked_add_signed(delay);
    if let (Some(deadline), next) = (facts.deadline, next) {
        if next.is_none_or(|n| n >= deadline) {
            return FailureDecision {
                to: StepState::TerminalFailed,
                next_attempt_at: None,
                reason: format!(
                    "{}: the next attempt would start after the step deadline",
                    failure.code
                ),
            };
        }
    }
    FailureDecision {
        to: StepState::RetryableFailed,
        next_attempt_at: Some(next.unwrap_or(DateTime::<Utc>::MAX_UTC)),
        reason: format!("{}: retry in {} ms", failure.code, delay.num_milliseconds()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_executors_huge_retry_delay_is_clamped_not_overflowed() {
        let policy = crate::retry::RetryPolicy {
            max_attempts: 5,
            initial_interval_ms: 100,
            backoff_coefficient: 2.0,
            max_interval_ms: 60_000,
            non_retryable_codes: vec![],
        };
        let now = Utc::now();
        for huge in [
            Duration::MAX,
            Duration::milliseconds(i64::MAX),
            Duration::days(1_000_000),
        ] {
            let facts = StepFacts {
                attempt: 1,
                uncounted: 0,
                policy: &policy,
                deadline: None,
                cancel_requested: false,
            };
            let failure = Failure {
                code: "LATER".into(),
                retryable: true,
                next_retry_delay: Some(huge),
            };
            let d = decide_failure(&facts, &failure, now, 0.5);
            assert_eq!(d.to, StepState::RetryableFailed);
            assert_eq!(
                d.next_attempt_at,
                Some(now + Duration::milliseconds(60_000))
            );
            // with a deadline, no overflow either
            let facts = StepFacts {
                deadline: Some(now + Duration::seconds(10)),
                ..facts
            };
            assert_eq!(
                decide_failure(&facts, &failure, now, 0.5).to,
                StepState::TerminalFailed
            );
        }
    }

    #[test]
    fn terminal_states_have_no_exit() {
        for from in StepState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in StepState::ALL {
                assert!(!from.can_transition_to(to), "{from} -> {to}");
            }
        }
        for from in RunState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in RunState::ALL {
                assert!(!from.can_transition_to(to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn step_table_matches_the_seed_design() {
        // (from, allowed successors) exactly as seed-sdd.md lists them
        let seed: &[(StepState, &[StepState])] = &[
            (
                StepState::Pending,
                &[StepState::Leased, StepState::Cancelled],
            ),
            (
                StepState::Leased,
                &[
                    StepState::Running,
                    StepState::RetryableFailed,
                    StepState::TerminalFailed,
                    StepState::Cancelled,
                ],
            ),
            (
                StepState::Running,
                &[
                    StepState::Succeeded,
                    StepState::RetryableFailed,
                    StepState::TerminalFailed,
                    StepState::Cancelled,
                ],
            ),
            (
                StepState::RetryableFailed,
                &[StepState::Leased, StepState::Cancelled],
            ),
            (StepState::Succeeded, &[]),
            (StepState::TerminalFailed, &[]),
            (StepState::Cancelled, &[]),
        ];
        for (from, allowed) in seed {
            for to in StepState::ALL {
                assert_eq!(
                    from.can_transition_to(to),
                    allowed.contains(&to),
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for s in StepState::ALL {
            assert_eq!(s.as_str().parse::<StepState>().ok(), Some(s));
        }
        for s in RunState::ALL {
            assert_eq!(s.as_str().parse::<RunState>().ok(), Some(s));
        }
        assert!("done".parse::<StepState>().is_err());
    }

    #[test]
    fn aggregate_follows_the_contract() {
        use RunState as R;
        use StepState as S;
        assert_eq!(aggregate_run(R::Pending, &[S::Pending], false), R::Pending);
        // leased is not started (it was Running until a cancel of such a run
        // recorded pending -> running, cancellation audit)
        assert_eq!(aggregate_run(R::Pending, &[S::Leased], false), R::Pending);
        assert_eq!(aggregate_run(R::Pending, &[S::Running], false), R::Running);
        assert_eq!(
            aggregate_run(R::Pending, &[S::RetryableFailed], false),
            R::Running
        );
        assert_eq!(
            aggregate_run(R::Running, &[S::Succeeded, S::Running], false),
            R::Running
        );
        assert_eq!(aggregate_run(R::Running, &[S::Succeeded], true), R::Running);
        assert_eq!(
            aggregate_run(R::Running, &[S::Succeeded, S::Succeeded], false),
            R::Succeeded
        );
        assert_eq!(
            aggregate_run(R::Running, &[S::TerminalFailed, S::Cancelled], true),
            R::Failed
        );
        assert_eq!(
            aggregate_run(R::Running, &[S::TerminalFailed, S::Running], false),
            R::Running
        );
        assert_eq!(
            aggregate_run(R::Running, &[S::Succeeded, S::Cancelled], true),
            R::Cancelled
        );
        assert_eq!(
            aggregate_run(R::Pending, &[S::Cancelled], false),
            R::Cancelled
        );
        assert_eq!(
            aggregate_run(R::Succeeded, &[S::Pending], false),
            R::Succeeded
        );
    }

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            initial_interval_ms: 1000,
            backoff_coefficient: 2.0,
            max_interval_ms: 60_000,
            non_retryable_codes: vec!["BAD_INPUT".into()],
        }
    }

    #[test]
    fn failure_decisions() {
        let p = policy();
        let now = Utc::now();
        let facts = |attempt, deadline, cancel| StepFacts {
            attempt,
            uncounted: 0,
            policy: &p,
            deadline,
            cancel_requested: cancel,
        };
        let f = |code: &str, retryable| Failure {
            code: code.into(),
            retryable,
            next_retry_delay: None,
        };
        let d = decide_failure(&facts(1, None, false), &f("X", true), now, 0.5);
        assert_eq!(d.to, StepState::RetryableFailed);
        assert_eq!(d.next_attempt_at, Some(now + Duration::milliseconds(1000)));
        assert_eq!(
            decide_failure(&facts(3, None, false), &f("X", true), now, 0.5).to,
            StepState::TerminalFailed
        );
        assert_eq!(
            decide_failure(&facts(1, None, false), &f("X", false), now, 0.5).to,
            StepState::TerminalFailed
        );
        assert_eq!(
            decide_failure(&facts(1, None, false), &f("BAD_INPUT", true), now, 0.5).to,
            StepState::TerminalFailed
        );
        // why, in the reason: the error's own flag, or the step's list
        assert_eq!(
            decide_failure(&facts(1, None, false), &f("X", false), now, 0.5).reason,
            "X: not retryable"
        );
        assert_eq!(
            decide_failure(&facts(1, None, false), &f("BAD_INPUT", true), now, 0.5).reason,
            "BAD_INPUT: in the step's non_retryable_codes"
        );
        assert_eq!(
            decide_failure(&facts(3, None, false), &f("X", true), now, 0.5).reason,
            "X: attempts exhausted (3/3)"
        );
        // attempts given back by a drain are named, not counted
        let drained = StepFacts {
            uncounted: 1,
            ..facts(3, None, false)
        };
        assert_eq!(
            decide_failure(&drained, &f("X", true), now, 0.5).reason,
            "X: attempts exhausted (3/3) after 1 given back uncounted"
        );
        assert_eq!(
            decide_failure(&facts(1, None, true), &f("X", true), now, 0.5).to,
            StepState::Cancelled
        );
        let soon = Some(now + Duration::milliseconds(500));
        assert_eq!(
            decide_failure(&facts(1, soon, false), &f("X", true), now, 0.5).to,
            StepState::TerminalFailed
        );
        let own = Failure {
            code: "X".into(),
            retryable: true,
            next_retry_delay: Some(Duration::milliseconds(7)),
        };
        assert_eq!(
            decide_failure(&facts(1, None, false), &own, now, 0.9).next_attempt_at,
            Some(now + Duration::milliseconds(7))
        );
    }
}
