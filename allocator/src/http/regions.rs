//! Regions: for each region pools are configured in or reports came from, when it last reported to
//! the ledger and whether it admits in fallback now (cut off from the allocator).

use std::collections::BTreeMap;

use allot_shared::ids::RegionId;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::errors::ApiError;
use super::io::json_response;
use crate::auth::OperatorRole;
use crate::pools;

/// How far back the latest report of a region is looked for.
pub const REPORT_LOOKBACK_MS: u64 = 15 * 60 * 1_000;

/// One region as `GET /v1/regions` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegionView {
    /// The region.
    pub region: RegionId,
    /// Pools configured with this region.
    pub pools: u64,
    /// When the ledger last received a report from the region (within the last 15 minutes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_report_at_ms: Option<u64>,
    /// Pools whose current window has fallback admits from this region: it is (or was, earlier in
    /// the window) cut off from the allocator.
    pub pools_in_fallback: u64,
    /// Tokens this region admitted in fallback in those windows.
    #[serde(rename = "fallbackAdmitted")]
    pub fallback_admitted_tokens: u64,
}

/// `GET /v1/regions` answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RegionList {
    /// By region id.
    pub regions: Vec<RegionView>,
}

/// What is gathered of a region before it is answered.
#[derive(Default)]
struct Seen {
    pools: u64,
    last_report_at_ms: Option<u64>,
    pools_in_fallback: u64,
    fallback_admitted_tokens: u64,
}

#[utoipa::path(get, path = "/v1/regions", tag = "pools",
    responses(
        (status = 200, description = "Every region pools name", body = RegionList),
        crate::http::errors::Refused,
    ))]
pub async fn list_regions(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let now_ms = state.clock.now_ms();
    let mut regions: BTreeMap<RegionId, Seen> = BTreeMap::new();
    let mut current_windows = BTreeMap::new();
    for (tenant, pool, stored) in pools::list_pools(&*state.kv).await? {
        let Ok(config) = stored.spec.validate() else {
            continue;
        };
        for region in &stored.spec.regions {
            regions.entry(region.clone()).or_default().pools += 1;
        }
        current_windows.insert((tenant, pool), config.window_at(now_ms).start_ms);
    }
    let oldest_current = current_windows.values().copied().min().unwrap_or(now_ms);
    for row in state.ledger.recent_fallback(oldest_current).await? {
        let current = current_windows.get(&(row.tenant.clone(), row.pool.clone()));
        if current != Some(&row.window_start_ms) {
            continue;
        }
        let view = regions.entry(row.region.clone()).or_default();
        view.pools_in_fallback += 1;
        view.fallback_admitted_tokens = view
            .fallback_admitted_tokens
            .saturating_add(row.admitted_tokens);
    }
    let since_ms = now_ms.saturating_sub(REPORT_LOOKBACK_MS);
    for (region, at_ms) in state.ledger.last_reports(since_ms).await? {
        regions.entry(region).or_default().last_report_at_ms = Some(at_ms);
    }
    let regions = regions
        .into_iter()
        .map(|(region, seen)| RegionView {
            region,
            pools: seen.pools,
            last_report_at_ms: seen.last_report_at_ms,
            pools_in_fallback: seen.pools_in_fallback,
            fallback_admitted_tokens: seen.fallback_admitted_tokens,
        })
        .collect();
    Ok(json_response(StatusCode::OK, &RegionList { regions }))
}
