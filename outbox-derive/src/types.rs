//! The type mapping: which PostgreSQL column type stores a Rust type, and why a type
//! has none.

use syn::{GenericArgument, PathArguments, Type};

use crate::attr::Errors;

/// Integer types PostgreSQL has no column type for (no unsigned, 8- or 128-bit integers).
const UNMAPPED_INTEGERS: &[&str] = &[
    "u8", "u16", "u32", "u64", "u128", "usize", "i8", "i128", "isize",
];

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

/// The column type of a field of type `ty` (an `Option`'s inner type): jsonb when the
/// field is marked `json`, else the type's own; `None` after reporting a type that has
/// none.
pub(crate) fn column_type(
    ty: &Type,
    json: bool,
    generics: &syn::Generics,
    errors: &mut Errors,
) -> Option<SqlType> {
    if json {
        return Some(JSONB);
    }
    let found = native_sql_type(ty);
    if found.is_none() && !is_type_param(ty, generics) {
        errors.push(syn::Error::new_spanned(ty, unmapped_type(ty)));
    }
    found
}

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

/// Whether `ty` is the plain type `name` (by the last segment of its path).
pub(crate) fn is_ident(ty: &Type, name: &str) -> bool {
    last_segment(ty).is_some_and(|s| s.ident == name && s.arguments.is_none())
}

/// `Some(T)` for `Option<T>`.
pub(crate) fn option_inner(ty: &Type) -> Option<&Type> {
    last_segment(ty)
        .filter(|s| s.ident == "Option")
        .and_then(generic_arg)
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
    if option_inner(ty).is_some() {
        return "a column is NULL or holds one value: it has no room for `Some(None)`; use a single \
                `Option`, or mark the field #[outbox(json)] to keep both levels in jsonb"
            .to_owned();
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
         serde_json::Value, or an Option of one of these (the derive reads a type's name, not \
         its definition: a type alias or a newtype of one of them is not recognised)"
    )
}

#[cfg(test)]
mod tests {
    use syn::parse_quote;

    use super::*;

    /// (ddl, catalog) of `ty`, if it maps to a column type.
    fn mapped(ty: &Type) -> Option<(&'static str, &'static str)> {
        native_sql_type(ty).map(|t| (t.ddl, t.catalog))
    }

    #[test]
    fn every_supported_type_has_its_ddl_and_catalog_name() {
        // The catalog name is what `format_type()` prints back, which the runtime
        // compares against the live table to detect drift.
        let cases: &[(Type, &str, &str)] = &[
            (parse_quote!(i16), "smallint", "smallint"),
            (parse_quote!(i32), "integer", "integer"),
            (parse_quote!(i64), "bigint", "bigint"),
            (parse_quote!(f32), "real", "real"),
            (parse_quote!(f64), "double precision", "double precision"),
            (parse_quote!(bool), "boolean", "boolean"),
            (parse_quote!(String), "text", "text"),
            (parse_quote!(std::string::String), "text", "text"),
            (parse_quote!(Vec<u8>), "bytea", "bytea"),
            (parse_quote!(uuid::Uuid), "uuid", "uuid"),
            (parse_quote!(chrono::NaiveDate), "date", "date"),
            (parse_quote!(time::Date), "date", "date"),
            (
                parse_quote!(chrono::NaiveTime),
                "time",
                "time without time zone",
            ),
            (parse_quote!(time::Time), "time", "time without time zone"),
            (
                parse_quote!(chrono::NaiveDateTime),
                "timestamp",
                "timestamp without time zone",
            ),
            (
                parse_quote!(time::PrimitiveDateTime),
                "timestamp",
                "timestamp without time zone",
            ),
            (
                parse_quote!(chrono::DateTime<chrono::Utc>),
                "timestamptz",
                "timestamp with time zone",
            ),
            (
                parse_quote!(time::OffsetDateTime),
                "timestamptz",
                "timestamp with time zone",
            ),
            (parse_quote!(serde_json::Value), "jsonb", "jsonb"),
            (parse_quote!(JsonValue), "jsonb", "jsonb"),
        ];
        for (ty, ddl, catalog) in cases {
            let name = quote::quote!(#ty).to_string();
            assert_eq!(mapped(ty), Some((*ddl, *catalog)), "{name}");
        }
    }

    #[test]
    fn unmapped_types_have_no_column_type() {
        let cases: &[Type] = &[
            parse_quote!(u8),
            parse_quote!(u32),
            parse_quote!(u64),
            parse_quote!(usize),
            parse_quote!(i8),
            parse_quote!(i128),
            parse_quote!(Vec<i32>),
            parse_quote!(Vec<u8, MyAlloc>),
            parse_quote!(std::collections::HashMap<String, i32>),
            parse_quote!(Line),
            parse_quote!(&'static str),
            parse_quote!([u8; 4]),
            parse_quote!((i32, i32)),
            parse_quote!(<T as Trait>::String),
            // An `Option` is unwrapped before mapping, not mapped itself.
            parse_quote!(Option<i32>),
        ];
        for ty in cases {
            let name = quote::quote!(#ty).to_string();
            assert!(mapped(ty).is_none(), "{name} should have no column type");
        }
    }

    #[test]
    fn only_date_and_time_types_are_date_time() {
        let date_time: Vec<&str> = ["i64", "String", "chrono::NaiveDate", "time::Time"]
            .into_iter()
            .chain(["chrono::NaiveDateTime", "time::OffsetDateTime"])
            .filter(|name| {
                let ty: Type = syn::parse_str(name).unwrap();
                native_sql_type(&ty).is_some_and(SqlType::is_date_time)
            })
            .collect();
        assert_eq!(
            date_time,
            [
                "chrono::NaiveDate",
                "time::Time",
                "chrono::NaiveDateTime",
                "time::OffsetDateTime"
            ]
        );
    }

    #[test]
    fn option_inner_unwraps_only_an_option() {
        let inner = |ty: Type| option_inner(&ty).map(|t| quote::quote!(#t).to_string());
        assert_eq!(
            inner(parse_quote!(Option<String>)).as_deref(),
            Some("String")
        );
        assert_eq!(
            inner(parse_quote!(::core::option::Option<Vec<u8>>)).as_deref(),
            Some("Vec < u8 >")
        );
        assert_eq!(inner(parse_quote!(String)), None);
        assert_eq!(inner(parse_quote!(Option)), None);
    }

    #[test]
    fn a_json_field_is_jsonb_whatever_its_type() {
        let mut errors = Errors::default();
        let ty: Type = parse_quote!(std::collections::HashMap<String, i32>);
        let found = column_type(&ty, true, &syn::Generics::default(), &mut errors);
        assert_eq!(found.map(|t| t.ddl), Some("jsonb"));
        assert!(errors.messages().is_empty());
    }

    #[test]
    fn an_unmapped_type_is_reported_with_its_fix() {
        let report = |ty: Type| {
            let mut errors = Errors::default();
            let found = column_type(&ty, false, &syn::Generics::default(), &mut errors);
            assert!(found.is_none());
            errors.messages()
        };
        assert_eq!(
            report(parse_quote!(u32)),
            [
                "`u32` has no PostgreSQL column type (PostgreSQL has no unsigned, 8-bit or 128-bit integers): use `i16`, `i32` or `i64`"
            ]
        );
        let borrowed = report(parse_quote!(&'static str));
        assert!(
            borrowed[0].starts_with("a field cannot borrow"),
            "{borrowed:?}"
        );
        let user = report(parse_quote!(crate::Line));
        assert!(
            user[0].starts_with(
                "`Line` has no PostgreSQL column type: mark the field #[outbox(json)]"
            ),
            "{user:?}"
        );
        let tuple = report(parse_quote!((i32, i32)));
        assert!(
            tuple[0].starts_with("this type has no PostgreSQL column type"),
            "{tuple:?}"
        );
    }

    #[test]
    fn a_type_parameter_is_not_reported_again() {
        // The generic struct itself is the error; its parameters are not a second one.
        let generics: syn::Generics = parse_quote!(<T>);
        let mut errors = Errors::default();
        let ty: Type = parse_quote!(T);
        assert!(column_type(&ty, false, &generics, &mut errors).is_none());
        assert!(errors.messages().is_empty());
    }
}
