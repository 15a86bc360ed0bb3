//! What an event costs its database: WAL bytes and server CPU per event, from the enqueue
//! to the vacuum that reclaims its dead row versions. The relay in both retention modes
//! against pgmq in both, and against the INSERT alone, the limit in view.

use futures_util::future::try_join_all;
use outbox::Outbox;
use outbox_testkit::app::{BenchUnindexedDeletedEvent, BenchUnindexedEvent};
use pgmq::PGMQueueExt;
use sqlx::PgPool;

use super::cpu::{Cpu, Work};
use super::waldump::{Breakdown, WalDump};
use super::{
    Args, Bench, BenchDeletedEvent, BenchEvent, Figure, Finish, PEER_BATCH, PeerMessage, PeerQueue,
    PgmqLeftovers, Result, random_events,
};

/// Connections that enqueue (one event per transaction each), and workers that drain.
const WORKERS: usize = 4;
/// The INSERT alone: a table of the payload and a primary key, nothing else.
const INSERT_TABLE: &str = "cost_inserts";
/// One row into [`INSERT_TABLE`].
const INSERT_ONE: &str = "INSERT INTO cost_inserts (payload) VALUES ($1)";

/// Who writes and drains the events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Subject {
    Insert,
    Relay(Finish),
    /// The relay on a table without the unique index on `event_id`.
    Unindexed(Finish),
    Pgmq(Finish),
}

impl Subject {
    const ALL: [Self; 7] = [
        Self::Relay(Finish::Archive),
        Self::Relay(Finish::Delete),
        Self::Unindexed(Finish::Archive),
        Self::Unindexed(Finish::Delete),
        Self::Pgmq(Finish::Archive),
        Self::Pgmq(Finish::Delete),
        Self::Insert,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Insert => "the INSERT alone",
            Self::Relay(Finish::Archive) => "relay, SENT kept",
            Self::Relay(Finish::Delete) => "relay, `delete_sent`",
            Self::Unindexed(Finish::Archive) => "relay, SENT kept, `no_event_id_index`",
            Self::Unindexed(Finish::Delete) => "relay, `delete_sent`, `no_event_id_index`",
            Self::Pgmq(Finish::Archive) => "pgmq, read + archive",
            Self::Pgmq(Finish::Delete) => "pgmq, read + delete",
        }
    }

    /// The tables it writes, as `TRUNCATE` and `VACUUM` list them.
    fn tables(self, queue: &PeerQueue) -> String {
        match self {
            Self::Insert => INSERT_TABLE.to_owned(),
            Self::Relay(Finish::Archive) => BenchEvent::SPEC.table().to_owned(),
            Self::Relay(Finish::Delete) => BenchDeletedEvent::SPEC.table().to_owned(),
            Self::Unindexed(Finish::Archive) => BenchUnindexedEvent::SPEC.table().to_owned(),
            Self::Unindexed(Finish::Delete) => BenchUnindexedDeletedEvent::SPEC.table().to_owned(),
            Self::Pgmq(_) => queue.tables.clone(),
        }
    }
}

/// Whether a checkpoint falls between the enqueue and the drain (the drain then writes a
/// full-page image of each page it touches first), and whether those images are
/// compressed.
#[derive(Clone, Copy)]
struct Variant {
    checkpoint: bool,
    compression: bool,
}

impl Variant {
    const ALL: [Self; 3] = [
        Self {
            checkpoint: false,
            compression: false,
        },
        Self {
            checkpoint: true,
            compression: false,
        },
        Self {
            checkpoint: true,
            compression: true,
        },
    ];

    fn label(self) -> &'static str {
        match (self.checkpoint, self.compression) {
            (false, _) => "no checkpoint inside the run",
            (true, false) => "a CHECKPOINT between the enqueue and the drain",
            (true, true) => {
                "a CHECKPOINT between the enqueue and the drain, `wal_compression = lz4`"
            }
        }
    }
}

/// What one phase cost, per event: WAL bytes, and the server's CPU in µs where it can
/// be read; and where the WAL went (bytes in all), when it was asked for.
#[derive(Clone)]
struct Spent {
    wal: f64,
    server: Option<f64>,
    sources: Breakdown,
}

/// One subject's run: its enqueue, its drain (none for the INSERT alone) and the vacuum.
#[derive(Clone)]
struct Cost {
    enqueue: Spent,
    drain: Option<Spent>,
    vacuum: Spent,
    /// Events/s of the drain.
    drain_rate: Option<f64>,
}

impl Cost {
    fn wal(&self) -> f64 {
        self.enqueue.wal + self.drain.as_ref().map_or(0.0, |d| d.wal) + self.vacuum.wal
    }

    fn phases(&self) -> [Option<&Spent>; 3] {
        [Some(&self.enqueue), self.drain.as_ref(), Some(&self.vacuum)]
    }
}

impl Bench {
    /// Section 13: WAL bytes and server CPU per event, enqueue to vacuum.
    pub(super) async fn cost(&self, args: &Args, leftovers: &PgmqLeftovers) -> Result {
        self.heading("13. Cost per event: WAL and server CPU, from the enqueue to the vacuum");
        let queue = self.peer_queue(leftovers).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {INSERT_TABLE} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             payload text NOT NULL)"
        )))
        .execute(&self.pool)
        .await?;
        let tables: Vec<String> = Subject::ALL.iter().map(|s| s.tables(&queue)).collect();
        // Autovacuum would fall into some runs and not others: the vacuum is a phase.
        self.autovacuum(&tables, "SET (autovacuum_enabled = off)")
            .await?;
        let n = args.cost_events;
        self.line(&format!(
            "{n} events of 100 random bytes, each enqueued in a transaction of its own from \
             {WORKERS} connections, drained by {WORKERS} workers (batch {PEER_BATCH}), then \
             `VACUUM` of the tables written; autovacuum off on them, a CHECKPOINT before \
             each run. WAL: `pg_current_wal_insert_lsn()` before and after each phase. \
             Server CPU: the server's processes, µs per event. pgmq: {}; its `send`, \
             `read` and `archive` / `delete`. The INSERT alone: `INSERT INTO {INSERT_TABLE} \
             (payload)`, a table of the payload and an identity primary key. Medians of {} \
             runs.\n",
            queue.installed, args.runs
        ));
        let events = random_events(n, 100);
        let dump = WalDump::find(&self.pool).await;
        let mut costs = vec![vec![Vec::new(); Subject::ALL.len()]; Variant::ALL.len()];
        for run in 0..args.runs {
            for (v, &variant) in Variant::ALL.iter().enumerate() {
                let mut order: Vec<usize> = (0..Subject::ALL.len()).collect();
                if run % 2 == 1 {
                    order.reverse();
                }
                for s in order {
                    // Where the WAL went: once, in the run with full-page images.
                    let dump = dump
                        .as_ref()
                        .filter(|_| run == 0 && variant.checkpoint && !variant.compression);
                    let cost = self
                        .cost_of(Subject::ALL[s], variant, &events, &queue, dump)
                        .await?;
                    costs[v][s].push(cost);
                }
            }
        }
        for (variant, costs) in Variant::ALL.iter().zip(&costs) {
            self.cost_table(*variant, costs);
        }
        match dump {
            Some(_) => self.sources_tables(&costs[1], &queue.name, n),
            None => self.line(
                "\n(No breakdown of the WAL: the server's `pg_wal` or its `pg_waldump` \
                 cannot be reached from here.)",
            ),
        }
        self.autovacuum(&tables, "RESET (autovacuum_enabled)")
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {INSERT_TABLE}")))
            .execute(&self.pool)
            .await?;
        self.empty_queue(&queue).await
    }

    async fn autovacuum(&self, tables: &[String], change: &str) -> Result {
        for table in tables.iter().flat_map(|t| t.split(", ")) {
            sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {table} {change}")))
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    /// One run of `subject`: its tables emptied and checkpointed, then the three phases,
    /// every connection with the variant's settings.
    async fn cost_of(
        &self,
        subject: Subject,
        variant: Variant,
        events: &[BenchEvent],
        queue: &PeerQueue,
        dump: Option<&WalDump>,
    ) -> Result<Cost> {
        let tables = subject.tables(queue);
        self.reset_tables(&tables).await?;
        if let Subject::Relay(_) | Subject::Unindexed(_) = subject {
            self.set_storage(&tables).await?;
        }
        if variant.compression {
            self.session.replace(vec![("wal_compression", "lz4")]);
        }
        let cost = self
            .phases(subject, variant, events, queue, &tables, dump)
            .await;
        self.session.take();
        cost
    }

    async fn phases(
        &self,
        subject: Subject,
        variant: Variant,
        events: &[BenchEvent],
        queue: &PeerQueue,
        tables: &str,
        dump: Option<&WalDump>,
    ) -> Result<Cost> {
        let n = events.len();
        let postmaster = self.postmaster().await;
        let pool = self.pool(WORKERS).await?;
        let pgmq = PGMQueueExt::new_with_pool(pool.clone()).await;

        let start = self.wal_position().await?;
        let cpu = Cpu::now(postmaster);
        try_join_all((0..WORKERS).map(|worker| {
            let (pool, pgmq) = (&pool, &pgmq);
            async move {
                for event in events.iter().skip(worker).step_by(WORKERS) {
                    enqueue(subject, event, pool, pgmq, &queue.name).await?;
                }
                Result::<()>::Ok(())
            }
        }))
        .await?;
        let enqueue = self
            .spent(&start, per_event(&cpu, postmaster, n), n, dump)
            .await?;

        if variant.checkpoint {
            sqlx::query("CHECKPOINT").execute(&pool).await?;
        }
        let start = self.wal_position().await?;
        let drained = match subject {
            Subject::Insert => None,
            Subject::Relay(Finish::Archive) => Some(
                self.drain_filled::<BenchEvent>(n, PEER_BATCH, WORKERS)
                    .await?,
            ),
            Subject::Relay(Finish::Delete) => Some(
                self.drain_filled::<BenchDeletedEvent>(n, PEER_BATCH, WORKERS)
                    .await?,
            ),
            Subject::Unindexed(Finish::Archive) => Some(
                self.drain_filled::<BenchUnindexedEvent>(n, PEER_BATCH, WORKERS)
                    .await?,
            ),
            Subject::Unindexed(Finish::Delete) => Some(
                self.drain_filled::<BenchUnindexedDeletedEvent>(n, PEER_BATCH, WORKERS)
                    .await?,
            ),
            Subject::Pgmq(finish) => Some(self.consume_pgmq(queue, n, WORKERS, finish).await?),
        };
        let drain = match drained {
            Some((_, work)) => Some(self.spent(&start, work.map(|w| w.server), n, dump).await?),
            None => None,
        };

        let start = self.wal_position().await?;
        let cpu = Cpu::now(postmaster);
        sqlx::query(sqlx::AssertSqlSafe(format!("VACUUM {tables}")))
            .execute(&pool)
            .await?;
        let vacuum = self
            .spent(&start, per_event(&cpu, postmaster, n), n, dump)
            .await?;
        pool.close().await;
        Ok(Cost {
            enqueue,
            drain,
            vacuum,
            drain_rate: drained.map(|(rate, _)| rate),
        })
    }

    async fn wal_position(&self) -> Result<String> {
        Ok(
            sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    /// What a phase of `n` events that began at WAL position `start` cost per event,
    /// given the server's CPU per event in µs, and where its WAL went if `dump`.
    async fn spent(
        &self,
        start: &str,
        server: Option<f64>,
        n: usize,
        dump: Option<&WalDump>,
    ) -> Result<Spent> {
        let (end, bytes): (String, f64) = sqlx::query_as(
            "SELECT pg_current_wal_insert_lsn()::text, \
                    pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::float8",
        )
        .bind(start)
        .fetch_one(&self.pool)
        .await?;
        let sources = match dump {
            Some(dump) => dump.between(&self.pool, start, &end).await?,
            None => Breakdown::new(),
        };
        Ok(Spent {
            wal: bytes / n as f64,
            server,
            sources,
        })
    }

    /// Where the WAL of each subject's run went, per event and phase.
    fn sources_tables(&self, costs: &[Vec<Cost>], queue: &str, n: usize) {
        self.line(
            "\nWhere the WAL went, in the run with a CHECKPOINT between the enqueue and \
             the drain (`pg_waldump` over each phase, bytes per event; a record's \
             full-page images apart from the record):",
        );
        for (subject, runs) in Subject::ALL.iter().zip(costs) {
            let Some(cost) = runs.first() else { continue };
            let mut sources: Vec<&String> = cost
                .phases()
                .iter()
                .flatten()
                .flat_map(|spent| spent.sources.keys())
                .collect();
            sources.sort();
            sources.dedup();
            self.line(&format!(
                "\n| {} | enqueue | drain | vacuum |\n|---|---|---|---|",
                subject.label()
            ));
            for source in sources {
                // Below half a byte per event in every phase: not worth a line.
                let bytes = |spent: Option<&Spent>| {
                    spent
                        .and_then(|s| s.sources.get(source))
                        .map(|&b| b as f64 / n as f64)
                };
                if cost
                    .phases()
                    .into_iter()
                    .all(|spent| bytes(spent).is_none_or(|b| b < 0.5))
                {
                    continue;
                }
                let cells: Vec<String> = cost
                    .phases()
                    .iter()
                    .map(|spent| match spent.and_then(|s| s.sources.get(source)) {
                        Some(&bytes) => format!("{:.0}", bytes as f64 / n as f64),
                        None => String::new(),
                    })
                    .collect();
                self.line(&format!(
                    "| {} | {} |",
                    source.replace(queue, "<queue>"),
                    cells.join(" | ")
                ));
            }
        }
    }

    fn cost_table(&self, variant: Variant, costs: &[Vec<Cost>]) {
        self.line(&format!("\n{}:\n", variant.label()));
        self.line(
            "| | WAL B/event: enqueue | drain | vacuum | total | total / pgmq | enqueue / pgmq | server CPU µs/event: enqueue | drain | vacuum | drain events/s |",
        );
        self.line("|---|---|---|---|---|---|---|---|---|---|---|");
        let median = |runs: &[Cost], of: &dyn Fn(&Cost) -> Option<f64>| {
            let values: Option<Vec<f64>> = runs.iter().map(of).collect();
            values
                .filter(|v| !v.is_empty())
                .map(|v| Figure::of(v).median)
        };
        let show = |value: Option<f64>| value.map_or_else(|| "—".to_owned(), |v| format!("{v:.0}"));
        let show_cpu =
            |value: Option<f64>| value.map_or_else(|| "—".to_owned(), |v| format!("{v:.1}"));
        let index = |subject| Subject::ALL.iter().position(|&s| s == subject);
        for (subject, runs) in Subject::ALL.iter().zip(costs) {
            let total = median(runs, &|c| Some(c.wal()));
            let enqueue = median(runs, &|c| Some(c.enqueue.wal));
            let (to_total, to_enqueue) = match subject {
                Subject::Relay(finish) | Subject::Unindexed(finish) => {
                    let pgmq = &costs[index(Subject::Pgmq(*finish)).unwrap_or_default()];
                    let ratio = |ours: Option<f64>, theirs: Option<f64>| {
                        ours.zip(theirs)
                            .map_or_else(|| "—".to_owned(), |(o, t)| format!("**{:.2}**", o / t))
                    };
                    (
                        ratio(total, median(pgmq, &|c| Some(c.wal()))),
                        ratio(enqueue, median(pgmq, &|c| Some(c.enqueue.wal))),
                    )
                }
                _ => (String::new(), String::new()),
            };
            self.line(&format!(
                "| {} | {} | {} | {} | {} | {to_total} | {to_enqueue} | {} | {} | {} | {} |",
                subject.label(),
                show(enqueue),
                show(median(runs, &|c| c.drain.as_ref().map(|d| d.wal))),
                show(median(runs, &|c| Some(c.vacuum.wal))),
                show(total),
                show_cpu(median(runs, &|c| c.enqueue.server)),
                show_cpu(median(runs, &|c| c.drain.as_ref().and_then(|d| d.server))),
                show_cpu(median(runs, &|c| c.vacuum.server)),
                show(median(runs, &|c| c.drain_rate)),
            ));
        }
        let total = |subject| index(subject).and_then(|i| median(&costs[i], &|c| Some(c.wal())));
        if let (Some(insert), Some(relay), Some(unindexed)) = (
            total(Subject::Insert),
            total(Subject::Relay(Finish::Delete)),
            total(Subject::Unindexed(Finish::Delete)),
        ) {
            self.line(&format!(
                "\nEnd to end / the INSERT alone: the relay with `delete_sent` **{:.2}**, and \
                 with `no_event_id_index` too **{:.2}**.",
                relay / insert,
                unindexed / insert
            ));
        }
    }
}

/// The server's CPU since `before`, in µs per event of `n`.
fn per_event(before: &Cpu, postmaster: Option<u32>, n: usize) -> Option<f64> {
    let work: Work = Cpu::now(postmaster).work_seconds(before)?;
    Some(work.per_event(n).server)
}

/// Writes one event the way `subject` does, in a transaction of its own.
async fn enqueue(
    subject: Subject,
    event: &BenchEvent,
    pool: &PgPool,
    pgmq: &PGMQueueExt,
    queue: &str,
) -> Result {
    match subject {
        Subject::Insert => {
            sqlx::query(INSERT_ONE)
                .bind(&event.payload)
                .execute(pool)
                .await?;
        }
        Subject::Relay(Finish::Archive) => {
            outbox::table::enqueue(event, pool).await?;
        }
        Subject::Relay(Finish::Delete) => {
            outbox::table::enqueue(&BenchDeletedEvent::from(event), pool).await?;
        }
        Subject::Unindexed(Finish::Archive) => {
            outbox::table::enqueue(&BenchUnindexedEvent::from(event), pool).await?;
        }
        Subject::Unindexed(Finish::Delete) => {
            outbox::table::enqueue(&BenchUnindexedDeletedEvent::from(event), pool).await?;
        }
        Subject::Pgmq(_) => {
            let message = PeerMessage {
                payload: event.payload.clone(),
            };
            pgmq.send(queue, &message).await?;
        }
    }
    Ok(())
}
