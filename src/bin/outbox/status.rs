//! `outbox status`: every table of the catalog, with its signals.

use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use outbox::catalog::{self, CatalogEntry};
use serde::Serialize;
use sqlx::PgPool;

use crate::Failure;
use crate::text::{Table, age, maybe_age};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Refresh in place every INTERVAL (default 2s) until interrupted.
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
          value_parser = crate::parse_every)]
    watch: Option<Duration>,
    /// Exit with 3 when a table's oldest waiting event (READY or IN PROGRESS) was enqueued
    /// longer ago than this (e.g. 5m).
    #[arg(long, value_name = "AGE", value_parser = humantime::parse_duration)]
    max_age: Option<Duration>,
}

impl Args {
    /// Whether it refreshes until interrupted.
    pub(crate) fn watches(&self) -> bool {
        self.watch.is_some()
    }
}

/// One table's state: its catalog entry's settings and its live signals.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TableStatus {
    pub(crate) table: String,
    pub(crate) schema: String,
    pub(crate) type_name: String,
    pub(crate) version: i32,
    pub(crate) lease_seconds: f64,
    pub(crate) max_attempts: i32,
    pub(crate) key: Option<String>,
    pub(crate) ready: i64,
    pub(crate) due: i64,
    /// Enqueued for a later time that has not come: neither backlog nor lag.
    pub(crate) scheduled: i64,
    pub(crate) in_progress: i64,
    pub(crate) expired_claims: i64,
    pub(crate) dead: i64,
    pub(crate) sent: i64,
    /// `None` for a table that deletes its sent rows.
    pub(crate) sent_last_minute: Option<i64>,
    /// Since the enqueue of the oldest event still to be published (`READY` or
    /// `INPROGRESS`); `None` when none is.
    pub(crate) oldest_waiting_age_seconds: Option<f64>,
    /// That event's `last_error`: why it still waits, once a relay tried it.
    pub(crate) oldest_waiting_error: Option<String>,
    pub(crate) held_keys: i64,
    pub(crate) oldest_held_age_seconds: Option<f64>,
    /// Why the catalog entry cannot be trusted, or the table's counts could not be read;
    /// the counts are zero then.
    pub(crate) problem: Option<String>,
}

/// The entry's stats, read in a read-only transaction: the statement is the catalog's
/// text, and whoever could edit the catalog must not make a status read write.
async fn read_only_stats(
    pool: &PgPool,
    entry: &CatalogEntry,
) -> Result<outbox::Stats, Box<dyn std::error::Error + Send + Sync>> {
    let mut tx = pool.begin_with("BEGIN READ ONLY").await?;
    let stats = entry.stats(&mut *tx).await?;
    tx.commit().await?;
    Ok(stats)
}

impl TableStatus {
    async fn read(pool: &PgPool, entry: &CatalogEntry) -> Self {
        // One table that cannot be read (no grants yet, a statement timeout on a huge
        // table) is that table's problem: the others are still reported.
        let (stats, problem) = match entry.problem() {
            Some(problem) => (outbox::Stats::default(), Some(problem.to_owned())),
            None => match read_only_stats(pool, entry).await {
                Ok(stats) => (stats, None),
                Err(error) => (
                    outbox::Stats::default(),
                    Some(format!("cannot read its counts: {error}")),
                ),
            },
        };
        Self {
            table: entry.table().to_owned(),
            schema: entry.schema().to_owned(),
            type_name: entry.type_name().to_owned(),
            version: entry.version(),
            lease_seconds: entry.lease().as_secs_f64(),
            max_attempts: entry.max_attempts(),
            key: entry.key().map(str::to_owned),
            ready: stats.ready,
            due: stats.due,
            scheduled: stats.scheduled,
            in_progress: stats.in_progress,
            expired_claims: stats.expired_claims,
            dead: stats.dead,
            sent: stats.sent,
            sent_last_minute: if entry.deletes_sent() {
                None
            } else {
                stats.sent_last_minute
            },
            oldest_waiting_age_seconds: stats.oldest_waiting_age.map(|d| d.as_secs_f64()),
            oldest_waiting_error: stats.oldest_waiting_error,
            held_keys: stats.held_keys,
            oldest_held_age_seconds: stats.oldest_held_age.map(|d| d.as_secs_f64()),
            problem,
        }
    }

    fn oldest(&self) -> Option<Duration> {
        self.oldest_waiting_age_seconds.map(Duration::from_secs_f64)
    }

    /// What the table says of why its oldest waiting event still waits.
    fn why_waiting(&self) -> String {
        match &self.oldest_waiting_error {
            Some(error) => format!("its last error: {error}"),
            None => "no failure recorded for it: no relay has tried it yet (is one running, \
                     and keeping up?)"
                .to_owned(),
        }
    }

    /// Why an operator should look at this table now, if at all.
    pub(crate) fn attention(&self, max_age: Option<Duration>) -> Vec<String> {
        let mut reasons = Vec::new();
        if let Some(problem) = &self.problem {
            reasons.push(format!("{}: {problem}", self.table));
        }
        if self.dead > 0 {
            reasons.push(format!(
                "{}: {} dead event(s){} (outbox dead --table {})",
                self.table,
                self.dead,
                if self.held_keys > 0 {
                    format!(", holding back {} ordering key(s)", self.held_keys)
                } else {
                    String::new()
                },
                self.table
            ));
        }
        if let (Some(max), Some(oldest)) = (max_age, self.oldest())
            && oldest > max
        {
            reasons.push(format!(
                "{}: the oldest waiting event was enqueued {} ago, over --max-age {}; {}",
                self.table,
                age(oldest),
                humantime::format_duration(max),
                self.why_waiting()
            ));
        }
        reasons
    }
}

/// The status of every table in the catalog.
pub(crate) async fn collect(pool: &PgPool) -> Result<Vec<TableStatus>, Failure> {
    let mut tables = Vec::new();
    for entry in catalog::tables(pool).await? {
        tables.push(TableStatus::read(pool, &entry).await);
    }
    Ok(tables)
}

const NO_TABLES: &str = "no outbox tables in the catalog of this schema: outbox::migrate has not \
                         run here (or --schema names another schema)";

pub(crate) async fn run(pool: &PgPool, args: Args) -> Result<(), Failure> {
    let Some(interval) = args.watch else {
        let tables = collect(pool).await?;
        print(&tables, args.json)?;
        let mut reasons: Vec<String> = tables
            .iter()
            .flat_map(|t| t.attention(args.max_age))
            .collect();
        if tables.is_empty() {
            // A mistyped --schema must not read as a healthy outbox to a cron check.
            reasons.push(NO_TABLES.to_owned());
        }
        if reasons.is_empty() {
            return Ok(());
        }
        for reason in &reasons {
            eprintln!("attention: {reason}");
        }
        return Err(Failure::Attention);
    };
    let clear = std::io::stdout().is_terminal() && !args.json;
    let mut ticks = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
        let tables = match collect(pool).await {
            Ok(tables) => tables,
            // A failover or a restart: the watch says so and reads again next tick.
            Err(Failure::Error(error))
                if error
                    .downcast_ref::<outbox::OutboxError>()
                    .is_some_and(outbox::OutboxError::is_transient) =>
            {
                println!(
                    "error: {error} (reading again in {})",
                    humantime::format_duration(interval)
                );
                std::io::stdout().flush()?;
                continue;
            }
            Err(failure) => return Err(failure),
        };
        if clear {
            // Home and clear, so the table refreshes in place.
            print!("\x1b[H\x1b[2J");
            println!(
                "outbox status, every {} (Ctrl-C to stop)\n",
                humantime::format_duration(interval)
            );
        }
        print(&tables, args.json)?;
        for reason in tables.iter().flat_map(|t| t.attention(args.max_age)) {
            println!("attention: {reason}");
        }
        std::io::stdout().flush()?;
    }
}

fn print(tables: &[TableStatus], json: bool) -> Result<(), Failure> {
    if json {
        println!("{}", serde_json::to_string_pretty(tables)?);
        return Ok(());
    }
    if tables.is_empty() {
        println!("{NO_TABLES}");
        return Ok(());
    }
    let mut table = Table::new(&[
        "TABLE",
        "TYPE",
        "READY",
        "DUE",
        "SCHEDULED",
        "IN PROGRESS",
        "EXPIRED",
        "DEAD",
        "SENT",
        "SENT/MIN",
        "OLDEST",
        "HELD KEYS",
    ]);
    for t in tables {
        if t.problem.is_some() {
            table.row(vec![
                t.table.clone(),
                short_type(&t.type_name),
                "?".to_owned(),
            ]);
            continue;
        }
        table.row(vec![
            t.table.clone(),
            short_type(&t.type_name),
            t.ready.to_string(),
            t.due.to_string(),
            t.scheduled.to_string(),
            t.in_progress.to_string(),
            t.expired_claims.to_string(),
            t.dead.to_string(),
            t.sent.to_string(),
            t.sent_last_minute
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            maybe_age(t.oldest()),
            if t.key.is_some() {
                t.held_keys.to_string()
            } else {
                "-".to_owned()
            },
        ]);
    }
    print!("{}", table.render());
    // An outage (or any failure the relay rides out) shows here: the relay writes why
    // it handed events back in their `last_error`.
    for t in tables.iter().filter(|t| t.problem.is_none()) {
        if let (Some(oldest), Some(error)) = (t.oldest(), &t.oldest_waiting_error) {
            println!(
                "{}: the oldest waiting event, enqueued {} ago, last failed: {error}",
                t.table,
                age(oldest)
            );
        }
    }
    Ok(())
}

/// The type's name without its module path: the table already says where it lives.
fn short_type(type_name: &str) -> String {
    type_name
        .rsplit("::")
        .next()
        .unwrap_or(type_name)
        .to_owned()
}
