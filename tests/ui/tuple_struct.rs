// A tuple struct: its fields have no names to become columns.
#[derive(outbox::Outbox)]
struct OrderPlaced(i64, String);

fn main() {}
