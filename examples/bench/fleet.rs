//! The `fleet` section: one relay fleet serving many databases, against a relay per
//! database, on a throwaway cluster of its own (its `max_connections` raised to 1,000)
//! holding `--fleet-databases` databases with an outbox table each.
//!
//! ```text
//! cargo run --release --example bench -- --only fleet --fleet-databases 200
//! ```
//!
//! - **idle**: every outbox empty; the server's CPU (its process tree) and the client
//!   connections it holds, once the pools settled;
//! - **a trickle**: one event per second into every database; enqueue → publish p50/p99;
//! - **one hot database**: a backlog drained in one database while the trickle goes on in
//!   the others; its rate against a relay of its own.

use std::sync::PoisonError;
use std::time::Duration;

use outbox::fleet::{self, Fleet, Target};
use outbox::testing::Cluster;
use outbox::{CancellationToken, Outbox, Relay};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior, sleep};

use super::cpu::{Cpu, postmaster};
use super::{Args, Bench, BenchEvent, Figure, LatencySink, Result, stamped};

/// Fleet members (tasks of this process, each with its own connection budget).
const MEMBERS: usize = 2;
/// Long enough for the pools to close what they do not use (30 s idle) after the start.
const SETTLE: Duration = Duration::from_secs(45);
const IDLE_MEASURED: Duration = Duration::from_secs(30);
const TRICKLE_MEASURED: Duration = Duration::from_secs(30);
/// The hot database's offered load, for how long, from how many connections.
const HOT_RATE: u32 = 5_000;
const HOT_FOR: Duration = Duration::from_secs(10);
const HOT_PRODUCERS: u32 = 8;
/// Hot runs of each side.
const HOT_RUNS: usize = 3;
/// The fleet's relays' poll interval in the idle row that weighs the polls.
const SLOW_POLL: Duration = Duration::from_secs(20);

impl Bench {
    pub(super) async fn fleet(&self, args: &Args) -> Result {
        let databases = args.fleet_databases as usize;
        self.heading("A relay fleet for many databases");
        let (cluster, admin, home, targets) = cluster_of(databases).await?;
        let server = postmaster(&admin).await;
        self.line(&format!(
            "{databases} databases on a throwaway cluster of this machine (max_connections \
             1,000, autovacuum off), a `bench_events` table each. Fleet: {MEMBERS} members \
             of this process, each with a budget of {} connections (2 per target), leases \
             of 15 s; single relays: one per database, a pool of 2. Every relay: batch \
             100, one worker, its `LISTEN`, polling every 5 s unless the row says \
             otherwise. Idle: the server's process tree's CPU over {} s, in % of one \
             core, after {} s for the pools to settle. Trickle: one event per second into \
             every database for {} s. Hot: {HOT_RATE} events/s offered to one database for \
             {} s (one per transaction, {HOT_PRODUCERS} connections) while the others \
             trickle, events/s published from the first enqueue to the last publication; \
             the fleet and a dedicated relay in turn, {HOT_RUNS} times each, medians.\n",
            databases + 20,
            IDLE_MEASURED.as_secs(),
            SETTLE.as_secs(),
            TRICKLE_MEASURED.as_secs(),
            HOT_FOR.as_secs(),
        ));

        let alone = self.idle(&admin, server, Duration::ZERO).await?;

        let sink = LatencySink::default();
        let stop = CancellationToken::new();
        let members = start_fleet(&home, &targets, &sink, &stop, Duration::from_secs(5)).await?;
        let fleet_idle = self.idle(&admin, server, SETTLE).await?;
        let fleet_trickle = trickle(&targets, &sink).await?;
        stop_all(&stop, members).await?;

        // Its relays polling every 20 s (under the pools' 30 s idle timeout, so that each
        // poll finds its connection open): what the polls cost.
        let stop = CancellationToken::new();
        let members = start_fleet(&home, &targets, &sink, &stop, SLOW_POLL).await?;
        let slow_idle = self.idle(&admin, server, SETTLE).await?;
        stop_all(&stop, members).await?;

        let (relays_idle, relays_trickle) = self.relays(&admin, server, &targets).await?;

        let hot = hot_runs(&home, &targets, &sink).await?;
        let ratios: Vec<f64> = hot
            .fleet
            .iter()
            .zip(&hot.dedicated)
            .map(|(fleet, dedicated)| fleet / dedicated)
            .collect();

        self.line("| | server CPU idle | client connections idle | trickle enqueue → publish p50 | p99 | hot database events/s |");
        self.line("|---|---|---|---|---|---|");
        let row = |name: &str,
                   idle: (Option<f64>, i64),
                   trickle: Option<(Option<u32>, Option<u32>)>,
                   hot: Option<f64>| {
            let (p50, p99) = trickle.map_or_else(
                || (String::new(), String::new()),
                |(p50, p99)| (ms(p50), ms(p99)),
            );
            format!(
                "| {name} | {} | {} | {p50} | {p99} | {} |",
                percent(idle.0),
                idle.1,
                hot.map_or_else(String::new, |h| format!("{h:.0}"))
            )
        };
        self.line(&row("the server alone (no relay)", alone, None, None));
        self.line(&row(
            "fleet, relays polling every 5 s",
            fleet_idle,
            Some(fleet_trickle),
            Some(median(&hot.fleet)),
        ));
        self.line(&row(
            &format!(
                "fleet, relays polling every {} s (its default)",
                SLOW_POLL.as_secs()
            ),
            slow_idle,
            None,
            None,
        ));
        self.line(&row(
            "a relay per database",
            relays_idle,
            Some(relays_trickle),
            Some(median(&hot.dedicated)),
        ));
        self.line(&format!(
            "\nHot database, fleet / its own relay: {}; events/s of each \
             run, fleet: {}; its own relay: {}; the hot events' enqueue → publish p99, \
             fleet: {}; its own relay: {}.\n",
            Figure::of(ratios.clone()).ratio(),
            rates(&hot.fleet),
            rates(&hot.dedicated),
            latencies(&hot.fleet_p99),
            latencies(&hot.dedicated_p99),
        ));
        home.close().await;
        admin.close().await;
        drop(cluster);
        Ok(())
    }

    /// A relay per database: idle, then the trickle.
    async fn relays(
        &self,
        admin: &PgPool,
        server: Option<u32>,
        targets: &[Target],
    ) -> Result<((Option<f64>, i64), (Option<u32>, Option<u32>))> {
        let sink = LatencySink::default();
        let stop = CancellationToken::new();
        let mut relays = JoinSet::new();
        let mut pools = Vec::new();
        for target in targets {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .min_connections(0)
                .idle_timeout(Duration::from_secs(30))
                .connect_lazy_with(target.options().clone());
            pools.push(pool.clone());
            relays.spawn(Relay::<BenchEvent, _>::new(pool, sink.clone()).run(stop.clone()));
        }
        let idle = self.idle(admin, server, SETTLE).await?;
        let latencies = trickle(targets, &sink).await?;
        stop.cancel();
        while let Some(relay) = relays.join_next().await {
            relay??;
        }
        for pool in pools {
            pool.close().await;
        }

        Ok((idle, latencies))
    }

    /// After `settle` (for the pools to close what they do not use): the server's CPU
    /// (cores) and its client connections other than the bench's own.
    async fn idle(
        &self,
        admin: &PgPool,
        server: Option<u32>,
        settle: Duration,
    ) -> Result<(Option<f64>, i64)> {
        sleep(settle).await;
        let before = Cpu::now(server);
        sleep(IDLE_MEASURED).await;
        let after = Cpu::now(server);
        let connections: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'
             AND application_name NOT LIKE 'bench-%'",
        )
        .fetch_one(admin)
        .await?;
        Ok((
            after.server_cores(&before, IDLE_MEASURED.as_secs_f64()),
            connections,
        ))
    }
}

/// A throwaway cluster (autovacuum off: its workers visiting every database, and the
/// hot one's dead rows, would land in whichever idle window came next) with
/// `databases` databases: its admin pool, the fleet's home, and the targets.
async fn cluster_of(databases: usize) -> Result<(Cluster, PgPool, PgPool, Vec<Target>)> {
    let mut cluster = Cluster::start().await?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(cluster.url())
        .await?;
    for setting in ["max_connections = 1000", "autovacuum = off"] {
        sqlx::raw_sql(AssertSqlSafe(format!("ALTER SYSTEM SET {setting}")))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    cluster.restart().await?;
    let base: PgConnectOptions = cluster.url().parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(base.clone().application_name("bench-admin"))
        .await?;
    let targets = create_databases(&admin, &base, databases).await?;
    let home = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(base.clone().application_name("bench-home"))
        .await?;
    fleet::migrate(&home).await?;
    Ok((cluster, admin, home, targets))
}

/// The hot database's runs, the fleet's and its own relay's.
struct Hot {
    fleet: Vec<f64>,
    dedicated: Vec<f64>,
    fleet_p99: Vec<Option<u32>>,
    dedicated_p99: Vec<Option<u32>>,
}

/// [`HOT_RUNS`] runs of [`hot_load`] on the first target: the fleet serving every
/// target, then the target's own relay, in turn.
async fn hot_runs(home: &PgPool, targets: &[Target], sink: &LatencySink) -> Result<Hot> {
    let (mut fleet_hot, mut dedicated_hot) = (Vec::new(), Vec::new());
    let (mut fleet_p99, mut dedicated_p99) = (Vec::new(), Vec::new());
    let hot_sink = LatencySink::default();
    for _ in 0..HOT_RUNS {
        let stop = CancellationToken::new();
        let members = start_fleet_with(
            home,
            targets,
            sink,
            &hot_sink,
            &stop,
            Duration::from_secs(5),
        )
        .await?;
        let (rate, p99) = hot_load(&targets[0], &targets[1..], &hot_sink).await?;
        fleet_hot.push(rate);
        fleet_p99.push(p99);
        stop_all(&stop, members).await?;

        let stop = CancellationToken::new();
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(targets[0].options().clone());
        let relay = tokio::spawn(
            Relay::<BenchEvent, _>::new(pool.clone(), hot_sink.clone()).run(stop.clone()),
        );
        let (rate, p99) = hot_load(&targets[0], &targets[1..], &hot_sink).await?;
        dedicated_hot.push(rate);
        dedicated_p99.push(p99);
        stop.cancel();
        relay.await??;
        pool.close().await;
    }
    Ok(Hot {
        fleet: fleet_hot,
        dedicated: dedicated_hot,
        fleet_p99,
        dedicated_p99,
    })
}

/// Starts [`MEMBERS`] fleet members serving `targets`, their relays polling every
/// `poll`, and waits until every target is served.
async fn start_fleet(
    home: &PgPool,
    targets: &[Target],
    sink: &LatencySink,
    stop: &CancellationToken,
    poll: Duration,
) -> Result<JoinSet<std::result::Result<(), outbox::OutboxError>>> {
    start_fleet_with(home, targets, sink, sink, stop, poll).await
}

/// [`start_fleet`], the first target publishing through `first_sink`.
async fn start_fleet_with(
    home: &PgPool,
    targets: &[Target],
    sink: &LatencySink,
    first_sink: &LatencySink,
    stop: &CancellationToken,
    poll: Duration,
) -> Result<JoinSet<std::result::Result<(), outbox::OutboxError>>> {
    let mut members = JoinSet::new();
    for _ in 0..MEMBERS {
        let (sink, first_sink) = (sink.clone(), first_sink.clone());
        let first = targets[0].name().to_owned();
        members.spawn(
            Fleet::<BenchEvent, _>::with_sinks(home.clone(), move |target| {
                if target.name() == first {
                    first_sink.clone()
                } else {
                    sink.clone()
                }
            })
            .targets(targets.to_vec())
            .max_connections(u32::try_from(targets.len() + 20).unwrap_or(u32::MAX))
            .relay(move |relay| relay.poll_interval(poll))
            .run(stop.clone()),
        );
    }
    let started = Instant::now();
    loop {
        let served = fleet::assignments(home, BenchEvent::SPEC.table())
            .await?
            .iter()
            .filter(|a| a.owner.is_some())
            .count();
        if served == targets.len() {
            return Ok(members);
        }
        if started.elapsed() > Duration::from_mins(2) {
            return Err(format!(
                "the fleet served {served} of {} databases after 2 minutes",
                targets.len()
            )
            .into());
        }
        sleep(Duration::from_millis(200)).await;
    }
}

async fn stop_all(
    stop: &CancellationToken,
    mut members: JoinSet<std::result::Result<(), outbox::OutboxError>>,
) -> Result {
    stop.cancel();
    while let Some(member) = members.join_next().await {
        member??;
    }
    Ok(())
}

/// `n` databases made from one template with the outbox table (a file copy each).
async fn create_databases(
    admin: &PgPool,
    base: &PgConnectOptions,
    n: usize,
) -> Result<Vec<Target>> {
    sqlx::query("CREATE DATABASE fleet_template")
        .execute(admin)
        .await?;
    let template = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(base.clone().database("fleet_template"))
        .await?;
    outbox::migrate(&template, &[BenchEvent::migrations()]).await?;
    template.close().await;
    let mut targets = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("tenant_{i}");
        sqlx::query(AssertSqlSafe(format!(
            "CREATE DATABASE {name} TEMPLATE fleet_template STRATEGY FILE_COPY"
        )))
        .execute(admin)
        .await?;
        targets.push(Target::new(name.clone(), base.clone().database(&name)));
    }
    Ok(targets)
}

/// One event per second into every database for a while (spread evenly), and the
/// enqueue → publish p50 and p99 of what was published meanwhile (µs).
async fn trickle(targets: &[Target], sink: &LatencySink) -> Result<(Option<u32>, Option<u32>)> {
    let pools: Vec<PgPool> = targets
        .iter()
        .map(|t| {
            PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy_with(t.options().clone().application_name("bench-producer"))
        })
        .collect();
    let period = Duration::from_secs(1) / u32::try_from(pools.len()).unwrap_or(1);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // A warm-up round, then measured.
    for pool in &pools {
        tick.tick().await;
        stamped().enqueue(pool).await?;
    }
    sleep(Duration::from_secs(1)).await;
    sink.latencies
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    let until = Instant::now() + TRICKLE_MEASURED;
    'trickle: loop {
        for pool in &pools {
            if Instant::now() >= until {
                break 'trickle;
            }
            tick.tick().await;
            stamped().enqueue(pool).await?;
        }
    }
    sleep(Duration::from_secs(1)).await;
    let mut taken = std::mem::take(
        &mut *sink
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    for pool in pools {
        pool.close().await;
    }
    taken.sort_unstable();
    let percentile = |p: usize| taken.get(taken.len().saturating_sub(1) * p / 100).copied();
    Ok((percentile(50), percentile(99)))
}

/// Offers [`HOT_RATE`] events/s to `hot` for [`HOT_FOR`] (one event per transaction,
/// [`HOT_PRODUCERS`] connections) while one event per second goes into each of
/// `others`: the events/s published, from the first enqueue to the last publication,
/// and the enqueue → publish p99 of `hot`'s events (`hot_sink`'s, µs).
async fn hot_load(
    hot: &Target,
    others: &[Target],
    hot_sink: &LatencySink,
) -> Result<(f64, Option<u32>)> {
    let stop = CancellationToken::new();
    let light = tokio::spawn({
        let others: Vec<Target> = others.to_vec();
        let stop = stop.clone();
        async move {
            let sink = LatencySink::default();
            tokio::select! {
                result = async { loop { trickle(&others, &sink).await?; } } => result,
                () = stop.cancelled() => Ok::<(), Box<dyn std::error::Error + Send + Sync>>(()),
            }
        }
    });
    let pool = PgPoolOptions::new()
        .max_connections(HOT_PRODUCERS)
        .connect_with(hot.options().clone().application_name("bench-hot"))
        .await?;
    hot_sink
        .latencies
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    let started = Instant::now();
    let period = Duration::from_secs(1) * HOT_PRODUCERS / HOT_RATE;
    let mut producers = JoinSet::new();
    for _ in 0..HOT_PRODUCERS {
        let pool = pool.clone();
        producers.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
            let mut enqueued = 0_usize;
            while started.elapsed() < HOT_FOR {
                tick.tick().await;
                stamped().enqueue(&pool).await?;
                enqueued += 1;
            }
            Ok::<_, outbox::OutboxError>(enqueued)
        });
    }
    let mut enqueued = 0;
    while let Some(produced) = producers.join_next().await {
        enqueued += produced??;
    }
    let published = || {
        hot_sink
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    };
    while published() < enqueued && started.elapsed() < HOT_FOR * 4 {
        sleep(Duration::from_millis(10)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let _ = light.await;
    // Autovacuum is off: the next run starts from a table without dead rows.
    sqlx::query("TRUNCATE bench_events").execute(&pool).await?;
    pool.close().await;
    let mut taken = std::mem::take(
        &mut *hot_sink
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner),
    );
    taken.sort_unstable();
    let p99 = taken.get(taken.len().saturating_sub(1) * 99 / 100).copied();
    #[allow(clippy::cast_precision_loss)]
    Ok((taken.len() as f64 / seconds, p99))
}

fn percent(cores: Option<f64>) -> String {
    cores.map_or_else(|| "n/a".into(), |c| format!("{:.2}%", c * 100.0))
}

fn ms(micros: Option<u32>) -> String {
    micros.map_or_else(
        || "n/a".into(),
        |m| format!("{:.1} ms", f64::from(m) / 1000.0),
    )
}

fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    Figure::of(values.to_vec()).median
}

fn rates(values: &[f64]) -> String {
    values
        .iter()
        .map(|rate| format!("{rate:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn latencies(values: &[Option<u32>]) -> String {
    values.iter().map(|p| ms(*p)).collect::<Vec<_>>().join(", ")
}
