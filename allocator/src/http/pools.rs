//! Pools: operators configure them (`/v1/pools`), agents read their terms, and the ledger's windows
//! are read per pool.

use allot_shared::contract::Problem;
use allot_shared::ids::{AgentId, PoolId, RegionId, TenantId};
use allot_shared::wire::{FallbackInWindow, PoolTerms};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::changes::{Changed, record_id, run_change, unrecorded};
use super::errors::{ApiError, invalid_id};
use super::io::{json_response, parse_json, parse_query, pool_path};
use crate::auth::OperatorRole;
use crate::ledger::{PoolChange, PoolLimits};
use crate::pools::{self, PoolSpec, PoolStoreError, StoredPool};

/// The pool as answered by the API: its spec flattened, its version, and when asked the live window.
///
/// One `window` object says what the window is and where it stands: a calendar pool's `calendar`
/// and `timeZone` (as its spec writes them) beside the live window's fields
/// (the private `PoolViewWire` is the JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(into = "PoolViewWire", try_from = "PoolViewWire")]
pub struct PoolView {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The configuration.
    pub spec: PoolSpec,
    /// The configuration's version.
    pub version: u64,
    /// Last update, epoch ms.
    pub updated_at_ms: u64,
    /// The current window, on `GET /v1/pools/{tenant}/{pool}`.
    pub window: Option<LiveWindow>,
}

/// The JSON of a [`PoolView`]: the spec's fields at the top, but its calendar (if any) inside
/// `window`, merged with the live window.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolViewWire {
    tenant: TenantId,
    pool: PoolId,
    #[serde(flatten)]
    spec: serde_json::Map<String, serde_json::Value>,
    version: u64,
    updated_at_ms: u64,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    window: serde_json::Map<String, serde_json::Value>,
}

/// The keys of a calendar window in a pool spec.
const CALENDAR_KEYS: [&str; 2] = ["calendar", "timeZone"];

impl From<PoolView> for PoolViewWire {
    fn from(view: PoolView) -> Self {
        let as_map = |value: serde_json::Value| match value {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        let mut spec = as_map(serde_json::to_value(&view.spec).unwrap_or_default());
        let mut window = as_map(spec.remove("window").unwrap_or_default());
        if let Some(live) = view.window {
            window.extend(as_map(serde_json::to_value(live).unwrap_or_default()));
        }
        Self {
            tenant: view.tenant,
            pool: view.pool,
            spec,
            version: view.version,
            updated_at_ms: view.updated_at_ms,
            window,
        }
    }
}

impl TryFrom<PoolViewWire> for PoolView {
    type Error = serde_json::Error;

    fn try_from(wire: PoolViewWire) -> Result<Self, Self::Error> {
        let (calendar, live): (serde_json::Map<_, _>, serde_json::Map<_, _>) = wire
            .window
            .into_iter()
            .partition(|(key, _)| CALENDAR_KEYS.contains(&key.as_str()));
        let mut spec = wire.spec;
        if !calendar.is_empty() {
            spec.insert("window".to_owned(), serde_json::Value::Object(calendar));
        }
        let window = if live.is_empty() {
            None
        } else {
            Some(serde_json::from_value(serde_json::Value::Object(live))?)
        };
        Ok(Self {
            tenant: wire.tenant,
            pool: wire.pool,
            spec: serde_json::from_value(serde_json::Value::Object(spec))?,
            version: wire.version,
            updated_at_ms: wire.updated_at_ms,
            window,
        })
    }
}

/// The schema of a [`PoolView`], from its parts' own: the spec's fields (its `window` replaced by
/// one object of the calendar's fields and the live window's, all optional), the tenant, pool,
/// version and update time.
impl utoipa::PartialSchema for PoolView {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::{ObjectBuilder, Schema};
        let object_of = |schema: RefOr<Schema>| match schema {
            RefOr::T(Schema::Object(object)) => Some(object),
            _ => None,
        };
        let Some(mut view) = object_of(<PoolSpec as utoipa::PartialSchema>::schema()) else {
            return <PoolSpec as utoipa::PartialSchema>::schema();
        };
        view.description =
            Some("A pool: its spec, version and, when asked, its live window.".into());
        view.properties.shift_remove("window");
        view.required.retain(|name| name != "window");
        let mut window = ObjectBuilder::new()
            .description(Some(
                "A calendar pool's calendar and time zone, and on GET of one pool the live window.",
            ))
            .build();
        for part in [
            <allot_shared::wire::CalendarWindowSpec as utoipa::PartialSchema>::schema(),
            <LiveWindow as utoipa::PartialSchema>::schema(),
        ] {
            if let Some(part) = object_of(part) {
                window.properties.extend(part.properties);
            }
        }
        view.properties.insert("window".to_owned(), window.into());
        for (name, schema) in [
            ("tenant", <TenantId as utoipa::PartialSchema>::schema()),
            ("pool", <PoolId as utoipa::PartialSchema>::schema()),
            ("version", <u64 as utoipa::PartialSchema>::schema()),
            ("updatedAtMs", <u64 as utoipa::PartialSchema>::schema()),
        ] {
            view.properties.insert(name.to_owned(), schema);
            view.required.push(name.to_owned());
        }
        RefOr::T(Schema::Object(view))
    }
}

impl utoipa::ToSchema for PoolView {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        <PoolSpec as utoipa::ToSchema>::schemas(schemas);
        <LiveWindow as utoipa::ToSchema>::schemas(schemas);
        <allot_shared::wire::CalendarWindowSpec as utoipa::ToSchema>::schemas(schemas);
    }
}

/// A pool's current window.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LiveWindow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Tokens not yet granted.
    #[serde(rename = "remaining")]
    pub remaining_tokens: u64,
    /// `G` in force now: the spec's, or an override's.
    #[serde(default, rename = "limitNow", skip_serializing_if = "Option::is_none")]
    pub limit_now_tokens: Option<u64>,
    /// The override in force now, if any (`/v1/overrides`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub override_id: Option<allot_shared::ids::RecordId>,
    /// Tokens granted per region.
    #[serde(rename = "grantedByRegion")]
    pub granted_tokens_by_region: std::collections::BTreeMap<RegionId, u64>,
    /// Leases of this window that have not expired.
    pub leases_outstanding: u64,
    /// The same, per region.
    #[serde(default)]
    pub leases_outstanding_by_region: std::collections::BTreeMap<RegionId, u64>,
}

/// `GET /v1/pools` answer.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolList {
    /// Every pool (or, with `limit`, one page), in (tenant, pool) order, without live windows.
    pub pools: Vec<PoolView>,
    /// With `limit`: `tenant/pool` to ask `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// Most pools one page of `GET /v1/pools` holds.
pub const MAX_POOLS_PER_PAGE: usize = 1_000;

/// `GET /v1/pools` query: without `limit`, every pool; with it, one page.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PoolsQuery {
    /// Pools per page (1 to [`MAX_POOLS_PER_PAGE`]).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// Only pools whose `tenant/pool` starts with this (`acme`, `acme/`, `acme/api`).
    #[param(pattern = "^[a-z0-9-]{0,32}(/[a-z0-9-]{0,32})?$")]
    pub prefix: Option<String>,
    /// The `next` of the page before: the page starts after this `tenant/pool`.
    #[param(pattern = "^[a-z0-9-]{1,32}/[a-z0-9-]{1,32}$")]
    pub after: Option<String>,
}

/// `GET /v1/pools/{tenant}/{pool}/windows` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WindowsQuery {
    /// How many of the latest windows (default 10, at most 1,000).
    #[param(minimum = 1, maximum = 1000)]
    pub last: Option<u64>,
}

/// `GET /v1/pools/{tenant}/{pool}/windows` answer.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WindowList {
    /// Newest first.
    pub windows: Vec<crate::ledger::WindowRow>,
}

/// `GET /v1/pools/{tenant}/{pool}/terms` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TermsQuery {
    /// The asking region: the answer adds its fallback admitted so far in the window (every agent
    /// of the region together, or, with `agentId`, that agent's own).
    #[param(pattern = "^[a-z0-9-]{1,32}$")]
    region: Option<String>,
    /// The asking agent (with `region`): the fallback admitted is its own, as its reports named it.
    #[serde(rename = "agentId")]
    #[param(rename = "agentId", pattern = "^[A-Za-z0-9._-]{1,64}$")]
    agent_id: Option<String>,
}

fn view(tenant: TenantId, pool: PoolId, stored: StoredPool) -> PoolView {
    PoolView {
        tenant,
        pool,
        spec: stored.spec,
        version: stored.version,
        updated_at_ms: stored.updated_at_ms,
        window: None,
    }
}

/// The pool at `tenant`/`pool`, or 404.
async fn stored_pool(
    state: &ApiState,
    tenant: &TenantId,
    pool: &PoolId,
) -> Result<StoredPool, ApiError> {
    let (stored, _) = pools::get_pool(&*state.kv, tenant, pool)
        .await?
        .ok_or_else(|| ApiError::not_found("no such pool"))?;
    Ok(stored)
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools",
    params(PoolsQuery),
    responses(
        (status = 200, description = "Every pool, or one page", body = PoolList),
        crate::http::errors::Refused,
    ))]
pub async fn list_pools(
    State(state): State<ApiState>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let query: PoolsQuery = parse_query(query.as_deref())?;
    let prefix =
        pools::PoolPrefix::parse(query.prefix.as_deref().unwrap_or_default()).map_err(|e| {
            ApiError::invalid(
                "prefix",
                format!("must be tenant, tenant/ or tenant/pool, each a prefix of an id: {e}"),
            )
        })?;
    let after = match &query.after {
        None => None,
        Some(text) => {
            let (tenant, pool) = text.split_once('/').ok_or_else(|| {
                ApiError::invalid("after", "must be tenant/pool, as `next` gives it")
            })?;
            Some(pool_path(tenant, pool).map_err(|_| {
                ApiError::invalid("after", "must be tenant/pool, as `next` gives it")
            })?)
        }
    };
    let Some(limit) = query.limit else {
        if after.is_some() {
            return Err(ApiError::invalid("after", "needs limit"));
        }
        let pools = pools::list_pools_matching(&*state.kv, &prefix)
            .await?
            .into_iter()
            .map(|(tenant, pool, stored)| view(tenant, pool, stored))
            .collect();
        return Ok(json_response(
            StatusCode::OK,
            &PoolList { pools, next: None },
        ));
    };
    if !(1..=MAX_POOLS_PER_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit", "must be in [1, 1000]"));
    }
    let page = pools::list_pools_page(&*state.kv, &prefix, after.as_ref(), limit).await?;
    let next = (page.len() == limit)
        .then(|| {
            page.last()
                .map(|(tenant, pool, _)| format!("{tenant}/{pool}"))
        })
        .flatten();
    let pools = page
        .into_iter()
        .map(|(tenant, pool, stored)| view(tenant, pool, stored))
        .collect();
    Ok(json_response(StatusCode::OK, &PoolList { pools, next }))
}

#[utoipa::path(get, path = "/v1/pools/{tenant}/{pool}", tag = "pools",
    params(("tenant" = TenantId, Path, description = "The tenant"), ("pool" = PoolId, Path, description = "The pool")),
    responses(
        (status = 200, description = "The pool and its live window", body = PoolView),
        (status = 404, description = "No such pool", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_pool(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let kv = &*state.kv;
    let stored = stored_pool(&state, &tenant, &pool).await?;
    let config = stored.spec.validate().map_err(PoolStoreError::from)?;
    let now_ms = state.clock.now_ms();
    let current = config.window_at(now_ms);
    let window = pools::get_window(kv, &tenant, &pool)
        .await?
        .map(|(w, _)| w)
        .filter(|w| w.window == current)
        .unwrap_or_else(|| allot_shared::lease::PoolWindowState::fresh(current));
    let mut leases_outstanding_by_region = std::collections::BTreeMap::new();
    for grant in pools::list_grants(kv, &tenant, &pool).await? {
        if grant.window_start_ms == current.start_ms && grant.expires_at_ms > now_ms {
            *leases_outstanding_by_region
                .entry(grant.region)
                .or_insert(0u64) += 1;
        }
    }
    let leases_outstanding = leases_outstanding_by_region.values().sum();
    let limit_now_tokens = stored.limit_at(now_ms);
    let override_id = stored
        .overrides
        .iter()
        .find(|o| o.in_force_at(now_ms))
        .map(|o| o.id);
    let mut answer = view(tenant, pool, stored);
    answer.window = Some(LiveWindow {
        window_start_ms: current.start_ms,
        window_end_ms: current.end_ms,
        remaining_tokens: window.remaining_tokens(&config.limited_to(limit_now_tokens)),
        limit_now_tokens: Some(limit_now_tokens),
        override_id,
        granted_tokens_by_region: window.granted_by_region,
        leases_outstanding,
        leases_outstanding_by_region,
    });
    Ok(json_response(StatusCode::OK, &answer))
}

#[utoipa::path(put, path = "/v1/pools/{tenant}/{pool}", tag = "pools",
    params(("tenant" = TenantId, Path, description = "The tenant"), ("pool" = PoolId, Path, description = "The pool")),
    request_body = PoolSpec,
    responses(
        (status = 200, description = "The pool as stored", body = PoolView),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn put_pool(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let spec: PoolSpec = parse_json(&headers, &body)?;
    run_change(
        state,
        credential,
        "pool.put",
        async move |state, credential| {
            let now_ms = state.clock.now_ms();
            let stored = pools::put_pool(&*state.kv, &tenant, &pool, spec, now_ms).await?;
            let target = format!("{tenant}/{pool}");
            let config_json = serde_json::to_string(&stored.spec).unwrap_or_default();
            state
                .ledger
                .record_pool_change(&PoolChange {
                    change_id: &record_id(now_ms).to_string(),
                    tenant: &tenant,
                    pool: &pool,
                    version: stored.version,
                    actor: &credential.actor(),
                    changed_at_ms: now_ms,
                    config_json: &config_json,
                })
                .await
                .map_err(|e| unrecorded("pool history", "pool.put", &target, e))?;
            tracing::info!(%tenant, %pool, version = stored.version, "pool configured");
            Ok(Changed {
                version: stored.version,
                detail: serde_json::json!({ "config": stored.spec }),
                target,
                response: json_response(StatusCode::OK, &view(tenant, pool, stored)),
            })
        },
    )
    .await
}

#[utoipa::path(delete, path = "/v1/pools/{tenant}/{pool}", tag = "pools",
    params(("tenant" = TenantId, Path, description = "The tenant"), ("pool" = PoolId, Path, description = "The pool")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such pool", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn delete_pool(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    run_change(
        state,
        credential,
        "pool.delete",
        async move |state, credential| {
            if !pools::delete_pool(&*state.kv, &tenant, &pool).await? {
                return Err(ApiError::not_found("no such pool"));
            }
            let now_ms = state.clock.now_ms();
            let target = format!("{tenant}/{pool}");
            state
                .ledger
                .record_pool_change(&PoolChange {
                    change_id: &record_id(now_ms).to_string(),
                    tenant: &tenant,
                    pool: &pool,
                    version: 0,
                    actor: &credential.actor(),
                    changed_at_ms: now_ms,
                    config_json: "{}",
                })
                .await
                .map_err(|e| unrecorded("pool history", "pool.delete", &target, e))?;
            tracing::info!(%tenant, %pool, "pool deleted");
            Ok(Changed {
                response: StatusCode::NO_CONTENT.into_response(),
                target,
                version: 0,
                detail: serde_json::json!({}),
            })
        },
    )
    .await
}

#[utoipa::path(get, path = "/v1/pools/{tenant}/{pool}/terms", tag = "agents",
    params(("tenant" = TenantId, Path, description = "The tenant"), ("pool" = PoolId, Path, description = "The pool"), TermsQuery),
    responses(
        (status = 200, description = "The pool's terms, as agents read them", body = PoolTerms),
        (status = 404, description = "No such pool", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_pool_terms(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    query: Result<Query<TermsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Reader)?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let Query(query) = query.map_err(|e| ApiError::invalid("region", e.body_text()))?;
    let region = query
        .region
        .as_deref()
        .map(|region| RegionId::parse(region).map_err(invalid_id("region")))
        .transpose()?;
    if let Some(region) = &region {
        check_region(&credential, region)?;
    }
    let agent = query
        .agent_id
        .as_deref()
        .map(|agent| AgentId::parse(agent).map_err(invalid_id("agentId")))
        .transpose()?;
    if agent.is_some() && region.is_none() {
        return Err(ApiError::invalid(
            "agentId",
            "names an agent of a region: send region with it",
        ));
    }
    let terms = pool_terms(&state, &tenant, &pool, region.as_ref(), agent.as_ref()).await?;
    Ok(json_response(StatusCode::OK, &terms))
}

/// A pool's terms as agents read them, asked for by `region` (its agent `agent`): with what it
/// admitted in fallback so far in the current window. The caller has checked both.
pub(super) async fn pool_terms(
    state: &ApiState,
    tenant: &TenantId,
    pool: &PoolId,
    region: Option<&RegionId>,
    agent: Option<&AgentId>,
) -> Result<PoolTerms, ApiError> {
    let stored = stored_pool(state, tenant, pool).await?;
    terms_of_stored(state, tenant, pool, &stored, region, agent).await
}

/// The terms of `stored`, `tenant`'s pool `pool`, as [`pool_terms`] answers them.
pub(super) async fn terms_of_stored(
    state: &ApiState,
    tenant: &TenantId,
    pool: &PoolId,
    stored: &StoredPool,
    region: Option<&RegionId>,
    agent: Option<&AgentId>,
) -> Result<PoolTerms, ApiError> {
    let config = stored.spec.validate().ok();
    let now_ms = state.clock.now_ms();
    let fallback_in_window = match (region, &config) {
        (Some(region), Some(config)) => {
            let window = config.window_at(now_ms);
            let admitted_tokens = state
                .ledger
                .fallback_admitted(tenant, pool, region, agent, window.start_ms)
                .await?;
            Some(FallbackInWindow {
                window_start_ms: window.start_ms,
                admitted_tokens,
            })
        }
        _ => None,
    };
    Ok(stored.terms(now_ms, fallback_in_window))
}

#[utoipa::path(get, path = "/v1/pools/{tenant}/{pool}/windows", tag = "pools",
    params(("tenant" = TenantId, Path, description = "The tenant"), ("pool" = PoolId, Path, description = "The pool"), WindowsQuery),
    responses(
        (status = 200, description = "The latest windows, newest first", body = WindowList),
        (status = 404, description = "No such pool", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn get_windows(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    query: Result<Query<WindowsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let Query(query) = query.map_err(|e| ApiError::invalid("last", e.body_text()))?;
    let last = query.last.unwrap_or(10);
    if !(1..=crate::ledger::MAX_WINDOWS).contains(&last) {
        return Err(ApiError::invalid("last", "must be in [1, 1000]"));
    }
    let stored = stored_pool(&state, &tenant, &pool).await?;
    let config = stored.spec.validate().map_err(PoolStoreError::from)?;
    let windows = state
        .ledger
        .windows(
            &tenant,
            &pool,
            PoolLimits {
                config: &config,
                overrides: &stored.overrides,
            },
            last,
            state.clock.now_ms(),
        )
        .await?;
    Ok(json_response(StatusCode::OK, &WindowList { windows }))
}

/// Most pools one `POST /v1/pools/bulk` writes.
pub const MAX_POOLS_PER_BULK: usize = 1_000;

/// Largest `POST /v1/pools/bulk` body: room for [`MAX_POOLS_PER_BULK`] specs of any shape.
pub const MAX_BULK_BODY_BYTES: usize = 1024 * 1024;

/// `POST /v1/pools/bulk` body: pools to create or replace in one call.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkPools {
    /// 1 to [`MAX_POOLS_PER_BULK`] pools, each named once.
    pub pools: Vec<BulkPool>,
}

/// One pool of a bulk write: where it is and its spec (the body of `PUT /v1/pools/{tenant}/{pool}`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkPool {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// Its configuration.
    pub spec: PoolSpec,
}

/// `POST /v1/pools/bulk` answer: what happened to each pool, in the body's order, and the totals.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BulkAnswer {
    /// Pools that did not exist.
    pub created: u64,
    /// Pools whose spec changed.
    pub updated: u64,
    /// Pools already at the given spec: nothing written, version kept.
    pub unchanged: u64,
    /// Each pool's outcome.
    pub pools: Vec<BulkWritten>,
}

/// One pool's outcome in a [`BulkAnswer`].
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BulkWritten {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// Its version now.
    pub version: u64,
    /// What the call did to it.
    pub outcome: pools::BulkOutcome,
}

/// Refuses a bulk body naming the entry and field at fault (`pools[3].spec.chunk`): too few or too
/// many pools, a pool named twice, an invalid spec. Nothing is written when any entry is refused.
fn check_bulk(body: &BulkPools) -> Result<(), ApiError> {
    if !(1..=MAX_POOLS_PER_BULK).contains(&body.pools.len()) {
        return Err(ApiError::invalid(
            "pools",
            format!(
                "must list 1 to {MAX_POOLS_PER_BULK} pools, got {}",
                body.pools.len()
            ),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(body.pools.len());
    for (index, entry) in body.pools.iter().enumerate() {
        if !seen.insert((&entry.tenant, &entry.pool)) {
            return Err(ApiError::invalid(
                format!("pools[{index}].pool"),
                format!("{}/{} is listed twice", entry.tenant, entry.pool),
            ));
        }
        entry.spec.validate().map_err(|invalid| {
            ApiError::invalid(
                format!("pools[{index}].spec.{}", invalid.field),
                invalid.message,
            )
        })?;
    }
    Ok(())
}

/// What a bulk call did: how many pools it created, updated and left unchanged, and each pool's
/// version and outcome, in the order they were listed.
fn bulk_answer(
    entries: Vec<(TenantId, PoolId, PoolSpec)>,
    written: Vec<(pools::StoredPool, pools::BulkOutcome)>,
) -> BulkAnswer {
    let count = |wanted: pools::BulkOutcome| {
        written
            .iter()
            .filter(|(_, outcome)| *outcome == wanted)
            .count() as u64
    };
    BulkAnswer {
        created: count(pools::BulkOutcome::Created),
        updated: count(pools::BulkOutcome::Updated),
        unchanged: count(pools::BulkOutcome::Unchanged),
        pools: entries
            .into_iter()
            .zip(written)
            .map(|((tenant, pool, _), (stored, outcome))| BulkWritten {
                tenant,
                pool,
                version: stored.version,
                outcome,
            })
            .collect(),
    }
}

#[utoipa::path(post, path = "/v1/pools/bulk", tag = "pools",
    request_body = BulkPools,
    responses(
        (status = 200, description = "What happened to each pool", body = BulkAnswer),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn bulk_put_pools(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let body: BulkPools = parse_json(&headers, &body)?;
    check_bulk(&body)?;
    run_change(
        state,
        credential,
        "pool.bulk",
        async move |state, credential| {
            let now_ms = state.clock.now_ms();
            let entries: Vec<_> = body
                .pools
                .into_iter()
                .map(|entry| (entry.tenant, entry.pool, entry.spec))
                .collect();
            let written = pools::put_pools(&*state.kv, &entries, now_ms).await?;
            let target = format!("{} pools", entries.len());
            let actor = credential.actor();
            // Each changed pool's history row: its id and stored spec, owned here, borrowed below.
            let changed: Vec<_> = entries
                .iter()
                .zip(&written)
                .filter(|(_, (_, outcome))| *outcome != pools::BulkOutcome::Unchanged)
                .map(|((tenant, pool, _), (stored, _))| {
                    let config_json = serde_json::to_string(&stored.spec).unwrap_or_default();
                    let change_id = record_id(now_ms).to_string();
                    (tenant, pool, stored.version, config_json, change_id)
                })
                .collect();
            let records: Vec<PoolChange> = changed
                .iter()
                .map(
                    |(tenant, pool, version, config_json, change_id)| PoolChange {
                        change_id,
                        tenant,
                        pool,
                        version: *version,
                        actor: &actor,
                        changed_at_ms: now_ms,
                        config_json,
                    },
                )
                .collect();
            state
                .ledger
                .record_pool_changes(&records)
                .await
                .map_err(|e| unrecorded("pool history", "pool.bulk", &target, e))?;
            let answer = bulk_answer(entries, written);
            tracing::info!(
                created = answer.created,
                updated = answer.updated,
                unchanged = answer.unchanged,
                "pools configured in bulk"
            );
            Ok(Changed {
                version: 0,
                detail: serde_json::json!({
                    "created": answer.created,
                    "updated": answer.updated,
                    "unchanged": answer.unchanged,
                }),
                target,
                response: json_response(StatusCode::OK, &answer),
            })
        },
    )
    .await
}
