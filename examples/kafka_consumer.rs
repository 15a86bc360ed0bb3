//! Kafka end to end: the relay publishes orders through `KafkaSink`, and a consumer
//! applies each one exactly once with the inbox.
//!
//! The consumer reads its partition (assigned, no group rebalance), applies each
//! record's effect (a customer's running total) and records its event id in the inbox
//! **in one transaction**, commits, and only then commits the record's offset. The first
//! consumer stops after its first record without committing the offset, as if it had
//! crashed between its transaction and its offset commit: the next one starts again from
//! the committed offset, reads that record again, and the inbox recognises it.
//!
//! ```text
//! cargo run --features kafka --example kafka_consumer   # a Kafka broker on 127.0.0.1:9092
//! ```
//!
//! `OUTBOX_KAFKA_BROKERS` names other brokers. Any Kafka-compatible broker will do, e.g.
//! tansu (`tansu broker --listener-url tcp://127.0.0.1:9092 --advertised-listener-url
//! tcp://127.0.0.1:9092`).

mod common;

use std::time::Duration;

use common::OrderPlaced;
use common::billing;
use outbox::kafka::KafkaSink;
use outbox::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox::kafka::rdkafka::client::DefaultClientContext;
use outbox::kafka::rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use outbox::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use outbox::{Inbox, Received, Relay};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// The consumer's group: where its offsets are committed.
const GROUP: &str = "billing";

#[tokio::main]
async fn main() -> Result {
    // A scratch schema, dropped at the end (on DATABASE_URL, or on a throwaway local
    // PostgreSQL when it is unset). In your application: `PgPool::connect(&database_url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();
    billing::prepare(pool).await?;

    let brokers = std::env::var("OUTBOX_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers); // and your TLS, SASL
    // Your deployment usually owns the topic; the example makes its own.
    let topic = format!("example.{}.orders", sandbox.name());
    create_topic(&config, &topic)
        .await
        .map_err(|e| format!("cannot create a topic on Kafka at {brokers}: {e}"))?;

    // The producer: orders and their events in one transaction, the relay publishes.
    let orders = [
        billing::order("ada@example.com", 1_250),
        billing::order("bob@example.com", 900),
        billing::order("ada@example.com", 300),
    ];
    OrderPlaced::enqueue_all(&orders, pool).await?;
    let sink = KafkaSink::<OrderPlaced>::new(&config, topic.clone())?;
    common::publish_all(pool, Relay::<OrderPlaced, _>::new(pool.clone(), sink)).await?;
    println!("relay:    published {} orders to {topic}", orders.len());

    let inbox = Inbox::new(GROUP);
    // The first consumer "crashes" after its first record; the second resumes from the
    // committed offset.
    let read = consume(pool, &inbox, &config, &topic, Some(1)).await?;
    let read = read + consume(pool, &inbox, &config, &topic, None).await?;
    if read != orders.len() + 1 {
        return Err(
            format!("read {read} records, not the 3 orders and the crashed one again").into(),
        );
    }

    billing::print_totals(pool).await?;
    sandbox.drop_schema().await?;
    Ok(())
}

async fn create_topic(config: &ClientConfig, topic: &str) -> Result {
    let admin: AdminClient<DefaultClientContext> = config.create()?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    for created in admin.create_topics(&[new], &options).await? {
        created.map_err(|(topic, code)| format!("creating {topic}: {code}"))?;
    }
    Ok(())
}

/// A consumer of partition 0 of `topic`, from its group's committed offset (the start
/// when there is none): applies each record once, whatever it reads, and commits each
/// record's offset after its transaction. With `crash_after`, stops after that many
/// records without committing the last offset; else reads until the partition is quiet
/// for 3 s. Returns how many records it read.
async fn consume(
    pool: &sqlx::PgPool,
    inbox: &Inbox,
    config: &ClientConfig,
    topic: &str,
    crash_after: Option<usize>,
) -> Result<usize> {
    let consumer: StreamConsumer = config
        .clone()
        .set("group.id", GROUP)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    let mut partitions = TopicPartitionList::new();
    partitions.add_partition_offset(topic, 0, Offset::Stored)?;
    consumer.assign(&partitions)?;
    let mut read = 0;
    while let Ok(message) = tokio::time::timeout(Duration::from_secs(3), consumer.recv()).await {
        let message = message?;
        read += 1;
        let event_id = outbox::kafka::event_id(&message).ok_or("no event id")?;
        let order: serde_json::Value =
            serde_json::from_slice(message.payload().unwrap_or_default())?;
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

        if crash_after == Some(read) {
            println!(
                "consumer: applied {event_id} ({customer}, {cents} cents), then crashed before committing its offset"
            );
            return Ok(read); // the offset stays uncommitted: the next consumer reads it again
        }
        match received {
            Received::New => {
                println!("consumer: applied {event_id} ({customer}, {cents} cents)");
            }
            Received::Duplicate => {
                println!("consumer: {event_id} again: already applied, offset committed only");
            }
        }
        consumer.commit_message(&message, CommitMode::Sync)?;
    }
    Ok(read)
}
