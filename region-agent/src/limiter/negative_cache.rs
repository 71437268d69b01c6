//! The gateway-side negative cache: after the store denies a key set, deny the same key set locally
//! for a short while without calling the store.
//!
//! A hot key is a load problem on *attempts*: a flood against an exhausted bucket costs the shard one
//! script call per attempt even though every one is denied. After a denial the agent remembers the
//! request's key set until `min(retry hint, max_ttl_ms)` (250 ms by default, the reference design's
//! cap) and denies a repeat from memory, so the flood reaches the shard about once per 250 ms per
//! agent instead of once per attempt.
//!
//! - **What matches.** The same keys in the same order (the same rules for the same principal, in
//!   the same sub-slot) and a cost on the denying rule at least as high as the denied one's: a
//!   cheaper request might fit where the denied one did not, so it goes to the store.
//! - **Never more generous than the store.** A cached answer is a denial; a hit never admits. The
//!   retry hint it reports is the store's original hint less the time since (at least 1 ms), or
//!   "never" for a request that can never fit.
//! - **A gateway retry of a request the store admitted** (same decision id, reply lost before the
//!   gateway got it) is denied locally while an entry for its key set lives, instead of being replayed
//!   from the decision record. That is conservative (a denial, never a second debit) and lasts at
//!   most `max_ttl_ms`.
//! - **Bounded (I10).** At most `max_entries` key sets; a new denial in a full cache evicts the
//!   entry inserted longest ago (evicting early only sends one more attempt to the store).

use std::sync::{Mutex, MutexGuard, PoisonError};

use allot_shared::limit::RetryAfter;

use super::batch::RuleBatch;
use super::bounded::BoundedMap;
use super::store::BatchDecision;

/// Default longest time a denial is served from memory, in ms (the reference design's 250 ms).
pub const DEFAULT_NEGATIVE_CACHE_TTL_MS: u64 = 250;

/// Default cap on cached key sets (I10). Each holds a request's keys (at most 8, about 60 bytes
/// each), so the cache stays within a few MB.
pub const DEFAULT_NEGATIVE_CACHE_MAX_ENTRIES: usize = 10_000;

/// A denial served from memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedDenial {
    /// The denying rule's index in the batch.
    pub denied_by: usize,
    /// What the denying rule had left when the store denied, in its own unit.
    pub remaining: u64,
    /// The store's hint less the time since it was given (at least 1 ms), or never.
    pub retry: RetryAfter,
}

#[derive(Debug)]
struct Entry {
    /// The entry serves denials while `now_ms < until_ms`.
    until_ms: u64,
    denied_by: usize,
    denied_cost_millitokens: u64,
    remaining: u64,
    /// When the store's hint runs out; `None` for never.
    retry_at_ms: Option<u64>,
}

/// The cache. See the module docs.
#[derive(Debug)]
pub(crate) struct NegativeCache {
    max_ttl_ms: u64,
    entries: Mutex<BoundedMap<String, Entry>>,
}

/// The cache key of a batch: its keys, in order. Keys never contain a newline.
fn key_set(batch: &RuleBatch) -> String {
    let mut joined = String::new();
    for rule in batch.rules() {
        joined.push_str(rule.key());
        joined.push('\n');
    }
    joined
}

impl NegativeCache {
    pub(crate) fn new(max_ttl_ms: u64, max_entries: usize) -> Self {
        Self {
            max_ttl_ms,
            entries: Mutex::new(BoundedMap::new(max_entries)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BoundedMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached denial for `batch` at `now_ms`, if one lives and covers the request's cost.
    pub(crate) fn check(&self, batch: &RuleBatch, now_ms: u64) -> Option<CachedDenial> {
        if self.max_ttl_ms == 0 {
            return None;
        }
        let key = key_set(batch);
        let mut entries = self.lock();
        let entry = entries.get(&key)?;
        if now_ms >= entry.until_ms {
            entries.remove(&key);
            return None;
        }
        let cost = batch.rules().get(entry.denied_by)?.cost_millitokens();
        if cost < entry.denied_cost_millitokens {
            return None;
        }
        let retry = match entry.retry_at_ms {
            None => RetryAfter::Never,
            Some(at) => RetryAfter::Ms(at.saturating_sub(now_ms).max(1)),
        };
        Some(CachedDenial {
            denied_by: entry.denied_by,
            remaining: entry.remaining,
            retry,
        })
    }

    /// Remembers the store's denial of `batch` at `now_ms`.
    pub(crate) fn remember(&self, batch: &RuleBatch, decision: &BatchDecision, now_ms: u64) {
        let Some(denied_by) = decision.denied_by.filter(|_| !decision.allowed) else {
            return;
        };
        let Some(rule) = batch.rules().get(denied_by) else {
            return;
        };
        let (hold_ms, retry_at_ms) = match decision.retry {
            RetryAfter::Never => (self.max_ttl_ms, None),
            RetryAfter::Ms(ms) => (ms.min(self.max_ttl_ms), Some(now_ms.saturating_add(ms))),
        };
        if hold_ms == 0 {
            return;
        }
        let entry = Entry {
            until_ms: now_ms.saturating_add(hold_ms),
            denied_by,
            denied_cost_millitokens: rule.cost_millitokens(),
            remaining: decision.remaining.get(denied_by).copied().unwrap_or(0),
            retry_at_ms,
        };
        let mut entries = self.lock();
        if let Err((key, entry)) = entries.insert(key_set(batch), entry) {
            entries.pop_oldest();
            // Room was just made; a failure here would only mean no caching.
            let _ = entries.insert(key, entry);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use allot_shared::ids::{DecisionId, TenantId};

    use super::*;
    use crate::limiter::batch::{BatchRule, RuleParams};

    fn batch(user: &str, cost_millitokens: u64) -> RuleBatch {
        let params = RuleParams::TokenBucket {
            capacity_millitokens: 20_000,
            refill_millitokens: 2_000,
            period_ms: 1_000,
            slack_ms: 0,
        };
        let tenant = TenantId::parse("atlas").expect("tenant");
        let rules = vec![
            BatchRule::new(
                format!("rl:v1:{{t:atlas}}:u:{user}:*"),
                params,
                cost_millitokens,
            )
            .expect("valid"),
            BatchRule::new("rl:v1:{t:atlas}:tenant:atlas:*".to_owned(), params, 1_000)
                .expect("valid"),
        ];
        RuleBatch::new(&tenant, DecisionId::parse("r-1").expect("id"), 0, rules).expect("valid")
    }

    fn denial(retry: RetryAfter) -> BatchDecision {
        BatchDecision {
            allowed: false,
            denied_by: Some(0),
            advisory_denials: Vec::new(),
            retry,
            remaining: vec![400, 19_000],
            replayed: false,
        }
    }

    #[test]
    fn a_denial_is_served_until_the_shorter_of_its_hint_and_the_cap() {
        let cache = NegativeCache::new(250, 10);
        cache.remember(&batch("a", 1_000), &denial(RetryAfter::Ms(300)), 1_000);
        let hit = cache.check(&batch("a", 1_000), 1_100).expect("cached");
        assert_eq!(
            hit,
            CachedDenial {
                denied_by: 0,
                remaining: 400,
                retry: RetryAfter::Ms(200)
            }
        );
        assert!(cache.check(&batch("a", 1_000), 1_249).is_some());
        assert_eq!(
            cache.check(&batch("a", 1_000), 1_250),
            None,
            "capped at 250 ms"
        );
        // A short hint is shorter than the cap.
        cache.remember(&batch("a", 1_000), &denial(RetryAfter::Ms(40)), 2_000);
        assert!(cache.check(&batch("a", 1_000), 2_039).is_some());
        assert_eq!(cache.check(&batch("a", 1_000), 2_040), None);
        // Never: held for the cap, reported as never.
        cache.remember(&batch("a", 1_000), &denial(RetryAfter::Never), 3_000);
        assert_eq!(
            cache.check(&batch("a", 1_000), 3_249).map(|hit| hit.retry),
            Some(RetryAfter::Never)
        );
    }

    #[test]
    fn other_key_sets_and_cheaper_requests_go_to_the_store() {
        let cache = NegativeCache::new(250, 10);
        cache.remember(&batch("a", 2_000), &denial(RetryAfter::Ms(100)), 0);
        assert!(cache.check(&batch("b", 2_000), 1).is_none(), "another user");
        assert!(cache.check(&batch("a", 1_000), 1).is_none(), "cheaper");
        assert!(cache.check(&batch("a", 3_000), 1).is_some(), "dearer");
        let allowed = BatchDecision {
            allowed: true,
            denied_by: None,
            advisory_denials: Vec::new(),
            retry: RetryAfter::Ms(0),
            remaining: vec![1, 1],
            replayed: false,
        };
        cache.remember(&batch("c", 1_000), &allowed, 0);
        assert!(
            cache.check(&batch("c", 1_000), 1).is_none(),
            "admissions are not cached"
        );
    }

    #[test]
    fn a_full_cache_evicts_its_oldest_entry() {
        let cache = NegativeCache::new(250, 2);
        for (n, user) in ["a", "b", "c"].into_iter().enumerate() {
            cache.remember(&batch(user, 1_000), &denial(RetryAfter::Ms(200)), n as u64);
        }
        assert_eq!(cache.len(), 2);
        assert!(cache.check(&batch("a", 1_000), 10).is_none(), "evicted");
        assert!(cache.check(&batch("b", 1_000), 10).is_some());
        assert!(cache.check(&batch("c", 1_000), 10).is_some());
    }
}
