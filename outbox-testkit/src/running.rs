//! A relay running in the background for a test: started with [`start`], stopped with
//! [`Running::stop`], which waits for `run` to return and passes on its result.

use std::time::Duration;

use outbox::{CancellationToken, Relay, Sink};
use outbox::{Outbox, OutboxError};
use tokio::task::JoinHandle;
use tokio::time::timeout;

/// A relay running in the background.
pub struct Running {
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), OutboxError>>,
}

/// Runs `relay` on a task of its own until [`Running::stop`].
pub fn start<T: Outbox, S: Sink<T>>(relay: Relay<T, S>) -> Running {
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(relay.run(shutdown.clone()));
    Running { shutdown, handle }
}

impl Running {
    /// Whether `run` has not returned yet.
    pub fn is_running(&self) -> bool {
        !self.handle.is_finished()
    }

    /// Cancels the shutdown token without waiting: the relay stops claiming, and
    /// [`stop`](Self::stop) then waits for it to return.
    pub fn begin_stop(&self) {
        self.shutdown.cancel();
    }

    /// Cancels the shutdown token and waits for `run` to return, with what it returned.
    pub async fn stop(self) -> Result<(), OutboxError> {
        self.shutdown.cancel();
        timeout(Duration::from_secs(15), self.handle)
            .await
            .expect("the relay returns within 15 s of a shutdown")
            .expect("the relay did not panic")
    }
}
