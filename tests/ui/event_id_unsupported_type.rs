// An #[outbox(event_id)] field of a type that cannot be a stable id.
#[derive(outbox::Outbox)]
struct Measured {
    #[outbox(event_id)]
    reading: f64,
}

fn main() {}
