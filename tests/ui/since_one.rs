// `since = 1`: version 1 is the CREATE TABLE, so a later column needs 2 or more.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    customer: String,
    #[outbox(since = 1)]
    referrer: Option<String>,
}

fn main() {}
