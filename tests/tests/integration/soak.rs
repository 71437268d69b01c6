//! The fault soak: the real-process topology under steady load through both agents while a chaos
//! loop, over and over, partitions a region from the allocators, kills (SIGKILL) and restarts the
//! leading allocator, stops and restarts an etcd member, restarts a regional Redis, kills and
//! restarts an agent, and kills and restarts an agent *during* a partition (it comes back on its
//! state directory alone: pool terms, pending reports, fallback claims). Afterwards:
//! - no process panicked, and each of ours stayed within its memory bound (peaks reported);
//! - every ledger window admitted at most its bound (G + fallback allowances);
//! - every report reached the ledger once: the ledger never holds more admits than the load
//!   generator could have seen (allowed + unanswered), and every admit it saw allowed is in the
//!   ledger except a killed agent's admits since its last journal: at most one journal interval of
//!   load per kill;
//! - nothing raw appears in any log or metric.
//!
//! The CI form runs a minute, and on until each kind of fault has been applied once;
//! `simulations/soak [MINUTES]` runs longer (docs/reliability.md records
//! the figures of a 10-minute run). Length: `ALLOT_SOAK_SECONDS`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_testkit::ProxyMode;
use serde_json::Value;

use crate::topology;

use crate::topology::{
    Counts, FALLBACK_PER_REGION, LIMIT, Topology, drive, resident_kib, sum, wait_until,
};

/// Most resident memory any one of our processes may reach, KiB.
const MEMORY_BOUND_KIB: u64 = 256 * 1024;
/// Requests a killed agent may have admitted and answered but not yet counted anywhere durable
/// besides one journal interval: the load generator's requests in flight at the kill.
const IN_FLIGHT_AT_A_KILL: u64 = 4;
/// Admits per second at EU and US.
const EU_RATE: u64 = 45;
const US_RATE: u64 = 5;

/// One chaos step.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Partition(&'static str),
    KillLeadingAllocator,
    StopEtcdMember,
    RestartRedis(&'static str),
    KillAgent(&'static str),
    KillAgentDuringPartition(&'static str),
}

/// Every kind of fault first, so that one pass applies each; then the other regions' turns.
const CYCLE: [Fault; 9] = [
    Fault::Partition("eu"),
    Fault::KillLeadingAllocator,
    Fault::StopEtcdMember,
    Fault::RestartRedis("us"),
    Fault::KillAgent("us"),
    Fault::KillAgentDuringPartition("eu"),
    Fault::Partition("us"),
    Fault::RestartRedis("eu"),
    Fault::KillAgent("eu"),
];

impl Fault {
    fn kind(self) -> std::mem::Discriminant<Self> {
        std::mem::discriminant(&self)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The soak's length is wall time: the harness reads the clock to end it (architecture invariant 1).
#[allow(clippy::disallowed_methods)]
async fn soak_under_chaos_loses_nothing_and_stays_bounded() {
    let seconds: u64 = std::env::var("ALLOT_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60)
        .clamp(30, 24 * 3600);
    let mut topology = Topology::start("allot_soak").await;
    let client = topology.client.clone();

    // Peak resident memory per process of ours, sampled every 500 ms.
    let peaks: Arc<std::sync::Mutex<BTreeMap<String, u64>>> = Arc::default();
    let pids: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    let refresh_pids = |topology: &Topology| {
        let current: Vec<(String, u32)> = topology
            .processes()
            .iter()
            .filter_map(|p| p.pid().map(|pid| (p.name.clone(), pid)))
            .collect();
        *pids.lock().expect("pids") = current;
    };
    refresh_pids(&topology);
    let sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peaks, pids, sampling) = (peaks.clone(), pids.clone(), sampling.clone());
        tokio::spawn(async move {
            while !sampling.load(Ordering::SeqCst) {
                let current = pids.lock().expect("pids").clone();
                for (name, pid) in current {
                    if let Some(kib) = resident_kib(pid) {
                        let mut peaks = peaks.lock().expect("peaks");
                        let peak = peaks.entry(name).or_insert(0);
                        *peak = (*peak).max(kib);
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };

    let stop = Arc::new(AtomicBool::new(false));
    let (eu_counts, us_counts) = (Arc::new(Counts::default()), Arc::new(Counts::default()));
    let load = [
        tokio::spawn(drive(
            client.clone(),
            topology.agents["eu"].url.clone(),
            EU_RATE,
            eu_counts.clone(),
            stop.clone(),
        )),
        tokio::spawn(drive(
            client.clone(),
            topology.agents["us"].url.clone(),
            US_RATE,
            us_counts.clone(),
            stop.clone(),
        )),
    ];

    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut applied: Vec<String> = Vec::new();
    // The run goes on until each kind in the cycle has been applied once, within one pass more.
    let fault_kinds: std::collections::HashSet<_> = CYCLE.iter().map(|f| f.kind()).collect();
    let mut kinds_applied = std::collections::HashSet::new();
    let mut agent_kills = 0u64;
    for (step, fault) in CYCLE.iter().cycle().enumerate() {
        // Past the length asked for only to apply every kind once (a slow machine): each kind
        // comes within the first pass, so a pass past the deadline is the most this takes.
        let every_kind = kinds_applied.len() == fault_kinds.len();
        let past_deadline = tokio::time::Instant::now() + Duration::from_secs(12) > deadline;
        if past_deadline && (every_kind || step >= CYCLE.len()) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        match *fault {
            Fault::Partition(region) => {
                for proxy in &topology.agents[region].proxies {
                    proxy.set_mode(ProxyMode::Refuse);
                }
                tokio::time::sleep(Duration::from_secs(6)).await;
                for proxy in &topology.agents[region].proxies {
                    proxy.set_mode(ProxyMode::Pass);
                }
            }
            Fault::KillLeadingAllocator => {
                let leader = topology.wait_for_leader(30).await;
                let index = topology
                    .allocators
                    .iter()
                    .position(|a| a.url == leader)
                    .expect("the leader is one of ours");
                topology.allocators[index].process.kill();
                let other = topology.allocators[1 - index].url.clone();
                wait_until("the other allocator leads", 30, async || {
                    topology::role(&client, &other)
                        .await
                        .is_some_and(|r| r.starts_with("leader"))
                })
                .await;
                topology.allocators[index].process.start();
            }
            Fault::StopEtcdMember => {
                let member = topology.etcd.leader_index();
                // The testkit's calls block while they wait for the servers: off the runtime's
                // workers, so the load keeps its pace.
                tokio::task::block_in_place(|| topology.etcd.stop_member(member));
                tokio::time::sleep(Duration::from_secs(4)).await;
                tokio::task::block_in_place(|| {
                    topology.etcd.restart_member(member);
                    topology.etcd.wait_healthy();
                });
            }
            Fault::RestartRedis(region) => {
                if let Some(redis) = topology.redis.get_mut(region) {
                    tokio::task::block_in_place(|| redis.stop());
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    tokio::task::block_in_place(|| redis.restart());
                }
            }
            Fault::KillAgentDuringPartition(region) => {
                for proxy in &topology.agents[region].proxies {
                    proxy.set_mode(ProxyMode::Refuse);
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Some(agent) = topology.agents.get_mut(region) {
                    agent.process.kill();
                    agent_kills += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    agent.process.start();
                }
                // Back up on its state directory alone, while still cut off.
                topology.wait_for_agent(region).await;
                tokio::time::sleep(Duration::from_secs(4)).await;
                for proxy in &topology.agents[region].proxies {
                    proxy.set_mode(ProxyMode::Pass);
                }
            }
            Fault::KillAgent(region) => {
                if let Some(agent) = topology.agents.get_mut(region) {
                    agent.process.kill();
                    agent_kills += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    agent.process.start();
                }
                topology.wait_for_agent(region).await;
            }
        }
        refresh_pids(&topology);
        applied.push(format!("{fault:?}"));
        kinds_applied.insert(fault.kind());
    }
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    tokio::time::sleep(remaining).await;
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.expect("load generator");
    }

    let allowed = Counts::get(&eu_counts.allowed) + Counts::get(&us_counts.allowed);
    let unanswered = Counts::get(&eu_counts.failed) + Counts::get(&us_counts.failed);
    // Leases end within a TTL and final reports follow within a second; a killed agent's leases
    // are reported final by its next incarnation, with what its journal says they spent.
    let leader = topology.wait_for_leader(30).await;
    let mut windows: Vec<Value> = Vec::new();
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(read) = topology.windows(&leader).await {
            windows = read;
            if sum(&windows, "admitted") >= allowed {
                break;
            }
        }
    }
    sampling.store(true, Ordering::SeqCst);
    let _ = sampler.await;
    let ledger_admitted = sum(&windows, "admitted");
    let unreported = sum(&windows, "unreported");
    let peaks = peaks.lock().expect("peaks").clone();
    let summary = format!(
        "{seconds} s, faults applied: {} ({}); load generator: allowed {allowed} (EU {} fallback {}, US {} fallback {}), denied {}, unanswered {unanswered}, skipped {}; ledger: admitted {ledger_admitted}, unreported {unreported}, {} windows; peak resident KiB: {peaks:?}",
        applied.len(),
        applied.join(", "),
        Counts::get(&eu_counts.allowed),
        Counts::get(&eu_counts.fallback),
        Counts::get(&us_counts.allowed),
        Counts::get(&us_counts.fallback),
        Counts::get(&eu_counts.denied) + Counts::get(&us_counts.denied),
        Counts::get(&eu_counts.skipped) + Counts::get(&us_counts.skipped),
        windows.len(),
    );
    println!("soak: {summary}");

    assert_eq!(
        kinds_applied, fault_kinds,
        "every kind of fault was applied; {summary}"
    );
    assert!(
        Counts::get(&eu_counts.allowed) > 0 && Counts::get(&us_counts.allowed) > 0,
        "both regions admitted; {summary}"
    );
    assert!(
        windows.len() as u64 >= seconds * 1_000 / topology::WINDOW_MS,
        "the ledger holds every window of the run; {summary}"
    );
    topology.assert_no_panic();
    assert_eq!(
        peaks.len(),
        4,
        "memory was sampled for every process of ours; {summary}"
    );
    for (name, peak) in &peaks {
        assert!(
            *peak <= MEMORY_BOUND_KIB,
            "{name} peaked at {peak} KiB; {summary}"
        );
    }
    for window in &windows {
        let admitted = window["admitted"].as_u64().unwrap_or(0);
        assert_eq!(
            window["bound"],
            LIMIT + 2 * FALLBACK_PER_REGION,
            "{summary}"
        );
        assert!(
            admitted <= LIMIT + 2 * FALLBACK_PER_REGION,
            "a window above its bound: {window}; {summary}"
        );
        for region in topology::REGIONS {
            let fallback = window["fallbackAdmittedByRegion"][region]
                .as_u64()
                .unwrap_or(0);
            assert!(
                fallback <= FALLBACK_PER_REGION,
                "{region} admitted {fallback} in fallback: {window}; {summary}"
            );
        }
    }
    // Nothing counted twice: the ledger holds no admit the generator could not have seen.
    assert!(
        ledger_admitted <= allowed + unanswered,
        "the ledger holds more than was admitted; {summary}"
    );
    // Nothing lost but what a killed agent admitted after its last journal: one journal interval
    // of load per kill (and the requests in flight when it died).
    let missing = allowed.saturating_sub(ledger_admitted);
    let journal_interval_ms =
        u64::try_from(allot_region_agent::service::JOURNAL_INTERVAL.as_millis()).unwrap_or(0);
    let per_kill = (EU_RATE * journal_interval_ms).div_ceil(1_000) + IN_FLIGHT_AT_A_KILL;
    assert!(
        missing <= agent_kills * per_kill,
        "{missing} missing: more than {agent_kills} kills x ({per_kill}: one journal interval of \
         load and what was in flight); {summary}"
    );
    topology.assert_nothing_raw(8).await;
    topology.stop().await;
}
