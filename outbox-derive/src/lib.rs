//! `#[derive(Outbox)]`: turns an event struct into a typed PostgreSQL outbox table.
//!
//! The macro works in stages, each in its own module:
//! `attr` parses `#[outbox(..)]` attributes, `model` validates them into a model
//! of the table, `sql` renders every statement and migration as text, and
//! `expand` generates the code. Errors are accumulated, each spanned at the
//! offending token, so one compile shows every mistake.
//!
//! Use it through the `outbox` crate, which documents the attributes.

mod attr;
mod expand;
mod model;
mod sql;

use proc_macro::TokenStream;
use syn::{DeriveInput, parse_macro_input};

/// Derives `outbox::Outbox` for a struct with named fields. See the `outbox` crate.
#[proc_macro_derive(Outbox, attributes(outbox))]
pub fn derive_outbox(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    model::Model::from_input(&input)
        .map_or_else(syn::Error::into_compile_error, |model| {
            expand::expand(&model)
        })
        .into()
}
