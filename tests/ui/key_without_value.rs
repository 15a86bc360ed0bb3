// A key that takes a value, given none.
#[derive(outbox::Outbox)]
#[outbox(table)]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
