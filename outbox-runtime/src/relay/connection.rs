//! The worker's connection, kept from batch to batch, and a spare one for renewals.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

use crate::error::OutboxError;

/// The worker's connection: acquired when there is work, kept while there is. Each
/// pass through the pool costs two round trips (sqlx pings a connection when it is
/// acquired and when it is released), as much as a small batch's statements.
pub(crate) struct Connection<'p> {
    pub(crate) pool: &'p PgPool,
    pub(crate) table: &'static str,
    pub(crate) held: Option<PoolConnection<Postgres>>,
}

impl Connection<'_> {
    /// The connection held, or one from the pool.
    pub(crate) async fn get(&mut self) -> Result<&mut PgConnection, OutboxError> {
        let held = match self.held.take() {
            Some(held) => held,
            None => crate::connect::acquire(self.pool, self.table).await?,
        };
        Ok(self.held.insert(held))
    }

    /// Gives the connection back to the pool (which tests it, and closes it if it is
    /// broken).
    pub(crate) fn release(&mut self) {
        self.held = None;
    }

    /// Closes the connection instead of giving it back: it was cut off mid-statement
    /// and its server may never answer again.
    pub(crate) fn discard(&mut self) {
        if let Some(held) = self.held.take() {
            drop(held.detach());
        }
    }
}

/// A connection of `pool` other than the worker's, if one is idle or can be opened
/// within [`SPARE_WAIT`]; `None` when every connection is in use.
pub(crate) async fn spare_connection(pool: &PgPool) -> Option<PoolConnection<Postgres>> {
    if let Some(idle) = pool.try_acquire() {
        return Some(idle);
    }
    if pool.size() >= pool.options().get_max_connections() {
        return None;
    }
    tokio::time::timeout(SPARE_WAIT, pool.acquire())
        .await
        .ok()?
        .ok()
}

/// How long a renewal waits for a spare connection to open.
const SPARE_WAIT: Duration = Duration::from_millis(250);
