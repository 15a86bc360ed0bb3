// A lease shorter than a renewal round trip: every claim would expire before the relay
// could renew it, and every event would die of it.
#[derive(outbox::Outbox)]
#[outbox(lease = "1ms")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
