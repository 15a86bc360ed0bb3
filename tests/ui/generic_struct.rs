// A generic struct: an event type's table and columns are fixed at compile time.
#[derive(outbox::Outbox)]
struct Wrapped<T> {
    payload: T,
}

fn main() {}
