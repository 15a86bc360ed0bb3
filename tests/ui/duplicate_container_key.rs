// The same struct key given twice, across two attributes.
#[derive(outbox::Outbox)]
#[outbox(lease = "30s")]
#[outbox(lease = "1m")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
