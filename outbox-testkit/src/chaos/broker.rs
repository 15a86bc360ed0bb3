//! The chaos run through a real broker, end to end: a business transaction commits an
//! order and its event; relay processes publish the events through the broker's sink
//! (`JetStreamSink`, `RabbitSink`, `KafkaSink`); consumer processes apply each event's effect with its
//! `outbox::Inbox` row in one PostgreSQL transaction, and only then acknowledge the
//! message. Meanwhile the driver SIGKILLs and restarts relays and consumers, SIGSTOPs them
//! past their lease or acknowledgement deadline, terminates their database sessions, and
//! takes the broker away: NATS is a server of the run's own (file storage), killed and
//! restarted; RabbitMQ is a shared system service, so the run cuts every connection to it
//! (a proxy in between goes down and up) instead; Kafka is a tansu of the run's own, but
//! in memory (a restart would lose the topic), so its connections are cut the same way.
//!
//! The audit, per event: the effect applied exactly once; at least one copy at the broker
//! (more only where the broker cannot deduplicate: RabbitMQ and Kafka never do across
//! publishers, JetStream only within its duplicate window); delivered to a consumer at least once. Every duplicate is
//! counted and its cause named in the report.
//!
//! The relay and consumer processes are the chaos run's children (`super::Relays`); a
//! relay child publishes through its broker's sink, recording what the broker took.
//!
//! A broker is one module (`nats.rs`, `rabbitmq.rs`, `kafka.rs`), behind its feature,
//! implementing [`ChaosBroker`]: the driver's side (start, the children's parameters, an
//! outage, the copies it holds) and the children's (the relay's sink, a consumer loop).
//! Another broker plugs in the same way: a module with one more implementation.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outbox::testing::TestSchema;
use outbox::{CancellationToken, Delivery, Sink, SinkError};
use outbox::{Inbox, inbox};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::time::{Instant, sleep};

use super::{
    Config, Orders, Relays, Report, Server, Wake, cancelled_by_sigterm, child_pool, say, setup,
    terminate_sessions, unsent, verify_deliveries, verify_outbox,
};
use crate::child::{self, ChildCommand};
use crate::events::ChaosEvent;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

#[cfg(feature = "kafka")]
pub use kafka::Kafka;
#[cfg(feature = "nats")]
pub use nats::Nats;
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::RabbitMq;

/// The child role of a consumer process.
const CONSUMER: &str = "chaos consumer";
/// The consumer's inbox: one logical consumer, whatever the process.
const INBOX: &str = "chaos-shipping";

/// What a broker run does.
#[derive(Clone, Debug)]
pub struct BrokerConfig {
    /// The events, the relays and the driver's seed, as in the relay-only run (its
    /// PostgreSQL restart is not done here: this run is about the broker).
    pub run: Config,
    /// Consumer processes.
    pub consumers: usize,
    /// How long a consumer may hold a message unacknowledged before the broker
    /// redelivers it (JetStream's `ack_wait`; RabbitMQ redelivers when the connection
    /// closes). A consumer pause outlasts it.
    pub ack_wait: Duration,
    /// JetStream's duplicate window: a copy published within it of the first is
    /// stored once. Short in the test, so that some redeliveries fall outside it.
    pub duplicate_window: Duration,
    /// Broker outages (restarts, cuts), at least.
    pub outages: u32,
    /// The chaos lasts at least this long (and until the events are enqueued).
    pub duration: Duration,
}

impl BrokerConfig {
    /// `events` through `broker`: 4 relays, 2 consumers, 3 outages, JetStream's window
    /// at 3 s and its acknowledgement deadline at 2 s.
    pub fn new(events: usize) -> Self {
        let mut run = Config::new(events);
        run.restart_postgres = false;
        Self {
            run,
            consumers: 2,
            ack_wait: Duration::from_secs(2),
            duplicate_window: Duration::from_secs(3),
            outages: 3,
            duration: Duration::ZERO,
        }
    }
}

/// What a broker run did and found.
#[derive(Debug, Default)]
pub struct BrokerReport {
    pub broker: String,
    /// The relays' side, as in the relay-only run: kills, pauses, the publications they
    /// recorded (`deliveries`), stale outcomes, the outbox's end state.
    pub relay: Report,
    pub consumers: usize,
    pub consumer_kills: u32,
    pub consumer_kills_mid_batch: u32,
    pub consumer_pauses: u32,
    /// Broker outages, as they were done.
    pub outages: Vec<String>,
    /// Publications the broker acknowledged as duplicates (JetStream, within its window).
    pub acked_duplicates: i64,
    /// Copies at the broker, and the events with more than one.
    pub copies: i64,
    pub events_with_copies: i64,
    pub events_copied_again: i64,
    /// How the extra copies came about (the broker's own words).
    pub copies_explained: String,
    /// Deliveries a consumer committed, those its inbox recognised as duplicates, and
    /// the broker's redeliveries among them.
    pub deliveries: i64,
    pub inbox_duplicates: i64,
    pub redeliveries: i64,
    pub max_delivery: i64,
    /// The inbox's duplicates by cause, one line each.
    pub duplicate_causes: Vec<String>,
    /// Effect rows, and the events with exactly one.
    pub effects: i64,
    pub events_applied_once: i64,
    pub failures: Vec<String>,
}

impl fmt::Display for BrokerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.relay;
        writeln!(
            f,
            "broker chaos summary (seed {}, {}, PostgreSQL: {})",
            r.seed, self.broker, r.server
        )?;
        writeln!(
            f,
            "  events                 {} ({} relays, {} consumers)",
            r.events, r.relays, self.consumers
        )?;
        writeln!(
            f,
            "  relay kills            {} ({} mid-batch); pauses past the lease {} ({} mid-batch)",
            r.kills, r.kills_mid_batch, r.pauses, r.pauses_mid_batch
        )?;
        writeln!(
            f,
            "  consumer kills         {} ({} mid-batch); pauses past the ack deadline {}",
            self.consumer_kills, self.consumer_kills_mid_batch, self.consumer_pauses
        )?;
        writeln!(
            f,
            "  backend terminations   {} ({} sessions)",
            r.terminations, r.sessions_terminated
        )?;
        writeln!(f, "  broker outages         {}", self.outages.len())?;
        for outage in &self.outages {
            writeln!(f, "    {outage}")?;
        }
        writeln!(
            f,
            "  publications recorded  {} by {} relay incarnations ({} by superseded generations; \
             {} acknowledged as duplicates)",
            r.deliveries, r.publishers, r.superseded_deliveries, self.acked_duplicates
        )?;
        writeln!(
            f,
            "  stale rejections       {} outcomes, {} renewals ({} publish timeouts)",
            r.stale_outcomes, r.renewals_rejected, r.publish_timeouts
        )?;
        writeln!(
            f,
            "  copies at the broker   {} for {} events; {} events more than once",
            self.copies, self.events_with_copies, self.events_copied_again
        )?;
        writeln!(f, "    why: {}", self.copies_explained)?;
        writeln!(
            f,
            "  consumer deliveries    {} committed ({} redelivered by the broker), {} of them \
             skipped by the inbox as duplicates:",
            self.deliveries, self.redeliveries, self.inbox_duplicates
        )?;
        for cause in &self.duplicate_causes {
            writeln!(f, "    {cause}")?;
        }
        writeln!(
            f,
            "  effects                {} rows; {} of {} events applied exactly once",
            self.effects, self.events_applied_once, r.events
        )?;
        r.write_tail(f, &self.failures)
    }
}

// -------------------------------------------------------------------------------------
// The brokers, as the driver and the children see them
// -------------------------------------------------------------------------------------

/// A broker a run goes through, as the driver sees it (start it, tell the children where
/// it is, take it away for a moment, read back what it holds) and as the children do
/// (the relay's sink, the consumer's loop). A test picks one by type:
/// `broker::run::<Nats>(..)`, and its children with `child_main_if_requested::<Nats>()`.
#[allow(
    async_fn_in_trait,
    reason = "the driver and the children await these on their own task: nothing needs Send"
)]
pub trait ChaosBroker: Sized + 'static {
    /// The broker's sink, in a relay child.
    type Publisher: Sink<ChaosEvent> + 'static;

    /// Starts (or reaches) the broker and declares what the run publishes to and
    /// consumes from, named after `schema`.
    async fn start(config: &BrokerConfig, schema: &TestSchema) -> Result<Self, String>;

    /// The broker, in a line of the report.
    fn describe(&self) -> String;

    /// The children's parameters: where the broker is, what to publish to and consume
    /// from.
    fn params(&self) -> Vec<(String, String)>;

    /// Takes the broker away for a moment; says what kind of outage it was, and how it
    /// went.
    async fn outage(&mut self, rng: &mut fastrand::Rng) -> Result<(&'static str, String), String>;

    /// Writes the copies the broker holds (or, when it cannot be read back, the copies
    /// it confirmed) into `chaos_copies`; explains the extra ones in `report`.
    async fn audit_copies(&self, pool: &PgPool, report: &mut BrokerReport) -> Result<(), String>;

    async fn teardown(self);

    /// In a relay child: the broker's sink, from the children's parameters.
    async fn publisher() -> Result<Self::Publisher, String>;

    /// Publishes `batch` through `publisher`: what the broker took of each event.
    fn publish(
        publisher: &Self::Publisher,
        batch: &[Delivery<'_, ChaosEvent>],
    ) -> impl Future<Output = Vec<Result<Receipt, SinkError>>> + Send;

    /// In a consumer child: consumes until `shutdown`, handling each message with
    /// [`Consumer::handle`] before acknowledging it.
    async fn consume(consumer: &Consumer, shutdown: &CancellationToken) -> Result<(), String>;
}

/// A publication the broker took: where it stored it (JetStream's stream sequence; 0
/// when the broker has no such thing) and whether it called it a duplicate.
pub struct Receipt {
    pub position: i64,
    pub duplicate: bool,
}

/// In a relay or consumer child of a run through `B`: run it until SIGTERM, then exit
/// the process. Returns without doing anything in any other process.
pub fn child_main_if_requested<B: ChaosBroker>() {
    consumer_main_if_requested::<B>();
    super::relay_main_if_requested(async |pool, pid| {
        Ok(BrokerSink::<B> {
            pool,
            pid,
            publisher: B::publisher().await?,
            rng: super::child_rng(),
        })
    });
}

/// The relay's sink in a broker run: the broker's own, then a record of each
/// publication the broker acknowledged in `chaos_deliveries` (as the relay-only run's
/// sink records its deliveries), before the relay may record the event `SENT`.
struct BrokerSink<B: ChaosBroker> {
    pool: PgPool,
    pid: i32,
    publisher: B::Publisher,
    rng: std::sync::Mutex<fastrand::Rng>,
}

impl<B: ChaosBroker> Sink<ChaosEvent> for BrokerSink<B> {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        say(&format!("batch {}", batch.len()));
        let receipts = B::publish(&self.publisher, batch).await;
        let mut columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (delivery, receipt) in batch.iter().zip(&receipts) {
            if let Ok(receipt) = receipt {
                columns.0.push(delivery.event_id().as_str());
                columns.1.push(delivery.generation().get());
                columns
                    .2
                    .push(i32::try_from(delivery.attempt()).unwrap_or(i32::MAX));
                columns.3.push(receipt.position);
                columns.4.push(receipt.duplicate);
            }
        }
        let recorded = if columns.0.is_empty() {
            Ok(())
        } else {
            sqlx::query(
                "INSERT INTO chaos_deliveries \
                     (event_id, generation, attempt, publisher_pid, broker_position, duplicate) \
                 SELECT e, g, a, $6, p, d \
                 FROM unnest($1::text[], $2::bigint[], $3::int[], $4::bigint[], $5::bool[]) \
                     AS u(e, g, a, p, d)",
            )
            .bind(&columns.0)
            .bind(&columns.1)
            .bind(&columns.2)
            .bind(&columns.3)
            .bind(&columns.4)
            .bind(self.pid)
            .execute(&self.pool)
            .await
            .map(drop)
        };
        // The window between the broker's acknowledgement and the relay's outcome,
        // widened a little so that the driver's kills and pauses land in it: the
        // redeliveries the broker and the inbox must absorb.
        sleep(Duration::from_millis(super::draw(&self.rng, |rng| {
            rng.u64(5..=40)
        })))
        .await;
        receipts
            .into_iter()
            .map(|receipt| match (receipt, &recorded) {
                (Ok(_), Ok(())) => Ok(()),
                // At the broker, not recorded: published again later (a copy the broker
                // deduplicates or the inbox absorbs).
                (Ok(_), Err(error)) => Err(SinkError::transient(format!("recording: {error}"))),
                (Err(error), _) => Err(error),
            })
            .collect()
    }

    async fn withdraw(&self) -> bool {
        self.publisher.withdraw().await
    }
}

// -------------------------------------------------------------------------------------
// The consumer child
// -------------------------------------------------------------------------------------

/// In a consumer child: consume until SIGTERM, then exit the process. Returns without
/// doing anything in any other process.
fn consumer_main_if_requested<B: ChaosBroker>() {
    if !child::requested(CONSUMER) {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = runtime.block_on(consumer_child::<B>());
    drop(runtime);
    std::process::exit(code);
}

async fn consumer_child<B: ChaosBroker>() -> i32 {
    let (Some(url), Some(app)) = (child::param("URL"), child::param("APP")) else {
        say("consumer failed: a chaos consumer needs a URL and an APP");
        return 2;
    };
    let pool = match child_pool(&url, &app) {
        Ok(pool) => pool,
        Err(error) => {
            say(&format!("consumer failed: {error}"));
            return 2;
        }
    };
    let shutdown = cancelled_by_sigterm();
    say("started");
    match B::consume(&Consumer::new(pool), &shutdown).await {
        Ok(()) => {
            say("stopped");
            0
        }
        Err(error) => {
            say(&format!("consumer failed: {error}"));
            1
        }
    }
}

/// What a consumer child applies messages with.
pub struct Consumer {
    pool: PgPool,
    inbox: Inbox,
    pid: i32,
}

impl Consumer {
    /// The consumer of this process, on `pool`.
    fn new(pool: PgPool) -> Self {
        Self {
            pool,
            inbox: Inbox::new(INBOX),
            pid: i32::try_from(std::process::id()).unwrap_or(-1),
        }
    }

    /// One message: the effect (a `shipments` row) and the inbox row in one transaction
    /// (`crate::broker::apply`), then a note of the delivery. The caller acknowledges
    /// the message after this returns, and not if it fails: the broker redelivers it.
    /// `position`: where the broker stored it; `delivery`: the broker's count of its
    /// deliveries (1 for the first).
    pub async fn handle(
        &self,
        event_id: &str,
        body: &[u8],
        position: i64,
        delivery: i64,
    ) -> Result<(), String> {
        let received = crate::broker::apply(&self.pool, &self.inbox, event_id, body)
            .await
            .map_err(|e| format!("applying {event_id}: {e}"))?;
        // After the commit: a consumer killed in between leaves a delivery uncounted,
        // not an effect missing.
        sqlx::query(
            "INSERT INTO chaos_consumed (event_id, broker_position, delivery, consumer_pid, new) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(event_id)
        .bind(position)
        .bind(delivery)
        .bind(self.pid)
        .bind(received.is_new())
        .execute(&self.pool)
        .await
        .map_err(|e| format!("noting the delivery of {event_id}: {e}"))?;
        Ok(())
    }
}

// -------------------------------------------------------------------------------------
// The audit's explanations, checked on their own
// -------------------------------------------------------------------------------------

/// The audit of deliveries noted by hand (`(event id, position, delivery count,
/// new)`, in the order they were noted) after broker outages that began at the given
/// offsets (in seconds, from before the first delivery; negative: before it).
pub async fn audit_of(
    noted: &[(&str, i64, i64, bool)],
    outages_began: &[f64],
) -> Result<BrokerReport, String> {
    let noted = noted.to_vec();
    audited(outages_began, async move |pool: &PgPool| {
        for (offset, (event_id, position, delivery, new)) in noted.into_iter().enumerate() {
            sqlx::query(
                "INSERT INTO chaos_consumed \
                     (event_id, broker_position, delivery, consumer_pid, new, consumed_at) \
                 VALUES ($1, $2, $3, 0, $4, \
                     (SELECT min(started_at) FROM chaos_audit_epoch) + $5 * interval '1 second')",
            )
            .bind(event_id)
            .bind(position)
            .bind(delivery)
            .bind(new)
            .bind(i32::try_from(offset).map_err(|e| e.to_string())? + 1)
            .execute(pool)
            .await
            .map_err(|e| format!("noting a delivery: {e}"))?;
        }
        Ok(())
    })
    .await
}

/// Sets up a run's tables in a schema of their own, notes outages that began at
/// `outages_began` (seconds from an epoch, `chaos_audit_epoch`), lets `deliver` note
/// deliveries, and explains the duplicates among them.
pub(super) async fn audited(
    outages_began: &[f64],
    deliver: impl AsyncFnOnce(&PgPool) -> Result<(), String>,
) -> Result<BrokerReport, String> {
    let (server, _) = Server::start().await?;
    let schema = TestSchema::new_in(server.url())
        .await
        .map_err(|e| e.to_string())?;
    setup(&schema).await?;
    let pool = schema.pool().clone();
    setup_broker_tables(&pool).await?;
    let db = |e: sqlx::Error| format!("noting the outages: {e}");
    sqlx::query("CREATE TABLE chaos_audit_epoch AS SELECT clock_timestamp() AS started_at")
        .execute(&pool)
        .await
        .map_err(db)?;
    for began in outages_began {
        sqlx::query(
            "INSERT INTO chaos_outages (kind, started_at, ended_at) \
             SELECT 'SIGKILL restart', e.started_at + $1 * interval '1 second', \
                 e.started_at + ($1 + 2) * interval '1 second' FROM chaos_audit_epoch e",
        )
        .bind(began)
        .execute(&pool)
        .await
        .map_err(db)?;
    }
    let mut report = BrokerReport::default();
    let explained = match deliver(&pool).await {
        Ok(()) => explain_duplicates(&pool, &mut report).await,
        Err(error) => Err(error),
    };
    schema.drop_schema().await.map_err(|e| e.to_string())?;
    drop(server);
    explained.map(|()| report)
}

// -------------------------------------------------------------------------------------
// The driver
// -------------------------------------------------------------------------------------

/// The tables beyond the relay-only run's: what the broker acknowledged of each
/// publication, the copies it holds, what the consumers received, their effects and
/// inbox.
async fn setup_broker_tables(pool: &PgPool) -> Result<(), String> {
    for ddl in [
        "ALTER TABLE chaos_deliveries ADD COLUMN broker_position bigint, \
             ADD COLUMN duplicate boolean",
        "CREATE TABLE chaos_copies (\
             event_id text NOT NULL, \
             broker_position bigint NOT NULL, \
             stored_at timestamptz NOT NULL)",
        "CREATE TABLE chaos_consumed (\
             event_id text NOT NULL, \
             broker_position bigint NOT NULL, \
             delivery bigint NOT NULL, \
             consumer_pid integer NOT NULL, \
             new boolean NOT NULL, \
             consumed_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        // When each outage began (before the broker was taken away) and ended.
        "CREATE TABLE chaos_outages (kind text NOT NULL, started_at timestamptz NOT NULL, \
             ended_at timestamptz NOT NULL)",
        // The effect (`crate::broker::apply`): deliberately no unique key, so that an
        // effect applied twice shows as two rows.
        "CREATE TABLE shipments (event_id text NOT NULL, parcels bigint NOT NULL)",
    ] {
        sqlx::query(ddl)
            .execute(pool)
            .await
            .map_err(|e| format!("{ddl}: {e}"))?;
    }
    inbox::migrate(pool)
        .await
        .map_err(|e| format!("the inbox: {e}"))?;
    Ok(())
}

/// Runs the chaos through the broker and audits the end state. `Err` only when the run
/// could not be set up; failed checks are listed in [`BrokerReport::failures`].
pub async fn run<B: ChaosBroker>(
    config: &BrokerConfig,
    command: &ChildCommand,
) -> Result<BrokerReport, String> {
    let wall = Instant::now();
    let run = &config.run;
    let (server, _) = Server::start().await?;
    let schema = TestSchema::new_in(server.url())
        .await
        .map_err(|e| e.to_string())?;
    setup(&schema).await?;
    let pool = schema.pool().clone();
    setup_broker_tables(&pool).await?;
    let mut broker = B::start(config, &schema).await?;
    let mut report = BrokerReport {
        broker: broker.describe(),
        consumers: config.consumers,
        relay: Report {
            seed: run.seed,
            events: run.events,
            relays: run.relays,
            server: server.describe(),
            ..Report::default()
        },
        ..BrokerReport::default()
    };
    println!("broker chaos: {}", report.broker);

    let total = i64::try_from(run.events).map_err(|e| e.to_string())?;
    let mut orders = Orders::prefill(&pool, run).await?;
    let (mut relays, mut consumers) = start_fleets(config, &broker, &schema, command)?;
    let chaos_started = Instant::now();
    orders.enqueue_the_rest(&pool, run);
    let mut fleets = Fleets {
        relays: &mut relays,
        consumers: &mut consumers,
    };
    chaos(
        config,
        &mut broker,
        &pool,
        &mut fleets,
        &orders.progress,
        &mut report,
    )
    .await?;
    report.relay.enqueue_retries = orders.finish(&mut report.failures).await;
    report.relay.chaos = chaos_started.elapsed();

    drain(config, &pool, &mut fleets, total, &mut report).await?;
    super::stop(fleets.relays, &mut report.relay).await;
    stop_consumers(fleets.consumers, &mut report).await;
    verify_outbox(&pool, total, &mut report.relay).await?;
    verify_deliveries(&pool, total, &mut report.relay).await?;
    broker.audit_copies(&pool, &mut report).await?;
    audit(&pool, total, &mut report).await?;
    report
        .failures
        .splice(0..0, report.relay.failures.drain(..));

    drop(relays);
    drop(consumers);
    broker.teardown().await;
    schema.drop_schema().await.map_err(|e| e.to_string())?;
    drop(server);
    report.relay.wall = wall.elapsed();
    Ok(report)
}

/// Starts the relay processes, publishing through `broker`, and the consumer processes.
fn start_fleets(
    config: &BrokerConfig,
    broker: &impl ChaosBroker,
    schema: &TestSchema,
    command: &ChildCommand,
) -> Result<(Relays, Relays), String> {
    let mut relays = Relays::new(schema, &config.run, command);
    relays.params = broker.params();
    relays.start(config.run.relays)?;
    let mut consumers = Relays::new(schema, &config.run, command);
    consumers.role = CONSUMER;
    consumers.kind = "consumer";
    consumers.letter = 'c';
    consumers.params = broker.params();
    consumers.pause_past = config.ack_wait;
    consumers.start(config.consumers)?;
    Ok((relays, consumers))
}

/// The relay and consumer processes.
struct Fleets<'a> {
    relays: &'a mut Relays,
    consumers: &'a mut Relays,
}

impl Fleets<'_> {
    fn reap_unexpected(&mut self) -> Result<(), String> {
        self.relays.reap_unexpected()?;
        self.consumers.reap_unexpected()
    }
}

/// The chaos phase: until every event is enqueued, the run's duration is over, and
/// every kind of chaos happened (the outages as often as configured).
async fn chaos(
    config: &BrokerConfig,
    broker: &mut impl ChaosBroker,
    pool: &PgPool,
    fleets: &mut Fleets<'_>,
    progress: &AtomicUsize,
    report: &mut BrokerReport,
) -> Result<(), String> {
    let run = &config.run;
    let mut rng = fastrand::Rng::with_seed(run.seed ^ 2);
    let started = Instant::now();
    #[allow(clippy::cast_precision_loss)]
    let hard_stop = started
        + config.duration
        + Duration::from_secs_f64(
            run.events as f64 / run.rate + 30.0 + 8.0 * f64::from(config.outages),
        );
    let mut next_action = Instant::now() + Duration::from_millis(rng.u64(200..600));
    let mut next_outage = Instant::now() + Duration::from_millis(rng.u64(1_000..2_500));
    loop {
        fleets.reap_unexpected()?;
        let enqueued = progress.load(Ordering::Relaxed) >= run.events;
        let outages_due = report.outages.len() < config.outages as usize;
        let r = &report.relay;
        // A fleet of one is never paused (the other must take over its work).
        let enough = r.kills >= 2
            && (r.pauses >= 1 || fleets.relays.slots.len() < 2)
            && report.consumer_kills >= 2
            && (report.consumer_pauses >= 1 || fleets.consumers.slots.len() < 2)
            && r.terminations >= 1
            && !outages_due
            && started.elapsed() >= config.duration;
        let paused = fleets.relays.paused() + fleets.consumers.paused();
        if (enqueued && enough && paused == 0) || Instant::now() > hard_stop {
            break;
        }
        if enqueued && enough {
            sleep(Duration::from_millis(20)).await;
            continue;
        }
        // Outages on their own clock, a few seconds apart: the relays and consumers
        // reconnect in between, and the next one finds them working.
        if Instant::now() >= next_outage && (outages_due || !config.duration.is_zero()) {
            let began = Instant::now();
            // When it began and ended, on the database's clock: the deliveries that
            // follow it are set against it in the audit. From before the broker is taken
            // away: a consumer may reconnect and be delivered a message anew before the
            // driver notices the broker is back.
            let started_at: String = sqlx::query_scalar("SELECT clock_timestamp()::text")
                .fetch_one(pool)
                .await
                .map_err(|e| format!("noting the outage: {e}"))?;
            let (kind, how) = broker.outage(&mut rng).await?;
            sqlx::query(
                "INSERT INTO chaos_outages (kind, started_at, ended_at) \
                 VALUES ($1, $2::timestamptz, clock_timestamp())",
            )
            .bind(kind)
            .bind(started_at)
            .execute(pool)
            .await
            .map_err(|e| format!("noting the outage: {e}"))?;
            let line = format!(
                "at {:.1}s: {how} ({:.2}s)",
                started.elapsed().as_secs_f64(),
                began.elapsed().as_secs_f64()
            );
            println!("broker chaos: {line}");
            report.outages.push(line);
            next_outage = Instant::now() + Duration::from_millis(rng.u64(2_500..5_000));
            continue;
        }
        if Instant::now() < next_action {
            sleep(Duration::from_millis(20)).await;
            continue;
        }
        next_action = Instant::now() + Duration::from_millis(rng.u64(150..500));
        act(&mut rng, fleets, pool, report).await?;
    }
    let r = &report.relay;
    if r.kills == 0 || report.consumer_kills == 0 || report.outages.is_empty() {
        report.failures.push(format!(
            "too little chaos: {} relay kills, {} consumer kills, {} outages",
            r.kills,
            report.consumer_kills,
            report.outages.len()
        ));
    }
    Ok(())
}

/// One of the chaos's actions on the relays, the consumers or their sessions, at random.
async fn act(
    rng: &mut fastrand::Rng,
    fleets: &mut Fleets<'_>,
    pool: &PgPool,
    report: &mut BrokerReport,
) -> Result<(), String> {
    match rng.u32(0..10) {
        // Pause a relay past its lease, mid-batch if it has one; every other pause
        // ends into the reclaim of its rows.
        0..=1 if fleets.relays.paused() < fleets.relays.slots.len() / 2 => {
            let running = fleets.relays.running();
            let slot = running[rng.usize(..running.len())];
            let mid_batch = fleets
                .relays
                .next_batch(slot, Duration::from_millis(rng.u64(0..15)))
                .await;
            let wake = if report.relay.pauses.is_multiple_of(2) {
                Wake::IntoReclaim
            } else {
                Wake::After(Duration::from_millis(rng.u64(300..1500)))
            };
            fleets.relays.pause(slot, wake)?;
            report.relay.pauses += 1;
            report.relay.pauses_mid_batch += u32::from(mid_batch);
        }
        // SIGKILL a relay, half of the time mid-batch (after the broker's
        // acknowledgement, before the outcome, now and then), and restart it.
        2..=3 => {
            let running = fleets.relays.running();
            let slot = running[rng.usize(..running.len())];
            let mid_batch = rng.bool()
                && fleets
                    .relays
                    .next_batch(slot, Duration::from_millis(rng.u64(0..15)))
                    .await;
            fleets.relays.kill_and_restart(slot)?;
            report.relay.kills += 1;
            report.relay.kills_mid_batch += u32::from(mid_batch);
        }
        // SIGKILL a consumer while it handles a batch (between a commit and its
        // acknowledgement, now and then): the broker redelivers, the inbox skips.
        4..=5 => {
            let running = fleets.consumers.running();
            if running.is_empty() {
                return Ok(());
            }
            let slot = running[rng.usize(..running.len())];
            let mid_batch = fleets
                .consumers
                .next_batch(slot, Duration::from_millis(rng.u64(0..10)))
                .await;
            fleets.consumers.kill_and_restart(slot)?;
            report.consumer_kills += 1;
            report.consumer_kills_mid_batch += u32::from(mid_batch);
        }
        // Pause a consumer past its acknowledgement deadline: its messages go to
        // the other one, and it wakes to find them applied (or waits on the
        // other's uncommitted inbox row).
        6 if fleets.consumers.paused() < fleets.consumers.slots.len().div_ceil(2)
            && fleets.consumers.slots.len() > 1 =>
        {
            let running = fleets.consumers.running();
            let slot = running[rng.usize(..running.len())];
            fleets
                .consumers
                .next_batch(slot, Duration::from_millis(rng.u64(0..10)))
                .await;
            let wake = Wake::After(Duration::from_millis(rng.u64(200..1000)));
            fleets.consumers.pause(slot, wake)?;
            report.consumer_pauses += 1;
        }
        // Terminate the database sessions of a relay or a consumer.
        7 => {
            let fleet = if rng.bool() {
                &*fleets.relays
            } else {
                &*fleets.consumers
            };
            let prefix = fleet.app_name(rng.usize(..fleet.slots.len()));
            if let Ok(ended) = terminate_sessions(pool, &prefix).await {
                report.relay.terminations += 1;
                report.relay.sessions_terminated += ended;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Every pause over; waits until every event is `SENT` and applied.
async fn drain(
    config: &BrokerConfig,
    pool: &PgPool,
    fleets: &mut Fleets<'_>,
    total: i64,
    report: &mut BrokerReport,
) -> Result<(), String> {
    report.relay.pauses_into_reclaim = fleets.relays.pauses_over().await;
    fleets.consumers.pauses_over().await;
    let started = Instant::now();
    loop {
        fleets.reap_unexpected()?;
        let left = match (unsent(pool).await, unapplied(pool, total).await) {
            (Ok(0), Ok(0)) => break,
            (Ok(unsent), Ok(unapplied)) => {
                format!("{unsent} unsent, {unapplied} unapplied or not noted")
            }
            (Err(error), _) | (_, Err(error)) => error.to_string(),
        };
        if started.elapsed() > config.run.drain_timeout {
            report.failures.push(format!(
                "{left} {:?} after the chaos: {}",
                config.run.drain_timeout,
                super::unsent_rows(pool).await
            ));
            break;
        }
        sleep(Duration::from_millis(100)).await;
    }
    report.relay.drain = started.elapsed();
    Ok(())
}

/// Events without an effect yet, or whose delivery no consumer noted yet (one killed
/// between its commit and the note: the broker redelivers the message, and the next
/// consumer notes it as a duplicate).
async fn unapplied(pool: &PgPool, total: i64) -> Result<i64, sqlx::Error> {
    let (applied, noted): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(DISTINCT event_id) FROM shipments), \
                (SELECT count(DISTINCT event_id) FROM chaos_consumed)",
    )
    .fetch_one(pool)
    .await?;
    Ok(total - applied.min(noted))
}

/// Stops the consumers gracefully; what went wrong in them fails the run.
async fn stop_consumers(consumers: &mut Relays, report: &mut BrokerReport) {
    let within = Duration::from_secs(20);
    for (slot, status) in consumers.stop(within).await {
        match status {
            Some(status) if status.success() => {}
            Some(status) => report.failures.push(format!(
                "consumer {slot} stopped with {status} after SIGTERM"
            )),
            None => report.failures.push(format!(
                "consumer {slot} did not stop within {within:?} of SIGTERM"
            )),
        }
    }
    for reader in consumers.readers.drain(..) {
        let _ = reader.join();
    }
    report.failures.append(&mut consumers.unexpected_exits);
    let alarming = consumers
        .logs
        .alarming
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for line in alarming.iter().take(20) {
        report.failures.push(format!("a consumer logged: {line}"));
    }
}

/// The consumers' side of the end state: per event, exactly one effect and at least
/// one delivery; no effect of an event the outbox does not hold.
async fn audit(pool: &PgPool, total: i64, report: &mut BrokerReport) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("auditing: {e}");
    let (applied_once, unapplied, applied_twice, effects, phantom): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "WITH per_event AS (SELECT e.event_id, count(s.event_id) AS n \
                 FROM chaos_events e LEFT JOIN shipments s USING (event_id) GROUP BY e.event_id) \
             SELECT count(*) FILTER (WHERE n = 1), count(*) FILTER (WHERE n = 0), \
                    count(*) FILTER (WHERE n > 1), \
                    (SELECT count(*) FROM shipments), \
                    (SELECT count(*) FROM shipments s WHERE NOT EXISTS \
                        (SELECT FROM chaos_events e WHERE e.event_id = s.event_id)) \
             FROM per_event",
        )
        .fetch_one(pool)
        .await
        .map_err(db)?;
    report.events_applied_once = applied_once;
    // Why a row is DEAD (the relay-side checks count them): the sink's reason.
    let dead: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT event_id, last_error FROM chaos_events WHERE status = 'DEAD' \
         ORDER BY event_id LIMIT 3",
    )
    .fetch_all(pool)
    .await
    .map_err(db)?;
    for (event_id, error) in dead {
        report.failures.push(format!(
            "{event_id} is DEAD: {}",
            error.as_deref().unwrap_or("(no reason)")
        ));
    }
    report.effects = effects;
    let failures = &mut report.failures;
    if applied_once != total {
        failures.push(format!(
            "{applied_once} of {total} events applied exactly once: {unapplied} never, \
             {applied_twice} more than once"
        ));
    }
    if phantom > 0 {
        failures.push(format!("{phantom} effects of events not in the outbox"));
    }
    let wrong_parcels: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM shipments s JOIN chaos_events e USING (event_id) \
         WHERE s.parcels <> e.order_seq",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    if wrong_parcels > 0 {
        failures.push(format!(
            "{wrong_parcels} effects carry another event's payload"
        ));
    }

    let (deliveries, inbox_duplicates, redeliveries, max_delivery, undelivered, new_twice): (
        i64,
        i64,
        i64,
        Option<i64>,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE NOT new), count(*) FILTER (WHERE delivery > 1), \
                max(delivery), \
                (SELECT count(*) FROM chaos_events e WHERE NOT EXISTS \
                    (SELECT FROM chaos_consumed c WHERE c.event_id = e.event_id)), \
                (SELECT count(*) FROM (SELECT event_id FROM chaos_consumed WHERE new \
                    GROUP BY event_id HAVING count(*) > 1) t) \
         FROM chaos_consumed",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    report.deliveries = deliveries;
    report.inbox_duplicates = inbox_duplicates;
    report.redeliveries = redeliveries;
    report.max_delivery = max_delivery.unwrap_or(0);
    // A consumer acknowledges only after noting the delivery: one killed before the note
    // gets the message redelivered, and the next delivery is noted.
    if undelivered > 0 {
        failures.push(format!(
            "{undelivered} events with no delivery noted by a consumer"
        ));
    }
    if new_twice > 0 {
        failures.push(format!(
            "{new_twice} events the inbox called new more than once"
        ));
    }
    explain_duplicates(pool, report).await
}

/// `dups`: each duplicate delivery, beside where the broker held the delivery that
/// was applied and that delivery's count (a broker without positions notes 0).
const DUPLICATES: &str = "WITH applied AS (SELECT DISTINCT ON (event_id) event_id, \
         broker_position AS applied_position, delivery AS applied_delivery \
         FROM chaos_consumed WHERE new ORDER BY event_id, consumed_at), \
     dups AS (SELECT c.*, a.applied_position, a.applied_delivery FROM chaos_consumed c \
         LEFT JOIN applied a USING (event_id) WHERE NOT c.new)";

/// A duplicate of the applied message itself (the same position at the broker).
const SAME_MESSAGE: &str = "broker_position > 0 AND broker_position = applied_position";

/// Sorts the inbox's duplicates by cause. Of the same message as the applied delivery
/// (the same position at the broker), by the broker's delivery count, which only grows
/// while the broker keeps its record of the message:
/// - a higher count: redelivered, as no acknowledgement reached the broker;
/// - a lower count: an earlier delivery handled late. Its consumer held it past the
///   acknowledgement deadline (paused, or waiting on the other consumer's uncommitted
///   inbox row), the broker redelivered it meanwhile, and the redelivery was applied
///   first (`handled_late_after_a_redelivery_explains_a_first_delivery_duplicate`);
/// - the same count: delivered anew, after the broker lost its record of the earlier
///   delivery and of its acknowledgement: only a broker restart may do that, so each
///   must come after an outage began.
///
/// Of another message: a count above 1 is a redelivery, else another copy of the
/// event at the broker.
async fn explain_duplicates(pool: &PgPool, report: &mut BrokerReport) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("explaining the duplicates: {e}");
    let (redelivered, late, other_copy, anew, unnoted): (i64, i64, i64, i64, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "{DUPLICATES} SELECT \
                 count(*) FILTER (WHERE ({SAME_MESSAGE}) AND delivery > applied_delivery \
                     OR NOT coalesce({SAME_MESSAGE}, false) AND delivery > 1), \
                 count(*) FILTER (WHERE ({SAME_MESSAGE}) AND delivery < applied_delivery), \
                 count(*) FILTER (WHERE applied_position IS NOT NULL \
                     AND NOT ({SAME_MESSAGE}) AND delivery = 1), \
                 count(*) FILTER (WHERE ({SAME_MESSAGE}) AND delivery = applied_delivery), \
                 count(*) FILTER (WHERE applied_position IS NULL) \
             FROM dups"
        )))
        .fetch_one(pool)
        .await
        .map_err(db)?;
    let causes = &mut report.duplicate_causes;
    causes.push(format!(
        "{redelivered} redelivered (the broker's delivery count above the applied one's, at \
         most {}): no acknowledgement reached the broker, from a consumer killed or paused \
         before it, or cut off",
        report.max_delivery
    ));
    causes.push(format!(
        "{late} handled late (a delivery count below the applied one's): held past the \
         acknowledgement deadline by a consumer paused or waiting on the other's inbox row, \
         while the broker redelivered the message and the redelivery was applied first"
    ));
    causes.push(format!(
        "{other_copy} another copy of the event at the broker (see the copies above)"
    ));
    if anew > 0 {
        let after: Vec<(Option<String>, i64, Option<f64>)> =
            sqlx::query_as(AssertSqlSafe(format!(
                "{DUPLICATES} SELECT o.kind, count(*), \
                 extract(epoch FROM max(d.consumed_at - o.started_at))::float8 \
             FROM dups d LEFT JOIN LATERAL (SELECT kind, started_at FROM chaos_outages \
                 WHERE started_at <= d.consumed_at ORDER BY started_at DESC LIMIT 1) o ON true \
             WHERE ({SAME_MESSAGE}) AND d.delivery = d.applied_delivery \
             GROUP BY o.kind ORDER BY count(*) DESC"
            )))
            .fetch_all(pool)
            .await
            .map_err(db)?;
        let by_outage: Vec<String> = after
            .iter()
            .map(|(kind, n, within)| match kind {
                Some(kind) => format!(
                    "{n} after a {kind} began (at most {:.1}s after it)",
                    within.unwrap_or(0.0)
                ),
                None => format!("{n} before any outage"),
            })
            .collect();
        causes.push(format!(
            "{anew} delivered anew (the same message, its delivery count no higher than the \
             applied one's): a restart lost the broker's record of the earlier delivery and of \
             its acknowledgement: {}",
            by_outage.join(", ")
        ));
        if let Some((None, n, _)) = after.iter().find(|(kind, ..)| kind.is_none()) {
            report.failures.push(format!(
                "{n} messages delivered anew with no broker outage before them"
            ));
        }
    }
    if unnoted > 0 {
        causes.push(format!(
            "{unnoted} duplicates of events whose applied delivery was not noted (a consumer \
             killed between its commit and the note)"
        ));
    }
    Ok(())
}
