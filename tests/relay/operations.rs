//! The operator's repairs and figures: requeue dead events, prune old `SENT` rows, stats.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox::OutboxError;
use outbox::{Relay, relay::MemorySink};
use outbox_testkit::events::Budgeted;
use outbox_testkit::rows::{Row, count, enqueue, row_of, status};
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

use crate::{budgeted, fast};

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
