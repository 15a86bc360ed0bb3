//! Where the relay publishes: the [`Sink`] trait, what a sink is given ([`Delivery`]) and
//! what it answers ([`SinkError`]), the two sinks shipped with the crate
//! ([`MemorySink`](memory::MemorySink), [`StdoutSink`](stdout::StdoutSink)), what a broker
//! sink puts into a message ([`message`]), and the broker sinks behind their cargo
//! features (`broker`).

#[cfg(any_broker)]
pub(crate) mod broker;
mod delivery;
mod destination;
mod error;
pub(crate) mod memory;
pub mod message;
pub(crate) mod stdout;

use std::future::Future;

pub use delivery::Delivery;
pub use destination::Destination;
pub use error::{BoxError, SinkError};

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
/// doubling, at most 5 s: [`Relay::unavailable_backoff`](crate::relay::Relay::unavailable_backoff)).
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
    /// [`send_timeout`](crate::relay::Relay::send_timeout); a batch not answered by then is in
    /// doubt as a whole. Return promptly: the relay renews no lease meanwhile.
    ///
    /// The default returns `false`: nothing to take back, and the relay drops `publish`.
    /// A sink that wraps another forwards this call.
    fn withdraw(&self) -> impl Future<Output = bool> + Send {
        std::future::ready(false)
    }

    /// Where the sink publishes `event`, for the relay's `send` span of a traced event
    /// (feature `otel`): the broker sinks name their system and the subject, topic or
    /// exchange. The default, `None`, leaves the span naming the outbox's table under the
    /// system `outbox`. Asked once per span, never for an unsampled request. A sink that
    /// wraps another forwards this call.
    fn destination(&self, event: &T) -> Option<Destination> {
        let _ = event;
        None
    }
}
