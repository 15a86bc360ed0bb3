//! The migrations of one outbox table, as the derive hands them to
//! [`migrate`](crate::migrate).

use crate::spec::{Outbox, TableSpec};

/// The migrations of one outbox table, as returned by the derived `T::migrations()`.
#[derive(Debug, Clone, Copy)]
pub struct TableMigrations {
    pub(crate) spec: &'static TableSpec,
    pub(crate) type_name: &'static str,
}

impl TableMigrations {
    /// The migrations of `T`'s table.
    pub fn of<T: Outbox>() -> Self {
        Self {
            spec: T::SPEC,
            type_name: std::any::type_name::<T>(),
        }
    }

    /// The event type stored in the table, as `std::any::type_name` spells it.
    pub fn type_name(&self) -> &'static str {
        self.type_name
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
