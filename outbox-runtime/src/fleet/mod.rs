//! A relay fleet: any number of processes that together publish the outbox tables of
//! many databases or schemas (tenants, shards), each target served by one process at
//! a time.
//!
//! # How the work is shared
//!
//! The members share a *home* database, which holds one row per target: who serves it,
//! until when, under which generation (`outbox_fleet`), and one per member alive
//! (`outbox_fleet_members`). Every third of a lease, each member says it is alive,
//! renews the leases of its targets, and takes free or expired ones up to its share
//! (the targets divided by the members alive, and no more than its connection budget
//! allows); a member holding more than its share gives the excess up, after its relay
//! for each has recorded what it had in flight. No coordinator: the rows and their
//! `FOR UPDATE SKIP LOCKED` are the agreement.
//!
//! # Fencing a member that paused
//!
//! A target's lease is fenced as an event's is: taking it bumps its generation, and a
//! renewal names the generation and succeeds only while the lease is live. Each member
//! also keeps the lease's end by its own clock, from the moment it *sent* the statement
//! that took or renewed it (less a tenth), and its relay claims nothing once that
//! moment is past: a member paused past its lease (SIGSTOP, a stalled VM) wakes up,
//! finds it over, and stops claiming before anyone else could have taken the target.
//! What it had in flight is fenced by each event's own lease and generation, as for any
//! publisher. So a target is served by one member at a time; an event may still be
//! published twice (as always: consumers deduplicate on its id).
//!
//! # Resources
//!
//! A target's relay has a pool of its own of at most
//! [`connections_per_target`](Fleet::connections_per_target) connections, opened when
//! needed and closed after 30 s unused (a quiet target keeps two: its worker's, which
//! polls, and its `LISTEN` session), and a member serves at most
//! `max_connections / connections_per_target` targets. A target whose database does not answer waits and backs off on its own
//! task; the others do not notice. If the home database does not answer, leases are
//! not renewed and every member stops claiming within a lease: the home is the fleet's
//! one shared dependency (a lease row in each target's database would avoid it at the
//! price of a connection per target per renewal).

mod leases;
mod rounds;
mod serve;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;

pub use leases::{Assignment, Member, TABLE, assignments, fleets, members, migrate};

use crate::error::OutboxError;
use crate::relay::Relay;
use crate::sink::{BoxError, Sink};
use crate::spec::Outbox;

/// One database (or schema) whose outbox table a fleet publishes: a name, unique in the
/// fleet and stable across restarts, and how to connect to it.
#[derive(Clone)]
pub struct Target {
    name: String,
    options: PgConnectOptions,
}

impl Target {
    /// The target `name`, reached with `options` (a schema per tenant: set its
    /// `search_path` with [`PgConnectOptions::options`]).
    pub fn new(name: impl Into<String>, options: PgConnectOptions) -> Self {
        Self {
            name: name.into(),
            options,
        }
    }

    /// The target `name` at `url` (`postgres://user:password@host:port/database`, with
    /// `?options=-csearch_path%3Dtenant_42` for a schema).
    pub fn from_url(name: impl Into<String>, url: &str) -> Result<Self, OutboxError> {
        let options = url
            .parse()
            .map_err(|source| OutboxError::InvalidUrl { source })?;
        Ok(Self::new(name, options))
    }

    /// Its name in the fleet.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How its relay connects to it.
    pub fn options(&self) -> &PgConnectOptions {
        &self.options
    }
}

impl fmt::Debug for Target {
    // The options hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("host", &self.options.get_host())
            .field("port", &self.options.get_port())
            .field("database", &self.options.get_database())
            .finish_non_exhaustive()
    }
}

type Discovered = Pin<Box<dyn Future<Output = Result<Vec<Target>, BoxError>> + Send>>;
type Discover = Box<dyn Fn() -> Discovered + Send + Sync>;
type MakeSink<S> = Box<dyn Fn(&Target) -> S + Send + Sync>;
type Configure<T, S> = Box<dyn Fn(Relay<T, S>) -> Relay<T, S> + Send + Sync>;

/// The members of a fleet, one per process: each publishes events of type `T` from its
/// share of the targets, through a sink `S` per target. Build it with
/// [`new`](Self::new) or [`with_sinks`](Self::with_sinks), name its targets ([`targets`](Self::targets) or
/// [`discover`](Self::discover)), then [`run`](Self::run) it; the module's
/// documentation says how the work is shared and fenced.
///
/// ```no_run
/// # use outbox_runtime::fleet::{Fleet, Target};
/// # use outbox_runtime::relay::{CancellationToken, StdoutSink};
/// # async fn run<T: outbox_runtime::Outbox + std::fmt::Debug>(home: sqlx::PgPool) -> Result<(), outbox_runtime::OutboxError> {
/// let tenants = (1..=200)
///     .map(|n| Target::from_url(format!("tenant_{n}"), &format!("postgres://app@db/tenant_{n}")))
///     .collect::<Result<Vec<_>, _>>()?;
/// Fleet::<T, _>::new(home, StdoutSink)
///     .targets(tenants)
///     .max_connections(60)
///     .relay(|relay| relay.batch_size(100))
///     .run(CancellationToken::new())
///     .await
/// # }
/// ```
#[must_use = "a fleet does nothing until `run`"]
pub struct Fleet<T, S> {
    home: PgPool,
    sink: MakeSink<S>,
    name: String,
    member: String,
    lease: Duration,
    max_connections: u32,
    connections_per_target: u32,
    discovery_interval: Duration,
    discover: Discover,
    relay: Configure<T, S>,
}

impl<T: Outbox, S: Sink<T> + Clone> Fleet<T, S> {
    /// A member of the fleet named after `T`'s table, whose leases live in `home`,
    /// publishing every target's events through a clone of `sink`: no targets yet,
    /// leases of 15 s, at most 100 connections to the targets, 2 per target, and relays
    /// as [`Relay::new`] makes them.
    pub fn new(home: PgPool, sink: S) -> Self {
        Self::with_sinks(home, move |_| sink.clone())
    }
}

impl<T: Outbox, S: Sink<T>> Fleet<T, S> {
    /// As [`new`](Self::new), with the sink of each target made by `sink` when the
    /// member starts serving it: a tenant's own subject prefix, topic or credentials.
    pub fn with_sinks(home: PgPool, sink: impl Fn(&Target) -> S + Send + Sync + 'static) -> Self {
        Self {
            home,
            sink: Box::new(sink),
            name: T::SPEC.table.to_owned(),
            member: format!("{}-{}", std::process::id(), uuid::Uuid::now_v7().simple()),
            lease: Duration::from_secs(15),
            max_connections: 100,
            connections_per_target: 2,
            discovery_interval: Duration::from_secs(30),
            discover: Box::new(|| Box::pin(async { Ok(Vec::new()) })),
            relay: Box::new(|relay| relay),
        }
    }

    /// The fleet's name in the home database (by default `T`'s table): the members of
    /// one fleet share its targets; fleets of other names (other event types) are
    /// apart.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// This member's name (by default the process id and a UUID), as the home
    /// database and [`assignments`] show it: unique among the fleet's members.
    pub fn member(mut self, name: impl Into<String>) -> Self {
        self.member = name.into();
        self
    }

    /// How long a target stays with a member that stopped renewing it (at least 1 s;
    /// renewed every third of it): how long a dead member's targets wait.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_secs(1));
        self
    }

    /// The connections this member may open to all its targets together (at least
    /// one target's worth).
    pub fn max_connections(mut self, connections: u32) -> Self {
        self.max_connections = connections;
        self
    }

    /// Each target's pool (at least 2): one per relay worker, and the one its `LISTEN`
    /// session keeps.
    pub fn connections_per_target(mut self, connections: u32) -> Self {
        self.connections_per_target = connections.max(2);
        self
    }

    /// A fixed set of targets.
    pub fn targets(self, targets: Vec<Target>) -> Self {
        self.discover(move || {
            let targets = targets.clone();
            async move { Ok(targets) }
        })
    }

    /// Targets found by `discover` (a catalog query, a service registry), called at
    /// start and every [`discovery_interval`](Self::discovery_interval): targets it
    /// adds are served from the next round, those it drops are given up. An error
    /// keeps the last set (logged).
    pub fn discover<F, Fut>(mut self, discover: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Target>, BoxError>> + Send + 'static,
    {
        self.discover = Box::new(move || Box::pin(discover()));
        self
    }

    /// How often [`discover`](Self::discover) is called (by default every 30 s; at
    /// least once a round).
    pub fn discovery_interval(mut self, interval: Duration) -> Self {
        self.discovery_interval = interval;
        self
    }

    /// Configures each target's relay (batch size, concurrency, poll interval, ...),
    /// made as [`Relay::new`] makes one but polling every 20 s: its `LISTEN` session
    /// wakes it for new events and it wakes for its own retries when due, so the poll
    /// only catches what those miss (the expired claims of a member that died, a
    /// notification lost while reconnecting), and with hundreds of targets the polls
    /// are most of the fleet's idle cost. Its pool is the fleet's: give
    /// [`connections_per_target`](Self::connections_per_target) one connection more
    /// than the relay's workers.
    pub fn relay<F>(mut self, configure: F) -> Self
    where
        F: Fn(Relay<T, S>) -> Relay<T, S> + Send + Sync + 'static,
    {
        self.relay = Box::new(configure);
        self
    }

    /// How many targets this member may serve at once.
    fn capacity(&self) -> usize {
        (self.max_connections / self.connections_per_target).max(1) as usize
    }
}

impl<T, S> fmt::Debug for Fleet<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fleet")
            .field("name", &self.name)
            .field("member", &self.member)
            .field("lease", &self.lease)
            .field("max_connections", &self.max_connections)
            .field("connections_per_target", &self.connections_per_target)
            .finish_non_exhaustive()
    }
}
