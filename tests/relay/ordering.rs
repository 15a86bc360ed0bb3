//! Per-key ordering (`#[outbox(key)]`): an event is claimed only once every earlier
//! event of its key (by row id) is `SENT`, so the events of one order leave in order,
//! one at a time, whatever the number of publishers.
//!
//! Each scenario holds the head of one key back in another way (a claim in flight, a
//! retry waiting out its delay, an expired claim, a `DEAD` event) and shows that the
//! key's later events wait while other keys go on.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::{CancellationToken, Delivery, Relay, Sink, SinkError};
use outbox::{Claim, Outbox};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{LenientStep, OrderStep, Shipment, ShipmentBeforeKey};
use outbox_testkit::rows::{due_in, enqueue, expire, status};
use outbox_testkit::running::start;
use outbox_testkit::schema::{schema_from_zero, schema_with};
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

fn step(name: &str, order_id: i64) -> OrderStep {
    OrderStep {
        name: name.into(),
        order_id,
    }
}

/// The event ids of a claimed batch, in claim order.
fn names<T: Outbox>(claims: &[Claim<T>]) -> Vec<&str> {
    claims.iter().map(|c| c.event_id().as_str()).collect()
}

async fn claim_all(pool: &PgPool) -> TestResult<Vec<Claim<OrderStep>>> {
    Ok(OrderStep::claim_batch(pool, 100).await?)
}

/// Events a1 and a2 of one order, of the type whose `DEAD` events release their key.
fn lenient_pair() -> [LenientStep; 2] {
    let order = uuid::Uuid::now_v7();
    ["a1", "a2"].map(|name| LenientStep {
        name: name.into(),
        order_id: order,
    })
}

/// [`claim_all`] within a transaction, which holds what the claim locked.
async fn claim_batch(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
) -> TestResult<Vec<Claim<OrderStep>>> {
    Ok(OrderStep::claim_batch(&mut **tx, 100).await?)
}

#[tokio::test]
async fn the_events_of_one_key_are_claimed_one_at_a_time_in_order() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[step("a1", 1), step("b1", 2), step("a2", 1), step("a3", 1)],
    )
    .await;

    // One event per key: a1 holds a2 and a3 back while it is in flight; b1 is another key.
    let first = claim_all(pool).await?;
    assert_eq!(names(&first), ["a1", "b1"]);
    let keys: Vec<Option<&str>> = first.iter().map(Claim::key).collect();
    assert_eq!(keys, [Some("1"), Some("2")], "what a sink publishes under");
    assert!(claim_all(pool).await?.is_empty(), "a2 waits for a1");

    // Each completion lets the next event of the key go, and only that one.
    let mut first = first.into_iter();
    first.next().ok_or("a1")?.complete(pool).await?;
    let second = claim_all(pool).await?;
    assert_eq!(names(&second), ["a2"]);
    for claim in second.into_iter().chain(first) {
        claim.complete(pool).await?;
    }
    let third = claim_all(pool).await?;
    assert_eq!(names(&third), ["a3"]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_retry_waiting_out_its_delay_holds_back_the_later_events_of_its_key() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[step("a1", 1), step("a2", 1), step("b1", 2)]).await;
    let mut claims = claim_all(pool).await?.into_iter();
    let a1 = claims.next().ok_or("a1")?;
    let retried = a1
        .retry_because(pool, Duration::from_hours(1), "broker said no")
        .await?;
    assert_eq!(retried, outbox::Retried::Scheduled);

    // a2 is due, and stays behind a1 for the hour a1 waits; b2 of the other key goes.
    enqueue(pool, &[step("b2", 2)]).await;
    claims.next().ok_or("b1")?.complete(pool).await?;
    assert_eq!(names(&claim_all(pool).await?), ["b2"]);
    assert_eq!(status::<OrderStep>(pool, "a2").await, "READY");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_expired_claim_is_reclaimed_before_the_later_events_of_its_key() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[step("a1", 1), step("a2", 1)]).await;
    let stalled = OrderStep::claim(pool).await?.ok_or("a1")?;

    // The publisher of a1 stalls past its lease: a1 is taken over, a2 still waits.
    expire::<OrderStep>(pool, stalled.id()).await?;
    let taken_over = claim_all(pool).await?;
    assert_eq!(names(&taken_over), ["a1"]);
    assert!(taken_over[0].is_reclaim());
    assert!(stalled.complete(pool).await.unwrap_err().is_stale());
    assert!(
        claim_all(pool).await?.is_empty(),
        "a2 waits for the new owner"
    );

    for claim in taken_over {
        claim.complete(pool).await?;
    }
    assert_eq!(names(&claim_all(pool).await?), ["a2"]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_dead_event_holds_its_key_until_it_is_requeued_or_discarded() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[step("a1", 1), step("a2", 1), step("b1", 2), step("b2", 2)],
    )
    .await;
    for claim in claim_all(pool).await? {
        claim.fail(pool, "the broker refuses it").await?;
    }

    // Both keys are held: their second events wait for an operator.
    assert!(claim_all(pool).await?.is_empty());
    let stats = outbox::stats::<OrderStep>(pool).await?;
    assert_eq!((stats.dead, stats.held_keys), (2, 2));
    assert!(stats.oldest_held_age.is_some());
    // A creation time written by hand as -infinity is the longest age, not an error.
    sqlx::query("UPDATE order_step_events SET created_at = '-infinity' WHERE event_id = 'a1'")
        .execute(pool)
        .await?;
    let stats = outbox::stats::<OrderStep>(pool).await?;
    assert_eq!(stats.oldest_held_age, Some(outbox::ops::MAX_INTERVAL));

    // Requeued, a1 goes first, then a2; discarded, b1 is gone and b2 goes.
    outbox::ops::requeue_dead::<OrderStep>(pool, &["a1"]).await?;
    let discarded = outbox::ops::discard_dead::<OrderStep>(pool, &["b1", "a2"]).await?;
    assert_eq!(discarded, [outbox::EventId::from("b1")], "a2 is not DEAD");
    assert_eq!(names(&claim_all(pool).await?), ["a1", "b2"]);
    let stats = outbox::stats::<OrderStep>(pool).await?;
    assert_eq!((stats.held_keys, stats.oldest_held_age), (0, None));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn with_dead_releases_key_a_dead_event_lets_its_key_go_on() -> TestResult {
    let db = schema_with(&[LenientStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &lenient_pair()).await;
    let a1 = LenientStep::claim(pool).await?.ok_or("a1")?;
    assert!(
        LenientStep::claim(pool).await?.is_none(),
        "in flight, a1 still holds a2"
    );
    // Its budget of one claim spent, a1 is DEAD, and a2 goes on without it.
    assert_eq!(a1.retry(pool, None).await?, outbox::Retried::Dead);
    let a2 = LenientStep::claim(pool).await?.ok_or("a2")?;
    assert_eq!(a2.event_id().as_str(), "a2");
    assert_eq!(outbox::stats::<LenientStep>(pool).await?.held_keys, 0);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn with_dead_releases_key_a_claim_that_moves_an_event_to_dead_wakes_the_one_set_aside_behind_it()
-> TestResult {
    let db = schema_with(&[LenientStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &lenient_pair()).await;
    let set_aside = async |name: &str| {
        outbox_testkit::rows::row_of::<LenientStep>(pool, name)
            .await
            .due_in
            > 0.0
    };

    // a1 waits (as if for a retry's delay): a claim sets a2 aside behind it.
    due_in::<LenientStep>(pool, "a1", 3600.0).await;
    assert!(LenientStep::claim(pool).await?.is_none());
    assert!(set_aside("a2").await);

    // a1's publisher takes its one claim and dies. The claim that finds its lease
    // expired moves it to DEAD, which lets a2 go: a2 is woken, and claimed at once by
    // the same call, which claims again for the event it did not get (not after the
    // lease a2 was set aside for).
    due_in::<LenientStep>(pool, "a1", 0.0).await;
    let stalled = LenientStep::claim(pool).await?.ok_or("a1")?;
    expire::<LenientStep>(pool, stalled.id()).await?;
    let a2 = LenientStep::claim(pool).await?.ok_or("a2 goes at once")?;
    assert_eq!(a2.event_id().as_str(), "a2");
    assert_eq!(status::<LenientStep>(pool, "a1").await, "DEAD");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn with_dead_releases_key_discarding_a_dead_event_leaves_the_retry_delay_after_it_alone()
-> TestResult {
    let db = schema_with(&[LenientStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &lenient_pair()).await;
    let a1 = LenientStep::claim(pool).await?.ok_or("a1")?;
    assert_eq!(a1.retry(pool, None).await?, outbox::Retried::Dead);
    // a1 DEAD does not hold the key: a2 was published, failed, and waits an hour
    // before its next attempt (its destination is down).
    let a2 = LenientStep::claim(pool).await?.ok_or("a2")?;
    assert_eq!(a2.event_id().as_str(), "a2");
    drop(a2);
    sqlx::query(
        "UPDATE lenient_order_events SET status = 'READY', lease_until = NULL
         WHERE event_id = 'a2'",
    )
    .execute(pool)
    .await?;
    due_in::<LenientStep>(pool, "a2", 3600.0).await;

    outbox::ops::discard_dead::<LenientStep>(pool, &["a1"]).await?;
    let due_in = outbox_testkit::rows::row_of::<LenientStep>(pool, "a2")
        .await
        .due_in;
    assert!(
        due_in > 3500.0,
        "nothing waited behind a1: a2 keeps its delay ({due_in} s)"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn discarding_a_dead_event_wakes_the_event_a_claim_set_aside_behind_it_meanwhile()
-> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[step("a1", 1), step("a2", 1)]).await;
    let a1 = OrderStep::claim(pool).await?.ok_or("a1")?;
    a1.fail(pool, "the broker refuses it").await?;

    // A claim sets a2 aside behind the DEAD a1, holding a1 share-locked until it
    // commits; the operator's discard of a1 waits for that lock meanwhile.
    let mut claim = pool.begin().await?;
    let claimer: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *claim)
        .await?;
    assert!(claim_batch(&mut claim).await?.is_empty());
    let discard = tokio::spawn({
        let pool = pool.clone();
        async move { outbox::ops::discard_dead::<OrderStep>(&pool, &["a1"]).await }
    });
    wait_until(
        "the discard waits for the claim",
        Duration::from_secs(10),
        async || {
            sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)))",
        )
        .bind(claimer)
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity")
        },
    )
    .await;
    claim.commit().await?;

    // The discard went on after the claim committed, on a snapshot from before it: a2
    // is woken all the same, and goes now, not after the lease it was set aside for.
    assert_eq!(discard.await??, [outbox::EventId::from("a1")]);
    assert_eq!(names(&claim_all(pool).await?), ["a2"]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_of_a_build_without_the_key_refuses_a_table_a_newer_build_keyed() -> TestResult {
    // A rollback: the table has its key (version 2); the relay is the build before it.
    let db = schema_with(&[Shipment::migrations()]).await?;
    let sink = outbox::relay::MemorySink::<ShipmentBeforeKey>::new();
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        Relay::<ShipmentBeforeKey, _>::new(db.pool().clone(), sink.clone())
            .run(CancellationToken::new()),
    )
    .await?;
    match outcome {
        Err(outbox::OutboxError::Drift { table, details }) => {
            assert_eq!(table, "shipment_events");
            assert!(details.contains("the key `parcel`"), "{details}");
        }
        other => panic!("expected Drift, got {other:?}"),
    }
    assert!(sink.published().is_empty());
    // The build with the key runs.
    let keyed = Relay::<Shipment, _>::new(
        db.pool().clone(),
        outbox::relay::MemorySink::<Shipment>::new(),
    );
    runs_until_stopped(keyed).await?;
    db.drop_schema().await?;

    // A table without a key, with an index of the application's own of that shape on
    // a column the build knows: no key, and the relay runs.
    let db = schema_with(&[ShipmentBeforeKey::migrations()]).await?;
    sqlx::query("CREATE INDEX ON shipment_events (status, id) WHERE status <> 'SENT'")
        .execute(db.pool())
        .await?;
    let unkeyed = Relay::<ShipmentBeforeKey, _>::new(db.pool().clone(), sink);
    runs_until_stopped(unkeyed).await?;
    db.drop_schema().await?;
    Ok(())
}

/// Runs `relay` until its first claim found nothing (past the checks of the table at
/// start): it must still be running (not refused the table), then stop cleanly.
async fn runs_until_stopped<T: Outbox, S: Sink<T>>(relay: Relay<T, S>) -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let running = start(relay);
    wait_until("the relay claims", Duration::from_secs(30), async || {
        counters.get(outbox::relay::metric::IDLE_CLAIMS, T::SPEC.table()) > 0
            || !running.is_running()
    })
    .await;
    assert!(
        running.is_running(),
        "the relay stopped: {:?}",
        running.stop().await
    );
    running.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_key_added_by_a_later_version_orders_the_events_enqueued_after_it() -> TestResult {
    // The table as first released, with events in it.
    let db = schema_with(&[ShipmentBeforeKey::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[
            ShipmentBeforeKey {
                name: "old1".into(),
            },
            ShipmentBeforeKey {
                name: "old2".into(),
            },
        ],
    )
    .await;

    // Version 2 adds the key: the earlier rows have none and go in no particular order.
    let report = outbox::migrate(pool, &[Shipment::migrations()]).await?;
    assert_eq!(report.applied().len(), 1, "{report:?}");
    let shipment = |name: &str, parcel: Option<&str>| Shipment {
        name: name.into(),
        parcel: parcel.map(Into::into),
    };
    enqueue(
        pool,
        &[
            shipment("p1", Some("P")),
            shipment("p2", Some("P")),
            shipment("free", None),
        ],
    )
    .await;
    let claims = Shipment::claim_batch(pool, 100).await?;
    assert_eq!(names(&claims), ["old1", "old2", "p1", "free"]);
    db.drop_schema().await?;
    Ok(())
}

/// A sink that checks, on every delivery, that the previous event of its key is
/// already recorded as `SENT`, or is claimed with it in one run (in flight under the
/// same claim, and acknowledged by this sink before), and fails every third first
/// attempt.
#[derive(Clone)]
struct InOrder {
    pool: PgPool,
    seen: Arc<Mutex<Seen>>,
}

#[derive(Default)]
struct Seen {
    /// Per key, the sequence numbers in the order of their first delivery.
    first: BTreeMap<i64, Vec<u32>>,
    /// Deliveries whose predecessor was neither `SENT` nor acknowledged in their run.
    early: Vec<String>,
    attempts: HashMap<String, u32>,
    /// The generation of each acknowledged delivery, by event.
    acknowledged: HashMap<String, i64>,
    /// Deliveries whose predecessor went out before them in the same run.
    in_runs: usize,
}

fn sequence(event: &OrderStep) -> u32 {
    event.name.rsplit('-').next().unwrap().parse().unwrap()
}

impl InOrder {
    async fn deliver(&self, delivery: &Delivery<'_, OrderStep>) -> Result<(), SinkError> {
        let event = delivery.event();
        let seq = sequence(event);
        if seq > 0 {
            let previous = format!("{}-{}", event.order_id, seq - 1);
            let (status, generation): (String, i64) = sqlx::query_as(
                "SELECT status, generation FROM order_step_events WHERE event_id = $1",
            )
            .bind(&previous)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            let in_run =
                status == "INPROGRESS" && seen.acknowledged.get(&previous) == Some(&generation);
            if in_run {
                seen.in_runs += 1;
            } else if status != "SENT" {
                seen.early
                    .push(format!("{} while {previous} is {status}", event.name));
            }
        }
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = &mut *seen;
        let attempts = seen.attempts.entry(event.name.clone()).or_default();
        *attempts += 1;
        if *attempts == 1 {
            seen.first.entry(event.order_id).or_default().push(seq);
            if seq % 3 == 1 {
                return Err(SinkError::transient("every third event fails once"));
            }
        }
        seen.acknowledged
            .insert(event.name.clone(), delivery.generation().get());
        Ok(())
    }
}

impl Sink<OrderStep> for InOrder {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        let mut results = Vec::with_capacity(batch.len());
        for delivery in batch {
            assert_eq!(
                delivery.key(),
                Some(delivery.event().order_id.to_string().as_str())
            );
            results.push(self.deliver(delivery).await);
        }
        results
    }
}

#[tokio::test]
async fn four_workers_publish_each_key_in_order_through_retries() -> TestResult {
    const KEYS: i64 = 20;
    const PER_KEY: u32 = 15;
    let db = schema_from_zero(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    // Keys interleaved, as orders of many customers arrive.
    let events: Vec<OrderStep> = (0..PER_KEY)
        .flat_map(|seq| (0..KEYS).map(move |key| step(&format!("{key}-{seq}"), key)))
        .collect();
    OrderStep::enqueue_all(&events, pool).await?;

    let sink = InOrder {
        pool: pool.clone(),
        seen: Arc::default(),
    };
    // The relay's own pool: four workers and its listener, beside the sink's lookups.
    let relay_pool = db.connect(6).await?;
    let relay = start(
        Relay::<OrderStep, _>::new(relay_pool, sink.clone())
            .concurrency(4)
            .batch_size(8)
            .poll_interval(Duration::from_millis(100))
            .retry_backoff(outbox::relay::Backoff::new(
                Duration::from_millis(50),
                Duration::from_millis(50),
            )),
    );
    let total = i64::from(PER_KEY) * KEYS;
    wait_until("every event is SENT", Duration::from_mins(1), async || {
        outbox::stats::<OrderStep>(pool).await.unwrap().sent == total
    })
    .await;
    relay.stop().await?;

    let seen = std::mem::take(&mut *sink.seen.lock().unwrap_or_else(PoisonError::into_inner));
    assert!(seen.early.is_empty(), "published early: {:?}", seen.early);
    assert!(seen.in_runs > 0, "the relay claimed runs of a key");
    let in_order: Vec<u32> = (0..PER_KEY).collect();
    for (key, firsts) in &seen.first {
        assert_eq!(firsts, &in_order, "key {key}");
    }
    assert_eq!(seen.first.len(), usize::try_from(KEYS)?);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_backlog_behind_a_waiting_event_is_set_aside_once_and_woken_in_turn() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let backlog: Vec<OrderStep> = (1..=50).map(|n| step(&format!("a{n}"), 1)).collect();
    OrderStep::enqueue_all(&backlog, pool).await?;
    let due = async |name: &str| {
        outbox_testkit::rows::row_of::<OrderStep>(pool, name)
            .await
            .due_in
            <= 0.0
    };

    // The claim takes a1. a2, behind an event in flight, stays due; a3 to a50, behind
    // events that wait, are set aside so that later claims do not step over them.
    let claims = claim_all(pool).await?;
    assert_eq!(names(&claims), ["a1"]);
    assert!(due("a2").await);
    for n in 3..=50 {
        assert!(!due(&format!("a{n}")).await, "a{n} is set aside");
    }
    assert!(claim_all(pool).await?.is_empty());

    // Each completion wakes the next event of its key, which the next claim takes.
    for claim in claims {
        claim.complete(pool).await?;
    }
    for n in 2..=50 {
        let claims = claim_all(pool).await?;
        assert_eq!(names(&claims), [format!("a{n}")]);
        for claim in claims {
            claim.complete(pool).await?;
        }
    }
    assert_eq!(outbox::stats::<OrderStep>(pool).await?.sent, 50);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_whose_batch_expired_claims_fill_sets_nothing_aside() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[step("b1", 2)]).await;
    let stalled = OrderStep::claim(pool).await?.ok_or("b1")?;
    expire::<OrderStep>(pool, stalled.id()).await?;
    let backlog: Vec<OrderStep> = (1..=5).map(|n| step(&format!("a{n}"), 1)).collect();
    OrderStep::enqueue_all(&backlog, pool).await?;

    // The claim of one takes the expired b1 and looks at no due event: it sets none
    // aside (it once took that for having walked them all, and set aside a2 to a5).
    let taken_over = OrderStep::claim_batch(pool, 1).await?;
    assert_eq!(names(&taken_over), ["b1"]);
    for n in 1..=5 {
        let row = outbox_testkit::rows::row_of::<OrderStep>(pool, format!("a{n}").as_str()).await;
        assert!(row.due_in <= 0.0, "a{n} is still due");
    }
    assert_eq!(names(&claim_all(pool).await?), ["a1"]);
    db.drop_schema().await?;
    Ok(())
}

/// A few hot keys and several workers: most claims find only events whose key is busy.
/// Every event must still go out on wake-ups alone, never waiting for the poll (here an
/// hour): a claim that sets events aside behind another's lock notifies, so a worker
/// that skipped them comes back (without it, 10 hot keys stalled in half the runs).
#[tokio::test]
async fn hot_keys_drain_on_wake_ups_alone_without_waiting_for_the_poll() -> TestResult {
    const KEYS: i64 = 10;
    const PER_KEY: i64 = 30;
    // What the relay said, shown if a round stalls (a lost wake-up once stalled one in
    // CI: the rows left and the relay's log are what told why).
    let logs = outbox_testkit::logs::Captured::default();
    let _logging = logs.this_thread(tracing_subscriber::filter::LevelFilter::DEBUG);
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let sink = outbox::relay::MemorySink::new();
    let relay = start(
        Relay::<OrderStep, _>::new(db.connect(5).await?, sink.clone())
            .concurrency(4)
            .batch_size(10)
            .poll_interval(Duration::from_hours(1)),
    );
    for round in 0..3 {
        let events: Vec<OrderStep> = (0..PER_KEY)
            .flat_map(|seq| (0..KEYS).map(move |key| step(&format!("{round}-{key}-{seq}"), key)))
            .collect();
        OrderStep::enqueue_all(&events, pool).await?;
        let total = (round + 1) * KEYS * PER_KEY;
        // A second, normally; without the notification, stalls of a minute or more.
        outbox_testkit::wait_until_explained(
            &format!("round {round} is SENT, on wake-ups alone"),
            Duration::from_secs(30),
            async || outbox::stats::<OrderStep>(pool).await.unwrap().sent >= total,
            async || stalled(pool, &logs).await,
        )
        .await;
    }
    relay.stop().await?;
    assert_eq!(sink.published().len(), usize::try_from(3 * KEYS * PER_KEY)?);
    db.drop_schema().await?;
    Ok(())
}

/// The rows not `SENT` yet and the relay's last log lines: why a round stalled.
async fn stalled(pool: &sqlx::PgPool, logs: &outbox_testkit::logs::Captured) -> String {
    let left: Result<Vec<(String, String, i32, f64)>, _> = sqlx::query_as(
        "SELECT event_id, status, attempts,
            extract(epoch FROM next_attempt_at - statement_timestamp())::float8
         FROM order_step_events WHERE status <> 'SENT' ORDER BY id LIMIT 40",
    )
    .fetch_all(pool)
    .await;
    // The relay's lines, not this test's own polling.
    let log = logs.text();
    let tail: Vec<&str> = log
        .lines()
        .rev()
        .filter(|line| !line.contains("oldest_waiting") && !line.contains("SELECT event_id"))
        .map(|line| line.get(..400).unwrap_or(line))
        .take(150)
        .collect();
    format!(
        "rows left (id, status, attempts, due in s): {left:?}\nthe relay's last log lines, \
         newest first:\n{}",
        tail.join("\n")
    )
}

/// A sink that holds each call with an event named `held` until the test lets it go,
/// writing down every event it publishes, in order.
#[derive(Clone)]
struct HoldsOne {
    held: &'static str,
    go: Arc<tokio::sync::Semaphore>,
    published: Arc<Mutex<Vec<String>>>,
}

impl Sink<OrderStep> for HoldsOne {
    async fn publish(&self, batch: &[Delivery<'_, OrderStep>]) -> Vec<Result<(), SinkError>> {
        if batch.iter().any(|d| d.event().name == self.held) {
            let _go = self.go.acquire().await;
        }
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(batch.iter().map(|d| d.event().name.clone()));
        batch.iter().map(|_| Ok(())).collect()
    }
}

/// While a1 is out, other claims take b1 and c1 and step over a2, held behind a1: the
/// relay's frontier moves on past a2. The worker that records a1, its key's last event
/// in flight, claims from behind it again: a2 goes after a1 on no wake-up (the poll is
/// an hour). (A sweep, due by then, would find it as well.)
#[tokio::test]
async fn an_event_stepped_over_behind_its_key_goes_once_the_event_before_it_is_recorded()
-> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let sink = HoldsOne {
        held: "a1",
        go: Arc::new(tokio::sync::Semaphore::new(0)),
        published: Arc::default(),
    };
    let relay = start(
        Relay::<OrderStep, _>::new(db.connect(4).await?, sink.clone())
            .concurrency(2)
            .batch_size(10)
            .poll_interval(Duration::from_hours(1)),
    );
    enqueue(pool, &[step("a1", 1)]).await;
    wait_until("a1 is out", Duration::from_secs(10), async || {
        status::<OrderStep>(pool, "a1").await == "INPROGRESS"
    })
    .await;
    enqueue(pool, &[step("a2", 1), step("b1", 2)]).await;
    wait_until(
        "b1 is SENT beside a1",
        Duration::from_secs(10),
        async || status::<OrderStep>(pool, "b1").await == "SENT",
    )
    .await;
    // A claim more than the frontier's margin (half a second) later steps over a2 too,
    // and moves the frontier past it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    enqueue(pool, &[step("c1", 3)]).await;
    wait_until(
        "c1 is SENT beside a1",
        Duration::from_secs(10),
        async || status::<OrderStep>(pool, "c1").await == "SENT",
    )
    .await;
    assert_eq!(
        status::<OrderStep>(pool, "a2").await,
        "READY",
        "held behind a1"
    );

    sink.go.add_permits(1);
    wait_until("a2 is SENT after a1", Duration::from_secs(10), async || {
        status::<OrderStep>(pool, "a2").await == "SENT"
    })
    .await;
    relay.stop().await?;
    let published = sink
        .published
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(published, ["b1", "c1", "a1", "a2"]);
    db.drop_schema().await?;
    Ok(())
}
