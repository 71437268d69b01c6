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
//! request waits up to [`FIRST_GRANT_WAIT`](super::settings::FIRST_GRANT_WAIT) for the renewal it triggered).

use allot_shared::contract::{AdmissionRequest, AdvisoryMode, Decision, DeniedScope, Reason};
use allot_shared::policy::{Limit, PolicyBundle, Rule};
use std::sync::Arc;

use super::bundle::lay_principal_overrides;
use super::pools::global_cost_tokens;
use super::regional::refused;
use super::replays::{Begin, ORIGINAL_WAIT, Ticket};
use super::settings::AgentSettings;
use super::settings::POLICY_UNAVAILABLE_RETRY_MS;
use super::{Agent, RequestRejected};
use crate::limiter::plan_request;

/// What a heartbeat ([`Agent::renew`]) did to the concurrency slots of a request.
pub use allot_shared::contract::SlotRenewal;

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
    ///
    /// Long by design: its four numbered steps are the admission's order (refusals from memory,
    /// global rules reserved, regional rules decided within the hold, then settled), and the global
    /// hold taken in step 2 must be committed or dropped in step 4 on every path; in one body, what
    /// becomes of the hold on each path can be read at once.
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
        let (decision, replayed) = match (&planned, screened) {
            (Some(planned), Some(screened)) => {
                self.decide_regional_in_time(request, planned, screened)
                    .await
            }
            _ => (admitted_by_global_rules_only(request, version), false),
        };
        // Named by its most constraining rule, its pools included.
        let mut decision = self.with_pool_figures(decision, &hold);
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
            slot.agent().count_shadow(cost_tokens, self.clock.now_ms());
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
