//! The claim transaction: a paused relay holds its events no longer than its limit; a
//! claim that fails hands back what it claimed and keeps the outcomes recorded before it.

use std::time::Duration;

use outbox::Outbox;
use outbox::{Relay, relay::MemorySink};
use outbox_testkit::events::{Budgeted, ChaosEvent};
use outbox_testkit::rows::{enqueue, row_of, status};
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::time::Instant;

use crate::run_until_it_gives_up;
use crate::{ScriptSink, budgeted, fast};

/// The role of [`paused_relay_child`].
const PAUSED: &str = "paused-relay";

/// The relay process of the pause test: a relay of [`ChaosEvent`] on the test's schema
/// (the parameter `URL`), publishing nowhere, until its parent kills it. A no-op in a
/// normal run.
#[test]
fn paused_relay_child() {
    if !outbox_testkit::child::requested(PAUSED) {
        return;
    }
    outbox_testkit::broker::relay_until_killed::<ChaosEvent, _>(PAUSED, async || {
        MemorySink::<ChaosEvent>::new()
    });
}

/// A relay paused (SIGSTOP) between its claim statement and its commit holds the rows
/// it claimed locked, and every other claim skips them (`SKIP LOCKED`), the seed's
/// "open claim transaction": the server ends such a session once it has been idle in
/// its transaction for the relay's transaction limit (the lease, at least 10 s), and the
/// claim never happened.
#[tokio::test]
async fn a_relay_paused_inside_its_claim_transaction_holds_its_events_no_longer_than_its_limit()
-> TestResult {
    let db = schema_from_zero(&[ChaosEvent::migrations()]).await?;
    let pool = db.pool();
    let event = ChaosEvent {
        key: "k".into(),
        order_seq: 1,
    };
    event.enqueue(pool).await?;
    // The child's claim takes 2 s on the server: long enough to pause the child while
    // it waits for the answer, which it then never gets to commit.
    let paused_name = format!("{}-paused", db.name());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(2); RETURN NEW; END $$;
         CREATE TRIGGER slow_claim BEFORE UPDATE ON chaos_events FOR EACH ROW
             WHEN (NEW.status = 'INPROGRESS'
                   AND current_setting('application_name') = '{paused_name}')
             EXECUTE FUNCTION slow_claim();"
    )))
    .execute(pool)
    .await?;
    let url = format!("{}&application_name={paused_name}", db.url());
    let mut relay = outbox_testkit::child::ChildCommand::test("claims::paused_relay_child")
        .spawn(PAUSED, &[("URL", &url)])?;
    let session = async |state: &str, wait_event: Option<&str>| {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = $1 \
             AND state = $2 AND wait_event IS NOT DISTINCT FROM $3)",
        )
        .bind(&paused_name)
        .bind(state)
        .bind(wait_event)
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity")
    };
    wait_until(
        "the child's claim runs",
        Duration::from_secs(15),
        async || session("active", Some("PgSleep")).await,
    )
    .await;
    relay.signal(nix::sys::signal::Signal::SIGSTOP)?;
    let paused = Instant::now();
    wait_until(
        "the claim is done, and its transaction waits for a commit",
        Duration::from_secs(5),
        async || session("idle in transaction", Some("ClientRead")).await,
    )
    .await;
    assert!(
        ChaosEvent::claim(pool).await?.is_none(),
        "the paused claim's row is locked: skipped"
    );

    wait_until(
        "the server ends the paused session",
        Duration::from_secs(20),
        async || !session("idle in transaction", Some("ClientRead")).await,
    )
    .await;
    let held = paused.elapsed();
    let claim = ChaosEvent::claim(pool).await?.expect("free again");
    assert_eq!(
        claim.generation().get(),
        1,
        "the paused claim never happened: this is the first"
    );
    assert!(
        held >= Duration::from_secs(8),
        "ended by its idle limit (10 s), not sooner: {held:?}"
    );
    claim.complete(pool).await?;
    relay.kill()?;
    db.drop_schema().await?;
    Ok(())
}

/// Makes every claim of the event `poison` in `T`'s table fail (SQLSTATE P0001: not a
/// transient error), after whatever the same statement or transaction did before.
async fn refuse_to_claim_poison<T: Outbox>(pool: &PgPool) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'poison may not be claimed'; END $$;
         CREATE TRIGGER refuse_poison BEFORE UPDATE ON {} FOR EACH ROW
             WHEN (NEW.event_id = 'poison' AND NEW.status = 'INPROGRESS')
             EXECUTE FUNCTION refuse_poison();",
        T::SPEC.table()
    )))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_claim_outside_a_transaction_that_fails_after_claiming_hands_those_rows_back()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[budgeted("spent"), budgeted("kept"), budgeted("poison")],
    )
    .await;
    // "spent" is an expired claim whose budget (3) is used up: the first claim statement
    // moves it to DEAD and returns it with "kept", and the claim looks for one more row
    // in a second statement, which meets "poison" and fails.
    sqlx::query(
        "UPDATE budget_events SET status = 'INPROGRESS', attempts = 3, generation = 1,
             lease_until = clock_timestamp() - interval '1 second'
         WHERE event_id = 'spent'",
    )
    .execute(pool)
    .await?;
    refuse_to_claim_poison::<Budgeted>(pool).await;

    let error = Budgeted::claim_batch(pool, 2)
        .await
        .expect_err("the second claim statement fails");
    assert!(
        error.to_string().contains("poison may not be claimed"),
        "{error}"
    );

    // "kept" was claimed and committed by the first statement: handed back, due now,
    // the attempt not counted, rather than left to wait out its 30 s lease.
    let kept = row_of::<Budgeted>(pool, "kept").await;
    assert_eq!(
        (kept.status.as_str(), kept.attempts, kept.lease_left),
        ("READY", 0, None)
    );
    assert!(kept.due_in <= 0.0, "due now: {}", kept.due_in);
    assert_eq!(status::<Budgeted>(pool, "spent").await, "DEAD");
    assert_eq!(status::<Budgeted>(pool, "poison").await, "READY");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_that_fails_for_good_beside_recorded_outcomes_still_records_them() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names = ["a", "b", "c", "d", "poison"];
    enqueue(pool, &names.map(budgeted)).await;
    refuse_to_claim_poison::<Budgeted>(pool).await;
    // Batches of 2: {a, b} is published while {c, d} is claimed ahead; {c, d} is
    // published while a transaction records {a, b} and claims {poison}, which fails,
    // rolling the recording back with it. The relay stops (a trigger that refuses claims
    // needs a person), but what it published is recorded first: an unrecorded event
    // would be claimed and published again.
    let sink = ScriptSink::always_ok();
    let error = run_until_it_gives_up(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())).batch_size(2),
    )
    .await;
    assert!(
        error.to_string().contains("poison may not be claimed"),
        "{error}"
    );
    assert_eq!(sink.calls().len(), 2);
    for &name in &names[..4] {
        assert_eq!(status::<Budgeted>(pool, name).await, "SENT", "{name}");
    }
    assert_eq!(status::<Budgeted>(pool, "poison").await, "READY");
    db.drop_schema().await?;
    Ok(())
}
