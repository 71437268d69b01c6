//! Threshold webhooks (`/v1/webhooks`): operators register an HTTPS endpoint for a tenant or one
//! pool, rotate its signing secret, and read its deliveries ([`crate::webhooks`]).

use allot_shared::contract::Problem;
use allot_shared::ids::{PoolId, TenantId};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::changes::{Changed, run_change};
use super::errors::ApiError;
use super::io::{json_response, parse_json};
use crate::auth::OperatorRole;
use crate::ledger::{DeliveryView, StoredWebhook};
use crate::pools;
use crate::webhooks::{
    DEFAULT_THRESHOLDS_PCT, MAX_WEBHOOKS, SECRET_OVERLAP_MS, addresses, new_secret, new_webhook_id,
};

/// Longest webhook URL, bytes.
pub const MAX_URL_LEN: usize = 2_048;
/// Most thresholds one webhook names.
pub const MAX_THRESHOLDS: usize = 10;
/// Most deliveries one read lists.
pub const MAX_DELIVERIES_LISTED: u32 = 1_000;

/// `POST /v1/webhooks` body.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookSpec {
    /// Where deliveries go: an `https://` URL.
    #[schema(pattern = "^https://", max_length = 2048)]
    pub url: String,
    /// The tenant.
    pub tenant: TenantId,
    /// One pool of the tenant; absent, every pool of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    /// Percentages of a window's limit to hear about, each 1 to 100, each once (default 80 and
    /// 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_items = 1, max_items = 10)]
    pub thresholds_pct: Option<Vec<u8>>,
}

/// A webhook as listed: never its secret.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookView {
    /// `wh-<hex>`.
    pub id: String,
    /// Where deliveries go.
    pub url: String,
    /// The tenant.
    pub tenant: TenantId,
    /// One pool, or absent for every pool of the tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    /// Thresholds, percent, ascending.
    pub thresholds_pct: Vec<u8>,
    /// Until when the previous secret still signs beside the current one, epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_secret_until_ms: Option<u64>,
    /// When it was registered, epoch ms.
    pub created_at_ms: u64,
    /// Who registered it.
    pub created_by: String,
}

impl From<&StoredWebhook> for WebhookView {
    fn from(stored: &StoredWebhook) -> Self {
        Self {
            id: stored.id.clone(),
            url: stored.url.clone(),
            tenant: stored.tenant.clone(),
            pool: stored.pool.clone(),
            thresholds_pct: stored.thresholds_pct.clone(),
            previous_secret_until_ms: stored.previous_secret_until_ms,
            created_at_ms: stored.created_at_ms,
            created_by: stored.created_by.clone(),
        }
    }
}

/// `POST /v1/webhooks` and `POST /v1/webhooks/{id}/rotate-secret` answer: the secret is shown
/// this once.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookWithSecret {
    /// The webhook.
    #[serde(flatten)]
    pub webhook: WebhookView,
    /// The signing secret (`whsec_<hex>`): HMAC-SHA256 key of `Allot-Signature`.
    pub secret: String,
}

/// `GET /v1/webhooks` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WebhookList {
    /// By id.
    pub webhooks: Vec<WebhookView>,
}

/// `GET /v1/webhooks/{id}/deliveries` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeliveryList {
    /// Newest first.
    pub deliveries: Vec<DeliveryView>,
}

/// `GET /v1/webhooks/{id}/deliveries` query.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// How many of the latest (default 50, at most 1,000).
    #[param(minimum = 1, maximum = 1000)]
    pub last: Option<u32>,
}

/// The thresholds `spec` asks for, checked: 1 to 100 each, at most [`MAX_THRESHOLDS`], each once;
/// ascending.
fn thresholds(spec: &WebhookSpec) -> Result<Vec<u8>, ApiError> {
    let mut thresholds = spec
        .thresholds_pct
        .clone()
        .unwrap_or_else(|| DEFAULT_THRESHOLDS_PCT.to_vec());
    if thresholds.is_empty() || thresholds.len() > MAX_THRESHOLDS {
        return Err(ApiError::invalid(
            "thresholdsPct",
            format!("must list 1 to {MAX_THRESHOLDS} percentages"),
        ));
    }
    if let Some(index) = thresholds.iter().position(|t| !(1..=100).contains(t)) {
        return Err(ApiError::invalid(
            format!("thresholdsPct[{index}]"),
            "must be 1 to 100",
        ));
    }
    thresholds.sort_unstable();
    if thresholds.windows(2).any(|pair| pair[0] == pair[1]) {
        return Err(ApiError::invalid(
            "thresholdsPct",
            "must name each percentage once",
        ));
    }
    Ok(thresholds)
}

/// `spec`'s URL, checked: `https://`, a host, at most [`MAX_URL_LEN`] bytes, no credentials, and
/// unless `allow_private`, no non-public address (a host name is checked at every delivery, when
/// it is resolved).
fn url(spec: &WebhookSpec, allow_private: bool) -> Result<String, ApiError> {
    let refused = |why: &str| ApiError::invalid("url", why.to_owned());
    if spec.url.len() > MAX_URL_LEN {
        return Err(refused("must be at most 2,048 bytes"));
    }
    let parsed = reqwest::Url::parse(&spec.url).map_err(|e| refused(&e.to_string()))?;
    if parsed.scheme() != "https" {
        return Err(refused(
            "must be https:// (deliveries are signed, and sent over TLS)",
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(refused("must name a host"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(refused("must not hold credentials"));
    }
    if !allow_private && let Some(refusal) = addresses::literal_refusal(&parsed) {
        return Err(refused(&refusal));
    }
    Ok(parsed.to_string())
}

/// A webhook on one pool needs the pool to exist: one registered ahead of it would hear nothing
/// until an operator made it, with no sign of why. A webhook on every pool of a tenant (no `pool`)
/// covers the tenant's pools as they come and go, so it needs none.
async fn pool_exists(state: &ApiState, spec: &WebhookSpec) -> Result<(), ApiError> {
    let Some(pool) = &spec.pool else {
        return Ok(());
    };
    match pools::get_pool(&*state.kv, &spec.tenant, pool).await? {
        Some(_) => Ok(()),
        None => Err(ApiError::not_found(format!(
            "no pool {}/{pool}: create it first, or leave out pool to hear every pool of the tenant",
            spec.tenant
        ))
        .with_field("pool")),
    }
}

#[utoipa::path(post, path = "/v1/webhooks", tag = "webhooks",
    request_body = WebhookSpec,
    responses(
        (status = 201, description = "Registered; the secret is shown this once", body = WebhookWithSecret),
        (status = 404, description = "The pool named does not exist (`field`: `pool`)", body = Problem,
            content_type = "application/problem+json"),
        (status = 409, description = "1,000 webhooks are registered already", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_webhook(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let spec: WebhookSpec = parse_json(&headers, &body)?;
    let thresholds_pct = thresholds(&spec)?;
    let url = url(&spec, state.webhook_allow_private)?;
    pool_exists(&state, &spec).await?;
    run_change(
        state,
        credential,
        "webhook.create",
        async move |state, credential| {
            let stored = StoredWebhook {
                id: new_webhook_id(),
                url,
                tenant: spec.tenant,
                pool: spec.pool,
                thresholds_pct,
                secret: new_secret(),
                previous_secret: None,
                previous_secret_until_ms: None,
                created_at_ms: state.clock.now_ms(),
                created_by: credential.actor(),
            };
            if !state.ledger.insert_webhook(&stored, MAX_WEBHOOKS).await? {
                return Err(ApiError::conflict(format!(
                    "{MAX_WEBHOOKS} webhooks are registered already; delete one first"
                )));
            }
            tracing::info!(id = %stored.id, tenant = %stored.tenant, "webhook registered");
            let answer = WebhookWithSecret {
                webhook: WebhookView::from(&stored),
                secret: stored.secret.clone(),
            };
            Ok(Changed {
                response: json_response(StatusCode::CREATED, &answer),
                target: stored.id.clone(),
                version: 0,
                detail: serde_json::json!({
                    "url": stored.url, "tenant": stored.tenant, "pool": stored.pool,
                    "thresholdsPct": stored.thresholds_pct,
                }),
            })
        },
    )
    .await
}

#[utoipa::path(get, path = "/v1/webhooks", tag = "webhooks",
    responses(
        (status = 200, description = "Every webhook (never its secret)", body = WebhookList),
        crate::http::errors::Refused,
    ))]
pub async fn list_webhooks(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let webhooks = state.ledger.webhooks().await?;
    let webhooks = webhooks.iter().map(WebhookView::from).collect();
    Ok(json_response(StatusCode::OK, &WebhookList { webhooks }))
}

/// A webhook id from a path: `wh-` and 16 hex digits.
fn webhook_id(id: &str) -> Result<&str, ApiError> {
    let well_formed = id
        .strip_prefix("wh-")
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
    if well_formed {
        Ok(id)
    } else {
        Err(ApiError::invalid("id", "must be wh- and 16 hex digits"))
    }
}

#[utoipa::path(delete, path = "/v1/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, pattern = "^wh-[0-9A-Fa-f]{16}$", description = "The webhook")),
    responses(
        (status = 204, description = "Removed, with its undelivered events"),
        (status = 404, description = "No such webhook", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn delete_webhook(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let id = webhook_id(&id)?.to_owned();
    run_change(
        state,
        credential,
        "webhook.delete",
        async move |state, _| {
            if !state.ledger.delete_webhook(&id).await? {
                return Err(ApiError::not_found("no such webhook"));
            }
            tracing::info!(%id, "webhook removed");
            Ok(Changed {
                response: StatusCode::NO_CONTENT.into_response(),
                target: id,
                version: 0,
                detail: serde_json::json!({}),
            })
        },
    )
    .await
}

#[utoipa::path(post, path = "/v1/webhooks/{id}/rotate-secret", tag = "webhooks",
    params(("id" = String, Path, pattern = "^wh-[0-9A-Fa-f]{16}$", description = "The webhook")),
    responses(
        (status = 200, description = "The new secret, shown this once; the old one signs beside it for 24 hours",
            body = WebhookWithSecret),
        (status = 404, description = "No such webhook", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn rotate_webhook_secret(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Author))?;
    let id = webhook_id(&id)?.to_owned();
    run_change(
        state,
        credential,
        "webhook.rotate",
        async move |state, _| {
            let secret = new_secret();
            let until_ms = state.clock.now_ms() + SECRET_OVERLAP_MS;
            if !state
                .ledger
                .rotate_webhook_secret(&id, &secret, until_ms)
                .await?
            {
                return Err(ApiError::not_found("no such webhook"));
            }
            let stored = state
                .ledger
                .webhooks()
                .await?
                .into_iter()
                .find(|webhook| webhook.id == id)
                .ok_or_else(|| ApiError::not_found("no such webhook"))?;
            tracing::info!(%id, "webhook secret rotated");
            let answer = WebhookWithSecret {
                webhook: WebhookView::from(&stored),
                secret,
            };
            Ok(Changed {
                response: json_response(StatusCode::OK, &answer),
                target: id,
                version: 0,
                detail: serde_json::json!({ "previousSecretUntilMs": until_ms }),
            })
        },
    )
    .await
}

#[utoipa::path(get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks",
    params(("id" = String, Path, pattern = "^wh-[0-9A-Fa-f]{16}$", description = "The webhook"),
        DeliveriesQuery),
    responses(
        (status = 200, description = "The latest events and how their delivery went", body = DeliveryList),
        (status = 404, description = "No such webhook", body = Problem,
            content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn list_deliveries(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    query: Result<Query<DeliveriesQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&state, &headers, Needs::Operator(OperatorRole::Viewer))?;
    let id = webhook_id(&id)?;
    let Query(query) = query.map_err(|e| ApiError::invalid("last", e.body_text()))?;
    let last = query.last.unwrap_or(50);
    if !(1..=MAX_DELIVERIES_LISTED).contains(&last) {
        return Err(ApiError::invalid("last", "must be in [1, 1000]"));
    }
    if !state.ledger.webhooks().await?.iter().any(|w| w.id == id) {
        return Err(ApiError::not_found("no such webhook"));
    }
    let deliveries = state.ledger.webhook_deliveries(id, last).await?;
    Ok(json_response(StatusCode::OK, &DeliveryList { deliveries }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str, thresholds: Option<Vec<u8>>) -> WebhookSpec {
        WebhookSpec {
            url: url.to_owned(),
            tenant: TenantId::parse("acme").expect("tenant"),
            pool: None,
            thresholds_pct: thresholds,
        }
    }

    #[test]
    fn thresholds_default_sort_and_refuse_what_is_out_of_range_or_repeated() {
        let ok = |t: Option<Vec<u8>>| {
            thresholds(&spec("https://x", t)).map_err(|e| e.field().map(str::to_owned))
        };
        assert_eq!(ok(None), Ok(vec![80, 100]));
        assert_eq!(ok(Some(vec![100, 50])), Ok(vec![50, 100]));
        assert_eq!(ok(Some(vec![])), Err(Some("thresholdsPct".to_owned())));
        assert_eq!(
            ok(Some(vec![50, 0])),
            Err(Some("thresholdsPct[1]".to_owned()))
        );
        assert_eq!(
            ok(Some(vec![101])),
            Err(Some("thresholdsPct[0]".to_owned()))
        );
        assert_eq!(
            ok(Some(vec![80, 80])),
            Err(Some("thresholdsPct".to_owned()))
        );
        assert!(ok(Some((1..=11).collect())).is_err());
    }

    #[test]
    fn urls_must_be_https_with_a_host_and_no_credentials() {
        assert_eq!(
            url(&spec("https://hooks.example/allot", None), false).expect("url"),
            "https://hooks.example/allot"
        );
        for bad in [
            "http://hooks.example/",
            "hooks.example",
            "https://user:pw@hooks.example/",
            "ftp://hooks.example/",
        ] {
            assert!(url(&spec(bad, None), true).is_err(), "{bad}");
        }
        let long = format!("https://hooks.example/{}", "a".repeat(MAX_URL_LEN));
        assert!(url(&spec(&long, None), true).is_err());
    }

    #[test]
    fn urls_naming_a_private_address_need_the_operator_to_allow_them() {
        for private in [
            "https://127.0.0.1:8443/hook",
            "https://[::1]/hook",
            "https://10.0.0.7/hook",
            "https://169.254.169.254/latest/meta-data",
            "https://[fd12::1]/hook",
            "https://2130706433/hook",
        ] {
            let refused = format!("{:?}", url(&spec(private, None), false).expect_err(private));
            assert!(
                refused.contains("--webhook-allow-private"),
                "{private}: {refused}"
            );
            assert!(url(&spec(private, None), true).is_ok(), "{private} allowed");
        }
        assert!(
            url(&spec("https://localhost/hook", None), false).is_ok(),
            "a name resolves later"
        );
    }
}
