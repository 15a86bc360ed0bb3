//! The consumer's half of the outbox: an inbox of the events a consumer has applied,
//! so that a redelivered event is recognised and its effect applied once.
//!
//! The relay delivers at least once: a publisher can send and die before recording
//! `SENT`, a broker can redeliver an unacknowledged message. Every copy carries the
//! same event id. A consumer records that id in the transaction that applies the
//! event's effect ([`Inbox::receive`]); the effect and the inbox row commit together or
//! not at all, so a copy that arrives later finds the row and is skipped.

use std::time::Duration;

use sqlx::{PgExecutor, PgPool};

use crate::error::{OnTable as _, OutboxError};
use crate::id::EventId;
use crate::interval;
use crate::schema::migrate::{MigrationReport, migrate_target};
use crate::schema::runner::own_runner;
use crate::trace::TraceContext;

/// The inbox table: one for every consumer of the schema, keyed by `(consumer,
/// event_id)`.
pub const TABLE: &str = outbox_internals::INBOX_TABLE;

/// The refinery history table of the inbox's migrations.
const HISTORY_TABLE: &str = "_outbox_history_outbox_inbox";

/// The inbox's migrations, in order. `event_id` is matched byte for byte, like the
/// outbox's own; the second index serves pruning.
const MIGRATIONS: [(&str, &str); 1] = [(
    "V1__create_outbox_inbox",
    "CREATE TABLE outbox_inbox (
    consumer text COLLATE \"C\" NOT NULL,
    event_id text COLLATE \"C\" NOT NULL,
    received_at timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX outbox_inbox_received_at ON outbox_inbox (consumer, received_at);
",
)];

const RECEIVE: &str =
    "INSERT INTO outbox_inbox (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

const PRUNE: &str = "DELETE FROM outbox_inbox WHERE consumer = $1 AND event_id IN (
    SELECT event_id FROM outbox_inbox
    WHERE consumer = $1 AND received_at < statement_timestamp() - $2::interval
    LIMIT $3)";

/// A message as a consumer received it from a broker: what the inbox reads from it.
///
/// Implemented for each broker sink's messages (`async_nats::Message`, lapin's
/// `Delivery`, rdkafka's `BorrowedMessage` and `OwnedMessage`, with their features);
/// implement it for the messages of a broker of your own.
pub trait Consumed {
    /// The event id it carries (the [`Outbox-Event-Id`](crate::message::header::EVENT_ID)
    /// header): what the inbox deduplicates on.
    fn event_id(&self) -> Option<&str>;

    /// The broker it was received from, as OpenTelemetry's messaging conventions name it
    /// (`messaging.system`: `nats`, `kafka`, `rabbitmq`).
    fn system(&self) -> &'static str;

    /// Where it was received from: its subject, topic, or exchange.
    fn destination(&self) -> &str;

    /// The trace context it carries (its `traceparent`, `tracestate` and `baggage`
    /// headers), if a valid one.
    fn trace(&self) -> Option<TraceContext>;

    /// A consumer's span for handling it (feature `otel`): `process <destination>`,
    /// span kind consumer, OpenTelemetry's messaging attributes, a child of the trace
    /// context it carries (with its baggage), so the consumer's work joins the trace that
    /// enqueued the event; a root span without one. Enter it (or `instrument` the
    /// handling with it) around the effect. [`Inbox::span`] is the same span with the
    /// inbox's consumer as the consumer group.
    #[cfg(feature = "otel")]
    fn consumer_span(&self) -> tracing::Span {
        process_span(self, None)
    }
}

/// The span of `consumer` (none: the group unnamed) processing `message`.
#[cfg(feature = "otel")]
fn process_span(message: &(impl Consumed + ?Sized), consumer: Option<&str>) -> tracing::Span {
    crate::trace::otel::consumer_span(
        message.system(),
        message.destination(),
        message.event_id().unwrap_or_default(),
        consumer,
        message.trace().as_ref(),
    )
}

/// Whether [`Inbox::receive`] saw an event for the first time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a duplicate's effect must not be applied again"]
pub enum Received {
    /// First time: apply the effect in the same transaction, then commit.
    New,
    /// This consumer already committed this event: skip it (and acknowledge it to the
    /// broker).
    Duplicate,
}

impl Received {
    /// Whether this is the event's first delivery to the consumer.
    pub fn is_new(self) -> bool {
        self == Self::New
    }
}

/// The events one consumer has applied.
///
/// ```no_run
/// use outbox_runtime::inbox::{Inbox, Received};
///
/// # async fn handle(pool: &sqlx::PgPool, event_id: &str, amount: i64) -> Result<(), Box<dyn std::error::Error>> {
/// outbox_runtime::inbox::migrate(pool).await?; // at startup, like `outbox::migrate`
/// let inbox = Inbox::new("billing");
///
/// // Per message: the effect and the inbox row in one transaction.
/// let mut tx = pool.begin().await?;
/// if inbox.receive(&mut tx, event_id).await? == Received::New {
///     sqlx::query("UPDATE accounts SET balance = balance + $1")
///         .bind(amount)
///         .execute(&mut *tx)
///         .await?;
/// }
/// tx.commit().await?;
/// // Only now acknowledge the message to the broker: a crash before this point
/// // redelivers it, and the inbox skips it.
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    consumer: String,
}

impl Inbox {
    /// The inbox of `consumer`: a stable name for one logical consumer (a service, or
    /// one of its handlers), the same in all its replicas. Consumers with different
    /// names see every event each.
    ///
    /// Event ids are unique within one outbox table. A consumer of several tables whose
    /// ids can coincide (ids the application chooses, such as an order id two event
    /// types carry) keeps one inbox per table, e.g. named `billing/order_events` after
    /// the message's [`Outbox-Table`](crate::message::header::TABLE) header: in one
    /// inbox, the second table's event would read [`Received::Duplicate`].
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
        }
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The span of this consumer's handling of `message` (feature `otel`):
    /// `process <destination>`, span kind consumer, with OpenTelemetry's messaging
    /// attributes (the event id, this consumer as `messaging.consumer.group.name`), a
    /// child of the trace the message carries: the trace that enqueued the event,
    /// through the relay's `send` span, reaches the effect. [`receive`](Self::receive)
    /// records in it whether the event was a duplicate (`outbox.duplicate`).
    ///
    /// Handle the message inside it: the effect's transaction, `receive`, the commit,
    /// and the acknowledgement to the broker.
    ///
    /// ```no_run
    /// # #[cfg(feature = "nats")]
    /// # async fn handle(pool: &sqlx::PgPool, message: &async_nats::jetstream::Message) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use outbox_runtime::inbox::{Consumed as _, Inbox};
    /// use tracing::Instrument as _;
    ///
    /// let inbox = Inbox::new("billing");
    /// async {
    ///     let mut tx = pool.begin().await?;
    ///     if inbox.receive(&mut tx, message.event_id().unwrap_or_default()).await?.is_new() {
    ///         // The effect, in `tx`.
    ///     }
    ///     tx.commit().await?;
    ///     message.ack().await
    /// }
    /// .instrument(inbox.span(&**message))
    /// .await
    /// # }
    /// ```
    #[cfg(feature = "otel")]
    pub fn span(&self, message: &impl Consumed) -> tracing::Span {
        process_span(message, Some(&self.consumer))
    }

    /// Records `event_id` for this consumer, in the caller's transaction: returns
    /// [`Received::New`] the first time and [`Received::Duplicate`] once a transaction
    /// that recorded it has committed. One `INSERT .. ON CONFLICT DO NOTHING`.
    ///
    /// It takes the transaction that applies the event's effect (a receipt committed
    /// on its own, before an effect that then fails, would make every redelivery read
    /// `Duplicate`: the effect lost). Run it before the effect: while another
    /// transaction holds the same event uncommitted, this one waits for it, and then
    /// sees `Duplicate` (it committed) or `New` (it rolled back). That is at `READ
    /// COMMITTED`, PostgreSQL's default; at `REPEATABLE READ` or `SERIALIZABLE` the
    /// waiting one fails with a serialization failure instead (SQLSTATE `40001`):
    /// nothing applied twice, and the message is to be handled again.
    ///
    /// An id the outbox could not have stored (empty, blank, longer than
    /// [`EventId::MAX_LEN`] bytes, with a NUL) is [`OutboxError::InvalidEventId`];
    /// [`OutboxError::MissingTable`] says that [`migrate`] has not run.
    pub async fn receive(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        event_id: impl AsRef<str>,
    ) -> Result<Received, OutboxError> {
        let event_id = event_id.as_ref();
        let id = EventId::from_column(event_id.to_owned());
        if let Some(reason) = id.defect() {
            return Err(OutboxError::InvalidEventId {
                table: TABLE,
                event_id: id.shortened(),
                reason,
            });
        }
        let done = sqlx::query(RECEIVE)
            .bind(&self.consumer)
            .bind(event_id)
            .execute(&mut **tx)
            .await
            .on_table(TABLE)?;
        let received = if done.rows_affected() == 1 {
            Received::New
        } else {
            Received::Duplicate
        };
        // In the consumer's span (`span`), if that is the current one.
        tracing::Span::current().record("outbox.duplicate", received == Received::Duplicate);
        Ok(received)
    }

    /// Deletes up to `batch` of this consumer's rows received more than `older_than`
    /// ago, and returns how many; call it in a loop until it returns less than `batch`.
    ///
    /// A pruned event is new again: keep rows longer than any copy can arrive late
    /// (the broker's redelivery horizon, and how long after a first publication your
    /// operators may requeue `DEAD` events). An age above
    /// [`MAX_INTERVAL`](crate::MAX_INTERVAL) is [`OutboxError::IntervalOutOfRange`].
    pub async fn prune<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        older_than: Duration,
        batch: u32,
    ) -> Result<u64, OutboxError> {
        let done = sqlx::query(PRUNE)
            .bind(&self.consumer)
            .bind(interval::checked(TABLE, "prune age", older_than)?)
            .bind(i64::from(batch))
            .execute(executor)
            .await
            .on_table(TABLE)?;
        Ok(done.rows_affected())
    }
}

/// Creates the inbox table the first time, through the runner and under the lock of
/// [`migrate`](crate::migrate) (its history in `_outbox_history_outbox_inbox`);
/// idempotent. Call it at a consumer's startup.
pub async fn migrate(pool: &PgPool) -> Result<MigrationReport, OutboxError> {
    let runner = own_runner(TABLE, HISTORY_TABLE, &MIGRATIONS)?;
    migrate_target(pool, TABLE, &runner).await
}
