//! Failures: transient ones back off within their budget, permanent ones are `DEAD` at
//! once, panicking and hung sinks are contained, and every cause is logged once.

use std::collections::BTreeSet;
use std::panic::AssertUnwindSafe;
use std::str::FromStr as _;
use std::time::Duration;

use futures_util::FutureExt as _;
use outbox::{
    Delivery, Relay, Sink, SinkError,
    relay::{Backoff, MemorySink},
};
use outbox_testkit::app::OrderPlaced;
use outbox_testkit::counters::Counters;
use outbox_testkit::events::Budgeted;
use outbox_testkit::logs::Captured;
use outbox_testkit::rows::{count, enqueue, row_of, status};
use outbox_testkit::running::{Running, start};
// Generations start at 0 here, as in the recovery lab, so that expectations read 1, 2,
// 3 (`table/statements.rs` checks the random start of production).
use outbox_testkit::schema::schema_from_zero;
use outbox_testkit::{TestResult, wait_until};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use crate::{
    Plan, ScriptSink, Seen, Wait, budgeted, fast, record_history, retry_delays,
    two_more_empty_claims,
};

#[tokio::test]
async fn transient_failures_back_off_with_growing_delays_until_the_budget_is_spent() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    record_history(pool, "budget_events").await;
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|_| Err(SinkError::transient("broker unavailable")))
            .collect(),
    });
    let (base, cap) = (Duration::from_millis(100), Duration::from_millis(300));
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .retry_backoff(Backoff::new(base, cap)),
    );
    let id = budgeted("flaky").enqueue(pool).await?.into_event_id();
    wait_until("the event is DEAD", Duration::from_secs(10), async || {
        status::<Budgeted>(pool, &id).await == "DEAD"
    })
    .await;
    two_more_empty_claims(&counters, "budget_events").await;
    relay.stop().await?;

    assert_eq!(
        sink.deliveries(),
        [
            Seen::new(&id, 1, 1),
            Seen::new(&id, 2, 2),
            Seen::new(&id, 3, 3)
        ],
        "three claims, then never again"
    );
    let delays = retry_delays(pool).await;
    // Equal jitter: attempt n waits between half and all of min(base * 2^(n-1), cap).
    assert_eq!(delays.len(), 2, "{delays:?}");
    assert!((50.0..=100.0).contains(&delays[0]), "{delays:?}");
    assert!((100.0..=200.0).contains(&delays[1]), "{delays:?}");
    assert!(delays[1] > delays[0], "the delay grows: {delays:?}");
    assert!(
        delays.iter().all(|&d| d <= 300.0),
        "never above the cap: {delays:?}"
    );

    let row = row_of::<Budgeted>(pool, &id).await;
    assert_eq!((row.generation, row.attempts), (3, 3));
    let error = row.last_error.unwrap();
    assert!(
        error.contains("attempt budget exhausted after 3 of 3 claims")
            && error.contains("broker unavailable"),
        "{error}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn retry_delays_stop_growing_at_the_backoff_cap() -> TestResult {
    let db = schema_from_zero(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    record_history(pool, "order_events").await;
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|_| Err(SinkError::transient("broker unavailable")))
            .collect(),
    });
    let relay = start(
        fast(Relay::<OrderPlaced, _>::new(pool.clone(), sink.clone())).retry_backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(80),
        )),
    );
    let event = OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: "ada".into(),
        total_cents: 1,
        note: None,
        lines: vec![],
    };
    let id = event.enqueue(pool).await?.into_event_id();
    wait_until("the event is DEAD", Duration::from_secs(15), async || {
        status::<OrderPlaced>(pool, &id).await == "DEAD"
    })
    .await;
    relay.stop().await?;

    let delays = retry_delays(pool).await;
    // OrderPlaced allows 10 claims: 9 retries, whose ceilings are 20, 40, then 80 ms.
    assert_eq!(delays.len(), 9, "{delays:?}");
    for (n, delay) in delays.iter().enumerate() {
        let ceiling = [20.0, 40.0, 80.0][n.min(2)];
        assert!(
            (ceiling / 2.0..=ceiling).contains(delay),
            "retry {}: {delay} ms, ceiling {ceiling} ms: {delays:?}",
            n + 1
        );
    }
    assert!(delays[0] < delays[1] && delays[1] < delays[2], "{delays:?}");
    let error = row_of::<OrderPlaced>(pool, &id).await.last_error.unwrap();
    assert!(error.contains("after 10 of 10 claims"), "{error}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_permanent_failure_moves_the_event_to_dead_at_once() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|s| {
                if s.event_id == "poison" {
                    Err(SinkError::permanent("rejected: message too large"))
                } else {
                    Ok(())
                }
            })
            .collect(),
    });
    enqueue(pool, &[budgeted("poison"), budgeted("fine")]).await;
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone())));
    wait_until("both are recorded", Duration::from_secs(5), async || {
        status::<Budgeted>(pool, "poison").await == "DEAD"
            && status::<Budgeted>(pool, "fine").await == "SENT"
    })
    .await;
    two_more_empty_claims(&counters, "budget_events").await;
    relay.stop().await?;

    let poison = row_of::<Budgeted>(pool, "poison").await;
    assert_eq!(
        (
            poison.generation,
            poison.attempts,
            poison.last_error.as_deref()
        ),
        (1, 1, Some("rejected: message too large")),
        "no retry, the sink's message kept"
    );
    assert_eq!(
        sink.deliveries(),
        [Seen::new("poison", 1, 1), Seen::new("fine", 1, 1)]
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_hung_sink_is_cut_off_by_the_send_timeout_and_the_batch_is_retried() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The first send hangs; the broker is back for the second.
    let sink = ScriptSink::new(|call, seen| {
        Plan::after(
            if call == 0 {
                Wait::Forever
            } else {
                Wait::Nothing
            },
            seen,
        )
    });
    record_history(pool, "budget_events").await;
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink.clone()))
            .send_timeout(Duration::from_millis(200))
            .retry_backoff(Backoff::new(Duration::from_secs(2), Duration::from_secs(2))),
    );
    budgeted("hung").enqueue(pool).await?;
    let mut retried = None;
    wait_until(
        "the timed-out send is retried",
        Duration::from_secs(5),
        async || {
            let row = row_of::<Budgeted>(pool, "hung").await;
            let done = row.status == "READY" && row.attempts == 1;
            retried = done.then_some(row);
            done
        },
    )
    .await;
    let retried = retried.expect("seen");
    let error = retried.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("publish timed out after 200ms"), "{error}");
    // Backed off by 1 to 2 s (equal jitter on 2 s), as the outcome's statement set it.
    let delays = retry_delays(pool).await;
    assert!(
        matches!(delays[..], [delay] if (1000.0..=2000.0).contains(&delay)),
        "{delays:?}"
    );
    assert_eq!(sink.abandoned(), 1, "the hung send was dropped");
    assert!(relay.is_running());

    wait_until("the retry is SENT", Duration::from_secs(5), async || {
        status::<Budgeted>(pool, "hung").await == "SENT"
    })
    .await;
    let row = row_of::<Budgeted>(pool, "hung").await;
    assert_eq!((row.generation, row.attempts), (2, 2));
    assert_eq!(sink.calls().len(), 2);
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_sink_that_panics_on_one_event_costs_its_batch_mates_nothing_and_the_relay_goes_on()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &["a", "poison", "b", "c"].map(budgeted)).await;
    let sink = ScriptSink::new(|_, seen| {
        assert!(
            !seen.iter().any(|s| s.event_id == "poison"),
            "cannot serialize poison"
        );
        Plan::ok(seen)
    });
    let relay = until_poison_is_dead(pool, sink.clone()).await;

    for name in ["a", "b", "c"] {
        let row = row_of::<Budgeted>(pool, name).await;
        assert_eq!((row.status.as_str(), row.attempts), ("SENT", 1), "{name}");
    }
    let poison = row_of::<Budgeted>(pool, "poison").await;
    assert_eq!(poison.attempts, 3, "the culprit alone spent its budget");
    let reason = poison.last_error.unwrap_or_default();
    assert!(
        reason.starts_with("attempt budget exhausted after 3 of 3 claims: sink panicked: ")
            && reason.contains("cannot serialize poison"),
        "{reason}"
    );
    let calls = sink.calls();
    let names = |call: &[Seen]| call.iter().map(|s| s.event_id.clone()).collect::<Vec<_>>();
    assert_eq!(names(&calls[0]), ["a", "poison", "b", "c"], "the batch");
    assert_eq!(
        calls[1..5].iter().map(|c| names(c)).collect::<Vec<_>>(),
        [["a"], ["poison"], ["b"], ["c"]],
        "then one event at a time"
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_sweep_that_keeps_failing_leaves_the_other_claims_room_to_publish() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // An expired claim, which only a sweep reclaims; and every reclaim fails, as a sweep
    // the server cancels after its statement_timeout does (with the horizon held back,
    // a sweep can take seconds).
    enqueue(pool, &[budgeted("expired")]).await;
    sqlx::raw_sql(
        "UPDATE budget_events SET status = 'INPROGRESS', attempts = 1,
             lease_until = now() - interval '1 minute' WHERE event_id = 'expired';
         CREATE FUNCTION cancel_reclaims() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.status = 'INPROGRESS' AND NEW.generation <> OLD.generation THEN
                 RAISE EXCEPTION 'canceling statement due to statement timeout'
                     USING ERRCODE = '57014';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER cancel_reclaims BEFORE UPDATE ON budget_events
             FOR EACH ROW EXECUTE FUNCTION cancel_reclaims();",
    )
    .execute(pool)
    .await?;
    let names: Vec<String> = (0..300).map(|i| format!("e{i}")).collect();
    let events: Vec<Budgeted> = names.iter().map(|name| budgeted(name)).collect();
    enqueue(pool, &events).await;

    let sink = MemorySink::<Budgeted>::new();
    let relay = start(
        fast(Relay::new(pool.clone(), sink.clone()))
            .batch_size(20)
            .concurrency(2),
    );
    wait_until(
        "the 300 due events SENT",
        Duration::from_secs(30),
        async || count::<Budgeted>(pool, "SENT").await == 300,
    )
    .await;
    relay.stop().await?;
    let published: Vec<String> = sink
        .published()
        .iter()
        .map(|p| p.event_id.to_string())
        .collect();
    let distinct: BTreeSet<&String> = published.iter().collect();
    assert_eq!(
        (published.len(), distinct.len()),
        (300, 300),
        "each published once: no outcome lost with a failed sweep"
    );
    assert_eq!(status::<Budgeted>(pool, "expired").await, "INPROGRESS");
    db.drop_schema().await?;
    Ok(())
}

/// Fails each event as its name says: `refused-..` for good, any other for now.
#[derive(Clone)]
struct FailingByName;

impl Sink<Budgeted> for FailingByName {
    async fn publish(&self, batch: &[Delivery<'_, Budgeted>]) -> Vec<Result<(), SinkError>> {
        batch
            .iter()
            .map(|delivery| {
                let name = &delivery.event().name;
                Err(if name.starts_with("refused") {
                    SinkError::permanent(format!("no such topic for {name}"))
                } else {
                    SinkError::transient(format!("broker busy for {name}"))
                })
            })
            .collect()
    }
}

/// A broker that fails every event of a batch writes one line per cause, not one per
/// event: a warning for the retries, an error for the events refused for good, another
/// for those whose budget ran out; each naming the table, an event, its attempt and the
/// reason. (The next line of a cause, after the interval, says how many were left out:
/// the failure log's own test.)
#[tokio::test]
async fn a_failing_broker_logs_one_line_per_cause_with_the_event_its_attempt_and_the_reason()
-> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    let names = [
        "busy-1",
        "busy-2",
        "busy-3",
        "busy-4",
        "refused-1",
        "refused-2",
        "refused-3",
        "last-1",
        "last-2",
    ];
    enqueue(pool, &names.map(budgeted)).await;
    // The `last-..` events used two of their three attempts already.
    sqlx::query("UPDATE budget_events SET attempts = 2 WHERE event_id LIKE 'last-%'")
        .execute(pool)
        .await?;
    let logs = Captured::default();
    let _guard = logs.this_thread(tracing_subscriber::filter::LevelFilter::WARN);
    let hour = Duration::from_hours(1);
    let relay = start(
        fast(Relay::new(pool.clone(), FailingByName))
            .batch_size(100)
            .retry_backoff(Backoff::new(hour, hour)),
    );
    wait_until(
        "5 DEAD and 4 retried",
        Duration::from_secs(30),
        async || {
            count::<Budgeted>(pool, "DEAD").await == 5
                && count::<Budgeted>(pool, "READY").await == 4
        },
    )
    .await;
    relay.stop().await?;

    let text = logs.text();
    let line = |message: &str| -> Vec<&str> {
        text.lines().filter(|line| line.contains(message)).collect()
    };
    let retried = line("publishing an event failed; it will be retried");
    assert_eq!(retried.len(), 1, "{text}");
    for field in [
        " WARN ",
        "table=\"budget_events\"",
        "event_id=busy-",
        "attempt=1 ",
        "reason=broker busy for busy-",
        "suppressed=0",
    ] {
        assert!(retried[0].contains(field), "{field} in {}", retried[0]);
    }
    let refused = line("publishing an event failed for good; it is DEAD now");
    assert_eq!(refused.len(), 1, "{text}");
    for field in [
        " ERROR ",
        "event_id=refused-",
        "attempt=1 ",
        "reason=no such topic for refused-",
    ] {
        assert!(refused[0].contains(field), "{field} in {}", refused[0]);
    }
    let exhausted = line("failed on the last attempt of its budget; it is DEAD now");
    assert_eq!(exhausted.len(), 1, "{text}");
    for field in [
        " ERROR ",
        "event_id=last-",
        "attempt=3 ",
        "reason=broker busy for last-",
    ] {
        assert!(exhausted[0].contains(field), "{field} in {}", exhausted[0]);
    }
    assert_eq!(text.lines().count(), 3, "nothing else was logged:\n{text}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_reason_a_latin1_database_cannot_hold_is_stored_escaped_and_the_relay_goes_on()
-> TestResult {
    let base = outbox::testing::database_url().await?;
    let name = format!(
        "outbox_latin1_{}",
        &uuid::Uuid::now_v7().simple().to_string()[20..]
    );
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&base)
        .await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
    )))
    .execute(&admin)
    .await?;
    let options = PgConnectOptions::from_str(&base)?.database(&name);
    // The database is the cluster's: dropped whatever the test did.
    let outcome = AssertUnwindSafe(escaped_in_latin1(options))
        .catch_unwind()
        .await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)")))
        .execute(&admin)
        .await?;
    match outcome {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

async fn escaped_in_latin1(options: PgConnectOptions) -> TestResult {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    outbox::migrate(&pool, &[Budgeted::migrations()]).await?;
    enqueue(&pool, &[budgeted("snowman"), budgeted("plain")]).await;
    // A broker's reason in characters LATIN1 has (é) and has not (☃).
    let sink = ScriptSink::new(|_, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|s| match s.event_id.as_str() {
                "snowman" => Err(SinkError::permanent("colis refusé ☃")),
                _ => Ok(()),
            })
            .collect(),
    });
    let relay = start(fast(Relay::<Budgeted, _>::new(pool.clone(), sink)));
    wait_until(
        "snowman DEAD, plain SENT",
        Duration::from_secs(10),
        async || {
            status::<Budgeted>(&pool, "snowman").await == "DEAD"
                && status::<Budgeted>(&pool, "plain").await == "SENT"
        },
    )
    .await;
    assert!(relay.is_running(), "recording the reason did not stop it");
    relay.stop().await?;
    let reason = row_of::<Budgeted>(&pool, "snowman").await.last_error;
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("colis refus\\u{e9} \\u{2603}")),
        "{reason:?}"
    );
    pool.close().await;
    Ok(())
}

/// A relay of `sink` retrying within milliseconds, once the poison event is `DEAD`:
/// still running, as a sink that panics never stops it.
async fn until_poison_is_dead<S: Sink<Budgeted>>(pool: &PgPool, sink: S) -> Running {
    let relay = start(
        fast(Relay::<Budgeted, _>::new(pool.clone(), sink)).retry_backoff(Backoff::new(
            Duration::from_millis(10),
            Duration::from_millis(20),
        )),
    );
    wait_until("poison is DEAD", Duration::from_secs(10), async || {
        status::<Budgeted>(pool, "poison").await == "DEAD"
    })
    .await;
    assert!(
        relay.is_running(),
        "a panicking sink does not stop the relay"
    );
    relay
}

/// A sink that checks each batch before it returns the future publishing it, and
/// panics on the poison event there.
#[derive(Clone)]
struct CheckedFirst(MemorySink<Budgeted>);

impl Sink<Budgeted> for CheckedFirst {
    fn publish(
        &self,
        batch: &[Delivery<'_, Budgeted>],
    ) -> impl Future<Output = Vec<Result<(), SinkError>>> + Send {
        assert!(
            !batch.iter().any(|d| d.event_id().as_str() == "poison"),
            "cannot serialize poison"
        );
        self.0.publish(batch)
    }
}

#[tokio::test]
async fn a_sink_that_panics_before_it_returns_its_future_is_contained_as_well() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue(pool, &["a", "poison", "b"].map(budgeted)).await;
    let sink = CheckedFirst(MemorySink::new());
    let relay = until_poison_is_dead(pool, sink.clone()).await;
    for name in ["a", "b"] {
        assert_eq!(status::<Budgeted>(pool, name).await, "SENT", "{name}");
    }
    let reason = row_of::<Budgeted>(pool, "poison").await.last_error;
    assert!(
        reason
            .as_deref()
            .unwrap_or_default()
            .contains("cannot serialize poison"),
        "{reason:?}"
    );
    relay.stop().await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_retry_is_claimed_when_its_delay_is_over_not_at_the_next_poll() -> TestResult {
    let db = schema_from_zero(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    // The first attempt fails; the retry goes through.
    let sink = ScriptSink::new(|call, seen| Plan {
        wait: Wait::Nothing,
        results: seen
            .iter()
            .map(|_| {
                if call == 0 {
                    Err(SinkError::transient("broker busy"))
                } else {
                    Ok(())
                }
            })
            .collect(),
    });
    // No poll within the test: only the relay's own record of the retry's time wakes it.
    let relay = start(
        Relay::<Budgeted, _>::new(pool.clone(), sink.clone())
            .poll_interval(Duration::from_hours(1))
            .retry_backoff(Backoff::new(
                Duration::from_millis(300),
                Duration::from_millis(300),
            )),
    );
    let id = budgeted("retried").enqueue(pool).await?.into_event_id();
    wait_until("the retry is SENT", Duration::from_secs(10), async || {
        status::<Budgeted>(pool, &id).await == "SENT"
    })
    .await;
    relay.stop().await?;
    let attempts: Vec<u32> = sink
        .calls()
        .iter()
        .flatten()
        .map(|seen| seen.attempt)
        .collect();
    assert_eq!(
        attempts,
        [1, 2],
        "published twice: the failure, then its retry"
    );
    db.drop_schema().await?;
    Ok(())
}
