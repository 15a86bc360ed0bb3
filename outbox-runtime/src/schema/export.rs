//! The migrations [`migrate`](crate::migrate) would apply, as versioned `.sql` files for
//! teams that apply schema changes with their own tool (sqlx migrate, Flyway, a DBA's
//! review).
//!
//! Each file runs one migration **and records it in the table's own history**, exactly
//! as `outbox::migrate` would have, so the application's `outbox::migrate` at startup
//! finds it applied, applies nothing, checks the columns and writes the catalog row.
//! Nothing has to be kept in step by hand:
//!
//! - a file holds the migration's SQL byte for byte, and the row it records carries
//!   refinery's checksum of that SQL. If the event type changes after its files were
//!   applied (a field added without `since`, say), `outbox::migrate` refuses to start
//!   with [`OutboxError::EventTypeChanged`], as it does for a table it migrated itself;
//!   an edit that changes a column is [`Drift`](OutboxError::Drift);
//! - an edited file cannot be seen in the database for what it is, so
//!   [`write_migrations`] refuses to go on with one in the directory, and
//!   [`check_migrations`] (in a test of the application) fails on one, or on a migration
//!   not exported yet: the files in the repository are always what the event types
//!   generate.
//!
//! # One transaction per file
//!
//! A file has no `BEGIN`/`COMMIT`: sqlx migrate and Flyway already run each file in a
//! transaction together with the row of their own history, and a `COMMIT` inside would
//! end theirs early. With `psql`, apply each file with `psql --single-transaction -f`.
//!
//! # File names
//!
//! Tools such as sqlx migrate and Flyway keep one version sequence per directory, where
//! each outbox table has its own (1, 2, ...). So a file's version is the next free one in
//! the directory at export time, whoever wrote the files there (the application's own
//! migrations included), and its description names the table and the table's version:
//! `0007_outbox_order_events_v2.sql` ([`FileNames::Sqlx`]),
//! `V0007__outbox_order_events_v2.sql` ([`FileNames::Flyway`]). Exporting again writes
//! only what is new, after everything already there, and never renames a file, so a
//! version a tool applied keeps its file: re-run the export whenever an event type gains
//! a migration, and commit the new files.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use refinery_core::Migration;

use super::catalog;
use super::table_migrations::TableMigrations;
use crate::error::OutboxError;

/// The columns of a refinery history table, exactly as refinery 0.10 creates them
/// (`%VERSION_TYPE%`: `int4`, or `int8` with refinery's `int8-versions` feature).
const HISTORY_TABLE: &str = "CREATE TABLE IF NOT EXISTS %TABLE%(
             version %VERSION_TYPE% PRIMARY KEY,
             name VARCHAR(255),
             applied_on VARCHAR(255),
             checksum VARCHAR(255));";

/// The history table's DDL, with refinery's version type of this build.
fn history_ddl(history_table: &str) -> String {
    let version = if size_of::<refinery_core::SchemaVersion>() == 8 {
        "int8"
    } else {
        "int4"
    };
    HISTORY_TABLE
        .replace("%TABLE%", history_table)
        .replace("%VERSION_TYPE%", version)
}

/// `applied_on` as refinery writes it (RFC 3339, UTC), at the time the file is applied.
const APPLIED_ON: &str =
    "to_char(statement_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

/// How exported files are named: the migration tool's convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileNames {
    /// `<version>_<description>.sql`, for `sqlx migrate` (and tools that read the same).
    Sqlx,
    /// `V<version>__<description>.sql`, for Flyway (and Liquibase's or refinery's
    /// readers of the same).
    Flyway,
}

impl FileNames {
    fn file_name(self, version: i64, description: &str) -> String {
        match self {
            Self::Sqlx => format!("{version:04}_{description}.sql"),
            Self::Flyway => format!("V{version:04}__{description}.sql"),
        }
    }

    /// The version and description of a migration file in this convention; `None` for
    /// any other file. A Flyway version of several parts (`V1.2__`, or `V1_2__`: Flyway
    /// reads an underscore in a version as a dot) counts by its first part, which is
    /// what orders it.
    fn parse(self, file_name: &str) -> Option<(i64, &str)> {
        let stem = file_name.strip_suffix(".sql")?;
        let (version, description) = match self {
            Self::Sqlx => stem.split_once('_')?,
            Self::Flyway => stem.strip_prefix('V')?.split_once("__")?,
        };
        let major = version.split(['.', '_']).next()?;
        Some((major.parse().ok()?, description))
    }
}

/// One exported migration: what its file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationFile {
    target: &'static str,
    version: u32,
    name: String,
    sql: String,
    contents: String,
}

impl MigrationFile {
    fn new(
        target: &'static str,
        history_table: &'static str,
        migration: &Migration,
    ) -> Result<Self, ExportError> {
        let sql = migration.sql().unwrap_or_default().to_owned();
        let version = u32::try_from(migration.version()).map_err(|_| ExportError::Version {
            target,
            version: migration.version(),
        })?;
        // The migration's last statement may lack its `;` (outbox::migrate runs it alone).
        let terminator = if sql.trim_end().ends_with(';') {
            ""
        } else {
            "\n;"
        };
        let contents = format!(
            "-- Migration {version} of \"{target}\" ({migration}), exported by outbox::export:\n\
             -- what outbox::migrate applies. Do not edit: outbox::migrate compares the history row\n\
             -- below with the event type and refuses a table that differs. Change the event type\n\
             -- instead (a new field with #[outbox(since = N)]) and export again.\n\
             --\n\
             -- In one transaction (sqlx migrate and Flyway run each file in one; with psql, use\n\
             -- `psql --single-transaction -f`): create the table's own migration history as\n\
             -- outbox::migrate does, run the migration byte for byte, and record it there, so that\n\
             -- outbox::migrate at startup finds it applied.\n\n{history}\n\n{sql}{terminator}\n\n\
             INSERT INTO {history_table} (version, name, applied_on, checksum) \
             VALUES ({version}, '{name}', {APPLIED_ON}, '{checksum}');\n",
            history = history_ddl(history_table),
            name = migration.name().replace('\'', "''"),
            checksum = migration.checksum(),
        );
        Ok(Self {
            target,
            version,
            name: migration.to_string(),
            sql,
            contents,
        })
    }

    /// The outbox table the migration belongs to (or `outbox_catalog`, the catalog
    /// `outbox::migrate` keeps of them).
    pub fn target(&self) -> &'static str {
        self.target
    }

    /// The version within the target's own sequence (1, 2, ...).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The refinery name, `V{version}__{description}`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The migration's SQL, byte for byte what `outbox::migrate` runs.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The whole file: a header, the history table, the SQL and its history row.
    pub fn contents(&self) -> &str {
        &self.contents
    }

    fn key(&self) -> (String, u32) {
        (self.target.to_owned(), self.version)
    }

    /// What the file name says after its version: `outbox_<target>_v<version>`.
    pub fn description(&self) -> String {
        format!("outbox_{}_v{}", self.target, self.version)
    }
}

/// Why migrations could not be exported, or the exported files do not match.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// A migration refinery cannot read (the derive never generates one).
    #[error(transparent)]
    Migration(#[from] OutboxError),

    /// A migration version below zero (the derive never generates one).
    #[error("migration {version} of `{target}` has a negative version")]
    Version {
        /// The outbox table.
        target: &'static str,
        /// The version.
        version: i32,
    },

    /// The directory or a file in it could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// What the system reported.
        #[source]
        source: std::io::Error,
    },

    /// An exported file differs from what the event type generates now: it was edited,
    /// or the event type changed since it was exported. Nothing was written.
    #[error(
        "{} differs from migration {version} of `{target}` as its event type generates it: it was edited, \
         or the event type changed since it was exported. Restore it (delete it and export again) \
         and change the event type instead: an outbox table only grows, by fields with #[outbox(since = N)]",
        .path.display()
    )]
    Edited {
        /// The file.
        path: PathBuf,
        /// The outbox table.
        target: &'static str,
        /// The table's version.
        version: u32,
    },

    /// A migration of `target` was not exported to the directory yet.
    #[error("migration {version} of `{target}` is not in {}: export again", .dir.display())]
    Missing {
        /// The directory.
        dir: PathBuf,
        /// The outbox table.
        target: &'static str,
        /// The table's version.
        version: u32,
    },

    /// A later migration of `target` is in the directory but an earlier one is not: it
    /// would be numbered after the later one, and applied out of order.
    #[error(
        "{} is there but migration {missing} of `{target}` is not: restore it (from version control) before exporting",
        .later.display()
    )]
    OutOfOrder {
        /// The outbox table.
        target: &'static str,
        /// The version missing from the directory.
        missing: u32,
        /// The file of a later version.
        later: PathBuf,
    },

    /// Two files of the directory hold the same migration.
    #[error("{} and {} both hold migration {version} of `{target}`", .first.display(), .second.display())]
    Duplicate {
        /// The outbox table.
        target: String,
        /// The table's version.
        version: u32,
        /// One file.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
}

/// Every migration `outbox::migrate(pool, tables)` would apply to an empty schema, in
/// the order it would: the catalog's first, then each table's in version order. For a
/// `build.rs` or an `xtask` that writes them its own way.
pub fn migration_files(tables: &[TableMigrations]) -> Result<Vec<MigrationFile>, ExportError> {
    let mut files = Vec::new();
    // `migrate` creates the catalog only for a non-empty list of tables.
    if tables.is_empty() {
        return Ok(files);
    }
    for migration in catalog::runner()?.get_migrations() {
        files.push(MigrationFile::new(
            catalog::TABLE,
            catalog::HISTORY_TABLE,
            migration,
        )?);
    }
    for table in tables {
        let spec = table.spec();
        for step in spec.migrations() {
            let migration = Migration::unapplied(step.name, step.sql).map_err(|source| {
                OutboxError::Migration {
                    target: spec.table().to_owned(),
                    source,
                }
            })?;
            files.push(MigrationFile::new(
                spec.table(),
                spec.history_table(),
                &migration,
            )?);
        }
    }
    Ok(files)
}

/// Writes the migrations of `tables` that `dir` lacks as `.sql` files named for `names`'
/// tool, numbered after the highest version in `dir` (see the [module](self)
/// documentation), and returns the files written, in order. Creates `dir` if needed.
///
/// Files exported before are left as they are, after checking that they still hold what
/// the event types generate: one that does not is [`ExportError::Edited`], and nothing
/// is written.
pub fn write_migrations(
    dir: &Path,
    tables: &[TableMigrations],
    names: FileNames,
) -> Result<Vec<PathBuf>, ExportError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ExportError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io(dir))?;
    let listing = Listing::read(dir, names)?;
    let files = migration_files(tables)?;
    let mut next = listing.highest + 1;
    let mut new = Vec::new();
    for file in &files {
        if let Some(path) = listing.exported.get(&file.key()) {
            check_file(path, file)?;
        } else if let Some(later) = listing.later_than(file) {
            return Err(ExportError::OutOfOrder {
                target: file.target,
                missing: file.version,
                later: later.clone(),
            });
        } else {
            new.push((dir.join(names.file_name(next, &file.description())), file));
            next += 1;
        }
    }
    for (path, file) in &new {
        // Never over another file: the directory changed since it was listed.
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io(path))?;
        out.write_all(file.contents.as_bytes()).map_err(io(path))?;
    }
    Ok(new.into_iter().map(|(path, _)| path).collect())
}

/// Checks that `dir` holds every migration of `tables`, each byte for byte as
/// [`write_migrations`] would write it: [`ExportError::Missing`] or
/// [`ExportError::Edited`] otherwise. An application's test calls it, so that the
/// files it ships never diverge from its event types.
pub fn check_migrations(
    dir: &Path,
    tables: &[TableMigrations],
    names: FileNames,
) -> Result<(), ExportError> {
    let listing = Listing::read(dir, names)?;
    for file in migration_files(tables)? {
        let Some(path) = listing.exported.get(&file.key()) else {
            return Err(ExportError::Missing {
                dir: dir.to_owned(),
                target: file.target,
                version: file.version,
            });
        };
        check_file(path, &file)?;
    }
    Ok(())
}

fn check_file(path: &Path, file: &MigrationFile) -> Result<(), ExportError> {
    let found = fs::read(path).map_err(|source| ExportError::Io {
        path: path.to_owned(),
        source,
    })?;
    if found == file.contents.as_bytes() {
        Ok(())
    } else {
        Err(ExportError::Edited {
            path: path.to_owned(),
            target: file.target,
            version: file.version,
        })
    }
}

/// The migration files of a directory, in one tool's naming.
struct Listing {
    /// The highest version of any migration file there, 0 if none.
    highest: i64,
    /// The outbox migrations exported there, by their description's table and version.
    exported: BTreeMap<(String, u32), PathBuf>,
}

impl Listing {
    fn read(dir: &Path, names: FileNames) -> Result<Self, ExportError> {
        let io = |source| ExportError::Io {
            path: dir.to_owned(),
            source,
        };
        let mut listing = Self {
            highest: 0,
            exported: BTreeMap::new(),
        };
        let mut entries = fs::read_dir(dir)
            .map_err(io)?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(io)?;
        // Sorted, so that errors name the same file every time.
        entries.sort();
        for path in entries {
            let Some((version, description)) = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(|name| names.parse(name))
            else {
                continue;
            };
            listing.highest = listing.highest.max(version);
            let Some(key) = exported_migration(description) else {
                continue;
            };
            if let Some(first) = listing.exported.get(&key) {
                return Err(ExportError::Duplicate {
                    target: key.0,
                    version: key.1,
                    first: first.clone(),
                    second: path,
                });
            }
            listing.exported.insert(key, path);
        }
        Ok(listing)
    }

    /// A file of a later version of `file`'s table, if there is one.
    fn later_than(&self, file: &MigrationFile) -> Option<&PathBuf> {
        self.exported
            .range((file.target.to_owned(), file.version + 1)..)
            .take_while(|((target, _), _)| target == file.target)
            .map(|(_, path)| path)
            .next()
    }
}

/// The table and version of an exported outbox migration, from its description
/// (`outbox_<table>_v<version>`); `None` for any other migration.
fn exported_migration(description: &str) -> Option<(String, u32)> {
    let (target, version) = description.strip_prefix("outbox_")?.rsplit_once("_v")?;
    Some((target.to_owned(), version.parse().ok()?))
}
