//! The relay against real PostgreSQL, one module per topic: publication, wake-ups,
//! leases and fencing, failures and backoff, the operator's repairs, shutdown, the claim
//! transaction, errors that stop it; a destination that is down; per-key ordering; the
//! runs of a key; the `delete_sent` retention mode; the monitor's gauges.

mod claims;
mod delete_sent;
mod errors;
mod fleet;
mod leases;
mod monitor;
mod operations;
mod ordering;
mod publishing;
mod retries;
mod runs;
mod shutdown;
mod unavailable;
mod wakeups;

use std::future::pending;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use outbox::{CancellationToken, Delivery, Relay, Sink, SinkError};
use outbox::{Outbox, OutboxError};
use outbox_testkit::app::PaymentCaptured;
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{Budgeted, LongSend};
use outbox_testkit::wait_until;
use sqlx::{AssertSqlSafe, PgPool};
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

/// Makes the row look claimed by another publisher (as after a pause of the relay's
/// past its lease): a newer generation, a lease an hour long. Returns the generation.
async fn take_over<T: Outbox>(pool: &PgPool, event_id: &(impl AsRef<str> + ?Sized)) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "UPDATE {} SET generation = generation + 1,
             lease_until = clock_timestamp() + interval '1 hour'
         WHERE event_id = $1 AND status = 'INPROGRESS' RETURNING generation",
        T::SPEC.table()
    )))
    .bind(event_id.as_ref())
    .fetch_one(pool)
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

    /// A sink whose first call lasts until the test cancels `released`; the others
    /// answer at once.
    fn holding_the_first_call(released: &CancellationToken) -> Self {
        let released = released.clone();
        Self::new(move |call, seen| match call {
            0 => Plan::after(Wait::Until(released.clone()), seen),
            _ => Plan::ok(seen),
        })
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

    /// The event id of every delivery, in the order the sink got them.
    fn event_ids(&self) -> Vec<String> {
        self.deliveries()
            .into_iter()
            .map(|seen| seen.event_id)
            .collect()
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

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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
