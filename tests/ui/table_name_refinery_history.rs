// refinery records the application's migrations in `refinery_schema_history` unless
// told otherwise, and `migrate_with_app` runs them beside the outbox's.
#[derive(outbox::Outbox)]
#[outbox(table = "refinery_schema_history")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
