// `max_attempts = 0`: an event must be allowed at least one claim.
#[derive(outbox::Outbox)]
#[outbox(max_attempts = 0)]
struct OrderPlaced {
    customer: String,
}

fn main() {}
