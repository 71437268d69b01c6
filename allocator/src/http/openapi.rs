//! The allocator API's OpenAPI 3.1 document, generated from the handlers' own annotations and the
//! types they read and answer (served at `/openapi.json`). Every route of [`super::routes`] is in
//! it; `allocator/tests/integration/openapi.rs` holds the two together and runs the outside judges.

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
                       pools, policies, overrides and tokens and read the ledger; region agents take grants, \
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
        super::terms::post_terms_batch,
        super::regions::list_regions,
        super::shards::get_shards,
        super::grants::post_grant,
        super::grants::post_grant_batch,
        super::reports::post_report,
        super::reports::post_report_batch,
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
        super::overrides::list_overrides,
        super::overrides::post_override,
        super::overrides::current_overrides,
        super::overrides::get_override,
        super::overrides::end_override,
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
        (name = "overrides", description = "Operators: a different limit for one tenant, user or API key, until a set time; agents: the rule overrides in force."),
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
