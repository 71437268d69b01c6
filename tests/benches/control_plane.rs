//! The control plane at scale: what the allocator, etcd and the wire pay per 1,000 active
//! pool-regions, with traffic and without.
//!
//! One process runs the real allocator (its own runtime, threads named `allocator-0`, on a real
//! etcd with a SQLite ledger), or `PLANE_ALLOCATORS` of them splitting the pools into
//! `PLANE_SHARDS` shards (12 by default when there are several; each on its own runtime,
//! `allocator-<i>`, one SQLite ledger file between them), and three real region agents (`eu`, `us`, `ap`: the shipped agent
//! service, its background loops as the server runs them, an in-process regional store), each
//! holding `PLANE_POOLS` pools (`t000000/api`, ...; one global rule). The agents reach the
//! allocators through a proxy each that counts the bytes both ways (an allocator advertises its
//! proxy, so the shard map points agents there too). Phases:
//! - **first touch**: every pool-region's first admission, `PLANE_TOUCH` (64) pools at a time per
//!   agent, each retried every 100 ms until admitted (the attempts denied are counted);
//! - **light**: every pool gets a request every `PLANE_GAP_MS` (3,000) in every region, spread
//!   evenly, for `PLANE_SECONDS` (60) after a warm-up of one lease TTL;
//! - **lag**: the same traffic while the harness samples, for 32 pool-regions, when each admission
//!   shows in the ledger's reported spend (a separate phase: its polling is not charged to the
//!   allocator's CPU);
//! - **idle**: no traffic, measured for `PLANE_SECONDS` once the leases have ended, their last
//!   reports are in, and the last windows have settled and been checked.
//!
//! For each phase: allocator CPU s/s (its runtime's threads and the SQLite ledger's workers; with
//! several, each allocator's runtime apart too) and
//! etcd CPU s/s, both per 1,000 pool-regions; bytes on the wire per pool-region per minute;
//! renewals (grants) per pool-region per minute from the allocator's own counter; and denials (every pool's quota is far above its traffic, so a denial is one while
//! the pool had tokens), before and after a pool's first admission in the region; and the reports
//! the ledger received per pool-region per minute. Needs `etcd`.
//! Run with `cargo bench -p allot-tests --bench control_plane` (`PLANE_POOLS` for another size).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_allocator::clock::{Clock, SystemClock};
use allot_allocator::http::Tokens;
use allot_allocator::kv::Kv;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::pools::{PoolSpec, put_pools};
use allot_allocator::server::{Settings, run};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{AgentId, DecisionId, PoolId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::Pepper;
use allot_shared::shards::ShardCount;

const REGIONS: [&str; 3] = ["eu", "us", "ap"];
const OPERATOR: &str = "operator-token-for-the-plane-bench";
const AGENT_TOKEN: &str = "agent-token-for-the-plane-bench-01";
/// The pools' terms: a minute's window far above the traffic, 15 s leases.
const WINDOW_MS: u64 = 60_000;
const LEASE_TTL_MS: u64 = 15_000;
/// Threads whose CPU is the allocators': their runtimes (`allocator-<i>`) and the ledger's workers.
const ALLOCATOR_THREADS: [&str; 2] = ["allocator-", "sqlx-sqlite"];
/// Pool-regions whose report lag is sampled.
const LAG_SAMPLES: usize = 32;
/// How often the ledger is polled for the sampled pool-regions, ms.
const LAG_POLL_MS: u64 = 100;

const BUNDLE: &str = r#"{ "rules": [
    { "id": "global-api", "scope": "global", "routeGroup": "read", "pool": "api",
      "failMode": "closed" } ] }"#;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn tenant(n: usize) -> TenantId {
    TenantId::parse(&format!("t{n:06}")).expect("tenant")
}

/// A pool whose report lag is sampled: used in the lag phase only, so all its spend in a window is
/// what the harness saw admitted.
fn sample_tenant(n: usize) -> TenantId {
    TenantId::parse(&format!("s{n:06}")).expect("tenant")
}

/// Pools sampled for report lag (each in every region).
const SAMPLE_POOLS: usize = LAG_SAMPLES.div_ceil(REGIONS.len());

fn region(name: &str) -> RegionId {
    RegionId::parse(name).expect("region")
}

/// Bytes through the proxy, both ways.
static WIRE_BYTES: AtomicU64 = AtomicU64::new(0);

/// A proxy from a loopback port to `upstream`, counting the bytes each way: the agents' calls to
/// the allocator, as a network would carry them (HTTP/1.1 over TCP, no TLS).
async fn counting_proxy(upstream: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind proxy");
    let address = listener.local_addr().expect("proxy address");
    tokio::spawn(async move {
        loop {
            let Ok((inbound, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let Ok(outbound) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (from_agent, to_agent) = inbound.into_split();
                let (from_allocator, to_allocator) = outbound.into_split();
                tokio::join!(
                    counted_copy(from_agent, to_allocator),
                    counted_copy(from_allocator, to_agent)
                );
            });
        }
    });
    address
}

/// Copies `from` to `to` until either closes, counting the bytes as they pass.
async fn counted_copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        WIRE_BYTES.fetch_add(read as u64, Ordering::Relaxed);
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Starts allocator `index` on a runtime of its own over `kv` and a SQLite ledger at `ledger_url`,
/// the pools split into `shards`, advertising a counting proxy in front of it; returns its address
/// and its proxy's once every shard has a known leader.
async fn start_allocator(
    kv: Arc<dyn Kv>,
    ledger_url: String,
    index: usize,
    shards: ShardCount,
) -> (SocketAddr, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let address = listener.local_addr().expect("address");
    let proxy = counting_proxy(address).await;
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("allocator-{index}"))
            .enable_all()
            .build()
            .expect("allocator runtime")
            .block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let tokens = Tokens {
                    operator: vec![OPERATOR.to_owned()],
                    agent: vec![AGENT_TOKEN.to_owned()],
                };
                let settings = Settings {
                    ledger_url: ledger_url.clone(),
                    advertise_url: format!("http://{proxy}"),
                    shards: Some(shards),
                    ..Settings::local(address, tokens, &format!("plane-{index}"))
                };
                let ledger = Ledger::connect(&ledger_url).await.expect("ledger");
                let clock: Arc<dyn Clock> = Arc::new(SystemClock);
                run(
                    settings,
                    kv,
                    ledger,
                    clock,
                    listener,
                    std::future::pending(),
                )
                .await
                .expect("the allocator ran");
            });
    });
    let client = reqwest::Client::new();
    for _ in 0..1_000 {
        let ready = client
            .get(format!("http://{address}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return (address, proxy);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the allocator did not lead within 20 s");
}

/// Waits until each of `allocators` leads its share of `shards` (at least `shards / n`).
async fn wait_for_balanced_shards(allocators: &[SocketAddr], shards: ShardCount) {
    let client = reqwest::Client::new();
    let share = shards.get() as usize / allocators.len();
    for _ in 0..600 {
        let map = client
            .get(format!("http://{}/v1/shards", allocators[0]))
            .bearer_auth(AGENT_TOKEN)
            .send()
            .await;
        if let Ok(response) = map
            && let Ok(map) = response.json::<allot_shared::wire::ShardMap>().await
        {
            let led_by = map.led_by();
            let led = |index: usize| {
                led_by
                    .get(format!("plane-{index}").as_str())
                    .copied()
                    .unwrap_or(0)
            };
            if (0..allocators.len()).all(|index| led(index) >= share) {
                let coordinator = map.shards[0].leader.as_ref().map(|l| l.node_id.clone());
                let counts: Vec<String> = (0..allocators.len())
                    .map(|index| format!("plane-{index} leads {}", led(index)))
                    .collect();
                println!(
                    "shards: {}; shard 0 (the store's once-a-round duties): {}",
                    counts.join(", "),
                    coordinator.unwrap_or_default()
                );
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the shards did not spread over the allocators within a minute");
}

/// One region's agent, its background loops running until the process ends.
async fn start_agent(name: &str, allocators: &[SocketAddr], pools: usize) -> Arc<Agent> {
    let clock = Arc::new(allot_region_agent::clock::SystemClock);
    let store = InProcessStore::new(clock.clone(), 4 * pools + 1_024);
    let limiter = Limiter::new(Arc::new(store), LimiterConfig::default()).expect("limiter");
    let urls = allocators.iter().map(|a| format!("http://{a}")).collect();
    let client = AllocatorClient::new(urls, AGENT_TOKEN.to_owned()).expect("client");
    let settings = AgentSettings {
        max_pools: pools + 16,
        ..AgentSettings::new(
            region(name),
            AgentId::parse(&format!("{name}-plane")).expect("agent id"),
            Pepper::new(b"plane-bench-pepper-0123456789abcdef".to_vec()).expect("pepper"),
        )
    };
    let agent = Agent::new(settings, clock, limiter, Some(Arc::new(client)), None);
    agent.refresh_policy().await;
    tokio::spawn(agent.clone().run_background(
        allot_region_agent::server::REPORT_EVERY,
        allot_region_agent::server::POLICY_EVERY,
        std::future::pending(),
    ));
    agent
}

/// Admissions of sampled pool-regions: (pool, region index) -> (window start, admission time),
/// epoch ms, in order.
type Sampled = HashMap<(usize, usize), Vec<(u64, u64)>>;

/// What the traffic saw.
#[derive(Default)]
struct Seen {
    allowed: AtomicU64,
    /// Denials before, and after, the pool-region's first admission.
    denied_before_first: AtomicU64,
    denied_after_first: AtomicU64,
    /// Denials after the first admission by reason, and whether in a window's first 5 s (when
    /// every lease of the last window has ended), its last second (when leases clamped to its end
    /// may no longer be spent), or between.
    denial_kinds: Mutex<std::collections::BTreeMap<String, u64>>,
    /// Pool-regions admitted at least once (by index: pool * 3 + region).
    admitted_once: Mutex<Vec<bool>>,
    /// Sampled pool-regions' admissions.
    sampled: Mutex<Sampled>,
}

fn request(n: u64, tenant_id: TenantId) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("p-{n}")).expect("id"),
        tenant_id,
        principal: Principal {
            kind: PrincipalType::User,
            id: "plane-user".to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

/// Sends every pool (`pools` of them, named by `tenant_of`) a request every `gap_ms` in every
/// region, spread evenly, for `seconds`; with `sample`, notes every admission's time.
async fn traffic(
    agents: &[Arc<Agent>],
    (pools, tenant_of): (usize, fn(usize) -> TenantId),
    gap_ms: u64,
    seconds: u64,
    seen: &Arc<Seen>,
    sample: bool,
) {
    const TICK_MS: u64 = 50;
    let per_tick = pools as f64 * TICK_MS as f64 / gap_ms as f64;
    let mut ticks = tokio::time::interval(Duration::from_millis(TICK_MS));
    let mut carry = 0.0f64;
    let mut next_pool = 0usize;
    static REQUESTS: AtomicU64 = AtomicU64::new(0);
    for _ in 0..seconds * 1_000 / TICK_MS {
        ticks.tick().await;
        carry += per_tick;
        let due = carry as usize;
        carry -= due as f64;
        for _ in 0..due {
            let pool = next_pool;
            next_pool = (next_pool + 1) % pools;
            for (index, agent) in agents.iter().enumerate() {
                let agent = agent.clone();
                let seen = seen.clone();
                let n = REQUESTS.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let Ok(decision) = agent.admit(&request(n, tenant_of(pool))).await else {
                        return;
                    };
                    let slot = pool * REGIONS.len() + index;
                    if decision.allowed {
                        seen.allowed.fetch_add(1, Ordering::Relaxed);
                        lock(&seen.admitted_once)[slot] = true;
                        if sample {
                            let now_ms = SystemClock.now_ms();
                            lock(&seen.sampled)
                                .entry((pool, index))
                                .or_default()
                                .push((now_ms - now_ms % WINDOW_MS, now_ms));
                        }
                    } else if lock(&seen.admitted_once)[slot] {
                        seen.denied_after_first.fetch_add(1, Ordering::Relaxed);
                        let into_window_ms = SystemClock.now_ms() % WINDOW_MS;
                        let when = if into_window_ms < 5_000 {
                            "in a window's first 5 s"
                        } else if into_window_ms >= WINDOW_MS - 1_000 {
                            "in a window's last second"
                        } else {
                            "between"
                        };
                        *lock(&seen.denial_kinds)
                            .entry(format!("{:?}, {when}", decision.reason))
                            .or_default() += 1;
                    } else {
                        seen.denied_before_first.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        }
    }
}

/// Admits one request for every pool in every region, at most `concurrency` at a time per agent,
/// retrying a pool until admitted: every pool's terms and first lease, without the storm of every
/// pool's first request at once (what that storm does is measured apart: the denials before a
/// pool's first admission).
async fn first_touch(agents: &[Arc<Agent>], pools: usize, concurrency: usize) -> u64 {
    let denied = Arc::new(AtomicU64::new(0));
    let mut all = tokio::task::JoinSet::new();
    for agent in agents {
        let agent = agent.clone();
        let denied = denied.clone();
        all.spawn(async move {
            let permits = Arc::new(tokio::sync::Semaphore::new(concurrency));
            let mut touches = tokio::task::JoinSet::new();
            for pool in 0..pools {
                let permit = permits.clone().acquire_owned().await.expect("permits");
                let agent = agent.clone();
                let denied = denied.clone();
                touches.spawn(async move {
                    for attempt in 0..50u64 {
                        let n = u64::MAX / 2 + (pool as u64) * 64 + attempt;
                        let admitted = agent
                            .admit(&request(n, tenant(pool)))
                            .await
                            .is_ok_and(|d| d.allowed);
                        if admitted {
                            break;
                        }
                        denied.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    drop(permit);
                });
            }
            while touches.join_next().await.is_some() {}
        });
    }
    while all.join_next().await.is_some() {}
    denied.load(Ordering::Relaxed)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The allocators' counter `name`, summed over its label sets. The allocators of this process
/// share one metrics recorder (metrics are process-wide), so any one's page counts for all.
async fn counter(client: &reqwest::Client, allocators: &[SocketAddr], name: &str) -> f64 {
    counter_of(client, allocators[0], name).await
}

/// One allocator's counter `name` (summed over its label sets) from its metrics page.
async fn counter_of(client: &reqwest::Client, allocator: SocketAddr, name: &str) -> f64 {
    let mut page = None;
    for _ in 0..5 {
        let fetched = client
            .get(format!("http://{allocator}/metrics"))
            .send()
            .await;
        if let Ok(response) = fetched
            && let Ok(text) = response.text().await
        {
            page = Some(text);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let page = page.expect("the allocator's metrics page");
    page.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What one phase measured.
struct Phase {
    name: &'static str,
    seconds: f64,
    allocator_cpu_s: f64,
    /// Each allocator's runtime alone (without the ledger's workers, which they share).
    runtime_cpu_s: Vec<f64>,
    /// Of which the SQLite ledger's worker threads.
    ledger_cpu_s: f64,
    etcd_cpu_s: f64,
    wire_bytes: f64,
    grants: f64,
    /// Ledger rounds that read the store's grant records.
    reconciliations: f64,
    /// When the phase ran, epoch ms (its reports are counted from the ledger afterwards).
    from_ms: u64,
    to_ms: u64,
    reports: f64,
}

impl Phase {
    fn print(&self, pool_regions: f64) {
        let per_thousand = pool_regions / 1_000.0;
        let minutes = self.seconds / 60.0;
        let allocator = self.allocator_cpu_s / self.seconds / per_thousand;
        let etcd = self.etcd_cpu_s / self.seconds / per_thousand;
        let bytes = self.wire_bytes / pool_regions / minutes;
        let renewals = self.grants / pool_regions / minutes;
        let reports = self.reports / pool_regions / minutes;
        println!(
            "{:<6} {:>10.0} {:>12.5} {:>12.5} {:>14.0} {:>12.2} {:>12.2}",
            self.name, pool_regions, allocator, etcd, bytes, renewals, reports
        );
        let runtimes: Vec<f64> = self
            .runtime_cpu_s
            .iter()
            .map(|cpu_s| cpu_s / self.seconds / per_thousand)
            .collect();
        if runtimes.len() > 1 {
            let shown: Vec<String> = runtimes.iter().map(|r| format!("{r:.5}")).collect();
            println!(
                "       each allocator's runtime, s/s per 1,000 pool-regions: {} (the ledger's workers apart)",
                shown.join(", ")
            );
        }
        println!(
            "{}",
            serde_json::json!({ "bench": "control_plane", "phase": self.name,
                "runtimeCpuPerThousand": runtimes,
                "poolRegions": pool_regions, "allocatorCpuPerThousand": allocator,
                "etcdCpuPerThousand": etcd,
                "ledgerShareOfAllocatorCpu": self.ledger_cpu_s / self.allocator_cpu_s.max(1e-9), "wireBytesPerPoolRegionMinute": bytes,
                "renewalsPerPoolRegionMinute": renewals,
                "reportsPerPoolRegionMinute": reports,
                "ledgerReconciliations": self.reconciliations })
        );
    }
}

/// Measures `work` as one phase.
async fn measure(
    name: &'static str,
    etcd: &allot_testkit::EtcdCluster,
    client: &reqwest::Client,
    allocators: &[SocketAddr],
    work: impl Future<Output = ()>,
) -> Phase {
    let runtime = |index: usize| format!("allocator-{index}");
    let runtimes_now = || -> Vec<f64> {
        (0..allocators.len())
            .map(|index| allot_testkit::threads_cpu_seconds(&[&runtime(index)]))
            .collect()
    };
    let runtimes_before = runtimes_now();
    let grants_before = counter(client, allocators, "allot_grants_total").await;
    let reconciliations_before =
        counter(client, allocators, "allot_ledger_reconciliations_total").await;
    let from_ms = SystemClock.now_ms();
    let cpu_before = allot_testkit::threads_cpu_seconds(&ALLOCATOR_THREADS);
    let ledger_before = allot_testkit::threads_cpu_seconds(&["sqlx-sqlite"]);
    let etcd_before = etcd.member_cpu_seconds(0);
    let bytes_before = WIRE_BYTES.load(Ordering::Relaxed);
    let stopwatch = allot_allocator::clock::Stopwatch::start();
    work.await;
    let seconds = stopwatch.elapsed().as_secs_f64();
    let allocator_cpu_s = allot_testkit::threads_cpu_seconds(&ALLOCATOR_THREADS) - cpu_before;
    let runtime_cpu_s = runtimes_now()
        .into_iter()
        .zip(runtimes_before)
        .map(|(after, before)| after - before)
        .collect();
    let ledger_cpu_s = allot_testkit::threads_cpu_seconds(&["sqlx-sqlite"]) - ledger_before;
    let etcd_cpu_s = etcd.member_cpu_seconds(0) - etcd_before;
    let wire_bytes = (WIRE_BYTES.load(Ordering::Relaxed) - bytes_before) as f64;
    let to_ms = SystemClock.now_ms();
    Phase {
        name,
        seconds,
        allocator_cpu_s,
        runtime_cpu_s,
        ledger_cpu_s,
        etcd_cpu_s,
        wire_bytes,
        grants: counter(client, allocators, "allot_grants_total").await - grants_before,
        reconciliations: counter(client, allocators, "allot_ledger_reconciliations_total").await
            - reconciliations_before,
        from_ms,
        to_ms,
        reports: 0.0,
    }
}

/// The reported spend of `tenant`'s pool in `region`'s window starting at `window_start_ms`, as
/// the ledger holds it.
async fn ledger_spend(
    ledger: &sqlx::SqlitePool,
    tenant: &TenantId,
    region: &str,
    window_start_ms: u64,
) -> u64 {
    let spent: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(s.spent), 0) FROM lease_spend s JOIN grants g ON g.lease_id = s.lease_id \
         WHERE g.tenant = ? AND g.pool = 'api' AND g.region = ? AND g.window_start_ms = ?",
    )
    .bind(tenant.as_str())
    .bind(region)
    .bind(i64::try_from(window_start_ms).unwrap_or(i64::MAX))
    .fetch_one(ledger)
    .await
    .unwrap_or(0);
    u64::try_from(spent).unwrap_or(0)
}

/// Polls the ledger for the sampled pool-regions while `seen` fills, and answers each admission's
/// lag to the ledger, ms: from its admission to the first poll whose reported spend covers it (or
/// the lag it had reached, for one never shown).
async fn sample_lag(ledger_url: &str, seen: &Arc<Seen>, until: Duration) -> Vec<u64> {
    let ledger = sqlx::SqlitePool::connect(ledger_url)
        .await
        .expect("the ledger, read");
    let stopwatch = allot_allocator::clock::Stopwatch::start();
    // (pool, region) -> admissions already matched to a poll.
    let mut matched: HashMap<(usize, usize), usize> = HashMap::new();
    let mut lags = Vec::new();
    while stopwatch.elapsed() < until {
        tokio::time::sleep(Duration::from_millis(LAG_POLL_MS)).await;
        let sampled = lock(&seen.sampled).clone();
        let now_ms = SystemClock.now_ms();
        for ((pool, region_index), admissions) in sampled {
            let done = matched.entry((pool, region_index)).or_default();
            let Some(&(window_start_ms, _)) = admissions.get(*done) else {
                continue;
            };
            let spent = ledger_spend(
                &ledger,
                &sample_tenant(pool),
                REGIONS[region_index],
                window_start_ms,
            )
            .await;
            // The window's admissions are one run, in order: the k-th of it is in the ledger once
            // the reported spend reaches k.
            let first_in_window = admissions
                .iter()
                .position(|(start, _)| *start == window_start_ms)
                .unwrap_or(0);
            // A window over for 10 s with admissions the ledger never showed: their lag is at
            // least this long, and is counted so (never dropped, which would flatter the p99).
            let window_over = window_start_ms + WINDOW_MS + 10_000 < now_ms;
            while let Some(&(start_ms, admitted_at_ms)) = admissions.get(*done) {
                let rank = *done - first_in_window + 1;
                if start_ms != window_start_ms || (spent < rank as u64 && !window_over) {
                    break;
                }
                lags.push(now_ms.saturating_sub(admitted_at_ms));
                *done += 1;
            }
        }
    }
    ledger.close().await;
    // Admissions still not shown when sampling ends (5 s after the traffic): counted at the lag
    // they have reached, a lower bound.
    let end_ms = SystemClock.now_ms();
    for (key, admissions) in lock(&seen.sampled).iter() {
        let done = matched.get(key).copied().unwrap_or(0);
        lags.extend(
            admissions
                .iter()
                .skip(done)
                .map(|(_, admitted_at_ms)| end_ms.saturating_sub(*admitted_at_ms)),
        );
    }
    lags.sort_unstable();
    lags
}

/// Counts the reports the ledger received during each phase (read after every phase is
/// measured: this read's threads are not the allocator's, but share their name).
async fn count_reports(ledger_url: &str, phases: &mut [&mut Phase]) {
    let ledger = sqlx::SqlitePool::connect(ledger_url)
        .await
        .expect("the ledger, read");
    for phase in phases.iter_mut() {
        let count: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM lease_reports WHERE received_at_ms >= ? AND received_at_ms < ?",
        )
        .bind(i64::try_from(phase.from_ms).unwrap_or(i64::MAX))
        .bind(i64::try_from(phase.to_ms).unwrap_or(i64::MAX))
        .fetch_one(&ledger)
        .await
        .expect("reports counted");
        phase.reports = count as f64;
    }
    ledger.close().await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pools = usize::try_from(env_or("PLANE_POOLS", 1_000)).unwrap_or(1_000);
    let gap_ms = env_or("PLANE_GAP_MS", 3_000);
    let seconds = env_or("PLANE_SECONDS", 60);
    let pool_regions = (pools * REGIONS.len()) as f64;

    let etcd = allot_testkit::EtcdCluster::single();
    let kv: Arc<dyn Kv> = Arc::new(EtcdKv::connect(&etcd.endpoints()).await.expect("etcd"));
    let spec = PoolSpec {
        limit_tokens: 1_000_000,
        window_ms: WINDOW_MS,
        window: None,
        chunk_tokens: 1_000,
        lease_ttl_ms: LEASE_TTL_MS,
        fallback_per_region_tokens: 0,
        settle_debt_per_region_tokens: 0,
        regions: REGIONS.iter().map(|r| region(r)).collect(),
    };
    let pool = PoolId::parse("api").expect("pool");
    let all: Vec<_> = (0..pools)
        .map(tenant)
        .chain((0..SAMPLE_POOLS).map(sample_tenant))
        .map(|tenant| (tenant, pool.clone(), spec.clone()))
        .collect();
    for chunk in all.chunks(1_000) {
        put_pools(&*kv, chunk, SystemClock.now_ms())
            .await
            .expect("pools");
    }
    let draft = allot_shared::policy::parse_bundle(BUNDLE).expect("bundle");
    allot_allocator::policies::publish(
        &*kv,
        draft,
        allot_shared::window::rfc3339_utc(SystemClock.now_ms()),
        None,
    )
    .await
    .expect("published");

    let dir = tempfile::tempdir().expect("temp dir");
    let ledger_url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let allocator_count = usize::try_from(env_or("PLANE_ALLOCATORS", 1))
        .unwrap_or(1)
        .max(1);
    let default_shards = if allocator_count == 1 { 1 } else { 12 };
    let shards = u32::try_from(env_or("PLANE_SHARDS", default_shards))
        .ok()
        .and_then(|count| ShardCount::new(count).ok())
        .expect("PLANE_SHARDS in [1, 256]");
    let mut allocators = Vec::new();
    let mut proxies = Vec::new();
    for index in 0..allocator_count {
        let (allocator, proxy) =
            start_allocator(kv.clone(), ledger_url.clone(), index, shards).await;
        allocators.push(allocator);
        proxies.push(proxy);
    }
    wait_for_balanced_shards(&allocators, shards).await;
    let mut agents = Vec::new();
    for name in REGIONS {
        agents.push(start_agent(name, &proxies, pools + SAMPLE_POOLS).await);
    }
    // A connection per read: a pooled one may be closed by the server while idle.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let seen = Arc::new(Seen {
        admitted_once: Mutex::new(vec![false; pools * REGIONS.len()]),
        ..Seen::default()
    });
    println!(
        "control plane: {pools} pools x {} regions, a request every {gap_ms} ms per pool-region; \
         {allocator_count} allocator(s), {} shard(s)",
        REGIONS.len(),
        shards.get()
    );

    // Warm-up: every pool's terms and first lease, `PLANE_TOUCH` pools at a time per agent, then
    // one lease TTL of renewals.
    let touch = allot_allocator::clock::Stopwatch::start();
    let touch_concurrency = usize::try_from(env_or("PLANE_TOUCH", 64)).unwrap_or(64);
    let touch_denied = first_touch(&agents, pools, touch_concurrency.max(1)).await;
    println!(
        "first touch of every pool-region, {touch_concurrency} at a time per agent: {:.1} s, \
         {touch_denied} attempts denied (retried 100 ms later)",
        touch.elapsed().as_secs_f64()
    );
    let every_pool = (pools, tenant as fn(usize) -> TenantId);
    let warm_up_s = LEASE_TTL_MS / 1_000 + 5;
    traffic(&agents, every_pool, gap_ms, warm_up_s, &seen, false).await;
    let light = measure("light", &etcd, &client, &allocators, async {
        traffic(&agents, every_pool, gap_ms, seconds, &seen, false).await;
    })
    .await;
    let denied_light = seen.denied_after_first.load(Ordering::Relaxed);
    let lag_seconds = 30;
    let sampled = Arc::new(Seen {
        admitted_once: Mutex::new(vec![false; SAMPLE_POOLS * REGIONS.len()]),
        ..Seen::default()
    });
    let sample_pools = (SAMPLE_POOLS, sample_tenant as fn(usize) -> TenantId);
    let (_, _, lags) = tokio::join!(
        traffic(&agents, every_pool, gap_ms, lag_seconds, &seen, false),
        traffic(&agents, sample_pools, gap_ms, lag_seconds, &sampled, true),
        sample_lag(&ledger_url, &sampled, Duration::from_secs(lag_seconds + 5)),
    );
    // Leases end (one TTL), their last reports go in, the agents settle; the last windows end,
    // settle and are checked by a ledger round (two rounds of 30 s): from then on nothing is owed
    // anywhere, and what the control plane spends is what idling costs.
    tokio::time::sleep(Duration::from_millis(LEASE_TTL_MS + WINDOW_MS + 70_000)).await;
    let mut idle = measure("idle", &etcd, &client, &allocators, async {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
    })
    .await;
    let mut light = light;
    count_reports(&ledger_url, &mut [&mut light, &mut idle]).await;

    println!(
        "{:<6} {:>10} {:>12} {:>12} {:>14} {:>12} {:>12}",
        "phase",
        "pool-reg.",
        "alloc s/s/k",
        "etcd s/s/k",
        "B/pool-reg/min",
        "renew/min",
        "reports/min"
    );
    light.print(pool_regions);
    idle.print(pool_regions);
    let p99 = lags
        .get((lags.len() * 99 / 100).min(lags.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0);
    let p50 = lags.get(lags.len() / 2).copied().unwrap_or(0);
    println!(
        "report lag to the ledger: p50 {p50} ms, p99 {p99} ms over {} admissions",
        lags.len()
    );
    println!(
        "admitted {}, denied after a pool-region's first admission {} (during light: {denied_light}), before it {}",
        seen.allowed.load(Ordering::Relaxed),
        seen.denied_after_first.load(Ordering::Relaxed),
        seen.denied_before_first.load(Ordering::Relaxed),
    );
    for (kind, count) in lock(&seen.denial_kinds).iter() {
        println!("  denied after the first admission: {count} {kind}");
    }
    println!(
        "{}",
        serde_json::json!({ "bench": "control_plane", "pools": pools,
            "reportLagP50Ms": p50, "reportLagP99Ms": p99, "lagSamples": lags.len(),
            "deniedAfterFirst": seen.denied_after_first.load(Ordering::Relaxed),
            "deniedBeforeFirst": seen.denied_before_first.load(Ordering::Relaxed) })
    );
    std::process::exit(0);
}
