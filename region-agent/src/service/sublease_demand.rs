//! What every gateway subscription (a stream and one of its buckets) wants of each pool, so that
//! scarce tokens are carved in proportion to demand. Bounded (I10): at most [`MAX_SUBSCRIPTIONS`]
//! entries, a stale one counting for nothing and forgotten first when full.

use std::collections::HashMap;

use super::pools::PoolKey;

/// Most (stream, bucket) subscriptions whose demand the agent weighs when tokens are scarce (I10).
pub const MAX_SUBSCRIPTIONS: usize = 65_536;
/// A subscription's demand counts toward its pool's total for this long after it was stated, ms.
pub const DEMAND_FRESH_MS: u64 = 30_000;
/// What every subscription wants of each pool: scarce tokens are divided in proportion.
pub(super) struct SubleaseDemand {
    by_pool: HashMap<PoolKey, HashMap<u64, (u64, u64)>>,
    len: usize,
    /// Most entries: [`MAX_SUBSCRIPTIONS`] (smaller in tests).
    capacity: usize,
}

impl Default for SubleaseDemand {
    fn default() -> Self {
        Self::with_capacity(MAX_SUBSCRIPTIONS)
    }
}

impl SubleaseDemand {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            by_pool: HashMap::new(),
            len: 0,
            capacity,
        }
    }

    /// Records that `subscription` wants `requests` of `pool` at `now_ms`, and returns the
    /// pool's fresh total (this subscription included).
    pub(super) fn want(
        &mut self,
        pool: &PoolKey,
        subscription: u64,
        requests: u64,
        now_ms: u64,
    ) -> u64 {
        if self.len >= self.capacity {
            self.forget_stale(now_ms);
        }
        let wants = self.by_pool.entry(pool.clone()).or_default();
        if wants.insert(subscription, (requests, now_ms)).is_none() {
            self.len += 1;
        }
        wants
            .values()
            .filter(|(_, at_ms)| now_ms.saturating_sub(*at_ms) <= DEMAND_FRESH_MS)
            .map(|(wanted, _)| *wanted)
            .fold(0u64, u64::saturating_add)
    }

    /// Forgets `subscription` (its stream ended, or it stopped reporting the bucket).
    pub(super) fn forget(&mut self, subscription: u64) {
        let mut removed = 0;
        for wants in self.by_pool.values_mut() {
            removed += usize::from(wants.remove(&subscription).is_some());
        }
        self.by_pool.retain(|_, wants| !wants.is_empty());
        self.len -= removed;
    }

    fn forget_stale(&mut self, now_ms: u64) {
        for wants in self.by_pool.values_mut() {
            wants.retain(|_, (_, at_ms)| now_ms.saturating_sub(*at_ms) <= DEMAND_FRESH_MS);
        }
        self.by_pool.retain(|_, wants| !wants.is_empty());
        self.len = self.by_pool.values().map(HashMap::len).sum();
        // Still full of fresh entries: drop whole pools until there is room (their gateways are
        // sized alone until they report again).
        while self.len >= self.capacity {
            let Some(key) = self.by_pool.keys().next().cloned() else {
                break;
            };
            if let Some(wants) = self.by_pool.remove(&key) {
                self.len -= wants.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_shared::ids::{PoolId, TenantId};

    fn pool(name: &str) -> PoolKey {
        (
            TenantId::parse("acme").expect("tenant"),
            PoolId::parse(name).expect("pool"),
        )
    }

    #[test]
    fn a_pool_s_total_counts_fresh_wants_only() {
        let mut demand = SubleaseDemand::default();
        assert_eq!(demand.want(&pool("chat"), 1, 10, 0), 10);
        assert_eq!(demand.want(&pool("chat"), 2, 5, 1_000), 15);
        assert_eq!(demand.want(&pool("other"), 3, 7, 1_000), 7);
        // Subscription 1 restates its want: replaced, not added.
        assert_eq!(demand.want(&pool("chat"), 1, 4, 2_000), 9);
        // Past the freshness of subscription 2 (stated at 1 000 ms), only the newer wants count.
        assert_eq!(
            demand.want(&pool("chat"), 1, 4, 1_000 + DEMAND_FRESH_MS + 1),
            4
        );
        demand.forget(1);
        assert_eq!(demand.len, 2);
        assert_eq!(demand.want(&pool("chat"), 4, 1, 2_000), 6);
    }

    #[test]
    fn a_full_table_makes_room_stale_entries_first() {
        const CAPACITY: usize = 64;
        let mut demand = SubleaseDemand::with_capacity(CAPACITY);
        let subscriptions = u64::try_from(CAPACITY).expect("fits");
        for subscription in 0..subscriptions {
            demand.want(&pool("chat"), subscription, 1, 0);
        }
        assert_eq!(demand.len, CAPACITY);
        // All stale by now: forgotten, and the new want stands alone.
        let later_ms = DEMAND_FRESH_MS + 1;
        assert_eq!(demand.want(&pool("other"), u64::MAX, 3, later_ms), 3);
        assert_eq!(demand.len, 1);
        // Full of fresh wants: whole pools are dropped, never past the bound.
        for subscription in 0..subscriptions {
            demand.want(&pool("busy"), subscription, 1, later_ms);
        }
        assert!(demand.len <= CAPACITY);
        assert_eq!(demand.want(&pool("last"), 7, 2, later_ms), 2);
        assert!(demand.len <= CAPACITY);
    }
}
