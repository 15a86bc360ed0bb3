//! `outbox requeue`, `discard` and `prune`: the library's guarded statements, each
//! with a dry run that says what would change, and a confirmation for bulk changes.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::Duration;

use outbox::catalog::CatalogEntry;
use sqlx::PgPool;

use crate::{Failure, entry, fail};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["event_ids", "all"])))]
pub(crate) struct RequeueArgs {
    /// The outbox table.
    #[arg(long)]
    table: String,
    /// The dead events to requeue, by event id.
    event_ids: Vec<String>,
    /// Every dead event of the table (asks for confirmation).
    #[arg(long)]
    all: bool,
    /// Say what would change, and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct DiscardArgs {
    /// The outbox table.
    #[arg(long)]
    table: String,
    /// The dead events to delete, by event id.
    #[arg(required = true)]
    event_ids: Vec<String>,
    /// Say what would change, and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
}

#[derive(Debug, clap::Args)]
pub(crate) struct PruneArgs {
    /// The outbox table.
    #[arg(long)]
    table: String,
    /// Delete SENT events published longer ago than this (e.g. 7d, 12h).
    #[arg(long, value_name = "AGE", value_parser = humantime::parse_duration)]
    older_than: Duration,
    /// Rows per transaction.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Say what would change, and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short)]
    yes: bool,
}

pub(crate) async fn requeue(pool: &PgPool, args: RequeueArgs) -> Result<(), Failure> {
    let entry = entry(pool, &args.table).await?;
    let table = entry.table();
    if args.all {
        // What `--all` would requeue, counted by the statement itself, rolled back.
        let mut tx = pool.begin().await?;
        let count = entry.requeue_all_dead(&mut *tx).await?;
        tx.rollback().await?;
        if args.dry_run || count == 0 {
            println!("would requeue {count} dead event(s) of {table}");
            return Ok(());
        }
        confirm(
            &format!("Requeue all {count} dead event(s) of {table}?"),
            args.yes,
        )?;
        // As many as were confirmed, or nothing: events that died while the operator read
        // the question were not counted in it.
        let requeued = entry.requeue_all_dead_confirmed(pool, count).await?;
        if requeued != count {
            return Err(fail(format!(
                "{table} has {requeued} dead event(s) now, not the {count} confirmed; nothing \
                 was requeued: run the command again"
            )));
        }
        println!("requeued {requeued} dead event(s) of {table}");
        return Ok(());
    }
    let changed = if args.dry_run {
        let mut tx = pool.begin().await?;
        let would = entry.requeue_dead(&mut *tx, &args.event_ids).await?;
        tx.rollback().await?;
        would
    } else {
        entry.requeue_dead(pool, &args.event_ids).await?
    };
    report(&entry, "requeue", args.dry_run, &args.event_ids, &changed)
}

pub(crate) async fn discard(pool: &PgPool, args: DiscardArgs) -> Result<(), Failure> {
    let entry = entry(pool, &args.table).await?;
    let mut tx = pool.begin().await?;
    let would = entry.discard_dead(&mut *tx, &args.event_ids).await?;
    tx.rollback().await?;
    if args.dry_run || would.is_empty() {
        return report(&entry, "discard", args.dry_run, &args.event_ids, &would);
    }
    confirm(
        &format!(
            "Delete {} dead event(s) of {} for good?",
            would.len(),
            entry.table()
        ),
        args.yes,
    )?;
    let discarded = entry.discard_dead(pool, &args.event_ids).await?;
    report(&entry, "discard", false, &args.event_ids, &discarded)
}

/// What a change by event ids did (or would do), and which ids it left alone: exit
/// code 3 when it left any alone, so that a script sees that not everything it named
/// changed (a typo, an event no longer `DEAD`).
fn report(
    entry: &CatalogEntry,
    verb: &str,
    dry_run: bool,
    asked: &[String],
    changed: &[outbox::EventId],
) -> Result<(), Failure> {
    let table = entry.table();
    let done = if dry_run {
        format!("would {verb}")
    } else {
        past(verb)
    };
    println!("{done} {} event(s) of {table}", changed.len());
    for id in changed {
        println!("  {}", id.as_str());
    }
    let left: Vec<&String> = asked
        .iter()
        .filter(|id| !changed.iter().any(|c| c.as_str() == id.as_str()))
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    println!("left alone (not DEAD now, or no such event):");
    for id in &left {
        println!("  {id}");
    }
    eprintln!(
        "attention: {} of the {} event id(s) named {}",
        left.len(),
        asked.len(),
        if dry_run {
            "would be left alone"
        } else {
            "were left alone"
        }
    );
    Err(Failure::Attention)
}

fn past(verb: &str) -> String {
    match verb {
        "requeue" => "requeued".to_owned(),
        "discard" => "discarded".to_owned(),
        other => format!("{other}ed"),
    }
}

pub(crate) async fn prune(pool: &PgPool, args: PruneArgs) -> Result<(), Failure> {
    let entry = entry(pool, &args.table).await?;
    let table = entry.table();
    let age = humantime::format_duration(args.older_than);
    // Counting reads every row of the table, which on the tables that most need a prune
    // can outlast the statement timeout: with --yes there is nobody to show it to.
    let due = if args.yes && !args.dry_run {
        None
    } else {
        Some(entry.count_prunable(pool, args.older_than).await?)
    };
    if let Some(due) = due
        && (args.dry_run || due == 0)
    {
        println!("would delete {due} SENT event(s) of {table} published more than {age} ago");
        return Ok(());
    }
    if let Some(due) = due {
        confirm(
            &format!("Delete {due} SENT event(s) of {table} published more than {age} ago?"),
            args.yes,
        )?;
    }
    let progress = std::io::stderr().is_terminal();
    let mut total = 0;
    loop {
        let pruned = entry.prune_sent(pool, args.older_than, args.batch).await?;
        total += pruned;
        if progress {
            match due {
                Some(due) => eprint!("\rdeleted {total} of about {due}"),
                None => eprint!("\rdeleted {total}"),
            }
        }
        // A short batch ends it (under steady traffic, rows keep coming of age: waiting
        // for an empty one might never end); rows another prune held are left to it.
        if pruned < u64::from(args.batch) {
            break;
        }
    }
    if progress {
        eprintln!();
    }
    println!("deleted {total} SENT event(s) of {table}");
    Ok(())
}

/// Asks on the terminal; without one, only `--yes` confirms.
fn confirm(question: &str, yes: bool) -> Result<(), Failure> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(fail(format!(
            "{question} Refused: confirm with --yes (stdin is not a terminal to ask on)"
        )));
    }
    print!("{question} [y/N] ");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(fail("cancelled; nothing changed"))
    }
}
