//! How long a relay may still claim: a fleet's lease on the relay's target, by this
//! process's clock.
//!
//! The fleet extends it from the moment it *sent* the statement that took or renewed
//! the lease, less a margin, so it always ends before the lease the database recorded
//! (which started later, at the statement's own timestamp). A process paused past it
//! (SIGSTOP, a stalled VM) finds it over when it wakes and claims nothing more before
//! anyone else could have taken the target over; what it had in flight stays fenced by
//! each event's own lease and generation.

use std::sync::Mutex;
use std::sync::PoisonError;

use tokio::time::{Instant, sleep_until};

#[derive(Debug)]
pub(crate) struct Tenure {
    until: Mutex<Instant>,
}

impl Tenure {
    /// A tenure that ends at `until`.
    pub(crate) fn until(until: Instant) -> Self {
        Self {
            until: Mutex::new(until),
        }
    }

    /// Moves the end to `until`, never back.
    pub(crate) fn extend(&self, until: Instant) {
        let mut end = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        *end = (*end).max(until);
    }

    /// Ends it now.
    pub(crate) fn end(&self) {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.until.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_live(&self) -> bool {
        Instant::now() < self.deadline()
    }

    /// Returns once it is over (an extension meanwhile moves the end it waits for).
    pub(crate) async fn ended(&self) {
        while self.is_live() {
            sleep_until(self.deadline()).await;
        }
    }
}
