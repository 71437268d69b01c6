//! The allocator API's OpenAPI 3.1 document, generated from the handlers' own annotations and the
//! types they read and answer (served at `/openapi.json`). Every route of [`super::routes`] is in
//! it; `allocator/tests/openapi.rs` holds the two together and runs the outside judges.

use allot_shared::contract::Problem;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Allot allocator",
        description = "The home region's authority over global quota pools: operators configure \
                       pools, policies and tokens and read the ledger; region agents take grants, \
                       report and read their terms. Every call but the probes carries a bearer \
                       token: an operator's (viewer, author or admin) or a region agent's.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        super::pools::list_pools,
        super::pools::bulk_put_pools,
        super::pools::get_pool,
        super::pools::put_pool,
        super::pools::delete_pool,
        super::pools::get_windows,
        super::pools::get_pool_terms,
        super::regions::list_regions,
        super::grants::post_grant,
        super::grants::post_report,
        super::agent_sessions::post_session_start,
        super::agent_sessions::post_session_end,
        super::policies::put_policy,
        super::policies::get_current_policy,
        super::policies::get_policy_status,
        super::policies::post_agent_status,
        super::policies::get_policy_version,
        super::policies::promote_policy,
        super::policies::rollback_policy,
        super::tokens::list_tokens,
        super::tokens::post_token,
        super::tokens::delete_token,
        super::webhooks::list_webhooks,
        super::webhooks::post_webhook,
        super::webhooks::delete_webhook,
        super::webhooks::rotate_webhook_secret,
        super::webhooks::list_deliveries,
        super::ops::get_audit,
        super::usage::get_usage,
        super::ops::get_bound_checks,
        super::ops::healthz,
        super::ops::readyz,
        super::ops::metrics_text,
        openapi_json,
    ),
    modifiers(&BearerToken),
    security(("token" = [])),
    tags(
        (name = "pools", description = "Operators: global quota pools and their windows."),
        (name = "policies", description = "Operators: policy bundles and their rollout."),
        (name = "tokens", description = "Admins: tokens minted and revoked."),
        (name = "usage", description = "Operators: usage for billing."),
        (name = "webhooks", description = "Operators: endpoints told when a window reaches a share of its quota."),
        (name = "agents", description = "Region agents: grants, reports, terms, runs, status."),
        (name = "operations", description = "Audit, bound checks, probes, metrics, this document."),
    )
)]
pub struct AllocatorApiDoc;

/// Declares the bearer token every call but the probes presents.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An operator token (viewer < author < admin) or a region agent's token; \
                         each operation says which it needs.",
                    ))
                    .build(),
            ),
        );
    }
}

/// The refusals any authenticated call can get.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum Refused {
    /// Bad input: problem+json naming the field (a path segment, a query parameter) at fault.
    #[response(status = 400, content_type = "application/problem+json")]
    Invalid(#[to_schema] Problem),
    /// No token, or an unknown one.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthorized(#[to_schema] Problem),
    /// The token's role or region may not do this.
    #[response(status = 403, content_type = "application/problem+json")]
    Forbidden(#[to_schema] Problem),
    /// Not the leader (a change; `leader` names it), or the store or ledger unavailable.
    #[response(status = 503, content_type = "application/problem+json")]
    Unavailable(#[to_schema] Problem),
}

/// The refusals of a call with a JSON body: [`Refused`]'s, and the body's own.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum JsonRefused {
    /// Bad input: problem+json naming the field at fault.
    #[response(status = 400, content_type = "application/problem+json")]
    Invalid(#[to_schema] Problem),
    /// No token, or an unknown one.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthorized(#[to_schema] Problem),
    /// The token's role or region may not do this.
    #[response(status = 403, content_type = "application/problem+json")]
    Forbidden(#[to_schema] Problem),
    /// The body is larger than the route allows.
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(#[to_schema] Problem),
    /// The body is not `application/json`.
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(#[to_schema] Problem),
    /// Not the leader (a change; `leader` names it), or the store or ledger unavailable.
    #[response(status = 503, content_type = "application/problem+json")]
    Unavailable(#[to_schema] Problem),
}

/// The document as JSON, built once.
pub fn document_json() -> &'static str {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DOCUMENT.get_or_init(|| {
        AllocatorApiDoc::openapi()
            .to_pretty_json()
            .unwrap_or_default()
    })
}

/// This API's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object)))]
pub async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
        .into_response()
}
