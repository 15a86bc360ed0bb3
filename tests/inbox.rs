//! The consumer inbox against real PostgreSQL: its migration through the outbox's runner,
//! first and repeated receipts, receipts that commit with the effect or roll back with
//! it, concurrent receipts of one event, bad ids, and pruning.

use std::time::Duration;

use outbox::OutboxError;
use outbox::testing::TestSchema;
use outbox::{Inbox, Received, inbox};
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

async fn fresh() -> TestResult<TestSchema> {
    let db = TestSchema::new().await?;
    let report = inbox::migrate(db.pool()).await?;
    let applied: Vec<(&str, &str)> = report
        .applied()
        .iter()
        .map(|m| (m.target(), m.name()))
        .collect();
    assert_eq!(applied, [("outbox_inbox", "V1__create_outbox_inbox")]);
    Ok(db)
}

async fn effects(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT event_id, count(*) FROM effects GROUP BY event_id ORDER BY event_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Applies `event_id`'s effect (a row in `effects`) once per consumer, as a consumer
/// does: the inbox row and the effect in one transaction.
async fn consume(pool: &PgPool, inbox: &Inbox, event_id: &str) -> TestResult<Received> {
    let mut tx = pool.begin().await?;
    let received = inbox.receive(&mut tx, event_id).await?;
    if received.is_new() {
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
            .bind(event_id)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(received)
}

#[tokio::test]
async fn migrate_is_idempotent_and_shares_the_outbox_history_scheme() -> TestResult {
    let db = fresh().await?;
    assert!(
        inbox::migrate(db.pool()).await?.is_empty(),
        "nothing the second time"
    );
    let history: Vec<(i32, String)> =
        sqlx::query_as("SELECT version, name FROM _outbox_history_outbox_inbox")
            .fetch_all(db.pool())
            .await?;
    assert_eq!(history, [(1, "create_outbox_inbox".to_owned())]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn each_event_applies_once_per_consumer_however_often_it_arrives() -> TestResult {
    let db = fresh().await?;
    let pool = db.pool();
    sqlx::query("CREATE TABLE effects (event_id text NOT NULL)")
        .execute(pool)
        .await?;
    let billing = Inbox::new("billing");
    let shipping = Inbox::new("shipping");
    let mut seen = Vec::new();
    for event_id in ["a", "b", "a", "a", "b", "c"] {
        seen.push(consume(pool, &billing, event_id).await?);
    }
    let (new, duplicate) = (Received::New, Received::Duplicate);
    assert_eq!(seen, [new, new, duplicate, duplicate, duplicate, new]);
    assert_eq!(
        consume(pool, &shipping, "a").await?,
        new,
        "another consumer sees it anew"
    );
    assert_eq!(
        effects(pool).await,
        [
            ("a".to_owned(), 2),
            ("b".to_owned(), 1),
            ("c".to_owned(), 1)
        ],
        "a: once for billing, once for shipping"
    );
    db.drop_schema().await?;
    Ok(())
}

/// `event_id` received by `inbox` in a transaction of its own.
async fn receive_alone(
    pool: &PgPool,
    inbox: &Inbox,
    event_id: impl AsRef<str>,
) -> Result<Received, OutboxError> {
    let mut tx = pool.begin().await.expect("a transaction");
    let received = inbox.receive(&mut tx, event_id).await?;
    tx.commit().await.expect("its commit");
    Ok(received)
}

/// Waits until a session of `db`'s waits on a lock: a second copy's receipt on the
/// first's.
async fn waits_on_a_lock(db: &TestSchema) {
    wait_until(
        "the second copy waits on the first's lock",
        Duration::from_secs(10),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event_type = 'Lock')",
            )
            .bind(db.name())
            .fetch_one(db.pool())
            .await
            .expect("pg_stat_activity")
        },
    )
    .await;
}

/// The inbox row commits with the effect: a consumer that fails before committing left
/// nothing, so the redelivery is new.
#[tokio::test]
async fn a_receipt_rolled_back_with_its_effect_leaves_the_event_new() -> TestResult {
    let db = fresh().await?;
    let pool = db.pool();
    let inbox = Inbox::new("billing");
    let mut tx = pool.begin().await?;
    assert_eq!(inbox.receive(&mut tx, "e-1").await?, Received::New);
    tx.rollback().await?;
    let mut tx = pool.begin().await?;
    assert_eq!(inbox.receive(&mut tx, "e-1").await?, Received::New);
    tx.commit().await?;
    assert_eq!(
        receive_alone(pool, &inbox, "e-1").await?,
        Received::Duplicate,
        "committed now"
    );
    db.drop_schema().await?;
    Ok(())
}

/// Two replicas handling two copies of one event at once: the second waits for the
/// first transaction, then sees the event as a duplicate.
#[tokio::test]
async fn a_concurrent_copy_waits_for_the_first_and_is_a_duplicate() -> TestResult {
    let db = fresh().await?;
    let pool = db.pool();
    let inbox = Inbox::new("billing");
    let mut first = pool.begin().await?;
    assert_eq!(inbox.receive(&mut first, "e-1").await?, Received::New);
    let second = tokio::spawn({
        let (pool, inbox) = (pool.clone(), inbox.clone());
        async move {
            let mut tx = pool.begin().await?;
            let received = inbox.receive(&mut tx, "e-1").await?;
            tx.commit().await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(received)
        }
    });
    // The second copy's insert waits for the first transaction's row lock.
    waits_on_a_lock(&db).await;
    assert!(!second.is_finished(), "it waits, and returns nothing yet");
    first.commit().await?;
    assert_eq!(
        second.await?.map_err(|e| e.to_string())?,
        Received::Duplicate
    );
    db.drop_schema().await?;
    Ok(())
}

/// At REPEATABLE READ the second copy cannot see the first's commit: it fails with a
/// serialization failure instead of reading `Duplicate`, and applies nothing.
#[tokio::test]
async fn at_repeatable_read_a_concurrent_copy_fails_to_serialize() -> TestResult {
    let db = fresh().await?;
    let pool = db.pool();
    let inbox = Inbox::new("billing");
    let repeatable = "BEGIN ISOLATION LEVEL REPEATABLE READ";
    let mut first = pool.begin_with(repeatable).await?;
    assert_eq!(inbox.receive(&mut first, "e-1").await?, Received::New);
    let second = tokio::spawn({
        let (pool, inbox) = (pool.clone(), inbox.clone());
        async move {
            let mut tx = pool.begin_with(repeatable).await.expect("a transaction");
            inbox.receive(&mut tx, "e-1").await
        }
    });
    waits_on_a_lock(&db).await;
    first.commit().await?;
    let error = second.await?.unwrap_err();
    let OutboxError::Database { source, .. } = &error else {
        panic!("a database error: {error:?}");
    };
    assert_eq!(
        source
            .as_database_error()
            .and_then(sqlx::error::DatabaseError::code)
            .as_deref(),
        Some("40001"),
        "{error}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn bad_ids_and_a_missing_table_are_typed_errors() -> TestResult {
    let db = TestSchema::new().await?;
    let pool = db.pool();
    let inbox = Inbox::new("billing");
    let missing = receive_alone(pool, &inbox, "e-1").await.unwrap_err();
    assert!(
        matches!(
            missing,
            OutboxError::MissingTable {
                table: "outbox_inbox",
                ..
            }
        ),
        "{missing:?}"
    );
    inbox::migrate(pool).await?;
    for (bad, reason) in [
        ("", "an event id cannot be empty"),
        ("  ", "an event id cannot be blank"),
        ("a\0b", "an event id cannot contain a NUL character"),
    ] {
        let error = receive_alone(pool, &inbox, bad).await.unwrap_err();
        assert!(
            matches!(&error, OutboxError::InvalidEventId { table: "outbox_inbox", reason: r, .. } if r == reason),
            "{bad:?}: {error:?}"
        );
    }
    let too_long = "x".repeat(outbox::EventId::MAX_LEN + 1);
    assert!(matches!(
        receive_alone(pool, &inbox, &too_long).await,
        Err(OutboxError::InvalidEventId { .. })
    ));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_inbox")
        .fetch_one(pool)
        .await?;
    assert_eq!(count, 0, "nothing written");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn prune_deletes_only_this_consumers_old_rows_in_batches() -> TestResult {
    let db = fresh().await?;
    let pool = db.pool();
    let (billing, shipping) = (Inbox::new("billing"), Inbox::new("shipping"));
    for n in 0..5 {
        let _ = receive_alone(pool, &billing, format!("old-{n}")).await?;
    }
    let _ = receive_alone(pool, &shipping, "old-0").await?;
    sqlx::query("UPDATE outbox_inbox SET received_at = received_at - interval '2 days'")
        .execute(pool)
        .await?;
    let _ = receive_alone(pool, &billing, "recent").await?;

    let day = Duration::from_hours(24);
    assert_eq!(billing.prune(pool, day, 3).await?, 3);
    assert_eq!(billing.prune(pool, day, 3).await?, 2);
    assert_eq!(billing.prune(pool, day, 3).await?, 0);
    assert_eq!(
        billing.prune(pool, outbox::ops::MAX_INTERVAL, 3).await?,
        0,
        "the longest age is counted back from now"
    );
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT consumer, event_id FROM outbox_inbox ORDER BY consumer")
            .fetch_all(pool)
            .await?;
    assert_eq!(
        left,
        [
            ("billing".to_owned(), "recent".to_owned()),
            ("shipping".to_owned(), "old-0".to_owned())
        ]
    );
    assert_eq!(
        receive_alone(pool, &billing, "old-0").await?,
        Received::New,
        "a pruned event is new again"
    );
    assert!(matches!(
        billing.prune(pool, Duration::MAX, 1).await,
        Err(OutboxError::IntervalOutOfRange {
            table: "outbox_inbox",
            ..
        })
    ));
    db.drop_schema().await?;
    Ok(())
}
