//! The rule of a key's run: once an event of a key does not go (not published, not
//! decodable, no longer owned), no event after it in that key goes either; those wait
//! behind it, handed back as if never claimed. And where each event of a batch stands
//! in its key's run.

use std::collections::HashMap;

use super::claim::Claim;
use crate::spec::Outbox;

/// Each claim's depth in its key's run, `claims` being in id order: 0 for a key's first
/// event in them, 1 for its second, ..; 0 for an event without a key.
pub(crate) fn depths<T: Outbox>(claims: &[Claim<T>]) -> impl Iterator<Item = usize> + '_ {
    // An unkeyed table's batches (every event 0) allocate nothing.
    let keyed = T::SPEC.key().is_some();
    let mut seen: HashMap<&str, usize> =
        HashMap::with_capacity(if keyed { claims.len() } else { 0 });
    claims.iter().map(move |claim| {
        claim.key().map_or(0, |key| {
            let next = seen.entry(key).or_default();
            *next += 1;
            *next - 1
        })
    })
}

/// The most events of one key in `claims` (1 when no key repeats, 0 for none).
pub(crate) fn longest_run<T: Outbox>(claims: &[Claim<T>]) -> usize {
    depths(claims).max().map_or(0, |deepest| deepest + 1)
}

/// The keys whose run broke so far, going through events in order (by id, within each
/// key).
#[derive(Debug, Default)]
pub(crate) struct BrokenRuns(Vec<String>);

impl BrokenRuns {
    /// Whether an event of `key`, after every event noted so far, may go. An event
    /// without a key is never held back.
    pub(crate) fn lets_go(&self, key: Option<&str>) -> bool {
        key.is_none_or(|key| !self.0.iter().any(|broken| broken == key))
    }

    /// Notes that an event of `key` did not go.
    pub(crate) fn break_at(&mut self, key: Option<&str>) {
        if let Some(key) = key
            && self.lets_go(Some(key))
        {
            self.0.push(key.to_owned());
        }
    }

    /// For `events` in order, each a key and whether the event went: whether it was held
    /// back (after an event of its key that did not go).
    pub(crate) fn held<'k>(events: impl Iterator<Item = (Option<&'k str>, bool)>) -> Vec<bool> {
        let mut broken = Self::default();
        events
            .map(|(key, went)| {
                let held = !broken.lets_go(key);
                if !went {
                    broken.break_at(key);
                }
                held
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::BrokenRuns;

    #[test]
    fn a_run_is_held_after_its_first_event_that_did_not_go() {
        let keys = [Some("a"), Some("b"), None, Some("a"), Some("b"), Some("a")];
        let went = [false, true, false, true, true, true];
        assert_eq!(
            BrokenRuns::held(keys.into_iter().zip(went)),
            [false, false, false, true, false, true],
            "a's events after its first are held; b's and the unkeyed event are not"
        );
    }
}
