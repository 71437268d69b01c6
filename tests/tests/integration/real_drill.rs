//! The real-process partition drill: a 3-member etcd cluster, a Redis per region, two allocator
//! processes on a shared PostgreSQL ledger, and two region-agent processes, each reaching the
//! allocators through fault proxies of ours. A load generator drives both agents' HTTP API and counts
//! every admit itself while faults are injected for real:
//!
//! 1. EU is cut off from both allocators for longer than a lease TTL (it spends its leases, then its
//!    fallback allowance);
//! 2. the leading allocator is killed (SIGKILL) and the other takes over;
//! 3. the etcd leader is stopped (the cluster keeps its quorum);
//! 4. US's Redis is stopped and restarted (regional rules run on their local buckets meanwhile);
//! 5. US's allocator calls hang (a black hole: connections accepted, nothing answered) for longer
//!    than a lease TTL: a renewal unanswered for 200 ms counts as an unreachable allocator, so US
//!    falls back instead of waiting, and no admit waits on the hung calls (their deadline is 2 s).
//!
//! Then, once every lease has ended and been reported, the ledger must account for exactly the
//! admits the load generator saw, every window must be within its bound (G + fallback allowances),
//! EU must have admitted in fallback, no process may have panicked, and no raw user id, API key id,
//! client address or token may appear in any process's log or in the agents' metrics.
//!
//! Short form (about 40 s of load) in the test suite; `ALLOT_REAL_DRILL_SCALE=10` stretches every
//! phase tenfold (`simulations/real-drill` runs it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_testkit::ProxyMode;
use serde_json::Value;

use crate::topology::{
    Counts, FALLBACK_PER_REGION, LIMIT, Topology, drive, role, sum, sum_region, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_processes_through_partitions_failovers_and_restarts_stay_within_the_bound() {
    let scale: u64 = std::env::var("ALLOT_REAL_DRILL_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .clamp(1, 100);
    let phase = |seconds: u64| Duration::from_secs(seconds * scale);
    let mut topology = Topology::start("allot_real_drill").await;
    let client = topology.client.clone();
    let leader_url = topology.wait_for_leader(30).await;

    // Load: 45 admits/s at EU, 5 at US (1.25 x G per window), counted by us.
    let stop = Arc::new(AtomicBool::new(false));
    let (eu_counts, us_counts) = (Arc::new(Counts::default()), Arc::new(Counts::default()));
    let load = [
        tokio::spawn(drive(
            client.clone(),
            topology.agents["eu"].url.clone(),
            45,
            eu_counts.clone(),
            stop.clone(),
        )),
        tokio::spawn(drive(
            client.clone(),
            topology.agents["us"].url.clone(),
            5,
            us_counts.clone(),
            stop.clone(),
        )),
    ];

    tokio::time::sleep(phase(6)).await;
    // 1. EU cut off from both allocators for 8 s (leases last 3 s: then fallback).
    for proxy in &topology.agents["eu"].proxies {
        proxy.set_mode(ProxyMode::Refuse);
    }
    tokio::time::sleep(phase(8)).await;
    for proxy in &topology.agents["eu"].proxies {
        proxy.set_mode(ProxyMode::Pass);
    }
    tokio::time::sleep(phase(4)).await;
    // 2. The leading allocator dies without a goodbye.
    let allowed_before_kill = Counts::get(&eu_counts.allowed);
    let leader_index = topology
        .allocators
        .iter()
        .position(|a| a.url == leader_url)
        .expect("the leader is one of ours");
    topology.allocators[leader_index].process.kill();
    let survivor = topology.allocators[1 - leader_index].url.clone();
    wait_until("the other allocator leads", 30, async || {
        role(&client, &survivor)
            .await
            .is_some_and(|r| r.starts_with("leader"))
    })
    .await;
    tokio::time::sleep(phase(4)).await;
    // 3. The etcd leader stops; two members keep the quorum.
    let etcd_leader = topology.etcd.leader_index();
    topology.etcd.stop_member(etcd_leader);
    tokio::time::sleep(phase(4)).await;
    // 4. US's Redis restarts.
    if let Some(redis) = topology.redis.get_mut("us") {
        redis.stop();
        tokio::time::sleep(phase(2)).await;
        redis.restart();
    }
    tokio::time::sleep(phase(2)).await;
    // 5. US's allocator calls hang.
    let us_fallback_before_hang = Counts::get(&us_counts.fallback);
    for proxy in &topology.agents["us"].proxies {
        proxy.set_mode(ProxyMode::Hold);
    }
    tokio::time::sleep(phase(5)).await;
    for proxy in &topology.agents["us"].proxies {
        proxy.set_mode(ProxyMode::Pass);
    }
    let us_fallback_in_hang = Counts::get(&us_counts.fallback) - us_fallback_before_hang;
    tokio::time::sleep(phase(6)).await;
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.expect("load generator");
    }
    let allowed_after_kill = Counts::get(&eu_counts.allowed) - allowed_before_kill;
    let counted = Counts::get(&eu_counts.allowed) + Counts::get(&us_counts.allowed);
    let eu_fallback = Counts::get(&eu_counts.fallback);
    // US may fall back too, briefly, while the surviving allocator takes over.
    let counted_fallback = eu_fallback + Counts::get(&us_counts.fallback);

    // Every lease ends within a TTL and is reported within a second: the ledger then holds every
    // admit the load generator saw, no more, no less.
    let mut windows: Vec<Value> = Vec::new();
    let mut ledger_admitted = 0;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Some(read) = topology.windows(&survivor).await else {
            continue;
        };
        windows = read;
        ledger_admitted = sum(&windows, "admitted");
        if ledger_admitted == counted && sum(&windows, "unreported") == 0 {
            break;
        }
    }
    let summary = format!(
        "load generator: EU allowed {} (fallback {}), denied {}, failed {}; US allowed {} (fallback {}), denied {}, failed {}; ledger windows: {}",
        Counts::get(&eu_counts.allowed),
        eu_fallback,
        Counts::get(&eu_counts.denied),
        Counts::get(&eu_counts.failed),
        Counts::get(&us_counts.allowed),
        Counts::get(&us_counts.fallback),
        Counts::get(&us_counts.denied),
        Counts::get(&us_counts.failed),
        serde_json::to_string(&windows).unwrap_or_default()
    );
    assert!(
        windows.len() >= 4,
        "the ledger holds the run's windows; {summary}"
    );
    assert!(counted > 0, "the load was admitted; {summary}");
    assert_eq!(
        ledger_admitted, counted,
        "the ledger accounts for exactly what was admitted; {summary}"
    );
    for window in &windows {
        let admitted = window["admitted"].as_u64().unwrap_or(0);
        let bound = window["bound"].as_u64().unwrap_or(0);
        assert_eq!(bound, LIMIT + 2 * FALLBACK_PER_REGION, "{summary}");
        assert!(admitted <= bound, "a window above its bound; {summary}");
        assert_eq!(window["unreported"], 0, "{summary}");
        for region in ["eu", "us"] {
            assert!(
                window["fallbackAdmittedByRegion"][region]
                    .as_u64()
                    .unwrap_or(0)
                    <= FALLBACK_PER_REGION,
                "{summary}"
            );
        }
    }
    assert!(
        eu_fallback > 0,
        "EU admitted in fallback while cut off; {summary}"
    );
    // A decision's `fallback` also marks regional rules decided on local buckets (US's Redis
    // restart, or a Redis reply past the decision budget on a starved machine); the ledger counts
    // global fallback only. The EU agent (never restarted) counts its global fallback admits itself:
    // those the ledger must hold exactly.
    let ledger_fallback = |region: &str| sum_region(&windows, "fallbackAdmittedByRegion", region);
    let agent_metrics = client
        .get(format!("{}/metrics", topology.agents["eu"].url))
        .send()
        .await
        .expect("EU metrics")
        .text()
        .await
        .expect("metrics text");
    let agent_fallback: u64 = agent_metrics
        .lines()
        .filter(|line| line.starts_with("allot_agent_fallback_admits_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64;
    assert_eq!(ledger_fallback("eu"), agent_fallback, "{summary}");
    assert!(ledger_fallback("eu") <= eu_fallback, "{summary}");
    assert!(
        ledger_fallback("eu") + ledger_fallback("us") <= counted_fallback,
        "{summary}"
    );
    assert!(
        allowed_after_kill > 0,
        "EU kept admitting after the allocator failover; {summary}"
    );
    // The hung allocator: US fell back rather than wait, and no admit waited on a hung call.
    assert!(
        us_fallback_in_hang > 0,
        "US admitted in fallback while its allocator calls hung; {summary}"
    );
    let slowest_ms =
        Counts::get(&us_counts.slowest_admit_ms).max(Counts::get(&eu_counts.slowest_admit_ms));
    let call_timeout_ms =
        u64::try_from(allot_region_agent::allocator_client::CALL_TIMEOUT.as_millis()).unwrap_or(0);
    assert!(
        slowest_ms < call_timeout_ms,
        "an admit took {slowest_ms} ms: it waited on an allocator call; {summary}"
    );
    assert!(
        Counts::get(&us_counts.failed) + Counts::get(&eu_counts.failed) == 0,
        "every request got a decision; {summary}"
    );
    // Nothing raw in logs or metrics: the processes only ever saw keyed hashes of the principals.
    topology.assert_no_panic();
    topology.assert_nothing_raw(7).await;
    topology.stop().await;
}
