//! One error shape for everything a client sees.
//!
//! Handlers answer errors as RFC 9457 problem+json, but some answers come from layers: the body
//! limit (413), an unknown method (405), a request deadline. [`problem_for_plain_errors`] rewrites
//! any 4xx or 5xx that is not already problem+json into one, keeping its status and using its text
//! as the detail, so a client never has to parse two error formats.

use axum::http::{HeaderValue, header};
use axum::response::Response;

/// The problem+json media type.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Largest plain error text kept as the detail, in bytes.
const MAX_DETAIL_BYTES: usize = 1_024;

/// Rewrites a plain 4xx/5xx answer as problem+json (for `axum::middleware::map_response`, applied
/// outermost so it sees what the other layers answer). An HTML error page (the operator console's)
/// is already written for its reader and passes unchanged.
pub async fn problem_for_plain_errors(response: Response) -> Response {
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE);
    let is_problem =
        content_type.is_some_and(|v| v.as_bytes().starts_with(PROBLEM_CONTENT_TYPE.as_bytes()));
    let is_page = content_type.is_some_and(|v| v.as_bytes().starts_with(b"text/html"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem || is_page {
        return response;
    }
    // Every header but the body's own stays (Retry-After, a proxy's X-Allot-Status, ...).
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_DETAIL_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let title = status.canonical_reason().unwrap_or("Error");
    let detail = if text.is_empty() {
        title.to_owned()
    } else {
        text
    };
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":{},\"status\":{},\"detail\":{}}}",
        json_string(title),
        status.as_u16(),
        json_string(&detail)
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
    );
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    #[tokio::test]
    async fn plain_errors_become_problems_and_the_rest_passes() {
        let plain = (StatusCode::PAYLOAD_TOO_LARGE, "length limit \"exceeded\"\n").into_response();
        let rewritten = problem_for_plain_errors(plain).await;
        assert_eq!(rewritten.status(), 413);
        assert_eq!(
            rewritten.headers()[header::CONTENT_TYPE],
            PROBLEM_CONTENT_TYPE
        );
        let body = axum::body::to_bytes(rewritten.into_body(), 4_096)
            .await
            .expect("body");
        assert_eq!(
            String::from_utf8_lossy(&body),
            r#"{"type":"about:blank","title":"Payload Too Large","status":413,"detail":"length limit \"exceeded\""}"#
        );
        // The answer's own headers stay; only the body's change.
        let mut refused = (StatusCode::FORBIDDEN, "no").into_response();
        refused
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("7"));
        refused
            .headers_mut()
            .insert("x-allot-status", HeaderValue::from_static("429"));
        let refused = problem_for_plain_errors(refused).await;
        assert_eq!(refused.headers()[header::RETRY_AFTER], "7");
        assert_eq!(refused.headers()["x-allot-status"], "429");
        assert_eq!(
            refused.headers()[header::CONTENT_TYPE],
            PROBLEM_CONTENT_TYPE
        );
        let ok = problem_for_plain_errors((StatusCode::OK, "fine").into_response()).await;
        assert_eq!(ok.status(), 200);
        assert!(
            ok.headers()
                .get(header::CONTENT_TYPE)
                .is_some_and(|v| v != PROBLEM_CONTENT_TYPE)
        );
        let mut page = (StatusCode::FORBIDDEN, "<p>Refused</p>").into_response();
        page.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        let page = problem_for_plain_errors(page).await;
        assert_eq!(page.status(), 403);
        assert!(
            page.headers()[header::CONTENT_TYPE]
                .as_bytes()
                .starts_with(b"text/html")
        );
    }
}
