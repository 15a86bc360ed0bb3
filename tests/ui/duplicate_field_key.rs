// The same field key given twice in one attribute.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(column = "buyer", column = "client")]
    customer: String,
}

fn main() {}
