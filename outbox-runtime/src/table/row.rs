//! A claimed row as the statements name it and answer for it: the token that owns it, its
//! lease, the outcome to record for it, and where a retry left it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use crate::error::ascii_reason;
use crate::spec::Outbox;

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

/// A lease, by both clocks: its end by the database's clock, which the guards compare,
/// and by this process's monotonic clock, which the relay schedules by (its renewals,
/// whether an outcome can still be recorded). The second is the instant the statement
/// that granted the lease was sent, plus the lease: the database starts a lease when it
/// starts the statement, never earlier, so by then the lease is live whatever the two
/// hosts' wall clocks say (a relay whose clock is behind the database's would otherwise
/// renew late, and one ahead of it give up early).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lease {
    until: DateTime<Utc>,
    deadline: Instant,
}

impl Lease {
    /// The lease of `T`, ending at `until` by the database's clock, granted by a
    /// statement sent at `sent`.
    pub(crate) fn granted<T: Outbox>(until: DateTime<Utc>, sent: Instant) -> Self {
        Self {
            until,
            deadline: sent + T::SPEC.lease,
        }
    }

    /// When the lease ends, by the database's clock.
    pub(crate) fn until(&self) -> DateTime<Utc> {
        self.until
    }

    /// When the lease ends, by this process's monotonic clock, at the latest.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// Where a [`Claim::retry`](crate::Claim::retry) left the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Retried {
    /// Back to `READY`, due again after the delay.
    Scheduled,
    /// The attempt budget is spent: the row is `DEAD` with the reason in `last_error`.
    Dead,
}
