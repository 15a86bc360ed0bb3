//! The least-privilege `GRANT` statements of an outbox table, for its three roles.

use crate::spec::TableSpec;

/// The spec's side of [`CatalogEntry::grants`](crate::catalog::CatalogEntry::grants), for an
/// application that has the type.
pub fn grants_for(spec: &TableSpec, schema: &str, roles: &Roles) -> String {
    grants(
        &Target {
            schema,
            table: spec.table,
            history_table: spec.history_table,
            deletes_sent: spec.deletes_sent,
        },
        roles,
    )
}

/// The three roles of an outbox table, by least privilege.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    /// Enqueues events, in the application's transactions: `INSERT` only (and `SELECT`
    /// of the two columns an enqueue returns).
    pub application: String,
    /// Runs the relay: reads and updates the table's rows, nothing else.
    pub relay: String,
    /// Runs the `outbox` command line: reads everything of the outbox, requeues,
    /// discards and prunes.
    pub operator: String,
}

pub(crate) struct Target<'a> {
    pub(crate) schema: &'a str,
    pub(crate) table: &'a str,
    pub(crate) history_table: &'a str,
    pub(crate) deletes_sent: bool,
}

pub(crate) fn grants(target: &Target<'_>, roles: &Roles) -> String {
    let ident = |name: &str| format!("\"{}\"", name.replace('"', "\"\""));
    let schema = ident(target.schema);
    let table = format!("{schema}.{}", ident(target.table));
    let (app, relay, operator) = (
        ident(&roles.application),
        ident(&roles.relay),
        ident(&roles.operator),
    );
    let relay_privileges = if target.deletes_sent {
        "SELECT, UPDATE, DELETE"
    } else {
        "SELECT, UPDATE"
    };
    format!(
        "-- Least privilege for the outbox table {table}. Migrations run as its owner.\n\
         -- The application enqueues: INSERT, and the two columns an enqueue returns.\n\
         GRANT USAGE ON SCHEMA {schema} TO {app};\n\
         GRANT INSERT, SELECT (id, event_id) ON {table} TO {app};\n\
         -- The relay claims and records outcomes{}: its rows, nothing else.\n\
         GRANT USAGE ON SCHEMA {schema} TO {relay};\n\
         GRANT {relay_privileges} ON {table} TO {relay};\n\
         -- The operator reads, requeues, discards and prunes, and reads the catalog.\n\
         GRANT USAGE ON SCHEMA {schema} TO {operator};\n\
         GRANT SELECT, UPDATE, DELETE ON {table} TO {operator};\n\
         GRANT SELECT ON {schema}.{}, {schema}.{} TO {operator};\n",
        if target.deletes_sent {
            " (deleting a sent row)"
        } else {
            ""
        },
        ident(outbox_internals::CATALOG_TABLE),
        ident(target.history_table),
    )
}
