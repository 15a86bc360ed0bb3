//! The `outbox` command line, run as a process against a real database (`commands`), and
//! least privilege with the roles `outbox grants` writes (`grants`).

mod commands;
mod grants;
