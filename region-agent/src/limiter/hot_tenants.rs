//! Hot tenants over `k` sub-slots: one huge tenant need not be one hot shard.
//!
//! Every key of a tenant carries the hash tag `{t:<tenant>}`, so all of them live in one Redis Cluster
//! slot, on one master (that is what makes a request's rules atomic, I2). A tenant configured with
//! `k` sub-slots uses `{t:<tenant>:<i>}` instead, with `i` in `0..k` chosen per request; its `k` tags
//! hash to (generally) `k` different slots, spread over the masters.
//!
//! # The key transformation
//!
//! The keys come from `allot_shared::keys`, which only knows the tag `{t:<tenant>}`. A sub-slot key is
//! that key with the tag's closing brace preceded by `:<i>` ([`sub_slot_key`]):
//! `rl:v1:{t:atlas}:u:<hash>:read` becomes `rl:v1:{t:atlas:3}:u:<hash>:read`. The key must hold
//! exactly one `{` and one `}`, around exactly `t:<tenant>`; anything else is refused. Tenant ids
//! cannot contain `:`, `{` or `}`, so `t:atlas:3` can never be another tenant's tag, and a
//! sub-slotted key can never be mistaken for a plain one.
//!
//! # Which sub-slot
//!
//! One request's keys must share one tag, so `i` is chosen once per request:
//! - **with a per-principal rule**, `i` = the principal's keyed hash mod `k`: a principal always lands
//!   in the same sub-slot, so its own buckets are whole, never split;
//! - **otherwise**, `i` = a hash of the decision id mod `k`: spread like a random choice, but a retry
//!   of the same decision lands in the same sub-slot and finds its decision record there (a
//!   round-robin or random choice would miss it and could debit twice, I6).
//!
//! # The split budget and its slack
//!
//! Budgets shared by the whole tenant (`tenant` and `route` scope) are split `k` ways: each sub-slot's
//! bucket gets `ceil(capacity / k)` and `ceil(refill / k)` (token bucket and GCRA, in millitokens), or
//! `ceil(limit / k)` units (window algorithms). Per-principal budgets are not split. What the tenant
//! can get in total:
//! - **Rounding**: the `k` parts add up to at most `capacity + (k - 1)` in the rule's unit (k - 1
//!   millitokens for rate rules, k - 1 units for window rules), and likewise for the refill.
//! - **Uneven spread**: each sub-slot enforces its part alone. If the traffic does not spread evenly
//!   (a few principals, each pinned to one sub-slot), the tenant is denied before reaching its whole
//!   budget: a single principal sees at most `1/k` of the tenant budget. The split never admits more
//!   than the rounding slack above the un-split budget; it may admit less.
//! - **Reconfiguration**: changing `k` moves the tenant to new keys, which start full: at most one
//!   more capacity of each tenant rule, once (like a key expiring, I7).
//! - **Costs**: a request that costs more than a part (`ceil(capacity / k)`) can never be admitted
//!   (retry "never"). Choose `k <= capacity / largest cost` for every tenant rule of a hot tenant.

use std::collections::HashMap;

use allot_shared::ids::TenantId;
use allot_shared::keys::{self, PrincipalHash};
use allot_shared::policy::Scope;

use super::batch::{BatchError, BatchRule, PlannedBatch, RuleBatch, RuleParams};

/// Most sub-slots one tenant may use (I10). More would split budgets into slivers that the
/// rounding slack dominates.
pub const MAX_SUB_SLOTS: u32 = 64;

/// A key that cannot be moved to a sub-slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubSlotError {
    /// The key is not exactly one `{t:<tenant>}` tag plus tag-free text.
    #[error("key {key} does not carry exactly one hash tag {{t:{tenant}}}")]
    NotTenantTagged {
        /// The key.
        key: String,
        /// The tenant it should belong to.
        tenant: String,
    },
    /// `k` outside `[2, MAX_SUB_SLOTS]`, or `i >= k`.
    #[error("sub-slot {index} of {count} is out of range (2 to {MAX_SUB_SLOTS} sub-slots)")]
    OutOfRange {
        /// The sub-slot asked for.
        index: u32,
        /// The tenant's sub-slot count.
        count: u32,
    },
}

/// Which tenants spread over sub-slots, and over how many.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HotTenants {
    sub_slots: HashMap<TenantId, u32>,
}

impl HotTenants {
    /// No hot tenants.
    pub fn new() -> Self {
        Self::default()
    }

    /// Spreads `tenant` over `k` sub-slots, `k` in `[2, MAX_SUB_SLOTS]`.
    pub fn with_tenant(mut self, tenant: TenantId, k: u32) -> Result<Self, SubSlotError> {
        if !(2..=MAX_SUB_SLOTS).contains(&k) {
            return Err(SubSlotError::OutOfRange { index: 0, count: k });
        }
        self.sub_slots.insert(tenant, k);
        Ok(self)
    }

    /// The tenant's sub-slot count, if it is hot.
    pub fn sub_slots(&self, tenant: &TenantId) -> Option<u32> {
        self.sub_slots.get(tenant).copied()
    }

    /// Every hot tenant and its sub-slot count, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&TenantId, u32)> {
        self.sub_slots.iter().map(|(tenant, k)| (tenant, *k))
    }
}

/// Moves a key built by `allot_shared::keys` into sub-slot `index` of `tenant` (module docs).
pub fn sub_slot_key(key: &str, tenant: &TenantId, index: u32) -> Result<String, SubSlotError> {
    keys::sub_slot_key(key, tenant, index).ok_or_else(|| SubSlotError::NotTenantTagged {
        key: key.to_owned(),
        tenant: tenant.to_string(),
    })
}

/// A tenant-wide rule's parameters for one of `k` sub-slots: capacities, refills and limits divided
/// by `k`, rounded up (module docs). Periods and windows are unchanged.
pub fn split_params(params: &RuleParams, k: u32) -> RuleParams {
    let part = |value: u64| value.div_ceil(u64::from(k.max(1)));
    match *params {
        RuleParams::TokenBucket {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
            slack_ms,
        } => RuleParams::TokenBucket {
            capacity_millitokens: part(capacity_millitokens),
            refill_millitokens: part(refill_millitokens),
            period_ms,
            slack_ms,
        },
        RuleParams::Gcra {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
        } => RuleParams::Gcra {
            capacity_millitokens: part(capacity_millitokens),
            refill_millitokens: part(refill_millitokens),
            period_ms,
        },
        RuleParams::FixedWindow {
            limit_units,
            window_ms,
        } => RuleParams::FixedWindow {
            limit_units: part(limit_units),
            window_ms,
        },
        RuleParams::SlidingCounter {
            limit_units,
            window_ms,
        } => RuleParams::SlidingCounter {
            limit_units: part(limit_units),
            window_ms,
        },
        RuleParams::SlidingLog {
            limit_units,
            window_ms,
        } => RuleParams::SlidingLog {
            limit_units: part(limit_units),
            window_ms,
        },
    }
}

/// Whether a rule's budget is shared by the whole tenant (and so split over sub-slots).
pub(crate) fn is_tenant_wide(scope: Scope) -> bool {
    matches!(scope, Scope::Route | Scope::Tenant)
}

/// FNV-1a, 64 bits: a stable hash (the same in every agent build), for choosing sub-slots.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The sub-slot of a request (module docs): by principal when it has per-principal rules, else by
/// decision id.
pub fn choose_sub_slot(planned: &PlannedBatch<'_>, k: u32) -> u32 {
    let k = u64::from(k.max(1));
    let hash = match &planned.principal_hash {
        Some(principal) => principal_bits(principal),
        None => mix(fnv1a(planned.batch.decision_id().as_str().as_bytes())),
    };
    u32::try_from(hash % k).unwrap_or(0)
}

/// MurmurHash3's 64-bit finaliser: FNV-1a's low bits mix poorly, and `mod k` reads the low bits.
fn mix(mut hash: u64) -> u64 {
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

/// The principal hash is 16 hex characters of an HMAC: uniform bits already.
fn principal_bits(principal: &PrincipalHash) -> u64 {
    u64::from_str_radix(principal.as_str(), 16)
        .unwrap_or_else(|_| fnv1a(principal.as_str().as_bytes()))
}

/// The request's batch moved to sub-slot `index` of `k`: every key (and the decision record)
/// re-tagged, tenant-wide budgets split. Rule order, costs and the decision id are unchanged.
pub fn spread(planned: &PlannedBatch<'_>, k: u32, index: u32) -> Result<RuleBatch, SpreadError> {
    if !(2..=MAX_SUB_SLOTS).contains(&k) || index >= k {
        return Err(SubSlotError::OutOfRange { index, count: k }.into());
    }
    let tenant = &planned.tenant;
    let mut rules = Vec::with_capacity(planned.batch.rules().len());
    for (rule, policy) in planned.batch.rules().iter().zip(&planned.rules) {
        let key = sub_slot_key(rule.key(), tenant, index)?;
        let params = if is_tenant_wide(policy.scope) {
            split_params(rule.params(), k)
        } else {
            *rule.params()
        };
        // Split parameters only shrink, so they stay within the validated bounds.
        let moved = BatchRule::new(key, params, rule.cost_millitokens())
            .map_err(|_| BatchError::UnreadableParams(policy.id.clone()))?;
        rules.push(if rule.advisory() {
            moved.into_advisory()
        } else {
            moved
        });
    }
    let batch = RuleBatch::new_in_sub_slot(
        tenant,
        index,
        planned.batch.decision_id().clone(),
        planned.batch.record_ttl_ms(),
        rules,
    )?;
    Ok(if planned.batch.dry_run() {
        batch.into_dry_run()
    } else {
        batch
    })
}

/// Why a batch could not be spread.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpreadError {
    /// A key or sub-slot was refused.
    #[error(transparent)]
    SubSlot(#[from] SubSlotError),
    /// The spread batch was refused.
    #[error(transparent)]
    Batch(#[from] BatchError),
}

#[cfg(test)]
mod tests {
    use allot_shared::contract::PrincipalType;
    use allot_shared::ids::{DecisionId, RouteGroup};
    use allot_shared::keys::{IpPrefixes, Pepper, principal_hash, principal_key, tenant_key};

    use super::*;

    fn atlas() -> TenantId {
        TenantId::parse("atlas").expect("tenant")
    }

    #[test]
    fn keys_move_to_the_sub_slot_tag_and_nothing_else_changes() {
        let pepper = Pepper::new(b"test-pepper-0123456789".to_vec()).expect("pepper");
        let hash = principal_hash(&pepper, PrincipalType::User, "U-17", IpPrefixes::default());
        let read = RouteGroup::parse("read").expect("route");
        let user = principal_key(&atlas(), PrincipalType::User, &hash, Some(&read));
        assert_eq!(
            sub_slot_key(&user, &atlas(), 3).expect("tagged"),
            format!("rl:v1:{{t:atlas:3}}:u:{hash}:read")
        );
        assert_eq!(
            sub_slot_key(&tenant_key(&atlas(), None), &atlas(), 0).expect("tagged"),
            "rl:v1:{t:atlas:0}:tenant:atlas:*"
        );
        let record = keys::decision_key(&atlas(), &DecisionId::parse("r-9").expect("id"));
        let moved = sub_slot_key(&record, &atlas(), 7).expect("tagged");
        assert_eq!(moved, "rl:v1:{t:atlas:7}:d:r-9");
        assert_eq!(keys::key_hash_tag(&moved), Some("t:atlas:7"));
    }

    #[test]
    fn keys_without_exactly_the_tenant_tag_are_refused() {
        let birch = TenantId::parse("birch").expect("tenant");
        for key in [
            "rl:v1:{t:birch}:tenant:birch:*",
            "rl:v1:t:atlas:tenant:atlas:*",
            "rl:v1:{t:atlas}:{x}",
            "rl:v1:{t:atlas:1}:tenant:atlas:*",
            "rl:v1:{t:atlasx}:tenant:atlas:*",
        ] {
            assert!(
                matches!(
                    sub_slot_key(key, &atlas(), 1),
                    Err(SubSlotError::NotTenantTagged { .. })
                ),
                "{key}"
            );
        }
        assert!(sub_slot_key("rl:v1:{t:birch}:x", &birch, 1).is_ok());
    }

    #[test]
    fn split_budgets_round_up_and_add_up_to_at_most_k_minus_1_over_the_whole() {
        let bucket = RuleParams::TokenBucket {
            capacity_millitokens: 50_000,
            refill_millitokens: 1_001,
            period_ms: 60_000,
            slack_ms: 5_000,
        };
        assert_eq!(
            split_params(&bucket, 8),
            RuleParams::TokenBucket {
                capacity_millitokens: 6_250,
                refill_millitokens: 126,
                period_ms: 60_000,
                slack_ms: 5_000
            }
        );
        for k in 2..=MAX_SUB_SLOTS {
            for limit_units in [1u64, 7, 50, 1_000, 1 << 40] {
                let window = RuleParams::FixedWindow {
                    limit_units,
                    window_ms: 1_000,
                };
                let RuleParams::FixedWindow {
                    limit_units: part, ..
                } = split_params(&window, k)
                else {
                    panic!("same algorithm");
                };
                let total = part * u64::from(k);
                assert!(part >= 1, "a part is never empty");
                assert!(
                    total >= limit_units && total < limit_units + u64::from(k),
                    "k {k}, limit {limit_units}: parts add up to {total}"
                );
                assert!(
                    RuleParams::FixedWindow {
                        limit_units: part,
                        window_ms: 1_000
                    }
                    .algorithm()
                    .is_ok()
                );
            }
        }
    }

    #[test]
    fn hot_tenant_configuration_is_bounded() {
        assert!(HotTenants::new().with_tenant(atlas(), 1).is_err());
        assert!(
            HotTenants::new()
                .with_tenant(atlas(), MAX_SUB_SLOTS + 1)
                .is_err()
        );
        let hot = HotTenants::new().with_tenant(atlas(), 4).expect("valid");
        assert_eq!(hot.sub_slots(&atlas()), Some(4));
        assert_eq!(
            hot.sub_slots(&TenantId::parse("birch").expect("tenant")),
            None
        );
    }

    #[test]
    fn fnv1a_matches_its_published_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
