//! Every failure a caller can cause, as one enum with context.

use crate::id::Generation;

/// The error type of every fallible operation in this crate.
#[derive(Debug, thiserror::Error)]
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

    /// A migration failed, or an applied migration was edited since it ran.
    #[error("migrating `{target}` failed: {source}")]
    Migration {
        /// The outbox table (or `application` for the application's own migrations).
        target: String,
        /// What refinery reported (a checksum divergence names both versions).
        #[source]
        source: refinery_core::Error,
    },

    /// A migration that already ran was edited since: its name or SQL no longer matches
    /// the checksum recorded in the history table. Nothing was applied; restore the
    /// migration as it ran and put the change in a new version.
    #[error(
        "migration {version} of `{target}` was edited after it was applied: the database ran `{applied}`, the code now has `{current}` with a different name or SQL; restore it and add a new migration instead"
    )]
    MigrationDiverged {
        /// The outbox table (or `application` for the application's own migrations).
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

    /// An event with this id is already in the table: the `event_id` column is unique,
    /// so enqueueing the same logical event twice is refused rather than duplicated.
    #[error("event {event_id} is already in `{table}`")]
    DuplicateEvent {
        /// The outbox table.
        table: &'static str,
        /// The id that was enqueued twice.
        event_id: String,
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

    /// Any other database error: connection lost, pool timed out, bad URL, ...
    #[error("database error on `{table}`: {source}")]
    Database {
        /// The outbox table the statement ran against.
        table: &'static str,
        /// What sqlx reported.
        #[source]
        source: sqlx::Error,
    },
}

impl OutboxError {
    /// Classifies a sqlx error raised by a statement on `table`.
    pub(crate) fn from_sqlx(table: &'static str, source: sqlx::Error) -> Self {
        const UNDEFINED_TABLE: &str = "42P01";
        const UNDEFINED_COLUMN: &str = "42703";
        const DATATYPE_MISMATCH: &str = "42804";
        const UNIQUE_VIOLATION: &str = "23505";
        match sqlstate(&source).as_deref() {
            Some(UNDEFINED_TABLE) => Self::MissingTable { table, source },
            // The only unique constraints of an outbox table are the id and event_id.
            Some(UNIQUE_VIOLATION) => Self::DuplicateEvent {
                table,
                event_id: duplicate_key(&source).unwrap_or_default(),
            },
            Some(UNDEFINED_COLUMN | DATATYPE_MISMATCH) => Self::Drift {
                table,
                details: source.to_string(),
            },
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
}

/// The value PostgreSQL names in a unique violation's detail: `Key (event_id)=(x) already exists.`
fn duplicate_key(error: &sqlx::Error) -> Option<String> {
    let detail = error
        .as_database_error()?
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?
        .detail()?;
    let start = detail.find(")=(")? + 3;
    let end = detail.rfind(") already exists")?;
    detail.get(start..end).map(str::to_owned)
}

/// The SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error
        .as_database_error()
        .and_then(sqlx::error::DatabaseError::code)
        .map(std::borrow::Cow::into_owned)
}
