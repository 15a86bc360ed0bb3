//! [`MemorySink`]: a sink that keeps what it is given, for tests and examples.

use std::sync::{Arc, Mutex, PoisonError};

use super::{Delivery, Sink, SinkError};
use crate::id::{EventId, Generation};

/// What a [`MemorySink`] saw of one delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct Published<T> {
    /// The stable event id.
    pub event_id: EventId,
    /// The generation of the claim that published it.
    pub generation: Generation,
    /// The attempt number.
    pub attempt: u32,
    /// The event.
    pub event: T,
}

/// An in-memory sink that records every delivery and always succeeds: for tests and
/// examples. Clones share the same record.
#[derive(Debug)]
pub struct MemorySink<T> {
    published: Arc<Mutex<Vec<Published<T>>>>,
}

impl<T> Clone for MemorySink<T> {
    fn clone(&self) -> Self {
        Self {
            published: Arc::clone(&self.published),
        }
    }
}

impl<T> Default for MemorySink<T> {
    fn default() -> Self {
        Self {
            published: Arc::default(),
        }
    }
}

impl<T: Clone> MemorySink<T> {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every delivery so far, in publication order.
    pub fn published(&self) -> Vec<Published<T>> {
        self.published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl<T: Clone + Send + Sync + 'static> Sink<T> for MemorySink<T> {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        published.extend(batch.iter().map(|d| Published {
            event_id: d.event_id.clone(),
            generation: d.generation,
            attempt: d.attempt,
            event: d.event.clone(),
        }));
        batch.iter().map(|_| Ok(())).collect()
    }
}
