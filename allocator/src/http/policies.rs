//! Policy bundles: publish (with an optional canary), read, promote, roll back, and what every agent
//! runs.

use crate::policies::Rollout;
use allot_shared::contract::Problem;
use allot_shared::ids::RegionId;
use allot_shared::policy::{PolicyBundle, parse_bundle};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::changes::{Changed, run_change, unrecorded};
use super::errors::{ApiError, invalid_id};
use super::io::{json_response, parse_json};
use crate::auth::OperatorRole;
use crate::policies::{self, AgentStatus, PolicyStoreError};

/// `PUT /v1/policies` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PublishQuery {
    /// Comma-separated regions to stage the bundle to before everyone.
    #[param(pattern = "^[a-z0-9-]{1,32}(,[a-z0-9-]{1,32})*$")]
    pub canary: Option<String>,
}

/// `GET /v1/policies/current` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CurrentQuery {
    /// The asking region: a canary region gets the staged bundle.
    #[param(pattern = "^[a-z0-9-]{1,32}$")]
    pub region: Option<String>,
}

/// `GET /v1/policies/status` answer: the rollout and what every live agent runs.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// What regions should run.
    pub rollout: policies::Rollout,
    /// Agents that reported recently.
    pub agents: Vec<AgentStatus>,
    /// Lowest version an agent runs.
    pub min_version: Option<u64>,
    /// Highest version an agent runs.
    pub max_version: Option<u64>,
    /// Agents running something else than what their region should run.
    pub agents_behind: usize,
    /// The pepper fingerprints live agents report, by region: more than one in a region means its
    /// agents key principals differently (each principal's buckets split), expected only while a
    /// pepper rotation rolls out.
    pub pepper_fingerprints:
        std::collections::BTreeMap<RegionId, std::collections::BTreeSet<String>>,
}

/// A bundle version from a path: 1 to 2^53, as the document states (versions count up from 1, and
/// every JSON reader holds 2^53 exactly).
fn parse_version(text: &str) -> Result<u64, ApiError> {
    text.parse::<u64>()
        .ok()
        .filter(|v| (1..=allot_shared::json_number::MAX_WHOLE).contains(v))
        .ok_or_else(|| ApiError::invalid("version", "must be an integer from 1 to 2^53"))
}

fn bundle_response(bundle: &PolicyBundle) -> Response {
    let mut response = json_response(StatusCode::OK, &bundle.to_json());
    if let Ok(etag) = HeaderValue::from_str(&format!("\"{}\"", bundle.checksum())) {
        response.headers_mut().insert(header::ETAG, etag);
    }
    response
}

#[utoipa::path(put, path = "/v1/policies", tag = "policies",
    params(PublishQuery),
    request_body(content = Object, description = "A policy bundle (docs/limiter.md): its rules; version and checksum are computed"),
    responses(
        (status = 201, description = "The bundle as published", body = Object),
        (status = 409, description = "Conflicts with the bundle in force", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn put_policy(
    State(state): State<ApiState>,
    query: Result<Query<PublishQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let Query(query) = query.map_err(|e| ApiError::invalid("canary", e.body_text()))?;
    let canary = query
        .canary
        .map(|list| {
            list.split(',')
                .map(|r| RegionId::parse(r.trim()).map_err(invalid_id("canary")))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::invalid("body", "not UTF-8"))?;
    let draft = parse_bundle(text).map_err(PolicyStoreError::from)?;
    run_change(
        state,
        credential,
        "policy.publish",
        async move |state, credential| {
            let now_ms = state.clock.now_ms();
            let published_at = allot_shared::window::rfc3339_utc(now_ms);
            let bundle = policies::publish(&*state.kv, draft, published_at, canary).await?;
            let target = bundle.version().to_string();
            state
                .ledger
                .record_bundle(&bundle, &credential.actor(), now_ms)
                .await
                .map_err(|e| unrecorded("bundle record", "policy.publish", &target, e))?;
            tracing::info!(
                version = bundle.version(),
                checksum = bundle.checksum(),
                "policy published"
            );
            Ok(Changed {
                response: bundle_response(&bundle),
                target,
                version: bundle.version(),
                detail: serde_json::json!({ "checksum": bundle.checksum() }),
            })
        },
    )
    .await
}

#[utoipa::path(get, path = "/v1/policies/current", tag = "policies",
    params(CurrentQuery),
    responses(
        (status = 200, description = "The bundle a region should run", body = Object, headers(("etag" = String))),
        (status = 404, description = "Nothing published yet", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_current_policy(
    State(state): State<ApiState>,
    query: Result<Query<CurrentQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Reader)?;
    let Query(query) = query.map_err(|e| ApiError::invalid("region", e.body_text()))?;
    let region = query
        .region
        .map(|r| RegionId::parse(&r).map_err(invalid_id("region")))
        .transpose()?;
    if let Some(region) = &region {
        check_region(&credential, region)?;
    }
    let bundle = policies::current_for(&*state.kv, region.as_ref()).await?;
    Ok(bundle_response(&bundle))
}

#[utoipa::path(get, path = "/v1/policies/{version}", tag = "policies",
    params(("version" = u64, Path, minimum = 1, maximum = 9_007_199_254_740_992_u64, description = "A bundle version")),
    responses(
        (status = 200, description = "That bundle", body = Object, headers(("etag" = String))),
        (status = 404, description = "No such version", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_policy_version(
    State(state): State<ApiState>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Reader)?;
    let version = parse_version(&version)?;
    let bundle = policies::get_bundle(&*state.kv, version).await?;
    Ok(bundle_response(&bundle))
}

#[utoipa::path(post, path = "/v1/policies/{version}/promote", tag = "policies",
    params(("version" = u64, Path, minimum = 1, maximum = 9_007_199_254_740_992_u64, description = "A bundle version")),
    responses(
        (status = 200, description = "The rollout: the canary bundle everywhere", body = Rollout),
        (status = 404, description = "No such version", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Not the canary bundle", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn promote_policy(
    State(state): State<ApiState>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let version = parse_version(&version)?;
    run_change(
        state,
        credential,
        "policy.promote",
        async move |state, _| {
            let rollout = policies::promote(&*state.kv, version).await?;
            tracing::info!(version, "policy promoted");
            Ok(Changed {
                response: json_response(StatusCode::OK, &rollout),
                target: version.to_string(),
                version,
                detail: serde_json::json!({}),
            })
        },
    )
    .await
}

/// `POST /v1/policies/{version}/rollback`: publishes `version`'s content as the next version,
/// current everywhere at once. Answers 201 with the new bundle (its location in `Location`).
#[utoipa::path(post, path = "/v1/policies/{version}/rollback", tag = "policies",
    params(("version" = u64, Path, minimum = 1, maximum = 9_007_199_254_740_992_u64, description = "A bundle version")),
    responses(
        (status = 201, description = "The old bundle published again as a new version", body = Object),
        (status = 404, description = "No such version", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Conflicts with the bundle in force", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn rollback_policy(
    State(state): State<ApiState>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let version = parse_version(&version)?;
    run_change(
        state,
        credential,
        "policy.rollback",
        async move |state, credential| {
            let now_ms = state.clock.now_ms();
            let published_at = allot_shared::window::rfc3339_utc(now_ms);
            let bundle = policies::rollback(&*state.kv, version, published_at).await?;
            let target = bundle.version().to_string();
            state
                .ledger
                .record_bundle(&bundle, &credential.actor(), now_ms)
                .await
                .map_err(|e| unrecorded("bundle record", "policy.rollback", &target, e))?;
            tracing::info!(
                version = bundle.version(),
                content_of = version,
                checksum = bundle.checksum(),
                "policy rolled back"
            );
            Ok(Changed {
                response: created_bundle_response(&bundle),
                target,
                version: bundle.version(),
                detail: serde_json::json!({ "checksum": bundle.checksum(), "contentOf": version }),
            })
        },
    )
    .await
}

/// A bundle just created at its own version's path: 201, with `Location`.
fn created_bundle_response(bundle: &PolicyBundle) -> Response {
    let mut response = bundle_response(bundle);
    *response.status_mut() = StatusCode::CREATED;
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/policies/{}", bundle.version())) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

#[utoipa::path(post, path = "/v1/policies/status", tag = "agents",
    request_body = AgentStatus,
    responses(
        (status = 204, description = "Recorded"),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_agent_status(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let mut status: AgentStatus = parse_json(&headers, &body)?;
    check_region(&credential, &status.region)?;
    if let Some(fingerprint) = &status.pepper_fingerprint
        && !(fingerprint.len() == 8
            && fingerprint
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    {
        return Err(ApiError::invalid(
            "pepperFingerprint",
            "must be 8 lowercase hex digits",
        ));
    }
    status.reported_at_ms = state.clock.now_ms();
    policies::report_agent(
        &*state.kv,
        &status,
        &state.status_leases,
        status.reported_at_ms,
    )
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(get, path = "/v1/policies/status", tag = "policies",
    responses(
        (status = 200, description = "The rollout and what every live agent runs", body = PolicyStatus),
        crate::http::errors::Refused,
    ))]
pub async fn get_policy_status(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let rollout = policies::rollout(&*state.kv).await?;
    let agents = policies::agent_statuses(&*state.kv, state.clock.now_ms()).await?;
    let agents_behind = agents
        .iter()
        .filter(|a| a.version != rollout.version_for(Some(&a.region)))
        .count();
    let status = PolicyStatus {
        pepper_fingerprints: policies::pepper_fingerprints(&agents),
        min_version: agents.iter().map(|a| a.version).min(),
        max_version: agents.iter().map(|a| a.version).max(),
        agents_behind,
        rollout,
        agents,
    };
    Ok(json_response(StatusCode::OK, &status))
}
