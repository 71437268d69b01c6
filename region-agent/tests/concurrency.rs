//! Concurrency caps in the admission pipeline (the reference design's exports): at most 3 in flight
//! per tenant; the fourth is refused as CONCURRENCY_EXCEEDED even though the rate rule has budget;
//! a released slot admits the next; a request the rate rule denies gives its slot back.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper};

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
    let bundle = allot_shared::policy::parse_bundle(
        r#"{ "rules": [ { "id": "export-tenant", "scope": "tenant", "routeGroup": "export",
            "algorithm": "token_bucket", "capacityMillis": 1000000, "refillMillis": 1000000,
            "periodMs": 60000, "costMillis": 10000, "concurrencyMax": 3, "failMode": "closed",
            "idempotent": true } ] }"#,
    )
    .and_then(|d| d.into_file_bundle())
    .expect("bundle");
    let clock = Arc::new(SystemClock);
    let limiter = Limiter::new(
        Arc::new(InProcessStore::new(clock.clone(), 1_000)),
        LimiterConfig::default(),
    )
    .expect("limiter");
    let agent = Agent::new(
        AgentSettings {
            region: RegionId::parse("eu").expect("region"),
            agent_id: "eu-1".to_owned(),
            pepper: Pepper::new(b"concurrency-pepper-012".to_vec()).expect("pepper"),
            ip_prefixes: IpPrefixes::default(),
            decision_record_ttl_ms: 30_000,
            expiry_margin_ms: 50,
            allocator_round_trip_ms: 20,
            policy_max_age_ms: 0,
        },
        clock,
        limiter,
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
