// Version 1 creates the table: a table created scheduled says `scheduled`, no `since`.
#[derive(outbox::Outbox)]
#[outbox(table = "reminder_events", scheduled(since = 1))]
struct Reminder {
    user: String,
}

fn main() {}
