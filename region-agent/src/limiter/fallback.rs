//! The bounded local fallback of `local_bounded` rules: an in-process token bucket per rule key, with
//! the rule's local capacity and refill, used only while the store cannot decide.
//!
//! A user spread over `g` gateways can get at most `g x (local capacity + local refill x outage)`
//! during an outage (the reference design's 4 x (5 + 0.25 x 60) = 80 in a minute); never an
//! unbounded fail-open.
//!
//! - **All or nothing**, like the store: a request is admitted only if every rule's local bucket
//!   admits it, and only then are any debited. The pure core's `TokenBucket::decide` does the
//!   arithmetic on the agent's monotonic clock.
//! - **Keyed by the rule's store key** (before any hot-tenant sub-slot: the local bucket is this
//!   agent's alone, so there is nothing to spread). A bucket keeps no parameters of its own: a
//!   changed policy takes effect on the next call (stored tokens are clamped to the new capacity).
//! - **Bounded (I10).** At most `max_buckets` buckets. A new key in a full table evicts the least
//!   recently used bucket only if it is idle (refilled to full, so forgetting it changes nothing);
//!   otherwise the request cannot be decided locally and the caller answers `LIMITER_UNAVAILABLE`.
//!   Evicting a bucket that is not full would hand its key a fresh, full bucket: a flood of new keys
//!   could then refill everyone's buckets, which is exactly the unbounded fail-open this avoids.

use std::sync::{Mutex, MutexGuard, PoisonError};

use allot_shared::limit::RetryAfter;
use allot_shared::limit::token_bucket::{TokenBucket, TokenBucketState};

use super::bounded::BoundedMap;

/// Default cap on local fallback buckets per agent (I10).
pub const DEFAULT_FALLBACK_MAX_BUCKETS: usize = 10_000;

/// One rule of a local decision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalRule<'a> {
    /// The rule's store key (without sub-slot).
    pub(crate) key: &'a str,
    /// The rule's local bucket.
    pub(crate) bucket: &'a TokenBucket,
    /// The request's cost against it, in millitokens.
    pub(crate) cost_millitokens: u64,
}

/// What the local buckets decided: the same shape as a store decision, in local units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackDecision {
    /// Every local bucket admitted the request (and was debited).
    pub allowed: bool,
    /// The first denying rule.
    pub denied_by: Option<usize>,
    /// `Ms(0)` when allowed, else the maximum hint over denying rules.
    pub retry: RetryAfter,
    /// Per rule, what its local bucket holds, in millitokens.
    pub remaining: Vec<u64>,
}

impl FallbackDecision {
    /// The decision of a subset of a request's rules (`indexes[i]` is the request's index of local
    /// rule `i`) as the whole request's: rules outside the subset hold nothing locally (0).
    pub(crate) fn spread_over(self, indexes: &[usize], rule_count: usize) -> Self {
        let mut remaining = vec![0; rule_count];
        for (local, &index) in indexes.iter().enumerate() {
            if let (Some(slot), Some(&left)) = (remaining.get_mut(index), self.remaining.get(local))
            {
                *slot = left;
            }
        }
        Self {
            denied_by: self.denied_by.and_then(|local| indexes.get(local).copied()),
            remaining,
            ..self
        }
    }
}

/// The table is full of buckets in use: the request's new key cannot be tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableFull {
    /// The rule whose key did not fit.
    pub(crate) rule: usize,
}

#[derive(Debug)]
struct Bucket {
    params: TokenBucket,
    state: TokenBucketState,
}

/// The buckets. See the module docs.
#[derive(Debug)]
pub(crate) struct LocalBuckets {
    buckets: Mutex<BoundedMap<String, Bucket>>,
}

impl LocalBuckets {
    pub(crate) fn new(max_buckets: usize) -> Self {
        Self {
            buckets: Mutex::new(BoundedMap::new(max_buckets)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BoundedMap<String, Bucket>> {
        // Every check runs before the first write, so a poisoned table is still consistent.
        self.buckets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides `rules` together at `now_ms` (monotonic); a `dry_run` decides and writes nothing.
    ///
    /// Long by design: the decision is all or none under one lock held throughout: every rule
    /// decided, then room made for every new key, then every state written; split, the lock guard
    /// would be passed between the phases, and a write could happen before it was known that all
    /// would fit.
    pub(crate) fn decide(
        &self,
        rules: &[LocalRule<'_>],
        now_ms: u64,
        dry_run: bool,
    ) -> Result<FallbackDecision, TableFull> {
        let mut buckets = self.lock();
        let mut outcomes = Vec::with_capacity(rules.len());
        for rule in rules {
            let key = rule.key.to_owned();
            let state = buckets.get(&key).map(|bucket| bucket.state);
            let available = rule.bucket.available_millitokens(state.as_ref(), now_ms);
            // A cost out of bounds (cannot pass policy validation) is denied as "never".
            let outcome = rule
                .bucket
                .decide(state.as_ref(), now_ms, rule.cost_millitokens)
                .map_or((false, 0, RetryAfter::Never, None), |d| {
                    (d.allowed, d.remaining, d.retry, d.write.map(|w| w.state))
                });
            outcomes.push((outcome, available));
        }
        if let Some(denied_by) = outcomes.iter().position(|(o, _)| !o.0) {
            let retry = outcomes
                .iter()
                .filter(|(o, _)| !o.0)
                .map(|(o, _)| o.2)
                .max()
                .unwrap_or(RetryAfter::Never);
            // Like the store: a rule that would have admitted shows what it holds, undebited.
            let remaining = outcomes
                .iter()
                .map(|(o, available)| if o.0 { *available } else { o.1 })
                .collect();
            return Ok(FallbackDecision {
                allowed: false,
                denied_by: Some(denied_by),
                retry,
                remaining,
            });
        }
        let remaining = outcomes.iter().map(|(o, _)| o.1).collect();
        if dry_run {
            return Ok(FallbackDecision {
                allowed: true,
                denied_by: None,
                retry: RetryAfter::Ms(0),
                remaining,
            });
        }
        // Admitted: make room for every new key first, so nothing is written unless all fit.
        for (index, rule) in rules.iter().enumerate() {
            let key = rule.key.to_owned();
            if buckets.get(&key).is_some() || !buckets.is_full() {
                continue;
            }
            let idle = buckets
                .oldest()
                .is_some_and(|(_, oldest)| bucket_is_full(oldest, now_ms));
            if !idle {
                return Err(TableFull { rule: index });
            }
            buckets.pop_oldest();
        }
        for (rule, (outcome, _)) in rules.iter().zip(outcomes) {
            let Some(state) = outcome.3 else { continue };
            let key = rule.key.to_owned();
            let bucket = Bucket {
                params: *rule.bucket,
                state,
            };
            // Room was made above for every new key of this request.
            if buckets.insert(key, bucket).is_err() {
                debug_assert!(false, "room was made for every new key");
            }
        }
        Ok(FallbackDecision {
            allowed: true,
            denied_by: None,
            retry: RetryAfter::Ms(0),
            remaining,
        })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

/// Whether a bucket has refilled to full at `now_ms`: forgetting it then changes nothing (a missing
/// bucket reads as full).
fn bucket_is_full(bucket: &Bucket, now_ms: u64) -> bool {
    bucket
        .params
        .available_millitokens(Some(&bucket.state), now_ms)
        >= bucket.params.capacity_millitokens()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 5 tokens, refilling 0.25 per second (the reference design's P-READ fallback).
    fn p_read_local() -> TokenBucket {
        TokenBucket::new(5_000, 250, 1_000, 0).expect("valid")
    }

    fn one(key: &str, bucket: &TokenBucket) -> Vec<(String, TokenBucket)> {
        vec![(key.to_owned(), *bucket)]
    }

    fn decide(
        buckets: &LocalBuckets,
        rules: &[(String, TokenBucket)],
        now_ms: u64,
    ) -> Result<FallbackDecision, TableFull> {
        let rules: Vec<LocalRule<'_>> = rules
            .iter()
            .map(|(key, bucket)| LocalRule {
                key,
                bucket,
                cost_millitokens: 1_000,
            })
            .collect();
        buckets.decide(&rules, now_ms, false)
    }

    fn allowed(decision: &Result<FallbackDecision, TableFull>) -> bool {
        matches!(decision, Ok(FallbackDecision { allowed: true, .. }))
    }

    #[test]
    fn a_local_bucket_admits_its_capacity_then_its_refill() {
        let buckets = LocalBuckets::new(10);
        let rules = one("u:1", &p_read_local());
        let admitted = (0..20)
            .filter(|_| allowed(&decide(&buckets, &rules, 0)))
            .count();
        assert_eq!(admitted, 5);
        assert_eq!(
            decide(&buckets, &rules, 0),
            Ok(FallbackDecision {
                allowed: false,
                denied_by: Some(0),
                retry: RetryAfter::Ms(4_000),
                remaining: vec![0]
            })
        );
        assert!(
            allowed(&decide(&buckets, &rules, 4_000)),
            "one token after 4 s"
        );
        assert!(!allowed(&decide(&buckets, &rules, 4_000)));
    }

    #[test]
    fn a_denial_anywhere_debits_no_local_bucket() {
        let buckets = LocalBuckets::new(10);
        let tiny = TokenBucket::new(1_000, 1, 1_000_000, 0).expect("valid");
        let rules = vec![
            ("u:1".to_owned(), p_read_local()),
            ("tenant".to_owned(), tiny),
        ];
        assert!(allowed(&decide(&buckets, &rules, 0)));
        let Ok(FallbackDecision {
            allowed: false,
            denied_by: Some(1),
            remaining,
            ..
        }) = decide(&buckets, &rules, 0)
        else {
            panic!("the tenant bucket is empty");
        };
        assert_eq!(remaining, [4_000, 0], "the user bucket shows what it holds");
        assert_eq!(
            decide(&buckets, &one("u:1", &p_read_local()), 0),
            Ok(FallbackDecision {
                allowed: true,
                denied_by: None,
                retry: RetryAfter::Ms(0),
                remaining: vec![3_000]
            })
        );
    }

    #[test]
    fn a_full_table_evicts_only_idle_buckets_and_otherwise_refuses() {
        let buckets = LocalBuckets::new(2);
        let bucket = p_read_local();
        assert!(allowed(&decide(&buckets, &one("a", &bucket), 0)));
        assert!(allowed(&decide(&buckets, &one("b", &bucket), 1_000)));
        // Both are in use: a third key cannot be tracked, and nothing is evicted.
        assert_eq!(
            decide(&buckets, &one("c", &bucket), 2_000),
            Err(TableFull { rule: 0 })
        );
        assert_eq!(buckets.len(), 2);
        // At 4,000 ms `a` (least recently used) has refilled to full: it makes room.
        assert!(allowed(&decide(&buckets, &one("c", &bucket), 4_000)));
        assert_eq!(buckets.len(), 2);
        // `b` kept its debit: 4 tokens + 0.75 refilled by 4,000 ms, minus this one.
        assert_eq!(
            decide(&buckets, &one("b", &bucket), 4_000),
            Ok(FallbackDecision {
                allowed: true,
                denied_by: None,
                retry: RetryAfter::Ms(0),
                remaining: vec![3_750]
            })
        );
    }
}
