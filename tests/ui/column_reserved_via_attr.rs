// A field renamed onto the outbox's own `generation` column.
#[derive(outbox::Outbox)]
struct OrderPlaced {
    #[outbox(column = "generation")]
    catalog_generation: i64,
}

fn main() {}
