//! A store split into shards, served by two allocators: an agent's client that knows only one of
//! them still has every pool granted and reported by its shard's leader. Grants and give-backs
//! are only the shard leader's to make, so each proves where its call went.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::shards::{ShardCount, shard_of};
use allot_shared::wire::{GrantBatch, GrantBody, Report, ReportBatch, ShardMap};
use allot_testkit::EtcdCluster;
use serde_json::json;

use crate::stack::{self, AGENT, OPERATOR};

/// An allocator of a store split into 4 shards, serving until `stop` is sent.
async fn start_allocator(
    etcd: &[String],
    ledger_url: &str,
    node: &str,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let settings = Settings {
        etcd: etcd.to_vec(),
        leader_lease_ttl_s: 2,
        shards: Some(ShardCount::new(4).expect("count")),
        ledger_url: ledger_url.to_owned(),
        ..Settings::local(
            addr,
            Tokens {
                operator: vec![OPERATOR.to_owned()],
                agent: vec![AGENT.to_owned()],
            },
            node,
        )
    };
    let kv = Arc::new(EtcdKv::connect(etcd).await.expect("etcd"));
    let ledger = Ledger::connect(ledger_url).await.expect("ledger");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(run(
        settings,
        kv,
        ledger,
        allot_allocator::server::system_clock(),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    (format!("http://{addr}"), stop)
}

/// The shard map as `url` answers it, once every shard has a leader and `done` holds of it.
async fn settled_map(url: &str, done: impl Fn(&ShardMap) -> bool) -> ShardMap {
    let client = reqwest::Client::new();
    for _ in 0..400 {
        if let Ok(response) = client
            .get(format!("{url}/v1/shards"))
            .bearer_auth(AGENT)
            .send()
            .await
            && let Ok(map) = response.json::<ShardMap>().await
            && map.shards.iter().all(|s| s.leader.is_some())
            && done(&map)
        {
            return map;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the shards never settled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_one_allocator_reaches_every_shards_leader() {
    let etcd = EtcdCluster::single();
    let endpoints = etcd.endpoints();
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger_url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let (url_a, _stop_a) = start_allocator(&endpoints, &ledger_url, "alloc-a").await;
    settled_map(&url_a, |_| true).await;
    let (url_b, _stop_b) = start_allocator(&endpoints, &ledger_url, "alloc-b").await;
    let led_by = |map: &ShardMap, node: &str| map.led_by().get(node).copied().unwrap_or(0);
    let map = settled_map(&url_a, |m| {
        led_by(m, "alloc-a") == 2 && led_by(m, "alloc-b") == 2
    })
    .await;

    // Two tenants in shards `a` leads, two in shards `b` leads, each with an hour-long pool.
    let count = ShardCount::new(map.shard_count).expect("count");
    let api = PoolId::parse("api").expect("pool");
    let leader_of = |tenant: &TenantId| {
        let shard = shard_of(tenant, &api, count);
        map.shards[shard.0 as usize]
            .leader
            .as_ref()
            .map(|l| l.node_id.clone())
    };
    let tenants: Vec<TenantId> = (0..64)
        .map(|n| TenantId::parse(&format!("t{n:02}")).expect("tenant"))
        .collect();
    let mut chosen: Vec<TenantId> = Vec::new();
    for node in ["alloc-a", "alloc-b"] {
        chosen.extend(
            tenants
                .iter()
                .filter(|t| leader_of(t).as_deref() == Some(node))
                .take(2)
                .cloned(),
        );
    }
    assert_eq!(chosen.len(), 4);
    let pool = json!({ "limit": 1000, "windowMs": 3_600_000, "chunk": 10, "leaseTtlMs": 60_000,
                       "fallbackPerRegion": 0, "regions": ["eu", "us"] });
    for tenant in &chosen {
        stack::put_pool(&url_a, tenant.as_str(), "api", &pool).await;
    }

    // The client knows `a` only. A batch of renewals across all four pools: each granted, the
    // ones in b's shards by b (which `a` would refuse, naming b).
    let client = AllocatorClient::new(vec![url_a.clone()], AGENT.to_owned()).expect("client");
    let region = RegionId::parse("eu").expect("region");
    let asks: Vec<GrantBody> = chosen
        .iter()
        .enumerate()
        .map(|(n, tenant)| GrantBody {
            lease_id: LeaseId::from_parts(7, n as u128),
            tenant: tenant.clone(),
            pool: api.clone(),
            region: region.clone(),
            want_tokens: 10,
        })
        .collect();
    let outcomes = client
        .grant_batch(&GrantBatch {
            grants: asks.clone(),
        })
        .await
        .expect("the batch is answered");
    let grants: Vec<_> = outcomes
        .into_iter()
        .map(|o| o.expect("granted").expect("the pool exists"))
        .collect();
    for (grant, tenant) in grants.iter().zip(&chosen) {
        assert_eq!(grant.granted_tokens, 10, "{tenant}");
        let shard = shard_of(tenant, &api, count);
        let leader = map.shards[shard.0 as usize].leader.as_ref().expect("led");
        assert_eq!(
            grant.epoch, leader.epoch,
            "{tenant} granted by its shard's leader"
        );
    }

    // Asked of `a` directly, a pool in b's shards is refused, naming b.
    let refused = reqwest::Client::new()
        .post(format!("{url_a}/v1/grants"))
        .bearer_auth(AGENT)
        .json(
            &json!({ "leaseId": LeaseId::from_parts(7, 99), "tenant": chosen[2], "pool": "api",
                       "region": "eu", "want": 1 }),
        )
        .send()
        .await
        .expect("a answers");
    assert_eq!(refused.status(), 503);
    let problem: serde_json::Value = refused.json().await.expect("problem");
    assert_eq!(problem["leader"], json!(url_b));

    // A final report for each lease, giving back 6 of its 10 tokens: taken back, which only the
    // shard's leader can do (another answers 0).
    let reports: Vec<Report> = asks
        .iter()
        .zip(&grants)
        .enumerate()
        .map(|(n, (ask, grant))| {
            serde_json::from_value(json!({
                "reportId": format!("r-{n}"), "region": "eu", "tenant": ask.tenant,
                "pool": "api", "windowStartMs": grant.window_start_ms,
                "leases": [{ "leaseId": ask.lease_id, "spent": 4, "final": true, "unspent": 6 }],
                "fallbackAdmitted": 0,
            }))
            .expect("report")
        })
        .collect();
    let results = client
        .report_batch(&ReportBatch { reports })
        .await
        .expect("the reports are answered");
    for (result, tenant) in results.iter().zip(&chosen) {
        let receipt = result.receipt.as_ref().expect("taken");
        assert_eq!(receipt.returned_tokens, 6, "{tenant}: {result:?}");
    }
}
