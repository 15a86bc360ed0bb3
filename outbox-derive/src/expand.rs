//! Stage 4: code generation. Generated code names our dependencies only through
//! `::outbox::__private` (or the path `crate = ".."` gives), so users need not depend
//! on sqlx themselves.

use outbox_internals::{BOOKKEEPING, Statement};
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned as _;

use crate::fields::Field;
use crate::model::Model;
use crate::statements::{self, Definition, LIMIT, Table};

pub(crate) fn expand(model: &Model) -> TokenStream {
    let krate = &model.krate;
    let p = quote!(#krate::__private);
    let ident = &model.ident;
    let table_sql = Table::new(model);
    let definitions: Vec<Definition> = Statement::ALL
        .into_iter()
        .map(|statement| statements::define(statement, &table_sql))
        .collect();
    let statements = statements(&p, &table_sql, &definitions);
    let migrations = crate::sql::migrations(model);
    let (table, history_table, max_attempts) =
        (&model.table, &model.history_table, model.max_attempts);
    let lease = micros(model.lease);
    let retry_delay = micros(model.retry_delay);
    let deletes_sent = model.sent == crate::model::Sent::Delete;
    let scheduled = model.scheduled.is_some();
    let traced = model.traced.is_some();
    let event_id_unique = model.no_event_id_index.is_none();
    let key = model.key().map_or_else(
        || quote!(::core::option::Option::None),
        |f| {
            let column = &f.column;
            quote!(::core::option::Option::Some(#column))
        },
    );

    let columns = columns(&p, model);
    let steps = migrations
        .iter()
        .map(|(version, name, sql)| quote!(#p::MigrationStep { version: #version, name: #name, sql: #sql }));

    let event_id = model.event_id.as_ref().map_or_else(
        || quote!(::core::option::Option::None),
        |f| {
            let (field, ty) = (&f.ident, &f.ty);
            quote!(::core::option::Option::Some(<#ty as #p::EventIdField>::to_event_id(&self.#field)))
        },
    );
    let binds = model.fields.iter().map(|f| bind(&p, f));
    let bind_columns = model.fields.iter().map(|f| bind_column(&p, f));
    let decode_event_id = model.event_id.as_ref().map(|f| {
        let (field, ty) = (&f.ident, &f.ty);
        quote! {
            #field: <#ty as #p::EventIdField>::from_event_id(event_id).map_err(|source| #p::sqlx::Error::ColumnDecode {
                index: <::std::string::String as ::core::convert::From<&::core::primitive::str>>::from("event_id"),
                source,
            })?,
        }
    });
    let decodes = model.fields.iter().map(|f| decode(&p, f));
    let inherent = inherent_methods(&p, model);
    let checked = if cfg!(feature = "checked") {
        checked(model, &definitions)
    } else {
        TokenStream::new()
    };

    quote! {
        #[automatically_derived]
        impl #p::Outbox for #ident {
            const SPEC: &'static #p::TableSpec = &#p::derive_only_table_spec(
                #table,
                #history_table,
                #p::Duration::from_micros(#lease),
                #p::Duration::from_micros(#retry_delay),
                #max_attempts,
                #key,
                #deletes_sent,
                #scheduled,
                #traced,
                #event_id_unique,
                #statements,
                &[#(#columns),*],
                &[#(#steps),*],
            );

            fn only_derive_is_allowed_to_implement_this_trait() {}

            fn event_id(&self) -> ::core::option::Option<#p::EventId> {
                #event_id
            }

            fn bind<'q>(&'q self, query: #p::PgQuery<'q>) -> #p::PgQuery<'q> {
                #(#binds)*
                query
            }

            fn bind_all<'q>(events: &'q [Self], query: #p::PgQuery<'q>) -> #p::PgQuery<'q> {
                #(#bind_columns)*
                query
            }

            fn decode(row: &#p::PgRow, event_id: &::core::primitive::str) -> ::core::result::Result<Self, #p::sqlx::Error> {
                ::core::result::Result::Ok(Self {
                    #decode_event_id
                    #(#decodes)*
                })
            }
        }

        #inherent

        #checked
    }
}

/// With the `checked` feature: every statement once more, through sqlx's `query!`, in
/// a function that is never called. With `DATABASE_URL` (or sqlx's offline data) the
/// compiler then verifies the SQL the runtime executes against the live schema, and the
/// type of each field against its column through the enqueue statement's parameters.
/// (`query!` expands to `::sqlx` paths: the user's crate depends on sqlx.)
fn checked(model: &Model, definitions: &[Definition]) -> TokenStream {
    let ident = &model.ident;
    let checks = definitions.iter().map(|d| &d.checked);
    quote! {
        const _: () = {
            #[allow(dead_code, clippy::all, clippy::pedantic)]
            async fn checked(pool: &::sqlx::PgPool, event: &#ident) -> ::core::result::Result<(), ::sqlx::Error> {
                let (ids, texts): (&[::core::primitive::i64], &[::std::string::String]) = (&[], &[]);
                let delays: &[::std::time::Duration] = &[];
                #(#checks)*
                ::core::result::Result::Ok(())
            }
        };
    }
}

/// Every column the table must have: the bookkeeping ones, those the type's flags add,
/// then the event's.
fn columns(p: &TokenStream, model: &Model) -> Vec<TokenStream> {
    let column = |name: &str, ty: &str, nullable: bool| quote!(#p::Column { name: #name, sql_type: #ty, nullable: #nullable });
    BOOKKEEPING
        .iter()
        .map(|c| column(c.name, c.catalog_type, c.nullable))
        .chain(
            model
                .optional_columns()
                .into_iter()
                .map(|(_, c)| column(c.name, c.catalog_type, c.nullable)),
        )
        .chain(
            model
                .fields
                .iter()
                .map(|f| column(&f.column, f.sql_type.catalog, f.nullable())),
        )
        .collect()
}

/// `T::enqueue`, `T::claim`, `T::claim_batch`, `T::migrations`: inherent, so users need
/// not import a trait to call them.
pub(crate) fn inherent_methods(p: &TokenStream, model: &Model) -> TokenStream {
    let (ident, table) = (&model.ident, &model.table);
    let scheduled = if model.scheduled.is_some() {
        scheduled_methods(p, table)
    } else {
        TokenStream::new()
    };
    quote! {
        #[automatically_derived]
        impl #ident {
            #[doc = ::core::concat!("Writes this event into `", #table, "` through `executor`: pass the business transaction (`&mut *tx`) so both commit together. An event whose id is already there is not written again (`Enqueued::Duplicate`), and the transaction stays usable.")]
            pub async fn enqueue<'e>(
                &self,
                executor: impl #p::PgExecutor<'e>,
            ) -> ::core::result::Result<#p::Enqueued, #p::OutboxError> {
                #p::enqueue(self, executor).await
            }

            #[doc = ::core::concat!("Writes `events` into `", #table, "` in one statement (pass the business transaction), returning what happened to each, in order: an id already there (or earlier in `events`) is `Enqueued::Duplicate` and not written again.")]
            pub async fn enqueue_all<'c>(
                events: &[Self],
                conn: impl #p::Acquire<'c, Database = #p::Postgres>,
            ) -> ::core::result::Result<::std::vec::Vec<#p::Enqueued>, #p::OutboxError> {
                #p::enqueue_all(events, conn).await
            }

            #scheduled

            #[doc = ::core::concat!("Claims the next due event of `", #table, "`, if any, under a fresh lease and generation.")]
            pub async fn claim<'c>(
                conn: impl #p::Acquire<'c, Database = #p::Postgres>,
            ) -> ::core::result::Result<::core::option::Option<#p::Claim<Self>>, #p::OutboxError> {
                #p::claim(conn).await
            }

            #[doc = ::core::concat!("Claims up to `limit` due events of `", #table, "` in one statement.")]
            pub async fn claim_batch<'c>(
                conn: impl #p::Acquire<'c, Database = #p::Postgres>,
                limit: ::core::primitive::u32,
            ) -> ::core::result::Result<::std::vec::Vec<#p::Claim<Self>>, #p::OutboxError> {
                #p::claim_batch(conn, limit).await
            }

            #[doc = ::core::concat!("The migrations of `", #table, "`, for `outbox::migrate`.")]
            pub fn migrations() -> #p::TableMigrations {
                #p::TableMigrations::of::<Self>()
            }
        }
    }
}

/// `enqueue_at`, `enqueue_after` and their batch forms, on a type without an ordering key.
fn scheduled_methods(p: &TokenStream, table: &str) -> TokenStream {
    quote! {
        #[doc = ::core::concat!("[`enqueue`](Self::enqueue) into `", #table, "`, due at `at`: the relay does not claim the event before (a time in the past means now; at most `outbox::ops::MAX_INTERVAL` ahead).")]
        pub async fn enqueue_at<'e>(
            &self,
            at: #p::DateTime<#p::Utc>,
            executor: impl #p::PgExecutor<'e>,
        ) -> ::core::result::Result<#p::Enqueued, #p::OutboxError> {
            #p::enqueue_scheduled(self, #p::Schedule::At(at), executor).await
        }

        #[doc = ::core::concat!("[`enqueue`](Self::enqueue) into `", #table, "`, due `delay` after the enqueue on the database's clock (at most `outbox::ops::MAX_INTERVAL`).")]
        pub async fn enqueue_after<'e>(
            &self,
            delay: #p::Duration,
            executor: impl #p::PgExecutor<'e>,
        ) -> ::core::result::Result<#p::Enqueued, #p::OutboxError> {
            #p::enqueue_scheduled(self, #p::Schedule::After(delay), executor).await
        }

        #[doc = ::core::concat!("[`enqueue_all`](Self::enqueue_all) into `", #table, "`, every event due at `at`.")]
        pub async fn enqueue_all_at<'c>(
            events: &[Self],
            at: #p::DateTime<#p::Utc>,
            conn: impl #p::Acquire<'c, Database = #p::Postgres>,
        ) -> ::core::result::Result<::std::vec::Vec<#p::Enqueued>, #p::OutboxError> {
            #p::enqueue_all_scheduled(events, #p::Schedule::At(at), conn).await
        }

        #[doc = ::core::concat!("[`enqueue_all`](Self::enqueue_all) into `", #table, "`, every event due `delay` after the enqueue.")]
        pub async fn enqueue_all_after<'c>(
            events: &[Self],
            delay: #p::Duration,
            conn: impl #p::Acquire<'c, Database = #p::Postgres>,
        ) -> ::core::result::Result<::std::vec::Vec<#p::Enqueued>, #p::OutboxError> {
            #p::enqueue_all_scheduled(events, #p::Schedule::After(delay), conn).await
        }
    }
}

/// The statements, as a call of the derive-only `Statements` constructor: their texts
/// in the order of `Statement::ALL`, and the claims in pieces, between which the
/// runtime writes its row limit: the relay's (with runs of a key), the one made by hand
/// (one event per key), and the relay's from a position.
fn statements(p: &TokenStream, table: &Table<'_>, definitions: &[Definition]) -> TokenStream {
    let texts = definitions.iter().map(|d| &d.sql);
    let claims = [
        table.claim(LIMIT, true),
        table.claim(LIMIT, false),
        table.claim_from(LIMIT),
    ];
    let [runs, each, from] = claims.each_ref().map(|claim| {
        let pieces = claim.split(LIMIT);
        quote!(&[#(#pieces),*])
    });
    quote! {
        #p::derive_only_statements([#(#texts),*], #runs, #each, #from)
    }
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

// A `json` field's calls are spanned at its type: a type that is not `Serialize` and
// `Deserialize` is an error there, not at the derive.
// (Only the function's path carries the field's span: the locals and `self` keep the
// derive's, which a type from a `macro_rules!` fragment would not resolve.)
fn bind(p: &TokenStream, f: &Field) -> TokenStream {
    let (field, at) = (&f.ident, f.ty.span());
    let (ty, inner) = (&f.ty, f.option_of.as_ref().unwrap_or(&f.ty));
    let call = match (f.json, f.nullable()) {
        (false, _) => return quote!(let query = query.bind(&self.#field);),
        (true, false) => quote_spanned!(at=> #p::json::bind::<#ty>),
        (true, true) => quote_spanned!(at=> #p::json::bind_option::<#inner>),
    };
    quote!(let query = #call(query, &self.#field);)
}

/// One array of the field's values across `events`, borrowed.
fn bind_column(p: &TokenStream, f: &Field) -> TokenStream {
    let (field, at) = (&f.ident, f.ty.span());
    match (f.json, f.nullable()) {
        // Iterator's methods by path: the user's module may have no prelude.
        (false, _) => quote! {
            let query = query.bind(::core::iter::Iterator::collect::<::std::vec::Vec<_>>(
                ::core::iter::Iterator::map(events.iter(), |event| &event.#field)
            ));
        },
        (true, false) => {
            let ty = &f.ty;
            let call = quote_spanned!(at=> #p::json::bind_column::<_, #ty>);
            quote!(let query = #call(query, events, |event| &event.#field);)
        }
        (true, true) => {
            let inner = f.option_of.as_ref().unwrap_or(&f.ty);
            let call = quote_spanned!(at=> #p::json::bind_option_column::<_, #inner>);
            quote!(let query = #call(query, events, |event| &event.#field);)
        }
    }
}

fn decode(p: &TokenStream, f: &Field) -> TokenStream {
    let (field, column, ty) = (&f.ident, &f.column, &f.ty);
    let at = ty.span();
    match (f.json, &f.option_of) {
        (false, _) => quote!(#field: #p::Row::try_get::<#ty, _>(row, #column)?,),
        (true, None) => {
            let call = quote_spanned!(at=> #p::json::decode::<#ty>);
            quote!(#field: #call(row, #column)?,)
        }
        (true, Some(inner)) => {
            let call = quote_spanned!(at=> #p::json::decode_option::<#inner>);
            quote!(#field: #call(row, #column)?,)
        }
    }
}
