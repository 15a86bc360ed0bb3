// `max_attempts` given as a string instead of an integer.
#[derive(outbox::Outbox)]
#[outbox(max_attempts = "3")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
