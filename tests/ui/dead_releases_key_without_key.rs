// `dead_releases_key` is a policy of the ordering key: without a key it means nothing.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events", dead_releases_key)]
struct OrderShipped {
    order_id: i64,
}

fn main() {}
