//! Shards: how the pools are split and who leads each shard (`GET /v1/shards`). Agents read it to
//! send each pool's grants and reports to its shard's leader; operators, to see who leads what.

use allot_shared::wire::{ShardLead, ShardLeader, ShardMap};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize};
use super::errors::ApiError;
use super::io::json_response;
use crate::leader::read_leaders;

#[utoipa::path(get, path = "/v1/shards", tag = "agents",
    responses(
        (status = 200, description = "The shard count and every shard's leader, as the store \
            holds them now (a shard without one is being taken over)", body = ShardMap),
        crate::http::errors::Refused,
    ))]
pub async fn get_shards(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Reader)?;
    let count = state.role.borrow().count();
    // Read from the store, not this node's last round: any node answers alike, and at once
    // after a failover.
    let leaders = read_leaders(&*state.kv, count)
        .await
        .map_err(crate::pools::PoolStoreError::Store)?;
    let shards = count
        .shards()
        .zip(leaders)
        .map(|(shard, leader)| ShardLead {
            shard,
            leader: leader.map(|(record, _)| ShardLeader {
                node_id: record.node_id,
                url: record.advertise_url,
                epoch: record.epoch,
            }),
        })
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &ShardMap {
            shard_count: count.get(),
            shards,
        },
    ))
}
