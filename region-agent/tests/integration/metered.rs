//! Charging after the response: a metered admission charges its estimate, `POST /v1/settle`
//! states the actual cost once (idempotent by decision id), and the difference is charged where
//! the estimate was: regional rules in one all-or-nothing store call, global pools through the
//! holder; what cannot be paid at once is debt the next admissions pay first, bounded, and what
//! is beyond the bound is written off and reported. Against the stand-in allocator (a real
//! remaining count, reports recorded) and the in-process store (the script's twin).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::service::Agent;
use allot_region_agent::service::settlement::SettleError;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Reason, SettleRequest};
use allot_shared::ids::{DecisionId, TenantId};
use serde_json::{Value, json};

use crate::common;

use crate::common::allocator::{Allocator, client};

const GATEWAY: &str = "gateway-token-for-metered-1";

/// Per user on `chat`: a bucket of 10 units refilled whole every 200 ms; the tenant's pool.
const BUNDLE: &str = r#"{ "rules": [
    { "id": "user-chat", "scope": "user", "routeGroup": "chat", "algorithm": "token_bucket",
      "capacityMillis": 10000, "refillMillis": 10000, "periodMs": 200, "failMode": "closed" },
    { "id": "plan", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

/// The tenant's pool alone.
const POOL_ONLY: &str = r#"{ "rules": [
    { "id": "plan", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

fn metered(n: u64, user: &str, estimate: u64) -> AdmissionRequest {
    AdmissionRequest {
        cost_hint: estimate,
        metered: true,
        ..common::user_request(&format!("m-{n}"), user, "chat")
    }
}

fn settle(n: u64, actual: u64) -> SettleRequest {
    SettleRequest {
        decision_id: DecisionId::parse(&format!("m-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        actual_cost_units: actual,
    }
}

async fn agent_with(fake: &Arc<Allocator>, bundle: &str) -> Arc<Agent> {
    common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(bundle)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_actual_cost_is_charged_once_and_an_overestimate_is_not_refunded() {
    let fake = Allocator::new(1_000, 100, 0);
    let agent = agent_with(&fake, BUNDLE).await;
    let before_ms = agent.now_ms();
    let admitted = agent.admit(&metered(1, "U-1", 2)).await.expect("decision");
    assert!(admitted.allowed, "{admitted:?}");
    let settle_by_ms = admitted
        .settle_by_ms
        .expect("a metered admission has a deadline");
    assert!(
        settle_by_ms >= before_ms + 300_000 - 1_000,
        "the default window"
    );
    // 2 estimated, 7 used: 5 more, on the user's bucket (8 left) and the pool.
    let answer = agent.settle(&settle(1, 7)).await.expect("settled");
    assert_eq!(
        (
            answer.estimate_units,
            answer.extra_units,
            answer.unused_units
        ),
        (2, 5, 0)
    );
    assert_eq!(
        (answer.regional.paid, answer.regional.owed),
        (5, 0),
        "{answer:?}"
    );
    assert_eq!(answer.pools.len(), 1, "{answer:?}");
    assert_eq!((answer.pools[0].paid, answer.pools[0].owed), (5, 0));
    // Again, the same: the first answer, charged nothing more.
    let again = agent.settle(&settle(1, 7)).await.expect("replayed");
    assert!(again.replayed);
    assert_eq!(again.regional, answer.regional);
    // Another cost for the same decision is a conflict; an unknown id is not open.
    assert!(matches!(
        agent.settle(&settle(1, 9)).await,
        Err(SettleError::Conflict(_))
    ));
    assert_eq!(
        agent.settle(&settle(404, 1)).await,
        Err(SettleError::NotOpen)
    );
    // Only 3 units left of the user's 10: a request of 4 is denied by the user's rule.
    let denied = agent
        .admit(&AdmissionRequest {
            cost_hint: 4,
            ..common::user_request("r-2", "U-1", "chat")
        })
        .await
        .expect("decision");
    assert_eq!(denied.denied_scope, Some(DeniedScope::User), "{denied:?}");
    // An overestimate gives nothing back: 6 estimated, 1 used.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let admitted = agent.admit(&metered(3, "U-2", 6)).await.expect("decision");
    assert!(admitted.allowed);
    let answer = agent.settle(&settle(3, 1)).await.expect("settled");
    assert_eq!((answer.unused_units, answer.extra_units), (5, 0));
    agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        2 + 5 + 6,
        "the pool spent each estimate and the extra, and refunded nothing"
    );
    // A settlement of a request that was not metered is not open.
    let plain = agent
        .admit(&common::user_request("m-5", "U-3", "chat"))
        .await
        .expect("decision");
    assert!(plain.allowed && plain.settle_by_ms.is_none());
    assert_eq!(agent.settle(&settle(5, 3)).await, Err(SettleError::NotOpen));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_pays_its_regional_debt_before_its_next_admission() {
    let fake = Allocator::new(1_000, 100, 0);
    let agent = agent_with(&fake, BUNDLE).await;
    let admitted = agent.admit(&metered(1, "U-1", 8)).await.expect("decision");
    assert!(admitted.allowed, "{admitted:?}");
    // 8 estimated, 15 used: 7 more does not fit in the 2 left, so it is owed.
    let answer = agent.settle(&settle(1, 15)).await.expect("settled");
    assert_eq!(
        (
            answer.regional.paid,
            answer.regional.owed,
            answer.regional.written_off
        ),
        (0, 7, 0),
        "{answer:?}"
    );
    // The next request (of 1) pays the 7 first: with 2 left, it is denied by the user's rule,
    // and a check says the same.
    let denied = agent
        .admit(&common::user_request("r-2", "U-1", "chat"))
        .await
        .expect("decision");
    assert!(!denied.allowed, "{denied:?}");
    assert_eq!(denied.denied_scope, Some(DeniedScope::User));
    assert_eq!(denied.reason, Some(Reason::RateExceeded));
    assert_eq!(denied.decision_id.as_str(), "r-2");
    let check = agent
        .admit(&AdmissionRequest {
            dry_run: true,
            ..common::user_request("r-3", "U-1", "chat")
        })
        .await
        .expect("decision");
    assert!(!check.allowed && check.dry_run, "{check:?}");
    // Another user owes nothing.
    let other = agent
        .admit(&common::user_request("r-4", "U-2", "chat"))
        .await
        .expect("decision");
    assert!(other.allowed, "{other:?}");
    // Once the bucket refilled, the debt is paid (7) and the request (1) admitted: 2 left.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let paid = agent
        .admit(&common::user_request("r-5", "U-1", "chat"))
        .await
        .expect("decision");
    assert!(paid.allowed, "{paid:?}");
    assert_eq!(paid.remaining_units, 2, "{paid:?}");
    // Paid: the next request is admitted at once.
    let next = agent
        .admit(&common::user_request("r-6", "U-1", "chat"))
        .await
        .expect("decision");
    assert!(next.allowed, "{next:?}");
    assert_eq!(next.remaining_units, 1);
    // A debt above what the rule admits from empty is owed up to one full limit: 8 estimated,
    // 40 used: 32 more, 10 owed, 22 written off.
    tokio::time::sleep(Duration::from_millis(250)).await;
    agent.admit(&metered(7, "U-3", 8)).await.expect("decision");
    let answer = agent.settle(&settle(7, 40)).await.expect("settled");
    assert_eq!(
        (answer.regional.owed, answer.regional.written_off),
        (10, 22),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_pays_its_debt_first_from_the_next_lease_and_writes_off_beyond_its_bound() {
    let fake = Allocator::new(1_000, 10, 0);
    fake.settle_debt_per_region_tokens
        .store(20, Ordering::SeqCst);
    let agent = agent_with(&fake, POOL_ONLY).await;
    let admitted = agent.admit(&metered(1, "U-1", 1)).await.expect("decision");
    assert!(admitted.allowed, "{admitted:?}");
    // 1 estimated, 50 used: 49 more; what the lease holds is paid, 20 owed, the rest written off.
    let answer = agent.settle(&settle(1, 50)).await.expect("settled");
    let pool = &answer.pools[0];
    assert_eq!(pool.paid + pool.owed + pool.written_off, 49, "{answer:?}");
    assert_eq!(pool.owed, 20, "{answer:?}");
    assert!(
        pool.paid <= 9,
        "at most what the first lease held: {answer:?}"
    );
    agent.send_reports().await;
    assert_eq!(
        fake.reported_settle_debt(),
        20,
        "the debt carried is reported"
    );
    assert_eq!(fake.reported_written_off(), pool.written_off);
    // The next admissions pay the debt first, from the next leases (chunks of 10).
    let mut admitted_after = 0;
    for n in 0..60 {
        let decision = agent
            .admit(&common::user_request(&format!("r-{n}"), "U-1", "chat"))
            .await
            .expect("decision");
        admitted_after += u64::from(decision.allowed);
        if admitted_after >= 5 {
            break;
        }
    }
    assert_eq!(
        admitted_after, 5,
        "the debt is paid, and requests admitted again"
    );
    agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        1 + pool.paid + 20 + 5,
        "the estimate, the extra paid at once, the debt paid later, the requests after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_over_http_names_the_field_at_fault() {
    let fake = Allocator::new(1_000, 100, 0);
    let agent = agent_with(&fake, BUNDLE).await;
    let url = common::serve_http(agent.clone(), GATEWAY).await;
    let http = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        http.post(format!("{url}{path}"))
            .bearer_auth(GATEWAY)
            .json(&body)
            .send()
    };
    let request = json!({
        "requestId": "h-1", "tenantId": "atlas", "principal": {"type": "user", "id": "U-1"},
        "routeGroup": "chat", "method": "POST", "costHint": 3, "metered": true,
    });
    let decision: Value = post("/v1/admit", request.clone())
        .await
        .expect("admit")
        .json()
        .await
        .expect("json");
    assert_eq!(decision["allowed"], true, "{decision}");
    assert!(decision["settleByMs"].as_u64().is_some(), "{decision}");
    let settle_body = json!({"decisionId": "h-1", "tenantId": "atlas", "actualCost": 4});
    let answer = post("/v1/settle", settle_body.clone())
        .await
        .expect("settle");
    assert_eq!(answer.status(), 200);
    let answer: Value = answer.json().await.expect("json");
    assert_eq!(
        (answer["extra"].clone(), answer["regional"]["paid"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(answer["pools"][0]["pool"], "api", "{answer}");
    // Refusals are problem+json naming the field.
    for (body, status, field) in [
        (
            json!({"decisionId": "h-9", "tenantId": "atlas", "actualCost": 4}),
            404,
            "decisionId",
        ),
        (
            json!({"decisionId": "h-1", "tenantId": "atlas", "actualCost": 5}),
            409,
            "actualCost",
        ),
        (
            json!({"decisionId": "h-1", "tenantId": "atlas", "actualCost": 2_000_000_000u64}),
            400,
            "actualCost",
        ),
        (
            json!({"decisionId": "h-1", "tenantId": "atlas"}),
            400,
            "actualCost",
        ),
        (
            json!({"decisionId": "h-1", "tenantId": "atlas", "actualCost": 1, "refund": true}),
            400,
            "refund",
        ),
    ] {
        let response = post("/v1/settle", body.clone()).await.expect("settle");
        assert_eq!(response.status(), status, "{body}");
        let problem: Value = response.json().await.expect("problem");
        assert_eq!(problem["field"], field, "{body} -> {problem}");
    }
    // Another tenant cannot settle (or learn of) this tenant's decision.
    let foreign = post(
        "/v1/settle",
        json!({"decisionId": "h-1", "tenantId": "borealis", "actualCost": 4}),
    )
    .await
    .expect("settle");
    assert_eq!(foreign.status(), 404);
    // A metered dry run is refused: there is nothing to settle.
    let mut dry = request.clone();
    dry["requestId"] = json!("h-2");
    dry["dryRun"] = json!(true);
    let refused = post("/v1/admit", dry).await.expect("admit");
    assert_eq!(refused.status(), 400);
    let problem: Value = refused.json().await.expect("problem");
    assert_eq!(problem["field"], "metered", "{problem}");
    // /v1/check from headers: the deadline comes back in a header.
    let checked = http
        .post(format!("{url}/v1/check"))
        .bearer_auth(GATEWAY)
        .header("x-allot-request-id", "h-3")
        .header("x-allot-tenant", "atlas")
        .header("x-allot-principal-type", "user")
        .header("x-allot-principal-id", "U-2")
        .header("x-allot-route-group", "chat")
        .header("x-allot-cost", "2")
        .header("x-allot-metered", "true")
        .send()
        .await
        .expect("check");
    assert_eq!(checked.status(), 200);
    assert!(
        checked.headers().get("x-allot-settle-by-ms").is_some(),
        "{:?}",
        checked.headers()
    );
    let answer = post(
        "/v1/settle",
        json!({"decisionId": "h-3", "tenantId": "atlas", "actualCost": 2}),
    )
    .await
    .expect("settle");
    assert_eq!(answer.status(), 200);
}

/// A retried admission of a metered request still open keeps the first's settlement and its
/// deadline: one open settlement per request, however often it is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_metered_admission_keeps_the_first_deadline() {
    let fake = Allocator::new(1_000, 100, 0);
    let agent = agent_with(&fake, BUNDLE).await;
    let first = agent.admit(&metered(9, "U-9", 1)).await.expect("decision");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let retried = agent.admit(&metered(9, "U-9", 1)).await.expect("decision");
    assert!(first.allowed && retried.allowed, "{first:?} {retried:?}");
    assert!(first.settle_by_ms.is_some());
    assert_eq!(retried.settle_by_ms, first.settle_by_ms);
}
