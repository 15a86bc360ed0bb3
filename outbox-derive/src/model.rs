//! Stage 2: the validated model of an outbox table. Every rule that keeps the SQL
//! sound is enforced here, with an error spanned at the token that breaks it.

use std::time::Duration;

use proc_macro2::Span;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, GenericArgument, Ident, LitInt, LitStr, PathArguments, Type};

use crate::attr::{self, Errors};

/// PostgreSQL truncates longer identifiers, so we refuse them instead.
const MAX_IDENTIFIER: usize = 63;
const HISTORY_PREFIX: &str = "_outbox_history_";

/// Columns every outbox table has; a field may not take one of these names.
pub(crate) const RESERVED_COLUMNS: &[&str] = &[
    "id",
    "event_id",
    "status",
    "generation",
    "attempts",
    "lease_until",
    "next_attempt_at",
    "last_error",
    "created_at",
];

/// Not a column: the claim statement returns it beside the payload columns.
const RESERVED_RESULT: &str = "outbox_reclaimed";

/// PostgreSQL's system columns: `CREATE TABLE` refuses a column with one of these names.
const SYSTEM_COLUMNS: &[&str] = &["tableoid", "xmin", "cmin", "xmax", "cmax", "ctid"];

/// Integer types PostgreSQL has no column type for (no unsigned, 8- or 128-bit integers).
const UNMAPPED_INTEGERS: &[&str] = &[
    "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i128", "isize",
];

pub(crate) struct Model {
    pub(crate) ident: Ident,
    pub(crate) table: String,
    pub(crate) history_table: String,
    pub(crate) lease: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) max_attempts: i32,
    pub(crate) event_id: Option<EventIdField>,
    pub(crate) fields: Vec<Field>,
}

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
    pub(crate) sql_type: SqlType,
    /// `Some(inner)` for `Option<inner>`: the column is nullable.
    pub(crate) option_of: Option<Type>,
    /// Stored as jsonb through `sqlx::types::Json`.
    pub(crate) json: bool,
    /// The migration version that adds the column (1: the `CREATE TABLE`).
    pub(crate) since: u32,
}

/// A column type: how it is declared, and how `format_type()` prints it back.
#[derive(Clone, Copy)]
pub(crate) struct SqlType {
    pub(crate) ddl: &'static str,
    pub(crate) catalog: &'static str,
}

impl SqlType {
    /// Dates and times: the types chrono and time both map.
    pub(crate) fn is_date_time(self) -> bool {
        matches!(self.ddl, "date" | "time" | "timestamp" | "timestamptz")
    }
}

const fn sql_type(ddl: &'static str, catalog: &'static str) -> SqlType {
    SqlType { ddl, catalog }
}

const JSONB: SqlType = sql_type("jsonb", "jsonb");

/// The column type of a Rust type, by the last segment of its path.
fn native_sql_type(ty: &Type) -> Option<SqlType> {
    let segment = last_segment(ty)?;
    let name = segment.ident.to_string();
    Some(match name.as_str() {
        "i16" => sql_type("smallint", "smallint"),
        "i32" => sql_type("integer", "integer"),
        "i64" => sql_type("bigint", "bigint"),
        "f32" => sql_type("real", "real"),
        "f64" => sql_type("double precision", "double precision"),
        "bool" => sql_type("boolean", "boolean"),
        "String" => sql_type("text", "text"),
        "Uuid" => sql_type("uuid", "uuid"),
        "NaiveDate" | "Date" => sql_type("date", "date"),
        "NaiveTime" | "Time" => sql_type("time", "time without time zone"),
        "NaiveDateTime" | "PrimitiveDateTime" => {
            sql_type("timestamp", "timestamp without time zone")
        }
        "DateTime" | "OffsetDateTime" => sql_type("timestamptz", "timestamp with time zone"),
        "Value" | "JsonValue" => JSONB,
        "Vec" if generic_arg(segment).is_some_and(|t| is_ident(t, "u8")) => {
            sql_type("bytea", "bytea")
        }
        _ => return None,
    })
}

fn last_segment(ty: &Type) -> Option<&syn::PathSegment> {
    match ty {
        Type::Path(p) if p.qself.is_none() => p.path.segments.last(),
        Type::Group(g) => last_segment(&g.elem),
        _ => None,
    }
}

fn generic_arg(segment: &syn::PathSegment) -> Option<&Type> {
    match &segment.arguments {
        PathArguments::AngleBracketed(args) if args.args.len() == 1 => match &args.args[0] {
            GenericArgument::Type(ty) => Some(ty),
            _ => None,
        },
        _ => None,
    }
}

fn is_ident(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_none())
}

/// `Some(T)` for `Option<T>`.
fn option_inner(ty: &Type) -> Option<&Type> {
    last_segment(ty)
        .filter(|s| s.ident == "Option")
        .and_then(generic_arg)
}

/// A plain lowercase SQL identifier: nothing to quote, nothing to inject.
fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Where a table or column name comes from, for the error that rejects it.
enum NameSource<'a> {
    /// Written as `key = "name"`.
    Attribute(&'a LitStr),
    /// Derived from the name of a Rust `item` (`"struct"` or `"field"`); `key` sets it.
    Item {
        ident: &'a Ident,
        item: &'a str,
        key: &'a str,
    },
}

/// `name` if it is a plain identifier PostgreSQL keeps as written; an error otherwise.
fn check_identifier(
    name: String,
    what: &str,
    source: &NameSource<'_>,
    errors: &mut Errors,
) -> Option<String> {
    const PLAIN: &str = "lowercase ASCII letters, digits and `_`, not starting with a digit";
    let too_long = name.len() > MAX_IDENTIFIER;
    if is_plain_identifier(&name) && !too_long {
        return Some(name);
    }
    let limit = format!(
        "is {} bytes long: PostgreSQL identifiers are at most {MAX_IDENTIFIER} bytes",
        name.len()
    );
    let (span, message) = match source {
        NameSource::Attribute(lit) if too_long && is_plain_identifier(&name) => {
            (lit.span(), format!("{what} `{name}` {limit}; shorten it"))
        }
        NameSource::Attribute(lit) => {
            let example = plain_suggestion(&name)
                .map(|s| format!(", as in `{s}`"))
                .unwrap_or_default();
            let message =
                format!("{what} `{name}` is not a plain identifier: use {PLAIN}{example}");
            (lit.span(), message)
        }
        NameSource::Item { ident, item, key } => {
            let problem = if is_plain_identifier(&name) {
                limit
            } else {
                format!("is not a plain identifier ({PLAIN})")
            };
            let message = format!(
                "{what} `{name}`, derived from the {item} name, {problem}; set one with #[outbox({key} = \"...\")]"
            );
            (ident.span(), message)
        }
    };
    errors.push(syn::Error::new(span, message));
    None
}

/// The plain identifier a rejected name was probably meant to be: `OrderEvents`,
/// `"order_events"` and `order-events` all suggest `order_events`.
fn plain_suggestion(name: &str) -> Option<String> {
    let mut out = String::new();
    let mut prev: Option<char> = None;
    for c in name.trim().trim_matches('"').chars() {
        if c.is_ascii_uppercase() {
            if prev.is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit()) {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else if c == '-' || c == ' ' {
            out.push('_');
        } else {
            out.push(c);
        }
        prev = Some(c);
    }
    (is_plain_identifier(&out) && out.len() <= MAX_IDENTIFIER && out != name).then_some(out)
}

/// The shortest duration a key accepts, and why.
struct Floor {
    min: Duration,
    message: &'static str,
}

/// A claim must outlive its renewal: the relay renews every third of the lease, and each
/// renewal needs a database round trip, scheduling jitter included, before the lease ends.
const LEASE_FLOOR: Floor = Floor {
    min: Duration::from_secs(1),
    message: "`lease` must be at least 1s: the relay renews a claim every third of its lease, \
              and each renewal must complete a database round trip before the lease ends; \
              a lease is also how long a crashed publisher's events wait to be claimed again, \
              so typical values are 10s to 5m",
};

const RETRY_DELAY_FLOOR: Floor = Floor {
    min: Duration::from_nanos(1),
    message: "`retry_delay` must be greater than zero: a failed event would be due again at once, in a hot loop",
};

fn parse_duration(
    lit: Option<&LitStr>,
    key: &str,
    default: Duration,
    floor: &Floor,
    errors: &mut Errors,
) -> Duration {
    let Some(lit) = lit else { return default };
    match humantime::parse_duration(&lit.value()) {
        Ok(d) if d < floor.min => {
            errors.push(syn::Error::new(lit.span(), floor.message));
            default
        }
        Ok(d) if d.as_micros() > u128::from(i64::MAX.unsigned_abs()) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "`{key}` is longer than a PostgreSQL interval can be (about 292,000 years)"
                ),
            ));
            default
        }
        Ok(d) if d.subsec_micros() * 1000 != d.subsec_nanos() => {
            errors.push(syn::Error::new(lit.span(), format!("`{key}` must be a whole number of microseconds, PostgreSQL's interval precision")));
            default
        }
        Ok(d) => d,
        Err(e) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!("invalid `{key}` duration {:?}: {e}; write it like \"30s\", \"1m\" or \"1h 30m\"", lit.value()),
            ));
            default
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

/// `_outbox_history_<table>`, shortened with a stable hash when it would exceed the limit.
fn history_table(table: &str) -> String {
    let name = format!("{HISTORY_PREFIX}{table}");
    if name.len() <= MAX_IDENTIFIER {
        return name;
    }
    // FNV-1a: stable across compilers, unlike std's hasher.
    let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let keep = MAX_IDENTIFIER - HISTORY_PREFIX.len() - 9;
    format!("{HISTORY_PREFIX}{}_{:08x}", &table[..keep], hash >> 32)
}

fn snake_case(ident: &Ident) -> String {
    let mut out = String::new();
    for (i, c) in ident.unraw().to_string().chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

impl Model {
    pub(crate) fn from_input(input: &DeriveInput) -> syn::Result<Self> {
        let mut errors = Errors::default();
        let attrs = attr::parse_container(&input.attrs, &mut errors);

        let named = named_fields(input, &mut errors);

        let (name, source) = match &attrs.table {
            Some(lit) => (lit.value(), NameSource::Attribute(lit)),
            None => (
                snake_case(&input.ident),
                NameSource::Item {
                    ident: &input.ident,
                    item: "struct",
                    key: "table",
                },
            ),
        };
        let table = check_identifier(name, "table name", &source, &mut errors).unwrap_or_default();
        let lease = parse_duration(
            attrs.lease.as_ref(),
            "lease",
            Duration::from_secs(30),
            &LEASE_FLOOR,
            &mut errors,
        );
        let retry_delay = parse_duration(
            attrs.retry_delay.as_ref(),
            "retry_delay",
            Duration::from_mins(1),
            &RETRY_DELAY_FLOOR,
            &mut errors,
        );
        let max_attempts = parse_max_attempts(attrs.max_attempts.as_ref(), &mut errors);

        let mut event_id: Option<EventIdField> = None;
        let mut fields = Vec::new();
        let mut column_spans = Vec::new();
        for field in named.into_iter().flat_map(|n| &n.named) {
            let Some(ident) = field.ident.clone() else {
                continue;
            };
            let fattrs = attr::parse_field(&field.attrs, &mut errors);
            if let Some(flag) = &fattrs.event_id {
                validate_event_id(field, &fattrs, &mut errors);
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
            if let Some(f) = Field::from_syn(ident, field, &fattrs, &input.generics, &mut errors) {
                fields.push(f);
                column_spans.push(column_span);
            }
        }
        check_column_names(&fields, &column_spans, &mut errors);

        errors.finish(Self {
            ident: input.ident.clone(),
            history_table: history_table(&table),
            table,
            lease,
            retry_delay,
            max_attempts,
            event_id,
            fields,
        })
    }

    /// Migration versions beyond 1, in order.
    pub(crate) fn later_versions(&self) -> Vec<u32> {
        let mut versions: Vec<u32> = self
            .fields
            .iter()
            .map(|f| f.since)
            .filter(|&v| v > 1)
            .collect();
        versions.sort_unstable();
        versions.dedup();
        versions
    }
}

/// The struct's named fields; anything else an outbox event cannot be is an error.
fn named_fields<'a>(input: &'a DeriveInput, errors: &mut Errors) -> Option<&'a syn::FieldsNamed> {
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

fn validate_event_id(field: &syn::Field, attrs: &attr::FieldAttrs, errors: &mut Errors) {
    const SUPPORTED: &[&str] = &["String", "Uuid", "i64", "i32"];
    if !SUPPORTED.iter().any(|name| is_ident(&field.ty, name)) {
        errors.push(syn::Error::new_spanned(
            &field.ty,
            "an `event_id` field must be `String`, `uuid::Uuid`, `i64` or `i32`: a stable value that never changes across retries",
        ));
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

impl Field {
    /// The field and its column, or `None` after recording every error it has.
    fn from_syn(
        ident: Ident,
        field: &syn::Field,
        attrs: &attr::FieldAttrs,
        generics: &syn::Generics,
        errors: &mut Errors,
    ) -> Option<Self> {
        let column = column_name(&ident, attrs, errors);
        let option_of = option_inner(&field.ty).cloned();
        let json = attrs.json.is_some();
        let sql_type = if json {
            Some(JSONB)
        } else {
            let ty = option_of.as_ref().unwrap_or(&field.ty);
            let found = native_sql_type(ty);
            if found.is_none() && !is_type_param(ty, generics) {
                errors.push(syn::Error::new_spanned(ty, unmapped_type(ty)));
            }
            found
        };

        let since = match &attrs.since {
            None => Some(1),
            Some(lit) => match lit.base10_parse::<i32>() {
                Ok(v) if v >= 2 && option_of.is_some() => Some(v.unsigned_abs()),
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
            },
        };
        Some(Self {
            ident,
            ty: field.ty.clone(),
            column: column?,
            sql_type: sql_type?,
            option_of,
            json,
            since: since?,
        })
    }

    pub(crate) fn nullable(&self) -> bool {
        self.option_of.is_some()
    }
}

/// The column of a payload field: `column = ".."`, or the field's name.
fn column_name(ident: &Ident, attrs: &attr::FieldAttrs, errors: &mut Errors) -> Option<String> {
    let (name, source) = match &attrs.column {
        Some(lit) => (lit.value(), NameSource::Attribute(lit)),
        None => (
            ident.unraw().to_string(),
            NameSource::Item {
                ident,
                item: "field",
                key: "column",
            },
        ),
    };
    let column = check_identifier(name, "column name", &source, errors)?;
    let span = match source {
        NameSource::Attribute(lit) => lit.span(),
        NameSource::Item { .. } => ident.span(),
    };
    let fix = if attrs.column.is_some() {
        "choose another name"
    } else if column == "event_id" {
        "to make this field the event's stable id, mark it #[outbox(event_id)]; otherwise name its column with #[outbox(column = \"...\")]"
    } else {
        "name its column with #[outbox(column = \"...\")]"
    };
    let problem = if RESERVED_COLUMNS.contains(&column.as_str()) {
        format!(
            "is reserved for the outbox's own bookkeeping ({})",
            RESERVED_COLUMNS.join(", ")
        )
    } else if column == RESERVED_RESULT {
        format!("is reserved: the claim statement returns `{RESERVED_RESULT}` beside the payload")
    } else if SYSTEM_COLUMNS.contains(&column.as_str()) {
        format!(
            "is a PostgreSQL system column ({}), which no table can declare",
            SYSTEM_COLUMNS.join(", ")
        )
    } else {
        return Some(column);
    };
    errors.push(syn::Error::new(
        span,
        format!("column `{column}` {problem}: {fix}"),
    ));
    None
}

/// Whether `ty` is one of the struct's own type parameters, already reported.
fn is_type_param(ty: &Type, generics: &syn::Generics) -> bool {
    generics.type_params().any(
        |param| matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.is_ident(&param.ident)),
    )
}

/// Why `ty` has no column type, and what to write instead.
fn unmapped_type(ty: &Type) -> String {
    if let Type::Reference(_) = ty {
        return "a field cannot borrow: an event is decoded from a row, so it owns its data; use `String` for `&str`, `Vec<u8>` for `&[u8]`".to_owned();
    }
    if let Some(name) = UNMAPPED_INTEGERS.iter().find(|name| is_ident(ty, name)) {
        return format!(
            "`{name}` has no PostgreSQL column type (PostgreSQL has no unsigned, 8-bit or 128-bit integers): use `i16`, `i32` or `i64`"
        );
    }
    let this =
        last_segment(ty).map_or_else(|| "this type".to_owned(), |s| format!("`{}`", s.ident));
    format!(
        "{this} has no PostgreSQL column type: mark the field #[outbox(json)] to store it as jsonb \
         ({this} must implement serde's Serialize and Deserialize), or use one of i16, i32, i64, \
         f32, f64, bool, String, Vec<u8>, uuid::Uuid, a chrono or time date, time or timestamp, \
         serde_json::Value, or an Option of one of these"
    )
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
