//! The table-level API: what an application and the relay do to the rows of one outbox
//! table. Events are written ([`enqueue`]), claimed ([`claiming`]) as tokens of ownership
//! ([`claim`]), their outcomes recorded a batch at a time ([`batch`]); an operator's statements read, repair and prune the table
//! ([`operations`]). Every statement of the table runs through its function in
//! [`statements`], which binds its parameters and decodes its result. The counters all
//! of it emits are named in [`metric`].

pub(crate) mod batch;
pub(crate) mod claim;
pub(crate) mod claiming;
pub(crate) mod enqueue;
pub(crate) mod extras;
pub(crate) mod key_order;
pub mod metric;
pub(crate) mod operations;
pub(crate) mod operator;
pub(crate) mod row;
pub(crate) mod statements;
