//! The agent's settings and their shipped defaults.

use std::time::Duration;

use allot_shared::ids::{AgentId, RegionId};
use allot_shared::keys::{IpPrefixes, Pepper};

/// Longest a request waits for the first grant of a pool it triggered (or for the lookup of its
/// terms); also how long a renewal may go unanswered before the allocator counts as unreachable
/// (fallback starts then).
pub const FIRST_GRANT_WAIT: Duration = Duration::from_millis(200);
/// Tokens are never spent within this many ms of a lease's end (clock-rate error between the agent
/// and the allocator): the shipped default.
pub const DEFAULT_EXPIRY_MARGIN_MS: u64 = 50;

/// The most an agent's clock may be off the allocator's, ms, unless configured: hosts kept by NTP
/// are within a few ms; this leaves room for a stepped clock. No fallback is admitted within it of
/// a window's edges.
pub const DEFAULT_CLOCK_MARGIN_MS: u64 = 100;
/// The largest clock margin an agent accepts, ms: beyond it, fallback windows of seconds would
/// never open, and a clock that far off needs fixing, not a margin.
pub const MAX_CLOCK_MARGIN_MS: u64 = 10_000;

/// The agent's settings.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    /// This agent's region.
    pub region: RegionId,
    /// This agent's id, for policy status.
    pub agent_id: AgentId,
    /// The HMAC pepper of principal keys.
    pub pepper: Pepper,
    /// Prefix lengths of anonymous principals.
    pub ip_prefixes: IpPrefixes,
    /// Retention of decision records for idempotent rules, ms.
    pub decision_record_ttl_ms: u64,
    /// Safety margin before a lease's end, ms.
    pub expiry_margin_ms: u64,
    /// The most this agent's clock may be off the allocator's, ms: no fallback within it of a
    /// window's edges.
    pub clock_margin_ms: u64,
    /// An estimate of the allocator round trip, ms (sizes the renewal watermark).
    pub allocator_round_trip_ms: u64,
    /// Once the bundle has not been confirmed by the allocator for this long, rules marked `strict`
    /// fail closed (I13). 0: never. Applies only to bundles that come from an allocator.
    pub policy_max_age_ms: u64,
    /// Agents serving this region (at least 1): each applies `fallbackPerRegion / region_agents`
    /// tokens per window in a partition, so the region's agents together stay within the pool's
    /// allowance (the bound's fallback term is per region, not per agent process).
    pub region_agents: u64,
    /// How long a metered admission may be settled after it was decided, ms (at most
    /// [`MAX_SETTLE_WINDOW_MS`]); past it the estimate stands.
    pub settle_window_ms: u64,
    /// Most pools held at once (I10): a request for one more pool fails as its rule's fail mode
    /// says until an idle pool is forgotten.
    pub max_pools: usize,
}

/// The most pools an agent holds unless told otherwise (`--max-pools`).
pub const DEFAULT_MAX_POOLS: usize = 10_000;
/// The most pools an agent may be told to hold.
pub const MAX_MAX_POOLS: usize = 1_000_000;

/// The shipped settle window, ms: long enough for a slow streamed response.
pub const DEFAULT_SETTLE_WINDOW_MS: u64 = 300_000;
/// The longest settle window an agent accepts, ms (I10: open settlements are held in memory).
pub const MAX_SETTLE_WINDOW_MS: u64 = 3_600_000;

/// The allocator round trip the shipped binary sizes renewals with, ms.
pub const DEFAULT_ALLOCATOR_ROUND_TRIP_MS: u64 = 20;

impl AgentSettings {
    /// Settings of agent `agent_id` in `region` keying principals with `pepper`, everything else at
    /// its shipped default: /32 and /64 address keys, decision records for
    /// [`DEFAULT_DECISION_RECORD_TTL_MS`](crate::limiter::DEFAULT_DECISION_RECORD_TTL_MS), the
    /// [`DEFAULT_EXPIRY_MARGIN_MS`] and [`DEFAULT_CLOCK_MARGIN_MS`] margins, a [`DEFAULT_ALLOCATOR_ROUND_TRIP_MS`] round trip, a
    /// bundle that never ages, one agent in the region.
    pub fn new(region: RegionId, agent_id: AgentId, pepper: Pepper) -> Self {
        Self {
            region,
            agent_id,
            pepper,
            ip_prefixes: IpPrefixes::default(),
            decision_record_ttl_ms: crate::limiter::DEFAULT_DECISION_RECORD_TTL_MS,
            expiry_margin_ms: DEFAULT_EXPIRY_MARGIN_MS,
            clock_margin_ms: DEFAULT_CLOCK_MARGIN_MS,
            allocator_round_trip_ms: DEFAULT_ALLOCATOR_ROUND_TRIP_MS,
            policy_max_age_ms: 0,
            region_agents: 1,
            settle_window_ms: DEFAULT_SETTLE_WINDOW_MS,
            max_pools: DEFAULT_MAX_POOLS,
        }
    }
}

/// Retry hint of a concurrency denial, ms: a slot frees when a holder finishes, at no known time.
pub const CONCURRENCY_RETRY_MS: u64 = 1_000;
/// Retry hint when the request cannot be evaluated (no bundle, a policy error), ms.
pub const POLICY_UNAVAILABLE_RETRY_MS: u64 = 1_000;
/// Retry hint of a request that found too little held while a renewal was under way, ms.
pub const AWAITING_GRANT_RETRY_MS: u64 = 100;
/// Largest random delay added to the retry hint of a denial at a window's edge or after a pool ran
/// out, ms (I5): clients denied in the same instant do not all return in the same instant.
pub const RETRY_JITTER_MAX_MS: u64 = 1_000;
