//! Prints the recovery matrix of "Kill the Outbox Worker: Recovering PostgreSQL Claims
//! with Leases and Generations": six scenarios, the leased protocol against the unsafe
//! baseline, each on real PostgreSQL (`DATABASE_URL`, or a throwaway cluster).
//!
//! ```text
//! cargo run --example recovery_lab
//! ```

use outbox_testkit::child::ChildCommand;
use outbox_testkit::lab;

fn main() -> std::process::ExitCode {
    // Scenario 1 re-executes this binary as the publisher it kills.
    lab::child_main_if_requested();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let rows = runtime.block_on(lab::matrix(&ChildCommand::binary()));
    print!("{}", lab::render(&rows));
    // Any other matrix is a failure (CI runs this example), a database that cannot be
    // reached among them.
    match lab::verdict(&rows) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(differs) => {
            eprintln!("error: {differs}");
            std::process::ExitCode::FAILURE
        }
    }
}
