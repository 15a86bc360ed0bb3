//! Operations on an outbox table beside the publish path: the repair path for `DEAD`
//! rows, explicit pruning of old `SENT` rows, and the operational signals.

use std::time::Duration;

use sqlx::PgExecutor;

use super::operator::{Operations, Stats};
use super::statements;
use crate::error::OutboxError;
use crate::id::EventId;
use crate::spec::Outbox;

/// Reads [`Stats`] for `T`'s table. Counts the whole table: poll it every few seconds,
/// not per event.
pub async fn stats<'e, T: Outbox>(executor: impl PgExecutor<'e>) -> Result<Stats, OutboxError> {
    statements::stats(&Operations::of::<T>(), executor).await
}

/// Puts the `DEAD` events among `event_ids` back to `READY` with a fresh attempt
/// budget, atomically; rows that are not `DEAD` now are left alone. Returns the ids
/// that were requeued.
pub async fn requeue_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    event_ids: &[impl AsRef<str>],
) -> Result<Vec<EventId>, OutboxError> {
    let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
    statements::requeue_dead(&Operations::of::<T>(), executor, &ids).await
}

/// Puts every `DEAD` event of `T`'s table back to `READY` with a fresh attempt budget.
/// Returns how many.
pub async fn requeue_all_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
) -> Result<u64, OutboxError> {
    statements::requeue_all_dead(&Operations::of::<T>(), executor).await
}

/// Deletes the `DEAD` events among `event_ids`: the operator's way to give one up for
/// good. For a type with an ordering key this is what lets the key's later events go
/// on without it (requeueing it publishes it first instead). Rows that are not `DEAD`
/// now are left alone. Returns the ids that were deleted.
pub async fn discard_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    event_ids: &[impl AsRef<str>],
) -> Result<Vec<EventId>, OutboxError> {
    let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
    statements::discard_dead(&Operations::of::<T>(), executor, &ids).await
}

/// Deletes up to `batch` `SENT` rows published more than `older_than` ago, and returns
/// how many. Their age counts from their `SENT` outcome, not their enqueue: an event
/// held back for days (behind a `DEAD` event, through an outage) and sent just now
/// stays, and enqueuing its id again stays a no-op, for `older_than`. Besides it, only [`discard_dead`] and, for a `delete_sent` type, the
/// outcome that records an event as published delete outbox rows
/// ([`Inbox::prune`](crate::inbox::Inbox::prune) deletes a consumer's receipts). Call
/// it in a loop until it returns less than `batch` to prune everything due, without
/// one long transaction (rows another prune holds at that moment are skipped, not
/// waited for: left to it).
pub async fn prune_sent<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, OutboxError> {
    statements::prune_sent(&Operations::of::<T>(), executor, older_than, batch).await
}
