//! Chaos for a relay fleet: member processes share the targets (databases of the run's
//! own) through their leases in a home schema, while the driver SIGKILLs and restarts
//! them, SIGSTOPs them past their lease, terminates their sessions, and makes a target
//! database refuse every connection for a while (`ALLOW_CONNECTIONS false`).
//!
//! Every member's sink records each delivery in the home schema (`fleet_published`:
//! target, member, event, the claim's generation). Triggers record every claim of an
//! event in its target (`fleet_claims`: event, generation, when) and every change of a
//! target's owner in the home (`fleet_owners`: target, owner, generation, when), all by
//! the one server's clock. At the end, every event must be `SENT`, delivered at least
//! once, and every delivery must come from a claim its member made while the target was
//! its own: the last change of the target's owner before the claim gave it to that
//! member. A paused member that went on claiming after its lease, or a member that
//! claimed a target it had given up, fails that check.
//!
//! Driven by `tests/fleet_chaos.rs`.

use std::fmt;
use std::time::Duration;

use nix::sys::signal::Signal;
use outbox::fleet::{self, Fleet, Target};
use outbox::testing::TestSchema;
use outbox::{Delivery, Sink, SinkError};
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::time::{Instant, sleep};

use super::{cancelled_by_sigterm, child_rng, child_runtime, draw};
use crate::child::{self, Child, ChildCommand};
use crate::database::TestDatabase;
use crate::events::ChaosEvent;

/// The child role of a fleet member.
const MEMBER: &str = "fleet-member";

/// The fleet's lease in the run: a pause of two leases hands a member's targets over.
const LEASE: Duration = Duration::from_secs(2);

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    pub targets: usize,
    pub members: usize,
    /// Events enqueued into each target while the chaos lasts.
    pub events_per_target: usize,
    /// How long the chaos lasts.
    pub chaos: Duration,
    pub seed: u64,
}

impl Config {
    /// 6 targets, 3 members, 200 events per target over 20 s of chaos.
    pub fn new(seed: u64) -> Self {
        Self {
            targets: 6,
            members: 3,
            events_per_target: 200,
            chaos: Duration::from_secs(20),
            seed,
        }
    }
}

/// What a run did and found.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub events: usize,
    pub kills: u32,
    pub pauses: u32,
    pub terminations: u32,
    /// Targets made unreachable for a while.
    pub outages: u32,
    pub deliveries: i64,
    /// Targets taken (a new generation) during the run.
    pub takes: i64,
    /// How long the last hand-over after a kill took, by the server's clock (the kill to
    /// the killed member's last target taken by another).
    pub handover_after_kill: Option<Duration>,
    pub failures: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fleet chaos (seed {}): {} events in {} deliveries; {} kills, {} pauses, {} \
             terminations, {} targets unreachable for a while; {} targets taken",
            self.seed,
            self.events,
            self.deliveries,
            self.kills,
            self.pauses,
            self.terminations,
            self.outages,
            self.takes
        )?;
        if let Some(handover) = self.handover_after_kill {
            write!(
                f,
                "; last hand-over after a kill {} ms",
                handover.as_millis()
            )?;
        }
        for failure in &self.failures {
            write!(f, "\n  FAILED: {failure}")?;
        }
        Ok(())
    }
}

/// In a member child: run a fleet member until SIGTERM, then exit the process. Returns
/// at once in any other process.
pub fn member_main_if_requested() {
    if !child::requested(MEMBER) {
        return;
    }
    let (Some(home), Some(targets), Some(member)) = (
        child::param("HOME"),
        child::param("TARGETS"),
        child::param("MEMBER"),
    ) else {
        panic!("a fleet member needs HOME, TARGETS and MEMBER");
    };
    let code = child_runtime().block_on(member_child(&home, &targets, &member));
    std::process::exit(code);
}

async fn member_child(home: &str, targets: &str, member: &str) -> i32 {
    let options = |url: &str| -> PgConnectOptions {
        // The member's name on every session: the driver ends a member's sessions by it.
        url.parse::<PgConnectOptions>()
            .expect("a target url")
            .application_name(member)
    };
    let home = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(options(home));
    let targets: Vec<Target> = targets
        .lines()
        .filter_map(|line| line.split_once(' '))
        .map(|(name, url)| Target::new(name, options(url)))
        .collect();
    let rng = std::sync::Arc::new(child_rng());
    let audit = home.clone();
    let member_name = member.to_owned();
    let fleet = Fleet::<ChaosEvent, _>::with_sinks(home, move |target| AuditSink {
        audit: audit.clone(),
        target: target.name().to_owned(),
        member: member_name.clone(),
        rng: std::sync::Arc::clone(&rng),
    })
    .member(member)
    .lease(LEASE)
    .targets(targets)
    .relay(|relay| {
        relay
            .batch_size(20)
            .poll_interval(Duration::from_millis(250))
            .send_timeout(Duration::from_secs(10))
            .shutdown_grace(Duration::from_secs(3))
    });
    child::say("started");
    match fleet.run(cancelled_by_sigterm()).await {
        Ok(()) => 0,
        Err(error) => {
            child::say(&format!("member failed: {error}"));
            1
        }
    }
}

/// Records each delivery in the home schema, after a short sleep (the broker's
/// latency) that widens the window in which a member holds claims.
struct AuditSink {
    audit: PgPool,
    target: String,
    member: String,
    rng: std::sync::Arc<std::sync::Mutex<fastrand::Rng>>,
}

impl Sink<ChaosEvent> for AuditSink {
    async fn publish(&self, batch: &[Delivery<'_, ChaosEvent>]) -> Vec<Result<(), SinkError>> {
        sleep(Duration::from_millis(draw(&self.rng, |rng| {
            rng.u64(2..=20)
        })))
        .await;
        let events: Vec<&str> = batch.iter().map(|d| d.event_id().as_str()).collect();
        let generations: Vec<i64> = batch.iter().map(|d| d.generation().get()).collect();
        let recorded = sqlx::query(
            "INSERT INTO fleet_published (target, member, event, generation)
             SELECT $1, $2, event, generation FROM unnest($3::text[], $4::bigint[])
                 AS d(event, generation)",
        )
        .bind(&self.target)
        .bind(&self.member)
        .bind(&events)
        .bind(&generations)
        .execute(&self.audit)
        .await;
        let failed = recorded.err().map(|error| error.to_string());
        batch
            .iter()
            .map(|_| match &failed {
                None => Ok(()),
                Some(error) => Err(SinkError::transient(format!(
                    "the audit did not record the batch: {error}"
                ))),
            })
            .collect()
    }
}

/// The home schema's audit tables and the trigger on the fleet's leases.
const HOME_AUDIT: &str = "
CREATE TABLE fleet_published (
    target text NOT NULL, member text NOT NULL, event text NOT NULL, generation bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE fleet_owners (
    target text NOT NULL, owner text, generation bigint NOT NULL, at timestamptz NOT NULL);
CREATE FUNCTION fleet_owner_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fleet_owners VALUES (NEW.target, NEW.owner, NEW.generation, statement_timestamp());
    RETURN NULL;
END $$;
CREATE TRIGGER fleet_owner_changed AFTER UPDATE ON outbox_fleet FOR EACH ROW
    WHEN (OLD.owner IS DISTINCT FROM NEW.owner OR OLD.generation IS DISTINCT FROM NEW.generation)
    EXECUTE FUNCTION fleet_owner_changed();";

/// A target's claim history.
const TARGET_AUDIT: &str = "
CREATE TABLE fleet_claims (event text NOT NULL, generation bigint NOT NULL, at timestamptz NOT NULL);
CREATE FUNCTION fleet_claimed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fleet_claims VALUES (NEW.event_id, NEW.generation, statement_timestamp());
    RETURN NULL;
END $$;
CREATE TRIGGER fleet_claimed AFTER UPDATE ON chaos_events FOR EACH ROW
    WHEN (NEW.status = 'INPROGRESS' AND OLD.generation IS DISTINCT FROM NEW.generation)
    EXECUTE FUNCTION fleet_claimed();";

/// A member process and its name.
struct Member {
    name: String,
    child: Child,
}

fn error(e: &dyn fmt::Display) -> String {
    e.to_string()
}

/// What a run holds: the home and the targets, the member processes, the schedule's
/// generator, and what it did so far.
struct Run<'c> {
    command: &'c ChildCommand,
    home: TestSchema,
    targets: Vec<TestDatabase>,
    /// The targets as the members read them: `name url` lines.
    listing: String,
    members: Vec<Member>,
    rng: fastrand::Rng,
    report: Report,
    /// The member killed last, and when (the server's clock).
    last_kill: Option<(String, chrono::DateTime<chrono::Utc>)>,
}

impl<'c> Run<'c> {
    /// The home schema, the target databases with their audit, and the members.
    async fn start(config: &Config, command: &'c ChildCommand) -> Result<Self, String> {
        let home = TestSchema::new().await.map_err(|e| error(&e))?;
        fleet::migrate(home.pool()).await.map_err(|e| error(&e))?;
        sqlx::raw_sql(HOME_AUDIT)
            .execute(home.pool())
            .await
            .map_err(|e| error(&e))?;
        let mut targets = Vec::new();
        for _ in 0..config.targets {
            let database = TestDatabase::new().await.map_err(|e| error(&*e))?;
            outbox::migrate(database.pool(), &[ChaosEvent::migrations()])
                .await
                .map_err(|e| error(&e))?;
            sqlx::raw_sql(TARGET_AUDIT)
                .execute(database.pool())
                .await
                .map_err(|e| error(&e))?;
            targets.push(database);
        }
        let listing = targets
            .iter()
            .enumerate()
            .map(|(n, database)| format!("target-{n} {}", database.url()))
            .collect::<Vec<_>>()
            .join("\n");
        let mut run = Self {
            command,
            home,
            targets,
            listing,
            members: Vec::new(),
            rng: fastrand::Rng::with_seed(config.seed),
            report: Report {
                seed: config.seed,
                events: config.targets * config.events_per_target,
                ..Report::default()
            },
            last_kill: None,
        };
        for n in 0..config.members {
            let member = run.spawn(&format!("member-{n}"))?;
            run.members.push(member);
        }
        Ok(run)
    }

    fn spawn(&mut self, name: &str) -> Result<Member, String> {
        let seed = self.rng.u64(..).to_string();
        let child = self.command.spawn(
            MEMBER,
            &[
                ("HOME", &self.home.url()),
                ("TARGETS", &self.listing),
                ("MEMBER", name),
                ("SEED", &seed),
            ],
        )?;
        Ok(Member {
            name: name.to_owned(),
            child,
        })
    }

    /// One chaos action: 0 kills a member and starts it again, 1 pauses one past two
    /// leases, 2 makes a target refuse every connection for two leases, 3 ends a
    /// member's sessions.
    async fn act(&mut self, action: u8) -> Result<(), String> {
        let pick = self.rng.usize(..self.members.len());
        match action {
            0 => {
                let at: chrono::DateTime<chrono::Utc> =
                    sqlx::query_scalar("SELECT clock_timestamp()")
                        .fetch_one(self.home.pool())
                        .await
                        .map_err(|e| error(&e))?;
                let name = self.members[pick].name.clone();
                self.members[pick].child.kill()?;
                self.report.kills += 1;
                self.last_kill = Some((name.clone(), at));
                self.members[pick] = self.spawn(&name)?;
            }
            1 => {
                self.members[pick].child.signal(Signal::SIGSTOP)?;
                sleep(LEASE * 2).await;
                self.members[pick].child.signal(Signal::SIGCONT)?;
                self.report.pauses += 1;
            }
            2 => {
                // Its member's relay backs off, the others do not notice; its events wait.
                let target = &self.targets[self.rng.usize(..self.targets.len())];
                target.set_reachable(false).await.map_err(|e| error(&*e))?;
                sleep(LEASE * 2).await;
                target.set_reachable(true).await.map_err(|e| error(&*e))?;
                self.report.outages += 1;
            }
            _ => {
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                )
                .bind(&self.members[pick].name)
                .execute(self.home.pool())
                .await
                .map_err(|e| error(&e))?;
                self.report.terminations += 1;
            }
        }
        Ok(())
    }

    /// Enqueues the events into every target at a steady pace, acting every 1-3 s
    /// (each action once first, in a random order, then any).
    async fn drive(&mut self, config: &Config) -> Result<(), String> {
        let started = Instant::now();
        let per_step = config.chaos / u32::try_from(config.events_per_target).unwrap_or(1);
        let mut next_action = started + Duration::from_secs(2);
        let mut first_actions: Vec<u8> = (0..4).collect();
        self.rng.shuffle(&mut first_actions);
        for seq in 0..config.events_per_target {
            for (n, target) in self.targets.iter().enumerate() {
                let event = ChaosEvent {
                    key: format!("target-{n}-event-{seq}"),
                    order_seq: i64::try_from(seq).unwrap_or(0),
                };
                event.enqueue(target.pool()).await.map_err(|e| error(&e))?;
            }
            if Instant::now() >= next_action {
                let action = first_actions.pop().unwrap_or_else(|| self.rng.u8(0..4));
                self.act(action).await?;
                next_action = Instant::now() + Duration::from_millis(self.rng.u64(1_000..3_000));
            }
            let step = u32::try_from(seq + 1).unwrap_or(u32::MAX);
            tokio::time::sleep_until(started + per_step * step).await;
        }
        Ok(())
    }

    /// Waits for every event to be `SENT` (a minute at most), then stops the members.
    async fn drain_and_stop(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_mins(1);
        loop {
            let mut left = 0;
            for target in &self.targets {
                left += crate::rows::count::<ChaosEvent>(target.pool(), "READY").await
                    + crate::rows::count::<ChaosEvent>(target.pool(), "INPROGRESS").await;
            }
            if left == 0 {
                break;
            }
            if Instant::now() > deadline {
                self.report
                    .failures
                    .push(format!("{left} events not SENT a minute after the chaos"));
                break;
            }
            sleep(Duration::from_millis(200)).await;
        }
        for member in &self.members {
            member.child.signal(Signal::SIGTERM)?;
        }
        for member in &mut self.members {
            member.child.wait()?;
        }
        Ok(())
    }
}

/// Runs the chaos; the report says what failed.
pub async fn run(config: &Config, command: &ChildCommand) -> Result<Report, String> {
    let mut run = Run::start(config, command).await?;
    run.drive(config).await?;
    run.drain_and_stop().await?;
    let Run {
        home,
        targets,
        mut report,
        last_kill,
        ..
    } = run;
    audit(&home, &targets, config, &mut report, last_kill)
        .await
        .map_err(|e| error(&e))?;
    for target in targets {
        target.drop_database().await.map_err(|e| error(&*e))?;
    }
    home.drop_schema().await.map_err(|e| error(&e))?;
    Ok(report)
}

/// The end state's checks: every event `SENT` and delivered, every delivery from a claim
/// made while its member owned the target.
async fn audit(
    home: &TestSchema,
    targets: &[TestDatabase],
    config: &Config,
    report: &mut Report,
    last_kill: Option<(String, chrono::DateTime<chrono::Utc>)>,
) -> Result<(), sqlx::Error> {
    report.deliveries = sqlx::query_scalar("SELECT count(*) FROM fleet_published")
        .fetch_one(home.pool())
        .await?;
    report.takes =
        sqlx::query_scalar("SELECT count(*) FROM fleet_owners o WHERE owner IS NOT NULL")
            .fetch_one(home.pool())
            .await?;
    let owners: Vec<(String, Option<String>, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT target, owner, at FROM fleet_owners ORDER BY at")
            .fetch_all(home.pool())
            .await?;
    let published: Vec<(String, String, String, i64)> =
        sqlx::query_as("SELECT target, member, event, generation FROM fleet_published")
            .fetch_all(home.pool())
            .await?;
    if let Some((killed, at)) = last_kill {
        // The targets the killed member held, and when each was taken again (by another
        // member, or by its own restart under the same name).
        let mut latest = None;
        let held = owners.iter().filter(|(_, _, changed)| *changed < at).fold(
            std::collections::BTreeMap::new(),
            |mut held, (target, owner, _)| {
                held.insert(target.clone(), owner.clone());
                held
            },
        );
        for (target, _) in held
            .iter()
            .filter(|(_, owner)| owner.as_deref() == Some(&*killed))
        {
            let taken = owners
                .iter()
                .find(|(t, owner, changed)| t == target && owner.is_some() && *changed > at);
            if let Some((_, _, changed)) = taken {
                latest = latest.max(Some(*changed - at));
            }
        }
        report.handover_after_kill = latest.and_then(|d| d.to_std().ok());
    }
    for (n, target) in targets.iter().enumerate() {
        let name = format!("target-{n}");
        let sent = crate::rows::count::<ChaosEvent>(target.pool(), "SENT").await;
        let expected = i64::try_from(config.events_per_target).unwrap_or(i64::MAX);
        if sent != expected {
            report
                .failures
                .push(format!("{name}: {sent} SENT of {expected}"));
        }
        let undelivered: i64 = sqlx::query_scalar(AssertSqlSafe(
            "SELECT count(*) FROM chaos_events e WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[]) AS d(event) WHERE d.event = e.event_id)".to_owned(),
        ))
        .bind(
            published
                .iter()
                .filter(|(t, ..)| *t == name)
                .map(|(_, _, event, _)| event.clone())
                .collect::<Vec<_>>(),
        )
        .fetch_one(target.pool())
        .await?;
        if undelivered > 0 {
            report.failures.push(format!(
                "{name}: {undelivered} events SENT, never delivered"
            ));
        }
        let claims: Vec<(String, i64, chrono::DateTime<chrono::Utc>)> =
            sqlx::query_as("SELECT event, generation, at FROM fleet_claims")
                .fetch_all(target.pool())
                .await?;
        let claimed_at: std::collections::HashMap<(String, i64), chrono::DateTime<chrono::Utc>> =
            claims.into_iter().map(|(e, g, at)| ((e, g), at)).collect();
        for (_, member, event, generation) in published.iter().filter(|(t, ..)| *t == name) {
            let Some(at) = claimed_at.get(&(event.clone(), *generation)) else {
                report.failures.push(format!(
                    "{name}: {event} generation {generation} delivered, never claimed"
                ));
                continue;
            };
            let owner = owners
                .iter()
                .rev()
                .find(|(t, _, changed)| *t == name && changed < at)
                .and_then(|(_, owner, _)| owner.as_deref());
            if owner != Some(member.as_str()) {
                report.failures.push(format!(
                    "{name}: {event} (generation {generation}) delivered by {member} from a claim at {at} while the target was {owner:?}'s"
                ));
            }
        }
    }
    report.failures.truncate(20);
    Ok(())
}
