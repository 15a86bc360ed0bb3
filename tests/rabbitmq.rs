//! The RabbitMQ sink through real RabbitMQ and real PostgreSQL.
//!
//! - The seed's broker-level test (`redeliver`): a relay process publishes a batch,
//!   RabbitMQ confirms it, and the process is SIGKILLed before it records `SENT`. The
//!   lease expires, a second relay publishes the batch again: the same event ids under a
//!   higher generation. RabbitMQ has no deduplication, so the queue holds two copies of
//!   each event; a consumer that applies each event through the inbox applies each
//!   effect exactly once.
//! - Bad input: an event that does not encode, a message no queue takes (returned,
//!   `mandatory`), a routing key over AMQP's 255 bytes: each `DEAD` with its reason, the
//!   others sent. An exchange that does not exist: the batch `DEAD`, with the reason.
//! - An outage: the client loses its broker (a proxy in between is stopped); batches go
//!   back without counting attempts until lapin's automatic recovery has reconnected,
//!   then everything is sent.
//!
//! - Wrong credentials: refused at connect, promptly, with AMQP's ACCESS_REFUSED; there is
//!   no connection, so no channel and no sink to lose an event with.
//!
//! Needs RabbitMQ on 127.0.0.1:5672, guest/guest (or `OUTBOX_AMQP_URL`); without it the
//! tests fail, saying how to start it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox::message::header;
use outbox::rabbitmq::RabbitSink;
use outbox::rabbitmq::lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use outbox::rabbitmq::lapin::types::{AMQPValue, FieldTable, ShortString};
use outbox::rabbitmq::lapin::{self, Channel, Connection, ExchangeKind};
use outbox::relay::Destination;
use outbox::testing::TestSchema;
use outbox::{Delivery, Relay, Sink, SinkError};
use outbox::{Inbox, Received, inbox};
use outbox_testkit::broker::{self, RefuseUnencodable};
use outbox_testkit::child::{self, ChildCommand};
use outbox_testkit::cleanup::Cleanup;
use outbox_testkit::events::{ChaosEvent, OrderStep, TracedOrder};
use outbox_testkit::proxy::Proxy;
use outbox_testkit::rows::{enqueue, row_of};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;
use tokio::time::timeout;

const ROLE: &str = "rabbitmq-relay";
/// Marks the child's protocol lines.
const MARK: &str = "RABBITMQ-CHILD";
/// The routing key the test queue is bound with.
const ROUTING_KEY: &str = "shipments";

fn amqp_url() -> String {
    std::env::var("OUTBOX_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The test's RabbitMQ connection; fails the test, saying how to start RabbitMQ, when
/// there is none.
async fn connect_rabbitmq() -> Arc<Connection> {
    let url = amqp_url();
    let how = "This test needs RabbitMQ: start it with `service rabbitmq-server start` \
               (Debian's `rabbitmq-server` package), or point OUTBOX_AMQP_URL at one";
    let connected = timeout(
        Duration::from_secs(10),
        Connection::connect(&url, lapin::ConnectionProperties::default()),
    )
    .await;
    match connected {
        Ok(Ok(connection)) => Arc::new(connection),
        Ok(Err(error)) => panic!("RabbitMQ is not reachable at {url}: {error}. {how}"),
        Err(elapsed) => panic!("RabbitMQ did not answer at {url}: {elapsed}. {how}"),
    }
}

/// A fresh exchange and a queue bound to it with [`ROUTING_KEY`], named after the test's
/// schema: deleted by [`Topology::delete`] at the end of the test, or when dropped if the
/// test fails first.
struct Topology {
    exchange: String,
    queue: String,
    cleanup: Cleanup,
}

impl Topology {
    async fn declare(channel: &Channel, db: &TestSchema) -> TestResult<Self> {
        let exchange = format!("outbox.test.{}", db.name());
        let queue = format!("outbox.test.{}.shipments", db.name());
        let cleanup = deleted_later(Some(&queue), &exchange);
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::default(),
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                ROUTING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            exchange,
            queue,
            cleanup,
        })
    }

    /// A sink publishing to the exchange with [`ROUTING_KEY`], on `connection`.
    async fn sink<T>(&self, connection: &Arc<Connection>) -> TestResult<RabbitSink<T>> {
        Ok(RabbitSink::new(Arc::clone(connection), self.exchange.clone(), ROUTING_KEY).await?)
    }

    /// How many messages the queue holds.
    async fn messages(&self, channel: &Channel) -> TestResult<u32> {
        let queue = channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await?;
        Ok(queue.message_count())
    }

    async fn delete(self) -> TestResult {
        self.cleanup.run().await
    }
}

/// Deletes `queue` and `exchange` from the shared server, at the end of the test or when
/// dropped (see [`Cleanup`]); on a connection of its own, as the test's may be gone.
/// RabbitMQ deletes what is not there without an error.
fn deleted_later(queue: Option<&str>, exchange: &str) -> Cleanup {
    let (queue, exchange) = (queue.map(str::to_owned), exchange.to_owned());
    let what = format!("the RabbitMQ exchange {exchange} and its queue {queue:?}");
    Cleanup::new(what, move || async move {
        let connection =
            Connection::connect(&amqp_url(), lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        if let Some(queue) = queue {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await?;
        connection.close(200, "deleted".into()).await?;
        Ok(())
    })
}

/// The relay process: re-executed by the test, it publishes through RabbitMQ and dies by
/// SIGKILL once the broker confirmed its first batch: of [`ChaosEvent`], or of
/// [`TracedOrder`] when told `EVENTS=traced`. A no-op in a normal run.
#[test]
fn rabbitmq_redeliver_child() {
    if !child::requested(ROLE) {
        return;
    }
    let exchange = broker::child_param("EXCHANGE");
    if child::param("EVENTS").as_deref() == Some("traced") {
        broker::relay_until_killed::<TracedOrder, _>(MARK, async || {
            KillAfterConfirms::new(exchange).await
        });
    } else {
        broker::relay_until_killed::<ChaosEvent, _>(MARK, async || {
            KillAfterConfirms::new(exchange).await
        });
    }
}

/// Publishes through RabbitMQ, then, once every confirm is in, reports them and SIGKILLs
/// its own process: confirmed by the broker, not recorded `SENT`.
struct KillAfterConfirms<T>(RabbitSink<T>);

impl<T> KillAfterConfirms<T> {
    /// Publishing to `exchange` with [`ROUTING_KEY`].
    async fn new(exchange: String) -> Self {
        Self(
            RabbitSink::new(connect_rabbitmq().await, exchange, ROUTING_KEY)
                .await
                .expect("a channel in confirm mode"),
        )
    }
}

impl<T: outbox::Outbox + serde::Serialize + Send + Sync> Sink<T> for KillAfterConfirms<T> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        let confirms = self.0.publish_confirmed(batch).await;
        let mut words = vec![format!("{MARK} CONFIRMED")];
        for (delivery, confirm) in batch.iter().zip(&confirms) {
            match confirm {
                Ok(confirmation) if confirmation.is_ack() => {
                    words.push(format!("{}:{}", delivery.event_id(), delivery.generation()));
                }
                other => {
                    child::say(&format!("{MARK} FAILED {}: {other:?}", delivery.event_id()));
                    std::process::exit(1);
                }
            }
        }
        child::say(&words.join(" "));
        nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL)
            .expect("SIGKILL to itself");
        std::future::pending().await
    }

    fn destination(&self, event: &T) -> Option<Destination> {
        self.0.destination(event)
    }
}

/// A header of a message, as text.
fn header_of(delivery: &lapin::message::Delivery, name: &str) -> Option<String> {
    match delivery.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(text) => Some(String::from_utf8_lossy(text.as_bytes()).into_owned()),
        _ => None,
    }
}

/// The consumer's handling of one delivery: [`broker::apply`] to its event id and body.
async fn apply(
    pool: &PgPool,
    inbox: &Inbox,
    delivery: &lapin::message::Delivery,
) -> TestResult<Received> {
    let event_id = outbox::rabbitmq::event_id(delivery).ok_or("a message without an event id")?;
    broker::apply(pool, inbox, event_id, &delivery.data).await
}

/// What the redelivery test's phases share.
struct Scene {
    channel: Channel,
    db: TestSchema,
    topology: Topology,
    events: Vec<ChaosEvent>,
}

#[tokio::test]
async fn a_publisher_killed_after_the_confirms_is_redelivered_queued_twice_and_applied_once()
-> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    sqlx::query("CREATE TABLE shipments (event_id text NOT NULL, parcels bigint NOT NULL)")
        .execute(pool)
        .await?;
    let topology = Topology::declare(&channel, &db).await?;

    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let mut scene = Scene {
        channel,
        db,
        topology,
        events,
    };
    let first = first_relay_is_killed_after_the_confirms(&mut scene).await?;
    second_relay_redelivers(&mut scene).await?;
    consumer_applies_each_effect_once(&mut scene, &first).await?;
    let Scene { db, topology, .. } = scene;
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// Phase 1: the first relay publishes, RabbitMQ confirms, the process dies. Returns the
/// generation each event was confirmed under.
async fn first_relay_is_killed_after_the_confirms(
    scene: &mut Scene,
) -> TestResult<BTreeMap<String, i64>> {
    let Scene {
        channel,
        db,
        topology,
        events,
    } = scene;
    let pool = db.pool();
    let mut first = ChildCommand::test("rabbitmq_redeliver_child").spawn(
        ROLE,
        &[("URL", &db.url()), ("EXCHANGE", &topology.exchange)],
    )?;
    let words = broker::killed_after_the_broker_took::<ChaosEvent>(
        &mut first,
        (MARK, "CONFIRMED"),
        pool,
        &broker::keys(events),
    )
    .await?;
    let confirmed: BTreeMap<String, i64> = words
        .iter()
        .map(|word| broker::event_and_generation(word))
        .collect();
    for event in events.iter() {
        assert_eq!(confirmed[&event.key], 1, "{}", event.key);
    }
    assert_eq!(topology.messages(channel).await?, 3);

    Ok(confirmed)
}

/// Phase 2: the first relay's lease expires; a second relay publishes the events again.
async fn second_relay_redelivers(scene: &mut Scene) -> TestResult {
    let Scene {
        channel,
        db,
        topology,
        events,
    } = scene;
    let pool = db.pool();
    let connection = connect_rabbitmq().await;
    let sink = topology.sink(&connection).await?;
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
    assert_eq!(
        topology.messages(channel).await?,
        6,
        "no deduplication in RabbitMQ: the queue holds two copies of each event"
    );
    Ok(())
}

/// Phase 3: the consumer takes all six copies, applying each through the inbox.
async fn consumer_applies_each_effect_once(
    scene: &mut Scene,
    first: &BTreeMap<String, i64>,
) -> TestResult {
    let Scene {
        channel,
        db,
        topology,
        ..
    } = scene;
    let pool = db.pool();
    let inbox = Inbox::new("shipping");
    let mut receipts = Vec::new();
    // event id -> the generations of its copies, in queue order.
    let mut copies: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while let Some(message) = channel
        .basic_get(topology.queue.as_str().into(), BasicGetOptions::default())
        .await?
    {
        let delivery = &message.delivery;
        let event_id = outbox::rabbitmq::event_id(delivery)
            .ok_or("no event id")?
            .to_owned();
        let properties = &delivery.properties;
        assert_eq!(
            properties.message_id().as_ref().map(ShortString::as_str),
            Some(event_id.as_str()),
            "message_id = the event id"
        );
        assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            properties.content_type().as_ref().map(ShortString::as_str),
            Some("application/json")
        );
        assert_eq!(
            header_of(delivery, header::TABLE).as_deref(),
            Some("chaos_events")
        );
        let generation = header_of(delivery, header::GENERATION).ok_or("no generation")?;
        assert_eq!(
            header_of(delivery, header::ATTEMPT),
            Some(generation.clone()),
            "one claim per attempt here"
        );
        assert_eq!(
            header_of(delivery, header::CREATED_AT),
            Some(broker::enqueue_time(pool, &event_id).await?),
            "the enqueue time, the same in both copies"
        );
        copies.entry(event_id).or_default().push(generation);
        receipts.push(apply(pool, &inbox, delivery).await?);
        delivery.ack(BasicAckOptions::default()).await?;
    }
    broker::each_event_twice(first, &copies);
    broker::each_effect_applied_once(pool, &receipts, 6).await?;
    assert_eq!(topology.messages(channel).await?, 0);

    Ok(())
}

#[tokio::test]
async fn bad_input_is_dead_with_its_reason_and_the_other_events_are_sent() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let topology = Topology::declare(&channel, &db).await?;
    let long = "k".repeat(300);
    // An event id AMQP's message_id cannot carry, routed like the others.
    let long_id = format!("id-{}", "i".repeat(300));
    let sink = topology
        .sink(&connection)
        .await?
        .routing_key_from(|event: &ChaosEvent| match event.key.as_str() {
            // No queue is bound with this key: the broker returns the message.
            "unroutable" => "nowhere".to_owned(),
            key if key.starts_with('k') && key.len() > 255 => key.to_owned(),
            _ => ROUTING_KEY.to_owned(),
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
            ("unroutable", "returned unroutable (312 NO_ROUTE)"),
            (&long, "the routing key is not an AMQP short string"),
            (&long_id, "the event id is not an AMQP short string"),
        ],
    )
    .await?;
    assert_eq!(topology.messages(&channel).await?, 2);
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// Routed and unroutable messages interleaved, by four workers: the broker confirms a
/// run of a channel's messages at once, and a returned message must be matched to its
/// own event, not to whichever confirm of the run came first.
#[tokio::test]
async fn each_returned_message_is_its_own_events_among_routed_ones() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let topology = Topology::declare(&channel, &db).await?;
    let events: Vec<ChaosEvent> = (0..400)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n:03}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let sink = topology
        .sink(&connection)
        .await?
        .routing_key_from(|event: &ChaosEvent| {
            if event.order_seq % 3 == 0 {
                "nowhere".to_owned()
            } else {
                ROUTING_KEY.to_owned()
            }
        });
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink)
            .concurrency(4)
            .batch_size(10)
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "every event SENT or DEAD",
        Duration::from_mins(1),
        async || {
            let stats = outbox::stats::<ChaosEvent>(pool).await.unwrap();
            stats.sent + stats.dead == 400
        },
    )
    .await;
    relay.stop().await?;

    // Every third event had no queue: DEAD, and only those; the queue holds the rest.
    let wrong: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_id, status FROM chaos_events
         WHERE (order_seq % 3 = 0) <> (status = 'DEAD') ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    assert!(wrong.is_empty(), "misattributed: {wrong:?}");
    assert_eq!(topology.messages(&channel).await?, 266);
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_ordering_key_is_a_header_and_each_keys_messages_are_queued_in_order() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let topology = Topology::declare(&channel, &db).await?;
    let sink = topology.sink(&connection).await?;
    broker::publish_order_steps(pool, sink).await?;

    // key -> its messages' event ids, in the queue's order.
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while let Some(message) = channel
        .basic_get(topology.queue.as_str().into(), BasicGetOptions::default())
        .await?
    {
        let delivery = &message.delivery;
        let key = header_of(delivery, header::KEY).ok_or("no key header")?;
        let event_id = outbox::rabbitmq::event_id(delivery).ok_or("no event id")?;
        by_key.entry(key).or_default().push(event_id.to_owned());
    }
    assert_eq!(
        by_key,
        broker::steps_by_order(),
        "each order's steps in the outbox's order"
    );
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// A run of one key whose third event no queue is bound for (returned, `DEAD`): the
/// queue holds nothing after it until it is requeued, then the whole run in order.
#[tokio::test]
async fn a_run_stops_at_a_returned_event_and_goes_on_in_order_once_requeued() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let topology = Topology::declare(&channel, &db).await?;
    let refusal = broker::Refusal::new();
    let sink = topology
        .sink(&connection)
        .await?
        // No queue is bound with `nowhere`: the broker returns the message.
        .routing_key_from(refusal.destination(ROUTING_KEY.to_owned(), "nowhere".to_owned()));
    // What the queue held so far, taken off it in its order.
    let mut taken = Vec::new();
    broker::a_refused_event_holds_the_rest_of_its_run(db.pool(), sink, &refusal, async |n| {
        let options = BasicGetOptions { no_ack: true };
        while let Some(message) = channel
            .basic_get(topology.queue.as_str().into(), options)
            .await?
        {
            let event_id = outbox::rabbitmq::event_id(&message.delivery).ok_or("no event id")?;
            taken.push(event_id.to_owned());
        }
        assert_eq!(taken.len(), n, "the queue's messages: {taken:?}");
        Ok(taken.clone())
    })
    .await?;
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn cloud_events_binary_as_cloud_events_headers_and_structured_as_the_body() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    for structured in [false, true] {
        let db = schema_from_zero(&[OrderStep::migrations()]).await?;
        let pool = db.pool();
        let topology = Topology::declare(&channel, &db).await?;
        let sink = topology
            .sink(&connection)
            .await?
            .cloud_events(broker::cloud_events(structured));
        broker::publish_order_steps(pool, sink).await?;

        let mut messages = 0;
        while let Some(message) = channel
            .basic_get(topology.queue.as_str().into(), BasicGetOptions::default())
            .await?
        {
            let delivery = &message.delivery;
            let event_id = outbox::rabbitmq::event_id(delivery).ok_or("no event id")?;
            let content_type = delivery
                .properties
                .content_type()
                .as_ref()
                .map(ShortString::as_str);
            if structured {
                assert_eq!(
                    content_type,
                    Some("application/cloudevents+json; charset=utf-8")
                );
                broker::assert_structured_cloud_event(event_id, &delivery.data)?;
            } else {
                assert_eq!(content_type, Some("application/json"));
                let attribute = |name: &str| header_of(delivery, &format!("cloudEvents_{name}"));
                broker::assert_binary_cloud_event(event_id, attribute)?;
                let event: serde_json::Value = serde_json::from_slice(&delivery.data)?;
                assert_eq!(event["name"], event_id, "the body is the event");
            }
            messages += 1;
        }
        assert_eq!(messages, 6);
        topology.delete().await?;
        db.drop_schema().await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_traced_events_context_is_in_its_messages_traceparent() -> TestResult {
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let topology = Topology::declare(&channel, &db).await?;
    broker::publish_traced_order(db.pool(), topology.sink(&connection).await?).await?;

    let message = channel
        .basic_get(topology.queue.as_str().into(), BasicGetOptions::default())
        .await?
        .ok_or("no message")?;
    let trace = outbox::rabbitmq::trace(&message.delivery).ok_or("no trace context")?;
    assert_eq!(trace.traceparent(), broker::TRACEPARENT);
    assert_eq!(trace.tracestate(), Some(broker::TRACESTATE));
    assert_eq!(trace.baggage(), Some(broker::BAGGAGE));
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// One trace from the request to the consumer's inbox (feature `otel`), across a relay
/// SIGKILLed after RabbitMQ confirmed its message, and that message's redelivery. The
/// killed relay's own spans die with it (this one exports none: its message carries the
/// context the order was enqueued in); the second relay's send, generation 2, is a child
/// of the request; the consumer processes both copies in the same trace, each a child
/// of the context its copy carries, and its inbox applies the first and skips the
/// second (`outbox.duplicate`).
#[cfg(feature = "otel")]
#[tokio::test]
async fn traced_one_trace_to_the_inbox_across_a_killed_relay_and_its_redelivery() -> TestResult {
    use outbox_testkit::otel::{Exported, attribute, order};

    let exported = Exported::install();
    let connection = connect_rabbitmq().await;
    let channel = connection.create_channel().await?;
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    let topology = Topology::declare(&channel, &db).await?;
    let (trace_id, request) = exported.enqueue_in_a_request(pool, &[order("o-1")]).await?;

    let mut first = ChildCommand::test("rabbitmq_redeliver_child").spawn(
        ROLE,
        &[
            ("URL", &db.url()),
            ("EXCHANGE", &topology.exchange),
            ("EVENTS", "traced"),
        ],
    )?;
    broker::killed_after_the_broker_took::<TracedOrder>(
        &mut first,
        (MARK, "CONFIRMED"),
        pool,
        &["o-1"],
    )
    .await?;
    let second = start(
        Relay::<TracedOrder, _>::new(pool.clone(), topology.sink(&connection).await?)
            .poll_interval(Duration::from_millis(50))
            .tracer_provider(exported.provider()),
    );
    wait_until(
        "the second relay sent it",
        Duration::from_secs(30),
        async || outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 1,
    )
    .await;
    second.stop().await?;

    let receipts = handled_in_the_inboxs_span(pool, &channel, &topology.queue).await?;
    assert_eq!(receipts, [Received::New, Received::Duplicate]);

    // The second relay's sends (one, unless RabbitMQ's confirm was slow and it retried).
    let sends = exported.named("send traced_order_events");
    assert!(!sends.is_empty(), "the second relay's send is exported");
    for send in &sends {
        assert_eq!(
            (send.span_context.trace_id(), send.parent_span_id),
            (trace_id, request),
            "the redelivery is sent in the request's trace"
        );
        assert_eq!(
            (
                attribute(send, "messaging.system").as_deref(),
                attribute(send, "messaging.destination.name").as_deref(),
                attribute(send, "messaging.rabbitmq.destination.routing_key").as_deref(),
            ),
            (
                Some("rabbitmq"),
                Some(topology.exchange.as_str()),
                Some(ROUTING_KEY)
            ),
            "RabbitMQ's destination: the exchange, and the routing key"
        );
        let generation = attribute(send, "outbox.generation").ok_or("no generation")?;
        assert!(
            generation.parse::<i64>()? >= 2,
            "a later claim: {generation}"
        );
    }
    let processes = exported.named(&format!("process {}", topology.exchange));
    let [killed_copy, redelivery] = processes.as_slice() else {
        panic!("one process span per copy: {processes:?}");
    };
    for process in [killed_copy, redelivery] {
        assert_eq!(process.span_context.trace_id(), trace_id, "one trace");
        assert_eq!(
            attribute(process, "messaging.message.id").as_deref(),
            Some("o-1")
        );
        assert_eq!(
            attribute(process, "messaging.system").as_deref(),
            Some("rabbitmq")
        );
    }
    assert_eq!(killed_copy.parent_span_id, request);
    assert_eq!(
        attribute(killed_copy, "outbox.duplicate").as_deref(),
        Some("false")
    );
    assert!(
        sends
            .iter()
            .any(|send| send.span_context.span_id() == redelivery.parent_span_id),
        "the redelivered copy is processed as a child of the send that published it"
    );
    assert_eq!(
        attribute(redelivery, "outbox.duplicate").as_deref(),
        Some("true")
    );
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// The consumer of the traced redelivery test: every message of `queue`, each handled in
/// its inbox span (`billing`): the inbox's receipt, the commit, the acknowledgement.
#[cfg(feature = "otel")]
async fn handled_in_the_inboxs_span(
    pool: &PgPool,
    channel: &Channel,
    queue: &str,
) -> TestResult<Vec<Received>> {
    use outbox::inbox::Consumed as _;
    use tracing::Instrument as _;

    let inbox = Inbox::new("billing");
    let mut receipts = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions::default())
        .await?
    {
        let delivery = &message.delivery;
        let receipt = async {
            let mut tx = pool.begin().await?;
            let event_id = delivery.event_id().ok_or("no event id")?;
            let receipt = inbox.receive(&mut tx, event_id).await?;
            tx.commit().await?;
            delivery.ack(BasicAckOptions::default()).await?;
            TestResult::Ok(receipt)
        }
        .instrument(inbox.span(delivery))
        .await?;
        receipts.push(receipt);
    }
    Ok(receipts)
}

#[tokio::test]
async fn a_broker_outage_burns_no_attempts_and_the_relay_resumes_when_it_returns() -> TestResult {
    let direct = connect_rabbitmq().await;
    let channel = direct.create_channel().await?;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let topology = Topology::declare(&channel, &db).await?;

    // The relay's connection goes through the proxy, and recovers (lapin's automatic
    // recovery: reconnects, reopens the channel in confirm mode).
    let mut proxy = Proxy::start("127.0.0.1:5672".to_owned()).await?;
    let through = amqp_url().replace("127.0.0.1:5672", &format!("127.0.0.1:{}", proxy.port));
    let connection = Connection::connect(
        &through,
        lapin::ConnectionProperties::default().enable_auto_recover(),
    )
    .await
    .map(Arc::new)?;
    let sink = topology.sink(&connection).await?;
    proxy.down();
    wait_until("the channel notices", Duration::from_secs(10), async || {
        !sink.channel_status().connected()
    })
    .await;

    broker::ride_out_an_outage(pool, &mut proxy, sink).await?;
    assert_eq!(topology.messages(&channel).await?, 10);
    proxy.down();
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// The publish closes the channel (AMQP's 404 is a channel error): the events of the
/// batch, all bound for the missing exchange, are `DEAD` with the broker's reason. The
/// connection stays open, and once the exchange exists the sink publishes on a new
/// channel.
#[tokio::test]
async fn a_missing_exchange_is_dead_with_its_reason_and_the_sink_goes_on_on_a_new_channel()
-> TestResult {
    let connection = connect_rabbitmq().await;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let shipment = |n: i64| ChaosEvent {
        key: format!("shipment-{n}"),
        order_seq: n,
    };
    // One event: the broker closes the channel on the first publish to a missing
    // exchange, and a batch-mate published after that close would find the channel
    // closed (handed back, unavailable), not the 404.
    enqueue(pool, &[shipment(1)]).await;
    // Declared by no one, yet.
    let exchange = format!("outbox.test.{}", db.name());
    let sink = RabbitSink::new(Arc::clone(&connection), exchange, ROUTING_KEY).await?;
    let first_channel = sink.channel_status();
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until("DEAD", Duration::from_secs(30), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().dead == 1
    })
    .await;
    let row = row_of::<ChaosEvent>(pool, "shipment-1").await;
    let error = row.last_error.unwrap_or_default();
    assert_eq!((row.status.as_str(), row.attempts), ("DEAD", 1), "{error}");
    assert!(error.contains("no such exchange"), "{error}");
    assert!(!first_channel.connected(), "the broker closed it");

    // The operator declares the exchange: the next events go out, on a new channel.
    let admin = connection.create_channel().await?;
    let topology = Topology::declare(&admin, &db).await?;
    enqueue(pool, &[shipment(2), shipment(3)]).await;
    wait_until("2 SENT", Duration::from_secs(30), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 2
    })
    .await;
    relay.stop().await?;
    assert!(sink.channel_status().connected());
    assert_eq!(topology.messages(&admin).await?, 2);
    for n in [2, 3] {
        let row = row_of::<ChaosEvent>(pool, format!("shipment-{n}").as_str()).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1));
    }
    topology.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_exchange_that_refuses_publishers_is_dead_with_its_reason_not_retried_forever()
-> TestResult {
    let connection = connect_rabbitmq().await;
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    // An internal exchange takes messages only from other exchanges: the broker answers
    // a publish with ACCESS_REFUSED and closes the channel, the connection stays open.
    let exchange = format!("outbox.test.{}.internal", db.name());
    let cleanup = deleted_later(None, &exchange);
    let admin = connection.create_channel().await?;
    admin
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                internal: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let sink = RabbitSink::new(Arc::clone(&connection), exchange.as_str(), ROUTING_KEY).await?;
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(50)),
    );
    for n in 1..=2 {
        let event = ChaosEvent {
            key: format!("refused-{n}"),
            order_seq: n,
        };
        enqueue(pool, &[event]).await;
        // Once as the only event of its batch; the second on the channel the sink opens
        // after the broker closed the first.
        wait_until("DEAD", Duration::from_secs(30), async || {
            outbox::stats::<ChaosEvent>(pool).await.unwrap().dead == n
        })
        .await;
        let row = row_of::<ChaosEvent>(pool, format!("refused-{n}").as_str()).await;
        let error = row.last_error.unwrap_or_default();
        assert_eq!((row.status.as_str(), row.attempts), ("DEAD", 1), "{error}");
        assert!(error.contains("ACCESS_REFUSED"), "{error}");
    }
    relay.stop().await?;
    cleanup.run().await?;
    db.drop_schema().await?;
    Ok(())
}

/// `url` with its password replaced by `password`.
fn with_password(url: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("amqp", url));
    let (credentials, host) = rest.rsplit_once('@').unwrap_or(("guest:guest", rest));
    let user = credentials.split(':').next().unwrap_or("guest");
    format!("{scheme}://{user}:{password}@{host}")
}

#[tokio::test]
async fn a_wrong_password_is_refused_at_connect_with_access_refused() -> TestResult {
    let wrong = with_password(&amqp_url(), "not-the-password");
    // With or without automatic recovery (which reconnects a connection that was open,
    // not one that never was): an error, promptly, not a hang or a panic.
    for properties in [
        lapin::ConnectionProperties::default(),
        lapin::ConnectionProperties::default().enable_auto_recover(),
    ] {
        let refused = timeout(
            Duration::from_secs(15),
            Connection::connect(&wrong, properties),
        )
        .await?
        .err()
        .ok_or("a wrong password was accepted")?;
        let access_refused = lapin::protocol::AMQPSoftError::ACCESSREFUSED.get_id();
        assert!(
            matches!(refused.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == access_refused),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("ACCESS"), "{refused}");
    }
    Ok(())
}
