//! Stage 1: the raw `#[outbox(..)]` attributes, parsed but not yet validated.

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
}

pub(crate) const CONTAINER_KEYS: &str = "`table`, `lease`, `retry_delay`, `max_attempts`";
pub(crate) const FIELD_KEYS: &str = "`event_id`, `json`, `column`, `since`";

/// `#[outbox(..)]` on the struct.
#[derive(Default)]
pub(crate) struct ContainerAttrs {
    pub(crate) table: Option<LitStr>,
    pub(crate) lease: Option<LitStr>,
    pub(crate) retry_delay: Option<LitStr>,
    pub(crate) max_attempts: Option<LitInt>,
}

/// `#[outbox(..)]` on a field.
#[derive(Default)]
pub(crate) struct FieldAttrs {
    pub(crate) event_id: Option<Ident>,
    pub(crate) json: Option<Ident>,
    pub(crate) column: Option<LitStr>,
    pub(crate) since: Option<LitInt>,
}

/// Sets `slot` once; a repeated key is an error at its second occurrence.
fn set_once<T>(slot: &mut Option<T>, value: T, key: &syn::Path, errors: &mut Errors) {
    if slot.is_some() {
        errors.push(syn::Error::new_spanned(
            key,
            format!("duplicate `{}` attribute", key_name(key)),
        ));
    } else {
        *slot = Some(value);
    }
}

fn key_name(path: &syn::Path) -> String {
    path.get_ident()
        .map_or_else(|| "?".into(), ToString::to_string)
}

fn outbox_attrs(attrs: &[Attribute]) -> impl Iterator<Item = &Attribute> {
    attrs.iter().filter(|a| a.path().is_ident("outbox"))
}

pub(crate) fn parse_container(attrs: &[Attribute], errors: &mut Errors) -> ContainerAttrs {
    let mut out = ContainerAttrs::default();
    for attr in outbox_attrs(attrs) {
        let result = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            if key.is_ident("table") {
                set_once(&mut out.table, meta.value()?.parse()?, key, errors);
            } else if key.is_ident("lease") {
                set_once(&mut out.lease, meta.value()?.parse()?, key, errors);
            } else if key.is_ident("retry_delay") {
                set_once(&mut out.retry_delay, meta.value()?.parse()?, key, errors);
            } else if key.is_ident("max_attempts") {
                set_once(&mut out.max_attempts, meta.value()?.parse()?, key, errors);
            } else {
                return Err(meta.error(format!(
                    "unknown outbox attribute `{}`; expected one of {CONTAINER_KEYS}",
                    key_name(key)
                )));
            }
            Ok(())
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    out
}

pub(crate) fn parse_field(attrs: &[Attribute], errors: &mut Errors) -> FieldAttrs {
    let mut out = FieldAttrs::default();
    for attr in outbox_attrs(attrs) {
        let result = attr.parse_nested_meta(|meta| {
            let key = &meta.path;
            let flag = || {
                key.get_ident()
                    .cloned()
                    .ok_or_else(|| meta.error("expected an identifier"))
            };
            if key.is_ident("event_id") {
                set_once(&mut out.event_id, flag()?, key, errors);
            } else if key.is_ident("json") {
                set_once(&mut out.json, flag()?, key, errors);
            } else if key.is_ident("column") {
                set_once(&mut out.column, meta.value()?.parse()?, key, errors);
            } else if key.is_ident("since") {
                set_once(&mut out.since, meta.value()?.parse()?, key, errors);
            } else {
                return Err(meta.error(format!(
                    "unknown outbox field attribute `{}`; expected one of {FIELD_KEYS}",
                    key_name(key)
                )));
            }
            if meta.input.peek(Token![=]) {
                return Err(syn::Error::new(
                    meta.input.span(),
                    format!("`{}` takes no value", key_name(key)),
                ));
            }
            Ok(())
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    out
}
