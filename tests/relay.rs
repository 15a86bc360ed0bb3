//! The relay against real PostgreSQL: publication, wake-ups, lease renewal and its
//! rejection, backoff, dead events and their repair, pruning, shutdown, send timeouts,
//! killed sessions, stats, and a missing table.

#[path = "../examples/common/mod.rs"]
mod common;
mod support;

use std::collections::{BTreeSet, HashSet};
use std::future::pending;
use std::panic::AssertUnwindSafe;
use std::str::FromStr as _;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use common::{BenchEvent, EmailChanged, OrderPlaced, PaymentCaptured};
use futures_util::FutureExt as _;
use outbox::testing::TestSchema;
use outbox::{
    CancellationToken, Delivery, Relay, Sink, SinkError,
    relay::{Backoff, MemorySink},
};
use outbox::{EventId, Outbox, OutboxError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use support::events::{Budgeted, ChaosEvent, LongSend};
use support::proxy::Proxy;
use support::role::with_role;
use support::rows::{Row, count, enqueue, row_of, status};
use support::running::{Running, start};
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`events.rs` checks the random start of production).
use support::counters::Counters;
use support::logs::Captured;
use support::schema::schema_from_zero;
use support::{TestResult, wait_until};
use tokio::time::{Instant, sleep, timeout};

const IDLE_CLAIMS: &str = outbox::relay::metric::IDLE_CLAIMS;

fn budgeted(name: &str) -> Budgeted {
    Budgeted { name: name.into() }
}

fn payment(amount_cents: i64) -> PaymentCaptured {
    PaymentCaptured {
        payment_id: uuid::Uuid::now_v7(),
        amount_cents,
    }
}

fn long_send(name: &str) -> LongSend {
    LongSend { name: name.into() }
}

/// The lease of `LongSend` `name` as it is now, in the database's clock.
async fn lease_until(pool: &PgPool, name: &str) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT lease_until FROM long_send_events WHERE event_id = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until the database's clock is past `lease`: from then on, only a renewal keeps
/// the row from being claimed.
async fn wait_past(pool: &PgPool, lease: chrono::DateTime<chrono::Utc>) {
    wait_until("the lease is over", Duration::from_secs(30), async || {
        sqlx::query_scalar::<_, bool>("SELECT clock_timestamp() > $1")
            .bind(lease)
            .fetch_one(pool)
            .await
            .unwrap()
    })
    .await;
}

/// Records every status change of `table`'s rows in a `history` table, with the delay
/// until `next_attempt_at` measured from the recording statement's own timestamp (so
/// a retry's backoff is read exactly, not raced against).
async fn record_history(pool: &PgPool, table: &str) {
    let sql = format!(
        "CREATE TABLE history (
             seq bigint GENERATED ALWAYS AS IDENTITY, event_id text, status text,
             attempts int, generation bigint, delay_ms float8, last_error text);
         CREATE FUNCTION log_history() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO history (event_id, status, attempts, generation, delay_ms, last_error)
             VALUES (NEW.event_id, NEW.status, NEW.attempts, NEW.generation,
                     extract(epoch FROM NEW.next_attempt_at - statement_timestamp()) * 1000,
                     NEW.last_error);
             RETURN NULL;
         END $$;
         CREATE TRIGGER history AFTER UPDATE ON {table} FOR EACH ROW
             WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION log_history();"
    );
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

/// The retry delays (ms) recorded so far, in order.
async fn retry_delays(pool: &PgPool) -> Vec<f64> {
    sqlx::query_scalar("SELECT delay_ms FROM history WHERE status = 'READY' ORDER BY seq")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// What a [`ScriptSink`] saw of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    event_id: String,
    generation: i64,
    attempt: u32,
}

impl Seen {
    fn new(event_id: &(impl ToString + ?Sized), generation: i64, attempt: u32) -> Self {
        Self {
            event_id: event_id.to_string(),
            generation,
            attempt,
        }
    }
}

/// What a scripted publish waits for before it reports its results.
enum Wait {
    Nothing,
    Forever,
    /// Until the relay says it lost ownership of this event (at most 10 s).
    UntilLost(String),
    /// Until the test cancels this token: a send that lasts until the test has seen
    /// what it waits for, however slow the machine.
    Until(CancellationToken),
}

/// What one publish call does.
struct Plan {
    wait: Wait,
    results: Vec<Result<(), SinkError>>,
}

impl Plan {
    fn ok(seen: &[Seen]) -> Self {
        Self::after(Wait::Nothing, seen)
    }

    fn after(wait: Wait, seen: &[Seen]) -> Self {
        Self {
            wait,
            results: seen.iter().map(|_| Ok(())).collect(),
        }
    }
}

type Script = dyn Fn(usize, &[Seen]) -> Plan + Send + Sync;

#[derive(Debug, Default)]
struct Log {
    /// Every publish call, in order.
    calls: Vec<Vec<Seen>>,
    /// Publish calls dropped by the relay before they finished.
    abandoned: usize,
    /// Per finished call: each delivery's `is_owned()` after the wait.
    owned: Vec<Vec<(String, bool)>>,
}

/// A sink whose every call follows a script: given the call's index and deliveries,
/// what to wait for and what to report.
#[derive(Clone)]
struct ScriptSink {
    script: Arc<Script>,
    log: Arc<Mutex<Log>>,
}

impl ScriptSink {
    fn new(script: impl Fn(usize, &[Seen]) -> Plan + Send + Sync + 'static) -> Self {
        Self {
            script: Arc::new(script),
            log: Arc::default(),
        }
    }

    fn always_ok() -> Self {
        Self::new(|_, seen| Plan::ok(seen))
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn calls(&self) -> Vec<Vec<Seen>> {
        self.log().calls.clone()
    }

    fn deliveries(&self) -> Vec<Seen> {
        self.log().calls.concat()
    }

    fn abandoned(&self) -> usize {
        self.log().abandoned
    }

    fn owned(&self) -> Vec<Vec<(String, bool)>> {
        self.log().owned.clone()
    }
}

/// Counts a publish call as abandoned unless it reaches its end.
struct Unfinished<'a>(Option<&'a Mutex<Log>>);

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(log) = self.0 {
            log.lock().unwrap_or_else(PoisonError::into_inner).abandoned += 1;
        }
    }
}

impl<T: Send + Sync + 'static> Sink<T> for ScriptSink {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        let seen: Vec<Seen> = batch
            .iter()
            .map(|d| Seen::new(d.event_id(), d.generation().get(), d.attempt()))
            .collect();
        let call = {
            let mut log = self.log();
            log.calls.push(seen.clone());
            log.calls.len() - 1
        };
        let plan = (self.script)(call, &seen);
        let mut unfinished = Unfinished(Some(&*self.log));
        match plan.wait {
            Wait::Nothing => {}
            Wait::Forever => pending::<()>().await,
            Wait::Until(released) => released.cancelled().await,
            Wait::UntilLost(event_id) => {
                if let Some(d) = batch.iter().find(|d| d.event_id() == event_id.as_str()) {
                    let _ = timeout(Duration::from_secs(10), d.ownership_lost()).await;
                }
            }
        }
        let owned = batch
            .iter()
            .map(|d| (d.event_id().to_string(), d.is_owned()))
            .collect();
        self.log().owned.push(owned);
        unfinished.0 = None;
        plan.results
    }
}

/// Waits until two more of the relay's claims of `table` found nothing: a relay that
/// would claim an event again has had its chances. (`counters` must be the test's
/// recorder.)
async fn two_more_empty_claims(counters: &Counters, table: &str) {
    let idle = counters.get(IDLE_CLAIMS, table);
    wait_until(
        "two more claims find nothing",
        Duration::from_secs(10),
        async || counters.get(IDLE_CLAIMS, table) >= idle + 2,
    )
    .await;
}

/// A relay that polls every 20 ms, for retries due within milliseconds.
fn fast<T: Outbox, S: Sink<T>>(relay: Relay<T, S>) -> Relay<T, S> {
    relay.poll_interval(Duration::from_millis(20))
}

#[tokio::test]
async fn a_backlog_with_undecodable_rows_drains_without_waiting_for_the_poll() -> TestResult {
    let db = schema_from_zero(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    // 100 orders written behind the outbox's back (no notification), every tenth of
    // them with an id that no longer decodes: each batch of 10 holds one.
    sqlx::query(
        "INSERT INTO order_events (event_id, customer, total_cents, lines)
         SELECT CASE WHEN n % 10 = 0 THEN 'not-a-uuid-' || n ELSE gen_random_uuid()::text END,
                'ada', 1, '[]'
         FROM generate_series(1, 100) AS n ORDER BY n",
    )
    .execute(pool)
    .await?;
    let sink = MemorySink::new();
    let relay = start(
        Relay::<OrderPlaced, _>::new(pool.clone(), sink.clone())
            .batch_size(10)
            .poll_interval(Duration::from_hours(1)),
    );

    // A batch of 9 claims is short only because its claim found a row it moved to DEAD:
    // the worker goes on at once, where it took the batch for the end of the backlog
    // and waited for the poll.
    wait_until("90 SENT and 10 DEAD", Duration::from_secs(10), async || {
        let stats = outbox::stats::<OrderPlaced>(pool).await.unwrap();
        (stats.sent, stats.dead) == (90, 10)
    })
    .await;
    relay.stop().await?;
    assert_eq!(sink.published().len(), 90);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn every_enqueued_event_is_published_exactly_once_and_ends_sent() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names: Vec<String> = (0..200).map(|n| format!("event-{n:03}")).collect();
    let events: Vec<Budgeted> = names.iter().map(|n| budgeted(n)).collect();
    // Half is waiting when the relay starts, the rest arrives while it runs.
    enqueue(pool, &events[..100]).await;
    let sink = MemorySink::new();
    let relay = start(
        Relay::<Budgeted, _>::new(pool.clone(), sink.clone())
            .concurrency(4)
            .batch_size(10)
            .poll_interval(Duration::from_millis(100)),
    );
    for chunk in events[100..].chunks(10) {
        enqueue(pool, chunk).await;
    }
    wait_until("all 200 are SENT", Duration::from_secs(30), async || {
        outbox::stats::<Budgeted>(pool).await.unwrap().sent == 200
    })
    .await;
    relay.stop().await?;

    let published = sink.published();
    let mut seen: Vec<&str> = published.iter().map(|p| p.event.name.as_str()).collect();
    seen.sort_unstable();
    assert_eq!(seen, names, "each event exactly once");
    assert!(
        published
            .iter()
            .all(|p| p.event_id == p.event.name.as_str()
                && (p.generation.get(), p.attempt) == (1, 1)),
        "first claims only, nothing reclaimed"
    );
    let unclean: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM budget_events
         WHERE (status, generation, attempts) <> ('SENT', 1, 1) OR lease_until IS NOT NULL",
    )
    .fetch_one(pool)
    .await?;
    assert_eq!(unclean, 0);
    let stats = outbox::stats::<Budgeted>(pool).await?;
    assert_eq!(
        (stats.ready, stats.in_progress, stats.sent, stats.dead),
        (0, 0, 200, 0)
    );
    assert_eq!((stats.expired_claims, stats.oldest_waiting_age), (0, None));
    db.drop_schema().await?;
    Ok(())
}

/// Between full claims a relay claims from its frontier, half a second behind the
/// latest row it claimed: an event whose transaction commits seconds after its INSERT
/// lies behind the frontier by then, and a full claim must find it.
#[tokio::test]
async fn an_event_committed_seconds_after_its_insert_is_published_behind_later_ones() -> TestResult
{
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let sink = MemorySink::new();
    let relay = start(fast(
        Relay::<Budgeted, _>::new(pool.clone(), sink.clone()).concurrency(2),
    ));
    let mut slow = pool.begin().await?;
    outbox::table::enqueue(&budgeted("committed-late"), &mut *slow).await?;
    // Later events, committed at once, claimed and published while it is uncommitted:
    // the frontier passes it. (Spread over 1.5 s: the frontier trails the latest row it
    // claimed by half a second.)
    for n in 0..15 {
        enqueue(pool, &[budgeted(&format!("on-time-{n:02}"))]).await;
        sleep(Duration::from_millis(100)).await;
    }
    wait_until(
        "the on-time events are SENT",
        Duration::from_secs(10),
        async || count::<Budgeted>(pool, "SENT").await == 15,
    )
    .await;
    slow.commit().await?;
    wait_until(
        "the late one is SENT",
        Duration::from_secs(10),
        async || count::<Budgeted>(pool, "SENT").await == 16,
    )
    .await;
    relay.stop().await?;
    let late: Vec<_> = sink
        .published()
        .into_iter()
        .filter(|p| p.event.name == "committed-late")
        .collect();
    assert_eq!(late.len(), 1, "published once");
    assert_eq!((late[0].generation.get(), late[0].attempt), (1, 1));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_notification_wakes_an_idle_relay_long_before_its_poll_interval() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[EmailChanged::migrations()]).await?;
    let pool = db.pool();
    let sink = MemorySink::new();
    let relay = start(
        Relay::<EmailChanged, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_mins(1)),
    );
    wait_until("the relay listens", Duration::from_secs(10), async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'",
        )
        .bind(db.name())
        .fetch_one(pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    for n in 1..=2 {
        // Idle: its first claim found nothing, the event before is recorded, and the
        // next poll is a minute away.
        wait_until("the relay is idle", Duration::from_secs(10), async || {
            counters.get(IDLE_CLAIMS, "customer_events") >= 1
                && outbox::stats::<EmailChanged>(pool).await.unwrap().sent
                    == i64::try_from(n - 1).unwrap()
        })
        .await;
        let event = EmailChanged {
            customer: format!("customer {n}"),
            email: format!("{n}@example.com"),
            referrer: None,
        };
        event.enqueue(pool).await?;
        // Well before the poll, a minute away: woken by the notification.
        wait_until(
            "the notified relay published it",
            Duration::from_secs(20),
            async || sink.published().len() == n,
        )
        .await;
        assert_eq!(sink.published()[n - 1].event, event);
    }
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_notification_wakes_one_idle_worker_not_all_of_them() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[EmailChanged::migrations()]).await?;
    let pool = db.pool();
    let sink = MemorySink::new();
    let relay = start(
        Relay::<EmailChanged, _>::new(db.connect(6).await?, sink.clone())
            .concurrency(4)
            .poll_interval(Duration::from_mins(1)),
    );
    wait_until(
        "the workers are idle",
        Duration::from_secs(10),
        async || counters.get(IDLE_CLAIMS, "customer_events") >= 4,
    )
    .await;
    let idle_at_start = counters.get(IDLE_CLAIMS, "customer_events");
    let events = 20;
    for n in 1..=events {
        // One event per transaction, each notified on its own, to idle workers.
        EmailChanged {
            customer: format!("customer {n}"),
            email: format!("{n}@example.com"),
            referrer: None,
        }
        .enqueue(pool)
        .await?;
        wait_until("it is published", Duration::from_secs(5), async || {
            sink.published().len() == n
        })
        .await;
        // Recorded: the worker that published it is done with it, and idle again.
        wait_until("it is SENT", Duration::from_secs(5), async || {
            outbox::stats::<EmailChanged>(pool).await.unwrap().sent == i64::try_from(n).unwrap()
        })
        .await;
    }
    let idle_claims = counters.get(IDLE_CLAIMS, "customer_events") - idle_at_start;
    // Each event costs the claim that finds it and the worker's next, empty one. Woken
    // all together, the four workers made about four empty claims per event.
    assert!(
        idle_claims <= events as u64 + 2,
        "{idle_claims} empty claims for {events} events"
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn lease_renewal_keeps_a_slow_send_owned() -> TestResult {
    let db = schema_from_zero(&[LongSend::migrations()]).await?;
    let pool = db.pool();
    // The send lasts until the test has seen its lease run out and the row stay owned.
    let released = CancellationToken::new();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |_, seen| Plan::after(Wait::Until(released.clone()), seen)
    });
    let relay = start(
        fast(Relay::<LongSend, _>::new(pool.clone(), sink.clone()))
            .send_timeout(Duration::from_mins(1)),
    );
    long_send("slow").enqueue(pool).await?;
    wait_until("the send started", Duration::from_secs(10), async || {
        !sink.calls().is_empty()
    })
    .await;
    // Past the lease the row had when the send began: without renewal it would be
    // claimable now. (The relay's own clock: it renews every second, and the 3 s lease
    // lets two renewals in a row come late before the row is free.)
    wait_past(pool, lease_until(pool, "slow").await).await;
    assert!(
        LongSend::claim(pool).await?.is_none(),
        "the renewed claim keeps its row"
    );
    let stats = outbox::stats::<LongSend>(pool).await?;
    assert_eq!((stats.in_progress, stats.expired_claims), (1, 0));
    assert!(row_of::<LongSend>(pool, "slow").await.lease_left > Some(0.0));

    released.cancel();
    wait_until(
        "the slow send is SENT",
        Duration::from_secs(10),
        async || status::<LongSend>(pool, "slow").await == "SENT",
    )
    .await;
    let row = row_of::<LongSend>(pool, "slow").await;
    assert_eq!((row.generation, row.attempts), (1, 1), "never reclaimed");
    assert_eq!(sink.calls(), [[Seen::new("slow", 1, 1)]]);
    assert_eq!(sink.owned(), [[("slow".to_owned(), true)]]);
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

/// Two events and a relay of batches of one, whose sink holds the first until the test
/// cancels `released`: the second is claimed ahead meanwhile.
async fn behind_a_slow_send(
    pool: &PgPool,
    released: &CancellationToken,
) -> TestResult<(EventId, EventId, ScriptSink, Running)> {
    let first = long_send("first").enqueue(pool).await?.into_event_id();
    let second = long_send("second").enqueue(pool).await?.into_event_id();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |call, seen| match call {
            0 => Plan::after(Wait::Until(released.clone()), seen),
            _ => Plan::ok(seen),
        }
    });
    let relay = start(
        fast(Relay::<LongSend, _>::new(pool.clone(), sink.clone()))
            .batch_size(1)
            .send_timeout(Duration::from_mins(1)),
    );
    Ok((first, second, sink, relay))
}

#[tokio::test]
async fn a_batch_claimed_ahead_keeps_its_lease_behind_a_send_longer_than_the_lease() -> TestResult {
    let db = schema_from_zero(&[LongSend::migrations()]).await?;
    let pool = db.pool();
    let released = CancellationToken::new();
    let (first, second, sink, relay) = behind_a_slow_send(pool, &released).await?;
    // Claimed ahead: the second is claimed while the first is still in the sink (a
    // relay in sequence claims it in the transaction that records the first SENT).
    wait_until(
        "the second claimed behind the first's send",
        Duration::from_secs(10),
        async || {
            status::<LongSend>(pool, &first).await == "INPROGRESS"
                && status::<LongSend>(pool, &second).await == "INPROGRESS"
        },
    )
    .await;
    assert_eq!(sink.calls().len(), 1, "the first is still in the sink");
    // The first's send outlasts the lease the second was claimed with.
    wait_past(pool, lease_until(pool, second.as_str()).await).await;
    released.cancel();
    wait_until("both SENT", Duration::from_secs(10), async || {
        outbox::stats::<LongSend>(pool).await.unwrap().sent == 2
    })
    .await;
    relay.stop().await?;

    // The second's lease was renewed with the first's while it waited: it went out on
    // its first claim, where it used to expire and spend an attempt unsent.
    assert_eq!(
        sink.calls(),
        [[Seen::new(&first, 1, 1)], [Seen::new(&second, 1, 1)]]
    );
    let row = row_of::<LongSend>(pool, &second).await;
    assert_eq!((row.generation, row.attempts), (1, 1));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_in_flight_keeps_its_lease_while_the_worker_records_the_one_before_slowly()
-> TestResult {
    let db = schema_from_zero(&[LongSend::migrations()]).await?;
    let pool = db.pool();
    let first = long_send("first").enqueue(pool).await?.into_event_id();
    let second = long_send("second").enqueue(pool).await?.into_event_id();
    // Recording the first SENT takes the worker's connection for 4 s (as a row lock
    // held by an operator's statement, or a slow disk, would): longer than the second's
    // 3 s lease, while the second is in the sink. The first's own outcome stays
    // valid: its lease was checked when the statement began.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE slowed (at timestamptz);
         CREATE FUNCTION slow_record() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM pg_sleep(4);
             INSERT INTO slowed VALUES (clock_timestamp());
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow_record BEFORE UPDATE ON {table} FOR EACH ROW
             WHEN (NEW.status = 'SENT' AND NEW.event_id = '{first}')
             EXECUTE FUNCTION slow_record();",
        table = LongSend::SPEC.table(),
    )))
    .execute(pool)
    .await?;
    // Batches of one: the first stays in the sink until the second is claimed ahead,
    // the second until the first's slow recording is over.
    let (first_sent, second_sent) = (CancellationToken::new(), CancellationToken::new());
    let sink = ScriptSink::new({
        let (first_sent, second_sent) = (first_sent.clone(), second_sent.clone());
        move |call, seen| match call {
            0 => Plan::after(Wait::Until(first_sent.clone()), seen),
            1 => Plan::after(Wait::Until(second_sent.clone()), seen),
            _ => Plan::ok(seen),
        }
    });
    let relay = start(
        fast(Relay::<LongSend, _>::new(pool.clone(), sink.clone()))
            .batch_size(1)
            .send_timeout(Duration::from_mins(1)),
    );
    wait_until(
        "the second claimed behind the first's send",
        Duration::from_secs(10),
        async || status::<LongSend>(pool, &second).await == "INPROGRESS",
    )
    .await;
    first_sent.cancel();
    let slowed = async || {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM slowed")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    // 4 s after the second was claimed: its lease from then is over.
    wait_until(
        "the first is recorded, slowly",
        Duration::from_secs(30),
        async || slowed().await == 1,
    )
    .await;
    second_sent.cancel();
    wait_until("both SENT", Duration::from_secs(15), async || {
        outbox::stats::<LongSend>(pool).await.unwrap().sent == 2
    })
    .await;
    relay.stop().await?;
    assert_eq!(slowed().await, 1, "the first was recorded slowly, once");
    assert_eq!(
        sink.calls(),
        [[Seen::new(&first, 1, 1)], [Seen::new(&second, 1, 1)]],
        "each went out once"
    );
    let row = row_of::<LongSend>(pool, &second).await;
    assert_eq!(
        (row.generation, row.attempts),
        (1, 1),
        "the second's lease was renewed on another connection while the worker's recorded \
         the first, and never expired"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_claimed_ahead_that_was_taken_over_while_it_waited_is_not_published() -> TestResult
{
    let logs = Captured::default();
    // A current-thread runtime polls the relay's tasks on this thread: they log here.
    let _logging = logs.this_thread(tracing_subscriber::filter::LevelFilter::INFO);
    let db = schema_from_zero(&[LongSend::migrations()]).await?;
    let pool = db.pool();
    let released = CancellationToken::new();
    let (first, second, sink, relay) = behind_a_slow_send(pool, &released).await?;
    wait_until(
        "the second claimed ahead",
        Duration::from_secs(10),
        async || status::<LongSend>(pool, &second).await == "INPROGRESS",
    )
    .await;
    // Another publisher takes it over meanwhile (as after a pause of this relay's past
    // the lease).
    let theirs = take_over::<LongSend>(pool, &second).await;
    // A third event: once it is out, the worker has moved past the second.
    let third = long_send("third").enqueue(pool).await?.into_event_id();
    // The first's send ends once a renewal of the second (one a second, once a third of
    // its lease is gone) was rejected: the relay knows it lost the second.
    wait_until(
        "the relay finds the second taken over",
        Duration::from_secs(10),
        async || logs.lines_with(&["taken over while they waited"]) == 1,
    )
    .await;
    released.cancel();

    wait_until(
        "the slow send and the third SENT",
        Duration::from_secs(10),
        async || {
            status::<LongSend>(pool, &first).await == "SENT"
                && status::<LongSend>(pool, &third).await == "SENT"
        },
    )
    .await;
    assert_eq!(
        sink.calls(),
        [[Seen::new(&first, 1, 1)], [Seen::new(&third, 1, 1)]],
        "the batch claimed ahead was checked before the sink got it"
    );
    let row = row_of::<LongSend>(pool, &second).await;
    assert_eq!(
        (row.status.as_str(), row.generation),
        ("INPROGRESS", theirs)
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_worker_whose_database_goes_silent_closes_that_connection_and_goes_on() -> TestResult {
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    // The relay reaches PostgreSQL through a proxy that can go silent.
    let (proxy, through) = through_a_proxy(&db).await?;
    let event = ChaosEvent {
        key: "silenced".into(),
        order_seq: 1,
    };
    enqueue(pool, std::slice::from_ref(&event)).await;
    // The first send ends once the server is silent: the worker records its outcome
    // into the silence. (Well within a third of the lease, 2 s: no renewal runs
    // meanwhile.)
    let released = CancellationToken::new();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |call, seen| match call {
            0 => Plan::after(Wait::Until(released.clone()), seen),
            _ => Plan::ok(seen),
        }
    });
    let relay = start(fast(Relay::<ChaosEvent, _>::new(through, sink.clone())));
    wait_until("the send started", Duration::from_secs(5), async || {
        !sink.calls().is_empty()
    })
    .await;
    // The server goes silent on the worker's connection (a failover that left it
    // half-open), which the worker records the outcome on once the send is over. After
    // 10 s without an answer it closes that connection and goes on with a new one.
    proxy.freeze();
    released.cancel();
    wait_until("SENT", Duration::from_secs(40), async || {
        status::<ChaosEvent>(pool, "silenced").await == "SENT"
    })
    .await;
    // Its lease had run out meanwhile: the event was claimed and published again.
    let row = row_of::<ChaosEvent>(pool, "silenced").await;
    assert_eq!((row.generation, row.attempts), (2, 2));
    assert_eq!(sink.calls().len(), 2);
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

/// A proxy to `db`'s server, and a pool of 3 connections to `db` through it.
async fn through_a_proxy(db: &TestSchema) -> TestResult<(Proxy, PgPool)> {
    let direct: PgConnectOptions = db.url().parse()?;
    let (host, port) = (direct.get_host(), direct.get_port());
    let upstream = if host.starts_with('/') {
        format!("{host}/.s.PGSQL.{port}")
    } else {
        format!("{host}:{port}")
    };
    let proxy = Proxy::start(upstream).await?;
    let through = PgPoolOptions::new()
        .max_connections(3)
        .connect_with(direct.host("127.0.0.1").port(proxy.port))
        .await?;
    Ok((proxy, through))
}

/// Makes the row look claimed by another publisher: a newer generation, a live lease.
async fn take_over<T: Outbox>(pool: &PgPool, event_id: &EventId) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "UPDATE {} SET generation = generation + 1,
             lease_until = clock_timestamp() + interval '1 hour'
         WHERE event_id = $1 AND status = 'INPROGRESS' RETURNING generation",
        T::SPEC.table()
    )))
    .bind(event_id.as_str())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A sink that holds a batch with a victim until the relay says the victim is lost.
fn until_lost(victims: Vec<String>) -> ScriptSink {
    ScriptSink::new(
        move |_, seen| match seen.iter().find(|s| victims.contains(&s.event_id)) {
            Some(victim) => Plan::after(Wait::UntilLost(victim.event_id.clone()), seen),
            None => Plan::ok(seen),
        },
    )
}

#[tokio::test]
async fn a_rejected_renewal_abandons_that_event_and_records_the_rest_of_the_batch() -> TestResult {
    let db = schema_from_zero(&[PaymentCaptured::migrations()]).await?;
    let pool = db.pool();
    let ids = enqueue(pool, &[payment(1), payment(2)]).await;
    let (victim, other) = (&ids[0], &ids[1]);
    let sink = until_lost(vec![victim.to_string()]);
    let relay = start(
        fast(Relay::<PaymentCaptured, _>::new(pool.clone(), sink.clone()))
            .send_timeout(Duration::from_secs(30)),
    );
    wait_until(
        "the batch is in the sink",
        Duration::from_secs(5),
        async || !sink.calls().is_empty(),
    )
    .await;
    assert_eq!(
        sink.calls(),
        [[Seen::new(victim, 1, 1), Seen::new(other, 1, 1)]]
    );
    assert_eq!(take_over::<PaymentCaptured>(pool, victim).await, 2);

    wait_until(
        "the rest of the batch is SENT",
        Duration::from_secs(5),
        async || status::<PaymentCaptured>(pool, other).await == "SENT",
    )
    .await;
    assert_eq!(
        sink.owned(),
        [[(victim.to_string(), false), (other.to_string(), true)]],
        "the sink saw the victim's ownership_lost() complete, and only the victim's"
    );
    relay.stop().await?;
    let row = row_of::<PaymentCaptured>(pool, victim).await;
    assert_eq!(
        (
            row.status.as_str(),
            row.generation,
            row.attempts,
            row.last_error
        ),
        ("INPROGRESS", 2, 1, None),
        "the relay recorded nothing for the row it lost"
    );
    assert!(
        row.lease_left > Some(3000.0),
        "the new owner's lease is untouched"
    );
    assert_eq!(sink.abandoned(), 0);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_published_after_a_takeover_records_sent_for_every_row_but_the_taken_one()
-> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let ids = enqueue(pool, &[budgeted("victim"), budgeted("other")]).await;
    let (victim, other) = (&ids[0], &ids[1]);
    // In the sink until the takeover is done, far shorter than the 30 s lease: no renewal
    // notices it, so only the guard of the outcome statement stands between the relay
    // and the row.
    let released = CancellationToken::new();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |_, seen| Plan::after(Wait::Until(released.clone()), seen)
    });
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())));
    wait_until(
        "the batch is in the sink",
        Duration::from_secs(5),
        async || !sink.calls().is_empty(),
    )
    .await;
    let in_the_sink = Instant::now();
    assert_eq!(take_over::<Budgeted>(pool, victim).await, 2);
    released.cancel();
    let held = in_the_sink.elapsed();

    wait_until(
        "the rest of the batch is SENT",
        Duration::from_secs(5),
        async || status::<Budgeted>(pool, other).await == "SENT",
    )
    .await;
    relay.stop().await?;
    let row = row_of::<Budgeted>(pool, victim).await;
    assert_eq!(
        (row.status.as_str(), row.generation, row.attempts),
        ("INPROGRESS", 2, 1),
        "the sink reported the victim published, and its stale SENT was rejected"
    );
    assert!(
        row.lease_left > Some(3000.0),
        "the new owner's lease is untouched"
    );
    assert_eq!(
        sink.calls().len(),
        1,
        "the relay did not publish the victim again"
    );
    // What an operator sees of it: one stale outcome, one SENT, two claimed, in one
    // batch that spent in the sink at least the time the test held it there.
    let table = Budgeted::SPEC.table();
    let metric = |name| counters.get(name, table);
    assert_eq!(
        (
            metric(outbox::relay::metric::STALE),
            metric(outbox::relay::metric::SENT),
            metric(outbox::relay::metric::CLAIMED)
        ),
        (1, 1, 2)
    );
    assert_eq!(
        counters.samples(outbox::relay::metric::BATCH_SIZE, table),
        [2.0]
    );
    let publish = counters.samples(outbox::relay::metric::PUBLISH_SECONDS, table);
    assert!(
        matches!(publish[..], [seconds] if seconds >= held.as_secs_f64()),
        "one batch, in the sink for at least {held:?}: {publish:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_whose_every_renewal_is_rejected_is_abandoned_and_the_relay_goes_on() -> TestResult
{
    let db = schema_from_zero(&[PaymentCaptured::migrations()]).await?;
    let pool = db.pool();
    let lost = payment(1).enqueue(pool).await?.into_event_id();
    let sink = until_lost(vec![lost.to_string()]);
    let relay = start(
        fast(Relay::<PaymentCaptured, _>::new(pool.clone(), sink.clone()))
            .send_timeout(Duration::from_secs(30)),
    );
    wait_until(
        "the event is in the sink",
        Duration::from_secs(5),
        async || !sink.calls().is_empty(),
    )
    .await;
    take_over::<PaymentCaptured>(pool, &lost).await;
    wait_until(
        "the relay abandons the send",
        Duration::from_secs(5),
        async || sink.abandoned() == 1,
    )
    .await;

    let next = payment(2).enqueue(pool).await?.into_event_id();
    wait_until(
        "the next event is SENT",
        Duration::from_secs(5),
        async || status::<PaymentCaptured>(pool, &next).await == "SENT",
    )
    .await;
    relay.stop().await?;
    let row = row_of::<PaymentCaptured>(pool, &lost).await;
    assert_eq!(
        (row.status.as_str(), row.generation, row.attempts),
        ("INPROGRESS", 2, 1)
    );
    assert!(row.lease_left > Some(3000.0));
    assert!(
        sink.owned()
            .iter()
            .flatten()
            .all(|(id, _)| *id != lost.to_string())
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn transient_failures_back_off_with_growing_delays_until_the_budget_is_spent() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    record_history(pool, "budget_events").await;
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|_| Err(SinkError::transient("broker unavailable")))
            .collect(),
    });
    let (base, cap) = (Duration::from_millis(100), Duration::from_millis(300));
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .retry_backoff(Backoff::new(base, cap)),
    );
    let id = budgeted("flaky").enqueue(pool).await?.into_event_id();
    wait_until("the event is DEAD", Duration::from_secs(10), async || {
        status::<Budgeted>(pool, &id).await == "DEAD"
    })
    .await;
    two_more_empty_claims(&counters, "budget_events").await;
    relay.stop().await?;

    assert_eq!(
        sink.deliveries(),
        [
            Seen::new(&id, 1, 1),
            Seen::new(&id, 2, 2),
            Seen::new(&id, 3, 3)
        ],
        "three claims, then never again"
    );
    let delays = retry_delays(pool).await;
    // Equal jitter: attempt n waits between half and all of min(base * 2^(n-1), cap).
    assert_eq!(delays.len(), 2, "{delays:?}");
    assert!((50.0..=100.0).contains(&delays[0]), "{delays:?}");
    assert!((100.0..=200.0).contains(&delays[1]), "{delays:?}");
    assert!(delays[1] > delays[0], "the delay grows: {delays:?}");
    assert!(
        delays.iter().all(|&d| d <= 300.0),
        "never above the cap: {delays:?}"
    );

    let row = row_of::<Budgeted>(pool, &id).await;
    assert_eq!((row.generation, row.attempts), (3, 3));
    let error = row.last_error.unwrap();
    assert!(
        error.contains("attempt budget exhausted after 3 of 3 claims")
            && error.contains("broker unavailable"),
        "{error}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn retry_delays_stop_growing_at_the_backoff_cap() -> TestResult {
    let db = schema_from_zero(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    record_history(pool, "order_events").await;
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|_| Err(SinkError::transient("broker unavailable")))
            .collect(),
    });
    let relay = start(
        fast(Relay::<OrderPlaced, _>::new(pool.clone(), sink.clone())).retry_backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(80),
        )),
    );
    let event = OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: "ada".into(),
        total_cents: 1,
        note: None,
        lines: vec![],
    };
    let id = event.enqueue(pool).await?.into_event_id();
    wait_until("the event is DEAD", Duration::from_secs(15), async || {
        status::<OrderPlaced>(pool, &id).await == "DEAD"
    })
    .await;
    relay.stop().await?;

    let delays = retry_delays(pool).await;
    // OrderPlaced allows 10 claims: 9 retries, whose ceilings are 20, 40, then 80 ms.
    assert_eq!(delays.len(), 9, "{delays:?}");
    for (n, delay) in delays.iter().enumerate() {
        let ceiling = [20.0, 40.0, 80.0][n.min(2)];
        assert!(
            (ceiling / 2.0..=ceiling).contains(delay),
            "retry {}: {delay} ms, ceiling {ceiling} ms: {delays:?}",
            n + 1
        );
    }
    assert!(delays[0] < delays[1] && delays[1] < delays[2], "{delays:?}");
    let error = row_of::<OrderPlaced>(pool, &id).await.last_error.unwrap();
    assert!(error.contains("after 10 of 10 claims"), "{error}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_permanent_failure_moves_the_event_to_dead_at_once() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|s| {
                if s.event_id == "poison" {
                    Err(SinkError::permanent("rejected: message too large"))
                } else {
                    Ok(())
                }
            })
            .collect(),
    });
    enqueue(pool, &[budgeted("poison"), budgeted("fine")]).await;
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())));
    wait_until("both are recorded", Duration::from_secs(5), async || {
        status::<Budgeted>(pool, "poison").await == "DEAD"
            && status::<Budgeted>(pool, "fine").await == "SENT"
    })
    .await;
    two_more_empty_claims(&counters, "budget_events").await;
    relay.stop().await?;

    let poison = row_of::<Budgeted>(pool, "poison").await;
    assert_eq!(
        (
            poison.generation,
            poison.attempts,
            poison.last_error.as_deref()
        ),
        (1, 1, Some("rejected: message too large")),
        "no retry, the sink's message kept"
    );
    assert_eq!(
        sink.deliveries(),
        [Seen::new("poison", 1, 1), Seen::new("fine", 1, 1)]
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn requeue_dead_gives_dead_events_a_fresh_budget_and_leaves_other_rows_alone() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[
            budgeted("dead-1"),
            budgeted("dead-2"),
            budgeted("dead-3"),
            budgeted("sent"),
        ],
    )
    .await;
    for claim in Budgeted::claim_batch(pool, 10).await? {
        if claim.event().name == "sent" {
            claim.complete(pool).await?;
        } else {
            claim.fail(pool, "rejected").await?;
        }
    }
    budgeted("ready").enqueue(pool).await?;
    let before = (
        row_of::<Budgeted>(pool, "sent").await,
        row_of::<Budgeted>(pool, "ready").await,
    );

    let requeued =
        outbox::ops::requeue_dead::<Budgeted>(pool, &["dead-1", "sent", "ready", "no-such-event"])
            .await?;
    assert_eq!(requeued, ["dead-1"], "only the DEAD row is requeued");
    let dead_1 = row_of::<Budgeted>(pool, "dead-1").await;
    assert_eq!(
        (dead_1.status.as_str(), dead_1.attempts, dead_1.generation),
        ("READY", 0, 1),
        "a fresh budget; the generation keeps counting"
    );
    assert!(dead_1.due_in <= 0.0, "due now");
    let after = (
        row_of::<Budgeted>(pool, "sent").await,
        row_of::<Budgeted>(pool, "ready").await,
    );
    for (before, after) in [(&before.0, &after.0), (&before.1, &after.1)] {
        let fields = |r: &Row| {
            let (status, error) = (r.status.clone(), r.last_error.clone());
            (status, r.generation, r.attempts, error, r.next_attempt_at)
        };
        assert_eq!(fields(before), fields(after), "untouched");
    }
    assert_eq!(outbox::ops::requeue_all_dead::<Budgeted>(pool).await?, 2);
    assert_eq!(outbox::ops::requeue_all_dead::<Budgeted>(pool).await?, 0);

    let sink = MemorySink::new();
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())));
    wait_until("everything is SENT", Duration::from_secs(5), async || {
        count::<Budgeted>(pool, "SENT").await == 5
    })
    .await;
    relay.stop().await?;
    let mut published: Vec<(String, i64, u32)> = sink
        .published()
        .into_iter()
        .map(|p| (p.event.name, p.generation.get(), p.attempt))
        .collect();
    published.sort();
    assert_eq!(
        published,
        [
            ("dead-1".into(), 2, 1),
            ("dead-2".into(), 2, 1),
            ("dead-3".into(), 2, 1),
            ("ready".into(), 1, 1),
        ],
        "requeued events start their budget over; the SENT one is not published again"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_from_before_an_event_died_cannot_record_after_requeue_and_reclaim() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    budgeted("e").enqueue(pool).await?;
    let old = Budgeted::claim(pool).await?.expect("due");
    assert_eq!(old.generation().get(), 1);
    sqlx::query("UPDATE budget_events SET lease_until = now() - interval '1 second'")
        .execute(pool)
        .await?;
    let reclaim = Budgeted::claim(pool).await?.expect("expired");
    assert!(reclaim.is_reclaim());
    reclaim.fail(pool, "rejected").await?;
    assert_eq!(
        outbox::ops::requeue_dead::<Budgeted>(pool, &["e"]).await?,
        ["e"]
    );
    let current = Budgeted::claim(pool).await?.expect("requeued");
    assert_eq!((current.generation().get(), current.attempt()), (3, 1));

    let err = old.complete(pool).await.unwrap_err();
    assert!(
        matches!(err, OutboxError::Stale { generation, .. } if generation.get() == 1),
        "{err}"
    );
    let row = row_of::<Budgeted>(pool, "e").await;
    assert_eq!((row.status.as_str(), row.generation), ("INPROGRESS", 3));
    current.complete(pool).await?;
    assert_eq!(status::<Budgeted>(pool, "e").await, "SENT");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn prune_sent_deletes_only_old_sent_rows_a_batch_at_a_time() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names = [
        "old-sent-1",
        "old-sent-2",
        "old-sent-3",
        "new-sent",
        "late-sent",
        "old-dead",
        "old-held",
    ];
    enqueue(pool, &names.map(budgeted)).await;
    let mut held = None;
    for claim in Budgeted::claim_batch(pool, 10).await? {
        match claim.event().name.as_str() {
            "old-dead" => claim.fail(pool, "rejected").await?,
            "old-held" => held = Some(claim),
            _ => claim.complete(pool).await?,
        }
    }
    budgeted("old-ready").enqueue(pool).await?;
    sqlx::query(
        "UPDATE budget_events SET created_at = now() - interval '2 hours',
             next_attempt_at = now() - interval '2 hours' WHERE event_id LIKE 'old-%'",
    )
    .execute(pool)
    .await?;
    // Enqueued two hours ago, sent just now (held back all that time): its age is the
    // time since it was sent, and a producer repeating its id must still find it.
    sqlx::query(
        "UPDATE budget_events SET created_at = now() - interval '2 hours'
             WHERE event_id = 'late-sent'",
    )
    .execute(pool)
    .await?;

    let hour = Duration::from_hours(1);
    assert_eq!(outbox::ops::prune_sent::<Budgeted>(pool, hour, 2).await?, 2);
    assert_eq!(outbox::ops::prune_sent::<Budgeted>(pool, hour, 2).await?, 1);
    assert_eq!(outbox::ops::prune_sent::<Budgeted>(pool, hour, 2).await?, 0);
    let left = |pool: &PgPool| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT event_id FROM budget_events")
                .fetch_all(&pool)
                .await
                .unwrap()
                .into_iter()
                .collect::<BTreeSet<String>>()
        }
    };
    let expected: BTreeSet<String> = ["new-sent", "late-sent", "old-dead", "old-held", "old-ready"]
        .map(String::from)
        .into();
    assert_eq!(left(pool).await, expected);

    // Whatever the age, only SENT rows go.
    assert_eq!(
        outbox::ops::prune_sent::<Budgeted>(pool, Duration::ZERO, 10).await?,
        2
    );
    let expected: BTreeSet<String> = ["old-dead", "old-held", "old-ready"]
        .map(String::from)
        .into();
    assert_eq!(left(pool).await, expected);
    held.expect("claimed").complete(pool).await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_shutdown_hands_unsent_claims_back_without_counting_the_attempt() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[budgeted("first"), budgeted("second"), budgeted("third")],
    )
    .await;
    // "first" already used one attempt.
    let claim = Budgeted::claim(pool).await?.expect("due");
    let _ = claim
        .retry_because(pool, Duration::ZERO, "broker unavailable")
        .await?;

    let sink = ScriptSink::new(|_, seen| Plan::after(Wait::Forever, seen));
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .shutdown_grace(Duration::from_millis(200)),
    );
    wait_until(
        "the batch is in the sink",
        Duration::from_secs(5),
        async || !sink.calls().is_empty(),
    )
    .await;
    assert_eq!(
        sink.calls(),
        [[
            Seen::new("first", 2, 2),
            Seen::new("second", 1, 1),
            Seen::new("third", 1, 1)
        ]]
    );
    // The send never returns: `stop` returns because the grace ended it.
    relay.stop().await?;
    assert_eq!(sink.abandoned(), 1, "the hung send was dropped");

    for (name, generation, attempts, last_error) in [
        ("first", 2, 1, Some("broker unavailable")),
        ("second", 1, 0, None),
        ("third", 1, 0, None),
    ] {
        let row = row_of::<Budgeted>(pool, name).await;
        assert_eq!(
            (
                row.status.as_str(),
                row.generation,
                row.attempts,
                row.last_error.as_deref()
            ),
            ("READY", generation, attempts, last_error),
            "{name}"
        );
        assert!(
            row.due_in <= 0.0 && row.lease_left.is_none(),
            "{name}: {row:?}"
        );
    }
    let reclaimed = Budgeted::claim_batch(pool, 10).await?;
    let attempts: Vec<u32> = reclaimed.iter().map(outbox::Claim::attempt).collect();
    assert_eq!(
        attempts,
        [2, 1, 1],
        "claimable at once, the abandoned attempt not counted"
    );
    for claim in reclaimed {
        claim.complete(pool).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_shutdown_lets_a_send_in_flight_finish_and_records_it() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The send ends once the shutdown is under way.
    let released = CancellationToken::new();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |_, seen| Plan::after(Wait::Until(released.clone()), seen)
    });
    // Waits as long as it takes: the longest durations a user can ask for are accepted.
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .shutdown_grace(Duration::MAX)
            .poll_interval(Duration::MAX),
    );
    budgeted("in-flight").enqueue(pool).await?;
    wait_until("the send started", Duration::from_secs(5), async || {
        !sink.calls().is_empty()
    })
    .await;
    relay.begin_stop();
    released.cancel();
    relay.stop().await?;
    assert_eq!(status::<Budgeted>(pool, "in-flight").await, "SENT");
    assert_eq!(sink.abandoned(), 0);

    budgeted("after").enqueue(pool).await?;
    // `run` has returned: this only gives a task it left behind a chance to claim.
    sleep(Duration::from_millis(200)).await;
    let after = row_of::<Budgeted>(pool, "after").await;
    assert_eq!(
        (after.status.as_str(), after.generation),
        ("READY", 0),
        "stopped claiming"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_hung_sink_is_cut_off_by_the_send_timeout_and_the_batch_is_retried() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The first send hangs; the broker is back for the second.
    let sink = ScriptSink::new(|call, seen| {
        Plan::after(
            if call == 0 {
                Wait::Forever
            } else {
                Wait::Nothing
            },
            seen,
        )
    });
    record_history(pool, "budget_events").await;
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .send_timeout(Duration::from_millis(200))
            .retry_backoff(Backoff::new(Duration::from_secs(2), Duration::from_secs(2))),
    );
    budgeted("hung").enqueue(pool).await?;
    let mut retried = None;
    wait_until(
        "the timed-out send is retried",
        Duration::from_secs(5),
        async || {
            let row = row_of::<Budgeted>(pool, "hung").await;
            let done = row.status == "READY" && row.attempts == 1;
            retried = done.then_some(row);
            done
        },
    )
    .await;
    let retried = retried.expect("seen");
    let error = retried.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("publish timed out after 200ms"), "{error}");
    // Backed off by 1 to 2 s (equal jitter on 2 s), as the outcome's statement set it.
    let delays = retry_delays(pool).await;
    assert!(
        matches!(delays[..], [delay] if (1000.0..=2000.0).contains(&delay)),
        "{delays:?}"
    );
    assert_eq!(sink.abandoned(), 1, "the hung send was dropped");
    assert!(relay.is_running());

    wait_until("the retry is SENT", Duration::from_secs(5), async || {
        status::<Budgeted>(pool, "hung").await == "SENT"
    })
    .await;
    let row = row_of::<Budgeted>(pool, "hung").await;
    assert_eq!((row.generation, row.attempts), (2, 2));
    assert_eq!(sink.calls().len(), 2);
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sessions_do_not_stop_the_relay_and_every_event_ends_sent_once() -> TestResult {
    let db = schema_from_zero(&[PaymentCaptured::migrations()]).await?;
    // The relay uses the schema's pool, whose sessions carry the schema's name; the test
    // enqueues, kills and checks through a pool of its own, under another name.
    let options: PgConnectOptions = outbox::testing::database_url().await?.parse()?;
    let side = PgPoolOptions::new()
        .max_connections(3)
        .connect_with(
            options
                .options([("search_path", db.name())])
                .application_name("outbox_relay_test_side"),
        )
        .await?;
    let sink = ScriptSink::always_ok();
    let relay = start(
        Relay::<PaymentCaptured, _>::new(db.pool().clone(), sink.clone())
            .concurrency(2)
            .batch_size(5)
            .poll_interval(Duration::from_millis(50)),
    );
    let stop_killing = CancellationToken::new();
    let killer = tokio::spawn({
        let (pool, name, stop) = (side.clone(), db.name().to_owned(), stop_killing.clone());
        async move {
            let mut killed = 0;
            while !stop.is_cancelled() {
                let terminated: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&name)
                .fetch_all(&pool)
                .await
                .expect("terminate");
                killed += terminated.into_iter().filter(|&t| t).count();
                sleep(Duration::from_millis(150)).await;
            }
            killed
        }
    });

    let mut ids = Vec::new();
    for round in 0..20 {
        let events: Vec<PaymentCaptured> = (0..10).map(|n| payment(round * 10 + n)).collect();
        ids.extend(enqueue(&side, &events).await);
        sleep(Duration::from_millis(100)).await;
    }
    stop_killing.cancel();
    let kills = killer.await?;
    assert!(kills > 0, "sessions were killed");

    wait_until("every event is SENT", Duration::from_secs(30), async || {
        count::<PaymentCaptured>(&side, "SENT").await == 200
    })
    .await;
    assert!(relay.is_running(), "the relay kept going");
    relay.stop().await?;
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM payment_events")
        .fetch_one(&side)
        .await?;
    assert_eq!(total, 200, "each event is one row, SENT");
    let delivered: HashSet<String> = sink.deliveries().into_iter().map(|s| s.event_id).collect();
    let missing: Vec<&EventId> = ids
        .iter()
        .filter(|id| !delivered.contains(id.as_str()))
        .collect();
    assert!(missing.is_empty(), "never published: {missing:?}");
    // A killed session can cost a claim (the event is published again, under a new
    // generation), never publish one claim twice.
    let mut claims = HashSet::new();
    for seen in sink.deliveries() {
        assert!(
            claims.insert((seen.event_id.clone(), seen.generation)),
            "one claim published twice: {seen:?}"
        );
    }
    side.close().await;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn stats_count_statuses_expired_claims_and_the_oldest_waiting_age_since_enqueue() -> TestResult
{
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let empty = outbox::stats::<Budgeted>(pool).await?;
    assert_eq!(
        (
            empty.ready,
            empty.in_progress,
            empty.sent,
            empty.dead,
            empty.expired_claims
        ),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(
        (empty.oldest_waiting_age, empty.oldest_waiting_error),
        (None, None)
    );

    enqueue(pool, &["dead", "live", "expired", "sent"].map(budgeted)).await;
    let mut held = Vec::new();
    for claim in Budgeted::claim_batch(pool, 10).await? {
        match claim.event().name.as_str() {
            "sent" => claim.complete(pool).await?,
            "dead" => claim.fail(pool, "rejected").await?,
            _ => held.push(claim),
        }
    }
    enqueue(pool, &["due", "later"].map(budgeted)).await;
    // The ages since enqueue; the DEAD event, the oldest of all, waits for an operator,
    // not for the relay. Every waiting event was just made due again (an outage's
    // hand-back does that): the age still counts from the enqueue.
    sqlx::raw_sql(
        "UPDATE budget_events SET created_at = now() - interval '2 hours' WHERE event_id = 'dead';
         UPDATE budget_events SET created_at = now() - interval '20 minutes' WHERE event_id = 'live';
         UPDATE budget_events SET created_at = now() - interval '15 minutes',
             lease_until = now() - interval '1 minute' WHERE event_id = 'expired';
         UPDATE budget_events SET created_at = now() - interval '10 minutes',
             last_error = 'destination unavailable: connection refused' WHERE event_id = 'due';
         UPDATE budget_events SET next_attempt_at = now() + interval '1 hour' WHERE event_id = 'later';
         UPDATE budget_events SET next_attempt_at = now() WHERE event_id = 'due';",
    )
    .execute(pool)
    .await?;

    let stats = outbox::stats::<Budgeted>(pool).await?;
    assert_eq!(
        (
            stats.ready,
            stats.in_progress,
            stats.sent,
            stats.dead,
            stats.expired_claims
        ),
        (2, 2, 1, 1, 1)
    );
    let within = |age: Option<Duration>, minutes: u64| {
        age.is_some_and(|age| {
            Duration::from_mins(minutes) <= age && age < Duration::from_mins(minutes + 1)
        })
    };
    // A live claim is still to be published: the oldest waiting event.
    assert!(within(stats.oldest_waiting_age, 20), "{stats:?}");
    assert_eq!(stats.oldest_waiting_error, None, "nothing failed for it");

    // Once it is sent, the expired claim is the oldest, then the READY event with the
    // reason the relay wrote when it handed it back.
    let live = held.remove(0);
    assert_eq!(live.event().name, "live");
    live.complete(pool).await?;
    let stats = outbox::stats::<Budgeted>(pool).await?;
    assert!(within(stats.oldest_waiting_age, 15), "{stats:?}");
    held.remove(0).complete(pool).await.ok();
    sqlx::query(
        "UPDATE budget_events SET status = 'SENT', lease_until = NULL WHERE event_id = 'expired'",
    )
    .execute(pool)
    .await?;
    let stats = outbox::stats::<Budgeted>(pool).await?;
    assert!(within(stats.oldest_waiting_age, 10), "{stats:?}");
    assert_eq!(
        stats.oldest_waiting_error.as_deref(),
        Some("destination unavailable: connection refused")
    );

    // A time written by hand as -infinity is the longest age the outbox counts, not an
    // error that would stop the monitor.
    sqlx::query("UPDATE budget_events SET created_at = '-infinity' WHERE event_id = 'due'")
        .execute(pool)
        .await?;
    let stats = outbox::stats::<Budgeted>(pool).await?;
    assert_eq!(stats.oldest_waiting_age, Some(outbox::ops::MAX_INTERVAL));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_on_a_missing_table_returns_an_error_instead_of_spinning() -> TestResult {
    let db = TestSchema::new().await?;
    let sink = MemorySink::<Budgeted>::new();
    let relay = fast(Relay::<Budgeted, _>::new(db.pool().clone(), sink.clone())).concurrency(2);
    let outcome = timeout(Duration::from_secs(10), relay.run(CancellationToken::new()))
        .await
        .expect("run returns on its own");
    assert!(
        matches!(
            outcome,
            Err(OutboxError::MissingTable {
                table: "budget_events",
                ..
            })
        ),
        "{outcome:?}"
    );
    assert!(sink.published().is_empty());
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_sink_that_panics_on_one_event_costs_its_batch_mates_nothing_and_the_relay_goes_on()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &["a", "poison", "b", "c"].map(budgeted)).await;
    let sink = ScriptSink::new(|_, seen| {
        assert!(
            !seen.iter().any(|s| s.event_id == "poison"),
            "cannot serialize poison"
        );
        Plan::ok(seen)
    });
    let relay = until_poison_is_dead(pool, sink.clone()).await;

    for name in ["a", "b", "c"] {
        let row = row_of::<Budgeted>(pool, name).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{name}");
    }
    let poison = row_of::<Budgeted>(pool, "poison").await;
    assert_eq!(poison.attempts, 3, "the culprit alone spent its budget");
    let reason = poison.last_error.unwrap_or_default();
    assert!(
        reason.starts_with("attempt budget exhausted after 3 of 3 claims: sink panicked: ")
            && reason.contains("cannot serialize poison"),
        "{reason}"
    );
    let calls = sink.calls();
    let names = |call: &[Seen]| call.iter().map(|s| s.event_id.clone()).collect::<Vec<_>>();
    assert_eq!(names(&calls[0]), ["a", "poison", "b", "c"], "the batch");
    assert_eq!(
        calls[1..5].iter().map(|c| names(c)).collect::<Vec<_>>(),
        [["a"], ["poison"], ["b"], ["c"]],
        "then one event at a time"
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_sweep_that_keeps_failing_leaves_the_other_claims_room_to_publish() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // An expired claim, which only a sweep reclaims; and every reclaim fails, as a sweep
    // the server cancels after its statement_timeout does (with the horizon held back,
    // a sweep can take seconds).
    enqueue(pool, &[budgeted("expired")]).await;
    sqlx::raw_sql(
        "UPDATE budget_events SET status = 'INPROGRESS', attempts = 1,
             lease_until = now() - interval '1 minute' WHERE event_id = 'expired';
         CREATE FUNCTION cancel_reclaims() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.status = 'INPROGRESS' AND NEW.generation <> OLD.generation THEN
                 RAISE EXCEPTION 'canceling statement due to statement timeout'
                     USING ERRCODE = '57014';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER cancel_reclaims BEFORE UPDATE ON budget_events
             FOR EACH ROW EXECUTE FUNCTION cancel_reclaims();",
    )
    .execute(pool)
    .await?;
    let names: Vec<String> = (0..300).map(|i| format!("e{i}")).collect();
    let events: Vec<Budgeted> = names.iter().map(|name| budgeted(name)).collect();
    enqueue(pool, &events).await;

    let sink = MemorySink::<Budgeted>::new();
    let relay = start(
        fast(Relay::new(pool.clone(), sink.clone()))
            .batch_size(20)
            .concurrency(2),
    );
    wait_until(
        "the 300 due events SENT",
        Duration::from_secs(30),
        async || count::<Budgeted>(pool, "SENT").await == 300,
    )
    .await;
    relay.stop().await?;
    let published: Vec<String> = sink
        .published()
        .iter()
        .map(|p| p.event_id.to_string())
        .collect();
    let distinct: BTreeSet<&String> = published.iter().collect();
    assert_eq!(
        (published.len(), distinct.len()),
        (300, 300),
        "each published once: no outcome lost with a failed sweep"
    );
    assert_eq!(status::<Budgeted>(pool, "expired").await, "INPROGRESS");
    db.drop_schema().await?;
    Ok(())
}

/// Fails each event as its name says: `refused-..` for good, any other for now.
#[derive(Clone)]
struct FailingByName;

impl Sink<Budgeted> for FailingByName {
    async fn publish(&self, batch: &[Delivery<'_, Budgeted>]) -> Vec<Result<(), SinkError>> {
        batch
            .iter()
            .map(|delivery| {
                let name = &delivery.event().name;
                Err(if name.starts_with("refused") {
                    SinkError::permanent(format!("no such topic for {name}"))
                } else {
                    SinkError::transient(format!("broker busy for {name}"))
                })
            })
            .collect()
    }
}

/// A broker that fails every event of a batch writes one line per cause, not one per
/// event: a warning for the retries, an error for the events refused for good, another
/// for those whose budget ran out; each naming the table, an event, its attempt and the
/// reason. (The next line of a cause, after the interval, says how many were left out:
/// the failure log's own test.)
#[tokio::test]
async fn a_failing_broker_logs_one_line_per_cause_with_the_event_its_attempt_and_the_reason()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names = [
        "busy-1",
        "busy-2",
        "busy-3",
        "busy-4",
        "refused-1",
        "refused-2",
        "refused-3",
        "last-1",
        "last-2",
    ];
    enqueue(pool, &names.map(budgeted)).await;
    // The `last-..` events used two of their three attempts already.
    sqlx::query("UPDATE budget_events SET attempts = 2 WHERE event_id LIKE 'last-%'")
        .execute(pool)
        .await?;
    let logs = Captured::default();
    let _guard = logs.this_thread(tracing_subscriber::filter::LevelFilter::WARN);
    let hour = Duration::from_hours(1);
    let relay = start(
        fast(Relay::new(pool.clone(), FailingByName))
            .batch_size(100)
            .retry_backoff(Backoff::new(hour, hour)),
    );
    wait_until(
        "5 DEAD and 4 retried",
        Duration::from_secs(30),
        async || {
            count::<Budgeted>(pool, "DEAD").await == 5
                && count::<Budgeted>(pool, "READY").await == 4
        },
    )
    .await;
    relay.stop().await?;

    let text = logs.text();
    let line = |message: &str| -> Vec<&str> {
        text.lines().filter(|line| line.contains(message)).collect()
    };
    let retried = line("publishing an event failed; it will be retried");
    assert_eq!(retried.len(), 1, "{text}");
    for field in [
        " WARN ",
        "table=\"budget_events\"",
        "event_id=busy-",
        "attempt=1 ",
        "reason=broker busy for busy-",
        "suppressed=0",
    ] {
        assert!(retried[0].contains(field), "{field} in {}", retried[0]);
    }
    let refused = line("publishing an event failed for good; it is DEAD now");
    assert_eq!(refused.len(), 1, "{text}");
    for field in [
        " ERROR ",
        "event_id=refused-",
        "attempt=1 ",
        "reason=no such topic for refused-",
    ] {
        assert!(refused[0].contains(field), "{field} in {}", refused[0]);
    }
    let exhausted = line("failed on the last attempt of its budget; it is DEAD now");
    assert_eq!(exhausted.len(), 1, "{text}");
    for field in [
        " ERROR ",
        "event_id=last-",
        "attempt=3 ",
        "reason=broker busy for last-",
    ] {
        assert!(exhausted[0].contains(field), "{field} in {}", exhausted[0]);
    }
    assert_eq!(text.lines().count(), 3, "nothing else was logged:\n{text}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_server_whose_transactions_default_to_repeatable_read_costs_the_relay_nothing()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let names: Vec<String> = (0..2000).map(|i| format!("e{i}")).collect();
    let events: Vec<Budgeted> = names.iter().map(|name| budgeted(name)).collect();
    enqueue(db.pool(), &events).await;
    // As `ALTER DATABASE .. SET default_transaction_isolation` would make every session.
    let options = PgConnectOptions::from_str(&db.url())?
        .options([("default_transaction_isolation", "repeatable read")]);
    let pool = PgPoolOptions::new()
        .max_connections(5)
        .connect_with(options)
        .await?;
    let logs = Captured::default();
    let _guard = logs.this_thread(tracing_subscriber::filter::LevelFilter::WARN);
    let sink = MemorySink::<Budgeted>::new();
    let relay = start(
        fast(Relay::new(pool.clone(), sink.clone()))
            .batch_size(20)
            .concurrency(4),
    );
    wait_until("2000 SENT", Duration::from_mins(1), async || {
        count::<Budgeted>(db.pool(), "SENT").await == 2000
    })
    .await;
    relay.stop().await?;
    assert_eq!(
        logs.lines_with(&["failed"]),
        0,
        "no claim or recording failed on a concurrent claim:\n{}",
        logs.text()
    );
    // What the log says, the rows say too: every event claimed once, and sent once.
    let again: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM budget_events WHERE (attempts, generation) <> (1, 1)",
    )
    .fetch_one(db.pool())
    .await?;
    assert_eq!(again, 0, "an event was claimed twice");
    assert_eq!(sink.published().len(), 2000, "each event published once");
    pool.close().await;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_reason_a_latin1_database_cannot_hold_is_stored_escaped_and_the_relay_goes_on()
-> TestResult {
    let base = outbox::testing::database_url().await?;
    let name = format!(
        "outbox_latin1_{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    );
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&base)
        .await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    )))
    .execute(&admin)
    .await?;
    let options = PgConnectOptions::from_str(&base)?.database(&name);
    // The database is the cluster's: dropped whatever the test did.
    let outcome = AssertUnwindSafe(escaped_in_latin1(options))
        .catch_unwind()
        .await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)")))
        .execute(&admin)
        .await?;
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

async fn escaped_in_latin1(options: PgConnectOptions) -> TestResult {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    outbox::migrate(&pool, &[Budgeted::migrations()]).await?;
    enqueue(&pool, &[budgeted("snowman"), budgeted("plain")]).await;
    // A broker's reason in characters LATIN1 has (é) and has not (☃).
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|s| match s.event_id.as_str() {
                "snowman" => Err(SinkError::permanent("colis refusé ☃")),
                _ => Ok(()),
            })
            .collect(),
    });
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink)));
    wait_until(
        "snowman DEAD, plain SENT",
        Duration::from_secs(10),
        async || {
            status::<Budgeted>(&pool, "snowman").await == "DEAD"
                && status::<Budgeted>(&pool, "plain").await == "SENT"
        },
    )
    .await;
    assert!(relay.is_running(), "recording the reason did not stop it");
    relay.stop().await?;
    let reason = row_of::<Budgeted>(&pool, "snowman").await.last_error;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("colis refus\\u{e9} \\u{2603}")),
        "{reason:?}"
    );
    pool.close().await;
    Ok(())
}

/// A relay of `sink` retrying within milliseconds, once the poison event is `DEAD`:
/// still running, as a sink that panics never stops it.
async fn until_poison_is_dead<S: Sink<Budgeted>>(pool: &PgPool, sink: S) -> Running {
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink)).retry_backoff(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(20),
        )),
    );
    wait_until("poison is DEAD", Duration::from_secs(10), async || {
        status::<Budgeted>(pool, "poison").await == "DEAD"
    })
    .await;
    assert!(
        relay.is_running(),
        "a panicking sink does not stop the relay"
    );
    relay
}

/// A sink that checks each batch before it returns the future publishing it, and
/// panics on the poison event there.
#[derive(Clone)]
struct CheckedFirst(MemorySink<Budgeted>);

impl Sink<Budgeted> for CheckedFirst {
    fn publish(
        &self,
        batch: &[Delivery<'_, Budgeted>],
    ) -> impl Future<Output = Vec<Result<(), SinkError>>> + Send {
        assert!(
            !batch.iter().any(|d| d.event_id().as_str() == "poison"),
            "cannot serialize poison"
        );
        self.0.publish(batch)
    }
}

#[tokio::test]
async fn a_sink_that_panics_before_it_returns_its_future_is_contained_as_well() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &["a", "poison", "b"].map(budgeted)).await;
    let sink = CheckedFirst(MemorySink::new());
    let relay = until_poison_is_dead(pool, sink.clone()).await;
    for name in ["a", "b"] {
        assert_eq!(status::<Budgeted>(pool, name).await, "SENT", "{name}");
    }
    let reason = row_of::<Budgeted>(pool, "poison").await.last_error;
    assert!(
        reason
            .as_deref()
            .unwrap_or_default()
            .contains("cannot serialize poison"),
        "{reason:?}"
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

/// Runs `relay` until it returns on its own; fails the test if it keeps running.
async fn run_until_it_gives_up<T: Outbox, S: Sink<T>>(relay: Relay<T, S>) -> OutboxError {
    let outcome = timeout(Duration::from_secs(20), relay.run(CancellationToken::new()))
        .await
        .expect("a fatal error ends run promptly instead of backing off forever");
    let error = outcome.expect_err("run cannot succeed");
    assert!(!error.is_transient(), "{error:?}");
    error
}

/// A pool on `db`'s schema that connects as `user` (trust authentication), to `database`.
fn pool_as(db: &TestSchema, user: &str, database: Option<&str>) -> TestResult<PgPool> {
    let mut options: PgConnectOptions = db.url().parse()?;
    options = options.username(user);
    if let Some(database) = database {
        options = options.database(database);
    }
    Ok(PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options))
}

#[tokio::test]
async fn a_relay_whose_role_may_not_update_stops_with_permission_denied() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    budgeted("e").enqueue(db.pool()).await?;
    // The application's role: it may enqueue, not publish.
    let role = format!("outbox_app_{}", db.name());
    let grants = format!(
        "GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT, INSERT ON budget_events TO {role};",
        schema = db.name()
    );
    with_role(&db, &role, &grants, async {
        let pool = pool_as(&db, &role, None)?;
        let sink = MemorySink::<Budgeted>::new();
        let error = run_until_it_gives_up(fast(Relay::new(pool.clone(), sink.clone()))).await;
        assert!(
            matches!(
                error,
                OutboxError::PermissionDenied {
                    table: "budget_events",
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(sink.published().is_empty());
        assert_eq!(
            status::<Budgeted>(db.pool(), "e").await,
            "READY",
            "nothing lost"
        );
        pool.close().await;
        Ok(())
    })
    .await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_refused_by_the_server_stops_and_says_where() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    // The test's own role, whatever the server: `root` on CI, `postgres` on the
    // throwaway cluster, yours with your DATABASE_URL.
    let options: PgConnectOptions = db.url().parse()?;
    let own = options.get_username().to_owned();
    for (user, database, cause) in [
        ("no_such_role", None, "no_such_role"),
        (own.as_str(), Some("no_such_database"), "no_such_database"),
    ] {
        let pool = pool_as(&db, user, database)?;
        let error = run_until_it_gives_up(fast(Relay::new(
            pool.clone(),
            MemorySink::<Budgeted>::new(),
        )))
        .await;
        let OutboxError::Connect { endpoint, .. } = &error else {
            panic!("expected Connect, got {error:?}");
        };
        assert!(endpoint.contains(&format!(" as {user}")), "{endpoint}");
        assert!(error.to_string().contains(cause), "{error}");
        pool.close().await;
    }
    db.drop_schema().await?;
    Ok(())
}

/// `outbox::connect` fails at once, naming where and why: a port nothing listens on, a
/// database that does not exist, a URL that does not parse; and otherwise opens a pool.
#[tokio::test]
async fn connect_says_where_and_why_it_cannot() -> TestResult {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let refused = outbox::connect(&format!("postgres://ada@127.0.0.1:{port}/shop"))
        .await
        .expect_err("nothing listens there");
    let OutboxError::Connect { endpoint, .. } = &refused else {
        panic!("expected Connect, got {refused}");
    };
    assert_eq!(endpoint, &format!("127.0.0.1:{port}/shop as ada"));
    assert!(
        refused.to_string().contains("Connection refused") && refused.is_transient(),
        "{refused}"
    );
    assert_eq!(format!("{refused:?}"), refused.to_string());

    let db = TestSchema::new().await?;
    let options: PgConnectOptions = db.url().parse()?;
    let missing = outbox::connect_with(
        PgPoolOptions::new(),
        options.clone().database("no_such_database"),
    )
    .await
    .expect_err("no such database");
    assert!(
        matches!(missing, OutboxError::Connect { .. })
            && missing.to_string().contains("no_such_database")
            && !missing.is_transient(),
        "{missing}"
    );
    let garbled = outbox::connect("postgres://ada:secret@[nope/shop")
        .await
        .expect_err("not a URL");
    assert!(
        matches!(garbled, OutboxError::InvalidUrl { .. })
            && !garbled.to_string().contains("secret"),
        "{garbled}"
    );

    let pool = outbox::connect(&db.url()).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
    assert_eq!(one, 1);
    pool.close().await;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_on_a_table_that_lost_a_column_stops_with_drift() -> TestResult {
    let db = schema_from_zero(&[OrderPlaced::migrations()]).await?;
    sqlx::query("ALTER TABLE order_events DROP COLUMN note")
        .execute(db.pool())
        .await?;
    let error = run_until_it_gives_up(fast(Relay::new(
        db.pool().clone(),
        MemorySink::<OrderPlaced>::new(),
    )))
    .await;
    assert!(
        matches!(
            error,
            OutboxError::Drift {
                table: "order_events",
                ..
            }
        ),
        "{error:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn results_a_sink_leaves_out_are_retried() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The first call reports one result for three deliveries.
    let sink = ScriptSink::new(|call, seen| {
        let mut plan = Plan::ok(seen);
        if call == 0 {
            plan.results.truncate(1);
        }
        plan
    });
    enqueue(pool, &["e0", "e1", "e2"].map(budgeted)).await;
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())).retry_backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(50),
        )),
    );
    wait_until("all are SENT", Duration::from_secs(5), async || {
        count::<Budgeted>(pool, "SENT").await == 3
    })
    .await;
    relay.stop().await?;

    let calls = sink.calls();
    assert_eq!(
        calls[0],
        [
            Seen::new("e0", 1, 1),
            Seen::new("e1", 1, 1),
            Seen::new("e2", 1, 1)
        ]
    );
    let mut again = calls[1..].concat();
    again.sort_by(|a, b| a.event_id.cmp(&b.event_id));
    assert_eq!(again, [Seen::new("e1", 2, 2), Seen::new("e2", 2, 2)]);
    let e0 = row_of::<Budgeted>(pool, "e0").await;
    assert_eq!((e0.generation, e0.last_error), (1, None));
    for name in ["e1", "e2"] {
        let row = row_of::<Budgeted>(pool, name).await;
        assert_eq!(
            (row.generation, row.attempts, row.last_error.as_deref()),
            (2, 2, Some("the sink returned no result for this event")),
            "{name}"
        );
    }
    db.drop_schema().await?;
    Ok(())
}

/// Eight workers claiming from the head of one queue: no event is claimed by two of
/// them, and not one statement fails (a claim skipping rows that another worker claimed
/// after its snapshot still locks them until it commits; the relay records before it
/// claims, so workers waiting on such locks cannot deadlock).
#[tokio::test]
async fn eight_workers_share_a_backlog_without_a_double_claim_or_a_failed_statement() -> TestResult
{
    let warnings = Captured::default();
    // A current-thread runtime polls the relay's tasks on this thread: they log here.
    let _logging = warnings.this_thread(tracing_subscriber::filter::LevelFilter::WARN);
    let db = schema_from_zero(&[BenchEvent::migrations()]).await?;
    let events: Vec<BenchEvent> = (0..6_000)
        .map(|n| BenchEvent {
            payload: format!("{n:0>100}"),
        })
        .collect();
    BenchEvent::enqueue_all(&events, db.pool()).await?;
    let pool = db.connect(9).await?;
    let sink = MemorySink::new();
    let relay = start(
        Relay::<BenchEvent, _>::new(pool.clone(), sink.clone())
            .concurrency(8)
            .batch_size(50),
    );
    wait_until("all 6,000 are SENT", Duration::from_mins(1), async || {
        outbox::stats::<BenchEvent>(&pool).await.unwrap().sent == 6_000
    })
    .await;
    relay.stop().await?;
    let published = sink.published();
    let distinct: HashSet<&str> = published.iter().map(|p| p.event_id.as_str()).collect();
    assert_eq!(
        (published.len(), distinct.len()),
        (6_000, 6_000),
        "each event published exactly once"
    );
    let logged = warnings.text();
    assert!(logged.is_empty(), "the relay logged failures:\n{logged}");
    pool.close().await;
    db.drop_schema().await?;
    Ok(())
}

/// A sink whose first batch waits until the worker has claimed the next one beside it
/// (`ahead` more rows `INPROGRESS`), notes whether it saw that, and then cancels
/// `shutdown` if asked to.
#[derive(Clone)]
struct WaitsForTheClaimAhead {
    pool: PgPool,
    ahead: i64,
    first: Arc<Mutex<Option<bool>>>,
    shutdown: Option<CancellationToken>,
    published: Arc<Mutex<Vec<String>>>,
}

impl Sink<Budgeted> for WaitsForTheClaimAhead {
    async fn publish(&self, batch: &[Delivery<'_, Budgeted>]) -> Vec<Result<(), SinkError>> {
        let first = lock(&self.first).is_none();
        if first {
            let expected = i64::try_from(batch.len()).unwrap() + self.ahead;
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut saw = false;
            while !saw && Instant::now() < deadline {
                let in_progress: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM budget_events WHERE status = 'INPROGRESS'",
                )
                .fetch_one(&self.pool)
                .await
                .unwrap();
                saw = in_progress == expected;
                sleep(Duration::from_millis(10)).await;
            }
            *lock(&self.first) = Some(saw);
            if let Some(shutdown) = &self.shutdown {
                shutdown.cancel();
            }
        }
        let mut published = lock(&self.published);
        published.extend(batch.iter().map(|d| d.event().name.clone()));
        batch.iter().map(|_| Ok(())).collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[tokio::test]
async fn a_worker_claims_its_next_batch_while_the_sink_has_the_current_one() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names: Vec<String> = (0..15).map(|n| format!("event-{n:02}")).collect();
    enqueue(pool, &names.iter().map(|n| budgeted(n)).collect::<Vec<_>>()).await;
    let sink = WaitsForTheClaimAhead {
        pool: pool.clone(),
        ahead: 5,
        first: Arc::default(),
        shutdown: None,
        published: Arc::default(),
    };
    let relay = start(
        Relay::<Budgeted, _>::new(db.connect(3).await?, sink.clone())
            .concurrency(1)
            .batch_size(5),
    );
    wait_until("all 15 are SENT", Duration::from_secs(20), async || {
        outbox::stats::<Budgeted>(pool).await.unwrap().sent == 15
    })
    .await;
    relay.stop().await?;
    assert_eq!(
        *lock(&sink.first),
        Some(true),
        "the next 5 were claimed while the first 5 were in flight"
    );
    assert_eq!(
        *lock(&sink.published),
        names,
        "one worker: its batches in claim order, each event once"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_claimed_ahead_goes_back_uncounted_at_shutdown() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names: Vec<String> = (0..10).map(|n| format!("event-{n:02}")).collect();
    enqueue(pool, &names.iter().map(|n| budgeted(n)).collect::<Vec<_>>()).await;
    let shutdown = CancellationToken::new();
    let sink = WaitsForTheClaimAhead {
        pool: pool.clone(),
        ahead: 5,
        first: Arc::default(),
        shutdown: Some(shutdown.clone()),
        published: Arc::default(),
    };
    let relay = Relay::<Budgeted, _>::new(db.connect(3).await?, sink.clone())
        .concurrency(1)
        .batch_size(5);
    timeout(Duration::from_secs(15), relay.run(shutdown)).await??;
    assert_eq!(
        *lock(&sink.first),
        Some(true),
        "the second batch was claimed ahead"
    );

    for (n, name) in names.iter().enumerate() {
        let row: Row = row_of::<Budgeted>(pool, name.as_str()).await;
        if n < 5 {
            assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{name}");
        } else {
            // Claimed (generation 1), never sent: back, due now, the attempt not counted.
            assert_eq!(
                (row.status.as_str(), row.generation, row.attempts),
                ("READY", 1, 0),
                "{name}"
            );
            assert!(row.due_in <= 0.0, "{name} is due again");
        }
    }
    db.drop_schema().await?;
    Ok(())
}

/// The role of [`paused_relay_child`].
const PAUSED: &str = "paused-relay";

/// The relay process of the pause test: a relay of [`ChaosEvent`] on the test's schema
/// (the parameter `URL`), publishing nowhere, until its parent kills it. A no-op in a
/// normal run.
#[test]
fn paused_relay_child() {
    if !support::child::requested(PAUSED) {
        return;
    }
    support::broker::relay_until_killed(PAUSED, async || MemorySink::<ChaosEvent>::new());
}

/// A relay paused (SIGSTOP) between its claim statement and its commit holds the rows
/// it claimed locked, and every other claim skips them (`SKIP LOCKED`), the seed's
/// "open claim transaction": the server ends such a session once it has been idle in
/// its transaction for the relay's transaction limit (the lease, at least 10 s), and the
/// claim never happened.
#[tokio::test]
async fn a_relay_paused_inside_its_claim_transaction_holds_its_events_no_longer_than_its_limit()
-> TestResult {
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let event = ChaosEvent {
        key: "k".into(),
        order_seq: 1,
    };
    event.enqueue(pool).await?;
    // The child's claim takes 2 s on the server: long enough to pause the child while
    // it waits for the answer, which it then never gets to commit.
    let paused_name = format!("{}-paused", db.name());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$;
         CREATE TRIGGER slow_claim BEFORE UPDATE ON chaos_events FOR EACH ROW
             WHEN (NEW.status = 'INPROGRESS'
                   AND current_setting('application_name') = '{paused_name}')
             EXECUTE FUNCTION slow_claim();"
    )))
    .execute(pool)
    .await?;
    let url = format!("{}&application_name={paused_name}", db.url());
    let mut relay =
        support::child::ChildCommand::test("paused_relay_child").spawn(PAUSED, &[("URL", &url)])?;
    let session = async |state: &str, wait_event: Option<&str>| {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1 \
             AND state = $2 AND wait_event IS NOT DISTINCT FROM $3)",
        )
        .bind(&paused_name)
        .bind(state)
        .bind(wait_event)
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity")
    };
    wait_until(
        "the child's claim runs",
        Duration::from_secs(15),
        async || session("active", Some("PgSleep")).await,
    )
    .await;
    relay.signal(nix::sys::signal::Signal::SIGSTOP)?;
    let paused = Instant::now();
    wait_until(
        "the claim is done, and its transaction waits for a commit",
        Duration::from_secs(5),
        async || session("idle in transaction", Some("ClientRead")).await,
    )
    .await;
    assert!(
        ChaosEvent::claim(pool).await?.is_none(),
        "the paused claim's row is locked: skipped"
    );

    wait_until(
        "the server ends the paused session",
        Duration::from_secs(20),
        async || !session("idle in transaction", Some("ClientRead")).await,
    )
    .await;
    let held = paused.elapsed();
    let claim = ChaosEvent::claim(pool).await?.expect("free again");
    assert_eq!(
        claim.generation().get(),
        1,
        "the paused claim never happened: this is the first"
    );
    assert!(
        held >= Duration::from_secs(8),
        "ended by its idle limit (10 s), not sooner: {held:?}"
    );
    claim.complete(pool).await?;
    relay.kill()?;
    db.drop_schema().await?;
    Ok(())
}

/// Makes every claim of the event `poison` in `T`'s table fail (SQLSTATE P0001: not a
/// transient error), after whatever the same statement or transaction did before.
async fn refuse_to_claim_poison<T: Outbox>(pool: &PgPool) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'poison may not be claimed'; END $$;
         CREATE TRIGGER refuse_poison BEFORE UPDATE ON {} FOR EACH ROW
             WHEN (NEW.event_id = 'poison' AND NEW.status = 'INPROGRESS')
             EXECUTE FUNCTION refuse_poison();",
        T::SPEC.table()
    )))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_claim_outside_a_transaction_that_fails_after_claiming_hands_those_rows_back()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[budgeted("spent"), budgeted("kept"), budgeted("poison")],
    )
    .await;
    // "spent" is an expired claim whose budget (3) is used up: the first claim statement
    // moves it to DEAD and returns it with "kept", and the claim looks for one more row
    // in a second statement, which meets "poison" and fails.
    sqlx::query(
        "UPDATE budget_events SET status = 'INPROGRESS', attempts = 3, generation = 1,
             lease_until = clock_timestamp() - interval '1 second'
         WHERE event_id = 'spent'",
    )
    .execute(pool)
    .await?;
    refuse_to_claim_poison::<Budgeted>(pool).await;

    let error = Budgeted::claim_batch(pool, 2)
        .await
        .expect_err("the second claim statement fails");
    assert!(
        error.to_string().contains("poison may not be claimed"),
        "{error}"
    );

    // "kept" was claimed and committed by the first statement: handed back, due now,
    // the attempt not counted, rather than left to wait out its 30 s lease.
    let kept = row_of::<Budgeted>(pool, "kept").await;
    assert_eq!(
        (kept.status.as_str(), kept.attempts, kept.lease_left),
        ("READY", 0, None)
    );
    assert!(kept.due_in <= 0.0, "due now: {}", kept.due_in);
    assert_eq!(status::<Budgeted>(pool, "spent").await, "DEAD");
    assert_eq!(status::<Budgeted>(pool, "poison").await, "READY");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_that_fails_for_good_beside_recorded_outcomes_still_records_them() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names = ["a", "b", "c", "d", "poison"];
    enqueue(pool, &names.map(budgeted)).await;
    refuse_to_claim_poison::<Budgeted>(pool).await;
    // Batches of 2: {a, b} is published while {c, d} is claimed ahead; {c, d} is
    // published while a transaction records {a, b} and claims {poison}, which fails,
    // rolling the recording back with it. The relay stops (a trigger that refuses claims
    // needs a person), but what it published is recorded first: an unrecorded event
    // would be claimed and published again.
    let sink = ScriptSink::always_ok();
    let error = run_until_it_gives_up(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())).batch_size(2),
    )
    .await;
    assert!(
        error.to_string().contains("poison may not be claimed"),
        "{error}"
    );
    assert_eq!(sink.calls().len(), 2);
    for &name in &names[..4] {
        assert_eq!(status::<Budgeted>(pool, name).await, "SENT", "{name}");
    }
    assert_eq!(status::<Budgeted>(pool, "poison").await, "READY");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_send_whose_lease_ends_by_the_relays_clock_with_renewals_unanswered_is_abandoned_at_once()
-> TestResult {
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let (mut proxy, through) = through_a_proxy(&db).await?;
    let event = ChaosEvent {
        key: "unrenewed".into(),
        order_seq: 1,
    };
    enqueue(pool, std::slice::from_ref(&event)).await;
    // The first send never ends by itself; the send timeout is ten minutes.
    let sink = ScriptSink::new(|call, seen| match call {
        0 => Plan::after(Wait::Forever, seen),
        _ => Plan::ok(seen),
    });
    let relay = start(
        fast(Relay::<ChaosEvent, _>::new(through, sink.clone()))
            .send_timeout(Duration::from_mins(10)),
    );
    wait_until("the send started", Duration::from_secs(5), async || {
        !sink.calls().is_empty()
    })
    .await;
    // The database goes out of the relay's reach: no renewal gets an answer, and by the
    // relay's clock the 2 s lease ends. Nothing it could record would count any more, and
    // another publisher may claim the event: the sink is cut off then, not at the send
    // timeout.
    proxy.down();
    wait_until(
        "the send is abandoned",
        Duration::from_mins(1),
        async || sink.abandoned() == 1,
    )
    .await;
    let row = row_of::<ChaosEvent>(pool, "unrenewed").await;
    assert_eq!(
        (row.status.as_str(), row.generation),
        ("INPROGRESS", 1),
        "nothing recorded"
    );
    // Back in reach, the relay claims the event again once its lease has ended in the
    // database, and publishes it.
    proxy.up().await?;
    wait_until("SENT", Duration::from_secs(30), async || {
        status::<ChaosEvent>(pool, "unrenewed").await == "SENT"
    })
    .await;
    assert_eq!(row_of::<ChaosEvent>(pool, "unrenewed").await.generation, 2);
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}
