//! The example application's event types, shared by the examples and the tests (the
//! tests compare their generated migrations with the golden files in `migrations/`),
//! and the examples' way of running a relay until it has published everything.

#![allow(dead_code, unreachable_pub)]

pub mod billing;

use std::time::Duration;

use outbox::{CancellationToken, Outbox, Relay, Sink};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// One line of an order, stored inside the event as jsonb.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Line {
    pub sku: String,
    pub quantity: i32,
}

/// Published when an order is placed (as JSON, by the broker examples).
#[derive(outbox::Outbox, Serialize, Debug, Clone, PartialEq)]
#[outbox(
    table = "order_events",
    lease = "30s",
    retry_delay = "1m",
    max_attempts = 10
)]
pub struct OrderPlaced {
    /// The order's id doubles as the stable event id: placing an order is one event.
    #[outbox(event_id)]
    pub order_id: uuid::Uuid,
    pub customer: String,
    pub total_cents: i64,
    pub note: Option<String>,
    #[outbox(json)]
    pub lines: Vec<Line>,
}

/// Published when a customer changes their email. It has no natural id, so every
/// enqueue gets a fresh UUIDv7; `referrer` came later, as migration version 2.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(
    table = "customer_events",
    lease = "10s",
    retry_delay = "5s",
    max_attempts = 3
)]
pub struct EmailChanged {
    pub customer: String,
    #[outbox(column = "new_email")]
    pub email: String,
    #[outbox(since = 2)]
    pub referrer: Option<String>,
}

/// Published when a payment is captured. Its short lease lets the quickstart show a
/// recovery in seconds.
#[derive(outbox::Outbox, Debug)]
#[outbox(
    table = "payment_events",
    lease = "1s",
    retry_delay = "5s",
    max_attempts = 5
)]
pub struct PaymentCaptured {
    #[outbox(event_id)]
    pub payment_id: uuid::Uuid,
    pub amount_cents: i64,
}

/// The benchmark's event: a 100-byte payload (as JSON, through the broker sinks).
#[derive(outbox::Outbox, Serialize, Debug, Clone)]
#[outbox(table = "bench_events", lease = "30s", retry_delay = "1s")]
pub struct BenchEvent {
    pub payload: String,
}

/// [`BenchEvent`] with its trace context kept (`traced`): the bench's trace section
/// weighs it against [`BenchEvent`].
#[derive(outbox::Outbox, Serialize, Debug, Clone)]
#[outbox(
    table = "bench_traced_events",
    lease = "30s",
    retry_delay = "1s",
    traced
)]
pub struct BenchTracedEvent {
    pub payload: String,
}

impl From<&BenchEvent> for BenchTracedEvent {
    fn from(event: &BenchEvent) -> Self {
        Self {
            payload: event.payload.clone(),
        }
    }
}

/// [`BenchEvent`] in the retention mode: the outcome that records an event as
/// published deletes its row (`delete_sent`).
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(
    table = "bench_deleted_events",
    lease = "30s",
    retry_delay = "1s",
    delete_sent
)]
pub struct BenchDeletedEvent {
    pub payload: String,
}

impl From<&BenchEvent> for BenchDeletedEvent {
    fn from(event: &BenchEvent) -> Self {
        Self {
            payload: event.payload.clone(),
        }
    }
}

/// [`BenchEvent`] without the unique index on `event_id` (`no_event_id_index`): the
/// bench's cost section weighs the two.
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(
    table = "bench_unindexed_events",
    lease = "30s",
    retry_delay = "1s",
    no_event_id_index
)]
pub struct BenchUnindexedEvent {
    pub payload: String,
}

/// [`BenchDeletedEvent`] without the unique index on `event_id`.
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(
    table = "bench_unindexed_deleted_events",
    lease = "30s",
    retry_delay = "1s",
    delete_sent,
    no_event_id_index
)]
pub struct BenchUnindexedDeletedEvent {
    pub payload: String,
}

impl From<&BenchEvent> for BenchUnindexedEvent {
    fn from(event: &BenchEvent) -> Self {
        Self {
            payload: event.payload.clone(),
        }
    }
}

impl From<&BenchEvent> for BenchUnindexedDeletedEvent {
    fn from(event: &BenchEvent) -> Self {
        Self {
            payload: event.payload.clone(),
        }
    }
}

/// The application's own refinery migrations (business tables), next to the outbox's.
pub fn app_migrations() -> Vec<outbox::schema::refinery::Migration> {
    [(
        "V1__create_orders",
        include_str!("../../migrations/app/V1__create_orders.sql"),
    )]
    .into_iter()
    .map(|(name, sql)| {
        outbox::schema::refinery::Migration::unapplied(name, sql).expect("a valid migration name")
    })
    .collect()
}

/// Runs `relay` until its table has nothing left to publish (no `READY` or `INPROGRESS`
/// row, retries included), then shuts it down gracefully. A service runs its relay until
/// SIGTERM instead; the examples stop when their events are out.
pub async fn publish_all<T: Outbox, S: Sink<T>>(
    pool: &PgPool,
    relay: Relay<T, S>,
) -> Result<(), Box<dyn std::error::Error>> {
    let shutdown = CancellationToken::new();
    let mut running = std::pin::pin!(relay.run(shutdown.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_mins(1);
    loop {
        let stats = outbox::stats::<T>(pool).await?;
        if stats.ready + stats.in_progress == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("still unpublished after a minute: {stats:?}").into());
        }
        tokio::select! {
            stopped = &mut running => {
                stopped?; // a fatal error: a missing table, permission denied, ...
                return Err("the relay stopped on its own".into());
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    shutdown.cancel(); // graceful: in-flight sends finish and are recorded
    running.await?;
    Ok(())
}

/// The ordering benchmark's event, ordered by its `key` (`#[outbox(key)]`).
#[derive(outbox::Outbox, Serialize, Debug, Clone)]
#[outbox(table = "bench_ordered_events", lease = "30s", retry_delay = "1s")]
pub struct BenchOrderedEvent {
    #[outbox(key)]
    pub key: i64,
    pub payload: String,
}

/// [`BenchOrderedEvent`] without the ordering: the same columns, `key` a plain column.
#[derive(outbox::Outbox, Serialize, Debug, Clone)]
#[outbox(table = "bench_keyed_events", lease = "30s", retry_delay = "1s")]
pub struct BenchKeyedEvent {
    pub key: i64,
    pub payload: String,
}

impl From<&BenchOrderedEvent> for BenchKeyedEvent {
    fn from(event: &BenchOrderedEvent) -> Self {
        Self {
            key: event.key,
            payload: event.payload.clone(),
        }
    }
}
