//! Outbox rows: enqueued in one transaction, read back as the database holds them, and
//! moved by fixtures where a test cannot wait for time to pass.

use outbox::{EventId, Outbox};
use sqlx::{AssertSqlSafe, PgPool};

/// Which row of a table: by its `id` (what a claim holds) or by its `event_id`.
#[derive(Clone, Copy, Debug)]
pub enum Key<'a> {
    Id(i64),
    EventId(&'a str),
}

impl From<i64> for Key<'_> {
    fn from(id: i64) -> Self {
        Key::Id(id)
    }
}

impl<'a> From<&'a str> for Key<'a> {
    fn from(event_id: &'a str) -> Self {
        Key::EventId(event_id)
    }
}

impl<'a> From<&'a EventId> for Key<'a> {
    fn from(event_id: &'a EventId) -> Self {
        Key::EventId(event_id.as_str())
    }
}

/// One outbox row, as the database sees it now.
#[derive(Debug)]
pub struct Row {
    pub status: String,
    pub generation: i64,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub next_attempt_at: chrono::DateTime<chrono::Utc>,
    /// Seconds until `next_attempt_at` (negative once due).
    pub due_in: f64,
    /// Seconds left on the lease, when claimed.
    pub lease_left: Option<f64>,
}

/// The row `key` of `T`'s table.
pub async fn fetch_row<'a, T: Outbox>(
    pool: &PgPool,
    key: impl Into<Key<'a>>,
) -> Result<Row, sqlx::Error> {
    let key = key.into();
    let column = match key {
        Key::Id(_) => "id",
        Key::EventId(_) => "event_id",
    };
    let sql = format!(
        "SELECT status, generation, attempts, last_error, next_attempt_at, \
         extract(epoch FROM next_attempt_at - clock_timestamp())::float8, \
         extract(epoch FROM lease_until - clock_timestamp())::float8 \
         FROM {} WHERE {column} = $1",
        T::SPEC.table()
    );
    let query = sqlx::query_as(AssertSqlSafe(sql));
    let query = match key {
        Key::Id(id) => query.bind(id),
        Key::EventId(event_id) => query.bind(event_id),
    };
    let (status, generation, attempts, last_error, next_attempt_at, due_in, lease_left) =
        query.fetch_one(pool).await?;
    Ok(Row {
        status,
        generation,
        attempts,
        last_error,
        next_attempt_at,
        due_in,
        lease_left,
    })
}

/// The row `key` of `T`'s table; fails the test if there is none.
pub async fn row_of<'a, T: Outbox>(pool: &PgPool, key: impl Into<Key<'a>>) -> Row {
    let key = key.into();
    fetch_row::<T>(pool, key)
        .await
        .unwrap_or_else(|e| panic!("row {key:?}: {e}"))
}

/// The status of row `key` of `T`'s table.
pub async fn status<'a, T: Outbox>(pool: &PgPool, key: impl Into<Key<'a>>) -> String {
    row_of::<T>(pool, key).await.status
}

/// How many rows of `T`'s table have `status`.
pub async fn count<T: Outbox>(pool: &PgPool, status: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {} WHERE status = $1", T::SPEC.table());
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(status)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Enqueues `events` in one transaction.
pub async fn enqueue<T: Outbox>(pool: &PgPool, events: &[T]) -> Vec<EventId> {
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::with_capacity(events.len());
    for event in events {
        ids.push(
            outbox::table::enqueue(event, &mut *tx)
                .await
                .unwrap()
                .into_event_id(),
        );
    }
    tx.commit().await.unwrap();
    ids
}

/// Moves the lease of row `id` of `T`'s table into the past, as if its publisher had
/// died a while ago: what the article's fixture does instead of waiting for the lease.
pub async fn expire<T: Outbox>(pool: &PgPool, id: i64) -> Result<(), sqlx::Error> {
    let sql = format!(
        "UPDATE {} SET lease_until = statement_timestamp() - interval '1 second' WHERE id = $1",
        T::SPEC.table()
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(id)
        .execute(pool)
        .await
        .map(drop)
}

/// Makes the event `event_id` of `T`'s table due `seconds` from now (in the past when
/// negative), as if a retry were waiting out its delay, or that delay were over.
pub async fn due_in<T: Outbox>(pool: &PgPool, event_id: &str, seconds: f64) {
    let sql = format!(
        "UPDATE {} SET next_attempt_at = statement_timestamp() + $2 * interval '1 second' \
         WHERE event_id = $1",
        T::SPEC.table()
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(event_id)
        .bind(seconds)
        .execute(pool)
        .await
        .unwrap();
}
