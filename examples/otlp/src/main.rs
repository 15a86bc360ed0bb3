//! A traced service exporting its spans over OTLP/HTTP: a request enqueues an order's
//! event, the relay publishes it in the request's trace, and the collector that
//! `OTEL_EXPORTER_OTLP_ENDPOINT` names receives one trace (`POST /orders`, then
//! `send traced_order_events`, its child).
//!
//! ```text
//! docker run -p 4318:4318 otel/opentelemetry-collector   # or Jaeger, Tempo, ...
//! OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 DATABASE_URL=postgres://... \
//!     cargo run -p otlp
//! ```
//!
//! Tracing never fails the outbox: with no collector listening, the exporter logs its
//! failures and the event is published all the same.

use std::time::Duration;

use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::SpanExporter;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use outbox::{CancellationToken, Relay, StdoutSink};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Layer as _, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

/// The event: `traced` keeps the enqueuing span's trace context in the row. (Its table is
/// the one the repository's traced tests use, so that the `checked` build knows it.)
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(table = "traced_order_events", traced)]
struct OrderPlaced {
    #[outbox(event_id)]
    order_id: String,
    customer: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The exporter reads OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/traces` is appended), and the
    // resource OTEL_SERVICE_NAME; the batch processor exports from a thread of its own.
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(SpanExporter::builder().with_http().build()?)
        .with_resource(Resource::builder().with_service_name("shop").build())
        .build();
    // The relay's `send` spans come from the global provider (or `Relay::tracer_provider`).
    opentelemetry::global::set_tracer_provider(provider.clone());
    // The application's own spans, through `tracing`: what enqueue reads its context from.
    // INFO and above: the exporter's HTTP client logs each connection at DEBUG and TRACE.
    tracing_subscriber::registry()
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("shop"))
                .with_filter(LevelFilter::INFO),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(LevelFilter::INFO),
        )
        .init();

    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let pool = outbox::connect(&url).await?;
    outbox::migrate(&pool, &[OrderPlaced::migrations()]).await?;

    // A request handler: the business transaction enqueues inside the request's span.
    let request = tracing::info_span!("POST /orders", otel.kind = "server");
    let trace_id = request.context().span().span_context().trace_id();
    async {
        let order = OrderPlaced {
            order_id: format!("order-{trace_id}"),
            customer: "ada@example.com".into(),
        };
        let mut tx = pool.begin().await?;
        let enqueued = order.enqueue(&mut *tx).await?;
        tx.commit().await?;
        println!("enqueued {}", enqueued.event_id());
        Ok::<_, Box<dyn std::error::Error>>(())
    }
    .instrument(request)
    .await?;
    println!("trace {trace_id}");

    // The relay, as a service runs it; stopped here once nothing is left to publish.
    let shutdown = CancellationToken::new();
    let mut relay = tokio::spawn(
        Relay::<OrderPlaced, _>::new(pool.clone(), StdoutSink)
            .poll_interval(Duration::from_millis(100))
            .run(shutdown.clone()),
    );
    loop {
        let stats = outbox::stats::<OrderPlaced>(&pool).await?;
        if stats.ready + stats.in_progress == 0 {
            break;
        }
        tokio::select! {
            stopped = &mut relay => {
                stopped??;
                return Err("the relay stopped on its own".into());
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    shutdown.cancel();
    relay.await??;

    // Exports what the batch processor still holds before the process ends.
    if let Err(error) = provider.shutdown() {
        eprintln!("exporting the last spans failed: {error}");
    }
    println!("published; spans exported");
    Ok(())
}
