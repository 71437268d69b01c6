//! Two regions sharing one global pool, end to end: a real allocator on a real etcd, two agents, each
//! with its own real Redis for its regional rules, gateways calling the agents' HTTP API.
//!
//! G = 1,000 per window, 3,000 attempts spread 90/10 over EU and US: the window never admits more
//! than G, the busy region gets most of the pool (no static split), and the ledger's window row
//! agrees with what the agents admitted.

use std::sync::Arc;

use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::ledger_sync::{CheckRotation, WINDOW_GAUGE_SETTLE_MS, publish_ledger_gauges};
use allot_region_agent::service::Agent;
use allot_testkit::{EtcdCluster, RedisServer};
use serde_json::{Value, json};

use crate::stack;

use crate::stack::{GATEWAY, OPERATOR, start_allocator};

fn bundle() -> allot_shared::policy::PolicyBundle {
    stack::bundle(&json!({ "rules": [
        { "id": "tenant-roomy", "scope": "tenant", "algorithm": "token_bucket",
          "capacityMillis": 100_000_000u64, "refillMillis": 1_000_000, "periodMs": 1000,
          "failMode": "closed" },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }
    ]}))
}

async fn start_agent(
    region: &str,
    allocator_url: &str,
    redis: &RedisServer,
) -> (Arc<Agent>, String) {
    stack::start_agent(region, allocator_url, redis, bundle()).await
}

fn request(n: usize, user: &str) -> Value {
    json!({ "requestId": format!("r-{n}"), "tenantId": "atlas",
            "principal": { "type": "user", "id": user }, "routeGroup": "read", "method": "GET" })
}

/// The longest retry hint of a denial while tokens are on their way, ms: the grant wait plus the
/// jitter every such hint carries.
const MOMENT_MS: u64 = allot_region_agent::service::AWAITING_GRANT_RETRY_MS
    + allot_region_agent::service::RETRY_JITTER_MAX_MS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_share_one_pool_without_overshoot() {
    let etcd = EtcdCluster::single();
    let (eu_redis, us_redis) = (RedisServer::start(), RedisServer::start());
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    // An hour-long window, so that the whole run is one window.
    let pool = json!({ "limit": 1000, "windowMs": 3_600_000, "chunk": 100, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 100, "regions": ["eu", "us"] });
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

    // 3,000 requests, 90% at EU, from 8 concurrent gateways. A denial whose hint is a moment (the
    // region's tokens are on their way: a burst beyond what it holds, on a loaded machine; the
    // grant wait plus up to a second of jitter) is retried after the hint, as a gateway would; one
    // until the window's end is final.
    let mut tasks = Vec::new();
    for gateway in 0..8usize {
        let (http, eu_url, us_url) = (http.clone(), eu_url.clone(), us_url.clone());
        tasks.push(tokio::spawn(async move {
            let (mut eu_admitted, mut us_admitted) = (0u64, 0u64);
            for i in 0..375usize {
                let n = gateway * 1_000 + i;
                let to_us = n % 10 == 0;
                let url = if to_us { &us_url } else { &eu_url };
                for attempt in 0..20usize {
                    let decision: Value = http
                        .post(format!("{url}/v1/admit"))
                        .bearer_auth(GATEWAY)
                        .json(&request(attempt * 100_000 + n, &format!("U-{}", n % 50)))
                        .send()
                        .await
                        .expect("admit")
                        .json()
                        .await
                        .expect("decision json");
                    if decision["allowed"] == true {
                        if to_us {
                            us_admitted += 1;
                        } else {
                            eu_admitted += 1;
                        }
                        break;
                    }
                    assert_eq!(decision["deniedScope"], "global", "{decision}");
                    assert_eq!(decision["policyVersion"], 1);
                    match decision["retryAfterMs"].as_u64() {
                        Some(hint_ms @ 0..=MOMENT_MS) => {
                            tokio::time::sleep(std::time::Duration::from_millis(hint_ms)).await;
                        }
                        _ => break,
                    }
                }
            }
            (eu_admitted, us_admitted)
        }));
    }
    let (mut eu_admitted, mut us_admitted) = (0, 0);
    for task in tasks {
        let (e, u) = task.await.expect("gateway");
        eu_admitted += e;
        us_admitted += u;
    }
    let admitted = eu_admitted + us_admitted;
    assert!(admitted <= 1_000, "admitted {admitted} > G");
    // What is not admitted sits in leases the regions still hold: at most a chunk per region.
    assert!(
        admitted >= 1_000 - 100 * 2,
        "the pool is used up but for what the leases hold: {admitted} (eu {eu_admitted}, us {us_admitted})"
    );
    assert!(us_admitted <= 300);
    assert!(
        eu_admitted >= 650,
        "the busy region gets most of the pool: eu {eu_admitted}, us {us_admitted}"
    );

    // The agents report; the ledger's window row agrees with what they admitted.
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
    assert_eq!(row["admitted"], admitted);
    assert!(
        row["granted"]
            .as_u64()
            .is_some_and(|g| g <= 1_000 && g >= admitted)
    );
    assert_eq!(row["overshoot"], 0);
    assert_eq!(
        row["grantedByRegion"]["eu"]
            .as_u64()
            .map(|g| g >= eu_admitted),
        Some(true)
    );

    // The agent's metrics count the decisions, and never name a principal.
    let metrics = http
        .get(format!("{eu_url}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("allot_agent_decisions_total{outcome=\"allowed\""),
        "{metrics}"
    );
    assert!(metrics.contains("allot_agent_renewals_total"), "{metrics}");
    assert!(
        metrics.contains("allot_agent_policy_version 1"),
        "{metrics}"
    );
    assert!(!metrics.contains("U-"), "no raw principal ids in metrics");
    // Store latency per shard, and the requests that found the region without a lease.
    assert!(
        metrics.contains("allot_agent_store_seconds_bucket{shard=\"0\""),
        "{metrics}"
    );
    // The coalescing counters are exported (agents coalesce by default; the value depends on
    // whether any decisions waited for a call, which this test does not arrange).
    assert!(
        metrics.contains("allot_agent_limiter_decisions{path=\"coalesced_calls\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            "allot_agent_lease_depletions_total{tenant=\"atlas\",pool=\"api\",pool_state=\"available\"}"
        ),
        "{metrics}"
    );

    // Once the window has settled, the allocator publishes the ledger's row as gauges for the
    // overshoot alert.
    let kv = EtcdKv::connect(&etcd.endpoints()).await.expect("etcd");
    let ledger = Ledger::connect(&format!(
        "sqlite://{}",
        dir.path().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    let window_end_ms = row["windowEndMs"].as_u64().expect("window end");
    let pools = allot_allocator::pools::list_pools(&kv)
        .await
        .expect("pools");
    let mut rotation = CheckRotation::default();
    publish_ledger_gauges(
        &ledger,
        &kv,
        &pools,
        &mut rotation,
        window_end_ms + WINDOW_GAUGE_SETTLE_MS,
    )
    .await
    .expect("gauges");
    let rendered = allot_allocator::metrics::handle()
        .expect("recorder")
        .render();
    for (name, value) in [
        ("allot_pool_window_admitted_tokens", admitted),
        ("allot_pool_window_bound_tokens", 1_000 + 2 * 100),
        ("allot_pool_window_overshoot_tokens", 0),
    ] {
        let line = format!("{name}{{tenant=\"atlas\",pool=\"api\"}} {value}");
        assert!(rendered.contains(&line), "no {line:?} in {rendered}");
    }
    assert!(
        rendered.contains("allot_policy_current_version 0"),
        "{rendered}"
    );
    // The same round checked the settled window against its bound, once: a second round adds
    // nothing, and nothing was over.
    let checked = ledger.bound_check_summary(10).await.expect("checks");
    assert!(checked.windows_checked >= 1, "{checked:?}");
    assert_eq!(checked.violations, 0, "{checked:?}");
    publish_ledger_gauges(
        &ledger,
        &kv,
        &pools,
        &mut rotation,
        window_end_ms + WINDOW_GAUGE_SETTLE_MS + 1,
    )
    .await
    .expect("gauges again");
    assert_eq!(
        ledger.bound_check_summary(10).await.expect("checks"),
        checked,
        "each window is checked once"
    );
    let rendered = allot_allocator::metrics::handle()
        .expect("recorder")
        .render();
    assert!(
        rendered.contains(&format!(
            "allot_bound_windows_checked_total {}",
            checked.windows_checked
        )),
        "{rendered}"
    );
    assert!(
        rendered.contains("allot_bound_violations_recorded 0"),
        "{rendered}"
    );
}

/// A denial anywhere debits nothing anywhere, as a gateway sees it: a pool of 50 and a per-user
/// bucket of 2. One user sending 60 requests is denied by their own bucket 58 times, and those
/// denials spend nothing of the tenant's pool: the next 20 users of the tenant are all admitted,
/// and the ledger's window says 22 admitted, not 60.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_flooding_past_their_bucket_leaves_the_pool_to_the_tenants_other_users() {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    // 50 an hour (one window for the whole run).
    let pool = json!({ "limit": 50, "windowMs": 3_600_000, "chunk": 10, "leaseTtlMs": 60_000,
                       "fallbackPerRegion": 0, "regions": ["eu"] });
    let put = http
        .put(format!("{allocator}/v1/pools/atlas/api"))
        .bearer_auth(OPERATOR)
        .json(&pool)
        .send()
        .await
        .expect("put pool");
    assert_eq!(put.status(), 200);
    stack::away_from_window_edges(3_600_000).await;
    let text = json!({ "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 2, "windowMs": 3_600_000, "failMode": "closed" },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }
    ]})
    .to_string();
    let bundle = allot_shared::policy::parse_bundle(&text)
        .and_then(|d| d.into_file_bundle())
        .expect("valid bundle");
    let (agent, url) = stack::start_agent("eu", &allocator, &redis, bundle).await;
    let admit = |n: usize, user: String| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let response = http
                .post(format!("{url}/v1/admit"))
                .bearer_auth(GATEWAY)
                .json(&request(n, &user))
                .send()
                .await
                .expect("admit");
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.expect("decision json"),
            )
        }
    };
    let mut flood_admitted = 0;
    for n in 0..60 {
        let (status, decision) = admit(n, "U-flood".to_owned()).await;
        if decision["allowed"] == true {
            flood_admitted += 1;
        } else {
            assert_eq!(status, 200, "/v1/admit answers the decision: {decision}");
            assert_eq!(decision["deniedScope"], "user", "{decision}");
        }
    }
    assert_eq!(flood_admitted, 2);
    for user in 0..20 {
        let (_, decision) = admit(100 + user, format!("U-{user}")).await;
        assert_eq!(
            decision["allowed"], true,
            "user {user} of the same tenant: {decision}"
        );
    }
    agent.send_reports().await;
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
    assert_eq!(row["spent"], 22, "{row}");
    assert_eq!(row["admitted"], 22, "{row}");
    // The agent's counters agree: 22 allowed, 58 denied by the user's rule.
    let metrics = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let allowed: f64 = metrics
        .lines()
        .filter(|line| line.starts_with("allot_agent_decisions_total{outcome=\"allowed\""))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(allowed, 22.0, "{metrics}");
}
