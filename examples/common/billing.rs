//! The broker consumer examples' business: each customer's order count and total, which
//! a consumer adds every order to once (the effect it commits with its inbox row).

use sqlx::{PgConnection, PgPool};

use super::{Line, OrderPlaced};

/// An order of one tin of tea.
pub fn order(customer: &str, total_cents: i64) -> OrderPlaced {
    OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: customer.into(),
        total_cents,
        note: None,
        lines: vec![Line {
            sku: "tea-earl-grey".into(),
            quantity: 1,
        }],
    }
}

/// The outbox table, the consumer's inbox, and the table of totals.
pub async fn prepare(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    outbox::migrate(pool, &[OrderPlaced::migrations()]).await?;
    outbox::inbox::migrate(pool).await?; // the consumer's side: its inbox table
    sqlx::query(
        "CREATE TABLE customer_totals \
         (customer text PRIMARY KEY, orders int NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The effect: one more order of `cents` for `customer` (in the consumer's transaction).
pub async fn add_to_totals(
    tx: &mut PgConnection,
    customer: &str,
    cents: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO customer_totals VALUES ($1, 1, $2) ON CONFLICT (customer) \
         DO UPDATE SET orders = customer_totals.orders + 1, \
         total_cents = customer_totals.total_cents + $2",
    )
    .bind(customer)
    .bind(cents)
    .execute(tx)
    .await
    .map(drop)
}

/// Prints the totals: each order counted once, however often it was delivered.
pub async fn print_totals(pool: &PgPool) -> Result<(), sqlx::Error> {
    let totals: Vec<(String, i32, i64)> = sqlx::query_as(
        "SELECT customer, orders, total_cents FROM customer_totals ORDER BY customer",
    )
    .fetch_all(pool)
    .await?;
    println!("\ncustomer_totals:");
    for (customer, orders, cents) in totals {
        println!("  {customer:<16} {orders} order(s), {cents} cents");
    }
    Ok(())
}
