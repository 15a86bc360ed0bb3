// `no_event_id_index` on a type whose ids come from a field: enqueue skips an id already
// in the table, and only the unique index on `event_id` can tell it is there.
#[derive(outbox::Outbox)]
#[outbox(table = "invoice_events", no_event_id_index)]
struct InvoiceIssued {
    #[outbox(event_id)]
    invoice: String,
}

fn main() {}
