//! Runs of a key: the relay claims a key's first event still to go together with the
//! events after it, and publishes them in order, each acknowledged before the next
//! goes, while other keys go out beside them. What follows an event that was not
//! published is handed back unattempted and waits behind it, as if never claimed.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::relay::Backoff;
use outbox::{CancellationToken, Delivery, Outbox, Relay, Sink, SinkError};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{
    Address, KeyedNote, KeyedReminder, LenientStep, OrderStep, OrderedChaosEvent,
};
use outbox_testkit::logs::Captured;
use outbox_testkit::rows::{row_of, status};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};

use crate::{ScriptSink, Seen, fast, take_over};

/// An event's name, as the tests script and read it.
trait Named {
    fn name(&self) -> &str;
}

impl Named for OrderStep {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for LenientStep {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for KeyedReminder {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for OrderedChaosEvent {
    fn name(&self) -> &str {
        &self.name
    }
}

/// A sink that writes down each call's events, in order, and answers as scripted: an
/// event's scripted failures first, then success.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<Vec<String>>>>,
    failures: Arc<Mutex<HashMap<String, VecDeque<SinkError>>>>,
}

impl Scripted {
    fn failing(self, name: &str, errors: impl IntoIterator<Item = SinkError>) -> Self {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), errors.into_iter().collect());
        self
    }

    fn calls(&self) -> Vec<Vec<String>> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every delivery, in the order the sink got them.
    fn deliveries(&self) -> Vec<String> {
        self.calls().concat()
    }
}

impl<T: Named + Send + Sync> Sink<T> for Scripted {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        let names: Vec<String> = batch.iter().map(|d| d.event().name().to_owned()).collect();
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let results = names
            .iter()
            .map(|name| {
                failures
                    .get_mut(name)
                    .and_then(VecDeque::pop_front)
                    .map_or(Ok(()), Err)
            })
            .collect();
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(names);
        results
    }
}

fn step(name: &str, order_id: i64) -> OrderStep {
    OrderStep {
        name: name.into(),
        order_id,
    }
}

/// A relay of one worker, batches of `batch`, quick retries.
fn relay<T: Outbox, S: Sink<T>>(pool: &sqlx::PgPool, sink: S, batch: u32) -> Relay<T, S> {
    Relay::new(pool.clone(), sink)
        .batch_size(batch)
        .poll_interval(Duration::from_millis(100))
        .retry_backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_millis(50),
        ))
}

/// Asserts that no call of the sink had two events of one key (by the events' names'
/// first letter).
fn one_per_key_per_call(calls: &[Vec<String>]) {
    for call in calls {
        let mut keys: Vec<char> = call.iter().filter_map(|n| n.chars().next()).collect();
        keys.sort_unstable();
        let before = keys.len();
        keys.dedup();
        assert_eq!(
            keys.len(),
            before,
            "a call with two events of a key: {call:?}"
        );
    }
}

#[tokio::test]
async fn a_run_goes_out_an_event_at_a_time_and_what_follows_a_failure_waits_unattempted()
-> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let events = ["a1", "a2", "a3", "a4", "a5"].map(|name| step(name, 1));
    OrderStep::enqueue_all(&events, pool).await?;
    OrderStep::enqueue_all(&[step("b1", 2)], pool).await?;
    let sink = Scripted::default().failing("a3", [SinkError::transient("the broker said no")]);

    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 6
    })
    .await;
    running.stop().await?;

    // One claim took the whole of key 1 with b1: each key's first event together, then
    // a2, then a3, which failed: a4 and a5 were not sent, and went after a3's retry.
    let calls = sink.calls();
    one_per_key_per_call(&calls);
    assert_eq!(calls[..3], [vec!["a1", "b1"], vec!["a2"], vec!["a3"]]);
    assert_eq!(
        sink.deliveries()[4..],
        ["a3", "a4", "a5"],
        "after the failed a3: {calls:?}"
    );
    // The events handed back were not charged an attempt.
    assert_eq!(row_of::<OrderStep>(pool, "a3").await.attempts, 2);
    for name in ["a1", "a2", "a4", "a5", "b1"] {
        assert_eq!(row_of::<OrderStep>(pool, name).await.attempts, 1, "{name}");
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_dead_event_in_a_run_holds_the_rest_of_its_key() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let events = ["a1", "a2", "a3"].map(|name| step(name, 1));
    OrderStep::enqueue_all(&events, pool).await?;
    let sink = Scripted::default().failing("a2", [SinkError::permanent("malformed")]);

    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10));
    wait_until("a1 SENT, a2 DEAD", Duration::from_secs(30), async || {
        let stats = outbox::stats::<OrderStep>(pool).await.unwrap();
        (stats.sent, stats.dead) == (1, 1)
    })
    .await;
    running.stop().await?;

    assert_eq!(sink.deliveries(), ["a1", "a2"], "a3 was never sent");
    let a3 = row_of::<OrderStep>(pool, "a3").await;
    assert_eq!((a3.status.as_str(), a3.attempts), ("READY", 0));
    assert!(
        OrderStep::claim(pool).await?.is_none(),
        "a3 waits for an operator"
    );
    assert_eq!(outbox::stats::<OrderStep>(pool).await?.held_keys, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_undecodable_event_in_a_run_holds_the_rest_of_its_key_unattempted() -> TestResult {
    let db = schema_with(&[KeyedNote::migrations()]).await?;
    let pool = db.pool();
    let notes: Vec<KeyedNote> = (1..=4)
        .map(|n| KeyedNote {
            name: format!("n{n}"),
            order_id: 1,
            body: Address {
                city: "Oslo".into(),
            },
        })
        .collect();
    KeyedNote::enqueue_all(&notes, pool).await?;
    // n2's payload, rewritten behind the outbox's back, no longer decodes.
    sqlx::query("UPDATE keyed_note_events SET body = '\"no city\"' WHERE event_id = 'n2'")
        .execute(pool)
        .await?;
    let sink = ScriptSink::always_ok();
    let running = start(relay::<KeyedNote, _>(pool, sink.clone(), 10));
    wait_until("n1 SENT, n2 DEAD", Duration::from_secs(30), async || {
        let stats = outbox::stats::<KeyedNote>(pool).await.unwrap();
        (stats.sent, stats.dead) == (1, 1)
    })
    .await;

    // One claim took the run; n2 went to DEAD unsent, and n3, n4 were handed back, their
    // attempt not counted, to wait behind it.
    assert!(
        row_of::<KeyedNote>(pool, "n2")
            .await
            .last_error
            .is_some_and(|error| error.starts_with("cannot decode payload"))
    );
    for name in ["n3", "n4"] {
        let row = row_of::<KeyedNote>(pool, name).await;
        assert_eq!((row.status.as_str(), row.attempts), ("READY", 0), "{name}");
    }
    assert_eq!(
        sink.deliveries(),
        [Seen::new(
            "n1",
            row_of::<KeyedNote>(pool, "n1").await.generation,
            1
        )]
    );
    // The operator mends n2 and requeues it: the key goes on, in order.
    sqlx::query("UPDATE keyed_note_events SET body = '{\"city\": \"Oslo\"}' WHERE event_id = 'n2'")
        .execute(pool)
        .await?;
    outbox::ops::requeue_dead::<KeyedNote>(pool, &["n2"]).await?;
    wait_until("all four SENT", Duration::from_secs(30), async || {
        outbox::stats::<KeyedNote>(pool).await.unwrap().sent == 4
    })
    .await;
    running.stop().await?;
    assert_eq!(
        sink.event_ids(),
        ["n1", "n2", "n3", "n4"],
        "once each, in order"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn with_dead_releases_key_a_dead_event_in_a_run_lets_the_rest_go_after_it() -> TestResult {
    let db = schema_with(&[LenientStep::migrations()]).await?;
    let pool = db.pool();
    let order = uuid::Uuid::now_v7();
    let events = ["a1", "a2", "a3"].map(|name| LenientStep {
        name: name.into(),
        order_id: order,
    });
    LenientStep::enqueue_all(&events, pool).await?;
    let sink = Scripted::default().failing("a2", [SinkError::permanent("malformed")]);

    let running = start(relay::<LenientStep, _>(pool, sink.clone(), 10));
    wait_until(
        "a1 and a3 SENT, a2 DEAD",
        Duration::from_secs(30),
        async || {
            let stats = outbox::stats::<LenientStep>(pool).await.unwrap();
            (stats.sent, stats.dead) == (2, 1)
        },
    )
    .await;
    running.stop().await?;

    // a3 was handed back when a2 failed, and went once a2 was DEAD.
    let calls = sink.calls();
    assert_eq!(calls, [vec!["a1"], vec!["a2"], vec!["a3"]]);
    assert_eq!(row_of::<LenientStep>(pool, "a3").await.attempts, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_run_ends_before_an_event_scheduled_for_later() -> TestResult {
    let db = schema_with(&[KeyedReminder::migrations()]).await?;
    let pool = db.pool();
    let reminder = |name: &str| KeyedReminder {
        name: name.into(),
        account: 7,
    };
    reminder("r1").enqueue(pool).await?;
    reminder("r2")
        .enqueue_after(Duration::from_millis(500), pool)
        .await?;
    reminder("r3").enqueue(pool).await?;
    let sink = Scripted::default();

    let running = start(relay::<KeyedReminder, _>(pool, sink.clone(), 10));
    wait_until(
        "every reminder is SENT",
        Duration::from_secs(30),
        async || outbox::stats::<KeyedReminder>(pool).await.unwrap().sent == 3,
    )
    .await;
    running.stop().await?;

    // r1's run stopped at r2, not yet due; r3 went after r2, in its run.
    let calls = sink.calls();
    assert_eq!(calls[0], ["r1"]);
    assert_eq!(sink.deliveries(), ["r1", "r2", "r3"], "{calls:?}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn keys_share_a_batch_every_key_first_then_the_runs() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    // One hot key (h, 30 events) enqueued before five quiet ones (one event each).
    let hot: Vec<OrderStep> = (1..=30).map(|n| step(&format!("h{n}"), 1)).collect();
    OrderStep::enqueue_all(&hot, pool).await?;
    let quiet = [("m1", 2), ("n1", 3), ("o1", 4), ("p1", 5), ("q1", 6)];
    OrderStep::enqueue_all(&quiet.map(|(name, key)| step(name, key)), pool).await?;
    let sink = Scripted::default();

    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 35
    })
    .await;
    running.stop().await?;

    // The first batch of ten: the hot key's first event and every quiet key's, then the
    // four events after h1 in the room they left.
    let calls = sink.calls();
    one_per_key_per_call(&calls);
    assert_eq!(calls[0], ["h1", "m1", "n1", "o1", "p1", "q1"]);
    assert_eq!(calls[1..5], [["h2"], ["h3"], ["h4"], ["h5"]]);
    // The hot key's later batches are runs of ten, in order.
    let hot_order: Vec<String> = sink
        .deliveries()
        .into_iter()
        .filter(|name| name.starts_with('h'))
        .collect();
    let expected: Vec<String> = (1..=30).map(|n| format!("h{n}")).collect();
    assert_eq!(hot_order, expected);
    assert!(
        calls.len() <= 30 + 1,
        "one call per layer: {} calls",
        calls.len()
    );
    db.drop_schema().await?;
    Ok(())
}

/// A sink that takes `a1` and then hangs on `a2`, as a publisher paused mid-run does,
/// until `wake` is notified.
#[derive(Clone)]
struct HangsOnA2 {
    taken: Arc<Mutex<Vec<String>>>,
    hanging: Arc<tokio::sync::Notify>,
    wake: Arc<tokio::sync::Notify>,
}

impl Sink<OrderStep> for HangsOnA2 {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        for delivery in batch {
            if delivery.event().name == "a2" {
                self.hanging.notify_one();
                self.wake.notified().await;
            }
            self.taken
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(delivery.event().name.clone());
        }
        batch.iter().map(|_| Ok(())).collect()
    }
}

#[tokio::test]
async fn a_run_whose_lease_ends_mid_send_is_reclaimed_whole_and_in_order() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let events = ["a1", "a2", "a3"].map(|name| step(name, 1));
    OrderStep::enqueue_all(&events, pool).await?;
    let stalled = HangsOnA2 {
        taken: Arc::default(),
        hanging: Arc::default(),
        wake: Arc::default(),
    };
    let first = start(relay::<OrderStep, _>(pool, stalled.clone(), 10));
    tokio::time::timeout(Duration::from_secs(30), stalled.hanging.notified()).await?;

    // The first publisher took a1 and hangs on a2; its run's lease ends meanwhile.
    let expired = sqlx::query(
        "UPDATE order_step_events SET lease_until = statement_timestamp() - interval '1 second'
         WHERE status = 'INPROGRESS'",
    )
    .execute(pool)
    .await?;
    assert_eq!(expired.rows_affected(), 3, "one claim took the whole run");
    let sink = Scripted::default();
    let second = start(relay::<OrderStep, _>(pool, sink.clone(), 10));
    wait_until("the run is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 3
    })
    .await;
    second.stop().await?;

    // Reclaimed whole: a1 again, then a2 and a3, one after the other.
    assert_eq!(sink.calls(), [vec!["a1"], vec!["a2"], vec!["a3"]]);
    for name in ["a1", "a2", "a3"] {
        assert_eq!(row_of::<OrderStep>(pool, name).await.attempts, 2, "{name}");
    }
    // The stale publisher wakes up: its late copies record nothing.
    stalled.wake.notify_one();
    first.stop().await?;
    assert_eq!(outbox::stats::<OrderStep>(pool).await?.sent, 3);
    db.drop_schema().await?;
    Ok(())
}

/// The role of [`mid_run_relay_child`], and what it says once it hangs on `a2`.
const MID_RUN: &str = "mid-run-relay";
const HANGING: &str = "mid-run-relay hangs on a2";

/// The relay process of the SIGKILL test: a relay of [`OrderedChaosEvent`] on the
/// test's schema (the parameter `URL`) whose broker takes `a1` and never answers for
/// `a2`, until its parent kills it. A no-op in a normal run.
#[test]
fn mid_run_relay_child() {
    if !outbox_testkit::child::requested(MID_RUN) {
        return;
    }
    outbox_testkit::broker::relay_until_killed::<OrderedChaosEvent, _>(MID_RUN, async || {
        HangsMidRun
    });
}

/// Takes `a1`; takes `a2` and never answers.
struct HangsMidRun;

impl Sink<OrderedChaosEvent> for HangsMidRun {
    async fn publish(
        &self,
        batch: &[Delivery<'_, OrderedChaosEvent>],
    ) -> Vec<Result<(), SinkError>> {
        if batch.iter().any(|delivery| delivery.event().name == "a2") {
            outbox_testkit::child::say(HANGING);
            std::future::pending::<()>().await;
        }
        batch.iter().map(|_| Ok(())).collect()
    }
}

/// A relay process is SIGKILLed in the middle of a run: its broker took `a1` and holds
/// `a2` unanswered, `a3` to `a5` are not sent. Nothing of the run was recorded: once its
/// lease ends (2 s, no longer renewed), another relay reclaims the run whole, in one
/// claim, and publishes it in order from `a1`.
#[tokio::test]
async fn a_run_whose_relay_is_killed_mid_send_is_reclaimed_whole_and_in_order() -> TestResult {
    let db = schema_with(&[OrderedChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let names = ["a1", "a2", "a3", "a4", "a5"];
    OrderedChaosEvent::enqueue_all(&short_leased(&names), pool).await?;
    let mut child = outbox_testkit::child::ChildCommand::test("runs::mid_run_relay_child")
        .spawn(MID_RUN, &[("URL", &db.url())])?;
    outbox_testkit::child::handshake(child.stderr()?, HANGING, Duration::from_secs(30)).await?;
    for name in names {
        let row = row_of::<OrderedChaosEvent>(pool, name).await;
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("INPROGRESS", 1),
            "{name}: one claim took the whole run"
        );
    }
    child.kill()?;

    let sink = Scripted::default();
    let second = start(relay::<OrderedChaosEvent, _>(pool, sink.clone(), 10));
    wait_until("the run is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderedChaosEvent>(pool).await.unwrap().sent == 5
    })
    .await;
    second.stop().await?;
    // Reclaimed whole: a1 again (the broker has it twice: first in order all the same),
    // then the rest, each after the one before was acknowledged.
    assert_eq!(
        sink.calls(),
        names.map(|name| vec![name.to_owned()]),
        "the run, in order, an event per call"
    );
    for name in names {
        assert_eq!(
            row_of::<OrderedChaosEvent>(pool, name).await.attempts,
            2,
            "{name}: reclaimed once"
        );
    }
    db.drop_schema().await?;
    Ok(())
}

/// A sink that, before it answers for `last` (the end of a run), waits until `next`,
/// the event after it in its key, is claimed: claimed ahead, while the run was out.
/// Otherwise it answers as `scripted` says.
#[derive(Clone)]
struct WaitsForTheClaimAhead {
    scripted: Scripted,
    pool: sqlx::PgPool,
    last: &'static str,
    next: &'static str,
    /// Whether `next` was claimed while `last` was out.
    claimed_ahead: Arc<Mutex<Option<bool>>>,
}

impl WaitsForTheClaimAhead {
    fn new(
        scripted: Scripted,
        pool: &sqlx::PgPool,
        last: &'static str,
        next: &'static str,
    ) -> Self {
        Self {
            scripted,
            pool: pool.clone(),
            last,
            next,
            claimed_ahead: Arc::default(),
        }
    }

    fn claimed_ahead(&self) -> Option<bool> {
        *self
            .claimed_ahead
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sink<OrderStep> for WaitsForTheClaimAhead {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        if batch.iter().any(|d| d.event().name == self.last) && self.claimed_ahead().is_none() {
            let claimed = tokio::time::timeout(Duration::from_secs(10), async {
                while status::<OrderStep>(&self.pool, self.next).await != "INPROGRESS" {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .is_ok();
            *self
                .claimed_ahead
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(claimed);
        }
        self.scripted.publish(batch).await
    }
}

/// A hot key's 30 events, `h1` to `h30`.
fn hot_key() -> Vec<OrderStep> {
    (1..=30).map(|n| step(&format!("h{n}"), 1)).collect()
}

/// Enqueues [`hot_key`] and publishes it through a relay of batches of 10 and `sink`.
async fn drain_the_hot_key<S: Sink<OrderStep>>(pool: &sqlx::PgPool, sink: S) -> TestResult {
    OrderStep::enqueue_all(&hot_key(), pool).await?;
    let running = start(relay::<OrderStep, _>(pool, sink, 10));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 30
    })
    .await;
    running.stop().await?;
    Ok(())
}

/// Publishes [`hot_key`] through a relay of batches of 10 whose sink answers as
/// `scripted` says, and checks that h11 was claimed while h10 was out: the batch after
/// h1..h10 continued that run, claimed beside its send instead of after its recording.
async fn publish_the_hot_key(
    pool: &sqlx::PgPool,
    scripted: Scripted,
) -> TestResult<WaitsForTheClaimAhead> {
    let sink = WaitsForTheClaimAhead::new(scripted, pool, "h10", "h11");
    drain_the_hot_key(pool, sink.clone()).await?;
    assert_eq!(
        sink.claimed_ahead(),
        Some(true),
        "h11 claimed while h10 was out"
    );
    Ok(sink)
}

#[tokio::test]
async fn while_a_run_is_out_the_worker_claims_its_continuation_ahead() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let sink = publish_the_hot_key(db.pool(), Scripted::default()).await?;

    let expected: Vec<String> = (1..=30).map(|n| format!("h{n}")).collect();
    assert_eq!(sink.scripted.deliveries(), expected, "once each, in order");
    one_per_key_per_call(&sink.scripted.calls());
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_continuation_claimed_ahead_waits_unattempted_when_its_run_breaks() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let scripted = Scripted::default().failing("h10", [SinkError::transient("the broker said no")]);
    let sink = publish_the_hot_key(pool, scripted).await?;

    // h11..h20, claimed while h10 was out, were handed back unsent when h10 failed, and
    // went after h10's retry, their attempt not counted.
    let mut expected: Vec<String> = (1..=10).map(|n| format!("h{n}")).collect();
    expected.extend((10..=30).map(|n| format!("h{n}")));
    assert_eq!(sink.scripted.deliveries(), expected);
    assert_eq!(row_of::<OrderStep>(pool, "h10").await.attempts, 2);
    for n in (1..=9).chain(11..=30) {
        let name = format!("h{n}");
        assert_eq!(
            row_of::<OrderStep>(pool, name.as_str()).await.attempts,
            1,
            "{name}"
        );
    }
    db.drop_schema().await?;
    Ok(())
}

/// The events `a1`, `a2`, .. of one order, with a lease of 2 s.
fn short_leased(names: &[&str]) -> Vec<OrderedChaosEvent> {
    names
        .iter()
        .zip(1..)
        .map(|(name, seq)| OrderedChaosEvent {
            name: (*name).into(),
            order_id: 1,
            seq,
        })
        .collect()
}

#[tokio::test]
async fn a_run_claimed_ahead_whose_first_event_is_taken_over_hands_the_rest_back_at_once()
-> TestResult {
    let logs = Captured::default();
    // A current-thread runtime polls the relay's tasks on this thread: they log here.
    let _logging = logs.this_thread(tracing_subscriber::filter::LevelFilter::INFO);
    let db = schema_with(&[OrderedChaosEvent::migrations()]).await?;
    let pool = db.pool();
    OrderedChaosEvent::enqueue_all(&short_leased(&["a1", "a2", "a3", "a4"]), pool).await?;
    // Batches of two: a1 stays in the sink while the run's continuation, {a3, a4}, is
    // claimed ahead.
    let released = CancellationToken::new();
    let sink = ScriptSink::holding_the_first_call(&released);
    let relay = start(
        fast(Relay::<OrderedChaosEvent, _>::new(
            pool.clone(),
            sink.clone(),
        ))
        .batch_size(2)
        .send_timeout(Duration::from_mins(1)),
    );
    wait_until(
        "the continuation claimed ahead",
        Duration::from_secs(10),
        async || status::<OrderedChaosEvent>(pool, "a4").await == "INPROGRESS",
    )
    .await;
    // Another publisher takes a3 over meanwhile (as after a pause of this relay's).
    let theirs = take_over::<OrderedChaosEvent>(pool, "a3").await;
    // The relay finds it out at the next renewal of the batch claimed ahead (a third of
    // its lease gone), while a1 is still out.
    wait_until(
        "the relay finds a3 taken over",
        Duration::from_secs(10),
        async || logs.lines_with(&["taken over while they waited"]) == 1,
    )
    .await;
    released.cancel();

    // a4 cannot go before a3: this relay hands it back, unattempted, to wait behind a3
    // (not out its lease, which would leave it expired behind a3's live claim).
    wait_until("a4 handed back", Duration::from_secs(10), async || {
        status::<OrderedChaosEvent>(pool, "a4").await == "READY"
    })
    .await;
    let a4 = row_of::<OrderedChaosEvent>(pool, "a4").await;
    assert_eq!(a4.attempts, 0, "its attempt not counted");
    assert_eq!(status::<OrderedChaosEvent>(pool, "a2").await, "SENT");
    // The other publisher's a3 goes; then a4, from this relay.
    sqlx::query(
        "UPDATE ordered_chaos_events SET status = 'SENT', lease_until = NULL
         WHERE event_id = 'a3' AND generation = $1",
    )
    .bind(theirs)
    .execute(pool)
    .await?;
    wait_until("a4 SENT", Duration::from_secs(10), async || {
        status::<OrderedChaosEvent>(pool, "a4").await == "SENT"
    })
    .await;
    relay.stop().await?;
    assert_eq!(
        sink.event_ids(),
        ["a1", "a2", "a4"],
        "a3 never from this relay, a4 once"
    );
    assert_eq!(
        row_of::<OrderedChaosEvent>(pool, "a4").await.attempts,
        1,
        "a4 went on its first counted attempt"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_run_is_at_most_run_length_events_and_goes_on_in_the_next_batch() -> TestResult {
    let counters = Counters::default();
    let _recorder = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let mut events: Vec<OrderStep> = (1..=7).map(|n| step(&format!("h{n}"), 1)).collect();
    events.push(step("k1", 2));
    OrderStep::enqueue_all(&events, pool).await?;
    let sink = WaitsForTheClaimAhead::new(Scripted::default(), pool, "h3", "h4");
    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10).run_length(3));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 8
    })
    .await;
    running.stop().await?;

    // Runs of three: h1..h3 beside k1, then h4..h6 and h7, each batch continuing the
    // run before it, claimed ahead while that one was out.
    assert_eq!(
        counters.samples(outbox::relay::metric::BATCH_SIZE, OrderStep::SPEC.table()),
        [4.0, 3.0, 1.0]
    );
    assert_eq!(
        sink.claimed_ahead(),
        Some(true),
        "h4 claimed while h3 was out"
    );
    let mut hot: Vec<String> = sink.scripted.deliveries();
    hot.retain(|name| name.starts_with('h'));
    let expected: Vec<String> = (1..=7).map(|n| format!("h{n}")).collect();
    assert_eq!(hot, expected, "once each, in order");
    db.drop_schema().await?;
    Ok(())
}

/// A sink that, on its first call, notes the events of the table set aside (`READY` and
/// not due) while that call's events are out, then answers as `scripted` says.
#[derive(Clone)]
struct NotesSetAside {
    scripted: Scripted,
    pool: sqlx::PgPool,
    set_aside: Arc<Mutex<Option<Vec<String>>>>,
}

impl Sink<OrderStep> for NotesSetAside {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        let first = self
            .set_aside
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none();
        if first {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT event_id FROM order_step_events
                 WHERE status = 'READY' AND next_attempt_at > statement_timestamp() ORDER BY id",
            )
            .fetch_all(&self.pool)
            .await
            .unwrap_or_else(|error| vec![format!("cannot read the table: {error}")]);
            *self
                .set_aside
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(names);
        }
        self.scripted.publish(batch).await
    }
}

#[tokio::test]
async fn the_backlog_of_a_key_the_relay_takes_stays_in_place_while_its_runs_go_out() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let sink = NotesSetAside {
        scripted: Scripted::default(),
        pool: pool.clone(),
        set_aside: Arc::default(),
    };
    OrderStep::enqueue_all(&hot_key(), pool).await?;
    // Older than the relay's frontier margin (half a second): what the claims step over
    // within it is set aside, as the frontier cannot pass it sooner.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 30
    })
    .await;
    running.stop().await?;

    // The first claim took h1..h10 and stepped over h11..h30, held behind them: it left
    // them where they were (a claim by hand sets them aside, a write each), and the
    // worker went on with the key's run, batch after batch.
    let set_aside = sink
        .set_aside
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(
        set_aside,
        Some(Vec::new()),
        "nothing set aside while h1..h10 were out"
    );
    let expected: Vec<String> = (1..=30).map(|n| format!("h{n}")).collect();
    assert_eq!(sink.scripted.deliveries(), expected, "once each, in order");
    db.drop_schema().await?;
    Ok(())
}

/// A sink that notes which task (which relay worker) made each call.
#[derive(Clone, Default)]
struct ByWorker {
    scripted: Scripted,
    workers: Arc<Mutex<HashSet<tokio::task::Id>>>,
}

impl ByWorker {
    /// How many workers published.
    fn workers(&self) -> usize {
        self.workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Sink<OrderStep> for ByWorker {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        if let Some(worker) = tokio::task::try_id() {
            self.workers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(worker);
        }
        self.scripted.publish(batch).await
    }
}

#[tokio::test]
async fn a_relays_workers_share_its_hot_keys_and_each_key_goes_out_in_order() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    // Four hot keys (a, b, c, d), 30 events each, enqueued in turn.
    let keys = ["a", "b", "c", "d"];
    let events: Vec<OrderStep> = (1..=30)
        .flat_map(|n| {
            (1..)
                .zip(keys)
                .map(move |(key, name)| step(&format!("{name}{n}"), key))
        })
        .collect();
    OrderStep::enqueue_all(&events, pool).await?;
    // A backlog: older than the relay's frontier margin (half a second), which its claims
    // move past. (A key's next event within it, the claim's scan finds and takes again,
    // as the first event still to go of its key.)
    tokio::time::sleep(Duration::from_millis(600)).await;
    let sink = ByWorker::default();

    let running = start(relay::<OrderStep, _>(pool, sink.clone(), 10).concurrency(4));
    wait_until("every event is SENT", Duration::from_secs(30), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == 120
    })
    .await;
    running.stop().await?;

    // The first claim took every key. Its worker, waiting for the database rather than
    // for this sink, went on with one (its share of four keys over four workers) and
    // handed the others over, each to a worker of its own.
    assert!(sink.workers() >= 2, "every key went out from one worker");
    let deliveries = sink.scripted.deliveries();
    for key in keys {
        let of_key: Vec<&String> = deliveries.iter().filter(|d| d.starts_with(key)).collect();
        let expected: Vec<String> = (1..=30).map(|n| format!("{key}{n}")).collect();
        assert_eq!(
            of_key,
            expected.iter().collect::<Vec<_>>(),
            "{key}: once each, in order"
        );
    }
    one_per_key_per_call(&sink.scripted.calls());
    db.drop_schema().await?;
    Ok(())
}
