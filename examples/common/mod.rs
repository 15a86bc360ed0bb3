//! The example application's event types, shared by the examples and the tests (the
//! tests compare their generated migrations with the golden files in `migrations/`).

#![allow(dead_code, unreachable_pub)]

use serde::{Deserialize, Serialize};

/// One line of an order, stored inside the event as jsonb.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Line {
    pub sku: String,
    pub quantity: i32,
}

/// Published when an order is placed.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
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

/// The benchmark's event: a 100-byte payload, as in `../shared/notes/batch-costs.md`.
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(table = "bench_events", lease = "30s", retry_delay = "1s")]
pub struct BenchEvent {
    pub payload: String,
}

/// The application's own refinery migrations (business tables), next to the outbox's.
pub fn app_migrations() -> Vec<outbox::refinery::Migration> {
    [(
        "V1__create_orders",
        include_str!("../../migrations/app/V1__create_orders.sql"),
    )]
    .into_iter()
    .map(|(name, sql)| {
        outbox::refinery::Migration::unapplied(name, sql).expect("a valid migration name")
    })
    .collect()
}
