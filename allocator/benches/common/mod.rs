//! What the allocator benchmarks of agents' rounds share: the real allocator on a runtime of its
//! own (threads named [`ALLOCATOR_THREAD`], so its CPU is told from the calling client's), with an
//! embedded store, a SQLite ledger and `pools` pools.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::clock::{Clock, SystemClock};
use allot_allocator::http::Tokens;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::pools::{PoolSpec, put_pools};
use allot_allocator::server::{Settings, run};
use allot_shared::ids::{PoolId, RegionId, TenantId};

pub const OPERATOR: &str = "operator-token-for-the-bench-01";
pub const AGENT: &str = "agent-token-for-the-bench-001";
/// Rounds of each shape, alternated (A/B/A/B), so a drift of the machine touches both.
pub const ROUNDS: usize = 4;

/// Threads whose CPU is the allocator's: its runtime's, and the SQLite ledger's workers.
pub const ALLOCATOR_THREADS: [&str; 2] = [ALLOCATOR_THREAD, "sqlx-sqlite"];
/// The name of the allocator runtime's threads.
pub const ALLOCATOR_THREAD: &str = "allocator";

/// The allocator serving `pools` pools on a runtime of its own (threads named
/// [`ALLOCATOR_THREAD`], so its CPU is told from the calling client's): (base URL, client, stop).
pub async fn serve(pools: usize) -> (String, reqwest::Client, tokio::sync::oneshot::Sender<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(ALLOCATOR_THREAD)
            .enable_all()
            .build()
            .expect("allocator runtime")
            .block_on(run_allocator(pools, listener, stopped));
    });
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    for _ in 0..500 {
        // Ready, and leading: grants are served.
        let leading = client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if leading {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (base, client, stop)
}

/// The allocator itself, with `pools` pools, until `stopped`.
async fn run_allocator(
    pools: usize,
    listener: std::net::TcpListener,
    stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
    let addr = listener.local_addr().expect("addr");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let kv = Arc::new(MemoryKv::new(clock.clone()));
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::connect(&format!(
        "sqlite://{}",
        dir.keep().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    let spec = PoolSpec {
        limit_tokens: 1_000_000,
        window_ms: 3_600_000,
        window: None,
        chunk_tokens: 100,
        lease_ttl_ms: 600_000,
        fallback_per_region_tokens: 50,
        settle_debt_per_region_tokens: 0,
        regions: vec![RegionId::parse("eu").expect("region")],
    };
    let pool = PoolId::parse("api").expect("pool");
    let all: Vec<_> = (0..pools)
        .map(|n| (tenant(n), pool.clone(), spec.clone()))
        .collect();
    put_pools(&*kv, &all, clock.now_ms()).await.expect("pools");
    let tokens = Tokens {
        operator: vec![OPERATOR.to_owned()],
        agent: vec![AGENT.to_owned()],
    };
    let settings = Settings::local(addr, tokens, "bench");
    run(settings, kv, ledger, clock, listener, async move {
        let _ = stopped.await;
    })
    .await
    .expect("the allocator ran");
}

pub fn tenant(n: usize) -> TenantId {
    TenantId::parse(&format!("tenant-{n:05}")).expect("tenant")
}
