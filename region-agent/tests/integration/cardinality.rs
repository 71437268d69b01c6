//! The pre-authentication cardinality cap through the agent: addresses that share a coarse prefix
//! (one party's /48) share one count of new keys, so minting fresh /64s stops growing the key set.

use std::sync::Arc;

use allot_shared::clock::ManualClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

const ANONYMOUS_ONLY: &str = r#"{ "rules": [
    { "id": "anon-ip", "scope": "user", "principalType": "ip",
      "algorithm": "fixed_window", "limit": 20, "windowMs": 10000, "failMode": "closed" } ] }"#;

fn from_address(n: usize, address: String) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("c-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::Ip,
            id: address,
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test]
async fn fresh_slash64s_of_one_slash48_are_capped_at_64_new_keys() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let agent = common::agent(
        common::settings(),
        clock,
        None,
        Some(common::bundle(ANONYMOUS_ONLY)),
    );
    // Each address is its own /64 (its own key) inside 2001:db8:7::/48 (one source).
    let mut allowed = 0;
    for n in 0..64 {
        let decision = agent
            .admit(&from_address(n, format!("2001:db8:7:{n:x}::1")))
            .await
            .expect("decision");
        assert!(decision.allowed, "address {n} is within the cap");
        allowed += 1;
    }
    assert_eq!(allowed, 64);
    let refused = agent
        .admit(&from_address(64, "2001:db8:7:40::1".to_owned()))
        .await
        .expect("decision");
    assert!(
        !refused.allowed,
        "the 65th new key of one source is refused"
    );
    assert_eq!(refused.reason, Some(Reason::RateExceeded));
    assert_eq!(refused.denied_scope, Some(DeniedScope::User));
    // A known key of the capped source is still served, and another /48 has its own count.
    let known = agent
        .admit(&from_address(65, "2001:db8:7:3::1".to_owned()))
        .await
        .expect("decision");
    assert!(known.allowed, "a source keeps using the keys it has");
    let elsewhere = agent
        .admit(&from_address(66, "2001:db8:8:40::1".to_owned()))
        .await
        .expect("decision");
    assert!(elsewhere.allowed, "another /48 is another source");
    assert_eq!(agent_stats_refusals(&agent), 1);
}

#[tokio::test]
async fn one_address_reusing_its_key_is_never_capped() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let agent = common::agent(
        common::settings(),
        clock,
        None,
        Some(common::bundle(ANONYMOUS_ONLY)),
    );
    let mut allowed = 0;
    for n in 0..30 {
        let decision = agent
            .admit(&from_address(n, "198.51.100.7".to_owned()))
            .await
            .expect("decision");
        if decision.allowed {
            allowed += 1;
        } else {
            // The fixed window (20 per 10 s) denies, not the cap.
            assert_eq!(decision.reason, Some(Reason::RateExceeded));
        }
    }
    assert_eq!(allowed, 20, "exactly the rule's limit, no cap refusal");
    let stats = agent_stats_refusals(&agent);
    assert_eq!(stats, 0);
}

fn agent_stats_refusals(agent: &allot_region_agent::service::Agent) -> u64 {
    agent.limiter_stats().cardinality_refusals
}
