//! Exporting the SQL: the files hold each migration byte for byte and the history row
//! `outbox::migrate` would write; applied by another tool (here plain `raw_sql`, in
//! version order, one transaction per file), `outbox::migrate` then applies nothing and
//! the tables work; an event type changed since its files were applied is refused at
//! startup; exporting again writes only what is new, and an edited file is caught.

use std::path::{Path, PathBuf};

use outbox::export::{ExportError, FileNames, MigrationFile, check_migrations, write_migrations};
use outbox::testing::TestSchema;
use outbox::{OutboxError, schema::TableMigrations};
use outbox_testkit::TestResult;
use outbox_testkit::events::{ParcelSent, ParcelSentChanged, Receipt, Shipment, ShipmentBeforeKey};
use sqlx::{AssertSqlSafe, PgPool};

/// A directory of its own under the system's temporary directory, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-export-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    /// The file names in the directory, sorted.
    fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn file_names(paths: &[PathBuf]) -> Vec<String> {
    paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Applies the sqlx-named files of `dir` in version order, each in one transaction, as
/// `sqlx migrate run` does: the external tool.
async fn apply_like_a_tool(pool: &PgPool, dir: &Path) -> TestResult {
    let mut files: Vec<(i64, PathBuf)> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let version = name.split_once('_').unwrap().0.parse().unwrap();
            (version, path)
        })
        .collect();
    files.sort();
    for (_, path) in files {
        let mut tx = pool.begin().await?;
        sqlx::raw_sql(AssertSqlSafe(std::fs::read_to_string(&path)?))
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        tx.commit().await?;
    }
    Ok(())
}

/// `(version, name, checksum)` of a history table.
async fn history(pool: &PgPool, table: &str) -> TestResult<Vec<(i32, String, String)>> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT version, name, checksum FROM {table} ORDER BY version"
    )))
    .fetch_all(pool)
    .await?)
}

/// The columns of a table as `information_schema` describes them, and its primary key.
async fn shape(
    pool: &PgPool,
    table: &str,
) -> TestResult<Vec<(String, String, Option<i32>, String)>> {
    Ok(sqlx::query_as(
        "SELECT c.column_name::text, c.data_type::text, c.character_maximum_length::int4, \
                c.is_nullable::text || coalesce(' ' || k.constraint_name::text, '') \
         FROM information_schema.columns c \
         LEFT JOIN information_schema.key_column_usage k \
             ON (k.table_schema, k.table_name, k.column_name) = (c.table_schema, c.table_name, c.column_name) \
         WHERE c.table_schema = current_schema() AND c.table_name = $1 \
         ORDER BY c.ordinal_position",
    )
    .bind(table)
    .fetch_all(pool)
    .await?)
}

fn tables() -> [TableMigrations; 2] {
    [Shipment::migrations(), Receipt::migrations()]
}

#[test]
fn each_file_holds_its_migration_byte_for_byte_and_the_row_that_records_it() -> TestResult {
    let files = outbox::export::migration_files(&tables())?;
    let exported: Vec<(&str, u32, &str)> = files
        .iter()
        .map(|f| (f.target(), f.version(), f.name()))
        .collect();
    assert_eq!(
        exported,
        [
            ("outbox_catalog", 1, "V1__create_outbox_catalog"),
            ("shipment_events", 1, "V1__create_shipment_events"),
            ("shipment_events", 2, "V2__add_parcel"),
            ("receipt_events", 1, "V1__create_receipt_events"),
        ]
    );
    for table in tables() {
        let spec = table.spec();
        for step in spec.migrations() {
            let file: &MigrationFile = files
                .iter()
                .find(|f| f.target() == spec.table() && f.version() == step.version)
                .expect("exported");
            assert_eq!(file.sql(), step.sql, "byte for byte");
            let contents = file.contents();
            let history = format!(
                "CREATE TABLE IF NOT EXISTS {}(\n             version int4 PRIMARY KEY,",
                spec.history_table()
            );
            let (head, rest) = contents
                .split_once(&history)
                .expect("the history table first");
            assert!(
                head.starts_with("-- ") && head.contains("Do not edit"),
                "{head}"
            );
            let at = rest.find(step.sql).expect("the migration's SQL, as it is");
            let after = &rest[at + step.sql.len()..];
            let checksum =
                outbox::schema::refinery::Migration::unapplied(step.name, step.sql)?.checksum();
            let description = step.name.split_once("__").unwrap().1;
            assert!(
                after.trim_start().starts_with(&format!(
                    "INSERT INTO {} (version, name, applied_on, checksum) VALUES ({}, '{description}', ",
                    spec.history_table(),
                    step.version
                )) && after.trim_end().ends_with(&format!("'{checksum}');")),
                "{after}"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn applied_by_another_tool_they_leave_outbox_migrate_nothing_to_do() -> TestResult {
    let dir = ScratchDir::new();
    let written = write_migrations(dir.path(), &tables(), FileNames::Sqlx)?;
    assert_eq!(
        file_names(&written),
        [
            "0001_outbox_outbox_catalog_v1.sql",
            "0002_outbox_shipment_events_v1.sql",
            "0003_outbox_shipment_events_v2.sql",
            "0004_outbox_receipt_events_v1.sql",
        ]
    );

    // The DBA's tool applies them; the application starts later and migrates as usual.
    let db = TestSchema::new().await?;
    let pool = db.pool();
    apply_like_a_tool(pool, dir.path()).await?;
    let report = outbox::migrate(pool, &tables()).await?;
    assert!(report.is_empty(), "nothing left to apply: {report:?}");
    let mut catalog: Vec<String> = outbox::catalog::tables(pool)
        .await?
        .iter()
        .map(|e| format!("{} v{}", e.table(), e.version()))
        .collect();
    catalog.sort();
    assert_eq!(catalog, ["receipt_events v1", "shipment_events v2"]);

    // The tables work.
    let shipment = Shipment {
        name: "s1".into(),
        parcel: Some("p1".into()),
    };
    shipment.enqueue(pool).await?;
    let claim = Shipment::claim(pool).await?.expect("the shipment");
    assert_eq!(claim.event(), &shipment);
    claim.complete(pool).await?;

    // Its history is the one outbox::migrate writes itself, in a table of the same shape.
    let migrated = outbox_testkit::schema::schema_with(&tables()).await?;
    for table in [
        "_outbox_history_outbox_catalog",
        "_outbox_history_shipment_events",
        "_outbox_history_receipt_events",
    ] {
        assert_eq!(
            history(pool, table).await?,
            history(migrated.pool(), table).await?,
            "{table}"
        );
        assert_eq!(
            shape(pool, table).await?.len(),
            4,
            "{table}: version, name, applied_on, checksum"
        );
        let columns = |shape: Vec<(String, String, Option<i32>, String)>| {
            shape
                .into_iter()
                .map(|(c, t, l, n)| (c, t, l, n.split(' ').next().map(str::to_owned)))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            columns(shape(pool, table).await?),
            columns(shape(migrated.pool(), table).await?),
            "{table}"
        );
    }
    migrated.drop_schema().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn files_of_an_event_type_that_changed_since_are_refused_at_startup() -> TestResult {
    let dir = ScratchDir::new();
    write_migrations(dir.path(), &[ParcelSent::migrations()], FileNames::Sqlx)?;
    let db = TestSchema::new().await?;
    apply_like_a_tool(db.pool(), dir.path()).await?;

    // The next build added a field without `since`: its migration 1 is not what ran.
    let error = outbox::migrate(db.pool(), &[ParcelSentChanged::migrations()])
        .await
        .expect_err("migration 1 diverged");
    assert!(
        matches!(
            &error,
            OutboxError::EventTypeChanged { table: "parcel_events", version: 1, changes }
                if changes == "missing column `grams` (bigint NOT NULL)"
        ),
        "{error:?}"
    );
    // Exporting it over the old files says the same before anything is applied.
    let refused = write_migrations(
        dir.path(),
        &[ParcelSentChanged::migrations()],
        FileNames::Sqlx,
    )
    .expect_err("the exported migration 1 differs");
    assert!(
        matches!(
            &refused,
            ExportError::Edited {
                target: "parcel_events",
                version: 1,
                ..
            }
        ),
        "{refused:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_hand_edited_file_is_caught_before_and_after_it_is_applied() -> TestResult {
    let dir = ScratchDir::new();
    let written = write_migrations(dir.path(), &tables(), FileNames::Sqlx)?;
    // A reviewer "fixes" the parcel column of migration 2.
    let v2 = &written[2];
    let edited = std::fs::read_to_string(v2)?.replace(
        "ADD COLUMN \"parcel\" text;",
        "ADD COLUMN \"parcel\" varchar(64);",
    );
    std::fs::write(v2, edited)?;

    let error = check_migrations(dir.path(), &tables(), FileNames::Sqlx)
        .expect_err("the application's test fails");
    assert!(
        matches!(&error, ExportError::Edited { path, target: "shipment_events", version: 2 } if path == v2),
        "{error:?}"
    );
    assert!(
        write_migrations(dir.path(), &tables(), FileNames::Sqlx).is_err(),
        "exporting again refuses too"
    );

    // Applied anyway, the table has drifted from the event type: the application does
    // not start.
    let db = TestSchema::new().await?;
    apply_like_a_tool(db.pool(), dir.path()).await?;
    let error = outbox::migrate(db.pool(), &tables())
        .await
        .expect_err("drift");
    assert!(
        matches!(
            &error,
            OutboxError::Drift { table: "shipment_events", details }
                if details == "column `parcel` is `character varying(64)`, expected `text`"
        ),
        "{error:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[test]
fn exporting_again_numbers_only_new_migrations_after_everything_in_the_directory() -> TestResult {
    let dir = ScratchDir::new();
    std::fs::write(
        dir.path().join("0001_create_orders.sql"),
        "CREATE TABLE orders ();",
    )?;
    // The first release: the shipments' table without its key.
    let first = write_migrations(
        dir.path(),
        &[ShipmentBeforeKey::migrations()],
        FileNames::Sqlx,
    )?;
    assert_eq!(
        file_names(&first),
        [
            "0002_outbox_outbox_catalog_v1.sql",
            "0003_outbox_shipment_events_v1.sql"
        ]
    );
    std::fs::write(
        dir.path().join("0004_add_customers.sql"),
        "CREATE TABLE customers ();",
    )?;

    // The next one adds the key (migration 2) and the receipts: numbered after 0004.
    let second = write_migrations(dir.path(), &tables(), FileNames::Sqlx)?;
    assert_eq!(
        file_names(&second),
        [
            "0005_outbox_shipment_events_v2.sql",
            "0006_outbox_receipt_events_v1.sql"
        ]
    );
    assert!(write_migrations(dir.path(), &tables(), FileNames::Sqlx)?.is_empty());
    check_migrations(dir.path(), &tables(), FileNames::Sqlx)?;
    assert_eq!(dir.names().len(), 6);

    // A migration lost from the directory is reported, not exported after its successor.
    std::fs::remove_file(dir.path().join("0003_outbox_shipment_events_v1.sql"))?;
    let error = write_migrations(dir.path(), &tables(), FileNames::Sqlx).expect_err("a gap");
    assert!(
        matches!(&error, ExportError::OutOfOrder { target: "shipment_events", missing: 1, later }
            if later.ends_with("0005_outbox_shipment_events_v2.sql")),
        "{error:?}"
    );
    let error = check_migrations(dir.path(), &tables(), FileNames::Sqlx).expect_err("missing");
    assert!(
        matches!(
            &error,
            ExportError::Missing {
                target: "shipment_events",
                version: 1,
                ..
            }
        ),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn flyway_names_follow_the_versions_flyway_already_has() -> TestResult {
    let dir = ScratchDir::new();
    std::fs::write(
        dir.path().join("V1.1__create_orders.sql"),
        "CREATE TABLE orders ();",
    )?;
    // Flyway reads an underscore in a version as a dot: version 2.1.
    std::fs::write(
        dir.path().join("V2_1__index_orders.sql"),
        "CREATE INDEX ON orders ((1));",
    )?;
    std::fs::write(
        dir.path().join("R__views.sql"),
        "CREATE VIEW v AS SELECT 1;",
    )?;
    let written = write_migrations(dir.path(), &[Receipt::migrations()], FileNames::Flyway)?;
    assert_eq!(
        file_names(&written),
        [
            "V0003__outbox_outbox_catalog_v1.sql",
            "V0004__outbox_receipt_events_v1.sql"
        ]
    );
    check_migrations(dir.path(), &[Receipt::migrations()], FileNames::Flyway)?;
    // The same directory read with sqlx's names holds no export.
    assert!(check_migrations(dir.path(), &[Receipt::migrations()], FileNames::Sqlx).is_err());
    Ok(())
}
