// A unit struct: an event needs named fields (an empty payload is written `{}`).
#[derive(outbox::Outbox)]
struct Tick;

fn main() {}
