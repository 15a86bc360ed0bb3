//! Opening a pool, and taking a connection from the application's pool, with an error
//! that says where and why when there is none.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, PgPool, Postgres};

use crate::error::{OnTable as _, OutboxError, sqlstate};

/// A pool of connections to the database at `url` (`postgres://user:password@host:port/
/// database`), with sqlx's default pool options: [`connect_with`] says how it fails.
///
/// ```no_run
/// # async fn run() -> Result<(), outbox_runtime::OutboxError> {
/// let url = std::env::var("DATABASE_URL").unwrap_or_default();
/// let pool = outbox_runtime::connect(&url).await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<PgPool, OutboxError> {
    let options = url
        .parse::<PgConnectOptions>()
        .map_err(|source| OutboxError::InvalidUrl { source })?;
    connect_with(PgPoolOptions::new(), options).await
}

/// A pool of `pool`'s kind, of connections made with `options`, once one connection made
/// directly succeeded: a server that is not there, or that refuses the role, its
/// password or the database, is [`OutboxError::Connect`] at once, naming
/// `host:port/database as user` and the cause (`Connection refused`, `password
/// authentication failed`, ...). sqlx's own `connect` retries until the pool's acquire
/// timeout (30 s by default) and then says only that the pool timed out. A server that
/// does not answer at all is given that timeout too.
pub async fn connect_with(
    pool: PgPoolOptions,
    options: PgConnectOptions,
) -> Result<PgPool, OutboxError> {
    let wait = pool.get_acquire_timeout();
    let failed = |source| OutboxError::Connect {
        target: String::new(),
        endpoint: endpoint(&options),
        source,
    };
    match tokio::time::timeout(wait, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
        Ok(Err(error)) => return Err(failed(error)),
        Err(_) => return Err(failed(no_answer(wait))),
    }
    // The pool opens its own connections as they are needed, from the first use on.
    Ok(pool.connect_lazy_with(options))
}

/// How long the diagnostic connection after a pool timeout may take.
const DIAGNOSIS: Duration = Duration::from_secs(5);

/// A connection from `pool`, for `target` (a table, or an operation).
///
/// When none can be opened, the error is [`OutboxError::Connect`], naming the server and
/// the cause. A pool that timed out says only that, so the cause is found by opening one
/// connection directly with the pool's options: if that succeeds, the pool was merely
/// exhausted, which is a [`OutboxError::Database`] error (transient).
pub(crate) async fn acquire(
    pool: &PgPool,
    target: &'static str,
) -> Result<PoolConnection<Postgres>, OutboxError> {
    let error = match pool.acquire().await {
        Ok(conn) => return Ok(conn),
        Err(error) => error,
    };
    let options = pool.connect_options();
    let cause = match error {
        sqlx::Error::PoolTimedOut => match diagnose(&options).await {
            None => {
                return Err(OutboxError::Database {
                    table: target,
                    source: sqlx::Error::PoolTimedOut,
                });
            }
            Some(cause) => cause,
        },
        error if is_connect_error(&error) => error,
        error => return Err(error).on_table(target),
    };
    Err(OutboxError::Connect {
        target: target.to_owned(),
        endpoint: endpoint(&options),
        source: cause,
    })
}

/// Why a direct connection fails, or `None` if it succeeds.
async fn diagnose(options: &PgConnectOptions) -> Option<sqlx::Error> {
    match tokio::time::timeout(DIAGNOSIS, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            None
        }
        Ok(Err(error)) => Some(error),
        Err(_) => Some(no_answer(DIAGNOSIS)),
    }
}

/// A connection attempt that got no answer in `wait`.
fn no_answer(wait: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no answer within {wait:?}"),
    ))
}

/// Errors of the connection phase: the network, TLS, the configuration, or the server
/// refusing the role (class `28`), the database (`3D000`) or any connection (`53300`,
/// `57P03`).
fn is_connect_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Configuration(_) => true,
        sqlx::Error::Database(_) => sqlstate(error).is_some_and(|code| {
            code.starts_with("28") || matches!(code.as_ref(), "3D000" | "53300" | "57P03")
        }),
        _ => false,
    }
}

/// `host:port/database as user`, or `socket/database as user`: where, never the password.
fn endpoint(options: &PgConnectOptions) -> String {
    let user = options.get_username();
    let database = options.get_database().unwrap_or(user);
    match options.get_socket() {
        Some(socket) => format!("{}/{database} as {user}", socket.display()),
        None => format!(
            "{}:{}/{database} as {user}",
            options.get_host(),
            options.get_port()
        ),
    }
}
