//! Tokens (admins): mint (shown once), list (never a token or digest), revoke.

use allot_shared::contract::Problem;
use allot_shared::ids::RegionId;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::access::{Needs, authorize};
use super::changes::{Changed, run_change};
use super::errors::{ApiError, invalid_id};
use super::io::{json_response, parse_json};
use crate::auth::{self, Holder, OperatorRole, TokenId, TokenIdError};

/// `POST /v1/tokens` body.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MintBody {
    /// `viewer`, `author`, `admin` or `agent`.
    #[schema(pattern = "^(viewer|author|admin|agent)$")]
    pub role: String,
    /// The region an agent token is scoped to (required for `agent`, refused otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[a-z0-9-]{1,32}$")]
    pub region: Option<String>,
    /// A name for humans (at most 64 characters).
    #[serde(default)]
    #[schema(max_length = 64)]
    pub name: String,
}

/// A token as listed: never the token, never its digest.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MintAnswer {
    /// The token's listing.
    #[serde(flatten)]
    pub view: TokenView,
    /// The bearer token.
    pub token: String,
}

/// `GET /v1/tokens` answer.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenList {
    /// File tokens first, then minted ones.
    pub tokens: Vec<TokenView>,
}

/// Who `body` asks a token for.
fn holder(body: &MintBody) -> Result<Holder, ApiError> {
    let region = body
        .region
        .as_deref()
        .map(|region| RegionId::parse(region).map_err(invalid_id("region")))
        .transpose()?;
    match (body.role.as_str(), region) {
        ("agent", Some(region)) => Ok(Holder::Agent(Some(region))),
        ("agent", None) => Err(ApiError::invalid(
            "region",
            "an agent token must be scoped to a region",
        )),
        (role, None) => Ok(Holder::Operator(OperatorRole::parse(role).ok_or_else(
            || ApiError::invalid("role", "must be one of viewer, author, admin, agent"),
        )?)),
        (_, Some(_)) => Err(ApiError::invalid(
            "region",
            "only agent tokens are scoped to a region",
        )),
    }
}

#[utoipa::path(post, path = "/v1/tokens", tag = "tokens",
    request_body = MintBody,
    responses(
        (status = 201, description = "The token, shown this once", body = MintAnswer),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_token(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Admin))?;
    let body: MintBody = parse_json(&headers, &body)?;
    let holder = holder(&body)?;
    if body.name.chars().count() > auth::MAX_TOKEN_NAME_LEN
        || body.name.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(
            "name",
            "must be at most 64 characters, without control characters",
        ));
    }
    run_change(state, credential, "token.mint", async move |state, credential| {
        let minted = auth::mint_token(
            &*state.kv,
            &holder,
            &body.name,
            &credential.actor(),
            state.clock.now_ms(),
        )
        .await?;
        if let Err(error) = auth::refresh(&*state.kv, &state.tokens).await {
            tracing::warn!(%error, "minted token not yet visible here; the next refresh will pick it up");
        }
        tracing::info!(id = %minted.record.id, role = %minted.record.role, "token minted");
        let answer = MintAnswer {
            view: TokenView::of_record(&minted.record),
            token: minted.token,
        };
        Ok(Changed {
            response: json_response(StatusCode::CREATED, &answer),
            target: minted.record.id.clone(),
            version: 0,
            detail: serde_json::json!({ "role": minted.record.role, "region": minted.record.region }),
        })
    })
    .await
}

#[utoipa::path(get, path = "/v1/tokens", tag = "tokens",
    responses(
        (status = 200, description = "Every token (never the token itself)", body = TokenList),
        crate::http::errors::Refused,
    ))]
pub async fn list_tokens(
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
    let stored = auth::list_stored_tokens(&*state.kv).await?;
    tokens.extend(stored.iter().map(TokenView::of_record));
    Ok(json_response(StatusCode::OK, &TokenList { tokens }))
}

#[utoipa::path(delete, path = "/v1/tokens/{id}", tag = "tokens",
    params(("id" = String, Path, pattern = "^(tok-[0-9A-Fa-f]{16}|file-.*)$",
        description = "A minted token's id (`tok-<hex>`)")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 404, description = "No such token", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "A token from a file: revoke it there", body = Problem, content_type = "application/problem+json"),
        crate::http::errors::Refused,
    ))]
pub async fn delete_token(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Operator(OperatorRole::Admin))?;
    let id = TokenId::parse(&id).map_err(|error| match error {
        TokenIdError::FromFile => ApiError::conflict(error.to_string()),
        TokenIdError::Malformed => ApiError::invalid("id", error.to_string()),
    })?;
    run_change(state, credential, "token.revoke", async move |state, _| {
        let record = auth::revoke_token(&*state.kv, &id)
            .await?
            .ok_or_else(|| ApiError::not_found("no such token"))?;
        if let Err(error) = auth::refresh(&*state.kv, &state.tokens).await {
            tracing::warn!(%error, "revoked token still known here until the next refresh");
        }
        tracing::info!(id = %record.id, "token revoked");
        Ok(Changed {
            response: StatusCode::NO_CONTENT.into_response(),
            target: record.id.clone(),
            version: 0,
            detail: serde_json::json!({ "role": record.role, "region": record.region }),
        })
    })
    .await
}
