//! The Kafka sink through a real Kafka-protocol broker (tansu) and real PostgreSQL.
//!
//! - The seed's broker-level test (`redeliver`): a relay process publishes a batch, the
//!   broker acknowledges it, and the process is SIGKILLed before it records `SENT`. The
//!   lease expires, a second relay publishes the batch again: the same event ids (key
//!   and header) under a higher generation. The idempotent producer deduplicates only
//!   within one producer session, so the topic holds two records of each event; a
//!   consumer that applies each event through the inbox applies each effect exactly
//!   once.
//! - Bad input: an event that does not encode, a record over the producer's
//!   `message.max.bytes`, a topic that does not exist: each `DEAD` with its reason, the
//!   others sent. A full producer queue: retried, everything sent once.
//! - An outage: the client loses its broker (a proxy in between is stopped); batches go
//!   back without counting attempts until it returns, then everything is sent.
//! - Credentials the broker refuses, and a broker that accepts connections and never
//!   answers: batches go back without counting attempts, nothing `DEAD`.
//! - Per-key ordering: the ordering key is the record key, and each key's records are in
//!   the outbox's order.
//! - A configuration that contradicts the idempotent producer, or an unbounded message
//!   timeout, is refused when the sink is built.
//! - A shutdown whose grace runs out with a batch still in the producer: a record still
//!   queued is taken back and handed back, and no copy of it leaves the producer later
//!   (none lands after the next event of its key); one sent and unanswered stays claimed.
//!
//! Each test starts its own tansu (an Apache Kafka-compatible broker, one static binary,
//! in-memory storage) on a free port: `OUTBOX_TANSU` names the binary, by default
//! `${XDG_CACHE_HOME:-~/.cache}/outbox/tansu-venv/bin/tansu`, where `.ci/run` installs
//! it. Without it the tests fail, saying how to install it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::Outbox as _;
use outbox::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox::kafka::rdkafka::client::DefaultClientContext;
use outbox::kafka::rdkafka::consumer::{Consumer as _, StreamConsumer};
use outbox::kafka::rdkafka::message::{BorrowedMessage, Headers as _};
use outbox::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use outbox::kafka::{ConfigError, KafkaSink};
use outbox::message::header;
use outbox::testing::TestSchema;
use outbox::{Delivery, Relay, Sink, SinkError, relay::Backoff};
use outbox::{Inbox, Received, inbox};
use outbox_testkit::broker::{self, RefuseUnencodable};
use outbox_testkit::child::{self, ChildCommand};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{ChaosEvent, OrderStep, TracedOrder};
use outbox_testkit::proxy::Proxy;
use outbox_testkit::rows::{enqueue, row_of};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::tansu::{Tansu, free_port};
use outbox_testkit::{TestResult, wait_until};
use tokio::time::timeout;

const ROLE: &str = "kafka-relay";
/// Marks the child's protocol lines.
const MARK: &str = "KAFKA-CHILD";
/// The producer's `message.timeout.ms` in these tests: below two thirds of
/// `ChaosEvent`'s 2 s lease.
const MESSAGE_TIMEOUT_MS: &str = "1200";

/// The producer configuration of these tests: the broker, and a message timeout below
/// the lease of `ChaosEvent`.
fn producer_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("message.timeout.ms", MESSAGE_TIMEOUT_MS);
    config
}

/// Creates `topic`, one partition.
async fn create_topic(bootstrap: &str, topic: &str) -> TestResult {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    let created = admin
        .create_topics(
            &[NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for result in created {
        result.map_err(|(topic, code)| format!("creating topic {topic}: {code}"))?;
    }
    Ok(())
}

/// A consumer of partition 0 of `topic` from its beginning (assigned: a group join is
/// slow on tansu, and the tests need no group).
fn consumer(bootstrap: &str, topic: &str) -> TestResult<StreamConsumer> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "outbox-tests")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut partitions = TopicPartitionList::new();
    partitions.add_partition_offset(topic, 0, Offset::Beginning)?;
    consumer.assign(&partitions)?;
    Ok(consumer)
}

/// Every record of partition 0 of `topic`, which must hold `count` (tansu's high
/// watermark is not the next offset, so a consumer counts): waits up to 30 s for them,
/// then 2 s for one too many.
async fn records(bootstrap: &str, topic: &str, count: usize) -> TestResult<Vec<Record>> {
    let consumer = consumer(bootstrap, topic)?;
    let mut records = Vec::with_capacity(count);
    while records.len() < count {
        let message = timeout(Duration::from_secs(30), consumer.recv())
            .await
            .map_err(|_| format!("{} records of {count} after 30 s", records.len()))??;
        records.push(Record::of(&message)?);
    }
    if let Ok(more) = timeout(Duration::from_secs(2), consumer.recv()).await {
        return Err(format!("more than {count} records: {:?}", Record::of(&more?)?).into());
    }
    Ok(records)
}

/// What a test reads of a record.
#[derive(Debug)]
struct Record {
    event_id: String,
    key: Option<Vec<u8>>,
    headers: BTreeMap<String, String>,
    value: Vec<u8>,
}

impl Record {
    fn of(message: &BorrowedMessage<'_>) -> TestResult<Self> {
        let event_id = outbox::kafka::event_id(message)
            .ok_or("a record without an event id")?
            .to_owned();
        let mut headers = BTreeMap::new();
        if let Some(all) = message.headers() {
            for header in all.iter() {
                let value = header.value.ok_or("a header without a value")?;
                headers.insert(
                    header.key.to_owned(),
                    String::from_utf8(value.to_vec()).map_err(|e| e.to_string())?,
                );
            }
        }
        Ok(Self {
            event_id,
            key: message.key().map(<[u8]>::to_vec),
            headers,
            value: message.payload().unwrap_or_default().to_vec(),
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// The relay process: re-executed by the test, it publishes through Kafka and dies by
/// SIGKILL once the broker acknowledged its first batch. A no-op in a normal run.
#[test]
fn kafka_redeliver_child() {
    if !child::requested(ROLE) {
        return;
    }
    let (bootstrap, topic) = (
        broker::child_param("BOOTSTRAP"),
        broker::child_param("TOPIC"),
    );
    broker::relay_until_killed::<ChaosEvent, _>(MARK, async || {
        KillAfterAcks(KafkaSink::new(&producer_config(&bootstrap), topic).expect("a producer"))
    });
}

/// Publishes through Kafka, then, once every delivery report is in, reports them and
/// SIGKILLs its own process: acknowledged by the broker, not recorded `SENT`.
struct KillAfterAcks(KafkaSink<ChaosEvent>);

impl Sink<ChaosEvent> for KillAfterAcks {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        let acks = self.0.publish_acked(batch).await;
        let mut words = vec![format!("{MARK} ACKED")];
        for (delivery, ack) in batch.iter().zip(&acks) {
            match ack {
                Ok(_) => {
                    words.push(format!("{}:{}", delivery.event_id(), delivery.generation()));
                }
                Err(error) => {
                    child::say(&format!("{MARK} FAILED {}: {error}", delivery.event_id()));
                    std::process::exit(1);
                }
            }
        }
        child::say(&words.join(" "));
        nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL)
            .expect("SIGKILL to itself");
        std::future::pending().await
    }
}

/// What the redelivery test's phases share.
struct Scene {
    tansu: Tansu,
    db: TestSchema,
    topic: String,
    events: Vec<ChaosEvent>,
}

#[tokio::test]
async fn kafka_a_publisher_killed_after_the_acks_is_redelivered_stored_twice_and_applied_once()
-> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    sqlx::query("CREATE TABLE shipments (event_id text NOT NULL, parcels bigint NOT NULL)")
        .execute(pool)
        .await?;
    let topic = format!("outbox.test.{}.shipments", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;

    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let mut scene = Scene {
        tansu,
        db,
        topic,
        events,
    };
    let first = first_relay_is_killed_after_the_acks(&mut scene).await?;
    second_relay_redelivers(&mut scene).await?;
    consumer_applies_each_effect_once(&mut scene, &first).await?;
    scene.db.drop_schema().await?;
    Ok(())
}

/// Phase 1: the first relay publishes, the broker acknowledges, the process dies.
/// Returns the generation each event was acknowledged under.
async fn first_relay_is_killed_after_the_acks(
    scene: &mut Scene,
) -> TestResult<BTreeMap<String, i64>> {
    let Scene {
        tansu,
        db,
        topic,
        events,
    } = scene;
    let pool = db.pool();
    let bootstrap = tansu.bootstrap();
    let mut first = ChildCommand::test("kafka_redeliver_child").spawn(
        ROLE,
        &[
            ("URL", &db.url()),
            ("BOOTSTRAP", &bootstrap),
            ("TOPIC", topic),
        ],
    )?;
    let words = broker::killed_after_the_broker_took::<ChaosEvent>(
        &mut first,
        (MARK, "ACKED"),
        pool,
        &broker::keys(events),
    )
    .await?;
    let acked: BTreeMap<String, i64> = words
        .iter()
        .map(|word| broker::event_and_generation(word))
        .collect();
    for event in events.iter() {
        assert_eq!(acked[&event.key], 1, "{}", event.key);
    }
    records(&bootstrap, topic, 3).await?;
    Ok(acked)
}

/// Phase 2: the first relay's lease expires; a second relay publishes the events again.
async fn second_relay_redelivers(scene: &mut Scene) -> TestResult {
    let Scene {
        tansu,
        db,
        topic,
        events,
    } = scene;
    let pool = db.pool();
    let bootstrap = tansu.bootstrap();
    let sink = KafkaSink::new(&producer_config(&bootstrap), topic.clone())?;
    let second = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink).poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "the second relay sent all 3",
        Duration::from_secs(30),
        async || outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 3,
    )
    .await;
    second.stop().await?;

    for event in events.iter() {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.generation, row.attempts),
            ("SENT", 2, 2),
            "{}",
            event.key
        );
    }
    // Two producer sessions: the topic holds two records of each event.
    records(&bootstrap, topic, 6).await?;
    Ok(())
}

/// Phase 3: the consumer reads all six records, applying each through the inbox.
async fn consumer_applies_each_effect_once(
    scene: &mut Scene,
    first: &BTreeMap<String, i64>,
) -> TestResult {
    let Scene {
        tansu, db, topic, ..
    } = scene;
    let pool = db.pool();
    let inbox = Inbox::new("shipping");
    let mut receipts: Vec<Received> = Vec::new();
    // event id -> the generations of its copies, in the partition's order.
    let mut copies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for record in records(&tansu.bootstrap(), topic, 6).await? {
        let event_id = record.event_id.clone();
        assert_eq!(
            record.key.as_deref(),
            Some(event_id.as_bytes()),
            "the key is the event id"
        );
        assert_eq!(
            record.header(header::CONTENT_TYPE),
            Some("application/json")
        );
        assert_eq!(record.header(header::TABLE), Some("chaos_events"));
        let generation = record
            .header(header::GENERATION)
            .ok_or("no generation")?
            .to_owned();
        assert_eq!(
            record.header(header::ATTEMPT),
            Some(generation.as_str()),
            "one claim per attempt here"
        );
        assert_eq!(
            record.header(header::CREATED_AT),
            Some(broker::enqueue_time(pool, &event_id).await?.as_str()),
            "the enqueue time, the same in both copies"
        );
        copies.entry(event_id.clone()).or_default().push(generation);
        receipts.push(broker::apply(pool, &inbox, &event_id, &record.value).await?);
    }
    broker::each_event_twice(first, &copies);
    broker::each_effect_applied_once(pool, &receipts, 6).await?;
    Ok(())
}

#[tokio::test]
async fn kafka_bad_input_is_dead_with_its_reason_and_the_other_events_are_sent() -> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let topic = format!("outbox.test.{}.shipments", db.name());
    let missing = format!("outbox.test.{}.missing", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    // Over the producer's `message.max.bytes` below (librdkafka's least, 1000): the
    // event id is the key, a header, and in the value.
    let huge = "h".repeat(1000);
    let mut config = producer_config(&tansu.bootstrap());
    config
        .set("message.max.bytes", "1000")
        // A producer asks the broker to create a topic it does not know (tansu does), and
        // waits up to `topic.metadata.propagation.max.ms` (30 s) for a new topic to show:
        // here a missing topic stays missing, and is known missing at once.
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "100");
    let topic_of = topic.clone();
    let sink = KafkaSink::new(&config, topic.clone())?
        .topic_from(move |event: &ChaosEvent| {
            if event.key == "missing" {
                missing.clone()
            } else {
                topic_of.clone()
            }
        })
        .encoding(RefuseUnencodable);
    broker::refused_events_are_dead_and_the_others_sent(
        pool,
        sink,
        &[
            (
                "unencodable",
                "cannot encode the event: parcels must be positive",
            ),
            (&huge, "MessageSizeTooLarge"),
            ("missing", "UnknownTopicOrPartition"),
        ],
    )
    .await?;
    let sent: Vec<String> = records(&tansu.bootstrap(), &topic, 2)
        .await?
        .into_iter()
        .map(|record| record.event_id)
        .collect();
    assert_eq!(sent, ["ok-1", "ok-2"]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn kafka_a_broker_outage_burns_no_attempts_and_the_relay_resumes_when_it_returns()
-> TestResult {
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    // Clients reach the broker through the proxy only: tansu advertises the proxy.
    let port = free_port()?;
    let mut proxy = Proxy::start(format!("127.0.0.1:{port}")).await?;
    let tansu = Tansu::start_advertising(port, proxy.port).await?;
    let through = format!("127.0.0.1:{}", proxy.port);
    let topic = format!("outbox.test.{}.shipments", db.name());
    create_topic(&through, &topic).await?;
    let sink = KafkaSink::new(&producer_config(&through), topic.clone())?;
    proxy.down();

    broker::ride_out_an_outage(pool, &mut proxy, sink).await?;
    let sent: std::collections::BTreeSet<String> = records(&through, &topic, 10)
        .await?
        .into_iter()
        .map(|record| record.event_id)
        .collect();
    assert_eq!(sent.len(), 10, "one record of each event: {sent:?}");
    proxy.down();
    drop(tansu);
    db.drop_schema().await?;
    Ok(())
}

/// A producer queue of one record: the batch's other records do not fit (`QueueFull`),
/// which is transient: retried, and everything is sent, once each.
#[tokio::test]
async fn kafka_a_full_local_queue_is_transient_and_every_event_is_sent_once() -> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let topic = format!("outbox.test.{}.shipments", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let mut config = producer_config(&tansu.bootstrap());
    config.set("queue.buffering.max.messages", "1");
    let errors = Arc::new(Mutex::new(Vec::new()));
    let sink = Recording {
        sink: KafkaSink::new(&config, topic.clone())?,
        errors: Arc::clone(&errors),
    };
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink).poll_interval(Duration::from_millis(50)),
    );
    wait_until("all 3 SENT", Duration::from_secs(30), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 3
    })
    .await;
    relay.stop().await?;

    let errors = std::mem::take(&mut *errors.lock().unwrap_or_else(PoisonError::into_inner));
    assert!(
        !errors.is_empty()
            && errors
                .iter()
                .all(|error| error.starts_with("transient") && error.contains("QueueFull")),
        "{errors:?}"
    );
    let mut attempts = Vec::new();
    for event in &events {
        attempts.push(
            row_of::<ChaosEvent>(pool, event.key.as_str())
                .await
                .attempts,
        );
    }
    assert_eq!(
        attempts.iter().sum::<i32>(),
        3 + i32::try_from(errors.len())?,
        "one counted attempt per refusal: {attempts:?}"
    );
    let mut sent: Vec<String> = records(&tansu.bootstrap(), &topic, 3)
        .await?
        .into_iter()
        .map(|record| record.event_id)
        .collect();
    sent.sort();
    assert_eq!(sent, ["shipment-1", "shipment-2", "shipment-3"]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn kafka_the_ordering_key_is_the_record_key_and_a_header_and_each_key_keeps_its_order()
-> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let topic = format!("outbox.test.{}.steps", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    let sink = KafkaSink::<OrderStep>::new(&producer_config(&tansu.bootstrap()), topic.clone())?;
    broker::publish_order_steps(pool, sink).await?;

    // key -> its records' event ids, in the partition's order.
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for record in records(&tansu.bootstrap(), &topic, 6).await? {
        let key = String::from_utf8(record.key.clone().ok_or("a record without a key")?)?;
        assert_eq!(
            record.header(header::KEY),
            Some(key.as_str()),
            "and a header"
        );
        by_key.entry(key).or_default().push(record.event_id);
    }
    assert_eq!(
        by_key,
        broker::steps_by_order(),
        "keyed by the order, in the outbox's order"
    );
    db.drop_schema().await?;
    Ok(())
}

/// A run of one key whose third event goes to a topic that does not exist: the
/// partition holds nothing after it until it is requeued, then the whole run in order.
#[tokio::test]
async fn kafka_a_run_stops_at_an_event_of_a_missing_topic_and_goes_on_in_order_once_requeued()
-> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let topic = format!("outbox.test.{}.steps", db.name());
    let missing = format!("outbox.test.{}.missing", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    let mut config = producer_config(&tansu.bootstrap());
    // A missing topic stays missing, and is known missing at once (see the bad input
    // test).
    config
        .set("allow.auto.create.topics", "false")
        .set("topic.metadata.propagation.max.ms", "100");
    let refusal = broker::Refusal::new();
    let sink = KafkaSink::new(&config, topic.clone())?
        .topic_from(refusal.destination(topic.clone(), missing));
    let bootstrap = tansu.bootstrap();
    broker::a_refused_event_holds_the_rest_of_its_run(db.pool(), sink, &refusal, async |n| {
        Ok(records(&bootstrap, &topic, n)
            .await?
            .into_iter()
            .map(|record| record.event_id)
            .collect())
    })
    .await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn kafka_cloud_events_binary_as_ce_headers_and_structured_as_the_value() -> TestResult {
    let tansu = Tansu::start().await?;
    for structured in [false, true] {
        let db = schema_from_zero(&[OrderStep::migrations()]).await?;
        let pool = db.pool();
        let topic = format!("outbox.test.{}.steps", db.name());
        create_topic(&tansu.bootstrap(), &topic).await?;
        let sink =
            KafkaSink::<OrderStep>::new(&producer_config(&tansu.bootstrap()), topic.clone())?
                .cloud_events(broker::cloud_events(structured));
        broker::publish_order_steps(pool, sink).await?;

        for record in records(&tansu.bootstrap(), &topic, 6).await? {
            assert_eq!(
                record.header(header::CONTENT_TYPE),
                None,
                "`content-type` instead"
            );
            if structured {
                assert_eq!(
                    record.header("content-type"),
                    Some("application/cloudevents+json; charset=utf-8")
                );
                broker::assert_structured_cloud_event(&record.event_id, &record.value)?;
            } else {
                assert_eq!(record.header("content-type"), Some("application/json"));
                let attribute =
                    |name: &str| record.header(&format!("ce_{name}")).map(str::to_owned);
                broker::assert_binary_cloud_event(&record.event_id, attribute)?;
                let event: serde_json::Value = serde_json::from_slice(&record.value)?;
                assert_eq!(
                    event["name"],
                    record.event_id.as_str(),
                    "the value is the event"
                );
            }
        }
        db.drop_schema().await?;
    }
    Ok(())
}

#[tokio::test]
async fn kafka_a_traced_events_context_is_in_its_records_traceparent() -> TestResult {
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let topic = format!("outbox.test.{}.traced", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    // Within the traced type's 1 s lease, as the sink requires.
    let mut config = producer_config(&tansu.bootstrap());
    config.set("message.timeout.ms", "500");
    let sink = KafkaSink::<TracedOrder>::new(&config, topic.clone())?;
    broker::publish_traced_order(db.pool(), sink).await?;

    let consumer = consumer(&tansu.bootstrap(), &topic)?;
    let message = timeout(Duration::from_secs(30), consumer.recv()).await??;
    let trace = outbox::kafka::trace(&message).ok_or("no trace context in the record")?;
    assert_eq!(trace.traceparent(), broker::TRACEPARENT);
    assert_eq!(trace.tracestate(), Some(broker::TRACESTATE));
    assert_eq!(trace.baggage(), Some(broker::BAGGAGE));
    db.drop_schema().await?;
    Ok(())
}

/// One trace from the request to the consumer's inbox through Kafka (feature `otel`):
/// the relay's send a child of the request, the consumer's `process <topic>` a child of
/// that send, through the record's `traceparent` header.
#[cfg(feature = "otel")]
#[tokio::test]
async fn kafka_traced_one_trace_from_the_request_to_the_consumers_inbox() -> TestResult {
    use outbox_testkit::otel::{Exported, order};
    use tracing::Instrument as _;

    let exported = Exported::install();
    let tansu = Tansu::start().await?;
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    let topic = format!("traced-{}", db.name());
    create_topic(&tansu.bootstrap(), &topic).await?;
    let request = exported
        .enqueue_in_a_request(pool, &[order("o-kafka")])
        .await?;
    // Within the traced type's 1 s lease, as the sink requires.
    let mut config = producer_config(&tansu.bootstrap());
    config.set("message.timeout.ms", "500");
    let relay = start(
        Relay::<TracedOrder, _>::new(pool.clone(), KafkaSink::new(&config, topic.clone())?)
            .tracer_provider(exported.provider()),
    );
    wait_until("SENT", Duration::from_secs(30), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 1
    })
    .await;
    relay.stop().await?;

    let consumer = consumer(&tansu.bootstrap(), &topic)?;
    let message = timeout(Duration::from_secs(30), consumer.recv()).await??;
    let inbox = Inbox::new("billing");
    async {
        let mut tx = pool.begin().await?;
        let event_id = outbox::kafka::event_id(&message).ok_or("no event id")?;
        assert!(inbox.receive(&mut tx, event_id).await?.is_new());
        tx.commit().await?;
        TestResult::Ok(())
    }
    .instrument(inbox.span(&message))
    .await?;
    exported.assert_one_trace(request, ("kafka", &topic), "billing")?;
    db.drop_schema().await?;
    Ok(())
}

/// A sink that keeps the errors of the sink it wraps, as text.
struct Recording {
    sink: KafkaSink<ChaosEvent>,
    errors: Arc<Mutex<Vec<String>>>,
}

impl Sink<ChaosEvent> for Recording {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        let results = self.sink.publish(batch).await;
        self.errors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(
                results
                    .iter()
                    .filter_map(|result| Some(result.as_ref().err()?.to_string())),
            );
        results
    }

    async fn withdraw(&self) -> bool {
        self.sink.withdraw().await
    }
}

/// Three events published through `sink`, whose brokers cannot take them, until the
/// relay has held back `batches` batches: no attempt counted, nothing `DEAD`, no error
/// recorded on a row. Returns the sink's errors.
async fn held_back(sink: KafkaSink<ChaosEvent>, batches: u64) -> TestResult<Vec<String>> {
    // A current-thread runtime polls the relay's tasks on this thread: they count here.
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let errors = Arc::new(Mutex::new(Vec::new()));
    let sink = Recording {
        sink,
        errors: Arc::clone(&errors),
    };
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink)
            .poll_interval(Duration::from_millis(50))
            .unavailable_backoff(Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(500),
            )),
    );
    let table = ChaosEvent::SPEC.table();
    wait_until(
        &format!("{batches} batches held back"),
        Duration::from_secs(30),
        async || counters.get(outbox::relay::metric::UNAVAILABLE, table) >= batches,
    )
    .await;
    relay.stop().await?;

    for event in &events {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("READY", 0),
            "{}",
            event.key
        );
        // No attempt counted, and why it waits said where `outbox status` reads it.
        assert!(
            row.last_error
                .as_deref()
                .is_some_and(|error| error.starts_with("destination unavailable: ")),
            "{row:?}"
        );
    }
    assert_eq!(counters.get(outbox::relay::metric::RETRIED, table), 0);
    db.drop_schema().await?;
    let errors = std::mem::take(&mut *errors.lock().unwrap_or_else(PoisonError::into_inner));
    assert!(
        !errors.is_empty()
            && errors
                .iter()
                .all(|error| error.starts_with("destination unavailable")),
        "every batch unavailable: {errors:?}"
    );
    Ok(errors)
}

/// tansu with `--authentication` completes no SASL handshake librdkafka offers (it
/// closes the connection at PLAIN's), so the credentials are refused: the cluster
/// cannot take anything, and no event pays for it.
#[tokio::test]
async fn kafka_credentials_the_broker_refuses_burn_no_attempts_and_send_nothing_to_dead()
-> TestResult {
    let port = free_port()?;
    let tansu = Tansu::start_with(port, port, &["--authentication"]).await?;
    let mut config = producer_config(&tansu.bootstrap());
    config
        .set("security.protocol", "SASL_PLAINTEXT")
        .set("sasl.mechanism", "PLAIN")
        .set("sasl.username", "outbox")
        .set("sasl.password", "wrong");
    let errors = held_back(KafkaSink::new(&config, "shipments")?, 3).await?;
    assert!(
        errors.iter().any(|error| error.contains("Authentication")),
        "librdkafka's reason: {errors:?}"
    );
    Ok(())
}

/// A listener that accepts connections and never answers: a broker hung, or a network
/// that drops everything. librdkafka reports no broker down; the records time out in
/// flight, and the sink finds that no broker answers a metadata request either.
#[tokio::test]
async fn kafka_a_broker_that_does_not_answer_burns_no_attempts_and_sends_nothing_to_dead()
-> TestResult {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = silent.local_addr()?.port();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            held.push(connection);
        }
    });
    let config = producer_config(&format!("127.0.0.1:{port}"));
    let errors = held_back(KafkaSink::new(&config, "shipments")?, 2).await?;
    holding.abort();
    assert!(
        errors.iter().all(|error| error.contains("MessageTimedOut")),
        "every record timed out: {errors:?}"
    );
    Ok(())
}

#[test]
fn kafka_a_producer_that_is_not_idempotent_or_unbounded_is_refused() {
    let refused = |property: &str, value: &str| {
        let mut config = producer_config("127.0.0.1:9");
        config.set(property, value);
        KafkaSink::<ChaosEvent>::new(&config, "shipments")
            .expect_err("refused")
            .to_string()
    };
    for (property, value, why) in [
        ("enable.idempotence", "false", "must be `true`"),
        ("acks", "1", "must be `all` (or -1)"),
        ("request.required.acks", "0", "must be `all` (or -1)"),
        ("transactional.id", "outbox", "must be unset"),
        (
            "message.timeout.ms",
            "0",
            "shorter than two thirds of the lease",
        ),
        (
            "delivery.timeout.ms",
            "1400",
            "shorter than two thirds of the lease",
        ),
        ("message.timeout.ms", "soon", "a number of milliseconds"),
    ] {
        let error = refused(property, value);
        assert!(
            error.contains(&format!("`{property}={value}`")) && error.contains(why),
            "{property}={value}: {error}"
        );
    }
    let mut config = producer_config("127.0.0.1:9");
    config.set("max.in.flight.requests.per.connection", "50");
    let error = KafkaSink::<ChaosEvent>::new(&config, "shipments").expect_err("refused");
    assert!(
        matches!(error, ConfigError::Client(_)),
        "librdkafka's own check: {error}"
    );
    // What the sink sets, accepted when given.
    let mut config = producer_config("127.0.0.1:9");
    config.set("enable.idempotence", "true").set("acks", "all");
    KafkaSink::<ChaosEvent>::new(&config, "shipments").expect("an idempotent producer");
}

/// A step of an order, as [`broker::order_steps`] names them.
fn step(order_id: i64, n: u32) -> OrderStep {
    OrderStep {
        name: format!("order-{order_id}-step-{n}"),
        order_id,
    }
}

/// A sink for `OrderStep` that counts the records it hands to its producer (its key
/// function runs just before each is handed over, in the same synchronous step).
fn counting_sink(
    config: &ClientConfig,
    topic: &str,
) -> TestResult<(KafkaSink<OrderStep>, Arc<AtomicUsize>)> {
    let handed = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&handed);
    let sink = KafkaSink::<OrderStep>::new(config, topic)?.key_from(
        move |delivery: &Delivery<'_, OrderStep>| {
            counted.fetch_add(1, Ordering::SeqCst);
            delivery.key().unwrap_or_default().to_owned()
        },
    );
    Ok((sink, handed))
}

/// Every record of partition 0 of `topic` up to the one of event `last`, which must come
/// (waits up to 30 s for each): `(event id, generation)`.
async fn records_through(
    bootstrap: &str,
    topic: &str,
    last: &str,
) -> TestResult<Vec<(String, String)>> {
    let consumer = consumer(bootstrap, topic)?;
    let mut records = Vec::new();
    loop {
        let message = timeout(Duration::from_secs(30), consumer.recv())
            .await
            .map_err(|_| format!("no record of {last} after 30 s; before it: {records:?}"))??;
        let record = Record::of(&message)?;
        let generation = record
            .header(header::GENERATION)
            .ok_or("no generation")?
            .to_owned();
        let done = record.event_id == last;
        records.push((record.event_id, generation));
        if done {
            return Ok(records);
        }
    }
}

/// The relay's shutdown grace runs out while the first step of an order lingers in
/// librdkafka's queue (`linger.ms`). The sink takes it back: the row is handed back,
/// and the producer, which the application still holds (a clone of the sink), never
/// sends it. Another relay, another producer, publishes both steps; then a marker
/// through the first producer, behind anything it still held for the partition, shows
/// that nothing of the abandoned batch ever left it: no late copy of step 1 after step 2.
#[tokio::test]
async fn kafka_a_record_still_queued_when_the_shutdown_grace_ends_is_taken_back_and_never_lands()
-> TestResult {
    let tansu = Tansu::start().await?;
    let bootstrap = tansu.bootstrap();
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let topic = format!("outbox.test.{}.steps", db.name());
    create_topic(&bootstrap, &topic).await?;
    enqueue(pool, &[step(7, 1), step(7, 2)]).await;

    // Each record waits 5 s in the producer's queue before it is sent: far longer than
    // the grace, shorter than the message timeout (below two thirds of the 30 s lease).
    let mut lingering = producer_config(&bootstrap);
    lingering
        .set("linger.ms", "5000")
        .set("message.timeout.ms", "19000");
    let (sink, handed) = counting_sink(&lingering, &topic)?;
    let first_producer = sink.clone();
    let first = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink)
            .shutdown_grace(Duration::from_millis(100))
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "step 1 is handed to the producer",
        Duration::from_secs(30),
        async || handed.load(Ordering::SeqCst) == 1,
    )
    .await;
    first.stop().await?;
    // Step 2 came in step 1's run, and was never sent: the first layer was taken back.
    for step in ["order-7-step-1", "order-7-step-2"] {
        let row = row_of::<OrderStep>(pool, step).await;
        assert_eq!(
            (row.status.as_str(), row.generation, row.attempts),
            ("READY", 1, 0),
            "{step} taken back unsent: handed back, the attempt not counted"
        );
    }

    // Another relay (a new process, its own producer) publishes both steps.
    let second = start(
        Relay::<OrderStep, _>::new(
            pool.clone(),
            KafkaSink::<OrderStep>::new(&producer_config(&bootstrap), topic.clone())?,
        )
        .poll_interval(Duration::from_millis(50)),
    );
    wait_until("both steps SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 2
    })
    .await;
    second.stop().await?;

    // The first producer keeps a partition's records in order: once it has written the
    // marker, it has written whatever it still held before it.
    enqueue(pool, &[step(9, 1)]).await;
    let marker = start(
        Relay::<OrderStep, _>::new(pool.clone(), first_producer)
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until("the marker SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 3
    })
    .await;
    marker.stop().await?;

    let owned = |(event_id, generation): (&str, &str)| (event_id.to_owned(), generation.to_owned());
    assert_eq!(
        records_through(&bootstrap, &topic, "order-9-step-1").await?,
        [
            ("order-7-step-1", "2"),
            ("order-7-step-2", "2"),
            ("order-9-step-1", "1")
        ]
        .map(owned),
        "steps 1 and 2 once, by the second relay, in order: no copy from the first producer"
    );
    db.drop_schema().await?;
    Ok(())
}

/// The relay's shutdown grace runs out while a record is on its way to the broker: sent
/// on a connection that went silent (a proxy frozen), unanswered. The sink takes it
/// back, but nothing can call back a request on the wire: the row is not handed back,
/// it stays claimed until its lease ends, so that no other relay publishes the step, or
/// the next one of its order, before a late copy could land.
#[tokio::test]
async fn kafka_a_record_sent_and_unanswered_when_the_shutdown_grace_ends_stays_claimed()
-> TestResult {
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    // Clients reach the broker through the proxy only: tansu advertises the proxy.
    let port = free_port()?;
    let mut proxy = Proxy::start(format!("127.0.0.1:{port}")).await?;
    let tansu = Tansu::start_advertising(port, proxy.port).await?;
    let through = format!("127.0.0.1:{}", proxy.port);
    let topic = format!("outbox.test.{}.steps", db.name());
    create_topic(&through, &topic).await?;
    // Far longer than the test: the request stays unanswered, not timed out.
    let mut config = producer_config(&through);
    config.set("message.timeout.ms", "19000");
    let (sink, handed) = counting_sink(&config, &topic)?;

    // The producer connects, learns the partition's leader and its producer id.
    enqueue(pool, &[step(8, 1)]).await;
    let warm = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "the first event SENT",
        Duration::from_secs(30),
        async || outbox::stats::<OrderStep>(pool).await.unwrap().sent == 1,
    )
    .await;
    warm.stop().await?;

    // Its connection goes silent: the next request goes out, and no answer comes back.
    proxy.freeze();
    enqueue(pool, &[step(7, 1), step(7, 2)]).await;
    let relay = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink)
            .shutdown_grace(Duration::from_millis(100))
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "step 1 is sent on the silent connection",
        Duration::from_secs(30),
        async || handed.load(Ordering::SeqCst) == 2 && proxy.held() > 0,
    )
    .await;
    relay.stop().await?;

    let row = row_of::<OrderStep>(pool, "order-7-step-1").await;
    assert_eq!(
        (row.status.as_str(), row.generation, row.attempts),
        ("INPROGRESS", 1, 1),
        "in doubt: still claimed, not handed back"
    );
    assert!(
        row.lease_left.is_some_and(|left| left > 0.0),
        "until its lease ends: {row:?}"
    );
    let next = row_of::<OrderStep>(pool, "order-7-step-2").await;
    assert_eq!(
        (next.status.as_str(), next.attempts),
        ("READY", 0),
        "the next step of the order waits behind it"
    );
    proxy.down();
    drop(tansu);
    db.drop_schema().await?;
    Ok(())
}
