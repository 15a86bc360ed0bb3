//! Clean-up of what a test creates on a shared server (a NATS stream, a RabbitMQ exchange
//! and queue), also when the test fails midway: [`Cleanup::run`] at the end of the test,
//! or, if it never gets there, on drop.

use std::future::Future;
use std::pin::Pin;
use std::thread;
use std::time::Duration;

use super::TestResult;

type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = TestResult>>> + Send>;

/// How long a clean-up on drop may take before the test gives up on it.
const LIMIT: Duration = Duration::from_secs(30);

/// A clean-up to run once: by [`run`](Self::run), or when dropped.
///
/// Create it before what it deletes, so that a test failing between the two leaves
/// nothing behind (deleting what is not there must succeed). Its job opens a connection
/// of its own: on drop, the test's runtime (and its clients) may be gone.
#[must_use = "dropped at once, it cleans up at once"]
pub struct Cleanup {
    what: String,
    job: Option<Job>,
}

impl Cleanup {
    /// `job` deletes `what` (named in a warning if it fails on drop).
    pub fn new<F: Future<Output = TestResult> + 'static>(
        what: impl Into<String>,
        job: impl FnOnce() -> F + Send + 'static,
    ) -> Self {
        Self {
            what: what.into(),
            job: Some(Box::new(move || Box::pin(job()))),
        }
    }

    /// Cleans up now, on the test's runtime: a failure fails the test.
    pub async fn run(mut self) -> TestResult {
        match self.job.take() {
            Some(job) => job()
                .await
                .map_err(|e| format!("deleting {}: {e}", self.what).into()),
            None => Ok(()),
        }
    }
}

impl Drop for Cleanup {
    /// The test failed before [`run`](Self::run): cleans up on a thread with a runtime of
    /// its own (drop may run on a runtime's thread, or while a panic unwinds), blocking
    /// until done. A failure is only reported: a panic here would abort the process.
    fn drop(&mut self) {
        let Some(job) = self.job.take() else { return };
        let what = std::mem::take(&mut self.what);
        let cleanup = thread::Builder::new()
            .name("test-cleanup".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let outcome = match runtime {
                    Ok(runtime) => runtime.block_on(async {
                        tokio::time::timeout(LIMIT, job())
                            .await
                            .unwrap_or_else(|_| Err(format!("timed out after {LIMIT:?}").into()))
                    }),
                    Err(error) => Err(error.into()),
                };
                if let Err(error) = outcome {
                    eprintln!("test clean-up: could not delete {what}: {error}");
                }
            });
        if let Ok(cleanup) = cleanup {
            let _ = cleanup.join();
        }
    }
}
