//! Where a relay's claims start in the `READY` index, and when it claims everywhere.
//!
//! While a transaction holds the xmin horizon back (an idle session in a transaction,
//! a long report, a standby's feedback), vacuum removes nothing, and the claim's
//! indexes keep an entry for every version of every row: a claim from the start of the
//! `READY` index steps over the old entry of every row claimed since, and the expired
//! path over every completed row's. Measured at 1,000 events/s: after ten minutes,
//! 200 ms per claim, with the server's cores busy stepping over them.
//!
//! So the relay remembers its frontier: the `next_attempt_at` before which its claims
//! found every due row they could see (rows are claimed in that order), less
//! [`MARGIN`]. Its claims start there ([`Scope::ReadyFrom`]) and step over the dead
//! entries of the last moments only. What such a claim cannot find is left to a full
//! claim (a sweep, [`Scope::All`]): an expired claim, a row whose enqueuing transaction
//! committed more than [`MARGIN`] after its `INSERT` began, a row a rolled-back claim
//! left locked while a claim passed it. Sweeps are spaced by their own cost: after a
//! sweep whose claim took `d`, the next waits `SWEEP_SPACING × d`, so they never take
//! more than about 1% of a worker's time however much a pin makes them cost, and at
//! most [`MAX_SPACING`]. Without a pin a sweep takes about a millisecond, so expired
//! claims are found within about a tenth of a second of their lease's end; at the end
//! of a ten-minute pin at 1,000 events/s (a sweep costs ~1.8 s by then), within a
//! minute. Only the claim statement counts: waiting for a
//! connection or recording outcomes says nothing of what a sweep costs (a 20 s wait
//! for the pool once spaced the next sweep half an hour later).
//!
//! On a table with an ordering key ([`Frontier::keyed`]), a claim steps over the events
//! held back behind their key's first one, and reports how far it saw every due row (its
//! reach: the statement's time when it found fewer rows than it looked for). Events held
//! so are left behind: those of a key the relay has in flight come in its runs, claimed
//! by key, and so does the next event of a key whose last event a worker records (its
//! claim, or another worker's it hands the key to, goes on from that event). Where no
//! claim took that next event (none was due yet, or it waits behind a retry), the
//! frontier moves *back* to where it can be ([`NextClaim::settle`],
//! [`Frontier::retreat`]): [`MARGIN`] before the last event's enqueue
//! ([`Frontier::behind`]). A claim that began before such a retreat may not have seen
//! what it was for (its snapshot can predate the recording), so it moves the frontier
//! no further than there: the frontier remembers its latest retreats, and a claim older
//! than all of them does not move it. Until its first sweep, a keyed table's
//! claims wait ([`Frontier::next`] returns once it ended, or failed): from the start,
//! each would walk the backlog held behind its keys' first events, one probe per event,
//! beside the sweep that walks it once. (Measured beside one hot key's backlog of
//! 100,000 events: three workers' claims of 2 s each, twice, beside the sweep, slowing
//! it from about 3 s to 5.5 s.)

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::table::claiming::Scope;

/// How long an enqueuing transaction may take from its `INSERT` to its commit and still
/// be found by the claims between sweeps: their frontier trails the rows they claimed
/// by this much. (A later commit is found by the next sweep.)
const MARGIN: Duration = outbox_internals::FRONTIER_MARGIN;

/// A sweep whose claim took `d` is followed by the next one `SWEEP_SPACING × d` later.
const SWEEP_SPACING: u32 = 100;

/// The longest wait between sweeps, whatever they cost: how late an expired claim may
/// be found at worst.
const MAX_SPACING: Duration = Duration::from_mins(1);

/// The shortest wait for the next sweep after one failed.
const AFTER_A_FAILED_SWEEP: Duration = Duration::from_secs(1);

/// How many of the latest retreats the frontier remembers: a claim that began before
/// the oldest of them does not move the frontier on.
const RECENT_RETREATS: usize = 64;

/// No frontier yet: the relay's first claim sweeps, and the claims beside it start at
/// the beginning of the `READY` index.
const NONE: i64 = i64::MIN;

/// A relay's frontier in the `READY` index, shared by its workers, and its sweeps.
#[derive(Debug)]
pub(super) struct Frontier {
    /// Whether claims wait for the first sweep (a keyed table's).
    waits_for_first_sweep: bool,
    state: Mutex<State>,
    /// Told when a sweep ends: the claims waiting for the first one go.
    swept: Notify,
}

#[derive(Debug)]
struct State {
    /// Microseconds since the Unix epoch, or [`NONE`].
    from: i64,
    /// Retreats so far.
    retreats: u64,
    /// The latest retreats: each one's number and where it moved the frontier back to.
    /// A claim that began before one moves the frontier no further than there.
    recent: VecDeque<(u64, i64)>,
    /// A worker is sweeping: the others claim from the frontier.
    running: bool,
    /// When the next sweep is due.
    due: Instant,
    /// A sweep has ended (or failed).
    swept: bool,
    /// The first sweep saw every due row and left nothing for another worker: the
    /// claims that waited for it have nothing to look for.
    first_sweep_saw_all: bool,
}

/// How a worker claims next: its scope, and the sweep it runs, if it is one.
#[derive(Debug)]
pub(super) struct NextClaim<'f> {
    pub(super) scope: Scope,
    sweep: Option<Sweep<'f>>,
    frontier: &'f Frontier,
    /// The frontier's retreats when the claim began.
    retreats: u64,
}

impl NextClaim<'_> {
    /// The claim succeeded, its statements having taken `took` (a sweep schedules the
    /// next one after its own cost), and got as far as `reached` (microseconds since the
    /// Unix epoch): the frontier retreats to `behind` ([`Frontier::retreat`], for the
    /// keys whose last event its transaction recorded and that it did not go on with),
    /// then moves up to [`MARGIN`] before `reached`, and no further than `behind` (the
    /// claim did not look there) or where other workers retreated to since the claim
    /// began (its snapshot may predate their recordings). `more`: the claim may have
    /// left due rows for another worker.
    pub(super) fn settle(
        mut self,
        took: Duration,
        reached: Option<i64>,
        behind: Option<i64>,
        more: bool,
    ) {
        let mut state = self.frontier.lock();
        if let Some(sweep) = &mut self.sweep {
            sweep.took = Some(took);
            state.first_sweep_saw_all |= !state.swept && !more;
        }
        let ceiling = state.retreated_to_since(self.retreats);
        // Its own retreat: the claim did not look there.
        let ceiling = ceiling.map(|ceiling| behind.map_or(ceiling, |behind| ceiling.min(behind)));
        if let Some(behind) = behind {
            state.retreat(behind);
        }
        if let (Some(reached), Some(ceiling)) = (reached, ceiling) {
            state.from = state
                .from
                .max(reached.saturating_sub(margin()).min(ceiling));
        }
    }
}

impl State {
    fn retreat(&mut self, to: i64) {
        let to = to.max(0);
        self.from = self.from.min(to);
        self.retreats += 1;
        if self.recent.len() == RECENT_RETREATS {
            self.recent.pop_front();
        }
        self.recent.push_back((self.retreats, to));
    }

    /// The earliest place the frontier retreated to after retreat number `seen`
    /// (`i64::MAX` if it did not), or `None` if the frontier no longer remembers them
    /// all.
    fn retreated_to_since(&self, seen: u64) -> Option<i64> {
        if self.retreats == seen {
            return Some(i64::MAX);
        }
        let remembered = self.recent.front().is_some_and(|(n, _)| *n <= seen + 1);
        remembered.then(|| {
            self.recent
                .iter()
                .filter(|(n, _)| *n > seen)
                .map(|(_, to)| *to)
                .min()
                .unwrap_or(i64::MAX)
        })
    }
}

/// [`MARGIN`] in microseconds.
fn margin() -> i64 {
    i64::try_from(MARGIN.as_micros()).unwrap_or(i64::MAX)
}

/// A sweep in progress. Dropped without [`NextClaim::settle`] (its claim failed), the
/// next sweep is spaced by the time this one took to fail, and at least
/// [`AFTER_A_FAILED_SWEEP`]: a sweep that fails every time (one the server cancels
/// after its `statement_timeout`, with the horizon held back) must leave the claims
/// from the frontier room to run. That time is the whole attempt's (a wait for the
/// pool, the outcomes recorded before the claim), as the claim's own is not known;
/// it is capped at [`MAX_SPACING`] all the same.
#[derive(Debug)]
struct Sweep<'f> {
    frontier: &'f Frontier,
    started: Instant,
    /// How long its claim took, once it succeeded.
    took: Option<Duration>,
}

impl Drop for Sweep<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut sweeps = self.frontier.lock();
        sweeps.running = false;
        sweeps.swept = true;
        let spacing = match self.took {
            Some(took) => {
                tracing::trace!(?took, "swept");
                took.saturating_mul(SWEEP_SPACING)
            }
            None => (now - self.started)
                .saturating_mul(SWEEP_SPACING)
                .max(AFTER_A_FAILED_SWEEP),
        };
        sweeps.due = now + spacing.min(MAX_SPACING);
        drop(sweeps);
        self.frontier.swept.notify_waiters();
    }
}

impl Frontier {
    pub(super) fn new() -> Self {
        Self::starting(false)
    }

    /// The frontier of a table with an ordering key: its claims wait for the first sweep,
    /// and events of a key recorded move it back ([`Frontier::retreat`]).
    pub(super) fn keyed() -> Self {
        Self::starting(true)
    }

    fn starting(keyed: bool) -> Self {
        Self {
            waits_for_first_sweep: keyed,
            state: Mutex::new(State {
                from: NONE,
                retreats: 0,
                recent: VecDeque::new(),
                running: false,
                due: Instant::now(),
                swept: false,
                first_sweep_saw_all: false,
            }),
            swept: Notify::new(),
        }
    }

    /// Where the next event of a key may wait once the events `finished` (their
    /// enqueue times, microseconds since the Unix epoch) are recorded: [`MARGIN`] before
    /// the earliest. The next event of a key was enqueued after the event before it,
    /// and is never due before its own enqueue; one whose enqueuing transaction
    /// committed later than that is found by a sweep, as any late commit is.
    pub(super) fn behind(finished: impl IntoIterator<Item = i64>) -> Option<i64> {
        finished
            .into_iter()
            .min()
            .map(|enqueued| enqueued.saturating_sub(margin()))
    }

    /// Events recorded outside a claim's transaction may have let the next of their key
    /// go, which may wait at `to` (microseconds since the Unix epoch): the frontier
    /// moves back there, and the claims that began before do not move it on.
    pub(super) fn retreat(&self, to: i64) {
        self.lock().retreat(to);
    }

    /// The next claim: a sweep when one is due and no other worker runs one; otherwise
    /// a claim from the frontier (the start of the index before any claim found one),
    /// once a keyed table's first sweep has ended. `None` when the claim waited for that
    /// sweep, which began after it and saw every due row, leaving nothing for another
    /// worker (one hot key's backlog, taken by its runs): looking again, from
    /// [`MARGIN`] behind that sweep, would step over what it stepped over, once per
    /// waiting worker, beside the run's first batches. (A worker woken for a signal that
    /// came after the sweep began claims all the same:
    /// [`Wakeups::stand_down`](super::wakeups::Wakeups::stand_down).)
    pub(super) async fn next(&self) -> Option<NextClaim<'_>> {
        let mut waited = false;
        loop {
            // Made before the sweeps are looked at: it hears a sweep that ends after.
            let swept = self.swept.notified();
            if let Some(next) = self.try_next() {
                let answered = waited && next.sweep.is_none() && self.lock().first_sweep_saw_all;
                return (!answered).then_some(next);
            }
            waited = true;
            swept.await;
        }
    }

    /// The next claim, or none while a keyed table's first sweep runs.
    fn try_next(&self) -> Option<NextClaim<'_>> {
        let mut state = self.lock();
        let retreats = state.retreats;
        if !state.running && Instant::now() >= state.due {
            state.running = true;
            return Some(NextClaim {
                scope: Scope::All,
                sweep: Some(Sweep {
                    frontier: self,
                    started: Instant::now(),
                    took: None,
                }),
                frontier: self,
                retreats,
            });
        }
        if self.waits_for_first_sweep && !state.swept {
            return None;
        }
        Some(NextClaim {
            scope: Scope::ReadyFrom(state.from.max(0)),
            sweep: None,
            frontier: self,
            retreats,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Frontier {
        /// A claim from the frontier that got as far as `reached`.
        async fn advance(&self, reached: Option<i64>) {
            self.claim()
                .await
                .settle(Duration::ZERO, reached, None, true);
        }

        async fn claim(&self) -> NextClaim<'_> {
            self.next().await.expect("a claim")
        }

        /// The first claim, a sweep of 1 s that got as far as `reached`.
        async fn sweep_once(&self, reached: Option<i64>) {
            let sweep = self.claim().await;
            assert_eq!(sweep.scope, Scope::All);
            sweep.settle(Duration::from_secs(1), reached, None, true);
        }

        fn from(&self) -> i64 {
            self.lock().from
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_claim_sweeps_and_the_next_ones_claim_from_the_frontier() {
        let frontier = Frontier::new();
        let first = frontier.claim().await;
        assert_eq!(first.scope, Scope::All);
        // While it sweeps, another worker without a frontier claims from the start of
        // the index.
        let second = frontier.claim().await;
        assert_eq!(second.scope, Scope::ReadyFrom(0));
        assert!(second.sweep.is_none());
        frontier.advance(Some(10_000_000)).await;
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(9_500_000));
        first.settle(Duration::from_millis(1), None, None, true);
        second.settle(Duration::from_millis(1), None, None, true);
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(9_500_000));
    }

    #[tokio::test(start_paused = true)]
    async fn the_frontier_trails_the_latest_row_claimed_and_a_claim_never_moves_it_back() {
        let frontier = Frontier::new();
        frontier.sweep_once(None).await;
        frontier.advance(Some(5_000_000)).await;
        frontier.advance(Some(2_000_000)).await;
        frontier.advance(None).await;
        assert_eq!(frontier.from(), 4_500_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_keyed_tables_claims_wait_for_its_first_sweep_then_move_on() {
        let frontier = Frontier::keyed();
        let sweep = frontier.claim().await;
        assert_eq!(sweep.scope, Scope::All, "the first claim sweeps");
        assert!(
            tokio::time::timeout(Duration::from_secs(1), frontier.next())
                .await
                .is_err(),
            "the others wait for it"
        );
        sweep.settle(Duration::from_millis(2), Some(10_000_000), None, true);
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(9_500_000));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_waiting_for_a_keyed_tables_first_sweep_goes_once_it_ends() {
        let frontier = std::sync::Arc::new(Frontier::keyed());
        let sweep = frontier.claim().await;
        let waiting = tokio::spawn({
            let frontier = std::sync::Arc::clone(&frontier);
            async move { frontier.claim().await.scope }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "it waits while the sweep runs");
        sweep.settle(Duration::from_millis(2), None, None, true);
        assert_eq!(waiting.await.unwrap(), Scope::ReadyFrom(0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_claims_that_waited_for_a_first_sweep_that_saw_everything_have_nothing_to_do() {
        let frontier = std::sync::Arc::new(Frontier::keyed());
        let sweep = frontier.claim().await;
        let waiting = tokio::spawn({
            let frontier = std::sync::Arc::clone(&frontier);
            async move { frontier.next().await.map(|next| next.scope) }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        sweep.settle(Duration::from_millis(2), Some(10_000_000), None, false);
        assert_eq!(waiting.await.unwrap(), None, "answered by the sweep");
        assert_eq!(
            frontier.claim().await.scope,
            Scope::ReadyFrom(9_500_000),
            "a claim that did not wait for it goes"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_keyed_tables_first_sweep_that_failed_is_waited_for_no_longer() {
        let frontier = Frontier::keyed();
        drop(frontier.claim().await);
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_began_before_a_retreat_does_not_move_the_frontier_past_it() {
        let frontier = Frontier::keyed();
        frontier.sweep_once(Some(10_000_000)).await;
        // A claim begins; meanwhile another worker records a key's last event, whose
        // next may wait at 2 s: the claim's snapshot may not have seen it let go.
        let before = frontier.claim().await;
        assert_eq!(before.scope, Scope::ReadyFrom(9_500_000));
        frontier.retreat(2_000_000);
        before.settle(Duration::ZERO, Some(20_000_000), None, true);
        assert_eq!(frontier.from(), 2_000_000, "the retreat holds");
        // A claim that began after it moves on.
        frontier.advance(Some(20_000_000)).await;
        assert_eq!(frontier.from(), 19_500_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_overtaken_by_retreats_moves_the_frontier_up_to_the_earliest_of_them() {
        let frontier = Frontier::keyed();
        frontier.sweep_once(None).await;
        let overtaken = frontier.claim().await;
        frontier.retreat(8_000_000);
        frontier.retreat(6_000_000);
        overtaken.settle(Duration::ZERO, Some(20_000_000), None, true);
        assert_eq!(frontier.from(), 6_000_000, "on, but not past 6 s");
        // One that began before more retreats than the frontier remembers stays put.
        let forgotten = frontier.claim().await;
        for _ in 0..=RECENT_RETREATS {
            frontier.retreat(30_000_000);
        }
        forgotten.settle(Duration::ZERO, Some(40_000_000), None, true);
        assert_eq!(frontier.from(), 6_000_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_records_a_keys_last_event_leaves_the_frontier_behind_it() {
        let frontier = Frontier::keyed();
        frontier.sweep_once(Some(10_000_000)).await;
        let behind = Frontier::behind([3_000_000, 4_000_000]);
        assert_eq!(
            behind,
            Some(2_500_000),
            "MARGIN before the earliest enqueue"
        );
        let claim = frontier.claim().await;
        assert_eq!(claim.scope, Scope::ReadyFrom(9_500_000));
        // It did not look behind its own recording: the next claim does.
        claim.settle(Duration::ZERO, Some(12_000_000), behind, true);
        assert_eq!(frontier.from(), 2_500_000);
        frontier
            .claim()
            .await
            .settle(Duration::ZERO, Some(12_000_000), None, true);
        assert_eq!(frontier.from(), 11_500_000);
        // One that another worker's retreat overtook does not move on, and keeps that
        // worker's retreat.
        let overtaken = frontier.claim().await;
        frontier.retreat(1_000_000);
        overtaken.settle(Duration::ZERO, Some(13_000_000), Some(5_000_000), true);
        assert_eq!(frontier.from(), 1_000_000);
    }

    #[tokio::test(start_paused = true)]
    async fn sweeps_are_spaced_by_their_own_cost_a_failed_one_as_well() {
        let frontier = Frontier::new();
        let sweep = frontier.claim().await;
        assert_eq!(sweep.scope, Scope::All);
        sweep.settle(Duration::from_millis(10), Some(1_000_000), None, true);
        // Due again after 100 × 10 ms.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        let failed = frontier.claim().await;
        assert_eq!(failed.scope, Scope::All);
        tokio::time::advance(Duration::from_millis(30)).await;
        drop(failed);
        // A failure after 30 ms: due again after 100 × 30 ms.
        tokio::time::advance(Duration::from_millis(2999)).await;
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        let quick = frontier.claim().await;
        assert_eq!(quick.scope, Scope::All);
        drop(quick);
        // One that failed at once: after a second.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(frontier.claim().await.scope, Scope::All);
    }

    #[tokio::test(start_paused = true)]
    async fn however_long_a_sweep_took_the_next_is_due_within_a_minute() {
        let frontier = Frontier::new();
        frontier
            .claim()
            .await
            .settle(Duration::from_secs(20), Some(1_000_000), None, true);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(frontier.claim().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(frontier.claim().await.scope, Scope::All);
    }
}
