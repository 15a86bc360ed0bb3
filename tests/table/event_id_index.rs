//! `#[outbox(no_event_id_index)]`: a table of generated event ids without the unique
//! index on `event_id`, created so or made so by a migration version of a table created
//! with it, whose events from before are published beside the new ones.

use outbox_testkit::TestResult;
use outbox_testkit::app::BenchUnindexedEvent;
use outbox_testkit::schema::schema_with;
use sqlx::PgPool;

/// Whether `table` has a unique index on `event_id`.
async fn event_id_unique(pool: &PgPool, table: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
             WHERE i.indrelid = $1::regclass AND i.indisunique AND a.attname = 'event_id')",
    )
    .bind(table)
    .fetch_one(pool)
    .await
}

// The table's earlier type is left out of the `checked` build (see its docs).
#[cfg(not(feature = "checked"))]
#[tokio::test]
async fn an_existing_table_drops_its_event_id_index_by_a_migration_version() -> TestResult {
    use std::collections::HashSet;
    use std::time::Duration;

    use outbox::{Relay, relay::MemorySink};
    use outbox_testkit::events::{Pulse, PulseBeforeUnindexing};
    use outbox_testkit::running::start;
    use outbox_testkit::wait_until;

    let db = schema_with(&[PulseBeforeUnindexing::migrations()]).await?;
    let pool = db.pool();
    for beat in 0..3 {
        PulseBeforeUnindexing { beat }.enqueue(pool).await?;
    }
    assert!(event_id_unique(pool, "pulse_events").await?);

    let report = outbox::migrate(pool, &[Pulse::migrations()]).await?;
    assert_eq!(report.applied().len(), 1, "{report:?}");
    outbox::verify(pool, &[Pulse::migrations()]).await?;
    assert!(
        !event_id_unique(pool, "pulse_events").await?,
        "version 2 drops it"
    );
    assert!(Pulse { beat: 3 }.enqueue(pool).await?.is_new());
    let later: Vec<Pulse> = (4..6).map(|beat| Pulse { beat }).collect();
    let enqueued = Pulse::enqueue_all(&later, pool).await?;
    assert!(
        enqueued.iter().all(outbox::Enqueued::is_new),
        "{enqueued:?}"
    );

    let sink = MemorySink::new();
    let relay = start(
        Relay::<Pulse, _>::new(pool.clone(), sink.clone()).poll_interval(Duration::from_millis(50)),
    );
    wait_until(
        "every pulse is published",
        Duration::from_secs(30),
        async || sink.published().len() >= 6,
    )
    .await;
    relay.stop().await?;
    let published = sink.published();
    let mut beats: Vec<i64> = published.iter().map(|p| p.event.beat).collect();
    beats.sort_unstable();
    assert_eq!(beats, [0, 1, 2, 3, 4, 5], "the events from before it too");
    let ids: HashSet<_> = published.iter().map(|p| p.event_id.clone()).collect();
    assert_eq!(ids.len(), 6, "every event its own id");
    assert_eq!(outbox::stats::<Pulse>(pool).await?.sent, 6);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_table_created_without_it_still_finds_a_dead_event_by_its_id() -> TestResult {
    let db = schema_with(&[BenchUnindexedEvent::migrations()]).await?;
    let pool = db.pool();
    assert!(!event_id_unique(pool, "bench_unindexed_events").await?);
    outbox::verify(pool, &[BenchUnindexedEvent::migrations()]).await?;

    let event = BenchUnindexedEvent {
        payload: "refused".into(),
    };
    let id = event.enqueue(pool).await?.into_event_id();
    let claim = BenchUnindexedEvent::claim(pool).await?.expect("the event");
    claim.fail(pool, "the broker refused it").await?;
    let requeued = outbox::ops::requeue_dead::<BenchUnindexedEvent>(pool, &[id.as_str()]).await?;
    assert_eq!(requeued, std::slice::from_ref(&id));

    let claim = BenchUnindexedEvent::claim(pool).await?.expect("requeued");
    assert_eq!(claim.event_id(), &id);
    claim.fail(pool, "refused again").await?;
    let discarded = outbox::ops::discard_dead::<BenchUnindexedEvent>(pool, &[id.as_str()]).await?;
    assert_eq!(discarded, [id]);
    assert_eq!(outbox::stats::<BenchUnindexedEvent>(pool).await?.dead, 0);
    db.drop_schema().await?;
    Ok(())
}
