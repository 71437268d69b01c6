//! What a pool's terms become in this agent: its holder's configuration, through the one pure
//! step the drills take too (`global::terms`), with this agent's settings. Below every other part
//! of the service: pools, upkeep and restore all build holders from it.

use std::time::Duration;

use super::Agent;
use super::settings::FIRST_GRANT_WAIT;
use crate::allocator_client::PoolTerms;
use crate::global::HolderConfig;
use crate::global::terms::{AgentShare, holder_config};

impl Agent {
    /// The holder configuration for a pool of `terms` (`None`: a window this agent cannot cut).
    pub(super) fn holder_config(&self, terms: &PoolTerms) -> Option<HolderConfig> {
        holder_config(terms, &self.share())
    }

    /// What this agent brings to every pool's terms.
    fn share(&self) -> AgentShare {
        AgentShare {
            region_agents: self.settings.region_agents,
            // A reservation is committed within the regional hold: reserving no later than the
            // margin plus the hold before a lease's end keeps every spend the margin ahead of it.
            expiry_margin_ms: self
                .settings
                .expiry_margin_ms
                .saturating_add(duration_ms(self.regional_hold())),
            clock_margin_ms: self.settings.clock_margin_ms,
            round_trip_ms: self.settings.allocator_round_trip_ms,
            renewal_patience_ms: duration_ms(FIRST_GRANT_WAIT),
            claims: self.journaling.keeps_state(),
        }
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
