//! Two real allocator processes on a real 3-member etcd cluster, under load: the leader is killed
//! (SIGKILL, no goodbye), the follower takes over with a higher epoch, and no grant is lost or
//! duplicated. Then an etcd member dies too, and grants carry on once the cluster has a quorum.
//! And a sharded store: two allocators split its shards, each grants only its shards' pools, and
//! one killed leaves its shards to the other.

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_allocator::pools::GrantRecord;
use allot_shared::ids::LeaseId;
use allot_shared::wire::GrantAnswer;
use allot_testkit::EtcdCluster;
use serde_json::json;

const OPERATOR_TOKEN: &str = "operator-token-for-tests-0001";
const AGENT_TOKEN: &str = "agent-token-for-tests-000001";

struct Allocator {
    child: Child,
    url: String,
}

impl Drop for Allocator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn start_allocator(dir: &std::path::Path, name: &str, etcd: &[String]) -> Allocator {
    start_allocator_with_ttl(dir, name, etcd, 2)
}

fn start_allocator_with_ttl(
    dir: &std::path::Path,
    name: &str,
    etcd: &[String],
    lease_ttl_s: u32,
) -> Allocator {
    start_allocator_with(dir, name, etcd, lease_ttl_s, &[])
}

fn start_allocator_with(
    dir: &std::path::Path,
    name: &str,
    etcd: &[String],
    lease_ttl_s: u32,
    extra_args: &[&str],
) -> Allocator {
    let port = free_port();
    let operator = dir.join("operator.tokens");
    let agent = dir.join("agent.tokens");
    std::fs::write(&operator, OPERATOR_TOKEN).expect("token file");
    std::fs::write(&agent, AGENT_TOKEN).expect("token file");
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log");
    let child = Command::new(env!("CARGO_BIN_EXE_allocator"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--etcd", &etcd.join(",")])
        .args(["--node-id", name])
        .args(["--leader-lease-ttl-s", &lease_ttl_s.to_string()])
        .arg("--data-dir")
        .arg(dir.join(name))
        .arg("--operator-token-file")
        .arg(&operator)
        .arg("--agent-token-file")
        .arg(&agent)
        .args(extra_args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("the allocator binary starts");
    Allocator {
        child,
        url: format!("http://127.0.0.1:{port}"),
    }
}

async fn ready_text(client: &reqwest::Client, url: &str) -> Option<String> {
    let response = client.get(format!("{url}/readyz")).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    for _ in 0..300 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Sends one grant, trying each allocator until one answers; `None` when none did (yet).
async fn grant_once(
    client: &reqwest::Client,
    urls: &[String],
    lease: LeaseId,
    want: u64,
) -> Option<GrantAnswer> {
    for url in urls {
        let Ok(response) = client
            .post(format!("{url}/v1/grants"))
            .bearer_auth(AGENT_TOKEN)
            .json(&json!({ "leaseId": lease, "tenant": "atlas", "pool": "api", "region": "eu", "want": want }))
            .send()
            .await
        else {
            continue;
        };
        if response.status().is_success() {
            return response.json().await.ok();
        }
    }
    None
}

/// A client gives up on one lease after this many tries, 20 ms apart (far beyond a failover).
const MAX_GRANT_TRIES: u32 = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_takes_over_without_losing_or_duplicating_grants() {
    let mut etcd = EtcdCluster::start(3);
    let endpoints = etcd.endpoints();
    let dir = tempfile::tempdir().expect("temp dir");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");

    let a = start_allocator(dir.path(), "alloc-a", &endpoints);
    wait_until("a leads", async || {
        ready_text(&client, &a.url)
            .await
            .is_some_and(|t| t.starts_with("leader"))
    })
    .await;
    let b = start_allocator(dir.path(), "alloc-b", &endpoints);
    wait_until("b follows a", async || {
        ready_text(&client, &b.url)
            .await
            .is_some_and(|t| t.starts_with("follower"))
    })
    .await;

    // A follower answers grants with 503 naming the leader.
    let refused = client
        .post(format!("{}/v1/grants", b.url))
        .bearer_auth(AGENT_TOKEN)
        .json(&json!({ "leaseId": LeaseId::from_parts(1, 1), "tenant": "atlas", "pool": "api", "region": "eu", "want": 1 }))
        .send()
        .await
        .expect("b answers");
    assert_eq!(refused.status(), 503);
    let problem: serde_json::Value = refused.json().await.expect("problem json");
    assert_eq!(problem["leader"], json!(a.url));

    let pool = json!({ "limit": 100000, "windowMs": 60000, "chunk": 10, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 0, "regions": ["eu", "us"] });
    let put = client
        .put(format!("{}/v1/pools/atlas/api", a.url))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&pool)
        .send()
        .await
        .expect("put pool");
    assert_eq!(put.status(), 200);

    // Load: 8 clients, each retrying its current lease id until some allocator answers it.
    let urls = vec![a.url.clone(), b.url.clone()];
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..8u64 {
        let (client, urls, stop, answered) =
            (client.clone(), urls.clone(), stop.clone(), answered.clone());
        clients.push(tokio::spawn(async move {
            let mut answers: Vec<(LeaseId, GrantAnswer, u32)> = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let lease = LeaseId::from_parts(c + 1, u128::from(c * 1_000_000 + n));
                let mut tries = 0;
                let record = loop {
                    tries += 1;
                    assert!(
                        tries <= MAX_GRANT_TRIES,
                        "no allocator answered a grant in {MAX_GRANT_TRIES} tries"
                    );
                    if let Some(record) = grant_once(&client, &urls, lease, 1 + n % 10).await {
                        break record;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                };
                // Ask once more: the same answer, never a second grant.
                let again = grant_once(&client, &urls, lease, 10).await;
                if let Some(again) = again {
                    // The stored grant; only the answer's own instant may be later, and the
                    // terms' version says what the answering worker holds, not the grant.
                    assert!(again.answered_at_ms >= record.answered_at_ms);
                    let again = GrantAnswer {
                        answered_at_ms: record.answered_at_ms,
                        terms_version: record.terms_version,
                        ..again
                    };
                    assert_eq!(again, record, "a retry returns the stored answer");
                }
                answers.push((lease, record, tries));
                answered.fetch_add(1, Ordering::SeqCst);
                n += 1;
            }
            answers
        }));
    }

    wait_until("grants flow", async || {
        answered.load(Ordering::SeqCst) >= 80
    })
    .await;
    let before_kill = answered.load(Ordering::SeqCst);
    drop(a); // SIGKILL: the leader lease is not revoked; b must wait it out.
    wait_until("b leads", async || {
        ready_text(&client, &b.url)
            .await
            .is_some_and(|t| t.starts_with("leader"))
    })
    .await;
    wait_until("grants flow again", async || {
        answered.load(Ordering::SeqCst) >= before_kill + 80
    })
    .await;

    // Now lose an etcd member (the etcd leader): a quorum of two remains and grants continue.
    let etcd_leader = etcd.leader_index();
    etcd.stop_member(etcd_leader);
    let before_member_loss = answered.load(Ordering::SeqCst);
    wait_until("grants flow without the etcd leader", async || {
        answered.load(Ordering::SeqCst) >= before_member_loss + 40
    })
    .await;
    stop.store(true, Ordering::SeqCst);

    let mut by_lease: HashMap<LeaseId, GrantAnswer> = HashMap::new();
    let mut epochs = Vec::new();
    for task in clients {
        for (lease, record, _) in task.await.expect("client") {
            epochs.push(record.epoch);
            assert!(
                by_lease.insert(lease, record).is_none(),
                "one answer per lease id"
            );
        }
    }
    let first_epoch = epochs.iter().min().copied().expect("grants");
    let last_epoch = epochs.iter().max().copied().expect("grants");
    assert!(
        last_epoch > first_epoch,
        "the new leader stamps a higher epoch"
    );

    // Every answered grant is in etcd exactly as answered: nothing lost, nothing rewritten.
    let kv = allot_allocator::kv::etcd::EtcdKv::connect(&etcd.endpoints())
        .await
        .expect("connect");
    let tenant = allot_shared::ids::TenantId::parse("atlas").expect("tenant");
    let pool_id = allot_shared::ids::PoolId::parse("api").expect("pool");
    let stored: HashMap<LeaseId, GrantRecord> =
        allot_allocator::pools::list_grants(&kv, &tenant, &pool_id)
            .await
            .expect("grants")
            .into_iter()
            .map(|g| (g.lease_id, g))
            .collect();
    for (lease, record) in &by_lease {
        // Stored as answered (the answer adds its own instant, and the version of the terms
        // its worker held, which a record does not keep).
        assert_eq!(
            stored.get(lease).map(|s| GrantAnswer {
                terms_version: record.terms_version,
                ..s.answer(record.answered_at_ms)
            }),
            Some(record.clone()),
            "grant {lease} is stored as answered"
        );
    }
    assert_eq!(
        stored.len(),
        by_lease.len(),
        "no grant nobody was told about"
    );
    // And no window granted more than its limit.
    let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
    for record in stored.values() {
        *per_window.entry(record.window_start_ms).or_default() += record.granted_tokens;
    }
    assert!(per_window.values().all(|granted| *granted <= 100_000));
}

/// SIGTERM: the leader stops taking requests, exits cleanly and revokes its lease, so the follower
/// takes over at once rather than after the lease TTL (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_leader_hands_over_at_once() {
    let etcd = EtcdCluster::single();
    let endpoints = etcd.endpoints();
    let dir = tempfile::tempdir().expect("temp dir");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    // A 30 s leader lease: only a revocation explains a takeover within the wait below (15 s).
    let start = |name: &str| start_allocator_with_ttl(dir.path(), name, &endpoints, 30);
    let mut a = start("alloc-a");
    wait_until("a leads", async || {
        ready_text(&client, &a.url)
            .await
            .is_some_and(|t| t.starts_with("leader"))
    })
    .await;
    let b = start("alloc-b");
    wait_until("b follows", async || {
        ready_text(&client, &b.url)
            .await
            .is_some_and(|t| t.starts_with("follower"))
    })
    .await;
    let terminated = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(terminated.success());
    let mut exited = None;
    for _ in 0..100 {
        if let Some(status) = a.child.try_wait().expect("wait") {
            exited = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        exited.is_some_and(|s| s.success()),
        "the leader exits cleanly: {exited:?}"
    );
    // b looks for a free leader key every second: it leads long before a's 30 s lease could lapse.
    let stopwatch = allot_allocator::clock::Stopwatch::start();
    wait_until("b leads", async || {
        ready_text(&client, &b.url)
            .await
            .is_some_and(|t| t.starts_with("leader"))
    })
    .await;
    assert!(
        stopwatch.elapsed_seconds() < 5.0,
        "took over in {:.1} s",
        stopwatch.elapsed_seconds()
    );
}

/// The shard map as `url` answers it: each shard's leader node id, `None` for none.
async fn shard_leaders(client: &reqwest::Client, url: &str) -> Option<Vec<Option<String>>> {
    let response = client
        .get(format!("{url}/v1/shards"))
        .bearer_auth(AGENT_TOKEN)
        .send()
        .await
        .ok()?;
    let map: allot_shared::wire::ShardMap = response.json().await.ok()?;
    Some(
        map.shards
            .into_iter()
            .map(|lead| lead.leader.map(|l| l.node_id))
            .collect(),
    )
}

/// A grant of one token of `tenant/api` asked of `url`: the status and the answer's body.
async fn ask_grant(
    client: &reqwest::Client,
    url: &str,
    tenant: &str,
    lease: LeaseId,
) -> (u16, serde_json::Value) {
    let response = client
        .post(format!("{url}/v1/grants"))
        .bearer_auth(AGENT_TOKEN)
        .json(&json!({ "leaseId": lease, "tenant": tenant, "pool": "api", "region": "eu", "want": 1 }))
        .send()
        .await
        .expect("the allocator answers");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_allocators_split_the_shards_and_one_killed_leaves_its_shards_to_the_other() {
    use allot_shared::ids::{PoolId, TenantId};
    use allot_shared::shards::{ShardCount, shard_of};
    let etcd = EtcdCluster::single();
    let endpoints = etcd.endpoints();
    let dir = tempfile::tempdir().expect("temp dir");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    let start = |name: &str, shards: &str| {
        start_allocator_with(dir.path(), name, &endpoints, 2, &["--shards", shards])
    };
    let a = start("alloc-a", "4");
    wait_until("a leads every shard", async || {
        ready_text(&client, &a.url)
            .await
            .is_some_and(|t| t.starts_with("leads 4 of 4 shards"))
    })
    .await;
    let mut b = start("alloc-b", "4");
    let count = |leaders: &[Option<String>], node: &str| {
        leaders
            .iter()
            .filter(|l| l.as_deref() == Some(node))
            .count()
    };
    wait_until("a and b lead two shards each", async || {
        shard_leaders(&client, &b.url)
            .await
            .is_some_and(|l| count(&l, "alloc-a") == 2 && count(&l, "alloc-b") == 2)
    })
    .await;

    // An allocator started with another count refuses to start, saying why.
    let mut wrong = start("alloc-c", "2");
    let mut exited = None;
    for _ in 0..200 {
        exited = wrong.child.try_wait().expect("wait");
        if exited.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = exited.expect("it exits within 10 s instead of serving");
    assert!(!status.success());
    let log = std::fs::read_to_string(dir.path().join("alloc-c.log")).expect("log");
    assert!(
        log.contains("--shards 2 disagrees with the store, whose pools are split into 4 shards"),
        "{log}"
    );

    // A pool in a shard `a` leads and one in a shard `b` leads.
    let leaders = shard_leaders(&client, &a.url).await.expect("map");
    let shards = ShardCount::new(4).expect("count");
    let tenant_led_by = |node: &str| {
        (0..64)
            .map(|n| format!("t{n:02}"))
            .find(|tenant| {
                let shard = shard_of(
                    &TenantId::parse(tenant).expect("tenant"),
                    &PoolId::parse("api").expect("pool"),
                    shards,
                );
                leaders[shard.0 as usize].as_deref() == Some(node)
            })
            .expect("some tenant in each node's shards")
    };
    let (on_a, on_b) = (tenant_led_by("alloc-a"), tenant_led_by("alloc-b"));
    let pool = json!({ "limit": 1000, "windowMs": 60000, "chunk": 10, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 0, "regions": ["eu", "us"] });
    for tenant in [&on_a, &on_b] {
        let put = client
            .put(format!("{}/v1/pools/{tenant}/api", a.url))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&pool)
            .send()
            .await
            .expect("put pool");
        assert_eq!(put.status(), 200);
    }

    // Each pool is granted by its shard's leader only; the other names that leader.
    let (status, refused) = ask_grant(&client, &a.url, &on_b, LeaseId::from_parts(1, 1)).await;
    assert_eq!(status, 503);
    assert_eq!(refused["leader"], json!(b.url));
    let (status, granted_by_b) = ask_grant(&client, &b.url, &on_b, LeaseId::from_parts(1, 1)).await;
    assert_eq!(status, 200, "{granted_by_b}");
    let (status, _) = ask_grant(&client, &a.url, &on_a, LeaseId::from_parts(1, 2)).await;
    assert_eq!(status, 200);

    // A batch across both shards, sent to `a`: a's pool granted, b's refused alone, naming b.
    let batch = client
        .post(format!("{}/v1/grants/batch", a.url))
        .bearer_auth(AGENT_TOKEN)
        .json(&json!({ "grants": [
            { "leaseId": LeaseId::from_parts(1, 3), "tenant": on_a, "pool": "api", "region": "eu", "want": 1 },
            { "leaseId": LeaseId::from_parts(1, 4), "tenant": on_b, "pool": "api", "region": "eu", "want": 1 },
        ] }))
        .send()
        .await
        .expect("batch");
    assert_eq!(batch.status(), 200);
    let results: serde_json::Value = batch.json().await.expect("json");
    assert!(results["results"][0]["grant"].is_object(), "{results}");
    assert_eq!(
        results["results"][1]["problem"]["status"],
        json!(503),
        "{results}"
    );
    assert_eq!(results["results"][1]["problem"]["leader"], json!(b.url));

    // `b` is killed: within its lease's TTL and a few rounds, `a` leads all four shards and grants
    // b's pool under a higher epoch.
    let _ = b.child.kill();
    let _ = b.child.wait();
    wait_until("a leads every shard again", async || {
        shard_leaders(&client, &a.url)
            .await
            .is_some_and(|l| count(&l, "alloc-a") == 4)
    })
    .await;
    let (status, granted_by_a) = ask_grant(&client, &a.url, &on_b, LeaseId::from_parts(1, 5)).await;
    assert_eq!(status, 200, "{granted_by_a}");
    assert!(
        granted_by_a["epoch"].as_u64() > granted_by_b["epoch"].as_u64(),
        "{granted_by_a} after {granted_by_b}"
    );
}
