//! `outbox dead` and `outbox show`: the events an operator decides about.

use std::time::Duration;

use outbox::catalog;
use serde::Serialize;
use sqlx::PgPool;

use crate::text::{Table, age, clip};
use crate::{Failure, entry, fail};

#[derive(Debug, clap::Args)]
pub(crate) struct DeadArgs {
    /// Only this table (default: every table of the catalog).
    #[arg(long)]
    table: Option<String>,
    /// At most this many events per table, oldest first.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ShowArgs {
    /// The outbox table.
    #[arg(long)]
    table: String,
    /// The event id.
    event_id: String,
    /// Print the row as JSON on one line (default: indented).
    #[arg(long)]
    json: bool,
}

/// One dead event, as `dead --json` and the dashboard's API show it.
#[derive(Debug, Serialize)]
pub(crate) struct DeadRow {
    pub(crate) table: &'static str,
    pub(crate) id: i64,
    pub(crate) event_id: String,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
    pub(crate) age_seconds: f64,
    pub(crate) key: Option<String>,
}

/// Up to `limit` dead events of each table (`table`, or every table whose catalog entry
/// is sound), oldest first, and why each other table was not read.
pub(crate) async fn dead_rows(
    pool: &PgPool,
    table: Option<&str>,
    limit: u32,
) -> Result<(Vec<DeadRow>, Vec<String>), Failure> {
    let mut skipped = Vec::new();
    let entries = if let Some(table) = table {
        vec![entry(pool, table).await?]
    } else {
        let mut sound = Vec::new();
        for entry in catalog::tables(pool).await? {
            if let Some(problem) = entry.problem() {
                skipped.push(format!("`{}` not read: {problem}", entry.table()));
            } else {
                sound.push(entry);
            }
        }
        sound
    };
    let mut rows = Vec::new();
    for entry in &entries {
        rows.extend(entry.dead(pool, limit).await?.into_iter().map(|e| DeadRow {
            table: entry.table(),
            id: e.id,
            event_id: e.event_id.as_str().to_owned(),
            attempts: e.attempts,
            last_error: e.last_error,
            age_seconds: e.age.as_secs_f64(),
            key: e.key,
        }));
    }
    Ok((rows, skipped))
}

pub(crate) async fn dead(pool: &PgPool, args: DeadArgs) -> Result<(), Failure> {
    let (rows, skipped) = dead_rows(pool, args.table.as_deref(), args.limit).await?;
    print_dead(rows, args.json)?;
    // "no dead events" must not hide a table that could not be looked at.
    if skipped.is_empty() {
        return Ok(());
    }
    for reason in &skipped {
        eprintln!("attention: {reason}");
    }
    Err(Failure::Attention)
}

fn print_dead(rows: Vec<DeadRow>, json: bool) -> Result<(), Failure> {
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no dead events");
        return Ok(());
    }
    let mut table = Table::new(&["TABLE", "EVENT ID", "ATTEMPTS", "AGE", "KEY", "LAST ERROR"]);
    for row in rows {
        table.row(vec![
            row.table.to_owned(),
            row.event_id,
            row.attempts.to_string(),
            age(Duration::from_secs_f64(row.age_seconds)),
            row.key.unwrap_or_else(|| "-".to_owned()),
            clip(row.last_error.as_deref().unwrap_or("-"), 80),
        ]);
    }
    print!("{}", table.render());
    Ok(())
}

pub(crate) async fn show(pool: &PgPool, args: ShowArgs) -> Result<(), Failure> {
    let entry = entry(pool, &args.table).await?;
    let Some(row) = entry.event(pool, &args.event_id).await? else {
        return Err(fail(format!(
            "no event `{}` in `{}`",
            args.event_id, args.table
        )));
    };
    if args.json {
        println!("{}", serde_json::to_string(&row)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&row)?);
    }
    Ok(())
}
