// A table name over PostgreSQL's 63-byte identifier limit (64 bytes).
#[derive(outbox::Outbox)]
#[outbox(table = "order_events_of_the_european_and_north_american_retail_divisions")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
