//! Parsing a bundle's JSON into rules: every field read once, by name, with an error naming the
//! rule and the field; unknown fields refused.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

use crate::contract::PrincipalType;
use crate::ids::{PoolId, RouteGroup, RuleId, TenantId};
use crate::limit::concurrency::Semaphore;
use crate::limit::fixed_window::FixedWindow;
use crate::limit::gcra::Gcra;
use crate::limit::multi::Algorithm;
use crate::limit::sliding_counter::SlidingCounter;
use crate::limit::sliding_log::SlidingLog;
use crate::limit::token_bucket::TokenBucket;
use crate::limit::{ParamError, check_param};
use crate::{MAX_RULE_PARAMETER, MILLITOKENS_PER_TOKEN};

use super::bundle::DraftBundle;
use super::checks::check_rule_set;
use super::{
    DEFAULT_CONCURRENCY_LEASE_TTL_MS, DEFAULT_COST_MILLITOKENS, DEFAULT_SLACK_MS, Exposure,
    FailMode, Limit, MAX_RULES_PER_BUNDLE, Matcher, Mode, PolicyError, Rule, Scope, error,
};

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

/// Reads the parameters of the regional algorithm `name` and checks the rule's cost against them.
///
/// Long by design: it is one match over every regional algorithm, each arm reading its own
/// parameters and checking the cost against them; split, the checks the algorithms share (cost
/// within capacity, whole units for windows) would be spread over as many functions.
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
