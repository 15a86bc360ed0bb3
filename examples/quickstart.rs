//! The main job, end to end, then the failure the protocol exists for:
//!
//! 1. startup: the application's migrations, then the outbox tables';
//! 2. an order and its `OrderPlaced` event, committed in one transaction (and a
//!    retried request that enqueues the same event again: a no-op);
//! 3. the relay publishes the event (to stdout), then shuts down gracefully;
//! 4. recovery: publisher A stalls holding a claim, its lease runs out, publisher B
//!    takes over, and A's late outcome is rejected.
//!
//! ```text
//! cargo run --example quickstart            # DATABASE_URL, or a throwaway PostgreSQL
//! ```

mod common;

use std::time::Duration;

use common::{Line, OrderPlaced, PaymentCaptured};
use outbox::{Enqueued, OutboxError, Relay, StdoutSink};
use sqlx::PgPool;

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> Result {
    // A scratch schema, dropped at the end (on DATABASE_URL, or on a throwaway local
    // PostgreSQL when it is unset). In your application: `PgPool::connect(&database_url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();

    startup(pool).await?;
    place_order(pool).await?;
    publish(pool).await?;
    recover(pool).await?;

    sandbox.drop_schema().await?;
    Ok(())
}

/// At startup, in every process: idempotent, and safe when several start at once.
async fn startup(pool: &PgPool) -> Result {
    println!("== 1. startup");
    let app = outbox::schema::refinery::Runner::new(&common::app_migrations());
    let report = outbox::schema::migrate_with_app(
        pool,
        &app,
        &[OrderPlaced::migrations(), PaymentCaptured::migrations()],
    )
    .await?;
    for m in report.applied() {
        println!("migrated {:<14} {}", m.target(), m.name());
    }
    Ok(())
}

/// The business write and its event commit together, or not at all.
async fn place_order(pool: &PgPool) -> Result {
    println!("\n== 2. an order and its event, in one transaction");
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
    for request in ["the request", "the client's retry of the same request"] {
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(order.order_id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(&mut *tx)
        .await?;
        let said = match order.enqueue(&mut *tx).await? {
            Enqueued::New(id) => format!("order {id} and its event, committed together"),
            Enqueued::Duplicate(id) => format!(
                "event {id} is already queued; enqueue wrote nothing and the transaction \
                 went on (the order id is the event id)"
            ),
        };
        println!("{request}: {said}");
        tx.commit().await?;
    }
    Ok(())
}

/// The relay claims the event, hands it to the sink, and records it `SENT`.
async fn publish(pool: &PgPool) -> Result {
    println!("\n== 3. the relay publishes (StdoutSink prints: event_id generation attempt event)");
    common::publish_all(pool, Relay::<OrderPlaced, _>::new(pool.clone(), StdoutSink)).await?;
    let stats = outbox::stats::<OrderPlaced>(pool).await?;
    println!(
        "the relay shut down: {} event sent, {} waiting",
        stats.sent,
        stats.ready + stats.in_progress
    );
    Ok(())
}

/// Recovery, by hand with the claim API (the relay does all of this on its own):
/// `PaymentCaptured` has a 1-second lease, so the story takes a second.
async fn recover(pool: &PgPool) -> Result {
    println!("\n== 4. a publisher stalls; another takes over");
    let payment = PaymentCaptured {
        payment_id: uuid::Uuid::now_v7(),
        amount_cents: 4_200,
    };
    payment.enqueue(pool).await?;

    let a = PaymentCaptured::claim(pool).await?.ok_or("a due payment")?;
    let id = a.event_id().clone();
    println!(
        "Publisher A claimed payment event {id} (generation {}, a 1-second lease), \
         then stalled: a GC pause, a frozen VM, a network partition.",
        a.generation()
    );
    if PaymentCaptured::claim(pool).await?.is_some() {
        return Err("a live lease must protect A's claim".into());
    }
    println!("Publisher B looked for work and found none: A's lease still protects the event.");

    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let mut b = PaymentCaptured::claim(pool)
        .await?
        .ok_or("the expired claim is claimable again")?;
    println!(
        "A's lease ran out. B claimed the event again: generation {}, attempt {}.",
        b.generation(),
        b.attempt()
    );

    match a.complete(pool).await {
        Err(OutboxError::Stale { .. }) => {
            println!(
                "A woke up, sent the payment, and reported it complete: rejected, because \
                 the event now belongs to B. Nothing was recorded for A."
            );
        }
        other => return Err(format!("a stale owner must be rejected, got {other:?}").into()),
    }
    b.renew(pool).await?; // a slow send extends its lease, guarded the same way
    b.complete(pool).await?;
    println!(
        "B sent it and recorded it SENT. The consumer may have received the payment \
         twice, from A and from B, both times as event {id}: it deduplicates on that id."
    );
    Ok(())
}
