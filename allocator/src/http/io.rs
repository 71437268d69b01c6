//! Reading requests and writing answers: JSON bodies (the field at fault named on error), path
//! segments, JSON answers.

use allot_shared::FieldError;
use allot_shared::ids::{PoolId, TenantId};
use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::errors::{ApiError, invalid_id};

/// A JSON answer.
pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_default();
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Parses a JSON body, naming the field at fault on error.
pub fn parse_json<T: DeserializeOwned>(headers: &HeaderMap, body: &Bytes) -> Result<T, ApiError> {
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
    FieldError::parse_json(body, "body")
        .map_err(|named| ApiError::invalid(named.field, named.message))
}

/// Parses a URL query (without the `?`; none is empty), naming the parameter at fault on error.
pub fn parse_query<T: DeserializeOwned>(query: Option<&str>) -> Result<T, ApiError> {
    FieldError::parse_query(query.unwrap_or_default(), "query")
        .map_err(|named| ApiError::invalid(named.field, named.message))
}

/// Parses the `{tenant}/{pool}` path segments.
pub fn pool_path(tenant: &str, pool: &str) -> Result<(TenantId, PoolId), ApiError> {
    Ok((
        TenantId::parse(tenant).map_err(invalid_id("tenant"))?,
        PoolId::parse(pool).map_err(invalid_id("pool"))?,
    ))
}
