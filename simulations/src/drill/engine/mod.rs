//! The drill engine: the shipped allocator grant service ([`Grantor`](allot_allocator::grants::Grantor) over the embedded
//! [`MemoryKv`]) and the shipped agent lease loop ([`PoolAgent`], the very type the agent service
//! runs, around its `PoolHolder`) driven in virtual time, with the scenario's demand and faults
//! applied at their seams (the store, the clock, the transport).
//!
//! Each tick, for every agent and tenant: grant answers that have arrived are handed to the pool's
//! agent; the tick's requests are reserved and committed as the agent admits a request whose only
//! rule is the pool (a request finding no lease waits for the renewal it started up to
//! [`FIRST_GRANT_WAIT`], as the agent does; renewals follow demand, one in flight at a time); every
//! [`REPORT_EVERY_MS`] the agent reports what its pools owe, and learns from the call, as from any,
//! whether the allocator is reachable. Faults act where they would in production: a partition fails
//! the agent's calls; a lost answer is granted but never delivered, so the call ends only when the
//! agent gives up on it ([`CALL_TIMEOUT`](allot_region_agent::allocator_client::CALL_TIMEOUT)); latency delays delivery; a crash loses the agent's
//! memory; a skewed clock is the agent's clock.
//!
//! Determinism: one task, one virtual clock, a seeded generator for every random choice; the same
//! scenario and seed give the same report, byte for byte. Units: tokens (cost 1 per request), ms.

mod allocator;
mod conditions;
mod setup;
mod step;

use std::sync::Arc;

use allot_allocator::clock::ManualClock;
use allot_allocator::kv::Kv;
use allot_allocator::kv::memory::MemoryKv;
use allot_region_agent::global::PoolAgent;
use allot_region_agent::global::holder::{HolderConfig, MAX_LIVE_LEASES};
use allot_region_agent::service::FIRST_GRANT_WAIT;
use allot_shared::ids::{LeaseId, PoolId, RegionId};
use allot_shared::lease::{OvershootBound, PoolConfig};
use allot_shared::window::Window;
use allot_shared::wire::GrantAnswer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::check::{TenantChecker, check_expectation};
use super::gateways::Gateways;
use super::results::{Convergence, DrillReport, MAX_VIOLATION_LINES};
use super::scenario::{Fault, PoolLayout, Scenario};
use allocator::DrillAllocator;
use conditions::{REQUEST_KIND_STREAM, TIMING_STREAM, arrival_phase, conditions, ms, poisson};
use setup::{configure_pools, deal, holder_config, pool_spec, tenants_of};
use step::{Step, crash, record_gateway_decision};

/// The allocator round trip without faults, ms (the agents size their renewal watermark with it).
pub const ROUND_TRIP_MS: u64 = 20;
/// Agents report (and the holders forget what was acknowledged) this often, ms.
pub const REPORT_EVERY_MS: u64 = 1_000;

/// A grant answer on its way to an agent (the renewal it answers is the pool agent's in flight).
#[derive(Debug, Clone)]
struct InFlight {
    deliver_at_ms: u64,
    /// When the agent's call gives up waiting ([`CALL_TIMEOUT`](allot_region_agent::allocator_client::CALL_TIMEOUT) after it was sent): an answer due
    /// later never reaches the holder; the call fails then (the grant stays committed).
    gives_up_at_ms: u64,
    /// The lease's end on the allocator's (true) clock, to check spends against.
    true_expires_at_ms: u64,
    /// When the call was made, on the agent's clock.
    asked_at_ms: u64,
    /// `None`: the answer is lost.
    answer: Option<GrantAnswer>,
}

/// One tenant's pool in one region's agent.
#[derive(Debug, Default)]
struct HeldPool {
    /// `None` until the agent has the pool's terms (at start, after a restart).
    agent: Option<PoolAgent>,
    in_flight: Option<InFlight>,
    /// Lease ends in true time, to check that nothing is spent past them.
    lease_ends: Vec<(LeaseId, u64)>,
    /// A lease whose grant was committed but whose answer was lost.
    committed_unanswered: Option<LeaseId>,
    demand_remainder: u64,
    stranded_seen: u64,
    admitted_since_report: u64,
    /// The region's gateways for this tenant, in RLQS drills (they outlive an agent crash).
    gateways: Option<Gateways>,
    /// When the agent next fetches the pool's terms after an operator changed its limit (true
    /// time, epoch ms): the shipped agent refreshes held terms every `TERMS_REFRESH_MS`, so it
    /// learns of the change that much later at worst, and asks again for a window it was told
    /// was spent.
    terms_change_seen_at_ms: Option<u64>,
}

/// One agent process of a region.
#[derive(Debug)]
struct RegionAgent {
    region: RegionId,
    /// Its region's index in the scenario (a region may run several agents).
    region_index: usize,
    /// Its index among the region's agents, from 0.
    agent_index: u64,
    /// Per tenant, the fallback admits the ledger holds for this agent: (window start, tokens).
    /// Survives a crash: it is the allocator's, handed to a restarting agent with the pool's terms.
    ledger_fallback: Vec<(u64, u64)>,
    /// What the agent believes after its last allocator call (it decides whether fallback applies).
    believes_reachable: bool,
    /// Down until this instant (ms since the start) after a crash.
    down_until_ms: Option<u64>,
    /// When the running process started on the agent's clock, epoch ms, if the one before it
    /// crashed: the drills' agents keep no state directory, so it counts that window's fallback
    /// allowance as used (as the shipped agent does, told by the allocator's session record).
    unclean_start_ms: Option<u64>,
    pools: Vec<HeldPool>,
}

/// Why a drill could not run to its end (a failing drill is a report with violations, not this).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DrillError {
    /// The scenario is not valid, or names what cannot be an identifier.
    #[error("invalid scenario: {0}")]
    Scenario(String),
    /// The embedded store refused what the drill set up.
    #[error("the embedded store failed: {0}")]
    Store(String),
    /// The shipped code did what must never happen, past which the drill cannot go on (a grant
    /// from a stale epoch reached a holder; a deposed allocator granted).
    #[error("broken: {0}")]
    Broken(String),
}

impl From<DrillError> for String {
    fn from(error: DrillError) -> String {
        error.to_string()
    }
}

fn invalid(error: impl std::fmt::Display) -> DrillError {
    DrillError::Scenario(error.to_string())
}

fn store(error: impl std::fmt::Display) -> DrillError {
    DrillError::Store(error.to_string())
}

/// Runs `scenario` with its own seed and duration.
pub async fn run(scenario: &Scenario) -> Result<DrillReport, DrillError> {
    run_with(scenario, scenario.seed, scenario.duration_ms).await
}

/// Runs `scenario` with `seed` for `duration_ms` (a shorter run reproduces a failure faster):
/// build the allocator and agents, tick until the duration, finish with the checks.
pub async fn run_with(
    scenario: &Scenario,
    seed: u64,
    duration_ms: u64,
) -> Result<DrillReport, DrillError> {
    let mut drill = Drill::build(scenario, seed).await?;
    let mut elapsed_ms = 0;
    while elapsed_ms < duration_ms {
        drill.tick(elapsed_ms).await?;
        elapsed_ms += scenario.tick_ms;
    }
    Ok(drill.finish(duration_ms))
}

/// A drill in progress: the shipped grant service and agent holders on one virtual clock, the
/// faults, and the checker that keeps the history.
struct Drill<'s> {
    scenario: &'s Scenario,
    seed: u64,
    /// Random arrivals and answer loss.
    rng: StdRng,
    /// Which requests are denied regionally or metered.
    kinds: StdRng,
    clock: Arc<ManualClock>,
    /// When the run starts (seed 0: the first window's start, `results::START_MS` unless the scenario
    /// has calendar windows).
    run_start_ms: u64,
    /// The first window's start: window offsets are measured from it.
    base_ms: u64,
    /// The tenant's quota as one pool (the bound's terms are computed from it).
    config: PoolConfig,
    allocator: DrillAllocator,
    /// Every region's agents, region by region.
    agents: Vec<RegionAgent>,
    /// Per region, how its agents configure a pool's holder (each its share of the allowance).
    holder_configs: Vec<HolderConfig>,
    /// Per region and tenant, this tick's arrivals for each of the region's agents (dealt by its
    /// first agent's turn, which draws them).
    shares: Vec<Vec<Vec<u64>>>,
    bound: OvershootBound,
    checker: TenantChecker,
    /// Per region, the last tick with an abnormal decision (fallback, waiting, agent down).
    last_abnormal_ms: Vec<Option<u64>>,
    /// Per tenant, its pool's overrides as the allocator stored them.
    overrides: Vec<Vec<allot_shared::overrides::PoolOverride>>,
}

impl<'s> Drill<'s> {
    /// The pools, the leader, the agents (their holders configured as the shipped agent does).
    ///
    /// Long by design: the timing stream seeded at its top is drawn in a fixed order (the run's
    /// start, then each region's and tenant's arrival phase), and a seed names the same run only
    /// while that order holds; split, the stream would be handed between helpers and the order of
    /// its draws would rest on the order of the calls.
    async fn build(scenario: &'s Scenario, seed: u64) -> Result<Self, DrillError> {
        scenario.validate().map_err(DrillError::Scenario)?;
        // Seed 0 starts on a window boundary (the figures the docs quote); any other seed starts
        // the run at a random tick within the first window, and each region's and tenant's
        // steady arrivals at a random phase, from a stream of their own (random arrivals and
        // answer loss keep theirs): a seed sweep then also varies where window ends fall relative
        // to faults, leases, renewals and arrivals.
        let mut phases = (seed != 0).then(|| StdRng::seed_from_u64(seed ^ TIMING_STREAM));
        let windows = scenario.windows().map_err(invalid)?;
        let base_ms = windows.base_ms;
        let ticks_per_window = (windows.phase_span_ms / scenario.tick_ms.max(1)).max(1);
        let run_start_ms = windows.start_ms
            + phases.as_mut().map_or(0, |rng| {
                rng.random_range(0..ticks_per_window) * scenario.tick_ms
            });
        let clock = Arc::new(ManualClock::new(run_start_ms));
        let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
        let regions = scenario
            .regions
            .iter()
            .map(|plan| RegionId::parse(&plan.region).map_err(invalid))
            .collect::<Result<Vec<_>, _>>()?;
        let tenants = tenants_of(scenario)?;
        let config = pool_spec(scenario, scenario.limit_tokens, regions.clone())
            .validate()
            .map_err(invalid)?;
        let pools = configure_pools(&*kv, scenario, &tenants, &regions, base_ms).await?;
        let shards = allot_shared::shards::ShardCount::new(scenario.shards).map_err(invalid)?;
        let allocator =
            DrillAllocator::lead_shards(kv, &clock, scenario.clamping, tenants, pools, shards)
                .await?;
        let tenant_count = allocator.tenants.len();
        let mut agents = Vec::new();
        for (region_index, (region, plan)) in regions.iter().zip(&scenario.regions).enumerate() {
            for agent_index in 0..plan.agents {
                agents.push(RegionAgent {
                    region: region.clone(),
                    region_index,
                    agent_index,
                    ledger_fallback: vec![(0, 0); tenant_count],
                    believes_reachable: true,
                    down_until_ms: None,
                    unclean_start_ms: None,
                    pools: (0..tenant_count)
                        .map(|_| HeldPool {
                            // The region's arrival phase is its first agent's: it draws the
                            // region's arrivals.
                            demand_remainder: if agent_index == 0 {
                                arrival_phase(&mut phases)
                            } else {
                                0
                            },
                            ..HeldPool::default()
                        })
                        .collect(),
                });
            }
        }
        let terms = allot_allocator::pools::StoredPool {
            spec: pool_spec(scenario, scenario.limit_tokens, regions.clone()),
            version: 1,
            updated_at_ms: base_ms,
            overrides: Vec::new(),
        }
        .terms(base_ms, None);
        let holder_configs = scenario
            .regions
            .iter()
            .map(|plan| holder_config(&terms, plan, scenario.clock_margin_ms))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| DrillError::Broken("the pool's windows cannot be cut".into()))?;
        let shares = scenario
            .regions
            .iter()
            .map(|plan| vec![vec![0; plan.agents as usize]; tenant_count])
            .collect();
        let pool_limits = match scenario.layout {
            PoolLayout::Shared => scenario.limit_tokens,
            PoolLayout::PerRegion { per_region_limit } => per_region_limit * regions.len() as u64,
        };
        let bound = OvershootBound {
            limit_tokens: pool_limits,
            ..OvershootBound::for_design(&config, scenario.clamping, MAX_LIVE_LEASES as u64, 0)
        };
        Ok(Self {
            scenario,
            seed,
            rng: StdRng::seed_from_u64(seed),
            kinds: StdRng::seed_from_u64(seed ^ REQUEST_KIND_STREAM),
            clock,
            run_start_ms,
            base_ms,
            config,
            allocator,
            agents,
            holder_configs,
            shares,
            bound,
            checker: TenantChecker::new(scenario, bound, tenant_count, regions.len()),
            last_abnormal_ms: vec![None; regions.len()],
            overrides: vec![Vec::new(); tenant_count],
        })
    }

    /// One tick: the clock moves, a failover or shard move due now happens, then every region's agent serves
    /// the tick's requests (unless it is down).
    async fn tick(&mut self, elapsed_ms: u64) -> Result<(), DrillError> {
        let tick_ms = self.scenario.tick_ms;
        let now_ms = self.run_start_ms + elapsed_ms;
        self.clock.set(now_ms);
        let window = self.config.window_at(now_ms);
        self.checker.roll_to(window.start_ms - self.base_ms);
        let due = |at_ms: u64| (elapsed_ms..elapsed_ms + tick_ms).contains(&at_ms);
        for fault in &self.scenario.faults {
            match *fault {
                Fault::Failover {
                    at_ms,
                    records_kept,
                } if due(at_ms) => {
                    let lost = self
                        .allocator
                        .fail_over(&self.config, &self.clock, records_kept, now_ms)
                        .await?;
                    for (tenant, lost) in lost.into_iter().enumerate() {
                        self.checker.add_lost(tenant, lost);
                    }
                }
                Fault::ShardMove { at_ms, shard } if due(at_ms) => {
                    let shard = allot_shared::shards::ShardId(shard);
                    self.allocator
                        .move_shard(shard, &self.config, now_ms)
                        .await?;
                }
                _ => {}
            }
        }
        self.apply_overrides(elapsed_ms, now_ms).await?;
        for a in 0..self.agents.len() {
            let abnormal = self.serve_agent(a, elapsed_ms, now_ms, window).await?;
            if abnormal {
                self.last_abnormal_ms[self.agents[a].region_index] = Some(elapsed_ms);
            }
        }
        Ok(())
    }

    /// The operator's overrides due this tick, made or ended through the allocator's own override
    /// store (the grant workers see them as production's do: in the pool's record, under its
    /// revision guard); the checker learns each tenant's overrides as stored.
    async fn apply_overrides(&mut self, elapsed_ms: u64, now_ms: u64) -> Result<(), DrillError> {
        use allot_allocator::overrides::{NewOverride, Target, create, end};
        let tick_ms = self.scenario.tick_ms;
        let due = |at_ms: u64| (elapsed_ms..elapsed_ms + tick_ms).contains(&at_ms);
        let pool = PoolId::parse("api").map_err(invalid)?;
        for (index, planned) in self.scenario.overrides.iter().enumerate() {
            let starts = due(planned.at_ms);
            let ends = planned
                .ended_after_ms
                .is_some_and(|after| due(planned.at_ms + after));
            if !starts && !ends {
                continue;
            }
            for t in 0..self.allocator.tenants.len() {
                if planned.tenant.is_some_and(|only| only != t as u64) {
                    continue;
                }
                let tenant = self.allocator.tenants[t].clone();
                // Reproducible ids: the override's schedule and tenant.
                let id = allot_shared::ids::RecordId::from_parts(
                    self.run_start_ms + planned.at_ms,
                    ((index as u128) << 32) | t as u128,
                );
                if starts {
                    let new = NewOverride {
                        tenant: tenant.clone(),
                        target: Target::Pool {
                            pool: pool.clone(),
                            limit_tokens: planned.limit,
                        },
                        expires_at_ms: planned.lasts_ms.map(|ms| now_ms + ms),
                        reason: format!("drill override {index}"),
                        created_by: "drill".to_owned(),
                    };
                    create(&*self.allocator.kv, new, id, now_ms)
                        .await
                        .map_err(store)?;
                }
                if ends {
                    end(&*self.allocator.kv, &tenant, &id, now_ms)
                        .await
                        .map_err(store)?;
                }
                let stored = allot_allocator::pools::get_pool(&*self.allocator.kv, &tenant, &pool)
                    .await
                    .map_err(store)?
                    .map(|(stored, _)| stored.overrides)
                    .unwrap_or_default();
                self.checker.set_overrides(t, stored.clone());
                self.overrides[t] = stored;
                let seen_at_ms = now_ms + allot_region_agent::service::TERMS_REFRESH_MS;
                for agent in &mut self.agents {
                    agent.pools[t].terms_change_seen_at_ms = Some(seen_at_ms);
                }
            }
        }
        Ok(())
    }

    /// Agent `a` during one tick: a crash due now empties its memory; then its share of each
    /// tenant's arrivals in its region is served (or, while the agent is down, not). Returns
    /// whether any decision was abnormal.
    ///
    /// Long by design: it is one agent's tick in the drill's order of events: a crash due in the
    /// tick lands before any arrival, each pool's arrivals are dealt before they are served, and a
    /// down agent's share still reaches its gateways or is denied; split, that order would hold
    /// only by the order of calls, and the step's disjoint borrows of the engine's fields would be
    /// taken again in each piece.
    async fn serve_agent(
        &mut self,
        a: usize,
        elapsed_ms: u64,
        now_ms: u64,
        window: Window,
    ) -> Result<bool, DrillError> {
        let scenario = self.scenario;
        let tick_ms = scenario.tick_ms;
        let (r, agent_index) = (self.agents[a].region_index, self.agents[a].agent_index);
        let plan = &scenario.regions[r];
        let c = conditions(scenario, &plan.region, elapsed_ms);
        let agent_now_ms = now_ms.saturating_add_signed(c.clock_offset_ms);
        for fault in &scenario.faults {
            if let Fault::AgentRestart {
                at_ms,
                down_ms,
                agent,
                ..
            } = *fault
                && fault.touches(&plan.region)
                && agent.is_none_or(|only| only == agent_index)
                && (elapsed_ms..elapsed_ms + tick_ms).contains(&at_ms)
            {
                crash(&mut self.agents[a], &mut self.checker, r, agent_now_ms);
                self.agents[a].down_until_ms = Some(at_ms + down_ms);
                let back_in_ms = (at_ms + down_ms).saturating_sub(elapsed_ms);
                // The allocator stamps the new run's session on its own clock.
                self.agents[a].unclean_start_ms = Some(now_ms + back_in_ms);
            }
        }
        let agent = &mut self.agents[a];
        let down = agent.down_until_ms.is_some_and(|until| elapsed_ms < until);
        let report_due = elapsed_ms.is_multiple_of(REPORT_EVERY_MS.max(tick_ms));
        let mut abnormal = down;
        for t in 0..agent.pools.len() {
            let held = &mut agent.pools[t];
            if !down
                && !c.partitioned
                && held.terms_change_seen_at_ms.is_some_and(|at| at <= now_ms)
            {
                held.terms_change_seen_at_ms = None;
                // An override changes the pool's limit, not its holder's terms: the agent takes
                // the same configuration again, as the service does with any change of terms.
                if let Some(agent) = held.agent.as_mut() {
                    let config = agent.config().clone();
                    agent.retune(config);
                }
            }
            // The region's first agent draws the region's arrivals and deals them out; its
            // other agents serve what they were dealt.
            if agent_index == 0 {
                let region_arrivals = {
                    let held = &mut agent.pools[t];
                    let per_minute = plan.per_minute_at(elapsed_ms, scenario.duration_ms);
                    if plan.random {
                        poisson(&mut self.rng, per_minute as f64 * tick_ms as f64 / 60_000.0)
                    } else {
                        let scaled = per_minute * tick_ms + held.demand_remainder;
                        held.demand_remainder = scaled % 60_000;
                        scaled / 60_000
                    }
                };
                deal(
                    region_arrivals,
                    elapsed_ms / tick_ms.max(1),
                    &mut self.shares[r][t],
                );
            }
            let arrivals = self.shares[r][t][agent_index as usize];
            if down {
                match agent.pools[t].gateways.as_mut() {
                    // Gateways keep enforcing what they were given while their agent is down.
                    Some(gateways) => {
                        let window_start_ms = window.start_ms;
                        for _ in 0..arrivals {
                            let decided = gateways.decide(agent_now_ms);
                            record_gateway_decision(
                                self.checker.record(t, r),
                                decided,
                                now_ms,
                                window_start_ms,
                            );
                        }
                    }
                    None => {
                        let record = self.checker.record(t, r);
                        record.demand += arrivals;
                        record.denied_unavailable += arrivals;
                    }
                }
                continue;
            }
            let mut step = Step {
                allocator: &mut self.allocator,
                rng: &mut self.rng,
                kinds: &mut self.kinds,
                plan,
                checker: &mut self.checker,
                region: &agent.region,
                believes_reachable: &mut agent.believes_reachable,
                held: &mut agent.pools[t],
                ledger_fallback: &mut agent.ledger_fallback[t],
                unclean_start_ms: agent.unclean_start_ms,
                tenant: t,
                region_index: r,
                conditions: c,
                now_ms,
                agent_now_ms,
                window_start_ms: window.start_ms,
                tick_ms,
                first_grant_wait_ms: ms(FIRST_GRANT_WAIT),
                limit_tokens: allot_shared::overrides::limit_at(
                    scenario.limit_tokens,
                    &self.overrides[t],
                    now_ms,
                ),
            };
            let config = self.holder_configs[r].clone();
            abnormal |= match scenario.gateways {
                Some(plan) => {
                    step.run_gateways(arrivals, config, report_due, plan)
                        .await?
                }
                None => step.run(arrivals, config, report_due).await?,
            };
        }
        Ok(abnormal)
    }

    /// The report: the history by window, convergence after the last heal, and every violation of
    /// the invariants, the bound and the scenario's expectation.
    fn finish(mut self, duration_ms: u64) -> DrillReport {
        let scenario = self.scenario;
        let tick_ms = scenario.tick_ms;
        let windows = self.checker.finish();
        let mut violations = std::mem::take(&mut self.checker.violations);
        let mut not_listed = self.checker.violations_not_listed;
        let convergence = scenario
            .heals_at_ms()
            .filter(|&h| h < duration_ms)
            .map(|healed_at_ms| {
                let mut after_ms = [0; super::scenario::MAX_REGIONS];
                for (r, last) in self.last_abnormal_ms.iter().enumerate() {
                    if let Some(last) = *last
                        && last >= healed_at_ms
                    {
                        after_ms[r] = last + tick_ms - healed_at_ms;
                    }
                }
                Convergence {
                    healed_at_ms,
                    after_ms,
                    limit_ms: scenario.converge_within_ttls * scenario.lease_ttl_ms,
                }
            });
        if let Some(c) = &convergence {
            for (r, plan) in scenario.regions.iter().enumerate() {
                if c.after_ms[r] > c.limit_ms {
                    violations.push(format!(
                        "region {} converged {} ms after the heal at {} ms, later than {} lease TTLs ({} ms)",
                        plan.region, c.after_ms[r], c.healed_at_ms, scenario.converge_within_ttls, c.limit_ms
                    ));
                }
            }
        }
        check_expectation(scenario, &windows, &mut violations);
        if violations.len() > MAX_VIOLATION_LINES {
            not_listed += (violations.len() - MAX_VIOLATION_LINES) as u64;
            violations.truncate(MAX_VIOLATION_LINES);
        }
        DrillReport {
            scenario: Scenario {
                duration_ms,
                ..scenario.clone()
            },
            seed: self.seed,
            bound: self.bound,
            windows,
            convergence,
            violations,
            violations_not_listed: not_listed,
        }
    }
}
