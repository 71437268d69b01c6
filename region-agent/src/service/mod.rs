//! The agent service: one admission decision per gateway request, from memory and one regional store
//! call, plus the background work that keeps leases, reports and the policy bundle fresh.
//!
//! - [`admission`]: the request path (refusals from memory, global reservations, regional rules,
//!   settle; the order and why are in its docs).
//! - [`quota`]: the caller's own quotas and what is left of them (`GET /v1/quota`).
//! - `regional` and `global_holds`: a request's regional rules and its global reservations, the
//!   steps admission runs.
//! - [`pools`]: the pools held (one `PoolAgent` each) and the single-flight lookup of their terms;
//!   `busy`: the pools the background rounds visit (touched since they last settled).
//! - [`upkeep`]: renewals, and pool upkeep (idle pools forgotten, terms refreshed).
//! - [`reports`]: what the holders owe the ledger, sent per (pool, window).
//! - [`background`]: the loops that run reports and upkeep, and policy refresh; `observe` the
//!   gauges set at each metrics scrape.
//! - [`persistence`]: the state directory: restore at start, the journal, durable fallback
//!   claims (the journal's bookkeeping, below the parts that note changes, in `journaling`).
//! - [`replays`]: admitted idempotent requests, answered again to a retry rather than decided
//!   again on any tier.
//! - [`settlement`]: metered admissions settled after the response (`POST /v1/settle`), and the
//!   debt of extra cost the next admissions pay first (the state behind it in `settlements`).
//! - [`subleases`]: assignments carved for gateways that enforce quota themselves (Envoy's RLQS),
//!   sized by what each subscription wants (`sublease_demand`).
//! - `bundle` and `session`: the policy bundle in force, and this run as the allocator knows it.
//! - [`together`]: several requests decided all or none (an Envoy call's descriptors).
//! - [`settings`]: the agent's settings and their defaults.
//! - `terms`: what a pool's terms become in this agent (its holder's configuration).
//!
//! This file is the composition: it declares the parts, the [`Agent`] holding them and builds
//! them; its own methods use only its own fields, so every part may call them.

pub mod admission;
pub mod background;
mod batch_queue;
mod bundle;
mod busy;
mod global_holds;
mod journaling;
mod observe;
pub mod persistence;
mod pool_slot;
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
    /// The state directory, when configured, and the journal's bookkeeping.
    journaling: journaling::Journaling,
    /// What gateways' sub-leases want of each pool.
    subleases: Mutex<sublease_demand::SubleaseDemand>,
    /// Metered admissions open for settlement, and principals owing regional debt.
    settlements: Mutex<settlements::Settlements>,
    /// Admitted idempotent requests, answered again to their retries.
    replays: replays::Replays,
    /// This run, as the allocator knows it.
    session: session::Session,
    /// Renewals waiting for the next call to the allocator.
    renewals: batch_queue::BatchQueue<upkeep::QueuedRenewal>,
    /// Whether the allocator lacks `POST /v1/reports/batch`.
    report_batch_route: crate::allocator_client::MissingRoute,
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
            journaling: journaling::Journaling::default(),
            subleases: Mutex::new(sublease_demand::SubleaseDemand::default()),
            settlements: Mutex::new(settlements::Settlements::default()),
            renewals: batch_queue::BatchQueue::default(),
            report_batch_route: crate::allocator_client::MissingRoute::default(),
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

    /// The regional limiter's counters.
    pub fn limiter_stats(&self) -> crate::limiter::LimiterStats {
        self.limiter.stats()
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
