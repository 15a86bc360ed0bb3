//! The event types the tests define: struct shapes the derive must handle, the recovery
//! lab's event and the chaos run's. `tests/table/golden.rs` compares their migrations with the
//! golden files (which the `checked` build applies before compiling them).

use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Address {
    pub city: String,
}

/// One field of every supported column type.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "every_type_events")]
pub struct EveryType {
    #[outbox(event_id)]
    pub key: i64,
    pub small: i16,
    pub int: i32,
    pub big: i64,
    pub single: f32,
    pub double: f64,
    pub flag: bool,
    pub text: String,
    pub bytes: Vec<u8>,
    pub uuid: uuid::Uuid,
    pub chrono_date: chrono::NaiveDate,
    pub chrono_time: chrono::NaiveTime,
    pub chrono_naive: chrono::NaiveDateTime,
    pub chrono_utc: chrono::DateTime<chrono::Utc>,
    pub time_date: time::Date,
    pub time_time: time::Time,
    pub time_primitive: time::PrimitiveDateTime,
    pub time_offset: time::OffsetDateTime,
    pub value: serde_json::Value,
    pub maybe_int: Option<i32>,
    pub maybe_uuid: Option<uuid::Uuid>,
    pub maybe_utc: Option<chrono::DateTime<chrono::Utc>>,
    #[outbox(json)]
    pub address: Address,
    #[outbox(json)]
    pub maybe_address: Option<Address>,
    #[outbox(column = "type")]
    pub r#type: String,
}

/// No payload at all: the row is the event.
#[derive(outbox::Outbox, Debug, PartialEq)]
#[outbox(table = "tick_events")]
pub struct Tick {}

/// A string event id, a short budget.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(
    table = "budget_events",
    lease = "30s",
    retry_delay = "1s",
    max_attempts = 3
)]
pub struct Budgeted {
    #[outbox(event_id)]
    pub name: String,
}

/// The recovery lab's event: just a stable id, as in the article's minimal table.
#[derive(outbox::Outbox, Debug)]
#[outbox(table = "outbox_lab", lease = "30s", retry_delay = "1m")]
pub struct LabEvent {
    #[outbox(event_id)]
    pub name: String,
}

/// A lease of three seconds, renewed every second: for the relay tests whose sends outlast
/// a lease. Each renewal gets a second and two can fail before the lease runs out: a
/// margin that a loaded machine does not eat, where a one-second lease leaves a third of
/// a second per renewal.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(
    table = "long_send_events",
    lease = "3s",
    retry_delay = "5s",
    max_attempts = 5
)]
pub struct LongSend {
    #[outbox(event_id)]
    pub name: String,
}

/// The chaos event: a short lease so that pauses outlast it within seconds, a short
/// retry delay, and a budget that chaos never exhausts. The broker tests publish it as
/// JSON.
#[derive(outbox::Outbox, Serialize, Debug, Clone)]
#[outbox(
    table = "chaos_events",
    lease = "2s",
    retry_delay = "100ms",
    max_attempts = 1000
)]
pub struct ChaosEvent {
    /// `chaos-<seq>`.
    #[outbox(event_id)]
    pub key: String,
    /// The business row (`chaos_orders.seq`) committed with the event.
    pub order_seq: i64,
}

/// The retention mode: the outcome that records an event as published deletes its row.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(
    table = "receipt_events",
    max_attempts = 3,
    retry_delay = "1s",
    delete_sent
)]
pub struct Receipt {
    #[outbox(event_id)]
    pub name: String,
}

/// Per-key ordering: the events of one order leave in order. A short budget, so that
/// a test can spend it. The broker tests publish it as JSON.
#[derive(outbox::Outbox, Serialize, Debug, Clone, PartialEq)]
#[outbox(
    table = "order_step_events",
    lease = "30s",
    retry_delay = "1s",
    max_attempts = 2
)]
pub struct OrderStep {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key)]
    pub order_id: i64,
}

/// Per-key ordering where a `DEAD` event does not hold its key back.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "lenient_order_events", max_attempts = 1, dead_releases_key)]
pub struct LenientStep {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key)]
    pub order_id: uuid::Uuid,
}

/// A table created without a key ([`Shipment`] as it was first released)...
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "shipment_events")]
pub struct ShipmentBeforeKey {
    #[outbox(event_id)]
    pub name: String,
}

/// ...and the same table once a later version adds its ordering key.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "shipment_events")]
pub struct Shipment {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key, since = 2)]
    pub parcel: Option<String>,
}

/// The ordering chaos run's event: one of `seq` 0, 1, 2.. of its order, with a short
/// lease so that pauses outlast it, and a budget that chaos never exhausts.
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(
    table = "ordered_chaos_events",
    lease = "2s",
    retry_delay = "50ms",
    max_attempts = 1000
)]
pub struct OrderedChaosEvent {
    /// `<order>-<seq>`.
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key)]
    pub order_id: i64,
    pub seq: i32,
}

/// A keyed event with a JSON payload: a row rewritten behind the outbox's back makes one
/// event of a key's run undecodable.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "keyed_note_events")]
pub struct KeyedNote {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key)]
    pub order_id: i64,
    #[outbox(json)]
    pub body: Address,
}

/// The first release of an event type, for the export tests...
#[derive(outbox::Outbox, Debug)]
#[outbox(table = "parcel_events")]
pub struct ParcelSent {
    #[outbox(event_id)]
    pub name: String,
}

/// ...and a later build that added a field without `since`, changing migration 1 (what
/// `outbox::migrate` refuses). The golden files hold this one's table: `ParcelSent`'s
/// statements need a subset of its columns.
#[derive(outbox::Outbox, Debug)]
#[outbox(table = "parcel_events")]
pub struct ParcelSentChanged {
    #[outbox(event_id)]
    pub name: String,
    pub grams: i64,
}

/// Scheduled publish: a reminder enqueued for later.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "reminder_events", lease = "30s", scheduled)]
pub struct Reminder {
    #[outbox(event_id)]
    pub name: String,
}

/// Scheduled publish with an ordering key: a scheduled event holds its key's later ones.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "keyed_reminder_events", lease = "30s", scheduled)]
pub struct KeyedReminder {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(key)]
    pub account: i64,
}

/// A table created without a schedule ([`Notice`] as it was first released)...
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "notice_events")]
pub struct NoticeBeforeSchedule {
    #[outbox(event_id)]
    pub name: String,
}

/// ...and the same table once a later version makes it scheduled, beside a new field.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "notice_events", scheduled(since = 2))]
pub struct Notice {
    #[outbox(event_id)]
    pub name: String,
    #[outbox(since = 2)]
    pub audience: Option<String>,
}

/// A table created with its unique index on `event_id` ([`Pulse`] as it was first
/// released)... Not in the `checked` build: its statements name the index (`ON
/// CONFLICT (event_id)`), which the schema that build checks against no longer has.
#[cfg(not(feature = "checked"))]
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "pulse_events", max_attempts = 1)]
pub struct PulseBeforeUnindexing {
    pub beat: i64,
}

/// ...and the same table once a later version drops it: its ids are generated.
#[derive(outbox::Outbox, Debug, Clone, PartialEq)]
#[outbox(table = "pulse_events", max_attempts = 1, no_event_id_index(since = 2))]
pub struct Pulse {
    pub beat: i64,
}

/// Trace context: an order enqueued inside a request's span, published in its trace.
#[derive(outbox::Outbox, Serialize, Debug, Clone, PartialEq)]
#[outbox(
    table = "traced_order_events",
    lease = "1s",
    retry_delay = "10ms",
    traced
)]
pub struct TracedOrder {
    #[outbox(event_id)]
    pub name: String,
    pub customer: String,
}
