// A zero `lease`: every claim would expire at once; it is below the 1s floor like any too-short lease.
#[derive(outbox::Outbox)]
#[outbox(lease = "0s")]
struct OrderPlaced {
    customer: String,
}

fn main() {}
