//! Writing events into their outbox table, in the caller's transaction.

use sqlx::{Acquire, PgExecutor, Postgres};

use super::extras::{Extras, Schedule};
use super::statements;
use crate::error::{OnTable as _, OutboxError};
use crate::id::EventId;
use crate::spec::Outbox;

/// What [`enqueue`] did with one event.
///
/// Enqueueing is idempotent on the event id: an event whose id is already in the table
/// is not written again, and the caller's transaction is left intact, so committing it
/// commits the business rows with exactly one event row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Enqueued {
    /// Written; it commits or rolls back with the caller's transaction.
    New(EventId),
    /// An event with this id was already in the table (or earlier in the same
    /// `enqueue_all`): nothing was written. The stored event is kept as it is; the new
    /// payload is not compared with it.
    Duplicate(EventId),
}

impl Enqueued {
    /// The event's id, whether it was written now or before.
    pub fn event_id(&self) -> &EventId {
        match self {
            Self::New(id) | Self::Duplicate(id) => id,
        }
    }

    /// Whether this call wrote the event.
    pub fn is_new(&self) -> bool {
        matches!(self, Self::New(_))
    }

    /// Whether the event was already queued.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Self::Duplicate(_))
    }

    /// The event's id.
    pub fn into_event_id(self) -> EventId {
        match self {
            Self::New(id) | Self::Duplicate(id) => id,
        }
    }
}

/// The id `event` is stored under, checked before anything is written.
fn event_id_of<T: Outbox>(event: &T) -> Result<EventId, OutboxError> {
    let id = event.event_id().unwrap_or_else(EventId::new_v7);
    match id.defect() {
        None => Ok(id),
        Some(reason) => Err(OutboxError::InvalidEventId {
            table: T::SPEC.table,
            event_id: id.shortened(),
            reason,
        }),
    }
}

/// Writes `event` into its outbox table through `executor`: pass the business
/// transaction (`&mut *tx`) so the event commits or rolls back with the business rows.
///
/// An event whose id is already in the table is not written again
/// ([`Enqueued::Duplicate`]), and the transaction stays usable: a duplicate never
/// aborts the caller's business write. A type without an `#[outbox(event_id)]` field
/// gets a fresh UUIDv7 per event, which no row can hold yet: its enqueue is a plain
/// `INSERT`, without the speculative insertion a duplicate check costs.
pub async fn enqueue<'e, T: Outbox>(
    event: &T,
    executor: impl PgExecutor<'e>,
) -> Result<Enqueued, OutboxError> {
    enqueue_scheduled(event, Schedule::Now, executor).await
}

/// [`enqueue`], due at `schedule`: the relay does not claim the event before.
///
/// A schedule beyond [`MAX_INTERVAL`](crate::MAX_INTERVAL) is
/// [`OutboxError::IntervalOutOfRange`], and a later time on a type not declared
/// `#[outbox(scheduled)]` [`OutboxError::NotScheduled`]; nothing is written then.
pub async fn enqueue_scheduled<'e, T: Outbox>(
    event: &T,
    schedule: Schedule,
    executor: impl PgExecutor<'e>,
) -> Result<Enqueued, OutboxError> {
    let extras = Extras::of::<T>(schedule)?;
    let event_id = event_id_of(event)?;
    Ok(
        if statements::enqueue(executor, &event_id, event, &extras).await? {
            Enqueued::New(event_id)
        } else {
            Enqueued::Duplicate(event_id)
        },
    )
}

/// Writes all `events` into their outbox table in one statement (one array parameter
/// per column), through `conn` (pass the business transaction: `&mut *tx`). Returns
/// what happened to each, in order: an event whose id was already in the table, or
/// earlier in `events`, is a [`Enqueued::Duplicate`] and is not written again.
///
/// Every id is checked before anything is written: one invalid id fails the whole call.
///
/// The insert is tried first as it is, in a savepoint (a transaction when `conn` is not
/// in one): `ON CONFLICT` makes every row a speculative insertion, which costs 45% more
/// for 10,000 rows, measured, where the savepoint costs two round trips. Only when an
/// id is already there is the insert rolled back to the savepoint and made again,
/// skipping the duplicates; the caller's transaction is never aborted.
pub async fn enqueue_all<'c, T: Outbox>(
    events: &[T],
    conn: impl Acquire<'c, Database = Postgres>,
) -> Result<Vec<Enqueued>, OutboxError> {
    enqueue_all_scheduled(events, Schedule::Now, conn).await
}

/// [`enqueue_all`], every event due at `schedule`, checked as by [`enqueue_scheduled`].
pub async fn enqueue_all_scheduled<'c, T: Outbox>(
    events: &[T],
    schedule: Schedule,
    conn: impl Acquire<'c, Database = Postgres>,
) -> Result<Vec<Enqueued>, OutboxError> {
    let table = T::SPEC.table;
    let extras = Extras::of::<T>(schedule)?;
    let ids = events
        .iter()
        .map(event_id_of)
        .collect::<Result<Vec<_>, _>>()?;
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let texts: Vec<&str> = ids.iter().map(EventId::as_str).collect();
    let mut conn = conn.acquire().await.on_table(table)?;

    let mut attempt = sqlx::Connection::begin(&mut *conn).await.on_table(table)?;
    if statements::enqueue_all(&mut *attempt, &texts, events, &extras).await? {
        attempt.commit().await.on_table(table)?;
        return Ok(ids.into_iter().map(Enqueued::New).collect());
    }
    attempt.rollback().await.on_table(table)?;

    // Rows are inserted in the order given, so the first of repeated ids is the one
    // written; each written id answers for one event.
    let mut written = statements::enqueue_all_skipping(&mut *conn, &texts, events, &extras).await?;
    Ok(ids
        .into_iter()
        .map(|id| {
            if written.remove(id.as_str()) {
                Enqueued::New(id)
            } else {
                Enqueued::Duplicate(id)
            }
        })
        .collect())
}
