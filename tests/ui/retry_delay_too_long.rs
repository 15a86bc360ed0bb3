// A `retry_delay` beyond the longest interval the outbox takes (1,000 years).
#[derive(outbox::Outbox)]
#[outbox(retry_delay = "300000 years")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
