// Version 3 without a version 2: a column added later with `since = 2` would come after
// a version the database already applied, and be skipped.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    customer: String,
    #[outbox(since = 3)]
    note: Option<String>,
}

fn main() {}
