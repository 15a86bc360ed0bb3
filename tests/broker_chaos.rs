//! The outbox end to end through NATS JetStream under chaos, in a short form for CI
//! (about 1,500 events, a minute): business transactions commit orders and their events;
//! four relay processes publish them through `JetStreamSink` to a `nats-server` of the
//! test's own; two consumer processes apply each event's effect with its inbox row in one
//! PostgreSQL transaction, then acknowledge it. The test SIGKILLs and SIGSTOPs relays and
//! consumers, terminates their sessions, and kills and restarts the server. Every event
//! must be applied exactly once, stored at least once (more only outside JetStream's
//! duplicate window), and delivered at least once; the output counts and explains every
//! duplicate. `cargo run --release --features nats,rabbitmq,kafka --example broker_chaos` is the
//! long form, through NATS, RabbitMQ or Kafka.
//!
//! Every random choice comes from one seed, printed with the result and in a failure's
//! message: `OUTBOX_CHAOS_SEED=<seed>` replays that schedule; without it each run draws a
//! fresh seed.
//!
//! Needs the `nats-server` binary (the test starts its own server, on a free port), and
//! PostgreSQL as the other tests do.

use std::time::Duration;

use outbox_testkit::chaos::broker::{self, BrokerConfig, Nats};
use outbox_testkit::child::ChildCommand;
use outbox_testkit::seed::{chaos_seed, replayable};

/// A relay or consumer process: re-executed by the test with the chaos environment set,
/// it runs until SIGTERM. A no-op in a normal test run.
#[test]
fn broker_chaos_child() {
    broker::child_main_if_requested::<Nats>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_applied_exactly_once_through_kills_pauses_and_broker_restarts() {
    let events = std::env::var("OUTBOX_CHAOS_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_500);
    let mut config = BrokerConfig::new(events);
    // Shorter than the 2 s lease: a redelivery after a reclaim falls outside it and is
    // stored again, a copy the consumers' inbox must absorb; a retry soon after the first
    // publication falls inside it and is stored once.
    config.duplicate_window = Duration::from_secs(1);
    config.run.verbose = std::env::var_os("OUTBOX_CHAOS_VERBOSE").is_some();
    config.run.seed = chaos_seed();
    // Boxed: the run's future is large.
    replayable(
        config.run.seed,
        Box::pin(async {
            let report = broker::run::<Nats>(&config, &ChildCommand::test("broker_chaos_child"))
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

/// The audit's explanation of the duplicate a consumer makes when it handles a first
/// delivery after the broker redelivered the message to another consumer, whose copy
/// was applied: not "delivered anew", which only a broker restart may cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_delivery_handled_after_its_redelivery_is_a_duplicate_handled_late() {
    let report = broker::nats::first_delivery_handled_after_its_redelivery()
        .await
        .unwrap_or_else(|error| panic!("the scenario could not run: {error}"));
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert!(
        report
            .duplicate_causes
            .iter()
            .any(|cause| cause.starts_with("1 handled late")),
        "{:?}",
        report.duplicate_causes
    );
}

/// The audit's sorting of duplicates by the broker's delivery counts: a higher count
/// than the applied delivery's is a redelivery, a lower one an earlier delivery handled
/// late, and the same count a delivery anew, which must follow the beginning of a broker
/// outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_sorts_duplicates_by_delivery_count_and_fails_a_delivery_anew_without_an_outage()
{
    let noted = [
        ("redelivered", 1, 1, true),
        ("redelivered", 1, 2, false),
        ("late", 2, 2, true),
        ("late", 2, 1, false),
        ("anew", 3, 1, true),
        ("anew", 3, 1, false),
    ];
    let causes = |report: &broker::BrokerReport| report.duplicate_causes.join("\n");

    let without_outage = broker::audit_of(&noted, &[]).await.unwrap();
    let all = causes(&without_outage);
    for cause in ["1 redelivered", "1 handled late", "1 delivered anew"] {
        assert!(all.contains(cause), "{cause}: {all}");
    }
    assert_eq!(
        without_outage.failures,
        ["1 messages delivered anew with no broker outage before them"]
    );

    // An outage that began after the first deliveries and before the delivery anew
    // explains it, though it ended after it was noted.
    let after_outage = broker::audit_of(&noted, &[5.5]).await.unwrap();
    assert!(
        after_outage.failures.is_empty(),
        "{:?}",
        after_outage.failures
    );
    assert!(
        causes(&after_outage).contains("1 after a SIGKILL restart began"),
        "{}",
        causes(&after_outage)
    );
}
