//! Per-key ordering under chaos: four relay processes publish 1,000 orders × 20 events
//! and 4 hot orders × 200 events (`#[outbox(key)]`; a hot order's runs go on from
//! batch to batch, each process with a run length of its own) through a sink that fails
//! now and then, while the test SIGKILLs and restarts them, SIGSTOPs them past their
//! lease and terminates their database sessions.
//!
//! The sink writes every event it takes into `ordering_deliveries` (the broker's log),
//! and a trigger notes when each `SENT` is recorded. Then, per order:
//! - every event was delivered, and the first deliveries came in sequence order;
//! - no event was first delivered before its predecessor's `SENT` was recorded, or,
//!   in a run of its key, before its predecessor in the same claim was acknowledged;
//! - a consumer reading the log in delivery order through an [`outbox::Inbox`] applies
//!   each event exactly once, in sequence order, though it sees duplicates (a relay
//!   killed after its sink took a batch, a paused owner's late send).
//!
//! The events are enqueued in waves during the chaos (25 s), as business transactions
//! keep coming. `OUTBOX_ORDERING_CHAOS_KEYS` and `OUTBOX_ORDERING_CHAOS_SECS` make it
//! larger or longer.
//!
//! Every random choice (the driver's, and the relays' sinks' through a seed of their own)
//! comes from one seed, printed at the start and in a failure's message:
//! `OUTBOX_CHAOS_SEED=<seed>` replays that schedule; without it each run draws a fresh seed.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::Signal;
use outbox::Inbox;
use outbox::{CancellationToken, Delivery, Relay, Sink, SinkError, relay::Backoff};
use outbox_testkit::child::{self, Child, ChildCommand};
use outbox_testkit::events::OrderedChaosEvent;
use outbox_testkit::schema::schema_with;
use outbox_testkit::seed::{chaos_seed, replayable};
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::time::{Instant, sleep};

const ROLE: &str = "ordering-relay";
const APP: &str = "ordering-relay-";
/// What a relay child says once a SIGTERM stops it gracefully.
const READY: &str = "relay ready";
const RELAYS: usize = 4;
const PER_KEY: i32 = 20;
/// The hot orders, after the others, and their events each.
const HOT_KEYS: i64 = 4;
const HOT_PER_KEY: i32 = 200;

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A relay process: re-executed by the test, it runs a relay until SIGTERM. A no-op in
/// a normal test run.
#[test]
fn ordering_chaos_child() {
    if !child::requested(ROLE) {
        return;
    }
    let url = child::param("URL").expect("a relay needs a URL");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = runtime.block_on(relay_child(&url));
    drop(runtime);
    std::process::exit(code);
}

async fn relay_child(url: &str) -> i32 {
    let Ok(options) = url.parse::<PgConnectOptions>() else {
        return 2;
    };
    let options = options.application_name(&format!("{APP}{}", std::process::id()));
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options);
    let shutdown = CancellationToken::new();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            terminate.recv().await;
            shutdown.cancel();
        }
    });
    // From here a SIGTERM is a graceful shutdown: before, it ends the process.
    child::say(READY);
    let seed = child::param("SEED").and_then(|seed| seed.parse().ok());
    let mut rng = seed.map_or_else(fastrand::Rng::new, fastrand::Rng::with_seed);
    // Each process its own run length: runs of one event, a few, or a whole batch, cut
    // and continued from batch to batch.
    let run_length = [1, 3, 7, 50][rng.usize(..4)];
    let sink = Broker {
        pool: pool.clone(),
        rng: Mutex::new(rng),
        delivered: Mutex::default(),
    };
    let relay = Relay::<OrderedChaosEvent, _>::new(pool, sink)
        .batch_size(50)
        .run_length(run_length)
        .concurrency(2)
        .poll_interval(Duration::from_millis(200))
        .retry_backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
        .send_timeout(Duration::from_secs(10))
        .shutdown_grace(Duration::from_secs(3));
    match relay.run(shutdown).await {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

/// The broker: slow enough that the relays are busy when chaos strikes (a call takes a
/// few milliseconds, and one or two more per event); takes a batch refusing about one
/// event in twenty (transient), and logs what it took in `ordering_deliveries`, one
/// statement per batch.
///
/// Each logged delivery says whether it came in a run, after its predecessor in the
/// same claim: the predecessor still in flight under the generation this process
/// delivered it with (nobody claimed it since, so this process's claim of it is the
/// one that carries this event too).
struct Broker {
    pool: PgPool,
    /// Its random choices, seeded by the driver.
    rng: Mutex<fastrand::Rng>,
    /// The generation each event this process delivered was delivered with.
    delivered: Mutex<HashMap<String, i64>>,
}

impl Broker {
    fn draw<T>(&self, choose: impl FnOnce(&mut fastrand::Rng) -> T) -> T {
        choose(&mut self.rng.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// For each of `events`, whether it follows its predecessor in a run of this
    /// process's (see [`Broker`]).
    async fn in_run(
        &self,
        events: impl Iterator<Item = &OrderedChaosEvent>,
    ) -> Result<Vec<bool>, sqlx::Error> {
        let previous: Vec<String> = events
            .map(|e| format!("{}-{}", e.order_id, e.seq - 1))
            .collect();
        let flight: HashMap<String, i64> = sqlx::query_as(
            "SELECT event_id, generation FROM ordered_chaos_events
             WHERE event_id = ANY($1) AND status = 'INPROGRESS'",
        )
        .bind(&previous)
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .collect();
        let delivered = self
            .delivered
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Ok(previous
            .iter()
            .map(|p| flight.get(p).is_some_and(|g| delivered.get(p) == Some(g)))
            .collect())
    }
}

impl Sink<OrderedChaosEvent> for Broker {
    async fn publish(
        &self,
        batch: &[Delivery<'_, OrderedChaosEvent>],
    ) -> Vec<Result<(), SinkError>> {
        let events = u64::try_from(batch.len()).unwrap_or(u64::MAX);
        let latency = |rng: &mut fastrand::Rng| rng.u64(2..10) + events * rng.u64(1..3);
        sleep(Duration::from_millis(self.draw(latency))).await;
        let results: Vec<Result<(), SinkError>> = batch
            .iter()
            .map(|_| {
                if self.draw(|rng| rng.u8(0..20)) == 0 {
                    Err(SinkError::transient("the broker refused it"))
                } else {
                    Ok(())
                }
            })
            .collect();
        let taken = || batch.iter().zip(&results).filter(|(_, r)| r.is_ok());
        let ids: Vec<&str> = taken().map(|(d, _)| d.event_id().as_str()).collect();
        let generations: Vec<i64> = taken().map(|(d, _)| d.generation().get()).collect();
        let in_run = match self.in_run(taken().map(|(d, _)| d.event())).await {
            Ok(in_run) => in_run,
            Err(error) => {
                return batch
                    .iter()
                    .map(|_| Err(SinkError::unavailable(error.to_string())))
                    .collect();
            }
        };
        let logged = sqlx::query(
            "INSERT INTO ordering_deliveries (event_id, generation, in_run, delivered_at)
             SELECT id, generation, in_run, clock_timestamp()
             FROM unnest($1::text[], $2::bigint[], $3::bool[]) AS u(id, generation, in_run)",
        )
        .bind(&ids)
        .bind(&generations)
        .bind(in_run)
        .execute(&self.pool)
        .await;
        if logged.is_ok() {
            let mut delivered = self
                .delivered
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (id, generation) in ids.iter().zip(generations) {
                delivered.insert((*id).to_owned(), generation);
            }
        }
        if let Err(error) = logged {
            // Not taken after all: nothing of this batch reached the broker's log.
            return batch
                .iter()
                .map(|_| Err(SinkError::unavailable(error.to_string())))
                .collect();
        }
        // The window in which a kill or a pause leaves a batch sent but not recorded.
        let window = |rng: &mut fastrand::Rng| rng.u64(5..15) + events * rng.u64(1..4);
        sleep(Duration::from_millis(self.draw(window))).await;
        results
    }
}

struct Relays {
    command: ChildCommand,
    url: String,
    children: Vec<Child>,
    /// The run's seed, and the children spawned so far: each child's seed derives from
    /// both.
    seed: u64,
    spawned: u64,
}

impl Relays {
    /// The relays of a run on `url` whose seed is `seed`, started.
    async fn start(url: String, seed: u64) -> Result<Self, String> {
        let mut relays = Relays {
            command: ChildCommand::test("ordering_chaos_child"),
            url,
            children: Vec::new(),
            seed,
            spawned: 0,
        };
        for _ in 0..RELAYS {
            let child = relays.spawn().await?;
            relays.children.push(child);
        }
        Ok(relays)
    }

    /// A relay, once it said it handles SIGTERM: the end of the run sends one, which
    /// would kill a relay restarted just before (on a loaded machine, its start can take
    /// longer than the last events' drain) instead of stopping it.
    async fn spawn(&mut self) -> Result<Child, String> {
        self.spawned += 1;
        let seed = (self.seed ^ self.spawned).to_string();
        let mut child = self
            .command
            .spawn(ROLE, &[("URL", &self.url), ("SEED", &seed)])?;
        child::handshake(child.stderr()?, READY, Duration::from_mins(1)).await?;
        Ok(child)
    }

    async fn kill_and_restart(&mut self, slot: usize) -> Result<(), String> {
        self.children[slot].kill()?;
        self.children[slot] = self.spawn().await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_publish_each_key_in_order_through_kills_pauses_and_terminations() {
    let seed = chaos_seed();
    replayable(seed, four_relays_under_chaos(seed)).await;
}

async fn four_relays_under_chaos(seed: u64) -> TestResult {
    let mut rng = fastrand::Rng::with_seed(seed);
    let keys = i64::try_from(setting("OUTBOX_ORDERING_CHAOS_KEYS", 1_000))?;
    let chaos_for = Duration::from_secs(setting("OUTBOX_ORDERING_CHAOS_SECS", 25));
    let db = schema_with(&[OrderedChaosEvent::migrations()]).await?;
    let pool = db.pool();
    setup(pool).await?;

    let events = orders(keys);
    let total = i64::try_from(events.len())?;
    // The business transactions keep coming while the relays are under chaos: a wave
    // per round of chaos (1.6 s on average), as many waves as 2.1 s rounds would take,
    // so that all of them go out under chaos but in an unlucky run.
    let rounds = usize::try_from(chaos_for.as_secs() * 10 / 21)?.max(1);
    let mut waves = events.chunks(events.len().div_ceil(rounds));

    let mut relays = Relays::start(db.url(), seed).await?;
    let mut actions: HashMap<&str, u32> = HashMap::new();
    let until = Instant::now() + chaos_for;
    // Each kind of chaos in turn, on a relay drawn at random.
    for round in 0.. {
        if Instant::now() >= until {
            break;
        }
        if let Some(wave) = waves.next() {
            OrderedChaosEvent::enqueue_all(wave, pool).await?;
        }
        sleep(Duration::from_millis(rng.u64(300..900))).await;
        let slot = rng.usize(0..RELAYS);
        match round % 3 {
            0 => {
                relays.kill_and_restart(slot).await?;
                *actions.entry("SIGKILL and restart").or_default() += 1;
            }
            1 => {
                // Past the lease (2 s): its rows are taken over while it sleeps.
                relays.children[slot].signal(Signal::SIGSTOP)?;
                sleep(Duration::from_millis(rng.u64(2_500..3_500))).await;
                relays.children[slot].signal(Signal::SIGCONT)?;
                *actions.entry("SIGSTOP past the lease").or_default() += 1;
            }
            _ => {
                let terminated: i64 = sqlx::query_scalar(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                     WHERE application_name = $1",
                )
                .bind(format!("{APP}{}", relays.children[slot].pid()))
                .fetch_one(pool)
                .await?;
                *actions.entry("pg_terminate_backend rounds").or_default() += 1;
                *actions.entry("sessions terminated").or_default() += u32::try_from(terminated)?;
            }
        }
    }
    for kind in [
        "SIGKILL and restart",
        "SIGSTOP past the lease",
        "pg_terminate_backend rounds",
    ] {
        assert!(actions.get(kind) > Some(&0), "no {kind}: {actions:?}");
    }
    let late = waves.len();
    for wave in waves {
        OrderedChaosEvent::enqueue_all(wave, pool).await?;
    }
    wait_until("every event is SENT", Duration::from_mins(3), async || {
        unsent(pool).await.is_ok_and(|n| n == 0)
    })
    .await;
    for child in &relays.children {
        child.signal(Signal::SIGTERM)?;
    }
    for child in &mut relays.children {
        let status = child.wait()?;
        assert!(status.success(), "a relay ended its shutdown with {status}");
    }

    let deliveries = verify_first_deliveries(pool, total).await?;
    let (applied, skipped) = consume(pool).await?;
    let complete: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ordering_effects
         WHERE last_seq = CASE WHEN order_id < $1 THEN $2 ELSE $3 END",
    )
    .bind(keys)
    .bind(PER_KEY - 1)
    .bind(HOT_PER_KEY - 1)
    .fetch_one(pool)
    .await?;
    println!(
        "ordering chaos: {total} events of {keys} orders and {HOT_KEYS} hot ones, {deliveries} deliveries \
         ({} duplicates, skipped by the inbox: {skipped}), {applied} effects applied; \
         {late} of {rounds} waves enqueued after the chaos; {actions:?}",
        deliveries - total
    );
    assert_eq!((applied, complete), (total, keys + HOT_KEYS));
    assert_eq!(skipped, deliveries - total);
    db.drop_schema().await?;
    Ok(())
}

/// The events of `keys` orders and the hot ones after them: orders interleaved, as many
/// customers' orders arrive; each order's events in turn, a hot order's spread over the
/// same waves.
fn orders(keys: i64) -> Vec<OrderedChaosEvent> {
    let steps = move |order_id: i64| {
        if order_id < keys {
            PER_KEY
        } else {
            HOT_PER_KEY
        }
    };
    let mut events: Vec<OrderedChaosEvent> = (0..keys + HOT_KEYS)
        .flat_map(|order_id| {
            (0..steps(order_id)).map(move |seq| OrderedChaosEvent {
                name: format!("{order_id}-{seq}"),
                order_id,
                seq,
            })
        })
        .collect();
    events.sort_by_key(|e| (e.seq * HOT_PER_KEY / steps(e.order_id), e.order_id));
    events
}

/// The broker's log, the trigger that notes each `SENT`, the consumer's effects and inbox.
async fn setup(pool: &PgPool) -> TestResult {
    sqlx::raw_sql(
        "CREATE TABLE ordering_deliveries (
             event_id text NOT NULL, generation bigint NOT NULL, in_run boolean NOT NULL,
             delivered_at timestamptz NOT NULL);
         CREATE TABLE ordering_sent (event_id text NOT NULL, recorded_at timestamptz NOT NULL);
         CREATE FUNCTION note_sent() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO ordering_sent VALUES (NEW.event_id, clock_timestamp()); RETURN NULL; END $$;
         CREATE TRIGGER note_sent AFTER UPDATE OF status ON ordered_chaos_events
             FOR EACH ROW WHEN (NEW.status = 'SENT' AND OLD.status <> 'SENT') EXECUTE FUNCTION note_sent();
         CREATE TABLE ordering_effects (order_id bigint PRIMARY KEY, last_seq integer NOT NULL);",
    )
    .execute(pool)
    .await?;
    outbox::inbox::migrate(pool).await?;
    Ok(())
}

/// Per order, the first deliveries in sequence order, each after its predecessor's `SENT`
/// was recorded. Returns how many deliveries the log holds.
async fn verify_first_deliveries(pool: &PgPool, total: i64) -> TestResult<i64> {
    let (delivered, deliveries): (i64, i64) =
        sqlx::query_as("SELECT count(DISTINCT event_id), count(*) FROM ordering_deliveries")
            .fetch_one(pool)
            .await?;
    assert_eq!(delivered, total, "every event delivered");
    let out_of_order: Vec<String> = sqlx::query_scalar(
        "WITH first AS (
             SELECT DISTINCT ON (d.event_id) d.event_id, e.order_id, e.seq, d.delivered_at
             FROM ordering_deliveries d JOIN ordered_chaos_events e USING (event_id)
             ORDER BY d.event_id, d.delivered_at)
         SELECT event_id || ' first delivered after seq ' || previous FROM (
             SELECT event_id, seq, lag(seq) OVER (PARTITION BY order_id ORDER BY delivered_at, seq) AS previous
             FROM first) o
         WHERE previous IS NOT NULL AND seq <> previous + 1
         LIMIT 10",
    )
    .fetch_all(pool)
    .await?;
    assert!(out_of_order.is_empty(), "{out_of_order:?}");
    // A first delivery comes after its predecessor's SENT, or after the predecessor in
    // the same run (which the broker acknowledged before).
    let early: Vec<String> = sqlx::query_scalar(
        "WITH first AS (
             SELECT DISTINCT ON (event_id) event_id, delivered_at AS at, in_run
             FROM ordering_deliveries ORDER BY event_id, delivered_at),
         sent AS (SELECT event_id, min(recorded_at) AS at FROM ordering_sent GROUP BY event_id)
         SELECT e.event_id FROM ordered_chaos_events e
         JOIN first f ON f.event_id = e.event_id
         JOIN sent s ON s.event_id = e.order_id || '-' || (e.seq - 1)
         WHERE f.at < s.at AND NOT f.in_run
         LIMIT 10",
    )
    .fetch_all(pool)
    .await?;
    assert!(
        early.is_empty(),
        "delivered before the predecessor's SENT, and not after it in a run: {early:?}"
    );
    let (in_runs,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM (SELECT DISTINCT ON (event_id) in_run FROM ordering_deliveries
         ORDER BY event_id, delivered_at) AS f WHERE in_run",
    )
    .fetch_one(pool)
    .await?;
    assert!(in_runs > 0, "the relays claimed runs of a key");

    Ok(deliveries)
}

/// The consumer: the log in delivery order, through the inbox, 500 messages per
/// transaction; each effect must be its order's next step. Returns (applied, skipped).
async fn consume(pool: &PgPool) -> TestResult<(i64, i64)> {
    let log: Vec<(String, i64, i32)> = sqlx::query_as(
        "SELECT d.event_id, e.order_id, e.seq FROM ordering_deliveries d
         JOIN ordered_chaos_events e USING (event_id) ORDER BY d.delivered_at",
    )
    .fetch_all(pool)
    .await?;
    let inbox = Inbox::new("ordering-chaos");
    let (mut applied, mut skipped) = (0_i64, 0_i64);
    for page in log.chunks(500) {
        let mut tx = pool.begin().await?;
        for (event_id, order_id, seq) in page {
            if !inbox.receive(&mut tx, event_id).await?.is_new() {
                skipped += 1;
                continue;
            }
            // The order's first step creates its row; every later one moves it on by one.
            let effect = if *seq == 0 {
                "INSERT INTO ordering_effects VALUES ($1, $2) ON CONFLICT DO NOTHING"
            } else {
                "UPDATE ordering_effects SET last_seq = $2 WHERE order_id = $1 AND last_seq = $2 - 1"
            };
            let stepped = sqlx::query(effect)
                .bind(order_id)
                .bind(seq)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            assert_eq!(stepped, 1, "{event_id} applied out of order");
            applied += 1;
        }
        tx.commit().await?;
    }
    Ok((applied, skipped))
}

async fn unsent(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM ordered_chaos_events WHERE status <> 'SENT'")
        .fetch_one(pool)
        .await
}
