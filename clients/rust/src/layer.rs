//! A tower [`Layer`] that asks the agent about every request of a service before the service sees
//! it: admitted, the request goes on and its response carries the `RateLimit` fields the caller
//! may see; refused, the caller gets the agent's 429 or 503 problem+json with `Retry-After`; no
//! decision (the agent unreachable), the request's [`FailMode`] says which.
//!
//! Who the request is from is the service's business: an identify function reads the request's
//! head (where the service's own authentication left the verified identity, say an extension) and
//! says how to admit it, or `None` to let it through unlimited.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use allot_shared::contract::{AdmissionRequest, PROBLEM_CONTENT_TYPE, Principal, Problem};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use tower::{Layer, Service};

use crate::body::{AllotBody, Completion, MeteredCost};
use crate::client::{AgentClient, Checked};

/// Requests let through or refused without a decision: `allot_client_undecided_total{outcome}`.
pub const UNDECIDED: &str = "allot_client_undecided_total";

/// What to do with a request the agent gave no decision for (unreachable, timed out, or refusing
/// the call itself: a wrong gateway token, a request it cannot read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Refuse it: 503 with `Retry-After: 1`. The default: never admit what was not decided.
    #[default]
    Closed,
    /// Let it through unlimited, counted in [`UNDECIDED`] and logged.
    Open,
}

/// How one request is to be admitted: from the verified identity only.
#[derive(Debug, Clone)]
pub struct Admission {
    tenant: TenantId,
    principal: Principal,
    route_group: RouteGroup,
    cost_units: u64,
    metered: bool,
    releases_slots: bool,
    renew_every: Option<Duration>,
    request_id: Option<DecisionId>,
    when_undecided: Option<FailMode>,
}

impl Admission {
    /// `principal` of `tenant` on `route_group`, at a cost of 1.
    pub fn new(tenant: TenantId, principal: Principal, route_group: RouteGroup) -> Self {
        Self {
            tenant,
            principal,
            route_group,
            cost_units: 1,
            metered: false,
            releases_slots: false,
            renew_every: None,
            request_id: None,
            when_undecided: None,
        }
    }

    /// Costs `units` (1 to 2^30).
    #[must_use]
    pub fn cost(mut self, units: u64) -> Self {
        self.cost_units = units;
        self
    }

    /// Charges `estimate_units` now and the actual cost when the response ends: the service states
    /// it through the [`MeteredCost`] in the request's extensions (unstated, the estimate stands).
    #[must_use]
    pub fn metered(mut self, estimate_units: u64) -> Self {
        self.cost_units = estimate_units;
        self.metered = true;
        self
    }

    /// The route's rules hold concurrency slots: give them back when the response ends.
    #[must_use]
    pub fn releases_slots(mut self) -> Self {
        self.releases_slots = true;
        self
    }

    /// Renews the request's slots every `period` while the response runs (a third of the rule's
    /// `concurrencyLeaseTtlMs` is a good period); implies [`Admission::releases_slots`].
    #[must_use]
    pub fn renew_every(mut self, period: Duration) -> Self {
        self.releases_slots = true;
        self.renew_every = Some(period);
        self
    }

    /// The request's id, when the service has one that is stable across the caller's retries
    /// (1 to 64 of `A-Z a-z 0-9 - _ .`, from a source the caller cannot choose). Otherwise each
    /// request gets a fresh UUIDv7.
    #[must_use]
    pub fn request_id(mut self, id: DecisionId) -> Self {
        self.request_id = Some(id);
        self
    }

    /// This request's fail mode, instead of the layer's.
    #[must_use]
    pub fn when_undecided(mut self, mode: FailMode) -> Self {
        self.when_undecided = Some(mode);
        self
    }

    fn to_request(&self, method: &http::Method) -> Result<AdmissionRequest, String> {
        let request_id = match &self.request_id {
            Some(id) => id.clone(),
            None => {
                DecisionId::parse(&uuid::Uuid::now_v7().to_string()).map_err(|e| e.to_string())?
            }
        };
        Ok(AdmissionRequest {
            request_id,
            tenant_id: self.tenant.clone(),
            principal: self.principal.clone(),
            route_group: self.route_group.clone(),
            method: method.as_str().to_ascii_uppercase(),
            cost_hint: self.cost_units,
            policy_epoch: None,
            dry_run: false,
            metered: self.metered,
        })
    }
}

/// The layer: wraps a service in [`Allot`].
pub struct AllotLayer<F> {
    client: AgentClient,
    identify: Arc<F>,
    when_undecided: FailMode,
}

impl<F> Clone for AllotLayer<F> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            identify: self.identify.clone(),
            when_undecided: self.when_undecided,
        }
    }
}

impl<F> AllotLayer<F>
where
    F: Fn(&http::request::Parts) -> Option<Admission> + Send + Sync + 'static,
{
    /// Asks the agent behind `client` about every request `identify` says how to admit.
    pub fn new(client: AgentClient, identify: F) -> Self {
        Self {
            client,
            identify: Arc::new(identify),
            when_undecided: FailMode::default(),
        }
    }

    /// What to do without a decision, for requests that do not say (default [`FailMode::Closed`]).
    #[must_use]
    pub fn when_undecided(mut self, mode: FailMode) -> Self {
        self.when_undecided = mode;
        self
    }
}

impl<S, F> Layer<S> for AllotLayer<F> {
    type Service = Allot<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        Allot {
            inner,
            client: self.client.clone(),
            identify: self.identify.clone(),
            when_undecided: self.when_undecided,
        }
    }
}

/// A service whose requests the agent admits first.
pub struct Allot<S, F> {
    inner: S,
    client: AgentClient,
    identify: Arc<F>,
    when_undecided: FailMode,
}

impl<S: Clone, F> Clone for Allot<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            client: self.client.clone(),
            identify: self.identify.clone(),
            when_undecided: self.when_undecided,
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, F, RequestBody, ResponseBody> Service<Request<RequestBody>> for Allot<S, F>
where
    S: Service<Request<RequestBody>, Response = Response<ResponseBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    F: Fn(&http::request::Parts) -> Option<Admission> + Send + Sync + 'static,
    RequestBody: Send + 'static,
    ResponseBody: Send + 'static,
{
    type Response = Response<AllotBody<ResponseBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<RequestBody>) -> Self::Future {
        // The clone that was polled ready serves this request; the fresh one waits for the next.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        let (parts, body) = request.into_parts();
        let admission = (self.identify)(&parts);
        let client = self.client.clone();
        let when_undecided = self.when_undecided;
        Box::pin(async move {
            let Some(admission) = admission else {
                return pass(inner, parts, body, None).await;
            };
            let mode = admission.when_undecided.unwrap_or(when_undecided);
            let wire = match admission.to_request(&parts.method) {
                Ok(wire) => wire,
                Err(why) => return undecided(mode, &why, inner, parts, body).await,
            };
            match client.check(&wire).await {
                Ok(checked) if checked.allowed => {
                    admitted(inner, parts, body, &client, &admission, wire, checked).await
                }
                Ok(checked) => Ok(refusal(&checked)),
                Err(error) => undecided(mode, &error.to_string(), inner, parts, body).await,
            }
        })
    }
}

/// Serves an admitted request: its meter in the extensions, its completion on the body, and the
/// caller's `RateLimit` fields on the response.
async fn admitted<S, RequestBody, ResponseBody>(
    inner: S,
    mut parts: http::request::Parts,
    body: RequestBody,
    client: &AgentClient,
    admission: &Admission,
    wire: AdmissionRequest,
    checked: Checked,
) -> Result<Response<AllotBody<ResponseBody>>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResponseBody>>,
{
    let meter = admission.metered.then(MeteredCost::new);
    if let Some(meter) = &meter {
        parts.extensions.insert(meter.clone());
    }
    let caller_headers = checked.caller_headers.clone();
    parts.extensions.insert(checked);
    let completion = Completion::start(
        client.clone(),
        wire,
        admission.releases_slots,
        meter,
        admission.renew_every,
    );
    let mut response = pass(inner, parts, body, completion).await?;
    for (name, value) in &caller_headers {
        if name != header::RETRY_AFTER {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    Ok(response)
}

/// Passes the request to the service; its response ends with `completion`.
async fn pass<S, RequestBody, ResponseBody>(
    mut inner: S,
    parts: http::request::Parts,
    body: RequestBody,
    completion: Option<Completion>,
) -> Result<Response<AllotBody<ResponseBody>>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResponseBody>>,
{
    // On an error `completion` drops here, and so still runs.
    let response = inner.call(Request::from_parts(parts, body)).await?;
    Ok(response.map(|body| AllotBody::served(body, completion)))
}

/// The agent's refusal, as it worded it for the caller.
fn refusal<B>(checked: &Checked) -> Response<AllotBody<B>> {
    let problem = checked.problem.clone().unwrap_or_else(|| {
        Problem::new(checked.status, "Rate limit exceeded", "Too many requests.")
    });
    let status = StatusCode::from_u16(checked.status).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    problem_response(status, &problem, &checked.caller_headers)
}

/// No decision: refused with 503 and `Retry-After: 1`, or let through, as `mode` says.
async fn undecided<S, RequestBody, ResponseBody>(
    mode: FailMode,
    why: &str,
    inner: S,
    parts: http::request::Parts,
    body: RequestBody,
) -> Result<Response<AllotBody<ResponseBody>>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResponseBody>>,
{
    match mode {
        FailMode::Closed => {
            metrics::counter!(UNDECIDED, "outcome" => "refused").increment(1);
            tracing::warn!(why, "no decision from the agent: refused (fail closed)");
            let mut headers = http::HeaderMap::new();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            Ok(problem_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &Problem::new(
                    503,
                    "Rate limiter unavailable",
                    "The request could not be checked against its quota. Retry later.",
                ),
                &headers,
            ))
        }
        FailMode::Open => {
            metrics::counter!(UNDECIDED, "outcome" => "admitted").increment(1);
            tracing::warn!(
                why,
                "no decision from the agent: let through unlimited (fail open)"
            );
            pass(inner, parts, body, None).await
        }
    }
}

fn problem_response<B>(
    status: StatusCode,
    problem: &Problem,
    headers: &http::HeaderMap,
) -> Response<AllotBody<B>> {
    let bytes = Bytes::from(serde_json::to_vec(problem).unwrap_or_default());
    let mut response = Response::new(AllotBody::refused(bytes));
    *response.status_mut() = status;
    for (name, value) in headers {
        response.headers_mut().insert(name.clone(), value.clone());
    }
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admission_becomes_the_wire_request() {
        let principal = Principal {
            kind: allot_shared::contract::PrincipalType::User,
            id: "U-1".to_owned(),
            api_key_id: None,
        };
        let admission = Admission::new(
            TenantId::parse("atlas").expect("tenant"),
            principal,
            RouteGroup::parse("read").expect("route"),
        )
        .metered(5);
        let first = admission.to_request(&http::Method::POST).expect("request");
        let second = admission.to_request(&http::Method::POST).expect("request");
        assert_eq!((first.cost_hint, first.metered), (5, true));
        assert_eq!(first.method, "POST");
        assert_ne!(first.request_id, second.request_id, "fresh ids per request");
        assert!(first.validate().is_ok());
        let pinned = admission
            .request_id(DecisionId::parse("req-1").expect("id"))
            .to_request(&http::Method::GET)
            .expect("request");
        assert_eq!(pinned.request_id.as_str(), "req-1");
    }
}
