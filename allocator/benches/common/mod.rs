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

/// Runs `round(number, batched)` for rounds 1 to `2 * ROUNDS`, alternated A/B/A/B (one by one on
/// odd rounds, batched on even ones) so a drift of the machine touches both shapes; each round
/// answers (CPU seconds, wall seconds). The totals: `[one by one, batched]`.
pub async fn alternate<F, R>(mut round: F) -> [(f64, f64); 2]
where
    F: FnMut(usize, bool) -> R,
    R: std::future::Future<Output = (f64, f64)>,
{
    let mut totals = [(0.0f64, 0.0f64); 2];
    for number in 1..=2 * ROUNDS {
        let batched = number % 2 == 0;
        let (cpu_s, wall_s) = round(number, batched).await;
        let shape = &mut totals[usize::from(batched)];
        shape.0 += cpu_s;
        shape.1 += wall_s;
    }
    totals
}

/// Runs `work` and answers the allocator's CPU seconds and the wall seconds it took.
pub async fn measured(work: impl std::future::Future<Output = ()>) -> (f64, f64) {
    let cpu_before = allot_testkit::threads_cpu_seconds(&ALLOCATOR_THREADS);
    let stopwatch = allot_allocator::clock::Stopwatch::start();
    work.await;
    (
        allot_testkit::threads_cpu_seconds(&ALLOCATOR_THREADS) - cpu_before,
        stopwatch.elapsed().as_secs_f64(),
    )
}

/// Prints the two shapes' figures per unit of work (`unit`: "report", "grant"), `units` of it per
/// shape, beside the one-by-one ceiling (named `ceiling`): a table, and a JSON object per shape.
pub fn print_shapes(
    bench: &str,
    unit: &str,
    ceiling: &str,
    pools: usize,
    units: f64,
    totals: [(f64, f64); 2],
) {
    let per_unit = |(cpu_s, wall_s): (f64, f64)| (cpu_s / units * 1e6, units / wall_s);
    let (one_cpu_us, _) = per_unit(totals[0]);
    println!(
        "{:<30} {:>7} {:>14} {:>12} {:>15}",
        "shape",
        "pools",
        format!("CPU us/{unit}"),
        format!("{unit}s/s"),
        "x one by one"
    );
    let capitalised: String = unit
        .chars()
        .take(1)
        .flat_map(char::to_uppercase)
        .chain(unit.chars().skip(1))
        .collect();
    for (shape, total) in [(ceiling, totals[0]), ("a round in batch calls", totals[1])] {
        let (cpu_us, rate) = per_unit(total);
        let ratio = cpu_us / one_cpu_us;
        println!("{shape:<30} {pools:>7} {cpu_us:>14.1} {rate:>12.0} {ratio:>15.3}");
        let mut line = serde_json::json!({ "bench": bench, "shape": shape, "pools": pools,
                                           "ratioToOneByOne": ratio });
        line[format!("cpuMicrosPer{capitalised}")] = cpu_us.into();
        line[format!("{unit}sPerSecond")] = rate.into();
        println!("{line}");
    }
}

/// An agent's `POST` of `body` to `path` on `base`, and the JSON answer.
pub async fn agent_post(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    client
        .post(format!("{base}{path}"))
        .bearer_auth(AGENT)
        .json(body)
        .send()
        .await
        .expect("the allocator answers")
        .json()
        .await
        .expect("a JSON answer")
}
