//! Publishing to NATS JetStream (cargo feature `nats`): [`JetStreamSink`].
//!
//! The sink takes the application's own JetStream [`Context`] (built from its
//! [`async_nats::Client`], with its TLS, credentials and reconnect settings), publishes
//! each event on a subject of its choosing, and sets `Nats-Msg-Id` to its table and
//! event id (`<table>:<event id>`):
//! within the stream's duplicate window (`duplicate_window`, two minutes by default) the
//! server stores a redelivered event once and acknowledges the copy as a duplicate,
//! which the sink reports as published.

pub use async_nats;
use async_nats::RequestErrorKind;
use async_nats::connection::State;
use async_nats::jetstream::context::{
    GetStreamByNameError, GetStreamByNameErrorKind, PublishAckFuture, PublishError,
    PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{Context, ErrorCode};
use derive_where::derive_where;
use futures_util::future::join_all;

use crate::sink::broker::{self, Failed, Outgoing};
use crate::sink::message::{CloudEvents, Encoding, Json, header};
use crate::sink::{Delivery, Destination, Sink, SinkError};
use crate::spec::Outbox;
use crate::trace::TraceContext;

/// The broker, as OpenTelemetry's messaging conventions name it (`messaging.system`).
const SYSTEM: &str = "nats";

/// Metric the sink emits through the `metrics` crate, labelled `table`.
pub mod metric {
    /// Counter: messages JetStream acknowledged as duplicates (a redelivery inside the
    /// stream's duplicate window, stored once), reported as published.
    pub const DUPLICATES: &str = "outbox_nats_duplicates_total";
}

/// A [`Sink`] that publishes events to NATS JetStream.
///
/// Each event becomes one message: the body from the [`Encoding`] (JSON by default),
/// the headers of [`message::header`](crate::message::header) (event id, table,
/// generation, attempt, enqueue time, content type), and `Nats-Msg-Id` =
/// `<table>:<event id>` (an event id is unique within its table, and a stream may take
/// several tables' events). A batch is pipelined: every message is published without
/// waiting for the acknowledgements before it, and each acknowledgement awaited as it
/// can be, so that the context's acknowledgement slots (`max_ack_inflight`) are freed
/// while the batch goes out.
///
/// | JetStream's answer | the result |
/// |---|---|
/// | an acknowledgement, a duplicate's included | `Ok` (`SENT`) |
/// | the client is not connected (before the batch, or when an acknowledgement is lost); no responders for a subject that a stream takes (JetStream stopping or starting, a leader election), or when the stream list does not answer either (no responders) | [`SinkError::Unavailable`]: handed back, no attempt counted |
/// | no acknowledgement in time, connected (the context's timeout, 5 s by default); no responders, and the stream list could not be asked (no answer in time, say for a publisher not allowed `$JS.API.STREAM.NAMES`, or an error from it) | [`SinkError::Transient`] |
/// | the event does not encode; no stream takes the subject (no responders, and JetStream's stream list has none for it); the message is over the server's or the stream's size limit; an invalid subject (empty, with whitespace, or with an empty token) or a wildcard one (a `*` or `>` token), checked before it is sent; an event id or key with a line break, which no NATS header can carry, or with leading or trailing whitespace, which the consumer's client would trim | [`SinkError::Permanent`] (`DEAD`) |
/// | any other error from the server (storage full, no leader) | [`SinkError::Transient`] |
///
/// ```no_run
/// use outbox_runtime::nats::{JetStreamSink, async_nats};
/// use outbox_runtime::relay::{CancellationToken, Relay};
///
/// // `OrderPlaced`: your event, `#[derive(outbox::Outbox, serde::Serialize)]`.
/// # async fn run<OrderPlaced: outbox_runtime::Outbox + serde::Serialize>(
/// #     pool: sqlx::PgPool,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let client = async_nats::connect("nats://127.0.0.1:4222").await?; // your TLS, auth
/// let jetstream = async_nats::jetstream::new(client);
/// // A stream must take the subject (created here, or by your deployment).
/// jetstream
///     .get_or_create_stream(async_nats::jetstream::stream::Config {
///         name: "ORDERS".into(),
///         subjects: vec!["orders.>".into()],
///         ..Default::default()
///     })
///     .await?;
/// let sink = JetStreamSink::<OrderPlaced>::new(jetstream, "orders.placed");
/// Relay::new(pool, sink).run(CancellationToken::new()).await?;
/// # Ok(()) }
/// ```
#[derive_where(Clone, Debug; E)]
pub struct JetStreamSink<T, E = Json> {
    #[derive_where(skip(Debug))]
    jetstream: Context,
    /// Subjects and bodies.
    outgoing: Outgoing<T, E>,
}

impl<T> JetStreamSink<T, Json> {
    /// A sink publishing every event as JSON on `subject`.
    pub fn new(jetstream: Context, subject: impl Into<String>) -> Self {
        Self {
            jetstream,
            outgoing: Outgoing::new(subject.into()),
        }
    }
}

impl<T, E> JetStreamSink<T, E> {
    /// Derives each event's subject from the event (a region, a tenant, an aggregate):
    /// `.subject_from(|order: &OrderPlaced| format!("orders.placed.{}", order.region))`.
    #[must_use]
    pub fn subject_from(self, subject: impl Fn(&T) -> String + Send + Sync + 'static) -> Self {
        Self {
            outgoing: self.outgoing.destination_from(subject),
            ..self
        }
    }

    /// Encodes the events with `encoding` instead of JSON.
    pub fn encoding<E2: Encoding<T>>(self, encoding: E2) -> JetStreamSink<T, E2> {
        JetStreamSink {
            jetstream: self.jetstream,
            outgoing: self.outgoing.encoding(encoding),
        }
    }

    /// Publishes each event as a CloudEvent ([`CloudEvents`]): in binary mode, its
    /// attributes as `ce-` headers (`ce-id`, `ce-source`, `ce-type`, ...,
    /// percent-encoded as the NATS binding asks), beside the outbox's own.
    #[must_use]
    pub fn cloud_events(self, cloud_events: CloudEvents) -> Self {
        Self {
            outgoing: self.outgoing.cloud_events(cloud_events),
            ..self
        }
    }
}

/// A message that did not reach the stream, and where it was headed.
struct Failure {
    subject: String,
    error: PublishError,
    /// Whether the message was never handed to the client (so the server cannot have
    /// it).
    unsent: bool,
}

impl<T: Outbox, E: Encoding<T>> JetStreamSink<T, E> {
    /// Publishes `batch` and returns JetStream's acknowledgement of each delivery, in
    /// order ([`PublishAck::duplicate`] says the stream already had it), or the error the
    /// [`Sink`] implementation reports. For sinks that wrap this one and need the
    /// acknowledgements (stream sequence, duplicate flag).
    pub async fn publish_acked(
        &self,
        batch: &[Delivery<'_, T>],
    ) -> Vec<Result<PublishAck, SinkError>> {
        let client = self.jetstream.client();
        let state = client.connection_state();
        if state != State::Connected {
            return broker::unavailable(batch, &format!("the NATS client is {state}"));
        }
        // One future per delivery, sending and then awaiting its own acknowledgement, all
        // driven together: the messages go out before the first acknowledgement is back
        // (about one round trip for the batch), and an acknowledgement is awaited as soon
        // as it can be. Each publish takes one of the context's acknowledgement slots
        // (`max_ack_inflight`, shared by every worker on the context), waiting for one when
        // none is free, and only an awaited (or dropped) acknowledgement frees its slot:
        // sending the whole batch before awaiting any would wait for slots that only this
        // batch could free. The futures are first polled in the batch's order, and the
        // client queues them fairly (slots, then its command channel), so the messages go
        // out in that order.
        let acked = join_all(batch.iter().map(|delivery| async move {
            let (subject, ack) = self.send(delivery).await?;
            ack.await.map_err(|error| {
                Failed::Client(Failure {
                    subject,
                    error,
                    unsent: false,
                })
            })
        }))
        .await;
        let connected = client.connection_state() == State::Connected;
        let table = T::SPEC.table;
        // What the stream list says of each subject that found no responders, asked once.
        let mut streams: Vec<(String, Responders)> = Vec::new();
        let mut answers = Vec::with_capacity(acked.len());
        for acked in acked {
            answers.push(match acked {
                Ok(ack) => {
                    if ack.duplicate {
                        metrics::counter!(metric::DUPLICATES, "table" => table).increment(1);
                    }
                    Ok(ack)
                }
                Err(Failed::Answer(error)) => Err(error),
                Err(Failed::Client(failure))
                    if failure.error.kind() == PublishErrorKind::StreamNotFound =>
                {
                    let known = streams
                        .iter()
                        .find(|(subject, _)| *subject == failure.subject);
                    let responders = if let Some((_, responders)) = known {
                        responders.clone()
                    } else {
                        let responders = self.responders(&failure.subject).await;
                        streams.push((failure.subject.clone(), responders.clone()));
                        responders
                    };
                    Err(no_responders(&failure.subject, responders))
                }
                Err(Failed::Client(failure)) => Err(classify(&failure, connected)),
            });
        }
        answers
    }

    /// Why a publish to `subject` found no responders: JetStream's stream list says
    /// whether a stream takes the subject.
    async fn responders(&self, subject: &str) -> Responders {
        let looked_up = self.jetstream.stream_by_subject(subject).await;
        let connected = self.jetstream.client().connection_state() == State::Connected;
        responders_from(looked_up, connected)
    }

    /// Hands one delivery's message to the client; returns its subject and the future
    /// of its acknowledgement.
    async fn send(
        &self,
        delivery: &Delivery<'_, T>,
    ) -> Result<(String, PublishAckFuture), Failed<Failure>> {
        let outgoing = self.outgoing.message(delivery)?;
        let cloud_event = cloud_event_headers(&outgoing);
        let broker::Message {
            destination: subject,
            body,
            headers,
            content_type,
            ..
        } = outgoing;
        // The client takes some invalid subjects, which the server then routes nowhere
        // (no responders, and the stream list refuses to say why: taken for an outage,
        // the event would be handed back forever), and panics on a header value with a
        // line break. Both are the event's, for good. A wildcard token is sent too, and a
        // stream capturing `a.>` stores `a.*` under that literal subject, which no
        // consumer filtering `a.b` ever sees.
        if async_nats::Subject::validated(&subject).is_err() {
            return Err(Failed::Answer(SinkError::permanent(format!(
                "publishing to `{subject}`: not a valid subject (empty, with whitespace, \
                 or with an empty token: a leading, trailing or doubled dot)"
            ))));
        }
        if subject.split('.').any(|token| token == "*" || token == ">") {
            return Err(Failed::Answer(SinkError::permanent(format!(
                "publishing to `{subject}`: a wildcard (`*` or `>`) names no single \
                 subject to publish to"
            ))));
        }
        if let Some(why) = unfaithful_header(&headers) {
            return Err(Failed::Answer(SinkError::permanent(format!(
                "publishing to `{subject}`: {why}"
            ))));
        }
        let mut message = PublishMessage::build()
            .payload(body.into())
            .message_id(message_id::<T>(delivery));
        for (name, value) in headers {
            message = message.header(name, value);
        }
        if let Some(content_type) = content_type {
            message = message.header(header::CONTENT_TYPE, content_type);
        }
        for (name, value) in cloud_event {
            message = message.header(name.as_str(), value);
        }
        match self.jetstream.send_publish(subject.clone(), message).await {
            Ok(ack) => Ok((subject, ack)),
            Err(error) => Err(Failed::Client(Failure {
                subject,
                error,
                unsent: true,
            })),
        }
    }
}

/// What the NATS binding of CloudEvents asks percent-encoded in a header value: space,
/// double quote, percent, the control characters; and every byte of a character outside
/// ASCII, always.
const CLOUD_EVENT_VALUE: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');

/// A binary CloudEvent's headers as the NATS binding names them (`ce-id`, ...), values
/// percent-encoded, `datacontenttype` among them; none for another message.
fn cloud_event_headers(message: &broker::Message<'_>) -> Vec<(String, String)> {
    if message.cloud_event.is_empty() {
        return Vec::new();
    }
    let encode =
        |value: &str| percent_encoding::utf8_percent_encode(value, CLOUD_EVENT_VALUE).to_string();
    message
        .cloud_event_headers("ce-")
        .map(|(name, value)| (name, encode(value)))
        .chain(
            message
                .content_type
                .map(|media| ("ce-datacontenttype".to_owned(), encode(media))),
        )
        .collect()
}

/// Why one of `headers` cannot reach a consumer as it is, if one cannot: the client
/// panics on a line break, and trims a value it reads, so `ord-1 ` would reach the
/// consumer as `ord-1`, another event's id, and its effect be skipped as already applied.
fn unfaithful_header(headers: &[(&str, String)]) -> Option<String> {
    headers.iter().find_map(|(name, value)| {
        if value.parse::<async_nats::HeaderValue>().is_err() {
            Some(format!(
                "the `{name}` header cannot carry this value (a NATS header value holds no \
                 line break)"
            ))
        } else if value.trim() != value {
            Some(format!(
                "the `{name}` header cannot carry `{value}` (leading or trailing whitespace: \
                 NATS clients trim header values, so a consumer would read `{}`)",
                value.trim()
            ))
        } else {
            None
        }
    })
}

/// The `Nats-Msg-Id` of a delivery: `<table>:<event id>`. JetStream drops a message
/// whose id it saw within the duplicate window on any subject of the stream, and an
/// event id is unique only within its table: two event types whose ids come from the
/// business (`#[outbox(event_id)] order_id`) published into one stream would have the
/// second one dropped, acknowledged as a duplicate, and recorded `SENT`. Nor does it
/// name the deployment: two (schemas, databases) publishing one table's business ids
/// into one stream drop each other's events alike (the README says so).
fn message_id<T: Outbox>(delivery: &Delivery<'_, T>) -> String {
    format!("{}:{}", T::SPEC.table, delivery.event_id())
}

/// Why a publish found no responders (NATS's 503): no stream takes its subject, or the
/// stream that takes it did not answer. A server shutting down stops JetStream before it
/// closes the clients' connections, so the second happens to a connected client. Or the
/// stream list could not say.
#[derive(Clone, Debug)]
enum Responders {
    NoStream,
    NotAnswering(String),
    LookupFailed(String),
}

/// What the stream list's answer (`looked_up`) says of a subject that found no
/// responders; `connected`: whether the client was connected once it answered.
fn responders_from(looked_up: Result<String, GetStreamByNameError>, connected: bool) -> Responders {
    match looked_up {
        Ok(stream) => Responders::NotAnswering(format!(
            "stream `{stream}` takes it, and did not answer (JetStream stopping or \
             starting, a leader being elected)"
        )),
        Err(error)
            if matches!(
                error.kind(),
                GetStreamByNameErrorKind::NotFound | GetStreamByNameErrorKind::InvalidSubject
            ) =>
        {
            Responders::NoStream
        }
        // JetStream's API is down as well, or the connection is: an outage.
        Err(error) if !connected || request_found_no_responders(&error) => {
            Responders::NotAnswering(format!(
                "JetStream did not say which stream takes it either ({error})"
            ))
        }
        // Anything else is not known to pass (a publisher not allowed to ask
        // `$JS.API.STREAM.NAMES` gets a permissions violation and no answer, so its
        // request times out): counted, so that an event failing this way for good ends
        // `DEAD` rather than holding its worker back forever.
        Err(error) => Responders::LookupFailed(error.to_string()),
    }
}

/// Whether the stream list request behind `error` found no responders: the JetStream
/// API did not answer at all.
fn request_found_no_responders(error: &GetStreamByNameError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        if error
            .downcast_ref::<async_nats::RequestError>()
            .is_some_and(|error| error.kind() == RequestErrorKind::NoResponders)
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// A publish to `subject` that found no responders: `DEAD` if no stream takes the
/// subject, the destination unavailable if its stream did not answer, transient if the
/// stream list could not be asked.
fn no_responders(subject: &str, responders: Responders) -> SinkError {
    match responders {
        Responders::NoStream => SinkError::permanent(format!(
            "publishing to `{subject}`: no JetStream stream takes this subject"
        )),
        Responders::NotAnswering(why) => {
            SinkError::unavailable(format!("publishing to `{subject}`: no responders: {why}"))
        }
        Responders::LookupFailed(why) => SinkError::transient(format!(
            "publishing to `{subject}`: no responders, and looking up which stream takes \
             the subject (`$JS.API.STREAM.NAMES`) failed: {why}"
        )),
    }
}

/// What a failed publish means for its event; `connected`: whether the client was
/// connected once the acknowledgements were in. (No responders is [`no_responders`].)
fn classify(failure: &Failure, connected: bool) -> SinkError {
    let Failure {
        subject,
        error,
        unsent,
    } = failure;
    let what = format!("publishing to `{subject}`: {error}");
    match error.kind() {
        // Asked of the stream list first (`responders`); without its word, taken as meant.
        PublishErrorKind::StreamNotFound => no_responders(subject, Responders::NoStream),
        PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence => SinkError::permanent(what),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe if !connected => {
            SinkError::unavailable(what)
        }
        // Before the client took it: an invalid subject is the event's (it never
        // publishes); anything else is the client's.
        PublishErrorKind::Other if *unsent && invalid_subject(error) => SinkError::permanent(what),
        PublishErrorKind::Other if *unsent && !connected => SinkError::unavailable(what),
        PublishErrorKind::Other
            if api_error(error) == Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) =>
        {
            SinkError::permanent(what)
        }
        _ => SinkError::transient(what),
    }
}

/// Whether `error` is the client refusing the subject (empty, or not a valid subject).
fn invalid_subject(error: &PublishError) -> bool {
    std::error::Error::source(error)
        .is_some_and(<dyn std::error::Error>::is::<async_nats::subject::SubjectError>)
}

/// The JetStream API error code behind `error`, if the server answered with one.
fn api_error(error: &PublishError) -> Option<ErrorCode> {
    std::error::Error::source(error)?
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(async_nats::jetstream::Error::error_code)
}

impl<T: Outbox + Send + Sync, E: Encoding<T>> Sink<T> for JetStreamSink<T, E> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        broker::acknowledged(self.publish_acked(batch).await)
    }

    /// `nats`, the subject.
    fn destination(&self, event: &T) -> Option<Destination> {
        Some(Destination::new(SYSTEM, self.outgoing.destination(event)))
    }
}

/// The event id a message carries (the [`header::EVENT_ID`] header), for a consumer's
/// [`Inbox`](crate::inbox::Inbox).
pub fn event_id(message: &async_nats::Message) -> Option<&str> {
    header_value(message, header::EVENT_ID)
}

/// The trace context a message carries (its [`header::TRACEPARENT`],
/// [`header::TRACESTATE`] and [`header::BAGGAGE`] headers), for the consumer's span
/// (`Consumed::consumer_span`); `None` without one, or with a malformed one.
pub fn trace(message: &async_nats::Message) -> Option<TraceContext> {
    TraceContext::parse(
        header_value(message, header::TRACEPARENT)?,
        header_value(message, header::TRACESTATE),
    )
    .map(|trace| trace.with_baggage(header_value(message, header::BAGGAGE)))
}

impl crate::inbox::Consumed for async_nats::Message {
    fn event_id(&self) -> Option<&str> {
        event_id(self)
    }

    fn system(&self) -> &'static str {
        SYSTEM
    }

    fn destination(&self) -> &str {
        self.subject.as_str()
    }

    fn trace(&self) -> Option<TraceContext> {
        trace(self)
    }
}

fn header_value<'m>(message: &'m async_nats::Message, name: &str) -> Option<&'m str> {
    message
        .headers
        .as_ref()?
        .get(name)
        .map(async_nats::HeaderValue::as_str)
}

#[cfg(test)]
mod tests {
    use async_nats::RequestError;

    use super::*;

    /// What `stream_by_subject` returns when its request fails with `kind`: the
    /// request's error, wrapped by the stream list, wrapped again.
    fn lookup_failed(kind: RequestErrorKind) -> Result<String, GetStreamByNameError> {
        Err(GetStreamByNameError::with_source(
            GetStreamByNameErrorKind::Request,
            RequestError::with_source(RequestErrorKind::Other, RequestError::new(kind)),
        ))
    }

    fn after(looked_up: Result<String, GetStreamByNameError>, connected: bool) -> SinkError {
        no_responders("orders.placed", responders_from(looked_up, connected))
    }

    /// The NATS binding's example, and the binding's names.
    #[test]
    fn cloud_event_headers_are_ce_prefixed_and_percent_encoded() {
        let message = broker::Message {
            destination: "orders".to_owned(),
            body: Vec::new(),
            headers: Vec::new(),
            content_type: Some("application/json"),
            cloud_event: vec![
                ("id", "A234-1234-1234".to_owned()),
                ("subject", "Euro \u{20AC} \u{1F600}".to_owned()),
                ("source", "/a \"quoted\" 100%".to_owned()),
            ],
        };
        assert_eq!(
            cloud_event_headers(&message),
            [
                ("ce-id".to_owned(), "A234-1234-1234".to_owned()),
                (
                    "ce-subject".to_owned(),
                    "Euro%20%E2%82%AC%20%F0%9F%98%80".to_owned()
                ),
                (
                    "ce-source".to_owned(),
                    "/a%20%22quoted%22%20100%25".to_owned()
                ),
                (
                    "ce-datacontenttype".to_owned(),
                    "application/json".to_owned()
                ),
            ]
        );
        let plain = broker::Message {
            cloud_event: Vec::new(),
            ..message
        };
        assert!(cloud_event_headers(&plain).is_empty(), "not a CloudEvent");
    }

    #[test]
    fn a_stream_that_takes_the_subject_and_did_not_answer_is_an_outage() {
        let error = after(Ok("ORDERS".to_owned()), true);
        assert!(error.is_unavailable(), "{error}");
        assert!(
            error.to_string().contains("stream `ORDERS` takes it"),
            "{error}"
        );
    }

    #[test]
    fn no_stream_for_the_subject_is_permanent() {
        let error = after(
            Err(GetStreamByNameError::new(
                GetStreamByNameErrorKind::NotFound,
            )),
            true,
        );
        assert!(matches!(error, SinkError::Permanent(_)), "{error}");
    }

    #[test]
    fn a_stream_list_that_finds_no_responders_or_a_lost_connection_is_an_outage() {
        for (kind, connected) in [
            (RequestErrorKind::NoResponders, true),
            (RequestErrorKind::NoResponders, false),
            (RequestErrorKind::TimedOut, false),
            (RequestErrorKind::Other, false),
        ] {
            let error = after(lookup_failed(kind), connected);
            assert!(
                error.is_unavailable(),
                "{kind:?}, connected {connected}: {error}"
            );
        }
    }

    #[test]
    fn any_other_failure_of_the_stream_list_is_transient_and_says_so() {
        // A publisher not allowed `$JS.API.STREAM.NAMES`: a permissions violation, no
        // answer, the request times out. Or JetStream answers with an error.
        let jetstream_error: async_nats::jetstream::Error =
            serde_json::from_value(serde_json::json!({
                "code": 503,
                "err_code": 10039,
                "description": "jetstream not enabled for account",
            }))
            .unwrap();
        let answered = Err(GetStreamByNameError::with_source(
            GetStreamByNameErrorKind::Request,
            RequestError::with_source(
                RequestErrorKind::Other,
                RequestError::with_source(RequestErrorKind::Other, jetstream_error),
            ),
        ));
        for (looked_up, why) in [
            (
                lookup_failed(RequestErrorKind::TimedOut),
                "request timed out",
            ),
            (answered, "jetstream not enabled for account"),
        ] {
            let error = after(looked_up, true);
            assert!(matches!(error, SinkError::Transient(_)), "{error}");
            let error = error.to_string();
            assert!(
                error.contains(
                    "no responders, and looking up which stream takes the subject \
                     (`$JS.API.STREAM.NAMES`) failed"
                ),
                "{error}"
            );
            assert!(error.contains(why), "{error}");
        }
    }

    #[test]
    fn a_key_with_leading_or_trailing_whitespace_is_refused_naming_it() {
        for key in ["ord-1 ", " ord-1", "ord-1\t"] {
            let headers = [
                (header::EVENT_ID, "e-1".to_owned()),
                (header::KEY, key.to_owned()),
            ];
            let why = unfaithful_header(&headers).expect("refused");
            assert!(
                why.contains(&format!("the `Outbox-Key` header cannot carry `{key}`")),
                "{why}"
            );
            assert!(why.contains("a consumer would read `ord-1`"), "{why}");
        }
        let faithful = [
            (header::EVENT_ID, "e 1".to_owned()),
            (header::KEY, "ord 1".to_owned()),
        ];
        assert_eq!(unfaithful_header(&faithful), None);
    }
}
