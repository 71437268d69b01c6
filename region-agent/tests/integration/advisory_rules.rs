//! Shadow and soft rules: decided and counted, never denying. A shadow rule dark-launches a limit
//! (the decision, metrics, the decision log and the gateway's headers say what it would have done;
//! the caller is not told); a soft rule admits and flags the violation to the caller. A shadow
//! global rule spends no lease: its would-be usage goes to the ledger per window. Against the
//! stand-in allocator (a real remaining count; reports recorded) and the in-process store.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::service::Agent;
use allot_shared::contract::{AdmissionRequest, AdvisoryMode};
use serde_json::{Value, json};

use crate::common;

use crate::common::allocator::{Allocator, client};

const GATEWAY: &str = "gateway-token-for-advice";

/// A per-user burst guard being dark-launched (2 an hour, shadow); the tenant's monthly-style plan
/// told to callers when they go past it (3 an hour, soft, shown); a generous enforced per-user rule;
/// and the tenant's global pool, itself in shadow mode.
const BUNDLE: &str = r#"{ "rules": [
    { "id": "burst-guard", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 2, "windowMs": 3600000, "failMode": "closed", "mode": "shadow" },
    { "id": "plan", "scope": "tenant", "algorithm": "fixed_window", "limit": 3,
      "windowMs": 3600000, "failMode": "closed", "mode": "soft", "expose": true },
    { "id": "hidden-soft", "scope": "route", "routeGroup": "write", "algorithm": "fixed_window",
      "limit": 1, "windowMs": 3600000, "failMode": "closed", "mode": "soft" },
    { "id": "user-roomy", "scope": "user", "algorithm": "token_bucket",
      "capacityMillis": 100000, "refillMillis": 1000, "periodMs": 1000, "failMode": "closed" },
    { "id": "pool-shadow", "scope": "global", "pool": "api", "failMode": "closed",
      "mode": "shadow" } ] }"#;

fn request(n: u64, user: &str, route: &str) -> AdmissionRequest {
    common::user_request(&format!("a-{n}"), user, route)
}

async fn agent_with(fake: &Arc<Allocator>) -> Arc<Agent> {
    common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(BUNDLE)),
    )
}

/// The decision's would-be denials, as `mode:rule`.
fn violations(decision: &allot_shared::contract::Decision) -> Vec<String> {
    decision
        .violations
        .iter()
        .map(|v| {
            let mode = match v.mode {
                AdvisoryMode::Shadow => "shadow",
                AdvisoryMode::Soft => "soft",
            };
            format!("{mode}:{}", v.policy_id)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_rules_admit_name_their_would_be_denials_and_count_what_they_would_admit() {
    let fake = Allocator::new(10, 5, 0);
    let agent = agent_with(&fake).await;
    let mut named = Vec::new();
    for n in 0..6 {
        let decision = agent
            .admit(&request(n, "U-1", "read"))
            .await
            .expect("decision");
        assert!(decision.allowed, "advisory rules never deny: {decision:?}");
        assert_eq!(
            decision.policy_id.as_deref(),
            Some("user-roomy"),
            "headers never name an advisory rule"
        );
        named.push(violations(&decision));
    }
    // The burst guard would have admitted 2, the plan 3: their windows count what enforcing them
    // would have admitted, so the would-be denials start there and go on.
    assert!(named[0].is_empty() && named[1].is_empty(), "{named:?}");
    assert_eq!(named[2], ["shadow:burst-guard"]);
    for later in &named[3..] {
        assert_eq!(later, &["shadow:burst-guard", "soft:plan"]);
    }
    // Another user: their own guard is whole; the tenant's plan is spent.
    let other = agent
        .admit(&request(10, "U-2", "read"))
        .await
        .expect("decision");
    assert_eq!(violations(&other), ["soft:plan"]);

    // The shadow pool spent no lease: no grant was ever asked for. The ledger hears what it would
    // have spent.
    assert!(
        fake.wants.lock().expect("lock").is_empty(),
        "no grant asked"
    );
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 0);
    assert_eq!(
        fake.reported_shadow(),
        7,
        "every admitted request, counted once"
    );
    // Reported again only when it grows.
    agent.send_reports().await;
    assert_eq!(fake.reported_shadow(), 7);
    agent
        .admit(&request(11, "U-3", "read"))
        .await
        .expect("decision");
    agent.send_reports().await;
    assert_eq!(fake.reported_shadow(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_spends_no_advisory_rule_and_counts_nothing() {
    let fake = Allocator::new(10, 5, 0);
    let agent = agent_with(&fake).await;
    for n in 0..3 {
        let mut check = request(n, "U-1", "read");
        check.dry_run = true;
        let decision = agent.admit(&check).await.expect("decision");
        assert!(decision.allowed && violations(&decision).is_empty());
    }
    agent.send_reports().await;
    assert_eq!(fake.reported_shadow(), 0, "a check counts nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_flags_soft_violations_to_the_caller_and_shadow_ones_to_the_gateway() {
    let fake = Allocator::new(10, 5, 0);
    let url = common::serve_http(agent_with(&fake).await, GATEWAY).await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    let check = |n: u64, tenant: &str, route: &str| {
        http.post(format!("{url}/v1/check"))
            .bearer_auth(GATEWAY)
            .json(&json!({ "requestId": format!("h-{n}"), "tenantId": tenant,
                "principal": { "type": "user", "id": "U-9" }, "routeGroup": route,
                "method": "GET" }))
            .send()
    };
    let mut answers = Vec::new();
    for n in 0..4 {
        let answer = check(n, "atlas", "read").await.expect("check");
        assert_eq!(answer.status(), 200, "advisory rules never deny");
        let header = |name: &str| {
            answer
                .headers()
                .get(name)
                .map(|v| v.to_str().expect("ascii").to_owned())
        };
        answers.push((
            header("x-allot-shadow-denied"),
            header("x-allot-soft-limit-exceeded"),
        ));
    }
    assert_eq!(answers[0], (None, None));
    assert_eq!(answers[2], (Some("burst-guard".to_owned()), None));
    assert_eq!(
        answers[3],
        (Some("burst-guard".to_owned()), Some("\"plan\"".to_owned())),
        "the plan is exposed: its name is shown"
    );
    // A soft rule the caller may not see is flagged without its name (another tenant, whose plan
    // is whole).
    check(10, "borealis", "write").await.expect("check");
    let flagged = check(11, "borealis", "write").await.expect("check");
    assert_eq!(flagged.status(), 200);
    assert_eq!(flagged.headers()["x-allot-soft-limit-exceeded"], "?1");
    let body: Value = http
        .post(format!("{url}/v1/admit"))
        .bearer_auth(GATEWAY)
        .json(&json!({ "requestId": "h-12", "tenantId": "borealis",
            "principal": { "type": "user", "id": "U-9" }, "routeGroup": "write", "method": "GET" }))
        .send()
        .await
        .expect("admit")
        .json()
        .await
        .expect("json");
    assert_eq!(
        body["violations"][0],
        json!({ "policyId": "hidden-soft", "mode": "soft", "scope": "route" }),
        "{body}"
    );
}
