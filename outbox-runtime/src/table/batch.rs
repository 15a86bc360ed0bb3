//! A batch's outcomes, recorded in one guarded statement; the rows they are recorded for.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::PgExecutor;

use super::claim::Claim;
use super::statements;
use crate::error::{OutboxError, ascii_reason};
use crate::spec::Outbox;
use outbox_internals::Status;

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

/// Records `outcomes` in one guarded statement: [`statements::complete_batch`] when every
/// row was published, [`statements::record`] otherwise.
pub(crate) async fn record<'e, T: Outbox>(
    executor: impl PgExecutor<'e>,
    outcomes: &[(Owned, Outcome)],
) -> Result<Recorded, OutboxError> {
    Ok(if outcomes.iter().all(|(_, o)| *o == Outcome::Sent) {
        let rows = outcomes.iter().map(|(row, _)| row);
        Recorded::Sent(statements::complete_batch::<T>(executor, rows).await?)
    } else {
        Recorded::Statuses(statements::record::<T>(executor, outcomes).await?)
    })
}
