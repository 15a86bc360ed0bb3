// A field named like the result column the claim statement adds beside the payload.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    outbox_reclaimed: bool,
}

fn main() {}
