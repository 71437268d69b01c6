//! "What do I have left": the caller's own quotas (`GET /v1/quota`), for an API's rate limit status
//! endpoint.
//!
//! - **Which rules.** Those that apply to the caller (its tenant, its principal type, the route group
//!   asked for or every one) and that it may see ([`Rule::visible_to`]): its own scope unless a rule's
//!   `expose` says otherwise. A caller that did not authenticate sees none.
//! - **Regional rules** are read with a [dry run](crate::limiter::RuleBatch::into_dry_run) of one
//!   unit through the limiter (the hot tenants' sub-slots and the local fallback included), so the
//!   read writes nothing and shows what the next request would meet.
//! - **Global pools** show the allocator's view: what the pool's window had left to grant when the
//!   allocator last answered this region, plus what this region holds unspent, with the figure's
//!   age. Other regions may have spent what they hold since, so it is an upper bound that ages.
//! - **Reset** is when the whole limit is back at the latest: a rate rule's refill time for what is
//!   missing, a fixed window's end, a sliding counter's next window end, a sliding log's window, a
//!   pool's window end (the agent's clock).

use std::sync::Arc;

use allot_shared::MILLITOKENS_PER_TOKEN;
use allot_shared::contract::{Principal, QuotaLine, QuotaQuery, QuotaStatus};
use allot_shared::ids::{DecisionId, PoolId, RouteGroup, TenantId};
use allot_shared::keys;
use allot_shared::limit::multi::{Algorithm, MAX_RULES_PER_REQUEST};
use allot_shared::policy::{Limit, PolicyBundle, Rule};

use super::bundle::lay_principal_overrides;
use super::{Agent, RequestRejected};
use crate::limiter::{BatchRule, Holding, PlannedBatch, RuleBatch, RuleParams};

/// Most quotas one read shows (the first in evaluation order): at most four store calls.
pub const MAX_QUOTA_LINES: usize = 32;

/// The route group a read uses when no rule names one (rules without a route group match any).
const ANY_ROUTE_GROUP: &str = "any";

impl Agent {
    /// The quotas `query`'s caller may see, with what is left of each (module docs). `Ok(None)`
    /// when the agent has no policy bundle yet.
    pub async fn quota(
        self: &Arc<Self>,
        query: &QuotaQuery,
    ) -> Result<Option<QuotaStatus>, RequestRejected> {
        query.validate()?;
        let Some(bundle) = self.bundle.load() else {
            return Ok(None);
        };
        let mut rules = visible_rules(&bundle, query);
        let caller = Principal {
            kind: query.principal_type,
            id: query.principal_id.clone(),
            api_key_id: None,
        };
        lay_principal_overrides(
            &bundle,
            &mut rules,
            &query.tenant_id,
            &caller,
            &self.settings,
        );
        // A read costs a store call per MAX_RULES_PER_REQUEST rules: bounded (I10).
        rules.truncate(MAX_QUOTA_LINES);
        let (regional, global): (Vec<&Rule>, Vec<&Rule>) = rules
            .into_iter()
            .partition(|rule| matches!(rule.limit, Limit::Regional(_)));
        let mut quotas = Vec::with_capacity(regional.len() + global.len());
        for chunk in regional.chunks(MAX_RULES_PER_REQUEST) {
            quotas.extend(self.regional_lines(&bundle, query, chunk).await);
        }
        for rule in global {
            if let Limit::Global(pool) = &rule.limit {
                quotas.push(self.pool_line(&query.tenant_id, rule, pool).await);
            }
        }
        Ok(Some(QuotaStatus {
            tenant_id: query.tenant_id.clone(),
            policy_version: bundle.version(),
            quotas,
        }))
    }

    /// The lines of up to [`MAX_RULES_PER_REQUEST`] regional rules, read in one dry run.
    async fn regional_lines(
        &self,
        bundle: &PolicyBundle,
        query: &QuotaQuery,
        rules: &[&Rule],
    ) -> Vec<QuotaLine> {
        let (holdings, fallback): (Vec<Option<Holding>>, bool) =
            match self.read_holdings(bundle, query, rules).await {
                Some((holdings, fallback)) => (holdings, fallback),
                None => (vec![None; rules.len()], false),
            };
        let now_ms = self.clock.now_ms();
        rules
            .iter()
            .zip(holdings)
            .filter_map(|(rule, holding)| {
                let Limit::Regional(algorithm) = &rule.limit else {
                    return None;
                };
                let limit_units = holding.map_or_else(
                    || {
                        crate::limiter::decision::limit_units(&RuleParams::from_algorithm(
                            algorithm,
                        ))
                    },
                    |h| h.limit_units,
                );
                Some(QuotaLine {
                    policy_id: rule.id.to_string(),
                    scope: rule.scope.denied_scope(),
                    route_group: rule.matcher.route_group.clone(),
                    pool: None,
                    limit_units,
                    remaining_units: holding.map(|h| h.available_units),
                    window_ms: crate::visibility::window_ms(algorithm),
                    reset_ms: holding.map_or(0, |h| reset_ms(algorithm, h, now_ms)),
                    fallback,
                    age_ms: None,
                    override_id: rule.override_id,
                })
            })
            .collect()
    }

    /// What `rules` hold for the caller, from a dry run of one unit each, and whether the local
    /// fallback answered; `None` when nothing could answer (an outage of a closed rule).
    async fn read_holdings(
        &self,
        bundle: &PolicyBundle,
        query: &QuotaQuery,
        rules: &[&Rule],
    ) -> Option<(Vec<Option<Holding>>, bool)> {
        let tenant = &query.tenant_id;
        let kind = query.principal_type;
        let principal_hash = keys::principal_hash(
            &self.settings.pepper,
            kind,
            &query.principal_id,
            self.settings.ip_prefixes,
        );
        let mut batch_rules = Vec::with_capacity(rules.len());
        for rule in rules {
            let Limit::Regional(algorithm) = &rule.limit else {
                return None;
            };
            let key = match rule.ip_prefixes {
                // A rule with its own prefix lengths keys the address at them.
                Some(_) if kind == allot_shared::contract::PrincipalType::Ip => {
                    let prefixes = rule.ip_prefixes_on(self.settings.ip_prefixes);
                    let own_hash = keys::principal_hash(
                        &self.settings.pepper,
                        kind,
                        &query.principal_id,
                        prefixes,
                    );
                    rule.key_for(tenant, kind, &own_hash)?
                }
                _ => rule.key_for(tenant, kind, &principal_hash)?,
            };
            let params = RuleParams::from_algorithm(algorithm);
            batch_rules.push(BatchRule::new(key, params, MILLITOKENS_PER_TOKEN).ok()?);
        }
        // A fresh id: a sliding log must not take the read for a retry of an admitted request.
        let read_id = DecisionId::parse(&format!("q-{:016x}", rand::random::<u64>())).ok()?;
        let batch = RuleBatch::new(tenant, read_id, 0, batch_rules)
            .ok()?
            .into_dry_run();
        let planned = PlannedBatch {
            batch,
            rules: rules.to_vec(),
            tenant: tenant.clone(),
            principal_type: kind,
            principal_hash: Some(principal_hash),
            policy_version: bundle.version(),
        };
        let read = self.limiter.read_holdings(&planned).await;
        let holdings = read.holdings(&planned)?;
        Some((holdings, read.fallback()))
    }

    /// A global rule's line: the pool's `G`, and the allocator's view of what is left (module docs).
    async fn pool_line(
        self: &Arc<Self>,
        tenant: &TenantId,
        rule: &Rule,
        pool: &PoolId,
    ) -> QuotaLine {
        let now_ms = self.clock.now_ms();
        let mut line = QuotaLine {
            policy_id: rule.id.to_string(),
            scope: rule.scope.denied_scope(),
            route_group: rule.matcher.route_group.clone(),
            pool: Some(pool.clone()),
            limit_units: 0,
            remaining_units: None,
            window_ms: 0,
            reset_ms: 0,
            fallback: false,
            age_ms: None,
            override_id: None,
        };
        let Some(slot) = self.slot(tenant, pool).await else {
            return line;
        };
        line.override_id = slot.override_in_force(now_ms);
        let figures = slot.figures(now_ms);
        line.limit_units = figures.limit_tokens;
        line.window_ms = figures.window_ms;
        line.reset_ms = figures.reset_ms;
        line.remaining_units = figures.remaining_tokens;
        line.age_ms = figures.age_ms;
        line
    }
}

/// The rules `query`'s caller may see, deduplicated, in evaluation order: for the route group asked
/// for, or for every route group the bundle names.
fn visible_rules<'b>(bundle: &'b PolicyBundle, query: &QuotaQuery) -> Vec<&'b Rule> {
    let groups: Vec<RouteGroup> = match &query.route_group {
        Some(group) => vec![group.clone()],
        None => {
            let mut named: Vec<RouteGroup> = bundle
                .rules()
                .iter()
                .filter_map(|rule| rule.matcher.route_group.clone())
                .collect();
            named.sort();
            named.dedup();
            if named.is_empty() {
                named.extend(RouteGroup::parse(ANY_ROUTE_GROUP).ok());
            }
            named
        }
    };
    let (tenant, kind) = (&query.tenant_id, query.principal_type);
    let mut rules: Vec<&Rule> = Vec::new();
    for group in &groups {
        let applying = bundle
            .regional_rules_for(tenant, group, kind)
            .into_iter()
            .chain(bundle.global_rules_for(tenant, group, kind));
        for rule in applying {
            if rule.visible_to(kind) && !rules.iter().any(|seen| seen.id == rule.id) {
                rules.push(rule);
            }
        }
    }
    rules
}

/// When the whole limit is back at the latest, ms from `now_ms` (module docs).
fn reset_ms(algorithm: &Algorithm, holding: Holding, now_ms: u64) -> u64 {
    let missing_units = holding.limit_units.saturating_sub(holding.available_units);
    if missing_units == 0 {
        return 0;
    }
    let refill_ms = |refill_millitokens: u64, period_ms: u64| {
        let missing = u128::from(missing_units) * u128::from(MILLITOKENS_PER_TOKEN);
        let ms = (missing * u128::from(period_ms)).div_ceil(u128::from(refill_millitokens.max(1)));
        u64::try_from(ms).unwrap_or(u64::MAX)
    };
    let to_window_end = |window_ms: u64| window_ms - now_ms % window_ms.max(1);
    match algorithm {
        Algorithm::TokenBucket(b) => refill_ms(b.refill_millitokens(), b.period_ms()),
        Algorithm::Gcra(g) => refill_ms(g.refill_millitokens(), g.period_ms()),
        Algorithm::FixedWindow(w) => to_window_end(w.window_ms()),
        Algorithm::SlidingCounter(c) => to_window_end(c.window_ms()) + c.window_ms(),
        Algorithm::SlidingLog(l) => l.window_ms(),
    }
}
