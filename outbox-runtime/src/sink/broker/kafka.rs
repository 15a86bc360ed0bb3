//! Publishing to Apache Kafka (cargo feature `kafka`): [`KafkaSink`].
//!
//! The sink takes the application's own librdkafka [`ClientConfig`] (its brokers, TLS,
//! SASL and tuning), makes it an idempotent producer, and publishes each event as one
//! record on a topic of its choosing, keyed by the event's ordering key (or its event
//! id, for a type without one) unless told otherwise.
//!
//! Kafka has no deduplication across producers: the idempotent producer drops the
//! copies its own retries make within one producer session, but an event published
//! again after a relay died (a new claim, a new producer) is a second record, which a
//! consumer recognises by its event id with an [`Inbox`](crate::inbox::Inbox).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use derive_where::derive_where;
use futures_util::future::join_all;
pub use rdkafka;
use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::future_producer::Delivery as Acked;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _, PurgeConfig};

use crate::sink::broker::{self, Failed, Outgoing};
use crate::sink::message::{CloudEvents, Encoding, Json, header};
use crate::sink::{Delivery, Destination, Sink, SinkError};
use crate::spec::Outbox;
use crate::trace::TraceContext;

/// The broker, as OpenTelemetry's messaging conventions name it (`messaging.system`).
const SYSTEM: &str = "kafka";

/// The record key of a delivery.
type KeyOf<T> = Arc<dyn Fn(&Delivery<'_, T>) -> Vec<u8> + Send + Sync>;

/// The producer the sink publishes with.
type Producer = FutureProducer<Health>;

/// The longest the default `message.timeout.ms` is.
const MAX_DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a metadata request may take to show that a broker answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Why [`KafkaSink::new`] refused a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A property contradicts the idempotent producer the sink needs.
    #[error(
        "`{property}={value}` contradicts the idempotent producer the outbox needs: it must be {required}"
    )]
    Contradicts {
        /// The property, as given.
        property: String,
        /// Its value, as given.
        value: String,
        /// What the sink needs of it.
        required: &'static str,
    },
    /// `message.timeout.ms` (or `delivery.timeout.ms`) is not a bounded time shorter than
    /// two thirds of the event type's lease.
    #[error(
        "`{property}={value}` must be a number of milliseconds, at least 1 and shorter than \
         two thirds of the lease of `{table}` ({lease:?}): a batch goes to the sink with two \
         thirds of its lease left, and a record still queued in librdkafka once the lease \
         is over could be published after another relay's copy"
    )]
    MessageTimeout {
        /// The property, as given.
        property: &'static str,
        /// Its value, as given.
        value: String,
        /// The outbox table.
        table: &'static str,
        /// The table's lease.
        lease: Duration,
    },
    /// librdkafka refused the configuration.
    #[error("librdkafka refused the producer's configuration: {0}")]
    Client(#[source] KafkaError),
}

/// A [`Sink`] that publishes events to Apache Kafka, through librdkafka's idempotent
/// producer.
///
/// Each event becomes one record: the value from the [`Encoding`] (JSON by default),
/// the key, and the headers of [`message::header`](crate::message::header) (event id,
/// table, generation, attempt, enqueue time, content type) as UTF-8 bytes. A batch is
/// pipelined: every record is handed to the producer, then every delivery report
/// awaited.
///
/// The key is the event's ordering key ([`Delivery::key`], `#[outbox(key)]`) when it
/// has one, else its event id; [`KafkaSink::key_from`] chooses another. Kafka keeps the
/// records of one key in one partition, in the order they were produced, and the relay
/// publishes an ordering key's events one at a time, in order, each once the previous
/// one is `SENT`: the partition keeps the outbox's order of each key, through a
/// shutdown too ([below](KafkaSink#shutdown)).
///
/// # The producer
///
/// [`KafkaSink::new`] takes your [`ClientConfig`] (`bootstrap.servers`, TLS, SASL,
/// `linger.ms`, `compression.type`, ...) and sets, when you did not:
///
/// - `enable.idempotence=true` and `acks=all`: the broker acknowledges a record once
///   the in-sync replicas have it, and librdkafka's own retries do not duplicate or
///   reorder records. A configuration that says otherwise (`enable.idempotence=false`,
///   `acks=1`, ...) or sets `transactional.id` (the sink does not run transactions) is
///   refused with a [`ConfigError`].
/// - `message.timeout.ms`: half the event type's lease, at most 10 s (so 10 s for the
///   default 30 s lease). It bounds how long librdkafka keeps a record queued
///   or retries it, sent or not (a record timed out in flight may still have been
///   written). It must stay below the lease: the relay renews its leases while a batch
///   is in flight, but if it cannot (it lost its database), the lease ends and another
///   relay publishes the events again; a record librdkafka still held then could land
///   after that relay's copy. A value of 0 (no limit) or one not below two
///   thirds of the lease is refused (a batch goes to the sink with two thirds of its
///   lease left). Pick it below the relay's
///   [`send_timeout`](crate::relay::Relay::send_timeout) too (30 s by default), so
///   that every delivery report arrives before the relay gives up on the batch.
///
/// - `linger.ms=0`: the relay hands the sink a batch and waits for its delivery reports,
///   so waiting for more records before sending only delays the batch; and a key's run
///   goes out a record per acknowledgement (a key's next record once the one before it
///   is acknowledged), so each record of a hot key would wait out the linger. (Measured
///   through tansu: one hot key at 166-177 records/s with librdkafka's default of 5 ms,
///   1,800-3,700 with 0; unordered batches no slower.)
///
/// Records are spread over partitions by librdkafka's partitioner on the key
/// (`consistent`, CRC32 of the key, set unless `config` sets another: librdkafka's own
/// default sends an empty key to a random partition, which would break the order of an
/// empty ordering key); set `partitioner=murmur2` for the partitions Java clients
/// choose.
///
/// A topic the brokers do not have: librdkafka asks them to create it
/// (`allow.auto.create.topics`, true for a producer; the broker's own setting decides),
/// and waits up to `topic.metadata.propagation.max.ms` (30 s by default) for a new topic
/// to show before it fails the records for it. Set `allow.auto.create.topics=false` and
/// a shorter propagation time for a missing topic to be `DEAD` at the first attempt.
///
/// # Results
///
/// | the producer's answer | the result |
/// |---|---|
/// | a delivery report without error | `Ok` (`SENT`) |
/// | no delivery of the batch succeeded, some failed on the way to the brokers (timed out, transport, all brokers down), and no broker answers a metadata request within 1 s | [`SinkError::Unavailable`]: handed back, no attempt counted |
/// | the same failures while a broker answers (or beside a delivery that succeeded); the local queue is full; any other broker error | [`SinkError::Transient`] |
/// | the cluster refuses the producer (authentication, cluster authorization such as `IDEMPOTENT_WRITE`); the producer hit a fatal error, or a broker fenced it (`PRODUCER_FENCED`, `INVALID_PRODUCER_EPOCH`) | [`SinkError::Unavailable`] |
/// | the event does not encode; the record is over `message.max.bytes` (librdkafka's or the broker's); the topic does not exist (above); an invalid topic name; no authorization for the topic | [`SinkError::Permanent`] (`DEAD`) |
/// | purged from librdkafka's queue at shutdown ([below](KafkaSink#shutdown)) | [`SinkError::Unavailable`]: handed back |
/// | purged in flight at shutdown | [`SinkError::InDoubt`]: kept claimed until its lease ends |
///
/// Once librdkafka reports that every broker is down, the sink asks for the cluster's
/// metadata before it hands the producer a batch: while no broker answers, batches are
/// unavailable at once, and no record waits in librdkafka's queue through the outage.
/// A producer that hits a fatal error (possible with the idempotent producer), or that a
/// broker fenced (a newer producer id or epoch took its place there, after a lost
/// connection: librdkafka raises no fatal error for it, and the broker refuses its every
/// record), fails its batch as unavailable and is replaced by a new one, built from the
/// same configuration, before the next batch.
///
/// # Shutdown
///
/// When the relay's shutdown grace runs out while a batch is still in the producer, the
/// sink takes it back ([`Sink::withdraw`]): it purges the producer's queues and its
/// requests in flight, and the batch's delivery reports say what became of each record.
/// No purged record leaves the producer afterwards, so the relay's outcomes hold:
///
/// - a record acknowledged before the purge is `SENT`;
/// - a record still queued never left the producer: handed back, due at once, the
///   attempt not counted;
/// - a record already sent, awaiting its acknowledgement, may still be written: nothing
///   can call back a request on the wire, and another producer's records are not fenced
///   by this one's (the idempotent producer deduplicates and orders only its own). It is
///   kept claimed until its lease ends, then published again: no other relay publishes
///   it, or the events after it under its key, before then. (This one producer
///   renumbers what it sends next, as librdkafka does after any purge in flight; with
///   `enable.gapless.guarantee=true` the purge is a fatal error instead, and the
///   producer is replaced.)
///
/// One limit: a record that librdkafka sent once and queued again to retry (its request
/// failed, on a lost connection say) is reported purged from the queue too (rdkafka does
/// not expose librdkafka's record status), and handed back; its first copy left the
/// producer before the shutdown, on a connection since closed. The producer is shared
/// by the sink's clones: the purge takes back their batches in flight too, which then
/// answer the same way.
///
/// ```no_run
/// use outbox_runtime::kafka::{KafkaSink, rdkafka::ClientConfig};
/// use outbox_runtime::relay::{CancellationToken, Relay};
///
/// // `OrderPlaced`: your event, `#[derive(outbox::Outbox, serde::Serialize)]`.
/// # async fn run<OrderPlaced: outbox_runtime::Outbox + serde::Serialize + Send + Sync>(
/// #     pool: sqlx::PgPool,
/// # ) -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092"); // your TLS, SASL
/// let sink = KafkaSink::<OrderPlaced>::new(&config, "orders")?;
/// Relay::new(pool, sink).run(CancellationToken::new()).await?;
/// # Ok(()) }
/// ```
#[derive_where(Clone, Debug; E)]
pub struct KafkaSink<T, E = Json> {
    #[derive_where(skip(Debug))]
    client: Arc<Client>,
    /// Topics and values.
    outgoing: Outgoing<T, E>,
    #[derive_where(skip(Debug))]
    key: Option<KeyOf<T>>,
}

/// The producer, the configuration to build it again after a fatal error, and what its
/// context learnt of the brokers.
struct Client {
    config: ClientConfig,
    producer: RwLock<Current>,
    brokers: Arc<Brokers>,
}

/// The producer in use, and whether the brokers fenced it.
#[derive(Clone)]
struct Current {
    producer: Producer,
    /// Set once a broker answered one of its records with `PRODUCER_FENCED` or
    /// `INVALID_PRODUCER_EPOCH`: a newer producer id or epoch took its place there, and
    /// it will be refused for good, though librdkafka raises no fatal error for an
    /// idempotent (not transactional) producer. Measured on tansu after connection cuts:
    /// one such producer failed every record for 90 s, 116 attempts each. Replaced
    /// before the next batch, as after a fatal error.
    fenced: Arc<AtomicBool>,
}

impl Current {
    fn new(producer: Producer) -> Self {
        Self {
            producer,
            fenced: Arc::default(),
        }
    }

    /// Why it must be replaced: a fatal error, or fenced by a broker.
    fn unusable(&self) -> Option<(RDKafkaErrorCode, String)> {
        self.producer.client().fatal_error().or_else(|| {
            self.fenced.load(Ordering::Relaxed).then(|| {
                (
                    RDKafkaErrorCode::ProducerFenced,
                    "a broker fenced the producer: a newer producer id or epoch took its place"
                        .to_owned(),
                )
            })
        })
    }
}

impl<T: Outbox> KafkaSink<T, Json> {
    /// A sink publishing every event as JSON to `topic`, with a producer built from
    /// `config` (see [the producer](KafkaSink#the-producer) for what it sets and
    /// refuses).
    pub fn new(config: &ClientConfig, topic: impl Into<String>) -> Result<Self, ConfigError> {
        let config = producer_config(config, T::SPEC.table, T::SPEC.lease)?;
        let brokers = Arc::new(Brokers::default());
        let producer = create(&config, &brokers).map_err(ConfigError::Client)?;
        Ok(Self {
            client: Arc::new(Client {
                config,
                producer: RwLock::new(Current::new(producer)),
                brokers,
            }),
            outgoing: Outgoing::new(topic.into()),
            key: None,
        })
    }
}

impl<T, E> KafkaSink<T, E> {
    /// Derives each event's topic from the event (a region, a tenant):
    /// `.topic_from(|order: &OrderPlaced| format!("orders.{}", order.region))`.
    #[must_use]
    pub fn topic_from(self, topic: impl Fn(&T) -> String + Send + Sync + 'static) -> Self {
        Self {
            outgoing: self.outgoing.destination_from(topic),
            ..self
        }
    }

    /// Derives each record's key from the delivery, instead of its ordering key or
    /// event id. Kafka keeps the records of one key in one partition, so an aggregate id
    /// as the key keeps an aggregate's events together; in the outbox's order only when
    /// it is the ordering key (without one, an event retried after a failure comes after
    /// the events published meanwhile). The event id stays in the [`header::EVENT_ID`]
    /// header.
    ///
    /// ```no_run
    /// # use outbox_runtime::kafka::{KafkaSink, rdkafka::ClientConfig};
    /// # use outbox_runtime::relay::Delivery;
    /// # trait Account { fn account(&self) -> &str; }
    /// // `OrderPlaced`: your event, with an `account()`.
    /// # fn build<OrderPlaced: outbox_runtime::Outbox + serde::Serialize + Account>(
    /// #     config: ClientConfig,
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// // The events of one account in one partition, in order.
    /// let sink = KafkaSink::<OrderPlaced>::new(&config, "orders")?
    ///     .key_from(|delivery: &Delivery<'_, OrderPlaced>| delivery.event().account().to_owned());
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn key_from<K: Into<Vec<u8>>>(
        mut self,
        key: impl Fn(&Delivery<'_, T>) -> K + Send + Sync + 'static,
    ) -> Self {
        self.key = Some(Arc::new(move |delivery: &Delivery<'_, T>| {
            key(delivery).into()
        }));
        self
    }

    /// Encodes the events with `encoding` instead of JSON.
    pub fn encoding<E2: Encoding<T>>(self, encoding: E2) -> KafkaSink<T, E2> {
        KafkaSink {
            client: self.client,
            outgoing: self.outgoing.encoding(encoding),
            key: self.key,
        }
    }

    /// Publishes each event as a CloudEvent ([`CloudEvents`]): in binary mode, its
    /// attributes as `ce_` headers (`ce_id`, `ce_source`, `ce_type`, ...) and its content
    /// type as `content-type`, as the Kafka binding has them, beside the outbox's own.
    #[must_use]
    pub fn cloud_events(self, cloud_events: CloudEvents) -> Self {
        Self {
            outgoing: self.outgoing.cloud_events(cloud_events),
            ..self
        }
    }
}

impl Client {
    /// The producer; a new one when the current one hit a fatal error or was fenced.
    fn producer(&self) -> Current {
        let producer = self
            .producer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some((code, reason)) = producer.unusable() else {
            return producer;
        };
        let mut current = self
            .producer
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if current.unusable().is_none() {
            // Replaced meanwhile.
            return current.clone();
        }
        match create(&self.config, &self.brokers) {
            Ok(fresh) => {
                tracing::warn!(%code, %reason, "the Kafka producer is unusable; replaced by a new one");
                *current = Current::new(fresh);
            }
            Err(error) => {
                tracing::error!(%code, %reason, %error, "the Kafka producer is unusable and cannot be replaced");
            }
        }
        current.clone()
    }
}

/// `config` with what the sink needs of a producer, or why it cannot have it.
fn producer_config(
    config: &ClientConfig,
    table: &'static str,
    lease: Duration,
) -> Result<ClientConfig, ConfigError> {
    let mut config = config.clone();
    let contradicts = |property: &str, value: &str, required| ConfigError::Contradicts {
        property: property.to_owned(),
        value: value.to_owned(),
        required,
    };
    match config.get("enable.idempotence") {
        None => {
            config.set("enable.idempotence", "true");
        }
        Some(value) if value.eq_ignore_ascii_case("true") => {}
        Some(value) => return Err(contradicts("enable.idempotence", value, "`true`")),
    }
    let mut acks = false;
    for property in ["acks", "request.required.acks"] {
        if let Some(value) = config.get(property) {
            if !(value.eq_ignore_ascii_case("all") || value == "-1") {
                return Err(contradicts(property, value, "`all` (or -1)"));
            }
            acks = true;
        }
    }
    if !acks {
        config.set("acks", "all");
    }
    if let Some(value) = config.get("transactional.id") {
        return Err(contradicts(
            "transactional.id",
            value,
            "unset (the sink does not run Kafka transactions)",
        ));
    }
    let mut timeout = false;
    for property in ["message.timeout.ms", "delivery.timeout.ms"] {
        if let Some(value) = config.get(property) {
            match value.trim().parse::<u64>() {
                Ok(ms) if ms > 0 && Duration::from_millis(ms) < lease * 2 / 3 => timeout = true,
                _ => {
                    return Err(ConfigError::MessageTimeout {
                        property,
                        value: value.to_owned(),
                        table,
                        lease,
                    });
                }
            }
        }
    }
    if !timeout {
        let default = (lease / 2).min(MAX_DEFAULT_MESSAGE_TIMEOUT);
        config.set("message.timeout.ms", default.as_millis().to_string());
    }
    // librdkafka's default (`consistent_random`) spreads records with an empty key over
    // random partitions, and an ordering key may be empty; `consistent` hashes every
    // other key the same way and keeps an empty one in one partition.
    if config.get("partitioner").is_none() {
        config.set("partitioner", "consistent");
    }
    // The relay hands over a batch and awaits its reports: lingering for more records
    // only delays it, and a key's run goes a record per acknowledgement.
    if ["linger.ms", "queue.buffering.max.ms"]
        .iter()
        .all(|property| config.get(property).is_none())
    {
        config.set("linger.ms", "0");
    }
    Ok(config)
}

fn create(config: &ClientConfig, brokers: &Arc<Brokers>) -> Result<Producer, KafkaError> {
    config.create_with_context(Health(Arc::clone(brokers)))
}

/// The producer's context: librdkafka's errors to `tracing`, and to [`Brokers`].
struct Health(Arc<Brokers>);

/// Whether librdkafka reported every broker down (or authentication failing) since a
/// broker last answered, and what it said.
#[derive(Default)]
struct Brokers {
    down: AtomicBool,
    said: Mutex<Said>,
}

#[derive(Default)]
struct Said {
    /// The last error reported, to log a repeat once: rdkafka 0.39 hands a producer's
    /// error event to the context twice.
    last: String,
    /// The last error other than "all brokers down": why they are.
    cause: String,
}

impl ClientContext for Health {
    fn error(&self, error: KafkaError, reason: &str) {
        let Self(brokers) = self;
        let code = error.rdkafka_error_code();
        if let Some(
            RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::Authentication
            | RDKafkaErrorCode::SaslAuthenticationFailed,
        ) = code
        {
            brokers.down.store(true, Ordering::Relaxed);
        }
        let text = format!("{error}: {reason}");
        let mut said = brokers.said.lock().unwrap_or_else(PoisonError::into_inner);
        if said.last == text {
            return;
        }
        let all_down = code == Some(RDKafkaErrorCode::AllBrokersDown);
        if !all_down {
            said.cause.clone_from(&text);
        }
        said.last = text;
        drop(said);
        if all_down {
            // Repeated while the brokers are away; the relay logs the outage itself.
            tracing::debug!(%error, reason, "librdkafka");
        } else {
            tracing::warn!(%error, reason, "librdkafka");
        }
    }
}

impl Brokers {
    fn up(&self) {
        self.down.store(false, Ordering::Relaxed);
    }

    /// Why no broker answers, as librdkafka said last.
    fn cause(&self) -> String {
        let said = self.said.lock().unwrap_or_else(PoisonError::into_inner);
        if said.cause.is_empty() {
            said.last.clone()
        } else {
            said.cause.clone()
        }
    }
}

impl Client {
    /// Whether a broker answers `producer`'s metadata request for `topic` within
    /// [`PROBE_TIMEOUT`].
    async fn reachable(&self, producer: &Producer, topic: String) -> bool {
        let producer = producer.clone();
        let answered = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), PROBE_TIMEOUT)
                .is_ok()
        })
        .await
        .unwrap_or(false);
        if answered {
            self.brokers.up();
        }
        answered
    }
}

/// How a failed delivery counts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The record cannot be published, however often it is tried.
    Permanent,
    /// The record did not reach a broker: retried, or the batch is unavailable when no
    /// broker answers.
    Unreached,
    /// The cluster refuses this producer (its credentials, its cluster-wide ACLs), or
    /// the producer is unusable (a fatal error; it is replaced): nothing could be
    /// published, so no attempt is counted.
    Refused,
    /// Anything else: retried.
    Transient,
    /// Purged from librdkafka's queues ([`Sink::withdraw`]): it never left the producer,
    /// and never will.
    Withdrawn,
    /// Purged while in flight ([`Sink::withdraw`]): sent, unanswered, and maybe still on
    /// its way to the broker.
    InDoubt,
    /// A broker fenced the producer ([`Current::fenced`]): nothing it sends will be
    /// taken, so no attempt is counted, and it is replaced.
    Fenced,
}

fn kind(error: &KafkaError) -> Kind {
    use RDKafkaErrorCode as Code;
    match error.rdkafka_error_code() {
        Some(
            Code::MessageSizeTooLarge
            | Code::MessageBatchTooLarge
            | Code::InvalidMessageSize
            | Code::InvalidRecord
            | Code::UnknownTopic
            | Code::UnknownPartition
            | Code::UnknownTopicOrPartition
            | Code::InvalidTopic
            | Code::TopicAuthorizationFailed
            | Code::InvalidArgument
            | Code::BadMessage,
        ) => Kind::Permanent,
        Some(
            Code::MessageTimedOut
            | Code::OperationTimedOut
            | Code::RequestTimedOut
            | Code::AllBrokersDown
            | Code::BrokerTransportFailure
            | Code::Resolve
            | Code::NetworkException
            | Code::BrokerNotAvailable,
        ) => Kind::Unreached,
        Some(
            Code::Authentication
            | Code::SaslAuthenticationFailed
            | Code::ClusterAuthorizationFailed
            | Code::Fatal,
        ) => Kind::Refused,
        Some(Code::ProducerFenced | Code::InvalidProducerEpoch) => Kind::Fenced,
        Some(Code::PurgeQueue) => Kind::Withdrawn,
        Some(Code::PurgeInflight) => Kind::InDoubt,
        _ => Kind::Transient,
    }
}

/// What kept a batch's records from the brokers, besides the records themselves.
#[derive(Clone, Copy)]
enum Outage {
    None,
    /// No broker answers.
    Brokers,
    /// The producer hit a fatal error, or was fenced: it fails every record until it is
    /// replaced.
    Fatal,
}

/// A record that did not reach its topic.
struct Failure {
    topic: String,
    error: KafkaError,
}

impl Failure {
    fn kind(&self) -> Kind {
        kind(&self.error)
    }

    fn into_error(self, outage: Outage) -> SinkError {
        let Self { topic, error } = self;
        let what = format!("publishing to topic `{topic}`: {error}");
        match (kind(&error), outage) {
            (Kind::Permanent, _) => SinkError::permanent(what),
            (Kind::Withdrawn, _) => {
                SinkError::unavailable(format!("{what} (taken back before it was sent)"))
            }
            (Kind::InDoubt, _) => SinkError::in_doubt(format!(
                "{what} (taken back after it was sent: the broker may still write it)"
            )),
            (Kind::Refused | Kind::Fenced, _)
            | (Kind::Unreached, Outage::Brokers | Outage::Fatal)
            | (Kind::Transient, Outage::Fatal) => SinkError::unavailable(what),
            (Kind::Unreached | Kind::Transient, _) => SinkError::transient(what),
        }
    }
}

impl<T: Outbox, E: Encoding<T>> KafkaSink<T, E> {
    /// Publishes `batch` and returns the delivery report of each delivery, in order
    /// (the partition and offset of its record), or the error the [`Sink`]
    /// implementation reports. For sinks that wrap this one and need the offsets.
    pub async fn publish_acked(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<Acked, SinkError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        let client = &self.client;
        let current = client.producer();
        let producer = &current.producer;
        if client.brokers.down.load(Ordering::Relaxed) {
            let topic = batch
                .first()
                .map(|delivery| self.outgoing.destination(delivery.event()))
                .unwrap_or_default();
            if !client.reachable(producer, topic).await {
                let cause = client.brokers.cause();
                return broker::unavailable(
                    batch,
                    &format!("no Kafka broker answers; librdkafka: {cause}"),
                );
            }
        }
        // Every record goes to the producer before any delivery report is awaited: the
        // batch costs about one round trip (per partition leader), not one per event.
        let sent: Vec<_> = batch
            .iter()
            .map(|delivery| self.send(producer, delivery))
            .collect();
        let delivered = join_all(sent.into_iter().map(|sent| async move {
            let (topic, report) = sent?;
            match report.await {
                Ok(Ok(acked)) => Ok(acked),
                Ok(Err((error, _))) => Err(Failed::Client(Failure { topic, error })),
                Err(_) => Err(Failed::Answer(SinkError::transient(format!(
                    "publishing to topic `{topic}`: the producer was dropped before the delivery report"
                )))),
            }
        }))
        .await;
        let acked = delivered.iter().any(Result::is_ok);
        if acked {
            client.brokers.up();
        }
        // Nothing reached a broker and something failed on the way: is any broker there?
        let unreached = delivered.iter().find_map(|delivered| match delivered {
            Err(Failed::Client(failure)) if failure.kind() == Kind::Unreached => {
                Some(failure.topic.clone())
            }
            _ => None,
        });
        if delivered.iter().any(
            |delivered| matches!(delivered, Err(Failed::Client(failure)) if failure.kind() == Kind::Fenced),
        ) {
            current.fenced.store(true, Ordering::Relaxed);
        }
        let outage = if current.unusable().is_some() {
            // Replaced before the next batch.
            Outage::Fatal
        } else if let Some(topic) = unreached
            && !acked
            && !client.reachable(producer, topic).await
        {
            Outage::Brokers
        } else {
            Outage::None
        };
        delivered
            .into_iter()
            .map(|delivered| match delivered {
                Ok(acked) => Ok(acked),
                Err(Failed::Answer(error)) => Err(error),
                Err(Failed::Client(failure)) => Err(failure.into_error(outage)),
            })
            .collect()
    }

    /// Hands one delivery's record to the producer; returns its topic and the future of
    /// its delivery report.
    fn send(
        &self,
        producer: &Producer,
        delivery: &Delivery<'_, T>,
    ) -> Result<(String, DeliveryFuture), Failed<Failure>> {
        let message = self.outgoing.message(delivery)?;
        let cloud_event: Vec<(String, String)> = message
            .cloud_event_headers("ce_")
            .map(|(name, value)| (name, value.to_owned()))
            .collect();
        let is_cloud_event = message.is_cloud_event();
        let broker::Message {
            destination: topic,
            body,
            headers: outbox_headers,
            content_type,
            ..
        } = message;
        let key = match &self.key {
            Some(key) => key(delivery),
            None => delivery
                .key()
                .unwrap_or(delivery.event_id().as_str())
                .as_bytes()
                .to_vec(),
        };
        let mut headers = OwnedHeaders::new_with_capacity(7 + cloud_event.len());
        for (name, value) in outbox_headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        if let Some(content_type) = content_type {
            // A CloudEvent's content type is `content-type`, as its Kafka binding names
            // it (Kafka's header names are case-sensitive): a binary one's
            // `datacontenttype`, or a structured one's media type, by which a consumer
            // tells the modes apart.
            let name = if is_cloud_event {
                "content-type"
            } else {
                header::CONTENT_TYPE
            };
            headers = headers.insert(Header {
                key: name,
                value: Some(content_type.as_bytes()),
            });
        }
        for (name, value) in &cloud_event {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let record = FutureRecord::to(&topic)
            .payload(&body)
            .key(&key)
            .headers(headers);
        match producer.send_result(record) {
            Ok(report) => Ok((topic, report)),
            Err((error, _)) => Err(Failed::Client(Failure { topic, error })),
        }
    }
}

impl<T: Outbox + Send + Sync, E: Encoding<T>> Sink<T> for KafkaSink<T, E> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        broker::acknowledged(self.publish_acked(batch).await)
    }

    /// `kafka`, the topic.
    fn destination(&self, event: &T) -> Option<Destination> {
        Some(Destination::new(SYSTEM, self.outgoing.destination(event)))
    }

    /// Purges the producer, queued and in-flight records (see
    /// [shutdown](KafkaSink#shutdown)), and waits for the purge to finish: librdkafka
    /// then sends none of them, and reports each to the batch it belongs to.
    async fn withdraw(&self) -> bool {
        // The producer in use: one replaced after a fatal error purged its queues itself.
        let producer = self
            .client
            .producer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .producer
            .clone();
        let purged = tokio::task::spawn_blocking(move || {
            producer.purge(PurgeConfig::default().queue().inflight());
        })
        .await;
        if let Err(error) = purged {
            // Whatever the producer still holds is reported to its batch all the same
            // (delivered, or timed out within `message.timeout.ms`); a batch the relay
            // hears nothing of by its send timeout is in doubt, and kept claimed.
            tracing::error!(%error, "purging the Kafka producer failed");
        }
        true
    }
}

/// The event id a record carries (the [`header::EVENT_ID`] header), for a consumer's
/// [`Inbox`](crate::inbox::Inbox).
pub fn event_id<M: rdkafka::Message>(message: &M) -> Option<&str> {
    header_value(message, header::EVENT_ID)
}

/// The trace context a record carries (its [`header::TRACEPARENT`],
/// [`header::TRACESTATE`] and [`header::BAGGAGE`] headers), for the consumer's span
/// (`Consumed::consumer_span`); `None` without one, or with a malformed one.
pub fn trace<M: rdkafka::Message>(message: &M) -> Option<TraceContext> {
    TraceContext::parse(
        header_value(message, header::TRACEPARENT)?,
        header_value(message, header::TRACESTATE),
    )
    .map(|trace| trace.with_baggage(header_value(message, header::BAGGAGE)))
}

/// A record's [`Consumed`](crate::inbox::Consumed), for each of rdkafka's message types.
macro_rules! consumed {
    ($($message:ty),*) => {$(
        impl crate::inbox::Consumed for $message {
            fn event_id(&self) -> Option<&str> {
                event_id(self)
            }

            fn system(&self) -> &'static str {
                SYSTEM
            }

            fn destination(&self) -> &str {
                rdkafka::Message::topic(self)
            }

            fn trace(&self) -> Option<TraceContext> {
                trace(self)
            }
        }
    )*};
}

consumed!(
    rdkafka::message::BorrowedMessage<'_>,
    rdkafka::message::OwnedMessage
);

fn header_value<'m, M: rdkafka::Message>(message: &'m M, name: &str) -> Option<&'m str> {
    message
        .headers()?
        .iter()
        .find(|header| header.key == name)?
        .value
        .and_then(|value| std::str::from_utf8(value).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configured(lease: Duration, set: &[(&str, &str)]) -> Result<ClientConfig, ConfigError> {
        let mut config = ClientConfig::new();
        for (property, value) in set {
            config.set(*property, *value);
        }
        producer_config(&config, "orders", lease)
    }

    #[test]
    fn the_idempotent_producer_and_a_message_timeout_below_the_lease_are_set() {
        for (lease, timeout) in [(2, "1000"), (30, "10000"), (300, "10000")] {
            let config = configured(Duration::from_secs(lease), &[]).unwrap();
            assert_eq!(config.get("enable.idempotence"), Some("true"));
            assert_eq!(config.get("acks"), Some("all"));
            assert_eq!(config.get("message.timeout.ms"), Some(timeout), "{lease}s");
            assert_eq!(config.get("partitioner"), Some("consistent"));
            assert_eq!(config.get("linger.ms"), Some("0"));
        }
    }

    #[test]
    fn what_the_application_set_in_agreement_is_kept() {
        let config = configured(
            Duration::from_secs(30),
            &[
                ("request.required.acks", "-1"),
                ("delivery.timeout.ms", "19000"),
                ("queue.buffering.max.ms", "20"),
            ],
        )
        .unwrap();
        assert_eq!(config.get("linger.ms"), None, "its alias is kept");
        assert_eq!(config.get("acks"), None);
        assert_eq!(config.get("request.required.acks"), Some("-1"));
        assert_eq!(config.get("message.timeout.ms"), None);
        assert_eq!(config.get("delivery.timeout.ms"), Some("19000"));
    }

    #[test]
    fn a_record_purged_from_the_queue_is_handed_back_and_one_purged_in_flight_is_in_doubt() {
        let purged = |code| {
            Failure {
                topic: "orders".to_owned(),
                error: KafkaError::MessageProduction(code),
            }
            .into_error(Outage::None)
        };
        let queued = purged(RDKafkaErrorCode::PurgeQueue);
        assert!(matches!(queued, SinkError::Unavailable(_)), "{queued}");
        let in_flight = purged(RDKafkaErrorCode::PurgeInflight);
        assert!(matches!(in_flight, SinkError::InDoubt(_)), "{in_flight}");
    }

    #[test]
    fn a_record_a_broker_refused_as_fenced_is_handed_back_for_the_producer_that_replaces_it() {
        for code in [
            RDKafkaErrorCode::ProducerFenced,
            RDKafkaErrorCode::InvalidProducerEpoch,
        ] {
            let failure = Failure {
                topic: "orders".to_owned(),
                error: KafkaError::MessageProduction(code),
            };
            assert!(failure.kind() == Kind::Fenced, "{code}");
            let error = failure.into_error(Outage::None);
            assert!(matches!(error, SinkError::Unavailable(_)), "{error}");
        }
    }

    #[test]
    fn a_message_timeout_not_below_two_thirds_of_the_lease_is_refused() {
        let error =
            configured(Duration::from_secs(30), &[("message.timeout.ms", "20000")]).unwrap_err();
        assert!(
            matches!(&error, ConfigError::MessageTimeout { property: "message.timeout.ms", value, table: "orders", lease }
                if value == "20000" && *lease == Duration::from_secs(30)),
            "{error}"
        );
        configured(Duration::from_secs(30), &[("message.timeout.ms", "19999")]).unwrap();
    }
}
