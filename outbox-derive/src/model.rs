//! Stage 2: the validated model of an outbox table. Every rule that keeps the SQL
//! sound is enforced here, with an error spanned at the token that breaks it: names in
//! `ident`, durations in `duration`, column types in `types`, the struct's fields in
//! `fields`; this module assembles their results.

use std::time::Duration;

use outbox_internals::{Bookkeeping, PUBLISH_AT, TRACED};
use syn::{DeriveInput, Ident, LitInt};

use crate::attr::{self, Errors};
use crate::fields::{self, EventIdField, Field};
use crate::{duration, ident};

pub(crate) struct Model {
    pub(crate) ident: Ident,
    /// The path to the `outbox` crate (`::outbox` unless `crate = ".."` says).
    pub(crate) krate: syn::Path,
    pub(crate) table: String,
    pub(crate) history_table: String,
    pub(crate) lease: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) max_attempts: i32,
    /// What recording an event as published does to its row.
    pub(crate) sent: Sent,
    /// Whether a `DEAD` event holds back the later events of its key.
    pub(crate) dead: Dead,
    pub(crate) event_id: Option<EventIdField>,
    pub(crate) fields: Vec<Field>,
    /// `#[outbox(scheduled)]`: the migration version that adds the `publish_at` column
    /// (1: the `CREATE TABLE`), and with it `enqueue_at` and `enqueue_after`.
    pub(crate) scheduled: Option<u32>,
    /// `#[outbox(traced)]`: the migration version that adds the `trace_parent` and
    /// `trace_state` columns, where enqueue keeps the current trace context.
    pub(crate) traced: Option<u32>,
    /// `#[outbox(no_event_id_index)]`: the migration version from which the table has
    /// no unique index on `event_id` (1: created without), for ids that are fresh
    /// UUIDv7s, unique by construction.
    pub(crate) no_event_id_index: Option<u32>,
}

/// What recording an event as published does to its row.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// The row stays, as `SENT` (the default): history, and enqueue stays idempotent on
    /// its event id until the row is pruned.
    Keep,
    /// The row is deleted by the guarded outcome (`delete_sent`): no second row version,
    /// no pruning.
    Delete,
}

/// What a `DEAD` event does to the later events of its ordering key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dead {
    /// They wait until an operator requeues or discards it (the default: order is the
    /// point of a key).
    HoldsKey,
    /// They go on without it (`dead_releases_key`).
    ReleasesKey,
}

impl Model {
    pub(crate) fn from_input(input: &DeriveInput) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let attrs = attr::parse_container(&input.attrs, &mut errors);
        let krate = attr::crate_path(&attrs, &mut errors);
        let named = fields::named_fields(input, &mut errors);
        let table = ident::table_name(&input.ident, attrs.table.as_ref(), &mut errors);
        let lease = duration::lease(attrs.lease.as_ref(), &mut errors);
        let retry_delay = duration::retry_delay(attrs.retry_delay.as_ref(), &mut errors);
        let max_attempts = parse_max_attempts(attrs.max_attempts.as_ref(), &mut errors);
        let mut added = Vec::new();
        let scheduled = opted_in(
            attrs.scheduled.as_ref(),
            "scheduled",
            "adds the scheduled events' column",
            &mut added,
            &mut errors,
        );
        let traced = opted_in(
            attrs.traced.as_ref(),
            "traced",
            "adds the trace context's columns",
            &mut added,
            &mut errors,
        );
        let no_event_id_index = opted_in(
            attrs.no_event_id_index.as_ref(),
            "no_event_id_index",
            "drops the unique index on `event_id`",
            &mut added,
            &mut errors,
        );
        let (event_id, fields, keyed) = fields::fields(named, &input.generics, added, &mut errors);
        if let (Some(flag), Some(_)) = (&attrs.no_event_id_index, &event_id) {
            errors.push(syn::Error::new_spanned(
                &flag.flag,
                "`no_event_id_index` is for generated event ids, unique by construction: with an #[outbox(event_id)] field, enqueue skips an id already in the table, and only the unique index on `event_id` can tell",
            ));
        }
        let dead = match &attrs.dead_releases_key {
            Some(flag) if !keyed => {
                errors.push(syn::Error::new(
                    flag.span(),
                    "`dead_releases_key` needs an ordering key: mark the field that holds the aggregate id with #[outbox(key)]",
                ));
                Dead::ReleasesKey
            }
            Some(_) => Dead::ReleasesKey,
            None => Dead::HoldsKey,
        };

        errors.finish(Self {
            ident: input.ident.clone(),
            krate,
            history_table: ident::history_table(&table),
            table,
            lease,
            retry_delay,
            max_attempts,
            sent: if attrs.delete_sent.is_some() {
                Sent::Delete
            } else {
                Sent::Keep
            },
            dead,
            event_id,
            fields,
            scheduled,
            traced,
            no_event_id_index,
        })
    }

    /// The ordering key's field, if the type has one.
    pub(crate) fn key(&self) -> Option<&Field> {
        self.fields.iter().find(|f| f.key)
    }

    /// The bookkeeping columns the type's flags add (`scheduled`, `traced`), each with
    /// the migration version that adds it.
    pub(crate) fn optional_columns(&self) -> Vec<(u32, &'static Bookkeeping)> {
        let scheduled = self.scheduled.map(|v| (v, &PUBLISH_AT));
        let traced = self
            .traced
            .into_iter()
            .flat_map(|v| TRACED.iter().map(move |column| (v, column)));
        scheduled.into_iter().chain(traced).collect()
    }

    /// Migration versions beyond 1, in order.
    pub(crate) fn later_versions(&self) -> Vec<u32> {
        let mut versions: Vec<u32> = self
            .fields
            .iter()
            .map(|f| f.since)
            .chain(self.scheduled)
            .chain(self.traced)
            .chain(self.no_event_id_index)
            .filter(|&v| v > 1)
            .collect();
        versions.sort_unstable();
        versions.dedup();
        versions
    }
}

/// The version that makes the change of an opt-in flag (`key`, whose version `what`):
/// `since = N` (2 or more, also recorded in `added` for the version check), or 1 without
/// `since`; `None` without the flag, or with a `since` in error.
fn opted_in(
    flag: Option<&attr::OptIn>,
    key: &str,
    what: &str,
    added: &mut Vec<(u32, proc_macro2::Span)>,
    errors: &mut Errors,
) -> Option<u32> {
    let Some(lit) = flag?.since.as_ref() else {
        return Some(1);
    };
    match lit.base10_parse::<i32>() {
        Ok(v) if v >= 2 => {
            added.push((v.unsigned_abs(), lit.span()));
            Some(v.unsigned_abs())
        }
        _ => {
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "`since` is the migration version that {what}: from 2 to 2147483647, as version 1 creates the table; write `#[outbox({key})]` for a table created with it"
                ),
            ));
            None
        }
    }
}

fn parse_max_attempts(lit: Option<&LitInt>, errors: &mut Errors) -> i32 {
    const DEFAULT: i32 = 10;
    let Some(lit) = lit else { return DEFAULT };
    match lit.base10_parse::<i32>() {
        Ok(n) if n >= 1 => n,
        _ => {
            errors.push(syn::Error::new(
                lit.span(),
                "`max_attempts` must be an integer from 1 to 2147483647: the number of claims an event may use before it moves to DEAD",
            ));
            DEFAULT
        }
    }
}
