//! What a sink says when it cannot publish: [`SinkError`], and the [`BoxError`] it
//! wraps.

/// A boxed error from a sink.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a sink could not publish an event.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Worth retrying later (broker unavailable, timeout): the event goes back to
    /// `READY` with a backoff, while its attempt budget lasts.
    #[error("transient: {0}")]
    Transient(#[source] BoxError),
    /// Retrying cannot help (the broker rejected the message): the event moves to
    /// `DEAD` now, with this message in `last_error`.
    #[error("permanent: {0}")]
    Permanent(#[source] BoxError),
    /// The destination cannot take anything now (the broker is down or unreachable, the
    /// client is reconnecting): the event goes back to `READY`, due at once, **without
    /// counting the attempt**, and the worker backs off before it claims again, so an
    /// outage of any length sends nothing to `DEAD`.
    ///
    /// For an outage, not for a message: an event that keeps failing this way is never
    /// retired. A message the broker refuses is [`Permanent`](Self::Permanent); a lost
    /// acknowledgement is [`Transient`](Self::Transient).
    #[error("destination unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// The message left this process and got no answer, and nothing can call it back:
    /// the destination may have it, or may still get it, late (a Kafka record already
    /// sent when the relay [withdrew](super::Sink::withdraw) its batch). The relay records
    /// nothing: the event stays claimed until its lease ends, and is then published
    /// again (the attempt counted, as for any claim that ran out). Handing it back at
    /// once could let another publisher send it, and the events after it under its
    /// ordering key, before the late copy lands.
    #[error("in doubt: {0}")]
    InDoubt(#[source] BoxError),
}

impl SinkError {
    /// A [`Transient`](Self::Transient) error.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self::Transient(error.into())
    }

    /// A [`Permanent`](Self::Permanent) error.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self::Permanent(error.into())
    }

    /// An [`Unavailable`](Self::Unavailable) error.
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }

    /// An [`InDoubt`](Self::InDoubt) error.
    pub fn in_doubt(error: impl Into<BoxError>) -> Self {
        Self::InDoubt(error.into())
    }

    /// Whether this says the destination is unavailable.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}
