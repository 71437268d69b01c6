//! What a pool's terms become in this agent: its holder's configuration. This agent's share of the
//! region's allowances, and the margins that keep every spend inside its lease and its window.
//! Below every other part of the service: pools, upkeep and restore all build holders from it.

use std::time::Duration;

use super::Agent;
use super::persistence::FALLBACK_CLAIM_BLOCKS;
use super::settings::FIRST_GRANT_WAIT;
use crate::allocator_client::PoolTerms;
use crate::global::HolderConfig;

impl Agent {
    /// The holder configuration for a pool of `terms` (`None`: a window this agent cannot cut).
    pub(super) fn holder_config(&self, terms: &PoolTerms) -> Option<HolderConfig> {
        let agents = self.settings.region_agents.max(1);
        let fallback_per_agent_tokens = terms.fallback_per_region_tokens / agents;
        Some(HolderConfig {
            window: terms.window_spec()?,
            chunk_tokens: terms.chunk_tokens,
            lease_ttl_ms: terms.lease_ttl_ms,
            fallback_per_region_tokens: fallback_per_agent_tokens,
            // A reservation is committed within the regional hold: reserving no later than the
            // margin plus the hold before a lease's end keeps every spend the margin ahead of it.
            expiry_margin_ms: self
                .settings
                .expiry_margin_ms
                .saturating_add(duration_ms(self.regional_hold())),
            clock_margin_ms: self.settings.clock_margin_ms,
            round_trip_ms: self.settings.allocator_round_trip_ms,
            renewal_patience_ms: duration_ms(FIRST_GRANT_WAIT),
            fallback_claim_block_tokens: self
                .fallback_claim_block_tokens(fallback_per_agent_tokens),
            settle_debt_tokens: terms.settle_debt_per_region_tokens / agents,
        })
    }

    /// Claim blocks for a pool's holder: `fallbackPerRegion / FALLBACK_CLAIM_BLOCKS`, at least 1;
    /// 0 (no claims) without a state directory.
    fn fallback_claim_block_tokens(&self, fallback_per_agent_tokens: u64) -> u64 {
        if !self.persistence.keeps_state() {
            return 0;
        }
        (fallback_per_agent_tokens / FALLBACK_CLAIM_BLOCKS).max(1)
    }

    /// How long global tokens stay reserved at most while the regional rules are decided: two
    /// decision budgets (concurrency slots, then the store call). Past it the request is answered
    /// `LIMITER_UNAVAILABLE` and the reservation cancelled. Holders never reserve within this long
    /// (plus the expiry margin) of a lease's end, so a committed token is spent before it.
    pub fn regional_hold(&self) -> Duration {
        self.limiter.decision_budget().saturating_mul(2)
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
