//! Metered admissions, settled after the response (`POST /v1/settle`).
//!
//! A metered admission (`"metered": true`) is decided and charged like any other, with its
//! `costHint` as an *estimate*; the gateway then states the actual cost (model tokens, bytes,
//! rows) within the settle window, once, by decision id. What happens to the difference:
//! - **Below the estimate**: nothing is given back (`unused`; no refunds, architecture invariant 4).
//!   Gateways that cannot estimate well should estimate low and let the extra be charged.
//! - **Above it**, the extra is charged where the estimate was:
//!   - each regional rule of the admission, in one all-or-nothing store call (the same script,
//!     a fresh decision id); denied, the extra becomes the principal's *regional debt*, which
//!     its next admission pays first (one more store call, for the same rules), at most one full
//!     limit of the rule that denied it (a principal that could never pay more is not locked out
//!     for ever); beyond it, or unpaid for [`REGIONAL_DEBT_TTL_MS`], it is written off and counted;
//!   - each global pool, through its holder: spent at once from the region's leases as far as
//!     they go, the rest owed and paid first from the next tokens the region holds, up to the
//!     pool's `settleDebtPerRegion` (this agent's share of it); beyond it, written off. Debt and
//!     write-offs are reported to the ledger per window, and the debt is a term of the overshoot
//!     bound.
//!
//! Unsettled admissions expire into their estimate. Everything here is bounded (I10): the open
//! admissions ([`MAX_OPEN_SETTLEMENTS`], the oldest pushed out first, into its estimate), the
//! debtors ([`MAX_REGIONAL_DEBTORS`]) and the settle window itself. Open admissions and regional
//! debt live in memory: an agent restart settles nothing more (the estimates stand) and forgets
//! regional debt; a pool's debt is journaled with its holder when the agent has a state directory.

use std::sync::Arc;

use allot_shared::contract::{
    AdmissionRequest, Charge, Decision, PoolCharge, SettleAnswer, SettleRequest,
};
use allot_shared::ids::{DecisionId, LeaseId};
use allot_shared::keys;
use allot_shared::policy::{Limit, PolicyBundle};

use super::pools::global_cost_tokens;
use super::settlements::{Begun, DebtorKey};
pub use super::settlements::{
    MAX_OPEN_SETTLEMENTS, MAX_REGIONAL_DEBTORS, REGIONAL_DEBT_TTL_MS, SettleError,
};
use super::{Agent, lock};
use crate::limiter::plan_request;

impl Agent {
    /// Opens an admitted metered request for settlement; returns its settle deadline, epoch ms.
    pub(super) fn open_settlement(
        &self,
        request: &AdmissionRequest,
        bundle: Arc<PolicyBundle>,
    ) -> u64 {
        let now_ms = self.clock.now_ms();
        let settle_by_ms = now_ms.saturating_add(self.settings.settle_window_ms);
        let mut settlements = lock(&self.settlements);
        settlements.prune(now_ms);
        settlements.insert(request, bundle, settle_by_ms)
    }

    /// Settles a metered admission's actual cost (module docs). Idempotent by decision id: the
    /// same actual cost again gets the first answer, marked `replayed`.
    pub async fn settle(
        self: &Arc<Self>,
        body: &SettleRequest,
    ) -> Result<SettleAnswer, SettleError> {
        body.validate().map_err(SettleError::Invalid)?;
        let actual_units = body.actual_cost_units;
        let key = (body.tenant_id.clone(), body.decision_id.clone());
        let begun = {
            let mut settlements = lock(&self.settlements);
            settlements.prune(self.clock.now_ms());
            settlements.begin(&key, actual_units)?
        };
        let (request, bundle) = match begun {
            Begun::Replayed(answer) => return Ok(answer),
            Begun::Charge { request, bundle } => (request, bundle),
        };
        // Charged in a task of its own: a gateway that goes away mid-settlement must not leave
        // it half done (a retry could not tell what was charged).
        let outcome = match actual_units.cmp(&request.cost_hint) {
            std::cmp::Ordering::Equal => "exact",
            std::cmp::Ordering::Greater => "under",
            std::cmp::Ordering::Less => "over",
        };
        metrics::counter!(crate::metrics::SETTLEMENTS, "outcome" => outcome).increment(1);
        let agent = self.clone();
        let charged =
            tokio::spawn(async move { agent.charge_extra(&request, &bundle, actual_units).await })
                .await;
        match charged {
            Ok(answer) => {
                lock(&self.settlements).finish(&key, Some(answer.clone()))?;
                Ok(answer)
            }
            Err(error) => {
                // The charge's task panicked: nothing of it is known to have happened.
                tracing::error!(%error, "a settlement's charge failed");
                lock(&self.settlements).finish(&key, None)?;
                Err(SettleError::Conflict(
                    "the settlement could not be completed; send it again".to_owned(),
                ))
            }
        }
    }

    /// Charges `request`'s cost once its response is done, for gateways that can only say what a
    /// request cost then (Envoy's rate limit filter applied on stream done: an RLS descriptor with
    /// `allot_charge: after_response`). It is the settlement of a metered admission estimated at
    /// 0: never denied (the response is gone), charged at once where it fits, owed where it does
    /// not, written off and counted beyond. `None` before the agent has a bundle. Not idempotent:
    /// such calls carry no stable id.
    pub async fn charge_after_response(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Option<SettleAnswer> {
        let bundle = self.bundle()?;
        metrics::counter!(crate::metrics::SETTLEMENTS, "outcome" => "after_response").increment(1);
        let unestimated = AdmissionRequest {
            cost_hint: 0,
            metered: false,
            dry_run: false,
            ..request.clone()
        };
        let actual_units = request.cost_hint;
        // In a task of its own, as a settlement: a caller gone mid-charge leaves it whole.
        let agent = self.clone();
        tokio::spawn(async move {
            agent
                .charge_extra(&unestimated, &bundle, actual_units)
                .await
        })
        .await
        .ok()
    }

    /// Charges what `actual_units` costs beyond the estimate `request` was admitted with.
    async fn charge_extra(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        bundle: &PolicyBundle,
        actual_units: u64,
    ) -> SettleAnswer {
        let estimate_units = request.cost_hint;
        let extra_units = actual_units.saturating_sub(estimate_units);
        let unused_units = estimate_units.saturating_sub(actual_units);
        metrics::counter!(crate::metrics::SETTLE_UNUSED_UNITS).increment(unused_units);
        let (regional, pools) = if extra_units == 0 {
            (Charge::default(), Vec::new())
        } else {
            let regional = self.charge_regional(request, bundle, extra_units).await;
            let pools = self.charge_global(request, bundle, actual_units).await;
            (regional, pools)
        };
        SettleAnswer {
            decision_id: request.request_id.clone(),
            estimate_units,
            actual_cost_units: actual_units,
            unused_units,
            extra_units,
            regional,
            pools,
            replayed: false,
        }
    }

    /// Charges `extra_units` to the regional rules of `request` in one all-or-nothing store call;
    /// refused, they become the principal's debt.
    async fn charge_regional(
        &self,
        request: &AdmissionRequest,
        bundle: &PolicyBundle,
        extra_units: u64,
    ) -> Charge {
        let charge = charge_request(request, extra_units, false);
        let decision = match self.decide_regional_charge(bundle, &charge).await {
            RegionalCharge::NoRules => return Charge::default(),
            RegionalCharge::Decided(decision) => decision,
        };
        if decision.allowed {
            metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "paid")
                .increment(extra_units);
            return Charge {
                paid: extra_units,
                ..Charge::default()
            };
        }
        // One full limit of the rule that refused: what it can pay from empty.
        let cap_units = decision.limit_units.max(1);
        let key = self.debtor_key(request);
        let charge =
            lock(&self.settlements).owe(key, request, extra_units, cap_units, self.clock.now_ms());
        metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "owed")
            .increment(charge.owed);
        metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "written_off")
            .increment(charge.written_off);
        charge
    }

    /// The store call of a regional charge (or debt payment): `request` (its cost the amount to
    /// charge) against `bundle`'s regional rules.
    async fn decide_regional_charge(
        &self,
        bundle: &PolicyBundle,
        request: &AdmissionRequest,
    ) -> RegionalCharge {
        let planned = match plan_request(
            bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) {
            Ok(Some(planned)) => planned,
            Ok(None) => return RegionalCharge::NoRules,
            Err(error) => {
                tracing::error!(%error, "a charge cannot be planned against the bundle");
                return RegionalCharge::NoRules;
            }
        };
        let decision = match self
            .limiter
            .screen(&planned, self.source_of(request).as_ref())
        {
            Ok(screened) => self.limiter.decide_screened(&planned, screened).await,
            Err(denied) => denied,
        };
        RegionalCharge::Decided(decision.to_contract(&planned))
    }

    /// Charges each global pool of `request` what `actual_units` costs it beyond the estimate.
    async fn charge_global(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        bundle: &PolicyBundle,
        actual_units: u64,
    ) -> Vec<PoolCharge> {
        let actual = AdmissionRequest {
            cost_hint: actual_units,
            ..request.clone()
        };
        let rules = bundle.global_rules_for(
            &request.tenant_id,
            &request.route_group,
            request.principal.kind,
        );
        let mut charges = Vec::new();
        for rule in rules.into_iter().filter(|rule| !rule.mode.is_advisory()) {
            let Limit::Global(pool) = &rule.limit else {
                continue;
            };
            // Nothing was estimated for a charge after the response (not even a pool's one-token
            // minimum).
            let estimated_tokens = if request.cost_hint == 0 {
                0
            } else {
                global_cost_tokens(rule, request)
            };
            let extra_tokens = global_cost_tokens(rule, &actual).saturating_sub(estimated_tokens);
            if extra_tokens == 0 {
                continue;
            }
            let count = |outcome: &'static str, tokens: u64| {
                metrics::counter!(crate::metrics::SETTLE_GLOBAL_TOKENS,
                    "tenant" => request.tenant_id.to_string(), "pool" => pool.to_string(),
                    "outcome" => outcome)
                .increment(tokens);
            };
            let Some(slot) = self.slot(&request.tenant_id, pool).await else {
                // The pool's terms cannot be had: nothing can be charged, and it is counted.
                count("written_off", extra_tokens);
                charges.push(PoolCharge {
                    pool: pool.clone(),
                    paid: 0,
                    owed: 0,
                    written_off: extra_tokens,
                });
                continue;
            };
            let now_ms = self.clock.now_ms();
            let charged = slot.agent().charge(extra_tokens, now_ms);
            for (outcome, tokens) in [
                ("paid", charged.paid_tokens),
                ("owed", charged.owed_tokens),
                ("written_off", charged.written_off_tokens),
            ] {
                count(outcome, tokens);
            }
            self.note_change();
            self.renew_if_wanted(&request.tenant_id, pool, &slot);
            charges.push(PoolCharge {
                pool: pool.clone(),
                paid: charged.paid_tokens,
                owed: charged.owed_tokens,
                written_off: charged.written_off_tokens,
            });
        }
        charges
    }

    /// Before a principal's admission: pays the regional debt it owes, against the rules of the
    /// request that incurred it. Returns the denial when the debt cannot be paid yet (the request
    /// is then denied, and nothing else is charged); a debt that can never be paid (above what
    /// the rules admit at once now) is written off. A dry run pays nothing, but is denied as the
    /// real request would be.
    pub(super) async fn pay_regional_debt(
        &self,
        request: &AdmissionRequest,
        bundle: &PolicyBundle,
    ) -> Option<Decision> {
        if !lock(&self.settlements).has_debtors(&request.tenant_id) {
            return None;
        }
        let key = self.debtor_key(request);
        let debt = lock(&self.settlements).take_debt(&key)?;
        let payment = charge_request(&debt.request, debt.owed_units, request.dry_run);
        let decision = match self.decide_regional_charge(bundle, &payment).await {
            RegionalCharge::NoRules => {
                // No regional rule applies to it any more: nothing left to pay it to.
                if request.dry_run {
                    lock(&self.settlements).restore_debt(key, debt);
                } else {
                    metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "written_off")
                        .increment(debt.owed_units);
                }
                return None;
            }
            RegionalCharge::Decided(decision) => decision,
        };
        if request.dry_run {
            lock(&self.settlements).restore_debt(key, debt);
            return (!decision.allowed).then(|| answer_for(request, decision));
        }
        if decision.allowed {
            metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "repaid")
                .increment(debt.owed_units);
            return None;
        }
        if decision.retry_after_ms < 0 {
            // Can never be admitted as it is (a lowered limit): written off, not a lock-out.
            metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "written_off")
                .increment(debt.owed_units);
            return None;
        }
        lock(&self.settlements).restore_debt(key, debt);
        Some(answer_for(request, decision))
    }

    fn debtor_key(&self, request: &AdmissionRequest) -> DebtorKey {
        let hash = keys::principal_hash(
            &self.settings.pepper,
            request.principal.kind,
            &request.principal.id,
            self.settings.ip_prefixes,
        );
        (request.tenant_id.clone(), hash)
    }
}

enum RegionalCharge {
    /// No regional rule applies.
    NoRules,
    Decided(Decision),
}

/// `request` as a charge of `units` more: a fresh decision id (a charge is its own write), never
/// metered.
fn charge_request(request: &AdmissionRequest, units: u64, dry_run: bool) -> AdmissionRequest {
    let id = format!("settle-{}", LeaseId::from_parts(0, rand::random()));
    AdmissionRequest {
        request_id: DecisionId::parse(&id).unwrap_or_else(|_| request.request_id.clone()),
        cost_hint: units.max(1),
        metered: false,
        dry_run,
        ..request.clone()
    }
}

/// A debt payment's denial as the answer to the request that was to pay it.
fn answer_for(request: &AdmissionRequest, decision: Decision) -> Decision {
    Decision {
        decision_id: request.request_id.clone(),
        dry_run: request.dry_run,
        ..decision
    }
}
