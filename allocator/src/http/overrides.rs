//! Overrides (`/v1/overrides`): a different limit for one tenant, user or API key without a
//! policy bundle per tenant ([`crate::overrides`]). Operators create, list and end them; agents
//! read the rule overrides in force as one versioned, checksummed set.

use allot_shared::contract::{PrincipalType, Problem};
use allot_shared::ids::{PoolId, RecordId, RuleId, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper, PrincipalHash, principal_hash};
use allot_shared::overrides::{OverridePrincipal, OverrideSet, RuleAmounts};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::changes::{Changed, record_id, run_change};
use super::errors::{ApiError, invalid_id};
use super::io::{json_response, parse_json};
use crate::auth::OperatorRole;
use crate::overrides::{
    MAX_REASON_CHARS, NewOverride, Override, OverrideStoreError, SetCache, Target,
    check_rule_target,
};

/// Most overrides one page lists.
pub const MAX_OVERRIDES_PER_PAGE: usize = 1_000;
/// Overrides per page when the query names no `limit`.
pub const DEFAULT_OVERRIDES_PER_PAGE: usize = 100;

/// What the API keeps for overrides: the agents' set, built once per version, and the pepper
/// that hashes the principals overrides name.
pub struct OverrideService {
    cache: SetCache,
    pepper: Option<Pepper>,
}

impl OverrideService {
    /// With the agents' pepper, when the allocator was given it.
    pub fn new(pepper: Option<Pepper>) -> Self {
        Self {
            cache: SetCache::default(),
            pepper,
        }
    }
}

/// The principal an override names: by id (hashed here, with the agents' pepper, and never
/// stored) or by its hash.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PrincipalSpec {
    /// `user` or `api_key`.
    #[serde(rename = "type")]
    pub kind: PrincipalType,
    /// The user id or API key id, as gateways send it; needs the allocator's `--pepper-file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 256)]
    pub id: Option<String>,
    /// The principal's keyed hash, as the agents' decision log shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<PrincipalHash>,
}

/// `POST /v1/overrides` body: exactly one of `pool` and `rule`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OverrideSpec {
    /// Whose limit.
    pub tenant: TenantId,
    /// A pool of the tenant: `limit` replaces its `G` (tokens per window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    /// A regional rule of the policy in force: its amounts for the tenant, or for `principal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<RuleId>,
    /// Only this user or API key (a per-principal rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<PrincipalSpec>,
    /// A pool's `G`, or a window rule's limit.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "allot_shared::json_number::optional_whole"
    )]
    #[schema(minimum = 1, maximum = 1_099_511_627_776_u64)]
    pub limit: Option<u64>,
    /// A rate rule's capacity, millitokens.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "allot_shared::json_number::optional_whole"
    )]
    #[schema(minimum = 1, maximum = 1_099_511_627_776_u64)]
    pub capacity_millis: Option<u64>,
    /// A rate rule's refill per period, millitokens.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "allot_shared::json_number::optional_whole"
    )]
    #[schema(minimum = 1, maximum = 1_099_511_627_776_u64)]
    pub refill_millis: Option<u64>,
    /// When it ends, epoch ms (in the future); absent: until it is ended.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "allot_shared::json_number::optional_whole"
    )]
    #[schema(minimum = 0, maximum = 9_007_199_254_740_992_u64)]
    pub expires_at_ms: Option<u64>,
    /// Why (shown in lists and the audit log).
    #[schema(min_length = 1, max_length = 200)]
    pub reason: String,
}

/// `GET /v1/overrides` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OverrideList {
    /// In (tenant, id) order: a tenant's by creation.
    pub overrides: Vec<Override>,
    /// `tenant/id` to ask `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// `GET /v1/overrides` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OverridesQuery {
    /// Only this tenant's.
    #[param(pattern = "^[a-z0-9-]{1,32}$")]
    pub tenant: Option<String>,
    /// Overrides per page (1 to 1,000; default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// The `next` of the page before.
    #[param(
        pattern = "^[a-z0-9-]{1,32}/[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
    )]
    pub after: Option<String>,
}

/// `GET /v1/overrides/current` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CurrentSetQuery {
    /// The set version the caller holds: the answer is empty (204) while it is the latest.
    #[param(minimum = 0, maximum = 9_007_199_254_740_992_u64)]
    pub after: Option<u64>,
}

impl From<OverrideStoreError> for ApiError {
    fn from(error: OverrideStoreError) -> Self {
        match error {
            OverrideStoreError::Invalid(invalid) => Self::invalid(invalid.field, invalid.message),
            OverrideStoreError::UnknownPool => Self::not_found("no such pool"),
            OverrideStoreError::NotFound => Self::not_found("no such override"),
            OverrideStoreError::Conflict(detail) => Self::conflict(detail),
            OverrideStoreError::Contended => Self::conflict(error.to_string()),
            other => Self::unavailable("Store unavailable", other.to_string()),
        }
    }
}

/// `spec` read into an override to create, every field checked; names the field at fault.
///
/// Long by design: an override's fields are checked against one another (a pool or a rule, never
/// both; the amounts each kind allows), and one match over the pair of pool and rule gives each
/// kind its own checks beside the target it builds; split, which fields belong to which kind would
/// be read in several places.
fn new_override(
    spec: OverrideSpec,
    pepper: Option<&Pepper>,
    now_ms: u64,
    created_by: String,
) -> Result<NewOverride, ApiError> {
    let reason = spec.reason.trim().to_owned();
    if reason.is_empty() || reason.chars().count() > MAX_REASON_CHARS {
        return Err(ApiError::invalid(
            "reason",
            "must say why, in 1 to 200 characters",
        ));
    }
    if let Some(end) = spec.expires_at_ms
        && end <= now_ms
    {
        return Err(ApiError::invalid(
            "expiresAtMs",
            format!("must be in the future (now is {now_ms})"),
        ));
    }
    let target = match (spec.pool, spec.rule) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("rule", "give a pool or a rule, not both"));
        }
        (None, None) => return Err(ApiError::invalid("pool", "give a pool or a rule")),
        (Some(pool), None) => {
            let not_for_pools = [
                ("principal", spec.principal.is_some()),
                ("capacityMillis", spec.capacity_millis.is_some()),
                ("refillMillis", spec.refill_millis.is_some()),
            ];
            if let Some((field, _)) = not_for_pools.iter().find(|(_, given)| *given) {
                return Err(ApiError::invalid(
                    *field,
                    "is for rule overrides: a pool override gives only its limit",
                ));
            }
            let limit_tokens = spec
                .limit
                .filter(|l| (1..=allot_shared::MAX_RULE_PARAMETER).contains(l))
                .ok_or_else(|| {
                    ApiError::invalid("limit", "a pool override needs limit in [1, 2^40]")
                })?;
            Target::Pool { pool, limit_tokens }
        }
        (None, Some(rule)) => {
            let amounts = RuleAmounts {
                capacity_millis: spec.capacity_millis,
                refill_millis: spec.refill_millis,
                limit: spec.limit,
            };
            if amounts.is_empty() {
                return Err(ApiError::invalid(
                    "limit",
                    "a rule override needs limit, capacityMillis or refillMillis",
                ));
            }
            let principal = spec
                .principal
                .map(|principal| hashed(principal, pepper))
                .transpose()?;
            Target::Rule {
                rule,
                principal,
                amounts,
            }
        }
    };
    Ok(NewOverride {
        tenant: spec.tenant,
        target,
        expires_at_ms: spec.expires_at_ms,
        reason,
        created_by,
    })
}

/// The principal by its keyed hash: the one given, or its id's under `pepper`.
fn hashed(spec: PrincipalSpec, pepper: Option<&Pepper>) -> Result<OverridePrincipal, ApiError> {
    if !spec.kind.is_authenticated() {
        return Err(ApiError::invalid(
            "principal.type",
            "must be user or api_key: anonymous callers get no overrides",
        ));
    }
    let hash = match (spec.id, spec.hash) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "principal.hash",
                "give the principal's id or its hash, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "principal.id",
                "give the principal's id or its hash",
            ));
        }
        (None, Some(hash)) => hash,
        (Some(id), None) => {
            let pepper = pepper.ok_or_else(|| {
                ApiError::invalid(
                    "principal.id",
                    "this allocator has no --pepper-file to hash it as agents do: give \
                     principal.hash instead (allotctl principal-hash prints it)",
                )
            })?;
            if id.is_empty() || id.chars().count() > allot_shared::contract::MAX_PRINCIPAL_ID_LEN {
                return Err(ApiError::invalid(
                    "principal.id",
                    "must be 1 to 256 characters",
                ));
            }
            // Users and API keys are hashed whole: the prefixes are for addresses only.
            principal_hash(pepper, spec.kind, &id, IpPrefixes::default())
        }
    };
    Ok(OverridePrincipal {
        kind: spec.kind,
        hash,
    })
}

/// The policy bundle every region runs, if one is published.
async fn bundle_in_force(
    state: &ApiState,
) -> Result<Option<allot_shared::policy::PolicyBundle>, ApiError> {
    match crate::policies::current_for(&*state.kv, None).await {
        Ok(bundle) => Ok(Some(bundle)),
        Err(crate::policies::PolicyStoreError::NothingCurrent) => Ok(None),
        Err(other) => Err(other.into()),
    }
}

#[utoipa::path(post, path = "/v1/overrides", tag = "overrides",
    request_body = OverrideSpec,
    responses(
        (status = 201, description = "In force from now", body = Override),
        (status = 404, description = "No such pool", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "An override of the same target is in force, or a bound is reached",
            body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_override(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let spec: OverrideSpec = parse_json(&headers, &body)?;
    let now_ms = state.clock.now_ms();
    let new = new_override(
        spec,
        state.overrides.pepper.as_ref(),
        now_ms,
        credential.actor(),
    )?;
    if matches!(new.target, Target::Rule { .. }) {
        check_rule_target(&new, bundle_in_force(&state).await?.as_ref())?;
    }
    run_change(
        state,
        credential,
        "override.create",
        async move |state, _| {
            let now_ms = state.clock.now_ms();
            let created =
                crate::overrides::create(&*state.kv, new, record_id(now_ms), now_ms).await?;
            tracing::info!(id = %created.id, tenant = %created.tenant, "override in force");
            Ok(Changed {
                response: json_response(StatusCode::CREATED, &created),
                target: format!("{}/{}", created.tenant, created.id),
                version: 0,
                detail: serde_json::to_value(&created).unwrap_or_default(),
            })
        },
    )
    .await
}

#[utoipa::path(get, path = "/v1/overrides", tag = "overrides",
    params(OverridesQuery),
    responses(
        (status = 200, description = "One page of overrides, in force and ended", body = OverrideList),
        crate::http::errors::Refused,
    ))]
pub async fn list_overrides(
    State(state): State<ApiState>,
    query: Result<Query<OverridesQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let Query(query) = query.map_err(|e| ApiError::invalid("query", e.body_text()))?;
    let tenant = query
        .tenant
        .as_deref()
        .map(|t| TenantId::parse(t).map_err(invalid_id("tenant")))
        .transpose()?;
    let limit = query.limit.unwrap_or(DEFAULT_OVERRIDES_PER_PAGE);
    if !(1..=MAX_OVERRIDES_PER_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit", "must be in [1, 1000]"));
    }
    let after = query.after.as_deref().map(cursor).transpose()?;
    let (overrides, next) =
        crate::overrides::list(&*state.kv, tenant.as_ref(), after.as_deref(), limit).await?;
    Ok(json_response(
        StatusCode::OK,
        &OverrideList { overrides, next },
    ))
}

/// A page cursor: `tenant/id`, as `next` gives it.
fn cursor(text: &str) -> Result<String, ApiError> {
    let refused = || ApiError::invalid("after", "must be tenant/id, as `next` gives it");
    let (tenant, id) = text.split_once('/').ok_or_else(refused)?;
    let tenant = TenantId::parse(tenant).map_err(|_| refused())?;
    let id = RecordId::parse(id).map_err(|_| refused())?;
    Ok(format!("{tenant}/{id}"))
}

fn override_path(tenant: &str, id: &str) -> Result<(TenantId, RecordId), ApiError> {
    Ok((
        TenantId::parse(tenant).map_err(invalid_id("tenant"))?,
        RecordId::parse(id).map_err(invalid_id("id"))?,
    ))
}

#[utoipa::path(get, path = "/v1/overrides/{tenant}/{id}", tag = "overrides",
    params(("tenant" = TenantId, Path, description = "The tenant"),
        ("id" = RecordId, Path, description = "The override")),
    responses(
        (status = 200, description = "The override", body = Override),
        (status = 404, description = "No such override", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_override(
    State(state): State<ApiState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let (tenant, id) = override_path(&tenant, &id)?;
    let found = crate::overrides::get(&*state.kv, &tenant, &id)
        .await?
        .ok_or_else(|| ApiError::not_found("no such override"))?;
    Ok(json_response(StatusCode::OK, &found))
}

#[utoipa::path(delete, path = "/v1/overrides/{tenant}/{id}", tag = "overrides",
    params(("tenant" = TenantId, Path, description = "The tenant"),
        ("id" = RecordId, Path, description = "The override")),
    responses(
        (status = 200, description = "Ended now (or earlier); it stays listed, ended", body = Override),
        (status = 404, description = "No such override", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn end_override(
    State(state): State<ApiState>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let (tenant, id) = override_path(&tenant, &id)?;
    run_change(state, credential, "override.end", async move |state, _| {
        let now_ms = state.clock.now_ms();
        let ended = crate::overrides::end(&*state.kv, &tenant, &id, now_ms).await?;
        tracing::info!(%id, %tenant, "override ended");
        Ok(Changed {
            response: json_response(StatusCode::OK, &ended),
            target: format!("{tenant}/{id}"),
            version: 0,
            detail: serde_json::json!({ "expiresAtMs": ended.expires_at_ms }),
        })
    })
    .await
}

#[utoipa::path(get, path = "/v1/overrides/current", tag = "overrides",
    params(CurrentSetQuery),
    responses(
        (status = 200, description = "Every stored rule override, at the store's version and checksummed",
            body = OverrideSet),
        (status = 204, description = "The caller holds the latest version"),
        crate::http::errors::Refused,
    ))]
pub async fn current_overrides(
    State(state): State<ApiState>,
    query: Result<Query<CurrentSetQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Reader)?;
    let Query(query) = query.map_err(|e| ApiError::invalid("after", e.body_text()))?;
    if query
        .after
        .is_some_and(|after| after > allot_shared::json_number::MAX_WHOLE)
    {
        return Err(ApiError::invalid("after", "must be at most 2^53"));
    }
    let set = state.overrides.cache.current(&*state.kv).await?;
    if query.after == Some(set.version) {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(json_response(StatusCode::OK, set.as_ref()))
}
