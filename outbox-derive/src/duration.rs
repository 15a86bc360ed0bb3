//! Durations: `lease` and `retry_delay`, in humantime syntax, whole microseconds
//! (PostgreSQL's `interval` precision), each above its floor.

use std::time::Duration;

use syn::LitStr;

use crate::attr::Errors;

/// The shortest duration a key accepts, and why.
struct Floor {
    min: Duration,
    message: &'static str,
}

/// A claim must outlive its renewal: the relay renews every third of the lease, and each
/// renewal needs a database round trip, scheduling jitter included, before the lease ends.
const LEASE_FLOOR: Floor = Floor {
    min: Duration::from_secs(1),
    message: "`lease` must be at least 1s: the relay renews a claim every third of its lease, \
              and each renewal must complete a database round trip before the lease ends; \
              a lease is also how long a crashed publisher's events wait to be claimed again, \
              so typical values are 10s to 5m",
};

const RETRY_DELAY_FLOOR: Floor = Floor {
    min: Duration::from_nanos(1),
    message: "`retry_delay` must be greater than zero: a failed event would be due again at once, in a hot loop",
};

/// `lease = ".."`, or 30 seconds; the default after reporting an invalid one.
pub(crate) fn lease(lit: Option<&LitStr>, errors: &mut Errors) -> Duration {
    parse_attr(lit, "lease", Duration::from_secs(30), &LEASE_FLOOR, errors)
}

/// `retry_delay = ".."`, or a minute; the default after reporting an invalid one.
pub(crate) fn retry_delay(lit: Option<&LitStr>, errors: &mut Errors) -> Duration {
    parse_attr(
        lit,
        "retry_delay",
        Duration::from_mins(1),
        &RETRY_DELAY_FLOOR,
        errors,
    )
}

fn parse_attr(
    lit: Option<&LitStr>,
    key: &str,
    default: Duration,
    floor: &Floor,
    errors: &mut Errors,
) -> Duration {
    let Some(lit) = lit else { return default };
    parse(&lit.value(), key, floor).unwrap_or_else(|message| {
        errors.push(syn::Error::new(lit.span(), message));
        default
    })
}

/// `text` as the duration `key`, or why it is not one.
fn parse(text: &str, key: &str, floor: &Floor) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d < floor.min => Err(floor.message.to_owned()),
        // The runtime refuses longer delays, and a longer lease would overflow
        // `timestamptz` in every claim.
        Ok(d) if d > outbox_internals::MAX_INTERVAL => Err(format!(
            "`{key}` is longer than 1,000 years, the longest interval the outbox takes"
        )),
        Ok(d) if d.subsec_micros() * 1000 != d.subsec_nanos() => Err(format!(
            "`{key}` must be a whole number of microseconds, PostgreSQL's interval precision"
        )),
        Ok(d) => Ok(d),
        Err(e) => Err(format!(
            "invalid `{key}` duration {text:?}: {e}; write it like \"30s\", \"1m\" or \"1h 30m\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(text: &str) -> Result<Duration, String> {
        parse(text, "lease", &LEASE_FLOOR)
    }

    fn retry_delay(text: &str) -> Result<Duration, String> {
        parse(text, "retry_delay", &RETRY_DELAY_FLOOR)
    }

    #[test]
    fn valid_durations() {
        assert_eq!(lease("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(lease("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(lease("1h 30m"), Ok(Duration::from_mins(90)));
        assert_eq!(lease("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(retry_delay("1m"), Ok(Duration::from_mins(1)));
        assert_eq!(retry_delay("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(retry_delay("1us"), Ok(Duration::from_micros(1)));
    }

    #[test]
    fn the_lease_floor_is_one_second() {
        assert_eq!(lease("999ms"), Err(LEASE_FLOOR.message.to_owned()));
        assert_eq!(lease("0s"), Err(LEASE_FLOOR.message.to_owned()));
        assert!(
            LEASE_FLOOR
                .message
                .starts_with("`lease` must be at least 1s")
        );
    }

    #[test]
    fn a_zero_retry_delay_is_refused() {
        assert_eq!(retry_delay("0s"), Err(RETRY_DELAY_FLOOR.message.to_owned()));
        assert_eq!(
            retry_delay("0ms"),
            Err(RETRY_DELAY_FLOOR.message.to_owned())
        );
    }

    #[test]
    fn sub_microsecond_durations_are_refused() {
        let whole =
            "`retry_delay` must be a whole number of microseconds, PostgreSQL's interval precision";
        assert_eq!(retry_delay("1ns"), Err(whole.to_owned()));
        assert_eq!(retry_delay("1500ns"), Err(whole.to_owned()));
        assert_eq!(lease("1s 1ns"), Err(whole.replace("retry_delay", "lease")));
    }

    #[test]
    fn durations_beyond_the_runtimes_longest_interval_are_refused() {
        let long = "`lease` is longer than 1,000 years, the longest interval the outbox takes";
        assert_eq!(lease("300000years"), Err(long.to_owned()));
        assert_eq!(lease("2000years"), Err(long.to_owned()));
        // 1,000 years of 365.25 days is the longest.
        assert_eq!(lease("8766000h"), Ok(Duration::from_hours(8_766_000)));
        assert_eq!(lease("8766000h 1us"), Err(long.to_owned()));
    }

    #[test]
    fn malformed_durations_say_how_to_write_one() {
        assert_eq!(
            lease("soon"),
            Err("invalid `lease` duration \"soon\": expected number at 0; write it like \"30s\", \"1m\" or \"1h 30m\"".to_owned())
        );
        let no_unit = lease("30").unwrap_err();
        assert!(
            no_unit.starts_with("invalid `lease` duration \"30\": "),
            "{no_unit}"
        );
        assert!(lease("").is_err());
    }
}
