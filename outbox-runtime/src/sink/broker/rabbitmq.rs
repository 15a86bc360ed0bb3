//! Publishing to RabbitMQ (cargo feature `rabbitmq`): [`RabbitSink`].
//!
//! The sink takes the application's own lapin [`Connection`] (with its TLS, credentials
//! and recovery settings), opens channels on it in confirm mode (`confirm.select`), one
//! for each batch in flight, and publishes each event to an exchange with a routing key of its choosing:
//! `mandatory` (a message no queue takes comes back, and is an error, not a silent
//! drop), persistent (delivery mode 2), and `message_id` = the event id. RabbitMQ has
//! no deduplication: a redelivered event is a second copy in the queue, which a
//! consumer recognises by its event id with an [`Inbox`](crate::inbox::Inbox).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use derive_where::derive_where;
use futures_util::future::join_all;
pub use lapin;
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ErrorKind, PublisherConfirm};

use crate::sink::broker::{self, Failed, Outgoing};
use crate::sink::message::{CloudEvents, Encoding, Json, header};
use crate::sink::{Delivery, Destination, Sink, SinkError};
use crate::spec::Outbox;
use crate::trace::TraceContext;

/// The broker, as OpenTelemetry's messaging conventions name it (`messaging.system`).
const SYSTEM: &str = "rabbitmq";

/// AMQP delivery mode 2: the broker writes the message to disk (in a durable queue).
const PERSISTENT: u8 = 2;

/// A [`Sink`] that publishes events to a RabbitMQ exchange.
///
/// Each event becomes one message: the body from the [`Encoding`] (JSON by default, its
/// media type as the `content_type` property), the headers of
/// [`message::header`](crate::message::header) (event id, table, generation, attempt,
/// enqueue time), `message_id` = the event id, delivery mode 2 (persistent), published
/// `mandatory`. A batch is pipelined: every message is published, then every publisher
/// confirm awaited.
///
/// | RabbitMQ's answer | the result |
/// |---|---|
/// | a confirm (`basic.ack`) | `Ok` (`SENT`) |
/// | the connection is closed (before the batch, or while confirms are awaited, or by the broker: `CONNECTION_FORCED`) | [`SinkError::Unavailable`]: handed back, no attempt counted |
/// | the broker blocks publishers (`connection.blocked`: a memory or disk alarm), before the batch or while it is sent | [`SinkError::Unavailable`] |
/// | a negative confirm (`basic.nack`); no confirm in time ([`RabbitSink::confirm_timeout`], 5 s by default), the connection open | [`SinkError::Transient`] |
/// | the event does not encode; the message is returned (no queue is bound for its routing key; matched by its `message_id`); the exchange does not exist or refuses publishers (`ACCESS_REFUSED`; a topic permission refuses the message whose routing key it names, its batch-mates are transient); the message is over the broker's `max_message_size`; a routing key or event id over 255 bytes | [`SinkError::Permanent`] (`DEAD`) |
/// | the broker closes the channel for any other reason, the connection open | [`SinkError::Transient`] |
///
/// To survive a broker restart, open the connection with lapin's automatic recovery
/// ([`ConnectionProperties::enable_auto_recover`](lapin::ConnectionProperties::enable_auto_recover)):
/// while it reconnects the batches are unavailable, and once it has reopened the channels
/// (in confirm mode again) the sink publishes on them. Without recovery, or once lapin
/// gave up (after 16 attempts unless its backoff has no limit), a connection that closed
/// stays closed, and so unavailable. In AMQP a publish to an exchange that does
/// not exist closes the channel, not the connection: the event is `DEAD` (declare the
/// exchange before the relay starts), and the next batch opens a new channel.
///
/// ```no_run
/// use std::sync::Arc;
///
/// use outbox_runtime::rabbitmq::{RabbitSink, lapin};
/// use outbox_runtime::relay::{CancellationToken, Relay};
///
/// // `OrderPlaced`: your event, `#[derive(outbox::Outbox, serde::Serialize)]`.
/// # async fn run<OrderPlaced: outbox_runtime::Outbox + serde::Serialize + Send + Sync>(
/// #     pool: sqlx::PgPool,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let connection = Arc::new(
///     lapin::Connection::connect(
///         "amqp://guest:guest@127.0.0.1:5672/%2f", // your TLS, auth
///         lapin::ConnectionProperties::default()
///             .enable_auto_recover() // reconnects,
///             .configure_backoff(|b| b.without_max_times()), // however long it takes
///     )
///     .await?,
/// );
/// let channel = connection.create_channel().await?;
/// // The exchange, and a queue bound to the routing key (here, or by your deployment).
/// channel
///     .exchange_declare(
///         "orders".into(),
///         lapin::ExchangeKind::Direct,
///         lapin::options::ExchangeDeclareOptions { durable: true, ..Default::default() },
///         lapin::types::FieldTable::default(),
///     )
///     .await?;
/// let sink = RabbitSink::<OrderPlaced>::new(connection, "orders", "orders.placed").await?;
/// Relay::new(pool, sink).run(CancellationToken::new()).await?;
/// # Ok(()) }
/// ```
#[derive_where(Clone, Debug; E)]
pub struct RabbitSink<T, E = Json> {
    #[derive_where(skip(Debug))]
    connection: Arc<Connection>,
    /// The sink's channels, in confirm mode.
    #[derive_where(skip(Debug))]
    channels: Arc<Mutex<Channels>>,
    exchange: ShortString,
    /// Routing keys and bodies.
    outgoing: Outgoing<T, E>,
    confirm_timeout: Duration,
}

impl<T> RabbitSink<T, Json> {
    /// A sink publishing every event as JSON to `exchange` with `routing_key`, on
    /// channels of its own that it opens on `connection` in confirm mode
    /// (`confirm.select`): the first now, more as batches go out side by side, and a new
    /// one for each the broker closes. Fails if the first channel cannot be opened, or
    /// if `exchange` is over 255 bytes.
    pub async fn new(
        connection: Arc<Connection>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Result<Self, lapin::Error> {
        let exchange = ShortString::try_new(exchange)
            .map_err(|error| lapin::Error::from(std::io::Error::other(error)))?;
        let channel = confirming_channel(&connection).await?;
        Ok(Self {
            connection,
            channels: Arc::new(Mutex::new(Channels {
                idle: vec![channel.clone()],
                latest: channel,
            })),
            exchange,
            outgoing: Outgoing::new(routing_key.into()),
            confirm_timeout: Duration::from_secs(5),
        })
    }
}

impl<T, E> RabbitSink<T, E> {
    /// Derives each event's routing key from the event (a region, a tenant, an
    /// aggregate): `.routing_key_from(|order: &OrderPlaced| format!("orders.{}", order.region))`.
    #[must_use]
    pub fn routing_key_from(
        self,
        routing_key: impl Fn(&T) -> String + Send + Sync + 'static,
    ) -> Self {
        Self {
            outgoing: self.outgoing.destination_from(routing_key),
            ..self
        }
    }

    /// How long a publisher confirm may take before the delivery fails (transient).
    /// Five seconds by default.
    #[must_use]
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Encodes the events with `encoding` instead of JSON.
    pub fn encoding<E2: Encoding<T>>(self, encoding: E2) -> RabbitSink<T, E2> {
        RabbitSink {
            connection: self.connection,
            channels: self.channels,
            exchange: self.exchange,
            outgoing: self.outgoing.encoding(encoding),
            confirm_timeout: self.confirm_timeout,
        }
    }

    /// Publishes each event as a CloudEvent ([`CloudEvents`]): in binary mode, its
    /// attributes in the headers table as `cloudEvents_id`, `cloudEvents_source`, ...
    /// (AMQP 0-9-1 has no CloudEvents binding of its own: these are the AMQP 1.0
    /// binding's names), its content type in the `content_type` property, beside the
    /// outbox's own headers.
    #[must_use]
    pub fn cloud_events(self, cloud_events: CloudEvents) -> Self {
        Self {
            outgoing: self.outgoing.cloud_events(cloud_events),
            ..self
        }
    }

    /// The live status of the channel the sink opened last (each batch is published on
    /// a channel of its own, taken from those the sink keeps). Only its status: a
    /// declaration on a channel a batch publishes on, refused by the broker, would
    /// close it under the batch's pending confirms.
    pub fn channel_status(&self) -> lapin::ChannelStatus {
        self.channels().latest.status().clone()
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, Channels> {
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A channel for one batch, which no other batch uses until it is given back: one
    /// of the sink's, or a new one. A channel the broker closed (a channel error, such as
    /// a publish to a missing exchange, closes the channel and leaves the connection
    /// open) is let go. `None` while the connection is not open (lapin's recovery, if
    /// enabled, reopens the channels itself).
    async fn take_channel(&self) -> Option<Channel> {
        if !self.connection.status().connected() {
            return None;
        }
        let mut closed = false;
        loop {
            let Some(channel) = self.channels().idle.pop() else {
                break;
            };
            if channel.status().connected() {
                return Some(channel);
            }
            closed = true;
        }
        match confirming_channel(&self.connection).await {
            Ok(fresh) => {
                if closed {
                    tracing::info!(exchange = %self.exchange, "a RabbitMQ channel was closed; publishing on a new one");
                }
                self.channels().latest = fresh.clone();
                Some(fresh)
            }
            Err(error) => {
                tracing::warn!(exchange = %self.exchange, %error, "cannot open a RabbitMQ channel");
                None
            }
        }
    }

    /// Gives back the channel of a batch, unless the broker closed it.
    fn give_back(&self, channel: Channel) {
        let closed = self.connection.status().connected() && !channel.status().connected();
        if !closed {
            self.channels().idle.push(channel);
        }
    }
}

/// The channels of a sink.
///
/// A batch has a channel to itself: the broker confirms a run of a channel's messages
/// at once (`multiple`), and lapin hands each returned (unroutable) message to whichever
/// confirm of that run it settles first, so on a shared channel one batch could take
/// another's returned message for its own, and a message no queue took be recorded
/// `SENT`. Within its batch, each returned message is matched by its `message_id`.
struct Channels {
    /// Those no batch is publishing on.
    idle: Vec<Channel>,
    /// The one opened last.
    latest: Channel,
}

/// A channel on `connection`, in confirm mode.
async fn confirming_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

impl<T: Outbox, E: Encoding<T>> RabbitSink<T, E> {
    /// Publishes `batch` and returns RabbitMQ's publisher confirm of each delivery, in
    /// order, or the error the [`Sink`] implementation reports. For sinks that wrap this
    /// one and need the confirms.
    pub async fn publish_confirmed(
        &self,
        batch: &[Delivery<'_, T>],
    ) -> Vec<Result<Confirmation, SinkError>> {
        let unavailable = |why: &str| broker::unavailable(batch, why);
        if self.connection.status().blocked() {
            // The broker takes nothing while an alarm lasts: waiting out the relay's
            // send timeout would count an attempt per batch until events went `DEAD`.
            return unavailable("RabbitMQ blocked publishers (a memory or disk alarm)");
        }
        let Some(channel) = self.take_channel().await else {
            let status = self.connection.status();
            return unavailable(if status.closed() || status.errored() {
                "the RabbitMQ connection is closed for good (no automatic recovery, or \
                 lapin's gave up): restart the relay, or let lapin's backoff try forever \
                 (`configure_backoff(|b| b.without_max_times())`)"
            } else {
                "the RabbitMQ connection is not open"
            });
        };
        let (confirmed, timed_out) = self.publish_on(&channel, batch).await;
        if timed_out {
            // A confirm still owed on this channel could settle with a later batch's
            // confirms and take its returned message (lapin attaches a return to the
            // first confirm it settles): the channel goes, not back to the pool.
            tokio::spawn(async move {
                let _ = channel
                    .close(200, ShortString::from("a publisher confirm timed out"))
                    .await;
            });
        } else {
            self.give_back(channel);
        }
        confirmed
    }

    /// Publishes `batch` on `channel`: each delivery's result, and whether a confirm (or
    /// a send) timed out.
    async fn publish_on(
        &self,
        channel: &Channel,
        batch: &[Delivery<'_, T>],
    ) -> (Vec<Result<Confirmation, SinkError>>, bool) {
        // Every message goes out before any confirm is awaited: the batch costs about
        // one round trip, not one per event. A send waits while the broker blocks
        // publishers (lapin writes nothing then): after the confirm timeout, the rest
        // of the batch is not sent.
        let confirm_timeout = self.confirm_timeout;
        let mut sent = Vec::with_capacity(batch.len());
        let mut stalled = false;
        for delivery in batch {
            let sending = async {
                if stalled {
                    return None;
                }
                tokio::time::timeout(confirm_timeout, self.send(channel, delivery))
                    .await
                    .ok()
            };
            let result = sending.await;
            stalled = result.is_none();
            sent.push(result.ok_or_else(|| self.outgoing.destination(delivery.event())));
        }
        let confirmed = join_all(sent.into_iter().map(|sent| async move {
            let (message, confirm) = match sent {
                Ok(Ok(sent)) => sent,
                Ok(Err(Failed::Answer(answer))) => return Settled::Answered(answer),
                Ok(Err(Failed::Client((message, error)))) => {
                    return Settled::Failed(message, error);
                }
                Err(routing_key) => {
                    return Settled::TimedOut(Sent {
                        routing_key,
                        size: 0,
                    });
                }
            };
            match tokio::time::timeout(confirm_timeout, confirm).await {
                Ok(Ok(confirmation)) => Settled::Confirmed(message, Box::new(confirmation)),
                Ok(Err(error)) => Settled::Failed(message, error),
                Err(_) => Settled::TimedOut(message),
            }
        }))
        .await;
        // The connection, not the channel: a channel the broker closed over one message
        // says nothing about whether the broker is there.
        let status = self.connection.status();
        let (connected, blocked) = (status.connected(), status.blocked());
        let timed_out = confirmed.iter().any(|c| matches!(c, Settled::TimedOut(_)));
        let mut returned = returned_messages(&confirmed);
        let results = batch
            .iter()
            .zip(confirmed)
            .map(|(delivery, confirmed)| match confirmed {
                Settled::Answered(answer) => Err(answer),
                Settled::Confirmed(message, confirmation) => {
                    let own = returned.remove(delivery.event_id().as_str());
                    self.answer(&message.routing_key, &confirmation, own)
                }
                Settled::TimedOut(message) => {
                    let what = format!(
                        "publishing with routing key `{}`: no publisher confirm in {confirm_timeout:?}{}",
                        message.routing_key,
                        if blocked {
                            " (RabbitMQ blocked publishers: a memory or disk alarm)"
                        } else {
                            ""
                        }
                    );
                    Err(if connected && !blocked {
                        SinkError::transient(what)
                    } else {
                        SinkError::unavailable(what)
                    })
                }
                Settled::Failed(message, error) => {
                    Err(self.classify(&message, &error, connected))
                }
            })
            .collect();
        (results, timed_out)
    }

    /// Hands one delivery's message to the channel; returns what it sent and the
    /// future of its confirm.
    async fn send(
        &self,
        channel: &Channel,
        delivery: &Delivery<'_, T>,
    ) -> Result<(Sent, PublisherConfirm), Failed<(Sent, lapin::Error)>> {
        let message = self.outgoing.message(delivery)?;
        let cloud_event: Vec<(String, String)> = message
            .cloud_event_headers("cloudEvents_")
            .map(|(name, value)| (name, value.to_owned()))
            .collect();
        let broker::Message {
            destination: routing_key,
            body,
            headers: outbox_headers,
            content_type,
            ..
        } = message;
        let too_long = |what: &str, error| {
            Failed::Answer(SinkError::permanent(format!(
                "the {what} is not an AMQP short string: {error}"
            )))
        };
        let key = ShortString::try_new(routing_key.as_str())
            .map_err(|error| too_long("routing key", error))?;
        let event_id = delivery.event_id().as_str();
        let message_id =
            ShortString::try_new(event_id).map_err(|error| too_long("event id", error))?;
        let mut headers = FieldTable::default();
        for (name, value) in outbox_headers {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        }
        for (name, value) in cloud_event {
            let name =
                ShortString::try_new(name).map_err(|error| too_long("header name", error))?;
            headers.insert(name, AMQPValue::LongString(LongString::from(value)));
        }
        let mut properties = BasicProperties::default()
            .with_message_id(message_id)
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers);
        if let Some(content_type) = content_type {
            let content_type = ShortString::try_new(content_type)
                .map_err(|error| too_long("content type", error))?;
            properties = properties.with_content_type(content_type);
        }
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let sent = Sent {
            routing_key,
            size: body.len(),
        };
        match channel
            .basic_publish(self.exchange.clone(), key, options, &body, properties)
            .await
        {
            Ok(confirm) => Ok((sent, confirm)),
            Err(error) => Err(Failed::Client((sent, error))),
        }
    }

    /// What the broker's confirm means for its event, `returned` the message the
    /// broker returned for it, if any (whichever confirm lapin attached it to).
    fn answer(
        &self,
        routing_key: &str,
        confirmation: &Confirmation,
        returned: Option<(u16, String)>,
    ) -> Result<Confirmation, SinkError> {
        let exchange = &self.exchange;
        if let Some((reply_code, reply_text)) = returned {
            return Err(SinkError::permanent(format!(
                "publishing to exchange `{exchange}` with routing key `{routing_key}`: \
                 returned unroutable ({reply_code} {reply_text}): no queue is bound for it"
            )));
        }
        match confirmation {
            Confirmation::Nack(_) => Err(SinkError::transient(format!(
                "publishing to exchange `{exchange}` with routing key `{routing_key}`: \
                 the broker refused the message (basic.nack)"
            ))),
            Confirmation::NotRequested => Err(SinkError::transient(format!(
                "publishing to exchange `{exchange}`: the channel is not in confirm mode \
                 (was it recovered without confirm.select?)"
            ))),
            // Another message's return, which is not this one's fate.
            Confirmation::Ack(_) => Ok(Confirmation::Ack(None)),
        }
    }

    /// What a failed publish means for its event; `connected`: whether the connection
    /// was open once the confirms were in.
    ///
    /// With the connection open, a protocol error is a channel error: the broker closed
    /// the channel over a message of the batch, and every confirm still awaited fails
    /// with it. A missing exchange, or one that refuses publishers (internal, or the
    /// user may not write to it), refuses every message: permanent. A message over the
    /// broker's size limit is permanent for itself and transient for its batch-mates.
    /// Anything else the broker closes a channel for is transient: retried, counted,
    /// and `DEAD` with the broker's reason once the budget is spent, never handed back
    /// uncounted forever.
    fn classify(&self, sent: &Sent, error: &lapin::Error, connected: bool) -> SinkError {
        use lapin::protocol::AMQPSoftError;
        let exchange = &self.exchange;
        let what = format!(
            "publishing to exchange `{exchange}` with routing key `{}`: {error}",
            sent.routing_key
        );
        match error.kind() {
            ErrorKind::SerialisationError(_) => SinkError::permanent(what),
            _ if !connected => SinkError::unavailable(what),
            // The broker closed the connection (shutting down, an operator's doing):
            // lapin's recovery, once it reconnected, fails the confirms it left pending.
            ErrorKind::ProtocolError(amqp) if amqp.get_id() == CONNECTION_FORCED => {
                SinkError::unavailable(what)
            }
            ErrorKind::ProtocolError(amqp) if amqp.get_id() == AMQPSoftError::NOTFOUND.get_id() => {
                SinkError::permanent(format!(
                    "publishing to exchange `{exchange}`: no such exchange ({error})"
                ))
            }
            ErrorKind::ProtocolError(amqp)
                if amqp.get_id() == AMQPSoftError::ACCESSREFUSED.get_id() =>
            {
                // A topic permission refuses one routing key, and the channel's close
                // fails every confirm still pending on it: only the message whose key it
                // names is refused for good.
                match refused_topic(amqp.get_message().as_str()) {
                    Some(topic) if topic != sent.routing_key => SinkError::transient(what),
                    _ => SinkError::permanent(what),
                }
            }
            ErrorKind::ProtocolError(amqp)
                if amqp.get_id() == AMQPSoftError::PRECONDITIONFAILED.get_id()
                    && max_message_size(amqp.get_message().as_str())
                        .is_some_and(|max| sent.size > max) =>
            {
                SinkError::permanent(format!(
                    "{what} (this message's body is {} bytes)",
                    sent.size
                ))
            }
            ErrorKind::InvalidChannelState(..)
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannel(_)
            | ErrorKind::IOError(_)
            | ErrorKind::MissingHeartbeatError => SinkError::unavailable(what),
            _ => SinkError::transient(what),
        }
    }
}

/// AMQP's `CONNECTION_FORCED`: the broker closed the connection.
const CONNECTION_FORCED: u16 = 320;

/// What became of one message of a batch.
enum Settled {
    /// The sink's own answer, before the message was sent (it does not encode...).
    Answered(SinkError),
    /// The broker's confirm (boxed: a returned message rides in it).
    Confirmed(Sent, Box<Confirmation>),
    /// No confirm in time.
    TimedOut(Sent),
    /// The client's error, to classify.
    Failed(Sent, lapin::Error),
}

/// The messages the broker returned to a batch, by `message_id` (the event id), with
/// the broker's reply: whichever confirm of the batch lapin attached each to.
fn returned_messages(confirmed: &[Settled]) -> HashMap<String, (u16, String)> {
    confirmed
        .iter()
        .filter_map(|confirmed| match confirmed {
            Settled::Confirmed(_, confirmation) => match confirmation.as_ref() {
                Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                    Some(returned)
                }
                _ => None,
            },
            _ => None,
        })
        .filter_map(|returned: &BasicReturnMessage| {
            let id = returned.delivery.properties.message_id().as_ref()?;
            Some((
                id.as_str().to_owned(),
                (returned.reply_code, returned.reply_text.as_str().to_owned()),
            ))
        })
        .collect()
}

/// The routing key a topic permission refused, from the broker's reason:
/// `ACCESS_REFUSED - access to topic 'k' in exchange 'x' in vhost '/' refused for user 'u'`.
fn refused_topic(reason: &str) -> Option<&str> {
    let (_, after) = reason.split_once("access to topic '")?;
    // The key may hold a quote itself: it ends where the exchange's part begins.
    Some(after.rsplit_once("' in exchange '")?.0)
}

/// The destination's name of `exchange` (`amq.default` for the default one), as
/// OpenTelemetry's messaging conventions name a RabbitMQ destination.
fn destination_name(exchange: &str) -> &str {
    match exchange {
        "" => "amq.default",
        exchange => exchange,
    }
}

/// A message handed to the channel, as its errors name it.
struct Sent {
    routing_key: String,
    /// The body's length, to tell which message of a batch was over the size limit.
    size: usize,
}

/// The largest message the broker takes, from its refusal of a larger one: RabbitMQ
/// closes the channel with `PRECONDITION_FAILED - message size N is larger than
/// configured max size M`.
fn max_message_size(reason: &str) -> Option<usize> {
    let (_, after) = reason.split_once("max size ")?;
    let digits = after.split(|c: char| !c.is_ascii_digit()).next()?;
    digits.parse().ok()
}

impl<T: Outbox + Send + Sync, E: Encoding<T>> Sink<T> for RabbitSink<T, E> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        broker::acknowledged(self.publish_confirmed(batch).await)
    }

    /// `rabbitmq`, the exchange, with the routing key.
    fn destination(&self, event: &T) -> Option<Destination> {
        Some(
            Destination::new(SYSTEM, destination_name(self.exchange.as_str())).with_attribute(
                "messaging.rabbitmq.destination.routing_key",
                self.outgoing.destination(event),
            ),
        )
    }
}

/// The event id a message carries (the [`header::EVENT_ID`] header, else its
/// `message_id`), for a consumer's [`Inbox`](crate::inbox::Inbox).
pub fn event_id(delivery: &lapin::message::Delivery) -> Option<&str> {
    header_value(delivery, header::EVENT_ID).or_else(|| {
        delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    })
}

/// The trace context a message carries (its [`header::TRACEPARENT`],
/// [`header::TRACESTATE`] and [`header::BAGGAGE`] headers), for the consumer's span
/// (`Consumed::consumer_span`); `None` without one, or with a malformed one.
pub fn trace(delivery: &lapin::message::Delivery) -> Option<TraceContext> {
    TraceContext::parse(
        header_value(delivery, header::TRACEPARENT)?,
        header_value(delivery, header::TRACESTATE),
    )
    .map(|trace| trace.with_baggage(header_value(delivery, header::BAGGAGE)))
}

impl crate::inbox::Consumed for lapin::message::Delivery {
    fn event_id(&self) -> Option<&str> {
        event_id(self)
    }

    fn system(&self) -> &'static str {
        SYSTEM
    }

    fn destination(&self) -> &str {
        destination_name(self.exchange.as_str())
    }

    fn trace(&self) -> Option<TraceContext> {
        trace(self)
    }
}

fn header_value<'d>(delivery: &'d lapin::message::Delivery, name: &str) -> Option<&'d str> {
    delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|headers| headers.inner().get(name))
        .and_then(|value| match value {
            AMQPValue::LongString(text) => std::str::from_utf8(text.as_bytes()).ok(),
            AMQPValue::ShortString(text) => Some(text.as_str()),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::{max_message_size, refused_topic};

    #[test]
    fn a_topic_refusal_names_the_routing_key() {
        let reason = "ACCESS_REFUSED - access to topic 'orders.secret' in exchange 'orders' in vhost '/' refused for user 'relay'";
        assert_eq!(refused_topic(reason), Some("orders.secret"));
        let quoted = "ACCESS_REFUSED - access to topic 'o'brien' in exchange 'x' in vhost '/' refused for user 'u'";
        assert_eq!(refused_topic(quoted), Some("o'brien"));
        let exchange =
            "ACCESS_REFUSED - access to exchange 'orders' in vhost '/' refused for user 'relay'";
        assert_eq!(refused_topic(exchange), None);
    }

    #[test]
    fn the_size_limit_is_read_from_the_brokers_refusal() {
        let reason = "PRECONDITION_FAILED - message size 134217729 is larger than configured max size 134217728";
        assert_eq!(max_message_size(reason), Some(134_217_728));
        assert_eq!(
            max_message_size("PRECONDITION_FAILED - inequivalent arg 'durable'"),
            None
        );
    }
}
