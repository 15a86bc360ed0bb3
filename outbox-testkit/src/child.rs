//! Re-running the current executable as a child process, for the runs that need a
//! process to kill or pause: the recovery lab's publisher (SIGKILLed once its claim has
//! committed), the chaos run's relays (killed, paused, restarted) and the benchmark's
//! memory probe. One protocol for all of them:
//!
//! - The parent starts [`std::env::current_exe`] again with a [`ChildCommand`]'s
//!   arguments, `OUTBOX_CHILD=<role>`, and the role's parameters as
//!   `OUTBOX_CHILD_<NAME>=<value>`. The child's stdin and stdout are null; its stderr is
//!   a pipe to the parent.
//! - The child's entry point runs first: before anything else in `main` (an example), or
//!   as a `#[test]` of its own that the arguments select (a test binary). [`requested`]
//!   tells it whether this process is that child; in any other process (a normal test
//!   run, the parent) it returns at once.
//! - The child writes its protocol lines to stderr with [`say`], beside whatever else it
//!   logs there. The parent reads them with [`handshake`] (the first line carrying a
//!   marker) or [`read_lines`] (every line).
//! - The parent signals it ([`Child::signal`], [`Child::kill`]). A child exits by itself
//!   once its parent is gone, and dropping a [`Child`] kills one still running: no child
//!   outlives its run.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{ChildStderr, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The variable naming the role a child was started for; its parameters are
/// `OUTBOX_CHILD_<NAME>`.
const ROLE: &str = "OUTBOX_CHILD";

fn param_var(name: &str) -> String {
    format!("{ROLE}_{name}")
}

/// How the current executable is made to run a child's entry point.
#[derive(Clone, Debug)]
pub struct ChildCommand {
    args: Vec<String>,
}

impl ChildCommand {
    /// In a test binary: run only the `#[test]` named `test`, which calls the child's
    /// entry point (a no-op in a normal test run).
    pub fn test(test: &str) -> Self {
        Self {
            args: ["--exact", test, "--nocapture", "--test-threads=1"]
                .map(String::from)
                .to_vec(),
        }
    }

    /// In a binary whose `main` calls the child's entry point first (an example): the
    /// binary, without arguments.
    pub fn binary() -> Self {
        Self { args: Vec::new() }
    }

    /// Starts the current executable as the child `role`, with `params` (read in the
    /// child with [`param`]).
    pub fn spawn(&self, role: &str, params: &[(&str, &str)]) -> Result<Child, String> {
        let exe = std::env::current_exe().map_err(|e| format!("the current executable: {e}"))?;
        let mut command = Command::new(exe);
        command
            .args(&self.args)
            .env(ROLE, role)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, value) in params {
            command.env(param_var(name), value);
        }
        let process = command
            .spawn()
            .map_err(|e| format!("spawning the {role}: {e}"))?;
        let pid = Pid::from_raw(i32::try_from(process.id()).map_err(|e| e.to_string())?);
        Ok(Child { process, pid })
    }
}

/// A running child, killed when dropped.
pub struct Child {
    process: std::process::Child,
    pid: Pid,
}

impl Child {
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// The child's stderr, where its protocol lines arrive; only once.
    pub fn stderr(&mut self) -> Result<ChildStderr, String> {
        self.process
            .stderr
            .take()
            .ok_or_else(|| format!("the stderr of child {} is taken", self.pid))
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, SIGTERM, ...).
    pub fn signal(&self, signal: Signal) -> Result<(), String> {
        kill(self.pid, signal).map_err(|e| format!("{signal} to child {}: {e}", self.pid))
    }

    /// SIGKILLs the child and reaps it.
    pub fn kill(&mut self) -> Result<ExitStatus, String> {
        self.signal(Signal::SIGKILL)?;
        self.wait()
    }

    /// Waits for the child to exit.
    pub fn wait(&mut self) -> Result<ExitStatus, String> {
        self.process
            .wait()
            .map_err(|e| format!("waiting for child {}: {e}", self.pid))
    }

    /// The child's exit status, if it exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, String> {
        self.process
            .try_wait()
            .map_err(|e| format!("child {}: {e}", self.pid))
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if matches!(self.process.try_wait(), Ok(None)) {
            let _ = self.kill();
        }
    }
}

/// In a child's entry point: whether this process was started as the child `role`.
/// When it was, the process also exits by itself once its parent is gone (there is no
/// parent-death signal without unsafe code).
pub fn requested(role: &str) -> bool {
    if std::env::var(ROLE).ok().as_deref() != Some(role) {
        return false;
    }
    let parent = nix::unistd::getppid();
    std::thread::Builder::new()
        .name("orphan-watch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(500));
                if nix::unistd::getppid() != parent {
                    std::process::exit(3);
                }
            }
        })
        .expect("a thread to watch the parent");
    true
}

/// In a child: the parameter `name` its parent passed to [`ChildCommand::spawn`].
pub fn param(name: &str) -> Option<String> {
    std::env::var(param_var(name)).ok()
}

/// In a child: writes a protocol line to stderr, at once.
pub fn say(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}").and_then(|()| err.flush());
}

/// In the parent: reads `output` line by line on a thread named `thread`, calling `each`
/// with every line until the child closes it (when it exits).
pub fn read_lines(
    thread: String,
    output: impl Read + Send + 'static,
    mut each: impl FnMut(&str) + Send + 'static,
) -> Result<JoinHandle<()>, String> {
    std::thread::Builder::new()
        .name(thread)
        .spawn(move || {
            for line in BufReader::new(output).lines().map_while(Result::ok) {
                each(&line);
            }
        })
        .map_err(|e| format!("a thread to read a child's output: {e}"))
}

/// In the parent: waits up to `within` for the first line of `output` carrying `marker`,
/// and returns it from the marker on (a test harness may print its own text before it on
/// the same line). Every other line is echoed to this process's stderr, so that a
/// child's error or panic shows where its parent runs.
pub async fn handshake(
    output: impl Read + Send + 'static,
    marker: &'static str,
    within: Duration,
) -> Result<String, String> {
    let (found, line) = tokio::sync::oneshot::channel();
    let mut found = Some(found);
    read_lines(format!("{marker} handshake"), output, move |line| {
        match (line.find(marker), found.take()) {
            (Some(at), Some(found)) => {
                let _ = found.send(line[at..].to_owned());
            }
            (_, unsent) => {
                found = unsent;
                eprintln!("{line}");
            }
        }
    })?;
    match tokio::time::timeout(within, line).await {
        Ok(Ok(line)) => Ok(line),
        Ok(Err(_)) => Err(format!("the child exited without printing {marker}")),
        Err(_) => Err(format!("the child printed no {marker} within {within:?}")),
    }
}
