// A column is NULL or holds a value: it has no room for `Some(None)`.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderPlaced {
    order_id: String,
    note: Option<Option<String>>,
}

fn main() {}
