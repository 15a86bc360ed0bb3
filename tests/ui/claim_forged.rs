// Building a Claim by hand, here to take over row 42: its fields are private.
#[derive(outbox::Outbox)]
struct Tick {}

fn forge(event: Tick) -> outbox::Claim<Tick> {
    outbox::Claim { id: 42, event }
}

fn main() {}
