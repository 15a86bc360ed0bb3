// Two fields marked #[outbox(event_id)].
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(event_id)]
    order_id: uuid::Uuid,
    #[outbox(event_id)]
    customer: String,
}

fn main() {}
