// Several mistakes in one struct: every one is reported by a single compile.
#[derive(outbox::Outbox)]
#[outbox(tabel = "orders", lease = "soon", max_attempts = 0)]
struct OrderPlaced {
    #[outbox(event_id)]
    order_id: f64,
    #[outbox(event_id)]
    customer: String,
    status: String,
    lines: std::collections::HashMap<String, i32>,
    #[outbox(since = 2)]
    referrer: String,
}

fn main() {}
