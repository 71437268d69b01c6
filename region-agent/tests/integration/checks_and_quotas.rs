//! Checking without spending and "what do I have left": a dry run (`dryRun`, an RLS descriptor
//! `hits_addend` of 0) answers what a real request would get and debits nothing anywhere: no
//! regional write, no lease spent, no fallback claimed, no concurrency slot taken. `GET /v1/quota`
//! shows the caller the quotas its rules let it see, with what is left, and nothing else. Against the
//! stand-in allocator (a real remaining count, reports recorded) and the in-process store (the
//! script's twin, held equal by the differential tests).

use std::sync::Arc;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::service::Agent;
use allot_region_agent::state_dir::StateDir;
use allot_shared::clock::ManualClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, PrincipalType, QuotaQuery, Reason};
use allot_shared::ids::{RegionId, RouteGroup, TenantId};
use serde_json::{Value, json};

use crate::common;

use crate::common::allocator::{Allocator, client};

const GATEWAY: &str = "gateway-token-for-checks-1";

/// Per user on `read`: 3 an hour (seen by the user); per user on `export`: one at a time; the
/// tenant's `read` budget (shown to its users: `expose`); a per-user flood guard nobody is told
/// about; and the tenant's global pool (its plan, shown to its users).
const BUNDLE: &str = r#"{ "rules": [
    { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 3, "windowMs": 3600000, "failMode": "closed" },
    { "id": "user-export", "scope": "user", "routeGroup": "export", "algorithm": "token_bucket",
      "capacityMillis": 100000000, "refillMillis": 1000000, "periodMs": 1000,
      "concurrencyMax": 1, "failMode": "closed" },
    { "id": "tenant-read", "scope": "route", "routeGroup": "read", "algorithm": "token_bucket",
      "capacityMillis": 100000, "refillMillis": 1000, "periodMs": 1000, "failMode": "closed",
      "expose": true },
    { "id": "flood-guard", "scope": "user", "algorithm": "token_bucket",
      "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 1000, "failMode": "closed",
      "expose": false },
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
      "expose": true } ] }"#;

fn request(n: u64, user: &str, route: &str, dry_run: bool) -> AdmissionRequest {
    AdmissionRequest {
        dry_run,
        ..common::user_request(&format!("c-{n}"), user, route)
    }
}

fn quota_query(user: &str, kind: PrincipalType, route: Option<&str>) -> QuotaQuery {
    QuotaQuery {
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal_type: kind,
        principal_id: user.to_owned(),
        route_group: route.map(|r| RouteGroup::parse(r).expect("route")),
    }
}

async fn agent_with(fake: &Arc<Allocator>) -> Arc<Agent> {
    common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(BUNDLE)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_answers_like_the_real_request_and_spends_nothing() {
    let fake = Allocator::new(50, 10, 0);
    let agent = agent_with(&fake).await;
    // Twenty checks by a user with 3 an hour: each says "yes, and 2 would be left", and none
    // spends a regional unit or a pool token.
    for n in 0..20 {
        let check = agent
            .admit(&request(n, "U-1", "read", true))
            .await
            .expect("decision");
        assert!(check.allowed && check.dry_run, "{check:?}");
        assert_eq!(check.policy_id.as_deref(), Some("user-read"), "{check:?}");
        assert_eq!((check.limit_units, check.remaining_units), (3, 2));
    }
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 0, "no pool token spent by a check");
    // The user's three real requests are all there.
    for n in 100..103 {
        let real = agent
            .admit(&request(n, "U-1", "read", false))
            .await
            .expect("decision");
        assert!(real.allowed && !real.dry_run, "{real:?}");
    }
    let denied = agent
        .admit(&request(103, "U-1", "read", false))
        .await
        .expect("decision");
    assert_eq!(denied.denied_scope, Some(DeniedScope::User), "{denied:?}");
    // A check now says what the real request got: denied by the user's own rule, with a hint.
    let check = agent
        .admit(&request(104, "U-1", "read", true))
        .await
        .expect("decision");
    assert!(!check.allowed && check.dry_run, "{check:?}");
    assert_eq!(check.policy_id.as_deref(), Some("user-read"));
    assert_eq!(check.reason, Some(Reason::RateExceeded));
    assert!(check.retry_after_ms > 0, "{check:?}");
    agent.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        3,
        "the ledger hears of real admits only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_of_a_drained_pool_is_denied_and_leaves_the_last_tokens_to_real_requests() {
    let fake = Allocator::new(4, 4, 0);
    let agent = agent_with(&fake).await;
    for n in 0..4 {
        let user = format!("U-{n}");
        let check = agent
            .admit(&request(n, &user, "read", true))
            .await
            .expect("decision");
        assert!(check.allowed, "check {n}: {check:?}");
        let real = agent
            .admit(&request(10 + n, &user, "read", false))
            .await
            .expect("decision");
        assert!(real.allowed, "request {n}: {real:?}");
    }
    let check = agent
        .admit(&request(20, "U-9", "read", true))
        .await
        .expect("decision");
    assert!(!check.allowed && check.dry_run, "{check:?}");
    assert_eq!(check.denied_scope, Some(DeniedScope::Global));
    agent.send_reports().await;
    assert_eq!(fake.reported_spent(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_takes_no_concurrency_slot() {
    let fake = Allocator::new(50, 10, 0);
    let agent = agent_with(&fake).await;
    for n in 0..5 {
        let check = agent
            .admit(&request(n, "U-1", "export", true))
            .await
            .expect("decision");
        assert!(check.allowed, "{check:?}");
    }
    // The one slot is still free for the real export, and then taken.
    let export = agent
        .admit(&request(10, "U-1", "export", false))
        .await
        .expect("decision");
    assert!(export.allowed, "{export:?}");
    let second = agent
        .admit(&request(11, "U-1", "export", false))
        .await
        .expect("decision");
    assert_eq!(
        second.reason,
        Some(Reason::ConcurrencyExceeded),
        "{second:?}"
    );
}

/// Half past 10:00 on 2026-12-01 (UTC): the hour-long windows never end under the test.
const MID_HOUR_MS: u64 = 1_796_119_200_000 + 1_800_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_during_a_partition_claims_no_fallback_allowance() {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = Arc::new(ManualClock::new(MID_HOUR_MS));
    let allowance = 12;
    let fake = Allocator::with_clock(1_000, 10, allowance, clock.clone());
    let start = |allocator: Arc<AllocatorClient>| {
        let agent = common::agent(
            common::settings(),
            clock.clone(),
            Some(allocator),
            Some(common::bundle(BUNDLE)),
        );
        agent.set_state_dir(
            StateDir::open(dir.path(), RegionId::parse("eu").expect("region")).expect("dir"),
        );
        agent.restore_state();
        agent
    };
    // Connected once, so the pool's terms are saved; then restarted cut off.
    let first = start(client(fake.clone()).await);
    let admitted = first
        .admit(&request(0, "U-0", "read", false))
        .await
        .expect("decision");
    assert!(admitted.allowed);
    first.write_journal_if_changed().await;
    drop(first);
    let unreachable = || {
        Arc::new(
            AllocatorClient::new(
                vec!["http://127.0.0.1:9".to_owned()],
                "agent-token-0123456789".to_owned(),
            )
            .expect("client"),
        )
    };
    let second = start(unreachable());
    for n in 0..30 {
        let check = second
            .admit(&request(100 + n, &format!("U-{n}"), "read", true))
            .await
            .expect("decision");
        assert!(check.allowed && check.fallback, "check {n}: {check:?}");
    }
    second.write_journal_if_changed().await;
    drop(second);
    // Had a check claimed a block of the allowance, a restart would start past it.
    let third = start(unreachable());
    let mut allowed = 0;
    for n in 0..(allowance + 5) {
        let real = third
            .admit(&request(200 + n, &format!("V-{n}"), "read", false))
            .await
            .expect("decision");
        allowed += u64::from(real.allowed);
    }
    assert_eq!(
        allowed, allowance,
        "the whole allowance is left after the checks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quota_shows_the_callers_own_and_exposed_rules_with_what_is_left() {
    let fake = Allocator::new(50, 10, 0);
    let agent = agent_with(&fake).await;
    for n in 0..2 {
        let real = agent
            .admit(&request(n, "U-1", "read", false))
            .await
            .expect("decision");
        assert!(real.allowed, "{real:?}");
    }
    let status = agent
        .quota(&quota_query("U-1", PrincipalType::User, Some("read")))
        .await
        .expect("valid")
        .expect("a bundle");
    let ids: Vec<&str> = status.quotas.iter().map(|q| q.policy_id.as_str()).collect();
    assert_eq!(
        ids,
        ["user-read", "tenant-read", "global-api"],
        "own, exposed and the pool; never the hidden flood guard"
    );
    let user = &status.quotas[0];
    assert_eq!((user.limit_units, user.remaining_units), (3, Some(1)));
    assert_eq!(user.window_ms, 3_600_000);
    assert!((1..=3_600_000).contains(&user.reset_ms), "{user:?}");
    let tenant = &status.quotas[1];
    assert_eq!(tenant.scope, DeniedScope::Route);
    assert_eq!(tenant.limit_units, 100);
    assert!(
        matches!(tenant.remaining_units, Some(98..=100)),
        "{tenant:?}"
    );
    let pool = &status.quotas[2];
    assert_eq!(pool.pool.as_ref().map(|p| p.as_str()), Some("api"));
    assert_eq!(pool.limit_units, 50);
    assert_eq!(
        pool.remaining_units,
        Some(48),
        "ungranted at the allocator plus held unspent: G less the two admits"
    );
    assert!(pool.age_ms.is_some_and(|age| age < 60_000), "{pool:?}");
    // Reading changed nothing: the third request is still there, the fourth is not.
    for _ in 0..3 {
        agent
            .quota(&quota_query("U-1", PrincipalType::User, None))
            .await
            .expect("valid");
    }
    let third = agent
        .admit(&request(2, "U-1", "read", false))
        .await
        .expect("decision");
    assert!(third.allowed, "{third:?}");
    let status = agent
        .quota(&quota_query("U-1", PrincipalType::User, None))
        .await
        .expect("valid")
        .expect("a bundle");
    let ids: Vec<&str> = status.quotas.iter().map(|q| q.policy_id.as_str()).collect();
    assert_eq!(
        ids,
        ["user-export", "user-read", "tenant-read", "global-api"]
    );
    assert_eq!(status.quotas[1].remaining_units, Some(0));
    // Another user's own budget is whole; the tenant's is shared.
    let other = agent
        .quota(&quota_query("U-2", PrincipalType::User, Some("read")))
        .await
        .expect("valid")
        .expect("a bundle");
    assert_eq!(other.quotas[0].remaining_units, Some(3));
    // A caller that did not authenticate is told nothing.
    let anonymous = agent
        .quota(&quota_query("192.0.2.7", PrincipalType::Ip, Some("read")))
        .await
        .expect("valid")
        .expect("a bundle");
    assert!(anonymous.quotas.is_empty(), "{anonymous:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_checks_and_quotas_are_authenticated_and_bad_input_names_the_field() {
    let fake = Allocator::new(50, 10, 0);
    let url = common::serve_http(agent_with(&fake).await, GATEWAY).await;
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    let admit = |body: Value| {
        http.post(format!("{url}/v1/admit"))
            .bearer_auth(GATEWAY)
            .json(&body)
            .send()
    };
    let body = |n: u64, dry_run: bool| {
        json!({ "requestId": format!("h-{n}"), "tenantId": "atlas",
                "principal": { "type": "user", "id": "U-5" }, "routeGroup": "read",
                "method": "GET", "dryRun": dry_run })
    };
    let check: Value = admit(body(0, true))
        .await
        .expect("admit")
        .json()
        .await
        .expect("json");
    assert_eq!(check["allowed"], true, "{check}");
    assert_eq!(check["dryRun"], true, "{check}");
    let real: Value = admit(body(1, false))
        .await
        .expect("admit")
        .json()
        .await
        .expect("json");
    assert!(
        real.get("dryRun").is_none(),
        "a real decision does not carry the flag: {real}"
    );
    let bad = admit(json!({ "requestId": "h-2", "tenantId": "atlas",
        "principal": { "type": "user", "id": "U-5" }, "routeGroup": "read", "method": "GET",
        "dryRun": "yes" }))
    .await
    .expect("admit");
    assert_eq!(bad.status(), 400);
    let problem: Value = bad.json().await.expect("problem");
    assert_eq!(problem["field"], "dryRun", "{problem}");

    let quota = |query: &str, token: &str| {
        http.get(format!("{url}/v1/quota?{query}"))
            .bearer_auth(token)
            .send()
    };
    let answer = quota(
        "tenantId=atlas&principalType=user&principalId=U-5&routeGroup=read",
        GATEWAY,
    )
    .await
    .expect("quota");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["cache-control"], "no-store");
    let status: Value = answer.json().await.expect("json");
    assert_eq!(status["quotas"][0]["policyId"], "user-read", "{status}");
    assert_eq!(
        status["quotas"][0]["remaining"], 2,
        "one real request of 3: {status}"
    );
    assert_eq!(status["quotas"][0]["limit"], 3, "{status}");
    let refused = quota(
        "tenantId=atlas&principalType=user&principalId=U-5",
        "wrong-token",
    )
    .await
    .expect("quota");
    assert_eq!(refused.status(), 401);
    for (query, field) in [
        ("principalType=user&principalId=U-5", "tenantId"),
        (
            "tenantId=atlas&principalType=robot&principalId=U-5",
            "principalType",
        ),
        (
            "tenantId=atlas&principalType=user&principalId=",
            "principalId",
        ),
        (
            "tenantId=at%20las&principalType=user&principalId=U-5",
            "tenantId",
        ),
        (
            "tenantId=atlas&principalType=user&principalId=U-5&colour=red",
            "colour",
        ),
    ] {
        let answer = quota(query, GATEWAY).await.expect("quota");
        assert_eq!(answer.status(), 400, "{query}");
        assert_eq!(
            answer.headers()["content-type"],
            "application/problem+json",
            "{query}"
        );
        let problem: Value = answer.json().await.expect("problem");
        assert_eq!(problem["field"], field, "{query}: {problem}");
    }
}

/// A request decided by global rules alone names its pool, with the figures `GET /v1/quota` shows
/// for it (`G`, and what is left by the allocator's last word plus what is held), not zeros.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_by_global_rules_alone_shows_the_pools_figures() {
    let fake = Allocator::new(10, 5, 0);
    let agent = Agent::new(
        common::settings(),
        Arc::new(SystemClock),
        allot_region_agent::limiter::Limiter::new(
            Arc::new(allot_region_agent::limiter::InProcessStore::new(
                Arc::new(SystemClock),
                1_000,
            )),
            allot_region_agent::limiter::LimiterConfig::default(),
        )
        .expect("limiter"),
        Some(client(fake.clone()).await),
        Some(common::bundle(
            r#"{ "rules": [ { "id": "global-api", "scope": "global", "pool": "api",
                 "expose": true, "failMode": "closed" } ] }"#,
        )),
    );
    let mut remaining = Vec::new();
    for n in 0..3 {
        let decision = agent
            .admit(&common::user_request(&format!("g-{n}"), "U-1", "read"))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
        assert_eq!(decision.policy_id.as_deref(), Some("global-api"));
        assert_eq!(decision.limit_units, 10, "the pool's G: {decision:?}");
        remaining.push(decision.remaining_units);
    }
    // 5 granted to this agent, 5 left to grant: 9, 8, 7 after each admission.
    assert_eq!(remaining, [9, 8, 7]);
    // The same figures in the RateLimit fields of /v1/check: the rule says `expose`, and the
    // pool's window is the allocator's (an hour here).
    let url = common::serve_http(agent, GATEWAY).await;
    let checked = reqwest::Client::new()
        .post(format!("{url}/v1/check"))
        .bearer_auth(GATEWAY)
        .json(&common::user_request("g-3", "U-1", "read"))
        .send()
        .await
        .expect("check");
    assert_eq!(checked.status(), 200);
    let field = |name: &str| {
        checked
            .headers()
            .get(name)
            .map(|value| value.to_str().expect("ascii").to_owned())
    };
    assert_eq!(
        field("ratelimit-policy").as_deref(),
        Some("\"global-api\";q=10;w=3600")
    );
    assert_eq!(
        field("ratelimit").as_deref(),
        Some("\"global-api\";r=6;t=0")
    );
}

/// "Most constraining" is the rule with the least left relative to its quota, whatever its scope,
/// the request's global pools included: a pool of 23 under a user rule of 500 names the pool, down
/// to 0 left on its 23rd admission, in the decision and in the RateLimit fields; a user rule of 2
/// on another route, tighter than the pool then, names itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_names_its_most_constraining_rule_its_pool_included() {
    let fake = Allocator::new(23, 23, 0);
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(
            r#"{ "rules": [
            { "id": "client-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
              "limit": 500, "windowMs": 3600000, "failMode": "closed" },
            { "id": "client-write", "scope": "user", "routeGroup": "write", "algorithm": "fixed_window",
              "limit": 2, "windowMs": 3600000, "failMode": "closed" },
            { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
              "expose": true } ] }"#,
        )),
    );
    let write = agent
        .admit(&common::user_request("w-0", "U-2", "write"))
        .await
        .expect("decision");
    assert!(write.allowed, "{write:?}");
    assert_eq!(
        (
            write.policy_id.as_deref(),
            write.remaining_units,
            write.limit_units
        ),
        (Some("client-write"), 1, 2),
        "1 of 2 left is tighter than 22 of 23: {write:?}"
    );
    let mut named = Vec::new();
    for n in 1..22 {
        let decision = agent
            .admit(&common::user_request(&format!("r-{n}"), "U-1", "read"))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
        named.push((decision.policy_id.clone(), decision.remaining_units));
    }
    let expected: Vec<(Option<String>, u64)> = (1..22)
        .map(|n| (Some("global-api".to_owned()), 22 - n))
        .collect();
    assert_eq!(named, expected, "the pool, with what it has left");
    let url = common::serve_http(agent.clone(), GATEWAY).await;
    let last = reqwest::Client::new()
        .post(format!("{url}/v1/check"))
        .bearer_auth(GATEWAY)
        .json(&common::user_request("r-22", "U-1", "read"))
        .send()
        .await
        .expect("check");
    assert_eq!(last.status(), 200, "the pool's 23rd token");
    let field = |name: &str| {
        last.headers()
            .get(name)
            .map(|value| value.to_str().expect("ascii").to_owned())
    };
    assert_eq!(
        field("ratelimit-policy").as_deref(),
        Some("\"global-api\";q=23;w=3600")
    );
    assert_eq!(
        field("ratelimit").as_deref(),
        Some("\"global-api\";r=0;t=3600"),
        "the pool named with nothing left, not the user rule's 478"
    );
    let refused = agent
        .admit(&common::user_request("r-23", "U-1", "read"))
        .await
        .expect("decision");
    assert!(!refused.allowed);
    assert_eq!(refused.policy_id.as_deref(), Some("global-api"));
}

/// A pool the allocator has said nothing of in this window (here its grants hang, and the agent
/// admits in fallback) is no measure of what is left: the admission names its regional rule, not
/// the pool with a made-up 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_the_allocators_figure_does_not_displace_the_regional_rule() {
    let fake = Allocator::new(10, 5, 5);
    fake.hang_grants
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(client(fake.clone()).await),
        Some(common::bundle(
            r#"{ "rules": [
            { "id": "client-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
              "limit": 500, "windowMs": 3600000, "failMode": "closed" },
            { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
              "expose": true } ] }"#,
        )),
    );
    let decision = agent
        .admit(&common::user_request("f-0", "U-1", "read"))
        .await
        .expect("decision");
    assert!(decision.allowed && decision.fallback, "{decision:?}");
    assert_eq!(
        (
            decision.policy_id.as_deref(),
            decision.remaining_units,
            decision.limit_units
        ),
        (Some("client-read"), 499, 500),
        "{decision:?}"
    );
}
