//! What a drill runs: a pool, regions with demand over time, faults over time, and the outcome the
//! run must show. Scenarios are TOML files (`simulations/scenarios/*.toml` are the built-in suite);
//! every field is checked before a run, and every error names the field.

use allot_shared::ids::RegionId;
use allot_shared::lease::LeaseClamping;
use allot_shared::window::WindowSpec;
use allot_shared::wire::CalendarWindowSpec;
use serde::{Deserialize, Serialize};

/// 2026-01-01T00:00:00Z: drills start in the window starting here (seed 0 on its boundary); window
/// offsets are measured from it.
pub const START_MS: u64 = 1_767_225_600_000;
/// Virtual time advances in steps of this many ms unless a scenario says otherwise.
pub const DEFAULT_TICK_MS: u64 = 100;
/// Most tenants one drill simulates (each has its own pool and agents' holders) (I10).
pub const MAX_TENANTS: u64 = 100_000;
/// Most regions one drill simulates.
pub const MAX_REGIONS: usize = 16;
/// Longest virtual duration, ms (400 days: a year of calendar months, and the days around it).
pub const MAX_DURATION_MS: u64 = 400 * 24 * 3_600_000;
/// Most ticks one drill takes (I10): a day at 10 ms, a year at 5 s.
pub const MAX_TICKS: u64 = 10_000_000;
/// Most fixed windows one drill spans (their records are kept per window) (I10).
pub const MAX_FIXED_WINDOWS: u64 = 1_000_000;
/// Most faults per scenario.
pub const MAX_FAULTS: usize = 64;
/// Largest clock rate error an agent may be given, parts per million.
pub const MAX_RATE_PPM: i64 = 100_000;
/// A region name in a fault that means every region (a full split).
pub const ALL_REGIONS: &str = "*";

/// A drill: a pool, regions with demand, faults, and what the run must show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short name (`allot drill <name>`): lowercase letters, digits and `-`.
    pub name: String,
    /// One line on what it demonstrates.
    #[serde(default)]
    pub about: String,
    /// Seed of every random choice (random demand, answer loss, and, for any seed but 0, the phase
    /// of steady arrivals). Printed with the report.
    #[serde(default)]
    pub seed: u64,
    /// G, tokens per window.
    #[serde(rename = "limit")]
    pub limit_tokens: u64,
    /// Window length, ms (a multiple of `tick_ms`). With `calendar`, the unit a failing run is
    /// shortened by, and the windows are the calendar's.
    pub window_ms: u64,
    /// Calendar windows instead of fixed ones, and the instant the run starts in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<DrillCalendar>,
    /// Largest grant, tokens.
    #[serde(rename = "chunk")]
    pub chunk_tokens: u64,
    /// Lease TTL before clamping, ms.
    pub lease_ttl_ms: u64,
    /// Fallback tokens per region per window.
    #[serde(rename = "fallback_per_region")]
    pub fallback_per_region_tokens: u64,
    /// Debt a region may carry per window from metered requests settled above their estimate,
    /// tokens (the bound's settle-debt term; default 0: what leases cannot pay is written off).
    #[serde(
        default,
        rename = "settle_debt_per_region",
        skip_serializing_if = "is_zero"
    )]
    pub settle_debt_per_region_tokens: u64,
    /// The agents' clock margin, ms (default: the agent's, 100): no fallback within it of a
    /// window's edges (on the agent's clock), so a clock off by less admits fallback in the right
    /// window. At most 10,000.
    #[serde(default = "default_clock_margin_ms")]
    pub clock_margin_ms: u64,
    /// Whether leases are clamped to their window (`"clamped"`, the default, or `"unclamped"`).
    #[serde(default = "clamped", with = "clamping_text")]
    pub clamping: LeaseClamping,
    /// Tenants, each with its own pool of G and the same demand (default 1).
    #[serde(default = "one")]
    pub tenants: u64,
    /// Shards the pools are split into between two allocators (default 1: one allocator leads
    /// every pool). With more, the first allocator leads them all at the start and `shard_move`
    /// faults move them one at a time; the agents' calls go to each pool's shard leader.
    #[serde(default = "one_shard", skip_serializing_if = "is_one_shard")]
    pub shards: u32,
    /// Virtual time step, ms (default 100).
    #[serde(default = "default_tick_ms")]
    pub tick_ms: u64,
    /// Virtual duration, ms.
    pub duration_ms: u64,
    /// The regions and their demand.
    pub regions: Vec<RegionPlan>,
    /// How G is laid out over allocator pools.
    #[serde(default)]
    pub layout: PoolLayout,
    /// Faults over time.
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// What the run must show beyond the bound and the invariants.
    pub expect: Expectation,
    /// After the last fault ends, every region must be back to normal leasing (no fallback, no
    /// waiting for grants, no agent down) within this many lease TTLs (default 2).
    #[serde(default = "two")]
    pub converge_within_ttls: u64,
    /// When set, no decision may wait longer than this for a grant, ms (how long a hung allocator
    /// can hold up admits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<u64>,
    /// When set, gateways decide every request themselves against assignments their region's
    /// agent carves from what it holds (Envoy's rate limit quota service), instead of asking the
    /// agent per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateways: Option<GatewayPlan>,
    /// Operators' overrides of the tenants' pool limit, on a schedule: made and ended through the
    /// allocator's own override store, and each window checked against the highest limit in force
    /// during it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<DrillOverride>,
}

/// An override of a tenant's pool limit (`G`), on a schedule; times are ms since the drill's
/// start. The shared pool layout only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrillOverride {
    /// Which tenant, by index from 0; absent: every tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<u64>,
    /// When the operator creates it.
    pub at_ms: u64,
    /// `G` while it is in force, tokens per window.
    pub limit: u64,
    /// How long until it expires on its own; absent: until it is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lasts_ms: Option<u64>,
    /// When the operator ends it by hand, ms after it was created (before it expires).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_after_ms: Option<u64>,
}

/// Most overrides a drill schedules.
pub const MAX_DRILL_OVERRIDES: usize = 16;

/// A drill's calendar windows: `calendar = { unit = "day", time_zone = "Europe/Berlin", start =
/// "2026-03-29T20:00:00Z" }`. The run starts at `start` (seeds but 0 up to an hour later); window
/// offsets are measured from the start of the window containing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrillCalendar {
    /// `day`, `week` or `month`.
    pub unit: String,
    /// An IANA time zone.
    pub time_zone: String,
    /// An RFC 3339 instant: when the run starts.
    pub start: String,
}

/// Gateways behind the rate limit quota service: each region's requests are spread over its
/// gateways, which report usage to their agent every `report_interval_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayPlan {
    /// Gateways per region (1 to [`MAX_GATEWAYS_PER_REGION`]); requests go round-robin.
    pub per_region: u64,
    /// How often each gateway reports its usage, ms (100 to 60,000; default 1,000).
    #[serde(default = "default_report_interval_ms")]
    pub report_interval_ms: u64,
}

/// Most gateways per region in a drill.
pub const MAX_GATEWAYS_PER_REGION: u64 = 64;

fn default_clock_margin_ms() -> u64 {
    allot_region_agent::service::DEFAULT_CLOCK_MARGIN_MS
}

fn default_report_interval_ms() -> u64 {
    1_000
}

fn clamped() -> LeaseClamping {
    LeaseClamping::Clamped
}

fn one() -> u64 {
    1
}

fn one_shard() -> u32 {
    1
}

fn is_one_shard(shards: &u32) -> bool {
    *shards == 1
}

fn two() -> u64 {
    2
}

fn default_tick_ms() -> u64 {
    DEFAULT_TICK_MS
}

mod clamping_text {
    use allot_shared::lease::LeaseClamping;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &LeaseClamping, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match value {
            LeaseClamping::Clamped => "clamped",
            LeaseClamping::Unclamped => "unclamped",
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LeaseClamping, D::Error> {
        match String::deserialize(d)?.as_str() {
            "clamped" => Ok(LeaseClamping::Clamped),
            "unclamped" => Ok(LeaseClamping::Unclamped),
            other => Err(serde::de::Error::custom(format!(
                "clamping must be \"clamped\" or \"unclamped\", not {other:?}"
            ))),
        }
    }
}

/// One region's demand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionPlan {
    /// The region id.
    pub region: String,
    /// Requests per minute per tenant at the start.
    pub per_minute: u64,
    /// Requests per minute at the end: demand ramps linearly from `per_minute` (absent: constant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ramp_to_per_minute: Option<u64>,
    /// Intervals of different demand (a burst, or a lull), replacing the base rate while they last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bursts: Vec<Burst>,
    /// Arrivals per tick are Poisson-distributed around the rate (seeded) instead of evenly spread.
    #[serde(default)]
    pub random: bool,
    /// Agents serving the region (1 to [`MAX_AGENTS_PER_REGION`]; absent: 1): its gateways spread
    /// the region's requests over them, and each takes up the pool's terms as the shipped agent
    /// does, with its share of the region's fallback allowance.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub agents: u64,
    /// What each of the region's agents is told the region runs (`--region-agents`; absent: the
    /// true count). Below it, the agents together take more than the region's allowance: the
    /// misconfiguration the bound check catches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region_agents_setting: Option<u64>,
    /// Percent of the region's requests (seeded) that a regional rule denies after their global
    /// reservation: reserved, then cancelled, as the agent does (a denial debits nothing).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub regional_deny_percent: u64,
    /// Percent of the region's admitted requests (seeded) that are metered and settled above
    /// their estimate after the response, by `metered_extra` tokens each.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub metered_percent: u64,
    /// Tokens a metered request costs beyond its estimate.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub metered_extra: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

fn is_one(value: &u64) -> bool {
    *value == 1
}

/// Most agents a drill's region may run.
pub const MAX_AGENTS_PER_REGION: u64 = 8;

impl RegionPlan {
    /// Requests per minute per tenant at `elapsed_ms` into a drill of `duration_ms`.
    pub fn per_minute_at(&self, elapsed_ms: u64, duration_ms: u64) -> u64 {
        if let Some(burst) = self
            .bursts
            .iter()
            .find(|b| (b.from_ms..b.until_ms).contains(&elapsed_ms))
        {
            return burst.per_minute;
        }
        match self.ramp_to_per_minute {
            None => self.per_minute,
            Some(to) => {
                let span = u128::from(duration_ms.max(1));
                let at = u128::from(elapsed_ms.min(duration_ms));
                let (from, to) = (u128::from(self.per_minute), u128::from(to));
                let rate = if to >= from {
                    from + (to - from) * at / span
                } else {
                    from - (from - to) * at / span
                };
                u64::try_from(rate).unwrap_or(u64::MAX)
            }
        }
    }
}

/// Demand different from the base rate over `[from_ms, until_ms)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    /// Start, ms since the drill's start.
    pub from_ms: u64,
    /// End (exclusive), ms since the drill's start.
    pub until_ms: u64,
    /// Requests per minute per tenant meanwhile.
    pub per_minute: u64,
}

/// How the tenant's quota is laid out over allocator pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PoolLayout {
    /// One pool of G shared by every region, leased on demand (Allot's design).
    #[default]
    Shared,
    /// One pool per region, each of this many tokens per window: G each models independent
    /// regional limiters (up to regions x G), G / regions a static split.
    PerRegion {
        /// Tokens per window in each region's pool.
        per_region_limit: u64,
    },
}

/// Something going wrong, on a schedule. Times are ms since the drill's start; `region` is a region
/// id or `"*"` for every region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// The region cannot reach the allocator at all (calls fail at once).
    Partition {
        /// The region cut off (`"*"`: a full split).
        region: String,
        /// Start.
        from_ms: u64,
        /// End (exclusive).
        until_ms: u64,
    },
    /// Asymmetric loss: grant requests reach the allocator (and are granted) but this share of the
    /// answers never comes back.
    AnswerLoss {
        /// The region.
        region: String,
        /// Start.
        from_ms: u64,
        /// End (exclusive).
        until_ms: u64,
        /// Answers lost, percent (0 to 100), drawn from the seeded generator.
        percent: u64,
    },
    /// Grant answers arrive this much later than the usual round trip.
    Latency {
        /// The region.
        region: String,
        /// Start.
        from_ms: u64,
        /// End (exclusive).
        until_ms: u64,
        /// Added one-way delay of an answer, ms.
        added_ms: u64,
    },
    /// The leading allocator is replaced by a new one.
    Failover {
        /// When.
        at_ms: u64,
        /// Whether the new leader sees the committed grants (etcd: yes). When not, it starts from a
        /// store that kept pool configurations and the epoch but lost every window's grants, as an
        /// asynchronously replicated store can: the lost-record term of the bound.
        records_kept: bool,
    },
    /// One shard changes allocators: its leader key is gone (handed over, or its leader cut off
    /// from the store while its lease lapsed) and the other allocator takes it with the next
    /// epoch, while the old one still believes it leads: its next grant for a pool of the shard
    /// must fail on the fence. Needs `shards` above 1.
    ShardMove {
        /// When.
        at_ms: u64,
        /// Which shard, `0..shards`.
        shard: u32,
    },
    /// The region's agent crashes and restarts: its leases, unreported spend and fallback counts
    /// are lost; while down, its requests are not served; on restart it needs the allocator for
    /// its pools' terms.
    AgentRestart {
        /// The region.
        region: String,
        /// When it crashes.
        at_ms: u64,
        /// How long it is down.
        down_ms: u64,
        /// Which of the region's agents, from 0 (absent: every one).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        agent: Option<u64>,
    },
    /// The region's agent clock is off: by `offset_ms` from the start, plus `rate_ppm` parts per
    /// million of the elapsed time (for the whole drill).
    ClockSkew {
        /// The region.
        region: String,
        /// Offset, ms (negative: the agent's clock is behind).
        offset_ms: i64,
        /// Rate error, parts per million (negative: the agent's clock runs slow).
        rate_ppm: i64,
    },
}

impl Fault {
    /// The region the fault concerns (`None` for an allocator failover).
    pub fn region(&self) -> Option<&str> {
        match self {
            Fault::Partition { region, .. }
            | Fault::AnswerLoss { region, .. }
            | Fault::Latency { region, .. }
            | Fault::AgentRestart { region, .. }
            | Fault::ClockSkew { region, .. } => Some(region),
            Fault::Failover { .. } | Fault::ShardMove { .. } => None,
        }
    }

    /// Whether the fault touches `region`.
    pub fn touches(&self, region: &str) -> bool {
        self.region()
            .is_some_and(|r| r == ALL_REGIONS || r == region)
    }

    /// When the fault is over (ms since the start), for faults that heal; clock skew and failovers
    /// are not healed.
    pub fn heals_at_ms(&self) -> Option<u64> {
        match self {
            Fault::Partition { until_ms, .. }
            | Fault::AnswerLoss { until_ms, .. }
            | Fault::Latency { until_ms, .. } => Some(*until_ms),
            Fault::AgentRestart { at_ms, down_ms, .. } => Some(at_ms.saturating_add(*down_ms)),
            Fault::Failover { .. } | Fault::ShardMove { .. } | Fault::ClockSkew { .. } => None,
        }
    }
}

/// A drill's expected outcome (checked after the run; the bound and the invariants are always
/// checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Expectation {
    /// No window admits more than G.
    NoOvershoot,
    /// Some window admits more than G only through fallback, and no region exceeds its allowance.
    FallbackWithinAllowance,
    /// Some window admits tokens carried over from an earlier window's lease, within the design's
    /// carry-over term.
    CarryOverWithinTerm,
    /// A failover may lose grant records; no window admits more than G by more than what was lost
    /// (how much is lost, and whether it shows, depends on where the failover falls in its window).
    OvershootWithinLostRecords,
    /// Some window admits more than G (independent regional limits), within regions x G.
    OvershootAcrossRegions,
    /// Some region is denied while the tenant's quota still had tokens (a static split).
    DeniedWhileTokensLeft,
    /// No overshoot, and no region is ever denied while the tenant's quota had tokens.
    NoDenialWhileTokensLeft,
    /// Nothing beyond the bound and the invariants (for faults whose outcome depends on the seed).
    WithinBound,
    /// An agent spends a lease after its end (a clock error beyond the safety margin): the checker
    /// must see it. The invariant is then reported, not failed.
    SpendPastLeaseEnd,
    /// Some window admits more than G under a raised override (it took effect), and every window
    /// stays within the bound of the highest limit in force during it.
    OverrideHonoured,
}

impl Scenario {
    /// A scenario from TOML text, checked.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let scenario: Scenario = toml::from_str(text).map_err(|e| {
            // One line: the message, and where.
            let line = e
                .span()
                .map(|span| text[..span.start.min(text.len())].lines().count().max(1));
            match line {
                Some(line) => format!("line {line}: {}", e.message()),
                None => e.message().to_owned(),
            }
        })?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// How the pools' windows are cut, the first window's start (window offsets are measured from
    /// it) and when the run starts (seed 0), epoch ms. The error names the field.
    pub fn windows(&self) -> Result<DrillWindows, String> {
        let Some(calendar) = &self.calendar else {
            let length_ms = std::num::NonZeroU64::new(self.window_ms)
                .ok_or_else(|| "window_ms: must be at least 1".to_owned())?;
            return Ok(DrillWindows {
                phase_span_ms: length_ms.get(),
                spec: WindowSpec::Fixed(length_ms),
                base_ms: START_MS,
                start_ms: START_MS,
            });
        };
        let spec = CalendarWindowSpec {
            calendar: calendar.unit.clone(),
            time_zone: calendar.time_zone.clone(),
        }
        .to_spec()
        .map_err(|e| {
            let field = if e.field.ends_with("calendar") {
                "unit"
            } else {
                "time_zone"
            };
            format!("calendar.{field}: {}", e.message)
        })?;
        let start: jiff::Timestamp = calendar
            .start
            .parse()
            .map_err(|e| format!("calendar.start: not an RFC 3339 instant ({e})"))?;
        let start_ms = u64::try_from(start.as_millisecond())
            .map_err(|_| "calendar.start: must be after 1970".to_owned())?;
        let first = spec.containing(start_ms);
        if !(start_ms - first.start_ms).is_multiple_of(self.tick_ms.max(1)) {
            return Err("calendar.start: must lie a whole number of ticks into its window".into());
        }
        Ok(DrillWindows {
            phase_span_ms: spec.shortest_ms().min(CALENDAR_PHASE_SPAN_MS),
            spec,
            base_ms: first.start_ms,
            start_ms,
        })
    }

    /// The scenario as TOML text.
    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    /// Checks the overrides: bounded, on the shared layout, one in force per tenant at a time,
    /// under an expectation that does not compare windows with G itself.
    fn validate_overrides(&self) -> Result<(), String> {
        if self.overrides.is_empty() {
            return Ok(());
        }
        if self.overrides.len() > MAX_DRILL_OVERRIDES {
            return Err(format!("overrides: at most {MAX_DRILL_OVERRIDES}"));
        }
        if self.layout != PoolLayout::Shared {
            return Err("overrides: only with the shared pool layout".to_owned());
        }
        // Expectations stated against G itself cannot hold once an override raises it.
        if !matches!(
            self.expect,
            Expectation::WithinBound | Expectation::OverrideHonoured
        ) {
            return Err("overrides: expect must be within_bound or override_honoured".to_owned());
        }
        for (index, o) in self.overrides.iter().enumerate() {
            let field = format!("overrides[{index}]");
            if o.limit == 0 || o.limit > allot_shared::MAX_RULE_PARAMETER {
                return Err(format!("{field}.limit: 1 to 2^40"));
            }
            if o.tenant.is_some_and(|t| t >= self.tenants) {
                return Err(format!(
                    "{field}.tenant: one of the {} tenants, from 0",
                    self.tenants
                ));
            }
            if o.lasts_ms == Some(0) || o.ended_after_ms == Some(0) {
                return Err(format!(
                    "{field}: lasts_ms and ended_after_ms are at least 1"
                ));
            }
            // One in force per pool at a time, as the allocator keeps them.
            let end = |o: &DrillOverride| {
                let until = o
                    .lasts_ms
                    .min(o.ended_after_ms)
                    .or(o.lasts_ms)
                    .or(o.ended_after_ms);
                until.map_or(u64::MAX, |ms| o.at_ms + ms)
            };
            for earlier in &self.overrides[..index] {
                let same_tenant =
                    earlier.tenant.is_none() || o.tenant.is_none() || earlier.tenant == o.tenant;
                if same_tenant && o.at_ms < end(earlier) && earlier.at_ms < end(o) {
                    return Err(format!(
                        "{field}: overlaps an earlier override of the same tenant (one is in force at a time)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks every field; the error names the field. Long by design: one check per field, in the
    /// scenario's order.
    pub fn validate(&self) -> Result<(), String> {
        let fail = |field: &str, message: String| Err(format!("{field}: {message}"));
        if self.name.is_empty()
            || self.name.len() > 64
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return fail("name", "1 to 64 of a-z, 0-9 and -".into());
        }
        if self.limit_tokens == 0 {
            return fail("limit", "must be at least 1".into());
        }
        if self.tick_ms == 0 || self.tick_ms > 60_000 {
            return fail("tick_ms", "must be 1 to 60000".into());
        }
        if self.window_ms == 0 || !self.window_ms.is_multiple_of(self.tick_ms) {
            return fail(
                "window_ms",
                format!("must be a positive multiple of tick_ms ({})", self.tick_ms),
            );
        }
        if self.calendar.is_some() {
            self.windows()?;
            // Calendar windows end on whole half hours from one another (daylight saving moves
            // clocks by an hour, or half an hour): ticks must divide that to land on every end.
            if !CALENDAR_STEP_MS.is_multiple_of(self.tick_ms) {
                return fail(
                    "tick_ms",
                    format!("must divide {CALENDAR_STEP_MS} with calendar windows"),
                );
            }
        }
        if self.clock_margin_ms > allot_region_agent::service::settings::MAX_CLOCK_MARGIN_MS {
            return fail("clock_margin_ms", "must be 0 to 10000".into());
        }
        if self.chunk_tokens == 0 || self.lease_ttl_ms == 0 {
            return fail("chunk", "chunk and lease_ttl_ms must be at least 1".into());
        }
        if !(1..=MAX_TENANTS).contains(&self.tenants) {
            return fail("tenants", format!("must be 1 to {MAX_TENANTS}"));
        }
        if self.duration_ms < self.tick_ms || self.duration_ms > MAX_DURATION_MS {
            return fail(
                "duration_ms",
                format!("must be tick_ms to {MAX_DURATION_MS}"),
            );
        }
        if self.duration_ms / self.tick_ms.max(1) > MAX_TICKS {
            return fail(
                "duration_ms",
                format!("at most {MAX_TICKS} ticks of tick_ms; raise tick_ms"),
            );
        }
        if self.calendar.is_none() && self.duration_ms / self.window_ms.max(1) > MAX_FIXED_WINDOWS {
            return fail(
                "duration_ms",
                format!("at most {MAX_FIXED_WINDOWS} windows of window_ms"),
            );
        }
        if self.regions.is_empty() || self.regions.len() > MAX_REGIONS {
            return fail("regions", format!("1 to {MAX_REGIONS} regions"));
        }
        for (index, plan) in self.regions.iter().enumerate() {
            let field = format!("regions[{index}]");
            if RegionId::parse(&plan.region).is_err() {
                return fail(&format!("{field}.region"), "not a valid region id".into());
            }
            if self.regions[..index]
                .iter()
                .any(|other| other.region == plan.region)
            {
                return fail(&format!("{field}.region"), "listed twice".into());
            }
            for (name, percent) in [
                ("regional_deny_percent", plan.regional_deny_percent),
                ("metered_percent", plan.metered_percent),
            ] {
                if percent > 100 {
                    return fail(&format!("{field}.{name}"), "0 to 100".into());
                }
                if percent > 0 && self.gateways.is_some() {
                    return fail(
                        &format!("{field}.{name}"),
                        "only where the agent decides requests (no [gateways])".into(),
                    );
                }
            }
            if plan.metered_extra > allot_shared::MAX_RULE_PARAMETER {
                return fail(&format!("{field}.metered_extra"), "0 to 2^40".into());
            }
            if !(1..=MAX_AGENTS_PER_REGION).contains(&plan.agents) {
                return fail(
                    &format!("{field}.agents"),
                    format!("1 to {MAX_AGENTS_PER_REGION}"),
                );
            }
            if plan
                .region_agents_setting
                .is_some_and(|setting| !(1..=MAX_AGENTS_PER_REGION).contains(&setting))
            {
                return fail(
                    &format!("{field}.region_agents_setting"),
                    format!("1 to {MAX_AGENTS_PER_REGION}"),
                );
            }
            for (b, burst) in plan.bursts.iter().enumerate() {
                if burst.from_ms >= burst.until_ms {
                    return fail(
                        &format!("{field}.bursts[{b}]"),
                        "from_ms must be before until_ms".into(),
                    );
                }
            }
        }
        if let PoolLayout::PerRegion { per_region_limit } = self.layout
            && per_region_limit == 0
        {
            return fail("layout.per_region_limit", "must be at least 1".into());
        }
        if let Some(gateways) = &self.gateways {
            if !(1..=MAX_GATEWAYS_PER_REGION).contains(&gateways.per_region) {
                return fail(
                    "gateways.per_region",
                    format!("1 to {MAX_GATEWAYS_PER_REGION}"),
                );
            }
            if !(100..=60_000).contains(&gateways.report_interval_ms) {
                return fail("gateways.report_interval_ms", "100 to 60000".into());
            }
        }
        self.validate_overrides()?;
        if !(1..=allot_shared::shards::MAX_SHARDS).contains(&self.shards) {
            return fail(
                "shards",
                format!("must be 1 to {}", allot_shared::shards::MAX_SHARDS),
            );
        }
        if self.faults.len() > MAX_FAULTS {
            return fail("faults", format!("at most {MAX_FAULTS}"));
        }
        for (index, fault) in self.faults.iter().enumerate() {
            let field = format!("faults[{index}]");
            if let Some(region) = fault.region()
                && region != ALL_REGIONS
                && !self.regions.iter().any(|p| p.region == region)
            {
                return fail(
                    &format!("{field}.region"),
                    format!("{region:?} is not one of the scenario's regions"),
                );
            }
            match fault {
                Fault::Partition {
                    from_ms, until_ms, ..
                }
                | Fault::Latency {
                    from_ms, until_ms, ..
                }
                | Fault::AnswerLoss {
                    from_ms, until_ms, ..
                } if from_ms >= until_ms => {
                    return fail(field.as_str(), "from_ms must be before until_ms".into());
                }
                Fault::AnswerLoss { percent, .. } if *percent > 100 => {
                    return fail(&format!("{field}.percent"), "0 to 100".into());
                }
                Fault::ShardMove { shard, .. } if *shard >= self.shards => {
                    return fail(
                        &format!("{field}.shard"),
                        format!("must be below shards ({})", self.shards),
                    );
                }
                Fault::Failover { .. } if self.shards > 1 => {
                    return fail(
                        field.as_str(),
                        "a failover replaces the one allocator: with shards, move them".into(),
                    );
                }
                Fault::AgentRestart {
                    region, down_ms, ..
                } if region == ALL_REGIONS || *down_ms == 0 => {
                    return fail(
                        field.as_str(),
                        "an agent restart names one region and lasts at least 1 ms".into(),
                    );
                }
                Fault::AgentRestart {
                    region,
                    agent: Some(agent),
                    ..
                } if self
                    .regions
                    .iter()
                    .find(|p| p.region == *region)
                    .is_none_or(|plan| *agent >= plan.agents) =>
                {
                    return fail(
                        &format!("{field}.agent"),
                        "one of the region's agents, from 0".into(),
                    );
                }
                Fault::ClockSkew {
                    offset_ms,
                    rate_ppm,
                    ..
                } if offset_ms.unsigned_abs() > self.window_ms || rate_ppm.abs() > MAX_RATE_PPM => {
                    return fail(
                        field.as_str(),
                        format!("offset_ms within one window and rate_ppm within +-{MAX_RATE_PPM}"),
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// When the last healing fault ends, ms since the start (`None`: no such fault).
    pub fn heals_at_ms(&self) -> Option<u64> {
        self.faults.iter().filter_map(Fault::heals_at_ms).max()
    }
}

// The built-in suite (`BUILTIN`): every file of `simulations/scenarios/`, listed by the build
// script, so that a new file there is a new drill.
include!(concat!(env!("OUT_DIR"), "/builtin_scenarios.rs"));

/// Calendar windows' ends lie whole multiples of this apart (half an hour), ms.
const CALENDAR_STEP_MS: u64 = 1_800_000;

/// How much later than its start a calendar drill's seed may begin, ms: an hour (its windows are
/// days or longer; a run of a few hours must still cross the boundary it was written for).
const CALENDAR_PHASE_SPAN_MS: u64 = 3_600_000;

/// A drill's windows ([`Scenario::windows`]).
#[derive(Debug, Clone)]
pub struct DrillWindows {
    /// How the windows are cut.
    pub spec: WindowSpec,
    /// The first window's start, epoch ms: window offsets are measured from it.
    pub base_ms: u64,
    /// When seed 0 starts, epoch ms.
    pub start_ms: u64,
    /// Other seeds start up to this much later (a whole number of ticks), ms.
    pub phase_span_ms: u64,
}

/// The built-in drills, parsed.
pub fn builtin() -> Vec<Scenario> {
    BUILTIN
        .iter()
        .filter_map(|(name, text)| match Scenario::from_toml(text) {
            Ok(scenario) => Some(scenario),
            Err(error) => {
                // Unreachable in a tested build: a test parses every built-in file.
                tracing::error!(%name, %error, "a built-in scenario does not parse");
                None
            }
        })
        .collect()
}
