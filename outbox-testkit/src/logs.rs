//! Log lines captured from the relay's `tracing` events, to count what it said.
//!
//! One subscriber serves the whole test binary: installed as the global default on first
//! use, it hands each event to the capture of the thread that logged it, if that thread
//! has one. A subscriber of each test's own (`set_default`) can miss lines: tracing
//! caches per log statement whether anyone listens, and while only one subscriber exists
//! it asks the default of whichever thread reaches the statement first; a test running
//! on another thread without a subscriber has it cached as never enabled, for everyone.
//! This subscriber answers "sometimes" for every statement and decides per event, so the
//! cache never hides a line, whichever test runs first.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, Once, PoisonError};

use tracing_subscriber::filter::{LevelFilter, dynamic_filter_fn};
use tracing_subscriber::fmt::writer::OptionalWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, fmt};

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

thread_local! {
    /// Where this thread's events go, and from which level on.
    static ROUTE: RefCell<Option<(Captured, LevelFilter)>> = const { RefCell::new(None) };
}

/// Captures this thread's events until dropped (then the thread's previous capture, if
/// any, resumes).
pub struct Capturing {
    previous: Option<(Captured, LevelFilter)>,
    /// Tied to the thread whose route it set.
    _thread: PhantomData<*const ()>,
}

impl Drop for Capturing {
    fn drop(&mut self) {
        let previous = self.previous.take();
        ROUTE.with(|route| *route.borrow_mut() = previous);
    }
}

/// Installs the routing subscriber as the global default, once per process.
fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let wanted = dynamic_filter_fn(|metadata, _| {
            ROUTE.with(|route| {
                route
                    .borrow()
                    .as_ref()
                    .is_some_and(|(_, level)| metadata.level() <= level)
            })
        });
        let to_this_thread = || {
            ROUTE.with(|route| match route.borrow().as_ref() {
                Some((captured, _)) => OptionalWriter::some(captured.clone()),
                None => OptionalWriter::none(),
            })
        };
        let layer = fmt::layer()
            .with_writer(to_this_thread)
            .with_ansi(false)
            .with_filter(wanted);
        tracing_subscriber::registry()
            .with(layer)
            .try_init()
            .expect("no other global tracing subscriber in a binary that captures logs");
    });
}

impl Captured {
    /// Captures what this thread logs at `level` and above, until the guard drops. A
    /// current-thread runtime (`#[tokio::test]`'s) polls its tasks on this thread, so
    /// they log here.
    pub fn this_thread(&self, level: LevelFilter) -> Capturing {
        install();
        let previous = ROUTE.with(|route| route.borrow_mut().replace((self.clone(), level)));
        Capturing {
            previous,
            _thread: PhantomData,
        }
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
