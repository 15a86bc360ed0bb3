//! An outbox in a state worth operating, left in a schema of its own for the `outbox`
//! command line and its dashboard: a backlog, events published in the last minute, dead
//! events with their errors, claims whose publishers "died" (their leases expire a
//! second later).
//!
//! ```text
//! export DATABASE_URL=postgres://localhost/postgres
//! cargo run --example ops_demo                         # seeds the schema outbox_demo
//! cargo run --features cli --bin outbox -- --schema outbox_demo status
//! cargo run --features cli --bin outbox -- --schema outbox_demo dead
//! cargo run --features cli --bin outbox -- --schema outbox_demo serve --allow-writes
//! cargo run --example ops_demo -- --drop               # removes it
//! ```
//!
//! Unlike the other examples it needs `DATABASE_URL`: what it leaves behind must outlive
//! it.

mod common;

use clap::Parser as _;
use common::{EmailChanged, Line, OrderPlaced, PaymentCaptured};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Seeds (or drops) a schema of outbox tables in a state worth operating.
#[derive(clap::Parser, Debug)]
#[command(name = "ops_demo")]
struct Args {
    /// The schema to seed (created if missing; its outbox tables start over).
    #[arg(long, default_value = "outbox_demo")]
    schema: String,
    /// Drop the schema instead.
    #[arg(long)]
    drop: bool,
}

#[tokio::main]
async fn main() -> Result {
    let args = Args::parse();
    if !is_plain_identifier(&args.schema) {
        return Err(format!(
            "--schema {:?}: a plain lowercase identifier, please",
            args.schema
        )
        .into());
    }
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL: the demo's schema must outlive this process")?;
    let options: PgConnectOptions = url.parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await?;
    let schema = &args.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&admin)
    .await?;
    if args.drop {
        println!("dropped the schema {schema}");
        return Ok(());
    }
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    seed(&pool).await?;
    println!(
        "seeded the schema {schema}; now try:\n  \
         cargo run --features cli --bin outbox -- --schema {schema} status\n  \
         cargo run --features cli --bin outbox -- --schema {schema} dead\n  \
         cargo run --features cli --bin outbox -- --schema {schema} serve --allow-writes"
    );
    Ok(())
}

fn is_plain_identifier(name: &str) -> bool {
    name.chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

async fn seed(pool: &PgPool) -> Result {
    outbox::migrate(
        pool,
        &[
            OrderPlaced::migrations(),
            EmailChanged::migrations(),
            PaymentCaptured::migrations(),
        ],
    )
    .await?;

    // Orders: 200 placed, 150 published, 2 refused for good, the rest waiting.
    let orders: Vec<OrderPlaced> = (0..200_i32)
        .map(|n| OrderPlaced {
            order_id: uuid::Uuid::now_v7(),
            customer: format!("customer-{}", n % 17),
            total_cents: 1_000 + i64::from(n) * 37,
            note: None,
            lines: vec![Line {
                sku: format!("SKU-{}", n % 5),
                quantity: 1 + n % 3,
            }],
        })
        .collect();
    OrderPlaced::enqueue_all(&orders, pool).await?;
    for claim in OrderPlaced::claim_batch(pool, 150).await? {
        claim.complete(pool).await?;
    }
    for claim in OrderPlaced::claim_batch(pool, 2).await? {
        claim
            .fail(pool, "the broker refused it: no such topic `orders.v2`")
            .await?;
    }

    // Customers: a backlog nobody publishes.
    for n in 0..30 {
        EmailChanged {
            customer: format!("customer-{n}"),
            email: format!("c{n}@example.com"),
            referrer: None,
        }
        .enqueue(pool)
        .await?;
    }

    // Payments: 3 claimed by a publisher that "dies" (a one-second lease, never
    // renewed): expired claims a second from now, taken over by the next claim.
    for n in 0..10 {
        PaymentCaptured {
            payment_id: uuid::Uuid::now_v7(),
            amount_cents: 500 + n,
        }
        .enqueue(pool)
        .await?;
    }
    let stalled = PaymentCaptured::claim_batch(pool, 3).await?;
    drop(stalled);
    Ok(())
}
