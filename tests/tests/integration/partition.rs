//! A region cut off from the allocator for longer than a lease: it spends what its leases hold, then
//! its pool's fallback allowance for the window (and says so), then denies until the window ends.
//! After the allocator is back, the fallback admits reach the ledger and the window stays within
//! its bound. An agent without a state directory killed while cut off does not get its allowance
//! back in its next run.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::Pepper;
use allot_testkit::EtcdCluster;
use serde_json::{Value, json};

use crate::stack;

use crate::stack::{AGENT, OPERATOR};

struct RunningAllocator {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start_allocator(etcd: &[String], dir: &std::path::Path, port: u16) -> RunningAllocator {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let settings = Settings {
        listen: addr,
        etcd: etcd.to_vec(),
        tokens: Tokens {
            operator: vec![OPERATOR.to_owned()],
            agent: vec![AGENT.to_owned()],
        },
        node_id: "alloc".to_owned(),
        advertise_url: format!("http://{addr}"),
        leader_lease_ttl_s: 2,
        shards: None,
        tls: None,
        etcd_history_minutes: 60,
        etcd_defragment: true,
        retention: Default::default(),
        ledger_round: allot_allocator::ledger_sync::LEDGER_RECONCILE_INTERVAL,
        webhook_ca: None,
        webhook_allow_private: false,
        pepper: None,
        ledger_url: format!("sqlite://{}", dir.join("ledger.db").display()),
    };
    let kv = Arc::new(EtcdKv::connect(etcd).await.expect("etcd"));
    let ledger = Ledger::connect(&settings.ledger_url).await.expect("ledger");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(
        settings,
        kv,
        ledger,
        allot_allocator::server::system_clock(),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    for _ in 0..400 {
        if let Ok(r) = client.get(format!("http://{addr}/readyz")).send().await
            && r.status() == 200
            && r.text().await.is_ok_and(|t| t.starts_with("leader"))
        {
            return RunningAllocator { stop, task };
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the allocator never became leader");
}

fn request(n: usize) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("p-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: format!("U-{n}"),
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

/// One etcd, an allocator that can be stopped and started again on the same port (same store,
/// same ledger), and the pool `atlas/api`.
struct Stage {
    _etcd: EtcdCluster,
    endpoints: Vec<String>,
    dir: tempfile::TempDir,
    port: u16,
    url: String,
}

impl Stage {
    async fn start() -> (Self, RunningAllocator) {
        let etcd = EtcdCluster::single();
        let endpoints = etcd.endpoints();
        let dir = tempfile::tempdir().expect("temp dir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let allocator = start_allocator(&endpoints, dir.path(), port).await;
        let url = format!("http://127.0.0.1:{port}");
        // An hour-long window, 1 s leases, 20 tokens of fallback per region.
        let pool = json!({ "limit": 1000, "windowMs": 3_600_000, "chunk": 10, "leaseTtlMs": 1000,
                           "fallbackPerRegion": 20, "regions": ["eu", "us"] });
        stack::put_pool(&url, "atlas", "api", &pool).await;
        let stage = Self {
            _etcd: etcd,
            endpoints,
            dir,
            port,
            url,
        };
        (stage, allocator)
    }

    /// The allocator back after a stop.
    async fn restart_allocator(&self) -> RunningAllocator {
        start_allocator(&self.endpoints, self.dir.path(), self.port).await
    }

    /// The ledger's row of the current window.
    async fn current_window(&self) -> Value {
        stack::windows(&self.url, "atlas", "api", 1)
            .await
            .into_iter()
            .next()
            .unwrap_or_default()
    }
}

/// A run of agent `eu-1` (no state directory) with one global rule on `atlas/api`, taking leases
/// from the allocator at `url`.
fn agent_run(url: &str) -> Arc<Agent> {
    let bundle = allot_shared::policy::parse_bundle(
        &json!({ "rules": [{ "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }] })
            .to_string(),
    )
    .and_then(|d| d.into_file_bundle())
    .expect("bundle");
    let clock = Arc::new(SystemClock);
    let limiter = Limiter::new(
        Arc::new(InProcessStore::new(clock.clone(), 1_000)),
        LimiterConfig::default(),
    )
    .expect("limiter");
    Agent::new(
        AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("eu-1").expect("agent id"),
            Pepper::new(b"partition-pepper-0123".to_vec()).expect("pepper"),
        ),
        clock,
        limiter,
        Some(Arc::new(
            AllocatorClient::new(vec![url.to_owned()], AGENT.to_owned()).expect("client"),
        )),
        Some(bundle),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_region_spends_its_leases_then_its_fallback_then_denies() {
    let (stage, allocator) = Stage::start().await;
    let url = stage.url.clone();
    let agent = agent_run(&url);

    // Connected: leases flow.
    let mut leased = 0;
    for n in 0..15 {
        let d = agent.admit(&request(n)).await.expect("decision");
        assert!(d.allowed && !d.fallback, "{d:?}");
        leased += 1;
    }

    // Cut off: the allocator stops. Wait past every lease's end.
    let _ = allocator.stop.send(());
    let _ = allocator.task.await;
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let mut fallback = 0;
    let mut denied = 0;
    for n in 100..130 {
        let d = agent.admit(&request(n)).await.expect("decision");
        if d.allowed {
            assert!(
                d.fallback,
                "after the leases end, only fallback admits: {d:?}"
            );
            fallback += 1;
        } else {
            assert_eq!(d.denied_scope, Some(DeniedScope::Global));
            assert_eq!(d.reason, Some(Reason::RateExceeded));
            assert!(
                d.fallback,
                "the denial comes from the spent fallback allowance"
            );
            assert!(d.retry_after_ms > 0 && d.retry_after_ms <= 3_600_000);
            denied += 1;
        }
    }
    assert_eq!(
        (fallback, denied),
        (20, 10),
        "exactly the fallback allowance, then denials"
    );
    assert!(!agent.allocator_reachable());

    // Healed: the allocator is back (same etcd, same ledger); the agent reports.
    let allocator = stage.restart_allocator().await;
    agent.send_reports().await;
    let row = &stage.current_window().await;
    assert_eq!(row["fallbackAdmitted"], 20, "{row}");
    assert_eq!(row["fallbackAdmittedByRegion"]["eu"], 20);
    assert_eq!(row["spent"], leased, "{row}");
    assert_eq!(row["admitted"], leased + 20);
    assert!(
        row["admitted"].as_u64() <= row["bound"].as_u64(),
        "within the bound: {row}"
    );
    assert_eq!(row["bound"], 1_000 + 20 * 2);
    // Connected again, leases flow again and nothing comes from fallback.
    let d = agent.admit(&request(500)).await.expect("decision");
    assert!(d.allowed && !d.fallback, "{d:?}");
    let _ = allocator.stop.send(());
}

/// An agent without a state directory, killed inside a partition, and its next run cut off again
/// in the same window: the killed run's fallback admits never reached the ledger, yet the new run
/// admits none, because the allocator's session record says the last run did not end cleanly. A
/// later run that follows a clean end still admits none in that window: the clean end does not
/// vouch for the crash before it. Real allocator on etcd, real agent service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_inside_a_partition_does_not_reopen_the_fallback_allowance() {
    let (stage, allocator) = Stage::start().await;
    let url = stage.url.clone();
    let run = || agent_run(&url);
    // Cut off past every lease's end, `agent` admits what it can: how many in fallback.
    let fallback_admits = async |agent: &Arc<Agent>, from: usize| {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let mut admitted = 0;
        for n in from..from + 30 {
            let d = agent.admit(&request(n)).await.expect("decision");
            assert!(
                d.fallback,
                "cut off, every decision is the fallback's: {d:?}"
            );
            admitted += u64::from(d.allowed);
        }
        admitted
    };

    // The first run leases, is cut off, admits its whole allowance in fallback, and is killed.
    let first = run();
    assert!(first.admit(&request(0)).await.expect("decision").allowed);
    let _ = allocator.stop.send(());
    let _ = allocator.task.await;
    assert_eq!(fallback_admits(&first, 100).await, 20);
    drop(first);

    // The next run starts while the allocator is back, then is cut off again in the same window.
    let allocator = stage.restart_allocator().await;
    let second = run();
    let d = second.admit(&request(200)).await.expect("decision");
    assert!(d.allowed && !d.fallback, "leases flow: {d:?}");
    let _ = allocator.stop.send(());
    let _ = allocator.task.await;
    assert_eq!(
        fallback_admits(&second, 300).await,
        0,
        "the killed run's unreported fallback counts as used"
    );

    // The second run stops cleanly: its reports reach the ledger and its session ends.
    let allocator = stage.restart_allocator().await;
    second.send_reports().await;
    assert!(
        second.end_session().await,
        "nothing unreported: a clean end"
    );
    drop(second);
    let third = run();
    assert!(third.admit(&request(400)).await.expect("decision").allowed);
    let _ = allocator.stop.send(());
    let _ = allocator.task.await;
    assert_eq!(
        fallback_admits(&third, 500).await,
        0,
        "a clean end does not vouch for the crash earlier in the window"
    );
    drop(third);

    // The ledger never learnt the killed run's admits: only the session record stood for them.
    let allocator = stage.restart_allocator().await;
    let row = stage.current_window().await;
    assert_eq!(row["fallbackAdmitted"], 0, "{row}");
    let _ = allocator.stop.send(());
}
