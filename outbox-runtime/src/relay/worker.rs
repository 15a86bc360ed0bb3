//! A relay's worker: claims a batch, publishes it through the sink while its leases are
//! renewed, and records the outcomes together with the next claim.

use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::Relay;
use super::backoff::Backoff;
use super::connection::{Connection, spare_connection};
use super::frontier::Frontier;
use super::in_flight::{self, InFlight};
use super::outage::Outage;
use super::pending::Pending;
use super::record;
use super::renewal::{self, Needed, Renewal};
use super::sink_panics;
use super::wakeups::Wakeups;
use crate::error::OutboxError;
use crate::sink::{Delivery, Sink, SinkError};
use crate::spec::Outbox;
use crate::table::batch::{Outcome, Owned, Recorded};
use crate::table::claim::Claim;
use crate::table::claiming::Scope;
use crate::table::metric;
use outbox_internals::Status;

pub(crate) struct Worker<T, S> {
    pub(crate) relay: Arc<Relay<T, S>>,
    pub(crate) wakeups: Arc<Wakeups>,
    pub(crate) frontier: Arc<Frontier>,
    pub(crate) outage: Arc<Outage>,
    pub(crate) stop: CancellationToken,
}

/// What the sink answered for a batch.
enum Answer {
    /// `publish` returned (or timed out): one result per delivery.
    Returned(Vec<Result<(), SinkError>>),
    /// The shutdown grace ran out and the sink took the batch back: what it said became
    /// of each delivery.
    Withdrawn(Vec<Result<(), SinkError>>),
    /// No answer: the shutdown grace ran out and the sink could take nothing back, or
    /// every row was lost.
    Abandoned,
}

impl Answer {
    /// The results, `None` for an abandoned batch.
    fn results(self) -> Option<Vec<Result<(), SinkError>>> {
        match self {
            Self::Returned(results) | Self::Withdrawn(results) => Some(results),
            Self::Abandoned => None,
        }
    }
}

/// What the database did beside a send: the outcomes of the batch before recorded and
/// the batch after claimed, or why not.
type Ahead<T> = Result<Batch<T>, OutboxError>;

/// A claimed batch, and whether its claim found as many rows as it looked for. Rows it
/// could not hand out count (a payload that does not decode, moved to `DEAD`; a row
/// taken over while the batch waited): a full claim says more may be due, however many
/// of its rows are left to publish.
struct Batch<T: Outbox> {
    claims: Vec<Claim<T>>,
    full: bool,
}

impl<T: Outbox> Batch<T> {
    fn empty() -> Self {
        Self {
            claims: Vec::new(),
            full: false,
        }
    }

    fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }
}

impl<T: Outbox, S: Sink<T>> Worker<T, S> {
    /// Claim, publish, then record the outcomes *and* claim the next batch in one
    /// transaction: one commit per batch. That transaction runs while the sink has the
    /// batch in between, so a full batch's database round trip costs the worker no time
    /// when the sink takes longer: the worker holds the batch in flight and the next
    /// one, claimed ahead.
    pub(crate) async fn run(self) -> Result<(), OutboxError> {
        let mut conn = Connection {
            pool: &self.relay.pool,
            table: T::SPEC.table,
            held: None,
        };
        let mut failures = 0;
        // Batches in a row the destination was unavailable for.
        let mut held_back = 0;
        let mut pending = Pending::default();
        // A batch claimed while the one before was in flight.
        let mut ahead = Batch::empty();
        loop {
            let stopping = self.stop.is_cancelled();
            if stopping && !ahead.is_empty() {
                pending.release(&std::mem::replace(&mut ahead, Batch::empty()).claims);
            }
            if stopping && pending.outcomes.is_empty() {
                return Ok(());
            }
            let batch = if ahead.is_empty() {
                // After a batch that drained what was due, claiming again would find
                // nothing (at a steady trickle, every other claim did): record it alone,
                // and wait for a wake-up. Whatever was enqueued meanwhile has sent one.
                // After a failure, outcomes are recorded alone before the next claim: a
                // claim that keeps failing would roll them back with it every time.
                let record_first = failures > 0 && !pending.outcomes.is_empty();
                let claim_next =
                    !stopping && !pending.drained && !pending.unavailable && !record_first;
                match self.record_and_claim(&mut conn, &pending, claim_next).await {
                    Ok(batch) => {
                        failures = 0;
                        let unavailable = std::mem::take(&mut pending).unavailable;
                        if batch.is_empty() {
                            // Idle: the connection goes back to the pool until there is work.
                            conn.release();
                            if claim_next {
                                metrics::counter!(metric::IDLE_CLAIMS, "table" => T::SPEC.table)
                                    .increment(1);
                            }
                            if stopping {
                                // Recorded: the loop ends.
                            } else if unavailable {
                                self.pause(self.relay.unavailable.delay(held_back)).await;
                            } else if !record_first {
                                self.idle().await;
                            }
                            continue;
                        }
                        if self.stop.is_cancelled() {
                            // Shutdown came while the claim ran: handed back, not sent.
                            pending.release(&batch.claims);
                            continue;
                        }
                        batch
                    }
                    Err(error) if !error.is_transient() => {
                        return Err(self.stop_on(error, &mut conn, pending).await);
                    }
                    Err(error) => {
                        // The pool tests it on release, and closes it if it is broken.
                        conn.release();
                        failures += 1;
                        self.back_off(&error, failures, &mut pending).await;
                        continue;
                    }
                }
            } else {
                std::mem::replace(&mut ahead, Batch::empty())
            };
            // The sink gets a batch with two thirds of its lease left: one claimed ahead
            // waited for the batch before it, and one claimed just now may have had a
            // late commit (a slow one, a pause).
            let Batch { claims, full } = batch;
            let claims = renewal::renew_ahead(&mut conn, claims, Needed::ToSend).await;
            if claims.is_empty() {
                continue;
            }
            let batch = Batch { claims, full };
            if batch.full {
                // There may be more: bring in another idle worker, which in turn brings
                // in the next while it finds full batches.
                self.wakeups.more();
            }
            let earlier = std::mem::take(&mut pending);
            let (published, beside) = self.publish(batch, &mut conn, &earlier).await;
            pending = published;
            match beside {
                None => pending = pending.after(earlier),
                Some(Ok(next)) => {
                    failures = 0;
                    ahead = next;
                }
                Some(Err(error)) if !error.is_transient() => {
                    return Err(self.stop_on(error, &mut conn, pending.after(earlier)).await);
                }
                Some(Err(error)) => {
                    failures += 1;
                    pending = pending.after(earlier);
                    self.back_off(&error, failures, &mut pending).await;
                }
            }
            if pending.unavailable && !ahead.is_empty() {
                // The destination is down: the batch claimed ahead goes back untouched.
                pending.release(&std::mem::replace(&mut ahead, Batch::empty()).claims);
            }
            held_back = if pending.unavailable {
                held_back.saturating_add(1)
            } else {
                0
            };
        }
    }

    /// Records the `pending` outcomes and, with `claim_next`, claims the next batch in
    /// one transaction, recording first: [`record::record_and_claim`] says why that order.
    /// The claim starts at the relay's [`Frontier`], or sweeps.
    async fn record_and_claim(
        &self,
        conn: &mut Connection<'_>,
        pending: &Pending,
        claim_next: bool,
    ) -> Result<Batch<T>, OutboxError> {
        let next = claim_next.then(|| self.frontier.next());
        let (scope, limit) = next
            .as_ref()
            .map_or((Scope::All, 0), |next| (next.scope, self.relay.batch_size));
        let claiming = next.is_some().then(|| self.wakeups.claiming());
        let limit_time = crate::table::claiming::transaction_limit(T::SPEC.lease);
        let transaction = async {
            record::record_and_claim::<T>(conn.get().await?, &pending.outcomes, scope, limit).await
        };
        let Ok(done) = tokio::time::timeout(limit_time, transaction).await else {
            conn.discard();
            let silent = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer from the database in {limit_time:?}; the connection is closed"),
            );
            return Err(OutboxError::Database {
                table: T::SPEC.table,
                source: sqlx::Error::Io(silent),
            });
        };
        let (claimed, recorded) = done?;
        account::<T>(&pending.outcomes, &recorded);
        if let Some(claiming) = claiming {
            claiming.answered(claimed.full);
        }
        if let Some(next) = next {
            next.done(claimed.took);
            self.frontier.advance(claimed.reached);
        }
        Ok(Batch {
            claims: claimed.claims,
            full: claimed.full,
        })
    }

    /// Stops the worker on a fatal `error`, recording the `pending` outcomes first, alone:
    /// the transaction that failed rolled back those it was recording, and the claim
    /// that failed beside them (a drifted table, a trigger that refuses it, a missing
    /// privilege) need not fail them too. Unrecorded, every event already published would
    /// be claimed and published again once its lease ends.
    async fn stop_on(
        &self,
        error: OutboxError,
        conn: &mut Connection<'_>,
        pending: Pending,
    ) -> OutboxError {
        if !pending.outcomes.is_empty()
            && let Err(unrecorded) = self.record_and_claim(conn, &pending, false).await
        {
            tracing::error!(table = T::SPEC.table, error = %unrecorded, rows = pending.outcomes.len(),
                "cannot record the outcomes of a stopping worker; its events will be claimed and published again");
        }
        error
    }

    /// Waits for a wake-up, the poll interval or shutdown.
    ///
    /// A wake-up wakes one worker, for a signal no claim has answered yet ([`Wakeups`]):
    /// waking every idle worker per notification made 2.5-3 claim statements per claimed
    /// batch, most of them finding nothing. A wake-up sent while no worker waits is kept,
    /// so none is lost between a worker's last claim and its wait; a worker that claims
    /// a full batch wakes the next.
    async fn idle(&self) {
        tokio::select! {
            () = self.wakeups.idle(self.relay.poll_interval) => {}
            () = self.stop.cancelled() => {}
        }
    }

    /// After the batch transaction failed (transiently) for the `failures`th time in a
    /// row: waits before the next try, and gives up on the `pending` outcomes if their
    /// leases would end first.
    async fn back_off(&self, error: &OutboxError, failures: u32, pending: &mut Pending) {
        let table = T::SPEC.table;
        let delay = Backoff::new(Duration::from_millis(50), Duration::from_secs(5)).delay(failures);
        let waiting = !pending.outcomes.is_empty();
        let given_up = pending.give_up_before(Instant::now() + delay);
        if given_up > 0 {
            tracing::error!(table, %error, rows = given_up,
                "cannot record outcomes before their leases end; the events will be claimed and published again");
        }
        if !pending.outcomes.is_empty() {
            tracing::warn!(table, %error, "recording outcomes failed; retrying");
        } else if !waiting {
            tracing::warn!(table, %error, "claim failed; backing off");
        }
        if pending.outcomes.is_empty() {
            self.pause(delay).await;
        } else {
            // Outcomes are waiting: retry even while shutting down.
            sleep(delay).await;
        }
    }

    async fn pause(&self, delay: Duration) {
        tokio::select! {
            () = sleep(delay) => {}
            () = self.stop.cancelled() => {}
        }
    }

    /// Publishes one claimed batch; returns the outcomes to record. Meanwhile, on the
    /// worker's connection, records the `earlier` outcomes and, after a full batch,
    /// claims the next one: `None` when there was nothing to do beside the send.
    async fn publish(
        &self,
        batch: Batch<T>,
        conn: &mut Connection<'_>,
        earlier: &Pending,
    ) -> (Pending, Option<Ahead<T>>) {
        let Batch { claims, full } = batch;
        let table = T::SPEC.table;
        let span = tracing::info_span!(
            "outbox.batch",
            table,
            size = claims.len(),
            first_id = claims[0].id()
        );
        async {
            count_claimed(&claims);
            let deliveries: Vec<Delivery<'_, T>> = claims.iter().map(InFlight::delivery).collect();
            let rows = InFlight::pair(&claims, &deliveries);
            let claim_next = full && !self.stop.is_cancelled();
            let beside = (claim_next || !earlier.outcomes.is_empty()).then(|| {
                // The connection moves to the transaction, and comes back with its result.
                let mut db = Connection {
                    pool: conn.pool,
                    table: conn.table,
                    held: conn.held.take(),
                };
                async move {
                    let ahead = self.record_and_claim(&mut db, earlier, claim_next).await;
                    if ahead.is_err() {
                        db.release();
                    }
                    (db.held, ahead)
                }
            });
            let (answer, lease_deadline, ahead) = self.send(&rows, &deliveries, conn, beside).await;
            // What a withdrawn batch says of the destination is only that it was withdrawn.
            let unavailable = match &answer {
                Answer::Returned(results) => results.iter().find_map(|result| match result {
                    Err(error @ SinkError::Unavailable(_)) => Some(error.to_string()),
                    _ => None,
                }),
                Answer::Withdrawn(_) | Answer::Abandoned => None,
            };
            match (&unavailable, &answer) {
                (Some(reason), _) => self.outage.held_back(reason),
                (None, Answer::Returned(_)) => self.outage.answered(),
                (None, _) => {}
            }
            // The claim ahead found nothing: it is as fresh as a short batch's.
            // (Not one whose rows were all dropped since: the claim was full.)
            let found_nothing =
                claim_next && matches!(&ahead, Some(Ok(next)) if next.is_empty() && !next.full);
            if found_nothing {
                metrics::counter!(metric::IDLE_CLAIMS, "table" => table).increment(1);
            }
            let mut outcomes = in_flight::outcomes(
                &rows,
                answer.results(),
                &self.relay.retry,
                &self.relay.failures,
            );
            if self.relay.ascii_reasons {
                outcomes = outcomes
                    .into_iter()
                    .map(|(row, outcome)| (row, outcome.in_ascii()))
                    .collect();
            }
            let pending = Pending {
                // With an ordering key, recording a batch lets the next event of each of
                // its keys go, and nobody is notified: the claim that follows the
                // recording in its transaction finds them.
                drained: (!full || found_nothing) && T::SPEC.key().is_none(),
                unavailable: unavailable.is_some(),
                ..Pending::of(outcomes, lease_deadline)
            };
            (pending, ahead)
        }
        .instrument(span)
        .await
    }

    /// Runs the sink on `deliveries`, renewing the leases of their `rows` meanwhile, and
    /// runs `beside` (a transaction that has taken the worker's connection, and gives it
    /// back) to its end. Returns what the sink answered, when the earliest lease of the
    /// rows still owned ends, and what `beside` returned.
    ///
    /// When the shutdown grace runs out first, the sink is asked to take the batch back
    /// ([`Sink::withdraw`]): a sink that can is awaited for what became of each event,
    /// the leases still renewed; one that cannot has its `publish` dropped, and every row
    /// is handed back.
    async fn send<B>(
        &self,
        rows: &[InFlight<'_, T>],
        deliveries: &[Delivery<'_, T>],
        conn: &mut Connection<'_>,
        beside: Option<B>,
    ) -> (Answer, Instant, Option<Ahead<T>>)
    where
        B: Future<Output = (Option<PoolConnection<Postgres>>, Ahead<T>)>,
    {
        let table = T::SPEC.table;
        let relay = &self.relay;
        let started = Instant::now();
        let mut renewal = Renewal::new(rows, started);
        let mut grace: Option<Instant> = None;
        // The grace ran out and the sink took the batch back: its results are awaited.
        let mut withdrawn = false;
        let mut sending = pin!(tokio::time::timeout(
            relay.send_timeout,
            sink_panics::publish_contained::<T, S>(&relay.sink, deliveries)
        ));
        let busy = beside.is_some();
        let mut beside = pin!(futures_util::future::OptionFuture::from(beside));
        let mut ahead = None;
        // Until `beside` gives the connection back, renewals take an idle one from the
        // pool, or wait for it when there is none.
        let mut db_busy = busy;
        let mut renewal_waits = false;

        let answer = loop {
            tokio::select! {
                biased;
                Some((held, done)) = &mut beside, if db_busy => {
                    conn.held = held;
                    ahead = Some(done);
                    db_busy = false;
                    renewal_waits = false;
                }
                sent = &mut sending => {
                    break if withdrawn {
                        Answer::Withdrawn(sent.unwrap_or_else(|_| in_doubt(rows.len())))
                    } else {
                        Answer::Returned(sent.unwrap_or_else(|_| self.timed_out(rows.len())))
                    };
                }
                // By this process's clock, the leases of the rows still owned ended with
                // their renewals unanswered: nothing can be recorded for them, and another
                // publisher may claim them now. The sink learns it at once, as it does
                // of a rejected renewal, rather than at the send timeout. Before the
                // renewals: one that keeps timing out is always due again.
                () = sleep_until(renewal.lease_deadline()) => {
                    let expired = rows.iter().filter(|row| row.is_owned()).count();
                    for row in rows {
                        row.expire();
                    }
                    tracing::warn!(table, rows = expired,
                        "the batch's leases ended in flight, their renewals unanswered; abandoning it (its events are claimed and published again)");
                    break Answer::Abandoned;
                }
                () = sleep_until(renewal.due()), if !renewal_waits => {
                    // The transaction beside can wait on a lock for up to its limit,
                    // longer than a lease: a renewal does not wait for it if the pool
                    // has a connection to spare, idle or yet to open. (Its wait is
                    // short: the transaction beside is not polled meanwhile.)
                    let lost = if db_busy {
                        let Some(idle) = spare_connection(conn.pool).await else {
                            renewal_waits = true;
                            continue;
                        };
                        let mut spare = Connection {
                            pool: conn.pool,
                            table,
                            held: Some(idle),
                        };
                        renewal.renew(&mut spare).await
                    } else {
                        renewal.renew(conn).await
                    };
                    for row in lost {
                        row.lose();
                    }
                    if renewal.lost_all() {
                        break Answer::Abandoned;
                    }
                    // The batch claimed ahead waits for this send: renewed too, once due
                    // (not right after a renewal that got no answer).
                    if renewal.answered()
                        && let Some(Ok(next)) = &mut ahead
                    {
                        let waiting = std::mem::take(&mut next.claims);
                        next.claims = renewal::renew_ahead(conn, waiting, Needed::ToWait).await;
                    }
                }
                () = self.stop.cancelled(), if grace.is_none() => {
                    grace = Some(Instant::now() + relay.shutdown_grace);
                }
                () = sleep_until(grace.unwrap_or(started)), if grace.is_some() && !withdrawn => {
                    if relay.sink.withdraw().await {
                        tracing::info!(table, "shutdown grace over; the sink took the batch back, awaiting what became of each event");
                        withdrawn = true;
                    } else {
                        tracing::info!(table, "shutdown grace over; handing unsent events back");
                        break Answer::Abandoned;
                    }
                }
            }
        };
        #[allow(clippy::cast_precision_loss)]
        metrics::histogram!(metric::PUBLISH_SECONDS, "table" => table)
            .record(started.elapsed().as_secs_f64());
        if db_busy && let Some((held, done)) = beside.await {
            conn.held = held;
            ahead = Some(done);
        }
        (answer, renewal.lease_deadline(), ahead)
    }

    /// The results of a batch of `size` whose publish timed out: a transient failure each.
    fn timed_out(&self, size: usize) -> Vec<Result<(), SinkError>> {
        let timeout = self.relay.send_timeout;
        tracing::warn!(
            table = T::SPEC.table,
            ?timeout,
            "publish timed out; retrying the batch later"
        );
        (0..size)
            .map(|_| {
                Err(SinkError::transient(format!(
                    "publish timed out after {timeout:?}"
                )))
            })
            .collect()
    }
}

/// The results of a withdrawn batch of `size` whose sink did not say, within the send
/// timeout, what became of its events: each may still reach the destination.
fn in_doubt(size: usize) -> Vec<Result<(), SinkError>> {
    (0..size)
        .map(|_| {
            Err(SinkError::in_doubt(
                "withdrawn at shutdown, and the sink did not say what became of it before the send timeout",
            ))
        })
        .collect()
}

/// Logs and counts a claimed batch.
fn count_claimed<T: Outbox>(claims: &[Claim<T>]) {
    let table = T::SPEC.table;
    tracing::debug!(event_ids = ?claims.iter().map(|c| c.event_id().as_str()).collect::<Vec<_>>(), "claimed");
    metrics::counter!(metric::CLAIMED, "table" => table).increment(claims.len() as u64);
    let reclaimed = claims.iter().filter(|c| c.is_reclaim()).count();
    metrics::counter!(metric::RECLAIMED, "table" => table).increment(reclaimed as u64);
    #[allow(clippy::cast_precision_loss)]
    metrics::histogram!(metric::BATCH_SIZE, "table" => table).record(claims.len() as f64);
}

/// Counts what happened to recorded outcomes.
fn account<T: Outbox>(outcomes: &[(Owned, Outcome)], recorded: &Recorded) {
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
            metrics::counter!(name, "table" => table).increment(value);
        }
    }
}
