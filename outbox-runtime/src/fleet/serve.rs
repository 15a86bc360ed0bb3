//! Serving one target: its own small pool, and a relay that claims only while the
//! member's lease on the target lasts, started again after a failure that stops it.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

use super::{Fleet, Target};
use crate::error::OnTable as _;
use crate::relay::Backoff;
use crate::relay::tenure::Tenure;
use crate::sink::Sink;
use crate::spec::Outbox;

/// How long a target's pool keeps a connection nobody uses. A relay polling more often
/// ([`POLL`] by default) keeps its worker's connection, beside its `LISTEN` session.
const IDLE_CONNECTION: Duration = Duration::from_secs(30);

/// How often a fleet's relay polls when no notification comes (a relay's own default
/// is 5 s): with hundreds of targets the polls are most of the fleet's idle cost (200
/// quiet databases: 1.5% of a core at 5 s, 0.2% at 20 s), and what they catch can wait
/// longer, as each relay wakes for its own retries when due and its `LISTEN` session for
/// new events.
const POLL: Duration = Duration::from_secs(20);

/// How many leases apart a member looks at each of its targets' oldest due event (a
/// minute at the default lease): a statement to the target and one to the home each
/// time, about a third of the polls' cost.
const OBSERVE_LEASES: u32 = 4;

/// A target this member serves: its lease's end by this process's clock, and the task
/// running its relay. Dropped without [`stop`](Self::stop) (the fleet's `run` future
/// dropped), the task is aborted: as if the process died, the target's claims wait for
/// their leases.
pub(super) struct Served {
    pub(super) generation: i64,
    pub(super) tenure: Arc<Tenure>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl Served {
    /// Starts serving `target` until `tenure` ends or [`stop`](Self::stop).
    pub(super) fn start<T, S>(
        fleet: &Arc<Fleet<T, S>>,
        target: &Target,
        generation: i64,
        tenure: Arc<Tenure>,
    ) -> Self
    where
        T: Outbox,
        S: Sink<T>,
    {
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(
            Arc::clone(fleet),
            target.clone(),
            generation,
            Arc::clone(&tenure),
            stop.clone(),
        ));
        Self {
            generation,
            tenure,
            stop,
            task: Some(task),
        }
    }

    /// Whether its relay stopped (its lease ran out by this process's clock).
    pub(super) fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Stops claiming at once, and waits for the relay to record what it had in flight
    /// and hand the rest back (within its shutdown grace).
    pub(super) async fn stop(mut self) {
        self.tenure.end();
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return;
        };
        if let Err(error) = task.await
            && error.is_panic()
        {
            std::panic::resume_unwind(error.into_panic());
        }
    }
}

async fn serve<T, S>(
    fleet: Arc<Fleet<T, S>>,
    target: Target,
    generation: i64,
    tenure: Arc<Tenure>,
    stop: CancellationToken,
) where
    T: Outbox,
    S: Sink<T>,
{
    let name = target.name();
    let pool = PgPoolOptions::new()
        .max_connections(fleet.connections_per_target)
        .min_connections(0)
        .idle_timeout(IDLE_CONNECTION)
        .connect_lazy_with(target.options.clone());
    tracing::info!(fleet = %fleet.name, target = name, "serving");
    let mut failures = 0;
    while !stop.is_cancelled() && tenure.is_live() {
        let relay =
            crate::relay::Relay::new(pool.clone(), (fleet.sink)(&target)).poll_interval(POLL);
        let relay = (fleet.relay)(relay)
            .within(Arc::clone(&tenure))
            .for_target(name);
        let run = relay.run(stop.child_token());
        tokio::pin!(run);
        let result = tokio::select! {
            result = &mut run => result,
            () = observe(&fleet, &pool, name, generation) => unreachable!("it observes until dropped"),
            () = tenure.ended() => {
                // The relay's workers stopped claiming already; it records what it
                // had in flight and hands the rest back.
                stop.cancel();
                run.await
            }
        };
        match result {
            Ok(()) => {}
            Err(error) => {
                failures += 1;
                let delay = Backoff::FLEET_RESTART.delay(failures);
                tracing::error!(fleet = %fleet.name, target = name, %error, ?delay, "the target's relay stopped; restarting it");
                tokio::select! {
                    () = sleep(delay) => {}
                    () = stop.cancelled() => {}
                }
            }
        }
    }
    pool.close().await;
    tracing::info!(fleet = %fleet.name, target = name, "no longer serving");
}

/// Every [`OBSERVE_LEASES`] leases, records in the home since when the target's oldest
/// due event has waited: one probe of its `READY` index. Failures are logged, nothing
/// more: the relay is what matters.
async fn observe<T: Outbox, S: Sink<T>>(
    fleet: &Fleet<T, S>,
    pool: &sqlx::PgPool,
    target: &str,
    generation: i64,
) {
    let probe = format!(
        "SELECT min(next_attempt_at) FROM {} WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()",
        T::SPEC.table
    );
    let taken = super::leases::Taken {
        target: target.to_owned(),
        generation,
    };
    loop {
        sleep(fleet.lease * OBSERVE_LEASES).await;
        let seen = sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            sqlx::AssertSqlSafe(probe.as_str()),
        )
        .fetch_one(pool)
        .await;
        let recorded = match seen.on_table(T::SPEC.table) {
            Ok(oldest) => fleet.leases().observed(&taken, oldest).await,
            Err(error) => Err(error),
        };
        if let Err(error) = recorded {
            tracing::debug!(fleet = %fleet.name, target, %error, "cannot observe the target");
        }
    }
}
