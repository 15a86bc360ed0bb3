//! One trace from the request to the consumer: the [W3C Trace Context] an event was
//! enqueued in, kept with it (`#[outbox(traced)]`) and sent with it.
//!
//! An outbox cuts a trace in two: the request that enqueued an event ends at the
//! `INSERT`, and the publication starts later, in another process. On a traced type,
//! enqueue keeps the current span's context in the row (`trace_parent`, `trace_state`,
//! in the same `INSERT`), and every message the relay publishes carries a
//! [`TraceContext`] in its `traceparent` and `tracestate` headers:
//!
//! - with the cargo feature `otel`, the context of the relay's own span for that
//!   publication (`send <table>`, span kind producer, OpenTelemetry's messaging
//!   attributes), a child of the enqueuing span: one trace from the request, through
//!   each attempt of the relay (a retry or a reclaim after a crash is a new span of the
//!   same trace, with its attempt and generation), to the consumer, whose span
//!   continues it (`Inbox::span` with the feature, or
//!   `consumer_span` from the context each broker module's `trace` reads);
//! - without it, the stored context as it is, so a consumer's span is a child of the
//!   enqueuing one.
//!
//! The context is the current [`tracing`] span's OpenTelemetry context (through
//! `tracing-opentelemetry`), in W3C form whatever propagator the application sets
//! globally. A malformed or oversized one is left out with a debug log: it never fails an
//! enqueue, a publication or a consumption.
//!
//! [W3C Trace Context]: https://www.w3.org/TR/trace-context/

/// The longest `tracestate` kept: 512 characters, W3C's limit for what a vendor may
/// propagate (longer ones are cut at a whole entry).
const MAX_STATE: usize = 512;

/// A W3C trace context: a `traceparent` (version `00`, a non-zero trace id and parent
/// id) and its `tracestate`, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    parent: String,
    state: Option<String>,
}

impl TraceContext {
    /// The context of `traceparent` and `tracestate`, if `traceparent` is one: `None`
    /// (with a debug log) for a malformed one. A `tracestate` longer than 512 characters
    /// is cut at its last whole entry within them; an empty one is none.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        if !is_traceparent(traceparent) {
            tracing::debug!(traceparent, "not a W3C traceparent (version 00): left out");
            return None;
        }
        Some(Self {
            parent: traceparent.to_owned(),
            state: tracestate.and_then(bounded_state),
        })
    }

    /// The `traceparent` header: `00-<trace id>-<parent id>-<flags>`.
    pub fn traceparent(&self) -> &str {
        &self.parent
    }

    /// The `tracestate` header, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.state.as_deref()
    }

    /// The trace id: 32 lowercase hex digits.
    pub fn trace_id(&self) -> &str {
        &self.parent[3..35]
    }

    /// The context of the current [`tracing`] span (feature `otel`): `None` without a
    /// span that OpenTelemetry samples or records, or without the feature.
    pub fn current() -> Option<Self> {
        #[cfg(feature = "otel")]
        {
            otel::current()
        }
        #[cfg(not(feature = "otel"))]
        {
            None
        }
    }
}

/// `00-` + 32 hex + `-` + 16 hex + `-` + 2 hex, lowercase, neither id all zeros.
fn is_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |part: &str, len: usize| {
        part.len() == len
            && part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let zero = |part: &str| part.bytes().all(|b| b == b'0');
    matches!(parts.as_slice(), [version, trace, parent, flags]
        if *version == "00"
            && hex(trace, 32) && !zero(trace)
            && hex(parent, 16) && !zero(parent)
            && hex(flags, 2))
}

/// `state`, cut at its last whole entry within [`MAX_STATE`] characters; `None` when
/// nothing is left.
fn bounded_state(state: &str) -> Option<String> {
    let state = state.trim();
    let mut kept = String::new();
    for entry in state.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let needed = entry.len() + usize::from(!kept.is_empty());
        if kept.len() + needed > MAX_STATE {
            tracing::debug!(
                tracestate = state,
                "tracestate over 512 characters: cut at a whole entry"
            );
            break;
        }
        if !kept.is_empty() {
            kept.push(',');
        }
        kept.push_str(entry);
    }
    (!kept.is_empty()).then_some(kept)
}

/// A consumer's span for handling one message (feature `otel`): `process <destination>`,
/// span kind consumer, a child of the `trace` the message carries (read it with
/// `outbox::nats::trace`, `outbox::kafka::trace` or `outbox::rabbitmq::trace`), so the
/// consumer's work joins the trace that enqueued the event; a root span without one.
/// Enter it (or `instrument` the handling with it) around the effect and the inbox's
/// `receive`.
#[cfg(feature = "otel")]
pub fn consumer_span(
    destination: &str,
    event_id: &str,
    trace: Option<&TraceContext>,
) -> tracing::Span {
    otel::consumer_span(destination, event_id, None, trace)
}

/// The relay's spans for publishing `deliveries` (feature `otel`, a traced type): one per
/// event, a child of the context it was enqueued in, whose own context each delivery then
/// carries. Ended by [`end_sends`] with the sink's results. None otherwise.
pub(crate) fn send_spans<T: crate::Outbox>(
    deliveries: &mut [crate::sink::Delivery<'_, T>],
) -> Vec<tracing::Span> {
    #[cfg(feature = "otel")]
    if T::SPEC.traced {
        return deliveries
            .iter_mut()
            .map(|delivery| {
                let span = otel::send_span(
                    T::SPEC.table,
                    delivery.event_id().as_str(),
                    delivery.attempt(),
                    delivery.generation().get(),
                    delivery.trace(),
                );
                if let Some(own) = otel::of_span(&span) {
                    delivery.trace = Some(own);
                }
                span
            })
            .collect();
    }
    let _ = deliveries;
    Vec::new()
}

/// Ends the spans of [`send_spans`], each with its event's result: an error's status and
/// reason, or none for a batch the sink never answered.
pub(crate) fn end_sends(
    spans: Vec<tracing::Span>,
    results: Option<&[Result<(), crate::sink::SinkError>]>,
) {
    for (i, span) in spans.into_iter().enumerate() {
        match results.and_then(|results| results.get(i)) {
            Some(Ok(())) => {}
            Some(Err(error)) => {
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", error.to_string());
            }
            None => {
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", "no answer from the sink");
            }
        }
    }
}

#[cfg(feature = "otel")]
pub(crate) mod otel {
    //! The OpenTelemetry side: contexts to and from [`TraceContext`], and the relay's and
    //! the consumer's spans.

    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use super::TraceContext;

    /// The current span's context, if OpenTelemetry has one for it.
    pub(super) fn current() -> Option<TraceContext> {
        of_span(&tracing::Span::current())
    }

    /// `span`'s OpenTelemetry context as a [`TraceContext`], if it has a valid one.
    pub(crate) fn of_span(span: &tracing::Span) -> Option<TraceContext> {
        let context = span.context();
        let span_context = context.span().span_context().clone();
        if !span_context.is_valid() {
            return None;
        }
        let state = span_context.trace_state().header();
        TraceContext::parse(
            &format!(
                "00-{}-{}-{:02x}",
                span_context.trace_id(),
                span_context.span_id(),
                span_context.trace_flags().to_u8()
            ),
            (!state.is_empty()).then_some(state.as_str()),
        )
    }

    /// The remote parent `trace` stands for.
    fn parent(trace: &TraceContext) -> Option<opentelemetry::Context> {
        let parts: Vec<&str> = trace.traceparent().split('-').collect();
        let [_, trace_id, span_id, flags] = parts.as_slice() else {
            return None;
        };
        let state = trace
            .tracestate()
            .and_then(|state| state.parse::<TraceState>().ok())
            .unwrap_or_default();
        let span_context = SpanContext::new(
            TraceId::from_hex(trace_id).ok()?,
            SpanId::from_hex(span_id).ok()?,
            TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
            true,
            state,
        );
        Some(opentelemetry::Context::new().with_remote_span_context(span_context))
    }

    /// Makes `span` a child of `trace`, before it is entered.
    fn set_parent(span: &tracing::Span, trace: Option<&TraceContext>) {
        if let Some(parent) = trace.and_then(parent) {
            // Fails only for a span no OpenTelemetry layer records: nothing to parent.
            let _ = span.set_parent(parent);
        }
    }

    /// The relay's span for publishing one event of `table`, a child of the context it
    /// was enqueued in: OpenTelemetry's messaging conventions for a send.
    pub(crate) fn send_span(
        table: &str,
        event_id: &str,
        attempt: u32,
        generation: i64,
        enqueued_in: Option<&TraceContext>,
    ) -> tracing::Span {
        let span = tracing::info_span!(
            target: "outbox",
            "send",
            otel.name = %format!("send {table}"),
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            messaging.system = "outbox",
            messaging.operation.type = "send",
            messaging.operation.name = "send",
            messaging.destination.name = table,
            messaging.message.id = event_id,
            outbox.attempt = attempt,
            outbox.generation = generation,
        );
        set_parent(&span, enqueued_in);
        span
    }

    /// See [`super::consumer_span`]; `consumer`, an inbox's consumer name, as the
    /// consumer group.
    pub(crate) fn consumer_span(
        destination: &str,
        event_id: &str,
        consumer: Option<&str>,
        trace: Option<&TraceContext>,
    ) -> tracing::Span {
        let span = tracing::info_span!(
            target: "outbox",
            "process",
            otel.name = %format!("process {destination}"),
            otel.kind = "consumer",
            messaging.system = "outbox",
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = destination,
            messaging.message.id = event_id,
            messaging.consumer.group.name = consumer,
            outbox.duplicate = tracing::field::Empty,
        );
        set_parent(&span, trace);
        span
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_w3c_traceparent_is_kept_and_anything_else_left_out() {
        let trace = TraceContext::parse(PARENT, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(trace.traceparent(), PARENT);
        assert_eq!(trace.tracestate(), Some("congo=t61rcWkgMzE"));
        assert_eq!(trace.trace_id(), "0af7651916cd43dd8448eb211c80319c");
        for malformed in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert_eq!(TraceContext::parse(malformed, None), None, "{malformed}");
        }
    }

    #[test]
    fn a_long_tracestate_is_cut_at_a_whole_entry_and_an_empty_one_is_none() {
        let entry = |n: usize| format!("v{n:02}={}", "x".repeat(60));
        let long: Vec<String> = (0..10).map(entry).collect();
        let trace = TraceContext::parse(PARENT, Some(&long.join(","))).unwrap();
        let kept = trace.tracestate().unwrap();
        assert!(kept.len() <= 512, "{}", kept.len());
        assert_eq!(kept, long[..7].join(","), "whole entries only");
        assert_eq!(
            TraceContext::parse(PARENT, Some(" ")).unwrap().tracestate(),
            None
        );
    }
}
