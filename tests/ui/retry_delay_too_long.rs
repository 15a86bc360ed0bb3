// A `retry_delay` beyond the range of a PostgreSQL interval.
#[derive(outbox::Outbox)]
#[outbox(retry_delay = "300000 years")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
