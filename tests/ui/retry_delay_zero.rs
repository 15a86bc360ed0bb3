// A zero `retry_delay`: a failing event would be retried in a hot loop.
#[derive(outbox::Outbox)]
#[outbox(retry_delay = "0ms")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
