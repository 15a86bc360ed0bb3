//! Least privilege, proven: the owner migrates, then the application enqueues, the
//! relay publishes and the operator repairs, each as the role `outbox grants` writes
//! for it, and none of them can do more.

use std::process::Output;
use std::str::FromStr as _;
use std::time::Duration;

use outbox::OutboxError;
use outbox::testing::TestSchema;
use outbox::{CancellationToken, Relay, relay::MemorySink};
use outbox_testkit::events::{ChaosEvent, Receipt};
use outbox_testkit::role::with_roles;
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions as _, PgPool};

/// Three login roles of this test's own (roles belong to the whole cluster).
struct Roles {
    application: String,
    relay: String,
    operator: String,
}

impl Roles {
    fn new() -> Self {
        let suffix = &uuid::Uuid::now_v7().simple().to_string()[20..];
        Self {
            application: format!("outbox_app_{suffix}"),
            relay: format!("outbox_relay_{suffix}"),
            operator: format!("outbox_ops_{suffix}"),
        }
    }

    fn all(&self) -> [&str; 3] {
        [&self.application, &self.relay, &self.operator]
    }

    /// Runs what `outbox grants --table <table>` prints for these roles, as the owner.
    async fn grant(&self, db: &TestSchema, table: &str) -> TestResult {
        let grants = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["--database-url", &db.url(), "grants", "--table", table])
            .args(["--application-role", &self.application])
            .args(["--relay-role", &self.relay])
            .args(["--operator-role", &self.operator])
            .output()
            .await?;
        sqlx::raw_sql(AssertSqlSafe(printed(&grants)))
            .execute(db.pool())
            .await?;
        Ok(())
    }
}

/// `db`'s connection options, logging in as `role`.
fn as_role(db: &TestSchema, role: &str) -> TestResult<PgConnectOptions> {
    Ok(PgConnectOptions::from_str(&db.url())?.username(role))
}

async fn pool_as(db: &TestSchema, role: &str, connections: u32) -> TestResult<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(as_role(db, role)?)
        .await?)
}

/// `outbox <args>`, logged in as `role`, on `db`'s schema.
async fn outbox_as(db: &TestSchema, role: &str, args: &[&str]) -> TestResult<Output> {
    Ok(tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("--database-url")
        .arg(as_role(db, role)?.to_url_lossy().as_str())
        .args(["--schema", db.name()])
        .args(args)
        .output()
        .await?)
}

/// What a successful `outbox` printed.
fn printed(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn denied<T: std::fmt::Debug>(result: &Result<T, OutboxError>) -> bool {
    matches!(result, Err(OutboxError::PermissionDenied { .. }))
}

fn denied_sql<T: std::fmt::Debug>(result: &Result<T, sqlx::Error>) -> bool {
    matches!(result, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501"))
}

#[tokio::test]
async fn each_role_does_its_job_with_the_grants_of_outbox_grants_and_nothing_more() -> TestResult {
    // The owner migrates (a deploy step), and owns the application's other tables.
    let db = schema_with(&[ChaosEvent::migrations(), Receipt::migrations()]).await?;
    sqlx::raw_sql("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint)")
        .execute(db.pool())
        .await?;
    with_three_roles(db, prove).await
}

/// Runs `test` with three fresh roles (dropped whatever it did), then drops `db`.
async fn with_three_roles(
    db: TestSchema,
    test: impl AsyncFnOnce(&TestSchema, &Roles) -> TestResult,
) -> TestResult {
    let roles = Roles::new();
    let outcome = with_roles(&db, &roles.all(), "", test(&db, &roles)).await;
    db.drop_schema().await?;
    outcome
}

async fn prove(db: &TestSchema, roles: &Roles) -> TestResult {
    let owner = db.pool();
    for table in ["chaos_events", "receipt_events"] {
        roles.grant(db, table).await?;
    }

    let app = pool_as(db, &roles.application, 2).await?;
    let relay = pool_as(db, &roles.relay, 4).await?;
    // What their processes run at startup instead of `migrate`, which needs the owner.
    let tables = [ChaosEvent::migrations(), Receipt::migrations()];
    for pool in [&app, &relay] {
        outbox::verify(pool, &tables).await?;
    }
    // Refused by PostgreSQL for want of a privilege (SQLSTATE 42501), at its first step.
    let refused = outbox::migrate(&app, &tables)
        .await
        .expect_err("the application cannot migrate");
    // The SQLSTATE is in the causes (`OutboxError`'s own Debug is its message).
    let causes = std::iter::successors(Some(&refused as &dyn std::error::Error), |e| e.source())
        .map(|e| format!("{e:?}"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        matches!(&refused, OutboxError::Migration { .. }) && causes.contains("\"42501\""),
        "{causes}"
    );
    application_enqueues_and_nothing_more(&app).await?;
    relay_publishes_and_nothing_more(owner, &relay).await?;
    operator_repairs(db, roles, &app).await?;
    for pool in [app, relay] {
        pool.close().await;
    }
    Ok(())
}

/// The application enqueues, alone and in bulk, and can do nothing else with the
/// outbox: no reading payloads, no claiming.
async fn application_enqueues_and_nothing_more(app: &PgPool) -> TestResult {
    for seq in 0..3 {
        ChaosEvent {
            key: format!("chaos-{seq}"),
            order_seq: seq,
        }
        .enqueue(app)
        .await?;
    }
    let receipts: Vec<Receipt> = (0..3)
        .map(|n| Receipt {
            name: format!("receipt-{n}"),
        })
        .collect();
    Receipt::enqueue_all(&receipts, app).await?;
    let payloads = sqlx::query_scalar::<_, i64>("SELECT order_seq FROM chaos_events")
        .fetch_all(app)
        .await;
    assert!(
        denied_sql(&payloads),
        "the application cannot read payloads"
    );
    assert!(denied(&ChaosEvent::claim(app).await), "nor claim");

    Ok(())
}

/// The relay publishes both tables (claims, LISTEN, outcomes; deleting the sent
/// receipts), and reaches nothing else.
async fn relay_publishes_and_nothing_more(owner: &PgPool, relay: &PgPool) -> TestResult {
    let shutdown = CancellationToken::new();
    let (chaos, receipts) = (MemorySink::new(), MemorySink::new());
    let relays = [
        tokio::spawn(
            Relay::<ChaosEvent, _>::new(relay.clone(), chaos.clone())
                .concurrency(1)
                .run(shutdown.clone()),
        ),
        tokio::spawn(
            Relay::<Receipt, _>::new(relay.clone(), receipts.clone())
                .concurrency(1)
                .run(shutdown.clone()),
        ),
    ];
    wait_until(
        "both tables are published and recorded",
        Duration::from_secs(20),
        async || {
            let chaos = outbox::stats::<ChaosEvent>(owner).await.unwrap();
            let receipts = outbox::stats::<Receipt>(owner).await.unwrap();
            chaos.sent == 3 && receipts.ready + receipts.in_progress + receipts.sent == 0
        },
    )
    .await;
    shutdown.cancel();
    for relay in relays {
        relay.await??;
    }
    assert_eq!(
        (chaos.published().len(), receipts.published().len()),
        (3, 3)
    );
    let forged = ChaosEvent {
        key: "forged".into(),
        order_seq: 9,
    };
    assert!(
        denied(&forged.enqueue(relay).await),
        "the relay cannot enqueue"
    );
    let history = <ChaosEvent as outbox::Outbox>::SPEC.history_table();
    for other in ["accounts", "outbox_catalog", history] {
        let read = sqlx::query(AssertSqlSafe(format!("SELECT * FROM {other}")))
            .fetch_all(relay)
            .await;
        assert!(denied_sql(&read), "the relay cannot read {other}");
    }

    Ok(())
}

/// The operator requeues the poison event with the command line.
async fn requeue_the_poison(db: &TestSchema, roles: &Roles) -> TestResult {
    let requeued = outbox_as(
        db,
        &roles.operator,
        &["requeue", "--table", "chaos_events", "poison"],
    )
    .await?;
    assert!(printed(&requeued).starts_with("requeued 1 event(s)"));
    Ok(())
}

/// An event enqueued through `app` that the broker refuses: `DEAD`.
async fn poison(owner: &PgPool, app: &PgPool) -> TestResult {
    ChaosEvent {
        key: "poison".into(),
        order_seq: 99,
    }
    .enqueue(app)
    .await?;
    let claim = ChaosEvent::claim(owner).await?.ok_or("the poison event")?;
    claim.fail(owner, "unroutable").await?;
    Ok(())
}

/// The operator finds the tables through the catalog, and repairs.
async fn operator_repairs(db: &TestSchema, roles: &Roles, app: &PgPool) -> TestResult {
    poison(db.pool(), app).await?;
    let alert = outbox_as(db, &roles.operator, &["status"]).await?;
    assert_eq!(alert.status.code(), Some(3), "a dead event needs attention");
    requeue_the_poison(db, roles).await?;
    let operator = pool_as(db, &roles.operator, 1).await?;
    let read = sqlx::query("SELECT * FROM accounts")
        .fetch_all(&operator)
        .await;
    assert!(
        denied_sql(&read),
        "the operator reads the outbox, not the business"
    );
    operator.close().await;
    Ok(())
}

#[tokio::test]
async fn an_operator_not_yet_granted_a_new_table_still_sees_and_repairs_the_others() -> TestResult {
    let db = schema_with(&[ChaosEvent::migrations(), Receipt::migrations()]).await?;
    with_three_roles(db, repair_beside_an_ungranted_table).await
}

/// `receipt_events` is new: its grants were not run yet. `chaos_events` has a dead event.
async fn repair_beside_an_ungranted_table(db: &TestSchema, roles: &Roles) -> TestResult {
    roles.grant(db, "chaos_events").await?;
    poison(db.pool(), db.pool()).await?;

    let status = outbox_as(db, &roles.operator, &["status"]).await?;
    let (table, alerts) = (
        String::from_utf8_lossy(&status.stdout),
        String::from_utf8_lossy(&status.stderr),
    );
    assert_eq!(status.status.code(), Some(3), "{alerts}");
    assert!(alerts.contains("chaos_events: 1 dead event(s)"), "{alerts}");
    assert!(
        alerts.contains("receipt_events: cannot read") && alerts.contains("permission denied"),
        "{alerts}"
    );
    assert!(
        table.contains("chaos_events") && table.contains("receipt_events"),
        "{table}"
    );
    requeue_the_poison(db, roles).await?;
    Ok(())
}
