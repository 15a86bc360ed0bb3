// An unknown key in a field's #[outbox(..)] attribute.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(jsonb)]
    lines: serde_json::Value,
}

fn main() {}
