//! A relay that cannot run stops with an error that says where and why: a missing table,
//! a lost column, a refused connection, a role without the privilege.

use std::time::Duration;

use outbox::OutboxError;
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Relay, relay::MemorySink};
use outbox_testkit::TestResult;
use outbox_testkit::app::OrderPlaced;
use outbox_testkit::events::Budgeted;
use outbox_testkit::role::with_role;
use outbox_testkit::rows::status;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::time::timeout;

use crate::run_until_it_gives_up;
use crate::{budgeted, fast};

#[tokio::test]
async fn a_relay_on_a_missing_table_returns_an_error_instead_of_spinning() -> TestResult {
    let db = TestSchema::new().await?;
    let sink = MemorySink::<Budgeted>::new();
    let relay = fast(Relay::<Budgeted, _>::new(db.pool().clone(), sink.clone())).concurrency(2);
    let outcome = timeout(Duration::from_secs(10), relay.run(CancellationToken::new()))
        .await
        .expect("run returns on its own");
    assert!(
        matches!(
            outcome,
            Err(OutboxError::MissingTable {
                table: "budget_events",
                ..
            })
        ),
        "{outcome:?}"
    );
    assert!(sink.published().is_empty());
    db.drop_schema().await?;
    Ok(())
}

/// A pool on `db`'s schema that connects as `user` (trust authentication), to `database`.
fn pool_as(db: &TestSchema, user: &str, database: Option<&str>) -> TestResult<PgPool> {
    let mut options: PgConnectOptions = db.url().parse()?;
    options = options.username(user);
    if let Some(database) = database {
        options = options.database(database);
    }
    Ok(PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options))
}

#[tokio::test]
async fn a_relay_whose_role_may_not_update_stops_with_permission_denied() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    budgeted("e").enqueue(db.pool()).await?;
    // The application's role: it may enqueue, not publish.
    let role = format!("outbox_app_{}", db.name());
    let grants = format!(
        "GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT, INSERT ON budget_events TO {role};",
        schema = db.name()
    );
    with_role(&db, &role, &grants, async {
        let pool = pool_as(&db, &role, None)?;
        let sink = MemorySink::<Budgeted>::new();
        let error = run_until_it_gives_up(fast(Relay::new(pool.clone(), sink.clone()))).await;
        assert!(
            matches!(
                error,
                OutboxError::PermissionDenied {
                    table: "budget_events",
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(sink.published().is_empty());
        assert_eq!(
            status::<Budgeted>(db.pool(), "e").await,
            "READY",
            "nothing lost"
        );
        pool.close().await;
        Ok(())
    })
    .await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_refused_by_the_server_stops_and_says_where() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    // The test's own role, whatever the server: `root` on CI, `postgres` on the
    // throwaway cluster, yours with your DATABASE_URL.
    let options: PgConnectOptions = db.url().parse()?;
    let own = options.get_username().to_owned();
    for (user, database, cause) in [
        ("no_such_role", None, "no_such_role"),
        (own.as_str(), Some("no_such_database"), "no_such_database"),
    ] {
        let pool = pool_as(&db, user, database)?;
        let error = run_until_it_gives_up(fast(Relay::new(
            pool.clone(),
            MemorySink::<Budgeted>::new(),
        )))
        .await;
        let OutboxError::Connect { endpoint, .. } = &error else {
            panic!("expected Connect, got {error:?}");
        };
        assert!(endpoint.contains(&format!(" as {user}")), "{endpoint}");
        assert!(error.to_string().contains(cause), "{error}");
        pool.close().await;
    }
    db.drop_schema().await?;
    Ok(())
}

/// `outbox::connect` fails at once, naming where and why: a port nothing listens on, a
/// database that does not exist, a URL that does not parse; and otherwise opens a pool.
#[tokio::test]
async fn connect_says_where_and_why_it_cannot() -> TestResult {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let refused = outbox::connect(&format!("postgres://ada@127.0.0.1:{port}/shop"))
        .await
        .expect_err("nothing listens there");
    let OutboxError::Connect { endpoint, .. } = &refused else {
        panic!("expected Connect, got {refused}");
    };
    assert_eq!(endpoint, &format!("127.0.0.1:{port}/shop as ada"));
    assert!(
        refused.to_string().contains("Connection refused") && refused.is_transient(),
        "{refused}"
    );
    assert_eq!(format!("{refused:?}"), refused.to_string());

    let db = TestSchema::new().await?;
    let options: PgConnectOptions = db.url().parse()?;
    let missing = outbox::connect_with(
        PgPoolOptions::new(),
        options.clone().database("no_such_database"),
    )
    .await
    .expect_err("no such database");
    assert!(
        matches!(missing, OutboxError::Connect { .. })
            && missing.to_string().contains("no_such_database")
            && !missing.is_transient(),
        "{missing}"
    );
    let garbled = outbox::connect("postgres://ada:secret@[nope/shop")
        .await
        .expect_err("not a URL");
    assert!(
        matches!(garbled, OutboxError::InvalidUrl { .. })
            && !garbled.to_string().contains("secret"),
        "{garbled}"
    );

    let pool = outbox::connect(&db.url()).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
    assert_eq!(one, 1);
    pool.close().await;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_relay_on_a_table_that_lost_a_column_stops_with_drift() -> TestResult {
    let db = schema_from_zero(&[OrderPlaced::migrations()]).await?;
    sqlx::query("ALTER TABLE order_events DROP COLUMN note")
        .execute(db.pool())
        .await?;
    let error = run_until_it_gives_up(fast(Relay::new(
        db.pool().clone(),
        MemorySink::<OrderPlaced>::new(),
    )))
    .await;
    assert!(
        matches!(
            error,
            OutboxError::Drift {
                table: "order_events",
                ..
            }
        ),
        "{error:?}"
    );
    db.drop_schema().await?;
    Ok(())
}
