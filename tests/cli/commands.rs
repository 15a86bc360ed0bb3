//! The `outbox` command line against a real database: an operator at 3 a.m. who has
//! none of the application's Rust types, only `DATABASE_URL`.

use std::process::Output;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::testing::TestSchema;
use outbox::{Delivery, Relay, Sink, SinkError, relay::Backoff};
use outbox_testkit::events::{Budgeted, OrderStep, Receipt, Shipment, ShipmentBeforeKey};
use outbox_testkit::running::start;
use outbox_testkit::schema::schema_with;
use outbox_testkit::{TestResult, wait_until};
use serde_json::Value;
use tokio::time::Instant;

/// Runs `outbox <args>` against `db`'s schema, with nothing on stdin.
async fn outbox(db: &TestSchema, args: &[&str]) -> TestResult<Output> {
    Ok(tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("--database-url")
        .arg(db.url())
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await?)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn json(output: &Output) -> TestResult<Value> {
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// Enqueues `names` into `Budgeted`'s table.
async fn enqueue(db: &TestSchema, names: &[&str]) -> TestResult {
    for name in names {
        Budgeted {
            name: (*name).to_owned(),
        }
        .enqueue(db.pool())
        .await?;
    }
    Ok(())
}

/// Claims the next event and gives up on it: one `DEAD` row, with `reason`.
async fn kill_next(db: &TestSchema, reason: &str) -> TestResult<String> {
    let claim = Budgeted::claim(db.pool())
        .await?
        .ok_or("nothing to claim")?;
    let event_id = claim.event_id().as_str().to_owned();
    claim.fail(db.pool(), reason).await?;
    Ok(event_id)
}

/// The status of `event_id` in `table`, if the row is there.
async fn status_in(db: &TestSchema, table: &str, event_id: &str) -> TestResult<Option<String>> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT status FROM {table} WHERE event_id = $1"
    )))
    .bind(event_id)
    .fetch_optional(db.pool())
    .await?)
}

async fn status_of(db: &TestSchema, event_id: &str) -> TestResult<Option<String>> {
    status_in(db, "budget_events", event_id).await
}

#[tokio::test]
async fn status_shows_every_table_and_exits_3_while_events_are_dead() -> TestResult {
    let db = schema_with(&[Budgeted::migrations(), Receipt::migrations()]).await?;
    enqueue(&db, &["a", "b", "c"]).await?;

    let healthy = outbox(&db, &["status"]).await?;
    assert_eq!(healthy.status.code(), Some(0), "{}", stderr(&healthy));
    let table = stdout(&healthy);
    assert!(table.starts_with("TABLE"), "{table}");
    let budget = table
        .lines()
        .find(|l| l.starts_with("budget_events"))
        .ok_or(table.clone())?;
    let cells: Vec<&str> = budget.split_whitespace().collect();
    // TABLE TYPE READY DUE IN-PROGRESS EXPIRED DEAD SENT SENT/MIN OLDEST..
    assert_eq!(
        &cells[..9],
        [
            "budget_events",
            "Budgeted",
            "3",
            "3",
            "0",
            "0",
            "0",
            "0",
            "0"
        ]
    );
    assert!(table.contains("receipt_events"), "{table}");

    let dead = kill_next(&db, "the broker refused it: message too large").await?;
    let alert = outbox(&db, &["status", "--json"]).await?;
    assert_eq!(alert.status.code(), Some(3), "dead rows need attention");
    assert!(
        stderr(&alert).contains("budget_events: 1 dead event(s)"),
        "{}",
        stderr(&alert)
    );
    let tables = json(&alert)?;
    let budget = &tables[0];
    assert_eq!(budget["table"], "budget_events");
    assert_eq!(budget["type_name"], "outbox_testkit::events::Budgeted");
    assert_eq!(
        (budget["ready"].as_i64(), budget["dead"].as_i64()),
        (Some(2), Some(1))
    );
    assert_eq!(budget["max_attempts"], 3);
    assert!(budget["oldest_waiting_age_seconds"].as_f64().is_some());
    // A table that deletes its sent rows cannot say how many went out.
    assert_eq!(tables[1]["table"], "receipt_events");
    assert_eq!(tables[1]["sent_last_minute"], Value::Null);

    let requeued = outbox(&db, &["requeue", "--table", "budget_events", &dead]).await?;
    assert_eq!(requeued.status.code(), Some(0), "{}", stderr(&requeued));
    // An age threshold is the other alert: every event is younger than an hour.
    let calm = outbox(&db, &["status", "--max-age", "1h"]).await?;
    assert_eq!(calm.status.code(), Some(0), "{}", stderr(&calm));
    let late = outbox(&db, &["status", "--max-age", "0s"]).await?;
    assert_eq!(late.status.code(), Some(3));
    assert!(
        stderr(&late).contains("over --max-age"),
        "{}",
        stderr(&late)
    );
    db.drop_schema().await?;
    Ok(())
}

/// A broker that is down: every batch is refused as unavailable. Remembers when.
#[derive(Clone, Default)]
struct Down {
    calls: Arc<Mutex<Vec<Instant>>>,
}

impl Down {
    fn calls_after(&self, at: Instant) -> usize {
        let calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        calls.iter().filter(|&&call| call > at).count()
    }
}

impl Sink<Budgeted> for Down {
    async fn publish(&self, batch: &[Delivery<'_, Budgeted>]) -> Vec<Result<(), SinkError>> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Instant::now());
        batch
            .iter()
            .map(|_| Err(SinkError::unavailable("nats: connection refused")))
            .collect()
    }
}

/// Through an outage, the relay hands the event back again and again, due at once each
/// time: `status` still counts its age from its enqueue, exits 3 past `--max-age`, and
/// says why it waits.
#[tokio::test]
async fn an_outage_longer_than_max_age_needs_attention_with_the_age_since_enqueue_and_why()
-> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let before = Instant::now();
    enqueue(&db, &["stuck"]).await?;
    let down = Down::default();
    let relay = start(
        Relay::<Budgeted, _>::new(db.pool().clone(), down.clone()).unavailable_backoff(
            Backoff::new(Duration::from_millis(20), Duration::from_millis(100)),
        ),
    );
    // Handed back twice after it was a second and a half old: each time due again.
    let late = before + Duration::from_millis(1_500);
    wait_until(
        "two hand-backs after 1.5 s",
        Duration::from_secs(30),
        async || down.calls_after(late) >= 2,
    )
    .await;

    let alert = outbox(&db, &["status", "--max-age", "1s"]).await?;
    assert_eq!(alert.status.code(), Some(3), "{}", stderr(&alert));
    let reason = "destination unavailable: nats: connection refused";
    let attention = stderr(&alert);
    assert!(
        attention.contains("attention: budget_events: the oldest waiting event was enqueued ")
            && attention.contains(&format!("over --max-age 1s; its last error: {reason}")),
        "{attention}"
    );
    let table = stdout(&alert);
    assert!(
        table.lines().any(|line| line
            .starts_with("budget_events: the oldest waiting event, enqueued ")
            && line.ends_with(&format!("last failed: {reason}"))),
        "{table}"
    );

    let tables = json(&outbox(&db, &["status", "--json", "--max-age", "1s"]).await?)?;
    let budget = &tables[0];
    let age = budget["oldest_waiting_age_seconds"]
        .as_f64()
        .ok_or("an age")?;
    assert!(age >= 1.5, "counted from the enqueue: {budget}");
    assert_eq!(budget["oldest_waiting_error"], reason);
    assert_eq!(budget["dead"], 0, "an outage burns no attempt");
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

/// The `stats` statement of `budget_events` as builds before the age since enqueue wrote
/// it into the catalog: its oldest age counted from when an event became due.
const OLDER_STATS: &str = "SELECT
    count(*) FILTER (WHERE status = 'READY') AS ready,
    count(*) FILTER (WHERE status = 'INPROGRESS') AS in_progress,
    count(*) FILTER (WHERE status = 'SENT') AS sent,
    count(*) FILTER (WHERE status = 'DEAD') AS dead,
    count(*) FILTER (WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()) AS expired_claims,
    statement_timestamp() - min(CASE
        WHEN status = 'READY' AND next_attempt_at <= statement_timestamp() THEN greatest(next_attempt_at, statement_timestamp() - interval '31557600000 seconds')
        WHEN status = 'INPROGRESS' AND lease_until <= statement_timestamp() THEN greatest(lease_until, statement_timestamp() - interval '31557600000 seconds') END)
        AS oldest_eligible_age,
    0::bigint AS held_keys, NULL::interval AS oldest_held_age,
    count(*) FILTER (WHERE status = 'SENT' AND next_attempt_at > statement_timestamp() - interval '1 minute') AS sent_last_minute,
    count(*) FILTER (WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()) AS due
FROM \"budget_events\"";

/// A catalog entry written by an older build: `status` says so rather than report its
/// age from the older figure, the other commands still work, and `migrate` with this
/// build rewrites it.
#[tokio::test]
async fn an_older_builds_stats_statement_is_named_until_migrate_rewrites_it() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue(&db, &["a", "b"]).await?;
    let dead = kill_next(&db, "refused").await?;
    sqlx::query(
        "UPDATE outbox_catalog SET statements = jsonb_set(statements, '{stats}', to_jsonb($1::text)) \
         WHERE table_name = 'budget_events'",
    )
    .bind(OLDER_STATS)
    .execute(db.pool())
    .await?;

    let older = outbox(&db, &["status"]).await?;
    assert_eq!(older.status.code(), Some(3), "{}", stderr(&older));
    assert!(
        stderr(&older).contains(
            "budget_events: cannot read its counts: the catalog entry of `budget_events` cannot \
             be used: its `stats` statement was written by an older build of the outbox crate \
             (it has no `oldest_waiting_age` column); run outbox::migrate with this version"
        ),
        "{}",
        stderr(&older)
    );
    let listed = outbox(&db, &["dead"]).await?;
    assert_eq!(listed.status.code(), Some(0), "{}", stderr(&listed));
    assert!(stdout(&listed).contains(&dead), "{}", stdout(&listed));

    outbox::migrate(db.pool(), &[Budgeted::migrations()]).await?;
    let current = outbox(&db, &["status"]).await?;
    assert_eq!(current.status.code(), Some(3), "the dead event");
    assert!(
        !stderr(&current).contains("cannot read its counts"),
        "{}",
        stderr(&current)
    );

    // A build from before scheduled publish: its statement has every column but
    // `scheduled`, and its tables no schedule; it is read as none scheduled.
    let updated = sqlx::query(
        "UPDATE outbox_catalog SET statements = jsonb_set(statements, '{stats}', \
             to_jsonb(replace(statements->>'stats', ',\n    0::bigint AS scheduled', ''))) \
         WHERE table_name = 'budget_events' AND statements->>'stats' LIKE '%AS scheduled%'",
    )
    .execute(db.pool())
    .await?;
    assert_eq!(updated.rows_affected(), 1);
    let before_scheduling = outbox(&db, &["status"]).await?;
    assert_eq!(before_scheduling.status.code(), Some(3), "the dead event");
    assert!(
        !stderr(&before_scheduling).contains("cannot read its counts"),
        "{}",
        stderr(&before_scheduling)
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn dead_and_show_tell_the_operator_what_died_and_why() -> TestResult {
    let db = schema_with(&[Budgeted::migrations(), OrderStep::migrations()]).await?;
    enqueue(&db, &["payment-7"]).await?;
    let dead = kill_next(&db, "card declined\nby the acquirer").await?;
    OrderStep {
        name: "step-1".to_owned(),
        order_id: 42,
    }
    .enqueue(db.pool())
    .await?;
    let step = OrderStep::claim(db.pool()).await?.ok_or("a step")?;
    step.fail(db.pool(), "no such order").await?;

    let listed = outbox(&db, &["dead"]).await?;
    assert_eq!(listed.status.code(), Some(0), "{}", stderr(&listed));
    let text = stdout(&listed);
    let line = text
        .lines()
        .find(|l| l.contains("payment-7"))
        .ok_or(text.clone())?;
    assert!(
        line.starts_with("budget_events") && line.ends_with("card declined by the acquirer"),
        "the error on one line: {line}"
    );
    assert!(text.contains("order_step_events  step-1"), "{text}");

    let only = outbox(&db, &["dead", "--table", "order_step_events", "--json"]).await?;
    let rows = json(&only)?;
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");
    assert_eq!(rows[0]["event_id"], "step-1");
    assert_eq!(rows[0]["key"], "42", "the ordering key it holds back");
    assert_eq!(rows[0]["last_error"], "no such order");

    let shown = outbox(&db, &["show", "--table", "budget_events", &dead, "--json"]).await?;
    assert_eq!(shown.status.code(), Some(0), "{}", stderr(&shown));
    let row = json(&shown)?;
    assert_eq!(
        (row["status"].as_str(), row["event_id"].as_str()),
        (Some("DEAD"), Some("payment-7"))
    );
    assert_eq!(row["attempts"], 1);

    let missing = outbox(&db, &["show", "--table", "budget_events", "nope"]).await?;
    assert_eq!(missing.status.code(), Some(1));
    assert!(stderr(&missing).contains("no event `nope` in `budget_events`"));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn requeue_says_what_it_would_do_then_does_it_and_asks_before_a_bulk_change() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue(&db, &["a", "b", "c"]).await?;
    let (a, b) = (kill_next(&db, "x").await?, kill_next(&db, "y").await?);

    let dry = outbox(
        &db,
        &["requeue", "--table", "budget_events", &a, "c", "--dry-run"],
    )
    .await?;
    // c is not dead: a script sees that not everything it named would change.
    assert_eq!(dry.status.code(), Some(3), "{}", stderr(&dry));
    assert!(
        stderr(&dry).contains("1 of the 2 event id(s) named would be left alone"),
        "{}",
        stderr(&dry)
    );
    assert_eq!(
        stdout(&dry),
        format!(
            "would requeue 1 event(s) of budget_events\n  {a}\n\
             left alone (not DEAD now, or no such event):\n  c\n"
        )
    );
    assert_eq!(
        status_of(&db, &a).await?.as_deref(),
        Some("DEAD"),
        "a dry run changes nothing"
    );

    let done = outbox(&db, &["requeue", "--table", "budget_events", &a]).await?;
    assert_eq!(done.status.code(), Some(0), "{}", stderr(&done));
    assert_eq!(
        stdout(&done),
        format!("requeued 1 event(s) of budget_events\n  {a}\n")
    );
    assert_eq!(status_of(&db, &a).await?.as_deref(), Some("READY"));

    // Every dead event at once is a bulk change: without a terminal to ask on, only
    // --yes confirms it.
    let refused = outbox(&db, &["requeue", "--table", "budget_events", "--all"]).await?;
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("confirm with --yes"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(status_of(&db, &b).await?.as_deref(), Some("DEAD"));
    let all = outbox(
        &db,
        &["requeue", "--table", "budget_events", "--all", "--yes"],
    )
    .await?;
    assert_eq!(stdout(&all), "requeued 1 dead event(s) of budget_events\n");
    assert_eq!(status_of(&db, &b).await?.as_deref(), Some("READY"));

    let neither = outbox(&db, &["requeue", "--table", "budget_events"]).await?;
    assert_eq!(
        neither.status.code(),
        Some(2),
        "ids or --all: a usage error"
    );
    db.drop_schema().await?;
    Ok(())
}

/// A dry run of discarding `first` deletes nothing; without a terminal to ask on, only
/// --yes deletes.
async fn discard_is_dry_run_or_confirmed(db: &TestSchema) -> TestResult {
    let dry = outbox(
        db,
        &[
            "discard",
            "--table",
            "order_step_events",
            "first",
            "--dry-run",
        ],
    )
    .await?;
    assert_eq!(dry.status.code(), Some(0), "{}", stderr(&dry));
    assert_eq!(
        stdout(&dry),
        "would discard 1 event(s) of order_step_events\n  first\n"
    );
    let refused = outbox(db, &["discard", "--table", "order_step_events", "first"]).await?;
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("confirm with --yes"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(
        status_in(db, "order_step_events", "first")
            .await?
            .as_deref(),
        Some("DEAD")
    );
    Ok(())
}

#[tokio::test]
async fn discard_lets_a_held_key_go_on_and_prune_deletes_old_sent_events() -> TestResult {
    let db = schema_with(&[Budgeted::migrations(), OrderStep::migrations()]).await?;
    for name in ["first", "second"] {
        OrderStep {
            name: name.to_owned(),
            order_id: 1,
        }
        .enqueue(db.pool())
        .await?;
    }
    let first = OrderStep::claim(db.pool()).await?.ok_or("first")?;
    first.fail(db.pool(), "poison").await?;
    assert!(
        OrderStep::claim(db.pool()).await?.is_none(),
        "held back by its dead predecessor"
    );

    discard_is_dry_run_or_confirmed(&db).await?;
    let discarded = outbox(
        &db,
        &["discard", "--table", "order_step_events", "first", "--yes"],
    )
    .await?;
    assert_eq!(
        stdout(&discarded),
        "discarded 1 event(s) of order_step_events\n  first\n"
    );
    let second = OrderStep::claim(db.pool()).await?.ok_or("second goes on")?;
    assert_eq!(second.event().name, "second");
    second.complete(db.pool()).await?;

    enqueue(&db, &["old-1", "old-2"]).await?;
    for _ in 0..2 {
        Budgeted::claim(db.pool())
            .await?
            .ok_or("a claim")?
            .complete(db.pool())
            .await?;
    }
    let dry = outbox(
        &db,
        &[
            "prune",
            "--table",
            "budget_events",
            "--older-than",
            "0s",
            "--dry-run",
        ],
    )
    .await?;
    assert_eq!(
        stdout(&dry),
        "would delete 2 SENT event(s) of budget_events published more than 0s ago\n"
    );
    let pruned = outbox(
        &db,
        &[
            "prune",
            "--table",
            "budget_events",
            "--older-than",
            "0s",
            "--batch",
            "1",
            "--yes",
        ],
    )
    .await?;
    assert_eq!(
        stdout(&pruned),
        "deleted 2 SENT event(s) of budget_events\n",
        "{}",
        stderr(&pruned)
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM budget_events")
        .fetch_one(db.pool())
        .await?;
    assert_eq!(left, 0);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn mistakes_get_clear_errors() -> TestResult {
    let db = TestSchema::new().await?;
    let empty = outbox(&db, &["status"]).await?;
    assert_eq!(
        empty.status.code(),
        Some(3),
        "a schema without outbox tables is not a healthy outbox to a cron check"
    );
    assert!(
        stdout(&empty).contains("outbox::migrate has not run here"),
        "{}",
        stdout(&empty)
    );
    outbox_testkit::schema::migrate(
        &db,
        &[Budgeted::migrations()],
        outbox_testkit::schema::Generations::Random,
    )
    .await?;

    let unknown = outbox(&db, &["dead", "--table", "orders"]).await?;
    assert_eq!(unknown.status.code(), Some(1));
    assert_eq!(
        stderr(&unknown),
        "error: no outbox table `orders` in the catalog of this schema; it lists budget_events\n"
    );

    let too_often = outbox(&db, &["status", "--watch", "0s"]).await?;
    assert_eq!(
        too_often.status.code(),
        Some(2),
        "a usage error, not a panic"
    );
    assert!(
        stderr(&too_often).contains("at least 100ms"),
        "{}",
        stderr(&too_often)
    );

    let bad_url = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", "mysql://nope", "status"])
        .output()
        .await?;
    assert_eq!(bad_url.status.code(), Some(1));
    assert!(
        stderr(&bad_url).starts_with("error: invalid database URL"),
        "{}",
        stderr(&bad_url)
    );

    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "--database-url",
            "postgres://ops@127.0.0.1:1/orders",
            "status",
        ])
        .output()
        .await?;
    assert_eq!(refused.status.code(), Some(1));
    // Where and why, once: the message already ends with its causes.
    assert!(
        stderr(&refused).starts_with(
            "error: cannot connect to PostgreSQL at 127.0.0.1:1/orders as ops: \
             error communicating with database: Connection refused"
        ) && stderr(&refused).lines().count() == 1,
        "{}",
        stderr(&refused)
    );

    // A table dropped behind the catalog's back is reported, and not touched.
    sqlx::query("DROP TABLE budget_events")
        .execute(db.pool())
        .await?;
    let dropped = outbox(&db, &["status"]).await?;
    assert_eq!(dropped.status.code(), Some(3));
    assert!(
        stderr(&dropped).contains("budget_events: the table does not exist"),
        "{}",
        stderr(&dropped)
    );
    let repair = outbox(
        &db,
        &["requeue", "--table", "budget_events", "--all", "--yes"],
    )
    .await?;
    assert_eq!(repair.status.code(), Some(1));
    // Nor does "no dead events" hide it.
    let dead = outbox(&db, &["dead"]).await?;
    assert_eq!(dead.status.code(), Some(3));
    assert!(
        stderr(&dead).contains("attention: `budget_events` not read: the table does not exist"),
        "{}",
        stderr(&dead)
    );

    let no_schema = outbox(&db, &["--schema", "no_such_schema", "status"]).await?;
    assert_eq!(no_schema.status.code(), Some(1));
    assert!(
        stderr(&no_schema).contains("--schema no_such_schema: no such schema in this database"),
        "{}",
        stderr(&no_schema)
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_table_found_outside_the_catalogs_schema_is_refused() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue(&db, &["a"]).await?;
    // Another schema first on the search_path, with a table of the same name and no
    // catalog: the catalog is found in the outbox's schema, the table in the other.
    let other = format!("{}_other", db.name());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA \"{other}\"; CREATE TABLE \"{other}\".budget_events (LIKE budget_events INCLUDING ALL);"
    )))
    .execute(db.pool())
    .await?;
    let search_path = format!("{other},{}", db.name());
    let status = outbox(&db, &["--schema", &search_path, "status"]).await?;
    let requeue = outbox(
        &db,
        &[
            "--schema",
            &search_path,
            "requeue",
            "--table",
            "budget_events",
            "--all",
            "--yes",
        ],
    )
    .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{other}\" CASCADE"
    )))
    .execute(db.pool())
    .await?;
    assert_eq!(status.status.code(), Some(3));
    let said = format!(
        "budget_events: the name resolves to `{other}.budget_events`, while the catalog is in schema `{}`",
        db.name()
    );
    assert!(stderr(&status).contains(&said), "{}", stderr(&status));
    assert_eq!(requeue.status.code(), Some(1), "{}", stderr(&requeue));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_statement_that_would_run_too_long_is_cancelled_by_the_server() -> TestResult {
    let db = TestSchema::new().await?;
    outbox_testkit::schema::migrate(
        &db,
        &[Budgeted::migrations()],
        outbox_testkit::schema::Generations::Random,
    )
    .await?;
    // A migration in another session holds the table: the query waits for it.
    let mut blocker = db.pool().begin().await?;
    sqlx::query("LOCK TABLE budget_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await?;

    let waited = outbox(
        &db,
        &[
            "--statement-timeout",
            "300ms",
            "dead",
            "--table",
            "budget_events",
        ],
    )
    .await?;
    assert_eq!(waited.status.code(), Some(1));
    assert!(
        stderr(&waited).contains("canceling statement due to statement timeout"),
        "{}",
        stderr(&waited)
    );

    blocker.rollback().await?;
    let answered = outbox(&db, &["dead", "--table", "budget_events"]).await?;
    assert_eq!(answered.status.code(), Some(0), "{}", stderr(&answered));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_catalog_follows_the_newest_build_and_grants_name_three_roles() -> TestResult {
    // The same table, as a newer build (V2: the key) and an older one (V1) that starts
    // afterwards during a rolling deploy: the entry keeps describing the newer.
    let db = schema_with(&[Shipment::migrations()]).await?;
    outbox::migrate(db.pool(), &[ShipmentBeforeKey::migrations()]).await?;
    let entry = outbox::catalog::table(db.pool(), "shipment_events").await?;
    assert_eq!((entry.version(), entry.key()), (2, Some("parcel")));
    assert!(
        entry.type_name().ends_with("::Shipment"),
        "{}",
        entry.type_name()
    );
    assert_eq!(entry.problem(), None);

    let grants = outbox(
        &db,
        &[
            "grants",
            "--table",
            "shipment_events",
            "--application-role",
            "shop",
            "--relay-role",
            "relay",
        ],
    )
    .await?;
    let text = stdout(&grants);
    let schema = db.name();
    for line in [
        format!(
            "GRANT INSERT, SELECT (id, event_id) ON \"{schema}\".\"shipment_events\" TO \"shop\";"
        ),
        format!("GRANT SELECT, UPDATE ON \"{schema}\".\"shipment_events\" TO \"relay\";"),
        format!(
            "GRANT SELECT, UPDATE, DELETE ON \"{schema}\".\"shipment_events\" TO \"outbox_operator\";"
        ),
    ] {
        assert!(text.contains(&line), "{line}\nin\n{text}");
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn status_watch_refreshes_until_interrupted() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue(&db, &["a"]).await?;
    let mut watch = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", &db.url(), "status", "--watch", "100ms"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = tokio::io::BufReader::new(watch.stdout.take().ok_or("stdout")?);
    // Three refreshes, each a header and the table's line.
    let mut refreshes = 0;
    let mut line = String::new();
    while refreshes < 3 {
        line.clear();
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut line),
        )
        .await
        .map_err(|_| "no refresh in 30 s")??;
        assert!(!line.is_empty(), "the watch ended early");
        if line.starts_with("budget_events") {
            refreshes += 1;
        }
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(watch.id().ok_or("pid")?)?);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT)?;
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), watch.wait())
        .await
        .map_err(|_| "the watch went on after Ctrl-C")??;
    assert_eq!(status.code(), Some(0), "Ctrl-C ends a watch cleanly");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn fleet_shows_which_member_serves_each_target_and_exits_3_when_one_is_unserved() -> TestResult
{
    use outbox::fleet::{Fleet, Target};

    let home = TestSchema::new().await?;
    let tenants = [
        schema_with(&[Budgeted::migrations()]).await?,
        schema_with(&[Budgeted::migrations()]).await?,
    ];
    let targets: Vec<Target> = tenants
        .iter()
        .enumerate()
        .map(|(n, db)| Target::from_url(format!("tenant-{n}"), &db.url()))
        .collect::<Result<_, _>>()?;
    // No fleet table yet (no member ever started), then an empty one.
    for table_exists in [false, true] {
        if table_exists {
            outbox::fleet::migrate(home.pool()).await?;
        }
        let none = outbox(&home, &["fleet"]).await?;
        assert_eq!(none.status.code(), Some(3), "{}", stderr(&none));
        assert!(
            stderr(&none).contains("no relay fleet"),
            "table exists: {table_exists}: {}",
            stderr(&none)
        );
    }

    let shutdown = outbox::CancellationToken::new();
    let member = tokio::spawn(
        Fleet::<Budgeted, _>::new(home.pool().clone(), outbox::relay::MemorySink::new())
            .member("member-a")
            .lease(Duration::from_secs(2))
            .targets(targets)
            .run(shutdown.clone()),
    );
    wait_until("both targets served", Duration::from_secs(30), async || {
        outbox::fleet::assignments(home.pool(), "budget_events")
            .await
            .is_ok_and(|a| a.len() == 2 && a.iter().all(|a| a.owner.is_some()))
    })
    .await;
    let served = outbox(&home, &["fleet"]).await?;
    assert_eq!(served.status.code(), Some(0), "{}", stderr(&served));
    let text = stdout(&served);
    assert!(text.contains("fleet budget_events"), "{text}");
    assert!(text.contains("member-a (alive"), "{text}");
    assert!(text.contains("OLDEST DUE"), "{text}");
    for target in ["tenant-0", "tenant-1"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(target))
            .ok_or(text.clone())?;
        assert!(line.contains("member-a"), "{line}");
    }

    // The member stops and gives its targets up: nobody serves them.
    shutdown.cancel();
    member.await??;
    let unserved = outbox(&home, &["fleet", "--name", "budget_events"]).await?;
    assert_eq!(unserved.status.code(), Some(3), "{}", stdout(&unserved));
    assert!(
        stderr(&unserved)
            .contains("served by no member: budget_events/tenant-0, budget_events/tenant-1"),
        "{}",
        stderr(&unserved)
    );
    for db in tenants {
        db.drop_schema().await?;
    }
    home.drop_schema().await?;
    Ok(())
}
