//! The outcomes of published batches, waiting to be recorded.

use tokio::time::Instant;

use super::key_runs::Finished;
use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::row::{Outcome, Owned};

/// The outcomes of a published batch, recorded together with the next claim (and those
/// of earlier batches that could not be recorded yet).
#[derive(Default)]
pub(crate) struct Pending {
    pub(crate) outcomes: Vec<(Owned, Outcome)>,
    /// The outcomes' batches, in order: `(end, deadline)` for the outcomes from the
    /// previous batch's `end` up to this one's, whose earliest lease ends at `deadline`
    /// (recording them after that cannot succeed).
    pub(crate) batches: Vec<(usize, Instant)>,
    /// On a keyed table, the keys whose last event in the batches is finished here.
    pub(crate) finished: Vec<Finished>,
    /// The batch was smaller than the batch size: nothing else was due when it was
    /// claimed.
    pub(crate) drained: bool,
    /// The sink said the destination is unavailable: the rows go back uncounted, and
    /// the worker waits before it claims again.
    pub(crate) unavailable: bool,
}

impl Pending {
    /// The outcomes of a batch whose earliest lease ends at `deadline`.
    pub(crate) fn of(outcomes: Vec<(Owned, Outcome)>, deadline: Instant) -> Self {
        Self {
            batches: vec![(outcomes.len(), deadline)],
            outcomes,
            ..Self::default()
        }
    }

    /// `self`, the outcomes of the batch just published, with those of the batch before
    /// that could not be recorded: to record together.
    pub(crate) fn after(mut self, earlier: Self) -> Self {
        let offset = self.outcomes.len();
        self.outcomes.extend(earlier.outcomes);
        self.finished.extend(earlier.finished);
        self.batches.extend(
            earlier
                .batches
                .into_iter()
                .map(|(end, deadline)| (offset + end, deadline)),
        );
        self
    }

    /// Hands `claims`, claimed ahead and never given to the sink, back: `READY`, due
    /// now, the attempt not counted.
    pub(crate) fn release<T: Outbox>(&mut self, claims: &[Claim<T>]) {
        if let Some(deadline) = claims.iter().map(Claim::lease_deadline).min() {
            self.outcomes.extend(
                claims
                    .iter()
                    .map(|claim| (Owned::of(claim), Outcome::Release)),
            );
            self.batches.push((self.outcomes.len(), deadline));
        }
    }

    /// Gives up on the outcomes of the batches whose leases end before `by`, and
    /// returns how many; the others are kept, to record.
    pub(crate) fn give_up_before(&mut self, by: Instant) -> usize {
        let mut kept = Vec::with_capacity(self.outcomes.len());
        let mut batches = Vec::with_capacity(self.batches.len());
        let mut outcomes = std::mem::take(&mut self.outcomes).into_iter();
        let mut start = 0;
        for (end, deadline) in std::mem::take(&mut self.batches) {
            let batch = outcomes.by_ref().take(end - start);
            if deadline > by {
                kept.extend(batch);
                batches.push((kept.len(), deadline));
            } else {
                batch.for_each(drop);
            }
            start = end;
        }
        let given_up = start - kept.len();
        self.outcomes = kept;
        self.batches = batches;
        given_up
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn sent(ids: std::ops::Range<i64>) -> Vec<(Owned, Outcome)> {
        ids.map(|id| (Owned { id, generation: 1 }, Outcome::Sent))
            .collect()
    }

    #[test]
    fn giving_up_on_a_batch_whose_leases_ended_keeps_the_outcomes_of_a_live_one() {
        let now = Instant::now();
        let earlier = Pending::of(sent(0..3), now + Duration::from_secs(1));
        let mut pending = Pending::of(sent(3..5), now + Duration::from_secs(30)).after(earlier);
        assert_eq!(pending.give_up_before(now + Duration::from_secs(2)), 3);
        let ids: Vec<i64> = pending.outcomes.iter().map(|(row, _)| row.id).collect();
        assert_eq!(ids, [3, 4], "the batch just published is still recorded");
        assert_eq!(pending.give_up_before(now + Duration::from_secs(31)), 2);
        assert!(pending.outcomes.is_empty() && pending.batches.is_empty());
    }
}
