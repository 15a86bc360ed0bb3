// A generic event struct.
#[derive(outbox::Outbox)]
struct Wrapped<T> {
    payload: T,
}

fn main() {}
