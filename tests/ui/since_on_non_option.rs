// `since = 2` on a field that is not an Option: existing rows have no value for it.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    customer: String,
    #[outbox(since = 2)]
    referrer: String,
}

fn main() {}
