// A zero `lease`: every claim would expire at once.
#[derive(outbox::Outbox)]
#[outbox(lease = "0s")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
