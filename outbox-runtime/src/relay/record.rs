//! The relay's batch transaction: the outcomes of the batch before recorded, and the
//! next batch claimed, with one commit.

use std::collections::HashSet;

use sqlx::{Connection as _, PgConnection};

use crate::error::{OnTable as _, OutboxError};
use crate::spec::Outbox;
use crate::table::batch::{Recorded, record};
use crate::table::claiming::{ClaimedBatch, Runs, Scope, begin_limited, claim_on};
use crate::table::row::{Outcome, Owned};

/// Records `outcomes`, then claims up to `limit` more rows in `scope`, with `runs` of a
/// key (continuing the runs the worker has in flight): one transaction, one commit per
/// batch. Returns the claimed batch, and what recording did. Rows whose payload does
/// not decode are moved to `DEAD` and not returned as claims.
///
/// The order is what keeps workers from deadlocking. A claim skipping rows that another
/// worker claimed after the claim's snapshot still locks them (PostgreSQL locks the
/// newest row version before rechecking it) until it commits, so recording can wait for
/// another worker's claim. Recording first, while this transaction holds no such lock,
/// and claiming last, which never waits, leaves no cycle; the claim's snapshot is also
/// fresh, so it locks few such rows.
pub(crate) async fn record_and_claim<T: Outbox>(
    conn: &mut PgConnection,
    outcomes: &[(Owned, Outcome)],
    scope: Scope,
    limit: u32,
    runs: Runs<'_>,
) -> Result<(ClaimedBatch<T>, Recorded), OutboxError> {
    let table = T::SPEC.table;
    let no_outcomes = || Recorded::Sent(HashSet::new());
    if limit == 0 {
        let recorded = if outcomes.is_empty() {
            no_outcomes()
        } else {
            record::<T>(conn, outcomes).await?
        };
        return Ok((ClaimedBatch::default(), recorded));
    }
    let begin = match scope {
        _ if T::SPEC.key().is_some() => GENERIC_PLANS_WITHOUT_JIT,
        Scope::All => BEGIN,
        Scope::ReadyFrom(_) => GENERIC_PLANS,
    };
    let mut tx = conn
        .begin_with(begin_limited::<T>(begin))
        .await
        .on_table(table)?;
    let recorded = if outcomes.is_empty() {
        no_outcomes()
    } else {
        record::<T>(&mut *tx, outcomes).await?
    };
    // Undecodable rows were moved to DEAD and logged: nothing to publish.
    let claimed = claim_on::<T>(&mut tx, scope, limit, runs).await?;
    tx.commit().await.on_table(table)?;
    Ok((claimed, recorded))
}

/// Begins a batch's transaction. READ COMMITTED whatever the server's default: the
/// claim relies on each statement's fresh snapshot and on PostgreSQL rechecking a row
/// that changed since; under a `default_transaction_isolation` of `repeatable read`,
/// a claim that meets a row another worker just claimed fails (40001) instead of
/// skipping it, and the outcomes recorded before it roll back with it.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Begins a transaction whose statements use their generic plans. The claim from a
/// position binds that position, and PostgreSQL would plan it again on every execution
/// (its estimate for a position near the end of the index always looks cheaper than
/// the generic plan's, which is the same plan): 0.15 ms of planning per 1.8 ms claim,
/// measured. `LOCAL`, so the setting ends with the transaction and never reaches the
/// pool's other users; one round trip, as a plain `BEGIN`.
const GENERIC_PLANS: &str =
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL plan_cache_mode = force_generic_plan";

/// [`GENERIC_PLANS`] and [`BEGIN_WITHOUT_JIT`], for a claim on a table with an ordering
/// key: it binds the runs in flight (and the claim from a position its position), and
/// its generic plan is the plan a claim without parameters would have.
///
/// [`BEGIN_WITHOUT_JIT`]: crate::table::claiming::BEGIN_WITHOUT_JIT
const GENERIC_PLANS_WITHOUT_JIT: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; \
     SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL jit = off";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::spec::interval;

    #[test]
    fn retry_delays_are_truncated_to_what_an_interval_holds() {
        assert_eq!(
            interval(Duration::new(1, 123_456_789)),
            Duration::new(1, 123_456_000)
        );
        assert_eq!(interval(Duration::ZERO), Duration::ZERO);
        let jittered =
            crate::relay::Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for attempt in 1..20 {
            assert_eq!(interval(jittered.delay(attempt)).subsec_nanos() % 1_000, 0);
        }
    }
}
