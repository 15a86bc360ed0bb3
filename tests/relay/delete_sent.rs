//! `#[outbox(delete_sent)]`, the retention mode: the guarded outcome that records an
//! event as published deletes its row instead of keeping it as `SENT`. Every other
//! outcome, and every guard, is as without it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::Retried;
use outbox::{Delivery, Relay, Sink, SinkError, relay::MemorySink};
use outbox_testkit::events::Receipt;
use outbox_testkit::rows::{count, enqueue};
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;

fn receipt(name: &str) -> Receipt {
    Receipt { name: name.into() }
}

async fn rows(pool: &PgPool) -> Vec<(String, String, i64)> {
    sqlx::query_as("SELECT event_id, status, generation FROM receipt_events ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Ends the lease of every claimed row, as a crashed or paused publisher's would end.
async fn expire_leases(pool: &PgPool) {
    sqlx::query(
        "UPDATE receipt_events SET lease_until = statement_timestamp() - interval '1 second'
         WHERE status = 'INPROGRESS'",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn completing_deletes_the_row_and_a_stale_owner_deletes_nothing() -> TestResult {
    let db = schema_from_zero(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[receipt("a")]).await;

    // A publisher claims the event, stalls past its lease, and another takes over.
    let stale = Receipt::claim(pool).await?.ok_or("nothing to claim")?;
    expire_leases(pool).await;
    let owner = Receipt::claim(pool)
        .await?
        .ok_or("the expired claim is claimable")?;
    assert_eq!((stale.generation().get(), owner.generation().get()), (1, 2));

    let rejected = stale.complete(pool).await.unwrap_err();
    assert!(rejected.is_stale(), "{rejected}");
    assert_eq!(rows(pool).await, [("a".into(), "INPROGRESS".into(), 2)]);

    owner.complete(pool).await?;
    assert!(rows(pool).await.is_empty(), "published: the row is gone");
    let stats = outbox::stats::<Receipt>(pool).await?;
    assert_eq!(
        (stats.ready, stats.in_progress, stats.sent, stats.dead),
        (0, 0, 0, 0)
    );

    // A lease that ended is as final for the owner itself: nothing is deleted.
    enqueue(pool, &[receipt("b")]).await;
    let late = Receipt::claim(pool).await?.ok_or("nothing to claim")?;
    expire_leases(pool).await;
    assert!(late.complete(pool).await.unwrap_err().is_stale());
    assert_eq!(rows(pool).await, [("b".into(), "INPROGRESS".into(), 1)]);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn retry_and_fail_keep_the_row_as_without_delete_sent() -> TestResult {
    let db = schema_from_zero(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &[receipt("retried"), receipt("failed")]).await;
    let mut claims = Receipt::claim_batch(pool, 2).await?;
    let failed = claims.pop().ok_or("two claims")?;
    let retried = claims.pop().ok_or("two claims")?;
    assert_eq!(
        retried.retry(pool, Duration::ZERO).await?,
        Retried::Scheduled
    );
    failed.fail(pool, "rejected by the broker").await?;
    assert_eq!(
        rows(pool).await,
        [
            ("retried".into(), "READY".into(), 1),
            ("failed".into(), "DEAD".into(), 1)
        ]
    );
    db.drop_schema().await?;
    Ok(())
}

/// Publishes every event but those named `refused-*`, which it refuses for good; keeps
/// the names it published.
#[derive(Clone, Default)]
struct Refusing {
    published: Arc<Mutex<Vec<String>>>,
}

impl Sink<Receipt> for Refusing {
    async fn publish(&self, batch: &[Delivery<'_, Receipt>]) -> Vec<Result<(), SinkError>> {
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        batch
            .iter()
            .map(|d| {
                let name = &d.event().name;
                if name.starts_with("refused") {
                    Err(SinkError::permanent("refused"))
                } else {
                    published.push(name.clone());
                    Ok(())
                }
            })
            .collect()
    }
}

#[tokio::test]
async fn a_relay_deletes_what_it_published_and_keeps_what_it_could_not() -> TestResult {
    let db = schema_from_zero(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    // Batches that mix outcomes (recorded by one statement: deletes and updates), and
    // batches published whole (the all-published statement).
    let names: Vec<String> = (0..60)
        .map(|n| {
            if n % 20 == 7 {
                format!("refused-{n:02}")
            } else {
                format!("receipt-{n:02}")
            }
        })
        .collect();
    enqueue(pool, &names.iter().map(|n| receipt(n)).collect::<Vec<_>>()).await;
    let sink = Refusing::default();
    let relay = start(
        Relay::<Receipt, _>::new(pool.clone(), sink.clone())
            .batch_size(10)
            .concurrency(2),
    );
    wait_until(
        "only the refused rows are left",
        Duration::from_secs(20),
        async || rows(pool).await.len() == 3 && count::<Receipt>(pool, "DEAD").await == 3,
    )
    .await;
    relay.stop().await?;
    let left: BTreeSet<String> = rows(pool).await.into_iter().map(|r| r.0).collect();
    assert_eq!(
        left,
        ["refused-07", "refused-27", "refused-47"]
            .map(String::from)
            .into()
    );
    let mut published = sink.published.lock().unwrap().clone();
    published.sort_unstable();
    let accepted: Vec<&String> = names.iter().filter(|n| !left.contains(*n)).collect();
    assert_eq!(
        published.len(),
        57,
        "each accepted receipt once: {published:?}"
    );
    assert_eq!(published.iter().collect::<Vec<_>>(), accepted);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn each_event_is_published_once_and_leaves_nothing_behind() -> TestResult {
    let db = schema_from_zero(&[Receipt::migrations()]).await?;
    let pool = db.pool();
    let names: BTreeSet<String> = (0..300).map(|n| format!("receipt-{n:03}")).collect();
    enqueue(pool, &names.iter().map(|n| receipt(n)).collect::<Vec<_>>()).await;
    let sink = MemorySink::new();
    outbox_testkit::app::publish_all(
        pool,
        Relay::<Receipt, _>::new(pool.clone(), sink.clone()).concurrency(4),
    )
    .await?;
    let published: Vec<String> = sink.published().into_iter().map(|p| p.event.name).collect();
    assert_eq!(published.len(), 300, "once each");
    assert_eq!(published.into_iter().collect::<BTreeSet<_>>(), names);
    assert!(rows(pool).await.is_empty());
    db.drop_schema().await?;
    Ok(())
}
