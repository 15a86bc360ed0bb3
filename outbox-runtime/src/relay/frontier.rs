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
//! A table with an ordering key keeps its frontier at the start of the index
//! ([`Frontier::at_the_start`]): there, what the claims between sweeps leave to the
//! sweeps is the expired claims and the setting aside of held events. Until its first
//! sweep has set aside what waits behind its keys' first events, a claim from the start
//! would walk all of it, one probe per event, to find nothing more than the sweep
//! finds: the other workers wait for that sweep ([`Frontier::next`] returns once it
//! ended, or failed). (Measured beside one hot key's
//! backlog of 100,000 events: three workers' claims of 2 s each, twice, beside the
//! sweep, slowing it from about 3 s to 5.5 s.)

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::table::claiming::Scope;

/// How long an enqueuing transaction may take from its `INSERT` to its commit and still
/// be found by the claims between sweeps: their frontier trails the rows they claimed
/// by this much. (A later commit is found by the next sweep.)
const MARGIN: Duration = Duration::from_millis(500);

/// A sweep whose claim took `d` is followed by the next one `SWEEP_SPACING × d` later.
const SWEEP_SPACING: u32 = 100;

/// The longest wait between sweeps, whatever they cost: how late an expired claim may
/// be found at worst.
const MAX_SPACING: Duration = Duration::from_mins(1);

/// The shortest wait for the next sweep after one failed.
const AFTER_A_FAILED_SWEEP: Duration = Duration::from_secs(1);

/// No frontier yet: the relay's first claim sweeps, and the claims beside it start at
/// the beginning of the `READY` index.
const NONE: i64 = i64::MIN;

/// A relay's frontier in the `READY` index, shared by its workers, and its sweeps.
#[derive(Debug)]
pub(super) struct Frontier {
    /// Microseconds since the Unix epoch, or [`NONE`].
    from: AtomicI64,
    /// Whether claims move it forward (not at the start, for good).
    moves: bool,
    /// Whether claims wait for the first sweep (at the start, for good).
    waits_for_first_sweep: bool,
    sweeps: Mutex<Sweeps>,
    /// Told when a sweep ends: the claims waiting for the first one go.
    swept: Notify,
}

#[derive(Debug)]
struct Sweeps {
    /// A worker is sweeping: the others claim from the frontier.
    running: bool,
    /// When the next sweep is due.
    due: Instant,
    /// A sweep has ended (or failed).
    swept: bool,
}

/// How a worker claims next: its scope, and the sweep it runs, if it is one.
#[derive(Debug)]
pub(super) struct NextClaim<'f> {
    pub(super) scope: Scope,
    sweep: Option<Sweep<'f>>,
}

impl NextClaim<'_> {
    /// The claim succeeded, its statements having taken `took`: a sweep schedules the
    /// next one after its own cost.
    pub(super) fn done(mut self, took: Duration) {
        if let Some(sweep) = &mut self.sweep {
            sweep.took = Some(took);
        }
    }
}

/// A sweep in progress. Dropped without [`NextClaim::done`] (its claim failed), the
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
        Self::starting(NONE, true)
    }

    /// The frontier of a table with an ordering key: the start of the `READY` index,
    /// for good. An event held back by its key keeps its place in the index, which the
    /// claims pass, so a frontier that moved on would leave it behind once released.
    /// What the sweeps add for such a table is the rest of the full claim: expired
    /// claims, and setting aside the events held behind a waiting one (`parked`), whose
    /// second walk over the claimed range cost a fifth of the ordered drain at 1,000
    /// keys, measured. Between sweeps, a held event is stepped over (one probe each).
    pub(super) fn at_the_start() -> Self {
        Self::starting(0, false)
    }

    fn starting(from: i64, moves: bool) -> Self {
        Self {
            from: AtomicI64::new(from),
            moves,
            waits_for_first_sweep: !moves,
            sweeps: Mutex::new(Sweeps {
                running: false,
                due: Instant::now(),
                swept: false,
            }),
            swept: Notify::new(),
        }
    }

    /// The next claim: a sweep when one is due and no other worker runs one; otherwise
    /// a claim from the frontier (the start of the index before any claim found one),
    /// once a keyed table's first sweep has ended.
    pub(super) async fn next(&self) -> NextClaim<'_> {
        loop {
            // Made before the sweeps are looked at: it hears a sweep that ends after.
            let swept = self.swept.notified();
            if let Some(next) = self.try_next() {
                return next;
            }
            swept.await;
        }
    }

    /// The next claim, or none while a keyed table's first sweep runs.
    fn try_next(&self) -> Option<NextClaim<'_>> {
        let from = self.from.load(Ordering::Relaxed);
        let mut sweeps = self.lock();
        if !sweeps.running && Instant::now() >= sweeps.due {
            sweeps.running = true;
            return Some(NextClaim {
                scope: Scope::All,
                sweep: Some(Sweep {
                    frontier: self,
                    started: Instant::now(),
                    took: None,
                }),
            });
        }
        if self.waits_for_first_sweep && !sweeps.swept {
            return None;
        }
        Some(NextClaim {
            scope: Scope::ReadyFrom(from.max(0)),
            sweep: None,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sweeps> {
        self.sweeps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A claim got as far as `reached` (the latest `next_attempt_at` it claimed from
    /// `READY`, in microseconds since the Unix epoch): the frontier moves up to
    /// [`MARGIN`] before it, and never back. One [at the start](Self::at_the_start)
    /// stays there.
    pub(super) fn advance(&self, reached: Option<i64>) {
        if let Some(reached) = reached.filter(|_| self.moves) {
            let margin = i64::try_from(MARGIN.as_micros()).unwrap_or(i64::MAX);
            self.from
                .fetch_max(reached.saturating_sub(margin), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_first_claim_sweeps_and_the_next_ones_claim_from_the_frontier() {
        let frontier = Frontier::new();
        let first = frontier.next().await;
        assert_eq!(first.scope, Scope::All);
        // While it sweeps, another worker without a frontier claims from the start of
        // the index.
        let second = frontier.next().await;
        assert_eq!(second.scope, Scope::ReadyFrom(0));
        assert!(second.sweep.is_none());
        frontier.advance(Some(10_000_000));
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(9_500_000));
        first.done(Duration::from_millis(1));
        second.done(Duration::from_millis(1));
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(9_500_000));
    }

    #[test]
    fn the_frontier_trails_the_latest_row_claimed_and_never_moves_back() {
        let frontier = Frontier::new();
        frontier.advance(Some(5_000_000));
        frontier.advance(Some(2_000_000));
        frontier.advance(None);
        assert_eq!(frontier.from.load(Ordering::Relaxed), 4_500_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_keyed_tables_claims_between_sweeps_start_at_the_beginning() {
        let frontier = Frontier::at_the_start();
        let sweep = frontier.next().await;
        assert_eq!(sweep.scope, Scope::All, "the first claim sweeps");
        assert!(
            tokio::time::timeout(Duration::from_secs(1), frontier.next())
                .await
                .is_err(),
            "the others wait for it"
        );
        sweep.done(Duration::from_millis(2));
        frontier.advance(Some(10_000_000));
        assert_eq!(
            frontier.next().await.scope,
            Scope::ReadyFrom(0),
            "then claim from the start, and stay there"
        );
        tokio::time::advance(Duration::from_millis(199)).await;
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(0));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            frontier.next().await.scope,
            Scope::All,
            "and again after 100 × 2 ms"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_waiting_for_a_keyed_tables_first_sweep_goes_once_it_ends() {
        let frontier = std::sync::Arc::new(Frontier::at_the_start());
        let sweep = frontier.next().await;
        let waiting = tokio::spawn({
            let frontier = std::sync::Arc::clone(&frontier);
            async move { frontier.next().await.scope }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "it waits while the sweep runs");
        sweep.done(Duration::from_millis(2));
        assert_eq!(waiting.await.unwrap(), Scope::ReadyFrom(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_keyed_tables_first_sweep_that_failed_is_waited_for_no_longer() {
        let frontier = Frontier::at_the_start();
        drop(frontier.next().await);
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(0));
    }

    #[tokio::test(start_paused = true)]
    async fn sweeps_are_spaced_by_their_own_cost_a_failed_one_as_well() {
        let frontier = Frontier::new();
        frontier.advance(Some(1_000_000));
        let sweep = frontier.next().await;
        assert_eq!(sweep.scope, Scope::All);
        sweep.done(Duration::from_millis(10));
        // Due again after 100 × 10 ms.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        let failed = frontier.next().await;
        assert_eq!(failed.scope, Scope::All);
        tokio::time::advance(Duration::from_millis(30)).await;
        drop(failed);
        // A failure after 30 ms: due again after 100 × 30 ms.
        tokio::time::advance(Duration::from_millis(2999)).await;
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        let quick = frontier.next().await;
        assert_eq!(quick.scope, Scope::All);
        drop(quick);
        // One that failed at once: after a second.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(frontier.next().await.scope, Scope::All);
    }

    #[tokio::test(start_paused = true)]
    async fn however_long_a_sweep_took_the_next_is_due_within_a_minute() {
        let frontier = Frontier::new();
        frontier.advance(Some(1_000_000));
        frontier.next().await.done(Duration::from_secs(20));
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(frontier.next().await.scope, Scope::ReadyFrom(500_000));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(frontier.next().await.scope, Scope::All);
    }
}
