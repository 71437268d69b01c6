//! Agent sessions: an agent says when one of its runs starts (and learns how the run before it
//! ended) and when it ends cleanly, with every fallback admit reported. See
//! [`crate::ledger::agent_sessions`].

use allot_shared::wire::AgentSessionStarted;
use allot_shared::wire::{AgentSession, AgentSessionEnded};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};

/// `POST /v1/agent-sessions`: a run starts; answers `AgentSessionStarted`.
#[utoipa::path(post, path = "/v1/agent-sessions", tag = "agents",
    request_body = AgentSession,
    responses(
        (status = 200, description = "The run recorded", body = AgentSessionStarted),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_session_start(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let session = agent_session(&state, &headers, &body)?;
    let now_ms = state.clock.now_ms();
    let started = state.ledger.start_agent_session(&session, now_ms).await?;
    // A retried start is answered as first recorded, with its own start time: counted once.
    let first_call = started.started_at_ms == now_ms;
    if first_call && !started.predecessor_ended_cleanly {
        tracing::info!(region = %session.region, agent = %session.agent_id,
            "an agent's previous run did not end cleanly: its fallback allowance of this window \
             counts as used");
        metrics::counter!(crate::metrics::AGENT_UNCLEAN_RESTARTS,
            "region" => session.region.to_string())
        .increment(1);
    }
    Ok(json_response(StatusCode::OK, &started))
}

/// `POST /v1/agent-sessions/end`: a run ends with every fallback admit reported; answers
/// `AgentSessionEnded`.
#[utoipa::path(post, path = "/v1/agent-sessions/end", tag = "agents",
    request_body = AgentSession,
    responses(
        (status = 200, description = "The run's end recorded", body = AgentSessionEnded),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_session_end(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let session = agent_session(&state, &headers, &body)?;
    let ended = state
        .ledger
        .end_agent_session(&session, state.clock.now_ms())
        .await?;
    Ok(json_response(StatusCode::OK, &AgentSessionEnded { ended }))
}

/// The session a request's body names, from an agent of its region.
fn agent_session(
    state: &ApiState,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<AgentSession, ApiError> {
    let credential = authorize(state, headers, Needs::Agent)?;
    let session: AgentSession = parse_json(headers, body)?;
    check_region(&credential, &session.region)?;
    Ok(session)
}
