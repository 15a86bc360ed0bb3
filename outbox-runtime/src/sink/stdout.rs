//! [`StdoutSink`]: a sink that prints, for trying things out.

use super::{Delivery, Sink, SinkError};

/// A sink that prints each event as one line on stdout: `event_id generation attempt
/// {event:?}`. For trying things out.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutSink;

impl<T: std::fmt::Debug + Send + Sync + 'static> Sink<T> for StdoutSink {
    async fn publish(&self, batch: &[Delivery<'_, T>]) -> Vec<Result<(), SinkError>> {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        batch
            .iter()
            .map(|d| {
                writeln!(
                    out,
                    "{} {} {} {:?}",
                    d.event_id, d.generation, d.attempt, d.event
                )
                .map_err(SinkError::transient)
            })
            .collect()
    }
}
