// A `json` field whose type serde cannot write or read: the error is at the field's type.
struct Line {
    sku: String,
}

#[derive(outbox::Outbox)]
struct OrderPlaced {
    customer: String,
    #[outbox(json)]
    lines: Vec<Line>,
}

fn main() {}
