//! Envoy's rate limit quota service (RLQS) v3 over gRPC:
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`.
//!
//! Gateways decide every request themselves, against *assignments* the agent pushes on one
//! long-lived stream per gateway: a token bucket per bucket of requests, carved out of what the
//! agent holds ([`crate::service::subleases`]). No call per request; the gateway reports usage
//! every reporting interval and the agent keeps its assignments fresh. Messages come from Allot's
//! own wire-compatible subset of Envoy's API (`region-agent/proto/envoy_rlqs_v3_subset*.proto`).
//!
//! # Buckets
//! A `BucketId`'s entries map to an admission request exactly as RLS descriptor entries do
//! ([`crate::grpc`]): `tenant`, one of `user` / `api_key` / `remote_address`, `route_group`, and an
//! optional `method`; other keys are ignored. A bucket stands for its requests one at a time (cost
//! 1). An entry that cannot be mapped ends the stream with `INVALID_ARGUMENT` naming the usage and
//! key, as does a report without `time_elapsed` (a negative one, or one outside protobuf's range
//! for a `Duration`) or a second domain. A `time_elapsed` of 0 is accepted: Envoy reports a new
//! bucket at once with 0, and later reports in whole seconds, which can round down to 0.
//!
//! # Assignments
//! - A bucket limited by global (leased) rules, regional rules or both gets a `token_bucket`: the
//!   requests its gateway may admit, sized by its reported demand (`allowed + denied` over
//!   `time_elapsed`, 1.5x headroom over [`ASSIGNMENT_TTL_MS`]), its share of the pool when gateways
//!   want more than the agent holds, at most one chunk, and at most what every rule has left; for
//!   about as long as that lasts at the gateway's demand (from [`MIN_ASSIGNMENT_TTL_MS`] to
//!   [`ASSIGNMENT_TTL_MS`], and never past the leases behind it). The bucket's regional rules are
//!   charged for the whole carve in one store call (what the gateway does not use is not given
//!   back to them: no refunds). The bucket starts full with about one second's worth and refills
//!   every second ([`crate::global::sublease::BucketStrategy::spreading`]), so it can never admit
//!   more than its carve within its time to live. Every duration sent is whole seconds, since
//!   Envoy reads no more of one (a sub-second fill interval would be no limit at all to it); a
//!   carve smaller than one request a second of its life gets a shorter life, and one of fewer
//!   than two requests is not sent. The timing rules are pure functions of
//!   [`crate::global::sublease`], which the drills run too.
//! - An assignment is renewed when [`RENEW_AT_PERCENT`] of its time to live has passed,
//!   [`RENEW_AT_USED_PERCENT`] of it is reported used, or the gateway's demand has grown to more
//!   than twice what it holds. A replaced assignment is cut to what its
//!   gateway could admit until the new one arrives ([`DELIVERY_MARGIN_MS`]); the rest goes back.
//! - A bucket no rule limits gets `ALLOW_ALL` for [`UNLIMITED_TTL_MS`]; one that nothing can be
//!   carved for (the pool exhausted, the fallback allowance spent, no policy) gets `DENY_ALL` until
//!   it may be retried (at most [`MAX_DENY_TTL_MS`]).
//! - A bucket that was limited and no longer is, and a bucket not reported for
//!   [`BUCKET_IDLE_MS`], get `abandon_action`.
//!
//! # Accounting
//! Reported `num_requests_allowed` are spends of the bucket's carves, oldest first, reported to the
//! ledger like any admission. A carve whose assignment ended is given back once a report sent after
//! its end has arrived (everything admitted under it is counted), and withholds what it still holds
//! when none arrives in time ([`crate::global::sublease::settlement`]). A carve of another kind
//! ([`crate::global::sublease::CarveKind`]) is handed only once the older ones are settled.
//! Requests reported beyond every carve (the gateway's own `no_assignment_behavior` or
//! `expired_assignment_behavior` admitted them) are spent from what the agent holds when possible
//! and counted in `allot_agent_rlqs_admitted_beyond_assignment_total` either way.
//!
//! # Bounds
//! [`MAX_STREAMS`] streams at once (more are refused `RESOURCE_EXHAUSTED`), [`MAX_BUCKETS_PER_STREAM`]
//! buckets a stream, [`MAX_USAGES_PER_MESSAGE`] usages a message, messages of
//! [`crate::envoy::MAX_MESSAGE_BYTES`]; a gateway that does not read its assignments for
//! [`SEND_TIMEOUT`] is disconnected. Authentication is the gateway bearer token in metadata, as for
//! RLS.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allot_shared::contract::AdmissionRequest;
use tokio::sync::{Semaphore, mpsc};
use tonic::{Request, Response, Status, Streaming};

use crate::envoy::{MAX_ENTRY_BYTES, request_from_entries};
pub use crate::global::sublease::{
    ASSIGNMENT_TTL_MS, DELIVERY_MARGIN_MS, MAX_DENY_TTL_MS, MAX_SETTLE_GRACE_MS,
    MIN_ASSIGNMENT_TTL_MS, MIN_DENY_TTL_MS, MIN_SETTLE_GRACE_MS, RENEW_AT_PERCENT,
    RENEW_AT_USED_PERCENT,
};
use crate::global::sublease::{
    BucketStrategy, Demand, Settlement, Spread, admissible_until_replaced, assignment_ttl_ms,
    deny_ttl_ms, renewal_due, settlement, wanted_requests,
};
use crate::http::AgentApi;
use crate::service::Agent;
use crate::service::subleases::{Carve, CarveAsk, Carving};

pub mod gateway;

/// The generated messages, server and client (Allot's subset of Envoy's v3 API), in modules that
/// follow their packages (the generated code refers across them by relative paths).
#[allow(missing_docs, clippy::all, clippy::unwrap_used)]
pub mod proto {
    /// `envoy.*`
    pub mod envoy {
        /// `envoy.service.*`
        pub mod service {
            /// `envoy.service.rate_limit_quota.*`
            pub mod rate_limit_quota {
                /// `envoy.service.rate_limit_quota.v3`: the service and its messages.
                pub mod v3 {
                    tonic::include_proto!("envoy.service.rate_limit_quota.v3");
                }
            }
        }
        /// `envoy.type.*`
        pub mod r#type {
            /// `envoy.type.v3`: the strategies an assignment carries.
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.v3");
            }
        }
    }
}

use proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use proto::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};

/// Streams served at once (I10).
pub const MAX_STREAMS: usize = 1_024;
/// Buckets one stream may subscribe to (I10).
pub const MAX_BUCKETS_PER_STREAM: usize = 1_000;
/// Usages one message may carry (I10).
pub const MAX_USAGES_PER_MESSAGE: usize = 1_000;
/// How often a stream's assignments are looked after without a report, ms.
pub const TICK_MS: u64 = 250;
/// A bucket not reported for this long is abandoned, ms.
pub const BUCKET_IDLE_MS: u64 = 30_000;
/// How long `ALLOW_ALL` lasts before the bucket's rules are looked at again, ms.
pub const UNLIMITED_TTL_MS: u64 = 60_000;
/// Responses queued for one stream (I10).
pub const OUTBOUND_MESSAGES: usize = 16;
/// A gateway that does not take a response for this long is disconnected.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(5);

static NEXT_SUBSCRIPTION: AtomicU64 = AtomicU64::new(1);

/// The RLQS implementation over an agent.
#[derive(Clone)]
pub struct RateLimitQuotaApi {
    agent: Arc<Agent>,
    gateway_tokens: Arc<Vec<String>>,
    streams: Arc<Semaphore>,
}

impl RateLimitQuotaApi {
    /// Serves `api`'s agent to gateways presenting one of `api`'s tokens.
    pub fn new(api: &AgentApi) -> Self {
        Self {
            agent: api.agent.clone(),
            gateway_tokens: api.gateway_tokens.clone(),
            streams: Arc::new(Semaphore::new(MAX_STREAMS)),
        }
    }

    /// The tonic service.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
            .max_decoding_message_size(crate::envoy::MAX_MESSAGE_BYTES)
    }
}

type Outbound = mpsc::Sender<Result<RateLimitQuotaResponse, Status>>;

#[tonic::async_trait]
impl RateLimitQuotaService for RateLimitQuotaApi {
    type StreamRateLimitQuotasStream =
        tokio_stream::wrappers::ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        crate::envoy::authorize_gateway(&self.gateway_tokens, &request)?;
        let permit = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!("at most {MAX_STREAMS} RLQS streams at once"))
        })?;
        let (outbound, receiver) = mpsc::channel(OUTBOUND_MESSAGES);
        let session = Session::new(self.agent.clone());
        let inbound = request.into_inner();
        tokio::spawn(async move {
            metrics::gauge!(crate::metrics::RLQS_STREAMS).increment(1.0);
            let cause = session.run(inbound, outbound).await;
            metrics::gauge!(crate::metrics::RLQS_STREAMS).decrement(1.0);
            metrics::counter!(crate::metrics::RLQS_STREAMS_ENDED, "cause" => cause).increment(1);
            drop(permit);
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            receiver,
        )))
    }
}

/// A carve handed to the gateway, and the assignment it went out as.
struct Handed {
    carve: Carve,
    strategy: BucketStrategy,
    sent_at_ms: u64,
    /// When the gateway stops using it: its time to live after sending, or the moment a
    /// replacement reached the gateway.
    ends_at_ms: u64,
}

/// What the bucket's gateway was last told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Told {
    Nothing,
    TokenBucket { sent_at_ms: u64, ttl_ms: u64 },
    AllowAll { until_ms: u64 },
    DenyAll { until_ms: u64 },
}

/// One bucket one gateway reports.
struct Bucket {
    id: BucketId,
    request: AdmissionRequest,
    subscription: u64,
    demand: Demand,
    last_report_ms: u64,
    report_interval_ms: u64,
    told: Told,
    /// The bundle version it was last told under: a new bundle looks at every bucket again.
    told_version: u64,
    handed: VecDeque<Handed>,
    /// Whether a limiting assignment (or a denial) was ever sent: a bucket that becomes unlimited
    /// is then abandoned.
    limited: bool,
}

impl Bucket {
    /// Whether a new assignment is due at `now_ms` under bundle `version`.
    fn due(&self, now_ms: u64, version: u64) -> bool {
        if self.told_version != version {
            return true;
        }
        match self.told {
            Told::Nothing => true,
            Told::AllowAll { until_ms } | Told::DenyAll { until_ms } => now_ms >= until_ms,
            Told::TokenBucket { sent_at_ms, ttl_ms } => {
                let (used, requests) = self.handed.back().map_or((0, 0), |handed| {
                    (handed.carve.used_requests(), handed.carve.requests())
                });
                let wanted = wanted_requests(self.demand.rate_milli_per_s(), ASSIGNMENT_TTL_MS);
                renewal_due(sent_at_ms, ttl_ms, used, requests, wanted, now_ms)
            }
        }
    }
}

/// One gateway's stream.
struct Session {
    agent: Arc<Agent>,
    domain: Option<String>,
    buckets: HashMap<BTreeMap<String, String>, Bucket>,
}

impl Session {
    fn new(agent: Arc<Agent>) -> Self {
        Self {
            agent,
            domain: None,
            buckets: HashMap::new(),
        }
    }

    /// Serves the stream until the gateway closes it, breaks a rule, or stops reading; returns
    /// why it ended. Every carve still held is settled on the way out.
    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        outbound: Outbound,
    ) -> &'static str {
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cause = loop {
            let actions = tokio::select! {
                message = inbound.message() => match message {
                    Ok(Some(reports)) => match self.on_reports(reports).await {
                        Ok(()) => self.look_after().await,
                        Err(status) => {
                            let _ = outbound.try_send(Err(status));
                            break "invalid_argument";
                        }
                    },
                    Ok(None) => break "closed",
                    Err(_) => break "broken",
                },
                _ = tick.tick() => self.look_after().await,
            };
            if actions.is_empty() {
                continue;
            }
            let response = RateLimitQuotaResponse {
                bucket_action: actions,
            };
            match tokio::time::timeout(SEND_TIMEOUT, outbound.send(Ok(response))).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => break "closed",
                Err(_) => break "not_reading",
            }
        };
        self.close();
        cause
    }

    /// Takes one message of usage reports: subscribes new buckets, records demand, spends what was
    /// admitted.
    ///
    /// Long by design: each usage's checks share one way of failing, naming the usage's index and
    /// field, and a bucket the usage subscribes is at once the one its demand and spend are
    /// recorded on; split, that way of failing and the stream's map of buckets would be passed to
    /// each piece.
    async fn on_reports(&mut self, reports: RateLimitQuotaUsageReports) -> Result<(), Status> {
        self.check_domain(&reports.domain)?;
        if reports.bucket_quota_usages.len() > MAX_USAGES_PER_MESSAGE {
            return Err(Status::invalid_argument(format!(
                "bucket_quota_usages: at most {MAX_USAGES_PER_MESSAGE} a message"
            )));
        }
        let now_ms = self.agent.now_ms();
        for (index, usage) in reports.bucket_quota_usages.into_iter().enumerate() {
            let fail = |key: &str, message: &dyn std::fmt::Display| {
                Status::invalid_argument(format!("bucket_quota_usages[{index}].{key}: {message}"))
            };
            // Envoy reports a new bucket at once with 0, and rounds later reports down to whole
            // seconds, so 0 is a report like any other.
            let elapsed_ms = usage
                .time_elapsed
                .as_ref()
                .ok_or_else(|| fail("time_elapsed", &"required"))
                .and_then(|elapsed| duration_ms(elapsed).map_err(|m| fail("time_elapsed", &m)))?;
            let entries: BTreeMap<String, String> = usage
                .bucket_id
                .as_ref()
                .map(|id| id.bucket.clone().into_iter().collect())
                .unwrap_or_default();
            if entries.is_empty() {
                return Err(fail("bucket_id", &"required, with at least one entry"));
            }
            if !self.buckets.contains_key(&entries) {
                if self.buckets.len() >= MAX_BUCKETS_PER_STREAM {
                    return Err(fail(
                        "bucket_id",
                        &format_args!("at most {MAX_BUCKETS_PER_STREAM} buckets a stream"),
                    ));
                }
                let request = request_from_entries(
                    entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                    entries.len(),
                    1,
                    &|key, message| fail(&format!("bucket_id.{key}"), message),
                )?;
                let bucket = Bucket {
                    id: BucketId {
                        bucket: entries.clone().into_iter().collect(),
                    },
                    request,
                    subscription: NEXT_SUBSCRIPTION.fetch_add(1, Ordering::Relaxed),
                    demand: Demand::default(),
                    last_report_ms: now_ms,
                    report_interval_ms: elapsed_ms,
                    told: Told::Nothing,
                    told_version: 0,
                    handed: VecDeque::new(),
                    limited: false,
                };
                self.buckets.insert(entries.clone(), bucket);
                metrics::gauge!(crate::metrics::RLQS_BUCKETS).increment(1.0);
            }
            let Some(bucket) = self.buckets.get_mut(&entries) else {
                continue;
            };
            bucket.last_report_ms = now_ms;
            if elapsed_ms > 0 {
                // A report of 0 says nothing of how often this gateway reports.
                bucket.report_interval_ms = elapsed_ms;
            }
            bucket.demand.record(
                usage
                    .num_requests_allowed
                    .saturating_add(usage.num_requests_denied),
                elapsed_ms,
            );
            spend_reported(&self.agent, bucket, usage.num_requests_allowed).await;
            if let Some(latest) = bucket.handed.back() {
                self.agent
                    .note_denied(&latest.carve, usage.num_requests_denied);
            }
        }
        Ok(())
    }

    fn check_domain(&mut self, domain: &str) -> Result<(), Status> {
        if domain.len() > MAX_ENTRY_BYTES {
            return Err(Status::invalid_argument(format!(
                "domain: at most {MAX_ENTRY_BYTES} bytes"
            )));
        }
        match (&self.domain, domain.is_empty()) {
            (None, true) => Err(Status::invalid_argument(
                "domain: required on a stream's first message",
            )),
            (None, false) => {
                self.domain = Some(domain.to_owned());
                Ok(())
            }
            (Some(_), true) => Ok(()),
            (Some(known), false) if known == domain => Ok(()),
            (Some(_), false) => Err(Status::invalid_argument(
                "domain: a stream has one domain; open another stream for another",
            )),
        }
    }

    /// Settles ended carves, abandons idle buckets, and assigns where an assignment is due.
    async fn look_after(&mut self) -> Vec<BucketAction> {
        let now_ms = self.agent.now_ms();
        let mut actions = Vec::new();
        let idle: Vec<BTreeMap<String, String>> = self
            .buckets
            .iter()
            .filter(|(_, bucket)| now_ms.saturating_sub(bucket.last_report_ms) >= BUCKET_IDLE_MS)
            .map(|(key, _)| key.clone())
            .collect();
        for key in idle {
            if let Some(bucket) = self.buckets.remove(&key) {
                actions.push(abandon(&bucket));
                self.forget(bucket);
            }
        }
        let mut unlimited = Vec::new();
        let version = self.agent.bundle().map_or(0, |bundle| bundle.version());
        for (key, bucket) in &mut self.buckets {
            settle_ended(&self.agent, bucket, now_ms);
            if !bucket.due(now_ms, version) {
                continue;
            }
            bucket.told_version = version;
            match assign(&self.agent, bucket).await {
                Some(Assigned::Action(action)) => actions.push(action),
                Some(Assigned::NoLongerLimited) => unlimited.push(key.clone()),
                None => {}
            }
        }
        for key in unlimited {
            if let Some(bucket) = self.buckets.remove(&key) {
                actions.push(abandon(&bucket));
                self.forget(bucket);
            }
        }
        actions
    }

    fn forget(&self, bucket: Bucket) {
        self.agent.forget_subscription(bucket.subscription);
        for handed in bucket.handed {
            self.agent.end_carve(handed.carve);
        }
        metrics::gauge!(crate::metrics::RLQS_BUCKETS).decrement(1.0);
    }

    /// The stream ended: every carve withholds what it holds (the gateway may have admitted it).
    fn close(mut self) {
        for (_, bucket) in std::mem::take(&mut self.buckets) {
            self.forget(bucket);
        }
    }
}

/// Spends `allowed` requests a bucket's gateway reported from its carves, oldest first; what no
/// carve holds was admitted beyond every assignment.
async fn spend_reported(agent: &Arc<Agent>, bucket: &mut Bucket, allowed: u64) {
    let mut left = allowed;
    for handed in bucket.handed.iter_mut() {
        if left == 0 {
            break;
        }
        left -= agent.spend_carved(&mut handed.carve, left);
    }
    if left > 0 && matches!(bucket.told, Told::TokenBucket { .. } | Told::Nothing) {
        let backed = agent.spend_beyond_assignment(&bucket.request, left).await;
        if backed > 0 {
            metrics::counter!(crate::metrics::RLQS_ADMITTED_BEYOND_ASSIGNMENT, "backed" => "true")
                .increment(backed);
        }
        if left > backed {
            metrics::counter!(crate::metrics::RLQS_ADMITTED_BEYOND_ASSIGNMENT, "backed" => "false")
                .increment(left - backed);
        }
    }
}

/// Settles the carves whose assignments ended: given back once a report covered their end,
/// withheld when none did in time ([`settlement`]).
fn settle_ended(agent: &Agent, bucket: &mut Bucket, now_ms: u64) {
    while let Some(handed) = bucket.handed.front() {
        let settled = settlement(
            handed.ends_at_ms,
            bucket.last_report_ms,
            now_ms,
            bucket.report_interval_ms,
        );
        let Some(settled) = settled else {
            break;
        };
        if let Some(handed) = bucket.handed.pop_front() {
            match settled {
                Settlement::GiveBack => agent.return_carve(handed.carve),
                Settlement::Withhold => agent.end_carve(handed.carve),
            }
        }
    }
}

/// What assigning a bucket came to.
enum Assigned {
    Action(BucketAction),
    NoLongerLimited,
}

/// Carves and tells the gateway; `None` when nothing is to be said yet (tokens on their way).
///
/// Long by design: it is one match over every outcome of a carve, each arm recording what the
/// bucket was told beside the action that tells it, and the carved arm either cancelling its carve
/// or handing it over; split, what the bucket believes it was told could drift from what the
/// gateway was sent.
async fn assign(agent: &Arc<Agent>, bucket: &mut Bucket) -> Option<Assigned> {
    let wanted = wanted_requests(bucket.demand.rate_milli_per_s(), ASSIGNMENT_TTL_MS);
    // Every unsettled carve of a bucket is of one kind: the oldest's.
    let kinds_in_use = bucket
        .handed
        .front()
        .map(|handed| handed.carve.kinds().to_vec())
        .unwrap_or_default();
    let ask = CarveAsk {
        subscription: bucket.subscription,
        wanted_requests: wanted,
        kinds_in_use,
    };
    let carving = agent.carve(&bucket.request, ask).await;
    let now_ms = agent.now_ms();
    match carving {
        Carving::Carved(carve) => {
            let Some(ttl_ms) = assignment_ttl_ms(
                carve.requests(),
                bucket.demand.rate_milli_per_s(),
                carve.usable_until_ms().saturating_sub(now_ms),
            ) else {
                agent.cancel_carve(carve);
                return None;
            };
            let Some(Spread { strategy, ttl_ms }) =
                BucketStrategy::spreading(carve.requests(), ttl_ms)
            else {
                // Too little to tell Envoy (fewer than two requests): denied until there is more.
                agent.cancel_carve(carve);
                cut_replaced(agent, bucket, now_ms);
                return Some(deny_all(bucket, MIN_DENY_TTL_MS, now_ms));
            };
            let mut carve = carve;
            agent.cut_carve(&mut carve, strategy.admissible_requests(ttl_ms));
            cut_replaced(agent, bucket, now_ms);
            bucket.handed.push_back(Handed {
                carve,
                strategy,
                sent_at_ms: now_ms,
                ends_at_ms: now_ms + ttl_ms + DELIVERY_MARGIN_MS,
            });
            bucket.told = Told::TokenBucket {
                sent_at_ms: now_ms,
                ttl_ms,
            };
            bucket.limited = true;
            count_action("token_bucket");
            Some(Assigned::Action(assignment(
                &bucket.id,
                ttl_ms,
                Strategy::TokenBucket(TokenBucket {
                    max_tokens: strategy.max_tokens,
                    tokens_per_fill: Some(strategy.tokens_per_fill),
                    fill_interval: Some(whole_seconds(strategy.fill_interval_ms)),
                }),
            )))
        }
        Carving::Unlimited if bucket.limited => {
            cut_replaced(agent, bucket, now_ms);
            Some(Assigned::NoLongerLimited)
        }
        Carving::Unlimited => {
            bucket.told = Told::AllowAll {
                until_ms: now_ms + UNLIMITED_TTL_MS,
            };
            count_action("allow_all");
            Some(Assigned::Action(assignment(
                &bucket.id,
                UNLIMITED_TTL_MS,
                Strategy::BlanketRule(BlanketRule::AllowAll as i32),
            )))
        }
        Carving::Denied { retry_after_ms } => {
            cut_replaced(agent, bucket, now_ms);
            Some(deny_all(bucket, deny_ttl_ms(retry_after_ms), now_ms))
        }
        Carving::Awaiting => None,
    }
}

/// `DENY_ALL` for `ttl_ms` (whole seconds).
fn deny_all(bucket: &mut Bucket, ttl_ms: u64, now_ms: u64) -> Assigned {
    bucket.told = Told::DenyAll {
        until_ms: now_ms + ttl_ms,
    };
    bucket.limited = true;
    count_action("deny_all");
    Assigned::Action(assignment(
        &bucket.id,
        ttl_ms,
        Strategy::BlanketRule(BlanketRule::DenyAll as i32),
    ))
}

/// The assignment in force is being replaced at `now_ms`: its gateway uses it until the
/// replacement arrives, so its carve keeps what the gateway could admit until then.
fn cut_replaced(agent: &Agent, bucket: &mut Bucket, now_ms: u64) {
    let Some(handed) = bucket.handed.back_mut() else {
        return;
    };
    let replaced_at_ms = now_ms + DELIVERY_MARGIN_MS;
    if handed.ends_at_ms <= replaced_at_ms {
        return;
    }
    agent.cut_carve(
        &mut handed.carve,
        admissible_until_replaced(handed.strategy, handed.sent_at_ms, now_ms),
    );
    handed.ends_at_ms = replaced_at_ms;
}

fn assignment(id: &BucketId, ttl_ms: u64, strategy: Strategy) -> BucketAction {
    BucketAction {
        bucket_id: Some(id.clone()),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(whole_seconds(ttl_ms)),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}

fn abandon(bucket: &Bucket) -> BucketAction {
    count_action("abandon");
    BucketAction {
        bucket_id: Some(bucket.id.clone()),
        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
    }
}

fn count_action(action: &'static str) {
    metrics::counter!(crate::metrics::RLQS_ACTIONS, "action" => action).increment(1);
}

/// A duration Envoy reads as meant: whole seconds, no nanos (it drops them).
fn whole_seconds(ms: u64) -> prost_types::Duration {
    debug_assert!(ms.is_multiple_of(1_000), "{ms} ms is not whole seconds");
    prost_types::Duration {
        seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

/// The largest `seconds` of a valid protobuf `Duration` (about 10,000 years).
const MAX_DURATION_SECONDS: i64 = 315_576_000_000;

/// A protobuf duration of at least 0, in whole ms (rounded up); refused, saying why, when it is
/// negative or outside protobuf's own range for a `Duration`.
fn duration_ms(duration: &prost_types::Duration) -> Result<u64, String> {
    let prost_types::Duration { seconds, nanos } = *duration;
    if !(-MAX_DURATION_SECONDS..=MAX_DURATION_SECONDS).contains(&seconds)
        || !(-999_999_999..=999_999_999).contains(&nanos)
    {
        return Err(format!(
            "{seconds} s {nanos} ns is outside protobuf's Duration range (seconds within              +-{MAX_DURATION_SECONDS}, nanos within +-999999999)"
        ));
    }
    match (u64::try_from(seconds), u64::try_from(nanos)) {
        (Ok(seconds), Ok(nanos)) => Ok(seconds * 1_000 + nanos.div_ceil(1_000_000)),
        _ => Err(format!("{seconds} s {nanos} ns is negative")),
    }
}
