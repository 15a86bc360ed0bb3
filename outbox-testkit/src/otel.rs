//! The trace tests' side of OpenTelemetry: spans exported in memory,
//! a request that enqueues traced orders, and the one trace a consumer's inbox must end.

use std::sync::OnceLock;

use opentelemetry::baggage::BaggageExt as _;
use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Instrument as _;
use tracing::subscriber::DefaultGuard;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

use super::TestResult;
use super::events::TracedOrder;

/// Spans of this thread exported in memory, until dropped. (The tests run on tokio's
/// current-thread runtime: the relay's tasks run on this thread.)
pub struct Exported {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _guard: DefaultGuard,
}

impl Exported {
    /// Exports every span of this thread from now on.
    pub fn install() -> Self {
        ask_every_dispatcher();
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests")));
        let guard = tracing::subscriber::set_default(subscriber);
        Self {
            exporter,
            provider,
            _guard: guard,
        }
    }

    /// The provider exporting here: a relay's `send` spans come from it with
    /// `Relay::tracer_provider`.
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }

    /// Every span ended so far.
    pub fn spans(&self) -> Vec<SpanData> {
        self.exporter
            .get_finished_spans()
            .expect("the exported spans")
    }

    /// The spans ended so far named `name`.
    pub fn named(&self, name: &str) -> Vec<SpanData> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }

    /// Enqueues `orders` inside an HTTP-request-like span carrying the baggage
    /// [`BAGGAGE`] (as a service's incoming request would), in one business transaction;
    /// returns the request span's trace and span ids.
    pub async fn enqueue_in_a_request(
        &self,
        pool: &sqlx::PgPool,
        orders: &[TracedOrder],
    ) -> TestResult<(TraceId, SpanId)> {
        let request = tracing::info_span!("POST /orders", otel.kind = "server");
        let _ = request.set_parent(
            opentelemetry::Context::new()
                .with_baggage([opentelemetry::KeyValue::new(BAGGAGE.0, BAGGAGE.1)]),
        );
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
        let request = self.named("POST /orders").pop().ok_or("no request span")?;
        Ok((
            request.span_context.trace_id(),
            request.span_context.span_id(),
        ))
    }

    /// The trace of one order from its request to `consumer`'s inbox: the relay's `send`
    /// spans (one per attempt: a broker's timeout makes a second), each a producer and a
    /// child of the `request`, and one `process <destination>` span, a consumer and a
    /// child of the send whose copy it processed, naming the consumer and a first
    /// delivery; all in the request's trace, each naming the broker (`system`) and the
    /// destination.
    pub fn assert_one_trace(
        &self,
        (trace_id, request): (TraceId, SpanId),
        (system, destination): (&str, &str),
        consumer: &str,
    ) -> TestResult {
        let sends = self.named("send traced_order_events");
        assert!(!sends.is_empty(), "no send span");
        for send in &sends {
            assert_eq!(
                send.span_context.trace_id(),
                trace_id,
                "the request's trace"
            );
            assert_eq!(
                send.parent_span_id, request,
                "sent as a child of the request"
            );
            assert_eq!(send.span_kind, SpanKind::Producer);
            assert_eq!(
                (
                    attribute(send, "messaging.system").as_deref(),
                    attribute(send, "messaging.destination.name").as_deref(),
                    attribute(send, "outbox.table").as_deref(),
                ),
                (Some(system), Some(destination), Some("traced_order_events")),
                "the broker and its destination, and the outbox's table"
            );
        }
        let processes = self.named(&format!("process {destination}"));
        let [process] = processes.as_slice() else {
            return Err(format!("one process span: {processes:?}").into());
        };
        assert_eq!(process.span_context.trace_id(), trace_id, "one trace");
        assert!(
            sends
                .iter()
                .any(|send| send.span_context.span_id() == process.parent_span_id),
            "processed as a child of a relay's send: {process:?}"
        );
        assert_eq!(process.span_kind, SpanKind::Consumer);
        assert_eq!(
            attribute(process, "messaging.system").as_deref(),
            Some(system)
        );
        assert_eq!(
            attribute(process, "messaging.consumer.group.name").as_deref(),
            Some(consumer)
        );
        assert_eq!(
            attribute(process, "outbox.duplicate").as_deref(),
            Some("false")
        );
        Ok(())
    }
}

/// Keeps a second dispatcher registered for the whole process, so that tracing asks every
/// dispatcher whether a span is wanted. While only one exists, it asks the default of
/// whichever thread reaches a span's callsite first, and caches the answer for everyone:
/// a test on a thread without a subscriber would hide the relay's spans from the test
/// that exports them.
fn ask_every_dispatcher() {
    static SECOND: OnceLock<tracing::Dispatch> = OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

/// The baggage entry of every request of [`Exported::enqueue_in_a_request`]: a value
/// that needs percent-encoding in the `baggage` header.
pub const BAGGAGE: (&str, &str) = ("tenant", "acme co");

/// The baggage entry `key` of the current span's context, as the consumer's code reads it.
pub fn current_baggage(key: &str) -> Option<String> {
    tracing::Span::current()
        .context()
        .baggage()
        .get(key)
        .map(ToString::to_string)
}

/// The attribute `key` of `span`, as text.
pub fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// A traced order named `name`.
pub fn order(name: &str) -> TracedOrder {
    TracedOrder {
        name: name.into(),
        customer: "ada".into(),
    }
}
