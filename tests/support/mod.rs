//! The harness every test shares, one place per concept:
//!
//! - [`schema`]: a fresh PostgreSQL schema with the event tables migrated;
//! - [`rows`]: outbox rows enqueued, read back, and moved by fixtures;
//! - [`wait_until`]: polling for a condition, with a deadline;
//! - [`child`]: re-running the current executable as a child process to kill;
//! - [`events`]: the event types the tests define (the examples' own are in
//!   `examples/common`);
//! - [`counters`]: a `metrics` recorder that counts;
//! - [`logs`]: the relay's log lines, captured;
//! - [`running`]: a relay running in the background, and its stop;
//! - [`seed`]: a chaos test's seed, from `OUTBOX_CHAOS_SEED` or fresh, named by its
//!   failures;
//! - [`role`]: a login role of the test's own, dropped whatever the test did;
//! - [`cleanup`]: what a test created on a shared broker, deleted whatever the test did;
//! - [`broker`]: what the broker sinks' tests share (a consumer's effect, an outage);
//! - [`proxy`]: a TCP proxy between clients and a server, to cut or to silence;
//! - [`nats_server`]: a NATS server of the test's own, to restart or to start with
//!   credentials.
//! - [`tansu`]: a Kafka-protocol broker of the test's own (the benchmark includes it too).
//!
//! A test file includes it with `mod support;`; an example that runs a test driver (the
//! recovery lab, the chaos run) with `#[path = "../tests/support/mod.rs"] mod support;`.
//! `tests/golden.rs` includes only [`events`].

#![allow(dead_code, unreachable_pub)]

pub mod broker;
pub mod child;
pub mod cleanup;
pub mod counters;
pub mod events;
pub mod logs;
pub mod nats_server;
pub mod proxy;
pub mod role;
pub mod rows;
pub mod running;
pub mod schema;
pub mod seed;
pub mod tansu;

use std::time::Duration;

use tokio::time::{Instant, sleep};

/// What a test returns: `?` on any error fails it with the error's message.
pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Polls `done` every 20 ms until it holds; fails the test after `limit`.
pub async fn wait_until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}"
        );
        sleep(Duration::from_millis(20)).await;
    }
}
