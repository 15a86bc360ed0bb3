//! The struct's fields: the event id, if one is marked, and the payload fields, each
//! with its column, its column type and the migration that adds it. The checks that
//! span fields (one event id, one field per column) are here too.

use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, LitInt, LitStr, Type};

use crate::attr::{self, Errors};
use crate::{ident, types};

/// The field whose value is the event's stable id, stored in the `event_id` column.
pub(crate) struct EventIdField {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
}

/// A payload field and its column.
pub(crate) struct Field {
    pub(crate) ident: Ident,
    pub(crate) ty: Type,
    pub(crate) column: String,
    pub(crate) sql_type: types::SqlType,
    /// `Some(inner)` for `Option<inner>`: the column is nullable.
    pub(crate) option_of: Option<Type>,
    /// Stored as jsonb through `sqlx::types::Json`.
    pub(crate) json: bool,
    /// The ordering key (`#[outbox(key)]`): events of one key are claimed one at a
    /// time, in `id` order.
    pub(crate) key: bool,
    /// The migration version that adds the column (1: the `CREATE TABLE`).
    pub(crate) since: u32,
}

impl Field {
    pub(crate) fn nullable(&self) -> bool {
        self.option_of.is_some()
    }
}

/// The struct's named fields; anything else an outbox event cannot be is an error.
pub(crate) fn named_fields<'a>(
    input: &'a DeriveInput,
    errors: &mut Errors,
) -> Option<&'a syn::FieldsNamed> {
    if let Some(param) = input.generics.params.first() {
        let message = if matches!(param, syn::GenericParam::Lifetime(_)) {
            "an outbox event cannot borrow: remove the lifetime parameter and own its data"
        } else {
            "an outbox event cannot be generic: each event type has its own table, fixed at compile time"
        };
        errors.push(syn::Error::new_spanned(&input.generics, message));
    }
    match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => return Some(named),
            Fields::Unnamed(f) => errors.push(syn::Error::new(f.span(), "tuple structs are not supported: an outbox event needs named fields, one per column")),
            Fields::Unit => errors.push(syn::Error::new(input.ident.span(), format!("unit structs are not supported: an outbox event needs named fields, one per column; an event without payload is written `struct {} {{}}`", input.ident))),
        },
        Data::Enum(_) => errors.push(syn::Error::new(input.ident.span(), "an enum cannot be an outbox event: derive Outbox on a struct with named fields, one per column; to store an enum, put it in a field marked #[outbox(json)]")),
        Data::Union(_) => errors.push(syn::Error::new(input.ident.span(), "a union cannot be an outbox event: derive Outbox on a struct with named fields, one per column")),
    }
    None
}

/// The event id field, if any, the payload fields that are valid, after reporting every
/// error of the others, and whether a field is marked `key` (valid or not: a key with
/// a wrong type is that field's error, not a missing key). `versions` holds the later
/// migration versions the struct's attributes add (`scheduled(since = N)`), checked
/// with the fields' own.
pub(crate) fn fields(
    named: Option<&syn::FieldsNamed>,
    generics: &syn::Generics,
    mut versions: Vec<(u32, Span)>,
    errors: &mut Errors,
) -> (Option<EventIdField>, Vec<Field>, bool) {
    let mut event_id: Option<EventIdField> = None;
    let mut keyed = false;
    let mut fields = Vec::new();
    let mut column_spans = Vec::new();
    let mut first_key: Option<Ident> = None;
    for field in named.into_iter().flat_map(|n| &n.named) {
        let Some(ident) = field.ident.clone() else {
            continue;
        };
        let fattrs = attr::parse_field(&field.attrs, errors);
        // Before the `event_id` branch: a key there too is reported as such, and the
        // struct is keyed all the same (no second error about `dead_releases_key`).
        keyed |= fattrs.key.is_some();
        if let Some(flag) = &fattrs.event_id {
            validate_event_id(field, &fattrs, errors);
            if let Some(first) = &event_id {
                errors.push(syn::Error::new(
                    flag.span(),
                    format!(
                        "only one field can be the `event_id`, and `{}` already is",
                        first.ident
                    ),
                ));
            }
            event_id = Some(EventIdField {
                ident,
                ty: field.ty.clone(),
            });
            continue;
        }
        let column_span = fattrs
            .column
            .as_ref()
            .map_or_else(|| ident.span(), LitStr::span);
        if let Some(f) = payload_field(ident, field, &fattrs, generics, errors) {
            if let Some(flag) = &fattrs.key {
                validate_key(field, &fattrs, flag, first_key.as_ref(), errors);
                first_key.get_or_insert_with(|| f.ident.clone());
            }
            if let Some(lit) = fattrs.since.as_ref().filter(|_| f.since > 1) {
                versions.push((f.since, lit.span()));
            }
            fields.push(f);
            column_spans.push(column_span);
        }
    }
    check_column_names(&fields, &column_spans, errors);
    check_versions(versions, errors);
    (event_id, fields, keyed)
}

fn validate_event_id(field: &syn::Field, attrs: &attr::FieldAttrs, errors: &mut Errors) {
    const SUPPORTED: &[&str] = &["String", "Uuid", "i64", "i32"];
    if !SUPPORTED
        .iter()
        .any(|name| types::is_ident(&field.ty, name))
    {
        errors.push(syn::Error::new_spanned(
            &field.ty,
            "an `event_id` field must be `String`, `uuid::Uuid`, `i64` or `i32`: a stable value that never changes across retries",
        ));
    }
    if let Some(key) = &attrs.key {
        errors.push(syn::Error::new(key.span(), "`key` cannot be combined with `event_id`: the event id names one event, the ordering key the aggregate many events share; mark another field with #[outbox(key)]"));
    }
    for (present, key) in [
        (attrs.json.as_ref().map(Spanned::span), "json"),
        (attrs.column.as_ref().map(Spanned::span), "column"),
        (attrs.since.as_ref().map(Spanned::span), "since"),
    ] {
        if let Some(span) = present {
            errors.push(syn::Error::new(span, format!("`{key}` cannot be combined with `event_id`: the id is always stored in the `event_id` column")));
        }
    }
}

/// The ordering key: an aggregate id, compared by equality in the claim, so a type
/// whose equality PostgreSQL and Rust agree on; one per struct.
fn validate_key(
    field: &syn::Field,
    attrs: &attr::FieldAttrs,
    flag: &Ident,
    first: Option<&Ident>,
    errors: &mut Errors,
) {
    const SUPPORTED: &[&str] = &["String", "Uuid", "i64", "i32"];
    let ty = types::option_inner(&field.ty).unwrap_or(&field.ty);
    if !SUPPORTED.iter().any(|name| types::is_ident(ty, name)) {
        errors.push(syn::Error::new_spanned(
            &field.ty,
            "an ordering `key` must be `String`, `uuid::Uuid`, `i64` or `i32` (an aggregate id), or an `Option` of one for a key added with `since`",
        ));
    }
    if let Some(json) = &attrs.json {
        errors.push(syn::Error::new(
            json.span(),
            "`json` cannot be combined with `key`: the ordering key is compared as a plain column",
        ));
    }
    if let Some(first) = first {
        errors.push(syn::Error::new(
            flag.span(),
            format!("only one field can be the ordering `key`, and `{first}` already is"),
        ));
    }
}

/// The field and its column, or `None` after recording every error it has.
fn payload_field(
    ident: Ident,
    field: &syn::Field,
    attrs: &attr::FieldAttrs,
    generics: &syn::Generics,
    errors: &mut Errors,
) -> Option<Field> {
    let column = ident::column_name(&ident, attrs, errors);
    let option_of = types::option_inner(&field.ty).cloned();
    let json = attrs.json.is_some();
    let ty = option_of.as_ref().unwrap_or(&field.ty);
    let sql_type = types::column_type(ty, json, generics, errors);
    let since = since(attrs.since.as_ref(), field, option_of.is_some(), errors);
    Some(Field {
        ident,
        ty: field.ty.clone(),
        column: column?,
        sql_type: sql_type?,
        option_of,
        json,
        key: attrs.key.is_some(),
        since: since?,
    })
}

/// The migration version that adds the field's column: `since = N` (2 or more, on an
/// `Option` field), or 1, the `CREATE TABLE`.
fn since(
    lit: Option<&LitInt>,
    field: &syn::Field,
    optional: bool,
    errors: &mut Errors,
) -> Option<u32> {
    let Some(lit) = lit else { return Some(1) };
    match lit.base10_parse::<i32>() {
        Ok(v) if v >= 2 && optional => Some(v.unsigned_abs()),
        Ok(v) if v >= 2 => {
            errors.push(syn::Error::new_spanned(
                &field.ty,
                format!("`since = {v}` adds this column to a table whose existing rows have no value for it: make the field an `Option<_>`"),
            ));
            None
        }
        _ => {
            errors.push(syn::Error::new(lit.span(), "`since` is the migration version that adds this column: from 2 to 2147483647, as version 1 creates the table; leave `since` out for a column the table was created with"));
            None
        }
    }
}

/// The `since` versions follow each other from 2 (fields may share one): a version
/// left out now could not be added later, as refinery does not apply a version below
/// one already applied. The first that skips one is the error, at its literal.
fn check_versions(mut versions: Vec<(u32, Span)>, errors: &mut Errors) {
    versions.sort_by_key(|&(version, _)| version);
    let mut next = 2;
    for (version, span) in versions {
        if version > next {
            errors.push(syn::Error::new(
                span,
                format!(
                    "`since = {version}` skips version {next}: a table's migration versions follow each other from 2, so this one is `since = {next}` (a version left out could not be added later: refinery does not apply a version below one already applied)"
                ),
            ));
            return;
        }
        next = next.max(version + 1);
    }
}

/// Two fields on one column: the later one is the error, at its column's name.
fn check_column_names(fields: &[Field], spans: &[Span], errors: &mut Errors) {
    for (i, (field, span)) in fields.iter().zip(spans).enumerate() {
        if let Some(first) = fields[..i].iter().find(|f| f.column == field.column) {
            errors.push(syn::Error::new(
                *span,
                format!(
                    "column `{}` is already taken by field `{}`: map one of the two to another column with #[outbox(column = \"...\")]",
                    field.column, first.ident
                ),
            ));
        }
    }
}
