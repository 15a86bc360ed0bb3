// Beyond 1,000 years: the longest interval the outbox takes, so that `now() ± lease`
// stays within PostgreSQL's timestamps.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events", lease = "2000years")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
