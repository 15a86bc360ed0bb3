// Using a claim again after `complete` consumed it.
#[derive(outbox::Outbox)]
struct Tick {}

async fn publish(pool: &sqlx::PgPool, claim: outbox::Claim<Tick>) {
    claim.complete(pool).await.unwrap();
    let _ = claim.retry(pool, None).await;
}

fn main() {}
