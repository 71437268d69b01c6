//! A bundle the allocator has not confirmed for longer than the maximum age: rules marked `strict`
//! fail closed, the others keep being served from the last bundle (I13).

use std::sync::Arc;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::service::AgentSettings;
use allot_shared::clock::ManualClock;
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

fn request(n: usize, route: &str) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("s-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-1".to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "POST".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test]
async fn strict_rules_fail_closed_once_the_bundle_is_too_old() {
    let bundle = common::bundle(
        r#"{ "rules": [
            { "id": "payments-strict", "scope": "user", "routeGroup": "payments", "strict": true,
              "algorithm": "token_bucket", "capacityMillis": 100000, "refillMillis": 1000,
              "periodMs": 1000, "failMode": "closed" },
            { "id": "read-lenient", "scope": "user", "routeGroup": "read",
              "algorithm": "token_bucket", "capacityMillis": 100000, "refillMillis": 1000,
              "periodMs": 1000, "failMode": "closed" },
            { "id": "read-shadow-strict", "scope": "tenant", "routeGroup": "read", "strict": true,
              "mode": "shadow", "algorithm": "token_bucket", "capacityMillis": 100000,
              "refillMillis": 1000, "periodMs": 1000, "failMode": "closed" } ] }"#,
    );
    let clock = Arc::new(ManualClock::new(1_000_000));
    // An allocator that cannot be reached: the bundle is never confirmed again.
    let allocator = AllocatorClient::new(
        vec!["http://127.0.0.1:9".to_owned()],
        "agent-token-0123456789".to_owned(),
    )
    .expect("client");
    let settings = AgentSettings {
        policy_max_age_ms: 60_000,
        ..common::settings()
    };
    let agent = common::agent(
        settings,
        clock.clone(),
        Some(Arc::new(allocator)),
        Some(bundle),
    );
    assert!(
        agent
            .admit(&request(1, "payments"))
            .await
            .expect("decision")
            .allowed
    );
    agent.refresh_policy().await;
    clock.advance(60_000);
    assert!(
        !agent.bundle_is_stale(),
        "exactly the maximum age is still fresh"
    );
    assert!(
        agent
            .admit(&request(2, "payments"))
            .await
            .expect("decision")
            .allowed
    );
    clock.advance(1);
    assert!(agent.bundle_is_stale());
    let strict = agent
        .admit(&request(3, "payments"))
        .await
        .expect("decision");
    assert!(!strict.allowed);
    assert_eq!(strict.reason, Some(Reason::LimiterUnavailable));
    assert_eq!(strict.policy_id.as_deref(), Some("payments-strict"));
    let lenient = agent.admit(&request(4, "read")).await.expect("decision");
    assert!(
        lenient.allowed,
        "non-strict rules keep the last bundle, and a strict shadow rule never denies: {lenient:?}"
    );
}
