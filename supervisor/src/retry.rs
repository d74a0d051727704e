//! Retry policy (CONTRACT §3, Temporal's semantics): exponential backoff with
//! jitter, capped at the maximum interval.

use chrono::Duration;
use serde::{Deserialize, Serialize};

/// A step's normalised retry policy, as `durable.submit_run` stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_interval_ms: u64,
    pub backoff_coefficient: f64,
    pub max_interval_ms: u64,
    #[serde(default)]
    pub non_retryable_codes: Vec<String>,
}

/// Jitter spreads retries of many steps that failed together: the delay is
/// drawn from `[base * (1 - JITTER), min(base * (1 + JITTER), max))`, so it
/// stays spread at the cap too (capping a draw from the whole range put
/// half of the retries of an outage, all at the cap by then, on the same
/// moment).
pub const JITTER: f64 = 0.2;

impl RetryPolicy {
    pub fn is_non_retryable(&self, code: &str) -> bool {
        self.non_retryable_codes.iter().any(|c| c == code)
    }

    /// The un-jittered delay before attempt `attempt + 1`, after `attempt`
    /// attempts failed: `initial * coefficient^(attempt-1)`, capped.
    pub fn base_delay_ms(&self, attempt: u32) -> f64 {
        let exp = attempt.saturating_sub(1).min(1000) as i32;
        let raw = self.initial_interval_ms as f64 * self.backoff_coefficient.max(1.0).powi(exp);
        raw.min(self.max_interval_ms as f64)
    }

    /// The jittered delay; `jitter` is uniform in `[0, 1)`. Never above the
    /// maximum interval, and spread below it ([`JITTER`]).
    pub fn backoff(&self, attempt: u32, jitter: f64) -> Duration {
        let base = self.base_delay_ms(attempt);
        let low = base * (1.0 - JITTER);
        let high = (base * (1.0 + JITTER)).min(self.max_interval_ms as f64);
        let ms = (low + (high - low) * jitter.clamp(0.0, 1.0)).max(0.0);
        Duration::milliseconds(ms.round() as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 10,
            initial_interval_ms: 100,
            backoff_coefficient: 2.0,
            max_interval_ms: 1000,
            non_retryable_codes: vec![],
        }
    }

    #[test]
    fn grows_exponentially_then_caps() {
        let p = p();
        let bases: Vec<f64> = (1..=6).map(|a| p.base_delay_ms(a)).collect();
        assert_eq!(bases, vec![100.0, 200.0, 400.0, 800.0, 1000.0, 1000.0]);
    }

    #[test]
    fn delays_at_the_cap_stay_spread() {
        // attempt 5 and on: the base is the cap (1000 ms)
        let p = p();
        let at_cap: Vec<i64> = [0.0, 0.25, 0.5, 0.75]
            .iter()
            .map(|&j| p.backoff(6, j).num_milliseconds())
            .collect();
        assert_eq!(
            at_cap,
            vec![800, 850, 900, 950],
            "spread over [0.8 cap, cap)"
        );
        assert_eq!(p.backoff(6, 1.0).num_milliseconds(), 1000);
        // below the cap the draw is the whole ±20%, as before
        assert_eq!(p.backoff(2, 0.0).num_milliseconds(), 160);
        assert_eq!(p.backoff(2, 0.5).num_milliseconds(), 200);
        assert_eq!(p.backoff(2, 1.0).num_milliseconds(), 240);
        // straddling the cap (base 800, cap 900): from 640 up to the cap
        let straddle = RetryPolicy {
            max_interval_ms: 900,
            ..p
        };
        assert_eq!(straddle.backoff(4, 0.0).num_milliseconds(), 640);
        assert_eq!(straddle.backoff(4, 0.5).num_milliseconds(), 770);
        assert_eq!(straddle.backoff(4, 1.0).num_milliseconds(), 900);
    }

    #[test]
    fn jitter_stays_within_bounds_and_under_the_cap() {
        let p = p();
        for attempt in 1..8 {
            let base = p.base_delay_ms(attempt);
            for j in [0.0, 0.25, 0.5, 0.75, 0.999] {
                let d = p.backoff(attempt, j).num_milliseconds() as f64;
                assert!(d >= (base * (1.0 - JITTER)).floor(), "{attempt} {j} {d}");
                assert!(
                    d <= (base * (1.0 + JITTER)).ceil().min(1000.0),
                    "{attempt} {j} {d}"
                );
            }
        }
    }
}
