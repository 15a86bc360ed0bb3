// Dropping a claim without an outcome, under #![deny(unused_must_use)].
#![deny(unused_must_use)]

#[derive(outbox::Outbox)]
struct Tick {}

async fn publish(pool: &sqlx::PgPool) {
    Tick::claim(pool).await.unwrap().expect("a tick is due");
}

fn main() {}
