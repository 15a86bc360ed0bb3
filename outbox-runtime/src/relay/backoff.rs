//! Exponential backoff with jitter and a cap.

use std::time::Duration;

use crate::interval::MAX_INTERVAL;

/// Retry delays that double per attempt from `base` up to `cap`, each drawn at random
/// from its upper half ("equal jitter"), so publishers that failed together do not
/// retry together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// Delays from `base` (at least a millisecond: no delay at all would make a relay
    /// spin through an outage), doubling, never above `cap` (at least `base`), nor above
    /// [`MAX_INTERVAL`].
    pub fn new(base: Duration, cap: Duration) -> Self {
        let base = base.clamp(Duration::from_millis(1), MAX_INTERVAL);
        Self {
            base,
            cap: cap.max(base).min(MAX_INTERVAL),
        }
    }

    /// The delay before attempt `attempt + 1`, after `attempt` (1-based) failed.
    pub fn delay(&self, attempt: u32) -> Duration {
        let half = self.ceiling(attempt) / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// The largest delay for `attempt`: `base * 2^(attempt - 1)`, capped.
    fn ceiling(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.base.saturating_mul(1 << doublings).min(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_are_capped() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        for attempt in 1..40 {
            let (d, ceiling) = (b.delay(attempt), b.ceiling(attempt));
            assert!(d >= ceiling / 2 && d <= ceiling, "{attempt}: {d:?}");
        }
        let ceilings: Vec<u64> = (1..=6).map(|a| b.ceiling(a).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 8, 10, 10]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(10));
    }

    #[test]
    fn no_backoff_is_a_millisecond() {
        let b = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(b.ceiling(1), Duration::from_millis(1));
        assert!(b.delay(1) >= Duration::from_micros(500));
    }
}
