//! One name for "a broker sink is built": `cfg(any_broker)`, set when the cargo feature
//! of any broker sink is on, for the code they all share. A broker sink is a file of
//! `src/sink/broker/` named as its feature (`nats.rs`, feature `nats`), so a new one
//! needs no line here.

/// Where the broker sinks are.
const BROKERS: &str = "src/sink/broker";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(any_broker)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed={BROKERS}");
    let brokers = std::fs::read_dir(BROKERS).expect("the broker sinks' directory");
    let any_on = brokers.filter_map(Result::ok).any(|file| {
        let path = file.path();
        let feature = path.file_stem().and_then(|stem| stem.to_str());
        path.extension().is_some_and(|extension| extension == "rs")
            && feature.is_some_and(|feature| {
                feature != "mod"
                    && std::env::var_os(format!("CARGO_FEATURE_{}", feature.to_uppercase()))
                        .is_some()
            })
    });
    if any_on {
        println!("cargo::rustc-cfg=any_broker");
    }
}
