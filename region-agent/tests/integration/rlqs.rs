//! Envoy's rate limit quota service over gRPC: gateways (tonic clients from the same proto subset)
//! stream usage reports and get assignments carved from what the agent holds, against a stand-in
//! allocator that grants from a real remaining count and records the reports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use allot_region_agent::clock::{Clock, SystemClock};
use allot_region_agent::global::sublease::BucketStrategy;
use allot_region_agent::rlqs::gateway::{Gateway as ReferenceGateway, NoAssignment};
use allot_region_agent::rlqs::proto::envoy::r#type::v3::rate_limit_strategy::{
    BlanketRule, Strategy,
};
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use allot_region_agent::service::Agent;
use tokio::sync::mpsc;
use tonic::Streaming;

use crate::common;

use crate::common::allocator::{Allocator, client};

const TOKEN: &str = "gateway-token-1";

/// The tenant's global pool on `read`; `open` is limited by nothing.
const POOL_ONLY: &str = r#"{ "rules": [
    { "id": "global-read", "scope": "global", "routeGroup": "read", "pool": "api",
      "failMode": "closed" } ] }"#;

/// The pool, and a per-user fixed window of 30 an hour on `read`.
const POOL_AND_USER_WINDOW: &str = r#"{ "rules": [
    { "id": "global-read", "scope": "global", "routeGroup": "read", "pool": "api",
      "failMode": "closed" },
    { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 30, "windowMs": 3600000, "failMode": "closed" } ] }"#;

struct Served {
    agent: Arc<Agent>,
    address: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn serve(fake: &Arc<Allocator>, bundle: &str) -> Served {
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(bundle)),
    );
    let (address, stop) = common::serve_grpc(agent.clone(), TOKEN).await;
    Served {
        agent,
        address,
        stop: Some(stop),
    }
}

/// A gateway: its report stream and the agent's answers.
struct Gateway {
    reporter: Reporter,
    answers: Streaming<RateLimitQuotaResponse>,
}

/// A gateway's side of its stream.
struct Reporter {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    domain_sent: bool,
}

async fn open(served: &Served, token: &str) -> Result<Gateway, tonic::Status> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", served.address))
        .await
        .expect("connect");
    let (reports, outgoing) = mpsc::channel(16);
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(outgoing));
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("metadata"),
    );
    let answers = client.stream_rate_limit_quotas(request).await?.into_inner();
    Ok(Gateway {
        reporter: Reporter {
            reports,
            domain_sent: false,
        },
        answers,
    })
}

fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

fn user_bucket(user: &str) -> BucketId {
    bucket(&[("tenant", "atlas"), ("user", user), ("route_group", "read")])
}

impl Gateway {
    async fn report(&mut self, id: &BucketId, elapsed_ms: u64, allowed: u64, denied: u64) {
        self.reporter.report(id, elapsed_ms, allowed, denied).await;
    }
}

impl Reporter {
    async fn report(&mut self, id: &BucketId, elapsed_ms: u64, allowed: u64, denied: u64) {
        let elapsed = prost_types::Duration {
            seconds: i64::try_from(elapsed_ms / 1_000).expect("fits"),
            nanos: i32::try_from(elapsed_ms % 1_000 * 1_000_000).expect("fits"),
        };
        self.report_elapsed(id, elapsed, allowed, denied).await;
    }

    /// A report whose `time_elapsed` is exactly `elapsed`, valid or not.
    async fn report_elapsed(
        &mut self,
        id: &BucketId,
        elapsed: prost_types::Duration,
        allowed: u64,
        denied: u64,
    ) {
        let message = RateLimitQuotaUsageReports {
            domain: if self.domain_sent {
                String::new()
            } else {
                "envoy".to_owned()
            },
            bucket_quota_usages: vec![BucketQuotaUsage {
                bucket_id: Some(id.clone()),
                time_elapsed: Some(elapsed),
                num_requests_allowed: allowed,
                num_requests_denied: denied,
            }],
        };
        self.domain_sent = true;
        self.reports
            .send(message)
            .await
            .expect("the stream is open");
    }
}

impl Gateway {
    /// The next action for `id`, within a few seconds.
    async fn action_for(&mut self, id: &BucketId) -> BucketAction {
        let deadline = allot_region_agent::clock::monotonic_now() + Duration::from_secs(5);
        loop {
            let message = tokio::time::timeout_at(deadline, self.answers.message())
                .await
                .expect("an answer in time")
                .expect("the stream stays up")
                .expect("a message");
            if let Some(action) = message
                .bucket_action
                .into_iter()
                .rev()
                .find(|a| a.bucket_id.as_ref() == Some(id))
            {
                return action;
            }
        }
    }

    /// The next token-bucket assignment for `id`: its strategy and time to live, ms.
    async fn token_bucket_for(&mut self, id: &BucketId) -> (BucketStrategy, u64) {
        loop {
            let action = self.action_for(id).await;
            if let Some(assigned) = token_bucket(&action) {
                return assigned;
            }
        }
    }
}

fn token_bucket(action: &BucketAction) -> Option<(BucketStrategy, u64)> {
    let Some(Action::QuotaAssignmentAction(assignment)) = &action.bucket_action else {
        return None;
    };
    let ttl = assignment.assignment_time_to_live.as_ref()?;
    let ttl_ms =
        u64::try_from(ttl.seconds).ok()? * 1_000 + u64::try_from(ttl.nanos).ok()? / 1_000_000;
    match assignment.rate_limit_strategy.as_ref()?.strategy.as_ref()? {
        Strategy::TokenBucket(bucket) => {
            let interval = bucket.fill_interval.as_ref()?;
            Some((
                BucketStrategy {
                    max_tokens: bucket.max_tokens,
                    tokens_per_fill: bucket.tokens_per_fill.unwrap_or(1),
                    fill_interval_ms: u64::try_from(interval.seconds).ok()? * 1_000
                        + u64::try_from(interval.nanos).ok()? / 1_000_000,
                },
                ttl_ms,
            ))
        }
        _ => None,
    }
}

fn blanket(action: &BucketAction) -> Option<BlanketRule> {
    let Some(Action::QuotaAssignmentAction(assignment)) = &action.bucket_action else {
        return None;
    };
    match assignment.rate_limit_strategy.as_ref()?.strategy.as_ref()? {
        Strategy::BlanketRule(rule) => BlanketRule::try_from(*rule).ok(),
        _ => None,
    }
}

/// A gateway reporting demand gets a token bucket it can admit no more than the pool gave; what
/// it reports admitted reaches the ledger as spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_bucket_gets_a_token_bucket_carved_from_the_pool() {
    let fake = Allocator::new(1_000, 200, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let mut gateway = open(&served, TOKEN).await.expect("open");
    let id = user_bucket("U-1");
    gateway.report(&id, 1_000, 0, 20).await;
    let (strategy, ttl_ms) = gateway.token_bucket_for(&id).await;
    let admissible = strategy.admissible_requests(ttl_ms);
    assert!((500..=5_000).contains(&ttl_ms), "ttl {ttl_ms}");
    assert!(admissible >= 1, "{strategy:?}");
    assert!(
        admissible <= 200,
        "no more than one chunk: {strategy:?} over {ttl_ms} ms"
    );
    // The gateway admits part of it and says so.
    let used = admissible.min(25);
    gateway.report(&id, 1_000, used, 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    served.agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        used,
        "admits only, as they are reported"
    );
}

/// Two gateways of one pool, one busy, one quiet, and too little for both: the busy one gets the
/// larger assignment, and together they can admit no more than the pool holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scarce_quota_goes_by_demand_and_never_beyond_what_is_held() {
    let fake = Allocator::new(120, 120, 0);
    // Demand first, so both are weighed before tokens are held: the lease the first report asks
    // for arrives after the second report (sent right after it), yet within the agent's patience
    // for a first grant (200 ms), past which the pool would be denied for a while.
    fake.grant_delay_ms
        .store(120, std::sync::atomic::Ordering::SeqCst);
    let served = serve(&fake, POOL_ONLY).await;
    let mut busy = open(&served, TOKEN).await.expect("open");
    let mut quiet = open(&served, TOKEN).await.expect("open");
    let id = user_bucket("U-shared");
    busy.report(&id, 1_000, 0, 90).await;
    quiet.report(&id, 1_000, 0, 10).await;
    let mut latest: HashMap<&str, (BucketStrategy, u64)> = HashMap::new();
    latest.insert("busy", busy.token_bucket_for(&id).await);
    latest.insert("quiet", quiet.token_bucket_for(&id).await);
    let admissible = |who: &str| {
        let (strategy, ttl_ms) = latest[who];
        strategy.admissible_requests(ttl_ms)
    };
    assert!(
        admissible("busy") > admissible("quiet"),
        "busy {} vs quiet {}",
        admissible("busy"),
        admissible("quiet")
    );
    assert!(
        admissible("busy") + admissible("quiet") <= 120,
        "busy {} + quiet {} within the pool",
        admissible("busy"),
        admissible("quiet")
    );
}

/// A bucket no rule limits is allowed; one whose pool is spent is denied; a policy that stops
/// limiting a bucket abandons it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlimited_buckets_are_allowed_spent_pools_denied_and_dropped_buckets_abandoned() {
    let fake = Allocator::new(0, 10, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let mut gateway = open(&served, TOKEN).await.expect("open");
    let open_route = bucket(&[
        ("tenant", "atlas"),
        ("user", "U-1"),
        ("route_group", "open"),
    ]);
    gateway.report(&open_route, 1_000, 5, 0).await;
    let action = gateway.action_for(&open_route).await;
    assert_eq!(blanket(&action), Some(BlanketRule::AllowAll), "{action:?}");

    let read = user_bucket("U-1");
    gateway.report(&read, 1_000, 0, 5).await;
    let action = gateway.action_for(&read).await;
    assert_eq!(blanket(&action), Some(BlanketRule::DenyAll), "{action:?}");

    // The next bundle limits nothing on read: the bucket is abandoned when next looked at.
    let unlimited = common::bundle(
        r#"{ "bundleVersion": 99, "rules": [
            { "id": "other", "scope": "user", "routeGroup": "write", "algorithm": "fixed_window",
              "limit": 1, "windowMs": 60000, "failMode": "closed" } ] }"#,
    );
    assert!(served.agent.offer_bundle(unlimited));
    let mut abandoned = false;
    for _ in 0..3 {
        gateway.report(&read, 1_000, 0, 5).await;
        let action = gateway.action_for(&read).await;
        if matches!(action.bucket_action, Some(Action::AbandonAction(_))) {
            abandoned = true;
            break;
        }
    }
    assert!(
        abandoned,
        "a bucket the policy no longer limits is abandoned"
    );
}

/// Regional rules are carved too: a user window of 30 bounds what the gateway may admit, and a
/// gateway that used it all is denied the rest of the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regional_rules_bound_the_assignment_as_well() {
    let fake = Allocator::new(1_000, 500, 0);
    let served = serve(&fake, POOL_AND_USER_WINDOW).await;
    let mut gateway = open(&served, TOKEN).await.expect("open");
    let id = user_bucket("U-window");
    gateway.report(&id, 1_000, 0, 100).await;
    let mut total_admissible = 0;
    let mut denied = false;
    for _ in 0..10 {
        let action = gateway.action_for(&id).await;
        if let Some((strategy, ttl_ms)) = token_bucket(&action) {
            let admissible = strategy.admissible_requests(ttl_ms);
            total_admissible += admissible;
            // The gateway spends all of it at once.
            gateway.report(&id, 1_000, admissible, 100).await;
        } else if blanket(&action) == Some(BlanketRule::DenyAll) {
            denied = true;
            break;
        }
    }
    assert!(denied, "the user's window runs out");
    assert!(
        (1..=30).contains(&total_admissible),
        "some, never beyond the user's window: {total_admissible}"
    );
}

/// Bad input ends the stream with an error naming the field; no token, no stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_streams_end_with_an_error_naming_the_field() {
    let fake = Allocator::new(100, 10, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let refused = open(&served, "wrong-token").await;
    assert_eq!(
        refused.err().map(|status| status.code()),
        Some(tonic::Code::Unauthenticated)
    );

    let mut gateway = open(&served, TOKEN).await.expect("open");
    let no_tenant = bucket(&[("user", "U-1"), ("route_group", "read")]);
    gateway.report(&no_tenant, 1_000, 0, 1).await;
    let status = gateway
        .answers
        .message()
        .await
        .expect_err("the stream ends with an error");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("bucket_quota_usages[0].bucket_id.tenant"),
        "{status:?}"
    );

    let mut gateway = open(&served, TOKEN).await.expect("open");
    gateway.reporter.domain_sent = true; // no domain on the first message
    gateway.report(&user_bucket("U-1"), 1_000, 0, 1).await;
    let status = gateway.answers.message().await.expect_err("an error");
    assert!(status.message().contains("domain"), "{status:?}");
}

/// A gateway that enforces what it is told (the reference gateway: a token bucket per assignment;
/// without one it denies) under `per_second` requests a second for `for_ms`, reporting every
/// 500 ms. Returns what it admitted.
async fn enforce(served: &Served, id: &BucketId, per_second: u64, for_ms: u64) -> u64 {
    enforce_reporting_every(served, id, per_second, for_ms, 500).await
}

/// As [`enforce`], reporting every `report_every_ms` (Envoy's filter: every 5 s).
async fn enforce_reporting_every(
    served: &Served,
    id: &BucketId,
    per_second: u64,
    for_ms: u64,
    report_every_ms: u64,
) -> u64 {
    let clock = SystemClock;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", served.address))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut gateway = ReferenceGateway::connect(
        channel,
        TOKEN,
        "envoy",
        NoAssignment::Deny,
        Arc::new(SystemClock),
    )
    .await
    .expect("open");
    let start_ms = clock.now_ms();
    let mut last_report_ms = start_ms;
    let step_ms = 20;
    let mut owed = 0u64;
    while clock.now_ms() < start_ms + for_ms {
        owed += per_second * step_ms;
        while owed >= 1_000 {
            owed -= 1_000;
            gateway.decide(id);
        }
        if clock.now_ms() >= last_report_ms + report_every_ms {
            gateway.report().await.expect("report");
            last_report_ms = clock.now_ms();
        }
        tokio::time::sleep(Duration::from_millis(step_ms)).await;
    }
    gateway.report().await.expect("report");
    tokio::time::sleep(Duration::from_millis(300)).await;
    gateway.counts(id).allowed
}

/// Envoy reads an assignment's time to live and fill interval in whole seconds. A quiet bucket's
/// carve is smaller than a request a second of its life; written with a fill interval between
/// whole seconds, Envoy would refill it every second and admit more than was carved. A pool of 3,
/// a gateway reading as Envoy does, asking 100 times a second and reporting every 5 s: it admits
/// what the pool holds and never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_carve_read_in_whole_seconds_as_envoy_does_admits_no_more_than_it_holds() {
    let fake = Allocator::new(3, 3, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let id = user_bucket("U-quiet");
    let admitted = enforce_reporting_every(&served, &id, 100, 7_000, 5_000).await;
    assert!(
        (1..=3).contains(&admitted),
        "{admitted} admitted of a pool of 3"
    );
}

/// Cut off from the allocator (its grants hang), an agent carves assignments from the fallback
/// allowance only: the gateway admits no more than the allowance in any window, and every admit is
/// reported as a fallback admit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_shrinks_assignments_to_the_fallback_allowance() {
    let allowance = 50;
    let fake = Allocator::new(1_000, 100, allowance);
    fake.hang_grants
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let served = serve(&fake, POOL_ONLY).await;
    let id = user_bucket("U-cut-off");
    let admitted = enforce(&served, &id, 100, 3_000).await;
    assert!(admitted >= 25, "the allowance is used: {admitted}");
    served.agent.send_reports().await;
    assert_eq!(fake.reported_fallback(), admitted, "every admit reported");
    // The stand-in's windows are wall-clock hours: a run across the hour has two allowances.
    let by_window = fake.fallback_by_window.lock().expect("lock").clone();
    assert!(
        (1..=2).contains(&by_window.len()),
        "one window, or two across the hour: {by_window:?}"
    );
    for (window_start_ms, fallback) in &by_window {
        assert!(
            *fallback <= allowance,
            "{fallback} admitted in the window from {window_start_ms} beyond the allowance of {allowance}"
        );
    }
    assert_eq!(fake.reported_spent(), 0, "nothing was leased");
}

/// Reachable, a busy gateway is held to the pool: what it admits is what the ledger hears of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enforcing_gateway_admits_within_the_pool_and_the_ledger_agrees() {
    let fake = Allocator::new(120, 60, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let id = user_bucket("U-busy");
    let admitted = enforce(&served, &id, 200, 3_000).await;
    assert!(
        admitted >= 60,
        "the gateway gets most of the pool: {admitted}"
    );
    assert!(
        admitted <= 120,
        "{admitted} admitted beyond the pool of 120"
    );
    served.agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        admitted,
        "the ledger hears of every admit"
    );
}

/// The keys of every bucket id the Envoy example builds (`deploy/envoy/rlqs.yaml`), read by
/// indentation: the entries of each inner `bucket_id_builder` map.
fn example_bucket_keys() -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/envoy/rlqs.yaml"
    ))
    .expect("the example");
    let lines: Vec<&str> = text.lines().collect();
    let indent = |line: &str| line.len() - line.trim_start().len();
    let mut buckets = Vec::new();
    for (at, pair) in lines.windows(2).enumerate() {
        if pair[0].trim() != "bucket_id_builder:" || pair[1].trim() != "bucket_id_builder:" {
            continue;
        }
        let key_indent = indent(pair[1]) + 2;
        let keys = lines[at + 2..]
            .iter()
            .take_while(|line| line.trim().is_empty() || indent(line) >= key_indent)
            .filter(|line| indent(line) == key_indent)
            .filter_map(|line| line.trim().split(':').next())
            .map(str::to_owned)
            .collect();
        buckets.push(keys);
    }
    buckets
}

/// Every bucket the Envoy example builds is one the agent maps: it gets an assignment, not an
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_example_builds_buckets_the_agent_maps() {
    let buckets = example_bucket_keys();
    assert!(buckets.len() >= 2, "{buckets:?}");
    let fake = Allocator::new(1_000, 100, 0);
    let served = serve(&fake, POOL_ONLY).await;
    for keys in buckets {
        let entries: Vec<(&str, &str)> = keys
            .iter()
            .map(|key| match key.as_str() {
                "tenant" => ("tenant", "atlas"),
                "route_group" => ("route_group", "read"),
                other => (other, "U-from-a-verified-claim"),
            })
            .collect();
        let id = bucket(&entries);
        let mut gateway = open(&served, TOKEN).await.expect("open");
        gateway.report(&id, 1_000, 0, 1).await;
        let action = gateway.action_for(&id).await;
        assert!(
            action.bucket_action.is_some(),
            "{keys:?} gets an action: {action:?}"
        );
    }
}

/// Envoy reports a new bucket at once with a `time_elapsed` of 0, and later ones in whole seconds
/// (which round down to 0 too): the stream goes on and the bucket gets its assignment. Durations
/// that are no protobuf `Duration` at all, or negative, end the stream saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_of_zero_elapsed_is_envoys_first_and_bad_durations_say_why() {
    let fake = Allocator::new(1_000, 200, 0);
    let served = serve(&fake, POOL_ONLY).await;
    let mut gateway = open(&served, TOKEN).await.expect("open");
    let id = user_bucket("U-1");
    gateway.report(&id, 0, 1, 0).await;
    let (strategy, ttl_ms) = gateway.token_bucket_for(&id).await;
    assert!(strategy.admissible_requests(ttl_ms) >= 1, "{strategy:?}");
    gateway.report(&id, 0, 0, 0).await;
    gateway.report(&id, 1_000, 2, 0).await;
    gateway.report(&id, 0, 1, 0).await;
    let (strategy, ttl_ms) = gateway.token_bucket_for(&id).await;
    assert!(
        strategy.admissible_requests(ttl_ms) >= 1,
        "the stream is up"
    );

    for (elapsed, says) in [
        ((315_576_000_001, 0), "outside protobuf's Duration range"),
        ((0, 1_000_000_000), "outside protobuf's Duration range"),
        ((-1, 0), "negative"),
        ((0, -5), "negative"),
    ] {
        let mut gateway = open(&served, TOKEN).await.expect("open");
        let (seconds, nanos) = elapsed;
        gateway
            .reporter
            .report_elapsed(&id, prost_types::Duration { seconds, nanos }, 1, 0)
            .await;
        let status = loop {
            match gateway.answers.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("{elapsed:?}: the stream ended without an error"),
                Err(status) => break status,
            }
        };
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status
                .message()
                .contains("bucket_quota_usages[0].time_elapsed")
                && status.message().contains(says),
            "{elapsed:?}: {status:?}"
        );
    }
}
