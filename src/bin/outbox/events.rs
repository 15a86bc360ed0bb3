//! `outbox dead` and `outbox show`: the events an operator decides about.

use outbox::catalog;
use serde_json::json;
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

pub(crate) async fn dead(pool: &PgPool, args: DeadArgs) -> Result<(), Failure> {
    let entries = match &args.table {
        Some(table) => vec![entry(pool, table).await?],
        None => catalog::tables(pool)
            .await?
            .into_iter()
            .filter(|e| e.problem().is_none())
            .collect(),
    };
    let mut listed = Vec::new();
    for entry in &entries {
        for event in entry.dead(pool, args.limit).await? {
            listed.push((entry.table(), event));
        }
    }
    if args.json {
        let rows: Vec<_> = listed
            .iter()
            .map(|(table, e)| {
                json!({
                    "table": table,
                    "id": e.id,
                    "event_id": e.event_id.as_str(),
                    "attempts": e.attempts,
                    "last_error": e.last_error,
                    "age_seconds": e.age.as_secs_f64(),
                    "key": e.key,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if listed.is_empty() {
        println!("no dead events");
        return Ok(());
    }
    let mut table = Table::new(&["TABLE", "EVENT ID", "ATTEMPTS", "AGE", "KEY", "LAST ERROR"]);
    for (name, e) in &listed {
        table.row(vec![
            (*name).to_owned(),
            e.event_id.as_str().to_owned(),
            e.attempts.to_string(),
            age(e.age),
            e.key.clone().unwrap_or_else(|| "-".to_owned()),
            clip(e.last_error.as_deref().unwrap_or("-"), 80),
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
