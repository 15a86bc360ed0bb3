//! Test support: a PostgreSQL database for tests, and a fresh schema per test.
//!
//! [`database_url`] uses `DATABASE_URL` when it is set. Otherwise it starts one throwaway
//! PostgreSQL cluster per process (in a temporary directory, from the server binaries found via
//! `pg_config`, `/usr/lib/postgresql/*/bin` or `initdb` on `PATH`), shared by every test in the
//! binary.
//!
//! # Cleaning up
//!
//! When the process exits normally (`main` returns or calls [`std::process::exit`], which is
//! how a test binary ends, failed tests included), every throwaway cluster it started is shut
//! down and its directory removed. A process killed by a signal (Ctrl-C, SIGKILL, an abort)
//! cannot clean up after itself: on Linux the kernel still stops its server (a parent-death
//! signal), but the directory stays in the temporary directory until the next cluster start, in
//! any process, removes the leftovers of processes that are gone.
//!
//! [`TestSchema`] creates a uniquely named schema in that database, with a pool whose
//! connections all use it as their `search_path`, so tests can run concurrently without seeing
//! each other's tables.
//!
//! A test that must own its server (to restart it mid-run) starts a dedicated [`Cluster`] and
//! creates its schema there with [`TestSchema::new_in`].

mod cluster;
mod schema;

pub use cluster::Cluster;
pub use schema::TestSchema;

use std::time::Duration;
use std::{env, io};

use tokio::sync::OnceCell;

/// How long pools wait for a connection, and how long a new cluster may take to accept one.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Why test support could not provide a database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestSupportError {
    /// `DATABASE_URL` is not set and no PostgreSQL server binaries were found.
    #[error(
        "DATABASE_URL is not set and no PostgreSQL server binaries were found \
         (tried `pg_config --bindir`, /usr/lib/postgresql/*/bin and `initdb` on PATH): \
         install the PostgreSQL server binaries or set DATABASE_URL"
    )]
    NoPostgres,
    /// The throwaway cluster could not be created or did not start.
    #[error("throwaway PostgreSQL cluster: {message}")]
    Cluster {
        /// What went wrong, including the output of `initdb` or the server log where relevant.
        message: String,
    },
    /// A file system or process operation failed while setting up the throwaway cluster.
    #[error("throwaway PostgreSQL cluster: {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Connecting to the database or running a statement failed.
    #[error("test database: {0}")]
    Database(#[from] sqlx::Error),
}

impl TestSupportError {
    fn cluster(message: impl Into<String>) -> Self {
        Self::Cluster {
            message: message.into(),
        }
    }

    fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let context = context.into();
        |source| Self::Io { context, source }
    }
}

/// The throwaway cluster's URL. A tokio `OnceCell` is not tied to a runtime, so each
/// `#[tokio::test]` may ask from its own: the first caller starts the cluster, the others wait.
/// A static is never dropped: the shared server is stopped and its directory removed by
/// the cluster's exit hooks when the process exits.
static CLUSTER: OnceCell<Cluster> = OnceCell::const_new();

/// The base URL in use (`DATABASE_URL` or the throwaway cluster), starting the cluster if needed.
pub async fn database_url() -> Result<String, TestSupportError> {
    if let Ok(url) = env::var("DATABASE_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    let cluster = CLUSTER.get_or_try_init(Cluster::start).await?;
    Ok(cluster.url().to_owned())
}

fn timed_out() -> sqlx::Error {
    sqlx::Error::Io(io::ErrorKind::TimedOut.into())
}
