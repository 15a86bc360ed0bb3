//! The tables the derive generates, against real PostgreSQL: every generated statement
//! executed for several struct shapes (`statements`), the SQL checked in as golden files
//! (`golden`), the migrations exported for other tools (`export`), scheduled publish
//! (`schedule`), and tables without a unique index on generated ids (`event_id_index`).

mod event_id_index;
mod export;
mod golden;
mod schedule;
mod statements;
