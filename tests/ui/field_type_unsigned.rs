// An unsigned integer field: PostgreSQL has no unsigned column type.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    quantity: u32,
}

fn main() {}
