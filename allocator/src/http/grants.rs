//! Agents: grants (`POST /v1/grants`) and reports (`POST /v1/reports`), for their own region only.

use allot_shared::contract::Problem;
use allot_shared::ids::LeaseId;
use allot_shared::lease::GrantRequest;
use allot_shared::wire::{GrantAnswer, ReportReceipt};
use allot_shared::wire::{GrantBody, Report};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};
use crate::pools;

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

#[utoipa::path(post, path = "/v1/reports", tag = "agents",
    request_body = Report,
    responses(
        (status = 200, description = "The report, recorded once", body = ReportReceipt),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_report(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let report: Report = parse_json(&headers, &body)?;
    check_region(&credential, &report.region)?;
    // Grants reach the ledger asynchronously and a report may overtake them. etcd is the authority:
    // copy what the ledger lacks from there before checking the report against it.
    let ids: Vec<LeaseId> = report.leases.iter().map(|l| l.lease_id).collect();
    let missing = state.ledger.missing_grants(&ids).await?;
    let mut found = Vec::new();
    for lease in missing {
        if let Some(record) =
            pools::get_grant(&*state.kv, &report.tenant, &report.pool, &lease).await?
        {
            found.push(record);
        }
    }
    if !found.is_empty() {
        state
            .ledger
            .record_grants(&report.tenant, &report.pool, &found)
            .await?;
    }
    let receipt = state
        .ledger
        .record_report(&report, state.clock.now_ms())
        .await?;
    Ok(json_response(StatusCode::OK, &receipt))
}
