//! Shutdown: unsent claims go back uncounted, a send in flight finishes and is recorded.

use std::sync::Arc;
use std::time::Duration;

use outbox::{CancellationToken, Relay};
use outbox_testkit::events::Budgeted;
use outbox_testkit::rows::{Row, enqueue, row_of, status};
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use tokio::time::{sleep, timeout};

use crate::WaitsForTheClaimAhead;
use crate::{Plan, ScriptSink, Seen, Wait, budgeted, fast, lock};

#[tokio::test]
async fn a_shutdown_hands_unsent_claims_back_without_counting_the_attempt() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(
        pool,
        &[budgeted("first"), budgeted("second"), budgeted("third")],
    )
    .await;
    // "first" already used one attempt.
    let claim = Budgeted::claim(pool).await?.expect("due");
    let _ = claim
        .retry_because(pool, Duration::ZERO, "broker unavailable")
        .await?;

    let sink = ScriptSink::new(|_, seen| Plan::after(Wait::Forever, seen));
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .shutdown_grace(Duration::from_millis(200)),
    );
    wait_until(
        "the batch is in the sink",
        Duration::from_secs(5),
        async || !sink.calls().is_empty(),
    )
    .await;
    assert_eq!(
        sink.calls(),
        [[
            Seen::new("first", 2, 2),
            Seen::new("second", 1, 1),
            Seen::new("third", 1, 1)
        ]]
    );
    // The send never returns: `stop` returns because the grace ended it.
    relay.stop().await?;
    assert_eq!(sink.abandoned(), 1, "the hung send was dropped");

    for (name, generation, attempts, last_error) in [
        ("first", 2, 1, Some("broker unavailable")),
        ("second", 1, 0, None),
        ("third", 1, 0, None),
    ] {
        let row = row_of::<Budgeted>(pool, name).await;
        assert_eq!(
            (
                row.status.as_str(),
                row.generation,
                row.attempts,
                row.last_error.as_deref()
            ),
            ("READY", generation, attempts, last_error),
            "{name}"
        );
        assert!(
            row.due_in <= 0.0 && row.lease_left.is_none(),
            "{name}: {row:?}"
        );
    }
    let reclaimed = Budgeted::claim_batch(pool, 10).await?;
    let attempts: Vec<u32> = reclaimed.iter().map(outbox::Claim::attempt).collect();
    assert_eq!(
        attempts,
        [2, 1, 1],
        "claimable at once, the abandoned attempt not counted"
    );
    for claim in reclaimed {
        claim.complete(pool).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_shutdown_lets_a_send_in_flight_finish_and_records_it() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The send ends once the shutdown is under way.
    let released = CancellationToken::new();
    let sink = ScriptSink::new({
        let released = released.clone();
        move |_, seen| Plan::after(Wait::Until(released.clone()), seen)
    });
    // Waits as long as it takes: the longest durations a user can ask for are accepted.
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .shutdown_grace(Duration::MAX)
            .poll_interval(Duration::MAX),
    );
    budgeted("in-flight").enqueue(pool).await?;
    wait_until("the send started", Duration::from_secs(5), async || {
        !sink.calls().is_empty()
    })
    .await;
    relay.begin_stop();
    released.cancel();
    relay.stop().await?;
    assert_eq!(status::<Budgeted>(pool, "in-flight").await, "SENT");
    assert_eq!(sink.abandoned(), 0);

    budgeted("after").enqueue(pool).await?;
    // `run` has returned: this only gives a task it left behind a chance to claim.
    sleep(Duration::from_millis(200)).await;
    let after = row_of::<Budgeted>(pool, "after").await;
    assert_eq!(
        (after.status.as_str(), after.generation),
        ("READY", 0),
        "stopped claiming"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_claimed_ahead_goes_back_uncounted_at_shutdown() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names: Vec<String> = (0..10).map(|n| format!("event-{n:02}")).collect();
    enqueue(pool, &names.iter().map(|n| budgeted(n)).collect::<Vec<_>>()).await;
    let shutdown = CancellationToken::new();
    let sink = WaitsForTheClaimAhead {
        pool: pool.clone(),
        ahead: 5,
        first: Arc::default(),
        shutdown: Some(shutdown.clone()),
        published: Arc::default(),
    };
    let relay = Relay::<Budgeted, _>::new(db.connect(3).await?, sink.clone())
        .concurrency(1)
        .batch_size(5);
    timeout(Duration::from_secs(15), relay.run(shutdown)).await??;
    assert_eq!(
        *lock(&sink.first),
        Some(true),
        "the second batch was claimed ahead"
    );

    for (n, name) in names.iter().enumerate() {
        let row: Row = row_of::<Budgeted>(pool, name.as_str()).await;
        if n < 5 {
            assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{name}");
        } else {
            // Claimed (generation 1), never sent: back, due now, the attempt not counted.
            assert_eq!(
                (row.status.as_str(), row.generation, row.attempts),
                ("READY", 1, 0),
                "{name}"
            );
            assert!(row.due_in <= 0.0, "{name} is due again");
        }
    }
    db.drop_schema().await?;
    Ok(())
}
