//! The request path: one admission decision per gateway request.
//!
//! # Order of a decision, and why
//! A denial anywhere debits nothing anywhere: neither a regional bucket nor the tenant's global
//! pool. So the request is decided in this order:
//! 1. **Refusals from memory**, before anything is reserved: no bundle, a `strict` rule of a stale
//!    bundle, a bundle that cannot be evaluated for the request, the limiter's negative cache and
//!    its pre-authentication cardinality cap ([`crate::limiter::Limiter::screen`]).
//! 2. **Global rules**: each rule's cost is *reserved* from its pool's leases in memory (or, with
//!    the allocator unreachable, from the window's fallback allowance). A global denial costs no
//!    store call and cancels the reservations made so far.
//! 3. **Regional rules**, within the [regional hold](Agent::regional_hold): concurrency slots, then
//!    one atomic store call for every rate rule ([`crate::limiter::Limiter::decide_screened`]).
//! 4. **Settle**: admitted, the reservations are committed (spent, and reported as spent); denied,
//!    failed or out of time, they are cancelled: the tokens go back to the same lease while it
//!    lives, and concurrency slots taken are released.
//!
//! A **dry run** (`dryRun`) goes through the same steps and answers what a real request would get,
//! but spends nothing: its reservations are always cancelled, a fallback allowance it would need is
//! not claimed (the answer says `fallback: true`), the store writes nothing, and no concurrency slot
//! is taken (a slot is held for a request's duration, not spent; one free now is no promise for
//! later, so caps are not checked). It may start a lease renewal the pool wants anyway: fetching
//! tokens is not spending them. Dry runs are counted apart from decisions and never logged as
//! traffic.
//!
//! Reserve-then-commit is safe because the lease lives in this process: nothing remote is ever
//! refunded, so an ambiguous store failure can still never double-count (I6). Global first keeps the
//! cheap, local check in front of the store; the reservation keeps a regional denial from draining
//! the tenant's pool (one user flooding past a per-user bucket must not starve the tenant's others).
//!
//! The allocator is never called on the request path except when a pool has no lease at all (the
//! request waits up to [`FIRST_GRANT_WAIT`] for the renewal it triggered).

use allot_shared::contract::{AdmissionRequest, AdvisoryMode, Decision, DeniedScope, Reason};
use allot_shared::ids::{PoolId, RuleId, TenantId};
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::{FailMode, Limit, PolicyBundle, Rule};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::bundle::lay_principal_overrides;
use super::pools::{PoolSlot, TERMS_RETRY_MS};
use super::replays::{Begin, ORIGINAL_WAIT, Ticket};
use super::settings::{AgentSettings, FIRST_GRANT_WAIT};
use super::{Agent, RequestRejected, lock};
use crate::global::{Denial, Refusal, Reservation};
use crate::limiter::{LeaseCall, LeaseOp, PlannedBatch, Screened, Verdict, plan_request};

/// Retry hint of a concurrency denial, ms: a slot frees when a holder finishes, at no known time.
pub const CONCURRENCY_RETRY_MS: u64 = 1_000;
/// Retry hint when the request cannot be evaluated (no bundle, a policy error), ms.
pub const POLICY_UNAVAILABLE_RETRY_MS: u64 = 1_000;
/// Retry hint of a request that found too little held while a renewal was under way, ms.
pub const AWAITING_GRANT_RETRY_MS: u64 = 100;
/// Largest random delay added to the retry hint of a denial at a window's edge or after a pool ran
/// out, ms (I5): clients denied in the same instant do not all return in the same instant.
pub const RETRY_JITTER_MAX_MS: u64 = 1_000;

/// What a heartbeat ([`Agent::renew`]) did to the concurrency slots of a request.
pub use allot_shared::contract::SlotRenewal;

/// Most reservation passes over a request's global rules: one per kind of wait (a renewal, a
/// fallback claim), one more for a pool forgotten meanwhile, and the last.
const MAX_RESERVATION_PASSES: usize = 4;

/// One reservation attempt.
enum Attempt {
    Reserved(Reservation),
    Refused(Refusal),
    /// The pool was forgotten since it was looked up.
    Evicted,
}

/// What a reservation pass must wait for before the next.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// The pool's slot again.
    Lookup,
    /// The renewal under way.
    Grant,
    /// A durable fallback claim for this many tokens.
    Claim(u64),
}

/// The refusal of a pool whose terms cannot be had (or whose fallback claim cannot be written).
fn fail_closed() -> GlobalRefusal {
    GlobalRefusal {
        refusal: Refusal {
            denial: Denial::FailClosed,
            retry_after_ms: TERMS_RETRY_MS,
        },
        limit_tokens: 0,
    }
}

/// Why a global rule refused, with what the decision reports.
#[derive(Debug, Clone, Copy)]
struct GlobalRefusal {
    refusal: Refusal,
    /// `G` of the pool's terms in force (0 when unknown).
    limit_tokens: u64,
}

/// A concurrency slot to take: the request, its plan, the rule's index in it, the lease call.
pub(super) type SlotCall<'c, 'b> = (
    &'c AdmissionRequest,
    &'c PlannedBatch<'b>,
    usize,
    &'c LeaseCall,
);

/// The concurrency slots taken for a decision, and whether a `local_bounded` rule's slot could
/// not be asked for (the answer is then a fallback's).
pub(super) struct SlotsHeld<'c> {
    /// The slots taken, to release if the decision is a denial.
    pub(super) held: Vec<&'c LeaseCall>,
    /// A `local_bounded` rule's lease call failed.
    pub(super) fallback: bool,
}

/// The global reservations of one request. Settled once: committed when the request is admitted,
/// cancelled otherwise, and cancelled when dropped unsettled (a gateway that went away
/// mid-decision must not leave tokens reserved).
#[derive(Default)]
pub(super) struct GlobalHold {
    /// (the pool's slot, the reservation, the rule it is for).
    held: Vec<(Arc<PoolSlot>, Reservation, RuleId)>,
    /// A dry run's: a rule would have been admitted from a fallback allowance not yet claimed.
    would_claim_fallback: bool,
}

impl GlobalHold {
    /// Whether any reservation came (or, for a dry run, would come) from a fallback allowance.
    fn uses_fallback(&self) -> bool {
        self.would_claim_fallback || self.held.iter().any(|(_, r, _)| r.is_fallback())
    }

    /// Spends every reservation. Returns whether any came from a fallback allowance.
    fn commit(mut self, tenant: &TenantId) -> bool {
        let mut fallback = false;
        for (slot, reservation, _) in self.held.drain(..) {
            if reservation.is_fallback() {
                fallback = true;
                metrics::counter!(crate::metrics::FALLBACK_ADMITS,
                    "tenant" => tenant.to_string(), "pool" => slot.pool.to_string())
                .increment(1);
            }
            lock(&slot.agent).commit(reservation);
        }
        fallback
    }
}

impl Drop for GlobalHold {
    fn drop(&mut self) {
        for (slot, reservation, _) in self.held.drain(..) {
            lock(&slot.agent).cancel(reservation);
        }
    }
}

impl Agent {
    /// Decides one request, and counts the decision.
    pub async fn admit(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        let mut decision = self.decide(request).await?;
        if request.dry_run {
            decision.dry_run = true;
            let outcome = if decision.allowed {
                "allowed"
            } else {
                "denied"
            };
            metrics::counter!(crate::metrics::DRY_RUNS, "outcome" => outcome).increment(1);
            return Ok(decision);
        }
        self.count_decision(request, &decision);
        Ok(decision)
    }

    /// Counts a decision (not a dry run's) in the metrics and the decision log.
    pub(super) fn count_decision(&self, request: &AdmissionRequest, decision: &Decision) {
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
            Reason::CostTooHigh => "cost_too_high",
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
        for violation in &decision.violations {
            let mode = match violation.mode {
                AdvisoryMode::Shadow => "shadow",
                AdvisoryMode::Soft => "soft",
            };
            metrics::counter!(crate::metrics::ADVISORY_DENIALS,
                "rule" => violation.policy_id.clone(), "mode" => mode)
            .increment(1);
        }
        if let Some(log) = self.decision_log.get() {
            log.record(self.clock.now_ms(), request, decision);
        }
    }

    async fn decide(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        request.validate()?;
        let Some(bundle) = self.bundle.load() else {
            return Ok(refused(
                request,
                0,
                None,
                Reason::PolicyError,
                POLICY_UNAVAILABLE_RETRY_MS,
            ));
        };
        // A dry run spends nothing, so it has nothing to replay.
        if request.dry_run || !applies_idempotent_rule(&bundle, request) {
            return self.decide_afresh(request, bundle).await;
        }
        let ticket = match self.begin_idempotent(request, bundle.version()).await {
            Ok(ticket) => ticket,
            Err(answer) => return Ok(answer),
        };
        let decision = self.decide_afresh(request, bundle).await?;
        if decision.allowed
            && let Some(ticket) = ticket
        {
            let until_ms = self
                .clock
                .now_ms()
                .saturating_add(self.settings.decision_record_ttl_ms);
            ticket.admitted(decision.clone(), until_ms);
        }
        Ok(decision)
    }

    /// Where an idempotent request stands: `Ok` to decide it (with the ticket that remembers its
    /// admission, if there is room), or `Err` with the answer: the admission already made for this
    /// request id, or `LIMITER_UNAVAILABLE` when its original is still being decided after
    /// [`ORIGINAL_WAIT`].
    async fn begin_idempotent(
        &self,
        request: &AdmissionRequest,
        version: u64,
    ) -> Result<Option<Ticket>, Decision> {
        let (tenant, request_id) = (&request.tenant_id, &request.request_id);
        let mut waited = false;
        loop {
            match self.replays.begin(tenant, request_id, self.clock.now_ms()) {
                Begin::Replay(decision) => {
                    metrics::counter!(crate::metrics::REPLAYED_ADMISSIONS, "tier" => "agent")
                        .increment(1);
                    return Err(decision);
                }
                Begin::Decide(ticket) => return Ok(Some(ticket)),
                Begin::Unremembered => return Ok(None),
                Begin::Wait(_) if waited => {
                    tracing::warn!("a retry's original is still being decided");
                    return Err(refused(
                        request,
                        version,
                        None,
                        Reason::LimiterUnavailable,
                        POLICY_UNAVAILABLE_RETRY_MS,
                    ));
                }
                Begin::Wait(mut original) => {
                    waited = true;
                    // Fails (at once, if already so) when the original's entry is settled.
                    let _ = tokio::time::timeout(ORIGINAL_WAIT, original.changed()).await;
                }
            }
        }
    }

    /// Decides a request with no earlier admission to answer again.
    async fn decide_afresh(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        bundle: Arc<PolicyBundle>,
    ) -> Result<Decision, RequestRejected> {
        let version = bundle.version();
        // 1. Refusals from memory: nothing is reserved yet.
        if let Some(rule) = self.stale_strict_rule(&bundle, request) {
            return Ok(refused(
                request,
                version,
                Some(rule),
                Reason::LimiterUnavailable,
                POLICY_UNAVAILABLE_RETRY_MS,
            ));
        }
        // A cost no rule state could ever admit is refused before anything is paid or asked.
        if let Some(denied) = inadmissible_cost(&bundle, request, version, &self.settings) {
            return Ok(denied);
        }
        // A principal owing extra cost of a metered request pays it first.
        if let Some(denied) = self.pay_regional_debt(request, &bundle).await {
            return Ok(denied);
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
                return Ok(refused(
                    request,
                    version,
                    None,
                    Reason::PolicyError,
                    POLICY_UNAVAILABLE_RETRY_MS,
                ));
            }
        };
        let screened = match &planned {
            None => None,
            Some(planned) => match self
                .limiter
                .screen(planned, self.source_of(request).as_ref())
            {
                Ok(screened) => Some(screened),
                Err(denied) => return Ok(self.with_jitter(denied.to_contract(planned), planned)),
            },
        };
        // 2. Global rules: reserved, not yet spent. A shadow global rule is only counted.
        let (shadow_rules, global_rules) = global_rules_of(&bundle, request);
        let hold = match self.reserve_global(request, version, &global_rules).await {
            Ok(hold) => hold,
            Err(denied) => return Ok(denied),
        };
        // 3. Regional rules, within the hold.
        let (mut decision, replayed) = match (&planned, screened) {
            (Some(planned), Some(screened)) => {
                self.decide_regional_in_time(request, planned, screened)
                    .await
            }
            _ => {
                let admitted = admitted_by_global_rules_only(request, version);
                (self.with_pool_figures(admitted, &hold), false)
            }
        };
        // 4. Settle. A dry run spends nothing: its reservations are cancelled.
        if request.dry_run {
            decision.fallback |= decision.allowed && hold.uses_fallback();
            drop(hold);
        } else if decision.allowed && replayed {
            // The store answered a retry with the admission its original made (this agent forgot
            // it, restarted, or is another agent of the region): that admission spent the global
            // rules, so this one spends nothing.
            metrics::counter!(crate::metrics::REPLAYED_ADMISSIONS, "tier" => "store").increment(1);
            drop(hold);
        } else if decision.allowed {
            decision.fallback |= self.commit_global(request, hold);
            self.count_shadow_usage(request, &shadow_rules).await;
            if request.metered {
                decision.settle_by_ms = Some(self.open_settlement(request, bundle.clone()));
            }
        } else {
            drop(hold);
        }
        Ok(decision)
    }

    /// Counts an admitted request against its shadow global rules' pools, per window, for the
    /// ledger: what enforcing them would have spent. A pool whose terms cannot be had is not
    /// counted (the windows are in them).
    pub(super) async fn count_shadow_usage(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        rules: &[&Rule],
    ) {
        for rule in rules {
            let Limit::Global(pool) = &rule.limit else {
                continue;
            };
            let Some(slot) = self.slot(&request.tenant_id, pool).await else {
                continue;
            };
            let cost_tokens = global_cost_tokens(rule, request);
            lock(&slot.agent).count_shadow(cost_tokens, self.clock.now_ms());
            // Journaled, so that a restart goes on counting the window rather than from zero.
            self.note_change();
            metrics::counter!(crate::metrics::SHADOW_ADMITTED_TOKENS,
                "tenant" => request.tenant_id.to_string(), "pool" => pool.to_string())
            .increment(cost_tokens);
        }
    }

    /// The first `strict` rule that applies to `request`, when the bundle is past its maximum age.
    /// Shadow and soft rules never deny, stale or not.
    pub(super) fn stale_strict_rule<'b>(
        &self,
        bundle: &'b PolicyBundle,
        request: &AdmissionRequest,
    ) -> Option<&'b Rule> {
        if !self.bundle_is_stale() {
            return None;
        }
        let (tenant, route, kind) = (
            &request.tenant_id,
            &request.route_group,
            request.principal.kind,
        );
        bundle
            .regional_rules_for(tenant, route, kind)
            .into_iter()
            .chain(bundle.global_rules_for(tenant, route, kind))
            .find(|rule| rule.strict && !rule.mode.is_advisory())
    }

    /// Reserves every global rule's cost, in bundle order; the first refusal cancels what was
    /// reserved and is the decision. See [`reserve_global_all`](Self::reserve_global_all).
    pub(super) async fn reserve_global(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        version: u64,
        rules: &[&Rule],
    ) -> Result<GlobalHold, Decision> {
        // Most requests have no global rule: nothing to look up, nothing to allocate.
        if rules.is_empty() {
            return Ok(GlobalHold::default());
        }
        let mut holds = self
            .reserve_global_all(&[(request, rules)], version)
            .await?;
        Ok(holds.pop().unwrap_or_default())
    }

    /// Spends `request`'s admitted hold: its reservations committed, the report loop told.
    /// Whether any came from a fallback allowance. No await: a call dropped after the decision
    /// cannot leave part of it committed.
    pub(super) fn commit_global(&self, request: &AdmissionRequest, hold: GlobalHold) -> bool {
        if hold.held.is_empty() {
            return false;
        }
        let fallback = hold.commit(&request.tenant_id);
        self.note_change();
        fallback
    }

    /// Reserves the global rules of several requests, all or none: a hold per request, or the
    /// first refusal (of the request it names), with everything reserved cancelled.
    ///
    /// Nothing is held while anything is awaited, so a reservation never outlives the regional
    /// hold: every rule's pool is looked up first; then one pass reserves every rule of every
    /// request with no wait in between. A rule that must wait (for a renewal under way, or for a
    /// fallback claim to be written) ends the pass: everything held is cancelled, the wait happens,
    /// and the pass starts again (each kind of wait at most once).
    pub(super) async fn reserve_global_all(
        self: &Arc<Self>,
        requests: &[(&AdmissionRequest, &[&Rule])],
        version: u64,
    ) -> Result<Vec<GlobalHold>, Decision> {
        // (the request's index, its rule, the rule's pool and slot), in order.
        let mut pools: Vec<(usize, &Rule, &PoolId, Arc<PoolSlot>)> = Vec::new();
        for (index, (request, rules)) in requests.iter().enumerate() {
            for rule in rules.iter() {
                let Limit::Global(pool) = &rule.limit else {
                    continue;
                };
                match self.slot(&request.tenant_id, pool).await {
                    Some(slot) => pools.push((index, rule, pool, slot)),
                    None => return Err(self.global_denial(request, version, rule, fail_closed())),
                }
            }
        }
        let (mut waited_for_grant, mut claimed) = (false, false);
        for _pass in 0..MAX_RESERVATION_PASSES {
            let mut holds: Vec<GlobalHold> =
                requests.iter().map(|_| GlobalHold::default()).collect();
            let mut wait = None;
            for (at, (index, rule, pool, slot)) in pools.iter().enumerate() {
                let request = requests[*index].0;
                let tenant = &request.tenant_id;
                let cost_tokens = global_cost_tokens(rule, request);
                match self.try_reserve(tenant, pool, slot, cost_tokens, request.dry_run) {
                    Attempt::Reserved(reservation) => {
                        holds[*index]
                            .held
                            .push((slot.clone(), reservation, rule.id.clone()));
                    }
                    Attempt::Evicted => {
                        wait = Some((at, Wait::Lookup));
                        break;
                    }
                    Attempt::Refused(refusal)
                        if request.dry_run && refusal.denial == Denial::FallbackUnclaimed =>
                    {
                        // Would be admitted once claimed; a dry run claims nothing.
                        holds[*index].would_claim_fallback = true;
                    }
                    Attempt::Refused(refusal) => {
                        if !waited_for_grant && !request.dry_run {
                            count_depletion(tenant, pool, refusal.denial);
                        }
                        let next = match refusal.denial {
                            Denial::AwaitingGrant if !waited_for_grant => Some(Wait::Grant),
                            Denial::FallbackUnclaimed if !claimed => Some(Wait::Claim(cost_tokens)),
                            _ => None,
                        };
                        let Some(next) = next else {
                            let limit_tokens = slot.limit.at(self.clock.now_ms());
                            let refused = GlobalRefusal {
                                refusal,
                                limit_tokens,
                            };
                            return Err(self.global_denial(request, version, rule, refused));
                        };
                        wait = Some((at, next));
                        break;
                    }
                }
            }
            let Some((at, wait)) = wait else {
                return Ok(holds);
            };
            // Nothing stays reserved while this request waits.
            drop(holds);
            let (index, rule, pool, slot) = &mut pools[at];
            let request = requests[*index].0;
            let tenant = &request.tenant_id;
            match wait {
                Wait::Lookup => match self.slot(tenant, pool).await {
                    Some(fresh) => *slot = fresh,
                    None => return Err(self.global_denial(request, version, rule, fail_closed())),
                },
                Wait::Grant => {
                    waited_for_grant = true;
                    self.wait_for_renewal(tenant, pool, slot).await;
                }
                Wait::Claim(cost_tokens) => {
                    claimed = true;
                    if !self.claim_fallback(tenant, pool, slot, cost_tokens).await {
                        return Err(self.global_denial(request, version, rule, fail_closed()));
                    }
                }
            }
        }
        let Some((index, rule, _, slot)) = pools.last() else {
            return Ok(requests.iter().map(|_| GlobalHold::default()).collect());
        };
        let refused = GlobalRefusal {
            refusal: Refusal {
                denial: Denial::AwaitingGrant,
                retry_after_ms: AWAITING_GRANT_RETRY_MS,
            },
            limit_tokens: slot.limit.at(self.clock.now_ms()),
        };
        Err(self.global_denial(requests[*index].0, version, rule, refused))
    }

    /// One reservation attempt on a pool's holder, without waiting for anything; starts a renewal
    /// when the holder wants one.
    fn try_reserve(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
        cost_tokens: u64,
        dry_run: bool,
    ) -> Attempt {
        let now_ms = self.clock.now_ms();
        let reserved = {
            let mut agent = lock(&slot.agent);
            // Forgotten since it was looked up (idle for minutes): look it up again.
            if slot.evicted.load(Ordering::Acquire) {
                return Attempt::Evicted;
            }
            agent.reserve(cost_tokens, now_ms, self.allocator_reachable(), dry_run)
        };
        self.renew_if_wanted(tenant, pool, slot);
        match reserved {
            Ok(reservation) => Attempt::Reserved(reservation),
            Err(refusal) => Attempt::Refused(refusal),
        }
    }

    /// Waits (up to [`FIRST_GRANT_WAIT`]) for the renewal under way for `slot`, if any.
    async fn wait_for_renewal(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
    ) {
        // Registered before a renewal can start (or be seen as under way), so its end cannot be
        // missed.
        let renewed = slot.renewed.notified();
        tokio::pin!(renewed);
        renewed.as_mut().enable();
        self.renew_if_wanted(tenant, pool, slot);
        // None under way: it already ended, or none was wanted; try again at once. One unanswered
        // past the holder's patience makes the next try fall back.
        if lock(&slot.agent).renewal_in_flight() {
            let _ = tokio::time::timeout(FIRST_GRANT_WAIT, renewed).await;
        }
    }

    /// The regional rules, answered `LIMITER_UNAVAILABLE` past the [regional
    /// hold](Self::regional_hold) (concurrency slots that may have been taken are released); with
    /// whether the store replayed a recorded admission of the same request id.
    async fn decide_regional_in_time(
        &self,
        request: &AdmissionRequest,
        planned: &PlannedBatch<'_>,
        screened: Screened,
    ) -> (Decision, bool) {
        // A dry run takes no slot (module docs).
        let slots = if request.dry_run {
            Vec::new()
        } else {
            concurrency_calls(planned, request)
        };
        match tokio::time::timeout(
            self.regional_hold(),
            self.decide_regional(request, planned, screened, &slots),
        )
        .await
        {
            Ok(decision) => decision,
            Err(_elapsed) => {
                tracing::warn!("regional rules not decided within the hold");
                let calls: Vec<&LeaseCall> = slots.iter().map(|(_, call)| call).collect();
                self.release_all(&calls).await;
                let decision = refused(
                    request,
                    planned.policy_version,
                    None,
                    Reason::LimiterUnavailable,
                    POLICY_UNAVAILABLE_RETRY_MS,
                );
                (decision, false)
            }
        }
    }

    /// Concurrency slots (a slot per rule that has a cap, given back if the request is not
    /// admitted; the gateway releases them when the request ends, a crashed holder's slot lapses
    /// with its TTL), then one store call for the rate rules.
    async fn decide_regional(
        &self,
        request: &AdmissionRequest,
        planned: &PlannedBatch<'_>,
        screened: Screened,
        slots: &[(usize, LeaseCall)],
    ) -> (Decision, bool) {
        let store_deadline = self.store_deadline();
        let slots: Vec<SlotCall<'_, '_>> = slots
            .iter()
            .map(|(rule_index, call)| (request, planned, *rule_index, call))
            .collect();
        let SlotsHeld { held, fallback } = match self.acquire_slots(&slots, store_deadline).await {
            Ok(taken) => taken,
            Err(denial) => return (denial, false),
        };
        let decided = self
            .limiter
            .decide_screened_until(planned, screened, store_deadline)
            .await;
        let replayed = matches!(&decided.verdict, Verdict::Store(store) if store.replayed);
        let mut decision = self.with_jitter(decided.to_contract(planned), planned);
        decision.fallback |= fallback;
        if !decision.allowed {
            self.release_all(&held).await;
        }
        (decision, replayed)
    }

    /// When every store call of a decision must end: early enough for the fail modes to answer
    /// within the hold (half a budget to spare, for a thread that runs late), so a hung store costs
    /// a local_bounded rule its local bucket's answer, never a 503.
    pub(super) fn store_deadline(&self) -> tokio::time::Instant {
        crate::clock::monotonic_now() + self.regional_hold() - self.limiter.decision_budget() / 2
    }

    /// Takes every concurrency slot of `slots` (the request, its plan, the rule's index in it, the
    /// call) by `deadline`. A slot refused, or a `closed` rule's lease call failed, ends it: what
    /// was taken is released and `Err` is the denial. A `local_bounded` rule's failed call is
    /// passed over (its rate rule's local bucket still bounds the request) and marks the answer as
    /// fallback.
    pub(super) async fn acquire_slots<'c>(
        &self,
        slots: &[SlotCall<'c, '_>],
        deadline: tokio::time::Instant,
    ) -> Result<SlotsHeld<'c>, Decision> {
        let mut taken = SlotsHeld {
            held: Vec::new(),
            fallback: false,
        };
        for &(request, planned, rule_index, call) in slots {
            let Some(rule) = planned.rules.get(rule_index) else {
                continue;
            };
            let refusal = match self
                .limiter
                .lease_until(LeaseOp::Acquire, call, deadline)
                .await
            {
                Ok(outcome) if outcome.held => {
                    taken.held.push(call);
                    continue;
                }
                Ok(_) => {
                    crate::limiter::concurrency_denial(planned, rule_index, CONCURRENCY_RETRY_MS)
                }
                Err(error) => {
                    tracing::warn!(%error, rule = %rule.id, "concurrency lease call failed");
                    if !matches!(rule.fail_mode, FailMode::Closed) {
                        taken.fallback = true;
                        continue;
                    }
                    refused(
                        request,
                        planned.policy_version,
                        Some(rule),
                        Reason::LimiterUnavailable,
                        POLICY_UNAVAILABLE_RETRY_MS,
                    )
                }
            };
            self.release_all(&taken.held).await;
            return Err(refusal);
        }
        Ok(taken)
    }

    pub(super) async fn release_all(&self, calls: &[&LeaseCall]) {
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
        request.validate()?;
        let slots = self.slots_of(request);
        let calls: Vec<&LeaseCall> = slots.iter().collect();
        self.release_all(&calls).await;
        Ok(())
    }

    /// The concurrency slots `request` holds under the bundle in force: none without a bundle, or
    /// when the request cannot be planned against it (it could not have taken one either).
    fn slots_of(&self, request: &AdmissionRequest) -> Vec<LeaseCall> {
        let Some(bundle) = self.bundle.load() else {
            return Vec::new();
        };
        let Ok(Some(planned)) = plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) else {
            return Vec::new();
        };
        concurrency_calls(&planned, request)
            .into_iter()
            .map(|(_, call)| call)
            .collect()
    }

    /// Extends the concurrency slots `request` holds by their lease TTL: a heartbeat for a long
    /// request (an export) that must keep its slot past the TTL. Call it more often than the TTL.
    /// A slot that already lapsed is not taken again (the cap may be full by now): it counts as
    /// lapsed.
    pub async fn renew(&self, request: &AdmissionRequest) -> Result<SlotRenewal, RequestRejected> {
        request.validate()?;
        let mut renewal = SlotRenewal::default();
        for call in self.slots_of(request) {
            match self.limiter.lease(LeaseOp::Renew, &call).await {
                Ok(outcome) if outcome.held => renewal.renewed += 1,
                Ok(_) => renewal.lapsed += 1,
                Err(error) => {
                    tracing::warn!(%error, "concurrency slot not renewed");
                    renewal.failed += 1;
                }
            }
        }
        Ok(renewal)
    }

    /// The decision for a global rule's refusal.
    fn global_denial(
        &self,
        request: &AdmissionRequest,
        version: u64,
        rule: &Rule,
        refused: GlobalRefusal,
    ) -> Decision {
        let Refusal {
            denial,
            retry_after_ms,
        } = refused.refusal;
        let (reason, fallback, retry_after_ms) = match denial {
            Denial::PoolExhausted => (Reason::RateExceeded, false, jittered(retry_after_ms)),
            Denial::FallbackSpent => (Reason::RateExceeded, true, jittered(retry_after_ms)),
            // The window's quota can no longer be leased; the pool refills when it ends.
            Denial::WindowEnding => (Reason::RateExceeded, false, jittered(retry_after_ms)),
            // Tokens are on their way: a burst beyond what is held, not an outage.
            Denial::AwaitingGrant => (
                Reason::RateExceeded,
                false,
                jittered(retry_after_ms.max(AWAITING_GRANT_RETRY_MS)),
            ),
            Denial::CostAboveChunk => (Reason::CostTooHigh, false, -1),
            // A fallback claim that could not be made durable: refused rather than admitted
            // beyond what a restart would know. At a window's edge, the agent cannot tell which
            // window the allocator's clock is in: refused until the edge has passed.
            Denial::FailClosed | Denial::FallbackUnclaimed | Denial::FallbackAtWindowEdge => (
                Reason::LimiterUnavailable,
                false,
                i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
            ),
        };
        Decision {
            allowed: false,
            decision_id: request.request_id.clone(),
            policy_id: Some(rule.id.to_string()),
            policy_version: version,
            denied_scope: Some(DeniedScope::Global),
            reason: Some(reason),
            limit_units: refused.limit_tokens,
            remaining_units: 0,
            retry_after_ms,
            fallback,
            dry_run: false,
            violations: Vec::new(),
            settle_by_ms: None,
        }
    }

    /// An admission by global rules alone, naming its most constraining pool (the smallest share
    /// left) with the figures `GET /v1/quota` shows: `G`, and what is left as the allocator last
    /// said plus what this agent holds (what it holds, before the allocator's first answer in the
    /// window), after this request.
    pub(super) fn with_pool_figures(&self, mut decision: Decision, hold: &GlobalHold) -> Decision {
        let now_ms = self.clock.now_ms();
        let mut most_constraining: Option<(&RuleId, u64, u64)> = None;
        for (slot, _, rule_id) in &hold.held {
            let figures = super::quota::pool_figures(slot, now_ms);
            let remaining_tokens = figures
                .remaining_tokens
                .unwrap_or(figures.held_tokens)
                .min(figures.limit_tokens);
            let tighter = most_constraining.is_none_or(|(_, remaining, limit)| {
                u128::from(remaining_tokens) * u128::from(limit)
                    < u128::from(remaining) * u128::from(figures.limit_tokens)
            });
            if tighter {
                most_constraining = Some((rule_id, remaining_tokens, figures.limit_tokens));
            }
        }
        if let Some((rule_id, remaining_tokens, limit_tokens)) = most_constraining {
            decision.policy_id = Some(rule_id.to_string());
            decision.limit_units = limit_tokens;
            decision.remaining_units = remaining_tokens;
        }
        decision
    }

    /// `decision` with jitter on its retry hint when a window rule denied it at its edge (I5).
    pub(super) fn with_jitter(
        &self,
        mut decision: Decision,
        planned: &PlannedBatch<'_>,
    ) -> Decision {
        if decision.allowed || decision.reason != Some(Reason::RateExceeded) {
            return decision;
        }
        let windowed = planned.rules.iter().any(|rule| {
            Some(rule.id.as_str()) == decision.policy_id.as_deref()
                && matches!(
                    rule.limit,
                    Limit::Regional(Algorithm::FixedWindow(_) | Algorithm::SlidingCounter(_))
                )
        });
        if windowed && let Ok(retry_ms) = u64::try_from(decision.retry_after_ms) {
            decision.retry_after_ms = jittered(retry_ms);
        }
        decision
    }
}

/// A global rule's cost for `request`, whole tokens (pools count whole tokens; policy validation
/// keeps a global rule's cost a multiple of 1,000 millitokens), at least 1.
pub(super) fn global_cost_tokens(rule: &Rule, request: &AdmissionRequest) -> u64 {
    rule.cost_millitokens_for(request.cost_hint)
        .map_or(u64::MAX, |millitokens| {
            millitokens / allot_shared::MILLITOKENS_PER_TOKEN
        })
        .max(1)
}

/// Counts a request that found its pool's leases empty: while tokens may still be had
/// (`available`) or because the pool is exhausted.
fn count_depletion(tenant: &TenantId, pool: &PoolId, denial: Denial) {
    let pool_state = match denial {
        Denial::AwaitingGrant => "available",
        Denial::PoolExhausted => "exhausted",
        _ => return,
    };
    metrics::counter!(crate::metrics::LEASE_DEPLETIONS,
        "tenant" => tenant.to_string(), "pool" => pool.to_string(),
        "pool_state" => pool_state)
    .increment(1);
}

/// `retry_ms` plus a uniform random delay of up to [`RETRY_JITTER_MAX_MS`], as a wire hint.
fn jittered(retry_ms: u64) -> i64 {
    let jitter_ms = rand::random_range(0..=RETRY_JITTER_MAX_MS);
    i64::try_from(retry_ms.saturating_add(jitter_ms)).unwrap_or(i64::MAX)
}

/// The concurrency slot calls of a planned request: (rule index, call), one per rule with a cap.
pub(super) fn concurrency_calls(
    planned: &PlannedBatch<'_>,
    request: &AdmissionRequest,
) -> Vec<(usize, LeaseCall)> {
    planned
        .rules
        .iter()
        .zip(planned.batch.rules())
        .enumerate()
        .filter_map(|(index, (rule, batch_rule))| {
            let semaphore = rule.concurrency?;
            LeaseCall::new(
                allot_shared::keys::concurrency_key(batch_rule.key()),
                semaphore.max_in_flight(),
                semaphore.lease_ttl_ms(),
                request.request_id.clone(),
            )
            .ok()
            .map(|call| (index, call))
        })
        .collect()
}

/// The `COST_TOO_HIGH` refusal of a request whose cost a regional rule that applies could never
/// admit, whatever its state: above an enforced rule's capacity or window limit, or not a valid
/// cost at all (beyond 2^40 millitokens, or overflowing `costMillis x costHint`), which no rule,
/// advisory or not, can be asked about. Decided from the bundle alone, before any store call, so a
/// huge `costHint` is the client's error (429, never retried), not an outage.
pub(super) fn inadmissible_cost(
    bundle: &PolicyBundle,
    request: &AdmissionRequest,
    version: u64,
    settings: &AgentSettings,
) -> Option<Decision> {
    let mut rules = bundle.regional_rules_for(
        &request.tenant_id,
        &request.route_group,
        request.principal.kind,
    );
    lay_principal_overrides(
        bundle,
        &mut rules,
        &request.tenant_id,
        &request.principal,
        settings,
    );
    let (rule, algorithm) = rules.into_iter().find_map(|rule| {
        let Limit::Regional(algorithm) = &rule.limit else {
            return None;
        };
        let cost = rule.cost_millitokens_for(request.cost_hint);
        let valid = cost.filter(|&c| (1..=allot_shared::MAX_RULE_PARAMETER).contains(&c));
        let refused = match valid {
            None => true,
            Some(_) if rule.mode.is_advisory() => false,
            Some(cost) => !algorithm.can_ever_admit(cost),
        };
        refused.then_some((rule, algorithm))
    })?;
    let mut decision = refused(request, version, Some(rule), Reason::CostTooHigh, 0);
    decision.limit_units = crate::limiter::algorithm_limit_units(algorithm);
    decision.retry_after_ms = -1;
    Some(decision)
}

/// Whether any rule that applies to `request` is `idempotent`: a retry with the same request id is
/// then the same request, on every tier.
fn applies_idempotent_rule(bundle: &PolicyBundle, request: &AdmissionRequest) -> bool {
    let (tenant, route, kind) = (
        &request.tenant_id,
        &request.route_group,
        request.principal.kind,
    );
    bundle
        .regional_rules_for(tenant, route, kind)
        .into_iter()
        .chain(bundle.global_rules_for(tenant, route, kind))
        .any(|rule| rule.idempotent)
}

/// An admission by global rules alone (no regional rule applies).
pub(super) fn admitted_by_global_rules_only(request: &AdmissionRequest, version: u64) -> Decision {
    Decision {
        allowed: true,
        decision_id: request.request_id.clone(),
        policy_id: None,
        policy_version: version,
        denied_scope: None,
        reason: None,
        limit_units: 0,
        remaining_units: 0,
        retry_after_ms: 0,
        fallback: false,
        dry_run: false,
        violations: Vec::new(),
        settle_by_ms: None,
    }
}

/// `request`'s global rules in `bundle`: (the advisory ones, only counted; the enforced ones).
pub(super) fn global_rules_of<'b>(
    bundle: &'b PolicyBundle,
    request: &AdmissionRequest,
) -> (Vec<&'b Rule>, Vec<&'b Rule>) {
    bundle
        .global_rules_for(
            &request.tenant_id,
            &request.route_group,
            request.principal.kind,
        )
        .into_iter()
        .partition(|rule| rule.mode.is_advisory())
}

/// A refusal that no budget decided (no bundle, policy error, an outage).
pub(super) fn refused(
    request: &AdmissionRequest,
    version: u64,
    rule: Option<&Rule>,
    reason: Reason,
    retry_after_ms: u64,
) -> Decision {
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: rule.map(|r| r.id.to_string()),
        policy_version: version,
        denied_scope: rule.map(|r| r.scope.denied_scope()),
        reason: Some(reason),
        limit_units: 0,
        remaining_units: 0,
        retry_after_ms: i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
        fallback: false,
        dry_run: false,
        violations: Vec::new(),
        settle_by_ms: None,
    }
}
