//! The allocator's HTTP API (axum): pools for operators, grants for agents, health for orchestrators.
//!
//! Wire types are JSON in camelCase (the allocator-agent messages are `allot_shared::wire`); every
//! error is an RFC 9457 problem+json body that names the field at fault ([`ApiError`]). Every
//! endpoint needs a bearer token ([`crate::auth`]): viewers read, authors also change pools and
//! policies, admins also manage tokens, agents take grants and report for their own region. A
//! missing or unknown token is 401 (the same answer for both), a known token without the role 403.
//! Every change runs to completion and is written to the ledger's audit log with its actor and
//! version. Every request is bounded: body size, time and concurrency (I10).
//!
//! A file per resource: `pools`, `regions`, `grants` (and reports), `agent_sessions`, `policies`, `tokens`, `ops` (audit,
//! metrics, health); beside them `access` (who may call what), `changes` (running and auditing a
//! change), `errors` and `io` (bodies, paths, answers).

mod access;
mod agent_sessions;
mod changes;
mod errors;
mod grants;
mod io;
pub mod openapi;
mod ops;
mod overrides;
mod policies;
mod pools;
mod regions;
mod reports;
mod shards;
mod terms;
mod tokens;
mod usage;
mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use tokio::sync::watch;

pub use self::errors::ApiError;
pub use self::ops::{AuditList, AuditQuery};
pub use self::overrides::{OverrideList, OverrideService, OverrideSpec, PrincipalSpec};
pub use self::policies::{CurrentQuery, PolicyStatus, PublishQuery};
pub use self::pools::{
    BulkAnswer, BulkPool, BulkPools, BulkWritten, LiveWindow, MAX_POOLS_PER_BULK,
    MAX_POOLS_PER_PAGE, PoolList, PoolView, TermsQuery, WindowList, WindowsQuery,
};
pub use self::regions::{REPORT_LOOKBACK_MS, RegionList, RegionView};
pub use self::tokens::{MintAnswer, MintBody, TokenList, TokenView};
pub use self::usage::{
    CSV_HEADER as USAGE_CSV_HEADER, DEFAULT_USAGE_PAGE, MAX_USAGE_PAGE, UsageQuery, UsageRecord,
};
pub use self::webhooks::{DeliveryList, WebhookList, WebhookSpec, WebhookView, WebhookWithSecret};
use crate::auth::TokenBook;
/// The token files' lines (see [`crate::auth`]).
pub use crate::auth::Tokens;
use crate::clock::Clock;
use crate::grants::Grantor;
use crate::kv::Kv;
use crate::leader::Roles;
use crate::ledger::Ledger;
/// The allocator-agent messages, as this API speaks them.
pub use allot_shared::wire::{FallbackInWindow, GrantAnswer, GrantBody, PoolTerms};

/// Largest request body, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest a request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Most requests served at once; more wait in the listener's backlog.
pub const MAX_CONCURRENT_REQUESTS: usize = 1_024;

/// The bounds of the allocator's listener, for everything it serves (I10).
pub fn listener_limits() -> allot_net::RouterLimits {
    allot_net::RouterLimits {
        max_body_bytes: MAX_BODY_BYTES,
        max_concurrent_requests: MAX_CONCURRENT_REQUESTS,
        request_timeout: REQUEST_TIMEOUT,
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    /// The store.
    pub kv: Arc<dyn Kv>,
    /// The grant service.
    pub grantor: Grantor,
    /// This node's role.
    pub role: watch::Receiver<Roles>,
    /// The allocator clock.
    pub clock: Arc<dyn Clock>,
    /// Accepted bearer tokens.
    pub tokens: Arc<TokenBook>,
    /// The accounting ledger.
    pub ledger: Ledger,
    /// The store lease agent status keys are written with.
    pub status_leases: Arc<crate::policies::StatusLeases>,
    /// Overrides: the agents' set and the pepper principals are hashed with.
    pub overrides: Arc<OverrideService>,
    /// The listing of every pool `GET /v1/regions` reuses for half a minute.
    pub pool_listing: Arc<regions::PoolListing>,
    /// Whether webhooks may name non-public addresses (`--webhook-allow-private`).
    pub webhook_allow_private: bool,
}

/// The API's routes, without the listener's bounds ([`listener_limits`]): the listener applies
/// them once around the API and the console, and the console calls these routes in-process from
/// within a request they already cover.
///
/// Long by design: it is the API's one table of routes, every path with its methods and handlers,
/// read as one list; split, what the API serves, and which route carries its own body limit, could
/// no longer be seen in one place.
pub fn routes(state: ApiState) -> Router {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics_text))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/v1/pools", get(pools::list_pools))
        .route(
            "/v1/pools/bulk",
            post(pools::bulk_put_pools).layer(axum::extract::DefaultBodyLimit::max(
                pools::MAX_BULK_BODY_BYTES,
            )),
        )
        .route(
            "/v1/pools/{tenant}/{pool}",
            get(pools::get_pool)
                .put(pools::put_pool)
                .delete(pools::delete_pool),
        )
        .route("/v1/pools/{tenant}/{pool}/windows", get(pools::get_windows))
        .route(
            "/v1/pools/{tenant}/{pool}/terms",
            get(pools::get_pool_terms),
        )
        .route("/v1/terms/batch", post(terms::post_terms_batch))
        .route("/v1/regions", get(regions::list_regions))
        .route("/v1/shards", get(shards::get_shards))
        .route("/v1/grants", post(grants::post_grant))
        .route("/v1/grants/batch", post(grants::post_grant_batch))
        .route("/v1/reports", post(reports::post_report))
        .route(
            "/v1/reports/batch",
            post(reports::post_report_batch).layer(axum::extract::DefaultBodyLimit::max(
                allot_shared::wire::MAX_REPORT_BATCH_BYTES,
            )),
        )
        .route(
            "/v1/agent-sessions",
            post(agent_sessions::post_session_start),
        )
        .route(
            "/v1/agent-sessions/end",
            post(agent_sessions::post_session_end),
        )
        .route("/v1/policies", axum::routing::put(policies::put_policy))
        .route("/v1/policies/current", get(policies::get_current_policy))
        .route(
            "/v1/policies/status",
            get(policies::get_policy_status).post(policies::post_agent_status),
        )
        .route("/v1/policies/{version}", get(policies::get_policy_version))
        .route(
            "/v1/policies/{version}/promote",
            post(policies::promote_policy),
        )
        .route(
            "/v1/policies/{version}/rollback",
            post(policies::rollback_policy),
        )
        .route(
            "/v1/tokens",
            get(tokens::list_tokens).post(tokens::post_token),
        )
        .route(
            "/v1/tokens/{id}",
            axum::routing::delete(tokens::delete_token),
        )
        .route(
            "/v1/webhooks",
            get(webhooks::list_webhooks).post(webhooks::post_webhook),
        )
        .route(
            "/v1/webhooks/{id}",
            axum::routing::delete(webhooks::delete_webhook),
        )
        .route(
            "/v1/webhooks/{id}/rotate-secret",
            post(webhooks::rotate_webhook_secret),
        )
        .route(
            "/v1/webhooks/{id}/deliveries",
            get(webhooks::list_deliveries),
        )
        .route(
            "/v1/overrides",
            get(overrides::list_overrides).post(overrides::post_override),
        )
        .route("/v1/overrides/current", get(overrides::current_overrides))
        .route(
            "/v1/overrides/{tenant}/{id}",
            get(overrides::get_override).delete(overrides::end_override),
        )
        .route("/v1/audit", get(ops::get_audit))
        .route("/v1/usage", get(usage::get_usage))
        .route("/v1/bound-checks", get(ops::get_bound_checks))
        .fallback(ops::not_found)
        .with_state(state)
}
