//! Agents: grants (`POST /v1/grants`), for their own region only.

use allot_shared::contract::Problem;
use allot_shared::lease::GrantRequest;
use allot_shared::wire::{GrantAnswer, GrantBody};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};

#[utoipa::path(post, path = "/v1/grants", tag = "agents",
    request_body = GrantBody,
    responses(
        (status = 200, description = "The grant (idempotent by lease id)", body = GrantAnswer),
        (status = 404, description = "No such pool", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_grant(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let body: GrantBody = parse_json(&headers, &body)?;
    check_region(&credential, &body.region)?;
    if body.want_tokens == 0 {
        return Err(ApiError::invalid("want", "must be at least 1"));
    }
    let request = GrantRequest {
        lease_id: body.lease_id,
        region: body.region,
        want_tokens: body.want_tokens,
    };
    let answer = state
        .grantor
        .grant(&body.tenant, &body.pool, request)
        .await?;
    Ok(json_response(StatusCode::OK, &answer))
}
