//! Deterministic partition drills: the shipped allocator grant service ([`Grantor`] over the
//! embedded [`MemoryKv`]) and the shipped agent lease logic ([`PoolHolder`]) driven in virtual time,
//! with regions cut off from the allocator on a schedule.
//!
//! Why: "what does a partition cost us?" needs a number and its proof. Each drill records, per
//! window, what every region admitted (from leases, carried over from an earlier window's lease, or
//! in fallback), what it was denied, what the allocator granted and what was stranded, and checks it
//! against the stated bound (`admitted <= G + carry-over + fallback allowances + lost records`).
//!
//! Determinism: one task, one virtual clock, integer demand; the same scenario gives the same table.
//! Units: tokens are whole requests (cost 1), times are epoch ms.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::grants::Grantor;
use allot_allocator::kv::Kv;
use allot_allocator::kv::Op;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::leader::{EPOCH_KEY, Leadership, Role, try_acquire};
use allot_allocator::pools::{PoolSpec, get_window, put_pool};
use allot_region_agent::global::holder::{
    Denial, GrantVerdict, HolderConfig, LeaseGrant, MAX_LIVE_LEASES, PoolHolder, Spend,
};
use allot_region_agent::service::DEFAULT_EXPIRY_MARGIN_MS;
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{
    GrantRequest, LeaseClamping, OvershootBound, PoolConfig, overshoot_tokens,
};
use allot_shared::window::Window;
use tokio::sync::watch;

/// 2026-01-01T00:00:00Z: drills start on a window boundary.
const START_MS: u64 = 1_767_225_600_000;
/// Virtual time advances in steps of this many ms.
const TICK_MS: u64 = 100;
/// The allocator round trip the agents assume, ms.
const ROUND_TRIP_MS: u64 = 20;

/// One region's demand and faults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionPlan {
    /// The region id.
    pub region: &'static str,
    /// Requests per minute, spread evenly over the ticks.
    pub per_minute: u64,
    /// Intervals `[from, until)` in ms since the drill's start during which this region cannot reach
    /// the allocator.
    pub partitions: Vec<(u64, u64)>,
}

/// A drill: a pool, regions with demand and faults, and what the run must show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    /// Short name (`allot drill <name>`).
    pub name: &'static str,
    /// One line on what it demonstrates.
    pub about: &'static str,
    /// G, tokens per window.
    pub limit: u64,
    /// Window length, ms.
    pub window_ms: u64,
    /// Largest grant, tokens.
    pub chunk: u64,
    /// Lease TTL before clamping, ms.
    pub lease_ttl_ms: u64,
    /// Fallback tokens per region per window.
    pub fallback_per_region: u64,
    /// Whether leases are clamped to their window.
    pub clamping: LeaseClamping,
    /// The regions.
    pub regions: Vec<RegionPlan>,
    /// Virtual duration, ms.
    pub duration_ms: u64,
    /// How G is laid out over pools.
    pub layout: PoolLayout,
    /// An allocator failover, if any.
    pub failover: Option<Failover>,
    /// What the run must show beyond the bound.
    pub expect: Expectation,
}

/// How the tenant's quota is laid out over allocator pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolLayout {
    /// One pool of G shared by every region, leased on demand (Allot's design).
    Shared,
    /// One pool per region, each of this many tokens per window: G each models independent
    /// regional limiters (up to regions x G), G / regions a static split.
    PerRegion {
        /// Tokens per window in each region's pool.
        per_region_limit: u64,
    },
}

/// The leading allocator is replaced by a new one at `at_ms` (ms since the drill's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failover {
    /// When, ms since the drill's start.
    pub at_ms: u64,
    /// Whether the new leader sees the committed grants (etcd: yes). When not, it starts from a
    /// store that kept pool configurations and the epoch but lost every window's grants, as an
    /// asynchronously replicated store can: the lost-record term of the bound.
    pub records_kept: bool,
}

/// A drill's expected outcome (checked after the run; the bound is always checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expectation {
    /// No window admits more than G.
    NoOvershoot,
    /// Some window admits more than G only through fallback, and no region exceeds its allowance.
    FallbackWithinAllowance,
    /// Some window admits tokens carried over from an earlier window's lease, within the design's
    /// carry-over term.
    CarryOverWithinTerm,
    /// Some window admits more than G, by no more than the grants the failover lost.
    OvershootWithinLostRecords,
    /// Some window admits more than G (independent regional limits), within regions x G.
    OvershootAcrossRegions,
    /// Some region is denied while the tenant's quota still had tokens (a static split).
    DeniedWhileTokensLeft,
    /// No overshoot, and no region is ever denied while the tenant's quota had tokens.
    NoDenialWhileTokensLeft,
}

/// One region in one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RegionWindow {
    /// Requests arriving.
    pub demand: u64,
    /// Admitted from leases of this window.
    pub leased: u64,
    /// Admitted from leases of an earlier window (unclamped carry-over).
    pub carried_over: u64,
    /// Admitted in fallback.
    pub fallback: u64,
    /// Denied: the pool is exhausted.
    pub denied_exhausted: u64,
    /// Denied: unreachable allocator and the fallback allowance is spent (or zero).
    pub denied_fallback_spent: u64,
    /// Denied while waiting for a first grant.
    pub denied_awaiting: u64,
    /// Of the pool-exhausted denials, those while the tenant's whole quota (G) was not yet granted
    /// in this window: the cost of a static split.
    pub denied_while_tokens_left: u64,
    /// Tokens granted to this region for this window.
    pub granted: u64,
    /// Tokens that became stranded during this window.
    pub stranded: u64,
}

impl RegionWindow {
    /// Everything admitted.
    pub fn admitted(&self) -> u64 {
        self.leased + self.carried_over + self.fallback
    }
}

/// One window of a drill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowRecord {
    /// Window start, ms since the drill's start.
    pub offset_ms: u64,
    /// Tokens granted in this window by an allocator whose records a failover lost (the bound's
    /// lost-record term for this window).
    pub lost_grant_record_tokens: u64,
    /// Per region, in scenario order.
    pub regions: Vec<RegionWindow>,
}

impl WindowRecord {
    fn sum(&self, field: impl Fn(&RegionWindow) -> u64) -> u64 {
        self.regions.iter().map(field).sum()
    }
}

/// The result of a drill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrillReport {
    /// The scenario.
    pub scenario: Scenario,
    /// The design's bound per window.
    pub bound: OvershootBound,
    /// Every window, in order.
    pub windows: Vec<WindowRecord>,
    /// Violated invariants and expectations (empty: the drill passed).
    pub violations: Vec<String>,
}

impl DrillReport {
    /// Whether every invariant and the expectation held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The report for machines: the scenario, the bound's terms, every window with its regions, and
    /// the violations.
    pub fn json(&self) -> serde_json::Value {
        let s = &self.scenario;
        let windows: Vec<serde_json::Value> = self
            .windows
            .iter()
            .map(|w| {
                let regions: Vec<serde_json::Value> = s
                    .regions
                    .iter()
                    .zip(&w.regions)
                    .map(|(plan, r)| {
                        let mut value = serde_json::json!(r);
                        value["region"] = serde_json::json!(plan.region);
                        value["admitted"] = serde_json::json!(r.admitted());
                        value
                    })
                    .collect();
                let admitted = w.sum(RegionWindow::admitted);
                serde_json::json!({
                    "offsetMs": w.offset_ms,
                    "admitted": admitted,
                    "overshoot": overshoot_tokens(admitted, s.limit),
                    "bound": self.bound.total_tokens() + w.lost_grant_record_tokens,
                    "lostGrantRecordTokens": w.lost_grant_record_tokens,
                    "regions": regions,
                })
            })
            .collect();
        serde_json::json!({
            "name": s.name,
            "about": s.about,
            "limit": s.limit,
            "windowMs": s.window_ms,
            "chunk": s.chunk,
            "leaseTtlMs": s.lease_ttl_ms,
            "fallbackPerRegion": s.fallback_per_region,
            "clamped": s.clamping == LeaseClamping::Clamped,
            "bound": {
                "limitTokens": self.bound.limit_tokens,
                "unclampedCarryOverTokens": self.bound.unclamped_carry_over_tokens,
                "fallbackAllowanceTokens": self.bound.fallback_allowance_tokens,
                "lostGrantRecordTokens": self.bound.lost_grant_record_tokens,
                "totalTokens": self.bound.total_tokens(),
            },
            "windows": windows,
            "passed": self.passed(),
            "violations": self.violations,
        })
    }

    /// A terminal table: one line per window.
    pub fn table(&self) -> String {
        let s = &self.scenario;
        let mut out = format!(
            "drill {}: {}\n  G={} window={}ms chunk={} ttl={}ms fallback/region={} leases {}\n  bound per window = {} (pool limits {} + carry-over {} + fallback {} + lost records {})\n",
            s.name,
            s.about,
            s.limit,
            s.window_ms,
            s.chunk,
            s.lease_ttl_ms,
            s.fallback_per_region,
            match s.clamping {
                LeaseClamping::Clamped => "clamped",
                LeaseClamping::Unclamped => "unclamped",
            },
            self.bound.total_tokens(),
            self.bound.limit_tokens,
            self.bound.unclamped_carry_over_tokens,
            self.bound.fallback_allowance_tokens,
            self.bound.lost_grant_record_tokens,
        );
        out.push_str(
            "  window  region  demand  leased  carried  fallback  denied  (tokens left)  granted  stranded\n",
        );
        for window in &self.windows {
            for (plan, r) in s.regions.iter().zip(&window.regions) {
                out.push_str(&format!(
                    "  {:>5}s  {:<6}  {:>6}  {:>6}  {:>7}  {:>8}  {:>6}  {:>13}  {:>7}  {:>8}\n",
                    window.offset_ms / 1_000,
                    plan.region,
                    r.demand,
                    r.leased,
                    r.carried_over,
                    r.fallback,
                    r.denied_exhausted + r.denied_fallback_spent + r.denied_awaiting,
                    r.denied_while_tokens_left,
                    r.granted,
                    r.stranded,
                ));
            }
            let admitted = window.sum(RegionWindow::admitted);
            let lost = window.lost_grant_record_tokens;
            out.push_str(&format!(
                "  {:>5}s  total   admitted {} of G {} (overshoot {}, bound {}{})\n",
                window.offset_ms / 1_000,
                admitted,
                s.limit,
                overshoot_tokens(admitted, s.limit),
                self.bound.total_tokens() + lost,
                if lost > 0 {
                    format!(" with {lost} lost grant records")
                } else {
                    String::new()
                },
            ));
        }
        if self.passed() {
            out.push_str("  PASS\n");
        } else {
            for v in &self.violations {
                out.push_str(&format!("  FAIL: {v}\n"));
            }
        }
        out
    }
}

/// The built-in drills.
pub fn builtin() -> Vec<Scenario> {
    let skewed = |eu_partitions: Vec<(u64, u64)>| {
        vec![
            RegionPlan {
                region: "eu",
                per_minute: 1_200,
                partitions: eu_partitions,
            },
            RegionPlan {
                region: "us",
                per_minute: 300,
                partitions: Vec::new(),
            },
        ]
    };
    let nine_to_one = || {
        vec![
            RegionPlan {
                region: "eu",
                per_minute: 900,
                partitions: Vec::new(),
            },
            RegionPlan {
                region: "us",
                per_minute: 100,
                partitions: Vec::new(),
            },
        ]
    };
    let base = Scenario {
        name: "clamped",
        about: "demand 1.5x G, EU 1200/min and US 300/min, leases clamped: nothing beyond G",
        limit: 1_000,
        window_ms: 60_000,
        chunk: 100,
        lease_ttl_ms: 15_000,
        fallback_per_region: 100,
        clamping: LeaseClamping::Clamped,
        regions: skewed(Vec::new()),
        duration_ms: 180_000,
        layout: PoolLayout::Shared,
        failover: None,
        expect: Expectation::NoOvershoot,
    };
    vec![
        base.clone(),
        Scenario {
            name: "unclamped",
            about: "demand 0.75x G (EU 600/min, US 150/min), leases may outlive their window: carry-over shows",
            clamping: LeaseClamping::Unclamped,
            regions: vec![
                RegionPlan {
                    region: "eu",
                    per_minute: 600,
                    partitions: Vec::new(),
                },
                RegionPlan {
                    region: "us",
                    per_minute: 150,
                    partitions: Vec::new(),
                },
            ],
            expect: Expectation::CarryOverWithinTerm,
            ..base.clone()
        },
        Scenario {
            name: "fallback",
            about: "EU cut off from the allocator for 90 s from 50 s: bounded fallback, no more",
            regions: skewed(vec![(50_000, 140_000)]),
            expect: Expectation::FallbackWithinAllowance,
            ..base.clone()
        },
        Scenario {
            name: "failover-etcd",
            about: "the leading allocator is replaced at 30 s; the new leader reads the committed grants",
            failover: Some(Failover {
                at_ms: 30_000,
                records_kept: true,
            }),
            ..base.clone()
        },
        Scenario {
            name: "failover-lost",
            about: "the same failover on a store that lost the window's grants: the lost-record term",
            failover: Some(Failover {
                at_ms: 30_000,
                records_kept: false,
            }),
            expect: Expectation::OvershootWithinLostRecords,
            ..base.clone()
        },
        Scenario {
            name: "independent",
            about: "each region enforces G on its own (no allocator): admits up to regions x G",
            layout: PoolLayout::PerRegion {
                per_region_limit: 1_000,
            },
            expect: Expectation::OvershootAcrossRegions,
            ..base.clone()
        },
        Scenario {
            name: "static-split",
            about: "G split 500/500 under EU 900/min, US 100/min: EU denied while US's half lies idle",
            layout: PoolLayout::PerRegion {
                per_region_limit: 500,
            },
            regions: nine_to_one(),
            expect: Expectation::DeniedWhileTokensLeft,
            ..base.clone()
        },
        Scenario {
            name: "demand-weighted",
            about: "one shared pool under EU 900/min, US 100/min: leases follow demand",
            regions: nine_to_one(),
            expect: Expectation::NoDenialWhileTokensLeft,
            ..base
        },
    ]
}

/// Runs `scenario` to completion.
pub async fn run(scenario: &Scenario) -> Result<DrillReport, String> {
    let clock = Arc::new(ManualClock::new(START_MS));
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
    let tenant = TenantId::parse("drill").map_err(|e| e.to_string())?;
    let pool = PoolId::parse("api").map_err(|e| e.to_string())?;
    let regions = scenario
        .regions
        .iter()
        .map(|plan| RegionId::parse(plan.region).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = |limit: u64, regions: Vec<RegionId>| PoolSpec {
        limit,
        window_ms: scenario.window_ms,
        chunk: scenario.chunk,
        lease_ttl_ms: scenario.lease_ttl_ms,
        fallback_per_region: scenario.fallback_per_region,
        regions,
    };
    // The tenant's quota as one pool: the bound's terms are computed from it.
    let config = spec(scenario.limit, regions.clone())
        .validate()
        .map_err(|e| e.to_string())?;
    let (pools, pool_limits) = match scenario.layout {
        PoolLayout::Shared => {
            put_pool(
                &*kv,
                &tenant,
                &pool,
                spec(scenario.limit, regions.clone()),
                START_MS,
            )
            .await
            .map_err(|e| e.to_string())?;
            (vec![pool; regions.len()], scenario.limit)
        }
        PoolLayout::PerRegion { per_region_limit } => {
            let mut pools = Vec::new();
            for region in &regions {
                let id = PoolId::parse(&format!("{pool}-{region}")).map_err(|e| e.to_string())?;
                put_pool(
                    &*kv,
                    &tenant,
                    &id,
                    spec(per_region_limit, vec![region.clone()]),
                    START_MS,
                )
                .await
                .map_err(|e| e.to_string())?;
                pools.push(id);
            }
            (pools, per_region_limit * regions.len() as u64)
        }
    };
    // The leader key's store lease outlives any drill: failover drills replace it explicitly.
    let leadership = try_acquire(&*kv, "drill-allocator", "http://drill", 1 << 40)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("the drill allocator did not become leader")?;
    let (role_sender, role) = watch::channel(Role::Leader(leadership));
    let mut allocator = DrillAllocator {
        kv: kv.clone(),
        leadership,
        role_sender,
        clamping: scenario.clamping,
        grantor: Grantor::new(
            kv.clone(),
            clock.clone() as Arc<dyn Clock>,
            role,
            scenario.clamping,
            None,
        ),
        tenant,
        pools,
        region_count: regions.len(),
        leases_asked: 0,
    };

    let window_ms = NonZeroU64::new(scenario.window_ms).ok_or("window_ms must be at least 1")?;
    let holder_config = HolderConfig {
        window_ms,
        chunk_tokens: scenario.chunk,
        lease_ttl_ms: scenario.lease_ttl_ms,
        fallback_per_region_tokens: scenario.fallback_per_region,
        expiry_margin_ms: DEFAULT_EXPIRY_MARGIN_MS,
    };
    let mut holders: Vec<PoolHolder> = regions
        .iter()
        .map(|_| PoolHolder::new(holder_config))
        .collect();
    // Demand per tick is per_minute x TICK_MS / 60_000 with the remainder carried (in 1/60_000ths).
    let mut demand_remainder = vec![0_u64; regions.len()];
    let mut stranded_seen = vec![0_u64; regions.len()];
    let mut windows: BTreeMap<u64, Vec<RegionWindow>> = BTreeMap::new();

    let mut lost_by_window: BTreeMap<u64, u64> = BTreeMap::new();
    let mut elapsed_ms = 0;
    while elapsed_ms < scenario.duration_ms {
        let now_ms = START_MS + elapsed_ms;
        clock.set(now_ms);
        let window = Window::containing(now_ms, window_ms);
        if let Some(failover) = scenario.failover
            && failover.at_ms == elapsed_ms
        {
            let lost = allocator
                .fail_over(&config, &clock, failover.records_kept, now_ms)
                .await?;
            *lost_by_window.entry(window.start_ms).or_default() += lost;
        }
        for (index, plan) in scenario.regions.iter().enumerate() {
            let reachable = !plan
                .partitions
                .iter()
                .any(|&(from, until)| (from..until).contains(&elapsed_ms));
            let holder = &mut holders[index];
            let arrivals = {
                let scaled = plan.per_minute * TICK_MS + demand_remainder[index];
                demand_remainder[index] = scaled % 60_000;
                scaled / 60_000
            };
            for _ in 0..arrivals {
                let mut outcome = holder.spend(1, now_ms, reachable);
                if matches!(
                    outcome,
                    Spend::Denied {
                        denial: Denial::AwaitingGrant,
                        ..
                    }
                ) {
                    // The agent renews on the spot when it holds nothing and can reach the allocator.
                    allocator
                        .renew(&regions[index], holder, index, now_ms, &mut windows)
                        .await?;
                    outcome = holder.spend(1, now_ms, reachable);
                }
                let row = window_row(&mut windows, window.start_ms, regions.len());
                let granted_in_window: u64 = row.iter().map(|r| r.granted).sum();
                let record = &mut row[index];
                record.demand += 1;
                match outcome {
                    Spend::Leased(lease) => {
                        if holder
                            .lease_window_start_ms(lease)
                            .is_some_and(|start| start < window.start_ms)
                        {
                            record.carried_over += 1;
                        } else {
                            record.leased += 1;
                        }
                    }
                    Spend::Fallback { .. } => record.fallback += 1,
                    Spend::Denied { denial, .. } => match denial {
                        Denial::PoolExhausted => {
                            record.denied_exhausted += 1;
                            if granted_in_window < scenario.limit {
                                record.denied_while_tokens_left += 1;
                            }
                        }
                        Denial::FallbackSpent | Denial::FailClosed => {
                            record.denied_fallback_spent += 1;
                        }
                        Denial::AwaitingGrant => record.denied_awaiting += 1,
                    },
                }
            }
            if reachable {
                allocator
                    .renew(&regions[index], holder, index, now_ms, &mut windows)
                    .await?;
            }
            // Reports keep the holder's ledger bounded; the drill reads its counters directly.
            let report = holder.pending_report(now_ms);
            holder.acknowledge(&report, now_ms);
            let stranded = holder.stranded_tokens();
            window_row(&mut windows, window.start_ms, regions.len())[index].stranded +=
                stranded - stranded_seen[index];
            stranded_seen[index] = stranded;
        }
        elapsed_ms += TICK_MS;
    }

    let bound = OvershootBound {
        limit_tokens: pool_limits,
        ..OvershootBound::for_design(&config, scenario.clamping, MAX_LIVE_LEASES as u64, 0)
    };
    let windows: Vec<WindowRecord> = windows
        .into_iter()
        .map(|(start_ms, regions)| WindowRecord {
            offset_ms: start_ms - START_MS,
            lost_grant_record_tokens: lost_by_window.get(&start_ms).copied().unwrap_or(0),
            regions,
        })
        .collect();
    let violations = check(scenario, &bound, &windows);
    Ok(DrillReport {
        scenario: scenario.clone(),
        bound,
        windows,
        violations,
    })
}

/// The per-region records of the window starting at `start_ms` (epoch ms), created empty.
fn window_row(
    windows: &mut BTreeMap<u64, Vec<RegionWindow>>,
    start_ms: u64,
    region_count: usize,
) -> &mut Vec<RegionWindow> {
    windows
        .entry(start_ms)
        .or_insert_with(|| vec![RegionWindow::default(); region_count])
}

/// The shipped grant service for the drill's one pool, as the agents reach it.
struct DrillAllocator {
    kv: Arc<dyn Kv>,
    leadership: Leadership,
    /// Keeps the current leader's role readable.
    role_sender: watch::Sender<Role>,
    clamping: LeaseClamping,
    grantor: Grantor,
    tenant: TenantId,
    /// The pool each region draws from, by region index.
    pools: Vec<PoolId>,
    region_count: usize,
    /// Lease ids are made from the virtual time and this counter (unique, reproducible).
    leases_asked: u128,
}

impl DrillAllocator {
    /// Replaces the leader: the old one loses its store lease (it crashed or was partitioned away),
    /// a new one takes over with the next epoch. Returns the tokens granted in the current window
    /// that the new leader cannot see (0 when records are kept).
    async fn fail_over(
        &mut self,
        config: &PoolConfig,
        clock: &Arc<ManualClock>,
        records_kept: bool,
        now_ms: u64,
    ) -> Result<u64, String> {
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
        self.kv
            .revoke(self.leadership.lease)
            .await
            .map_err(|e| e.to_string())?;
        let mut lost = 0;
        if !records_kept {
            let current = config.window_at(now_ms);
            let mut pools = self.pools.clone();
            pools.dedup();
            for pool in &pools {
                lost += get_window(&*self.kv, &self.tenant, pool)
                    .await
                    .map_err(|e| e.to_string())?
                    .filter(|(state, _)| state.window == current)
                    .map_or(0, |(state, _)| state.granted_tokens());
            }
            // The replica the new leader reads kept configurations and the epoch, not the grants.
            let replica: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
            for (key, value) in self
                .kv
                .get_prefix("/allot/", 10_000)
                .await
                .map_err(|e| e.to_string())?
            {
                if key.starts_with("/allot/pools/") || key == EPOCH_KEY {
                    replica
                        .txn(
                            Vec::new(),
                            vec![Op::Put {
                                key,
                                value: value.value,
                                lease: None,
                            }],
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                }
            }
            self.kv = replica;
        }
        let leadership = try_acquire(&*self.kv, "drill-allocator-2", "http://drill-2", 1 << 40)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("the new allocator did not become leader")?;
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
                .ok_or("a pool has at least one region")?;
            let attempt = deposed
                .grant(
                    &self.tenant,
                    &self.pools[0],
                    GrantRequest {
                        lease_id: LeaseId::from_parts(now_ms, self.leases_asked),
                        region,
                        want_tokens: 1,
                    },
                )
                .await;
            if attempt.is_ok() {
                return Err("a deposed allocator granted after the failover".to_owned());
            }
        }
        Ok(lost)
    }

    /// One renewal, as the agent's renewal task does it: ask for what the holder wants, record the
    /// grant against its window, hand it to the holder.
    async fn renew(
        &mut self,
        region: &RegionId,
        holder: &mut PoolHolder,
        index: usize,
        now_ms: u64,
        windows: &mut BTreeMap<u64, Vec<RegionWindow>>,
    ) -> Result<(), String> {
        let Some(want_tokens) = holder.wants(now_ms, ROUND_TRIP_MS) else {
            return Ok(());
        };
        self.leases_asked += 1;
        holder.begin_renewal();
        let answer = self
            .grantor
            .grant(
                &self.tenant,
                &self.pools[index],
                GrantRequest {
                    lease_id: LeaseId::from_parts(now_ms, self.leases_asked),
                    region: region.clone(),
                    want_tokens,
                },
            )
            .await;
        holder.end_renewal();
        let record = answer.map_err(|e| format!("grant failed: {e}"))?;
        window_row(windows, record.window_start_ms, self.region_count)[index].granted +=
            record.granted;
        let verdict = holder.accept(
            LeaseGrant {
                lease_id: record.lease_id,
                epoch: record.epoch,
                granted_tokens: record.granted,
                window: Window {
                    start_ms: record.window_start_ms,
                    end_ms: record.window_end_ms,
                },
                expires_at_ms: record.expires_at_ms,
                retry_after_ms: record.retry_after_ms,
            },
            now_ms,
        );
        if let GrantVerdict::StaleEpoch { highest } = verdict {
            return Err(format!(
                "a grant from a stale epoch reached the holder (highest {highest:?})"
            ));
        }
        Ok(())
    }
}

/// Invariants on the recorded history, then the scenario's expectation.
fn check(scenario: &Scenario, bound: &OvershootBound, windows: &[WindowRecord]) -> Vec<String> {
    let mut violations = Vec::new();
    let regions = scenario.regions.len() as u64;
    for window in windows {
        let at = window.offset_ms / 1_000;
        let admitted = window.sum(RegionWindow::admitted);
        let granted = window.sum(|r| r.granted);
        let bound = OvershootBound {
            lost_grant_record_tokens: window.lost_grant_record_tokens,
            ..*bound
        };
        if !bound.holds(admitted) {
            violations.push(format!(
                "window {at}s admitted {admitted} > bound {}",
                bound.total_tokens()
            ));
        }
        if granted > bound.limit_tokens + window.lost_grant_record_tokens {
            violations.push(format!(
                "window {at}s granted {granted} > the pools' limits {}",
                bound.limit_tokens
            ));
        }
        let leased = window.sum(|r| r.leased);
        if leased > granted {
            violations.push(format!(
                "window {at}s spent {leased} leased tokens of {granted} granted"
            ));
        }
        for (plan, r) in scenario.regions.iter().zip(&window.regions) {
            if r.fallback > scenario.fallback_per_region {
                violations.push(format!(
                    "window {at}s region {} admitted {} in fallback > allowance {}",
                    plan.region, r.fallback, scenario.fallback_per_region
                ));
            }
        }
        let carried = window.sum(|r| r.carried_over);
        if carried > bound.unclamped_carry_over_tokens {
            violations.push(format!(
                "window {at}s carried over {carried} > term {}",
                bound.unclamped_carry_over_tokens
            ));
        }
    }
    let max_admitted = windows
        .iter()
        .map(|w| w.sum(RegionWindow::admitted))
        .max()
        .unwrap_or(0);
    let total_fallback: u64 = windows.iter().map(|w| w.sum(|r| r.fallback)).sum();
    let total_carried: u64 = windows.iter().map(|w| w.sum(|r| r.carried_over)).sum();
    let denied_while_left: u64 = windows
        .iter()
        .map(|w| w.sum(|r| r.denied_while_tokens_left))
        .sum();
    match scenario.expect {
        Expectation::NoOvershoot => {
            if max_admitted > scenario.limit {
                violations.push(format!(
                    "expected no overshoot; a window admitted {max_admitted} > G {}",
                    scenario.limit
                ));
            }
            if total_fallback + total_carried > 0 {
                violations.push("expected neither fallback nor carry-over".to_owned());
            }
            // Clamped leases strand at most about a chunk per region per window (what is held when
            // the window ends).
            let stranded_cap = scenario.chunk * regions;
            for window in windows {
                let stranded = window.sum(|r| r.stranded);
                if stranded > stranded_cap {
                    violations.push(format!(
                        "window {}s stranded {stranded} > chunk x regions {stranded_cap}",
                        window.offset_ms / 1_000
                    ));
                }
            }
        }
        Expectation::FallbackWithinAllowance => {
            if total_fallback == 0 {
                violations.push("expected fallback admits during the partition".to_owned());
            }
            if max_admitted > scenario.limit + scenario.fallback_per_region * regions {
                violations.push(format!(
                    "expected at most G + fallback x regions; a window admitted {max_admitted}"
                ));
            }
        }
        Expectation::OvershootWithinLostRecords => {
            let lost: u64 = windows.iter().map(|w| w.lost_grant_record_tokens).sum();
            if lost == 0 || max_admitted <= scenario.limit {
                violations.push(format!(
                    "expected an overshoot from {lost} lost grant records; the most a window admitted was {max_admitted}"
                ));
            }
            if total_fallback + total_carried > 0 {
                violations.push("expected neither fallback nor carry-over".to_owned());
            }
        }
        Expectation::OvershootAcrossRegions => {
            if max_admitted <= scenario.limit || max_admitted > scenario.limit * regions {
                violations.push(format!(
                    "expected a window above G {} and within regions x G; the most was {max_admitted}",
                    scenario.limit
                ));
            }
        }
        Expectation::DeniedWhileTokensLeft => {
            if max_admitted > scenario.limit {
                violations.push(format!("a window admitted {max_admitted} > G"));
            }
            if denied_while_left == 0 {
                violations.push("expected denials while the quota had tokens".to_owned());
            }
        }
        Expectation::NoDenialWhileTokensLeft => {
            if max_admitted > scenario.limit {
                violations.push(format!("a window admitted {max_admitted} > G"));
            }
            if denied_while_left > 0 {
                violations.push(format!(
                    "{denied_while_left} denials while the quota had tokens"
                ));
            }
        }
        Expectation::CarryOverWithinTerm => {
            if total_carried == 0 {
                violations.push("expected carry-over from unclamped leases".to_owned());
            }
        }
    }
    violations
}

/// Runs the named drills (all when `names` is empty) on a single-threaded runtime: the table (or,
/// with `json`, a JSON array) for each, and an error naming the failed ones.
pub fn run_blocking(names: &[String], json: bool) -> Result<String, String> {
    let all = builtin();
    let chosen: Vec<Scenario> = if names.is_empty() {
        all
    } else {
        let mut chosen = Vec::new();
        for name in names {
            let scenario = all.iter().find(|s| s.name == name).ok_or_else(|| {
                let known: Vec<&str> = all.iter().map(|s| s.name).collect();
                format!("no drill named {name:?} (known: {})", known.join(", "))
            })?;
            chosen.push(scenario.clone());
        }
        chosen
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let mut out = String::new();
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for scenario in &chosen {
        let report = runtime.block_on(run(scenario))?;
        if json {
            reports.push(report.json());
        } else {
            out.push_str(&report.table());
            out.push('\n');
        }
        if !report.passed() {
            failed.push(scenario.name);
        }
    }
    if json {
        out = serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?;
        out.push('\n');
    }
    if failed.is_empty() {
        Ok(out)
    } else {
        Err(format!("{out}drills failed: {}", failed.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(admitted_leased: u64, granted: u64, fallback: u64) -> WindowRecord {
        WindowRecord {
            offset_ms: 0,
            lost_grant_record_tokens: 0,
            regions: vec![RegionWindow {
                demand: admitted_leased + fallback,
                leased: admitted_leased,
                fallback,
                granted,
                ..RegionWindow::default()
            }],
        }
    }

    fn scenario() -> Scenario {
        builtin().remove(0)
    }

    fn bound() -> OvershootBound {
        OvershootBound {
            limit_tokens: 1_000,
            unclamped_carry_over_tokens: 0,
            fallback_allowance_tokens: 200,
            lost_grant_record_tokens: 0,
        }
    }

    #[test]
    fn a_window_within_g_passes_the_checks() {
        assert_eq!(
            check(&scenario(), &bound(), &[window(990, 1_000, 0)]),
            Vec::<String>::new()
        );
    }

    /// Fails unless one of `violations` contains `needle`.
    fn assert_violation(violations: &[String], needle: &str) {
        assert!(
            violations.iter().any(|v| v.contains(needle)),
            "no violation mentions {needle:?}: {violations:?}"
        );
    }

    #[test]
    fn the_checker_catches_admits_beyond_the_bound_and_grants_beyond_g() {
        let violations = check(&scenario(), &bound(), &[window(1_150, 1_150, 100)]);
        assert_violation(&violations, "> bound 1200");
        assert_violation(&violations, "granted 1150 > the pools' limits 1000");
        assert_violation(&violations, "expected no overshoot");
    }

    #[test]
    fn the_checker_catches_spending_more_than_was_granted_and_fallback_beyond_the_allowance() {
        let violations = check(&scenario(), &bound(), &[window(500, 400, 101)]);
        assert_violation(&violations, "spent 500 leased tokens of 400");
        assert_violation(&violations, "101 in fallback > allowance 100");
    }
}
