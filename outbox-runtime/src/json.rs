//! How `#[derive(Outbox)]` binds and reads `#[outbox(json)]` fields: through these,
//! whose bounds are serde's, so that a field type serde cannot write or read is an
//! error naming `Serialize` or `Deserialize`, at the field (the derive spans each call
//! at the field's type), not a chain of sqlx's encoding traits at the derive.

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Row as _;
use sqlx::postgres::PgRow;
use sqlx::types::Json;

use crate::spec::PgQuery;

/// Binds `value` as `jsonb`.
pub fn bind<'q, T: Serialize + Sync>(query: PgQuery<'q>, value: &'q T) -> PgQuery<'q> {
    query.bind(Json(value))
}

/// Binds `value` as a nullable `jsonb`.
pub fn bind_option<'q, T: Serialize + Sync>(
    query: PgQuery<'q>,
    value: &'q Option<T>,
) -> PgQuery<'q> {
    query.bind(value.as_ref().map(Json))
}

/// Binds the `field` of every event as one `jsonb[]`.
pub fn bind_column<'q, E, T: Serialize + Sync + 'q>(
    query: PgQuery<'q>,
    events: &'q [E],
    field: impl Fn(&'q E) -> &'q T,
) -> PgQuery<'q> {
    query.bind(events.iter().map(|e| Json(field(e))).collect::<Vec<_>>())
}

/// Binds the `field` of every event as one `jsonb[]` with NULLs.
pub fn bind_option_column<'q, E, T: Serialize + Sync + 'q>(
    query: PgQuery<'q>,
    events: &'q [E],
    field: impl Fn(&'q E) -> &'q Option<T>,
) -> PgQuery<'q> {
    query.bind(
        events
            .iter()
            .map(|e| field(e).as_ref().map(Json))
            .collect::<Vec<_>>(),
    )
}

/// Reads `column` as `jsonb`.
pub fn decode<T: DeserializeOwned>(row: &PgRow, column: &str) -> Result<T, sqlx::Error> {
    Ok(row.try_get::<Json<T>, _>(column)?.0)
}

/// Reads `column` as a nullable `jsonb`.
pub fn decode_option<T: DeserializeOwned>(
    row: &PgRow,
    column: &str,
) -> Result<Option<T>, sqlx::Error> {
    Ok(row
        .try_get::<Option<Json<T>>, _>(column)?
        .map(|json| json.0))
}
