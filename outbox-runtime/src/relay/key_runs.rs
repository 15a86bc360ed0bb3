//! Runs of a key: on a keyed table, one claim carries a key's next events together (its
//! head, the first still to go, and the events after it), and they go out in order.
//!
//! The batch is arranged in layers: every key's first event, then every key's second,
//! and so on. The sink gets one layer at a time, so a key's event is published only
//! after the one before it was acknowledged, while different keys go out together.
//! (Handing a whole run over at once would let a broker hold event k + 1 while k
//! failed: a negative acknowledgement, a timeout or a lost connection on k does not
//! stop k + 1, already on the wire.) Once an event of a run is not published, the
//! events after it are not sent at all: they are handed back unattempted, and wait
//! behind it as if they had never been claimed.
//!
//! A run goes on from batch to batch: the batch claimed ahead while one is out may
//! continue that one's runs (after its [`tails`]), and is published after it; a key's
//! continuation goes only if that key's events in the batch before all went
//! ([`take_broken_continuations`]).

use std::collections::HashMap;
use std::ops::Range;

use tokio_util::sync::CancellationToken;

use super::in_flight::InFlight;
use super::sink_panics::publish_contained;
use crate::sink::{Delivery, Sink, SinkError};
use crate::spec::Outbox;
use crate::table::claim::Claim;
use crate::table::key_order::{self, BrokenRuns};
use crate::table::row::{Outcome, Owned};

/// Where each layer of an arranged batch starts and ends, in order.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Layers(Vec<Range<usize>>);

/// Arranges `claims` in layers ([`Layers`]): every key's first event, in id order,
/// then every key's second, .. . A batch in which no key repeats (an unkeyed table, or
/// a run-less claim) is one layer, left as it was claimed.
pub(super) fn arrange<T: Outbox>(claims: &mut [Claim<T>]) -> Layers {
    // The whole batch as one layer. (`vec![range]` reads as a range of ranges.)
    let len = claims.len();
    let whole = || Layers(std::iter::once(0..len).collect());
    if T::SPEC.key().is_none() || claims.len() < 2 {
        return whole();
    }
    claims.sort_unstable_by_key(Claim::id);
    let depths: HashMap<i64, usize> = claims
        .iter()
        .map(Claim::id)
        .zip(key_order::depths(claims))
        .collect();
    let deepest = depths.values().copied().max().unwrap_or(0);
    if deepest == 0 {
        return whole();
    }
    claims.sort_by_key(|claim| (depths[&claim.id()], claim.id()));
    let mut layers = Vec::with_capacity(deepest + 1);
    let mut start = 0;
    for depth in 0..=deepest {
        let len = claims[start..]
            .iter()
            .take_while(|claim| depths[&claim.id()] == depth)
            .count();
        layers.push(start..start + len);
        start += len;
    }
    Layers(layers)
}

/// Keeps the `claims` (in id order, as claimed) for which `keep` holds, and of a key's
/// run only what can still go in order: a claim after a dropped one of its key is
/// dropped too, and returned, `keep` having held for it: still this worker's, to hand
/// back (it waits behind the other, unattempted, instead of out its lease).
pub(super) fn retain_in_order<T: Outbox>(
    claims: &mut Vec<Claim<T>>,
    mut keep: impl FnMut(&mut Claim<T>) -> bool,
) -> Vec<Claim<T>> {
    let mut broken = BrokenRuns::default();
    let mut behind = Vec::new();
    for mut claim in std::mem::take(claims) {
        let own = keep(&mut claim);
        if own && broken.lets_go(claim.key()) {
            claims.push(claim);
            continue;
        }
        broken.break_at(claim.key());
        if own {
            behind.push(claim);
        }
    }
    behind
}

/// Whether a key repeats in `claims`: the claim took runs, which it does only in the
/// room its heads left, its scan having found fewer due events than it looked for.
pub(super) fn took_runs<T: Outbox>(claims: &[Claim<T>]) -> bool {
    key_order::longest_run(claims) > 1
}

/// The last event of each key in `claims` (a batch about to be published): where the
/// claim ahead may continue its key's run ([`Runs::After`]), in id order: the oldest
/// runs first.
///
/// [`Runs::After`]: crate::table::claiming::Runs::After
pub(super) fn tails<T: Outbox>(claims: &[Claim<T>]) -> Vec<Owned> {
    if T::SPEC.key().is_none() {
        return Vec::new();
    }
    let mut tails: Vec<Owned> = last_of_each_key(claims)
        .into_values()
        .map(Owned::of)
        .collect();
    tails.sort_unstable_by_key(|tail| tail.id);
    tails
}

/// The last event (the largest id) of each key in `claims`.
fn last_of_each_key<T: Outbox>(claims: &[Claim<T>]) -> HashMap<&str, &Claim<T>> {
    let mut last: HashMap<&str, &Claim<T>> = HashMap::new();
    for claim in claims {
        if let Some(key) = claim.key() {
            let tail = last.entry(key).or_insert(claim);
            if claim.id() > tail.id() {
                *tail = claim;
            }
        }
    }
    last
}

/// A key whose last event in a batch was published, or died: once that is recorded, the
/// key's next event, if any, may go, and may wait behind the relay's frontier, which the
/// claims moved on past it while it was held back.
#[derive(Debug, Clone)]
pub(crate) struct Finished {
    /// The event's row, in the generation it was claimed in.
    pub(crate) row: Owned,
    pub(crate) key: String,
    /// When it was enqueued, in microseconds since the Unix epoch.
    pub(crate) enqueued: i64,
}

/// The keys of `claims` whose last event there has an outcome in `outcomes` that
/// finishes it (`SENT`, `DEAD`).
pub(super) fn finished<T: Outbox>(
    claims: &[Claim<T>],
    outcomes: &[(Owned, Outcome)],
) -> Vec<Finished> {
    if T::SPEC.key().is_none() {
        return Vec::new();
    }
    let finishes: HashMap<i64, bool> = outcomes
        .iter()
        .map(|(row, outcome)| {
            let finishes = matches!(outcome, Outcome::Sent | Outcome::Dead { .. });
            (row.id, finishes)
        })
        .collect();
    last_of_each_key(claims)
        .into_iter()
        .filter(|(_, claim)| finishes.get(&claim.id()) == Some(&true))
        .map(|(key, claim)| Finished {
            row: Owned::of(claim),
            key: key.to_owned(),
            enqueued: claim.enqueued_micros(),
        })
        .collect()
}

/// Takes out of `ahead` (claimed while `rows` were out, `results` what the sink said of
/// them, `None` for a batch abandoned) the events of every key of which an event in
/// `rows` did not go: published, and still owned. Such an event continues its key's run
/// from `rows` (while they were in flight, nothing else of their keys could be
/// claimed), so it must not be sent: it is handed back, to wait behind the one that did
/// not go.
pub(super) fn take_broken_continuations<T: Outbox>(
    ahead: &mut Vec<Claim<T>>,
    rows: &[InFlight<'_, T>],
    results: Option<&[Result<(), SinkError>]>,
) -> Vec<Claim<T>> {
    let went = |i: usize, row: &InFlight<'_, T>| {
        row.is_owned() && results.is_some_and(|results| matches!(results.get(i), Some(Ok(()))))
    };
    let mut broken = BrokenRuns::default();
    for (i, row) in rows.iter().enumerate() {
        if !went(i, row) {
            broken.break_at(row.claim().key());
        }
    }
    let (kept, behind) = std::mem::take(ahead)
        .into_iter()
        .partition(|claim| broken.lets_go(claim.key()));
    *ahead = kept;
    behind
}

/// The reason a held event's placeholder result carries: never recorded (a held event is
/// handed back), only seen in the sink's results while the batch is out.
const HELD: &str = "not sent: an earlier event of its key in this batch was not published";

/// The result of an event a withdrawn batch never sent: taken back unsent, as a sink
/// reports what it took back (handed back, its attempt not counted).
const WITHDRAWN: &str = "not sent: the batch was withdrawn at shutdown";

/// Publishes an arranged `batch` through `sink`, one layer at a time; an event whose
/// key's run broke in an earlier layer (its event there was not published) is not sent,
/// nor is any layer after `withdrawn` (the sink took the batch back at shutdown).
/// Returns one result per delivery, in order (an event not sent has an error).
pub(super) async fn publish<T, S: Sink<T>>(
    sink: &S,
    batch: &[Delivery<'_, T>],
    layers: &Layers,
    withdrawn: &CancellationToken,
) -> Vec<Result<(), SinkError>> {
    if layers.0.len() < 2 {
        return publish_contained(sink, batch).await;
    }
    let mut results: Vec<Result<(), SinkError>> = Vec::with_capacity(batch.len());
    let mut broken = BrokenRuns::default();
    for layer in &layers.0 {
        if withdrawn.is_cancelled() {
            results.extend(
                layer
                    .clone()
                    .map(|_| Err(SinkError::unavailable(WITHDRAWN))),
            );
            continue;
        }
        // A delivery no longer owned is not sent either, and ends its key's run.
        let going =
            |delivery: &Delivery<'_, T>| delivery.is_owned() && broken.lets_go(delivery.key);
        // The layer's events that go, in stretches of neighbours: one call each
        // (nearly always one: runs rarely break).
        let mut stretch = layer.start;
        while stretch < layer.end {
            let held = batch[stretch..layer.end]
                .iter()
                .take_while(|delivery| !going(delivery))
                .count();
            results.extend((0..held).map(|_| Err(SinkError::transient(HELD))));
            stretch += held;
            let sent = batch[stretch..layer.end]
                .iter()
                .take_while(|delivery| going(delivery))
                .count();
            if sent > 0 {
                results.extend(publish_one_layer(sink, &batch[stretch..stretch + sent]).await);
                stretch += sent;
            }
        }
        for (delivery, result) in batch[layer.clone()].iter().zip(&results[layer.clone()]) {
            if result.is_err() {
                broken.break_at(delivery.key);
            }
        }
    }
    results
}

/// The results of one stretch of a layer, exactly one per delivery.
async fn publish_one_layer<T, S: Sink<T>>(
    sink: &S,
    stretch: &[Delivery<'_, T>],
) -> Vec<Result<(), SinkError>> {
    let mut results = publish_contained(sink, stretch).await;
    // A sink that returned fewer results than events: the missing ones failed.
    results.resize_with(stretch.len(), || {
        Err(SinkError::transient(
            "the sink returned no result for this event",
        ))
    });
    results.truncate(stretch.len());
    results
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::SystemTime;

    use tokio_util::sync::CancellationToken;

    use super::{Layers, publish};
    use crate::id::{EventId, Generation};
    use crate::sink::{Delivery, Sink, SinkError};

    /// A sink that writes down each call's keys and, during its first call, is told to
    /// take the batch back (as the relay does when its shutdown grace runs out).
    struct WithdrawnDuringFirstCall {
        calls: Mutex<Vec<Vec<String>>>,
        withdrawal: CancellationToken,
    }

    impl Sink<()> for WithdrawnDuringFirstCall {
        async fn publish(&self, batch: &[Delivery<'_, ()>]) -> Vec<Result<(), SinkError>> {
            let keys = batch
                .iter()
                .filter_map(|d| d.key.map(str::to_owned))
                .collect();
            self.calls.lock().unwrap().push(keys);
            self.withdrawal.cancel();
            batch.iter().map(|_| Ok(())).collect()
        }
    }

    #[tokio::test]
    async fn a_withdrawn_batch_sends_no_further_layer() {
        let ids = [EventId::from("a1"), EventId::from("a2")];
        let deliveries: Vec<Delivery<'_, ()>> = ids
            .iter()
            .map(|event_id| Delivery {
                event_id,
                generation: Generation::new(1),
                attempt: 1,
                created_at: SystemTime::UNIX_EPOCH,
                key: Some("a"),
                trace: None,
                event: &(),
                lost: CancellationToken::new(),
            })
            .collect();
        let sink = WithdrawnDuringFirstCall {
            calls: Mutex::default(),
            withdrawal: CancellationToken::new(),
        };
        let layers = Layers(vec![0..1, 1..2]);
        let results = publish(&sink, &deliveries, &layers, &sink.withdrawal).await;
        assert_eq!(sink.calls.lock().unwrap().len(), 1, "a2 was not sent");
        assert!(results[0].is_ok());
        assert!(
            matches!(&results[1], Err(SinkError::Unavailable(_))),
            "taken back unsent: {:?}",
            results[1]
        );
    }
}
