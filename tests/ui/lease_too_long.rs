// Beyond 10,000 years, `now() + lease` would leave PostgreSQL's timestamps.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events", lease = "20000years")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
