//! `outbox fleet`: the relay fleets whose leases this database keeps (it is their home):
//! the members alive, and which member serves each target.

use outbox::OutboxError;
use outbox::fleet;
use sqlx::PgPool;

use crate::Failure;
use crate::text::{Table, maybe_age};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only this fleet (default: every fleet this database keeps).
    #[arg(long)]
    name: Option<String>,
}

/// Prints each fleet; needs attention when a target is served by no member.
pub(crate) async fn run(pool: &PgPool, args: Args) -> Result<(), Failure> {
    let names = match args.name {
        Some(name) => vec![name],
        None => match fleet::fleets(pool).await {
            Ok(names) => names,
            // The first member creates the table (or `outbox::fleet::migrate`).
            Err(OutboxError::MissingTable { .. }) => Vec::new(),
            Err(error) => return Err(error.into()),
        },
    };
    if names.is_empty() {
        eprintln!(
            "no relay fleet keeps its leases in this database (its `{}` table is empty or not there)",
            fleet::TABLE
        );
        return Err(Failure::Attention);
    }
    let mut unserved = Vec::new();
    for name in names {
        let members = fleet::members(pool, &name).await?;
        let assignments = fleet::assignments(pool, &name).await?;
        println!("fleet {name}");
        let alive: Vec<String> = members
            .iter()
            .map(|m| match m.alive_for {
                Some(left) => format!("{} (alive, {} left)", m.name, maybe_age(Some(left))),
                None => format!("{} (missed its heartbeat)", m.name),
            })
            .collect();
        println!(
            "members: {}",
            if alive.is_empty() {
                "none".to_owned()
            } else {
                alive.join(", ")
            }
        );
        let mut table = Table::new(&[
            "TARGET",
            "MEMBER",
            "GENERATION",
            "LEASE LEFT",
            "SERVED FOR",
            "OLDEST DUE",
        ]);
        for a in &assignments {
            if a.owner.is_none() {
                unserved.push(format!("{name}/{}", a.target));
            }
            table.row(vec![
                a.target.clone(),
                a.owner.clone().unwrap_or_else(|| "-".to_owned()),
                a.generation.to_string(),
                maybe_age(a.lease_left),
                maybe_age(a.served_for),
                // As its member last saw it, within a lease.
                match a.observed {
                    None => "?".to_owned(),
                    Some(_) => maybe_age(a.oldest_due),
                },
            ]);
        }
        print!("{}", table.render());
        println!();
    }
    if unserved.is_empty() {
        return Ok(());
    }
    eprintln!("served by no member: {}", unserved.join(", "));
    Err(Failure::Attention)
}
