//! CPU time from `/proc`: the machine's, the PostgreSQL server's process tree's (when
//! it runs on this machine), and this process's. On a shared machine, the work's own
//! CPU per event moves far less from run to run than its events per second.

use super::Bench;

/// `/proc` counts CPU time in `USER_HZ`, 100 on every Linux ABI.
const TICKS_PER_SECOND: f64 = 100.0;

impl Bench {
    /// The postmaster's pid of the bench's server (see [`postmaster`]).
    pub(super) async fn postmaster(&self) -> Option<u32> {
        postmaster(&self.pool).await
    }
}

/// The postmaster's pid of `pool`'s server, when it runs on this machine (its
/// `postmaster.pid` is readable and names a live `postgres` process).
pub(super) async fn postmaster(pool: &sqlx::PgPool) -> Option<u32> {
    let data: String = sqlx::query_scalar("SHOW data_directory")
        .fetch_one(pool)
        .await
        .ok()?;
    let pid_file = std::fs::read_to_string(format!("{data}/postmaster.pid")).ok()?;
    let pid: u32 = pid_file.lines().next()?.trim().parse().ok()?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    (comm.trim() == "postgres").then_some(pid)
}

/// CPU time a piece of work took (seconds, or per event): the server's and this
/// process's.
#[derive(Clone, Copy)]
pub(super) struct Work {
    pub(super) server: f64,
    pub(super) client: f64,
}

impl Work {
    pub(super) fn total(self) -> f64 {
        self.server + self.client
    }

    /// Per event of `n`, in µs (ms per 1,000 events).
    pub(super) fn per_event(self, n: usize) -> Self {
        Self {
            server: self.server * 1e6 / n as f64,
            client: self.client * 1e6 / n as f64,
        }
    }
}

/// CPU time so far: the machine's (busy and total ticks, `/proc/stat`), the
/// postmaster's process tree's (its children's and, through its `cutime`, those that
/// have exited), and this process's.
pub(super) struct Cpu {
    /// Busy and total ticks, and the number of CPUs.
    machine: Option<(u64, u64, usize)>,
    server: Option<u64>,
    client: Option<u64>,
}

impl Cpu {
    pub(super) fn now(postmaster: Option<u32>) -> Self {
        Self {
            machine: machine_ticks(),
            server: postmaster.and_then(server_ticks),
            client: std::fs::read_to_string("/proc/self/stat")
                .ok()
                .and_then(|stat| stat_ticks(&stat, &[14, 15])),
        }
    }

    pub(super) fn machine_cores(&self, before: &Self) -> Option<f64> {
        let ((busy, total, cpus), (busy0, total0, _)) = (self.machine?, before.machine?);
        Some((busy - busy0) as f64 / (total - total0).max(1) as f64 * cpus as f64)
    }

    pub(super) fn server_cores(&self, before: &Self, seconds: f64) -> Option<f64> {
        Some(self.server?.saturating_sub(before.server?) as f64 / TICKS_PER_SECOND / seconds)
    }

    /// The CPU seconds of the server's process tree and of this process since `before`.
    pub(super) fn work_seconds(&self, before: &Self) -> Option<Work> {
        let server = self.server?.saturating_sub(before.server?);
        let client = self.client?.saturating_sub(before.client?);
        Some(Work {
            server: server as f64 / TICKS_PER_SECOND,
            client: client as f64 / TICKS_PER_SECOND,
        })
    }

    pub(super) fn client_cores(&self, before: &Self, seconds: f64) -> Option<f64> {
        Some(self.client?.saturating_sub(before.client?) as f64 / TICKS_PER_SECOND / seconds)
    }
}

fn machine_ticks() -> Option<(u64, u64, usize)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpus = stat
        .lines()
        .filter(|l| {
            l.strip_prefix("cpu")
                .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal (guest time is within user).
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3)? + fields.get(4)?;
    Some((total - idle, total, cpus))
}

fn server_ticks(postmaster: u32) -> Option<u64> {
    let mut ticks = 0;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if pid == postmaster {
            ticks += stat_ticks(&stat, &[14, 15, 16, 17]).unwrap_or(0);
        } else if stat_ticks(&stat, &[4]) == Some(u64::from(postmaster)) {
            ticks += stat_ticks(&stat, &[14, 15]).unwrap_or(0);
        }
    }
    Some(ticks)
}

/// The sum of the numbered fields of a `/proc/<pid>/stat` (4: the parent's pid; 14, 15:
/// user and system ticks; 16, 17: those of the children waited for).
fn stat_ticks(stat: &str, numbers: &[usize]) -> Option<u64> {
    // Fields are numbered from 1, and the text after the name starts at field 3.
    let (_, after_name) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    numbers
        .iter()
        .map(|n| fields.get(n.checked_sub(3)?)?.parse::<u64>().ok())
        .sum()
}

/// Marks around the work whose instructions callgrind counts (`instructions.py`, which
/// has callgrind dump its counts before each): the dump an `ends` triggers holds the
/// work since the mark before it, which says whether its event type is traced. Each
/// does nothing, in its own way, so that the compiler folds no two into one.
pub(super) mod marks {
    /// Traced or untraced work begins.
    pub(in super::super) fn begins(traced: bool) {
        if traced {
            traced_begins();
        } else {
            untraced_begins();
        }
    }

    #[inline(never)]
    fn traced_begins() {
        std::hint::black_box(1);
    }

    #[inline(never)]
    fn untraced_begins() {
        std::hint::black_box(2);
    }

    /// The work since the last mark ends.
    #[inline(never)]
    pub(in super::super) fn ends() {
        std::hint::black_box(3);
    }
}
