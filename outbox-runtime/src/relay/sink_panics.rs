//! A sink that panics: contained, its batch published again one event at a time.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt as _;

use crate::sink::{Delivery, Sink, SinkError};

/// `sink.publish(batch)`, awaited, or the panic it raised: in the call itself (a sink
/// may encode the batch before it returns its future) or in the future.
async fn publish_caught<T, S: Sink<T>>(
    sink: &S,
    batch: &[Delivery<'_, T>],
) -> std::thread::Result<Vec<Result<(), SinkError>>> {
    let publishing = std::panic::catch_unwind(AssertUnwindSafe(|| sink.publish(batch)))?;
    AssertUnwindSafe(publishing).catch_unwind().await
}

/// Runs `sink.publish(batch)`, containing a panic: a batch that panics is published
/// again one delivery at a time, and a delivery that panics on its own fails as
/// transient, with the panic's message.
pub(crate) async fn publish_contained<T, S: Sink<T>>(
    sink: &S,
    batch: &[Delivery<'_, T>],
) -> Vec<Result<(), SinkError>> {
    let panic = match publish_caught(sink, batch).await {
        Ok(results) => return results,
        Err(panic) => panic_message(panic.as_ref()),
    };
    if let [one] = batch {
        tracing::error!(event_id = %one.event_id, %panic, "the sink panicked");
        return vec![Err(panicked(&panic))];
    }
    tracing::error!(size = batch.len(), %panic,
        "the sink panicked on a batch; publishing its events one at a time");
    let mut results = Vec::with_capacity(batch.len());
    for one in batch.chunks(1) {
        let result = if one[0].is_owned() {
            match publish_caught(sink, one).await {
                Ok(mut result) => result.pop().unwrap_or_else(|| {
                    Err(SinkError::transient(
                        "the sink returned no result for this event",
                    ))
                }),
                Err(panic) => {
                    let panic = panic_message(panic.as_ref());
                    tracing::error!(event_id = %one[0].event_id, %panic, "the sink panicked");
                    Err(panicked(&panic))
                }
            }
        } else {
            // Another publisher owns it now: nothing will be recorded for it.
            Err(SinkError::transient("ownership lost"))
        };
        results.push(result);
    }
    results
}

fn panicked(message: &str) -> SinkError {
    SinkError::transient(format!("sink panicked: {message}"))
}

/// What `panic!` was given: a `&str` or a `String`, as the standard hook prints it.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
