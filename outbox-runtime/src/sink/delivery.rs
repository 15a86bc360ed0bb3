//! One event as a sink receives it: [`Delivery`].

use std::borrow::Cow;
use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use crate::id::{EventId, Generation};
use crate::trace::TraceContext;

/// One event handed to a [`Sink`](super::Sink), with the identities a consumer needs.
#[derive(Debug)]
pub struct Delivery<'a, T> {
    pub(crate) event_id: &'a EventId,
    pub(crate) generation: Generation,
    pub(crate) attempt: u32,
    pub(crate) created_at: SystemTime,
    pub(crate) key: Option<&'a str>,
    /// The stored context, borrowed from the claim, or the relay's own span's.
    pub(crate) trace: Option<Cow<'a, TraceContext>>,
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

    /// The trace context to publish the event in (`traceparent`, `tracestate` headers),
    /// for a type with `#[outbox(traced)]`: the relay's span for this publication (feature
    /// `otel`), or the context the event was enqueued in. The broker sinks send it.
    pub fn trace(&self) -> Option<&TraceContext> {
        self.trace.as_deref()
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
