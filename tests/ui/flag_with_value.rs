// A value given to the `json` flag.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(json = true)]
    lines: Vec<String>,
}

fn main() {}
