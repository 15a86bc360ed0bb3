//! A relay fleet: members sharing targets (schemas standing in for tenant databases)
//! through leases in a home schema, each target served by one member at a time, handed
//! over when a member stops, dies or pauses, targets discovered and dropped at run time,
//! an unreachable target beside the others, and the connection budget.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::fleet::{self, Fleet, Target};
use outbox::relay::MemorySink;
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Outbox, OutboxError};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::Budgeted;
use outbox_testkit::rows::{count, enqueue};
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::budgeted;

/// The fleet's lease in these tests: short, so hand-overs are quick.
const LEASE: Duration = Duration::from_secs(1);

/// The tenants: a schema each with the `Budgeted` table, and the fleet's home schema.
struct Tenants {
    home: TestSchema,
    schemas: Vec<TestSchema>,
}

impl Tenants {
    async fn new(n: usize) -> TestResult<Self> {
        let home = TestSchema::new().await?;
        // Its members create the tables too; the test reads them from the start.
        fleet::migrate(home.pool()).await?;
        let mut schemas = Vec::with_capacity(n);
        for _ in 0..n {
            schemas.push(schema_with(&[Budgeted::migrations()]).await?);
        }
        Ok(Self { home, schemas })
    }

    fn target(&self, n: usize) -> Target {
        Target::from_url(format!("tenant-{n}"), &self.schemas[n].url()).unwrap()
    }

    fn targets(&self) -> Vec<Target> {
        (0..self.schemas.len()).map(|n| self.target(n)).collect()
    }

    /// Enqueues `per_tenant` events in each tenant, named after it and `round`.
    async fn enqueue(&self, round: &str, per_tenant: usize) {
        for (n, schema) in self.schemas.iter().enumerate() {
            let events: Vec<Budgeted> = (0..per_tenant)
                .map(|i| budgeted(&format!("{round}-tenant-{n}-{i}")))
                .collect();
            enqueue(schema.pool(), &events).await;
        }
    }

    async fn all_sent(&self, expected: i64) -> bool {
        for schema in &self.schemas {
            if count::<Budgeted>(schema.pool(), "SENT").await != expected {
                return false;
            }
        }
        true
    }

    /// Which member serves each target now (live leases only).
    async fn owners(&self) -> HashMap<String, Option<String>> {
        fleet::assignments(self.home.pool(), Budgeted::SPEC.table())
            .await
            .unwrap()
            .into_iter()
            .map(|a| (a.target, a.owner))
            .collect()
    }

    async fn served_by(&self, member: &str) -> usize {
        self.owners()
            .await
            .values()
            .filter(|owner| owner.as_deref() == Some(member))
            .count()
    }

    async fn drop_all(self) -> TestResult {
        for schema in self.schemas {
            schema.drop_schema().await?;
        }
        self.home.drop_schema().await?;
        Ok(())
    }
}

/// One member of the fleet, running on a task of its own, with the sink it publishes to.
struct Member {
    name: &'static str,
    sink: MemorySink<Budgeted>,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), OutboxError>>,
}

impl Member {
    fn start(name: &'static str, home: &PgPool, targets: Vec<Target>) -> Self {
        Self::start_with(name, home, |fleet| fleet.targets(targets))
    }

    fn start_with(
        name: &'static str,
        home: &PgPool,
        configure: impl FnOnce(
            Fleet<Budgeted, MemorySink<Budgeted>>,
        ) -> Fleet<Budgeted, MemorySink<Budgeted>>,
    ) -> Self {
        let sink = MemorySink::new();
        let fleet = Fleet::<Budgeted, _>::new(home.clone(), sink.clone())
            .member(name)
            .lease(LEASE)
            .relay(|relay| relay.poll_interval(Duration::from_millis(100)));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(configure(fleet).run(shutdown.clone()));
        Self {
            name,
            sink,
            shutdown,
            task,
        }
    }

    fn published(&self) -> Vec<String> {
        self.sink
            .published()
            .into_iter()
            .map(|p| p.event.name)
            .collect()
    }

    async fn stop(self) -> TestResult {
        self.shutdown.cancel();
        self.task.await??;
        Ok(())
    }
}

/// Every name in `published` once, and `expected` of them.
fn each_once(published: impl IntoIterator<Item = String>, expected: usize) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for name in published {
        *seen.entry(name).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    assert_eq!(seen.len(), expected, "every event published");
}

#[tokio::test]
async fn two_members_share_the_targets_and_a_stopping_member_hands_its_own_over() -> TestResult {
    let tenants = Tenants::new(6).await?;
    let home = tenants.home.pool();
    tenants.enqueue("before", 10).await;
    let a = Member::start("a", home, tenants.targets());
    let b = Member::start("b", home, tenants.targets());

    wait_until(
        "each member serves three targets",
        Duration::from_secs(30),
        async || tenants.served_by("a").await == 3 && tenants.served_by("b").await == 3,
    )
    .await;
    tenants.enqueue("shared", 10).await;
    wait_until("120 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(20).await
    })
    .await;
    assert!(
        !a.published().is_empty() && !b.published().is_empty(),
        "both published"
    );

    // A member that stops gives its targets up: the other serves all six.
    let published_by_a = a.published();
    a.stop().await?;
    wait_until("b serves all six", Duration::from_secs(30), async || {
        tenants.served_by("b").await == 6
    })
    .await;
    tenants.enqueue("after", 10).await;
    wait_until("180 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(30).await
    })
    .await;
    let published_by_b = b.published();
    assert!(
        published_by_b
            .iter()
            .filter(|n| n.starts_with("after"))
            .count()
            == 60,
        "b published what came after a stopped"
    );
    b.stop().await?;
    each_once(published_by_a.into_iter().chain(published_by_b), 180);
    assert!(
        tenants.owners().await.values().all(Option::is_none),
        "stopped members hold no target"
    );
    tenants.drop_all().await
}

#[tokio::test]
async fn a_target_no_longer_discovered_whose_member_died_is_forgotten_after_its_lease() -> TestResult
{
    let tenants = Tenants::new(2).await?;
    let home = tenants.home.pool();
    let a = Member::start("a", home, tenants.targets());
    wait_until("a serves both", Duration::from_secs(30), async || {
        tenants.served_by("a").await == 2
    })
    .await;
    // Dropped mid-run: its leases are never released.
    a.task.abort();
    // Tenant 0 has left the fleet's view: once a's lease on it has run out, nobody
    // serves it, and the next discovery forgets it.
    let only_one = vec![tenants.target(1)];
    let b = Member::start_with("b", home, move |fleet| {
        fleet.targets(only_one).discovery_interval(Duration::ZERO)
    });
    wait_until(
        "only tenant 1 is known",
        Duration::from_secs(30),
        async || tenants.owners().await.keys().collect::<Vec<_>>() == ["tenant-1"],
    )
    .await;
    b.stop().await?;
    tenants.drop_all().await
}

#[tokio::test]
async fn the_targets_of_a_member_that_died_are_taken_over_after_their_lease() -> TestResult {
    let tenants = Tenants::new(4).await?;
    let home = tenants.home.pool();
    let a = Member::start("a", home, tenants.targets());
    wait_until("a serves all four", Duration::from_secs(30), async || {
        tenants.served_by("a").await == 4
    })
    .await;
    // Dropped mid-run: no release, no goodbye; its relays are aborted with it.
    a.task.abort();
    let b = Member::start("b", home, tenants.targets());
    tenants.enqueue("after-death", 5).await;
    wait_until("b serves all four", Duration::from_secs(30), async || {
        tenants.served_by("b").await == 4
    })
    .await;
    wait_until("20 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(5).await
    })
    .await;
    let published = b.published();
    b.stop().await?;
    each_once(published, 20);
    tenants.drop_all().await
}

#[tokio::test]
async fn a_paused_member_stops_claiming_when_its_lease_ends_and_cannot_renew_it_back() -> TestResult
{
    let tenants = Tenants::new(4).await?;
    let home = tenants.home.pool();
    let a = Member::start("a", home, tenants.targets());
    let b = Member::start("b", home, tenants.targets());
    wait_until(
        "each member serves two",
        Duration::from_secs(30),
        async || tenants.served_by("a").await == 2 && tenants.served_by("b").await == 2,
    )
    .await;
    // `a` stalls: its round waits on its own member row, locked here, and renews
    // nothing. Its leases run out by its own clock first: its relays stop claiming.
    let mut stall = home.begin().await?;
    sqlx::query("SELECT 1 FROM outbox_fleet_members WHERE member = 'a' FOR UPDATE")
        .execute(&mut *stall)
        .await?;
    wait_until("b serves all four", Duration::from_secs(30), async || {
        tenants.served_by("b").await == 4
    })
    .await;
    let before = a.published().len();
    tenants.enqueue("while-a-stalls", 5).await;
    wait_until("20 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(5).await
    })
    .await;
    assert_eq!(
        a.published().len(),
        before,
        "a stalled member claimed nothing"
    );

    // `a` wakes up: its renewals name generations that are no longer current, so it
    // gives nothing back from b by renewing; it takes its share again only as b
    // releases it.
    stall.commit().await?;
    wait_until(
        "each member serves two again",
        Duration::from_secs(30),
        async || tenants.served_by("a").await == 2 && tenants.served_by("b").await == 2,
    )
    .await;
    tenants.enqueue("after-a-woke", 5).await;
    wait_until("40 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(10).await
    })
    .await;
    let (published_a, published_b) = (a.published(), b.published());
    a.stop().await?;
    b.stop().await?;
    each_once(published_a.into_iter().chain(published_b), 40);
    tenants.drop_all().await
}

#[tokio::test]
async fn targets_come_and_go_at_run_time_and_an_unreachable_one_costs_the_others_nothing()
-> TestResult {
    let tenants = Tenants::new(2).await?;
    let home = tenants.home.pool();
    // A database nobody listens for: refused at every connection.
    let unreachable =
        Target::from_url("unreachable", "postgres://root@127.0.0.1:1/nowhere").unwrap();
    let discovered = Arc::new(Mutex::new(vec![unreachable, tenants.target(0)]));
    let current = Arc::clone(&discovered);
    let a = Member::start_with("a", home, move |fleet| {
        fleet.discovery_interval(Duration::ZERO).discover(move || {
            let targets = current
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            async move { Ok(targets) }
        })
    });
    tenants.enqueue("first", 5).await;
    wait_until(
        "tenant 0's events sent",
        Duration::from_secs(30),
        async || count::<Budgeted>(tenants.schemas[0].pool(), "SENT").await == 5,
    )
    .await;
    assert_eq!(
        tenants.served_by("a").await,
        2,
        "the unreachable target is served too"
    );

    // Tenant 1 joins, tenant 0 leaves: from the next rounds on.
    *discovered.lock().unwrap() = vec![tenants.target(1)];
    wait_until(
        "tenant 1's events sent",
        Duration::from_secs(30),
        async || count::<Budgeted>(tenants.schemas[1].pool(), "SENT").await == 5,
    )
    .await;
    wait_until(
        "only tenant 1 is known",
        Duration::from_secs(30),
        async || tenants.owners().await.keys().collect::<Vec<_>>() == ["tenant-1"],
    )
    .await;
    enqueue(tenants.schemas[0].pool(), &[budgeted("left-behind")]).await;
    tokio::time::sleep(LEASE).await;
    assert_eq!(
        count::<Budgeted>(tenants.schemas[0].pool(), "READY").await,
        1,
        "a target no longer discovered is not served"
    );
    a.stop().await?;
    tenants.drop_all().await
}

#[tokio::test]
async fn a_member_serves_no_more_targets_than_its_connections_allow() -> TestResult {
    let tenants = Tenants::new(3).await?;
    let home = tenants.home.pool();
    let targets = tenants.targets();
    let small = |fleet: Fleet<Budgeted, MemorySink<Budgeted>>| {
        fleet
            .targets(targets.clone())
            .max_connections(4)
            .connections_per_target(2)
    };
    let a = Member::start_with("a", home, small);
    tenants.enqueue("capped", 3).await;
    wait_until(
        "a serves two of the three",
        Duration::from_secs(30),
        async || tenants.served_by("a").await == 2,
    )
    .await;
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(tenants.served_by("a").await, 2, "never a third");
    let b = Member::start_with("b", home, small);
    wait_until("9 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(3).await
    })
    .await;
    let owners = tenants.owners().await;
    assert_eq!(
        owners
            .values()
            .filter(|o| o.as_deref() == Some(b.name))
            .count(),
        1,
        "b took what a could not serve: {owners:?}"
    );
    a.stop().await?;
    b.stop().await?;
    tenants.drop_all().await
}

#[tokio::test]
async fn each_target_publishes_through_a_sink_made_for_it_and_is_counted_apart() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let tenants = Tenants::new(2).await?;
    let sinks: Arc<Mutex<HashMap<String, MemorySink<Budgeted>>>> = Arc::default();
    let made = Arc::clone(&sinks);
    let fleet = Fleet::<Budgeted, _>::with_sinks(tenants.home.pool().clone(), move |target| {
        let sink = MemorySink::new();
        made.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(target.name().to_owned(), sink.clone());
        sink
    })
    .targets(tenants.targets())
    .lease(LEASE);
    let shutdown = CancellationToken::new();
    let member = tokio::spawn(fleet.run(shutdown.clone()));
    tenants.enqueue("own-sink", 3).await;
    wait_until("6 events sent", Duration::from_secs(30), async || {
        tenants.all_sent(3).await
    })
    .await;
    shutdown.cancel();
    member.await??;
    for (target, sink) in sinks.lock().unwrap().iter() {
        let n = target.trim_start_matches("tenant-");
        let names: Vec<String> = sink.published().into_iter().map(|p| p.event.name).collect();
        assert_eq!(names.len(), 3, "{target}: {names:?}");
        let sent = counters.get_for_target(outbox::relay::metric::SENT, "budget_events", target);
        assert_eq!(sent, 3, "{target}'s relay counts its own events");
        assert!(
            names
                .iter()
                .all(|name| name.starts_with(&format!("own-sink-tenant-{n}-"))),
            "{target} published its own events only: {names:?}"
        );
    }
    tenants.drop_all().await
}

#[tokio::test]
async fn each_target_shows_how_long_its_oldest_due_event_has_waited() -> TestResult {
    let tenants = Tenants::new(2).await?;
    // Tenant 0's destination is down: its events wait. Tenant 1's publishes.
    let fleet = Fleet::<Budgeted, _>::with_sinks(tenants.home.pool().clone(), |target| DownFor {
        down: target.name() == "tenant-0",
        sink: MemorySink::new(),
    })
    .targets(tenants.targets())
    .lease(LEASE)
    .relay(|relay| relay.poll_interval(Duration::from_millis(100)));
    let shutdown = CancellationToken::new();
    let member = tokio::spawn(fleet.run(shutdown.clone()));
    tenants.enqueue("lagging", 2).await;
    wait_until(
        "tenant 0 lags by a lease, tenant 1 not at all",
        Duration::from_secs(30),
        async || {
            let assignments = fleet::assignments(tenants.home.pool(), Budgeted::SPEC.table())
                .await
                .unwrap();
            // What the target's member saw when it last looked: `None` if it did not
            // look yet, `Some(None)` if nothing was due.
            let seen = |target: &str| {
                assignments
                    .iter()
                    .find(|a| a.target == target)
                    .and_then(|a| a.observed.map(|_| a.oldest_due))
            };
            let tenant_0_lags = matches!(seen("tenant-0"), Some(Some(waited)) if waited >= LEASE);
            // Observed after its events were sent: nothing due.
            let tenant_1_sent = count::<Budgeted>(tenants.schemas[1].pool(), "SENT").await == 2;
            tenant_0_lags && tenant_1_sent && seen("tenant-1") == Some(None)
        },
    )
    .await;
    shutdown.cancel();
    member.await??;
    tenants.drop_all().await
}

/// A sink whose destination is down (every batch handed back), or a memory sink.
struct DownFor {
    down: bool,
    sink: MemorySink<Budgeted>,
}

impl outbox::Sink<Budgeted> for DownFor {
    async fn publish(
        &self,
        batch: &[outbox::Delivery<'_, Budgeted>],
    ) -> Vec<Result<(), outbox::SinkError>> {
        if self.down {
            return batch
                .iter()
                .map(|_| {
                    Err(outbox::SinkError::unavailable(
                        "the tenant's broker is down",
                    ))
                })
                .collect();
        }
        self.sink.publish(batch).await
    }
}
