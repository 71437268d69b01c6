//! The in-process limiter store: the embedded default (`allot dev`) and the twin the Redis store is
//! tested against.
//!
//! It behaves exactly like the Lua scripts, because it runs the pure core they mirror: a map from key
//! to `(state, expires_at_ms)` behind one mutex, read and written in one critical section per call
//! (the script's atomicity), with the TTLs the pure functions compute. An expired key reads as
//! absent, like Redis: a key written at `t` with TTL `d` is live through `t + d` and gone after.
//!
//! Bounded (I10): it holds at most `max_keys` keys. A call that needs new keys when the map is full
//! first drops every expired key; if that does not make room it fails with
//! [`StoreError::KeyCapReached`] and writes nothing. It never evicts a live key, because that would
//! silently reset a counter (a fuller bucket, like an eviction in Redis). Dropping expired keys scans
//! the map, so a store kept at its cap pays O(keys) per new key; size the cap above the live set.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use allot_shared::clock::Clock;
use allot_shared::limit::concurrency::SemaphoreState;
use allot_shared::limit::multi::{MultiRuleError, RuleInput, State, decide_all};

use super::batch::RuleBatch;
use super::store::{
    BatchDecision, LeaseCall, LeaseOperation, LeaseOutcome, LimiterStore, Rejection, StoreError,
};

/// Default cap on the keys an in-process store holds (I10).
pub const DEFAULT_IN_PROCESS_MAX_KEYS: usize = 100_000;

/// What one key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    /// A rule's state.
    Rule(State),
    /// A recorded admission, replayed to a retry with the same decision id.
    Record(BatchDecision),
    /// A concurrency lease set.
    Leases(SemaphoreState),
}

#[derive(Debug, Clone)]
struct Entry {
    value: Stored,
    /// Epoch ms on the store's clock; the key is gone once `now > expires_at_ms`.
    expires_at_ms: u64,
}

/// A limiter store in this process's memory. See the module docs.
pub struct InProcessStore {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    entries: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for InProcessStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessStore")
            .field("max_keys", &self.max_keys)
            .field("keys", &self.lock().len())
            .finish_non_exhaustive()
    }
}

/// The keys of one critical section, with expiry applied at `now_ms`.
struct Keys<'a> {
    map: MutexGuard<'a, HashMap<String, Entry>>,
    now_ms: u64,
    max_keys: usize,
}

impl Keys<'_> {
    /// The live value under `key`; an expired one is removed and reads as absent.
    fn live(&mut self, key: &str) -> Option<&Stored> {
        if self
            .map
            .get(key)
            .is_some_and(|e| e.expires_at_ms < self.now_ms)
        {
            self.map.remove(key);
        }
        self.map.get(key).map(|entry| &entry.value)
    }

    /// Checks that `keys` can be written: drops expired keys when they would not fit, and refuses
    /// (writing nothing) when they still do not.
    fn make_room<'k>(&mut self, keys: impl Iterator<Item = &'k str>) -> Result<(), StoreError> {
        let new_keys = keys.filter(|key| !self.map.contains_key(*key)).count();
        if self.map.len() + new_keys <= self.max_keys {
            return Ok(());
        }
        let now_ms = self.now_ms;
        self.map.retain(|_, entry| entry.expires_at_ms >= now_ms);
        if self.map.len() + new_keys <= self.max_keys {
            return Ok(());
        }
        Err(StoreError::KeyCapReached {
            max_keys: self.max_keys,
        })
    }

    fn write(&mut self, key: &str, value: Stored, ttl_ms: u64) {
        let expires_at_ms = self.now_ms + ttl_ms;
        self.map.insert(
            key.to_owned(),
            Entry {
                value,
                expires_at_ms,
            },
        );
    }
}

impl InProcessStore {
    /// A store reading time from `clock`, holding at most `max_keys` keys.
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        Self {
            clock,
            max_keys,
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // A panic cannot leave a half-applied call behind: every check runs before the first write,
        // and writes are infallible map inserts. So a poisoned map is still consistent.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn keys(&self) -> Keys<'_> {
        Keys {
            map: self.lock(),
            now_ms: self.clock.now_ms(),
            max_keys: self.max_keys,
        }
    }

    /// The live value under `key` and its expiry (epoch ms), for tests comparing stores.
    #[cfg(test)]
    pub(crate) fn peek(&self, key: &str) -> Option<(Stored, u64)> {
        let mut keys = self.keys();
        keys.live(key)?;
        keys.map
            .get(key)
            .map(|entry| (entry.value.clone(), entry.expires_at_ms))
    }

    fn decide_locked(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        let mut keys = self.keys();
        if batch.record_ttl_ms() > 0 {
            match keys.live(batch.record_key()) {
                Some(Stored::Record(recorded)) => {
                    return Ok(BatchDecision {
                        replayed: true,
                        advisory_denials: Vec::new(),
                        ..recorded.clone()
                    });
                }
                Some(_) => return Err(state_mismatch("the decision record holds another value")),
                None => {}
            }
        }
        let mut states = Vec::with_capacity(batch.rules().len());
        for rule in batch.rules() {
            states.push(match keys.live(rule.key()) {
                None => None,
                Some(Stored::Rule(state)) => Some(state.clone()),
                Some(_) => return Err(state_mismatch("a rule key holds another value")),
            });
        }
        let inputs: Vec<RuleInput<'_>> = batch
            .rules()
            .iter()
            .zip(&states)
            .map(|(rule, state)| RuleInput {
                algorithm: rule.algorithm(),
                state: state.as_ref(),
                cost_millitokens: rule.cost_millitokens(),
                advisory: rule.advisory(),
            })
            .collect();
        let decision =
            decide_all(&inputs, keys.now_ms, batch.decision_id().as_str()).map_err(reject)?;
        let outcome = BatchDecision::from_multi(&decision);
        debug_assert!(decision.allowed || decision.writes.iter().all(Option::is_none));
        // A denial wrote nothing; a dry run writes nothing either.
        if !decision.allowed || batch.dry_run() {
            return Ok(outcome);
        }
        let record = (batch.record_ttl_ms() > 0).then_some(batch.record_key());
        let written = batch
            .rules()
            .iter()
            .zip(&decision.writes)
            .filter(|(_, write)| write.is_some())
            .map(|(rule, _)| rule.key());
        keys.make_room(written.chain(record))?;
        for (rule, write) in batch.rules().iter().zip(decision.writes) {
            if let Some(write) = write {
                keys.write(rule.key(), Stored::Rule(write.state), write.ttl_ms);
            }
        }
        if let Some(record_key) = record {
            keys.write(
                record_key,
                Stored::Record(outcome.clone()),
                batch.record_ttl_ms(),
            );
        }
        Ok(outcome)
    }

    fn leases_locked(
        &self,
        call: &LeaseCall,
        operation: LeaseOperation,
    ) -> Result<LeaseOutcome, StoreError> {
        let mut keys = self.keys();
        let now_ms = keys.now_ms;
        let state = match keys.live(call.key()) {
            None => None,
            Some(Stored::Leases(state)) => Some(state.clone()),
            Some(_) => return Err(state_mismatch("the lease set holds another value")),
        };
        let semaphore = call.semaphore();
        let lease_id = call.lease_id().as_str();
        match operation {
            LeaseOperation::Acquire => {
                let acquire = semaphore.acquire(state.as_ref(), now_ms, lease_id);
                if let Some((leases, ttl_ms)) = acquire.write {
                    keys.make_room(std::iter::once(call.key()))?;
                    keys.write(call.key(), Stored::Leases(leases), ttl_ms);
                }
                Ok(LeaseOutcome {
                    held: acquire.acquired,
                    in_flight: acquire.in_flight,
                })
            }
            LeaseOperation::Renew => match semaphore.renew(state.as_ref(), now_ms, lease_id) {
                Some((leases, ttl_ms)) => {
                    let in_flight = leases.leases.len() as u64;
                    keys.write(call.key(), Stored::Leases(leases), ttl_ms);
                    Ok(LeaseOutcome {
                        held: true,
                        in_flight,
                    })
                }
                // Not held, so releasing it would change nothing: what release keeps is the live set.
                None => Ok(LeaseOutcome {
                    held: false,
                    in_flight: semaphore
                        .release(state.as_ref(), now_ms, lease_id)
                        .leases
                        .len() as u64,
                }),
            },
            LeaseOperation::Release => {
                // A lease is held exactly when renewing it would succeed.
                let held = semaphore.renew(state.as_ref(), now_ms, lease_id).is_some();
                let remaining = semaphore.release(state.as_ref(), now_ms, lease_id);
                let in_flight = remaining.leases.len() as u64;
                if remaining.leases.is_empty() {
                    keys.map.remove(call.key());
                } else if let Some(entry) = keys.map.get_mut(call.key()) {
                    // The key keeps its expiry: it is already at least the latest remaining lease's.
                    entry.value = Stored::Leases(remaining);
                }
                Ok(LeaseOutcome { held, in_flight })
            }
        }
    }
}

fn state_mismatch(detail: &str) -> StoreError {
    StoreError::Rejected {
        kind: Rejection::StateMismatch,
        detail: detail.to_owned(),
    }
}

fn reject(error: MultiRuleError) -> StoreError {
    let kind = match error {
        MultiRuleError::StateMismatch { .. } => Rejection::StateMismatch,
        MultiRuleError::RuleCount(_) | MultiRuleError::Param { .. } => Rejection::InvalidArgument,
    };
    StoreError::Rejected {
        kind,
        detail: error.to_string(),
    }
}

#[async_trait::async_trait]
impl LimiterStore for InProcessStore {
    async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        self.decide_locked(batch)
    }

    async fn acquire_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.leases_locked(call, LeaseOperation::Acquire)
    }

    async fn renew_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.leases_locked(call, LeaseOperation::Renew)
    }

    async fn release_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.leases_locked(call, LeaseOperation::Release)
    }
}

#[cfg(test)]
mod tests {
    use allot_shared::clock::ManualClock;
    use allot_shared::ids::{DecisionId, TenantId};

    use super::*;
    use crate::limiter::batch::{BatchRule, RuleParams};

    const T0: u64 = 1_700_000_000_000;

    /// A fixed window of 5 per `window_ms` on `key`: its key expires at the window's end.
    fn window_rule(key: &str, id: &str, window_ms: u64) -> RuleBatch {
        let rule = BatchRule::new(
            format!("rl:v1:{{t:atlas}}:{key}"),
            RuleParams::FixedWindow {
                limit_units: 5,
                window_ms,
            },
            1_000,
        )
        .expect("valid");
        RuleBatch::new(
            &TenantId::parse("atlas").expect("tenant"),
            DecisionId::parse(id).expect("id"),
            0,
            vec![rule],
        )
        .expect("valid")
    }

    fn decide(store: &InProcessStore, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        store.decide_locked(batch)
    }

    #[test]
    fn at_the_cap_expired_keys_make_room_and_live_keys_are_never_evicted() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = InProcessStore::new(clock.clone(), 2);
        // T0 is a multiple of 10 s: a expires at T0 + 1,000, b at T0 + 10,000.
        decide(&store, &window_rule("a", "r-1", 1_000)).expect("first key");
        clock.set(T0 + 500);
        decide(&store, &window_rule("b", "r-2", 10_000)).expect("second key");
        let before = store.peek("rl:v1:{t:atlas}:a").expect("a is live");
        assert_eq!(
            decide(&store, &window_rule("c", "r-3", 1_000)),
            Err(StoreError::KeyCapReached { max_keys: 2 })
        );
        assert_eq!(
            store.peek("rl:v1:{t:atlas}:a"),
            Some(before),
            "nothing evicted"
        );
        assert_eq!(store.peek("rl:v1:{t:atlas}:c"), None, "nothing written");
        // Updating an existing key needs no room.
        decide(&store, &window_rule("a", "r-4", 1_000)).expect("existing key");
        // After a's window (its TTL) has passed, a makes room; b is still live and stays.
        clock.set(T0 + 1_001);
        decide(&store, &window_rule("c", "r-5", 1_000)).expect("room after expiry");
        assert_eq!(store.peek("rl:v1:{t:atlas}:a"), None);
        assert!(store.peek("rl:v1:{t:atlas}:b").is_some(), "b still lives");
    }

    #[test]
    fn an_expired_key_reads_as_absent_like_redis() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = InProcessStore::new(clock.clone(), 10);
        for n in 0..5 {
            decide(&store, &window_rule("a", &format!("r-{n}"), 1_000)).expect("decides");
        }
        let (_, expires_at_ms) = store.peek("rl:v1:{t:atlas}:a").expect("written");
        assert_eq!(expires_at_ms, T0 + 1_000);
        clock.set(expires_at_ms - 1);
        assert!(
            !decide(&store, &window_rule("a", "r-9", 1_000))
                .expect("decides")
                .allowed
        );
        clock.set(expires_at_ms);
        assert!(
            store.peek("rl:v1:{t:atlas}:a").is_some(),
            "live at its expiry instant"
        );
        clock.set(expires_at_ms + 1);
        assert_eq!(store.peek("rl:v1:{t:atlas}:a"), None);
    }
}
