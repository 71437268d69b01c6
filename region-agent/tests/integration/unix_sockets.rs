//! Gateways on the agent's host reach it over Unix domain sockets (`--listen unix:/path`,
//! `--grpc-listen unix:/path`): the HTTP API and Envoy's rate limit service answer there as they do
//! over TCP, from the same buckets, and the socket files go when the agent stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allot_net::{ListenAddr, Listener};
use allot_region_agent::clock::SystemClock;
use allot_region_agent::http::AgentApi;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::UnixStream;

use crate::common;

const GATEWAY: &str = "gateway-token-unix-0001";

/// `POST /v1/admit` for `user` over the HTTP socket at `path`, as a gateway on the host sends it.
async fn admit_over_socket(path: &Path, user: &str, n: usize) -> Value {
    let stream = UnixStream::connect(path).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let body = json!({ "requestId": format!("{user}-{n}"), "tenantId": "atlas",
                       "principal": { "type": "user", "id": user }, "routeGroup": "read",
                       "method": "GET" });
    let request = hyper::Request::post("/v1/admit")
        .header("host", "agent")
        .header("authorization", format!("Bearer {GATEWAY}"))
        .header("content-type", "application/json")
        .body(Full::new(hyper::body::Bytes::from(body.to_string())))
        .expect("request");
    let answer = sender.send_request(request).await.expect("answered");
    let bytes = answer.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).expect("json")
}

/// Envoy's RLS call for `user`, over the gRPC socket at `path`: whether it is over the limit.
async fn over_limit_over_socket(path: PathBuf, user: &str) -> bool {
    // The URI is only a name: the connector below dials the socket.
    let channel = tonic::transport::Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .expect("channel");
    let mut client = RateLimitServiceClient::new(channel);
    let call = common::rls_call(
        GATEWAY,
        common::rls_entries(&[("tenant", "atlas"), ("user", user), ("route_group", "read")]),
    );
    let answer = client
        .should_rate_limit(call)
        .await
        .expect("answered")
        .into_inner();
    answer.overall_code == Code::OverLimit as i32
}

#[tokio::test]
async fn gateways_decide_over_unix_sockets_from_the_same_buckets() {
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(
            &json!({ "rules": [
                { "id": "per-user", "scope": "user", "principalType": "user",
                  "algorithm": "token_bucket", "capacityMillis": 3000, "refillMillis": 1000,
                  "periodMs": 60000, "failMode": "closed" }
            ]})
            .to_string(),
        )),
    );
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: None,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let http_path = dir.path().join("agent.sock");
    let grpc_path = dir.path().join("agent-grpc.sock");
    let http = Listener::bind(
        &format!("unix:{}", http_path.display())
            .parse::<ListenAddr>()
            .expect("address"),
    )
    .await
    .expect("bind the HTTP socket");
    let grpc = Listener::bind(&ListenAddr::Unix(grpc_path.clone()))
        .await
        .expect("bind the gRPC socket");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let http_task = tokio::spawn(allot_region_agent::http::serve(
        http,
        api.clone(),
        None,
        until(stopped.clone()),
    ));
    let grpc_task = tokio::spawn(allot_region_agent::grpc::serve_grpc(
        grpc,
        api,
        None,
        until(stopped),
    ));
    // Three a minute per user: the HTTP socket admits three, the fourth is denied.
    for n in 0..4 {
        let decision = admit_over_socket(&http_path, "U-7", n).await;
        assert_eq!(decision["allowed"], n < 3, "request {n}: {decision}");
    }
    // Envoy on the gRPC socket sees the same buckets: U-7 is spent, U-8 is not.
    assert!(over_limit_over_socket(grpc_path.clone(), "U-7").await);
    assert!(!over_limit_over_socket(grpc_path.clone(), "U-8").await);
    // Stopped, the agent leaves no socket files behind.
    let _ = stop.send(true);
    http_task.await.expect("joined").expect("served");
    grpc_task.await.expect("joined").expect("served");
    assert!(!http_path.exists() && !grpc_path.exists());
}

/// The agent reaches its Redis on the same host over a Unix socket (`redis+unix:///path`): the
/// rule is decided by the store there, two admitted and the third denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limiter_store_is_reached_over_a_unix_socket() {
    use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
    let redis = allot_testkit::RedisServer::start_unix();
    let store = RedisStore::connect(&redis.unix_url(), RedisStoreConfig::default())
        .await
        .expect("connects over the Unix socket");
    let limiter = Limiter::new(Arc::new(store), LimiterConfig::default()).expect("limiter");
    let agent = allot_region_agent::service::Agent::new(
        common::settings(),
        Arc::new(SystemClock),
        limiter,
        None,
        Some(common::bundle(
            r#"{ "rules": [
                { "id": "user-read", "scope": "user", "routeGroup": "read",
                  "algorithm": "fixed_window", "limit": 2, "windowMs": 3600000,
                  "failMode": "closed" } ] }"#,
        )),
    );
    let mut allowed = Vec::new();
    for n in 0..3 {
        let decision = agent
            .admit(&common::user_request(&format!("u-{n}"), "U-1", "read"))
            .await
            .expect("decision");
        assert!(!decision.fallback, "decided by the store: {decision:?}");
        allowed.push(decision.allowed);
    }
    assert_eq!(allowed, [true, true, false]);
    // The counts are in that server (read over its TCP port).
    let client = redis::Client::open(redis.url()).expect("client");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let keys: u64 = redis::cmd("DBSIZE")
        .query_async(&mut connection)
        .await
        .expect("dbsize");
    assert!(
        keys > 0,
        "the rule's state is in the server behind the socket"
    );
}
