//! A denial anywhere debits nothing anywhere, the global tier included: global tokens are reserved
//! from the held lease and spent only when every other rule admits; a regional denial, a full
//! concurrency cap or a refusal from memory gives them back to the same lease. Also what global
//! costs above the held lease or above a chunk get, jittered retry hints, and a hung allocator.
//! Against a stand-in allocator that grants from a real remaining count and records the reports.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use allot_region_agent::clock::{Clock, SystemClock};
use allot_region_agent::service::{Agent, FIRST_GRANT_WAIT, RETRY_JITTER_MAX_MS};
use allot_shared::clock::ManualClock;
use allot_shared::contract::{
    AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason, http_status,
};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

use crate::common::allocator::{Allocator, client};

/// A per-user fixed window of 2 an hour on `read`, and the tenant's global pool.
const USER_BUCKET_AND_POOL: &str = r#"{ "rules": [
    { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 2, "windowMs": 3600000, "failMode": "closed" },
    { "id": "export-slots", "scope": "user", "routeGroup": "export", "algorithm": "token_bucket",
      "capacityMillis": 100000000, "refillMillis": 1000000, "periodMs": 1000,
      "concurrencyMax": 1, "failMode": "closed" },
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

fn request(n: u64, user: &str, route: &str, cost_hint: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("r-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: user.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "GET".to_owned(),
        cost_hint,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

async fn agent_for(fake: &Arc<Allocator>, bundle: &str) -> Arc<Agent> {
    common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(bundle)),
    )
}

/// The story from the field: a pool of 50, a user bucket of 2. One user hammering past their own
/// bucket used to drain the tenant's pool (every denial had spent a global token); now the next 20
/// users are all admitted, and the ledger hears of the 22 admits only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_flooding_past_their_own_bucket_leaves_the_tenants_pool_to_the_others() {
    let fake = Allocator::new(50, 10, 0);
    let agent = agent_for(&fake, USER_BUCKET_AND_POOL).await;
    let mut admitted = 0;
    for n in 0..60 {
        let decision = agent
            .admit(&request(n, "U-flood", "read", 1))
            .await
            .expect("decision");
        if decision.allowed {
            admitted += 1;
        } else {
            assert_eq!(
                decision.denied_scope,
                Some(DeniedScope::User),
                "{decision:?}"
            );
        }
    }
    assert_eq!(admitted, 2, "the user's own bucket");
    for user in 0..20 {
        let decision = agent
            .admit(&request(100 + user, &format!("U-{user}"), "read", 1))
            .await
            .expect("decision");
        assert!(decision.allowed, "user {user}: {decision:?}");
    }
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 22, "the ledger counts admits only");
}

/// A full concurrency cap and a denial from the negative cache (consulted before anything is
/// reserved) give the global token back too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_concurrency_cap_returns_the_global_token_to_its_lease() {
    let fake = Allocator::new(5, 5, 0);
    let agent = agent_for(&fake, USER_BUCKET_AND_POOL).await;
    let first = agent
        .admit(&request(0, "U-1", "export", 1))
        .await
        .expect("decision");
    assert!(first.allowed, "{first:?}");
    for n in 1..20 {
        let decision = agent
            .admit(&request(n, "U-1", "export", 1))
            .await
            .expect("decision");
        assert_eq!(
            decision.reason,
            Some(Reason::ConcurrencyExceeded),
            "{decision:?}"
        );
    }
    // 4 of the pool's 5 are left for the others.
    for user in 0..4 {
        let decision = agent
            .admit(&request(
                100 + user,
                &format!("U-{}", user + 2),
                "export",
                1,
            ))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
    }
    let last = agent
        .admit(&request(200, "U-9", "export", 1))
        .await
        .expect("decision");
    assert_eq!(last.denied_scope, Some(DeniedScope::Global), "{last:?}");
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 5);
}

const GLOBAL_COSTS: &str = r#"{ "rules": [
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

/// A cost above what is held waits for a renewal sized for it; a cost above the chunk (the most a
/// lease can hold) is a clear 429 that says it will never be admitted, not an endless 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_costs_above_the_lease_are_satisfiable_and_above_the_chunk_are_refused_clearly() {
    let fake = Allocator::new(1_000, 10, 0);
    let agent = agent_for(&fake, GLOBAL_COSTS).await;
    let small = agent
        .admit(&request(0, "U-1", "read", 1))
        .await
        .expect("decision");
    assert!(small.allowed, "{small:?}");
    // One token a while: leases are sized small, far below 8.
    let big = agent
        .admit(&request(1, "U-1", "read", 8))
        .await
        .expect("decision");
    assert!(
        big.allowed,
        "{big:?} after asks {:?}",
        fake.wants.lock().expect("lock")
    );
    assert!(
        fake.wants
            .lock()
            .expect("lock")
            .iter()
            .any(|&want| want >= 8)
    );

    let too_big = agent
        .admit(&request(2, "U-1", "read", 11))
        .await
        .expect("decision");
    assert!(!too_big.allowed);
    assert_eq!(too_big.reason, Some(Reason::CostTooHigh));
    assert_eq!(too_big.retry_after_ms, -1, "never: no Retry-After");
    assert_eq!(http_status(&too_big), 429);
    assert_eq!(too_big.denied_scope, Some(DeniedScope::Global));
}

/// Denials after the pool ran out carry a retry hint with up to a second of jitter, so clients
/// denied in the same instant do not all come back in the same instant (I5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_hints_after_the_pool_ran_out_are_jittered_within_their_bound() {
    let fake = Allocator::new(3, 3, 0);
    let agent = agent_for(&fake, GLOBAL_COSTS).await;
    let mut hints = Vec::new();
    for n in 0..100 {
        let decision = agent
            .admit(&request(n, "U-1", "read", 1))
            .await
            .expect("decision");
        if !decision.allowed {
            assert_eq!(decision.reason, Some(Reason::RateExceeded), "{decision:?}");
            hints.push(decision.retry_after_ms);
        }
    }
    assert!(hints.len() >= 90, "{hints:?}");
    // The stand-in says the pool refills in 60 s; each hint is that, less the time since, plus at
    // most the jitter bound.
    let jitter = i64::try_from(RETRY_JITTER_MAX_MS).expect("fits");
    assert!(
        hints
            .iter()
            .all(|&h| (50_000..=60_000 + jitter).contains(&h)),
        "{hints:?}"
    );
    let distinct: std::collections::BTreeSet<i64> = hints.iter().copied().collect();
    assert!(distinct.len() > 20, "spread out: {distinct:?}");
}

/// When allocator calls hang (neither answered nor refused), a renewal unanswered for the
/// patience (FIRST_GRANT_WAIT) counts as an unreachable allocator: requests are admitted from the
/// fallback allowance, never waiting on the hung call beyond it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_allocator_means_fallback_within_the_patience() {
    let fake = Allocator::new(1_000, 2, 50);
    let agent = agent_for(&fake, GLOBAL_COSTS).await;
    for n in 0..2 {
        let decision = agent
            .admit(&request(n, "U-1", "read", 1))
            .await
            .expect("decision");
        assert!(decision.allowed && !decision.fallback, "{decision:?}");
    }
    fake.hang_grants.store(true, Ordering::SeqCst);
    // A renewal the second admit started may have been answered before the hang: at most one
    // chunk (2) can still be admitted from a lease.
    let (mut fallback_admits, mut leased_admits) = (0, 0);
    for n in 2..40 {
        let started = allot_region_agent::clock::Stopwatch::start();
        let decision = agent
            .admit(&request(n, "U-1", "read", 1))
            .await
            .expect("decision");
        // The bound under test, with room for a loaded machine: never the call's 2 s deadline.
        assert!(
            started.elapsed() < FIRST_GRANT_WAIT + Duration::from_millis(800),
            "request {n} waited {:?}",
            started.elapsed()
        );
        if decision.allowed && decision.fallback {
            fallback_admits += 1;
        } else if decision.allowed {
            leased_admits += 1;
        }
    }
    assert!(
        leased_admits <= 2,
        "{leased_admits} leased admits after the hang"
    );
    assert!(fallback_admits >= 30, "{fallback_admits} fallback admits");
}

/// The same user's second request, denied by their bucket at the store, is then denied from the
/// negative cache: neither reserves anything (the pool of 3 still serves 3 others).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_from_memory_reserve_nothing() {
    let fake = Allocator::new(5, 5, 0);
    let clock = Arc::new(ManualClock::new(SystemClock.now_ms()));
    let agent = common::agent(
        common::settings(),
        clock,
        Some(client(fake.clone()).await),
        Some(common::bundle(USER_BUCKET_AND_POOL)),
    );
    for n in 0..10 {
        let _ = agent
            .admit(&request(n, "U-1", "read", 1))
            .await
            .expect("decision");
    }
    let stats = agent.limiter_stats();
    assert!(stats.negative_cache_hits > 0, "{stats:?}");
    for user in 0..3 {
        let decision = agent
            .admit(&request(100 + user, &format!("U-{}", user + 2), "read", 1))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
    }
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 5);
}

/// Global rules cost what regional ones do: a stated cost whatever the hint, or per unit of the
/// hint when the rule says `chargesCostHint`. What the ledger hears is what was charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_rule_charges_its_stated_cost_or_the_hint_when_it_says_so() {
    for (rule, hint, charged) in [
        (r#""costMillis": 2000"#, 5, 2),
        (r#""costMillis": 2000, "chargesCostHint": true"#, 5, 10),
        (r#""failMode": "closed""#, 4, 4),
    ] {
        let fake = Allocator::new(1_000, 100, 0);
        let bundle = format!(
            r#"{{ "rules": [ {{ "id": "global-api", "scope": "global", "pool": "api",
                "failMode": "closed", {rule} }} ] }}"#
        )
        .replace(
            r#""failMode": "closed", "failMode": "closed""#,
            r#""failMode": "closed""#,
        );
        let agent = agent_for(&fake, &bundle).await;
        let decision = agent
            .admit(&request(1, "U-1", "read", hint))
            .await
            .expect("decision");
        assert!(decision.allowed, "{rule}: {decision:?}");
        agent.send_reports().await;
        assert_eq!(
            fake.reported_spent(),
            charged,
            "{rule} with costHint {hint}"
        );
    }
}

/// Several requests decided together (an Envoy call's descriptors) are all or none on every tier:
/// one user's exhausted bucket denies the call, and neither the other user's bucket nor the
/// tenant's pool is spent; an exhausted pool denies the call, and no bucket is spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_decided_together_spend_nothing_anywhere_when_one_is_denied() {
    let fake = Allocator::new(6, 6, 0);
    let agent = agent_for(&fake, USER_BUCKET_AND_POOL).await;
    for n in 0..2 {
        let spent = agent
            .admit(&request(n, "U-flood", "read", 1))
            .await
            .expect("decision");
        assert!(spent.allowed, "{spent:?}");
    }
    for n in 10..20 {
        let call = [
            request(n, "U-a", "read", 1),
            request(100 + n, "U-flood", "read", 1),
        ];
        let decisions = agent.admit_together(&call).await.expect("decisions");
        assert!(decisions.iter().all(|d| !d.allowed), "{decisions:?}");
        assert_eq!(decisions[0].decision_id, call[0].request_id);
        assert_eq!(decisions[1].denied_scope, Some(DeniedScope::User));
    }
    // U-a's bucket is whole, and the pool lost only U-flood's two.
    let together = [request(30, "U-a", "read", 1), request(31, "U-b", "read", 1)];
    let both = agent.admit_together(&together).await.expect("decisions");
    assert!(both.iter().all(|d| d.allowed), "{both:?}");
    let again = agent
        .admit(&request(32, "U-a", "read", 1))
        .await
        .expect("decision");
    assert!(again.allowed, "U-a's second of two: {again:?}");
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 5, "2 + 2 together + 1");
    // The pool has 1 left: a call needing 2 of it is denied by the pool, and spends no bucket.
    let call = [request(40, "U-c", "read", 1), request(41, "U-d", "read", 1)];
    let denied = agent.admit_together(&call).await.expect("decisions");
    assert!(
        denied
            .iter()
            .all(|d| d.denied_scope == Some(DeniedScope::Global)),
        "{denied:?}"
    );
    for (n, user) in [(42, "U-c"), (43, "U-d")] {
        let alone = agent
            .admit(&request(n, user, "read", 1))
            .await
            .expect("decision");
        if n == 42 {
            assert!(alone.allowed, "the pool's last token: {alone:?}");
        }
    }
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 6);
}
