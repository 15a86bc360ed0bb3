//! Where the relay publishes: the [`Sink`] trait, and two sinks shipped with the crate.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use futures_util::FutureExt as _;

use tokio_util::sync::CancellationToken;

use crate::id::{EventId, Generation};

/// A boxed error from a sink.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// One event handed to a [`Sink`], with the identities a consumer needs.
#[derive(Debug)]
pub struct Delivery<'a, T> {
    pub(crate) event_id: &'a EventId,
    pub(crate) generation: Generation,
    pub(crate) attempt: u32,
    pub(crate) created_at: SystemTime,
    pub(crate) key: Option<&'a str>,
    pub(crate) event: &'a T,
    pub(crate) lost: CancellationToken,
}

impl<T> Delivery<'_, T> {
    /// The stable id consumers deduplicate on: publish it with the event.
    pub fn event_id(&self) -> &EventId {
        self.event_id
    }

    /// The claim's fencing token (differs between a delivery and its redelivery).
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Which claim of the attempt budget this is (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the event was enqueued (the database's clock).
    pub fn created_at(&self) -> SystemTime {
        self.created_at
    }

    /// The event's ordering key as text (`#[outbox(key)]`): publish under it where the
    /// broker orders by key (a partition key), so the broker keeps the outbox's order.
    /// `None` for a type without a key, or an event enqueued before the key.
    pub fn key(&self) -> Option<&str> {
        self.key
    }

    /// The event.
    pub fn event(&self) -> &T {
        self.event
    }

    /// Whether the relay still owns this event. Once a lease renewal finds that another
    /// publisher took the row over, or the lease ends by the relay's clock with its
    /// renewals unanswered (the database out of reach), sending it is pointless: nothing
    /// can be recorded for it, and another publisher may be sending it already. A sink
    /// that can cancel an in-flight send should check this, or await
    /// [`ownership_lost`](Self::ownership_lost).
    pub fn is_owned(&self) -> bool {
        !self.lost.is_cancelled()
    }

    /// Completes when the relay loses ownership of this event.
    pub async fn ownership_lost(&self) {
        self.lost.cancelled().await;
    }
}

/// Why a sink could not publish an event.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Worth retrying later (broker unavailable, timeout): the event goes back to
    /// `READY` with a backoff, while its attempt budget lasts.
    #[error("transient: {0}")]
    Transient(#[source] BoxError),
    /// Retrying cannot help (the broker rejected the message): the event moves to
    /// `DEAD` now, with this message in `last_error`.
    #[error("permanent: {0}")]
    Permanent(#[source] BoxError),
    /// The destination cannot take anything now (the broker is down or unreachable, the
    /// client is reconnecting): the event goes back to `READY`, due at once, **without
    /// counting the attempt**, and the worker backs off before it claims again, so an
    /// outage of any length sends nothing to `DEAD`.
    ///
    /// For an outage, not for a message: an event that keeps failing this way is never
    /// retired. A message the broker refuses is [`Permanent`](Self::Permanent); a lost
    /// acknowledgement is [`Transient`](Self::Transient).
    #[error("destination unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// The message left this process and got no answer, and nothing can call it back:
    /// the destination may have it, or may still get it, late (a Kafka record already
    /// sent when the relay [withdrew](Sink::withdraw) its batch). The relay records
    /// nothing: the event stays claimed until its lease ends, and is then published
    /// again (the attempt counted, as for any claim that ran out). Handing it back at
    /// once could let another publisher send it, and the events after it under its
    /// ordering key, before the late copy lands.
    #[error("in doubt: {0}")]
    InDoubt(#[source] BoxError),
}

impl SinkError {
    /// A [`Transient`](Self::Transient) error.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self::Transient(error.into())
    }

    /// A [`Permanent`](Self::Permanent) error.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self::Permanent(error.into())
    }

    /// An [`Unavailable`](Self::Unavailable) error.
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }

    /// An [`InDoubt`](Self::InDoubt) error.
    pub fn in_doubt(error: impl Into<BoxError>) -> Self {
        Self::InDoubt(error.into())
    }

    /// Whether this says the destination is unavailable.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// A destination for events: a broker client, a webhook, a test double.
///
/// `publish` receives a whole claimed batch and reports one result per delivery, in
/// order. A result is what the relay records: `Ok` -> `SENT`, a transient error ->
/// retry with backoff, a permanent error -> `DEAD`, an error in doubt -> nothing (the
/// claim stands until its lease ends). A missing result counts as a transient error.
///
/// When the destination itself is down, return [`SinkError::Unavailable`] for the
/// deliveries it did not take (usually all of them): the relay hands them back without
/// counting their attempt, and that worker waits before it claims again (from 100 ms,
/// doubling, at most 5 s: [`Relay::unavailable_backoff`](super::Relay::unavailable_backoff)).
/// The relay logs the outage once when it begins and once when the sink answers again.
///
/// ```
/// use outbox_runtime::relay::{Delivery, Sink, SinkError};
///
/// # #[derive(Debug)] struct Event;
/// /// Stands for a broker client.
/// struct Broker { connected: bool }
///
/// struct BrokerSink { broker: Broker }
///
/// impl Sink<Event> for BrokerSink {
///     async fn publish(&self, batch: &[Delivery<'_, Event>]) -> Vec<Result<(), SinkError>> {
///         if !self.broker.connected {
///             // Nothing of this batch can reach the broker: not the events' fault.
///             return batch
///                 .iter()
///                 .map(|_| Err(SinkError::unavailable("not connected to the broker")))
///                 .collect();
///         }
///         batch.iter().map(|_| Ok(())).collect()
///     }
/// }
/// ```
///
/// A `publish` that panics does not take the relay down. The relay catches the panic
/// and publishes the batch again one event at a time, so the events the sink can
/// publish are published in the same attempt, and only the event it panics on is
/// retried, with `sink panicked: <message>` as its `last_error` (and, once its attempt
/// budget is spent, in `DEAD`).
pub trait Sink<T>: Send + Sync + 'static {
    /// Publishes `batch`, one result per delivery.
    fn publish(
        &self,
        batch: &[Delivery<'_, T>],
    ) -> impl Future<Output = Vec<Result<(), SinkError>>> + Send;

    /// Takes back what the sink still holds of the batches it is publishing: called when
    /// the relay's shutdown grace runs out while `publish` has not returned.
    ///
    /// Without it the relay drops the `publish` future and hands the batch's events back,
    /// due at once. That is safe for a sink that sends nothing once its future is
    /// dropped, not for one whose client keeps sending in the background (a producer's
    /// queue): another relay could claim and publish the next event of a key before the
    /// late copy of this one lands, and the destination would hold them out of order.
    ///
    /// Return `true` once nothing of those batches can leave this process any more; the
    /// `publish` calls in flight must then return promptly, each delivery's result saying
    /// what became of it: `Ok` if the destination took it before, [`SinkError::Unavailable`]
    /// if it was taken back unsent (handed back at once, the attempt not counted),
    /// [`SinkError::InDoubt`] if it was sent and unanswered (kept claimed until its lease
    /// ends). The relay waits for them within its
    /// [`send_timeout`](super::Relay::send_timeout); a batch not answered by then is in
    /// doubt as a whole. Return promptly: the relay renews no lease meanwhile.
    ///
    /// The default returns `false`: nothing to take back, and the relay drops `publish`.
    /// A sink that wraps another forwards this call.
    fn withdraw(&self) -> impl Future<Output = bool> + Send {
        std::future::ready(false)
    }
}

/// `sink.publish(batch)`, awaited, or the panic it raised: in the call itself (a sink
/// may encode the batch before it returns its future) or in the future.
async fn publish_caught<T, S: Sink<T>>(
    sink: &S,
    batch: &[Delivery<'_, T>],
) -> std::thread::Result<Vec<Result<(), SinkError>>> {
    let publishing = std::panic::catch_unwind(AssertUnwindSafe(|| sink.publish(batch)))?;
    AssertUnwindSafe(publishing).catch_unwind().await
}

/// Runs `sink.publish(batch)`, containing a panic: a batch that panics is published
/// again one delivery at a time, and a delivery that panics on its own fails as
/// transient, with the panic's message.
pub(crate) async fn publish_contained<T, S: Sink<T>>(
    sink: &S,
    batch: &[Delivery<'_, T>],
) -> Vec<Result<(), SinkError>> {
    let panic = match publish_caught(sink, batch).await {
        Ok(results) => return results,
        Err(panic) => panic_message(panic.as_ref()),
    };
    if let [one] = batch {
        tracing::error!(event_id = %one.event_id, %panic, "the sink panicked");
        return vec![Err(panicked(&panic))];
    }
    tracing::error!(size = batch.len(), %panic,
        "the sink panicked on a batch; publishing its events one at a time");
    let mut results = Vec::with_capacity(batch.len());
    for one in batch.chunks(1) {
        let result = if one[0].is_owned() {
            match publish_caught(sink, one).await {
                Ok(mut result) => result.pop().unwrap_or_else(|| {
                    Err(SinkError::transient(
                        "the sink returned no result for this event",
                    ))
                }),
                Err(panic) => {
                    let panic = panic_message(panic.as_ref());
                    tracing::error!(event_id = %one[0].event_id, %panic, "the sink panicked");
                    Err(panicked(&panic))
                }
            }
        } else {
            // Another publisher owns it now: nothing will be recorded for it.
            Err(SinkError::transient("ownership lost"))
        };
        results.push(result);
    }
    results
}

fn panicked(message: &str) -> SinkError {
    SinkError::transient(format!("sink panicked: {message}"))
}

/// What `panic!` was given: a `&str` or a `String`, as the standard hook prints it.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// What a [`MemorySink`] saw of one delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct Published<T> {
    /// The stable event id.
    pub event_id: EventId,
    /// The generation of the claim that published it.
    pub generation: Generation,
    /// The attempt number.
    pub attempt: u32,
    /// The event.
    pub event: T,
}

/// An in-memory sink that records every delivery and always succeeds: for tests and
/// examples. Clones share the same record.
#[derive(Debug)]
pub struct MemorySink<T> {
    published: Arc<Mutex<Vec<Published<T>>>>,
}

impl<T> Clone for MemorySink<T> {
    fn clone(&self) -> Self {
        Self {
            published: Arc::clone(&self.published),
        }
    }
}

impl<T> Default for MemorySink<T> {
    fn default() -> Self {
        Self {
            published: Arc::default(),
        }
    }
}

impl<T: Clone> MemorySink<T> {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every delivery so far, in publication order.
    pub fn published(&self) -> Vec<Published<T>> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<T: Clone + Send + Sync + 'static> Sink<T> for MemorySink<T> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        published.extend(batch.iter().map(|d| Published {
            event_id: d.event_id.clone(),
            generation: d.generation,
            attempt: d.attempt,
            event: d.event.clone(),
        }));
        batch.iter().map(|_| Ok(())).collect()
    }
}

/// A sink that prints each event as one line on stdout: `event_id generation attempt
/// {event:?}`. For trying things out.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutSink;

impl<T: std::fmt::Debug + Send + Sync + 'static> Sink<T> for StdoutSink {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        batch
            .iter()
            .map(|d| {
                writeln!(
                    out,
                    "{} {} {} {:?}",
                    d.event_id, d.generation, d.attempt, d.event
                )
                .map_err(SinkError::transient)
            })
            .collect()
    }
}
