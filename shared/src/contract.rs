//! The admission contract: what a gateway asks, what the limiter answers, and how the answer becomes an
//! HTTP response.
//!
//! These are wire types (serde, camelCase) shared by the agent and by tests; the decision core does not
//! depend on them. The HTTP mapping is pure so that the agent's HTTP and gRPC surfaces and the tests
//! agree on it:
//! - allowed -> 200 (the request proceeds; admission is not a promise of backend success, I11);
//! - rate or concurrency exceeded -> 429 with `Retry-After: max(1, ceil(ms / 1000))`, omitted when the
//!   request can never succeed (`retryAfterMs = -1`);
//! - a fail-closed limiter outage or a broken policy -> 503, never 429;
//! - `RateLimit` / `RateLimit-Policy` fields only for authenticated callers, and only for rules they
//!   may see (their own scope, unless the rule's `expose` says otherwise);
//! - error bodies are RFC 9457 problem details.

use serde::{Deserialize, Serialize};

use crate::FieldError;
use crate::ids::{DecisionId, RouteGroup, TenantId};

/// Longest principal id or API key id accepted, in characters (I10: at most 1 KiB of UTF-8), as
/// JSON Schema's `maxLength` counts them. They are hashed, never stored raw.
pub const MAX_PRINCIPAL_ID_LEN: usize = 256;

/// Whether `id` is a principal or API key id of 1 to [`MAX_PRINCIPAL_ID_LEN`] characters. The byte
/// length is looked at first, so a hostile megabyte is refused without counting it.
pub fn principal_id_in_bounds(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 4 * MAX_PRINCIPAL_ID_LEN
        && id.chars().count() <= MAX_PRINCIPAL_ID_LEN
}

/// The kind of verified identity a request carries.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PrincipalType {
    /// A user, from a verified token.
    User,
    /// An API key, looked up server-side.
    ApiKey,
    /// A client address, before authentication (coarse limits only).
    Ip,
}

impl PrincipalType {
    /// The principal-type segment of a store key: `u`, `k` or `ip`.
    pub fn key_segment(self) -> &'static str {
        match self {
            PrincipalType::User => "u",
            PrincipalType::ApiKey => "k",
            PrincipalType::Ip => "ip",
        }
    }

    /// Whether the caller proved who it is. Unauthenticated callers learn nothing about limits.
    pub fn is_authenticated(self) -> bool {
        !matches!(self, PrincipalType::Ip)
    }
}

/// Who the request is from, derived by the gateway from verified credentials only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Principal {
    /// The identity kind.
    #[serde(rename = "type")]
    pub kind: PrincipalType,
    /// The identity (user id, or the client address for `ip`). Never stored raw: keys hold its HMAC.
    #[schema(min_length = 1, max_length = 256)]
    pub id: String,
    /// The API key the request came with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 256)]
    pub api_key_id: Option<String>,
}

/// The admission request a gateway sends for every request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdmissionRequest {
    /// Minted at ingress and stable across retries: the idempotency scope of the decision.
    pub request_id: DecisionId,
    /// The verified tenant.
    pub tenant_id: TenantId,
    /// The verified principal.
    pub principal: Principal,
    /// The route group the request maps to, e.g. `read`.
    pub route_group: RouteGroup,
    /// The HTTP method, for logs and matching.
    #[schema(pattern = "^[A-Z]{1,16}$")]
    pub method: String,
    /// Cost in whole units (default 1); a policy may override it per route group.
    #[serde(default = "one", deserialize_with = "crate::json_number::whole")]
    #[schema(minimum = 1, maximum = 1_073_741_824)]
    pub cost_hint: u64,
    /// The policy bundle version the gateway evaluated against, if it tracks one.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::json_number::optional_whole"
    )]
    #[schema(minimum = 0, maximum = 9_007_199_254_740_992_u64)]
    pub policy_epoch: Option<u64>,
    /// Decide without spending: the answer says what a real request would get now, and nothing is
    /// debited anywhere (no regional write, no lease spent, no fallback claimed, no concurrency
    /// slot taken).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// Charge `costHint` now as an estimate and the actual cost later (`POST /v1/settle` with the
    /// decision id, within the agent's settle window): for costs known only after the response
    /// (model tokens, bytes, rows). Unsettled, the estimate stands.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub metered: bool,
}

fn one() -> u64 {
    1
}

impl AdmissionRequest {
    /// Checks what serde cannot: bounded, non-empty identities, a plausible method and a cost in
    /// `[1, 2^30]` units.
    pub fn validate(&self) -> Result<(), FieldError> {
        let bounded = principal_id_in_bounds;
        if !bounded(&self.principal.id) {
            return Err(FieldError::new(
                "principal.id",
                "must be 1 to 256 characters",
            ));
        }
        if let Some(key) = &self.principal.api_key_id
            && !bounded(key)
        {
            return Err(FieldError::new(
                "principal.apiKeyId",
                "must be 1 to 256 characters",
            ));
        }
        if self.method.is_empty()
            || self.method.len() > 16
            || !self.method.bytes().all(|b| b.is_ascii_uppercase())
        {
            return Err(FieldError::new(
                "method",
                "must be an upper-case HTTP method of at most 16 letters",
            ));
        }
        if !(1..=(1 << 30)).contains(&self.cost_hint) {
            return Err(FieldError::new(
                "costHint",
                "must be an integer in [1, 2^30]",
            ));
        }
        if self.metered && self.dry_run {
            return Err(FieldError::new(
                "metered",
                "a dry run spends nothing, so there is nothing to settle: send one of metered and dryRun",
            ));
        }
        Ok(())
    }
}

/// Largest actual cost a settlement may state, in whole units (as `costHint`).
pub const MAX_SETTLE_COST_UNITS: u64 = 1 << 30;

/// `POST /v1/settle`: the actual cost of a metered admission, once the response is known.
/// Idempotent by decision id: the same body again gets the same answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettleRequest {
    /// The metered admission's decision id (its `requestId`).
    pub decision_id: DecisionId,
    /// The tenant it was admitted for.
    pub tenant_id: TenantId,
    /// What the request actually cost, whole units, in `[0, 2^30]`.
    #[serde(rename = "actualCost", deserialize_with = "crate::json_number::whole")]
    #[schema(minimum = 0, maximum = 1_073_741_824)]
    pub actual_cost_units: u64,
}

impl SettleRequest {
    /// Checks what serde cannot: a bounded actual cost.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.actual_cost_units > MAX_SETTLE_COST_UNITS {
            return Err(FieldError::new(
                "actualCost",
                "must be an integer in [0, 2^30]",
            ));
        }
        Ok(())
    }
}

/// The answer to `POST /v1/settle`.
///
/// An actual cost below the estimate gives nothing back (`unused`; no refunds). Above it, the
/// difference (`extra`) is charged at once where it fits; what does not fit becomes debt that the
/// next admissions pay first (`owed`), up to a bound; beyond it, it is written off and counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettleAnswer {
    /// The admission settled.
    pub decision_id: DecisionId,
    /// The estimate charged at admission, whole units.
    #[serde(rename = "estimate")]
    pub estimate_units: u64,
    /// The actual cost, whole units.
    #[serde(rename = "actualCost")]
    pub actual_cost_units: u64,
    /// `estimate - actualCost` when positive: spent all the same.
    #[serde(rename = "unused")]
    pub unused_units: u64,
    /// `actualCost - estimate` when positive: what was charged now or owed.
    #[serde(rename = "extra")]
    pub extra_units: u64,
    /// How the regional rules took the extra cost.
    pub regional: Charge,
    /// How each global pool took it, in tokens.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<PoolCharge>,
    /// True when this decision id was settled before: the answer is that settlement's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

/// How one limit took a settlement's extra cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Charge {
    /// Charged at once.
    pub paid: u64,
    /// Owed: the next admissions pay it first.
    pub owed: u64,
    /// Beyond the debt the limit may carry: not charged, counted in metrics and the ledger.
    pub written_off: u64,
}

/// How one global pool took a settlement's extra cost, tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCharge {
    /// The pool.
    pub pool: crate::ids::PoolId,
    /// Charged at once from the region's leases.
    pub paid: u64,
    /// Owed: paid first from the region's next leases.
    pub owed: u64,
    /// Beyond `settleDebtPerRegion`: not charged, counted in metrics and the ledger.
    pub written_off: u64,
}

/// The answer to `POST /v1/renew`: what a heartbeat did to the concurrency slots of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SlotRenewal {
    /// Slots extended by their lease TTL.
    pub renewed: u32,
    /// Slots that had lapsed (or were never held): not taken again.
    pub lapsed: u32,
    /// Slots the store could not be asked about (they lapse with their TTL unless a later
    /// heartbeat reaches them).
    pub failed: u32,
}

/// Which rule said no.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DeniedScope {
    /// A per-principal rule.
    User,
    /// A tenant-wide rule.
    Tenant,
    /// A tenant-wide rule for one route group.
    Route,
    /// The leased global pool.
    Global,
    /// A concurrency cap.
    Concurrency,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Reason {
    /// A rate rule is exhausted.
    RateExceeded,
    /// A concurrency cap is full.
    ConcurrencyExceeded,
    /// The store is unavailable and the rule fails closed.
    LimiterUnavailable,
    /// The policy cannot be evaluated (a defect to alert on).
    PolicyError,
    /// The request costs more than the rule can ever admit at once (a global pool's chunk): it will
    /// never be admitted as it is (429, no `Retry-After`).
    CostTooHigh,
}

/// The decision: a structured record first, an HTTP response second.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Decision {
    /// Whether the request may proceed.
    pub allowed: bool,
    /// The request's id, echoed.
    pub decision_id: DecisionId,
    /// The rule the decision is attributed to (the denying rule, or the most constraining one).
    pub policy_id: Option<String>,
    /// The policy bundle version the decision was made against.
    pub policy_version: u64,
    /// Which scope denied; `None` when allowed.
    pub denied_scope: Option<DeniedScope>,
    /// Why it was denied; `None` when allowed.
    pub reason: Option<Reason>,
    /// The attributed rule's limit, in whole units (internal; exposure to clients is separate).
    #[serde(rename = "limit")]
    pub limit_units: u64,
    /// What is left of it, in whole units.
    #[serde(rename = "remaining")]
    pub remaining_units: u64,
    /// When to retry in ms; 0 when allowed; -1 when the request can never succeed.
    pub retry_after_ms: i64,
    /// True when the decision was made without the shared store (a bounded local fallback).
    pub fallback: bool,
    /// True when the request was a dry run: nothing was spent, whatever `allowed` says.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// The shadow and soft rules that would have denied the request (they deny nothing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<Violation>,
    /// A metered admission: settle its actual cost (`POST /v1/settle`) before this instant, epoch
    /// ms; unsettled, the estimate stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settle_by_ms: Option<u64>,
}

/// A shadow or soft rule that would have denied a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Violation {
    /// The rule.
    pub policy_id: String,
    /// How it acts: `shadow` (the caller is not told) or `soft` (the caller is).
    pub mode: AdvisoryMode,
    /// Whose budget it limits.
    pub scope: DeniedScope,
}

/// The mode of a rule that advises instead of denying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AdvisoryMode {
    /// Dark-launched: metrics, the decision log and the gateway's headers say what it would have
    /// done; the caller is not told.
    Shadow,
    /// The caller is told (a response header) and admitted.
    Soft,
}

/// `GET /v1/quota` on the agent: whose quotas to show. A query string of these fields, set by the
/// gateway from verified credentials, like an [`AdmissionRequest`].
#[derive(
    Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema, utoipa::IntoParams,
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct QuotaQuery {
    /// The verified tenant.
    pub tenant_id: TenantId,
    /// The verified principal's kind.
    pub principal_type: PrincipalType,
    /// The verified principal (hashed, never stored).
    #[schema(min_length = 1, max_length = 256)]
    #[param(min_length = 1, max_length = 256)]
    pub principal_id: String,
    /// Only the rules of this route group (and those of every route group); absent: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_group: Option<RouteGroup>,
}

impl QuotaQuery {
    /// Checks what serde cannot: a bounded, non-empty principal id.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !principal_id_in_bounds(&self.principal_id) {
            return Err(FieldError::new(
                "principalId",
                "must be 1 to 256 characters",
            ));
        }
        Ok(())
    }
}

/// The answer to `GET /v1/quota`: the caller's own quotas, only those its rules let it see.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaStatus {
    /// The tenant asked about.
    pub tenant_id: TenantId,
    /// The policy bundle version the rules come from.
    pub policy_version: u64,
    /// One line per visible rule, in evaluation order (regional, then global).
    pub quotas: Vec<QuotaLine>,
}

/// One quota as its caller may see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaLine {
    /// The rule's id.
    pub policy_id: String,
    /// Whose budget it is (`user`, `route`, `tenant` or `global`).
    pub scope: DeniedScope,
    /// The route group the rule is limited to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_group: Option<RouteGroup>,
    /// The global pool, for a global rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::ids::PoolId>,
    /// The limit in whole units (a token bucket's capacity, a window's limit, a pool's `G`).
    #[serde(rename = "limit")]
    pub limit_units: u64,
    /// What is left now, in whole units; `null` when it cannot be known now (the store is
    /// unavailable, or this region has not heard from the allocator in the pool's current window).
    #[serde(rename = "remaining")]
    pub remaining_units: Option<u64>,
    /// The window the limit is stated over, ms (a rate rule's: its time to refill from empty).
    pub window_ms: u64,
    /// When the whole limit is available again, ms from now, at the latest.
    pub reset_ms: u64,
    /// Decided from the region's bounded local fallback, not the shared store.
    pub fallback: bool,
    /// For a global pool: how old the allocator's figure is, ms. The pool's remaining is what the
    /// allocator had left to grant then, plus what this region holds unspent; other regions may
    /// have spent some of theirs since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
    /// The override the limit comes from, when an operator set one for this tenant or this
    /// caller (or, for a global pool, for the pool) instead of the policy's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub override_id: Option<crate::ids::RecordId>,
}

/// `application/problem+json`.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// The HTTP status for a decision.
pub fn http_status(decision: &Decision) -> u16 {
    if decision.allowed {
        return 200;
    }
    match decision.reason {
        Some(Reason::LimiterUnavailable) | Some(Reason::PolicyError) => 503,
        Some(Reason::RateExceeded)
        | Some(Reason::ConcurrencyExceeded)
        | Some(Reason::CostTooHigh)
        | None => 429,
    }
}

/// The `Retry-After` value in whole seconds for a hint in ms: `max(1, ceil(ms / 1000))`, or `None` when
/// the request can never succeed (negative hint). Rounding up is deliberate: a client that came back
/// early would be denied again.
pub fn retry_after_seconds(retry_after_ms: i64) -> Option<u64> {
    let ms = u64::try_from(retry_after_ms).ok()?;
    Some(ms.div_ceil(1_000).max(1))
}

/// The `Retry-After` header for a decision: only on denials with a finite hint.
pub fn retry_after_header(decision: &Decision) -> Option<u64> {
    if decision.allowed {
        return None;
    }
    retry_after_seconds(decision.retry_after_ms)
}

/// One quota as a caller may see it, in the units of the RateLimit header draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaView {
    /// The policy name shown to the caller (a rule id; its charset needs no escaping).
    pub policy_name: String,
    /// Quota units per window (`q`).
    pub quota_units: u64,
    /// Window length in seconds (`w`).
    pub window_seconds: u64,
    /// Units left (`r`).
    pub remaining_units: u64,
    /// Seconds until more is available (`t`).
    pub reset_seconds: u64,
}

fn sf_string(value: &str) -> String {
    // A Structured Fields sf-string: printable ASCII, with `"` and `\` escaped; anything else dropped.
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// The `RateLimit-Policy` and `RateLimit` field values (draft-ietf-httpapi-ratelimit-headers) of a
/// quota, e.g. `"read";q=20;w=10` and `"read";r=0;t=1`. Whether the caller may see the quota at
/// all is the rule's to say (`allot_shared::policy::Rule::visible_to`), asked before this.
pub fn rate_limit_fields(view: &QuotaView) -> (String, String) {
    let name = sf_string(&view.policy_name);
    (
        format!("{name};q={};w={}", view.quota_units, view.window_seconds),
        format!("{name};r={};t={}", view.remaining_units, view.reset_seconds),
    )
}

/// An RFC 9457 problem details body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    /// A URI naming the problem type; `about:blank` when the status says it all.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short summary of the problem type.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What happened, for a human.
    pub detail: String,
    /// The request field at fault, when there is one (e.g. `rules[2].capacityMillis`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The decision this problem belongs to, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_id: Option<String>,
    /// Further members specific to the problem (e.g. `leader` on a follower's 503).
    #[serde(flatten)]
    pub extensions: serde_json::Map<String, serde_json::Value>,
}

impl Problem {
    /// A problem of type `about:blank`.
    pub fn new(status: u16, title: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            type_uri: "about:blank".to_owned(),
            title: title.into(),
            status,
            detail: detail.into(),
            field: None,
            decision_id: None,
            extensions: serde_json::Map::new(),
        }
    }

    /// Adds a member to the body.
    pub fn with_extension(mut self, name: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extensions.insert(name.to_owned(), value.into());
        self
    }

    /// Names the field at fault.
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// The body for a denied decision. Unauthenticated callers get a generic text with no policy names,
    /// limits or counts.
    pub fn for_denial(decision: &Decision, caller: PrincipalType) -> Self {
        let status = http_status(decision);
        let mut problem = if status == 503 {
            Self::new(
                503,
                "Rate limiter unavailable",
                "The request could not be checked against its quota. Retry later.",
            )
        } else if decision.reason == Some(Reason::CostTooHigh) {
            Self::new(
                429,
                "Request cost too high",
                "The request costs more than its quota can admit at once; it will not be admitted \
                 as it is. Send it in smaller parts.",
            )
        } else {
            Self::new(
                429,
                "Rate limit exceeded",
                "Too many requests. Retry after the interval given.",
            )
        };
        if caller.is_authenticated() {
            problem.decision_id = Some(decision.decision_id.to_string());
        }
        problem
    }
}
