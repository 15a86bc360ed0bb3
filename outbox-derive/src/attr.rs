//! Stage 1: the raw `#[outbox(..)]` attributes, parsed but not yet validated.

use proc_macro2::{TokenStream, TokenTree};
use syn::meta::ParseNestedMeta;
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, Ident, LitInt, LitStr, Token};

/// Accumulates errors so one compile reports every mistake.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn finish<T>(self, value: T) -> syn::Result<T> {
        self.0.map_or(Ok(value), Err)
    }

    /// Every message, in order.
    #[cfg(test)]
    pub(crate) fn messages(self) -> Vec<String> {
        self.0
            .into_iter()
            .flatten()
            .map(|e| e.to_string())
            .collect()
    }
}

pub(crate) const CONTAINER_KEYS: &[&str] = &[
    "table",
    "lease",
    "retry_delay",
    "max_attempts",
    "delete_sent",
    "dead_releases_key",
    "scheduled",
    "traced",
    "no_event_id_index",
    "crate",
];
pub(crate) const FIELD_KEYS: &[&str] = &["event_id", "key", "json", "column", "since"];

/// `#[outbox(..)]` on the struct.
#[derive(Default)]
pub(crate) struct ContainerAttrs {
    pub(crate) table: Option<LitStr>,
    pub(crate) lease: Option<LitStr>,
    pub(crate) retry_delay: Option<LitStr>,
    pub(crate) max_attempts: Option<LitInt>,
    pub(crate) delete_sent: Option<Ident>,
    pub(crate) dead_releases_key: Option<Ident>,
    /// `scheduled`, or `scheduled(since = N)`.
    pub(crate) scheduled: Option<OptIn>,
    /// `traced`, or `traced(since = N)`.
    pub(crate) traced: Option<OptIn>,
    /// `no_event_id_index`, or `no_event_id_index(since = N)`.
    pub(crate) no_event_id_index: Option<OptIn>,
    /// The path to the `outbox` crate, for a renamed or re-exported dependency.
    pub(crate) krate: Option<LitStr>,
}

/// A flag on the struct that changes the table (`scheduled`, `traced`: columns added;
/// `no_event_id_index`: an index dropped), with the `since` of a table that changes by a
/// later migration version.
pub(crate) struct OptIn {
    /// The flag as written, where an error about the flag itself points.
    pub(crate) flag: syn::Path,
    pub(crate) since: Option<LitInt>,
}

/// `#[outbox(..)]` on a field.
#[derive(Default)]
pub(crate) struct FieldAttrs {
    pub(crate) event_id: Option<Ident>,
    pub(crate) key: Option<Ident>,
    pub(crate) json: Option<Ident>,
    pub(crate) column: Option<LitStr>,
    pub(crate) since: Option<LitInt>,
}

/// Sets `slot` once; a repeated key is an error at its second occurrence.
fn set_once<T>(slot: &mut Option<T>, value: Option<T>, key: &syn::Path, errors: &mut Errors) {
    let Some(value) = value else { return };
    if slot.is_some() {
        errors.push(syn::Error::new_spanned(
            key,
            format!("`{}` is given twice; keep only one", key_name(key)),
        ));
    } else {
        *slot = Some(value);
    }
}

/// The key as written: `lease`, or a path such as `outbox::json`.
fn key_name(path: &syn::Path) -> String {
    let segments = path.segments.iter().map(|s| s.ident.to_string());
    let joined = segments.collect::<Vec<_>>().join("::");
    if path.leading_colon.is_some() {
        format!("::{joined}")
    } else {
        joined
    }
}

fn outbox_attrs(attrs: &[Attribute]) -> impl Iterator<Item = &Attribute> {
    attrs.iter().filter(|a| a.path().is_ident("outbox"))
}

/// Consumes whatever follows a key up to the next `,`: `= value`, `(..)`, or nothing.
fn skip_value(input: ParseStream<'_>) -> syn::Result<TokenStream> {
    let mut skipped = TokenStream::new();
    while !input.is_empty() && !input.peek(Token![,]) {
        skipped.extend([input.parse::<TokenTree>()?]);
    }
    Ok(skipped)
}

/// The value of `key = value`, which must parse as `T`. A missing or mistyped value
/// is recorded and skipped, so the attribute's other keys are still checked.
fn value<T: Parse>(
    meta: &ParseNestedMeta<'_>,
    kind: &str,
    example: &str,
    errors: &mut Errors,
) -> syn::Result<Option<T>> {
    let key = key_name(&meta.path);
    if !meta.input.peek(Token![=]) {
        skip_value(meta.input)?;
        errors.push(meta.error(format!("`{key}` needs a value: write `{key} = {example}`")));
        return Ok(None);
    }
    let input = meta.value()?;
    let ahead = input.fork();
    if ahead.parse::<T>().is_ok() && (ahead.is_empty() || ahead.peek(Token![,])) {
        return input.parse().map(Some);
    }
    let found = skip_value(input)?;
    let message = format!("`{key}` takes {kind}, as in `{key} = {example}`");
    errors.push(if found.is_empty() {
        meta.error(message)
    } else {
        syn::Error::new_spanned(found, message)
    });
    Ok(None)
}

/// A flag such as `json`: it takes no value. A value is recorded as an error and
/// skipped; the flag still counts, so its absence causes no further errors.
fn flag(meta: &ParseNestedMeta<'_>, errors: &mut Errors) -> syn::Result<Option<Ident>> {
    let key = key_name(&meta.path);
    let found = skip_value(meta.input)?;
    if !found.is_empty() {
        errors.push(syn::Error::new_spanned(
            found,
            format!("`{key}` is a flag and takes no value: write `#[outbox({key})]`"),
        ));
    }
    Ok(meta.path.get_ident().cloned())
}

/// `scheduled`, `traced` or `no_event_id_index`, alone or with `(since = N)`: a flag
/// with one optional key.
/// Anything else is recorded and skipped; the flag still counts.
fn opt_in(meta: &ParseNestedMeta<'_>, errors: &mut Errors) -> syn::Result<Option<OptIn>> {
    let key = key_name(&meta.path);
    let forms = format!(
        "write `#[outbox({key})]`, or `#[outbox({key}(since = 2))]` on a table created without it"
    );
    let mut since = None;
    if meta.input.peek(syn::token::Paren) {
        meta.parse_nested_meta(|inner| {
            if inner.path.is_ident("since") {
                let v = value(&inner, "an integer", "2", errors)?;
                set_once(&mut since, v, &inner.path, errors);
            } else {
                errors.push(syn::Error::new_spanned(
                    &inner.path,
                    format!("`{key}` takes only `since`: {forms}"),
                ));
                skip_value(inner.input)?;
            }
            Ok(())
        })?;
    } else {
        let found = skip_value(meta.input)?;
        if !found.is_empty() {
            errors.push(syn::Error::new_spanned(
                found,
                format!("`{key}` takes no value: {forms}"),
            ));
        }
    }
    Ok(Some(OptIn {
        flag: meta.path.clone(),
        since,
    }))
}

/// An unknown key: recorded with the valid ones, and skipped with its value. A key of
/// the other kind (a field key on the struct, or the reverse) says where it goes.
fn unknown(
    meta: &ParseNestedMeta<'_>,
    (on, keys): (&str, &[&str]),
    (other, misplaced): (&str, &[&str]),
    errors: &mut Errors,
) -> syn::Result<()> {
    let key = key_name(&meta.path);
    let listed = keys
        .iter()
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let hint = if misplaced.contains(&key.as_str()) {
        format!("; `{key}` goes on {other}, not on {on}")
    } else if let Some(near) = closest(&key, keys) {
        format!("; did you mean `{near}`?")
    } else {
        String::new()
    };
    errors.push(syn::Error::new_spanned(
        &meta.path,
        format!("unknown outbox attribute `{key}` on {on}: expected one of {listed}{hint}"),
    ));
    skip_value(meta.input).map(drop)
}

/// The key within two edits of `key` (a typo such as `tabel` or `retry_dealy`), if any.
fn closest<'k>(key: &str, keys: &[&'k str]) -> Option<&'k str> {
    keys.iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|&(d, _)| d <= 2)
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// Levenshtein distance: the fewest insertions, deletions and substitutions.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

pub(crate) fn parse_container(attrs: &[Attribute], errors: &mut Errors) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in outbox_attrs(attrs) {
        let result = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            if key.is_ident("table") {
                let v = value(&meta, "a string", "\"order_events\"", errors)?;
                set_once(&mut out.table, v, key, errors);
            } else if key.is_ident("lease") {
                let v = value(&meta, "a string", "\"30s\"", errors)?;
                set_once(&mut out.lease, v, key, errors);
            } else if key.is_ident("retry_delay") {
                let v = value(&meta, "a string", "\"1m\"", errors)?;
                set_once(&mut out.retry_delay, v, key, errors);
            } else if key.is_ident("max_attempts") {
                let v = value(&meta, "an integer", "10", errors)?;
                set_once(&mut out.max_attempts, v, key, errors);
            } else if key.is_ident("delete_sent") {
                let v = flag(&meta, errors)?;
                set_once(&mut out.delete_sent, v, key, errors);
            } else if key.is_ident("dead_releases_key") {
                let v = flag(&meta, errors)?;
                set_once(&mut out.dead_releases_key, v, key, errors);
            } else if key.is_ident("scheduled") {
                let v = opt_in(&meta, errors)?;
                set_once(&mut out.scheduled, v, key, errors);
            } else if key.is_ident("traced") {
                let v = opt_in(&meta, errors)?;
                set_once(&mut out.traced, v, key, errors);
            } else if key.is_ident("no_event_id_index") {
                let v = opt_in(&meta, errors)?;
                set_once(&mut out.no_event_id_index, v, key, errors);
            } else if key.is_ident("crate") {
                let v = value(&meta, "a string", "\"::outbox\"", errors)?;
                set_once(&mut out.krate, v, key, errors);
            } else {
                let here = ("the struct", CONTAINER_KEYS);
                unknown(&meta, here, ("a field", FIELD_KEYS), errors)?;
            }
            Ok(())
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    out
}

/// The path the generated code names the `outbox` crate by: `crate = ".."`, or
/// `::outbox`. A path that does not parse is an error at the string.
pub(crate) fn crate_path(attrs: &ContainerAttrs, errors: &mut Errors) -> syn::Path {
    let default = || syn::parse_quote!(::outbox);
    attrs.krate.as_ref().map_or_else(default, |lit| {
        lit.parse::<syn::Path>().unwrap_or_else(|e| {
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "`crate` is the path to the outbox crate, such as \"::outbox\" or \"::my_deps::outbox\": {e}"
                ),
            ));
            default()
        })
    })
}

pub(crate) fn parse_field(attrs: &[Attribute], errors: &mut Errors) -> FieldAttrs {
    let mut out = FieldAttrs::default();
    for attr in outbox_attrs(attrs) {
        let result = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            if key.is_ident("event_id") {
                let v = flag(&meta, errors)?;
                set_once(&mut out.event_id, v, key, errors);
            } else if key.is_ident("key") {
                let v = flag(&meta, errors)?;
                set_once(&mut out.key, v, key, errors);
            } else if key.is_ident("json") {
                let v = flag(&meta, errors)?;
                set_once(&mut out.json, v, key, errors);
            } else if key.is_ident("column") {
                let v = value(&meta, "a string", "\"name\"", errors)?;
                set_once(&mut out.column, v, key, errors);
            } else if key.is_ident("since") {
                let v = value(&meta, "an integer", "2", errors)?;
                set_once(&mut out.since, v, key, errors);
            } else {
                let here = ("a field", FIELD_KEYS);
                unknown(&meta, here, ("the struct", CONTAINER_KEYS), errors)?;
            }
            Ok(())
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_insertions_deletions_and_substitutions() {
        assert_eq!(edit_distance("table", "table"), 0);
        assert_eq!(edit_distance("", "lease"), 5);
        assert_eq!(edit_distance("lease", ""), 5);
        assert_eq!(edit_distance("tabel", "table"), 2);
        assert_eq!(edit_distance("lese", "lease"), 1);
        assert_eq!(edit_distance("leases", "lease"), 1);
        assert_eq!(edit_distance("lEase", "lease"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn closest_suggests_a_key_within_two_edits() {
        assert_eq!(closest("tabel", CONTAINER_KEYS), Some("table"));
        assert_eq!(closest("retry_dealy", CONTAINER_KEYS), Some("retry_delay"));
        assert_eq!(closest("max_attempt", CONTAINER_KEYS), Some("max_attempts"));
        assert_eq!(closest("jsn", FIELD_KEYS), Some("json"));
        assert_eq!(closest("columns", FIELD_KEYS), Some("column"));
        assert_eq!(closest("eventid", FIELD_KEYS), Some("event_id"));
        // Three edits or more: no guess.
        assert_eq!(closest("name", CONTAINER_KEYS), None);
        assert_eq!(closest("nullable", FIELD_KEYS), None);
    }

    #[test]
    fn closest_prefers_the_nearest_key_then_the_first() {
        assert_eq!(closest("abx", &["abcd", "ab"]), Some("ab"));
        assert_eq!(closest("ab", &["abc", "ab_"]), Some("abc"));
    }
}
