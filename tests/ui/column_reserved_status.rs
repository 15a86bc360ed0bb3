// A field named like the outbox's own `status` column.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    status: String,
}

fn main() {}
