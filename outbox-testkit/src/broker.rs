//! What the broker sinks' tests share: an encoding that refuses one event, the
//! consumer's effect applied with its inbox row, a TCP proxy whose stop is, for the
//! clients connected through it, the broker going away, and two orders' steps whose
//! per-key order a broker must keep.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::Outbox as _;
use outbox::message::{Encoding, Json};
use outbox::{CancellationToken, Relay, Sink, relay::Backoff};
use outbox::{Inbox, Received};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::child;
use super::counters::Counters;
use super::events::{ChaosEvent, OrderStep, TracedOrder};
use super::proxy::Proxy;
use super::rows::{enqueue, row_of};
use super::running::start;
use super::{TestResult, wait_until};

/// JSON, except for the event named `unencodable`: a stand-in for an event a real
/// encoding cannot handle.
pub struct RefuseUnencodable;

impl Encoding<ChaosEvent> for RefuseUnencodable {
    fn content_type(&self) -> Option<&str> {
        Some("application/json")
    }

    fn encode(&self, event: &ChaosEvent) -> Result<Vec<u8>, outbox::relay::BoxError> {
        if event.key == "unencodable" {
            return Err("parcels must be positive".into());
        }
        Json.encode(event)
    }
}

/// In a redelivery test's child process: the parameter `name` its parent passed.
pub fn child_param(name: &str) -> String {
    child::param(name).unwrap_or_else(|| panic!("no {name} given"))
}

/// The body of a redelivery test's child process: a relay of `T` ([`ChaosEvent`],
/// [`TracedOrder`]) on the test's schema (the parameter `URL`), publishing through the
/// sink `sink` makes, which SIGKILLs the process once the broker acknowledged a batch.
/// Says `FAILED` under `mark` if the relay returns instead.
pub fn relay_until_killed<T, S>(mark: &str, sink: impl AsyncFnOnce() -> S)
where
    T: outbox::Outbox + Send + Sync + 'static,
    S: Sink<T>,
{
    let url = child_param("URL");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect(&url)
            .await
            .expect("the test's schema");
        let result = Relay::<T, _>::new(pool, sink().await)
            .run(CancellationToken::new())
            .await;
        child::say(&format!("{mark} FAILED the relay returned: {result:?}"));
    });
}

/// Enqueues [`order_steps`] and publishes them through `sink`, with a relay of two
/// workers, until all six are `SENT`.
pub async fn publish_order_steps<S: Sink<OrderStep>>(pool: &PgPool, sink: S) -> TestResult {
    enqueue(pool, &order_steps()).await;
    let relay = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink)
            .concurrency(2)
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until("all 6 SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 6
    })
    .await;
    relay.stop().await?;
    Ok(())
}

/// The trace context [`publish_traced_order`] stores with its order, as a request's
/// span would have.
pub const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
/// Its `tracestate`.
pub const TRACESTATE: &str = "congo=t61rcWkgMzE";
/// Its `baggage`.
pub const BAGGAGE: &str = "tenant=acme%20co;ttl=5";

/// Enqueues one [`TracedOrder`] `o-1` whose row holds [`TRACEPARENT`], [`TRACESTATE`]
/// and [`BAGGAGE`] (written as an enqueue inside that trace would, here without the
/// `otel` feature that captures it), and publishes it through `sink`: a relay without
/// `otel` sends the stored context as it is.
pub async fn publish_traced_order<S: Sink<TracedOrder>>(pool: &PgPool, sink: S) -> TestResult {
    TracedOrder {
        name: "o-1".into(),
        customer: "ada".into(),
    }
    .enqueue(pool)
    .await?;
    sqlx::query(
        "UPDATE traced_order_events SET trace_parent = $1, trace_state = $2, trace_baggage = $3",
    )
    .bind(TRACEPARENT)
    .bind(TRACESTATE)
    .bind(BAGGAGE)
    .execute(pool)
    .await?;
    let relay = start(Relay::<TracedOrder, _>::new(pool.clone(), sink));
    wait_until("SENT", Duration::from_secs(30), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 1
    })
    .await;
    relay.stop().await?;
    Ok(())
}

/// Three steps of each of orders 7 and 8, enqueued interleaved.
pub fn order_steps() -> Vec<OrderStep> {
    (1..=3)
        .flat_map(|n| {
            [7, 8].map(|order_id| OrderStep {
                name: format!("order-{order_id}-step-{n}"),
                order_id,
            })
        })
        .collect()
}

/// The event a broker refuses in [`a_refused_event_holds_the_rest_of_its_run`]: the
/// third of [`run_of_one_key`].
pub const REFUSED_STEP: &str = "order-9-step-3";

/// Five steps of one order (key 9), `order-9-step-1` to `-5`: one claim takes them as a
/// run.
pub fn run_of_one_key() -> Vec<OrderStep> {
    (1..=5)
        .map(|n| OrderStep {
            name: format!("order-9-step-{n}"),
            order_id: 9,
        })
        .collect()
}

/// While it holds, [`REFUSED_STEP`] goes where the broker refuses it.
#[derive(Clone)]
pub struct Refusal(Arc<AtomicBool>);

impl Refusal {
    /// A refusal that holds until [`a_refused_event_holds_the_rest_of_its_run`] mends the
    /// destination.
    pub fn new() -> Self {
        Self(Arc::new(AtomicBool::new(true)))
    }

    /// A sink's destination for each step: `refused` for [`REFUSED_STEP`] while the
    /// refusal holds, `taken` otherwise.
    pub fn destination(
        &self,
        taken: String,
        refused: String,
    ) -> impl Fn(&OrderStep) -> String + Send + Sync + 'static {
        let refusing = Arc::clone(&self.0);
        move |step| {
            if refusing.load(Ordering::SeqCst) && step.name == REFUSED_STEP {
                refused.clone()
            } else {
                taken.clone()
            }
        }
    }

    /// The destination is mended.
    fn end(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Default for Refusal {
    fn default() -> Self {
        Self::new()
    }
}

/// A run of one key through a real broker that refuses its third event ([`REFUSED_STEP`],
/// which `sink` sends where no stream, topic or queue takes it while `refusal` holds):
/// the broker holds nothing after the refused event, however the run was sent, and once
/// the operator requeues it (the destination mended), the broker holds the whole run in
/// order, each event once.
///
/// `stored(n)` reads what the broker holds of the run, in its order, which must be `n`
/// events (and not more).
pub async fn a_refused_event_holds_the_rest_of_its_run<S: Sink<OrderStep>>(
    pool: &PgPool,
    sink: S,
    refusal: &Refusal,
    mut stored: impl AsyncFnMut(usize) -> TestResult<Vec<String>>,
) -> TestResult {
    let run = run_of_one_key();
    enqueue(pool, &run).await;
    let names: Vec<String> = run.into_iter().map(|step| step.name).collect();
    let relay = start(
        Relay::<OrderStep, _>::new(pool.clone(), sink)
            .batch_size(10)
            .poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "steps 1 and 2 SENT, 3 DEAD",
        Duration::from_secs(30),
        async || {
            let stats = outbox::stats::<OrderStep>(pool).await.unwrap();
            (stats.sent, stats.dead) == (2, 1)
        },
    )
    .await;
    for held in &names[3..] {
        let row = row_of::<OrderStep>(pool, held.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("READY", 0),
            "{held} waits behind the refused step, unattempted"
        );
    }
    assert_eq!(
        stored(2).await?,
        names[..2],
        "nothing after the refused step reached the broker"
    );

    refusal.end();
    let requeued = outbox::ops::requeue_dead::<OrderStep>(pool, &[REFUSED_STEP]).await?;
    assert_eq!(requeued.len(), 1);
    wait_until("the whole run SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 5
    })
    .await;
    relay.stop().await?;
    assert_eq!(stored(5).await?, names, "the run in order, each step once");
    Ok(())
}

/// What a broker must hold of [`order_steps`]: for each order (its key, as the
/// `Outbox-Key` header writes it), its steps' event ids in the outbox's order.
pub fn steps_by_order() -> BTreeMap<String, Vec<String>> {
    [7, 8]
        .map(|order_id| {
            (
                order_id.to_string(),
                (1..=3)
                    .map(|n| format!("order-{order_id}-step-{n}"))
                    .collect(),
            )
        })
        .into_iter()
        .collect()
}

/// The CloudEvents setting the broker tests publish [`order_steps`] with: binary mode
/// with the default source and type, or structured mode with those
/// [`assert_structured_cloud_event`] expects.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub fn cloud_events(structured: bool) -> outbox::message::CloudEvents {
    if structured {
        outbox::message::CloudEvents::structured()
            .source("https://shop.example.com/orders")
            .event_type("com.example.order.step")
    } else {
        outbox::message::CloudEvents::binary()
    }
}

/// Checks a binary CloudEvent of an [`order_steps`] event published with the default
/// source and type: `attribute` reads one attribute from the broker's headers (by its
/// CloudEvents name, which the caller prefixes as its binding does).
pub fn assert_binary_cloud_event(
    event_id: &str,
    attribute: impl Fn(&str) -> Option<String>,
) -> TestResult {
    assert_eq!(attribute("specversion").as_deref(), Some("1.0"));
    assert_eq!(
        attribute("id").as_deref(),
        Some(event_id),
        "the id is the event id"
    );
    assert_eq!(
        attribute("source").as_deref(),
        Some("/outbox/order_step_events")
    );
    assert_eq!(attribute("type").as_deref(), Some("order_step_events"));
    let time = attribute("time").ok_or("no time")?;
    chrono::DateTime::parse_from_rfc3339(&time)?;
    let order = event_id.split('-').nth(1).ok_or("not an order step")?;
    assert_eq!(
        attribute("subject").as_deref(),
        Some(order),
        "the key is the subject"
    );
    Ok(())
}

/// Checks a structured CloudEvent (`body`) of an [`order_steps`] event published with
/// the source `https://shop.example.com/orders` and type `com.example.order.step`.
pub fn assert_structured_cloud_event(event_id: &str, body: &[u8]) -> TestResult {
    let event: serde_json::Value = serde_json::from_slice(body)?;
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(event["id"], event_id);
    assert_eq!(event["source"], "https://shop.example.com/orders");
    assert_eq!(event["type"], "com.example.order.step");
    assert_eq!(event["datacontenttype"], "application/json");
    assert_eq!(event["data"]["name"], event_id, "the event, as JSON");
    chrono::DateTime::parse_from_rfc3339(event["time"].as_str().ok_or("no time")?)?;
    Ok(())
}

/// The consumer's handling of one message (`event_id`, and `body`, a `ChaosEvent` as
/// JSON): the effect (a row in `shipments`) and the inbox row in one transaction.
pub async fn apply(
    pool: &PgPool,
    inbox: &Inbox,
    event_id: &str,
    body: &[u8],
) -> TestResult<Received> {
    let event: serde_json::Value = serde_json::from_slice(body)?;
    let mut tx = pool.begin().await?;
    let received = inbox.receive(&mut tx, event_id).await?;
    if received.is_new() {
        sqlx::query("INSERT INTO shipments (event_id, parcels) VALUES ($1, $2)")
            .bind(event_id)
            .bind(event["order_seq"].as_i64().ok_or("no order_seq")?)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(received)
}

/// The end of a broker-level redelivery test: of `receipts` (the consumer's, one per
/// copy it received, `copies_received` in all), the first of each of the three events
/// was new and applied, every later one recognised by the inbox and skipped, so each
/// event's effect (its row in `shipments`) is there exactly once.
pub async fn each_effect_applied_once(
    pool: &PgPool,
    receipts: &[Received],
    copies_received: usize,
) -> TestResult {
    let new = receipts.iter().filter(|r| r.is_new()).count();
    assert_eq!((new, receipts.len()), (3, copies_received), "{receipts:?}");
    let applied: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT event_id, count(*), sum(parcels)::bigint FROM shipments GROUP BY event_id ORDER BY event_id",
    )
    .fetch_all(pool)
    .await?;
    assert_eq!(
        applied,
        [
            ("shipment-1".to_owned(), 1, 1),
            ("shipment-2".to_owned(), 1, 2),
            ("shipment-3".to_owned(), 1, 3)
        ],
        "each effect exactly once"
    );
    Ok(())
}

/// What a broker without deduplication holds after a redelivery test: each of the
/// events the first relay published (`first`, by event id) twice under its unchanged
/// id, `copies` giving each copy's generation header in the order received: 1, then the
/// redelivery's 2.
pub fn each_event_twice(first: &BTreeMap<String, i64>, copies: &BTreeMap<String, Vec<String>>) {
    let expected: BTreeMap<String, Vec<String>> = first
        .keys()
        .map(|id| (id.clone(), vec!["1".to_owned(), "2".to_owned()]))
        .collect();
    assert_eq!(
        copies, &expected,
        "each event twice, under its unchanged id: generation 1, then the redelivery's 2"
    );
}

/// The `Outbox-Created-At` header a message of `event_id` must carry: its row's enqueue
/// time, the same in every copy.
pub async fn enqueue_time(pool: &PgPool, event_id: &str) -> TestResult<String> {
    let created_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT created_at FROM chaos_events WHERE event_id = $1")
            .bind(event_id)
            .fetch_one(pool)
            .await?;
    Ok(outbox::message::timestamp(created_at.into()))
}

/// Bad input through `sink`: `ok-1`, an event named after each of `refused` (name, then
/// the reason its `last_error` must give), and `ok-2` are enqueued in that order and
/// published by a relay. Each refused event must be `DEAD` after its one attempt, with
/// its reason, and the two good ones `SENT`: one bad event costs no other. The caller
/// checks what the broker holds.
pub async fn refused_events_are_dead_and_the_others_sent(
    pool: &PgPool,
    sink: impl Sink<ChaosEvent>,
    refused: &[(&str, &str)],
) -> TestResult {
    let names = std::iter::once("ok-1")
        .chain(refused.iter().map(|(name, _)| *name))
        .chain(std::iter::once("ok-2"));
    let events: Vec<ChaosEvent> = names
        .map(|name| ChaosEvent {
            key: name.to_owned(),
            order_seq: 1,
        })
        .collect();
    enqueue(pool, &events).await;
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink).poll_interval(Duration::from_millis(50)),
    );
    let dead = i64::try_from(refused.len())?;
    let done = format!("2 SENT and {dead} DEAD");
    wait_until(&done, Duration::from_secs(30), async || {
        let stats = outbox::stats::<ChaosEvent>(pool).await.unwrap();
        (stats.sent, stats.dead) == (2, dead)
    })
    .await;
    relay.stop().await?;

    for &(name, reason) in refused {
        let row = row_of::<ChaosEvent>(pool, name).await;
        let error = row.last_error.unwrap_or_default();
        // Some names are long: the start says which.
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("DEAD", 1),
            "{name:.40}: {error}"
        );
        assert!(error.contains(reason), "{name:.40}: {error}");
    }
    for name in ["ok-1", "ok-2"] {
        let row = row_of::<ChaosEvent>(pool, name).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{name}");
    }
    Ok(())
}

/// Ten events enqueued and published through `sink`, whose broker is away behind
/// `proxy` (down) until the relay has held back five batches: no attempt is counted
/// while it is away, and every event is `SENT` after one counted attempt once `proxy` is
/// up again. The caller checks what the broker holds.
pub async fn ride_out_an_outage(
    pool: &PgPool,
    proxy: &mut Proxy,
    sink: impl Sink<ChaosEvent>,
) -> TestResult {
    // A current-thread runtime polls the relay's tasks on this thread: they count here.
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let events: Vec<ChaosEvent> = (1..=10)
        .map(|n| ChaosEvent {
            key: format!("shipment-{n}"),
            order_seq: n,
        })
        .collect();
    enqueue(pool, &events).await;
    let relay = start(
        Relay::<ChaosEvent, _>::new(pool.clone(), sink)
            .poll_interval(Duration::from_millis(50))
            .unavailable_backoff(Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(500),
            )),
    );
    let table = ChaosEvent::SPEC.table();
    wait_until("5 batches held back", Duration::from_secs(20), async || {
        counters.get(outbox::relay::metric::UNAVAILABLE, table) >= 5
    })
    .await;
    let burnt: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM chaos_events WHERE attempts > 1 OR status = 'DEAD'",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(burnt, 0, "no attempt counted while the broker is away");

    proxy.up().await?;
    wait_until("all 10 SENT", Duration::from_mins(1), async || {
        outbox::stats::<ChaosEvent>(pool).await.unwrap().sent == 10
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
        assert!(row.generation >= 5, "claimed through the outage: {row:?}");
        // Handed back with the outage's reason, which stays for the record.
        assert!(
            row.last_error
                .as_deref()
                .is_some_and(|error| error.starts_with("destination unavailable: ")),
            "{row:?}"
        );
    }
    assert_eq!(counters.get(outbox::relay::metric::RETRIED, table), 0);
    Ok(())
}

/// The first relay of a broker-level redelivery test: the child reported on its protocol
/// line (marked `mark`) that the broker took the batch (`verb`, then one word per
/// event), and died by SIGKILL before recording anything. Checks both, and that each of
/// `event_ids` (of `T`) is still `INPROGRESS` under its first claim; returns the words.
pub async fn killed_after_the_broker_took<T: outbox::Outbox>(
    first: &mut super::child::Child,
    (mark, verb): (&'static str, &str),
    pool: &PgPool,
    event_ids: &[&str],
) -> TestResult<Vec<String>> {
    use std::os::unix::process::ExitStatusExt as _;
    let line = super::child::handshake(first.stderr()?, mark, Duration::from_mins(1)).await?;
    let status = first.wait()?;
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.get(1), Some(&verb), "the child: {line}");
    assert_eq!(
        status.signal(),
        Some(9),
        "the first relay died by SIGKILL: {status:?}"
    );
    assert_eq!(words.len() - 2, event_ids.len(), "{line}");
    for event_id in event_ids {
        let row = row_of::<T>(pool, *event_id).await;
        assert_eq!(
            (row.status.as_str(), row.generation, row.attempts),
            ("INPROGRESS", 1, 1),
            "taken by the broker ({verb}), not recorded: {event_id}"
        );
    }
    Ok(words[2..].iter().map(|word| (*word).to_owned()).collect())
}

/// The event ids of `events`.
pub fn keys(events: &[ChaosEvent]) -> Vec<&str> {
    events.iter().map(|event| event.key.as_str()).collect()
}

/// `event_id:generation`, as a redelivery child reports each event.
pub fn event_and_generation(word: &str) -> (String, i64) {
    let (event_id, generation) = word.rsplit_once(':').expect("event_id:generation");
    (
        event_id.to_owned(),
        generation.parse().expect("a generation"),
    )
}
