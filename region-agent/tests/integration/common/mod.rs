//! Shared test support: an agent on the in-process limiter store.

#![allow(dead_code)]

pub mod allocator;

use std::sync::Arc;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::Clock;
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::RegionId;
use allot_shared::keys::Pepper;
use allot_shared::policy::PolicyBundle;

/// The pepper every test agent keys principals with.
pub const PEPPER: &[u8] = b"region-agent-test-pepper";

/// A bundle from JSON text (version and checksum computed when absent).
pub fn bundle(json: &str) -> PolicyBundle {
    allot_shared::policy::parse_bundle(json)
        .and_then(|draft| draft.into_file_bundle())
        .expect("a valid bundle")
}

/// Settings of an `eu` agent whose bundle never ages.
pub fn settings() -> AgentSettings {
    AgentSettings::new(
        RegionId::parse("eu").expect("region"),
        allot_shared::ids::AgentId::parse("eu-test").expect("agent id"),
        Pepper::new(PEPPER.to_vec()).expect("pepper"),
    )
}

/// An agent on an in-process limiter store read on `clock`.
pub fn agent(
    settings: AgentSettings,
    clock: Arc<dyn Clock>,
    allocator: Option<Arc<AllocatorClient>>,
    bundle: Option<PolicyBundle>,
) -> Arc<Agent> {
    let store = Arc::new(InProcessStore::new(clock.clone(), 1_000));
    let limiter = Limiter::new(store, LimiterConfig::default()).expect("limiter");
    Agent::new(settings, clock, limiter, allocator, bundle)
}

/// An agent on `redis` (a real server the test started) with `config`, serving `bundle`; no
/// allocator.
pub async fn agent_on_redis(
    redis: &allot_testkit::RedisServer,
    config: LimiterConfig,
    bundle: &str,
) -> Arc<Agent> {
    use allot_region_agent::limiter::{RedisStore, RedisStoreConfig};
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default())
        .await
        .expect("redis");
    let limiter = Limiter::new(Arc::new(store), config).expect("limiter");
    Agent::new(
        settings(),
        Arc::new(allot_region_agent::clock::SystemClock),
        limiter,
        None,
        Some(self::bundle(bundle)),
    )
}

/// Serves `agent`'s gateway HTTP API on a loopback port to gateways holding `token`; its URL.
pub async fn serve_http(agent: Arc<Agent>, token: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let api = allot_region_agent::http::AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![token.to_owned()]),
        metrics: None,
    };
    tokio::spawn(allot_region_agent::http::serve(
        listener,
        api,
        None,
        std::future::pending(),
    ));
    url
}

/// Serves `agent`'s gRPC services (RLS and RLQS) on a loopback port to gateways holding `token`:
/// its address, and the sender that stops it (dropping it stops it too).
pub async fn serve_grpc(
    agent: Arc<Agent>,
    token: &str,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let api = allot_region_agent::http::AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![token.to_owned()]),
        metrics: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(allot_region_agent::grpc::serve_grpc(
        listener,
        api,
        None,
        async move {
            let _ = stopped.await;
        },
    ));
    (address, stop)
}

/// A GET request `id` by user `user` of tenant `atlas` on `route`, costing 1.
pub fn user_request(id: &str, user: &str, route: &str) -> allot_shared::contract::AdmissionRequest {
    use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
    use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
    AdmissionRequest {
        request_id: DecisionId::parse(id).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: user.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

/// A descriptor's entries, as Envoy sends them, from `(key, value)` pairs.
pub fn rls_entries(
    pairs: &[(&str, &str)],
) -> Vec<envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry> {
    pairs
        .iter()
        .map(|(key, value)| {
            envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            }
        })
        .collect()
}

/// Envoy's `ShouldRateLimit` call in domain `allot` for one descriptor of `entries`, its gateway
/// `token` as the bearer, as Envoy's filter sends it (no hits addend, no per-descriptor limit).
pub fn rls_call(
    token: &str,
    entries: Vec<
        envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry,
    >,
) -> tonic::Request<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let mut call = tonic::Request::new(RateLimitRequest {
        domain: "allot".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries,
            limit: None,
            hits_addend: None,
            is_negative_hits: false,
        }],
        hits_addend: 0,
    });
    call.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("header value"),
    );
    call
}
