//! Operations: the audit log, metrics, health and readiness, and what no route matches.

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
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// How many of the latest entries (default 50, at most 1,000).
    pub last: Option<u64>,
}

/// `GET /v1/audit` answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct AuditList {
    /// Newest first.
    pub entries: Vec<AuditEntry>,
}

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

pub async fn healthz() -> &'static str {
    "ok\n"
}

pub async fn readyz(State(state): State<ApiState>) -> Response {
    let role = state.role.borrow().clone();
    match role {
        Role::Leader(leadership) => (
            StatusCode::OK,
            format!("leader, epoch {}\n", leadership.epoch),
        )
            .into_response(),
        Role::Follower(Some(leader)) => (
            StatusCode::OK,
            format!(
                "follower of {} (epoch {})\n",
                leader.advertise_url, leader.epoch
            ),
        )
            .into_response(),
        Role::Follower(None) | Role::Unknown => {
            (StatusCode::SERVICE_UNAVAILABLE, "no known leader\n").into_response()
        }
    }
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint")
}
