//! What a table's flags add to an enqueue, after the payload: when a scheduled event
//! becomes due ([`Schedule`]), and a traced event's trace context.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::OutboxError;
use crate::interval;
use crate::spec::{Outbox, PgQuery};
use crate::trace::TraceContext;

/// When an enqueued event becomes due: the relay does not claim it before. For an event
/// type declared `#[outbox(scheduled)]`.
///
/// A scheduled event is published within the relay's
/// [`poll_interval`](crate::relay::Relay::poll_interval) after its time, as a retry
/// after its delay: no notification wakes the relay for it. Until then it counts in
/// [`Stats::scheduled`](crate::Stats::scheduled), not in the backlog (`due`) nor in the
/// lag, which counts from its time. On a type with an ordering key it holds its key's
/// later events until it is published, as a retry delay does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// Due at once.
    #[default]
    Now,
    /// Due at this time; a time in the past means now. At most
    /// [`MAX_INTERVAL`](crate::MAX_INTERVAL) ahead.
    At(DateTime<Utc>),
    /// Due this long after the enqueue, on the database's clock. At most
    /// [`MAX_INTERVAL`](crate::MAX_INTERVAL).
    After(Duration),
}

/// What a table's flags add to its enqueue statements' parameters, after the payload: a
/// scheduled table's time and delay, the latest of which (and now) is when the event is
/// due ([`Schedule`], checked); a traced table's current trace context.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extras {
    at: Option<DateTime<Utc>>,
    after: Option<Duration>,
    trace: Option<TraceContext>,
}

impl Extras {
    /// `schedule` checked for `T`'s table, and the trace context to keep, if `T` is
    /// traced.
    pub(super) fn of<T: Outbox>(schedule: Schedule) -> Result<Self, OutboxError> {
        let table = T::SPEC.table;
        let (at, after) = match schedule {
            Schedule::Now => (None, None),
            Schedule::After(delay) => (
                None,
                Some(interval::checked(table, "enqueue delay", delay)?),
            ),
            Schedule::At(at) => {
                let ahead = (at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
                interval::checked(table, "enqueue time, from now,", ahead)?;
                // A time in the past (on this clock) is now, however far back.
                ((!ahead.is_zero()).then_some(at), None)
            }
        };
        if schedule != Schedule::Now && !T::SPEC.scheduled {
            return Err(OutboxError::NotScheduled { table });
        }
        let trace = if T::SPEC.traced {
            TraceContext::current()
        } else {
            None
        };
        Ok(Self { at, after, trace })
    }

    /// Binds the parameters `T`'s enqueue statements take after the payload (borrowed:
    /// the extras outlive the statement).
    pub(super) fn bind<'q, T: Outbox>(&'q self, mut query: PgQuery<'q>) -> PgQuery<'q> {
        if T::SPEC.scheduled {
            query = query.bind(self.at).bind(self.after);
        }
        if T::SPEC.traced {
            let trace = self.trace.as_ref();
            query = query
                .bind(trace.map(TraceContext::traceparent))
                .bind(trace.and_then(TraceContext::tracestate))
                .bind(trace.and_then(TraceContext::baggage));
        }
        query
    }
}
