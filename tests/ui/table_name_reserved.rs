// A table name the outbox keeps for itself: the consumers' inbox.
#[derive(outbox::Outbox)]
#[outbox(table = "outbox_inbox")]
struct PaymentReceived {
    payment_id: String,
}

fn main() {}
