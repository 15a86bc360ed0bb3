//! `outbox serve`: the dashboard. (Being built: see the session notes.)

use std::net::SocketAddr;

use sqlx::PgPool;

use crate::{Failure, fail};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    /// Show the requeue and prune buttons (protected by a per-process token).
    #[arg(long)]
    allow_writes: bool,
}

pub(crate) async fn run(_pool: PgPool, args: Args) -> Result<(), Failure> {
    Err(fail(format!(
        "the dashboard is not built yet (asked for {} with writes {})",
        args.bind, args.allow_writes
    )))
}
