//! Claiming rows: the claim statements, in a transaction or not, and what they claimed.

use std::time::Duration;

use sqlx::{Acquire, Connection as _, PgConnection, Postgres, Row};
use tokio::time::Instant;

use super::batch;
use super::claim::{self, Claim, Claimed, dead_letter, decode_claim};
use super::key_order::{self, BrokenRuns};
use super::row::{Outcome, Owned};
use super::statements;
use crate::error::{OnTable as _, OutboxError};
use crate::interval;
use crate::spec::Outbox;
use outbox_internals::claim_header as header;

/// Where a claim looks for due rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Everywhere: expired claims first, then due `READY` rows ([`Statement::Claim`]).
    ///
    /// [`Statement::Claim`]: outbox_internals::Statement::Claim
    All,
    /// Due `READY` rows from this `next_attempt_at` on, in microseconds since the Unix
    /// epoch ([`Statement::ClaimFrom`]).
    ///
    /// [`Statement::ClaimFrom`]: outbox_internals::Statement::ClaimFrom
    ReadyFrom(i64),
}

/// Whether a claim on a keyed table takes runs of a key (its first event still to go,
/// and the events after it, in the batch's room), which only a publisher that sends a
/// key's events in order may take: the relay's claims, not [`claim_batch`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Runs<'a> {
    /// One event per key.
    No,
    /// Runs of up to `length` events of a key (at least 1), and after each of the
    /// `tails` (the last event of each run the claimer has in flight, still its own),
    /// the next event of its key as a head: the claimer sends it after that run, and
    /// only if the run went whole.
    After { tails: &'a [Owned], length: u32 },
}

impl Runs<'_> {
    /// Whether the claim takes runs.
    pub(crate) fn taken(self) -> bool {
        matches!(self, Self::After { .. })
    }

    /// Whether a key's run in `claims` is as long as a run may be: more of that key
    /// may be due, however few rows the claim took.
    fn at_length<T: Outbox>(self, claims: &[Claim<T>]) -> bool {
        let Self::After { length, .. } = self else {
            return false;
        };
        key_order::longest_run(claims) >= usize::try_from(length).unwrap_or(usize::MAX)
    }
}

/// What a claim statement claimed.
pub(crate) struct ClaimedBatch<T: Outbox> {
    /// The claims, in id order.
    pub(crate) claims: Vec<Claim<T>>,
    /// The rows whose payload does not decode, moved to `DEAD`.
    pub(crate) undecodable: Vec<OutboxError>,
    /// How far into the `READY` index the claim saw every due row it could, in
    /// microseconds since the Unix epoch: the latest `next_attempt_at` among the `READY`
    /// rows claimed, or on a keyed table the statement's own reach (its scan steps over
    /// events held back by their key, and may find fewer rows than it looked for).
    pub(crate) reached: Option<i64>,
    /// Whether the claim found all it looked for (the rows that do not decode count),
    /// or a run as long as a run may be: more may be due.
    pub(crate) full: bool,
    /// How long its claim statements took.
    pub(crate) took: Duration,
}

impl<T: Outbox> Default for ClaimedBatch<T> {
    fn default() -> Self {
        Self {
            claims: Vec::new(),
            undecodable: Vec::new(),
            reached: None,
            full: false,
            took: Duration::ZERO,
        }
    }
}

/// Claims up to `limit` rows and decodes them. Rows whose payload cannot be decoded
/// are moved to `DEAD` (guarded by their generation) with the error in `last_error`.
/// Rows the statement moved to `DEAD` (a spent budget) are claimed again in their
/// place, so a caller only gets fewer rows than `limit` when fewer are due.
async fn claim_rows<'a, T: Outbox>(
    conn: impl Acquire<'a, Database = Postgres>,
    limit: u32,
) -> Result<ClaimedBatch<T>, OutboxError> {
    let table = T::SPEC.table;
    let mut conn = conn.acquire().await.on_table(table)?;
    if T::SPEC.key().is_none() {
        if conn.is_in_transaction() {
            return claim_on(&mut conn, Scope::All, limit, Runs::No).await;
        }
        // Each claim statement commits on its own: rows claimed before a later step
        // fails (another claim statement, a decode, a move to DEAD) would wait out their
        // lease with an attempt spent. (A transaction around the claim would cost every
        // claim two more round trips.)
        let mut claimed = Vec::new();
        return match claim_noting::<T>(&mut conn, Scope::All, limit, Runs::No, Some(&mut claimed))
            .await
        {
            Ok(batch) => Ok(batch),
            Err(error) => {
                hand_back::<T>(&mut conn, &claimed, &error).await;
                Err(error)
            }
        };
    }
    if conn.is_in_transaction() {
        // The caller's transaction: JIT stays off until it ends.
        sqlx::raw_sql("SET LOCAL jit = off")
            .execute(&mut *conn)
            .await
            .on_table(table)?;
        return claim_on(&mut conn, Scope::All, limit, Runs::No).await;
    }
    let mut tx = conn
        .begin_with(begin_limited::<T>(BEGIN_WITHOUT_JIT))
        .await
        .on_table(table)?;
    let claimed = claim_on(&mut tx, Scope::All, limit, Runs::No).await?;
    tx.commit().await.on_table(table)?;
    Ok(claimed)
}

/// Begins the transaction of a claim on a table with an ordering key, with PostgreSQL's
/// JIT compilation off. Its planner cannot know how few rows the claim sets aside
/// (`parked`), so on a large table the claim's estimated cost passes `jit_above_cost`
/// and every execution would be compiled first: measured, 600 ms per claim that ran in
/// 2 ms without. `LOCAL`: the setting ends with the transaction; one round trip, as a
/// plain `BEGIN`. READ COMMITTED whatever the server's default, as claims need (the
/// relay's `BEGIN` says why; a claim in the caller's own transaction, or of a table
/// without a key outside one, runs at the caller's or the server's level).
pub(crate) const BEGIN_WITHOUT_JIT: &str =
    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL jit = off";

/// `begin` (a transaction that claims), with the server told to end the session if
/// the transaction sits idle for longer than [`transaction_limit`]. A process paused
/// inside it (SIGSTOP, a frozen VM) would otherwise keep the rows it claimed locked,
/// uncommitted, for as long as the pause lasts: every other claim skips a locked row
/// (`SKIP LOCKED`) however long ago its lease ended, and on a keyed table its key's
/// later events wait too. Ended by the server, the claim never happened. Still one
/// round trip.
pub(crate) fn begin_limited<T: Outbox>(begin: &str) -> sqlx::AssertSqlSafe<String> {
    let limit = transaction_limit(T::SPEC.lease);
    sqlx::AssertSqlSafe(format!(
        "{begin}; SET LOCAL idle_in_transaction_session_timeout = {}",
        interval::setting_millis(limit)
    ))
}

/// How long a transaction that claims may take: the lease (past it, neither the
/// outcomes nor the claim hold), at least 10 s, so that a merely slow database is
/// waited for. The relay gives up on a connection whose transaction takes longer (a
/// server gone silent, a failover that left it half-open, would otherwise hold the
/// worker, its renewals and its shutdown until the kernel gives up on it: a quarter of
/// an hour on Linux); the server ends a session left idle in it for longer.
pub(crate) fn transaction_limit(lease: Duration) -> Duration {
    lease.max(Duration::from_secs(10))
}

/// Hands back `claimed`, rows a claim outside a transaction committed before it failed
/// with `error`: `READY`, due now, the attempt not counted, each guarded by its
/// generation. If that fails too (the connection is gone), they are claimed again once
/// their leases end.
async fn hand_back<T: Outbox>(conn: &mut PgConnection, claimed: &[Owned], error: &OutboxError) {
    if claimed.is_empty() {
        return;
    }
    let table = T::SPEC.table;
    let release: Vec<(Owned, Outcome)> =
        claimed.iter().map(|row| (*row, Outcome::Release)).collect();
    match batch::record::<T>(conn, &release).await {
        Ok(_) => tracing::info!(table, rows = claimed.len(), %error,
            "a claim failed after it claimed rows; handed them back"),
        Err(unreleased) => tracing::warn!(table, rows = claimed.len(), %error, %unreleased,
            "a claim failed after it claimed rows, which could not be handed back; they are claimed again once their leases end"),
    }
}

/// [`claim_rows`] in `scope`, on a connection (or in a transaction) the caller holds,
/// with or without [`Runs`]. (A claim from a position, the relay's, always takes runs.)
pub(crate) async fn claim_on<T: Outbox>(
    conn: &mut PgConnection,
    scope: Scope,
    limit: u32,
    runs: Runs<'_>,
) -> Result<ClaimedBatch<T>, OutboxError> {
    claim_noting(conn, scope, limit, runs, None).await
}

/// [`claim_on`], noting in `claimed`, if given, each row its statements claim as soon as
/// they return it, for [`hand_back`] (a claim in a transaction has no use for it).
async fn claim_noting<T: Outbox>(
    conn: &mut PgConnection,
    scope: Scope,
    limit: u32,
    runs: Runs<'_>,
    mut claimed: Option<&mut Vec<Owned>>,
) -> Result<ClaimedBatch<T>, OutboxError> {
    let mut claims = Vec::new();
    let mut undecodable = Vec::new();
    let mut reached = None;
    let mut took = Duration::ZERO;
    loop {
        // Undecodable rows were claimed too: they count against the limit.
        let found = claims.len() + undecodable.len();
        let wanted = limit.saturating_sub(u32::try_from(found).unwrap_or(u32::MAX));
        let sent = Instant::now();
        let rows = match scope {
            Scope::All => statements::claim::<T>(&mut *conn, wanted, runs).await?,
            Scope::ReadyFrom(from) => {
                statements::claim_from::<T>(&mut *conn, from, wanted, runs).await?
            }
        };
        took += sent.elapsed();
        if let Some(claimed) = claimed.as_deref_mut() {
            claimed.extend(rows.iter().filter_map(|row| {
                Some(Owned {
                    id: row.try_get(header::ID).ok()?,
                    generation: row.try_get(header::GENERATION).ok()?,
                })
            }));
        }
        let mut exhausted = false;
        if T::SPEC.key().is_some()
            && runs.taken()
            && let Some(row) = rows.first()
        {
            reached = reached.max(claim::reach(row).on_table(T::SPEC.table)?);
        }
        for row in &rows {
            let (claimed, due) = decode_claim(row, sent).on_table(T::SPEC.table)?;
            match claimed {
                Claimed::Claim(claim) => claims.push(claim),
                Claimed::Undecodable(bad) => undecodable.push(bad),
                Claimed::Exhausted => exhausted = true,
            }
            if T::SPEC.key().is_none() {
                reached = reached.max(due);
            }
        }
        if !exhausted || wanted == 0 {
            break;
        }
    }
    let found = claims.len() + undecodable.len();
    let full = limit > 0
        && (found >= usize::try_from(limit).unwrap_or(usize::MAX) || runs.at_length(&claims));
    // UPDATE .. RETURNING does not promise an order; publish in id order.
    claims.sort_unstable_by_key(Claim::id);
    // A run goes on only past events that go: what follows an undecodable event of its
    // key (now `DEAD`) is handed back, to wait behind it as its key's rule says.
    let mut behind = Vec::new();
    if runs.taken() && !undecodable.is_empty() {
        let mut bad: Vec<(i64, Option<&str>)> = undecodable
            .iter()
            .map(|bad| (bad.id(), bad.key()))
            .collect();
        bad.sort_unstable_by_key(|(id, _)| *id);
        let mut bad = bad.into_iter().peekable();
        let mut broken = BrokenRuns::default();
        claims.retain(|claim| {
            while let Some((_, key)) = bad.next_if(|(id, _)| *id < claim.id()) {
                broken.break_at(key);
            }
            let goes = broken.lets_go(claim.key());
            if !goes {
                behind.push((Owned::of(claim), Outcome::Release));
            }
            goes
        });
    }
    let mut errors = Vec::with_capacity(undecodable.len());
    for bad in undecodable {
        errors.push(dead_letter::<T>(conn, bad).await?);
    }
    if !behind.is_empty() {
        batch::record::<T>(conn, &behind).await?;
    }
    Ok(ClaimedBatch {
        claims,
        undecodable: errors,
        reached,
        full,
        took,
    })
}

/// Claims the next due event, if any. See [`claim_batch`].
///
/// Returns [`OutboxError::Decode`] when the claimed row's payload does not decode
/// (the row has been moved to `DEAD`).
pub async fn claim<'a, T: Outbox>(
    conn: impl Acquire<'a, Database = Postgres>,
) -> Result<Option<Claim<T>>, OutboxError> {
    let mut batch = claim_rows::<T>(conn, 1).await?;
    match batch.undecodable.pop() {
        Some(error) => Err(error),
        None => Ok(batch.claims.pop()),
    }
}

/// Claims up to `limit` due events in one statement: `INPROGRESS` rows whose lease
/// expired first, then `READY` rows whose `next_attempt_at` has come; returned in id order.
/// Each claimed row's generation is bumped and a fresh lease granted.
///
/// Rows whose payload does not decode are moved to `DEAD` (and logged) instead of
/// being returned, so one bad row never blocks a batch.
pub async fn claim_batch<'a, T: Outbox>(
    conn: impl Acquire<'a, Database = Postgres>,
    limit: u32,
) -> Result<Vec<Claim<T>>, OutboxError> {
    Ok(claim_rows::<T>(conn, limit).await?.claims)
}
