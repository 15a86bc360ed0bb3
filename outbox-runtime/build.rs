//! One name for "a broker sink is built": `cfg(any_broker)`, set when any of the broker
//! features (`nats`, `rabbitmq`, `kafka`) is on, for the code they all share.

/// The cargo features of the broker sinks.
const BROKERS: [&str; 3] = ["NATS", "RABBITMQ", "KAFKA"];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(any_broker)");
    println!("cargo::rerun-if-changed=build.rs");
    if BROKERS
        .iter()
        .any(|feature| std::env::var_os(format!("CARGO_FEATURE_{feature}")).is_some())
    {
        println!("cargo::rustc-cfg=any_broker");
    }
}
