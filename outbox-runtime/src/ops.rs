//! Operations on an outbox table beside the publish path: the repair path for `DEAD`
//! rows, explicit pruning of old `SENT` rows, and the operational signals.

use std::time::Duration;

use sqlx::PgExecutor;
use sqlx::postgres::types::PgInterval;

use crate::error::OutboxError;
use crate::interval;
use crate::spec::{Outbox, Statement};

/// A snapshot of one outbox table, for dashboards and alerts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Rows waiting for a claim (due or not yet due).
    pub ready: i64,
    /// Rows claimed by a publisher, live or expired.
    pub in_progress: i64,
    /// Rows whose publication was recorded.
    pub sent: i64,
    /// Rows that exhausted their budget or failed permanently, waiting for repair.
    pub dead: i64,
    /// Claims whose lease expired: a publisher died or stalled holding them.
    pub expired_claims: i64,
    /// How long the oldest eligible event (due `READY`, or expired `INPROGRESS`) has
    /// waited; `None` when nothing is eligible. The lag alert signal.
    pub oldest_eligible_age: Option<Duration>,
    /// Ordering keys held back by a `DEAD` event (a type with `#[outbox(key)]`, unless
    /// it says `dead_releases_key`): their later events wait for an operator to requeue
    /// or discard it.
    pub held_keys: i64,
    /// How long ago the oldest `DEAD` event holding back a key was enqueued; `None` when
    /// no key is held.
    pub oldest_held_age: Option<Duration>,
}

/// Reads [`Stats`] for `T`'s table. Counts the whole table: poll it every few seconds,
/// not per event.
pub async fn stats<'e, T: Outbox>(executor: impl PgExecutor<'e>) -> Result<Stats, OutboxError> {
    let spec = T::SPEC;
    let (ready, in_progress, sent, dead, expired_claims, age, held_keys, held_age): (
        i64,
        i64,
        i64,
        i64,
        i64,
        Option<PgInterval>,
        i64,
        Option<PgInterval>,
    ) = sqlx::query_as(spec.sql.get(Statement::Stats))
        .fetch_one(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(Stats {
        ready,
        in_progress,
        sent,
        dead,
        expired_claims,
        oldest_eligible_age: age.map(interval_to_duration),
        held_keys,
        oldest_held_age: held_age.map(interval_to_duration),
    })
}

/// `timestamptz - timestamptz` has no months; a negative interval (clock skew) is zero.
fn interval_to_duration(i: PgInterval) -> Duration {
    let micros = i64::from(i.days) * 86_400_000_000 + i.microseconds;
    Duration::from_micros(micros.max(0).unsigned_abs())
}

/// Puts the `DEAD` events among `event_ids` back to `READY` with a fresh attempt
/// budget, atomically; rows that are not `DEAD` now are left alone. Returns the ids
/// that were requeued.
pub async fn requeue_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    event_ids: &[impl AsRef<str>],
) -> Result<Vec<crate::EventId>, OutboxError> {
    let spec = T::SPEC;
    let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
    let requeued: Vec<String> = sqlx::query_scalar(spec.sql.get(Statement::RequeueDead))
        .bind(ids)
        .fetch_all(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(requeued.into_iter().map(crate::EventId::from).collect())
}

/// Puts every `DEAD` event of `T`'s table back to `READY` with a fresh attempt budget.
/// Returns how many.
pub async fn requeue_all_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
) -> Result<u64, OutboxError> {
    let spec = T::SPEC;
    let count: i64 = sqlx::query_scalar(spec.sql.get(Statement::RequeueAllDead))
        .fetch_one(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(count.unsigned_abs())
}

/// Deletes the `DEAD` events among `event_ids`: the operator's way to give one up for
/// good. For a type with an ordering key this is what lets the key's later events go
/// on without it (requeueing it publishes it first instead). Rows that are not `DEAD`
/// now are left alone. Returns the ids that were deleted.
pub async fn discard_dead<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    event_ids: &[impl AsRef<str>],
) -> Result<Vec<crate::EventId>, OutboxError> {
    let spec = T::SPEC;
    let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
    let discarded: Vec<String> = sqlx::query_scalar(spec.sql.get(Statement::DiscardDead))
        .bind(ids)
        .fetch_all(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(discarded.into_iter().map(crate::EventId::from).collect())
}

/// Deletes up to `batch` `SENT` rows enqueued more than `older_than` ago, and returns
/// how many. The only statement that deletes anything; call it in a loop until it
/// returns less than `batch` to prune everything due, without one long transaction.
pub async fn prune_sent<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    older_than: Duration,
    batch: u32,
) -> Result<u64, OutboxError> {
    let spec = T::SPEC;
    let done = sqlx::query(spec.sql.get(Statement::PruneSent))
        .bind(interval::checked(spec.table, "prune age", older_than)?)
        .bind(i64::from(batch))
        .execute(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(done.rows_affected())
}
