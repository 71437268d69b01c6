//! The allocator's HTTP API (axum): pools for operators, grants for agents, health for orchestrators.
//!
//! Wire types are JSON in camelCase; every error is an RFC 9457 problem+json body that names the field
//! at fault. Every endpoint needs a bearer token ([`crate::auth`]): viewers read, authors also change
//! pools and policies, admins also manage tokens, agents take grants and report for their own region.
//! A missing or unknown token is 401 (the same answer for both), a known token without the role 403.
//! Every change is written to the ledger's audit log with its actor and version. Every request is
//! bounded: body size, time and concurrency (I10).

use std::sync::Arc;
use std::time::Duration;

use allot_shared::contract::{PROBLEM_CONTENT_TYPE, Problem};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::GrantRequest;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The token files' lines (see [`crate::auth`]).
pub use crate::auth::Tokens;
use crate::auth::{self, Credential, Holder, OperatorRole, TokenBook, TokenStoreError};
use crate::clock::Clock;
use crate::grants::{GrantFailure, Grantor};
use crate::kv::Kv;
use crate::leader::Role;
use crate::ledger::{AuditEntry, Ledger, LedgerError, PoolChange, Report};
use crate::policies::{self, AgentStatus, PolicyStoreError};
use crate::pools::{self, PoolSpec, PoolStoreError, StoredPool};
/// The terms answer's wire types, shared with the agent's client.
pub use allot_shared::lease::{FallbackInWindow, PoolTerms};
use allot_shared::policy::parse_bundle;

/// Largest request body, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest a request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Most requests served at once; more wait in the listener's backlog.
pub const MAX_CONCURRENT_REQUESTS: usize = 1_024;

/// What a handler needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// An operator with at least this role.
    Operator(OperatorRole),
    /// A region agent.
    Agent,
    /// Any operator, or an agent.
    Reader,
}

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    /// The store.
    pub kv: Arc<dyn Kv>,
    /// The grant service.
    pub grantor: Grantor,
    /// This node's role.
    pub role: watch::Receiver<Role>,
    /// The allocator clock.
    pub clock: Arc<dyn Clock>,
    /// Accepted bearer tokens.
    pub tokens: Arc<TokenBook>,
    /// The accounting ledger.
    pub ledger: Ledger,
    /// The store lease agent status keys are written with.
    pub status_leases: Arc<policies::StatusLeases>,
}

/// An error answered as problem+json.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    problem: Box<Problem>,
}

impl ApiError {
    fn new(status: StatusCode, title: &str, detail: impl Into<String>) -> Self {
        Self {
            status,
            problem: Box::new(Problem::new(status.as_u16(), title, detail)),
        }
    }

    fn invalid(field: impl Into<String>, detail: impl Into<String>) -> Self {
        let mut error = Self::new(StatusCode::BAD_REQUEST, "Invalid request", detail);
        error.problem = Box::new(error.problem.with_field(field));
        error
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.problem).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Authenticates the caller and checks it may call an endpoint that `needs` what it names. An
/// unknown token and a missing one get the same 401: a caller learns nothing about which tokens exist.
fn authorize(state: &ApiState, headers: &HeaderMap, needs: Needs) -> Result<Credential, ApiError> {
    let credential = bearer_token(headers)
        .and_then(|token| state.tokens.authenticate(token))
        .ok_or_else(|| {
            metrics::counter!(crate::metrics::AUTH_REFUSALS, "status" => "401").increment(1);
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "send Authorization: Bearer <token>",
            )
        })?;
    let allowed = match (&credential.holder, needs) {
        (Holder::Operator(role), Needs::Operator(least)) => *role >= least,
        (Holder::Agent(_), Needs::Agent) => true,
        (_, Needs::Reader) => true,
        _ => false,
    };
    if !allowed {
        let detail = match needs {
            Needs::Operator(least) => format!(
                "this endpoint needs an operator token with role {} or above",
                least.as_str()
            ),
            Needs::Agent => "this endpoint needs an agent token".to_owned(),
            Needs::Reader => String::new(),
        };
        metrics::counter!(crate::metrics::AUTH_REFUSALS, "status" => "403").increment(1);
        return Err(ApiError::new(StatusCode::FORBIDDEN, "Forbidden", detail));
    }
    Ok(credential)
}

/// Refuses an agent acting for a region its token is not scoped to. Operators may name any region
/// on the read endpoints that take one.
fn check_region(credential: &Credential, region: &RegionId) -> Result<(), ApiError> {
    if matches!(credential.holder, Holder::Agent(_)) && !credential.may_act_for(region) {
        let mut error = ApiError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("this agent token may not act for region {region}"),
        );
        error.problem = Box::new(error.problem.with_field("region"));
        return Err(error);
    }
    Ok(())
}

/// Parses the `{tenant}/{pool}` path segments.
fn pool_path(tenant: &str, pool: &str) -> Result<(TenantId, PoolId), ApiError> {
    Ok((
        parse_id("tenant", tenant, TenantId::parse)?,
        parse_id("pool", pool, PoolId::parse)?,
    ))
}

/// A UUID v7 for an audit entry that sorts after every earlier one of this process, even within one
/// millisecond or after the clock stepped back: RFC 9562's method 1, a 12-bit counter in `rand_a`
/// that restarts each millisecond.
fn audit_entry_id(now_ms: u64) -> String {
    static LAST: std::sync::Mutex<(u64, u16)> = std::sync::Mutex::new((0, 0));
    let (ms, counter) = {
        let mut last = LAST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now_ms > last.0 {
            *last = (now_ms, 0);
        } else if last.1 < 0xFFF {
            last.1 += 1;
        } else {
            // 4,096 entries in one millisecond: borrow the next one.
            *last = (last.0 + 1, 0);
        }
        *last
    };
    let random = (u128::from(counter) << 64) | u128::from(rand::random::<u64>());
    LeaseId::from_parts(ms, random).to_string()
}

/// The answer when a change reached the store but its ledger or audit record did not: logged at error
/// level with what is missing, counted in `allot_audit_write_failures_total`, and answered 500 (not
/// 503: a retry would apply the change again).
fn unrecorded(what: &str, action: &str, target: &str, error: impl std::fmt::Display) -> ApiError {
    tracing::error!(%error, action, target, what, "change applied but not recorded");
    metrics::counter!(crate::metrics::AUDIT_WRITE_FAILURES).increment(1);
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Change applied but not recorded",
        format!("the change was applied but its {what} was not written: {error}"),
    )
}

/// Runs a change to completion even when the client goes away or the request deadline passes: once
/// the store has the change, its ledger and audit records must follow.
async fn to_completion(
    change: impl Future<Output = Result<Response, ApiError>> + Send + 'static,
) -> Result<Response, ApiError> {
    tokio::spawn(change).await.unwrap_or_else(|error| {
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            format!("the change task failed: {error}"),
        ))
    })
}

/// Writes one audit entry. The change is already applied when this runs: a failure is
/// [`unrecorded`], so nothing is silently unaudited.
async fn audit(
    state: &ApiState,
    credential: &Credential,
    action: &str,
    target: String,
    version: u64,
    detail: serde_json::Value,
) -> Result<(), ApiError> {
    let at_ms = state.clock.now_ms();
    let entry = AuditEntry {
        entry_id: audit_entry_id(at_ms),
        at_ms,
        actor: credential.actor(),
        action: action.to_owned(),
        target,
        version,
        detail: detail.to_string(),
    };
    state
        .ledger
        .record_audit(&entry)
        .await
        .map_err(|error| unrecorded("audit entry", action, &entry.target, error))
}

/// Parses a JSON body, naming the field at fault on error.
fn parse_json<T: DeserializeOwned>(headers: &HeaderMap, body: &Bytes) -> Result<T, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Unsupported media type",
            "send the body as Content-Type: application/json",
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let field = match path.as_str() {
            "." | "?" | "" => "body".to_owned(),
            _ => path,
        };
        ApiError::invalid(field, inner.to_string())
    })?;
    deserializer
        .end()
        .map_err(|e| ApiError::invalid("body", e.to_string()))?;
    Ok(value)
}

fn parse_id<T>(
    field: &str,
    value: &str,
    parse: fn(&str) -> Result<T, allot_shared::ids::IdError>,
) -> Result<T, ApiError> {
    parse(value).map_err(|e| ApiError::invalid(field, e.to_string()))
}

fn store_error(error: PoolStoreError) -> ApiError {
    match error {
        PoolStoreError::Invalid(invalid) => ApiError::invalid(invalid.field, invalid.message),
        PoolStoreError::Contended => {
            ApiError::new(StatusCode::CONFLICT, "Conflict", error.to_string())
        }
        other => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Store unavailable",
            other.to_string(),
        ),
    }
}

/// The pool as answered by the API: its spec flattened, its version, and when asked the live window.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The configuration.
    #[serde(flatten)]
    pub spec: PoolSpec,
    /// The configuration's version.
    pub version: u64,
    /// Last update, epoch ms.
    pub updated_at_ms: u64,
    /// The current window, on `GET /v1/pools/{tenant}/{pool}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<LiveWindow>,
}

/// A pool's current window.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveWindow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Tokens not yet granted.
    pub remaining: u64,
    /// Tokens granted per region.
    pub granted_by_region: std::collections::BTreeMap<RegionId, u64>,
    /// Leases of this window that have not expired.
    pub leases_outstanding: u64,
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

async fn put_pool(
    state: State<ApiState>,
    path: Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    to_completion(put_pool_change(state, path, headers, body)).await
}

async fn put_pool_change(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let spec: PoolSpec = parse_json(&headers, &body)?;
    let now_ms = state.clock.now_ms();
    let stored = pools::put_pool(&*state.kv, &tenant, &pool, spec, now_ms)
        .await
        .map_err(store_error)?;
    let config_json = serde_json::to_string(&stored.spec).unwrap_or_default();
    state
        .ledger
        .record_pool_change(&PoolChange {
            change_id: &change_id(now_ms),
            tenant: &tenant,
            pool: &pool,
            version: stored.version,
            actor: &credential.actor(),
            changed_at_ms: now_ms,
            config_json: &config_json,
        })
        .await
        .map_err(|e| unrecorded("pool history", "pool.put", &format!("{tenant}/{pool}"), e))?;
    audit(
        &state,
        &credential,
        "pool.put",
        format!("{tenant}/{pool}"),
        stored.version,
        serde_json::json!({ "config": stored.spec }),
    )
    .await?;
    tracing::info!(%tenant, %pool, version = stored.version, "pool configured");
    Ok(json_response(StatusCode::OK, &view(tenant, pool, stored)))
}

async fn get_pool(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let kv = &*state.kv;
    let (stored, _) = pools::get_pool(kv, &tenant, &pool)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "Not found", "no such pool"))?;
    let config = stored.spec.validate().map_err(|e| store_error(e.into()))?;
    let now_ms = state.clock.now_ms();
    let current = config.window_at(now_ms);
    let window = pools::get_window(kv, &tenant, &pool)
        .await
        .map_err(store_error)?
        .map(|(w, _)| w)
        .filter(|w| w.window == current)
        .unwrap_or_else(|| allot_shared::lease::PoolWindowState::fresh(current));
    let leases_outstanding = pools::list_grants(kv, &tenant, &pool)
        .await
        .map_err(store_error)?
        .iter()
        .filter(|g| g.window_start_ms == current.start_ms && g.expires_at_ms > now_ms)
        .count() as u64;
    let mut answer = view(tenant, pool, stored);
    answer.window = Some(LiveWindow {
        window_start_ms: current.start_ms,
        window_end_ms: current.end_ms,
        remaining: window.remaining_tokens(&config),
        granted_by_region: window.granted_by_region,
        leases_outstanding,
    });
    Ok(json_response(StatusCode::OK, &answer))
}

async fn delete_pool(
    state: State<ApiState>,
    path: Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    to_completion(delete_pool_change(state, path, headers)).await
}

async fn delete_pool_change(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    if !pools::delete_pool(&*state.kv, &tenant, &pool)
        .await
        .map_err(store_error)?
    {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "Not found",
            "no such pool",
        ));
    }
    let now_ms = state.clock.now_ms();
    state
        .ledger
        .record_pool_change(&PoolChange {
            change_id: &change_id(now_ms),
            tenant: &tenant,
            pool: &pool,
            version: 0,
            actor: &credential.actor(),
            changed_at_ms: now_ms,
            config_json: "{}",
        })
        .await
        .map_err(|e| {
            unrecorded(
                "pool history",
                "pool.delete",
                &format!("{tenant}/{pool}"),
                e,
            )
        })?;
    audit(
        &state,
        &credential,
        "pool.delete",
        format!("{tenant}/{pool}"),
        0,
        serde_json::json!({}),
    )
    .await?;
    tracing::info!(%tenant, %pool, "pool deleted");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /v1/pools/{tenant}/{pool}/terms` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TermsQuery {
    region: Option<String>,
}

async fn get_pool_terms(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    query: Result<axum::extract::Query<TermsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Reader)?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::invalid("region", e.body_text()))?;
    let region = query
        .region
        .as_deref()
        .map(|region| parse_id("region", region, RegionId::parse))
        .transpose()?;
    if let Some(region) = &region {
        check_region(&credential, region)?;
    }
    let (stored, _) = pools::get_pool(&*state.kv, &tenant, &pool)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "Not found", "no such pool"))?;
    let spec = stored.spec;
    let fallback_in_window = match (&region, std::num::NonZeroU64::new(spec.window_ms)) {
        (Some(region), Some(window_ms)) => {
            let window = allot_shared::window::Window::containing(state.clock.now_ms(), window_ms);
            let admitted = state
                .ledger
                .fallback_admitted(&tenant, &pool, region, window.start_ms)
                .await
                .map_err(ledger_error)?;
            Some(FallbackInWindow {
                window_start_ms: window.start_ms,
                admitted,
            })
        }
        _ => None,
    };
    let terms = PoolTerms {
        limit: spec.limit,
        window_ms: spec.window_ms,
        chunk: spec.chunk,
        lease_ttl_ms: spec.lease_ttl_ms,
        fallback_per_region: spec.fallback_per_region,
        regions: spec.regions,
        version: stored.version,
        fallback_in_window,
    };
    Ok(json_response(StatusCode::OK, &terms))
}

/// `GET /v1/pools` answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct PoolList {
    /// Every pool, without live windows.
    pub pools: Vec<PoolView>,
}

async fn list_pools(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let pools = pools::list_pools(&*state.kv)
        .await
        .map_err(store_error)?
        .into_iter()
        .map(|(tenant, pool, stored)| view(tenant, pool, stored))
        .collect();
    Ok(json_response(StatusCode::OK, &PoolList { pools }))
}

/// `POST /v1/grants` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantBody {
    /// Idempotency key, a UUID v7.
    pub lease_id: LeaseId,
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The asking region.
    pub region: RegionId,
    /// Tokens wanted.
    pub want: u64,
}

async fn post_grant(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let body: GrantBody = parse_json(&headers, &body)?;
    check_region(&credential, &body.region)?;
    if body.want == 0 {
        return Err(ApiError::invalid("want", "must be at least 1"));
    }
    let request = GrantRequest {
        lease_id: body.lease_id,
        region: body.region,
        want_tokens: body.want,
    };
    match state.grantor.grant(&body.tenant, &body.pool, request).await {
        Ok(record) => Ok(json_response(StatusCode::OK, &record)),
        Err(failure) => Err(grant_error(failure)),
    }
}

fn grant_error(failure: GrantFailure) -> ApiError {
    let detail = failure.to_string();
    match failure {
        GrantFailure::NotLeader(leader) => {
            let mut error =
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "Not the leader", detail);
            if let Some(leader) = leader {
                error.problem = Box::new(
                    error
                        .problem
                        .with_extension("leader", leader.advertise_url)
                        .with_extension("leaderEpoch", leader.epoch.0),
                );
            }
            error
        }
        GrantFailure::UnknownPool => ApiError::new(StatusCode::NOT_FOUND, "Not found", detail),
        GrantFailure::RegionNotInPool(_) => {
            let mut error = ApiError::new(StatusCode::FORBIDDEN, "Forbidden", detail);
            error.problem = Box::new(error.problem.with_field("region"));
            error
        }
        GrantFailure::ZeroWant => ApiError::invalid("want", detail),
        GrantFailure::Overloaded | GrantFailure::Unavailable(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "Unavailable", detail)
        }
    }
}

fn change_id(now_ms: u64) -> String {
    LeaseId::from_parts(now_ms, rand::random::<u128>()).to_string()
}

fn ledger_error(error: LedgerError) -> ApiError {
    match error {
        LedgerError::Invalid { field, message } => ApiError::invalid(field, message),
        other => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Ledger unavailable",
            other.to_string(),
        ),
    }
}

async fn post_report(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let report: Report = parse_json(&headers, &body)?;
    check_region(&credential, &report.region)?;
    // Grants reach the ledger asynchronously and a report may overtake them. etcd is the authority:
    // copy what the ledger lacks from there before checking the report against it.
    let ids: Vec<LeaseId> = report.leases.iter().map(|l| l.lease_id).collect();
    let missing = state
        .ledger
        .missing_grants(&ids)
        .await
        .map_err(ledger_error)?;
    let mut found = Vec::new();
    for lease in missing {
        if let Some(record) = pools::get_grant(&*state.kv, &report.tenant, &report.pool, &lease)
            .await
            .map_err(store_error)?
        {
            found.push(record);
        }
    }
    if !found.is_empty() {
        state
            .ledger
            .record_grants(&report.tenant, &report.pool, &found)
            .await
            .map_err(ledger_error)?;
    }
    let receipt = state
        .ledger
        .record_report(&report, state.clock.now_ms())
        .await
        .map_err(ledger_error)?;
    Ok(json_response(StatusCode::OK, &receipt))
}

/// `GET /v1/pools/{tenant}/{pool}/windows` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowsQuery {
    /// How many of the latest windows (default 10, at most 1,000).
    pub last: Option<u64>,
}

/// `GET /v1/pools/{tenant}/{pool}/windows` answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct WindowList {
    /// Newest first.
    pub windows: Vec<crate::ledger::WindowRow>,
}

async fn get_windows(
    State(state): State<ApiState>,
    Path((tenant, pool)): Path<(String, String)>,
    query: Result<axum::extract::Query<WindowsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let (tenant, pool) = pool_path(&tenant, &pool)?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::invalid("last", e.body_text()))?;
    let last = query.last.unwrap_or(10);
    if !(1..=crate::ledger::MAX_WINDOWS).contains(&last) {
        return Err(ApiError::invalid("last", "must be in [1, 1000]"));
    }
    let (stored, _) = pools::get_pool(&*state.kv, &tenant, &pool)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "Not found", "no such pool"))?;
    let config = stored.spec.validate().map_err(|e| store_error(e.into()))?;
    let windows = state
        .ledger
        .windows(&tenant, &pool, &config, last, state.clock.now_ms())
        .await
        .map_err(ledger_error)?;
    Ok(json_response(StatusCode::OK, &WindowList { windows }))
}

fn policy_error(error: PolicyStoreError) -> ApiError {
    match error {
        PolicyStoreError::Invalid(invalid) => {
            let detail = invalid.to_string();
            // The bundle parser names the document's root `$`; the API calls it the body.
            let field = match invalid.field.as_str() {
                "$" | "" => "body".to_owned(),
                _ => invalid.field.to_string(),
            };
            ApiError::invalid(field, detail)
        }
        PolicyStoreError::UnknownVersion(_) | PolicyStoreError::NothingCurrent => {
            ApiError::new(StatusCode::NOT_FOUND, "Not found", error.to_string())
        }
        PolicyStoreError::Contended => {
            ApiError::new(StatusCode::CONFLICT, "Conflict", error.to_string())
        }
        other => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Store unavailable",
            other.to_string(),
        ),
    }
}

fn parse_version(text: &str) -> Result<u64, ApiError> {
    text.parse::<u64>()
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| ApiError::invalid("version", "must be a positive integer"))
}

fn bundle_response(bundle: &allot_shared::policy::PolicyBundle) -> Response {
    let mut response = json_response(StatusCode::OK, &bundle.to_json());
    if let Ok(etag) = HeaderValue::from_str(&format!("\"{}\"", bundle.checksum())) {
        response.headers_mut().insert(header::ETAG, etag);
    }
    response
}

/// `PUT /v1/policies` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishQuery {
    /// Comma-separated regions to stage the bundle to before everyone.
    pub canary: Option<String>,
}

async fn put_policy(
    state: State<ApiState>,
    query: Result<axum::extract::Query<PublishQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    to_completion(put_policy_change(state, query, headers, body)).await
}

async fn put_policy_change(
    State(state): State<ApiState>,
    query: Result<axum::extract::Query<PublishQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::invalid("canary", e.body_text()))?;
    let canary = query
        .canary
        .map(|list| {
            list.split(',')
                .map(|r| parse_id("canary", r.trim(), RegionId::parse))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let text = std::str::from_utf8(&body).map_err(|_| ApiError::invalid("body", "not UTF-8"))?;
    let draft = parse_bundle(text).map_err(|e| policy_error(e.into()))?;
    let now_ms = state.clock.now_ms();
    let published_at = allot_shared::window::rfc3339_utc(now_ms);
    let bundle = policies::publish(&*state.kv, draft, published_at, canary)
        .await
        .map_err(policy_error)?;
    state
        .ledger
        .record_bundle(&bundle, &credential.actor(), now_ms)
        .await
        .map_err(|e| {
            unrecorded(
                "bundle record",
                "policy.publish",
                &bundle.version().to_string(),
                e,
            )
        })?;
    audit(
        &state,
        &credential,
        "policy.publish",
        bundle.version().to_string(),
        bundle.version(),
        serde_json::json!({ "checksum": bundle.checksum() }),
    )
    .await?;
    tracing::info!(
        version = bundle.version(),
        checksum = bundle.checksum(),
        "policy published"
    );
    Ok(bundle_response(&bundle))
}

/// `GET /v1/policies/current` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurrentQuery {
    /// The asking region: a canary region gets the staged bundle.
    pub region: Option<String>,
}

async fn get_current_policy(
    State(state): State<ApiState>,
    query: Result<axum::extract::Query<CurrentQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Reader)?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::invalid("region", e.body_text()))?;
    let region = query
        .region
        .map(|r| parse_id("region", &r, RegionId::parse))
        .transpose()?;
    if let Some(region) = &region {
        check_region(&credential, region)?;
    }
    let bundle = policies::current_for(&*state.kv, region.as_ref())
        .await
        .map_err(policy_error)?;
    Ok(bundle_response(&bundle))
}

async fn get_policy_version(
    State(state): State<ApiState>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Reader)?;
    let version = parse_version(&version)?;
    let bundle = policies::get_bundle(&*state.kv, version)
        .await
        .map_err(policy_error)?;
    Ok(bundle_response(&bundle))
}

async fn promote_policy(
    state: State<ApiState>,
    path: Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    to_completion(promote_policy_change(state, path, headers)).await
}

async fn promote_policy_change(
    State(state): State<ApiState>,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let version = parse_version(&version)?;
    let rollout = policies::promote(&*state.kv, version)
        .await
        .map_err(policy_error)?;
    audit(
        &state,
        &credential,
        "policy.promote",
        version.to_string(),
        version,
        serde_json::json!({}),
    )
    .await?;
    tracing::info!(version, "policy promoted");
    Ok(json_response(StatusCode::OK, &rollout))
}

async fn post_agent_status(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let mut status: AgentStatus = parse_json(&headers, &body)?;
    check_region(&credential, &status.region)?;
    let valid_agent = !status.agent_id.is_empty()
        && status.agent_id.len() <= 64
        && status
            .agent_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !valid_agent {
        return Err(ApiError::invalid(
            "agentId",
            "must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'",
        ));
    }
    if let Some(fingerprint) = &status.pepper_fingerprint
        && !(fingerprint.len() == 8
            && fingerprint
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    {
        return Err(ApiError::invalid(
            "pepperFingerprint",
            "must be 8 lowercase hex digits",
        ));
    }
    status.reported_at_ms = state.clock.now_ms();
    policies::report_agent(
        &*state.kv,
        &status,
        &state.status_leases,
        status.reported_at_ms,
    )
    .await
    .map_err(policy_error)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /v1/policies/status` answer: the rollout and what every live agent runs.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// What regions should run.
    pub rollout: policies::Rollout,
    /// Agents that reported recently.
    pub agents: Vec<AgentStatus>,
    /// Lowest version an agent runs.
    pub min_version: Option<u64>,
    /// Highest version an agent runs.
    pub max_version: Option<u64>,
    /// Agents running something else than what their region should run.
    pub agents_behind: usize,
    /// The pepper fingerprints live agents report, by region: more than one in a region means its
    /// agents key principals differently (each principal's buckets split), expected only while a
    /// pepper rotation rolls out.
    pub pepper_fingerprints:
        std::collections::BTreeMap<RegionId, std::collections::BTreeSet<String>>,
}

async fn get_policy_status(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let rollout = policies::rollout(&*state.kv).await.map_err(policy_error)?;
    let agents = policies::agent_statuses(&*state.kv, state.clock.now_ms())
        .await
        .map_err(policy_error)?;
    let agents_behind = agents
        .iter()
        .filter(|a| a.version != rollout.version_for(Some(&a.region)))
        .count();
    let status = PolicyStatus {
        pepper_fingerprints: policies::pepper_fingerprints(&agents),
        min_version: agents.iter().map(|a| a.version).min(),
        max_version: agents.iter().map(|a| a.version).max(),
        agents_behind,
        rollout,
        agents,
    };
    Ok(json_response(StatusCode::OK, &status))
}

/// `POST /v1/tokens` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MintBody {
    /// `viewer`, `author`, `admin` or `agent`.
    pub role: String,
    /// The region an agent token is scoped to (required for `agent`, refused otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// A name for humans (at most 64 characters).
    #[serde(default)]
    pub name: String,
}

/// A token as listed: never the token, never its digest.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenView {
    /// `file-<hex>` (from a token file) or `tok-<hex>` (minted).
    pub id: String,
    /// `viewer`, `author`, `admin` or `agent`.
    pub role: String,
    /// An agent token's region (absent: any region, file tokens only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<RegionId>,
    /// `file` or `store`.
    pub source: String,
    /// A minted token's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// When a minted token was minted, epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at_ms: Option<u64>,
    /// Who minted it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_by: Option<String>,
}

impl TokenView {
    fn of_record(record: &auth::StoredToken) -> Self {
        Self {
            id: record.id.clone(),
            role: record.role.clone(),
            region: record.region.clone(),
            source: "store".to_owned(),
            name: record.name.clone(),
            created_at_ms: Some(record.created_at_ms),
            created_by: Some(record.created_by.clone()),
        }
    }
}

/// `POST /v1/tokens` answer: the token is shown once and never again.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MintAnswer {
    /// The token's listing.
    #[serde(flatten)]
    pub view: TokenView,
    /// The bearer token.
    pub token: String,
}

/// `GET /v1/tokens` answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct TokenList {
    /// File tokens first, then minted ones.
    pub tokens: Vec<TokenView>,
}

fn token_store_error(error: TokenStoreError) -> ApiError {
    match error {
        TokenStoreError::Full => ApiError::new(StatusCode::CONFLICT, "Conflict", error.to_string()),
        other => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Store unavailable",
            other.to_string(),
        ),
    }
}

async fn post_token(
    state: State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    to_completion(post_token_change(state, headers, body)).await
}

async fn post_token_change(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Admin))?;
    let body: MintBody = parse_json(&headers, &body)?;
    let region = body
        .region
        .as_deref()
        .map(|region| parse_id("region", region, RegionId::parse))
        .transpose()?;
    let holder = match (body.role.as_str(), region) {
        ("agent", Some(region)) => Holder::Agent(Some(region)),
        ("agent", None) => {
            return Err(ApiError::invalid(
                "region",
                "an agent token must be scoped to a region",
            ));
        }
        (role, None) => Holder::Operator(OperatorRole::parse(role).ok_or_else(|| {
            ApiError::invalid("role", "must be one of viewer, author, admin, agent")
        })?),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "region",
                "only agent tokens are scoped to a region",
            ));
        }
    };
    if body.name.chars().count() > auth::MAX_TOKEN_NAME_LEN
        || body.name.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(
            "name",
            "must be at most 64 characters, without control characters",
        ));
    }
    let minted = auth::mint_token(
        &*state.kv,
        &holder,
        &body.name,
        &credential.actor(),
        state.clock.now_ms(),
    )
    .await
    .map_err(token_store_error)?;
    if let Err(error) = auth::refresh(&*state.kv, &state.tokens).await {
        tracing::warn!(%error, "minted token not yet visible here; the next refresh will pick it up");
    }
    audit(
        &state,
        &credential,
        "token.mint",
        minted.record.id.clone(),
        0,
        serde_json::json!({ "role": minted.record.role, "region": minted.record.region }),
    )
    .await?;
    tracing::info!(id = %minted.record.id, role = %minted.record.role, "token minted");
    let answer = MintAnswer {
        view: TokenView::of_record(&minted.record),
        token: minted.token,
    };
    Ok(json_response(StatusCode::CREATED, &answer))
}

async fn list_tokens(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Admin))?;
    let mut tokens: Vec<TokenView> = state
        .tokens
        .file_credentials()
        .into_iter()
        .map(|credential| TokenView {
            role: credential.holder.kind().to_owned(),
            region: match credential.holder {
                Holder::Agent(region) => region,
                Holder::Operator(_) => None,
            },
            id: credential.id,
            source: "file".to_owned(),
            name: String::new(),
            created_at_ms: None,
            created_by: None,
        })
        .collect();
    let stored = auth::list_stored_tokens(&*state.kv)
        .await
        .map_err(token_store_error)?;
    tokens.extend(stored.iter().map(TokenView::of_record));
    Ok(json_response(StatusCode::OK, &TokenList { tokens }))
}

async fn delete_token(
    state: State<ApiState>,
    path: Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    to_completion(delete_token_change(state, path, headers)).await
}

async fn delete_token_change(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Admin))?;
    let well_formed = id
        .strip_prefix("tok-")
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if id.starts_with("file-") {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            "this token comes from a token file: remove its line and restart the allocator",
        ));
    }
    if !well_formed {
        return Err(ApiError::invalid("id", "must be tok- and 16 hex digits"));
    }
    let Some(record) = auth::revoke_token(&*state.kv, &id)
        .await
        .map_err(token_store_error)?
    else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "Not found",
            "no such token",
        ));
    };
    if let Err(error) = auth::refresh(&*state.kv, &state.tokens).await {
        tracing::warn!(%error, "revoked token still known here until the next refresh");
    }
    audit(
        &state,
        &credential,
        "token.revoke",
        record.id.clone(),
        0,
        serde_json::json!({ "role": record.role, "region": record.region }),
    )
    .await?;
    tracing::info!(id = %record.id, "token revoked");
    Ok(StatusCode::NO_CONTENT.into_response())
}

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

async fn get_audit(
    State(state): State<ApiState>,
    query: Result<axum::extract::Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let axum::extract::Query(query) =
        query.map_err(|e| ApiError::invalid("last", e.body_text()))?;
    let last = query.last.unwrap_or(50);
    if !(1..=crate::ledger::MAX_AUDIT_ENTRIES).contains(&last) {
        return Err(ApiError::invalid("last", "must be in [1, 1000]"));
    }
    let entries = state
        .ledger
        .audit_entries(last)
        .await
        .map_err(ledger_error)?;
    Ok(json_response(StatusCode::OK, &AuditList { entries }))
}

async fn metrics_text() -> Response {
    match crate::metrics::handle() {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Metrics unavailable",
            "another metrics recorder is installed in this process",
        )
        .into_response(),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<ApiState>) -> Response {
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

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "Not found", "no such endpoint")
}

/// The API router with its bounds.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/v1/pools", get(list_pools))
        .route(
            "/v1/pools/{tenant}/{pool}",
            get(get_pool).put(put_pool).delete(delete_pool),
        )
        .route("/v1/pools/{tenant}/{pool}/windows", get(get_windows))
        .route("/v1/pools/{tenant}/{pool}/terms", get(get_pool_terms))
        .route("/v1/grants", post(post_grant))
        .route("/v1/reports", post(post_report))
        .route("/v1/policies", axum::routing::put(put_policy))
        .route("/v1/policies/current", get(get_current_policy))
        .route(
            "/v1/policies/status",
            get(get_policy_status).post(post_agent_status),
        )
        .route("/v1/policies/{version}", get(get_policy_version))
        .route("/v1/policies/{version}/promote", post(promote_policy))
        .route("/v1/tokens", get(list_tokens).post(post_token))
        .route("/v1/tokens/{id}", axum::routing::delete(delete_token))
        .route("/v1/audit", get(get_audit))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            MAX_CONCURRENT_REQUESTS,
        ))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            REQUEST_TIMEOUT,
        ))
        // Outermost, so it also sees what the layers above answer on their own.
        .layer(axum::middleware::map_response(
            allot_net::problem_for_plain_errors,
        ))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_entry_ids_sort_in_write_order() {
        // Many in one millisecond, then the clock stepping back: still increasing.
        let mut ids: Vec<String> = (0..5_000).map(|_| audit_entry_id(1_000_000)).collect();
        ids.push(audit_entry_id(999_000));
        ids.push(audit_entry_id(2_000_000));
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    }
}
