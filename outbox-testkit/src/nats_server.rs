//! A NATS server of the test's own (`nats-server -js`, file storage in a fresh directory,
//! a free port): a run that kills and restarts it, or starts it with credentials, does not
//! disturb the shared server on 4222 that the other tests use.
//!
//! The binary is `OUTBOX_NATS_SERVER`, else `nats-server` on `PATH` or in `/usr/sbin`;
//! without one, [`NatsServer::start`] fails saying how to install it.
//!
//! A process that exits normally stops its server and deletes its directory; one killed
//! by a signal cannot, so the next start in any process stops the servers of processes
//! that are gone (their pid files) and deletes their directories.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Where the binary comes from, for the error that says it is missing.
const HOW_TO_INSTALL: &str = "install it (`apt-get install nats-server`, or a release from \
     github.com/nats-io/nats-server) or point OUTBOX_NATS_SERVER at the binary";

/// How a stop ends the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGKILL: no shutdown at all (what it has written to its files survives).
    Kill,
    /// SIGTERM: a clean shutdown.
    Term,
}

/// A `nats-server -js` child process on `127.0.0.1:<port>`, storing in its own directory.
/// Dropping it kills the server and deletes the directory.
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    /// Extra arguments (credentials).
    args: Vec<String>,
    process: Option<Child>,
    /// Starts so far (1 after [`NatsServer::start`]).
    pub starts: u32,
}

impl NatsServer {
    /// Starts a server with JetStream on a free port; `args` are added to its command
    /// line (e.g. `["--user", "u", "--pass", "p"]`).
    pub fn start(args: &[&str]) -> Result<Self, String> {
        Self::start_with(args, None)
    }

    /// Starts a server as [`start`](Self::start) does, with `config` as its
    /// configuration file (users and their permissions).
    pub fn start_with_config(config: &str) -> Result<Self, String> {
        Self::start_with(&[], Some(config))
    }

    fn start_with(args: &[&str], config: Option<&str>) -> Result<Self, String> {
        let binary = binary()?;
        reap_leftovers();
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!(
            "{PREFIX}{}-{port}-{:x}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
        if let Some(config) = config {
            let file = dir.join("server.conf");
            std::fs::write(&file, config)
                .map_err(|e| format!("writing {}: {e}", file.display()))?;
            args.extend(["-c".to_owned(), file.display().to_string()]);
        }
        let mut server = Self {
            binary,
            port,
            dir,
            args,
            process: None,
            starts: 0,
        };
        server.up()?;
        Ok(server)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's own log (both starts and stops), for a failure message.
    pub fn log(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The extra arguments of the next start: another password is the credentials
    /// revoked.
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|&a| a.to_owned()).collect();
    }

    /// Stops the server as `how` says and waits until it is gone.
    pub fn down(&mut self, how: Stop) -> Result<(), String> {
        let Some(mut process) = self.process.take() else {
            return Ok(());
        };
        let pid = Pid::from_raw(i32::try_from(process.id()).map_err(|e| e.to_string())?);
        let signal = match how {
            Stop::Kill => Signal::SIGKILL,
            Stop::Term => Signal::SIGTERM,
        };
        kill(pid, signal).map_err(|e| format!("{signal} to nats-server: {e}"))?;
        process
            .wait()
            .map_err(|e| format!("waiting for nats-server: {e}"))?;
        Ok(())
    }

    /// Starts the server again on the same port and store directory, and waits until
    /// it accepts connections (JetStream recovers the streams from the directory).
    pub fn up(&mut self) -> Result<(), String> {
        if self.process.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())
            .map_err(|e| format!("opening {}: {e}", self.log().display()))?;
        let port = self.port.to_string();
        let store = self.dir.join("store");
        let mut process = Command::new(&self.binary)
            .args(["-js", "-a", "127.0.0.1", "-p", &port, "-sd"])
            .arg(&store)
            .arg("-P")
            .arg(self.dir.join(PID_FILE))
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.binary.display()))?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = process.try_wait().map_err(|e| e.to_string())? {
                return Err(format!(
                    "nats-server exited at start ({status}); its log: {}",
                    self.log().display()
                ));
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                let _ = process.kill();
                return Err(format!(
                    "nats-server did not listen on {} within 20 s; its log: {}",
                    self.port,
                    self.log().display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.process = Some(process);
        self.starts += 1;
        Ok(())
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.down(Stop::Kill);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directories' prefix in the temporary directory: then the owner's pid.
const PREFIX: &str = "outbox-nats-";
/// The server's pid, in its directory.
const PID_FILE: &str = "server.pid";

/// Stops the servers of processes that are gone (killed before they could), and deletes
/// their directories.
fn reap_leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name
            .to_str()
            .and_then(|name| name.strip_prefix(PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok())
        else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        let dir = entry.path();
        let server = std::fs::read_to_string(dir.join(PID_FILE))
            .ok()
            .and_then(|pid| pid.trim().parse::<i32>().ok());
        if let Some(server) = server {
            // Only if it is still a nats-server (a pid can be reused).
            let command =
                std::fs::read_to_string(format!("/proc/{server}/comm")).unwrap_or_default();
            if command.trim() == "nats-server" {
                let _ = kill(Pid::from_raw(server), Signal::SIGKILL);
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The nats-server binary: `OUTBOX_NATS_SERVER`, `PATH`, `/usr/sbin`, `/usr/local/bin`.
fn binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("OUTBOX_NATS_SERVER") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "OUTBOX_NATS_SERVER={} is not a file: {HOW_TO_INSTALL}",
                path.display()
            ))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| Path::is_file(candidate))
        .ok_or_else(|| {
            format!("this test starts its own NATS server, and nats-server is not installed: {HOW_TO_INSTALL}")
        })
}

/// A port nothing listens on now (the kernel's choice for an ephemeral bind).
fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}
