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

/// Publishing each event as a [CloudEvent](https://cloudevents.io) (specification 1.0),
/// set on a broker sink with its `cloud_events` method (with a broker's cargo feature).
///
/// The event's attributes: `id` = the event id (what a consumer deduplicates on),
/// `source` and `type` as set here (by default `/outbox/<table>` and the table's name),
/// `time` = when it was enqueued, `subject` = its ordering key where it has one, and
/// `datacontenttype` = the [`Encoding`]'s media type. The outbox's own headers
/// ([`header`]) are sent as well.
///
/// - [`binary`](Self::binary), the default mode: the body is the encoded event, and the
///   attributes are headers, named as each broker's protocol binding has them: `ce_id`
///   on Kafka (the content type in `content-type`), `ce-id` on NATS (values
///   percent-encoded, the content type also in `ce-datacontenttype`), `cloudEvents_id`
///   on RabbitMQ (the content type in the `content_type` property; AMQP 0-9-1 has no
///   binding of its own, so this is the AMQP 1.0 binding's, in the headers table).
/// - [`structured`](Self::structured): the body is the event in CloudEvents' JSON
///   format, `application/cloudevents+json`: the attributes beside `data` (the encoded
///   event, as JSON where the encoding is JSON, else as `data_base64`).
///
/// ```
/// use outbox_runtime::message::CloudEvents;
///
/// let events = CloudEvents::binary()
///     .source("https://shop.example.com/orders")
///     .event_type("com.example.order.placed");
/// # let _ = events;
/// ```
#[cfg(any_broker)]
#[derive(Debug, Clone, Default)]
pub struct CloudEvents {
    source: Option<String>,
    event_type: Option<String>,
    structured: bool,
}

/// A CloudEvent's attributes beside `data`, by name (`datacontenttype` aside, which each
/// binding carries its own way).
#[cfg(any_broker)]
pub(crate) type Attributes = Vec<(&'static str, String)>;

/// The media type of a CloudEvent in the JSON format: a structured message's content type.
#[cfg(any_broker)]
pub(crate) const STRUCTURED: &str = "application/cloudevents+json; charset=utf-8";

#[cfg(any_broker)]
impl CloudEvents {
    /// Binary mode: the encoded event as the body, the attributes as headers.
    pub fn binary() -> Self {
        Self::default()
    }

    /// Structured mode: the whole CloudEvent as a JSON body.
    pub fn structured() -> Self {
        Self {
            structured: true,
            ..Self::default()
        }
    }

    /// The `source` attribute (a URI-reference: where the events come from); by default
    /// `/outbox/<table>`.
    #[must_use]
    pub fn source(self, source: impl Into<String>) -> Self {
        Self {
            source: Some(source.into()),
            ..self
        }
    }

    /// The `type` attribute (what happened, reverse-DNS by convention:
    /// `com.example.order.placed`); by default the table's name.
    #[must_use]
    pub fn event_type(self, event_type: impl Into<String>) -> Self {
        Self {
            event_type: Some(event_type.into()),
            ..self
        }
    }

    /// Whether the events go out in structured mode.
    pub(crate) fn is_structured(&self) -> bool {
        self.structured
    }

    /// The attributes of an event of `table`, beside `data` and `datacontenttype`: the
    /// trace context, where it has one, as the distributed-tracing extension's
    /// `traceparent` and `tracestate` (the same as the message's own trace headers).
    pub(crate) fn attributes(
        &self,
        table: &str,
        event_id: &str,
        created_at: std::time::SystemTime,
        key: Option<&str>,
        trace: Option<&crate::trace::TraceContext>,
    ) -> Attributes {
        let mut attributes = vec![
            ("specversion", "1.0".to_owned()),
            ("id", event_id.to_owned()),
            (
                "source",
                self.source
                    .clone()
                    .unwrap_or_else(|| format!("/outbox/{table}")),
            ),
            (
                "type",
                self.event_type.clone().unwrap_or_else(|| table.to_owned()),
            ),
            ("time", timestamp(created_at)),
        ];
        if let Some(key) = key {
            attributes.push(("subject", key.to_owned()));
        }
        if let Some(trace) = trace {
            attributes.push(("traceparent", trace.traceparent().to_owned()));
            if let Some(state) = trace.tracestate() {
                attributes.push(("tracestate", state.to_owned()));
            }
        }
        attributes
    }
}

/// The CloudEvent in the JSON event format: `attributes`, `datacontenttype` when there
/// is one, and `data`: the body itself, as it is, where its media type is JSON and it is
/// valid JSON, else `data_base64`.
#[cfg(any_broker)]
pub(crate) fn structured(
    attributes: &Attributes,
    content_type: Option<&str>,
    body: &[u8],
) -> Vec<u8> {
    use base64::Engine as _;
    use serde_json::value::RawValue;

    #[derive(serde::Serialize)]
    struct Envelope<'a> {
        #[serde(flatten)]
        attributes: std::collections::BTreeMap<&'a str, &'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        datacontenttype: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        data: Option<&'a RawValue>,
        #[serde(skip_serializing_if = "Option::is_none")]
        data_base64: Option<String>,
    }

    // Checked, not parsed into a tree: the body is spliced in as it is.
    let data = content_type
        .filter(|media| is_json(media))
        .and_then(|_| serde_json::from_slice::<&RawValue>(body).ok());
    let envelope = Envelope {
        attributes: attributes
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect(),
        datacontenttype: content_type,
        data,
        data_base64: data
            .is_none()
            .then(|| base64::engine::general_purpose::STANDARD.encode(body)),
    };
    serde_json::to_vec(&envelope).unwrap_or_default()
}

/// Whether a media type is JSON: `application/json`, or a `+json` suffix
/// (`application/vnd.example+json`), parameters aside.
#[cfg(any_broker)]
fn is_json(media: &str) -> bool {
    let essence = media.split(';').next().unwrap_or_default().trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence.to_ascii_lowercase().ends_with("+json")
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
    /// The W3C trace context to continue (a type with `#[outbox(traced)]`, an event
    /// enqueued in a trace): what OpenTelemetry's propagators read, so an instrumented
    /// consumer joins the trace. See [`crate::trace`].
    pub const TRACEPARENT: &str = "traceparent";
    /// Its vendor entries, when there are any.
    pub const TRACESTATE: &str = "tracestate";
    /// The W3C baggage that goes with the trace context, when there is any.
    pub const BAGGAGE: &str = "baggage";
}

#[cfg(all(test, any_broker))]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    /// 2018-04-05T17:31:00Z, the time of the CloudEvents specification's examples.
    fn spec_time() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_mins(25_382_491)
    }

    #[test]
    fn the_attributes_default_to_the_table_and_name_the_key_as_subject() {
        let unkeyed =
            CloudEvents::binary().attributes("order_events", "A234", spec_time(), None, None);
        assert_eq!(
            unkeyed,
            [
                ("specversion", "1.0".to_owned()),
                ("id", "A234".to_owned()),
                ("source", "/outbox/order_events".to_owned()),
                ("type", "order_events".to_owned()),
                ("time", "2018-04-05T17:31:00.000000Z".to_owned()),
            ]
        );
        let keyed = CloudEvents::binary()
            .source("/mycontext")
            .event_type("com.example.someevent")
            .attributes("order_events", "A234", spec_time(), Some("order-7"), None);
        assert_eq!(keyed[2], ("source", "/mycontext".to_owned()));
        assert_eq!(keyed[3], ("type", "com.example.someevent".to_owned()));
        assert_eq!(keyed.last(), Some(&("subject", "order-7".to_owned())));
    }

    /// The distributed-tracing extension: the same context as the message's own headers.
    #[test]
    fn a_traced_event_carries_the_distributed_tracing_extension() {
        let trace = crate::trace::TraceContext::parse(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            Some("congo=t61rcWkgMzE"),
        );
        let attributes = CloudEvents::binary().attributes(
            "order_events",
            "A234",
            spec_time(),
            None,
            trace.as_ref(),
        );
        assert_eq!(
            attributes[attributes.len() - 2..],
            [
                (
                    "traceparent",
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned()
                ),
                ("tracestate", "congo=t61rcWkgMzE".to_owned()),
            ]
        );
    }

    /// The JSON event format's examples: JSON data as `data`, other data as
    /// `data_base64`.
    #[test]
    fn a_structured_event_is_the_json_formats_envelope() {
        let attributes = CloudEvents::structured()
            .source("/mycontext")
            .event_type("com.example.someevent")
            .attributes("t", "C234-1234-1234", spec_time(), None, None);
        let body = br#"{"appinfoA":"abc","appinfoB":123,"appinfoC":true}"#;
        let json: serde_json::Value =
            serde_json::from_slice(&structured(&attributes, Some("application/json"), body))
                .unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "specversion": "1.0",
                "type": "com.example.someevent",
                "source": "/mycontext",
                "id": "C234-1234-1234",
                "time": "2018-04-05T17:31:00.000000Z",
                "datacontenttype": "application/json",
                "data": { "appinfoA": "abc", "appinfoB": 123, "appinfoC": true }
            })
        );

        let thrift = structured(
            &attributes,
            Some("application/vnd.apache.thrift.binary"),
            &[0, 159, 255],
        );
        let json: serde_json::Value = serde_json::from_slice(&thrift).unwrap();
        assert_eq!(json["data_base64"], "AJ//");
        assert_eq!(
            json["datacontenttype"],
            "application/vnd.apache.thrift.binary"
        );
        assert!(json.get("data").is_none());
    }

    #[test]
    fn only_json_media_types_embed_their_data() {
        assert!(is_json("application/json"));
        assert!(is_json("application/json; charset=utf-8"));
        assert!(is_json("application/vnd.example+json"));
        assert!(is_json("Application/JSON"));
        assert!(!is_json("application/xml"));
        assert!(!is_json("text/plain"));
        // JSON that does not parse is sent as it is, in base64.
        let attributes = CloudEvents::structured().attributes("t", "1", spec_time(), None, None);
        let json: serde_json::Value =
            serde_json::from_slice(&structured(&attributes, Some("application/json"), b"{"))
                .unwrap();
        assert_eq!(json["data_base64"], "ew==");
    }
}
