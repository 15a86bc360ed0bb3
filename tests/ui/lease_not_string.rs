// A `lease` written as a bare number instead of a duration string.
#[derive(outbox::Outbox)]
#[outbox(lease = 30)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
