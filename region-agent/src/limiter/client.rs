//! The client path: one call per request, [`Limiter::decide`], around a [`LimiterStore`], failing in
//! ways chosen in advance (the reference design's resilience chapter).
//!
//! # One decision, step by step
//!
//! 1. **Deadline.** The decision gets one deadline, `decision_budget` from now on the monotonic clock;
//!    every wait below ends by it. A wait whose timer fires takes what became ready in the same turn
//!    of the runtime (a reply, a free place; `late_turn.rs`): a thread held up past a deadline
//!    finds both due at once, and the timer alone must not decide.
//! 2. **Hot tenant.** A tenant configured with `k` sub-slots has its batch moved to one of them
//!    ([`hot_tenants`]).
//! 3. **Negative cache.** The same key set was denied less than `min(hint, 250 ms)` ago: deny from
//!    memory, no store call ([`negative_cache`](super::negative_cache)).
//! 4. **Cardinality.** A pre-authentication (`ip`) request whose source has created its quota of new
//!    keys this interval is denied, no store call ([`cardinality`](super::cardinality)).
//! 5. **Breaker.** The shard's circuit breaker is open: degrade at once ([`breaker`](super::breaker)).
//! 6. **In-flight bound.** A place among the shard's calls in flight ([`overload`](super::overload)):
//!    the bound follows the shard's reply latency (between `min_in_flight_per_shard` and
//!    `max_in_flight_per_shard`, cut while replies are slower than a third of the budget). A
//!    decision waits for one at most `acquire_wait`, and never so long that a call no longer fits in
//!    the budget; when more decisions wait than the shard serves in that time, it is shed at once.
//!    Either way nothing is sent, and the rules' fail modes answer: under overload the excess is
//!    refused early instead of timing out late.
//! 7. **The store call**, bounded by the deadline. Its failure is classified by phase
//!    ([`StoreError`]):
//!
//! | outcome | breaker | then |
//! | --- | --- | --- |
//! | a decision | success | answer it; a denial is remembered by the negative cache |
//! | `NotExecuted` (before send, refused, unreachable) | failure | degrade (nothing ran) |
//! | the store lost the function or script (`NOSCRIPT`, function not found) | | handled inside the store: load, retry once |
//! | `Rejected` (the script refused the arguments) | no verdict | `POLICY_ERROR` (503), no retry; logged as an error |
//! | `Ambiguous`, or the deadline passed after sending | failure | with a decision record: retry once, same decision id (the script replays a recorded admission); otherwise degrade |
//! | the deadline passed (or an `Ambiguous` reply came only after it: the store's own call timeout noticed first), but the shard answered some call within the last ten budgets, or the agent was held up (its timer fired half a budget late) | no verdict | as above: the shard is slow, not down; the in-flight bound is cut instead |
//! | `MalformedReply` | no verdict | degrade, no retry; logged as an error |
//! | `KeyCapReached` (in-process store full) | no verdict | degrade |
//!
//! An idempotent batch's first attempt gets half of the remaining budget, so a retry after a timeout
//! still has time; if the retry fails too, the decision reports the first attempt's ambiguity. After
//! an ambiguous failure without a record the script may have debited: the request is decided by the
//! fail modes anyway, accepting at most one extra unit, and **nothing is ever refunded** (I4, I6).
//!
//! # Degrading: per-rule fail modes
//!
//! When the store cannot decide, each rule's `failMode` says what happens; there is no unbounded
//! fail-open:
//! - any `closed` rule in the request: `LIMITER_UNAVAILABLE` (503) naming that rule, with a
//!   conservative retry hint (`unavailable_retry_ms`). Closed wins over `local_bounded`;
//! - all `local_bounded`: every rule's in-process bucket (local capacity and refill) decides, all or
//!   nothing, and the decision says `fallback: true` ([`fallback`](super::fallback)). If the bounded
//!   table of local buckets is full of buckets in use, the request is `LIMITER_UNAVAILABLE` too.
//!
//! # Shards
//!
//! Breakers and in-flight bounds are per shard as the store reports them
//! ([`LimiterStore::shard_count`], [`LimiterStore::shard_of`]): one for a single Redis or the
//! in-process store; one per master for a Redis Cluster (by the slot map read at connect), so a dead
//! master degrades only the tenants whose slots it owns. (That needs the cluster to keep serving
//! while a master is down: `cluster-require-full-coverage no` on the limiter's cluster.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_shared::contract::PrincipalType;
use allot_shared::limit::RetryAfter;
use allot_shared::policy::{FailMode, Scope};

use super::batch::{PlannedBatch, RuleBatch};
use super::breaker::{BreakerSnapshot, CircuitBreaker};
use super::cardinality::{CardinalityGuard, CardinalityRefusal, SourceId};
use super::fallback::{FallbackDecision, LocalBuckets, LocalRule};
use super::hot_tenants::{self, HotTenants};
use super::late_turn;
use super::negative_cache::{CachedDenial, NegativeCache};
use super::overload::{InFlightBound, NoSlot, ShardLoad, Slot};
use super::store::{BatchDecision, LimiterStore, StoreError};
use crate::clock::{MonotonicClock, SystemMonotonicClock, monotonic_now};

mod config;

pub use config::{
    DEFAULT_ACQUIRE_WAIT, DEFAULT_DECISION_BUDGET, DEFAULT_MAX_IN_FLIGHT_PER_SHARD,
    DEFAULT_UNAVAILABLE_RETRY_MS, LATENCY_TARGET_DIVISOR, LimiterConfig, LimiterConfigError,
    MAX_IN_FLIGHT_PER_SHARD, MAX_SHARDS, SLOW_NOT_DOWN_BUDGETS,
};

/// Why the store did not decide a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DegradeCause {
    /// The shard's breaker is open (nothing sent).
    BreakerOpen,
    /// No place among the shard's calls in flight within the wait (nothing sent).
    PoolExhausted,
    /// More decisions waited for the shard than it serves within the wait: refused at once
    /// (nothing sent).
    Shed,
    /// The store did not run the script: unreachable, refused, busy, redirected.
    NotExecuted,
    /// The call was sent and its outcome is unknown: the script may have debited.
    Ambiguous,
    /// The decision's deadline passed during the call (ambiguous too).
    DeadlineExceeded,
    /// The reply broke the script's contract (the script ran); a defect to alert on.
    MalformedReply,
    /// The in-process store holds its maximum of live keys.
    StoreFull,
}

/// A request's sub-slot, for a hot tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubSlot {
    /// The sub-slot, in `0..count`.
    pub index: u32,
    /// The tenant's sub-slot count `k`.
    pub count: u32,
}

/// What decided the request, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The store decided (possibly a replay of a recorded admission).
    Store(BatchDecision),
    /// Denied from the negative cache, without a store call.
    CachedDenial(CachedDenial),
    /// Denied by the pre-authentication cardinality cap, without a store call.
    CardinalityCapped {
        /// The first per-principal `ip` rule (the one the denial names).
        rule: usize,
        /// When the source may create keys again.
        refusal: CardinalityRefusal,
    },
    /// The store could not decide and every rule is `local_bounded`: the local buckets decided.
    Fallback(FallbackDecision),
    /// The store could not decide and `rule` fails closed (or its local bucket table is full).
    Unavailable {
        /// The rule that could not be decided.
        rule: usize,
        /// The retry hint, in ms.
        retry_ms: u64,
    },
    /// The policy cannot be evaluated: the script rejected the call, or the batch could not be
    /// built. A defect to alert on; never retried.
    PolicyError,
}

/// A request the limiter did not refuse from memory: what [`Limiter::decide_screened`] needs.
#[derive(Debug)]
pub struct Screened {
    /// A hot tenant's batch, spread to its sub-slot.
    spread: Option<RuleBatch>,
    sub_slot: Option<SubSlot>,
    /// When it was screened (the limiter's clock), for the negative cache.
    now_ms: u64,
}

impl Screened {
    /// The batch the store would decide for `planned`: a hot tenant's in its sub-slot, else the
    /// planned one.
    pub fn batch<'b>(&'b self, planned: &'b PlannedBatch<'_>) -> &'b RuleBatch {
        self.spread.as_ref().unwrap_or(&planned.batch)
    }
}

/// The client path's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitDecision {
    /// The decision.
    pub verdict: Verdict,
    /// Why the store did not decide, when it did not (`Fallback` and `Unavailable` verdicts).
    pub degraded: Option<DegradeCause>,
    /// Store calls made (0 to 2).
    pub store_calls: u8,
    /// The sub-slot the request went to, for a hot tenant.
    pub sub_slot: Option<SubSlot>,
}

impl LimitDecision {
    /// Whether the request may proceed.
    pub fn allowed(&self) -> bool {
        match &self.verdict {
            Verdict::Store(decision) => decision.allowed,
            Verdict::Fallback(decision) => decision.allowed,
            Verdict::CachedDenial(_)
            | Verdict::CardinalityCapped { .. }
            | Verdict::Unavailable { .. }
            | Verdict::PolicyError => false,
        }
    }

    /// Whether the local fallback decided (the contract's `fallback`).
    pub fn fallback(&self) -> bool {
        matches!(self.verdict, Verdict::Fallback(_))
    }
}

/// Counters of the client path, for metrics (monotonic totals since the limiter was made).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Calls to [`Limiter::decide`].
    pub decisions: u64,
    /// Store calls, retries included.
    pub store_calls: u64,
    /// Retries after an ambiguous failure (idempotent batches only).
    pub store_retries: u64,
    /// Denials served by the negative cache.
    pub negative_cache_hits: u64,
    /// Requests refused by the cardinality cap.
    pub cardinality_refusals: u64,
    /// Decisions made by local fallback buckets.
    pub fallback_decisions: u64,
    /// `LIMITER_UNAVAILABLE` answers.
    pub unavailable: u64,
    /// `POLICY_ERROR` answers.
    pub policy_errors: u64,
    /// Degraded decisions whose store was refused by an open breaker.
    pub breaker_refusals: u64,
    /// Degraded decisions that found no place in flight in time.
    pub pool_exhausted: u64,
    /// Degraded decisions shed at once: the shard's waiting line was full.
    pub shed: u64,
    /// Calls that overran their deadline while the shard answered others, or while this agent was
    /// held up (slow, not down: no breaker failure). A first attempt counted here may have been
    /// retried and decided.
    pub slow_calls: u64,
    /// Calls counted as failures against their shard's breaker: not executed, ambiguous, or past
    /// the deadline while the shard answered nothing else.
    pub breaker_failures: u64,
    /// Waits for a place in flight and store calls that ran out while this agent's own thread was
    /// held up: a wait that ended half the wait late, a call half the decision budget past its
    /// deadline (and at least 2 ms either way). Not the store's doing: an agent that counts many
    /// needs CPU (or fewer neighbours on its cores). A subset of `pool_exhausted` and `slow_calls`.
    pub held_up: u64,
    /// Decisions the store sent together in coalesced calls of more than one (a hot tenant's that
    /// arrived while its call was in flight); 0 for a store that sends every decision alone.
    pub coalesced_decisions: u64,
    /// The coalesced calls that carried them: `coalesced_decisions / coalesced_calls` is how
    /// many decisions share a call's fixed cost.
    pub coalesced_calls: u64,
}

#[derive(Debug, Default)]
struct Counters {
    decisions: AtomicU64,
    store_calls: AtomicU64,
    store_retries: AtomicU64,
    negative_cache_hits: AtomicU64,
    cardinality_refusals: AtomicU64,
    fallback_decisions: AtomicU64,
    unavailable: AtomicU64,
    policy_errors: AtomicU64,
    pool_exhausted: AtomicU64,
    shed: AtomicU64,
    slow_calls: AtomicU64,
    held_up: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// One shard's breaker and in-flight bound.
#[derive(Debug)]
struct Shard {
    breaker: CircuitBreaker,
    in_flight: InFlightBound,
    /// The shard's store-call latency histogram, registered on first use (after the recorder is
    /// installed) so the hot path neither formats nor allocates a label.
    latency: std::sync::OnceLock<metrics::Histogram>,
}

impl Shard {
    fn record_latency(&self, index: usize, seconds: f64) {
        self.latency
            .get_or_init(
                || metrics::histogram!(crate::metrics::STORE_SECONDS, "shard" => index.to_string()),
            )
            .record(seconds);
    }
}

/// Why a store call produced no decision.
enum CallFailure {
    Rejected,
    Degrade(DegradeCause),
}

/// The regional limiter's client path. See the module docs.
pub struct Limiter {
    store: Arc<dyn LimiterStore>,
    config: LimiterConfig,
    /// Breakers, negative-cache entries, fallback buckets and cardinality windows run on it.
    clock: Arc<dyn MonotonicClock>,
    shards: Vec<Shard>,
    negative_cache: NegativeCache,
    fallback: LocalBuckets,
    cardinality: CardinalityGuard,
    counters: Counters,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("config", &self.config)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

/// What to do with a concurrency lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// Take a slot (idempotent per lease id).
    Acquire,
    /// Extend a held slot.
    Renew,
    /// Give the slot back (idempotent).
    Release,
}

impl Limiter {
    /// A limiter over `store` on the runtime's monotonic clock.
    pub fn new(
        store: Arc<dyn LimiterStore>,
        config: LimiterConfig,
    ) -> Result<Self, LimiterConfigError> {
        Self::with_clock(store, config, Arc::new(SystemMonotonicClock::new()))
    }

    /// A limiter whose breakers, caches, fallback buckets and windows read `clock` (tests step it).
    /// Deadlines always run on the runtime's clock.
    pub fn with_clock(
        store: Arc<dyn LimiterStore>,
        config: LimiterConfig,
        clock: Arc<dyn MonotonicClock>,
    ) -> Result<Self, LimiterConfigError> {
        config.validate()?;
        let shard_count = store.shard_count().clamp(1, MAX_SHARDS);
        let shards = (0..shard_count)
            .map(|_| Shard {
                breaker: CircuitBreaker::new(config.breaker),
                in_flight: InFlightBound::new(config.concurrency()),
                latency: std::sync::OnceLock::new(),
            })
            .collect();
        Ok(Self {
            negative_cache: NegativeCache::new(
                config.negative_cache_ttl_ms,
                config.negative_cache_max_entries,
            ),
            fallback: LocalBuckets::new(config.fallback_max_buckets),
            cardinality: CardinalityGuard::new(config.cardinality),
            store,
            config,
            clock,
            shards,
            counters: Counters::default(),
        })
    }

    /// Acquires, renews or releases a concurrency lease, within one decision budget, through the
    /// same shard breaker and in-flight permits as decisions: an open breaker or a full shard
    /// answers `NotExecuted` at once (nothing sent), so a store outage costs lease calls no more
    /// than it costs decisions. Leases are idempotent by their id (acquire and release), so a
    /// caller may retry any of them.
    pub async fn lease(
        &self,
        op: LeaseOp,
        call: &super::store::LeaseCall,
    ) -> Result<super::store::LeaseOutcome, StoreError> {
        self.lease_until(op, call, monotonic_now() + self.config.decision_budget)
            .await
    }

    /// [`lease`](Self::lease), ending by `deadline` or the decision budget, whichever is first.
    pub async fn lease_until(
        &self,
        op: LeaseOp,
        call: &super::store::LeaseCall,
        deadline: tokio::time::Instant,
    ) -> Result<super::store::LeaseOutcome, StoreError> {
        let deadline = deadline.min(monotonic_now() + self.config.decision_budget);
        let shard_index = self.store.shard_of_key(call.key()) % self.shards.len();
        let Some(shard) = self.shards.get(shard_index) else {
            return Err(StoreError::NotExecuted {
                detail: "no shard for the lease key".to_owned(),
            });
        };
        let Some(breaker_call) = shard.breaker.admit(self.clock.elapsed_ms()) else {
            return Err(StoreError::NotExecuted {
                detail: "the shard's breaker is open".to_owned(),
            });
        };
        // Nothing sent without a place: the breaker call is dropped without a verdict.
        let slot =
            self.place_in_flight(shard, deadline)
                .await
                .map_err(|_| StoreError::NotExecuted {
                    detail: "the shard's in-flight calls are at their bound".to_owned(),
                })?;
        let sent = monotonic_now();
        let store = &self.store;
        let call_future = async {
            match op {
                LeaseOp::Acquire => store.acquire_lease(call).await,
                LeaseOp::Renew => store.renew_lease(call).await,
                LeaseOp::Release => store.release_lease(call).await,
            }
        };
        let result = late_turn::within(deadline, call_future)
            .await
            .unwrap_or_else(|| {
                Err(StoreError::Ambiguous {
                    detail: "the concurrency lease call missed its deadline".to_owned(),
                })
            });
        let slow = matches!(result, Err(StoreError::Ambiguous { .. }))
            && self.met_a_slow_shard(shard, shard_index, &slot, deadline);
        let now_ms = self.clock.elapsed_ms();
        // The verdicts of the decision path's table (module docs): a reply is a success; a call
        // not executed or ambiguous is a failure, unless it overran a slow shard; a rejection, a
        // malformed reply or a full in-process store say nothing about the store's health.
        match &result {
            Ok(_) => {
                slot.replied(monotonic_now().duration_since(sent));
                breaker_call.succeeded();
            }
            Err(StoreError::Ambiguous { .. }) if slow => {}
            Err(StoreError::NotExecuted { .. } | StoreError::Ambiguous { .. }) => {
                breaker_call.finally_failed(now_ms);
            }
            Err(
                StoreError::Rejected { .. }
                | StoreError::MalformedReply { .. }
                | StoreError::KeyCapReached { .. },
            ) => {}
        }
        result
    }

    /// Every shard's in-flight bound, by shard index.
    pub fn shard_loads(&self) -> Vec<ShardLoad> {
        self.shards
            .iter()
            .map(|shard| shard.in_flight.load())
            .collect()
    }

    /// The tenants spread over sub-slots.
    pub fn hot_tenants(&self) -> &HotTenants {
        &self.config.hot_tenants
    }

    /// Every shard's breaker, by shard index.
    pub fn breakers(&self) -> Vec<BreakerSnapshot> {
        let now_ms = self.clock.elapsed_ms();
        self.shards
            .iter()
            .map(|shard| shard.breaker.snapshot(now_ms))
            .collect()
    }

    /// The counters so far.
    pub fn stats(&self) -> LimiterStats {
        let c = &self.counters;
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        // Breaker verdicts are counted where they are made, by each shard's breaker.
        let breakers = self.breakers();
        let over_breakers = |count: fn(&BreakerSnapshot) -> u64| breakers.iter().map(count).sum();
        let (coalesced_decisions, coalesced_calls) = self.store.coalesced();
        LimiterStats {
            decisions: read(&c.decisions),
            store_calls: read(&c.store_calls),
            store_retries: read(&c.store_retries),
            negative_cache_hits: read(&c.negative_cache_hits),
            cardinality_refusals: read(&c.cardinality_refusals),
            fallback_decisions: read(&c.fallback_decisions),
            unavailable: read(&c.unavailable),
            policy_errors: read(&c.policy_errors),
            breaker_refusals: over_breakers(|breaker| breaker.refused_total),
            pool_exhausted: read(&c.pool_exhausted),
            shed: read(&c.shed),
            slow_calls: read(&c.slow_calls),
            breaker_failures: over_breakers(|breaker| breaker.failed_total),
            held_up: read(&c.held_up),
            coalesced_decisions,
            coalesced_calls,
        }
    }

    /// Decides a request's regional rules (module docs): [`screen`](Self::screen), then
    /// [`decide_screened`](Self::decide_screened). `source` groups pre-authentication requests for
    /// the cardinality cap ([`SourceId::for_address`]); without it the principal's own hash is its
    /// source.
    pub async fn decide(
        &self,
        planned: &PlannedBatch<'_>,
        source: Option<&SourceId>,
    ) -> LimitDecision {
        match self.screen(planned, source) {
            Ok(screened) => self.decide_screened(planned, screened).await,
            Err(denied) => denied,
        }
    }

    /// Everything the limiter can refuse from memory, before any store call and before the agent
    /// reserves anything elsewhere: a batch that does not match its rules, a hot tenant's batch
    /// that cannot be spread, the negative cache, and the pre-authentication cardinality cap.
    /// `Err` is the decision (a denial, with no store call); `Ok` goes on to
    /// [`decide_screened`](Self::decide_screened).
    pub fn screen(
        &self,
        planned: &PlannedBatch<'_>,
        source: Option<&SourceId>,
    ) -> Result<Screened, LimitDecision> {
        bump(&self.counters.decisions);
        let now_ms = self.clock.elapsed_ms();
        let refused = |verdict, sub_slot| LimitDecision {
            verdict,
            degraded: None,
            store_calls: 0,
            sub_slot,
        };
        if planned.rules.len() != planned.batch.rules().len() {
            tracing::error!(
                decision_id = %planned.batch.decision_id(),
                "a planned batch whose rules do not match its policy rules"
            );
            bump(&self.counters.policy_errors);
            return Err(refused(Verdict::PolicyError, None));
        }
        let (spread, sub_slot) = self.spread(planned)?;
        let batch = spread.as_ref().unwrap_or(&planned.batch);
        if let Some(hit) = self.negative_cache.check(batch, now_ms) {
            bump(&self.counters.negative_cache_hits);
            return Err(refused(Verdict::CachedDenial(hit), sub_slot));
        }
        if let Some((rule, refusal)) = self.check_cardinality(planned, batch, source, now_ms) {
            bump(&self.counters.cardinality_refusals);
            return Err(refused(
                Verdict::CardinalityCapped { rule, refusal },
                sub_slot,
            ));
        }
        Ok(Screened {
            spread,
            sub_slot,
            now_ms,
        })
    }

    /// A hot tenant's batch moved to its sub-slot (`None` for other tenants); `Err` is the
    /// decision when it cannot be spread (a policy error).
    fn spread(
        &self,
        planned: &PlannedBatch<'_>,
    ) -> Result<(Option<RuleBatch>, Option<SubSlot>), LimitDecision> {
        let Some(count) = self.config.hot_tenants.sub_slots(&planned.tenant) else {
            return Ok((None, None));
        };
        let index = hot_tenants::choose_sub_slot(planned, count);
        match hot_tenants::spread(planned, count, index) {
            Ok(moved) => Ok((Some(moved), Some(SubSlot { index, count }))),
            Err(error) => {
                tracing::error!(tenant = %planned.tenant, %error, "cannot spread a hot tenant's batch");
                bump(&self.counters.policy_errors);
                Err(LimitDecision {
                    verdict: Verdict::PolicyError,
                    degraded: None,
                    store_calls: 0,
                    sub_slot: None,
                })
            }
        }
    }

    /// Reads what a caller's rules hold now (`GET /v1/quota`): a [dry run](RuleBatch::into_dry_run)
    /// decided by the store (or, when it cannot, by the local fallback buckets), with neither the
    /// negative cache nor the pre-authentication key cap in front (a read creates no key and must
    /// see the store's numbers). Read the amounts with [`LimitDecision::holdings`].
    pub async fn read_holdings(&self, planned: &PlannedBatch<'_>) -> LimitDecision {
        debug_assert!(planned.batch.dry_run(), "a read must not write");
        let (spread, sub_slot) = match self.spread(planned) {
            Ok(spread) => spread,
            Err(refused) => return refused,
        };
        let screened = Screened {
            spread,
            sub_slot,
            now_ms: self.clock.elapsed_ms(),
        };
        self.decide_screened(planned, screened).await
    }

    /// Decides a screened request in one store call (with its breaker, permit, deadline and
    /// retry), or by the rules' fail modes when the store cannot decide.
    pub async fn decide_screened(
        &self,
        planned: &PlannedBatch<'_>,
        screened: Screened,
    ) -> LimitDecision {
        self.decide_screened_until(
            planned,
            screened,
            monotonic_now() + self.config.decision_budget,
        )
        .await
    }

    /// [`decide_screened`](Self::decide_screened), giving the store until `deadline` or the
    /// decision budget, whichever is first; past it the rules' fail modes answer, so a caller with
    /// less time left than a budget still gets `local_bounded` rules decided by their local
    /// buckets in time.
    pub async fn decide_screened_until(
        &self,
        planned: &PlannedBatch<'_>,
        screened: Screened,
        deadline: tokio::time::Instant,
    ) -> LimitDecision {
        let deadline = deadline.min(monotonic_now() + self.config.decision_budget);
        let Screened {
            spread,
            sub_slot,
            now_ms,
        } = screened;
        let batch = spread.as_ref().unwrap_or(&planned.batch);
        let answer = |verdict, degraded, store_calls| LimitDecision {
            verdict,
            degraded,
            store_calls,
            sub_slot,
        };
        let (result, store_calls) = self.call_store(batch, deadline).await;
        match result {
            Ok(decision) => {
                // A dry run changes nothing, the negative cache included.
                if !decision.allowed && !batch.dry_run() {
                    self.negative_cache.remember(batch, &decision, now_ms);
                }
                answer(Verdict::Store(decision), None, store_calls)
            }
            Err(CallFailure::Rejected) => {
                bump(&self.counters.policy_errors);
                answer(Verdict::PolicyError, None, store_calls)
            }
            Err(CallFailure::Degrade(cause)) => {
                let verdict = self.degrade(planned);
                answer(verdict, Some(cause), store_calls)
            }
        }
    }

    /// Decides a batch built from several screened requests' batches
    /// ([`combine_batches`](super::batch::combine_batches)) in one store call, all or nothing, by
    /// `deadline` or the decision budget, whichever is first; past it the rules' fail modes
    /// answer. The requests were screened one by one, so nothing is screened (or spread) again.
    pub async fn decide_combined_until(
        &self,
        combined: &PlannedBatch<'_>,
        deadline: tokio::time::Instant,
    ) -> LimitDecision {
        let screened = Screened {
            spread: None,
            sub_slot: None,
            now_ms: self.clock.elapsed_ms(),
        };
        self.decide_screened_until(combined, screened, deadline)
            .await
    }

    /// The longest one store decision may take (the per-decision deadline).
    pub fn decision_budget(&self) -> std::time::Duration {
        self.config.decision_budget
    }

    /// The cardinality cap for pre-authentication requests: `Some` when refused.
    fn check_cardinality(
        &self,
        planned: &PlannedBatch<'_>,
        batch: &RuleBatch,
        source: Option<&SourceId>,
        now_ms: u64,
    ) -> Option<(usize, CardinalityRefusal)> {
        if planned.principal_type != PrincipalType::Ip {
            return None;
        }
        let per_principal: Vec<usize> = planned
            .rules
            .iter()
            .enumerate()
            // Advisory rules never deny, the cap included.
            .filter(|(_, rule)| rule.scope == Scope::User && !rule.mode.is_advisory())
            .map(|(index, _)| index)
            .collect();
        let first = *per_principal.first()?;
        let source = source
            .map(SourceId::as_str)
            .or_else(|| planned.principal_hash.as_ref().map(|hash| hash.as_str()))?;
        let keys: Vec<&str> = per_principal
            .iter()
            .filter_map(|&index| batch.rules().get(index).map(|rule| rule.key()))
            .collect();
        let counted = if batch.dry_run() {
            self.cardinality.would_admit(source, &keys, now_ms)
        } else {
            self.cardinality.admit(source, &keys, now_ms)
        };
        counted.err().map(|refusal| (first, refusal))
    }

    /// Whether a call that ended ambiguous (or timed out) met a slow shard rather than a dead one
    /// (counted in `slow_calls`, no breaker failure). Only a call that ended past `call_deadline`
    /// overran: whichever timer noticed first, the deadline's or the store's own call timeout
    /// (which answers first when this thread ran late past both). An overrun cuts the shard's
    /// in-flight bound, and met a slow shard when the shard answered some call within the last
    /// [`SLOW_NOT_DOWN_BUDGETS`] budgets, or this agent was held up itself (its timer fired half a
    /// budget late or more: a stall says nothing of the shard). Otherwise the overrun is logged
    /// and counts against the breaker, as does an ambiguous call that ended in time.
    fn met_a_slow_shard(
        &self,
        shard: &Shard,
        shard_index: usize,
        slot: &Slot<'_>,
        call_deadline: tokio::time::Instant,
    ) -> bool {
        let now = monotonic_now();
        if now < call_deadline {
            return false;
        }
        slot.overran();
        let budget = self.config.decision_budget;
        let late = now.duration_since(call_deadline);
        let held_up = late_turn::was_held_up(late, budget);
        if held_up {
            bump(&self.counters.held_up);
        }
        let slow = held_up
            || shard
                .in_flight
                .answered_within(budget * SLOW_NOT_DOWN_BUDGETS);
        if slow {
            bump(&self.counters.slow_calls);
        } else {
            tracing::warn!(
                shard = shard_index,
                "a limiter call overran its deadline and the shard has not answered lately"
            );
        }
        slow
    }

    /// A place among the shard's calls in flight, waiting at most `acquire_wait` and never past the
    /// point where a call of the latency target would miss `deadline` (module docs, step 6).
    async fn place_in_flight<'s>(
        &self,
        shard: &'s Shard,
        deadline: tokio::time::Instant,
    ) -> Result<Slot<'s>, DegradeCause> {
        let wait = self.config.acquire_wait.min(
            deadline
                .saturating_duration_since(monotonic_now())
                .saturating_sub(self.config.latency_target()),
        );
        shard
            .in_flight
            .acquire(wait)
            .await
            .map_err(|refusal| match refusal {
                NoSlot::Shed => {
                    bump(&self.counters.shed);
                    DegradeCause::Shed
                }
                NoSlot::WaitedOut { held_up } => {
                    bump(&self.counters.pool_exhausted);
                    if held_up {
                        bump(&self.counters.held_up);
                    }
                    DegradeCause::PoolExhausted
                }
            })
    }

    /// The store call with its breaker, permit, deadline and retry (module docs).
    ///
    /// Long by design: the breaker call, the in-flight place and an earlier attempt's ambiguity
    /// live across every attempt of the loop, and what the breaker is told (success, a failure to
    /// retry, a final failure, or nothing for a slow shard or a policy fault) is decided per
    /// outcome in one match; split, those three would be passed into each piece and what the
    /// breaker hears would be read in several places.
    async fn call_store(
        &self,
        batch: &RuleBatch,
        deadline: tokio::time::Instant,
    ) -> (Result<BatchDecision, CallFailure>, u8) {
        let shard_index = self.store.shard_of(batch) % self.shards.len();
        let Some(shard) = self.shards.get(shard_index) else {
            return (Err(CallFailure::Degrade(DegradeCause::NotExecuted)), 0);
        };
        let Some(mut breaker_call) = shard.breaker.admit(self.clock.elapsed_ms()) else {
            return (Err(CallFailure::Degrade(DegradeCause::BreakerOpen)), 0);
        };
        // Nothing sent without a place: the breaker call is dropped without a verdict.
        let slot = match self.place_in_flight(shard, deadline).await {
            Ok(slot) => slot,
            Err(cause) => return (Err(CallFailure::Degrade(cause)), 0),
        };
        let max_calls: u8 = if batch.record_ttl_ms() > 0 { 2 } else { 1 };
        let mut calls: u8 = 0;
        // An earlier attempt's ambiguity: whatever the retry says, the script may have run once.
        let mut ambiguous: Option<DegradeCause> = None;
        loop {
            calls += 1;
            bump(&self.counters.store_calls);
            let now = monotonic_now();
            let call_deadline = if calls < max_calls {
                now + deadline.saturating_duration_since(now) / 2
            } else {
                deadline
            };
            // A reply read in the turn the deadline fired is taken (see `late_turn`).
            let result = late_turn::within(call_deadline, self.store.decide(batch)).await;
            let latency = monotonic_now().duration_since(now);
            shard.record_latency(shard_index, latency.as_secs_f64());
            let now_ms = self.clock.elapsed_ms();
            let degrade = |cause| (Err(CallFailure::Degrade(ambiguous.unwrap_or(cause))), calls);
            let cause = match result {
                Some(Ok(decision)) => {
                    slot.replied(latency);
                    breaker_call.succeeded();
                    return (Ok(decision), calls);
                }
                Some(Err(StoreError::Rejected { kind, detail })) => {
                    tracing::error!(decision_id = %batch.decision_id(), ?kind, %detail,
                        "the limiter script rejected a call: a policy fault");
                    return (Err(CallFailure::Rejected), calls);
                }
                Some(Err(StoreError::NotExecuted { detail })) => {
                    tracing::warn!(%detail, "limiter store did not execute the call; degrading");
                    breaker_call.finally_failed(now_ms);
                    return degrade(DegradeCause::NotExecuted);
                }
                Some(Err(StoreError::MalformedReply { detail })) => {
                    tracing::error!(decision_id = %batch.decision_id(), %detail,
                        "limiter script reply breaks its contract; degrading");
                    return degrade(DegradeCause::MalformedReply);
                }
                Some(Err(StoreError::KeyCapReached { max_keys })) => {
                    tracing::warn!(max_keys, "in-process limiter store is full; degrading");
                    return degrade(DegradeCause::StoreFull);
                }
                Some(Err(StoreError::Ambiguous { detail })) => {
                    tracing::warn!(decision_id = %batch.decision_id(), %detail, "ambiguous limiter call");
                    DegradeCause::Ambiguous
                }
                None => DegradeCause::DeadlineExceeded,
            };
            // Only `Ambiguous` and `DeadlineExceeded` get here.
            let slow = self.met_a_slow_shard(shard, shard_index, &slot, call_deadline);
            if calls < max_calls && monotonic_now() < deadline {
                // The same batch, so the same decision id: a recorded admission is replayed.
                ambiguous = Some(cause);
                if !slow {
                    breaker_call.failed(now_ms);
                }
                bump(&self.counters.store_retries);
                continue;
            }
            if !slow {
                breaker_call.finally_failed(now_ms);
            }
            return (Err(CallFailure::Degrade(cause)), calls);
        }
    }

    /// The per-rule fail modes, when the store could not decide: closed wins; otherwise every
    /// rule's local bucket decides. Shadow and soft rules take no part: they never deny, and an
    /// outage of their store must not either.
    fn degrade(&self, planned: &PlannedBatch<'_>) -> Verdict {
        let unavailable = |rule| {
            bump(&self.counters.unavailable);
            Verdict::Unavailable {
                rule,
                retry_ms: self.config.unavailable_retry_ms,
            }
        };
        let enforced: Vec<usize> = (0..planned.rules.len())
            .filter(|&index| {
                planned
                    .rules
                    .get(index)
                    .is_some_and(|rule| !rule.mode.is_advisory())
            })
            .collect();
        if let Some(&rule) = enforced
            .iter()
            .find(|&&index| planned.rules[index].fail_mode == FailMode::Closed)
        {
            return unavailable(rule);
        }
        let mut local = Vec::with_capacity(enforced.len());
        for &index in &enforced {
            let (Some(batch_rule), Some(rule)) =
                (planned.batch.rules().get(index), planned.rules.get(index))
            else {
                return unavailable(index);
            };
            let FailMode::LocalBounded(bucket) = &rule.fail_mode else {
                return unavailable(index);
            };
            local.push(LocalRule {
                key: batch_rule.key(),
                bucket,
                cost_millitokens: batch_rule.cost_millitokens(),
            });
        }
        let dry_run = planned.batch.dry_run();
        let decided = if local.is_empty() {
            // Only advisory rules: nothing may deny.
            Ok(FallbackDecision {
                allowed: true,
                denied_by: None,
                retry: RetryAfter::Ms(0),
                remaining: Vec::new(),
            })
        } else {
            self.fallback
                .decide(&local, self.clock.elapsed_ms(), dry_run)
        };
        match decided {
            Ok(decision) => {
                bump(&self.counters.fallback_decisions);
                Verdict::Fallback(decision.spread_over(&enforced, planned.rules.len()))
            }
            Err(full) => {
                tracing::warn!("local fallback table is full of buckets in use");
                unavailable(enforced.get(full.rule).copied().unwrap_or(0))
            }
        }
    }
}
