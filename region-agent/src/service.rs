//! The agent service: one admission decision per gateway request, from memory and one regional store
//! call, plus the background work that keeps leases, reports and the policy bundle fresh.
//!
//! # Order of a decision
//! 1. Validate the request; evaluate it against ONE bundle snapshot (its version is in the decision).
//! 2. **Global rules first**: spend from the pool's leases in memory ([`crate::global`]). A denial
//!    here costs no store call. When a global rule admits and a later rule denies, the global token
//!    is spent and reported as spent: accounted for (it counts towards `admitted` in the ledger, the
//!    conservative side of the bound), never refunded.
//! 3. **Regional rules** in one atomic store call ([`crate::limiter::Limiter::decide`]).
//!
//! The allocator is never called on the request path except when a pool has no lease at all yet (the
//! first request waits up to [`FIRST_GRANT_WAIT`] for the renewal it triggered).

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_shared::contract::{AdmissionRequest, Decision, DeniedScope, PrincipalType, Reason};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper};
use allot_shared::policy::{Limit, PolicyBundle, Rule};
use allot_shared::window::Window;
use arc_swap::ArcSwapOption;
use tokio::sync::Notify;

use crate::allocator_client::{AllocatorClient, PoolTerms, ReportBody, ReportLease};
use crate::clock::Clock;
use crate::global::{
    Denial, GrantVerdict, HolderConfig, LeaseGrant, PendingReport, PoolHolder, Spend,
};
use crate::limiter::{
    DEFAULT_SOURCE_PREFIXES, LeaseCall, LeaseOp, Limiter, SourceId, plan_request,
};

/// Longest a request waits for the first grant of a pool it triggered.
pub const FIRST_GRANT_WAIT: Duration = Duration::from_millis(200);
/// Tokens are never spent within this many ms of a lease's end (clock-rate error between the agent
/// and the allocator): the shipped default.
pub const DEFAULT_EXPIRY_MARGIN_MS: u64 = 50;
/// Retry hint of a concurrency denial, ms: a slot frees when a holder finishes, at no known time.
pub const CONCURRENCY_RETRY_MS: u64 = 1_000;
/// Most pools an agent holds at once (I10).
pub const MAX_POOLS: usize = 10_000;
/// After a pool's terms could not be fetched (allocator unreachable), requests for it fail closed
/// from memory for this long, ms, instead of each calling the allocator again.
pub const TERMS_RETRY_MS: u64 = 1_000;
/// After the allocator said a pool does not exist, requests for it are denied from memory for this
/// long, ms.
pub const UNKNOWN_POOL_RETRY_MS: u64 = 5_000;
/// A held pool's terms are fetched again at most this often, ms (a pool update reaches the agent
/// within about this long).
pub const TERMS_REFRESH_MS: u64 = 30_000;
/// Most pool terms fetched again in one upkeep round (the rest wait for the next round).
pub const MAX_TERMS_REFRESH_PER_ROUND: usize = 64;
/// A pool with no demand for this long, and nothing held or owed, is forgotten, ms.
pub const POOL_IDLE_MS: u64 = 600_000;
/// Longest one round of background work (reports, or policy and pool upkeep) may take; a round cut
/// short loses nothing (unacknowledged report lines stay pending).
pub const ROUND_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest the last round of reports at shutdown may take.
pub const FINAL_REPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The agent's settings.
#[derive(Debug, Clone)]
pub struct AgentSettings {
    /// This agent's region.
    pub region: RegionId,
    /// This agent's id, for policy status.
    pub agent_id: String,
    /// The HMAC pepper of principal keys.
    pub pepper: Pepper,
    /// Prefix lengths of anonymous principals.
    pub ip_prefixes: IpPrefixes,
    /// Retention of decision records for idempotent rules, ms.
    pub decision_record_ttl_ms: u64,
    /// Safety margin before a lease's end, ms.
    pub expiry_margin_ms: u64,
    /// An estimate of the allocator round trip, ms (sizes the renewal watermark).
    pub allocator_round_trip_ms: u64,
    /// Once the bundle has not been confirmed by the allocator for this long, rules marked `strict`
    /// fail closed (I13). 0: never. Applies only to bundles that come from an allocator.
    pub policy_max_age_ms: u64,
    /// Agents serving this region (at least 1): each applies `fallbackPerRegion / region_agents`
    /// tokens per window in a partition, so the region's agents together stay within the pool's
    /// allowance (the bound's fallback term is per region, not per agent process).
    pub region_agents: u64,
}

/// The allocator round trip the shipped binary sizes renewals with, ms.
pub const DEFAULT_ALLOCATOR_ROUND_TRIP_MS: u64 = 20;

impl AgentSettings {
    /// Settings of agent `agent_id` in `region` keying principals with `pepper`, everything else at
    /// its shipped default: /32 and /64 address keys, decision records for
    /// [`DEFAULT_DECISION_RECORD_TTL_MS`](crate::limiter::DEFAULT_DECISION_RECORD_TTL_MS), the
    /// [`DEFAULT_EXPIRY_MARGIN_MS`] margin, a [`DEFAULT_ALLOCATOR_ROUND_TRIP_MS`] round trip, a
    /// bundle that never ages, one agent in the region.
    pub fn new(region: RegionId, agent_id: String, pepper: Pepper) -> Self {
        Self {
            region,
            agent_id,
            pepper,
            ip_prefixes: IpPrefixes::default(),
            decision_record_ttl_ms: crate::limiter::DEFAULT_DECISION_RECORD_TTL_MS,
            expiry_margin_ms: DEFAULT_EXPIRY_MARGIN_MS,
            allocator_round_trip_ms: DEFAULT_ALLOCATOR_ROUND_TRIP_MS,
            policy_max_age_ms: 0,
            region_agents: 1,
        }
    }
}

/// Why a request could not even be decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct RequestRejected {
    /// The field at fault.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

struct PoolSlot {
    holder: Mutex<PoolHolder>,
    /// `G` of the terms in force, tokens (read on every global denial).
    limit: AtomicU64,
    /// The terms in force and when they were last fetched, epoch ms.
    terms: Mutex<(PoolTerms, u64)>,
    renewed: Notify,
    /// Set (under the holder's lock) when the slot is forgotten: a request that still holds it
    /// looks the pool up again instead of spending on a holder nobody reports.
    evicted: AtomicBool,
}

impl PoolSlot {
    fn new(config: HolderConfig, terms: PoolTerms, fetched_at_ms: u64) -> Self {
        Self {
            holder: Mutex::new(PoolHolder::new(config)),
            limit: AtomicU64::new(terms.limit),
            terms: Mutex::new((terms, fetched_at_ms)),
            renewed: Notify::new(),
            evicted: AtomicBool::new(false),
        }
    }
}

/// A pool whose terms the agent does not hold.
enum Lookup {
    /// Being fetched; the sender is dropped when the fetch ends (single flight).
    Fetching(tokio::sync::watch::Receiver<()>),
    /// Could not be had; requests fail closed from memory until then, epoch ms.
    Missing { retry_at_ms: u64 },
}

type PoolKey = (TenantId, PoolId);

/// The pools an agent holds, by tenant then pool: a request finds its pool from the ids it already
/// has, without building (allocating) a key.
#[derive(Default)]
struct PoolSlots {
    by_tenant: HashMap<TenantId, HashMap<PoolId, Arc<PoolSlot>>>,
    len: usize,
}

impl PoolSlots {
    fn get(&self, tenant: &TenantId, pool: &PoolId) -> Option<&Arc<PoolSlot>> {
        self.by_tenant.get(tenant)?.get(pool)
    }

    fn len(&self) -> usize {
        self.len
    }

    /// The slot of `key`, made by `make` when absent.
    fn get_or_insert_with(&mut self, key: PoolKey, make: impl FnOnce() -> Arc<PoolSlot>) {
        let pools = self.by_tenant.entry(key.0).or_default();
        if let std::collections::hash_map::Entry::Vacant(vacant) = pools.entry(key.1) {
            vacant.insert(make());
            self.len += 1;
        }
    }

    fn remove(&mut self, (tenant, pool): &PoolKey) {
        let Some(pools) = self.by_tenant.get_mut(tenant) else {
            return;
        };
        if pools.remove(pool).is_some() {
            self.len -= 1;
        }
        if pools.is_empty() {
            self.by_tenant.remove(tenant);
        }
    }

    fn iter(&self) -> impl Iterator<Item = ((&TenantId, &PoolId), &Arc<PoolSlot>)> {
        self.by_tenant.iter().flat_map(|(tenant, pools)| {
            pools.iter().map(move |(pool, slot)| ((tenant, pool), slot))
        })
    }

    /// Every slot with its key, for work done outside the lock.
    fn snapshot(&self) -> Vec<(PoolKey, Arc<PoolSlot>)> {
        self.iter()
            .map(|((tenant, pool), slot)| ((tenant.clone(), pool.clone()), slot.clone()))
            .collect()
    }
}

/// The agent.
pub struct Agent {
    settings: AgentSettings,
    clock: Arc<dyn Clock>,
    bundle: ArcSwapOption<PolicyBundle>,
    limiter: Limiter,
    allocator: Option<Arc<AllocatorClient>>,
    pools: Mutex<PoolSlots>,
    /// Pools being looked up, or recently not found (at most [`MAX_POOLS`]).
    lookups: Mutex<HashMap<PoolKey, Lookup>>,
    /// Report lines dropped by holders since forgotten (the live ones count their own).
    dropped_reports_of_evicted: AtomicU64,
    /// Where the next report round starts, so a round cut short does not starve the same pools.
    report_cursor: AtomicUsize,
    reachable: AtomicBool,
    /// When the bundle in force was installed, epoch ms (0: none).
    bundle_installed_at_ms: std::sync::atomic::AtomicU64,
    /// When the allocator last confirmed the bundle in force (installed it, or answered the same or
    /// an older version), epoch ms.
    bundle_confirmed_at_ms: std::sync::atomic::AtomicU64,
    /// The sampled decision log, when configured.
    /// Set once at startup; read lock-free on every admit.
    decision_log: std::sync::OnceLock<crate::decision_log::DecisionLog>,
    decision_counters: crate::metrics::DecisionCounters,
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
        let installed_at_ms = if bundle.is_some() { clock.now_ms() } else { 0 };
        Arc::new(Self {
            bundle_installed_at_ms: std::sync::atomic::AtomicU64::new(installed_at_ms),
            bundle_confirmed_at_ms: std::sync::atomic::AtomicU64::new(installed_at_ms),
            settings,
            clock,
            bundle: ArcSwapOption::from(bundle.map(Arc::new)),
            limiter,
            allocator,
            pools: Mutex::new(PoolSlots::default()),
            lookups: Mutex::new(HashMap::new()),
            dropped_reports_of_evicted: AtomicU64::new(0),
            report_cursor: AtomicUsize::new(0),
            reachable: AtomicBool::new(true),
            decision_log: std::sync::OnceLock::new(),
            decision_counters: crate::metrics::DecisionCounters::default(),
        })
    }

    /// Starts logging sampled decisions to `log`. Once per agent: a second log is refused (and
    /// warned about), never swapped in under running requests.
    pub fn set_decision_log(&self, log: crate::decision_log::DecisionLog) {
        if self.decision_log.set(log).is_err() {
            tracing::warn!("a decision log is already set; the new one is ignored");
        }
    }

    /// The bundle in force.
    pub fn bundle(&self) -> Option<Arc<PolicyBundle>> {
        self.bundle.load_full()
    }

    /// Installs `candidate` if it is newer than the bundle in force (only higher versions, I13).
    pub fn offer_bundle(&self, candidate: PolicyBundle) -> bool {
        let current = self.bundle.load_full();
        if current
            .as_ref()
            .is_some_and(|c| !c.is_superseded_by(&candidate))
        {
            return false;
        }
        tracing::info!(version = candidate.version(), "policy bundle installed");
        self.bundle.store(Some(Arc::new(candidate)));
        self.bundle_installed_at_ms
            .store(self.clock.now_ms(), Ordering::Relaxed);
        self.bundle_confirmed_at_ms
            .store(self.clock.now_ms(), Ordering::Relaxed);
        true
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
        let bundle = self.bundle.load();
        let version = bundle.as_ref().map_or(0, |b| b.version());
        metrics::gauge!(crate::metrics::POLICY_VERSION).set(version as f64);
        let installed = self.bundle_installed_at_ms.load(Ordering::Relaxed);
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
        ] {
            metrics::gauge!(crate::metrics::LIMITER_DECISIONS, "path" => path).set(count as f64);
        }
        metrics::gauge!(crate::metrics::ALLOCATOR_REACHABLE).set(if self.allocator_reachable() {
            1.0
        } else {
            0.0
        });
        let pools = lock(&self.pools);
        let mut dropped = self.dropped_reports_of_evicted.load(Ordering::Relaxed);
        for ((tenant, pool), slot) in pools.iter() {
            let holder = lock(&slot.holder);
            dropped += holder.dropped_reports();
            metrics::gauge!(crate::metrics::TOKENS_STRANDED,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.stranded_tokens() as f64);
            metrics::gauge!(crate::metrics::FALLBACK_ALLOWANCE,
                "tenant" => tenant.to_string(), "pool" => pool.to_string())
            .set(holder.config().fallback_per_region_tokens as f64);
        }
        metrics::gauge!(crate::metrics::POOLS_HELD).set(pools.len() as f64);
        metrics::gauge!(crate::metrics::REPORT_LINES_DROPPED).set(dropped as f64);
    }

    /// Pools held now (with terms), and pools being looked up or recently not found.
    pub fn pool_counts(&self) -> (usize, usize) {
        (lock(&self.pools).len(), lock(&self.lookups).len())
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
        let confirmed = self.bundle_confirmed_at_ms.load(Ordering::Relaxed);
        self.clock.now_ms().saturating_sub(confirmed) > max_age_ms
    }

    /// Whether the allocator answered the last call.
    pub fn allocator_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// Decides one request, and counts the decision.
    pub async fn admit(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        let decision = self.decide(request).await?;
        let scope = decision.denied_scope.map_or("none", |s| match s {
            DeniedScope::User => "user",
            DeniedScope::Tenant => "tenant",
            DeniedScope::Route => "route",
            DeniedScope::Global => "global",
            DeniedScope::Concurrency => "concurrency",
        });
        let reason = decision.reason.map_or("none", |r| match r {
            Reason::RateExceeded => "rate_exceeded",
            Reason::ConcurrencyExceeded => "concurrency_exceeded",
            Reason::LimiterUnavailable => "limiter_unavailable",
            Reason::PolicyError => "policy_error",
        });
        let outcome = if decision.allowed {
            "allowed"
        } else {
            "denied"
        };
        self.decision_counters
            .counter(
                outcome,
                scope,
                reason,
                decision.policy_id.as_deref().unwrap_or_default(),
                decision.policy_version,
            )
            .increment(1);
        if let Some(log) = self.decision_log.get() {
            log.record(self.clock.now_ms(), request, &decision);
        }
        Ok(decision)
    }

    async fn decide(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        request.validate().map_err(|e| RequestRejected {
            field: e.field.to_owned(),
            message: e.message.to_owned(),
        })?;
        let Some(bundle) = self.bundle.load_full() else {
            return Ok(unavailable(request, 0, None, Reason::PolicyError, 1_000));
        };
        let version = bundle.version();
        let mut fallback = false;
        let tenant = &request.tenant_id;
        let kind = request.principal.kind;
        if self.bundle_is_stale() {
            let strict = bundle
                .regional_rules_for(tenant, &request.route_group, kind)
                .into_iter()
                .chain(bundle.global_rules_for(tenant, &request.route_group, kind))
                .find(|rule| rule.strict);
            if let Some(rule) = strict {
                return Ok(unavailable(
                    request,
                    version,
                    Some(rule),
                    Reason::LimiterUnavailable,
                    1_000,
                ));
            }
        }
        for rule in bundle.global_rules_for(tenant, &request.route_group, kind) {
            let Limit::Global(pool) = &rule.limit else {
                continue;
            };
            let cost = (rule.cost_millitokens / 1_000)
                .saturating_mul(request.cost_hint)
                .max(1);
            match self.spend_global(tenant, pool, cost).await {
                Ok(from_fallback) => {
                    if from_fallback {
                        metrics::counter!(crate::metrics::FALLBACK_ADMITS,
                            "tenant" => tenant.to_string(), "pool" => pool.to_string())
                        .increment(1);
                    }
                    fallback |= from_fallback;
                }
                Err((denial, retry_after_ms, limit)) => {
                    return Ok(global_denial(
                        request,
                        version,
                        rule,
                        denial,
                        retry_after_ms,
                        limit,
                    ));
                }
            }
        }
        let planned = match plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) {
            Ok(planned) => planned,
            Err(error) => {
                tracing::error!(%error, "the bundle cannot be evaluated for a request");
                return Ok(unavailable(
                    request,
                    version,
                    None,
                    Reason::PolicyError,
                    1_000,
                ));
            }
        };
        let Some(planned) = planned else {
            return Ok(Decision {
                allowed: true,
                decision_id: request.request_id.clone(),
                policy_id: None,
                policy_version: version,
                denied_scope: None,
                reason: None,
                limit: 0,
                remaining: 0,
                retry_after_ms: 0,
                fallback,
            });
        };
        // Concurrency caps: a slot per rule that has one, taken before the rate decision and given
        // back (idempotently) if the request is not admitted. The gateway releases it when the
        // request ends (`release`); a crashed holder's slot lapses with its lease TTL.
        let mut held = Vec::new();
        for (index, rule) in planned.rules.iter().enumerate() {
            let Some(semaphore) = rule.concurrency else {
                continue;
            };
            let Some(batch_rule) = planned.batch.rules().get(index) else {
                continue;
            };
            let Ok(call) = LeaseCall::new(
                allot_shared::keys::concurrency_key(batch_rule.key()),
                semaphore.max_in_flight(),
                semaphore.lease_ttl_ms(),
                request.request_id.clone(),
            ) else {
                continue;
            };
            match self.limiter.lease(LeaseOp::Acquire, &call).await {
                Ok(outcome) if outcome.held => held.push(call),
                Ok(_) => {
                    self.release_all(&held).await;
                    return Ok(crate::limiter::concurrency_denial(
                        &planned,
                        index,
                        CONCURRENCY_RETRY_MS,
                    ));
                }
                Err(error) => {
                    tracing::warn!(%error, rule = %rule.id, "concurrency lease call failed");
                    if matches!(rule.fail_mode, allot_shared::policy::FailMode::Closed) {
                        self.release_all(&held).await;
                        return Ok(unavailable(
                            request,
                            version,
                            Some(rule),
                            Reason::LimiterUnavailable,
                            1_000,
                        ));
                    }
                    // local_bounded: the rate rule's local bucket still bounds the request.
                    fallback = true;
                }
            }
        }
        // Pre-authentication requests count against the cardinality cap of their source: the
        // coarse prefix of the client address (/24, /48), so the addresses one party controls share
        // one count. Authenticated principals are not capped.
        let source = (kind == PrincipalType::Ip).then(|| {
            SourceId::for_address(
                &self.settings.pepper,
                &request.principal.id,
                DEFAULT_SOURCE_PREFIXES,
            )
        });
        let decided = self.limiter.decide(&planned, source.as_ref()).await;
        let mut decision = decided.to_contract(&planned);
        decision.fallback |= fallback;
        if !decision.allowed {
            self.release_all(&held).await;
        }
        Ok(decision)
    }

    async fn release_all(&self, calls: &[LeaseCall]) {
        for call in calls {
            if let Err(error) = self.limiter.lease(LeaseOp::Release, call).await {
                // The slot lapses with its lease TTL anyway.
                tracing::warn!(%error, "concurrency lease not released");
            }
        }
    }

    /// Gives back the concurrency slots `request` holds (call when the request has finished).
    /// Idempotent: releasing twice, or a slot that lapsed, changes nothing.
    pub async fn release(&self, request: &AdmissionRequest) -> Result<(), RequestRejected> {
        request.validate().map_err(|e| RequestRejected {
            field: e.field.to_owned(),
            message: e.message.to_owned(),
        })?;
        let Some(bundle) = self.bundle.load_full() else {
            return Ok(());
        };
        let Ok(Some(planned)) = plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) else {
            return Ok(());
        };
        let calls: Vec<LeaseCall> = planned
            .rules
            .iter()
            .zip(planned.batch.rules())
            .filter_map(|(rule, batch_rule)| {
                let semaphore = rule.concurrency?;
                LeaseCall::new(
                    allot_shared::keys::concurrency_key(batch_rule.key()),
                    semaphore.max_in_flight(),
                    semaphore.lease_ttl_ms(),
                    request.request_id.clone(),
                )
                .ok()
            })
            .collect();
        self.release_all(&calls).await;
        Ok(())
    }

    /// Spends `cost` tokens of a global pool. `Ok(true)` when admitted from the fallback allowance.
    async fn spend_global(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        cost: u64,
    ) -> Result<bool, (Denial, u64, u64)> {
        let Some(mut slot) = self.slot(tenant, pool).await else {
            return Err((Denial::FailClosed, TERMS_RETRY_MS, 0));
        };
        for attempt in 0..2 {
            let now_ms = self.clock.now_ms();
            let spend = {
                let mut holder = lock(&slot.holder);
                if slot.evicted.load(Ordering::Acquire) {
                    drop(holder);
                    // Forgotten between the lookup and now (idle for minutes): look it up again.
                    match self.slot(tenant, pool).await {
                        Some(fresh) => slot = fresh,
                        None => return Err((Denial::FailClosed, TERMS_RETRY_MS, 0)),
                    }
                    lock(&slot.holder).spend(cost, now_ms, self.allocator_reachable())
                } else {
                    holder.spend(cost, now_ms, self.allocator_reachable())
                }
            };
            let limit = slot.limit.load(Ordering::Relaxed);
            // Registered before the renewal can start, so its end cannot be missed.
            let renewed = slot.renewed.notified();
            tokio::pin!(renewed);
            renewed.as_mut().enable();
            self.renew_if_wanted(tenant, pool, &slot);
            let depleted = match spend {
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                } if attempt == 0 => Some("available"),
                Spend::Denied {
                    denial: Denial::PoolExhausted,
                    ..
                } => Some("exhausted"),
                _ => None,
            };
            if let Some(pool_state) = depleted {
                metrics::counter!(crate::metrics::LEASE_DEPLETIONS,
                    "tenant" => tenant.to_string(), "pool" => pool.to_string(),
                    "pool_state" => pool_state)
                .increment(1);
            }
            match spend {
                Spend::Leased(_) => return Ok(false),
                Spend::Fallback { .. } => return Ok(true),
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                } if attempt == 0 => {
                    // Wait for the renewal in flight, if any (none: it already ended, or none was
                    // wanted; try again at once).
                    if lock(&slot.holder).renewal_in_flight() {
                        let _ = tokio::time::timeout(FIRST_GRANT_WAIT, renewed).await;
                    }
                }
                Spend::Denied {
                    denial,
                    retry_after_ms,
                } => return Err((denial, retry_after_ms, limit)),
            }
        }
        Err((
            Denial::AwaitingGrant,
            100,
            slot.limit.load(Ordering::Relaxed),
        ))
    }

    /// The pool's slot, fetching its terms on first use. `None` when the terms cannot be had (no
    /// allocator, unknown pool, unreachable, or too many pools).
    ///
    /// Off the hot path by construction: one fetch per pool at a time (the others wait for it, up
    /// to [`FIRST_GRANT_WAIT`]), the fetch runs on its own task with the client's deadline, and a
    /// failed lookup is remembered ([`TERMS_RETRY_MS`], [`UNKNOWN_POOL_RETRY_MS`]) so a flood of
    /// requests for a missing pool costs one allocator call per interval, not one per request.
    async fn slot(self: &Arc<Self>, tenant: &TenantId, pool: &PoolId) -> Option<Arc<PoolSlot>> {
        if let Some(slot) = lock(&self.pools).get(tenant, pool) {
            return Some(slot.clone());
        }
        let allocator = self.allocator.clone()?;
        let key = (tenant.clone(), pool.clone());
        let mut fetched = {
            let mut lookups = lock(&self.lookups);
            // The fetch may have finished since the first look (it installs, then forgets).
            if let Some(slot) = lock(&self.pools).get(tenant, pool) {
                return Some(slot.clone());
            }
            let now_ms = self.clock.now_ms();
            match lookups.get(&key) {
                Some(Lookup::Missing { retry_at_ms }) if now_ms < *retry_at_ms => return None,
                Some(Lookup::Fetching(fetched)) => fetched.clone(),
                _ => {
                    if lookups.len() >= MAX_POOLS {
                        lookups.retain(|_, lookup| {
                            !matches!(lookup, Lookup::Missing { retry_at_ms } if *retry_at_ms <= now_ms)
                        });
                        if lookups.len() >= MAX_POOLS {
                            return None;
                        }
                    }
                    let (done, fetched) = tokio::sync::watch::channel(());
                    lookups.insert(key.clone(), Lookup::Fetching(fetched.clone()));
                    tokio::spawn(self.clone().fetch_terms(allocator, key.clone(), done));
                    fetched
                }
            }
        };
        // Ends when the fetch's sender is dropped; the fetch goes on without a caller who stops
        // waiting.
        let _ = tokio::time::timeout(FIRST_GRANT_WAIT, fetched.changed()).await;
        lock(&self.pools).get(tenant, pool).cloned()
    }

    /// Fetches a pool's terms and installs its slot, or remembers why not. Dropping `done` wakes
    /// the requests waiting for it.
    async fn fetch_terms(
        self: Arc<Self>,
        allocator: Arc<AllocatorClient>,
        key: PoolKey,
        done: tokio::sync::watch::Sender<()>,
    ) {
        let (tenant, pool) = &key;
        let stopwatch = crate::clock::Stopwatch::start();
        let answer = allocator
            .pool_terms(tenant, pool, Some(&self.settings.region))
            .await;
        metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "terms")
            .record(stopwatch.elapsed().as_secs_f64());
        let now_ms = self.clock.now_ms();
        let retry_in_ms = match answer {
            Ok(Some(mut terms)) => {
                self.reachable.store(true, Ordering::Relaxed);
                // What the region already admitted in fallback this window (a restart must not
                // re-open the allowance); not part of the terms kept and compared.
                let fallback_in_window = terms.fallback_in_window.take();
                match self.holder_config(&terms) {
                    Some(config) => {
                        let mut pools = lock(&self.pools);
                        if pools.len() < MAX_POOLS {
                            pools.get_or_insert_with(key.clone(), || {
                                let slot = PoolSlot::new(config, terms, now_ms);
                                if let Some(f) = fallback_in_window {
                                    lock(&slot.holder).seed_fallback(f.window_start_ms, f.admitted);
                                }
                                Arc::new(slot)
                            });
                            None
                        } else {
                            tracing::warn!(max = MAX_POOLS, "agent holds its maximum of pools");
                            Some(TERMS_RETRY_MS)
                        }
                    }
                    None => {
                        tracing::error!(%tenant, %pool, "pool terms with a zero window ignored");
                        Some(UNKNOWN_POOL_RETRY_MS)
                    }
                }
            }
            Ok(None) => {
                tracing::debug!(%tenant, %pool, "no such pool at the allocator");
                Some(UNKNOWN_POOL_RETRY_MS)
            }
            Err(error) => {
                self.reachable
                    .store(!error.is_unreachable(), Ordering::Relaxed);
                metrics::counter!(crate::metrics::ALLOCATOR_ERRORS, "call" => "terms").increment(1);
                tracing::warn!(%error, %tenant, %pool, "pool terms not fetched");
                Some(TERMS_RETRY_MS)
            }
        };
        let mut lookups = lock(&self.lookups);
        match retry_in_ms {
            None => lookups.remove(&key),
            Some(retry_ms) => lookups.insert(
                key,
                Lookup::Missing {
                    retry_at_ms: now_ms.saturating_add(retry_ms),
                },
            ),
        };
        drop(lookups);
        drop(done);
    }

    fn holder_config(&self, terms: &PoolTerms) -> Option<HolderConfig> {
        Some(HolderConfig {
            window_ms: NonZeroU64::new(terms.window_ms)?,
            chunk_tokens: terms.chunk,
            lease_ttl_ms: terms.lease_ttl_ms,
            fallback_per_region_tokens: terms.fallback_per_region
                / self.settings.region_agents.max(1),
            expiry_margin_ms: self.settings.expiry_margin_ms,
            round_trip_ms: self.settings.allocator_round_trip_ms,
        })
    }

    /// Pool upkeep: forgets pools idle for [`POOL_IDLE_MS`] with nothing held or owed, and fetches
    /// the terms of pools last fetched [`TERMS_REFRESH_MS`] ago or more (at most
    /// [`MAX_TERMS_REFRESH_PER_ROUND`] per call), so pool updates reach the holders.
    pub async fn maintain_pools(&self) {
        let now_ms = self.clock.now_ms();
        let slots = lock(&self.pools).snapshot();
        let mut stale = Vec::new();
        for (key, slot) in slots {
            let mut pools = lock(&self.pools);
            let mut holder = lock(&slot.holder);
            let current = pools
                .get(&key.0, &key.1)
                .is_some_and(|s| Arc::ptr_eq(s, &slot));
            if current && holder.is_idle(now_ms, POOL_IDLE_MS) {
                slot.evicted.store(true, Ordering::Release);
                self.dropped_reports_of_evicted
                    .fetch_add(holder.dropped_reports(), Ordering::Relaxed);
                pools.remove(&key);
                continue;
            }
            drop((holder, pools));
            let fetched_at_ms = lock(&slot.terms).1;
            if now_ms.saturating_sub(fetched_at_ms) >= TERMS_REFRESH_MS {
                stale.push((fetched_at_ms, key, slot));
            }
        }
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        // Longest unrefreshed first.
        stale.sort_by_key(|(fetched_at_ms, _, _)| *fetched_at_ms);
        for (_, (tenant, pool), slot) in stale.into_iter().take(MAX_TERMS_REFRESH_PER_ROUND) {
            match allocator.pool_terms(&tenant, &pool, None).await {
                Ok(Some(terms)) => {
                    self.reachable.store(true, Ordering::Relaxed);
                    let Some(config) = self.holder_config(&terms) else {
                        continue;
                    };
                    let mut in_force = lock(&slot.terms);
                    if in_force.0 != terms {
                        tracing::info!(%tenant, %pool, version = terms.version, "pool terms updated");
                        lock(&slot.holder).reconfigure(config);
                        slot.limit.store(terms.limit, Ordering::Relaxed);
                        in_force.0 = terms;
                    }
                    in_force.1 = self.clock.now_ms();
                }
                Ok(None) => {
                    // Deleted: its leases run out, renewals answer nothing; it is forgotten when idle.
                    tracing::warn!(%tenant, %pool, "a held pool no longer exists at the allocator");
                    lock(&slot.terms).1 = self.clock.now_ms();
                }
                Err(error) => {
                    self.reachable
                        .store(!error.is_unreachable(), Ordering::Relaxed);
                    tracing::debug!(%error, "pool terms not refreshed; next round");
                    return;
                }
            }
        }
    }

    /// Starts a renewal (single flight) when the holder wants one.
    fn renew_if_wanted(self: &Arc<Self>, tenant: &TenantId, pool: &PoolId, slot: &Arc<PoolSlot>) {
        let Some(allocator) = self.allocator.clone() else {
            return;
        };
        let asked = {
            let mut holder = lock(&slot.holder);
            let now_ms = self.clock.now_ms();
            let want = holder.wants(now_ms);
            want.map(|want| {
                holder.begin_renewal();
                let fresh = LeaseId::from_parts(now_ms, rand::random());
                (want, holder.renewal_lease_id(fresh))
            })
        };
        let Some((want, lease_id)) = asked else {
            return;
        };
        let (agent, slot, tenant, pool) =
            (self.clone(), slot.clone(), tenant.clone(), pool.clone());
        tokio::spawn(async move {
            let asked_at_ms = agent.clock.now_ms();
            let stopwatch = crate::clock::Stopwatch::start();
            let answer = allocator
                .grant(&tenant, &pool, &agent.settings.region, lease_id, want)
                .await;
            metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "grant")
                .record(stopwatch.elapsed().as_secs_f64());
            match answer {
                Ok(Some(answer)) => {
                    agent.reachable.store(true, Ordering::Relaxed);
                    let grant = LeaseGrant {
                        lease_id: answer.lease_id,
                        epoch: answer.epoch,
                        granted_tokens: answer.granted,
                        window: Window {
                            start_ms: answer.window_start_ms,
                            end_ms: answer.window_end_ms,
                        },
                        expires_at_ms: answer.expires_at_ms,
                        retry_after_ms: answer.retry_after_ms,
                    }
                    .on_agent_clock(answer.issued_at_ms, asked_at_ms);
                    let verdict = lock(&slot.holder).accept(grant, agent.clock.now_ms());
                    let outcome = match verdict {
                        GrantVerdict::Accepted if answer.granted < want => "partial",
                        GrantVerdict::Accepted => "granted",
                        GrantVerdict::Exhausted { .. } => "exhausted",
                        GrantVerdict::StaleEpoch { .. } => {
                            tracing::warn!(epoch = %answer.epoch, %tenant, %pool,
                                "grant from a stale allocator epoch ignored");
                            "stale_epoch"
                        }
                        GrantVerdict::AlreadyExpired | GrantVerdict::Duplicate => "expired",
                    };
                    metrics::counter!(crate::metrics::RENEWALS, "outcome" => outcome).increment(1);
                    if matches!(verdict, GrantVerdict::Accepted) {
                        metrics::counter!(crate::metrics::TOKENS_GRANTED).increment(answer.granted);
                    }
                }
                Ok(None) => {
                    lock(&slot.holder).renewal_failed(lease_id, false);
                    tracing::warn!(%tenant, %pool, "the pool no longer exists");
                }
                Err(error) => {
                    // No answer (or a 5xx): the grant may have been committed; ask again with
                    // the same lease id. A refusal is final.
                    lock(&slot.holder).renewal_failed(lease_id, error.is_unreachable());
                    agent
                        .reachable
                        .store(!error.is_unreachable(), Ordering::Relaxed);
                    metrics::counter!(crate::metrics::RENEWALS, "outcome" => "failed").increment(1);
                    metrics::counter!(crate::metrics::ALLOCATOR_ERRORS, "call" => "grant")
                        .increment(1);
                    tracing::warn!(%error, %tenant, %pool, "renewal failed");
                }
            }
            lock(&slot.holder).end_renewal();
            slot.renewed.notify_waiters();
        });
    }

    /// Sends every pool's pending report lines, one report per (pool, window), and acknowledges what
    /// the allocator took. Lines that fail stay pending for the next round.
    pub async fn send_reports(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        let mut slots = lock(&self.pools).snapshot();
        if slots.is_empty() {
            return;
        }
        // Start where the last round stopped: a round cut short by its deadline must not leave
        // the same pools unreported every time.
        slots.sort_by(|a, b| a.0.cmp(&b.0));
        let start = self.report_cursor.load(Ordering::Relaxed) % slots.len();
        slots.rotate_left(start);
        for ((tenant, pool), slot) in slots {
            self.report_cursor.fetch_add(1, Ordering::Relaxed);
            let now_ms = self.clock.now_ms();
            let pending = lock(&slot.holder).pending_report(now_ms);
            if pending.is_empty() {
                continue;
            }
            let mut windows: Vec<u64> = pending
                .leases
                .iter()
                .map(|l| l.window_start_ms)
                .chain(pending.fallback.iter().map(|f| f.window_start_ms))
                .collect();
            windows.sort_unstable();
            windows.dedup();
            for window_start_ms in windows {
                let part = PendingReport {
                    leases: pending
                        .leases
                        .iter()
                        .filter(|l| l.window_start_ms == window_start_ms)
                        .copied()
                        .collect(),
                    fallback: pending
                        .fallback
                        .iter()
                        .filter(|f| f.window_start_ms == window_start_ms)
                        .copied()
                        .collect(),
                };
                let body = ReportBody {
                    report_id: LeaseId::from_parts(now_ms, rand::random()).to_string(),
                    region: self.settings.region.clone(),
                    tenant: tenant.clone(),
                    pool: pool.clone(),
                    window_start_ms,
                    leases: part
                        .leases
                        .iter()
                        .map(|l| ReportLease {
                            lease_id: l.lease_id,
                            spent: l.spent_tokens,
                            final_report: l.final_line,
                        })
                        .collect(),
                    fallback_admitted: part.fallback.first().map_or(0, |f| f.admitted_tokens),
                };
                match allocator.report(&body).await {
                    Ok(()) => {
                        self.reachable.store(true, Ordering::Relaxed);
                        lock(&slot.holder).acknowledge(&part, self.clock.now_ms());
                    }
                    Err(error) => {
                        self.reachable
                            .store(!error.is_unreachable(), Ordering::Relaxed);
                        tracing::warn!(%error, %tenant, %pool, "report not taken; kept for the next round");
                    }
                }
            }
        }
    }

    /// Fetches the bundle this region should run and installs it if newer; tells the allocator what
    /// runs here.
    pub async fn refresh_policy(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        match allocator.current_policy(&self.settings.region).await {
            Ok(Some(bundle)) => {
                self.offer_bundle(bundle);
                self.bundle_confirmed_at_ms
                    .store(self.clock.now_ms(), Ordering::Relaxed);
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(%error, "policy refresh failed; keeping the bundle in force")
            }
        }
        let version = self.bundle.load().as_ref().map_or(0, |b| b.version());
        if let Err(error) = allocator
            .report_status(
                &self.settings.region,
                &self.settings.agent_id,
                version,
                &self.settings.pepper.fingerprint(),
            )
            .await
        {
            tracing::debug!(%error, "policy status not reported");
        }
    }

    /// Runs the background loops until `shutdown` resolves: reports every `report_every`; policy
    /// refresh and pool upkeep every `policy_every`. The loops are independent (a slow allocator
    /// holds up neither the other loop nor shutdown), each round has [`ROUND_TIMEOUT`], and a last
    /// round of reports is sent within [`FINAL_REPORT_TIMEOUT`].
    pub async fn run_background(
        self: Arc<Self>,
        report_every: Duration,
        policy_every: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let signal = async {
            shutdown.await;
            let _ = stop.send(true);
        };
        let reports = every(report_every, stopped.clone(), "reports", || {
            self.send_reports()
        });
        let upkeep = every(policy_every, stopped, "policy and pool upkeep", || async {
            self.refresh_policy().await;
            self.maintain_pools().await;
        });
        tokio::join!(signal, reports, upkeep);
        if tokio::time::timeout(FINAL_REPORT_TIMEOUT, self.send_reports())
            .await
            .is_err()
        {
            tracing::warn!("the last reports did not reach the allocator before shutdown");
        }
    }
}

/// Runs `round` every `period` until `stopped` turns true; a round is cut at [`ROUND_TIMEOUT`] or
/// at the stop.
async fn every<F, Fut>(
    period: Duration,
    mut stopped: tokio::sync::watch::Receiver<bool>,
    name: &'static str,
    round: F,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return,
            _ = ticks.tick() => {}
        }
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return,
            finished = tokio::time::timeout(ROUND_TIMEOUT, round()) => {
                if finished.is_err() {
                    tracing::warn!(round = name, "background round cut at its deadline");
                }
            }
        }
    }
}

fn unavailable(
    request: &AdmissionRequest,
    version: u64,
    rule: Option<&Rule>,
    reason: Reason,
    retry_after_ms: i64,
) -> Decision {
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: rule.map(|r| r.id.to_string()),
        policy_version: version,
        denied_scope: rule.map(|r| r.scope.denied_scope()),
        reason: Some(reason),
        limit: 0,
        remaining: 0,
        retry_after_ms,
        fallback: false,
    }
}

fn global_denial(
    request: &AdmissionRequest,
    version: u64,
    rule: &Rule,
    denial: Denial,
    retry_after_ms: u64,
    limit: u64,
) -> Decision {
    let (reason, fallback) = match denial {
        Denial::PoolExhausted => (Reason::RateExceeded, false),
        Denial::FallbackSpent => (Reason::RateExceeded, true),
        // The window's quota can no longer be leased; the pool refills when it ends.
        Denial::WindowEnding => (Reason::RateExceeded, false),
        Denial::FailClosed | Denial::AwaitingGrant => (Reason::LimiterUnavailable, false),
    };
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: Some(rule.id.to_string()),
        policy_version: version,
        denied_scope: Some(DeniedScope::Global),
        reason: Some(reason),
        limit,
        remaining: 0,
        retry_after_ms: i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
        fallback,
    }
}
