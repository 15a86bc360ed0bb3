// `scheduled` is a flag, or `scheduled(since = N)`; and `since` is its only key.
#[derive(outbox::Outbox)]
#[outbox(table = "reminder_events", scheduled = true)]
struct Reminder {
    user: String,
}

#[derive(outbox::Outbox)]
#[outbox(table = "notice_events", scheduled(at = 2))]
struct Notice {
    user: String,
}

fn main() {}
