//! The gateway HTTP API: `/v1/admit` answers decisions as JSON; `/v1/check` answers with the HTTP
//! status a proxy needs (429 with Retry-After, problem+json), also from `X-Allot-*` headers; callers
//! who did not authenticate learn nothing about limits; gateways must present a token.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use serde_json::{Value, json};

use crate::common;

const GATEWAY: &str = "gateway-token-for-tests-01";

async fn start() -> String {
    // One token per user per minute; anonymous callers: one per minute per address.
    let bundle = common::bundle(&json!({ "rules": [
            { "id": "per-user", "scope": "user", "principalType": "user", "algorithm": "token_bucket",
              "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed" },
            { "id": "anon", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
              "limit": 1, "windowMs": 60000, "failMode": "closed" }
        ]}).to_string());
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(bundle),
    );
    common::serve_http(agent, GATEWAY).await
}

/// Asserts `answer` refuses the request as bad input naming `field`.
async fn assert_refused(answer: reqwest::Response, field: &str) {
    assert_eq!(answer.status(), 400);
    assert_eq!(answer.json::<Value>().await.expect("json")["field"], field);
}

fn request(id: &str, kind: &str, who: &str) -> Value {
    json!({ "requestId": id, "tenantId": "atlas", "principal": { "type": kind, "id": who },
            "routeGroup": "read", "method": "GET" })
}

#[tokio::test]
async fn check_answers_with_the_status_a_proxy_needs() {
    let url = start().await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    let check = |body: Value| {
        http.post(format!("{url}/v1/check"))
            .bearer_auth(GATEWAY)
            .json(&body)
            .send()
    };
    assert_eq!(
        check(request("r-1", "user", "U-17"))
            .await
            .expect("check")
            .status(),
        200
    );
    let denied = check(request("r-2", "user", "U-17")).await.expect("check");
    assert_eq!(denied.status(), 429);
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    // The caller's own limit, in the draft's Structured Fields syntax.
    assert_eq!(
        denied.headers()["ratelimit-policy"],
        "\"per-user\";q=1;w=60"
    );
    assert_eq!(
        denied.headers()["ratelimit"].to_str().expect("ascii"),
        format!("\"per-user\";r=0;t={retry}")
    );
    let problem: Value = denied.json().await.expect("json");
    assert_eq!(
        problem["decisionId"], "r-2",
        "an authenticated caller gets its decision id"
    );

    // /v1/admit answers the decision itself.
    let decision: Value = http
        .post(format!("{url}/v1/admit"))
        .bearer_auth(GATEWAY)
        .json(&request("r-3", "user", "U-17"))
        .send()
        .await
        .expect("admit")
        .json()
        .await
        .expect("json");
    assert_eq!(decision["allowed"], false);
    assert_eq!(decision["deniedScope"], "user");
    assert_eq!(decision["policyId"], "per-user");
    assert_eq!(decision["reason"], "RATE_EXCEEDED");

    // Anonymous callers learn nothing about limits.
    assert_eq!(
        check(request("r-4", "ip", "203.0.113.9"))
            .await
            .expect("check")
            .status(),
        200
    );
    let anon = check(request("r-5", "ip", "203.0.113.9"))
        .await
        .expect("check");
    assert_eq!(anon.status(), 429);
    assert!(
        anon.headers().get("ratelimit").is_none(),
        "no limits for anonymous callers"
    );
    assert!(anon.headers().get("ratelimit-policy").is_none());
    let body = anon.text().await.expect("text");
    for secret in [
        "anon",
        "atlas",
        "\"limit\"",
        "remaining",
        "decisionId",
        "r-5",
    ] {
        assert!(
            !body.contains(secret),
            "{secret:?} leaked to an anonymous caller: {body}"
        );
    }
}

/// nginx's `auth_request` passes on 2xx, 401 and 403 only: a denial is a 403 that carries the status
/// the caller should get, and the subrequest (a GET) is read from headers.
#[tokio::test]
async fn auth_request_answers_in_the_statuses_nginx_passes_on() {
    let url = start().await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    let ask = |method: reqwest::Method, id: &str, token: &str| {
        http.request(method, format!("{url}/v1/auth-request"))
            .bearer_auth(token)
            .header("x-allot-request-id", id)
            .header("x-allot-tenant", "atlas")
            .header("x-allot-principal-type", "user")
            .header("x-allot-principal-id", "U-41")
            .header("x-allot-route-group", "read")
            .header("x-allot-method", "POST")
            .send()
    };
    let admitted = ask(reqwest::Method::GET, "n-1", GATEWAY)
        .await
        .expect("auth");
    assert_eq!(admitted.status(), 204);
    assert!(admitted.headers().get("x-allot-status").is_none());
    assert_eq!(
        admitted.headers()["ratelimit-policy"],
        "\"per-user\";q=1;w=60"
    );
    let denied = ask(reqwest::Method::GET, "n-2", GATEWAY)
        .await
        .expect("auth");
    assert_eq!(denied.status(), 403);
    assert_eq!(denied.headers()["x-allot-status"], "429");
    let retry: u64 = denied.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    // A wrong gateway token and bad input keep their statuses, which nginx makes errors, never
    // admissions.
    assert_eq!(
        ask(reqwest::Method::GET, "n-3", "not-a-gateway-token-00001")
            .await
            .expect("auth")
            .status(),
        401
    );
    let missing = http
        .get(format!("{url}/v1/auth-request"))
        .bearer_auth(GATEWAY)
        .header("x-allot-request-id", "n-4")
        .header("x-allot-tenant", "atlas")
        .send()
        .await
        .expect("auth");
    assert_refused(missing, "x-allot-principal-type").await;
}

#[tokio::test]
async fn check_takes_headers_and_refuses_bad_input() {
    let url = start().await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    let with_headers = |id: &str, extra: Option<(&str, &str)>| {
        let mut request = http
            .post(format!("{url}/v1/check"))
            .bearer_auth(GATEWAY)
            .header("x-allot-request-id", id)
            .header("x-allot-tenant", "atlas")
            .header("x-allot-principal-type", "user")
            .header("x-allot-principal-id", "U-99")
            .header("x-allot-route-group", "read");
        if let Some((name, value)) = extra {
            request = request.header(name, value);
        }
        request.send()
    };
    assert_eq!(
        with_headers("h-1", None).await.expect("check").status(),
        200
    );
    assert_eq!(
        with_headers("h-2", None).await.expect("check").status(),
        429
    );
    let bad = with_headers("h-3", Some(("x-allot-cost", "lots")))
        .await
        .expect("check");
    assert_refused(bad, "x-allot-cost").await;
    let missing = http
        .post(format!("{url}/v1/check"))
        .bearer_auth(GATEWAY)
        .header("x-allot-request-id", "h-4")
        .send()
        .await
        .expect("check");
    assert_refused(missing, "x-allot-tenant").await;
    let hostile = http
        .post(format!("{url}/v1/admit"))
        .bearer_auth(GATEWAY)
        .json(&json!({ "requestId": "x", "tenantId": "at}las", "principal": { "type": "user", "id": "u" },
                       "routeGroup": "read", "method": "GET" }))
        .send()
        .await
        .expect("admit");
    assert_refused(hostile, "tenantId").await;
    // A whole admit followed by anything but whitespace is not one document: refused, not read in
    // part.
    let mut trailing = serde_json::to_vec(&request("r-trailing", "user", "U-1")).expect("json");
    trailing.extend_from_slice(b" {}");
    let trailing = http
        .post(format!("{url}/v1/admit"))
        .bearer_auth(GATEWAY)
        .header("content-type", "application/json")
        .body(trailing)
        .send()
        .await
        .expect("admit");
    assert_refused(trailing, "body").await;
    let unauthenticated = http
        .post(format!("{url}/v1/admit"))
        .json(&request("r-1", "user", "U-1"))
        .send()
        .await
        .expect("admit");
    assert_eq!(unauthenticated.status(), 401);
}

/// An outage knows the caller's policy but not what is left of it: `/v1/check` answers 503 with
/// the policy alone, never a `RateLimit` field that says the quota is used up. And an admission
/// that took the last unit says when more comes (the window), not `t=0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_never_claims_the_quota_is_used_up() {
    use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
    let mut redis = allot_testkit::RedisServer::start();
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default())
        .await
        .expect("redis");
    let limiter = Limiter::new(Arc::new(store), LimiterConfig::default()).expect("limiter");
    let bundle = common::bundle(
        &json!({ "rules": [
            { "id": "read-user", "scope": "user", "principalType": "user", "routeGroup": "read",
              "algorithm": "fixed_window", "limit": 2, "windowMs": 60000, "failMode": "closed" }
        ]})
        .to_string(),
    );
    let agent = allot_region_agent::service::Agent::new(
        common::settings(),
        Arc::new(SystemClock),
        limiter,
        None,
        Some(bundle),
    );
    let url = common::serve_http(agent, GATEWAY).await;
    let http = reqwest::Client::new();
    let check = |id: &str| {
        http.post(format!("{url}/v1/check"))
            .bearer_auth(GATEWAY)
            .json(&request(id, "user", "U-17"))
            .send()
    };
    let first = check("r-1").await.expect("check");
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["ratelimit"], "\"read-user\";r=1;t=0");
    let last = check("r-2").await.expect("check");
    assert_eq!(last.status(), 200);
    assert_eq!(
        last.headers()["ratelimit"],
        "\"read-user\";r=0;t=60",
        "none left: more comes with the next window, not now"
    );
    redis.stop();
    let outage = check("r-3").await.expect("check");
    assert_eq!(outage.status(), 503);
    assert!(
        outage.headers().get("ratelimit").is_none(),
        "an outage does not know what is left: {:?}",
        outage.headers()
    );
    assert_eq!(
        outage.headers()["ratelimit-policy"],
        "\"read-user\";q=2;w=60"
    );
}
