//! Policy bundles: versioned, immutable, checksummed rule sets, their validation and rule matching.
//!
//! The wire format follows the reference design's bundle example (`bundleVersion`, `publishedAt`,
//! `checksum`, `rules[]` with `id`, `scope`, `tenant`, `routeGroup`, `algorithm`, `capacityMillis`,
//! `refillMillis`, `periodMs`, `costMillis`, `concurrencyMax`, `failMode`, `idempotent`) and adds what it
//! lacks: `principalType`, `slackMs`, `limit`/`windowMs` for window algorithms, `pool` for global rules,
//! `localCapacityMillis`/`localRefillMillis`/`localPeriodMs` for `local_bounded`,
//! `concurrencyLeaseTtlMs`, `exempt`/`owner` for exemptions, `strict`, `expose` and `mode`.
//!
//! Validation happens once, at publish time (and again when an agent loads a bundle), so that the data
//! plane never discovers a bad policy as a script error or a CROSSSLOT at runtime. Every error names the
//! rule and the field. The checksum is SHA-256 over a canonical encoding of the validated bundle (sorted
//! keys, defaults filled in, no whitespace), so it does not depend on how the author formatted the file.
//! Versions only go up: a rollback is a new, higher version with older content.

mod bundle;
mod checks;
mod overlay;
mod parse;

use serde_json::Value;

use crate::contract::{DeniedScope, PrincipalType};
use crate::ids::{PoolId, RouteGroup, RuleId, TenantId};
use crate::limit::concurrency::Semaphore;
use crate::limit::fixed_window::FixedWindow;
use crate::limit::gcra::Gcra;
use crate::limit::multi::Algorithm;
use crate::limit::sliding_counter::SlidingCounter;
use crate::limit::sliding_log::SlidingLog;
use crate::limit::token_bucket::TokenBucket;
use crate::overrides::RuleAmounts;

pub use bundle::{DraftBundle, PolicyBundle};
use checks::{KeyKind, key_shape};
pub use overlay::{Overlay, OverrideProblem};
pub use parse::parse_bundle;

/// Most rules in one bundle (I10).
pub const MAX_RULES_PER_BUNDLE: usize = 1_000;
/// Default TTL slack of a token bucket key, in ms.
pub const DEFAULT_SLACK_MS: u64 = 5_000;
/// Default cost per unit of `costHint`, in millitokens.
pub const DEFAULT_COST_MILLITOKENS: u64 = 1_000;
/// Default lease TTL of a concurrency slot, in ms.
pub const DEFAULT_CONCURRENCY_LEASE_TTL_MS: u64 = 60_000;

/// A bundle that failed to parse or validate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{field}: {message}", rule_id.as_ref().map(|id| format!("rule {id}: ")).unwrap_or_default())]
pub struct PolicyError {
    /// JSON path of the field at fault, e.g. `rules[2].capacityMillis`.
    pub field: String,
    /// The rule's id, when the error belongs to one rule and its id is known.
    pub rule_id: Option<String>,
    /// What was wrong.
    pub message: String,
}

fn error(field: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError {
        field: field.into(),
        rule_id: None,
        message: message.into(),
    }
}

/// The scope of a rule: whose budget it limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// One bucket per principal.
    User,
    /// One bucket per tenant and route group.
    Route,
    /// One bucket per tenant.
    Tenant,
    /// A cross-tenant budget, leased from an allocator pool.
    Global,
}

impl Scope {
    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "user" => Scope::User,
            "route" => Scope::Route,
            "tenant" => Scope::Tenant,
            "global" => Scope::Global,
            _ => return None,
        })
    }

    /// The `deniedScope` a denial by this rule reports.
    pub fn denied_scope(self) -> DeniedScope {
        match self {
            Scope::User => DeniedScope::User,
            Scope::Route => DeniedScope::Route,
            Scope::Tenant => DeniedScope::Tenant,
            Scope::Global => DeniedScope::Global,
        }
    }
}

/// What a rule does when its store is unavailable. There is no unbounded fail-open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailMode {
    /// Refuse with 503 `LIMITER_UNAVAILABLE`.
    Closed,
    /// Decide from an in-process bucket with these parameters; the decision says `fallback: true`.
    LocalBounded(TokenBucket),
}

/// Which requests a rule applies to. `None` matches anything.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Matcher {
    /// Only this tenant.
    pub tenant: Option<TenantId>,
    /// Only this route group (also the key's route segment).
    pub route_group: Option<RouteGroup>,
    /// Only this principal type.
    pub principal_type: Option<PrincipalType>,
}

impl Matcher {
    /// Whether a request with these attributes matches.
    pub fn matches(
        &self,
        tenant: &TenantId,
        route_group: &RouteGroup,
        principal_type: PrincipalType,
    ) -> bool {
        self.tenant.as_ref().is_none_or(|t| t == tenant)
            && self.route_group.as_ref().is_none_or(|r| r == route_group)
            && self.principal_type.is_none_or(|p| p == principal_type)
    }
}

/// Whether callers may be told a rule's limit and what is left of it (`expose`), on every surface:
/// HTTP `RateLimit` fields, Envoy RLS statuses, the agent's `GET /v1/quota`. Callers that did not
/// authenticate are never told anything, whatever the rule says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Exposure {
    /// No `expose` field: shown only when the rule limits the caller's own budget (scope `user`).
    #[default]
    OwnScope,
    /// `expose: true`: shown to the authenticated callers it applies to, whatever its scope (a
    /// tenant's monthly plan its users may see).
    Shown,
    /// `expose: false`: never shown, even a per-user rule (a DoS-protection rule stays invisible).
    Hidden,
}

/// How a rule acts on what it decides (`mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// Denies what it does not admit (no `mode` field, or `"enforce"`).
    #[default]
    Enforce,
    /// Decided and counted like an enforced rule (its state spent by what it would admit), but it
    /// never denies: metrics, the decision log and the gateway's headers say what it would have
    /// done. For dark-launching a limit. A shadow global rule spends no lease; its would-be usage
    /// is reported to the ledger per window.
    Shadow,
    /// Like shadow, but the violation is the caller's to know: the decision and a response header
    /// flag it. Regional rules only (a global pool's bound must hold).
    Soft,
}

impl Mode {
    /// Whether the rule only advises (shadow or soft): it never denies.
    pub fn is_advisory(self) -> bool {
        self != Mode::Enforce
    }

    /// The name in a bundle, in metrics and in decisions.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
            Mode::Soft => "soft",
        }
    }
}

/// Where a rule's budget lives.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Limit {
    /// In the region's store, decided by this algorithm.
    Regional(Algorithm),
    /// In an allocator pool of the request's tenant, spent from leases.
    Global(PoolId),
}

/// A validated rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Unique within the bundle.
    pub id: RuleId,
    /// Whose budget it limits.
    pub scope: Scope,
    /// Which requests it applies to.
    pub matcher: Matcher,
    /// Where its budget lives.
    pub limit: Limit,
    /// The rule's cost (`costMillis`), in millitokens: what each request is charged, or, when
    /// `charges_cost_hint`, what each unit of the request's `costHint` is charged.
    pub cost_millitokens: u64,
    /// Whether the request's `costHint` multiplies the cost (`chargesCostHint`; the default for a
    /// rule that states no `costMillis`).
    pub charges_cost_hint: bool,
    /// Optional concurrency cap checked alongside the rate rule.
    pub concurrency: Option<Semaphore>,
    /// Behaviour when the store is unavailable.
    pub fail_mode: FailMode,
    /// Whether store calls carry an idempotency record (safe to retry after an ambiguous timeout).
    pub idempotent: bool,
    /// For an exemption: who owns it. An exemption replaces the non-exempt rules of the same scope and
    /// route group for the requests it matches, with its own cap.
    pub exempt_owner: Option<String>,
    /// Whether the rule fails closed once the agent's bundle is older than its maximum age (I13).
    pub strict: bool,
    /// Whether callers may see the rule's limit (`expose`).
    pub exposure: Exposure,
    /// Whether it denies, or only advises (`mode`).
    pub mode: Mode,
    /// Its own prefix lengths for anonymous principals (`ipPrefixV4`, `ipPrefixV6`; per-principal
    /// rules of `principalType: ip` only); `None` keeps the agent's.
    pub ip_prefixes: Option<crate::keys::RulePrefixes>,
    /// The override its amounts come from, when it is a rule as overridden for a tenant or a
    /// principal (`crate::overrides`); `None` for the bundle's own rule.
    pub override_id: Option<crate::ids::RecordId>,
    canonical: Value,
}

impl Rule {
    /// Whether the rule applies to a request of `tenant` on `route_group` by a principal of
    /// `principal_type`: its matcher matches, and, for a caller that did not authenticate (`ip`),
    /// the rule is per principal (its own bucket) or targets `principalType: ip` explicitly.
    /// Pre-authentication traffic never spends a tenant's, a route's or a global budget by default:
    /// an unverified caller cannot drain what the tenant's real users share.
    pub fn applies_to(
        &self,
        tenant: &TenantId,
        route_group: &RouteGroup,
        principal_type: PrincipalType,
    ) -> bool {
        self.matcher.matches(tenant, route_group, principal_type)
            && (principal_type.is_authenticated()
                || self.scope == Scope::User
                || self.matcher.principal_type == Some(principal_type))
    }

    /// Whether a caller of `caller`'s principal type may be told this rule's limit and what is left
    /// of it ([`Exposure`]). The one place every surface asks. A shadow rule is a dark launch: shown
    /// only when it says `expose: true`.
    pub fn visible_to(&self, caller: PrincipalType) -> bool {
        caller.is_authenticated()
            && match self.exposure {
                Exposure::OwnScope => self.scope == Scope::User && self.mode != Mode::Shadow,
                Exposure::Shown => true,
                Exposure::Hidden => false,
            }
    }

    /// What a request with `cost_hint` is charged by this rule, in millitokens: the stated cost, or
    /// that cost per unit of the hint. `None` when that does not fit in 64 bits.
    pub fn cost_millitokens_for(&self, cost_hint: u64) -> Option<u64> {
        if self.charges_cost_hint {
            self.cost_millitokens.checked_mul(cost_hint)
        } else {
            Some(self.cost_millitokens)
        }
    }

    /// The rule in canonical wire form (all defaults explicit).
    pub fn to_json(&self) -> Value {
        self.canonical.clone()
    }

    /// This regional rule with `amounts` in place of its own (an override): its period or window,
    /// key, cost and everything else unchanged. Errors name the amount's field: one its algorithm
    /// has not, a value out of range, or a capacity or limit below the rule's own cost.
    ///
    /// Long by design: it is one match over every regional algorithm (its guard arms refuse an
    /// amount the algorithm has not), then the cost check a rule passes when its bundle is read,
    /// then the amounts written into the canonical form; kept together, an overridden rule is seen
    /// to pass every check a rule read from a bundle does.
    pub fn with_amounts(&self, amounts: &RuleAmounts) -> Result<Rule, PolicyError> {
        let Limit::Regional(algorithm) = &self.limit else {
            return Err(error(
                "rule",
                format!(
                    "{} is a global rule, spent from a pool: override the pool's limit instead",
                    self.id
                ),
            ));
        };
        let misfit = |field: &str, kind: &str| {
            error(
                field,
                format!("rule {} is a {kind} rule, which has no {field}", self.id),
            )
        };
        let rate = |capacity: u64, refill: u64| {
            (
                amounts.capacity_millis.unwrap_or(capacity),
                amounts.refill_millis.unwrap_or(refill),
            )
        };
        let overridden = match algorithm {
            Algorithm::TokenBucket(_) | Algorithm::Gcra(_) if amounts.limit.is_some() => {
                return Err(misfit("limit", "rate"));
            }
            Algorithm::TokenBucket(bucket) => {
                let (capacity, refill) =
                    rate(bucket.capacity_millitokens(), bucket.refill_millitokens());
                TokenBucket::new(capacity, refill, bucket.period_ms(), bucket.slack_ms())
                    .map(Algorithm::TokenBucket)
            }
            Algorithm::Gcra(gcra) => {
                let (capacity, refill) =
                    rate(gcra.capacity_millitokens(), gcra.refill_millitokens());
                Gcra::new(capacity, refill, gcra.period_ms()).map(Algorithm::Gcra)
            }
            _ if amounts.capacity_millis.is_some() => {
                return Err(misfit("capacityMillis", "window"));
            }
            _ if amounts.refill_millis.is_some() => {
                return Err(misfit("refillMillis", "window"));
            }
            Algorithm::FixedWindow(w) => {
                FixedWindow::new(amounts.limit.unwrap_or(w.limit_units()), w.window_ms())
                    .map(Algorithm::FixedWindow)
            }
            Algorithm::SlidingCounter(w) => {
                SlidingCounter::new(amounts.limit.unwrap_or(w.limit_units()), w.window_ms())
                    .map(Algorithm::SlidingCounter)
            }
            Algorithm::SlidingLog(w) => {
                SlidingLog::new(amounts.limit.unwrap_or(w.limit_units()), w.window_ms())
                    .map(Algorithm::SlidingLog)
            }
        }
        .map_err(|e| error(e.field, e.to_string()))?;
        // As when the bundle was read: the rule's cost (per unit of the hint, when it charges
        // the hint) must fit, or the override would refuse every request.
        if !overridden.can_ever_admit(self.cost_millitokens) {
            let field = if amounts.limit.is_some() {
                "limit"
            } else {
                "capacityMillis"
            };
            return Err(error(
                field,
                format!(
                    "would leave rule {} unable to admit its own cost of {} millitokens",
                    self.id, self.cost_millitokens
                ),
            ));
        }
        let mut rule = self.clone();
        rule.limit = Limit::Regional(overridden);
        if let Value::Object(canonical) = &mut rule.canonical {
            let fields = [
                ("capacityMillis", amounts.capacity_millis),
                ("refillMillis", amounts.refill_millis),
                ("limit", amounts.limit),
            ];
            for (field, value) in fields {
                if let Some(value) = value {
                    canonical.insert(field.to_owned(), Value::from(value));
                }
            }
        }
        Ok(rule)
    }

    /// The principal segment of this per-principal rule's keys for a principal of
    /// `principal_type`: the type's, or, for an anonymous principal under a rule with its own
    /// prefix lengths, those lengths' ([`crate::keys::RulePrefixes::key_segment`]).
    pub fn principal_segment(
        &self,
        principal_type: PrincipalType,
    ) -> std::borrow::Cow<'static, str> {
        match (principal_type, self.ip_prefixes) {
            (PrincipalType::Ip, Some(prefixes)) => prefixes.key_segment().into(),
            _ => principal_type.key_segment().into(),
        }
    }

    /// The prefix lengths that key this rule's anonymous principals on an agent keying at `agent`.
    pub fn ip_prefixes_on(&self, agent: crate::keys::IpPrefixes) -> crate::keys::IpPrefixes {
        self.ip_prefixes.map_or(agent, |own| own.resolve(agent))
    }

    /// The store key this rule uses for a request of `tenant` by a principal of `principal_type`
    /// whose keyed hash is `principal_hash`, state shape included (`keys::rule_state_key`); `None`
    /// for global (leased) rules, which have no regional key. Every key carries the tenant's hash
    /// tag.
    pub fn key_for(
        &self,
        tenant: &TenantId,
        principal_type: PrincipalType,
        principal_hash: &crate::keys::PrincipalHash,
    ) -> Option<String> {
        let route_group = self.matcher.route_group.as_ref();
        let Limit::Regional(algorithm) = &self.limit else {
            return None;
        };
        let rule_key = match key_shape(self)?.0 {
            KeyKind::Principal(_) => crate::keys::principal_key_in(
                tenant,
                &self.principal_segment(principal_type),
                principal_hash,
                route_group,
            ),
            KeyKind::Tenant => crate::keys::tenant_key(tenant, route_group),
        };
        Some(crate::keys::rule_state_key(
            &rule_key,
            algorithm.state_shape(),
        ))
    }
}
