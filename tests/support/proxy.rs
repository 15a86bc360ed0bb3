//! A TCP proxy between clients and a server (a broker, PostgreSQL): stopping it is, for
//! the clients connected through it, the server going away; freezing it, the server
//! going silent on the connections open then (a half-open connection after a
//! failover), while new connections get through.

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
}

impl Proxy {
    /// A proxy to `upstream`: `host:port`, or the path of a Unix socket.
    pub async fn start(upstream: String) -> TestResult<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let freezes = watch::Sender::new(0);
        let serving = Some(tokio::spawn(Self::serve(
            listener,
            upstream.clone(),
            freezes.subscribe(),
        )));
        Ok(Self {
            port,
            upstream,
            serving,
            freezes,
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
        )));
        Ok(())
    }

    /// Stops forwarding on every connection open now, without closing any: for their
    /// clients, a server that went silent. Later connections are served as before.
    pub fn freeze(&self) {
        self.freezes.send_modify(|freezes| *freezes += 1);
    }

    async fn serve(listener: TcpListener, upstream: String, freezes: watch::Receiver<u64>) {
        // Dropped with this task: aborts every connection.
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            let mut freezes = freezes.clone();
            let opened = *freezes.borrow_and_update();
            connections.spawn(async move {
                let frozen = async move {
                    let _ = freezes.wait_for(|now| *now > opened).await;
                };
                if upstream.starts_with('/') {
                    if let Ok(server) = UnixStream::connect(&upstream).await {
                        forward(client, server, frozen).await;
                    }
                } else if let Ok(server) = TcpStream::connect(&upstream).await {
                    forward(client, server, frozen).await;
                }
            });
        }
    }
}

/// Copies both ways until either side closes, or until `frozen`: then holds both
/// sockets open, silent, until the task is aborted.
async fn forward<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: TcpStream,
    mut server: S,
    frozen: impl Future<Output = ()>,
) {
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = frozen => std::future::pending().await,
    }
}
