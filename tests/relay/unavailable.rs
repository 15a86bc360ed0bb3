//! A destination that is down: the sink says so ([`SinkError::Unavailable`]) and the
//! relay, against real PostgreSQL, hands the rows back without counting the attempt,
//! backs off (exponential, capped), logs the outage once when it begins and once when it
//! ends, and publishes everything once the destination is back.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox::Outbox;
use outbox::{
    Delivery, Relay, Sink, SinkError,
    relay::{Backoff, MemorySink},
};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{Budgeted, LabEvent};
use outbox_testkit::logs::Captured;
use outbox_testkit::rows::{count, enqueue, row_of};
use outbox_testkit::running::start;
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use tokio::time::Instant;

/// Refuses its first `down_for` publish calls as unavailable, then publishes into a
/// [`MemorySink`]. Remembers when each call came and how many deliveries it had.
#[derive(Clone)]
struct OutageSink {
    down_for: usize,
    calls: Arc<Mutex<Vec<(Instant, usize)>>>,
    up: MemorySink<Budgeted>,
}

impl OutageSink {
    fn calls(&self) -> Vec<(Instant, usize)> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Sink<Budgeted> for OutageSink {
    async fn publish(&self, batch: &[Delivery<'_, Budgeted>]) -> Vec<Result<(), SinkError>> {
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
            calls.push((Instant::now(), batch.len()));
            calls.len()
        };
        if call <= self.down_for {
            return batch
                .iter()
                .map(|_| Err(SinkError::unavailable("connection refused")))
                .collect();
        }
        self.up.publish(batch).await
    }
}

/// `Budgeted` allows 3 attempts. The destination refuses 15 batches in a row, each
/// claiming every event again: counted, that would have sent all of them to `DEAD` after
/// the third. Handed back uncounted, every event is `SENT` after one counted attempt.
#[tokio::test]
async fn a_long_outage_burns_no_attempts_backs_off_and_logs_twice() -> TestResult {
    let logged = Captured::default();
    // A current-thread runtime polls the relay's tasks on this thread: they log and
    // count here.
    let _logging = logged.this_thread(tracing_subscriber::filter::LevelFilter::INFO);
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);

    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let events: Vec<Budgeted> = (0..25)
        .map(|n| Budgeted {
            name: format!("event-{n:02}"),
        })
        .collect();
    enqueue(pool, &events).await;

    let refused = 15;
    let sink = OutageSink {
        down_for: refused,
        calls: Arc::default(),
        up: MemorySink::new(),
    };
    let (base, cap) = (Duration::from_millis(20), Duration::from_millis(200));
    let relay = start(
        Relay::<Budgeted, _>::new(pool.clone(), sink.clone())
            .batch_size(100)
            .unavailable_backoff(Backoff::new(base, cap)),
    );
    wait_until("all 25 are SENT", Duration::from_secs(30), async || {
        count::<Budgeted>(pool, "SENT").await == 25
    })
    .await;
    relay.stop().await?;

    // Every claim was delivered; the first `refused` were handed back.
    let calls = sink.calls();
    assert!(calls.len() > refused, "{} calls", calls.len());
    assert!(
        calls[..refused].iter().all(|&(_, size)| size == 25),
        "each refused batch was claimed whole again: {calls:?}"
    );
    // The worker backed off after each refusal: at least half of `base * 2^(n-1)`,
    // capped, and never by much more than the cap.
    for (n, pair) in calls[..=refused].windows(2).enumerate() {
        let gap = pair[1].0 - pair[0].0;
        let ceiling = base.saturating_mul(1 << n.min(10)).min(cap);
        assert!(
            gap >= ceiling / 2,
            "after refusal {}: waited {gap:?}, less than half of {ceiling:?}",
            n + 1
        );
        // (A few seconds of margin, for a loaded machine.)
        assert!(
            gap < cap + Duration::from_secs(5),
            "after refusal {}: waited {gap:?}, far past the cap",
            n + 1
        );
    }

    // Nothing burnt: each row used one counted attempt, over `refused + 1` claims.
    assert_eq!(count::<Budgeted>(pool, "DEAD").await, 0);
    for event in &events {
        let row = row_of::<Budgeted>(pool, event.name.as_str()).await;
        assert_eq!(
            (row.status.as_str(), row.attempts, row.generation),
            ("SENT", 1, i64::try_from(refused)? + 1),
            "{}",
            event.name
        );
    }
    let published = sink.up.published();
    assert_eq!(published.len(), 25, "each published once, after the outage");
    assert!(published.iter().all(|p| p.attempt == 1));

    let table = Budgeted::SPEC.table();
    assert_eq!(
        counters.get(outbox::relay::metric::UNAVAILABLE, table),
        refused as u64
    );
    assert_eq!(
        counters.get(outbox::relay::metric::RELEASED, table),
        25 * refused as u64
    );
    assert_eq!(counters.get(outbox::relay::metric::RETRIED, table), 0);
    assert_eq!(
        (
            logged.lines_with(&["the destination is unavailable", table]),
            logged.lines_with(&["the destination is available again", table]),
        ),
        (1, 1),
        "one line when the outage began, one when it ended"
    );
    db.drop_schema().await?;
    Ok(())
}

/// In a batch, only the deliveries the sink says are unavailable go back uncounted; the
/// others are recorded as the sink said.
#[tokio::test]
async fn only_the_unavailable_deliveries_of_a_batch_are_handed_back() -> TestResult {
    #[derive(Clone, Default)]
    struct HalfDown {
        calls: Arc<Mutex<usize>>,
    }
    impl Sink<LabEvent> for HalfDown {
        async fn publish(&self, batch: &[Delivery<'_, LabEvent>]) -> Vec<Result<(), SinkError>> {
            let first = {
                let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
                *calls += 1;
                *calls == 1
            };
            batch
                .iter()
                .map(|d| match d.event().name.as_str() {
                    "down" if first => Err(SinkError::unavailable("partition leader moving")),
                    "bad" => Err(SinkError::permanent("too large")),
                    _ => Ok(()),
                })
                .collect()
        }
    }
    let db = schema_from_zero(&[LabEvent::migrations()]).await?;
    let pool = db.pool();
    let names = ["ok", "down", "bad"];
    let events: Vec<LabEvent> = names
        .iter()
        .map(|n| LabEvent { name: (*n).into() })
        .collect();
    enqueue(pool, &events).await;
    let relay = start(
        Relay::<LabEvent, _>::new(pool.clone(), HalfDown::default()).unavailable_backoff(
            Backoff::new(Duration::from_millis(10), Duration::from_millis(10)),
        ),
    );
    wait_until("'down' is SENT", Duration::from_secs(30), async || {
        row_of::<LabEvent>(pool, "down").await.status == "SENT"
    })
    .await;
    relay.stop().await?;
    let rows = [
        row_of::<LabEvent>(pool, "ok").await,
        row_of::<LabEvent>(pool, "down").await,
        row_of::<LabEvent>(pool, "bad").await,
    ];
    let seen: Vec<(&str, i32, i64)> = rows
        .iter()
        .map(|r| (r.status.as_str(), r.attempts, r.generation))
        .collect();
    assert_eq!(
        seen,
        [("SENT", 1, 1), ("SENT", 1, 2), ("DEAD", 1, 1)],
        "ok, down, bad: (status, attempts, generation)"
    );
    // The hand-back says why, where `outbox status` reads it (kept once sent).
    let errors: Vec<Option<&str>> = rows.iter().map(|r| r.last_error.as_deref()).collect();
    assert_eq!(
        errors,
        [
            None,
            Some("destination unavailable: partition leader moving"),
            Some("too large")
        ]
    );
    db.drop_schema().await?;
    Ok(())
}
