// No `table`, and a struct name that is not a plain SQL identifier once snake-cased.
#[derive(outbox::Outbox)]
struct CommandePassée {
    client: String,
}

fn main() {}
