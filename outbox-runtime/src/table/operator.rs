//! What an operator's statements run on and return: one table's statement texts (the
//! derive's, or the catalog's copies) and its figures.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::postgres::types::PgInterval;

use crate::spec::{Outbox, Statement, Statements, TableSpec};

/// One table's operator statements, from its event type's spec or from the catalog
/// (which `migrate` writes from the same spec): each is run by its function in
/// [`statements`](super::statements), written once for both.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operations<'s> {
    /// The table, which errors name.
    pub(crate) table: &'static str,
    texts: Texts<'s>,
}

/// Where an [`Operations`]' texts come from.
#[derive(Debug, Clone, Copy)]
enum Texts<'s> {
    /// The derive's.
    Spec(&'static Statements),
    /// The catalog's copies, by statement name.
    Kept(&'s BTreeMap<String, String>),
}

impl Operations<'static> {
    /// The statements `T`'s derive wrote.
    pub(crate) fn of<T: Outbox>() -> Self {
        Self::of_spec(T::SPEC)
    }

    /// The statements the derive wrote into `spec`: for callers that hold a table's
    /// spec rather than its type (the monitor, given `T::migrations()`).
    pub(crate) fn of_spec(spec: &'static TableSpec) -> Self {
        Self {
            table: spec.table,
            texts: Texts::Spec(&spec.sql),
        }
    }
}

impl<'s> Operations<'s> {
    /// The copies of `table`'s statements that the catalog keeps, by name.
    pub(crate) fn kept(table: &'static str, statements: &'s BTreeMap<String, String>) -> Self {
        Self {
            table,
            texts: Texts::Kept(statements),
        }
    }

    /// The text of `statement`: the derive's, or the catalog's copy (empty where the
    /// catalog has none; the catalog checks its entries for every statement it keeps).
    pub(crate) fn text(&self, statement: Statement) -> &'s str {
        match self.texts {
            Texts::Spec(sql) => sql.get(statement),
            Texts::Kept(kept) => kept.get(statement.name()).map_or("", String::as_str),
        }
    }
}

/// A snapshot of one outbox table, for dashboards and alerts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Rows waiting for a claim (due or not yet due).
    pub ready: i64,
    /// The `READY` rows that are due: the backlog a relay should be draining.
    pub due: i64,
    /// The `READY` rows enqueued for a later time ([`Schedule`](crate::Schedule)) that
    /// has not come: not in [`due`](Self::due), and not waiting yet (once due, an
    /// event's age counts from its time). Always 0 on a table not declared
    /// `#[outbox(scheduled)]`.
    pub scheduled: i64,
    /// Rows claimed by a publisher, live or expired.
    pub in_progress: i64,
    /// Rows whose publication was recorded.
    pub sent: i64,
    /// Rows that exhausted their budget or failed permanently, waiting for repair.
    pub dead: i64,
    /// Claims whose lease expired: a publisher died or stalled holding them.
    pub expired_claims: i64,
    /// How long ago the oldest event still to be published (`READY` or `INPROGRESS`, the
    /// one with the lowest id; on a scheduled table, the one due first) was enqueued, or
    /// became due if it was enqueued for later; `None` when none is. The lag to alert on:
    /// it grows through an outage, whatever the relay retries or hands back meanwhile.
    /// `DEAD` events are not waiting for the relay but for an operator: they have their
    /// own figures ([`dead`](Self::dead), [`oldest_held_age`](Self::oldest_held_age)).
    pub oldest_waiting_age: Option<Duration>,
    /// That oldest waiting event's `last_error`: why it is still waiting, once a relay
    /// tried it (`destination unavailable: ..` through an outage, which the relay
    /// writes when it hands events back, or a transient failure's reason). `None` when
    /// no relay recorded a failure for it: not tried yet, or no relay runs.
    pub oldest_waiting_error: Option<String>,
    /// Ordering keys held back by a `DEAD` event (a type with `#[outbox(key)]`, unless
    /// it says `dead_releases_key`): their later events wait for an operator to requeue
    /// or discard it.
    pub held_keys: i64,
    /// How long ago the oldest `DEAD` event holding back a key was enqueued; `None` when
    /// no key is held.
    pub oldest_held_age: Option<Duration>,
    /// Events recorded `SENT` in the last minute: the publish rate. `None` for a
    /// `delete_sent` table, whose sent events leave no row behind.
    pub sent_last_minute: Option<i64>,
}

/// `timestamptz - timestamptz` has no months; a negative interval (clock skew) is zero,
/// an infinite one (PostgreSQL 17's) the longest.
pub(crate) fn interval_to_duration(i: PgInterval) -> Duration {
    let micros = i64::from(i.days)
        .saturating_mul(86_400_000_000)
        .saturating_add(i.microseconds);
    Duration::from_micros(micros.max(0).unsigned_abs())
}
