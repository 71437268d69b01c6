//! Operations: the audit log, metrics, health and readiness, and what no route matches.

use crate::ledger::BoundCheckSummary;
use allot_shared::contract::Problem;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::errors::ApiError;
use super::io::json_response;
use crate::auth::OperatorRole;
use crate::leader::Role;
use crate::ledger::AuditEntry;

/// `GET /v1/audit` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// How many of the latest entries (default 50, at most 1,000).
    #[param(minimum = 1, maximum = 1000)]
    pub last: Option<u64>,
}

/// `GET /v1/audit` answer.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditList {
    /// Newest first.
    pub entries: Vec<AuditEntry>,
}

#[utoipa::path(get, path = "/v1/audit", tag = "operations",
    params(AuditQuery),
    responses(
        (status = 200, description = "The latest changes, newest first", body = AuditList),
        crate::http::errors::Refused,
    ))]
pub async fn get_audit(
    State(state): State<ApiState>,
    query: Result<Query<AuditQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let Query(query) = query.map_err(|e| ApiError::invalid("last", e.body_text()))?;
    let last = query.last.unwrap_or(50);
    if !(1..=crate::ledger::MAX_AUDIT_ENTRIES).contains(&last) {
        return Err(ApiError::invalid("last", "must be in [1, 1000]"));
    }
    let entries = state.ledger.audit_entries(last).await?;
    Ok(json_response(StatusCode::OK, &AuditList { entries }))
}

/// `GET /v1/bound-checks?recent=N`: every window checked against its overshoot bound so far, the
/// violations, and the newest `N` of them (default 20, at most 100).
#[utoipa::path(get, path = "/v1/bound-checks", tag = "operations",
    params(BoundChecksQuery),
    responses(
        (status = 200, description = "Windows checked against their bound", body = BoundCheckSummary),
        crate::http::errors::Refused,
    ))]
pub async fn get_bound_checks(
    State(state): State<ApiState>,
    query: Result<Query<BoundChecksQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let Query(query) = query.map_err(|e| ApiError::invalid("recent", e.body_text()))?;
    let recent = query.recent.unwrap_or(20);
    if recent > crate::ledger::MAX_RECENT_VIOLATIONS {
        return Err(ApiError::invalid(
            "recent",
            format!("must be in [0, {}]", crate::ledger::MAX_RECENT_VIOLATIONS),
        ));
    }
    let summary = state.ledger.bound_check_summary(recent).await?;
    Ok(json_response(StatusCode::OK, &summary))
}

/// The query of `GET /v1/bound-checks`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct BoundChecksQuery {
    /// How many of the newest violations to list.
    #[param(minimum = 0, maximum = 100)]
    pub recent: Option<u64>,
}

#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses(
        (status = 200, description = "The Prometheus text format", body = String, content_type = "text/plain"),
        (status = 503, description = "No metrics registry", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn metrics_text() -> Response {
    match crate::metrics::handle() {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => ApiError::unavailable(
            "Metrics unavailable",
            "another metrics recorder is installed in this process",
        )
        .into_response(),
    }
}

#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Alive", body = String, content_type = "text/plain"),
    ))]
pub async fn healthz() -> &'static str {
    "ok\n"
}

#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready: every shard's leader is this node or known to it", body = String, content_type = "text/plain"),
        (status = 503, description = "A shard without a known leader", body = String, content_type = "text/plain"),
    ))]
pub async fn readyz(State(state): State<ApiState>) -> Response {
    let roles = state.role.borrow().clone();
    let unled = roles
        .all()
        .iter()
        .position(|role| matches!(role, Role::Follower(None) | Role::Unknown));
    if let Some(shard) = unled {
        let text = if roles.all().len() == 1 {
            "no known leader\n".to_owned()
        } else {
            format!("no known leader of shard {shard}\n")
        };
        return (StatusCode::SERVICE_UNAVAILABLE, text).into_response();
    }
    let text = match roles.all() {
        [Role::Leader(leadership)] => format!("leader, epoch {}\n", leadership.epoch),
        [Role::Follower(Some(leader))] => format!(
            "follower of {} (epoch {})\n",
            leader.advertise_url, leader.epoch
        ),
        shards => format!(
            "leads {} of {} shards; every shard's leader known\n",
            roles.leading().count(),
            shards.len()
        ),
    };
    (StatusCode::OK, text).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint")
}
