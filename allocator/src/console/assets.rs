//! The console's stylesheet and script, compiled into the binary from `allocator/console/`:
//! the console fetches nothing from anywhere else.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

const STYLESHEET: &str = include_str!("../../console/console.css");
const SCRIPT: &str = include_str!("../../console/console.js");

/// `GET /console/assets/{name}`.
pub async fn asset(Path(name): Path<String>) -> Response {
    let (body, content_type) = match name.as_str() {
        "console.css" => (STYLESHEET, "text/css; charset=utf-8"),
        "console.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        _ => return (StatusCode::NOT_FOUND, "no such asset").into_response(),
    };
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Assets change only with the binary; a short cache keeps upgrades visible within minutes.
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    response
}
