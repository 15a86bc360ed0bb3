//! Durations bound as PostgreSQL intervals (retry delays, prune ages), and PostgreSQL's time
//! settings in their unit.

use std::time::Duration;

use crate::error::OutboxError;
use crate::spec::interval;

/// The longest delay or age the outbox accepts: 1,000 years (of 365.25 days). Far
/// beyond any sensible retry delay, and short enough that `now() ± MAX_INTERVAL` is
/// always a valid `timestamptz` and fits an `interval`. `#[derive(Outbox)]` refuses a
/// longer `lease` or `retry_delay`.
pub const MAX_INTERVAL: Duration = outbox_internals::MAX_INTERVAL;

/// A time limit of PostgreSQL's that must stay on (`idle_in_transaction_session_timeout`)
/// in its unit, milliseconds: at least 1 (0 would turn it off), a shorter one rounded
/// up, and at most the setting's limit, an `int` (24.8 days).
pub(crate) fn setting_millis(value: Duration) -> u128 {
    value
        .as_millis()
        .clamp(1, u128::from(i32::MAX.unsigned_abs()))
}

/// A `statement_timeout` of `limit`, as PostgreSQL takes it, in milliseconds: the one rule
/// of the monitor and the command line. `Duration::ZERO` is no limit, 0, as PostgreSQL
/// has it; any other limit stays a limit, at least 1 ms (a shorter one is rounded up,
/// never down to no limit), and at most the setting's maximum, an `int` (24.8 days).
pub fn statement_timeout_millis(limit: Duration) -> u128 {
    if limit.is_zero() {
        0
    } else {
        setting_millis(limit)
    }
}

/// `value`, truncated to microseconds, or the error that names `what` on `table`.
pub(crate) fn checked(
    table: &'static str,
    what: &'static str,
    value: Duration,
) -> Result<Duration, OutboxError> {
    if value > MAX_INTERVAL {
        return Err(OutboxError::IntervalOutOfRange {
            table,
            what,
            value,
            max: MAX_INTERVAL,
        });
    }
    Ok(interval(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_timeout_of_zero_is_none_and_any_other_at_least_a_millisecond() {
        assert_eq!(statement_timeout_millis(Duration::ZERO), 0, "no limit");
        assert_eq!(statement_timeout_millis(Duration::from_nanos(1)), 1);
        assert_eq!(statement_timeout_millis(Duration::from_micros(1500)), 1);
        assert_eq!(statement_timeout_millis(Duration::from_secs(30)), 30_000);
        assert_eq!(
            statement_timeout_millis(Duration::from_hours(100 * 24)),
            2_147_483_647,
            "the longest the server takes"
        );
        assert_eq!(
            setting_millis(Duration::ZERO),
            1,
            "a limit that must stay on never turns it off"
        );
    }

    #[test]
    fn a_delay_beyond_the_maximum_is_an_error_that_says_so() {
        assert_eq!(
            checked("t", "retry delay", MAX_INTERVAL).unwrap(),
            MAX_INTERVAL
        );
        let err = checked("t", "retry delay", Duration::MAX).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "retry delay of 18446744073709551615.999999999s on `t` is out of range"
            ),
            "{err}"
        );
    }
}
