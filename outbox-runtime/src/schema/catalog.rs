//! The catalog of a schema's outbox tables: what [`migrate`](crate::migrate) knows about
//! each one, kept in the database so that tools without the application's Rust types
//! (the `outbox` command line and its dashboard) find every table, its settings, and
//! the guarded statements that repair it.
//!
//! # Why it cannot drift from the tables
//!
//! - Only `migrate` writes it: under its advisory lock, for each table right after that
//!   table's migrations ran and its columns were checked, from the same spec the
//!   migrations came from. An entry never describes a table its own build did not just
//!   verify.
//! - An entry only moves forward: a build that knows fewer versions of a table than the
//!   entry records (an old replica during a rolling deploy) leaves it alone.
//! - Whoever reads an entry checks it against the live table (see
//!   [`CatalogEntry::problem`]): a dropped table, a table migrated further by a build
//!   that did not write the catalog, or an entry of an unknown format is reported,
//!   and its statements are not run.
//!
//! The statements an entry keeps are the derive's own text, byte for byte, so the
//! command line's `requeue` is the library's [`requeue_dead`](crate::requeue_dead)
//! with every guard. They run with the privileges of whoever runs the tool: the catalog
//! is owned by the role that owns the outbox tables, which could already run code as
//! that operator with a trigger on its own table, so it trusts no one new.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use refinery_core::Runner;
use sqlx::postgres::types::PgInterval;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, PgConnection, PgExecutor, PgPool, Row};

use super::grants::{Target, grants};
use super::runner::own_runner;
use super::table_migrations::TableMigrations;
use crate::error::{OnTable as _, OutboxError};
use crate::id::EventId;
use crate::spec::Statement;
use crate::table::operator::{Operations, Stats, interval_to_duration};
use crate::table::statements;

pub use super::grants::{Roles, grants_for};

/// The catalog table, in the schema of the outbox tables it lists.
pub const TABLE: &str = outbox_internals::CATALOG_TABLE;

/// The refinery history table of the catalog's own migrations.
pub(crate) const HISTORY_TABLE: &str = "_outbox_history_outbox_catalog";

/// The shape of an entry's `statements`: a reader of another format runs none of them.
const FORMAT: i32 = 1;

/// The statements an entry keeps: the operator's.
const KEPT: [Statement; 5] = [
    Statement::Stats,
    Statement::RequeueDead,
    Statement::RequeueAllDead,
    Statement::DiscardDead,
    Statement::PruneSent,
];

const MIGRATIONS: [(&str, &str); 1] = [(
    "V1__create_outbox_catalog",
    "CREATE TABLE outbox_catalog (
    table_name text COLLATE \"C\" PRIMARY KEY,
    type_name text NOT NULL,
    history_table text NOT NULL,
    version integer NOT NULL,
    lease interval NOT NULL,
    retry_delay interval NOT NULL,
    max_attempts integer NOT NULL,
    key_column text,
    deletes_sent boolean NOT NULL,
    format integer NOT NULL,
    statements jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT statement_timestamp()
);
",
)];

/// Writes an entry unless a build that knows more versions wrote it, and only when
/// something changed (a restart writes nothing).
const RECORD: &str = "\
    INSERT INTO outbox_catalog AS c (table_name, type_name, history_table, version, lease, \
        retry_delay, max_attempts, key_column, deletes_sent, format, statements) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
    ON CONFLICT (table_name) DO UPDATE SET type_name = EXCLUDED.type_name, \
        history_table = EXCLUDED.history_table, version = EXCLUDED.version, \
        lease = EXCLUDED.lease, retry_delay = EXCLUDED.retry_delay, \
        max_attempts = EXCLUDED.max_attempts, key_column = EXCLUDED.key_column, \
        deletes_sent = EXCLUDED.deletes_sent, format = EXCLUDED.format, \
        statements = EXCLUDED.statements, updated_at = statement_timestamp() \
    WHERE c.version <= EXCLUDED.version \
        AND (c.type_name, c.history_table, c.version, c.lease, c.retry_delay, c.max_attempts, \
             c.key_column, c.deletes_sent, c.format, c.statements) \
        IS DISTINCT FROM (EXCLUDED.type_name, EXCLUDED.history_table, EXCLUDED.version, \
             EXCLUDED.lease, EXCLUDED.retry_delay, EXCLUDED.max_attempts, EXCLUDED.key_column, \
             EXCLUDED.deletes_sent, EXCLUDED.format, EXCLUDED.statements)";

const ENTRIES: &str = "\
    SELECT table_name, type_name, history_table, version, lease, retry_delay, max_attempts, \
        key_column, deletes_sent, format, statements, \
        to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS updated_at, \
        (SELECT n.nspname FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace \
            WHERE r.oid = to_regclass(quote_ident(table_name))) AS table_schema, \
        (SELECT n.nspname FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace \
            WHERE r.oid = 'outbox_catalog'::regclass) AS schema \
    FROM outbox_catalog";

/// The catalog's runner: its own table and history, through `migrate`'s lock.
pub(crate) fn runner() -> Result<Runner, OutboxError> {
    own_runner(TABLE, HISTORY_TABLE, &MIGRATIONS)
}

/// Records `table` in the catalog; `migrate` calls it under its lock, once the table's
/// migrations ran and its columns were checked.
pub(crate) async fn record(
    conn: &mut PgConnection,
    table: &TableMigrations,
) -> Result<(), OutboxError> {
    let spec = table.spec();
    let statements: BTreeMap<&str, &str> =
        KEPT.iter().map(|&s| (s.name(), spec.sql.get(s))).collect();
    let version = spec.migrations.iter().map(|m| m.version).max().unwrap_or(0);
    sqlx::query(RECORD)
        .bind(spec.table)
        .bind(table.type_name())
        .bind(spec.history_table)
        .bind(i64::from(version))
        .bind(crate::spec::interval(spec.lease))
        .bind(crate::spec::interval(spec.retry_delay))
        .bind(spec.max_attempts)
        .bind(spec.key)
        .bind(spec.deletes_sent)
        .bind(FORMAT)
        .bind(Json(statements))
        .execute(conn)
        .await
        .on_table(TABLE)?;
    Ok(())
}

/// One outbox table as the catalog describes it: its settings, its state of health
/// ([`problem`](Self::problem)), and the operations an operator runs on it, with the
/// derive's guarded statements.
#[derive(Debug, Clone)]
pub struct CatalogEntry {
    table: &'static str,
    schema: String,
    type_name: String,
    history_table: String,
    version: i32,
    lease: Duration,
    retry_delay: Duration,
    max_attempts: i32,
    key: Option<String>,
    deletes_sent: bool,
    updated_at: String,
    statements: BTreeMap<String, String>,
    problem: Option<String>,
}

/// Every outbox table in the catalog of the connection's schema (the first
/// `outbox_catalog` on its `search_path`), by name, each checked against its live table
/// (which must be the one its name finds in that schema). An empty list when `migrate` never
/// ran there.
pub async fn tables(pool: &PgPool) -> Result<Vec<CatalogEntry>, OutboxError> {
    let mut conn = crate::connect::acquire(pool, TABLE).await?;
    let present: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(TABLE)
        .fetch_one(&mut *conn)
        .await
        .on_table(TABLE)?;
    if !present {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(AssertSqlSafe(format!("{ENTRIES} ORDER BY table_name")))
        .fetch_all(&mut *conn)
        .await
        .on_table(TABLE)?;
    let mut entries = Vec::with_capacity(rows.len());
    for row in &rows {
        let (mut entry, table_schema) = CatalogEntry::decode(row).on_table(TABLE)?;
        entry.problem = entry.check(&mut conn, table_schema.as_deref()).await?;
        entries.push(entry);
    }
    Ok(entries)
}

/// The catalog entry of `table`: [`OutboxError::UnknownTable`] (naming the tables there
/// are) when the catalog has none.
pub async fn table(pool: &PgPool, table: &str) -> Result<CatalogEntry, OutboxError> {
    let mut entries = tables(pool).await?;
    match entries.iter().position(|e| e.table == table) {
        Some(i) => Ok(entries.swap_remove(i)),
        None => Err(OutboxError::UnknownTable {
            table: table.to_owned(),
            known: entries.iter().map(|e| e.table.to_owned()).collect(),
        }),
    }
}

impl CatalogEntry {
    /// The entry, and the schema its table's name resolves to (`None`: no such table).
    fn decode(row: &sqlx::postgres::PgRow) -> Result<(Self, Option<String>), sqlx::Error> {
        let lease: PgInterval = row.try_get("lease")?;
        let retry_delay: PgInterval = row.try_get("retry_delay")?;
        let format: i32 = row.try_get("format")?;
        let Json(statements): Json<BTreeMap<String, String>> = row.try_get("statements")?;
        let table: String = row.try_get("table_name")?;
        let entry = Self {
            table: intern(table),
            schema: row.try_get("schema")?,
            type_name: row.try_get("type_name")?,
            history_table: row.try_get("history_table")?,
            version: row.try_get("version")?,
            lease: interval_to_duration(lease),
            retry_delay: interval_to_duration(retry_delay),
            max_attempts: row.try_get("max_attempts")?,
            key: row.try_get("key_column")?,
            deletes_sent: row.try_get("deletes_sent")?,
            updated_at: row.try_get("updated_at")?,
            statements,
            problem: (format != FORMAT).then(|| {
                format!(
                    "written by a version of the outbox crate with catalog format {format} \
                     (this one reads {FORMAT}); run outbox::migrate with this version"
                )
            }),
        };
        Ok((entry, row.try_get("table_schema")?))
    }

    /// What is wrong with this entry, checked against the database, its table's name
    /// resolving to `table_schema`.
    async fn check(
        &self,
        conn: &mut PgConnection,
        table_schema: Option<&str>,
    ) -> Result<Option<String>, OutboxError> {
        if self.problem.is_some() {
            return Ok(self.problem.clone());
        }
        let Some(table_schema) = table_schema else {
            return Ok(Some(format!(
                "the table does not exist (dropped after outbox::migrate recorded version {})",
                self.version
            )));
        };
        // The statements name the table unqualified, as the application's do: they act on
        // whichever table the search_path finds first, which must be the catalog's own.
        if table_schema != self.schema {
            return Ok(Some(format!(
                "the name resolves to `{table_schema}.{table}`, while the catalog is in schema \
                 `{schema}`: put `{schema}` first in the search_path (--schema {schema})",
                table = self.table,
                schema = self.schema,
            )));
        }
        let names_ok = [
            Some(self.table),
            Some(self.history_table.as_str()),
            self.key.as_deref(),
        ]
        .into_iter()
        .flatten()
        .all(|name| {
            outbox_internals::is_plain_identifier(name)
                && name.len() <= outbox_internals::MAX_IDENTIFIER
        });
        if !names_ok {
            return Ok(Some(
                "the entry names a table or column that outbox::migrate could not have written"
                    .to_owned(),
            ));
        }
        if let Some(missing) = KEPT
            .iter()
            .find(|s| !self.statements.contains_key(s.name()))
        {
            return Ok(Some(format!(
                "the entry lacks the `{}` statement; run outbox::migrate with this version",
                missing.name()
            )));
        }
        // int8: the column is refinery's `int4`, or `int8` with its `int8-versions` feature.
        let applied: Option<i64> = match sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max(version)::int8 FROM \"{}\"",
            self.history_table
        )))
        .fetch_one(conn)
        .await
        .on_table(self.table)
        {
            Ok(applied) => applied,
            Err(error) if error.is_transient() => return Err(error),
            // This entry's, not the catalog's: a role without this table's grants yet
            // (a new event type) still reads and repairs the others.
            Err(error) => {
                return Ok(Some(format!(
                    "cannot read its migration history `{}`: {error}",
                    self.history_table
                )));
            }
        };
        Ok(match applied {
            Some(applied) if applied > i64::from(self.version) => Some(format!(
                "the table is at migration version {applied}, the catalog describes version {}: \
                 a build of an older outbox crate migrated it; run outbox::migrate with a current build",
                self.version
            )),
            _ => None,
        })
    }

    /// The table name.
    pub fn table(&self) -> &'static str {
        self.table
    }

    /// The catalog's schema, which is the table's unless [`problem`](Self::problem) says
    /// otherwise.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The Rust type stored in the table, as `std::any::type_name` spelled it for the
    /// build that migrated it last.
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    /// The refinery history table of the table's migrations.
    pub fn history_table(&self) -> &str {
        &self.history_table
    }

    /// The table's migration version, as of the build that migrated it last.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// The lease a claim holds.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The default delay before a retried event is due again.
    pub fn retry_delay(&self) -> Duration {
        self.retry_delay
    }

    /// How many claims an event may use before it moves to `DEAD`.
    pub fn max_attempts(&self) -> i32 {
        self.max_attempts
    }

    /// The ordering key's column, if the type has one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// Whether recording `SENT` deletes the row.
    pub fn deletes_sent(&self) -> bool {
        self.deletes_sent
    }

    /// When `migrate` last changed this entry (UTC, RFC 3339).
    pub fn updated_at(&self) -> &str {
        &self.updated_at
    }

    /// Why this entry cannot be trusted, or `None` when it matches its table. The
    /// operations below refuse to run on an entry with a problem
    /// ([`OutboxError::CatalogEntryInvalid`]).
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    fn operations(&self) -> Result<Operations<'_>, OutboxError> {
        if let Some(problem) = &self.problem {
            return Err(OutboxError::CatalogEntryInvalid {
                table: self.table,
                problem: problem.clone(),
            });
        }
        Ok(Operations::kept(self.table, &self.statements))
    }

    /// The table's [`Stats`], as [`stats`](crate::stats) reads them.
    pub async fn stats<'e>(&self, executor: impl PgExecutor<'e>) -> Result<Stats, OutboxError> {
        statements::stats(&self.operations()?, executor).await
    }

    /// [`requeue_dead`](crate::requeue_dead) on this table.
    pub async fn requeue_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        event_ids: &[impl AsRef<str>],
    ) -> Result<Vec<EventId>, OutboxError> {
        let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
        statements::requeue_dead(&self.operations()?, executor, &ids).await
    }

    /// [`requeue_all_dead`](crate::requeue_all_dead) on this table.
    pub async fn requeue_all_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
    ) -> Result<u64, OutboxError> {
        statements::requeue_all_dead(&self.operations()?, executor).await
    }

    /// Requeues every dead event of this table if there are exactly `confirmed` of
    /// them, in one transaction, and returns how many there were: when that is not
    /// `confirmed` (events died, or were requeued, since an operator was asked),
    /// nothing changed.
    pub async fn requeue_all_dead_confirmed(
        &self,
        pool: &PgPool,
        confirmed: u64,
    ) -> Result<u64, OutboxError> {
        let mut tx = pool.begin().await.on_table(self.table)?;
        let dead = self.requeue_all_dead(&mut *tx).await?;
        if dead == confirmed {
            tx.commit().await.on_table(self.table)?;
        } else {
            tx.rollback().await.on_table(self.table)?;
        }
        Ok(dead)
    }

    /// [`discard_dead`](crate::discard_dead) on this table.
    pub async fn discard_dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        event_ids: &[impl AsRef<str>],
    ) -> Result<Vec<EventId>, OutboxError> {
        let ids: Vec<&str> = event_ids.iter().map(AsRef::as_ref).collect();
        statements::discard_dead(&self.operations()?, executor, &ids).await
    }

    /// [`prune_sent`](crate::prune_sent) on this table: one batch.
    pub async fn prune_sent<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        older_than: Duration,
        batch: u32,
    ) -> Result<u64, OutboxError> {
        statements::prune_sent(&self.operations()?, executor, older_than, batch).await
    }

    /// How many `SENT` rows [`prune_sent`](Self::prune_sent) would delete with
    /// `older_than`: its dry run.
    pub async fn count_prunable<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        older_than: Duration,
    ) -> Result<u64, OutboxError> {
        self.operations()?;
        let count: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\" WHERE status = 'SENT' \
             AND next_attempt_at < statement_timestamp() - $1::interval",
            self.table
        )))
        .bind(crate::interval::checked(
            self.table,
            "prune age",
            older_than,
        )?)
        .fetch_one(executor)
        .await
        .on_table(self.table)?;
        Ok(count.unsigned_abs())
    }

    /// Up to `limit` `DEAD` events, oldest first.
    pub async fn dead<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        limit: u32,
    ) -> Result<Vec<DeadEvent>, OutboxError> {
        self.operations()?;
        let key = self
            .key
            .as_ref()
            .map_or_else(|| "NULL".to_owned(), |k| format!("\"{k}\"::text"));
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT id, event_id, attempts, last_error, \
             statement_timestamp() - created_at AS age, {key} AS key \
             FROM \"{}\" WHERE status = 'DEAD' ORDER BY id LIMIT $1",
            self.table
        )))
        .bind(i64::from(limit))
        .fetch_all(executor)
        .await
        .on_table(self.table)?;
        rows.iter()
            .map(|row| {
                Ok(DeadEvent {
                    id: row.try_get("id")?,
                    event_id: EventId::from(row.try_get::<String, _>("event_id")?),
                    attempts: row.try_get("attempts")?,
                    last_error: row.try_get("last_error")?,
                    age: interval_to_duration(row.try_get("age")?),
                    key: row.try_get("key")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .on_table(self.table)
    }

    /// One event's whole row, payload included, as JSON (`to_jsonb` of the row), by
    /// its event id; `None` when there is none.
    pub async fn event<'e>(
        &self,
        executor: impl PgExecutor<'e>,
        event_id: &str,
    ) -> Result<Option<serde_json::Value>, OutboxError> {
        self.operations()?;
        let row: Option<Json<serde_json::Value>> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT to_jsonb(o) FROM \"{}\" AS o WHERE event_id = $1",
            self.table
        )))
        .bind(event_id)
        .fetch_optional(executor)
        .await
        .on_table(self.table)?;
        Ok(row.map(|Json(row)| row))
    }

    /// The least-privilege `GRANT` statements for `roles` on this table.
    pub fn grants(&self, roles: &Roles) -> String {
        grants(
            &Target {
                schema: &self.schema,
                table: self.table,
                history_table: &self.history_table,
                deletes_sent: self.deletes_sent,
            },
            roles,
        )
    }
}

/// One `DEAD` event, for an operator deciding to requeue or discard it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadEvent {
    /// The row id.
    pub id: i64,
    /// The stable event id.
    pub event_id: EventId,
    /// Claims it used.
    pub attempts: i32,
    /// Why it died.
    pub last_error: Option<String>,
    /// How long ago it was enqueued.
    pub age: Duration,
    /// Its ordering key, as text, for a keyed table.
    pub key: Option<String>,
}

/// A table name read from the catalog, as the `&'static str` errors carry. Each name is
/// leaked once per process, however often it is read: a database has few tables.
fn intern(name: String) -> &'static str {
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    let names = names.get_or_insert_with(HashSet::new);
    if let Some(&known) = names.get(name.as_str()) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.insert(leaked);
    leaked
}
