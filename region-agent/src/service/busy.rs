//! The pools the background rounds visit: those touched since a report round last found them
//! settled. An idle pool costs the rounds nothing, however many pools the agent holds.
//!
//! A pool is *listed* from the moment anything takes its agent's lock to act on it (a request, a
//! grant, a settlement: [`PoolSlot::agent`](super::pool_slot::PoolSlot::agent)) until a report
//! round finds it settled: nothing owed, no lease live, no renewal in flight
//! ([`PoolAgent::settled`](crate::global::PoolAgent::settled)). Listing and unlisting both happen
//! under the pool agent's lock, so a touch after the round's look always lists the pool again:
//! nothing a round must do is ever missed. A settled pool waits in a queue (one entry per pool)
//! until it may be forgotten ([`POOL_IDLE_MS`](super::POOL_IDLE_MS) after it settled): the
//! upkeep round looks only at the queue's due head.
//!
//! Lock order: a pool agent's lock before this registry's (which is a leaf).

use std::collections::{BTreeSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_shared::ids::{PoolId, TenantId};

use super::lock;

/// A pool held, by tenant and pool.
pub(super) type PoolKey = (TenantId, PoolId);

/// Most settled pools one upkeep round looks at to forget (I10: a round's work is bounded; the rest
/// wait for the next round).
pub const MAX_SETTLED_CHECKS_PER_ROUND: usize = 4_096;

/// The pools listed, and the settled ones waiting to be forgotten.
#[derive(Default)]
pub(super) struct BusyPools {
    /// Pools touched since they last settled, sorted (the report round's order).
    listed: Mutex<BTreeSet<PoolKey>>,
    /// Pools that settled, in the order they were queued: at most one entry per slot held (an
    /// entry names its slot, so one left by a forgotten slot is told from its successor's).
    settled: Mutex<VecDeque<Settled>>,
    /// The next slot's number.
    next_slot_id: AtomicU64,
}

/// A settled pool's entry in the queue: when it settled (epoch ms), its key, and its slot's number.
pub(super) type Settled = (u64, PoolKey, u64);

impl BusyPools {
    /// A number for a new slot, never given before.
    pub(super) fn new_slot_id(&self) -> u64 {
        self.next_slot_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Lists `key` (its slot's flag went from unlisted to listed, under its agent's lock).
    pub(super) fn list(&self, key: &PoolKey) {
        lock(&self.listed).insert(key.clone());
    }

    /// Unlists `key` (it settled; under its agent's lock).
    pub(super) fn settle(&self, key: &PoolKey) {
        lock(&self.listed).remove(key);
    }

    /// Forgets `key` altogether (its slot was removed).
    pub(super) fn forget(&self, key: &PoolKey) {
        lock(&self.listed).remove(key);
    }

    /// The pools listed now, in order.
    pub(super) fn listed(&self) -> Vec<PoolKey> {
        lock(&self.listed).iter().cloned().collect()
    }

    /// How many pools are listed.
    pub(super) fn listed_count(&self) -> usize {
        lock(&self.listed).len()
    }

    /// Takes the settled pools that settled at or before `settled_by_ms`, oldest first, at most
    /// `max`.
    pub(super) fn take_settled(&self, settled_by_ms: u64, max: usize) -> Vec<Settled> {
        let mut settled = lock(&self.settled);
        let due = settled
            .iter()
            .take(max)
            .take_while(|(at_ms, _, _)| *at_ms <= settled_by_ms)
            .count();
        settled.drain(..due).collect()
    }

    /// Queues `key`'s slot number `slot_id`, settled at `settled_at_ms`, to be looked at once it
    /// may be forgotten (at most one entry per slot: the slot says whether it has one). An entry
    /// queued out of order is looked at late, never early.
    pub(super) fn queue(&self, key: PoolKey, slot_id: u64, settled_at_ms: u64) {
        lock(&self.settled).push_back((settled_at_ms, key, slot_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str) -> PoolKey {
        (
            TenantId::parse(tenant).expect("tenant"),
            PoolId::parse("api").expect("pool"),
        )
    }

    #[test]
    fn settled_pools_come_out_oldest_first_and_only_when_due() {
        let busy = BusyPools::default();
        busy.list(&key("b"));
        busy.list(&key("a"));
        assert_eq!(busy.listed(), vec![key("a"), key("b")]);
        busy.settle(&key("b"));
        busy.queue(key("b"), 7, 1_000);
        busy.settle(&key("a"));
        busy.queue(key("a"), 8, 2_000);
        assert_eq!(busy.listed_count(), 0);
        assert!(busy.take_settled(999, 10).is_empty());
        assert_eq!(busy.take_settled(1_500, 10), vec![(1_000, key("b"), 7)]);
        busy.queue(key("b"), 7, 3_000);
        assert_eq!(busy.take_settled(5_000, 1), vec![(2_000, key("a"), 8)]);
        assert_eq!(busy.take_settled(5_000, 10), vec![(3_000, key("b"), 7)]);
        assert!(busy.take_settled(u64::MAX, 10).is_empty());
    }
}
