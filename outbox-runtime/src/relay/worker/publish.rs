//! The publish step: the batch handed to the sink, and its results turned into the
//! outcomes to record.

use super::super::connection::Connection;
use super::super::in_flight::{self, InFlight};
use super::super::key_runs;
use super::super::pending::Pending;
use super::send::Answer;
use super::{Ahead, Batch, Worker};
use crate::sink::{Delivery, Sink, SinkError};
use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::metric;

impl<T: Outbox, S: Sink<T>> Worker<T, S> {
    /// Publishes one claimed batch; returns the outcomes to record. Meanwhile, on the
    /// worker's connection, records the `earlier` outcomes and, after a full batch,
    /// claims the next one, which may continue this batch's runs of a key: `None` when
    /// there was nothing to do beside the send. A run continued there keeps its events
    /// only if its key's events here all went; the others are handed back with the
    /// outcomes.
    pub(super) async fn publish(
        &self,
        batch: Batch<T>,
        conn: &mut Connection<'_>,
        earlier: &Pending,
    ) -> (Pending, Option<Ahead<T>>) {
        let Batch {
            mut claims, full, ..
        } = batch;
        let layers = key_runs::arrange(&mut claims);
        let table = T::SPEC.table;
        let span = tracing::info_span!(
            "outbox.batch",
            table,
            size = claims.len(),
            first_id = claims[0].id()
        );
        // The batch's span holds the batch's own work (its spans made, the sink's send,
        // its outcomes), not the transaction beside it, which records the batch before
        // and claims the next: sqlx polls each row of a query in the current span, and
        // with an OpenTelemetry subscriber every entry costs (about 5,000 instructions
        // per event, counted by callgrind).
        let mut deliveries: Vec<Delivery<'_, T>> = claims.iter().map(InFlight::delivery).collect();
        let sends = span.in_scope(|| {
            count_claimed(&self.relay.labels, &claims);
            self.relay
                .tracer
                .open(&self.relay.sink, &mut deliveries, span.clone())
        });
        let rows = InFlight::pair(&claims, &deliveries);
        let claim_next = full && !self.stopping();
        let in_flight = &claims;
        let beside = (claim_next || !earlier.outcomes.is_empty()).then(|| {
            // The connection moves to the transaction, and comes back with its result.
            let mut db = Connection {
                pool: conn.pool,
                table: conn.table,
                held: conn.held.take(),
            };
            async move {
                let ahead = self
                    .record_and_claim(&mut db, earlier, claim_next, in_flight)
                    .await;
                if ahead.is_err() {
                    db.release();
                }
                (db.held, ahead)
            }
        });
        let (answer, lease_deadline, mut ahead) = self
            .send(&rows, &deliveries, &layers, sends, conn, beside)
            .await;
        let _batch = span.enter();
        let unavailable = self.note_destination(&answer);
        // The claim ahead found nothing: it is as fresh as a short batch's.
        // (Not one whose rows were all dropped since: the claim was full.)
        let found_nothing =
            claim_next && matches!(&ahead, Some(Ok(next)) if next.is_empty() && !next.full);
        let results = answer.results();
        let continued_broken = match &mut ahead {
            Some(Ok(next)) => {
                key_runs::take_broken_continuations(&mut next.claims, &rows, results.as_deref())
            }
            _ => Vec::new(),
        };
        let mut outcomes =
            in_flight::outcomes(&rows, results, &self.relay.retry, &self.relay.failures);
        if self.relay.ascii_reasons {
            outcomes = outcomes
                .into_iter()
                .map(|(row, outcome)| (row, outcome.in_ascii()))
                .collect();
        }
        let finished = key_runs::finished(&claims, &outcomes);
        let mut pending = Pending {
            finished,
            // With an ordering key, recording a batch lets the next event of each of
            // its keys go, and nobody is notified: the claim that follows the
            // recording in its transaction finds them.
            drained: (!full || found_nothing) && T::SPEC.key().is_none(),
            unavailable: unavailable.is_some(),
            ..Pending::of(outcomes, lease_deadline)
        };
        pending.release(&continued_broken);
        (pending, ahead)
    }

    /// Whether the sink said the destination is unavailable (why), noted in the relay's
    /// outage log: an outage is logged when it begins and when it ends. What a withdrawn
    /// or abandoned batch says of the destination is only that it was withdrawn.
    fn note_destination(&self, answer: &Answer) -> Option<String> {
        let Answer::Returned(results) = answer else {
            return None;
        };
        let unavailable = results.iter().find_map(|result| match result {
            Err(error @ SinkError::Unavailable(_)) => Some(error.to_string()),
            _ => None,
        });
        match &unavailable {
            Some(reason) => self.outage.held_back(reason),
            None => self.outage.answered(),
        }
        unavailable
    }
}

/// Logs and counts a claimed batch.
fn count_claimed<T: Outbox>(labels: &[metrics::Label], claims: &[Claim<T>]) {
    tracing::debug!(event_ids = ?claims.iter().map(|c| c.event_id().as_str()).collect::<Vec<_>>(), "claimed");
    metrics::counter!(metric::CLAIMED, labels.iter()).increment(claims.len() as u64);
    let reclaimed = claims.iter().filter(|c| c.is_reclaim()).count();
    metrics::counter!(metric::RECLAIMED, labels.iter()).increment(reclaimed as u64);
    #[allow(clippy::cast_precision_loss)]
    metrics::histogram!(metric::BATCH_SIZE, labels.iter()).record(claims.len() as f64);
}
