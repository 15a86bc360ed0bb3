//! What a broker sink puts into a message besides the event: how the event is encoded
//! ([`Encoding`], JSON by default) and the headers that carry its identities
//! ([`header`]). Shared by the broker sinks, so a consumer reads the same headers
//! whichever broker carried the event.

use serde::Serialize;

use super::BoxError;

/// How a broker sink turns an event into a message body.
///
/// [`Json`] is the default. Implement it for protobuf, Avro, or bytes the event already
/// holds; an error makes that event fail permanently (`DEAD`, the error in
/// `last_error`): encoding it again would fail the same way.
///
/// ```
/// use outbox_runtime::message::Encoding;
/// use outbox_runtime::relay::BoxError;
///
/// struct Invoice { pdf: Vec<u8> }
///
/// /// The body is the event's own bytes.
/// struct Pdf;
///
/// impl Encoding<Invoice> for Pdf {
///     fn content_type(&self) -> Option<&str> {
///         Some("application/pdf")
///     }
///
///     fn encode(&self, invoice: &Invoice) -> Result<Vec<u8>, BoxError> {
///         Ok(invoice.pdf.clone())
///     }
/// }
/// # assert_eq!(Pdf.encode(&Invoice { pdf: vec![1] }).unwrap(), [1]);
/// ```
pub trait Encoding<T>: Send + Sync + 'static {
    /// The body's media type, sent as the message's content type when there is one.
    fn content_type(&self) -> Option<&str> {
        None
    }

    /// The message body for `event`.
    fn encode(&self, event: &T) -> Result<Vec<u8>, BoxError>;
}

/// The event as JSON, through its `serde::Serialize`: the default [`Encoding`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl<T: Serialize> Encoding<T> for Json {
    fn content_type(&self) -> Option<&str> {
        Some("application/json")
    }

    fn encode(&self, event: &T) -> Result<Vec<u8>, BoxError> {
        Ok(serde_json::to_vec(event)?)
    }
}

/// `at` as the [`header::CREATED_AT`] header writes it.
pub fn timestamp(at: std::time::SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(at).to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The names of the headers a broker sink sets on every message.
pub mod header {
    /// The stable event id: what a consumer deduplicates on (with an
    /// [`Inbox`](crate::inbox::Inbox)). The same in every copy of the event.
    pub const EVENT_ID: &str = "Outbox-Event-Id";
    /// The outbox table the event came from: its event type.
    pub const TABLE: &str = "Outbox-Table";
    /// The generation of the claim that published this copy: differs between a copy
    /// and its redelivery. For diagnostics.
    pub const GENERATION: &str = "Outbox-Generation";
    /// Which attempt of the event's budget published this copy (1 for the first). For
    /// diagnostics.
    pub const ATTEMPT: &str = "Outbox-Attempt";
    /// When the event was enqueued, in RFC 3339 with microseconds, UTC
    /// (`2026-12-03T21:05:09.123456Z`).
    pub const CREATED_AT: &str = "Outbox-Created-At";
    /// The event's ordering key (`#[outbox(key)]`) as text, when its type has one and
    /// the event a key: what a consumer that applies each key's events in order groups
    /// them by. (The Kafka sink also makes it the record key, by default.)
    pub const KEY: &str = "Outbox-Key";
    /// The body's media type, when the [`Encoding`](super::Encoding) names one.
    pub const CONTENT_TYPE: &str = "Content-Type";
}
