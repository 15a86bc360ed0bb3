//! Renewing the leases of a batch while the sink has it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use super::connection::Connection;
use super::in_flight::InFlight;
use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::row::{Lease, Owned};
use crate::table::statements;

/// The lease renewals of one batch in flight: every third of the lease, each bounded by
/// a third of the lease and by the lease's end, on the worker's connection, or on another from the pool while
/// the transaction beside the send has it (that one may wait on a lock for longer than
/// a lease). Guarded like the outcomes: a row whose renewal is rejected belongs to
/// someone else now.
pub(super) struct Renewal<'r, 'a, T: Outbox> {
    /// The batch's rows; those still owned are renewed.
    rows: &'r [InFlight<'a, T>],
    /// A third of the lease: between renewals, and how long one may take.
    every: Duration,
    /// When the next renewal is due.
    next: Instant,
    /// When the earliest lease of the rows still owned ends.
    lease_deadline: Instant,
    /// Whether the last renewal got an answer (true before the first).
    answered: bool,
}

impl<'r, 'a, T: Outbox> Renewal<'r, 'a, T> {
    /// The renewals of `rows`, whose send started at `started`.
    pub(super) fn new(rows: &'r [InFlight<'a, T>], started: Instant) -> Self {
        let lease_deadline = deadline(rows.iter().map(|row| row.claim().lease_deadline()));
        let every = T::SPEC.lease / 3;
        // A third of the lease after the claim: a batch claimed ahead, while the one
        // before was in flight, is renewed as soon as it is due, not a third after its
        // send starts.
        let first = lease_deadline
            .checked_sub(2 * every)
            .map_or(started, |due| due.min(started + every));
        Self {
            rows,
            every,
            next: first,
            lease_deadline,
            answered: true,
        }
    }

    /// When the next renewal is due.
    pub(super) fn due(&self) -> Instant {
        self.next
    }

    /// When the earliest lease of the rows still owned ends: recording after that cannot
    /// succeed.
    pub(super) fn lease_deadline(&self) -> Instant {
        self.lease_deadline
    }

    /// Whether the last renewal got an answer from the database.
    pub(super) fn answered(&self) -> bool {
        self.answered
    }

    /// Whether every row was lost to another publisher.
    pub(super) fn lost_all(&self) -> bool {
        !self.rows.iter().any(InFlight::is_owned)
    }

    /// Renews the leases of the rows still owned, and schedules the next renewal.
    /// Returns the rows whose renewal was rejected, for the caller to [`lose`]; a renewal
    /// that fails or times out is logged, loses nothing, and is tried again next time.
    ///
    /// [`lose`]: InFlight::lose
    pub(super) async fn renew(&mut self, conn: &mut Connection<'_>) -> Vec<&'r InFlight<'a, T>> {
        self.next += self.every;
        let rows: Vec<Owned> = self
            .rows
            .iter()
            .filter(|row| row.is_owned())
            .map(InFlight::row)
            .collect();
        // Not past the lease's end by this process's clock: the batch is given up then.
        let limit = self.every.min(
            self.lease_deadline
                .saturating_duration_since(Instant::now()),
        );
        let Some(renewed) = renew_within::<T>(conn, &rows, limit, "trying again").await else {
            self.answered = false;
            return Vec::new();
        };
        self.answered = true;
        let still: HashSet<i64> = renewed.iter().map(|(id, _)| *id).collect();
        self.lease_deadline = deadline(renewed.iter().map(|(_, lease)| lease.deadline()));
        self.rows
            .iter()
            .filter(|row| row.is_owned() && !still.contains(&row.claim().id()))
            .collect()
    }
}

/// Renews the leases of a batch claimed ahead once its first renewal is due (a third of
/// its lease gone): while the batch before it is in flight, at each of that batch's
/// renewals, and before the sink gets it. A send can outlast a lease (`send_timeout`
/// is at least the lease), and a batch that waited unrenewed behind it would expire:
/// each of its events would spend an attempt without being sent. Rows whose renewal is
/// rejected were taken over meanwhile and are not published. A renewal that fails
/// keeps the rows with more than `needed` of their lease left by this process's clock
/// and drops the others: with the database not answering they could not be recorded.
/// While the batch waits, any lease left will do (it is renewed again at the next
/// tick); before the sink gets it, two thirds ([`Needed::ToSend`]: what a sink may rely
/// on, as the Kafka sink's message timeout does).
///
/// Returns the rows to publish, and those dropped only because an earlier event of
/// their key was: still this worker's, to hand back.
pub(super) async fn renew_ahead<T: Outbox>(
    conn: &mut Connection<'_>,
    mut ahead: Vec<Claim<T>>,
    needed: Needed,
) -> (Vec<Claim<T>>, Vec<Claim<T>>) {
    let table = T::SPEC.table;
    let every = T::SPEC.lease / 3;
    let earliest = deadline(ahead.iter().map(Claim::lease_deadline));
    if ahead.is_empty() || earliest > Instant::now() + 2 * every {
        return (ahead, Vec::new());
    }
    let rows: Vec<Owned> = ahead.iter().map(Owned::of).collect();
    let before = ahead.len();
    let Some(renewed) = renew_within::<T>(conn, &rows, every, "renewing again later").await else {
        let enough = Instant::now()
            + match needed {
                Needed::ToWait => Duration::ZERO,
                Needed::ToSend => 2 * every,
            };
        let behind =
            super::key_runs::retain_in_order(&mut ahead, |claim| claim.lease_deadline() > enough);
        if ahead.len() + behind.len() < before {
            tracing::warn!(
                table,
                dropped = before - ahead.len() - behind.len(),
                "events claimed ahead could not be renewed; not publishing them (claimed again once their leases end)"
            );
        }
        return (ahead, behind);
    };
    let renewed: HashMap<i64, Lease> = renewed.into_iter().collect();
    let behind = super::key_runs::retain_in_order(&mut ahead, |claim| {
        renewed
            .get(&claim.id())
            .map(|lease| claim.renewed(*lease))
            .is_some()
    });
    if ahead.len() + behind.len() < before {
        tracing::info!(
            table,
            lost = before - ahead.len() - behind.len(),
            behind = behind.len(),
            "events claimed ahead were taken over while they waited; not publishing them (nor the events of their keys after them, handed back)"
        );
    }
    (ahead, behind)
}

/// How much lease a row of a batch claimed ahead must have left, when its renewal fails,
/// to be kept.
#[derive(Debug, Clone, Copy)]
pub(super) enum Needed {
    /// Any: the batch waits behind the one in flight, and is renewed again.
    ToWait,
    /// Two thirds of it: the batch goes to the sink now.
    ToSend,
}

/// Renews the leases of `rows` within `limit` (so an unreachable database cannot hold
/// up the send timeout or the shutdown grace for long): the rows renewed, with their
/// new lease, or `None` when the renewal failed or timed out, logged with `then` (what
/// the caller does instead).
async fn renew_within<T: Outbox>(
    conn: &mut Connection<'_>,
    rows: &[Owned],
    limit: Duration,
    then: &str,
) -> Option<Vec<(i64, Lease)>> {
    let table = T::SPEC.table;
    let renewal = async { statements::renew_batch::<T>(conn.get().await?, rows).await };
    match tokio::time::timeout(limit, renewal).await {
        Ok(Ok(renewed)) => Some(renewed),
        Ok(Err(error)) => {
            // The pool tests it, and closes it if it is broken.
            conn.release();
            tracing::warn!(table, %error, "lease renewal failed; {then}");
            None
        }
        Err(_) => {
            // Cut off mid-statement: its server may never answer again.
            conn.discard();
            tracing::warn!(table, "lease renewal timed out; {then}");
            None
        }
    }
}

/// The earliest of the lease deadlines (now, if there is none).
pub(super) fn deadline(leases: impl Iterator<Item = Instant>) -> Instant {
    leases.min().unwrap_or_else(Instant::now)
}
