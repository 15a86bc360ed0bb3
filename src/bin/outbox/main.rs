//! `outbox`: the operator's command line for the outbox tables of a database.
//!
//! It needs none of the application's Rust types: `outbox::migrate` keeps a catalog of
//! every outbox table in the schema (its settings and its guarded repair statements),
//! and every command starts from there.

mod events;
mod fleet;
mod repair;
mod serve;
mod status;
mod text;

use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use clap::{Parser, Subcommand};
use outbox::catalog::{self, CatalogEntry, Roles};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Inspect and repair the PostgreSQL outbox tables of a database.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, after_help = EXIT_CODES)]
struct Cli {
    /// The database, as a PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    /// The schema of the outbox tables (default: the connection's search_path).
    #[arg(long, global = true)]
    schema: Option<String>,

    /// How long the server lets any one statement run before cancelling it: `0` is no
    /// limit, any other at least 1 ms (a shorter one is rounded up). Counting a very
    /// large table, or pruning, should not weigh on the application's database for
    /// longer.
    #[arg(long, value_name = "DURATION", default_value = "30s", global = true,
          value_parser = humantime::parse_duration)]
    statement_timeout: Duration,

    #[command(subcommand)]
    command: Command,
}

const EXIT_CODES: &str = "\
Exit codes:
  0  done; for `status`: nothing needs attention
  1  an error (the database, a table, a refused change)
  2  a usage error
  3  something needs attention: for `status`, a table (dead rows, an event waiting
     longer than --max-age since its enqueue, a catalog entry that does not match its table, or no
     outbox table at all; a `status --watch` ends with 0 on Ctrl-C, its attention
     lines on stdout); for `dead`, a table it could not read; for `requeue` and
     `discard` by id, ids left alone (not DEAD, or no such event); for `fleet`, a
     target served by no member, or no fleet at all";

#[derive(Debug, Subcommand)]
enum Command {
    /// Every outbox table: counts per status, due backlog, the oldest waiting event's
    /// age since its enqueue (and why it waits), expired claims, dead rows, sent in the
    /// last minute.
    Status(status::Args),
    /// The dead events, with their attempts, error and age.
    Dead(events::DeadArgs),
    /// One event's row, payload included.
    Show(events::ShowArgs),
    /// Put dead events back to READY with a fresh attempt budget.
    Requeue(repair::RequeueArgs),
    /// Delete dead events for good (lets a blocked ordering key go on without them).
    Discard(repair::DiscardArgs),
    /// Delete SENT events published more than an age ago, in batches.
    Prune(repair::PruneArgs),
    /// The least-privilege GRANT statements for a table's three roles.
    Grants(GrantsArgs),
    /// A dashboard in the browser, with a JSON API (read-only unless --allow-writes).
    Serve(serve::Args),
    /// The relay fleets whose leases this database keeps: members alive, which member
    /// serves each target, and how long each target's oldest due event has waited.
    Fleet(fleet::Args),
}

impl Command {
    /// Whether it keeps going while the database does not answer, saying so (`serve`,
    /// `status --watch`): it starts without one.
    fn rides_out_a_lost_database(&self) -> bool {
        match self {
            Self::Serve(_) => true,
            Self::Status(args) => args.watches(),
            _ => false,
        }
    }
}

#[derive(Debug, clap::Args)]
struct GrantsArgs {
    /// The outbox table.
    #[arg(long)]
    table: String,
    /// The role the application enqueues as.
    #[arg(long, default_value = "outbox_application")]
    application_role: String,
    /// The role the relay runs as.
    #[arg(long, default_value = "outbox_relay")]
    relay_role: String,
    /// The role operators run this command as.
    #[arg(long, default_value = "outbox_operator")]
    operator_role: String,
}

/// A failure, as the command reports it.
#[derive(Debug)]
enum Failure {
    /// Exit code 1: the message, and its causes.
    Error(Box<dyn std::error::Error + Send + Sync>),
    /// Exit code 3: something needs attention (what, on stderr).
    Attention,
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for Failure {
    fn from(error: E) -> Self {
        Self::Error(Box::new(error))
    }
}

/// A plain error message.
#[derive(Debug)]
struct Message(String);

impl std::fmt::Display for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Message {}

/// An interval between repeated reads of every table (`status --watch`, `serve
/// --sample-every`): at least 100ms, since each read counts every table.
fn parse_every(text: &str) -> Result<Duration, String> {
    let interval = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if interval < Duration::from_millis(100) {
        return Err("at least 100ms: every read counts every table".to_owned());
    }
    Ok(interval)
}

fn fail(message: impl Into<String>) -> Failure {
    Failure::from(Message(message.into()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => return report(&Failure::from(e)),
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => report(&failure),
    }
}

fn report(failure: &Failure) -> ExitCode {
    match failure {
        Failure::Attention => ExitCode::from(3),
        Failure::Error(error) => {
            let mut said = error.to_string();
            eprintln!("error: {said}");
            // Most messages already end with their cause (`..: Connection refused`): a
            // cause is printed only when it says something new.
            let mut source = error.source();
            while let Some(cause) = source {
                let text = cause.to_string();
                if !said.contains(&text) {
                    eprintln!("  caused by: {text}");
                    said.push_str(&text);
                }
                source = cause.source();
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let (pool, session) = connect(
        cli.database_url.as_deref(),
        cli.schema.as_deref(),
        cli.statement_timeout,
        cli.command.rides_out_a_lost_database(),
    )
    .await?;
    session.check(&pool).await?;
    let result = match cli.command {
        Command::Status(args) => status::run(&pool, args).await,
        Command::Dead(args) => events::dead(&pool, args).await,
        Command::Show(args) => events::show(&pool, args).await,
        Command::Requeue(args) => repair::requeue(&pool, args).await,
        Command::Discard(args) => repair::discard(&pool, args).await,
        Command::Prune(args) => repair::prune(&pool, args).await,
        Command::Grants(args) => grants(&pool, &args).await,
        Command::Serve(args) => serve::run(pool.clone(), args).await,
        Command::Fleet(args) => fleet::run(&pool, args).await,
    };
    pool.close().await;
    result
}

/// A small pool, once a first connection made directly succeeded (a refused one is
/// reported at once, with where and why), or, for a command that `rides_out` a database
/// that does not answer, a pool that connects when it is first used; and the settings
/// its sessions must have.
async fn connect(
    url: Option<&str>,
    schema: Option<&str>,
    statement_timeout: Duration,
    rides_out: bool,
) -> Result<(PgPool, Session), Failure> {
    let url = url.ok_or_else(|| {
        fail("no database: pass --database-url or set DATABASE_URL (postgres://user@host/db)")
    })?;
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(fail(
            "invalid database URL: expected postgres://user@host:port/database",
        ));
    }
    let timeout = outbox::ops::statement_timeout_millis(statement_timeout).to_string();
    let mut options = PgConnectOptions::from_str(url)
        .map_err(|e| fail(format!("invalid database URL: {e}")))?
        .application_name("outbox-cli")
        .options([("statement_timeout", timeout.as_str())]);
    if let Some(schema) = schema {
        options = options.options([("search_path", schema)]);
    }
    let pool_options = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3));
    let pool = if rides_out {
        pool_options.connect_lazy_with(options)
    } else {
        outbox::connect_with(pool_options, options).await?
    };
    let session = Session {
        search_path: schema.map(str::to_owned),
        statement_timeout: timeout,
    };
    Ok((pool, session))
}

/// The session settings the command line asks for in the connection's startup options.
/// A connection pooler may refuse those options, or be told to ignore them (PgBouncer's
/// `ignore_startup_parameters`): a first session checks they took, so that `--schema`
/// never silently means the default schema's tables.
struct Session {
    search_path: Option<String>,
    statement_timeout: String,
}

impl Session {
    async fn check(&self, pool: &PgPool) -> Result<(), Failure> {
        // No connection: the command reports why, where and as whom.
        let Ok(mut conn) = pool.acquire().await else {
            return Ok(());
        };
        let (search_path, timeout, schema): (String, String, Option<String>) = sqlx::query_as(
            "SELECT current_setting('search_path'), \
                    (SELECT setting FROM pg_settings WHERE name = 'statement_timeout'), \
                    current_schema()",
        )
        .fetch_one(&mut *conn)
        .await?;
        let refused = |what: String| {
            Err(fail(format!(
                "{what}: the server (or a connection pooler between) did not apply the \
                 connection's startup options; connect to PostgreSQL directly"
            )))
        };
        if let Some(wanted) = &self.search_path {
            if search_path != *wanted {
                return refused(format!(
                    "--schema {wanted}: the session's search_path is `{search_path}`"
                ));
            }
            if schema.is_none() {
                return Err(fail(format!(
                    "--schema {wanted}: no such schema in this database"
                )));
            }
        }
        if timeout != self.statement_timeout {
            return refused(format!(
                "--statement-timeout: the session's statement_timeout is {timeout} ms, not {} ms",
                self.statement_timeout
            ));
        }
        Ok(())
    }
}

/// The catalog entry of `table`, refused when it does not match its table.
async fn entry(pool: &PgPool, table: &str) -> Result<CatalogEntry, Failure> {
    let entry = catalog::table(pool, table).await?;
    if let Some(problem) = entry.problem() {
        return Err(fail(format!("`{table}`: {problem}")));
    }
    Ok(entry)
}

async fn grants(pool: &PgPool, args: &GrantsArgs) -> Result<(), Failure> {
    let entry = catalog::table(pool, &args.table).await?;
    print!(
        "{}",
        entry.grants(&Roles {
            application: args.application_role.clone(),
            relay: args.relay_role.clone(),
            operator: args.operator_role.clone(),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `--statement-timeout` sets on the sessions, and checks they have.
    #[tokio::test]
    async fn a_statement_timeout_shorter_than_a_millisecond_is_one_not_none() {
        // A pool that connects when first used (`rides_out`): nothing connects here.
        let session = async |timeout| {
            let (_, session) = connect(
                Some("postgres://outbox@127.0.0.1/outbox"),
                None,
                timeout,
                true,
            )
            .await
            .expect("a valid URL");
            session.statement_timeout
        };
        assert_eq!(session(Duration::ZERO).await, "0", "no limit");
        assert_eq!(session(Duration::from_micros(500)).await, "1");
        assert_eq!(session(Duration::from_secs(30)).await, "30000");
        assert_eq!(
            session(Duration::from_hours(100 * 24)).await,
            "2147483647",
            "the longest the server takes"
        );
    }
}
