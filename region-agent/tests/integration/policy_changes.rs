//! A bundle that changes a rule's algorithm (or adds an exemption with another algorithm over the
//! same key) takes effect at once from fresh state: every state key carries the shape of the state
//! its algorithm stores, so the new algorithm never meets the old one's state (which answered
//! POLICY_ERROR until the old key expired: a day, for a daily window). On the in-process store and
//! on real Redis.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
use allot_region_agent::service::Agent;
use allot_shared::contract::{
    AdmissionRequest, Decision, DeniedScope, Principal, PrincipalType, Reason,
};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use allot_shared::policy::PolicyBundle;
use allot_testkit::RedisServer;
use serde_json::json;

use crate::common;

fn bundle(version: u64, rules: serde_json::Value) -> PolicyBundle {
    let text = json!({ "bundleVersion": version, "rules": rules }).to_string();
    allot_shared::policy::parse_bundle(&text)
        .and_then(|draft| draft.into_file_bundle())
        .expect("a valid bundle")
}

/// v1: a per-user token bucket of 2 a day on `read`.
fn v1() -> PolicyBundle {
    bundle(
        1,
        json!([{ "id": "read-user", "scope": "user", "routeGroup": "read",
                 "algorithm": "token_bucket", "capacityMillis": 2000, "refillMillis": 1000,
                 "periodMs": 86_400_000, "failMode": "closed" }]),
    )
}

/// v2: the same rule as a daily fixed window of 5.
fn v2() -> PolicyBundle {
    bundle(
        2,
        json!([{ "id": "read-user", "scope": "user", "routeGroup": "read",
                 "algorithm": "fixed_window", "limit": 5, "windowMs": 86_400_000,
                 "failMode": "closed" }]),
    )
}

/// v3: v2, and an exemption for tenant atlas over the same key with a sliding log of 3.
fn v3() -> PolicyBundle {
    bundle(
        3,
        json!([{ "id": "read-user", "scope": "user", "routeGroup": "read",
                 "algorithm": "fixed_window", "limit": 5, "windowMs": 86_400_000,
                 "failMode": "closed" },
               { "id": "read-user-partner", "scope": "user", "routeGroup": "read",
                 "tenant": "atlas", "exempt": true, "owner": "partner-team",
                 "algorithm": "sliding_log", "limit": 3, "windowMs": 86_400_000,
                 "failMode": "closed" }]),
    )
}

fn request(n: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("p-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-17".to_owned(),
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

/// Admits `count` requests from `first`; returns how many were allowed, checking that every
/// denial is the user's rule running out (never a policy error).
async fn allowed(agent: &Arc<Agent>, first: u64, count: u64) -> u64 {
    let mut allowed = 0;
    for n in first..first + count {
        let decision: Decision = agent.admit(&request(n)).await.expect("decision");
        if decision.allowed {
            allowed += 1;
        } else {
            assert_eq!(decision.reason, Some(Reason::RateExceeded), "{decision:?}");
            assert_eq!(
                decision.denied_scope,
                Some(DeniedScope::User),
                "{decision:?}"
            );
        }
    }
    allowed
}

async fn algorithm_changes_start_from_fresh_state(agent: Arc<Agent>) {
    assert_eq!(allowed(&agent, 0, 4).await, 2, "the bucket of 2");
    assert!(agent.offer_bundle(v2()));
    assert_eq!(
        allowed(&agent, 10, 7).await,
        5,
        "a fresh window of 5, not a policy error"
    );
    assert!(agent.offer_bundle(v3()));
    assert_eq!(
        allowed(&agent, 20, 5).await,
        3,
        "the exemption's own fresh log of 3"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_a_changed_algorithm_starts_from_fresh_state() {
    let agent = common::agent(common::settings(), Arc::new(SystemClock), None, Some(v1()));
    algorithm_changes_start_from_fresh_state(agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_changed_algorithm_starts_from_fresh_state() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default())
        .await
        .expect("redis");
    // Generous: a slow CI machine must not turn a Redis reply into LIMITER_UNAVAILABLE here.
    let config = LimiterConfig {
        decision_budget: std::time::Duration::from_secs(2),
        ..LimiterConfig::default()
    };
    let limiter = Limiter::new(Arc::new(store), config).expect("limiter");
    let agent = Agent::new(
        common::settings(),
        Arc::new(SystemClock),
        limiter,
        None,
        Some(v1()),
    );
    algorithm_changes_start_from_fresh_state(agent).await;
}
