//! One error type for the API, answered as problem+json (RFC 9457) naming the field at fault, and
//! how each failure of the layers below becomes one.

use allot_shared::contract::{PROBLEM_CONTENT_TYPE, Problem};
use allot_shared::ids::IdError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::auth::TokenStoreError;
use crate::grants::GrantFailure;
use crate::ledger::LedgerError;
use crate::policies::PolicyStoreError;
use crate::pools::PoolStoreError;

/// An error answered as problem+json. A 503 says `Retry-After: 1`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    problem: Box<Problem>,
}

impl ApiError {
    /// An error with `status`, a short `title` and a `detail` for a human.
    pub fn new(status: StatusCode, title: &str, detail: impl Into<String>) -> Self {
        Self {
            status,
            problem: Box::new(Problem::new(status.as_u16(), title, detail)),
        }
    }

    /// 400: `field` is at fault.
    pub fn invalid(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "Invalid request", detail).with_field(field)
    }

    /// 404.
    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "Not found", detail)
    }

    /// 409.
    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "Conflict", detail)
    }

    /// 403: `detail` says which role or scope is missing.
    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "Forbidden", detail)
    }

    /// 500: the server failed in a way a retry does not mend.
    pub fn internal(title: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, title, detail)
    }

    /// 503: what the API depends on is unavailable; retry.
    pub fn unavailable(title: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, title, detail)
    }

    /// The field at fault, if the error names one.
    #[cfg(test)]
    pub fn field(&self) -> Option<&str> {
        self.problem.field.as_deref()
    }

    /// Names the field at fault.
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.problem = Box::new(self.problem.with_field(field));
        self
    }

    /// The problem body, for an answer that carries it among others (a batch's entry).
    pub fn into_problem(self) -> Problem {
        *self.problem
    }

    /// The problem of entry `index` of a batch's `list` refused alone: its field named within the
    /// batch (`list[index].field`, or `list[index]` when it named none).
    pub fn into_entry_problem(self, list: &str, index: usize) -> Problem {
        let mut problem = self.into_problem();
        problem.field = Some(match problem.field.take() {
            Some(field) => format!("{list}[{index}].{field}"),
            None => format!("{list}[{index}]"),
        });
        problem
    }

    /// Adds a member to the problem body.
    pub fn with_extension(mut self, name: &str, value: impl Into<serde_json::Value>) -> Self {
        self.problem = Box::new(self.problem.with_extension(name, value));
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.problem).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl From<PoolStoreError> for ApiError {
    fn from(error: PoolStoreError) -> Self {
        match error {
            PoolStoreError::Invalid(invalid) => Self::invalid(invalid.field, invalid.message),
            PoolStoreError::Contended => Self::conflict(error.to_string()),
            other => Self::unavailable("Store unavailable", other.to_string()),
        }
    }
}

impl From<LedgerError> for ApiError {
    fn from(error: LedgerError) -> Self {
        match error {
            LedgerError::Invalid(invalid) => Self::invalid(invalid.field, invalid.message),
            other => Self::unavailable("Ledger unavailable", other.to_string()),
        }
    }
}

impl From<PolicyStoreError> for ApiError {
    fn from(error: PolicyStoreError) -> Self {
        match error {
            PolicyStoreError::Invalid(invalid) => {
                let detail = invalid.to_string();
                // The bundle parser names the document's root `$`; the API calls it the body.
                let field = match invalid.field.as_str() {
                    "$" | "" => "body".to_owned(),
                    _ => invalid.field.to_string(),
                };
                Self::invalid(field, detail)
            }
            PolicyStoreError::UnknownVersion(_) | PolicyStoreError::NothingCurrent => {
                Self::not_found(error.to_string())
            }
            // Agents only go up (I13): a change that would move a region down is refused.
            PolicyStoreError::OlderThanCurrent { .. } => Self::conflict(error.to_string()),
            PolicyStoreError::CanaryRegionsLeftBehind { .. } => {
                Self::conflict(error.to_string()).with_field("canary")
            }
            PolicyStoreError::Contended => Self::conflict(error.to_string()),
            other => Self::unavailable("Store unavailable", other.to_string()),
        }
    }
}

impl From<TokenStoreError> for ApiError {
    fn from(error: TokenStoreError) -> Self {
        match error {
            TokenStoreError::Full => Self::conflict(error.to_string()),
            other => Self::unavailable("Store unavailable", other.to_string()),
        }
    }
}

impl From<GrantFailure> for ApiError {
    fn from(failure: GrantFailure) -> Self {
        let detail = failure.to_string();
        match failure {
            GrantFailure::NotLeader(leader) => {
                let error = Self::unavailable("Not the leader", detail);
                match leader {
                    Some(leader) => error
                        .with_extension("leader", leader.advertise_url)
                        .with_extension("leaderEpoch", leader.epoch.0),
                    None => error,
                }
            }
            GrantFailure::UnknownPool => Self::not_found(detail),
            GrantFailure::RegionNotInPool(_) => Self::forbidden(detail).with_field("region"),
            GrantFailure::ZeroWant => Self::invalid("want", detail),
            GrantFailure::LeaseIdOutlived => Self::invalid("leaseId", detail),
            GrantFailure::Overloaded | GrantFailure::Unavailable(_) => {
                Self::unavailable("Unavailable", detail)
            }
        }
    }
}

/// An identifier in a path or query that does not parse, naming where it was.
pub fn invalid_id(field: &str) -> impl Fn(IdError) -> ApiError + '_ {
    move |error| ApiError::invalid(field, error.to_string())
}

/// The refusals any authenticated call can get.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum Refused {
    /// Bad input: problem+json naming the field (a path segment, a query parameter) at fault.
    #[response(status = 400, content_type = "application/problem+json")]
    Invalid(#[to_schema] Problem),
    /// No token, or an unknown one.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthorized(#[to_schema] Problem),
    /// The token's role or region may not do this.
    #[response(status = 403, content_type = "application/problem+json")]
    Forbidden(#[to_schema] Problem),
    /// Not the leader (a change; `leader` names it), or the store or ledger unavailable.
    #[response(status = 503, content_type = "application/problem+json")]
    Unavailable(#[to_schema] Problem),
}

/// The refusals of a call's JSON body, beside [`Refused`]'s.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub(crate) enum BodyRefused {
    /// The body is larger than the route allows.
    #[response(status = 413, content_type = "application/problem+json")]
    TooLarge(#[to_schema] Problem),
    /// The body is not `application/json`.
    #[response(status = 415, content_type = "application/problem+json")]
    NotJson(#[to_schema] Problem),
}
