//! The outbox against the raw-SQL floor, and against pgmq, measured in one run.
//!
//! ```text
//! cargo run --release --example bench                       # defaults: about two minutes on 2 cores
//! cargo run --release --example bench -- --events 100000 --runs 5 --out BENCHMARKS.md
//! cargo run --release --example bench -- --endurance        # adds the 5-minute steady-load run
//! cargo run --release --example bench -- --only drain --batches 100   # one section, one batch size
//! cargo run --release --example bench -- --only peers --payloads 2000 # the relay vs pgmq, 2 KB events
//! cargo run --release --features nats,rabbitmq,kafka --example bench -- --only sinks # the broker sinks
//! cargo run --release --example bench -- --only cost   # WAL and server CPU per event
//! cargo run --release --example bench -- --only peers \
//!     --storage 'fillfactor = 100'   # every table packed, as before the derive's fillfactor
//! ```
//!
//! Runs against `DATABASE_URL` (or a throwaway cluster, which runs with `fsync=off`:
//! point `DATABASE_URL` at a server with your durability settings to size a relay), in a
//! schema of its own (the peers section installs pgmq's SQL in its schema `pgmq`, and drops
//! that schema at the end, unless the database had pgmq already). Every
//! figure is the median of `--runs` runs with its spread, and every comparison is a
//! ratio measured in the same run: absolute figures on shared machines drift.

// Event counts stay far below 2^52: converting them to f64 for rates is exact.
#![allow(clippy::cast_precision_loss)]

mod cost;
mod cpu;
mod fleet;
mod ordering;
mod pinned;
mod sinks;
mod trace;
mod wakeups;
mod waldump;

use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use outbox_testkit::app::{BenchDeletedEvent, BenchEvent};
// The memory probe is a child process: the test harness's protocol for one.
use clap::Parser as _;
use clap::builder::RangedU64ValueParser;
use cpu::Cpu;
use outbox::{CancellationToken, Delivery, Sink, SinkError};
use outbox::{Outbox, Relay};
use outbox_testkit::child::{self, ChildCommand};
use pgmq::PGMQueueExt;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

type Result<T = (), E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

/// The floor's claim: what a careful hand-written loop does without the toolkit, the
/// usual `FOR UPDATE SKIP LOCKED` claim reduced to READY rows (no reclaim of expired
/// leases), on the same partial index as the relay's. (A single OR predicate over READY
/// and expired rows would be a weaker floor: it sorts every eligible row, so it slows
/// down as the backlog grows.)
const FLOOR_CLAIM: &str = "UPDATE bench_events SET status = 'INPROGRESS', generation = generation + 1, \
     lease_until = statement_timestamp() + interval '30 seconds' \
     WHERE id IN (SELECT id FROM bench_events \
                  WHERE status = 'READY' AND next_attempt_at <= statement_timestamp() \
                  ORDER BY next_attempt_at, id LIMIT $1 FOR UPDATE SKIP LOCKED) \
     RETURNING id, event_id, generation, payload";
/// The floor's completion: no guard at all.
const FLOOR_COMPLETE: &str =
    "UPDATE bench_events SET status = 'SENT', lease_until = NULL WHERE id = ANY($1)";
const RAW_INSERT: &str = "INSERT INTO bench_events (event_id, payload) VALUES ($1, $2)";
const RAW_INSERT_MANY: &str =
    "INSERT INTO bench_events (event_id, payload) SELECT * FROM unnest($1::text[], $2::text[])";

/// The outbox against the raw-SQL floor, measured in one run: every figure is the median
/// of `--runs` runs with its spread, every comparison a ratio measured in the same run.
/// Runs against DATABASE_URL (or a throwaway cluster, which runs with fsync=off), in a
/// schema of its own.
#[derive(clap::Parser, Debug)]
#[command(name = "bench")]
struct Args {
    /// Events in a backlog: the memory section's, and the drain section's largest (it
    /// drains 1,000 per row of the batch size, at least 200).
    #[arg(long, value_name = "N", default_value_t = 50_000, value_parser = at_least_one())]
    events: usize,
    /// Runs per figure.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = at_least_one())]
    runs: usize,
    /// Batch sizes the drain section measures.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_value = "1,10,100", value_parser = clap::value_parser!(u32).range(1..))]
    batches: Vec<u32>,
    /// Worker counts the drain section measures, for each batch size.
    #[arg(long, value_name = "N,..", value_delimiter = ',', default_value = "1,4,8", value_parser = at_least_one())]
    concurrency: Vec<usize>,
    /// Payload sizes the peers section measures, in bytes.
    #[arg(long, value_name = "BYTES,..", value_delimiter = ',', default_value = "100,2000", value_parser = at_least_one())]
    payloads: Vec<usize>,
    /// Also run the 5-minute steady-load endurance section.
    #[arg(long)]
    endurance: bool,
    /// Run only these sections [default: all but endurance, which needs --endurance].
    #[arg(long, value_name = "SECTION,..", value_delimiter = ',')]
    only: Option<Vec<Section>>,
    /// Storage parameters set on every outbox table the bench empties before a run,
    /// before it is filled, as `ALTER TABLE .. SET (<STORAGE>)` takes them: to compare
    /// with the derive's own (`fillfactor = 50`, ..).
    #[arg(long, value_name = "STORAGE")]
    storage: Option<String>,
    /// How long the pinned section holds a snapshot: seconds, or 10m, 1m30s, 2h.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = pinned::duration)]
    pin: Duration,
    /// Events/s the wakeups section offers, one rate after the other, one event per
    /// transaction.
    #[arg(long, value_name = "EVENTS/S,..", value_delimiter = ',', default_value = "500,5000", value_parser = clap::value_parser!(u32).range(1..))]
    wakeup_rates: Vec<u32>,
    /// Databases of the fleet section.
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = clap::value_parser!(u32).range(2..=400))]
    fleet_databases: u32,
    /// Key counts of the ordering section's drains of 100,000 events (`1`: one hot key).
    #[arg(long, value_name = "KEYS,..", value_delimiter = ',', default_value = "100000,1000,10,1", value_parser = clap::value_parser!(u32).range(1..))]
    ordering_keys: Vec<u32>,
    /// Leave out the ordering section's part 2 (the claim beside a large history).
    #[arg(long)]
    no_history: bool,
    /// Events/s the pinned section offers, one per transaction.
    #[arg(long, value_name = "EVENTS/S", default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..))]
    rate: u32,
    /// Events per run of the sinks section (the relay's backlog, the raw producer's
    /// messages).
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = at_least_one())]
    sink_events: usize,
    /// Events/s the sinks section offers for its latency, one per transaction.
    #[arg(long, value_name = "EVENTS/S", default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    sink_rate: u32,
    /// The share of requests the trace section's sampler records (`ParentBased` on a
    /// trace-id ratio; 1: every one).
    #[arg(long, value_name = "RATIO", default_value_t = 1.0, value_parser = trace::ratio)]
    trace_sampled: f64,
    /// Events per run of the cost section.
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = at_least_one())]
    cost_events: usize,
    /// Also write the report (Markdown) to this file.
    #[arg(long, value_name = "FILE")]
    out: Option<String>,
}

/// The sections of the report, in order.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Section {
    Drain,
    PerEvent,
    Enqueue,
    Scale,
    Endurance,
    /// Only with --only: a snapshot held for --pin under --rate (about --pin + 3 minutes).
    Pinned,
    /// Only with --only: claim statements per batch at each of --wakeup-rates (~25 s each).
    Wakeups,
    /// Only with --only: per-key ordering vs the same table unordered (a few minutes).
    Ordering,
    /// Only with --only: the relay through each broker sink vs the broker client's own
    /// loop, and enqueue → consumer latency (needs the features nats, rabbitmq, kafka).
    Sinks,
    /// Only with --only: #[outbox(traced)] vs untraced, OpenTelemetry on (needs the
    /// feature otel; installs the process's global subscriber).
    Trace,
    Memory,
    Peers,
    /// Only with --only: WAL bytes and server CPU per event, relay vs pgmq vs the INSERT
    /// alone (a few minutes).
    Cost,
    /// Only with --only: a relay fleet for --fleet-databases databases vs a relay per
    /// database, on a throwaway cluster (about 8 minutes at 200).
    Fleet,
}

impl Args {
    /// Whether this run includes `section`: the ones `--only` names, or else every one
    /// but the long ones (endurance only with `--endurance`; pinned and wakeups only
    /// when `--only` names them).
    fn selects(&self, section: Section) -> bool {
        match (&self.only, section) {
            (Some(only), _) => only.contains(&section),
            (None, Section::Endurance) => self.endurance,
            (
                None,
                Section::Pinned
                | Section::Wakeups
                | Section::Ordering
                | Section::Sinks
                | Section::Trace
                | Section::Cost
                | Section::Fleet,
            ) => false,
            (None, _) => true,
        }
    }

    /// Small batches drain slowly (a commit each): scale the backlog with the batch.
    fn backlog(&self, batch: u32) -> usize {
        self.events.min(batch as usize * 1_000).max(200)
    }
}

fn at_least_one() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// Median and spread of repeated measurements.
#[derive(Clone, Copy)]
struct Figure {
    median: f64,
    min: f64,
    max: f64,
}

impl Figure {
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        Self {
            median: samples[samples.len() / 2],
            min: samples[0],
            max: samples[samples.len() - 1],
        }
    }

    fn spread(self) -> f64 {
        (self.max - self.min) / self.median * 50.0
    }

    /// A ratio's cell: the median in bold, the lowest and highest in parentheses.
    fn ratio(self) -> String {
        format!("**{:.2}** ({:.2}–{:.2})", self.median, self.min, self.max)
    }

    fn show(self, unit: &str) -> String {
        format!("{:.0}{unit} ±{:.0}%", self.median, self.spread())
    }
}

fn payload(i: usize) -> BenchEvent {
    BenchEvent {
        payload: format!("{i:0>100}"),
    }
}

struct Bench {
    pool: PgPool,
    url: String,
    report: RefCell<String>,
    /// Whether CHECKPOINT was refused (warned once).
    unchecked: Cell<bool>,
    /// `--storage`, set on each table before it is filled.
    storage: Option<String>,
    /// Settings of every connection [`Self::pool`] opens (`wal_compression`, ..).
    session: RefCell<Vec<(&'static str, &'static str)>>,
}

impl Bench {
    /// Empties the table and checkpoints, so that no checkpoint starts inside the timed
    /// run that follows (whichever side it fell on would write a full-page image of
    /// every page it touched first), unless `max_wal_size` forces one.
    async fn reset(&self) -> Result {
        self.reset_tables("bench_events").await?;
        self.set_storage("bench_events").await
    }

    /// Sets `--storage` on `table`, emptied and not yet filled.
    async fn set_storage(&self, table: &str) -> Result {
        if let Some(options) = &self.storage {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE {table} SET ({options})"
            )))
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }

    /// Empties `tables` (a list `TRUNCATE` takes) and checkpoints, as [`Self::reset`].
    async fn reset_tables(&self, tables: &str) -> Result {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "TRUNCATE {tables} RESTART IDENTITY"
        )))
        .execute(&self.pool)
        .await?;
        if let Err(error) = sqlx::query("CHECKPOINT").execute(&self.pool).await {
            // Needs superuser or pg_checkpoint: without it, figures are only noisier.
            if !self.unchecked.replace(true) {
                eprintln!("no CHECKPOINT between runs ({error}): expect more spread");
            }
        }
        Ok(())
    }

    async fn fill(&self, n: usize) -> Result {
        self.fill_with(&(0..n).map(payload).collect::<Vec<_>>())
            .await
    }

    async fn fill_with<T: Outbox>(&self, events: &[T]) -> Result {
        let table = T::SPEC.table();
        self.reset_tables(table).await?;
        self.set_storage(table).await?;
        for chunk in events.chunks(10_000) {
            outbox::table::enqueue_all(chunk, &self.pool).await?;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM ANALYZE {table}")))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A pool with every connection open, so that no run times connecting, and
    /// [`session`](Self::session)'s settings in each.
    async fn pool(&self, connections: usize) -> Result<PgPool> {
        let size = u32::try_from(connections)?;
        let mut options: PgConnectOptions = self.url.parse()?;
        for (name, value) in self.session.borrow().iter() {
            options = options.options([(name, value)]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .min_connections(size)
            .connect_with(options)
            .await?;
        let mut open = Vec::with_capacity(connections);
        for _ in 0..connections {
            open.push(pool.acquire().await?);
        }
        Ok(pool)
    }

    async fn pending<T: Outbox>(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE status IN ('READY', 'INPROGRESS')",
            T::SPEC.table()
        )))
        .fetch_one(&self.pool)
        .await?)
    }

    /// Events/s of the relay draining `events` with a no-op sink, until every outcome
    /// is recorded: the sink stops the relay at the last event, and `run` returns once
    /// the outcomes in flight are recorded.
    async fn drain_relay<T: Outbox>(
        &self,
        events: &[T],
        batch: u32,
        workers: usize,
    ) -> Result<f64> {
        Ok(self.drain_relay_cpu(events, batch, workers).await?.0)
    }

    /// [`drain_relay`](Self::drain_relay), and the CPU time the drain took, in
    /// milliseconds per 1,000 events: the server's process tree's and this process's,
    /// `None` where the server's cannot be read (another machine's server).
    async fn drain_relay_cpu<T: Outbox>(
        &self,
        events: &[T],
        batch: u32,
        workers: usize,
    ) -> Result<(f64, Option<cpu::Work>)> {
        self.fill_with(events).await?;
        self.drain_filled::<T>(events.len(), batch, workers).await
    }

    /// [`drain_relay_cpu`](Self::drain_relay_cpu) of the `n` events its table holds.
    async fn drain_filled<T: Outbox>(
        &self,
        n: usize,
        batch: u32,
        workers: usize,
    ) -> Result<(f64, Option<cpu::Work>)> {
        let postmaster = self.postmaster().await;
        let pool = self.pool(workers + 1).await?;
        let stop = CancellationToken::new();
        let relay = Relay::<T, _>::new(pool.clone(), CountingSink::until(n, &stop))
            .batch_size(batch)
            .concurrency(workers);
        let cpu = Cpu::now(postmaster);
        cpu::marks::begins(T::SPEC.traced());
        let started = Instant::now();
        relay.run(stop).await?;
        let elapsed = started.elapsed();
        cpu::marks::ends();
        let cpu = Cpu::now(postmaster).work_seconds(&cpu);
        pool.close().await;
        match self.pending::<T>().await? {
            0 => Ok((
                n as f64 / elapsed.as_secs_f64(),
                cpu.map(|work| work.per_event(n)),
            )),
            left => Err(format!("the relay stopped with {left} events not recorded").into()),
        }
    }

    /// Events/s of the floor: the READY-only claim and an unguarded `= ANY` completion.
    async fn drain_floor(&self, n: usize, batch: u32, workers: usize) -> Result<f64> {
        self.fill(n).await?;
        let pool = self.pool(workers).await?;
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..workers {
            let pool = pool.clone();
            tasks.spawn(async move {
                loop {
                    let rows: Vec<(i64, String, i64, String)> = sqlx::query_as(FLOOR_CLAIM)
                        .bind(i64::from(batch))
                        .fetch_all(&pool)
                        .await?;
                    if rows.is_empty() {
                        return Ok::<_, sqlx::Error>(());
                    }
                    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                    sqlx::query(FLOOR_COMPLETE).bind(ids).execute(&pool).await?;
                }
            });
        }
        for done in tasks.join_all().await {
            done?;
        }
        let elapsed = started.elapsed();
        pool.close().await;
        Ok(n as f64 / elapsed.as_secs_f64())
    }

    async fn drain(&self, args: &Args) -> Result {
        self.heading("1. Drain a backlog: relay (no-op sink) vs the raw-SQL floor");
        self.line(
            "| batch | concurrency | events | relay events/s | floor events/s | relay / floor |",
        );
        self.line("|---|---|---|---|---|---|");
        for &batch in &args.batches {
            for &workers in &args.concurrency {
                let n = args.backlog(batch);
                let events: Vec<BenchEvent> = (0..n).map(payload).collect();
                let (mut relay, mut floor, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
                for run in 0..args.runs {
                    // Alternating which goes first cancels the drift of a shared machine.
                    let (r, f) = if run % 2 == 0 {
                        let r = self.drain_relay(&events, batch, workers).await?;
                        (r, self.drain_floor(n, batch, workers).await?)
                    } else {
                        let f = self.drain_floor(n, batch, workers).await?;
                        (self.drain_relay(&events, batch, workers).await?, f)
                    };
                    relay.push(r);
                    floor.push(f);
                    ratios.push(r / f);
                }
                let ratio = Figure::of(ratios);
                self.line(&format!(
                    "| {batch} | {workers} | {n} | {} | {} | {} |",
                    Figure::of(relay).show(""),
                    Figure::of(floor).show(""),
                    ratio.ratio(),
                ));
            }
        }
        Ok(())
    }

    /// The relay against pgmq, the Postgres queue a user would pick instead, draining the
    /// same backlog of the same payloads with the same workers and connections: the relay
    /// keeping SENT rows against pgmq archiving, and the relay deleting them
    /// (`delete_sent`) against pgmq deleting. The four alternate which goes first, run by
    /// run.
    async fn peers(&self, args: &Args, leftovers: &PgmqLeftovers) -> Result {
        self.heading(&format!(
            "7. Peers: relay vs pgmq draining the same backlog (batch {PEER_BATCH})"
        ));
        let queue = self.peer_queue(leftovers).await?;
        self.line(&format!(
            "pgmq: {}, a queue made by `pgmq.create` with its defaults. Its consumer reads \
             {PEER_BATCH} messages (visibility timeout {PEER_VT} s), then deletes or archives \
             them by id: two statements, each its own transaction. The relay keeps SENT rows, \
             or deletes them in the outcome's statement (`delete_sent`). Both sides get the same \
             payloads of random letters and digits (incompressible, so a long one is stored out \
             of line, in TOAST), as the relay's `payload` text and as pgmq's \
             `{{\"payload\": ..}}` jsonb; the pools hold one connection per worker + 1, all \
             open before the clock starts.\n",
            queue.installed
        ));
        self.line(
            "| payload | concurrency | events | relay events/s | relay `delete_sent` events/s | pgmq archive events/s | pgmq delete events/s | relay / pgmq archive | relay `delete_sent` / pgmq delete |",
        );
        self.line("|---|---|---|---|---|---|---|---|---|");
        let n = args.backlog(PEER_BATCH);
        for &bytes in &args.payloads {
            let events = random_events(n, bytes);
            let deleted: Vec<BenchDeletedEvent> = events.iter().map(Into::into).collect();
            for &workers in &args.concurrency {
                let mut rates = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
                for run in 0..args.runs {
                    // The four in turn, the order reversed every other run.
                    let mut order = [
                        Peer::Relay(Finish::Archive),
                        Peer::Relay(Finish::Delete),
                        Peer::Pgmq(Finish::Archive),
                        Peer::Pgmq(Finish::Delete),
                    ];
                    if run % 2 == 1 {
                        order.reverse();
                    }
                    for peer in order {
                        let rate = match peer {
                            Peer::Relay(Finish::Archive) => {
                                self.empty_queue(&queue).await?;
                                self.drain_relay(&events, PEER_BATCH, workers).await?
                            }
                            Peer::Relay(Finish::Delete) => {
                                self.empty_queue(&queue).await?;
                                self.drain_relay(&deleted, PEER_BATCH, workers).await?
                            }
                            Peer::Pgmq(finish) => {
                                self.drain_pgmq(&queue, &events, workers, finish).await?
                            }
                        };
                        rates[peer.index()].push(rate);
                    }
                }
                let [relay, relay_deleting, archive, delete] = rates;
                let ratio = |relay: &[f64], pgmq: &[f64]| {
                    let ratio = Figure::of(relay.iter().zip(pgmq).map(|(r, p)| r / p).collect());
                    ratio.ratio()
                };
                let (to_archive, to_delete) =
                    (ratio(&relay, &archive), ratio(&relay_deleting, &delete));
                self.line(&format!(
                    "| {bytes} B | {workers} | {n} | {} | {} | {} | {} | {to_archive} | {to_delete} |",
                    Figure::of(relay).show(""),
                    Figure::of(relay_deleting).show(""),
                    Figure::of(archive).show(""),
                    Figure::of(delete).show(""),
                ));
            }
        }
        self.empty_queue(&queue).await
    }

    /// Installs pgmq's SQL, unless the database has pgmq already, and creates the bench's
    /// queue, noting both in `leftovers` before it makes them.
    async fn peer_queue(&self, leftovers: &PgmqLeftovers) -> Result<PeerQueue> {
        let pgmq = PGMQueueExt::new_with_pool(self.pool.clone()).await;
        let existing: bool = sqlx::query_scalar("SELECT to_regnamespace('pgmq') IS NOT NULL")
            .fetch_one(&self.pool)
            .await?;
        let installed = if existing {
            "the installation already in the database".to_owned()
        } else {
            leftovers.schema.set(true);
            pgmq.install_sql_from_embedded().await?;
            let version = pgmq.installed_version().await?;
            format!(
                "its SQL {}installed without the extension, by the `pgmq` crate (in a schema \
                 `pgmq` the bench drops at its end)",
                version.map(|v| format!("v{v} ")).unwrap_or_default()
            )
        };
        let name = format!("outbox_bench_{}", std::process::id());
        leftovers.queue.replace(Some(name.clone()));
        pgmq.create(&name).await?;
        Ok(PeerQueue {
            tables: format!("pgmq.q_{name}, pgmq.a_{name}"),
            name,
            installed,
        })
    }

    /// Empties the queue and its archive (no checkpoint: the relay's fill checkpoints).
    async fn empty_queue(&self, queue: &PeerQueue) -> Result {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "TRUNCATE {} RESTART IDENTITY",
            queue.tables
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Events/s of pgmq consumers draining `events` from the queue: each worker reads a
    /// batch and deletes or archives it, until a read finds nothing visible.
    async fn drain_pgmq(
        &self,
        queue: &PeerQueue,
        events: &[BenchEvent],
        workers: usize,
        finish: Finish,
    ) -> Result<f64> {
        // The outbox's table is emptied too: whatever autovacuum would do to it, it does
        // not do during this run.
        self.reset_tables(&format!("bench_events, {}", queue.tables))
            .await?;
        let filler = PGMQueueExt::new_with_pool(self.pool.clone()).await;
        for chunk in events.chunks(10_000) {
            let messages: Vec<PeerMessage> = chunk
                .iter()
                .map(|e| PeerMessage {
                    payload: e.payload.clone(),
                })
                .collect();
            filler.send_batch(&queue.name, &messages).await?;
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "VACUUM ANALYZE {}",
            queue.tables
        )))
        .execute(&self.pool)
        .await?;

        Ok(self
            .consume_pgmq(queue, events.len(), workers, finish)
            .await?
            .0)
    }

    /// Events/s of pgmq consumers draining the `n` messages the queue holds, and the
    /// CPU time it took per event (as [`Self::drain_filled`]).
    async fn consume_pgmq(
        &self,
        queue: &PeerQueue,
        n: usize,
        workers: usize,
        finish: Finish,
    ) -> Result<(f64, Option<cpu::Work>)> {
        let postmaster = self.postmaster().await;
        let pool = self.pool(workers + 1).await?;
        let pgmq = PGMQueueExt::new_with_pool(pool.clone()).await;
        let quantity = i32::try_from(PEER_BATCH)?;
        let cpu = Cpu::now(postmaster);
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..workers {
            let (pgmq, name) = (pgmq.clone(), queue.name.clone());
            tasks.spawn(async move {
                let mut finished = 0;
                loop {
                    let batch: Vec<pgmq::Message<PeerMessage>> =
                        pgmq.read_batch(&name, PEER_VT, quantity).await?;
                    if batch.is_empty() {
                        return Ok::<_, pgmq::PgmqError>(finished);
                    }
                    let ids: Vec<i64> = batch.iter().map(|m| m.msg_id).collect();
                    finished += match finish {
                        Finish::Delete => pgmq.delete_batch(&name, &ids).await?,
                        Finish::Archive => pgmq.archive_batch(&name, &ids).await?,
                    }
                    .len();
                }
            });
        }
        let mut finished = 0;
        for done in tasks.join_all().await {
            finished += done?;
        }
        let elapsed = started.elapsed();
        let cpu = Cpu::now(postmaster).work_seconds(&cpu);
        pool.close().await;
        if finished == n {
            Ok((
                n as f64 / elapsed.as_secs_f64(),
                cpu.map(|work| work.per_event(n)),
            ))
        } else {
            Err(format!("the pgmq consumers finished {finished} of {n} messages").into())
        }
    }

    /// Events/s of `claim` + `complete` one at a time, typed vs the same SQL raw.
    async fn per_event(&self, args: &Args) -> Result {
        self.heading("2. Per-event path: claim + complete, one at a time");
        let n = 1_000;
        let (mut typed, mut raw) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            self.fill(n).await?;
            let started = Instant::now();
            while let Some(claim) = BenchEvent::claim(&self.pool).await? {
                claim.complete(&self.pool).await?;
            }
            typed.push(n as f64 / started.elapsed().as_secs_f64());

            self.fill(n).await?;
            let sql = BenchEvent::SPEC.sql();
            let claim = sql.claim_limited(1, true);
            let started = Instant::now();
            loop {
                let row: Option<sqlx::postgres::PgRow> =
                    sqlx::query(sqlx::AssertSqlSafe(claim.as_str()))
                        .fetch_optional(&self.pool)
                        .await?;
                let Some(row) = row else { break };
                let (id, generation): (i64, i64) =
                    (sqlx::Row::get(&row, 0), sqlx::Row::get(&row, 2));
                sqlx::query(sql.get(outbox::__private::Statement::Complete))
                    .bind(id)
                    .bind(generation)
                    .execute(&self.pool)
                    .await?;
            }
            raw.push(n as f64 / started.elapsed().as_secs_f64());
        }
        self.ratio_table("typed API", "same SQL, raw sqlx", typed, raw);
        Ok(())
    }

    async fn enqueue(&self, args: &Args) -> Result {
        self.heading("3. Enqueue: one event per business transaction, and in bulk");
        let n = 1_000;
        let (mut typed, mut raw) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            self.reset().await?;
            let started = Instant::now();
            for i in 0..n {
                let mut tx = self.pool.begin().await?;
                payload(i).enqueue(&mut *tx).await?;
                tx.commit().await?;
            }
            typed.push(n as f64 / started.elapsed().as_secs_f64());
            self.reset().await?;
            let started = Instant::now();
            for i in 0..n {
                let mut tx = self.pool.begin().await?;
                let event = payload(i);
                sqlx::query(RAW_INSERT)
                    .bind(uuid::Uuid::now_v7().to_string())
                    .bind(&event.payload)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
            raw.push(n as f64 / started.elapsed().as_secs_f64());
        }
        self.ratio_table("enqueue (with NOTIFY)", "raw INSERT", typed, raw);

        let n = 10_000;
        let (mut typed, mut raw) = (Vec::new(), Vec::new());
        let events: Vec<BenchEvent> = (0..n).map(payload).collect();
        for _ in 0..args.runs {
            self.reset().await?;
            let started = Instant::now();
            BenchEvent::enqueue_all(&events, &self.pool).await?;
            typed.push(n as f64 / started.elapsed().as_secs_f64());
            self.reset().await?;
            let started = Instant::now();
            let ids: Vec<String> = (0..n).map(|_| uuid::Uuid::now_v7().to_string()).collect();
            let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
            sqlx::query(RAW_INSERT_MANY)
                .bind(ids)
                .bind(payloads)
                .execute(&self.pool)
                .await?;
            raw.push(n as f64 / started.elapsed().as_secs_f64());
        }
        self.ratio_table("enqueue_all of 10,000", "raw multi-row INSERT", typed, raw);
        Ok(())
    }

    /// Claim latency beside few vs many SENT, DEAD and expired rows: one table of each
    /// kind (the big one in a schema of its own), measured in alternating rounds so the
    /// drift of a shared machine falls on both.
    async fn scale(&self) -> Result {
        self.heading("4. Claim cost as the table grows (claims of 100, rolled back)");
        let big = outbox::testing::TestSchema::new().await?;
        // A pool like the small table's: plan caches and connection reuse alike.
        let pool = big.connect(2).await?;
        let outcome = self.scale_against(&pool).await;
        pool.close().await;
        big.drop_schema().await?;
        outcome
    }

    async fn scale_against(&self, big: &PgPool) -> Result {
        outbox::migrate(big, &[BenchEvent::migrations()]).await?;
        let small_label = "1,000 READY + 10,000 SENT";
        let big_label = "1,000 READY + 1,000,000 SENT + 100,000 DEAD + 100,000 expired";
        self.reset().await?;
        fill_scale(&self.pool, 10_000, 0, 0).await?;
        fill_scale(big, 1_000_000, 100_000, 100_000).await?;

        let (mut small_ms, mut big_ms) = (Vec::new(), Vec::new());
        for _ in 0..25 {
            small_ms.extend(claim_latencies(&self.pool, 40).await?);
            big_ms.extend(claim_latencies(big, 40).await?);
        }
        let [small, big_figure] = [small_ms, big_ms].map(|mut ms| {
            ms.sort_by(f64::total_cmp);
            (ms[ms.len() / 2], ms[ms.len() * 99 / 100])
        });
        self.line("| table | claim p50 | claim p99 |");
        self.line("|---|---|---|");
        for (label, (p50, p99)) in [(small_label, small), (big_label, big_figure)] {
            self.line(&format!("| {label} | {p50:.2} ms | {p99:.2} ms |"));
        }
        self.line(&format!(
            "\nRatio big / small: p50 **{:.2}**, p99 **{:.2}**.",
            big_figure.0 / small.0,
            big_figure.1 / small.1
        ));
        let plan = explain_claim(big).await?;
        let verdict = if plan.contains("Seq Scan") {
            "a sequential scan: investigate"
        } else {
            "no sequential scan"
        };
        self.line(&format!(
            "\nThe claim's plan on the big table ({verdict}):\n\n```text\n{plan}```"
        ));
        Ok(())
    }

    /// Peak RSS of a relay process (batch 100, concurrency 8) draining a backlog.
    async fn memory(&self, args: &Args) -> Result {
        self.heading("6. Memory: peak RSS of a relay process (batch 100, concurrency 8)");
        self.fill(args.events).await?;
        let mut probe = ChildCommand::binary().spawn(
            MEMORY_PROBE,
            &[("URL", &self.url), ("EVENTS", &args.events.to_string())],
        )?;
        let line = child::handshake(probe.stderr()?, PEAK_RSS, Duration::from_hours(1)).await;
        probe.wait()?;
        let peak = match line {
            Ok(line) => line[PEAK_RSS.len()..].trim().to_owned(),
            Err(error) => {
                eprintln!("the memory probe: {error}");
                "unknown".into()
            }
        };
        self.line(&format!(
            "Peak RSS after draining {} events: **{peak}** (target < 64 MiB).",
            args.events
        ));
        Ok(())
    }

    /// Steady enqueue + relay for 5 minutes: throughput per minute and dead tuples.
    async fn endurance(&self) -> Result {
        self.heading(
            "5. Endurance: 5 minutes of steady enqueue (2,000 events/s offered) and a relay, beside 1,000,000 retained SENT rows",
        );
        self.reset().await?;
        // What a table keeps under a retention of a few hours: autovacuum's default
        // thresholds scale with it.
        sqlx::query(
            "INSERT INTO bench_events (event_id, status, payload) \
             SELECT 'retained-' || i, 'SENT', lpad(i::text, 100, '0') FROM generate_series(1, 1000000) i",
        )
        .execute(&self.pool)
        .await?;
        sqlx::query("VACUUM ANALYZE bench_events")
            .execute(&self.pool)
            .await?;
        let pool = self.pool(10).await?;
        let sink = LatencySink::default();
        let latencies = Arc::clone(&sink.latencies);
        let stop = CancellationToken::new();
        let relay = tokio::spawn(
            Relay::<BenchEvent, _>::new(pool.clone(), sink)
                .batch_size(100)
                .concurrency(4)
                .run(stop.clone()),
        );
        let producer = {
            let pool = pool.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(50));
                while !stop.is_cancelled() {
                    tick.tick().await;
                    let events: Vec<BenchEvent> = (0..100).map(|_| stamped()).collect();
                    BenchEvent::enqueue_all(&events, &pool).await?;
                }
                Ok::<_, outbox::OutboxError>(())
            })
        };
        self.line(
            "| minute | events/s | enqueue → publish p50 | p99 | dead tuples | autovacuums |",
        );
        self.line("|---|---|---|---|---|---|");
        let mut minutes = Vec::new();
        for minute in 1..=5 {
            tokio::time::sleep(Duration::from_mins(1)).await;
            let mut taken =
                std::mem::take(&mut *latencies.lock().unwrap_or_else(PoisonError::into_inner));
            taken.sort_unstable();
            let percentile = |p: usize| {
                taken
                    .get(taken.len().saturating_sub(1) * p / 100)
                    .copied()
                    .unwrap_or(0)
            };
            let (p50, p99) = (percentile(50), percentile(99));
            let (dead, autovacuums): (i64, i64) = sqlx::query_as(
                "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables \
                 WHERE relname = 'bench_events' AND schemaname = current_schema()",
            )
            .fetch_one(&self.pool)
            .await?;
            let rate = taken.len() as f64 / 60.0;
            self.line(&format!(
                "| {minute} | {rate:.0} | {:.1} ms | {:.1} ms | {dead} | {autovacuums} |",
                f64::from(p50) / 1e3,
                f64::from(p99) / 1e3
            ));
            minutes.push((rate, p99));
        }
        stop.cancel();
        producer.await??;
        relay.await??;
        let ((first, first_p99), (last, last_p99)) = (minutes[0], minutes[4]);
        self.line(&format!(
            "\nLast minute / first: throughput **{:.2}**, p99 latency **{:.2}**.",
            last / first,
            f64::from(last_p99) / f64::from(first_p99.max(1))
        ));
        Ok(())
    }

    fn ratio_table(&self, ours: &str, baseline: &str, typed: Vec<f64>, raw: Vec<f64>) {
        let ratios: Vec<f64> = typed.iter().zip(&raw).map(|(t, r)| t / r).collect();
        let ratio = Figure::of(ratios);
        self.line(&format!("| {ours} | {baseline} | ratio |\n|---|---|---|"));
        self.line(&format!(
            "| {} ev/s | {} ev/s | {} |\n",
            Figure::of(typed).show(""),
            Figure::of(raw).show(""),
            ratio.ratio(),
        ));
    }

    fn heading(&self, title: &str) {
        self.line(&format!("\n### {title}\n"));
    }

    /// Prints a line of the report and keeps it for `--out`.
    fn line(&self, text: &str) {
        println!("{text}");
        let mut report = self.report.borrow_mut();
        report.push_str(text);
        report.push('\n');
    }
}

/// The peers section's batch: the relay's claim and pgmq's read alike.
const PEER_BATCH: u32 = 100;
/// pgmq's visibility timeout, in seconds: the relay's lease (`BenchEvent`'s 30 s).
const PEER_VT: i32 = 30;

/// One side of the peers section.
#[derive(Clone, Copy)]
enum Peer {
    /// The relay; `Archive`: SENT rows kept, `Delete`: `delete_sent`.
    Relay(Finish),
    Pgmq(Finish),
}

impl Peer {
    /// Its column in the table: relay, relay `delete_sent`, pgmq archive, pgmq delete.
    fn index(self) -> usize {
        match self {
            Peer::Relay(Finish::Archive) => 0,
            Peer::Relay(Finish::Delete) => 1,
            Peer::Pgmq(Finish::Archive) => 2,
            Peer::Pgmq(Finish::Delete) => 3,
        }
    }
}

/// How a consumer finishes what it published: deleting it (pgmq's delete, the relay's
/// `delete_sent`), or keeping it (pgmq's archive, a move to the queue's archive table;
/// the relay's SENT rows).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Finish {
    Delete,
    Archive,
}

/// A pgmq message: the event's payload as jsonb, `{"payload": "<text>"}`.
#[derive(serde::Serialize, serde::Deserialize)]
struct PeerMessage {
    payload: String,
}

/// The peers section's pgmq queue.
struct PeerQueue {
    name: String,
    /// The queue's table and its archive, as `TRUNCATE` and `VACUUM` list them.
    tables: String,
    /// Which pgmq, for the report.
    installed: String,
}

/// What the peers section made in the database, dropped by `main` when the run ends,
/// also on Ctrl-C. pgmq's SQL names its schema, `pgmq`: it cannot go in a scratch one.
#[derive(Default)]
struct PgmqLeftovers {
    /// Whether the bench installed pgmq, so drops its schema and everything in it.
    schema: Cell<bool>,
    /// The bench's queue, dropped alone from an installation that was there before.
    queue: RefCell<Option<String>>,
}

impl PgmqLeftovers {
    async fn drop_all(&self, pool: &PgPool) -> Result {
        if self.schema.get() {
            sqlx::query("DROP SCHEMA IF EXISTS pgmq CASCADE")
                .execute(pool)
                .await?;
        } else if let Some(queue) = self.queue.take() {
            PGMQueueExt::new_with_pool(pool.clone())
                .await
                .drop_queue(&queue)
                .await?;
        }
        Ok(())
    }
}

/// `n` events whose payloads are `bytes` random letters and digits: incompressible, so a
/// long one is stored out of line (TOAST) as an incompressible payload of its size would
/// be, where a padded counter would compress to almost nothing.
fn random_events(n: usize, bytes: usize) -> Vec<BenchEvent> {
    let mut rng = fastrand::Rng::with_seed(0x0b0c);
    (0..n)
        .map(|_| BenchEvent {
            payload: (0..bytes).map(|_| rng.alphanumeric()).collect(),
        })
        .collect()
}

/// A sink that publishes nowhere, counts batches, and keeps how long each event waited
/// since its enqueue. Clones share what they keep.
#[derive(Default, Clone)]
struct LatencySink {
    /// Microseconds from enqueue to publish, per event.
    latencies: Arc<Mutex<Vec<u32>>>,
    /// Publish calls.
    batches: Arc<AtomicU64>,
}

impl Sink<BenchEvent> for LatencySink {
    async fn publish(&self, batch: &[Delivery<'_, BenchEvent>]) -> Vec<Result<(), SinkError>> {
        let now = micros_now();
        self.batches.fetch_add(1, Ordering::Relaxed);
        let mut latencies = self
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        batch
            .iter()
            .map(|delivery| {
                let enqueued: u64 = delivery
                    .event()
                    .payload
                    .parse()
                    .map_err(SinkError::permanent)?;
                latencies.push(u32::try_from(now.saturating_sub(enqueued)).unwrap_or(u32::MAX));
                Ok(())
            })
            .collect()
    }
}

/// `SENT`, `DEAD` and expired `INPROGRESS` rows in the numbers given, then 1,000 READY.
async fn fill_scale(pool: &PgPool, sent: i64, dead: i64, expired: i64) -> Result {
    sqlx::query(
        "INSERT INTO bench_events (event_id, payload, status, generation, attempts, lease_until) \
         SELECT 'x' || i, repeat('x', 100), \
                CASE WHEN i <= $1 THEN 'SENT' WHEN i <= $1 + $2 THEN 'DEAD' ELSE 'INPROGRESS' END, \
                1, 1, CASE WHEN i > $1 + $2 THEN now() - interval '1 hour' END \
         FROM generate_series(1, $1 + $2 + $3) AS i",
    )
    .bind(sent)
    .bind(dead)
    .bind(expired)
    .execute(pool)
    .await?;
    let events: Vec<BenchEvent> = (0..1_000).map(payload).collect();
    BenchEvent::enqueue_all(&events, pool).await?;
    sqlx::query("VACUUM ANALYZE bench_events")
        .execute(pool)
        .await?;
    Ok(())
}

/// Milliseconds of `n` claims of 100, each rolled back so the table stays as it is.
async fn claim_latencies(pool: &PgPool, n: usize) -> Result<Vec<f64>> {
    let mut latencies = Vec::with_capacity(n);
    for _ in 0..n {
        let mut tx = pool.begin().await?;
        let started = Instant::now();
        let claims = BenchEvent::claim_batch(&mut *tx, 100).await?;
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
        assert_eq!(claims.len(), 100);
        tx.rollback().await?;
    }
    Ok(latencies)
}

async fn explain_claim(pool: &PgPool) -> Result<String> {
    let mut tx = pool.begin().await?;
    let prepare = format!(
        "PREPARE bench_claim AS {}",
        BenchEvent::SPEC.sql().claim_limited(100, true)
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(prepare))
        .execute(&mut *tx)
        .await?;
    let lines: Vec<String> = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE bench_claim",
    )
    .fetch_all(&mut *tx)
    .await?;
    // Prepared statements belong to the session, not the transaction.
    sqlx::query("DEALLOCATE bench_claim")
        .execute(&mut *tx)
        .await?;
    tx.rollback().await?;
    Ok(lines.iter().fold(String::new(), |mut out, l| {
        let _ = writeln!(out, "{l}");
        out
    }))
}

fn micros_now() -> u64 {
    let since_epoch = std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .unwrap_or_default();
    u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX)
}

/// An event whose payload is its enqueue time, padded to the benchmark's payload size.
fn stamped() -> BenchEvent {
    BenchEvent {
        payload: format!("{:0>100}", micros_now()),
    }
}

/// A no-op sink that shuts its relay down once it has published `target` events.
struct CountingSink {
    published: AtomicUsize,
    target: usize,
    done: CancellationToken,
}

impl CountingSink {
    fn until(target: usize, stop: &CancellationToken) -> Self {
        Self {
            published: AtomicUsize::new(0),
            target,
            done: stop.clone(),
        }
    }
}

impl<T: Send + Sync + 'static> Sink<T> for CountingSink {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        if self.published.fetch_add(batch.len(), Ordering::Relaxed) + batch.len() >= self.target {
            self.done.cancel();
        }
        batch.iter().map(|_| Ok(())).collect()
    }
}

/// The child role that measures a relay's memory (see `outbox_testkit::child`).
const MEMORY_PROBE: &str = "memory probe";
/// The probe's handshake: the `VmHWM:` line of `/proc/self/status`.
const PEAK_RSS: &str = "VmHWM:";

/// The memory probe: runs a relay until the backlog is drained, then prints its peak RSS.
async fn rss_child(url: String, events: usize) -> Result {
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await?;
    let stop = CancellationToken::new();
    Relay::<BenchEvent, _>::new(pool, CountingSink::until(events, &stop))
        .batch_size(100)
        .concurrency(8)
        .run(stop)
        .await?;
    let status = std::fs::read_to_string("/proc/self/status")?;
    for line in status.lines().filter(|l| l.starts_with(PEAK_RSS)) {
        child::say(line);
    }
    Ok(())
}

async fn environment(pool: &PgPool) -> Result<String> {
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await?;
    let mut settings = Vec::new();
    for name in [
        "synchronous_commit",
        "fsync",
        "shared_buffers",
        "max_connections",
        "autovacuum",
    ] {
        let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(pool)
            .await?;
        settings.push(format!("{name}={value}"));
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    // What a commit costs weighs the relay's one commit per batch against the floor's two.
    let mut commits = Vec::new();
    for i in 0..50 {
        let started = Instant::now();
        sqlx::query(RAW_INSERT)
            .bind(format!("commit-{i}"))
            .bind("")
            .execute(pool)
            .await?;
        commits.push(started.elapsed().as_secs_f64() * 1e3);
    }
    sqlx::query("TRUNCATE bench_events").execute(pool).await?;
    Ok(format!(
        "Machine: {cores} cores ({cpu}). PostgreSQL {version}: {}. \
         A one-row INSERT with its commit: {:.2} ms (median of 50).",
        settings.join(", "),
        Figure::of(commits).median
    ))
}

#[tokio::main]
async fn main() -> Result {
    if child::requested(MEMORY_PROBE) {
        let (Some(url), Some(events)) = (child::param("URL"), child::param("EVENTS")) else {
            return Err("the memory probe needs a URL and EVENTS".into());
        };
        return rss_child(url, events.parse()?).await;
    }
    let args = Args::parse();
    let schema = outbox::testing::TestSchema::new().await?;
    outbox::migrate(
        schema.pool(),
        &[
            BenchEvent::migrations(),
            BenchDeletedEvent::migrations(),
            outbox_testkit::app::BenchTracedEvent::migrations(),
            outbox_testkit::app::BenchOrderedEvent::migrations(),
            outbox_testkit::app::BenchKeyedEvent::migrations(),
            outbox_testkit::app::BenchUnindexedEvent::migrations(),
            outbox_testkit::app::BenchUnindexedDeletedEvent::migrations(),
        ],
    )
    .await?;
    let leftovers = PgmqLeftovers::default();
    // Ctrl-C still drops the schema and pgmq's objects: a benchmark leaves nothing behind.
    let outcome = tokio::select! {
        outcome = run(&args, &schema, &leftovers) => outcome,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };
    let dropped = leftovers.drop_all(schema.pool()).await;
    schema.drop_schema().await?;
    outcome.and(dropped)
}

async fn run(
    args: &Args,
    schema: &outbox::testing::TestSchema,
    leftovers: &PgmqLeftovers,
) -> Result {
    let bench = Bench {
        pool: schema.connect(2).await?,
        url: schema.url(),
        report: RefCell::default(),
        unchecked: Cell::default(),
        storage: args.storage.clone(),
        session: RefCell::default(),
    };
    let command = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    bench.line(&format!(
        "## Benchmark\n\n`cargo run --release --example bench -- {command}`\n"
    ));
    bench.line(&environment(&bench.pool).await?);
    if let Some(options) = &args.storage {
        bench.line(&format!("Every table's storage: `{options}`.\n"));
    }
    if args.selects(Section::Drain) {
        bench.drain(args).await?;
    }
    if args.selects(Section::PerEvent) {
        bench.per_event(args).await?;
    }
    if args.selects(Section::Enqueue) {
        bench.enqueue(args).await?;
    }
    if args.selects(Section::Scale) {
        bench.scale().await?;
    }
    if args.selects(Section::Endurance) {
        bench.endurance().await?;
    }
    if args.selects(Section::Pinned) {
        bench.pinned(args).await?;
    }
    if args.selects(Section::Wakeups) {
        bench.wakeups(args).await?;
    }
    if args.selects(Section::Ordering) {
        bench.ordering(args, leftovers).await?;
    }
    if args.selects(Section::Sinks) {
        bench.sinks(args).await?;
    }
    if args.selects(Section::Trace) {
        bench.trace(args).await?;
    }
    if args.selects(Section::Memory) {
        bench.memory(args).await?;
    }
    if args.selects(Section::Peers) {
        bench.peers(args, leftovers).await?;
    }
    if args.selects(Section::Cost) {
        bench.cost(args, leftovers).await?;
    }
    if args.selects(Section::Fleet) {
        bench.fleet(args).await?;
    }
    if let Some(path) = &args.out {
        std::fs::write(path, bench.report.take())?;
        println!("\nwrote {path}");
    }
    bench.pool.close().await;
    Ok(())
}
