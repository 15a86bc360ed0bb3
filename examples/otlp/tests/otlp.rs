//! The OTLP example against a collector of the test's own: an HTTP server taking
//! `POST /v1/traces` as the OpenTelemetry Collector does, decoding each export.

use std::error::Error;
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use outbox::testing::TestSchema;
use prost::Message as _;

type TestResult<T = ()> = Result<T, Box<dyn Error>>;

/// The spans a collector received, each with its resource's `service.name`.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<(String, Span)>>>);

impl Received {
    fn named(&self, name: &str) -> Vec<(String, Span)> {
        let spans = self.0.lock().unwrap();
        spans
            .iter()
            .filter(|(_, span)| span.name == name)
            .cloned()
            .collect()
    }
}

/// A collector on a port of its own: OTLP/HTTP with protobuf bodies, as on 4318.
async fn collector() -> TestResult<(String, Received)> {
    let received = Received::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(export))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((endpoint, received))
}

/// One export: decoded, its spans kept; refused unless it is protobuf.
async fn export(
    axum::extract::State(received): axum::extract::State<Received>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    if headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        != Some("application/x-protobuf")
    {
        return StatusCode::UNSUPPORTED_MEDIA_TYPE;
    }
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return StatusCode::BAD_REQUEST;
    };
    let mut spans = received.0.lock().unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .as_ref()
            .and_then(|resource| text(&resource.attributes, "service.name"))
            .unwrap_or_default();
        for scope_spans in resource_spans.scope_spans {
            spans.extend(
                scope_spans
                    .spans
                    .into_iter()
                    .map(|span| (service.clone(), span)),
            );
        }
    }
    StatusCode::OK
}

/// The text attribute `key`.
fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref() {
            Some(AnyValue {
                value: Some(Value::StringValue(text)),
            }) => Some(text.clone()),
            _ => None,
        })
}

/// Runs the example against `database_url`, exporting to `endpoint`.
async fn run(database_url: &str, endpoint: &str) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_otlp"));
    command
        .env("DATABASE_URL", database_url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("OTEL_SERVICE_NAME")
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_mins(2), command.output())
        .await
        .expect("the example finishes within 2 minutes")
        .expect("the example runs")
}

fn describe(output: &Output) -> String {
    format!(
        "{}\n--- stdout:\n{}--- stderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The line of `output` after `prefix`, after checking the example succeeded and
/// published its event.
fn printed(output: &Output, prefix: &str) -> String {
    assert!(output.status.success(), "{}", describe(output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        stdout.lines().last(),
        Some("published; spans exported"),
        "{}",
        describe(output)
    );
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line: {}", describe(output)))
        .to_owned()
}

#[tokio::test]
async fn the_request_and_the_relays_send_reach_the_collector_as_one_trace() -> TestResult {
    let (endpoint, received) = collector().await?;
    let schema = TestSchema::new().await?;
    let output = run(&schema.url(), &endpoint).await;
    let trace_id = printed(&output, "trace ");

    let [(service, request)] = received
        .named("POST /orders")
        .try_into()
        .map_err(|spans| format!("one request span: {spans:?}\n{}", describe(&output)))?;
    let sends = received.named("send traced_order_events");
    assert!(!sends.is_empty(), "no send span: {}", describe(&output));
    assert_eq!(service, "shop");
    assert_eq!(
        hex(&request.trace_id),
        trace_id,
        "the trace the example printed"
    );
    assert_eq!(request.kind, SpanKind::Server as i32);
    for (service, send) in &sends {
        assert_eq!(service, "shop");
        assert_eq!(send.trace_id, request.trace_id, "one trace");
        assert_eq!(
            send.parent_span_id, request.span_id,
            "a child of the request"
        );
        assert_eq!(send.kind, SpanKind::Producer as i32);
        assert_eq!(
            text(&send.attributes, "messaging.message.id"),
            Some(format!("order-{trace_id}"))
        );
        assert_eq!(
            text(&send.attributes, "outbox.table").as_deref(),
            Some("traced_order_events")
        );
    }

    let status: Vec<(String,)> = sqlx::query_as("SELECT status FROM traced_order_events")
        .fetch_all(schema.pool())
        .await?;
    assert_eq!(status, [("SENT".to_owned(),)]);
    schema.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn without_a_collector_the_event_is_published_all_the_same() -> TestResult {
    // A port nothing listens on: one just freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let schema = TestSchema::new().await?;
    let output = run(&schema.url(), &format!("http://127.0.0.1:{port}")).await;
    printed(&output, "trace ");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("BatchSpanProcessor.ExportError"),
        "the failed export is logged: {}",
        describe(&output)
    );
    let status: Vec<(String,)> = sqlx::query_as("SELECT status FROM traced_order_events")
        .fetch_all(schema.pool())
        .await?;
    assert_eq!(status, [("SENT".to_owned(),)], "{}", describe(&output));
    schema.drop_schema().await?;
    Ok(())
}

/// `bytes` as lowercase hex digits, as a trace id is printed.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    })
}
