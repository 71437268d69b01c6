//! Overrides: a different limit for one tenant, or for one of its users or API keys, without a
//! policy bundle per tenant.
//!
//! Two kinds, each enforced where its budget lives:
//! - a [`PoolOverride`] replaces a tenant pool's `G` for a while. The allocator grants against
//!   [`limit_at`] the moment it grants; the bound of a window is checked against
//!   [`window_limit`], the highest limit in force at any moment of it, so a limit raised for an
//!   hour and ended mid-window is still honoured in that window's accounting;
//! - a [`RuleOverride`] replaces the amounts of one regional rule (`capacityMillis`/`refillMillis`
//!   of a rate rule, `limit` of a window rule) for one tenant, or for one principal of that tenant
//!   on a per-principal rule. Agents receive every rule override in force as an [`OverrideSet`]:
//!   versioned (only a higher version replaces the one held) and checksummed, like a bundle, and
//!   lay those in force over it (`crate::policy::Overlay`). Periods and windows are the rule's
//!   own: an override changes how much, never how often.
//!
//! Principals are named by their keyed hash ([`PrincipalHash`]), never by their id: an override
//! stores and carries no raw user id or API key.
//!
//! Overrides on one pool, or on one (tenant, rule, principal), never overlap in time: a new one is
//! refused while another is in force, so "which override applies" never depends on order.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::contract::PrincipalType;
use crate::ids::{RecordId, RuleId, TenantId};
use crate::keys::PrincipalHash;
use crate::window::Window;

/// Most overrides stored at once, in force or kept after they ended (I10).
pub const MAX_OVERRIDES: usize = 10_000;
/// Most overrides of one tenant in force at once (I10).
pub const MAX_OVERRIDES_PER_TENANT: usize = 100;
/// Most overrides one pool record keeps, in force or ended (I10): past it a new one is refused
/// until the oldest ended one has been kept [`ENDED_POOL_OVERRIDE_KEPT_MS`].
pub const MAX_POOL_OVERRIDES_KEPT: usize = 32;
/// How long an ended override stays on its pool's record, ms: as long as the ledger keeps the
/// windows it touched, rolled up (400 days by default), whose accounting holds them to it.
pub const ENDED_POOL_OVERRIDE_KEPT_MS: u64 = 400 * 24 * 3_600_000;
/// How long an ended override stays listed (`/v1/overrides`) and in the agents' set, in ms: longer
/// than the longest window (a calendar month) plus the time the leader takes to check a settled
/// window's bound. Its pool's record keeps a pool override longer
/// ([`ENDED_POOL_OVERRIDE_KEPT_MS`]).
pub const ENDED_OVERRIDE_KEPT_MS: u64 = 40 * 24 * 3_600_000;

/// A tenant pool's limit replaced for a while.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolOverride {
    /// The override's id.
    pub id: RecordId,
    /// The pool's `G` while the override is in force, tokens per window.
    #[serde(rename = "limit")]
    pub limit_tokens: u64,
    /// When it came into force, epoch ms (allocator clock).
    pub starts_at_ms: u64,
    /// When it ends, epoch ms; none: until it is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

impl PoolOverride {
    /// Whether it is in force at `now_ms`.
    pub fn in_force_at(&self, now_ms: u64) -> bool {
        self.starts_at_ms <= now_ms && self.expires_at_ms.is_none_or(|end| now_ms < end)
    }

    /// Whether it is in force at some moment of `window`.
    pub fn overlaps(&self, window: Window) -> bool {
        self.starts_at_ms < window.end_ms
            && self.expires_at_ms.is_none_or(|end| window.start_ms < end)
    }
}

/// The pool's limit at `now_ms`: the override in force, else `base_tokens`.
pub fn limit_at(base_tokens: u64, overrides: &[PoolOverride], now_ms: u64) -> u64 {
    overrides
        .iter()
        .find(|o| o.in_force_at(now_ms))
        .map_or(base_tokens, |o| o.limit_tokens)
}

/// The highest limit in force at any moment of `window`: what the window's grants can have reached
/// when every grant was clamped to [`limit_at`] its own moment. The base limit counts unless
/// overrides cover the whole window.
pub fn window_limit(base_tokens: u64, overrides: &[PoolOverride], window: Window) -> u64 {
    let mut touching: Vec<&PoolOverride> =
        overrides.iter().filter(|o| o.overlaps(window)).collect();
    touching.sort_by_key(|o| o.starts_at_ms);
    let mut covered_until_ms = window.start_ms;
    for o in &touching {
        if o.starts_at_ms > covered_until_ms {
            break;
        }
        covered_until_ms = covered_until_ms.max(o.expires_at_ms.unwrap_or(u64::MAX));
    }
    let base = (covered_until_ms < window.end_ms).then_some(base_tokens);
    touching
        .iter()
        .map(|o| o.limit_tokens)
        .chain(base)
        .max()
        .unwrap_or(base_tokens)
}

/// The principal a rule override is for, by keyed hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OverridePrincipal {
    /// `user` or `api_key`: anonymous (`ip`) callers get no overrides.
    #[serde(rename = "type")]
    pub kind: PrincipalType,
    /// The principal's keyed hash, as the agents compute it.
    pub hash: PrincipalHash,
}

/// The amounts a rule override replaces; the rule's algorithm says which apply.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleAmounts {
    /// A rate rule's capacity, millitokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_millis: Option<u64>,
    /// A rate rule's refill per period, millitokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_millis: Option<u64>,
    /// A window rule's limit, units per window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

impl RuleAmounts {
    /// Whether it names no amount at all.
    pub fn is_empty(&self) -> bool {
        self.capacity_millis.is_none() && self.refill_millis.is_none() && self.limit.is_none()
    }
}

/// One regional rule's amounts replaced for a tenant, or for one principal of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleOverride {
    /// The override's id.
    pub id: RecordId,
    /// Whose requests.
    pub tenant: TenantId,
    /// Which rule of the bundle in force.
    pub rule: RuleId,
    /// Only this principal's requests (a per-principal rule); none: all of the tenant's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<OverridePrincipal>,
    /// The replaced amounts.
    pub amounts: RuleAmounts,
    /// When it ends, epoch ms (allocator clock); none: until it is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
}

impl RuleOverride {
    /// Whether it is still in force at `now_ms`.
    pub fn in_force_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|end| now_ms < end)
    }
}

/// Every rule override in force, as agents receive it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OverrideSet {
    /// Goes up by one with every change to the stored overrides (0: none ever).
    pub version: u64,
    /// `sha256:<hex>` over the version and the overrides ([`OverrideSet::seal`]).
    pub checksum: String,
    /// The overrides, by id.
    pub overrides: Vec<RuleOverride>,
}

/// A set whose checksum does not match its content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("override set {version}: checksum {given} does not match its content ({computed})")]
pub struct ChecksumMismatch {
    /// The set's version.
    pub version: u64,
    /// The checksum it carried.
    pub given: String,
    /// The checksum of its content.
    pub computed: String,
}

impl OverrideSet {
    /// The set of `overrides` at `version`, sorted by id and checksummed.
    pub fn seal(version: u64, mut overrides: Vec<RuleOverride>) -> Self {
        overrides.sort_by_key(|o| o.id);
        let checksum = checksum_of(version, &overrides);
        Self {
            version,
            checksum,
            overrides,
        }
    }

    /// The set, if its checksum matches its content.
    pub fn verify(self) -> Result<Self, ChecksumMismatch> {
        let computed = checksum_of(self.version, &self.overrides);
        if computed == self.checksum {
            Ok(self)
        } else {
            Err(ChecksumMismatch {
                version: self.version,
                given: self.checksum,
                computed,
            })
        }
    }
}

/// SHA-256 over the canonical JSON of the version and the overrides in order (serde writes the
/// fields of each in declaration order, without whitespace).
fn checksum_of(version: u64, overrides: &[RuleOverride]) -> String {
    let content = serde_json::json!({ "version": version, "overrides": overrides });
    let digest = Sha256::digest(content.to_string().as_bytes());
    format!("sha256:{}", hex::encode(digest))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(n: u64) -> RecordId {
        RecordId::from_parts(1_000 + n, u128::from(n))
    }

    fn pool_override(n: u64, limit: u64, starts: u64, expires: Option<u64>) -> PoolOverride {
        PoolOverride {
            id: id(n),
            limit_tokens: limit,
            starts_at_ms: starts,
            expires_at_ms: expires,
        }
    }

    fn window(start_ms: u64, end_ms: u64) -> Window {
        Window { start_ms, end_ms }
    }

    #[test]
    fn the_limit_in_force_is_the_overrides_between_its_start_and_end() {
        let raise = [pool_override(1, 5_000, 100, Some(200))];
        assert_eq!(limit_at(1_000, &raise, 99), 1_000);
        assert_eq!(limit_at(1_000, &raise, 100), 5_000);
        assert_eq!(limit_at(1_000, &raise, 199), 5_000);
        assert_eq!(limit_at(1_000, &raise, 200), 1_000);
        let open = [pool_override(2, 10, 0, None)];
        assert_eq!(limit_at(1_000, &open, u64::MAX - 1), 10);
    }

    #[test]
    fn a_window_counts_every_limit_in_force_during_it() {
        let raise = [pool_override(1, 5_000, 150, Some(160))];
        // Raised for 10 ms of the window: the window may have granted up to the raise.
        assert_eq!(window_limit(1_000, &raise, window(100, 200)), 5_000);
        assert_eq!(window_limit(1_000, &raise, window(200, 300)), 1_000);
        // A lowering that covers the whole window replaces the base; one that covers a part
        // does not.
        let lower = [pool_override(2, 300, 0, None)];
        assert_eq!(window_limit(1_000, &lower, window(100, 200)), 300);
        let part = [pool_override(3, 300, 120, None)];
        assert_eq!(window_limit(1_000, &part, window(100, 200)), 1_000);
        // Two lowerings back to back cover it together.
        let both = [
            pool_override(4, 200, 0, Some(150)),
            pool_override(5, 400, 150, None),
        ];
        assert_eq!(window_limit(1_000, &both, window(100, 200)), 400);
        let gap = [
            pool_override(6, 200, 0, Some(140)),
            pool_override(7, 400, 150, None),
        ];
        assert_eq!(window_limit(1_000, &gap, window(100, 200)), 1_000);
    }

    proptest! {
        /// Whatever the overrides (never overlapping, as the allocator keeps them) and whenever
        /// grants happen, a window's grants clamped to the limit at their moment never exceed
        /// its window limit.
        #[test]
        fn grants_clamped_at_their_moment_stay_within_the_window_limit(
            base in 1u64..10_000,
            spans in proptest::collection::vec((0u64..50, 1u64..50, 1u64..10_000, any::<bool>()), 0..6),
            grants in proptest::collection::vec((0u64..1_000, 1u64..5_000), 0..40),
        ) {
            let mut overrides = Vec::new();
            let mut at = 0;
            for (n, (gap, length, limit, open)) in spans.into_iter().enumerate() {
                let starts = at + gap * 10;
                let expires = (!open).then_some(starts + length * 10);
                overrides.push(pool_override(n as u64, limit, starts, expires));
                match expires {
                    Some(end) => at = end,
                    None => break,
                }
            }
            let window = window(200, 800);
            let mut grants: Vec<(u64, u64)> = grants
                .into_iter()
                .map(|(at, want)| (200 + at % 600, want))
                .collect();
            grants.sort();
            let mut granted = 0u64;
            for (at, want) in grants {
                let limit = limit_at(base, &overrides, at);
                granted += want.min(limit.saturating_sub(granted));
            }
            prop_assert!(granted <= window_limit(base, &overrides, window));
        }
    }

    fn rule_override(n: u64) -> RuleOverride {
        RuleOverride {
            id: id(n),
            tenant: TenantId::parse("acme").expect("tenant"),
            rule: RuleId::parse("read-user").expect("rule"),
            principal: Some(OverridePrincipal {
                kind: PrincipalType::ApiKey,
                hash: PrincipalHash::parse("0123456789abcdef").expect("hash"),
            }),
            amounts: RuleAmounts {
                limit: Some(50),
                ..RuleAmounts::default()
            },
            expires_at_ms: Some(5_000),
        }
    }

    #[test]
    fn a_set_verifies_only_with_its_own_checksum() {
        let set = OverrideSet::seal(3, vec![rule_override(2), rule_override(1)]);
        assert_eq!(set.overrides[0].id, id(1), "sealed in id order");
        let json = serde_json::to_string(&set).expect("json");
        let read: OverrideSet = serde_json::from_str(&json).expect("read");
        assert_eq!(read.clone().verify(), Ok(set.clone()));
        let mut tampered = read;
        tampered.overrides[0].amounts.limit = Some(5_000);
        assert!(tampered.verify().is_err());
        let mut renumbered = set;
        renumbered.version = 4;
        assert!(renumbered.verify().is_err());
    }

    #[test]
    fn the_wire_names_a_principal_by_hash_only() {
        let json = serde_json::to_value(rule_override(1)).expect("json");
        assert_eq!(
            json["principal"],
            serde_json::json!({"type": "api_key", "hash": "0123456789abcdef"})
        );
        assert_eq!(json["amounts"], serde_json::json!({"limit": 50}));
        let unknown =
            serde_json::json!({"type": "user", "hash": "0123456789abcdef", "id": "alice"});
        assert!(serde_json::from_value::<OverridePrincipal>(unknown).is_err());
        let short = serde_json::json!({"type": "user", "hash": "0123"});
        assert!(serde_json::from_value::<OverridePrincipal>(short).is_err());
    }
}
