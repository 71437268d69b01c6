//! The console's way to the API: every read and change is an API request made in-process with the
//! signed-in operator's token, so the API alone decides who may do what and validates every
//! input. The console renders the API's answers, and its problem+json errors beside the field
//! they name.

use allot_shared::contract::Problem;
use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::ServiceExt;

/// Largest API answer the console reads, in bytes (10,000 pools fit well within it).
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// The API, called as one operator.
#[derive(Clone)]
pub struct Api {
    router: Router,
    token: String,
}

/// A failed API call: the API's own problem, or one the console describes.
#[derive(Debug, Clone)]
pub struct ApiProblem(pub Box<Problem>);

impl ApiProblem {
    /// A problem the console found itself, answered with `status`.
    pub fn local(status: StatusCode, detail: impl Into<String>) -> Self {
        Self(Box::new(Problem::new(
            status.as_u16(),
            status.canonical_reason().unwrap_or("Error"),
            detail,
        )))
    }

    /// 400: the console refused `field` before asking the API.
    pub fn invalid(field: &str, detail: impl Into<String>) -> Self {
        Self(Box::new(
            Problem::new(400, "Invalid request", detail).with_field(field),
        ))
    }

    /// The HTTP status the API answered.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The field at fault, when the API named one.
    pub fn field(&self) -> Option<&str> {
        self.0.field.as_deref()
    }

    /// What went wrong, for a human.
    pub fn detail(&self) -> &str {
        &self.0.detail
    }
}

impl Api {
    /// The API behind `router`, called with `token`.
    pub fn new(router: Router, token: String) -> Self {
        Self { router, token }
    }

    /// `GET path`, answered as `T`.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiProblem> {
        let bytes = self.call(Method::GET, path, None).await?;
        serde_json::from_slice(&bytes).map_err(|e| {
            ApiProblem::local(
                StatusCode::BAD_GATEWAY,
                format!("the API answered {path} in an unexpected shape: {e}"),
            )
        })
    }

    /// `GET path`, answered as raw JSON text.
    pub async fn get_text(&self, path: &str) -> Result<String, ApiProblem> {
        let bytes = self.call(Method::GET, path, None).await?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// `method path` with a JSON `body`; the answer's body, if any.
    pub async fn send<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: &B,
    ) -> Result<Vec<u8>, ApiProblem> {
        let json = serde_json::to_vec(body).map_err(|e| {
            ApiProblem::local(StatusCode::BAD_REQUEST, format!("unencodable body: {e}"))
        })?;
        self.call(method, path, Some(json)).await
    }

    /// `method path` without a body (a deletion, a promotion); the answer's body, if any.
    pub async fn act(&self, method: Method, path: &str) -> Result<Vec<u8>, ApiProblem> {
        self.call(method, path, None).await
    }

    /// `method path` with a raw JSON body (a pasted bundle goes to the API as typed).
    pub async fn send_raw(
        &self,
        method: Method,
        path: &str,
        json: Vec<u8>,
    ) -> Result<Vec<u8>, ApiProblem> {
        self.call(method, path, Some(json)).await
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        json: Option<Vec<u8>>,
    ) -> Result<Vec<u8>, ApiProblem> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token));
        if json.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(json.map(Body::from).unwrap_or_else(Body::empty))
            .map_err(|e| ApiProblem::local(StatusCode::BAD_REQUEST, format!("bad request: {e}")))?;
        let response = self
            .router
            .clone()
            .oneshot(request)
            .await
            .unwrap_or_else(|never| match never {});
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), MAX_ANSWER_BYTES)
            .await
            .map_err(|e| {
                ApiProblem::local(StatusCode::BAD_GATEWAY, format!("unreadable answer: {e}"))
            })?;
        if status.is_success() {
            return Ok(bytes.to_vec());
        }
        Err(serde_json::from_slice::<Problem>(&bytes)
            .map(|problem| ApiProblem(Box::new(problem)))
            .unwrap_or_else(|_| {
                ApiProblem::local(status, String::from_utf8_lossy(&bytes).into_owned())
            }))
    }
}
