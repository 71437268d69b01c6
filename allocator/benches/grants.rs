//! Grants per second through the allocator's grant service, beside a raw etcd transaction loop of the
//! same shape, against the same single etcd member, in the same run.
//!
//! Shapes: one hot pool (every request on one window key) and 1,000 pools, 1 and 64 concurrent
//! clients; and, for how cost grows with pools, 10, 10,000 and 100,000 pools at 64 clients. Per-pool group commit on (up to 120 grants of a pool per commit) and off (1). Commits of
//! different pools are merged by the committer either way. The raw loop is what a
//! naive allocator would do: read the window key, then compare-and-put it; on one hot key most of those
//! transactions conflict. Run with `scripts/bench` (or `cargo bench -p allot-allocator --bench grants`).
//! Prints one JSON object per line for the report, and a table.
//!
//! `warm`: every pool has had a grant from this grant service before the run (its worker holds the
//! pool's configuration and window, as in steady state); `cold`: none has (every pool's first grant
//! in the run reads them from etcd first, as after a failover). The 10,000- and 100,000-pool
//! shapes are measured both ways; the others warm. Each row also has the grant latency's median
//! and 99th percentile; the 100,000-pool shape adds the allocator's resident memory per warm pool
//! (its growth while the warm-up loads every pool, over the pools) and etcd's database size.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_allocator::clock::{Clock, Stopwatch, SystemClock};
use allot_allocator::grants::Grantor;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::kv::{Compare, Kv, Op};
use allot_allocator::leader::{Role, Roles, try_acquire};
use allot_allocator::pools::{PoolSpec, put_pools};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GrantRequest, LeaseClamping};
use tokio::sync::watch;

const RUN: Duration = Duration::from_secs(4);

fn pools(count: usize) -> Vec<(TenantId, PoolId)> {
    (0..count)
        .map(|n| {
            (
                TenantId::parse(&format!("t{n}")).expect("tenant"),
                PoolId::parse("api").expect("pool"),
            )
        })
        .collect()
}

/// How the raw loop writes.
#[derive(Clone, Copy)]
enum Raw {
    /// One unconditional single-put transaction per operation: the store's ceiling for the shape.
    Blind,
    /// Read the key, then compare-and-put it: what a naive allocator does for every grant.
    CompareAndPut,
    /// The etcd work of one committed grant without the allocator around it: one transaction that
    /// requires a new record key to be absent and puts the pool's window key and the record (on a
    /// lease).
    GrantShaped,
}

/// Successful transactions per second on `keys` keys from `clients` tasks, and the share that
/// failed their comparison.
async fn raw_loop(kv: Arc<EtcdKv>, keys: usize, clients: usize, mode: Raw) -> (f64, f64) {
    let record_lease = kv.grant_lease(3_600).await.expect("lease");
    // Record keys must be new in every run.
    let run: u64 = rand::random();
    let done = Arc::new(AtomicU64::new(0));
    let conflicts = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (kv, done, conflicts, stop) =
            (kv.clone(), done.clone(), conflicts.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = client;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("/bench/raw/{}", n % keys);
                n += clients;
                if let Raw::GrantShaped = mode {
                    let record = format!("/bench/raw/records/{run}/{client}/{n}");
                    let compares = vec![Compare::ModRevision {
                        key: record.clone(),
                        revision: 0,
                    }];
                    let ops = vec![
                        Op::Put {
                            key,
                            value: vec![b'w'; 96],
                            lease: None,
                        },
                        Op::Put {
                            key: record,
                            value: vec![b'r'; 200],
                            lease: Some(record_lease),
                        },
                    ];
                    match kv.txn(compares, ops).await {
                        Ok(o) if o.succeeded => done.fetch_add(1, Ordering::Relaxed),
                        _ => conflicts.fetch_add(1, Ordering::Relaxed),
                    };
                    continue;
                }
                let compares = match mode {
                    Raw::Blind | Raw::GrantShaped => vec![],
                    Raw::CompareAndPut => {
                        let revision = kv
                            .get(&key)
                            .await
                            .ok()
                            .flatten()
                            .map_or(0, |v| v.mod_revision);
                        vec![Compare::ModRevision {
                            key: key.clone(),
                            revision,
                        }]
                    }
                };
                let put = Op::Put {
                    key,
                    value: vec![b'x'; 64],
                    lease: None,
                };
                match kv.txn(compares, vec![put]).await {
                    Ok(o) if o.succeeded => done.fetch_add(1, Ordering::Relaxed),
                    _ => conflicts.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let stopwatch = Stopwatch::start();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    let seconds = stopwatch.elapsed_seconds();
    let ok = done.load(Ordering::Relaxed) as f64;
    let failed = conflicts.load(Ordering::Relaxed) as f64;
    (ok / seconds, failed / (ok + failed).max(1.0))
}

/// One grant for every pool of `targets`, from 64 tasks: afterwards every pool's worker holds its
/// configuration and window.
async fn warm_up(grantor: &Grantor, targets: &Arc<Vec<(TenantId, PoolId)>>) {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (grantor, targets, next) = (grantor.clone(), targets.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let eu = RegionId::parse("eu").expect("region");
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some((tenant, pool)) = targets.get(n) else {
                    return;
                };
                let request = GrantRequest {
                    lease_id: LeaseId::from_parts(1, rand::random()),
                    region: eu.clone(),
                    want_tokens: 1,
                };
                let _ = grantor.grant(tenant, pool, request).await;
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
}

/// Grants per second through the grant service, and the grants' latency quantiles (p50, p99), ms.
async fn grant_loop(
    grantor: Grantor,
    targets: Arc<Vec<(TenantId, PoolId)>>,
    clients: usize,
) -> (f64, f64, f64) {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (grantor, targets, done, stop) =
            (grantor.clone(), targets.clone(), done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = client;
            let eu = RegionId::parse("eu").expect("region");
            let mut latencies_ms = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let (tenant, pool) = &targets[n % targets.len()];
                let request = GrantRequest {
                    lease_id: LeaseId::from_parts(1, rand::random()),
                    region: eu.clone(),
                    want_tokens: 1,
                };
                n += clients;
                let stopwatch = Stopwatch::start();
                match grantor.grant(tenant, pool, request).await {
                    Ok(g) if g.granted_tokens == 1 => {
                        latencies_ms.push(stopwatch.elapsed_seconds() * 1_000.0);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        if std::env::var_os("BENCH_DEBUG").is_some() {
                            eprintln!("grant failed: {other:?}");
                        }
                    }
                }
            }
            latencies_ms
        }));
    }
    let stopwatch = Stopwatch::start();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies_ms = Vec::new();
    for task in tasks {
        latencies_ms.extend(task.await.unwrap_or_default());
    }
    let rate = done.load(Ordering::Relaxed) as f64 / stopwatch.elapsed_seconds();
    latencies_ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies_ms
            .get(((latencies_ms.len().saturating_sub(1)) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    (rate, at(0.5), at(0.99))
}

/// etcd's database size on disk, and the part in use, bytes.
async fn etcd_db_bytes(endpoints: &[String]) -> (i64, i64) {
    let mut client = etcd_client::Client::connect(endpoints, None)
        .await
        .expect("etcd client");
    let status = client.status().await.expect("etcd status");
    (status.db_size(), status.raft_used_db_size())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let etcd = allot_testkit::EtcdCluster::single();
    let kv = Arc::new(EtcdKv::connect(&etcd.endpoints()).await.expect("connect"));
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    // A leader lease that outlives the whole run (nothing keeps it alive here).
    let leadership = try_acquire(&*kv, "bench", "http://bench", 3_600)
        .await
        .expect("store")
        .expect("leads");
    let (_role_sender, role) = watch::channel(Roles::single(Role::Leader(leadership)));
    let spec = PoolSpec {
        limit_tokens: 1 << 40,
        window_ms: 3_600_000,
        window: None,
        chunk_tokens: 1,
        lease_ttl_ms: 60_000,
        fallback_per_region_tokens: 0,
        settle_debt_per_region_tokens: 0,
        regions: vec![RegionId::parse("eu").expect("region")],
    };
    let all = pools(100_000);
    let (db_empty, _) = etcd_db_bytes(&etcd.endpoints()).await;
    let specs: Vec<_> = all
        .iter()
        .map(|(tenant, pool)| (tenant.clone(), pool.clone(), spec.clone()))
        .collect();
    let created = Stopwatch::start();
    put_pools(&*kv, &specs, clock.now_ms())
        .await
        .expect("pools");
    let create_seconds = created.elapsed_seconds();
    let (db_pools, db_pools_in_use) = etcd_db_bytes(&etcd.endpoints()).await;
    println!(
        "{} pools created in bulk in {create_seconds:.1} s ({:.0}/s); etcd database {db_empty} B empty, {db_pools} B ({db_pools_in_use} B in use) with them: {:.0} B a pool",
        all.len(),
        all.len() as f64 / create_seconds,
        (db_pools_in_use - db_empty) as f64 / all.len() as f64
    );
    println!(
        "BENCH {}",
        serde_json::json!({ "bench": "allocator_pools", "pools": all.len(),
            "createSeconds": create_seconds, "etcdDbEmptyBytes": db_empty,
            "etcdDbBytes": db_pools, "etcdDbInUseBytes": db_pools_in_use })
    );
    println!(
        "{:<12} {:>5} {:>8} {:>8} {:>10} {:>8} {:>8} {:>10} {:>8} {:>10} {:>8} {:>10} {:>8} {:>9}",
        "shape",
        "pools",
        "clients",
        "batch",
        "grants/s",
        "p50 ms",
        "p99 ms",
        "blind/s",
        "x blind",
        "shaped/s",
        "x shaped",
        "CAS/s",
        "x CAS",
        "CAS fail"
    );
    // How cost grows with pools: 10 and 10,000 beside the hot pool and 1,000 (64 clients only).
    let shapes: [(&str, usize, &[usize]); 5] = [
        ("hot pool", 1, &[1, 64]),
        ("10 pools", 10, &[64]),
        ("1000 pools", 1_000, &[1, 64]),
        ("10000 pools", 10_000, &[64]),
        ("100000 pools", 100_000, &[64]),
    ];
    // `GRANTS_POOLS=10000,100000` runs only those shapes (all by default).
    let only: Option<Vec<usize>> = std::env::var("GRANTS_POOLS").ok().map(|list| {
        list.split(',')
            .filter_map(|n| n.trim().parse().ok())
            .collect()
    });
    // With `BENCH_DEBUG`, each row also prints the grant service's own metrics.
    let recorder = std::env::var_os("BENCH_DEBUG")
        .is_some()
        .then(allot_allocator::metrics::handle)
        .flatten();
    for (shape, pool_count, client_counts) in shapes {
        if only
            .as_ref()
            .is_some_and(|only| !only.contains(&pool_count))
        {
            continue;
        }
        let targets = Arc::new(all[..pool_count].to_vec());
        for &clients in client_counts {
            let (blind, _) = raw_loop(kv.clone(), pool_count, clients, Raw::Blind).await;
            let (shaped, _) = raw_loop(kv.clone(), pool_count, clients, Raw::GrantShaped).await;
            let (cas, cas_failed) =
                raw_loop(kv.clone(), pool_count, clients, Raw::CompareAndPut).await;
            let states: &[&str] = if pool_count >= 10_000 {
                &["warm", "cold"]
            } else {
                &["warm"]
            };
            for (&max_batch, &state) in [120usize, 1]
                .iter()
                .flat_map(|batch| states.iter().map(move |state| (batch, state)))
            {
                let kv_dyn: Arc<dyn Kv> = kv.clone();
                let grantor = Grantor::new(
                    kv_dyn,
                    clock.clone(),
                    role.clone(),
                    LeaseClamping::Clamped,
                    None,
                )
                .with_max_batch(max_batch);
                if state == "warm" {
                    let before = allot_testkit::resident_bytes();
                    warm_up(&grantor, &targets).await;
                    if pool_count >= 100_000 {
                        let per_pool = allot_testkit::resident_bytes().saturating_sub(before)
                            / pool_count as u64;
                        println!(
                            "allocator memory per warm pool: {per_pool} B (resident growth over the warm-up)"
                        );
                        println!(
                            "BENCH {}",
                            serde_json::json!({ "bench": "allocator_pools", "pools": pool_count,
                                "maxBatch": max_batch, "residentBytesPerWarmPool": per_pool })
                        );
                    }
                }
                let (grants, p50_ms, p99_ms) = grant_loop(grantor, targets.clone(), clients).await;
                let (x_blind, x_cas) = (grants / blind.max(1.0), grants / cas.max(1.0));
                let x_shaped = grants / shaped.max(1.0);
                println!(
                    "{shape:<12} {state:>5} {clients:>8} {max_batch:>8} {grants:>10.0} {p50_ms:>8.2} {p99_ms:>8.2} {blind:>10.0} {x_blind:>8.2} {shaped:>10.0} {x_shaped:>8.2} {cas:>10.0} {x_cas:>8.2} {:>8.0}%",
                    cas_failed * 100.0
                );
                if let Some(recorder) = &recorder {
                    for line in recorder.render().lines().filter(|line| {
                        line.starts_with("allot_pools_per_txn")
                            || line.starts_with("allot_pools_per_load")
                            || line.starts_with("allot_store_errors")
                            || line.starts_with("allot_grants_total")
                    }) {
                        eprintln!("  {line}");
                    }
                }
                let round2 = |x: f64| (x * 100.0).round() / 100.0;
                println!(
                    "BENCH {}",
                    serde_json::json!({ "bench": "allocator_grants", "shape": shape, "clients": clients,
                        "pools": state,
                        "maxBatch": max_batch, "grantsPerSecond": grants.round(),
                        "p50Ms": p50_ms, "p99Ms": p99_ms,
                        "blindTxnPerSecond": blind.round(), "ratioToBlind": round2(x_blind),
                        "shapedTxnPerSecond": shaped.round(), "ratioToShaped": round2(x_shaped),
                        "casTxnPerSecond": cas.round(), "ratioToCas": round2(x_cas),
                        "casConflictShare": round2(cas_failed * 100.0) })
                );
            }
        }
    }
}
