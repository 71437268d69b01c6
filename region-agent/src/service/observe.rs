//! The gauges that describe the agent's state now, set at each metrics scrape: the regional
//! store's breakers and load, the bundle's version and age, each busy pool's stranded tokens,
//! fallback allowance and debt, and the settlements open.

use super::{Agent, lock};

impl Agent {
    /// Sets the gauges that describe the agent's state now (called at each metrics scrape).
    ///
    /// Long by design: it is the one list of the gauges a scrape sets, each a line or two read
    /// straight from the agent's parts, with the pools' lock let go before the settlements' is
    /// taken; split, what a scrape reports, and the order of the locks it takes, could no longer be
    /// seen in one place.
    pub fn observe(&self) {
        use crate::limiter::BreakerState;
        for (shard, snapshot) in self.limiter.breakers().iter().enumerate() {
            let state = match snapshot.state {
                BreakerState::Closed => 0.0,
                BreakerState::HalfOpen => 1.0,
                BreakerState::Open => 2.0,
            };
            metrics::gauge!(crate::metrics::BREAKER_STATE, "shard" => shard.to_string()).set(state);
        }
        for (shard, load) in self.limiter.shard_loads().iter().enumerate() {
            let shard = shard.to_string();
            metrics::gauge!(crate::metrics::STORE_IN_FLIGHT_LIMIT, "shard" => shard.clone())
                .set(load.limit as f64);
            metrics::gauge!(crate::metrics::STORE_IN_FLIGHT, "shard" => shard.clone())
                .set(load.in_flight as f64);
            metrics::gauge!(crate::metrics::STORE_WAITING, "shard" => shard)
                .set(load.waiting as f64);
        }
        for (tenant, sub_slots) in self.limiter.hot_tenants().iter() {
            metrics::gauge!(crate::metrics::HOT_TENANT_SUB_SLOTS, "tenant" => tenant.to_string())
                .set(f64::from(sub_slots));
        }
        metrics::gauge!(crate::metrics::POLICY_VERSION).set(self.bundle.version() as f64);
        let installed = self.bundle.installed_at_ms();
        if installed > 0 {
            let age_ms = self.clock.now_ms().saturating_sub(installed);
            metrics::gauge!(crate::metrics::POLICY_AGE_SECONDS).set(age_ms as f64 / 1_000.0);
        }
        let stats = self.limiter.stats();
        for (path, count) in [
            ("decisions", stats.decisions),
            ("store_calls", stats.store_calls),
            ("store_retries", stats.store_retries),
            ("negative_cache_hits", stats.negative_cache_hits),
            ("cardinality_refusals", stats.cardinality_refusals),
            ("fallback", stats.fallback_decisions),
            ("unavailable", stats.unavailable),
            ("policy_errors", stats.policy_errors),
            ("breaker_refusals", stats.breaker_refusals),
            ("in_flight_exhausted", stats.pool_exhausted),
            ("shed", stats.shed),
            ("slow_calls", stats.slow_calls),
            ("breaker_failures", stats.breaker_failures),
            ("held_up", stats.held_up),
            ("coalesced", stats.coalesced_decisions),
            ("coalesced_calls", stats.coalesced_calls),
        ] {
            metrics::gauge!(crate::metrics::LIMITER_DECISIONS, "path" => path).set(count as f64);
        }
        metrics::gauge!(crate::metrics::ALLOCATOR_REACHABLE).set(if self.allocator_reachable() {
            1.0
        } else {
            0.0
        });
        // The pools' gauges of busy pools only: a settled pool's were set when it settled.
        for ((tenant, pool), slot) in self.pools.busy_slots() {
            let mut agent = slot.agent_quietly();
            self.pools
                .note_dropped_reports(agent.take_dropped_reports());
            crate::metrics::set_pool_gauges(&tenant, &pool, agent.holder());
        }
        let (held, _) = self.pools.counts();
        metrics::gauge!(crate::metrics::POOLS_HELD).set(held as f64);
        metrics::gauge!(crate::metrics::POOLS_BUSY).set(self.pools.busy().listed_count() as f64);
        let dropped = self.pools.dropped_reports();
        let (open, debtors) = {
            let settlements = lock(&self.settlements);
            (settlements.open_count(), settlements.debtor_count())
        };
        metrics::gauge!(crate::metrics::OPEN_SETTLEMENTS).set(open as f64);
        metrics::gauge!(crate::metrics::REGIONAL_DEBTORS).set(debtors as f64);
        metrics::gauge!(crate::metrics::REPORT_LINES_DROPPED).set(dropped as f64);
    }
}
