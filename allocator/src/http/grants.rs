//! Agents: grants, for their own region only: one at a time (`POST /v1/grants`) or a renewal
//! round of several pools in one call (`POST /v1/grants/batch`), each idempotent by lease id.

use allot_shared::contract::Problem;
use allot_shared::lease::GrantRequest;
use allot_shared::wire::{
    GrantAnswer, GrantBatch, GrantBatchAnswer, GrantBody, GrantResult, MAX_GRANTS_PER_BATCH,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};
use crate::auth::Credential;
use crate::grants::GrantFailure;

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
    let answer = decide(&state, &credential, body).await?;
    Ok(json_response(StatusCode::OK, &answer))
}

#[utoipa::path(post, path = "/v1/grants/batch", tag = "agents",
    request_body = GrantBatch,
    responses(
        (status = 200, description = "One result per ask, in order: its grant (idempotent by lease \
            id), or the problem `POST /v1/grants` would have answered (its field prefixed \
            `grants[i].`)", body = GrantBatchAnswer),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_grant_batch(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let batch: GrantBatch = parse_json(&headers, &body)?;
    check_bounds(&batch)?;
    // Every ask goes to its own pool's worker at once: the workers' commits that wait together
    // are merged into shared transactions, so a round of many pools costs a few round trips.
    let decided = futures::future::join_all(
        batch
            .grants
            .into_iter()
            .map(|ask| decide(&state, &credential, ask)),
    )
    .await;
    // With one shard a follower decides nothing: the whole call goes to the leader, where each
    // ask is answered (again, for any decided here before a failover: grants are idempotent by
    // lease id). With several, the asks this node does not lead are refused one by one, each
    // naming its shard's leader, and the rest stand.
    let not_split = state.role.borrow().count().get() == 1;
    if let (true, Some(not_leader)) = (
        not_split,
        decided.iter().find_map(|result| match result {
            Err(Decided::Failed(failure @ GrantFailure::NotLeader(_))) => Some(failure.clone()),
            _ => None,
        }),
    ) {
        return Err(not_leader.into());
    }
    let results = decided
        .into_iter()
        .enumerate()
        .map(|(index, result)| match result {
            Ok(grant) => GrantResult {
                grant: Some(grant),
                problem: None,
            },
            Err(refused) => GrantResult {
                grant: None,
                problem: Some(ApiError::from(refused).into_entry_problem("grants", index)),
            },
        })
        .collect();
    Ok(json_response(StatusCode::OK, &GrantBatchAnswer { results }))
}

/// A batch's bounds, and each ask's fields as the schema states them: a call that breaks the
/// schema is refused whole, naming the field.
fn check_bounds(batch: &GrantBatch) -> Result<(), ApiError> {
    if let Some(index) = batch.grants.iter().position(|ask| ask.want_tokens == 0) {
        return Err(ApiError::invalid(
            format!("grants[{index}].want"),
            "must be at least 1",
        ));
    }
    if batch.grants.len() > MAX_GRANTS_PER_BATCH {
        return Err(ApiError::invalid(
            "grants",
            format!("at most {MAX_GRANTS_PER_BATCH} grants per call"),
        ));
    }
    Ok(())
}

/// Why one ask got no grant: refused before it reached its pool, or failed there.
enum Decided {
    Refused(ApiError),
    Failed(GrantFailure),
}

impl From<Decided> for ApiError {
    fn from(decided: Decided) -> Self {
        match decided {
            Decided::Refused(refused) => refused,
            Decided::Failed(failure) => failure.into(),
        }
    }
}

/// One ask, checked (the caller's region, at least one token) and decided by its pool's worker.
async fn decide(
    state: &ApiState,
    credential: &Credential,
    body: GrantBody,
) -> Result<GrantAnswer, Decided> {
    check_region(credential, &body.region).map_err(Decided::Refused)?;
    if body.want_tokens == 0 {
        return Err(Decided::Refused(ApiError::invalid(
            "want",
            "must be at least 1",
        )));
    }
    let request = GrantRequest {
        lease_id: body.lease_id,
        region: body.region,
        want_tokens: body.want_tokens,
    };
    state
        .grantor
        .grant(&body.tenant, &body.pool, request)
        .await
        .map_err(Decided::Failed)
}
