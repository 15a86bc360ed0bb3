// The key's type is the one mistake: `dead_releases_key` has its key all the same.
#[derive(outbox::Outbox)]
#[outbox(dead_releases_key)]
struct OrderPlaced {
    #[outbox(key)]
    order_id: u64,
}

fn main() {}
