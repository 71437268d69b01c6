//! The operator console: server-rendered pages at `/console/` on the allocator's own listener.
//!
//! An operator signs in with a token; the console then acts as that token by calling the API
//! in-process (`api::Api`), so the API alone enforces roles and validates input, and the
//! console only hides what the role cannot do. The browser holds a random session cookie
//! (HttpOnly, SameSite=Strict); every change is a POST carrying the session's CSRF token and is
//! refused when the browser says it comes from another site. Every answer carries a strict
//! Content-Security-Policy: the only script is the console's own file, served from the binary
//! like its stylesheet (nothing is fetched at run time). Live parts of a page are refreshed by
//! that script polling a fragment of the page (bounded: one request in flight, paused while the
//! page is hidden, backing off on errors).
//!
//! A file per page family: `pools`, `regions`, `policies`, `tokens`, `audit`; beside them
//! `session` (sign-in state), `api` (the in-process API client), `layout` (the page shell and
//! headers), `chart` (per-window SVG charts) and `assets`.

mod api;
mod assets;
mod audit;
mod chart;
mod layout;
mod overrides;
mod policies;
mod pools;
mod regions;
pub mod session;
mod tokens;
mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use self::api::{Api, ApiProblem};
use self::layout::{Section, html_response, secure_headers, sign_in_page};
use self::session::{COOKIE_NAME, Session, Sessions};
use crate::auth::{Holder, TokenBook};
use crate::clock::Clock;

/// What console handlers share.
#[derive(Clone)]
pub struct ConsoleState {
    /// The API's routes (without the listener's bounds, which already apply to the console's own
    /// request), called in-process.
    pub api: Router,
    /// Accepted tokens, to sign in with.
    pub tokens: Arc<TokenBook>,
    /// Live sessions.
    pub sessions: Arc<Sessions>,
    /// The allocator clock.
    pub clock: Arc<dyn Clock>,
    /// Whether cookies are marked `Secure` (the listener serves TLS).
    pub secure_cookies: bool,
}

/// The console's routes, all under `/console`.
pub fn router(state: ConsoleState) -> Router {
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route("/console/", get(home))
        .route("/console/sign-in", get(sign_in_form).post(sign_in))
        .route("/console/sign-out", post(sign_out))
        .route("/console/assets/{name}", get(assets::asset))
        .route("/console/pools", get(pools::list))
        .route(
            "/console/pools/new",
            get(pools::new_form).post(pools::create),
        )
        .route("/console/pools/{tenant}/{pool}", get(pools::detail))
        .route("/console/pools/{tenant}/{pool}/live", get(pools::live))
        .route(
            "/console/pools/{tenant}/{pool}/chart.svg",
            get(pools::chart),
        )
        .route(
            "/console/pools/{tenant}/{pool}/edit",
            get(pools::edit_form).post(pools::update),
        )
        .route(
            "/console/pools/{tenant}/{pool}/delete",
            get(pools::delete_confirm).post(pools::delete),
        )
        .route("/console/regions", get(regions::page))
        .route("/console/regions/live", get(regions::live))
        .route("/console/policies", get(policies::page))
        .route("/console/policies/publish", post(policies::publish))
        .route("/console/policies/diff", get(policies::diff))
        .route("/console/policies/replay", post(policies::replay))
        .route(
            "/console/policies/{version}/promote",
            post(policies::promote),
        )
        .route(
            "/console/policies/{version}/rollback",
            post(policies::rollback),
        )
        .route("/console/tokens", get(tokens::page).post(tokens::mint))
        .route("/console/tokens/{id}/revoke", post(tokens::revoke))
        .route("/console/audit", get(audit::page))
        .route("/console/webhooks", get(webhooks::page))
        .route("/console/overrides", get(overrides::page))
        .layer(axum::middleware::map_response(secure_response))
        .with_state(state)
}

async fn secure_response(response: Response) -> Response {
    secure_headers(response)
}

/// A signed-in request: the session and the API as its operator. As a handler's argument it
/// sends whoever has no live session to the sign-in page.
pub struct SignedIn {
    /// The session.
    pub session: Session,
    /// The API, called with the session's token.
    pub api: Api,
    /// The cookie's session id (to end the session when the API stops accepting its token).
    session_id: String,
}

impl FromRequestParts<ConsoleState> for SignedIn {
    type Rejection = Refused;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &ConsoleState,
    ) -> Result<Self, Refused> {
        console.signed_in(&parts.headers)
    }
}

/// What every change's form carries.
pub trait CarriesCsrf {
    /// The CSRF token the form was sent with.
    fn csrf(&self) -> &str;
}

/// A signed-in change: its form, sent from the console itself with the session's CSRF token. As a
/// handler's argument it refuses anything else (403), and an unreadable or oversized form with
/// the form's own error (400, 413).
pub struct Change<T> {
    /// Who sends it.
    pub signed_in: SignedIn,
    /// What was sent.
    pub form: T,
}

impl<T> FromRequest<ConsoleState> for Change<T>
where
    T: DeserializeOwned + CarriesCsrf + Send,
{
    type Rejection = Response;

    async fn from_request(request: Request, console: &ConsoleState) -> Result<Self, Response> {
        let headers = request.headers().clone();
        let axum::Form(form) = axum::Form::<T>::from_request(request, console)
            .await
            .map_err(IntoResponse::into_response)?;
        let signed_in = console
            .signed_in_change(&headers, form.csrf())
            .map_err(IntoResponse::into_response)?;
        Ok(Self { signed_in, form })
    }
}

fn cookie_value<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// Why a request gets no page: not signed in (to the sign-in page), or a change refused (403).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// No live session.
    SignIn,
    /// A change without its CSRF token, or sent from another site.
    Forbidden(&'static str),
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self {
            Self::SignIn => to_sign_in(),
            Self::Forbidden(detail) => forbidden(detail),
        }
    }
}

fn to_sign_in() -> Response {
    Redirect::to("/console/sign-in").into_response()
}

impl ConsoleState {
    /// The signed-in caller, or the redirect to the sign-in page.
    pub fn signed_in(&self, headers: &HeaderMap) -> Result<SignedIn, Refused> {
        let session_id = cookie_value(headers, COOKIE_NAME).ok_or(Refused::SignIn)?;
        let session = self
            .sessions
            .touch(session_id, self.clock.now_ms())
            .ok_or(Refused::SignIn)?;
        let api = Api::new(self.api.clone(), session.token.clone());
        Ok(SignedIn {
            session,
            api,
            session_id: session_id.to_owned(),
        })
    }

    /// The signed-in caller of a change: also checks that the browser did not send it from another
    /// site and that it carries the session's CSRF token.
    pub fn signed_in_change(&self, headers: &HeaderMap, csrf: &str) -> Result<SignedIn, Refused> {
        if from_another_site(headers) {
            return Err(Refused::Forbidden("this change came from another site"));
        }
        let signed_in = self.signed_in(headers)?;
        if !signed_in.session.csrf_matches(csrf) {
            return Err(Refused::Forbidden(
                "this form has expired or did not come from the console; reload the page and try again",
            ));
        }
        Ok(signed_in)
    }

    /// Ends the session when the API no longer accepts its token (revoked), so the operator signs
    /// in again instead of seeing 401 on every page.
    pub fn end_if_refused(&self, signed_in: &SignedIn, problem: &ApiProblem) -> Option<Response> {
        if problem.status() != StatusCode::UNAUTHORIZED {
            return None;
        }
        self.sessions.sign_out(&signed_in.session_id);
        Some(to_sign_in())
    }

    /// The page for a failed API call: the sign-in page when the token is no longer accepted,
    /// else what the API said, in `section`.
    pub fn failed(&self, signed_in: &SignedIn, section: Section, problem: &ApiProblem) -> Response {
        self.end_if_refused(signed_in, problem)
            .unwrap_or_else(|| layout::problem_page(&signed_in.session, section, problem))
    }

    /// The same for a live fragment: only the problem, no page around it.
    pub fn failed_fragment(&self, signed_in: &SignedIn, problem: &ApiProblem) -> Response {
        self.end_if_refused(signed_in, problem)
            .unwrap_or_else(|| html_response(problem.status(), layout::problem_banner(problem)))
    }

    fn session_cookie(&self, session_id: &str, max_age_s: u64) -> HeaderValue {
        let secure = if self.secure_cookies { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{COOKIE_NAME}={session_id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age_s}{secure}"
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("allot_console=; Max-Age=0"))
    }
}

/// Whether the browser says the request was made by another site (Fetch Metadata, or an Origin
/// that is not this host). Browsers send at least one of them on every POST; a request with
/// neither is not from a browser, and still needs the session cookie and CSRF token.
fn from_another_site(headers: &HeaderMap) -> bool {
    let header_text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    if let Some(site) = header_text(header::HeaderName::from_static("sec-fetch-site")) {
        return !matches!(site, "same-origin" | "none");
    }
    match (header_text(header::ORIGIN), header_text(header::HOST)) {
        (Some(origin), Some(host)) => {
            let origin_host = origin.split_once("://").map(|(_, rest)| rest);
            origin_host != Some(host)
        }
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// A 403 page saying why.
fn forbidden(detail: &str) -> Response {
    html_response(
        StatusCode::FORBIDDEN,
        maud::html! {
            (maud::DOCTYPE)
            html lang="en" {
                (layout::head("Refused", None))
                body { main id="main" { h1 { "Refused" } p.problem role="alert" { (detail) } p { a href="/console/" { "Back to the console" } } } }
            }
        },
    )
}

async fn home(_: SignedIn) -> Response {
    Redirect::to("/console/pools").into_response()
}

async fn sign_in_form() -> Response {
    html_response(StatusCode::OK, sign_in_page(None))
}

/// The sign-in form.
#[derive(Debug, Deserialize)]
pub struct SignInForm {
    token: String,
}

async fn sign_in(
    State(console): State<ConsoleState>,
    headers: HeaderMap,
    form: Result<axum::Form<SignInForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    if from_another_site(&headers) {
        return forbidden("sign-in came from another site");
    }
    let refused = |status, detail| html_response(status, sign_in_page(Some(detail)));
    let form = match form {
        Ok(axum::Form(form)) => form,
        Err(rejection) => return rejection.into_response(),
    };
    let token = form.token.trim();
    let Some(credential) = console.tokens.authenticate(token) else {
        metrics::counter!(crate::metrics::AUTH_REFUSALS, "status" => "401").increment(1);
        return refused(StatusCode::UNAUTHORIZED, "this token is not accepted");
    };
    let Holder::Operator(role) = credential.holder else {
        return refused(
            StatusCode::FORBIDDEN,
            "agent tokens cannot sign in; use an operator token",
        );
    };
    let session_id = console.sessions.sign_in(
        token.to_owned(),
        role,
        credential.id,
        console.clock.now_ms(),
    );
    tracing::info!(role = role.as_str(), "console sign-in");
    let mut response = Redirect::to("/console/pools").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        console.session_cookie(&session_id, session::ABSOLUTE_TIMEOUT_MS / 1_000),
    );
    response
}

/// A form that carries only the CSRF token.
#[derive(Debug, Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

impl CarriesCsrf for CsrfForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

async fn sign_out(
    State(console): State<ConsoleState>,
    Change { signed_in, .. }: Change<CsrfForm>,
) -> Response {
    console.sessions.sign_out(&signed_in.session_id);
    let mut response = Redirect::to("/console/sign-in").into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, console.session_cookie("", 0));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_str(value).expect("value"));
        }
        map
    }

    #[test]
    fn cross_site_requests_are_recognised_from_fetch_metadata_or_origin() {
        assert!(from_another_site(&headers(&[(
            "sec-fetch-site",
            "cross-site"
        )])));
        assert!(from_another_site(&headers(&[(
            "sec-fetch-site",
            "same-site"
        )])));
        assert!(!from_another_site(&headers(&[(
            "sec-fetch-site",
            "same-origin"
        )])));
        assert!(from_another_site(&headers(&[
            ("origin", "https://evil.example"),
            ("host", "allot.example:8080")
        ])));
        assert!(!from_another_site(&headers(&[
            ("origin", "https://allot.example:8080"),
            ("host", "allot.example:8080")
        ])));
        assert!(!from_another_site(&headers(&[])));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let map = headers(&[("cookie", "a=1; allot_console=abc; b=2")]);
        assert_eq!(cookie_value(&map, COOKIE_NAME), Some("abc"));
        assert_eq!(
            cookie_value(&headers(&[("cookie", "allot_consolex=1")]), COOKIE_NAME),
            None
        );
    }
}
