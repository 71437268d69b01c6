//! The operators' rule overrides laid over a bundle's rules: per tenant, or per principal, looked up
//! on the request path.

use std::collections::HashMap;

use crate::contract::PrincipalType;
use crate::ids::{RecordId, RuleId, TenantId};
use crate::keys::PrincipalHash;
use crate::overrides::{OverrideSet, RuleOverride};

use super::{Rule, Scope};

/// An override an agent could not lay over its bundle; it changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverrideProblem {
    /// The override's id.
    pub id: RecordId,
    /// Why, naming the rule or the field.
    pub message: String,
}

/// The rule overrides in force laid over one bundle's rules: each a copy of its rule with the
/// overridden amounts, looked up by tenant (and principal) on the request path. Empty unless an
/// override applies, so a tenant without one pays one failed lookup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlay {
    /// The set's version (0: none laid).
    version: u64,
    tenants: HashMap<TenantId, TenantRules>,
    /// The earliest end of a laid override, epoch ms: the overlay must be laid again by then.
    next_expiry_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TenantRules {
    /// The tenant's overrides for all its principals, by rule.
    whole: HashMap<RuleId, Rule>,
    /// One principal's overrides: (its type, the rule as overridden for it).
    principals: HashMap<PrincipalHash, Vec<(PrincipalType, Rule)>>,
}

impl Overlay {
    /// Lays `set`'s overrides in force at `now_ms` over `rules`; returns what could not be laid.
    pub fn build(rules: &[Rule], set: &OverrideSet, now_ms: u64) -> (Self, Vec<OverrideProblem>) {
        let by_id: HashMap<&RuleId, &Rule> = rules.iter().map(|r| (&r.id, r)).collect();
        let mut overlay = Overlay {
            version: set.version,
            ..Overlay::default()
        };
        let mut problems = Vec::new();
        // The tenant-wide ones first: a principal's override starts from its tenant's rule.
        let in_force = || set.overrides.iter().filter(|o| o.in_force_at(now_ms));
        let tenant_wide = in_force().filter(|o| o.principal.is_none());
        for o in tenant_wide.chain(in_force().filter(|o| o.principal.is_some())) {
            match overlay.lay(&by_id, o) {
                Ok(()) => {
                    if let Some(end) = o.expires_at_ms {
                        overlay.next_expiry_ms =
                            Some(overlay.next_expiry_ms.map_or(end, |e| e.min(end)));
                    }
                }
                Err(message) => problems.push(OverrideProblem { id: o.id, message }),
            }
        }
        (overlay, problems)
    }

    fn lay(&mut self, rules: &HashMap<&RuleId, &Rule>, o: &RuleOverride) -> Result<(), String> {
        let rule = rules
            .get(&o.rule)
            .ok_or_else(|| format!("the bundle has no rule {}", o.rule))?;
        if rule.matcher.tenant.as_ref().is_some_and(|t| t != &o.tenant) {
            return Err(format!(
                "rule {} applies to another tenant, not {}",
                o.rule, o.tenant
            ));
        }
        if let Some(principal) = &o.principal
            && (rule.scope != Scope::User || !principal.kind.is_authenticated())
        {
            return Err(format!(
                "rule {} is not a per-principal rule of authenticated callers",
                o.rule
            ));
        }
        // A principal's amounts replace those of its tenant's rule, overridden or not.
        let base = match &o.principal {
            Some(_) => self
                .tenants
                .get(&o.tenant)
                .and_then(|t| t.whole.get(&o.rule))
                .unwrap_or(rule),
            None => rule,
        };
        let mut overridden = base.with_amounts(&o.amounts).map_err(|e| e.to_string())?;
        overridden.override_id = Some(o.id);
        let tenant = self.tenants.entry(o.tenant.clone()).or_default();
        let taken = match &o.principal {
            None => match tenant.whole.entry(o.rule.clone()) {
                std::collections::hash_map::Entry::Occupied(_) => true,
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(overridden);
                    false
                }
            },
            Some(principal) => {
                let slot = tenant.principals.entry(principal.hash.clone()).or_default();
                let taken = slot
                    .iter()
                    .any(|(kind, r)| *kind == principal.kind && r.id == o.rule);
                if !taken {
                    slot.push((principal.kind, overridden));
                }
                taken
            }
        };
        if taken {
            return Err(format!("another override of rule {} came first", o.rule));
        }
        Ok(())
    }

    /// The laid set's version (0: none).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// How many overrides are laid.
    pub fn len(&self) -> usize {
        self.tenants
            .values()
            .map(|t| t.whole.len() + t.principals.values().map(Vec::len).sum::<usize>())
            .sum()
    }

    /// Whether none is (a tenant is only entered with an override laid).
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// When the first laid override ends, epoch ms: the set must be laid again then.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.next_expiry_ms
    }

    /// Whether some principal of `tenant` has an override.
    pub fn has_principal_overrides(&self, tenant: &TenantId) -> bool {
        // Without any override, not even a lookup (the request path asks on every decision).
        !self.tenants.is_empty()
            && self
                .tenants
                .get(tenant)
                .is_some_and(|t| !t.principals.is_empty())
    }

    /// Replaces each of `rules` that `tenant` has an override of with the overridden rule.
    pub(super) fn for_tenant<'a>(&'a self, rules: &mut [&'a Rule], tenant: &TenantId) {
        if self.tenants.is_empty() {
            return;
        }
        let Some(overrides) = self.tenants.get(tenant) else {
            return;
        };
        for rule in rules.iter_mut() {
            if let Some(overridden) = overrides.whole.get(&rule.id) {
                *rule = overridden;
            }
        }
    }

    /// `rule` as it applies to one principal of `tenant`.
    pub(super) fn for_principal<'a>(
        &'a self,
        rule: &'a Rule,
        tenant: &TenantId,
        kind: PrincipalType,
        hash: &PrincipalHash,
    ) -> &'a Rule {
        self.tenants
            .get(tenant)
            .and_then(|t| t.principals.get(hash))
            .and_then(|slot| {
                slot.iter()
                    .find(|(k, r)| *k == kind && r.id == rule.id)
                    .map(|(_, r)| r)
            })
            .unwrap_or(rule)
    }
}
