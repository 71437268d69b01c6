//! The gateway API's OpenAPI 3.1 document, generated from the handlers' own annotations and the
//! contract's types (served at `/openapi.json`). Every route of [`crate::http::router`] is in it;
//! `region-agent/tests/integration/openapi.rs` holds the two together.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Allot region agent",
        description = "The gateway API of a region's agent: admission decisions against regional \
                       rules and global quota pools, and what follows them (release, renew, settle, \
                       quota). Gateways authenticate with a bearer gateway token.",
        license(name = "Apache-2.0", identifier = "Apache-2.0"),
    ),
    paths(
        crate::http::gateway::admit,
        crate::http::gateway::check,
        crate::http::gateway::auth_request,
        crate::http::gateway::quota,
        crate::http::gateway::settle,
        crate::http::gateway::release,
        crate::http::gateway::renew,
        crate::http::gateway::healthz,
        crate::http::gateway::readyz,
        crate::http::gateway::metrics_text,
        openapi_json,
    ),
    modifiers(&GatewayToken),
    security(("gateway_token" = [])),
    tags(
        (name = "gateway", description = "What gateways call for each request."),
        (name = "operations", description = "Probes, metrics and this document; no token."),
    )
)]
pub struct AgentApiDoc;

/// Declares the bearer gateway token every gateway call presents.
struct GatewayToken;

impl Modify for GatewayToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "gateway_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("A gateway token (`--gateway-token-file`)."))
                    .build(),
            ),
        );
    }
}

/// The document as JSON, built once.
pub fn document_json() -> &'static str {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DOCUMENT.get_or_init(|| {
        let mut document = serde_json::to_value(AgentApiDoc::openapi()).unwrap_or_default();
        add_what_types_cannot_say(&mut document);
        serde_json::to_string_pretty(&document).unwrap_or_default()
    })
}

/// The constraints across fields that the types' derived schemas cannot state.
fn add_what_types_cannot_say(document: &mut serde_json::Value) {
    // A dry run spends nothing, so it has nothing to settle: not both `dryRun` and `metered`.
    if let Some(admission) = document
        .pointer_mut("/components/schemas/AdmissionRequest")
        .and_then(serde_json::Value::as_object_mut)
    {
        admission.insert(
            "not".to_owned(),
            serde_json::json!({
                "required": ["dryRun", "metered"],
                "properties": { "dryRun": { "const": true }, "metered": { "const": true } }
            }),
        );
    }
}

/// This API's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object)))]
pub(crate) async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
        .into_response()
}
