// A `retry_delay` with a unit that is not a time unit.
#[derive(outbox::Outbox)]
#[outbox(retry_delay = "5 fortnights")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
