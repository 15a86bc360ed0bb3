// `max_attempts = 0`: no event could ever be claimed.
#[derive(outbox::Outbox)]
#[outbox(max_attempts = 0)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
