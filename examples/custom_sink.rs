//! A sink of your own, and a consumer that deduplicates.
//!
//! The relay hands the sink each claimed batch; the sink sends every event to the
//! broker with its event id and answers, per event: `Ok` (recorded `SENT`),
//! `SinkError::Transient` (retried later, with backoff, while the attempt budget lasts)
//! or `SinkError::Permanent` (`DEAD` now, the message kept in `last_error`).
//!
//! The "broker" is an in-process channel standing in for a network client (Kafka,
//! NATS, RabbitMQ, a webhook), with scripted faults so that one run shows every path:
//! one order finds the broker unavailable, one order's acknowledgement is lost after
//! the broker delivered it (so it is delivered twice), and one order is too large for
//! the broker and rejected. The consumer drops the duplicate by its event id.
//!
//! ```text
//! cargo run --example custom_sink           # DATABASE_URL, or a throwaway PostgreSQL
//! ```

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use common::{Line, OrderPlaced};
use outbox::{Delivery, EventId, Relay, Sink, SinkError, relay::Backoff};
use tokio::sync::mpsc;

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// What goes over the wire: the event id travels with every message.
#[derive(Debug)]
struct Message {
    event_id: String,
    body: String,
}

/// The sink: turns deliveries into messages, and the broker's answers into outcomes.
struct BrokerSink {
    broker: Broker,
}

impl Sink<OrderPlaced> for BrokerSink {
    async fn publish(&self, batch: &[Delivery<'_, OrderPlaced>]) -> Vec<Result<(), SinkError>> {
        // One result per delivery, in order. (A broker client that batches would send
        // them all at once and map its per-message acknowledgements back.)
        let mut results = Vec::with_capacity(batch.len());
        for delivery in batch {
            let result = self.send(delivery).await;
            let outcome = result
                .as_ref()
                .map_or_else(ToString::to_string, |()| "sent".into());
            let customer = &delivery.event().customer;
            let attempt = delivery.attempt();
            println!("sink:     {customer}, attempt {attempt}: {outcome}");
            results.push(result);
        }
        results
    }
}

impl BrokerSink {
    async fn send(&self, delivery: &Delivery<'_, OrderPlaced>) -> Result<(), SinkError> {
        if !delivery.is_owned() {
            // A lease renewal found that another publisher took this event over: sending
            // it is pointless, and the relay records nothing for it either way.
            return Err(SinkError::transient("another publisher owns this event"));
        }
        let order = delivery.event();
        // A real sink serializes the event (JSON, protobuf) and puts the event id in the
        // message's key or headers.
        let lines: Vec<String> = order
            .lines
            .iter()
            .map(|line| format!("{} x {}", line.quantity, line.sku))
            .collect();
        let message = Message {
            event_id: delivery.event_id().to_string(),
            body: format!(
                "{}, {} cents: {}",
                order.customer,
                order.total_cents,
                lines.join(", ")
            ),
        };
        match self.broker.send(message).await {
            Ok(()) => Ok(()),
            // The broker is down: not this event's fault. The relay hands it back
            // without counting the attempt and waits a little before it claims again.
            Err(BrokerError::Unavailable(why)) => Err(SinkError::unavailable(why)),
            // Worth another try: the relay backs off and hands the event over again.
            Err(BrokerError::NoAck(why)) => Err(SinkError::transient(why)),
            // No retry can help: the event moves to DEAD with this reason.
            Err(BrokerError::Rejected(why)) => Err(SinkError::permanent(why)),
        }
    }
}

/// How a send can fail.
enum BrokerError {
    /// Nothing was sent: connection refused, broker down.
    Unavailable(String),
    /// The message may or may not have arrived: the acknowledgement did not come back.
    NoAck(String),
    /// The broker refused the message, and always will.
    Rejected(String),
}

/// The faults the broker plays, once each.
#[derive(Clone, Copy)]
enum Fault {
    Unavailable,
    AckLost,
}

/// Stands in for a broker client: delivers to the consumer through a channel.
struct Broker {
    queue: mpsc::Sender<Message>,
    faults: Mutex<HashMap<String, Fault>>,
}

impl Broker {
    const MAX_MESSAGE_BYTES: usize = 256;

    async fn send(&self, message: Message) -> Result<(), BrokerError> {
        if message.body.len() > Self::MAX_MESSAGE_BYTES {
            return Err(BrokerError::Rejected(format!(
                "message of {} bytes rejected: the broker takes at most {}",
                message.body.len(),
                Self::MAX_MESSAGE_BYTES
            )));
        }
        let fault = self
            .faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&message.event_id);
        if let Some(Fault::Unavailable) = fault {
            return Err(BrokerError::Unavailable("connection refused".into()));
        }
        self.queue
            .send(message)
            .await
            .map_err(|_| BrokerError::Unavailable("the broker has shut down".into()))?;
        match fault {
            Some(Fault::AckLost) => Err(BrokerError::NoAck(
                "timed out waiting for the acknowledgement".into(),
            )),
            _ => Ok(()),
        }
    }
}

/// The consumer: processes each event once, whatever the broker delivers twice. A real
/// consumer keeps the ids it processed in its own database, in the transaction that
/// applies the event (a table with the event id as its primary key).
async fn consume(mut inbox: mpsc::Receiver<Message>) -> (usize, usize) {
    let mut processed = HashSet::new();
    let mut duplicates = 0;
    while let Some(message) = inbox.recv().await {
        if processed.insert(message.event_id.clone()) {
            println!("consumer: processed {}: {}", message.event_id, message.body);
        } else {
            duplicates += 1;
            println!(
                "consumer: {} again: already processed, dropped",
                message.event_id
            );
        }
    }
    (processed.len(), duplicates)
}

fn order(customer: &str, lines: usize) -> OrderPlaced {
    OrderPlaced {
        order_id: uuid::Uuid::now_v7(),
        customer: customer.into(),
        total_cents: 1_250,
        note: None,
        lines: vec![
            Line {
                sku: "tea-earl-grey".into(),
                quantity: 1,
            };
            lines
        ],
    }
}

#[tokio::main]
async fn main() -> Result {
    // A scratch schema, dropped at the end (on DATABASE_URL, or on a throwaway local
    // PostgreSQL when it is unset). In your application: `PgPool::connect(&database_url)`.
    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();
    outbox::migrate(pool, &[OrderPlaced::migrations()]).await?;

    let orders = [
        order("ada@example.com", 1),
        order("bob@example.com", 1),
        order("cleo@example.com", 2),
        order("dan@example.com", 40), // too large for the broker
    ];
    let ids: Vec<EventId> = OrderPlaced::enqueue_all(&orders, pool)
        .await?
        .into_iter()
        .map(outbox::Enqueued::into_event_id)
        .collect();
    println!("enqueued {} orders", ids.len());

    let (queue, inbox) = mpsc::channel(64);
    let consumer = tokio::spawn(consume(inbox));
    let faults = HashMap::from([
        (ids[1].to_string(), Fault::Unavailable),
        (ids[2].to_string(), Fault::AckLost),
    ]);
    let sink = BrokerSink {
        broker: Broker {
            queue,
            faults: Mutex::new(faults),
        },
    };

    // Retries are due after 0.1-0.2 s here (`OrderPlaced`'s `retry_delay` is a minute),
    // and idle workers look for them every 100 ms.
    let relay = Relay::<OrderPlaced, _>::new(pool.clone(), sink)
        .retry_backoff(Backoff::new(
            Duration::from_millis(200),
            Duration::from_secs(2),
        ))
        .poll_interval(Duration::from_millis(100));
    common::publish_all(pool, relay).await?;
    // The relay (and with it the sink's end of the channel) is gone: the consumer ends.
    let (processed, duplicates) = consumer.await?;
    println!("consumer: {processed} orders processed, {duplicates} duplicate(s) dropped");

    let rows: Vec<(String, String, i32, Option<String>)> = sqlx::query_as(
        "SELECT customer, status, attempts, last_error FROM order_events ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    println!("\norder_events:");
    for (customer, status, attempts, last_error) in rows {
        let why = last_error.map(|e| format!(" ({e})")).unwrap_or_default();
        println!("  {customer:<17} {status:<4} after {attempts} attempt(s){why}");
    }

    sandbox.drop_schema().await?;
    Ok(())
}
