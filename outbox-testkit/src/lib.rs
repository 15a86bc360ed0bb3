//! The harness every test shares, one place per concept:
//!
//! - [`schema`]: a fresh PostgreSQL schema with the event tables migrated;
//! - [`database`]: a fresh database, for targets a schema cannot stand in for;
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
//!   credentials;
//! - [`tansu`]: a Kafka-protocol broker of the test's own;
//! - [`chaos`]: the chaos drivers (relay processes killed, paused and cut off; through
//!   a broker, consumers too);
//! - [`lab`]: the recovery lab's scenarios;
//! - [`app`]: the examples' own event types (`examples/common`), for the tests that check
//!   them.
//!
//! A dev-dependency of `outbox`: the tests and the test-driving examples (the recovery lab,
//! the chaos runs, the benchmark) `use outbox_testkit::...`. The `nats`, `rabbitmq` and
//! `kafka` features of `outbox` turn on this crate's, and with them a broker's chaos code.

#![allow(
    missing_docs,
    reason = "test support: documented where a reader needs it, not item by item"
)]
#![allow(
    clippy::missing_panics_doc,
    reason = "test support: a panic is how it fails the test that called it"
)]

// The examples keep their event types in their own module, as an application would; the
// tests check those very types (their golden migrations), so this crate compiles them too.
#[path = "../../examples/common/mod.rs"]
pub mod app;
pub mod broker;
pub mod chaos;
pub mod child;
pub mod cleanup;
pub mod counters;
pub mod database;
pub mod events;
pub mod lab;
pub mod logs;
pub mod nats_server;
pub mod otel;
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
pub async fn wait_until(what: &str, limit: Duration, done: impl AsyncFnMut() -> bool) {
    wait_until_explained(what, limit, done, async || String::new()).await;
}

/// [`wait_until`], failing with what `explain` says of where things stand (the rows
/// left, a log): what a test that stalls once in many runs needs to say why.
pub async fn wait_until_explained(
    what: &str,
    limit: Duration,
    mut done: impl AsyncFnMut() -> bool,
    explain: impl AsyncFnOnce() -> String,
) {
    let deadline = Instant::now() + limit;
    while !done().await {
        if Instant::now() >= deadline {
            let explained = explain().await;
            let separator = if explained.is_empty() { "" } else { "\n" };
            panic!("timed out after {limit:?} waiting until {what}{separator}{explained}");
        }
        sleep(Duration::from_millis(20)).await;
    }
}
