//! A batch's outcomes, recorded in one guarded statement; the rows they are recorded for.

use std::collections::{HashMap, HashSet};

use sqlx::PgExecutor;

use super::row::{Outcome, Owned};
use super::statements;
use crate::error::OutboxError;
use crate::spec::Outbox;
use outbox_internals::Status;

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
