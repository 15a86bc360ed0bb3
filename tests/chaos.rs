//! The relay under chaos, in a short form for CI (about 2,000 events): four relay
//! processes publish while the test SIGKILLs and restarts them, SIGSTOPs them past
//! their lease, terminates their database sessions and restarts PostgreSQL once. Every
//! event must end `SENT` exactly once, delivered at least once, recorded by the
//! generation that held it. `cargo run --release --example chaos` is the long form.
//!
//! Every random choice comes from one seed, printed with the result and in a failure's
//! message: `OUTBOX_CHAOS_SEED=<seed>` replays that schedule; without it each run draws a
//! fresh seed.

// `mod chaos;` alone would find this file as well as the driver.

use outbox_testkit::chaos;
use outbox_testkit::child::ChildCommand;
use outbox_testkit::seed::{chaos_seed, replayable};

/// A relay process: re-executed by the test with the chaos environment set, it runs a
/// relay until SIGTERM. A no-op in a normal test run.
#[test]
fn chaos_child() {
    chaos::child_main_if_requested();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_deliver_every_event_through_kills_pauses_terminations_and_a_restart() {
    let events = std::env::var("OUTBOX_CHAOS_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000);
    let mut config = chaos::Config::new(events);
    config.verbose = std::env::var_os("OUTBOX_CHAOS_VERBOSE").is_some();
    config.seed = chaos_seed();
    replayable(config.seed, async {
        let report = chaos::run(&config, &ChildCommand::test("chaos_child"))
            .await
            .map_err(|error| format!("the chaos run could not run: {error}"))?;
        println!("{report}");
        assert!(report.failures.is_empty(), "{report}");
        Ok(())
    })
    .await;
}
