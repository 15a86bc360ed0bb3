//! Stage 3: every statement and migration of a table, rendered as text at expansion
//! time. Table and column names were validated as plain identifiers and are quoted
//! anyway; values only ever arrive as bound parameters.

use std::fmt::Write as _;
use std::time::Duration;

use crate::model::{Field, Model};

/// The guard every outcome carries: this row, still claimed, by this generation, with
/// a live lease by the wall clock (not the statement's start).
///
/// `status || ''` is `status`, written so the planner cannot match the INPROGRESS
/// partial index: its leading column is not `id`, and its row estimate is usually
/// stale (it was near empty at the last ANALYZE), so the planner would scan all of it
/// for every row of a batch instead of probing the primary key.
const OWNED: &str = "id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()";

pub(crate) struct Sql {
    pub(crate) enqueue: String,
    pub(crate) enqueue_all: String,
    pub(crate) claim: String,
    pub(crate) complete: String,
    pub(crate) retry: String,
    pub(crate) renew: String,
    pub(crate) fail: String,
    pub(crate) complete_batch: String,
    pub(crate) record: String,
    pub(crate) renew_batch: String,
    pub(crate) requeue_dead: String,
    pub(crate) requeue_all_dead: String,
    pub(crate) prune_sent: String,
    pub(crate) stats: String,
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

        let (enqueue, enqueue_all) = enqueue(model, &t, &payload);

        let returning = ["id", "event_id", "generation", "attempts", "lease_until"]
            .into_iter()
            .map(|c| format!("o.{c}"))
            // A reserved name, so no payload column can share it.
            .chain(std::iter::once(
                "o.id = ANY(ARRAY(SELECT id FROM expired)) AS outbox_reclaimed".to_owned(),
            ))
            .chain(payload.iter().map(|c| format!("o.{c}")))
            .collect::<Vec<_>>()
            .join(", ");
        let claim = format!(
            "WITH {}\n{}",
            candidates(&t),
            claim_candidates(&t, max, &lease, &returning)
        );
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

        let batch = Batch::render(&t, max, &lease);

        let mut migrations = vec![(
            1,
            format!("V1__create_{}", model.table),
            create_table(model),
        )];
        for version in model.later_versions() {
            let added: Vec<&Field> = model.fields.iter().filter(|f| f.since == version).collect();
            // refinery keeps names in a varchar(255): name one column, or count them.
            let names = match added.as_slice() {
                [one] => one.column.clone(),
                many => format!("{}_columns", many.len()),
            };
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
            enqueue_all,
            claim,
            complete,
            retry,
            renew,
            fail,
            complete_batch: batch.complete,
            record: batch.record,
            renew_batch: batch.renew,
            requeue_dead: batch.requeue_dead,
            requeue_all_dead: batch.requeue_all_dead,
            prune_sent: batch.prune_sent,
            stats: batch.stats,
            migrations,
        }
    }
}

/// The statements of the relay and of operations: one statement per batch.
struct Batch {
    complete: String,
    record: String,
    renew: String,
    requeue_dead: String,
    requeue_all_dead: String,
    prune_sent: String,
    stats: String,
}

impl Batch {
    fn render(t: &str, max: i32, lease: &str) -> Self {
        // The relay's outcomes for a batch, in one statement. The same guard as OWNED
        // (and written the same way, for the same plan), per row of the batch: each
        // stale row is rejected on its own, and RETURNING says which rows were recorded.
        const OWNED_EACH: &str = "o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation \
             AND o.lease_until > clock_timestamp()";
        // The relay's common case, every row published: the general statement's CASEs
        // and three more arrays cost ~15% of a batch's recording, measured. (Returning
        // only the rejected rows instead costs more: the anti-join outweighs the rows.)
        let complete = format!(
            "UPDATE {t} AS o SET status = 'SENT', lease_until = NULL\n\
             FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)\n\
             WHERE {OWNED_EACH}\n\
             RETURNING o.id"
        );
        let record = format!(
            "UPDATE {t} AS o SET\n\
             \x20   status = CASE u.outcome\n\
             \x20       WHEN 'SENT' THEN 'SENT'\n\
             \x20       WHEN 'RELEASE' THEN 'READY'\n\
             \x20       WHEN 'RETRY' THEN CASE WHEN o.attempts >= {max} THEN 'DEAD' ELSE 'READY' END\n\
             \x20       ELSE 'DEAD' END,\n\
             \x20   lease_until = NULL,\n\
             \x20   attempts = CASE u.outcome WHEN 'RELEASE' THEN o.attempts - 1 ELSE o.attempts END,\n\
             \x20   next_attempt_at = CASE u.outcome\n\
             \x20       WHEN 'RETRY' THEN statement_timestamp() + u.delay\n\
             \x20       WHEN 'RELEASE' THEN statement_timestamp()\n\
             \x20       ELSE o.next_attempt_at END,\n\
             \x20   last_error = CASE\n\
             \x20       WHEN u.outcome = 'RETRY' AND o.attempts >= {max}\n\
             \x20           THEN 'attempt budget exhausted after ' || o.attempts || ' of {max} claims' || coalesce(': ' || u.error, '')\n\
             \x20       WHEN u.outcome IN ('RETRY', 'DEAD') THEN coalesce(u.error, o.last_error)\n\
             \x20       ELSE o.last_error END\n\
             FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::interval[], $5::text[])\n\
             \x20   AS u(id, generation, outcome, delay, error)\n\
             WHERE {OWNED_EACH}\n\
             RETURNING o.id, o.status"
        );
        let renew = format!(
            "UPDATE {t} AS o SET lease_until = statement_timestamp() + {lease}\n\
             FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)\n\
             WHERE {OWNED_EACH}\n\
             RETURNING o.id, o.lease_until"
        );
        // A requeued event gets a fresh attempt budget; its generation keeps counting,
        // so a claim from before it died can still never record an outcome.
        let requeue = "SET status = 'READY', attempts = 0, next_attempt_at = statement_timestamp()";
        let requeue_dead = format!(
            "UPDATE {t} {requeue} WHERE status = 'DEAD' AND event_id = ANY($1::text[]) RETURNING event_id"
        );
        let requeue_all_dead = format!(
            "WITH requeued AS (UPDATE {t} {requeue} WHERE status = 'DEAD' RETURNING 1)\n\
             SELECT count(*) AS requeued FROM requeued"
        );
        let prune_sent = format!(
            "WITH doomed AS (\n\
             \x20   SELECT id FROM {t}\n\
             \x20   WHERE status = 'SENT' AND created_at < statement_timestamp() - $1::interval\n\
             \x20   ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)\n\
             DELETE FROM {t} AS o USING doomed AS d WHERE o.id = d.id"
        );
        let stats = format!(
            "SELECT\n\
             \x20   count(*) FILTER (WHERE status = 'READY') AS ready,\n\
             \x20   count(*) FILTER (WHERE status = 'INPROGRESS') AS in_progress,\n\
             \x20   count(*) FILTER (WHERE status = 'SENT') AS sent,\n\
             \x20   count(*) FILTER (WHERE status = 'DEAD') AS dead,\n\
             \x20   count(*) FILTER (WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()) AS expired_claims,\n\
             \x20   statement_timestamp() - min(CASE\n\
             \x20       WHEN status = 'READY' AND next_attempt_at <= statement_timestamp() THEN next_attempt_at\n\
             \x20       WHEN status = 'INPROGRESS' AND lease_until <= statement_timestamp() THEN lease_until END)\n\
             \x20       AS oldest_eligible_age\n\
             FROM {t}"
        );
        Self {
            complete,
            record,
            renew,
            requeue_dead,
            requeue_all_dead,
            prune_sent,
            stats,
        }
    }
}

/// The single and the bulk insert; both notify the relay on commit.
///
/// Both are idempotent on the event id: `ON CONFLICT (event_id) DO NOTHING` skips an
/// event already in the table (or earlier in the same bulk insert) instead of raising a
/// unique violation, which would abort the caller's business transaction. They return
/// what they wrote: the single insert its row id (none for a duplicate), the bulk insert
/// the event id of every row written.
fn enqueue(model: &Model, t: &str, payload: &[String]) -> (String, String) {
    let columns = std::iter::once("event_id".to_owned())
        .chain(payload.iter().cloned())
        .collect::<Vec<_>>()
        .join(", ");
    // The notification is sent when the enqueuing transaction commits, waking an idle
    // relay at once; identical notifications of one transaction are merged, and none is
    // sent when nothing was written.
    let notify = format!(
        "(SELECT pg_notify('{}', '') FROM enqueued LIMIT 1) AS notified",
        model.table
    );
    let enqueue = {
        let params = (1..=payload.len() + 1)
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>();
        format!(
            "WITH enqueued AS (\n\
             \x20   INSERT INTO {t} ({columns}) VALUES ({})\n\
             \x20   ON CONFLICT (event_id) DO NOTHING RETURNING id)\n\
             SELECT id FROM enqueued, {notify}",
            params.join(", "),
        )
    };

    // Many events in one statement: one array parameter per column, so the text
    // stays the same whatever the number of events.
    let enqueue_all = {
        let arrays = std::iter::once("text")
            .chain(model.fields.iter().map(|f| f.sql_type.ddl))
            .enumerate()
            .map(|(i, ty)| format!("${}::{ty}[]", i + 1))
            .collect::<Vec<_>>();
        format!(
            "WITH enqueued AS (\n\
             \x20   INSERT INTO {t} ({columns}) SELECT * FROM unnest({})\n\
             \x20   ON CONFLICT (event_id) DO NOTHING RETURNING event_id)\n\
             SELECT event_id FROM enqueued, {notify}",
            arrays.join(", "),
        )
    };
    (enqueue, enqueue_all)
}

/// The claim's candidates: up to `$1` rows. Each eligibility path reads its own
/// partial index in its own order and locks with SKIP LOCKED (a locking clause cannot
/// sit on a UNION), so claim cost stays flat however many SENT, DEAD or expired rows
/// pile up. Expired claims come first (their publishers are gone: the oldest work),
/// due READY rows fill the rest: every row locked is a row claimed, where two branches
/// of `$1` each would lock up to twice the batch and hold the surplus until commit.
fn candidates(t: &str) -> String {
    format!(
        "expired AS (\n\
         \x20   SELECT id, ctid FROM {t}\n\
         \x20   WHERE status = 'INPROGRESS' AND lease_until <= statement_timestamp()\n\
         \x20   ORDER BY lease_until, id LIMIT $1 FOR UPDATE SKIP LOCKED\n\
         ), ready AS (\n\
         \x20   SELECT ctid FROM {t}\n\
         \x20   WHERE status = 'READY' AND next_attempt_at <= statement_timestamp()\n\
         \x20   ORDER BY next_attempt_at, id LIMIT $1 - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED\n\
         )"
    )
}

/// Claims the candidates: generation + 1 and a fresh lease. An expired claim that used
/// the whole attempt budget is moved to DEAD instead (its lease_until comes back NULL).
///
/// The candidates are found again by their `ctid`s as one array, a TID scan of their
/// pages, not by a join: planned on a table it thinks small, PostgreSQL hash-joins them
/// against a sequential scan of the whole table, and the claim's cached plan keeps
/// doing so as the table grows (measured: 10 ms instead of 1.5 ms beside 10,000 rows).
/// The rows are locked, so their `ctid`s hold until the update. (A row that another
/// transaction updated after this statement's snapshot yet left due would be locked
/// and left unclaimed, where a join on `id` would claim it; none of ours does that.)
fn claim_candidates(t: &str, max: i32, lease: &str, returning: &str) -> String {
    format!(
        "UPDATE {t} AS o SET\n\
         \x20   status = CASE WHEN o.attempts >= {max} THEN 'DEAD' ELSE 'INPROGRESS' END,\n\
         \x20   generation = CASE WHEN o.attempts >= {max} THEN o.generation ELSE o.generation + 1 END,\n\
         \x20   attempts = CASE WHEN o.attempts >= {max} THEN o.attempts ELSE o.attempts + 1 END,\n\
         \x20   lease_until = CASE WHEN o.attempts >= {max} THEN NULL ELSE statement_timestamp() + {lease} END,\n\
         \x20   last_error = CASE WHEN o.attempts >= {max}\n\
         \x20       THEN 'lease expired on claim ' || o.attempts || ' of {max}: attempt budget exhausted'\n\
         \x20       ELSE o.last_error END\n\
         WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM expired UNION ALL SELECT ctid FROM ready))\n\
         RETURNING {returning}"
    )
}

/// The table. `generation` starts at a random value below 2^62 (and counts up by one
/// per claim): a claim token is a row id and a generation, and ids start at 1 in every
/// table, schema and database, and again after `TRUNCATE .. RESTART IDENTITY`. From a
/// random start, a claim taken on one table cannot match a row of another (or of the
/// same table rebuilt), so it can never record an outcome there.
///
/// `event_id` is compared in byte order (`COLLATE "C"`): ids are only ever
/// matched, never sorted for people, and its unique index takes a new entry, checked
/// against its neighbours, on every claim and outcome (no update is HOT), where a
/// locale-aware comparison costs far more than a `memcmp`.
fn create_table(model: &Model) -> String {
    let t = quoted(&model.table);
    let mut sql = format!(
        "-- Generated by #[derive(Outbox)]. Refinery checksums this text: it never changes once released.\n\
         CREATE TABLE {t} (\n\
         \x20   id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n\
         \x20   event_id text COLLATE \"C\" NOT NULL UNIQUE,\n\
         \x20   status text NOT NULL DEFAULT 'READY'\n\
         \x20       CHECK (status IN ('READY', 'INPROGRESS', 'SENT', 'DEAD')),\n\
         \x20   generation bigint NOT NULL DEFAULT (random() * (2 ^ 62))::bigint,\n\
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
         )\n\
         -- Every event is updated twice, never HOT (status is in the partial indexes'\n\
         -- predicates): vacuum after 1% of the rows are dead, not autovacuum's default 20%,\n\
         -- and at full speed, so dead entries do not pile up where claims scan.\n\
         WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);\n\
         -- One partial index per eligibility path of the claim; SENT and DEAD rows are in neither.\n\
         CREATE INDEX ON {t} (next_attempt_at, id) WHERE status = 'READY';\n\
         CREATE INDEX ON {t} (lease_until, id) WHERE status = 'INPROGRESS';\n\
         -- DEAD rows are few and looked at by operators: requeue and stats find them here.\n\
         CREATE INDEX ON {t} (id) WHERE status = 'DEAD';\n"
    );
    sql
}
