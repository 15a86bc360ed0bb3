//! A TCP proxy between clients and a server (a broker, PostgreSQL): stopping it is, for
//! the clients connected through it, the server going away; freezing it, the server
//! going silent on the connections open then (a half-open connection after a
//! failover), while new connections get through; what a client sends on a frozen
//! connection is held, never forwarded, and counted ([`Proxy::held`]).

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::watch;

use super::TestResult;

pub struct Proxy {
    pub port: u16,
    /// `host:port`, or the path of a Unix socket.
    upstream: String,
    serving: Option<tokio::task::JoinHandle<()>>,
    /// Counts the freezes: a connection opened before the latest one forwards nothing.
    freezes: watch::Sender<u64>,
    /// Counts the frozen connections whose client sent something after the freeze.
    held: watch::Sender<u64>,
}

impl Proxy {
    /// A proxy to `upstream`: `host:port`, or the path of a Unix socket.
    pub async fn start(upstream: String) -> TestResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let freezes = watch::Sender::new(0);
        let held = watch::Sender::new(0);
        let serving = Some(tokio::spawn(Self::serve(
            listener,
            upstream.clone(),
            freezes.subscribe(),
            held.clone(),
        )));
        Ok(Self {
            port,
            upstream,
            serving,
            freezes,
            held,
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
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await?;
        self.serving = Some(tokio::spawn(Self::serve(
            listener,
            self.upstream.clone(),
            self.freezes.subscribe(),
            self.held.clone(),
        )));
        Ok(())
    }

    /// Stops forwarding on every connection open now, without closing any: for their
    /// clients, a server that went silent. Later connections are served as before.
    pub fn freeze(&self) {
        self.freezes.send_modify(|freezes| *freezes += 1);
    }

    /// How many frozen connections have a client that sent something since the freeze
    /// (a request that is out, as far as the client knows, and will never arrive).
    pub fn held(&self) -> u64 {
        *self.held.borrow()
    }

    async fn serve(
        listener: TcpListener,
        upstream: String,
        freezes: watch::Receiver<u64>,
        held: watch::Sender<u64>,
    ) {
        // Dropped with this task: aborts every connection.
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            let held = held.clone();
            let mut freezes = freezes.clone();
            let opened = *freezes.borrow_and_update();
            connections.spawn(async move {
                let frozen = async move {
                    let _ = freezes.wait_for(|now| *now > opened).await;
                };
                if upstream.starts_with('/') {
                    if let Ok(server) = UnixStream::connect(&upstream).await {
                        forward(client, server, frozen, held).await;
                    }
                } else if let Ok(server) = TcpStream::connect(&upstream).await {
                    forward(client, server, frozen, held).await;
                }
            });
        }
    }
}

/// Copies both ways until either side closes, or until `frozen`: then holds both
/// sockets open, silent, until the task is aborted, and counts in `held` a client that
/// sends something meanwhile (left unread, as before).
async fn forward<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: TcpStream,
    mut server: S,
    frozen: impl Future<Output = ()>,
    held: watch::Sender<u64>,
) {
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = frozen => {
            if client.peek(&mut [0; 1]).await.is_ok_and(|sent| sent > 0) {
                held.send_modify(|held| *held += 1);
            }
            std::future::pending::<()>().await;
        }
    }
}
