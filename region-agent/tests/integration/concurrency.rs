//! Concurrency caps in the admission pipeline (the reference design's exports): at most 3 in flight
//! per tenant; the fourth is refused as CONCURRENCY_EXCEEDED even though the rate rule has budget;
//! a released slot admits the next; a request the rate rule denies gives its slot back.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

fn export(n: usize, cost: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("r-e{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-17".to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("export").expect("route"),
        method: "POST".to_owned(),
        cost_hint: cost,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test]
async fn the_fourth_concurrent_export_is_refused_and_releases_free_slots() {
    let bundle = common::bundle(
        r#"{ "rules": [ { "id": "export-tenant", "scope": "tenant", "routeGroup": "export",
            "algorithm": "token_bucket", "capacityMillis": 1000000, "refillMillis": 1000000,
            "periodMs": 60000, "costMillis": 10000, "chargesCostHint": true, "concurrencyMax": 3,
            "failMode": "closed", "idempotent": true } ] }"#,
    );
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(bundle),
    );
    for n in 1..=3 {
        let d = agent.admit(&export(n, 1)).await.expect("decision");
        assert!(d.allowed, "export {n}: {d:?}");
    }
    let fourth = agent.admit(&export(4, 1)).await.expect("decision");
    assert!(!fourth.allowed);
    assert_eq!(fourth.denied_scope, Some(DeniedScope::Concurrency));
    assert_eq!(fourth.reason, Some(Reason::ConcurrencyExceeded));
    assert_eq!((fourth.limit_units, fourth.remaining_units), (3, 0));
    assert!(fourth.retry_after_ms > 0);

    // A retried admission of a held request is not a second slot (acquire is idempotent).
    assert!(agent.admit(&export(2, 1)).await.expect("decision").allowed);

    agent.release(&export(2, 1)).await.expect("release");
    agent
        .release(&export(2, 1))
        .await
        .expect("releasing twice is fine");
    assert!(
        agent.admit(&export(5, 1)).await.expect("decision").allowed,
        "a freed slot admits"
    );
    assert!(
        !agent.admit(&export(6, 1)).await.expect("decision").allowed,
        "full again"
    );

    // A request the rate rule denies does not keep a slot: cost 101 x 10 tokens > capacity 1,000.
    agent.release(&export(5, 1)).await.expect("release");
    let too_costly = agent.admit(&export(7, 101)).await.expect("decision");
    assert!(!too_costly.allowed);
    assert_eq!(too_costly.retry_after_ms, -1, "can never succeed");
    assert!(
        agent.admit(&export(8, 1)).await.expect("decision").allowed,
        "its slot was given back"
    );
}

/// A heartbeat (`renew`, `POST /v1/renew`) extends a long request's slot by its lease TTL, so a
/// long export keeps its slot; without one it lapses with the TTL and the next export is admitted.
/// A lapsed slot is not taken again by a late heartbeat.
#[tokio::test]
async fn a_heartbeat_keeps_a_long_exports_slot_and_a_late_one_does_not_resurrect_it() {
    use allot_shared::clock::ManualClock;

    let bundle = common::bundle(
        r#"{ "rules": [ { "id": "export-user", "scope": "user", "routeGroup": "export",
            "algorithm": "token_bucket", "capacityMillis": 1000000, "refillMillis": 1000000,
            "periodMs": 60000, "concurrencyMax": 1, "concurrencyLeaseTtlMs": 1000,
            "failMode": "closed" } ] }"#,
    );
    let clock = Arc::new(ManualClock::new(1_000_000));
    let agent = common::agent(common::settings(), clock.clone(), None, Some(bundle));
    assert!(agent.admit(&export(1, 1)).await.expect("decision").allowed);
    clock.advance(800);
    let renewal = agent.renew(&export(1, 1)).await.expect("renew");
    assert_eq!((renewal.renewed, renewal.lapsed), (1, 0));
    // 1.6 s after the start: without the heartbeat the slot would have lapsed at 1 s.
    clock.advance(800);
    let second = agent.admit(&export(2, 1)).await.expect("decision");
    assert_eq!(
        second.reason,
        Some(Reason::ConcurrencyExceeded),
        "{second:?}"
    );
    // No heartbeat for longer than the TTL: the slot lapses and the next export gets it.
    clock.advance(1_100);
    assert!(agent.admit(&export(3, 1)).await.expect("decision").allowed);
    let late = agent.renew(&export(1, 1)).await.expect("renew");
    assert_eq!((late.renewed, late.lapsed), (0, 1), "not resurrected");

    // Over HTTP: the same body as /v1/release, answered with what happened to the slots.
    let url = common::serve_http(agent, "gateway-token-for-tests-01").await;
    let http = reqwest::Client::new();
    let body = serde_json::to_value(export(3, 1)).expect("json");
    let answer = http
        .post(format!("{url}/v1/renew"))
        .bearer_auth("gateway-token-for-tests-01")
        .json(&body)
        .send()
        .await
        .expect("renew");
    assert_eq!(answer.status(), 200);
    let renewal: serde_json::Value = answer.json().await.expect("json");
    assert_eq!(renewal["renewed"], 1, "{renewal}");
    assert_eq!(renewal["lapsed"], 0, "{renewal}");
    let unauthenticated = http
        .post(format!("{url}/v1/renew"))
        .json(&body)
        .send()
        .await
        .expect("renew");
    assert_eq!(unauthenticated.status(), 401);
    let bad = http
        .post(format!("{url}/v1/renew"))
        .bearer_auth("gateway-token-for-tests-01")
        .json(&serde_json::json!({ "requestId": "x" }))
        .send()
        .await
        .expect("renew");
    assert_eq!(bad.status(), 400);
}

/// A hung Redis (`CLIENT PAUSE`) under a `local_bounded` rule with a concurrency cap: the slot
/// call and the decision call share the regional hold, and every admission is answered from the
/// rule's local bucket within it, never `LIMITER_UNAVAILABLE`, at the default decision budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_store_answers_local_bounded_rules_from_their_local_bucket_every_time() {
    let redis = allot_testkit::RedisServer::start();
    let agent = common::agent_on_redis(
        &redis,
        allot_region_agent::limiter::LimiterConfig::default(),
        r#"{ "rules": [ { "id": "export-user", "scope": "user", "routeGroup": "export",
            "algorithm": "token_bucket", "capacityMillis": 100000, "refillMillis": 1000,
            "periodMs": 1000, "concurrencyMax": 3, "failMode": "local_bounded",
            "localCapacityMillis": 8000, "localRefillMillis": 1, "localPeriodMs": 60000 } ] }"#,
    )
    .await;
    let first = agent.admit(&export(0, 1)).await.expect("decision");
    assert!(
        first.allowed && !first.fallback,
        "the store decides: {first:?}"
    );
    agent.release(&export(0, 1)).await.expect("released");
    let mut pause = redis::Client::open(redis.url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let paused: String = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(4_000)
        .arg("ALL")
        .query_async(&mut pause)
        .await
        .expect("pause");
    assert_eq!(paused, "OK");
    let mut answers = Vec::new();
    for n in 1..=12 {
        let decision = agent.admit(&export(n, 1)).await.expect("decision");
        assert_ne!(
            decision.reason,
            Some(Reason::LimiterUnavailable),
            "admission {n}: {decision:?}"
        );
        assert!(decision.fallback, "the local bucket answered: {decision:?}");
        answers.push(decision.allowed);
    }
    // The local bucket holds 8 and refills 1 a minute: 8 admitted, then refused by it.
    assert_eq!(answers.iter().filter(|a| **a).count(), 8, "{answers:?}");
}
