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

    /// [`new`](Self::new) for a setting already in its range: a base of at least a
    /// millisecond, a cap from the base to [`MAX_INTERVAL`] (the tests check the named
    /// ones).
    const fn named(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
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

/// The relay's own waits, named for what they wait on: none of them is a setting of the
/// relay (the sink's unavailability is, and this is its default).
impl Backoff {
    /// After the sink said the destination is unavailable: from 100 ms, at most 5 s
    /// ([`Relay::unavailable_backoff`](super::Relay::unavailable_backoff)'s default).
    pub(crate) const UNAVAILABLE: Self =
        Self::named(Duration::from_millis(100), Duration::from_secs(5));

    /// After a worker's batch transaction (a claim, recording outcomes) failed
    /// transiently: from 50 ms, at most 5 s.
    pub(crate) const BATCH_TRANSACTION: Self =
        Self::named(Duration::from_millis(50), Duration::from_secs(5));

    /// Reconnecting the relay's `LISTEN` session: from 100 ms, at most 10 s.
    pub(crate) const LISTEN: Self =
        Self::named(Duration::from_millis(100), Duration::from_secs(10));

    /// Restarting a fleet target's relay after an error that stopped it (a missing
    /// table, a privilege): from 1 s, at most a minute. The lease is kept meanwhile:
    /// another member would fail the same way.
    pub(crate) const FLEET_RESTART: Self =
        Self::named(Duration::from_secs(1), Duration::from_mins(1));

    /// While the database does not answer as the relay starts: from 200 ms, at most 5 s.
    pub(crate) const STARTUP: Self =
        Self::named(Duration::from_millis(200), Duration::from_secs(5));
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
    fn the_named_settings_are_in_range() {
        for named in [
            Backoff::UNAVAILABLE,
            Backoff::BATCH_TRANSACTION,
            Backoff::LISTEN,
            Backoff::STARTUP,
        ] {
            assert_eq!(named, Backoff::new(named.base, named.cap));
        }
    }

    #[test]
    fn no_backoff_is_a_millisecond() {
        let b = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(b.ceiling(1), Duration::from_millis(1));
        assert!(b.delay(1) >= Duration::from_micros(500));
    }
}
