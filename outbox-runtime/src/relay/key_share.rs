//! How a relay's workers share the keys of a keyed table.
//!
//! A worker goes on with the keys it has: the claim it makes while a batch is out
//! continues that batch's runs ([`key_runs::tails`]). Left at that, the first claim of a
//! few hot keys takes them all, and one worker carries every one of them while the
//! others find nothing to claim: ten keys drained at the pace of one worker's round
//! trips. So each worker goes on with no more than its share of the keys the relay's
//! workers carry, `ceil(keys / workers)`, and hands the others over: once the last event
//! it had of such a key is recorded `SENT`, that event goes to a queue here, another
//! worker is woken, and its claim continues the key from it, finding the key's next
//! event by the key's index ([`Runs::After`]) rather than by walking the backlog.
//! A worker whose sink sets its pace keeps its keys
//! ([`Worker::keeps_keys`](super::worker::Worker::keeps_keys)).
//!
//! [`key_runs::tails`]: super::key_runs::tails
//! [`Runs::After`]: crate::table::claiming::Runs::After

use std::collections::{HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::frontier::Frontier;
use super::key_runs::Finished;
use crate::table::batch::Recorded;
use crate::table::row::Owned;
use outbox_internals::Status;

/// The keys a relay's workers carry, and those handed over, waiting for a worker.
pub(crate) struct KeyShare {
    workers: usize,
    state: Mutex<State>,
}

struct State {
    /// How many keys each worker carries: in flight, or claimed ahead.
    carried: Vec<usize>,
    /// The last event of each key handed over, recorded `SENT`, oldest first.
    handed: VecDeque<Finished>,
}

impl State {
    fn keys(&self) -> usize {
        self.carried.iter().sum::<usize>() + self.handed.len()
    }
}

impl KeyShare {
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            workers: workers.max(1),
            state: Mutex::new(State {
                carried: vec![0; workers.max(1)],
                handed: VecDeque::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counts only: a panic elsewhere leaves them usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many keys a worker goes on with: the keys carried and handed over, spread
    /// over the workers, and at least one.
    pub(crate) fn share(&self) -> usize {
        self.lock().keys().div_ceil(self.workers).max(1)
    }

    /// Takes up to `room` keys handed over, for a worker's claim to continue.
    pub(crate) fn take(&self, room: usize) -> Vec<Finished> {
        if room == 0 {
            return Vec::new();
        }
        let mut state = self.lock();
        let taken = room.min(state.handed.len());
        state.handed.drain(..taken).collect()
    }

    /// Whether keys wait for a worker.
    #[cfg(test)]
    fn waiting(&self) -> bool {
        !self.lock().handed.is_empty()
    }

    /// Hands keys over to the other workers.
    pub(crate) fn hand_over(&self, keys: impl IntoIterator<Item = Finished>) {
        self.lock().handed.extend(keys);
    }

    /// Notes how many keys `worker` carries now, after a transaction that let the keys
    /// `over` go; whether keys wait for a worker.
    pub(crate) fn settle(&self, worker: usize, keys: usize, over: Vec<Finished>) -> bool {
        let mut state = self.lock();
        if let Some(carried) = state.carried.get_mut(worker) {
            *carried = keys;
        }
        state.handed.extend(over);
        !state.handed.is_empty()
    }
}

/// The keys one claim goes on with, up to the worker's share, and those it lets go.
pub(crate) struct KeyPlan<'p> {
    /// The last event of each run in flight it continues, the oldest runs first.
    flying: Vec<Owned>,
    /// The keys whose last event the outcomes recorded with it finish, that it goes on
    /// with.
    own: Vec<&'p Finished>,
    /// Those it lets go: beyond the share, or all of them when nothing is claimed.
    over: Vec<&'p Finished>,
    /// The keys handed over by other workers, that it goes on with.
    handed: Vec<Finished>,
}

impl<'p> KeyPlan<'p> {
    /// The plan of a claim after the runs `flying` (their last events, the oldest
    /// first) and the keys `finished` (not in flight), up to the worker's share of the
    /// relay's `keys` (or all of them: `keep`), taking keys handed over into the room
    /// left. Without `keys` (no claim runs, or the table has no key), every key finished
    /// is let go.
    pub(crate) fn new(
        mut flying: Vec<Owned>,
        finished: impl IntoIterator<Item = &'p Finished>,
        keys: Option<&KeyShare>,
        keep: bool,
    ) -> Self {
        let mut finished: Vec<&Finished> = finished.into_iter().collect();
        let Some(keys) = keys else {
            flying.clear();
            return Self {
                flying,
                own: Vec::new(),
                over: finished,
                handed: Vec::new(),
            };
        };
        let share = keys.share();
        let most = if keep { usize::MAX } else { share };
        flying.truncate(most);
        let own: Vec<&Finished> = finished
            .drain(..(most - flying.len()).min(finished.len()))
            .collect();
        let handed = keys.take(share.saturating_sub(flying.len() + own.len()));
        Self {
            flying,
            own,
            over: finished,
            handed,
        }
    }

    /// The claim failed: the keys handed over to it go back, for another.
    pub(crate) fn give_back(self, keys: &KeyShare) {
        keys.hand_over(self.handed);
    }

    /// The last event of each key the claim goes on from ([`Runs::After`]).
    ///
    /// [`Runs::After`]: crate::table::claiming::Runs::After
    pub(crate) fn tails(&self) -> Vec<Owned> {
        let finished = self.own.iter().copied().chain(&self.handed);
        self.flying
            .iter()
            .copied()
            .chain(finished.map(|finished| finished.row))
            .collect()
    }

    /// After the transaction committed, with the keys of the rows it `claimed` and what it
    /// `recorded`: the keys let go to hand over (their last event recorded `SENT`), and
    /// where the frontier must move back to ([`Frontier::behind`]) for the keys nobody
    /// goes on with whose next event may wait there (not taken, last event `SENT` or
    /// `DEAD`).
    pub(crate) fn let_go(
        self,
        claimed: &HashSet<&str>,
        recorded: &Recorded,
    ) -> (Vec<Finished>, Option<i64>) {
        let free = |finished: &Finished| !claimed.contains(finished.key.as_str());
        let status = |finished: &Finished| recorded.status(finished.row.id);
        let mut behind: Vec<i64> = self
            .own
            .iter()
            .copied()
            .filter(|finished| free(finished))
            .filter(|finished| matches!(status(finished), Some(Status::Sent | Status::Dead)))
            .chain(self.handed.iter().filter(|finished| free(finished)))
            .map(|finished| finished.enqueued)
            .collect();
        let mut over = Vec::new();
        for finished in self.over.into_iter().filter(|finished| free(finished)) {
            match status(finished) {
                Some(Status::Sent) => over.push(finished.clone()),
                Some(Status::Dead) => behind.push(finished.enqueued),
                _ => {}
            }
        }
        (over, Frontier::behind(behind))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::{KeyPlan, KeyShare};
    use crate::relay::key_runs::Finished;
    use crate::table::batch::Recorded;
    use crate::table::row::Owned;
    use outbox_internals::Status;

    fn finished(id: i64) -> Finished {
        Finished {
            row: Owned { id, generation: 1 },
            key: format!("k{id}"),
            enqueued: 0,
        }
    }

    /// The last event of one run in flight: row 9.
    fn run_in_flight() -> Vec<Owned> {
        vec![Owned {
            id: 9,
            generation: 1,
        }]
    }

    fn tail_ids(plan: &KeyPlan<'_>) -> Vec<i64> {
        plan.tails().iter().map(|tail| tail.id).collect()
    }

    #[test]
    fn ten_keys_spread_over_four_workers_three_at_most_each() {
        let share = KeyShare::new(4);
        assert_eq!(share.share(), 1, "no keys yet: a worker goes on with one");
        share.settle(0, 10, Vec::new());
        assert_eq!(share.share(), 3);
        // The first worker lets seven go once their last events are recorded.
        share.settle(0, 3, Vec::new());
        share.hand_over((0..7).map(finished));
        assert_eq!(share.share(), 3, "handed-over keys still count");
        assert_eq!(share.take(3).len(), 3);
        share.settle(1, 3, Vec::new());
        assert_eq!(share.take(3).len(), 3);
        share.settle(2, 3, Vec::new());
        assert_eq!(share.take(3).len(), 1);
        share.settle(3, 1, Vec::new());
        assert!(!share.waiting());
        assert_eq!(share.share(), 3);
    }

    #[test]
    fn a_claim_goes_on_with_its_share_and_hands_over_the_keys_recorded_sent_beyond_it() {
        let (a, b, c, d) = (finished(1), finished(2), finished(3), finished(4));
        let keys = KeyShare::new(2);
        keys.settle(0, 5, Vec::new());
        keys.hand_over([finished(5)]);
        // A share of three: one run in flight, two of the four keys finished go on, the
        // other two are let go, and the key handed over waits for another worker.
        let plan = KeyPlan::new(run_in_flight(), [&a, &b, &c, &d], Some(&keys), false);
        let tails = tail_ids(&plan);
        assert_eq!(tails, [9, 1, 2]);
        assert!(keys.waiting(), "no room for the key handed over");
        // `c` was recorded SENT, `d` DEAD; the claim took `a`'s next event, not `b`'s.
        let recorded = Recorded::Statuses(HashMap::from([
            (1, Status::Sent),
            (2, Status::Sent),
            (3, Status::Sent),
            (4, Status::Dead),
        ]));
        let (over, behind) = plan.let_go(&HashSet::from(["k1"]), &recorded);
        let over: Vec<i64> = over.iter().map(|finished| finished.row.id).collect();
        assert_eq!(over, [3], "handed over: the key let go recorded SENT");
        assert!(
            behind.is_some(),
            "b's and d's next events may wait behind the frontier"
        );
    }

    #[test]
    fn a_worker_the_sink_sets_the_pace_of_keeps_every_key_it_has() {
        let (a, b) = (finished(1), finished(2));
        let keys = KeyShare::new(4);
        keys.settle(0, 4, Vec::new());
        keys.hand_over([finished(3)]);
        let plan = KeyPlan::new(run_in_flight(), [&a, &b], Some(&keys), true);
        let tails = tail_ids(&plan);
        assert_eq!(
            tails,
            [9, 1, 2],
            "beyond its share of two, none handed to it"
        );
        assert!(keys.waiting());
    }

    #[test]
    fn a_failed_claim_gives_the_keys_handed_to_it_back() {
        let keys = KeyShare::new(2);
        keys.hand_over([finished(1)]);
        let plan = KeyPlan::new(Vec::new(), [], Some(&keys), false);
        assert_eq!(plan.tails().len(), 1);
        assert!(!keys.waiting());
        plan.give_back(&keys);
        assert!(keys.waiting());
    }

    #[test]
    fn without_a_claim_every_key_finished_is_let_go() {
        let a = finished(1);
        let plan = KeyPlan::new(run_in_flight(), [&a], None, false);
        assert!(plan.tails().is_empty());
        let recorded = Recorded::Sent(HashSet::from([1]));
        let (over, behind) = plan.let_go(&HashSet::new(), &recorded);
        assert_eq!(over.len(), 1);
        assert_eq!(behind, None);
    }

    #[test]
    fn one_worker_keeps_every_key() {
        let share = KeyShare::new(1);
        share.settle(0, 10, Vec::new());
        assert_eq!(share.share(), 10);
    }
}
