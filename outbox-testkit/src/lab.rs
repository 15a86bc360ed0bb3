//! The article's recovery lab ("Kill the Outbox Worker"), in Rust, on real PostgreSQL.
//!
//! Six scenarios run against two publishers: the leased protocol this crate generates
//! (`Leased`) and the article's unsafe baseline (`Baseline`: a READY-only claim and
//! outcome updates that check the row id and status but neither the generation nor the
//! lease). Each scenario runs in its own schema and reports pass or the reason it failed.
//! Driven by `tests/recovery_lab.rs` and `examples/recovery_lab.rs`.

use std::fmt::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use nix::sys::signal::Signal;
use outbox::testing::TestSchema;
use sqlx::{PgConnection, PgPool};

use crate::child::{self, ChildCommand};
use crate::events::LabEvent;
use crate::rows;
use crate::schema::schema_from_zero;

/// Which publisher a scenario drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Leased,
    Baseline,
}

impl Protocol {
    fn as_str(self) -> &'static str {
        match self {
            Self::Leased => "leased",
            Self::Baseline => "baseline",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Leased, Self::Baseline]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// The article's unsafe baseline statements.
mod baseline {
    pub(super) const CLAIM: &str = "UPDATE outbox_lab SET status = 'INPROGRESS', generation = generation + 1, \
         attempts = attempts + 1, lease_until = statement_timestamp() + interval '30 seconds' \
         WHERE id = (SELECT id FROM outbox_lab WHERE status = 'READY' AND next_attempt_at <= statement_timestamp() \
                     ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) \
         RETURNING id, event_id, generation";
    pub(super) const COMPLETE: &str = "UPDATE outbox_lab SET status = 'SENT', lease_until = NULL WHERE id = $1 AND status = 'INPROGRESS' RETURNING id";
    pub(super) const RETRY: &str = "UPDATE outbox_lab SET status = 'READY', lease_until = NULL, \
         next_attempt_at = statement_timestamp() + interval '1 minute' WHERE id = $1 AND status = 'INPROGRESS' RETURNING id";
}

/// What a publisher holds after a claim.
pub enum Token {
    Leased(outbox::Claim<LabEvent>),
    Baseline {
        id: i64,
        event_id: String,
        generation: i64,
    },
}

impl Token {
    /// (id, event_id, generation), as the article prints a claim.
    pub fn describe(&self) -> (i64, String, i64) {
        match self {
            Self::Leased(c) => (c.id(), c.event_id().to_string(), c.generation().get()),
            Self::Baseline {
                id,
                event_id,
                generation,
            } => (*id, event_id.clone(), *generation),
        }
    }
}

type Outcome = Result<(), String>;

async fn claim(protocol: Protocol, conn: &mut PgConnection) -> Result<Option<Token>, String> {
    match protocol {
        Protocol::Leased => Ok(LabEvent::claim(conn)
            .await
            .map_err(|e| e.to_string())?
            .map(Token::Leased)),
        Protocol::Baseline => {
            let row: Option<(i64, String, i64)> = sqlx::query_as(baseline::CLAIM)
                .fetch_optional(conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(row.map(|(id, event_id, generation)| Token::Baseline {
                id,
                event_id,
                generation,
            }))
        }
    }
}

async fn claim_on(protocol: Protocol, pool: &PgPool) -> Result<Option<Token>, String> {
    let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
    claim(protocol, &mut conn).await
}

/// Records SENT; `Ok(true)` when the database accepted the outcome.
async fn complete(token: Token, pool: &PgPool) -> Result<bool, String> {
    match token {
        Token::Leased(c) => match c.complete(pool).await {
            Ok(()) => Ok(true),
            Err(e) if e.is_stale() => Ok(false),
            Err(e) => Err(e.to_string()),
        },
        Token::Baseline { id, .. } => baseline_outcome(baseline::COMPLETE, id, pool).await,
    }
}

/// Sends the event back to READY; `Ok(true)` when the database accepted the outcome.
async fn retry(token: Token, pool: &PgPool) -> Result<bool, String> {
    match token {
        Token::Leased(c) => match c.retry(pool, None).await {
            Ok(_) => Ok(true),
            Err(e) if e.is_stale() => Ok(false),
            Err(e) => Err(e.to_string()),
        },
        Token::Baseline { id, .. } => baseline_outcome(baseline::RETRY, id, pool).await,
    }
}

async fn baseline_outcome(sql: &'static str, id: i64, pool: &PgPool) -> Result<bool, String> {
    let row: Option<(i64,)> = sqlx::query_as(sql)
        .bind(id)
        .fetch_optional(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.is_some())
}

async fn insert_events(pool: &PgPool, names: &[&str]) -> Result<(), String> {
    for name in names {
        LabEvent {
            name: (*name).to_owned(),
        }
        .enqueue(pool)
        .await
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The persisted (status, generation) of a row.
async fn row_state(pool: &PgPool, id: i64) -> Result<(String, i64), String> {
    let row = rows::fetch_row::<LabEvent>(pool, id)
        .await
        .map_err(|e| e.to_string())?;
    Ok((row.status, row.generation))
}

/// The article's fixture: move a lease into the past instead of waiting thirty seconds.
async fn expire_lease(pool: &PgPool, id: i64) -> Result<(), String> {
    rows::expire::<LabEvent>(pool, id)
        .await
        .map_err(|e| e.to_string())
}

#[allow(clippy::needless_pass_by_value)] // reads like the article: expect(what, got, want)
fn expect<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Outcome {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, expected {want:?}"))
    }
}

/// A scenario of the lab.
pub struct Scenario {
    pub number: u8,
    pub name: &'static str,
}

pub static SCENARIOS: [Scenario; 6] = [
    Scenario {
        number: 1,
        name: "SIGKILL after the claim commits; the expired claim is reclaimed",
    },
    Scenario {
        number: 2,
        name: "an open claim transaction: others skip its row; rollback frees it",
    },
    Scenario {
        number: 3,
        name: "a stale owner's complete is rejected under a newer generation",
    },
    Scenario {
        number: 4,
        name: "a stale owner's retry is rejected under a newer generation",
    },
    Scenario {
        number: 5,
        name: "retry cannot move a SENT row back to READY",
    },
    Scenario {
        number: 6,
        name: "an expired owner cannot finalize; the happy path completes",
    },
];

/// The child role of scenario 1: the publisher the parent kills (see `crate::child`).
const PUBLISHER: &str = "lab publisher";
/// The publisher's handshake: `CLAIMED <id> <event_id> <generation>`.
const CLAIMED: &str = "CLAIMED";

/// In the child process: claim one event in autocommit, print the claim, and wait to
/// be killed. Returns without doing anything in any other process.
pub fn child_main_if_requested() {
    if !child::requested(PUBLISHER) {
        return;
    }
    let (Some(url), Some(protocol)) = (
        child::param("URL"),
        child::param("PROTOCOL").and_then(|p| Protocol::parse(&p)),
    ) else {
        panic!("the lab's publisher needs a URL and a PROTOCOL");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let mut conn = <PgConnection as sqlx::Connection>::connect(&url)
            .await
            .expect("child connects");
        let token = claim(protocol, &mut conn)
            .await
            .expect("child claims")
            .expect("an event to claim");
        let (id, event_id, generation) = token.describe();
        child::say(&format!("{CLAIMED} {id} {event_id} {generation}"));
        // The claim is committed; now wait for the SIGKILL without recording anything.
        std::future::pending::<()>().await;
    });
}

async fn scenario_1(db: &TestSchema, protocol: Protocol, command: &ChildCommand) -> Outcome {
    let pool = db.pool();
    insert_events(pool, &["event-001"]).await?;
    let mut publisher = command.spawn(
        PUBLISHER,
        &[("URL", &db.url()), ("PROTOCOL", protocol.as_str())],
    )?;
    // Wait for the handshake: only a printed claim proves the claim committed.
    let line = child::handshake(publisher.stderr()?, CLAIMED, Duration::from_mins(1)).await;
    let status = publisher.kill()?;
    let line = line?;
    expect(
        "child exit signal",
        status.signal(),
        Some(Signal::SIGKILL as i32),
    )?;

    let fields: Vec<&str> = line.split_whitespace().collect();
    let (id, event_id): (i64, &str) = (fields[1].parse().map_err(|_| "bad claim line")?, fields[2]);
    expect(
        "the killed child's claim",
        (event_id, fields[3]),
        ("event-001", "1"),
    )?;
    expect(
        "state after SIGKILL",
        row_state(pool, id).await?,
        ("INPROGRESS".to_owned(), 1),
    )?;

    expire_lease(pool, id).await?;
    let next = claim_on(protocol, pool)
        .await?
        .ok_or("no candidate after the lease expired: the event is stranded")?;
    expect(
        "the replacement claim",
        next.describe(),
        (id, "event-001".to_owned(), 2),
    )
}

async fn scenario_2(db: &TestSchema, protocol: Protocol) -> Outcome {
    let pool = db.pool();
    insert_events(pool, &["event-001", "event-002"]).await?;
    let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
    let first = claim(protocol, &mut tx)
        .await?
        .ok_or("the open transaction claimed nothing")?
        .describe();
    let second = claim_on(protocol, pool)
        .await?
        .ok_or("a second poller found nothing while a row was free")?
        .describe();
    if first.0 == second.0 {
        return Err(format!("both pollers claimed row {}", first.0));
    }
    tx.rollback().await.map_err(|e| e.to_string())?;
    let again = claim_on(protocol, pool)
        .await?
        .ok_or("the rolled-back row is not claimable")?
        .describe();
    expect(
        "the row claimed after rollback",
        (again.0, again.2),
        (first.0, 1),
    )
}

/// Scenarios 3 and 4: worker A holds generation 1; a newer live generation is
/// constructed directly (as the article does); A's outcome must be rejected.
async fn stale_owner(db: &TestSchema, protocol: Protocol, outcome_is_complete: bool) -> Outcome {
    let pool = db.pool();
    insert_events(pool, &["event-001"]).await?;
    let stale = claim_on(protocol, pool).await?.ok_or("nothing to claim")?;
    let id = stale.describe().0;
    sqlx::query("UPDATE outbox_lab SET generation = 2, lease_until = statement_timestamp() + interval '30 seconds' WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    let accepted = if outcome_is_complete {
        complete(stale, pool).await?
    } else {
        retry(stale, pool).await?
    };
    expect("stale outcome accepted", accepted, false)?;
    expect(
        "the newer owner's row",
        row_state(pool, id).await?,
        ("INPROGRESS".to_owned(), 2),
    )
}

async fn scenario_5(db: &TestSchema, protocol: Protocol) -> Outcome {
    let pool = db.pool();
    insert_events(pool, &["event-001"]).await?;
    let late = claim_on(protocol, pool).await?.ok_or("nothing to claim")?;
    let id = late.describe().0;
    // The success was recorded (the fixture writes it directly, since a completed
    // `Claim` is consumed); a late failure callback for the same attempt follows.
    sqlx::query("UPDATE outbox_lab SET status = 'SENT', lease_until = NULL WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    expect("late retry accepted", retry(late, pool).await?, false)?;
    expect(
        "state after the late retry",
        row_state(pool, id).await?,
        ("SENT".to_owned(), 1),
    )
}

async fn scenario_6(db: &TestSchema, protocol: Protocol) -> Outcome {
    let pool = db.pool();
    insert_events(pool, &["event-001"]).await?;
    let expired = claim_on(protocol, pool).await?.ok_or("nothing to claim")?;
    let id = expired.describe().0;
    expire_lease(pool, id).await?;
    expect(
        "an expired owner's complete accepted",
        complete(expired, pool).await?,
        false,
    )?;
    expect(
        "state after the expired complete",
        row_state(pool, id).await?,
        ("INPROGRESS".to_owned(), 1),
    )?;

    // The happy path: whoever claims next completes normally.
    let owner = claim_on(protocol, pool)
        .await?
        .ok_or("the expired claim is not claimable")?;
    expect("complete accepted", complete(owner, pool).await?, true)?;
    expect(
        "final state",
        row_state(pool, id).await?,
        ("SENT".to_owned(), 2),
    )
}

/// Runs one scenario in a fresh schema.
pub async fn run(number: u8, protocol: Protocol, command: &ChildCommand) -> Outcome {
    // The article's schema starts generations at 0, and its scenarios expect 1, then 2.
    // The derived table starts them at a random value (so that a claim can never match
    // another table's row); the lab pins the article's start to check its numbers.
    let db = schema_from_zero(&[LabEvent::migrations()])
        .await
        .map_err(|e| e.to_string())?;
    let outcome = match number {
        1 => scenario_1(&db, protocol, command).await,
        2 => scenario_2(&db, protocol).await,
        3 => stale_owner(&db, protocol, true).await,
        4 => stale_owner(&db, protocol, false).await,
        5 => scenario_5(&db, protocol).await,
        6 => scenario_6(&db, protocol).await,
        _ => Err(format!("no scenario {number}")),
    };
    db.drop_schema().await.map_err(|e| e.to_string())?;
    outcome
}

/// Every scenario under both protocols (the two side by side): rows of (scenario,
/// leased, baseline).
pub async fn matrix(command: &ChildCommand) -> Vec<(&'static Scenario, Outcome, Outcome)> {
    let mut rows = Vec::with_capacity(SCENARIOS.len());
    for scenario in &SCENARIOS {
        let (leased, baseline) = tokio::join!(
            run(scenario.number, Protocol::Leased, command),
            run(scenario.number, Protocol::Baseline, command)
        );
        rows.push((scenario, leased, baseline));
    }
    rows
}

/// The scenarios the unsafe baseline fails, as the article reports them, each with
/// what its failure says: a baseline that fails for another reason (a lost connection,
/// a broken fixture) did not show what the scenario is about.
pub const BASELINE_FAILS: [(u8, &str); 4] = [
    (1, "the event is stranded"),
    (3, "stale outcome accepted"),
    (4, "stale outcome accepted"),
    (6, "an expired owner's complete accepted"),
];

/// Whether the matrix came out as the article says: the leased protocol passes every
/// scenario, the baseline fails exactly [`BASELINE_FAILS`], for their reasons;
/// otherwise, what differs.
pub fn verdict(rows: &[(&'static Scenario, Outcome, Outcome)]) -> Result<(), String> {
    let leased_failures: Vec<u8> = rows
        .iter()
        .filter(|r| r.1.is_err())
        .map(|r| r.0.number)
        .collect();
    let baseline_failures: Vec<(u8, &str)> = rows
        .iter()
        .filter_map(|r| r.2.as_ref().err().map(|e| (r.0.number, e.as_str())))
        .collect();
    let expected: Vec<u8> = BASELINE_FAILS.iter().map(|(n, _)| *n).collect();
    let numbers: Vec<u8> = baseline_failures.iter().map(|(n, _)| *n).collect();
    let off_reason: Vec<String> = baseline_failures
        .iter()
        .filter(|(n, why)| {
            !BASELINE_FAILS
                .iter()
                .any(|(m, reason)| m == n && why.contains(reason))
        })
        .map(|(n, why)| format!("{n}: {why}"))
        .collect();
    if leased_failures.is_empty() && numbers == expected && off_reason.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the leased protocol failed scenarios {leased_failures:?} (expected none), \
             the baseline {numbers:?} (expected {expected:?}){}",
            if off_reason.is_empty() {
                String::new()
            } else {
                format!(
                    ", for other reasons than the scenario's: {}",
                    off_reason.join("; ")
                )
            }
        ))
    }
}

/// The matrix as a table, like the article reports it.
pub fn render(rows: &[(&'static Scenario, Outcome, Outcome)]) -> String {
    let cell = |o: &Outcome| match o {
        Ok(()) => "pass".to_owned(),
        Err(e) => format!("FAIL ({e})"),
    };
    let mut out = String::from(
        "| # | scenario | leased + generation | unsafe baseline |\n|---|---|---|---|\n",
    );
    for (s, leased, baseline) in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            s.number,
            s.name,
            cell(leased),
            cell(baseline)
        );
    }
    let failures = |pick: for<'a> fn(&'a (&'static Scenario, Outcome, Outcome)) -> &'a Outcome| {
        rows.iter().filter(|r| pick(r).is_err()).count()
    };
    let _ = write!(
        out,
        "\nleased: {} failed, {} passed; baseline: {} failed, {} passed\n",
        failures(|r| &r.1),
        rows.len() - failures(|r| &r.1),
        failures(|r| &r.2),
        rows.len() - failures(|r| &r.2)
    );
    out
}
