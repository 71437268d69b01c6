//! The drill's layout: its tenants, each pool's spec and holder configuration as the agent would
//! derive them, and how arrivals are dealt over a region's agents.

use allot_allocator::kv::Kv;
use allot_allocator::pools::{PoolSpec, put_pool};
use allot_region_agent::global::holder::HolderConfig;
use allot_region_agent::global::terms::AgentShare;
use allot_region_agent::limiter::LimiterConfig;
use allot_region_agent::service::{DEFAULT_EXPIRY_MARGIN_MS, FIRST_GRANT_WAIT};
use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::wire::{CalendarWindowSpec, PoolTerms};

use super::conditions::ms;
use super::{DrillError, ROUND_TRIP_MS, invalid, store};
use crate::drill::scenario::{PoolLayout, Scenario};

/// The drill's tenants: `drill`, or `t00000`, `t00001`, ... for several.
pub(super) fn tenants_of(scenario: &Scenario) -> Result<Vec<TenantId>, DrillError> {
    let tenant_count = usize::try_from(scenario.tenants).map_err(invalid)?;
    (0..tenant_count)
        .map(|t| {
            let name = if tenant_count == 1 {
                "drill".to_owned()
            } else {
                format!("t{t:05}")
            };
            TenantId::parse(&name).map_err(invalid)
        })
        .collect()
}

/// A pool of `limit_tokens` for `regions` with the scenario's terms.
pub(super) fn pool_spec(
    scenario: &Scenario,
    limit_tokens: u64,
    regions: Vec<RegionId>,
) -> PoolSpec {
    let window = scenario.calendar.as_ref().map(|c| CalendarWindowSpec {
        calendar: c.unit.clone(),
        time_zone: c.time_zone.clone(),
    });
    PoolSpec {
        limit_tokens,
        window_ms: if window.is_some() {
            0
        } else {
            scenario.window_ms
        },
        window,
        chunk_tokens: scenario.chunk_tokens,
        lease_ttl_ms: scenario.lease_ttl_ms,
        fallback_per_region_tokens: scenario.fallback_per_region_tokens,
        settle_debt_per_region_tokens: scenario.settle_debt_per_region_tokens,
        regions,
    }
}

/// Configures every tenant's pools as the layout says; returns, by tenant and region, the pool
/// each region draws from.
pub(super) async fn configure_pools(
    kv: &dyn Kv,
    scenario: &Scenario,
    tenants: &[TenantId],
    regions: &[RegionId],
    configured_at_ms: u64,
) -> Result<Vec<Vec<PoolId>>, DrillError> {
    let pool_id = PoolId::parse("api").map_err(invalid)?;
    let mut pools = Vec::with_capacity(tenants.len());
    for tenant in tenants {
        match scenario.layout {
            PoolLayout::Shared => {
                let spec = pool_spec(scenario, scenario.limit_tokens, regions.to_vec());
                put_pool(kv, tenant, &pool_id, spec, configured_at_ms)
                    .await
                    .map_err(store)?;
                pools.push(vec![pool_id.clone(); regions.len()]);
            }
            PoolLayout::PerRegion { per_region_limit } => {
                let mut per_region = Vec::new();
                for region in regions {
                    let id = PoolId::parse(&format!("{pool_id}-{region}")).map_err(invalid)?;
                    let spec = pool_spec(scenario, per_region_limit, vec![region.clone()]);
                    put_pool(kv, tenant, &id, spec, configured_at_ms)
                        .await
                        .map_err(store)?;
                    per_region.push(id);
                }
                pools.push(per_region);
            }
        }
    }
    Ok(pools)
}

/// How a shipped agent of a region of `plan` configures a pool's holder from its `terms`, through
/// the agent's own step: its share of the region's allowance (by what it is told the region runs),
/// an expiry margin that includes the regional hold (two decision budgets), and a renewal
/// unanswered for FIRST_GRANT_WAIT means fallback. `None`: windows it cannot cut.
pub(super) fn holder_config(
    terms: &PoolTerms,
    plan: &crate::drill::scenario::RegionPlan,
    clock_margin_ms: u64,
) -> Option<HolderConfig> {
    let regional_hold_ms = 2 * ms(LimiterConfig::default().decision_budget);
    let share = AgentShare {
        region_agents: plan.region_agents_setting.unwrap_or(plan.agents),
        expiry_margin_ms: DEFAULT_EXPIRY_MARGIN_MS + regional_hold_ms,
        clock_margin_ms,
        round_trip_ms: ROUND_TRIP_MS,
        renewal_patience_ms: ms(FIRST_GRANT_WAIT),
        // The drills' agents keep no state directory: a restart starts from the ledger's count.
        claims: false,
    };
    allot_region_agent::global::terms::holder_config(terms, &share)
}

/// Deals `arrivals` out over a region's agents (`shares`, one each), evenly, the remainder
/// to the agents from `turn` on, so no agent is always the one that gets more.
pub(super) fn deal(arrivals: u64, turn: u64, shares: &mut [u64]) {
    let agents = shares.len().max(1) as u64;
    for (k, share) in shares.iter_mut().enumerate() {
        let behind = (k as u64 + agents - turn % agents) % agents;
        *share = arrivals / agents + u64::from(behind < arrivals % agents);
    }
    debug_assert_eq!(shares.iter().sum::<u64>(), arrivals, "every arrival dealt");
}
