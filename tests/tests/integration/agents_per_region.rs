//! Several agents per region, as real processes, cut off from the allocator: EU runs two agents
//! and US three, each told how many its region runs (`--region-agents`); AP runs two agents each
//! told it runs alone. Every agent reaches the allocator through a proxy of its own, and all are cut
//! off for two windows, then healed.
//!
//! Checked against what the gateways (this test) were answered:
//! - the ledger keeps each agent's fallback admits: per agent and summed per region, they equal the
//!   fallback admits the agent answered, and usage export's `admitted` equals every admit answered;
//! - EU's and US's agents together stay within the region's allowance in every window, and no
//!   window of theirs is a bound-check violation;
//! - AP's agents together admit more than AP's allowance: its windows are violations naming AP, and
//!   its over-allowance counter counts them;
//! - lowering the allowance to 0 afterwards (as the fallback runbook says) leaves those windows
//!   judged by the allowance they ran under: no new violation;
//! - the allocator exports its bound-check counters at 0 from the start.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_testkit::{EtcdCluster, FaultProxy, ProxyMode, RedisServer, workspace_binary};
use serde_json::{Value, json};

use crate::topology;

use crate::topology::{
    Process, create_database, drop_database, free_port, holds_within, http, wait_until,
};

const OPERATOR: &str = "operator-token-agents-per-region-1";
const GATEWAY: &str = "gateway-token-agents-per-region-1";
const PEPPER: &str = "a-pepper-for-agents-per-region-0123456789";
const WINDOW_MS: u64 = 6_000;
/// Divisible by 2 and 3: EU's agents take 6 each, US's 4, AP's (misconfigured) 12 each.
const FALLBACK_PER_REGION: u64 = 12;
/// Each region, its agents, and what each agent is told the region runs.
const REGIONS: [(&str, usize, u64); 3] = [("eu", 2, 2), ("us", 3, 3), ("ap", 2, 1)];

/// One agent process, where it serves, the proxy it reaches the allocator through, and what its
/// gateway was answered.
struct AgentUnderTest {
    region: &'static str,
    id: String,
    url: String,
    proxy: FaultProxy,
    process: Process,
    admitted: AtomicU64,
    fallback: AtomicU64,
}

fn pool_spec(fallback_per_region: u64) -> Value {
    json!({ "limit": 1000, "windowMs": WINDOW_MS, "chunk": 10, "leaseTtlMs": 2000,
        "fallbackPerRegion": fallback_per_region, "regions": ["eu", "us", "ap"] })
}

/// Admits one request at `agent`, counting what its gateway was answered.
async fn admit(client: &reqwest::Client, agent: &AgentUnderTest, n: u64) {
    let body = json!({ "requestId": format!("{}-{n}", agent.id), "tenantId": "drill",
        "principal": { "type": "user", "id": format!("user-{}", n % 13) },
        "routeGroup": "read", "method": "GET" });
    let Ok(response) = client
        .post(format!("{}/v1/admit", agent.url))
        .bearer_auth(GATEWAY)
        .json(&body)
        .send()
        .await
    else {
        return;
    };
    // A decision that did not come back cannot be counted: none may be lost here.
    let decision: Value = response.json().await.expect("a decision");
    if decision["allowed"] == true {
        agent.admitted.fetch_add(1, Ordering::SeqCst);
        if decision["fallback"] == true {
            agent.fallback.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Sends a request every 50 ms to each agent, one after another, until `stop`.
async fn drive(client: reqwest::Client, agents: Arc<Vec<AgentUnderTest>>, stop: Arc<AtomicBool>) {
    let mut each = tokio::task::JoinSet::new();
    for index in 0..agents.len() {
        let (client, agents, stop) = (client.clone(), agents.clone(), stop.clone());
        each.spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                admit(&client, &agents[index], n).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    while let Some(done) = each.join_next().await {
        done.expect("an agent's load");
    }
}

async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    let response = client
        .get(url)
        .bearer_auth(OPERATOR)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(
        response.status().is_success(),
        "GET {url}: {}",
        response.status()
    );
    response.json().await.expect("JSON")
}

/// The ledger's fallback admits per agent over every window, by (region, agent id).
fn ledger_fallback_by_agent(windows: &[Value]) -> BTreeMap<(String, String), u64> {
    let mut by_agent = BTreeMap::new();
    for window in windows {
        let Some(regions) = window["fallbackAdmittedByAgent"].as_object() else {
            continue;
        };
        for (region, agents) in regions {
            for (agent, tokens) in agents.as_object().expect("agents") {
                *by_agent.entry((region.clone(), agent.clone())).or_default() +=
                    tokens.as_u64().expect("tokens");
            }
        }
    }
    by_agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_agents_per_region_cut_off_are_counted_exactly_and_a_region_over_its_allowance_shows()
 {
    let client = http();
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path().to_owned();
    let etcd = EtcdCluster::start(1);
    let (ledger_url, database) = create_database("allot_agents_per_region").await;
    let agent_tokens: String = REGIONS
        .iter()
        .map(|(region, _, _)| format!("{region} agent-{region}-token-agents-per-region\n"))
        .collect();
    for (file, text) in [
        ("operator.tokens", OPERATOR.to_owned()),
        ("agent.tokens", agent_tokens),
        ("gateway.tokens", GATEWAY.to_owned()),
        ("pepper", PEPPER.to_owned()),
        (
            "bundle.json",
            json!({ "rules": [{ "id": "global-read", "scope": "global", "routeGroup": "read",
                "pool": "api", "failMode": "closed" }] })
            .to_string(),
        ),
    ] {
        std::fs::write(d.join(file), text).expect("file");
    }
    let path = |name: &str| d.join(name).display().to_string();

    // The allocator, checking settled windows every second.
    let port = free_port();
    let allocator = format!("http://127.0.0.1:{port}");
    let args = [
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--etcd",
        &etcd.endpoints().join(","),
        "--node-id",
        "alloc",
        "--advertise-url",
        &allocator,
        "--ledger",
        &ledger_url,
        "--data-dir",
        &path("alloc"),
        "--operator-token-file",
        &path("operator.tokens"),
        "--agent-token-file",
        &path("agent.tokens"),
        "--ledger-round-seconds",
        "1",
    ];
    let allocator_process = Process::spawn(
        &d,
        "allocator",
        workspace_binary("allocator"),
        args.iter().map(|a| (*a).to_owned()).collect(),
    );
    wait_until("the allocator leads", 60, async || {
        topology::role(&client, &allocator)
            .await
            .is_some_and(|r| r.starts_with("leader"))
    })
    .await;
    // Exported from the start, before any window was checked.
    let metrics = client
        .get(format!("{allocator}/metrics"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    for series in [
        "allot_bound_violations_total 0",
        "allot_bound_windows_checked_total 0",
        "allot_bound_violations_recorded 0",
    ] {
        assert!(
            metrics.lines().any(|line| line == series),
            "{series} from the start:\n{metrics}"
        );
    }
    let put = client
        .put(format!("{allocator}/v1/pools/drill/api"))
        .bearer_auth(OPERATOR)
        .json(&pool_spec(FALLBACK_PER_REGION))
        .send()
        .await
        .expect("put pool");
    assert_eq!(
        put.status(),
        200,
        "{}",
        put.text().await.unwrap_or_default()
    );

    // The agents: a Redis per region, a proxy per agent.
    let redis: BTreeMap<&str, RedisServer> = REGIONS
        .iter()
        .map(|(region, _, _)| (*region, RedisServer::start()))
        .collect();
    let mut agents = Vec::new();
    for (region, count, told) in REGIONS {
        for k in 0..count {
            let id = format!("{region}-{}", ["a", "b", "c"][k]);
            let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
            let (http_port, grpc_port) = (free_port(), free_port());
            let args = vec![
                "--region".into(),
                region.into(),
                "--listen".into(),
                format!("127.0.0.1:{http_port}"),
                "--grpc-listen".into(),
                format!("127.0.0.1:{grpc_port}"),
                "--allocator".into(),
                proxy.url(),
                "--agent-token-file".into(),
                path("agent.tokens"),
                "--gateway-token-file".into(),
                path("gateway.tokens"),
                "--pepper-file".into(),
                path("pepper"),
                "--redis".into(),
                redis[region].url(),
                "--policy-file".into(),
                path("bundle.json"),
                "--agent-id".into(),
                id.clone(),
                "--region-agents".into(),
                told.to_string(),
                "--decision-budget-ms".into(),
                "200".into(),
            ];
            let process = Process::spawn(&d, &id, workspace_binary("region-agent"), args);
            agents.push(AgentUnderTest {
                region,
                id,
                url: format!("http://127.0.0.1:{http_port}"),
                proxy,
                process,
                admitted: AtomicU64::new(0),
                fallback: AtomicU64::new(0),
            });
        }
    }
    for agent in &agents {
        let ready = holds_within(90, async || {
            client
                .get(format!("{}/readyz", agent.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        assert!(
            ready,
            "{} not ready:\n{}",
            agent.id,
            agent.process.log_tail()
        );
    }
    let agents = Arc::new(agents);

    // Traffic through every agent: first with the allocator reachable (each takes up the pool),
    // then cut off for two windows and more, then healed.
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(drive(client.clone(), agents.clone(), stop.clone()));
    wait_until("every agent admitted from its leases", 30, async || {
        agents
            .iter()
            .all(|agent| agent.admitted.load(Ordering::SeqCst) > 0)
    })
    .await;
    for agent in agents.iter() {
        agent.proxy.set_mode(ProxyMode::Refuse);
    }
    tokio::time::sleep(Duration::from_millis(2 * WINDOW_MS + 3_000)).await;
    for agent in agents.iter() {
        agent.proxy.set_mode(ProxyMode::Pass);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    load.await.expect("the load");
    for agent in agents.iter() {
        assert!(
            agent.fallback.load(Ordering::SeqCst) > 0,
            "{} admitted in fallback while cut off",
            agent.id
        );
    }

    // The ledger, once every report is in: each agent's fallback as its gateway was answered, and
    // usage export's admits as every gateway was.
    let answered: BTreeMap<(String, String), u64> = agents
        .iter()
        .map(|agent| {
            (
                (agent.region.to_owned(), agent.id.clone()),
                agent.fallback.load(Ordering::SeqCst),
            )
        })
        .collect();
    let admitted_total: u64 = agents
        .iter()
        .map(|agent| agent.admitted.load(Ordering::SeqCst))
        .sum();
    eprintln!("answered in fallback, by agent: {answered:?}; admitted in all: {admitted_total}");
    let windows_url = format!("{allocator}/v1/pools/drill/api/windows?last=100");
    let mut windows = Vec::new();
    let reported = holds_within(30, async || {
        windows = get_json(&client, &windows_url).await["windows"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ledger_fallback_by_agent(&windows) == answered
    })
    .await;
    assert!(
        reported,
        "the ledger's fallback per agent {:?} is what the agents answered {answered:?}",
        ledger_fallback_by_agent(&windows)
    );
    for (region, _, _) in REGIONS {
        let by_agents: u64 = answered
            .iter()
            .filter(|((r, _), _)| r == region)
            .map(|(_, tokens)| tokens)
            .sum();
        let by_region: u64 = windows
            .iter()
            .map(|w| w["fallbackAdmittedByRegion"][region].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(by_region, by_agents, "{region}: the sum of its agents'");
    }
    let now_ms = windows[0]["windowEndMs"].as_u64().expect("end") + WINDOW_MS;
    let usage_url = format!("{allocator}/v1/usage?from=0&to={now_ms}&prefix=drill/api");
    let mut exported = 0;
    let matched = holds_within(30, async || {
        let text = client
            .get(&usage_url)
            .bearer_auth(OPERATOR)
            .send()
            .await
            .expect("usage")
            .text()
            .await
            .expect("usage text");
        exported = text
            .lines()
            .map(|line| {
                let record: Value = serde_json::from_str(line).expect("a usage record");
                record["admitted"].as_u64().expect("admitted")
            })
            .sum();
        exported == admitted_total
    })
    .await;
    assert!(
        matched,
        "usage export admitted {exported}; the gateways were answered {admitted_total} admits"
    );

    // Every window within each region's allowance but AP's, whose agents each took it all.
    let share = |region: &str| {
        let (_, count, _) = REGIONS
            .iter()
            .find(|(r, _, _)| *r == region)
            .expect("region");
        FALLBACK_PER_REGION / *count as u64
    };
    let mut ap_over = 0;
    for window in &windows {
        for (region, tokens) in window["fallbackAdmittedByRegion"]
            .as_object()
            .expect("regions")
        {
            let tokens = tokens.as_u64().expect("tokens");
            if region == "ap" {
                ap_over += u64::from(tokens > FALLBACK_PER_REGION);
            } else {
                assert!(tokens <= FALLBACK_PER_REGION, "{region}: {window}");
                for agent_tokens in window["fallbackAdmittedByAgent"][region]
                    .as_object()
                    .expect("agents")
                    .values()
                {
                    assert!(agent_tokens.as_u64().expect("tokens") <= share(region));
                }
            }
        }
    }
    assert!(
        ap_over >= 1,
        "AP's two agents took twice its allowance: {windows:?}"
    );

    // The bound checks see it: AP's windows over its allowance, named, and nothing else.
    let mut summary = Value::Null;
    let checked = holds_within(30, async || {
        summary = get_json(&client, &format!("{allocator}/v1/bound-checks?recent=100")).await;
        summary["violations"].as_u64() >= Some(ap_over)
    })
    .await;
    assert!(checked, "AP's windows are violations: {summary}");
    let violations = summary["violations"].as_u64().expect("violations");
    eprintln!("AP windows over its allowance: {ap_over}; violations recorded: {violations}");
    for violation in summary["recentViolations"].as_array().expect("violations") {
        assert_eq!(
            violation["regionsOverAllowance"],
            json!(["ap"]),
            "{summary}"
        );
        assert!(violation["fallbackOverAllowance"].as_u64() > Some(0));
    }
    let metrics = client
        .get(format!("{allocator}/metrics"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    let counted = |region: &str| -> Option<u64> {
        let prefix = format!("allot_region_fallback_over_allowance_total{{region=\"{region}\"}} ");
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(&prefix)?.parse().ok())
    };
    assert_eq!(counted("eu"), Some(0), "{metrics}");
    assert_eq!(counted("us"), Some(0));
    assert!(counted("ap") >= Some(1));

    // The runbook's step after a partition: the allowance set to 0. The partition's windows stay
    // judged by the allowance they ran under.
    let put = client
        .put(format!("{allocator}/v1/pools/drill/api"))
        .bearer_auth(OPERATOR)
        .json(&pool_spec(0))
        .send()
        .await
        .expect("put pool");
    assert_eq!(put.status(), 200);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = get_json(&client, &format!("{allocator}/v1/bound-checks?recent=100")).await;
    assert_eq!(
        after["violations"].as_u64(),
        Some(violations),
        "no window became a violation by today's terms: {after}"
    );
    let rejudged = get_json(&client, &windows_url).await;
    for window in rejudged["windows"].as_array().expect("windows") {
        if window["fallbackAdmitted"].as_u64() > Some(0) {
            assert_eq!(window["fallbackPerRegion"], FALLBACK_PER_REGION, "{window}");
        }
    }

    for agent in agents.iter() {
        assert!(
            !agent.process.log_text().contains("panicked"),
            "{}",
            agent.id
        );
    }
    assert!(!allocator_process.log_text().contains("panicked"));
    drop(allocator_process);
    drop(agents);
    drop_database(&database).await;
}
