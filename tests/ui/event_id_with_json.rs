// `event_id` combined with `json` on the same field.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(event_id, json)]
    order_id: String,
}

fn main() {}
