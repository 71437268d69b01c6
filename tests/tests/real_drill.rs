//! The real-process partition drill: a 3-member etcd cluster, a Redis per region, two allocator
//! processes on a shared PostgreSQL ledger, and two region-agent processes, each reaching the
//! allocators through fault proxies of ours. A load generator drives both agents' HTTP API and counts
//! every admit itself while faults are injected for real:
//!
//! 1. EU is cut off from both allocators for longer than a lease TTL (it spends its leases, then its
//!    fallback allowance);
//! 2. the leading allocator is killed (SIGKILL) and the other takes over;
//! 3. the etcd leader is stopped (the cluster keeps its quorum);
//! 4. US's Redis is stopped and restarted (regional rules run on their local buckets meanwhile).
//!
//! Then, once every lease has ended and been reported, the ledger must account for exactly the
//! admits the load generator saw, every window must be within its bound (G + fallback allowances),
//! EU must have admitted in fallback, no process may have panicked, and no raw user id, API key id,
//! client address or token may appear in any process's log or in the agents' metrics.
//!
//! Short form (about 40 s of load) in the test suite; `ALLOT_REAL_DRILL_SCALE=10` stretches every
//! phase tenfold (`simulations/real-drill` runs it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_testkit::{EtcdCluster, FaultProxy, ProxyMode, RedisServer, workspace_binary};
use serde_json::{Value, json};

const OPERATOR: &str = "operator-token-real-drill-01";
/// Agent tokens, each scoped to its region in the allocators' token file.
const AGENT_EU: &str = "agent-eu-token-real-drill-01";
const AGENT_US: &str = "agent-us-token-real-drill-01";
const GATEWAY: &str = "gateway-token-real-drill-01";
/// G per window, and the pool's other terms: short windows, so a short run spans several.
const LIMIT: u64 = 400;
const WINDOW_MS: u64 = 10_000;
const FALLBACK_PER_REGION: u64 = 30;
const LEASE_TTL_MS: u64 = 3_000;

/// A process of ours, killed on drop.
struct Process {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn spawn(dir: &Path, name: &str, program: PathBuf, args: &[String]) -> Process {
    let log = dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).expect("log file");
    let child = Command::new(&program)
        .args(args)
        .env("ALLOT_LOG", "info")
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log file"))
        .stderr(file)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    Process {
        name: name.to_owned(),
        child,
        log,
    }
}

/// A fresh database on the test PostgreSQL server (dropped by the OS-level cleanup of the server's
/// test databases is not assumed: the drill drops it at the end).
async fn create_database() -> (String, String) {
    let server = std::env::var("ALLOT_TEST_POSTGRES_URL")
        .expect("ALLOT_TEST_POSTGRES_URL must name a PostgreSQL server (scripts/test sets it)");
    let server = server.trim_end_matches('/').to_owned();
    let name = format!("allot_real_drill_{}", std::process::id());
    let admin = format!("{server}/postgres");
    psql(&admin, &format!("DROP DATABASE IF EXISTS {name}")).await;
    psql(&admin, &format!("CREATE DATABASE {name}")).await;
    (format!("{server}/{name}"), name)
}

async fn psql(url: &str, statement: &str) {
    use sqlx::Connection;
    let mut connection = sqlx::PgConnection::connect(url)
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(statement)
        .execute(&mut connection)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client")
}

async fn wait_until(what: &str, seconds: u64, mut check: impl AsyncFnMut() -> bool) {
    for _ in 0..seconds * 20 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out after {seconds} s waiting until {what}");
}

async fn role(client: &reqwest::Client, url: &str) -> Option<String> {
    let response = client.get(format!("{url}/readyz")).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

/// The raw identities the load uses: none may ever appear in a log line or a metric label.
fn raw_user(n: u64) -> String {
    format!("user-rawid-{:04}", n % 20)
}

fn raw_api_key(n: u64) -> String {
    format!("key-rawsecret-{:04}", n % 7)
}

fn raw_address(n: u64) -> String {
    format!("203.0.113.{}", n % 50)
}

/// What the load generator saw, per region.
#[derive(Default)]
struct Counts {
    allowed: AtomicU64,
    fallback: AtomicU64,
    denied: AtomicU64,
    /// Sent, but no decision came back (an admit the ledger may hold that we cannot count).
    failed: AtomicU64,
    /// Not sent: 32 requests were already in flight (the generator does not queue).
    skipped: AtomicU64,
}

/// Sends `per_second` admits to `agent` until `stop`, counting outcomes.
async fn drive(
    client: reqwest::Client,
    agent: String,
    per_second: u64,
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
) {
    let mut ticks = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
    let permits = Arc::new(tokio::sync::Semaphore::new(32));
    let mut n = 0u64;
    let mut tasks = tokio::task::JoinSet::new();
    while !stop.load(Ordering::SeqCst) {
        ticks.tick().await;
        n += 1;
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            counts.skipped.fetch_add(1, Ordering::SeqCst);
            continue;
        };
        let (client, agent, counts) = (client.clone(), agent.clone(), counts.clone());
        tasks.spawn(async move {
            let _permit = permit;
            // Every tenth caller is not signed in yet: an `ip` principal.
            let principal = if n.is_multiple_of(10) {
                json!({ "type": "ip", "id": raw_address(n) })
            } else {
                json!({ "type": "user", "id": raw_user(n), "apiKeyId": raw_api_key(n) })
            };
            let body = json!({ "requestId": format!("d-{n}"), "tenantId": "drill",
                "principal": principal, "routeGroup": "read", "method": "GET" });
            let answer = client
                .post(format!("{agent}/v1/admit"))
                .bearer_auth(GATEWAY)
                .json(&body)
                .send()
                .await;
            let decision: Option<Value> = match answer {
                Ok(response) if response.status().is_success() => response.json().await.ok(),
                _ => None,
            };
            match decision {
                Some(d) if d["allowed"] == true => {
                    counts.allowed.fetch_add(1, Ordering::SeqCst);
                    if d["fallback"] == true {
                        counts.fallback.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Some(_) => {
                    counts.denied.fetch_add(1, Ordering::SeqCst);
                }
                None => {
                    counts.failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_processes_through_partitions_failovers_and_restarts_stay_within_the_bound() {
    let scale: u64 = std::env::var("ALLOT_REAL_DRILL_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .clamp(1, 100);
    let phase = |seconds: u64| Duration::from_secs(seconds * scale);
    let allocator_bin = workspace_binary("allocator");
    let agent_bin = workspace_binary("region-agent");
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    let mut etcd = EtcdCluster::start(3);
    let (eu_redis, mut us_redis) = (RedisServer::start(), RedisServer::start());
    let (ledger_url, database) = create_database().await;
    let agent_tokens = format!("eu {AGENT_EU}\nus {AGENT_US}\n");
    for (file, token) in [
        ("operator.tokens", OPERATOR),
        ("agent.tokens", agent_tokens.as_str()),
        ("gateway.tokens", GATEWAY),
        ("pepper", "a-pepper-for-the-real-drill-0123456789"),
    ] {
        std::fs::write(d.join(file), token).expect("secret file");
    }
    let bundle = json!({ "rules": [
        { "id": "global-read", "scope": "global", "routeGroup": "read", "pool": "api",
          "failMode": "closed" },
        { "id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
          "capacityMillis": 1000000, "refillMillis": 100000, "periodMs": 1000,
          "failMode": "local_bounded", "localCapacityMillis": 1000000,
          "localRefillMillis": 100000 } ] });
    std::fs::write(d.join("bundle.json"), bundle.to_string()).expect("bundle");
    let path = |name: &str| d.join(name).display().to_string();

    // Two allocators on the etcd cluster and one ledger.
    let mut allocators = Vec::new();
    for name in ["alloc-a", "alloc-b"] {
        let port = free_port();
        let url = format!("http://127.0.0.1:{port}");
        let args: Vec<String> = vec![
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--etcd".into(),
            etcd.endpoints().join(","),
            "--node-id".into(),
            name.into(),
            "--advertise-url".into(),
            url.clone(),
            "--leader-lease-ttl-s".into(),
            "2".into(),
            "--ledger".into(),
            ledger_url.clone(),
            "--data-dir".into(),
            path(name),
            "--operator-token-file".into(),
            path("operator.tokens"),
            "--agent-token-file".into(),
            path("agent.tokens"),
        ];
        allocators.push((spawn(d, name, allocator_bin.clone(), &args), url, port));
    }
    let client = http();
    wait_until("an allocator leads", 30, async || {
        for (_, url, _) in &allocators {
            if role(&client, url)
                .await
                .is_some_and(|r| r.starts_with("leader"))
            {
                return true;
            }
        }
        false
    })
    .await;
    let leader_url = {
        let mut found = None;
        for (_, url, _) in &allocators {
            if role(&client, url)
                .await
                .is_some_and(|r| r.starts_with("leader"))
            {
                found = Some(url.clone());
            }
        }
        found.expect("a leader")
    };
    let pool = json!({ "limit": LIMIT, "windowMs": WINDOW_MS, "chunk": 40,
        "leaseTtlMs": LEASE_TTL_MS, "fallbackPerRegion": FALLBACK_PER_REGION,
        "regions": ["eu", "us"] });
    let put = client
        .put(format!("{leader_url}/v1/pools/drill/api"))
        .bearer_auth(OPERATOR)
        .json(&pool)
        .send()
        .await
        .expect("put pool");
    assert_eq!(
        put.status(),
        200,
        "{}",
        put.text().await.unwrap_or_default()
    );

    // Two agents, each reaching both allocators through its own proxies.
    let mut proxies: BTreeMap<&str, Vec<FaultProxy>> = BTreeMap::new();
    let mut agents = Vec::new();
    for (region, redis) in [("eu", &eu_redis), ("us", &us_redis)] {
        let region_proxies: Vec<FaultProxy> = allocators
            .iter()
            .map(|(_, _, port)| {
                FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], *port)))
            })
            .collect();
        let (port, grpc_port) = (free_port(), free_port());
        let args: Vec<String> = vec![
            "--region".into(),
            region.into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--grpc-listen".into(),
            format!("127.0.0.1:{grpc_port}"),
            "--allocator".into(),
            region_proxies
                .iter()
                .map(FaultProxy::url)
                .collect::<Vec<_>>()
                .join(","),
            "--agent-token-file".into(),
            path("agent.tokens"),
            "--gateway-token-file".into(),
            path("gateway.tokens"),
            "--pepper-file".into(),
            path("pepper"),
            "--redis".into(),
            redis.url(),
            "--policy-file".into(),
            path("bundle.json"),
        ];
        let name = format!("agent-{region}");
        agents.push((
            spawn(d, &name, agent_bin.clone(), &args),
            format!("http://127.0.0.1:{port}"),
        ));
        proxies.insert(region, region_proxies);
    }
    for (_, url) in &agents {
        wait_until("the agent is ready", 30, async || {
            client
                .get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
    }

    // Load: 45 admits/s at EU, 5 at US (1.25 x G per window), counted by us.
    let stop = Arc::new(AtomicBool::new(false));
    let (eu_counts, us_counts) = (Arc::new(Counts::default()), Arc::new(Counts::default()));
    let load = [
        tokio::spawn(drive(
            client.clone(),
            agents[0].1.clone(),
            45,
            eu_counts.clone(),
            stop.clone(),
        )),
        tokio::spawn(drive(
            client.clone(),
            agents[1].1.clone(),
            5,
            us_counts.clone(),
            stop.clone(),
        )),
    ];

    tokio::time::sleep(phase(6)).await;
    // 1. EU cut off from both allocators for 8 s (leases last 3 s: then fallback).
    for proxy in &proxies["eu"] {
        proxy.set_mode(ProxyMode::Refuse);
    }
    tokio::time::sleep(phase(8)).await;
    for proxy in &proxies["eu"] {
        proxy.set_mode(ProxyMode::Pass);
    }
    tokio::time::sleep(phase(4)).await;
    // 2. The leading allocator dies without a goodbye.
    let allowed_before_kill = eu_counts.allowed.load(Ordering::SeqCst);
    let leader_index = allocators
        .iter()
        .position(|(_, url, _)| *url == leader_url)
        .expect("the leader is one of ours");
    allocators[leader_index].0.kill();
    let survivor = allocators[1 - leader_index].1.clone();
    wait_until("the other allocator leads", 30, async || {
        role(&client, &survivor)
            .await
            .is_some_and(|r| r.starts_with("leader"))
    })
    .await;
    tokio::time::sleep(phase(4)).await;
    // 3. The etcd leader stops; two members keep the quorum.
    let etcd_leader = etcd.leader_index();
    etcd.stop_member(etcd_leader);
    tokio::time::sleep(phase(4)).await;
    // 4. US's Redis restarts.
    us_redis.stop();
    tokio::time::sleep(phase(2)).await;
    us_redis.restart();
    tokio::time::sleep(phase(6)).await;
    stop.store(true, Ordering::SeqCst);
    for task in load {
        task.await.expect("load generator");
    }
    let allowed_after_kill = eu_counts.allowed.load(Ordering::SeqCst) - allowed_before_kill;
    let counted =
        eu_counts.allowed.load(Ordering::SeqCst) + us_counts.allowed.load(Ordering::SeqCst);
    let eu_fallback = eu_counts.fallback.load(Ordering::SeqCst);
    // US may fall back too, briefly, while the surviving allocator takes over.
    let counted_fallback = eu_fallback + us_counts.fallback.load(Ordering::SeqCst);

    // Every lease ends within a TTL and is reported within a second: the ledger then holds every
    // admit the load generator saw, no more, no less.
    let mut windows: Vec<Value> = Vec::new();
    let mut ledger_admitted = 0;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(response) = client
            .get(format!("{survivor}/v1/pools/drill/api/windows?last=100"))
            .bearer_auth(OPERATOR)
            .send()
            .await
        else {
            continue;
        };
        let Ok(body) = response.json::<Value>().await else {
            continue;
        };
        windows = body["windows"].as_array().cloned().unwrap_or_default();
        ledger_admitted = windows
            .iter()
            .map(|w| w["admitted"].as_u64().unwrap_or(0))
            .sum::<u64>();
        let unreported: u64 = windows
            .iter()
            .map(|w| w["unreported"].as_u64().unwrap_or(0))
            .sum();
        if ledger_admitted == counted && unreported == 0 {
            break;
        }
    }
    let summary = format!(
        "load generator: EU allowed {} (fallback {}), denied {}, failed {}; US allowed {} (fallback {}), denied {}, failed {}; ledger windows: {}",
        eu_counts.allowed.load(Ordering::SeqCst),
        eu_fallback,
        eu_counts.denied.load(Ordering::SeqCst),
        eu_counts.failed.load(Ordering::SeqCst),
        us_counts.allowed.load(Ordering::SeqCst),
        us_counts.fallback.load(Ordering::SeqCst),
        us_counts.denied.load(Ordering::SeqCst),
        us_counts.failed.load(Ordering::SeqCst),
        serde_json::to_string(&windows).unwrap_or_default()
    );
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
    // restart); the ledger counts global fallback only. EU's Redis never fails: there the two agree.
    let ledger_fallback = |region: &str| -> u64 {
        windows
            .iter()
            .map(|w| w["fallbackAdmittedByRegion"][region].as_u64().unwrap_or(0))
            .sum()
    };
    assert_eq!(ledger_fallback("eu"), eu_fallback, "{summary}");
    assert!(
        ledger_fallback("eu") + ledger_fallback("us") <= counted_fallback,
        "{summary}"
    );
    assert!(
        allowed_after_kill > 0,
        "EU kept admitting after the allocator failover; {summary}"
    );
    assert!(
        us_counts.failed.load(Ordering::SeqCst) + eu_counts.failed.load(Ordering::SeqCst) == 0,
        "every request got a decision; {summary}"
    );
    // Nothing raw in logs or metrics: the processes only ever saw keyed hashes of the principals.
    let mut exposed: Vec<String> = Vec::new();
    for (_, url) in &agents {
        if let Ok(response) = client.get(format!("{url}/metrics")).send().await
            && let Ok(text) = response.text().await
        {
            exposed.push(text);
        }
    }
    for process in allocators
        .iter()
        .map(|(p, _, _)| p)
        .chain(agents.iter().map(|(p, _)| p))
    {
        let log = process.log_text();
        assert!(
            !log.contains("panicked"),
            "{} panicked:\n{log}",
            process.name
        );
        exposed.push(log);
    }
    assert!(
        exposed.len() >= 6,
        "every log and both agents' metrics were read"
    );
    for text in &exposed {
        for raw in [
            "user-rawid-",
            "key-rawsecret-",
            "203.0.113.",
            GATEWAY,
            AGENT_EU,
            AGENT_US,
            OPERATOR,
        ] {
            assert!(
                !text.contains(raw),
                "a raw identifier or token ({raw}) appears in a log or in metrics"
            );
        }
    }
    drop(agents);
    drop(allocators);
    let server = std::env::var("ALLOT_TEST_POSTGRES_URL").unwrap_or_default();
    psql(
        &format!("{}/postgres", server.trim_end_matches('/')),
        &format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
    )
    .await;
}
