//! Every link over TLS, end to end: an allocator that requires mutual TLS, an agent that reaches it
//! with a client certificate and serves gateways over TLS (HTTP and Envoy's gRPC), and operators
//! through `allotctl` with `--ca-file` and a client certificate. Certificates come from a throwaway
//! PKI; clients without the CA, or without a certificate the CA signed, are refused.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};
use allot_net::{ClientTls, ServerTls};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::grpc::proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_region_agent::grpc::serve_grpc;
use allot_region_agent::http::{AgentApi, serve};
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::RegionId;
use allot_shared::keys::Pepper;
use allot_testkit::{TestPki, workspace_binary};
use serde_json::{Value, json};

const OPERATOR: &str = "operator-token-for-tls-0001";
const AGENT_EU: &str = "agent-eu-token-for-tls-0001";
const GATEWAY: &str = "gateway-token-for-tls-0001";

async fn start_allocator(pki: &TestPki, dir: &std::path::Path) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let settings = Settings {
        listen: addr,
        etcd: vec![],
        tokens: Tokens {
            operator: vec![OPERATOR.to_owned()],
            agent: vec![format!("eu {AGENT_EU}")],
        },
        node_id: "tls-1".to_owned(),
        advertise_url: format!("https://127.0.0.1:{}", addr.port()),
        leader_lease_ttl_s: 5,
        shards: None,
        etcd_history_minutes: 60,
        etcd_defragment: true,
        retention: Default::default(),
        ledger_round: allot_allocator::ledger_sync::LEDGER_RECONCILE_INTERVAL,
        webhook_ca: None,
        webhook_allow_private: false,
        pepper: None,
        ledger_url: format!("sqlite://{}", dir.join("ledger.db").display()),
        tls: Some(ServerTls {
            cert: pki.server_cert(),
            key: pki.server_key(),
            client_ca: Some(pki.ca()),
        }),
    };
    let clock = allot_allocator::server::system_clock();
    let kv = Arc::new(MemoryKv::new(clock.clone()));
    let ledger = Ledger::connect(&settings.ledger_url).await.expect("ledger");
    tokio::spawn(run(
        settings,
        kv,
        ledger,
        clock,
        listener,
        std::future::pending(),
    ));
    format!("https://127.0.0.1:{}", addr.port())
}

fn client(tls: &ClientTls) -> reqwest::Client {
    tls.configure(reqwest::Client::builder().timeout(Duration::from_secs(5)))
        .expect("client TLS")
        .build()
        .expect("client")
}

fn member(pki: &TestPki) -> ClientTls {
    ClientTls {
        ca: Some(pki.ca()),
        cert: Some(pki.client_cert()),
        key: Some(pki.client_key()),
    }
}

async fn wait_ready(http: &reqwest::Client, url: &str) {
    for _ in 0..250 {
        if let Ok(r) = http.get(format!("{url}/readyz")).send().await
            && r.status() == 200
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{url} never became ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_link_runs_over_tls() {
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&pki, dir.path()).await;
    let operator = client(&member(&pki));
    wait_ready(&operator, &allocator).await;

    // Mutual TLS comes before any token: without a certificate only the probes answer (even with a
    // valid token); a certificate from another CA gets no connection.
    let anonymous = client(&ClientTls {
        ca: Some(pki.ca()),
        ..ClientTls::default()
    });
    let probe = anonymous
        .get(format!("{allocator}/readyz"))
        .send()
        .await
        .expect("probes need no certificate");
    assert_eq!(probe.status(), 200);
    let refused = anonymous
        .get(format!("{allocator}/v1/pools"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("an answer");
    assert_eq!(refused.status(), 401);
    assert!(
        refused
            .text()
            .await
            .expect("body")
            .contains("client certificate")
    );
    let stranger = client(&ClientTls {
        ca: Some(pki.ca()),
        cert: Some(pki.stranger_cert()),
        key: Some(pki.stranger_key()),
    });
    assert!(
        stranger
            .get(format!("{allocator}/healthz"))
            .send()
            .await
            .is_err()
    );

    let pool = operator
        .put(format!("{allocator}/v1/pools/atlas/api"))
        .bearer_auth(OPERATOR)
        .json(
            &json!({ "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 15000,
                       "fallbackPerRegion": 10, "regions": ["eu"] }),
        )
        .send()
        .await
        .expect("pool over TLS");
    assert_eq!(pool.status(), 200);

    // allotctl with --ca-file and a client certificate.
    let listed = tokio::process::Command::new(workspace_binary("allotctl"))
        .args(["--server", &allocator, "--token", OPERATOR, "--json"])
        .arg("--ca-file")
        .arg(pki.ca())
        .arg("--client-cert")
        .arg(pki.client_cert())
        .arg("--client-key")
        .arg(pki.client_key())
        .args(["pools", "list"])
        .env_remove("ALLOT_TOKEN")
        .output()
        .await
        .expect("allotctl runs");
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let pools: Value = serde_json::from_slice(&listed.stdout).expect("json");
    assert_eq!(pools["pools"][0]["tenant"], "atlas");
    let refused_cli = tokio::process::Command::new(workspace_binary("allotctl"))
        .args(["--server", &allocator, "--token", OPERATOR, "pools", "list"])
        .arg("--ca-file")
        .arg(pki.ca())
        .env_remove("ALLOT_TOKEN")
        .output()
        .await
        .expect("allotctl runs");
    assert_eq!(refused_cli.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&refused_cli.stderr).starts_with("allotctl: 401"),
        "{}",
        String::from_utf8_lossy(&refused_cli.stderr)
    );
    // An agent that reaches the allocator with its certificate and serves gateways over TLS.
    let allocator_client =
        AllocatorClient::with_tls(vec![allocator.clone()], AGENT_EU.to_owned(), &member(&pki))
            .expect("allocator client");
    let bundle = allot_shared::policy::parse_bundle(
        &json!({ "rules": [
            { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }
        ]})
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
    let agent = Agent::new(
        AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("eu-tls").expect("agent id"),
            Pepper::new(b"tls-test-pepper-0123456789".to_vec()).expect("pepper"),
        ),
        clock,
        limiter,
        Some(Arc::new(allocator_client)),
        Some(bundle),
    );
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: None,
    };
    let gateway_tls = ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: None,
    };
    let acceptor = gateway_tls.acceptor().expect("acceptor");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let agent_url = format!(
        "https://127.0.0.1:{}",
        listener.local_addr().expect("addr").port()
    );
    tokio::spawn(serve(
        listener,
        api.clone(),
        Some(acceptor.clone()),
        std::future::pending(),
    ));
    let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let grpc_port = grpc_listener.local_addr().expect("addr").port();
    tokio::spawn(serve_grpc(
        grpc_listener,
        api,
        Some(acceptor),
        std::future::pending(),
    ));

    let gateway = client(&ClientTls {
        ca: Some(pki.ca()),
        ..ClientTls::default()
    });
    let admit: Value = gateway
        .post(format!("{agent_url}/v1/admit"))
        .bearer_auth(GATEWAY)
        .json(&json!({ "requestId": "r-1", "tenantId": "atlas",
                       "principal": { "type": "user", "id": "U-1" }, "routeGroup": "read",
                       "method": "GET" }))
        .send()
        .await
        .expect("admit over TLS")
        .json()
        .await
        .expect("json");
    assert_eq!(
        admit["allowed"], true,
        "a lease came over mutual TLS: {admit}"
    );

    let channel = tonic::transport::Channel::from_shared(format!("https://127.0.0.1:{grpc_port}"))
        .expect("uri")
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(
                    std::fs::read(pki.ca()).expect("ca"),
                ))
                .domain_name("localhost"),
        )
        .expect("tls config")
        .connect()
        .await
        .expect("gRPC over TLS");
    let mut rls = RateLimitServiceClient::new(channel);
    let entries = [
        ("tenant", "atlas"),
        ("user", "U-2"),
        ("route_group", "read"),
    ];
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: "envoy".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(key, value)| Entry {
                    key: (*key).to_owned(),
                    value: (*value).to_owned(),
                })
                .collect(),
            hits_addend: None,
            is_negative_hits: false,
        }],
        hits_addend: 0,
    });
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {GATEWAY}").parse().expect("metadata"),
    );
    let answer = rls.should_rate_limit(request).await.expect("RLS over TLS");
    assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);
}
