// An event struct that borrows its data.
#[derive(outbox::Outbox)]
struct OrderPlaced<'a> {
    customer: &'a str,
}

fn main() {}
