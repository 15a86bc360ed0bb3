//! facade (being written)
pub use outbox_runtime::*;
