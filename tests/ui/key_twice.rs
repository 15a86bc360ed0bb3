// One ordering key per type: events are ordered within one aggregate.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderShipped {
    #[outbox(key)]
    order_id: i64,
    #[outbox(key)]
    customer_id: i64,
}

fn main() {}
