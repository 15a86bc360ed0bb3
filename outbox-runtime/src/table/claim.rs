//! The claim token: proof of ownership of one outbox row, consumed by its outcome; and
//! what a row returned by a claim statement decodes to.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgRow, PgValueFormat};
use sqlx::{Column as _, PgExecutor, Postgres, Row, ValueRef as _};
use tokio::time::Instant;

use super::row::{Lease, Owned, Retried};
use super::{metric, statements};
use crate::error::OutboxError;
use crate::id::{EventId, Generation};
use crate::spec::Outbox;
use crate::trace::TraceContext;
use outbox_internals::claim_header as header;
use outbox_internals::{TRACE_BAGGAGE, TRACE_PARENT, TRACE_STATE};

/// Ownership of one outbox row for the duration of a lease.
///
/// A claim is obtained from `T::claim` / `T::claim_batch` and consumed by exactly
/// one outcome: [`complete`](Self::complete), [`retry`](Self::retry) or
/// [`fail`](Self::fail). Each outcome is guarded by the row id, the claim's
/// [`Generation`] and a live lease, so a publisher that was paused past its lease
/// cannot overwrite the outcome of whoever claimed the row after it. A claim that is
/// dropped without an outcome is recovered when its lease expires.
///
/// Claims cannot be built by hand: every field is private.
#[must_use = "a claim must be completed, retried or failed; a dropped claim waits for its lease to expire"]
#[derive(Debug)]
pub struct Claim<T: Outbox> {
    id: i64,
    event_id: EventId,
    generation: Generation,
    attempt: i32,
    lease: Lease,
    created_at: DateTime<Utc>,
    reclaimed: bool,
    /// The ordering key as text, for a type with `#[outbox(key)]` (NULL keys are `None`).
    key: Option<String>,
    /// The trace context it was enqueued in, for a type with `#[outbox(traced)]`.
    trace: Option<TraceContext>,
    event: T,
}

impl Owned {
    /// The row `claim` owns, as the guarded statements name it.
    pub(crate) fn of<T: Outbox>(claim: &Claim<T>) -> Self {
        Self {
            id: claim.id(),
            generation: claim.generation().get(),
        }
    }
}

impl<T: Outbox> Claim<T> {
    /// The row id (the table's identity primary key).
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The stable id of the logical event: the same across retries and reclaims.
    /// Publish it with the event so consumers can deduplicate.
    pub fn event_id(&self) -> &EventId {
        &self.event_id
    }

    /// The fencing token this claim holds.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Which claim of the current attempt budget this is (1 for the first).
    /// Abandoned claims count: a publisher that died holding the row used one.
    pub fn attempt(&self) -> u32 {
        self.attempt.unsigned_abs()
    }

    /// Whether this claim took over an expired claim (a publisher died or stalled)
    /// rather than a `READY` row.
    pub fn is_reclaim(&self) -> bool {
        self.reclaimed
    }

    /// When the lease ends, as last granted by the database: by the database's clock,
    /// which this host's need not agree with.
    pub fn lease_until(&self) -> SystemTime {
        self.lease.until().into()
    }

    /// When the lease ends by this process's monotonic clock, at the latest ([`Lease`]).
    pub(crate) fn lease_deadline(&self) -> Instant {
        self.lease.deadline()
    }

    /// When the event was enqueued (its row's `created_at`, the database's clock).
    pub fn created_at(&self) -> SystemTime {
        self.created_at.into()
    }

    /// [`created_at`](Self::created_at) in microseconds since the Unix epoch.
    pub(crate) fn enqueued_micros(&self) -> i64 {
        self.created_at.timestamp_micros()
    }

    /// The event's ordering key as text (`#[outbox(key)]`), to publish it under: a
    /// broker that orders by key (a Kafka partition key) keeps the order the outbox
    /// kept. `None` for a type without a key, or an event enqueued before the key.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The trace context the event was enqueued in (`#[outbox(traced)]`): publish it
    /// with the event (`traceparent`, `tracestate`) so its consumer joins that trace.
    /// `None` for a type that is not traced, or an event enqueued outside a trace.
    pub fn trace(&self) -> Option<&TraceContext> {
        self.trace.as_ref()
    }

    /// The event.
    pub fn event(&self) -> &T {
        &self.event
    }

    /// Records that the event was published: `INPROGRESS -> SENT`.
    ///
    /// Returns [`OutboxError::Stale`] and records nothing if the lease expired or a
    /// newer generation owns the row.
    pub async fn complete<'e>(self, executor: impl PgExecutor<'e>) -> Result<(), OutboxError> {
        if statements::complete::<T>(executor, Owned::of(&self)).await? {
            Ok(())
        } else {
            Err(self.stale())
        }
    }

    /// Hands the event back for another attempt after `delay` (or the type's
    /// `retry_delay` when `None`). When the attempt budget is spent the row moves to
    /// `DEAD` instead; the returned [`Retried`] says which.
    ///
    /// A delay above [`MAX_INTERVAL`](crate::MAX_INTERVAL) is refused with
    /// [`OutboxError::IntervalOutOfRange`] and records nothing: the event is claimed
    /// again once this claim's lease ends.
    pub async fn retry<'e>(
        self,
        executor: impl PgExecutor<'e>,
        delay: impl Into<Option<Duration>>,
    ) -> Result<Retried, OutboxError> {
        self.retry_inner(executor, delay.into(), None).await
    }

    /// Like [`retry`](Self::retry), and keeps `reason` in the row's `last_error`.
    pub async fn retry_because<'e>(
        self,
        executor: impl PgExecutor<'e>,
        delay: impl Into<Option<Duration>>,
        reason: &str,
    ) -> Result<Retried, OutboxError> {
        self.retry_inner(executor, delay.into(), Some(reason)).await
    }

    async fn retry_inner<'e>(
        self,
        executor: impl PgExecutor<'e>,
        delay: Option<Duration>,
        reason: Option<&str>,
    ) -> Result<Retried, OutboxError> {
        let delay = delay.unwrap_or(T::SPEC.retry_delay);
        statements::retry::<T>(executor, Owned::of(&self), delay, reason)
            .await?
            .ok_or_else(|| self.stale())
    }

    /// Gives up on the event now: `INPROGRESS -> DEAD` with `reason` in `last_error`.
    /// Dead rows stay visible in the table until someone requeues them.
    pub async fn fail<'e>(
        self,
        executor: impl PgExecutor<'e>,
        reason: &str,
    ) -> Result<(), OutboxError> {
        if statements::fail::<T>(executor, Owned::of(&self), reason).await? {
            Ok(())
        } else {
            Err(self.stale())
        }
    }

    /// The lease a batch renewal gave this claim (the relay's renewals, one statement
    /// for a whole batch).
    pub(crate) fn renewed(&mut self, lease: Lease) {
        self.lease = lease;
    }

    /// Extends the lease by the type's `lease` from now, for sends that take long.
    ///
    /// Guarded like the outcomes: when it returns [`OutboxError::Stale`] the row is no
    /// longer this claim's, and the caller should stop publishing it if it can.
    pub async fn renew<'e>(&mut self, executor: impl PgExecutor<'e>) -> Result<(), OutboxError> {
        let lease = statements::renew::<T>(executor, Owned::of(self)).await?;
        self.lease = lease.ok_or_else(|| self.stale())?;
        Ok(())
    }

    fn stale(&self) -> OutboxError {
        OutboxError::Stale {
            table: T::SPEC.table,
            id: self.id,
            generation: self.generation,
        }
    }
}

/// A claimed row whose payload did not decode.
pub(crate) struct Undecodable {
    id: i64,
    generation: i64,
    event_id: String,
    key: Option<String>,
    source: sqlx::Error,
}

impl Undecodable {
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// Its ordering key, on a keyed table.
    pub(crate) fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }
}

/// What one row returned by a claim statement turned out to be.
pub(crate) enum Claimed<T: Outbox> {
    Claim(Claim<T>),
    /// An expired claim that had used the whole budget: the statement moved it to DEAD
    /// (and decoding logged it).
    Exhausted,
    Undecodable(Undecodable),
}

/// Moves a claimed row whose payload does not decode to `DEAD` (guarded by its
/// generation), and returns the error that says so.
pub(crate) async fn dead_letter<T: Outbox>(
    conn: &mut sqlx::PgConnection,
    bad: Undecodable,
) -> Result<OutboxError, OutboxError> {
    let spec = T::SPEC;
    tracing::error!(
        table = spec.table, id = bad.id, event_id = %bad.event_id, error = %bad.source,
        "claimed an event that cannot be decoded; moving it to DEAD"
    );
    metrics::counter!(metric::DEAD, "table" => spec.table).increment(1);
    let row = Owned {
        id: bad.id,
        generation: bad.generation,
    };
    // Not recorded (stale): another claim has the row now, and meets the same payload.
    statements::fail::<T>(conn, row, &format!("cannot decode payload: {}", bad.source)).await?;
    Ok(OutboxError::Decode {
        table: spec.table,
        id: bad.id,
        event_id: bad.event_id,
        source: bad.source,
    })
}

/// Decodes a row returned by a claim statement sent at `sent`; an error is a broken
/// header (drift). With it, the row's `next_attempt_at` (microseconds since the Unix
/// epoch) when it was claimed from `READY`.
pub(crate) fn decode_claim<T: Outbox>(
    row: &PgRow,
    sent: Instant,
) -> Result<(Claimed<T>, Option<i64>), sqlx::Error> {
    let id: i64 = row.try_get(header::ID)?;
    let event_id: String = row.try_get(header::EVENT_ID)?;
    let generation: i64 = row.try_get(header::GENERATION)?;
    let attempt: i32 = row.try_get(header::ATTEMPTS)?;
    let Some(lease_until) = row.try_get::<Option<DateTime<Utc>>, _>(header::LEASE_UNTIL)? else {
        tracing::warn!(table = T::SPEC.table, id, %event_id,
            "an expired claim used the whole attempt budget; moved to DEAD");
        metrics::counter!(metric::DEAD, "table" => T::SPEC.table).increment(1);
        return Ok((Claimed::Exhausted, None));
    };
    let created_at = timestamp(row, header::CREATED_AT)?;
    let reclaimed: bool = row.try_get(header::RECLAIMED)?;
    let key = match T::SPEC.key() {
        Some(_) => row.try_get::<Option<String>, _>(header::KEY_NAME)?,
        None => None,
    };
    let trace = if T::SPEC.traced {
        // Read in place: the context copies what it keeps.
        let parent: Option<&str> = row.try_get(TRACE_PARENT.name)?;
        let state: Option<&str> = row.try_get(TRACE_STATE.name)?;
        let baggage: Option<&str> = row.try_get(TRACE_BAGGAGE.name)?;
        parent
            .and_then(|parent| TraceContext::parse(parent, state).map(|t| t.with_baggage(baggage)))
    } else {
        None
    };
    let due = (!reclaimed)
        .then(|| unix_micros(row, header::NEXT_ATTEMPT_AT))
        .transpose()?;
    let claimed = match decode_event::<T>(row, &event_id) {
        Ok(event) => Claimed::Claim(Claim {
            id,
            event_id: EventId::from_column(event_id),
            generation: Generation::new(generation),
            attempt,
            lease: Lease::granted::<T>(lease_until, sent),
            created_at,
            reclaimed,
            key,
            trace,
            event,
        }),
        Err(source) => Claimed::Undecodable(Undecodable {
            id,
            generation,
            event_id,
            key,
            source,
        }),
    };
    Ok((claimed, due))
}

/// Decodes the event of a claimed row. A decoder that panics is an undecodable row,
/// not a dead worker: sqlx's chrono and time decoders panic on a timestamp outside
/// their range, such as `'infinity'` written into a payload column by hand.
fn decode_event<T: Outbox>(row: &PgRow, event_id: &str) -> Result<T, sqlx::Error> {
    std::panic::catch_unwind(AssertUnwindSafe(|| T::decode(row, event_id))).unwrap_or_else(
        |panic| {
            let message = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("no message");
            Err(sqlx::Error::Decode(
                format!("a column's decoder panicked: {message}").into(),
            ))
        },
    )
}

/// How far the `READY` scan of a relay's claim on a keyed table saw every due row
/// ([`header::REACH_NAME`]), in microseconds since the Unix epoch; `None` where expired
/// claims filled the batch.
pub(crate) fn reach(row: &PgRow) -> Result<Option<i64>, sqlx::Error> {
    let column = row.try_column(header::REACH_NAME)?.ordinal();
    if row.try_get_raw(column)?.is_null() {
        return Ok(None);
    }
    unix_micros(row, column).map(Some)
}

/// Microseconds from 2000-01-01, PostgreSQL's epoch, back to the Unix epoch.
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A `timestamptz` column of the header in microseconds since the Unix epoch. Read
/// from its binary form, so that `±infinity` (an operator's `UPDATE`) saturates where
/// sqlx's own decoder would panic.
fn unix_micros(row: &PgRow, column: usize) -> Result<i64, sqlx::Error> {
    let value = row.try_get_raw(column)?;
    if value.format() == PgValueFormat::Text {
        return row
            .try_get::<DateTime<Utc>, _>(column)
            .map(|t| t.timestamp_micros());
    }
    <i64 as sqlx::Decode<'_, Postgres>>::decode(value)
        .map(|since_2000| since_2000.saturating_add(POSTGRES_EPOCH_MICROS))
        .map_err(|source| sqlx::Error::ColumnDecode {
            index: column.to_string(),
            source,
        })
}

/// A `timestamptz` column of the header, one beyond chrono's range clamped to it.
fn timestamp(row: &PgRow, column: usize) -> Result<DateTime<Utc>, sqlx::Error> {
    let micros = unix_micros(row, column)?;
    Ok(
        DateTime::from_timestamp_micros(micros).unwrap_or(if micros < 0 {
            DateTime::<Utc>::MIN_UTC
        } else {
            DateTime::<Utc>::MAX_UTC
        }),
    )
}
