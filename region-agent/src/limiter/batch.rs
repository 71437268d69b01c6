//! What one store call decides: the regional rules of one request, as keys, algorithms and costs.
//!
//! A [`RuleBatch`] is validated once, when it is built, so that stores never see a batch the scripts
//! would have to reject for its shape: 1 to 8 rules, distinct keys, and every key under the tenant's
//! hash tag (one Redis Cluster slot, so one script decides them atomically, I2). Costs are not
//! checked here: the pure core (in-process) and the script (Redis) check them identically and reject
//! an invalid one as a policy fault.
//!
//! [`plan_request`] maps a request and a validated policy bundle to its batch: the rules from
//! `PolicyBundle::regional_rules_for` in evaluation order, their keys from `allot_shared::keys`, and
//! costs of `rule.cost_millitokens_for(costHint)` (the stated cost, or that cost per unit of the
//! hint).

use allot_shared::MAX_RULE_PARAMETER;
use allot_shared::contract::{AdmissionRequest, PrincipalType};
use allot_shared::ids::{DecisionId, RuleId, TenantId};
use allot_shared::keys::{self, IpPrefixes, Pepper, PrincipalHash};
use allot_shared::limit::ParamError;
use allot_shared::limit::fixed_window::FixedWindow;
use allot_shared::limit::gcra::Gcra;
use allot_shared::limit::multi::{Algorithm, MAX_RULES_PER_REQUEST};
use allot_shared::limit::sliding_counter::SlidingCounter;
use allot_shared::limit::sliding_log::SlidingLog;
use allot_shared::limit::token_bucket::TokenBucket;
use allot_shared::policy::{Limit, PolicyBundle, Rule, Scope};

/// How long a decision record lives when a rule asks for one (`idempotent`), in ms: long enough to
/// cover a call's deadline and its retries, short enough that records stay few (the reference
/// design's example: 30 s at 100 exports/s is 3,000 records).
pub const DEFAULT_DECISION_RECORD_TTL_MS: u64 = 30_000;

/// An algorithm's parameters as numbers, which the Lua scripts need as arguments.
///
/// (The validated `Algorithm` types of `allot_shared` do not expose all of them, so the batch
/// carries both: these numbers for the scripts and the [`Algorithm`] built from them for the pure
/// core.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuleParams {
    /// A token bucket (millitokens and ms).
    TokenBucket {
        /// Capacity, in millitokens.
        capacity_millitokens: u64,
        /// Refill per period, in millitokens.
        refill_millitokens: u64,
        /// Refill period, in ms.
        period_ms: u64,
        /// TTL slack after the full-refill time, in ms.
        slack_ms: u64,
    },
    /// GCRA, with a token bucket's parameters (millitokens and ms).
    Gcra {
        /// Burst capacity, in millitokens.
        capacity_millitokens: u64,
        /// Refill per period, in millitokens.
        refill_millitokens: u64,
        /// Refill period, in ms.
        period_ms: u64,
    },
    /// An epoch-aligned fixed window.
    FixedWindow {
        /// Units admitted per window.
        limit_units: u64,
        /// Window length, in ms.
        window_ms: u64,
    },
    /// A sliding approximate counter.
    SlidingCounter {
        /// Units admitted per trailing window (estimated).
        limit_units: u64,
        /// Window length, in ms.
        window_ms: u64,
    },
    /// A sliding log (unit cost only).
    SlidingLog {
        /// Units admitted per trailing window.
        limit_units: u64,
        /// Window length, in ms.
        window_ms: u64,
    },
}

impl RuleParams {
    /// Validates the parameters into the pure core's algorithm.
    pub fn algorithm(&self) -> Result<Algorithm, ParamError> {
        Ok(match *self {
            RuleParams::TokenBucket {
                capacity_millitokens,
                refill_millitokens,
                period_ms,
                slack_ms,
            } => Algorithm::TokenBucket(TokenBucket::new(
                capacity_millitokens,
                refill_millitokens,
                period_ms,
                slack_ms,
            )?),
            RuleParams::Gcra {
                capacity_millitokens,
                refill_millitokens,
                period_ms,
            } => Algorithm::Gcra(Gcra::new(
                capacity_millitokens,
                refill_millitokens,
                period_ms,
            )?),
            RuleParams::FixedWindow {
                limit_units,
                window_ms,
            } => Algorithm::FixedWindow(FixedWindow::new(limit_units, window_ms)?),
            RuleParams::SlidingCounter {
                limit_units,
                window_ms,
            } => Algorithm::SlidingCounter(SlidingCounter::new(limit_units, window_ms)?),
            RuleParams::SlidingLog {
                limit_units,
                window_ms,
            } => Algorithm::SlidingLog(SlidingLog::new(limit_units, window_ms)?),
        })
    }

    /// The parameters of a validated algorithm.
    pub fn from_algorithm(algorithm: &Algorithm) -> Self {
        match algorithm {
            Algorithm::TokenBucket(b) => RuleParams::TokenBucket {
                capacity_millitokens: b.capacity_millitokens(),
                refill_millitokens: b.refill_millitokens(),
                period_ms: b.period_ms(),
                slack_ms: b.slack_ms(),
            },
            Algorithm::Gcra(g) => RuleParams::Gcra {
                capacity_millitokens: g.capacity_millitokens(),
                refill_millitokens: g.refill_millitokens(),
                period_ms: g.period_ms(),
            },
            Algorithm::FixedWindow(w) => RuleParams::FixedWindow {
                limit_units: w.limit_units(),
                window_ms: w.window_ms(),
            },
            Algorithm::SlidingCounter(c) => RuleParams::SlidingCounter {
                limit_units: c.limit_units(),
                window_ms: c.window_ms(),
            },
            Algorithm::SlidingLog(l) => RuleParams::SlidingLog {
                limit_units: l.limit_units(),
                window_ms: l.window_ms(),
            },
        }
    }
}

/// One rule of a batch: its store key, its algorithm and the request's cost against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRule {
    key: String,
    params: RuleParams,
    algorithm: Algorithm,
    cost_millitokens: u64,
    advisory: bool,
}

impl BatchRule {
    /// A rule on `key` with validated `params`. The cost (millitokens; a multiple of 1,000 for window
    /// algorithms) is checked when the store decides.
    pub fn new(key: String, params: RuleParams, cost_millitokens: u64) -> Result<Self, ParamError> {
        let algorithm = params.algorithm()?;
        Ok(Self {
            key,
            params,
            algorithm,
            cost_millitokens,
            advisory: false,
        })
    }

    /// The same rule as an advisory one (a shadow or soft rule): decided and, when the request is
    /// admitted and it would admit too, spent; it never denies.
    pub fn into_advisory(mut self) -> Self {
        self.advisory = true;
        self
    }

    /// Whether the rule only advises ([`into_advisory`](Self::into_advisory)).
    pub fn advisory(&self) -> bool {
        self.advisory
    }

    /// The rule's store key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The parameters as numbers.
    pub fn params(&self) -> &RuleParams {
        &self.params
    }

    /// The validated algorithm.
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// The request's cost against this rule, in millitokens.
    pub fn cost_millitokens(&self) -> u64 {
        self.cost_millitokens
    }
}

/// A batch that cannot be sent to a store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// No rules, or more than [`MAX_RULES_PER_REQUEST`].
    #[error("a batch holds 1 to {MAX_RULES_PER_REQUEST} rules, got {0}")]
    RuleCount(usize),
    /// A key outside the tenant's hash tag: it could live in another slot (CROSSSLOT at runtime).
    #[error("key {key} is not under the tenant's hash tag {{{expected_tag}}}")]
    ForeignKey {
        /// The offending key.
        key: String,
        /// The tag every key must carry, without braces.
        expected_tag: String,
    },
    /// Two rules on one key would read the same state and overwrite each other.
    #[error("key {0} appears twice in one batch")]
    DuplicateKey(String),
    /// A decision record TTL above 2^40 ms.
    #[error("decision record ttl {0} ms is above 2^40")]
    RecordTtl(u64),
    /// `cost_millitokens x costHint` does not fit in 64 bits.
    #[error("rule {rule_id}: cost {cost_millitokens} x costHint {cost_hint} overflows")]
    CostOverflow {
        /// The rule.
        rule_id: RuleId,
        /// The rule's cost per unit, in millitokens.
        cost_millitokens: u64,
        /// The request's cost hint, in units.
        cost_hint: u64,
    },
    /// A global (leased) rule: it has no regional key.
    #[error("rule {0} is global: it is spent from leases, not decided by the regional store")]
    NotRegional(RuleId),
    /// A regional rule whose parameters could not be read back from the bundle (a bundle format
    /// this agent does not understand).
    #[error("rule {0}: its algorithm parameters could not be read")]
    UnreadableParams(RuleId),
}

/// Every regional rule of one request, ready for one atomic store call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleBatch {
    decision_id: DecisionId,
    record_key: String,
    record_ttl_ms: u64,
    rules: Vec<BatchRule>,
    dry_run: bool,
}

impl RuleBatch {
    /// A batch for `tenant`'s request `decision_id`. `record_ttl_ms = 0` means no decision record;
    /// otherwise an admission is recorded for that long and replayed to a retry with the same id.
    pub fn new(
        tenant: &TenantId,
        decision_id: DecisionId,
        record_ttl_ms: u64,
        rules: Vec<BatchRule>,
    ) -> Result<Self, BatchError> {
        let tag = keys::hash_tag(tenant);
        let record_key = keys::decision_key(tenant, &decision_id);
        Self::under_tag(&tag, record_key, decision_id, record_ttl_ms, rules)
    }

    /// A batch of a hot tenant's request in sub-slot `sub_slot` (see
    /// [`hot_tenants`](super::hot_tenants)): every key, the decision record's too, carries the tag
    /// `{t:<tenant>:<sub_slot>}`.
    pub fn new_in_sub_slot(
        tenant: &TenantId,
        sub_slot: u32,
        decision_id: DecisionId,
        record_ttl_ms: u64,
        rules: Vec<BatchRule>,
    ) -> Result<Self, BatchError> {
        let tag = keys::sub_slot_tag(tenant, sub_slot);
        let record_key =
            keys::sub_slot_key(&keys::decision_key(tenant, &decision_id), tenant, sub_slot)
                .ok_or_else(|| BatchError::ForeignKey {
                    key: keys::decision_key(tenant, &decision_id),
                    expected_tag: tag.clone(),
                })?;
        Self::under_tag(&tag, record_key, decision_id, record_ttl_ms, rules)
    }

    fn under_tag(
        tag: &str,
        record_key: String,
        decision_id: DecisionId,
        record_ttl_ms: u64,
        rules: Vec<BatchRule>,
    ) -> Result<Self, BatchError> {
        if rules.is_empty() || rules.len() > MAX_RULES_PER_REQUEST {
            return Err(BatchError::RuleCount(rules.len()));
        }
        if record_ttl_ms > MAX_RULE_PARAMETER {
            return Err(BatchError::RecordTtl(record_ttl_ms));
        }
        let expected_tag = tag.trim_start_matches('{').trim_end_matches('}');
        for (index, rule) in rules.iter().enumerate() {
            if keys::key_hash_tag(&rule.key) != Some(expected_tag) {
                return Err(BatchError::ForeignKey {
                    key: rule.key.clone(),
                    expected_tag: expected_tag.to_owned(),
                });
            }
            if rules[..index].iter().any(|earlier| earlier.key == rule.key) {
                return Err(BatchError::DuplicateKey(rule.key.clone()));
            }
        }
        debug_assert_eq!(keys::key_hash_tag(&record_key), Some(expected_tag));
        Ok(Self {
            decision_id,
            record_key,
            record_ttl_ms,
            rules,
            dry_run: false,
        })
    }

    /// The same batch as a dry run: decided and answered as usual, but nothing is written (no rule
    /// state, no decision record). A check that spends nothing.
    pub fn into_dry_run(mut self) -> Self {
        self.dry_run = true;
        self
    }

    /// Whether the store must write nothing ([`into_dry_run`](Self::into_dry_run)).
    pub fn dry_run(&self) -> bool {
        self.dry_run
    }

    /// The request's decision id: the sliding log's member and the decision record's name.
    pub fn decision_id(&self) -> &DecisionId {
        &self.decision_id
    }

    /// The decision record's key (always present: it also routes the call to the tenant's slot).
    pub fn record_key(&self) -> &str {
        &self.record_key
    }

    /// How long an admission is recorded, in ms; 0 = no record.
    pub fn record_ttl_ms(&self) -> u64 {
        self.record_ttl_ms
    }

    /// The rules, in evaluation order.
    pub fn rules(&self) -> &[BatchRule] {
        &self.rules
    }
}

/// Why several requests' batches cannot be decided as one store call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CombineError {
    /// Nothing to combine.
    #[error("no request has a regional rule")]
    Empty,
    /// Their keys live under different hash tags (two tenants, or a hot tenant's principals in two
    /// sub-slots): no single call can decide them atomically.
    #[error("request {0} is under another hash tag than request 0 (another tenant or sub-slot)")]
    ForeignTag(usize),
    /// Two requests spend one key the store cannot charge twice in one call (a sliding log counts
    /// one entry per request), or one key under two rules.
    #[error("request {later} spends key {key} of request {earlier}, which cannot be charged twice")]
    SharedKey {
        /// The earlier request.
        earlier: usize,
        /// The later one.
        later: usize,
        /// The key.
        key: String,
    },
    /// More distinct regional rules than one call decides.
    #[error("the requests' regional rules are {0}, above {MAX_RULES_PER_REQUEST} for one call")]
    RuleCount(usize),
    /// The summed cost of a shared key is out of range.
    #[error("the summed cost on key {0} is out of range")]
    Cost(String),
}

/// Several requests' batches (as [screened](super::Limiter::screen), a hot tenant's already in its
/// sub-slot) as one all-or-nothing store call: each distinct key once, a key two of them share
/// charged their summed cost, under the first's decision id, with no decision record. Returns the
/// combined batch and, for each request, the combined indexes of its rules (in its own order).
pub fn combine_batches(
    batches: &[&RuleBatch],
) -> Result<(RuleBatch, Vec<Vec<usize>>), CombineError> {
    let first = batches.first().ok_or(CombineError::Empty)?;
    let tag = keys::key_hash_tag(first.record_key())
        .ok_or(CombineError::ForeignTag(0))?
        .to_owned();
    let mut rules: Vec<BatchRule> = Vec::new();
    let mut owner_of_rule: Vec<usize> = Vec::new();
    let mut indexes = Vec::with_capacity(batches.len());
    for (request, batch) in batches.iter().enumerate() {
        let mut own = Vec::with_capacity(batch.rules().len());
        for rule in batch.rules() {
            if keys::key_hash_tag(rule.key()) != Some(tag.as_str()) {
                return Err(CombineError::ForeignTag(request));
            }
            match rules.iter().position(|earlier| earlier.key == rule.key) {
                None => {
                    own.push(rules.len());
                    rules.push(rule.clone());
                    owner_of_rule.push(request);
                }
                Some(at) => {
                    let shared = &mut rules[at];
                    let chargeable_twice = shared.params == rule.params
                        && shared.advisory == rule.advisory
                        && !matches!(shared.algorithm, Algorithm::SlidingLog(_));
                    if !chargeable_twice {
                        return Err(CombineError::SharedKey {
                            earlier: owner_of_rule[at],
                            later: request,
                            key: rule.key.clone(),
                        });
                    }
                    shared.cost_millitokens = shared
                        .cost_millitokens
                        .checked_add(rule.cost_millitokens)
                        .filter(|cost| *cost <= MAX_RULE_PARAMETER)
                        .ok_or_else(|| CombineError::Cost(rule.key.clone()))?;
                    own.push(at);
                }
            }
        }
        indexes.push(own);
    }
    if rules.len() > MAX_RULES_PER_REQUEST {
        return Err(CombineError::RuleCount(rules.len()));
    }
    let combined = RuleBatch::under_tag(
        &tag,
        first.record_key().to_owned(),
        first.decision_id().clone(),
        0,
        rules,
    )
    .map_err(|_| CombineError::ForeignTag(0))?;
    Ok((combined, indexes))
}

/// A request's batch beside the policy rules it came from: `rules[i]` is batch rule `i`, so a
/// denial's index names its rule (and scope), its fail mode and its local bucket.
#[derive(Debug, Clone)]
pub struct PlannedBatch<'a> {
    /// What the store decides.
    pub batch: RuleBatch,
    /// The policy rules, in the batch's order.
    pub rules: Vec<&'a Rule>,
    /// The request's tenant (the keys' hash tag).
    pub tenant: TenantId,
    /// The request's principal type (`ip` marks a pre-authentication request).
    pub principal_type: PrincipalType,
    /// The principal's keyed hash, when a per-principal rule applies (it is in that rule's key).
    pub principal_hash: Option<PrincipalHash>,
    /// The version of the bundle the rules came from, for the decision record.
    pub policy_version: u64,
}

impl<'a> PlannedBatch<'a> {
    /// The same rules charged `requests` times over, under `decision_id`, with no decision record:
    /// one store call that takes a gateway's share of every regional rule at once (a sub-lease).
    /// A denial still debits nothing.
    pub fn times(&self, requests: u64, decision_id: DecisionId) -> Result<Self, BatchError> {
        let rules = self
            .batch
            .rules()
            .iter()
            .zip(&self.rules)
            .map(|(batch_rule, rule)| {
                let cost_millitokens = batch_rule
                    .cost_millitokens()
                    .checked_mul(requests)
                    .ok_or_else(|| BatchError::CostOverflow {
                        rule_id: rule.id.clone(),
                        cost_millitokens: batch_rule.cost_millitokens(),
                        cost_hint: requests,
                    })?;
                Ok(BatchRule {
                    cost_millitokens,
                    ..batch_rule.clone()
                })
            })
            .collect::<Result<Vec<_>, BatchError>>()?;
        Ok(Self {
            batch: RuleBatch::new(&self.tenant, decision_id, 0, rules)?,
            rules: self.rules.clone(),
            tenant: self.tenant.clone(),
            principal_type: self.principal_type,
            principal_hash: self.principal_hash.clone(),
            policy_version: self.policy_version,
        })
    }
}

/// Maps a validated request to the store call for its regional rules, or `None` when no regional
/// rule applies. A decision record of `record_ttl_ms` is requested when any of the rules is
/// `idempotent`. A request's `dryRun` makes the batch a [dry run](RuleBatch::into_dry_run).
///
/// The request must have passed `AdmissionRequest::validate` (its principal id is hashed, never
/// stored).
///
/// Long by design: the principal's keyed hash is computed at most once, lazily, and shared by the
/// overrides laid on the rules, every user-scope rule's key and the planned batch; split, that
/// once-only hash would be threaded through each piece, and whether the principal id is hashed at
/// all would no longer be seen in one place.
pub fn plan_request<'a>(
    bundle: &'a PolicyBundle,
    request: &AdmissionRequest,
    pepper: &Pepper,
    ip_prefixes: IpPrefixes,
    record_ttl_ms: u64,
) -> Result<Option<PlannedBatch<'a>>, BatchError> {
    let tenant = &request.tenant_id;
    let kind = request.principal.kind;
    let mut rules = bundle.regional_rules_for(tenant, &request.route_group, kind);
    if rules.is_empty() {
        return Ok(None);
    }
    // The keyed hash of the principal, computed once and only if a user-scope rule needs it (a
    // rule with its own prefix lengths hashes the address at them).
    let principal_hash = std::cell::OnceCell::new();
    let hash_principal = || keys::principal_hash(pepper, kind, &request.principal.id, ip_prefixes);
    // The principal's own overrides, if any are laid: same keys, other amounts.
    bundle.lay_principal_overrides(&mut rules, tenant, kind, || {
        principal_hash.get_or_init(hash_principal).clone()
    });
    let mut batch_rules = Vec::with_capacity(rules.len());
    for rule in &rules {
        let route_group = rule.matcher.route_group.as_ref();
        let rule_key = match rule.scope {
            Scope::User if kind == PrincipalType::Ip && rule.ip_prefixes.is_some() => {
                let prefixes = rule.ip_prefixes_on(ip_prefixes);
                let hash = keys::principal_hash(pepper, kind, &request.principal.id, prefixes);
                keys::principal_key_in(tenant, &rule.principal_segment(kind), &hash, route_group)
            }
            Scope::User => {
                let hash = principal_hash.get_or_init(hash_principal);
                keys::principal_key(tenant, kind, hash, route_group)
            }
            Scope::Route | Scope::Tenant => keys::tenant_key(tenant, route_group),
            // Leased from an allocator pool, never decided by the regional store.
            Scope::Global => return Err(BatchError::NotRegional(rule.id.clone())),
        };
        let cost_millitokens = rule
            .cost_millitokens_for(request.cost_hint)
            .ok_or_else(|| BatchError::CostOverflow {
                rule_id: rule.id.clone(),
                cost_millitokens: rule.cost_millitokens,
                cost_hint: request.cost_hint,
            })?;
        let Limit::Regional(algorithm) = &rule.limit else {
            return Err(BatchError::NotRegional(rule.id.clone()));
        };
        let key = keys::rule_state_key(&rule_key, algorithm.state_shape());
        let params = RuleParams::from_algorithm(algorithm);
        let batch_rule = BatchRule::new(key, params, cost_millitokens)
            .map_err(|_| BatchError::UnreadableParams(rule.id.clone()))?;
        let batch_rule = if rule.mode.is_advisory() {
            batch_rule.into_advisory()
        } else {
            batch_rule
        };
        debug_assert_eq!(batch_rule.algorithm(), algorithm);
        batch_rules.push(batch_rule);
    }
    let record_ttl_ms = if rules.iter().any(|rule| rule.idempotent) {
        record_ttl_ms
    } else {
        0
    };
    let batch = RuleBatch::new(
        tenant,
        request.request_id.clone(),
        record_ttl_ms,
        batch_rules,
    )?;
    let batch = if request.dry_run {
        batch.into_dry_run()
    } else {
        batch
    };
    Ok(Some(PlannedBatch {
        batch,
        rules,
        tenant: tenant.clone(),
        principal_type: kind,
        principal_hash: principal_hash.into_inner(),
        policy_version: bundle.version(),
    }))
}

#[cfg(test)]
mod tests {
    use allot_shared::contract::{Principal, PrincipalType};
    use allot_shared::ids::RouteGroup;
    use allot_shared::policy::parse_bundle;

    use super::*;

    const BUNDLE: &str = r#"{
        "rules": [
            {"id": "tenant-all", "scope": "tenant", "algorithm": "token_bucket",
             "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 60000,
             "failMode": "closed"},
            {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
             "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000, "failMode": "closed"},
            {"id": "read-route", "scope": "route", "routeGroup": "read", "algorithm": "sliding_log",
             "limit": 50, "windowMs": 10000, "failMode": "closed", "idempotent": true},
            {"id": "export-user", "scope": "user", "routeGroup": "export", "algorithm": "gcra",
             "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000, "costMillis": 10000,
             "failMode": "closed"}
        ]
    }"#;

    fn tenant() -> TenantId {
        TenantId::parse("atlas").expect("tenant")
    }

    fn request(route: &str, cost_hint: u64) -> AdmissionRequest {
        AdmissionRequest {
            request_id: DecisionId::parse("r-1").expect("id"),
            tenant_id: tenant(),
            principal: Principal {
                kind: PrincipalType::User,
                id: "U-17".to_owned(),
                api_key_id: None,
            },
            route_group: RouteGroup::parse(route).expect("route"),
            method: "GET".to_owned(),
            cost_hint,
            policy_epoch: None,
            dry_run: false,
            metered: false,
        }
    }

    fn pepper() -> Pepper {
        Pepper::new(b"test-pepper-0123456789".to_vec()).expect("pepper")
    }

    #[test]
    fn a_request_maps_to_its_rules_in_evaluation_order_with_scaled_costs() {
        let bundle = parse_bundle(BUNDLE)
            .expect("valid")
            .into_file_bundle()
            .expect("sealed");
        let planned = plan_request(
            &bundle,
            &request("read", 3),
            &pepper(),
            IpPrefixes::default(),
            30_000,
        )
        .expect("plannable")
        .expect("rules apply");
        let ids: Vec<&str> = planned.rules.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["read-user", "read-route", "tenant-all"]);
        let batch = &planned.batch;
        let hash = keys::principal_hash(
            &pepper(),
            PrincipalType::User,
            "U-17",
            IpPrefixes::default(),
        );
        let read = RouteGroup::parse("read").expect("route");
        let keys: Vec<&str> = batch.rules().iter().map(BatchRule::key).collect();
        assert_eq!(
            keys,
            [
                format!(
                    "{}:tb",
                    keys::principal_key(&tenant(), PrincipalType::User, &hash, Some(&read))
                ),
                format!("{}:sl", keys::tenant_key(&tenant(), Some(&read))),
                format!("{}:tb", keys::tenant_key(&tenant(), None)),
            ]
        );
        let costs: Vec<u64> = batch
            .rules()
            .iter()
            .map(BatchRule::cost_millitokens)
            .collect();
        assert_eq!(costs, [3_000, 3_000, 3_000]);
        assert_eq!(
            batch.rules()[1].params(),
            &RuleParams::SlidingLog {
                limit_units: 50,
                window_ms: 10_000
            }
        );
        assert_eq!(batch.record_ttl_ms(), 30_000, "read-route is idempotent");
        assert_eq!(batch.record_key(), "rl:v1:{t:atlas}:d:r-1");
    }

    #[test]
    fn gcra_parameters_are_read_back_exactly_and_records_only_when_asked() {
        let bundle = parse_bundle(BUNDLE)
            .expect("valid")
            .into_file_bundle()
            .expect("sealed");
        let planned = plan_request(
            &bundle,
            &request("export", 1),
            &pepper(),
            IpPrefixes::default(),
            30_000,
        )
        .expect("plannable")
        .expect("rules apply");
        assert_eq!(
            planned.batch.rules()[0].params(),
            &RuleParams::Gcra {
                capacity_millitokens: 20_000,
                refill_millitokens: 2_000,
                period_ms: 1_000
            }
        );
        assert_eq!(planned.batch.rules()[0].cost_millitokens(), 10_000);
        assert_eq!(
            planned.batch.record_ttl_ms(),
            0,
            "no idempotent rule applies"
        );
    }

    #[test]
    fn batches_refuse_foreign_tags_duplicate_keys_and_bad_sizes() {
        let params = RuleParams::FixedWindow {
            limit_units: 5,
            window_ms: 1_000,
        };
        let rule = |key: &str| BatchRule::new(key.to_owned(), params, 1_000).expect("valid");
        let id = || DecisionId::parse("r-1").expect("id");
        let own = "rl:v1:{t:atlas}:tenant:atlas:*";
        assert!(matches!(
            RuleBatch::new(
                &tenant(),
                id(),
                0,
                vec![rule("rl:v1:{t:birch}:tenant:birch:*")]
            ),
            Err(BatchError::ForeignKey { .. })
        ));
        assert!(matches!(
            RuleBatch::new(&tenant(), id(), 0, vec![rule("no-tag")]),
            Err(BatchError::ForeignKey { .. })
        ));
        assert_eq!(
            RuleBatch::new(&tenant(), id(), 0, vec![rule(own), rule(own)]),
            Err(BatchError::DuplicateKey(own.to_owned()))
        );
        assert_eq!(
            RuleBatch::new(&tenant(), id(), 0, vec![]),
            Err(BatchError::RuleCount(0))
        );
        let nine = (0..9)
            .map(|i| rule(&format!("rl:v1:{{t:atlas}}:x:{i}")))
            .collect();
        assert_eq!(
            RuleBatch::new(&tenant(), id(), 0, nine),
            Err(BatchError::RuleCount(9))
        );
        assert_eq!(
            RuleBatch::new(&tenant(), id(), (1 << 40) + 1, vec![rule(own)]),
            Err(BatchError::RecordTtl((1 << 40) + 1))
        );
        assert!(
            BatchRule::new(
                own.to_owned(),
                RuleParams::FixedWindow {
                    limit_units: 0,
                    window_ms: 1
                },
                1_000
            )
            .is_err()
        );
    }

    fn batch(id: &str, rules: Vec<BatchRule>) -> RuleBatch {
        RuleBatch::new(&tenant(), DecisionId::parse(id).expect("id"), 0, rules).expect("batch")
    }

    fn window(key: &str, cost_millitokens: u64) -> BatchRule {
        let params = RuleParams::FixedWindow {
            limit_units: 5,
            window_ms: 1_000,
        };
        BatchRule::new(key.to_owned(), params, cost_millitokens).expect("rule")
    }

    fn log(key: &str) -> BatchRule {
        let params = RuleParams::SlidingLog {
            limit_units: 5,
            window_ms: 1_000,
        };
        BatchRule::new(key.to_owned(), params, 1_000).expect("rule")
    }

    const TENANT_KEY: &str = "rl:v1:{t:atlas}:tenant:atlas:*";

    #[test]
    fn a_shared_key_is_decided_once_at_the_summed_cost() {
        let a = batch(
            "r-a",
            vec![
                window("rl:v1:{t:atlas}:u:a", 1_000),
                window(TENANT_KEY, 1_000),
            ],
        );
        let b = batch(
            "r-b",
            vec![
                window("rl:v1:{t:atlas}:u:b", 2_000),
                window(TENANT_KEY, 2_000),
            ],
        );
        let (combined, indexes) = combine_batches(&[&a, &b]).expect("combinable");
        let keys: Vec<&str> = combined.rules().iter().map(BatchRule::key).collect();
        assert_eq!(
            keys,
            ["rl:v1:{t:atlas}:u:a", TENANT_KEY, "rl:v1:{t:atlas}:u:b"]
        );
        let costs: Vec<u64> = combined
            .rules()
            .iter()
            .map(BatchRule::cost_millitokens)
            .collect();
        assert_eq!(costs, [1_000, 3_000, 2_000], "the tenant key pays for both");
        assert_eq!(indexes, [vec![0, 1], vec![2, 1]]);
        assert_eq!(combined.record_ttl_ms(), 0, "no decision record");
        assert_eq!(combined.decision_id(), a.decision_id());
    }

    #[test]
    fn what_one_store_call_cannot_decide_is_refused_naming_the_request() {
        let a = batch("r-a", vec![window(TENANT_KEY, 1_000)]);
        let other_tenant = RuleBatch::new(
            &TenantId::parse("birch").expect("tenant"),
            DecisionId::parse("r-b").expect("id"),
            0,
            vec![window("rl:v1:{t:birch}:tenant:birch:*", 1_000)],
        )
        .expect("batch");
        assert_eq!(
            combine_batches(&[&a, &other_tenant]),
            Err(CombineError::ForeignTag(1))
        );
        let logged = batch("r-c", vec![log("rl:v1:{t:atlas}:route:read:sl")]);
        let logged_again = batch("r-d", vec![log("rl:v1:{t:atlas}:route:read:sl")]);
        assert!(matches!(
            combine_batches(&[&a, &logged, &logged_again]),
            Err(CombineError::SharedKey {
                earlier: 1,
                later: 2,
                ..
            })
        ));
        let other_params = batch(
            "r-e",
            vec![
                BatchRule::new(
                    TENANT_KEY.to_owned(),
                    RuleParams::FixedWindow {
                        limit_units: 6,
                        window_ms: 1_000,
                    },
                    1_000,
                )
                .expect("rule"),
            ],
        );
        assert!(matches!(
            combine_batches(&[&a, &other_params]),
            Err(CombineError::SharedKey { later: 1, .. })
        ));
        let many: Vec<RuleBatch> = (0..9)
            .map(|i| {
                batch(
                    "r-m",
                    vec![window(&format!("rl:v1:{{t:atlas}}:x:{i}"), 1_000)],
                )
            })
            .collect();
        let many: Vec<&RuleBatch> = many.iter().collect();
        assert_eq!(combine_batches(&many), Err(CombineError::RuleCount(9)));
        assert_eq!(combine_batches(&[]), Err(CombineError::Empty));
    }
}
