// A struct attribute (`lease`) written on a field.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderPlaced {
    #[outbox(lease = "30s")]
    customer: String,
}

fn main() {}
