//! A relay's worker: a loop over named steps.
//!
//! - **claim**: record what is pending and claim the next batch, in one transaction;
//! - **renew** the batch's leases if it waited (two thirds of a lease left to send it);
//! - **publish** it through the sink, its leases renewed meanwhile, while the batch
//!   transaction runs beside it on the worker's connection: the outcomes of the batch
//!   before recorded, and after a full batch the next one claimed ahead;
//! - **settle** what that transaction did: the batch claimed ahead kept, or its
//!   failure **backed off** from (or the worker stopped, on a fatal one);
//! - **hand back** what will not be sent: a batch claimed ahead when the destination is
//!   down or the relay stops.
//!
//! What a worker carries from one step to the next is its [`State`].

mod publish;
mod send;
mod transaction;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::Relay;
use super::backoff::Backoff;
use super::connection::Connection;
use super::frontier::Frontier;
use super::key_share::KeyShare;
use super::outage::Outage;
use super::pending::Pending;
use super::renewal::{self, Needed};
use super::wakeups::Wakeups;
use crate::error::OutboxError;
use crate::sink::Sink;
use crate::spec::Outbox;
use crate::table::claim::Claim;

pub(crate) struct Worker<T, S> {
    /// Which of the relay's workers this is, from 0.
    pub(crate) index: usize,
    pub(crate) key_share: Arc<KeyShare>,
    /// Whether the worker keeps the keys it has rather than its share ([`KeyShare`]):
    /// unless its last batch transaction took longer than its send would with its keys
    /// spread over the relay's workers (the send's time times the workers), the sink as
    /// much as the database sets its pace. Another worker would send a key's events no
    /// sooner then (one acknowledgement at a time either way), while each layer sent
    /// would carry fewer events: through a broker, sharing 10 keys made the relay slower
    /// (JetStream 14,500 -> 10,600 events/s, RabbitMQ 4,600 -> 3,100).
    pub(crate) keeps_keys: AtomicBool,
    pub(crate) relay: Arc<Relay<T, S>>,
    pub(crate) wakeups: Arc<Wakeups>,
    pub(crate) frontier: Arc<Frontier>,
    pub(crate) outage: Arc<Outage>,
    pub(crate) stop: CancellationToken,
}

/// What a worker carries from one step to the next.
struct State<'p, T: Outbox> {
    /// Kept from batch to batch while there is work.
    conn: Connection<'p>,
    /// Batch transactions in a row that failed (transiently).
    failures: u32,
    /// Batches in a row the destination was unavailable for.
    held_back: u32,
    /// Outcomes published and not recorded yet.
    pending: Pending,
    /// A batch claimed while the one before was in flight.
    ahead: Batch<T>,
}

impl<'p, T: Outbox> State<'p, T> {
    fn new(pool: &'p PgPool) -> Self {
        Self {
            conn: Connection {
                pool,
                table: T::SPEC.table,
                held: None,
            },
            failures: 0,
            held_back: 0,
            pending: Pending::default(),
            ahead: Batch::empty(),
        }
    }
}

/// What the database did beside a send: the outcomes of the batch before recorded and
/// the batch after claimed, or why not.
type Ahead<T> = Result<Batch<T>, OutboxError>;

/// A claimed batch, and whether its claim found as many rows as it looked for. Rows it
/// could not hand out count (a payload that does not decode, moved to `DEAD`; a row
/// taken over while the batch waited): a full claim says more may be due, however many
/// of its rows are left to publish.
struct Batch<T: Outbox> {
    claims: Vec<Claim<T>>,
    full: bool,
    /// Whether other workers may find more due: the batch is full, and without runs of
    /// a key (a claim takes those only in the room its heads left, having found fewer
    /// than it looked for).
    more: bool,
    /// Claims dropped from the batch while it waited, behind an earlier event of their
    /// key that was taken over: still this worker's, handed back with the next
    /// outcomes recorded.
    behind: Vec<Claim<T>>,
}

impl<T: Outbox> Batch<T> {
    fn empty() -> Self {
        Self {
            claims: Vec::new(),
            full: false,
            more: false,
            behind: Vec::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    /// The batch, if it has rows (to publish or to hand back), leaving an empty one.
    fn take(&mut self) -> Option<Self> {
        (!self.is_empty() || !self.behind.is_empty())
            .then(|| std::mem::replace(self, Self::empty()))
    }
}

impl<T: Outbox, S: Sink<T>> Worker<T, S> {
    /// Claim, publish, then record the outcomes *and* claim the next batch in one
    /// transaction: one commit per batch. That transaction runs while the sink has the
    /// batch in between, so a full batch's database round trip costs the worker no time
    /// when the sink takes longer: the worker holds the batch in flight and the next
    /// one, claimed ahead.
    pub(crate) async fn run(self) -> Result<(), OutboxError> {
        let mut state = State::new(&self.relay.pool);
        loop {
            let stopping = self.stopping();
            if stopping {
                Self::hand_back_ahead(&mut state);
                if state.pending.outcomes.is_empty() {
                    return Ok(());
                }
            }
            let batch = match state.ahead.take() {
                Some(batch) => batch,
                None => match self.claim(&mut state, stopping).await? {
                    Some(batch) => batch,
                    None => continue,
                },
            };
            let Some(batch) = Self::renew_to_send(&mut state, batch).await else {
                continue;
            };
            self.publish_and_settle(&mut state, batch).await?;
        }
    }

    /// The claim step: records the pending outcomes and claims the next batch, in one
    /// transaction. `None` when there is nothing to publish now: the worker was idle,
    /// backed off, or is stopping.
    async fn claim(
        &self,
        state: &mut State<'_, T>,
        stopping: bool,
    ) -> Result<Option<Batch<T>>, OutboxError> {
        // After a batch that drained what was due, claiming again would find nothing (at
        // a steady trickle, every other claim did): record it alone, and wait for a
        // wake-up. Whatever was enqueued meanwhile has sent one. After a failure,
        // outcomes are recorded alone before the next claim: a claim that keeps failing
        // would roll them back with it every time.
        let pending = &state.pending;
        let record_first = state.failures > 0 && !pending.outcomes.is_empty();
        let claim_next = !stopping && !pending.drained && !pending.unavailable && !record_first;
        match self
            .record_and_claim(&mut state.conn, pending, claim_next, &[])
            .await
        {
            Ok(batch) => {
                state.failures = 0;
                let unavailable = std::mem::take(&mut state.pending).unavailable;
                if batch.is_empty() {
                    // Idle: the connection goes back to the pool until there is work.
                    state.conn.release();
                    if stopping {
                        // Recorded: the loop ends.
                    } else if unavailable {
                        self.pause(self.relay.unavailable.delay(state.held_back))
                            .await;
                    } else if !record_first {
                        self.idle().await;
                    }
                    return Ok(None);
                }
                if self.stopping() {
                    // Shutdown came while the claim ran (or the fleet's lease on the
                    // target ended): handed back, not sent.
                    state.pending.release(&batch.claims);
                    return Ok(None);
                }
                Ok(Some(batch))
            }
            Err(error) if !error.is_transient() => {
                let pending = std::mem::take(&mut state.pending);
                Err(self.stop_on(error, &mut state.conn, pending).await)
            }
            Err(error) => {
                // The pool tests it on release, and closes it if it is broken.
                state.conn.release();
                self.back_off(&error, state).await;
                Ok(None)
            }
        }
    }

    /// The renew step: the sink gets a batch with two thirds of its lease left. One
    /// claimed ahead waited for the batch before it, and one claimed just now may have
    /// had a late commit (a slow one, a pause). What is dropped behind an event of its
    /// key taken over is handed back. `None` when no row is left.
    async fn renew_to_send(state: &mut State<'_, T>, batch: Batch<T>) -> Option<Batch<T>> {
        let Batch {
            claims,
            full,
            more,
            behind,
        } = batch;
        let (claims, dropped) = renewal::renew_ahead(&mut state.conn, claims, Needed::ToSend).await;
        state.pending.release(&behind);
        state.pending.release(&dropped);
        (!claims.is_empty()).then_some(Batch {
            claims,
            full,
            more,
            behind: Vec::new(),
        })
    }

    /// The publish step, with the batch transaction beside it, then the settle step:
    /// what that transaction did decides what is pending and what comes next.
    async fn publish_and_settle(
        &self,
        state: &mut State<'_, T>,
        batch: Batch<T>,
    ) -> Result<(), OutboxError> {
        if batch.more {
            // There may be more: bring in another idle worker, which in turn brings in
            // the next while it finds full batches.
            self.wakeups.more();
        }
        let earlier = std::mem::take(&mut state.pending);
        let (published, beside) = self.publish(batch, &mut state.conn, &earlier).await;
        state.pending = published;
        match beside {
            Some(Ok(next)) => {
                state.failures = 0;
                state.ahead = next;
            }
            Some(Err(error)) if !error.is_transient() => {
                let pending = std::mem::take(&mut state.pending).after(earlier);
                return Err(self.stop_on(error, &mut state.conn, pending).await);
            }
            Some(Err(error)) => {
                state.pending = std::mem::take(&mut state.pending).after(earlier);
                self.back_off(&error, state).await;
            }
            None => state.pending = std::mem::take(&mut state.pending).after(earlier),
        }
        if state.pending.unavailable {
            // The destination is down: the batch claimed ahead goes back untouched.
            Self::hand_back_ahead(state);
            state.held_back = state.held_back.saturating_add(1);
        } else {
            state.held_back = 0;
        }
        Ok(())
    }

    /// The hand-back step: a batch claimed ahead that will not be sent goes back,
    /// `READY`, due now, its attempt not counted (with the pending outcomes).
    fn hand_back_ahead(state: &mut State<'_, T>) {
        let ahead = std::mem::replace(&mut state.ahead, Batch::empty());
        state.pending.release(&ahead.claims);
        state.pending.release(&ahead.behind);
    }

    /// The back-off step, after the batch transaction failed (transiently) once more:
    /// waits before the next try, and gives up on the pending outcomes if their leases
    /// would end first.
    async fn back_off(&self, error: &OutboxError, state: &mut State<'_, T>) {
        state.failures += 1;
        let table = T::SPEC.table;
        let delay = Backoff::BATCH_TRANSACTION.delay(state.failures);
        let pending = &mut state.pending;
        let waiting = !pending.outcomes.is_empty();
        let given_up = pending.give_up_before(Instant::now() + delay);
        if given_up > 0 {
            tracing::error!(table, %error, rows = given_up,
                "cannot record outcomes before their leases end; the events will be claimed and published again");
        }
        if !pending.outcomes.is_empty() {
            tracing::warn!(table, %error, "recording outcomes failed; retrying");
        } else if !waiting {
            tracing::warn!(table, %error, "claim failed; backing off");
        }
        if pending.outcomes.is_empty() {
            self.pause(delay).await;
        } else {
            // Outcomes are waiting: retry even while shutting down.
            sleep(delay).await;
        }
    }

    /// Whether to claim no more: shutdown, or the end of a fleet's lease on the target
    /// (checked here too, not only by the fleet cancelling `stop`: a process that wakes
    /// from a pause must not claim before the fleet's own task has run).
    fn stopping(&self) -> bool {
        self.stop.is_cancelled() || self.relay.tenure.as_ref().is_some_and(|t| !t.is_live())
    }

    /// Waits for a wake-up, the poll interval or shutdown.
    ///
    /// A wake-up wakes one worker, for a signal no claim has answered yet ([`Wakeups`]):
    /// waking every idle worker per notification made 2.5-3 claim statements per claimed
    /// batch, most of them finding nothing. A wake-up sent while no worker waits is kept,
    /// so none is lost between a worker's last claim and its wait; a worker that claims
    /// a full batch wakes the next.
    async fn idle(&self) {
        tokio::select! {
            () = self.wakeups.idle(self.relay.poll_interval) => {}
            () = self.stop.cancelled() => {}
        }
    }

    async fn pause(&self, delay: Duration) {
        tokio::select! {
            () = sleep(delay) => {}
            () = self.stop.cancelled() => {}
        }
    }
}
