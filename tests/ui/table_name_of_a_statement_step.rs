// A struct whose table would take the name of a step of the generated statements
// (`WITH done AS (..)`): inside them, `done` would be the step, not the table.
#[derive(outbox::Outbox)]
struct Done {
    order_id: String,
}

fn main() {}
