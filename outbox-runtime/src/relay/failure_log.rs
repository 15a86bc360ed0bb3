//! The log of the sink's failures that the relay rides out, one line per event: a
//! transient failure (the event goes back to `READY` for a retry) as a warning, a
//! permanent one or a spent attempt budget (the event goes `DEAD`) as an error. A broker
//! that fails every event would write a line per event, so each cause is logged at most
//! once per [`INTERVAL`] per relay; the next line of a cause says how many of its lines
//! were left out since the last one (`suppressed`). Counted in full by the relay's
//! metrics all the same. An unavailable destination is [`Outage`](super::outage)'s.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::row::Outcome;

/// At most one line per cause in this long.
pub(super) const INTERVAL: Duration = Duration::from_secs(10);

/// What a logged failure did to its event: each is rate-limited on its own, so that a
/// flood of retries never hides an event going `DEAD`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// A transient failure: back to `READY`, retried after a delay.
    Retried,
    /// A permanent failure: `DEAD`.
    Refused,
    /// A transient failure on the last attempt of the budget: `DEAD`.
    Exhausted,
}

impl Cause {
    const ALL: usize = 3;

    fn index(self) -> usize {
        match self {
            Self::Retried => 0,
            Self::Refused => 1,
            Self::Exhausted => 2,
        }
    }
}

/// One relay's failure log: shared by its workers, so that the limit holds for the
/// relay, whatever its concurrency.
#[derive(Debug)]
pub(super) struct FailureLog {
    interval: Duration,
    causes: Mutex<[Window; Cause::ALL]>,
}

/// When a cause was last logged, and how many of its lines were left out since.
#[derive(Debug, Clone, Copy, Default)]
struct Window {
    logged: Option<Instant>,
    suppressed: u64,
}

impl Default for FailureLog {
    fn default() -> Self {
        Self::every(INTERVAL)
    }
}

impl FailureLog {
    /// A log of at most one line per cause per `interval`.
    pub(super) fn every(interval: Duration) -> Self {
        Self {
            interval,
            causes: Mutex::new([Window::default(); Cause::ALL]),
        }
    }

    /// Logs what `outcome` says of `claim`'s delivery, if it is a failure and its cause
    /// was not logged within the interval. Nothing to do, and no lock taken, for a
    /// published event or one handed back.
    pub(super) fn log<T: Outbox>(&self, claim: &Claim<T>, outcome: &Outcome) {
        if let Outcome::Sent | Outcome::Release | Outcome::Unavailable { .. } = outcome {
            return;
        }
        let (table, event_id, attempt) = (T::SPEC.table, claim.event_id(), claim.attempt());
        let max_attempts = T::SPEC.max_attempts;
        match outcome {
            Outcome::Sent | Outcome::Release | Outcome::Unavailable { .. } => {}
            // The record statement moves a retry on the budget's last attempt to DEAD.
            Outcome::Retry { error, .. } if i64::from(attempt) >= i64::from(max_attempts) => {
                if let Some(suppressed) = self.admit(Cause::Exhausted, Instant::now()) {
                    tracing::error!(table, %event_id, attempt, max_attempts, reason = %error, suppressed,
                        "publishing an event failed on the last attempt of its budget; it is DEAD now");
                }
            }
            Outcome::Retry { delay, error } => {
                if let Some(suppressed) = self.admit(Cause::Retried, Instant::now()) {
                    tracing::warn!(table, %event_id, attempt, max_attempts, retry_in = ?delay, reason = %error,
                        suppressed, "publishing an event failed; it will be retried");
                }
            }
            Outcome::Dead { error } => {
                if let Some(suppressed) = self.admit(Cause::Refused, Instant::now()) {
                    tracing::error!(table, %event_id, attempt, reason = %error, suppressed,
                        "publishing an event failed for good; it is DEAD now");
                }
            }
        }
    }

    /// Whether a line of `cause` is logged `now`: `Some` with how many were left out
    /// since the last one, or `None` (one more left out) within the interval.
    fn admit(&self, cause: Cause, now: Instant) -> Option<u64> {
        let mut causes = self.causes.lock().unwrap_or_else(PoisonError::into_inner);
        let window = &mut causes[cause.index()];
        match window.logged {
            Some(logged) if now.saturating_duration_since(logged) < self.interval => {
                window.suppressed += 1;
                None
            }
            _ => {
                window.logged = Some(now);
                Some(std::mem::take(&mut window.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_cause_per_interval_and_the_next_counts_those_left_out() {
        let log = FailureLog::every(Duration::from_secs(10));
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert_eq!(log.admit(Cause::Retried, at(0)), Some(0));
        assert_eq!(log.admit(Cause::Retried, at(1)), None);
        assert_eq!(log.admit(Cause::Retried, at(9)), None);
        // Another cause has a window of its own.
        assert_eq!(log.admit(Cause::Refused, at(9)), Some(0));
        assert_eq!(log.admit(Cause::Exhausted, at(9)), Some(0));
        assert_eq!(log.admit(Cause::Refused, at(10)), None);
        assert_eq!(
            log.admit(Cause::Retried, at(10)),
            Some(2),
            "the interval is over: the two left out are counted"
        );
        assert_eq!(log.admit(Cause::Retried, at(11)), None);
        assert_eq!(log.admit(Cause::Retried, at(25)), Some(1));
        assert_eq!(log.admit(Cause::Refused, at(25)), Some(1));
    }
}
