//! Verified bundles and drafts: the canonical encoding and its SHA-256 checksum, versions, and the
//! rules that match a request.

use std::collections::BTreeSet;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::contract::PrincipalType;
use crate::ids::{RouteGroup, TenantId};
use crate::overrides::OverrideSet;

use super::checks::{KeyShape, key_shape};
use super::overlay::{Overlay, OverrideProblem};
use super::{Limit, PolicyError, Rule, Scope, error};

/// A parsed and validated bundle whose version and checksum may still be missing (a file written by
/// hand, or a draft sent to the allocator's publish API).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftBundle {
    /// `bundleVersion`, if given.
    pub version: Option<u64>,
    /// `publishedAt`, if given (RFC 3339 text, carried verbatim).
    pub published_at: Option<String>,
    /// `checksum`, if given.
    pub checksum: Option<String>,
    /// The validated rules, in bundle order.
    pub rules: Vec<Rule>,
}

/// A sealed bundle: version and checksum present and consistent with the content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyBundle {
    version: u64,
    published_at: Option<String>,
    checksum: String,
    rules: Vec<Rule>,
    /// The overrides in force over these rules (not part of the content or the checksum).
    overlay: Overlay,
}

/// Writes `value` as canonical JSON: object keys sorted bytewise, no whitespace. Independent of
/// serde_json's map ordering features.
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (n, (key, item)) in entries.into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn content_json(version: u64, published_at: Option<&str>, rules: &[Rule]) -> Value {
    let mut map = Map::new();
    map.insert("bundleVersion".to_owned(), Value::from(version));
    if let Some(published_at) = published_at {
        map.insert("publishedAt".to_owned(), Value::from(published_at));
    }
    map.insert(
        "rules".to_owned(),
        Value::Array(rules.iter().map(Rule::to_json).collect()),
    );
    Value::Object(map)
}

fn checksum_of(version: u64, published_at: Option<&str>, rules: &[Rule]) -> String {
    let mut canonical = String::new();
    write_canonical(&content_json(version, published_at, rules), &mut canonical);
    format!(
        "sha256:{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    )
}

impl DraftBundle {
    /// Seals the draft as `version`, computing its checksum (any checksum in the draft is replaced).
    pub fn seal(self, version: u64, published_at: Option<String>) -> PolicyBundle {
        let checksum = checksum_of(version, published_at.as_deref(), &self.rules);
        PolicyBundle {
            version,
            published_at,
            checksum,
            rules: self.rules,
            overlay: Overlay::default(),
        }
    }

    /// Requires a version and a checksum, and checks the checksum against the content. This is how an
    /// agent accepts a bundle from the control plane.
    pub fn into_verified(self) -> Result<PolicyBundle, PolicyError> {
        let version = self
            .version
            .ok_or_else(|| error("bundleVersion", "is required in a published bundle"))?;
        let given = self
            .checksum
            .clone()
            .ok_or_else(|| error("checksum", "is required in a published bundle"))?;
        let published_at = self.published_at.clone();
        let sealed = self.seal(version, published_at);
        if sealed.checksum == given {
            return Ok(sealed);
        }
        let expected = sealed.checksum.clone();
        sealed
            .into_published_before_charges_cost_hint(&given)
            .ok_or_else(|| {
                error(
                    "checksum",
                    format!("does not match the content (expected {expected})"),
                )
            })
    }

    /// For a bundle file (e.g. the agent's `--policy-file`): a missing version is 1, a missing checksum
    /// is computed, a present one is verified.
    pub fn into_file_bundle(mut self) -> Result<PolicyBundle, PolicyError> {
        let version = *self.version.get_or_insert(1);
        match self.checksum.clone() {
            Some(_) => self.into_verified(),
            None => {
                let published_at = self.published_at.take();
                Ok(self.seal(version, published_at))
            }
        }
    }
}

impl PolicyBundle {
    /// This bundle as published before rules stated `chargesCostHint`, when `given` is its
    /// checksum over the canonical form of then (the same, without that field): every rule then
    /// charged its cost per unit of the caller's `costHint`, so it still does. `None` when the
    /// checksum is not of that form either. Bundles stored by an earlier allocator keep verifying,
    /// and keep meaning what they meant, until they are published again.
    fn into_published_before_charges_cost_hint(mut self, given: &str) -> Option<Self> {
        for rule in &mut self.rules {
            rule.charges_cost_hint = true;
            if let Value::Object(canonical) = &mut rule.canonical {
                canonical.remove("chargesCostHint");
            }
        }
        let legacy = checksum_of(self.version, self.published_at.as_deref(), &self.rules);
        if legacy != given {
            return None;
        }
        for rule in &mut self.rules {
            if let Value::Object(canonical) = &mut rule.canonical {
                canonical.insert("chargesCostHint".to_owned(), Value::Bool(true));
            }
        }
        self.checksum = legacy;
        Some(self)
    }

    /// The bundle version (at least 1).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// `publishedAt`, if set.
    pub fn published_at(&self) -> Option<&str> {
        self.published_at.as_deref()
    }

    /// `sha256:<hex>` over the canonical content.
    pub fn checksum(&self) -> &str {
        &self.checksum
    }

    /// The rules, in bundle order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// The wire form, with version and checksum.
    pub fn to_json(&self) -> Value {
        let mut value = content_json(self.version, self.published_at.as_deref(), &self.rules);
        if let Value::Object(map) = &mut value {
            map.insert("checksum".to_owned(), Value::from(self.checksum.clone()));
        }
        value
    }

    /// This bundle with `set`'s overrides in force at `now_ms` laid over its rules (replacing any
    /// laid before), and the overrides that could not be laid (an unknown rule, amounts its
    /// algorithm has not, ...), which change nothing.
    pub fn with_overrides(
        &self,
        set: &OverrideSet,
        now_ms: u64,
    ) -> (PolicyBundle, Vec<OverrideProblem>) {
        let (overlay, problems) = Overlay::build(&self.rules, set, now_ms);
        let bundle = PolicyBundle {
            overlay,
            ..self.clone()
        };
        (bundle, problems)
    }

    /// The overrides laid over the rules.
    pub fn overlay(&self) -> &Overlay {
        &self.overlay
    }

    /// `rule` (one of this bundle's regional rules, as [`regional_rules_for`](Self::regional_rules_for)
    /// returned it for `tenant`) as it applies to the principal of `kind` whose keyed hash is
    /// `hash`: with that principal's override, if one is laid.
    pub fn rule_for_principal<'a>(
        &'a self,
        rule: &'a Rule,
        tenant: &TenantId,
        kind: PrincipalType,
        hash: &crate::keys::PrincipalHash,
    ) -> &'a Rule {
        self.overlay.for_principal(rule, tenant, kind, hash)
    }

    /// Replaces each per-principal rule of `rules` (as [`regional_rules_for`](Self::regional_rules_for)
    /// returned them for `tenant`) with the override laid for the principal of `kind` whose keyed
    /// hash `hash` gives, if one is. `hash` is called only when an authenticated principal of the
    /// tenant has an override: otherwise nothing is hashed and nothing looked up.
    pub fn lay_principal_overrides<'a>(
        &'a self,
        rules: &mut [&'a Rule],
        tenant: &TenantId,
        kind: PrincipalType,
        hash: impl FnOnce() -> crate::keys::PrincipalHash,
    ) {
        if !kind.is_authenticated() || !self.overlay.has_principal_overrides(tenant) {
            return;
        }
        let hash = hash();
        for rule in rules.iter_mut().filter(|rule| rule.scope == Scope::User) {
            *rule = self.rule_for_principal(rule, tenant, kind, &hash);
        }
    }

    /// Whether `candidate` may replace this bundle: only a strictly higher version. (Its checksum was
    /// verified when it was parsed.) A delayed old snapshot can therefore never overwrite a newer one.
    pub fn is_superseded_by(&self, candidate: &PolicyBundle) -> bool {
        candidate.version > self.version
    }

    /// The regional rules that apply to a request, in evaluation order: user, then route, then tenant
    /// (the client hears about its own limit before a shared one); within a scope, rules for one route
    /// group before route-wide ones, then bundle order. An
    /// exemption that matches replaces the non-exempt rules of its scope and route group.
    pub fn regional_rules_for(
        &self,
        tenant: &TenantId,
        route_group: &RouteGroup,
        principal_type: PrincipalType,
    ) -> Vec<&Rule> {
        let matching: Vec<&Rule> = self
            .rules
            .iter()
            .filter(|r| key_shape(r).is_some() && r.applies_to(tenant, route_group, principal_type))
            .collect();
        let exempted: BTreeSet<KeyShape<'_>> = matching
            .iter()
            .filter(|r| r.exempt_owner.is_some())
            .filter_map(|r| key_shape(r))
            .collect();
        let mut selected: Vec<&Rule> = matching
            .into_iter()
            .filter(|r| {
                r.exempt_owner.is_some() || key_shape(r).is_none_or(|s| !exempted.contains(&s))
            })
            .collect();
        // Stable: bundle order within (scope, route-specific before route-wide).
        selected.sort_by_key(|r| (r.scope, r.matcher.route_group.is_none()));
        self.overlay.for_tenant(&mut selected, tenant);
        selected
    }

    /// The global (leased) rules that apply to a request, in bundle order.
    pub fn global_rules_for(
        &self,
        tenant: &TenantId,
        route_group: &RouteGroup,
        principal_type: PrincipalType,
    ) -> Vec<&Rule> {
        self.rules
            .iter()
            .filter(|r| {
                matches!(r.limit, Limit::Global(_))
                    && r.applies_to(tenant, route_group, principal_type)
            })
            .collect()
    }
}
