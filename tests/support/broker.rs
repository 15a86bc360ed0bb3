//! What the broker sinks' tests share: an encoding that refuses one event, the
//! consumer's effect applied with its inbox row, and a TCP proxy whose stop is, for the
//! clients connected through it, the broker going away.

use outbox::inbox::{Inbox, Received};
use outbox::message::{Encoding, Json};
use sqlx::PgPool;

use super::TestResult;
use super::events::ChaosEvent;

/// JSON, except for the event named `unencodable`: a stand-in for an event a real
/// encoding cannot handle.
pub struct RefuseUnencodable;

impl Encoding<ChaosEvent> for RefuseUnencodable {
    fn content_type(&self) -> Option<&str> {
        Some("application/json")
    }

    fn encode(&self, event: &ChaosEvent) -> Result<Vec<u8>, outbox::BoxError> {
        if event.key == "unencodable" {
            return Err("parcels must be positive".into());
        }
        Json.encode(event)
    }
}

/// The consumer's handling of one message (`event_id`, and `body`, a `ChaosEvent` as
/// JSON): the effect (a row in `shipments`) and the inbox row in one transaction.
pub async fn apply(
    pool: &PgPool,
    inbox: &Inbox,
    event_id: &str,
    body: &[u8],
) -> TestResult<Received> {
    let event: serde_json::Value = serde_json::from_slice(body)?;
    let mut tx = pool.begin().await?;
    let received = inbox.receive(&mut *tx, event_id).await?;
    if received.is_new() {
        sqlx::query("INSERT INTO shipments (event_id, parcels) VALUES ($1, $2)")
            .bind(event_id)
            .bind(event["order_seq"].as_i64().ok_or("no order_seq")?)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(received)
}

/// A TCP proxy between clients and a broker: stopping it is, for the clients connected
/// through it, the broker going away.
pub struct Proxy {
    pub port: u16,
    upstream: String,
    serving: Option<tokio::task::JoinHandle<()>>,
}

impl Proxy {
    pub async fn start(upstream: String) -> TestResult<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let serving = Some(tokio::spawn(Self::serve(listener, upstream.clone())));
        Ok(Self {
            port,
            upstream,
            serving,
        })
    }

    /// Closes the listener and every connection through it.
    pub fn down(&mut self) {
        if let Some(serving) = self.serving.take() {
            serving.abort();
        }
    }

    /// Listens again, on the same port.
    pub async fn up(&mut self) -> TestResult {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port)).await?;
        self.serving = Some(tokio::spawn(Self::serve(listener, self.upstream.clone())));
        Ok(())
    }

    async fn serve(listener: tokio::net::TcpListener, upstream: String) {
        // Dropped with this task: aborts every connection.
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            connections.spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    }
}
