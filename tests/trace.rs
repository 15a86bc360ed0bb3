//! One trace from the request to the consumer (`#[outbox(traced)]`, feature `otel`): an
//! HTTP-request-like span enqueues an order inside its business transaction, a relay
//! publishes it (through real NATS JetStream, or in memory), and a consumer handles it
//! under `outbox::trace::consumer_span`. OpenTelemetry's in-memory exporter shows one
//! trace: request -> send (producer, one per attempt, a retry or a reclaim included) ->
//! process (consumer).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::nats::async_nats::jetstream::{self, consumer, stream};
use outbox::nats::{JetStreamSink, async_nats};
use outbox::relay::MemorySink;
use outbox::{Delivery, Relay, Sink, SinkError};
use outbox_testkit::cleanup::Cleanup;
use outbox_testkit::events::TracedOrder;
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use tracing::Instrument as _;
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::SubscriberExt as _;

/// Spans of this thread exported in memory, until the guard drops. (The tests run on
/// tokio's current-thread runtime: the relay's tasks run on this thread.)
struct Exported {
    exporter: InMemorySpanExporter,
    _provider: SdkTracerProvider,
    _guard: DefaultGuard,
}

impl Exported {
    fn install() -> Self {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests")));
        let guard = tracing::subscriber::set_default(subscriber);
        Self {
            exporter,
            _provider: provider,
            _guard: guard,
        }
    }

    fn spans(&self) -> Vec<SpanData> {
        self.exporter
            .get_finished_spans()
            .expect("the exported spans")
    }

    fn named(&self, name: &str) -> Vec<SpanData> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn order(name: &str) -> TracedOrder {
    TracedOrder {
        name: name.into(),
        customer: "ada".into(),
    }
}

/// Enqueues `orders` inside a request span, in one business transaction; returns the
/// request span's trace and span ids.
async fn enqueue_in_a_request(
    pool: &sqlx::PgPool,
    exported: &Exported,
    orders: &[TracedOrder],
) -> TestResult<(TraceId, SpanId)> {
    let request = tracing::info_span!("POST /orders", otel.kind = "server");
    async {
        let mut tx = pool.begin().await?;
        for order in orders {
            order.enqueue(&mut *tx).await?;
        }
        tx.commit().await?;
        TestResult::Ok(())
    }
    .instrument(request)
    .await?;
    let request = exported
        .named("POST /orders")
        .pop()
        .ok_or("no request span")?;
    Ok((
        request.span_context.trace_id(),
        request.span_context.span_id(),
    ))
}

/// The `trace_parent` of the table's one row.
async fn stored_trace_parent(pool: &sqlx::PgPool) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT trace_parent FROM traced_order_events")
        .fetch_one(pool)
        .await
}

/// Runs a relay until it has published the table's one order.
async fn publish_the_one_order(pool: &sqlx::PgPool) -> TestResult {
    let sink = MemorySink::new();
    let relay = start(Relay::<TracedOrder, _>::new(pool.clone(), sink.clone()));
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
    let (trace_id, request) = enqueue_in_a_request(pool, &exported, &[order("o-1")]).await?;
    let stored = stored_trace_parent(pool).await?;
    let stored = stored.ok_or("no trace context stored")?;
    assert!(
        stored.starts_with(&format!("00-{trace_id}-{request}-")),
        "the request's context, in the same INSERT: {stored}"
    );

    publish_the_one_order(pool).await?;

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
    let (trace_id, request) =
        enqueue_in_a_request(pool, &exported, &[order("reclaimed"), order("retried")]).await?;

    // "reclaimed": claimed by a publisher that dies holding it (its 1 s lease ends).
    let abandoned = TracedOrder::claim(pool).await?.ok_or("the first order")?;
    assert_eq!(abandoned.event().name, "reclaimed");
    drop(abandoned);

    let relay = start(Relay::<TracedOrder, _>::new(
        pool.clone(),
        FailsOnce::default(),
    ));
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
    publish_the_one_order(pool).await?;
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

    let garbage = outbox::trace::TraceContext::parse("garbage", Some("k=v"));
    assert_eq!(garbage, None, "left out");
    let span = outbox::trace::consumer_span("orders", "x", garbage.as_ref());
    drop(span.entered());
    let process = exported.named("process orders");
    assert_eq!(process.len(), 1);
    assert_eq!(process[0].parent_span_id, SpanId::INVALID);
    assert_eq!(process[0].span_kind, SpanKind::Consumer);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn through_nats_the_consumer_span_continues_the_relays_send() -> TestResult {
    let exported = Exported::install();
    let db = schema_from_zero(&[TracedOrder::migrations()]).await?;
    let pool = db.pool();
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
    let (trace_id, _) = enqueue_in_a_request(pool, &exported, &[order("o-nats")]).await?;
    let relay = start(Relay::<TracedOrder, _>::new(
        pool.clone(),
        JetStreamSink::new(js.clone(), subject),
    ));
    wait_until("SENT", Duration::from_secs(10), async || {
        outbox::stats::<TracedOrder>(pool).await.unwrap().sent == 1
    })
    .await;
    relay.stop().await?;

    // The consumer: the message's headers, as any OpenTelemetry consumer reads them.
    let consumer = stream
        .create_consumer(consumer::pull::Config::default())
        .await?;
    let mut messages = consumer.fetch().max_messages(1).messages().await?;
    let message = messages
        .next()
        .await
        .ok_or("no message")?
        .map_err(|e| e.to_string())?;
    let trace = outbox::nats::trace(&message).ok_or("no trace context in the message")?;
    let span = outbox::trace::consumer_span("traced", "o-nats", Some(&trace));
    async {}.instrument(span).await;

    let [send] = exported
        .named("send traced_order_events")
        .try_into()
        .map_err(|_| "one send")?;
    let [process] = exported
        .named("process traced")
        .try_into()
        .map_err(|_| "one process")?;
    assert_eq!(
        trace.traceparent(),
        format!("00-{trace_id}-{}-01", send.span_context.span_id()),
        "the message carries the send span's context"
    );
    assert_eq!(
        process.span_context.trace_id(),
        trace_id,
        "one trace to the consumer"
    );
    assert_eq!(process.parent_span_id, send.span_context.span_id());
    assert_eq!(process.span_kind, SpanKind::Consumer);
    cleanup.run().await?;
    db.drop_schema().await?;
    Ok(())
}
