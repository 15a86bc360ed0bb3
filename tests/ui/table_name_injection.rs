// A table name that smuggles SQL.
#[derive(outbox::Outbox)]
#[outbox(table = "orders; DROP TABLE x")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
