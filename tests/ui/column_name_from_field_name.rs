// No `column`, and a field name that is not a plain SQL identifier.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    quantité: i32,
}

fn main() {}
