//! What monthly pools keep in etcd: `RECORD_POOLS` pools (default 10,000) with calendar-month
//! quotas (fixed windows of 31 days here: the same rule), each held in 3 regions and renewed
//! every 10 minutes (10-minute leases, as `year-monthly` sizes them), each ended lease giving back
//! half of what it held. The real grant worker on a real etcd, its clock moved 10 minutes a round
//! over 70 minutes: every record and give-back mark a steady state keeps is then in the store (a
//! record lives an hour after its commit, up to ten minutes more). Reports the keys, their bytes,
//! and etcd's database size before and after compaction and defragmentation, beside etcd's
//! default quota of 2 GiB. Needs `etcd` and `etcdctl`. Run with
//! `cargo bench -p allot-allocator --bench record_store`.

use std::sync::Arc;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::grants::{Grantor, LeaseReturn};
use allot_allocator::kv::Kv;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::leader::{Role, Roles, try_acquire};
use allot_allocator::pools::{PoolSpec, put_pools};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GrantRequest, LeaseClamping};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::watch;

/// A 31-day window, ms: longer than a record is kept, as every calendar month is.
const MONTH_MS: u64 = 31 * 86_400_000;
/// The lease TTL and the renewal period, ms.
const ROUND_MS: u64 = 600_000;
/// Rounds: 70 minutes of renewals, a record's longest life.
const ROUNDS: u64 = 7;
/// Tokens each renewal asks for; half of each lease is given back at its end.
const WANT_TOKENS: u64 = 20;
/// etcd's default backend quota, bytes.
const ETCD_DEFAULT_QUOTA_BYTES: f64 = 2.0 * 1024.0 * 1024.0 * 1024.0;

fn region(index: usize) -> RegionId {
    RegionId::parse(["eu", "us", "ap"][index]).expect("region")
}

fn tenant(pool: usize) -> TenantId {
    TenantId::parse(&format!("t{pool:06}")).expect("tenant")
}

fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    let output = std::process::Command::new("etcdctl")
        .arg(format!("--endpoints={endpoint}"))
        .args(args)
        .output()
        .expect("etcdctl runs");
    assert!(
        output.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// (database size, size in use, revision), bytes.
fn status(endpoint: &str) -> (u64, u64, u64) {
    let json: Value =
        serde_json::from_str(&etcdctl(endpoint, &["endpoint", "status", "-w", "json"]))
            .expect("status JSON");
    let status = &json[0]["Status"];
    (
        status["dbSize"].as_u64().unwrap_or(0),
        status["dbSizeInUse"].as_u64().unwrap_or(0),
        status["header"]["revision"].as_u64().unwrap_or(0),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pools: usize = std::env::var("RECORD_POOLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let cluster = allot_testkit::EtcdCluster::single();
    let endpoint = cluster.endpoints()[0].clone();
    let kv: Arc<dyn Kv> = Arc::new(EtcdKv::connect(&cluster.endpoints()).await.expect("etcd"));
    let start_ms = allot_allocator::clock::SystemClock.now_ms();
    let clock = Arc::new(ManualClock::new(start_ms));
    let spec = PoolSpec {
        limit_tokens: 40_000,
        window_ms: MONTH_MS,
        window: None,
        chunk_tokens: WANT_TOKENS,
        lease_ttl_ms: ROUND_MS,
        fallback_per_region_tokens: 500,
        settle_debt_per_region_tokens: 0,
        regions: (0..3).map(region).collect(),
    };
    let api = PoolId::parse("api").expect("pool");
    let specs: Vec<(TenantId, PoolId, PoolSpec)> = (0..pools)
        .map(|pool| (tenant(pool), api.clone(), spec.clone()))
        .collect();
    for chunk in specs.chunks(40) {
        put_pools(&*kv, chunk, start_ms).await.expect("pools");
    }
    let leadership = try_acquire(&*kv, "bench", "http://bench", 1 << 30)
        .await
        .expect("store")
        .expect("leads");
    let (_leading, role) = watch::channel(Roles::single(Role::Leader(leadership)));
    let grantor = Grantor::new(
        kv.clone(),
        clock.clone(),
        role,
        LeaseClamping::Clamped,
        None,
    );
    let (_, _, revision_before) = status(&endpoint);
    let wall = allot_allocator::clock::Stopwatch::start();
    let mut asks = 0u64;
    let mut taken_back = 0u64;
    for round in 0..ROUNDS {
        let now_ms = clock.now_ms();
        let jobs = (0..pools).flat_map(|pool| (0..3).map(move |r| (pool, r)));
        let results: Vec<u64> = futures::stream::iter(jobs)
            .map(|(pool, r)| {
                let (grantor, api) = (grantor.clone(), api.clone());
                async move {
                    let id = |round: u64| {
                        LeaseId::from_parts(
                            start_ms + round * ROUND_MS,
                            ((pool as u128) << 8) | r as u128,
                        )
                    };
                    let asked = GrantRequest {
                        lease_id: id(round),
                        region: region(r),
                        want_tokens: WANT_TOKENS,
                    };
                    let granted = grantor
                        .grant(&tenant(pool), &api, asked)
                        .await
                        .expect("grant");
                    assert_eq!(granted.granted_tokens, WANT_TOKENS);
                    if round == 0 {
                        return 0;
                    }
                    let ended = LeaseReturn {
                        lease_id: id(round - 1),
                        region: region(r),
                        spent_tokens: WANT_TOKENS / 2,
                        unspent_tokens: WANT_TOKENS / 2,
                    };
                    grantor
                        .take_back(&tenant(pool), &api, ended)
                        .await
                        .expect("give-back")
                }
            })
            .buffer_unordered(512)
            .collect()
            .await;
        asks += results.len() as u64;
        taken_back += results.iter().sum::<u64>();
        eprintln!(
            "round {round} at +{} min: {} pool-regions renewed",
            (now_ms - start_ms) / 60_000,
            results.len()
        );
        clock.advance(ROUND_MS);
    }
    let elapsed_s = wall.elapsed_seconds();
    let keys = etcdctl(
        &endpoint,
        &["get", "--prefix", "/allot/", "--limit=1", "-w", "json"],
    );
    let keys: Value = serde_json::from_str(&keys).expect("count JSON");
    let key_count = keys["count"].as_u64().unwrap_or(0);
    let (db_before, in_use_before, revision) = status(&endpoint);
    etcdctl(&endpoint, &["compact", &revision.to_string()]);
    etcdctl(&endpoint, &["defrag"]);
    let (db_after, in_use_after, _) = status(&endpoint);
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let row = serde_json::json!({
        "bench": "record_store",
        "pools": pools,
        "pool_regions": pools * 3,
        "rounds": ROUNDS,
        "grants": asks,
        "tokens_given_back": taken_back,
        "keys": key_count,
        "revisions_written": revision.saturating_sub(revision_before),
        "db_mib_before_compaction": mib(db_before),
        "db_mib_in_use_before_compaction": mib(in_use_before),
        "db_mib_after_compaction_and_defrag": mib(db_after),
        "db_mib_in_use_after": mib(in_use_after),
        "share_of_default_quota_after": db_after as f64 / ETCD_DEFAULT_QUOTA_BYTES,
        "share_of_default_quota_before": db_before as f64 / ETCD_DEFAULT_QUOTA_BYTES,
        "wall_s": elapsed_s,
    });
    println!("{row}");
    println!(
        "| {pools} monthly pools x 3 regions, {ROUNDS} rounds of 10 min | {key_count} keys | {:.1} MiB before compaction ({:.1} % of 2 GiB) | {:.1} MiB after compaction and defrag ({:.1} %) | {:.0} s |",
        mib(db_before),
        100.0 * db_before as f64 / ETCD_DEFAULT_QUOTA_BYTES,
        mib(db_after),
        100.0 * db_after as f64 / ETCD_DEFAULT_QUOTA_BYTES,
        elapsed_s
    );
}
