//! The JetStream sink through real NATS JetStream and real PostgreSQL.
//!
//! - The seed's broker-level test (`redeliver`): a relay process publishes a batch,
//!   JetStream acknowledges it, and the process is SIGKILLed before it records `SENT`.
//!   The lease expires, a second relay publishes the batch again: the same event ids
//!   under a higher generation, which JetStream stores once (its acknowledgement marked
//!   duplicate, reported as published). A consumer that applies each event through the
//!   inbox, and sees every event more than once, applies each effect exactly once.
//! - Bad input: an event that does not encode, a subject no stream takes, a message over
//!   the stream's size limit: each `DEAD` with its reason, the others sent.
//! - An outage: the client loses its server (a proxy in between is stopped); batches go
//!   back without counting attempts until it reconnects, then everything is sent.
//! - Wrong credentials (a server of the test's own, with a user and a password): refused
//!   at connect with a typed error; a client told to keep retrying leaves the sink
//!   unavailable, so nothing is counted or `DEAD` until the right credentials come. The
//!   same when the credentials are revoked under a connected client (the server restarts
//!   with another password) and restored later.
//! - Server restarts under load (a server of the test's own, SIGTERMed and SIGKILLed while
//!   a relay publishes): nothing goes `DEAD`, everything is sent.
//!
//! Needs NATS with JetStream on 127.0.0.1:4222 (or `OUTBOX_NATS_URL`); without it the
//! tests fail, saying how to start it.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt as _;
use outbox::Outbox;
use outbox::message::header;
use outbox::nats::async_nats::jetstream::context::GetStreamErrorKind;
use outbox::nats::async_nats::jetstream::{self, consumer, stream};
use outbox::nats::{JetStreamSink, async_nats};
use outbox::testing::TestSchema;
use outbox::{Delivery, Relay, Sink, SinkError};
use outbox::{Inbox, Received, inbox};
use outbox_testkit::broker::{self, RefuseUnencodable};
use outbox_testkit::child::{self, ChildCommand};
use outbox_testkit::cleanup::Cleanup;
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{ChaosEvent, OrderStep};
use outbox_testkit::nats_server::{NatsServer, Stop};
use outbox_testkit::proxy::Proxy;
use outbox_testkit::rows::{enqueue, row_of};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;
use tokio::time::timeout;

const ROLE: &str = "nats-relay";
/// Marks the child's protocol lines.
const MARK: &str = "NATS-CHILD";

fn nats_url() -> String {
    std::env::var("OUTBOX_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// The test's NATS client; fails the test, saying how to start NATS, when there is none.
async fn connect_nats() -> async_nats::Client {
    let url = nats_url();
    let connected = timeout(
        Duration::from_secs(5),
        async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(3))
            .connect(&url),
    )
    .await;
    match connected {
        Ok(Ok(client)) => client,
        Ok(Err(error)) => panic!(
            "NATS is not reachable at {url}: {error}. This test needs NATS with JetStream: start it \
             with `nats-server -js -a 127.0.0.1 -p 4222` (or point OUTBOX_NATS_URL at one)"
        ),
        Err(elapsed) => panic!(
            "NATS did not answer at {url}: {elapsed}. This test needs NATS with JetStream: start it \
             with `nats-server -js -a 127.0.0.1 -p 4222` (or point OUTBOX_NATS_URL at one)"
        ),
    }
}

/// The relay process: re-executed by the test, it publishes through JetStream and dies
/// by SIGKILL once the broker acknowledged its first batch. A no-op in a normal run.
#[test]
fn nats_redeliver_child() {
    if !child::requested(ROLE) {
        return;
    }
    let subject = broker::child_param("SUBJECT");
    broker::relay_until_killed::<ChaosEvent, _>(MARK, async || {
        KillAfterAcks(JetStreamSink::new(
            jetstream::new(connect_nats().await),
            subject,
        ))
    });
}

/// Publishes through JetStream, then, once every acknowledgement is in, reports them and
/// SIGKILLs its own process: acknowledged by the broker, not recorded `SENT`.
struct KillAfterAcks(JetStreamSink<ChaosEvent>);

impl Sink<ChaosEvent> for KillAfterAcks {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        let acks = self.0.publish_acked(batch).await;
        let mut words = vec![format!("{MARK} ACKED")];
        for (delivery, ack) in batch.iter().zip(&acks) {
            match ack {
                Ok(ack) => words.push(format!(
                    "{}:{}:{}:{}",
                    delivery.event_id(),
                    delivery.generation(),
                    ack.sequence,
                    ack.duplicate
                )),
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

/// One acknowledged publication, as the child or the second relay saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Acked {
    event_id: String,
    generation: i64,
    sequence: u64,
    duplicate: bool,
}

impl Acked {
    fn parse(word: &str) -> Self {
        let parts: Vec<&str> = word.split(':').collect();
        let [event_id, generation, sequence, duplicate] = parts[..] else {
            panic!("a malformed acknowledgement: {word}");
        };
        Self {
            event_id: event_id.to_owned(),
            generation: generation.parse().expect("a generation"),
            sequence: sequence.parse().expect("a sequence"),
            duplicate: duplicate.parse().expect("a duplicate flag"),
        }
    }
}

/// The second relay's sink: JetStream, recording each acknowledgement.
#[derive(Clone)]
struct RecordAcks {
    inner: JetStreamSink<ChaosEvent>,
    acked: Arc<Mutex<Vec<Acked>>>,
}

impl Sink<ChaosEvent> for RecordAcks {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        let acks = self.inner.publish_acked(batch).await;
        let mut acked = self.acked.lock().unwrap_or_else(PoisonError::into_inner);
        batch
            .iter()
            .zip(acks)
            .map(|(delivery, ack)| {
                let ack = ack?;
                acked.push(Acked {
                    event_id: delivery.event_id().to_string(),
                    generation: delivery.generation().get(),
                    sequence: ack.sequence,
                    duplicate: ack.duplicate,
                });
                Ok(())
            })
            .collect()
    }
}

/// The consumer's handling of one message: [`broker::apply`] to its event id and body.
async fn apply(
    pool: &PgPool,
    inbox: &Inbox,
    message: &async_nats::Message,
) -> TestResult<Received> {
    let event_id = outbox::nats::event_id(message).ok_or("a message without an event id")?;
    broker::apply(pool, inbox, event_id, &message.payload).await
}

fn header_of<'m>(message: &'m async_nats::Message, name: &str) -> Option<&'m str> {
    Some(message.headers.as_ref()?.get(name)?.as_str())
}

/// What the redelivery test's phases share.
struct Scene {
    nats: async_nats::Client,
    js: jetstream::Context,
    db: TestSchema,
    stream: SharedStream,
    subject: String,
    events: Vec<ChaosEvent>,
}

#[tokio::test]
async fn a_publisher_killed_after_the_pub_ack_is_redelivered_stored_once_and_applied_once()
-> TestResult {
    let nats = connect_nats().await;
    let js = jetstream::new(nats.clone());
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    sqlx::query("CREATE TABLE shipments (event_id text NOT NULL, parcels bigint NOT NULL)")
        .execute(pool)
        .await?;
    let subject = format!("outbox.test.{}.shipments", db.name());
    let stream = SharedStream::create(&js, &db, &subject, |config| {
        config.duplicate_window = Duration::from_mins(2);
    })
    .await?;

    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let mut scene = Scene {
        nats,
        js,
        db,
        stream,
        subject,
        events,
    };
    let first_acks = first_relay_is_killed_after_the_acks(&mut scene).await?;
    let redelivered = second_relay_redelivers(&mut scene, &first_acks).await?;
    consumer_applies_each_effect_once(&mut scene, &redelivered).await?;
    scene.stream.delete().await?;
    scene.db.drop_schema().await?;
    Ok(())
}

/// Phase 1: the first relay publishes, JetStream acknowledges, the process dies.
async fn first_relay_is_killed_after_the_acks(
    scene: &mut Scene,
) -> TestResult<BTreeMap<String, Acked>> {
    let Scene {
        db,
        stream,
        subject,
        events,
        ..
    } = scene;
    let pool = db.pool();
    let mut first = ChildCommand::test("nats_redeliver_child")
        .spawn(ROLE, &[("URL", &db.url()), ("SUBJECT", subject)])?;
    let words = broker::killed_after_the_broker_took::<ChaosEvent>(
        &mut first,
        (MARK, "ACKED"),
        pool,
        &broker::keys(events),
    )
    .await?;
    let first_acks: BTreeMap<String, Acked> = words
        .iter()
        .map(|word| {
            let acked = Acked::parse(word);
            (acked.event_id.clone(), acked)
        })
        .collect();
    for event in events.iter() {
        let acked = &first_acks[&event.key];
        assert_eq!((acked.generation, acked.duplicate), (1, false), "{acked:?}");
    }
    assert_eq!(stream.info().await?.state.messages, 3);

    Ok(first_acks)
}

/// Phase 2: the first relay's lease expires; a second relay publishes the events again.
/// Returns the copies a plain subscriber saw on the wire.
async fn second_relay_redelivers(
    scene: &mut Scene,
    first_acks: &BTreeMap<String, Acked>,
) -> TestResult<Vec<async_nats::Message>> {
    let Scene {
        nats,
        js,
        db,
        stream,
        subject,
        events,
    } = scene;
    let pool = db.pool();
    // A plain subscriber sees every message on the wire, stored or not.
    let mut wire = nats.subscribe(subject.clone()).await?;
    nats.flush().await?;
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let acked = Arc::new(Mutex::new(Vec::new()));
    let sink = RecordAcks {
        inner: JetStreamSink::new(js.clone(), subject.clone()),
        acked: Arc::clone(&acked),
    };
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

    let second_acks = acked.lock().unwrap_or_else(PoisonError::into_inner).clone();
    assert_eq!(second_acks.len(), 3, "{second_acks:?}");
    for acked in &second_acks {
        let first = &first_acks[&acked.event_id];
        assert_eq!(
            (acked.generation, acked.duplicate, acked.sequence),
            (2, true, first.sequence),
            "{}: the redelivery, generation 2, is acknowledged as the copy the stream holds",
            acked.event_id
        );
    }
    assert_eq!(
        counters.get(outbox::nats::metric::DUPLICATES, ChaosEvent::SPEC.table()),
        3
    );
    assert_eq!(
        stream.info().await?.state.messages,
        3,
        "the stream holds one copy of each event"
    );
    for event in events.iter() {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.generation, row.attempts),
            ("SENT", 2, 2),
            "{}",
            event.key
        );
    }
    // On the wire: the unchanged event id (in the header and in Nats-Msg-Id), generation 2.
    let mut redelivered = Vec::new();
    for _ in 0..3 {
        let message = timeout(Duration::from_secs(5), wire.next())
            .await?
            .ok_or("the subscription ended")?;
        let event_id = outbox::nats::event_id(&message)
            .ok_or("no event id")?
            .to_owned();
        assert_eq!(
            header_of(&message, "Nats-Msg-Id"),
            Some(format!("chaos_events:{event_id}").as_str())
        );
        assert_eq!(header_of(&message, header::GENERATION), Some("2"));
        assert_eq!(header_of(&message, header::ATTEMPT), Some("2"));
        assert_eq!(header_of(&message, header::TABLE), Some("chaos_events"));
        assert_eq!(
            header_of(&message, header::CONTENT_TYPE),
            Some("application/json")
        );
        assert_eq!(
            header_of(&message, header::CREATED_AT),
            Some(broker::enqueue_time(pool, &event_id).await?.as_str()),
            "the enqueue time, unchanged by the redelivery"
        );
        redelivered.push(message);
    }
    let wire_ids: BTreeSet<String> = redelivered
        .iter()
        .filter_map(|m| outbox::nats::event_id(m).map(str::to_owned))
        .collect();
    assert_eq!(wire_ids, first_acks.keys().cloned().collect());

    Ok(redelivered)
}

/// Phase 3: the consumer.
async fn consumer_applies_each_effect_once(
    scene: &mut Scene,
    redelivered: &[async_nats::Message],
) -> TestResult {
    let Scene { db, stream, .. } = scene;
    let pool = db.pool();
    // Every event reaches it three times (the stream's copy, JetStream
    // redelivering it because the consumer committed but never acknowledged, and the
    // wire copy of the relay's redelivery); each effect applies once.
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("shipping".into()),
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
    let inbox = Inbox::new("shipping");
    let mut receipts = Vec::new();
    for pass in 1..=2 {
        let mut batch = consumer
            .fetch()
            // Exactly the batch: a pull request left waiting for more would take the
            // next pass's redeliveries.
            .max_messages(3)
            .expires(Duration::from_secs(5))
            .messages()
            .await?;
        let mut got = 0;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| e.to_string())?;
            let stored = header_of(&message, header::GENERATION).map(str::to_owned);
            assert_eq!(
                stored.as_deref(),
                Some("1"),
                "the stream keeps the first copy"
            );
            receipts.push(apply(pool, &inbox, &message).await?);
            got += 1;
            if pass == 2 {
                message.ack().await.map_err(|e| e.to_string())?;
            }
            // Pass 1 commits and dies before acknowledging: JetStream redelivers.
        }
        assert_eq!(got, 3, "pass {pass}");
    }
    for message in redelivered {
        receipts.push(apply(pool, &inbox, message).await?);
    }
    broker::each_effect_applied_once(pool, &receipts, 9).await?;

    Ok(())
}

/// A stream taking `subject`, with `configure` applied.
async fn create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    configure: impl FnOnce(&mut stream::Config),
) -> TestResult<stream::Stream> {
    let mut config = stream::Config {
        name: name.to_owned(),
        subjects: vec![subject.to_owned()],
        ..Default::default()
    };
    configure(&mut config);
    Ok(js.create_stream(config).await?)
}

/// A stream on the shared server, named after the test's schema: deleted by
/// [`SharedStream::delete`] at the end of the test, or when dropped if the test fails
/// first.
struct SharedStream {
    stream: stream::Stream,
    cleanup: Cleanup,
}

impl SharedStream {
    /// A stream taking `subject`, with `configure` applied, named after `db`.
    async fn create(
        js: &jetstream::Context,
        db: &TestSchema,
        subject: &str,
        configure: impl FnOnce(&mut stream::Config),
    ) -> TestResult<Self> {
        STREAMS_SWEPT
            .get_or_init(|| sweep_leftover_streams(js))
            .await;
        let name = db.name().to_uppercase();
        let cleanup = Cleanup::new(format!("the NATS stream {name}"), {
            let name = name.clone();
            move || async move { delete_shared_stream(&name).await }
        });
        let stream = create_stream(js, &name, subject, configure).await?;
        Ok(Self { stream, cleanup })
    }

    async fn delete(self) -> TestResult {
        self.cleanup.run().await
    }
}

impl Deref for SharedStream {
    type Target = stream::Stream;

    fn deref(&self) -> &stream::Stream {
        &self.stream
    }
}

impl DerefMut for SharedStream {
    fn deref_mut(&mut self) -> &mut stream::Stream {
        &mut self.stream
    }
}

/// Deletes the stream `name` from the shared server, on a connection of its own (the
/// test's may be gone); one that is not there is deleted already.
async fn delete_shared_stream(name: &str) -> TestResult {
    let js = jetstream::new(async_nats::connect(nats_url()).await?);
    match js.delete_stream(name).await {
        Ok(_) => Ok(()),
        Err(error) => match error.kind() {
            GetStreamErrorKind::JetStream(e)
                if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(())
            }
            _ => Err(error.into()),
        },
    }
}

/// Whether this process swept the shared server already.
static STREAMS_SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// Deletes the streams that test runs killed midway (a cancelled run, a CI timeout) left
/// on the shared server: named after a test schema (`OUTBOX_TEST_` and a UUIDv7, which
/// says when it was created: the tests' and the examples' streams) and older than an hour,
/// longer than any run of them takes. Best effort.
async fn sweep_leftover_streams(js: &jetstream::Context) {
    let mut names = js.stream_names();
    let mut leftovers = Vec::new();
    while let Some(Ok(name)) = names.next().await {
        let created = name
            .strip_prefix("OUTBOX_TEST_")
            .and_then(|id| uuid::Uuid::try_parse(id).ok())
            .filter(|id| id.get_version_num() == 7)
            .and_then(|id| id.get_timestamp())
            .map(|at| {
                let (secs, nanos) = at.to_unix();
                std::time::UNIX_EPOCH + Duration::new(secs, nanos)
            });
        let age = created.and_then(|at| std::time::SystemTime::now().duration_since(at).ok());
        if age.is_some_and(|age| age > Duration::from_hours(1)) {
            leftovers.push(name);
        }
    }
    for name in leftovers {
        if js.delete_stream(&name).await.is_ok() {
            eprintln!("deleted the stream {name}, which a killed test run left behind");
        }
    }
}

#[tokio::test]
async fn bad_input_is_dead_with_its_reason_and_the_other_events_are_sent() -> TestResult {
    let js = jetstream::new(connect_nats().await);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let nowhere = format!("outbox.test.{}.nowhere", db.name());
    let below = format!("{subject}.>");
    let mut stream = SharedStream::create(&js, &db, &subject, |config| {
        config.max_message_size = 1024;
        // Would store a message published to a wildcard below the subject.
        config.subjects.push(below);
    })
    .await?;
    let large = "x".repeat(900);
    let sink = JetStreamSink::new(js.clone(), subject.clone())
        .subject_from(move |event: &ChaosEvent| {
            match event.key.as_str() {
                "nowhere" => nowhere.clone(),
                // An empty token: the client sends it, and no stream can take it.
                "invalid-subject" => format!("{subject}."),
                "wildcard" => format!("{subject}.*"),
                _ => subject.clone(),
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
            ("nowhere", "no JetStream stream takes this subject"),
            (&large, "message size exceeds maximum allowed"),
            ("invalid-subject", "not a valid subject"),
            (
                "wildcard",
                "a wildcard (`*` or `>`) names no single subject",
            ),
            (
                "line\nbreak",
                "the `Outbox-Event-Id` header cannot carry this value",
            ),
            // A consumer's client would read `ok-1`, and skip it as applied.
            (
                "ok-1 ",
                "the `Outbox-Event-Id` header cannot carry `ok-1 ` (leading or trailing \
                 whitespace: NATS clients trim header values, so a consumer would read `ok-1`)",
            ),
            (
                "\tok-2",
                "the `Outbox-Event-Id` header cannot carry `\tok-2`",
            ),
        ],
    )
    .await?;
    assert_eq!(stream.info().await?.state.messages, 2);
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_larger_than_the_contexts_acknowledgement_slots_is_sent_promptly_in_order()
-> TestResult {
    // Four acknowledgements in flight at most: a publish waits for a free slot, which
    // only an awaited acknowledgement frees.
    let js = jetstream::ContextBuilder::new()
        .max_ack_inflight(4)
        .build(connect_nats().await);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let mut stream = SharedStream::create(&js, &db, &subject, |_| {}).await?;
    let events: Vec<ChaosEvent> = (1..=50)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n:02}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), JetStreamSink::new(js.clone(), subject))
            .batch_size(50)
            .poll_interval(Duration::from_millis(50)),
    );
    // Well within the relay's send timeout (30 s), which a stalled batch waits out.
    wait_until("all 50 SENT", Duration::from_secs(10), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 50
    })
    .await;
    relay.stop().await?;
    for event in &events {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("SENT", 1),
            "{}",
            event.key
        );
    }
    assert_eq!(stream.info().await?.state.messages, 50);
    // One batch, one worker: stored in the outbox's order.
    let mut stored = Vec::new();
    for sequence in 1..=50 {
        let message = stream.get_raw_message(sequence).await?;
        let event_id = message.headers.get(header::EVENT_ID).ok_or("no event id")?;
        stored.push(event_id.as_str().to_owned());
    }
    let enqueued: Vec<String> = events.iter().map(|event| event.key.clone()).collect();
    assert_eq!(stored, enqueued);
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn two_tables_events_with_one_event_id_are_both_stored_in_a_shared_stream() -> TestResult {
    let js = jetstream::new(connect_nats().await);
    let db = schema_from_zero(&[ChaosEvent::migrations(), OrderStep::migrations()]).await?;
    let pool = db.pool();
    let prefix = format!("outbox.test.{}", db.name());
    let mut stream = SharedStream::create(&js, &db, &format!("{prefix}.>"), |_| {}).await?;
    // One business id, two event types, each with its own table.
    let id = "order-42";
    ChaosEvent {
        key: id.to_owned(),
        order_seq: 1,
    }
    .enqueue(pool)
    .await?;
    OrderStep {
        name: id.to_owned(),
        order_id: 42,
    }
    .enqueue(pool)
    .await?;
    let chaos = start(Relay::<ChaosEvent, _>::new(
        pool.clone(),
        JetStreamSink::new(js.clone(), format!("{prefix}.chaos")),
    ));
    let steps = start(Relay::<OrderStep, _>::new(
        pool.clone(),
        JetStreamSink::new(js.clone(), format!("{prefix}.steps")),
    ));
    wait_until("both SENT", Duration::from_secs(15), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 1
            && outbox::stats::<OrderStep>(pool).await.unwrap().sent == 1
    })
    .await;
    chaos.stop().await?;
    steps.stop().await?;
    assert_eq!(
        stream.info().await?.state.messages,
        2,
        "each table's event stored, not taken for the other's duplicate"
    );
    let mut ids = Vec::new();
    for sequence in 1..=2 {
        let message = stream.get_raw_message(sequence).await?;
        ids.push(
            message
                .headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned()),
        );
    }
    ids.sort();
    assert_eq!(
        ids,
        [
            Some(format!("chaos_events:{id}")),
            Some(format!("order_step_events:{id}"))
        ]
    );
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_ordering_key_is_a_header_and_each_keys_messages_are_stored_in_order() -> TestResult {
    let js = jetstream::new(connect_nats().await);
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.steps", db.name());
    let stream = SharedStream::create(&js, &db, &subject, |_| {}).await?;
    broker::publish_order_steps(pool, JetStreamSink::new(js.clone(), subject)).await?;

    // key -> its messages' event ids, in the stream's order.
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for sequence in 1..=6 {
        let message = stream.get_raw_message(sequence).await?;
        let key = message.headers.get(header::KEY).ok_or("no key header")?;
        let event_id = message.headers.get(header::EVENT_ID).ok_or("no event id")?;
        by_key
            .entry(key.as_str().to_owned())
            .or_default()
            .push(event_id.as_str().to_owned());
    }
    assert_eq!(
        by_key,
        broker::steps_by_order(),
        "each order's steps in the outbox's order"
    );
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// A run of one key whose third event no stream takes: the stream holds nothing after
/// it until it is requeued, then the whole run in order.
#[tokio::test]
async fn a_run_stops_at_an_event_no_stream_takes_and_goes_on_in_order_once_requeued() -> TestResult
{
    let js = jetstream::new(connect_nats().await);
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let subject = format!("outbox.test.{}.steps", db.name());
    let nowhere = format!("outbox.test.{}.nowhere", db.name());
    let mut stream = SharedStream::create(&js, &db, &subject, |_| {}).await?;
    let refusal = broker::Refusal::new();
    let sink = JetStreamSink::new(js.clone(), subject.clone())
        .subject_from(refusal.destination(subject, nowhere));
    broker::a_refused_event_holds_the_rest_of_its_run(db.pool(), sink, &refusal, async |n| {
        let n = u64::try_from(n)?;
        assert_eq!(stream.info().await?.state.messages, n);
        let mut stored = Vec::new();
        for sequence in 1..=n {
            let message = stream.get_raw_message(sequence).await?;
            let event_id = message.headers.get(header::EVENT_ID).ok_or("no event id")?;
            stored.push(event_id.as_str().to_owned());
        }
        Ok(stored)
    })
    .await?;
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn cloud_events_binary_as_ce_headers_and_structured_as_the_json_body() -> TestResult {
    let js = jetstream::new(connect_nats().await);
    for structured in [false, true] {
        // A schema, and so a stream, of each mode's own: the events' ids are the same.
        let db = schema_from_zero(&[OrderStep::migrations()]).await?;
        let pool = db.pool();
        let subject = format!("outbox.test.{}.steps", db.name());
        let stream = SharedStream::create(&js, &db, &subject, |_| {}).await?;
        let sink =
            JetStreamSink::new(js.clone(), subject).cloud_events(broker::cloud_events(structured));
        broker::publish_order_steps(pool, sink).await?;

        for sequence in 1..=6 {
            let message = stream.get_raw_message(sequence).await?;
            let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
            let event_id = header(header::EVENT_ID).ok_or("no event id")?;
            if structured {
                assert_eq!(
                    header(header::CONTENT_TYPE).as_deref(),
                    Some("application/cloudevents+json; charset=utf-8")
                );
                broker::assert_structured_cloud_event(&event_id, &message.payload)?;
                continue;
            }
            let event: serde_json::Value = serde_json::from_slice(&message.payload)?;
            assert_eq!(event["name"], event_id.as_str(), "the body is the event");
            broker::assert_binary_cloud_event(&event_id, |attribute| {
                header(&format!("ce-{attribute}"))
            })?;
            assert_eq!(
                header("ce-datacontenttype").as_deref(),
                Some("application/json")
            );
        }
        stream.delete().await?;
        db.drop_schema().await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_server_outage_burns_no_attempts_and_the_relay_resumes_when_it_returns() -> TestResult {
    let direct = connect_nats().await;
    let js = jetstream::new(direct);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let mut stream = SharedStream::create(&js, &db, &subject, |_| {}).await?;

    let upstream = nats_url().trim_start_matches("nats://").to_owned();
    let mut proxy = Proxy::start(upstream).await?;
    let client = async_nats::connect(format!("nats://127.0.0.1:{}", proxy.port)).await?;
    proxy.down();
    wait_until("the client notices", Duration::from_secs(10), async || {
        client.connection_state() != async_nats::connection::State::Connected
    })
    .await;

    let sink = JetStreamSink::new(jetstream::new(client.clone()), subject.clone());
    broker::ride_out_an_outage(pool, &mut proxy, sink).await?;
    assert_eq!(stream.info().await?.state.messages, 10);
    proxy.down();
    stream.delete().await?;
    db.drop_schema().await?;
    Ok(())
}

/// The credentials of the test's own server.
const USER: &str = "outbox";
const PASSWORD: &str = "s3cret";

fn with_password(password: &str) -> async_nats::ConnectOptions {
    async_nats::ConnectOptions::with_user_and_password(USER.into(), password.into())
        .connection_timeout(Duration::from_secs(3))
}

#[tokio::test]
async fn wrong_credentials_are_refused_at_connect_and_a_retrying_client_loses_nothing() -> TestResult
{
    let server = NatsServer::start(&["--user", USER, "--pass", PASSWORD])?;
    let url = server.url();

    // At connect: a typed error, promptly, for a wrong password and for none.
    for (what, options) in [
        ("a wrong password", with_password("wrong")),
        ("no credentials", async_nats::ConnectOptions::new()),
    ] {
        let refused = timeout(Duration::from_secs(10), options.connect(&url))
            .await?
            .err()
            .ok_or_else(|| format!("{what} was accepted"))?;
        assert_eq!(
            refused.kind(),
            async_nats::ConnectErrorKind::AuthorizationViolation,
            "{what}: {refused}"
        );
        assert!(
            refused.to_string().contains("authorization violation"),
            "{refused}"
        );
    }

    // A client told to keep retrying (`retry_on_initial_connect`) is handed back never
    // connected: the sink finds it unavailable, and the relay counts nothing.
    let js = jetstream::new(with_password(PASSWORD).connect(&url).await?);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let mut stream = create_stream(&js, "SHIPMENTS", &subject, |_| {}).await?;
    let events: Vec<ChaosEvent> = (1..=3)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let retrying = with_password("wrong")
        .retry_on_initial_connect()
        .connect(&url)
        .await?;
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let relay = start(
        Relay::<ChaosEvent, _>::new(
            pool.clone(),
            JetStreamSink::new(jetstream::new(retrying.clone()), subject.clone()),
        )
        .poll_interval(Duration::from_millis(50))
        .unavailable_backoff(outbox::relay::Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(200),
        )),
    );
    let table = ChaosEvent::SPEC.table();
    wait_until("3 batches held back", Duration::from_secs(20), async || {
        counters.get(outbox::relay::metric::UNAVAILABLE, table) >= 3
    })
    .await;
    relay.stop().await?;
    assert_ne!(
        retrying.connection_state(),
        async_nats::connection::State::Connected
    );
    for event in &events {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("READY", 0),
            "handed back, no attempt counted: {row:?}"
        );
    }
    assert_eq!(stream.info().await?.state.messages, 0);

    // The right credentials (a new client): everything is sent, on its first attempt.
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), JetStreamSink::new(js.clone(), subject))
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until("all 3 SENT", Duration::from_secs(20), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 3
    })
    .await;
    relay.stop().await?;
    for event in &events {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{row:?}");
    }
    assert_eq!(stream.info().await?.state.messages, 3);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn revoked_credentials_leave_the_sink_unavailable_until_they_are_restored() -> TestResult {
    let mut server = NatsServer::start(&["--user", USER, "--pass", PASSWORD])?;
    let url = server.url();
    // The relay's client, connected with what were the right credentials; it reconnects
    // with them, quickly.
    let client = with_password(PASSWORD)
        .reconnect_delay_callback(|_| Duration::from_millis(100))
        .connect(&url)
        .await?;
    let js = jetstream::new(client.clone());
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let mut stream = create_stream(&js, "SHIPMENTS", &subject, |_| {}).await?;
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), JetStreamSink::new(js, subject))
            .poll_interval(Duration::from_millis(50))
            .unavailable_backoff(outbox::relay::Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(200),
            )),
    );
    let shipments = |range: std::ops::RangeInclusive<i64>| -> Vec<ChaosEvent> {
        range
            .map(|n| ChaosEvent {
                key: format!("shipment-{n}"),
                order_seq: n,
            })
            .collect()
    };
    enqueue(pool, &shipments(1..=3)).await;
    wait_until("the first 3 SENT", Duration::from_secs(20), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 3
    })
    .await;

    // Revoked: the server comes back with another password; the client's reconnects
    // are refused.
    server.down(Stop::Term)?;
    server.set_args(&["--user", USER, "--pass", "rotated"]);
    server.up()?;
    let table = ChaosEvent::SPEC.table();
    let before = counters.get(outbox::relay::metric::UNAVAILABLE, table);
    enqueue(pool, &shipments(4..=6)).await;
    wait_until("3 batches held back", Duration::from_secs(20), async || {
        counters.get(outbox::relay::metric::UNAVAILABLE, table) >= before + 3
    })
    .await;
    assert_ne!(
        client.connection_state(),
        async_nats::connection::State::Connected
    );
    // The relay keeps claiming while the credentials are refused: each claim finds the
    // destination unavailable and hands the rows back uncounted. So a row is READY with no
    // attempt between two claims, or INPROGRESS with that claim's attempt alone, never
    // more: three batches counted would show three.
    for event in shipments(4..=6) {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert!(
            matches!(
                (row.status.as_str(), row.attempts),
                ("READY", 0) | ("INPROGRESS", 1)
            ),
            "handed back, no attempt counted: {row:?}"
        );
    }

    // Restored: the same client reconnects by itself, and the relay sends the rest.
    server.down(Stop::Term)?;
    server.set_args(&["--user", USER, "--pass", PASSWORD]);
    server.up()?;
    wait_until("all 6 SENT", Duration::from_secs(30), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 6
    })
    .await;
    relay.stop().await?;
    for event in shipments(4..=6) {
        let row = row_of::<ChaosEvent>(pool, event.key.as_str()).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{row:?}");
    }
    assert_eq!(stream.info().await?.state.messages, 6);
    db.drop_schema().await?;
    Ok(())
}

/// A publisher allowed its events' subjects and its acknowledgements, nothing else: not
/// the JetStream API, its stream list included.
const LEAST_PRIVILEGE: &str = r#"
authorization {
  users = [
    { user: admin, password: admin }
    { user: publisher, password: publisher, permissions: {
        publish: { allow: ["outbox.>"] }
        subscribe: { allow: ["_INBOX.>"] }
    } }
  ]
}
"#;

#[tokio::test]
async fn a_publisher_not_allowed_the_stream_list_spends_the_budget_of_a_subject_no_stream_takes()
-> TestResult {
    let server = NatsServer::start_with_config(LEAST_PRIVILEGE)?;
    let admin = async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin".into())
        .connect(server.url())
        .await?;
    let mut stream =
        create_stream(&jetstream::new(admin), "ORDERS", "outbox.orders", |_| {}).await?;
    // The stream list's request gets a permissions violation and no answer: it times
    // out, after a second.
    let publisher =
        async_nats::ConnectOptions::with_user_and_password("publisher".into(), "publisher".into())
            .request_timeout(Some(Duration::from_secs(1)))
            .connect(server.url())
            .await?;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[
            OrderStep {
                name: "taken".into(),
                order_id: 1,
            },
            OrderStep {
                name: "nowhere".into(),
                order_id: 2,
            },
        ],
    )
    .await;
    let sink = JetStreamSink::new(jetstream::new(publisher), "outbox.orders").subject_from(
        |step: &OrderStep| {
            if step.order_id == 1 {
                "outbox.orders".to_owned()
            } else {
                "outbox.nowhere".to_owned()
            }
        },
    );
    let relay = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink)
            .poll_interval(Duration::from_millis(50))
            .unavailable_backoff(outbox::relay::Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(200),
            )),
    );
    // Taken for an outage, `nowhere` would be handed back uncounted, forever.
    wait_until("1 SENT and 1 DEAD", Duration::from_secs(20), async || {
        let stats = outbox::stats::<OrderStep>(pool).await.unwrap();
        (stats.sent, stats.dead) == (1, 1)
    })
    .await;
    relay.stop().await?;
    let taken = row_of::<OrderStep>(pool, "taken").await;
    assert_eq!((taken.status.as_str(), taken.attempts), ("SENT", 1));
    let nowhere = row_of::<OrderStep>(pool, "nowhere").await;
    let error = nowhere.last_error.clone().unwrap_or_default();
    assert_eq!(
        (nowhere.status.as_str(), nowhere.attempts),
        ("DEAD", 2),
        "both attempts of its budget counted: {error}"
    );
    assert!(
        error.contains(
            "publishing to `outbox.nowhere`: no responders, and looking up which stream \
             takes the subject (`$JS.API.STREAM.NAMES`) failed"
        ),
        "{error}"
    );
    assert!(error.contains("timed out"), "{error}");
    assert_eq!(stream.info().await?.state.messages, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restarts_under_load_send_nothing_to_dead() -> TestResult {
    let mut server = NatsServer::start(&[])?;
    let client = async_nats::ConnectOptions::new()
        .reconnect_delay_callback(|_| Duration::from_millis(20))
        .connect(server.url())
        .await?;
    let js = jetstream::new(client);
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let subject = format!("outbox.test.{}.shipments", db.name());
    let mut stream = create_stream(&js, "SHIPMENTS", &subject, |_| {}).await?;
    let events: Vec<ChaosEvent> = (1..=4_000)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    let mut chunks = events.chunks(500);
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), JetStreamSink::new(js, subject))
            .batch_size(50)
            .concurrency(4)
            .poll_interval(Duration::from_millis(20))
            .unavailable_backoff(outbox::relay::Backoff::new(
                Duration::from_millis(20),
                Duration::from_millis(200),
            )),
    );
    // Restarts while batches are in flight (each follows a fresh 500 events by a few
    // milliseconds, well within their drain): a clean shutdown (SIGTERM) stops
    // JetStream before it closes the clients' connections, a SIGKILL does neither.
    for restart in 0..8 {
        if let Some(chunk) = chunks.next() {
            enqueue(pool, chunk).await;
        }
        tokio::time::sleep(Duration::from_millis(fastrand::u64(5..50))).await;
        let how = if restart % 2 == 0 {
            Stop::Term
        } else {
            Stop::Kill
        };
        tokio::task::block_in_place(|| server.down(how))?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        tokio::task::block_in_place(|| server.up())?;
    }
    wait_until(
        "every event SENT or DEAD",
        Duration::from_mins(1),
        async || {
            let stats = outbox::stats::<ChaosEvent>(pool).await.unwrap();
            stats.sent + stats.dead == 4_000
        },
    )
    .await;
    relay.stop().await?;
    let dead: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT event_id, last_error FROM chaos_events WHERE status = 'DEAD' LIMIT 5",
    )
    .fetch_all(pool)
    .await?;
    assert!(
        dead.is_empty(),
        "a server restart sent events to DEAD: {dead:?}"
    );
    let stored = stream.info().await?.state.messages;
    assert_eq!(stored, 4_000, "each event stored once");
    db.drop_schema().await?;
    Ok(())
}
