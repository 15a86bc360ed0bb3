// An attribute key written as a path: named as written in the error.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderPlaced {
    #[outbox(outbox::key)]
    order_id: String,
}

fn main() {}
