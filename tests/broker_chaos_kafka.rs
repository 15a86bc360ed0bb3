//! The outbox end to end through a Kafka-protocol broker under chaos, in a short form for
//! CI (1,500 events, about half a minute): business transactions commit orders and their
//! events; four relay processes publish them through `KafkaSink` (the idempotent
//! producer, `acks=all`) to a tansu broker of the test's own; two consumer processes
//! apply each event's effect with its inbox row in one PostgreSQL transaction, then commit
//! their offsets. The test SIGKILLs and SIGSTOPs relays and consumers, terminates their
//! sessions, and cuts every connection to the broker at least three times. Every event
//! must be applied exactly once, be in the topic at least once and be delivered at least
//! once; the output counts and explains every copy. `tests/broker_chaos.rs` is the same
//! through NATS, and `cargo run --release --features nats,rabbitmq,kafka --example
//! broker_chaos -- --broker kafka` the long form.
//!
//! Every random choice comes from one seed, printed with the result and in a failure's
//! message: `OUTBOX_CHAOS_SEED=<seed>` replays that schedule; without it each run draws a
//! fresh seed.
//!
//! Needs the tansu binary (`OUTBOX_TANSU`, or where `.ci/run` installs it), and
//! PostgreSQL as the other tests do.

use outbox_testkit::chaos::broker::{self, BrokerConfig, Kafka};
use outbox_testkit::child::ChildCommand;
use outbox_testkit::seed::{chaos_seed, replayable};

/// A relay or consumer process: re-executed by the test with the chaos environment set,
/// it runs until SIGTERM. A no-op in a normal test run.
#[test]
fn broker_chaos_kafka_child() {
    broker::child_main_if_requested::<Kafka>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_applied_exactly_once_through_kills_pauses_and_cut_connections() {
    let events = std::env::var("OUTBOX_CHAOS_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_500);
    let mut config = BrokerConfig::new(events);
    config.run.verbose = std::env::var_os("OUTBOX_CHAOS_VERBOSE").is_some();
    config.run.seed = chaos_seed();
    // Boxed: the run's future is large.
    replayable(
        config.run.seed,
        Box::pin(async {
            let report =
                broker::run::<Kafka>(&config, &ChildCommand::test("broker_chaos_kafka_child"))
                    .await
                    .map_err(|error| format!("the broker chaos run could not run: {error}"))?;
            println!("{report}");
            assert!(report.failures.is_empty(), "{report}");
            assert!(
                report.outages.len() >= 3 && report.consumer_kills >= 2 && report.relay.kills >= 2,
                "{report}"
            );
            Ok(())
        }),
    )
    .await;
}
