//! Regions: for each region pools are configured in or reports came from, when it last reported to
//! the ledger and whether it admits in fallback now (cut off from the allocator).

use std::collections::{BTreeMap, HashMap};

use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::window::WindowSpec;
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
/// How long a listing of every pool serves `GET /v1/regions`, ms: the page costs one listing of
/// every pool a half minute at most, however often it is read, and its pool counts are that old
/// at most.
pub const POOL_LISTING_REUSED_MS: u64 = 30_000;

/// What `GET /v1/regions` needs of every pool, from one listing: how many pools name each region,
/// and how each pool's windows are cut (to tell a fallback row of its current window).
#[derive(Default)]
pub struct PoolListing {
    listed: tokio::sync::Mutex<Option<Listed>>,
}

struct Listed {
    at_ms: u64,
    pools_by_region: BTreeMap<RegionId, u64>,
    windows: HashMap<(TenantId, PoolId), WindowSpec>,
    longest_window_ms: u64,
}

impl PoolListing {
    /// The listing, read again when it is older than [`POOL_LISTING_REUSED_MS`] (one reader at a
    /// time; the others wait for it and share it).
    async fn fresh(
        &self,
        kv: &dyn crate::kv::Kv,
        now_ms: u64,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Listed>>, ApiError> {
        let mut listed = self.listed.lock().await;
        let stale = listed.as_ref().is_none_or(|l| {
            now_ms.saturating_sub(l.at_ms) >= POOL_LISTING_REUSED_MS || now_ms < l.at_ms
        });
        if stale {
            let mut fresh = Listed {
                at_ms: now_ms,
                pools_by_region: BTreeMap::new(),
                windows: HashMap::new(),
                longest_window_ms: 0,
            };
            for (tenant, pool, stored) in pools::list_pools(kv).await? {
                let Ok(config) = stored.spec.validate() else {
                    continue;
                };
                for region in &stored.spec.regions {
                    *fresh.pools_by_region.entry(region.clone()).or_default() += 1;
                }
                fresh.longest_window_ms = fresh.longest_window_ms.max(config.window().longest_ms());
                fresh
                    .windows
                    .insert((tenant, pool), config.window().clone());
            }
            *listed = Some(fresh);
        }
        Ok(listed)
    }
}

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
    let guard = state.pool_listing.fresh(&*state.kv, now_ms).await?;
    let Some(listed) = guard.as_ref() else {
        return Err(ApiError::internal("Internal error", "no pool listing"));
    };
    for (region, pools) in &listed.pools_by_region {
        regions.entry(region.clone()).or_default().pools = *pools;
    }
    // No current window started before the longest window ago.
    let oldest_current = now_ms.saturating_sub(listed.longest_window_ms);
    for row in state.ledger.recent_fallback(oldest_current).await? {
        let current = listed
            .windows
            .get(&(row.tenant.clone(), row.pool.clone()))
            .map(|window| window.containing(now_ms).start_ms);
        if current != Some(row.window_start_ms) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use allot_shared::clock::ManualClock;

    use super::*;
    use crate::kv::memory::MemoryKv;
    use crate::pools::{PoolSpec, put_pool};

    async fn add_pool(kv: &MemoryKv, pool: &str) {
        let spec: PoolSpec = serde_json::from_value(serde_json::json!({
            "limit": 10, "windowMs": 60000, "chunk": 1, "leaseTtlMs": 1000,
            "fallbackPerRegion": 0, "regions": ["eu", "us"] }))
        .expect("spec");
        let tenant = TenantId::parse("acme").expect("tenant");
        put_pool(kv, &tenant, &PoolId::parse(pool).expect("pool"), spec, 0)
            .await
            .expect("pool");
    }

    #[tokio::test]
    async fn one_listing_serves_the_regions_page_for_half_a_minute() {
        let kv = MemoryKv::new(Arc::new(ManualClock::new(0)));
        add_pool(&kv, "a").await;
        let listing = PoolListing::default();
        let counts = |listing: &Option<Listed>| {
            listing
                .as_ref()
                .map(|l| l.pools_by_region.values().copied().collect::<Vec<u64>>())
        };
        let at = 1_000_000;
        assert_eq!(
            counts(&listing.fresh(&kv, at).await.expect("listed")),
            Some(vec![1, 1])
        );
        add_pool(&kv, "b").await;
        let reused = listing
            .fresh(&kv, at + POOL_LISTING_REUSED_MS - 1)
            .await
            .expect("listed");
        assert_eq!(counts(&reused), Some(vec![1, 1]), "not listed again yet");
        drop(reused);
        let again = listing
            .fresh(&kv, at + POOL_LISTING_REUSED_MS)
            .await
            .expect("listed");
        assert_eq!(counts(&again), Some(vec![2, 2]));
        assert_eq!(again.as_ref().map(|l| l.longest_window_ms), Some(60_000));
    }
}
