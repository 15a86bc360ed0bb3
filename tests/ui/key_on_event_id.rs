// The event id identifies one event; the ordering key is the aggregate many events share.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderShipped {
    #[outbox(event_id, key)]
    id: String,
}

fn main() {}
