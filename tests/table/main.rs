//! The tables the derive generates, against real PostgreSQL: every generated statement
//! executed for several struct shapes (`statements`), the SQL checked in as golden files
//! (`golden`), the migrations exported for other tools (`export`), and scheduled publish
//! (`schedule`).

mod export;
mod golden;
mod schedule;
mod statements;
