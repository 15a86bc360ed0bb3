//! A `metrics` recorder that counts and keeps each gauge's last value, for tests.
//! Install it on the test's thread with `metrics::set_default_local_recorder`: a
//! `#[tokio::test]` runs every task it spawns on that thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Metric values by (name, `table` label).
type Values = Mutex<HashMap<(String, String), Arc<AtomicU64>>>;

/// Counter values, and gauge values (an `f64`'s bits, as `metrics` stores them in an
/// `AtomicU64`), by (name, `table` label).
#[derive(Default)]
pub(crate) struct Counters {
    counters: Values,
    gauges: Values,
}

impl Counters {
    /// The value of counter `name` labelled `table`.
    pub(crate) fn get(&self, name: &str, table: &str) -> u64 {
        value(&self.counters, name, table).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The last value of gauge `name` labelled `table`, or `None` if it was never
    /// registered.
    pub(crate) fn gauge(&self, name: &str, table: &str) -> Option<f64> {
        value(&self.gauges, name, table).map(|g| f64::from_bits(g.load(Ordering::Relaxed)))
    }
}

fn value(values: &Values, name: &str, table: &str) -> Option<Arc<AtomicU64>> {
    values
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(name.to_owned(), table.to_owned()))
        .cloned()
}

/// The value registered for `key` in `values`, created at 0 the first time.
fn register(values: &Values, key: &Key) -> Arc<AtomicU64> {
    let table = key
        .labels()
        .find(|l| l.key() == "table")
        .map(|l| l.value().to_owned())
        .unwrap_or_default();
    let mut values = values.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(values.entry((key.name().to_owned(), table)).or_default())
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(register(&self.counters, key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(register(&self.gauges, key))
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}
