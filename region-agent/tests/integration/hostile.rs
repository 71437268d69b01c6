//! Hostile input against the agent's gateway APIs, as a table: malformed JSON, wrong types, unknown
//! fields, huge and negative numbers, empty and 10 MB bodies, unicode and reserved characters in ids,
//! over-long principals; and odd Envoy RLS calls. Each gets a 4xx problem+json (gRPC: an error status
//! or a decision, never a crash), and none spends a token: the user's bucket is whole afterwards.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::grpc::proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_region_agent::grpc::serve_grpc;
use allot_region_agent::http::{AgentApi, serve};
use serde_json::{Value, json};

use crate::common;

const GATEWAY: &str = "gateway-token-hostile-0001";

/// Three requests per user per minute.
const CAPACITY: usize = 3;

async fn start() -> (String, String) {
    let bundle = common::bundle(
        &json!({ "rules": [
            { "id": "per-user", "scope": "user", "principalType": "user", "algorithm": "token_bucket",
              "capacityMillis": 3000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed" }
        ]})
        .to_string(),
    );
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(bundle),
    );
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(vec![GATEWAY.to_owned()]),
        metrics: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let http = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(serve(listener, api.clone(), None, std::future::pending()));
    let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let grpc = format!("http://{}", grpc_listener.local_addr().expect("addr"));
    tokio::spawn(serve_grpc(grpc_listener, api, None, std::future::pending()));
    (http, grpc)
}

fn admission() -> Value {
    json!({ "requestId": "r-1", "tenantId": "atlas", "principal": { "type": "user", "id": "U-7" },
            "routeGroup": "read", "method": "GET" })
}

fn with(path: &[&str], value: Value) -> String {
    let mut body = admission();
    let mut target = &mut body;
    for key in &path[..path.len() - 1] {
        target = &mut target[*key];
    }
    target[path[path.len() - 1]] = value;
    body.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_gateway_input_gets_a_problem_and_spends_nothing() {
    let (http, grpc) = start().await;
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()
        .expect("client");
    // (body, content type, status, field)
    let mut cases: Vec<(String, Option<&str>, u16, Option<&str>)> = vec![
        (String::new(), Some("application/json"), 400, Some("body")),
        (
            "{\"requestId\": ".to_owned(),
            Some("application/json"),
            400,
            None,
        ),
        ("[]".to_owned(), Some("application/json"), 400, None),
        ("null".to_owned(), Some("application/json"), 400, None),
        ("{} {}".to_owned(), Some("application/json"), 400, None),
        // Deeper than serde_json's recursion limit, within the 16 KiB body limit.
        (
            format!("{}{}", "[".repeat(5_000), "]".repeat(5_000)),
            Some("application/json"),
            400,
            None,
        ),
        (admission().to_string(), Some("text/plain"), 415, None),
        (admission().to_string(), None, 415, None),
        ("x".repeat(10 << 20), Some("application/json"), 413, None),
    ];
    for (path, value, field) in [
        (&["requestId"][..], json!(""), "requestId"),
        (&["requestId"][..], json!(7), "requestId"),
        (&["tenantId"][..], json!("Atlas"), "tenantId"),
        (&["tenantId"][..], json!("atlas}"), "tenantId"),
        (&["tenantId"][..], json!("at:las"), "tenantId"),
        (&["tenantId"][..], json!("ätlas"), "tenantId"),
        (&["tenantId"][..], json!("a".repeat(33)), "tenantId"),
        (&["principal", "type"][..], json!("root"), "principal.type"),
        (&["principal", "id"][..], json!(""), "principal.id"),
        (
            &["principal", "id"][..],
            json!("u".repeat(257)),
            "principal.id",
        ),
        (&["principal", "id"][..], json!(17), "principal.id"),
        (&["routeGroup"][..], json!("read}"), "routeGroup"),
        (&["routeGroup"][..], json!(["read"]), "routeGroup"),
        (&["method"][..], json!(null), "method"),
        (&["costHint"][..], json!(-1), "costHint"),
        (&["costHint"][..], json!(0), "costHint"),
        (&["costHint"][..], json!(1.5), "costHint"),
        (&["costHint"][..], json!(1e300), "costHint"),
        (&["costHint"][..], json!("NaN"), "costHint"),
        (
            &["costHint"][..],
            json!(18_446_744_073_709_551_615u64),
            "costHint",
        ),
        (&["policyEpoch"][..], json!(-2), "policyEpoch"),
        (&["surprise"][..], json!(true), "surprise"),
    ] {
        cases.push((
            with(path, value),
            Some("application/json"),
            400,
            Some(field),
        ));
    }
    let mut failures = Vec::new();
    for endpoint in ["/v1/admit", "/v1/check", "/v1/release", "/v1/renew"] {
        for (body, content_type, status, field) in &cases {
            let mut request = client
                .post(format!("{http}{endpoint}"))
                .bearer_auth(GATEWAY)
                .body(body.clone());
            if let Some(content_type) = content_type {
                request = request.header("content-type", *content_type);
            }
            let label = format!("{endpoint} {:?}", &body[..body.len().min(80)]);
            let response = match request.send().await {
                Ok(response) => response,
                // An oversize body is refused from its Content-Length, before it is read: the
                // connection may close while the client is still sending.
                Err(_) if *status == 413 => continue,
                Err(error) => {
                    failures.push(format!("{label}: no answer: {error}"));
                    continue;
                }
            };
            let got = response.status().as_u16();
            let content = response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let problem: Value = response.json().await.unwrap_or(Value::Null);
            if got != *status || content != "application/problem+json" || problem["status"] != got {
                failures.push(format!(
                    "{label}: {got} {content} {problem}, expected {status}"
                ));
                continue;
            }
            if let Some(field) = field
                && problem["field"]
                    .as_str()
                    .is_none_or(|f| !f.starts_with(field))
            {
                failures.push(format!(
                    "{label}: names {}, expected {field}",
                    problem["field"]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // gRPC: odd calls answer with a status or a decision; none crashes or spends U-7's tokens.
    let mut rls = RateLimitServiceClient::connect(grpc.clone())
        .await
        .expect("connect");
    let descriptor = |entries: &[(&str, &str)]| RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        hits_addend: None,
        is_negative_hits: false,
    };
    let odd: Vec<(Vec<RateLimitDescriptor>, u32)> = vec![
        (vec![], 0),
        (vec![descriptor(&[])], 0),
        (
            vec![descriptor(&[("tenant", "atlas}"), ("user", "U-7")])],
            0,
        ),
        (vec![descriptor(&[("tenant", "ätlas"), ("user", "U-7")])], 0),
        (
            vec![descriptor(&[
                ("tenant", "atlas"),
                ("user", &"u".repeat(300)),
            ])],
            0,
        ),
        (
            vec![descriptor(&[
                ("tenant", "atlas"),
                ("user", "U-7"),
                ("route_group", "read"),
            ])],
            u32::MAX,
        ),
        (
            (0..1_000)
                .map(|n| descriptor(&[("k", &n.to_string())]))
                .collect(),
            0,
        ),
    ];
    for (descriptors, hits) in odd {
        let mut request = tonic::Request::new(RateLimitRequest {
            domain: "envoy".to_owned(),
            descriptors,
            hits_addend: hits,
        });
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {GATEWAY}").parse().expect("metadata"),
        );
        match rls.should_rate_limit(request).await {
            Ok(_) => {}
            Err(status) => assert!(
                matches!(
                    status.code(),
                    tonic::Code::InvalidArgument
                        | tonic::Code::ResourceExhausted
                        | tonic::Code::Unauthenticated
                ),
                "{status:?}"
            ),
        }
    }
    let unauthenticated = rls
        .should_rate_limit(tonic::Request::new(RateLimitRequest::default()))
        .await
        .expect_err("no token");
    assert_eq!(unauthenticated.code(), tonic::Code::Unauthenticated);

    // Nothing above spent a token: U-7 still has its whole bucket, and not one more.
    for n in 0..=CAPACITY {
        let decision: Value = client
            .post(format!("{http}/v1/admit"))
            .bearer_auth(GATEWAY)
            .json(
                &json!({ "requestId": format!("ok-{n}"), "tenantId": "atlas",
                           "principal": { "type": "user", "id": "U-7" }, "routeGroup": "read",
                           "method": "GET" }),
            )
            .send()
            .await
            .expect("admit")
            .json()
            .await
            .expect("json");
        assert_eq!(decision["allowed"], n < CAPACITY, "request {n}: {decision}");
    }
}
