//! NATS JetStream end to end: the relay publishes orders through `JetStreamSink`, as
//! CloudEvents in binary mode, and a consumer applies each one exactly once with the
//! inbox.
//!
//! The consumer reads what any CloudEvents consumer reads: the `ce-` headers, `ce-id`
//! (the event id, which it deduplicates on) and `ce-type`, and the body, the order as
//! JSON.
//!
//! The consumer takes each message, applies its effect (a customer's running total) and
//! records its event id in the inbox **in one transaction**, commits, and only then
//! acknowledges the message. One message is left unacknowledged once, as if the consumer
//! had crashed between its commit and its acknowledgement: JetStream delivers it again,
//! and the inbox recognises it.
//!
//! ```text
//! cargo run --features nats --example nats_consumer   # NATS with JetStream on 127.0.0.1:4222
//! ```

mod common;

use std::time::Duration;

use common::OrderPlaced;
use common::billing;
use futures_util::StreamExt as _;
use outbox::message::CloudEvents;
use outbox::nats::async_nats::jetstream::{self, consumer, stream};
use outbox::nats::{JetStreamSink, async_nats};
use outbox::{Inbox, Received, Relay};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> Result {
    // A scratch schema, dropped at the end (on DATABASE_URL, or on a throwaway local
    // PostgreSQL when it is unset). In your application: `PgPool::connect(&database_url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();
    billing::prepare(pool).await?;

    let url = std::env::var("OUTBOX_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await.map_err(|e| {
        format!("cannot reach NATS at {url} ({e}); start it with `nats-server -js`")
    })?;
    let js = jetstream::new(client);
    // Your deployment usually owns the stream; the example makes its own. Within its
    // duplicate window JetStream stores a redelivered event once (`Nats-Msg-Id`).
    let (stream_name, subject) = (
        sandbox.name().to_uppercase(),
        format!("example.{}.orders", sandbox.name()),
    );
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: Duration::from_mins(2),
            ..Default::default()
        })
        .await?;

    // The producer: orders and their events in one transaction, the relay publishes.
    let orders = [
        billing::order("ada@example.com", 1_250),
        billing::order("bob@example.com", 900),
        billing::order("ada@example.com", 300),
    ];
    OrderPlaced::enqueue_all(&orders, pool).await?;
    let sink = JetStreamSink::<OrderPlaced>::new(js.clone(), subject.clone()).cloud_events(
        CloudEvents::binary()
            .source("https://shop.example.com/orders")
            .event_type("com.example.order.placed"),
    );
    common::publish_all(pool, Relay::<OrderPlaced, _>::new(pool.clone(), sink)).await?;
    println!("relay:    published {} orders to {subject}", orders.len());

    consume(pool, &stream, orders.len()).await?;

    billing::print_totals(pool).await?;
    js.delete_stream(&stream_name).await?;
    sandbox.drop_schema().await?;
    Ok(())
}

/// The consumer: applies each of the `expected` orders once, whatever JetStream
/// delivers, and acknowledges each message after its transaction committed.
async fn consume(pool: &sqlx::PgPool, stream: &stream::Stream, expected: usize) -> Result {
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("billing".into()),
            ack_wait: Duration::from_secs(1), // unacknowledged messages come back after 1 s
            ..Default::default()
        })
        .await?;
    let inbox = Inbox::new("billing");
    let mut crashed_once = false;
    let mut acknowledged = 0;
    while acknowledged < expected {
        let mut messages = consumer
            .fetch()
            .max_messages(10)
            .expires(Duration::from_secs(3))
            .messages()
            .await?;
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| e.to_string())?;
            // The CloudEvent's attributes (its ids and types need no percent-decoding).
            let attribute = |name: &str| {
                let headers = message.headers.as_ref()?;
                Some(headers.get(format!("ce-{name}").as_str())?.as_str())
            };
            let event_id = attribute("id").ok_or("not a CloudEvent: no ce-id")?;
            let event_type = attribute("type").ok_or("not a CloudEvent: no ce-type")?;
            assert_eq!(Some(event_id), outbox::nats::event_id(&message));
            let order: serde_json::Value = serde_json::from_slice(&message.payload)?;
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
                continue; // no ack: JetStream delivers it again after `ack_wait`
            }
            match received {
                Received::New => {
                    println!(
                        "consumer: applied {event_type} {event_id} ({customer}, {cents} cents)"
                    );
                }
                Received::Duplicate => {
                    println!("consumer: {event_id} again: already applied, acknowledged only");
                }
            }
            message.ack().await.map_err(|e| e.to_string())?;
            acknowledged += 1;
        }
    }

    Ok(())
}
