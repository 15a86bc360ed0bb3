//! The `trace` section: what `#[outbox(traced)]` costs with OpenTelemetry on, against the
//! same event type untraced, in the same run.
//!
//! ```text
//! cargo run --release --features otel --example bench -- --only trace
//! ```
//!
//! The process's `tracing` subscriber is an OpenTelemetry layer at level INFO, and OpenTelemetry's
//! global tracer provider (the relay's `send` spans) the same provider: a batch span
//! processor whose exporter drops every batch: what an application pays to make, fill
//! and hand over its spans, without a collector's network cost. Both sides run under
//! it, so the only difference is the trace context:
//!
//! - enqueue, one event per business transaction inside a request span: the traced type
//!   reads the span's context and writes it in the same `INSERT` (two more columns);
//! - the drain (no-op sink, batch 100, concurrency 1 and 4) and the same through each
//!   broker sink built in: each traced event stored as a request of its own would have
//!   enqueued it (a trace of its own, sampled or not as that request's sampler would
//!   have decided); the relay reads the stored context and opens one `send` span per
//!   event, a child of it, whose context each delivery carries.
//!
//! `--trace-sampled 0.1` samples a tenth of the requests instead of all (a `ParentBased`
//! sampler on a trace-id ratio, the setting most applications run): the relay's spans of
//! an unsampled request do not record, and it sends the stored context as it is.
//!
//! Without the feature `otel`, the section says so and measures nothing. It installs the
//! process's global subscriber: run it on its own (`--only trace`).

use super::{Args, Bench, Result};

/// `--trace-sampled`: a ratio from 0 to 1.
pub(super) fn ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("{text} is not a ratio from 0 to 1")),
    }
}

impl Bench {
    #[cfg_attr(not(feature = "otel"), allow(clippy::unused_async))]
    pub(super) async fn trace(&self, args: &Args) -> Result {
        self.heading(
            "Trace context: #[outbox(traced)] vs the same type untraced, OpenTelemetry on",
        );
        #[cfg(feature = "otel")]
        {
            with_otel::install(args.trace_sampled)?;
            self.line(&format!(
                "OpenTelemetry records {}: a `ParentBased` sampler on a trace-id ratio of {}.\n",
                if args.trace_sampled >= 1.0 {
                    "every span"
                } else {
                    "a share of the requests"
                },
                args.trace_sampled
            ));
            self.trace_enqueue(args).await?;
            self.trace_drain(args).await?;
            self.line(&format!(
                "\nThrough each broker sink built in ({} events per run, batch 100), the same \
                 relay and sink, traced vs untraced:\n",
                args.sink_events
            ));
            self.line("| broker | concurrency | traced events/s | untraced events/s | traced / untraced |");
            self.line("|---|---|---|---|---|");
            #[cfg(feature = "nats")]
            self.trace_broker(
                &super::sinks::with_brokers::nats::Nats::connect().await?,
                args,
            )
            .await?;
            #[cfg(feature = "rabbitmq")]
            self.trace_broker(
                &super::sinks::with_brokers::rabbitmq::Rabbit::connect().await?,
                args,
            )
            .await?;
            #[cfg(feature = "kafka")]
            self.trace_broker(
                &super::sinks::with_brokers::kafka::Kafka::start().await?,
                args,
            )
            .await?;
        }
        #[cfg(not(feature = "otel"))]
        {
            let _ = args;
            self.line("Not built: the section needs `--features otel`.");
        }
        Ok(())
    }
}

#[cfg(feature = "otel")]
mod with_otel {
    use std::fmt::Write as _;
    use std::time::Instant;

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
    use outbox::Outbox;
    use outbox_testkit::app::BenchTracedEvent;
    use tracing::Instrument as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::super::cpu::{Work, marks};
    use super::super::{Args, Bench, BenchEvent, Figure, Result, payload};

    /// An exporter that drops every batch.
    #[derive(Debug)]
    struct Dropped;

    impl SpanExporter for Dropped {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            Ok(())
        }
    }

    /// OpenTelemetry as the process's subscriber, its spans dropped in batches, the
    /// requests sampled at `ratio` (their spans, the relay's included, follow them).
    pub(super) fn install(ratio: f64) -> Result {
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio,
            ))))
            .with_batch_exporter(Dropped)
            .build();
        // At INFO, as a service runs: the relay's DEBUG events are not made at all.
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::LevelFilter::INFO)
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bench")));
        tracing::subscriber::set_global_default(subscriber)?;
        // The relay's `send` spans come from the global provider.
        opentelemetry::global::set_tracer_provider(provider);
        Ok(())
    }

    /// A request span for the work `future` does.
    fn in_a_request<F: Future>(future: F) -> tracing::instrument::Instrumented<F> {
        future.instrument(tracing::info_span!("POST /orders"))
    }

    impl Bench {
        /// Events/s of enqueueing `events`, one per transaction, in a request span.
        async fn enqueue_each<T: Outbox>(&self, events: &[T]) -> Result<f64> {
            self.reset_tables(T::SPEC.table()).await?;
            marks::begins(T::SPEC.traced());
            let started = Instant::now();
            in_a_request(async {
                for event in events {
                    let mut tx = self.pool.begin().await?;
                    outbox::table::enqueue(event, &mut *tx).await?;
                    tx.commit().await?;
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
            .await?;
            let rate = events.len() as f64 / started.elapsed().as_secs_f64();
            marks::ends();
            Ok(rate)
        }

        pub(super) async fn trace_enqueue(&self, args: &Args) -> Result {
            let events: Vec<BenchEvent> = (0..1_000).map(payload).collect();
            let traced_events: Vec<BenchTracedEvent> = events.iter().map(Into::into).collect();
            let (mut traced, mut untraced) = (Vec::new(), Vec::new());
            for run in 0..args.runs {
                if run % 2 == 0 {
                    traced.push(self.enqueue_each(&traced_events).await?);
                    untraced.push(self.enqueue_each(&events).await?);
                } else {
                    untraced.push(self.enqueue_each(&events).await?);
                    traced.push(self.enqueue_each(&traced_events).await?);
                }
            }
            self.line("Enqueue, one event per business transaction (1,000), in a request span:\n");
            self.ratio_table("traced", "untraced", traced, untraced);
            Ok(())
        }

        /// Fills the traced table with `events`, each as a request of its own would have
        /// enqueued it: a trace context of its own, sampled at `ratio` (the flag the
        /// request's sampler would have set). One `INSERT`, untimed.
        async fn fill_requests(&self, events: &[BenchTracedEvent], ratio: f64) -> Result {
            let table = BenchTracedEvent::SPEC.table();
            self.reset_tables(table).await?;
            self.set_storage(table).await?;
            // Event ids as enqueue makes them (UUIDv7, in time order), as the untraced side's.
            let ids: Vec<String> = events
                .iter()
                .map(|_| uuid::Uuid::now_v7().to_string())
                .collect();
            let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
            sqlx::query(
                "INSERT INTO bench_traced_events (event_id, payload, trace_parent) \
                 SELECT event_id, payload, \
                        '00-' || md5(random()::text) || '-' || left(md5(random()::text), 16) \
                        || CASE WHEN random() < $3 THEN '-01' ELSE '-00' END \
                 FROM unnest($1::text[], $2::text[]) AS e (event_id, payload)",
            )
            .bind(ids)
            .bind(payloads)
            .bind(ratio)
            .execute(&self.pool)
            .await?;
            sqlx::query("VACUUM ANALYZE bench_traced_events")
                .execute(&self.pool)
                .await?;
            Ok(())
        }

        /// `broker`'s rows: the relay through its sink, traced vs untraced, at 1 and 4
        /// workers.
        #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
        pub(super) async fn trace_broker<B: super::super::sinks::with_brokers::Broker>(
            &self,
            broker: &B,
            args: &Args,
        ) -> Result {
            let events: Vec<BenchEvent> = (0..args.sink_events).map(payload).collect();
            let traced_events: Vec<BenchTracedEvent> = events.iter().map(Into::into).collect();
            let n = events.len();
            for workers in [1, 4] {
                let pairs = alternate(
                    args.runs,
                    async || {
                        self.fill_requests(&traced_events, args.trace_sampled)
                            .await?;
                        let through =
                            self.relay_through_filled::<B, BenchTracedEvent>(broker, n, workers);
                        Ok((through.await?.0, None))
                    },
                    async || Ok((self.relay_through(broker, &events, workers).await?.0, None)),
                )
                .await?;
                self.line(&pairs.row(&format!("| {} | {workers} ", B::NAME)));
            }
            Ok(())
        }

        pub(super) async fn trace_drain(&self, args: &Args) -> Result {
            let n = args.backlog(100);
            let events: Vec<BenchEvent> = (0..n).map(payload).collect();
            let traced_events: Vec<BenchTracedEvent> = events.iter().map(Into::into).collect();
            self.line(&format!(
                "Drain of {n} events, each enqueued by a request of its own (no-op sink, batch \
                 100), one `send` span per event of a sampled request for the traced type:\n"
            ));
            self.line(
                "| concurrency | traced events/s | untraced events/s | traced / untraced | \
                 relay CPU µs/event, traced / untraced | server CPU µs/event, traced / untraced |",
            );
            self.line("|---|---|---|---|---|---|");
            for workers in [1, 4] {
                let pairs = alternate(
                    args.runs,
                    async || {
                        self.fill_requests(&traced_events, args.trace_sampled)
                            .await?;
                        self.drain_filled::<BenchTracedEvent>(n, 100, workers).await
                    },
                    async || self.drain_relay_cpu(&events, 100, workers).await,
                )
                .await?;
                self.line(&pairs.row(&format!("| {workers} ")));
            }
            Ok(())
        }
    }

    /// A run's events/s, and the CPU it took per event where it was measured.
    type Measured = (f64, Option<Work>);

    /// Traced and untraced rates of the same runs, their ratios, and the CPU per event
    /// of each side where every run measured it.
    #[derive(Default)]
    struct Pairs {
        traced: Vec<f64>,
        untraced: Vec<f64>,
        ratios: Vec<f64>,
        cpu: Option<Vec<(Work, Work)>>,
    }

    impl Pairs {
        /// A table row: `cells` (`| a | b `), then the two rates and their ratio, then
        /// (where measured) the relay's and the server's CPU per event, traced / untraced.
        fn row(self, cells: &str) -> String {
            let ratio = Figure::of(self.ratios);
            let mut row = format!(
                "{cells}| {} | {} | {} |",
                Figure::of(self.traced).show(""),
                Figure::of(self.untraced).show(""),
                ratio.ratio(),
            );
            if let Some(cpu) = self.cpu {
                let side = |of: fn(&(Work, Work)) -> f64| Figure::of(cpu.iter().map(of).collect());
                let (relay, relay_untraced) = (side(|c| c.0.client), side(|c| c.1.client));
                let (server, server_untraced) = (side(|c| c.0.server), side(|c| c.1.server));
                let _ = write!(
                    row,
                    " {:.1} / {:.1} | {:.1} / {:.1} |",
                    relay.median, relay_untraced.median, server.median, server_untraced.median
                );
            }
            row
        }
    }

    /// `runs` runs of `traced` and `untraced`, alternating which goes first.
    async fn alternate(
        runs: usize,
        mut traced: impl AsyncFnMut() -> Result<Measured>,
        mut untraced: impl AsyncFnMut() -> Result<Measured>,
    ) -> Result<Pairs> {
        let mut pairs = Pairs {
            cpu: Some(Vec::new()),
            ..Pairs::default()
        };
        for run in 0..runs {
            let (t, u) = if run % 2 == 0 {
                let t = traced().await?;
                (t, untraced().await?)
            } else {
                let u = untraced().await?;
                (traced().await?, u)
            };
            pairs.traced.push(t.0);
            pairs.untraced.push(u.0);
            pairs.ratios.push(t.0 / u.0);
            pairs.cpu = pairs.cpu.zip(t.1.zip(u.1)).map(|(mut cpu, both)| {
                cpu.push(both);
                cpu
            });
        }
        Ok(pairs)
    }
}
