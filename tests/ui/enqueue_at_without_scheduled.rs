// A type not declared `#[outbox(scheduled)]` has no column to keep a time in, and no
// `enqueue_at`.
#[derive(outbox::Outbox)]
#[outbox(table = "reminder_events")]
struct Reminder {
    user: String,
}

async fn remind(pool: &sqlx::PgPool) {
    let at = chrono::Utc::now();
    let _ = Reminder { user: "ada".into() }.enqueue_at(at, pool).await;
}

fn main() {}
