//! Gateways deciding locally behind the rate limit quota service (RLQS), beside Envoy's rate limit
//! service (RLS: one agent call per request), on the same agent, policy and Redis.
//!
//! - `rls`: 64 tonic callers, one `ShouldRateLimit` per decision, as fast as they go.
//! - `rlqs same load`: 8 reference gateways (one stream each), deciding at the rate `rls` reached,
//!   spread over 100 users; every decision is local, against the assignments the agent pushes.
//! - `rlqs flat out`: the same gateways deciding as fast as they can.
//! - `local bucket`: a gateway's own floor: one enforced token bucket deciding in a loop, no
//!   stream, no map (the ceiling of what a local decision can cost).
//!
//! The policy is the agent bench's: one global pool (leases from a stand-in allocator, chunks of
//! 100,000 so one assignment can carry a gateway's demand) and three regional rules on Redis
//! (charged per carve on the RLQS path, per request on the RLS path). The agent runs on a runtime
//! of its own, on threads named `agent-rt`; its CPU is read from `/proc/self/task/*/stat`
//! (user + system) for exactly those threads, so the load generators' CPU is not counted. Redis CPU
//! from `INFO cpu`. 3 s per figure. Prints a table and `BENCH {json}` lines with bench = "rlqs".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_region_agent::clock::{Stopwatch, SystemClock};
use allot_region_agent::global::sublease::{BucketStrategy, EnforcedBucket};
use allot_region_agent::http::AgentApi;
use allot_region_agent::limiter::{RedisStore, RedisStoreConfig};
use allot_region_agent::rlqs::gateway::{Gateway, NoAssignment};
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::BucketId;
use serde_json::json;

mod common;

use common::{
    AGENT_THREADS, GATEWAY, agent_and_load_runtimes, envoy_channels, logging_as_deployed,
    redis_cpu_seconds, rls_request, start_agent, stub_allocator, thread_cpu_seconds,
};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const RUN: Duration = Duration::from_secs(3);
const RLS_CALLERS: u64 = 64;
const GATEWAYS: u64 = 8;
const USERS: u64 = 100;
/// Chunk of the stand-in allocator's grants: large enough that an assignment carries a gateway's
/// demand (the agent bench uses the reference design's 100).
const CHUNK_TOKENS: u64 = 100_000;

struct Figure {
    decisions_per_second: f64,
    admitted_share: f64,
    /// Share of RLS calls answered `UNAVAILABLE` (a Redis call past the decision budget).
    unavailable_share: f64,
    agent_cpu_us_per_1000: f64,
    redis_cpu_us_per_1000: f64,
    agent_calls_per_1000: f64,
}

/// CPU of the agent and of Redis over a measured run of `decisions`, with `agent_calls` messages
/// or calls to the agent, `admitted` of them admitted.
struct Run {
    decisions: u64,
    admitted: u64,
    unavailable: u64,
    agent_calls: u64,
}

async fn measure<F>(connection: &mut redis::aio::MultiplexedConnection, run: F) -> Figure
where
    F: std::future::Future<Output = Run>,
{
    let agent_before = thread_cpu_seconds(AGENT_THREADS);
    let redis_before = redis_cpu_seconds(connection).await;
    let stopwatch = Stopwatch::start();
    let outcome = run.await;
    let seconds = stopwatch.elapsed().as_secs_f64();
    let agent_cpu = thread_cpu_seconds(AGENT_THREADS) - agent_before;
    let redis_cpu = redis_cpu_seconds(connection).await - redis_before;
    let per_1000 = |value: f64| value * 1_000.0 / outcome.decisions.max(1) as f64;
    Figure {
        decisions_per_second: outcome.decisions as f64 / seconds,
        admitted_share: outcome.admitted as f64 / outcome.decisions.max(1) as f64,
        unavailable_share: outcome.unavailable as f64 / outcome.decisions.max(1) as f64,
        agent_cpu_us_per_1000: per_1000(agent_cpu * 1e6),
        redis_cpu_us_per_1000: per_1000(redis_cpu * 1e6),
        agent_calls_per_1000: per_1000(outcome.agent_calls as f64),
    }
}

/// RLS: `RLS_CALLERS` tonic callers, one call per decision.
async fn rls(url: String) -> Run {
    use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let channels = envoy_channels(&url, RLS_CALLERS).await;
    for caller in 0..RLS_CALLERS {
        let stop = stop.clone();
        let channel = channels[caller as usize % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut client = RateLimitServiceClient::new(channel);
            let (mut decisions, mut admitted, mut unavailable) = (0u64, 0u64, 0u64);
            let mut n = caller;
            while !stop.load(Ordering::Relaxed) {
                let request = rls_request(n, USERS);
                match client.should_rate_limit(request).await {
                    Ok(answer) if answer.get_ref().overall_code == Code::Ok as i32 => admitted += 1,
                    Err(status) if status.code() == tonic::Code::Unavailable => unavailable += 1,
                    _ => {}
                }
                decisions += 1;
                n += RLS_CALLERS;
            }
            (decisions, admitted, unavailable)
        }));
    }
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let mut run = Run {
        decisions: 0,
        admitted: 0,
        unavailable: 0,
        agent_calls: 0,
    };
    for task in tasks {
        let (decisions, admitted, unavailable) = task.await.expect("caller");
        run.decisions += decisions;
        run.admitted += admitted;
        run.unavailable += unavailable;
    }
    run.agent_calls = run.decisions;
    run
}

fn user_bucket(user: u64) -> BucketId {
    BucketId {
        bucket: [
            ("tenant", "atlas".to_owned()),
            ("user", format!("U-{user}")),
            ("route_group", "read".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
    }
}

/// RLQS: `GATEWAYS` reference gateways deciding locally, at `per_second` decisions a second in all
/// (`None`: as fast as they can), reporting every second. Counts decisions and the messages each
/// way as agent calls.
async fn rlqs(url: String, per_second: Option<f64>, warm_up: bool) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    let buckets: Arc<Vec<BucketId>> = Arc::new((0..USERS).map(user_bucket).collect());
    for gateway_index in 0..GATEWAYS {
        let (url, stop, reports, buckets) =
            (url.clone(), stop.clone(), reports.clone(), buckets.clone());
        tasks.push(tokio::spawn(async move {
            let channel = tonic::transport::Channel::from_shared(url)
                .expect("uri")
                .connect()
                .await
                .expect("connect");
            let mut gateway = Gateway::connect(
                channel,
                GATEWAY,
                "bench",
                NoAssignment::Deny,
                Arc::new(SystemClock),
            )
            .await
            .expect("stream");
            let clock = Stopwatch::start();
            let (mut decisions, mut admitted) = (0u64, 0u64);
            let mut next_report_s = 0.0;
            // Each gateway sees every user, starting at its own.
            let mut n = gateway_index * USERS / GATEWAYS;
            let per_gateway = per_second.map(|rate| rate / GATEWAYS as f64);
            if warm_up {
                // Subscribe every bucket and let the first assignments arrive.
                for bucket in buckets.iter() {
                    gateway.decide(bucket);
                }
                gateway.report().await.expect("report");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            while !stop.load(Ordering::Relaxed) {
                let elapsed = clock.elapsed().as_secs_f64();
                let due = per_gateway.map_or(u64::MAX, |rate| (rate * elapsed) as u64);
                let mut burst = 0;
                while decisions < due && burst < 1_000 {
                    if gateway.decide(&buckets[(n % USERS) as usize]) {
                        admitted += 1;
                    }
                    decisions += 1;
                    n += 1;
                    burst += 1;
                }
                if elapsed >= next_report_s {
                    gateway.report().await.expect("report");
                    reports.fetch_add(1, Ordering::Relaxed);
                    next_report_s += 1.0;
                }
                if per_gateway.is_some() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                } else {
                    tokio::task::yield_now().await;
                }
            }
            (decisions, admitted)
        }));
    }
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let mut run = Run {
        decisions: 0,
        admitted: 0,
        unavailable: 0,
        agent_calls: 0,
    };
    for task in tasks {
        let (decisions, admitted) = task.await.expect("gateway");
        run.decisions += decisions;
        run.admitted += admitted;
    }
    run.agent_calls = reports.load(Ordering::Relaxed);
    run
}

/// A gateway's floor: one enforced bucket deciding in a loop.
fn local_bucket() -> Run {
    let strategy = BucketStrategy {
        max_tokens: u32::MAX,
        tokens_per_fill: u32::MAX,
        fill_interval_ms: 1,
    };
    let stopwatch = Stopwatch::start();
    let mut bucket = EnforcedBucket::new(strategy, u64::MAX / 2, 0);
    let (mut decisions, mut admitted) = (0u64, 0u64);
    while stopwatch.elapsed() < RUN {
        for _ in 0..10_000 {
            let now_ms = decisions / 1_000;
            if bucket.try_admit(std::hint::black_box(now_ms)) {
                admitted += 1;
            }
            decisions += 1;
        }
    }
    Run {
        decisions,
        admitted,
        unavailable: 0,
        agent_calls: 0,
    }
}

fn main() {
    logging_as_deployed();
    let redis = allot_testkit::RedisServer::start();
    let (agent_runtime, load) = agent_and_load_runtimes();
    let redis_url = redis.url();
    let url = agent_runtime.block_on(async move {
        let grants = Arc::new(AtomicU64::new(0));
        let allocator = stub_allocator(grants, CHUNK_TOKENS).await;
        let store = Arc::new(
            RedisStore::connect(&redis_url, RedisStoreConfig::default())
                .await
                .expect("redis"),
        );
        let (_, api): (String, AgentApi) = start_agent(store, &allocator, true).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(allot_region_agent::grpc::serve_grpc(
            listener,
            api,
            None,
            std::future::pending(),
        ));
        url
    });
    let redis_url = redis.url();
    load.block_on(async move {
        let mut connection = redis::Client::open(redis_url.as_str())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection");
        let rls_figure = measure(&mut connection, rls(url.clone())).await;
        let same_load = measure(
            &mut connection,
            rlqs(url.clone(), Some(rls_figure.decisions_per_second), true),
        )
        .await;
        let flat_out = measure(&mut connection, rlqs(url.clone(), None, true)).await;
        let floor = measure(&mut connection, async { local_bucket() }).await;
        println!(
            "{:<16} {:>14} {:>9} {:>10} {:>16} {:>10} {:>16} {:>16}",
            "path",
            "decisions/s",
            "x rls",
            "admitted",
            "agent us/1000",
            "x rls",
            "redis us/1000",
            "agent calls/1000"
        );
        for (path, figure) in [
            ("rls", &rls_figure),
            ("rlqs same load", &same_load),
            ("rlqs flat out", &flat_out),
            ("local bucket", &floor),
        ] {
            let speed = figure.decisions_per_second / rls_figure.decisions_per_second.max(1.0);
            let cpu = figure.agent_cpu_us_per_1000 / rls_figure.agent_cpu_us_per_1000.max(1.0);
            println!(
                "{path:<16} {:>14.0} {speed:>9.2} {:>9.1}% {:>16.0} {cpu:>10.3} {:>16.0} {:>16.2}",
                figure.decisions_per_second,
                figure.admitted_share * 100.0,
                figure.agent_cpu_us_per_1000,
                figure.redis_cpu_us_per_1000,
                figure.agent_calls_per_1000
            );
            println!(
                "BENCH {}",
                json!({ "bench": "rlqs", "path": path,
                    "decisionsPerSecond": figure.decisions_per_second.round(),
                    "xRls": (speed * 100.0).round() / 100.0,
                    "admittedPercent": (figure.admitted_share * 1_000.0).round() / 10.0,
                    "unavailablePercent": (figure.unavailable_share * 1_000.0).round() / 10.0,
                    "agentCpuUsPer1000": figure.agent_cpu_us_per_1000.round(),
                    "agentCpuXRls": (cpu * 1_000.0).round() / 1_000.0,
                    "redisCpuUsPer1000": figure.redis_cpu_us_per_1000.round(),
                    "agentCallsPer1000": (figure.agent_calls_per_1000 * 100.0).round() / 100.0 })
            );
        }
    });
}
