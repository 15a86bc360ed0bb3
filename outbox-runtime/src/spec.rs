//! What `#[derive(Outbox)]` knows about a table, fixed at expansion time.

use std::time::Duration;

pub(crate) use outbox_internals::Statement;
use sqlx::postgres::{PgArguments, PgRow};

/// A query whose arguments are being bound.
pub type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

/// The statements of one outbox table, by [`Statement`]. Every one is a `&'static str`
/// produced by the derive, and nothing from a caller reaches the SQL text except through
/// bound parameters; the one exception, the claims' row limit, is an integer (see
/// [`claim_limited`](Self::claim_limited)).
///
/// Not part of the public API: only `#[derive(Outbox)]` builds one, through
/// `__private::derive_only_statements`, because the guards the runtime relies on (the
/// lease, the generation) live in this SQL. Each [`Statement`]'s documentation is its
/// contract: its parameters and its result.
#[doc(hidden)]
#[derive(Debug)]
pub struct Statements {
    texts: [&'static str; Statement::COUNT],
    /// The claims, in pieces between which the row limit is written: the relay's...
    claim: &'static [&'static str],
    /// ... one made by hand (one event per key) ...
    claim_each: &'static [&'static str],
    /// ... and the relay's from a position.
    claim_from: &'static [&'static str],
}

/// Builds the [`Statements`] of a table: for `#[derive(Outbox)]` only, which renders
/// every statement with its guards. Not part of the public API.
#[doc(hidden)]
pub const fn derive_only_statements(
    texts: [&'static str; Statement::COUNT],
    claim: &'static [&'static str],
    claim_each: &'static [&'static str],
    claim_from: &'static [&'static str],
) -> Statements {
    Statements {
        texts,
        claim,
        claim_each,
        claim_from,
    }
}

impl Statements {
    /// The text of `statement`.
    pub const fn get(&self, statement: Statement) -> &'static str {
        self.texts[statement.index()]
    }

    /// The claim of up to `limit` rows, with the limit written into the text.
    ///
    /// A statement with parameters is planned again on every execution until its
    /// generic plan looks as cheap as the custom ones, which a `LIMIT $1` never does: it
    /// would cost a third of a 100-row claim, every time (measured: 0.3–0.5 ms of
    /// planning per 1.2 ms execution). Without parameters it is planned once per
    /// connection and limit, kept prepared by sqlx, and planned again only when the
    /// table's statistics change.
    ///
    /// On a keyed table, `runs` says whether the claim may take runs of a key (its
    /// first event still to go, and the events after it, in the batch's room), as the
    /// relay's do, or one event per key. With runs, it binds the claimer's runs in
    /// flight, as [`Statement::Claim`] says (and runs with generic plans).
    #[must_use]
    pub fn claim_limited(&self, limit: u32, runs: bool) -> String {
        let pieces = if runs { self.claim } else { self.claim_each };
        pieces.join(&limit.to_string())
    }

    /// [`Statement::ClaimFrom`] of up to `limit` rows, written as
    /// [`claim_limited`](Self::claim_limited) writes the claim (with runs).
    #[must_use]
    pub fn claim_from_limited(&self, limit: u32) -> String {
        self.claim_from.join(&limit.to_string())
    }
}

/// `d` truncated to whole microseconds: a PostgreSQL `interval` holds no finer unit,
/// and sqlx refuses to encode a `Duration` with a sub-microsecond remainder (jittered
/// backoff delays nearly always have one).
pub(crate) fn interval(d: Duration) -> Duration {
    Duration::new(d.as_secs(), d.subsec_micros() * 1_000)
}

/// One column the event type expects, used to detect a drifted table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column {
    /// Column name.
    pub name: &'static str,
    /// The type as `format_type()` prints it (`bigint`, `timestamp with time zone`, ...).
    pub sql_type: &'static str,
    /// Whether the column accepts NULL.
    pub nullable: bool,
}

/// One versioned migration of an outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationStep {
    /// The version within this table's own sequence (1, 2, ...).
    pub version: u32,
    /// The refinery name, `V{version}__{description}`.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

/// Everything the derive knows about one outbox table, read through `T::SPEC`.
///
/// Only `#[derive(Outbox)]` builds one: its statements carry the lease and generation
/// guards every outcome relies on, so a hand-written spec could bypass them. Outside
/// this crate it is read-only, through the accessors below.
#[derive(Debug)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent yes/no attributes of the event type, each with its accessor"
)]
pub struct TableSpec {
    /// The table name (a plain lowercase identifier).
    pub(crate) table: &'static str,
    /// Name of the refinery history table that keeps this table's own version sequence.
    pub(crate) history_table: &'static str,
    /// The lease a claim holds.
    pub(crate) lease: Duration,
    /// The default delay before a retried event is due again.
    pub(crate) retry_delay: Duration,
    /// How many claims an event may use before it moves to `DEAD`.
    pub(crate) max_attempts: i32,
    /// The ordering key's column (`#[outbox(key)]`), if the type has one.
    pub(crate) key: Option<&'static str>,
    /// Whether recording `SENT` deletes the row (`#[outbox(delete_sent)]`).
    pub(crate) deletes_sent: bool,
    /// Whether its events may be enqueued for a later time (`#[outbox(scheduled)]`).
    pub(crate) scheduled: bool,
    /// Whether its events keep the trace context they were enqueued in
    /// (`#[outbox(traced)]`).
    pub(crate) traced: bool,
    /// Whether the table keeps a unique index on `event_id` (all but those of
    /// `#[outbox(no_event_id_index)]`, whose ids are generated).
    pub(crate) event_id_unique: bool,
    /// The statements.
    pub(crate) sql: Statements,
    /// Every column the table must have, bookkeeping columns included.
    pub(crate) columns: &'static [Column],
    /// The migrations, in version order.
    pub(crate) migrations: &'static [MigrationStep],
}

/// Builds the [`TableSpec`] of a table: for `#[derive(Outbox)]` only, which validates
/// the names and durations and renders `sql` with its guards. Not part of the public API.
#[doc(hidden)]
#[expect(
    clippy::too_many_arguments,
    clippy::fn_params_excessive_bools,
    reason = "one argument per field, written only by the derive"
)]
pub const fn derive_only_table_spec(
    table: &'static str,
    history_table: &'static str,
    lease: Duration,
    retry_delay: Duration,
    max_attempts: i32,
    key: Option<&'static str>,
    deletes_sent: bool,
    scheduled: bool,
    traced: bool,
    event_id_unique: bool,
    sql: Statements,
    columns: &'static [Column],
    migrations: &'static [MigrationStep],
) -> TableSpec {
    TableSpec {
        table,
        history_table,
        lease,
        retry_delay,
        max_attempts,
        key,
        deletes_sent,
        scheduled,
        traced,
        event_id_unique,
        sql,
        columns,
        migrations,
    }
}

impl TableSpec {
    /// The table name (a plain lowercase identifier), also the `NOTIFY` channel.
    pub const fn table(&self) -> &'static str {
        self.table
    }

    /// Name of the refinery history table that keeps this table's own version sequence.
    pub const fn history_table(&self) -> &'static str {
        self.history_table
    }

    /// The lease a claim holds (`#[outbox(lease = "..")]`, at least one second).
    pub const fn lease(&self) -> Duration {
        self.lease
    }

    /// The default delay before a retried event is due again
    /// (`#[outbox(retry_delay = "..")]`).
    pub const fn retry_delay(&self) -> Duration {
        self.retry_delay
    }

    /// How many claims an event may use before it moves to `DEAD`
    /// (`#[outbox(max_attempts = ..)]`).
    pub const fn max_attempts(&self) -> i32 {
        self.max_attempts
    }

    /// The column of the ordering key (`#[outbox(key)]`), if the type has one: its
    /// events are published in the order they were enqueued, each after the one before.
    pub const fn key(&self) -> Option<&'static str> {
        self.key
    }

    /// Whether recording `SENT` deletes the row (`#[outbox(delete_sent)]`) instead of
    /// keeping it as history.
    pub const fn deletes_sent(&self) -> bool {
        self.deletes_sent
    }

    /// Whether its events may be enqueued for a later time (`#[outbox(scheduled)]`).
    pub const fn scheduled(&self) -> bool {
        self.scheduled
    }

    /// Whether its events keep the trace context they were enqueued in
    /// (`#[outbox(traced)]`).
    pub const fn traced(&self) -> bool {
        self.traced
    }

    /// Whether the table keeps a unique index on `event_id`, which makes enqueue
    /// idempotent on it: every table but those of `#[outbox(no_event_id_index)]`, whose
    /// ids are fresh UUIDv7s.
    pub const fn event_id_unique(&self) -> bool {
        self.event_id_unique
    }

    /// Every column the table must have, bookkeeping columns included.
    pub const fn columns(&self) -> &'static [Column] {
        self.columns
    }

    /// The migrations, in version order.
    pub const fn migrations(&self) -> &'static [MigrationStep] {
        self.migrations
    }

    /// The generated statements, to read (benchmarks, `EXPLAIN`). Not part of the public
    /// API: the runtime's functions and [`Claim`](crate::Claim) are how they are run.
    #[doc(hidden)]
    pub const fn sql(&self) -> &Statements {
        &self.sql
    }
}

/// An event type stored in its own outbox table.
///
/// Implemented only by `#[derive(Outbox)]`; its SQL is generated and guarded. Every
/// outcome a [`Claim`](crate::Claim) records is guarded by the claim's lease and
/// generation in that SQL, so the trait is not to be implemented by hand: the trait has
/// a hidden required item that only the derive writes, and [`TableSpec`] is built only
/// through hidden functions of the derive's (`outbox::__private`, which is not API:
/// code that calls it gets no guarantee, and may break with any release). The derive also adds the inherent methods `enqueue`,
/// `enqueue_all`, `claim`, `claim_batch` and `migrations` that delegate to this crate's
/// generic functions.
pub trait Outbox: Sized + Send + Sync + Unpin + 'static {
    /// The table, its statements and its migrations.
    const SPEC: &'static TableSpec;

    /// Implemented only by `#[derive(Outbox)]`; its SQL is generated and guarded. A
    /// hand-written impl lacks this item and does not compile.
    #[doc(hidden)]
    fn only_derive_is_allowed_to_implement_this_trait();

    /// The stable id of this event, or `None` when the type has no
    /// `#[outbox(event_id)]` field (a UUIDv7 is generated at enqueue).
    fn event_id(&self) -> Option<crate::id::EventId>;

    /// Binds one parameter per payload column, in column order, after the event id.
    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q>;

    /// Binds one array per payload column, in column order, after the event ids.
    fn bind_all<'q>(events: &'q [Self], query: PgQuery<'q>) -> PgQuery<'q>;

    /// Decodes the payload columns of a claimed row (by column name); `event_id` is the
    /// row's stored id, from which an `#[outbox(event_id)]` field is rebuilt.
    fn decode(row: &PgRow, event_id: &str) -> Result<Self, sqlx::Error>;
}
