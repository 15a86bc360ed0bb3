//! Live gauges for Prometheus: a relay publishes the orders' events while a
//! [`Monitor`](outbox::monitor::Monitor) samples both outbox tables every second, and
//! `/metrics` shows the relay's counters (`outbox_sent_total`, ...) next to the
//! monitor's gauges (`outbox_due`, `outbox_oldest_waiting_age_seconds`, ...).
//!
//! The customers' events have no relay here, so their backlog and its age grow: what
//! the alert rules in the README catch.
//!
//! ```text
//! cargo run --example prometheus                    # until Ctrl-C, on 127.0.0.1:9000
//! curl -s http://127.0.0.1:9000/metrics | grep '^outbox_'   # meanwhile, in another shell
//! cargo run --example prometheus -- --seconds 5 --listen 127.0.0.1:9100   # 5 s, elsewhere
//! ```
//!
//! It runs in a scratch schema on `DATABASE_URL` (or a throwaway local PostgreSQL),
//! dropped at the end.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser as _;
use common::{EmailChanged, Line, OrderPlaced};
use metrics_exporter_prometheus::PrometheusBuilder;
use outbox::{CancellationToken, Relay, StdoutSink, monitor::Monitor};
use sqlx::PgPool;
use tracing_subscriber::util::SubscriberInitExt as _;

type Result<T = (), E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Serves the outbox's metrics on `/metrics` while a relay publishes and a monitor
/// samples the tables.
#[derive(clap::Parser, Debug)]
#[command(name = "prometheus")]
struct Args {
    /// Where `/metrics` is served.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Stop after this many seconds [default: at Ctrl-C].
    #[arg(long, value_name = "N")]
    seconds: Option<u64>,
}

#[tokio::main]
async fn main() -> Result {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .finish()
        .init();
    // Before anything emits a metric: the recorder is global, and the exporter serves it.
    PrometheusBuilder::new()
        .with_http_listener(args.listen)
        .install()?;
    println!("serving http://{}/metrics", args.listen);

    let sandbox = outbox::testing::TestSchema::new().await?;
    let pool = sandbox.pool();
    let tables = [OrderPlaced::migrations(), EmailChanged::migrations()];
    outbox::migrate(pool, &tables).await?;

    // At startup, beside the relays, one line each; both stop on the same token.
    let shutdown = CancellationToken::new();
    let relay =
        tokio::spawn(Relay::<OrderPlaced, _>::new(pool.clone(), StdoutSink).run(shutdown.clone()));
    let monitor = tokio::spawn(
        Monitor::new(pool.clone(), &tables)
            .interval(Duration::from_secs(1))
            .run(shutdown.clone()),
    );

    let business = enqueue_every_second(pool);
    let stop = async {
        match args.seconds {
            Some(seconds) => tokio::time::sleep(Duration::from_secs(seconds)).await,
            None => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    };
    tokio::select! {
        () = stop => {}
        enqueued = business => enqueued?,
    }

    shutdown.cancel();
    relay.await??;
    monitor.await??;
    sandbox.drop_schema().await?;
    Ok(())
}

/// An order and a customer's email change every second, each event in the transaction
/// of its business write (here, the event alone).
async fn enqueue_every_second(pool: &PgPool) -> Result {
    let mut ticks = tokio::time::interval(Duration::from_secs(1));
    for n in 1_i64.. {
        ticks.tick().await;
        let mut tx = pool.begin().await?;
        OrderPlaced {
            order_id: uuid::Uuid::now_v7(),
            customer: format!("customer-{n}@example.com"),
            total_cents: 1_000 + n,
            note: None,
            lines: vec![Line {
                sku: "tea-earl-grey".into(),
                quantity: 1,
            }],
        }
        .enqueue(&mut *tx)
        .await?;
        EmailChanged {
            customer: format!("customer-{n}"),
            email: format!("new-{n}@example.com"),
            referrer: None,
        }
        .enqueue(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(())
}
