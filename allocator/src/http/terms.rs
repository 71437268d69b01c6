//! Agents: the terms of many pools in one call (`POST /v1/terms/batch`), each answered as
//! `GET /v1/pools/{tenant}/{pool}/terms` answers it. An agent that starts cold, or meets many
//! new pools at once, asks for them a batch at a time instead of one call per pool.

use allot_shared::ids::{PoolId, TenantId};
use allot_shared::wire::{MAX_TERMS_PER_BATCH, TermsBatch, TermsBatchAnswer, TermsResult};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};
use super::pools::terms_of_stored;
use crate::pools;

#[utoipa::path(post, path = "/v1/terms/batch", tag = "agents",
    request_body = TermsBatch,
    responses(
        (status = 200, description = "One result per pool, in order: its terms, or the problem \
            `GET /v1/pools/{tenant}/{pool}/terms` would have answered (its field prefixed \
            `pools[i].`)", body = TermsBatchAnswer),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_terms_batch(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Reader)?;
    let batch: TermsBatch = parse_json(&headers, &body)?;
    if batch.pools.len() > MAX_TERMS_PER_BATCH {
        return Err(ApiError::invalid(
            "pools",
            format!("at most {MAX_TERMS_PER_BATCH} pools per call"),
        ));
    }
    if let Some(region) = &batch.region {
        check_region(&credential, region)?;
    }
    if batch.agent_id.is_some() && batch.region.is_none() {
        return Err(ApiError::invalid(
            "agentId",
            "names an agent of a region: send region with it",
        ));
    }
    // The pools' records in a round trip per 128, then each pool's fallback count in the ledger.
    let keys: Vec<(TenantId, PoolId)> = batch
        .pools
        .iter()
        .map(|ask| (ask.tenant.clone(), ask.pool.clone()))
        .collect();
    let stored = pools::get_pools(&*state.kv, &keys).await?;
    let answered =
        futures::future::join_all(batch.pools.iter().zip(stored).map(|(ask, stored)| async {
            let stored = stored?.ok_or_else(|| ApiError::not_found("no such pool"))?;
            terms_of_stored(
                &state,
                &ask.tenant,
                &ask.pool,
                &stored,
                batch.region.as_ref(),
                batch.agent_id.as_ref(),
            )
            .await
        }))
        .await;
    let results = answered
        .into_iter()
        .enumerate()
        .map(|(index, answer)| match answer {
            Ok(terms) => TermsResult {
                terms: Some(terms),
                problem: None,
            },
            Err(refused) => TermsResult {
                terms: None,
                problem: Some(refused.into_entry_problem("pools", index)),
            },
        })
        .collect();
    Ok(json_response(StatusCode::OK, &TermsBatchAnswer { results }))
}
