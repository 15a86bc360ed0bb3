//! The broker sinks, each behind its cargo feature, and what they share: a message's body
//! and the outbox's headers, built the same way whichever broker carries the event.

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

use super::message::{Encoding, header, timestamp};
use super::{Delivery, SinkError};
use crate::spec::Outbox;

/// The body of `delivery`'s message, or a broker sink's answer when there is none to
/// send: the event was taken over (nothing will be recorded for it), or it does not
/// encode (permanent).
pub(crate) fn body<T, E: Encoding<T>>(
    encoding: &E,
    delivery: &Delivery<'_, T>,
) -> Result<Vec<u8>, SinkError> {
    if !delivery.is_owned() {
        return Err(SinkError::transient("ownership lost"));
    }
    encoding
        .encode(delivery.event())
        .map_err(|error| SinkError::permanent(format!("cannot encode the event: {error}")))
}

/// The outbox's headers of `delivery`'s message, by name (the content type aside).
pub(crate) fn headers<T: Outbox>(
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
}
