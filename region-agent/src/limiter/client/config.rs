//! The client path's budgets and bounds: their defaults, why each default is what it is, and the
//! checks a configuration passes before a [`Limiter`](super::Limiter) takes it.

use std::time::Duration;

use crate::limiter::breaker::BreakerConfig;
use crate::limiter::cardinality::CardinalityConfig;
use crate::limiter::fallback::DEFAULT_FALLBACK_MAX_BUCKETS;
use crate::limiter::hot_tenants::HotTenants;
use crate::limiter::negative_cache::{
    DEFAULT_NEGATIVE_CACHE_MAX_ENTRIES, DEFAULT_NEGATIVE_CACHE_TTL_MS,
};
use crate::limiter::overload::{ConcurrencyConfig, DEFAULT_MIN_IN_FLIGHT};

/// Default budget of one decision, from its start to its answer: below a gateway's own request
/// budget, and long enough for a round trip to a healthy regional Redis and one retry.
pub const DEFAULT_DECISION_BUDGET: Duration = Duration::from_millis(10);

/// Default longest wait for a place among a shard's calls in flight: two fifths of the default
/// budget, so a decision that waited still has room for its call (whose latency the bound keeps
/// near a third of the budget). Chosen on the overload bench's sweep
/// (`ALLOT_BENCH_OVERLOAD_SWEEP=1 ALLOT_BENCH_OVERLOAD_ONLY=1 cargo bench -p allot-region-agent
/// --bench limiter`, docs/limiter.md): with 2 ms, 0.4-1.3 % of the decisions offered at 0.5x and
/// 0.8x of the peak were answered unavailable; with 4 ms (and a floor of 64) 0.0-0.3 %, while at
/// 2x the goodput stayed 1.09x the peak and the p99 of decided calls 8.9 ms, within the budget
/// (6 ms took it past: 10.4 ms).
pub const DEFAULT_ACQUIRE_WAIT: Duration = Duration::from_millis(4);

/// Default most calls in flight per shard, where the adaptive bound starts. The Redis store
/// multiplexes them over one connection.
pub const DEFAULT_MAX_IN_FLIGHT_PER_SHARD: usize = 128;

/// The shard's replies should come within `decision_budget / LATENCY_TARGET_DIVISOR`; slower ones
/// cut its in-flight bound.
pub const LATENCY_TARGET_DIVISOR: u32 = 3;

/// A shard that answered some call within this many decision budgets is slow, not down, when a
/// call overruns: its overruns are no breaker failures. Ten budgets (100 ms by default): a
/// saturated agent or store can keep every reply past the budget for a few budgets in a row, and a
/// dead shard is cut off a tenth of a second later than it would be by counting every overrun. (On
/// the agent bench at 64 callers the breaker still opens in some runs after 100 ms without an
/// answer in time; what holds the replies up that long is not known yet.)
pub const SLOW_NOT_DOWN_BUDGETS: u32 = 10;

/// Most calls in flight per shard a configuration may ask for (I10).
pub const MAX_IN_FLIGHT_PER_SHARD: usize = 65_536;

/// Most shards the client keeps breakers for (I10).
pub const MAX_SHARDS: usize = 1_024;

/// Default retry hint of a `LIMITER_UNAVAILABLE` answer, in ms: conservative, about one breaker
/// cool-down.
pub const DEFAULT_UNAVAILABLE_RETRY_MS: u64 = 1_000;

/// The client path's budgets and bounds.
#[derive(Debug, Clone)]
pub struct LimiterConfig {
    /// One decision's deadline, from start to answer.
    pub decision_budget: Duration,
    /// Longest wait for a place among a shard's calls in flight before degrading.
    pub acquire_wait: Duration,
    /// Most calls in flight per shard, 1 to [`MAX_IN_FLIGHT_PER_SHARD`]: where the adaptive bound
    /// starts and what it never passes.
    pub max_in_flight_per_shard: usize,
    /// Least the adaptive bound goes down to, at least 1 (above `max_in_flight_per_shard`, that).
    pub min_in_flight_per_shard: usize,
    /// When a shard's breaker opens and how it recovers.
    pub breaker: BreakerConfig,
    /// Longest time a denial is served from memory, in ms (0 turns the negative cache off).
    pub negative_cache_ttl_ms: u64,
    /// Cap on the negative cache's key sets.
    pub negative_cache_max_entries: usize,
    /// Cap on local fallback buckets.
    pub fallback_max_buckets: usize,
    /// Retry hint of a `LIMITER_UNAVAILABLE` answer, in ms.
    pub unavailable_retry_ms: u64,
    /// The pre-authentication cardinality cap.
    pub cardinality: CardinalityConfig,
    /// Tenants spread over sub-slots.
    pub hot_tenants: HotTenants,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            decision_budget: DEFAULT_DECISION_BUDGET,
            acquire_wait: DEFAULT_ACQUIRE_WAIT,
            max_in_flight_per_shard: DEFAULT_MAX_IN_FLIGHT_PER_SHARD,
            min_in_flight_per_shard: DEFAULT_MIN_IN_FLIGHT,
            breaker: BreakerConfig::default(),
            negative_cache_ttl_ms: DEFAULT_NEGATIVE_CACHE_TTL_MS,
            negative_cache_max_entries: DEFAULT_NEGATIVE_CACHE_MAX_ENTRIES,
            fallback_max_buckets: DEFAULT_FALLBACK_MAX_BUCKETS,
            unavailable_retry_ms: DEFAULT_UNAVAILABLE_RETRY_MS,
            cardinality: CardinalityConfig::default(),
            hot_tenants: HotTenants::default(),
        }
    }
}

/// A configuration out of bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("limiter configuration: {0}")]
pub struct LimiterConfigError(pub &'static str);

impl LimiterConfig {
    /// Checks every bound.
    pub fn validate(&self) -> Result<(), LimiterConfigError> {
        if self.decision_budget.is_zero() {
            return Err(LimiterConfigError("decision_budget must be positive"));
        }
        if !(1..=MAX_IN_FLIGHT_PER_SHARD).contains(&self.max_in_flight_per_shard) {
            return Err(LimiterConfigError(
                "max_in_flight_per_shard must be in [1, 65536]",
            ));
        }
        if self.min_in_flight_per_shard == 0 {
            return Err(LimiterConfigError(
                "min_in_flight_per_shard must be at least 1",
            ));
        }
        if self.negative_cache_max_entries == 0 || self.fallback_max_buckets == 0 {
            return Err(LimiterConfigError(
                "negative_cache_max_entries and fallback_max_buckets must be at least 1",
            ));
        }
        self.breaker.validate().map_err(LimiterConfigError)?;
        self.cardinality.validate().map_err(LimiterConfigError)?;
        Ok(())
    }

    /// The latency a shard's replies should stay within: a share of the decision budget.
    pub(super) fn latency_target(&self) -> Duration {
        self.decision_budget / LATENCY_TARGET_DIVISOR
    }

    /// How the shards' in-flight bounds move.
    pub(super) fn concurrency(&self) -> ConcurrencyConfig {
        ConcurrencyConfig {
            latency_target: self.latency_target(),
            min_limit: self
                .min_in_flight_per_shard
                .min(self.max_in_flight_per_shard),
            max_limit: self.max_in_flight_per_shard,
        }
    }
}
