//! RabbitMQ in the broker run. The broker is the shared system service (127.0.0.1:5672,
//! or `OUTBOX_AMQP_URL`), which a run cannot restart without disturbing the other tests;
//! its outage is every relay's and consumer's connection cut instead: they connect
//! through a proxy (`crate::proxy::Proxy`) that the driver takes down and up. The
//! relays reconnect with lapin's automatic recovery (as the sink's documentation advises),
//! the consumers by opening a new connection.
//!
//! RabbitMQ does not deduplicate: every publication it confirmed is a copy in the queue.
//! The copies are counted from the relays' records of the confirms (the queue cannot be
//! read back once consumed): a lower bound, since a relay killed between the confirms and
//! its record leaves a copy unrecorded.

use std::time::Duration;

use futures_util::StreamExt as _;
use outbox::rabbitmq::RabbitSink;
use outbox::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use outbox::rabbitmq::lapin::types::FieldTable;
use outbox::rabbitmq::lapin::{self, Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Delivery, SinkError};
use sqlx::PgPool;
use tokio::time::{Instant, sleep};

use super::{BrokerConfig, BrokerReport, ChaosBroker, Consumer, Receipt};
use crate::chaos::say;
use crate::child;
use crate::cleanup::Cleanup;
use crate::events::ChaosEvent;
use crate::proxy::Proxy;

/// The routing key the run's queue is bound with.
const ROUTING_KEY: &str = "shipments";

fn amqp_url() -> String {
    std::env::var("OUTBOX_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn param(name: &str) -> Result<String, String> {
    child::param(name).ok_or_else(|| format!("no {name} given"))
}

/// The driver's side.
pub struct RabbitMq {
    channel: Channel,
    proxy: Proxy,
    /// The URL through the proxy.
    through: String,
    exchange: String,
    queue: String,
    /// Deletes the exchange and the queue from the shared server: at the teardown, or
    /// when dropped if the run ends early (an error, a panic).
    cleanup: Cleanup,
}

impl ChaosBroker for RabbitMq {
    type Publisher = RabbitSink<ChaosEvent>;

    async fn start(_config: &BrokerConfig, schema: &TestSchema) -> Result<Self, String> {
        let url = amqp_url();
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .map_err(|e| {
                format!(
                    "RabbitMQ is not reachable at {url}: {e}; start it with `service \
                     rabbitmq-server start`, or point OUTBOX_AMQP_URL at one"
                )
            })?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| e.to_string())?;
        let exchange = format!("outbox.chaos.{}", schema.name());
        let queue = format!("outbox.chaos.{}.shipments", schema.name());
        let cleanup = deleted_later(&url, &queue, &exchange);
        let durable = |what: &str, e: lapin::Error| format!("declaring the {what}: {e}");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| durable("exchange", e))?;
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| durable("queue", e))?;
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                ROUTING_KEY.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| durable("binding", e))?;
        let upstream = authority(&url)?;
        let proxy = Proxy::start(upstream.clone())
            .await
            .map_err(|e| format!("the proxy: {e}"))?;
        let through = url.replace(&upstream, &format!("127.0.0.1:{}", proxy.port));
        Ok(Self {
            channel,
            proxy,
            through,
            exchange,
            queue,
            cleanup,
        })
    }

    fn describe(&self) -> String {
        format!(
            "RabbitMQ (the system service; its outages are every connection cut at a proxy \
             on port {}, not restarts)",
            self.proxy.port
        )
    }

    fn params(&self) -> Vec<(String, String)> {
        vec![
            ("BROKER".into(), "rabbitmq".into()),
            ("AMQP_URL".into(), self.through.clone()),
            ("AMQP_EXCHANGE".into(), self.exchange.clone()),
            ("AMQP_QUEUE".into(), self.queue.clone()),
        ]
    }

    /// Cuts every connection through the proxy and refuses new ones for a moment.
    async fn outage(&mut self, rng: &mut fastrand::Rng) -> Result<(&'static str, String), String> {
        self.proxy.down();
        let down = Duration::from_millis(rng.u64(200..1_500));
        sleep(down).await;
        self.proxy
            .up()
            .await
            .map_err(|e| format!("the proxy back up: {e}"))?;
        Ok((
            "connection cut",
            format!(
                "every connection to RabbitMQ cut, none accepted for {:.1}s",
                down.as_secs_f64()
            ),
        ))
    }

    /// The copies: every confirmed publication the relays recorded.
    async fn audit_copies(&self, pool: &PgPool, report: &mut BrokerReport) -> Result<(), String> {
        let db = |e: sqlx::Error| format!("auditing the copies: {e}");
        sqlx::query(
            "INSERT INTO chaos_copies (event_id, broker_position, stored_at) \
             SELECT event_id, id, delivered_at FROM chaos_deliveries",
        )
        .execute(pool)
        .await
        .map_err(db)?;
        let (copies, events, copied_again, unconfirmed): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), count(DISTINCT event_id), \
                    (SELECT count(*) FROM (SELECT FROM chaos_copies GROUP BY event_id \
                        HAVING count(*) > 1) t), \
                    (SELECT count(*) FROM chaos_events e WHERE NOT EXISTS \
                        (SELECT FROM chaos_copies c WHERE c.event_id = e.event_id)) \
             FROM chaos_copies",
        )
        .fetch_one(pool)
        .await
        .map_err(db)?;
        let left = self
            .channel
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| format!("the queue: {e}"))?
            .message_count();
        report.copies = copies;
        report.events_with_copies = events;
        report.events_copied_again = copied_again;
        report.copies_explained = format!(
            "RabbitMQ does not deduplicate: every publication that reached the queue is a \
             copy. Counted here from the confirms the relays recorded, a lower bound: a copy \
             whose confirm was lost when the connection was cut (the batch handed back as \
             unavailable and published again), or that was confirmed to a relay killed before \
             its record, is not; the consumers' count of other copies below sees those too. \
             An event is published again when its relay was killed, paused past its lease or \
             cut off before it recorded SENT ({left} copies left unconsumed at the end)"
        );
        // Every event was SENT, so some relay recorded its confirm (the sink records
        // before the relay may record SENT).
        if unconfirmed > 0 {
            report.failures.push(format!(
                "{unconfirmed} events SENT without a confirm recorded"
            ));
        }
        Ok(())
    }

    async fn teardown(self) {
        if let Err(error) = self.cleanup.run().await {
            eprintln!("broker chaos: {error}");
        }
        let mut proxy = self.proxy;
        proxy.down();
    }

    /// In a relay child: the RabbitMQ sink, on a connection that recovers by itself.
    async fn publisher() -> Result<Self::Publisher, String> {
        let (url, exchange) = (param("AMQP_URL")?, param("AMQP_EXCHANGE")?);
        let connection = connect(&url, || {
            ConnectionProperties::default().enable_auto_recover()
        })
        .await?;
        RabbitSink::new(std::sync::Arc::new(connection), exchange, ROUTING_KEY)
            .await
            .map_err(|e| format!("a channel in confirm mode: {e}"))
    }

    async fn publish(
        sink: &RabbitSink<ChaosEvent>,
        batch: &[Delivery<'_, ChaosEvent>],
    ) -> Vec<Result<Receipt, SinkError>> {
        let confirmed = sink.publish_confirmed(batch).await;
        confirmed
            .into_iter()
            .map(|confirmed| {
                confirmed.map(|_| Receipt {
                    position: 0,
                    duplicate: false,
                })
            })
            .collect()
    }

    /// In a consumer child: consumes the queue until `shutdown`, handling each message and
    /// then acknowledging it. On any error the connection is closed (RabbitMQ requeues what
    /// was unacknowledged, marked redelivered) and a new one opened.
    async fn consume(consumer: &Consumer, shutdown: &CancellationToken) -> Result<(), String> {
        let (url, queue) = (param("AMQP_URL")?, param("AMQP_QUEUE")?);
        while !shutdown.is_cancelled() {
            let connection = connect(&url, ConnectionProperties::default).await?;
            let session = session(&connection, &queue, consumer, shutdown).await;
            let _ = connection.close(200, "consumer stopping".into()).await;
            if let Err(error) = session {
                say(&format!("consumer: {error}; reconnecting"));
                sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }
}

/// Deletes `queue` and `exchange` from the server at `url`, on a connection of its own
/// (see [`Cleanup`]).
fn deleted_later(url: &str, queue: &str, exchange: &str) -> Cleanup {
    let (url, queue, exchange) = (url.to_owned(), queue.to_owned(), exchange.to_owned());
    let what = format!("the RabbitMQ exchange {exchange} and its queue {queue}");
    Cleanup::new(what, move || async move {
        let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await?;
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await?;
        connection.close(200, "deleted".into()).await?;
        Ok(())
    })
}

/// `host:port` of an AMQP URL.
fn authority(url: &str) -> Result<String, String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split('/').next().unwrap_or(rest);
    let authority = host
        .rsplit_once('@')
        .map_or(host, |(_, authority)| authority);
    if authority.contains(':') {
        Ok(authority.to_owned())
    } else {
        Err(format!("no host:port in {url}"))
    }
}

/// Connects, retrying for up to 30 s (the proxy may be down when a child starts).
async fn connect(
    url: &str,
    properties: impl Fn() -> ConnectionProperties,
) -> Result<Connection, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match Connection::connect(url, properties()).await {
            Ok(connection) => return Ok(connection),
            Err(error) if Instant::now() > deadline => {
                return Err(format!("connecting to RabbitMQ: {error}"));
            }
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn session(
    connection: &Connection,
    queue: &str,
    consumer: &Consumer,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| format!("a channel: {e}"))?;
    channel
        .basic_qos(20, BasicQosOptions::default())
        .await
        .map_err(|e| format!("basic.qos: {e}"))?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| format!("basic.consume: {e}"))?;
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            next = deliveries.next() => next,
        };
        let delivery = next
            .ok_or("the broker cancelled the consumer")?
            .map_err(|e| format!("consuming: {e}"))?;
        say("batch");
        let Some(event_id) = outbox::rabbitmq::event_id(&delivery) else {
            // Not the relay's: a bug, never skipped quietly.
            say("consumer failed: a message without an event id");
            continue;
        };
        let delivery_number = 1 + i64::from(delivery.redelivered);
        consumer
            .handle(event_id, &delivery.data, 0, delivery_number)
            .await?;
        delivery
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| format!("acknowledging: {e}"))?;
    }
}
