//! Where a phase's WAL went: `pg_waldump` over the phase's range of the server's WAL,
//! each record's bytes charged to what wrote it (a heap insert, a row lock, an entry of
//! one index, a full-page image, ..). Needs the server on this machine, its `pg_wal`
//! readable and the server's own `pg_waldump`; the section says so when it has none.

use std::collections::BTreeMap;
use std::path::PathBuf;

use sqlx::PgPool;

use super::Result;

/// Bytes of WAL by source.
pub(super) type Breakdown = BTreeMap<String, u64>;

/// The server's `pg_waldump` and WAL directory.
pub(super) struct WalDump {
    program: PathBuf,
    wal: PathBuf,
}

impl WalDump {
    /// The server's own `pg_waldump` (its major version's, Debian's layout or `PATH`),
    /// if it and the server's `pg_wal` can be reached from here.
    pub(super) async fn find(pool: &PgPool) -> Option<Self> {
        let data: String = sqlx::query_scalar("SHOW data_directory")
            .fetch_one(pool)
            .await
            .ok()?;
        let version: String = sqlx::query_scalar("SHOW server_version_num")
            .fetch_one(pool)
            .await
            .ok()?;
        let major = version.parse::<u32>().ok()? / 10_000;
        let wal = PathBuf::from(data).join("pg_wal");
        std::fs::read_dir(&wal).ok()?;
        let debian = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin/pg_waldump"));
        let program = if debian.exists() {
            debian
        } else {
            PathBuf::from("pg_waldump")
        };
        let probe = std::process::Command::new(&program)
            .arg("--version")
            .output()
            .ok()?;
        let answer = String::from_utf8_lossy(&probe.stdout);
        answer
            .contains(&format!(" {major}."))
            .then_some(Self { program, wal })
    }

    /// The WAL from `start` to `end` by source. Call it before the next checkpoint,
    /// which may recycle the segments.
    pub(super) async fn between(&self, pool: &PgPool, start: &str, end: &str) -> Result<Breakdown> {
        // Only what is flushed is in the files; a phase ends with a commit, which is.
        let flushed: String =
            sqlx::query_scalar("SELECT least(pg_current_wal_flush_lsn(), $1::pg_lsn)::text")
                .bind(end)
                .fetch_one(pool)
                .await?;
        let output = std::process::Command::new(&self.program)
            .arg("-p")
            .arg(&self.wal)
            .args(["-s", start, "-e", &flushed])
            .output()?;
        let names = relation_names(pool).await?;
        let mut breakdown = Breakdown::new();
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some(record) = Record::parse(line) {
                let image = record.total - record.main;
                *breakdown.entry(record.source(&names)).or_default() += record.main;
                if image > 0 {
                    *breakdown.entry("full-page images".into()).or_default() += image;
                }
            }
        }
        Ok(breakdown)
    }
}

/// The relations of the current schemas (and pgmq's) by file node, as records name them.
async fn relation_names(pool: &PgPool) -> Result<BTreeMap<String, String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT pg_relation_filenode(c.oid)::text, c.relname::text FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE (n.nspname = ANY(current_schemas(false)) OR n.nspname = 'pgmq') \
           AND pg_relation_filenode(c.oid) IS NOT NULL",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// One line of `pg_waldump`: `rmgr: Heap len (rec/tot): 79/ 79, tx: .., desc: INSERT
/// off 3 .., blkref #0: rel 1663/16384/16412 blk 0 [FPW]`.
struct Record<'a> {
    manager: &'a str,
    kind: &'a str,
    /// The record without its full-page images, and with them.
    main: u64,
    total: u64,
    node: Option<&'a str>,
}

impl<'a> Record<'a> {
    fn parse(line: &'a str) -> Option<Self> {
        let manager = line.strip_prefix("rmgr: ")?.split_whitespace().next()?;
        let (_, lengths) = line.split_once("len (rec/tot):")?;
        let (lengths, _) = lengths.split_once(',')?;
        let (main, total) = lengths.split_once('/')?;
        let (_, desc) = line.split_once("desc: ")?;
        let kind = desc.split_whitespace().next()?.trim_end_matches(',');
        let node = line
            .split_once("blkref #0: rel ")
            .and_then(|(_, rel)| rel.split_whitespace().next())
            .and_then(|rel| rel.rsplit('/').next());
        Some(Self {
            manager,
            kind,
            main: main.trim().parse().ok()?,
            total: total.trim().parse().ok()?,
            node,
        })
    }

    /// What the record is the price of.
    fn source(&self, names: &BTreeMap<String, String>) -> String {
        let relation = self.node.and_then(|n| names.get(n));
        match (self.manager, self.kind) {
            ("Transaction", _) => "commits".into(),
            ("Heap", "INSERT" | "INSERT+INIT") => "heap: rows inserted".into(),
            ("Heap", "HEAP_CONFIRM") => "heap: `ON CONFLICT` confirmations".into(),
            ("Heap", "LOCK") => "heap: row locks (`FOR UPDATE SKIP LOCKED`)".into(),
            ("Heap", "UPDATE" | "HOT_UPDATE") => "heap: new row versions".into(),
            ("Heap", "DELETE") => "heap: rows deleted".into(),
            ("Heap2", _) => "heap: pruning and vacuum".into(),
            ("Btree", _) => match relation {
                Some(name) => format!("index `{name}`"),
                None => "indexes of other tables".into(),
            },
            (manager, _) => format!("other ({manager})"),
        }
    }
}
