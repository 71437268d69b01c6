//! The in-process stack the end-to-end tests share: a real allocator (on a real etcd, with a SQLite
//! ledger) served on a loopback port, and region agents on their own real Redis serving the gateway
//! HTTP API, all in the test's process. Tests that need processes, faults between them or TLS use
//! `topology/` instead.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::http::{AgentApi, serve};
use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::RegionId;
use allot_shared::keys::Pepper;
use allot_shared::policy::PolicyBundle;
use allot_testkit::{EtcdCluster, RedisServer};
use serde_json::Value;

/// The operators' token.
pub const OPERATOR: &str = "operator-token-for-e2e-0001";
/// The agents' token.
pub const AGENT: &str = "agent-token-for-e2e-000001";
/// The gateways' token.
pub const GATEWAY: &str = "gateway-token-for-e2e-0001";
/// The agents' pepper, which the allocator holds too (to hash the principals overrides name).
pub const PEPPER: &[u8] = b"e2e-pepper-0123456789";

/// An HTTP client with a deadline.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client")
}

/// A bundle from JSON (version and checksum computed).
pub fn bundle(rules: &Value) -> PolicyBundle {
    allot_shared::policy::parse_bundle(&rules.to_string())
        .and_then(|draft| draft.into_file_bundle())
        .expect("valid bundle")
}

/// Starts an allocator on `etcd` with its ledger in `dir`; its URL once it is ready.
pub async fn start_allocator(etcd: &EtcdCluster, dir: &std::path::Path) -> String {
    let ledger_url = format!("sqlite://{}", dir.join("ledger.db").display());
    start_allocator_with_ledger(etcd, &ledger_url).await
}

/// Starts an allocator on `etcd` with its ledger at `ledger_url` (SQLite or PostgreSQL); its URL
/// once it is ready.
pub async fn start_allocator_with_ledger(etcd: &EtcdCluster, ledger_url: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let tokens = Tokens {
        operator: vec![OPERATOR.to_owned()],
        agent: vec![AGENT.to_owned()],
    };
    let settings = Settings {
        etcd: etcd.endpoints(),
        pepper: Some(Pepper::new(PEPPER.to_vec()).expect("pepper")),
        ledger_url: ledger_url.to_owned(),
        ..Settings::local(addr, tokens, "alloc-1")
    };
    let kv = Arc::new(EtcdKv::connect(&settings.etcd).await.expect("etcd"));
    let ledger = Ledger::connect(&settings.ledger_url).await.expect("ledger");
    let clock = allot_allocator::server::system_clock();
    tokio::spawn(run(
        settings,
        kv,
        ledger,
        clock,
        listener,
        std::future::pending(),
    ));
    let url = format!("http://{addr}");
    let client = http();
    for _ in 0..200 {
        if let Ok(r) = client.get(format!("{url}/readyz")).send().await
            && r.status() == 200
        {
            return url;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the allocator never became ready");
}

/// Configures `tenant`/`pool` on the allocator at `url` (the pool's JSON spec); a pool with a
/// fixed window then waits [`away_from_window_edges`].
pub async fn put_pool(url: &str, tenant: &str, pool: &str, spec: &Value) {
    let put = http()
        .put(format!("{url}/v1/pools/{tenant}/{pool}"))
        .bearer_auth(OPERATOR)
        .json(spec)
        .send()
        .await
        .expect("put pool");
    assert_eq!(
        put.status(),
        200,
        "{}",
        put.text().await.unwrap_or_default()
    );
    if let Some(window_ms) = spec["windowMs"].as_u64() {
        away_from_window_edges(window_ms).await;
    }
}

/// Waits, when the current fixed window of `window_ms` (on the wall clock these tests run on) is
/// about to end, until the next has begun, and past the first second of a window: a test that
/// reads one window's figures, or spends one window's fallback allowance, must not straddle two,
/// whatever time of day it runs. Waits at most a quarter of the window, and never over a minute.
pub async fn away_from_window_edges(window_ms: u64) {
    use allot_region_agent::clock::Clock;
    let margin_ms = (window_ms / 4).min(60_000);
    let into_ms = SystemClock.now_ms() % window_ms.max(1);
    let left_ms = window_ms - into_ms;
    let wait_ms = if left_ms < margin_ms {
        left_ms + 1_000
    } else {
        1_000u64.saturating_sub(into_ms)
    };
    tokio::time::sleep(Duration::from_millis(wait_ms)).await;
}

/// The ledger's latest `last` windows of `tenant`/`pool`, newest first.
pub async fn windows(url: &str, tenant: &str, pool: &str, last: u64) -> Vec<Value> {
    let answer: Value = http()
        .get(format!(
            "{url}/v1/pools/{tenant}/{pool}/windows?last={last}"
        ))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("windows")
        .json()
        .await
        .expect("json");
    answer["windows"].as_array().cloned().unwrap_or_default()
}

/// An agent for `region` on `redis`, reaching the allocator at `allocator_url`, running `bundle`.
pub async fn agent(
    region: &str,
    allocator_url: &str,
    redis: &RedisServer,
    bundle: PolicyBundle,
) -> Arc<Agent> {
    // The regional rules are incidental here: a generous call deadline and decision budget keep a
    // CPU-starved CI machine from turning a slow Redis reply into LIMITER_UNAVAILABLE (deadlines
    // have their own tests).
    let store_config = RedisStoreConfig {
        call_timeout: Duration::from_secs(2),
        ..RedisStoreConfig::default()
    };
    let config = LimiterConfig {
        decision_budget: Duration::from_secs(2),
        acquire_wait: Duration::from_secs(1),
        ..LimiterConfig::default()
    };
    agent_with(region, allocator_url, redis, bundle, store_config, config).await
}

/// [`agent`] with the given store and limiter settings (the shipped defaults, say).
pub async fn agent_with(
    region: &str,
    allocator_url: &str,
    redis: &RedisServer,
    bundle: PolicyBundle,
    store_config: RedisStoreConfig,
    config: LimiterConfig,
) -> Arc<Agent> {
    let store = RedisStore::connect(&redis.url(), store_config)
        .await
        .expect("redis");
    let limiter = Limiter::new(Arc::new(store), config).expect("limiter");
    let client =
        AllocatorClient::new(vec![allocator_url.to_owned()], AGENT.to_owned()).expect("client");
    let settings = AgentSettings::new(
        RegionId::parse(region).expect("region"),
        allot_shared::ids::AgentId::parse(&format!("{region}-1")).expect("agent id"),
        Pepper::new(PEPPER.to_vec()).expect("pepper"),
    );
    Agent::new(
        settings,
        Arc::new(SystemClock),
        limiter,
        Some(Arc::new(client)),
        Some(bundle),
    )
}

/// What the agent's listeners serve: `agent`, for gateways holding [`GATEWAY`].
pub fn api(agent: Arc<Agent>) -> AgentApi {
    AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: allot_allocator::metrics::handle(),
    }
}

/// A loopback listener and its `http://` URL.
pub async fn listener() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    (listener, url)
}

/// [`agent`], serving the gateway HTTP API: the agent and the API's URL.
pub async fn start_agent(
    region: &str,
    allocator_url: &str,
    redis: &RedisServer,
    bundle: PolicyBundle,
) -> (Arc<Agent>, String) {
    let agent = agent(region, allocator_url, redis, bundle).await;
    let url = serve_agent(agent.clone()).await;
    (agent, url)
}

/// Serves the gateway HTTP API of `agent` on a loopback port; its URL.
pub async fn serve_agent(agent: Arc<Agent>) -> String {
    let (listener, url) = listener().await;
    tokio::spawn(serve(listener, api(agent), None, std::future::pending()));
    url
}
