//! Operations on an outbox table beside the publish path: the repair path for `DEAD`
//! rows, explicit pruning of old `SENT` rows, and the operational signals.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgExecutor;
use sqlx::postgres::types::PgInterval;

use super::statements;
use crate::error::OutboxError;
use crate::id::EventId;
use crate::spec::{Outbox, Statement, Statements, TableSpec};

/// One table's operator statements, from its event type's spec or from the catalog
/// (which `migrate` writes from the same spec): each is run by its function in
/// [`statements`], written once for both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operations<'s> {
    /// The table, which errors name.
    pub(crate) table: &'static str,
    texts: Texts<'s>,
}

/// Where an [`Operations`]' texts come from.
#[derive(Debug, Clone, Copy)]
enum Texts<'s> {
    /// The derive's.
    Spec(&'static Statements),
    /// The catalog's copies, by statement name.
    Kept(&'s BTreeMap<String, String>),
}

impl Operations<'static> {
    /// The statements `T`'s derive wrote.
    pub(crate) fn of<T: Outbox>() -> Self {
        Self::of_spec(T::SPEC)
    }

    /// The statements the derive wrote into `spec`: for callers that hold a table's
    /// spec rather than its type (the monitor, given `T::migrations()`).
    pub(crate) fn of_spec(spec: &'static TableSpec) -> Self {
        Self {
            table: spec.table,
            texts: Texts::Spec(&spec.sql),
        }
    }
}

impl<'s> Operations<'s> {
    /// The copies of `table`'s statements that the catalog keeps, by name.
    pub(crate) fn kept(table: &'static str, statements: &'s BTreeMap<String, String>) -> Self {
        Self {
            table,
            texts: Texts::Kept(statements),
        }
    }

    /// The text of `statement`: the derive's, or the catalog's copy (empty where the
    /// catalog has none; the catalog checks its entries for every statement it keeps).
    pub(crate) fn text(&self, statement: Statement) -> &'s str {
        match self.texts {
            Texts::Spec(sql) => sql.get(statement),
            Texts::Kept(kept) => kept.get(statement.name()).map_or("", String::as_str),
        }
    }
}

/// A snapshot of one outbox table, for dashboards and alerts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Rows waiting for a claim (due or not yet due).
    pub ready: i64,
    /// The `READY` rows that are due: the backlog a relay should be draining.
    pub due: i64,
    /// Rows claimed by a publisher, live or expired.
    pub in_progress: i64,
    /// Rows whose publication was recorded.
    pub sent: i64,
    /// Rows that exhausted their budget or failed permanently, waiting for repair.
    pub dead: i64,
    /// Claims whose lease expired: a publisher died or stalled holding them.
    pub expired_claims: i64,
    /// How long ago the oldest event still to be published (`READY` or `INPROGRESS`, the
    /// one with the lowest id) was enqueued; `None` when none is. The lag to alert on:
    /// it grows through an outage, whatever the relay retries or hands back meanwhile.
    /// `DEAD` events are not waiting for the relay but for an operator: they have their
    /// own figures ([`dead`](Self::dead), [`oldest_held_age`](Self::oldest_held_age)).
    pub oldest_waiting_age: Option<Duration>,
    /// That oldest waiting event's `last_error`: why it is still waiting, once a relay
    /// tried it (`destination unavailable: ..` through an outage, which the relay
    /// writes when it hands events back, or a transient failure's reason). `None` when
    /// no relay recorded a failure for it: not tried yet, or no relay runs.
    pub oldest_waiting_error: Option<String>,
    /// Ordering keys held back by a `DEAD` event (a type with `#[outbox(key)]`, unless
    /// it says `dead_releases_key`): their later events wait for an operator to requeue
    /// or discard it.
    pub held_keys: i64,
    /// How long ago the oldest `DEAD` event holding back a key was enqueued; `None` when
    /// no key is held.
    pub oldest_held_age: Option<Duration>,
    /// Events recorded `SENT` in the last minute: the publish rate. `None` for a
    /// `delete_sent` table, whose sent events leave no row behind.
    pub sent_last_minute: Option<i64>,
}

/// Reads [`Stats`] for `T`'s table. Counts the whole table: poll it every few seconds,
/// not per event.
pub async fn stats<'e, T: Outbox>(executor: impl PgExecutor<'e>) -> Result<Stats, OutboxError> {
    statements::stats(&Operations::of::<T>(), executor).await
}

/// `timestamptz - timestamptz` has no months; a negative interval (clock skew) is zero,
/// an infinite one (PostgreSQL 17's) the longest.
pub(crate) fn interval_to_duration(i: PgInterval) -> Duration {
    let micros = i64::from(i.days)
        .saturating_mul(86_400_000_000)
        .saturating_add(i.microseconds);
    Duration::from_micros(micros.max(0).unsigned_abs())
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
