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

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::contract::{DeniedScope, PrincipalType};
use crate::ids::RecordId;
use crate::ids::{PoolId, RouteGroup, RuleId, TenantId};
use crate::keys::PrincipalHash;
use crate::limit::concurrency::Semaphore;
use crate::limit::fixed_window::FixedWindow;
use crate::limit::gcra::Gcra;
use crate::limit::multi::{Algorithm, MAX_RULES_PER_REQUEST};
use crate::limit::sliding_counter::SlidingCounter;
use crate::limit::sliding_log::SlidingLog;
use crate::limit::token_bucket::TokenBucket;
use crate::limit::{ParamError, check_param};
use crate::overrides::{OverrideSet, RuleAmounts, RuleOverride};
use crate::{MAX_RULE_PARAMETER, MILLITOKENS_PER_TOKEN};

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

/// Field reader for one JSON object that remembers what it read, for unknown-field detection and for
/// the canonical encoding.
struct Fields<'a> {
    object: &'a Map<String, Value>,
    path: String,
    read: BTreeSet<&'static str>,
    canonical: Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn new(value: &'a Value, path: String) -> Result<Self, PolicyError> {
        let object = value
            .as_object()
            .ok_or_else(|| error(path.clone(), "must be a JSON object"))?;
        Ok(Self {
            object,
            path,
            read: BTreeSet::new(),
            canonical: Map::new(),
        })
    }

    fn at(&self, name: &str) -> String {
        format!("{}.{name}", self.path)
    }

    fn raw(&mut self, name: &'static str) -> Option<&'a Value> {
        self.read.insert(name);
        self.object.get(name).filter(|v| !v.is_null())
    }

    fn u64(&mut self, name: &'static str) -> Result<Option<u64>, PolicyError> {
        let Some(value) = self.raw(name) else {
            return Ok(None);
        };
        let number = value
            .as_u64()
            .filter(|n| *n <= MAX_RULE_PARAMETER)
            .ok_or_else(|| {
                error(
                    self.at(name),
                    format!("must be an integer in [0, 2^40], got {value}"),
                )
            })?;
        self.canonical.insert(name.to_owned(), Value::from(number));
        Ok(Some(number))
    }

    fn u64_or(&mut self, name: &'static str, default: u64) -> Result<u64, PolicyError> {
        let number = self.u64(name)?.unwrap_or(default);
        self.canonical.insert(name.to_owned(), Value::from(number));
        Ok(number)
    }

    fn required_u64(&mut self, name: &'static str, why: &str) -> Result<u64, PolicyError> {
        self.u64(name)?
            .ok_or_else(|| error(self.at(name), format!("is required {why}")))
    }

    fn string(&mut self, name: &'static str) -> Result<Option<&'a str>, PolicyError> {
        let Some(value) = self.raw(name) else {
            return Ok(None);
        };
        let text = value
            .as_str()
            .ok_or_else(|| error(self.at(name), format!("must be a string, got {value}")))?;
        self.canonical
            .insert(name.to_owned(), Value::from(text.to_owned()));
        Ok(Some(text))
    }

    fn bool(&mut self, name: &'static str) -> Result<bool, PolicyError> {
        self.bool_or(name, false)
    }

    fn bool_or(&mut self, name: &'static str, default: bool) -> Result<bool, PolicyError> {
        let flag = match self.raw(name) {
            None => default,
            Some(value) => value.as_bool().ok_or_else(|| {
                error(self.at(name), format!("must be true or false, got {value}"))
            })?,
        };
        self.canonical.insert(name.to_owned(), Value::from(flag));
        Ok(flag)
    }

    fn id<T>(
        &mut self,
        name: &'static str,
        parse: fn(&str) -> Result<T, crate::ids::IdError>,
    ) -> Result<Option<T>, PolicyError> {
        match self.string(name)? {
            None => Ok(None),
            Some(text) => parse(text)
                .map(Some)
                .map_err(|e| error(self.at(name), e.to_string())),
        }
    }

    fn finish(self) -> Result<Map<String, Value>, PolicyError> {
        if let Some(unknown) = self.object.keys().find(|k| !self.read.contains(k.as_str())) {
            return Err(error(format!("{}.{unknown}", self.path), "unknown field"));
        }
        Ok(self.canonical)
    }
}

fn param(path: String) -> impl Fn(ParamError) -> PolicyError {
    move |e| error(format!("{path}.{}", e.field), e.to_string())
}

fn parse_rule(value: &Value, index: usize) -> Result<Rule, PolicyError> {
    let path = format!("rules[{index}]");
    let mut f = Fields::new(value, path.clone())?;
    let id = f
        .id("id", RuleId::parse)?
        .ok_or_else(|| error(format!("{path}.id"), "is required"))?;
    let with_id = |mut e: PolicyError| {
        e.rule_id = Some(id.to_string());
        e
    };
    let mut rule = parse_rule_body(&mut f, &path, id.clone()).map_err(with_id)?;
    rule.canonical = Value::Object(f.finish().map_err(with_id)?);
    Ok(rule)
}

/// Long by design: a rule's fields read in the bundle format's order, each with its own check and
/// error naming the field; split, the format would no longer read top to bottom.
fn parse_rule_body(f: &mut Fields<'_>, path: &str, id: RuleId) -> Result<Rule, PolicyError> {
    let scope_text = f
        .string("scope")?
        .ok_or_else(|| error(f.at("scope"), "is required (user, route, tenant or global)"))?;
    let scope = Scope::parse(scope_text).ok_or_else(|| {
        error(
            f.at("scope"),
            format!("must be user, route, tenant or global, got {scope_text:?}"),
        )
    })?;
    let matcher = Matcher {
        tenant: f.id("tenant", TenantId::parse)?,
        route_group: f.id("routeGroup", RouteGroup::parse)?,
        principal_type: match f.string("principalType")? {
            None => None,
            Some("user") => Some(PrincipalType::User),
            Some("api_key") => Some(PrincipalType::ApiKey),
            Some("ip") => Some(PrincipalType::Ip),
            Some(other) => {
                return Err(error(
                    f.at("principalType"),
                    format!("must be user, api_key or ip, got {other:?}"),
                ));
            }
        },
    };
    if scope == Scope::Route && matcher.route_group.is_none() {
        return Err(error(f.at("routeGroup"), "is required for scope route"));
    }
    // A rule that states its cost charges it; one that does not charges the caller's costHint (in
    // units of DEFAULT_COST_MILLITOKENS). `chargesCostHint: true` makes a stated cost a cost per unit of
    // the hint (token-metered APIs).
    let stated_cost = f.u64("costMillis")?;
    let cost_millitokens = f.u64_or("costMillis", DEFAULT_COST_MILLITOKENS)?;
    check_param("costMillis", cost_millitokens, 1).map_err(param(path.to_owned()))?;
    let charges_cost_hint = f.bool_or("chargesCostHint", stated_cost.is_none())?;
    let pool = f.id("pool", PoolId::parse)?;
    let algorithm_name = f.string("algorithm")?;
    let limit = if scope == Scope::Global {
        let pool = pool.ok_or_else(|| {
            error(
                f.at("pool"),
                "is required for scope global: a cross-tenant budget cannot share the request's \
                 tenant hash tag, so it must be leased from an allocator pool",
            )
        })?;
        if !matches!(algorithm_name, None | Some("lease")) {
            return Err(error(
                f.at("algorithm"),
                "must be absent or \"lease\" for scope global",
            ));
        }
        if !cost_millitokens.is_multiple_of(MILLITOKENS_PER_TOKEN) {
            return Err(error(
                f.at("costMillis"),
                "must be a multiple of 1000 for global rules (pools count whole tokens)",
            ));
        }
        Limit::Global(pool)
    } else {
        if pool.is_some() {
            return Err(error(f.at("pool"), "is only allowed for scope global"));
        }
        let name = algorithm_name.ok_or_else(|| {
            error(
                f.at("algorithm"),
                "is required (token_bucket, gcra, fixed_window, sliding_counter or sliding_log)",
            )
        })?;
        Limit::Regional(parse_algorithm(f, path, name, cost_millitokens)?)
    };
    let concurrency = match f.u64("concurrencyMax")? {
        None => None,
        Some(max) => {
            let ttl = f.u64_or("concurrencyLeaseTtlMs", DEFAULT_CONCURRENCY_LEASE_TTL_MS)?;
            Some(Semaphore::new(max, ttl).map_err(param(path.to_owned()))?)
        }
    };
    let fail_mode = match f.string("failMode")? {
        None => {
            return Err(error(
                f.at("failMode"),
                "is required: say what happens when the store is unavailable (closed or local_bounded)",
            ));
        }
        Some("closed") => FailMode::Closed,
        Some("local_bounded") => {
            let why = "for failMode local_bounded";
            let capacity = f.required_u64("localCapacityMillis", why)?;
            let refill = f.required_u64("localRefillMillis", why)?;
            let period = f.u64_or("localPeriodMs", 1_000)?;
            let local = TokenBucket::new(capacity, refill, period, 0).map_err(|e| {
                let field = match e.field {
                    "capacityMillis" => "localCapacityMillis",
                    "refillMillis" => "localRefillMillis",
                    _ => "localPeriodMs",
                };
                error(f.at(field), e.to_string())
            })?;
            if cost_millitokens > capacity {
                return Err(error(
                    f.at("localCapacityMillis"),
                    format!(
                        "{capacity} is below costMillis {cost_millitokens}: the fallback could never admit"
                    ),
                ));
            }
            FailMode::LocalBounded(local)
        }
        Some(other) => {
            return Err(error(
                f.at("failMode"),
                format!("must be closed or local_bounded, got {other:?}"),
            ));
        }
    };
    let idempotent = f.bool("idempotent")?;
    let exempt = f.bool("exempt")?;
    let owner = f.string("owner")?;
    let exempt_owner = if exempt {
        if matcher.tenant.is_none() {
            return Err(error(
                f.at("tenant"),
                "is required for an exemption: an exemption may not match every tenant",
            ));
        }
        if scope == Scope::Global {
            return Err(error(f.at("exempt"), "global rules cannot be exemptions"));
        }
        let owner = owner
            .filter(|o| !o.trim().is_empty() && o.len() <= 128)
            .ok_or_else(|| {
                error(
                    f.at("owner"),
                    "is required for an exemption (1 to 128 bytes)",
                )
            })?;
        Some(owner.to_owned())
    } else {
        None
    };
    let strict = f.bool("strict")?;
    // Canonical only when stated, so that bundles written before the field keep their checksums.
    let exposure = match f.raw("expose") {
        None => Exposure::OwnScope,
        Some(Value::Bool(shown)) => {
            f.canonical.insert("expose".to_owned(), Value::Bool(*shown));
            if *shown {
                Exposure::Shown
            } else {
                Exposure::Hidden
            }
        }
        Some(other) => {
            return Err(error(
                f.at("expose"),
                format!("must be true or false, got {other}"),
            ));
        }
    };
    let mode = match f.string("mode")? {
        None | Some("enforce") => Mode::Enforce,
        Some("shadow") => Mode::Shadow,
        Some("soft") if scope == Scope::Global => {
            return Err(error(
                f.at("mode"),
                "soft is for regional rules: a global pool's overshoot bound must hold (use shadow \
                 to measure a pool without enforcing it)",
            ));
        }
        Some("soft") => Mode::Soft,
        Some(other) => {
            return Err(error(
                f.at("mode"),
                format!("must be enforce, shadow or soft, got {other:?}"),
            ));
        }
    };
    if mode.is_advisory() && exempt_owner.is_some() {
        return Err(error(
            f.at("mode"),
            "an exemption is enforced: a shadow or soft exemption would switch off the rule it \
             replaces",
        ));
    }
    let ip_prefixes = parse_ip_prefixes(f, scope, &matcher)?;
    if mode.is_advisory() && concurrency.is_some() {
        return Err(error(
            f.at("concurrencyMax"),
            "is only for mode enforce: a shadow or soft rule takes no concurrency slot",
        ));
    }
    Ok(Rule {
        id,
        scope,
        matcher,
        limit,
        cost_millitokens,
        charges_cost_hint,
        concurrency,
        fail_mode,
        idempotent,
        exempt_owner,
        strict,
        exposure,
        mode,
        ip_prefixes,
        override_id: None,
        canonical: Value::Null,
    })
}

/// `ipPrefixV4` and `ipPrefixV6`: a per-principal rule's own prefix lengths for anonymous callers,
/// so only on `scope: user` rules of `principalType: ip`. Canonical only when stated.
fn parse_ip_prefixes(
    f: &mut Fields<'_>,
    scope: Scope,
    matcher: &Matcher,
) -> Result<Option<crate::keys::RulePrefixes>, PolicyError> {
    let mut bits = |name: &'static str, max: u64| -> Result<Option<u8>, PolicyError> {
        let Some(value) = f.u64(name)? else {
            return Ok(None);
        };
        if !(1..=max).contains(&value) {
            return Err(error(
                f.at(name),
                format!("must be a prefix length in [1, {max}], got {value}"),
            ));
        }
        if scope != Scope::User || matcher.principal_type != Some(PrincipalType::Ip) {
            return Err(error(
                f.at(name),
                "applies only to per-principal rules of anonymous callers (scope user, \
                 principalType ip)",
            ));
        }
        Ok(u8::try_from(value).ok())
    };
    let v4_bits = bits("ipPrefixV4", 32)?;
    let v6_bits = bits("ipPrefixV6", 128)?;
    Ok((v4_bits.is_some() || v6_bits.is_some())
        .then_some(crate::keys::RulePrefixes { v4_bits, v6_bits }))
}

fn parse_algorithm(
    f: &mut Fields<'_>,
    path: &str,
    name: &str,
    cost_millitokens: u64,
) -> Result<Algorithm, PolicyError> {
    let exceeds = |f: &Fields<'_>, field: &'static str, cap: u64| {
        error(
            f.at("costMillis"),
            format!(
                "{cost_millitokens} exceeds {field} {cap}: the request could never be admitted"
            ),
        )
    };
    match name {
        "token_bucket" | "gcra" => {
            let why = "for a rate algorithm";
            let capacity = f.required_u64("capacityMillis", why)?;
            let refill = f.required_u64("refillMillis", why)?;
            let period = f.required_u64("periodMs", why)?;
            if refill == 0 {
                return Err(error(
                    f.at("refillMillis"),
                    "must be at least 1: a bucket that never refills would silently reset to full \
                     when its key expires",
                ));
            }
            if cost_millitokens > capacity {
                return Err(exceeds(f, "capacityMillis", capacity));
            }
            if name == "gcra" {
                return Gcra::new(capacity, refill, period)
                    .map(Algorithm::Gcra)
                    .map_err(param(path.to_owned()));
            }
            let slack = f.u64_or("slackMs", DEFAULT_SLACK_MS)?;
            TokenBucket::new(capacity, refill, period, slack)
                .map(Algorithm::TokenBucket)
                .map_err(param(path.to_owned()))
        }
        "fixed_window" | "sliding_counter" | "sliding_log" => {
            let why = "for a window algorithm";
            let limit = f.required_u64("limit", why)?;
            let window = f.required_u64("windowMs", why)?;
            if !cost_millitokens.is_multiple_of(MILLITOKENS_PER_TOKEN) {
                return Err(error(
                    f.at("costMillis"),
                    "must be a multiple of 1000 for window algorithms (they count whole units)",
                ));
            }
            if name == "sliding_log" && cost_millitokens != MILLITOKENS_PER_TOKEN {
                return Err(error(
                    f.at("costMillis"),
                    "must be 1000 for sliding_log (one log entry per request)",
                ));
            }
            if cost_millitokens / MILLITOKENS_PER_TOKEN > limit {
                return Err(exceeds(f, "limit x 1000", limit * MILLITOKENS_PER_TOKEN));
            }
            let algorithm = match name {
                "fixed_window" => FixedWindow::new(limit, window).map(Algorithm::FixedWindow),
                "sliding_counter" => {
                    SlidingCounter::new(limit, window).map(Algorithm::SlidingCounter)
                }
                _ => SlidingLog::new(limit, window).map(Algorithm::SlidingLog),
            };
            algorithm.map_err(param(path.to_owned()))
        }
        other => Err(error(
            f.at("algorithm"),
            format!(
                "must be token_bucket, gcra, fixed_window, sliding_counter or sliding_log, got {other:?}"
            ),
        )),
    }
}

/// Whose identity a regional rule's key carries (see [`crate::keys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum KeyKind {
    /// `<u|k|ip>:<principal hash>`: user-scope rules; `ipp<v4>-<v6>:<hash>` for anonymous
    /// principals under a rule with its own prefix lengths.
    Principal(Option<crate::keys::RulePrefixes>),
    /// `tenant:<tenant>`: tenant- and route-scope rules.
    Tenant,
}

type KeyShape<'a> = (KeyKind, Option<&'a RouteGroup>);

/// The shape of the store key a regional rule writes: rules with the same shape whose matchers overlap
/// would share one key, and two algorithms on one key corrupt each other. A route-scope rule and a
/// tenant-scope rule with the same route group write the same tenant key.
fn key_shape(rule: &Rule) -> Option<KeyShape<'_>> {
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

fn check_rule_set(rules: &[Rule]) -> Result<(), PolicyError> {
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

/// Parses and validates a bundle from JSON text. Version and checksum may be absent; a present checksum
/// is not verified here (see [`DraftBundle::into_verified`]).
pub fn parse_bundle(json: &str) -> Result<DraftBundle, PolicyError> {
    let value: Value =
        serde_json::from_str(json).map_err(|e| error("$", format!("is not valid JSON: {e}")))?;
    let mut f = Fields::new(&value, "$".to_owned())?;
    let version = f.u64("bundleVersion")?;
    if version == Some(0) {
        return Err(error("bundleVersion", "must be at least 1"));
    }
    let published_at = f.string("publishedAt")?.map(str::to_owned);
    if published_at.as_ref().is_some_and(|p| p.len() > 64) {
        return Err(error("publishedAt", "must be at most 64 characters"));
    }
    let checksum = f.string("checksum")?.map(str::to_owned);
    let rules_value = f
        .raw("rules")
        .ok_or_else(|| error("rules", "is required (an array of rules)"))?;
    let rules_array = rules_value
        .as_array()
        .ok_or_else(|| error("rules", "must be an array"))?;
    if rules_array.len() > MAX_RULES_PER_BUNDLE {
        return Err(error(
            "rules",
            format!(
                "has {} rules; at most {MAX_RULES_PER_BUNDLE} are allowed",
                rules_array.len()
            ),
        ));
    }
    f.finish().map_err(|mut e| {
        e.field = e.field.trim_start_matches("$.").to_owned();
        e
    })?;
    let rules = rules_array
        .iter()
        .enumerate()
        .map(|(index, rule)| parse_rule(rule, index))
        .collect::<Result<Vec<_>, _>>()?;
    check_rule_set(&rules)?;
    Ok(DraftBundle {
        version,
        published_at,
        checksum,
        rules,
    })
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
    fn for_tenant<'a>(&'a self, rules: &mut [&'a Rule], tenant: &TenantId) {
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
    fn for_principal<'a>(
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
