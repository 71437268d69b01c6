//! Usage export (`GET /v1/usage`): what each tenant's pool granted, spent and admitted, per region
//! and window, from the ledger, for billing. A page at a time, as JSON lines or CSV; every record
//! has an id of its own (tenant, pool, region and window), so loading a page twice, or a window
//! again after late reports moved it, replaces a record instead of counting it twice.

use allot_shared::ids::{PoolId, RegionId, TenantId};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::errors::ApiError;
use super::io::{parse_query, pool_path};
use crate::auth::OperatorRole;
use crate::ledger::WindowRow;
use crate::pools::{self, PoolPrefix};

/// Records a page holds unless `limit` says otherwise.
pub const DEFAULT_USAGE_PAGE: usize = 1_000;
/// Most records a page holds.
pub const MAX_USAGE_PAGE: usize = 10_000;
/// A window is closed once it ended this long ago, ms: its last reports are in.
pub const USAGE_SETTLE_MS: u64 = crate::ledger_sync::WINDOW_GAUGE_SETTLE_MS;
/// Pools one page reads at most (each a ledger read, however few windows they have).
const POOLS_PER_PAGE: usize = 1_000;

/// `GET /v1/usage` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// Windows that start at or after this instant, epoch ms.
    #[param(maximum = 9_007_199_254_740_992_u64)]
    pub from: u64,
    /// Windows that start before this instant, epoch ms (after `from`).
    #[param(maximum = 9_007_199_254_740_992_u64)]
    pub to: u64,
    /// Only pools whose `tenant/pool` starts with this (`acme`, `acme/`, `acme/api`).
    #[param(pattern = "^[a-z0-9-]{0,32}(/[a-z0-9-]{0,32})?$")]
    pub prefix: Option<String>,
    /// `jsonl` (the default) or `csv`.
    #[param(pattern = "^(jsonl|csv)$")]
    pub format: Option<String>,
    /// Records per page (1 to [`MAX_USAGE_PAGE`]; default [`DEFAULT_USAGE_PAGE`]).
    #[param(minimum = 1, maximum = 10000)]
    pub limit: Option<usize>,
    /// The cursor the page before ended with (its `Allot-Next-After` header).
    pub after: Option<String>,
}

/// One exported record: a region's figures in one window of one pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageRecord {
    /// Stable for the tenant, pool, region and window: the key to load the record by.
    pub record_id: String,
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The region.
    pub region: RegionId,
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Whether the window ended and settled: its figures move only if a late report arrives.
    pub closed: bool,
    /// Tokens granted to the region.
    #[serde(rename = "granted")]
    pub granted_tokens: u64,
    /// Tokens the region spent from its leases.
    #[serde(rename = "spent")]
    pub spent_tokens: u64,
    /// Tokens the region admitted in fallback (the allocator unreachable).
    #[serde(rename = "fallbackAdmitted")]
    pub fallback_admitted_tokens: u64,
    /// spent + fallbackAdmitted: what the region's users consumed.
    #[serde(rename = "admitted")]
    pub admitted_tokens: u64,
    /// Metered requests: the most debt the region carried (consumed beyond `admitted`).
    #[serde(rename = "settleDebt")]
    pub settle_debt_tokens: u64,
    /// Metered requests: consumed beyond the debt the region could carry, never charged.
    #[serde(rename = "writtenOff")]
    pub written_off_tokens: u64,
}

/// The CSV header, in [`UsageRecord::csv_line`]'s order.
pub const CSV_HEADER: &str = "recordId,tenant,pool,region,windowStartMs,windowEndMs,closed,granted,spent,fallbackAdmitted,admitted,settleDebt,writtenOff";

impl UsageRecord {
    /// The record's id: the first 128 bits of SHA-256 over its tenant, pool, region and window
    /// start, in hex.
    pub fn id_of(
        tenant: &TenantId,
        pool: &PoolId,
        region: &RegionId,
        window_start_ms: u64,
    ) -> String {
        allot_shared::ids::content_id(&[tenant, pool, region, &window_start_ms])
    }

    /// The record as a CSV line (ids and numbers only: nothing to quote).
    pub fn csv_line(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.record_id,
            self.tenant,
            self.pool,
            self.region,
            self.window_start_ms,
            self.window_end_ms,
            self.closed,
            self.granted_tokens,
            self.spent_tokens,
            self.fallback_admitted_tokens,
            self.admitted_tokens,
            self.settle_debt_tokens,
            self.written_off_tokens
        )
    }

    /// A window's records, one a region that has any figure in it, in region order.
    fn of_window(tenant: &TenantId, pool: &PoolId, row: &WindowRow, now_ms: u64) -> Vec<Self> {
        let mut regions: Vec<&RegionId> = row
            .granted_tokens_by_region
            .keys()
            .chain(row.spent_tokens_by_region.keys())
            .chain(row.fallback_admitted_tokens_by_region.keys())
            .chain(row.settle_debt_tokens_by_region.keys())
            .chain(row.written_off_tokens_by_region.keys())
            .collect();
        regions.sort();
        regions.dedup();
        let of = |map: &std::collections::BTreeMap<RegionId, u64>, region: &RegionId| {
            map.get(region).copied().unwrap_or(0)
        };
        regions
            .into_iter()
            .map(|region| Self {
                record_id: Self::id_of(tenant, pool, region, row.window_start_ms),
                tenant: tenant.clone(),
                pool: pool.clone(),
                region: region.clone(),
                window_start_ms: row.window_start_ms,
                window_end_ms: row.window_end_ms,
                closed: row.window_end_ms.saturating_add(USAGE_SETTLE_MS) <= now_ms,
                granted_tokens: of(&row.granted_tokens_by_region, region),
                spent_tokens: of(&row.spent_tokens_by_region, region),
                fallback_admitted_tokens: of(&row.fallback_admitted_tokens_by_region, region),
                admitted_tokens: of(&row.admitted_tokens_by_region, region),
                settle_debt_tokens: of(&row.settle_debt_tokens_by_region, region),
                written_off_tokens: of(&row.written_off_tokens_by_region, region),
            })
            .collect()
    }
}

/// Where a page starts: in pool `tenant/pool`, at its windows that start before `before_ms`
/// (a pool's windows are read newest first). Written `tenant/pool@before_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    tenant: TenantId,
    pool: PoolId,
    before_ms: u64,
}

impl Cursor {
    fn parse(text: &str) -> Option<Self> {
        let (path, before) = text.split_once('@')?;
        let (tenant, pool) = path.split_once('/')?;
        let (tenant, pool) = pool_path(tenant, pool).ok()?;
        Some(Self {
            tenant,
            pool,
            before_ms: before.parse().ok()?,
        })
    }

    fn text(&self) -> String {
        format!("{}/{}@{}", self.tenant, self.pool, self.before_ms)
    }
}

/// A page of records and the cursor of the next (none after the last). Pools in key order, each
/// pool's windows newest first; a cursor at `before_ms` 0 means its pool is done.
///
/// Long by design: the cursor is both read at its top (which pool to resume, and from where in it)
/// and written at its two exits (mid-pool, never splitting a window's records, or after the last
/// pool listed); in one body, the cursor a page hands out can be checked against how the next page
/// reads it.
async fn page(
    state: &ApiState,
    query: &UsageQuery,
    prefix: &PoolPrefix,
    limit: usize,
    start: Option<Cursor>,
) -> Result<(Vec<UsageRecord>, Option<Cursor>), ApiError> {
    let now_ms = state.clock.now_ms();
    let after_pool = start
        .as_ref()
        .map(|cursor| (cursor.tenant.clone(), cursor.pool.clone()));
    let mut pools = Vec::new();
    // The cursor's pool first, from where the last page stopped in it; then the pools after it.
    if let Some(cursor) = start.as_ref().filter(|cursor| cursor.before_ms > 0)
        && let Some((stored, _)) = pools::get_pool(&*state.kv, &cursor.tenant, &cursor.pool).await?
    {
        pools.push((
            cursor.tenant.clone(),
            cursor.pool.clone(),
            stored,
            cursor.before_ms,
        ));
    }
    let listed =
        pools::list_pools_page(&*state.kv, prefix, after_pool.as_ref(), POOLS_PER_PAGE).await?;
    let more_pools = listed.len() >= POOLS_PER_PAGE;
    pools.extend(
        listed
            .into_iter()
            .map(|(tenant, pool, stored)| (tenant, pool, stored, u64::MAX)),
    );
    let mut records = Vec::new();
    for (tenant, pool, stored, resume_before_ms) in &pools {
        let Ok(config) = stored.spec.validate() else {
            continue;
        };
        let mut before_ms = (*resume_before_ms).min(query.to);
        while before_ms > query.from {
            // No more windows than can start in [from, before): a day's export of a pool with a
            // year in the ledger reads a day of windows, not the newest thousand.
            let in_range = (before_ms - query.from).div_ceil(config.window().shortest_ms().max(1));
            let rows = state
                .ledger
                .windows_before(
                    tenant,
                    pool,
                    crate::ledger::PoolLimits {
                        config: &config,
                        overrides: &stored.overrides,
                    },
                    in_range.min(crate::ledger::MAX_WINDOWS),
                    now_ms,
                    before_ms,
                )
                .await?;
            let Some(oldest) = rows.last().map(|row| row.window_start_ms) else {
                break;
            };
            for row in rows.iter().filter(|row| row.window_start_ms >= query.from) {
                let window = UsageRecord::of_window(tenant, pool, row, now_ms);
                // A window's records are never split over two pages.
                if !records.is_empty() && records.len() + window.len() > limit {
                    let next = Cursor {
                        tenant: tenant.clone(),
                        pool: pool.clone(),
                        before_ms: row.window_start_ms.saturating_add(1),
                    };
                    return Ok((records, Some(next)));
                }
                records.extend(window);
            }
            debug_assert!(oldest < before_ms, "each read goes further back");
            before_ms = oldest;
        }
    }
    let next = more_pools
        .then(|| pools.last())
        .flatten()
        .map(|(tenant, pool, _, _)| Cursor {
            tenant: tenant.clone(),
            pool: pool.clone(),
            before_ms: 0,
        });
    Ok((records, next))
}

#[utoipa::path(get, path = "/v1/usage", tag = "usage",
    params(UsageQuery),
    responses(
        (status = 200, description = "A page of usage records, JSON lines or CSV; `Allot-Next-After` names the next page",
            content((UsageRecord = "application/x-ndjson"), (String = "text/csv")), headers(("allot-next-after" = String))),
        crate::http::errors::Refused,
    ))]
pub async fn get_usage(
    State(state): State<ApiState>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let query: UsageQuery = parse_query(query.as_deref())?;
    for (field, ms) in [("from", query.from), ("to", query.to)] {
        if ms > allot_shared::json_number::MAX_WHOLE {
            return Err(ApiError::invalid(field, "must be at most 2^53"));
        }
    }
    if query.to <= query.from {
        return Err(ApiError::invalid("to", "must be after from"));
    }
    let csv = match query.format.as_deref() {
        None | Some("jsonl") => false,
        Some("csv") => true,
        Some(_) => return Err(ApiError::invalid("format", "must be jsonl or csv")),
    };
    let limit = query.limit.unwrap_or(DEFAULT_USAGE_PAGE);
    if !(1..=MAX_USAGE_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit", "must be in [1, 10000]"));
    }
    let prefix = PoolPrefix::parse(query.prefix.as_deref().unwrap_or_default())
        .map_err(|e| ApiError::invalid("prefix", e.to_string()))?;
    let start = match &query.after {
        None => None,
        Some(text) => Some(Cursor::parse(text).ok_or_else(|| {
            ApiError::invalid("after", "must be the Allot-Next-After of the page before")
        })?),
    };
    let (records, next) = page(&state, &query, &prefix, limit, start).await?;
    let mut body = String::new();
    if csv {
        body.push_str(CSV_HEADER);
        body.push('\n');
    }
    for record in &records {
        if csv {
            body.push_str(&record.csv_line());
        } else {
            body.push_str(&serde_json::to_string(record).unwrap_or_default());
        }
        body.push('\n');
    }
    let content_type = if csv {
        "text/csv; charset=utf-8"
    } else {
        "application/x-ndjson"
    };
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(next) = next
        && let Ok(value) = HeaderValue::from_str(&next.text())
    {
        headers.insert("allot-next-after", value);
    }
    Ok(response)
}
