//! Running a relay: the checks before it starts, then its workers and its listener,
//! until shutdown or a fatal error.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio::time::sleep;

use super::backoff::Backoff;
use super::frontier::Frontier;
use super::key_share::KeyShare;
use super::listen::listen;
use super::outage::Outage;
use super::wakeups::Wakeups;
use super::worker::Worker;
use super::{CancellationToken, Relay, Sink};
use crate::error::{OnTable as _, OutboxError};
use crate::spec::Outbox;

impl<T: Outbox, S: Sink<T>> Relay<T, S> {
    /// Publishes until `shutdown` is cancelled, then stops claiming, lets in-flight sends
    /// finish within the grace period, records their outcomes, and hands unsent rows
    /// back ([`shutdown_grace`](Self::shutdown_grace)).
    ///
    /// Transient database failures (a lost or refused connection, a server restart, a
    /// deadlock: [`OutboxError::is_transient`]) are logged and retried with backoff, and
    /// sink failures are recorded per event. Any other error returns at once, after the
    /// other workers stopped: a missing table or column, a drifted table, a missing
    /// privilege, credentials or a database the server refuses. Nothing is lost then:
    /// the events claimed and not recorded are claimed again once their leases end.
    ///
    /// A sink that panics does not stop the relay: see [`Sink`].
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), OutboxError> {
        let Some(ascii_reasons) = starting_checks::<T>(&self.pool, &shutdown).await? else {
            return Ok(());
        };
        let mut relay = self;
        relay.ascii_reasons = ascii_reasons;
        let relay = Arc::new(relay);
        let connections = relay.pool.options().get_max_connections() as usize;
        if connections <= relay.concurrency {
            tracing::warn!(
                table = T::SPEC.table,
                connections,
                workers = relay.concurrency,
                "the relay's pool has fewer connections than workers + 1 (the LISTEN session keeps one); workers will wait on each other"
            );
        }
        let stop = shutdown.child_token();
        let wakeups = Arc::new(Wakeups::default());
        let frontier = Arc::new(if T::SPEC.key().is_some() {
            Frontier::keyed()
        } else {
            Frontier::new()
        });
        let outage = Arc::new(Outage::new(T::SPEC.table, Arc::clone(&relay.labels)));
        let listener = tokio::spawn(listen::<T>(
            relay.pool.clone(),
            Arc::clone(&wakeups),
            stop.clone(),
        ));

        let key_share = Arc::new(KeyShare::new(relay.concurrency));
        let mut workers = JoinSet::new();
        for index in 0..relay.concurrency {
            let worker = Worker {
                index,
                key_share: Arc::clone(&key_share),
                // Until a send says otherwise: keeping keys is how a relay without
                // sharing behaves.
                keeps_keys: AtomicBool::new(true),
                relay: Arc::clone(&relay),
                wakeups: Arc::clone(&wakeups),
                frontier: Arc::clone(&frontier),
                outage: Arc::clone(&outage),
                stop: stop.clone(),
            };
            workers.spawn(worker.run());
        }
        let mut outcome = Ok(());
        let mut panic = None;
        while let Some(joined) = workers.join_next().await {
            match joined {
                Ok(Err(error)) => {
                    tracing::error!(table = T::SPEC.table, %error, "relay cannot go on; stopping");
                    stop.cancel();
                    outcome = outcome.and(Err(error));
                }
                // The other workers stop as on shutdown, recording what they sent,
                // before the panic goes on.
                Err(panicked) if panicked.is_panic() => {
                    stop.cancel();
                    panic.get_or_insert(panicked.into_panic());
                }
                Ok(Ok(())) | Err(_) => {}
            }
        }
        stop.cancel();
        let _ = listener.await;
        if let Some(panic) = panic {
            std::panic::resume_unwind(panic);
        }
        outcome
    }
}

/// What the relay checks of its database before its workers start, waiting for a
/// database that does not answer yet (`None` if `shutdown` comes first):
///
/// - a table a newer build keyed, when this build's type has no key (a rollback, an
///   old replica restarting), is [`OutboxError::Drift`]: its claims would publish a
///   key's events out of order;
/// - whether reasons must be stored in ASCII (the `Some`): a broker's error text can
///   hold any character, and one the database's encoding lacks (LATIN1 has no `☃`)
///   fails the statement recording the outcome (22P05), for good. UTF-8 and SQL_ASCII
///   store anything.
async fn starting_checks<T: Outbox>(
    pool: &PgPool,
    shutdown: &CancellationToken,
) -> Result<Option<bool>, OutboxError> {
    let table = T::SPEC.table;
    let read = async || {
        if let Some(key) = crate::schema::verify::key_unknown_to_build(pool, T::SPEC).await? {
            return Err(OutboxError::Drift {
                table,
                details: format!(
                    "a newer build orders it by the key `{key}`, which this build's event type \
                     does not have: its relay would publish a key's events out of order; \
                     run the relay of a build with the key"
                ),
            });
        }
        sqlx::query_scalar::<_, String>("SELECT current_setting('server_encoding')")
            .fetch_one(pool)
            .await
            .on_table(table)
    };
    for attempt in 1.. {
        match read().await {
            Ok(encoding) => {
                let ascii = !matches!(encoding.as_str(), "UTF8" | "SQL_ASCII");
                if ascii {
                    tracing::info!(table, %encoding, "the database is not UTF-8: reasons are stored with non-ASCII characters escaped");
                }
                return Ok(Some(ascii));
            }
            Err(error) if error.is_transient() => {
                if attempt == 1 {
                    tracing::warn!(table, %error, "the relay waits for its database to answer before it starts");
                }
                tokio::select! {
                    () = sleep(Backoff::STARTUP.delay(attempt)) => {}
                    () = shutdown.cancelled() => return Ok(None),
                }
            }
            Err(error) => return Err(error),
        }
    }
    unreachable!("the attempts never end")
}
