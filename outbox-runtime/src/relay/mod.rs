//! The relay: the long-running publisher that turns claims into sends.
//!
//! Each of `concurrency` workers claims a batch in one statement, publishes it through
//! the [`Sink`], and records every outcome in one guarded statement, in the transaction
//! that claims its next batch, which runs while the sink has the batch in between; a
//! busy worker keeps its pool connection from batch to batch. While a send is in flight its leases are renewed (guarded the same way); a
//! row whose renewal is rejected belongs to someone else now, and the relay records
//! nothing for it. Idle workers give their connection back and sleep until a `NOTIFY`
//! from `enqueue` or the poll interval; database errors back off; shutdown finishes
//! in-flight sends within a grace period and hands the rest back.

mod backoff;
mod connection;
mod failure_log;
mod frontier;
mod in_flight;
mod key_runs;
mod key_share;
mod listen;
mod outage;
mod pending;
mod record;
mod renewal;
mod run;
mod sink_panics;
pub(crate) mod tenure;
mod wakeups;
mod worker;

use std::marker::PhantomData;
use std::time::Duration;

use sqlx::PgPool;

pub use crate::sink::memory::{MemorySink, Published};
pub use crate::sink::stdout::StdoutSink;
pub use crate::sink::{BoxError, Delivery, Destination, Sink, SinkError};
pub use crate::table::metric;
pub use backoff::Backoff;
/// The shutdown signal [`Relay::run`] takes (re-exported from tokio-util).
pub use tokio_util::sync::CancellationToken;

use crate::interval::MAX_INTERVAL;
use crate::spec::Outbox;

/// The publisher loop for events of type `T`, sending through a sink `S`. Build it
/// with [`new`](Self::new) and the setters, then [`run`](Self::run) it until shutdown
/// (the `outbox` crate's documentation has an example).
#[derive(Debug)]
#[must_use = "a relay does nothing until `run`"]
pub struct Relay<T, S> {
    pool: PgPool,
    sink: S,
    batch_size: u32,
    /// The most events of a key one claim takes (`None`: the batch size).
    run_length: Option<u32>,
    concurrency: usize,
    shutdown_grace: Duration,
    poll_interval: Duration,
    send_timeout: Duration,
    retry: Backoff,
    unavailable: Backoff,
    /// Whether the database stores only ASCII reasons safely (its encoding is neither
    /// UTF-8 nor SQL_ASCII): read when the relay starts.
    ascii_reasons: bool,
    /// The sink's failures, logged at most once per cause per 10 s by all the workers.
    /// (Boxed: a relay's `run` future holds the relay, and stays small.)
    failures: Box<failure_log::FailureLog>,
    /// Where the `send` spans of a traced type come from (feature `otel`).
    tracer: crate::trace::SendTracer,
    /// A fleet's lease on this relay's target: no claim once it is over.
    tenure: Option<std::sync::Arc<tenure::Tenure>>,
    /// The labels of its metrics: the table, and a fleet's target.
    labels: std::sync::Arc<[metrics::Label]>,
    event: PhantomData<fn() -> T>,
}

impl<T: Outbox, S: Sink<T>> Relay<T, S> {
    /// A relay with one worker claiming batches of 100, polling every 5 s when no
    /// notification arrives, a send timeout of 30 s (or one lease, if longer), a 10 s
    /// shutdown grace, and retries backing off from the type's `retry_delay` up to an
    /// hour.
    ///
    /// The pool needs `concurrency + 1` connections: one per busy worker (kept from batch
    /// to batch) and one that the relay's `LISTEN` session keeps. A few more let the
    /// leases of a batch in flight be renewed while the worker's own connection records
    /// the batch before it (which can wait on a row lock); without an idle one, the
    /// renewal waits for that recording.
    pub fn new(pool: PgPool, sink: S) -> Self {
        let spec = T::SPEC;
        Self {
            pool,
            sink,
            batch_size: 100,
            run_length: None,
            concurrency: 1,
            shutdown_grace: Duration::from_secs(10),
            poll_interval: Duration::from_secs(5),
            send_timeout: spec.lease.max(Duration::from_secs(30)),
            retry: Backoff::new(spec.retry_delay, Duration::from_hours(1)),
            unavailable: Backoff::UNAVAILABLE,
            ascii_reasons: false,
            failures: Box::default(),
            tracer: crate::trace::SendTracer::default(),
            tenure: None,
            labels: std::sync::Arc::new([metrics::Label::new("table", spec.table)]),
            event: PhantomData,
        }
    }

    /// Rows per claim statement (at least 1).
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.max(1);
        self
    }

    /// On a table with an ordering key, the most events of one key a claim takes
    /// together, its run (at least 1; by default, and at most, the batch size). A key's
    /// run goes out in order, an event once the one before it was acknowledged, and
    /// goes on from batch to batch while there is more of the key; a shorter run lets
    /// fewer of a key's events wait in one batch behind one that fails, and bounds how
    /// many of them a consumer gets before the next batch. Keys still share a batch
    /// (every key's first event before any key's second), whatever the length.
    pub fn run_length(mut self, events: u32) -> Self {
        self.run_length = Some(events.max(1));
        self
    }

    /// The length of a run in this relay's claims.
    fn longest_run(&self) -> u32 {
        self.run_length
            .unwrap_or(self.batch_size)
            .min(self.batch_size)
    }

    /// Workers claiming and publishing concurrently (at least 1).
    pub fn concurrency(mut self, workers: usize) -> Self {
        self.concurrency = workers.max(1);
        self
    }

    /// How long a shutdown waits for in-flight sends before handing their rows back
    /// (at most [`MAX_INTERVAL`]: `Duration::MAX` waits for them).
    /// A sink that can take a batch back ([`Sink::withdraw`], as the Kafka sink does) is
    /// asked to, and says which rows it can hand back; those that may still reach the
    /// destination stay claimed until their leases end.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace.min(MAX_INTERVAL);
        self
    }

    /// How often an idle worker looks for due events without a notification: events
    /// another relay process retried with a delay (this relay's own retries wake a
    /// worker when due), the expired claims of a publisher that died, an enqueue that
    /// committed long after its `INSERT` began, notifications lost while disconnected.
    /// From 1 ms to [`MAX_INTERVAL`] (`Duration::MAX`:
    /// notifications alone, and those events wait for the next one).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.clamp(Duration::from_millis(1), MAX_INTERVAL);
        self
    }

    /// How long one `publish` may take before the whole batch counts as a transient
    /// failure (a hung broker). Leases are renewed meanwhile.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }

    /// The retry policy for transient failures, overriding the type's `retry_delay`.
    pub fn retry_backoff(mut self, backoff: Backoff) -> Self {
        self.retry = backoff;
        self
    }

    /// How long a worker waits before it claims again after the sink said the
    /// destination is unavailable ([`SinkError::Unavailable`]), by how many batches in a
    /// row it said so: by default from 100 ms, doubling, at most 5 s, so the relay is
    /// back at full speed within seconds of the destination's return.
    pub fn unavailable_backoff(mut self, backoff: Backoff) -> Self {
        self.unavailable = backoff;
        self
    }

    /// The OpenTelemetry tracer provider of the relay's `send` spans, for a type with
    /// `#[outbox(traced)]` (feature `otel`); by default OpenTelemetry's global one
    /// (`opentelemetry::global::set_tracer_provider`). Without a provider that records,
    /// the relay sends each event's stored context as it is.
    #[cfg(feature = "otel")]
    pub fn tracer_provider<P>(mut self, provider: &P) -> Self
    where
        P: opentelemetry::trace::TracerProvider,
        P::Tracer: Send + Sync + 'static,
        <P::Tracer as opentelemetry::trace::Tracer>::Span: Send + Sync + 'static,
    {
        self.tracer = crate::trace::SendTracer::of(provider);
        self
    }
}

impl<T, S> Relay<T, S> {
    /// Claims only while `tenure` lasts (a fleet's lease on the target).
    pub(crate) fn within(mut self, tenure: std::sync::Arc<tenure::Tenure>) -> Self {
        self.tenure = Some(tenure);
        self
    }

    /// Labels its metrics with a fleet's `target` too.
    pub(crate) fn for_target(mut self, target: &str) -> Self {
        let mut labels = self.labels.to_vec();
        labels.push(metrics::Label::new("target", target.to_owned()));
        self.labels = labels.into();
        self
    }
}
