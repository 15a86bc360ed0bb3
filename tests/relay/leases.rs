//! Leases and fencing: renewals keep a slow send owned; a rejected renewal or a takeover
//! abandons exactly the rows lost; a silent database or a lease run out by the relay's own
//! clock stops the send at once.

use std::time::Duration;

use outbox::testing::TestSchema;
use outbox::{CancellationToken, Relay};
use outbox::{EventId, Outbox};
use outbox_testkit::app::PaymentCaptured;
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{Budgeted, ChaosEvent, LongSend};
use outbox_testkit::logs::Captured;
use outbox_testkit::proxy::Proxy;
use outbox_testkit::rows::{enqueue, row_of, status};
use outbox_testkit::running::{Running, start};
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::time::Instant;

use crate::{
    Plan, ScriptSink, Seen, Wait, budgeted, fast, lease_until, long_send, payment, take_over,
    wait_past,
};

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
    let sink = ScriptSink::holding_the_first_call(released);
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
    let sink = ScriptSink::holding_the_first_call(&released);
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
