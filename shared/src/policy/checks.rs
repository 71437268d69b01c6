//! Checks across a bundle's rules: no two rules that could count one request in the same keys
//! (the keys' shapes overlap), and no request that could match more rules than one store call takes.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::contract::PrincipalType;
use crate::ids::{RouteGroup, TenantId};
use crate::limit::multi::MAX_RULES_PER_REQUEST;

use super::{Limit, PolicyError, Rule, Scope, error};

/// Whose identity a regional rule's key carries (see [`crate::keys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum KeyKind {
    /// `<u|k|ip>:<principal hash>`: user-scope rules; `ipp<v4>-<v6>:<hash>` for anonymous
    /// principals under a rule with its own prefix lengths.
    Principal(Option<crate::keys::RulePrefixes>),
    /// `tenant:<tenant>`: tenant- and route-scope rules.
    Tenant,
}

pub(super) type KeyShape<'a> = (KeyKind, Option<&'a RouteGroup>);

/// The shape of the store key a regional rule writes: rules with the same shape whose matchers overlap
/// would share one key, and two algorithms on one key corrupt each other. A route-scope rule and a
/// tenant-scope rule with the same route group write the same tenant key.
pub(super) fn key_shape(rule: &Rule) -> Option<KeyShape<'_>> {
    let kind = match (&rule.limit, rule.scope) {
        (Limit::Global(_), _) | (_, Scope::Global) => return None,
        // A rule with its own prefix lengths has keys of its own (a ceiling over another rule).
        (_, Scope::User) => KeyKind::Principal(rule.ip_prefixes),
        (_, Scope::Route | Scope::Tenant) => KeyKind::Tenant,
    };
    Some((kind, rule.matcher.route_group.as_ref()))
}

fn overlap<T: PartialEq>(a: Option<&T>, b: Option<&T>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

pub(super) fn check_rule_set(rules: &[Rule]) -> Result<(), PolicyError> {
    let mut ids = BTreeMap::new();
    for (index, rule) in rules.iter().enumerate() {
        if let Some(first) = ids.insert(rule.id.clone(), index) {
            return Err(PolicyError {
                field: format!("rules[{index}].id"),
                rule_id: Some(rule.id.to_string()),
                message: format!("duplicates the id of rules[{first}]"),
            });
        }
    }
    check_rules_per_request(rules)?;
    // Duplicate keys: same shape, overlapping matchers, and not an exemption replacing a rule.
    let mut by_shape: HashMap<KeyShape<'_>, Vec<usize>> = HashMap::new();
    for (index, rule) in rules.iter().enumerate() {
        if let Some(shape) = key_shape(rule) {
            by_shape.entry(shape).or_default().push(index);
        }
    }
    for indexes in by_shape.values() {
        for (n, &i) in indexes.iter().enumerate() {
            for &j in &indexes[..n] {
                let (a, b) = (&rules[i], &rules[j]);
                let collide = a.exempt_owner.is_some() == b.exempt_owner.is_some()
                    && overlap(a.matcher.tenant.as_ref(), b.matcher.tenant.as_ref())
                    && (a.scope != Scope::User
                        || b.scope != Scope::User
                        || overlap(
                            a.matcher.principal_type.as_ref(),
                            b.matcher.principal_type.as_ref(),
                        ));
                if collide {
                    return Err(PolicyError {
                        field: format!("rules[{i}]"),
                        rule_id: Some(a.id.to_string()),
                        message: format!(
                            "would share a store key with rule {} (same scope and route group for an \
                             overlapping tenant and principal type); give one a distinct routeGroup or \
                             tenant, or make it an exemption",
                            b.id
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Rejects bundles where some request would be evaluated against more than
/// [`MAX_RULES_PER_REQUEST`] regional rules. Counts exemptions alongside the rules they replace
/// (conservative).
fn check_rules_per_request(rules: &[Rule]) -> Result<(), PolicyError> {
    type Class<'a> = (
        Option<&'a TenantId>,
        Option<&'a RouteGroup>,
        Option<PrincipalType>,
    );
    let mut classes: HashMap<Class<'_>, usize> = HashMap::new();
    let mut tenants: BTreeSet<Option<&TenantId>> = BTreeSet::from([None]);
    let mut routes: BTreeSet<Option<&RouteGroup>> = BTreeSet::from([None]);
    for rule in rules.iter().filter(|r| key_shape(r).is_some()) {
        let m = &rule.matcher;
        *classes
            .entry((m.tenant.as_ref(), m.route_group.as_ref(), m.principal_type))
            .or_default() += 1;
        tenants.insert(m.tenant.as_ref());
        routes.insert(m.route_group.as_ref());
    }
    let kinds = [
        PrincipalType::User,
        PrincipalType::ApiKey,
        PrincipalType::Ip,
    ];
    for &t in &tenants {
        for &r in &routes {
            for p in kinds {
                let mut count = 0;
                for ct in [t, None].into_iter().collect::<BTreeSet<_>>() {
                    for cr in [r, None].into_iter().collect::<BTreeSet<_>>() {
                        for cp in [Some(p), None] {
                            count += classes.get(&(ct, cr, cp)).copied().unwrap_or(0);
                        }
                    }
                }
                if count > MAX_RULES_PER_REQUEST {
                    let describe = |x: Option<String>| x.unwrap_or_else(|| "any".to_owned());
                    return Err(error(
                        "rules",
                        format!(
                            "{count} rules would apply to one request (tenant {}, route group {}, \
                             principal type {p:?}); at most {MAX_RULES_PER_REQUEST} may",
                            describe(t.map(ToString::to_string)),
                            describe(r.map(ToString::to_string)),
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}
