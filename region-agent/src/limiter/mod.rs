//! The regional limiter: every regional rule of a request (per user, per route, per tenant) decided in
//! one atomic store call, all debited or none.
//!
//! # Why it is shaped like this
//!
//! - **One call, one slot, one script (I1, I2).** All of a request's keys carry the tenant's hash tag
//!   `{t:<tenant>}` (from `allot_shared::keys`), so they live in one Redis Cluster slot and one Lua
//!   script reads them, decides every rule and writes all or nothing. Two requests racing for a last
//!   token are serialised by the shard; at most one gets it. Policy validation guarantees a request's
//!   rules fit one tag; [`RuleBatch`] refuses a key outside it rather than meet CROSSSLOT at runtime.
//! - **One semantics, two stores.** [`RedisStore`] runs the scripts; [`InProcessStore`] (the embedded
//!   default and the unit-test store) runs the pure core `allot_shared::limit::multi::decide_all`
//!   under a mutex. The scripts mirror the pure core field by field, and differential tests drive
//!   random requests, costs, parameter changes and clock steps through the pure core, the in-process
//!   store and the scripts on real Redis, requiring identical answers, states and expiries.
//! - **The store's clock.** The scripts read Redis `TIME`, never the caller's clock: gateway skew
//!   cannot influence refill. A clock that steps back never refills; one that jumps forward refills at
//!   most to full.
//! - **A denial writes nothing; there are no refunds (I4, I6).** A decision id names a decision
//!   record (for `idempotent` rules): a retry after a lost reply replays the recorded admission
//!   instead of debiting again. Failures are classified by what they tell about the script having run
//!   ([`StoreError`]); no path gives tokens back.
//! - **Every key expires (I7, I10).** Every write sets its key's TTL in the same script (the TTLs the
//!   pure functions compute: after it the missing key decides like the stored state would). The store
//!   deployment must use `maxmemory-policy noeviction`: an evicted key is a silently refilled bucket.
//!   A replica failover can lose recent writes, making a bucket fuller by at most its capacity (I7).
//!
//! # Map
//!
//! - [`batch`]: [`RuleBatch`], the validated unit of one store call, and [`plan_request`] from a
//!   policy bundle and an admission request.
//! - [`store`]: the [`LimiterStore`] seam, [`BatchDecision`], lease calls and [`StoreError`].
//! - `scripts/decide.lua`, `scripts/concurrency.lua`: the Lua, each documenting its KEYS/ARGV/reply
//!   contract; `scripts.rs` is the Rust half of those contracts.
//! - [`in_process`] and [`redis_store`]: the two stores.
//! - [`client`]: the client path, [`Limiter::decide`]: one deadline per decision, a bounded
//!   in-flight count and a [`breaker`] per shard, failures classified by phase, per-rule fail modes
//!   ([`fallback`] buckets for `local_bounded`, 503 for `closed`), the [`negative_cache`],
//!   [`hot_tenants`] over sub-slots and the pre-authentication [`cardinality`] cap.
//! - [`decision`]: a [`LimitDecision`] as the contract's `Decision`.
//! - [`Limiter::lease`]: concurrency slots (acquire, release, renew) through the same deadline,
//!   breaker and fail modes; the agent takes them before the store call and releases them on any
//!   denial.

pub mod batch;
mod bounded;
pub mod breaker;
pub mod cardinality;
pub mod client;
pub mod coalescing;
pub mod decision;
pub mod fallback;
pub mod hot_tenants;
pub mod in_process;
mod late_turn;
mod lua_inline;
pub mod negative_cache;
pub mod overload;
mod redis_calls;
pub mod redis_store;
mod scripts;
pub mod store;

#[cfg(test)]
mod tests;

pub use batch::{
    BatchError, BatchRule, CombineError, DEFAULT_DECISION_RECORD_TTL_MS, PlannedBatch, RuleBatch,
    RuleParams, combine_batches, plan_request,
};
pub use breaker::{BreakerConfig, BreakerSnapshot, BreakerState};
pub use cardinality::{CardinalityConfig, CardinalityRefusal, DEFAULT_SOURCE_PREFIXES, SourceId};
pub use client::LeaseOp;
pub use client::{
    DegradeCause, LimitDecision, Limiter, LimiterConfig, LimiterConfigError, LimiterStats,
    Screened, SubSlot, Verdict,
};
pub use decision::{Holding, algorithm_limit_units, concurrency_denial};
pub use fallback::FallbackDecision;
pub use hot_tenants::HotTenants;
pub use in_process::{DEFAULT_IN_PROCESS_MAX_KEYS, InProcessStore};
pub use negative_cache::CachedDenial;
pub use overload::{ConcurrencyConfig, MAX_WAITING_PER_SHARD, ShardLoad};
pub use redis_store::{RedisStore, RedisStoreConfig, RedisTls, StateLayout};
pub use scripts::{decide_library, decide_reply_admits};
pub use store::{BatchDecision, LeaseCall, LeaseOutcome, LimiterStore, Rejection, StoreError};
