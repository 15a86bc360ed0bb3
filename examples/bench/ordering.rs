//! The `ordering` section: what per-key ordering (`#[outbox(key)]`) costs.
//!
//! ```text
//! cargo run --release --example bench -- --only ordering
//! ```
//!
//! 1. A backlog of 100,000 events drained by a relay (batch 100, 4 workers, no-op sink),
//!    ordered vs the same columns unordered, in one run, for a range of key counts. With
//!    few keys, each claim carries runs of a key: its first event still to go and the
//!    ones after it, published in order.
//! 2. The claim beside a large history: the claim of 100 from a backlog of distinct keys,
//!    timed on a small table and again beside 1,000,000 `SENT` rows and 100,000 keys
//!    held back by a `DEAD` event (each with a later event set aside behind it), with
//!    the claim's plan.
//! 3. Against pgmq's grouped FIFO reads: the same key counts, 10,000 events, drained by
//!    the relay and by pgmq consumers reading with `read_grouped` and `read_grouped_rr`
//!    (each read groups the whole queue, so a larger backlog would mostly measure that).

use std::fmt::Write as _;
use std::time::Instant;

use outbox::Outbox;

use super::{Args, Bench, Figure, PEER_VT, PeerQueue, PgmqLeftovers, Result};
use outbox_testkit::app::{BenchKeyedEvent, BenchOrderedEvent};

const BATCH: u32 = 100;
const WORKERS: usize = 4;
/// Events of each row of part 1.
const EVENTS: usize = 100_000;
/// Claims timed per table in part 2.
const CLAIMS: usize = 200;
/// Events of each row of part 4, through a broker.
#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
const THROUGH_BROKER: usize = 5_000;

impl Bench {
    pub(super) async fn ordering(&self, args: &Args, leftovers: &PgmqLeftovers) -> Result {
        self.heading("Ordering: per-key ordering vs the same table unordered");
        self.line(&format!(
            "Part 1: the relay drains a backlog (batch {BATCH}, {WORKERS} workers, no-op sink, \
             100-byte payloads), once with `#[outbox(key)]` on `key` and once with `key` a plain \
             column, the two in turn (order reversed every other run), {} runs. Events are \
             enqueued with keys round-robin, as many customers' orders arrive, {EVENTS} per \
             row. Each claim takes every key's first event still to go, then, in the room \
             left, runs of each key after it, published layer by layer (a key's event after \
             the one before it was acknowledged). CPU: the server's process tree's and the bench's \
             (the relay's), per 1,000 events, while the relay ran; on a shared machine it \
             varies far less than events/s, and unordered / ordered CPU is what an ordered \
             event costs the database and the relay, relative to an unordered one. *Once \
             sending*: the events recorded after the first batch, over the time from its \
             recording to the last one's (a `SENT` row's `next_attempt_at` says when it was \
             recorded): the rate without the relay's first claim, which on a keyed table \
             steps over the backlog held behind each key's first event, once.\n",
            args.runs
        ));
        self.line(
            "| keys | events | ordered events/s | unordered events/s | ordered / unordered \
             | ordered events/s once sending | once sending: ordered / unordered \
             | ordered CPU ms / 1,000 events | unordered | unordered / ordered CPU |",
        );
        self.line("|---|---|---|---|---|---|---|---|---|---|");
        for &keys in &args.ordering_keys {
            let keys = keys as usize;
            let n = EVENTS;
            let ordered: Vec<BenchOrderedEvent> = (0..n)
                .map(|i| BenchOrderedEvent {
                    key: i64::try_from(i % keys).unwrap_or_default(),
                    payload: format!("{i:0>100}"),
                })
                .collect();
            let unordered: Vec<BenchKeyedEvent> = ordered.iter().map(Into::into).collect();
            let (mut with, mut without) = (Vec::new(), Vec::new());
            let (mut sending_with, mut sending_without) = (Vec::new(), Vec::new());
            for run in 0..args.runs {
                for ordered_now in [run % 2 == 0, run % 2 == 1] {
                    if ordered_now {
                        with.push(self.drain_relay_cpu(&ordered, BATCH, WORKERS).await?);
                        sending_with.push(self.sending_rate::<BenchOrderedEvent>().await?);
                    } else {
                        without.push(self.drain_relay_cpu(&unordered, BATCH, WORKERS).await?);
                        sending_without.push(self.sending_rate::<BenchKeyedEvent>().await?);
                    }
                }
            }
            let ratio = Figure::of(with.iter().zip(&without).map(|(o, u)| o.0 / u.0).collect());
            let sending_ratio = Figure::of(
                sending_with
                    .iter()
                    .zip(&sending_without)
                    .map(|(o, u)| o / u)
                    .collect(),
            );
            let cpu = |drains: &[(f64, Option<super::cpu::Work>)]| {
                drains
                    .iter()
                    .map(|d| d.1.map(super::cpu::Work::total))
                    .collect::<Option<Vec<f64>>>()
                    .map(Figure::of)
            };
            let (cpu_with, cpu_without) = (cpu(&with), cpu(&without));
            let cpu_ratio = with
                .iter()
                .zip(&without)
                .map(|(o, u)| Some(u.1?.total() / o.1?.total()))
                .collect::<Option<Vec<f64>>>()
                .map(Figure::of);
            let shown =
                |figure: Option<Figure>| figure.map_or_else(|| "-".to_owned(), |f| f.show(""));
            self.line(&format!(
                "| {keys} | {n} | {} | {} | {} | {} | {} | {} | {} | {} |",
                Figure::of(with.iter().map(|d| d.0).collect()).show(""),
                Figure::of(without.iter().map(|d| d.0).collect()).show(""),
                ratio.ratio(),
                Figure::of(sending_with.clone()).show(""),
                sending_ratio.ratio(),
                shown(cpu_with),
                shown(cpu_without),
                cpu_ratio.map_or_else(|| "-".to_owned(), Figure::ratio),
            ));
        }
        self.hot_beside_quiet(args).await?;
        self.against_pgmq_fifo(args, leftovers).await?;
        self.through_brokers(args).await?;
        if args.no_history {
            return Ok(());
        }
        self.claim_beside_history().await
    }

    /// Events/s of the drain just done, once sending: the `SENT` rows recorded after the
    /// first batch, over the time from its recording to the last one's.
    async fn sending_rate<T: Outbox>(&self) -> Result<f64> {
        let rate: Option<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT (count(*) FILTER (WHERE next_attempt_at > first))::float8
                 / nullif(extract(epoch FROM max(next_attempt_at) - first)::float8, 0)
             FROM {table}, (SELECT min(next_attempt_at) AS first FROM {table}) AS f
             GROUP BY first",
            table = T::SPEC.table()
        )))
        .fetch_one(&self.pool)
        .await?;
        Ok(rate.unwrap_or(f64::NAN))
    }

    /// Part 1b: keys share a batch. One hot key's backlog of 20,000 events, then one
    /// event of each of 200 quiet keys enqueued after it: when each quiet event is sent,
    /// and when the hot backlog is, from the relay's start (a sent row's
    /// `next_attempt_at` says when it was sent).
    async fn hot_beside_quiet(&self, args: &Args) -> Result {
        const HOT: usize = 20_000;
        const QUIET: usize = 200;
        let event = |key: usize, i: usize| BenchOrderedEvent {
            key: i64::try_from(key).unwrap_or_default(),
            payload: format!("{i:0>100}"),
        };
        let events: Vec<BenchOrderedEvent> = (0..HOT)
            .map(|i| event(0, i))
            .chain((1..=QUIET).map(|key| event(key, key)))
            .collect();
        let (mut quiet_p50, mut quiet_max, mut hot) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.runs {
            self.fill_with(&events).await?;
            let started: f64 =
                sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                    .fetch_one(&self.pool)
                    .await?;
            self.drain_filled::<BenchOrderedEvent>(events.len(), BATCH, WORKERS)
                .await?;
            let (p50, max, last): (f64, f64, f64) = sqlx::query_as(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY t) FILTER (WHERE key > 0),
                        max(t) FILTER (WHERE key > 0), max(t) FILTER (WHERE key = 0)
                 FROM (SELECT key, extract(epoch FROM next_attempt_at)::float8 - $1 AS t
                       FROM bench_ordered_events) AS sent",
            )
            .bind(started)
            .fetch_one(&self.pool)
            .await?;
            quiet_p50.push(p50 * 1e3);
            quiet_max.push(max * 1e3);
            hot.push(last * 1e3);
        }
        let (p50, max, hot) = (
            Figure::of(quiet_p50),
            Figure::of(quiet_max),
            Figure::of(hot),
        );
        self.line(&format!(
            "\nKeys share a batch: one hot key's {HOT} events, then one event of each of \
             {QUIET} quiet keys, drained as above ({} runs), from just before the relay \
             starts. The quiet events sent after {} (median; the last at {}), the hot \
             backlog after {}. Each claim takes every key's first event before any run, so \
             once the quiet events are found the hot key takes only the room they leave; \
             finding them, the first claim walks the hot backlog once (and leaves it in \
             place: the hot key's runs take it), in time proportional to its length.",
            args.runs,
            p50.show(" ms"),
            max.show(" ms"),
            hot.show(" ms"),
        ));
        Ok(())
    }

    /// Part 3: the relay's ordered drain against pgmq consumers reading a queue's
    /// message groups in order (`x-pgmq-group` = the key), each worker reading a batch
    /// and deleting it, as pgmq's FIFO documentation shows, with its FIFO index.
    async fn against_pgmq_fifo(&self, args: &Args, leftovers: &PgmqLeftovers) -> Result {
        const N: usize = 10_000;
        let queue = self.peer_queue(leftovers).await?;
        sqlx::query("SELECT pgmq.create_fifo_index($1)")
            .bind(&queue.name)
            .execute(&self.pool)
            .await?;
        self.line(&format!(
            "\nPart 3: the same key counts against pgmq's grouped FIFO reads ({}): {N} \
             events, 100-byte payloads, drained by the relay as above and by {WORKERS} pgmq \
             consumers, each reading {BATCH} with `read_grouped` (a group's messages \
             first, the oldest group first) or `read_grouped_rr` (round robin over the \
             groups), then deleting them, the key as the message's `x-pgmq-group` header, \
             with pgmq's FIFO index; a consumer whose read finds nothing visible reads \
             again after a millisecond until all are deleted, or for {} s at most (a rate \
             marked *first 30 s* is of what was deleted by then). {} runs. (Each read \
             groups the whole queue: a larger backlog would mostly measure that.)\n",
            queue.installed,
            PGMQ_LIMIT.as_secs(),
            args.runs
        ));
        self.line(
            "| keys | events | relay events/s | pgmq `read_grouped` events/s | pgmq `read_grouped_rr` events/s | relay / `read_grouped` | relay / `read_grouped_rr` |",
        );
        self.line("|---|---|---|---|---|---|---|");
        for &keys in &args.ordering_keys {
            let keys = keys as usize;
            let events: Vec<BenchOrderedEvent> = (0..N)
                .map(|i| BenchOrderedEvent {
                    key: i64::try_from(i % keys).unwrap_or_default(),
                    payload: format!("{i:0>100}"),
                })
                .collect();
            let (mut relay, mut grouped, mut round_robin) = (Vec::new(), Vec::new(), Vec::new());
            // Whether a drain of each read stopped before the end.
            let (mut grouped_cut, mut round_robin_cut) = (false, false);
            for _ in 0..args.runs {
                relay.push(self.drain_relay_cpu(&events, BATCH, WORKERS).await?.0);
                for (read, rates, cut) in [
                    (GroupedRead::Groups, &mut grouped, &mut grouped_cut),
                    (
                        GroupedRead::RoundRobin,
                        &mut round_robin,
                        &mut round_robin_cut,
                    ),
                ] {
                    let (rate, whole) = self.drain_pgmq_fifo(&queue, &events, read).await?;
                    rates.push(rate);
                    *cut |= !whole;
                }
            }
            let ratio = |pgmq: &[f64]| {
                let ratio = Figure::of(relay.iter().zip(pgmq).map(|(r, p)| r / p).collect());
                ratio.ratio()
            };
            let cut =
                [grouped_cut, round_robin_cut].map(|cut| if cut { " (first 30 s)" } else { "" });
            self.line(&format!(
                "| {keys} | {N} | {} | {}{} | {}{} | {} | {} |",
                Figure::of(relay.clone()).show(""),
                Figure::of(grouped.clone()).show(""),
                cut[0],
                Figure::of(round_robin.clone()).show(""),
                cut[1],
                ratio(&grouped),
                ratio(&round_robin),
            ));
        }
        // The peers section measures the queue as `pgmq.create` makes it.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP INDEX IF EXISTS pgmq.\"q_{}_fifo_idx\"",
            queue.name
        )))
        .execute(&self.pool)
        .await?;
        self.empty_queue(&queue).await
    }

    /// Part 4: the same key counts end to end through each broker built in (features
    /// `nats`, `rabbitmq`, `kafka`, as the sinks section runs them): the relay's ordered
    /// drain against the same events unordered, through the broker's sink, and each key's
    /// first deliveries read back.
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    async fn through_brokers(&self, args: &Args) -> Result {
        #[allow(unused_imports)]
        use super::sinks::with_brokers;
        self.line(&format!(
            "\nPart 4: end to end through each broker, as the sinks section runs them (JetStream \
             `PubAck`s; RabbitMQ publisher confirms; Kafka's idempotent producer, `acks=all`, \
             on an in-memory tansu): {THROUGH_BROKER} events of each key count (100-byte \
             payloads) drained by the relay ({WORKERS} workers, batch {BATCH}) ordered and \
             unordered, in turn, {} runs; every ordered run's messages are then read back \
             from the stream, queue or topic and each key's first deliveries checked to be \
             in the order the events were enqueued (a run out of order fails the bench). A \
             key's run goes to the broker an event per acknowledgement, so a hot key costs a \
             broker round trip per event; Kafka with the sink's `linger.ms=0` and with \
             librdkafka's default of 5 ms.\n",
            args.runs
        ));
        self.line(
            "| broker | keys | events | ordered events/s | unordered events/s | ordered / unordered |",
        );
        self.line("|---|---|---|---|---|---|");
        #[cfg(feature = "nats")]
        self.broker_rows(
            &with_brokers::nats::Nats::connect().await?,
            "NATS JetStream",
            args,
        )
        .await?;
        #[cfg(feature = "rabbitmq")]
        self.broker_rows(
            &with_brokers::rabbitmq::Rabbit::connect().await?,
            "RabbitMQ",
            args,
        )
        .await?;
        #[cfg(feature = "kafka")]
        for (linger, label) in [
            (None, "Kafka (tansu), `linger.ms=0`"),
            (Some("5"), "Kafka (tansu), `linger.ms=5`"),
        ] {
            let broker = with_brokers::kafka::Kafka::start().await?;
            let broker = match linger {
                Some(ms) => broker.linger(ms),
                None => broker,
            };
            self.broker_rows(&broker, label, args).await?;
        }
        Ok(())
    }

    /// Part 4's rows for one broker.
    #[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
    async fn broker_rows<B: super::sinks::with_brokers::Broker>(
        &self,
        broker: &B,
        label: &str,
        args: &Args,
    ) -> Result {
        const N: usize = THROUGH_BROKER;
        for &keys in &args.ordering_keys {
            let keys = keys as usize;
            let ordered: Vec<BenchOrderedEvent> = (0..N)
                .map(|i| BenchOrderedEvent {
                    key: i64::try_from(i % keys).unwrap_or_default(),
                    payload: format!("{i:0>100}"),
                })
                .collect();
            let unordered: Vec<BenchKeyedEvent> = ordered.iter().map(Into::into).collect();
            let (mut with, mut without) = (Vec::new(), Vec::new());
            for run in 0..args.runs {
                for ordered_now in [run % 2 == 0, run % 2 == 1] {
                    if ordered_now {
                        self.fill_with(&ordered).await?;
                        let drained =
                            self.relay_through_filled::<B, BenchOrderedEvent>(broker, N, WORKERS);
                        with.push(drained.await?.0);
                    } else {
                        self.fill_with(&unordered).await?;
                        let drained =
                            self.relay_through_filled::<B, BenchKeyedEvent>(broker, N, WORKERS);
                        without.push(drained.await?.0);
                    }
                }
            }
            let ratio = Figure::of(with.iter().zip(&without).map(|(o, u)| o / u).collect());
            self.line(&format!(
                "| {label} | {keys} | {N} | {} | {} | {} |",
                Figure::of(with).show(""),
                Figure::of(without).show(""),
                ratio.ratio(),
            ));
        }
        Ok(())
    }

    #[cfg(not(any(feature = "nats", feature = "rabbitmq", feature = "kafka")))]
    #[allow(clippy::unused_async)]
    async fn through_brokers(&self, _args: &Args) -> Result {
        self.line(
            "\nPart 4 (end to end through the brokers) needs a broker feature: \
             `cargo run --release --features nats,rabbitmq,kafka --example bench -- --only ordering`.",
        );
        Ok(())
    }

    /// Events/s of pgmq consumers draining `events` (sent to the queue with their key as
    /// the message group) with the grouped `read`, and whether they drained them all
    /// (they stop after [`PGMQ_LIMIT`]).
    async fn drain_pgmq_fifo(
        &self,
        queue: &PeerQueue,
        events: &[BenchOrderedEvent],
        read: GroupedRead,
    ) -> Result<(f64, bool)> {
        let table = BenchOrderedEvent::SPEC.table();
        self.reset_tables(&format!("{table}, {}", queue.tables))
            .await?;
        for chunk in events.chunks(10_000) {
            let (payloads, groups): (Vec<&str>, Vec<String>) = chunk
                .iter()
                .map(|e| (e.payload.as_str(), e.key.to_string()))
                .unzip();
            sqlx::query(
                "SELECT count(*) FROM pgmq.send_batch($1,
                     (SELECT array_agg(jsonb_build_object('payload', p) ORDER BY i)
                      FROM unnest($2::text[]) WITH ORDINALITY AS u(p, i)),
                     (SELECT array_agg(jsonb_build_object('x-pgmq-group', g) ORDER BY i)
                      FROM unnest($3::text[]) WITH ORDINALITY AS u(g, i)))",
            )
            .bind(&queue.name)
            .bind(payloads)
            .bind(groups)
            .execute(&self.pool)
            .await?;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "VACUUM ANALYZE {}",
            queue.tables
        )))
        .execute(&self.pool)
        .await?;

        let n = events.len();
        let pool = self.pool(WORKERS + 1).await?;
        let deleted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..WORKERS {
            let (pool, name, deleted) = (pool.clone(), queue.name.clone(), deleted.clone());
            tasks.spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                while deleted.load(Relaxed) < n && started.elapsed() < PGMQ_LIMIT {
                    let ids: Vec<i64> = sqlx::query_scalar(read.sql())
                        .bind(&name)
                        .bind(PEER_VT)
                        .bind(i32::try_from(BATCH).unwrap_or(i32::MAX))
                        .fetch_all(&pool)
                        .await?;
                    if ids.is_empty() {
                        // Every group's head is in another consumer's hands.
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                        continue;
                    }
                    let gone: Vec<i64> = sqlx::query_scalar("SELECT pgmq.delete($1, $2::bigint[])")
                        .bind(&name)
                        .bind(&ids)
                        .fetch_all(&pool)
                        .await?;
                    deleted.fetch_add(gone.len(), Relaxed);
                }
                Ok::<_, sqlx::Error>(())
            });
        }
        for done in tasks.join_all().await {
            done?;
        }
        let elapsed = started.elapsed();
        pool.close().await;
        let deleted = deleted.load(std::sync::atomic::Ordering::Relaxed);
        Ok((deleted as f64 / elapsed.as_secs_f64(), deleted == n))
    }

    /// Part 2: claim latency on a small table, then beside a large history.
    async fn claim_beside_history(&self) -> Result {
        let table = BenchOrderedEvent::SPEC.table();
        self.line(&format!(
            "\nPart 2: {CLAIMS} claims of {BATCH} from a backlog of 10,000 events of distinct \
             keys, each in a transaction rolled back (the table is the same for each), timed \
             from the client. *Small*: the backlog alone. *Large*: beside 1,000,000 `SENT` \
             rows and 100,000 keys held back by a `DEAD` event, each with a later event (set \
             aside by a first, committed claim, as the relay's claims do).\n"
        ));
        let backlog: Vec<BenchOrderedEvent> = (0..10_000)
            .map(|i| BenchOrderedEvent {
                key: 1_000_000 + i,
                payload: format!("{i:0>100}"),
            })
            .collect();
        self.fill_with(&backlog).await?;
        let small = self.time_claims().await?;
        let history = format!(
            "INSERT INTO {table} (event_id, key, payload, status)
                 SELECT 'sent-' || g, g % 200000, lpad(g::text, 100, '0'), 'SENT'
                 FROM generate_series(1, 1000000) g;
             INSERT INTO {table} (event_id, key, payload, status, last_error)
                 SELECT 'dead-' || g, 2000000 + g, lpad(g::text, 100, '0'), 'DEAD', 'bench'
                 FROM generate_series(1, 100000) g;
             -- Due an hour ago: in front of the backlog in the claim's index.
             INSERT INTO {table} (event_id, key, payload, next_attempt_at)
                 SELECT 'held-' || g, 2000000 + g, lpad(g::text, 100, '0'),
                     statement_timestamp() - interval '1 hour'
                 FROM generate_series(1, 100000) g;"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(history))
            .execute(&self.pool)
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(&self.pool)
            .await?;
        // The first claim sets the held events aside, and commits; so do the relay's.
        let started = Instant::now();
        let first = BenchOrderedEvent::claim_batch(&self.pool, BATCH).await?;
        let setting_aside = started.elapsed();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(&self.pool)
            .await?;
        let large = self.time_claims().await?;
        let stats = outbox::stats::<BenchOrderedEvent>(&self.pool).await?;
        self.line("| table | rows | claim p50 | claim p99 |");
        self.line("|---|---|---|---|");
        self.line(&format!(
            "| small | 10,000 READY | {:.2} ms | {:.2} ms |",
            small.0, small.1
        ));
        self.line(&format!(
            "| large | {} SENT, {} READY, {} DEAD holding {} keys | {:.2} ms | {:.2} ms |",
            stats.sent, stats.ready, stats.dead, stats.held_keys, large.0, large.1
        ));
        self.line(&format!(
            "\nLarge / small: p50 **{:.2}**, p99 **{:.2}**. The first claim beside the history \
             (it claimed {} events and set 100,000 aside) took {:.0} ms, once.\n",
            large.0 / small.0,
            large.1 / small.1,
            first.len(),
            setting_aside.as_secs_f64() * 1e3
        ));
        self.line(&format!(
            "The claim's plan beside the history (`EXPLAIN (ANALYZE, BUFFERS)`, rolled back):\n\n```text\n{}```",
            self.explain_ordered_claim().await?
        ));
        Ok(())
    }

    /// p50 and p99 in milliseconds of [`CLAIMS`] claims, each rolled back.
    async fn time_claims(&self) -> Result<(f64, f64)> {
        let mut times = Vec::with_capacity(CLAIMS);
        for _ in 0..CLAIMS {
            let mut tx = self.pool.begin().await?;
            let started = Instant::now();
            let claims = BenchOrderedEvent::claim_batch(&mut *tx, BATCH).await?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
            tx.rollback().await?;
            if claims.len() != BATCH as usize {
                return Err(format!("a claim took {} events, not {BATCH}", claims.len()).into());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok((times[CLAIMS / 2], times[CLAIMS * 99 / 100]))
    }

    async fn explain_ordered_claim(&self) -> Result<String> {
        let mut tx = self.pool.begin().await?;
        sqlx::raw_sql("SET LOCAL jit = off")
            .execute(&mut *tx)
            .await?;
        let explain = format!(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {}",
            BenchOrderedEvent::SPEC.sql().claim_limited(BATCH, true)
        );
        // The relay's claim, with no run in flight to continue, runs as long as a batch.
        let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
            .bind(Vec::<i64>::new())
            .bind(Vec::<i64>::new())
            .bind(i64::from(BATCH))
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(lines.iter().fold(String::new(), |mut out, l| {
            let _ = writeln!(out, "{l}");
            out
        }))
    }
}

/// How long part 3 lets pgmq's consumers drain: with many groups each grouped read
/// takes seconds.
const PGMQ_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// pgmq's grouped reads.
#[derive(Clone, Copy)]
enum GroupedRead {
    /// `read_grouped`: the oldest group's messages first, as many as the batch holds.
    Groups,
    /// `read_grouped_rr`: round robin over the groups.
    RoundRobin,
}

impl GroupedRead {
    fn sql(self) -> &'static str {
        match self {
            Self::Groups => "SELECT msg_id FROM pgmq.read_grouped($1, $2, $3)",
            Self::RoundRobin => "SELECT msg_id FROM pgmq.read_grouped_rr($1, $2, $3)",
        }
    }
}
