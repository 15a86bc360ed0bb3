//! Stage 3: every statement and migration of a table, rendered as text at expansion
//! time. Table and column names were validated as plain identifiers and are quoted
//! anyway; values only ever arrive as bound parameters.

use std::fmt::Write as _;
use std::time::Duration;

use crate::model::{Field, Model};

/// The guard every outcome carries: this row, still claimed, by this generation, with
/// a live lease by the wall clock (not the statement's start).
const OWNED: &str =
    "id = $1 AND status = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()";

pub(crate) struct Sql {
    pub(crate) enqueue: String,
    pub(crate) claim: String,
    pub(crate) complete: String,
    pub(crate) retry: String,
    pub(crate) renew: String,
    pub(crate) fail: String,
    /// (version, refinery name, SQL)
    pub(crate) migrations: Vec<(u32, String, String)>,
}

fn quoted(name: &str) -> String {
    format!("\"{name}\"")
}

/// A PostgreSQL interval literal for `d`, exact to the microsecond.
fn interval(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("interval '{} seconds'", d.as_secs())
    } else {
        format!("interval '{} microseconds'", d.as_micros())
    }
}

impl Sql {
    pub(crate) fn render(model: &Model) -> Self {
        let t = quoted(&model.table);
        let max = model.max_attempts;
        let lease = interval(model.lease);
        let payload: Vec<String> = model.fields.iter().map(|f| quoted(&f.column)).collect();

        let enqueue = {
            let columns = std::iter::once("event_id".to_owned())
                .chain(payload.iter().cloned())
                .collect::<Vec<_>>();
            let params = (1..=columns.len())
                .map(|i| format!("${i}"))
                .collect::<Vec<_>>();
            format!(
                "INSERT INTO {t} ({}) VALUES ({})",
                columns.join(", "),
                params.join(", ")
            )
        };

        let returning = ["id", "event_id", "generation", "attempts", "lease_until"]
            .into_iter()
            .map(str::to_owned)
            .chain(payload.iter().cloned())
            .map(|c| format!("o.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let claim = claim(&t, max, &lease, &returning);
        let complete = format!(
            "UPDATE {t} SET status = 'SENT', lease_until = NULL WHERE {OWNED} RETURNING id"
        );
        let retry = format!(
            "UPDATE {t} SET\n\
             \x20   status = CASE WHEN attempts >= {max} THEN 'DEAD' ELSE 'READY' END,\n\
             \x20   lease_until = NULL,\n\
             \x20   next_attempt_at = statement_timestamp() + $3::interval,\n\
             \x20   last_error = CASE WHEN attempts >= {max}\n\
             \x20       THEN 'attempt budget exhausted after ' || attempts || ' of {max} claims' || coalesce(': ' || $4::text, '')\n\
             \x20       ELSE coalesce($4::text, last_error) END\n\
             WHERE {OWNED}\n\
             RETURNING status"
        );
        let renew = format!(
            "UPDATE {t} SET lease_until = statement_timestamp() + {lease} WHERE {OWNED} RETURNING lease_until"
        );
        let fail = format!(
            "UPDATE {t} SET status = 'DEAD', lease_until = NULL, last_error = $3 WHERE {OWNED} RETURNING id"
        );

        let mut migrations = vec![(
            1,
            format!("V1__create_{}", model.table),
            create_table(model),
        )];
        for version in model.later_versions() {
            let added: Vec<&Field> = model.fields.iter().filter(|f| f.since == version).collect();
            let names = added
                .iter()
                .map(|f| f.column.as_str())
                .collect::<Vec<_>>()
                .join("_");
            let mut sql = String::new();
            for f in added {
                let _ = writeln!(
                    sql,
                    "ALTER TABLE {t} ADD COLUMN {} {};",
                    quoted(&f.column),
                    f.sql_type.ddl
                );
            }
            migrations.push((version, format!("V{version}__add_{names}"), sql));
        }

        Self {
            enqueue,
            claim,
            complete,
            retry,
            renew,
            fail,
            migrations,
        }
    }
}

/// The claim of up to `$1` rows.
fn claim(t: &str, max: i32, lease: &str, returning: &str) -> String {
    // Each eligibility path reads its own partial index in its own order and locks
    // with SKIP LOCKED (a locking clause cannot sit on the UNION), so claim cost
    // stays flat however many SENT or DEAD rows pile up. Expired claims that used
    // the whole attempt budget are moved to DEAD by the same statement.
    format!(
        "WITH exhausted AS (\n\
         \x20   UPDATE {t} SET status = 'DEAD', lease_until = NULL,\n\
         \x20       last_error = 'lease expired on claim ' || attempts || ' of {max}: attempt budget exhausted'\n\
         \x20   WHERE id IN (\n\
         \x20       SELECT id FROM {t}\n\
         \x20       WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp() AND attempts >= {max}\n\
         \x20       ORDER BY lease_until, id LIMIT $1 FOR UPDATE SKIP LOCKED)\n\
         ), ready AS (\n\
         \x20   SELECT id FROM {t}\n\
         \x20   WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()\n\
         \x20   ORDER BY next_attempt_at, id LIMIT $1 FOR UPDATE SKIP LOCKED\n\
         ), expired AS (\n\
         \x20   SELECT id FROM {t}\n\
         \x20   WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp() AND attempts < {max}\n\
         \x20   ORDER BY lease_until, id LIMIT $1 FOR UPDATE SKIP LOCKED\n\
         ), candidate AS (\n\
         \x20   SELECT id FROM ready UNION ALL SELECT id FROM expired ORDER BY id LIMIT $1\n\
         )\n\
         UPDATE {t} AS o\n\
         SET status = 'INPROGRESS', generation = o.generation + 1, attempts = o.attempts + 1,\n\
         \x20   lease_until = statement_timestamp() + {lease}\n\
         FROM candidate AS c\n\
         WHERE o.id = c.id\n\
         RETURNING {returning}"
    )
}

fn create_table(model: &Model) -> String {
    let t = quoted(&model.table);
    let mut sql = format!(
        "-- Generated by #[derive(Outbox)]. Refinery checksums this text: it never changes once released.\n\
         CREATE TABLE {t} (\n\
         \x20   id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n\
         \x20   event_id text NOT NULL UNIQUE,\n\
         \x20   status text NOT NULL DEFAULT 'READY'\n\
         \x20       CHECK (status IN ('READY', 'INPROGRESS', 'SENT', 'DEAD')),\n\
         \x20   generation bigint NOT NULL DEFAULT 0,\n\
         \x20   attempts integer NOT NULL DEFAULT 0,\n\
         \x20   lease_until timestamptz,\n\
         \x20   next_attempt_at timestamptz NOT NULL DEFAULT statement_timestamp(),\n\
         \x20   last_error text,\n\
         \x20   created_at timestamptz NOT NULL DEFAULT statement_timestamp(),\n"
    );
    for f in model.fields.iter().filter(|f| f.since == 1) {
        let null = if f.nullable() { "" } else { " NOT NULL" };
        let _ = writeln!(sql, "    {} {}{null},", quoted(&f.column), f.sql_type.ddl);
    }
    let _ = write!(
        sql,
        "    CHECK ((status = 'INPROGRESS') = (lease_until IS NOT NULL))\n\
         );\n\
         -- One partial index per eligibility path of the claim; SENT and DEAD rows are in neither.\n\
         CREATE INDEX ON {t} (next_attempt_at, id) WHERE status = 'READY';\n\
         CREATE INDEX ON {t} (lease_until, id) WHERE status = 'INPROGRESS';\n"
    );
    sql
}
