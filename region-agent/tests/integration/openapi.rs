//! The gateway API's OpenAPI document: valid by an outside validator, naming exactly the routes and
//! methods the router serves, and the running agent held to it by Schemathesis (every operation,
//! bad input included: no undocumented status, no 5xx but those documented, every answer's body,
//! headers and content type as documented, every call without a token refused).

use crate::common;

const GATEWAY: &str = "gateway-token-for-openapi-1";

/// Where the agent's contract is deliberately open.
const SCHEMATHESIS_CONFIG: &str = r#"
# HTTP headers are open: nginx's subrequest carries headers of its own beside the X-Allot ones, so
# an unknown header is no bad input.
[[operations]]
include-path = "/v1/auth-request"
generation.allow-extra-parameters = false
"#;

#[test]
fn the_document_is_valid_and_names_every_route_and_only_routes() {
    allot_testkit::check_openapi_document(
        allot_region_agent::openapi::document_json(),
        include_str!("../../src/http/mod.rs"),
        10,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_agent_answers_as_its_document_says() {
    let redis = allot_testkit::RedisServer::start();
    let bundle = r#"{ "rules": [
        { "id": "per-user", "scope": "user", "principalType": "user", "algorithm": "token_bucket",
          "capacityMillis": 5000, "refillMillis": 1000, "periodMs": 1000, "failMode": "closed" },
        { "id": "anon", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": 3, "windowMs": 1000, "failMode": "closed" },
        { "id": "exports", "scope": "tenant", "routeGroup": "export", "algorithm": "token_bucket",
          "capacityMillis": 100000, "refillMillis": 100000, "periodMs": 1000,
          "concurrencyMax": 2, "failMode": "closed" } ] }"#;
    let agent = common::agent_on_redis(
        &redis,
        allot_region_agent::limiter::LimiterConfig::default(),
        bundle,
    )
    .await;
    let url = common::serve_http(agent, GATEWAY).await;
    let schema_url = format!("{url}/openapi.json");
    let report = tokio::task::block_in_place(|| {
        allot_testkit::schemathesis(&allot_testkit::SchemathesisRun {
            schema_url: &schema_url,
            authorization: &format!("Bearer {GATEWAY}"),
            max_examples: 30,
            seed: 20_261_206,
            config: SCHEMATHESIS_CONFIG,
        })
    });
    assert!(report.contains("passed"), "{report}");
}
