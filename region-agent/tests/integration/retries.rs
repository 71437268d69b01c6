//! A retried idempotent request is one request on every tier: the regional store replays its
//! decision record, and the tenant's global pool is spent once, whether the retry comes after the
//! answer, while the original is still being decided, or to another agent of the region.

use std::sync::Arc;

use allot_region_agent::clock::{Clock, SystemClock};
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::Agent;
use allot_shared::contract::{AdmissionRequest, DeniedScope};

use crate::common;

use crate::common::allocator::{Allocator, client};

/// An idempotent per-user window on `export` (well above what the tests use), and the tenant's pool.
const IDEMPOTENT_RULE_AND_POOL: &str = r#"{ "rules": [
    { "id": "user-export", "scope": "user", "routeGroup": "export", "algorithm": "fixed_window",
      "limit": 100, "windowMs": 3600000, "failMode": "closed", "idempotent": true },
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

/// The same pool behind an idempotent global rule alone: no store call at all.
const IDEMPOTENT_POOL_ONLY: &str = r#"{ "rules": [
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
      "idempotent": true } ] }"#;

/// The pool without any idempotent rule: a repeated request id is a new request.
const PLAIN_POOL: &str = r#"{ "rules": [
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

fn export(id: &str) -> AdmissionRequest {
    common::user_request(id, "U-a", "export")
}

async fn agent_for(fake: &Arc<Allocator>, bundle: &str) -> Arc<Agent> {
    common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(bundle)),
    )
}

/// Admits fresh requests until the pool denies one; how many were admitted.
async fn admitted_until_the_pool_denies(agent: &Arc<Agent>, prefix: &str) -> u64 {
    for n in 0..100 {
        let decision = agent
            .admit(&export(&format!("{prefix}-{n}")))
            .await
            .expect("decision");
        if !decision.allowed {
            assert_eq!(
                decision.denied_scope,
                Some(DeniedScope::Global),
                "{decision:?}"
            );
            return n;
        }
    }
    panic!("the pool never ran out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_idempotent_request_spends_the_pool_once_and_gets_the_same_answer() {
    for bundle in [IDEMPOTENT_RULE_AND_POOL, IDEMPOTENT_POOL_ONLY] {
        let fake = Allocator::new(6, 6, 0);
        let agent = agent_for(&fake, bundle).await;
        let first = agent.admit(&export("r-retried")).await.expect("decision");
        assert!(first.allowed, "{first:?}");
        for _ in 0..3 {
            let retry = agent.admit(&export("r-retried")).await.expect("decision");
            assert_eq!(retry, first, "a retry is answered as its original was");
        }
        assert_eq!(
            admitted_until_the_pool_denies(&agent, "r-fresh").await,
            5,
            "the retries left the rest of the pool of 6 to new requests"
        );
        agent.send_reports().await;
        assert_eq!(
            fake.reported_spent(),
            6,
            "the ledger counts one spend per request"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_racing_their_original_spend_the_pool_once() {
    let fake = Allocator::new(6, 6, 0);
    let agent = agent_for(&fake, IDEMPOTENT_RULE_AND_POOL).await;
    let racing: Vec<_> = (0..8)
        .map(|_| {
            let agent = agent.clone();
            tokio::spawn(async move { agent.admit(&export("r-raced")).await.expect("decision") })
        })
        .collect();
    for task in racing {
        let answer = task.await.expect("task");
        assert!(answer.allowed, "{answer:?}");
    }
    assert_eq!(admitted_until_the_pool_denies(&agent, "r-fresh").await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_to_another_agent_of_the_region_is_replayed_by_the_store_and_spends_nothing() {
    // Chunks of 3: each agent holds some of the pool.
    let fake = Allocator::new(6, 3, 0);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = Arc::new(InProcessStore::new(clock.clone(), 1_000));
    let agent_on_shared_store = |settings| {
        let store = store.clone();
        let clock = clock.clone();
        let fake = fake.clone();
        async move {
            let limiter = Limiter::new(store, LimiterConfig::default()).expect("limiter");
            Agent::new(
                settings,
                clock,
                limiter,
                Some(client(fake).await),
                Some(common::bundle(IDEMPOTENT_RULE_AND_POOL)),
            )
        }
    };
    let mut second_settings = common::settings();
    second_settings.agent_id = allot_shared::ids::AgentId::parse("eu-test-2").expect("agent id");
    let first_agent = agent_on_shared_store(common::settings()).await;
    let second_agent = agent_on_shared_store(second_settings).await;
    let first = first_agent
        .admit(&export("r-moved"))
        .await
        .expect("decision");
    let retry = second_agent
        .admit(&export("r-moved"))
        .await
        .expect("decision");
    assert!(first.allowed && retry.allowed, "{first:?} {retry:?}");
    first_agent.send_reports().await;
    second_agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        1,
        "the store's replay cancelled the second agent's reservation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_idempotent_rule_a_repeated_request_id_is_a_new_request() {
    let fake = Allocator::new(3, 3, 0);
    let agent = agent_for(&fake, PLAIN_POOL).await;
    for _ in 0..3 {
        let decision = agent.admit(&export("r-same")).await.expect("decision");
        assert!(decision.allowed, "{decision:?}");
    }
    let fourth = agent.admit(&export("r-same")).await.expect("decision");
    assert!(!fourth.allowed, "each call spent the pool: {fourth:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_original_is_not_replayed_and_a_dry_run_remembers_nothing() {
    let fake = Allocator::new(1, 1, 0);
    let agent = agent_for(&fake, IDEMPOTENT_RULE_AND_POOL).await;
    let mut dry = export("r-dry");
    dry.dry_run = true;
    let checked = agent.admit(&dry).await.expect("decision");
    assert!(checked.allowed && checked.dry_run, "{checked:?}");
    let spent = agent.admit(&export("r-dry")).await.expect("decision");
    assert!(
        spent.allowed && !spent.dry_run,
        "a dry run is no original: {spent:?}"
    );
    let denied = agent.admit(&export("r-late")).await.expect("decision");
    assert!(!denied.allowed, "{denied:?}");
    let again = agent.admit(&export("r-late")).await.expect("decision");
    assert!(!again.allowed, "decided again, and still denied: {again:?}");
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 1);
}
