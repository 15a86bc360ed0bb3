//! The `wakeups` section: how many claim statements a relay spends per batch it
//! publishes, and how long an event waits from its enqueue to its publication, at steady
//! offered loads of one event per transaction (each transaction notifies the relay).
//!
//! ```text
//! cargo run --release --example bench -- --only wakeups --wakeup-rates 500,5000
//! ```
//!
//! Claim statements are counted by `pg_stat_statements` when the server has it loaded
//! (`shared_preload_libraries = 'pg_stat_statements'`); otherwise only latencies are
//! reported.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use outbox::CancellationToken;
use outbox::Relay;
use tokio::time::MissedTickBehavior;

use super::pinned::CLAIM_PREFIXES;
use super::{Args, Bench, BenchEvent, LatencySink, Result, stamped};

const WORKERS: usize = 4;
const PRODUCERS: u32 = 8;
const WARM_UP: Duration = Duration::from_secs(3);
const MEASURED: Duration = Duration::from_secs(20);

impl Bench {
    /// A relay and producers at each of `--wakeup-rates`: claim statements per published
    /// batch, and enqueue → publish latency.
    pub(super) async fn wakeups(&self, args: &Args) -> Result {
        self.heading("Wake-ups: claim statements per published batch at an offered load");
        let statements = self.extension("pg_stat_statements").await;
        self.line(&format!(
            "One event per transaction (each notifies), {PRODUCERS} producers, a relay with \
             {WORKERS} workers (batch 100) and a no-op sink, {} s measured after a {} s \
             warm-up. Claim statements are `pg_stat_statements` calls of the claims{}; \
             batches are the sink's publish calls.\n",
            MEASURED.as_secs(),
            WARM_UP.as_secs(),
            if statements.is_some() {
                ""
            } else {
                " (unavailable here: n/a)"
            },
        ));
        self.line(
            "| offered events/s | achieved events/s | claim statements per published batch | enqueue → publish p50 | p99 |",
        );
        self.line("|---|---|---|---|---|");
        for &rate in &args.wakeup_rates {
            let row = self.wakeups_at(rate, statements.as_deref()).await?;
            self.line(&row);
        }
        Ok(())
    }

    /// One offered rate: a relay, producers, and what they did while measured.
    async fn wakeups_at(&self, rate: u32, statements: Option<&str>) -> Result<String> {
        self.reset().await?;
        let relay_pool = self.pool(WORKERS + 1).await?;
        let producer_pool = self.pool(PRODUCERS as usize).await?;
        let sink = LatencySink::default();
        let (latencies, batches) = (Arc::clone(&sink.latencies), Arc::clone(&sink.batches));
        let stop = CancellationToken::new();
        let relay = tokio::spawn(
            Relay::<BenchEvent, _>::new(relay_pool.clone(), sink)
                .batch_size(100)
                .concurrency(WORKERS)
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
        let batches_before = batches.load(Ordering::Relaxed);
        let claims_before = self.claim_statements(statements).await?;
        tokio::time::sleep(MEASURED).await;
        let claims = self.claim_statements(statements).await?;
        let published_batches = batches.load(Ordering::Relaxed) - batches_before;
        let mut taken =
            std::mem::take(&mut *latencies.lock().unwrap_or_else(PoisonError::into_inner));
        stop.cancel();
        for producer in producers {
            producer.await??;
        }
        relay.await??;
        relay_pool.close().await;
        producer_pool.close().await;

        taken.sort_unstable();
        let percentile = |p: usize| taken.get(taken.len().saturating_sub(1) * p / 100).copied();
        let ms = |micros: Option<u32>| {
            micros.map_or("-".to_owned(), |m| format!("{:.1} ms", f64::from(m) / 1e3))
        };
        let per_batch = match claims.zip(claims_before) {
            Some((after, before)) if published_batches > 0 => {
                format!("{:.2}", (after - before) as f64 / published_batches as f64)
            }
            _ => "n/a".to_owned(),
        };
        Ok(format!(
            "| {rate} | {:.0} | {per_batch} | {} | {} |",
            taken.len() as f64 / MEASURED.as_secs_f64(),
            ms(percentile(50)),
            ms(percentile(99)),
        ))
    }

    /// Claim statements run so far on the server, by `pg_stat_statements` in `schema`
    /// (its statistics are flushed at most every second: wait for them).
    async fn claim_statements(&self, schema: Option<&str>) -> Result<Option<i64>> {
        let Some(schema) = schema else {
            return Ok(None);
        };
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        Ok(Some(
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT coalesce(sum(calls), 0)::bigint FROM {schema}.pg_stat_statements \
                 WHERE query LIKE '{}%' OR query LIKE '{}%'",
                CLAIM_PREFIXES[0], CLAIM_PREFIXES[1]
            )))
            .fetch_one(&self.pool)
            .await?,
        ))
    }
}
