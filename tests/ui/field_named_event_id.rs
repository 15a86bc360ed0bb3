// A payload field named `event_id`: the event id's column already has that name, and
// the field was most likely meant to be the event id.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderPlaced {
    event_id: uuid::Uuid,
    customer: String,
}

fn main() {}
