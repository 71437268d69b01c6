//! The lease protocol, model-checked: every interleaving of the shipped agent loop (the
//! [`PoolAgent`](allot_region_agent::global::PoolAgent) each agent runs for the pool, around its `PoolHolder`) and the shipped grant
//! decision ([`plan_batch`](allot_allocator::grants::plan_batch) behind the store's conditional commit, idempotent by lease id), for
//! small configurations, explored exhaustively by [stateright] and checked against the overshoot
//! bound.
//!
//! What the model adds is only what the real system gets from its surroundings: time advancing in
//! steps, a network that loses, duplicates, delays and reorders messages, an allocator failover
//! (a deposed leader keeps serving until it notices), agent restarts (from the state directory's
//! journal, or, without one, from what the ledger and the allocator's session record say), and
//! the gateways' requests: each reserved and committed as the service admits it, or, denied by a
//! regional rule after its reservation, cancelled; a metered one charged its extra cost after
//! its response. Each of those is an action; the checker tries every order. Faults are bounded (a
//! count of each) and happen before the *heal*; after it, every message is delivered before time
//! moves on, so renewals must resume.
//!
//! The allocator's side is the worker's steps in order: a lease id already granted is answered
//! from its record (idempotency across batches, which lives in the store); otherwise
//! [`plan_batch`](allot_allocator::grants::plan_batch) decides the asks queued together (one, or, in a configuration with batches,
//! every ask in flight at once) on the leader's cached window, and the commit of them all
//! succeeds only while the leader's fence and the window's revision still hold (etcd's compare).
//! A commit that fails the revision reloads the cache and decides again; a deposed leader answers
//! "not leader".
//!
//! Properties, per window of the allocator's clock: admitted tokens (what metered requests were
//! charged beyond their estimates, paid or owed, included) stay within [`OvershootBound`]; a token
//! is spent only before its lease's end and inside its window; no grant from a stale epoch is
//! held; a denial debits nothing; after the heal every renewal is answered within a step; without
//! a state directory, no region admits more than its allowance in fallback in a window, however
//! often its agent restarts. [`Variant`]s break one guard each so a test can show the checker
//! catches it.

mod agents;
mod allocator;
mod checker;
mod state;

use allot_region_agent::global::HolderConfig;
use allot_region_agent::global::terms::{AgentShare, holder_config};
use allot_shared::ids::RegionId;
use allot_shared::lease::{LeaseClamping, OvershootBound, PoolConfig, PoolConfigError};
use allot_shared::window::{CalendarUnit, CalendarWindow, WindowSpec};
use allot_shared::wire::{CalendarWindowSpec, PoolTerms};

pub use state::{Action, Breach, GivenBack, Message, ModelState, Reply};

/// Most regions a model may have (the state grows with each).
pub const MAX_MODEL_REGIONS: usize = 3;

/// How the model's windows are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelWindow {
    /// Fixed windows of this many ms, the first starting when the model does.
    Fixed(u64),
    /// Calendar days in Europe/Berlin, crossing the local midnight that begins the day daylight
    /// saving starts (a 23-hour day) half way through the model.
    BerlinDay,
}

/// A guard of the protocol deliberately broken, to show the checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The code as shipped.
    Shipped,
    /// The allocator commits without its compare (leader fence and window revision): a deposed
    /// leader grants from its stale view of the window.
    FenceSkipped,
    /// Leases are not clamped to their window's end.
    ClampRemoved,
    /// An agent times a grant from when its answer arrives, as if it were new, rather than from
    /// its own ask with what was left of the lease when the allocator answered.
    RecoveredTimedFromReceipt,
    /// An agent without a state directory, restarted after a crash, trusts the ledger's count of
    /// its region's fallback, which misses what the crashed run admitted and never reported.
    UncleanRestartTrusted,
    /// Agents cut fallback windows on their own clocks with no clock margin at the windows'
    /// edges, as if their clocks agreed with the allocator's.
    ClockMarginIgnored,
    /// Each of a region's agents takes the region's whole fallback allowance, as if it ran alone
    /// (`--region-agents` left at 1 with two agents).
    AllowanceNotSplit,
    /// The allocator decides grants against ten times the pool's limit: the guard that keeps a
    /// window's grants within `G`, broken. Every configuration's demand exceeds its bound, so
    /// this breaks "admitted within the bound" in each.
    LimitIgnored,
    /// The allocator decides each ask of a batch on the window as it was before the batch, as
    /// if alone, and commits them together: asks decided together can be granted the same
    /// tokens.
    BatchDecidedApart,
    /// The allocator takes a lease's unspent tokens back without the store's mark that it did:
    /// a final line delivered twice gives its tokens back twice.
    GiveBackUnmarked,
}

/// A configuration to explore.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Regions sharing the pool (1 to [`MAX_MODEL_REGIONS`]).
    pub regions: usize,
    /// Agents serving the first region (1 or 2; every other region runs one): each takes its
    /// share of the region's fallback allowance, as the shipped agent does.
    pub agents_in_first_region: usize,
    /// `G`, tokens per window.
    pub limit_tokens: u64,
    /// Largest grant, tokens.
    pub chunk_tokens: u64,
    /// Lease TTL before clamping, ms.
    pub lease_ttl_ms: u64,
    /// The windows.
    pub window: ModelWindow,
    /// Tokens a region may admit per window while the allocator is unreachable.
    pub fallback_per_region_tokens: u64,
    /// How far time moves in one tick, ms; also the agent's call timeout.
    pub step_ms: u64,
    /// Ticks until the model ends.
    pub steps: u32,
    /// Requests each region's gateways send in every step (steady demand: when each arrives,
    /// relative to the protocol's messages, is the checker's choice; whether it arrives is not,
    /// which keeps the state space to what the protocol does).
    pub spends_per_step: u8,
    /// Messages the network may lose, in all.
    pub losses: u8,
    /// Requests the network may deliver twice, in all.
    pub duplicates: u8,
    /// Allocator failovers.
    pub failovers: u8,
    /// Agent restarts (crashes): from the state directory's journal, or without one.
    pub restarts: u8,
    /// Requests denied by a regional rule after their global reservation (reserved, then
    /// cancelled: a denial anywhere debits nothing anywhere), in all.
    pub regional_denials: u8,
    /// Metered requests settled a token above their estimate after their response (charged to
    /// the pool: paid from leases, owed within the agent's settle debt, or written off), in all.
    pub charges: u8,
    /// Debt a region may carry from such charges per window, tokens (the bound's settle-debt
    /// term).
    pub settle_debt_per_region_tokens: u64,
    /// Whether asks that are in flight together may be decided in one batch and committed
    /// together, as the allocator's worker does with the asks queued for a pool.
    pub batches: bool,
    /// Whether agents keep a state directory (fallback within durable claims, restarts from the
    /// journal); without one a restart starts from the ledger and the session record.
    pub state_dir: bool,
    /// Each region's clock less the allocator's, ms (regions past [`regions`](Self::regions) are
    /// ignored). The agents' clock margin is the largest of them: the margin holds.
    pub clock_offsets_ms: [i64; MAX_MODEL_REGIONS],
    /// The tick from which nothing fails: no loss, duplicate, failover or restart, and every
    /// message is delivered before time moves on.
    pub heal_at_step: u32,
    /// Whether final report lines give what their leases left unspent back to the allocator, as
    /// agents do with an allocator that takes them back (off: those tokens stay stranded).
    pub give_back: bool,
    /// Which guard, if any, is broken.
    pub variant: Variant,
}

impl ModelConfig {
    /// The base of the configurations CI explores: 2 regions, `G` = 3 in chunks of 2, 3 s
    /// windows with leases of 2 s, 1 token of fallback per region and window, a request per
    /// region every 1 s step, over 5 s (a whole window and most of the next), healed after 2 s;
    /// no fault (each configuration adds its own). A window's demand (6) exceeds its bound (5),
    /// so a broken guard can show as an overshoot.
    pub fn small() -> Self {
        Self {
            regions: 2,
            agents_in_first_region: 1,
            limit_tokens: 3,
            chunk_tokens: 2,
            lease_ttl_ms: 2_000,
            window: ModelWindow::Fixed(3_000),
            fallback_per_region_tokens: 1,
            step_ms: 1_000,
            steps: 5,
            spends_per_step: 1,
            losses: 0,
            duplicates: 0,
            failovers: 0,
            restarts: 0,
            regional_denials: 0,
            charges: 0,
            settle_debt_per_region_tokens: 0,
            batches: false,
            state_dir: true,
            clock_offsets_ms: [0; MAX_MODEL_REGIONS],
            heal_at_step: 2,
            give_back: false,
            variant: Variant::Shipped,
        }
    }

    /// The same configuration with `variant`.
    pub fn with_variant(self, variant: Variant) -> Self {
        Self { variant, ..self }
    }
}

/// A built model: the configuration with what every state shares.
#[derive(Debug, Clone)]
pub struct LeaseModel {
    config: ModelConfig,
    pool: PoolConfig,
    /// Each agent's holder configuration, by agent.
    holders: Vec<HolderConfig>,
    /// Each agent's region, by agent (the first region's agents first).
    agent_regions: Vec<usize>,
    regions: Vec<RegionId>,
    origin_ms: u64,
    bound_tokens: u64,
    /// Check only this property (the checker stops at its first discovery).
    only: Option<&'static str>,
}

/// Why a configuration cannot be modelled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelConfigError {
    /// The pool terms are invalid.
    #[error("invalid pool: {0}")]
    Pool(#[from] PoolConfigError),
    /// Something else.
    #[error("invalid model: {0}")]
    Invalid(&'static str),
}

/// 2026-01-01T00:00:00Z, where fixed windows start.
const FIXED_ORIGIN_MS: u64 = 1_767_225_600_000;
/// An instant on 2026-03-29 in Berlin, the day daylight saving starts.
const BERLIN_DST_DAY_MS: u64 = 1_774_774_800_000;

impl LeaseModel {
    /// Builds the model, validating the pool terms exactly as the allocator does.
    ///
    /// Long by design: it derives the model's parts from one another in the order the real system
    /// does (window, pool, the terms the allocator gives, each agent's holder configuration from
    /// its share, the bound), with the variants' broken guards applied where each part is made;
    /// split, the variants' effects would be scattered over several helpers.
    pub fn new(config: ModelConfig) -> Result<Self, ModelConfigError> {
        if !(1..=MAX_MODEL_REGIONS).contains(&config.regions) {
            return Err(ModelConfigError::Invalid("regions must be 1 to 3"));
        }
        if !(1..=2).contains(&config.agents_in_first_region) {
            return Err(ModelConfigError::Invalid(
                "the first region runs 1 or 2 agents",
            ));
        }
        if config.step_ms == 0 || config.steps == 0 || config.heal_at_step > config.steps {
            return Err(ModelConfigError::Invalid(
                "step_ms and steps must be positive and heal_at_step at most steps",
            ));
        }
        let (window, origin_ms) = match config.window {
            ModelWindow::Fixed(ms) => {
                let length = std::num::NonZeroU64::new(ms)
                    .ok_or(ModelConfigError::Invalid("a window of 0 ms"))?;
                (
                    WindowSpec::Fixed(length),
                    FIXED_ORIGIN_MS - FIXED_ORIGIN_MS % ms,
                )
            }
            ModelWindow::BerlinDay => {
                let calendar = CalendarWindow::new(CalendarUnit::Day, "Europe/Berlin")
                    .map_err(|_| ModelConfigError::Invalid("no Europe/Berlin time zone"))?;
                let spec = WindowSpec::Calendar(calendar);
                let midnight = spec.containing(BERLIN_DST_DAY_MS).start_ms;
                let half_ms = u64::from(config.steps / 2) * config.step_ms;
                (spec, midnight - half_ms)
            }
        };
        let regions: Vec<RegionId> = (0..config.regions)
            .map(|r| RegionId::parse(&format!("r{r}")))
            .collect::<Result<_, _>>()
            .map_err(|_| ModelConfigError::Invalid("region name"))?;
        let pool = PoolConfig::with_window(
            config.limit_tokens,
            window.clone(),
            config.chunk_tokens,
            config.lease_ttl_ms,
            config.fallback_per_region_tokens,
            regions.clone(),
        )?
        .with_settle_debt_per_region(config.settle_debt_per_region_tokens)?;
        let offsets = &config.clock_offsets_ms[..config.regions];
        if offsets
            .iter()
            .any(|offset| offset.unsigned_abs() >= config.step_ms)
        {
            return Err(ModelConfigError::Invalid(
                "clock offsets must be shorter than a step",
            ));
        }
        let clock_margin_ms = match config.variant {
            Variant::ClockMarginIgnored => 0,
            _ => offsets.iter().map(|o| o.unsigned_abs()).max().unwrap_or(0),
        };
        // The pool's terms as the allocator gives them to agents.
        let terms = PoolTerms {
            limit_tokens: config.limit_tokens,
            window_ms: pool.window().longest_ms(),
            window: match &window {
                WindowSpec::Calendar(calendar) => Some(CalendarWindowSpec::of(calendar)),
                WindowSpec::Fixed(_) => None,
            },
            chunk_tokens: config.chunk_tokens,
            lease_ttl_ms: config.lease_ttl_ms,
            fallback_per_region_tokens: config.fallback_per_region_tokens,
            settle_debt_per_region_tokens: config.settle_debt_per_region_tokens,
            regions: regions.clone(),
            version: 1,
            fallback_in_window: None,
            limit_override: None,
        };
        let agent_regions: Vec<usize> = std::iter::repeat_n(0, config.agents_in_first_region)
            .chain(1..config.regions)
            .collect();
        let holders = agent_regions
            .iter()
            .map(|&region| {
                let region_agents = match config.variant {
                    Variant::AllowanceNotSplit => 1,
                    _ => agent_regions.iter().filter(|&&r| r == region).count() as u64,
                };
                // The agent's own step from terms to its holder's configuration: its share of the
                // region's allowance, and the margins.
                let share = AgentShare {
                    region_agents,
                    expiry_margin_ms: 50,
                    clock_margin_ms,
                    round_trip_ms: 20,
                    // A renewal unanswered for a whole step counts as an unreachable allocator.
                    renewal_patience_ms: config.step_ms,
                    // With a state directory: fallback only within durable claims.
                    claims: config.state_dir,
                };
                holder_config(&terms, &share)
            })
            .collect::<Option<Vec<_>>>()
            .ok_or(ModelConfigError::Invalid("windows the agents cannot cut"))?;
        // Leases are clamped, grant records survive a failover (etcd), and nothing is settled.
        let bound_tokens =
            OvershootBound::for_design(&pool, LeaseClamping::Clamped, 1, 0).total_tokens();
        Ok(Self {
            config,
            pool,
            holders,
            agent_regions,
            regions,
            origin_ms,
            bound_tokens,
            only: None,
        })
    }

    /// The model checking only `property` (one of this module's property names), so the
    /// checker stops at the first state that breaks it: how a broken variant is shown.
    pub fn checking_only(self, property: &'static str) -> Self {
        Self {
            only: Some(property),
            ..self
        }
    }

    /// The bound every window is checked against, tokens.
    pub fn bound_tokens(&self) -> u64 {
        self.bound_tokens
    }

    /// Now on the allocator's clock (the one windows are checked on).
    fn now_ms(&self, state: &ModelState) -> u64 {
        self.origin_ms + u64::from(state.step) * self.config.step_ms
    }

    /// Now on agent `a`'s clock (its region's): everything the agent does is timed on it.
    fn agent_ms(&self, state: &ModelState, a: usize) -> u64 {
        self.now_ms(state)
            .saturating_add_signed(self.clock_offset_ms(a))
    }

    /// How far agent `a`'s clock (its region's) is off the allocator's, ms.
    fn clock_offset_ms(&self, a: usize) -> i64 {
        let region = self.agent_regions.get(a).copied().unwrap_or(a);
        self.config
            .clock_offsets_ms
            .get(region)
            .copied()
            .unwrap_or(0)
    }

    /// Whether what each region admits in fallback per window is counted and checked against its
    /// allowance: without state directories (restarts start from the ledger) or with clock
    /// offsets (windows are cut on two clocks). Otherwise it is not kept, so the configurations
    /// without either explore exactly the states they always did.
    fn tracks_fallback(&self) -> bool {
        !self.config.state_dir
            || self.config.clock_offsets_ms.iter().any(|&o| o != 0)
            || self.config.agents_in_first_region > 1
    }

    fn healed(&self, state: &ModelState) -> bool {
        state.step >= self.config.heal_at_step
    }

    /// The pool as the allocator decides grants on it (with [`Variant::LimitIgnored`], ten times
    /// its limit).
    fn granting_pool(&self) -> std::borrow::Cow<'_, PoolConfig> {
        match self.config.variant {
            Variant::LimitIgnored => self
                .pool
                .limited_to(self.pool.limit_tokens().saturating_mul(10)),
            _ => std::borrow::Cow::Borrowed(&self.pool),
        }
    }

    fn clamping(&self) -> LeaseClamping {
        match self.config.variant {
            Variant::ClampRemoved => LeaseClamping::Unclamped,
            _ => LeaseClamping::Clamped,
        }
    }
}

/// The safety properties, each with the breach that breaks it.
pub const SAFETY: [(&str, Breach); 7] = [
    (WITHIN_BOUND, Breach::OverBound),
    (SPENT_IN_LEASE_LIFE, Breach::SpentPastLeaseEnd),
    (SPENT_IN_WINDOW, Breach::SpentOutsideWindow),
    (NO_STALE_EPOCH, Breach::StaleEpochHeld),
    (DENIAL_DEBITS_NOTHING, Breach::DenialDebited),
    (RESUMES_AFTER_HEAL, Breach::RenewalUnansweredAfterHeal),
    (FALLBACK_WITHIN_ALLOWANCE, Breach::FallbackOverAllowance),
];

/// Per window, admitted tokens stay within the overshoot bound.
pub const WITHIN_BOUND: &str = "admitted within the bound";
/// No token is spent at or after its lease's end.
pub const SPENT_IN_LEASE_LIFE: &str = "spent within its lease's life";
/// No token is spent outside its lease's window.
pub const SPENT_IN_WINDOW: &str = "spent within its window";
/// No grant from an epoch older than one held is held.
pub const NO_STALE_EPOCH: &str = "no stale epoch held";
/// A denied request changes nothing.
pub const DENIAL_DEBITS_NOTHING: &str = "a denial debits nothing";
/// After the heal, every renewal is answered within a step.
pub const RESUMES_AFTER_HEAL: &str = "renewals resume after the heal";
/// Without a state directory, no region admits more than its allowance in fallback in a window.
pub const FALLBACK_WITHIN_ALLOWANCE: &str = "fallback within the allowance";
/// Coverage: some window admits its whole limit.
pub const REACHES_LIMIT: &str = "a window admits its limit";
/// Coverage: a grant of the failover's epoch is held.
pub const HOLDS_AFTER_FAILOVER: &str = "a grant after a failover is held";
/// Coverage: something is admitted in fallback.
pub const ADMITS_IN_FALLBACK: &str = "something is admitted in fallback";
/// Reachability: a lease's unspent tokens are taken back (with give-back on).
pub const GIVES_BACK: &str = "unspent tokens are taken back";
