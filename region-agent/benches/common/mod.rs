//! What the agent benchmarks share: the policy, a stand-in allocator, a request, an agent.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::http::{AgentApi, serve};
use allot_region_agent::limiter::{Limiter, LimiterConfig, LimiterStore};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::Pepper;
use axum::Json;
use axum::routing::{get, post};
use serde_json::{Value, json};

/// The gateway token the benchmarks' agents accept.
pub const GATEWAY: &str = "gateway-token-for-bench-01";

/// The 3 regional rules and the global pool of the benchmarks (`with_regional: false`: the pool only).
pub fn bundle(with_regional: bool) -> allot_shared::policy::PolicyBundle {
    let mut rules =
        vec![json!({ "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" })];
    if with_regional {
        for (id, scope, route) in [
            ("user", "user", None),
            ("route", "route", Some("read")),
            ("tenant", "tenant", None),
        ] {
            let mut rule = json!({ "id": id, "scope": scope, "algorithm": "token_bucket",
                "capacityMillis": 1_000_000_000u64, "refillMillis": 1_000_000_000u64, "periodMs": 1000,
                "failMode": "closed" });
            if let Some(route) = route {
                rule["routeGroup"] = json!(route);
            }
            rules.push(rule);
        }
    }
    allot_shared::policy::parse_bundle(&json!({ "rules": rules }).to_string())
        .and_then(|d| d.into_file_bundle())
        .expect("bundle")
}

/// A stand-in allocator: terms for every tenant's `api` pool with `chunk_tokens` (100 in the
/// reference design), and grants of min(want, chunk) tokens per call, counted.
pub async fn stub_allocator(grants: Arc<AtomicU64>, chunk_tokens: u64) -> String {
    let terms = json!({ "limit": 1u64 << 40, "windowMs": 3_600_000, "chunk": chunk_tokens, "leaseTtlMs": 600_000,
                        "fallbackPerRegion": 0, "regions": ["eu"], "version": 1 });
    let app = axum::Router::new()
        .route(
            "/v1/pools/{tenant}/api/terms",
            get(move || async move { Json(terms.clone()) }),
        )
        .route(
            "/v1/agent-sessions",
            post(|| async { Json(json!({ "predecessorEndedCleanly": true, "startedAtMs": 0 })) }),
        )
        .route(
            "/v1/grants",
            post(move |Json(body): Json<Value>| {
                let grants = grants.clone();
                async move {
                    grants.fetch_add(1, Ordering::Relaxed);
                    let now = allot_region_agent::clock::Clock::now_ms(&SystemClock);
                    let start = now - now % 3_600_000;
                    Json(
                        json!({ "leaseId": body["leaseId"], "region": body["region"], "issuedAtMs": now, "answeredAtMs": now, "granted": body["want"].as_u64().unwrap_or(1).min(chunk_tokens), "epoch": 1,
                        "windowStartMs": start, "windowEndMs": start + 3_600_000,
                        "expiresAtMs": (now + 600_000).min(start + 3_600_000), "retryAfterMs": 0 }),
                    )
                }
            }),
        );
    serve_on_free_port(app).await
}

/// Serves `app` on a free loopback port with the agent's own accept loop (so a ceiling served
/// this way differs from the agent only in its handlers); answers its URL.
pub async fn serve_on_free_port(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(allot_net::serve(
        listener,
        app,
        None,
        allot_net::ServeLimits::default(),
        std::future::pending(),
    ));
    url
}

/// An Envoy RLS `ShouldRateLimit` call for request `n` (user `n % users`), with the gateway token.
pub fn rls_request(
    n: u64,
    users: u64,
) -> tonic::Request<allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::RateLimitRequest>
{
    use allot_region_agent::grpc::proto::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::RateLimitRequest;
    let entry = |key: &str, value: String| Entry {
        key: key.to_owned(),
        value,
    };
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: "bench".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![
                entry("tenant", "atlas".to_owned()),
                entry("user", format!("U-{}", n % users)),
                entry("route_group", "read".to_owned()),
            ],
            hits_addend: None,
            is_negative_hits: false,
        }],
        hits_addend: 0,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {GATEWAY}").parse().expect("metadata"),
    );
    request
}

pub fn request(n: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("b-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: format!("U-{}", n % 1_000),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

/// The benchmarks' agent settings: region `eu`, a 5 ms allocator round trip.
pub fn settings() -> AgentSettings {
    AgentSettings {
        allocator_round_trip_ms: 5,
        ..AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("bench").expect("agent id"),
            Pepper::new(b"bench-pepper-0123456789".to_vec()).expect("pepper"),
        )
    }
}

/// An agent with `settings` over `store`, calling the allocator at `allocator`.
pub fn agent(
    store: Arc<dyn LimiterStore>,
    allocator: &str,
    with_regional: bool,
    settings: AgentSettings,
) -> Arc<Agent> {
    let limiter = Limiter::new(store, LimiterConfig::default()).expect("limiter");
    let client = AllocatorClient::new(vec![allocator.to_owned()], "agent-token-bench".to_owned())
        .expect("client");
    Agent::new(
        settings,
        Arc::new(SystemClock),
        limiter,
        Some(Arc::new(client)),
        Some(bundle(with_regional)),
    )
}

pub async fn start_agent(
    store: Arc<dyn LimiterStore>,
    allocator: &str,
    with_regional: bool,
) -> (String, AgentApi) {
    let agent = agent(store, allocator, with_regional, settings());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: None,
    };
    tokio::spawn(serve(listener, api.clone(), None, std::future::pending()));
    (url, api)
}

/// Clock ticks per second in `/proc`'s CPU times (USER_HZ on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// User + system clock ticks in a `/proc/.../stat` text (0 when it cannot be read).
fn stat_cpu_ticks(stat: &str) -> u64 {
    // Fields after the parenthesised command: state is field 3; utime 14, stime 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

/// Most bytes a bench reads of an admit's answer (a decision is a few hundred).
pub const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// This process's threads named `name`: their `/proc/self/task/<id>` directories.
pub fn threads_named(name: &str) -> Vec<std::path::PathBuf> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .map(|task| task.path())
        .filter(|task| {
            std::fs::read_to_string(task.join("comm")).is_ok_and(|comm| comm.trim() == name)
        })
        .collect()
}

/// CPU seconds (user + system) of this process's threads named `name`.
pub fn thread_cpu_seconds(name: &str) -> f64 {
    let ticks: u64 = threads_named(name)
        .iter()
        .map(|task| stat_cpu_ticks(&std::fs::read_to_string(task.join("stat")).unwrap_or_default()))
        .sum();
    ticks as f64 / TICKS_PER_SECOND
}

/// The whole machine's CPU ticks so far, busy and in all (`/proc/stat`'s first line: every core,
/// every process; idle and iowait are not busy), so that a run can say how busy the machine was.
pub fn machine_cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(all_cores) = stat.lines().next() else {
        return (0, 0);
    };
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let ticks: Vec<u64> = all_cores
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|field| field.parse().ok())
        .collect();
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Installs the agent binary's logging (the `info` level, as `region-agent` without `ALLOT_LOG`),
/// so that the agents (and the load generators' clients) here pay what deployed ones pay for it:
/// a callsite below the level (the HTTP/2 stack's trace spans) is disabled once, and costs nothing
/// after; with no subscriber at all, every such span was built and recorded. Written to stderr
/// with `ALLOT_BENCH_LOG` set, else dropped.
pub fn logging_as_deployed() {
    let subscriber =
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new("info"));
    if std::env::var_os("ALLOT_BENCH_LOG").is_some() {
        subscriber.with_writer(std::io::stderr).init();
    } else {
        subscriber.with_writer(std::io::sink).init();
    }
}

/// HTTP/2 connections an Envoy opens to the rate limit service: one per worker thread (its
/// connection pool per worker and upstream host opens a second only past the stream limit, which
/// is 2^31 by default), the calls of the worker's requests multiplexed over it. Four workers: a
/// 4-core Envoy.
pub const ENVOY_WORKERS: u64 = 4;

/// `callers` gRPC callers' channels to `url`, as an Envoy's workers hold them: at most
/// [`ENVOY_WORKERS`] connections, caller `i` on connection `i % ENVOY_WORKERS`.
pub async fn envoy_channels(url: &str, callers: u64) -> Vec<tonic::transport::Channel> {
    let mut channels = Vec::new();
    for _ in 0..callers.clamp(1, ENVOY_WORKERS) {
        let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned()).expect("a URL");
        channels.push(endpoint.connect().await.expect("connect"));
    }
    channels
}

/// The name of the threads the benchmarks run agents on, so that their CPU can be told apart
/// from the load generators'.
pub const AGENT_THREADS: &str = "agent-rt";

/// The runtime the benchmarks run agents on (one worker thread named [`AGENT_THREADS`]), and one
/// for the load generators.
pub fn agent_and_load_runtimes() -> (tokio::runtime::Runtime, tokio::runtime::Runtime) {
    let agents = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(AGENT_THREADS)
        .enable_all()
        .build()
        .expect("the agents' runtime");
    let load = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the load generators' runtime");
    (agents, load)
}

/// Redis's CPU seconds so far, user + system (`INFO cpu`).
pub async fn redis_cpu_seconds(connection: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(connection)
        .await
        .expect("INFO cpu");
    info.lines()
        .filter_map(|line| {
            line.strip_prefix("used_cpu_sys:")
                .or_else(|| line.strip_prefix("used_cpu_user:"))
        })
        .filter_map(|value| value.trim().parse::<f64>().ok())
        .sum()
}
