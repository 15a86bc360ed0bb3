// An ordering key is an aggregate id compared by equality: not a float, not JSON.
#[derive(outbox::Outbox)]
#[outbox(table = "readings")]
struct Reading {
    #[outbox(key)]
    sensor: f64,
    value: i64,
}

#[derive(outbox::Outbox)]
#[outbox(table = "documents")]
struct Document {
    #[outbox(key, json)]
    owner: serde_json::Value,
}

fn main() {}
