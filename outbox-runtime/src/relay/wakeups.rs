//! Waking idle workers: as many claims as there is new work for.
//!
//! A notification says that a transaction committed something to publish. Waking a
//! worker for each one made about 1.45 claim statements per published batch at a
//! trickle of 500 events/s: the extra claims found nothing, because the claim of a
//! worker woken a moment earlier had already taken the event (its snapshot was taken
//! after the event's commit, and the notification arrives after the commit).
//!
//! So each signal (a notification, or a full batch saying there may be more) is
//! numbered, each claim remembers the last signal before it started, and a signal is
//! *answered* by a claim that started after it and came back with less than a full
//! batch: that claim saw everything the signal was about, and took what it could. A
//! signal that arrives while no claim is running wakes a worker at once; one that
//! arrives while claims run waits for them: answered, it wakes nobody; still
//! unanswered when the last of them ends (they started before it), it wakes a worker
//! then, or after [`DEFER_LIMIT`] at most, whichever comes first. A worker woken for a
//! signal that was answered meanwhile goes back to waiting.
//!
//! No notification says that a retry became due: the relay that recorded it knows
//! when, and wakes one worker then ([`Wakeups::retry_at`]), so a retry waits for its
//! delay, not for the next poll.

use std::convert::Infallible;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep};

/// The longest a signal waits for the claims that were running when it arrived.
/// Claims take about a millisecond; a longer one (a sweep under a pinned horizon)
/// does not hold a new event back for more than this.
const DEFER_LIMIT: Duration = Duration::from_millis(5);

/// The wake-ups of one relay's workers.
#[derive(Debug, Default)]
pub(super) struct Wakeups {
    state: Mutex<State>,
    /// Wakes one idle worker.
    workers: Notify,
    /// Tells [`Wakeups::watch_deferred`] that a signal is waiting.
    deferred: Notify,
    /// Tells idle workers that a retry became due sooner.
    retries: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Signals so far: the last one's number.
    signals: u64,
    /// Claims running.
    claims: usize,
    /// The last signal no claim has answered yet.
    unanswered: Option<u64>,
    /// A signal arrived while claims were running and has not woken a worker yet.
    deferred: bool,
    /// A worker was woken and has not started its claim yet: that claim answers every
    /// signal until then, so they need not wake another.
    waking: bool,
    /// When the earliest retry this relay recorded becomes due, until a worker wakes
    /// for it.
    retry_due: Option<Instant>,
}

/// A claim that is running: [`Claiming::answered`] when it came back, dropped when it
/// failed.
#[must_use = "a claim that is not ended keeps deferring signals"]
pub(super) struct Claiming<'w> {
    wakeups: &'w Wakeups,
    /// The last signal before the claim started.
    after: u64,
    ended: bool,
}

impl Wakeups {
    /// A notification arrived: something may have been committed since any running
    /// claim started.
    pub(super) fn notified(&self) {
        let mut state = self.lock();
        state.signals += 1;
        state.unanswered = Some(state.signals);
        if state.claims == 0 {
            self.wake(state);
        } else if !std::mem::replace(&mut state.deferred, true) {
            drop(state);
            self.deferred.notify_one();
        }
    }

    /// A worker claimed a full batch: there may be more, for another worker now.
    pub(super) fn more(&self) {
        let mut state = self.lock();
        state.signals += 1;
        state.unanswered = Some(state.signals);
        state.waking = true;
        drop(state);
        self.workers.notify_one();
    }

    /// A retry was recorded, due at `at` (by this process's clock, no earlier than the
    /// database's): one idle worker wakes then.
    pub(super) fn retry_at(&self, at: Instant) {
        let mut state = self.lock();
        state.retry_due = Some(state.retry_due.map_or(at, |due| due.min(at)));
        drop(state);
        // The idle workers look at the new time.
        self.retries.notify_waiters();
    }

    /// A worker about to claim learned that the claim would find nothing (another one
    /// saw every due row since the worker set out): it goes back to waiting instead, if
    /// no signal is unanswered, and says so. Were one unanswered (it may be what woke the
    /// worker), it must claim: no other worker is woken for it.
    pub(super) fn stand_down(&self) -> bool {
        let mut state = self.lock();
        if state.unanswered.is_some() {
            return false;
        }
        // The next signal wakes a worker, this one or another.
        state.waking = false;
        true
    }

    /// A claim starts.
    pub(super) fn claiming(&self) -> Claiming<'_> {
        let mut state = self.lock();
        state.claims += 1;
        state.waking = false;
        Claiming {
            wakeups: self,
            after: state.signals,
            ended: false,
        }
    }

    /// Waits until a signal wants a worker, a recorded retry is due, or `poll` has
    /// passed.
    pub(super) async fn idle(&self, poll: Duration) {
        let polled = Instant::now() + poll;
        loop {
            // Made before the time is read: it hears any later `retry_at`.
            let sooner = self.retries.notified();
            let due = self.lock().retry_due;
            let wake_at = due.map_or(polled, |due| due.min(polled));
            tokio::select! {
                () = self.workers.notified() => {
                    let mut state = self.lock();
                    if state.unanswered.is_some() {
                        // To claim: `waking` until the claim starts.
                        return;
                    }
                    // Answered since: back to waiting.
                    state.waking = false;
                }
                () = sooner => {}
                () = tokio::time::sleep_until(wake_at) => {
                    if wake_at == polled {
                        return;
                    }
                    // The retry's worker: the first to wake takes it.
                    let mut state = self.lock();
                    if state.retry_due.is_some_and(|due| due <= Instant::now()) {
                        state.retry_due = None;
                        return;
                    }
                }
            }
        }
    }

    /// Passes on each deferred signal that is still waiting after [`DEFER_LIMIT`]. Runs
    /// beside the listener, for as long as it listens.
    pub(super) async fn watch_deferred(&self) -> Infallible {
        loop {
            self.deferred.notified().await;
            sleep(DEFER_LIMIT).await;
            let mut state = self.lock();
            if std::mem::take(&mut state.deferred) {
                self.wake(state);
            }
        }
    }

    fn end(&self, after: u64, answered: bool) {
        let mut state = self.lock();
        state.claims -= 1;
        if answered && state.unanswered.is_some_and(|last| last <= after) {
            state.unanswered = None;
            state.deferred = false;
        }
        if state.claims == 0 && std::mem::take(&mut state.deferred) {
            self.wake(state);
        }
    }

    /// Wakes a worker, unless one was woken and is about to claim.
    fn wake(&self, mut state: std::sync::MutexGuard<'_, State>) {
        if !std::mem::replace(&mut state.waking, true) {
            drop(state);
            self.workers.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Claiming<'_> {
    /// The claim came back; `more` when it may have left due events behind (a full
    /// batch, without runs of a key): a claim that did not answered every signal before
    /// it.
    pub(super) fn answered(mut self, more: bool) {
        self.ended = true;
        self.wakeups.end(self.after, !more);
    }
}

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.wakeups.end(self.after, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a worker waiting now would be woken at once.
    async fn wakes(wakeups: &Wakeups) -> bool {
        tokio::time::timeout(
            Duration::from_millis(20),
            wakeups.idle(Duration::from_mins(1)),
        )
        .await
        .is_ok()
    }

    #[tokio::test]
    async fn a_notification_with_no_claim_running_wakes_a_worker() {
        let wakeups = Wakeups::default();
        wakeups.notified();
        assert!(wakes(&wakeups).await);
        assert!(!wakes(&wakeups).await, "one signal, one wake-up");
    }

    #[tokio::test]
    async fn notifications_before_the_woken_worker_claims_wake_nobody_else() {
        let wakeups = Wakeups::default();
        wakeups.notified();
        assert!(wakes(&wakeups).await);
        wakeups.notified();
        assert!(
            !wakes(&wakeups).await,
            "the woken worker's claim answers it"
        );
        wakeups.claiming().answered(false);
        wakeups.notified();
        assert!(
            wakes(&wakeups).await,
            "after that claim, a notification wakes again"
        );
    }

    #[tokio::test]
    async fn a_claim_that_started_after_a_notification_answers_it() {
        let wakeups = Wakeups::default();
        wakeups.notified();
        wakeups.claiming().answered(false);
        assert!(
            !wakes(&wakeups).await,
            "the permit left behind wakes nobody"
        );
    }

    #[tokio::test]
    async fn a_notification_during_a_claim_waits_for_it_and_wakes_after_it() {
        let wakeups = Wakeups::default();
        let running = wakeups.claiming();
        wakeups.notified();
        assert!(!wakes(&wakeups).await, "deferred while the claim runs");
        running.answered(false);
        assert!(
            wakes(&wakeups).await,
            "the claim started before it: not answered"
        );
    }

    #[tokio::test]
    async fn a_later_claim_answers_a_deferred_notification() {
        let wakeups = Wakeups::default();
        let early = wakeups.claiming();
        wakeups.notified();
        wakeups.claiming().answered(false);
        early.answered(false);
        assert!(!wakes(&wakeups).await);
    }

    #[tokio::test]
    async fn a_full_claim_answers_nothing() {
        let wakeups = Wakeups::default();
        let running = wakeups.claiming();
        wakeups.notified();
        wakeups.claiming().answered(true);
        running.answered(false);
        assert!(wakes(&wakeups).await);
    }

    #[tokio::test]
    async fn a_failed_claim_passes_a_deferred_notification_on() {
        let wakeups = Wakeups::default();
        let running = wakeups.claiming();
        wakeups.notified();
        drop(running);
        assert!(wakes(&wakeups).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deferred_notification_waits_for_a_long_claim_no_longer_than_the_limit() {
        let wakeups = std::sync::Arc::new(Wakeups::default());
        let watcher = tokio::spawn({
            let wakeups = std::sync::Arc::clone(&wakeups);
            async move { match wakeups.watch_deferred().await {} }
        });
        let _sweep = wakeups.claiming();
        wakeups.notified();
        let started = Instant::now();
        wakeups.idle(Duration::from_mins(1)).await;
        assert_eq!(started.elapsed(), DEFER_LIMIT);
        watcher.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_woken_while_a_long_claim_runs_answers_the_signal_with_its_own_claim_after_it()
    {
        let wakeups = std::sync::Arc::new(Wakeups::default());
        let watcher = tokio::spawn({
            let wakeups = std::sync::Arc::clone(&wakeups);
            async move { match wakeups.watch_deferred().await {} }
        });
        // A keyed table's first sweep outlasts the limit: a worker is woken, and waits
        // for the sweep's end before its claim starts.
        let sweep = wakeups.claiming();
        wakeups.notified();
        wakeups.idle(Duration::from_mins(1)).await;
        wakeups.notified();
        sweep.answered(false);
        assert!(
            !wakes(&wakeups).await,
            "the woken worker's claim is still to come: it answers both"
        );
        wakeups.claiming().answered(false);
        wakeups.notified();
        assert!(
            wakes(&wakeups).await,
            "and later notifications wake workers"
        );
        watcher.abort();
    }

    #[tokio::test]
    async fn a_worker_stands_down_only_when_no_signal_waits_for_an_answer() {
        let wakeups = Wakeups::default();
        // A long claim (a first sweep) runs; a notification comes after it began.
        let sweep = wakeups.claiming();
        wakeups.notified();
        sweep.answered(false);
        assert!(wakes(&wakeups).await, "a worker is woken for it");
        assert!(
            !wakeups.stand_down(),
            "and must claim: the sweep began before it"
        );
        wakeups.claiming().answered(false);
        assert!(wakeups.stand_down(), "nothing unanswered: it may go back");
        wakeups.notified();
        assert!(
            wakes(&wakeups).await,
            "the next notification wakes a worker"
        );
    }

    #[tokio::test]
    async fn a_full_batch_brings_in_another_worker_while_it_claims_on() {
        let wakeups = Wakeups::default();
        let _ahead = wakeups.claiming();
        wakeups.more();
        assert!(wakes(&wakeups).await);
    }
}
