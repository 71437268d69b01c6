//! The drill engine: the shipped allocator grant service ([`Grantor`] over the embedded
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
//! agent gives up on it ([`CALL_TIMEOUT`]); latency delays delivery; a crash loses the agent's
//! memory; a skewed clock is the agent's clock.
//!
//! Determinism: one task, one virtual clock, a seeded generator for every random choice; the same
//! scenario and seed give the same report, byte for byte. Units: tokens (cost 1 per request), ms.

use std::sync::Arc;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::grants::Grantor;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::kv::{Kv, Op};
use allot_allocator::leader::{EPOCH_KEY, Leadership, Role, try_acquire};
use allot_allocator::pools::{PoolSpec, get_window, put_pool};
use allot_region_agent::allocator_client::CALL_TIMEOUT;
use allot_region_agent::global::driver::{Inherited, RenewalOutcome};
use allot_region_agent::global::holder::{
    DebtCharge, Denial, HolderConfig, MAX_LIVE_LEASES, Spend,
};
use allot_region_agent::global::terms::AgentShare;
use allot_region_agent::global::{GrantCall, PoolAgent};
use allot_region_agent::limiter::LimiterConfig;
use allot_region_agent::service::{DEFAULT_EXPIRY_MARGIN_MS, FIRST_GRANT_WAIT};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GrantRequest, LeaseClamping, OvershootBound, PoolConfig};
use allot_shared::window::Window;
use allot_shared::wire::{CalendarWindowSpec, FallbackInWindow, GrantAnswer, PoolTerms};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

use super::check::{TenantChecker, check_expectation};
use super::gateways::{Decided, Gateways};
use super::results::{Convergence, DrillReport, MAX_VIOLATION_LINES};
use super::scenario::{Fault, GatewayPlan, PoolLayout, RegionPlan, Scenario};

/// The allocator round trip without faults, ms (the agents size their renewal watermark with it).
pub const ROUND_TRIP_MS: u64 = 20;
/// Agents report (and the holders forget what was acknowledged) this often, ms.
pub const REPORT_EVERY_MS: u64 = 1_000;

/// A grant answer on its way to an agent (the renewal it answers is the pool agent's in flight).
#[derive(Debug, Clone)]
struct InFlight {
    deliver_at_ms: u64,
    /// When the agent's call gives up waiting ([`CALL_TIMEOUT`] after it was sent): an answer due
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

/// The faults acting on one region during one tick.
#[derive(Debug, Clone, Copy, Default)]
struct RegionConditions {
    partitioned: bool,
    loss_percent: u64,
    added_ms: u64,
    clock_offset_ms: i64,
}

fn conditions(scenario: &Scenario, region: &str, elapsed_ms: u64) -> RegionConditions {
    let mut c = RegionConditions::default();
    for fault in scenario.faults.iter().filter(|f| f.touches(region)) {
        match *fault {
            Fault::Partition {
                from_ms, until_ms, ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => c.partitioned = true,
            Fault::AnswerLoss {
                from_ms,
                until_ms,
                percent,
                ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => {
                c.loss_percent = c.loss_percent.max(percent);
            }
            Fault::Latency {
                from_ms,
                until_ms,
                added_ms,
                ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => c.added_ms += added_ms,
            Fault::ClockSkew {
                offset_ms,
                rate_ppm,
                ..
            } => {
                let drift = i64::try_from(elapsed_ms)
                    .unwrap_or(i64::MAX)
                    .saturating_mul(rate_ppm)
                    / 1_000_000;
                c.clock_offset_ms += offset_ms + drift;
            }
            _ => {}
        }
    }
    c
}

/// Poisson-distributed arrivals with mean `mean` (Knuth's method for small means, a rounded normal
/// approximation above 30).
fn poisson(rng: &mut StdRng, mean: f64) -> u64 {
    if mean <= 0.0 {
        return 0;
    }
    if mean > 30.0 {
        // Box-Muller.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        return (mean + z * mean.sqrt()).round().max(0.0) as u64;
    }
    let limit = (-mean).exp();
    let mut product = rng.random::<f64>();
    let mut count = 0;
    while product > limit {
        product *= rng.random::<f64>();
        count += 1;
    }
    count
}

/// Mixed into the seed for the stream of timings (the run's start, arrival phases).
const TIMING_STREAM: u64 = 0x5eed_0fa1_11e5;
/// The stream that decides which requests a regional rule denies and which are metered: a
/// stream of its own, so drills without either draw exactly what they always did.
const REQUEST_KIND_STREAM: u64 = 0x5eed_0de1_7e0d;

/// The starting remainder of a steady arrival count (in requests x 60,000): 0 without a phase
/// stream, else uniform over one request.
fn arrival_phase(phases: &mut Option<StdRng>) -> u64 {
    phases.as_mut().map_or(0, |rng| rng.random_range(0..60_000))
}

fn ms(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
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
        let allocator = DrillAllocator::lead(kv, &clock, scenario.clamping, tenants, pools).await?;
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

    /// One tick: the clock moves, a failover due now happens, then every region's agent serves
    /// the tick's requests (unless it is down).
    async fn tick(&mut self, elapsed_ms: u64) -> Result<(), DrillError> {
        let tick_ms = self.scenario.tick_ms;
        let now_ms = self.run_start_ms + elapsed_ms;
        self.clock.set(now_ms);
        let window = self.config.window_at(now_ms);
        self.checker.roll_to(window.start_ms - self.base_ms);
        let due = |at_ms: u64| (elapsed_ms..elapsed_ms + tick_ms).contains(&at_ms);
        for fault in &self.scenario.faults {
            if let Fault::Failover {
                at_ms,
                records_kept,
            } = *fault
                && due(at_ms)
            {
                let lost = self
                    .allocator
                    .fail_over(&self.config, &self.clock, records_kept, now_ms)
                    .await?;
                for (tenant, lost) in lost.into_iter().enumerate() {
                    self.checker.add_lost(tenant, lost);
                }
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
                if let Some(agent) = held.agent.as_mut() {
                    agent.holder_mut().forget_exhaustion();
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

/// The drill's tenants: `drill`, or `t00000`, `t00001`, ... for several.
fn tenants_of(scenario: &Scenario) -> Result<Vec<TenantId>, DrillError> {
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
fn pool_spec(scenario: &Scenario, limit_tokens: u64, regions: Vec<RegionId>) -> PoolSpec {
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
async fn configure_pools(
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
fn holder_config(
    terms: &PoolTerms,
    plan: &super::scenario::RegionPlan,
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
fn deal(arrivals: u64, turn: u64, shares: &mut [u64]) {
    let agents = shares.len().max(1) as u64;
    for (k, share) in shares.iter_mut().enumerate() {
        let behind = (k as u64 + agents - turn % agents) % agents;
        *share = arrivals / agents + u64::from(behind < arrivals % agents);
    }
    debug_assert_eq!(shares.iter().sum::<u64>(), arrivals, "every arrival dealt");
}

/// Region `r`'s agent crashes: everything in its memory is gone. What its holders held is
/// stranded, what it admitted since its last report is unreported.
fn crash(agent: &mut RegionAgent, checker: &mut TenantChecker, r: usize, agent_now_ms: u64) {
    for (t, held) in agent.pools.iter_mut().enumerate() {
        let record = checker.record(t, r);
        if let Some(agent) = &held.agent {
            record.stranded_tokens += agent.holder().available_tokens(agent_now_ms);
        }
        if let Some(InFlight {
            answer: Some(answer),
            ..
        }) = &held.in_flight
        {
            record.stranded_tokens += answer.granted_tokens;
        }
        record.unreported_tokens += held.admitted_since_report;
        let mut gateways = held.gateways.take();
        if let Some(gateways) = gateways.as_mut() {
            gateways.agent_crashed();
        }
        *held = HeldPool {
            gateways,
            ..HeldPool::default()
        };
    }
    agent.believes_reachable = true;
}

/// Counts a gateway's decision on one request at `now_ms` (true time) in the window starting at
/// `window_start_ms`.
fn record_gateway_decision(
    record: &mut super::results::RegionWindow,
    decided: Decided,
    now_ms: u64,
    window_start_ms: u64,
) {
    record.demand += 1;
    match decided {
        Decided::Admitted(source) => {
            if source.fallback {
                record.fallback += 1;
            } else if source
                .lease_window_start_ms
                .is_some_and(|start| start < window_start_ms)
            {
                record.carried_over += 1;
            } else {
                record.leased += 1;
            }
            if now_ms >= source.true_until_ms {
                record.spent_after_lease_end += 1;
            }
        }
        Decided::Denied => record.denied_by_gateway += 1,
    }
}

/// What a request is, besides its pool: decided once, before its first try.
#[derive(Debug, Clone, Copy)]
struct RequestKind {
    /// A regional rule denies it after its global reservation.
    denied_regionally: bool,
    /// Tokens it costs beyond its estimate, settled after the response (0: not metered).
    extra_tokens: u64,
}

/// What became of one request at its agent.
enum Served {
    /// Decided on the pool: admitted from a lease or in fallback, or denied; with what settling
    /// a metered one charged the pool.
    Pool(Spend, Option<DebtCharge>),
    /// Its reservation held, but a regional rule denied it: cancelled (`debited`: the holder was
    /// left other than before the reservation, which must never be).
    DeniedRegionally { debited: bool },
}

/// What a holder has spent (leases and fallback) and can spend at `now_ms`: a denial must leave
/// both as they were.
fn what_is_held(holder: &allot_region_agent::global::PoolHolder, now_ms: u64) -> (u64, u64) {
    let snapshot = holder.snapshot(None);
    let spent: u64 = snapshot.leases.iter().map(|l| l.spent_tokens).sum::<u64>()
        + snapshot
            .fallback
            .iter()
            .map(|f| f.admitted_tokens)
            .sum::<u64>();
    (spent, holder.available_tokens(now_ms))
}

/// One tenant's pool in one region's agent during one tick.
struct Step<'a> {
    allocator: &'a mut DrillAllocator,
    rng: &'a mut StdRng,
    kinds: &'a mut StdRng,
    /// The region's demand: which of its requests are denied regionally or metered.
    plan: &'a RegionPlan,
    checker: &'a mut TenantChecker,
    region: &'a RegionId,
    believes_reachable: &'a mut bool,
    held: &'a mut HeldPool,
    ledger_fallback: &'a mut (u64, u64),
    unclean_start_ms: Option<u64>,
    tenant: usize,
    region_index: usize,
    conditions: RegionConditions,
    now_ms: u64,
    agent_now_ms: u64,
    window_start_ms: u64,
    tick_ms: u64,
    first_grant_wait_ms: u64,
    limit_tokens: u64,
}

impl Step<'_> {
    /// Hands over the allocator's answer in flight once it has arrived; a call past its deadline
    /// is handed over as a lost answer (the agent's call timed out).
    fn deliver_due_answer(&mut self) -> Result<(), DrillError> {
        let due = self
            .held
            .in_flight
            .as_ref()
            .is_some_and(|f| f.deliver_at_ms <= self.now_ms || f.gives_up_at_ms <= self.now_ms);
        if !due {
            return Ok(());
        }
        let Some(f) = self.held.in_flight.take() else {
            return Ok(());
        };
        if f.deliver_at_ms <= self.now_ms {
            self.deliver(f)?;
        } else {
            self.deliver(InFlight { answer: None, ..f })?;
        }
        Ok(())
    }

    /// Serves `arrivals` requests; returns whether any decision was abnormal (fallback, waiting
    /// for or lacking a grant): the terms looked up, an answer that arrived handed over, each
    /// request served, then the report and the strands of the tick.
    async fn run(
        &mut self,
        arrivals: u64,
        config: HolderConfig,
        report_due: bool,
    ) -> Result<bool, DrillError> {
        self.look_up_terms(config);
        self.deliver_due_answer()?;
        if self.held.agent.is_none() {
            let record = self.checker.record(self.tenant, self.region_index);
            record.demand += arrivals;
            record.denied_unavailable += arrivals;
            return Ok(arrivals > 0);
        }
        let mut abnormal = false;
        for _ in 0..arrivals {
            abnormal |= self.serve_one().await?;
        }
        if report_due {
            self.report();
        }
        self.tally_strands();
        Ok(abnormal)
    }

    /// The tick's requests decided by the region's gateways on their own, then the agent's side:
    /// their reports spent, ended carves settled, due assignments carved (with a renewal when the
    /// holder wants one), the ledger report and the strands. Returns whether any decision was
    /// abnormal (a fallback admit, or no pool terms).
    async fn run_gateways(
        &mut self,
        arrivals: u64,
        config: HolderConfig,
        report_due: bool,
        plan: GatewayPlan,
    ) -> Result<bool, DrillError> {
        self.look_up_terms(config);
        self.deliver_due_answer()?;
        let gateways = self.held.gateways.get_or_insert_with(|| {
            Gateways::new(plan.per_region, plan.report_interval_ms, self.agent_now_ms)
        });
        let mut abnormal = false;
        let record = self.checker.record(self.tenant, self.region_index);
        for _ in 0..arrivals {
            let decided = gateways.decide(self.agent_now_ms);
            abnormal |= matches!(decided, Decided::Admitted(source) if source.fallback);
            if matches!(decided, Decided::Admitted(_)) {
                self.held.admitted_since_report += 1;
            }
            record_gateway_decision(record, decided, self.now_ms, self.window_start_ms);
        }
        if let Some(agent) = self.held.agent.as_mut() {
            let lease_ends = &self.held.lease_ends;
            let tended = gateways.tend(
                agent.holder_mut(),
                self.agent_now_ms,
                *self.believes_reachable,
                |id| {
                    lease_ends
                        .iter()
                        .find(|(lease, _)| *lease == id)
                        .map(|(_, end)| *end)
                },
            );
            // Waiting for a renewal is how carving keeps up with demand, not a fault: only
            // fallback admits (and no terms at all) are abnormal here.
            let _ = tended;
        } else {
            abnormal |= arrivals > 0;
        }
        self.renew().await?;
        if report_due {
            self.report();
        }
        self.tally_strands();
        Ok(abnormal)
    }

    /// The agent fetches the pool's terms on first use (not while cut off), with what its region
    /// already admitted in fallback this window (as the ledger holds it), and takes over the
    /// window as the shipped agent does.
    fn look_up_terms(&mut self, config: HolderConfig) {
        if self.held.agent.is_some() || self.conditions.partitioned {
            return;
        }
        let (window_start_ms, admitted_tokens) = *self.ledger_fallback;
        let inherited = Inherited {
            ledger_fallback: (window_start_ms == self.window_start_ms).then_some(
                FallbackInWindow {
                    window_start_ms,
                    admitted_tokens,
                },
            ),
            unclean_start_ms: self.unclean_start_ms,
        };
        let (agent, _presumed) = PoolAgent::taking_over(config, inherited, self.agent_now_ms);
        self.held.agent = Some(agent);
    }

    /// One request, as the agent serves it: spend; if no lease is held, start a renewal and wait
    /// for the one in flight (up to FIRST_GRANT_WAIT), then spend again; record the outcome.
    /// Returns whether it was abnormal.
    async fn serve_one(&mut self) -> Result<bool, DrillError> {
        let kind = self.request_kind();
        let mut outcome = self.spend(0, kind);
        let mut wait_ms = 0;
        if matches!(
            outcome,
            Served::Pool(
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                },
                _
            )
        ) {
            let answered_in_ms = self.renew().await?;
            wait_ms = match (self.held.in_flight.clone(), answered_in_ms) {
                (Some(f), _) => {
                    let arrives_in_ms = f.deliver_at_ms.saturating_sub(self.now_ms);
                    if arrives_in_ms <= self.first_grant_wait_ms {
                        self.deliver(f)?;
                        arrives_in_ms
                    } else {
                        self.first_grant_wait_ms
                    }
                }
                // Answered within the call; or nothing asked, or the call failed at once.
                (None, Some(ms)) => ms,
                (None, None) => 0,
            };
            // Spent again after the wait (a renewal unanswered past the holder's patience now
            // means fallback).
            outcome = self.spend(wait_ms, kind);
        }
        let abnormal = self.record_outcome(outcome, wait_ms);
        // As the agent: every spend may start a renewal.
        self.renew().await?;
        Ok(abnormal)
    }

    /// What a request of this region is: denied by a regional rule after its reservation, and
    /// metered beyond its estimate by how many tokens (0: not metered), drawn from the drill's
    /// own stream only when the region has either.
    fn request_kind(&mut self) -> RequestKind {
        let mut draw = |percent: u64| percent > 0 && self.kinds.random_range(0..100) < percent;
        let denied_regionally = draw(self.plan.regional_deny_percent);
        let metered = draw(self.plan.metered_percent);
        RequestKind {
            denied_regionally,
            extra_tokens: if metered { self.plan.metered_extra } else { 0 },
        }
    }

    /// Counts one request's outcome in the window's record. Returns whether it was abnormal.
    fn record_outcome(&mut self, served: Served, wait_ms: u64) -> bool {
        let granted_in_window = self.checker.granted_in_window(self.tenant);
        let record = self.checker.record(self.tenant, self.region_index);
        record.demand += 1;
        if wait_ms > 0 {
            record.waited += 1;
            record.max_wait_ms = record.max_wait_ms.max(wait_ms);
        }
        let outcome = match served {
            Served::DeniedRegionally { debited } => {
                record.denied_regional += 1;
                record.denials_that_debited += u64::from(debited);
                return false;
            }
            Served::Pool(outcome, charged) => {
                if let Some(charged) = charged {
                    record.charged_extra_tokens += charged.paid_tokens + charged.owed_tokens;
                    record.written_off_tokens += charged.written_off_tokens;
                }
                outcome
            }
        };
        match outcome {
            Spend::Leased(lease) => {
                let agent = self.held.agent.as_ref();
                if agent
                    .and_then(|a| a.holder().lease_window_start_ms(lease))
                    .is_some_and(|start| start < self.window_start_ms)
                {
                    record.carried_over += 1;
                } else {
                    record.leased += 1;
                }
                if self
                    .held
                    .lease_ends
                    .iter()
                    .any(|&(id, end)| self.now_ms + wait_ms >= end && id == lease)
                {
                    record.spent_after_lease_end += 1;
                }
                self.held.admitted_since_report += 1;
                false
            }
            Spend::Fallback { .. } => {
                record.fallback += 1;
                self.held.admitted_since_report += 1;
                true
            }
            Spend::Denied { denial, .. } => match denial {
                Denial::PoolExhausted => {
                    record.denied_exhausted += 1;
                    if granted_in_window < self.limit_tokens {
                        record.denied_while_tokens_left += 1;
                    }
                    false
                }
                Denial::FallbackSpent | Denial::FailClosed | Denial::FallbackAtWindowEdge => {
                    record.denied_fallback_spent += 1;
                    true
                }
                Denial::AwaitingGrant => {
                    record.denied_awaiting += 1;
                    true
                }
                Denial::WindowEnding => {
                    record.denied_window_end += 1;
                    false
                }
                // Every drill request costs 1 token (never above a chunk), and the drills' agents
                // keep no state directory (no claims).
                Denial::CostAboveChunk | Denial::FallbackUnclaimed => {
                    record.denied_unavailable += 1;
                    false
                }
            },
        }
    }

    /// The agent reports what its pool owes, as the shipped agent does, every
    /// [`REPORT_EVERY_MS`]: cut off (or slower than the call's deadline) the report fails and
    /// stays owed; taken, the ledger keeps this agent's fallback count. Either way the agent
    /// learns from it whether the allocator is reachable, as from any call.
    fn report(&mut self) {
        let Some(agent) = self.held.agent.as_mut() else {
            return;
        };
        if !agent.owes_report(self.agent_now_ms) {
            return;
        }
        let parts = agent.report(self.agent_now_ms);
        if parts.is_empty() {
            return;
        }
        let answered = !self.conditions.partitioned
            && ROUND_TRIP_MS + self.conditions.added_ms < ms(CALL_TIMEOUT);
        *self.believes_reachable = answered;
        if !answered {
            return;
        }
        for part in parts {
            let admitted = part.fallback_admitted_tokens();
            if admitted > 0 {
                let (window_start_ms, held) = self.ledger_fallback;
                if part.window_start_ms() > *window_start_ms {
                    *self.ledger_fallback = (part.window_start_ms(), admitted);
                } else if part.window_start_ms() == *window_start_ms {
                    *held = (*held).max(admitted);
                }
            }
            agent.reported(&part, self.agent_now_ms);
        }
        self.held.admitted_since_report = 0;
    }

    /// Counts what the holder stranded this tick, and forgets lease ends long past.
    fn tally_strands(&mut self) {
        let Some(agent) = self.held.agent.as_ref() else {
            return;
        };
        let stranded = agent.holder().stranded_tokens();
        self.checker
            .record(self.tenant, self.region_index)
            .stranded_tokens += stranded - self.held.stranded_seen;
        self.held.stranded_seen = stranded;
        let horizon = self.now_ms.saturating_sub(self.tick_ms);
        self.held.lease_ends.retain(|&(_, end)| end >= horizon);
    }

    /// Spends a token `after_ms` into the tick (after a wait for a grant).
    fn spend(&mut self, after_ms: u64, kind: RequestKind) -> Served {
        let Some(agent) = self.held.agent.as_mut() else {
            return Served::Pool(
                Spend::Denied {
                    denial: Denial::FailClosed,
                    retry_after_ms: 1_000,
                },
                None,
            );
        };
        // As the agent admits a request whose global rule is the pool: reserved; then, its
        // regional rules decided, committed or cancelled.
        let at_ms = self.agent_now_ms + after_ms;
        let before = kind
            .denied_regionally
            .then(|| what_is_held(agent.holder(), at_ms));
        let reservation = match agent.reserve(1, at_ms, *self.believes_reachable, false) {
            Ok(reservation) => reservation,
            Err(refusal) => {
                let denied = Spend::Denied {
                    denial: refusal.denial,
                    retry_after_ms: refusal.retry_after_ms,
                };
                return Served::Pool(denied, None);
            }
        };
        if let Some(before) = before {
            agent.cancel(reservation);
            let debited = what_is_held(agent.holder(), at_ms) != before;
            return Served::DeniedRegionally { debited };
        }
        let spend = agent.commit(reservation);
        // A metered request settled after its response above its estimate.
        let charged = (kind.extra_tokens > 0).then(|| agent.charge(kind.extra_tokens, at_ms));
        Served::Pool(spend, charged)
    }

    /// Starts a renewal when the holder wants one and none is in flight. Returns the answer's
    /// delay, ms, when the allocator was reached (the answer is delivered at once when it arrives
    /// before the next tick).
    async fn renew(&mut self) -> Result<Option<u64>, DrillError> {
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(None);
        };
        // Lease ids are made from the agent's clock and a counter of renewals asked
        // (reproducible).
        let fresh = LeaseId::from_parts(self.agent_now_ms, self.allocator.leases_asked + 1);
        let Some(ask) = agent.renewal_to_ask(self.agent_now_ms, fresh) else {
            return Ok(None);
        };
        self.allocator.leases_asked += 1;
        let (lease_id, want_tokens) = (ask.lease_id, ask.want_tokens);
        if self.conditions.partitioned {
            // The call fails at once: nothing reached the allocator.
            let call = GrantCall::Unanswered;
            agent.renewal_answered(&call, self.agent_now_ms);
            *self.believes_reachable = call.answer().reached_allocator();
            return Ok(None);
        }
        let record = self
            .allocator
            .grant(
                self.tenant,
                self.region_index,
                self.region,
                lease_id,
                want_tokens,
            )
            .await?;
        let retry_of_committed = self.held.committed_unanswered == Some(lease_id);
        if !retry_of_committed {
            let window_start_ms = record.window_start_ms;
            self.checker.add_granted(
                self.tenant,
                self.region_index,
                window_start_ms,
                record.granted_tokens,
            );
        }
        let lost = self.conditions.loss_percent > 0
            && self.rng.random_range(0..100) < self.conditions.loss_percent;
        let gives_up_at_ms = self.now_ms + ms(CALL_TIMEOUT);
        let flight = InFlight {
            true_expires_at_ms: record.expires_at_ms,
            // A lost answer ends the call only when the agent gives up on it, as its client does.
            deliver_at_ms: if lost {
                gives_up_at_ms
            } else {
                self.now_ms + ROUND_TRIP_MS + self.conditions.added_ms
            },
            gives_up_at_ms,
            // As the agent: what is left of the lease is measured on the agent's clock from when
            // it asked.
            asked_at_ms: self.agent_now_ms,
            answer: (!lost).then_some(record),
        };
        if lost {
            self.checker
                .record(self.tenant, self.region_index)
                .answers_lost += 1;
        }
        // An answer (or, lost, the call's failure) due before the next tick is in hand for the
        // next tick's requests.
        let delay_ms = flight.deliver_at_ms - self.now_ms;
        self.held.in_flight = Some(flight.clone());
        if delay_ms < self.tick_ms {
            self.deliver(flight)?;
        }
        Ok(Some(delay_ms))
    }

    /// Hands an answer (or its loss) to the pool's agent.
    fn deliver(&mut self, flight: InFlight) -> Result<(), DrillError> {
        self.held.in_flight = None;
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(());
        };
        let Some(answer) = flight.answer else {
            let call = GrantCall::Unanswered;
            if let Some(ask) = agent.renewal_asked() {
                self.held.committed_unanswered = Some(ask.lease_id);
            }
            agent.renewal_answered(&call, self.agent_now_ms);
            *self.believes_reachable = call.answer().reached_allocator();
            return Ok(());
        };
        let call = GrantCall::Answered {
            answer: answer.clone(),
            asked_at_ms: flight.asked_at_ms,
        };
        *self.believes_reachable = call.answer().reached_allocator();
        let recovered = self.held.committed_unanswered == Some(answer.lease_id);
        if recovered {
            self.held.committed_unanswered = None;
        }
        let Some(outcome) = agent.renewal_answered(&call, self.agent_now_ms) else {
            return Ok(());
        };
        if outcome == RenewalOutcome::StaleEpoch {
            return Err(DrillError::Broken(format!(
                "a grant from a stale epoch reached the holder ({answer:?})"
            )));
        }
        if outcome.held() {
            self.held
                .lease_ends
                .push((answer.lease_id, flight.true_expires_at_ms));
            if recovered {
                self.checker
                    .record(self.tenant, self.region_index)
                    .recovered_tokens += answer.granted_tokens;
            }
        }
        Ok(())
    }
}

/// The shipped grant service for the drill's pools, as the agents reach it.
struct DrillAllocator {
    kv: Arc<dyn Kv>,
    leadership: Leadership,
    /// Keeps the current leader's role readable.
    role_sender: watch::Sender<Role>,
    clamping: LeaseClamping,
    grantor: Grantor,
    tenants: Vec<TenantId>,
    /// The pool each region draws from, by tenant and region index.
    pools: Vec<Vec<PoolId>>,
    /// Lease ids are made from the virtual time and this counter (unique, reproducible).
    leases_asked: u128,
}

impl DrillAllocator {
    /// The first allocator, leading over `pools` of `tenants` (its leader key outlives any drill:
    /// failover drills replace it explicitly).
    async fn lead(
        kv: Arc<dyn Kv>,
        clock: &Arc<ManualClock>,
        clamping: LeaseClamping,
        tenants: Vec<TenantId>,
        pools: Vec<Vec<PoolId>>,
    ) -> Result<Self, DrillError> {
        let leadership = try_acquire(&*kv, "drill-allocator", "http://drill", 1 << 40)
            .await
            .map_err(store)?
            .ok_or_else(|| {
                DrillError::Broken("the drill allocator did not become leader".into())
            })?;
        let (role_sender, role) = watch::channel(Role::Leader(leadership));
        Ok(Self {
            grantor: Grantor::new(
                kv.clone(),
                clock.clone() as Arc<dyn Clock>,
                role,
                clamping,
                None,
            ),
            kv,
            leadership,
            role_sender,
            clamping,
            tenants,
            pools,
            leases_asked: 0,
        })
    }

    async fn grant(
        &mut self,
        tenant: usize,
        region_index: usize,
        region: &RegionId,
        lease_id: LeaseId,
        want_tokens: u64,
    ) -> Result<GrantAnswer, DrillError> {
        self.grantor
            .grant(
                &self.tenants[tenant],
                &self.pools[tenant][region_index],
                GrantRequest {
                    lease_id,
                    region: region.clone(),
                    want_tokens,
                },
            )
            .await
            .map_err(|e| DrillError::Broken(format!("grant failed: {e}")))
    }

    /// Replaces the leader: the old one loses its store lease (it crashed or was partitioned away),
    /// a new one takes over with the next epoch. Returns, per tenant, the tokens granted in the
    /// current window that the new leader cannot see (0 when records are kept).
    async fn fail_over(
        &mut self,
        config: &PoolConfig,
        clock: &Arc<ManualClock>,
        records_kept: bool,
        now_ms: u64,
    ) -> Result<Vec<u64>, DrillError> {
        let deposed = std::mem::replace(
            &mut self.grantor,
            Grantor::new(
                self.kv.clone(),
                clock.clone() as Arc<dyn Clock>,
                self.role_sender.subscribe(),
                self.clamping,
                None,
            ),
        );
        self.kv.revoke(self.leadership.lease).await.map_err(store)?;
        let mut lost = vec![0; self.tenants.len()];
        if !records_kept {
            let current = config.window_at(now_ms);
            for (t, tenant) in self.tenants.iter().enumerate() {
                let mut pools = self.pools[t].clone();
                pools.dedup();
                for pool in &pools {
                    lost[t] += get_window(&*self.kv, tenant, pool)
                        .await
                        .map_err(store)?
                        .filter(|(state, _)| state.window == current)
                        .map_or(0, |(state, _)| state.granted_tokens());
                }
            }
            // The replica the new leader reads kept configurations and the epoch, not the grants.
            let replica: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
            let mut puts = Vec::new();
            for (key, value) in self
                .kv
                .get_prefix("/allot/", 1 << 20)
                .await
                .map_err(store)?
            {
                if key.starts_with("/allot/pools/") || key == EPOCH_KEY {
                    puts.push(Op::Put {
                        key,
                        value: value.value,
                        lease: None,
                    });
                }
            }
            for batch in puts.chunks(allot_allocator::kv::MAX_TXN_OPS) {
                replica
                    .txn(Vec::new(), batch.to_vec())
                    .await
                    .map_err(store)?;
            }
            self.kv = replica;
        }
        let leadership = try_acquire(&*self.kv, "drill-allocator-2", "http://drill-2", 1 << 40)
            .await
            .map_err(store)?
            .ok_or_else(|| DrillError::Broken("the new allocator did not become leader".into()))?;
        debug_assert!(leadership.epoch > self.leadership.epoch);
        self.leadership = leadership;
        let (role_sender, role) = watch::channel(Role::Leader(leadership));
        self.role_sender = role_sender;
        self.grantor = Grantor::new(
            self.kv.clone(),
            clock.clone() as Arc<dyn Clock>,
            role,
            self.clamping,
            None,
        );
        if records_kept {
            // The deposed leader still believes it leads; its writes must be fenced off.
            self.leases_asked += 1;
            let region = config
                .regions()
                .first()
                .cloned()
                .ok_or_else(|| DrillError::Broken("a pool has at least one region".into()))?;
            let attempt = deposed
                .grant(
                    &self.tenants[0],
                    &self.pools[0][0],
                    GrantRequest {
                        lease_id: LeaseId::from_parts(now_ms, self.leases_asked),
                        region,
                        want_tokens: 1,
                    },
                )
                .await;
            // Fenced off, a deposed allocator says it does not lead. Tokens from it would be a
            // grant the new leader cannot know of; a refusal from it, an answer from a stale cache.
            match attempt {
                Ok(record) if record.granted_tokens > 0 => {
                    return Err(DrillError::Broken(format!(
                        "a deposed allocator granted {} tokens after the failover",
                        record.granted_tokens
                    )));
                }
                Ok(_) => {
                    return Err(DrillError::Broken(
                        "a deposed allocator answered from its cache after the failover instead \
                         of saying it does not lead"
                            .to_owned(),
                    ));
                }
                Err(_) => {}
            }
        }
        Ok(lost)
    }
}
