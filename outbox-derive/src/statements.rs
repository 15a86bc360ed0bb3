//! Stage 3a: every statement of a table, each defined once: its text and its
//! compile-time check, in one arm of [`define`]. Adding a statement is a variant of
//! `outbox_internals::Statement` (whose documentation is its contract: parameters and
//! result), an arm here (the `match` is exhaustive), and the function in the runtime's
//! `table/statements.rs` that binds its parameters and decodes its result.
//!
//! Table and column names were validated as plain identifiers and are quoted anyway;
//! values only ever arrive as bound parameters.

use std::time::Duration;

use outbox_internals::{Outcome, PUBLISH_AT, Statement, Status, TRACED, claim_header};
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;

use crate::model::{Dead, Model, Sent};

/// One statement: the SQL the runtime runs, and (for the `checked` feature) the
/// `::sqlx::query!` call through which the compiler verifies it against a live schema.
pub(crate) struct Definition {
    pub(crate) sql: String,
    pub(crate) checked: TokenStream,
}

/// The guard every outcome carries: this row, still claimed, by this generation, with
/// a live lease by the wall clock (not the statement's start).
///
/// `status || ''` is `status`, written so the planner cannot match the INPROGRESS
/// partial index: its leading column is not `id`, and its row estimate is usually
/// stale (it was near empty at the last ANALYZE), so the planner would scan all of it
/// for every row of a batch instead of probing the primary key.
const OWNED: &str = "id = $1 AND status || '' = 'INPROGRESS' AND generation = $2 AND lease_until > clock_timestamp()";

/// [`OWNED`] for each row `u` of a batch, written the same way for the same plan: each
/// stale row is rejected on its own, and `RETURNING` says which rows were recorded.
const OWNED_EACH: &str = "o.id = u.id AND o.status || '' = 'INPROGRESS' AND o.generation = u.generation \
     AND o.lease_until > clock_timestamp()";

/// What recording `SENT` writes beside the status: a sent row is never due again, so its
/// `next_attempt_at` says when it was sent instead (the operators' "sent in the last
/// minute"). Free: the update writes a new row version anyway, and no index of a `SENT`
/// row has the column.
const SENT_AT: &str = "next_attempt_at = statement_timestamp()";

/// The row limit in the claims' texts, where the runtime writes the number.
pub(crate) const LIMIT: &str = "\u{0}";

/// What every statement of one table is written from.
pub(crate) struct Table<'m> {
    model: &'m Model,
    /// The quoted table name.
    name: String,
    /// The payload columns, quoted.
    payload: Vec<String>,
    /// The lease as an interval literal.
    lease: String,
}

impl<'m> Table<'m> {
    pub(crate) fn new(model: &'m Model) -> Self {
        Self {
            model,
            name: quoted(&model.table),
            payload: model.fields.iter().map(|f| quoted(&f.column)).collect(),
            lease: interval(model.lease),
        }
    }

    /// The claim, with `limit` as its row limit; on a keyed table, with `runs` (the
    /// relay's) or one event per key (a claim made by hand).
    pub(crate) fn claim(&self, limit: &str, runs: bool) -> String {
        claim(self, limit, runs)
    }

    /// The claim from a position in the `READY` index, with `limit` as its row limit.
    pub(crate) fn claim_from(&self, limit: &str) -> String {
        claim_from(self, limit)
    }
}

pub(crate) fn quoted(name: &str) -> String {
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

/// The earliest time an age counts from, `MAX_INTERVAL` ago: an age saturates there, so
/// that a timestamp written by hand as `-infinity` reads as the longest age instead of
/// failing every `stats` (and stopping the monitor) with "cannot subtract infinite
/// timestamps".
fn oldest() -> String {
    format!(
        "statement_timestamp() - {}",
        interval(outbox_internals::MAX_INTERVAL)
    )
}

/// The text and check of `statement` on `table`.
#[allow(clippy::too_many_lines, reason = "one short arm per statement")]
pub(crate) fn define(statement: Statement, table: &Table<'_>) -> Definition {
    let t = &table.name;
    let max = table.model.max_attempts;
    let lease = &table.lease;
    let (sent, ready, in_progress, dead) = (
        Status::Sent.as_sql(),
        Status::Ready.as_sql(),
        Status::InProgress.as_sql(),
        Status::Dead.as_sql(),
    );
    // The `checked` calls bind one value of each parameter's type; `pool` and `event`
    // are the arguments of the function they are emitted in.
    let (ids, texts, delays) = (quote!(ids), quote!(texts), quote!(delays));
    // The parameters a table's flags add to its enqueues, after the payload: unchecked
    // (`as _`), as the user's sqlx.toml chooses between chrono and time for a
    // `timestamptz`; the runtime binds `Option`s of chrono's, std's and `String`.
    let none = quote!(, ::core::option::Option::<::core::primitive::i64>::None as _);
    let extra_params: TokenStream = extras(table, 0).iter().map(|_| none.clone()).collect();
    match statement {
        Statement::Enqueue => {
            let n = table.payload.len() + 1;
            let values = (1..=n)
                .map(|i| format!("${i}"))
                .chain(extra_values(table, n))
                .collect::<Vec<_>>()
                .join(", ");
            // A generated id (a fresh UUIDv7) cannot be in the table already: a plain
            // insert, not the speculative insertion `ON CONFLICT` makes of it, whose
            // confirmation record is 48 more bytes of WAL per event.
            let skip_duplicate = if table.model.event_id.is_some() {
                "\n    ON CONFLICT (event_id) DO NOTHING"
            } else {
                ""
            };
            let sql = format!(
                "WITH enqueued AS (\n\
                 \x20   INSERT INTO {t} ({}) VALUES ({values}){skip_duplicate} RETURNING id)\n\
                 SELECT id FROM enqueued, {}",
                insert_columns(table),
                notify(table)
            );
            let fields = checked_fields(table.model);
            let checked = quote!(::sqlx::query!(#sql, "event id" #(, #fields)* #extra_params)
                .fetch_optional(pool).await?;);
            Definition { sql, checked }
        }
        Statement::EnqueueAll => {
            // The common case: no id is already there. A plain insert, because
            // `ON CONFLICT` makes every row a speculative insertion, measured 45% slower
            // for 10,000 rows; the runtime tries this one in a savepoint first.
            let sql = format!(
                "WITH enqueued AS (\n\
                 \x20   INSERT INTO {t} ({}) {} RETURNING id)\n\
                 SELECT pg_notify('{}', '') FROM enqueued LIMIT 1",
                insert_columns(table),
                insert_rows(table),
                table.model.table,
            );
            let arrays = table.model.fields.iter().map(|_| quote!(#texts as _));
            let checked = quote!(::sqlx::query!(#sql, #texts #(, #arrays)* #extra_params)
                .fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::EnqueueAllSkipping => {
            // Without a unique index on `event_id` there is nothing to skip, and no
            // `ON CONFLICT (event_id)` could be planned.
            let skip_duplicates = if table.model.no_event_id_index.is_some() {
                ""
            } else {
                "\n    ON CONFLICT (event_id) DO NOTHING"
            };
            let sql = format!(
                "WITH enqueued AS (\n\
                 \x20   INSERT INTO {t} ({}) {}{skip_duplicates} RETURNING event_id)\n\
                 SELECT event_id FROM enqueued, {}",
                insert_columns(table),
                insert_rows(table),
                notify(table)
            );
            let arrays = table.model.fields.iter().map(|_| quote!(#texts as _));
            let checked = quote!(::sqlx::query!(#sql, #texts #(, #arrays)* #extra_params)
                .fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::Claim => {
            let sql = claim(table, "1", true);
            let checked = if table.model.key().is_some() {
                // The claim made by hand too: the same steps, without runs.
                let each = claim(table, "1", false);
                quote! {
                    ::sqlx::query!(#sql, #ids, #ids, 1_i64).fetch_all(pool).await?;
                    ::sqlx::query!(#each).fetch_all(pool).await?;
                }
            } else {
                quote!(::sqlx::query!(#sql).fetch_all(pool).await?;)
            };
            Definition { sql, checked }
        }
        Statement::ClaimFrom => {
            let sql = claim_from(table, "1");
            let checked = if table.model.key().is_some() {
                quote!(::sqlx::query!(#sql, 0_i64, #ids, #ids, 1_i64).fetch_all(pool).await?;)
            } else {
                quote!(::sqlx::query!(#sql, 0_i64).fetch_all(pool).await?;)
            };
            Definition { sql, checked }
        }
        Statement::Complete => {
            let body = match table.model.sent {
                Sent::Keep => {
                    format!(
                        "UPDATE {t} SET status = '{sent}', lease_until = NULL, {SENT_AT} WHERE {OWNED}"
                    )
                }
                Sent::Delete => format!("DELETE FROM {t} WHERE {OWNED}"),
            };
            let sql = releasing(table, &body, "", &["id"], Some("true"));
            let checked = quote!(::sqlx::query!(#sql, 1_i64, 1_i64).fetch_optional(pool).await?;);
            Definition { sql, checked }
        }
        Statement::Retry => {
            let sql = format!(
                "UPDATE {t} SET\n\
                 \x20   status = CASE WHEN attempts >= {max} THEN '{dead}' ELSE '{ready}' END,\n\
                 \x20   lease_until = NULL,\n\
                 \x20   next_attempt_at = statement_timestamp() + $3::interval,\n\
                 \x20   last_error = CASE WHEN attempts >= {max}\n\
                 \x20       THEN 'attempt budget exhausted after ' || attempts || ' of {max} claims' || coalesce(': ' || $4::text, '')\n\
                 \x20       ELSE coalesce($4::text, last_error) END\n\
                 WHERE {OWNED}"
            );
            let sql = releasing(
                table,
                &sql,
                "",
                &["status"],
                dead_releases(table).then_some("f.status = 'DEAD'"),
            );
            let checked = quote! {
                ::sqlx::query!(#sql, 1_i64, 1_i64, ::std::time::Duration::ZERO as _, ::core::option::Option::<&::core::primitive::str>::None)
                    .fetch_optional(pool)
                    .await?;
            };
            Definition { sql, checked }
        }
        Statement::Renew => {
            let sql = format!(
                "UPDATE {t} SET lease_until = statement_timestamp() + {lease} WHERE {OWNED} RETURNING lease_until"
            );
            let checked = quote!(::sqlx::query!(#sql, 1_i64, 1_i64).fetch_optional(pool).await?;);
            Definition { sql, checked }
        }
        Statement::Fail => {
            let sql = format!(
                "UPDATE {t} SET status = '{dead}', lease_until = NULL, last_error = $3 WHERE {OWNED}"
            );
            let sql = releasing(
                table,
                &sql,
                "",
                &["id"],
                dead_releases(table).then_some("true"),
            );
            let checked =
                quote!(::sqlx::query!(#sql, 1_i64, 1_i64, "reason").fetch_optional(pool).await?;);
            Definition { sql, checked }
        }
        Statement::CompleteBatch => {
            // The relay's common case, every row published: `Record`'s CASEs and three
            // more arrays cost ~15% of a batch's recording, measured. (Returning only the
            // rejected rows instead costs more: the anti-join outweighs the rows.)
            let body = match table.model.sent {
                Sent::Keep => format!(
                    "UPDATE {t} AS o SET status = '{sent}', lease_until = NULL, {SENT_AT}\n\
                     FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)\n\
                     WHERE {OWNED_EACH}"
                ),
                Sent::Delete => format!(
                    "DELETE FROM {t} AS o\n\
                     USING unnest($1::bigint[], $2::bigint[]) AS u(id, generation)\n\
                     WHERE {OWNED_EACH}"
                ),
            };
            let sql = releasing(table, &body, "o.", &["id"], Some("true"));
            let checked = quote!(::sqlx::query!(#sql, #ids, #ids).fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::Record => {
            let (o_sent, o_retry, o_dead, o_release) = (
                Outcome::Sent.as_sql(),
                Outcome::Retry.as_sql(),
                Outcome::Dead.as_sql(),
                Outcome::Release.as_sql(),
            );
            let outcomes = "unnest($1::bigint[], $2::bigint[], $3::text[], $4::interval[], $5::text[])\n\
                 \x20   AS u(id, generation, outcome, delay, error)";
            let update = |from: &str, only: &str| {
                format!(
                    "UPDATE {t} AS o SET\n\
                     \x20   status = CASE u.outcome\n\
                     \x20       WHEN '{o_sent}' THEN '{sent}'\n\
                     \x20       WHEN '{o_release}' THEN '{ready}'\n\
                     \x20       WHEN '{o_retry}' THEN CASE WHEN o.attempts >= {max} THEN '{dead}' ELSE '{ready}' END\n\
                     \x20       ELSE '{dead}' END,\n\
                     \x20   lease_until = NULL,\n\
                     \x20   attempts = CASE u.outcome WHEN '{o_release}' THEN o.attempts - 1 ELSE o.attempts END,\n\
                     \x20   next_attempt_at = CASE u.outcome\n\
                     \x20       WHEN '{o_retry}' THEN statement_timestamp() + u.delay\n\
                     \x20       WHEN '{o_release}' THEN statement_timestamp()\n\
                     \x20       WHEN '{o_sent}' THEN statement_timestamp()\n\
                     \x20       ELSE o.next_attempt_at END,\n\
                     \x20   last_error = CASE\n\
                     \x20       WHEN u.outcome = '{o_retry}' AND o.attempts >= {max}\n\
                     \x20           THEN 'attempt budget exhausted after ' || o.attempts || ' of {max} claims' || coalesce(': ' || u.error, '')\n\
                     \x20       WHEN u.outcome IN ('{o_retry}', '{o_dead}', '{o_release}') THEN coalesce(u.error, o.last_error)\n\
                     \x20       ELSE o.last_error END\n\
                     FROM {from}\n\
                     WHERE {only}{OWNED_EACH}"
                )
            };
            let released = if dead_releases(table) {
                format!("f.status IN ('{sent}', '{dead}')")
            } else {
                format!("f.status = '{sent}'")
            };
            let sql = match (table.model.sent, key_returning(table, "o.")) {
                (Sent::Keep, _) => releasing(
                    table,
                    &update(outcomes, ""),
                    "o.",
                    &["id", "status"],
                    Some(&released),
                ),
                // The published rows are deleted and the others updated, each by its
                // own statement of one: two data-modifying CTEs on disjoint rows.
                (Sent::Delete, key) => format!(
                    "WITH u AS (SELECT * FROM {outcomes}),\n\
                     sent AS (\n\
                     \x20   DELETE FROM {t} AS o USING u\n\
                     \x20   WHERE u.outcome = '{o_sent}' AND {OWNED_EACH}\n\
                     \x20   RETURNING o.id, '{sent}' AS status{key}),\n\
                     other AS (\n{}\nRETURNING o.id, o.status{key}){}\n\
                     SELECT id, status FROM sent UNION ALL SELECT id, status FROM other",
                    update("u", &format!("u.outcome <> '{o_sent}' AND ")),
                    if key.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ",\ndone AS (SELECT * FROM sent UNION ALL SELECT * FROM other){}",
                            wake(table, FINISHED, &released, Successor::SetAside)
                        )
                    }
                ),
            };
            let checked = quote! {
                ::sqlx::query!(#sql, #ids, #ids, #texts, #delays as _, #texts).fetch_all(pool).await?;
            };
            Definition { sql, checked }
        }
        Statement::RenewBatch => {
            let sql = format!(
                "UPDATE {t} AS o SET lease_until = statement_timestamp() + {lease}\n\
                 FROM unnest($1::bigint[], $2::bigint[]) AS u(id, generation)\n\
                 WHERE {OWNED_EACH}\n\
                 RETURNING o.id, o.lease_until"
            );
            let checked = quote!(::sqlx::query!(#sql, #ids, #ids).fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::RequeueDead => {
            let sql = format!(
                "UPDATE {t} {} WHERE status = '{dead}' AND event_id = ANY($1::text[]) RETURNING event_id",
                requeue()
            );
            let checked = quote!(::sqlx::query!(#sql, #texts).fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::RequeueAllDead => {
            let sql = format!(
                "WITH requeued AS (UPDATE {t} {} WHERE status = '{dead}' RETURNING 1)\n\
                 SELECT count(*) AS requeued FROM requeued",
                requeue()
            );
            let checked = quote!(::sqlx::query!(#sql).fetch_one(pool).await?;);
            Definition { sql, checked }
        }
        Statement::DiscardDead => {
            let sql =
                format!("DELETE FROM {t} WHERE status = '{dead}' AND event_id = ANY($1::text[])");
            // Where a `DEAD` event releases its key, nothing waits behind it: a wake
            // would only cut short the retry delay of the event after it.
            let released = (!dead_releases(table)).then_some("true");
            let sql = releasing_as(table, &sql, "", &["event_id"], released, Successor::Latest);
            let checked = quote!(::sqlx::query!(#sql, #texts).fetch_all(pool).await?;);
            Definition { sql, checked }
        }
        Statement::PruneSent => {
            let sql = format!(
                "WITH doomed AS (\n\
                 \x20   SELECT id FROM {t}\n\
                 \x20   WHERE status = '{sent}' AND next_attempt_at < statement_timestamp() - $1::interval\n\
                 \x20   ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)\n\
                 DELETE FROM {t} AS o USING doomed AS d WHERE o.id = d.id"
            );
            let checked = quote! {
                ::sqlx::query!(#sql, ::std::time::Duration::ZERO as _, 1_i64).execute(pool).await?;
            };
            Definition { sql, checked }
        }
        Statement::Stats => {
            // One sequential scan counts every row (the counts of SENT rows have no index
            // to come from); the oldest waiting event is the one with the lowest id in that
            // scan, then one primary-key probe reads when it was enqueued and its last
            // error. Ids follow the enqueue order (to within concurrent enqueues), and the
            // age is its `created_at`'s, not its `next_attempt_at`'s: every hand-back of
            // an outage makes an event due again, which would restart the age. (No index
            // has `created_at`; its min() in the scan as well as the id's measured a
            // sixth slower.) Measured with EXPLAIN ANALYZE on 1,000,000
            // SENT, 100,000 READY and 100 INPROGRESS rows (PostgreSQL 15, 2 busy cores):
            // a median of 357 ms with two parallel workers (609 ms without), as the
            // statement before this figure (348 ms, 707 ms) within the noise; the
            // probe 0.04 ms.
            // A scheduled table's event enqueued for later is not waiting for the relay
            // until its time: it is counted apart, and its lag counts from that time. So
            // the oldest waiting event is the one due first, not the lowest id (the id
            // of the least (due time, id) pair, in the same scan).
            let (scheduled, first_waiting, since) = if table.model.scheduled.is_some() {
                let p = PUBLISH_AT.name;
                let since = format!("greatest(created_at, {p}, {})", oldest());
                (
                    format!(
                        "count(*) FILTER (WHERE status = '{ready}' AND {p} > statement_timestamp())"
                    ),
                    format!(
                        "(min(ARRAY[extract(epoch FROM {since}), id]) FILTER (WHERE status IN ('{ready}', '{in_progress}') AND ({p} IS NULL OR {p} <= statement_timestamp())))[2]::bigint"
                    ),
                    since,
                )
            } else {
                (
                    "0::bigint".to_owned(),
                    format!("min(id) FILTER (WHERE status IN ('{ready}', '{in_progress}'))"),
                    format!("greatest(created_at, {})", oldest()),
                )
            };
            let sql = format!(
                "SELECT s.*, w.oldest_waiting_age, w.oldest_waiting_error\n\
                 FROM (SELECT\n\
                 \x20   count(*) FILTER (WHERE status = '{ready}') AS ready,\n\
                 \x20   count(*) FILTER (WHERE status = '{in_progress}') AS in_progress,\n\
                 \x20   count(*) FILTER (WHERE status = '{sent}') AS sent,\n\
                 \x20   count(*) FILTER (WHERE status = '{dead}') AS dead,\n\
                 \x20   count(*) FILTER (WHERE status = '{in_progress}' AND lease_until <= statement_timestamp()) AS expired_claims,\n\
                 \x20   {first_waiting} AS first_waiting,\n\
                 \x20   {held},\n\
                 \x20   {recent} AS sent_last_minute,\n\
                 \x20   count(*) FILTER (WHERE status = '{ready}' AND next_attempt_at <= statement_timestamp()) AS due,\n\
                 \x20   {scheduled} AS scheduled\n\
                 \x20   FROM {t}) AS s\n\
                 LEFT JOIN LATERAL (SELECT\n\
                 \x20   statement_timestamp() - {since} AS oldest_waiting_age,\n\
                 \x20   last_error AS oldest_waiting_error\n\
                 \x20   FROM {t} WHERE id = s.first_waiting) AS w ON true",
                held = held_keys(table.model),
                recent = match table.model.sent {
                    Sent::Keep => format!(
                        "count(*) FILTER (WHERE status = '{sent}' AND next_attempt_at > statement_timestamp() - interval '1 minute')"
                    ),
                    // A sent row is gone: nothing in the table says when.
                    Sent::Delete => "NULL::bigint".to_owned(),
                }
            );
            let checked = quote!(::sqlx::query!(#sql).fetch_one(pool).await?;);
            Definition { sql, checked }
        }
    }
}

/// The stats' two columns of held keys: how many keys a `DEAD` event holds back, and the age
/// of the oldest such event (zero and NULL where no key can be held).
fn held_keys(model: &Model) -> String {
    let (held, age) = ("held_keys", "oldest_held_age");
    match model.key() {
        Some(key) if model.dead == Dead::HoldsKey => {
            let (k, dead, oldest) = (quoted(&key.column), Status::Dead.as_sql(), oldest());
            format!(
                "count(DISTINCT {k}) FILTER (WHERE status = '{dead}') AS {held},\n\
                 \x20   statement_timestamp() - min(greatest(created_at, {oldest})) FILTER (WHERE status = '{dead}' AND {k} IS NOT NULL) AS {age}"
            )
        }
        _ => format!("0::bigint AS {held}, NULL::interval AS {age}"),
    }
}

/// Whether a `DEAD` event lets the later events of its key go (`dead_releases_key`).
fn dead_releases(table: &Table<'_>) -> bool {
    table.model.key().is_some() && table.model.dead == Dead::ReleasesKey
}

/// The finished row's id and key, as [`key_returning`] names them, for [`wake`].
const FINISHED: (&str, &str) = ("f.outbox_id", "f.outbox_key");

/// The extra columns a finishing statement returns on a keyed table, for [`wake`]: the
/// row id and its key, as `outbox_id` and `outbox_key` ([`FINISHED`]).
fn key_returning(table: &Table<'_>, prefix: &str) -> String {
    table.model.key().map_or_else(String::new, |key| {
        format!(
            ", {prefix}id AS outbox_id, {prefix}{} AS outbox_key",
            quoted(&key.column)
        )
    })
}

/// `body`, an `UPDATE` or `DELETE` of the rows an outcome finishes, returning the
/// `returning` columns (of the row named with `prefix`). On a table with an ordering
/// key, the rows for which `released` holds (a condition on the returned row `f`; `None`
/// when no row of this statement can release its key) also wake the next event of
/// their key ([`wake`]).
fn releasing(
    table: &Table<'_>,
    body: &str,
    prefix: &str,
    returning: &[&str],
    released: Option<&str>,
) -> String {
    releasing_as(
        table,
        body,
        prefix,
        returning,
        released,
        Successor::SetAside,
    )
}

/// [`releasing`], waking the successors that `successor` says.
fn releasing_as(
    table: &Table<'_>,
    body: &str,
    prefix: &str,
    returning: &[&str],
    released: Option<&str>,
    successor: Successor,
) -> String {
    let columns = |prefix: &str| {
        returning
            .iter()
            .map(|c| format!("{prefix}{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match released {
        Some(released) if table.model.key().is_some() => format!(
            "WITH done AS (\n{body}\n    RETURNING {}{}){}\nSELECT {} FROM done",
            columns(prefix),
            key_returning(table, prefix),
            wake(table, FINISHED, released, successor),
            columns("")
        ),
        _ => {
            let line = if body.contains('\n') { "\n" } else { " " };
            format!("{body}{line}RETURNING {}", columns(prefix))
        }
    }
}

/// Which successors of the finished events [`wake`] makes due.
#[derive(Clone, Copy)]
enum Successor {
    /// Those the statement's snapshot sees set aside: where every setting aside the
    /// finished events could have caused committed before the statement began.
    SetAside,
    /// Each `READY` successor, as its latest version says, whatever the snapshot saw:
    /// for `DEAD` events, which a claim may be setting aside behind right now.
    Latest,
}

/// The `woken` CTE of a statement whose `done` CTE returns finished rows `f`, with
/// their id and key as `finished` names them: for each row for which `released` holds,
/// the next event of its key, if a claim set it aside ([`parking`]), is due again now.
///
/// The next event is the first entry after the finished one in the key's index, found
/// with a row comparison on `(key, id)`: an order only that index has. (With `key =
/// $1 AND id > $2 ORDER BY id` the planner may walk the primary key from the finished
/// event onwards instead, to the end of the table when it was its key's last event.)
/// A second row comparison, up to the largest id, keeps the walk within the key: where
/// the finished event was its key's last, the scan ends in the index, without fetching
/// the next key's first row. (The key's equality would do the same, and let the planner
/// walk the primary key again: measured, a 2,000-event table of 10 keys took 6 times
/// longer to record.)
///
/// [`Successor::SetAside`]: the events to wake are found first (only those set aside:
/// `READY` and not yet due), then updated by their ids (`status || ''` keeps the planner
/// off the `READY` index, whose statistics rarely know of the events set aside, as
/// [`OWNED`] keeps it off the `INPROGRESS` one). Filtering before the update matters:
/// most finished events have no successor set aside, and looking each one up again by
/// id cost 8% of a keyed batch's recording, measured. This statement's snapshot sees
/// every such setting aside when the finished events were claimed: a claim sets an
/// event aside only while it holds a share lock on the event before it, and only while
/// that event is `READY` or `DEAD`, so before finishing here it was claimed, by a claim
/// that had to wait for that lock (or skip the row) and so began after the setting
/// aside committed.
///
/// [`Successor::Latest`]: a `DEAD` event that is deleted was never claimed since it
/// died, and a claim may set its successor aside after this statement's snapshot was
/// taken (the delete waits for the claim's share lock, then goes on with the snapshot
/// it had). So every successor is updated, by id, to be due no later than now: an
/// update reads the latest version of a row that changed after its snapshot, waiting
/// for a claim that holds it, where a plain read sees what the snapshot saw. A claim
/// that comes after the update cannot set the successor aside: the event before it is
/// locked, then gone.
fn wake(table: &Table<'_>, finished: (&str, &str), released: &str, successor: Successor) -> String {
    let Some(key) = table.model.key() else {
        return String::new();
    };
    let (id, key_of) = finished;
    let (t, k) = (&table.name, quoted(&key.column));
    let (ready, sent) = (Status::Ready.as_sql(), Status::Sent.as_sql());
    let (set_aside, due, recheck) = match successor {
        Successor::SetAside => (
            format!(" AND q.status = '{ready}' AND q.next_attempt_at > statement_timestamp()"),
            "statement_timestamp()",
            " AND w.next_attempt_at > statement_timestamp()",
        ),
        Successor::Latest => (
            String::new(),
            "least(w.next_attempt_at, statement_timestamp())",
            "",
        ),
    };
    // A scheduled successor is not due before its time, whatever held it.
    let due = if table.model.scheduled.is_some() {
        format!("greatest({due}, w.{})", PUBLISH_AT.name)
    } else {
        due.to_owned()
    };
    let finished = match successor {
        // Of a key's events finished here, only the last can have a successor set
        // aside: the successors of the ones before it are in flight (a batch's runs
        // are contiguous). One probe per key, where a run of 100 made 100.
        Successor::SetAside => format!(
            "(SELECT DISTINCT ON ({key_of}) * FROM done AS f WHERE {released} ORDER BY {key_of}, {id} DESC)"
        ),
        Successor::Latest => "done".to_owned(),
    };
    format!(
        ",\nnext AS (\n\
         \x20   SELECT q.id FROM {finished} AS f CROSS JOIN LATERAL (\n\
         \x20       SELECT q.id, q.status, q.next_attempt_at FROM {t} AS q\n\
         \x20       WHERE (q.{k}, q.id) > ({key_of}, {id})\n\
         \x20           AND (q.{k}, q.id) <= ({key_of}, {last}) AND q.status <> '{sent}'{}\n\
         \x20       ORDER BY q.{k}, q.id LIMIT 1) AS q\n\
         \x20   WHERE {released}{set_aside}\n\
         ), woken AS (\n\
         \x20   UPDATE {t} AS w SET next_attempt_at = {due}\n\
         \x20   WHERE w.id = ANY(ARRAY(SELECT id FROM next))\n\
         \x20       AND w.status || '' = '{ready}'{recheck})",
        blocking(table, "q"),
        last = i64::MAX,
    )
}

/// For a keyed table whose `DEAD` events release their key, the condition that excludes
/// them from the events before another (`alias.status <> 'DEAD'`); empty otherwise.
fn blocking(table: &Table<'_>, alias: &str) -> String {
    if dead_releases(table) {
        format!(" AND {alias}.status <> '{}'", Status::Dead.as_sql())
    } else {
        String::new()
    }
}

/// A requeued event gets a fresh attempt budget; its generation keeps counting, so a
/// claim from before it died can still never record an outcome.
fn requeue() -> String {
    format!(
        "SET status = '{}', attempts = 0, next_attempt_at = statement_timestamp()",
        Status::Ready.as_sql()
    )
}

fn insert_columns(table: &Table<'_>) -> String {
    std::iter::once("event_id")
        .chain(table.payload.iter().map(String::as_str))
        .chain(extras(table, 0).into_iter().map(|(column, _)| column))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The columns a table's flags add to an enqueue, and their values, from the parameters
/// after the `columns` before them (the event id and the payload):
/// - `scheduled`: a time (`timestamptz`) and a delay (`interval`), either or both NULL.
///   Due at the latest of now, the time and now plus the delay (`greatest` skips NULLs):
///   a time in the past means now, and the delay counts on the database's clock.
///   `publish_at` is that time when it is later than now, NULL otherwise.
/// - `traced`: the W3C `traceparent`, `tracestate` and `baggage` (`text`, NULL without a
///   trace).
fn extras(table: &Table<'_>, columns: usize) -> Vec<(&'static str, String)> {
    let mut param = columns;
    let mut next = || {
        param += 1;
        param
    };
    let mut extras = Vec::new();
    if table.model.scheduled.is_some() {
        let due = format!(
            "greatest(statement_timestamp(), ${}::timestamptz, statement_timestamp() + ${}::interval)",
            next(),
            next()
        );
        extras.push((
            PUBLISH_AT.name,
            format!("nullif({due}, statement_timestamp())"),
        ));
        extras.push(("next_attempt_at", due));
    }
    if table.model.traced.is_some() {
        for column in &TRACED {
            extras.push((column.name, format!("${}::text", next())));
        }
    }
    extras
}

/// The values of [`extras`], joined.
fn extra_values(table: &Table<'_>, columns: usize) -> Option<String> {
    let values: Vec<String> = extras(table, columns)
        .into_iter()
        .map(|(_, value)| value)
        .collect();
    (!values.is_empty()).then(|| values.join(", "))
}

/// The rows of a many-event insert: the arrays, unnested, and the values the table's
/// flags add after them.
fn insert_rows(table: &Table<'_>) -> String {
    let columns = table.model.fields.len() + 1;
    match extra_values(table, columns) {
        Some(values) => format!("SELECT *, {values} FROM unnest({})", insert_arrays(table)),
        None => format!("SELECT * FROM unnest({})", insert_arrays(table)),
    }
}

/// One array parameter per column, so the text stays the same whatever the number of
/// events.
fn insert_arrays(table: &Table<'_>) -> String {
    std::iter::once("text")
        .chain(table.model.fields.iter().map(|f| f.sql_type.ddl))
        .enumerate()
        .map(|(i, ty)| format!("${}::{ty}[]", i + 1))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The notification of the inserts: sent when the enqueuing transaction commits, waking
/// an idle relay at once; identical notifications of one transaction are merged, and
/// none is sent when nothing was written.
fn notify(table: &Table<'_>) -> String {
    format!(
        "(SELECT pg_notify('{}', '') FROM enqueued LIMIT 1) AS notified",
        table.model.table
    )
}

/// The claim of up to `limit` rows.
///
/// The candidates: each eligibility path reads its own partial index in its own order
/// and locks with SKIP LOCKED (a locking clause cannot sit on a UNION), so claim cost
/// stays flat however many SENT, DEAD or expired rows pile up. Expired claims come
/// first (their publishers are gone: the oldest work), due READY rows fill the rest:
/// every row locked is a row claimed, where two branches of `limit` each would lock up
/// to twice the batch and hold the surplus until commit.
///
/// On a keyed table, with `runs` (the relay's claims), the events after each head in
/// its key come with it ([`runs`]); without, one event per key (a claim made by hand).
///
/// The limit is written into the text, not bound: PostgreSQL plans a statement with a
/// `LIMIT $1` again on every execution (its generic plan never looks cheap enough),
/// which cost a third of a 100-row claim; without parameters it is planned once per
/// connection. (The relay's keyed claims bind the runs it has in flight, and run with
/// generic plans.)
fn claim(table: &Table<'_>, limit: &str, runs: bool) -> String {
    let t = &table.name;
    let (ready, in_progress) = (Status::Ready.as_sql(), Status::InProgress.as_sql());
    let (c, in_turn) = (candidate(table), in_turn(table));
    let (head, reached, steps, parking) = match table.model.key() {
        Some(key) => {
            let head = head_columns(key);
            let steps = runs.then(|| {
                RunSteps::after(
                    table,
                    &format!("SELECT * FROM expired UNION ALL SELECT id, ctid{head} FROM ready"),
                    &format!(
                        "{limit} - (SELECT count(*) FROM expired) - (SELECT count(*) FROM ready)"
                    ),
                    1,
                )
            });
            let parking = parking(table, limit, steps.is_some());
            (head, ", next_attempt_at, id", steps, parking)
        }
        None => (String::new(), "", None, String::new()),
    };
    let (ctes, claimed, reclaimed) = steps.as_ref().map_or_else(Default::default, |steps| {
        (
            steps.ctes.as_str(),
            format!(" UNION ALL {}", RunSteps::CLAIMED),
            format!(" UNION ALL {}", RunSteps::RECLAIMED),
        )
    });
    format!(
        "WITH expired AS (\n\
         \x20   SELECT id, ctid{head} FROM {t}{c}\n\
         \x20   WHERE status = '{in_progress}' AND lease_until <= statement_timestamp(){in_turn}\n\
         \x20   ORDER BY lease_until, id LIMIT {limit} FOR UPDATE SKIP LOCKED\n\
         ), ready AS (\n\
         \x20   SELECT ctid{reached}{head} FROM {t}{c}\n\
         \x20   WHERE status = '{ready}' AND next_attempt_at <= statement_timestamp(){in_turn}\n\
         \x20   ORDER BY next_attempt_at, id LIMIT {limit} - (SELECT count(*) FROM expired) FOR UPDATE SKIP LOCKED\n\
         ){ctes}{parking}{}",
        take(
            table,
            &format!("SELECT ctid FROM expired UNION ALL SELECT ctid FROM ready{claimed}"),
            &format!("o.id = ANY(ARRAY(SELECT id FROM expired{reclaimed}))"),
            steps
                .is_some()
                .then_some("(SELECT least(at, statement_timestamp()) FROM reach)"),
        )
    )
}

/// What a keyed claim's heads select besides their `id` and `ctid`, for [`runs`]: the
/// key and the attempts made.
fn head_columns(key: &crate::fields::Field) -> String {
    format!(", {}, attempts", quoted(&key.column))
}

/// A keyed claim's steps after its heads, in the relay's claims: the runs that continue
/// the claimer's runs in flight (`continued`), and the runs of each head (`run_*`).
struct RunSteps {
    ctes: String,
}

impl RunSteps {
    /// The rows the steps claim (their `ctid`s).
    const CLAIMED: &str = "SELECT ctid FROM continued UNION ALL SELECT ctid FROM run_members";

    /// Those of them that were expired claims (their ids).
    const RECLAIMED: &str =
        "SELECT id FROM continued WHERE expired UNION ALL SELECT id FROM run_members WHERE expired";

    /// The steps after `heads` (a query of `id, ctid, key, attempts`: the first event
    /// still to go of each key, claimed by this statement), which left `room` rows of
    /// the batch; the claimer's runs in flight are bound from parameter `$tails` on
    /// ([`continued`]), and the most events of a key a run may have in the parameter
    /// after them (`bigint`, at least 1).
    fn after(table: &Table<'_>, heads: &str, room: &str, tails: usize) -> Self {
        let continued = continued(table, room, tails);
        let heads = format!(
            "{heads} UNION ALL SELECT id, ctid{} FROM continued",
            table.model.key().map_or_else(String::new, head_columns)
        );
        let room = format!("{room} - (SELECT count(*) FROM continued)");
        let length = format!("${}::bigint", tails + 2);
        Self {
            ctes: format!("{continued}{}", runs(table, &heads, &room, &length)),
        }
    }
}

/// For a keyed table, whether an event `q` may go right after the event before it in
/// its key, in the same claim: not one scheduled for later, nor one waiting out a
/// retry's delay (attempted before and not yet due: an event never attempted whose time
/// is in the future was set aside by [`parking`], and may go), nor one in flight under
/// a live lease, nor one that would move to `DEAD` on this claim (its budget spent), nor
/// a `DEAD` one. An expired claim may follow: it is reclaimed with the events before it.
fn may_follow(table: &Table<'_>, q: &str) -> String {
    let max = table.model.max_attempts;
    let (ready, in_progress) = (Status::Ready.as_sql(), Status::InProgress.as_sql());
    let scheduled = if table.model.scheduled.is_some() {
        let p = PUBLISH_AT.name;
        format!(" AND ({q}.{p} IS NULL OR {q}.{p} <= statement_timestamp())")
    } else {
        String::new()
    };
    format!(
        "{q}.attempts < {max} AND (\n\
         \x20               {q}.status = '{ready}' AND ({q}.next_attempt_at <= statement_timestamp() OR {q}.attempts = 0){scheduled}\n\
         \x20               OR {q}.status = '{in_progress}' AND {q}.lease_until <= statement_timestamp())"
    )
}

/// The columns [`may_follow`] reads, selected from `q`.
fn follow_columns(table: &Table<'_>, q: &str) -> String {
    let publish_at = if table.model.scheduled.is_some() {
        format!(", {q}.{}", PUBLISH_AT.name)
    } else {
        String::new()
    };
    format!(
        "{q}.ctid, {q}.id, {q}.status, {q}.attempts, {q}.next_attempt_at, {q}.lease_until{publish_at}"
    )
}

/// For a keyed table, the relay's claim's `continued` CTE: after each tail bound in
/// `$tails` (ids) and `$tails + 1` (generations), both `bigint[]`, the event right after
/// it in its key, if it may follow ([`may_follow`]), is a head of this claim, up to
/// `room` of them. A tail is either
/// - the last event of a run the claimer has in flight, still its own (in flight in that
///   generation, its lease live): the claimer publishes its successor after that run,
///   and only if the run was published whole (else hands it back). So a hot key's events
///   go out batch after batch from one relay worker, where each batch would otherwise
///   wait for the one before to be recorded, and the claim that follows;
/// - or the last event of a key recorded `SENT` in that generation (by the claimer, in
///   this transaction or before): its successor goes at once. So a key goes on from
///   a run just recorded, or is handed from one worker to another, without a scan of
///   the `READY` index to find its next event.
///
/// The next event is found as [`wake`] finds it, whatever its place in the `READY`
/// index: a key's backlog is set aside ([`parking`]) while an event before it waits.
/// The candidates are found in the statement's snapshot, then locked by their `ctid`,
/// skipping any another transaction holds or changed since.
fn continued(table: &Table<'_>, room: &str, tails: usize) -> String {
    let Some(key) = table.model.key() else {
        return String::new();
    };
    let (t, k) = (&table.name, quoted(&key.column));
    let (in_progress, sent) = (Status::InProgress.as_sql(), Status::Sent.as_sql());
    format!(
        ", continued AS (\n\
         \x20   SELECT id, ctid, {k}, attempts, status = '{in_progress}' AS expired FROM {t}\n\
         \x20   WHERE ctid = ANY(ARRAY(\n\
         \x20       SELECT n.ctid FROM unnest(${tails}::bigint[], ${generations}::bigint[]) AS tail(id, generation)\n\
         \x20       JOIN {t} AS p ON p.id = tail.id AND p.generation = tail.generation\n\
         \x20           AND (p.status || '' = '{in_progress}' AND p.lease_until > statement_timestamp()\n\
         \x20               OR p.status || '' = '{sent}')\n\
         \x20       CROSS JOIN LATERAL (\n\
         \x20           SELECT {} FROM {t} AS n\n\
         \x20           WHERE (n.{k}, n.id) > (p.{k}, p.id)\n\
         \x20               AND (n.{k}, n.id) <= (p.{k}, {last}) AND n.status <> '{sent}'{blocking}\n\
         \x20           ORDER BY n.{k}, n.id LIMIT 1) AS n\n\
         \x20       WHERE {}\n\
         \x20       ORDER BY p.id LIMIT {room}))\n\
         \x20   FOR UPDATE SKIP LOCKED\n\
         )",
        follow_columns(table, "n"),
        may_follow(table, "n"),
        generations = tails + 1,
        blocking = blocking(table, "n"),
        last = i64::MAX,
    )
}

/// For a keyed table, the claim's runs: after the `heads` (a query of `id, ctid, key,
/// attempts`: the first event still to go of each key, claimed by this statement), the
/// events that follow each in its key, claimed with it so that one claim carries a
/// key's events in order, up to `room` more rows (the batch's rest), and up to
/// `length` events of a key, its head included.
///
/// A run is the events after its head, in id order, up to the first that may not go
/// now ([`may_follow`]), or one `DEAD` where that holds the key, and at most `length`
/// events long. An expired claim may follow in a run: the run is then reclaimed as a
/// whole, in order.
///
/// Keys share the batch: every head first (the `ready` scan), then the runs by depth
/// (each key's first follower, then each key's second, ..), so one hot key takes only
/// the room its peers leave. The candidates are found in the statement's snapshot, then
/// locked, skipping any another transaction holds or changed since; a run ends before
/// the first that was not locked, so it stays contiguous.
fn runs(table: &Table<'_>, heads: &str, room: &str, length: &str) -> String {
    let Some(key) = table.model.key() else {
        return String::new();
    };
    let (t, k, max) = (&table.name, quoted(&key.column), table.model.max_attempts);
    let (in_progress, sent) = (Status::InProgress.as_sql(), Status::Sent.as_sql());
    format!(
        ", run_candidates AS (\n\
         \x20   SELECT ctid, id, head, expired FROM (\n\
         \x20       SELECT q.ctid, q.id, h.id AS head, q.status = '{in_progress}' AS expired,\n\
         \x20           row_number() OVER (PARTITION BY h.id ORDER BY q.id) AS depth,\n\
         \x20           bool_and({}) OVER (PARTITION BY h.id ORDER BY q.id) AS in_run\n\
         \x20       FROM ({heads}) AS h CROSS JOIN LATERAL (\n\
         \x20           SELECT {} FROM {t} AS q\n\
         \x20           WHERE (q.{k}, q.id) > (h.{k}, h.id)\n\
         \x20               AND (q.{k}, q.id) <= (h.{k}, {last}) AND q.status <> '{sent}'{blocking}\n\
         \x20           ORDER BY q.{k}, q.id LIMIT least({room}, {length} - 1)) AS q\n\
         \x20       WHERE h.attempts < {max}) AS q\n\
         \x20   WHERE in_run AND depth < {length}\n\
         \x20   ORDER BY depth, id LIMIT {room}\n\
         ), run_locked AS (\n\
         \x20   SELECT ctid FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM run_candidates))\n\
         \x20   FOR UPDATE SKIP LOCKED\n\
         ), run_members AS (\n\
         \x20   SELECT c.ctid, c.id, c.expired FROM run_candidates AS c\n\
         \x20   WHERE NOT EXISTS (SELECT FROM run_candidates AS m\n\
         \x20       WHERE m.head = c.head AND m.id <= c.id\n\
         \x20           AND m.ctid <> ALL(ARRAY(SELECT ctid FROM run_locked)))\n\
         )",
        may_follow(table, "q"),
        follow_columns(table, "q"),
        blocking = blocking(table, "q"),
        last = i64::MAX,
    )
}

/// For a keyed table, the claim's `parked` CTE: the due events its `ready` scan stepped
/// over because an event before them waits (`READY`, not claimed by this statement nor
/// being claimed by another, or `DEAD` where that holds the key) are set aside, due again
/// after the lease or their age, whichever is longer, so that later claims do not step
/// over them again: a hot key's backlog, or the events behind a retry's delay or a
/// `DEAD` event, would otherwise be walked by every claim. An event right behind one in
/// flight is left where it is: it is released within moments, and there is at most one
/// per key in flight. (While an event of a key is in flight, none before it waits: so an
/// event with a waiting event anywhere before it is at least two behind.)
///
/// Every waiting event locked notifies the table's channel (once per transaction:
/// PostgreSQL folds identical notifications), whether or not the event behind it is then
/// set aside (another claim may lock that one first). While this claim held the waiting
/// events locked, a claim that came for them skipped them and may have gone idle, finding
/// nothing else: the notification, sent when this claim commits, brings a worker back for
/// them. (Without it, a relay of 10 hot keys stalled for its poll interval in half its
/// runs. The notification is in the candidates' own select list, evaluated for each
/// candidate that passed the locking `EXISTS`, before the candidate itself is locked.)
///
/// The waiting event is share-locked, skipping one that is locked: while this claim has
/// not committed, it cannot be claimed, and no event after it before it is finished, so
/// every event between it and the one set aside is claimed, and finished, by statements
/// that see the setting aside; the one that finishes the last of them wakes its
/// successor ([`wake`]). The age term spaces out the rechecks of events held
/// back for long (behind a `DEAD` event): each recheck that finds them still held back
/// doubles their age, so they are rechecked a logarithmic number of times.
///
/// In the relay's claims (`runs`), the events of a key this claim takes are left where
/// they are if they are older than the relay's frontier margin
/// ([`outbox_internals::FRONTIER_MARGIN`]): the claimer continues its run with them,
/// batch after batch, and the relay's frontier moves past them at once (claims of a
/// keyed table move on from what they stepped over, and a relay that records a key's
/// last event taken looks behind its frontier again). Set aside, a hot key's backlog
/// costs one more write per event: the relay's first claim beside 100,000 events of one
/// key took about 3 s setting them aside, and takes 0.6 s stepping over them. Those
/// within the margin are set aside all the same: the frontier stays behind them for
/// that long, and every claim meanwhile (a run's worker claims every few milliseconds)
/// would step over them again.
///
/// Only the range the `ready` scan walked is looked at, by `(next_attempt_at, id)` (one
/// batch enqueued in one statement shares its `next_attempt_at`): up to its last row,
/// every due row when it found fewer than it looked for, and none when expired claims
/// filled the batch and it looked for nothing. The rows it claimed are passed over
/// before any lookup.
fn parking(table: &Table<'_>, limit: &str, runs: bool) -> String {
    let Some(key) = table.model.key() else {
        return String::new();
    };
    let (t, k, lease) = (&table.name, quoted(&key.column), &table.lease);
    let (ready, dead, sent) = (
        Status::Ready.as_sql(),
        Status::Dead.as_sql(),
        Status::Sent.as_sql(),
    );
    let before = before_in_key(&k, "p", "c");
    let waiting = if dead_releases(table) {
        format!("'{ready}'")
    } else {
        format!("'{ready}', '{dead}'")
    };
    format!(
        ", reach AS (\n\
         \x20   SELECT at, id FROM (\n\
         \x20       SELECT next_attempt_at AS at, id, 0 AS last FROM ready\n\
         \x20       WHERE (SELECT count(*) FROM ready) = {limit} - (SELECT count(*) FROM expired)\n\
         \x20       UNION ALL SELECT timestamptz 'infinity', 0, 1\n\
         \x20       WHERE (SELECT count(*) FROM expired) < {limit}) AS walked\n\
         \x20   ORDER BY last, at DESC, id DESC LIMIT 1\n\
         ), parked AS (\n\
         \x20   UPDATE {t} AS w\n\
         \x20   SET next_attempt_at = statement_timestamp() + greatest({lease}, statement_timestamp() - w.created_at)\n\
         \x20   WHERE w.ctid = ANY(ARRAY(SELECT ctid FROM (\n\
         \x20       SELECT c.ctid, pg_notify('{channel}', '') FROM {t} AS c\n\
         \x20       WHERE c.status = '{ready}' AND c.next_attempt_at <= statement_timestamp()\n\
         \x20           AND (c.next_attempt_at, c.id) <= ((SELECT at FROM reach), (SELECT id FROM reach))\n\
         \x20           AND c.ctid <> ALL(ARRAY(SELECT ctid FROM ready{claimed})){running}\n\
         \x20           AND EXISTS (SELECT FROM {t} AS p\n\
         \x20               WHERE {before} AND p.status <> '{sent}' AND p.status IN ({waiting})\n\
         \x20                   AND p.ctid <> ALL(ARRAY(SELECT ctid FROM ready{claimed}))\n\
         \x20               ORDER BY p.{k} DESC, p.id DESC LIMIT 1 FOR SHARE SKIP LOCKED)\n\
         \x20       ORDER BY c.next_attempt_at, c.id FOR UPDATE OF c SKIP LOCKED) AS waiting)))",
        channel = table.model.table,
        claimed = if runs {
            format!(" UNION ALL {}", RunSteps::CLAIMED)
        } else {
            String::new()
        },
        running = if runs {
            format!(
                "\n\x20           AND (c.next_attempt_at > statement_timestamp() - {margin}\n\
                 \x20               OR c.{k} <> ALL(ARRAY(SELECT {k} FROM expired \
                 UNION ALL SELECT {k} FROM ready UNION ALL SELECT {k} FROM continued)))",
                margin = interval(outbox_internals::FRONTIER_MARGIN),
            )
        } else {
            String::new()
        },
    )
}

/// The claim's name for a candidate row, which [`in_turn`] refers to.
fn candidate(table: &Table<'_>) -> &'static str {
    if table.model.key().is_some() {
        " AS c"
    } else {
        ""
    }
}

/// For a table with an ordering key, the claim's condition on a candidate `c`: no
/// earlier event of its key is still to be published. Earlier events that are `READY`
/// (a retry waiting out its delay, or simply due first) or `INPROGRESS` (live, or
/// expired and to be reclaimed first) hold it back; `DEAD` ones too, unless the type
/// says `dead_releases_key`. A candidate is checked against the claim's snapshot, which
/// sees every earlier event of its key that committed before the claim began: one probe
/// of the key's index ([`before_in_key`]), no extra round trip. Two events of one key
/// are never both in turn, since the later one always sees the earlier one still to go:
/// the events after a key's first come only in its run ([`runs`]). A NULL key (an event
/// enqueued before the key existed) equals nothing: never held back.
fn in_turn(table: &Table<'_>) -> String {
    let Some(key) = table.model.key() else {
        return String::new();
    };
    let (t, k, sent) = (&table.name, quoted(&key.column), Status::Sent.as_sql());
    let dead = blocking(table, "p");
    format!(
        "\n\x20       AND (SELECT p.id FROM {t} AS p\n\
         \x20           WHERE {before} AND p.status <> '{sent}'{dead}\n\
         \x20           ORDER BY p.{k} DESC, p.id DESC LIMIT 1) IS NULL",
        before = before_in_key(&k, "p", "c"),
    )
}

/// The events of `of`'s key before it, as `alias`: a range of the key's index, by row
/// comparisons on `(key, id)`, which only that index orders. A probe written so is one
/// short scan of the index, whatever the planner believes of the key's values. (With
/// `p.key = c.key AND p.id < c.id`, after an `ANALYZE` that saw one hot key, the
/// planner hashed the whole table for every claim and compared each candidate with
/// every event of its key: 128 s for a claim beside 20,000 events of one key, where
/// this probe took 1.6 s, and every claim after the first far less.)
fn before_in_key(k: &str, alias: &str, of: &str) -> String {
    format!(
        "({alias}.{k}, {alias}.id) < ({of}.{k}, {of}.id) AND ({alias}.{k}, {alias}.id) >= ({of}.{k}, {first})",
        first = i64::MIN,
    )
}

/// [`claim`]'s `READY` path alone, from `$1` on: what a relay claims between its full
/// claims.
///
/// While a transaction holds the xmin horizon back, vacuum can remove nothing, and the
/// `READY` index keeps an entry for every version of every row that was ever due: a
/// claim from the start of the index steps over every claimed row's old entry (after
/// ten minutes at 1,000 events/s, most of a 200 ms claim). A relay's claims move
/// forward through that index, so the relay starts each claim where its earlier claims
/// left off, and leaves what lies before it (commits that arrived late, the expired
/// claims) to a full claim now and then.
fn claim_from(table: &Table<'_>, limit: &str) -> String {
    let t = &table.name;
    let ready = Status::Ready.as_sql();
    let (c, in_turn) = (candidate(table), in_turn(table));
    let (columns, steps, claimed, reclaimed) = match table.model.key() {
        // The run steps read the heads as `id, ctid, key, attempts`; the reach, the last
        // row's `next_attempt_at`.
        Some(key) => (
            format!("id, ctid{}, next_attempt_at", head_columns(key)),
            RunSteps::after(
                table,
                &format!("SELECT id, ctid{} FROM ready", head_columns(key)),
                &format!("{limit} - (SELECT count(*) FROM ready)"),
                2,
            )
            .ctes,
            format!(" UNION ALL {}", RunSteps::CLAIMED),
            format!("o.id = ANY(ARRAY({}))", RunSteps::RECLAIMED),
        ),
        None => (
            "ctid".to_owned(),
            String::new(),
            String::new(),
            "false".to_owned(),
        ),
    };
    format!(
        "WITH ready AS (\n\
         \x20   SELECT {columns} FROM {t}{c}\n\
         \x20   WHERE status = '{ready}'\n\
         \x20       AND next_attempt_at >= timestamptz 'epoch' + $1::bigint * interval '1 microsecond'\n\
         \x20       AND next_attempt_at <= statement_timestamp(){in_turn}\n\
         \x20   ORDER BY next_attempt_at, id LIMIT {limit} FOR UPDATE SKIP LOCKED\n\
         ){steps}{}",
        take(
            table,
            &format!("SELECT ctid FROM ready{claimed}"),
            &reclaimed,
            table
                .model
                .key()
                .map(|_| {
                    format!(
                        "(SELECT CASE WHEN count(*) < {limit} THEN statement_timestamp() \
                         ELSE max(next_attempt_at) END FROM ready)"
                    )
                })
                .as_deref(),
        )
    )
}

/// The claim of the `candidates` (a query of `ctid`s), returning the claim header, with
/// `reclaimed` as its last column, the payload, the key and, in the relay's claims of a
/// keyed table, `reach` (an expression of the statement's `READY` scan: how far it saw
/// every due row, [`claim_header::REACH_NAME`]).
///
/// The claim: generation + 1 and a fresh lease. An expired claim that used the whole
/// attempt budget (or a row due again after the budget was lowered) is moved to DEAD
/// instead (its lease_until comes back NULL), with a `last_error` that says which.
///
/// The candidates are found again by their `ctid`s as one array, a TID scan of their
/// pages, not by a join: planned on a table it thinks small, PostgreSQL hash-joins them
/// against a sequential scan of the whole table, and the claim's cached plan keeps
/// doing so as the table grows (measured: 10 ms instead of 1.5 ms beside 10,000 rows).
/// The rows are locked, so their `ctid`s hold until the update. (A row that another
/// transaction updated after this statement's snapshot yet left due would be locked
/// and left unclaimed, where a join on `id` would claim it; none of ours does that.)
///
/// The text ends the claim's `WITH` list: the update itself or, on a keyed table whose
/// `DEAD` events release their key, a `done` CTE with the update, the [`wake`] of the
/// events after the rows it moved to `DEAD` (set aside while such a row still waited,
/// before the claim that let its lease expire), and the select of the claim's columns.
/// (A `READY` row moved to `DEAD` because its budget was lowered can race: a sweep that
/// sets its successor aside and commits after this claim's snapshot goes unseen, and the
/// successor waits out the lease or its age. Rare, and only after a budget change.)
fn take(table: &Table<'_>, candidates: &str, reclaimed: &str, reach: Option<&str>) -> String {
    let (t, max, lease) = (&table.name, table.model.max_attempts, &table.lease);
    let (in_progress, dead) = (Status::InProgress.as_sql(), Status::Dead.as_sql());
    let returning = claim_header::COLUMNS
        .iter()
        .map(|c| (*c).to_owned())
        .chain(std::iter::once(format!(
            "{reclaimed} AS {}",
            claim_header::RECLAIMED_NAME
        )))
        .chain(table.payload.iter().map(|c| format!("o.{c}")))
        .chain(table.model.key().map(|key| {
            format!(
                "o.{}::text AS {}",
                quoted(&key.column),
                claim_header::KEY_NAME
            )
        }))
        .chain(reach.map(|reach| format!("{reach} AS {}", claim_header::REACH_NAME)))
        .chain(
            table
                .model
                .traced
                .into_iter()
                .flat_map(|_| TRACED.iter().map(|column| format!("o.{}", column.name))),
        )
        .collect::<Vec<_>>()
        .join(", ");
    let update = format!(
        "UPDATE {t} AS o SET\n\
         \x20   status = CASE WHEN o.attempts >= {max} THEN '{dead}' ELSE '{in_progress}' END,\n\
         \x20   generation = CASE WHEN o.attempts >= {max} THEN o.generation ELSE o.generation + 1 END,\n\
         \x20   attempts = CASE WHEN o.attempts >= {max} THEN o.attempts ELSE o.attempts + 1 END,\n\
         \x20   lease_until = CASE WHEN o.attempts >= {max} THEN NULL ELSE statement_timestamp() + {lease} END,\n\
         \x20   last_error = CASE\n\
         \x20       WHEN o.attempts < {max} THEN o.last_error\n\
         \x20       WHEN o.status = '{in_progress}'\n\
         \x20           THEN 'lease expired on claim ' || o.attempts || ' of {max}: attempt budget exhausted'\n\
         \x20       ELSE 'attempt budget exhausted: ' || o.attempts || ' claims made, the budget is now {max}'\n\
         \x20           || coalesce('; the last error: ' || o.last_error, '') END\n\
         WHERE o.ctid = ANY(ARRAY({candidates}))\n\
         RETURNING {returning}"
    );
    match table.model.key() {
        // The key is a payload column too: `done` returns it as it is, for `wake`.
        Some(key) if dead_releases(table) => format!(
            ",\ndone AS (\n{update}){}\nSELECT * FROM done",
            wake(
                table,
                ("f.id", &format!("f.{}", quoted(&key.column))),
                "f.lease_until IS NULL",
                Successor::SetAside
            ),
        ),
        _ => format!("\n{update}"),
    }
}

/// The `enqueue` arguments of the `checked` form: each field as its column's type.
fn checked_fields(model: &Model) -> Vec<TokenStream> {
    model
        .fields
        .iter()
        .map(|f| {
            // Spanned at the field's type, so a mismatch with its column points there.
            let (field, ty, span) = (&f.ident, &f.ty, f.ty.span());
            if f.json {
                // jsonb parameters are `serde_json::Value` to sqlx; `Json<T>` encodes to it.
                quote_spanned!(span => ::sqlx::types::Json(&event.#field) as _)
            } else if f.sql_type.is_date_time() {
                // Whether a date/time column maps to chrono or time is the user's
                // sqlx.toml setting; the explicit type lets either be used, and skips
                // only that check.
                quote_spanned!(span => &event.#field as &#ty)
            } else if f.nullable() {
                quote_spanned!(span => event.#field.as_ref())
            } else {
                quote_spanned!(span => &event.#field)
            }
        })
        .collect()
}
