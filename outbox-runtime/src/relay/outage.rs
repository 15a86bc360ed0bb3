//! A destination that is unavailable: the relay's view of an outage, logged once when
//! it begins and once when it ends, however many batches it holds back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tokio::time::Instant;

use crate::table::metric;

/// Whether the sink last said its destination is unavailable, shared by a relay's
/// workers so that an outage logs two lines, not one per worker or per batch.
#[derive(Debug)]
pub(super) struct Outage {
    table: &'static str,
    labels: std::sync::Arc<[metrics::Label]>,
    /// A lock-free check for the common case: no outage.
    down: AtomicBool,
    since: Mutex<Option<Down>>,
}

#[derive(Debug)]
struct Down {
    since: Instant,
    batches: u64,
}

impl Outage {
    pub(super) fn new(table: &'static str, labels: std::sync::Arc<[metrics::Label]>) -> Self {
        Self {
            table,
            labels,
            down: AtomicBool::new(false),
            since: Mutex::new(None),
        }
    }

    /// A batch was handed back because the sink said the destination is unavailable.
    pub(super) fn held_back(&self, reason: &str) {
        metrics::counter!(metric::UNAVAILABLE, self.labels.iter()).increment(1);
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(down) = &mut *since {
            down.batches += 1;
            return;
        }
        tracing::warn!(
            table = self.table,
            reason,
            "the destination is unavailable; handing events back without counting the attempt, and backing off until it answers again"
        );
        *since = Some(Down {
            since: Instant::now(),
            batches: 1,
        });
        self.down.store(true, Ordering::Release);
    }

    /// The sink answered for a batch (published it, or failed its events one by one).
    pub(super) fn answered(&self) {
        if !self.down.load(Ordering::Acquire) {
            return;
        }
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(down) = since.take() {
            self.down.store(false, Ordering::Release);
            tracing::info!(
                table = self.table,
                after = ?down.since.elapsed(),
                batches_held_back = down.batches,
                "the destination is available again"
            );
        }
    }
}
