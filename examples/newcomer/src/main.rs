//! A first program with `outbox`: an order and its event written in one transaction,
//! then a relay that publishes the event and shuts down.

use std::time::Duration;

use outbox::{CancellationToken, Relay, StdoutSink};
use serde::{Deserialize, Serialize};

/// One line of an order, stored inside the event as jsonb.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Line {
    sku: String,
    quantity: i32,
}

/// The event. The derive gives it a table (`order_events`), a migration, and typed
/// `enqueue` / `claim` code.
#[derive(outbox::Outbox, Debug, Clone)]
#[outbox(
    table = "order_events",
    lease = "30s",
    retry_delay = "1m",
    max_attempts = 10
)]
struct OrderPlaced {
    #[outbox(event_id)] // the stable id consumers deduplicate on
    order_id: uuid::Uuid,
    customer: String,
    total_cents: i64,
    note: Option<String>, // nullable column
    #[outbox(json)] // any serde type, stored as jsonb
    lines: Vec<Line>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // outbox logs through `tracing`: without a subscriber, nothing is logged at all.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();

    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    // Says where and why when it cannot connect (a wrong port: `Connection refused`).
    let pool = outbox::connect(&url).await?;

    // At startup: creates the outbox table the first time, checks it afterwards.
    outbox::migrate(&pool, &[OrderPlaced::migrations()]).await?;
    // Your own table (in a real application, one of your migrations).
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders \
         (id uuid PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

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
    let enqueued = order.enqueue(&mut *tx).await?;
    tx.commit().await?;
    println!("enqueued {}", enqueued.event_id());

    // The publisher, in the background. StdoutSink prints each event it is handed:
    // `event_id generation attempt event`.
    let shutdown = CancellationToken::new();
    let relay = Relay::<OrderPlaced, _>::new(pool.clone(), StdoutSink);
    let mut relay = tokio::spawn(relay.run(shutdown.clone()));

    // A service runs the relay until SIGTERM. This program stops it once nothing is
    // left to publish.
    loop {
        let stats = outbox::stats::<OrderPlaced>(&pool).await?;
        if stats.ready + stats.in_progress == 0 {
            break;
        }
        tokio::select! {
            stopped = &mut relay => {
                stopped??; // a fatal error: the table is missing, permission denied, ...
                return Err("the relay stopped on its own".into());
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    shutdown.cancel(); // graceful: in-flight sends finish and are recorded
    relay.await??;
    println!("published; the relay has shut down");
    Ok(())
}
