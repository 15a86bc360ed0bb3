//! The batch transaction: the outcomes of the batches published, and the next claim.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use super::super::connection::Connection;
use super::super::key_runs;
use super::super::key_share::KeyPlan;
use super::super::pending::Pending;
use super::super::record;
use super::{Batch, Worker};
use crate::error::OutboxError;
use crate::sink::Sink;
use crate::spec::Outbox;
use crate::table::batch::Recorded;
use crate::table::claim::Claim;
use crate::table::claiming::{Runs, Scope};
use crate::table::metric;
use crate::table::row::{Outcome, Owned};
use outbox_internals::Status;

impl<T: Outbox, S: Sink<T>> Worker<T, S> {
    /// Records the `pending` outcomes and, with `claim_next`, claims the next batch in
    /// one transaction, recording first: [`record::record_and_claim`] says why that order.
    /// The claim starts at the relay's [`Frontier`], or sweeps.
    ///
    /// On a keyed table it goes on with the worker's share of keys ([`KeyShare`]), or
    /// all it has where the sink sets its pace ([`Worker::keeps_keys`]): the runs of the
    /// batch `in_flight`, the keys whose last event `pending` records, then keys another
    /// worker handed over, each from its last event. A key the worker lets go (beyond
    /// its share) is handed over once its last event is recorded `SENT`; one whose next
    /// event the claim did not take (none due yet, or held) may wait behind the
    /// frontier, which moves back to it ([`Frontier::behind`]).
    ///
    /// [`KeyShare`]: super::super::key_share::KeyShare
    /// [`Frontier`]: super::super::frontier::Frontier
    /// [`Frontier::behind`]: super::super::frontier::Frontier::behind
    pub(super) async fn record_and_claim(
        &self,
        conn: &mut Connection<'_>,
        pending: &Pending,
        claim_next: bool,
        in_flight: &[Claim<T>],
    ) -> Result<Batch<T>, OutboxError> {
        let flying: HashSet<&str> = in_flight.iter().filter_map(Claim::key).collect();
        let finished = pending
            .finished
            .iter()
            .filter(|finished| !flying.contains(finished.key.as_str()));
        let next = if claim_next {
            match self.frontier.next().await {
                // The first sweep saw every due row: nothing to claim, unless for a
                // signal that came after it began.
                None if !self.wakeups.stand_down() => self.frontier.next().await,
                next => next,
            }
        } else {
            None
        };
        let keyed = T::SPEC.key().is_some();
        let keys = KeyPlan::new(
            key_runs::tails(in_flight),
            finished,
            (keyed && next.is_some()).then_some(&*self.key_share),
            self.keeps_keys.load(Ordering::Relaxed),
        );
        let tails = keys.tails();
        let (scope, limit) = next
            .as_ref()
            .map_or((Scope::All, 0), |next| (next.scope, self.relay.batch_size));
        let claiming = next.is_some().then(|| self.wakeups.claiming());
        let limit_time = crate::table::claiming::transaction_limit(T::SPEC.lease);
        let runs = Runs::After {
            tails: &tails,
            length: self.relay.longest_run(),
        };
        let transaction = async {
            record::record_and_claim::<T>(conn.get().await?, &pending.outcomes, scope, limit, runs)
                .await
        };
        let done = tokio::time::timeout(limit_time, transaction).await;
        let (claimed, recorded) = match done {
            Ok(Ok(done)) => done,
            failed => {
                // Rolled back: the keys handed over to it wait for another claim.
                keys.give_back(&self.key_share);
                let Ok(Err(error)) = failed else {
                    conn.discard();
                    let silent = std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no answer from the database in {limit_time:?}; the connection is closed"
                        ),
                    );
                    return Err(OutboxError::Database {
                        table: T::SPEC.table,
                        source: sqlx::Error::Io(silent),
                    });
                };
                return Err(error);
            }
        };
        account::<T>(&self.relay.labels, &pending.outcomes, &recorded);
        // Committed: each retry's `next_attempt_at` is at most its delay from now.
        let soonest = pending
            .outcomes
            .iter()
            .filter_map(|(_, outcome)| match outcome {
                Outcome::Retry { delay, .. } => Some(*delay),
                _ => None,
            });
        if let Some(delay) = soonest.min() {
            self.wakeups.retry_at(tokio::time::Instant::now() + delay);
        }
        let more = claimed.full && !key_runs::took_runs(&claimed.claims);
        let taken: HashSet<&str> = claimed.claims.iter().filter_map(Claim::key).collect();
        let (over, behind) = keys.let_go(&taken, &recorded);
        if keyed {
            let carried: HashSet<&str> = flying.union(&taken).copied().collect();
            if self.key_share.settle(self.index, carried.len(), over) {
                self.wakeups.more();
            }
        }
        if let Some(next) = next {
            // A claim statement ran and found nothing due.
            if claimed.claims.is_empty() && !claimed.full {
                metrics::counter!(metric::IDLE_CLAIMS, self.relay.labels.iter()).increment(1);
            }
            next.settle(claimed.took, claimed.reached, behind, more);
        } else if let Some(behind) = behind {
            // No claim looked there: another worker will.
            self.frontier.retreat(behind);
            self.wakeups.more();
        }
        if let Some(claiming) = claiming {
            claiming.answered(more);
        }
        Ok(Batch {
            claims: claimed.claims,
            full: claimed.full,
            more,
            behind: Vec::new(),
        })
    }

    /// Stops the worker on a fatal `error`, recording the `pending` outcomes first, alone:
    /// the transaction that failed rolled back those it was recording, and the claim
    /// that failed beside them (a drifted table, a trigger that refuses it, a missing
    /// privilege) need not fail them too. Unrecorded, every event already published would
    /// be claimed and published again once its lease ends.
    pub(super) async fn stop_on(
        &self,
        error: OutboxError,
        conn: &mut Connection<'_>,
        pending: Pending,
    ) -> OutboxError {
        if !pending.outcomes.is_empty()
            && let Err(unrecorded) = self.record_and_claim(conn, &pending, false, &[]).await
        {
            tracing::error!(table = T::SPEC.table, error = %unrecorded, rows = pending.outcomes.len(),
                "cannot record the outcomes of a stopping worker; its events will be claimed and published again");
        }
        error
    }
}

/// Counts what happened to recorded outcomes.
fn account<T: Outbox>(
    labels: &[metrics::Label],
    outcomes: &[(Owned, Outcome)],
    recorded: &Recorded,
) {
    let table = T::SPEC.table;
    let (mut sent, mut retried, mut dead, mut released, mut stale) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for (row, outcome) in outcomes {
        match (recorded.status(row.id), outcome) {
            (None, _) => {
                stale += 1;
                tracing::warn!(
                    table,
                    id = row.id,
                    generation = row.generation,
                    "outcome rejected: the claim is stale"
                );
            }
            (Some(Status::Dead), _) => dead += 1,
            (Some(_), Outcome::Sent) => sent += 1,
            (Some(_), Outcome::Release | Outcome::Unavailable { .. }) => released += 1,
            (Some(_), _) => retried += 1,
        }
    }
    for (name, value) in [
        (metric::SENT, sent),
        (metric::RETRIED, retried),
        (metric::DEAD, dead),
        (metric::RELEASED, released),
        (metric::STALE, stale),
    ] {
        if value > 0 {
            metrics::counter!(name, labels.iter()).increment(value);
        }
    }
}
