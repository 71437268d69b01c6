//! The allocator API's OpenAPI document: valid by an outside validator, naming exactly the routes
//! and methods the router serves, and the running allocator (on a real etcd) held to it by
//! Schemathesis, once with an operator's token and once with a region agent's: every operation, bad
//! input included, no undocumented status, no 5xx but those documented, every answer as
//! documented, every call without a token refused.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::http::openapi::document_json;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::server::{Settings, run};
use allot_testkit::{EtcdCluster, SchemathesisRun};
use serde_json::Value;

const OPERATOR: &str = "operator-token-for-openapi-01";
const AGENT: &str = "agent-token-for-openapi-0001";

/// Where the allocator's contract is deliberately looser than its schemas can say.
const SCHEMATHESIS_CONFIG: &str = r#"
# A pool spec's rules across fields (chunk at most the limit, a lease shorter than the window,
# exactly one of windowMs and window, a time zone that exists) and a policy bundle's grammar (its
# own parser, docs/limiter.md) are checked past the schema: a schema-valid body may still be
# refused with 400 naming the field. Every other check still runs on these operations.
[[operations]]
include-path-regex = "^/v1/(pools|policies)"
checks.positive_data_acceptance.enabled = false

# Tokens are minted from a role and, for agents only, a region: a pair the schema cannot tie.
[[operations]]
include-path = "/v1/tokens"
checks.positive_data_acceptance.enabled = false

# A webhook URL the schema's pattern admits may still not parse as a URL with a host.
[[operations]]
include-path-regex = "^/v1/webhooks"
checks.positive_data_acceptance.enabled = false

# A usage range must end after it starts, and a cursor needs the query it came from.
[[operations]]
include-path = "/v1/usage"
checks.positive_data_acceptance.enabled = false

# Reports, grants and runs name leases, windows and pools that must exist and agree.
[[operations]]
include-path-regex = "^/v1/(grants|reports|agent-sessions)"
checks.positive_data_acceptance.enabled = false
"#;

#[test]
fn the_document_is_valid_openapi_3_1() {
    let document: Value = serde_json::from_str(document_json()).expect("JSON");
    assert!(
        document["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "{}",
        document["openapi"]
    );
    allot_testkit::validate_openapi(document_json());
}

#[test]
fn the_document_names_every_route_and_only_routes() {
    let routed = allot_testkit::routed_operations(include_str!("../src/http/mod.rs"));
    assert!(routed.len() >= 25, "the scan is broken: {routed:?}");
    assert_eq!(
        routed,
        allot_testkit::documented_operations(document_json()),
        "routes (left) and the document (right) differ"
    );
}

/// An allocator on `etcd` with its ledger in `dir`, ready: its URL.
async fn start_allocator(etcd: &EtcdCluster, dir: &std::path::Path) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let settings = Settings {
        listen: addr,
        etcd: etcd.endpoints(),
        tokens: Tokens {
            operator: vec![OPERATOR.to_owned()],
            agent: vec![AGENT.to_owned()],
        },
        node_id: "alloc-openapi".to_owned(),
        advertise_url: format!("http://{addr}"),
        leader_lease_ttl_s: 5,
        tls: None,
        etcd_history_minutes: 60,
        etcd_defragment: true,
        retention: Default::default(),
        webhook_ca: None,
        ledger_url: format!("sqlite://{}", dir.join("ledger.db").display()),
    };
    let kv = Arc::new(EtcdKv::connect(&settings.etcd).await.expect("etcd"));
    let ledger = Ledger::connect(&settings.ledger_url).await.expect("ledger");
    let clock = allot_allocator::server::system_clock();
    tokio::spawn(run(
        settings,
        kv,
        ledger,
        clock,
        listener,
        std::future::pending(),
    ));
    let url = format!("http://{addr}");
    let client = reqwest::Client::new();
    for _ in 0..400 {
        if let Ok(answer) = client.get(format!("{url}/readyz")).send().await
            && answer.status() == 200
        {
            return url;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the allocator never became ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_allocator_answers_as_its_document_says() {
    let etcd = EtcdCluster::single();
    let dir = tempfile::tempdir().expect("temp dir");
    let url = start_allocator(&etcd, dir.path()).await;
    let schema_url = format!("{url}/openapi.json");
    for token in [OPERATOR, AGENT] {
        let report = tokio::task::block_in_place(|| {
            allot_testkit::schemathesis(&SchemathesisRun {
                schema_url: &schema_url,
                authorization: &format!("Bearer {token}"),
                max_examples: 20,
                seed: 20_261_206,
                exclude_checks: &[],
                config: SCHEMATHESIS_CONFIG,
            })
        });
        assert!(report.contains("passed"), "{report}");
    }
}
