//! The `sinks` section: the relay publishing through each broker sink against a
//! hand-written outbox publisher on the same table and broker, and the latency from an
//! enqueue to a consumer's effect.
//!
//! ```text
//! cargo run --release --features nats,rabbitmq,kafka --example bench -- --only sinks
//! cargo run --release --features nats --example bench -- --only sinks --sink-events 50000
//! ```
//!
//! For each broker built in (features `nats`, `rabbitmq`, `kafka`; the others are
//! reported as not built), at batch 100 and concurrency 1 and 4:
//!
//! - the relay drains a backlog of `--sink-events` events through the sink, until every
//!   outcome is recorded;
//! - the hand-written publisher, what a user writes instead of the outbox, drains the
//!   same backlog: section 1's floor claim of 100 (`FOR UPDATE SKIP LOCKED`, READY rows
//!   only), the broker client's own publish of the batch, encoded the same way (the
//!   same JSON body, the sink's headers, the same message id or key) with the same
//!   acknowledgements, pipelined per batch as the sink does, then the floor's unguarded
//!   completion to `SENT`; by as many tasks as the relay has workers, on one client as
//!   the relay's workers share one sink. The ratio relay / hand-written is what the
//!   outbox's guarantees (leases, generations, attempts, recorded outcomes) cost;
//! - the raw producer publishes the same messages from memory, reading nothing from
//!   PostgreSQL: the broker client's ceiling on these two cores.
//!
//! The acknowledgements: JetStream publish with `Nats-Msg-Id`, each `PubAck` awaited
//! (a file-storage stream); RabbitMQ publisher confirms, persistent messages, `mandatory`,
//! to a durable queue through the default exchange; Kafka's idempotent producer,
//! `acks=all`, `message.timeout.ms=10000`, `linger.ms=0` (what `KafkaSink` sets for a 30 s lease), on a
//! one-partition topic of a tansu broker the bench starts (in memory; see
//! `outbox-testkit/src/tansu.rs`).
//!
//! Then the latency at a fixed offered load (`--sink-rate`, one event per transaction,
//! the event's payload its enqueue time), a relay (batch 100, 4 workers) publishing
//! through the sink and a consumer of each broker recording when each message arrives:
//! enqueue → consumer, p50 and p99, over 10 s after a 3 s warm-up.
//!
//! Every run gets a fresh stream, queue or topic, deleted after it. NATS is
//! `OUTBOX_NATS_URL` (`nats://127.0.0.1:4222`), RabbitMQ `OUTBOX_AMQP_URL`
//! (`amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::time::Duration;

use super::{Args, Bench, Result};

/// The latency run's warm-up, and how long it is measured.
const WARM_UP: Duration = Duration::from_secs(3);
const MEASURED: Duration = Duration::from_secs(10);

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
use with_brokers::Broker;

/// The brokers, their features, and whether this build has them.
const BROKERS: [(&str, &str, bool); 3] = [
    ("NATS JetStream", "nats", cfg!(feature = "nats")),
    ("RabbitMQ", "rabbitmq", cfg!(feature = "rabbitmq")),
    ("Kafka (tansu)", "kafka", cfg!(feature = "kafka")),
];

impl Bench {
    /// The relay through each broker sink vs the broker client's own loop, and the
    /// latency enqueue → consumer at an offered load.
    #[cfg_attr(
        not(any(feature = "nats", feature = "rabbitmq", feature = "kafka")),
        allow(clippy::unused_async)
    )]
    pub(super) async fn sinks(&self, args: &Args) -> Result {
        self.heading("Broker sinks: the relay vs a hand-written outbox publisher");
        let missing: Vec<&str> = BROKERS
            .iter()
            .filter(|(_, _, built)| !built)
            .map(|(_, feature, _)| *feature)
            .collect();
        if !missing.is_empty() {
            eprintln!(
                "the sinks section measures only the brokers built in: add `--features {}` \
                 (cargo run --release --features nats,rabbitmq,kafka --example bench -- --only sinks)",
                missing.join(",")
            );
        }
        self.line(&format!(
            "Batch 100; {} events per run, drained from the same table by the relay (every \
             outcome recorded) and by a hand-written publisher: section 1's floor claim of \
             100 (`FOR UPDATE SKIP LOCKED`), the broker client's own publish of the batch \
             (the same encoded messages and headers, the same acknowledgements, pipelined), \
             the floor's completion to `SENT`; as many tasks as the relay has workers, on \
             one client. Median of {} runs, alternating which goes first. \
             The raw producer publishes the same messages from memory, no database: the \
             broker's own ceiling. The sink alone: the events over the time each worker \
             spent in the sink's publish during the relay's drain. The no-op column is the \
             relay with a sink that publishes nowhere (section 1's drain).\n",
            args.sink_events, args.runs
        ));
        self.line(
            "| broker | concurrency | relay events/s | hand-written events/s | relay / hand-written | raw producer events/s | the sink alone events/s | relay, no-op sink events/s |",
        );
        self.line("|---|---|---|---|---|---|---|---|");
        #[allow(unused_mut)]
        let mut latencies: Vec<String> = Vec::new();
        for (name, feature, built) in BROKERS {
            if !built {
                self.line(&format!(
                    "| {name} | – | not built (feature `{feature}`) | | | | | |"
                ));
            }
            #[cfg(feature = "nats")]
            if feature == "nats" {
                let broker = with_brokers::nats::Nats::connect().await?;
                latencies.push(self.broker(&broker, args).await?);
            }
            #[cfg(feature = "rabbitmq")]
            if feature == "rabbitmq" {
                let broker = with_brokers::rabbitmq::Rabbit::connect().await?;
                latencies.push(self.broker(&broker, args).await?);
            }
            #[cfg(feature = "kafka")]
            if feature == "kafka" {
                let broker = with_brokers::kafka::Kafka::start().await?;
                latencies.push(self.broker(&broker, args).await?);
            }
        }
        if latencies.is_empty() {
            return Ok(());
        }
        self.line(&format!(
            "\nEnqueue → consumer at {} events/s offered (one event per transaction, 8 \
             producers), a relay with 4 workers (batch 100) publishing through the sink, a \
             consumer recording each message's arrival; {} s measured after a {} s warm-up.\n",
            args.sink_rate,
            MEASURED.as_secs(),
            WARM_UP.as_secs(),
        ));
        self.line("| broker | consumed events/s | enqueue → consumer p50 | p99 |");
        self.line("|---|---|---|---|");
        for row in latencies {
            self.line(&row);
        }
        Ok(())
    }

    /// One broker's rows: its throughput table rows printed, its latency row returned.
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    async fn broker<B: Broker>(&self, broker: &B, args: &Args) -> Result<String> {
        use super::{Figure, payload};
        let n = args.sink_events;
        let events: Vec<super::BenchEvent> = (0..n).map(payload).collect();
        for workers in [1, 4] {
            let (mut relay, mut pipeline, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            let (mut raw, mut noop, mut alone) = (Vec::new(), Vec::new(), Vec::new());
            for run in 0..args.runs {
                let ((r, a), p) = if run % 2 == 0 {
                    let r = self.relay_through(broker, &events, workers).await?;
                    (r, self.pipeline_through(broker, &events, workers).await?)
                } else {
                    let p = self.pipeline_through(broker, &events, workers).await?;
                    (self.relay_through(broker, &events, workers).await?, p)
                };
                alone.push(a);
                raw.push(raw_through(broker, &events, workers).await?);
                noop.push(self.drain_relay(&events, 100, workers).await?);
                relay.push(r);
                pipeline.push(p);
                ratios.push(r / p);
            }
            let ratio = Figure::of(ratios);
            self.line(&format!(
                "| {} | {workers} | {} | {} | {} | {} | {} | {} |",
                B::NAME,
                Figure::of(relay).show(""),
                Figure::of(pipeline).show(""),
                ratio.ratio(),
                Figure::of(raw).show(""),
                Figure::of(alone).show(""),
                Figure::of(noop).show(""),
            ));
        }
        self.latency(broker, args.sink_rate).await
    }
}

/// Events/s of the broker client's own loop publishing `events` from memory: no
/// database.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
async fn raw_through<B: Broker>(
    broker: &B,
    events: &[super::BenchEvent],
    workers: usize,
) -> Result<f64> {
    let messages = std::sync::Arc::new(with_brokers::RawMessage::all(events));
    publish_through(
        broker,
        with_brokers::Source::Memory(messages),
        events.len(),
        workers,
    )
    .await
}

/// Events/s of `source` published through `broker`'s client by its own loop.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
async fn publish_through<B: Broker>(
    broker: &B,
    source: with_brokers::Source,
    n: usize,
    workers: usize,
) -> Result<f64> {
    let tag = with_brokers::tag();
    broker.create(&tag).await?;
    let elapsed = broker.raw(&tag, source, workers).await;
    broker.delete(&tag).await?;
    Ok(n as f64 / elapsed?.as_secs_f64())
}

impl Bench {
    /// Events/s of a hand-written outbox publisher draining `events` through `broker`'s
    /// client: the floor's claim of 100 (`FOR UPDATE SKIP LOCKED`), the client's own
    /// publish of the batch with the sink's acknowledgements, the floor's completion.
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    async fn pipeline_through<B: Broker>(
        &self,
        broker: &B,
        events: &[super::BenchEvent],
        workers: usize,
    ) -> Result<f64> {
        self.fill_with(events).await?;
        let pool = self.pool(workers).await?;
        let rate = publish_through(
            broker,
            with_brokers::Source::Table(pool.clone()),
            events.len(),
            workers,
        )
        .await;
        pool.close().await;
        let unsent: i64 =
            sqlx::query_scalar("SELECT count(*) FROM bench_events WHERE status <> 'SENT'")
                .fetch_one(&self.pool)
                .await?;
        match unsent {
            0 => rate,
            left => Err(format!("{}: {left} events not SENT by the pipeline", B::NAME).into()),
        }
    }
}

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub(crate) mod with_brokers {
    use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, PoisonError};
    use std::time::{Duration, Instant, SystemTime};

    use outbox::Relay;
    use outbox::message::{header, timestamp};
    use outbox::{CancellationToken, Delivery, Sink, SinkError};
    use tokio::time::MissedTickBehavior;

    use sqlx::PgPool;

    use super::super::{
        Bench, BenchEvent, FLOOR_CLAIM, FLOOR_COMPLETE, Result, micros_now, stamped,
    };
    use super::{MEASURED, WARM_UP};

    pub(super) const BATCH: usize = 100;
    const LATENCY_WORKERS: usize = 4;
    const PRODUCERS: u32 = 8;
    /// The body's media type, as `Json` names it.
    pub(super) const JSON: &str = "application/json";

    /// Microseconds from enqueue to a consumer, per message.
    pub(super) type Latencies = Arc<Mutex<Vec<u32>>>;

    /// The messages of an ordering benchmark read back from a broker, in its order: each
    /// key's first deliveries must come in the order the events were enqueued (the
    /// `payload` of each is its place in the backlog); a redelivery may come later.
    pub(super) struct FirstDeliveries {
        /// Each key's last event first delivered, by its place.
        last: std::collections::HashMap<i64, u64>,
        seen: std::collections::HashSet<u64>,
        in_sequence: bool,
    }

    impl FirstDeliveries {
        pub(super) fn new() -> Self {
            Self {
                last: std::collections::HashMap::new(),
                seen: std::collections::HashSet::new(),
                in_sequence: true,
            }
        }

        /// Notes the next message's JSON `body`.
        pub(super) fn note(&mut self, body: &[u8]) -> Result {
            let body: serde_json::Value = serde_json::from_slice(body)?;
            let key = body["key"].as_i64().ok_or("no key in the body")?;
            let place: u64 = body["payload"].as_str().ok_or("no payload")?.parse()?;
            if self.seen.insert(place) {
                self.in_sequence &= self
                    .last
                    .insert(key, place)
                    .is_none_or(|before| before < place);
            }
            Ok(())
        }

        /// Whether all `n` events were read.
        pub(super) fn seen_all(&self, n: usize) -> bool {
            self.seen.len() >= n
        }

        /// Whether the `n` events were all read, each key's in sequence.
        pub(super) fn all_in_sequence(&self, n: usize) -> Result<bool> {
            if !self.seen_all(n) {
                return Err(format!("{} of {n} events read back", self.seen.len()).into());
            }
            Ok(self.in_sequence)
        }
    }

    /// An event type the broker sinks publish: [`BenchEvent`], or its traced twin.
    pub(crate) trait Event:
        outbox::Outbox + serde::Serialize + Send + Sync + 'static
    {
    }

    impl<T: outbox::Outbox + serde::Serialize + Send + Sync + 'static> Event for T {}

    /// A broker the section measures.
    pub(crate) trait Broker {
        const NAME: &'static str;
        type Sink<T: Event>: Sink<T> + Clone + Send + Sync + 'static;
        /// A fresh stream, queue or topic for `tag`.
        async fn create(&self, tag: &str) -> Result;
        /// Deletes what [`Broker::create`] made.
        async fn delete(&self, tag: &str) -> Result;
        /// The sink publishing to `tag`'s.
        async fn sink<T: Event>(&self, tag: &str) -> Result<Self::Sink<T>>;
        /// How long the client's own loop takes to publish what `source` holds to `tag`'s,
        /// batches of [`BATCH`] pipelined, by `workers` tasks.
        async fn raw(&self, tag: &str, source: Source, workers: usize) -> Result<Duration>;
        /// Whether the `n` events of an ordering benchmark that `tag`'s holds were first
        /// delivered in sequence for each key ([`FirstDeliveries`]).
        async fn first_deliveries_in_sequence(&self, tag: &str, n: usize) -> Result<bool>;
        /// A consumer of `tag`'s recording each message's latency until `stop`.
        async fn consume(
            &self,
            tag: &str,
            latencies: Latencies,
            stop: CancellationToken,
        ) -> Result<tokio::task::JoinHandle<Result>>;
    }

    /// A unique name part for one run's stream, queue or topic.
    pub(super) fn tag() -> String {
        static RUN: AtomicU32 = AtomicU32::new(0);
        format!(
            "{}-{}",
            std::process::id(),
            RUN.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// One message of the raw producer: what the relay's claim would hand the sink.
    pub(crate) struct RawMessage {
        pub(super) event: BenchEvent,
        pub(super) event_id: String,
        pub(super) created_at: SystemTime,
    }

    impl RawMessage {
        pub(super) fn all(events: &[BenchEvent]) -> Vec<Self> {
            let created_at = SystemTime::now();
            events
                .iter()
                .map(|event| Self {
                    event: event.clone(),
                    event_id: uuid::Uuid::now_v7().to_string(),
                    created_at,
                })
                .collect()
        }

        /// The body, as the sinks' `Json` encodes it.
        pub(super) fn body(&self) -> Result<Vec<u8>> {
            Ok(serde_json::to_vec(&self.event)?)
        }

        /// The headers the sinks set (`outbox::message`), for a first attempt: the
        /// content type aside.
        pub(super) fn headers(&self) -> [(&'static str, String); 5] {
            [
                (header::EVENT_ID, self.event_id.clone()),
                (header::TABLE, "bench_events".to_owned()),
                (header::GENERATION, "1".to_owned()),
                (header::ATTEMPT, "1".to_owned()),
                (header::CREATED_AT, timestamp(self.created_at)),
            ]
        }
    }

    /// Where a publish loop takes its batches from.
    #[derive(Clone)]
    pub(crate) enum Source {
        /// The messages, in memory: the broker client alone, no database.
        Memory(Arc<Vec<RawMessage>>),
        /// The table's backlog, claimed and completed with hand-written SQL (the floor's
        /// statements of section 1): a hand-written outbox publisher.
        Table(PgPool),
    }

    /// Runs `publish` on batches of [`BATCH`] from `source`, by `workers` tasks taking the
    /// next batch as they finish one; returns how long it took.
    pub(super) async fn in_batches<C, F>(
        source: Source,
        workers: usize,
        client: C,
        publish: fn(C, Arc<Vec<RawMessage>>, std::ops::Range<usize>) -> F,
    ) -> Result<Duration>
    where
        C: Clone + Send + 'static,
        F: Future<Output = Result> + Send + 'static,
    {
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks: tokio::task::JoinSet<Result> = tokio::task::JoinSet::new();
        for _ in 0..workers {
            let (next, source, client) = (Arc::clone(&next), source.clone(), client.clone());
            tasks.spawn(async move {
                loop {
                    match &source {
                        Source::Memory(messages) => {
                            let start = next.fetch_add(BATCH, Ordering::Relaxed);
                            if start >= messages.len() {
                                return Ok(());
                            }
                            let end = (start + BATCH).min(messages.len());
                            publish(client.clone(), Arc::clone(messages), start..end).await?;
                        }
                        Source::Table(pool) => {
                            if !claim_publish_complete(pool, client.clone(), publish).await? {
                                return Ok(());
                            }
                        }
                    }
                }
            });
        }
        for done in tasks.join_all().await {
            done?;
        }
        Ok(started.elapsed())
    }

    /// One round of the hand-written publisher: claims up to [`BATCH`] READY rows
    /// (`FOR UPDATE SKIP LOCKED`), publishes them with `publish`, and marks them `SENT`;
    /// false once nothing is left to claim.
    async fn claim_publish_complete<C, F: Future<Output = Result>>(
        pool: &PgPool,
        client: C,
        publish: fn(C, Arc<Vec<RawMessage>>, std::ops::Range<usize>) -> F,
    ) -> Result<bool> {
        let rows: Vec<(i64, String, i64, String)> = sqlx::query_as(FLOOR_CLAIM)
            .bind(i64::try_from(BATCH)?)
            .fetch_all(pool)
            .await?;
        if rows.is_empty() {
            return Ok(false);
        }
        let created_at = SystemTime::now();
        let (ids, messages): (Vec<i64>, Vec<RawMessage>) = rows
            .into_iter()
            .map(|(id, event_id, _, payload)| {
                let event = BenchEvent { payload };
                (
                    id,
                    RawMessage {
                        event,
                        event_id,
                        created_at,
                    },
                )
            })
            .unzip();
        let len = messages.len();
        publish(client, Arc::new(messages), 0..len).await?;
        sqlx::query(FLOOR_COMPLETE).bind(ids).execute(pool).await?;
        Ok(true)
    }

    /// The latency of a message whose body is a [`stamped`] event's JSON, now.
    pub(super) fn latency_of(body: &[u8]) -> Option<u32> {
        let now = micros_now();
        let event: serde_json::Value = serde_json::from_slice(body).ok()?;
        let enqueued: u64 = event["payload"].as_str()?.parse().ok()?;
        Some(u32::try_from(now.saturating_sub(enqueued)).unwrap_or(u32::MAX))
    }

    /// A sink that publishes through `inner` and shuts its relay down once `target`
    /// events are published.
    struct Until<S> {
        inner: S,
        published: AtomicUsize,
        /// Nanoseconds spent in `inner`'s publish, all workers together.
        busy: Arc<AtomicU64>,
        target: usize,
        done: CancellationToken,
    }

    impl<T: Event, S: Sink<T>> Sink<T> for Until<S> {
        async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
            let started = Instant::now();
            let results = self.inner.publish(batch).await;
            let busy = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.busy.fetch_add(busy, Ordering::Relaxed);
            let ok = results.iter().filter(|r| r.is_ok()).count();
            if self.published.fetch_add(ok, Ordering::Relaxed) + ok >= self.target {
                self.done.cancel();
            }
            results
        }

        async fn withdraw(&self) -> bool {
            self.inner.withdraw().await
        }

        fn destination(&self, event: &T) -> Option<outbox::relay::Destination> {
            self.inner.destination(event)
        }
    }

    impl Bench {
        /// Events/s of the relay draining `events` through `broker`'s sink, until every
        /// outcome is recorded; and events/s of the sink alone, per worker: the events
        /// over the time each worker spent in the sink's publish, on average.
        pub(crate) async fn relay_through<B: Broker>(
            &self,
            broker: &B,
            events: &[BenchEvent],
            workers: usize,
        ) -> Result<(f64, f64)> {
            self.fill_with(events).await?;
            self.relay_through_filled::<B, BenchEvent>(broker, events.len(), workers)
                .await
        }

        /// [`relay_through`](Self::relay_through) of the `n` events `T`'s table holds.
        pub(crate) async fn relay_through_filled<B: Broker, T: Event>(
            &self,
            broker: &B,
            n: usize,
            workers: usize,
        ) -> Result<(f64, f64)> {
            let tag = tag();
            broker.create(&tag).await?;
            let pool = self.pool(workers + 1).await?;
            let stop = CancellationToken::new();
            // Kept past the timing: a client's shutdown (librdkafka's can take a second)
            // is not the relay's cost, and the raw loop drops its client untimed too.
            let client = broker.sink(&tag).await?;
            let busy = Arc::new(AtomicU64::new(0));
            let sink = Until {
                inner: client.clone(),
                published: AtomicUsize::new(0),
                busy: Arc::clone(&busy),
                target: n,
                done: stop.clone(),
            };
            let relay = Relay::<T, _>::new(pool.clone(), sink)
                .batch_size(u32::try_from(BATCH)?)
                .concurrency(workers);
            let started = Instant::now();
            relay.run(stop).await?;
            let elapsed = started.elapsed();
            drop(client);
            pool.close().await;
            if T::SPEC.key().is_some() && !broker.first_deliveries_in_sequence(&tag, n).await? {
                return Err(
                    format!("{}: a key's first deliveries out of sequence", B::NAME).into(),
                );
            }
            broker.delete(&tag).await?;
            let unsent: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {} WHERE status <> 'SENT'",
                T::SPEC.table()
            )))
            .fetch_one(&self.pool)
            .await?;
            match unsent {
                0 => {
                    let per_worker = busy.load(Ordering::Relaxed) as f64 / 1e9 / workers as f64;
                    Ok((n as f64 / elapsed.as_secs_f64(), n as f64 / per_worker))
                }
                left => Err(format!("{}: {left} events not SENT after the run", B::NAME).into()),
            }
        }

        /// The latency row of `broker` at `rate` events/s offered.
        pub(super) async fn latency<B: Broker>(&self, broker: &B, rate: u32) -> Result<String> {
            self.reset().await?;
            let tag = tag();
            broker.create(&tag).await?;
            let latencies = Latencies::default();
            let stop = CancellationToken::new();
            let consumer = broker
                .consume(&tag, Arc::clone(&latencies), stop.clone())
                .await?;
            let relay_pool = self.pool(LATENCY_WORKERS + 1).await?;
            let producer_pool = self.pool(PRODUCERS as usize).await?;
            let relay = tokio::spawn(
                Relay::<BenchEvent, _>::new(
                    relay_pool.clone(),
                    broker.sink::<BenchEvent>(&tag).await?,
                )
                .batch_size(u32::try_from(BATCH)?)
                .concurrency(LATENCY_WORKERS)
                .run(stop.clone()),
            );
            let period = Duration::from_secs(1) * PRODUCERS / rate;
            let producers: Vec<_> = (0..PRODUCERS)
                .map(|_| {
                    let (pool, stop) = (producer_pool.clone(), stop.clone());
                    tokio::spawn(async move {
                        let mut tick = tokio::time::interval(period);
                        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
                        while !stop.is_cancelled() {
                            tick.tick().await;
                            let _ = stamped().enqueue(&pool).await?;
                        }
                        Ok::<_, outbox::OutboxError>(())
                    })
                })
                .collect();
            tokio::time::sleep(WARM_UP).await;
            latencies
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
            tokio::time::sleep(MEASURED).await;
            let mut taken =
                std::mem::take(&mut *latencies.lock().unwrap_or_else(PoisonError::into_inner));
            stop.cancel();
            for producer in producers {
                producer.await??;
            }
            relay.await??;
            consumer.await??;
            relay_pool.close().await;
            producer_pool.close().await;
            broker.delete(&tag).await?;

            taken.sort_unstable();
            let percentile = |p: usize| taken.get(taken.len().saturating_sub(1) * p / 100).copied();
            let ms = |micros: Option<u32>| {
                micros.map_or("-".to_owned(), |m| format!("{:.1} ms", f64::from(m) / 1e3))
            };
            Ok(format!(
                "| {} | {:.0} | {} | {} |",
                B::NAME,
                taken.len() as f64 / MEASURED.as_secs_f64(),
                ms(percentile(50)),
                ms(percentile(99)),
            ))
        }
    }

    /// Waits for `stop` or the next item of `stream`, whichever comes first.
    #[cfg(any(feature = "nats", feature = "rabbitmq"))]
    pub(super) async fn next_or_stop<S: futures_util::Stream + Unpin>(
        stream: &mut S,
        stop: &CancellationToken,
    ) -> Option<S::Item> {
        use futures_util::StreamExt as _;
        tokio::select! {
            () = stop.cancelled() => None,
            item = stream.next() => item,
        }
    }

    #[cfg(feature = "nats")]
    pub(crate) mod nats {
        use std::ops::Range;
        use std::sync::{Arc, PoisonError};
        use std::time::Duration;

        use futures_util::future::join_all;
        use outbox::CancellationToken;
        use outbox::message::header;
        use outbox::nats::async_nats::jetstream::{self, Context, consumer, stream};
        use outbox::nats::{JetStreamSink, async_nats};

        use super::{
            BATCH, Broker, Event, FirstDeliveries, JSON, Latencies, RawMessage, Result, Source,
            in_batches, latency_of, next_or_stop,
        };

        pub(crate) struct Nats {
            jetstream: Context,
        }

        fn stream_of(tag: &str) -> String {
            format!("BENCH_SINKS_{}", tag.replace('-', "_"))
        }

        fn subject_of(tag: &str) -> String {
            format!("bench.sinks.{tag}")
        }

        impl Nats {
            pub(crate) async fn connect() -> Result<Self> {
                let url = std::env::var("OUTBOX_NATS_URL")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
                let client = async_nats::connect(&url)
                    .await
                    .map_err(|error| format!("NATS at {url}: {error}"))?;
                Ok(Self {
                    jetstream: jetstream::new(client),
                })
            }
        }

        async fn publish(
            (jetstream, subject): (Context, String),
            messages: Arc<Vec<RawMessage>>,
            range: Range<usize>,
        ) -> Result {
            let mut acks = Vec::with_capacity(BATCH);
            for message in &messages[range] {
                let mut publish = jetstream::message::PublishMessage::build()
                    .payload(message.body()?.into())
                    .message_id(&message.event_id);
                for (name, value) in message.headers() {
                    publish = publish.header(name, value);
                }
                publish = publish.header(header::CONTENT_TYPE, JSON);
                acks.push(jetstream.send_publish(subject.clone(), publish).await?);
            }
            for ack in join_all(acks.into_iter().map(IntoFuture::into_future)).await {
                ack?;
            }
            Ok(())
        }

        impl Broker for Nats {
            const NAME: &'static str = "NATS JetStream";
            type Sink<T: Event> = JetStreamSink<T>;

            async fn create(&self, tag: &str) -> Result {
                self.jetstream
                    .create_stream(stream::Config {
                        name: stream_of(tag),
                        subjects: vec![subject_of(tag)],
                        ..Default::default()
                    })
                    .await?;
                Ok(())
            }

            async fn delete(&self, tag: &str) -> Result {
                self.jetstream.delete_stream(stream_of(tag)).await?;
                Ok(())
            }

            async fn sink<T: Event>(&self, tag: &str) -> Result<Self::Sink<T>> {
                Ok(JetStreamSink::new(self.jetstream.clone(), subject_of(tag)))
            }

            async fn raw(&self, tag: &str, source: Source, workers: usize) -> Result<Duration> {
                let client = (self.jetstream.clone(), subject_of(tag));
                in_batches(source, workers, client, publish).await
            }

            async fn first_deliveries_in_sequence(&self, tag: &str, n: usize) -> Result<bool> {
                let mut stream = self.jetstream.get_stream(stream_of(tag)).await?;
                let stored = stream.info().await?.state.messages;
                let mut first = FirstDeliveries::new();
                for sequence in 1..=stored {
                    first.note(&stream.get_raw_message(sequence).await?.payload)?;
                }
                first.all_in_sequence(n)
            }

            async fn consume(
                &self,
                tag: &str,
                latencies: Latencies,
                stop: CancellationToken,
            ) -> Result<tokio::task::JoinHandle<Result>> {
                let stream = self.jetstream.get_stream(stream_of(tag)).await?;
                let consumer = stream
                    .create_consumer(consumer::pull::Config::default())
                    .await?;
                let mut messages = consumer.messages().await?;
                Ok(tokio::spawn(async move {
                    while let Some(message) = next_or_stop(&mut messages, &stop).await {
                        let message = message?;
                        if let Some(latency) = latency_of(&message.payload) {
                            latencies
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(latency);
                        }
                        message.ack().await?;
                    }
                    Ok(())
                }))
            }
        }
    }

    #[cfg(feature = "rabbitmq")]
    pub(crate) mod rabbitmq {
        use std::ops::Range;
        use std::sync::{Arc, PoisonError};
        use std::time::Duration;

        use futures_util::future::join_all;
        use outbox::CancellationToken;
        use outbox::rabbitmq::RabbitSink;
        use outbox::rabbitmq::lapin::options::{
            BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions,
            BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
        };
        use outbox::rabbitmq::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
        use outbox::rabbitmq::lapin::{
            BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
        };

        use super::{
            BATCH, Broker, Event, FirstDeliveries, JSON, Latencies, RawMessage, Result, Source,
            in_batches, latency_of, next_or_stop,
        };

        pub(crate) struct Rabbit {
            connection: std::sync::Arc<Connection>,
            admin: Channel,
        }

        fn queue_of(tag: &str) -> String {
            format!("outbox.bench.sinks.{tag}")
        }

        impl Rabbit {
            pub(crate) async fn connect() -> Result<Self> {
                let url = std::env::var("OUTBOX_AMQP_URL")
                    .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
                let connection = Connection::connect(&url, ConnectionProperties::default())
                    .await
                    .map_err(|error| format!("RabbitMQ at {url}: {error}"))?;
                let connection = std::sync::Arc::new(connection);
                let admin = connection.create_channel().await?;
                Ok(Self { connection, admin })
            }
        }

        async fn publish(
            (channel, queue): (Channel, String),
            messages: Arc<Vec<RawMessage>>,
            range: Range<usize>,
        ) -> Result {
            let mut confirms = Vec::with_capacity(BATCH);
            for message in &messages[range] {
                let mut headers = FieldTable::default();
                for (name, value) in message.headers() {
                    headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
                }
                let properties = BasicProperties::default()
                    .with_message_id(ShortString::try_new(message.event_id.as_str())?)
                    .with_delivery_mode(2)
                    .with_headers(headers)
                    .with_content_type(ShortString::try_new(JSON)?);
                let options = BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                };
                confirms.push(
                    channel
                        .basic_publish(
                            "".into(),
                            queue.as_str().into(),
                            options,
                            &message.body()?,
                            properties,
                        )
                        .await?,
                );
            }
            for confirm in join_all(confirms).await {
                match confirm? {
                    Confirmation::Ack(None) => {}
                    other => return Err(format!("RabbitMQ answered {other:?}").into()),
                }
            }
            Ok(())
        }

        impl Broker for Rabbit {
            const NAME: &'static str = "RabbitMQ";
            type Sink<T: Event> = RabbitSink<T>;

            async fn create(&self, tag: &str) -> Result {
                self.admin
                    .queue_declare(
                        queue_of(tag).as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                Ok(())
            }

            async fn delete(&self, tag: &str) -> Result {
                self.admin
                    .queue_delete(queue_of(tag).as_str().into(), QueueDeleteOptions::default())
                    .await?;
                Ok(())
            }

            async fn sink<T: Event>(&self, tag: &str) -> Result<Self::Sink<T>> {
                Ok(
                    RabbitSink::new(std::sync::Arc::clone(&self.connection), "", queue_of(tag))
                        .await?,
                )
            }

            async fn raw(&self, tag: &str, source: Source, workers: usize) -> Result<Duration> {
                let channel = self.connection.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                let elapsed =
                    in_batches(source, workers, (channel.clone(), queue_of(tag)), publish).await;
                channel.close(200, "done".into()).await?;
                elapsed
            }

            async fn first_deliveries_in_sequence(&self, tag: &str, n: usize) -> Result<bool> {
                let mut first = FirstDeliveries::new();
                let taken = BasicGetOptions { no_ack: true };
                while let Some(message) = self
                    .admin
                    .basic_get(queue_of(tag).as_str().into(), taken)
                    .await?
                {
                    first.note(&message.delivery.data)?;
                }
                first.all_in_sequence(n)
            }

            async fn consume(
                &self,
                tag: &str,
                latencies: Latencies,
                stop: CancellationToken,
            ) -> Result<tokio::task::JoinHandle<Result>> {
                let channel = self.connection.create_channel().await?;
                channel.basic_qos(1_000, BasicQosOptions::default()).await?;
                let mut consumer = channel
                    .basic_consume(
                        queue_of(tag).as_str().into(),
                        "bench".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
                Ok(tokio::spawn(async move {
                    while let Some(delivery) = next_or_stop(&mut consumer, &stop).await {
                        let delivery = delivery?;
                        if let Some(latency) = latency_of(&delivery.data) {
                            latencies
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(latency);
                        }
                        delivery.ack(BasicAckOptions::default()).await?;
                    }
                    channel.close(200, "done".into()).await?;
                    Ok(())
                }))
            }
        }
    }

    #[cfg(feature = "kafka")]
    pub(crate) mod kafka {
        use std::ops::Range;
        use std::sync::{Arc, PoisonError};
        use std::time::Duration;

        use futures_util::future::join_all;
        use outbox::CancellationToken;
        use outbox::kafka::KafkaSink;
        use outbox::kafka::rdkafka::admin::{
            AdminClient, AdminOptions, NewTopic, TopicReplication,
        };
        use outbox::kafka::rdkafka::client::DefaultClientContext;
        use outbox::kafka::rdkafka::consumer::{Consumer as _, StreamConsumer};
        use outbox::kafka::rdkafka::message::{Header, OwnedHeaders};
        use outbox::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
        use outbox::kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
        use outbox::message::header;

        use super::{
            BATCH, Broker, Event, FirstDeliveries, JSON, Latencies, RawMessage, Result, Source,
            in_batches, latency_of,
        };
        // The tests' tansu.
        use outbox_testkit::tansu::Tansu;

        pub(crate) struct Kafka {
            tansu: Tansu,
            admin: AdminClient<DefaultClientContext>,
            /// The sink's `linger.ms`, where not the sink's default (0).
            linger: Option<&'static str>,
        }

        fn topic_of(tag: &str) -> String {
            format!("bench-sinks-{tag}")
        }

        impl Kafka {
            pub(crate) async fn start() -> Result<Self> {
                let tansu = Tansu::start().await?;
                let admin = ClientConfig::new()
                    .set("bootstrap.servers", tansu.bootstrap())
                    .create()?;
                Ok(Self {
                    tansu,
                    admin,
                    linger: None,
                })
            }

            /// The sink's producer waits `ms` for more records before it sends a batch.
            pub(crate) fn linger(mut self, ms: &'static str) -> Self {
                self.linger = Some(ms);
                self
            }

            fn config(&self) -> ClientConfig {
                let mut config = ClientConfig::new();
                config.set("bootstrap.servers", self.tansu.bootstrap());
                config
            }

            /// A consumer of `tag`'s topic from its beginning.
            fn consumer(&self, tag: &str) -> Result<StreamConsumer> {
                let consumer: StreamConsumer = self
                    .config()
                    .set("group.id", "outbox-bench")
                    .set("enable.auto.commit", "false")
                    // tansu holds a fetch for its full wait even once records arrive:
                    // a short wait measures the publish path, not tansu's fetch.
                    .set("fetch.wait.max.ms", "10")
                    .create()?;
                let mut partitions = TopicPartitionList::new();
                partitions.add_partition_offset(&topic_of(tag), 0, Offset::Beginning)?;
                consumer.assign(&partitions)?;
                Ok(consumer)
            }
        }

        async fn publish(
            (producer, topic): (FutureProducer, Arc<str>),
            messages: Arc<Vec<RawMessage>>,
            range: Range<usize>,
        ) -> Result {
            let mut reports = Vec::with_capacity(BATCH);
            for message in &messages[range] {
                let mut headers = OwnedHeaders::new_with_capacity(6);
                let named = message.headers();
                for (name, value) in &named {
                    headers = headers.insert(Header {
                        key: name,
                        value: Some(value.as_bytes()),
                    });
                }
                headers = headers.insert(Header {
                    key: header::CONTENT_TYPE,
                    value: Some(JSON.as_bytes()),
                });
                let body = message.body()?;
                let record = FutureRecord::to(&topic)
                    .payload(&body)
                    .key(message.event_id.as_bytes())
                    .headers(headers);
                reports.push(
                    producer
                        .send_result(record)
                        .map_err(|(error, _)| format!("producing: {error}"))?,
                );
            }
            for report in join_all(reports).await {
                report?.map_err(|(error, _)| format!("delivery: {error}"))?;
            }
            Ok(())
        }

        impl Broker for Kafka {
            const NAME: &'static str = "Kafka (tansu)";
            type Sink<T: Event> = KafkaSink<T>;

            async fn create(&self, tag: &str) -> Result {
                let topic = topic_of(tag);
                let created = self
                    .admin
                    .create_topics(
                        &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
                        &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
                    )
                    .await?;
                for result in created {
                    result.map_err(|(topic, code)| format!("creating topic {topic}: {code}"))?;
                }
                Ok(())
            }

            async fn delete(&self, tag: &str) -> Result {
                let topic = topic_of(tag);
                for result in self
                    .admin
                    .delete_topics(&[&topic], &AdminOptions::new())
                    .await?
                {
                    result.map_err(|(topic, code)| format!("deleting topic {topic}: {code}"))?;
                }
                Ok(())
            }

            async fn sink<T: Event>(&self, tag: &str) -> Result<Self::Sink<T>> {
                let mut config = self.config();
                if let Some(ms) = self.linger {
                    config.set("linger.ms", ms);
                }
                Ok(KafkaSink::new(&config, topic_of(tag))?)
            }

            async fn raw(&self, tag: &str, source: Source, workers: usize) -> Result<Duration> {
                // What `KafkaSink` sets for `BenchEvent`'s 30 s lease.
                let producer: FutureProducer = self
                    .config()
                    .set("enable.idempotence", "true")
                    .set("acks", "all")
                    .set("message.timeout.ms", "10000")
                    .set("linger.ms", "0")
                    .create()?;
                let topic: Arc<str> = topic_of(tag).into();
                in_batches(source, workers, (producer, topic), publish).await
            }

            async fn first_deliveries_in_sequence(&self, tag: &str, n: usize) -> Result<bool> {
                let consumer = self.consumer(tag)?;
                let mut first = FirstDeliveries::new();
                // Records until all `n` were seen, or none came for a while.
                while !first.seen_all(n)
                    && let Ok(message) =
                        tokio::time::timeout(Duration::from_secs(5), consumer.recv()).await
                {
                    first.note(message?.payload().ok_or("a record without a body")?)?;
                }
                first.all_in_sequence(n)
            }

            async fn consume(
                &self,
                tag: &str,
                latencies: Latencies,
                stop: CancellationToken,
            ) -> Result<tokio::task::JoinHandle<Result>> {
                let consumer = self.consumer(tag)?;
                Ok(tokio::spawn(async move {
                    loop {
                        let message = tokio::select! {
                            () = stop.cancelled() => return Ok(()),
                            message = consumer.recv() => message?,
                        };
                        if let Some(latency) = message.payload().and_then(latency_of) {
                            latencies
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(latency);
                        }
                    }
                }))
            }
        }
    }
}
