//! Identifier rules and names: the table's name, each column's, and the history
//! table's. Every name is a plain lowercase SQL identifier PostgreSQL keeps as written,
//! and no column takes a name the outbox or PostgreSQL already uses.

use syn::ext::IdentExt;
use syn::{Ident, LitStr};

use outbox_internals::{
    BOOKKEEPING, HISTORY_PREFIX, MAX_IDENTIFIER, OWN_TABLES, PUBLISH_AT, REFINERY_HISTORY,
    STATEMENT_STEPS, TRACED, claim_header, is_plain_identifier,
};

use crate::attr::{self, Errors};

/// Not a column: the claim statement returns it beside the payload columns.
const RESERVED_RESULTS: [&str; 3] = [
    claim_header::RECLAIMED_NAME,
    claim_header::KEY_NAME,
    claim_header::REACH_NAME,
];

/// PostgreSQL's system columns: `CREATE TABLE` refuses a column with one of these names.
const SYSTEM_COLUMNS: &[&str] = &["tableoid", "xmin", "cmin", "xmax", "cmax", "ctid"];

/// The table's name: `table = ".."`, or the struct's name in snake case. Empty after
/// reporting a name that is not a plain identifier.
pub(crate) fn table_name(ident: &Ident, attr: Option<&LitStr>, errors: &mut Errors) -> String {
    let (name, source) = match attr {
        Some(lit) => (lit.value(), NameSource::Attribute(lit)),
        None => (
            snake_case(ident),
            NameSource::Item {
                ident,
                item: "struct",
                key: "table",
            },
        ),
    };
    let Some(table) = check_identifier(name, "table name", &source, errors) else {
        return String::new();
    };
    let problem = if OWN_TABLES.contains(&table.as_str()) {
        format!(
            "is one of the outbox's own tables ({})",
            OWN_TABLES.join(", ")
        )
    } else if STATEMENT_STEPS.contains(&table.as_str()) {
        format!(
            "names a step of the generated statements (`WITH {table} AS (..)`), which would \
             stand for the table inside them"
        )
    } else if table == REFINERY_HISTORY {
        "is where refinery records an application's applied migrations by default".to_owned()
    } else if table.starts_with(HISTORY_PREFIX) {
        format!("starts with `{HISTORY_PREFIX}`, which names the tables of applied migrations")
    } else {
        return table;
    };
    let (span, fix) = match source {
        NameSource::Attribute(lit) => (lit.span(), "choose another name"),
        NameSource::Item { ident, .. } => (
            ident.span(),
            "name the table with #[outbox(table = \"...\")]",
        ),
    };
    errors.push(syn::Error::new(
        span,
        format!("table name `{table}` {problem}: {fix}"),
    ));
    String::new()
}

/// The column of a payload field: `column = ".."`, or the field's name.
pub(crate) fn column_name(
    ident: &Ident,
    attrs: &attr::FieldAttrs,
    errors: &mut Errors,
) -> Option<String> {
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
    let Some(problem) = taken(&column) else {
        return Some(column);
    };
    errors.push(syn::Error::new(
        span,
        format!("column `{column}` {problem}: {fix}"),
    ));
    None
}

/// Why no field may use `column`, if it is a name the outbox or PostgreSQL has taken.
fn taken(column: &str) -> Option<String> {
    Some(if BOOKKEEPING.iter().any(|c| c.name == column) {
        let names: Vec<&str> = BOOKKEEPING.iter().map(|c| c.name).collect();
        format!(
            "is reserved for the outbox's own bookkeeping ({})",
            names.join(", ")
        )
    } else if column == PUBLISH_AT.name {
        "is reserved for the time a scheduled event is due (`#[outbox(scheduled)]`)".to_owned()
    } else if TRACED.iter().any(|c| c.name == column) {
        "is reserved for the trace context an event was enqueued in (`#[outbox(traced)]`)"
            .to_owned()
    } else if RESERVED_RESULTS.contains(&column) {
        format!("is reserved: the claim statement returns `{column}` beside the payload")
    } else if SYSTEM_COLUMNS.contains(&column) {
        format!(
            "is a PostgreSQL system column ({}), which no table can declare",
            SYSTEM_COLUMNS.join(", ")
        )
    } else {
        return None;
    })
}

/// `_outbox_history_<table>`, shortened with a stable hash when it would exceed the limit.
///
/// Deployed databases keep each table's applied migrations under this name: a change
/// to its output orphans every deployment's history (`outbox::migrate` would find none
/// and create the table again). The unit tests pin it.
pub(crate) fn history_table(table: &str) -> String {
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

/// `OrderPlaced` → `order_placed`: the default table name.
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
            // The schema is the connection's: a qualified name is not for the derive.
            let schema = if name.contains('.') {
                "; the schema is not part of the name: it is the connection's `search_path`"
            } else {
                ""
            };
            let message =
                format!("{what} `{name}` is not a plain identifier: use {PLAIN}{example}{schema}");
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

#[cfg(test)]
mod tests {
    use proc_macro2::Span;
    use syn::parse_quote;

    use super::*;

    // These names are where every deployment keeps its applied migrations: if one of
    // these assertions fails, the change orphans those histories (`outbox::migrate`
    // would no longer find them). Do not update the expected values; revert the change.
    #[test]
    fn history_table_of_a_short_table_is_pinned() {
        assert_eq!(
            history_table("order_events"),
            "_outbox_history_order_events"
        );
        // 47 bytes of table name: the longest that fits whole in 63 bytes.
        let longest = "a".repeat(47);
        assert_eq!(
            history_table(&longest),
            format!("_outbox_history_{longest}")
        );
        assert_eq!(history_table(&longest).len(), 63);
    }

    #[test]
    fn history_table_of_a_long_table_is_pinned() {
        // Longer names keep their first 38 bytes and add 8 hex digits of their FNV-1a hash.
        let long = "order_events_of_the_european_webshop_and_its_partner_stores";
        assert_eq!(
            history_table(long),
            "_outbox_history_order_events_of_the_european_webshop_a_d414021c"
        );
        assert_eq!(
            history_table(&"a".repeat(48)),
            "_outbox_history_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_b4fb5d9e"
        );
        assert_eq!(
            history_table(&"a".repeat(63)),
            "_outbox_history_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_51c1e07b"
        );
        for table in [long, &"a".repeat(48), &"a".repeat(63)] {
            assert_eq!(history_table(table).len(), MAX_IDENTIFIER);
        }
    }

    #[test]
    fn snake_case_of_a_struct_name() {
        let cases: [(Ident, &str); 5] = [
            (parse_quote!(OrderPlaced), "order_placed"),
            (parse_quote!(Ping), "ping"),
            (parse_quote!(already_snake), "already_snake"),
            (parse_quote!(HTTPRequest), "h_t_t_p_request"),
            (parse_quote!(r#Type), "type"),
        ];
        for (ident, expected) in cases {
            assert_eq!(snake_case(&ident), expected);
        }
    }

    #[test]
    fn plain_identifiers() {
        for name in ["order_events", "_private", "v2", "a", &"a".repeat(200)] {
            assert!(is_plain_identifier(name), "{name}");
        }
        let rejected = [
            "",
            "Order",
            "2fast",
            "order-events",
            "order events",
            "\"q\"",
            "été",
        ];
        for name in rejected {
            assert!(!is_plain_identifier(name), "{name}");
        }
    }

    #[test]
    fn plain_suggestion_of_a_rejected_name() {
        let cases = [
            ("OrderEvents", Some("order_events")),
            ("\"order_events\"", Some("order_events")),
            ("order-events", Some("order_events")),
            (" order events ", Some("order_events")),
            ("Order2Events", Some("order2_events")),
            ("HTTP", Some("http")),
            // Nothing plain to suggest, or nothing to change.
            ("2fast", None),
            ("orders; DROP TABLE x", None),
            ("order_events", None),
            (&"A".repeat(64), None),
        ];
        for (name, expected) in cases {
            assert_eq!(plain_suggestion(name).as_deref(), expected, "{name}");
        }
    }

    fn table_errors(attr: Option<&str>, ident: &Ident) -> (String, Vec<String>) {
        let lit = attr.map(|s| LitStr::new(s, Span::call_site()));
        let mut errors = Errors::default();
        let table = table_name(ident, lit.as_ref(), &mut errors);
        (table, errors.messages())
    }

    #[test]
    fn table_names() {
        let ident: Ident = parse_quote!(OrderPlaced);
        assert_eq!(table_errors(None, &ident), ("order_placed".into(), vec![]));
        let given = table_errors(Some("order_events"), &ident);
        assert_eq!(given, ("order_events".into(), vec![]));

        let (table, errors) = table_errors(Some("Order-Events"), &ident);
        assert_eq!(table, "");
        assert_eq!(
            errors,
            [
                "table name `Order-Events` is not a plain identifier: use lowercase ASCII letters, digits and `_`, not starting with a digit, as in `order_events`"
            ]
        );
        let (_, errors) = table_errors(Some(&"a".repeat(64)), &ident);
        assert_eq!(
            errors,
            [format!(
                "table name `{}` is 64 bytes long: PostgreSQL identifiers are at most 63 bytes; shorten it",
                "a".repeat(64)
            )]
        );
        let (_, errors) = table_errors(None, &format_ident(&format!("E{}", "x".repeat(63))));
        assert_eq!(
            errors,
            [format!(
                "table name `e{}`, derived from the struct name, is 64 bytes long: PostgreSQL identifiers are at most 63 bytes; set one with #[outbox(table = \"...\")]",
                "x".repeat(63)
            )]
        );

        // The outbox's own tables, and its history tables' prefix.
        let (table, errors) = table_errors(None, &parse_quote!(OutboxCatalog));
        assert_eq!(table, "");
        assert_eq!(
            errors,
            [
                "table name `outbox_catalog` is one of the outbox's own tables (outbox_catalog, outbox_inbox): name the table with #[outbox(table = \"...\")]"
            ]
        );
        let (_, errors) = table_errors(Some("_outbox_history_orders"), &ident);
        assert_eq!(
            errors,
            [
                "table name `_outbox_history_orders` starts with `_outbox_history_`, which names the tables of applied migrations: choose another name"
            ]
        );
    }

    fn format_ident(name: &str) -> Ident {
        syn::parse_str(name).unwrap()
    }

    fn column_errors(field: &str, column: Option<&str>) -> Vec<String> {
        let attrs = attr::FieldAttrs {
            column: column.map(|s| LitStr::new(s, Span::call_site())),
            ..attr::FieldAttrs::default()
        };
        let mut errors = Errors::default();
        let found = column_name(&format_ident(field), &attrs, &mut errors);
        let messages = errors.messages();
        assert_eq!(found.is_none(), !messages.is_empty());
        messages
    }

    #[test]
    fn column_names() {
        assert!(column_errors("customer", None).is_empty());
        assert!(column_errors("customer", Some("buyer")).is_empty());
        assert!(column_errors("r#type", None).is_empty());
        assert!(column_errors("status", Some("order_status")).is_empty());
        assert_eq!(
            column_errors("created", Some("created_at")),
            [
                "column `created_at` is reserved for the outbox's own bookkeeping (id, event_id, status, generation, attempts, lease_until, next_attempt_at, last_error, created_at): choose another name"
            ]
        );
        let event_id = column_errors("event_id", None);
        assert!(
            event_id[0].ends_with(": to make this field the event's stable id, mark it #[outbox(event_id)]; otherwise name its column with #[outbox(column = \"...\")]"),
            "{event_id:?}"
        );
        assert_eq!(
            column_errors("outbox_reclaimed", None),
            [
                "column `outbox_reclaimed` is reserved: the claim statement returns `outbox_reclaimed` beside the payload: name its column with #[outbox(column = \"...\")]"
            ]
        );
        assert_eq!(
            column_errors("xmin", None),
            [
                "column `xmin` is a PostgreSQL system column (tableoid, xmin, cmin, xmax, cmax, ctid), which no table can declare: name its column with #[outbox(column = \"...\")]"
            ]
        );
        assert_eq!(
            column_errors("Total", None),
            [
                "column name `Total`, derived from the field name, is not a plain identifier (lowercase ASCII letters, digits and `_`, not starting with a digit); set one with #[outbox(column = \"...\")]"
            ]
        );
    }
}
