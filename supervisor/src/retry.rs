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
/// drawn from `[base * (1 - JITTER), base * (1 + JITTER))`, then capped.
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
    /// maximum interval.
    pub fn backoff(&self, attempt: u32, jitter: f64) -> Duration {
        let base = self.base_delay_ms(attempt);
        let factor = 1.0 - JITTER + 2.0 * JITTER * jitter.clamp(0.0, 1.0);
        let ms = (base * factor).min(self.max_interval_ms as f64).max(0.0);
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
