// A struct whose table would be one of the outbox's own: the error points at the name.
#[derive(outbox::Outbox)]
struct OutboxCatalog {
    entry: String,
}

fn main() {}
