//! The seed of a chaos test: every random choice of the run derives from it, so that
//! `OUTBOX_CHAOS_SEED=<seed>` replays a run's schedule; without it, each run draws a
//! fresh seed and explores another schedule. A failure names the seed.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;

use super::TestResult;

/// The variable that replays a run.
pub const VARIABLE: &str = "OUTBOX_CHAOS_SEED";

/// `OUTBOX_CHAOS_SEED` when set (a run to replay), else a fresh random seed.
pub fn chaos_seed() -> u64 {
    match std::env::var(VARIABLE) {
        Ok(seed) => seed.trim().parse().unwrap_or_else(|_| {
            panic!("{VARIABLE}={seed} is not a seed (an unsigned 64-bit number)")
        }),
        Err(_) => fastrand::u64(..),
    }
}

/// Runs `scenario`, whose random choices all derive from `seed`. A failure, a panic or
/// an error, fails the test with a message that starts with the seed and how to replay
/// it.
pub async fn replayable<T>(seed: u64, scenario: impl Future<Output = TestResult<T>>) -> T {
    println!("chaos seed {seed} (replay with {VARIABLE}={seed})");
    let failure = match AssertUnwindSafe(scenario).catch_unwind().await {
        Ok(Ok(value)) => return value,
        Ok(Err(error)) => error.to_string(),
        Err(panic) => panic_message(&*panic),
    };
    panic!("chaos seed {seed} failed (replay with {VARIABLE}={seed}): {failure}");
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
