//! What a pool's terms become in one agent: its holder's configuration, in one place. The agent
//! service and the drills both take up terms through [`holder_config`], so an agent in a drill
//! holds exactly what a shipped agent would: its share of the region's allowances, and the margins
//! that keep every spend inside its lease and its window. Pure.

use allot_shared::wire::PoolTerms;

use super::HolderConfig;

/// With a state directory, a fallback claim grows by the allowance divided by this (at least one
/// token): what a restart can leave unused of a window's allowance, and how many syncs a window's
/// fallback costs at most.
pub const FALLBACK_CLAIM_BLOCKS: u64 = 8;

/// What an agent brings to every pool's terms: what it knows of itself, not of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentShare {
    /// Agents serving the region (at least 1): each applies `1/region_agents` of the region's
    /// fallback allowance and settle debt, so the region's agents together stay within them.
    pub region_agents: u64,
    /// Tokens are never reserved within this many ms of a lease's end: the clock-rate margin plus
    /// the longest a reservation may wait for the regional rules before it is committed.
    pub expiry_margin_ms: u64,
    /// The most the agent's clock may be off the allocator's, ms.
    pub clock_margin_ms: u64,
    /// The allocator round trip the agent assumes, ms.
    pub round_trip_ms: u64,
    /// A renewal unanswered this long, ms, counts as an unreachable allocator.
    pub renewal_patience_ms: u64,
    /// Whether the agent keeps a state directory: fallback is then admitted only within durable
    /// claims of [`FALLBACK_CLAIM_BLOCKS`] a window.
    pub claims: bool,
}

impl AgentShare {
    /// This agent's share of a region-wide allowance of `region_tokens`: the region's agents
    /// together never exceed it (the remainder of the division is left unused).
    pub fn of_region(&self, region_tokens: u64) -> u64 {
        region_tokens / self.region_agents.max(1)
    }
}

/// The holder configuration for a pool of `terms` in an agent of `share` (`None`: windows this
/// agent cannot cut).
pub fn holder_config(terms: &PoolTerms, share: &AgentShare) -> Option<HolderConfig> {
    let fallback_tokens = share.of_region(terms.fallback_per_region_tokens);
    let config = HolderConfig {
        window: terms.window_spec()?,
        chunk_tokens: terms.chunk_tokens,
        lease_ttl_ms: terms.lease_ttl_ms,
        fallback_per_region_tokens: fallback_tokens,
        expiry_margin_ms: share.expiry_margin_ms,
        clock_margin_ms: share.clock_margin_ms,
        round_trip_ms: share.round_trip_ms,
        renewal_patience_ms: share.renewal_patience_ms,
        fallback_claim_block_tokens: if share.claims {
            (fallback_tokens / FALLBACK_CLAIM_BLOCKS).max(1)
        } else {
            0
        },
        settle_debt_tokens: share.of_region(terms.settle_debt_per_region_tokens),
    };
    debug_assert!(
        config
            .fallback_per_region_tokens
            .saturating_mul(share.region_agents.max(1))
            <= terms.fallback_per_region_tokens,
        "the region's agents together stay within its allowance"
    );
    Some(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(fallback: u64, debt: u64) -> PoolTerms {
        serde_json::from_value(serde_json::json!({
            "limit": 100, "windowMs": 60000, "chunk": 10, "leaseTtlMs": 5000,
            "fallbackPerRegion": fallback, "settleDebtPerRegion": debt,
            "regions": ["eu"], "version": 1 }))
        .expect("terms")
    }

    fn share(region_agents: u64, claims: bool) -> AgentShare {
        AgentShare {
            region_agents,
            expiry_margin_ms: 450,
            clock_margin_ms: 100,
            round_trip_ms: 20,
            renewal_patience_ms: 200,
            claims,
        }
    }

    #[test]
    fn the_regions_agents_together_never_exceed_its_allowances() {
        for agents in 1..=9 {
            for fallback in [0, 1, 7, 16, 100, 1_001] {
                let config = holder_config(&terms(fallback, fallback / 2), &share(agents, true))
                    .expect("config");
                assert!(config.fallback_per_region_tokens * agents <= fallback);
                assert!(config.settle_debt_tokens * agents <= fallback / 2);
                // What the division leaves unused is less than one more token each.
                assert!(fallback - config.fallback_per_region_tokens * agents < agents);
                assert!(config.fallback_claim_block_tokens >= 1);
            }
        }
        let alone = holder_config(&terms(16, 0), &share(2, false)).expect("config");
        assert_eq!(
            (
                alone.fallback_per_region_tokens,
                alone.fallback_claim_block_tokens
            ),
            (8, 0),
            "no state directory: no claims"
        );
    }
}
