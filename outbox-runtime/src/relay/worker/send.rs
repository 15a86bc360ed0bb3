//! The send step: the sink has the batch, its leases are renewed meanwhile, and the
//! batch transaction runs beside it on the worker's connection.

use std::pin::pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::super::connection::{Connection, spare_connection};
use super::super::in_flight::InFlight;
use super::super::key_runs::{self, Layers};
use super::super::renewal::{self, Needed, Renewal};
use super::{Ahead, Worker};
use crate::sink::{Delivery, Sink, SinkError};
use crate::spec::Outbox;
use crate::table::metric;
use crate::trace::SendSpans;

/// What the sink answered for a batch.
pub(super) enum Answer {
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
    pub(super) fn results(self) -> Option<Vec<Result<(), SinkError>>> {
        match self {
            Self::Returned(results) | Self::Withdrawn(results) => Some(results),
            Self::Abandoned => None,
        }
    }

    /// [`Answer::results`], borrowed.
    fn results_ref(&self) -> Option<&[Result<(), SinkError>]> {
        match self {
            Self::Returned(results) | Self::Withdrawn(results) => Some(results),
            Self::Abandoned => None,
        }
    }
}

impl<T: Outbox, S: Sink<T>> Worker<T, S> {
    /// Runs the sink on `deliveries`, arranged in `layers` (a key's run goes out in
    /// order, [`key_runs`]), renewing the leases of their `rows` meanwhile, and
    /// runs `beside` (a transaction that has taken the worker's connection, and gives it
    /// back) to its end. The `sends` spans end with the sink's answer, while `beside` may
    /// still run. Returns what the sink answered, when the earliest lease of the rows
    /// still owned ends, and what `beside` returned. Notes from the two's times whether
    /// the worker keeps its keys ([`Worker::keeps_keys`]).
    ///
    /// When the shutdown grace runs out first, the sink is asked to take the batch back
    /// ([`Sink::withdraw`]): a sink that can is awaited for what became of each event,
    /// the leases still renewed; one that cannot has its `publish` dropped, and every row
    /// is handed back.
    pub(super) async fn send<B>(
        &self,
        rows: &[InFlight<'_, T>],
        deliveries: &[Delivery<'_, T>],
        layers: &Layers,
        sends: SendSpans,
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
        // The grace ran out and the sink took the batch back: its results are awaited
        // (and the layers of a batch with runs not yet sent are not).
        let mut withdrawn = false;
        let withdrawal = CancellationToken::new();
        let mut sending = pin!(tokio::time::timeout(
            relay.send_timeout,
            key_runs::publish::<T, S>(&relay.sink, deliveries, layers, &withdrawal)
                .instrument(sends.batch().clone())
        ));
        let busy = beside.is_some();
        let mut beside = pin!(futures_util::future::OptionFuture::from(beside));
        let mut ahead = None;
        // Until `beside` gives the connection back, renewals take an idle one from the
        // pool, or wait for it when there is none.
        let mut db_busy = busy;
        let mut renewal_waits = false;
        let mut send_took = Duration::MAX;

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
                    send_took = started.elapsed();
                    break if withdrawn {
                        Answer::Withdrawn(sent.unwrap_or_else(|_| in_doubt(rows.len())))
                    } else {
                        Answer::Returned(sent.unwrap_or_else(|_| self.timed_out(rows.len())))
                    };
                }
                // The leases ended by this process's clock, their renewals unanswered.
                // Before the renewals: one that keeps timing out is always due again.
                () = sleep_until(renewal.lease_deadline()) => {
                    expire(rows);
                    break Answer::Abandoned;
                }
                () = sleep_until(renewal.due()), if !renewal_waits => {
                    match renew_in_flight(&relay.labels, &mut renewal, conn, db_busy, &mut ahead).await {
                        Renewed::Owned => {}
                        Renewed::NoConnection => renewal_waits = true,
                        Renewed::LostAll => break Answer::Abandoned,
                    }
                }
                () = self.stop.cancelled(), if grace.is_none() => {
                    grace = Some(Instant::now() + relay.shutdown_grace);
                }
                () = sleep_until(grace.unwrap_or(started)), if grace.is_some() && !withdrawn => {
                    if relay.sink.withdraw().await {
                        tracing::info!(table, "shutdown grace over; the sink took the batch back, awaiting what became of each event");
                        withdrawn = true;
                        withdrawal.cancel();
                    } else {
                        tracing::info!(table, "shutdown grace over; handing unsent events back");
                        break Answer::Abandoned;
                    }
                }
            }
        };
        #[allow(clippy::cast_precision_loss)]
        metrics::histogram!(metric::PUBLISH_SECONDS, relay.labels.iter())
            .record(started.elapsed().as_secs_f64());
        // Their time is the send's, and their work is done while the database works.
        sends.end(answer.results_ref());
        if db_busy && let Some((held, done)) = beside.await {
            conn.held = held;
            ahead = Some(done);
            let workers = u32::try_from(relay.concurrency).unwrap_or(u32::MAX);
            let spread = send_took.saturating_mul(workers) < started.elapsed();
            self.keeps_keys.store(!spread, Ordering::Relaxed);
        } else if busy {
            self.keeps_keys.store(true, Ordering::Relaxed);
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

/// What a renewal in flight found.
enum Renewed {
    /// Some rows are still this worker's.
    Owned,
    /// The worker's connection is busy beside and the pool has none to spare: the
    /// renewal waits for it.
    NoConnection,
    /// Every row belongs to another publisher now: the batch is cancelled.
    LostAll,
}

/// Renews the leases of the rows in flight, and then those of the batch claimed
/// `ahead`, which waits for this send. The transaction beside (`db_busy`) can wait on a
/// lock for up to its limit, longer than a lease: a renewal does not wait for it if
/// the pool has a connection to spare, idle or yet to open. (Its wait is short: the
/// transaction beside is not polled meanwhile.)
async fn renew_in_flight<T: Outbox>(
    labels: &[metrics::Label],
    renewal: &mut Renewal<'_, '_, T>,
    conn: &mut Connection<'_>,
    db_busy: bool,
    ahead: &mut Option<Ahead<T>>,
) -> Renewed {
    let lost = if db_busy {
        let Some(idle) = spare_connection(conn.pool).await else {
            return Renewed::NoConnection;
        };
        let mut spare = Connection {
            pool: conn.pool,
            table: conn.table,
            held: Some(idle),
        };
        renewal.renew(&mut spare).await
    } else {
        renewal.renew(conn).await
    };
    for row in lost {
        row.lose(labels);
    }
    if renewal.lost_all() {
        return Renewed::LostAll;
    }
    // The batch claimed ahead is renewed too, once due (not right after a renewal that
    // got no answer).
    if renewal.answered()
        && let Some(Ok(next)) = ahead
    {
        let waiting = std::mem::take(&mut next.claims);
        let (claims, behind) = renewal::renew_ahead(conn, waiting, Needed::ToWait).await;
        next.claims = claims;
        next.behind.extend(behind);
    }
    Renewed::Owned
}

/// By this process's clock, the leases of the rows still owned ended with their
/// renewals unanswered: nothing can be recorded for them, and another publisher may
/// claim them now. The sink learns it at once, as it does of a rejected renewal, rather
/// than at the send timeout.
fn expire<T: Outbox>(rows: &[InFlight<'_, T>]) {
    let expired = rows.iter().filter(|row| row.is_owned()).count();
    for row in rows {
        row.expire();
    }
    tracing::warn!(
        table = T::SPEC.table,
        rows = expired,
        "the batch's leases ended in flight, their renewals unanswered; abandoning it (its events are claimed and published again)"
    );
}
