//! Envoy's rate limit quota service end to end: a real allocator on a real etcd, two regions, each
//! with its own real Redis and agent serving RLQS; several gateways per region decide every request
//! themselves against the assignments their agent pushes, under load skewed 90/10 over EU and US.
//!
//! The window never admits more than G, the ledger's spent is exactly what the gateways counted
//! admitted, and the busy region gets most of the pool.

use std::sync::Arc;
use std::time::Duration;

use allot_region_agent::clock::{Clock, SystemClock};
use allot_region_agent::grpc::serve_grpc;
use allot_region_agent::rlqs::gateway::{Gateway, NoAssignment};
use allot_region_agent::rlqs::proto::envoy::service::rate_limit_quota::v3::BucketId;
use allot_region_agent::service::Agent;
use allot_testkit::{EtcdCluster, RedisServer};
use serde_json::{Value, json};

use crate::stack;

use crate::stack::{GATEWAY, OPERATOR, start_allocator};

/// G: tokens per (hour-long) window.
const LIMIT: u64 = 600;

fn bundle() -> allot_shared::policy::PolicyBundle {
    let text = json!({ "rules": [
        { "id": "tenant-roomy", "scope": "tenant", "algorithm": "token_bucket",
          "capacityMillis": 100_000_000u64, "refillMillis": 1_000_000, "periodMs": 1000,
          "failMode": "closed" },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }
    ]})
    .to_string();
    allot_shared::policy::parse_bundle(&text)
        .and_then(|d| d.into_file_bundle())
        .expect("valid bundle")
}

/// An agent of `region` serving RLQS; returns it and its gRPC address.
async fn start_agent(
    region: &str,
    allocator_url: &str,
    redis: &RedisServer,
) -> (Arc<Agent>, String) {
    let agent = stack::agent(region, allocator_url, redis, bundle()).await;
    let (listener, url) = stack::listener().await;
    let api = stack::api(agent.clone());
    tokio::spawn(serve_grpc(listener, api, None, std::future::pending()));
    (agent, url)
}

fn bucket(user: &str) -> BucketId {
    BucketId {
        bucket: [("tenant", "atlas"), ("user", user), ("route_group", "read")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    }
}

/// One gateway: `per_second` requests a second spread over `users` buckets, for `for_ms`, reporting
/// every 500 ms. Returns what it admitted (its own count).
async fn gateway(agent_url: String, users: Vec<String>, per_second: u64, for_ms: u64) -> u64 {
    let clock = SystemClock;
    let channel = tonic::transport::Channel::from_shared(agent_url)
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut gateway = Gateway::connect(
        channel,
        GATEWAY,
        "envoy",
        NoAssignment::Deny,
        Arc::new(SystemClock),
    )
    .await
    .expect("stream");
    let ids: Vec<BucketId> = users.iter().map(|user| bucket(user)).collect();
    let start_ms = clock.now_ms();
    let (mut last_report_ms, mut owed, mut next) = (0, 0u64, 0usize);
    while clock.now_ms() < start_ms + for_ms {
        owed += per_second * 20;
        while owed >= 1_000 {
            owed -= 1_000;
            gateway.decide(&ids[next % ids.len()]);
            next += 1;
        }
        if clock.now_ms() >= last_report_ms + 500 {
            gateway.report().await.expect("report");
            last_report_ms = clock.now_ms();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.report().await.expect("final report");
    // The agent takes the last report before the stream closes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ids.iter().map(|id| gateway.counts(id).allowed).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_enforcing_assignments_in_two_regions_stay_within_the_pool() {
    let etcd = EtcdCluster::single();
    let (eu_redis, us_redis) = (RedisServer::start(), RedisServer::start());
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client");
    let pool = json!({ "limit": LIMIT, "windowMs": 3_600_000, "chunk": 100, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 50, "regions": ["eu", "us"] });
    let put = http
        .put(format!("{allocator}/v1/pools/atlas/api"))
        .bearer_auth(OPERATOR)
        .json(&pool)
        .send()
        .await
        .expect("put pool");
    assert_eq!(put.status(), 200);
    stack::away_from_window_edges(3_600_000).await;
    let (eu, eu_url) = start_agent("eu", &allocator, &eu_redis).await;
    let (us, us_url) = start_agent("us", &allocator, &us_redis).await;

    // Three EU gateways at 100/s each, one US gateway at 30/s, for 4 s: about 1,300 requests for a
    // pool of 600.
    let run_ms = 4_000;
    let users = |prefix: &str| -> Vec<String> { (0..5).map(|n| format!("{prefix}-{n}")).collect() };
    let mut eu_gateways = Vec::new();
    for n in 0..3 {
        eu_gateways.push(tokio::spawn(gateway(
            eu_url.clone(),
            users(&format!("eu{n}")),
            100,
            run_ms,
        )));
    }
    let us_gateway = tokio::spawn(gateway(us_url.clone(), users("us"), 30, run_ms));
    let mut eu_admitted = 0;
    for task in eu_gateways {
        eu_admitted += task.await.expect("eu gateway");
    }
    let us_admitted = us_gateway.await.expect("us gateway");
    let admitted = eu_admitted + us_admitted;
    assert!(admitted <= LIMIT, "admitted {admitted} > G = {LIMIT}");
    assert!(
        eu_admitted >= 2 * us_admitted,
        "the busy region gets most: eu {eu_admitted}, us {us_admitted}"
    );
    assert!(
        admitted >= LIMIT / 3,
        "gateways are served: eu {eu_admitted}, us {us_admitted}"
    );

    // The agents report; the ledger's window agrees with what the gateways counted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    eu.send_reports().await;
    us.send_reports().await;
    let windows: Value = http
        .get(format!("{allocator}/v1/pools/atlas/api/windows?last=1"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("windows")
        .json()
        .await
        .expect("json");
    let row = &windows["windows"][0];
    assert_eq!(row["spent"], admitted, "{row}");
    assert_eq!(row["admitted"], admitted, "{row}");
    assert_eq!(row["overshoot"], 0, "{row}");
    assert!(row["granted"].as_u64().is_some_and(|g| g <= LIMIT), "{row}");
}
