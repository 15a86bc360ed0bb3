// The event id identifies one event; the ordering key is the aggregate many events share.
// The one mistake: `dead_releases_key` has its key all the same.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events", dead_releases_key)]
struct OrderShipped {
    #[outbox(event_id, key)]
    id: String,
}

fn main() {}
