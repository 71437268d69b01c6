//! The agent service: one admission decision per gateway request, from memory and one regional store
//! call, plus the background work that keeps leases, reports and the policy bundle fresh.
//!
//! - [`admission`]: the request path (refusals from memory, global reservations, regional rules,
//!   settle; the order and why are in its docs).
//! - [`quota`]: the caller's own quotas and what is left of them (`GET /v1/quota`).
//! - [`pools`]: the pools held (one `PoolHolder` each) and the single-flight lookup of their terms.
//! - [`upkeep`]: renewals, and pool upkeep (idle pools forgotten, terms refreshed).
//! - [`reports`]: what the holders owe the ledger, sent per (pool, window).
//! - [`background`]: the loops that run reports and upkeep, and policy refresh.
//! - [`persistence`]: the state directory: restore at start, the journal, durable fallback
//!   claims.
//! - [`replays`]: admitted idempotent requests, answered again to a retry rather than decided
//!   again on any tier.
//! - [`settlement`]: metered admissions settled after the response (`POST /v1/settle`), and the
//!   debt of extra cost the next admissions pay first.
//! - [`subleases`]: assignments carved for gateways that enforce quota themselves (Envoy's RLQS).
//! - [`together`]: several requests decided all or none (an Envoy call's descriptors).
//! - [`settings`]: the agent's settings and their defaults.
//! - `terms`: what a pool's terms become in this agent (its holder's configuration).

pub mod admission;
pub mod background;
mod bundle;
mod global_holds;
pub mod persistence;
pub mod pools;
pub mod quota;
mod regional;
pub mod replays;
pub mod reports;
mod session;
pub mod settings;
pub mod settlement;
mod settlements;
mod sublease_demand;
pub mod subleases;
mod terms;
pub mod together;
pub mod upkeep;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use allot_shared::policy::PolicyBundle;

pub use admission::SlotRenewal;
pub use background::{FINAL_REPORT_TIMEOUT, ROUND_TIMEOUT};
pub use persistence::{CLAIM_WRITE_TIMEOUT, FALLBACK_CLAIM_BLOCKS, JOURNAL_INTERVAL, Restored};
pub use pools::{
    MAX_TERMS_REFRESH_PER_ROUND, POOL_IDLE_MS, TERMS_REFRESH_MS, TERMS_RETRY_MS,
    UNKNOWN_POOL_RETRY_MS,
};
pub use settings::{
    AWAITING_GRANT_RETRY_MS, AgentSettings, CONCURRENCY_RETRY_MS, DEFAULT_ALLOCATOR_ROUND_TRIP_MS,
    DEFAULT_CLOCK_MARGIN_MS, DEFAULT_EXPIRY_MARGIN_MS, DEFAULT_MAX_POOLS, FIRST_GRANT_WAIT,
    MAX_MAX_POOLS, POLICY_UNAVAILABLE_RETRY_MS, RETRY_JITTER_MAX_MS,
};

use crate::allocator_client::AllocatorClient;
use crate::clock::Clock;
use crate::limiter::Limiter;

/// Why a request could not even be decided: the field at fault.
pub type RequestRejected = allot_shared::FieldError;

/// The agent.
pub struct Agent {
    settings: AgentSettings,
    clock: Arc<dyn Clock>,
    bundle: bundle::BundleSlot,
    limiter: Limiter,
    allocator: Option<Arc<AllocatorClient>>,
    /// The pools held and their lookups.
    pools: pools::PoolRegistry,
    /// Where the next report round starts, so a round cut short does not starve the same pools.
    report_cursor: AtomicUsize,
    reachable: AtomicBool,
    /// Whether this run has warned that its clock is beyond the clock margin (once a run).
    clock_warned: AtomicBool,
    /// The sampled decision log, when configured.
    /// Set once at startup; read lock-free on every admit.
    decision_log: std::sync::OnceLock<crate::decision_log::DecisionLog>,
    decision_counters: crate::metrics::DecisionCounters,
    /// The state directory and the journal's bookkeeping, when configured.
    persistence: persistence::Persistence,
    /// What gateways' sub-leases want of each pool.
    subleases: Mutex<sublease_demand::SubleaseDemand>,
    /// Metered admissions open for settlement, and principals owing regional debt.
    settlements: Mutex<settlements::Settlements>,
    /// Admitted idempotent requests, answered again to their retries.
    replays: replays::Replays,
    /// This run, as the allocator knows it.
    session: session::Session,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Agent {
    /// An agent deciding with `limiter`, taking leases from `allocator` (none: no global rules can be
    /// served), starting with `bundle` if given.
    pub fn new(
        settings: AgentSettings,
        clock: Arc<dyn Clock>,
        limiter: Limiter,
        allocator: Option<Arc<AllocatorClient>>,
        bundle: Option<PolicyBundle>,
    ) -> Arc<Self> {
        Arc::new(Self {
            bundle: bundle::BundleSlot::new(bundle, clock.now_ms()),
            session: session::Session::new(clock.now_ms(), rand::random()),
            settings,
            clock,
            limiter,
            allocator,
            pools: pools::PoolRegistry::default(),
            report_cursor: AtomicUsize::new(0),
            reachable: AtomicBool::new(true),
            clock_warned: AtomicBool::new(false),
            decision_log: std::sync::OnceLock::new(),
            decision_counters: crate::metrics::DecisionCounters::default(),
            persistence: persistence::Persistence::default(),
            subleases: Mutex::new(sublease_demand::SubleaseDemand::default()),
            settlements: Mutex::new(settlements::Settlements::default()),
            replays: replays::Replays::default(),
        })
    }

    /// Starts logging sampled decisions to `log`. Once per agent: a second log is refused (and
    /// warned about), never swapped in under running requests.
    pub fn set_decision_log(&self, log: crate::decision_log::DecisionLog) {
        if self.decision_log.set(log).is_err() {
            tracing::warn!("a decision log is already set; the new one is ignored");
        }
    }

    /// Now on the agent's clock, epoch ms.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The bundle in force.
    pub fn bundle(&self) -> Option<Arc<PolicyBundle>> {
        self.bundle.load()
    }

    /// Installs `candidate` if it is newer than the bundle in force (only higher versions, I13).
    pub fn offer_bundle(&self, candidate: PolicyBundle) -> bool {
        self.bundle.offer(candidate, self.clock.now_ms())
    }

    /// Takes `set` (verified) if it is newer than the override set held, and lays it over the
    /// bundle in force.
    pub fn offer_overrides(&self, set: allot_shared::overrides::OverrideSet) -> bool {
        self.bundle.offer_overrides(set, self.clock.now_ms())
    }

    /// Sets the gauges that describe the agent's state now (called at each metrics scrape).
    pub fn observe(&self) {
        use crate::limiter::BreakerState;
        for (shard, snapshot) in self.limiter.breakers().iter().enumerate() {
            let state = match snapshot.state {
                BreakerState::Closed => 0.0,
                BreakerState::HalfOpen => 1.0,
                BreakerState::Open => 2.0,
            };
            metrics::gauge!(crate::metrics::BREAKER_STATE, "shard" => shard.to_string()).set(state);
        }
        for (shard, load) in self.limiter.shard_loads().iter().enumerate() {
            let shard = shard.to_string();
            metrics::gauge!(crate::metrics::STORE_IN_FLIGHT_LIMIT, "shard" => shard.clone())
                .set(load.limit as f64);
            metrics::gauge!(crate::metrics::STORE_IN_FLIGHT, "shard" => shard.clone())
                .set(load.in_flight as f64);
            metrics::gauge!(crate::metrics::STORE_WAITING, "shard" => shard)
                .set(load.waiting as f64);
        }
        for (tenant, sub_slots) in self.limiter.hot_tenants().iter() {
            metrics::gauge!(crate::metrics::HOT_TENANT_SUB_SLOTS, "tenant" => tenant.to_string())
                .set(f64::from(sub_slots));
        }
        metrics::gauge!(crate::metrics::POLICY_VERSION).set(self.bundle.version() as f64);
        let installed = self.bundle.installed_at_ms();
        if installed > 0 {
            let age_ms = self.clock.now_ms().saturating_sub(installed);
            metrics::gauge!(crate::metrics::POLICY_AGE_SECONDS).set(age_ms as f64 / 1_000.0);
        }
        let stats = self.limiter.stats();
        for (path, count) in [
            ("decisions", stats.decisions),
            ("store_calls", stats.store_calls),
            ("store_retries", stats.store_retries),
            ("negative_cache_hits", stats.negative_cache_hits),
            ("cardinality_refusals", stats.cardinality_refusals),
            ("fallback", stats.fallback_decisions),
            ("unavailable", stats.unavailable),
            ("policy_errors", stats.policy_errors),
            ("breaker_refusals", stats.breaker_refusals),
            ("in_flight_exhausted", stats.pool_exhausted),
            ("shed", stats.shed),
            ("slow_calls", stats.slow_calls),
            ("breaker_failures", stats.breaker_failures),
            ("held_up", stats.held_up),
            ("coalesced", stats.coalesced_decisions),
            ("coalesced_calls", stats.coalesced_calls),
        ] {
            metrics::gauge!(crate::metrics::LIMITER_DECISIONS, "path" => path).set(count as f64);
        }
        metrics::gauge!(crate::metrics::ALLOCATOR_REACHABLE).set(if self.allocator_reachable() {
            1.0
        } else {
            0.0
        });
        let pools = self.pools.slots();
        let mut dropped = self.pools.dropped_reports_of_evicted();
        for ((tenant, pool), slot) in pools.iter() {
            let agent = lock(&slot.agent);
            let holder = agent.holder();
            dropped += holder.dropped_reports();
            metrics::gauge!(crate::metrics::TOKENS_STRANDED,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.stranded_tokens() as f64);
            metrics::gauge!(crate::metrics::FALLBACK_ALLOWANCE,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.config().fallback_per_region_tokens as f64);
            metrics::gauge!(crate::metrics::SETTLE_DEBT,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.debt_tokens() as f64);
            metrics::gauge!(crate::metrics::SETTLE_DEBT_LIMIT,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.config().settle_debt_tokens as f64);
        }
        metrics::gauge!(crate::metrics::POOLS_HELD).set(pools.len() as f64);
        drop(pools);
        let (open, debtors) = {
            let settlements = lock(&self.settlements);
            (settlements.open_count(), settlements.debtor_count())
        };
        metrics::gauge!(crate::metrics::OPEN_SETTLEMENTS).set(open as f64);
        metrics::gauge!(crate::metrics::REGIONAL_DEBTORS).set(debtors as f64);
        metrics::gauge!(crate::metrics::REPORT_LINES_DROPPED).set(dropped as f64);
    }

    /// Pools held now (with terms), and pools being looked up or recently not found.
    pub fn pool_counts(&self) -> (usize, usize) {
        self.pools.counts()
    }

    /// The regional limiter's counters.
    pub fn limiter_stats(&self) -> crate::limiter::LimiterStats {
        self.limiter.stats()
    }

    /// Whether the bundle in force is past its maximum age (strict rules then fail closed).
    pub fn bundle_is_stale(&self) -> bool {
        let max_age_ms = self.settings.policy_max_age_ms;
        if max_age_ms == 0 || self.allocator.is_none() {
            return false;
        }
        let confirmed = self.bundle.confirmed_at_ms();
        self.clock.now_ms().saturating_sub(confirmed) > max_age_ms
    }

    /// Notes what an allocator call said about reachability: any answer (a refusal too) means
    /// reachable; no answer, or a 5xx, means not (fallback then applies). The one place the flag
    /// is set.
    fn note_allocator<T>(&self, outcome: &Result<T, crate::allocator_client::ClientError>) {
        let reachable = outcome
            .as_ref()
            .map_or_else(|e| !e.is_unreachable(), |_| true);
        self.reachable.store(reachable, Ordering::Relaxed);
    }

    /// Pre-authentication requests count against the cardinality cap of their source: the coarse
    /// prefix of the client address (/24, /48), so the addresses one party controls share one count.
    /// Authenticated principals are not capped.
    fn source_of(
        &self,
        request: &allot_shared::contract::AdmissionRequest,
    ) -> Option<crate::limiter::SourceId> {
        use allot_shared::contract::PrincipalType;
        (request.principal.kind == PrincipalType::Ip).then(|| {
            crate::limiter::SourceId::for_address(
                &self.settings.pepper,
                &request.principal.id,
                crate::limiter::DEFAULT_SOURCE_PREFIXES,
            )
        })
    }

    /// Whether the allocator answered the last call.
    pub fn allocator_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }
}
