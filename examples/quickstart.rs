//! The main job, end to end: migrate at startup, enqueue an event in the same
//! transaction as the business write, claim it, publish it (to stdout), record the
//! outcome. Then the two failures the protocol exists for: a publisher that dies
//! holding a claim, and a paused publisher that wakes up after someone else took over.
//!
//! ```text
//! cargo run --example quickstart            # DATABASE_URL, or a throwaway PostgreSQL
//! ```

mod common;

use std::time::Duration;

use common::{Line, OrderPlaced, PaymentCaptured};
use outbox::OutboxError;

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> Result {
    // A fresh schema on DATABASE_URL (or on a throwaway cluster when it is unset), so
    // the example leaves nothing behind. In an application: `PgPool::connect(url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();

    // Startup: the application's own refinery migrations, then the outbox tables'.
    let app = outbox::refinery::Runner::new(&common::app_migrations());
    let report = outbox::migrate_with_app(
        pool,
        &app,
        &[OrderPlaced::migrations(), PaymentCaptured::migrations()],
    )
    .await?;
    for m in report.applied() {
        println!("migrated {:<14} {}", m.target(), m.name());
    }

    // The business write and its event commit together, or not at all.
    let order = OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: "ada@example.com".into(),
        total_cents: 4_200,
        note: None,
        lines: vec![Line {
            sku: "tea-earl-grey".into(),
            quantity: 2,
        }],
    };
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3)")
        .bind(order.order_id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(&mut *tx)
        .await?;
    let event_id = order.enqueue(&mut *tx).await?.into_event_id();
    tx.commit().await?;
    println!("\nenqueued OrderPlaced {event_id} with its order");

    // The publisher: claim, send, record. Consumers dedupe on the event id.
    while let Some(claim) = OrderPlaced::claim(pool).await? {
        println!(
            "publish  event_id={} generation={} attempt={} {:?}",
            claim.event_id(),
            claim.generation(),
            claim.attempt(),
            claim.event()
        );
        claim.complete(pool).await?;
    }
    println!("recorded SENT");

    // Recovery: publisher A claims a payment event and stops before recording anything
    // (it crashed, or it is paused: a GC pause, a frozen VM, a SIGSTOP).
    let payment = PaymentCaptured {
        payment_id: uuid::Uuid::now_v7(),
        amount_cents: 4_200,
    };
    payment.enqueue(pool).await?;
    let publisher_a = PaymentCaptured::claim(pool).await?.ok_or("a due payment")?;
    println!(
        "\npublisher A claimed {} (generation {}) and stopped",
        publisher_a.event_id(),
        publisher_a.generation()
    );
    assert!(
        PaymentCaptured::claim(pool).await?.is_none(),
        "the lease still protects A's claim"
    );

    tokio::time::sleep(Duration::from_millis(1_100)).await; // the 1s lease expires
    let mut takeover = PaymentCaptured::claim(pool)
        .await?
        .ok_or("the expired claim is claimable again")?;
    println!(
        "publisher B reclaimed {} with generation {}",
        takeover.event_id(),
        takeover.generation()
    );

    // A was only paused. It wakes up and tries to record its outcome: fenced off.
    match publisher_a.complete(pool).await {
        Err(e @ OutboxError::Stale { .. }) => {
            println!("publisher A woke up; its complete was rejected: {e}");
        }
        other => return Err(format!("a stale owner must be rejected, got {other:?}").into()),
    }
    takeover.renew(pool).await?; // B's send is slow: it renews its lease, guarded the same way
    takeover.complete(pool).await?;
    println!("publisher B recorded SENT; the event may have been sent twice, under one event_id");

    sandbox.drop_schema().await?;
    Ok(())
}
