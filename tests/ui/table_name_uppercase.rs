// An uppercase table name, which PostgreSQL would only keep if quoted.
#[derive(outbox::Outbox)]
#[outbox(table = "OrderEvents")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
