// Two fields mapped to the same column.
#[derive(outbox::Outbox)]
struct EmailChanged {
    email: String,
    #[outbox(column = "email")]
    new_email: String,
}

fn main() {}
