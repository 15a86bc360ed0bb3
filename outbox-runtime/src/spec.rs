//! What `#[derive(Outbox)]` knows about a table, fixed at expansion time.

use std::time::Duration;

use sqlx::postgres::{PgArguments, PgRow};

/// A query whose arguments are being bound.
pub type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, PgArguments>;

/// The statements of one outbox table. Every one is a `&'static str` produced by the
/// derive, and nothing from a caller reaches the SQL text except through bound
/// parameters; the one exception, the claim's row limit, is an integer (see
/// [`claim_limited`](Self::claim_limited)).
#[derive(Debug)]
pub struct Statements {
    /// `INSERT` of one event, `$1` the event id then one parameter per field, and a
    /// `pg_notify` on the table's name, delivered when the transaction commits.
    pub enqueue: &'static str,
    /// `INSERT` of many events from one array per column (`$1` the event ids), and one
    /// `pg_notify`.
    pub enqueue_all: &'static str,
    /// Claim of up to `$1` rows: due `READY` rows and expired `INPROGRESS` rows, each
    /// branch read from its own partial index and locked with `SKIP LOCKED`; expired
    /// rows over their attempt budget move to `DEAD` in the same statement. Returns
    /// id, event_id, generation, attempts, lease_until, reclaimed, then the payload.
    /// `$1` is its only parameter; it runs as [`claim_limited`](Self::claim_limited).
    pub claim: &'static str,
    /// Guarded `INPROGRESS -> SENT` of (`$1` id, `$2` generation).
    pub complete: &'static str,
    /// Guarded `INPROGRESS -> READY` after `$3` (or `DEAD` when the budget is spent),
    /// `$4` optional error text.
    pub retry: &'static str,
    /// Guarded lease extension of (`$1` id, `$2` generation).
    pub renew: &'static str,
    /// Guarded `INPROGRESS -> DEAD` of (`$1` id, `$2` generation) with `$3` as `last_error`.
    pub fail: &'static str,
    /// Guarded `INPROGRESS -> SENT` of a batch, each row guarded on its own (`$1` ids,
    /// `$2` generations). Returns the ids it recorded.
    pub complete_batch: &'static str,
    /// The outcomes of a batch, each row guarded on its own (`$1`..`$5`: arrays of ids,
    /// generations, outcomes `SENT`/`RETRY`/`DEAD`/`RELEASE`, retry delays, errors).
    /// Returns (id, new status) per recorded row; a row missing there was stale.
    pub record: &'static str,
    /// Guarded lease extension of a batch (`$1` ids, `$2` generations); returns (id, lease).
    pub renew_batch: &'static str,
    /// `DEAD -> READY` with a fresh budget, for the event ids in `$1`; returns the ids.
    pub requeue_dead: &'static str,
    /// `DEAD -> READY` with a fresh budget for every dead row; returns the count.
    pub requeue_all_dead: &'static str,
    /// Deletes up to `$2` `SENT` rows created more than `$1` ago.
    pub prune_sent: &'static str,
    /// Counts per status, expired claims, and the age of the oldest eligible event.
    pub stats: &'static str,
}

impl Statements {
    /// The claim of up to `limit` rows, with the limit written into the text.
    ///
    /// A statement with parameters is planned again on every execution until its
    /// generic plan looks as cheap as the custom ones, which a `LIMIT $1` never does: it
    /// would cost a third of a 100-row claim, every time (measured: 0.3–0.5 ms of
    /// planning per 1.2 ms execution). Without parameters it is planned once per
    /// connection and limit, kept prepared by sqlx, and planned again only when the
    /// table's statistics change.
    #[must_use]
    pub fn claim_limited(&self, limit: u32) -> String {
        self.claim.replace("$1", &limit.to_string())
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

/// Everything the derive knows about one outbox table.
#[derive(Debug)]
pub struct TableSpec {
    /// The table name (a plain lowercase identifier).
    pub table: &'static str,
    /// Name of the refinery history table that keeps this table's own version sequence.
    pub history_table: &'static str,
    /// The lease a claim holds.
    pub lease: Duration,
    /// The default delay before a retried event is due again.
    pub retry_delay: Duration,
    /// How many claims an event may use before it moves to `DEAD`.
    pub max_attempts: i32,
    /// The statements.
    pub sql: Statements,
    /// Every column the table must have, bookkeeping columns included.
    pub columns: &'static [Column],
    /// The migrations, in version order.
    pub migrations: &'static [MigrationStep],
}

/// An event type stored in its own outbox table. Implemented by `#[derive(Outbox)]`;
/// the derive also adds the inherent methods `enqueue`, `claim`, `claim_batch` and
/// `migrations` that delegate to this crate's generic functions.
pub trait Outbox: Sized + Send + Sync + Unpin + 'static {
    /// The table, its statements and its migrations.
    const SPEC: &'static TableSpec;

    /// The stable id of this event, or `None` when the type has no
    /// `#[outbox(event_id)]` field (a UUIDv7 is generated at enqueue).
    fn event_id(&self) -> Option<crate::EventId>;

    /// Binds one parameter per payload column, in column order, after the event id.
    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q>;

    /// Binds one array per payload column, in column order, after the event ids.
    fn bind_all<'q>(events: &'q [Self], query: PgQuery<'q>) -> PgQuery<'q>;

    /// Decodes the payload columns of a claimed row (by column name); `event_id` is the
    /// row's stored id, from which an `#[outbox(event_id)]` field is rebuilt.
    fn decode(row: &PgRow, event_id: &str) -> Result<Self, sqlx::Error>;
}
