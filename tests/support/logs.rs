//! Log lines captured from the relay's `tracing` events, to count what it said.

use std::sync::{Arc, Mutex, PoisonError};

/// A `tracing_subscriber::fmt` writer that keeps everything written to it; clones share
/// the same text.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures what this thread logs at `level` and above, until the guard drops. A
    /// current-thread runtime (`#[tokio::test]`'s) polls its tasks on this thread, so
    /// they log here.
    ///
    /// tracing caches per log statement whether any subscriber wants it. A statement
    /// first reached on another test's thread, which has no subscriber, while this one
    /// was being installed can be cached as wanted by none, and its lines would be lost
    /// here: the cache is rebuilt once this subscriber is in place.
    pub fn this_thread(
        &self,
        level: tracing_subscriber::filter::LevelFilter,
    ) -> tracing::dispatcher::DefaultGuard {
        use tracing_subscriber::util::SubscriberInitExt as _;
        let writer = self.clone();
        let guard = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish()
            .set_default();
        tracing::callsite::rebuild_interest_cache();
        guard
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    /// How many lines contain every one of `texts`.
    pub fn lines_with(&self, texts: &[&str]) -> usize {
        self.text()
            .lines()
            .filter(|line| texts.iter().all(|text| line.contains(text)))
            .count()
    }
}
