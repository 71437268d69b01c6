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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use allot_shared::contract::{
    AdmissionRequest, Charge, Decision, PoolCharge, SettleAnswer, SettleRequest,
};
use allot_shared::ids::{DecisionId, LeaseId, TenantId};
use allot_shared::keys;
use allot_shared::policy::{Limit, PolicyBundle};

use super::admission::global_cost_tokens;
use super::{Agent, lock};
use crate::limiter::plan_request;

/// Most metered admissions open for settlement at once (I10).
pub const MAX_OPEN_SETTLEMENTS: usize = 65_536;
/// Most principals owing regional debt at once (I10); past it the oldest debt is written off.
pub const MAX_REGIONAL_DEBTORS: usize = 65_536;
/// Regional debt not paid within this long is written off, ms: a principal that never returns
/// must not hold memory for ever.
pub const REGIONAL_DEBT_TTL_MS: u64 = 3_600_000;

/// Why a settlement was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    /// The body is not valid.
    #[error("{0}")]
    Invalid(allot_shared::FieldError),
    /// No metered admission of this tenant with this id is open: never made here, or past its
    /// settle window (its estimate stands).
    #[error(
        "no metered admission with this decision id is open for this tenant on this agent: it was \
         not metered, was decided by another agent, or is past its settle window (its estimate \
         stands)"
    )]
    NotOpen,
    /// Settled before with another actual cost, or being settled now.
    #[error("{0}")]
    Conflict(String),
}

type OpenKey = (TenantId, DecisionId);

/// Metered admissions open for settlement, and principals owing regional debt.
#[derive(Default)]
pub(super) struct Settlements {
    open: HashMap<OpenKey, Open>,
    /// Open admissions in the order they were made (so by settle deadline): pruned from the front.
    order: VecDeque<(u64, OpenKey)>,
    debts: HashMap<DebtorKey, RegionalDebt>,
    /// Tenants with a debtor: admissions of other tenants skip the principal's hash.
    tenants_in_debt: HashMap<TenantId, usize>,
    /// When the debts were last looked through for ones owed too long, epoch ms.
    debts_scanned_ms: u64,
}

/// How often the debts are looked through for ones owed too long, ms: the scan is linear in the
/// debtors, so it runs at most this often, not on every metered admission.
const DEBT_SCAN_EVERY_MS: u64 = 1_000;

struct Open {
    /// The request as admitted: its `costHint` is the estimate.
    request: AdmissionRequest,
    /// The bundle it was decided by: the extra is charged to the same rules.
    bundle: Arc<PolicyBundle>,
    settle_by_ms: u64,
    state: OpenState,
}

enum OpenState {
    Open,
    /// Being settled (its charge under way).
    Settling,
    Settled(SettleAnswer),
}

type DebtorKey = (TenantId, keys::PrincipalHash);

struct RegionalDebt {
    /// The request whose extra cost is owed: paid against its rules, as the bundle has them then.
    request: AdmissionRequest,
    owed_units: u64,
    /// The most this principal may owe: one full limit of the rule that denied the charge.
    cap_units: u64,
    since_ms: u64,
}

impl Settlements {
    pub(super) fn open_count(&self) -> usize {
        self.open.len()
    }

    pub(super) fn debtor_count(&self) -> usize {
        self.debts.len()
    }

    /// Forgets open admissions past their settle deadline (their estimates stand) and regional
    /// debt owed too long (written off).
    fn prune(&mut self, now_ms: u64) {
        while let Some((settle_by_ms, _)) = self.order.front() {
            if *settle_by_ms > now_ms {
                break;
            }
            let Some((_, key)) = self.order.pop_front() else {
                break;
            };
            if let Some(open) = self.open.get(&key)
                && open.settle_by_ms <= now_ms
            {
                if matches!(open.state, OpenState::Open) {
                    metrics::counter!(crate::metrics::SETTLEMENTS, "outcome" => "expired")
                        .increment(1);
                }
                self.open.remove(&key);
            }
        }
        if self.debts.is_empty()
            || now_ms < self.debts_scanned_ms.saturating_add(DEBT_SCAN_EVERY_MS)
        {
            return;
        }
        self.debts_scanned_ms = now_ms;
        let stale: Vec<DebtorKey> = self
            .debts
            .iter()
            .filter(|(_, debt)| now_ms.saturating_sub(debt.since_ms) >= REGIONAL_DEBT_TTL_MS)
            .map(|(key, _)| key.clone())
            .collect();
        for key in stale {
            self.write_off_debt(&key);
        }
    }

    /// Opens `request` (admitted, metered) for settlement until `settle_by_ms`.
    fn insert(&mut self, request: &AdmissionRequest, bundle: Arc<PolicyBundle>, settle_by_ms: u64) {
        let key = (request.tenant_id.clone(), request.request_id.clone());
        if let Some(existing) = self.open.get(&key)
            && !matches!(existing.state, OpenState::Open)
        {
            // A retried admission of a request being or already settled: the first stands.
            return;
        }
        while self.open.len() >= MAX_OPEN_SETTLEMENTS {
            let Some((_, oldest)) = self.order.pop_front() else {
                break;
            };
            if self.open.remove(&oldest).is_some() {
                metrics::counter!(crate::metrics::SETTLEMENTS, "outcome" => "evicted").increment(1);
            }
        }
        self.open.insert(
            key.clone(),
            Open {
                request: request.clone(),
                bundle,
                settle_by_ms,
                state: OpenState::Open,
            },
        );
        self.order.push_back((settle_by_ms, key));
    }

    /// Adds `units` to what the principal of `request` owes, within `cap_units`; returns what was
    /// owed and what was written off.
    fn owe(
        &mut self,
        key: DebtorKey,
        request: &AdmissionRequest,
        units: u64,
        cap_units: u64,
        now_ms: u64,
    ) -> Charge {
        if !self.debts.contains_key(&key) && self.debts.len() >= MAX_REGIONAL_DEBTORS {
            let oldest = self
                .debts
                .iter()
                .min_by_key(|(_, debt)| debt.since_ms)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.write_off_debt(&oldest);
            }
        }
        let is_new = !self.debts.contains_key(&key);
        let debt = self
            .debts
            .entry(key.clone())
            .or_insert_with(|| RegionalDebt {
                request: request.clone(),
                owed_units: 0,
                cap_units,
                since_ms: now_ms,
            });
        debt.cap_units = debt.cap_units.min(cap_units).max(1);
        let room = debt.cap_units.saturating_sub(debt.owed_units);
        let owed = units.min(room);
        debt.owed_units += owed;
        if debt.owed_units == 0 {
            self.debts.remove(&key);
        } else if is_new {
            *self.tenants_in_debt.entry(key.0).or_default() += 1;
        }
        Charge {
            paid: 0,
            owed,
            written_off: units - owed,
        }
    }

    /// Takes the debt of `key` to pay it (put back with [`restore_debt`](Self::restore_debt) when
    /// the payment is refused).
    fn take_debt(&mut self, key: &DebtorKey) -> Option<RegionalDebt> {
        let debt = self.debts.remove(key)?;
        self.forget_debtor(&key.0);
        Some(debt)
    }

    fn restore_debt(&mut self, key: DebtorKey, debt: RegionalDebt) {
        let tenant = key.0.clone();
        match self.debts.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut existing) => {
                // Owed meanwhile as well: one debt, within the tighter cap.
                let merged = existing.get_mut();
                merged.cap_units = merged.cap_units.min(debt.cap_units);
                merged.owed_units = (merged.owed_units + debt.owed_units).min(merged.cap_units);
                merged.since_ms = merged.since_ms.min(debt.since_ms);
            }
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(debt);
                *self.tenants_in_debt.entry(tenant).or_default() += 1;
            }
        }
    }

    fn write_off_debt(&mut self, key: &DebtorKey) {
        if let Some(debt) = self.take_debt(key) {
            metrics::counter!(crate::metrics::SETTLE_REGIONAL_UNITS, "outcome" => "written_off")
                .increment(debt.owed_units);
        }
    }

    fn forget_debtor(&mut self, tenant: &TenantId) {
        if let Some(count) = self.tenants_in_debt.get_mut(tenant) {
            *count -= 1;
            if *count == 0 {
                self.tenants_in_debt.remove(tenant);
            }
        }
    }
}

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
        settlements.insert(request, bundle, settle_by_ms);
        settle_by_ms
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
        let (request, bundle) = {
            let mut settlements = lock(&self.settlements);
            settlements.prune(self.clock.now_ms());
            let open = settlements.open.get_mut(&key).ok_or(SettleError::NotOpen)?;
            match &open.state {
                OpenState::Settled(answer) if answer.actual_cost_units == actual_units => {
                    return Ok(SettleAnswer {
                        replayed: true,
                        ..answer.clone()
                    });
                }
                OpenState::Settled(answer) => {
                    return Err(SettleError::Conflict(format!(
                        "already settled with actualCost {}; a decision is settled once",
                        answer.actual_cost_units
                    )));
                }
                OpenState::Settling => {
                    return Err(SettleError::Conflict(
                        "being settled now; send the same body again for its answer".to_owned(),
                    ));
                }
                OpenState::Open => {
                    open.state = OpenState::Settling;
                    (open.request.clone(), open.bundle.clone())
                }
            }
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
        let mut settlements = lock(&self.settlements);
        let Some(open) = settlements.open.get_mut(&key) else {
            return Err(SettleError::NotOpen);
        };
        match charged {
            Ok(answer) => {
                open.state = OpenState::Settled(answer.clone());
                Ok(answer)
            }
            Err(error) => {
                // The charge's task panicked: nothing of it is known to have happened.
                tracing::error!(%error, "a settlement's charge failed");
                open.state = OpenState::Open;
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
            let charged = lock(&slot.agent).charge(extra_tokens, now_ms);
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
        let key = {
            let settlements = lock(&self.settlements);
            if !settlements.tenants_in_debt.contains_key(&request.tenant_id) {
                return None;
            }
            drop(settlements);
            self.debtor_key(request)
        };
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
