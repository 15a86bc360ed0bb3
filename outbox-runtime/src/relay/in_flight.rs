//! One claimed row while its batch is out, and what to record for it afterwards.

use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::failure_log::FailureLog;
use crate::sink::{Delivery, SinkError};
use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::key_order::BrokenRuns;
use crate::table::metric;
use crate::table::row::{Outcome, Owned};

/// A claimed row while the sink has its batch: the claim, and its delivery's ownership
/// token, which also says whether the relay still owns the row.
pub(super) struct InFlight<'a, T: Outbox> {
    claim: &'a Claim<T>,
    /// Cancelled once a lease renewal finds that another publisher owns the row, or the
    /// lease ended by this process's clock; the sink sees it through
    /// [`Delivery::is_owned`].
    lost: &'a CancellationToken,
}

impl<'a, T: Outbox> InFlight<'a, T> {
    /// What the sink is handed for `claim`.
    pub(super) fn delivery(claim: &Claim<T>) -> Delivery<'_, T> {
        Delivery {
            event_id: claim.event_id(),
            generation: claim.generation(),
            attempt: claim.attempt(),
            created_at: claim.created_at(),
            key: claim.key(),
            trace: claim.trace().map(std::borrow::Cow::Borrowed),
            event: claim.event(),
            lost: CancellationToken::new(),
        }
    }

    /// Each claim with its delivery (built from it by [`delivery`](Self::delivery)).
    pub(super) fn pair(claims: &'a [Claim<T>], deliveries: &'a [Delivery<'a, T>]) -> Vec<Self> {
        claims
            .iter()
            .zip(deliveries)
            .map(|(claim, delivery)| Self {
                claim,
                lost: &delivery.lost,
            })
            .collect()
    }

    pub(super) fn claim(&self) -> &'a Claim<T> {
        self.claim
    }

    /// The row, as the guarded statements name it.
    pub(super) fn row(&self) -> Owned {
        Owned::of(self.claim)
    }

    /// Whether the relay still owns the row: no renewal was rejected.
    pub(super) fn is_owned(&self) -> bool {
        !self.lost.is_cancelled()
    }

    /// Marks the row's lease ended by this process's clock (its renewals unanswered):
    /// the sink can stop sending it, and the relay records nothing for it.
    pub(super) fn expire(&self) {
        self.lost.cancel();
    }

    /// Marks the row lost to another publisher: the sink can stop sending it, and the
    /// relay records nothing for it.
    pub(super) fn lose(&self, labels: &[metrics::Label]) {
        let table = T::SPEC.table;
        let claim = self.claim;
        self.lost.cancel();
        metrics::counter!(metric::STALE, labels.iter()).increment(1);
        tracing::warn!(table, id = claim.id(), event_id = %claim.event_id(), generation = %claim.generation(),
            "lease renewal rejected: another publisher owns this event now");
    }
}

/// What became of one delivery.
enum Delivered {
    /// The sink published it.
    Sent,
    /// The sink returned an error for it.
    Failed(SinkError),
    /// The sink returned fewer results than deliveries, none for this one.
    Missing,
    /// The batch was abandoned before the sink returned (the shutdown grace ran out, or
    /// every row was lost).
    Abandoned,
    /// Not sent: an earlier event of its key's run in the batch was not published.
    Held,
}

impl Delivered {
    /// One per delivery, in order, and endless: `results` is what the sink returned, or
    /// `None` for an abandoned batch.
    fn each(results: Option<Vec<Result<(), SinkError>>>) -> impl Iterator<Item = Self> {
        let abandoned = results.is_none();
        let returned = results.into_iter().flatten().map(|result| match result {
            Ok(()) => Self::Sent,
            Err(error) => Self::Failed(error),
        });
        returned.chain(std::iter::repeat_with(move || {
            if abandoned {
                Self::Abandoned
            } else {
                Self::Missing
            }
        }))
    }

    /// What to record for a delivery of a claim's `attempt`: a transient failure and a
    /// missing result are retried after `retry`'s delay; an abandoned one, or one whose
    /// destination was unavailable, is handed back; one in doubt, nothing (`Err`, with
    /// the sink's reason): its claim stands until its lease ends.
    fn outcome(self, attempt: u32, retry: &Backoff) -> Result<Outcome, String> {
        Ok(match self {
            Self::Sent => Outcome::Sent,
            Self::Failed(SinkError::Permanent(e)) => Outcome::Dead {
                error: e.to_string(),
            },
            Self::Failed(SinkError::Transient(e)) => Outcome::Retry {
                delay: retry.delay(attempt),
                error: e.to_string(),
            },
            Self::Missing => Outcome::Retry {
                delay: retry.delay(attempt),
                error: "the sink returned no result for this event".to_owned(),
            },
            // Not sent, or the destination was down: not this event's attempt. The
            // outage's reason is written, for the operators' `status`.
            Self::Abandoned | Self::Held => Outcome::Release,
            Self::Failed(error @ SinkError::Unavailable(_)) => Outcome::Unavailable {
                error: error.to_string(),
            },
            Self::Failed(SinkError::InDoubt(e)) => return Err(e.to_string()),
        })
    }
}

/// The outcomes to record for a sent batch, one per row still owned and not in doubt:
/// `results` is what the sink returned for `rows`, in order, or `None` for an abandoned
/// batch. A row of a key's run after one of its key that was not published (see
/// [`key_runs`](super::key_runs)) was not sent: it is handed back, its attempt not
/// counted. Each failure goes to the `failures` log.
pub(super) fn outcomes<T: Outbox>(
    rows: &[InFlight<'_, T>],
    results: Option<Vec<Result<(), SinkError>>>,
    retry: &Backoff,
    failures: &FailureLog,
) -> Vec<(Owned, Outcome)> {
    let table = T::SPEC.table;
    let held = results.as_ref().map(|results| {
        BrokenRuns::held(
            rows.iter()
                .map(|row| row.claim.key())
                .zip(results.iter().map(Result::is_ok)),
        )
    });
    let held = |i: usize| held.as_ref().is_some_and(|held| held.get(i) == Some(&true));
    rows.iter()
        .zip(Delivered::each(results))
        .enumerate()
        .map(|(i, (row, delivered))| (row, if held(i) { Delivered::Held } else { delivered }))
        .filter(|(row, _)| row.is_owned())
        .filter_map(
            |(row, delivered)| match delivered.outcome(row.claim.attempt(), retry) {
                Ok(outcome) => {
                    failures.log(row.claim, &outcome);
                    Some((row.row(), outcome))
                }
                Err(reason) => {
                    let claim = row.claim;
                    tracing::warn!(table, id = claim.id(), event_id = %claim.event_id(), generation = %claim.generation(), %reason,
                        "the event may still reach the destination: left claimed until its lease ends, then published again");
                    None
                }
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn outcomes_of(results: Option<Vec<Result<(), SinkError>>>, rows: usize) -> Vec<Outcome> {
        let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        Delivered::each(results)
            .take(rows)
            .map(|delivered| delivered.outcome(1, &retry).expect("not in doubt"))
            .collect()
    }

    #[test]
    fn each_result_maps_to_its_outcome_and_a_missing_one_is_retried() {
        let results = vec![
            Ok(()),
            Err(SinkError::permanent("rejected")),
            Err(SinkError::transient("unavailable")),
            Err(SinkError::unavailable("connection refused")),
        ];
        let outcomes = outcomes_of(Some(results), 5);
        assert_eq!(outcomes[0], Outcome::Sent);
        assert_eq!(
            outcomes[1],
            Outcome::Dead {
                error: "rejected".to_owned()
            }
        );
        assert!(
            matches!(&outcomes[2], Outcome::Retry { delay, error } if *delay >= Duration::from_millis(500) && error == "unavailable")
        );
        assert_eq!(
            outcomes[3],
            Outcome::Unavailable {
                error: "destination unavailable: connection refused".to_owned()
            },
            "the attempt is not counted, the reason is kept"
        );
        assert!(
            matches!(&outcomes[4], Outcome::Retry { error, .. } if error == "the sink returned no result for this event")
        );
    }

    #[test]
    fn an_abandoned_batch_releases_every_row() {
        assert_eq!(outcomes_of(None, 3), vec![Outcome::Release; 3]);
    }

    #[test]
    fn an_event_in_doubt_has_no_outcome_and_keeps_its_claim() {
        let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let delivered = Delivered::each(Some(vec![Err(SinkError::in_doubt("sent, unanswered"))]))
            .next()
            .expect("one per delivery");
        assert_eq!(
            delivered.outcome(1, &retry),
            Err("sent, unanswered".to_owned())
        );
    }
}
