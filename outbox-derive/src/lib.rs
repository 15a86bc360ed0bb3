//! `#[derive(Outbox)]`: turns an event struct into a typed PostgreSQL outbox table.
//!
//! The macro works in stages, each in its own module:
//! `attr` parses `#[outbox(..)]` attributes, `model` validates them into a model
//! of the table, `sql` renders every statement and migration as text, and
//! `expand` generates the code. `model` assembles the rules of its own modules:
//! `ident` (table, column and history table names), `duration` (`lease`,
//! `retry_delay`), `types` (Rust type to column type) and `fields` (the struct's
//! fields). Errors are accumulated, each spanned at the offending token, so one
//! compile shows every mistake; `fallback` emits them with a stand-in
//! implementation, so the type's uses elsewhere report nothing more.
//!
//! Use it through the `outbox` crate (`#[derive(outbox::Outbox)]`): the generated code
//! names the runtime only through `::outbox::__private`. The attribute reference is the
//! derive's own documentation, [`Outbox`](derive@Outbox), which docs.rs shows on the
//! derive's page.

mod attr;
mod duration;
mod expand;
mod fallback;
mod fields;
mod ident;
mod model;
mod sql;
mod statements;
mod types;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Turns a struct with named fields into a typed PostgreSQL outbox table: one row per
/// event, one column per field.
///
/// ```ignore
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize, Debug, Clone)]
/// pub struct Line { pub sku: String, pub quantity: i32 }
///
/// #[derive(outbox::Outbox, Debug, Clone)]
/// #[outbox(table = "order_events", lease = "30s", retry_delay = "1m", max_attempts = 10)]
/// pub struct OrderPlaced {
///     #[outbox(event_id)]      // the stable id; without one, a UUIDv7 is generated at enqueue
///     pub order_id: uuid::Uuid,
///     pub customer: String,     // text NOT NULL
///     pub total_cents: i64,     // bigint NOT NULL
///     pub note: Option<String>, // text, nullable
///     #[outbox(json)]           // any serde type, as jsonb
///     pub lines: Vec<Line>,
///     #[outbox(since = 2)]      // added later, by the table's migration V2
///     pub coupon: Option<String>,
/// }
/// ```
///
// The example cannot compile here (this crate cannot depend on `outbox`): the same one
// is a compiled doctest in `outbox`'s crate documentation (src/lib.rs). Keep them equal.
/// The event must be a struct with named fields (`struct Ping {}` is an event without
/// payload); it cannot be generic or borrow. Every mistake below is a compile error at
/// the offending token, and one compile reports all of them.
///
/// # Struct attributes
///
/// Written `#[outbox(key = value, ..)]` on the struct; every key is optional.
///
/// | attribute | meaning | default |
/// |---|---|---|
/// | `table = "order_events"` | The table's name: a plain lowercase SQL identifier (`a`–`z`, `0`–`9`, `_`, not starting with a digit), at most 63 bytes, and none of the outbox's own (`outbox_catalog`, `outbox_inbox`, `_outbox_history_*`) nor a name the generated statements give their steps (`done`, `doomed`, `enqueued`, `expired`, `next`, `other`, `parked`, `reach`, `ready`, `requeued`, `sent`, `u`, `woken`), which would stand for the step inside them. It is also the `NOTIFY` channel. | the struct's name in snake case (`OrderPlaced` → `order_placed`) |
/// | `lease = "30s"` | How long a claim owns its row. The relay renews a claim every third of its lease, and each renewal must complete a database round trip before the lease ends, so the lease must be **at least `1s`**. A lease is also how long a crashed publisher's events wait before another publisher may claim them: typical values are `10s` to `5m`. | `"30s"` |
/// | `retry_delay = "1m"` | How long a retried event waits before it is due again, when the retry names no delay (the relay backs off from it). Greater than zero. | `"1m"` |
/// | `max_attempts = 10` | How many claims an event may use before it moves to `DEAD` (an integer from 1 to 2147483647). | `10` |
/// | `delete_sent` | A flag: the guarded outcome that records an event as published deletes its row instead of keeping it as `SENT` (the same guards: a stale owner deletes nothing). The table then holds only work not yet done and `DEAD` rows, with no `SENT` row versions to write, vacuum or prune. The price: once its row is gone an event id is forgotten, so enqueueing the same id again enqueues it again. | off: `SENT` rows are kept until `prune_sent` |
/// | `dead_releases_key` | A flag, with an ordering `key`: a `DEAD` event no longer holds back the later events of its key. | off: a `DEAD` event holds its key until it is requeued or discarded |
/// | `scheduled` | A flag: events may be enqueued for a later time (`enqueue_at`, `enqueue_after`, `enqueue_all_at`, `enqueue_all_after`), kept in a `publish_at` column. `scheduled(since = N)` adds the column to an existing table by migration version `N`, as `since` does a field's. | off: no such methods, no column |
/// | `traced` | A flag: enqueue keeps the current span's W3C trace context and baggage in `trace_parent`, `trace_state` and `trace_baggage` columns, in the same `INSERT`, and the relay publishes each event in that trace (`traceparent`, `tracestate`, `baggage` headers; with the cargo feature `otel`, under a span of its own); see `outbox::trace`. `traced(since = N)` adds the columns to an existing table by migration version `N`. | off: no trace context kept |
/// | `no_event_id_index` | A flag, on a type without an `#[outbox(event_id)]` field: its ids are fresh UUIDv7s, unique by construction, and its table has no unique index on `event_id`, which took an entry per row version (a fifth of an event's WAL, measured). A repeated id is then not caught (enqueue of a natural id needs the index, hence the restriction); looking one event up by id (`outbox show`, requeueing or discarding `DEAD` events by id) reads the table instead of an index. `no_event_id_index(since = N)` drops the index of an existing table by migration version `N`, once no process runs a build older than this flag (whose enqueue names the index, `ON CONFLICT (event_id)`, and would fail without it). | off: a unique index on `event_id` |
/// | `crate = "::my_deps::outbox"` | The path the generated code names the `outbox` crate by: for a dependency renamed in `Cargo.toml`, or re-exported by another crate. | `"::outbox"` |
///
/// Durations are strings in [humantime](https://docs.rs/humantime) syntax (`"500ms"`,
/// `"30s"`, `"1m"`, `"1h 30m"`), in whole microseconds, PostgreSQL's `interval`
/// precision.
///
/// # Field attributes
///
/// Written `#[outbox(..)]` on a field.
///
/// | attribute | meaning |
/// |---|---|
/// | `event_id` | This field is the event's stable id, the one consumers deduplicate on: stored (as text) in the `event_id` column rather than a column of its own. Its type is `String`, `uuid::Uuid`, `i64` or `i32`. At most one field; it combines with no other attribute. Without one, a UUIDv7 is generated at enqueue. |
/// | `key` | This field is the ordering key, an aggregate id (`String`, `uuid::Uuid`, `i64`, `i32`, or an `Option` of one, as a key added with `since` must be): the events of one key are published in the order of their row ids, each only once every earlier one is `SENT` (or `DEAD`, with `dead_releases_key`) or acknowledged before it in the same claim (the relay's claims take a key's events in runs, sent one after the other). An event whose key is `None` has no order: it never waits, nor holds anything back. Stored in the field's column, with an index on it. At most one field. |
/// | `json` | Stores the field, of any type implementing serde's `Serialize` and `Deserialize`, as `jsonb`. What JSON cannot hold does not come back: serde_json writes a NaN or infinite float as `null`, which then fails to decode when the event is claimed (moved to `DEAD`, the reason in `last_error`), and `jsonb` refuses a string with a NUL character (the enqueue fails, with its transaction). |
/// | `column = "name"` | The field's column (a plain lowercase identifier, as for `table`); default: the field's name. The outbox's own columns (`id`, `event_id`, `status`, `generation`, `attempts`, `lease_until`, `next_attempt_at`, `last_error`, `created_at`), `outbox_reclaimed`, `outbox_key` and PostgreSQL's system columns are reserved. |
/// | `since = 2` | The migration version of the table that adds this column (2 or more; version 1 creates the table). The field must be an `Option`: rows written before it have no value. Fields with the same `since` are added by one migration. Versions follow each other from 2 (a version left out is a compile error: used later, it would come after versions a database already applied and never be applied). |
///
/// # Field types
///
/// | Rust type | PostgreSQL column |
/// |---|---|
/// | `i16`, `i32`, `i64` | `smallint`, `integer`, `bigint` |
/// | `f32`, `f64` | `real`, `double precision` |
/// | `bool` | `boolean` |
/// | `String` | `text` |
/// | `Vec<u8>` | `bytea` |
/// | `uuid::Uuid` | `uuid` |
/// | `chrono::NaiveDate`, `time::Date` | `date` |
/// | `chrono::NaiveTime`, `time::Time` | `time` |
/// | `chrono::NaiveDateTime`, `time::PrimitiveDateTime` | `timestamp` |
/// | `chrono::DateTime<Utc>`, `time::OffsetDateTime` | `timestamptz` (an instant: a `time::OffsetDateTime` comes back at offset zero) |
/// | `serde_json::Value` | `jsonb` |
/// | any serde type, with `#[outbox(json)]` | `jsonb` |
/// | `Option<T>` of any of these | the same type, nullable (every other column is `NOT NULL`) |
///
/// Any other type is a compile error that suggests `#[outbox(json)]`; so are unsigned,
/// 8-bit and 128-bit integers, which PostgreSQL has no column type for. Date and time
/// values are stored to the microsecond, PostgreSQL's precision: finer digits are cut.
///
/// # What it generates
///
/// `impl outbox::Outbox for T`: the table's spec (`T::SPEC`: its name, lease, retry
/// delay, attempt budget, columns and migrations) and its statements, every one
/// rendered at compile time with the lease and generation guards. The trait is
/// implemented only by this derive. With the `outbox` crate's `checked` feature, every
/// statement is also checked against a live schema at compile time.
///
/// And inherent methods on `T`, callable without importing a trait:
///
/// | method | what it does |
/// |---|---|
/// | `event.enqueue(&mut *tx)` | Writes the event through an executor (pass the business transaction, so both commit together); returns an `Enqueued`: `New(id)`, or `Duplicate(id)` when its id was already in the table (nothing written). |
/// | `T::enqueue_all(&events, &mut *tx)` | Writes a slice of events in one statement; returns one `Enqueued` per event, in order. |
/// | `T::claim(&pool)` | Claims the next due event, if any, under a fresh lease and generation: `Option<Claim<T>>`. |
/// | `T::claim_batch(&pool, limit)` | Claims up to `limit` due events in one statement: `Vec<Claim<T>>`. |
/// | `T::migrations()` | The table's migrations, for `outbox::migrate(&pool, &[T::migrations()])` at startup. |
///
/// Each returns `Result<_, OutboxError>` (the async ones once awaited).
///
/// # Schema evolution: a table only grows
///
/// The table's migrations are generated from the struct: version 1 creates the table
/// with every field that has no `since`, in field order, and each later version adds
/// the fields marked with it. `outbox::migrate` records each migration's checksum and
/// refuses to start when an applied one was edited. So:
///
/// - **add** a field as an `Option<_>` marked `#[outbox(since = N)]`, with `N` one more
///   than the table's latest version;
/// - **never remove, rename, retype or reorder** a field, nor change its `column` or
///   `json`: that edits migration V1 (or the version that added it), which is refused
///   at startup. A change the migration does not show is not refused, and is as
///   harmful: the `event_id` field's type, the Rust type inside a `json` column (both
///   stay `text` or `jsonb`); the events enqueued before it that no longer decode are
///   moved to `DEAD` when claimed;
/// - **to change an event's shape**, define a new event type with its own table, publish
///   the new one, and retire the old type once its relay has drained its table.
#[proc_macro_derive(Outbox, attributes(outbox))]
pub fn derive_outbox(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match model::Model::from_input(&input) {
        Ok(model) => expand::expand(&model),
        Err(errors) => fallback::fallback(&input, errors),
    }
    .into()
}
