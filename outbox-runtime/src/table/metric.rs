//! Metric names the relay emits through the `metrics` crate, each labelled `table`.
//!
//! (The claim statements count the rows they move to `DEAD` under [`DEAD`] too, whoever
//! runs them.)

/// Counter: rows claimed.
pub const CLAIMED: &str = "outbox_claimed_total";
/// Counter: claims that took over an expired lease.
pub const RECLAIMED: &str = "outbox_reclaimed_total";
/// Counter: rows recorded `SENT`.
pub const SENT: &str = "outbox_sent_total";
/// Counter: rows sent back to `READY` after a transient failure.
pub const RETRIED: &str = "outbox_retried_total";
/// Counter: rows moved to `DEAD` (permanent failure or spent budget).
pub const DEAD: &str = "outbox_dead_total";
/// Counter: outcomes or renewals rejected because a newer generation owns the row.
pub const STALE: &str = "outbox_stale_rejected_total";
/// Counter: claim statements that found nothing due (a worker going idle): the
/// cost of wake-ups and polling.
pub const IDLE_CLAIMS: &str = "outbox_idle_claims_total";
/// Counter: unsent rows handed back, the attempt not counted (at shutdown, or
/// because the destination was unavailable).
pub const RELEASED: &str = "outbox_released_total";
/// Counter: batches handed back because the sink said the destination is
/// unavailable ([`SinkError::Unavailable`](crate::relay::SinkError::Unavailable)).
pub const UNAVAILABLE: &str = "outbox_unavailable_total";
/// Histogram: seconds a batch spent in the sink.
pub const PUBLISH_SECONDS: &str = "outbox_publish_seconds";
/// Histogram: rows per claimed batch.
pub const BATCH_SIZE: &str = "outbox_batch_size";
