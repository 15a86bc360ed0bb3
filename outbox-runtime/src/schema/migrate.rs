//! Startup migrations: refinery's runner over a sqlx connection, serialized by a
//! PostgreSQL advisory lock, followed by a check that every table still has the
//! columns its event type expects.

use refinery_core::{Migration, Report, Runner};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockGuard, PgAdvisoryLockKey};
use sqlx::{PgConnection, PgPool, Postgres};

use super::catalog;
use super::driver::SqlxDriver;
use super::runner::{migration_error, table_runner};
use super::table_migrations::TableMigrations;
use super::verify::{changes, check_columns, warn_if_newer};
use crate::error::{OnTable as _, OutboxError};

/// The target name of the application's own migrations in errors, logs and reports.
const APPLICATION: &str = "application";

/// The advisory lock key: one per schema, so tenants in separate schemas of one
/// database migrate independently, and in a namespace of its own so it cannot collide
/// with sqlx's migrator or the application's locks.
const LOCK_KEY: &str =
    "SELECT hashtextextended('outbox.migrate:' || coalesce(current_schema(), ''), 0)";

/// What one [`migrate`] or [`migrate_with_app`] call applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationReport {
    applied: Vec<AppliedMigration>,
}

impl MigrationReport {
    /// Every migration this call applied, in the order it ran. Empty when the
    /// database was already up to date.
    pub fn applied(&self) -> &[AppliedMigration] {
        &self.applied
    }

    /// Whether nothing was applied.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty()
    }

    fn record(&mut self, target: &str, report: &Report) {
        let applied = report.applied_migrations();
        log_applied(target, applied);
        self.applied
            .extend(applied.iter().map(|m| AppliedMigration::new(target, m)));
    }
}

/// One migration applied by a [`migrate`] call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedMigration {
    target: String,
    version: i64,
    name: String,
}

impl AppliedMigration {
    fn new(target: &str, migration: &Migration) -> Self {
        Self {
            target: target.to_owned(),
            version: i64::from(migration.version()),
            name: migration.to_string(),
        }
    }

    /// The outbox table, or `application` for the application's own migrations.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The version within the target's own sequence.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// The refinery name, `V{version}__{description}`.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Runs the migrations of every table in `tables`, then checks that each table has the
/// columns its event type expects. Idempotent: a second call applies nothing.
///
/// Each table keeps its own version sequence in its own refinery history table
/// ([`TableSpec::history_table`]), so adding an event type never renumbers another's.
/// Every migration runs in its own transaction together with its history row. Calls
/// are serialized per schema by a session-level advisory lock, so every replica of a
/// service may call this at startup.
///
/// A table that a newer build already migrated further (a rolling deploy, or a
/// rollback) is fine: its newer migrations are logged as a warning, and the columns this
/// build needs are checked as usual.
///
/// Fails with [`OutboxError::Connect`] when no connection can be opened,
/// [`OutboxError::EventTypeChanged`] when an event type's fields changed in a way its
/// table cannot follow (a migration that ran was edited), [`OutboxError::Migration`]
/// when one fails, and [`OutboxError::Drift`] when a table lacks a column or has a
/// different type or nullability.
///
/// [`TableSpec::history_table`]: crate::TableSpec::history_table
pub async fn migrate(
    pool: &PgPool,
    tables: &[TableMigrations],
) -> Result<MigrationReport, OutboxError> {
    run(pool, None, tables).await
}

/// Runs the application's own refinery migrations (in the history table `app` is
/// configured with, `refinery_schema_history` by default), then the outbox tables', all
/// under the one advisory lock of [`migrate`].
///
/// The application's migrations are reported under the target `application`.
pub async fn migrate_with_app(
    pool: &PgPool,
    app: &Runner,
    tables: &[TableMigrations],
) -> Result<MigrationReport, OutboxError> {
    run(pool, Some(app), tables).await
}

/// Runs `runner`, the migrations of `target` (a table of the crate's own, such as the
/// consumer inbox), under the lock of [`migrate`].
pub(crate) async fn migrate_target(
    pool: &PgPool,
    target: &str,
    runner: &Runner,
) -> Result<MigrationReport, OutboxError> {
    let mut lock = migration_lock(pool).await?;
    let result = run_runner(runner, &mut SqlxDriver(&mut lock), target).await;
    if let Err(e) = lock.release_now().await {
        tracing::warn!(error = %e, "cannot release the migration lock; closing its connection");
    }
    let mut report = MigrationReport::default();
    report.record(target, &result?);
    Ok(report)
}

async fn run(
    pool: &PgPool,
    app: Option<&Runner>,
    tables: &[TableMigrations],
) -> Result<MigrationReport, OutboxError> {
    if app.is_none() && tables.is_empty() {
        return Ok(MigrationReport::default());
    }
    // A malformed spec fails before anything is locked.
    let runners = tables
        .iter()
        .map(|t| table_runner(t.spec))
        .collect::<Result<Vec<_>, _>>()?;
    let mut lock = migration_lock(pool).await?;
    let result = run_locked(&mut lock, app, tables, &runners).await;
    // The connection is closed when dropped, which would release the lock too.
    if let Err(e) = lock.release_now().await {
        tracing::warn!(error = %e, "cannot release the migration lock; closing its connection");
    }
    result
}

async fn run_locked(
    conn: &mut PgConnection,
    app: Option<&Runner>,
    tables: &[TableMigrations],
    runners: &[Runner],
) -> Result<MigrationReport, OutboxError> {
    let mut report = MigrationReport::default();
    let mut driver = SqlxDriver(conn);
    if let Some(app) = app {
        let applied = run_runner(app, &mut driver, APPLICATION).await?;
        report.record(APPLICATION, &applied);
    }
    if !tables.is_empty() {
        let applied = run_runner(&catalog::runner()?, &mut driver, catalog::TABLE).await?;
        report.record(catalog::TABLE, &applied);
    }
    for (table, runner) in tables.iter().zip(runners) {
        let spec = table.spec;
        let applied = match run_runner(runner, &mut driver, spec.table).await {
            Err(OutboxError::MigrationDiverged { version, .. }) => {
                return Err(OutboxError::EventTypeChanged {
                    table: spec.table,
                    version,
                    changes: changes(&mut *driver.0, spec).await?,
                });
            }
            applied => applied?,
        };
        report.record(spec.table, &applied);
        warn_if_newer(&mut *driver.0, spec).await?;
        check_columns(&mut *driver.0, spec).await?;
        catalog::record(driver.0, table).await?;
    }
    Ok(report)
}

async fn run_runner(
    runner: &Runner,
    driver: &mut SqlxDriver<'_>,
    target: &str,
) -> Result<Report, OutboxError> {
    runner.run_async(driver).await.map_err(|e| {
        // Migrations before the failing one were committed: say so.
        if let Some(partial) = e.report() {
            log_applied(target, partial.applied_migrations());
        }
        migration_error(target, e)
    })
}

fn log_applied(target: &str, migrations: &[Migration]) {
    for m in migrations {
        tracing::info!(
            table = target, version = i64::from(m.version()), migration = %m,
            "applied migration"
        );
    }
}

/// The migration lock: sqlx's advisory lock, held on one pooled connection for the whole
/// run, on which every migration runs.
///
/// refinery takes no lock of its own, so concurrent starts would race on `CREATE
/// TABLE` and on the history rows. The key is per schema (see [`LOCK_KEY`]); builds of
/// every version compute it the same way, so an old and a new build never migrate at
/// once during a rolling deploy.
async fn migration_lock(
    pool: &PgPool,
) -> Result<PgAdvisoryLockGuard<PoolConnection<Postgres>>, OutboxError> {
    const TARGET: &str = "outbox::migrate";
    // From the pool rather than fresh, so its `after_connect` (e.g. a `SET
    // search_path`) applies: the lock key and every table name depend on it.
    let mut conn = crate::connect::acquire(pool, TARGET).await?;
    // A session lock must never go back to the pool, even if this future is dropped
    // mid-run: closing the connection releases it.
    conn.close_on_drop();
    // Computed once: a migration that changes the search_path must not change the key.
    let key: i64 = sqlx::query_scalar(LOCK_KEY)
        .fetch_one(&mut *conn)
        .await
        .on_table(TARGET)?;
    tracing::debug!(key, "waiting for the migration lock");
    PgAdvisoryLock::with_key(PgAdvisoryLockKey::BigInt(key))
        .acquire(conn)
        .await
        .on_table(TARGET)
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Duration;

    use sqlx::AssertSqlSafe;

    use super::*;
    use crate::schema::verify::verify;
    use crate::spec::{Column, MigrationStep, Statement, TableSpec};

    const V1: MigrationStep = MigrationStep {
        version: 1,
        name: "V1__create_widget_events",
        sql: "CREATE TABLE widget_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
              event_id text NOT NULL UNIQUE, note text)",
    };
    const V1_EDITED: MigrationStep = MigrationStep {
        sql: "CREATE TABLE widget_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
              event_id text NOT NULL UNIQUE, note varchar(200))",
        ..V1
    };
    const V2: MigrationStep = MigrationStep {
        version: 2,
        name: "V2__add_extra",
        sql: "ALTER TABLE widget_events ADD COLUMN extra bigint",
    };
    const GADGET_V1: MigrationStep = MigrationStep {
        version: 1,
        name: "V1__create_gadget_events",
        sql: "CREATE TABLE gadget_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
              event_id text NOT NULL UNIQUE)",
    };

    const fn column(name: &'static str, sql_type: &'static str, nullable: bool) -> Column {
        Column {
            name,
            sql_type,
            nullable,
        }
    }
    const ID: Column = column("id", "bigint", false);
    const EVENT_ID: Column = column("event_id", "text", false);
    const NOTE: Column = column("note", "text", true);
    const EXTRA: Column = column("extra", "bigint", true);

    const fn spec(
        table: &'static str,
        history_table: &'static str,
        columns: &'static [Column],
        migrations: &'static [MigrationStep],
    ) -> TableSpec {
        TableSpec {
            table,
            history_table,
            lease: Duration::from_secs(30),
            retry_delay: Duration::from_secs(1),
            max_attempts: 5,
            key: None,
            deletes_sent: false,
            scheduled: false,
            traced: false,
            event_id_unique: true,
            sql: crate::spec::derive_only_statements([""; Statement::COUNT], &[], &[], &[]),
            columns,
            migrations,
        }
    }

    const WIDGET_HISTORY: &str = "widget_events_history";
    static WIDGETS_V1: TableSpec = spec(
        "widget_events",
        WIDGET_HISTORY,
        &[ID, EVENT_ID, NOTE],
        &[V1],
    );
    static WIDGETS_V2: TableSpec = spec(
        "widget_events",
        WIDGET_HISTORY,
        &[ID, EVENT_ID, NOTE, EXTRA],
        &[V1, V2],
    );
    /// V1 with `note` retyped, as a field retyped in the event type would.
    static WIDGETS_EDITED: TableSpec = spec(
        "widget_events",
        WIDGET_HISTORY,
        &[ID, EVENT_ID, column("note", "character varying(200)", true)],
        &[V1_EDITED],
    );
    /// V1's SQL, but columns the SQL does not create.
    static WIDGETS_WRONG_COLUMNS: TableSpec = spec(
        "widget_events",
        WIDGET_HISTORY,
        &[ID, column("event_id", "uuid", false), NOTE],
        &[V1],
    );
    static GADGETS_V1: TableSpec = spec(
        "gadget_events",
        "gadget_events_history",
        &[ID, EVENT_ID],
        &[GADGET_V1],
    );
    static NO_HISTORY_TABLE: TableSpec = spec("widget_events", "", &[], &[V1]);

    fn of(spec: &'static TableSpec) -> TableMigrations {
        TableMigrations {
            spec,
            type_name: "tests::Widget",
        }
    }

    /// Runs `test` with a pool whose search_path is a schema of its own, then drops the
    /// schema whether or not the test panicked.
    async fn in_fresh_schema<F, Fut>(test: F)
    where
        F: FnOnce(PgPool) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let db = crate::testing::TestSchema::new()
            .await
            .expect("a test schema");
        let pool = db.connect(8).await.expect("a pool on the test schema");
        let outcome = tokio::spawn(test(pool.clone())).await;
        pool.close().await;
        db.drop_schema().await.expect("drop the test schema");
        if let Err(e) = outcome {
            std::panic::resume_unwind(e.into_panic());
        }
    }

    fn applied(report: &MigrationReport) -> Vec<(&str, &str)> {
        report
            .applied()
            .iter()
            .map(|m| (m.target(), m.name()))
            .collect()
    }

    async fn history(pool: &PgPool, table: &str) -> Vec<(i32, String)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT version, name FROM {table} ORDER BY version"
        )))
        .fetch_all(pool)
        .await
        .expect("read history")
    }

    async fn tables_named(pool: &PgPool, name: &str) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_class \
             WHERE relname = $1 AND relnamespace = current_schema()::regnamespace",
        )
        .bind(name)
        .fetch_one(pool)
        .await
        .expect("count tables")
    }

    fn history_of(rows: &[(i32, &str)]) -> Vec<(i32, String)> {
        rows.iter().map(|&(v, n)| (v, n.to_owned())).collect()
    }

    #[tokio::test]
    async fn migrate_is_idempotent() {
        in_fresh_schema(|pool| async move {
            let first = migrate(&pool, &[of(&WIDGETS_V2)]).await.expect("first run");
            assert_eq!(
                applied(&first),
                [
                    ("outbox_catalog", "V1__create_outbox_catalog"),
                    ("widget_events", "V1__create_widget_events"),
                    ("widget_events", "V2__add_extra")
                ]
            );
            let second = migrate(&pool, &[of(&WIDGETS_V2)])
                .await
                .expect("second run");
            assert!(second.is_empty(), "second run applied {second:?}");
            assert_eq!(
                history(&pool, WIDGET_HISTORY).await,
                history_of(&[(1, "create_widget_events"), (2, "add_extra")])
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_new_version_applies_alone() {
        in_fresh_schema(|pool| async move {
            let first = migrate(&pool, &[of(&WIDGETS_V1)]).await.expect("V1");
            assert_eq!(
                applied(&first),
                [
                    ("outbox_catalog", "V1__create_outbox_catalog"),
                    ("widget_events", "V1__create_widget_events")
                ]
            );
            let second = migrate(&pool, &[of(&WIDGETS_V2)]).await.expect("V1+V2");
            assert_eq!(applied(&second), [("widget_events", "V2__add_extra")]);
            assert_eq!(second.applied()[0].version(), 2);
            verify(&pool, &[of(&WIDGETS_V2)]).await.expect("verify");
        })
        .await;
    }

    #[tokio::test]
    async fn tables_keep_separate_histories() {
        in_fresh_schema(|pool| async move {
            migrate(&pool, &[of(&WIDGETS_V2)]).await.expect("widgets");
            // Adding an event type starts its own sequence at 1.
            let report = migrate(&pool, &[of(&WIDGETS_V2), of(&GADGETS_V1)])
                .await
                .expect("widgets and gadgets");
            assert_eq!(
                applied(&report),
                [("gadget_events", "V1__create_gadget_events")]
            );
            assert_eq!(
                history(&pool, WIDGET_HISTORY).await,
                history_of(&[(1, "create_widget_events"), (2, "add_extra")])
            );
            assert_eq!(
                history(&pool, "gadget_events_history").await,
                history_of(&[(1, "create_gadget_events")])
            );
            assert_eq!(tables_named(&pool, "refinery_schema_history").await, 0);
        })
        .await;
    }

    #[tokio::test]
    async fn an_edited_migration_is_refused_with_what_changed() {
        in_fresh_schema(|pool| async move {
            migrate(&pool, &[of(&WIDGETS_V1)]).await.expect("V1");
            sqlx::query("ALTER TABLE widget_events ADD COLUMN gone text")
                .execute(&pool)
                .await
                .expect("a column the type no longer has");
            let err = migrate(&pool, &[of(&WIDGETS_EDITED)])
                .await
                .expect_err("edited V1 must be refused");
            let message = err.to_string();
            let OutboxError::EventTypeChanged {
                table,
                version,
                changes,
            } = err
            else {
                panic!("expected EventTypeChanged, got {err:?}");
            };
            assert_eq!((table, version), ("widget_events", 1));
            assert_eq!(
                changes,
                "column `note` is `text`, expected `character varying(200)`; \
                 column `gone` (text) is in the table but no field maps to it"
            );
            for advice in [
                "add a field as an `Option<_>` with #[outbox(since = N)]",
                "never remove, rename, retype or reorder a field",
                "declare a new event type with its own table",
            ] {
                assert!(message.contains(advice), "{message}");
            }
            assert!(!message.contains("filesystem"), "{message}");
            assert_eq!(history(&pool, WIDGET_HISTORY).await.len(), 1);
        })
        .await;
    }

    #[tokio::test]
    async fn an_older_build_starts_against_a_table_a_newer_build_migrated() {
        in_fresh_schema(|pool| async move {
            migrate(&pool, &[of(&WIDGETS_V2)])
                .await
                .expect("the new build");
            // The previous build, during a rolling deploy or after a rollback.
            let report = migrate(&pool, &[of(&WIDGETS_V1)])
                .await
                .expect("the old build starts");
            assert!(report.is_empty(), "{report:?}");
            verify(&pool, &[of(&WIDGETS_V1)])
                .await
                .expect("its columns are there");
            assert_eq!(history(&pool, WIDGET_HISTORY).await.len(), 2);
            // A newer table that lost a column the old build needs is still drift.
            sqlx::query("ALTER TABLE widget_events DROP COLUMN note")
                .execute(&pool)
                .await
                .expect("drop");
            let err = migrate(&pool, &[of(&WIDGETS_V1)]).await.expect_err("drift");
            assert!(matches!(err, OutboxError::Drift { .. }), "{err:?}");
        })
        .await;
    }

    #[tokio::test]
    async fn a_refused_connection_says_where_and_why() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(500))
            .connect_lazy("postgres://outbox@127.0.0.1:1/orders")
            .expect("a lazy pool");
        let err = migrate(&pool, &[of(&WIDGETS_V1)])
            .await
            .expect_err("nothing listens on port 1");
        let message = err.to_string();
        assert!(
            matches!(&err, OutboxError::Connect { endpoint, .. } if endpoint == "127.0.0.1:1/orders as outbox"),
            "{err:?}"
        );
        assert!(message.contains("refused"), "{message}");
        assert!(err.is_transient(), "a server that is down may come up");
    }

    #[tokio::test]
    async fn a_corrupt_history_row_is_an_error() {
        in_fresh_schema(|pool| async move {
            migrate(&pool, &[of(&WIDGETS_V1)]).await.expect("V1");
            sqlx::query("UPDATE widget_events_history SET checksum = 'not a number'")
                .execute(&pool)
                .await
                .expect("corrupt");
            let err = migrate(&pool, &[of(&WIDGETS_V1)])
                .await
                .expect_err("corrupt history");
            assert!(
                matches!(&err, OutboxError::Migration { target, .. } if target == "widget_events"),
                "{err:?}"
            );
            assert!(format!("{err:?}").contains("checksum"), "{err:?}");
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_calls_apply_each_migration_once() {
        in_fresh_schema(|pool| async move {
            let calls: Vec<_> = (0..6)
                .map(|_| {
                    let pool = pool.clone();
                    tokio::spawn(async move { migrate(&pool, &[of(&WIDGETS_V2)]).await })
                })
                .collect();
            let mut total = 0;
            for call in calls {
                let report = call.await.expect("task").expect("concurrent migrate");
                total += report.applied().len();
            }
            assert_eq!(
                total, 3,
                "each migration (the catalog's too) applied exactly once"
            );
            assert_eq!(tables_named(&pool, "widget_events").await, 1);
            assert_eq!(history(&pool, WIDGET_HISTORY).await.len(), 2);
        })
        .await;
    }

    #[tokio::test]
    async fn verify_reports_drift() {
        in_fresh_schema(|pool| async move {
            let err = verify(&pool, &[of(&WIDGETS_V1)])
                .await
                .expect_err("no table yet");
            assert!(
                matches!(
                    err,
                    OutboxError::MissingTable {
                        table: "widget_events",
                        ..
                    }
                ),
                "{err:?}"
            );
            sqlx::query(
                "CREATE TABLE widget_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                 event_id integer NOT NULL, note text NOT NULL, unrelated text)",
            )
            .execute(&pool)
            .await
            .expect("hand-made table");
            let err = verify(&pool, &[of(&WIDGETS_V2)])
                .await
                .expect_err("drifted");
            let OutboxError::Drift { table, details } = &err else {
                panic!("expected Drift, got {err:?}");
            };
            assert_eq!(*table, "widget_events");
            assert_eq!(
                details,
                "column `event_id` is `integer`, expected `text`; \
                 column `note` is NOT NULL, expected nullable; \
                 missing column `extra` (bigint nullable); \
                 no unique index on `event_id` (enqueueing's `ON CONFLICT (event_id)` needs one)"
            );
            // A deferrable one cannot serve `ON CONFLICT`: still missing.
            sqlx::query("ALTER TABLE widget_events ADD CONSTRAINT later UNIQUE (event_id) DEFERRABLE")
                .execute(&pool)
                .await
                .expect("the deferrable constraint");
            let err = verify(&pool, &[of(&WIDGETS_V2)])
                .await
                .expect_err("still drifted");
            assert!(
                matches!(&err, OutboxError::Drift { details, .. } if details.contains("no unique index on `event_id`")),
                "{err:?}"
            );
            // With it (a unique constraint makes one), the rest is what differs.
            sqlx::query("ALTER TABLE widget_events DROP CONSTRAINT later, ADD UNIQUE (event_id)")
                .execute(&pool)
                .await
                .expect("the constraint");
            let err = verify(&pool, &[of(&WIDGETS_V2)])
                .await
                .expect_err("still drifted");
            assert!(
                matches!(&err, OutboxError::Drift { details, .. } if !details.contains("unique")),
                "{err:?}"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn migrate_checks_drift() {
        in_fresh_schema(|pool| async move {
            let err = migrate(&pool, &[of(&WIDGETS_WRONG_COLUMNS)])
                .await
                .expect_err("columns differ from the migration");
            assert!(
                matches!(&err, OutboxError::Drift { table: "widget_events", details }
                    if details == "column `event_id` is `text`, expected `uuid`"),
                "{err:?}"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn app_migrations_run_first_in_their_own_history() {
        in_fresh_schema(|pool| async move {
            let accounts = Migration::unapplied(
                "V1__create_accounts",
                "CREATE TABLE accounts (id bigint PRIMARY KEY)",
            )
            .expect("app migration");
            let app = Runner::new(&[accounts]);
            let report = migrate_with_app(&pool, &app, &[of(&WIDGETS_V2)])
                .await
                .expect("app and tables");
            assert_eq!(
                applied(&report),
                [
                    ("application", "V1__create_accounts"),
                    ("outbox_catalog", "V1__create_outbox_catalog"),
                    ("widget_events", "V1__create_widget_events"),
                    ("widget_events", "V2__add_extra")
                ]
            );
            assert_eq!(
                history(&pool, "refinery_schema_history").await,
                history_of(&[(1, "create_accounts")])
            );
            assert_eq!(tables_named(&pool, "accounts").await, 1);
            let again = migrate_with_app(&pool, &app, &[of(&WIDGETS_V2)])
                .await
                .expect("second run");
            assert!(again.is_empty(), "{again:?}");
        })
        .await;
    }

    #[test]
    fn a_malformed_spec_is_an_error_not_a_panic() {
        let Err(err) = table_runner(&NO_HISTORY_TABLE) else {
            panic!("an empty history table name must be refused");
        };
        assert!(
            matches!(&err, OutboxError::Migration { target, .. } if target == "widget_events"),
            "{err:?}"
        );
    }
}
