//! The monitor: a task beside the relays that reads every outbox table's [`Stats`] on an
//! interval and sets `metrics` gauges from them, so dashboards and alerts see the
//! backlog, the lag and the dead rows without anyone calling [`stats`](crate::stats).
//! The relay's own counters ([`relay::metric`](crate::relay::metric)) give the rates.

use std::time::Duration;

use metrics::Gauge;
use sqlx::{Connection as _, PgPool};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::error::{OnTable as _, OutboxError};
use crate::schema::table_migrations::TableMigrations;
use crate::spec::TableSpec;
use crate::table::operator::{Operations, Stats};
use crate::table::statements;

/// Gauge names the [`Monitor`] sets through the `metrics` crate, each labelled `table`.
/// Counts are rows at the last sample; ages are seconds.
pub mod metric {
    /// Gauge: rows waiting for a claim, due or not yet due (retries wait here).
    pub const READY: &str = "outbox_ready";
    /// Gauge: `READY` rows that are due: the backlog the relays should be draining.
    pub const DUE: &str = "outbox_due";
    /// Gauge, tables declared `#[outbox(scheduled)]`: `READY` rows enqueued for a later
    /// time that has not come (`enqueue_at`, `enqueue_after`): neither backlog nor lag.
    pub const SCHEDULED: &str = "outbox_scheduled";
    /// Gauge: rows claimed by a publisher, live or expired.
    pub const IN_PROGRESS: &str = "outbox_in_progress";
    /// Gauge: claims whose lease expired: a publisher died or stalled holding them. A
    /// relay takes them over on its next claim, so a value that persists means no relay
    /// is running for the table.
    pub const EXPIRED_CLAIMS: &str = "outbox_expired_claims";
    /// Gauge: `DEAD` rows, waiting for an operator to requeue or discard them.
    pub const DEAD: &str = "outbox_dead";
    /// Gauge: seconds since the oldest event still to be published (`READY` or
    /// `INPROGRESS`) was enqueued; 0 when none is. The lag to alert on: it keeps growing
    /// through an outage, however often the relay hands the events back.
    pub const OLDEST_WAITING_AGE_SECONDS: &str = "outbox_oldest_waiting_age_seconds";
    /// Gauge, tables with an ordering key (`#[outbox(key)]`) only: keys held back by a
    /// `DEAD` event, whose later events wait for an operator.
    pub const HELD_KEYS: &str = "outbox_held_keys";
    /// Gauge, tables with an ordering key only: seconds since the oldest `DEAD` event
    /// holding back a key was enqueued; 0 when no key is held.
    pub const OLDEST_HELD_AGE_SECONDS: &str = "outbox_oldest_held_age_seconds";
    /// Gauge, tables that keep their `SENT` rows only (not `#[outbox(delete_sent)]`):
    /// events recorded `SENT` in the last minute, the publish rate as the table sees it.
    pub const SENT_LAST_MINUTE: &str = "outbox_sent_last_minute";
    /// Gauge: when the table was last sampled, in seconds since the Unix epoch. The
    /// other gauges keep their values while samples fail (or after the monitor
    /// stopped): alert on this one's age to know they are current.
    pub const LAST_SAMPLE_TIMESTAMP_SECONDS: &str = "outbox_last_sample_timestamp_seconds";
}

/// How often a monitor samples by default.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(15);

/// The shortest interval accepted: every sample counts whole tables.
const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// The shortest time a sample's statement may run, however short the interval.
const MIN_TIMEOUT: Duration = Duration::from_secs(1);

/// How often a monitor that keeps failing says so again after its first warning.
const REPEAT_WARNING: Duration = Duration::from_mins(1);

/// Samples the [`Stats`] of every outbox table it is given, on an interval, and sets
/// the gauges named in [`metric`], labelled `table`, through whatever `metrics`
/// recorder the application installed (a Prometheus exporter, say).
///
/// ```no_run
/// use std::time::Duration;
/// use outbox_runtime::Monitor;
/// use outbox_runtime::relay::CancellationToken;
///
/// # fn start(pool: sqlx::PgPool, tables: &[outbox_runtime::TableMigrations]) {
/// // tables: [OrderPlaced::migrations(), Shipped::migrations()], as for `migrate`
/// let shutdown = CancellationToken::new(); // the relays' token
/// tokio::spawn(Monitor::new(pool, tables).interval(Duration::from_secs(15)).run(shutdown.clone()));
/// # }
/// ```
///
/// It reads each table with the statement of [`stats`](crate::stats), one table after
/// the other on one pooled connection at a time, so its role needs only `SELECT` on the
/// outbox tables. Each sample counts whole tables: keep the interval in seconds. A
/// count that outlasts the interval (at least a second) is cancelled by the server and
/// counts as a transient failure.
#[derive(Debug, Clone)]
#[must_use = "a monitor does nothing until `run`"]
pub struct Monitor {
    pool: PgPool,
    tables: Vec<&'static TableSpec>,
    interval: Duration,
}

impl Monitor {
    /// A monitor of `tables` (each type's `T::migrations()`), sampling every 15 s. Two
    /// types stored in the same table are sampled once, through the first.
    pub fn new(pool: PgPool, tables: &[TableMigrations]) -> Self {
        let mut specs: Vec<&'static TableSpec> = Vec::with_capacity(tables.len());
        for table in tables {
            if !specs.iter().any(|s| s.table == table.table()) {
                specs.push(table.spec());
            }
        }
        Self {
            pool,
            tables: specs,
            interval: DEFAULT_INTERVAL,
        }
    }

    /// How often to sample (at least 10 ms). A sample that outlasts it delays the next
    /// rather than piling up. Each table's count runs with the interval as its
    /// `statement_timeout`, at least a second ([`statement_timeout_millis`]): never 0,
    /// which would be no limit, whatever the interval.
    ///
    /// [`statement_timeout_millis`]: crate::statement_timeout_millis
    pub fn interval(mut self, every: Duration) -> Self {
        self.interval = every.max(MIN_INTERVAL);
        self
    }

    /// Samples at once and then every interval until `shutdown` is cancelled, which it
    /// obeys mid-sample too.
    ///
    /// A transient failure ([`OutboxError::is_transient`]: a lost connection, a server
    /// restarting) is logged as a warning, the first time and then once a minute while
    /// it lasts, and the next sample tries again; the gauges keep their last values
    /// meanwhile. Any other error returns at once: a missing table, a missing `SELECT`
    /// privilege, credentials the server refuses.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), OutboxError> {
        let gauges: Vec<TableGauges> = self.tables.iter().map(|s| TableGauges::new(s)).collect();
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut failures = FailureLog::default();
        loop {
            let sampled = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                sampled = async {
                    ticks.tick().await;
                    self.sample(&gauges).await
                } => sampled,
            };
            match sampled {
                Ok(()) => {
                    if let Some((failed, lasted)) = failures.succeeded(Instant::now()) {
                        tracing::info!(
                            failed,
                            lasted = ?lasted,
                            "outbox monitor recovered: its samples succeed again"
                        );
                    }
                }
                Err(error) if error.is_transient() => {
                    if let Some(failed) = failures.failed(Instant::now()) {
                        tracing::warn!(
                            %error,
                            failed,
                            "outbox monitor cannot sample; its gauges keep their last values until it can \
                             (said again once a minute while it lasts)"
                        );
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "outbox monitor cannot go on; stopping");
                    return Err(error);
                }
            }
        }
    }

    /// Reads every table's stats and sets its gauges.
    ///
    /// Each table is read in a read-only transaction whose statements the server
    /// cancels after the interval (at least a second): a table grown too large to count
    /// in that time costs one warning a minute and stale gauges, not a core of the
    /// application's database busy counting it again and again. A table whose read
    /// fails transiently (that timeout, a lock held past it) keeps its gauges, and the
    /// tables after it are read all the same; the first such failure is returned once
    /// every table was tried. A failure that is not transient, or no connection at
    /// all, returns at once: the next tables would fail the same way.
    async fn sample(&self, gauges: &[TableGauges]) -> Result<(), OutboxError> {
        let timeout = crate::interval::statement_timeout_millis(self.interval.max(MIN_TIMEOUT));
        let begin = format!("BEGIN READ ONLY; SET LOCAL statement_timeout = {timeout}");
        let mut first_failure = None;
        for (spec, gauges) in self.tables.iter().zip(gauges) {
            let mut conn = crate::connect::acquire(&self.pool, spec.table).await?;
            let read = async {
                let mut tx = conn
                    .begin_with(sqlx::AssertSqlSafe(begin.clone()))
                    .await
                    .on_table(spec.table)?;
                let stats = statements::stats(&Operations::of_spec(spec), &mut *tx).await?;
                tx.commit().await.on_table(spec.table)?;
                Ok::<_, OutboxError>(stats)
            };
            match read.await {
                Ok(stats) => gauges.set(&stats),
                Err(error) if error.is_transient() => {
                    first_failure.get_or_insert(error);
                }
                Err(error) => return Err(error),
            }
        }
        first_failure.map_or(Ok(()), Err)
    }
}

/// The gauges of one table, registered once.
struct TableGauges {
    ready: Gauge,
    due: Gauge,
    /// Only for a table declared `#[outbox(scheduled)]`: the others take no schedule.
    scheduled: Option<Gauge>,
    in_progress: Gauge,
    expired_claims: Gauge,
    dead: Gauge,
    oldest_waiting_age: Gauge,
    /// Only for a table with an ordering key: others hold no key.
    held: Option<(Gauge, Gauge)>,
    /// Only for a table that keeps its `SENT` rows: the others cannot count them.
    sent_last_minute: Option<Gauge>,
    last_sample: Gauge,
}

impl TableGauges {
    fn new(spec: &'static TableSpec) -> Self {
        let gauge = |name: &'static str| metrics::gauge!(name, "table" => spec.table);
        Self {
            ready: gauge(metric::READY),
            due: gauge(metric::DUE),
            scheduled: spec.scheduled.then(|| gauge(metric::SCHEDULED)),
            in_progress: gauge(metric::IN_PROGRESS),
            expired_claims: gauge(metric::EXPIRED_CLAIMS),
            dead: gauge(metric::DEAD),
            oldest_waiting_age: gauge(metric::OLDEST_WAITING_AGE_SECONDS),
            held: spec.key.map(|_| {
                (
                    gauge(metric::HELD_KEYS),
                    gauge(metric::OLDEST_HELD_AGE_SECONDS),
                )
            }),
            sent_last_minute: (!spec.deletes_sent).then(|| gauge(metric::SENT_LAST_MINUTE)),
            last_sample: gauge(metric::LAST_SAMPLE_TIMESTAMP_SECONDS),
        }
    }

    fn set(&self, stats: &Stats) {
        self.ready.set(rows(stats.ready));
        self.due.set(rows(stats.due));
        if let Some(scheduled) = &self.scheduled {
            scheduled.set(rows(stats.scheduled));
        }
        self.in_progress.set(rows(stats.in_progress));
        self.expired_claims.set(rows(stats.expired_claims));
        self.dead.set(rows(stats.dead));
        self.oldest_waiting_age
            .set(seconds(stats.oldest_waiting_age));
        if let Some((held_keys, oldest_held_age)) = &self.held {
            held_keys.set(rows(stats.held_keys));
            oldest_held_age.set(seconds(stats.oldest_held_age));
        }
        if let (Some(gauge), Some(sent)) = (&self.sent_last_minute, stats.sent_last_minute) {
            gauge.set(rows(sent));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_sample.set(now.as_secs_f64());
    }
}

#[expect(
    clippy::cast_precision_loss,
    reason = "a gauge is an f64; row counts stay far below 2^53"
)]
fn rows(count: i64) -> f64 {
    count as f64
}

/// An age in seconds; nothing to wait for is 0, so an alert on the age clears.
fn seconds(age: Option<Duration>) -> f64 {
    age.map_or(0.0, |age| age.as_secs_f64())
}

/// When to log the monitor's transient failures: the first of a run of them, then at
/// most once per [`REPEAT_WARNING`], and the recovery once.
#[derive(Debug, Default)]
struct FailureLog {
    failing: Option<Failing>,
}

#[derive(Debug)]
struct Failing {
    since: Instant,
    /// Failures since the run began.
    failed: u64,
    last_warned: Instant,
}

impl FailureLog {
    /// Counts a failure at `now`; `Some(failures so far)` when it is time to warn.
    fn failed(&mut self, now: Instant) -> Option<u64> {
        let Some(failing) = &mut self.failing else {
            self.failing = Some(Failing {
                since: now,
                failed: 1,
                last_warned: now,
            });
            return Some(1);
        };
        failing.failed += 1;
        if now.duration_since(failing.last_warned) < REPEAT_WARNING {
            return None;
        }
        failing.last_warned = now;
        Some(failing.failed)
    }

    /// Ends a run of failures; `Some((failures, how long it lasted))` if there was one.
    fn succeeded(&mut self, now: Instant) -> Option<(u64, Duration)> {
        let failing = self.failing.take()?;
        Some((failing.failed, now.duration_since(failing.since)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_failures_warns_first_then_once_a_minute_then_recovers_once() {
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let mut log = FailureLog::default();
        assert_eq!(log.succeeded(at(0)), None, "nothing failed: nothing to say");
        assert_eq!(log.failed(at(0)), Some(1));
        for second in (15..60).step_by(15) {
            assert_eq!(log.failed(at(second)), None, "{second}s: quiet");
        }
        assert_eq!(
            log.failed(at(60)),
            Some(5),
            "a minute later, with the count"
        );
        assert_eq!(log.failed(at(75)), None);
        assert_eq!(log.succeeded(at(90)), Some((6, Duration::from_secs(90))));
        assert_eq!(log.succeeded(at(105)), None, "recovered once");
        assert_eq!(log.failed(at(120)), Some(1), "a new run warns at once");
    }

    #[test]
    fn gauges_read_zero_age_when_nothing_waits() {
        assert!(seconds(None).abs() < f64::EPSILON);
        assert!((seconds(Some(Duration::from_millis(1_500))) - 1.5).abs() < f64::EPSILON);
        assert!((rows(42) - 42.0).abs() < f64::EPSILON);
    }

    #[tokio::test]
    async fn the_interval_is_never_zero() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://outbox@127.0.0.1:1/orders")
            .expect("a lazy pool");
        let monitor = Monitor::new(pool, &[]).interval(Duration::ZERO);
        assert_eq!(monitor.interval, MIN_INTERVAL);
    }
}
