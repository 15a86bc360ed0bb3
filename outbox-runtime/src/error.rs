//! Every failure a caller can cause, as one enum with context, and which of them are
//! worth retrying.

use std::time::Duration;

use crate::id::Generation;

/// The error type of every fallible operation in this crate.
///
/// # Transient or fatal
///
/// [`is_transient`](Self::is_transient) says whether the same call can succeed later
/// without anyone changing anything. The relay retries transient errors with backoff
/// and stops at the first fatal one, so a misconfigured publisher fails at once
/// instead of logging forever:
///
/// | transient: a restart, failover, network blip or overload explains it | fatal: a person must change something |
/// |---|---|
/// | connection refused, reset or lost; pool timed out | authentication failed, unknown role or database ([`Connect`](Self::Connect)) |
/// | SQLSTATE class `08` (connection), `40` (serialization failure, deadlock), `53` (too many connections, out of memory or disk), `57` (server shut down, query cancelled; not `57P04` database dropped), `58` (I/O error) | [`PermissionDenied`](Self::PermissionDenied), [`MissingTable`](Self::MissingTable), [`Drift`](Self::Drift) (an undefined or retyped column) |
/// | `55P03` lock not available, `25006` read-only transaction (a failover in progress), `25P03` idle-in-transaction timeout, `25P04` transaction timeout (PostgreSQL 17) | every other SQLSTATE: a constraint, a trigger raising, a syntax or data error would fail the same way again |
/// | | TLS, configuration, a closed pool; encoding errors; migration errors |
///
/// [`Stale`](Self::Stale) is neither: it is the answer, not a failure (the claim is no
/// longer yours; never retry the outcome).
///
/// Its `Debug` form is its message, causes included: what a `main` returning
/// `Result<(), Box<dyn Error>>` prints for it.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The ownership guard matched nothing: the claim's lease expired, or another
    /// publisher claimed the row since (a newer generation), or the row is no longer
    /// `INPROGRESS`. The outcome was **not** recorded; never follow this with an
    /// unguarded update.
    #[error(
        "stale claim on `{table}` row {id} (generation {generation}): the lease expired or a newer generation owns the row; outcome not recorded"
    )]
    Stale {
        /// The outbox table.
        table: &'static str,
        /// The row id.
        id: i64,
        /// The generation the caller held.
        generation: Generation,
    },

    /// A claimed row's payload could not be decoded into the event type. The row was
    /// moved to `DEAD` with the decoding error in `last_error`, so it is neither lost
    /// nor retried forever.
    #[error("cannot decode `{table}` row {id} (event {event_id}); it was moved to DEAD: {source}")]
    Decode {
        /// The outbox table.
        table: &'static str,
        /// The row id.
        id: i64,
        /// The stable event id of the row.
        event_id: String,
        /// What sqlx reported.
        #[source]
        source: sqlx::Error,
    },

    /// The outbox table does not exist: run [`migrate`](crate::migrate) at startup.
    #[error("outbox table `{table}` does not exist; run outbox::migrate at startup")]
    MissingTable {
        /// The outbox table.
        table: &'static str,
        /// What PostgreSQL reported.
        #[source]
        source: sqlx::Error,
    },

    /// The table exists but does not have the shape the event type expects.
    #[error("outbox table `{table}` has drifted from the event type: {details}")]
    Drift {
        /// The outbox table.
        table: &'static str,
        /// Which columns differ, and how.
        details: String,
    },

    /// The database role lacks a privilege the statement needs (SQLSTATE `42501`).
    /// `outbox::migrate` needs `CREATE` on the schema; enqueueing needs `INSERT`; the
    /// relay needs `SELECT` and `UPDATE` on the table.
    #[error("permission denied on `{table}`: {source}; grant the role what it needs")]
    PermissionDenied {
        /// The outbox table.
        table: &'static str,
        /// What PostgreSQL reported.
        #[source]
        source: sqlx::Error,
    },

    /// No connection could be opened: the server refused or did not answer, or it
    /// refused the credentials or the database name.
    #[error("cannot connect to PostgreSQL at {endpoint}{}: {source}", for_target(.target))]
    Connect {
        /// The outbox table or operation that needed the connection; empty for a new
        /// pool's first connection ([`connect`](crate::connect())).
        target: String,
        /// Where: `host:port/database as user` (no password).
        endpoint: String,
        /// What the connection attempt reported.
        #[source]
        source: sqlx::Error,
    },

    /// A database URL that does not parse (given to [`connect`](crate::connect())). The
    /// URL is not repeated: it may hold a password.
    #[error(
        "invalid database URL (expected postgres://user:password@host:port/database): {source}"
    )]
    InvalidUrl {
        /// What sqlx reported.
        #[source]
        source: sqlx::Error,
    },

    /// A migration failed.
    #[error("migrating `{target}` failed: {source}")]
    Migration {
        /// The outbox table (or `application` for the application's own migrations).
        target: String,
        /// What refinery reported.
        #[source]
        source: refinery_core::Error,
    },

    /// One of the application's own migrations that already ran was edited since: its
    /// name or SQL no longer matches the checksum recorded in the history table.
    /// Nothing was applied; restore the migration as it ran and put the change in a new
    /// version.
    #[error(
        "migration {version} of `{target}` was edited after it was applied: the database ran `{applied}`, the code now has `{current}` with a different name or SQL; restore it and add a new migration instead"
    )]
    MigrationDiverged {
        /// `application`.
        target: String,
        /// The version that diverged.
        version: i64,
        /// The migration as recorded in the history table (`V{version}__{name}`).
        applied: String,
        /// The migration as the code declares it now.
        current: String,
        /// What refinery reported.
        #[source]
        source: refinery_core::Error,
    },

    /// The event type's fields changed in a way its table cannot follow: a field was
    /// added without `since`, or removed, renamed, retyped or reordered, so the
    /// migration that created (or extended) the table is no longer the one that ran.
    /// Nothing was applied.
    #[error(
        "the event type stored in `{table}` changed since its table was created (migration {version} no longer matches what ran): {changes}. \
         An outbox table only grows: add a field as an `Option<_>` with #[outbox(since = N)], N being the next version; \
         never remove, rename, retype or reorder a field. To change an event's shape, declare a new event type with its own table, \
         and drop the old table once its relay has drained it"
    )]
    EventTypeChanged {
        /// The outbox table.
        table: &'static str,
        /// The migration version that no longer matches.
        version: i64,
        /// What differs between the table and the event type, as far as the columns tell.
        changes: String,
    },

    /// The catalog of the schema has no outbox table of this name: `outbox::migrate`
    /// never ran for it there (or under another `search_path`).
    #[error("no outbox table `{table}` in the catalog of this schema{}", known_tables(.known))]
    UnknownTable {
        /// The table asked for.
        table: String,
        /// The tables the catalog lists.
        known: Vec<String>,
    },

    /// A catalog entry that does not match its table (see
    /// [`CatalogEntry::problem`](crate::catalog::CatalogEntry::problem)): nothing was run.
    #[error("the catalog entry of `{table}` cannot be used: {problem}")]
    CatalogEntryInvalid {
        /// The outbox table.
        table: &'static str,
        /// What is wrong.
        problem: String,
    },

    /// An event id that cannot be stored: empty, blank, longer than
    /// [`EventId::MAX_LEN`](crate::EventId::MAX_LEN) bytes, or containing a NUL
    /// character. Nothing was written.
    #[error("invalid event id for `{table}` ({event_id:?}): {reason}")]
    InvalidEventId {
        /// The outbox table.
        table: &'static str,
        /// The id, shortened to its first 64 characters when longer.
        event_id: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A delay or age outside what the outbox stores (at most
    /// [`MAX_INTERVAL`](crate::MAX_INTERVAL), about 1,000 years). Nothing was written.
    #[error(
        "{what} of {value:?} on `{table}` is out of range: at most {max:?} (about 1,000 years)"
    )]
    IntervalOutOfRange {
        /// The outbox table.
        table: &'static str,
        /// Which argument: `retry delay`, `prune age`, ...
        what: &'static str,
        /// The value given.
        value: Duration,
        /// The largest value accepted.
        max: Duration,
    },

    /// An event was given a later time ([`Schedule`](crate::Schedule)) on a table not
    /// declared `#[outbox(scheduled)]`, which has no column to keep it. Nothing was
    /// written.
    #[error(
        "`{table}` takes no schedule: declare its event type `#[outbox(scheduled)]` (or \
         `#[outbox(scheduled(since = N))]` on an existing table) to enqueue events for later"
    )]
    NotScheduled {
        /// The outbox table.
        table: &'static str,
    },

    /// An event could not be encoded for the database (e.g. a `#[outbox(json)]` field
    /// whose `Serialize` implementation failed).
    #[error("cannot encode an event for `{table}`: {source}")]
    Encode {
        /// The outbox table.
        table: &'static str,
        /// What the encoder reported.
        #[source]
        source: sqlx::error::BoxDynError,
    },

    /// Any other database error: connection lost, pool timed out, a constraint, ...
    /// See [`is_transient`](Self::is_transient).
    #[error("database error on `{table}`: {source}")]
    Database {
        /// The outbox table the statement ran against.
        table: &'static str,
        /// What sqlx reported.
        #[source]
        source: sqlx::Error,
    },
}

/// The message: every variant's says what happened, where, and the cause (or what to
/// do), where a derived `Debug` would print nested structs (`MissingTable { table: ..,
/// source: Database(PgDatabaseError { .. }) }`).
impl std::fmt::Debug for OutboxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// A sqlx result as the outbox reports it: the one place a `sqlx::Error` becomes an
/// [`OutboxError`], classified ([`OutboxError::from_sqlx`]) for the table its statement
/// ran on (or the target, such as `outbox::migrate`, that errors name instead).
pub(crate) trait OnTable<T> {
    /// This result, its error classified for `table`.
    fn on_table(self, table: &'static str) -> Result<T, OutboxError>;
}

impl<T> OnTable<T> for Result<T, sqlx::Error> {
    fn on_table(self, table: &'static str) -> Result<T, OutboxError> {
        self.map_err(|source| OutboxError::from_sqlx(table, source))
    }
}

impl OutboxError {
    /// Classifies a sqlx error raised by a statement on `table` (through [`OnTable`]).
    fn from_sqlx(table: &'static str, source: sqlx::Error) -> Self {
        const UNDEFINED_TABLE: &str = "42P01";
        const UNDEFINED_COLUMN: &str = "42703";
        const DATATYPE_MISMATCH: &str = "42804";
        const INSUFFICIENT_PRIVILEGE: &str = "42501";
        let code = sqlstate(&source).map(std::borrow::Cow::into_owned);
        match code.as_deref() {
            Some(UNDEFINED_TABLE) => Self::MissingTable { table, source },
            Some(UNDEFINED_COLUMN | DATATYPE_MISMATCH) => Self::Drift {
                table,
                details: source.to_string(),
            },
            Some(INSUFFICIENT_PRIVILEGE) => Self::PermissionDenied { table, source },
            _ => match source {
                sqlx::Error::Encode(source) => Self::Encode { table, source },
                source => Self::Database { table, source },
            },
        }
    }

    /// Whether this is a [`Stale`](Self::Stale) rejection.
    pub fn is_stale(&self) -> bool {
        matches!(self, Self::Stale { .. })
    }

    /// Whether the same call can succeed later with nothing changed: a lost or refused
    /// connection, a server restarting or overloaded, a deadlock. Everything else needs
    /// a person (see the table on [`OutboxError`]). `Stale` is not transient: retrying
    /// a stale outcome can never succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { source, .. } | Self::Database { source, .. } => is_transient(source),
            _ => false,
        }
    }
}

fn for_target(target: &str) -> String {
    if target.is_empty() {
        String::new()
    } else {
        format!(" (for `{target}`)")
    }
}

fn known_tables(known: &[String]) -> String {
    if known.is_empty() {
        "; it lists none: run outbox::migrate (a build of the application) against it first"
            .to_owned()
    } else {
        format!("; it lists {}", known.join(", "))
    }
}

/// The transient half of the table on [`OutboxError`].
pub(crate) fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            let class = code.get(..2).unwrap_or_default();
            (matches!(class, "08" | "40" | "53" | "57" | "58") && code != "57P04")
                || matches!(code.as_ref(), "55P03" | "25006" | "25P03" | "25P04")
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// The longest `last_error` kept, in bytes: a reason, not a log.
pub(crate) const MAX_REASON: usize = 4096;

/// `reason` as a `text` column can hold it: without NUL characters, which PostgreSQL
/// refuses (a sink's error text is not ours to trust), and cut at [`MAX_REASON`] bytes.
pub(crate) fn storable_reason(reason: &str) -> std::borrow::Cow<'_, str> {
    if reason.len() <= MAX_REASON && !reason.contains('\0') {
        return std::borrow::Cow::Borrowed(reason);
    }
    let mut kept: String = reason.chars().filter(|&c| c != '\0').collect();
    if kept.len() > MAX_REASON {
        let mut end = MAX_REASON - 3;
        while !kept.is_char_boundary(end) {
            end -= 1;
        }
        kept.truncate(end);
        kept.push_str("...");
    }
    std::borrow::Cow::Owned(kept)
}

/// `reason` with every non-ASCII character escaped (`☃` as `\u{2603}`): what a
/// database whose encoding is neither UTF-8 nor SQL_ASCII can store of it.
pub(crate) fn ascii_reason(reason: String) -> String {
    if reason.is_ascii() {
        return reason;
    }
    let mut ascii = String::with_capacity(reason.len() + 8);
    for c in reason.chars() {
        if c.is_ascii() {
            ascii.push(c);
        } else {
            ascii.extend(c.escape_unicode());
        }
    }
    ascii
}

/// The SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(error: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    error.as_database_error()?.code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_connections_are_transient_and_configuration_is_fatal() {
        let io = |kind| sqlx::Error::Io(std::io::Error::from(kind));
        assert!(is_transient(&io(std::io::ErrorKind::ConnectionRefused)));
        assert!(is_transient(&io(std::io::ErrorKind::ConnectionReset)));
        assert!(is_transient(&sqlx::Error::PoolTimedOut));
        assert!(!is_transient(&sqlx::Error::PoolClosed));
        assert!(!is_transient(&sqlx::Error::Configuration("bad url".into())));
        assert!(!is_transient(&sqlx::Error::Tls("bad certificate".into())));
        let stale = OutboxError::Stale {
            table: "t",
            id: 1,
            generation: Generation::new(1),
        };
        assert!(!stale.is_transient());
    }

    #[test]
    fn debug_is_the_message() {
        let missing = OutboxError::MissingTable {
            table: "order_events",
            source: sqlx::Error::RowNotFound,
        };
        assert_eq!(
            format!("{missing:?}"),
            "outbox table `order_events` does not exist; run outbox::migrate at startup"
        );
        let boxed: Box<dyn std::error::Error> = Box::new(missing);
        assert_eq!(
            format!("{boxed:?}"),
            boxed.to_string(),
            "as `main` prints it"
        );
    }

    #[test]
    fn a_reason_for_a_database_that_is_not_utf8_escapes_what_is_not_ascii() {
        assert_eq!(ascii_reason("refused".into()), "refused");
        assert_eq!(
            ascii_reason("colis refusé ☃".into()),
            "colis refus\\u{e9} \\u{2603}"
        );
    }

    #[test]
    fn a_reason_is_stored_without_nul_and_at_most_4_kb() {
        assert_eq!(storable_reason("broker down"), "broker down");
        assert_eq!(storable_reason("a\0b"), "ab");
        let long = "é".repeat(3_000);
        let kept = storable_reason(&long);
        assert!(
            kept.len() <= MAX_REASON && kept.ends_with("..."),
            "{}",
            kept.len()
        );
    }
}
