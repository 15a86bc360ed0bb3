//! The vocabulary that `outbox-derive` (which writes the SQL) and `outbox-runtime`
//! (which runs it) must agree on, in one place: the row statuses, the relay's outcomes,
//! the bookkeeping columns, the claim's result header, the statements, and the
//! identifier rule. No dependencies, no public API of the `outbox` crate: the derive
//! uses it at expansion time, the runtime at run time.

/// The states of an outbox row, as stored in its `status` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Waiting for a claim once `next_attempt_at` has come.
    Ready,
    /// Claimed by a publisher until `lease_until`.
    InProgress,
    /// Published, and recorded so by the current owner.
    Sent,
    /// Given up on: a permanent failure, a spent budget, or a payload that does not
    /// decode. Kept for an operator.
    Dead,
}

impl Status {
    /// Every status, in the order a row moves through them.
    pub const ALL: [Self; 4] = [Self::Ready, Self::InProgress, Self::Sent, Self::Dead];

    /// The value in the `status` column.
    pub const fn as_sql(self) -> &'static str {
        match self {
            Self::Ready => "READY",
            Self::InProgress => "INPROGRESS",
            Self::Sent => "SENT",
            Self::Dead => "DEAD",
        }
    }

    /// The status a `status` value names.
    pub fn from_sql(value: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_sql() == value)
    }
}

/// What the relay records for one claimed row, as its `record` statement spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Published: `SENT`.
    Sent,
    /// Failed, worth another attempt after a delay: `READY` (or `DEAD` once the budget
    /// is spent).
    Retry,
    /// Failed for good: `DEAD`.
    Dead,
    /// Not sent (shutdown, or the destination unavailable): back to `READY`, due now,
    /// the attempt not counted; with an error (the destination's), that is its
    /// `last_error`, which is kept otherwise.
    Release,
}

impl Outcome {
    /// The value the `record` statement matches on.
    pub const fn as_sql(self) -> &'static str {
        match self {
            Self::Sent => "SENT",
            Self::Retry => "RETRY",
            Self::Dead => "DEAD",
            Self::Release => "RELEASE",
        }
    }
}

/// A column every outbox table has, beside the event's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bookkeeping {
    /// The column's name.
    pub name: &'static str,
    /// Its definition in `CREATE TABLE`, after the name.
    pub definition: &'static str,
    /// Its type as `format_type()` prints it, for the drift check.
    pub catalog_type: &'static str,
    /// Whether it accepts NULL.
    pub nullable: bool,
}

const fn column(
    name: &'static str,
    definition: &'static str,
    catalog_type: &'static str,
    nullable: bool,
) -> Bookkeeping {
    Bookkeeping {
        name,
        definition,
        catalog_type,
        nullable,
    }
}

/// The bookkeeping columns, in table order. Once a table is released, its `CREATE
/// TABLE` must never change (the migration's checksum would), so neither may these.
pub const BOOKKEEPING: [Bookkeeping; 9] = [
    column(
        "id",
        "bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        "bigint",
        false,
    ),
    // Matched byte for byte, never sorted: its unique index takes an entry on every
    // update, where a locale-aware comparison costs far more than a `memcmp`.
    column(
        "event_id",
        "text COLLATE \"C\" NOT NULL UNIQUE",
        "text",
        false,
    ),
    column(
        "status",
        "text NOT NULL DEFAULT 'READY'\n        CHECK (status IN ('READY', 'INPROGRESS', 'SENT', 'DEAD'))",
        "text",
        false,
    ),
    // A random start: a claim token (id, generation) can then never match a row of
    // another table, schema or database, nor of this one after its ids restart.
    column(
        "generation",
        "bigint NOT NULL DEFAULT (random() * (2 ^ 62))::bigint",
        "bigint",
        false,
    ),
    column("attempts", "integer NOT NULL DEFAULT 0", "integer", false),
    column(
        "lease_until",
        "timestamptz",
        "timestamp with time zone",
        true,
    ),
    // When a `READY` row is due; for a `SENT` row, when it was recorded sent.
    column(
        "next_attempt_at",
        "timestamptz NOT NULL DEFAULT statement_timestamp()",
        "timestamp with time zone",
        false,
    ),
    column("last_error", "text", "text", true),
    column(
        "created_at",
        "timestamptz NOT NULL DEFAULT statement_timestamp()",
        "timestamp with time zone",
        false,
    ),
];

/// The column of a table declared `#[outbox(scheduled)]`: the time its event was
/// enqueued for (`enqueue_at`, `enqueue_after`), NULL for one due at its enqueue. Its
/// `next_attempt_at` starts there, and moves with claims, retries and hand-backs; this
/// stays, so that the wake-up of a key's held events never makes a scheduled one due
/// early, and the lag counts from the time an event was due, not from its enqueue.
pub const PUBLISH_AT: Bookkeeping = column(
    "publish_at",
    "timestamptz",
    "timestamp with time zone",
    true,
);

/// The columns of a table declared `#[outbox(traced)]`, in their order: the W3C trace
/// context of the span that enqueued the event (`traceparent`, `tracestate`) and its W3C
/// `baggage`, NULL when there was none. The relay's publish of the event continues that
/// trace.
pub const TRACED: [Bookkeeping; 3] = [TRACE_PARENT, TRACE_STATE, TRACE_BAGGAGE];
/// See [`TRACED`].
pub const TRACE_PARENT: Bookkeeping = column("trace_parent", "text", "text", true);
/// See [`TRACED`].
pub const TRACE_STATE: Bookkeeping = column("trace_state", "text", "text", true);
/// See [`TRACED`].
pub const TRACE_BAGGAGE: Bookkeeping = column("trace_baggage", "text", "text", true);

/// The columns the claim statements return before the payload, in order: what a
/// [`Claim`](https://docs.rs/outbox) is made of.
pub mod claim_header {
    /// The row id.
    pub const ID: usize = 0;
    /// The stable event id.
    pub const EVENT_ID: usize = 1;
    /// The generation this claim holds.
    pub const GENERATION: usize = 2;
    /// Claims used of the budget, this one included.
    pub const ATTEMPTS: usize = 3;
    /// The new lease's end; NULL when the claim moved the row to `DEAD` instead.
    pub const LEASE_UNTIL: usize = 4;
    /// When the row became due: where it sits in the `READY` index.
    pub const NEXT_ATTEMPT_AT: usize = 5;
    /// When the event was enqueued.
    pub const CREATED_AT: usize = 6;
    /// Whether the claim took over an expired claim.
    pub const RECLAIMED: usize = 7;
    /// The header's columns up to [`RECLAIMED`], as the statements write them (`o.` is
    /// the claimed row); each claim then writes its own `.. AS` [`RECLAIMED_NAME`].
    pub const COLUMNS: [&str; 7] = [
        "o.id",
        "o.event_id",
        "o.generation",
        "o.attempts",
        "o.lease_until",
        "o.next_attempt_at",
        "o.created_at",
    ];
    /// The result name of [`RECLAIMED`]: not a column, so no payload column may take it.
    pub const RECLAIMED_NAME: &str = "outbox_reclaimed";
    /// For a type with an ordering key, the key as text, after the payload columns.
    pub const KEY_NAME: &str = "outbox_key";
    /// For a type with an ordering key, in the relay's claims, after the key: how far
    /// its `READY` scan saw every due row it could (`timestamptz`, NULL when expired
    /// claims filled the batch): the statement's time when the scan found fewer rows
    /// than it looked for, else the `next_attempt_at` of the last row it found.
    pub const REACH_NAME: &str = "outbox_reach";
}

/// Declares [`Statement`] from one list, so its variants, [`Statement::ALL`] and
/// [`Statement::name`] cannot disagree: the spec stores statements by their place in
/// that list.
macro_rules! statements {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)*) => {
        /// Every statement of an outbox table. The derive writes each one's text (and,
        /// with the `checked` feature, its compile-time check) in one exhaustive `match`;
        /// the runtime runs it from the table's spec through one function named after
        /// it (its `table::statements`), which binds the parameters and decodes the
        /// result. Each variant's documentation is its contract: its parameters and what
        /// it returns.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Statement {
            $($(#[$doc])* $variant,)*
        }

        impl Statement {
            /// Every statement, in declaration order: the order the spec stores them.
            pub const ALL: [Self; [$($name),*].len()] = [$(Self::$variant),*];

            /// Its name, in snake case: for snapshots and logs.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }
    };
}

statements! {
    /// `INSERT` of one event, skipping an event id already there. `$1` the event id
    /// (`text`), then one parameter per payload column, then when it is due: a time
    /// (`timestamptz`) and a delay (`interval`), either NULL; the latest of now, the time
    /// and now plus the delay (`enqueue_at`, `enqueue_after`). Returns the row's `id`, or
    /// no row for a duplicate; notifies the table's channel on commit.
    Enqueue => "enqueue",
    /// `INSERT` of many events, one array per column: `$1` the event ids (`text[]`), then
    /// one array per payload column, then when they are all due, as for
    /// [`Enqueue`](Self::Enqueue). Returns nothing; raises a unique violation on a
    /// duplicate. Notifies once on commit.
    EnqueueAll => "enqueue_all",
    /// [`EnqueueAll`](Self::EnqueueAll) that skips event ids already there (or earlier
    /// in the arrays). Returns the `event_id` of every row written.
    EnqueueAllSkipping => "enqueue_all_skipping",
    /// Claims up to a limit of due `READY` rows and expired `INPROGRESS` rows, the
    /// limit written into the text (see `Statements::claim_limited`). On a table with an
    /// ordering key, the relay's claim (runs of a key) binds the claimer's runs in
    /// flight: `$1` the ids and `$2` the generations (`bigint[]`) of the last event of
    /// each, whose key's next event may follow it in this claim, and `$3` the most
    /// events of one key the claim takes (`bigint`, at least 1); otherwise no
    /// parameters. Returns the [`claim_header`] columns, then the payload columns.
    Claim => "claim",
    /// [`Claim`](Self::Claim) of due `READY` rows only, from a position in the `READY`
    /// index on: `$1` the earliest `next_attempt_at` to look at, in microseconds since
    /// the Unix epoch (`bigint`), then on a keyed table the runs in flight as `$2` and
    /// `$3`, and the most events of a key as `$4`. Rows due before it are left to
    /// `Claim`. Same result.
    ClaimFrom => "claim_from",
    /// Guarded `INPROGRESS -> SENT`: `$1` id, `$2` generation (`bigint`). Returns `id`.
    Complete => "complete",
    /// Guarded `INPROGRESS -> READY` after `$3` (`interval`), or `DEAD` when the budget is
    /// spent; `$4` the error (`text`, nullable). Returns the new `status`.
    Retry => "retry",
    /// Guarded lease extension: `$1` id, `$2` generation. Returns the new `lease_until`.
    Renew => "renew",
    /// Guarded `INPROGRESS -> DEAD`: `$1` id, `$2` generation, `$3` the reason. Returns `id`.
    Fail => "fail",
    /// Guarded `INPROGRESS -> SENT` of a batch, each row on its own: `$1` ids, `$2`
    /// generations (`bigint[]`). Returns the `id`s recorded.
    CompleteBatch => "complete_batch",
    /// The outcomes of a batch, each row on its own: `$1` ids, `$2` generations, `$3`
    /// [`Outcome`]s (`text[]`), `$4` retry delays (`interval[]`), `$5` errors (`text[]`).
    /// Returns (`id`, new `status`) per row recorded; a row missing there was stale.
    Record => "record",
    /// Guarded lease extension of a batch: `$1` ids, `$2` generations. Returns (`id`,
    /// `lease_until`) per row still owned.
    RenewBatch => "renew_batch",
    /// `DEAD -> READY` with a fresh budget for the event ids in `$1` (`text[]`). Returns
    /// the `event_id`s requeued.
    RequeueDead => "requeue_dead",
    /// `DEAD -> READY` with a fresh budget for every dead row. Returns the count.
    RequeueAllDead => "requeue_all_dead",
    /// Deletes the `DEAD` rows among the event ids in `$1` (`text[]`): given up for
    /// good, by an operator. Returns the `event_id`s deleted.
    DiscardDead => "discard_dead",
    /// Deletes up to `$2` (`bigint`) `SENT` rows created more than `$1` (`interval`) ago.
    PruneSent => "prune_sent",
    /// The operators' figures, one row, its columns read by name: `ready`,
    /// `in_progress`, `sent`, `dead` (counts per status), `expired_claims`,
    /// `oldest_waiting_age` and `oldest_waiting_error` (how long ago the oldest `READY`
    /// or `INPROGRESS` event, the one with the lowest id, was enqueued, and its
    /// `last_error`; NULL when none waits), `held_keys` and `oldest_held_age` (the keys
    /// held back by a `DEAD` event, the age of the oldest such event), `sent_last_minute`
    /// (NULL for a `delete_sent` table) and `due` (the `READY` rows that are due).
    Stats => "stats",
}

impl Statement {
    /// How many statements a table has.
    pub const COUNT: usize = Self::ALL.len();

    /// This statement's place in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// The outbox's own table of every outbox table's settings and statements, which the
/// command line reads.
pub const CATALOG_TABLE: &str = "outbox_catalog";

/// The consumers' inbox table.
pub const INBOX_TABLE: &str = "outbox_inbox";

/// The tables the outbox keeps for itself beside the application's: no event type's
/// table may take one of these names.
pub const OWN_TABLES: [&str; 2] = [CATALOG_TABLE, INBOX_TABLE];

/// The names the generated statements give their steps (`WITH ready AS (..)`).
/// Inside a statement, an unqualified table name that is also a step's name means the
/// step, not the table: no event type's table may take one of these names.
pub const STATEMENT_STEPS: [&str; 17] = [
    "continued",
    "done",
    "doomed",
    "enqueued",
    "expired",
    "next",
    "other",
    "parked",
    "reach",
    "ready",
    "requeued",
    "run_candidates",
    "run_locked",
    "run_members",
    "sent",
    "u",
    "woken",
];

/// The prefix of every table that holds a table's applied migrations
/// (`_outbox_history_<table>`): no event type's table may start with it.
pub const HISTORY_PREFIX: &str = "_outbox_history_";

/// Where refinery records an application's applied migrations unless told otherwise
/// (`migrate_with_app` runs the application's runner as it was configured): no event
/// type's table may take it.
pub const REFINERY_HISTORY: &str = "refinery_schema_history";

/// PostgreSQL truncates longer identifiers, so the derive refuses them.
pub const MAX_IDENTIFIER: usize = 63;

/// The longest delay, lease or age the outbox accepts: 1,000 years (of 365.25 days).
/// Far beyond any sensible one, and short enough that `now() ± MAX_INTERVAL` is always
/// a valid `timestamptz` (which starts in 4713 BC) and fits an `interval`.
pub const MAX_INTERVAL: std::time::Duration = std::time::Duration::from_hours(1_000 * 8_766);

/// How long an enqueuing transaction may take from its `INSERT` to its commit and still
/// be found by a relay's claims between its sweeps: the relay's frontier in the `READY`
/// index trails the rows its claims reached by this much. A keyed table's claims set
/// aside the events they step over within it (a frontier cannot pass them sooner).
pub const FRONTIER_MARGIN: std::time::Duration = std::time::Duration::from_millis(500);

/// A plain lowercase SQL identifier: nothing to quote, nothing to inject. (Its length
/// is a separate rule: at most [`MAX_IDENTIFIER`] bytes.)
pub fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_indexed_in_the_order_of_all() {
        for (i, s) in Statement::ALL.into_iter().enumerate() {
            assert_eq!(s.index(), i, "{}", s.name());
        }
    }

    #[test]
    fn statuses_round_trip_through_their_column_values() {
        for s in Status::ALL {
            assert_eq!(Status::from_sql(s.as_sql()), Some(s));
        }
        assert_eq!(Status::from_sql("ready"), None);
    }

    #[test]
    fn the_status_column_allows_every_status_and_only_those() {
        let status = BOOKKEEPING.iter().find(|c| c.name == "status").unwrap();
        let allowed: Vec<String> = Status::ALL
            .iter()
            .map(|s| format!("'{}'", s.as_sql()))
            .collect();
        assert!(
            status
                .definition
                .ends_with(&format!("CHECK (status IN ({}))", allowed.join(", "))),
            "{}",
            status.definition
        );
    }

    #[test]
    fn plain_identifiers() {
        assert!(is_plain_identifier("order_events"));
        assert!(is_plain_identifier("_x1"));
        assert!(!is_plain_identifier("1x"));
        assert!(!is_plain_identifier("Order"));
        assert!(!is_plain_identifier("a;drop"));
        assert!(!is_plain_identifier(""));
        assert!(
            is_plain_identifier(&"a".repeat(64)),
            "length is a rule of its own"
        );
    }
}
