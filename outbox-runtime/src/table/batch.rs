//! Recording a batch's outcomes, and renewing its leases: one guarded statement each.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use tokio::time::Instant;

use super::claim::{Claim, Lease};
use crate::error::{OutboxError, ascii_reason, storable_reason};
use crate::spec::{Outbox, Statement, interval};
use outbox_internals::{Outcome as Recording, Status};

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
    /// [`Release`](Self::Release), the destination unavailable: the reason goes to
    /// `last_error`, so that an outage shows in the table.
    Unavailable { error: String },
}

impl Outcome {
    /// This outcome, its reason with every non-ASCII character escaped
    /// ([`ascii_reason`]).
    pub(crate) fn in_ascii(self) -> Self {
        match self {
            Self::Retry { delay, error } => Self::Retry {
                delay,
                error: ascii_reason(error),
            },
            Self::Dead { error } => Self::Dead {
                error: ascii_reason(error),
            },
            Self::Unavailable { error } => Self::Unavailable {
                error: ascii_reason(error),
            },
            other => other,
        }
    }
}

/// A row the relay owns: id and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owned {
    pub(crate) id: i64,
    pub(crate) generation: i64,
}

impl Owned {
    /// The row `claim` owns, as the guarded statements name it.
    pub(crate) fn of<T: Outbox>(claim: &Claim<T>) -> Self {
        Self {
            id: claim.id(),
            generation: claim.generation().get(),
        }
    }
}

/// What recording a batch's outcomes did to its rows.
#[derive(Debug)]
pub(crate) enum Recorded {
    /// An all-`SENT` batch: the rows recorded; a row missing here was stale.
    Sent(HashSet<i64>),
    /// The status each recorded row was left in, by id; a row missing here was stale.
    Statuses(HashMap<i64, Status>),
}

impl Recorded {
    /// The status row `id` was left in, or `None` if its outcome was rejected as stale.
    pub(crate) fn status(&self, id: i64) -> Option<Status> {
        match self {
            Self::Sent(recorded) => recorded.contains(&id).then_some(Status::Sent),
            Self::Statuses(statuses) => statuses.get(&id).copied(),
        }
    }
}

/// Records `outcomes` in one guarded statement.
pub(crate) async fn record<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    outcomes: &[(Owned, Outcome)],
) -> Result<Recorded, OutboxError> {
    let spec = T::SPEC;
    let db = |e| OutboxError::from_sqlx(spec.table, e);
    let (ids, generations) = columns(outcomes.iter().map(|(row, _)| row));
    if outcomes.iter().all(|(_, o)| *o == Outcome::Sent) {
        let recorded: Vec<i64> = sqlx::query_scalar(spec.sql.get(Statement::CompleteBatch))
            .bind(ids)
            .bind(generations)
            .fetch_all(executor)
            .await
            .map_err(db)?;
        Ok(Recorded::Sent(recorded.into_iter().collect()))
    } else {
        let (mut kinds, mut delays, mut errors) = (
            Vec::with_capacity(outcomes.len()),
            Vec::with_capacity(outcomes.len()),
            Vec::with_capacity(outcomes.len()),
        );
        for (_, outcome) in outcomes {
            let (kind, delay, error) = match outcome {
                Outcome::Sent => (Recording::Sent, Duration::ZERO, None),
                Outcome::Retry { delay, error } => (Recording::Retry, *delay, Some(error.as_str())),
                Outcome::Dead { error } => (Recording::Dead, Duration::ZERO, Some(error.as_str())),
                Outcome::Release => (Recording::Release, Duration::ZERO, None),
                Outcome::Unavailable { error } => {
                    (Recording::Release, Duration::ZERO, Some(error.as_str()))
                }
            };
            kinds.push(kind.as_sql());
            delays.push(interval(delay));
            errors.push(error.map(storable_reason));
        }
        let statuses: Vec<(i64, String)> = sqlx::query_as(spec.sql.get(Statement::Record))
            .bind(ids)
            .bind(generations)
            .bind(kinds)
            .bind(delays)
            .bind(errors)
            .fetch_all(executor)
            .await
            .map_err(db)?;
        // The table's CHECK allows only the four statuses.
        Ok(Recorded::Statuses(
            statuses
                .into_iter()
                .filter_map(|(id, status)| Some((id, Status::from_sql(&status)?)))
                .collect(),
        ))
    }
}

/// Extends the leases of `rows`; returns the rows still owned, with their new lease.
pub(crate) async fn renew<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    rows: &[Owned],
) -> Result<Vec<(i64, Lease)>, OutboxError> {
    let spec = T::SPEC;
    let (ids, generations) = columns(rows);
    let sent = Instant::now();
    let renewed: Vec<(i64, DateTime<Utc>)> = sqlx::query_as(spec.sql.get(Statement::RenewBatch))
        .bind(ids)
        .bind(generations)
        .fetch_all(executor)
        .await
        .map_err(|e| OutboxError::from_sqlx(spec.table, e))?;
    Ok(renewed
        .into_iter()
        .map(|(id, until)| (id, Lease::granted::<T>(until, sent)))
        .collect())
}

/// The id and generation arrays every guarded batch statement binds first.
fn columns<'a>(rows: impl IntoIterator<Item = &'a Owned>) -> (Vec<i64>, Vec<i64>) {
    rows.into_iter().map(|r| (r.id, r.generation)).unzip()
}
