//! Envoy's rate limit service (v3) over gRPC:
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! The messages come from Allot's own wire-compatible subset of Envoy's API
//! (`region-agent/proto/envoy_rls_v3_subset*.proto`, generated at build time into `OUT_DIR`).
//!
//! # Descriptor mapping
//! Every descriptor of a request becomes one [`AdmissionRequest`]; a call's descriptors are decided
//! **all or none** ([`Agent::admit_together`]): one store call for all their regional rules, their
//! global reservations committed only if every one is admitted, so a call that is `OVER_LIMIT`
//! spends nothing for any of its descriptors:
//!
//! | descriptor entry | admission request | |
//! |---|---|---|
//! | `tenant` | `tenantId` | required |
//! | `user` / `api_key` / `remote_address` | `principal` of type `user` / `api_key` / `ip` | exactly one required |
//! | `route_group` | `routeGroup` | required |
//! | `method` | `method` | optional (default `UNKNOWN`, which no method matcher names) |
//! | `request_id` | `requestId` (Envoy's `x-request-id`); else a fresh random id | optional |
//! | `allot_charge` | `after_response`: charge the cost, never deny (below) | optional |
//! | `allot_release` | `stream_done`: free the request's concurrency slots (below) | optional, with `request_id` |
//! | any other key | ignored | lets one Envoy action list feed several services |
//!
//! - The cost is the descriptor's `hits_addend`, else the request's `hits_addend` when non-zero, else 1
//!   (a cost must be in `[1, 2^30]`).
//! - A descriptor `hits_addend` of **0** is a *dry run* (the admission API's `dryRun`): the descriptor
//!   is decided at cost 1 and answered as usual, but nothing is spent anywhere. It asks "would one
//!   more be admitted, and how much is left?" without using any of it. (The request-level
//!   `hits_addend` cannot say this: proto3 cannot tell an explicit 0 from an unset field, and Envoy
//!   sends 0 for "1".)
//! - A descriptor with `allot_charge: after_response` is a **charge after the response**, for
//!   costs known only once it is done (model tokens, bytes): Envoy's rate limit filter applied on
//!   stream done, its `hits_addend` the actual cost. It is charged as a metered admission estimated
//!   at 0 is settled ([`crate::service::settlement`]): never denied, charged at once where the
//!   rules have room, owed (paid first by the principal's next requests, the pool's within its
//!   `settleDebtPerRegion`) where they do not, written off and counted beyond. Its status is `OK`
//!   when all of it was charged at once, else `OVER_LIMIT` (the next request will feel it); Envoy
//!   ignores both once the stream is done. A `hits_addend` of 0 has nothing to charge and is
//!   refused.
//! - The request id is the `request_id` entry (Envoy's `x-request-id`, copied by a
//!   `request_headers` action), else a fresh random [`DecisionId`] per descriptor. Concurrency
//!   slots are held under it, so that a descriptor with `allot_release: stream_done` and the same
//!   id, sent by Envoy when the stream is done (`apply_on_stream_done`), frees them as
//!   `/v1/release` does; it answers `OK`, which Envoy ignores. A release without `request_id` is
//!   refused, as is Envoy's `is_negative_hits` (nothing is given back over RLS).
//! - `domain` is not used for matching (the `tenant` entry is); it is only bounded.
//! - Every descriptor is validated before any is decided; a missing or repeated entry, an invalid
//!   value, more than [`MAX_DESCRIPTORS`] descriptors or [`MAX_ENTRIES`] entries, or an entry over
//!   [`MAX_ENTRY_BYTES`] answers `INVALID_ARGUMENT` naming the descriptor and key, and debits nothing.
//!   So do descriptors one store call cannot decide together: two tenants in one call (or a hot
//!   tenant's principals in two sub-slots), one sliding-log key twice, or more than 8 distinct
//!   regional rules.
//! - Order: checks (`hits_addend` 0) first; if one is over, the call is over and the descriptors
//!   that would spend are answered as checks too (nothing spent). Then the spending descriptors,
//!   together; then charges after the response; then releases.
//!
//! # Answer
//! - allowed -> `OK`; denied (rate or concurrency) -> `OVER_LIMIT`; `overall_code` is `OVER_LIMIT` when
//!   any descriptor is. A call denied is denied for every descriptor that would have spent: each is
//!   `OVER_LIMIT`, naming the rule that denied the call.
//! - `duration_until_reset` = the decision's `retryAfterMs` (0 when allowed, and 0 when the request can
//!   never succeed, `retryAfterMs = -1`).
//! - `current_limit` = `{requests_per_unit: limit, unit: UNKNOWN, name: policy id}` and
//!   `limit_remaining` = `remaining`. The unit is `UNKNOWN` on purpose: Allot's rules are token buckets
//!   and windows of any length, which Envoy's fixed units cannot express; `requests_per_unit` is the
//!   rule's capacity in whole units and the real timing is in `duration_until_reset`. Both are left
//!   unset for callers that did not authenticate (principal `ip`) and whenever the rule the decision
//!   names is not of the caller's own scope (tenant, route, global, concurrency), whether it denied or
//!   was only the most constraining rule of an admission: the HTTP API's `RateLimit` rule
//!   ([`crate::visibility`]), since Envoy may turn them into response headers.
//! - A shadow or soft rule that would have denied a descriptor: `x-allot-soft-limit-exceeded` in
//!   `response_headers_to_add` (to the caller; the soft rules it may see, else `?1`) and
//!   `x-allot-shadow-denied` in `request_headers_to_add` (to the upstream service, never the caller).
//! - `response_headers_to_add` carries `x-allot-decision-id` (the first descriptor's decision id),
//!   except for unauthenticated callers.
//!
//! # Fail-closed outages and `failure_mode_deny`
//! When a descriptor's decision is a fail-closed outage (reason `LIMITER_UNAVAILABLE` or
//! `POLICY_ERROR`), the whole call answers gRPC `UNAVAILABLE` instead of `OVER_LIMIT`, so Envoy's own
//! `failure_mode_deny` decides: `true` turns it into a denial (Envoy answers 500 by default), `false`
//! lets the request through. Allot's per-rule fail modes have already decided everything they could
//! (`open` and `local_bounded` rules answer `OK`/`OVER_LIMIT` themselves), so `UNAVAILABLE` only
//! reaches Envoy for rules that must not be guessed. Nothing of the call was spent: its descriptors
//! are decided together.
//!
//! # Authentication and bounds
//! Gateways send metadata `authorization: Bearer <gateway token>` (the HTTP API's tokens); otherwise
//! `UNAUTHENTICATED`. Messages are bounded to [`MAX_MESSAGE_BYTES`], calls to
//! [`crate::http::REQUEST_TIMEOUT`], concurrency to [`crate::http::MAX_CONCURRENT_REQUESTS`] calls.

use std::sync::Arc;

use allot_shared::contract::{AdmissionRequest, Decision, PrincipalType, Reason, SettleAnswer};
use allot_shared::ids::{DecisionId, PoolId};
use allot_shared::policy::PolicyBundle;
use tonic::{Request, Response, Status};

pub use crate::envoy::{DEFAULT_METHOD, MAX_ENTRIES, MAX_ENTRY_BYTES, MAX_MESSAGE_BYTES};
use crate::envoy::{authorize_gateway, request_from_entries};
use crate::http::{AgentApi, MAX_CONCURRENT_REQUESTS, REQUEST_TIMEOUT};
use crate::service::Agent;

/// The generated messages, server and client (Allot's subset of Envoy's v3 API).
#[allow(missing_docs, clippy::all, clippy::unwrap_used)]
pub mod proto {
    /// `envoy.*`
    pub mod envoy {
        /// `envoy.service.*`
        pub mod service {
            /// `envoy.service.ratelimit.*`
            pub mod ratelimit {
                /// `envoy.service.ratelimit.v3`: the service, request and response.
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ratelimit.v3");
                }
            }
        }
        /// `envoy.extensions.*`
        pub mod extensions {
            /// `envoy.extensions.common.*`
            pub mod common {
                /// `envoy.extensions.common.ratelimit.*`
                pub mod ratelimit {
                    /// `envoy.extensions.common.ratelimit.v3`: descriptors.
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                    }
                }
            }
        }
        /// `envoy.config.*`
        pub mod config {
            /// `envoy.config.core.*`
            pub mod core {
                /// `envoy.config.core.v3`: header values.
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
    }
}

use proto::envoy::config::core::v3::HeaderValue;
use proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit,
};
use proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// Most descriptors in one call (I10).
pub const MAX_DESCRIPTORS: usize = 16;
/// The response header naming the first descriptor's decision.
pub const DECISION_ID_HEADER: &str = "x-allot-decision-id";

/// The RLS implementation over an agent.
#[derive(Clone)]
pub struct RateLimitApi {
    agent: Arc<Agent>,
    gateway_tokens: Arc<Vec<String>>,
    /// Calls decided at once; the rest wait ([`MAX_CONCURRENT_REQUESTS`]).
    permits: Arc<tokio::sync::Semaphore>,
    /// Each call's [`REQUEST_TIMEOUT`], on a shared coarse tick rather than a timer per call.
    deadlines: allot_net::CoarseDeadlines,
}

impl RateLimitApi {
    /// Serves `api`'s agent to gateways presenting one of `api`'s tokens.
    pub fn new(api: &AgentApi) -> Self {
        Self {
            agent: api.agent.clone(),
            gateway_tokens: api.gateway_tokens.clone(),
            permits: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REQUESTS)),
            deadlines: allot_net::CoarseDeadlines::for_limit(REQUEST_TIMEOUT),
        }
    }

    fn authorize<T>(&self, request: &Request<T>) -> Result<(), Status> {
        authorize_gateway(&self.gateway_tokens, request)
    }
}

fn invalid(index: usize, key: &str, message: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("descriptors[{index}].{key}: {message}"))
}

/// Turns one descriptor into an admission request, or says which entry is wrong.
pub fn admission_request(
    index: usize,
    descriptor: &RateLimitDescriptor,
    request_hits: u32,
) -> Result<AdmissionRequest, Status> {
    if descriptor.is_negative_hits {
        return Err(invalid(
            index,
            "is_negative_hits",
            "hits are never given back over RLS (a denied call spends nothing already; free a \
             request's concurrency slots with allot_release)",
        ));
    }
    let (cost_hint, dry_run) = match descriptor.hits_addend {
        Some(0) => (1, true),
        Some(hits) => (hits, false),
        None if request_hits > 0 => (u64::from(request_hits), false),
        None => (1, false),
    };
    let mut request = request_from_entries(
        descriptor
            .entries
            .iter()
            .map(|entry| (entry.key.as_str(), entry.value.as_str())),
        descriptor.entries.len(),
        cost_hint,
        &|key, message| invalid(index, key, message),
    )?;
    request.dry_run = dry_run;
    let mut ids = descriptor
        .entries
        .iter()
        .filter(|entry| entry.key == REQUEST_ID_ENTRY);
    if let Some(id) = ids.next() {
        if ids.next().is_some() {
            return Err(invalid(index, REQUEST_ID_ENTRY, "given twice"));
        }
        request.request_id =
            DecisionId::parse(&id.value).map_err(|e| invalid(index, REQUEST_ID_ENTRY, e))?;
    }
    Ok(request)
}

/// The entry that names the request a descriptor belongs to: Envoy's `x-request-id`, copied by a
/// `request_headers` action. Its concurrency slots are held under it, so that the descriptor sent
/// when the stream is done ([`RELEASE_ENTRY`]) can free them.
pub const REQUEST_ID_ENTRY: &str = "request_id";

/// The entry that marks a descriptor as the release of its request's concurrency slots, and its
/// one value.
pub const RELEASE_ENTRY: (&str, &str) = ("allot_release", "stream_done");

/// The entry that marks a descriptor as a charge after the response, and its one value.
pub const CHARGE_ENTRY: (&str, &str) = ("allot_charge", "after_response");

/// What a descriptor asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asks {
    /// An admission (or, at `hits_addend` 0, a check).
    Admission,
    /// A charge after the response ([`CHARGE_ENTRY`]).
    ChargeAfterResponse,
    /// The release of the concurrency slots its request holds ([`RELEASE_ENTRY`]).
    Release,
}

/// What descriptor `index` asks for, or which entry is wrong.
pub fn what_it_asks(index: usize, descriptor: &RateLimitDescriptor) -> Result<Asks, Status> {
    match (
        charges_after_response(index, descriptor)?,
        releases_slots(index, descriptor)?,
    ) {
        (true, true) => Err(invalid(
            index,
            RELEASE_ENTRY.0,
            "a descriptor charges or releases, not both: send two",
        )),
        (true, false) => Ok(Asks::ChargeAfterResponse),
        (false, true) => Ok(Asks::Release),
        (false, false) => Ok(Asks::Admission),
    }
}

/// Whether a descriptor releases its request's slots (`allot_release: stream_done`, with the
/// request's id), or which entry is wrong.
fn releases_slots(index: usize, descriptor: &RateLimitDescriptor) -> Result<bool, Status> {
    let (key, value) = RELEASE_ENTRY;
    let Some(entry) = descriptor.entries.iter().find(|entry| entry.key == key) else {
        return Ok(false);
    };
    if entry.value != value {
        return Err(invalid(index, key, format_args!("must be {value}")));
    }
    if !descriptor
        .entries
        .iter()
        .any(|entry| entry.key == REQUEST_ID_ENTRY)
    {
        return Err(invalid(
            index,
            REQUEST_ID_ENTRY,
            "missing: a release names the request whose slots it frees (Envoy's x-request-id)",
        ));
    }
    Ok(true)
}

/// Whether a descriptor is a charge after the response (`allot_charge: after_response`), or which
/// entry is wrong.
pub fn charges_after_response(
    index: usize,
    descriptor: &RateLimitDescriptor,
) -> Result<bool, Status> {
    let (key, value) = CHARGE_ENTRY;
    let Some(entry) = descriptor.entries.iter().find(|entry| entry.key == key) else {
        return Ok(false);
    };
    if entry.value != value {
        return Err(invalid(index, key, format_args!("must be {value}")));
    }
    if descriptor.hits_addend == Some(0) {
        return Err(invalid(
            index,
            "hits_addend",
            "a charge after the response needs the cost it charges (1 or more)",
        ));
    }
    Ok(true)
}

/// The status of a charge after the response: `OK` when all of it was charged at once.
fn charge_status(answer: Option<&SettleAnswer>) -> DescriptorStatus {
    let charged_at_once = answer.is_some_and(|answer| {
        answer.regional.owed == 0
            && answer.regional.written_off == 0
            && answer
                .pools
                .iter()
                .all(|pool| pool.owed == 0 && pool.written_off == 0)
    });
    DescriptorStatus {
        code: if charged_at_once {
            Code::Ok
        } else {
            Code::OverLimit
        } as i32,
        current_limit: None,
        limit_remaining: 0,
        duration_until_reset: Some(duration_ms(0)),
    }
}

/// The status of a release: `OK`, nothing to show (Envoy ignores it on stream done).
fn released_status() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        current_limit: None,
        limit_remaining: 0,
        duration_until_reset: Some(duration_ms(0)),
    }
}

fn duration_ms(ms: i64) -> prost_types::Duration {
    let ms = ms.max(0);
    prost_types::Duration {
        seconds: ms / 1_000,
        // In [0, 999_000_000]: fits.
        nanos: i32::try_from((ms % 1_000) * 1_000_000).unwrap_or(0),
    }
}

fn is_outage(decision: &Decision) -> bool {
    !decision.allowed
        && matches!(
            decision.reason,
            Some(Reason::LimiterUnavailable) | Some(Reason::PolicyError)
        )
}

/// The status Envoy gets for one decision (outages are answered before this, as `UNAVAILABLE`).
/// The limit and what is left are shown only when `bundle` says the caller may see the rule the
/// decision names ([`crate::visibility::caller_view`]): never a tenant-wide or shared limit the rule
/// does not expose, even when it was only the most constraining rule of an admission.
pub fn descriptor_status(
    bundle: Option<&PolicyBundle>,
    kind: PrincipalType,
    decision: &Decision,
    pool_window_ms: &dyn Fn(&PoolId) -> Option<u64>,
) -> DescriptorStatus {
    let code = if decision.allowed {
        Code::Ok
    } else {
        Code::OverLimit
    };
    let view = bundle
        .and_then(|bundle| crate::visibility::caller_view(bundle, kind, decision, pool_window_ms));
    DescriptorStatus {
        code: code as i32,
        current_limit: view.as_ref().map(|view| RateLimit {
            name: view.policy_name.clone(),
            requests_per_unit: u32::try_from(view.quota_units).unwrap_or(u32::MAX),
            unit: Unit::Unknown as i32,
        }),
        limit_remaining: view.as_ref().map_or(0, |view| {
            u32::try_from(view.remaining_units).unwrap_or(u32::MAX)
        }),
        duration_until_reset: Some(duration_ms(if decision.allowed {
            0
        } else {
            decision.retry_after_ms
        })),
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitApi {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let stopwatch = crate::clock::Stopwatch::start();
        let work = async {
            let _permit = self.permits.acquire().await;
            self.decide(request).await
        };
        let answer = match self.deadlines.within(REQUEST_TIMEOUT, work).await {
            Ok(answer) => answer,
            Err(allot_net::DeadlinePassed) => Err(Status::unavailable(format!(
                "not decided within {} ms",
                REQUEST_TIMEOUT.as_millis()
            ))),
        };
        let code = match &answer {
            Ok(response) if response.get_ref().overall_code == Code::OverLimit as i32 => {
                "over_limit"
            }
            Ok(_) => "ok",
            Err(status) => match status.code() {
                tonic::Code::InvalidArgument => "invalid_argument",
                tonic::Code::Unauthenticated => "unauthenticated",
                tonic::Code::Unavailable => "unavailable",
                _ => "other_error",
            },
        };
        metrics::counter!(crate::metrics::RLS_REQUESTS, "code" => code).increment(1);
        metrics::histogram!(crate::metrics::RLS_SECONDS).record(stopwatch.elapsed().as_secs_f64());
        answer
    }
}

/// What a call's answer gathers as its descriptors are decided.
#[derive(Default)]
struct CallAnswer {
    over: bool,
    headers: Vec<HeaderValue>,
    upstream_headers: Vec<HeaderValue>,
}

impl CallAnswer {
    /// Takes descriptor `index`'s decision into the answer: its status, and the headers it adds.
    fn record(
        &mut self,
        agent: &Agent,
        index: usize,
        admission: &AdmissionRequest,
        decision: &Decision,
    ) -> DescriptorStatus {
        if index == 0 && admission.principal.kind.is_authenticated() {
            self.headers.push(HeaderValue {
                key: DECISION_ID_HEADER.to_owned(),
                value: decision.decision_id.to_string(),
            });
        }
        self.over |= !decision.allowed;
        let bundle = agent.bundle();
        if let Some(bundle) = bundle.as_deref() {
            let (soft, shadow) =
                crate::visibility::violation_headers(bundle, admission.principal.kind, decision);
            let header = |key: &str, value: String| HeaderValue {
                key: key.to_owned(),
                value,
            };
            self.headers
                .extend(soft.map(|v| header(crate::visibility::SOFT_LIMIT_HEADER, v)));
            self.upstream_headers
                .extend(shadow.map(|v| header(crate::visibility::SHADOW_DENIED_HEADER, v)));
        }
        let pool_window_ms = |pool: &PoolId| agent.pool_window_ms(&admission.tenant_id, pool);
        descriptor_status(
            bundle.as_deref(),
            admission.principal.kind,
            decision,
            &pool_window_ms,
        )
    }
}

impl RateLimitApi {
    /// One descriptor decided alone (a check); an outage answers `UNAVAILABLE`.
    async fn decide_one(
        &self,
        index: usize,
        admission: &AdmissionRequest,
    ) -> Result<Decision, Status> {
        let decision = self
            .agent
            .admit(admission)
            .await
            .map_err(|rejected| invalid(index, &rejected.field, rejected.message))?;
        if is_outage(&decision) {
            return Err(Status::unavailable(
                "a fail-closed rule could not be decided; Envoy's failure_mode_deny applies",
            ));
        }
        Ok(decision)
    }

    /// One `ShouldRateLimit` call: its checks (`hits_addend` 0) first, then every descriptor that
    /// spends decided together, all or none ([`Agent::admit_together`]), then charges after the
    /// response; an outage answers `UNAVAILABLE` (so Envoy's `failure_mode_deny` decides).
    ///
    /// Long by design: its passes over the descriptors (checks, then the spending ones together,
    /// then charges, then releases) fill one list of statuses by index and one answer whose `over`
    /// the later passes read; split, the statuses and the answer would be threaded through every
    /// pass, and the order that keeps an over call from spending would be read in several places.
    async fn decide(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.authorize(&request)?;
        let request = request.into_inner();
        if request.domain.len() > MAX_ENTRY_BYTES {
            return Err(Status::invalid_argument(format!(
                "domain: at most {MAX_ENTRY_BYTES} bytes"
            )));
        }
        if request.descriptors.is_empty() || request.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "descriptors: 1 to {MAX_DESCRIPTORS} descriptors"
            )));
        }
        let admissions = request
            .descriptors
            .iter()
            .enumerate()
            .map(|(index, d)| {
                Ok((
                    admission_request(index, d, request.hits_addend)?,
                    what_it_asks(index, d)?,
                ))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        let mut answer = CallAnswer::default();
        let mut statuses: Vec<Option<DescriptorStatus>> = vec![None; admissions.len()];
        // Checks first: a dry run spends nothing, and one that is over makes the call over, so
        // nothing else of it may spend either.
        for (index, (admission, asks)) in admissions.iter().enumerate() {
            if admission.dry_run && *asks == Asks::Admission {
                let decision = self.decide_one(index, admission).await?;
                statuses[index] = Some(answer.record(&self.agent, index, admission, &decision));
            }
        }
        let spending: Vec<usize> = (0..admissions.len())
            .filter(|&index| {
                let (admission, asks) = &admissions[index];
                !admission.dry_run && *asks == Asks::Admission
            })
            .collect();
        if answer.over {
            // Answered as checks: the call is over, so these spend nothing.
            for &index in &spending {
                let mut check = admissions[index].0.clone();
                check.dry_run = true;
                let decision = self.decide_one(index, &check).await?;
                statuses[index] = Some(answer.record(&self.agent, index, &check, &decision));
            }
        } else if !spending.is_empty() {
            let requests: Vec<AdmissionRequest> = spending
                .iter()
                .map(|&index| admissions[index].0.clone())
                .collect();
            let decisions =
                self.agent
                    .admit_together(&requests)
                    .await
                    .map_err(|(at, rejected)| {
                        invalid(spending[at], &rejected.field, rejected.message)
                    })?;
            if decisions.iter().any(is_outage) {
                return Err(Status::unavailable(
                    "a fail-closed rule could not be decided; Envoy's failure_mode_deny applies",
                ));
            }
            for (&index, decision) in spending.iter().zip(&decisions) {
                let admission = &admissions[index].0;
                statuses[index] = Some(answer.record(&self.agent, index, admission, decision));
            }
        }
        // Charges after the response (never denied: the request is done), then releases.
        for (index, (admission, asks)) in admissions.iter().enumerate() {
            if *asks == Asks::ChargeAfterResponse {
                let charged = self.agent.charge_after_response(admission).await;
                let status = charge_status(charged.as_ref());
                answer.over |= status.code == Code::OverLimit as i32;
                statuses[index] = Some(status);
            }
        }
        for (index, (admission, asks)) in admissions.iter().enumerate() {
            if *asks == Asks::Release {
                self.agent
                    .release(admission)
                    .await
                    .map_err(|rejected| invalid(index, &rejected.field, rejected.message))?;
                statuses[index] = Some(released_status());
            }
        }
        let CallAnswer {
            over,
            headers,
            upstream_headers,
        } = answer;
        let statuses: Vec<DescriptorStatus> = statuses.into_iter().flatten().collect();
        let overall = if over { Code::OverLimit } else { Code::Ok };
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add: headers,
            request_headers_to_add: upstream_headers,
        }))
    }
}

/// Serves Envoy's rate limit service and rate limit quota service on `listener` (HTTP/2; through
/// TLS when `tls` is given) until `shutdown` resolves, finishing calls in flight. It goes through
/// the same bounded accept loop as the HTTP API ([`fn@allot_net::serve`]). An RLS call waits for
/// one of [`MAX_CONCURRENT_REQUESTS`] permits and is answered `UNAVAILABLE` past
/// [`REQUEST_TIMEOUT`]; RLQS streams are long-lived and bounded by their own count
/// ([`crate::rlqs::MAX_STREAMS`]).
pub async fn serve_grpc(
    listener: impl Into<allot_net::Listener>,
    api: AgentApi,
    tls: Option<allot_net::TlsServing>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let rls = RateLimitServiceServer::new(RateLimitApi::new(&api))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let rlqs = crate::rlqs::RateLimitQuotaApi::new(&api).into_server();
    let router = tonic::service::Routes::new(rls)
        .add_service(rlqs)
        .prepare()
        .into_axum_router();
    allot_net::serve(
        listener,
        router,
        tls,
        allot_net::ServeLimits::default(),
        shutdown,
    )
    .await
}
