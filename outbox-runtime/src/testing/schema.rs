//! [`TestSchema`]: a fresh schema per test, dropped when the test is done, and the
//! leftovers of killed runs dropped a day later.

use std::thread;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};
use tokio::sync::OnceCell;
use uuid::Uuid;

use super::{TIMEOUT, TestSupportError, database_url, timed_out};

/// Connections per [`TestSchema::pool`].
const POOL_SIZE: u32 = 5;

/// The names of test schemas: this prefix and a UUIDv7, which says when it was created.
const SCHEMA_PREFIX: &str = "outbox_test_";

/// How old a test schema must be for a later test run to drop it: one whose test process
/// was killed (a cancelled run, a CI timeout) before it could drop its own.
const LEFTOVER_AGE: Duration = Duration::from_hours(24);

/// Whether this process dropped the leftovers already.
static LEFTOVERS_DROPPED: OnceCell<()> = OnceCell::const_new();

/// Drops the test schemas older than `age` that no session uses: what killed test runs
/// left behind. Best effort: a failure is logged and changes nothing.
async fn drop_leftovers(pool: &PgPool, age: Duration) {
    let names: Vec<String> = match sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1) \
         AND nspname NOT IN (SELECT application_name FROM pg_stat_activity \
         WHERE application_name IS NOT NULL)",
    )
    .bind(SCHEMA_PREFIX)
    .fetch_all(pool)
    .await
    {
        Ok(names) => names,
        Err(error) => {
            tracing::debug!(%error, "cannot list the leftover test schemas");
            return;
        }
    };
    let now = std::time::SystemTime::now();
    for name in names {
        // Only the harness's names: the prefix and a UUIDv7 in its simple form.
        let created = name
            .strip_prefix(SCHEMA_PREFIX)
            .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|id| Uuid::try_parse(id).ok())
            .filter(|id| id.get_version_num() == 7)
            .and_then(|id| id.get_timestamp())
            .map(|at| {
                let (secs, nanos) = at.to_unix();
                std::time::UNIX_EPOCH + Duration::new(secs, nanos)
            });
        let old = created.is_some_and(|at| now.duration_since(at).is_ok_and(|d| d > age));
        if !old {
            continue;
        }
        // Not waiting for a lock someone else holds on it (a session left open in a
        // transaction): the schema is left for a later run.
        let statements = format!(
            "BEGIN; SET LOCAL lock_timeout = '1s'; DROP SCHEMA IF EXISTS {} CASCADE; COMMIT",
            quote_ident(&name)
        );
        let Ok(mut conn) = pool.acquire().await else {
            return;
        };
        let dropped = sqlx::raw_sql(AssertSqlSafe(statements))
            .execute(&mut *conn)
            .await;
        if dropped.is_err() {
            // The failed transaction is still open on this connection: not the pool's.
            drop(conn.detach());
        }
        match dropped {
            Ok(_) => {
                tracing::info!(schema = %name, "dropped a test schema a killed run left behind");
            }
            Err(error) => {
                tracing::debug!(schema = %name, %error, "cannot drop a leftover test schema");
            }
        }
    }
}

/// A freshly created schema, dropped afterwards.
///
/// Call [`drop_schema`](Self::drop_schema) at the end of a test. If the test panics first,
/// dropping the value removes the schema instead, blocking until done: it terminates the
/// connections still using the schema, so an open transaction cannot block it.
#[derive(Debug)]
pub struct TestSchema {
    name: String,
    base_url: String,
    pool: PgPool,
    dropped: bool,
}

impl TestSchema {
    /// Creates `outbox_test_<uuid>` in the test database (see [`database_url`]) and a pool of
    /// up to 5 connections whose `search_path` is that schema alone.
    pub async fn new() -> Result<TestSchema, TestSupportError> {
        Self::new_in(&database_url().await?).await
    }

    /// Creates `outbox_test_<uuid>` in the database at `base_url` (e.g. a dedicated
    /// [`Cluster`](super::Cluster)'s [`url`](super::Cluster::url)), with a pool like [`new`](Self::new)'s.
    pub async fn new_in(base_url: &str) -> Result<TestSchema, TestSupportError> {
        let base_url = base_url.to_owned();
        let name = format!("{SCHEMA_PREFIX}{}", Uuid::now_v7().simple());
        // A `search_path` naming a schema that does not exist yet is fine, so the pool can
        // create it.
        let pool = open_pool(&base_url, &name, POOL_SIZE).await?;
        let create = format!("CREATE SCHEMA {}", quote_ident(&name));
        sqlx::query(AssertSqlSafe(create)).execute(&pool).await?;
        LEFTOVERS_DROPPED
            .get_or_init(|| drop_leftovers(&pool, LEFTOVER_AGE))
            .await;
        Ok(TestSchema {
            name,
            base_url,
            pool,
            dropped: false,
        })
    }

    /// The pool; every connection has `search_path` set to this schema, also after reconnects.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema's name, a plain identifier that needs no quoting.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A connection URL that selects this schema, for child processes: the base URL plus
    /// `options=-csearch_path%3D<name>` (understood by sqlx and libpq) and an
    /// `application_name` that lets a panicking test's cleanup terminate those connections.
    pub fn url(&self) -> String {
        schema_url(&self.base_url, &self.name)
    }

    /// Opens an extra, separate pool on the same schema (e.g. to act as a second publisher).
    pub async fn connect(&self, max_connections: u32) -> Result<PgPool, TestSupportError> {
        open_pool(&self.base_url, &self.name, max_connections).await
    }

    /// Drops the schema (`CASCADE`) and closes the pool. The schema's other sessions (by
    /// their `application_name`: a transaction the test left open, a relay or a child
    /// process still running) are ended first: their locks would hold `DROP SCHEMA`
    /// forever.
    pub async fn drop_schema(mut self) -> Result<(), TestSupportError> {
        let mut conn = self.pool.acquire().await?;
        end_other_sessions(&mut conn, &self.name).await?;
        sqlx::query(drop_schema_sql(&self.name))
            .execute(&mut *conn)
            .await?;
        drop(conn);
        self.dropped = true;
        self.pool.close().await;
        Ok(())
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (base_url, name) = (self.base_url.clone(), self.name.clone());
        // Drop may run on a runtime thread (or outside any runtime): a thread with its own
        // runtime can block here without waiting on tasks of the runtime it blocks.
        let cleanup = thread::Builder::new()
            .name("outbox-test-schema-drop".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let result = match runtime {
                    Ok(runtime) => runtime.block_on(async {
                        tokio::time::timeout(TIMEOUT, drop_leftover_schema(&base_url, &name))
                            .await
                            .unwrap_or_else(|_| Err(timed_out()))
                    }),
                    Err(error) => Err(sqlx::Error::Io(error)),
                };
                if let Err(error) = result {
                    tracing::warn!(schema = %name, %error, "could not drop test schema");
                }
            });
        if let Ok(cleanup) = cleanup {
            let _ = cleanup.join();
        }
    }
}

async fn open_pool(
    base_url: &str,
    schema: &str,
    max_connections: u32,
) -> Result<PgPool, TestSupportError> {
    let options = base_url
        .parse::<PgConnectOptions>()?
        // A startup option rather than `SET`, so connections the pool opens later get it too.
        .options([("search_path", schema)])
        .application_name(schema);
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(TIMEOUT)
        .connect_with(options)
        .await?)
}

fn schema_url(base_url: &str, schema: &str) -> String {
    let separator = if base_url.contains('?') { '&' } else { '?' };
    format!("{base_url}{separator}options=-csearch_path%3D{schema}&application_name={schema}")
}

async fn drop_leftover_schema(base_url: &str, schema: &str) -> Result<(), sqlx::Error> {
    let mut connection = PgConnection::connect(base_url).await?;
    end_other_sessions(&mut connection, schema).await?;
    sqlx::query(drop_schema_sql(schema))
        .execute(&mut connection)
        .await?;
    connection.close().await
}

/// Ends the sessions of `schema` (by their `application_name`) but `conn`'s own: a
/// transaction one left open would hold locks that block `DROP SCHEMA`.
async fn end_other_sessions(conn: &mut PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND pid <> pg_backend_pid()",
    )
    .bind(schema)
    .execute(conn)
    .await
    .map(drop)
}

fn drop_schema_sql(schema: &str) -> AssertSqlSafe<String> {
    AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        quote_ident(schema)
    ))
}

fn quote_ident(identifier: &str) -> String {
    format!("\"{}\"", identifier.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn schema_exists(name: &str) -> bool {
        let mut connection = PgConnection::connect(&database_url().await.unwrap())
            .await
            .unwrap();
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
            .bind(name)
            .fetch_one(&mut connection)
            .await
            .unwrap()
    }

    async fn current_schema(pool: &PgPool) -> String {
        sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn concurrent_schemas_are_separate() {
        let (a, b) = tokio::try_join!(TestSchema::new(), TestSchema::new()).unwrap();
        assert_ne!(a.name(), b.name());
        for schema in [&a, &b] {
            assert_eq!(current_schema(schema.pool()).await, schema.name());
            let extra = schema.connect(2).await.unwrap();
            assert_eq!(current_schema(&extra).await, schema.name());
            extra.close().await;
        }
        tokio::try_join!(a.drop_schema(), b.drop_schema()).unwrap();
    }

    #[tokio::test]
    async fn a_schema_a_killed_run_left_a_day_ago_is_dropped_and_a_recent_one_kept() {
        use uuid::{NoContext, Timestamp};
        let schema = TestSchema::new().await.unwrap();
        let two_days_ago = (std::time::SystemTime::now() - Duration::from_hours(48))
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let stamp = Timestamp::from_unix(NoContext, two_days_ago.as_secs(), 0);
        let left = format!("{SCHEMA_PREFIX}{}", Uuid::new_v7(stamp).simple());
        let recent = format!("{SCHEMA_PREFIX}{}", Uuid::now_v7().simple());
        for name in [&left, &recent] {
            sqlx::query(AssertSqlSafe(format!(
                "CREATE SCHEMA {}",
                quote_ident(name)
            )))
            .execute(schema.pool())
            .await
            .unwrap();
        }
        drop_leftovers(schema.pool(), LEFTOVER_AGE).await;
        assert!(!schema_exists(&left).await, "two days old: dropped");
        assert!(schema_exists(&recent).await, "a running test's: kept");
        assert!(schema_exists(schema.name()).await, "in use: kept");
        sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA {}",
            quote_ident(&recent)
        )))
        .execute(schema.pool())
        .await
        .unwrap();
        schema.drop_schema().await.unwrap();
    }

    #[tokio::test]
    async fn url_selects_the_schema() {
        let schema = TestSchema::new().await.unwrap();
        let pool = PgPool::connect(&schema.url()).await.unwrap();
        assert_eq!(current_schema(&pool).await, schema.name());
        pool.close().await;
        schema.drop_schema().await.unwrap();
    }

    #[test]
    fn url_appends_to_an_existing_query() {
        assert_eq!(
            schema_url("postgres://h/db?sslmode=disable", "s"),
            "postgres://h/db?sslmode=disable&options=-csearch_path%3Ds&application_name=s"
        );
    }

    /// A fresh schema with a table `t` in it, and the schema's name.
    async fn schema_with_a_table() -> (TestSchema, String) {
        let schema = TestSchema::new().await.unwrap();
        let name = schema.name().to_owned();
        sqlx::query("CREATE TABLE t (id int)")
            .execute(schema.pool())
            .await
            .unwrap();
        (schema, name)
    }

    #[tokio::test]
    async fn drop_schema_drops_it() {
        let (schema, name) = schema_with_a_table().await;
        schema.drop_schema().await.unwrap();
        assert!(!schema_exists(&name).await);
    }

    #[tokio::test]
    async fn drop_schema_drops_it_despite_a_transaction_on_another_pool() {
        let (schema, name) = schema_with_a_table().await;
        let other = schema.connect(1).await.unwrap();
        let mut transaction = other.begin().await.unwrap();
        sqlx::query("LOCK TABLE t")
            .execute(&mut *transaction)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), schema.drop_schema())
            .await
            .expect("not held by the lock")
            .unwrap();
        assert!(!schema_exists(&name).await);
        drop(transaction);
    }

    #[tokio::test]
    async fn dropping_drops_it_despite_an_open_transaction() {
        let schema = TestSchema::new().await.unwrap();
        let name = schema.name().to_owned();
        let mut transaction = schema.pool().begin().await.unwrap();
        sqlx::query("CREATE TABLE t (id int)")
            .execute(&mut *transaction)
            .await
            .unwrap();
        drop(schema);
        assert!(!schema_exists(&name).await);
        drop(transaction);
    }
}
