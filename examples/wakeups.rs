//! How many claim statements a relay spends per batch it publishes, and how long an
//! event waits from its enqueue to its publication, at a steady offered load of one
//! event per transaction (each transaction notifies the relay).
//!
//! ```text
//! DATABASE_URL=postgres://.. cargo run --release --example wakeups -- 500 5000
//! ```
//!
//! Claim statements are counted by `pg_stat_statements` when the server has it loaded
//! (`shared_preload_libraries = 'pg_stat_statements'`); otherwise only latencies are
//! reported. Each rate runs for 20 s after a 3 s warm-up, with 4 relay workers
//! (batch 100) and 8 producers.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use common::BenchEvent;
use outbox::relay::{CancellationToken, Delivery, Relay, Sink, SinkError};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

type Result<T = (), E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

const PRODUCERS: u64 = 8;
const WARM_UP: Duration = Duration::from_secs(3);
const MEASURED: Duration = Duration::from_secs(20);

#[tokio::main]
async fn main() -> Result {
    let rates: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<std::result::Result<_, _>>()?;
    let rates = if rates.is_empty() {
        vec![500, 5000]
    } else {
        rates
    };
    let schema = outbox::testing::TestSchema::new().await?;
    let pool = schema.connect(20).await?;
    outbox::migrate(&pool, &[BenchEvent::migrations()]).await?;
    let statements = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .is_ok()
        && sqlx::query("SELECT pg_stat_statements_reset()")
            .execute(&pool)
            .await
            .is_ok();
    println!(
        "| offered events/s | achieved events/s | claim statements per published batch | enqueue → publish p50 | p99 |"
    );
    println!("|---|---|---|---|---|");
    for rate in rates {
        let row = measure(&pool, rate, statements).await?;
        println!("{row}");
    }
    pool.close().await;
    schema.drop_schema().await?;
    Ok(())
}

/// One offered rate: a relay, producers, and what they did while measured.
#[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
async fn measure(pool: &PgPool, rate: u64, statements: bool) -> Result<String> {
    sqlx::query("TRUNCATE bench_events").execute(pool).await?;
    let relay_pool = PgPoolOptions::new()
        .max_connections(5)
        .connect_with(pool.connect_options().as_ref().clone())
        .await?;
    let sink = LatencySink::default();
    let (latencies, batches) = (Arc::clone(&sink.latencies), Arc::clone(&sink.batches));
    let stop = CancellationToken::new();
    let relay = tokio::spawn(
        Relay::<BenchEvent, _>::new(relay_pool.clone(), sink)
            .batch_size(100)
            .concurrency(4)
            .run(stop.clone()),
    );
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|_| {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval(Duration::from_micros(1_000_000 * PRODUCERS / rate));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
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
    let batches_before = batches.load(Ordering::Relaxed);
    let claims_before = claim_statements(pool, statements).await?;
    tokio::time::sleep(MEASURED).await;
    let claims = claim_statements(pool, statements).await? - claims_before;
    let published_batches = batches.load(Ordering::Relaxed) - batches_before;
    let mut taken = std::mem::take(&mut *latencies.lock().unwrap_or_else(PoisonError::into_inner));
    stop.cancel();
    for producer in producers {
        producer.await??;
    }
    relay.await??;
    relay_pool.close().await;

    taken.sort_unstable();
    let percentile = |p: usize| taken.get(taken.len().saturating_sub(1) * p / 100).copied();
    let ms = |micros: Option<u64>| {
        micros.map_or("-".to_owned(), |m| format!("{:.1} ms", m as f64 / 1e3))
    };
    let per_batch = if statements && published_batches > 0 {
        format!("{:.2}", claims as f64 / published_batches as f64)
    } else {
        "n/a".to_owned()
    };
    Ok(format!(
        "| {rate} | {:.0} | {per_batch} | {} | {} |",
        taken.len() as f64 / MEASURED.as_secs_f64(),
        ms(percentile(50)),
        ms(percentile(99)),
    ))
}

/// Claim statements run so far, by `pg_stat_statements` (statistics are flushed at most
/// every second: wait for them).
async fn claim_statements(pool: &PgPool, available: bool) -> Result<i64> {
    if !available {
        return Ok(0);
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
         WHERE query LIKE 'WITH expired AS%' OR query LIKE 'WITH ready AS%'",
    )
    .fetch_one(pool)
    .await?)
}

fn micros_now() -> u64 {
    let since_epoch = std::time::SystemTime::UNIX_EPOCH
        .elapsed()
        .unwrap_or_default();
    u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX)
}

/// An event whose payload is its enqueue time.
fn stamped() -> BenchEvent {
    BenchEvent {
        payload: format!("{:0>100}", micros_now()),
    }
}

/// A sink that publishes nowhere, counts batches, and keeps each event's wait.
#[derive(Default)]
struct LatencySink {
    latencies: Arc<Mutex<Vec<u64>>>,
    batches: Arc<AtomicU64>,
}

impl Sink<BenchEvent> for LatencySink {
    async fn publish(
        &self,
        batch: &[Delivery<'_, BenchEvent>],
    ) -> Vec<std::result::Result<(), SinkError>> {
        let now = micros_now();
        self.batches.fetch_add(1, Ordering::Relaxed);
        let mut latencies = self
            .latencies
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        batch
            .iter()
            .map(|d| {
                let enqueued: u64 = d.event().payload.parse().map_err(SinkError::permanent)?;
                latencies.push(now.saturating_sub(enqueued));
                Ok(())
            })
            .collect()
    }
}
