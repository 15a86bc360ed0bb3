// A `lease` that is not a duration.
#[derive(outbox::Outbox)]
#[outbox(lease = "soon")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
