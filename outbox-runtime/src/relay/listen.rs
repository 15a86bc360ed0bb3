//! The relay's `LISTEN` session: notifications from `enqueue` wake idle workers.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::wakeups::Wakeups;
use crate::spec::Outbox;

/// LISTENs on the table's channel and wakes idle workers. A lost connection costs
/// latency only: workers also poll.
pub(crate) async fn listen<T: Outbox>(
    pool: PgPool,
    wakeups: Arc<Wakeups>,
    stop: CancellationToken,
) {
    let channel = T::SPEC.table;
    let mut failures = 0;
    loop {
        let started = Instant::now();
        let error = tokio::select! {
            () = stop.cancelled() => return,
            error = listen_session(&pool, channel, &wakeups) => error,
        };
        // A session that lasted was a success: start the backoff over.
        failures = if started.elapsed() > Duration::from_mins(1) {
            1
        } else {
            failures + 1
        };
        tracing::warn!(table = channel, %error, "relay listener lost its connection; reconnecting");
        tokio::select! {
            () = stop.cancelled() => return,
            () = sleep(Backoff::LISTEN.delay(failures)) => {}
        }
    }
}

/// One listening session; returns only when its connection fails.
async fn listen_session(pool: &PgPool, channel: &str, wakeups: &Wakeups) -> sqlx::Error {
    let mut listener = match PgListener::connect_with(pool).await {
        Ok(listener) => listener,
        Err(error) => return error,
    };
    if let Err(error) = listener.listen(channel).await {
        return error;
    }
    // Anything enqueued while we were not listening is found by this wake-up.
    wakeups.notified();
    let receiving = async {
        loop {
            match listener.try_recv().await {
                Err(error) => return error,
                // `None`: the connection dropped and the next call reconnects; what was
                // enqueued meanwhile sent its notification to nobody, so wake up anyway.
                Ok(_) => wakeups.notified(),
            }
        }
    };
    tokio::select! {
        error = receiving => error,
        never = wakeups.watch_deferred() => match never {},
    }
}
