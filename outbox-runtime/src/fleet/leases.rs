//! The fleet's two tables in its home database, and the statements of a round: who is
//! alive (`outbox_fleet_members`), which targets exist and who serves each, under which
//! generation, until when (`outbox_fleet`).
//!
//! A target's lease works as an event's: taking it bumps its generation, renewing or
//! releasing it names the generation it was taken with, and an expired lease is never
//! renewed, only taken again (with a new generation). So a member that paused past its
//! lease cannot renew it back from whoever took the target meanwhile.

use std::time::Duration;

use sqlx::PgPool;

use crate::error::{OnTable as _, OutboxError};
use crate::interval;
use crate::schema::migrate::{MigrationReport, migrate_target};
use crate::schema::runner::own_runner;

/// The table of targets and their leases.
pub const TABLE: &str = "outbox_fleet";

/// The refinery history table of the fleet's migrations.
const HISTORY_TABLE: &str = "_outbox_history_outbox_fleet";

const MIGRATIONS: [(&str, &str); 2] = [
    (
        "V1__create_outbox_fleet",
        "CREATE TABLE outbox_fleet (
    fleet text COLLATE \"C\" NOT NULL,
    target text COLLATE \"C\" NOT NULL,
    owner text COLLATE \"C\",
    generation bigint NOT NULL DEFAULT 0,
    lease_until timestamptz,
    served_since timestamptz,
    PRIMARY KEY (fleet, target),
    CONSTRAINT outbox_fleet_lease CHECK ((owner IS NULL) = (lease_until IS NULL))
);
CREATE TABLE outbox_fleet_members (
    fleet text COLLATE \"C\" NOT NULL,
    member text COLLATE \"C\" NOT NULL,
    alive_until timestamptz NOT NULL,
    PRIMARY KEY (fleet, member)
);
",
    ),
    // What the member serving a target last saw of it: since when its oldest due
    // event has waited (none: nothing due), and when it looked.
    (
        "V2__outbox_fleet_observed",
        "ALTER TABLE outbox_fleet
    ADD COLUMN oldest_due_since timestamptz,
    ADD COLUMN observed_at timestamptz;
",
    ),
];

/// Creates the fleet's tables the first time, through the runner and under the lock of
/// [`migrate`](crate::migrate) (their history in `_outbox_history_outbox_fleet`);
/// idempotent. [`Fleet::run`](super::Fleet::run) calls it.
pub async fn migrate(home: &PgPool) -> Result<MigrationReport, OutboxError> {
    let runner = own_runner(TABLE, HISTORY_TABLE, &MIGRATIONS)?;
    migrate_target(home, TABLE, &runner).await
}

/// A target this member took, and the generation it took it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Taken {
    pub(super) target: String,
    pub(super) generation: i64,
}

/// One member's statements on the home database.
pub(super) struct Leases<'a> {
    pub(super) home: &'a PgPool,
    pub(super) fleet: &'a str,
    pub(super) member: &'a str,
    pub(super) lease: Duration,
}

impl Leases<'_> {
    fn lease(&self) -> Result<Duration, OutboxError> {
        interval::checked(TABLE, "fleet lease", self.lease)
    }

    /// Says this member is alive for one more lease, forgets members dead for a lease
    /// already, and returns how many are alive (this one included).
    pub(super) async fn heartbeat(&self) -> Result<i64, OutboxError> {
        sqlx::query_scalar(
            "WITH beat AS (
                INSERT INTO outbox_fleet_members (fleet, member, alive_until)
                VALUES ($1, $2, statement_timestamp() + $3)
                ON CONFLICT (fleet, member) DO UPDATE SET alive_until = EXCLUDED.alive_until
            ), forgotten AS (
                DELETE FROM outbox_fleet_members
                WHERE fleet = $1 AND alive_until < statement_timestamp() - $3
            )
            SELECT 1 + count(*) FROM outbox_fleet_members
            WHERE fleet = $1 AND member <> $2 AND alive_until > statement_timestamp()",
        )
        .bind(self.fleet)
        .bind(self.member)
        .bind(self.lease()?)
        .fetch_one(self.home)
        .await
        .on_table(TABLE)
    }

    /// Records the targets this member discovered (those already known stay as they are).
    pub(super) async fn offer(&self, targets: &[&str]) -> Result<(), OutboxError> {
        sqlx::query(
            "INSERT INTO outbox_fleet (fleet, target)
             SELECT $1, target FROM unnest($2::text[]) AS target
             ON CONFLICT (fleet, target) DO NOTHING",
        )
        .bind(self.fleet)
        .bind(targets)
        .execute(self.home)
        .await
        .on_table(TABLE)?;
        Ok(())
    }

    /// Renews the leases of `held` that are still this member's, in the generation it
    /// took them with, and live; returns the targets renewed.
    pub(super) async fn renew(&self, held: &[Taken]) -> Result<Vec<String>, OutboxError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let (targets, generations): (Vec<&str>, Vec<i64>) = held
            .iter()
            .map(|t| (t.target.as_str(), t.generation))
            .unzip();
        sqlx::query_scalar(
            "UPDATE outbox_fleet SET lease_until = statement_timestamp() + $3
             WHERE fleet = $1 AND owner = $2 AND lease_until > statement_timestamp()
               AND (target, generation) IN (SELECT * FROM unnest($4::text[], $5::bigint[]))
             RETURNING target",
        )
        .bind(self.fleet)
        .bind(self.member)
        .bind(self.lease()?)
        .bind(targets)
        .bind(generations)
        .fetch_all(self.home)
        .await
        .on_table(TABLE)
    }

    /// Takes up to `wanted` of `among` whose lease is free or expired, each with a new
    /// generation.
    pub(super) async fn take(
        &self,
        among: &[&str],
        wanted: usize,
    ) -> Result<Vec<Taken>, OutboxError> {
        if wanted == 0 || among.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(String, i64)> = sqlx::query_as(
            // Materialized: as a subquery in FROM, it is the inner side of a nested
            // loop, scanned again per row, and each scan locks (and returns) others.
            "WITH free AS MATERIALIZED (
                SELECT target FROM outbox_fleet
                WHERE fleet = $1 AND target = ANY($4::text[])
                  AND (lease_until IS NULL OR lease_until <= statement_timestamp())
                ORDER BY target
                LIMIT $5
                FOR UPDATE SKIP LOCKED
             )
             UPDATE outbox_fleet AS f
             SET owner = $2, generation = f.generation + 1,
                 lease_until = statement_timestamp() + $3, served_since = statement_timestamp()
             FROM free
             WHERE f.fleet = $1 AND f.target = free.target
             RETURNING f.target, f.generation",
        )
        .bind(self.fleet)
        .bind(self.member)
        .bind(self.lease()?)
        .bind(among)
        .bind(i64::try_from(wanted).unwrap_or(i64::MAX))
        .fetch_all(self.home)
        .await
        .on_table(TABLE)?;
        Ok(rows
            .into_iter()
            .map(|(target, generation)| Taken { target, generation })
            .collect())
    }

    /// Gives `taken` up (the member stopped serving it), if it is still this member's
    /// in that generation.
    pub(super) async fn release(&self, taken: &Taken) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE outbox_fleet SET owner = NULL, lease_until = NULL
             WHERE fleet = $1 AND target = $2 AND owner = $3 AND generation = $4",
        )
        .bind(self.fleet)
        .bind(&taken.target)
        .bind(self.member)
        .bind(taken.generation)
        .execute(self.home)
        .await
        .on_table(TABLE)?;
        Ok(())
    }

    /// Records what this member saw of `taken`: since when its oldest due event has
    /// waited (`None`: nothing due), if it still serves it.
    pub(super) async fn observed(
        &self,
        taken: &Taken,
        oldest_due_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), OutboxError> {
        sqlx::query(
            "UPDATE outbox_fleet SET oldest_due_since = $5, observed_at = statement_timestamp()
             WHERE fleet = $1 AND target = $2 AND owner = $3 AND generation = $4",
        )
        .bind(self.fleet)
        .bind(&taken.target)
        .bind(self.member)
        .bind(taken.generation)
        .bind(oldest_due_since)
        .execute(self.home)
        .await
        .on_table(TABLE)?;
        Ok(())
    }

    /// Says this member is gone, so the others share its targets at once.
    pub(super) async fn leave(&self) -> Result<(), OutboxError> {
        sqlx::query("DELETE FROM outbox_fleet_members WHERE fleet = $1 AND member = $2")
            .bind(self.fleet)
            .bind(self.member)
            .execute(self.home)
            .await
            .on_table(TABLE)?;
        Ok(())
    }

    /// Forgets the targets nobody discovers any more: those not in `targets` whose lease
    /// is free, released or run out (a member with another view may still serve one; it
    /// stays while that member renews it; one whose member died unreleased goes once its
    /// lease ends).
    pub(super) async fn forget_others(&self, targets: &[&str]) -> Result<(), OutboxError> {
        sqlx::query(
            "DELETE FROM outbox_fleet
             WHERE fleet = $1 AND target <> ALL($2::text[])
               AND (owner IS NULL OR lease_until <= statement_timestamp())",
        )
        .bind(self.fleet)
        .bind(targets)
        .execute(self.home)
        .await
        .on_table(TABLE)?;
        Ok(())
    }
}

/// Who serves one target, as the home database says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// The target's name.
    pub target: String,
    /// The member serving it while its lease is live, if any.
    pub owner: Option<String>,
    /// How many times it was taken.
    pub generation: i64,
    /// What is left of its lease (`None`: free or expired).
    pub lease_left: Option<Duration>,
    /// How long its owner has served it (`None`: nobody does).
    pub served_for: Option<Duration>,
    /// How long ago its owner last looked at it (it does every four leases); `None`:
    /// nobody did yet.
    pub observed: Option<Duration>,
    /// How long its oldest due event had waited then; `None`: nothing was due.
    pub oldest_due: Option<Duration>,
}

/// A member of a fleet, as its last heartbeat says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its name ([`Fleet::member`](super::Fleet::member)).
    pub name: String,
    /// How long it stays alive without another heartbeat (`None`: it missed it, and is
    /// no longer counted).
    pub alive_for: Option<Duration>,
}

/// The fleets whose targets `home` keeps, by name.
pub async fn fleets(home: &PgPool) -> Result<Vec<String>, OutboxError> {
    sqlx::query_scalar(
        "SELECT fleet FROM outbox_fleet UNION SELECT fleet FROM outbox_fleet_members ORDER BY 1",
    )
    .fetch_all(home)
    .await
    .on_table(TABLE)
}

/// Which member serves which target of `fleet` (see [`Fleet::name`](super::Fleet::name)),
/// by target name.
pub async fn assignments(home: &PgPool, fleet: &str) -> Result<Vec<Assignment>, OutboxError> {
    // Target, owner, generation, seconds of lease left, seconds served, seconds the
    // oldest due event had waited when observed, seconds since.
    type Row = (
        String,
        Option<String>,
        i64,
        Option<f64>,
        Option<f64>,
        Option<f64>,
        Option<f64>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT target, owner, generation,
                extract(epoch FROM lease_until - statement_timestamp())::float8,
                extract(epoch FROM statement_timestamp() - served_since)::float8,
                extract(epoch FROM observed_at - oldest_due_since)::float8,
                extract(epoch FROM statement_timestamp() - observed_at)::float8
         FROM outbox_fleet WHERE fleet = $1 ORDER BY target",
    )
    .bind(fleet)
    .fetch_all(home)
    .await
    .on_table(TABLE)?;
    Ok(rows
        .into_iter()
        .map(|(target, owner, generation, left, served, waited, since)| {
            let lease_left = left.and_then(remaining);
            Assignment {
                target,
                owner: owner.filter(|_| lease_left.is_some()),
                generation,
                served_for: served.filter(|_| lease_left.is_some()).map(elapsed),
                observed: since.map(elapsed),
                oldest_due: waited.map(elapsed),
                lease_left,
            }
        })
        .collect())
}

/// The members of `fleet`, alive or not yet forgotten, by name.
pub async fn members(home: &PgPool, fleet: &str) -> Result<Vec<Member>, OutboxError> {
    let rows: Vec<(String, f64)> = sqlx::query_as(
        "SELECT member, extract(epoch FROM alive_until - statement_timestamp())::float8
         FROM outbox_fleet_members WHERE fleet = $1 ORDER BY member",
    )
    .bind(fleet)
    .fetch_all(home)
    .await
    .on_table(TABLE)?;
    Ok(rows
        .into_iter()
        .map(|(name, left)| Member {
            name,
            alive_for: remaining(left),
        })
        .collect())
}

/// What is left of a lease with `seconds` to go, as the database counted them: `None`
/// once it is over.
fn remaining(seconds: f64) -> Option<Duration> {
    (seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

/// How long ago something was, `seconds` as the database counted them (none in the
/// future: the clocks of two statements may disagree by a little).
fn elapsed(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds.max(0.0))
}
