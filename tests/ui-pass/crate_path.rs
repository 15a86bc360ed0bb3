// The outbox crate named by another path, as a dependency renamed in Cargo.toml or
// re-exported by another crate is.
mod deps {
    pub use ::outbox as renamed;
}

#[derive(deps::renamed::Outbox)]
#[outbox(crate = "crate::deps::renamed", table = "renamed_events")]
struct Shipped {
    #[outbox(event_id)]
    name: String,
}

fn main() {
    let _ = Shipped::migrations();
}
