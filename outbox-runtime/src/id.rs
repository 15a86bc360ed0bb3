//! The two identities of an outbox row: the stable [`EventId`] of the logical message
//! and the [`Generation`] of one attempt to own its publication.

use std::fmt;

/// The stable identity of a logical event. It never changes across retries or
/// reclaims, so consumers deduplicate on it.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(String);

impl EventId {
    /// The longest event id the outbox stores, in bytes. The `event_id` column is
    /// unique, and a btree index entry must fit in a third of a page (about 2.7 kB);
    /// 1 kB leaves room and is far beyond any UUID, ULID or business key.
    pub const MAX_LEN: usize = 1024;

    /// A fresh, time-ordered id (UUIDv7), used when the event type has no
    /// `#[outbox(event_id)]` field.
    pub fn new_v7() -> Self {
        Self(uuid::Uuid::now_v7().to_string())
    }

    /// The id as stored in the `event_id` column.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub(crate) fn from_column(text: String) -> Self {
        Self(text)
    }

    /// Why this id cannot be stored, if it cannot: empty or blank (it would make every
    /// such event a duplicate of the first), longer than [`MAX_LEN`](Self::MAX_LEN)
    /// bytes, or containing NUL, which PostgreSQL's `text` cannot hold.
    pub(crate) fn defect(&self) -> Option<String> {
        let id = &self.0;
        if id.trim().is_empty() {
            Some(if id.is_empty() {
                "an event id cannot be empty".to_owned()
            } else {
                "an event id cannot be blank".to_owned()
            })
        } else if id.len() > Self::MAX_LEN {
            Some(format!(
                "an event id is at most {} bytes, this one has {}",
                Self::MAX_LEN,
                id.len()
            ))
        } else if id.contains('\0') {
            Some("an event id cannot contain a NUL character".to_owned())
        } else {
            None
        }
    }

    /// The id as an error shows it: its first 64 characters.
    pub(crate) fn shortened(&self) -> String {
        match self.0.char_indices().nth(64) {
            Some((end, _)) => format!("{}...", &self.0[..end]),
            None => self.0.clone(),
        }
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for EventId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for EventId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for EventId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// The fencing token of a claim: bumped by every claim of the row, so an outcome
/// recorded under an older generation is rejected.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Generation(i64);

impl Generation {
    /// The raw value, as stored in the `generation` column.
    pub const fn get(self) -> i64 {
        self.0
    }

    pub(crate) const fn new(value: i64) -> Self {
        Self(value)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// A field type that can serve as the stable `#[outbox(event_id)]` of an event.
///
/// Implemented for `String`, `uuid::Uuid`, `i64` and `i32`; the derive rejects other
/// types at compile time.
pub trait EventIdField: Sized {
    /// The id under which the event is stored.
    fn to_event_id(&self) -> EventId;
    /// Parses the stored id back into the field.
    fn from_event_id(id: &str) -> Result<Self, sqlx::error::BoxDynError>;
}

impl EventIdField for String {
    fn to_event_id(&self) -> EventId {
        EventId(self.clone())
    }
    fn from_event_id(id: &str) -> Result<Self, sqlx::error::BoxDynError> {
        Ok(id.to_owned())
    }
}

impl EventIdField for uuid::Uuid {
    fn to_event_id(&self) -> EventId {
        EventId(self.to_string())
    }
    fn from_event_id(id: &str) -> Result<Self, sqlx::error::BoxDynError> {
        Ok(id.parse()?)
    }
}

macro_rules! integer_event_id {
    ($($t:ty),*) => {$(
        impl EventIdField for $t {
            fn to_event_id(&self) -> EventId {
                EventId(self.to_string())
            }
            fn from_event_id(id: &str) -> Result<Self, sqlx::error::BoxDynError> {
                Ok(id.parse()?)
            }
        }
    )*};
}
integer_event_id!(i64, i32);

impl From<uuid::Uuid> for EventId {
    fn from(id: uuid::Uuid) -> Self {
        id.to_event_id()
    }
}

impl From<String> for EventId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

impl From<&str> for EventId {
    fn from(id: &str) -> Self {
        Self(id.to_owned())
    }
}
