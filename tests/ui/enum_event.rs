// An enum.
#[derive(outbox::Outbox)]
enum OrderEvent {
    Placed { customer: String },
    Cancelled { reason: String },
}

fn main() {}
