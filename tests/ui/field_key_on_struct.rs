// A field attribute (`json`) written on the struct.
#[derive(outbox::Outbox)]
#[outbox(json)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
