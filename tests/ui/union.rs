// A union holds one of its fields at a time: an event's row holds all of them.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
union OrderPlaced {
    cents: i64,
    units: i32,
}

fn main() {}
