//! The live tables against this build's event types: the columns each type expects, the
//! unique index on `event_id`, the versions a newer build applied, and an ordering key a
//! newer build added.

use std::collections::HashMap;

use sqlx::{AssertSqlSafe, PgConnection, PgExecutor, PgPool};

use super::table_migrations::TableMigrations;
use crate::error::{OnTable as _, OutboxError};
use crate::spec::TableSpec;

/// The live columns of a table, resolved through the search_path. `::regclass` (rather
/// than `to_regclass`) makes a missing table an `undefined_table` error, which
/// [`OnTable`](crate::error::OnTable) reports as [`OutboxError::MissingTable`].
const LIVE_COLUMNS: &str = "\
    SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull \
    FROM pg_attribute a \
    WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped";

/// Whether a table has what `enqueue`'s `ON CONFLICT (event_id)` needs: a valid unique
/// index on exactly `event_id`, not partial, not deferrable.
const EVENT_ID_UNIQUE: &str = "\
    SELECT EXISTS (SELECT FROM pg_index i \
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
        WHERE i.indrelid = $1::regclass AND i.indisunique AND i.indisvalid AND i.indimmediate \
            AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL \
            AND a.attname = 'event_id')";

/// Checks, without migrating, that every table in `tables` exists and has the columns
/// its event type expects: [`OutboxError::MissingTable`] or [`OutboxError::Drift`]
/// otherwise. Columns the event type does not know are allowed.
pub async fn verify(pool: &PgPool, tables: &[TableMigrations]) -> Result<(), OutboxError> {
    for table in tables {
        let mut conn = crate::connect::acquire(pool, table.spec.table).await?;
        check_columns(&mut conn, table.spec).await?;
    }
    Ok(())
}

/// The column a newer build orders `spec`'s table by, when this build's event type has
/// no ordering key: the first column of the table's index on `(key, id)` for the events
/// not yet `SENT`, which the migration adding a key creates. Read from PostgreSQL's own
/// catalogs, which every role may read (a relay's role has no grant on the outbox
/// catalog).
pub(crate) async fn key_unknown_to_build(
    pool: &PgPool,
    spec: &'static TableSpec,
) -> Result<Option<String>, OutboxError> {
    if spec.key.is_some() {
        return Ok(None);
    }
    let mut conn = crate::connect::acquire(pool, spec.table).await?;
    // Exactly `(<a column this build does not know>, id) WHERE status <> 'SENT'`: an
    // index of the application's own, on columns the build knows, is not a key.
    let known: Vec<&str> = spec
        .columns
        .iter()
        .map(|c| c.name)
        .chain(outbox_internals::BOOKKEEPING.iter().map(|b| b.name))
        .collect();
    sqlx::query_scalar(
        "SELECT a.attname::text FROM pg_index i \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
         JOIN pg_attribute id ON id.attrelid = i.indrelid AND id.attnum = i.indkey[1] \
         WHERE i.indrelid = to_regclass(quote_ident($1)) AND i.indnatts = 2 \
             AND id.attname = 'id' AND a.attname <> ALL($2::text[]) \
             AND pg_get_expr(i.indpred, i.indrelid) = '(status <> ''SENT''::text)' \
         LIMIT 1",
    )
    .bind(spec.table)
    .bind(known)
    .fetch_optional(&mut *conn)
    .await
    .on_table(spec.table)
}

/// Logs the versions of `spec`'s table that a newer build applied: this build does not
/// know them, and carries on if the columns it needs are there (checked next).
pub(crate) async fn warn_if_newer(
    conn: &mut PgConnection,
    spec: &'static TableSpec,
) -> Result<(), OutboxError> {
    let known = spec.migrations.iter().map(|m| m.version).max().unwrap_or(0);
    // int8: the column is refinery's `int4`, or `int8` with its `int8-versions` feature.
    let newer: Vec<(i64, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT version::int8, name FROM {} WHERE version > $1 ORDER BY version",
        spec.history_table
    )))
    .bind(i64::from(known))
    .fetch_all(conn)
    .await
    .on_table(spec.table)?;
    if !newer.is_empty() {
        let newer: Vec<String> = newer
            .iter()
            .map(|(v, name)| format!("V{v}__{name}"))
            .collect();
        tracing::warn!(
            table = spec.table,
            known,
            newer = %newer.join(", "),
            "a newer build migrated this table further (a rolling deploy or a rollback); \
             this build knows its migrations up to version {known} and carries on if the columns it needs are there"
        );
    }
    Ok(())
}

/// What differs between `spec`'s table and its event type, for an edited migration: in
/// words, as far as the columns tell.
pub(crate) async fn changes(
    conn: &mut PgConnection,
    spec: &'static TableSpec,
) -> Result<String, OutboxError> {
    let live = live_columns(conn, spec).await?;
    let mut changes = column_differences(spec, &live);
    changes.extend(
        live.iter()
            .filter(|(name, ..)| !spec.columns.iter().any(|c| c.name == name))
            .map(|(name, ty, _)| {
                format!("column `{name}` ({ty}) is in the table but no field maps to it")
            }),
    );
    Ok(if changes.is_empty() {
        "the columns still match: fields were reordered, a `json` or `column` attribute changed, \
         or the table was created by another version of the outbox crate"
            .to_owned()
    } else {
        changes.join("; ")
    })
}

async fn live_columns<'e>(
    executor: impl PgExecutor<'e>,
    spec: &'static TableSpec,
) -> Result<Vec<(String, String, bool)>, OutboxError> {
    sqlx::query_as(LIVE_COLUMNS)
        .bind(spec.table)
        .fetch_all(executor)
        .await
        .on_table(spec.table)
}

/// Compares the live table with `spec.columns`, and checks the unique index on
/// `event_id` that enqueueing needs (unless the type generates its ids and the table
/// has none: `#[outbox(no_event_id_index)]`).
pub(crate) async fn check_columns(
    conn: &mut PgConnection,
    spec: &'static TableSpec,
) -> Result<(), OutboxError> {
    let live = live_columns(&mut *conn, spec).await?;
    let mut differences = column_differences(spec, &live);
    // Only a table whose enqueue relies on the index is asked for it.
    let needs_index = spec.event_id_unique && live.iter().any(|(name, _, _)| name == "event_id");
    if needs_index
        && !sqlx::query_scalar::<_, bool>(EVENT_ID_UNIQUE)
            .bind(spec.table)
            .fetch_one(&mut *conn)
            .await
            .on_table(spec.table)?
    {
        differences.push(
            "no unique index on `event_id` (enqueueing's `ON CONFLICT (event_id)` needs one)"
                .to_owned(),
        );
    }
    if differences.is_empty() {
        Ok(())
    } else {
        Err(OutboxError::Drift {
            table: spec.table,
            details: differences.join("; "),
        })
    }
}

/// Missing columns and type or nullability mismatches, in the spec's column order.
/// Extra live columns are fine: a migration may add one before the event type uses it.
fn column_differences(spec: &TableSpec, live: &[(String, String, bool)]) -> Vec<String> {
    let live: HashMap<&str, (&str, bool)> = live
        .iter()
        .map(|(name, ty, nullable)| (name.as_str(), (ty.as_str(), *nullable)))
        .collect();
    let null = |nullable: bool| if nullable { "nullable" } else { "NOT NULL" };
    let mut differences = Vec::new();
    for column in spec.columns {
        match live.get(column.name) {
            None => differences.push(format!(
                "missing column `{}` ({} {})",
                column.name,
                column.sql_type,
                null(column.nullable)
            )),
            Some(&(ty, nullable)) => {
                if ty != column.sql_type {
                    differences.push(format!(
                        "column `{}` is `{ty}`, expected `{}`",
                        column.name, column.sql_type
                    ));
                }
                if nullable != column.nullable {
                    differences.push(format!(
                        "column `{}` is {}, expected {}",
                        column.name,
                        null(nullable),
                        null(column.nullable)
                    ));
                }
            }
        }
    }
    differences
}
