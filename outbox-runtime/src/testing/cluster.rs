//! [`Cluster`]: a throwaway PostgreSQL server in a temporary directory, from the local
//! server binaries, run as `nobody` when the caller is root, and removed when the process
//! exits (or, after a kill, by the next cluster's start).

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use std::{env, io, process, thread};

use nix::sys::signal::{self, Signal};
use nix::unistd::{Pid, User};
use sqlx::{Connection, PgConnection};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{TIMEOUT, TestSupportError, timed_out};

/// Another process may grab the free port we picked before the server binds it.
const PORT_ATTEMPTS: u32 = 3;
/// Prefix of the throwaway clusters' directories, followed by `<pid>-<random>`.
const CLUSTER_DIR_PREFIX: &str = "outbox-pg-";

/// A dedicated throwaway PostgreSQL cluster that its owner can restart.
///
/// Like the shared cluster behind [`database_url`](super::database_url), it lives in a
/// temporary directory, runs as `nobody` when the caller is root, and is cleaned up when the
/// process exits (see the [module docs](super#cleaning-up)). Unlike it, the caller owns the server:
/// [`restart`](Self::restart) stops it (fast shutdown: every session is cut) and starts it
/// again on the same port and data directory, so connection URLs stay valid. Dropping the
/// value stops the server and removes the directory.
#[derive(Debug)]
pub struct Cluster {
    bindir: PathBuf,
    dir: PathBuf,
    owner: Option<User>,
    /// The password of the superuser `postgres`: any local user can reach 127.0.0.1.
    password: String,
    port: u16,
    url: String,
    postmaster: Option<Postmaster>,
}

/// A running server process, reaped by the thread that spawned it.
#[derive(Debug)]
struct Postmaster {
    pid: Pid,
    exited: oneshot::Receiver<ExitStatus>,
}

/// The throwaway cluster's client authentication: the superuser `postgres` by password
/// (any local user can reach 127.0.0.1), every other role as on a trust-auth server.
const PG_HBA: &str = "\
local all postgres scram-sha-256
host all postgres 127.0.0.1/32 scram-sha-256
host all postgres ::1/128 scram-sha-256
local all all trust
host all all 127.0.0.1/32 trust
host all all ::1/128 trust
";

/// Writes `contents` to a new file at `path` that only its owner may read, handed to
/// `owner` when there is one.
fn write_private(
    path: &Path,
    contents: &str,
    owner: Option<&User>,
) -> Result<(), TestSupportError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let what = || format!("writing {}", path.display());
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(TestSupportError::io(what()))?;
    file.write_all(contents.as_bytes())
        .map_err(TestSupportError::io(what()))?;
    if let Some(owner) = owner {
        chown(path, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).map_err(
            TestSupportError::io(format!("handing {} to user {}", path.display(), owner.name)),
        )?;
    }
    Ok(())
}

impl Cluster {
    /// Creates and starts a new cluster (from the server binaries found as described in the
    /// [module docs](super)), removing leftovers of dead processes first.
    pub async fn start() -> Result<Cluster, TestSupportError> {
        remove_stale_clusters().await;
        let bindir = find_bindir().ok_or(TestSupportError::NoPostgres)?;
        let owner = server_owner()?;
        let random = Uuid::now_v7().simple().to_string();
        // Keep the path short: the server's Unix socket lives in it, and those paths are limited
        // to about 100 bytes. The tail of a v7 UUID is random.
        let dir = env::temp_dir().join(format!(
            "{CLUSTER_DIR_PREFIX}{}-{}",
            process::id(),
            &random[20..]
        ));
        fs::create_dir(&dir)
            .map_err(TestSupportError::io(format!("creating {}", dir.display())))?;
        at_exit::track(&dir);
        let mut cluster = Cluster {
            bindir,
            dir,
            owner,
            // Random (the random bits of two UUIDs, from the operating system's
            // generator), never written down but in the URL this process hands out.
            password: format!("{}{}", Uuid::now_v7().simple(), Uuid::now_v7().simple()),
            port: 0,
            url: String::new(),
            postmaster: None,
        };
        // On failure, dropping `cluster` removes the directory (and any server).
        cluster.init().await?;
        let mut attempt = 1;
        loop {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .map_err(TestSupportError::io("finding a free port"))?
                .port();
            match cluster.launch(port).await {
                Ok(()) => break,
                // Another process may grab the free port we picked before the server binds it.
                Err(Launch::PortTaken(_)) if attempt < PORT_ATTEMPTS => attempt += 1,
                Err(error) => return Err(error.into()),
            }
        }
        tracing::debug!(port = cluster.port, dir = %cluster.dir.display(), "started throwaway PostgreSQL");
        Ok(cluster)
    }

    /// The server's base URL (user `postgres` with its password, database `postgres`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The TCP port the server listens on (on 127.0.0.1), the same after a restart.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server with a fast shutdown (open sessions are terminated, their
    /// transactions rolled back) and starts it again on the same port and data directory.
    /// Returns once it accepts connections.
    pub async fn restart(&mut self) -> Result<(), TestSupportError> {
        self.stop_server().await?;
        let mut attempt = 1;
        loop {
            match self.launch(self.port).await {
                Ok(()) => return Ok(()),
                // A connection of ours to the port may briefly hold it, or another process
                // grabbed it; it is ours to take back.
                Err(Launch::PortTaken(_)) if attempt < PORT_ATTEMPTS * 10 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// Fast shutdown of the running server, waiting for it to exit (an immediate shutdown
    /// after [`TIMEOUT`]).
    async fn stop_server(&mut self) -> Result<(), TestSupportError> {
        let Some(mut postmaster) = self.postmaster.take() else {
            return Ok(());
        };
        let _ = signal::kill(postmaster.pid, Signal::SIGINT);
        if tokio::time::timeout(TIMEOUT, &mut postmaster.exited)
            .await
            .is_err()
        {
            let _ = signal::kill(postmaster.pid, Signal::SIGQUIT);
            if tokio::time::timeout(TIMEOUT, postmaster.exited)
                .await
                .is_err()
            {
                return Err(TestSupportError::cluster(format!(
                    "postgres (pid {}) did not stop",
                    postmaster.pid
                )));
            }
        }
        Ok(())
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }
}

/// initdb refuses to run as root, so as root the cluster belongs to `nobody`.
fn server_owner() -> Result<Option<User>, TestSupportError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    match User::from_name("nobody") {
        Ok(Some(user)) => Ok(Some(user)),
        Ok(None) => Err(TestSupportError::cluster(
            "running as root, which initdb refuses, and there is no `nobody` user to run \
             PostgreSQL as; run the tests as another user or set DATABASE_URL",
        )),
        Err(errno) => Err(TestSupportError::io("looking up the `nobody` user")(
            errno.into(),
        )),
    }
}

fn find_bindir() -> Option<PathBuf> {
    let has_server = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(OsStr::from_bytes(output.stdout.trim_ascii())));
    // Debian's client-only packages ship pg_config too, so check that the server is there.
    if let Some(dir) = from_pg_config.filter(|dir| has_server(dir)) {
        return Some(dir);
    }
    let newest_debian = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(str::parse)
                .collect::<Result<Vec<u32>, _>>()
                .ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .max();
    if let Some((_, dir)) = newest_debian {
        return Some(dir);
    }
    // Resolve symlinks: `postgres` need only sit next to the real `initdb`.
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join("initdb"))
        .find(|initdb| initdb.is_file())
        .and_then(|initdb| Some(fs::canonicalize(initdb).ok()?.parent()?.to_path_buf()))
        .filter(|dir| has_server(dir))
}

/// Why a server did not start.
enum Launch {
    /// The port was taken (the server log says so).
    PortTaken(String),
    /// Anything else.
    Failed(TestSupportError),
}

impl From<Launch> for TestSupportError {
    fn from(launch: Launch) -> Self {
        match launch {
            Launch::PortTaken(log) => TestSupportError::cluster(format!(
                "postgres could not bind its port; server log:\n{log}"
            )),
            Launch::Failed(error) => error,
        }
    }
}

impl From<TestSupportError> for Launch {
    fn from(error: TestSupportError) -> Self {
        Launch::Failed(error)
    }
}

impl Cluster {
    /// Runs initdb in the (empty) directory.
    async fn init(&self) -> Result<(), TestSupportError> {
        let (bindir, dir, owner) = (&self.bindir, &self.dir, self.owner.as_ref());
        if let Some(owner) = owner {
            chown(dir, Some(owner.uid.as_raw()), Some(owner.gid.as_raw())).map_err(
                TestSupportError::io(format!("handing {} to user {}", dir.display(), owner.name)),
            )?;
        }
        let data = self.data();
        // The password for initdb to read, readable by the server's user alone, and gone
        // once the cluster exists.
        let pwfile = dir.join("pwfile");
        write_private(&pwfile, &self.password, owner)?;
        let mut initdb = server_command(&bindir.join("initdb"), dir, owner);
        initdb
            .arg("-D")
            .arg(&data)
            .arg("--pwfile")
            .arg(&pwfile)
            .args([
                "-U",
                "postgres",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
                // Valid with UTF8 whatever the environment's locale is, and deterministic.
                "--locale=C",
                "--no-sync",
            ]);
        let output = tokio::process::Command::from(initdb)
            .output()
            .await
            .map_err(TestSupportError::io(format!(
                "running {}",
                bindir.join("initdb").display()
            )))?;
        let _ = fs::remove_file(&pwfile);
        if !output.status.success() {
            return Err(TestSupportError::cluster(format!(
                "initdb {} ({}):\n{}{}",
                data.display(),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        // The superuser needs the password; the roles tests create (a relay's, an
        // operator's: no superuser) log in without one, as on a trust-auth server.
        let hba = data.join("pg_hba.conf");
        fs::remove_file(&hba)
            .map_err(TestSupportError::io(format!("replacing {}", hba.display())))?;
        write_private(&hba, PG_HBA, owner)?;
        Ok(())
    }

    /// Starts the server on `port` and waits until it accepts connections. The server log
    /// (`postgres.log`) is appended to, so it covers every start.
    async fn launch(&mut self, port: u16) -> Result<(), Launch> {
        let log_path = self.log_path();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(TestSupportError::io(format!(
                "opening {}",
                log_path.display()
            )))?;
        let logged_before = log.metadata().map_or(0, |m| m.len());
        let read_log = || {
            let log = fs::read(&log_path).unwrap_or_default();
            let start = usize::try_from(logged_before).unwrap_or(0).min(log.len());
            String::from_utf8_lossy(&log[start..]).into_owned()
        };
        let log_err = log
            .try_clone()
            .map_err(TestSupportError::io("cloning log"))?;
        let mut postgres = server_command(
            &self.bindir.join("postgres"),
            &self.dir,
            self.owner.as_ref(),
        );
        postgres
            .arg("-D")
            .arg(self.data())
            .args(["-p", &port.to_string(), "-k"])
            .arg(&self.dir)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        die_with_parent(&mut postgres);
        let url = format!(
            "postgres://postgres:{}@127.0.0.1:{port}/postgres",
            self.password
        );
        let (pid, mut exited) = spawn_postmaster(postgres, &self.dir)?;
        match wait_until_ready(&url, &mut exited).await {
            Startup::Ready => {
                self.port = port;
                self.url = url;
                self.postmaster = Some(Postmaster { pid, exited });
                Ok(())
            }
            Startup::Exited(status) => {
                let log = read_log();
                if log.contains("could not bind") {
                    Err(Launch::PortTaken(log))
                } else {
                    Err(Launch::Failed(TestSupportError::cluster(format!(
                        "postgres {status}; server log:\n{log}"
                    ))))
                }
            }
            Startup::TimedOut(error) => {
                let _ = signal::kill(pid, Signal::SIGQUIT);
                let _ = tokio::time::timeout(Duration::from_secs(5), exited).await;
                Err(Launch::Failed(TestSupportError::cluster(format!(
                    "postgres did not accept connections within {TIMEOUT:?} (last error: \
                     {error}); server log:\n{}",
                    read_log()
                ))))
            }
        }
    }
}

impl Drop for Cluster {
    /// Stops the server (fast shutdown; immediate after 10 s) and removes the directory.
    fn drop(&mut self) {
        if let Some(mut postmaster) = self.postmaster.take() {
            // Drop may run on a runtime thread: poll instead of awaiting.
            let _ = signal::kill(postmaster.pid, Signal::SIGINT);
            let mut stopped = false;
            for round in 0..400 {
                if round == 200 {
                    let _ = signal::kill(postmaster.pid, Signal::SIGQUIT);
                }
                if !matches!(
                    postmaster.exited.try_recv(),
                    Err(oneshot::error::TryRecvError::Empty)
                ) {
                    stopped = true;
                    break;
                }
                thread::sleep(Duration::from_millis(50));
            }
            if !stopped {
                // Leave the directory: the process's exit tries again, or the next cluster
                // start removes it once we are gone.
                tracing::warn!(pid = %postmaster.pid, "throwaway PostgreSQL did not stop");
                return;
            }
        }
        match fs::remove_dir_all(&self.dir) {
            Ok(()) => at_exit::untrack(&self.dir),
            Err(error) => {
                tracing::debug!(dir = %self.dir.display(), %error, "could not remove test cluster");
            }
        }
    }
}

/// Stops the servers of this process's throwaway clusters and removes their directories when
/// the process exits normally (an `atexit(3)` handler: statics are never dropped, and the
/// shared cluster is one).
mod at_exit {
    use std::path::{Path, PathBuf};
    use std::sync::{Mutex, MutexGuard, Once, PoisonError};
    use std::thread;
    use std::time::Duration;

    use nix::sys::signal::{self, Signal};
    use nix::unistd::Pid;

    /// A cluster directory this process created and has not removed, and its running server.
    struct Tracked {
        dir: PathBuf,
        server: Option<Pid>,
    }

    static TRACKED: Mutex<Vec<Tracked>> = Mutex::new(Vec::new());
    static REGISTER: Once = Once::new();

    fn tracked() -> MutexGuard<'static, Vec<Tracked>> {
        TRACKED.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `dir` is removed at exit, after its server (if any) stopped.
    pub(super) fn track(dir: &Path) {
        REGISTER.call_once(register);
        tracked().push(Tracked {
            dir: dir.to_owned(),
            server: None,
        });
    }

    /// `dir` was removed.
    pub(super) fn untrack(dir: &Path) {
        tracked().retain(|t| t.dir != dir);
    }

    /// The server `pid` runs in `dir`, until it is reaped ([`server_exited`]).
    pub(super) fn server_started(dir: &Path, pid: Pid) {
        if let Some(t) = tracked().iter_mut().find(|t| t.dir == dir) {
            t.server = Some(pid);
        }
    }

    /// The server `pid` exited and was reaped.
    pub(super) fn server_exited(pid: Pid) {
        for t in tracked().iter_mut().filter(|t| t.server == Some(pid)) {
            t.server = None;
        }
    }

    #[allow(unsafe_code)]
    fn register() {
        unsafe extern "C" {
            // atexit(3), from the C library every Rust program on Unix links.
            safe fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        // Failure (no room for another handler) only means leftovers for the next start.
        let _ = atexit(clean_up);
    }

    /// Runs in the exiting thread while the others still run, so the threads that reap the
    /// servers report their exit as usual. Fast shutdown first, immediate after 10 s; a
    /// directory whose server did not stop is left for the next cluster start.
    extern "C" fn clean_up() {
        let running = || -> Vec<Pid> { tracked().iter().filter_map(|t| t.server).collect() };
        for (signal, rounds) in [(Signal::SIGINT, 200), (Signal::SIGQUIT, 100)] {
            let servers = running();
            if servers.is_empty() {
                break;
            }
            for pid in servers {
                let _ = signal::kill(pid, signal);
            }
            for _ in 0..rounds {
                if running().is_empty() {
                    break;
                }
                thread::sleep(Duration::from_millis(50));
            }
        }
        let mut tracked = tracked();
        tracked.retain(|t| t.server.is_some() || std::fs::remove_dir_all(&t.dir).is_err());
    }
}

fn server_command(program: &Path, dir: &Path, owner: Option<&User>) -> Command {
    let mut command = Command::new(program);
    // The owner may not be able to enter our working directory.
    command.current_dir(dir);
    if let Some(owner) = owner {
        command.uid(owner.uid.as_raw()).gid(owner.gid.as_raw());
    }
    command
}

/// Has the kernel send the postmaster SIGINT (fast shutdown) when its parent dies, so no
/// server outlives the test process, however that ends.
#[cfg(any(target_os = "linux", target_os = "android"))]
#[allow(unsafe_code)]
fn die_with_parent(command: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec. It only makes the prctl(2) and
    // getppid(2) system calls, which are async-signal-safe, and builds its error from an errno
    // without allocating or taking locks.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGINT)?;
            // The parent may have died before the signal was armed.
            if nix::unistd::getppid() == parent {
                Ok(())
            } else {
                Err(nix::errno::Errno::ESRCH.into())
            }
        });
    }
}

/// Elsewhere the server outlives a killed test process until the next cluster start removes it.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn die_with_parent(_: &mut Command) {}

/// Spawns the postmaster from a thread that lives as long as the server: the parent-death
/// signal fires when the *thread* that forked the child ends, and a test's thread ends with the
/// test. The thread also reaps the server and reports its exit.
fn spawn_postmaster(
    mut command: Command,
    dir: &Path,
) -> Result<(Pid, oneshot::Receiver<ExitStatus>), TestSupportError> {
    let (spawned_tx, spawned_rx) = std::sync::mpsc::channel();
    let (exited_tx, exited_rx) = oneshot::channel();
    let dir = dir.to_owned();
    thread::Builder::new()
        .name("outbox-test-postgres".into())
        .spawn(move || match command.spawn() {
            Ok(mut child) => {
                let pid = Pid::from_raw(child.id().cast_signed());
                at_exit::server_started(&dir, pid);
                let _ = spawned_tx.send(Ok(pid));
                let status = child.wait();
                at_exit::server_exited(pid);
                if let Ok(status) = status {
                    let _ = exited_tx.send(status);
                }
            }
            Err(error) => {
                let _ = spawned_tx.send(Err(error));
            }
        })
        .map_err(TestSupportError::io("spawning a thread"))?;
    let pid = spawned_rx
        .recv()
        .map_err(|_| io::Error::other("the spawning thread died"))
        .and_then(|spawned| spawned)
        .map_err(TestSupportError::io("starting postgres"))?;
    Ok((pid, exited_rx))
}

enum Startup {
    Ready,
    Exited(String),
    TimedOut(sqlx::Error),
}

async fn wait_until_ready(url: &str, exited: &mut oneshot::Receiver<ExitStatus>) -> Startup {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match exited.try_recv() {
            Ok(status) => return Startup::Exited(format!("exited ({status})")),
            Err(oneshot::error::TryRecvError::Closed) => {
                return Startup::Exited("exited".into());
            }
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        let attempt = tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url))
            .await
            .unwrap_or_else(|_| Err(timed_out()));
        let error = match attempt {
            Ok(connection) => {
                let _ = connection.close().await;
                return Startup::Ready;
            }
            Err(error) => error,
        };
        if Instant::now() >= deadline {
            return Startup::TimedOut(error);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Removes the cluster directories of test processes that are gone, shutting down any server
/// still running in them (a process killed where there is no parent-death signal).
async fn remove_stale_clusters() {
    let Ok(entries) = fs::read_dir(env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(owner) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.strip_prefix(CLUSTER_DIR_PREFIX)?.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if owner == process::id() || is_alive(Pid::from_raw(owner.cast_signed())) {
            continue;
        }
        let dir = entry.path();
        if let Some(postmaster) = running_postmaster(&dir.join("data")) {
            let _ = signal::kill(postmaster, Signal::SIGQUIT);
            for _ in 0..100 {
                if !is_alive(postmaster) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if let Err(error) = fs::remove_dir_all(&dir) {
            tracing::debug!(dir = %dir.display(), %error, "could not remove stale test cluster");
        }
    }
}

fn is_alive(pid: Pid) -> bool {
    // EPERM: it exists, as another user.
    !matches!(signal::kill(pid, None), Err(nix::errno::Errno::ESRCH))
}

fn running_postmaster(data: &Path) -> Option<Pid> {
    let pid: i32 = fs::read_to_string(data.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()?;
    // The pid may have been reused: only signal a process that serves this data directory.
    let command_line = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let data = data.as_os_str().as_bytes();
    command_line
        .windows(data.len())
        .any(|window| window == data)
        .then(|| Pid::from_raw(pid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{TestSchema, database_url};

    #[tokio::test]
    async fn a_dedicated_cluster_restarts_on_the_same_port_and_is_removed_when_dropped() {
        let mut cluster = match Cluster::start().await {
            Err(TestSupportError::NoPostgres) => return, // nothing to own without binaries
            started => started.unwrap(),
        };
        let (url, dir) = (cluster.url().to_owned(), cluster.dir.clone());
        let schema = TestSchema::new_in(&url).await.unwrap();
        sqlx::query("CREATE TABLE kept (id int)")
            .execute(schema.pool())
            .await
            .unwrap();
        let mut session = PgConnection::connect(&url).await.unwrap();
        cluster.restart().await.unwrap();
        assert_eq!(cluster.url(), url);
        // The fast shutdown cut the open session; new ones reach the same data.
        assert!(sqlx::query("SELECT 1").execute(&mut session).await.is_err());
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM kept")
            .fetch_one(schema.pool())
            .await
            .unwrap();
        assert_eq!(count, 0);
        schema.drop_schema().await.unwrap();
        drop(cluster);
        assert!(!dir.exists());
    }

    /// Set for the child processes of the clean-up tests.
    const CHILD: &str = "OUTBOX_TEST_CLUSTER_CHILD";

    /// In a child process (see below): starts the shared cluster, prints its directory, and
    /// then returns (`exit`) or waits to be killed (`wait`).
    #[tokio::test]
    #[ignore = "run in a child process by the clean-up tests"]
    async fn cluster_child() {
        let Ok(then) = env::var(CHILD) else { return };
        database_url().await.unwrap();
        println!(
            "cluster dir: {}",
            super::super::CLUSTER.get().unwrap().dir.display()
        );
        if then == "wait" {
            tokio::time::sleep(Duration::from_mins(2)).await;
        }
    }

    /// Runs [`cluster_child`] in a child process without `DATABASE_URL`; `None` without
    /// server binaries.
    fn spawn_cluster_child(then: &str) -> Option<(process::Child, PathBuf)> {
        use std::io::BufRead as _;
        find_bindir()?;
        let mut child = Command::new(env::current_exe().unwrap())
            .args([
                "--exact",
                "testing::cluster::tests::cluster_child",
                "--ignored",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env_remove("DATABASE_URL")
            .env(CHILD, then)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = io::BufReader::new(child.stdout.take().unwrap());
        let dir = (&mut stdout)
            .lines()
            .map_while(Result::ok)
            // libtest prints the test's name on the same line.
            .find_map(|line| Some(PathBuf::from(line.split_once("cluster dir: ")?.1)))
            .expect("the child prints its cluster's directory");
        // The child must not fail on writing what follows.
        thread::spawn(move || io::copy(&mut stdout, &mut io::sink()));
        assert!(dir.join("data").is_dir());
        Some((child, dir))
    }

    #[test]
    fn a_process_that_exits_removes_its_cluster() {
        let Some((mut child, dir)) = spawn_cluster_child("exit") else {
            return; // nothing to start without binaries
        };
        assert!(child.wait().unwrap().success());
        assert!(!dir.exists(), "{} was left behind", dir.display());
    }

    #[tokio::test]
    async fn a_killed_process_leaves_its_cluster_to_the_next_start() {
        let Some((mut child, dir)) = spawn_cluster_child("wait") else {
            return;
        };
        child.kill().unwrap(); // SIGKILL: no clean-up runs
        child.wait().unwrap();
        assert!(dir.join("data").is_dir());
        remove_stale_clusters().await;
        assert!(!dir.exists(), "{} was left behind", dir.display());
    }
}
