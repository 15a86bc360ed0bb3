//! Scheduled publish: an event enqueued for later is not claimed before its time, counts
//! apart from the backlog and the lag, and a schedule that cannot be kept is refused
//! before anything is written.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::ops::MAX_INTERVAL;
use outbox::table::{Schedule, enqueue_scheduled};
use outbox::{OutboxError, Relay, relay::MemorySink};
use outbox_testkit::app::OrderPlaced;
use outbox_testkit::events::OrderStep;
use outbox_testkit::rows::count;
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

fn order(customer: &str) -> OrderPlaced {
    OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: customer.into(),
        total_cents: 100,
        note: None,
        lines: Vec::new(),
    }
}

/// How long after its enqueue each order is due, on the database's clock.
async fn due_after_enqueue(pool: &PgPool) -> sqlx::Result<Vec<(String, f64)>> {
    sqlx::query_as(
        "SELECT customer, extract(epoch FROM next_attempt_at - created_at)::float8 \
         FROM order_events ORDER BY id",
    )
    .fetch_all(pool)
    .await
}

#[tokio::test]
async fn an_event_enqueued_for_later_is_not_claimed_before_its_time() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();

    let mut tx = pool.begin().await?;
    order("in an hour")
        .enqueue_after(Duration::from_hours(1), &mut *tx)
        .await?;
    order("tomorrow")
        .enqueue_at(Utc::now() + chrono::Duration::days(1), &mut *tx)
        .await?;
    tx.commit().await?;

    assert!(
        OrderPlaced::claim(pool).await?.is_none(),
        "neither is due yet"
    );
    let stats = outbox::stats::<OrderPlaced>(pool).await?;
    assert_eq!(
        (stats.ready, stats.due, stats.scheduled),
        (2, 0, 2),
        "scheduled, not backlog"
    );
    assert_eq!(
        stats.oldest_waiting_age, None,
        "an event before its time is no lag"
    );
    let due = due_after_enqueue(pool).await?;
    assert_eq!(
        due[0],
        ("in an hour".to_owned(), 3_600.0),
        "the delay counts on the database's clock, from the enqueue"
    );
    assert!(
        (86_399.0..=86_401.0).contains(&due[1].1),
        "due at the time given: {due:?}"
    );

    order("now").enqueue(pool).await?;
    let claim = OrderPlaced::claim(pool)
        .await?
        .expect("the unscheduled event is due at once");
    assert_eq!(claim.event().customer, "now");
    claim.complete(pool).await?;
    assert!(OrderPlaced::claim(pool).await?.is_none());
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_scheduled_event_is_claimed_once_its_time_has_come() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    order("soon")
        .enqueue_after(Duration::from_millis(300), pool)
        .await?;

    wait_until(
        "the event is claimable",
        Duration::from_secs(10),
        async || OrderPlaced::claim(pool).await.unwrap().is_some(),
    )
    .await;
    let (claimed_after_enqueue,): (f64,) = sqlx::query_as(
        "SELECT extract(epoch FROM lease_until - interval '30 seconds' - created_at)::float8 \
         FROM order_events",
    )
    .fetch_one(pool)
    .await?;
    assert!(
        claimed_after_enqueue >= 0.3,
        "claimed {claimed_after_enqueue} s after the enqueue, before its time"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_time_in_the_past_means_now() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    order("a minute ago")
        .enqueue_at(Utc::now() - chrono::Duration::minutes(1), pool)
        .await?;
    order("the beginning of time")
        .enqueue_at(DateTime::<Utc>::MIN_UTC, pool)
        .await?;
    order("no delay")
        .enqueue_after(Duration::ZERO, pool)
        .await?;

    let due = due_after_enqueue(pool).await?;
    assert!(
        due.iter().all(|(_, after)| *after == 0.0),
        "each due at its enqueue, as if unscheduled: {due:?}"
    );
    assert_eq!(OrderPlaced::claim_batch(pool, 10).await?.len(), 3);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_schedule_beyond_the_longest_interval_is_refused_before_anything_is_written() -> TestResult
{
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    let too_long = MAX_INTERVAL + Duration::from_secs(1);

    let mut tx = pool.begin().await?;
    let error = order("never")
        .enqueue_after(too_long, &mut *tx)
        .await
        .expect_err("a delay beyond MAX_INTERVAL");
    assert!(
        matches!(error, OutboxError::IntervalOutOfRange { what: "enqueue delay", value, .. } if value == too_long),
        "{error}"
    );
    let far = Utc::now() + chrono::Duration::from_std(too_long)? + chrono::Duration::days(1);
    let error = order("never")
        .enqueue_at(far, &mut *tx)
        .await
        .expect_err("a time beyond MAX_INTERVAL");
    assert!(
        matches!(error, OutboxError::IntervalOutOfRange { .. }),
        "{error}"
    );
    // Refused before the statement: the business transaction is still usable.
    order("kept").enqueue(&mut *tx).await?;
    tx.commit().await?;
    assert_eq!(count::<OrderPlaced>(pool, "READY").await, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_enqueued_for_later_is_due_together() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    let batch = [order("a"), order("b"), order("c")];
    let enqueued = OrderPlaced::enqueue_all_after(&batch, Duration::from_secs(90), pool).await?;
    assert!(enqueued.iter().all(outbox::Enqueued::is_new));
    // Again, with one new event: the duplicates are skipped, the new one scheduled too.
    let again = [batch[0].clone(), order("d")];
    let at = Utc::now() + chrono::Duration::seconds(90);
    let enqueued = OrderPlaced::enqueue_all_at(&again, at, pool).await?;
    assert_eq!(
        enqueued
            .iter()
            .map(outbox::Enqueued::is_new)
            .collect::<Vec<_>>(),
        [false, true]
    );

    assert!(OrderPlaced::claim_batch(pool, 10).await?.is_empty());
    let stats = outbox::stats::<OrderPlaced>(pool).await?;
    assert_eq!((stats.ready, stats.scheduled), (4, 4));
    let due = due_after_enqueue(pool).await?;
    assert!(
        due.iter().all(|(_, after)| (89.0..=91.0).contains(after)),
        "{due:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_type_with_an_ordering_key_takes_no_schedule() -> TestResult {
    let db = schema_with(&[OrderStep::migrations()]).await?;
    let pool = db.pool();
    let step = OrderStep {
        name: "paid".into(),
        order_id: 7,
    };
    // The derive gives a keyed type no `enqueue_at`; the generic form refuses it.
    let error = enqueue_scheduled(&step, Schedule::After(Duration::from_secs(1)), pool)
        .await
        .expect_err("a keyed event cannot be scheduled");
    assert!(
        matches!(
            error,
            OutboxError::ScheduledWithKey {
                table: "order_step_events"
            }
        ),
        "{error}"
    );
    assert_eq!(
        count::<OrderStep>(pool, "READY").await,
        0,
        "nothing written"
    );
    enqueue_scheduled(&step, Schedule::Now, pool).await?;
    assert_eq!(count::<OrderStep>(pool, "READY").await, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_relay_publishes_a_scheduled_event_after_its_time() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    let sink = MemorySink::new();
    let relay = start(
        Relay::<OrderPlaced, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(50)),
    );
    order("later")
        .enqueue_after(Duration::from_millis(500), pool)
        .await?;
    order("now").enqueue(pool).await?;

    wait_until("both published", Duration::from_secs(10), async || {
        sink.published().len() == 2
    })
    .await;
    relay.stop().await?;
    let order_of: Vec<String> = sink
        .published()
        .iter()
        .map(|p| p.event.customer.clone())
        .collect();
    assert_eq!(order_of, ["now", "later"], "the scheduled one waited");
    // A SENT row's next_attempt_at is when it was recorded sent.
    let (sent_after_enqueue,): (f64,) = sqlx::query_as(
        "SELECT extract(epoch FROM next_attempt_at - created_at)::float8 \
         FROM order_events WHERE customer = 'later'",
    )
    .fetch_one(pool)
    .await?;
    assert!(
        sent_after_enqueue >= 0.5,
        "sent {sent_after_enqueue} s after"
    );
    db.drop_schema().await?;
    Ok(())
}
