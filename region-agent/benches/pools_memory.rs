//! The agent's memory per pool it holds: an agent (lease-only policy, in-process limiter) admits
//! one request for each of 1,000, then 10,000, then 100,000 tenants' pools, each a pool it then
//! holds with its first lease; its process's resident memory is read after each step. Then the
//! agent's journal (what `--state-dir` keeps) is written once: its size and how long the write took.
//! The allocator is the benches' stand-in in this process (its answers are not kept). Run with
//! `scripts/bench` (or `cargo bench -p allot-region-agent --bench pools_memory`). Prints one JSON
//! object per line for the report, and a table.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{InProcessStore, LimiterStore};
use allot_region_agent::service::AgentSettings;
use allot_shared::ids::TenantId;

mod common;

/// The pool counts measured, in order: each step adds pools to those already held.
const STEPS: [u64; 3] = [1_000, 10_000, 100_000];
/// Admissions in flight at once while pools are added.
const CALLERS: u64 = 64;

/// Bytes of the files under `path` (the state folder's journal and whatever else it holds).
fn folder_bytes(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path).map_or(0, |entries| {
        entries
            .flatten()
            .map(|entry| match entry.metadata() {
                Ok(meta) if meta.is_dir() => folder_bytes(&entry.path()),
                Ok(meta) => meta.len(),
                Err(_) => 0,
            })
            .sum()
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let grants = Arc::new(AtomicU64::new(0));
    let allocator = common::stub_allocator(grants.clone(), 100).await;
    let store: Arc<dyn LimiterStore> =
        Arc::new(InProcessStore::new(Arc::new(SystemClock), 100_000));
    let agent = common::agent(
        store,
        &allocator,
        false,
        AgentSettings {
            max_pools: 200_000,
            ..common::settings()
        },
    );
    let state = tempfile::tempdir().expect("a state folder");
    agent.set_state_dir(
        allot_region_agent::state_dir::StateDir::open(
            state.path(),
            allot_shared::ids::RegionId::parse("eu").expect("region"),
        )
        .expect("the state folder"),
    );
    println!(
        "{:>8} {:>14} {:>14} {:>10} {:>14} {:>10}",
        "pools", "resident B", "B per pool", "allowed", "journal B", "write ms"
    );
    let mut held = 0;
    let mut resident_before = allot_testkit::resident_bytes();
    for step in STEPS {
        let next = Arc::new(AtomicU64::new(held));
        let allowed = Arc::new(AtomicU64::new(0));
        let mut callers = Vec::new();
        for _ in 0..CALLERS {
            let (agent, next, allowed) = (agent.clone(), next.clone(), allowed.clone());
            callers.push(tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= step {
                        return;
                    }
                    let mut request = common::request(n);
                    request.tenant_id = TenantId::parse(&format!("tenant-{n:06}")).expect("tenant");
                    if agent.admit(&request).await.is_ok_and(|d| d.allowed) {
                        allowed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for caller in callers {
            caller.await.expect("caller");
        }
        let resident = allot_testkit::resident_bytes();
        let added = step - held;
        let per_pool = resident.saturating_sub(resident_before) / added;
        let allowed = allowed.load(Ordering::Relaxed);
        assert_eq!(
            agent.pool_counts().0 as u64,
            step,
            "every pool is held ({allowed} of {added} new pools' first requests allowed)"
        );
        let stopwatch = allot_region_agent::clock::Stopwatch::start();
        agent.write_journal_if_changed().await;
        let write_ms = stopwatch.elapsed().as_secs_f64() * 1_000.0;
        let journal_bytes = folder_bytes(state.path());
        println!(
            "{step:>8} {resident:>14} {per_pool:>14} {allowed:>10} {journal_bytes:>14} {write_ms:>10.1}"
        );
        println!(
            "BENCH {}",
            serde_json::json!({ "bench": "agent_pools_memory", "pools": step,
                "residentBytes": resident, "residentBytesPerPoolAdded": per_pool,
                "journalBytes": journal_bytes, "journalWriteMs": write_ms,
                "allocatorGrantCalls": grants.load(Ordering::Relaxed) })
        );
        held = step;
        // The journal's write allocates; the next step's growth starts after it.
        resident_before = allot_testkit::resident_bytes();
    }
}
