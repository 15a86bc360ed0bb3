// A column named by the attribute must be a plain identifier too.
#[derive(outbox::Outbox)]
#[outbox(table = "order_events")]
struct OrderPlaced {
    #[outbox(column = "Total Cents")]
    total_cents: i64,
}

fn main() {}
