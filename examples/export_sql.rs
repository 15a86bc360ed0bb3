//! Exports the example application's outbox migrations as `.sql` files for a migration
//! tool of its own, numbered after what the directory already holds; with `--check`,
//! only checks that the directory holds every one of them, unedited (what a CI step or
//! a test of the application does).
//!
//! ```text
//! cargo run --example export_sql -- migrations/             # sqlx migrate's names
//! cargo run --example export_sql -- --flyway sql/           # Flyway's
//! cargo run --example export_sql -- --check migrations/
//! ```
//!
//! An application does the same with its own event types, in an `xtask` or a small
//! binary: only it knows them. No database is needed.

mod common;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser as _;
use common::{EmailChanged, OrderPlaced, PaymentCaptured};
use outbox::export::FileNames;

/// Writes the example event types' migrations as versioned `.sql` files.
#[derive(clap::Parser, Debug)]
#[command(name = "export_sql")]
struct Args {
    /// The migration directory (created if missing).
    dir: PathBuf,
    /// Name the files for Flyway (`V<n>__<description>.sql`) instead of sqlx migrate
    /// (`<n>_<description>.sql`).
    #[arg(long)]
    flyway: bool,
    /// Write nothing: fail unless every migration is there, byte for byte.
    #[arg(long)]
    check: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let names = if args.flyway {
        FileNames::Flyway
    } else {
        FileNames::Sqlx
    };
    let tables = [
        OrderPlaced::migrations(),
        EmailChanged::migrations(),
        PaymentCaptured::migrations(),
    ];
    let outcome = if args.check {
        outbox::export::check_migrations(&args.dir, &tables, names)
            .map(|()| println!("{}: every migration is there, unedited", args.dir.display()))
    } else {
        outbox::export::write_migrations(&args.dir, &tables, names).map(|written| {
            if written.is_empty() {
                println!("{}: nothing new to export", args.dir.display());
            }
            for path in written {
                println!("wrote {}", path.display());
            }
        })
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("export_sql: {error}");
            ExitCode::FAILURE
        }
    }
}
