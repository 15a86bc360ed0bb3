//! RabbitMQ end to end: the relay publishes orders through `RabbitSink`, and a consumer
//! applies each one exactly once with the inbox.
//!
//! The consumer takes each message, applies its effect (a customer's running total) and
//! records its event id in the inbox **in one transaction**, commits, and only then
//! acknowledges the message. Once, it closes its channel instead of acknowledging, as if
//! it had crashed between its commit and its acknowledgement: RabbitMQ requeues the
//! message (marked redelivered) and delivers it again, and the inbox recognises it.
//! RabbitMQ does not deduplicate, so a relay's redelivery would arrive the same way.
//!
//! ```text
//! cargo run --features rabbitmq --example rabbitmq_consumer   # RabbitMQ on 127.0.0.1:5672, guest/guest
//! ```

mod common;

use common::OrderPlaced;
use common::billing;
use futures_util::StreamExt as _;
use outbox::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
    ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use outbox::rabbitmq::lapin::types::FieldTable;
use outbox::rabbitmq::{RabbitSink, lapin};
use outbox::{Inbox, Received, Relay};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

const ROUTING_KEY: &str = "orders.placed";

#[tokio::main]
async fn main() -> Result {
    // A scratch schema, dropped at the end (on DATABASE_URL, or on a throwaway local
    // PostgreSQL when it is unset). In your application: `PgPool::connect(&database_url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();
    billing::prepare(pool).await?;

    let url = std::env::var("OUTBOX_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let connection = lapin::Connection::connect(
        &url,
        lapin::ConnectionProperties::default().enable_auto_recover(),
    )
    .await
    .map(std::sync::Arc::new)
    .map_err(|e| {
        format!(
            "cannot reach RabbitMQ at {url} ({e}); start it with `service rabbitmq-server start`"
        )
    })?;
    // Your deployment usually owns the exchange and the queue; the example declares its
    // own, and deletes them at the end.
    let (exchange, queue) = (
        format!("example.{}", sandbox.name()),
        format!("example.{}.orders", sandbox.name()),
    );
    let channel = connection.create_channel().await?;
    declare(&channel, &exchange, &queue).await?;

    // The producer: orders and their events in one transaction, the relay publishes.
    let orders = [
        billing::order("ada@example.com", 1_250),
        billing::order("bob@example.com", 900),
        billing::order("ada@example.com", 300),
    ];
    OrderPlaced::enqueue_all(&orders, pool).await?;
    let sink = RabbitSink::<OrderPlaced>::new(
        std::sync::Arc::clone(&connection),
        exchange.clone(),
        ROUTING_KEY,
    )
    .await?;
    common::publish_all(pool, Relay::<OrderPlaced, _>::new(pool.clone(), sink)).await?;
    println!(
        "relay:    published {} orders to exchange {exchange}",
        orders.len()
    );

    consume(pool, &connection, &queue, orders.len()).await?;

    billing::print_totals(pool).await?;
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    sandbox.drop_schema().await?;
    Ok(())
}

/// The exchange, and a durable queue bound to it with the relay's routing key.
async fn declare(channel: &lapin::Channel, exchange: &str, queue: &str) -> Result {
    channel
        .exchange_declare(
            exchange.into(),
            lapin::ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            ROUTING_KEY.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// The consumer: applies each of the `expected` orders once, whatever RabbitMQ
/// delivers, and acknowledges each message after its transaction committed.
async fn consume(
    pool: &sqlx::PgPool,
    connection: &lapin::Connection,
    queue: &str,
    expected: usize,
) -> Result {
    let inbox = Inbox::new("billing");
    let mut crashed_once = false;
    let mut acknowledged = 0;
    'channels: while acknowledged < expected {
        let channel = connection.create_channel().await?;
        // One unacknowledged message at a time: the "crash" below requeues just it.
        channel.basic_qos(1, BasicQosOptions::default()).await?;
        let mut deliveries = channel
            .basic_consume(
                queue.into(),
                "billing".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        while let Some(delivery) = deliveries.next().await {
            let delivery = delivery?;
            let event_id = outbox::rabbitmq::event_id(&delivery).ok_or("no event id")?;
            let order: serde_json::Value = serde_json::from_slice(&delivery.data)?;
            let (customer, cents) = (
                order["customer"].as_str().ok_or("no customer")?,
                order["total_cents"].as_i64().ok_or("no total")?,
            );

            // The effect and the inbox row: one transaction.
            let mut tx = pool.begin().await?;
            let received = inbox.receive(&mut tx, event_id).await?;
            if received == Received::New {
                billing::add_to_totals(&mut tx, customer, cents).await?;
            }
            tx.commit().await?;

            if received == Received::New && !crashed_once {
                crashed_once = true;
                println!(
                    "consumer: applied {event_id} ({customer}, {cents} cents), then crashed before acknowledging it"
                );
                // No ack, and the channel goes: RabbitMQ requeues the message.
                channel.close(200, "crashed".into()).await?;
                continue 'channels;
            }
            match received {
                Received::New => {
                    println!("consumer: applied {event_id} ({customer}, {cents} cents)");
                }
                Received::Duplicate => println!(
                    "consumer: {event_id} again (redelivered: {}): already applied, acknowledged only",
                    delivery.redelivered
                ),
            }
            delivery.ack(BasicAckOptions::default()).await?;
            acknowledged += 1;
            if acknowledged == expected {
                break 'channels;
            }
        }
        return Err("RabbitMQ cancelled the consumer".into());
    }
    Ok(())
}
