//! The real-process topology the drill and the soak run against: a 3-member etcd cluster, a Redis per
//! region, two allocator processes on one PostgreSQL ledger, and an agent process per region that
//! reaches the allocators through fault proxies of ours; plus the load generator that drives the
//! agents and counts every outcome itself, and the readings both tests check (ledger windows, logs,
//! peak memory).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_testkit::{EtcdCluster, FaultProxy, RedisServer, workspace_binary};
use serde_json::{Value, json};

pub const OPERATOR: &str = "operator-token-real-drill-01";
/// Agent tokens, each scoped to its region in the allocators' token file.
pub const AGENT_EU: &str = "agent-eu-token-real-drill-01";
pub const AGENT_US: &str = "agent-us-token-real-drill-01";
pub const GATEWAY: &str = "gateway-token-real-drill-01";
/// G per window, and the pool's other terms: short windows, so a short run spans several.
pub const LIMIT: u64 = 400;
pub const WINDOW_MS: u64 = 10_000;
pub const FALLBACK_PER_REGION: u64 = 30;
pub const LEASE_TTL_MS: u64 = 3_000;
pub const REGIONS: [&str; 2] = ["eu", "us"];

/// A process of ours, killed on drop; it can be killed and started again with the same arguments
/// (each incarnation logs to a file of its own).
pub struct Process {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    dir: PathBuf,
    child: Option<Child>,
    incarnations: u32,
    logs: Vec<PathBuf>,
}

impl Process {
    pub fn spawn(dir: &Path, name: &str, program: PathBuf, args: Vec<String>) -> Self {
        let mut process = Self {
            name: name.to_owned(),
            program,
            args,
            dir: dir.to_owned(),
            child: None,
            incarnations: 0,
            logs: Vec::new(),
        };
        process.start();
        process
    }

    /// Starts the process (again).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        self.incarnations += 1;
        let log = self
            .dir
            .join(format!("{}-{}.log", self.name, self.incarnations));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(&self.program)
            .args(&self.args)
            .env("ALLOT_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.program.display()));
        self.child = Some(child);
        self.logs.push(log);
    }

    /// SIGKILL: no goodbye, no final report.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The end of the current incarnation's log, for failure messages.
    pub fn log_tail(&self) -> String {
        self.logs.last().map_or_else(
            || "(no log yet)".to_owned(),
            |log| allot_testkit::log_tail(log),
        )
    }

    /// Every incarnation's log, in order.
    pub fn log_text(&self) -> String {
        self.logs
            .iter()
            .map(|log| std::fs::read_to_string(log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Resident memory of `pid` now, KiB (`VmRSS`), if it lives.
pub fn resident_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A fresh database on the test PostgreSQL server (the test drops it at the end).
pub async fn create_database(prefix: &str) -> (String, String) {
    let server = std::env::var("ALLOT_TEST_POSTGRES_URL")
        .expect("ALLOT_TEST_POSTGRES_URL must name a PostgreSQL server (scripts/test sets it)");
    let server = server.trim_end_matches('/').to_owned();
    let name = format!("{prefix}_{}", std::process::id());
    let admin = format!("{server}/postgres");
    psql(&admin, &format!("DROP DATABASE IF EXISTS {name}")).await;
    psql(&admin, &format!("CREATE DATABASE {name}")).await;
    (format!("{server}/{name}"), name)
}

pub async fn drop_database(name: &str) {
    let server = std::env::var("ALLOT_TEST_POSTGRES_URL").unwrap_or_default();
    psql(
        &format!("{}/postgres", server.trim_end_matches('/')),
        &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
    )
    .await;
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

pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client")
}

/// How long [`Topology::wait_for_agent`] waits for an agent's readiness, s.
const AGENT_READY_WITHIN_S: u64 = 90;

pub async fn wait_until(what: &str, seconds: u64, check: impl AsyncFnMut() -> bool) {
    if !holds_within(seconds, check).await {
        panic!("timed out after {seconds} s waiting until {what}");
    }
}

/// Whether `check` holds within `seconds` (polled every 50 ms).
pub async fn holds_within(seconds: u64, mut check: impl AsyncFnMut() -> bool) -> bool {
    for _ in 0..seconds * 20 {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

pub async fn role(client: &reqwest::Client, url: &str) -> Option<String> {
    let response = client.get(format!("{url}/readyz")).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

/// The raw identities the load uses: none may ever appear in a log line or a metric label.
pub fn raw_user(n: u64) -> String {
    format!("user-rawid-{:04}", n % 20)
}

pub fn raw_api_key(n: u64) -> String {
    format!("key-rawsecret-{:04}", n % 7)
}

pub fn raw_address(n: u64) -> String {
    format!("203.0.113.{}", n % 50)
}

/// The agents' pepper.
pub const PEPPER: &str = "a-pepper-for-the-real-drill-0123456789";

/// Everything raw a run used: identities, tokens and the pepper.
pub const RAW: [&str; 8] = [
    "user-rawid-",
    "key-rawsecret-",
    "203.0.113.",
    GATEWAY,
    AGENT_EU,
    AGENT_US,
    OPERATOR,
    PEPPER,
];

/// What the load generator saw, per region.
#[derive(Default)]
pub struct Counts {
    pub allowed: AtomicU64,
    pub fallback: AtomicU64,
    pub denied: AtomicU64,
    /// Sent, but no decision came back (an admit the ledger may hold that we cannot count).
    pub failed: AtomicU64,
    /// Not sent: 32 requests were already in flight (the generator does not queue).
    pub skipped: AtomicU64,
    /// The longest an admitted request took, ms (how long an admit can wait on the allocator).
    pub slowest_admit_ms: AtomicU64,
}

impl Counts {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::SeqCst)
    }
}

/// Sends `per_second` admits to `agent` until `stop`, counting outcomes.
pub async fn drive(
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
            let stopwatch = allot_region_agent::clock::Stopwatch::start();
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
                    let took_ms =
                        u64::try_from(stopwatch.elapsed().as_millis()).unwrap_or(u64::MAX);
                    counts.slowest_admit_ms.fetch_max(took_ms, Ordering::SeqCst);
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

/// An allocator process and where it serves.
pub struct Allocator {
    pub process: Process,
    pub url: String,
    pub port: u16,
}

/// An agent process, where it serves, and the proxies it reaches the allocators through.
pub struct Agent {
    pub process: Process,
    pub url: String,
    pub proxies: Vec<FaultProxy>,
}

/// The whole topology, running, with the pool `drill/api` configured and both agents ready.
pub struct Topology {
    pub dir: tempfile::TempDir,
    pub etcd: EtcdCluster,
    pub redis: BTreeMap<&'static str, RedisServer>,
    pub allocators: Vec<Allocator>,
    pub agents: BTreeMap<&'static str, Agent>,
    pub database: String,
    pub client: reqwest::Client,
}

impl Topology {
    pub async fn start(database_prefix: &str) -> Self {
        let allocator_bin = workspace_binary("allocator");
        let agent_bin = workspace_binary("region-agent");
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path().to_owned();
        let etcd = EtcdCluster::start(3);
        let mut redis = BTreeMap::new();
        for region in REGIONS {
            redis.insert(region, RedisServer::start());
        }
        let (ledger_url, database) = create_database(database_prefix).await;
        let agent_tokens = format!("eu {AGENT_EU}\nus {AGENT_US}\n");
        for (file, token) in [
            ("operator.tokens", OPERATOR),
            ("agent.tokens", agent_tokens.as_str()),
            ("gateway.tokens", GATEWAY),
            ("pepper", PEPPER),
        ] {
            std::fs::write(d.join(file), token).expect("secret file");
        }
        // Signed-in callers and, explicitly, anonymous ones (`ip`) spend the tenant's pool.
        let bundle = json!({ "rules": [
            { "id": "global-read", "scope": "global", "routeGroup": "read", "pool": "api",
              "failMode": "closed" },
            { "id": "global-read-anonymous", "scope": "global", "routeGroup": "read",
              "principalType": "ip", "pool": "api", "failMode": "closed" },
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
            allocators.push(Allocator {
                process: Process::spawn(&d, name, allocator_bin.clone(), args),
                url,
                port,
            });
        }
        let mut topology = Self {
            dir,
            etcd,
            redis,
            allocators,
            agents: BTreeMap::new(),
            database,
            client: http(),
        };
        let leader = topology.wait_for_leader(30).await;
        let pool = json!({ "limit": LIMIT, "windowMs": WINDOW_MS, "chunk": 40,
            "leaseTtlMs": LEASE_TTL_MS, "fallbackPerRegion": FALLBACK_PER_REGION,
            "regions": REGIONS });
        let put = topology
            .client
            .put(format!("{leader}/v1/pools/drill/api"))
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

        // An agent per region, each reaching both allocators through its own proxies.
        for region in REGIONS {
            let proxies: Vec<FaultProxy> = topology
                .allocators
                .iter()
                .map(|a| FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], a.port))))
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
                proxies
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
                topology.redis[region].url(),
                "--policy-file".into(),
                path("bundle.json"),
                "--agent-id".into(),
                format!("{region}-1"),
                // Survives the agent's restarts: pool terms, pending reports, fallback claims.
                "--state-dir".into(),
                path(&format!("state-{region}")),
                // A CI machine shares its 2 cores with a dozen processes here.
                "--decision-budget-ms".into(),
                "200".into(),
            ];
            let name = format!("agent-{region}");
            topology.agents.insert(
                region,
                Agent {
                    process: Process::spawn(&d, &name, agent_bin.clone(), args),
                    url: format!("http://127.0.0.1:{port}"),
                    proxies,
                },
            );
        }
        for region in REGIONS {
            topology.wait_for_agent(region).await;
        }
        topology
    }

    /// The leading allocator's URL, once one leads (within `seconds`).
    pub async fn wait_for_leader(&self, seconds: u64) -> String {
        let mut found = None;
        wait_until("an allocator leads", seconds, async || {
            for allocator in &self.allocators {
                if role(&self.client, &allocator.url)
                    .await
                    .is_some_and(|r| r.starts_with("leader"))
                {
                    found = Some(allocator.url.clone());
                    return true;
                }
            }
            false
        })
        .await;
        found.expect("a leader")
    }

    pub async fn wait_for_agent(&self, region: &str) {
        let url = &self.agents[region].url;
        // Ready: started, connected to its Redis, holding its policy bundle. Beside the soak and
        // the real drill on two cores, a suite run once found an agent not ready after 30 s; the
        // bound only ends a run that would otherwise hang, and then shows the agent's log.
        let ready = holds_within(AGENT_READY_WITHIN_S, async || {
            self.client
                .get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        if !ready {
            panic!(
                "the {region} agent was not ready within {AGENT_READY_WITHIN_S} s\n{}",
                self.agents[region].process.log_tail()
            );
        }
    }

    /// Every process of ours: allocators, then agents.
    pub fn processes(&self) -> Vec<&Process> {
        self.allocators
            .iter()
            .map(|a| &a.process)
            .chain(self.agents.values().map(|a| &a.process))
            .collect()
    }

    /// The pool's ledger windows, read through `via` (an allocator URL).
    pub async fn windows(&self, via: &str) -> Option<Vec<Value>> {
        let response = self
            .client
            .get(format!("{via}/v1/pools/drill/api/windows?last=1000"))
            .bearer_auth(OPERATOR)
            .send()
            .await
            .ok()?;
        let body = response.json::<Value>().await.ok()?;
        body["windows"].as_array().cloned()
    }

    /// No process of ours panicked, in any incarnation.
    pub fn assert_no_panic(&self) {
        for process in self.processes() {
            let log = process.log_text();
            assert!(
                !log.contains("panicked"),
                "{} panicked:\n{log}",
                process.name
            );
        }
    }

    /// No raw identity, token or pepper in any log or live process's metrics (at least `texts` of
    /// them read).
    pub async fn assert_nothing_raw(&self, texts: usize) {
        let exposed = self.exposed_text().await;
        assert!(
            exposed.len() >= texts,
            "every log and the live processes' metrics were read: {}",
            exposed.len()
        );
        for text in &exposed {
            for raw in RAW {
                assert!(
                    !text.contains(raw),
                    "a raw identifier or token ({raw}) appears in a log or in metrics"
                );
            }
        }
    }

    /// Stops every process and drops the ledger database.
    pub async fn stop(self) {
        let database = self.database.clone();
        drop(self);
        drop_database(&database).await;
    }

    /// Every live process's /metrics text, and every process's logs: what must never show
    /// anything raw.
    pub async fn exposed_text(&self) -> Vec<String> {
        let mut exposed = Vec::new();
        let urls = self
            .agents
            .values()
            .map(|a| &a.url)
            .chain(self.allocators.iter().map(|a| &a.url));
        for url in urls {
            // A killed allocator answers nothing; the live processes' metrics are all read.
            if let Ok(response) = self.client.get(format!("{url}/metrics")).send().await
                && let Ok(text) = response.text().await
            {
                exposed.push(text);
            }
        }
        for process in self.processes() {
            exposed.push(process.log_text());
        }
        exposed
    }
}

/// Sums a number field over windows.
pub fn sum(windows: &[Value], field: &str) -> u64 {
    windows.iter().map(|w| w[field].as_u64().unwrap_or(0)).sum()
}

/// Sums a per-region field over windows.
pub fn sum_region(windows: &[Value], field: &str, region: &str) -> u64 {
    windows
        .iter()
        .map(|w| w[field][region].as_u64().unwrap_or(0))
        .sum()
}
