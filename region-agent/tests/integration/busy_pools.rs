//! An idle pool costs the background rounds nothing: once a report round finds a pool settled
//! (nothing owed, no lease live), no round visits it, reports it or fetches its terms until a
//! request acts on it again; a settled pool is forgotten once idle. Against a stand-in allocator
//! that counts its calls, on a clock the test moves.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use allot_region_agent::clock::{Clock, SystemClock};
use allot_region_agent::service::{Agent, POOL_IDLE_MS, TERMS_REFRESH_MS};
use allot_shared::clock::ManualClock;
use allot_shared::contract::AdmissionRequest;
use allot_shared::ids::TenantId;

use crate::common;
use crate::common::allocator::{Allocator, client};

const TENANT_POOL: &str = r#"{ "rules": [
    { "id": "global-api", "scope": "global", "routeGroup": "read", "pool": "api",
      "failMode": "closed" } ] }"#;

/// Leases last a minute: a pool settles well before it may be forgotten.
const LEASE_MS: u64 = 60_000;
const TENANTS: u64 = 20;

fn request(n: u64, tenant: u64) -> AdmissionRequest {
    AdmissionRequest {
        tenant_id: TenantId::parse(&format!("t{tenant:03}")).expect("tenant"),
        ..common::user_request(&format!("r-{n}"), "U-1", "read")
    }
}

async fn admit(agent: &Arc<Agent>, n: u64, tenant: u64) {
    let decision = agent.admit(&request(n, tenant)).await.expect("decision");
    assert!(decision.allowed, "{decision:?}");
}

/// Rounds as the background runs them, `times` over, the clock moved `step_ms` before each.
async fn rounds(agent: &Arc<Agent>, clock: &ManualClock, times: u64, step_ms: u64) {
    for _ in 0..times {
        clock.advance(step_ms);
        agent.send_reports().await;
        agent.maintain_pools().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_pools_cost_the_rounds_nothing_until_a_request_touches_them() {
    let clock = Arc::new(ManualClock::new(SystemClock.now_ms()));
    let fake = Allocator::with_clock(1_000_000, 100, 0, clock.clone());
    fake.lease_ms.store(LEASE_MS, Ordering::SeqCst);
    let agent = common::agent(
        common::settings(),
        clock.clone(),
        Some(client(fake.clone()).await),
        Some(common::bundle(TENANT_POOL)),
    );
    for tenant in 0..TENANTS {
        admit(&agent, tenant, tenant).await;
    }
    assert_eq!(
        agent.busy_pools(),
        TENANTS as usize,
        "every pool holds a lease"
    );
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), TENANTS);

    // The leases end: the final lines are reported, then a round finds every pool settled.
    rounds(&agent, &clock, 3, LEASE_MS / 2).await;
    assert_eq!(agent.busy_pools(), 0, "nothing owed, no lease live");
    assert_eq!(agent.pool_counts().0, TENANTS as usize, "held until idle");

    // Settled pools are neither reported nor refreshed, however long the rounds run.
    let (reports, terms) = (
        fake.report_calls.load(Ordering::SeqCst),
        fake.terms_calls.load(Ordering::SeqCst),
    );
    rounds(&agent, &clock, 4, TERMS_REFRESH_MS).await;
    assert_eq!(fake.report_calls.load(Ordering::SeqCst), reports);
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), terms);

    // A request touches one pool: it alone is busy, reported, and its stale terms fetched again.
    admit(&agent, 100, 7).await;
    assert_eq!(agent.busy_pools(), 1);
    rounds(&agent, &clock, 1, 1).await;
    assert_eq!(fake.reported_spent(), TENANTS + 1);
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), terms + 1);
    assert_eq!(fake.report_calls.load(Ordering::SeqCst), reports + 1);

    // The settled pools are forgotten once idle; the one in use is kept.
    clock.advance(POOL_IDLE_MS);
    admit(&agent, 101, 7).await;
    agent.maintain_pools().await;
    assert_eq!(agent.pool_counts().0, 1, "only the pool in use is held");
    assert_eq!(agent.busy_pools(), 1);
}

/// A pool in steady use: one request every 10 s for `minutes`, a round every 10 s (reports, then
/// upkeep every fifth second as the agent runs it, here after each request).
async fn steady_use(agent: &Arc<Agent>, clock: &ManualClock, first: u64, minutes: u64) {
    for n in 0..minutes * 6 {
        clock.advance(10_000);
        admit(agent, first + n, 0).await;
        agent.send_reports().await;
        agent.maintain_pools().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_fetches_its_terms_only_when_a_grant_says_they_changed() {
    let clock = Arc::new(ManualClock::new(SystemClock.now_ms()));
    // Leases of 20 s: renewed more often than terms are refreshed.
    let fake = Allocator::with_clock(1_000_000, 10, 0, clock.clone());
    fake.lease_ms.store(20_000, Ordering::SeqCst);
    let agent = common::agent(
        common::settings(),
        clock.clone(),
        Some(client(fake.clone()).await),
        Some(common::bundle(TENANT_POOL)),
    );
    admit(&agent, 0, 0).await;
    let terms_calls = || fake.terms_calls.load(Ordering::SeqCst);
    assert_eq!(terms_calls(), 1, "looked up once");

    // An allocator whose grants do not say their terms' version: fetched every 30 s in use.
    steady_use(&agent, &clock, 1, 2).await;
    let unconfirmed = terms_calls() - 1;
    assert!(unconfirmed >= 3, "{unconfirmed} fetches in two minutes");

    // Grants that say the version in force confirm it: no fetch, however long the pool is used.
    fake.grants_say_terms_version.store(true, Ordering::SeqCst);
    let before = terms_calls();
    steady_use(&agent, &clock, 100, 2).await;
    assert_eq!(
        terms_calls(),
        before,
        "each lease's grant confirmed the terms"
    );

    // The operator changes the pool: the next grant says so, and the next upkeep fetches them.
    fake.terms_version.store(2, Ordering::SeqCst);
    steady_use(&agent, &clock, 200, 1).await;
    assert_eq!(
        terms_calls(),
        before + 1,
        "fetched once, then confirmed again"
    );
}
