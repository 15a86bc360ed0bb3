//! The table-level API: what an application and the relay do to the rows of one outbox
//! table. Events are written ([`enqueue`]), claimed ([`claiming`]) as tokens of ownership
//! ([`claim`]), their outcomes recorded and leases renewed a batch at a time
//! ([`batch`]); an operator's statements read, repair and prune the table
//! ([`operations`]). The counters all of it emits are named in [`metric`].

pub(crate) mod batch;
pub(crate) mod claim;
pub(crate) mod claiming;
pub(crate) mod enqueue;
pub mod metric;
pub(crate) mod operations;
