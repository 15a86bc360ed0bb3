//! The monitor against real PostgreSQL: its gauges follow two tables through claims,
//! failures, expired leases and repairs; it stops on cancel, also mid-sample; it needs
//! only `SELECT` on the tables and stops on a missing table or privilege; a lost
//! connection, or a sample the server cancels at its bound, is logged once and sampling
//! resumes.

use std::time::Duration;

use outbox::monitor::metric;
use outbox::testing::TestSchema;
use outbox::{CancellationToken, OutboxError, monitor::Monitor};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{OrderStep, Receipt};
use outbox_testkit::logs::Captured;
use outbox_testkit::role::with_role;
use outbox_testkit::rows::{enqueue, expire};
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tracing_subscriber::filter::LevelFilter;

const STEPS: &str = "order_step_events";
const RECEIPTS: &str = "receipt_events";

/// A monitor running in the background, sampling every 20 ms.
struct Running {
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), OutboxError>>,
}

fn start(pool: &PgPool, tables: &[outbox::schema::TableMigrations]) -> Running {
    start_every(Duration::from_millis(20), pool, tables)
}

fn start_every(
    interval: Duration,
    pool: &PgPool,
    tables: &[outbox::schema::TableMigrations],
) -> Running {
    let shutdown = CancellationToken::new();
    let monitor = Monitor::new(pool.clone(), tables).interval(interval);
    let handle = tokio::spawn(monitor.run(shutdown.clone()));
    Running { shutdown, handle }
}

impl Running {
    /// Cancels the token and waits for `run` to return.
    async fn stop(self) -> Result<(), OutboxError> {
        self.shutdown.cancel();
        self.returned().await
    }

    /// What `run` returned, which it must do within 5 s.
    async fn returned(self) -> Result<(), OutboxError> {
        timeout(Duration::from_secs(5), self.handle)
            .await
            .expect("the monitor returns promptly")
            .expect("the monitor did not panic")
    }
}

/// The gauges of one table, `None` where the monitor set none.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Gauges {
    ready: Option<f64>,
    due: Option<f64>,
    in_progress: Option<f64>,
    expired_claims: Option<f64>,
    dead: Option<f64>,
    held_keys: Option<f64>,
    sent_last_minute: Option<f64>,
}

impl Gauges {
    fn of(counters: &Counters, table: &str) -> Self {
        let gauge = |name| counters.gauge(name, table);
        Self {
            ready: gauge(metric::READY),
            due: gauge(metric::DUE),
            in_progress: gauge(metric::IN_PROGRESS),
            expired_claims: gauge(metric::EXPIRED_CLAIMS),
            dead: gauge(metric::DEAD),
            held_keys: gauge(metric::HELD_KEYS),
            sent_last_minute: gauge(metric::SENT_LAST_MINUTE),
        }
    }

    /// A table's counts, every gauge set.
    fn counts(ready: f64, due: f64, in_progress: f64, expired_claims: f64, dead: f64) -> Self {
        Self {
            ready: Some(ready),
            due: Some(due),
            in_progress: Some(in_progress),
            expired_claims: Some(expired_claims),
            dead: Some(dead),
            held_keys: Some(0.0),
            sent_last_minute: Some(0.0),
        }
    }
}

/// Waits until `table`'s gauges read `expected`.
async fn wait_for_gauges(counters: &Counters, table: &str, expected: Gauges) {
    wait_until(
        &format!("the gauges of {table} read {expected:?}"),
        Duration::from_secs(10),
        async || Gauges::of(counters, table) == expected,
    )
    .await;
}

fn step(name: &str, order_id: i64) -> OrderStep {
    OrderStep {
        name: name.into(),
        order_id,
    }
}

fn receipt(name: &str) -> Receipt {
    Receipt { name: name.into() }
}

#[tokio::test]
async fn the_gauges_follow_each_tables_claims_failures_and_repairs() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[OrderStep::migrations(), Receipt::migrations()]).await?;
    let pool = db.pool();
    let monitor = start(pool, &[OrderStep::migrations(), Receipt::migrations()]);

    // Empty tables read 0. Only a keyed table holds keys; only a table that keeps its
    // SENT rows can count them.
    wait_for_gauges(&counters, STEPS, Gauges::counts(0.0, 0.0, 0.0, 0.0, 0.0)).await;
    let receipts_empty = Gauges {
        held_keys: None,
        sent_last_minute: None,
        ..Gauges::counts(0.0, 0.0, 0.0, 0.0, 0.0)
    };
    wait_for_gauges(&counters, RECEIPTS, receipts_empty).await;

    // Order 1's first step fails for good and holds its second back (a claim that
    // passes it over parks it: waiting, not due); order 2's is sent; orders 3 and 4 are
    // claimed, and order 3's publisher dies holding its claim.
    enqueue(
        pool,
        &[
            step("1-a", 1),
            step("1-b", 1),
            step("2-a", 2),
            step("3-a", 3),
            step("4-a", 4),
        ],
    )
    .await;
    let claimed = OrderStep::claim(pool).await?.expect("1-a");
    claimed.fail(pool, "the broker refused it").await?;
    let claimed = OrderStep::claim(pool).await?.expect("2-a");
    assert_eq!(claimed.event().name, "2-a", "1-b waits behind 1-a");
    claimed.complete(pool).await?;
    // 1-b, the oldest event still to be published, was enqueued 10 minutes ago (1-a,
    // DEAD, waits for an operator, not for the relay).
    sqlx::query("UPDATE order_step_events SET created_at = now() - interval '10 minutes' WHERE event_id = '1-b'")
        .execute(pool)
        .await?;
    let died = OrderStep::claim(pool).await?.expect("3-a");
    let _live = OrderStep::claim(pool).await?.expect("4-a");
    expire::<OrderStep>(pool, died.id()).await?;
    wait_for_gauges(
        &counters,
        STEPS,
        Gauges {
            held_keys: Some(1.0),
            sent_last_minute: Some(1.0),
            ..Gauges::counts(1.0, 0.0, 2.0, 1.0, 1.0)
        },
    )
    .await;
    let age = counters
        .gauge(metric::OLDEST_WAITING_AGE_SECONDS, STEPS)
        .expect("the age gauge");
    assert!(
        (600.0..660.0).contains(&age),
        "1-b waits since its enqueue, 10 minutes ago: {age}"
    );

    // Receipts: one sent (its row deleted), one retried in an hour (waiting, not due),
    // one due.
    enqueue(pool, &[receipt("r1"), receipt("r2"), receipt("r3")]).await;
    Receipt::claim(pool)
        .await?
        .expect("r1")
        .complete(pool)
        .await?;
    let retried = Receipt::claim(pool)
        .await?
        .expect("r2")
        .retry(pool, Duration::from_hours(1))
        .await?;
    assert_eq!(retried, outbox::Retried::Scheduled);
    wait_for_gauges(
        &counters,
        RECEIPTS,
        Gauges {
            ready: Some(2.0),
            due: Some(1.0),
            ..receipts_empty
        },
    )
    .await;

    // The operator requeues 1-a: nothing is dead or held any more, and 1-a is due.
    outbox::ops::requeue_dead::<OrderStep>(pool, &["1-a"]).await?;
    wait_for_gauges(
        &counters,
        STEPS,
        Gauges {
            sent_last_minute: Some(1.0),
            ..Gauges::counts(2.0, 1.0, 2.0, 1.0, 0.0)
        },
    )
    .await;
    assert_eq!(
        counters.gauge(metric::OLDEST_HELD_AGE_SECONDS, STEPS),
        Some(0.0)
    );

    monitor.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn it_stops_on_cancel_even_in_the_middle_of_a_sample() -> TestResult {
    let db = schema_with(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    // A migration holds the table: the monitor's first sample waits on the lock, and
    // with a minute's interval the server would cancel it only after a minute (its
    // statement timeout), so only the monitor's own cancel can end it within 5 s.
    let mut migration = pool.begin().await?;
    sqlx::query("LOCK TABLE receipt_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *migration)
        .await?;
    let monitor = start_every(Duration::from_mins(1), pool, &[Receipt::migrations()]);
    waiting_sample(pool, db.name()).await?;
    monitor.stop().await?;
    migration.rollback().await?;
    db.drop_schema().await?;
    Ok(())
}

/// The backend of the monitor's sample once it waits for a lock on a table.
async fn waiting_sample(side: &PgPool, application_name: &str) -> TestResult<i32> {
    let mut pid = None;
    wait_until(
        "the monitor's sample waits on the lock",
        Duration::from_secs(10),
        async || {
            pid = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
            )
            .bind(application_name)
            .fetch_optional(side)
            .await
            .expect("pg_stat_activity");
            pid.is_some()
        },
    )
    .await;
    Ok(pid.expect("waited for it"))
}

#[tokio::test]
async fn a_missing_table_stops_it_with_the_error() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    // The application forgot to migrate the receipts' table.
    let monitor = start(db.pool(), &[OrderStep::migrations(), Receipt::migrations()]);
    let error = monitor
        .returned()
        .await
        .expect_err("a missing table is fatal");
    assert!(
        matches!(
            error,
            OutboxError::MissingTable {
                table: "receipt_events",
                ..
            }
        ),
        "{error:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn select_on_the_tables_is_all_it_needs_and_a_missing_grant_stops_it() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[OrderStep::migrations(), Receipt::migrations()]).await?;
    let role = format!("{}_monitor", db.name());
    let grants = format!(
        "GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT ON {schema}.order_step_events TO {role};",
        schema = db.name()
    );
    // Boxed: the monitors it runs make a large future.
    let test = Box::pin(sampled_with_select_alone(&db, &counters, &role));
    with_role(&db, &role, &grants, test).await?;
    db.drop_schema().await?;
    Ok(())
}

/// As `role`, which may read `order_step_events` and nothing more.
async fn sampled_with_select_alone(db: &TestSchema, counters: &Counters, role: &str) -> TestResult {
    let options: PgConnectOptions = outbox::testing::database_url().await?.parse()?;
    let as_monitor = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            options
                .username(role)
                .options([("search_path", db.name())])
                .application_name(db.name()),
        )
        .await?;

    // Without SELECT on the receipts it stops at once, saying so.
    let tables = [OrderStep::migrations(), Receipt::migrations()];
    let error = start(&as_monitor, &tables)
        .returned()
        .await
        .expect_err("no SELECT on receipt_events");
    assert!(
        matches!(
            error,
            OutboxError::PermissionDenied {
                table: "receipt_events",
                ..
            }
        ),
        "{error:?}"
    );

    // With it, and nothing else (not even the catalog), it samples both tables.
    sqlx::query(AssertSqlSafe(format!(
        "GRANT SELECT ON receipt_events TO {role}"
    )))
    .execute(db.pool())
    .await?;
    enqueue(db.pool(), &[receipt("r1")]).await;
    let monitor = start(&as_monitor, &tables);
    wait_until(
        "both tables are sampled",
        Duration::from_secs(10),
        async || {
            counters.gauge(metric::READY, RECEIPTS) == Some(1.0)
                && counters.gauge(metric::READY, STEPS) == Some(0.0)
        },
    )
    .await;
    monitor.stop().await?;
    as_monitor.close().await;
    Ok(())
}

#[tokio::test]
async fn a_lost_connection_or_a_cancelled_sample_is_logged_once_and_sampling_resumes() -> TestResult
{
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let logs = Captured::default();
    // A current-thread runtime polls the monitor on this thread: it logs here.
    let _logging = logs.this_thread(LevelFilter::INFO);
    let db = schema_with(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    let monitor = start(pool, &[Receipt::migrations()]);
    wait_until("a first sample", Duration::from_secs(10), async || {
        counters.gauge(metric::READY, RECEIPTS) == Some(0.0)
    })
    .await;

    // The sample waits on a lock when its connection is terminated (a failover, an
    // operator's pg_terminate_backend).
    let mut migration = pool.begin().await?;
    sqlx::query("LOCK TABLE receipt_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *migration)
        .await?;
    let sample = waiting_sample(pool, db.name()).await?;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(sample)
        .execute(pool)
        .await?;
    wait_until("the monitor warns", Duration::from_secs(10), async || {
        logs.lines_with(&["WARN", "outbox monitor cannot sample"]) == 1
    })
    .await;
    assert!(
        !monitor.handle.is_finished(),
        "a lost connection is transient"
    );

    // The lock goes away; the next samples see what was enqueued since.
    migration.rollback().await?;
    enqueue(pool, &[receipt("r1"), receipt("r2")]).await;
    wait_until(
        "the gauges move again",
        Duration::from_secs(10),
        async || counters.gauge(metric::READY, RECEIPTS) == Some(2.0),
    )
    .await;
    assert_eq!(logs.lines_with(&["INFO", "outbox monitor recovered"]), 1);
    assert_eq!(
        logs.lines_with(&["outbox monitor cannot sample"]),
        1,
        "{}",
        logs.text()
    );

    // A lock held for longer than a sample may take (the interval, at least a second):
    // the server cancels the count instead of letting it wait, and the monitor goes on.
    let mut migration = pool.begin().await?;
    sqlx::query("LOCK TABLE receipt_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *migration)
        .await?;
    wait_until(
        "the monitor warns again",
        Duration::from_secs(10),
        async || logs.lines_with(&["WARN", "outbox monitor cannot sample"]) == 2,
    )
    .await;
    assert_eq!(
        logs.lines_with(&["WARN", "cannot sample", "statement timeout"]),
        1,
        "{}",
        logs.text()
    );
    assert!(
        !monitor.handle.is_finished(),
        "a cancelled sample is transient"
    );
    migration.rollback().await?;
    enqueue(pool, &[receipt("r3")]).await;
    wait_until(
        "the gauges move again",
        Duration::from_secs(10),
        async || counters.gauge(metric::READY, RECEIPTS) == Some(3.0),
    )
    .await;
    assert_eq!(logs.lines_with(&["INFO", "outbox monitor recovered"]), 2);
    monitor.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_table_that_cannot_be_read_leaves_the_gauges_of_the_others_moving() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[OrderStep::migrations(), Receipt::migrations()]).await?;
    let pool = db.pool();
    let monitor = start(pool, &[OrderStep::migrations(), Receipt::migrations()]);
    wait_until("a first sample", Duration::from_secs(10), async || {
        counters.gauge(metric::READY, RECEIPTS) == Some(0.0)
    })
    .await;

    // The first table is locked for longer than a sample may take: each sample's read
    // of it is cancelled, and the table after it is read all the same.
    let mut migration = pool.begin().await?;
    sqlx::query("LOCK TABLE order_step_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *migration)
        .await?;
    enqueue(pool, &[receipt("r1"), receipt("r2")]).await;
    wait_until(
        "the receipts' gauges move while the steps cannot be read",
        Duration::from_secs(10),
        async || counters.gauge(metric::READY, RECEIPTS) == Some(2.0),
    )
    .await;
    assert!(
        !monitor.handle.is_finished(),
        "a cancelled read is transient"
    );
    // The steps' gauges are stale, and their last sample says since when.
    let last_sample = |table| {
        counters
            .gauge(metric::LAST_SAMPLE_TIMESTAMP_SECONDS, table)
            .expect("sampled once")
    };
    let stale_since = last_sample(STEPS);
    assert!(last_sample(RECEIPTS) > stale_since);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    assert!(
        (0.0..60.0).contains(&(now - stale_since)),
        "a Unix time in seconds: {stale_since}"
    );

    migration.rollback().await?;
    enqueue(pool, &[step("s1", 1)]).await;
    wait_until(
        "the steps' gauges move again",
        Duration::from_secs(10),
        async || counters.gauge(metric::READY, STEPS) == Some(1.0),
    )
    .await;
    assert!(last_sample(STEPS) > stale_since);
    monitor.stop().await?;
    db.drop_schema().await?;
    Ok(())
}
