//! The page shell every console page shares (navigation by role, the signed-in token, sign-out),
//! the headers every console answer carries, and small pieces forms reuse.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

use super::api::ApiProblem;
use super::session::Session;
use crate::auth::OperatorRole;

/// The console's Content-Security-Policy: scripts, styles and images only from the console
/// itself, no inline script or style, no framing, forms post only back to it.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; \
    frame-ancestors 'none'; base-uri 'none'";

/// Adds the headers every console answer carries: the CSP, no sniffing, no framing, no referrer,
/// and no caching of pages that show an operator's data.
pub fn secure_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// An HTML answer.
pub fn html_response(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup.into_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    response
}

/// Which part of the console a page belongs to (highlighted in the navigation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// Pools and their windows.
    Pools,
    /// Regions and their agents.
    Regions,
    /// Policy bundles.
    Policies,
    /// Operator and agent tokens.
    Tokens,
    /// Overrides of pools' and rules' limits.
    Overrides,
    /// Threshold webhooks and their deliveries.
    Webhooks,
    /// The audit log.
    Audit,
}

const SECTIONS: [(Section, &str, &str, OperatorRole); 7] = [
    (
        Section::Pools,
        "Pools",
        "/console/pools",
        OperatorRole::Viewer,
    ),
    (
        Section::Regions,
        "Regions",
        "/console/regions",
        OperatorRole::Viewer,
    ),
    (
        Section::Policies,
        "Policies",
        "/console/policies",
        OperatorRole::Viewer,
    ),
    (
        Section::Tokens,
        "Tokens",
        "/console/tokens",
        OperatorRole::Admin,
    ),
    (
        Section::Overrides,
        "Overrides",
        "/console/overrides",
        OperatorRole::Viewer,
    ),
    (
        Section::Webhooks,
        "Webhooks",
        "/console/webhooks",
        OperatorRole::Viewer,
    ),
    (
        Section::Audit,
        "Audit",
        "/console/audit",
        OperatorRole::Viewer,
    ),
];

/// Every page's head: `title`, the stylesheet, and for a signed-in page (`csrf` given) its CSRF
/// token and the console's script.
pub fn head(title: &str, csrf: Option<&str>) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            @if let Some(csrf) = csrf { meta name="csrf-token" content=(csrf); }
            title { (title) " · Allot" }
            link rel="stylesheet" href="/console/assets/console.css";
            @if csrf.is_some() { script src="/console/assets/console.js" defer {} }
        }
    }
}

/// A whole page: `title`, the navigation for `session`'s role, and `body`.
pub fn page(session: &Session, section: Section, title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title, Some(&session.csrf)))
            body {
                header.top {
                    a.brand href="/console/pools" { "Allot" }
                    nav aria-label="Sections" {
                        @for (each, label, href, least) in SECTIONS {
                            @if session.role >= least {
                                a href=(href) aria-current=[(each == section).then_some("page")] { (label) }
                            }
                        }
                    }
                    form.signout method="post" action="/console/sign-out" {
                        span.who { (session.role.as_str()) " · " (session.token_id) }
                        (csrf_field(session))
                        button type="submit" { "Sign out" }
                    }
                }
                main id="main" {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

/// The sign-in page, with `problem` when the last attempt failed.
pub fn sign_in_page(problem: Option<&str>) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head("Sign in", None))
            body.signin {
                main id="main" {
                    h1 { "Allot console" }
                    form method="post" action="/console/sign-in" {
                        label for="token" { "Operator token" }
                        input id="token" name="token" type="password" autocomplete="current-password"
                            required autofocus aria-describedby=[problem.map(|_| "token-error")];
                        @if let Some(problem) = problem {
                            p.error id="token-error" role="alert" { (problem) }
                        }
                        button type="submit" { "Sign in" }
                    }
                    p.hint { "Viewer tokens see, author tokens also change pools and policies, admin tokens also manage tokens." }
                }
            }
        }
    }
}

/// The hidden CSRF field every form carries.
pub fn csrf_field(session: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(session.csrf); }
}

/// A problem the API answered, for the top of a page.
pub fn problem_banner(problem: &ApiProblem) -> Markup {
    html! {
        div.problem role="alert" {
            strong { (problem.0.title) }
            " " (problem.detail())
            @if let Some(field) = problem.field() { " (field " code { (field) } ")" }
        }
    }
}

/// A page that only says what went wrong.
pub fn problem_page(session: &Session, section: Section, problem: &ApiProblem) -> Response {
    html_response(
        problem.status(),
        page(
            session,
            section,
            "Something went wrong",
            problem_banner(problem),
        ),
    )
}

/// An epoch-ms instant as an HTTP date in UTC (`Tue, 01 Dec 2026 04:00:00 GMT`).
pub fn utc(epoch_ms: u64) -> String {
    httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_millis(epoch_ms))
}

/// Percent-encodes `text` for a query string.
pub fn query_escape(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A duration in ms, in the largest unit that divides it (`60 s`, `1 min`, `250 ms`).
pub fn duration(ms: u64) -> String {
    match ms {
        0 => "0 ms".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{} h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{} min", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{} s", ms / 1_000),
        ms => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(
            utc(951_782_400_000 + 1_500),
            "Tue, 29 Feb 2000 00:00:01 GMT"
        );
    }

    #[test]
    fn query_text_is_percent_encoded() {
        assert_eq!(query_escape("a b/c&d"), "a%20b%2Fc%26d");
    }

    #[test]
    fn durations_use_the_largest_exact_unit() {
        assert_eq!(duration(60_000), "1 min");
        assert_eq!(duration(90_000), "90 s");
        assert_eq!(duration(250), "250 ms");
        assert_eq!(duration(7_200_000), "2 h");
    }
}
