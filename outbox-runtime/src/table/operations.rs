//! Operations on an outbox table beside the publish path: the repair path for `DEAD`
//! rows, explicit pruning of old `SENT` rows, and the operational signals.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::postgres::types::PgInterval;
use sqlx::{AssertSqlSafe, PgExecutor, Row as _};

use crate::error::OutboxError;
use crate::id::EventId;
use crate::interval;
use crate::spec::{Outbox, Statement, TableSpec};

/// One table's operator statements, from its event type's spec or from the catalog
/// (which `migrate` writes from the same spec): each operation below is written once,
/// for both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operations<'s> {
    pub(crate) table: &'static str,
    pub(crate) stats: &'s str,
    pub(crate) requeue_dead: &'s str,
    pub(crate) requeue_all_dead: &'s str,
    pub(crate) discard_dead: &'s str,
    pub(crate) prune_sent: &'s str,
}

impl Operations<'static> {
    /// The statements `T`'s derive wrote.
    pub(crate) fn of<T: Outbox>() -> Self {
        Self::of_spec(T::SPEC)
    }

    /// The statements the derive wrote into `spec`: for callers that hold a table's
    /// spec rather than its type (the monitor, given `T::migrations()`).
    pub(crate) fn of_spec(spec: &'static TableSpec) -> Self {
        let (table, sql) = (spec.table, &spec.sql);
        Self {
            table,
            stats: sql.get(Statement::Stats),
            requeue_dead: sql.get(Statement::RequeueDead),
            requeue_all_dead: sql.get(Statement::RequeueAllDead),
            discard_dead: sql.get(Statement::DiscardDead),
            prune_sent: sql.get(Statement::PruneSent),
        }
    }
}

/// A statement's text: the derive's own, or the copy of it the catalog keeps.
fn text(sql: &str) -> AssertSqlSafe<String> {
    AssertSqlSafe(sql.to_owned())
}

impl Operations<'_> {
    fn error(&self) -> impl FnOnce(sqlx::Error) -> OutboxError {
        let table = self.table;
        move |e| OutboxError::from_sqlx(table, e)
    }

    pub(crate) async fn stats<'e>(
        &self,
        executor: impl PgExecutor<'e>,
    ) -> Result<Stats, OutboxError> {
        let row = sqlx::query(text(self.stats))
            .fetch_one(executor)
            .await
            .map_err(self.error())?;
        Stats::decode(&row).map_err(|error| match error {
            // A catalog entry written by an older build: its statement measured the
            // oldest age from when an event became due, and has no such column.
            sqlx::Error::ColumnNotFound(column) => OutboxError::CatalogEntryInvalid {
                table: self.table,
                problem: format!(
                    "its `stats` statement was written by an older build of the outbox crate \
                     (it has no `{column}` column); run outbox::migrate with this version"
                ),
            },
            error => self.error()(error),
        })
    }

    pub(crate) async fn requeue_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        event_ids: &[&str],
    ) -> Result<Vec<EventId>, OutboxError> {
        let requeued: Vec<String> = sqlx::query_scalar(text(self.requeue_dead))
            .bind(event_ids)
            .fetch_all(executor)
            .await
            .map_err(self.error())?;
        Ok(requeued.into_iter().map(EventId::from).collect())
    }

    pub(crate) async fn requeue_all_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
    ) -> Result<u64, OutboxError> {
        let count: i64 = sqlx::query_scalar(text(self.requeue_all_dead))
            .fetch_one(executor)
            .await
            .map_err(self.error())?;
        Ok(count.unsigned_abs())
    }

    pub(crate) async fn discard_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        event_ids: &[&str],
    ) -> Result<Vec<EventId>, OutboxError> {
        let discarded: Vec<String> = sqlx::query_scalar(text(self.discard_dead))
            .bind(event_ids)
            .fetch_all(executor)
            .await
            .map_err(self.error())?;
        Ok(discarded.into_iter().map(EventId::from).collect())
    }

    pub(crate) async fn prune_sent<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        older_than: Duration,
        batch: u32,
    ) -> Result<u64, OutboxError> {
        let done = sqlx::query(text(self.prune_sent))
            .bind(interval::checked(self.table, "prune age", older_than)?)
            .bind(i64::from(batch))
            .execute(executor)
            .await
            .map_err(self.error())?;
        Ok(done.rows_affected())
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

impl Stats {
    /// The `stats` statement's row, by column name (its contract).
    fn decode(row: &PgRow) -> Result<Self, sqlx::Error> {
        let age = |column: &str| -> Result<Option<Duration>, sqlx::Error> {
            Ok(row
                .try_get::<Option<PgInterval>, _>(column)?
                .map(interval_to_duration))
        };
        Ok(Self {
            ready: row.try_get("ready")?,
            due: row.try_get("due")?,
            in_progress: row.try_get("in_progress")?,
            sent: row.try_get("sent")?,
            dead: row.try_get("dead")?,
            expired_claims: row.try_get("expired_claims")?,
            oldest_waiting_age: age("oldest_waiting_age")?,
            oldest_waiting_error: row.try_get("oldest_waiting_error")?,
            held_keys: row.try_get("held_keys")?,
            oldest_held_age: age("oldest_held_age")?,
            sent_last_minute: row.try_get("sent_last_minute")?,
        })
    }
}

/// Reads [`Stats`] for `T`'s table. Counts the whole table: poll it every few seconds,
/// not per event.
pub async fn stats<'e, T: Outbox>(executor: impl PgExecutor<'e>) -> Result<Stats, OutboxError> {
    Operations::of::<T>().stats(executor).await
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
    Operations::of::<T>().requeue_dead(executor, &ids).await
}

/// Puts every `DEAD` event of `T`'s table back to `READY` with a fresh attempt budget.
/// Returns how many.
pub async fn requeue_all_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
) -> Result<u64, OutboxError> {
    Operations::of::<T>().requeue_all_dead(executor).await
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
    Operations::of::<T>().discard_dead(executor, &ids).await
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
    Operations::of::<T>()
        .prune_sent(executor, older_than, batch)
        .await
}
