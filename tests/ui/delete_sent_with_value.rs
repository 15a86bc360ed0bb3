// The retention mode is a flag on the struct, not a boolean.
#[derive(outbox::Outbox)]
#[outbox(table = "receipts", delete_sent = false)]
struct Receipt {
    amount_cents: i64,
}

fn main() {}
