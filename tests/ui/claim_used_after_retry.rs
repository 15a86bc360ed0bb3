// Using a claim again after `retry` consumed it.
#[derive(outbox::Outbox)]
struct Tick {}

async fn publish(pool: &sqlx::PgPool, claim: outbox::Claim<Tick>) {
    let _ = claim.retry(pool, None).await;
    claim.complete(pool).await.unwrap();
}

fn main() {}
