//! The broker sinks, each behind its cargo feature, and what they share: where an event
//! goes and how it is encoded ([`Outgoing`]), a message's body and the outbox's headers,
//! built the same way whichever broker carries the event, and a message that failed
//! ([`Failed`]). A broker's file holds what is its own: its client, what it checks
//! before a message goes out, and what its errors mean.
//!
//! A new broker: its file here (named as its cargo feature, which turns `cfg(any_broker)`
//! on), its `mod` line below, its feature and optional dependency (this crate's and the
//! facade's), and its re-export in both crates' `lib.rs`.

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

use std::sync::Arc;

use derive_where::derive_where;

use super::message::{self, Attributes, CloudEvents, Encoding, Json, header, timestamp};
use super::{Delivery, SinkError};
use crate::spec::Outbox;

/// Where an event goes (a subject, a routing key, a topic), from the event.
type DestinationOf<T> = Arc<dyn Fn(&T) -> String + Send + Sync>;

/// What a broker sink makes of each event before its broker sees it: the destination,
/// from the event, and the body, with the [`Encoding`].
///
/// `derive_where`, here and in the sinks that hold it: `T` is only the events' type, and
/// `derive` would ask for `T: Clone` and `T: Debug`.
#[derive_where(Clone, Debug; E)]
pub(crate) struct Outgoing<T, E> {
    #[derive_where(skip)]
    destination: DestinationOf<T>,
    pub(crate) encoding: E,
    /// Each event as a CloudEvent, when set.
    cloud_events: Option<Arc<CloudEvents>>,
}

impl<T> Outgoing<T, Json> {
    /// Every event to `destination`, as JSON.
    pub(crate) fn new(destination: String) -> Self {
        Self {
            destination: Arc::new(move |_: &T| destination.clone()),
            encoding: Json,
            cloud_events: None,
        }
    }
}

impl<T, E> Outgoing<T, E> {
    /// Each event to the destination `destination` derives from it.
    pub(crate) fn destination_from(
        self,
        destination: impl Fn(&T) -> String + Send + Sync + 'static,
    ) -> Self {
        Self {
            destination: Arc::new(destination),
            ..self
        }
    }

    /// The events encoded with `encoding`.
    pub(crate) fn encoding<E2>(self, encoding: E2) -> Outgoing<T, E2> {
        Outgoing {
            destination: self.destination,
            encoding,
            cloud_events: self.cloud_events,
        }
    }

    /// Each event as a CloudEvent.
    pub(crate) fn cloud_events(self, cloud_events: CloudEvents) -> Self {
        Self {
            cloud_events: Some(Arc::new(cloud_events)),
            ..self
        }
    }

    /// Where `event` goes.
    pub(crate) fn destination(&self, event: &T) -> String {
        (self.destination)(event)
    }
}

impl<T: Outbox, E: Encoding<T>> Outgoing<T, E> {
    /// `delivery`'s message, or the sink's answer when there is none to send: the event
    /// was taken over (nothing will be recorded for it), or it does not encode
    /// (permanent).
    pub(crate) fn message(&self, delivery: &Delivery<'_, T>) -> Result<Message<'_>, SinkError> {
        if !delivery.is_owned() {
            return Err(SinkError::transient("ownership lost"));
        }
        let body = self
            .encoding
            .encode(delivery.event())
            .map_err(|error| SinkError::permanent(format!("cannot encode the event: {error}")))?;
        let content_type = self.encoding.content_type();
        let mut message = Message {
            destination: self.destination(delivery.event()),
            body,
            headers: headers(delivery).collect(),
            content_type,
            cloud_event: Vec::new(),
        };
        if let Some(cloud_events) = &self.cloud_events {
            let attributes = cloud_events.attributes(
                T::SPEC.table,
                delivery.event_id().as_str(),
                delivery.created_at(),
                delivery.key(),
                delivery.trace(),
            );
            if cloud_events.is_structured() {
                message.body = message::structured(&attributes, content_type, &message.body);
                message.content_type = Some(message::STRUCTURED);
            } else {
                message.cloud_event = attributes;
            }
        }
        Ok(message)
    }
}

/// One event's message, for its broker to carry.
pub(crate) struct Message<'a> {
    /// The subject, routing key or topic.
    pub(crate) destination: String,
    pub(crate) body: Vec<u8>,
    /// The outbox's headers, by name (the content type aside).
    pub(crate) headers: Vec<(&'static str, String)>,
    /// The encoding's media type, a header or a property as the broker has it (a
    /// structured CloudEvent's, in that mode).
    pub(crate) content_type: Option<&'a str>,
    /// A CloudEvent's attributes in binary mode, for headers named as the broker's
    /// binding has them; empty otherwise.
    pub(crate) cloud_event: Attributes,
}

impl Message<'_> {
    /// Whether the message is a CloudEvent: in binary mode (its attributes) or in
    /// structured mode (its media type).
    #[cfg_attr(
        not(feature = "kafka"),
        expect(
            dead_code,
            reason = "only Kafka's binding renames the content type header"
        )
    )]
    pub(crate) fn is_cloud_event(&self) -> bool {
        !self.cloud_event.is_empty() || self.content_type == Some(message::STRUCTURED)
    }

    /// The CloudEvent attributes as headers, each name after `prefix` (`ce_`, `ce-`,
    /// `cloudEvents_`).
    pub(crate) fn cloud_event_headers<'m>(
        &'m self,
        prefix: &'m str,
    ) -> impl Iterator<Item = (String, &'m str)> + 'm {
        self.cloud_event
            .iter()
            .map(move |(name, value)| (format!("{prefix}{name}"), value.as_str()))
    }
}

/// The outbox's headers of `delivery`'s message, by name (the content type aside).
fn headers<T: Outbox>(
    delivery: &Delivery<'_, T>,
) -> impl Iterator<Item = (&'static str, String)> + use<T> {
    [
        (header::EVENT_ID, delivery.event_id().as_str().to_owned()),
        (header::TABLE, T::SPEC.table.to_owned()),
        (header::GENERATION, delivery.generation().to_string()),
        (header::ATTEMPT, delivery.attempt().to_string()),
        (header::CREATED_AT, timestamp(delivery.created_at())),
    ]
    .into_iter()
    .chain(delivery.key().map(|key| (header::KEY, key.to_owned())))
    .chain(
        delivery
            .trace()
            .map(|trace| (header::TRACEPARENT, trace.traceparent().to_owned())),
    )
    .chain(
        delivery
            .trace()
            .and_then(|trace| trace.tracestate())
            .map(|state| (header::TRACESTATE, state.to_owned())),
    )
    .chain(
        delivery
            .trace()
            .and_then(|trace| trace.baggage())
            .map(|baggage| (header::BAGGAGE, baggage.to_owned())),
    )
}

/// A message that will not be acknowledged: the sink's own answer, or the client's error
/// (`F`), which the sink classifies once it knows how the batch went (was the client
/// still connected, did a broker answer).
pub(crate) enum Failed<F> {
    /// Final: ownership lost, the event does not encode, a destination or header the
    /// broker would not carry faithfully.
    Answer(SinkError),
    /// The client's error, and what the sink needs to tell what it means.
    Client(F),
}

impl<F> From<SinkError> for Failed<F> {
    fn from(answer: SinkError) -> Self {
        Self::Answer(answer)
    }
}

/// The answer for every delivery of a batch that cannot go out: the broker is away.
pub(crate) fn unavailable<A, T>(batch: &[Delivery<'_, T>], why: &str) -> Vec<Result<A, SinkError>> {
    batch
        .iter()
        .map(|_| Err(SinkError::unavailable(why.to_owned())))
        .collect()
}

/// A batch's acknowledgements as [`Sink::publish`](super::Sink::publish) reports them:
/// whether each delivery was acknowledged. (Each sink also offers them whole, for a sink
/// that wraps it.)
pub(crate) fn acknowledged<A>(acks: Vec<Result<A, SinkError>>) -> Vec<Result<(), SinkError>> {
    acks.into_iter().map(|ack| ack.map(drop)).collect()
}
