//! The article's six recovery scenarios against real PostgreSQL, one test each for the
//! leased protocol, plus the matrix that shows the unsafe baseline failing four.

use outbox_testkit::child::ChildCommand;
use outbox_testkit::lab::{self, Protocol};

/// Scenario 1's child publisher: re-executed by the parent with the lab's environment
/// set, it claims one event and waits for SIGKILL. A no-op in a normal test run.
#[test]
fn lab_child() {
    lab::child_main_if_requested();
}

fn child() -> ChildCommand {
    ChildCommand::test("lab_child")
}

async fn leased(number: u8) {
    if let Err(reason) = lab::run(number, Protocol::Leased, &child()).await {
        panic!("scenario {number} failed: {reason}");
    }
}

#[tokio::test]
async fn a_claim_killed_after_commit_is_reclaimed_with_the_next_generation() {
    leased(1).await;
}

#[tokio::test]
async fn an_open_claim_transaction_is_skipped_and_its_rollback_frees_the_row() {
    leased(2).await;
}

#[tokio::test]
async fn a_stale_owners_complete_is_rejected_under_a_newer_generation() {
    leased(3).await;
}

#[tokio::test]
async fn a_stale_owners_retry_is_rejected_under_a_newer_generation() {
    leased(4).await;
}

#[tokio::test]
async fn retry_cannot_move_a_sent_row_back_to_ready() {
    leased(5).await;
}

#[tokio::test]
async fn an_expired_owner_cannot_finalize_and_the_happy_path_completes() {
    leased(6).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_baseline_fails_the_four_scenarios_the_seed_reports() {
    let rows = lab::matrix(&child()).await;
    if let Err(differs) = lab::verdict(&rows) {
        panic!("{differs}\n{}", lab::render(&rows));
    }
}

#[test]
fn a_baseline_failing_for_another_reason_than_the_scenarios_is_not_the_articles_matrix() {
    let rows: Vec<_> = lab::SCENARIOS
        .iter()
        .map(|scenario| {
            let baseline = lab::BASELINE_FAILS
                .iter()
                .find(|(number, _)| *number == scenario.number)
                .map_or(Ok(()), |(_, reason)| Err(format!("check: {reason}")));
            (scenario, Ok(()), baseline)
        })
        .collect();
    assert_eq!(lab::verdict(&rows), Ok(()));
    // Scenario 1's baseline broke (the database went away) instead of stranding the
    // event: the same cell says FAIL, and it shows nothing.
    let mut broken = rows.clone();
    broken[0].2 = Err("error communicating with database: connection refused".to_owned());
    let verdict = lab::verdict(&broken).unwrap_err();
    assert!(
        verdict.contains("other reasons than the scenario's"),
        "{verdict}"
    );
}
