//! One trace from the request to the consumer (`#[outbox(traced)]`, feature `otel`): an
//! HTTP-request-like span enqueues an order inside its business transaction, a relay
//! publishes it (through real NATS JetStream, or in memory), and a consumer handles it
//! in the inbox's span. OpenTelemetry's in-memory exporter shows one
//! trace: request -> send (producer, one per attempt, a retry or a reclaim included) ->
//! process (consumer).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry_sdk::trace::SpanData;
use outbox::inbox::{self, Consumed as _};
use outbox::nats::async_nats::jetstream::{self, consumer, stream};
use outbox::nats::{JetStreamSink, async_nats};
use outbox::relay::MemorySink;
use outbox::{Delivery, Inbox, Relay, Sink, SinkError};
use outbox_testkit::cleanup::Cleanup;
use outbox_testkit::events::TracedOrder;
use outbox_testkit::otel::{BAGGAGE, Exported, attribute, current_baggage, order};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use tracing::Instrument as _;

/// The `trace_parent` of the table's one row.
async fn stored_trace_parent(pool: &sqlx::PgPool) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT trace_parent FROM traced_order_events")
        .fetch_one(pool)
        .await
}

/// Runs a relay, its spans exported, until it has published the table's one order.
async fn publish_the_one_order(pool: &sqlx::PgPool, exported: &Exported) -> TestResult {
    let sink = MemorySink::new();
    let relay = start(
        Relay::<TracedOrder, _>::new(pool.clone(), sink.clone())
            .tracer_provider(exported.provider()),
    );
    wait_until("published", Duration::from_secs(10), async || {
        sink.published().len() == 1
    })
    .await;
    relay.stop().await?;
    Ok(())
}

#[tokio::test]
async fn the_relays_send_is_a_producer_span_in_the_trace_that_enqueued_the_event() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    let (trace_id, request) = exported.enqueue_in_a_request(pool, &[order("o-1")]).await?;
    let stored = stored_trace_parent(pool).await?;
    let stored = stored.ok_or("no trace context stored")?;
    assert!(
        stored.starts_with(&format!("00-{trace_id}-{request}-")),
        "the request's context, in the same INSERT: {stored}"
    );
    let baggage: Option<String> =
        sqlx::query_scalar("SELECT trace_baggage FROM traced_order_events")
            .fetch_one(pool)
            .await?;
    assert_eq!(
        baggage.as_deref(),
        Some("tenant=acme%20co"),
        "and its baggage, as the W3C header has it"
    );

    publish_the_one_order(pool, &exported).await?;

    let sends = exported.named("send traced_order_events");
    let [send] = sends.as_slice() else {
        panic!("one send span: {sends:?}");
    };
    assert_eq!(
        send.span_context.trace_id(),
        trace_id,
        "the request's trace"
    );
    assert_eq!(
        send.parent_span_id, request,
        "a child of the enqueuing span"
    );
    assert_eq!(send.span_kind, SpanKind::Producer);
    assert_eq!(
        attribute(send, "messaging.message.id").as_deref(),
        Some("o-1")
    );
    assert_eq!(
        attribute(send, "messaging.operation.type").as_deref(),
        Some("send")
    );
    assert_eq!(attribute(send, "outbox.attempt").as_deref(), Some("1"));
    assert_eq!(send.status, Status::Unset);
    db.drop_schema().await?;
    Ok(())
}

/// An event's name, and the `traceparent` it was handed to the sink with.
type Handed = (String, Option<String>);

/// Records what each event was handed to it with.
#[derive(Clone, Default)]
struct Contexts(std::sync::Arc<std::sync::Mutex<Vec<Handed>>>);

impl Sink<TracedOrder> for Contexts {
    async fn publish(&self, batch: &[Delivery<'_, TracedOrder>]) -> Vec<Result<(), SinkError>> {
        let mut seen = self.0.lock().unwrap();
        batch
            .iter()
            .map(|delivery| {
                let parent = delivery.trace().map(|t| t.traceparent().to_owned());
                seen.push((delivery.event().name.clone(), parent));
                Ok(())
            })
            .collect()
    }
}

#[tokio::test]
async fn an_event_of_an_unsampled_request_gets_no_send_span_and_keeps_its_context() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    let (trace_id, request) = exported
        .enqueue_in_a_request(pool, &[order("sampled"), order("unsampled")])
        .await?;
    // As a request its sampler left out would have stored it: flags 00.
    let unsampled = format!("00-{trace_id}-{request}-00");
    sqlx::query("UPDATE traced_order_events SET trace_parent = $1 WHERE event_id = 'unsampled'")
        .bind(&unsampled)
        .execute(pool)
        .await?;

    // A relay whose sampler records every span it is asked for: the relay does not ask
    // for one under a request that was not sampled.
    let relays_spans = opentelemetry_sdk::trace::InMemorySpanExporter::default();
    let always_on = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_sampler(opentelemetry_sdk::trace::Sampler::AlwaysOn)
        .with_simple_exporter(relays_spans.clone())
        .build();
    let sink = Contexts::default();
    let relay =
        start(Relay::<TracedOrder, _>::new(pool.clone(), sink.clone()).tracer_provider(&always_on));
    wait_until("both SENT", Duration::from_secs(10), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 2
    })
    .await;
    relay.stop().await?;

    let sends: Vec<SpanData> = relays_spans
        .get_finished_spans()?
        .into_iter()
        .filter(|span| span.name == "send traced_order_events")
        .collect();
    let [send] = sends.as_slice() else {
        panic!("a send span for the sampled request's event alone: {sends:?}");
    };
    assert_eq!(
        attribute(send, "messaging.message.id").as_deref(),
        Some("sampled")
    );
    let handed = sink.0.lock().unwrap().clone();
    assert!(
        handed.contains(&("unsampled".to_owned(), Some(unsampled))),
        "the stored context, as it is, for the consumer to continue: {handed:?}"
    );
    assert!(
        handed.contains(&(
            "sampled".to_owned(),
            Some(format!("00-{trace_id}-{}-01", send.span_context.span_id()))
        )),
        "the sampled one under its send span: {handed:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

/// Refuses each event's first attempt (transient), then publishes it.
#[derive(Default)]
struct FailsOnce(AtomicBool);

impl Sink<TracedOrder> for FailsOnce {
    async fn publish(&self, batch: &[Delivery<'_, TracedOrder>]) -> Vec<Result<(), SinkError>> {
        let failed_before = self.0.swap(true, Ordering::SeqCst);
        batch
            .iter()
            .map(|_| {
                if failed_before {
                    Ok(())
                } else {
                    Err(SinkError::transient("the broker said no, this once"))
                }
            })
            .collect()
    }
}

#[tokio::test]
async fn a_retry_and_a_reclaim_are_new_send_spans_of_the_same_trace() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    let (trace_id, request) = exported
        .enqueue_in_a_request(pool, &[order("reclaimed"), order("retried")])
        .await?;

    // "reclaimed": claimed by a publisher that dies holding it (its 1 s lease ends).
    let abandoned = TracedOrder::claim(pool).await?.ok_or("the first order")?;
    assert_eq!(abandoned.event().name, "reclaimed");
    drop(abandoned);

    let relay = start(
        Relay::<TracedOrder, _>::new(pool.clone(), FailsOnce::default())
            .tracer_provider(exported.provider()),
    );
    wait_until("both SENT", Duration::from_secs(20), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 2
    })
    .await;
    relay.stop().await?;

    let sends = exported.named("send traced_order_events");
    assert!(sends.len() >= 3, "{sends:?}");
    for send in &sends {
        assert_eq!(send.span_context.trace_id(), trace_id, "one trace");
        assert_eq!(
            send.parent_span_id, request,
            "each a child of the enqueuing span"
        );
    }
    let failed: Vec<&SpanData> = sends
        .iter()
        .filter(|s| matches!(s.status, Status::Error { .. }))
        .collect();
    assert!(!failed.is_empty(), "the refused attempt says so");
    let reclaimed: Vec<String> = sends
        .iter()
        .filter(|s| attribute(s, "messaging.message.id").as_deref() == Some("reclaimed"))
        .filter_map(|s| attribute(s, "outbox.attempt"))
        .collect();
    assert!(
        reclaimed.iter().any(|attempt| attempt != "1"),
        "the reclaim is a later attempt: {reclaimed:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn no_trace_or_a_malformed_one_is_left_out_and_never_fails() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    order("outside any span").enqueue(pool).await?;
    let stored = stored_trace_parent(pool).await?;
    assert_eq!(stored, None);

    // A row whose stored context was mangled by hand is published all the same.
    sqlx::query("UPDATE traced_order_events SET trace_parent = '00-not-a-trace-01'")
        .execute(pool)
        .await?;
    publish_the_one_order(pool, &exported).await?;
    let sends = exported.named("send traced_order_events");
    assert_eq!(sends.len(), 1);
    let [batch] = exported
        .named("outbox.batch")
        .try_into()
        .map_err(|_| "one batch")?;
    assert_eq!(
        sends[0].parent_span_id,
        batch.span_context.span_id(),
        "no trace to continue: a child of the relay's own batch span"
    );

    let span = Garbage.consumer_span();
    drop(span.entered());
    let process = exported.named("process orders");
    assert_eq!(process.len(), 1);
    assert_eq!(process[0].parent_span_id, SpanId::INVALID);
    assert_eq!(process[0].span_kind, SpanKind::Consumer);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn through_nats_one_trace_from_the_request_to_the_consumers_inbox() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
    inbox::migrate(pool).await?;
    let url = std::env::var("OUTBOX_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&url).await?);
    let (name, subject) = (
        db.name().to_uppercase(),
        format!("outbox.test.{}.traced", db.name()),
    );
    // Deleted at the end, or when the test fails first: nothing left on the shared server.
    let cleanup = Cleanup::new(format!("the NATS stream {name}"), {
        let (url, name) = (url.clone(), name.clone());
        move || async move {
            let js = jetstream::new(async_nats::connect(&url).await?);
            js.delete_stream(&name).await?;
            Ok(())
        }
    });
    let stream = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await?;
    let request = exported
        .enqueue_in_a_request(pool, &[order("o-nats")])
        .await?;
    let relay = start(
        Relay::<TracedOrder, _>::new(
            pool.clone(),
            JetStreamSink::new(js.clone(), subject.clone()),
        )
        .tracer_provider(exported.provider()),
    );
    wait_until("SENT", Duration::from_secs(10), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 1
    })
    .await;
    relay.stop().await?;

    // The consumer: the effect and its inbox row in one transaction, in the inbox's span.
    let consumer = stream
        .create_consumer(consumer::pull::Config::default())
        .await?;
    let mut messages = consumer.fetch().max_messages(1).messages().await?;
    let message = messages
        .next()
        .await
        .ok_or("no message")?
        .map_err(|e| e.to_string())?;
    let inbox = Inbox::new("billing");
    async {
        assert_eq!(
            current_baggage(BAGGAGE.0).as_deref(),
            Some(BAGGAGE.1),
            "the request's baggage, in the consumer's context"
        );
        let mut tx = pool.begin().await?;
        let event_id = message.event_id().ok_or("no event id")?;
        assert!(inbox.receive(&mut tx, event_id).await?.is_new());
        tx.commit().await?;
        message.ack().await.map_err(|e| e.to_string())?;
        TestResult::Ok(())
    }
    .instrument(inbox.span(&*message))
    .await?;

    exported.assert_one_trace(request, ("nats", &subject), "billing")?;
    let carried = message.trace().ok_or("no trace context")?;
    assert_eq!(
        carried.baggage(),
        Some("tenant=acme%20co"),
        "the baggage header"
    );
    assert!(
        exported
            .named("send traced_order_events")
            .iter()
            .any(|send| carried.traceparent()
                == format!("00-{}-{}-01", request.0, send.span_context.span_id())),
        "the message carries its send span's context: {carried:?}"
    );
    cleanup.run().await?;
    db.drop_schema().await?;
    Ok(())
}

/// A message of a broker of one's own whose `traceparent` is garbage.
struct Garbage;

impl outbox::inbox::Consumed for Garbage {
    fn event_id(&self) -> Option<&str> {
        Some("x")
    }

    fn system(&self) -> &'static str {
        "own"
    }

    fn destination(&self) -> &'static str {
        "orders"
    }

    fn trace(&self) -> Option<outbox::trace::TraceContext> {
        let garbage = outbox::trace::TraceContext::parse("garbage", Some("k=v"));
        assert_eq!(garbage, None, "left out");
        garbage
    }
}
