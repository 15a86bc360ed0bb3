//! A `metrics` recorder that counts, keeps each gauge's last value and each
//! histogram's samples, for tests.
//! Install it on the test's thread with `metrics::set_default_local_recorder`: a
//! `#[tokio::test]` runs every task it spawns on that thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// Metric values by (name, `table` label), or (name, `table@target`) for a fleet's
/// relay, whose metrics carry a `target` label too.
type Values<V = AtomicU64> = Mutex<HashMap<(String, String), Arc<V>>>;

/// Counter values, gauge values (an `f64`'s bits, as `metrics` stores them in an
/// `AtomicU64`) and histogram samples, by (name, `table` label).
#[derive(Default)]
pub struct Counters {
    counts: Values,
    gauges: Values,
    histograms: Values<Samples>,
}

/// A histogram's samples, in the order they were recorded.
#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(value);
    }
}

impl Counters {
    /// The value of counter `name` labelled `table`.
    pub fn get(&self, name: &str, table: &str) -> u64 {
        value(&self.counts, name, table).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The value of counter `name` labelled `table` and a fleet's `target`.
    pub fn get_for_target(&self, name: &str, table: &str, target: &str) -> u64 {
        self.get(name, &format!("{table}@{target}"))
    }

    /// The last value of gauge `name` labelled `table`, or `None` if it was never
    /// registered.
    pub fn gauge(&self, name: &str, table: &str) -> Option<f64> {
        value(&self.gauges, name, table).map(|g| f64::from_bits(g.load(Ordering::Relaxed)))
    }

    /// The samples recorded by histogram `name` labelled `table`, oldest first.
    pub fn samples(&self, name: &str, table: &str) -> Vec<f64> {
        value(&self.histograms, name, table).map_or_else(Vec::new, |h| {
            h.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
        })
    }
}

fn value<V>(values: &Values<V>, name: &str, table: &str) -> Option<Arc<V>> {
    values
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(name.to_owned(), table.to_owned()))
        .cloned()
}

/// The value registered for `key` in `values`, created at 0 the first time.
fn register<V: Default>(values: &Values<V>, key: &Key) -> Arc<V> {
    let label = |name: &str| {
        key.labels()
            .find(|l| l.key() == name)
            .map(|l| l.value().to_owned())
    };
    let table = label("table").unwrap_or_default();
    let table = match label("target") {
        Some(target) => format!("{table}@{target}"),
        None => table,
    };
    let mut values = values.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(values.entry((key.name().to_owned(), table)).or_default())
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(register(&self.counts, key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(register(&self.gauges, key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(register(&self.histograms, key))
    }
}
