//! Startup migrations through refinery over a sqlx connection. (Being written.)

use sqlx::PgPool;

use crate::error::OutboxError;
use crate::spec::{Outbox, TableSpec};

/// The migrations of one outbox table, as returned by the derived `T::migrations()`.
#[derive(Debug, Clone, Copy)]
pub struct TableMigrations {
    spec: &'static TableSpec,
}

impl TableMigrations {
    /// The migrations of `T`'s table.
    pub fn of<T: Outbox>() -> Self {
        Self { spec: T::SPEC }
    }

    /// The outbox table these migrations create and evolve.
    pub fn table(&self) -> &'static str {
        self.spec.table
    }

    /// The table's spec.
    pub fn spec(&self) -> &'static TableSpec {
        self.spec
    }
}

/// Runs the migrations of every table in `tables`. Idempotent.
pub async fn migrate(pool: &PgPool, tables: &[TableMigrations]) -> Result<(), OutboxError> {
    let _ = (pool, tables);
    todo!()
}

/// Runs the application's own refinery migrations, then the outbox tables'.
pub async fn migrate_with_app(
    pool: &PgPool,
    app: &refinery_core::Runner,
    tables: &[TableMigrations],
) -> Result<(), OutboxError> {
    let _ = (pool, app, tables);
    todo!()
}
