// The schema is the connection's (its search_path), not part of the table's name.
#[derive(outbox::Outbox)]
#[outbox(table = "app.order_events")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
