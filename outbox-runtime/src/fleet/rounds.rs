//! A member's rounds: every third of a lease, say it is alive, renew its leases, take
//! or give up targets to hold its share; at shutdown, give everything up.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::leases::{Leases, Taken};
use super::serve::Served;
use super::{Fleet, Target};
use crate::error::OutboxError;
use crate::relay::tenure::Tenure;
use crate::sink::Sink;
use crate::spec::Outbox;

impl<T: Outbox, S: Sink<T>> Fleet<T, S> {
    pub(super) fn leases(&self) -> Leases<'_> {
        Leases {
            home: &self.home,
            fleet: &self.name,
            member: &self.member,
            lease: self.lease,
        }
    }

    /// Serves this member's share of the targets until `shutdown` is cancelled, then
    /// stops its relays (each records what it had in flight and hands the rest back)
    /// and gives its targets up, so the other members take them at once.
    ///
    /// Creates the fleet's tables in the home database first ([`migrate`](super::migrate)).
    /// A home database that does not answer is logged and tried again every round
    /// (meanwhile the leases run out, and the relays stop claiming); any other error
    /// of the home database (a missing privilege) stops the member and is returned.
    /// The targets' own errors never stop it: each target's relay backs off, or is
    /// started again, on its own.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), OutboxError> {
        super::migrate(&self.home).await?;
        let mut member = Member {
            fleet: Arc::new(self),
            targets: BTreeMap::new(),
            served: BTreeMap::new(),
            leaving: JoinSet::new(),
            discovered: None,
            home_down: false,
        };
        let every = member.fleet.lease / 3;
        let outcome = loop {
            let started = Instant::now();
            match member.round().await {
                Ok(()) => member.home_down = false,
                Err(error) if error.is_transient() => {
                    if !member.home_down {
                        tracing::warn!(fleet = %member.fleet.name, %error, "the fleet's home database does not answer; its leases run out meanwhile");
                    }
                    member.home_down = true;
                }
                Err(error) => break Err(error),
            }
            tokio::select! {
                () = sleep_until(started + every) => {}
                () = shutdown.cancelled() => break Ok(()),
            }
        };
        member.leave().await;
        outcome
    }
}

/// What one member knows between rounds.
struct Member<T, S> {
    fleet: Arc<Fleet<T, S>>,
    /// The targets as last discovered, by name.
    targets: BTreeMap<String, Target>,
    /// The targets this member serves, by name.
    served: BTreeMap<String, Served>,
    /// The targets being given up: their relays finishing, then their leases released.
    leaving: JoinSet<()>,
    /// When discovery last succeeded.
    discovered: Option<Instant>,
    /// Whether the last round failed to reach the home database (logged once).
    home_down: bool,
}

impl<T: Outbox, S: Sink<T>> Member<T, S> {
    /// The end of a lease taken or renewed by a statement sent at `sent`, by this
    /// process's clock: a tenth early, for clocks that run at slightly different rates.
    fn tenure_from(&self, sent: Instant) -> Instant {
        sent + self.fleet.lease * 9 / 10
    }

    async fn round(&mut self) -> Result<(), OutboxError> {
        self.discover().await;
        let fleet = Arc::clone(&self.fleet);
        let leases = fleet.leases();
        let members = usize::try_from(leases.heartbeat().await?)
            .unwrap_or(1)
            .max(1);
        let names: Vec<&str> = self.targets.keys().map(String::as_str).collect();
        leases.offer(&names).await?;
        self.renew(&leases).await?;

        // Targets no longer discovered, then the excess over this member's share.
        let gone: Vec<String> = self
            .served
            .keys()
            .filter(|target| !self.targets.contains_key(*target))
            .cloned()
            .collect();
        for target in gone {
            self.retire(&target, true);
        }
        let share = self
            .targets
            .len()
            .div_ceil(members)
            .min(self.fleet.capacity());
        let excess: Vec<String> = self.served.keys().skip(share).cloned().collect();
        for target in excess {
            self.retire(&target, true);
        }
        self.take(&leases, share).await
    }

    /// Renews the leases of the targets served; stops serving those it could not.
    async fn renew(&mut self, leases: &Leases<'_>) -> Result<(), OutboxError> {
        let held: Vec<Taken> = self
            .served
            .iter()
            .map(|(target, served)| Taken {
                target: target.clone(),
                generation: served.generation,
            })
            .collect();
        let sent = Instant::now();
        let renewed = leases.renew(&held).await?;
        let until = self.tenure_from(sent);
        for taken in held {
            if renewed.contains(&taken.target) {
                self.renewed(&taken.target, until);
            } else {
                tracing::warn!(fleet = %self.fleet.name, target = taken.target, "lost the target's lease (it ran out, or another member took it); no longer serving it");
                self.retire(&taken.target, false);
            }
        }
        Ok(())
    }

    /// Takes free targets up to `share`, and starts serving them.
    async fn take(&mut self, leases: &Leases<'_>, share: usize) -> Result<(), OutboxError> {
        let free: Vec<&str> = self
            .targets
            .keys()
            .filter(|target| !self.served.contains_key(*target))
            .map(String::as_str)
            .collect();
        let sent = Instant::now();
        let taken = leases
            .take(&free, share.saturating_sub(self.served.len()))
            .await?;
        let until = self.tenure_from(sent);
        for taken in taken {
            let Some(target) = self.targets.get(&taken.target) else {
                continue;
            };
            let served = Served::start(
                &self.fleet,
                target,
                taken.generation,
                Arc::new(Tenure::until(until)),
            );
            self.served.insert(taken.target, served);
        }
        Ok(())
    }

    /// Extends a renewed target's tenure, and starts its relay again if it stopped at
    /// the tenure's end (the renewal came late, while the lease was still live).
    fn renewed(&mut self, target: &str, until: Instant) {
        let Some(served) = self.served.get_mut(target) else {
            return;
        };
        served.tenure.extend(until);
        if served.is_finished()
            && let Some(known) = self.targets.get(target)
        {
            *served = Served::start(
                &self.fleet,
                known,
                served.generation,
                Arc::clone(&served.tenure),
            );
        }
    }

    /// Stops serving `target` at once (no claim from now on) and, on a task of its own,
    /// lets its relay record what it had in flight (within its shutdown grace), then
    /// releases its lease if `release` (not one lost already). A round that waited for
    /// the relay would renew the other targets late.
    fn retire(&mut self, target: &str, release: bool) {
        let Some(served) = self.served.remove(target) else {
            return;
        };
        served.tenure.end();
        let taken = Taken {
            target: target.to_owned(),
            generation: served.generation,
        };
        let fleet = Arc::clone(&self.fleet);
        self.leaving.spawn(async move {
            served.stop().await;
            if release && let Err(error) = fleet.leases().release(&taken).await {
                tracing::warn!(fleet = %fleet.name, target = taken.target, %error, "cannot give the target up; it waits for its lease to run out");
            }
        });
        // Those done since.
        while self.leaving.try_join_next().is_some() {}
    }

    /// Calls the discovery when it is due; an error keeps the last set.
    async fn discover(&mut self) {
        let due = self
            .discovered
            .is_none_or(|at| at.elapsed() >= self.fleet.discovery_interval);
        if !due {
            return;
        }
        match (self.fleet.discover)().await {
            Ok(targets) => {
                self.discovered = Some(Instant::now());
                self.targets = targets
                    .into_iter()
                    .map(|target| (target.name.clone(), target))
                    .collect();
                let names: Vec<&str> = self.targets.keys().map(String::as_str).collect();
                if let Err(error) = self.fleet.leases().forget_others(&names).await {
                    tracing::debug!(fleet = %self.fleet.name, %error, "cannot forget the targets no longer discovered");
                }
            }
            Err(error) => {
                tracing::warn!(fleet = %self.fleet.name, error = %error, "cannot discover the fleet's targets; keeping the last ones");
            }
        }
    }

    /// Stops every relay, gives every target up and leaves the fleet.
    async fn leave(mut self) {
        let all: Vec<String> = self.served.keys().cloned().collect();
        for target in all {
            self.retire(&target, true);
        }
        while let Some(done) = self.leaving.join_next().await {
            if let Err(error) = done
                && error.is_panic()
            {
                std::panic::resume_unwind(error.into_panic());
            }
        }
        if let Err(error) = self.fleet.leases().leave().await {
            tracing::debug!(fleet = %self.fleet.name, %error, "cannot say this member left");
        }
    }
}
