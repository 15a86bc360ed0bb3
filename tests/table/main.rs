//! The tables the derive generates, against real PostgreSQL: every generated statement
//! executed for several struct shapes (`statements`), the SQL checked in as golden files
//! (`golden`), and the migrations exported for other tools (`export`).

mod export;
mod golden;
mod statements;
