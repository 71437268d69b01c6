//! A gateway of the rate limit quota service: it decides every request locally against the
//! assignments its agent pushes and reports usage, as Envoy's `rate_limit_quota` filter does.
//!
//! Allot's agent never runs this; it is the client the tests, drills and benchmarks drive the
//! service with, and a reference for what the agent's bound assumes of gateways: an assignment's
//! token bucket starts full, refills continuously, and admits nothing once its time to live has
//! run out ([`EnforcedBucket`]); a bucket without a live assignment is decided by
//! [`NoAssignment`] (Envoy's `no_assignment_behavior` and, after expiry,
//! `expired_assignment_behavior` with `fallback_rate_limit`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::mpsc;
use tonic::Status;
use tonic::transport::Channel;

use super::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use super::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use super::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use super::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use super::proto::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use super::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use super::{duration_ms, duration_of_ms};
use crate::clock::Clock;
use crate::global::sublease::{BucketStrategy, EnforcedBucket};

/// Reports queued for the stream at most (I10).
pub const OUTBOUND_REPORTS: usize = 16;

/// What a gateway does with a bucket that has no live assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoAssignment {
    /// Deny (Envoy: `blanket_rule: DENY_ALL`): nothing beyond what the agent carved.
    Deny,
    /// Allow (Envoy: `blanket_rule: ALLOW_ALL`): admits the agent counts as beyond assignment.
    Allow,
}

/// What the gateway was last told for a bucket.
#[derive(Debug, Clone, Copy)]
enum Enforcing {
    Nothing,
    AllowAll { until_ms: u64 },
    DenyAll { until_ms: u64 },
    TokenBucket(EnforcedBucket),
}

#[derive(Debug, Clone)]
struct LocalBucket {
    id: BucketId,
    enforcing: Enforcing,
    allowed: u64,
    denied: u64,
    /// Since the last report.
    allowed_unreported: u64,
    denied_unreported: u64,
    reported_at_ms: u64,
}

/// Counts of one bucket since the gateway started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketCounts {
    /// Requests admitted.
    pub allowed: u64,
    /// Requests denied.
    pub denied: u64,
}

type Buckets = Arc<Mutex<HashMap<BTreeMap<String, String>, LocalBucket>>>;

fn lock(buckets: &Buckets) -> MutexGuard<'_, HashMap<BTreeMap<String, String>, LocalBucket>> {
    buckets.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A gateway on one RLQS stream.
pub struct Gateway {
    clock: Arc<dyn Clock>,
    buckets: Buckets,
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    domain: String,
    domain_sent: bool,
    no_assignment: NoAssignment,
    reader: tokio::task::JoinHandle<Option<Status>>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Gateway {
    /// Opens a stream on `channel` with gateway `token` for `domain`; time is read on `clock`.
    pub async fn connect(
        channel: Channel,
        token: &str,
        domain: &str,
        no_assignment: NoAssignment,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, Status> {
        let mut client = RateLimitQuotaServiceClient::new(channel);
        let (reports, outgoing) = mpsc::channel(OUTBOUND_REPORTS);
        let mut request =
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(outgoing));
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| Status::invalid_argument("the token is not a valid header value"))?;
        request.metadata_mut().insert("authorization", value);
        let mut answers = client.stream_rate_limit_quotas(request).await?.into_inner();
        let buckets: Buckets = Arc::default();
        let applied = buckets.clone();
        let reader_clock = clock.clone();
        let reader = tokio::spawn(async move {
            loop {
                match answers.message().await {
                    Ok(Some(message)) => {
                        let now_ms = reader_clock.now_ms();
                        let mut buckets = lock(&applied);
                        for action in message.bucket_action {
                            apply(&mut buckets, action, now_ms);
                        }
                    }
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        });
        Ok(Self {
            clock,
            buckets,
            reports,
            domain: domain.to_owned(),
            domain_sent: false,
            no_assignment,
            reader,
        })
    }

    /// Decides one request of bucket `id` on the gateway's own, as Envoy does: against its live
    /// assignment, else by the no-assignment behaviour. A bucket seen for the first time is
    /// reported on the next [`report`](Self::report), which subscribes it.
    pub fn decide(&self, id: &BucketId) -> bool {
        let now_ms = self.clock.now_ms();
        let key: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
        let mut buckets = lock(&self.buckets);
        let bucket = buckets.entry(key).or_insert_with(|| LocalBucket {
            id: id.clone(),
            enforcing: Enforcing::Nothing,
            allowed: 0,
            denied: 0,
            allowed_unreported: 0,
            denied_unreported: 0,
            reported_at_ms: now_ms,
        });
        let allowed = match &mut bucket.enforcing {
            Enforcing::TokenBucket(enforced) if !enforced.expired(now_ms) => {
                enforced.try_admit(now_ms)
            }
            Enforcing::AllowAll { until_ms } if now_ms < *until_ms => true,
            Enforcing::DenyAll { until_ms } if now_ms < *until_ms => false,
            _ => self.no_assignment == NoAssignment::Allow,
        };
        if allowed {
            bucket.allowed += 1;
            bucket.allowed_unreported += 1;
        } else {
            bucket.denied += 1;
            bucket.denied_unreported += 1;
        }
        allowed
    }

    /// Sends the usage of every bucket since its last report (the first message carries the
    /// domain).
    pub async fn report(&mut self) -> Result<(), Status> {
        let now_ms = self.clock.now_ms();
        let usages: Vec<BucketQuotaUsage> = {
            let mut buckets = lock(&self.buckets);
            buckets
                .values_mut()
                .map(|bucket| {
                    let usage = BucketQuotaUsage {
                        bucket_id: Some(bucket.id.clone()),
                        time_elapsed: Some(duration_of_ms(
                            now_ms.saturating_sub(bucket.reported_at_ms).max(1),
                        )),
                        num_requests_allowed: bucket.allowed_unreported,
                        num_requests_denied: bucket.denied_unreported,
                    };
                    bucket.allowed_unreported = 0;
                    bucket.denied_unreported = 0;
                    bucket.reported_at_ms = now_ms;
                    usage
                })
                .collect()
        };
        if usages.is_empty() {
            return Ok(());
        }
        let message = RateLimitQuotaUsageReports {
            domain: if self.domain_sent {
                String::new()
            } else {
                self.domain.clone()
            },
            bucket_quota_usages: usages,
        };
        self.domain_sent = true;
        self.reports
            .send(message)
            .await
            .map_err(|_| Status::unavailable("the stream has ended"))
    }

    /// Counts of bucket `id` since the gateway started.
    pub fn counts(&self, id: &BucketId) -> BucketCounts {
        let key: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
        lock(&self.buckets)
            .get(&key)
            .map(|bucket| BucketCounts {
                allowed: bucket.allowed,
                denied: bucket.denied,
            })
            .unwrap_or_default()
    }

    /// Whether bucket `id` was last given a token-bucket assignment.
    pub fn assigned(&self, id: &BucketId) -> bool {
        let key: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
        lock(&self.buckets)
            .get(&key)
            .is_some_and(|bucket| matches!(bucket.enforcing, Enforcing::TokenBucket(_)))
    }
}

/// Applies one action the agent sent.
fn apply(
    buckets: &mut HashMap<BTreeMap<String, String>, LocalBucket>,
    action: BucketAction,
    now_ms: u64,
) {
    let Some(id) = action.bucket_id else {
        return;
    };
    let key: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
    match action.bucket_action {
        Some(Action::AbandonAction(_)) => {
            buckets.remove(&key);
        }
        Some(Action::QuotaAssignmentAction(assignment)) => {
            let ttl_ms = assignment
                .assignment_time_to_live
                .as_ref()
                .and_then(|duration| duration_ms(duration).ok())
                .unwrap_or(u64::MAX);
            let until_ms = now_ms.saturating_add(ttl_ms);
            let enforcing = match assignment
                .rate_limit_strategy
                .and_then(|strategy| strategy.strategy)
            {
                Some(Strategy::TokenBucket(bucket)) => {
                    let strategy = BucketStrategy {
                        max_tokens: bucket.max_tokens,
                        tokens_per_fill: bucket.tokens_per_fill.unwrap_or(1),
                        fill_interval_ms: bucket
                            .fill_interval
                            .as_ref()
                            .and_then(|duration| duration_ms(duration).ok())
                            .unwrap_or(1_000),
                    };
                    Enforcing::TokenBucket(EnforcedBucket::new(strategy, ttl_ms, now_ms))
                }
                Some(Strategy::BlanketRule(rule))
                    if BlanketRule::try_from(rule) == Ok(BlanketRule::DenyAll) =>
                {
                    Enforcing::DenyAll { until_ms }
                }
                // ALLOW_ALL, no strategy (allow all), or one this gateway does not enforce.
                _ => Enforcing::AllowAll { until_ms },
            };
            if let Some(bucket) = buckets.get_mut(&key) {
                bucket.enforcing = enforcing;
            }
        }
        None => {}
    }
}
