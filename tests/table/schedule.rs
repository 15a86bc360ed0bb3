//! Scheduled publish (`#[outbox(scheduled)]`): an event enqueued for later is not claimed
//! before its time, counts apart from the backlog, lags from its time, holds its key's
//! later events, and a schedule that cannot be kept is refused before anything is
//! written.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::ops::MAX_INTERVAL;
use outbox::table::{Schedule, enqueue_scheduled};
use outbox::{OutboxError, Relay, relay::MemorySink};
use outbox_testkit::app::OrderPlaced;
use outbox_testkit::events::{KeyedReminder, Notice, NoticeBeforeSchedule, Reminder};
use outbox_testkit::rows::count;
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

fn reminder(name: &str) -> Reminder {
    Reminder { name: name.into() }
}

/// Each event's (name, seconds from its enqueue to when it is due, `publish_at` set).
async fn due_after_enqueue(pool: &PgPool, table: &str) -> sqlx::Result<Vec<(String, f64, bool)>> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT event_id, extract(epoch FROM next_attempt_at - created_at)::float8, \
                publish_at IS NOT NULL \
         FROM {table} ORDER BY id"
    )))
    .fetch_all(pool)
    .await
}

#[tokio::test]
async fn an_event_enqueued_for_later_is_not_claimed_before_its_time() -> TestResult {
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();

    let mut tx = pool.begin().await?;
    reminder("in an hour")
        .enqueue_after(Duration::from_hours(1), &mut *tx)
        .await?;
    reminder("tomorrow")
        .enqueue_at(Utc::now() + chrono::Duration::days(1), &mut *tx)
        .await?;
    tx.commit().await?;

    assert!(Reminder::claim(pool).await?.is_none(), "neither is due yet");
    let stats = outbox::stats::<Reminder>(pool).await?;
    assert_eq!(
        (stats.ready, stats.due, stats.scheduled),
        (2, 0, 2),
        "scheduled, not backlog"
    );
    assert_eq!(
        stats.oldest_waiting_age, None,
        "an event before its time is no lag"
    );
    let due = due_after_enqueue(pool, "reminder_events").await?;
    assert_eq!(
        due[0],
        ("in an hour".to_owned(), 3_600.0, true),
        "the delay counts on the database's clock, from the enqueue"
    );
    assert!(
        (86_399.0..=86_401.0).contains(&due[1].1),
        "due at the time given: {due:?}"
    );

    reminder("now").enqueue(pool).await?;
    let claim = Reminder::claim(pool)
        .await?
        .expect("the unscheduled event is due at once");
    assert_eq!(claim.event().name, "now");
    claim.complete(pool).await?;
    assert!(Reminder::claim(pool).await?.is_none());
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_scheduled_event_is_claimed_once_its_time_has_come_and_lags_from_it() -> TestResult {
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();
    // Enqueued "an hour ago" for "a second ago": due for a second, not for an hour.
    reminder("was due")
        .enqueue_after(Duration::from_hours(1), pool)
        .await?;
    sqlx::query(
        "UPDATE reminder_events SET created_at = created_at - interval '1 hour 1 second', \
         publish_at = publish_at - interval '1 hour 1 second', \
         next_attempt_at = next_attempt_at - interval '1 hour 1 second'",
    )
    .execute(pool)
    .await?;
    reminder("soon")
        .enqueue_after(Duration::from_millis(300), pool)
        .await?;

    let stats = outbox::stats::<Reminder>(pool).await?;
    assert_eq!((stats.due, stats.scheduled), (1, 1));
    let lag = stats.oldest_waiting_age.expect("one event is due");
    assert!(
        (Duration::from_secs(1)..Duration::from_mins(1)).contains(&lag),
        "the lag counts from the time it was due, not its enqueue an hour ago: {lag:?}"
    );

    let first = Reminder::claim(pool).await?.expect("the due one");
    assert_eq!(first.event().name, "was due");
    wait_until(
        "the second is claimable",
        Duration::from_secs(10),
        async || Reminder::claim(pool).await.unwrap().is_some(),
    )
    .await;
    let (claimed_after_enqueue,): (f64,) = sqlx::query_as(
        "SELECT extract(epoch FROM lease_until - interval '30 seconds' - created_at)::float8 \
         FROM reminder_events WHERE event_id = 'soon'",
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
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();
    reminder("a minute ago")
        .enqueue_at(Utc::now() - chrono::Duration::minutes(1), pool)
        .await?;
    reminder("the beginning of time")
        .enqueue_at(DateTime::<Utc>::MIN_UTC, pool)
        .await?;
    reminder("no delay")
        .enqueue_after(Duration::ZERO, pool)
        .await?;

    let due = due_after_enqueue(pool, "reminder_events").await?;
    assert!(
        due.iter()
            .all(|&(_, after, published_at)| after == 0.0 && !published_at),
        "each due at its enqueue, as if unscheduled: {due:?}"
    );
    assert_eq!(Reminder::claim_batch(pool, 10).await?.len(), 3);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_schedule_beyond_the_longest_interval_is_refused_before_anything_is_written() -> TestResult
{
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();
    let too_long = MAX_INTERVAL + Duration::from_secs(1);

    let mut tx = pool.begin().await?;
    let error = reminder("never")
        .enqueue_after(too_long, &mut *tx)
        .await
        .expect_err("a delay beyond MAX_INTERVAL");
    assert!(
        matches!(error, OutboxError::IntervalOutOfRange { what: "enqueue delay", value, .. } if value == too_long),
        "{error}"
    );
    let far = Utc::now() + chrono::Duration::from_std(too_long)? + chrono::Duration::days(1);
    let error = reminder("never")
        .enqueue_at(far, &mut *tx)
        .await
        .expect_err("a time beyond MAX_INTERVAL");
    assert!(
        matches!(error, OutboxError::IntervalOutOfRange { .. }),
        "{error}"
    );
    // Refused before the statement: the business transaction is still usable.
    reminder("kept").enqueue(&mut *tx).await?;
    tx.commit().await?;
    assert_eq!(count::<Reminder>(pool, "READY").await, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_enqueued_for_later_is_due_together() -> TestResult {
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();
    let batch = [reminder("a"), reminder("b"), reminder("c")];
    let enqueued = Reminder::enqueue_all_after(&batch, Duration::from_secs(90), pool).await?;
    assert!(enqueued.iter().all(outbox::Enqueued::is_new));
    // Again, with one new event: the duplicate is skipped, the new one scheduled too.
    let again = [batch[0].clone(), reminder("d")];
    let at = Utc::now() + chrono::Duration::seconds(90);
    let enqueued = Reminder::enqueue_all_at(&again, at, pool).await?;
    assert_eq!(
        enqueued
            .iter()
            .map(outbox::Enqueued::is_new)
            .collect::<Vec<_>>(),
        [false, true]
    );

    assert!(Reminder::claim_batch(pool, 10).await?.is_empty());
    let stats = outbox::stats::<Reminder>(pool).await?;
    assert_eq!((stats.ready, stats.scheduled), (4, 4));
    let due = due_after_enqueue(pool, "reminder_events").await?;
    assert!(
        due.iter()
            .all(|&(_, after, set)| (89.0..=91.0).contains(&after) && set),
        "{due:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_type_not_declared_scheduled_takes_no_schedule() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    let order = OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: "ada".into(),
        total_cents: 100,
        note: None,
        lines: Vec::new(),
    };
    // The derive gives it no `enqueue_at`; the generic form refuses a time.
    let error = enqueue_scheduled(&order, Schedule::After(Duration::from_secs(1)), pool)
        .await
        .expect_err("no column to keep the time in");
    assert!(
        matches!(
            error,
            OutboxError::NotScheduled {
                table: "order_events"
            }
        ),
        "{error}"
    );
    assert_eq!(
        count::<OrderPlaced>(pool, "READY").await,
        0,
        "nothing written"
    );
    enqueue_scheduled(&order, Schedule::Now, pool).await?;
    assert_eq!(count::<OrderPlaced>(pool, "READY").await, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_scheduled_event_holds_its_keys_later_events_and_is_not_woken_early() -> TestResult {
    let db = schema_with(&[KeyedReminder::migrations()]).await?;
    let pool = db.pool();
    let of = |name: &str| KeyedReminder {
        name: name.into(),
        account: 7,
    };
    of("first").enqueue(pool).await?;
    of("scheduled")
        .enqueue_after(Duration::from_hours(1), pool)
        .await?;
    of("after it").enqueue(pool).await?;
    KeyedReminder {
        name: "another key".into(),
        account: 8,
    }
    .enqueue(pool)
    .await?;

    let claims = KeyedReminder::claim_batch(pool, 10).await?;
    let names: Vec<&str> = claims.iter().map(|c| c.event().name.as_str()).collect();
    assert_eq!(names, ["first", "another key"], "one per key, in order");
    // Publishing "first" wakes its key's next event, which is the scheduled one: it
    // stays due at its time, and "after it" waits behind it.
    for claim in claims {
        claim.complete(pool).await?;
    }
    assert!(
        KeyedReminder::claim_batch(pool, 10).await?.is_empty(),
        "the scheduled event is not due, and holds the one after it"
    );
    let (due_in,): (f64,) = sqlx::query_as(
        "SELECT extract(epoch FROM next_attempt_at - statement_timestamp())::float8 \
         FROM keyed_reminder_events WHERE event_id = 'scheduled'",
    )
    .fetch_one(pool)
    .await?;
    assert!(
        due_in > 3_500.0,
        "still due in an hour, not woken: {due_in}"
    );
    let stats = outbox::stats::<KeyedReminder>(pool).await?;
    assert_eq!((stats.scheduled, stats.sent), (1, 2));

    // Its time comes: then the key goes on in order.
    sqlx::query(
        "UPDATE keyed_reminder_events SET publish_at = now(), next_attempt_at = now() \
         WHERE event_id = 'scheduled'",
    )
    .execute(pool)
    .await?;
    let claim = KeyedReminder::claim(pool)
        .await?
        .expect("the scheduled one, due");
    assert_eq!(claim.event().name, "scheduled");
    claim.complete(pool).await?;
    let claim = KeyedReminder::claim(pool)
        .await?
        .expect("the one behind it");
    assert_eq!(claim.event().name, "after it");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_existing_table_becomes_scheduled_by_a_migration_version() -> TestResult {
    let db = schema_with(&[NoticeBeforeSchedule::migrations()]).await?;
    let pool = db.pool();
    NoticeBeforeSchedule {
        name: "before".into(),
    }
    .enqueue(pool)
    .await?;

    let report = outbox::migrate(pool, &[Notice::migrations()]).await?;
    assert_eq!(report.applied().len(), 1, "{report:?}");
    outbox::verify(pool, &[Notice::migrations()]).await?;
    Notice {
        name: "after".into(),
        audience: None,
    }
    .enqueue_after(Duration::from_hours(1), pool)
    .await?;
    let claim = Notice::claim(pool).await?.expect("the event from before");
    assert_eq!(
        claim.event().name,
        "before",
        "due at its enqueue, as before"
    );
    claim.complete(pool).await?;
    assert!(Notice::claim(pool).await?.is_none());
    assert_eq!(outbox::stats::<Notice>(pool).await?.scheduled, 1);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_relay_publishes_a_scheduled_event_after_its_time() -> TestResult {
    let db = schema_with(&[Reminder::migrations()]).await?;
    let pool = db.pool();
    let sink = MemorySink::new();
    let relay = start(
        Relay::<Reminder, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(50)),
    );
    reminder("later")
        .enqueue_after(Duration::from_millis(500), pool)
        .await?;
    reminder("now").enqueue(pool).await?;

    wait_until("both published", Duration::from_secs(10), async || {
        sink.published().len() == 2
    })
    .await;
    relay.stop().await?;
    let names: Vec<String> = sink
        .published()
        .iter()
        .map(|p| p.event.name.clone())
        .collect();
    assert_eq!(names, ["now", "later"], "the scheduled one waited");
    // A SENT row's next_attempt_at is when it was recorded sent.
    let (sent_after_enqueue,): (f64,) = sqlx::query_as(
        "SELECT extract(epoch FROM next_attempt_at - created_at)::float8 \
         FROM reminder_events WHERE event_id = 'later'",
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
