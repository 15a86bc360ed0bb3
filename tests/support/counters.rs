//! A `metrics` recorder that counts, for tests. Install it on the test's thread with
//! `metrics::set_default_local_recorder`: a `#[tokio::test]` runs every task it spawns
//! on that thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Counter values by (name, `table` label).
#[derive(Default)]
pub(crate) struct Counters(Mutex<HashMap<(String, String), Arc<AtomicU64>>>);

impl Counters {
    /// The value of counter `name` labelled `table`.
    pub(crate) fn get(&self, name: &str, table: &str) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(name.to_owned(), table.to_owned()))
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let table = key
            .labels()
            .find(|l| l.key() == "table")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        let mut counters = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let counter = counters.entry((key.name().to_owned(), table)).or_default();
        Counter::from_arc(Arc::clone(counter))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}
