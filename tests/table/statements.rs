//! Every generated statement, executed against real PostgreSQL for several struct shapes.

use std::time::Duration;

use outbox::testing::TestSchema;
use outbox::{Enqueued, Outbox, OutboxError, Retried};
use outbox_testkit::app::{EmailChanged, Line, OrderPlaced};
use outbox_testkit::counters::Counters;
use outbox_testkit::events::{Address, Budgeted, EveryType, Tick};
use outbox_testkit::rows::{expire, row_of, status};
use outbox_testkit::{TestResult, wait_until};
use sqlx::PgPool;
// Generations start at a random value here, as in production: these tests check that.
use outbox_testkit::schema::schema_with;

const DEAD_TOTAL: &str = outbox::relay::metric::DEAD;

fn every_type(key: i64) -> EveryType {
    let date = chrono::NaiveDate::from_ymd_opt(2026, 12, 2).unwrap();
    let ctime = chrono::NaiveTime::from_hms_micro_opt(14, 53, 57, 123_456).unwrap();
    let tdate = time::Date::from_calendar_date(2026, time::Month::December, 2).unwrap();
    let ttime = time::Time::from_hms_micro(14, 53, 57, 123_456).unwrap();
    EveryType {
        key,
        small: -7,
        int: 1 << 20,
        big: i64::MAX,
        single: 1.5,
        double: -2.25,
        flag: true,
        text: "naïve ☃".into(),
        bytes: vec![0, 159, 255],
        uuid: uuid::Uuid::now_v7(),
        chrono_date: date,
        chrono_time: ctime,
        chrono_naive: date.and_time(ctime),
        chrono_utc: date.and_time(ctime).and_utc(),
        time_date: tdate,
        time_time: ttime,
        time_primitive: time::PrimitiveDateTime::new(tdate, ttime),
        time_offset: time::PrimitiveDateTime::new(tdate, ttime).assume_utc(),
        value: serde_json::json!({"a": [1, 2, {"b": null}]}),
        maybe_int: None,
        maybe_uuid: Some(uuid::Uuid::nil()),
        maybe_utc: None,
        address: Address {
            city: "Lyon".into(),
        },
        maybe_address: None,
        r#type: "keyword column".into(),
    }
}

fn order() -> OrderPlaced {
    OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: "ada".into(),
        total_cents: 4_200,
        note: Some("leave at the door".into()),
        lines: vec![Line {
            sku: "tea".into(),
            quantity: 2,
        }],
    }
}

/// The (status, generation, last_error) of row `id`.
async fn status_of<T: Outbox>(pool: &PgPool, id: i64) -> (String, i64, Option<String>) {
    let row = row_of::<T>(pool, id).await;
    (row.status, row.generation, row.last_error)
}

/// Enqueues `n` budgeted events named `e0`, `e1`, ...
async fn enqueue_numbered(pool: &PgPool, n: usize) -> Result<(), OutboxError> {
    for i in 0..n {
        Budgeted {
            name: format!("e{i}"),
        }
        .enqueue(pool)
        .await?;
    }
    Ok(())
}

#[tokio::test]
async fn an_event_enqueued_in_a_business_transaction_is_claimed_and_completed() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    let event = order();

    let mut tx = pool.begin().await?;
    let id = event.enqueue(&mut *tx).await?.into_event_id();
    tx.commit().await?;
    assert_eq!(
        id.as_str(),
        event.order_id.to_string(),
        "the event_id field is the stable id"
    );

    let claim = OrderPlaced::claim(pool)
        .await?
        .expect("the committed event is due");
    assert_eq!(claim.event(), &event);
    assert_eq!(claim.event_id(), &id);
    assert_eq!(claim.attempt(), 1);
    assert!(claim.lease_until() > std::time::SystemTime::now());
    let (row, generation) = (claim.id(), claim.generation().get());
    claim.complete(pool).await?;

    assert_eq!(
        status_of::<OrderPlaced>(pool, row).await,
        ("SENT".into(), generation, None)
    );
    assert!(
        OrderPlaced::claim(pool).await?.is_none(),
        "SENT events are never claimed again"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_rolled_back_business_transaction_leaves_no_event() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let mut tx = db.pool().begin().await?;
    order().enqueue(&mut *tx).await?;
    tx.rollback().await?;
    assert!(OrderPlaced::claim(db.pool()).await?.is_none());
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn every_column_type_round_trips() -> TestResult {
    let db = schema_with(&[EveryType::migrations()]).await?;
    let events = [
        every_type(1),
        EveryType {
            maybe_int: Some(3),
            maybe_address: Some(Address {
                city: "Oslo".into(),
            }),
            ..every_type(2)
        },
    ];
    for e in &events {
        e.enqueue(db.pool()).await?;
    }
    let claims = EveryType::claim_batch(db.pool(), 10).await?;
    let got: Vec<&EveryType> = claims.iter().map(outbox::Claim::event).collect();
    assert_eq!(got, events.iter().collect::<Vec<_>>());
    assert_eq!(claims[1].event_id(), &"2");
    for claim in claims {
        claim.complete(db.pool()).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn many_events_are_enqueued_in_one_statement() -> TestResult {
    let db = schema_with(&[EveryType::migrations()]).await?;
    let events: Vec<EveryType> = (1..=3)
        .map(|key| EveryType {
            maybe_int: Some(i32::try_from(key).unwrap()),
            maybe_address: (key == 2).then(|| Address {
                city: "Oslo".into(),
            }),
            ..every_type(key)
        })
        .collect();
    let mut tx = db.pool().begin().await?;
    let ids = EveryType::enqueue_all(&events, &mut *tx).await?;
    tx.commit().await?;
    assert_eq!(
        ids.iter()
            .map(|e| e.event_id().as_str())
            .collect::<Vec<_>>(),
        ["1", "2", "3"]
    );
    assert!(ids.iter().all(Enqueued::is_new));
    let claims = EveryType::claim_batch(db.pool(), 10).await?;
    let got: Vec<&EveryType> = claims.iter().map(outbox::Claim::event).collect();
    assert_eq!(got, events.iter().collect::<Vec<_>>());
    for claim in claims {
        claim.complete(db.pool()).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

/// Which of `ids` the table holds, and how many rows each has.
async fn rows_per_event_id<T: Outbox>(pool: &PgPool) -> Vec<(String, i64)> {
    let sql = format!(
        "SELECT event_id, count(*) FROM {} GROUP BY event_id ORDER BY event_id",
        T::SPEC.table()
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn orders(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn insert_order(tx: &mut sqlx::PgConnection, event: &OrderPlaced) -> TestResult {
    sqlx::query("INSERT INTO orders (id, customer, total_cents) VALUES ($1, $2, $3)")
        .bind(event.order_id)
        .bind(&event.customer)
        .bind(event.total_cents)
        .execute(tx)
        .await?;
    Ok(())
}

#[tokio::test]
async fn a_duplicate_event_id_never_discards_the_business_write() -> TestResult {
    let db = TestSchema::new().await?;
    let app = outbox::schema::refinery::Runner::new(&outbox_testkit::app::app_migrations());
    outbox::schema::migrate_with_app(db.pool(), &app, &[OrderPlaced::migrations()]).await?;
    let event = order();
    assert!(event.enqueue(db.pool()).await?.is_new());

    // A retried request: the order row is new, its event is already queued.
    let retried = OrderPlaced {
        order_id: event.order_id,
        note: Some("second try".into()),
        ..order()
    };
    let mut tx = db.pool().begin().await?;
    insert_order(&mut tx, &retried).await?;
    let enqueued = retried.enqueue(&mut *tx).await?;
    assert_eq!(enqueued, Enqueued::Duplicate(event.order_id.into()));
    // The transaction is intact: more business work succeeds, and so does the commit.
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tx.commit().await?;

    assert_eq!(orders(db.pool()).await, 1, "the business row committed");
    assert_eq!(
        rows_per_event_id::<OrderPlaced>(db.pool()).await,
        [(event.order_id.to_string(), 1)],
        "exactly one event row"
    );
    let claim = OrderPlaced::claim(db.pool()).await?.expect("due");
    assert_eq!(claim.event(), &event, "the event first queued is kept");
    claim.complete(db.pool()).await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_with_duplicates_writes_each_new_event_once_and_says_which_were_not() -> TestResult
{
    let db = schema_with(&[EveryType::migrations()]).await?;
    EveryType::enqueue_all(&[every_type(2)], db.pool()).await?;

    let mut tx = db.pool().begin().await?;
    let batch = [every_type(4), every_type(2), every_type(5), every_type(4)];
    let enqueued = EveryType::enqueue_all(&batch, &mut *tx).await?;
    tx.commit().await?;
    assert_eq!(
        enqueued,
        [
            Enqueued::New("4".into()),
            Enqueued::Duplicate("2".into()),
            Enqueued::New("5".into()),
            Enqueued::Duplicate("4".into()),
        ]
    );
    assert_eq!(
        rows_per_event_id::<EveryType>(db.pool()).await,
        [("2".into(), 1), ("4".into(), 1), ("5".into(), 1)]
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_event_id_that_cannot_be_stored_is_refused_before_anything_is_written() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let named = |name: &str| Budgeted { name: name.into() };
    let long = "x".repeat(20_000);
    let cases = [
        ("", "an event id cannot be empty"),
        ("  \t", "an event id cannot be blank"),
        (
            long.as_str(),
            "an event id is at most 1024 bytes, this one has 20000",
        ),
        ("a\0b", "an event id cannot contain a NUL character"),
    ];
    let mut tx = db.pool().begin().await?;
    for (id, expected) in cases {
        let err = named(id).enqueue(&mut *tx).await.unwrap_err();
        assert!(
            matches!(&err, OutboxError::InvalidEventId { table: "budget_events", reason, .. } if reason == expected),
            "{id:?}: {err}"
        );
        let err = Budgeted::enqueue_all(&[named("fine"), named(id)], &mut *tx)
            .await
            .unwrap_err();
        assert!(matches!(err, OutboxError::InvalidEventId { .. }), "{err}");
    }
    let err = named(&long).enqueue(&mut *tx).await.unwrap_err();
    assert!(
        err.to_string().contains(&format!("{}...", "x".repeat(64))),
        "{err}"
    );
    assert!(
        !err.to_string().contains(&"x".repeat(65)),
        "shortened: {err}"
    );
    // The longest id is stored, and the transaction was never aborted.
    let longest = "y".repeat(outbox::EventId::MAX_LEN);
    assert!(named(&longest).enqueue(&mut *tx).await?.is_new());
    tx.commit().await?;
    assert_eq!(
        rows_per_event_id::<Budgeted>(db.pool()).await,
        [(longest, 1)]
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_event_without_an_id_field_gets_a_uuid_v7() -> TestResult {
    let db = schema_with(&[EmailChanged::migrations(), Tick::migrations()]).await?;
    let event = EmailChanged {
        customer: "ada".into(),
        email: "ada@example.com".into(),
        referrer: None,
    };
    let id = event.enqueue(db.pool()).await?.into_event_id();
    assert_eq!(uuid::Uuid::parse_str(id.as_str())?.get_version_num(), 7);
    let claim = EmailChanged::claim(db.pool()).await?.expect("due");
    assert_eq!((claim.event_id(), claim.event()), (&id, &event));
    claim.complete(db.pool()).await?;

    let tick = Tick {}.enqueue(db.pool()).await?.into_event_id();
    let claim = Tick::claim(db.pool()).await?.expect("due");
    assert_eq!(claim.event_id(), &tick);
    claim.complete(db.pool()).await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_batch_claims_in_id_order_up_to_its_limit() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue_numbered(db.pool(), 5).await?;
    let first = Budgeted::claim_batch(db.pool(), 3).await?;
    let names: Vec<&str> = first.iter().map(|c| c.event().name.as_str()).collect();
    assert_eq!(names, ["e0", "e1", "e2"]);
    let rest = Budgeted::claim_batch(db.pool(), 10).await?;
    assert_eq!(rest.len(), 2, "claimed rows are not claimed twice");
    assert!(Budgeted::claim_batch(db.pool(), 10).await?.is_empty());
    for claim in first.into_iter().chain(rest) {
        claim.complete(db.pool()).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_claim_is_planned_once_per_connection_not_on_every_batch() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    enqueue_numbered(db.pool(), 6).await?;
    let mut conn = db.pool().acquire().await?;
    let mut claims = Vec::new();
    for _ in 0..3 {
        claims.extend(Budgeted::claim_batch(&mut *conn, 2).await?);
    }
    assert_eq!(claims.len(), 6);
    // A `LIMIT $1` would get a custom plan every time: planning is a third of a claim.
    let (generic, custom): (i64, i64) = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
    )
    .bind(Budgeted::SPEC.sql().claim_limited(2, true))
    .fetch_one(&mut *conn)
    .await?;
    assert_eq!((generic, custom), (3, 0), "one plan, used three times");
    drop(conn);
    for claim in claims {
        claim.complete(db.pool()).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_claim_never_reads_the_whole_table() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    sqlx::raw_sql(
        "INSERT INTO budget_events (event_id, status) SELECT 'sent-' || i, 'SENT' FROM generate_series(1, 10000) i;
         INSERT INTO budget_events (event_id) SELECT 'due-' || i FROM generate_series(1, 1000) i;
         ANALYZE budget_events",
    )
    .execute(db.pool())
    .await?;
    let explain = format!("EXPLAIN {}", Budgeted::SPEC.sql().claim_limited(100, true));
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .fetch_all(db.pool())
        .await?;
    let plan = plan.join("\n");
    // Small enough for the planner to hash-join a sequential scan, if it were let.
    assert!(!plan.contains("Seq Scan"), "{plan}");
    assert!(plan.contains("Tid Scan"), "{plan}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn expired_claims_are_reclaimed_first_and_a_claim_locks_only_what_it_returns() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    enqueue_numbered(pool, 4).await?;
    // e0 and e1: claimed by publishers that died; e2 and e3 still READY.
    let abandoned = Budgeted::claim_batch(pool, 2).await?;
    for claim in &abandoned {
        expire::<Budgeted>(pool, claim.id()).await?;
    }

    let mut tx = pool.begin().await?;
    let claims = Budgeted::claim_batch(&mut *tx, 3).await?;
    let taken: Vec<(&str, bool)> = claims
        .iter()
        .map(|c| (c.event().name.as_str(), c.is_reclaim()))
        .collect();
    assert_eq!(taken, [("e0", true), ("e1", true), ("e2", false)]);
    // Another publisher, meanwhile: the one row this claim did not take is free.
    let other = Budgeted::claim_batch(pool, 10).await?;
    let names: Vec<&str> = other.iter().map(|c| c.event().name.as_str()).collect();
    assert_eq!(
        names,
        ["e3"],
        "no row is held locked beyond the claimed ones"
    );
    tx.commit().await?;
    drop((abandoned, claims, other));
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn retry_delays_the_event_and_the_next_claim_bumps_the_generation() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    Budgeted { name: "e".into() }.enqueue(pool).await?;

    let claim = Budgeted::claim(pool).await?.expect("due");
    let (row, first) = (claim.id(), claim.generation().get());
    assert_eq!(
        claim
            .retry_because(pool, Duration::from_hours(1), "broker unavailable")
            .await?,
        Retried::Scheduled
    );
    assert!(
        Budgeted::claim(pool).await?.is_none(),
        "not due for an hour"
    );
    assert_eq!(
        status_of::<Budgeted>(pool, row).await,
        ("READY".into(), first, Some("broker unavailable".into()))
    );

    sqlx::query("UPDATE budget_events SET next_attempt_at = now() WHERE id = $1")
        .bind(row)
        .execute(pool)
        .await?;
    let claim = Budgeted::claim(pool).await?.expect("due again");
    assert_eq!((claim.generation().get(), claim.attempt()), (first + 1, 2));
    // `None` uses the type's retry_delay of one second.
    assert_eq!(claim.retry(pool, None).await?, Retried::Scheduled);
    let due: (f64,) = sqlx::query_as("SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM budget_events WHERE id = $1")
        .bind(row)
        .fetch_one(pool)
        .await?;
    assert!(
        due.0 > 0.0 && due.0 <= 1.0,
        "due in about a second: {}",
        due.0
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn the_attempt_budget_counts_abandoned_claims_and_ends_in_dead() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    Budgeted {
        name: "abandoned".into(),
    }
    .enqueue(pool)
    .await?;
    Budgeted {
        name: "failing".into(),
    }
    .enqueue(pool)
    .await?;

    // "abandoned": three claims whose publishers die (their leases expire).
    let (mut row, mut first) = (0, None);
    for attempt in 1..=3 {
        let claims = Budgeted::claim_batch(pool, 10).await?;
        let abandoned = claims
            .iter()
            .find(|c| c.event().name == "abandoned")
            .expect("claimable");
        let first = *first.get_or_insert(abandoned.generation().get());
        assert_eq!(abandoned.generation().get(), first + attempt - 1);
        assert_eq!(abandoned.attempt(), u32::try_from(attempt)?);
        row = abandoned.id();
        for claim in claims {
            if claim.event().name == "failing" {
                // "failing": every send fails and is retried at once.
                let outcome = claim.retry(pool, Duration::ZERO).await?;
                assert_eq!(
                    outcome,
                    if attempt == 3 {
                        Retried::Dead
                    } else {
                        Retried::Scheduled
                    }
                );
            }
        }
        expire::<Budgeted>(pool, row).await?;
    }
    assert!(
        Budgeted::claim(pool).await?.is_none(),
        "a spent budget is never claimed again"
    );
    let (status, generation, last_error) = status_of::<Budgeted>(pool, row).await;
    assert_eq!((status.as_str(), generation), ("DEAD", first.unwrap() + 2));
    assert!(
        last_error
            .unwrap()
            .contains("lease expired on claim 3 of 3")
    );
    let dead: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_id, last_error FROM budget_events WHERE status = 'DEAD' ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    assert_eq!(dead.len(), 2, "dead rows stay visible: {dead:?}");
    assert_eq!(
        counters.get(DEAD_TOTAL, "budget_events"),
        1,
        "counted where the claim statement moved it"
    );
    assert!(
        dead[1]
            .1
            .contains("attempt budget exhausted after 3 of 3 claims"),
        "{dead:?}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn an_event_due_again_after_the_budget_was_lowered_is_moved_to_dead_saying_so() -> TestResult
{
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    Budgeted {
        name: "patient".into(),
    }
    .enqueue(pool)
    .await?;
    Budgeted {
        name: "next".into(),
    }
    .enqueue(pool)
    .await?;
    // Retried 5 times by a build whose budget was 10; this build allows 3.
    sqlx::query(
        "UPDATE budget_events SET attempts = 5, last_error = 'broker said 503' \
         WHERE event_id = 'patient'",
    )
    .execute(pool)
    .await?;

    let claim = Budgeted::claim(pool)
        .await?
        .expect("the next event is claimed");
    assert_eq!(
        claim.event().name,
        "next",
        "the spent one is not handed out"
    );
    let row: (String, Option<String>) =
        sqlx::query_as("SELECT status, last_error FROM budget_events WHERE event_id = 'patient'")
            .fetch_one(pool)
            .await?;
    assert_eq!(
        row,
        (
            "DEAD".to_owned(),
            Some(
                "attempt budget exhausted: 5 claims made, the budget is now 3; \
                 the last error: broker said 503"
                    .to_owned()
            )
        ),
        "no lease expired: it was waiting for its retry"
    );
    claim.complete(pool).await?;
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn renew_extends_a_live_lease_and_is_rejected_once_it_expired() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    let pool = db.pool();
    Budgeted {
        name: "slow".into(),
    }
    .enqueue(pool)
    .await?;
    let mut claim = Budgeted::claim(pool).await?.expect("due");
    let held = claim.generation();
    sqlx::query("UPDATE budget_events SET lease_until = now() + interval '1 second'")
        .execute(pool)
        .await?;
    claim.renew(pool).await?;
    let remaining = claim
        .lease_until()
        .duration_since(std::time::SystemTime::now())?;
    assert!(
        remaining > Duration::from_secs(25),
        "renewed to the full lease: {remaining:?}"
    );

    expire::<Budgeted>(pool, claim.id()).await?;
    let err = claim.renew(pool).await.unwrap_err();
    assert!(
        matches!(err, OutboxError::Stale { table: "budget_events", generation, .. } if generation == held),
        "{err}"
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn fail_moves_the_event_to_dead_with_the_reason() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    order().enqueue(db.pool()).await?;
    let claim = OrderPlaced::claim(db.pool()).await?.expect("due");
    let (row, generation) = (claim.id(), claim.generation().get());
    claim
        .fail(db.pool(), "rejected by the broker: message too large")
        .await?;
    assert_eq!(
        status_of::<OrderPlaced>(db.pool(), row).await,
        (
            "DEAD".into(),
            generation,
            Some("rejected by the broker: message too large".into())
        )
    );
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_payload_that_cannot_be_decoded_is_moved_to_dead_not_lost() -> TestResult {
    let counters = Counters::default();
    let _recording = metrics::set_default_local_recorder(&counters);
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let pool = db.pool();
    sqlx::query("INSERT INTO order_events (event_id, customer, total_cents, lines) VALUES ('not-a-uuid', 'x', 1, '[]'), ($1, 'y', 2, '\"not lines\"')")
        .bind(uuid::Uuid::now_v7().to_string())
        .execute(pool)
        .await?;
    let good = order();
    good.enqueue(pool).await?;

    let err = OrderPlaced::claim(pool).await.unwrap_err();
    assert!(
        matches!(&err, OutboxError::Decode { event_id, .. } if event_id == "not-a-uuid"),
        "{err}"
    );
    // The batch skips the other bad row (moving it to DEAD) and returns the good one.
    let claims = OrderPlaced::claim_batch(pool, 10).await?;
    assert_eq!(
        claims.iter().map(outbox::Claim::event).collect::<Vec<_>>(),
        [&good]
    );
    let dead: Vec<(String,)> =
        sqlx::query_as("SELECT last_error FROM order_events WHERE status = 'DEAD' ORDER BY id")
            .fetch_all(pool)
            .await?;
    assert_eq!(dead.len(), 2);
    assert!(
        dead.iter()
            .all(|(e,)| e.starts_with("cannot decode payload")),
        "{dead:?}"
    );
    assert_eq!(counters.get(DEAD_TOTAL, "order_events"), 2);
    for claim in claims {
        claim.complete(pool).await?;
    }
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn timestamps_beyond_rusts_range_neither_panic_a_claim_nor_lose_an_event() -> TestResult {
    let db = schema_with(&[EveryType::migrations()]).await?;
    let pool = db.pool();
    for key in 1..=3 {
        every_type(key).enqueue(pool).await?;
    }
    // Written by hand: an operator puts event 1 at the front of the queue, and a payload
    // column of event 2 holds a timestamp that no chrono or time value can hold.
    sqlx::query(
        "UPDATE every_type_events SET next_attempt_at = '-infinity', created_at = '-infinity'
         WHERE event_id = '1'",
    )
    .execute(pool)
    .await?;
    sqlx::query("UPDATE every_type_events SET chrono_utc = 'infinity' WHERE event_id = '2'")
        .execute(pool)
        .await?;

    let claims = EveryType::claim_batch(pool, 10).await?;
    assert_eq!(
        claims.iter().map(|c| c.event().key).collect::<Vec<_>>(),
        [1, 3],
        "event 1 first, event 2 set aside"
    );
    assert!(claims[0].created_at() < std::time::UNIX_EPOCH);
    let (status, _, reason) = status_of::<EveryType>(pool, 2).await;
    assert_eq!(status, "DEAD");
    let reason = reason.unwrap_or_default();
    assert!(
        reason.starts_with("cannot decode payload") && reason.contains("panicked"),
        "{reason}"
    );
    for claim in claims {
        claim.complete(pool).await?;
    }
    assert_eq!(outbox::stats::<EveryType>(pool).await?.sent, 2);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_missing_table_is_a_typed_error() -> TestResult {
    let db = TestSchema::new().await?;
    let err = OrderPlaced::claim(db.pool()).await.unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::MissingTable {
                table: "order_events",
                ..
            }
        ),
        "{err}"
    );
    let err = order().enqueue(db.pool()).await.unwrap_err();
    assert!(err.to_string().contains("run outbox::migrate"), "{err}");
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_transaction_the_server_ends_for_idling_is_a_transient_error() -> TestResult {
    let db = schema_with(&[OrderPlaced::migrations()]).await?;
    let mut tx = db.pool().begin().await?;
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query("SET LOCAL idle_in_transaction_session_timeout = '50ms'")
        .execute(&mut *tx)
        .await?;
    wait_until(
        "the server ends the idle session",
        Duration::from_secs(30),
        async || {
            sqlx::query_scalar::<_, bool>(
                "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)",
            )
            .bind(backend)
            .fetch_one(db.pool())
            .await
            .unwrap()
        },
    )
    .await;
    // The server ended the session (SQLSTATE 25P03): a relay retries on another
    // connection, as after any lost connection, rather than stopping.
    let err = OrderPlaced::claim(&mut *tx).await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");
    drop(tx);
    db.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_bad_database_url_is_a_typed_error() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://nobody@127.0.0.1:1/nowhere")
        .unwrap();
    let err = OrderPlaced::claim(&pool).await.unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::Database {
                table: "order_events",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn a_claim_never_records_an_outcome_on_another_tables_row() -> TestResult {
    // Two tenants, one schema each: row ids start at 1 in both.
    let tenant_a = schema_with(&[Budgeted::migrations()]).await?;
    let tenant_b = schema_with(&[Budgeted::migrations()]).await?;
    Budgeted { name: "a".into() }
        .enqueue(tenant_a.pool())
        .await?;
    Budgeted { name: "b".into() }
        .enqueue(tenant_b.pool())
        .await?;
    let claim_a = Budgeted::claim(tenant_a.pool()).await?.expect("due in A");
    let claim_b = Budgeted::claim(tenant_b.pool()).await?.expect("due in B");
    assert_eq!(claim_a.id(), claim_b.id(), "the same row id in both tables");

    // A's claim, recorded through B's pool by mistake: B's row is not A's row.
    let row = claim_a.id();
    let err = claim_a.complete(tenant_b.pool()).await.unwrap_err();
    assert!(err.is_stale(), "{err}");
    assert_eq!(status::<Budgeted>(tenant_b.pool(), row).await, "INPROGRESS");
    // B's real owner still records its outcome.
    assert_eq!(
        claim_b.retry(tenant_b.pool(), Duration::ZERO).await?,
        Retried::Scheduled
    );

    // The same within one table emptied while a claim was out, its ids restarted.
    sqlx::query("TRUNCATE budget_events RESTART IDENTITY")
        .execute(tenant_a.pool())
        .await?;
    Budgeted { name: "a2".into() }
        .enqueue(tenant_a.pool())
        .await?;
    let before = Budgeted::claim(tenant_a.pool()).await?.expect("due");
    sqlx::query("TRUNCATE budget_events RESTART IDENTITY")
        .execute(tenant_a.pool())
        .await?;
    Budgeted { name: "a3".into() }
        .enqueue(tenant_a.pool())
        .await?;
    let after = Budgeted::claim(tenant_a.pool()).await?.expect("due");
    assert_eq!(before.id(), after.id(), "the id was reused");
    let err = before.complete(tenant_a.pool()).await.unwrap_err();
    assert!(err.is_stale(), "a claim from before the truncate: {err}");
    after.complete(tenant_a.pool()).await?;

    tenant_a.drop_schema().await?;
    tenant_b.drop_schema().await?;
    Ok(())
}

#[tokio::test]
async fn a_delay_longer_than_an_interval_holds_is_refused_as_such() -> TestResult {
    let db = schema_with(&[Budgeted::migrations()]).await?;
    Budgeted { name: "e".into() }.enqueue(db.pool()).await?;
    let claim = Budgeted::claim(db.pool()).await?.expect("due");
    let row = claim.id();
    let err = claim.retry(db.pool(), Duration::MAX).await.unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::IntervalOutOfRange {
                table: "budget_events",
                what: "retry delay",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.to_string().contains("encode"), "{err}");
    assert_eq!(
        status::<Budgeted>(db.pool(), row).await,
        "INPROGRESS",
        "nothing recorded: the lease brings the event back"
    );
    let err = outbox::ops::prune_sent::<Budgeted>(db.pool(), Duration::MAX, 100)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::IntervalOutOfRange {
                what: "prune age",
                ..
            }
        ),
        "{err:?}"
    );
    // The longest accepted delay is stored.
    sqlx::query("UPDATE budget_events SET lease_until = now() - interval '1 second'")
        .execute(db.pool())
        .await?;
    let claim = Budgeted::claim(db.pool()).await?.expect("reclaimed");
    assert_eq!(
        claim.retry(db.pool(), outbox::ops::MAX_INTERVAL).await?,
        Retried::Scheduled
    );
    // And the longest accepted age is counted back from now.
    assert_eq!(
        outbox::ops::prune_sent::<Budgeted>(db.pool(), outbox::ops::MAX_INTERVAL, 100).await?,
        0
    );
    db.drop_schema().await?;
    Ok(())
}
