//! Overrides end to end: a real allocator on a real etcd, an agent on a real Redis. An operator
//! raises one user's limit of a shared per-user rule and one tenant's global pool; the agent takes
//! the rule override with its next policy refresh, the allocator grants the raised pool at once,
//! `GET /v1/quota` shows where each limit comes from, and ending them puts the policy's limits
//! back, while the ledger holds the window to the highest limit that was in force in it. Run on a
//! SQLite ledger and on a PostgreSQL one.

use serde_json::{Value, json};

use crate::stack;
use crate::topology;

use crate::stack::{
    GATEWAY, OPERATOR, put_pool, start_agent, start_allocator_with_ledger, windows,
};
use allot_testkit::{EtcdCluster, RedisServer};

fn request(n: usize, user: &str, route: &str) -> Value {
    json!({ "requestId": format!("o-{n}"), "tenantId": "atlas",
            "principal": { "type": "user", "id": user }, "routeGroup": route, "method": "GET" })
}

/// Sends `body` as `method` to the allocator at `url`; the status and the JSON answer.
async fn call(method: reqwest::Method, url: String, body: Option<Value>) -> (u16, Value) {
    let mut request = stack::http().request(method, url).bearer_auth(OPERATOR);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("call");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_change_one_users_rule_and_one_tenants_pool_until_they_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    overrides_end_to_end(&ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_end_to_end_on_a_postgresql_ledger() {
    let (url, name) = topology::create_database("allot_overrides").await;
    overrides_end_to_end(&url).await;
    topology::drop_database(&name).await;
}

async fn overrides_end_to_end(ledger_url: &str) {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let allocator = start_allocator_with_ledger(&etcd, ledger_url).await;
    put_pool(
        &allocator,
        "atlas",
        "api",
        &json!({ "limit": 5, "windowMs": 3_600_000, "chunk": 5, "leaseTtlMs": 60_000,
                 "fallbackPerRegion": 0, "regions": ["eu"] }),
    )
    .await;
    let rules = json!({ "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 3, "windowMs": 3_600_000, "failMode": "closed" },
        { "id": "global-api", "scope": "global", "routeGroup": "write", "pool": "api",
          "failMode": "closed", "expose": true }
    ]});
    let published = stack::http()
        .put(format!("{allocator}/v1/policies"))
        .bearer_auth(OPERATOR)
        .json(&rules)
        .send()
        .await
        .expect("publish");
    assert_eq!(published.status(), 200);
    let (agent, url) = start_agent("eu", &allocator, &redis, stack::bundle(&rules)).await;
    let http = stack::http();
    let admit = |n: usize, user: &str, route: &str| {
        let (http, url, body) = (http.clone(), url.clone(), request(n, user, route));
        async move {
            let decision: Value = http
                .post(format!("{url}/v1/admit"))
                .bearer_auth(GATEWAY)
                .json(&body)
                .send()
                .await
                .expect("admit")
                .json()
                .await
                .expect("decision");
            decision["allowed"].as_bool().expect("allowed")
        }
    };
    let quota = |user: &str| {
        let (http, url) = (http.clone(), url.clone());
        let query = format!("{url}/v1/quota?tenantId=atlas&principalType=user&principalId={user}");
        async move {
            let status: Value = http
                .get(query)
                .bearer_auth(GATEWAY)
                .send()
                .await
                .expect("quota")
                .json()
                .await
                .expect("json");
            status["quotas"].as_array().cloned().unwrap_or_default()
        }
    };
    let line = |lines: &[Value], rule: &str| {
        lines
            .iter()
            .find(|l| l["policyId"] == rule)
            .cloned()
            .unwrap_or_else(|| panic!("no quota line for {rule} in {lines:?}"))
    };

    // Alice's own limit of the shared per-user rule goes to 5, by her id: the allocator hashes
    // it as the agents do and stores only the hash.
    let (status, alice_override) = call(
        reqwest::Method::POST,
        format!("{allocator}/v1/overrides"),
        Some(json!({ "tenant": "atlas", "rule": "user-read",
                     "principal": { "type": "user", "id": "alice" }, "limit": 5,
                     "reason": "support ticket 42" })),
    )
    .await;
    assert_eq!(status, 201, "{alice_override}");
    assert!(
        !alice_override.to_string().contains("alice"),
        "{alice_override}"
    );
    let expected_hash = allot_shared::keys::principal_hash(
        &allot_shared::keys::Pepper::new(stack::PEPPER.to_vec()).expect("pepper"),
        allot_shared::contract::PrincipalType::User,
        "alice",
        allot_shared::keys::IpPrefixes::default(),
    );
    assert_eq!(alice_override["principal"]["hash"], expected_hash.as_str());
    // The tenant's pool goes from 5 to 8 tokens a window.
    let (status, pool_override) = call(
        reqwest::Method::POST,
        format!("{allocator}/v1/overrides"),
        Some(json!({ "tenant": "atlas", "pool": "api", "limit": 8,
                     "reason": "launch week" })),
    )
    .await;
    assert_eq!(status, 201, "{pool_override}");
    agent.refresh_policy().await;

    let alice: Vec<bool> = futures_sequential(5, |n| admit(n, "alice", "read")).await;
    assert_eq!(alice, [true; 5], "alice's override admits 5");
    assert!(!admit(5, "alice", "read").await, "and not a sixth");
    let bob: Vec<bool> = futures_sequential(4, |n| admit(100 + n, "bob", "read")).await;
    assert_eq!(bob, [true, true, true, false], "bob keeps the policy's 3");
    let writes: Vec<bool> = futures_sequential(9, |n| admit(200 + n, "carol", "write")).await;
    assert_eq!(
        writes.iter().filter(|a| **a).count(),
        8,
        "the pool grants its raised 8"
    );
    assert!(!writes[8], "and the ninth is refused");

    let alice_lines = quota("alice").await;
    let read = line(&alice_lines, "user-read");
    assert_eq!(
        (read["limit"].as_u64(), read["remaining"].as_u64()),
        (Some(5), Some(0))
    );
    assert_eq!(read["overrideId"], alice_override["id"]);
    let global = line(&alice_lines, "global-api");
    assert_eq!(global["limit"].as_u64(), Some(8));
    assert_eq!(global["overrideId"], pool_override["id"]);
    let bob_read = line(&quota("bob").await, "user-read");
    assert_eq!(bob_read["limit"].as_u64(), Some(3));
    assert!(bob_read.get("overrideId").is_none(), "{bob_read}");

    // Listed, and audited with the actor.
    let (status, listed) = call(
        reqwest::Method::GET,
        format!("{allocator}/v1/overrides?tenant=atlas"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(listed["overrides"].as_array().map(Vec::len), Some(2));
    // Ending both puts the policy's limits back: alice has used 5 of the rule's 3 now.
    for ended in [&alice_override, &pool_override] {
        let (status, answer) = call(
            reqwest::Method::DELETE,
            format!(
                "{allocator}/v1/overrides/atlas/{}",
                ended["id"].as_str().expect("id")
            ),
            None,
        )
        .await;
        assert_eq!(status, 200, "{answer}");
        assert!(answer["expiresAtMs"].as_u64().is_some());
    }
    agent.refresh_policy().await;
    assert!(!admit(300, "alice", "read").await, "back to the policy's 3");
    assert_eq!(
        line(&quota("alice").await, "user-read")["limit"].as_u64(),
        Some(3)
    );
    let (_, audit) = call(
        reqwest::Method::GET,
        format!("{allocator}/v1/audit?last=10"),
        None,
    )
    .await;
    let actions: Vec<&str> = audit["entries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["action"].as_str())
        .filter(|a| a.starts_with("override."))
        .collect();
    assert_eq!(actions.len(), 4, "two created, two ended: {audit}");

    // The window's accounting holds it to the highest limit in force during it.
    agent.send_reports().await;
    let rows = windows(&allocator, "atlas", "api", 1).await;
    assert_eq!(rows[0]["limit"].as_u64(), Some(8), "{rows:?}");
    assert_eq!(rows[0]["overshoot"].as_u64(), Some(0), "{rows:?}");
}

/// `count` requests one after another (each decision depends on the ones before).
async fn futures_sequential<F, Fut>(count: usize, mut make: F) -> Vec<bool>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut out = Vec::with_capacity(count);
    for n in 0..count {
        out.push(make(n).await);
    }
    out
}
