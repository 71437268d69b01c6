//! Concurrency caps in the admission pipeline (the reference design's exports): at most 3 in flight
//! per tenant; the fourth is refused as CONCURRENCY_EXCEEDED even though the rate rule has budget;
//! a released slot admits the next; a request the rate rule denies gives its slot back.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

mod common;

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
    }
}

#[tokio::test]
async fn the_fourth_concurrent_export_is_refused_and_releases_free_slots() {
    let bundle = common::bundle(
        r#"{ "rules": [ { "id": "export-tenant", "scope": "tenant", "routeGroup": "export",
            "algorithm": "token_bucket", "capacityMillis": 1000000, "refillMillis": 1000000,
            "periodMs": 60000, "costMillis": 10000, "concurrencyMax": 3, "failMode": "closed",
            "idempotent": true } ] }"#,
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
    assert_eq!((fourth.limit, fourth.remaining), (3, 0));
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
