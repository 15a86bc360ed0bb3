//! A relay fleet under chaos, in a short form for CI: three member processes share six
//! targets while the test SIGKILLs and restarts them, SIGSTOPs them past their lease
//! and terminates their sessions. Every event must end `SENT` and delivered, and every
//! delivery must come from a claim its member made while the target was its own.
//!
//! `OUTBOX_CHAOS_SEED=<seed>` replays a schedule; without it each run draws a fresh seed.

use outbox_testkit::chaos::fleet;
use outbox_testkit::child::ChildCommand;
use outbox_testkit::seed::{chaos_seed, replayable};

/// A member process: re-executed by the test, it runs a fleet member until SIGTERM. A
/// no-op in a normal test run.
#[test]
fn fleet_member_child() {
    fleet::member_main_if_requested();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_serves_each_target_from_one_member_at_a_time_through_kills_and_pauses() {
    let config = fleet::Config::new(chaos_seed());
    replayable(config.seed, async {
        let report = fleet::run(&config, &ChildCommand::test("fleet_member_child"))
            .await
            .map_err(|error| format!("the fleet chaos could not run: {error}"))?;
        println!("{report}");
        assert!(report.failures.is_empty(), "{report}");
        Ok(())
    })
    .await;
}
