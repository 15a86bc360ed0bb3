// An enum: an event type is one table, with one column per named field.
#[derive(outbox::Outbox)]
enum OrderEvent {
    Placed { customer: String },
    Cancelled { reason: String },
}

fn main() {}
