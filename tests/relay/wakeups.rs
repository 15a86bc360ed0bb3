//! Wake-ups: a notification wakes an idle relay long before its poll, and one worker only.

use std::time::Duration;

use outbox::{Relay, relay::MemorySink};
use outbox_testkit::app::EmailChanged;
use outbox_testkit::counters::Counters;
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};

use crate::IDLE_CLAIMS;

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
