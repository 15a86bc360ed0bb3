// `_outbox_history_*` names the tables of applied migrations.
#[derive(outbox::Outbox)]
#[outbox(table = "_outbox_history_orders")]
struct OrderPlaced {
    order_id: String,
}

fn main() {}
