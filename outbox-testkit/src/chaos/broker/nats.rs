//! NATS JetStream in the broker run: a `nats-server -js` of the run's own
//! (`crate::nats_server`), file storage, killed (SIGKILL or SIGTERM) and restarted on
//! the same port and directory; one stream, one durable pull consumer shared by the
//! consumer processes.

use std::time::Duration;

use futures_util::StreamExt as _;
use outbox::nats::async_nats::jetstream::{self, consumer, stream};
use outbox::nats::{JetStreamSink, async_nats};
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Delivery, SinkError};
use sqlx::PgPool;
use tokio::time::sleep;

use super::{BrokerConfig, BrokerReport, ChaosBroker, Consumer, Receipt, audited};
use crate::chaos::say;
use crate::child;
use crate::events::ChaosEvent;
use crate::nats_server::{NatsServer, Stop};

/// The durable consumer the consumer processes share.
const DURABLE: &str = "chaos-shipping";

/// A client that keeps trying: a child started while the server is down connects once
/// it is back, and every reconnect comes within half a second of the server's return.
async fn client(url: &str) -> Result<async_nats::Client, String> {
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis(u64::try_from(attempts).unwrap_or(5).min(5) * 100)
        })
        .connect(url)
        .await
        .map_err(|e| format!("connecting to NATS at {url}: {e}"))
}

fn param(name: &str) -> Result<String, String> {
    child::param(name).ok_or_else(|| format!("no {name} given"))
}

/// The driver's side.
pub struct Nats {
    server: NatsServer,
    js: jetstream::Context,
    stream: String,
    subject: String,
    window: Duration,
}

impl ChaosBroker for Nats {
    type Publisher = JetStreamSink<ChaosEvent>;

    async fn start(config: &BrokerConfig, schema: &TestSchema) -> Result<Self, String> {
        let server = tokio::task::block_in_place(|| NatsServer::start(&[]))?;
        let js = jetstream::new(client(&server.url()).await?);
        let (stream, subject) = (
            schema.name().to_uppercase(),
            format!("chaos.{}.shipments", schema.name()),
        );
        let created = js
            .create_stream(stream::Config {
                name: stream.clone(),
                subjects: vec![subject.clone()],
                storage: stream::StorageType::File,
                duplicate_window: config.duplicate_window,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating the stream: {e}"))?;
        created
            .create_consumer(consumer::pull::Config {
                durable_name: Some(DURABLE.into()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating the consumer: {e}"))?;
        Ok(Self {
            server,
            js,
            stream,
            subject,
            window: config.duplicate_window,
        })
    }

    fn describe(&self) -> String {
        format!(
            "NATS JetStream (own nats-server on port {}, file storage, duplicate window {:?})",
            self.server.port(),
            self.window
        )
    }

    fn params(&self) -> Vec<(String, String)> {
        vec![
            ("BROKER".into(), "nats".into()),
            ("NATS_URL".into(), self.server.url()),
            ("NATS_STREAM".into(), self.stream.clone()),
            ("NATS_SUBJECT".into(), self.subject.clone()),
        ]
    }

    /// Kills the server (SIGKILL, every other time SIGTERM), leaves it down a moment,
    /// and starts it again on its port and directory.
    async fn outage(&mut self, rng: &mut fastrand::Rng) -> Result<(&'static str, String), String> {
        let how = if self.server.starts % 2 == 1 {
            Stop::Kill
        } else {
            Stop::Term
        };
        tokio::task::block_in_place(|| self.server.down(how))?;
        let down = Duration::from_millis(rng.u64(200..1_500));
        sleep(down).await;
        tokio::task::block_in_place(|| self.server.up())?;
        let (kind, killed) = match how {
            Stop::Kill => ("SIGKILL restart", "SIGKILLed"),
            Stop::Term => ("SIGTERM restart", "SIGTERMed"),
        };
        Ok((
            kind,
            format!(
                "nats-server {killed} and restarted after {:.1}s down",
                down.as_secs_f64()
            ),
        ))
    }

    /// Reads every message of the stream into `chaos_copies`, and checks the copies
    /// against JetStream's promise: an acknowledged publication is in the stream, and a
    /// second copy of an event is stored only outside the duplicate window of the first.
    async fn audit_copies(&self, pool: &PgPool, report: &mut BrokerReport) -> Result<(), String> {
        let mut stream = self
            .js
            .get_stream(&self.stream)
            .await
            .map_err(|e| format!("the stream: {e}"))?;
        let stored = stream
            .info()
            .await
            .map_err(|e| format!("the stream's info: {e}"))?
            .state
            .messages;
        // Every message, once, unacknowledged: a reader, not a consumer.
        let reader = stream
            .create_consumer(consumer::pull::Config {
                ack_policy: consumer::AckPolicy::None,
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("a reader of the stream: {e}"))?;
        let (mut ids, mut positions, mut times) = (Vec::new(), Vec::new(), Vec::new());
        while (ids.len() as u64) < stored {
            let mut batch = reader
                .fetch()
                .max_messages(500)
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .map_err(|e| format!("reading the stream: {e}"))?;
            let before = ids.len();
            while let Some(message) = batch.next().await {
                let message = message.map_err(|e| format!("reading the stream: {e}"))?;
                let info = message.info().map_err(|e| e.to_string())?;
                ids.push(
                    outbox::nats::event_id(&message)
                        .ok_or("a message without an event id in the stream")?
                        .to_owned(),
                );
                positions.push(i64::try_from(info.stream_sequence).unwrap_or(i64::MAX));
                // The client's date-time type, which sqlx binds as a timestamptz.
                times.push(info.published);
            }
            if ids.len() == before {
                return Err(format!(
                    "the stream holds {stored} messages; only {before} could be read"
                ));
            }
        }
        sqlx::query(
            "INSERT INTO chaos_copies (event_id, broker_position, stored_at) \
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::timestamptz[])",
        )
        .bind(&ids)
        .bind(&positions)
        .bind(&times)
        .execute(pool)
        .await
        .map_err(|e| format!("recording the copies: {e}"))?;
        audit(pool, self.window, report).await
    }

    async fn teardown(self) {
        let _ = self.js.delete_stream(&self.stream).await;
        // Dropping the server kills it and deletes its directory.
        drop(self.server);
    }

    /// In a relay child: the JetStream sink, on a client that keeps reconnecting.
    async fn publisher() -> Result<Self::Publisher, String> {
        let (url, subject) = (param("NATS_URL")?, param("NATS_SUBJECT")?);
        Ok(JetStreamSink::new(
            jetstream::new(client(&url).await?),
            subject,
        ))
    }

    async fn publish(
        sink: &JetStreamSink<ChaosEvent>,
        batch: &[Delivery<'_, ChaosEvent>],
    ) -> Vec<Result<Receipt, SinkError>> {
        let acked = sink.publish_acked(batch).await;
        acked
            .into_iter()
            .map(|acked| {
                acked.map(|ack| Receipt {
                    position: i64::try_from(ack.sequence).unwrap_or(i64::MAX),
                    duplicate: ack.duplicate,
                })
            })
            .collect()
    }

    /// In a consumer child: pulls from the shared durable consumer until `shutdown`,
    /// handling each message and then acknowledging it. Errors (the server away, a
    /// session terminated) leave the message unacknowledged, to be redelivered after the
    /// acknowledgement deadline; the loop carries on.
    async fn consume(consumer: &Consumer, shutdown: &CancellationToken) -> Result<(), String> {
        let (url, stream) = (param("NATS_URL")?, param("NATS_STREAM")?);
        let js = jetstream::new(client(&url).await?);
        while !shutdown.is_cancelled() {
            // Not there while the server is down or still recovering its streams.
            let Ok(pull) = js
                .get_consumer_from_stream::<consumer::pull::Config, _, _>(DURABLE, &stream)
                .await
            else {
                sleep(Duration::from_millis(100)).await;
                continue;
            };
            if let Err(error) = pull_batches(&pull, consumer, shutdown).await {
                say(&format!("consumer: {error}; pulling again"));
                sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

/// JetStream's side of the audit, on `chaos_copies` and the relays' records.
async fn audit(pool: &PgPool, window: Duration, report: &mut BrokerReport) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("auditing the copies: {e}");
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    let (copies, events, copied_again, extra, inside_window, min_gap_ms): (
        i64,
        i64,
        i64,
        i64,
        i64,
        Option<f64>,
    ) = sqlx::query_as(
        "WITH gaps AS (SELECT event_id, stored_at - lag(stored_at) OVER \
             (PARTITION BY event_id ORDER BY broker_position) AS gap FROM chaos_copies) \
         SELECT count(*), count(DISTINCT event_id), \
                (SELECT count(*) FROM (SELECT FROM chaos_copies GROUP BY event_id \
                    HAVING count(*) > 1) t), \
                count(gap), \
                count(*) FILTER (WHERE gap < $1 * interval '1 millisecond'), \
                (extract(epoch FROM min(gap)) * 1000)::float8 \
         FROM gaps",
    )
    .bind(window_ms)
    .fetch_one(pool)
    .await
    .map_err(db)?;
    let (acked_duplicates, acked_missing, lost_events): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE duplicate), \
                count(*) FILTER (WHERE NOT duplicate AND NOT EXISTS (SELECT FROM chaos_copies c \
                    WHERE c.broker_position = d.broker_position AND c.event_id = d.event_id)), \
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
    report.acked_duplicates = acked_duplicates;
    report.copies_explained = if extra == 0 {
        format!(
            "none: every redelivery came within the {window:?} duplicate window, and \
             JetStream stored it once ({acked_duplicates} publications acknowledged as \
             duplicates)"
        )
    } else {
        format!(
            "{extra} extra copies, each stored at least {:.1}s after the event's previous \
             copy, outside the {window:?} duplicate window (a redelivery after a lease \
             expiry or a relay's pause); {acked_duplicates} redeliveries inside the window \
             were acknowledged as duplicates and stored once",
            min_gap_ms.unwrap_or(0.0) / 1000.0
        )
    };
    if lost_events > 0 {
        report
            .failures
            .push(format!("{lost_events} events have no copy in the stream"));
    }
    if acked_missing > 0 {
        report.failures.push(format!(
            "{acked_missing} publications JetStream acknowledged (not as duplicates) are not \
             in the stream"
        ));
    }
    if inside_window > 0 {
        report.failures.push(format!(
            "{inside_window} copies stored within the {window:?} duplicate window of the \
             event's previous copy"
        ));
    }
    Ok(())
}

async fn pull_batches(
    pull: &consumer::PullConsumer,
    consumer: &Consumer,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    while !shutdown.is_cancelled() {
        let mut batch = pull
            .fetch()
            .max_messages(20)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .map_err(|e| format!("fetching: {e}"))?;
        let mut announced = false;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| format!("fetching: {e}"))?;
            if !announced {
                say("batch");
                announced = true;
            }
            let info = message
                .info()
                .map_err(|e| format!("a message's info: {e}"))?;
            let (position, delivery) = (
                i64::try_from(info.stream_sequence).unwrap_or(i64::MAX),
                info.delivered,
            );
            let Some(event_id) = outbox::nats::event_id(&message) else {
                // Not the relay's: a bug, never skipped quietly.
                say(&format!(
                    "consumer failed: message {position} has no event id"
                ));
                continue;
            };
            consumer
                .handle(event_id, &message.payload, position, delivery)
                .await?;
            message
                .ack()
                .await
                .map_err(|e| format!("acknowledging: {e}"))?;
        }
    }
    Ok(())
}

/// JetStream's behaviour behind the audit's "handled late", made to happen once, in
/// order: a consumer holds a first delivery past its acknowledgement deadline, the
/// broker redelivers the message to another consumer, which applies it, and then the
/// first handles its copy (the inbox skips it). Returns the audit's explanation of the
/// duplicate, and its failures.
pub async fn first_delivery_handled_after_its_redelivery() -> Result<BrokerReport, String> {
    audited(&[], async |pool: &PgPool| {
        handled_late(&Consumer::new(pool.clone())).await
    })
    .await
}

/// The audit's "handled late", in order, on a `nats-server` of its own: one event's
/// message is delivered to a consumer, which holds it unacknowledged past the
/// acknowledgement deadline; the broker redelivers it (delivery count 2), and that
/// delivery is applied; only then is the held first delivery (count 1) handled, and the
/// inbox skips it. Each step waits for the broker, never for a guessed time.
async fn handled_late(consumer: &Consumer) -> Result<(), String> {
    let server = tokio::task::block_in_place(|| NatsServer::start(&[]))?;
    let js = jetstream::new(client(&server.url()).await?);
    let (stream, subject) = ("LATE", "late.shipments");
    let created = js
        .create_stream(stream::Config {
            name: stream.into(),
            subjects: vec![subject.into()],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("creating the stream: {e}"))?;
    let pull = created
        .create_consumer(consumer::pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_millis(500),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("creating the consumer: {e}"))?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(outbox::message::header::EVENT_ID, "late-1");
    js.publish_with_headers(subject, headers, r#"{"order_seq": 1}"#.into())
        .await
        .map_err(|e| format!("publishing: {e}"))?
        .await
        .map_err(|e| format!("the publication's acknowledgement: {e}"))?;

    let next = async || -> Result<jetstream::Message, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < deadline {
            let mut batch = pull
                .fetch()
                .max_messages(1)
                .expires(Duration::from_secs(2))
                .messages()
                .await
                .map_err(|e| format!("fetching: {e}"))?;
            if let Some(message) = batch.next().await {
                return message.map_err(|e| format!("fetching: {e}"));
            }
        }
        Err("no delivery within 30 s".to_owned())
    };
    let held = next().await?;
    // Not acknowledged: the next delivery is the broker's redelivery, once the
    // acknowledgement deadline passed.
    let redelivered = next().await?;
    let (first, second) = (
        held.info().map_err(|e| e.to_string())?,
        redelivered.info().map_err(|e| e.to_string())?,
    );
    if (first.stream_sequence, first.delivered, second.delivered) != (second.stream_sequence, 1, 2)
    {
        return Err(format!(
            "expected the message at {} delivered twice (1, then 2), got {} at {}",
            first.stream_sequence, second.delivered, second.stream_sequence
        ));
    }
    let position = i64::try_from(first.stream_sequence).map_err(|e| e.to_string())?;
    for (message, delivery) in [(&redelivered, second.delivered), (&held, first.delivered)] {
        let event_id = outbox::nats::event_id(message).ok_or("no event id")?;
        consumer
            .handle(event_id, &message.payload, position, delivery)
            .await?;
        message
            .ack()
            .await
            .map_err(|e| format!("acknowledging: {e}"))?;
    }
    let _ = js.delete_stream(stream).await;
    drop(server);
    Ok(())
}
