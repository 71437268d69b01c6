//! The typed client: one method per agent endpoint, every call bounded in time and attempts.
//!
//! A call that gets no answer (the connection fails, the call times out, a proxy in between answers
//! 500, 502 or 504) is tried again with the same body, so an admission keeps its `requestId` and a
//! rule that says `idempotent` answers the retry with the first admission instead of charging it
//! twice. An answer, even a refusal, is never retried.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use allot_shared::FieldError;
use allot_shared::contract::{
    AdmissionRequest, Decision, PROBLEM_CONTENT_TYPE, Problem, QuotaQuery, QuotaStatus,
    SettleAnswer, SettleRequest, SlotRenewal,
};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, StatusCode, header};
use serde::de::DeserializeOwned;

/// How long one attempt may take unless set otherwise: the agent answers within its own 2 s
/// request bound, and well within this when healthy.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// Attempts of one call unless set otherwise (the first and one retry).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 2;
/// Most attempts a client may be set to make (I10: every retry is bounded).
pub const MAX_ATTEMPTS: u32 = 5;
/// Longest a client may let one attempt take.
pub const MAX_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause before the first retry unless set otherwise; each later one doubles it, plus up to as
/// much again of random jitter, so callers that failed together do not retry together.
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_millis(20);

/// The headers of a `/v1/check` answer a caller may be shown.
const CALLER_HEADERS: [&str; 4] = [
    "retry-after",
    "ratelimit-policy",
    "ratelimit",
    "x-allot-soft-limit-exceeded",
];

/// Why a call has no answer to give.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The request was not sent: it breaks the contract (the field at fault is named).
    #[error("invalid request: {0}")]
    Invalid(#[from] FieldError),
    /// No answer after every attempt.
    #[error("the agent at {url} did not answer after {attempts} attempt(s): {last}")]
    Unreachable {
        /// The agent's base URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// What the last attempt met.
        last: String,
    },
    /// The agent answered, and refused the call (a bad gateway token, bad input, a settlement of
    /// nothing open, a quota read before the agent has a policy).
    #[error("the agent refused the call ({status}): {}", problem.detail)]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The agent's problem+json.
        problem: Box<Problem>,
    },
    /// The client cannot be built as asked.
    #[error("client configuration: {0}")]
    Config(String),
}

impl ClientError {
    /// The status of a refusal, if this is one.
    pub fn refused_status(&self) -> Option<u16> {
        match self {
            Self::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// The answer of `POST /v1/check`: the decision as a proxy should pass it on.
#[derive(Debug, Clone)]
pub struct Checked {
    /// 200 when admitted, 429 when a limit said no, 503 when a fail-closed rule could not decide.
    pub status: u16,
    /// Whether the request may go on.
    pub allowed: bool,
    /// The headers the caller may be shown, as the agent chose them: `Retry-After`,
    /// `RateLimit-Policy`, `RateLimit` and `X-Allot-Soft-Limit-Exceeded` (only those it sent).
    pub caller_headers: HeaderMap,
    /// The shadow rules that would have refused the request, for the service's logs; never for
    /// the caller.
    pub shadow_denied: Option<String>,
    /// A metered admission's settle deadline, epoch ms.
    pub settle_by_ms: Option<u64>,
    /// A refusal's problem+json, as the caller may read it.
    pub problem: Option<Problem>,
}

impl Checked {
    /// The whole seconds a refused caller should wait, when the agent said.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.caller_headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }
}

/// Builds an [`AgentClient`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    base_url: String,
    gateway_token: String,
    tls: allot_net::ClientTls,
    call_timeout: Duration,
    max_attempts: u32,
    retry_backoff: Duration,
}

impl ClientBuilder {
    /// Trusts the CA certificates in this PEM file (instead of the system's) for an `https://`
    /// agent.
    #[must_use]
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls.ca = Some(path.into());
        self
    }

    /// Presents this certificate and key (PEM files) to an agent that asks for one.
    #[must_use]
    pub fn client_certificate(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls.cert = Some(cert.into());
        self.tls.key = Some(key.into());
        self
    }

    /// How long one attempt may take (default [`DEFAULT_CALL_TIMEOUT`], at most
    /// [`MAX_CALL_TIMEOUT`]).
    #[must_use]
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// How many times one call is tried in all (default [`DEFAULT_MAX_ATTEMPTS`], 1 to
    /// [`MAX_ATTEMPTS`]).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The pause before the first retry (default [`DEFAULT_RETRY_BACKOFF`]).
    #[must_use]
    pub fn retry_backoff(mut self, backoff: Duration) -> Self {
        self.retry_backoff = backoff;
        self
    }

    /// The client, or what is wrong with the settings.
    pub fn build(self) -> Result<AgentClient, ClientError> {
        let base_url = self.base_url.trim_end_matches('/').to_owned();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(ClientError::Config(format!(
                "the agent URL must start with http:// or https://, not {base_url:?}"
            )));
        }
        if self.gateway_token.trim().is_empty() {
            return Err(ClientError::Config("the gateway token is empty".to_owned()));
        }
        if !(1..=MAX_ATTEMPTS).contains(&self.max_attempts) {
            return Err(ClientError::Config(format!(
                "max attempts must be 1 to {MAX_ATTEMPTS}, not {}",
                self.max_attempts
            )));
        }
        if self.call_timeout.is_zero() || self.call_timeout > MAX_CALL_TIMEOUT {
            return Err(ClientError::Config(format!(
                "the call timeout must be above 0 and at most {MAX_CALL_TIMEOUT:?}"
            )));
        }
        let builder = reqwest::Client::builder()
            .timeout(self.call_timeout)
            .connect_timeout(self.call_timeout);
        let http = self
            .tls
            .configure(builder)
            .map_err(|e| ClientError::Config(e.to_string()))?
            .build()
            .map_err(|e| ClientError::Config(e.to_string()))?;
        Ok(AgentClient {
            shared: Arc::new(Shared {
                http,
                authorization: format!("Bearer {}", self.gateway_token.trim()),
                base_url,
                max_attempts: self.max_attempts,
                retry_backoff: self.retry_backoff,
            }),
        })
    }
}

/// A client of one region agent's gateway API. Cheap to clone (one connection pool).
#[derive(Clone)]
pub struct AgentClient {
    shared: Arc<Shared>,
}

struct Shared {
    http: reqwest::Client,
    base_url: String,
    /// `Bearer <gateway token>`.
    authorization: String,
    max_attempts: u32,
    retry_backoff: Duration,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("AgentClient")
            .field("base_url", &self.shared.base_url)
            .field("max_attempts", &self.shared.max_attempts)
            .finish_non_exhaustive()
    }
}

/// One answer, read whole.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn is_problem(&self) -> bool {
        self.headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_CONTENT_TYPE.as_bytes()))
    }

    fn problem(&self) -> Problem {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            Problem::new(
                self.status.as_u16(),
                self.status.canonical_reason().unwrap_or("Error"),
                String::from_utf8_lossy(&self.body).trim(),
            )
        })
    }

    fn refused(&self) -> ClientError {
        ClientError::Refused {
            status: self.status.as_u16(),
            problem: Box::new(self.problem()),
        }
    }

    fn json<T: DeserializeOwned>(&self, url: &str) -> Result<T, ClientError> {
        serde_json::from_slice(&self.body).map_err(|e| ClientError::Unreachable {
            url: url.to_owned(),
            attempts: 1,
            last: format!("an answer that is not the contract's: {e}"),
        })
    }
}

impl AgentClient {
    /// A builder for the agent at `base_url` (`https://agent.eu.internal:7701`), calling with
    /// `gateway_token`.
    pub fn builder(base_url: impl Into<String>, gateway_token: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.into(),
            gateway_token: gateway_token.into(),
            tls: allot_net::ClientTls::default(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
        }
    }

    /// The agent's base URL.
    pub fn base_url(&self) -> &str {
        &self.shared.base_url
    }

    /// `POST /v1/admit`: the decision.
    pub async fn admit(&self, request: &AdmissionRequest) -> Result<Decision, ClientError> {
        request.validate()?;
        let answer = self.post("/v1/admit", request).await?;
        match answer.status {
            StatusCode::OK => answer.json(&self.shared.base_url),
            _ => Err(answer.refused()),
        }
    }

    /// `POST /v1/check`: the decision as a proxy passes it on (status, the headers the caller may
    /// see, the problem of a refusal).
    pub async fn check(&self, request: &AdmissionRequest) -> Result<Checked, ClientError> {
        request.validate()?;
        let answer = self.post("/v1/check", request).await?;
        let header = |name: &str| {
            answer
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let decided = answer.status == StatusCode::OK
            || (matches!(answer.status.as_u16(), 429 | 503) && answer.is_problem());
        if !decided {
            return Err(answer.refused());
        }
        let mut caller_headers = HeaderMap::new();
        for name in CALLER_HEADERS {
            if let Some(value) = answer.headers.get(name) {
                caller_headers.insert(HeaderName::from_static(name), value.clone());
            }
        }
        let allowed = answer.status == StatusCode::OK;
        Ok(Checked {
            status: answer.status.as_u16(),
            allowed,
            shadow_denied: header("x-allot-shadow-denied"),
            settle_by_ms: header("x-allot-settle-by-ms").and_then(|v| v.parse().ok()),
            problem: (!allowed).then(|| answer.problem()),
            caller_headers,
        })
    }

    /// `POST /v1/release`: gives back the concurrency slots `request` holds (idempotent).
    pub async fn release(&self, request: &AdmissionRequest) -> Result<(), ClientError> {
        request.validate()?;
        let answer = self.post("/v1/release", request).await?;
        match answer.status {
            StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            _ => Err(answer.refused()),
        }
    }

    /// `POST /v1/renew`: extends the concurrency slots `request` holds (a heartbeat).
    pub async fn renew(&self, request: &AdmissionRequest) -> Result<SlotRenewal, ClientError> {
        request.validate()?;
        let answer = self.post("/v1/renew", request).await?;
        match answer.status {
            StatusCode::OK => answer.json(&self.shared.base_url),
            _ => Err(answer.refused()),
        }
    }

    /// `POST /v1/settle`: the actual cost of a metered admission. A refusal says 404 when nothing
    /// of that id is open, 409 when it was settled before with another cost.
    pub async fn settle(&self, settlement: &SettleRequest) -> Result<SettleAnswer, ClientError> {
        settlement.validate()?;
        let answer = self.post("/v1/settle", settlement).await?;
        match answer.status {
            StatusCode::OK => answer.json(&self.shared.base_url),
            _ => Err(answer.refused()),
        }
    }

    /// `GET /v1/quota`: the caller's own quotas and what is left of them.
    pub async fn quota(&self, query: &QuotaQuery) -> Result<QuotaStatus, ClientError> {
        query.validate()?;
        let query =
            serde_urlencoded::to_string(query).map_err(|e| ClientError::Config(e.to_string()))?;
        let url = format!("{}/v1/quota?{query}", self.shared.base_url);
        let answer = self.send(|| self.shared.http.get(&url)).await?;
        match answer.status {
            StatusCode::OK => answer.json(&self.shared.base_url),
            _ => Err(answer.refused()),
        }
    }

    async fn post(&self, path: &str, body: &impl serde::Serialize) -> Result<Answer, ClientError> {
        let url = format!("{}{path}", self.shared.base_url);
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Config(e.to_string()))?;
        self.send(|| {
            self.shared
                .http
                .post(&url)
                .header(header::CONTENT_TYPE, "application/json")
                .body(body.clone())
        })
        .await
    }

    /// Sends what `request` builds until an attempt gets an answer, at most `max_attempts` times.
    async fn send(
        &self,
        request: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Answer, ClientError> {
        let shared = &self.shared;
        let mut last = String::new();
        for attempt in 1..=shared.max_attempts {
            if attempt > 1 {
                tokio::time::sleep(backoff(shared.retry_backoff, attempt)).await;
                metrics::counter!(RETRIES).increment(1);
            }
            match self.attempt(&request).await {
                Ok(answer) if !is_no_answer(answer.status) => return Ok(answer),
                Ok(answer) => last = format!("{} from something between", answer.status),
                Err(error) => last = error,
            }
        }
        Err(ClientError::Unreachable {
            url: shared.base_url.clone(),
            attempts: shared.max_attempts,
            last,
        })
    }

    async fn attempt(
        &self,
        request: &impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Answer, String> {
        let response = request()
            .header(header::AUTHORIZATION, &self.shared.authorization)
            .send()
            .await
            .map_err(describe)?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(describe)?;
        Ok(Answer {
            status,
            headers,
            body,
        })
    }
}

/// Retries counted: `allot_client_retries_total`.
pub const RETRIES: &str = "allot_client_retries_total";

/// Statuses that are no answer from the agent, which never sends them: a proxy's or load
/// balancer's, or a crash's. (The agent's own 503 is an answer: a decision on `/v1/check`, "no
/// policy yet" on `/v1/quota`.)
fn is_no_answer(status: StatusCode) -> bool {
    matches!(status.as_u16(), 500 | 502 | 504)
}

/// The pause before attempt `attempt` (2 or more): `base * 2^(attempt-2)` plus up to as much again.
fn backoff(base: Duration, attempt: u32) -> Duration {
    let pause = base.saturating_mul(1 << attempt.saturating_sub(2).min(16));
    let jitter_ms = rand::random_range(0..=u64::try_from(pause.as_millis()).unwrap_or(u64::MAX));
    pause + Duration::from_millis(jitter_ms)
}

/// A transport error in one line, without the token (reqwest's errors never carry headers).
fn describe(error: reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_builder_refuses_what_it_cannot_bound() {
        let refused = |builder: ClientBuilder| match builder.build() {
            Err(ClientError::Config(why)) => why,
            other => panic!("built: {other:?}"),
        };
        assert!(refused(AgentClient::builder("agent:7701", "token")).contains("http://"));
        assert!(refused(AgentClient::builder("http://agent", " ")).contains("token"));
        assert!(
            refused(AgentClient::builder("http://agent", "t").max_attempts(0)).contains("attempts")
        );
        assert!(
            refused(AgentClient::builder("http://agent", "t").max_attempts(MAX_ATTEMPTS + 1))
                .contains("attempts")
        );
        assert!(
            refused(AgentClient::builder("http://agent", "t").call_timeout(Duration::ZERO))
                .contains("timeout")
        );
        assert!(
            refused(AgentClient::builder("https://agent", "t").ca_file("/nonexistent/ca.pem"))
                .contains("/nonexistent/ca.pem")
        );
        let client = AgentClient::builder("http://agent:7701/", "secret-token")
            .build()
            .expect("client");
        assert_eq!(client.base_url(), "http://agent:7701");
        assert!(!format!("{client:?}").contains("secret-token"));
    }

    #[test]
    fn backoff_doubles_with_at_most_as_much_again_of_jitter() {
        let base = Duration::from_millis(20);
        for _ in 0..200 {
            let second = backoff(base, 2);
            assert!((base..=base * 2).contains(&second), "{second:?}");
            let third = backoff(base, 3);
            assert!((base * 2..=base * 4).contains(&third), "{third:?}");
        }
        // Huge attempt numbers saturate instead of overflowing.
        assert!(backoff(base, u32::MAX) >= base);
    }

    #[test]
    fn only_statuses_the_agent_never_sends_are_retried() {
        for status in [500, 502, 504] {
            assert!(is_no_answer(StatusCode::from_u16(status).expect("status")));
        }
        for status in [200, 204, 400, 401, 404, 409, 429, 503] {
            assert!(!is_no_answer(StatusCode::from_u16(status).expect("status")));
        }
    }
}
