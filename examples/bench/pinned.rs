//! The `pinned` section: what a held-back xmin horizon costs the relay, measured.
//!
//! ```text
//! cargo run --release --example bench -- --only pinned                 # 10-minute pin, 1,000 events/s
//! cargo run --release --example bench -- --only pinned --pin 2m --rate 500
//! ```
//!
//! A transaction that keeps a snapshot (an idle-in-transaction session, a long report, a
//! standby with `hot_standby_feedback`) keeps every row version the relay's claims and
//! outcomes leave behind, and the claim's index scans step over all of them on every
//! claim: the dead READY versions of claimed rows sit at the front of the
//! `(next_attempt_at, id) WHERE status = 'READY'` index, and the dead INPROGRESS versions
//! of completed rows, their leases past, in the expired branch's `(lease_until, id)
//! WHERE status = 'INPROGRESS'` index. This section measures that; it fixes nothing.
//!
//! A relay (batch 100, concurrency 4, a no-op sink that keeps each event's enqueue →
//! publish latency) and producers offering `--rate` events/s, one event per transaction,
//! run through three phases: unpinned (`--pin` / 10, at least 30 s), pinned (a
//! `REPEATABLE READ` transaction that has read the table holds its snapshot for
//! `--pin`; a row per minute), and recovery (60 s after its `COMMIT`). Each row gives
//! throughput, latency, the claim statement's time on the server (`pg_stat_statements`:
//! mean, max, shared buffers per call) and as the relay sees it (p50/p99 of sqlx's
//! statement timing, the round trip included: `pg_stat_statements` keeps no
//! percentiles), dead tuples, the oldest backend xmin's age, and CPU (the whole
//! machine's, shared by client and server, and the postmaster's process tree's).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use outbox::CancellationToken;
use outbox::{Outbox as _, Relay};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions as _, Connection as _};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::field::Visit;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

use super::cpu::Cpu;
use super::{Args, Bench, BenchEvent, LatencySink, Result, stamped};

/// Producer tasks, each with its own connection, sharing the offered rate.
const PRODUCERS: u32 = 8;
const BATCH: u32 = 100;
const WORKERS: usize = 4;
/// Load before the first measured window, so that it starts in a steady state.
const WARM_UP: Duration = Duration::from_secs(10);
/// How long after the pin's `COMMIT` the recovery row is measured.
const RECOVERY: Duration = Duration::from_mins(1);
/// The shortest unpinned phase.
const UNPINNED_AT_LEAST: Duration = Duration::from_secs(30);
/// How the claim statements start (the full claim, the claim from the relay's
/// frontier): what `pg_stat_statements` and sqlx's log show of them.
pub(super) const CLAIM_PREFIXES: [&str; 2] = ["WITH expired AS", "WITH ready AS"];
/// sqlx's statement log: every statement, with its elapsed time.
const QUERY_TARGET: &str = "sqlx::query";

/// `--pin`: seconds (`600`), or amounts with units as humantime writes them (`10m`,
/// `1m30s`, `2h`, `90 s`).
pub(super) fn duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("`{text}` is not a duration: write seconds (600) or 10m, 1m30s, 2h");
    let text = text.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return positive(seconds).ok_or_else(bad);
    }
    let (mut total, mut rest) = (0_u64, text);
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let amount: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = rest[digits..].trim_start();
        let letters = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let unit = match &rest[..letters] {
            "s" | "sec" | "secs" | "second" | "seconds" => 1,
            "m" | "min" | "mins" | "minute" | "minutes" => 60,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3_600,
            _ => return Err(bad()),
        };
        total = amount
            .checked_mul(unit)
            .and_then(|s| total.checked_add(s))
            .ok_or_else(bad)?;
        rest = rest[letters..].trim_start();
    }
    positive(total).ok_or_else(bad)
}

fn positive(seconds: u64) -> Option<Duration> {
    (seconds > 0).then(|| Duration::from_secs(seconds))
}

impl Bench {
    /// Steady load, then a snapshot held for `--pin`, then its release: throughput,
    /// latency and claim cost per minute against the unpinned figures.
    pub(super) async fn pinned(&self, args: &Args) -> Result {
        let unpinned = (args.pin / 10).max(UNPINNED_AT_LEAST);
        self.heading(&format!(
            "7. Pinned horizon: a snapshot held for {} at {} events/s offered",
            show_duration(args.pin),
            args.rate
        ));
        let timed = install_claim_timer();
        self.reset().await?;
        let statements = self.statements().await;
        let postmaster = self.postmaster().await;
        self.line(&format!(
            "Relay: batch {BATCH}, concurrency {WORKERS}, a no-op sink. {PRODUCERS} producers, \
             each on its own connection, offer {} events/s in all, one event per transaction \
             (paced, missed ticks skipped). {} unpinned, then a `REPEATABLE READ` transaction \
             that has read the table holds its snapshot for {}, then `COMMIT` and {} s of \
             recovery. Claim times: the server's from `pg_stat_statements` (mean and max per \
             row; buffers = shared blocks hit + read per call){}; the relay's p50/p99 from \
             sqlx's statement timing (round trip included){}. CPU in cores: the machine's \
             (`/proc/stat`), the postmaster's process tree's{}, this process's (relay, producers, \
             probes), and the rest (other work on the machine: it disturbs the figures).\n",
            args.rate,
            show_duration(unpinned),
            show_duration(args.pin),
            RECOVERY.as_secs(),
            match &statements {
                Some(s) if !s.queryids.is_empty() => "",
                Some(_) => " (every claim text of the server: no query id)",
                None => " (unavailable here: n/a)",
            },
            if timed { "" } else { " (unavailable: n/a)" },
            if postmaster.is_some() {
                ""
            } else {
                " (not on this machine: n/a)"
            },
        ));
        let load = Load::start(self, args.rate).await?;
        let outcome = self
            .pinned_phases(args, unpinned, &load, statements.as_ref(), postmaster)
            .await;
        let stopped = load.stop().await;
        match (outcome, stopped) {
            (Err(error), Err(stop)) => Err(format!("{error} (and stopping: {stop})").into()),
            (outcome, stopped) => outcome.and(stopped),
        }
    }

    async fn pinned_phases(
        &self,
        args: &Args,
        unpinned: Duration,
        load: &Load,
        statements: Option<&Statements>,
        postmaster: Option<u32>,
    ) -> Result {
        let probe = Probe {
            bench: self,
            load,
            statements,
            postmaster,
        };
        probe.wait(WARM_UP).await?;
        self.line(Row::HEADER);
        self.line(Row::RULE);
        let before = probe.measure("unpinned", unpinned).await?;
        self.line(&before.markdown());
        let plan_before = self.explain_claim_buffers().await?;

        let pin = Pin::hold(&self.url).await?;
        let held = probe.pinned_minutes(args.pin).await;
        // The EXPLAIN ran inside the pin: the snapshot is released only now.
        let released = pin.release().await;
        let (minutes, plan_pinned, since_pin) = held?;
        released?;
        let recovery = probe
            .measure(
                &format!("recovery ({} s after COMMIT)", RECOVERY.as_secs()),
                RECOVERY,
            )
            .await?;
        self.line(&recovery.markdown());

        let last = minutes.last().ok_or("the pin measured no minute")?;
        let ratio = |after: Option<f64>, before: Option<f64>| match (after, before) {
            (Some(a), Some(b)) if b > 0.0 => format!("**{:.2}**", a / b),
            _ => "n/a".to_owned(),
        };
        let throughput = last.published / before.published;
        let claim_p99 = last
            .claim_p99
            .zip(before.claim_p99)
            .map(|(after, before)| after / before);
        self.line(&format!(
            "\nEnd of the pin ({}) / unpinned: throughput **{throughput:.2}**, claim p99 (relay) {}, \
             claim mean (server) {}, buffers per claim {}, enqueue → publish p99 {}. \
             The fix's targets: throughput ≥ 0.95 ({}), claim p99 ≤ 2× ({}).",
            last.label,
            ratio(last.claim_p99, before.claim_p99),
            ratio(
                last.server.map(|s| s.mean_ms),
                before.server.map(|s| s.mean_ms)
            ),
            ratio(
                last.server.map(|s| s.buffers),
                before.server.map(|s| s.buffers)
            ),
            ratio(Some(last.publish_p99), Some(before.publish_p99)),
            if throughput >= 0.95 { "met" } else { "missed" },
            match claim_p99 {
                Some(r) if r <= 2.0 => "met",
                Some(_) => "missed",
                None => "n/a",
            },
        ));
        // What the pin leaves behind, per event enqueued while it held: the bytes the
        // table grew by and the dead tuples at its end; and the application's commits
        // (the producers') once it is released, against theirs before it.
        let during = last
            .enqueued_so_far
            .saturating_sub(before.enqueued_so_far)
            .max(1) as f64;
        self.line(&format!(
            "\nPer event enqueued during the pin: the table grew by **{:.0} B** ({:.1} MB to \
             {:.1} MB, indexes included) and held **{:.2}** dead tuples at its end. The \
             application's commits in the {} s after the pin's `COMMIT`: {:.0}/s, **{:.2}** of \
             their unpinned rate.",
            (last.table_bytes - before.table_bytes) as f64 / during,
            before.table_bytes as f64 / 1e6,
            last.table_bytes as f64 / 1e6,
            last.dead as f64 / during,
            RECOVERY.as_secs(),
            recovery.enqueued,
            recovery.enqueued / before.enqueued,
        ));
        if before.enqueued < 0.95 * f64::from(args.rate) {
            self.line(&format!(
                "\nUnpinned, the producers enqueued {:.0} of the {} events/s offered (the machine's \
                 CPU: {} cores busy): what this machine had to spare, not the offer, sets the \
                 unpinned figures.",
                before.enqueued,
                args.rate,
                before
                    .machine
                    .map_or_else(|| "n/a".to_owned(), |c| format!("{c:.2}")),
            ));
        }
        self.line(&format!(
            "\nThe claim's plan (`EXPLAIN (ANALYZE, BUFFERS)` of a claim of 100, rolled back) \
             at the end of the unpinned phase:\n\n```text\n{plan_before}```"
        ));
        self.line(&format!(
            "\nAnd at the end of the pin, before its `COMMIT` ({since_pin}):\n\n```text\n{plan_pinned}```"
        ));
        Ok(())
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of a claim of 100 in a transaction rolled back, the
    /// full claim (a relay's sweep) and one from half a second ago (what a relay claims
    /// between sweeps), and the size of each index of the table (its leaf entries when
    /// `pageinspect` can be had).
    async fn explain_claim_buffers(&self) -> Result<String> {
        let sql = BenchEvent::SPEC.sql();
        let mut tx = self.pool.begin().await?;
        let from: i64 = sqlx::query_scalar(
            "SELECT (extract(epoch FROM statement_timestamp()) * 1e6)::bigint - 500000",
        )
        .fetch_one(&mut *tx)
        .await?;
        let mut lines = vec!["the full claim (a sweep):".to_owned()];
        for (claim, from) in [
            (sql.claim_limited(100, true), None),
            (sql.claim_from_limited(100), Some(from)),
        ] {
            if from.is_some() {
                lines.push("\nthe claim from half a second ago:".to_owned());
            }
            let explain = format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {claim}");
            sqlx::query("SAVEPOINT explain").execute(&mut *tx).await?;
            let explain = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(explain));
            let explain = match from {
                Some(from) => explain.bind(from),
                None => explain,
            };
            lines.extend(explain.fetch_all(&mut *tx).await?);
            sqlx::query("ROLLBACK TO SAVEPOINT explain")
                .execute(&mut *tx)
                .await?;
        }
        tx.rollback().await?;
        let mut out = lines.iter().fold(String::new(), |mut out, l| {
            let _ = writeln!(out, "{l}");
            out
        });
        let _ = writeln!(out, "\nindex: pages, leaf entries (live and dead versions)");
        for (index, pages, entries) in self.index_census().await? {
            let entries = entries.map_or_else(|| "n/a".to_owned(), |e| e.to_string());
            let _ = writeln!(out, "{index}: {pages}, {entries}");
        }
        Ok(out)
    }

    /// Each index of the table: its name, pages, and leaf entries (`pageinspect`'s
    /// `bt_page_stats`, less each leaf's high key), which count the dead versions too.
    async fn index_census(&self) -> Result<Vec<(String, i64, Option<i64>)>> {
        const BLOCK: &str = "current_setting('block_size')::bigint";
        let entries = match self.extension("pageinspect").await {
            Some(schema) => format!(
                "(SELECT coalesce(sum(s.live_items - (s.btpo_next <> 0)::int), 0)::bigint \
                 FROM generate_series(1::bigint, pg_relation_size(c.oid) / {BLOCK} - 1) AS b, \
                      LATERAL {schema}.bt_page_stats(c.oid::regclass::text, b) AS s \
                 WHERE s.type = 'l')"
            ),
            None => "NULL::bigint".to_owned(),
        };
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT c.relname::text, pg_relation_size(c.oid) / {BLOCK}, {entries} \
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE i.indrelid = 'bench_events'::regclass ORDER BY c.relname"
        )))
        .fetch_all(&self.pool)
        .await?)
    }

    /// `pg_stat_statements`, if the server has it loaded, and the claims' query ids.
    async fn statements(&self) -> Option<Statements> {
        let schema = self.extension("pg_stat_statements").await?;
        let sql = BenchEvent::SPEC.sql();
        let mut queryids = Vec::new();
        for (claim, from) in [
            (sql.claim_limited(BATCH, true), None),
            (sql.claim_from_limited(BATCH), Some(0_i64)),
        ] {
            let explain = format!("EXPLAIN (VERBOSE, COSTS OFF) {claim}");
            let explain = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(explain));
            let explain = match from {
                Some(from) => explain.bind(from),
                None => explain,
            };
            let lines = explain.fetch_all(&self.pool).await.ok()?;
            queryids.extend(lines.iter().find_map(|l| {
                l.trim()
                    .strip_prefix("Query Identifier:")
                    .and_then(|id| id.trim().parse::<i64>().ok())
            }));
        }
        Some(Statements { schema, queryids })
    }

    /// The schema of extension `name`, quoted, creating it in the bench's schema (which
    /// is dropped with it) if the database has it nowhere yet.
    pub(super) async fn extension(&self, name: &str) -> Option<String> {
        let find = || {
            sqlx::query_scalar::<_, String>(
                "SELECT format('%I', n.nspname) FROM pg_extension e \
                 JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = $1",
            )
            .bind(name)
            .fetch_optional(&self.pool)
        };
        if let Ok(Some(schema)) = find().await {
            return Some(schema);
        }
        let create = format!("CREATE EXTENSION IF NOT EXISTS {name}");
        if let Err(error) = sqlx::query(sqlx::AssertSqlSafe(create))
            .execute(&self.pool)
            .await
        {
            eprintln!("no {name}: {error}");
            return None;
        }
        find().await.ok().flatten()
    }
}

/// Where `pg_stat_statements` is, and the claims' query ids in it (which depend on the
/// table's oid, so they are this schema's claims alone even when other schemas run
/// claims). Empty when the server computes none.
struct Statements {
    schema: String,
    queryids: Vec<i64>,
}

/// The claim's statistics over a window.
#[derive(Clone, Copy)]
struct ServerClaims {
    mean_ms: f64,
    max_ms: f64,
    buffers: f64,
}

impl Statements {
    async fn reset(&self, bench: &Bench) -> Result {
        let schema = &self.schema;
        if self.queryids.is_empty() {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT {schema}.pg_stat_statements_reset()"
            )))
            .execute(&bench.pool)
            .await?;
        }
        for id in &self.queryids {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT {schema}.pg_stat_statements_reset(0, 0, $1)"
            )))
            .bind(id)
            .execute(&bench.pool)
            .await?;
        }
        Ok(())
    }

    async fn read(&self, bench: &Bench) -> Result<Option<ServerClaims>> {
        let row: (Option<f64>, Option<f64>, Option<f64>) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT sum(total_exec_time) / nullif(sum(calls), 0), max(max_exec_time), \
                        sum(shared_blks_hit + shared_blks_read)::float8 / nullif(sum(calls), 0) \
                 FROM {}.pg_stat_statements \
                 WHERE (query LIKE '{}%' OR query LIKE '{}%') \
                   AND (cardinality($1::bigint[]) = 0 OR queryid = ANY($1))",
                self.schema, CLAIM_PREFIXES[0], CLAIM_PREFIXES[1]
            )))
            .bind(&self.queryids)
            .fetch_one(&bench.pool)
            .await?;
        Ok(match row {
            (Some(mean_ms), Some(max_ms), Some(buffers)) => Some(ServerClaims {
                mean_ms,
                max_ms,
                buffers,
            }),
            _ => None,
        })
    }
}

/// The relay and the producers, running until stopped; dropped, they stop at once.
struct Load {
    stop: CancellationToken,
    relay: Option<JoinHandle<Result>>,
    producers: Vec<JoinHandle<Result>>,
    relay_pool: sqlx::PgPool,
    enqueued: Arc<AtomicU64>,
    latencies: Arc<Mutex<Vec<u32>>>,
    /// Events published so far: the latencies taken.
    published: AtomicU64,
}

impl Load {
    async fn start(bench: &Bench, rate: u32) -> Result<Self> {
        // Workers, the LISTEN session, and one to spare.
        let relay_pool = bench.pool(WORKERS + 2).await?;
        let sink = LatencySink::default();
        let latencies = Arc::clone(&sink.latencies);
        let stop = CancellationToken::new();
        let relay = Relay::<BenchEvent, _>::new(relay_pool.clone(), sink)
            .batch_size(BATCH)
            .concurrency(WORKERS)
            .run(stop.clone());
        let mut load = Self {
            relay: Some(tokio::spawn(async move { Ok(relay.await?) })),
            stop,
            producers: Vec::new(),
            relay_pool,
            enqueued: Arc::default(),
            latencies,
            published: AtomicU64::new(0),
        };
        // Only the relay's statements are timed: the producers' go unlogged.
        let quiet = bench
            .url
            .parse::<PgConnectOptions>()?
            .disable_statement_logging();
        let period = Duration::from_secs(1) * PRODUCERS / rate;
        let first = tokio::time::Instant::now();
        for i in 0..PRODUCERS {
            let mut conn = PgConnection::connect_with(&quiet).await?;
            let (stop, enqueued) = (load.stop.clone(), Arc::clone(&load.enqueued));
            // Staggered, so that the producers' ticks do not come in bursts.
            let start = first + period * i / PRODUCERS;
            load.producers.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval_at(start, period);
                tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
                let produced: Result = async {
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return Ok(()),
                            _ = tick.tick() => {}
                        }
                        stamped().enqueue(&mut conn).await?;
                        enqueued.fetch_add(1, Ordering::Relaxed);
                    }
                }
                .await;
                conn.close().await?;
                produced
            }));
        }
        Ok(load)
    }

    /// An error if the relay or a producer has stopped (its error comes with `stop`).
    fn check(&self) -> Result {
        let relay_done = self.relay.as_ref().is_none_or(JoinHandle::is_finished);
        if relay_done || self.producers.iter().any(JoinHandle::is_finished) {
            return Err("the relay or a producer stopped early".into());
        }
        Ok(())
    }

    /// Enqueue → publish latencies since the last call, in microseconds.
    fn take(&self) -> Vec<u32> {
        let taken = std::mem::take(
            &mut *self
                .latencies
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.published
            .fetch_add(taken.len() as u64, Ordering::Relaxed);
        taken
    }

    /// Stops the producers, then the relay (a minute at most), and returns the first error.
    async fn stop(mut self) -> Result {
        self.stop.cancel();
        let mut outcome = Ok(());
        for producer in std::mem::take(&mut self.producers) {
            outcome = outcome.and(joined(producer).await);
        }
        if let Some(relay) = self.relay.take() {
            let abort = relay.abort_handle();
            let stopped = tokio::time::timeout(Duration::from_mins(1), joined(relay))
                .await
                .unwrap_or_else(|_| {
                    abort.abort();
                    Err("the relay did not stop within a minute".into())
                });
            outcome = outcome.and(stopped);
        }
        self.relay_pool.close().await;
        outcome
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.cancel();
        for task in self.producers.iter().chain(&self.relay) {
            task.abort();
        }
    }
}

async fn joined(task: JoinHandle<Result>) -> Result {
    task.await?
}

/// A session that holds its snapshot: the xmin horizon stays where it began.
struct Pin {
    conn: PgConnection,
}

impl Pin {
    async fn hold(url: &str) -> Result<Self> {
        let options = url.parse::<PgConnectOptions>()?.disable_statement_logging();
        let mut conn = PgConnection::connect_with(&options).await?;
        sqlx::raw_sql("SET idle_in_transaction_session_timeout = 0; SET statement_timeout = 0")
            .execute(&mut conn)
            .await?;
        sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut conn)
            .await?;
        // The first statement takes the snapshot, which the transaction keeps.
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_events")
            .fetch_one(&mut conn)
            .await?;
        Ok(Self { conn })
    }

    /// `COMMIT`, then the session closed (also when the commit fails: dropping it closes
    /// the socket, and the server ends the transaction).
    async fn release(mut self) -> Result {
        sqlx::raw_sql("COMMIT").execute(&mut self.conn).await?;
        self.conn.close().await?;
        Ok(())
    }
}

/// What a window is measured with.
struct Probe<'a> {
    bench: &'a Bench,
    load: &'a Load,
    statements: Option<&'a Statements>,
    postmaster: Option<u32>,
}

/// Counters at the start of a window.
struct Mark {
    at: Instant,
    enqueued: u64,
    cpu: Cpu,
}

impl Probe<'_> {
    /// Sleeps for `span`, checking every second that the load still runs.
    async fn wait(&self, span: Duration) -> Result {
        let until = tokio::time::Instant::now() + span;
        while tokio::time::Instant::now() < until {
            self.load.check()?;
            tokio::time::sleep_until(
                until.min(tokio::time::Instant::now() + Duration::from_secs(1)),
            )
            .await;
        }
        self.load.check()
    }

    async fn mark(&self) -> Result<Mark> {
        self.load.take();
        claim_times();
        if let Some(statements) = self.statements
            && let Err(error) = statements.reset(self.bench).await
        {
            eprintln!("pg_stat_statements_reset: {error}");
        }
        Ok(Mark {
            at: Instant::now(),
            enqueued: self.load.enqueued.load(Ordering::Relaxed),
            cpu: Cpu::now(self.postmaster),
        })
    }

    /// A row measured over the next `span`.
    async fn measure(&self, label: &str, span: Duration) -> Result<Row> {
        let mark = self.mark().await?;
        self.wait(span).await?;
        self.row(label, &mark).await
    }

    /// A row per minute of the pin (the last one shorter if the pin is not whole
    /// minutes), then the claim's plan before the pin is released.
    async fn pinned_minutes(&self, pin: Duration) -> Result<(Vec<Row>, String, String)> {
        let started = Instant::now();
        self.load.take();
        let (enqueued, published) = (
            self.load.enqueued.load(Ordering::Relaxed),
            self.load.published.load(Ordering::Relaxed),
        );
        let mut rows = Vec::new();
        let (mut minute, mut left) = (0, pin);
        while !left.is_zero() {
            minute += 1;
            let span = left.min(Duration::from_mins(1));
            left -= span;
            let row = self
                .measure(&format!("pinned, minute {minute}"), span)
                .await?;
            self.bench.line(&row.markdown());
            rows.push(row);
        }
        self.load.take();
        let since_pin = format!(
            "{} s into it: {} events enqueued and {} published since it began",
            started.elapsed().as_secs(),
            self.load.enqueued.load(Ordering::Relaxed) - enqueued,
            self.load.published.load(Ordering::Relaxed) - published,
        );
        let plan = self.bench.explain_claim_buffers().await?;
        Ok((rows, plan, since_pin))
    }

    async fn row(&self, label: &str, mark: &Mark) -> Result<Row> {
        let mut latencies = self.load.take();
        let cpu = Cpu::now(self.postmaster);
        let seconds = mark.at.elapsed().as_secs_f64();
        let enqueued = self.load.enqueued.load(Ordering::Relaxed);
        let mut claims = claim_times();
        let server = match self.statements {
            Some(statements) => statements.read(self.bench).await.unwrap_or_else(|error| {
                eprintln!("pg_stat_statements: {error}");
                None
            }),
            None => None,
        };
        let (dead, xmin_age, table_bytes): (i64, i64, i64) = sqlx::query_as(
            "SELECT (SELECT n_dead_tup FROM pg_stat_user_tables \
                     WHERE relname = 'bench_events' AND schemaname = current_schema()), \
                    (SELECT coalesce(max(age(backend_xmin)), 0)::bigint FROM pg_stat_activity \
                     WHERE pid <> pg_backend_pid()), \
                    pg_total_relation_size('bench_events')",
        )
        .fetch_one(&self.bench.pool)
        .await?;
        latencies.sort_unstable();
        claims.sort_unstable();
        let ms = |micros: u32| f64::from(micros) / 1e3;
        Ok(Row {
            label: label.to_owned(),
            enqueued: (enqueued - mark.enqueued) as f64 / seconds,
            published: latencies.len() as f64 / seconds,
            backlog: enqueued.saturating_sub(self.load.published.load(Ordering::Relaxed)),
            publish_p50: percentile(&latencies, 50).map_or(0.0, ms),
            publish_p99: percentile(&latencies, 99).map_or(0.0, ms),
            claims: claims.len() as f64 / seconds,
            claim_p50: percentile(&claims, 50).map(ms),
            claim_p99: percentile(&claims, 99).map(ms),
            server,
            dead,
            xmin_age,
            table_bytes,
            enqueued_so_far: enqueued,
            machine: cpu.machine_cores(&mark.cpu),
            postgres: cpu.server_cores(&mark.cpu, seconds),
            bench: cpu.client_cores(&mark.cpu, seconds),
        })
    }
}

fn percentile(sorted: &[u32], p: usize) -> Option<u32> {
    sorted.get(sorted.len().checked_sub(1)? * p / 100).copied()
}

/// One line of the section's table.
struct Row {
    label: String,
    enqueued: f64,
    published: f64,
    backlog: u64,
    publish_p50: f64,
    publish_p99: f64,
    claims: f64,
    claim_p50: Option<f64>,
    claim_p99: Option<f64>,
    server: Option<ServerClaims>,
    dead: i64,
    xmin_age: i64,
    /// The table with its indexes and TOAST.
    table_bytes: i64,
    /// Events the producers enqueued since the load began.
    enqueued_so_far: u64,
    machine: Option<f64>,
    postgres: Option<f64>,
    /// This process: the relay, the producers, the probes.
    bench: Option<f64>,
}

impl Row {
    const HEADER: &'static str = "| | enqueued/s | published/s | backlog | enqueue → publish p50 | p99 \
        | claims/s | claim mean (server) | claim max (server) | claim p50 (relay) | claim p99 (relay) \
        | buffers/claim | dead tuples | table MB | oldest xmin age | CPU: machine | postgres | bench | the rest |";
    const RULE: &'static str =
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

    fn markdown(&self) -> String {
        let or_na = |v: Option<String>| v.unwrap_or_else(|| "n/a".to_owned());
        let cores = |c: Option<f64>| or_na(c.map(|c| format!("{c:.2}")));
        format!(
            "| {} | {:.0} | {:.0} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
            self.label,
            self.enqueued,
            self.published,
            self.backlog,
            show_ms(self.publish_p50),
            show_ms(self.publish_p99),
            self.claims,
            or_na(self.server.map(|s| show_ms(s.mean_ms))),
            or_na(self.server.map(|s| show_ms(s.max_ms))),
            or_na(self.claim_p50.map(show_ms)),
            or_na(self.claim_p99.map(show_ms)),
            or_na(self.server.map(|s| format!("{:.0}", s.buffers))),
            self.dead,
            self.table_bytes as f64 / 1e6,
            self.xmin_age,
            cores(self.machine),
            cores(self.postgres),
            cores(self.bench),
            // What else ran on the machine meanwhile: other work disturbs the figures.
            cores(
                self.machine
                    .zip(self.postgres)
                    .zip(self.bench)
                    .map(|((m, p), b)| (m - p - b).max(0.0))
            ),
        )
    }
}

fn show_ms(ms: f64) -> String {
    if ms < 10.0 {
        format!("{ms:.2} ms")
    } else if ms < 100.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.0} ms")
    }
}

fn show_duration(d: Duration) -> String {
    match d.as_secs() {
        s if s % 60 == 0 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

/// The relay's claim times (microseconds) since the last call.
fn claim_times() -> Vec<u32> {
    std::mem::take(&mut *CLAIM_TIMES.lock().unwrap_or_else(PoisonError::into_inner))
}

static CLAIM_TIMES: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Installs the subscriber that keeps the claim's times from sqlx's statement log (and
/// prints warnings and errors), unless the process has one: then there are none.
fn install_claim_timer() -> bool {
    tracing_subscriber::registry()
        .with(ClaimTimer)
        .try_init()
        .is_ok()
}

/// Keeps the elapsed time of every claim statement sqlx logs; prints warnings and errors.
struct ClaimTimer;

impl ClaimTimer {
    fn wants(metadata: &Metadata<'_>) -> bool {
        metadata.target() == QUERY_TARGET || *metadata.level() <= Level::WARN
    }
}

impl<S: Subscriber> Layer<S> for ClaimTimer {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if Self::wants(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        Self::wants(metadata)
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let metadata = event.metadata();
        if metadata.target() == QUERY_TARGET {
            let mut statement = Statement::default();
            event.record(&mut statement);
            if statement.claim
                && let Some(seconds) = statement.elapsed
            {
                let micros = (seconds * 1e6).clamp(0.0, f64::from(u32::MAX));
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "clamped to u32's range"
                )]
                CLAIM_TIMES
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(micros as u32);
            }
        } else {
            let mut text = Text::default();
            event.record(&mut text);
            eprintln!("{} {}:{}", metadata.level(), metadata.target(), text.0);
        }
    }
}

/// What a logged statement says of itself: whether it is a claim, and how long it took.
#[derive(Default)]
struct Statement {
    claim: bool,
    elapsed: Option<f64>,
}

impl Visit for Statement {
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        if field.name() == "elapsed_secs" {
            self.elapsed = Some(value);
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "summary" {
            self.claim = CLAIM_PREFIXES.iter().any(|p| value.starts_with(p));
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

/// An event's fields, as text.
#[derive(Default)]
struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}
