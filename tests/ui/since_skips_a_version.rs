// Version 2 left out: once version 3 is applied, refinery would never apply a version 2.
#[derive(outbox::Outbox)]
#[outbox(table = "customer_events")]
struct EmailChanged {
    customer_id: String,
    #[outbox(since = 3)]
    referrer: Option<String>,
}

fn main() {}
