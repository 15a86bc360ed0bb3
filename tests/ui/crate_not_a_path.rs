// `crate` names the outbox crate by a Rust path.
#[derive(outbox::Outbox)]
#[outbox(crate = "the outbox crate")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
