// `publish_at` is where a scheduled table keeps an event's time.
#[derive(outbox::Outbox)]
#[outbox(table = "reminder_events")]
struct Reminder {
    user: String,
    publish_at: String,
}

fn main() {}
