//! One trace from the request to the consumer: the [W3C Trace Context] an event was
//! enqueued in, kept with it (`#[outbox(traced)]`) and sent with it.
//!
//! An outbox cuts a trace in two: the request that enqueued an event ends at the
//! `INSERT`, and the publication starts later, in another process. On a traced type,
//! enqueue keeps the current span's context in the row (`trace_parent`, `trace_state`,
//! and the [W3C Baggage] in `trace_baggage`, in the same `INSERT`), and every message the
//! relay publishes carries a [`TraceContext`] in its `traceparent`, `tracestate` and
//! `baggage` headers:
//!
//! - with the cargo feature `otel`, the context of the relay's own span for that
//!   publication (`send <table>`, span kind producer, OpenTelemetry's messaging
//!   attributes), a child of the enqueuing span: one trace from the request, through
//!   each attempt of the relay (a retry or a reclaim after a crash is a new span of the
//!   same trace, with its attempt and generation), to the consumer, whose span
//!   continues it (`Inbox::span` with the feature, or the message's own
//!   `Consumed::consumer_span`). The relay makes its spans with OpenTelemetry's
//!   API, from the global tracer provider or the one `Relay::tracer_provider` names;
//! - without it, or without a provider that records, the stored context as it is, so a
//!   consumer's span is a child of the enqueuing one.
//!
//! The stored context is the current [`tracing`] span's OpenTelemetry context (through
//! `tracing-opentelemetry`), in W3C form whatever propagator the application sets
//! globally. A malformed or oversized one is left out with a debug log: it never fails an
//! enqueue, a publication or a consumption.
//!
//! [W3C Trace Context]: https://www.w3.org/TR/trace-context/
//! [W3C Baggage]: https://www.w3.org/TR/baggage/

/// The longest `tracestate` kept: 512 characters, W3C's limit for what a vendor may
/// propagate (longer ones are cut at a whole entry).
const MAX_STATE: usize = 512;

/// The longest `baggage` kept: 8,192 bytes, what W3C Baggage asks every platform to
/// propagate (longer ones are cut at a whole entry).
const MAX_BAGGAGE: usize = 8192;

/// A W3C trace context: a `traceparent` (version `00`, a non-zero trace id and parent
/// id), its `tracestate`, if any, and the W3C `baggage` that goes with it, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    parent: String,
    ids: Ids,
    /// Its `tracestate` and `baggage`, where it has either (boxed: most have neither, and
    /// every claim of a traced type holds a context).
    lists: Option<Box<Lists>>,
}

/// A [`TraceContext`]'s `tracestate` and `baggage`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Lists {
    state: Option<String>,
    baggage: Option<String>,
}

impl TraceContext {
    /// The context of `traceparent` and `tracestate`, if `traceparent` is one: `None`
    /// (with a debug log) for a malformed one. A `tracestate` longer than 512 characters
    /// is cut at its last whole entry within them; an empty one is none.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let Some(ids) = Ids::of(traceparent) else {
            tracing::debug!(traceparent, "not a W3C traceparent (version 00): left out");
            return None;
        };
        let state = tracestate.and_then(|state| bounded_list(state, MAX_STATE, "tracestate"));
        Some(Self::of(traceparent.to_owned(), ids, state))
    }

    /// The context of a valid `traceparent` and its `ids`, with `state`.
    fn of(traceparent: String, ids: Ids, state: Option<String>) -> Self {
        Self {
            parent: traceparent,
            ids,
            lists: state.map(|state| {
                Box::new(Lists {
                    state: Some(state),
                    baggage: None,
                })
            }),
        }
    }

    /// With `baggage`, a W3C `baggage` header (`key=value;property,...`): cut at its last
    /// whole entry within 8,192 bytes, entries with control characters left out; an empty
    /// one is none.
    #[must_use]
    pub fn with_baggage(self, baggage: Option<&str>) -> Self {
        self.with_baggage_kept(
            baggage.and_then(|baggage| bounded_list(baggage, MAX_BAGGAGE, "baggage")),
        )
    }

    /// With `baggage`, already bounded.
    fn with_baggage_kept(mut self, baggage: Option<String>) -> Self {
        let state = self.lists.take().and_then(|lists| lists.state);
        self.lists =
            (state.is_some() || baggage.is_some()).then(|| Box::new(Lists { state, baggage }));
        self
    }

    /// The `traceparent` header: `00-<trace id>-<parent id>-<flags>`.
    pub fn traceparent(&self) -> &str {
        &self.parent
    }

    /// The `tracestate` header, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.lists.as_ref().and_then(|lists| lists.state.as_deref())
    }

    /// The `baggage` header, if any.
    pub fn baggage(&self) -> Option<&str> {
        self.lists
            .as_ref()
            .and_then(|lists| lists.baggage.as_deref())
    }

    /// The trace id: 32 lowercase hex digits.
    pub fn trace_id(&self) -> &str {
        &self.parent[3..35]
    }

    /// Whether the request it comes from was sampled: the `sampled` flag of its
    /// `traceparent`.
    pub fn is_sampled(&self) -> bool {
        self.ids.flags & 1 == 1
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

/// What a `traceparent` says, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ids {
    trace: [u8; 16],
    parent: [u8; 8],
    flags: u8,
}

impl Ids {
    /// The ids and flags of a version `00` `traceparent` (`00-` + 32 hex + `-` + 16 hex +
    /// `-` + 2 hex, lowercase, neither id all zeros), `None` for anything else. Checked
    /// and decoded in one pass, without allocating: the relay reads every traced
    /// event's.
    fn of(traceparent: &str) -> Option<Self> {
        let text = traceparent.as_bytes();
        if text.len() != 55 || !text.starts_with(b"00-") || text[35] != b'-' || text[52] != b'-' {
            return None;
        }
        let mut ids = Self {
            trace: [0; 16],
            parent: [0; 8],
            flags: 0,
        };
        let mut flags = [0];
        decode_hex(&text[3..35], &mut ids.trace)?;
        decode_hex(&text[36..52], &mut ids.parent)?;
        decode_hex(&text[53..55], &mut flags)?;
        ids.flags = flags[0];
        (ids.trace != [0; 16] && ids.parent != [0; 8]).then_some(ids)
    }
}

impl Ids {
    /// The `traceparent` of these ids. (Written digit by digit into place: formatting the
    /// ids took a third of the relay's work per span.)
    #[cfg(feature = "otel")]
    fn traceparent(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut text = *b"00-________________________________-________________-__";
        let fields = [
            (3, &self.trace[..]),
            (36, &self.parent[..]),
            (53, &[self.flags][..]),
        ];
        for (at, bytes) in fields {
            for (pair, byte) in text[at..].chunks_exact_mut(2).zip(bytes) {
                pair[0] = DIGITS[usize::from(byte >> 4)];
                pair[1] = DIGITS[usize::from(byte & 0xf)];
            }
        }
        // Hex digits and dashes: ASCII, always UTF-8.
        String::from_utf8(text.to_vec()).unwrap_or_default()
    }
}

/// Lowercase `hex` into `bytes` (two digits each), `None` at a character that is not one.
fn decode_hex(hex: &[u8], bytes: &mut [u8]) -> Option<()> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (pair, byte) in hex.chunks_exact(2).zip(bytes) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(())
}

/// `list` (a `tracestate` or a `baggage` header, named `what`), cut at its last whole
/// entry within `max` bytes, entries with a control character left out (they would
/// break a header); `None` when nothing is left.
fn bounded_list(list: &str, max: usize, what: &str) -> Option<String> {
    let list = list.trim();
    let mut kept = String::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        if entry.chars().any(char::is_control) {
            tracing::debug!(what, entry, "a control character: entry left out");
            continue;
        }
        let needed = entry.len() + usize::from(!kept.is_empty());
        if kept.len() + needed > max {
            tracing::debug!(what, list, max, "too long: cut at a whole entry");
            break;
        }
        if !kept.is_empty() {
            kept.push(',');
        }
        kept.push_str(entry);
    }
    (!kept.is_empty()).then_some(kept)
}

/// Where the relay's `send` spans come from (feature `otel`): OpenTelemetry's global
/// tracer provider, unless the relay names one. Nothing without the feature.
#[derive(Clone, Default)]
pub(crate) struct SendTracer {
    #[cfg(feature = "otel")]
    named: Option<std::sync::Arc<opentelemetry::global::BoxedTracer>>,
}

impl std::fmt::Debug for SendTracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(feature = "otel")]
        if self.named.is_some() {
            return f.write_str("SendTracer(named)");
        }
        f.write_str("SendTracer(global)")
    }
}

impl SendTracer {
    /// The tracer of `provider`, under the scope `outbox`.
    #[cfg(feature = "otel")]
    pub(crate) fn of<P>(provider: &P) -> Self
    where
        P: opentelemetry::trace::TracerProvider,
        P::Tracer: Send + Sync + 'static,
        <P::Tracer as opentelemetry::trace::Tracer>::Span: Send + Sync + 'static,
    {
        let tracer = provider.tracer_with_scope(otel::scope());
        Self {
            named: Some(std::sync::Arc::new(
                opentelemetry::global::BoxedTracer::new(Box::new(tracer)),
            )),
        }
    }

    /// The relay's spans for publishing `deliveries` through `sink`, in its `batch` span:
    /// (feature `otel`, a traced type) one per event, a child of the context it was
    /// enqueued in (else of `batch`), whose own context each delivery then carries. Ended
    /// by [`SendSpans::end`] with the sink's results.
    #[cfg_attr(not(feature = "otel"), expect(clippy::unused_self))]
    pub(crate) fn open<T: crate::Outbox, S: crate::sink::Sink<T>>(
        &self,
        sink: &S,
        deliveries: &mut [crate::sink::Delivery<'_, T>],
        batch: tracing::Span,
    ) -> SendSpans {
        #[cfg(feature = "otel")]
        if T::SPEC.traced {
            let global;
            let tracer = if let Some(named) = &self.named {
                named.as_ref()
            } else {
                // Asked per batch: a provider set after the relay was built counts.
                global = opentelemetry::global::tracer_with_scope(otel::scope());
                &global
            };
            let spans = otel::send_spans(tracer, sink, deliveries, &batch);
            return SendSpans { batch, spans };
        }
        let _ = (sink, deliveries);
        SendSpans {
            batch,
            #[cfg(feature = "otel")]
            spans: Vec::new(),
        }
    }
}

/// The relay's spans of one batch's send: the batch's own (`outbox.batch`), and its
/// events' `send` spans, in the order of its deliveries.
#[must_use = "the spans end with the sink's results"]
pub(crate) struct SendSpans {
    batch: tracing::Span,
    #[cfg(feature = "otel")]
    spans: Vec<Option<opentelemetry::global::BoxedSpan>>,
}

impl SendSpans {
    /// The batch's span, where the sink's send runs.
    pub(crate) fn batch(&self) -> &tracing::Span {
        &self.batch
    }

    /// Ends each span with its event's result: an error's status and reason, or none for
    /// a batch the sink never answered.
    #[cfg_attr(not(feature = "otel"), expect(clippy::unused_self))]
    pub(crate) fn end(self, results: Option<&[Result<(), crate::sink::SinkError>]>) {
        #[cfg(feature = "otel")]
        otel::end_sends(self.spans, results);
        #[cfg(not(feature = "otel"))]
        let _ = results;
    }
}

#[cfg(feature = "otel")]
pub(crate) mod otel {
    //! The OpenTelemetry side: contexts to and from [`TraceContext`], and the relay's and
    //! the consumer's spans.

    use opentelemetry::baggage::{Baggage, BaggageExt as _, KeyValueMetadata};
    use opentelemetry::global::{BoxedSpan, BoxedTracer};
    use opentelemetry::trace::{
        Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags,
        TraceId, TraceState, Tracer as _,
    };
    use opentelemetry::{InstrumentationScope, KeyValue};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    use super::TraceContext;

    /// The current span's context, if OpenTelemetry has one for it, with the baggage of
    /// its context (else of OpenTelemetry's current one).
    pub(super) fn current() -> Option<TraceContext> {
        let context = tracing::Span::current().context();
        let trace = of(context.span().span_context())?;
        let baggage = if context.baggage().is_empty() {
            opentelemetry::Context::map_current(|current| current.baggage().to_string())
        } else {
            context.baggage().to_string()
        };
        Some(trace.with_baggage(Some(&baggage)))
    }

    /// `span_context` as a [`TraceContext`], if it is a valid one.
    fn of(span_context: &SpanContext) -> Option<TraceContext> {
        if !span_context.is_valid() {
            return None;
        }
        let ids = super::Ids {
            trace: span_context.trace_id().to_bytes(),
            parent: span_context.span_id().to_bytes(),
            flags: span_context.trace_flags().to_u8(),
        };
        let state = super::bounded_list(
            &span_context.trace_state().header(),
            super::MAX_STATE,
            "tracestate",
        );
        Some(TraceContext::of(ids.traceparent(), ids, state))
    }

    /// The instrumentation scope of the relay's spans.
    pub(super) fn scope() -> InstrumentationScope {
        InstrumentationScope::builder("outbox")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build()
    }

    /// The entries of a W3C `baggage` header, their values percent-decoded; a malformed
    /// entry left out.
    pub(super) fn baggage(header: &str) -> Baggage {
        header
            .split(',')
            .filter_map(|member| {
                let (pair, properties) = member.split_once(';').unwrap_or((member, ""));
                let (key, value) = pair.split_once('=')?;
                let key = key.trim();
                let value = percent_encoding::percent_decode_str(value.trim())
                    .decode_utf8()
                    .ok()?;
                (!key.is_empty()).then(|| {
                    KeyValueMetadata::new(key.to_owned(), value.into_owned(), properties.trim())
                })
            })
            .collect()
    }

    /// The remote parent `trace` stands for.
    fn parent(trace: &TraceContext) -> opentelemetry::Context {
        let super::Ids {
            trace: trace_id,
            parent: span_id,
            flags,
        } = trace.ids;
        let state = trace
            .tracestate()
            .and_then(|state| state.parse::<TraceState>().ok())
            .unwrap_or_default();
        let span_context = SpanContext::new(
            TraceId::from_bytes(trace_id),
            SpanId::from_bytes(span_id),
            TraceFlags::new(flags),
            true,
            state,
        );
        opentelemetry::Context::new().with_remote_span_context(span_context)
    }

    /// Makes `span` a child of `trace`, with its baggage, before it is entered.
    fn set_parent(span: &tracing::Span, trace: Option<&TraceContext>) {
        let Some(trace) = trace else { return };
        let mut parent = parent(trace);
        if let Some(header) = trace.baggage() {
            parent = parent.with_baggage(baggage(header));
        }
        // Fails only for a span no OpenTelemetry layer records: nothing to parent.
        let _ = span.set_parent(parent);
    }

    /// The relay's spans for publishing `deliveries` through `sink`: OpenTelemetry's
    /// messaging conventions for a send, one per event, each a child of the context the
    /// event was enqueued in, or else of the relay's `batch` span. Made with
    /// the OpenTelemetry API directly: a `tracing` span per event costs about three times
    /// as much. A delivery then carries its span's context, where the span records.
    ///
    /// An event whose request was not sampled gets no span: the relay follows the
    /// request's decision (the `sampled` flag of its `traceparent`), as a parent-based
    /// sampler would, without the SDK's work for a span nobody records, and sends the
    /// stored context as it is. The others are asked for with their attributes, which the
    /// span takes as they are (set afterwards, each would grow its list).
    pub(super) fn send_spans<T: crate::Outbox, S: crate::sink::Sink<T>>(
        tracer: &BoxedTracer,
        sink: &S,
        deliveries: &mut [crate::sink::Delivery<'_, T>],
        batch: &tracing::Span,
    ) -> Vec<Option<BoxedSpan>> {
        let table = T::SPEC.table;
        // The relay's batch span: the parent of an event enqueued outside a trace.
        let mut batch_context = None;
        let name = send_span_name(table);
        deliveries
            .iter_mut()
            .map(|delivery| {
                if delivery.trace().is_some_and(|trace| !trace.is_sampled()) {
                    return None;
                }
                let enqueued_in = delivery.trace().map(parent);
                let span = tracer
                    .span_builder(name)
                    .with_kind(SpanKind::Producer)
                    .with_attributes(send_attributes(sink, table, delivery))
                    .start_with_context(
                        tracer,
                        match &enqueued_in {
                            Some(parent) => parent,
                            None => batch_context.get_or_insert_with(|| batch.context()),
                        },
                    );
                if span.is_recording()
                    && let Some(mut own) = of(span.span_context())
                {
                    // The request's baggage goes on with its trace.
                    let baggage = delivery.trace().and_then(TraceContext::baggage);
                    own = own.with_baggage_kept(baggage.map(str::to_owned));
                    delivery.trace = Some(std::borrow::Cow::Owned(own));
                }
                Some(span)
            })
            .collect()
    }

    /// A `send` span's attributes: where the sink publishes the event (its system and
    /// destination; the outbox's table without one), and which event, attempt and
    /// generation.
    fn send_attributes<T: crate::Outbox, S: crate::sink::Sink<T>>(
        sink: &S,
        table: &'static str,
        delivery: &crate::sink::Delivery<'_, T>,
    ) -> Vec<KeyValue> {
        let (system, name, own) = match sink.destination(delivery.event()) {
            Some(destination) => {
                let (system, name, own) = destination.into_parts();
                (system, opentelemetry::Value::from(name), own)
            }
            None => ("outbox", table.into(), Vec::new()),
        };
        let mut attributes = Vec::with_capacity(8 + own.len());
        attributes.extend([
            KeyValue::new("messaging.system", system),
            KeyValue::new("messaging.destination.name", name),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new(
                "messaging.message.id",
                delivery.event_id().as_str().to_owned(),
            ),
            KeyValue::new("outbox.table", table),
            KeyValue::new("outbox.attempt", i64::from(delivery.attempt())),
            KeyValue::new("outbox.generation", delivery.generation().get()),
        ]);
        attributes.extend(
            own.into_iter()
                .map(|(key, value)| KeyValue::new(key, value)),
        );
        attributes
    }

    /// `send <table>`, made once per table: a span's name is kept as it is given, and a
    /// name made per span would be an allocation per event.
    fn send_span_name(table: &'static str) -> &'static str {
        static NAMES: std::sync::Mutex<Vec<(&str, &str)>> = std::sync::Mutex::new(Vec::new());
        let mut names = NAMES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, name)) = names.iter().find(|(known, _)| *known == table) {
            return name;
        }
        // One per outbox table of the process: a bounded set.
        let name: &'static str = Box::leak(format!("send {table}").into_boxed_str());
        names.push((table, name));
        name
    }

    /// See [`super::SendSpans::end`].
    pub(super) fn end_sends(
        spans: Vec<Option<BoxedSpan>>,
        results: Option<&[Result<(), crate::sink::SinkError>]>,
    ) {
        for (i, span) in spans.into_iter().enumerate() {
            let Some(mut span) = span else { continue };
            match results.and_then(|results| results.get(i)) {
                Some(Ok(())) => {}
                Some(Err(error)) => span.set_status(Status::error(error.to_string())),
                None => span.set_status(Status::error("no answer from the sink")),
            }
            span.end();
        }
    }

    /// A consumer's span for handling one message of `system`, received from
    /// `destination`: `process <destination>`, span kind consumer, a child of the `trace`
    /// it carries; `consumer`, an inbox's consumer name, as the consumer group. (See
    /// [`Consumed::consumer_span`](crate::inbox::Consumed::consumer_span).)
    pub(crate) fn consumer_span(
        system: &'static str,
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
            messaging.system = system,
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
        assert!(trace.is_sampled());
        let unsampled = &PARENT.replace("-01", "-00");
        assert!(!TraceContext::parse(unsampled, None).unwrap().is_sampled());
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

    #[test]
    fn baggage_is_kept_whole_entries_within_8_kib_without_control_characters() {
        let trace = TraceContext::parse(PARENT, None).unwrap();
        assert_eq!(trace.baggage(), None);
        let with = |baggage: &str| trace.clone().with_baggage(Some(baggage));
        assert_eq!(
            with("tenant=acme%20co, user=42;sensitive").baggage(),
            Some("tenant=acme%20co,user=42;sensitive")
        );
        assert_eq!(
            with("a=1,bad=x\r\nInjected: yes,b=2").baggage(),
            Some("a=1,b=2"),
            "a header injection left out"
        );
        let entry = |n: usize| format!("k{n:03}={}", "v".repeat(95));
        let long: Vec<String> = (0..100).map(entry).collect();
        let kept = with(&long.join(",")).baggage().unwrap().to_owned();
        assert!(kept.len() <= 8192, "{}", kept.len());
        assert_eq!(kept, long[..81].join(","), "whole entries only");
        assert_eq!(with(" , ").baggage(), None);
    }

    #[cfg(feature = "otel")]
    #[test]
    fn a_traceparent_is_written_back_from_its_decoded_ids() {
        for parent in [
            PARENT,
            "00-ffffffffffffffffffffffffffffffff-0000000000000001-00",
        ] {
            let trace = TraceContext::parse(parent, None).unwrap();
            assert_eq!(trace.ids.traceparent(), parent);
        }
    }

    #[cfg(feature = "otel")]
    #[test]
    fn a_baggage_header_decodes_to_its_entries_and_skips_malformed_ones() {
        let baggage = otel::baggage("tenant=acme%20co;ttl=5, =nokey, novalue, user = 42");
        assert_eq!(baggage.len(), 2, "{baggage:?}");
        assert_eq!(
            baggage.get("tenant").map(ToString::to_string).as_deref(),
            Some("acme co")
        );
        assert_eq!(
            baggage.get("user").map(ToString::to_string).as_deref(),
            Some("42")
        );
    }
}
