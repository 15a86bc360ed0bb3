//! refinery's async driver over a sqlx connection, so migrations need no second driver.

use refinery_core::traits::r#async::{AsyncMigrate, AsyncQuery, AsyncTransaction};
use refinery_core::{Migration, SchemaVersion};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// refinery's async driver over a sqlx connection, so migrations need no second driver.
pub(crate) struct SqlxDriver<'c>(pub(crate) &'c mut PgConnection);

impl AsyncTransaction for SqlxDriver<'_> {
    type Error = sqlx::Error;

    /// Runs `queries` in one transaction: refinery passes a migration together with
    /// the insert of its history row, which must commit or roll back as one.
    async fn execute<'a, T: Iterator<Item = &'a str> + Send + 'a>(
        &'a mut self,
        queries: T,
    ) -> Result<usize, Self::Error> {
        let mut tx = self.0.begin().await?;
        let mut count = 0;
        for query in queries {
            // Migration SQL is the application's own, and history rows are
            // refinery's; `raw_sql` also allows several statements per migration.
            sqlx::raw_sql(AssertSqlSafe(query))
                .execute(&mut *tx)
                .await?;
            count += 1;
        }
        tx.commit().await?;
        Ok(count)
    }
}

impl AsyncQuery<Vec<Migration>> for SqlxDriver<'_> {
    /// Reads applied migrations from a history table.
    async fn query<'a>(&'a mut self, query: &'a str) -> Result<Vec<Migration>, Self::Error> {
        let rows = sqlx::raw_sql(AssertSqlSafe(query))
            .fetch_all(&mut *self.0)
            .await?;
        rows.iter().map(applied_migration).collect()
    }
}

impl AsyncMigrate for SqlxDriver<'_> {}

/// Decodes one history row (`version`, `name`, `applied_on` RFC 3339, `checksum` u64 as
/// text); a row refinery did not write is an error, not a panic.
fn applied_migration(row: &PgRow) -> Result<Migration, sqlx::Error> {
    let version: SchemaVersion = row.try_get("version")?;
    let name: String = row.try_get("name")?;
    let applied_on: String = row.try_get("applied_on")?;
    let checksum: String = row.try_get("checksum")?;
    let applied_on =
        OffsetDateTime::parse(&applied_on, &Rfc3339).map_err(|e| sqlx::Error::ColumnDecode {
            index: "applied_on".into(),
            source: Box::new(e),
        })?;
    let checksum = checksum
        .parse::<u64>()
        .map_err(|e| sqlx::Error::ColumnDecode {
            index: "checksum".into(),
            source: Box::new(e),
        })?;
    Ok(Migration::applied(version, name, applied_on, checksum))
}
