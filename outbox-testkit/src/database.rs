//! [`TestDatabase`]: a freshly created database, for the tests that need targets a
//! schema cannot stand in for (made unreachable with `ALLOW_CONNECTIONS false`), dropped
//! afterwards; the leftovers of killed runs dropped a day later.

use std::time::Duration;

use outbox::testing::database_url;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::TestResult;

/// The names of test databases: this prefix and a UUIDv7 (when it was created).
const PREFIX: &str = "outbox_testdb_";

/// A database of the test's own.
pub struct TestDatabase {
    name: String,
    url: String,
    options: PgConnectOptions,
    admin: PgPool,
    pool: PgPool,
}

impl TestDatabase {
    /// Creates `outbox_testdb_<uuid>` on the test server ([`database_url`]).
    pub async fn new() -> TestResult<Self> {
        let base_url = database_url().await?;
        let base: PgConnectOptions = base_url.parse()?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(base.clone())
            .await?;
        drop_leftovers(&admin).await;
        let name = format!("{PREFIX}{}", Uuid::now_v7().simple());
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await?;
        let options = base.database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options.clone());
        Ok(Self {
            url: with_database(&base_url, &name),
            name,
            options,
            admin,
            pool,
        })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How to connect to it.
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }

    /// Its URL, for child processes: the test server's, naming this database.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Refuses every new connection (superusers' too) and ends the open ones, or lets
    /// connections in again.
    pub async fn set_reachable(&self, reachable: bool) -> TestResult {
        sqlx::query(AssertSqlSafe(format!(
            "ALTER DATABASE {} WITH ALLOW_CONNECTIONS {reachable}",
            self.name
        )))
        .execute(&self.admin)
        .await?;
        if !reachable {
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            )
            .bind(&self.name)
            .execute(&self.admin)
            .await?;
        }
        Ok(())
    }

    /// Drops it, ending its sessions first.
    pub async fn drop_database(self) -> TestResult {
        self.pool.close().await;
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&self.admin)
        .await?;
        self.admin.close().await;
        Ok(())
    }
}

/// Drops the test databases created over a day ago: what killed runs left behind.
async fn drop_leftovers(admin: &PgPool) {
    let Ok(names) = sqlx::query_scalar::<_, String>(
        "SELECT datname::text FROM pg_database WHERE starts_with(datname, $1)",
    )
    .bind(PREFIX)
    .fetch_all(admin)
    .await
    else {
        return;
    };
    for name in names {
        let created = name
            .strip_prefix(PREFIX)
            .and_then(|id| Uuid::try_parse(id).ok())
            .and_then(|id| id.get_timestamp())
            .map(|at| {
                let (secs, nanos) = at.to_unix();
                std::time::UNIX_EPOCH + Duration::new(secs, nanos)
            });
        let old = created.is_some_and(|at| {
            std::time::SystemTime::now()
                .duration_since(at)
                .is_ok_and(|age| age > Duration::from_hours(24))
        });
        if old {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(admin)
            .await;
        }
    }
}

/// `url` (`postgres://user:password@host:port/database?parameters`) naming `database`.
fn with_database(url: &str, database: &str) -> String {
    let authority = url.find("://").map_or(0, |at| at + 3);
    let path = url[authority..].find('/').map(|at| authority + at);
    let query = url[authority..].find('?').map(|at| authority + at);
    let (head, tail) = match (path, query) {
        (Some(path), Some(query)) if path < query => (&url[..path], &url[query..]),
        (Some(path), None) => (&url[..path], ""),
        (_, Some(query)) => (&url[..query], &url[query..]),
        (None, None) => (url, ""),
    };
    format!("{head}/{database}{tail}")
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn a_url_names_another_database_and_keeps_the_rest() {
        assert_eq!(
            with_database("postgres://root@127.0.0.1:5432/test", "t1"),
            "postgres://root@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "t1"),
            "postgres://u:p@h/t1?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:1?x=y", "t1"),
            "postgres://h:1/t1?x=y"
        );
        assert_eq!(with_database("postgres://h", "t1"), "postgres://h/t1");
    }
}
