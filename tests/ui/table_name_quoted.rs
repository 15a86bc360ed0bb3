// A table name written with its own SQL quotes.
#[derive(outbox::Outbox)]
#[outbox(table = "\"order_events\"")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
