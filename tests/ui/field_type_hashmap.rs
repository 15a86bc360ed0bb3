// A HashMap field, which has no column mapping, without #[outbox(json)].
use std::collections::HashMap;

#[derive(outbox::Outbox)]
struct OrderPlaced {
    quantities: HashMap<String, i32>,
}

fn main() {}
