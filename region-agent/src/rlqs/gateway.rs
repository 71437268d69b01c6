//! A gateway of the rate limit quota service: it decides every request locally against the
//! assignments its agent pushes and reports usage, as Envoy's `rate_limit_quota` filter does.
//!
//! Allot's agent never runs this; it is the client the tests, drills and benchmarks drive the
//! service with, and a reference for what the agent's bound assumes of gateways: an assignment's
//! token bucket starts full, refills continuously, and admits nothing once its time to live has
//! run out ([`EnforcedBucket`]); a bucket without a live assignment is decided by
//! [`NoAssignment`] (Envoy's `no_assignment_behavior` and, after expiry,
//! `expired_assignment_behavior` with `fallback_rate_limit`).
//!
//! It reads and sends what Envoy's `rate_limit_quota` filter does, never friendlier:
//! - durations in **whole seconds**: an assignment's time to live and a bucket's fill interval lose
//!   their nanos; a time to live of 0 (or none) expires at once; a fill interval of 0 seconds
//!   divides Envoy's refill by zero, which admits everything until the assignment ends;
//!   `tokens_per_fill` unset is 0 (no refill);
//! - a token bucket whose `max_tokens`, `tokens_per_fill` and fill interval nanos equal the one in
//!   force is kept as it is (its tokens and its old fill interval), only its time to live renewed;
//! - a new bucket is reported at once, its first request counted, with a `time_elapsed` of 0;
//!   every report's `time_elapsed` is whole seconds, rounded down; every message names the
//!   domain.

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
use super::proto::envoy::r#type::v3::TokenBucket;
use super::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
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
    AllowAll {
        until_ms: u64,
    },
    DenyAll {
        until_ms: u64,
    },
    /// With what Envoy compares to keep a bucket: `max_tokens`, `tokens_per_fill` and the fill
    /// interval's nanos (not its seconds).
    TokenBucket {
        enforced: EnforcedBucket,
        kept_if_equal: (u32, u32, i32),
    },
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
        let new = !buckets.contains_key(&key);
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
            Enforcing::TokenBucket { enforced, .. } if !enforced.expired(now_ms) => {
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
        if new {
            // Envoy reports a new bucket at once, with its first request and 0 elapsed; a report
            // that cannot be queued is dropped, as Envoy drops one while its stream is down.
            let usage = take_usage(bucket, now_ms);
            let _dropped = self.reports.try_send(RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: vec![usage],
            });
        }
        allowed
    }

    /// Sends the usage of every bucket since its last report (Envoy's filter does so every
    /// 5 s, whatever the bucket's `reporting_interval` says).
    pub async fn report(&mut self) -> Result<(), Status> {
        let now_ms = self.clock.now_ms();
        let usages: Vec<BucketQuotaUsage> = {
            let mut buckets = lock(&self.buckets);
            buckets
                .values_mut()
                .map(|bucket| take_usage(bucket, now_ms))
                .collect()
        };
        if usages.is_empty() {
            return Ok(());
        }
        let message = RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: usages,
        };
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
            .is_some_and(|bucket| matches!(bucket.enforcing, Enforcing::TokenBucket { .. }))
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
            let until_ms = now_ms.saturating_add(whole_seconds_ms(
                assignment.assignment_time_to_live.as_ref(),
            ));
            let Some(bucket) = buckets.get_mut(&key) else {
                return;
            };
            let enforcing = match assignment
                .rate_limit_strategy
                .and_then(|strategy| strategy.strategy)
            {
                Some(Strategy::TokenBucket(token_bucket)) => {
                    token_bucket_as_envoy(&bucket.enforcing, &token_bucket, until_ms, now_ms)
                }
                Some(Strategy::BlanketRule(rule))
                    if BlanketRule::try_from(rule) == Ok(BlanketRule::DenyAll) =>
                {
                    Enforcing::DenyAll { until_ms }
                }
                // ALLOW_ALL, no strategy (allow all), or one this gateway does not enforce.
                _ => Enforcing::AllowAll { until_ms },
            };
            bucket.enforcing = enforcing;
        }
        None => {}
    }
}

/// A bucket's usage since its last report, as Envoy reports it (elapsed whole seconds, rounded
/// down); its counters start again.
fn take_usage(bucket: &mut LocalBucket, now_ms: u64) -> BucketQuotaUsage {
    let elapsed_s = now_ms.saturating_sub(bucket.reported_at_ms) / 1_000;
    let usage = BucketQuotaUsage {
        bucket_id: Some(bucket.id.clone()),
        time_elapsed: Some(prost_types::Duration {
            seconds: i64::try_from(elapsed_s).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        num_requests_allowed: bucket.allowed_unreported,
        num_requests_denied: bucket.denied_unreported,
    };
    bucket.allowed_unreported = 0;
    bucket.denied_unreported = 0;
    bucket.reported_at_ms = now_ms;
    usage
}

/// A duration as Envoy's filter reads it: whole seconds, the nanos dropped; none is 0.
pub fn whole_seconds_ms(duration: Option<&prost_types::Duration>) -> u64 {
    let Some(duration) = duration else {
        return 0;
    };
    // absl::ToInt64Seconds: the whole duration, truncated toward zero.
    let nanos = i128::from(duration.seconds) * 1_000_000_000 + i128::from(duration.nanos);
    u64::try_from(nanos / 1_000_000_000)
        .unwrap_or(0)
        .saturating_mul(1_000)
}

/// The token bucket Envoy enforces for an assignment until `until_ms`: the one in force kept when
/// Envoy finds it equal, else a new one, full; a fill interval of 0 whole seconds admits
/// everything (Envoy divides its refill by zero).
fn token_bucket_as_envoy(
    in_force: &Enforcing,
    token_bucket: &TokenBucket,
    until_ms: u64,
    now_ms: u64,
) -> Enforcing {
    let fill = token_bucket.fill_interval.unwrap_or_default();
    let tokens_per_fill = token_bucket.tokens_per_fill.unwrap_or(0);
    let kept_if_equal = (token_bucket.max_tokens, tokens_per_fill, fill.nanos);
    let ttl_ms = until_ms.saturating_sub(now_ms);
    if let Enforcing::TokenBucket {
        enforced,
        kept_if_equal: in_force_key,
    } = in_force
        && *in_force_key == kept_if_equal
    {
        return Enforcing::TokenBucket {
            enforced: enforced.renewed(ttl_ms, now_ms),
            kept_if_equal,
        };
    }
    let fill_interval_ms = whole_seconds_ms(Some(&fill));
    if fill_interval_ms == 0 {
        return Enforcing::AllowAll { until_ms };
    }
    let strategy = BucketStrategy {
        max_tokens: token_bucket.max_tokens,
        tokens_per_fill,
        fill_interval_ms,
    };
    Enforcing::TokenBucket {
        enforced: EnforcedBucket::new(strategy, ttl_ms, now_ms),
        kept_if_equal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn duration(seconds: i64, nanos: i32) -> prost_types::Duration {
        prost_types::Duration { seconds, nanos }
    }

    fn bucket(max_tokens: u32, tokens_per_fill: Option<u32>, fill: (i64, i32)) -> TokenBucket {
        TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval: Some(duration(fill.0, fill.1)),
        }
    }

    fn admitted(enforcing: &mut Enforcing, from_ms: u64, until_ms: u64) -> u64 {
        (from_ms..until_ms)
            .step_by(10)
            .filter(|&now_ms| match enforcing {
                Enforcing::TokenBucket { enforced, .. } => enforced.try_admit(now_ms),
                Enforcing::AllowAll { until_ms } => now_ms < *until_ms,
                _ => false,
            })
            .count() as u64
    }

    #[test]
    fn durations_are_whole_seconds_truncated_and_none_is_zero() {
        assert_eq!(whole_seconds_ms(None), 0);
        assert_eq!(whole_seconds_ms(Some(&duration(0, 999_999_999))), 0);
        assert_eq!(whole_seconds_ms(Some(&duration(1, 999_000_000))), 1_000);
        assert_eq!(whole_seconds_ms(Some(&duration(2, -500_000_000))), 1_000);
        assert_eq!(whole_seconds_ms(Some(&duration(-3, 0))), 0);
    }

    #[test]
    fn a_token_bucket_is_read_as_envoy_reads_it() {
        // A fill interval of 1.667 s is 1 s to Envoy: one a second, not one every 1.667 s.
        let mut sub_second = token_bucket_as_envoy(
            &Enforcing::Nothing,
            &bucket(1, Some(1), (1, 667_000_000)),
            5_000,
            0,
        );
        assert_eq!(admitted(&mut sub_second, 0, 5_000), 5);
        // Under a second is 0 seconds: Envoy's refill divides by zero and admits everything.
        let mut unlimited = token_bucket_as_envoy(
            &Enforcing::Nothing,
            &bucket(1, Some(1), (0, 500_000_000)),
            1_000,
            0,
        );
        assert_eq!(admitted(&mut unlimited, 0, 2_000), 100);
        // No tokens_per_fill: no refill at all.
        let mut no_refill =
            token_bucket_as_envoy(&Enforcing::Nothing, &bucket(3, None, (1, 0)), 5_000, 0);
        assert_eq!(admitted(&mut no_refill, 0, 5_000), 3);
    }

    #[test]
    fn an_unchanged_bucket_is_kept_with_its_tokens_and_its_old_fill_interval() {
        let mut first =
            token_bucket_as_envoy(&Enforcing::Nothing, &bucket(2, Some(1), (1, 0)), 1_000, 0);
        assert_eq!(admitted(&mut first, 0, 10), 1, "one of two taken");
        // Same max_tokens and tokens_per_fill, another fill interval's seconds: kept as it is.
        let mut kept = token_bucket_as_envoy(&first, &bucket(2, Some(1), (4, 0)), 3_500, 500);
        assert_eq!(
            admitted(&mut kept, 500, 3_500),
            1 + 3,
            "the token left and one a second (the old interval) for 3 s"
        );
        // Another max_tokens: a new bucket, full.
        let mut fresh = token_bucket_as_envoy(&kept, &bucket(5, Some(1), (1, 0)), 5_000, 4_000);
        assert_eq!(admitted(&mut fresh, 4_000, 4_010), 1);
        assert_eq!(admitted(&mut fresh, 4_010, 4_020), 1, "it started full");
    }
}
