// PostgreSQL's intervals count microseconds: a finer delay would be rounded silently.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events", retry_delay = "1500ns")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
