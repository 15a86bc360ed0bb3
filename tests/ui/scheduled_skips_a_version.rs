// The schedule's column comes with the table's versions, which follow each other from 2.
#[derive(outbox::Outbox)]
#[outbox(table = "reminder_events", scheduled(since = 3))]
struct Reminder {
    user: String,
}

fn main() {}
