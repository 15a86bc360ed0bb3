//! A fresh schema per test (on `DATABASE_URL`, or a throwaway cluster), with the event
//! tables migrated as `outbox::migrate` does in production.

use outbox::schema::TableMigrations;
use outbox::testing::TestSchema;
use sqlx::AssertSqlSafe;

use super::TestResult;

/// Where the generations of a freshly migrated table start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generations {
    /// At the random value the migration picks, as in production (so that a claim can
    /// never match another table's row): what the event tests check.
    Random,
    /// At 0, as in the recovery lab's article, so that expectations read 1, 2, 3: the
    /// relay tests and the lab, which count claims by their generations.
    FromZero,
}

/// Migrates `tables` into `db`, their generations starting as `generations` says.
pub async fn migrate(
    db: &TestSchema,
    tables: &[TableMigrations],
    generations: Generations,
) -> TestResult {
    outbox::migrate(db.pool(), tables).await?;
    if generations == Generations::FromZero {
        for table in tables {
            sqlx::query(AssertSqlSafe(format!(
                "ALTER TABLE {} ALTER COLUMN generation SET DEFAULT 0",
                table.table()
            )))
            .execute(db.pool())
            .await?;
        }
    }
    Ok(())
}

/// A fresh schema with `tables` migrated; generations start at a random value, as in
/// production.
pub async fn schema_with(tables: &[TableMigrations]) -> TestResult<TestSchema> {
    let db = TestSchema::new().await?;
    migrate(&db, tables, Generations::Random).await?;
    Ok(db)
}

/// A fresh schema with `tables` migrated and their generations starting at 0
/// ([`Generations::FromZero`]).
pub async fn schema_from_zero(tables: &[TableMigrations]) -> TestResult<TestSchema> {
    let db = TestSchema::new().await?;
    migrate(&db, tables, Generations::FromZero).await?;
    Ok(db)
}
