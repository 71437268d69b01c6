//! From the client path's answer to the admission contract's [`Decision`].
//!
//! | verdict | allowed | policyId | deniedScope | reason | limit, remaining | retryAfterMs | fallback |
//! | --- | --- | --- | --- | --- | --- | --- | --- |
//! | store admitted | yes | the most constraining rule | | | that rule's | 0 | no |
//! | store denied, or negative cache | no | the first denying rule | its scope | `RATE_EXCEEDED` | that rule's | the hint (-1: never) | no |
//! | cardinality cap | no | the first `ip` rule | `user` | `RATE_EXCEEDED` | that rule's, 0 left | until the source's window ends | no |
//! | fallback admitted / denied | as decided | most constraining / first denying | as above | as above | the local bucket's | as above | yes |
//! | unavailable | no | the closed rule | its scope | `LIMITER_UNAVAILABLE` (503) | that rule's, 0 left | `unavailable_retry_ms` | no |
//! | policy error | no | none | none | `POLICY_ERROR` (503) | 0, 0 | -1 | no |
//!
//! - **Whole units.** Rate rules (token bucket, GCRA) count millitokens: their limit is the capacity
//!   and their remaining the tokens left, both rounded down to whole tokens. Window rules count units.
//! - **Most constraining** is the rule with the smallest share left (`remaining / limit`, compared
//!   exactly in each rule's own unit); the first in evaluation order on a tie. The agent then
//!   weighs the request's global pools against it (`with_pool_figures`), so an admission names the
//!   tightest of all its rules.
//! - **Hot tenants.** A tenant-wide rule in a sub-slot reports its part of the budget, which is what
//!   was enforced ([`split_params`]).
//! - A concurrency cap that refuses is reported by [`concurrency_denial`].

use allot_shared::MILLITOKENS_PER_TOKEN;
use allot_shared::contract::{AdvisoryMode, Decision, DeniedScope, Reason, Violation};
use allot_shared::limit::RetryAfter;
use allot_shared::policy::{FailMode, Mode, Rule};

use super::batch::{PlannedBatch, RuleParams};
use super::client::{LimitDecision, Verdict};
use super::hot_tenants::{is_tenant_wide, split_params};

/// A rule's limit in its own unit, and how many of those make a whole unit.
fn native_limit(params: &RuleParams) -> (u64, u64) {
    match *params {
        RuleParams::TokenBucket {
            capacity_millitokens,
            ..
        }
        | RuleParams::Gcra {
            capacity_millitokens,
            ..
        } => (capacity_millitokens, MILLITOKENS_PER_TOKEN),
        RuleParams::FixedWindow { limit_units, .. }
        | RuleParams::SlidingCounter { limit_units, .. }
        | RuleParams::SlidingLog { limit_units, .. } => (limit_units, 1),
    }
}

/// A rule's limit in whole units (a rate rule's capacity in tokens, a window rule's limit).
pub fn limit_units(params: &RuleParams) -> u64 {
    let (limit, unit) = native_limit(params);
    limit / unit
}

/// A regional rule's limit in whole units, as a decision reports it.
pub fn algorithm_limit_units(algorithm: &allot_shared::limit::multi::Algorithm) -> u64 {
    limit_units(&RuleParams::from_algorithm(algorithm))
}

/// The index with the smallest `remaining / limit`; the first on a tie. Rules without a known limit
/// (0) are skipped. `None` when none is left.
fn most_constraining(shares: &[(u64, u64)]) -> Option<usize> {
    let mut best: Option<(usize, u64, u64)> = None;
    for (index, &(remaining, limit)) in shares.iter().enumerate() {
        if limit == 0 {
            continue;
        }
        let better = best.is_none_or(|(_, best_remaining, best_limit)| {
            u128::from(remaining) * u128::from(best_limit)
                < u128::from(best_remaining) * u128::from(limit)
        });
        if better {
            best = Some((index, remaining, limit));
        }
    }
    best.map(|(index, _, _)| index)
}

/// What one rule holds, in whole units ([`LimitDecision::holdings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The rule's limit as enforced (a hot tenant's tenant-wide rule: its sub-slot's part; the
    /// local bucket's in fallback).
    pub limit_units: u64,
    /// What is left of it before the request.
    pub available_units: u64,
}

impl LimitDecision {
    /// What each rule of `planned` held before the request, when this is the answer to a dry run:
    /// after an admission the store reports what is left *after* the request's cost, so the cost is
    /// added back (at most to the limit); after a denial nothing was debited. `None` when the answer
    /// carries no amount per rule (an outage, a policy error, a refusal from memory); a rule's entry
    /// is `None` when the answer says nothing of it (a shadow or soft rule in fallback).
    pub fn holdings(&self, planned: &PlannedBatch<'_>) -> Option<Vec<Option<Holding>>> {
        let (allowed, remaining, in_fallback) = match &self.verdict {
            Verdict::Store(store) => (store.allowed, &store.remaining, false),
            Verdict::Fallback(local) => (local.allowed, &local.remaining, true),
            _ => return None,
        };
        let holdings = planned
            .batch
            .rules()
            .iter()
            .zip(&planned.rules)
            .zip(remaining)
            .map(|((batch_rule, rule), &left)| {
                if in_fallback && rule.mode.is_advisory() {
                    return None;
                }
                let (limit, unit) = match (&rule.fail_mode, self.sub_slot) {
                    (FailMode::LocalBounded(bucket), _) if in_fallback => {
                        (bucket.capacity_millitokens(), MILLITOKENS_PER_TOKEN)
                    }
                    (_, Some(slot)) if is_tenant_wide(rule.scope) => {
                        native_limit(&split_params(batch_rule.params(), slot.count))
                    }
                    _ => native_limit(batch_rule.params()),
                };
                // The cost in the amount's own unit: millitokens for rate rules and local buckets,
                // whole units for window rules.
                let cost = if unit == 1 {
                    batch_rule.cost_millitokens() / MILLITOKENS_PER_TOKEN
                } else {
                    batch_rule.cost_millitokens()
                };
                let available = if allowed {
                    left.saturating_add(cost).min(limit)
                } else {
                    left
                };
                Some(Holding {
                    limit_units: limit / unit,
                    available_units: available / unit,
                })
            })
            .collect();
        Some(holdings)
    }

    /// The contract decision for this answer to `planned` (module docs).
    ///
    /// Long by design: it is one match over every verdict, each arm naming its rule's limit through
    /// the two readings defined above it (the store's limit, split in a tenant's sub-slot, and the
    /// local fallback's capacity); split, those readings would be passed to each arm, and which
    /// limit a verdict reports would be read away from the verdict.
    pub fn to_contract(&self, planned: &PlannedBatch<'_>) -> Decision {
        let mut decision = Decision {
            allowed: self.allowed(),
            decision_id: planned.batch.decision_id().clone(),
            policy_id: None,
            policy_version: planned.policy_version,
            denied_scope: None,
            reason: None,
            limit_units: 0,
            remaining_units: 0,
            retry_after_ms: 0,
            fallback: self.fallback(),
            dry_run: false,
            violations: Vec::new(),
            settle_by_ms: None,
        };
        // The store's limits as enforced: split for a tenant-wide rule in a sub-slot. A shadow or
        // soft rule has none to name (limit 0: never the most constraining; it never denies).
        let store_limit = |index: usize| -> (u64, u64) {
            let (Some(batch_rule), Some(rule)) =
                (planned.batch.rules().get(index), planned.rules.get(index))
            else {
                return (0, 1);
            };
            if rule.mode.is_advisory() {
                return (0, 1);
            }
            match self.sub_slot {
                Some(slot) if is_tenant_wide(rule.scope) => {
                    native_limit(&split_params(batch_rule.params(), slot.count))
                }
                _ => native_limit(batch_rule.params()),
            }
        };
        let local_limit = |index: usize| -> (u64, u64) {
            // An advisory rule took no part in the local decision (limit 0: never named).
            if planned
                .rules
                .get(index)
                .is_some_and(|r| r.mode.is_advisory())
            {
                return (0, 1);
            }
            match planned.rules.get(index).map(|rule| &rule.fail_mode) {
                Some(FailMode::LocalBounded(bucket)) => {
                    (bucket.capacity_millitokens(), MILLITOKENS_PER_TOKEN)
                }
                _ => (0, 1),
            }
        };
        let rule_at = |index: usize| planned.rules.get(index).copied();
        if let Verdict::Store(store) = &self.verdict {
            decision.violations = store
                .advisory_denials
                .iter()
                .filter_map(|&index| rule_at(index))
                .map(violation)
                .collect();
        }
        match &self.verdict {
            Verdict::Store(store) => attribute(
                &mut decision,
                rule_at,
                store.denied_by,
                store.retry,
                &store.remaining,
                store_limit,
            ),
            Verdict::Fallback(local) => attribute(
                &mut decision,
                rule_at,
                local.denied_by,
                local.retry,
                &local.remaining,
                local_limit,
            ),
            Verdict::CachedDenial(hit) => {
                let (limit, unit) = store_limit(hit.denied_by);
                deny(
                    &mut decision,
                    rule_at(hit.denied_by),
                    Reason::RateExceeded,
                    limit / unit,
                    hit.remaining / unit,
                    hit.retry.as_wire_ms(),
                );
            }
            Verdict::CardinalityCapped { rule, refusal } => {
                let (limit, unit) = store_limit(*rule);
                deny(
                    &mut decision,
                    rule_at(*rule),
                    Reason::RateExceeded,
                    limit / unit,
                    0,
                    RetryAfter::Ms(refusal.retry_ms).as_wire_ms(),
                );
                decision.denied_scope = Some(DeniedScope::User);
            }
            Verdict::Unavailable { rule, retry_ms } => {
                let (limit, unit) = store_limit(*rule);
                deny(
                    &mut decision,
                    rule_at(*rule),
                    Reason::LimiterUnavailable,
                    limit / unit,
                    0,
                    RetryAfter::Ms(*retry_ms).as_wire_ms(),
                );
            }
            Verdict::PolicyError => {
                decision.reason = Some(Reason::PolicyError);
                decision.retry_after_ms = RetryAfter::Never.as_wire_ms();
            }
        }
        decision
    }
}

/// How a shadow or soft rule that would have denied is reported.
fn violation(rule: &Rule) -> Violation {
    Violation {
        policy_id: rule.id.to_string(),
        mode: match rule.mode {
            Mode::Soft => AdvisoryMode::Soft,
            Mode::Shadow | Mode::Enforce => AdvisoryMode::Shadow,
        },
        scope: rule.scope.denied_scope(),
    }
}

/// Fills in an admission or a rate denial decided by a store or the local buckets.
fn attribute<'r>(
    decision: &mut Decision,
    rule_at: impl Fn(usize) -> Option<&'r Rule>,
    denied_by: Option<usize>,
    retry: RetryAfter,
    remaining: &[u64],
    limit_of: impl Fn(usize) -> (u64, u64),
) {
    let left = |index: usize| remaining.get(index).copied().unwrap_or(0);
    if decision.allowed {
        let shares: Vec<(u64, u64)> = (0..remaining.len())
            .map(|index| (left(index), limit_of(index).0))
            .collect();
        if let Some(index) = most_constraining(&shares) {
            let (limit, unit) = limit_of(index);
            decision.policy_id = rule_at(index).map(|rule| rule.id.to_string());
            decision.limit_units = limit / unit;
            decision.remaining_units = left(index) / unit;
        }
        return;
    }
    let index = denied_by.unwrap_or(0);
    let (limit, unit) = limit_of(index);
    deny(
        decision,
        rule_at(index),
        Reason::RateExceeded,
        limit / unit,
        left(index) / unit,
        retry.as_wire_ms(),
    );
}

fn deny(
    decision: &mut Decision,
    rule: Option<&Rule>,
    reason: Reason,
    limit: u64,
    remaining: u64,
    retry_after_ms: i64,
) {
    decision.allowed = false;
    decision.policy_id = rule.map(|rule| rule.id.to_string());
    decision.denied_scope = rule.map(|rule| rule.scope.denied_scope());
    decision.reason = Some(reason);
    decision.limit_units = limit;
    decision.remaining_units = remaining;
    decision.retry_after_ms = retry_after_ms;
}

/// The decision for a request whose rule `rule` (an index into `planned.rules`) has a concurrency
/// cap that is full: `CONCURRENCY_EXCEEDED` (429), scope `concurrency`, the cap as the limit and
/// `retry_after_ms` as the policy's hint.
pub fn concurrency_denial(
    planned: &PlannedBatch<'_>,
    rule: usize,
    retry_after_ms: u64,
) -> Decision {
    let policy = planned.rules.get(rule).copied();
    Decision {
        allowed: false,
        decision_id: planned.batch.decision_id().clone(),
        policy_id: policy.map(|rule| rule.id.to_string()),
        policy_version: planned.policy_version,
        denied_scope: Some(DeniedScope::Concurrency),
        reason: Some(Reason::ConcurrencyExceeded),
        limit_units: policy
            .and_then(|rule| rule.concurrency.as_ref())
            .map_or(0, |semaphore| semaphore.max_in_flight()),
        remaining_units: 0,
        retry_after_ms: RetryAfter::Ms(retry_after_ms).as_wire_ms(),
        fallback: false,
        dry_run: false,
        violations: Vec::new(),
        settle_by_ms: None,
    }
}

#[cfg(test)]
mod tests {
    use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType, http_status};
    use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
    use allot_shared::keys::{IpPrefixes, Pepper};
    use allot_shared::policy::{PolicyBundle, parse_bundle};

    use super::*;
    use crate::limiter::batch::plan_request;
    use crate::limiter::cardinality::CardinalityRefusal;
    use crate::limiter::client::SubSlot;
    use crate::limiter::fallback::FallbackDecision;
    use crate::limiter::negative_cache::CachedDenial;
    use crate::limiter::store::BatchDecision;

    const BUNDLE: &str = r#"{
        "bundleVersion": 7,
        "rules": [
            {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
             "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000,
             "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 250},
            {"id": "read-route", "scope": "route", "routeGroup": "read", "algorithm": "fixed_window",
             "limit": 50, "windowMs": 10000, "failMode": "closed", "concurrencyMax": 3},
            {"id": "tenant-all", "scope": "tenant", "algorithm": "token_bucket",
             "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 60000,
             "failMode": "local_bounded", "localCapacityMillis": 20000, "localRefillMillis": 16000}
        ]
    }"#;

    fn bundle() -> PolicyBundle {
        parse_bundle(BUNDLE)
            .expect("valid")
            .into_file_bundle()
            .expect("sealed")
    }

    fn planned(bundle: &PolicyBundle) -> PlannedBatch<'_> {
        let request = AdmissionRequest {
            request_id: DecisionId::parse("r-1").expect("id"),
            tenant_id: TenantId::parse("atlas").expect("tenant"),
            principal: Principal {
                kind: PrincipalType::User,
                id: "U-17".to_owned(),
                api_key_id: None,
            },
            route_group: RouteGroup::parse("read").expect("route"),
            method: "GET".to_owned(),
            cost_hint: 1,
            policy_epoch: None,
            dry_run: false,
            metered: false,
        };
        let pepper = Pepper::new(b"test-pepper-0123456789".to_vec()).expect("pepper");
        plan_request(bundle, &request, &pepper, IpPrefixes::default(), 30_000)
            .expect("plannable")
            .expect("rules apply")
    }

    fn answer(verdict: Verdict) -> LimitDecision {
        LimitDecision {
            verdict,
            degraded: None,
            store_calls: 1,
            sub_slot: None,
        }
    }

    #[test]
    fn an_admission_names_the_rule_with_the_smallest_share_left() {
        let bundle = bundle();
        let planned = planned(&bundle);
        // 19.5 of 20 tokens, 10 of 50 units, 999 of 1,000 tokens: the route rule is tightest.
        let decision = answer(Verdict::Store(BatchDecision {
            allowed: true,
            denied_by: None,
            advisory_denials: Vec::new(),
            retry: RetryAfter::Ms(0),
            remaining: vec![19_500, 10, 999_000],
            replayed: false,
        }))
        .to_contract(&planned);
        assert!(decision.allowed);
        assert_eq!(decision.policy_id.as_deref(), Some("read-route"));
        assert_eq!((decision.limit_units, decision.remaining_units), (50, 10));
        assert_eq!(decision.policy_version, 7);
        assert_eq!(decision.decision_id.as_str(), "r-1");
        assert_eq!((decision.denied_scope, decision.reason), (None, None));
        assert_eq!(http_status(&decision), 200);
    }

    #[test]
    fn a_denial_names_its_rule_scope_and_hint_in_whole_units() {
        let bundle = bundle();
        let planned = planned(&bundle);
        let decision = answer(Verdict::Store(BatchDecision {
            allowed: false,
            denied_by: Some(0),
            advisory_denials: Vec::new(),
            retry: RetryAfter::Ms(500),
            remaining: vec![999, 10, 999_000],
            replayed: false,
        }))
        .to_contract(&planned);
        assert_eq!(decision.policy_id.as_deref(), Some("read-user"));
        assert_eq!(decision.denied_scope, Some(DeniedScope::User));
        assert_eq!(decision.reason, Some(Reason::RateExceeded));
        assert_eq!((decision.limit_units, decision.remaining_units), (20, 0));
        assert_eq!(decision.retry_after_ms, 500);
        assert!(!decision.fallback);
        assert_eq!(http_status(&decision), 429);

        let cached = answer(Verdict::CachedDenial(CachedDenial {
            denied_by: 2,
            remaining: 1_500,
            retry: RetryAfter::Never,
        }))
        .to_contract(&planned);
        assert_eq!(cached.policy_id.as_deref(), Some("tenant-all"));
        assert_eq!(cached.denied_scope, Some(DeniedScope::Tenant));
        assert_eq!((cached.limit_units, cached.remaining_units), (1_000, 1));
        assert_eq!(cached.retry_after_ms, -1);
    }

    #[test]
    fn degraded_answers_say_fallback_or_unavailable() {
        let bundle = bundle();
        let planned = planned(&bundle);
        let local = answer(Verdict::Fallback(FallbackDecision {
            allowed: true,
            denied_by: None,
            retry: RetryAfter::Ms(0),
            remaining: vec![4_000, 0, 19_000],
        }))
        .to_contract(&planned);
        assert!(local.allowed && local.fallback);
        // The route rule has no local bucket (it is closed, so it never reaches the fallback).
        assert_eq!(local.policy_id.as_deref(), Some("read-user"));
        assert_eq!((local.limit_units, local.remaining_units), (5, 4));

        let unavailable = answer(Verdict::Unavailable {
            rule: 1,
            retry_ms: 1_000,
        })
        .to_contract(&planned);
        assert_eq!(unavailable.reason, Some(Reason::LimiterUnavailable));
        assert_eq!(unavailable.policy_id.as_deref(), Some("read-route"));
        assert_eq!(unavailable.retry_after_ms, 1_000);
        assert!(!unavailable.fallback);
        assert_eq!(http_status(&unavailable), 503);

        let broken = answer(Verdict::PolicyError).to_contract(&planned);
        assert_eq!(broken.reason, Some(Reason::PolicyError));
        assert_eq!(
            (broken.policy_id.as_deref(), broken.retry_after_ms),
            (None, -1)
        );
        assert_eq!(http_status(&broken), 503);
    }

    #[test]
    fn caps_report_their_scope_and_hot_tenants_their_part() {
        let bundle = bundle();
        let planned = planned(&bundle);
        let capped = answer(Verdict::CardinalityCapped {
            rule: 0,
            refusal: CardinalityRefusal { retry_ms: 700 },
        })
        .to_contract(&planned);
        assert_eq!(capped.denied_scope, Some(DeniedScope::User));
        assert_eq!((capped.retry_after_ms, capped.remaining_units), (700, 0));

        let concurrency = concurrency_denial(&planned, 1, 2_000);
        assert_eq!(concurrency.denied_scope, Some(DeniedScope::Concurrency));
        assert_eq!(concurrency.reason, Some(Reason::ConcurrencyExceeded));
        assert_eq!(concurrency.limit_units, 3);
        assert_eq!(http_status(&concurrency), 429);

        let mut split = answer(Verdict::Store(BatchDecision {
            allowed: false,
            denied_by: Some(2),
            advisory_denials: Vec::new(),
            retry: RetryAfter::Ms(60),
            remaining: vec![19_000, 10, 0],
            replayed: false,
        }));
        split.sub_slot = Some(SubSlot { index: 1, count: 8 });
        let split = split.to_contract(&planned);
        assert_eq!(split.limit_units, 125, "1,000 tokens over 8 sub-slots");
    }
}
