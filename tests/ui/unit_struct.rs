// A unit struct.
#[derive(outbox::Outbox)]
struct Tick;

fn main() {}
