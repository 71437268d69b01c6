//! The state behind metered admissions: the admissions open for settlement and the principals
//! owing regional debt, each bounded (I10). It owns both privately; `settlement.rs` drives it.
//!
//! An open admission moves `Open → Settling → Settled` once; a failed charge returns it to `Open`
//! (nothing of it is known to have happened), and past its settle deadline it is forgotten (its
//! estimate stands). A debt never exceeds its cap, and `tenants_in_debt` counts each tenant's
//! debtors exactly, so admissions of tenants without debt skip the principal's hash.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use allot_shared::contract::{AdmissionRequest, Charge, SettleAnswer};
use allot_shared::ids::{DecisionId, TenantId};
use allot_shared::keys;
use allot_shared::policy::PolicyBundle;

/// Most metered admissions open for settlement at once (I10).
pub const MAX_OPEN_SETTLEMENTS: usize = 65_536;
/// Most principals owing regional debt at once (I10); past it the oldest debt is written off.
pub const MAX_REGIONAL_DEBTORS: usize = 65_536;
/// Regional debt not paid within this long is written off, ms: a principal that never returns
/// must not hold memory for ever.
pub const REGIONAL_DEBT_TTL_MS: u64 = 3_600_000;

pub(super) type OpenKey = (TenantId, DecisionId);

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

/// How a settlement begins.
pub(super) enum Begun {
    /// Settled before with the same actual cost: the first answer, marked `replayed`.
    Replayed(SettleAnswer),
    /// Now being settled: the extra is charged to the rules of `bundle`.
    Charge {
        request: AdmissionRequest,
        bundle: Arc<PolicyBundle>,
    },
}

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

pub(super) type DebtorKey = (TenantId, keys::PrincipalHash);

pub(super) struct RegionalDebt {
    /// The request whose extra cost is owed: paid against its rules, as the bundle has them then.
    pub(super) request: AdmissionRequest,
    pub(super) owed_units: u64,
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

    /// Whether any principal of `tenant` owes regional debt.
    pub(super) fn has_debtors(&self, tenant: &TenantId) -> bool {
        self.tenants_in_debt.contains_key(tenant)
    }

    /// Starts settling the open admission `key` with `actual_units`: its first answer again when
    /// settled before with the same cost; otherwise it is now `Settling` until
    /// [`finish`](Self::finish).
    pub(super) fn begin(&mut self, key: &OpenKey, actual_units: u64) -> Result<Begun, SettleError> {
        let open = self.open.get_mut(key).ok_or(SettleError::NotOpen)?;
        match &open.state {
            OpenState::Settled(answer) if answer.actual_cost_units == actual_units => {
                Ok(Begun::Replayed(SettleAnswer {
                    replayed: true,
                    ..answer.clone()
                }))
            }
            OpenState::Settled(answer) => Err(SettleError::Conflict(format!(
                "already settled with actualCost {}; a decision is settled once",
                answer.actual_cost_units
            ))),
            OpenState::Settling => Err(SettleError::Conflict(
                "being settled now; send the same body again for its answer".to_owned(),
            )),
            OpenState::Open => {
                open.state = OpenState::Settling;
                Ok(Begun::Charge {
                    request: open.request.clone(),
                    bundle: open.bundle.clone(),
                })
            }
        }
    }

    /// Ends the settlement [`begin`](Self::begin) started: settled with `answer`, or open again
    /// when its charge failed (`None`: nothing of it is known to have happened).
    pub(super) fn finish(
        &mut self,
        key: &OpenKey,
        answer: Option<SettleAnswer>,
    ) -> Result<(), SettleError> {
        let open = self.open.get_mut(key).ok_or(SettleError::NotOpen)?;
        debug_assert!(matches!(open.state, OpenState::Settling));
        open.state = match answer {
            Some(answer) => OpenState::Settled(answer),
            None => OpenState::Open,
        };
        Ok(())
    }

    /// Forgets open admissions past their settle deadline (their estimates stand) and regional
    /// debt owed too long (written off).
    pub(super) fn prune(&mut self, now_ms: u64) {
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

    /// Opens `request` (admitted, metered) for settlement until `settle_by_ms`; the deadline in
    /// force. A retried admission of a request already open (or being or already settled) keeps
    /// the first entry and its deadline: one entry, and one place in the eviction order, per
    /// request, however often it is retried.
    pub(super) fn insert(
        &mut self,
        request: &AdmissionRequest,
        bundle: Arc<PolicyBundle>,
        settle_by_ms: u64,
    ) -> u64 {
        let key = (request.tenant_id.clone(), request.request_id.clone());
        if let Some(existing) = self.open.get(&key) {
            return existing.settle_by_ms;
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
        debug_assert!(self.order.len() >= self.open.len());
        settle_by_ms
    }

    /// Adds `units` to what the principal of `request` owes, within `cap_units`; returns what was
    /// owed and what was written off.
    pub(super) fn owe(
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
    pub(super) fn take_debt(&mut self, key: &DebtorKey) -> Option<RegionalDebt> {
        let debt = self.debts.remove(key)?;
        self.forget_debtor(&key.0);
        Some(debt)
    }

    pub(super) fn restore_debt(&mut self, key: DebtorKey, debt: RegionalDebt) {
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

    pub(super) fn write_off_debt(&mut self, key: &DebtorKey) {
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
