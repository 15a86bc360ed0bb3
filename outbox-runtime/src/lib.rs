//! The runtime of the [`outbox`](https://docs.rs/outbox) crate: the claim token, the
//! errors, the generic statements behind `#[derive(Outbox)]`, the migration runner, the
//! relay and its sinks (the broker sinks behind their cargo features), and the
//! consumer's inbox.
//!
//! Users depend on the `outbox` facade, which re-exports everything an application uses,
//! each item at one path: the everyday ones at its root, the rest in topical modules
//! (`outbox::relay`, `outbox::schema`, `outbox::ops`, ...). The paths in this crate are
//! the runtime's own, not the ones users write.

// What the rest is built on: the derive's spec of a table and how it binds JSON, the
// identities of a row, the errors, intervals, connections.
mod connect;
mod error;
mod id;
mod interval;
#[doc(hidden)]
pub mod json;
mod spec;

// The rows of one outbox table (enqueue, claim, record, repair), the tables' schema
// (migrations, verification, the catalog), and where events go (the sinks).
mod schema;
mod sink;
mod table;

// What runs beside the application: the relay, from the tables to a sink; the consumer's
// inbox; the monitor's gauges; and test support.
pub mod fleet;
pub mod inbox;
pub mod monitor;
pub mod relay;
#[cfg(feature = "testing")]
pub mod testing;
pub mod trace;

pub use connect::{connect, connect_with};
pub use error::OutboxError;
pub use id::{EventId, EventIdField, Generation};
pub use interval::{MAX_INTERVAL, statement_timeout_millis};
pub use monitor::Monitor;
pub use schema::migrate::{AppliedMigration, MigrationReport, migrate, migrate_with_app};
pub use schema::table_migrations::TableMigrations;
pub use schema::verify::verify;
pub use schema::{catalog, export};
#[cfg(feature = "kafka")]
pub use sink::broker::kafka;
#[cfg(feature = "nats")]
pub use sink::broker::nats;
#[cfg(feature = "rabbitmq")]
pub use sink::broker::rabbitmq;
pub use sink::message;
pub use spec::{Column, MigrationStep, Outbox, PgQuery, TableSpec};
pub use table::claim::Claim;
pub use table::claiming::{claim, claim_batch};
pub use table::enqueue::{
    Enqueued, enqueue, enqueue_all, enqueue_all_scheduled, enqueue_scheduled,
};
pub use table::extras::Schedule;
pub use table::operations::{discard_dead, prune_sent, requeue_all_dead, requeue_dead, stats};
pub use table::operator::Stats;
pub use table::row::Retried;

/// Re-exported so applications can build their own refinery migrations
/// (`refinery::Migration::unapplied`, `refinery::Runner`) for [`migrate_with_app`].
pub use refinery_core as refinery;

/// What `#[derive(Outbox)]` expands to refers to, through `::outbox::__private`.
#[doc(hidden)]
pub mod __private {
    pub use crate::json;
    pub use crate::spec::{Statements, derive_only_statements, derive_only_table_spec};
    pub use crate::{
        Claim, Column, Enqueued, EventId, EventIdField, MigrationStep, Outbox, OutboxError,
        PgQuery, Schedule, TableMigrations, TableSpec, claim, claim_batch, enqueue, enqueue_all,
        enqueue_all_scheduled, enqueue_scheduled,
    };
    pub use chrono::{DateTime, Utc};
    pub use core::time::Duration;
    pub use outbox_internals::{STATEMENT_STEPS, Statement};
    pub use sqlx::postgres::PgRow;
    pub use sqlx::types::Json;
    pub use sqlx::{self, Acquire, PgExecutor, Postgres, Row};
}
