//! The lease protocol, model-checked: every interleaving of the shipped agent loop (the
//! [`PoolAgent`] each agent runs for the pool, around its `PoolHolder`) and the shipped grant
//! decision ([`plan_batch`] behind the store's conditional commit, idempotent by lease id), for
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
//! [`plan_batch`] decides the asks queued together (one, or, in a configuration with batches,
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

use std::collections::BTreeMap;

use allot_allocator::grants::plan_batch;
use allot_allocator::pools::GrantRecord;
use allot_region_agent::global::driver::{Inherited, RenewalAnswer};
use allot_region_agent::global::terms::{AgentShare, holder_config};
use allot_region_agent::global::{
    Denial, GrantCall, HolderConfig, HolderSnapshot, PoolAgent, PoolJournal, Refusal, Spend,
};
use allot_shared::ids::{Epoch, LeaseId, RegionId};
use allot_shared::lease::{
    GrantRequest, LeaseClamping, OvershootBound, PoolConfig, PoolConfigError, PoolWindowState,
};
use allot_shared::window::{CalendarUnit, CalendarWindow, WindowSpec};
use allot_shared::wire::{CalendarWindowSpec, FallbackInWindow, GrantAnswer, PoolTerms};
use stateright::{Model, Property};

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

/// A breach of a safety property, recorded by the step that saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Breach {
    /// A token was spent at or after its lease's end (the allocator's clock).
    SpentPastLeaseEnd,
    /// A token was spent outside its lease's window.
    SpentOutsideWindow,
    /// A grant older than one already taken was held.
    StaleEpochHeld,
    /// A denied request changed what was spent or spendable.
    DenialDebited,
    /// After the heal, a renewal went a whole step unanswered.
    RenewalUnansweredAfterHeal,
    /// A window that ended admitted more than the bound.
    OverBound,
    /// A region admitted more than its allowance in fallback in a window.
    FallbackOverAllowance,
}

impl Breach {
    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// What the allocator answered.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// A grant (possibly of nothing).
    Grant(GrantAnswer),
    /// A definite refusal.
    Refused,
    /// A deposed leader: the agent's client treats it as no answer.
    NotLeader,
}

/// A message in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Message {
    /// A region's renewal, to the allocator.
    Ask {
        /// The asking region.
        region: u8,
        /// The call that sent it gave up: the allocator still serves it, but its answer goes
        /// nowhere (an answer travels back on its call's own connection).
        orphan: bool,
        /// The lease id asked with.
        lease_id: LeaseId,
        /// Tokens wanted.
        want_tokens: u64,
    },
    /// The allocator's answer, to the region.
    Answer {
        /// The region.
        region: u8,
        /// The lease id it answers.
        lease_id: LeaseId,
        /// What was answered.
        reply: Reply,
    },
}

/// One allocator node that believes it leads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Leader {
    epoch: Epoch,
    /// Its cached window and the store revision it was read at.
    window: Option<PoolWindowState>,
    revision: u64,
}

/// The allocator: the store (etcd) and the nodes serving from it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Allocator {
    /// The epoch the store's leader key holds: the fence.
    epoch: Epoch,
    window: Option<PoolWindowState>,
    window_revision: u64,
    records: BTreeMap<LeaseId, GrantRecord>,
    /// The newest last; a deposed one serves until the model forgets it.
    leaders: Vec<Leader>,
}

/// A renewal call the agent is waiting on (the renewal is its pool agent's in flight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Call {
    lease_id: LeaseId,
    asked_at_ms: u64,
}

/// One agent, for the pool (a region's one agent, or one of the first region's two: its messages
/// and figures are by agent).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Region {
    agent: PoolAgent,
    call: Option<Call>,
    reachable: bool,
    next_lease: u32,
    journal: PoolJournal,
    spends_this_step: u8,
    highest_epoch_held: Epoch,
}

/// A state of the whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelState {
    step: u32,
    allocator: Allocator,
    regions: Vec<Region>,
    /// Messages in flight, sorted (a multiset).
    network: Vec<Message>,
    losses: u8,
    duplicates: u8,
    failovers: u8,
    restarts: u8,
    regional_denials: u8,
    charges: u8,
    /// Tokens admitted per window (its start on the allocator's clock).
    admitted: BTreeMap<u64, u64>,
    /// Without a state directory (or with a region of two agents): tokens each agent admitted in
    /// fallback per window, in truth and as the ledger holds them (reported), by (window start,
    /// agent). Kept only then, so the configurations with one explore the states they always did.
    fallback_admitted: BTreeMap<(u64, u8), u64>,
    ledger_fallback: BTreeMap<(u64, u8), u64>,
    breaches: u8,
}

impl ModelState {
    /// Whether a step recorded `breach`.
    pub fn breached(&self, breach: Breach) -> bool {
        self.breaches & breach.bit() != 0
    }
}

/// A step the checker may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Time moves on a step: calls that timed out give up, agents journal and renew.
    Tick,
    /// A gateway asks region `r`'s agent to admit one token.
    Spend(u8),
    /// An ask is served by leader `leader` (0 the oldest) and its answer arrives at once: the
    /// only way asks travel after the heal (and in a model without faults), which spares the
    /// checker the interleavings of answers with other regions' steps that change nothing.
    RoundTrip {
        /// Index into the network.
        index: u8,
        /// Which leader serves it.
        leader: u8,
    },
    /// Message `index` arrives; an ask is served by leader `leader` (0 the oldest).
    Deliver {
        /// Index into the network.
        index: u8,
        /// Which leader serves an ask.
        leader: u8,
    },
    /// Message `index` is lost.
    Lose(u8),
    /// Ask `index` is delivered twice.
    Duplicate(u8),
    /// The allocator fails over to a new leader of the next epoch.
    FailOver,
    /// Region `r`'s agent crashes and restarts (from its journal, if it keeps a state directory).
    Restart(u8),
    /// Agent `r` reserves a request's token, and a regional rule then denies the request: what
    /// was reserved is cancelled (one of the step's requests).
    DenyRegionally(u8),
    /// A metered request agent `r` admitted earlier is settled a token above its estimate.
    Charge(u8),
    /// Every ask in flight is served by leader `leader` in one batch, committed together, and
    /// each answer arrives at once.
    RoundTripAll {
        /// Which leader serves them.
        leader: u8,
    },
}

impl Allocator {
    /// The grant worker's steps for one ask at `leader`, at `now_ms`.
    fn serve(
        &mut self,
        model: &LeaseModel,
        leader: usize,
        request: &GrantRequest,
        now_ms: u64,
    ) -> Reply {
        self.serve_batch(model, leader, std::slice::from_ref(request), now_ms)
            .pop()
            .unwrap_or(Reply::NotLeader)
    }

    /// The grant worker's steps for asks queued together at `leader`, at `now_ms`: a lease id
    /// already granted is answered from its record (idempotency across batches, which lives in
    /// the store); the rest are decided in one [`plan_batch`] on the leader's cached window and
    /// committed in one transaction, which succeeds only while the leader's fence and the
    /// window's revision still hold (etcd's compare). A commit that fails the revision reloads
    /// the cache and decides again; a deposed leader answers "not leader". One reply per ask.
    fn serve_batch(
        &mut self,
        model: &LeaseModel,
        leader: usize,
        requests: &[GrantRequest],
        now_ms: u64,
    ) -> Vec<Reply> {
        let mut replies: Vec<Option<Reply>> = requests
            .iter()
            .map(|request| {
                self.records
                    .get(&request.lease_id)
                    .map(|record| Reply::Grant(record.answer(now_ms)))
            })
            .collect();
        let new: Vec<usize> = (0..requests.len())
            .filter(|&i| replies[i].is_none())
            .collect();
        let fill = |replies: Vec<Option<Reply>>, rest: &mut dyn FnMut(usize) -> Reply| {
            replies
                .into_iter()
                .enumerate()
                .map(|(i, reply)| reply.unwrap_or_else(|| rest(i)))
                .collect::<Vec<Reply>>()
        };
        if new.is_empty() {
            return fill(replies, &mut |_| Reply::NotLeader);
        }
        let fence = model.config.variant != Variant::FenceSkipped;
        let pool = model.granting_pool();
        // The second attempt decides on a freshly read window, so it commits or is deposed.
        for _ in 0..2 {
            let Some(node) = self.leaders.get(leader) else {
                return fill(replies, &mut |_| Reply::NotLeader);
            };
            let plan = match model.config.variant {
                Variant::BatchDecidedApart => {
                    decided_apart(&pool, node, now_ms, model.clamping(), &new, requests)
                }
                _ => plan_batch(
                    &pool,
                    node.window.as_ref(),
                    node.epoch,
                    now_ms,
                    model.clamping(),
                    new.iter().map(|&i| &requests[i]),
                ),
            };
            let deposed = node.epoch != self.epoch;
            // What the window had left is shown to callers and decides nothing; it differs
            // only with the order of grants, which would split one state into many.
            let answer_of = |answer: &Result<GrantRecord, _>| match answer {
                Ok(record) => Reply::Grant(
                    GrantRecord {
                        ungranted_tokens: None,
                        ..record.clone()
                    }
                    .answer(now_ms),
                ),
                Err(_) => Reply::Refused,
            };
            if plan.new_records.is_empty() {
                if deposed {
                    return fill(replies, &mut |_| Reply::NotLeader);
                }
                for (&i, answer) in new.iter().zip(&plan.answers) {
                    replies[i] = Some(answer_of(answer));
                }
                return fill(replies, &mut |_| Reply::Refused);
            }
            let compare_holds = !deposed && node.revision == self.window_revision;
            if compare_holds || !fence {
                self.window_revision += 1;
                self.window = plan.window.clone();
                for record in &plan.new_records {
                    let record = GrantRecord {
                        ungranted_tokens: None,
                        ..record.clone()
                    };
                    self.records.insert(record.lease_id, record);
                }
                let revision = self.window_revision;
                if let Some(node) = self.leaders.get_mut(leader) {
                    node.window = plan.window.clone();
                    node.revision = revision;
                }
                for (&i, answer) in new.iter().zip(&plan.answers) {
                    replies[i] = Some(answer_of(answer));
                }
                return fill(replies, &mut |_| Reply::Refused);
            }
            if deposed {
                return fill(replies, &mut |_| Reply::NotLeader);
            }
            let (window, revision) = (self.window.clone(), self.window_revision);
            if let Some(node) = self.leaders.get_mut(leader) {
                node.window = window;
                node.revision = revision;
            }
        }
        fill(replies, &mut |_| Reply::NotLeader)
    }
}

/// [`Variant::BatchDecidedApart`]: each ask decided alone on the leader's window as it was before
/// the batch; the batch's window is the one the last ask left.
fn decided_apart(
    pool: &PoolConfig,
    node: &Leader,
    now_ms: u64,
    clamping: LeaseClamping,
    new: &[usize],
    requests: &[GrantRequest],
) -> allot_allocator::grants::BatchPlan {
    let mut merged = allot_allocator::grants::BatchPlan {
        answers: Vec::new(),
        new_records: Vec::new(),
        window: node.window.clone(),
    };
    for &i in new {
        let alone = plan_batch(
            pool,
            node.window.as_ref(),
            node.epoch,
            now_ms,
            clamping,
            std::iter::once(&requests[i]),
        );
        merged.answers.extend(alone.answers);
        merged.new_records.extend(alone.new_records);
        if alone.window.is_some() {
            merged.window = alone.window;
        }
    }
    merged
}

/// Tokens a holder has spent or admitted in fallback, as its snapshot would say.
fn used_tokens(snapshot: &HolderSnapshot) -> u64 {
    let leased: u64 = snapshot.leases.iter().map(|l| l.spent_tokens).sum();
    let fallback: u64 = snapshot.fallback.iter().map(|f| f.admitted_tokens).sum();
    leased + fallback
}

/// Region `r`'s call is over (it gave up, or the agent restarted): its answer, if one is on its
/// way, goes nowhere, and an ask still on its way is served without one.
fn end_call(state: &mut ModelState, r: usize) {
    state.regions[r].call = None;
    let region = r as u8;
    state
        .network
        .retain(|m| !matches!(m, Message::Answer { region: to, .. } if *to == region));
    for message in &mut state.network {
        if let Message::Ask {
            region: from,
            orphan,
            ..
        } = message
            && *from == region
        {
            *orphan = true;
        }
    }
    state.network.sort();
}

impl LeaseModel {
    /// Region `region`'s `n`th lease id. Every id carries the run's start as when it was made: a
    /// run is shorter than a grant record is kept, so no lost answer is ever given up for age
    /// (`lost_answer_recoverable_until_ms`), and ids made at different steps stay one state.
    fn lease_id(&self, region: usize, n: u32) -> LeaseId {
        LeaseId::from_parts(
            self.origin_ms,
            ((region as u128) << 32) | u128::from(n) | (1 << 64),
        )
    }

    /// The agent's upkeep: start a renewal if the holder wants one and no call is out.
    fn renew(&self, state: &mut ModelState, r: usize) {
        let now_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        if region.call.is_some() {
            return;
        }
        let fresh = self.lease_id(r, region.next_lease);
        if let Some(ask) = region.agent.renewal_to_ask(now_ms, fresh) {
            if ask.lease_id == fresh {
                region.next_lease += 1;
            }
            region.call = Some(Call {
                lease_id: ask.lease_id,
                asked_at_ms: now_ms,
            });
            state.network.push(Message::Ask {
                region: r as u8,
                orphan: false,
                lease_id: ask.lease_id,
                want_tokens: ask.want_tokens,
            });
            state.network.sort();
        }
    }

    fn tick(&self, state: &mut ModelState) {
        let healed_before = self.healed(state);
        state.step += 1;
        for r in 0..state.regions.len() {
            let now_ms = self.agent_ms(state, r);
            let region = &mut state.regions[r];
            region.spends_this_step = 0;
            if let Some(call) = region.call
                && now_ms.saturating_sub(call.asked_at_ms) >= self.config.step_ms
            {
                if healed_before && call.asked_at_ms >= self.heal_ms(r) {
                    state.breaches |= Breach::RenewalUnansweredAfterHeal.bit();
                }
                // The call times out: no answer, so the grant may exist and the id is kept.
                let timed_out = GrantCall::Unanswered;
                region.agent.renewal_answered(&timed_out, now_ms);
                region.reachable = timed_out.answer().reached_allocator();
                end_call(state, r);
            }
            let region = &mut state.regions[r];
            if region.reachable {
                // The agent's report round: what the allocator acknowledges is done with.
                for part in region.agent.report(now_ms) {
                    region.agent.reported(&part, now_ms);
                    let admitted = part.fallback_admitted_tokens();
                    if self.tracks_fallback() && admitted > 0 {
                        let held = state
                            .ledger_fallback
                            .entry((part.window_start_ms(), r as u8))
                            .or_default();
                        *held = (*held).max(admitted);
                    }
                }
            }
            region.journal = region.agent.journal(None);
            self.renew(state, r);
        }
        self.close_windows(state, self.now_ms(state));
    }

    /// Windows that ended are checked against the bound and forgotten, and grant records past
    /// their retention (a window past the window's end) vanish, as the store's lease removes
    /// them: states that differ only in history become one.
    fn close_windows(&self, state: &mut ModelState, now_ms: u64) {
        let current_start_ms = self.pool.window_at(now_ms).start_ms;
        let bound_tokens = self.bound_tokens;
        let mut over = false;
        state.admitted.retain(|&start_ms, &mut admitted| {
            over |= admitted > bound_tokens;
            start_ms >= current_start_ms
        });
        state
            .fallback_admitted
            .retain(|&(start_ms, _), _| start_ms >= current_start_ms);
        state
            .ledger_fallback
            .retain(|&(start_ms, _), _| start_ms >= current_start_ms);
        if over {
            state.breaches |= Breach::OverBound.bit();
        }
        state.allocator.records.retain(|_, record| {
            let length_ms = record.window_end_ms - record.window_start_ms;
            record.window_end_ms + length_ms > now_ms
        });
    }

    /// The heal, on agent `a`'s clock.
    fn heal_ms(&self, a: usize) -> u64 {
        (self.origin_ms + u64::from(self.config.heal_at_step) * self.config.step_ms)
            .saturating_add_signed(self.clock_offset_ms(a))
    }

    fn spend(&self, state: &mut ModelState, r: usize) {
        // The request is decided on the agent's clock and checked on the allocator's.
        let now_ms = self.now_ms(state);
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        region.spends_this_step += 1;
        let before = (
            used_tokens(&region.agent.holder().snapshot(None)),
            region.agent.holder().available_tokens(agent_ms),
        );
        let mut reserved = region.agent.reserve(1, agent_ms, region.reachable, false);
        if let Err(Refusal {
            denial: Denial::FallbackUnclaimed,
            ..
        }) = reserved
            && let Some((window_start_ms, claimed)) =
                region.agent.fallback_claim_wanted(1, agent_ms)
        {
            // The agent makes the claim durable (journal written and synced), then admits.
            region.journal = region.agent.journal(Some((window_start_ms, claimed)));
            region.agent.claim_durable(window_start_ms, claimed);
            reserved = region.agent.reserve(1, agent_ms, region.reachable, false);
        }
        // The pool is the request's only rule: admitted, what it reserved is committed.
        let outcome = match reserved {
            Ok(reservation) => region.agent.commit(reservation),
            Err(refusal) => Spend::Denied {
                denial: refusal.denial,
                retry_after_ms: refusal.retry_after_ms,
            },
        };
        let window_start_ms = self.pool.window_at(now_ms).start_ms;
        match outcome {
            Spend::Leased(lease_id) => {
                match state.allocator.records.get(&lease_id) {
                    Some(record) => {
                        if now_ms >= record.expires_at_ms {
                            state.breaches |= Breach::SpentPastLeaseEnd.bit();
                        }
                        if !(record.window_start_ms..record.window_end_ms).contains(&now_ms) {
                            state.breaches |= Breach::SpentOutsideWindow.bit();
                        }
                    }
                    None => state.breaches |= Breach::SpentPastLeaseEnd.bit(),
                }
                *state.admitted.entry(window_start_ms).or_default() += 1;
            }
            Spend::Fallback { .. } => {
                *state.admitted.entry(window_start_ms).or_default() += 1;
                if self.tracks_fallback() {
                    *state
                        .fallback_admitted
                        .entry((window_start_ms, r as u8))
                        .or_default() += 1;
                    // The region's agents together, against the region's allowance.
                    let region = self.agent_regions[r];
                    let regions_admits: u64 = state
                        .fallback_admitted
                        .iter()
                        .filter(|&(&(start_ms, agent), _)| {
                            start_ms == window_start_ms
                                && self.agent_regions[usize::from(agent)] == region
                        })
                        .map(|(_, admitted)| *admitted)
                        .sum();
                    if regions_admits > self.config.fallback_per_region_tokens {
                        state.breaches |= Breach::FallbackOverAllowance.bit();
                    }
                }
            }
            Spend::Denied { .. } => {
                let region = &mut state.regions[r];
                let after = (
                    used_tokens(&region.agent.holder().snapshot(None)),
                    region.agent.holder().available_tokens(agent_ms),
                );
                if after != before {
                    state.breaches |= Breach::DenialDebited.bit();
                }
            }
        }
        self.renew(state, r);
    }

    /// Message `index` arrives (an ask at `leader`); with `round_trip`, an ask's answer arrives at
    /// once too.
    fn deliver(&self, state: &mut ModelState, index: usize, leader: usize, round_trip: bool) {
        let now_ms = self.now_ms(state);
        let message = state.network.remove(index);
        match message {
            Message::Ask {
                region,
                orphan,
                lease_id,
                want_tokens,
            } => {
                let request = GrantRequest {
                    lease_id,
                    region: self.regions[self.agent_regions[usize::from(region)]].clone(),
                    want_tokens,
                };
                let reply = state.allocator.serve(self, leader, &request, now_ms);
                if !orphan {
                    state.network.push(Message::Answer {
                        region,
                        lease_id,
                        reply,
                    });
                    state.network.sort();
                    if round_trip
                        && let Some(index) = state.network.iter().position(|m| {
                            matches!(m, Message::Answer { region: to, lease_id: id, .. }
                                if *to == region && *id == lease_id)
                        })
                    {
                        self.deliver(state, index, 0, false);
                    }
                }
            }
            Message::Answer {
                region: r,
                lease_id,
                reply,
            } => {
                let r = usize::from(r);
                let now_ms = self.agent_ms(state, r);
                let region = &mut state.regions[r];
                // Answers of calls that ended are dropped with them (see `end_call`).
                let Some(call) = region.call.filter(|c| c.lease_id == lease_id) else {
                    return;
                };
                let grant_call = match &reply {
                    Reply::Grant(answer) => self.grant_call(answer, call.asked_at_ms, now_ms),
                    Reply::Refused => GrantCall::Refused,
                    Reply::NotLeader => GrantCall::Unanswered,
                };
                let answer = grant_call.answer();
                let Some(outcome) = region.agent.renewal_answered(&grant_call, now_ms) else {
                    return;
                };
                if let (true, RenewalAnswer::Granted(grant)) = (outcome.held(), answer) {
                    if grant.epoch < region.highest_epoch_held {
                        state.breaches |= Breach::StaleEpochHeld.bit();
                    }
                    region.highest_epoch_held = region.highest_epoch_held.max(grant.epoch);
                }
                region.reachable = answer.reached_allocator();
                end_call(state, r);
                self.renew(state, r);
            }
        }
    }

    /// The call's outcome as the agent's transport gives it: `answer`, to a call asked at
    /// `asked_at_ms`, arriving at `now_ms`.
    fn grant_call(&self, answer: &GrantAnswer, asked_at_ms: u64, now_ms: u64) -> GrantCall {
        match self.config.variant {
            // Timed as if new: from its arrival, for the lease's whole original length.
            Variant::RecoveredTimedFromReceipt => GrantCall::Answered {
                answer: GrantAnswer {
                    answered_at_ms: answer.issued_at_ms,
                    ..answer.clone()
                },
                asked_at_ms: now_ms,
            },
            _ => GrantCall::Answered {
                answer: answer.clone(),
                asked_at_ms,
            },
        }
    }

    /// A request at agent `r` reserves its token, and a regional rule denies it: the reservation
    /// is cancelled, and nothing spent or spendable may have moved.
    fn deny_regionally(&self, state: &mut ModelState, r: usize) {
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        region.spends_this_step += 1;
        let before = (
            used_tokens(&region.agent.holder().snapshot(None)),
            region.agent.holder().available_tokens(agent_ms),
        );
        if let Ok(reservation) = region.agent.reserve(1, agent_ms, region.reachable, false) {
            region.agent.cancel(reservation);
        }
        let after = (
            used_tokens(&region.agent.holder().snapshot(None)),
            region.agent.holder().available_tokens(agent_ms),
        );
        if after != before {
            state.breaches |= Breach::DenialDebited.bit();
        }
        self.renew(state, r);
    }

    /// A metered request agent `r` admitted is settled a token above its estimate: what its
    /// leases pay and what it owes are consumed in the window (the bound's settle-debt term
    /// covers what is owed); what is written off was never charged, and is outside the bound.
    fn charge(&self, state: &mut ModelState, r: usize) {
        let now_ms = self.now_ms(state);
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        let charged = region.agent.charge(1, agent_ms);
        let window_start_ms = self.pool.window_at(now_ms).start_ms;
        *state.admitted.entry(window_start_ms).or_default() +=
            charged.paid_tokens + charged.owed_tokens;
        self.renew(state, r);
    }

    /// Every ask in flight served by `leader` in one batch and committed together; the answers
    /// arrive at once, in the asks' order.
    fn round_trip_all(&self, state: &mut ModelState, leader: usize) {
        let now_ms = self.now_ms(state);
        let (asks, rest): (Vec<Message>, Vec<Message>) = std::mem::take(&mut state.network)
            .into_iter()
            .partition(|m| matches!(m, Message::Ask { .. }));
        state.network = rest;
        let requests: Vec<GrantRequest> = asks
            .iter()
            .filter_map(|m| match m {
                Message::Ask {
                    region,
                    lease_id,
                    want_tokens,
                    ..
                } => Some(GrantRequest {
                    lease_id: *lease_id,
                    region: self.regions[self.agent_regions[usize::from(*region)]].clone(),
                    want_tokens: *want_tokens,
                }),
                Message::Answer { .. } => None,
            })
            .collect();
        let replies = state.allocator.serve_batch(self, leader, &requests, now_ms);
        let mut answered = Vec::new();
        for (ask, reply) in asks.into_iter().zip(replies) {
            if let Message::Ask {
                region,
                orphan: false,
                lease_id,
                ..
            } = ask
            {
                answered.push((region, lease_id));
                state.network.push(Message::Answer {
                    region,
                    lease_id,
                    reply,
                });
            }
        }
        state.network.sort();
        // The batch's answers arrive at once, each where its call waits.
        for (to, id) in answered {
            if let Some(index) = state.network.iter().position(|m| {
                matches!(m, Message::Answer { region, lease_id, .. } if *region == to && *lease_id == id)
            }) {
                self.deliver(state, index, 0, false);
            }
        }
    }

    fn fail_over(&self, state: &mut ModelState) {
        let allocator = &mut state.allocator;
        allocator.epoch = Epoch(allocator.epoch.0 + 1);
        let leader = Leader {
            epoch: allocator.epoch,
            window: allocator.window.clone(),
            revision: allocator.window_revision,
        };
        allocator.leaders.push(leader);
        if allocator.leaders.len() > 2 {
            allocator.leaders.remove(0);
        }
    }

    fn restart(&self, state: &mut ModelState, r: usize) {
        // The session record is stamped on the allocator's clock; the new run takes over the
        // window it is in on its own.
        let allocator_ms = self.now_ms(state);
        let now_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        let config = self.holders[r].clone();
        region.agent =
            if self.config.state_dir {
                PoolAgent::restored(config, &region.journal)
            } else {
                // A crash never ends the run's session: the new run is told so, and takes over the
                // window from the ledger's count of its own fallback (the ledger keeps each agent's).
                let window_start_ms = self.pool.window_at(now_ms).start_ms;
                let ledger_fallback = state.ledger_fallback.get(&(window_start_ms, r as u8)).map(
                    |&admitted_tokens| FallbackInWindow {
                        window_start_ms,
                        admitted_tokens,
                    },
                );
                let unclean_start_ms =
                    (self.config.variant != Variant::UncleanRestartTrusted).then_some(allocator_ms);
                let inherited = Inherited {
                    ledger_fallback,
                    unclean_start_ms,
                };
                PoolAgent::taking_over(config, inherited, now_ms).0
            };
        region.reachable = true;
        region.highest_epoch_held = region.agent.holder().highest_epoch();
        end_call(state, r);
    }
}

impl Model for LeaseModel {
    type State = ModelState;
    type Action = Action;

    fn init_states(&self) -> Vec<ModelState> {
        let agents = self
            .holders
            .iter()
            .map(|holder| Region {
                agent: PoolAgent::taking_over(holder.clone(), Inherited::default(), self.origin_ms)
                    .0,
                call: None,
                reachable: true,
                next_lease: 0,
                journal: PoolJournal::default(),
                spends_this_step: 0,
                highest_epoch_held: Epoch(0),
            })
            .collect();
        vec![ModelState {
            step: 0,
            allocator: Allocator {
                epoch: Epoch(1),
                window: None,
                window_revision: 0,
                records: BTreeMap::new(),
                leaders: vec![Leader {
                    epoch: Epoch(1),
                    window: None,
                    revision: 0,
                }],
            },
            regions: agents,
            network: Vec::new(),
            losses: self.config.losses,
            duplicates: self.config.duplicates,
            failovers: self.config.failovers,
            restarts: self.config.restarts,
            regional_denials: self.config.regional_denials,
            charges: self.config.charges,
            admitted: BTreeMap::new(),
            fallback_admitted: BTreeMap::new(),
            ledger_fallback: BTreeMap::new(),
            breaches: 0,
        }]
    }

    fn actions(&self, state: &ModelState, actions: &mut Vec<Action>) {
        let broken = SAFETY
            .iter()
            .any(|&(name, breach)| self.checks(name) && !self.keeps(breach, state));
        if broken {
            // A breach of a checked property ends the behaviour: its trace is the shortest one
            // that shows it, and the states past it are not worth exploring.
            return;
        }
        let healed = self.healed(state);
        let demand_met = state
            .regions
            .iter()
            .all(|r| r.spends_this_step >= self.config.spends_per_step);
        if state.step < self.config.steps && demand_met && (!healed || state.network.is_empty()) {
            actions.push(Action::Tick);
        }
        for (r, region) in state.regions.iter().enumerate() {
            if region.spends_this_step < self.config.spends_per_step {
                actions.push(Action::Spend(r as u8));
                if state.regional_denials > 0 {
                    actions.push(Action::DenyRegionally(r as u8));
                }
            }
            if state.charges > 0 {
                actions.push(Action::Charge(r as u8));
            }
        }
        let asks = state
            .network
            .iter()
            .filter(|m| matches!(m, Message::Ask { .. }))
            .count();
        if self.config.batches && asks > 1 {
            for leader in 0..state.allocator.leaders.len() as u8 {
                actions.push(Action::RoundTripAll { leader });
            }
        }
        let leaders = state.allocator.leaders.len() as u8;
        for (index, message) in state.network.iter().enumerate() {
            // Equal messages lead to equal states: try the first of a run only.
            if index > 0 && state.network[index - 1] == *message {
                continue;
            }
            let index = index as u8;
            match message {
                Message::Ask { .. } => {
                    for leader in 0..leaders {
                        actions.push(Action::RoundTrip { index, leader });
                        if !healed {
                            // Served now, answered later (or never).
                            actions.push(Action::Deliver { index, leader });
                        }
                    }
                    if !healed && state.duplicates > 0 {
                        actions.push(Action::Duplicate(index));
                    }
                }
                Message::Answer { .. } => actions.push(Action::Deliver { index, leader: 0 }),
            }
            if !healed && state.losses > 0 {
                actions.push(Action::Lose(index));
            }
        }
        if !healed && state.failovers > 0 {
            actions.push(Action::FailOver);
        }
        if !healed && state.restarts > 0 {
            for r in 0..state.regions.len() {
                actions.push(Action::Restart(r as u8));
            }
        }
    }

    fn next_state(&self, last: &ModelState, action: Action) -> Option<ModelState> {
        let mut state = last.clone();
        match action {
            Action::Tick => self.tick(&mut state),
            Action::Spend(r) => self.spend(&mut state, usize::from(r)),
            Action::RoundTrip { index, leader } => {
                self.deliver(&mut state, usize::from(index), usize::from(leader), true)
            }
            Action::Deliver { index, leader } => {
                self.deliver(&mut state, usize::from(index), usize::from(leader), false)
            }
            Action::Lose(index) => {
                state.losses -= 1;
                state.network.remove(usize::from(index));
            }
            Action::Duplicate(index) => {
                state.duplicates -= 1;
                let copy = state.network[usize::from(index)].clone();
                state.network.push(copy);
                state.network.sort();
            }
            Action::FailOver => {
                state.failovers -= 1;
                self.fail_over(&mut state);
            }
            Action::Restart(r) => {
                state.restarts -= 1;
                self.restart(&mut state, usize::from(r));
            }
            Action::DenyRegionally(r) => {
                state.regional_denials -= 1;
                self.deny_regionally(&mut state, usize::from(r));
            }
            Action::Charge(r) => {
                state.charges -= 1;
                self.charge(&mut state, usize::from(r));
            }
            Action::RoundTripAll { leader } => {
                self.round_trip_all(&mut state, usize::from(leader));
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let always = |name, keeps: fn(&Self, &ModelState) -> bool| Property::always(name, keeps);
        let mut properties = vec![
            always(WITHIN_BOUND, |m, s| m.keeps(Breach::OverBound, s)),
            always(SPENT_IN_LEASE_LIFE, |m, s| {
                m.keeps(Breach::SpentPastLeaseEnd, s)
            }),
            always(SPENT_IN_WINDOW, |m, s| {
                m.keeps(Breach::SpentOutsideWindow, s)
            }),
            always(NO_STALE_EPOCH, |m, s| m.keeps(Breach::StaleEpochHeld, s)),
            always(DENIAL_DEBITS_NOTHING, |m, s| {
                m.keeps(Breach::DenialDebited, s)
            }),
            always(RESUMES_AFTER_HEAL, |m, s| {
                m.keeps(Breach::RenewalUnansweredAfterHeal, s)
            }),
            always(FALLBACK_WITHIN_ALLOWANCE, |m, s| {
                m.keeps(Breach::FallbackOverAllowance, s)
            }),
            Property::sometimes(REACHES_LIMIT, |model: &Self, state: &ModelState| {
                state
                    .admitted
                    .values()
                    .any(|&a| a >= model.config.limit_tokens)
            }),
            Property::sometimes(HOLDS_AFTER_FAILOVER, |_: &Self, state: &ModelState| {
                state
                    .regions
                    .iter()
                    .any(|r| r.highest_epoch_held > Epoch(1))
            }),
            Property::sometimes(ADMITS_IN_FALLBACK, |_: &Self, state: &ModelState| {
                state.regions.iter().any(|r| {
                    r.agent
                        .holder()
                        .snapshot(None)
                        .fallback
                        .iter()
                        .any(|f| f.admitted_tokens > 0)
                })
            }),
        ];
        properties.retain(|p| self.checks(p.name));
        properties
    }
}

impl LeaseModel {
    /// Whether `state` keeps the property `breach` would break.
    fn keeps(&self, breach: Breach, state: &ModelState) -> bool {
        !state.breached(breach)
            && (breach != Breach::OverBound
                || state.admitted.values().all(|&a| a <= self.bound_tokens))
    }

    /// Whether the property `name` is checked: all are, unless the model is
    /// [`checking_only`](Self::checking_only) one.
    fn checks(&self, name: &str) -> bool {
        self.only.is_none_or(|only| only == name)
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
