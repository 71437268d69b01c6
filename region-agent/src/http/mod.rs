//! The gateway-facing HTTP API of the agent.
//!
//! - `POST /v1/admit`: the decision as JSON (an RPC: the answer is in the body, status 200).
//! - `POST /v1/check`: for proxies that want an HTTP answer (forward-auth style): 200 when allowed, 429
//!   with `Retry-After` when a limit says no, 503 when a fail-closed rule cannot be decided; the body is
//!   problem+json. Pre-authentication callers (principal type `ip`) get a plain 429 with no limits,
//!   names or counts.
//! - `GET /v1/quota?tenantId=&principalType=&principalId=[&routeGroup=]`: the caller's own quotas
//!   and what is left of them, for an API's rate limit status endpoint (only the rules the caller
//!   may see: [`crate::service::quota`]); 503 before the agent has a policy bundle.
//! - `POST /v1/admit` with `"dryRun": true` answers what a real request would get, spending nothing.
//! - `POST /v1/admit` with `"metered": true` charges `costHint` as an estimate; `POST /v1/settle`
//!   (`{decisionId, tenantId, actualCost}`) states the actual cost within the settle window
//!   ([`crate::service::settlement`]): 200 with how the difference was charged, 404 when nothing
//!   of that id is open, 409 when settled before with another cost. `/v1/check` answers a
//!   metered admission's deadline in `x-allot-settle-by-ms`.
//! - `GET /v1/auth-request`: `/v1/check` for nginx's `auth_request`,
//!   which passes on 2xx, 401 and 403 only: 204 when allowed, 403 with `X-Allot-Status: 429|503`
//!   and `Retry-After` when not; the request from `X-Allot-*` headers.
//! - `POST /v1/release`: the same request, when it has finished: gives back its concurrency slots
//!   (idempotent; a slot a gateway never releases lapses with its lease TTL).
//! - `/healthz`, `/readyz`, `/metrics`.
//!
//! Gateways authenticate with a bearer token; every request is bounded (body, time, concurrency).

pub(crate) mod gateway;

pub use gateway::{
    AUTH_REQUEST_STATUS_HEADER, AgentApi, MAX_BODY_BYTES, MAX_CONCURRENT_REQUESTS, REQUEST_TIMEOUT,
    SETTLE_BY_HEADER, token_known,
};
use gateway::{
    admit, auth_request, check, healthz, metrics_text, quota, readyz, release, renew, settle,
};

use axum::Router;
use axum::routing::{get, post};

/// The agent's router with its bounds.
pub fn router(api: AgentApi) -> Router {
    let routes = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .route("/v1/admit", post(admit))
        .route("/v1/check", post(check))
        .route("/v1/auth-request", get(auth_request))
        .route("/v1/quota", get(quota))
        .route("/v1/settle", post(settle))
        .route("/v1/release", post(release))
        .route("/v1/renew", post(renew));
    allot_net::bounded_router(
        routes,
        allot_net::RouterLimits {
            max_body_bytes: MAX_BODY_BYTES,
            max_concurrent_requests: MAX_CONCURRENT_REQUESTS,
            request_timeout: REQUEST_TIMEOUT,
        },
    )
    .with_state(api)
}

/// Serves gateways on `listener` (through TLS when `tls` is given) until `shutdown` resolves,
/// finishing requests in flight. Connections, handshakes and header reads are bounded
/// ([`allot_net::ServeLimits`]).
pub async fn serve(
    listener: impl Into<allot_net::Listener>,
    api: AgentApi,
    tls: Option<allot_net::TlsServing>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    allot_net::serve(
        listener,
        router(api),
        tls,
        allot_net::ServeLimits::default(),
        shutdown,
    )
    .await
}
