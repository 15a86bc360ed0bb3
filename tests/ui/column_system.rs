// A field named like a PostgreSQL system column, which CREATE TABLE refuses.
#[derive(outbox::Outbox)]
struct RowCopied {
    xmin: i64,
}

fn main() {}
