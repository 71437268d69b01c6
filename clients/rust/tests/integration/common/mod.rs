//! What the tests against a real agent share: the agent itself, on a real Redis, with one bundle.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::{AgentId, RegionId};
use allot_shared::keys::Pepper;
use allot_testkit::RedisServer;
use serde_json::json;

pub const GATEWAY: &str = "gateway-token-for-client-01";

/// `read`: 2 a minute per user. `export`: one at a time per user. `summarize`: a bucket of 100
/// units per user that refills in an hour. `orders`: 10 an hour per user, idempotent by request id.
pub fn bundle() -> allot_shared::policy::PolicyBundle {
    let text = json!({ "rules": [
        { "id": "reads", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 2, "windowMs": 60_000, "failMode": "closed" },
        { "id": "exports", "scope": "user", "routeGroup": "export", "algorithm": "token_bucket",
          "capacityMillis": 1_000_000, "refillMillis": 1_000_000, "periodMs": 1000,
          "concurrencyMax": 1, "concurrencyLeaseTtlMs": 60_000, "failMode": "closed" },
        { "id": "summaries", "scope": "user", "routeGroup": "summarize", "algorithm": "token_bucket",
          "capacityMillis": 100_000, "refillMillis": 100_000, "periodMs": 3_600_000,
          "failMode": "closed" },
        { "id": "orders", "scope": "user", "routeGroup": "orders", "algorithm": "token_bucket",
          "capacityMillis": 10_000, "refillMillis": 10_000, "periodMs": 3_600_000,
          "failMode": "closed", "idempotent": true }
    ]})
    .to_string();
    allot_shared::policy::parse_bundle(&text)
        .and_then(|draft| draft.into_file_bundle())
        .expect("valid bundle")
}

/// A real agent on `redis`, serving its gateway API on a loopback port: its URL.
pub async fn start_agent(redis: &RedisServer) -> String {
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default())
        .await
        .expect("redis");
    let limiter = Limiter::new(Arc::new(store), LimiterConfig::default()).expect("limiter");
    let settings = AgentSettings::new(
        RegionId::parse("eu").expect("region"),
        AgentId::parse("eu-client-test").expect("agent id"),
        Pepper::new(b"client-test-pepper-0001".to_vec()).expect("pepper"),
    );
    let agent = Agent::new(
        settings,
        Arc::new(SystemClock),
        limiter,
        None,
        Some(bundle()),
    );
    let api = allot_region_agent::http::AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: allot_region_agent::metrics::install(),
    };
    let (listener, url) = listener().await;
    tokio::spawn(allot_region_agent::http::serve(
        listener,
        api,
        None,
        std::future::pending(),
    ));
    url
}

pub async fn listener() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    (listener, url)
}
