//! Publication: every event once and `SENT`, in order of commit as well as of insert, a
//! backlog with undecodable rows, results a sink leaves out, workers sharing a backlog,
//! claims ahead of the sink, killed sessions, and a server defaulting to repeatable read.

use std::collections::HashSet;
use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use outbox::EventId;
use outbox::{
    CancellationToken, Relay,
    relay::{Backoff, MemorySink},
};
use outbox_testkit::app::{BenchEvent, OrderPlaced, PaymentCaptured};
use outbox_testkit::events::Budgeted;
use outbox_testkit::logs::Captured;
use outbox_testkit::rows::{count, enqueue, row_of};
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::time::sleep;

use crate::WaitsForTheClaimAhead;
use crate::{Plan, ScriptSink, Seen, budgeted, fast, lock, payment};

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
    let delivered: HashSet<String> = sink.event_ids().into_iter().collect();
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
