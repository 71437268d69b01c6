//! The override API on a real etcd: every refusal names its field, one override per target is in
//! force, viewers read and authors write, agents get the rule overrides as a versioned,
//! checksummed set (and nothing while they hold the latest), and without the agents' pepper a
//! principal can only be named by its hash.

use allot_shared::overrides::OverrideSet;
use serde_json::{Value, json};

use crate::common;

use crate::common::{AGENT, AUTHOR, OPERATOR, VIEWER};

async fn send(
    server: &common::Server,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = server
        .client
        .request(method, format!("{}{path}", server.url))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("call");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn post(server: &common::Server, body: Value) -> (u16, Value) {
    send(
        server,
        reqwest::Method::POST,
        "/v1/overrides",
        AUTHOR,
        Some(body),
    )
    .await
}

async fn get(server: &common::Server, path: &str, token: &str) -> (u16, Value) {
    send(server, reqwest::Method::GET, path, token, None).await
}

async fn setup(server: &common::Server) {
    let (status, _) = send(
        server,
        reqwest::Method::PUT,
        "/v1/pools/acme/api",
        OPERATOR,
        Some(
            json!({ "limit": 100, "windowMs": 60_000, "chunk": 10, "leaseTtlMs": 5_000,
                     "fallbackPerRegion": 0, "regions": ["eu"] }),
        ),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = send(
        server,
        reqwest::Method::PUT,
        "/v1/policies",
        OPERATOR,
        Some(json!({ "rules": [
            { "id": "per-user", "scope": "user", "algorithm": "token_bucket",
              "capacityMillis": 10_000, "refillMillis": 1_000, "periodMs": 1_000,
              "failMode": "closed" },
            { "id": "per-tenant", "scope": "tenant", "algorithm": "sliding_counter",
              "limit": 100, "windowMs": 60_000, "failMode": "closed" }
        ]})),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_are_checked_bounded_and_served_to_agents() {
    let etcd = allot_testkit::EtcdCluster::single();
    let server = common::start_with(common::Options {
        etcd: etcd.endpoints(),
        pepper: Some(
            allot_shared::keys::Pepper::new(b"override-test-pepper".to_vec()).expect("pepper"),
        ),
        ..Default::default()
    })
    .await;
    setup(&server).await;
    let base = json!({ "tenant": "acme", "reason": "why not" });
    let with = |extra: Value| {
        let mut body = base.clone();
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        body
    };
    // Every refusal names its field.
    let refusals = [
        (json!({}), "pool"),
        (
            json!({ "pool": "api", "rule": "per-user", "limit": 5 }),
            "rule",
        ),
        (json!({ "pool": "api" }), "limit"),
        (
            json!({ "pool": "api", "limit": 5, "capacityMillis": 5 }),
            "capacityMillis",
        ),
        (json!({ "rule": "nope", "limit": 5 }), "rule"),
        (json!({ "rule": "per-user" }), "limit"),
        (json!({ "rule": "per-user", "limit": 5 }), "limit"),
        (
            json!({ "rule": "per-tenant", "capacityMillis": 5_000 }),
            "capacityMillis",
        ),
        (json!({ "rule": "per-tenant", "limit": 0 }), "limit"),
        (
            json!({ "rule": "per-user", "capacityMillis": 500 }),
            "capacityMillis",
        ),
        (
            json!({ "rule": "per-tenant", "limit": 5,
                 "principal": { "type": "user", "id": "ann" } }),
            "principal",
        ),
        (
            json!({ "rule": "per-user", "capacityMillis": 50_000,
                 "principal": { "type": "ip", "id": "203.0.113.9" } }),
            "principal.type",
        ),
        (
            json!({ "rule": "per-user", "capacityMillis": 50_000,
                 "principal": { "type": "user" } }),
            "principal.id",
        ),
        (
            json!({ "rule": "per-user", "capacityMillis": 50_000, "expiresAtMs": 1 }),
            "expiresAtMs",
        ),
        (
            json!({ "rule": "per-user", "capacityMillis": 50_000, "reason": " " }),
            "reason",
        ),
    ];
    for (extra, field) in refusals {
        let body = with(extra);
        let (status, problem) = post(&server, body.clone()).await;
        assert_eq!(status, 400, "{body} -> {problem}");
        assert_eq!(problem["field"], field, "{body} -> {problem}");
    }
    let (status, problem) = post(&server, with(json!({ "pool": "nope", "limit": 5 }))).await;
    assert_eq!(status, 404, "{problem}");

    // Viewers read, authors write; agents only read the set.
    let (status, _) = send(
        &server,
        reqwest::Method::POST,
        "/v1/overrides",
        VIEWER,
        Some(with(json!({ "pool": "api", "limit": 5 }))),
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = get(&server, "/v1/overrides", AGENT).await;
    assert_eq!(status, 403);

    let (status, set) = get(&server, "/v1/overrides/current", AGENT).await;
    assert_eq!(status, 200, "{set}");
    assert_eq!(set["version"], 0);

    let user = with(json!({ "rule": "per-user", "capacityMillis": 50_000,
                            "principal": { "type": "api_key", "id": "key-7" } }));
    let (status, created) = post(&server, user.clone()).await;
    assert_eq!(status, 201, "{created}");
    let (status, again) = post(&server, user).await;
    assert_eq!(status, 409, "one in force per target: {again}");
    let (status, tenant_wide) =
        post(&server, with(json!({ "rule": "per-tenant", "limit": 500 }))).await;
    assert_eq!(status, 201, "{tenant_wide}");
    let (status, pool) = post(&server, with(json!({ "pool": "api", "limit": 500 }))).await;
    assert_eq!(status, 201, "{pool}");

    let (status, set) = get(&server, "/v1/overrides/current", AGENT).await;
    assert_eq!(status, 200);
    let set: OverrideSet = serde_json::from_value(set).expect("a set");
    let set = set.verify().expect("checksummed");
    assert_eq!(set.version, 3);
    assert_eq!(set.overrides.len(), 2, "rule overrides only");
    let path = format!("/v1/overrides/current?after={}", set.version);
    let response = server
        .client
        .get(format!("{}{path}", server.url))
        .bearer_auth(AGENT)
        .send()
        .await
        .expect("current");
    assert_eq!(
        response.status(),
        204,
        "nothing while the agent holds the latest"
    );

    // Terms carry the pool's override; the pool shows the limit in force.
    let (_, terms) = get(&server, "/v1/pools/acme/api/terms", AGENT).await;
    assert_eq!(terms["override"]["limit"], 500, "{terms}");
    let (_, shown) = get(&server, "/v1/pools/acme/api", VIEWER).await;
    assert_eq!(shown["window"]["limitNow"], 500, "{shown}");
    assert_eq!(shown["window"]["remaining"], 500, "{shown}");

    // Paged with a cursor; a viewer can read one.
    let (status, first) = get(&server, "/v1/overrides?limit=2", VIEWER).await;
    assert_eq!(status, 200);
    let next = first["next"].as_str().expect("a next page").to_owned();
    let (_, second) = get(
        &server,
        &format!("/v1/overrides?limit=2&after={next}"),
        VIEWER,
    )
    .await;
    let ids: Vec<&Value> = first["overrides"]
        .as_array()
        .into_iter()
        .chain(second["overrides"].as_array())
        .flatten()
        .map(|o| &o["id"])
        .collect();
    assert_eq!(ids.len(), 3);
    let (status, _) = get(&server, "/v1/overrides?after=junk", VIEWER).await;
    assert_eq!(status, 400);
    let one = format!("/v1/overrides/acme/{}", pool["id"].as_str().expect("id"));
    let (status, read) = get(&server, &one, VIEWER).await;
    assert_eq!((status, &read["limit"]), (200, &json!(500)));

    // Ended: the pool is back to its own limit, and its terms carry no override.
    let (status, ended) = send(&server, reqwest::Method::DELETE, &one, AUTHOR, None).await;
    assert_eq!(status, 200, "{ended}");
    let (_, terms) = get(&server, "/v1/pools/acme/api/terms", AGENT).await;
    assert!(terms.get("override").is_none(), "{terms}");
    let (status, _) = send(
        &server,
        reqwest::Method::DELETE,
        "/v1/overrides/acme/0190f5f0-0000-7000-8000-000000000000",
        AUTHOR,
        None,
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn without_the_pepper_a_principal_is_named_by_its_hash() {
    let server = common::start().await;
    setup(&server).await;
    let by_id = json!({ "tenant": "acme", "rule": "per-user", "capacityMillis": 50_000,
                        "principal": { "type": "user", "id": "ann" }, "reason": "vip" });
    let (status, problem) = post(&server, by_id).await;
    assert_eq!(status, 400);
    assert_eq!(problem["field"], "principal.id", "{problem}");
    let by_hash = json!({ "tenant": "acme", "rule": "per-user", "capacityMillis": 50_000,
                          "principal": { "type": "user", "hash": "00112233445566ff" },
                          "reason": "vip" });
    let (status, created) = post(&server, by_hash).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["principal"]["hash"], "00112233445566ff");
}
