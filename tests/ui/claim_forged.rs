// Building a Claim by hand, here to take over another row: its fields are private.
#[derive(outbox::Outbox)]
struct Tick {}

fn forge(claim: outbox::Claim<Tick>) -> outbox::Claim<Tick> {
    outbox::Claim { id: 42, ..claim }
}

fn main() {}
