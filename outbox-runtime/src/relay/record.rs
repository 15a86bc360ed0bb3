//! Recording a batch's outcomes, and renewing its leases: one guarded statement each.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};

use crate::claim::{Claim, Claimed, dead_letter, decode_claim};
use crate::error::OutboxError;
use crate::spec::{Outbox, interval};

/// What to record for one claimed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Published: `SENT`.
    Sent,
    /// Failed, worth retrying after the delay (or `DEAD` if the budget is spent).
    Retry { delay: Duration, error: String },
    /// Failed for good: `DEAD`.
    Dead { error: String },
    /// Not sent (shutdown): back to `READY`, due now, the attempt not counted.
    Release,
}

/// A row the relay owns: id and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owned {
    pub(crate) id: i64,
    pub(crate) generation: i64,
}

/// Records `outcomes` and claims up to `limit` more rows, in one statement. Returns the
/// claims, and the status each recorded row was left in by id (a row missing there was
/// stale). Rows whose payload does not decode are moved to `DEAD` and not returned.
pub(crate) async fn record_and_claim<T: Outbox>(
    pool: &PgPool,
    outcomes: &[(Owned, Outcome)],
    limit: u32,
) -> Result<(Vec<Claim<T>>, Vec<(i64, String)>), OutboxError> {
    let spec = T::SPEC;
    let db = |e| OutboxError::from_sqlx(spec.table, e);
    let n = outcomes.len();
    let (mut ids, mut generations) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let (mut kinds, mut delays, mut errors) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (row, outcome) in outcomes {
        ids.push(row.id);
        generations.push(row.generation);
        let (kind, delay, error) = match outcome {
            Outcome::Sent => ("SENT", Duration::ZERO, None),
            Outcome::Retry { delay, error } => ("RETRY", *delay, Some(error.as_str())),
            Outcome::Dead { error } => ("DEAD", Duration::ZERO, Some(error.as_str())),
            Outcome::Release => ("RELEASE", Duration::ZERO, None),
        };
        kinds.push(kind);
        delays.push(interval(delay));
        errors.push(error);
    }
    let mut conn = pool.acquire().await.map_err(db)?;
    let rows = sqlx::query(spec.sql.record_and_claim)
        .bind(i64::from(limit))
        .bind(ids)
        .bind(generations)
        .bind(kinds)
        .bind(delays)
        .bind(errors)
        .fetch_all(&mut *conn)
        .await
        .map_err(db)?;

    let (mut claims, mut recorded, mut undecodable) =
        (Vec::with_capacity(rows.len()), Vec::new(), Vec::new());
    for row in &rows {
        if let Some(status) = row
            .try_get::<Option<String>, _>("outbox_recorded")
            .map_err(db)?
        {
            recorded.push((row.try_get(0).map_err(db)?, status));
            continue;
        }
        match decode_claim::<T>(row).map_err(db)? {
            Claimed::Claim(claim) => claims.push(claim),
            Claimed::Undecodable(bad) => undecodable.push(bad),
            Claimed::Exhausted => {}
        }
    }
    for bad in undecodable {
        dead_letter::<T>(&mut conn, bad).await?;
    }
    claims.sort_unstable_by_key(Claim::id);
    Ok((claims, recorded))
}

/// Extends the leases of `rows`; returns the rows still owned, with their new lease.
pub(crate) async fn renew<T: Outbox>(
    pool: &PgPool,
    rows: &[Owned],
) -> Result<Vec<(i64, DateTime<Utc>)>, OutboxError> {
    let spec = T::SPEC;
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let generations: Vec<i64> = rows.iter().map(|r| r.generation).collect();
    sqlx::query_as(spec.sql.renew_batch)
        .bind(ids)
        .bind(generations)
        .fetch_all(pool)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_are_truncated_to_what_an_interval_holds() {
        assert_eq!(
            interval(Duration::new(1, 123_456_789)),
            Duration::new(1, 123_456_000)
        );
        assert_eq!(interval(Duration::ZERO), Duration::ZERO);
        let jittered =
            crate::relay::Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for attempt in 1..20 {
            assert_eq!(interval(jittered.delay(attempt)).subsec_nanos() % 1_000, 0);
        }
    }
}
