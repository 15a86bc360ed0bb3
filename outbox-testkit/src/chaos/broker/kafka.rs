//! Kafka in the broker run, through tansu (an Apache Kafka-compatible broker, one binary:
//! `OUTBOX_TANSU`, by default `${XDG_CACHE_HOME:-~/.cache}/outbox/tansu-venv/bin/tansu`,
//! where `.ci/run` installs it) of the run's own, on a free port.
//!
//! tansu keeps its topics in memory here, so a restart would lose every record: the
//! outage is every relay's and consumer's connection cut instead, as for RabbitMQ. tansu
//! advertises a proxy (`crate::proxy::Proxy`) as its address, so every client
//! connection, the bootstrap's and the partition leader's, goes through it; the driver
//! takes the proxy down and up. librdkafka reconnects by itself.
//!
//! The topic has one partition per consumer process, and consumer slot `n` is assigned
//! partition `n` (assigned, not subscribed: a consumer-group join is slow on tansu, and a
//! rebalance on every kill would be most of the run). A consumer applies a record's effect
//! with its inbox row in one PostgreSQL transaction, then commits the record's offset to
//! the broker (`commit_message`, synchronous, under a group id: offsets are committed and
//! fetched without a group join). A consumer killed between its transaction and the
//! offset commit, or whose commit the cut lost, leaves the offset behind; its successor
//! resumes from the committed offset, reads the record again and the inbox skips it.
//! (Storing the offset in PostgreSQL, in the effect's transaction, would make the
//! consumer's position exact and its re-reads disappear; this run commits to the broker,
//! as `examples/kafka_consumer.rs` does, so that the inbox has re-reads to absorb.)
//!
//! Kafka does not deduplicate across producer sessions: the idempotent producer drops its
//! own retries, but an event published again by another relay (or by the same one after
//! a failed batch) is a new record. The audit reads the whole topic back: every record is
//! a copy. Kafka has no delivery count; the consumers count their reads of each record
//! (its partition and offset), so a re-read shows as a redelivery.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use outbox::kafka::KafkaSink;
use outbox::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use outbox::kafka::rdkafka::client::DefaultClientContext;
use outbox::kafka::rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use outbox::kafka::rdkafka::message::BorrowedMessage;
use outbox::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Delivery, SinkError};
use sqlx::PgPool;
use tokio::time::{Instant, sleep, timeout};

use super::{BrokerConfig, BrokerReport, ChaosBroker, Consumer, Receipt};
use crate::chaos::say;
use crate::child;
use crate::events::ChaosEvent;
use crate::proxy::Proxy;
use crate::tansu::{Tansu, free_port};

/// The consumers' group: where their offsets are committed (no member ever joins it).
const GROUP: &str = "chaos-shipping";

fn param(name: &str) -> Result<String, String> {
    child::param(name).ok_or_else(|| format!("no {name} given"))
}

/// Where a record is: its partition and offset in one number, never 0 (the audit's "no
/// position"). An offset the delivery report does not know (negative: librdkafka's
/// `RD_KAFKA_OFFSET_INVALID`, as for a retried batch tansu answers as a duplicate of one
/// it already stored) is no position: 0, which the audit neither seeks nor checks.
fn position(partition: i32, offset: i64) -> i64 {
    if offset < 0 {
        return 0;
    }
    (i64::from(partition) << 40) + offset + 1
}

/// The partition and offset of a [`position`].
fn split(at: i64) -> (i32, i64) {
    (
        i32::try_from(at >> 40).unwrap_or(i32::MAX),
        (at & ((1 << 40) - 1)) - 1,
    )
}

/// The records read back from the topic, each position once.
#[derive(Default)]
struct Copies {
    ids: Vec<String>,
    positions: Vec<i64>,
    times: Vec<i64>,
    seen: HashSet<i64>,
}

impl Copies {
    /// Reads the given partitions from the given offsets until nothing comes for a while:
    /// 15 s while fewer than `expected` records came, else 3 s.
    async fn read(
        &mut self,
        reader: &StreamConsumer,
        topic: &str,
        from: impl Iterator<Item = (i32, Offset)>,
        expected: usize,
    ) -> Result<(), String> {
        let mut partitions = TopicPartitionList::new();
        for (partition, offset) in from {
            partitions
                .add_partition_offset(topic, partition, offset)
                .map_err(|e| e.to_string())?;
        }
        reader.assign(&partitions).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_mins(2);
        loop {
            let quiet = Duration::from_secs(if self.seen.len() < expected { 15 } else { 3 });
            let Ok(message) = timeout(quiet, reader.recv()).await else {
                return Ok(());
            };
            let message = message.map_err(|e| format!("reading the topic: {e}"))?;
            let at = position(message.partition(), message.offset());
            if self.seen.insert(at) {
                self.ids.push(
                    outbox::kafka::event_id(&message)
                        .ok_or("a record without an event id in the topic")?
                        .to_owned(),
                );
                self.positions.push(at);
                self.times
                    .push(message.timestamp().to_millis().unwrap_or(0));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "reading the topic: still reading after 2 min ({} records)",
                    self.ids.len()
                ));
            }
        }
    }
}

/// The driver's side.
pub struct Kafka {
    /// Killed when dropped, with the run, whatever ends it (an error, Ctrl-C).
    _tansu: Tansu,
    /// Where tansu listens, and the proxy every client goes through.
    port: u16,
    proxy: Proxy,
    topic: String,
    partitions: i32,
}

impl ChaosBroker for Kafka {
    type Publisher = KafkaSink<ChaosEvent>;

    async fn start(config: &BrokerConfig, schema: &TestSchema) -> Result<Self, String> {
        let port = free_port().map_err(|e| format!("a free port: {e}"))?;
        let proxy = Proxy::start(format!("127.0.0.1:{port}"))
            .await
            .map_err(|e| format!("the proxy: {e}"))?;
        let tansu = Tansu::start_advertising(port, proxy.port)
            .await
            .map_err(|e| e.to_string())?;
        let partitions = i32::try_from(config.consumers.max(1)).map_err(|e| e.to_string())?;
        let broker = Self {
            _tansu: tansu,
            port,
            proxy,
            topic: format!("outbox.chaos.{}.shipments", schema.name()),
            partitions,
        };
        broker.create_topic().await?;
        // The consumers count their reads of each record by its position.
        sqlx::query(
            "CREATE TABLE chaos_reads (broker_position bigint PRIMARY KEY, reads bigint NOT NULL)",
        )
        .execute(schema.pool())
        .await
        .map_err(|e| format!("the table of reads: {e}"))?;
        Ok(broker)
    }

    fn describe(&self) -> String {
        format!(
            "Kafka (own tansu on port {}, in memory, {} partitions, one per consumer; its \
             outages are every connection cut at a proxy on port {}, not restarts)",
            self.port, self.partitions, self.proxy.port
        )
    }

    fn params(&self) -> Vec<(String, String)> {
        vec![
            ("BROKER".into(), "kafka".into()),
            (
                "KAFKA_BROKERS".into(),
                format!("127.0.0.1:{}", self.proxy.port),
            ),
            ("KAFKA_TOPIC".into(), self.topic.clone()),
            ("KAFKA_PARTITIONS".into(), self.partitions.to_string()),
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
                "every connection to tansu cut, none accepted for {:.1}s",
                down.as_secs_f64()
            ),
        ))
    }

    /// Reads every record of the topic into `chaos_copies` and checks them against the
    /// relays' records: every acknowledged publication is in the topic.
    ///
    /// Two passes, because tansu 0.6.0's fetch is not Kafka's: a fetch at an offset inside
    /// a record batch returns the batches after it and not that batch (fixed upstream in
    /// tansu's "return the batch containing a mid-batch fetch offset"), and the fetch
    /// service advances its offset by the records it returned, which lands inside a batch
    /// wherever offsets are not contiguous (after a produce that took offsets and stored
    /// nothing). So a reader from the beginning can step over a whole batch. The first
    /// pass reads each partition from its beginning, until nothing comes for 3 s (15 s
    /// while fewer records came than the relays recorded: tansu's high watermark is not
    /// the next offset); the second seeks to every position a relay recorded that the first
    /// pass did not return, and reads from there.
    async fn audit_copies(&self, pool: &PgPool, report: &mut BrokerReport) -> Result<(), String> {
        let db = |e: sqlx::Error| format!("auditing the copies: {e}");
        let recorded: Vec<i64> = sqlx::query_scalar(
            "SELECT DISTINCT broker_position FROM chaos_deliveries \
             WHERE broker_position > 0 ORDER BY 1",
        )
        .fetch_all(pool)
        .await
        .map_err(db)?;
        let reader: StreamConsumer = self
            .client_config()
            .set("group.id", "chaos-audit")
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|e| format!("a reader of the topic: {e}"))?;
        let mut copies = Copies::default();
        let from_the_beginning = (0..self.partitions).map(|p| (p, Offset::Beginning));
        copies
            .read(&reader, &self.topic, from_the_beginning, recorded.len())
            .await?;
        for at in recorded {
            if !copies.seen.contains(&at) {
                let (partition, offset) = split(at);
                let seek = std::iter::once((partition, Offset::Offset(offset)));
                copies.read(&reader, &self.topic, seek, 0).await?;
            }
        }
        sqlx::query(
            "INSERT INTO chaos_copies (event_id, broker_position, stored_at) \
             SELECT e, p, to_timestamp(t / 1000.0) \
             FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS u(e, p, t)",
        )
        .bind(&copies.ids)
        .bind(&copies.positions)
        .bind(&copies.times)
        .execute(pool)
        .await
        .map_err(db)?;
        audit(pool, report).await
    }

    #[allow(clippy::unused_async)]
    async fn teardown(mut self) {
        self.proxy.down();
    }

    /// In a relay child: the Kafka sink (its producer's `message.timeout.ms` half the 2 s
    /// lease, the sink's default), through the proxy.
    async fn publisher() -> Result<Self::Publisher, String> {
        let (brokers, topic) = (param("KAFKA_BROKERS")?, param("KAFKA_TOPIC")?);
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", brokers);
        KafkaSink::new(&config, topic).map_err(|e| format!("the Kafka sink: {e}"))
    }

    async fn publish(
        sink: &KafkaSink<ChaosEvent>,
        batch: &[Delivery<'_, ChaosEvent>],
    ) -> Vec<Result<Receipt, SinkError>> {
        let acked = sink.publish_acked(batch).await;
        acked
            .into_iter()
            .map(|acked| {
                acked.map(|report| Receipt {
                    position: position(report.partition, report.offset),
                    duplicate: false,
                })
            })
            .collect()
    }

    /// In a consumer child: consumes partition `SLOT` (modulo the partitions) from its
    /// committed offset until `shutdown`, handling each record and then committing its
    /// offset. On any error the consumer is dropped and a new one resumes from the committed
    /// offset: what was handled and not committed is read again, and the inbox skips it.
    async fn consume(consumer: &Consumer, shutdown: &CancellationToken) -> Result<(), String> {
        let (brokers, topic) = (param("KAFKA_BROKERS")?, param("KAFKA_TOPIC")?);
        let partitions: i32 = param("KAFKA_PARTITIONS")?
            .parse()
            .map_err(|e| format!("KAFKA_PARTITIONS: {e}"))?;
        let slot: i32 = param("SLOT")?.parse().map_err(|e| format!("SLOT: {e}"))?;
        let partition = slot % partitions.max(1);
        while !shutdown.is_cancelled() {
            let reader: StreamConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", GROUP)
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", "earliest")
                .create()
                .map_err(|e| format!("a consumer: {e}"))?;
            let mut assigned = TopicPartitionList::new();
            assigned
                .add_partition_offset(&topic, partition, Offset::Stored)
                .map_err(|e| e.to_string())?;
            reader
                .assign(&assigned)
                .map_err(|e| format!("assign: {e}"))?;
            if let Err(error) = session(&reader, consumer, shutdown).await {
                say(&format!(
                    "consumer: {error}; resuming from the committed offset"
                ));
                sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }
}

impl Kafka {
    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", format!("127.0.0.1:{}", self.port));
        config
    }

    async fn create_topic(&self) -> Result<(), String> {
        let admin: AdminClient<DefaultClientContext> = self
            .client_config()
            .create()
            .map_err(|e| format!("an admin client: {e}"))?;
        let created = admin
            .create_topics(
                &[NewTopic::new(
                    &self.topic,
                    self.partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(|e| format!("creating the topic: {e}"))?;
        for result in created {
            result.map_err(|(topic, code)| format!("creating topic {topic}: {code}"))?;
        }
        Ok(())
    }
}

/// Kafka's side of the audit, on `chaos_copies` and the relays' records.
async fn audit(pool: &PgPool, report: &mut BrokerReport) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("auditing the copies: {e}");
    let (copies, events, copied_again, unrecorded): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), \
                (SELECT count(*) FROM (SELECT FROM chaos_copies GROUP BY event_id \
                    HAVING count(*) > 1) t), \
                count(*) FILTER (WHERE NOT EXISTS (SELECT FROM chaos_deliveries d \
                    WHERE d.broker_position = c.broker_position)) \
         FROM chaos_copies c",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    let (acked, unplaced, acked_missing, wrong_event, lost_events): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE d.broker_position = 0), \
                count(*) FILTER (WHERE d.broker_position > 0 AND NOT EXISTS \
                    (SELECT FROM chaos_copies c WHERE c.broker_position = d.broker_position)), \
                count(*) FILTER (WHERE EXISTS (SELECT FROM chaos_copies c \
                    WHERE c.broker_position = d.broker_position AND c.event_id <> d.event_id)), \
                (SELECT count(*) FROM chaos_events e WHERE NOT EXISTS \
                    (SELECT FROM chaos_copies c WHERE c.event_id = e.event_id)) \
         FROM chaos_deliveries d",
        )
        .fetch_one(pool)
        .await
        .map_err(db)?;
    report.copies = copies;
    report.events_with_copies = events;
    report.events_copied_again = copied_again;
    report.copies_explained = format!(
        "Kafka does not deduplicate across producer sessions (the idempotent producer drops \
         only its own retries): an event published again, after its relay was killed, paused \
         past its lease or cut off before it recorded SENT, is a new record. All {copies} \
         records read back from the topic; {acked} delivery reports the relays recorded ({unplaced} without an offset); \
         {unrecorded} records at a position no relay recorded (acknowledged to a relay \
         killed before its record, or whose delivery report the cut lost). The consumers \
         count their own reads of a record (Kafka has no delivery count): a re-read after a \
         consumer died before its offset commit is a redelivery"
    );
    // Where the delivery reports put a record, checked against the topic read back. On
    // tansu some do not match (a report's offset holding another event's record, or none):
    // reported, not failed, since what the audit guarantees is the event's record, checked
    // above and below; with a real Kafka every report should match.
    if acked_missing + wrong_event > 0 {
        let sample: Option<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT d.event_id, d.broker_position, c.event_id FROM chaos_deliveries d \
             LEFT JOIN chaos_copies c USING (broker_position) \
             WHERE c.event_id IS DISTINCT FROM d.event_id ORDER BY d.delivered_at LIMIT 1",
        )
        .fetch_optional(pool)
        .await
        .map_err(db)?;
        let sample = sample.map_or_else(String::new, |(event, at, found)| {
            let (partition, offset) = split(at);
            format!(
                ", e.g. {event} reported at partition {partition} offset {offset}, where the \
                 topic holds {}",
                found.as_deref().unwrap_or("nothing")
            )
        });
        let _ = write!(
            report.copies_explained,
            ". NOTE: of the delivery reports the relays recorded, {wrong_event} give an offset \
             holding another event's record and {acked_missing} an offset holding none{sample}: \
             tansu's reported offsets are not always where it stored the record (its high \
             watermark is not the next offset either); every event's own record is in the topic"
        );
    }
    if lost_events > 0 {
        report.failures.push(lost(pool, lost_events).await?);
    }
    // Every event acknowledged to a relay has a record (the delivery reports' offsets
    // aside, above).
    let acked_lost: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT event_id) FROM chaos_deliveries d WHERE NOT EXISTS \
             (SELECT FROM chaos_copies c WHERE c.event_id = d.event_id)",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    if acked_lost > 0 {
        report.failures.push(format!(
            "{acked_lost} events Kafka acknowledged have no record in the topic"
        ));
    }
    Ok(())
}

/// The failure of `count` events with no record in the topic read back: where the
/// consumers read them, and what the read-back holds there.
async fn lost(pool: &PgPool, count: i64) -> Result<String, String> {
    let seen: Vec<(String, i64, Option<String>)> = sqlx::query_as(
        "SELECT DISTINCT ON (e.event_id) e.event_id, c.broker_position, k.event_id \
         FROM chaos_events e JOIN chaos_consumed c USING (event_id) \
         LEFT JOIN chaos_copies k ON k.broker_position = c.broker_position \
         WHERE NOT EXISTS (SELECT FROM chaos_copies x WHERE x.event_id = e.event_id) \
         ORDER BY e.event_id, c.consumed_at LIMIT 3",
    )
    .fetch_all(pool)
    .await
    .map_err(|e| format!("auditing the copies: {e}"))?;
    let seen: Vec<String> = seen
        .into_iter()
        .map(|(event, at, found)| {
            let (partition, offset) = split(at);
            format!(
                "{event} consumed at partition {partition} offset {offset}, where the \
                 read-back holds {}",
                found.as_deref().unwrap_or("nothing")
            )
        })
        .collect();
    Ok(format!(
        "{count} events have no record in the topic read back ({})",
        if seen.is_empty() {
            "no consumer read them either".to_owned()
        } else {
            seen.join("; ")
        }
    ))
}

async fn session(
    reader: &StreamConsumer,
    consumer: &Consumer,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    loop {
        let message = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            message = reader.recv() => message.map_err(|e| format!("consuming: {e}"))?,
        };
        say("batch");
        handle(reader, &message, consumer).await?;
    }
}

async fn handle(
    reader: &StreamConsumer,
    message: &BorrowedMessage<'_>,
    consumer: &Consumer,
) -> Result<(), String> {
    let at = position(message.partition(), message.offset());
    let Some(event_id) = outbox::kafka::event_id(message) else {
        // Not the relay's: a bug, never skipped quietly.
        say(&format!("consumer failed: record {at} has no event id"));
        return Ok(());
    };
    // Kafka counts no deliveries: the consumers count their reads of the record, each
    // read its own number (two consumers reading it at once after a rebalance get 1 and
    // 2), as JetStream numbers its deliveries.
    let read: i64 = sqlx::query_scalar(
        "INSERT INTO chaos_reads VALUES ($1, 1) ON CONFLICT (broker_position) \
         DO UPDATE SET reads = chaos_reads.reads + 1 RETURNING reads",
    )
    .bind(at)
    .fetch_one(&consumer.pool)
    .await
    .map_err(|e| format!("counting the reads of {event_id}: {e}"))?;
    consumer
        .handle(event_id, message.payload().unwrap_or_default(), at, read)
        .await?;
    // Only now: a consumer killed before this commit leaves the offset behind, and its
    // successor reads the record again.
    tokio::task::block_in_place(|| reader.commit_message(message, CommitMode::Sync))
        .map_err(|e| format!("committing the offset of {event_id}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::{position, split};

    #[test]
    fn a_position_splits_back_into_its_partition_and_offset() {
        for (partition, offset) in [(0, 0), (0, 41), (1, 0), (7, (1 << 40) - 2)] {
            assert_eq!(split(position(partition, offset)), (partition, offset));
        }
    }

    /// A delivery report that knows no offset (librdkafka's -1 or -1001) once made the
    /// audit seek to offset -1, which the client refuses: it is no position at all.
    #[test]
    fn an_offset_the_report_does_not_know_is_no_position() {
        for partition in [0, 1, 5] {
            assert_eq!(position(partition, -1), 0);
            assert_eq!(position(partition, -1001), 0);
        }
    }
}
