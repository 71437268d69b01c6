//! The gateway API's handlers, what they share, and the refusals every call can get.

use std::sync::Arc;
use std::time::Duration;

use allot_shared::FieldError;
use allot_shared::contract::{
    AdmissionRequest, Decision, PROBLEM_CONTENT_TYPE, PrincipalType, Problem, QuotaQuery,
    QuotaStatus, SettleAnswer, SettleRequest, SlotRenewal, http_status, retry_after_header,
};
use allot_shared::ids::{DecisionId, PoolId, RouteGroup, TenantId};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::service::Agent;
use crate::service::settlement::SettleError;

/// The response header of `/v1/check` that carries a metered admission's settle deadline, epoch
/// ms.
pub const SETTLE_BY_HEADER: &str = "x-allot-settle-by-ms";

/// The response header of `/v1/auth-request` that carries, on a denial, the status the caller
/// should see (429 or 503).
pub const AUTH_REQUEST_STATUS_HEADER: &str = "x-allot-status";

/// Largest admission request body, in bytes.
pub const MAX_BODY_BYTES: usize = 16 * 1024;
/// Longest a request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Most requests served at once.
pub const MAX_CONCURRENT_REQUESTS: usize = 4_096;

/// What the handlers share.
#[derive(Clone)]
pub struct AgentApi {
    /// The agent.
    pub agent: Arc<Agent>,
    /// Bearer tokens gateways present.
    pub gateway_tokens: Arc<Vec<String>>,
    /// The Prometheus registry to render at `/metrics` (none: `/metrics` answers 404).
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

fn problem(status: StatusCode, problem: Problem) -> Response {
    let mut response = (status, serde_json::to_vec(&problem).unwrap_or_default()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
    );
    response
}

fn invalid(field: &str, detail: &str) -> Response {
    problem(
        StatusCode::BAD_REQUEST,
        Problem::new(400, "Invalid request", detail).with_field(field),
    )
}

/// Whether `token` is one of the gateway tokens. Every candidate is compared in full, so the time
/// taken does not reveal which one matched (or how much of one).
pub fn token_known(tokens: &[String], token: &str) -> bool {
    let known = tokens.iter().fold(false, |found, candidate| {
        found
            | (candidate.len() == token.len()
                && candidate
                    .bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0)
    });
    known && !token.is_empty()
}

fn authorized(api: &AgentApi, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or_default();
    if token_known(&api.gateway_tokens, token) {
        return Ok(());
    }
    Err(Box::new(problem(
        StatusCode::UNAUTHORIZED,
        Problem::new(
            401,
            "Unauthorized",
            "send Authorization: Bearer <gateway token>",
        ),
    )))
}

/// A call with a JSON body: from a known gateway ([`authorized`]), and the body read as `T`
/// ([`parse`]); or the refusal to answer.
fn authorized_json<T: serde::de::DeserializeOwned>(
    api: &AgentApi,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<T, Box<Response>> {
    authorized(api, headers)?;
    parse(headers, body)
}

fn parse<T: serde::de::DeserializeOwned>(
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<T, Box<Response>> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !is_json {
        return Err(Box::new(problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Problem::new(415, "Unsupported media type", "send application/json"),
        )));
    }
    FieldError::parse_json(body, "body")
        .map_err(|named| Box::new(invalid(&named.field, &named.message)))
}

/// Decides a request; the decision is the answer, whatever it says.
#[utoipa::path(post, path = "/v1/admit", tag = "gateway",
    request_body = AdmissionRequest,
    responses(
        (status = 200, description = "The decision, allowed or not", body = Decision),
        CallRefused,
        BodyRefused,
    ))]
pub(crate) async fn admit(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: AdmissionRequest = match authorized_json(&api, &headers, &body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    match api.agent.admit(&request).await {
        Ok(decision) => {
            let mut response = (
                StatusCode::OK,
                serde_json::to_vec(&decision).unwrap_or_default(),
            )
                .into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(rejected) => invalid(&rejected.field, &rejected.message),
    }
}

/// Builds an admission request from `X-Allot-*` headers, for proxies that cannot send a body:
/// `X-Allot-Request-Id`, `X-Allot-Tenant`, `X-Allot-Principal-Type`, `X-Allot-Principal-Id`,
/// `X-Allot-Route-Group` (required), `X-Allot-Api-Key-Id`, `X-Allot-Method` (default GET),
/// `X-Allot-Cost` (default 1) and `X-Allot-Metered` (`true` or `false`, the default).
fn from_headers(headers: &HeaderMap) -> Result<AdmissionRequest, Box<Response>> {
    // Bytes past ASCII are read as ISO-8859-1, as HTTP has always read them, so every value has
    // one reading and two different values never read the same.
    let get = |name: &str| {
        headers.get(name).map(|v| {
            v.as_bytes()
                .iter()
                .map(|&b| char::from(b))
                .collect::<String>()
        })
    };
    let required = |name: &'static str| {
        get(name).ok_or_else(|| Box::new(invalid(name, "is required without a JSON body")))
    };
    let metered = match get("x-allot-metered").as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(Box::new(invalid(
                "x-allot-metered",
                "must be true or false",
            )));
        }
    };
    let cost = match get("x-allot-cost") {
        None => 1,
        Some(text) => text
            .parse::<u64>()
            .map_err(|_| Box::new(invalid("x-allot-cost", "must be a positive integer")))?,
    };
    let request_id = required("x-allot-request-id")?;
    let tenant = required("x-allot-tenant")?;
    let mut principal = serde_json::json!({
        "type": required("x-allot-principal-type")?,
        "id": required("x-allot-principal-id")?,
    });
    if let Some(key) = get("x-allot-api-key-id") {
        principal["apiKeyId"] = serde_json::Value::String(key);
    }
    let value = serde_json::json!({
        "requestId": request_id,
        "tenantId": tenant,
        "principal": principal,
        "routeGroup": required("x-allot-route-group")?,
        "method": get("x-allot-method").unwrap_or_else(|| "GET".to_owned()),
        "costHint": cost,
        "metered": metered,
    });
    // As `FieldError::parse_json`: plainly first, and with the path (a string per field) only to
    // name the header of a request that fails.
    if let Ok(request) = <AdmissionRequest as serde::Deserialize>::deserialize(&value) {
        return Ok(request);
    }
    serde_path_to_error::deserialize(&value).map_err(|error| {
        Box::new(invalid(
            header_of(&error.path().to_string()),
            &error.into_inner().to_string(),
        ))
    })
}

/// The `X-Allot-*` header a field of the admission request comes from, for errors about a request
/// read from headers (the field's own name when no header carries it).
fn header_of(field: &str) -> &str {
    match field {
        "requestId" => "x-allot-request-id",
        "tenantId" => "x-allot-tenant",
        "principal.type" => "x-allot-principal-type",
        "principal.id" => "x-allot-principal-id",
        "principal.apiKeyId" => "x-allot-api-key-id",
        "routeGroup" => "x-allot-route-group",
        "method" => "x-allot-method",
        "costHint" => "x-allot-cost",
        "metered" => "x-allot-metered",
        other => other,
    }
}

/// Decides a request and answers as a proxy should: 200, or the caller's refusal. The request may
/// come as `X-Allot-*` headers instead of a body (see `/v1/auth-request`).
#[utoipa::path(post, path = "/v1/check", tag = "gateway",
    request_body = AdmissionRequest,
    responses(
        (status = 200, description = "Admitted; `RateLimit-Policy` and `RateLimit` when the caller may see its limit",
            headers(("ratelimit-policy" = String), ("ratelimit" = String), ("x-allot-settle-by-ms" = u64))),
        (status = 429, description = "A limit said no; `Retry-After` in whole seconds unless it never will",
            body = Problem, content_type = "application/problem+json", headers(("retry-after" = u64))),
        (status = 503, description = "A fail-closed rule could not be decided", body = Problem, content_type = "application/problem+json",
            headers(("retry-after" = u64))),
        CallRefused,
        BodyRefused,
    ))]
pub(crate) async fn check(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(response) = authorized(&api, &headers) {
        return *response;
    }
    let from_header_fields = body.is_empty() && headers.contains_key("x-allot-request-id");
    let parsed = if from_header_fields {
        from_headers(&headers)
    } else {
        parse(&headers, &body)
    };
    let request = match parsed {
        Ok(request) => request,
        Err(response) => return *response,
    };
    let decision = match api.agent.admit(&request).await {
        Ok(decision) => decision,
        Err(rejected) if from_header_fields => {
            return invalid(header_of(&rejected.field), &rejected.message);
        }
        Err(rejected) => return invalid(&rejected.field, &rejected.message),
    };
    let mut response = if decision.allowed {
        StatusCode::OK.into_response()
    } else {
        problem(
            denial_status(&decision),
            Problem::for_denial(&decision, request.principal.kind),
        )
    };
    add_decision_headers(&api, &request, &decision, response.headers_mut());
    response
}

/// The status a proxy answers a denial with: 429, or 503 when a fail-closed rule could not decide.
fn denial_status(decision: &Decision) -> StatusCode {
    StatusCode::from_u16(http_status(decision)).unwrap_or(StatusCode::TOO_MANY_REQUESTS)
}

/// `GET /v1/auth-request`: for nginx's `auth_request`, which knows three answers only: 2xx
/// lets the request through, 401 and 403 refuse it with that status, and anything else is an
/// error (nginx answers 500). So an admission answers 204; a denial answers 403 with the status
/// the caller should see in `X-Allot-Status` (429 or 503) beside `Retry-After`, which the shipped
/// configuration (`deploy/nginx/`) turns into that answer. The request comes from `X-Allot-*`
/// headers only (nginx sends no body), as for [`check`]. A wrong gateway token still answers 401
/// and bad input 400: the configuration maps both to errors, never to an admission.
#[utoipa::path(get, path = "/v1/auth-request", tag = "gateway",
    params(
        ("x-allot-request-id" = DecisionId, Header, description = "Unique per request, stable across retries"),
        ("x-allot-tenant" = TenantId, Header, description = "The verified tenant"),
        ("x-allot-principal-type" = PrincipalType, Header, description = "user, api_key or ip"),
        ("x-allot-principal-id" = String, Header, min_length = 1, max_length = 256,
            description = "The verified principal"),
        ("x-allot-route-group" = RouteGroup, Header, description = "The request's route group"),
        ("x-allot-method" = Option<String>, Header, nullable = false, pattern = "^[A-Z]{1,16}$",
            description = "The request's method (GET)"),
        ("x-allot-cost" = Option<u64>, Header, nullable = false, minimum = 1, maximum = 1_073_741_824,
            description = "Cost in whole units (1)"),
        ("x-allot-metered" = Option<bool>, Header, nullable = false, description = "Charge the cost as an estimate (false)"),
        ("x-allot-api-key-id" = Option<String>, Header, nullable = false, min_length = 1, max_length = 256,
            description = "The API key the request came with"),
    ),
    responses(
        (status = 204, description = "Admitted", headers(("ratelimit-policy" = String), ("ratelimit" = String))),
        (status = 403, description = "Refused: `X-Allot-Status` says how to answer the caller (429 or 503)",
            body = Problem, content_type = "application/problem+json", headers(("x-allot-status" = u16), ("retry-after" = u64))),
        CallRefused,
    ))]
pub(crate) async fn auth_request(State(api): State<AgentApi>, headers: HeaderMap) -> Response {
    if let Err(response) = authorized(&api, &headers) {
        return *response;
    }
    let request = match from_headers(&headers) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    let decision = match api.agent.admit(&request).await {
        Ok(decision) => decision,
        Err(rejected) => return invalid(header_of(&rejected.field), &rejected.message),
    };
    let mut response = if decision.allowed {
        StatusCode::NO_CONTENT.into_response()
    } else {
        // The body (the denial as `/v1/check` words it) is for people reading the exchange;
        // nginx drops it.
        let mut refused = problem(
            StatusCode::FORBIDDEN,
            Problem::for_denial(&decision, request.principal.kind),
        );
        refused.headers_mut().insert(
            AUTH_REQUEST_STATUS_HEADER,
            HeaderValue::from(denial_status(&decision).as_u16()),
        );
        refused
    };
    add_decision_headers(&api, &request, &decision, response.headers_mut());
    response
}

/// What a proxy passes on about a decision: `Retry-After` on a denial with a finite hint, a
/// metered admission's settle deadline, and what the caller may be told of its limits (RateLimit
/// fields, soft-limit and shadow notes), from one look at the bundle in force.
fn add_decision_headers(
    api: &AgentApi,
    request: &AdmissionRequest,
    decision: &Decision,
    headers: &mut HeaderMap,
) {
    if let Some(seconds) = retry_after_header(decision) {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if let Some(settle_by_ms) = decision.settle_by_ms {
        headers.insert(SETTLE_BY_HEADER, HeaderValue::from(settle_by_ms));
    }
    let Some(bundle) = api.agent.bundle() else {
        return;
    };
    let kind = request.principal.kind;
    let (soft, shadow) = crate::visibility::violation_headers(&bundle, kind, decision);
    let pool_window_ms = |pool: &PoolId| api.agent.pool_window_ms(&request.tenant_id, pool);
    let (policy, current) =
        crate::visibility::rate_limit_headers(&bundle, kind, decision, &pool_window_ms);
    for (name, value) in [
        (crate::visibility::SOFT_LIMIT_HEADER, soft),
        (crate::visibility::SHADOW_DENIED_HEADER, shadow),
        ("ratelimit-policy", policy),
        ("ratelimit", current),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_str(&v).ok()) {
            headers.insert(name, value);
        }
    }
}

/// The caller's own quotas and what is left of them (only the rules it may see).
#[utoipa::path(get, path = "/v1/quota", tag = "gateway",
    params(QuotaQuery),
    responses(
        (status = 200, description = "The caller's quotas", body = QuotaStatus),
        (status = 503, description = "No policy bundle yet", body = Problem, content_type = "application/problem+json"),
        CallRefused,
    ))]
pub(crate) async fn quota(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    if let Err(response) = authorized(&api, &headers) {
        return *response;
    }
    let query: QuotaQuery =
        match FieldError::parse_query(query.as_deref().unwrap_or_default(), "query") {
            Ok(query) => query,
            Err(named) => return invalid(&named.field, &named.message),
        };
    let status = match api.agent.quota(&query).await {
        Ok(Some(status)) => status,
        Ok(None) => {
            metrics::counter!(crate::metrics::QUOTA_READS, "outcome" => "refused").increment(1);
            return problem(
                StatusCode::SERVICE_UNAVAILABLE,
                Problem::new(503, "No policy yet", "the agent has no policy bundle yet"),
            );
        }
        Err(rejected) => return invalid(&rejected.field, &rejected.message),
    };
    metrics::counter!(crate::metrics::QUOTA_READS, "outcome" => "answered").increment(1);
    let mut response = axum::Json(status).into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// States the actual cost of a metered admission (idempotent by decision id).
#[utoipa::path(post, path = "/v1/settle", tag = "gateway",
    request_body = SettleRequest,
    responses(
        (status = 200, description = "How the difference was charged", body = SettleAnswer),
        (status = 404, description = "Nothing of that id is open for settlement", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Settled before with another cost", body = Problem, content_type = "application/problem+json"),
        CallRefused,
        BodyRefused,
    ))]
pub(crate) async fn settle(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: SettleRequest = match authorized_json(&api, &headers, &body) {
        Ok(body) => body,
        Err(response) => return *response,
    };
    match api.agent.settle(&body).await {
        Ok(answer) => (StatusCode::OK, axum::Json(answer)).into_response(),
        Err(SettleError::Invalid(rejected)) => invalid(&rejected.field, &rejected.message),
        Err(error @ SettleError::NotOpen) => problem(
            StatusCode::NOT_FOUND,
            Problem::new(404, "Not open for settlement", error.to_string())
                .with_field("decisionId"),
        ),
        Err(SettleError::Conflict(detail)) => problem(
            StatusCode::CONFLICT,
            Problem::new(409, "Settled differently", &detail).with_field("actualCost"),
        ),
    }
}

/// Gives back the concurrency slots a finished request holds (idempotent).
#[utoipa::path(post, path = "/v1/release", tag = "gateway",
    request_body = AdmissionRequest,
    responses(
        (status = 204, description = "Released (or nothing was held)"),
        CallRefused,
        BodyRefused,
    ))]
pub(crate) async fn release(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: AdmissionRequest = match authorized_json(&api, &headers, &body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    match api.agent.release(&request).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(rejected) => invalid(&rejected.field, &rejected.message),
    }
}

/// Extends the concurrency slots a running request holds (a heartbeat).
#[utoipa::path(post, path = "/v1/renew", tag = "gateway",
    request_body = AdmissionRequest,
    responses(
        (status = 200, description = "What the heartbeat did", body = SlotRenewal),
        CallRefused,
        BodyRefused,
    ))]
pub(crate) async fn renew(
    State(api): State<AgentApi>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: AdmissionRequest = match authorized_json(&api, &headers, &body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    match api.agent.renew(&request).await {
        Ok(renewal) => (StatusCode::OK, axum::Json(renewal)).into_response(),
        Err(rejected) => invalid(&rejected.field, &rejected.message),
    }
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "operations", security(()),
    responses(
        (status = 200, description = "The Prometheus text format", body = String, content_type = "text/plain"),
        (status = 404, description = "No metrics registry in this process", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn metrics_text(State(api): State<AgentApi>) -> Response {
    let Some(handle) = api.metrics.as_ref() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    api.agent.observe();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response()
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "operations", security(()),
    responses((status = 200, description = "Alive", body = String, content_type = "text/plain")))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// Readiness: ready once a policy bundle is in force.
#[utoipa::path(get, path = "/readyz", tag = "operations", security(()),
    responses(
        (status = 200, description = "Ready, and the policy version", body = String, content_type = "text/plain"),
        (status = 503, description = "No policy bundle yet", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn readyz(State(api): State<AgentApi>) -> Response {
    match api.agent.bundle() {
        Some(bundle) => (
            StatusCode::OK,
            format!("ready, policy version {}\n", bundle.version()),
        )
            .into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no policy bundle yet\n").into_response(),
    }
}

/// The refusals every gateway call can get.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum CallRefused {
    /// Bad input: problem+json naming the field (in the body, the query or a header) at fault.
    #[response(status = 400, content_type = "application/problem+json")]
    Invalid(#[to_schema] Problem),
    /// No gateway token, or an unknown one.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthorized(#[to_schema] Problem),
}

/// The refusals of a call's JSON body, beside [`CallRefused`]'s.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum BodyRefused {
    /// The body is larger than 16 KiB.
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(#[to_schema] Problem),
    /// The body is not `application/json`.
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(#[to_schema] Problem),
}
