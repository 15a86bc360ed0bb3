//! A PostgreSQL transactional outbox that is safe by construction.
//!
//! An application writes its business rows and an event row in one transaction; a
//! publisher later **claims** the event, sends it to a broker, and records the
//! outcome. Two protections make that safe when publishers die or stall:
//!
//! - a **lease**: a claim expires, and an expired claim is claimable again, so an
//!   event is never stuck behind a publisher that died after committing its claim;
//! - a **generation**: a fencing token bumped by every claim. Complete, retry and
//!   renew succeed only for the current generation while its lease is live, so a
//!   paused publisher that wakes up after someone else took over cannot overwrite the
//!   new owner's outcome.
//!
//! Neither prevents duplicate *publication*: a publisher can send and then die before
//! recording `SENT`. Every event therefore carries a stable [`EventId`] that
//! consumers deduplicate on.
//!
//! # Declaring an event
//!
//! ```
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, Debug, Clone)]
//! pub struct Line { pub sku: String, pub quantity: i32 }
//!
//! #[derive(outbox::Outbox, Debug, Clone)]
//! #[outbox(table = "order_events", lease = "30s", retry_delay = "1m", max_attempts = 10)]
//! pub struct OrderPlaced {
//!     #[outbox(event_id)]      // the stable id; without one, a UUIDv7 is generated at enqueue
//!     pub order_id: uuid::Uuid,
//!     pub customer: String,     // text NOT NULL
//!     pub total_cents: i64,     // bigint NOT NULL
//!     pub note: Option<String>, // text, nullable
//!     #[outbox(json)]           // any serde type, as jsonb
//!     pub lines: Vec<Line>,
//!     #[outbox(since = 2)]      // added later, by the table's migration V2
//!     pub coupon: Option<String>,
//! }
//! # let spec = <OrderPlaced as outbox::Outbox>::SPEC;
//! # assert_eq!(spec.table(), "order_events");
//! # assert_eq!(spec.lease(), std::time::Duration::from_secs(30));
//! # assert_eq!(spec.migrations().len(), 2);
//! ```
//!
//! Struct attributes: `table` (a plain lowercase identifier; default: the struct name
//! in snake case), `lease` (at least `1s`; default `"30s"`), `retry_delay` (default
//! `"1m"`), `max_attempts` (claims an event may use before it moves to `DEAD`; default
//! 10), and two flags: `delete_sent` (recording an event as published deletes its row
//! instead of keeping it `SENT`) and `dead_releases_key` (with an ordering key: a `DEAD`
//! event no longer holds back its key's later events). Field attributes: `event_id`,
//! `key` (the ordering key: one key's events are published in the order of their row
//! ids, each after the one before it), `json`, `column = "name"`, and `since = N` for an `Option` field
//! added by migration version `N` of the table. The derive's own
//! documentation, [`Outbox`](derive@Outbox), is the full reference: every attribute,
//! the field types and their columns, what it generates, and how a table may evolve.
//!
//! # Using it
//!
//! ```no_run
//! # #[derive(outbox::Outbox)] struct OrderPlaced { customer: String }
//! # async fn run(pool: sqlx::PgPool, event: OrderPlaced) -> Result<(), Box<dyn std::error::Error>> {
//! outbox::migrate(&pool, &[OrderPlaced::migrations()]).await?;   // at startup; idempotent
//!
//! let mut tx = pool.begin().await?;                              // business write + event
//! sqlx::query("UPDATE accounts SET orders = orders + 1").execute(&mut *tx).await?;
//! let id = event.enqueue(&mut *tx).await?;
//! tx.commit().await?;
//!
//! if let Some(claim) = OrderPlaced::claim(&pool).await? {
//!     // publish claim.event() under claim.event_id(), then:
//!     claim.complete(&pool).await?;                              // Err(Stale) if ownership is gone
//! }
//! # let _ = id; Ok(()) }
//! ```
//!
//! # Publishing with the relay
//!
//! [`Relay`] is the long-running publisher: batch claims, a [`Sink`] per batch, lease
//! renewal during slow sends, retries with backoff, dead letters, `NOTIFY` wake-ups,
//! and a graceful shutdown that hands unsent events back. It returns early only on a
//! fatal error ([`OutboxError::is_transient`] tells which are not).
//!
//! A sink of your own implements [`Sink::publish`]: it gets each claimed batch and
//! returns one result per [`Delivery`], in order: `Ok` (recorded `SENT`),
//! [`SinkError::Transient`] (retried with backoff), [`SinkError::Permanent`] (`DEAD`
//! now) or [`SinkError::Unavailable`] (the destination is down: handed back without
//! counting the attempt, and the worker backs off). A sink whose client keeps sending
//! after its future is dropped also implements [`Sink::withdraw`], for a shutdown whose
//! grace runs out. The README walks through one, with a consumer that deduplicates on the event
//! id, and `examples/custom_sink.rs` runs it.
//!
//! ```no_run
//! # #[derive(outbox::Outbox, Debug, Clone)] struct OrderPlaced { customer: String }
//! # async fn run(pool: sqlx::PgPool) -> Result<(), outbox::OutboxError> {
//! use std::time::Duration;
//! use outbox::{CancellationToken, StdoutSink};
//!
//! let shutdown = CancellationToken::new(); // cancel it on SIGTERM
//! let relay = outbox::Relay::<OrderPlaced, _>::new(pool, StdoutSink)
//!     .batch_size(100)
//!     .concurrency(8) // the pool needs 8 + 1 connections
//!     .shutdown_grace(Duration::from_secs(10));
//! relay.run(shutdown).await // returns after a graceful shutdown
//! # }
//! ```
//!
//! # Where everything is
//!
//! Each item has one path. The root holds what a first program and an everyday service
//! name:
//!
//! - declaring and writing events: [`Outbox`](derive@Outbox) (the derive, and the
//!   [trait](trait@Outbox) it implements), [`Enqueued`], [`EventId`];
//! - claiming them by hand: [`Claim`], [`Retried`] (what [`Claim::retry`] answers),
//!   [`Generation`];
//! - publishing them: [`Relay`], [`Sink`], [`Delivery`], [`SinkError`], [`StdoutSink`],
//!   [`CancellationToken`];
//! - consuming them once: [`Inbox`], [`Received`];
//! - the database: [`connect`], [`connect_with`] (a pool sized for the relay's workers),
//!   [`migrate`], [`verify`], [`stats`] and its [`Stats`];
//! - every error: [`OutboxError`].
//!
//! The rest, by topic:
//!
//! - [`relay`]: the relay's [`Backoff`](relay::Backoff), the
//!   [`MemorySink`](relay::MemorySink) for tests, [`BoxError`](relay::BoxError), and
//!   its counters' names;
//! - [`schema`]: migration reports, an event type's migrations and table spec,
//!   [`migrate_with_app`](schema::migrate_with_app) and refinery;
//! - [`ops`]: requeue, discard and prune, and the limits of durations and statement
//!   timeouts;
//! - [`table`]: `enqueue`, `claim` and their batch forms, generic over the event type;
//! - [`inbox`]: the inbox table's own [`migrate`](inbox::migrate);
//! - [`monitor`]: the [`Monitor`](monitor::Monitor) that sets gauges from [`stats`],
//!   and their names;
//! - [`catalog`]: what `migrate` records of each table, for tools without the types;
//! - [`export`]: the migrations as `.sql` files, for teams with their own tool;
//! - [`message`]: what a broker sink puts into a message (encoding, headers, CloudEvents);
//! - [`trace`]: one trace from the request to the consumer (`#[outbox(traced)]`; the
//!   relay's and the consumer's spans with the cargo feature `otel`);
//! - `nats`, `rabbitmq`, `kafka` (cargo features of the same names): the broker sinks;
//! - `testing` (feature `testing`): a database and a fresh schema per test.

pub use outbox_derive::Outbox;
/// The trait `#[derive(Outbox)]` implements (macros and traits live in separate
/// namespaces, as with serde's `Serialize`).
pub use outbox_runtime::Outbox;
pub use outbox_runtime::inbox::{Inbox, Received};
pub use outbox_runtime::relay::{CancellationToken, Delivery, Relay, Sink, SinkError, StdoutSink};
pub use outbox_runtime::{
    Claim, Enqueued, EventId, Generation, OutboxError, Retried, Stats, connect, connect_with,
    migrate, stats, verify,
};

pub mod relay {
    //! What tunes and tests a [`Relay`](crate::Relay) beyond its builder: the [`Backoff`]
    //! of its retries and outages, the [`MemorySink`] that records what it published (as
    //! [`Published`] events), the [`BoxError`] every [`SinkError`](crate::SinkError)
    //! carries, where a sink says it publishes ([`Destination`], for the relay's spans),
    //! and the names of the counters it emits ([`metric`]). The relay, the
    //! [`Sink`](crate::Sink) trait and the [`StdoutSink`](crate::StdoutSink) are at the
    //! root.
    pub use outbox_runtime::relay::{
        Backoff, BoxError, Destination, MemorySink, Published, metric,
    };
}

pub mod schema {
    //! The outbox tables' schema beyond [`migrate`](crate::migrate) and
    //! [`verify`](crate::verify): what a migration run reports
    //! ([`MigrationReport`], [`AppliedMigration`]), an event type's migrations
    //! ([`TableMigrations`], [`MigrationStep`]) and table ([`TableSpec`], [`Column`],
    //! the field types an event id can come from: [`EventIdField`]), and the
    //! application's own refinery migrations run under the same lock
    //! ([`migrate_with_app`], [`refinery`]).
    pub use outbox_runtime::{
        AppliedMigration, Column, EventIdField, MigrationReport, MigrationStep, TableMigrations,
        TableSpec, migrate_with_app, refinery,
    };
}

pub mod ops {
    //! An operator's statements on one table, generic over its event type, beside
    //! [`stats`](crate::stats): put `DEAD` events back ([`requeue_dead`],
    //! [`requeue_all_dead`]) or delete them ([`discard_dead`]), delete old `SENT` rows
    //! ([`prune_sent`]); the longest delay or age they (and
    //! [`Claim::retry`](crate::Claim::retry)) accept ([`MAX_INTERVAL`]), and the
    //! `statement_timeout` rule of the monitor and the command line
    //! ([`statement_timeout_millis`]).
    pub use outbox_runtime::{
        MAX_INTERVAL, discard_dead, prune_sent, requeue_all_dead, requeue_dead,
        statement_timeout_millis,
    };
}

pub mod table {
    //! The generic forms of the methods `#[derive(Outbox)]` gives each event type
    //! (`OrderPlaced::enqueue`, `OrderPlaced::claim`, ...), for code generic over
    //! `T: Outbox`: [`enqueue`], [`enqueue_all`], [`claim`], [`claim_batch`]; and the
    //! scheduled forms behind `enqueue_at` and `enqueue_after`: [`enqueue_scheduled`],
    //! [`enqueue_all_scheduled`], at a [`Schedule`].
    pub use outbox_runtime::{
        Schedule, claim, claim_batch, enqueue, enqueue_all, enqueue_all_scheduled,
        enqueue_scheduled,
    };
}

pub mod inbox {
    //! The consumer's inbox beyond [`Inbox`](crate::Inbox) and
    //! [`Received`](crate::Received): its table's [`migrate`], to run at startup, its
    //! name ([`TABLE`]), and what it reads from a broker's message ([`Consumed`]).
    pub use outbox_runtime::inbox::{Consumed, TABLE, migrate};
}

pub use outbox_runtime::{catalog, export, fleet, message, monitor, trace};

#[cfg(feature = "kafka")]
pub use outbox_runtime::kafka;
#[cfg(feature = "nats")]
pub use outbox_runtime::nats;
#[cfg(feature = "rabbitmq")]
pub use outbox_runtime::rabbitmq;
#[cfg(feature = "testing")]
pub use outbox_runtime::testing;

#[doc(hidden)]
pub use outbox_runtime::__private;

/// The guide (`docs/src`): every chapter's Rust snippets run as this crate's doc tests,
/// so the guide cannot drift from the code. A broker's chapter runs with its feature.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../docs/src/event-types.md")]
    struct EventTypes;
    #[doc = include_str!("../docs/src/sinks.md")]
    struct Sinks;
    #[cfg(feature = "nats")]
    #[doc = include_str!("../docs/src/nats.md")]
    struct Nats;
    #[cfg(feature = "rabbitmq")]
    #[doc = include_str!("../docs/src/rabbitmq.md")]
    struct RabbitMq;
    #[cfg(feature = "kafka")]
    #[doc = include_str!("../docs/src/kafka.md")]
    struct Kafka;
    #[cfg(feature = "nats")]
    #[doc = include_str!("../docs/src/inbox.md")]
    struct Inbox;
    #[doc = include_str!("../docs/src/ordering.md")]
    struct Ordering;
    #[cfg(feature = "otel")]
    #[doc = include_str!("../docs/src/tracing.md")]
    struct Tracing;
    #[doc = include_str!("../docs/src/operations.md")]
    struct Operations;
    #[doc = include_str!("../docs/src/monitoring.md")]
    struct Monitoring;
    #[doc = include_str!("../docs/src/relay.md")]
    struct Relay;
    #[doc = include_str!("../docs/src/fleet.md")]
    struct Fleet;
    #[doc = include_str!("../docs/src/schema.md")]
    struct Schema;
    #[doc = include_str!("../docs/src/testing.md")]
    struct Testing;
}
