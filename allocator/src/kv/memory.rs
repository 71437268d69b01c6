//! An in-process [`Kv`] with etcd's semantics: a global revision that increases with every write,
//! per-key modification revisions, guarded transactions, and leases whose expiry deletes their keys.
//!
//! It backs the embedded single-process mode (`allot dev`) and the simulator, where its clock is
//! virtual. Lease expiry is applied lazily, before every operation, and like every deletion it
//! consumes a revision, exactly as etcd's does. It is not durable: a restart forgets everything, which is
//! why it is announced as not for production.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::{Compare, Kv, KvError, Op, TxnOutcome, Versioned};
use crate::clock::Clock;

#[derive(Debug)]
struct Entry {
    value: Vec<u8>,
    mod_revision: i64,
    lease: Option<i64>,
}

#[derive(Debug)]
struct Lease {
    ttl_s: i64,
    expires_at_ms: u64,
}

#[derive(Debug, Default)]
struct State {
    revision: i64,
    entries: BTreeMap<String, Entry>,
    leases: HashMap<i64, Lease>,
    next_lease: i64,
}

/// The in-process store.
pub struct MemoryKv {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
}

impl MemoryKv {
    /// An empty store at revision 1, timing leases with `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: Mutex::new(State {
                revision: 1,
                next_lease: 1,
                ..State::default()
            }),
        }
    }

    /// Locks the state after expiring leases whose time has passed.
    fn lock(&self) -> MutexGuard<'_, State> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now_ms = self.clock.now_ms();
        let expired: Vec<i64> = state
            .leases
            .iter()
            .filter(|(_, lease)| lease.expires_at_ms <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            state.drop_lease(id);
        }
        state
    }
}

impl State {
    fn drop_lease(&mut self, id: i64) {
        if self.leases.remove(&id).is_none() {
            return;
        }
        let before = self.entries.len();
        self.entries.retain(|_, entry| entry.lease != Some(id));
        if self.entries.len() != before {
            self.revision += 1;
        }
    }

    fn holds(&self, compare: &Compare) -> bool {
        match compare {
            Compare::ModRevision { key, revision } => {
                self.entries.get(key).map_or(0, |e| e.mod_revision) == *revision
            }
            Compare::Value { key, value } => {
                self.entries.get(key).is_some_and(|e| &e.value == value)
            }
        }
    }
}

fn versioned(entry: &Entry) -> Versioned {
    Versioned {
        value: entry.value.clone(),
        mod_revision: entry.mod_revision,
    }
}

#[async_trait]
impl Kv for MemoryKv {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, KvError> {
        Ok(self.lock().entries.get(key).map(versioned))
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, KvError> {
        if keys.len() > super::MAX_TXN_OPS {
            return Err(KvError::Refused(
                "too many operations in txn request".to_owned(),
            ));
        }
        let state = self.lock();
        Ok(keys
            .iter()
            .map(|key| state.entries.get(key).map(versioned))
            .collect())
    }

    async fn get_prefix_after(
        &self,
        prefix: &str,
        after: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        use std::ops::Bound;
        let state = self.lock();
        let start = if after.is_empty() {
            Bound::Included(prefix.to_owned())
        } else {
            Bound::Excluded(after.to_owned())
        };
        Ok(state
            .entries
            .range((start, Bound::Unbounded))
            .skip_while(|(key, _)| !key.starts_with(prefix) && key.as_str() < prefix)
            .take_while(|(key, _)| key.starts_with(prefix))
            .take(limit.min(super::MAX_PREFIX_KEYS))
            .map(|(key, entry)| (key.clone(), versioned(entry)))
            .collect())
    }

    async fn get_prefix_newest(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        let state = self.lock();
        let matching: Vec<(&String, &Entry)> = state
            .entries
            .range(prefix.to_owned()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .collect();
        Ok(matching
            .into_iter()
            .rev()
            .take(limit.min(super::MAX_PREFIX_KEYS))
            .map(|(key, entry)| (key.clone(), versioned(entry)))
            .collect())
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> Result<TxnOutcome, KvError> {
        super::check_txn(&compares, &ops)?;
        let mut state = self.lock();
        if !compares.iter().all(|c| state.holds(c)) {
            return Ok(TxnOutcome {
                succeeded: false,
                revision: state.revision,
            });
        }
        for op in &ops {
            if let Op::Put {
                lease: Some(lease), ..
            } = op
                && !state.leases.contains_key(lease)
            {
                return Err(KvError::LeaseNotFound(*lease));
            }
        }
        if !ops.is_empty() {
            state.revision += 1;
        }
        let revision = state.revision;
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    state.entries.insert(
                        key,
                        Entry {
                            value,
                            mod_revision: revision,
                            lease,
                        },
                    );
                }
                Op::Delete { key } => {
                    state.entries.remove(&key);
                }
            }
        }
        Ok(TxnOutcome {
            succeeded: true,
            revision,
        })
    }

    async fn grant_lease(&self, ttl_s: i64) -> Result<i64, KvError> {
        if ttl_s < 1 {
            return Err(KvError::Refused(format!(
                "lease TTL {ttl_s}s must be at least 1s"
            )));
        }
        let now_ms = self.clock.now_ms();
        let mut state = self.lock();
        let id = state.next_lease;
        state.next_lease += 1;
        state.leases.insert(
            id,
            Lease {
                ttl_s,
                expires_at_ms: now_ms + ttl_s.unsigned_abs() * 1_000,
            },
        );
        Ok(id)
    }

    async fn keep_alive(&self, lease: i64) -> Result<i64, KvError> {
        let now_ms = self.clock.now_ms();
        let mut state = self.lock();
        let held = state
            .leases
            .get_mut(&lease)
            .ok_or(KvError::LeaseNotFound(lease))?;
        held.expires_at_ms = now_ms + held.ttl_s.unsigned_abs() * 1_000;
        Ok(held.ttl_s)
    }

    async fn revoke(&self, lease: i64) -> Result<(), KvError> {
        self.lock().drop_lease(lease);
        Ok(())
    }
}
