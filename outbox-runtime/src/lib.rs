//! The runtime of the [`outbox`](https://docs.rs/outbox) crate: the claim token, the
//! errors, the generic statements behind `#[derive(Outbox)]`, and the migration runner.
//!
//! Users depend on the `outbox` facade, which re-exports everything here.

mod claim;
mod error;
mod id;
mod migrate;
mod spec;
#[cfg(feature = "testing")]
pub mod testing;

pub use claim::{Claim, Retried, claim, claim_batch, enqueue};
pub use error::OutboxError;
pub use id::{EventId, EventIdField, Generation};
pub use migrate::{TableMigrations, migrate, migrate_with_app};
pub use spec::{Column, MigrationStep, Outbox, PgQuery, Statements, TableSpec};

/// Re-exported so applications can build their own refinery migrations
/// (`refinery::Migration::unapplied`, `refinery::Runner`) for [`migrate_with_app`].
pub use refinery_core as refinery;
