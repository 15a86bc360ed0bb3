//! Chaos for the relay: several relay processes publish one stream of events while the
//! driver SIGKILLs them, SIGSTOPs them past their lease, terminates their database
//! sessions and restarts PostgreSQL under them. At the end every event must be `SENT`
//! exactly once in the outbox, delivered at least once, and recorded `SENT` by the
//! generation that held the row.
//!
//! Each relay is a child process re-executing the current binary (`crate::child`, as
//! in the recovery lab) that runs [`outbox::Relay`] into a sink recording every delivery
//! in `chaos_deliveries`, a plain table outside the outbox. A trigger notes every transition to `SENT` in `chaos_sent`, with the
//! recording session's `application_name`, which names the relay process: the end state
//! must show each `SENT` recorded by the process that delivered the row's final
//! generation, after delivering it (a fencing bug that lets a stale owner's outcome
//! through fails that check even when the new owner delivered too). The children log
//! the relay's tracing output to stderr; the driver reads it to count stale rejections
//! and to catch constraint violations and panics.
//!
//! Driven by `tests/chaos.rs` (a short run, for CI) and `examples/chaos.rs` (long runs).
//! [`broker`] runs the same relay processes
//! through a real broker to consumer processes (`tests/broker_chaos.rs`,
//! `examples/broker_chaos.rs`).

use std::fmt;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use outbox::testing::{Cluster, TestSchema, TestSupportError};
use outbox::{CancellationToken, Delivery, Relay, Sink, SinkError, relay::Backoff};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep};

use crate::child::{self, Child, ChildCommand};
use crate::events::ChaosEvent;
use crate::schema::{Generations, migrate};

#[cfg(any(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
pub mod broker;
pub mod fleet;

fn lease() -> Duration {
    <ChaosEvent as outbox::Outbox>::SPEC.lease()
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    /// Events enqueued in all.
    pub events: usize,
    /// Share of the events enqueued before the relays start (the rest while they run).
    pub prefill: f64,
    /// Events per second enqueued while the relays run.
    pub rate: f64,
    /// Relay processes.
    pub relays: usize,
    /// Rows per claim of each relay.
    pub batch_size: u32,
    /// Workers per relay.
    pub concurrency: usize,
    /// Seed of every random choice: the driver's (which relay, which action, how long)
    /// and, through a seed of their own, the children's (a sink's latency).
    pub seed: u64,
    /// Restart PostgreSQL once mid-run (only when the run owns its server).
    pub restart_postgres: bool,
    /// Echo every line the relays log.
    pub verbose: bool,
    /// Give up waiting for the outbox to drain after this long.
    pub drain_timeout: Duration,
}

impl Config {
    /// `events` events with the defaults: 40% enqueued up front, the rest at 150/s,
    /// 4 relays claiming 50 rows with 2 workers each, a PostgreSQL restart.
    pub fn new(events: usize) -> Self {
        Self {
            events,
            prefill: 0.4,
            rate: 150.0,
            relays: 4,
            batch_size: 50,
            concurrency: 2,
            seed: fastrand::u64(..),
            restart_postgres: true,
            verbose: false,
            drain_timeout: Duration::from_secs(90),
        }
    }
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub events: usize,
    pub relays: usize,
    /// Where the database came from.
    pub server: String,
    /// Relays SIGKILLed (and restarted), and how many of those in the middle of a batch.
    pub kills: u32,
    pub kills_mid_batch: u32,
    /// Relays SIGSTOPped past their lease, and how many of those in the middle of a batch.
    pub pauses: u32,
    pub pauses_mid_batch: u32,
    /// Pauses that ended as another relay started a batch (likely the reclaim).
    pub pauses_into_reclaim: u32,
    /// `pg_terminate_backend` rounds, and sessions they ended.
    pub terminations: u32,
    pub sessions_terminated: i64,
    /// PostgreSQL restarts, or why there was none.
    pub restarts: u32,
    pub restart_skipped: Option<String>,
    /// Business transactions retried after a database error.
    pub enqueue_retries: u32,
    /// Rows in `chaos_deliveries`.
    pub deliveries: i64,
    /// Deliveries by a claim whose generation is not the row's final one.
    pub superseded_deliveries: i64,
    /// Relay incarnations that delivered something.
    pub publishers: i64,
    /// Highest generation and attempt count of any row.
    pub max_generation: i64,
    pub max_attempts: i32,
    /// Lines the relays logged, by kind.
    pub stale_outcomes: u64,
    pub renewals_rejected: u64,
    pub publish_timeouts: u64,
    pub relay_errors: u64,
    pub relay_error_samples: Vec<String>,
    pub constraint_violations: u64,
    /// Seconds: the whole run, the chaos phase, the drain after it.
    pub wall: Duration,
    pub chaos: Duration,
    pub drain: Duration,
    /// Every check that failed; empty for a passing run.
    pub failures: Vec<String>,
}

impl Report {
    /// Deliveries beyond one per event.
    pub fn duplicates(&self) -> i64 {
        self.deliveries - i64::try_from(self.events).unwrap_or(i64::MAX)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let restarts = match &self.restart_skipped {
            Some(why) => format!("{} (skipped: {why})", self.restarts),
            None => self.restarts.to_string(),
        };
        writeln!(f, "chaos summary (seed {}, {})", self.seed, self.server)?;
        writeln!(
            f,
            "  events                 {} ({} relays)",
            self.events, self.relays
        )?;
        writeln!(
            f,
            "  kills                  {} ({} mid-batch)",
            self.kills, self.kills_mid_batch
        )?;
        writeln!(
            f,
            "  pauses past the lease  {} ({} mid-batch, {} woken into another relay's batch)",
            self.pauses, self.pauses_mid_batch, self.pauses_into_reclaim
        )?;
        writeln!(
            f,
            "  backend terminations   {} ({} sessions)",
            self.terminations, self.sessions_terminated
        )?;
        writeln!(f, "  postgres restarts      {restarts}")?;
        writeln!(f, "  enqueue retries        {}", self.enqueue_retries)?;
        writeln!(
            f,
            "  deliveries             {} by {} relay incarnations",
            self.deliveries, self.publishers
        )?;
        writeln!(
            f,
            "  duplicate deliveries   {} ({} by superseded generations)",
            self.duplicates(),
            self.superseded_deliveries
        )?;
        writeln!(
            f,
            "  stale rejections       {} outcomes, {} renewals ({} publish timeouts)",
            self.stale_outcomes, self.renewals_rejected, self.publish_timeouts
        )?;
        writeln!(
            f,
            "  max generation/claims  {}/{}",
            self.max_generation, self.max_attempts
        )?;
        self.write_tail(f, &self.failures)
    }
}

impl Report {
    /// The summary's last lines, the broker run's too: the relays' errors, the wall
    /// time, and the result, `failures` listed.
    fn write_tail(&self, f: &mut fmt::Formatter<'_>, failures: &[String]) -> fmt::Result {
        writeln!(
            f,
            "  relay errors logged    {} (constraint violations: {})",
            self.relay_errors, self.constraint_violations
        )?;
        for sample in &self.relay_error_samples {
            writeln!(f, "    e.g. {sample}")?;
        }
        writeln!(
            f,
            "  wall time              {:.1}s (chaos {:.1}s, drain {:.1}s)",
            self.wall.as_secs_f64(),
            self.chaos.as_secs_f64(),
            self.drain.as_secs_f64()
        )?;
        if failures.is_empty() {
            write!(f, "  result                 every check passed")
        } else {
            write!(f, "  result                 {} FAILED:", failures.len())?;
            for failure in failures {
                write!(f, "\n    - {failure}")?;
            }
            Ok(())
        }
    }
}

/// The child role of a relay process (see `crate::child`).
const RELAY: &str = "chaos relay";
/// Prefix of the lines a child (relay or consumer) writes itself (the rest is the
/// relay's tracing).
const MARK: &str = "chaos-child:";
/// Written by the sink (a consumer: its fetch) when a batch arrives: the driver times
/// some pauses and kills on it.
const BATCH_LINE: &str = "chaos-child: batch";
/// Written once the child handles SIGTERM.
const STARTED_LINE: &str = "chaos-child: started";

// -------------------------------------------------------------------------------------
// The relay child
// -------------------------------------------------------------------------------------

/// In a relay child: run the relay until SIGTERM, recording its deliveries, then exit
/// the process. Returns without doing anything in any other process. (A broker run's
/// children: [`broker::child_main_if_requested`].)
pub fn child_main_if_requested() {
    relay_main_if_requested(async |pool, pid| {
        Ok(RecordingSink {
            pool,
            pid,
            rng: child_rng(),
        })
    });
}

/// In a relay child: run the relay into the sink `sink` makes (from the child's pool and
/// pid) until SIGTERM, then exit the process. Returns without doing anything in any other
/// process.
fn relay_main_if_requested<S: Sink<ChaosEvent> + 'static>(
    sink: impl AsyncFnOnce(PgPool, i32) -> Result<S, String>,
) {
    if !child::requested(RELAY) {
        return;
    }
    let (Some(url), Some(app)) = (child::param("URL"), child::param("APP")) else {
        panic!("a chaos relay needs a URL and an APP");
    };
    let number = |name: &str, default: usize| {
        child::param(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (batch, concurrency) = (number("BATCH", 50), number("CONCURRENCY", 2));
    let runtime = child_runtime();
    let code = runtime.block_on(relay_child(
        &url,
        &app,
        u32::try_from(batch).unwrap_or(50),
        concurrency,
        sink,
    ));
    drop(runtime);
    std::process::exit(code);
}

fn say(line: &str) {
    child::say(&format!("{MARK} {line}"));
}

/// A child's pool on `url`, its sessions named `app` + the pid (which tells the driver
/// which incarnation recorded each SENT, and whose sessions to terminate).
fn child_pool(url: &str, app: &str) -> Result<PgPool, String> {
    let options = url
        .parse::<PgConnectOptions>()
        .map_err(|e| format!("bad url: {e}"))?
        .application_name(&format!("{app}{}", std::process::id()));
    // Lazy: a child restarted while PostgreSQL is down starts anyway and backs off.
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options))
}

/// In a child: its log on stderr (the parent reads it), and a runtime of two workers.
fn child_runtime() -> tokio::runtime::Runtime {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// A token cancelled by SIGTERM (in a child's runtime).
fn cancelled_by_sigterm() -> CancellationToken {
    let shutdown = CancellationToken::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            terminate.recv().await;
            say("SIGTERM: shutting down");
            shutdown.cancel();
        }
    });
    shutdown
}

async fn relay_child<S: Sink<ChaosEvent> + 'static>(
    url: &str,
    app: &str,
    batch: u32,
    concurrency: usize,
    sink: impl AsyncFnOnce(PgPool, i32) -> Result<S, String>,
) -> i32 {
    let pool = match child_pool(url, app) {
        Ok(pool) => pool,
        Err(error) => {
            say(&error);
            return 2;
        }
    };
    let shutdown = cancelled_by_sigterm();
    let pid = i32::try_from(std::process::id()).unwrap_or(-1);
    match sink(pool.clone(), pid).await {
        Ok(sink) => run_relay(pool, sink, batch, concurrency, shutdown).await,
        Err(error) => {
            say(&format!("relay failed: no sink: {error}"));
            1
        }
    }
}

/// Runs a relay into `sink` until `shutdown`; the process's exit code.
async fn run_relay(
    pool: PgPool,
    sink: impl Sink<ChaosEvent> + 'static,
    batch: u32,
    concurrency: usize,
    shutdown: CancellationToken,
) -> i32 {
    let relay = Relay::<ChaosEvent, _>::new(pool, sink)
        .batch_size(batch)
        .concurrency(concurrency)
        .poll_interval(Duration::from_millis(250))
        .retry_backoff(Backoff::new(
            Duration::from_millis(100),
            Duration::from_secs(1),
        ))
        // Longer than the lease: a relay woken from a pause finds its sink still sending,
        // and its renewals (not a timeout) tell it the rows are gone.
        .send_timeout(Duration::from_secs(10))
        .shutdown_grace(Duration::from_secs(5));
    say("started");
    match relay.run(shutdown).await {
        Ok(()) => {
            say("stopped");
            0
        }
        Err(error) => {
            say(&format!("relay failed: {error}"));
            1
        }
    }
}

/// Records every delivery in `chaos_deliveries` (one statement per batch), between two
/// short sleeps (the broker's latency) that widen the windows in which a relay holds
/// claims: a relay paused or killed before the insert has not delivered, one stopped after
/// it has delivered without recording `SENT`.
struct RecordingSink {
    pool: PgPool,
    pid: i32,
    rng: Mutex<fastrand::Rng>,
}

/// In a child: the generator of its random choices, seeded by the driver (`SEED`).
fn child_rng() -> Mutex<fastrand::Rng> {
    let seed = child::param("SEED").and_then(|seed| seed.parse().ok());
    Mutex::new(seed.map_or_else(fastrand::Rng::new, fastrand::Rng::with_seed))
}

/// A draw from a child's generator.
fn draw<T>(rng: &Mutex<fastrand::Rng>, choose: impl FnOnce(&mut fastrand::Rng) -> T) -> T {
    choose(&mut rng.lock().unwrap_or_else(PoisonError::into_inner))
}

impl Sink<ChaosEvent> for RecordingSink {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        say(&format!("batch {}", batch.len()));
        sleep(Duration::from_millis(draw(&self.rng, |rng| {
            rng.u64(2..=12)
        })))
        .await;
        let event_ids: Vec<&str> = batch.iter().map(|d| d.event_id().as_str()).collect();
        let generations: Vec<i64> = batch.iter().map(|d| d.generation().get()).collect();
        let attempts: Vec<i32> = batch
            .iter()
            .map(|d| i32::try_from(d.attempt()).unwrap_or(i32::MAX))
            .collect();
        let inserted = sqlx::query(
            "INSERT INTO chaos_deliveries (event_id, generation, attempt, publisher_pid) \
             SELECT e, g, a, $4 FROM unnest($1::text[], $2::bigint[], $3::int[]) AS u(e, g, a)",
        )
        .bind(&event_ids)
        .bind(&generations)
        .bind(&attempts)
        .bind(self.pid)
        .execute(&self.pool)
        .await;
        // Now and then a slow broker: longer than the lease, which renewals must extend.
        // Redeliveries are slow too, so that a stale owner woken from a pause acts while
        // the new owner still holds the row: the window in which a fencing bug would
        // let the stale outcome through.
        let redelivery = batch.iter().any(|d| d.attempt() > 1);
        let latency = draw(&self.rng, |rng| {
            if rng.u32(0..40) == 0 {
                rng.u64(700..=2_500)
            } else if redelivery {
                rng.u64(100..=300)
            } else {
                rng.u64(5..=20)
            }
        });
        sleep(Duration::from_millis(latency)).await;
        match inserted {
            Ok(_) => batch.iter().map(|_| Ok(())).collect(),
            // Not recorded, so not delivered (or, if the commit's acknowledgement was
            // lost, delivered and retried: a duplicate, which consumers absorb).
            Err(error) => batch
                .iter()
                .map(|_| Err(SinkError::transient(format!("recording: {error}"))))
                .collect(),
        }
    }
}

// -------------------------------------------------------------------------------------
// The driver: relay processes
// -------------------------------------------------------------------------------------

/// What the relays logged, counted by the threads reading their stderr.
#[derive(Debug, Default)]
struct LogCounts {
    stale_outcomes: AtomicU64,
    renewals_rejected: AtomicU64,
    publish_timeouts: AtomicU64,
    errors: AtomicU64,
    constraint_violations: AtomicU64,
    /// The first few errors (under chaos, some are expected: outcomes that could not be
    /// recorded while PostgreSQL restarted).
    error_samples: Mutex<Vec<String>>,
    /// Lines that fail the run: constraint violations, panics, relay failures.
    alarming: Mutex<Vec<String>>,
}

impl LogCounts {
    fn read(&self, tag: &str, line: &str, batches: &mpsc::UnboundedSender<()>, verbose: bool) {
        let bump = |counter: &AtomicU64| counter.fetch_add(1, Ordering::Relaxed);
        if line.contains(BATCH_LINE) {
            let _ = batches.send(());
        } else if line.contains("outcome rejected: the claim is stale") {
            bump(&self.stale_outcomes);
        } else if line.contains("lease renewal rejected") {
            bump(&self.renewals_rejected);
        } else if line.contains("publish timed out") {
            bump(&self.publish_timeouts);
        }
        if line.contains(" ERROR ") && bump(&self.errors) < 5 {
            self.error_samples
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("{tag} {line}"));
        }
        let constraint = line.contains("constraint");
        if constraint {
            bump(&self.constraint_violations);
        }
        if constraint
            || line.contains("panicked")
            || line.contains("relay failed")
            || line.contains("consumer failed")
        {
            self.alarming
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("{tag} {line}"));
        }
        if verbose && !line.contains(BATCH_LINE) {
            eprintln!("{tag} {line}");
        }
    }
}

/// One relay slot: the running child process and its batch announcements.
struct RelayProcess {
    child: Child,
    batches: mpsc::UnboundedReceiver<()>,
    /// Whether it said it handles SIGTERM.
    started: Arc<AtomicBool>,
    /// Whether it is SIGSTOPped.
    paused: Arc<AtomicBool>,
}

/// How a pause ends.
#[derive(Clone, Copy, Debug)]
enum Wake {
    /// This long after the lease ended.
    After(Duration),
    /// Just after the lease ended, as soon as another relay starts a batch (most likely
    /// the reclaim of the paused relay's rows): it wakes while the new owner is sending,
    /// and must not be able to renew or record anything.
    IntoReclaim,
}

/// The relay processes (or a broker run's consumer processes): started, paused, killed
/// and restarted, stopped; their logs read.
struct Relays {
    /// What the children are: their role (see `crate::child`), their name in messages
    /// (`relay`, `consumer`), and the letter in their sessions' `application_name`.
    role: &'static str,
    kind: &'static str,
    letter: char,
    /// Parameters beyond the URL, the name and the batch (a broker's address).
    params: Vec<(String, String)>,
    /// How long a pause lasts at least: past the relay's lease, past the consumer's
    /// acknowledgement deadline.
    pause_past: Duration,
    slots: Vec<RelayProcess>,
    incarnations: usize,
    url: String,
    schema: String,
    config: Config,
    command: ChildCommand,
    logs: Arc<LogCounts>,
    /// Woken by every batch any relay starts.
    announced: Arc<tokio::sync::Notify>,
    /// The tasks ending the pauses.
    pauses: Vec<tokio::task::JoinHandle<bool>>,
    /// The threads reading the relays' stderr.
    readers: Vec<std::thread::JoinHandle<()>>,
    /// Relays that exited without being told to.
    unexpected_exits: Vec<String>,
}

impl Relays {
    /// The relay processes of a run on `schema`.
    fn new(schema: &TestSchema, config: &Config, command: &ChildCommand) -> Self {
        Self {
            role: RELAY,
            kind: "relay",
            letter: 'r',
            params: Vec::new(),
            pause_past: lease(),
            slots: Vec::new(),
            incarnations: 0,
            url: schema.url(),
            schema: schema.name().to_owned(),
            config: config.clone(),
            command: command.clone(),
            logs: Arc::default(),
            announced: Arc::default(),
            pauses: Vec::new(),
            readers: Vec::new(),
            unexpected_exits: Vec::new(),
        }
    }

    /// The prefix of the `application_name` of slot `slot`'s sessions; each
    /// incarnation appends its pid.
    fn app_name(&self, slot: usize) -> String {
        format!("{}-{}{slot}-", self.schema, self.letter)
    }

    fn spawn(&mut self, slot: usize) -> Result<RelayProcess, String> {
        self.incarnations += 1;
        // Each incarnation's choices from the run's seed, in the driver's order of spawns.
        let seed = self.config.seed
            ^ (u64::from(self.letter) << 56)
            ^ u64::try_from(self.incarnations).unwrap_or(u64::MAX);
        let (app, batch, concurrency, slot_param, seed) = (
            self.app_name(slot),
            self.config.batch_size.to_string(),
            self.config.concurrency.to_string(),
            slot.to_string(),
            seed.to_string(),
        );
        let mut params = vec![
            ("URL", self.url.as_str()),
            ("APP", app.as_str()),
            ("SLOT", slot_param.as_str()),
            ("BATCH", batch.as_str()),
            ("CONCURRENCY", concurrency.as_str()),
            ("SEED", seed.as_str()),
        ];
        params.extend(self.params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let mut child = self
            .command
            .spawn(self.role, &params)
            .map_err(|e| format!("{} {slot}: {e}", self.kind))?;
        let stderr = child.stderr()?;
        let pid = child.pid();
        let (tx, rx) = mpsc::unbounded_channel();
        let (logs, verbose) = (Arc::clone(&self.logs), self.config.verbose);
        let started = Arc::new(AtomicBool::new(false));
        let said_started = Arc::clone(&started);
        let announced = Arc::clone(&self.announced);
        let tag = format!("[{}{slot}#{} pid {pid}]", self.letter, self.incarnations);
        let thread = format!("chaos-{}-{slot}-log", self.kind);
        let reader = child::read_lines(thread, stderr, move |line| {
            if line.contains(STARTED_LINE) {
                said_started.store(true, Ordering::Relaxed);
            } else if line.contains(BATCH_LINE) {
                announced.notify_waiters();
            }
            logs.read(&tag, line, &tx, verbose);
        })?;
        self.readers.push(reader);
        Ok(RelayProcess {
            child,
            batches: rx,
            started,
            paused: Arc::default(),
        })
    }

    /// Starts `count` children.
    fn start(&mut self, count: usize) -> Result<(), String> {
        for slot in 0..count {
            let process = self.spawn(slot)?;
            self.slots.push(process);
        }
        Ok(())
    }

    /// Waits up to a second for `slot` to announce a new batch, then `jitter` more (which
    /// lands before or after its sink's insert); true if it announced one.
    async fn next_batch(&mut self, slot: usize, jitter: Duration) -> bool {
        let batches = &mut self.slots[slot].batches;
        while batches.try_recv().is_ok() {}
        let announced = tokio::time::timeout(Duration::from_secs(1), batches.recv())
            .await
            .is_ok_and(|got| got.is_some());
        if announced {
            sleep(jitter).await;
        }
        announced
    }

    fn kill_and_restart(&mut self, slot: usize) -> Result<(), String> {
        self.slots[slot]
            .child
            .kill()
            .map_err(|e| format!("{} {slot}: {e}", self.kind))?;
        self.slots[slot] = self.spawn(slot)?;
        Ok(())
    }

    /// SIGSTOPs `slot` past its lease (`pause_past`); a task SIGCONTs it as `wake` says.
    fn pause(&mut self, slot: usize, wake: Wake) -> Result<(), String> {
        let (kind, past) = (self.kind, self.pause_past);
        let process = &self.slots[slot];
        process
            .child
            .signal(Signal::SIGSTOP)
            .map_err(|e| format!("{kind} {slot}: {e}"))?;
        process.paused.store(true, Ordering::SeqCst);
        let (pid, paused) = (process.child.pid(), Arc::clone(&process.paused));
        let announced = Arc::clone(&self.announced);
        let verbose = self.config.verbose;
        if verbose {
            eprintln!("[chaos] SIGSTOP {kind} {slot} (pid {pid}), waking {wake:?}");
        }
        self.pauses.push(tokio::spawn(async move {
            let into_reclaim = match wake {
                Wake::After(delay) => {
                    sleep(past + delay).await;
                    false
                }
                Wake::IntoReclaim => {
                    sleep(past + Duration::from_millis(20)).await;
                    tokio::time::timeout(Duration::from_secs(1), announced.notified())
                        .await
                        .is_ok()
                }
            };
            let _ = kill(pid, Signal::SIGCONT);
            paused.store(false, Ordering::SeqCst);
            if verbose {
                eprintln!(
                    "[chaos] SIGCONT {kind} {slot} (pid {pid}); into a batch: {into_reclaim}"
                );
            }
            into_reclaim
        }));
        Ok(())
    }

    /// Waits until every pause is over; how many woke into another relay's batch.
    async fn pauses_over(&mut self) -> u32 {
        let mut into_reclaim = 0;
        for pause in self.pauses.drain(..) {
            into_reclaim += u32::from(pause.await.unwrap_or(false));
        }
        into_reclaim
    }

    fn running(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&slot| !self.slots[slot].paused.load(Ordering::SeqCst))
            .collect()
    }

    fn paused(&self) -> usize {
        self.slots.len() - self.running().len()
    }

    /// Notes and replaces relays that exited on their own.
    fn reap_unexpected(&mut self) -> Result<(), String> {
        for slot in 0..self.slots.len() {
            if let Some(status) = self.slots[slot].child.try_wait()? {
                self.unexpected_exits
                    .push(format!("{} {slot} exited on its own: {status}", self.kind));
                self.slots[slot] = self.spawn(slot)?;
            }
        }
        Ok(())
    }

    /// SIGTERMs every relay and waits for them to exit; their exit statuses.
    async fn stop(&mut self, within: Duration) -> Vec<(usize, Option<ExitStatus>)> {
        let deadline = Instant::now() + within;
        // A relay restarted a moment ago may not handle SIGTERM yet.
        while Instant::now() < deadline
            && !self.slots.iter().all(|p| p.started.load(Ordering::Relaxed))
        {
            sleep(Duration::from_millis(20)).await;
        }
        for process in &self.slots {
            let _ = process.child.signal(Signal::SIGTERM);
        }
        let mut statuses = Vec::new();
        for (slot, process) in self.slots.iter_mut().enumerate() {
            let status = loop {
                match process.child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => {
                        sleep(Duration::from_millis(20)).await;
                    }
                    _ => break None,
                }
            };
            statuses.push((slot, status));
        }
        statuses
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for pause in &self.pauses {
            pause.abort();
        }
        // Then the slots drop, and with them (SIGKILLed) every relay still running.
    }
}

// -------------------------------------------------------------------------------------
// The driver: the database
// -------------------------------------------------------------------------------------

/// The server a run uses: its own cluster when PostgreSQL binaries are installed (so it
/// can restart it), otherwise `DATABASE_URL` (no restart).
enum Server {
    Owned(Box<Cluster>),
    Shared(String),
}

impl Server {
    async fn start() -> Result<(Server, Option<String>), String> {
        match Cluster::start().await {
            Ok(cluster) => Ok((Server::Owned(Box::new(cluster)), None)),
            Err(TestSupportError::NoPostgres) => match std::env::var("DATABASE_URL") {
                Ok(url) if !url.is_empty() => Ok((
                    Server::Shared(url),
                    Some("no local PostgreSQL binaries to own a server; using DATABASE_URL".into()),
                )),
                _ => Err(TestSupportError::NoPostgres.to_string()),
            },
            Err(error) => Err(error.to_string()),
        }
    }

    fn url(&self) -> &str {
        match self {
            Server::Owned(cluster) => cluster.url(),
            Server::Shared(url) => url,
        }
    }

    fn describe(&self) -> String {
        match self {
            Server::Owned(cluster) => format!("own cluster on port {}", cluster.port()),
            Server::Shared(_) => "DATABASE_URL".to_owned(),
        }
    }
}

async fn setup(schema: &TestSchema) -> Result<(), String> {
    migrate(schema, &[ChaosEvent::migrations()], Generations::Random)
        .await
        .map_err(|e| format!("migrating: {e}"))?;
    let pool = schema.pool();
    for ddl in [
        "CREATE TABLE chaos_orders (seq bigint PRIMARY KEY)",
        "CREATE TABLE chaos_deliveries (\
             id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             event_id text NOT NULL, \
             generation bigint NOT NULL, \
             attempt integer NOT NULL, \
             publisher_pid integer NOT NULL, \
             delivered_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        // Who recorded each SENT, and when: the session's application_name names the
        // relay process. Written by the recording statement's own transaction.
        "CREATE TABLE chaos_sent (\
             event_id text NOT NULL, \
             generation bigint NOT NULL, \
             recorder text NOT NULL, \
             sent_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE FUNCTION chaos_note_sent() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO chaos_sent (event_id, generation, recorder) \
             VALUES (NEW.event_id, NEW.generation, current_setting('application_name')); \
             RETURN NULL; END $$",
        "CREATE TRIGGER chaos_note_sent AFTER UPDATE ON chaos_events FOR EACH ROW \
             WHEN (NEW.status = 'SENT' AND OLD.status IS DISTINCT FROM 'SENT') \
             EXECUTE FUNCTION chaos_note_sent()",
    ] {
        sqlx::query(ddl)
            .execute(pool)
            .await
            .map_err(|e| format!("{ddl}: {e}"))?;
    }
    Ok(())
}

fn key(seq: i64) -> String {
    format!("chaos-{seq:06}")
}

/// One business transaction: the orders `seqs` and their events.
async fn enqueue_orders(pool: &PgPool, seqs: &[i64]) -> Result<(), String> {
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    sqlx::query("INSERT INTO chaos_orders (seq) SELECT * FROM unnest($1::bigint[])")
        .bind(seqs)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    for &seq in seqs {
        ChaosEvent {
            key: key(seq),
            order_seq: seq,
        }
        .enqueue(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    }
    tx.commit().await.map_err(|e| e.to_string())
}

/// Enqueues `seqs` in one transaction, retrying through database outages. A commit whose
/// acknowledgement was lost may have happened: the order rows tell.
async fn enqueue_durably(pool: &PgPool, seqs: &[i64], retries: &AtomicU64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_mins(1);
    loop {
        let error = match enqueue_orders(pool, seqs).await {
            Ok(()) => return Ok(()),
            Err(error) => error,
        };
        retries.fetch_add(1, Ordering::Relaxed);
        let committed: Result<bool, _> =
            sqlx::query_scalar("SELECT EXISTS (SELECT FROM chaos_orders WHERE seq = $1)")
                .bind(seqs[0])
                .fetch_one(pool)
                .await;
        if matches!(committed, Ok(true)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("enqueueing {seqs:?} kept failing: {error}"));
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// Enqueues `from..to` in transactions of 1..=`max_tx` events, at `rate` events per
/// second (`None`: as fast as possible).
async fn enqueue_range(
    pool: PgPool,
    (from, to): (i64, i64),
    max_tx: i64,
    rate: Option<f64>,
    seed: u64,
    progress: Arc<AtomicUsize>,
    retries: Arc<AtomicU64>,
) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let started = Instant::now();
    let mut next = from;
    while next < to {
        let end = (next + rng.i64(1..=max_tx)).min(to);
        let seqs: Vec<i64> = (next..end).collect();
        enqueue_durably(&pool, &seqs, &retries).await?;
        progress.fetch_add(seqs.len(), Ordering::Relaxed);
        next = end;
        if let Some(rate) = rate {
            #[allow(clippy::cast_precision_loss)]
            let due = started + Duration::from_secs_f64((next - from) as f64 / rate);
            tokio::time::sleep_until(due).await;
        }
    }
    Ok(())
}

/// The business transactions of a run: a share of the orders up front, the rest at the
/// run's rate while the relays run.
struct Orders {
    /// Events enqueued so far.
    progress: Arc<AtomicUsize>,
    retries: Arc<AtomicU64>,
    prefilled: i64,
    rest: Option<tokio::task::JoinHandle<Result<(), String>>>,
}

impl Orders {
    /// Enqueues `config.prefill` of the events, as fast as possible.
    async fn prefill(pool: &PgPool, config: &Config) -> Result<Self, String> {
        let total = i64::try_from(config.events).map_err(|e| e.to_string())?;
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_precision_loss,
            clippy::cast_sign_loss
        )]
        let prefilled = ((config.events as f64 * config.prefill) as i64).clamp(0, total);
        let orders = Self {
            progress: Arc::default(),
            retries: Arc::default(),
            prefilled,
            rest: None,
        };
        enqueue_range(
            pool.clone(),
            (0, prefilled),
            20,
            None,
            config.seed,
            Arc::clone(&orders.progress),
            Arc::clone(&orders.retries),
        )
        .await?;
        Ok(orders)
    }

    /// Starts enqueueing the rest, at `config.rate`, in a task.
    fn enqueue_the_rest(&mut self, pool: &PgPool, config: &Config) {
        let total = i64::try_from(config.events).unwrap_or(i64::MAX);
        self.rest = Some(tokio::spawn(enqueue_range(
            pool.clone(),
            (self.prefilled, total),
            8,
            Some(config.rate),
            config.seed ^ 1,
            Arc::clone(&self.progress),
            Arc::clone(&self.retries),
        )));
    }

    /// Waits for the rest to be enqueued; notes in `failures` if it could not be, and
    /// returns how many business transactions were retried.
    async fn finish(&mut self, failures: &mut Vec<String>) -> u32 {
        if let Some(rest) = self.rest.take() {
            match rest.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => failures.push(error),
                Err(error) => failures.push(format!("the enqueuer died: {error}")),
            }
        }
        u32::try_from(self.retries.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
    }
}

/// Terminates the sessions of one relay (`Some(slot)`) or of all; how many it ended.
async fn terminate_sessions(pool: &PgPool, prefix: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE starts_with(application_name, $1) AND pid <> pg_backend_pid()",
    )
    .bind(prefix)
    .fetch_one(pool)
    .await
}

async fn unsent(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM chaos_events WHERE status <> 'SENT'")
        .fetch_one(pool)
        .await
}

/// What the events still unsent look like, grouped: for a drain that timed out, so that
/// the failure says where they are stuck.
async fn unsent_rows(pool: &PgPool) -> String {
    /// Status, attempts, whether the lease is live, the last error, and how many.
    type Group = (String, i32, bool, Option<String>, i64);
    let groups: Result<Vec<Group>, _> = sqlx::query_as(
        "SELECT status, attempts, coalesce(lease_until > clock_timestamp(), false), \
                left(last_error, 200), count(*) \
         FROM chaos_events WHERE status <> 'SENT' GROUP BY 1, 2, 3, 4 ORDER BY 5 DESC LIMIT 5",
    )
    .fetch_all(pool)
    .await;
    match groups {
        Ok(groups) => groups
            .into_iter()
            .map(|(status, attempts, live, error, n)| {
                format!(
                    "{n} {status} after {attempts} attempts{}{}",
                    if live { ", lease live" } else { "" },
                    error
                        .map(|e| format!(", last error: {e}"))
                        .unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(error) => format!("(could not read them: {error})"),
    }
}

// -------------------------------------------------------------------------------------
// The driver: the run
// -------------------------------------------------------------------------------------

/// Runs the chaos and checks the end state. `Err` only when the run could not be set
/// up; failed checks are listed in [`Report::failures`].
pub async fn run(config: &Config, command: &ChildCommand) -> Result<Report, String> {
    let wall = Instant::now();
    let (mut server, no_restart) = Server::start().await?;
    let schema = TestSchema::new_in(server.url())
        .await
        .map_err(|e| e.to_string())?;
    setup(&schema).await?;
    let pool = schema.pool().clone();

    let mut report = Report {
        seed: config.seed,
        events: config.events,
        relays: config.relays,
        server: server.describe(),
        restart_skipped: if config.restart_postgres {
            no_restart
        } else {
            Some("disabled".into())
        },
        ..Report::default()
    };
    if let Some(why) = &report.restart_skipped {
        println!("chaos: the PostgreSQL restart is skipped: {why}");
    }
    let total = i64::try_from(config.events).map_err(|e| e.to_string())?;
    let mut orders = Orders::prefill(&pool, config).await?;

    let mut relays = Relays::new(&schema, config, command);
    relays.start(config.relays)?;
    let chaos_started = Instant::now();
    orders.enqueue_the_rest(&pool, config);

    chaos(
        config,
        &mut server,
        &pool,
        &mut relays,
        &orders.progress,
        &mut report,
    )
    .await?;
    report.enqueue_retries = orders.finish(&mut report.failures).await;
    report.chaos = chaos_started.elapsed();

    // A restart that could run must have run (a drain faster than the chaos would
    // otherwise pass without one).
    let restart_missing = report.restart_skipped.is_none() && report.restarts == 0;
    if report.kills == 0 || report.pauses == 0 || report.terminations == 0 || restart_missing {
        report.failures.push(format!(
            "too little chaos: {} kills, {} pauses, {} termination rounds, {} restarts",
            report.kills, report.pauses, report.terminations, report.restarts
        ));
    }
    drain(config, &pool, &mut relays, &mut report).await?;
    stop(&mut relays, &mut report).await;
    verify_outbox(&pool, total, &mut report).await?;
    verify_deliveries(&pool, total, &mut report).await?;
    drop(relays);
    schema.drop_schema().await.map_err(|e| e.to_string())?;
    drop(server);
    report.wall = wall.elapsed();
    Ok(report)
}

/// Every relay runs again; waits until nothing is left to send.
async fn drain(
    config: &Config,
    pool: &PgPool,
    relays: &mut Relays,
    report: &mut Report,
) -> Result<(), String> {
    report.pauses_into_reclaim = relays.pauses_over().await;
    relays.reap_unexpected()?;
    let started = Instant::now();
    loop {
        match unsent(pool).await {
            Ok(0) => break,
            Ok(_) | Err(_) if started.elapsed() < config.drain_timeout => {
                relays.reap_unexpected()?;
                sleep(Duration::from_millis(100)).await;
            }
            Ok(left) => {
                report.failures.push(format!(
                    "{left} events still unsent {:?} after the chaos: {}",
                    config.drain_timeout,
                    unsent_rows(pool).await
                ));
                break;
            }
            Err(error) => {
                report.failures.push(format!("draining: {error}"));
                break;
            }
        }
    }
    report.drain = started.elapsed();
    Ok(())
}

/// Stops the relays gracefully (each handles SIGTERM by cancelling its shutdown token)
/// and collects what they logged.
async fn stop(relays: &mut Relays, report: &mut Report) {
    let within = Duration::from_secs(20);
    for (slot, status) in relays.stop(within).await {
        match status {
            Some(status) if status.success() => {}
            Some(status) => report.failures.push(format!(
                "{} {slot} stopped with {status} after SIGTERM",
                relays.kind
            )),
            None => report.failures.push(format!(
                "{} {slot} did not stop within {within:?} of SIGTERM",
                relays.kind
            )),
        }
    }
    // Every child is gone, so every reader reaches the end of its pipe.
    for reader in relays.readers.drain(..) {
        let _ = reader.join();
    }
    let logs = &relays.logs;
    report.stale_outcomes = logs.stale_outcomes.load(Ordering::Relaxed);
    report.renewals_rejected = logs.renewals_rejected.load(Ordering::Relaxed);
    report.publish_timeouts = logs.publish_timeouts.load(Ordering::Relaxed);
    report.relay_errors = logs.errors.load(Ordering::Relaxed);
    report.relay_error_samples = std::mem::take(
        &mut *logs
            .error_samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    report.constraint_violations = logs.constraint_violations.load(Ordering::Relaxed);
    report.failures.append(&mut relays.unexpected_exits);
    for line in logs
        .alarming
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .take(20)
    {
        report.failures.push(format!("a relay logged: {line}"));
    }
}

/// The chaos phase: runs while events are being enqueued, and until every kind of
/// chaos happened a few times.
async fn chaos(
    config: &Config,
    server: &mut Server,
    pool: &PgPool,
    relays: &mut Relays,
    progress: &AtomicUsize,
    report: &mut Report,
) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(config.seed ^ 2);
    let started = Instant::now();
    // However it goes, the chaos ends 20 s after the enqueueing should have.
    #[allow(clippy::cast_precision_loss)]
    let hard_stop = started + Duration::from_secs_f64(config.events as f64 / config.rate + 20.0);
    let restart_at = config.events - (config.events - progress.load(Ordering::Relaxed)) / 2;
    let mut next_action = Instant::now() + Duration::from_millis(rng.u64(200..600));
    loop {
        relays.reap_unexpected()?;
        let enqueued = progress.load(Ordering::Relaxed) >= config.events;
        let restart_pending = report.restart_skipped.is_none() && report.restarts == 0;
        let enough = report.kills >= 3
            && report.pauses >= 2
            && report.pauses_mid_batch >= 1
            && report.terminations >= 2
            && !restart_pending;
        // Once everything is enqueued and every kind of chaos happened, start nothing new
        // and end when the last pause does.
        if (enqueued && enough && relays.paused() == 0) || Instant::now() > hard_stop {
            break;
        }
        if (enqueued && enough) || Instant::now() < next_action {
            sleep(Duration::from_millis(20)).await;
            continue;
        }
        next_action = Instant::now() + Duration::from_millis(rng.u64(150..500));

        if restart_pending && progress.load(Ordering::Relaxed) >= restart_at {
            if let Server::Owned(cluster) = server {
                let began = Instant::now();
                cluster
                    .restart()
                    .await
                    .map_err(|e| format!("restarting PostgreSQL: {e}"))?;
                report.restarts += 1;
                println!(
                    "chaos: restarted PostgreSQL in {:.2}s",
                    began.elapsed().as_secs_f64()
                );
            }
            continue;
        }
        let running = relays.running();
        match rng.u32(0..10) {
            // Pause a relay (mid-batch if it has one) for longer than its lease.
            0..=2 if relays.paused() < relays.slots.len() / 2 => {
                let slot = running[rng.usize(..running.len())];
                let jitter = Duration::from_millis(rng.u64(0..15));
                let mid_batch = relays.next_batch(slot, jitter).await;
                // Every other pause ends into the reclaim of the paused relay's rows.
                let wake = if report.pauses.is_multiple_of(2) {
                    Wake::IntoReclaim
                } else {
                    Wake::After(Duration::from_millis(rng.u64(300..1500)))
                };
                relays.pause(slot, wake)?;
                report.pauses += 1;
                report.pauses_mid_batch += u32::from(mid_batch);
            }
            // Terminate the database sessions of one relay, or of all.
            3..=5 => {
                let prefix = if rng.bool() {
                    relays.app_name(running[rng.usize(..running.len())])
                } else {
                    format!("{}-r", relays.schema)
                };
                // PostgreSQL may be restarting: a failed round is no round.
                if let Ok(ended) = terminate_sessions(pool, &prefix).await {
                    report.terminations += 1;
                    report.sessions_terminated += ended;
                }
            }
            // SIGKILL a relay, half of the time in the middle of a batch, and restart it.
            _ => {
                let slot = running[rng.usize(..running.len())];
                let jitter = Duration::from_millis(rng.u64(0..15));
                let mid_batch = rng.bool() && relays.next_batch(slot, jitter).await;
                relays.kill_and_restart(slot)?;
                report.kills += 1;
                report.kills_mid_batch += u32::from(mid_batch);
            }
        }
    }
    Ok(())
}

/// The end state of the outbox and the business rows.
async fn verify_outbox(pool: &PgPool, total: i64, report: &mut Report) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("verifying: {e}");
    let failures = &mut report.failures;
    let mut check = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };

    let (rows, distinct, sent, inprogress, dead, lease_mismatch, max_generation, max_attempts): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        Option<i64>,
        Option<i32>,
    ) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), count(*) FILTER (WHERE status = 'SENT'), \
                count(*) FILTER (WHERE status = 'INPROGRESS'), count(*) FILTER (WHERE status = 'DEAD'), \
                count(*) FILTER (WHERE (status = 'INPROGRESS') <> (lease_until IS NOT NULL)), \
                max(generation), max(attempts) \
         FROM chaos_events",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    check(
        rows == total && distinct == total,
        format!("outbox rows: {rows} ({distinct} distinct event ids), expected {total}"),
    );
    check(sent == total, format!("{sent} of {total} rows SENT"));
    check(
        inprogress == 0,
        format!("{inprogress} rows left INPROGRESS"),
    );
    check(dead == 0, format!("{dead} rows DEAD"));
    check(
        lease_mismatch == 0,
        format!("{lease_mismatch} rows break (status = 'INPROGRESS') = (lease_until IS NOT NULL)"),
    );
    let (has_check,): (bool,) = sqlx::query_as(
        "SELECT EXISTS (SELECT FROM pg_constraint WHERE conrelid = 'chaos_events'::regclass \
         AND contype = 'c' AND pg_get_constraintdef(oid) LIKE '%lease_until IS NOT NULL%')",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    check(
        has_check,
        "the table has no lease CHECK constraint".to_owned(),
    );

    let (orders, orphans): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS \
             (SELECT FROM chaos_events e WHERE e.order_seq = o.seq)) \
         FROM chaos_orders o",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    check(
        orders == total && orphans == 0,
        format!("{orders} business rows ({orphans} without their event), expected {total}"),
    );

    report.max_generation = max_generation.unwrap_or(0);
    report.max_attempts = max_attempts.unwrap_or(0);
    Ok(())
}

/// The deliveries the sinks recorded, against the outbox.
async fn verify_deliveries(pool: &PgPool, total: i64, report: &mut Report) -> Result<(), String> {
    let db = |e: sqlx::Error| format!("verifying: {e}");
    let failures = &mut report.failures;
    let mut check = |ok: bool, what: String| {
        if !ok {
            failures.push(what);
        }
    };
    let (deliveries, delivered, claims, publishers): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), count(DISTINCT (event_id, generation)), \
                count(DISTINCT publisher_pid) \
         FROM chaos_deliveries",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    check(
        delivered == total,
        format!("{delivered} of {total} events delivered"),
    );
    check(
        claims == deliveries,
        format!(
            "{} deliveries repeat an (event, generation): two claims shared a fencing token",
            deliveries - claims
        ),
    );
    let (phantom, superseded, future, final_missing): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT \
             (SELECT count(*) FROM chaos_deliveries d \
              WHERE NOT EXISTS (SELECT FROM chaos_events e WHERE e.event_id = d.event_id)), \
             (SELECT count(*) FROM chaos_deliveries d JOIN chaos_events e USING (event_id) \
              WHERE d.generation < e.generation), \
             (SELECT count(*) FROM chaos_deliveries d JOIN chaos_events e USING (event_id) \
              WHERE d.generation > e.generation), \
             (SELECT count(*) FROM chaos_events e WHERE NOT EXISTS \
                 (SELECT FROM chaos_deliveries d WHERE d.event_id = e.event_id \
                  AND d.generation = e.generation AND d.attempt = e.attempts))",
    )
    .fetch_one(pool)
    .await
    .map_err(db)?;
    check(
        phantom == 0,
        format!("{phantom} deliveries of events not in the outbox"),
    );
    check(
        future == 0,
        format!("{future} deliveries by a generation newer than the row's"),
    );
    check(
        final_missing == 0,
        format!(
            "{final_missing} rows were recorded SENT by a generation that delivered nothing \
             (no delivery with the row's final generation and attempt)"
        ),
    );
    report.deliveries = deliveries;
    report.superseded_deliveries = superseded;
    report.publishers = publishers;
    verify_recorders(pool, total, &mut report.failures).await
}

/// Who recorded each SENT: the process that delivered the generation holding the row,
/// after delivering it. A stale owner's accepted outcome shows up here even when the
/// current owner delivered too.
async fn verify_recorders(
    pool: &PgPool,
    total: i64,
    failures: &mut Vec<String>,
) -> Result<(), String> {
    let (transitions, events, foreign): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), count(*) FILTER (WHERE NOT EXISTS \
             (SELECT FROM chaos_deliveries d WHERE d.event_id = s.event_id \
              AND d.generation = s.generation AND s.recorder LIKE '%-' || d.publisher_pid \
              AND d.delivered_at <= s.sent_at)) \
         FROM chaos_sent s",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| format!("verifying: {e}"))?;
    if transitions != total || events != total {
        failures.push(format!(
            "{transitions} transitions to SENT for {events} events, expected {total} each"
        ));
    }
    if foreign > 0 {
        let examples: Vec<(String, i64, String)> = sqlx::query_as(
            "SELECT s.event_id, s.generation, s.recorder FROM chaos_sent s WHERE NOT EXISTS \
                 (SELECT FROM chaos_deliveries d WHERE d.event_id = s.event_id \
                  AND d.generation = s.generation AND s.recorder LIKE '%-' || d.publisher_pid \
                  AND d.delivered_at <= s.sent_at) \
             ORDER BY s.sent_at LIMIT 3",
        )
        .fetch_all(pool)
        .await
        .map_err(|e| format!("verifying: {e}"))?;
        failures.push(format!(
            "{foreign} SENT recorded by a process that had not delivered the row's generation \
             (a stale outcome accepted), e.g. {examples:?}"
        ));
    }
    Ok(())
}
