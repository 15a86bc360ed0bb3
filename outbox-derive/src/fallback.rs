//! When the input has errors: the errors, and beside them a stand-in implementation,
//! so that the type's uses elsewhere in the crate (`T::claim`, `event.enqueue(..)`,
//! a `T: Outbox` bound) compile as if the derive had worked and only the input's own
//! errors are reported, not a cascade of missing items. Its bodies are never run: the
//! crate does not compile.

use std::time::Duration;

use proc_macro2::TokenStream;
use quote::quote;
use syn::DeriveInput;

use crate::expand;
use crate::model::Model;

/// `errors` as compile errors, with the stand-in when the type can have one: not for a
/// generic type or one that borrows, whose parameters the impl would have to name (their
/// error says the type cannot be an event at all).
pub(crate) fn fallback(input: &DeriveInput, errors: syn::Error) -> TokenStream {
    let mut out = errors.into_compile_error();
    if input.generics.params.is_empty() {
        out.extend(stand_in(input));
    }
    out
}

/// `impl Outbox` with an empty `SPEC` and functions that panic, and the inherent
/// methods `expand` generates (so their signatures have one source), for a model
/// without table or fields.
fn stand_in(input: &DeriveInput) -> TokenStream {
    // The attributes' errors are already reported: only the crate's path is wanted.
    let mut reported = crate::attr::Errors::default();
    let attrs = crate::attr::parse_container(&input.attrs, &mut reported);
    let krate = crate::attr::crate_path(&attrs, &mut reported);
    let p = quote!(#krate::__private);
    let ident = &input.ident;
    let model = Model {
        ident: ident.clone(),
        krate,
        table: String::new(),
        history_table: String::new(),
        lease: Duration::ZERO,
        retry_delay: Duration::ZERO,
        max_attempts: 0,
        sent: crate::model::Sent::Keep,
        dead: crate::model::Dead::HoldsKey,
        event_id: None,
        fields: Vec::new(),
        // The methods a scheduled type has, so that calls of them report nothing more.
        scheduled: attrs.scheduled.as_ref().map(|_| 1),
        traced: None,
        no_event_id_index: None,
    };
    let inherent = expand::inherent_methods(&p, &model);
    // A value, not a panic: a constant that reads `T::SPEC` is evaluated even in a crate
    // that does not compile, and would report the panic as an error of its own.
    let statements = std::iter::repeat_n("", outbox_internals::Statement::COUNT);
    quote! {
        #[automatically_derived]
        impl #p::Outbox for #ident {
            const SPEC: &'static #p::TableSpec = &#p::derive_only_table_spec(
                "",
                "",
                #p::Duration::ZERO,
                #p::Duration::ZERO,
                0,
                ::core::option::Option::None,
                false,
                false,
                false,
                true,
                #p::derive_only_statements([#(#statements),*], &[], &[], &[]),
                &[],
                &[],
            );

            fn only_derive_is_allowed_to_implement_this_trait() {}

            fn event_id(&self) -> ::core::option::Option<#p::EventId> {
                ::core::unimplemented!()
            }

            fn bind<'q>(&'q self, _: #p::PgQuery<'q>) -> #p::PgQuery<'q> {
                ::core::unimplemented!()
            }

            fn bind_all<'q>(_: &'q [Self], _: #p::PgQuery<'q>) -> #p::PgQuery<'q> {
                ::core::unimplemented!()
            }

            fn decode(_: &#p::PgRow, _: &::core::primitive::str) -> ::core::result::Result<Self, #p::sqlx::Error> {
                ::core::unimplemented!()
            }
        }

        #inherent
    }
}
