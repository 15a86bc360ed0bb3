// A field of a user type with no column mapping, without #[outbox(json)].
#[derive(serde::Serialize, serde::Deserialize)]
struct Address {
    city: String,
}

#[derive(outbox::Outbox)]
struct OrderPlaced {
    shipping: Address,
}

fn main() {}
