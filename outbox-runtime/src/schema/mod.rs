//! The outbox tables' schema: [`migrate`] creates and evolves them, from each event
//! type's migrations ([`table_migrations`]) through refinery ([`runner`], [`driver`]);
//! [`verify`] holds the live tables against the event types; the [`catalog`] keeps what
//! `migrate` knows of each table in the database, for tools without the types, with the
//! roles' [`grants`]; [`export`] writes the migrations as `.sql` files for teams that
//! apply them with their own tool.

pub mod catalog;
pub(crate) mod driver;
pub mod export;
pub(crate) mod grants;
pub(crate) mod migrate;
pub(crate) mod runner;
pub(crate) mod table_migrations;
pub(crate) mod verify;
