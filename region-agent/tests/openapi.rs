//! The gateway API's OpenAPI document: valid by an outside validator, naming exactly the routes and
//! methods the router serves, and the running agent held to it by Schemathesis (every operation,
//! bad input included: no undocumented status, no 5xx but those documented, every answer's body,
//! headers and content type as documented, every call without a token refused).

use std::collections::BTreeSet;

use serde_json::Value;

mod common;

const GATEWAY: &str = "gateway-token-for-openapi-1";

/// Where the agent's contract is deliberately open.
const SCHEMATHESIS_CONFIG: &str = r#"
# HTTP headers are open: nginx's subrequest carries headers of its own beside the X-Allot ones, so
# an unknown header is no bad input.
[[operations]]
include-path = "/v1/auth-request"
generation.allow-extra-parameters = false
"#;

fn document() -> Value {
    serde_json::from_str(allot_region_agent::openapi::document_json()).expect("JSON")
}

/// (path, method) of every operation in the document.
fn documented(document: &Value) -> BTreeSet<(String, String)> {
    let mut operations = BTreeSet::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            operations.insert((path.clone(), method.clone()));
        }
    }
    operations
}

/// (path, method) of every route `source` (a router's code) declares: `.route("/p", get(a).post(b))`.
fn routed(source: &str) -> BTreeSet<(String, String)> {
    let mut operations = BTreeSet::new();
    for declaration in source.split(".route(").skip(1) {
        let Some(path) = declaration.split('"').nth(1) else {
            continue;
        };
        // The method routers up to the route's closing parenthesis.
        let mut depth = 1;
        let end = declaration
            .char_indices()
            .find_map(|(i, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(i)
            })
            .unwrap_or(declaration.len());
        let methods = &declaration[..end];
        for method in ["get", "post", "put", "delete", "patch"] {
            let called = methods
                .match_indices(&format!("{method}("))
                .any(|(i, _)| i == 0 || !methods.as_bytes()[i - 1].is_ascii_alphanumeric());
            if called {
                operations.insert((path.to_owned(), method.to_owned()));
            }
        }
    }
    operations
}

#[test]
fn the_document_is_valid_openapi_3_1() {
    let document = document();
    assert!(
        document["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "{}",
        document["openapi"]
    );
    allot_testkit::validate_openapi(allot_region_agent::openapi::document_json());
}

#[test]
fn the_document_names_every_route_and_only_routes() {
    let source = include_str!("../src/http.rs");
    let routed = routed(source);
    assert!(routed.len() >= 10, "the scan is broken: {routed:?}");
    assert_eq!(
        routed,
        documented(&document()),
        "routes (left) and the document (right) differ"
    );
    // The scan itself: a route with two methods, a path, and a handler named like a method.
    assert_eq!(
        routed_pairs(r#".route("/a", get(x).post(y)).route("/b", post(get_all))"#),
        [("/a", "get"), ("/a", "post"), ("/b", "post")]
    );
}

fn routed_pairs(source: &str) -> Vec<(&'static str, &'static str)> {
    routed(source)
        .into_iter()
        .map(|(p, m)| -> (&'static str, &'static str) {
            (Box::leak(p.into_boxed_str()), Box::leak(m.into_boxed_str()))
        })
        .collect()
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
            exclude_checks: &[],
            config: SCHEMATHESIS_CONFIG,
        })
    });
    assert!(report.contains("passed"), "{report}");
}
