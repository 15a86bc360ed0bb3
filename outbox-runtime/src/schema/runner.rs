//! refinery's runners: of an outbox table, from its spec, and of the crate's own tables
//! (the catalog, the inbox); and refinery's errors, as the crate reports them.

use refinery_core::error::{Kind, WrapMigrationError};
use refinery_core::{Migration, Runner};

use crate::error::OutboxError;
use crate::spec::TableSpec;

/// The runner of one of the crate's own tables (the catalog, the inbox): its
/// `migrations` (name, SQL) recorded in `history_table`.
pub(crate) fn own_runner(
    target: &str,
    history_table: &str,
    migrations: &[(&str, &str)],
) -> Result<Runner, OutboxError> {
    let migrations = migrations
        .iter()
        .map(|(name, sql)| Migration::unapplied(name, sql))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| OutboxError::Migration {
            target: target.to_owned(),
            source,
        })?;
    let mut runner = Runner::new(&migrations)
        .set_abort_divergent(true)
        .set_abort_missing(false);
    runner.set_migration_table_name(history_table);
    Ok(runner)
}

/// The refinery runner of one table, configured for the table's own history table.
pub(crate) fn table_runner(spec: &'static TableSpec) -> Result<Runner, OutboxError> {
    let invalid = |e: SpecError| {
        Err::<(), _>(e)
            .migration_err("invalid table spec", None)
            .map_err(|e| migration_error(spec.table, e))
    };
    // refinery splices the name into its SQL, and panics on an empty one.
    if !is_identifier(spec.history_table) {
        invalid(SpecError::HistoryTable(spec.history_table))?;
    }
    let mut migrations = Vec::with_capacity(spec.migrations.len());
    for step in spec.migrations {
        let migration = Migration::unapplied(step.name, step.sql)
            .map_err(|e| migration_error(spec.table, e))?;
        if i64::from(migration.version()) != i64::from(step.version) {
            invalid(SpecError::Version {
                name: step.name,
                version: step.version,
            })?;
        }
        migrations.push(migration);
    }
    // A version applied by a newer build is not an error: see `warn_if_newer`.
    let mut runner = Runner::new(&migrations)
        .set_abort_divergent(true)
        .set_abort_missing(false);
    runner.set_migration_table_name(spec.history_table);
    Ok(runner)
}

/// A spec the derive should never produce, reported as a migration failure.
#[derive(Debug, thiserror::Error)]
enum SpecError {
    #[error("history table name `{0}` is not a plain lowercase identifier")]
    HistoryTable(&'static str),
    #[error("migration `{name}` is declared as version {version}")]
    Version { name: &'static str, version: u32 },
}

fn is_identifier(name: &str) -> bool {
    outbox_internals::is_plain_identifier(name) && name.len() <= outbox_internals::MAX_IDENTIFIER
}

/// Wraps a refinery error, singling out an edited applied migration.
pub(crate) fn migration_error(target: &str, source: refinery_core::Error) -> OutboxError {
    if let Kind::DivergentVersion(applied, current) = source.kind() {
        let (version, applied, current) = (
            i64::from(applied.version()),
            applied.to_string(),
            current.to_string(),
        );
        return OutboxError::MigrationDiverged {
            target: target.to_owned(),
            version,
            applied,
            current,
            source,
        };
    }
    OutboxError::Migration {
        target: target.to_owned(),
        source,
    }
}
