// An unknown key in the struct's #[outbox(..)] attribute.
#[derive(outbox::Outbox)]
#[outbox(tabel = "order_events")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
