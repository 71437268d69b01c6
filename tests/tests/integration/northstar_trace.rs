//! The reference design's end-to-end trace (chapter 18), through a region agent on a real Redis:
//! pre-authentication window, user + tenant buckets decided in one script, two gateways racing for a
//! user's last token, the retry after refill, exports under a concurrency cap with an idempotent
//! retry, the fourth concurrent export refused, and the store lost with per-route fail modes.

use std::sync::Arc;
use std::time::Duration;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::{
    IpPrefixes, Pepper, principal_hash, principal_key, rule_state_key, tenant_key,
};
use allot_testkit::RedisServer;

const PEPPER: &[u8] = b"northstar-pepper-012345";

fn bundle() -> allot_shared::policy::PolicyBundle {
    let text = r#"{ "bundleVersion": 42, "rules": [
        { "id": "anon-ip", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": 20, "windowMs": 10000, "failMode": "local_bounded",
          "localCapacityMillis": 5000, "localRefillMillis": 250 },
        { "id": "read-user-v3", "scope": "user", "principalType": "user", "routeGroup": "read",
          "algorithm": "token_bucket", "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000,
          "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 250 },
        { "id": "tenant-atlas-minute", "scope": "tenant", "tenant": "atlas", "algorithm": "token_bucket",
          "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 60000,
          "failMode": "local_bounded", "localCapacityMillis": 20000, "localRefillMillis": 16000 },
        { "id": "export-tenant", "scope": "tenant", "routeGroup": "export", "algorithm": "token_bucket",
          "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 60000, "costMillis": 10000,
          "concurrencyMax": 3, "failMode": "closed", "idempotent": true } ] }"#;
    allot_shared::policy::parse_bundle(text)
        .and_then(|d| d.into_file_bundle())
        .expect("bundle")
}

fn request(id: &str, kind: PrincipalType, who: &str, route: &str) -> AdmissionRequest {
    // Before authentication there is no verified tenant: the edge files those requests under its
    // own pseudo-tenant, so they can never spend a real tenant's budget.
    let tenant = if kind == PrincipalType::Ip {
        "edge"
    } else {
        "atlas"
    };
    AdmissionRequest {
        request_id: DecisionId::parse(id).expect("id"),
        tenant_id: TenantId::parse(tenant).expect("tenant"),
        principal: Principal {
            kind,
            id: who.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: Some(42),
        dry_run: false,
        metered: false,
    }
}

async fn tokens(redis: &RedisServer, key: &str) -> Option<u64> {
    let client = redis::Client::open(redis.url()).expect("client");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    // A token bucket's state is "t<tokens> <updated at>".
    let state: Option<String> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut connection)
        .await
        .expect("GET");
    let tokens = state?.strip_prefix('t')?.split(' ').next()?.parse();
    Some(tokens.expect("a token bucket's state"))
}

async fn agent_on(redis: &RedisServer) -> Arc<Agent> {
    // Deadlines have their own tests; here a generous call deadline and budget keep a CPU-starved
    // CI machine from turning a slow Redis reply into LIMITER_UNAVAILABLE.
    let store_config = RedisStoreConfig {
        call_timeout: std::time::Duration::from_secs(1),
        ..RedisStoreConfig::default()
    };
    let store = RedisStore::connect(&redis.url(), store_config)
        .await
        .expect("redis");
    let config = LimiterConfig {
        decision_budget: std::time::Duration::from_secs(1),
        acquire_wait: std::time::Duration::from_millis(500),
        ..LimiterConfig::default()
    };
    let limiter = Limiter::new(Arc::new(store), config).expect("limiter");
    Agent::new(
        AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("gateway-a").expect("agent id"),
            Pepper::new(PEPPER.to_vec()).expect("pepper"),
        ),
        Arc::new(SystemClock),
        limiter,
        None,
        Some(bundle()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_northstar_trace() {
    let mut redis = RedisServer::start();
    // Gateways A and B: two agents on the same regional Redis.
    let (a, b) = (agent_on(&redis).await, agent_on(&redis).await);
    let atlas = TenantId::parse("atlas").expect("tenant");
    let read = RouteGroup::parse("read").expect("route");
    let pepper = Pepper::new(PEPPER.to_vec()).expect("pepper");
    // Every rule here is a token bucket: its state lives under the key's `tb` shape.
    let user_key = rule_state_key(
        &principal_key(
            &atlas,
            PrincipalType::User,
            &principal_hash(&pepper, PrincipalType::User, "U-17", IpPrefixes::default()),
            Some(&read),
        ),
        "tb",
    );
    let tenant_bucket = rule_state_key(&tenant_key(&atlas, None), "tb");
    let export_bucket = rule_state_key(
        &tenant_key(&atlas, Some(&RouteGroup::parse("export").expect("route"))),
        "tb",
    );

    // 1. Pre-authentication: 7 requests from one address pass the 20-per-10-s window.
    for n in 0..7 {
        let d = a
            .admit(&request(
                &format!("ip-{n}"),
                PrincipalType::Ip,
                "203.0.113.9",
                "login",
            ))
            .await
            .expect("decision");
        assert!(d.allowed, "pre-auth request {n}");
    }

    // 6. Request 1 for U-17: user 20,000 -> 19,000 and tenant -> 999,000 in one script call.
    let first = a
        .admit(&request(
            "r-9f3a61c2e07b4d18",
            PrincipalType::User,
            "U-17",
            "read",
        ))
        .await
        .expect("decision");
    assert!(first.allowed);
    assert_eq!(first.policy_version, 42);
    assert_eq!(tokens(&redis, &user_key).await, Some(19_000));
    assert_eq!(tokens(&redis, &tenant_bucket).await, Some(999_000));

    // 7. Drain U-17 to its last token, then gateways A and B race for it: exactly one wins.
    for n in 0..18 {
        let d = a
            .admit(&request(
                &format!("d-{n}"),
                PrincipalType::User,
                "U-17",
                "read",
            ))
            .await
            .expect("decision");
        assert!(d.allowed, "drain {n}");
    }
    let tenant_before_race = tokens(&redis, &tenant_bucket).await.expect("tenant bucket");
    let (from_a, from_b) = (
        request("race-a", PrincipalType::User, "U-17", "read"),
        request("race-b", PrincipalType::User, "U-17", "read"),
    );
    let (race_a, race_b) = tokio::join!(a.admit(&from_a), b.admit(&from_b));
    let (race_a, race_b) = (race_a.expect("decision"), race_b.expect("decision"));
    assert_eq!(
        u8::from(race_a.allowed) + u8::from(race_b.allowed),
        1,
        "exactly one of two contending requests is admitted"
    );
    let loser = if race_a.allowed { &race_b } else { &race_a };
    assert_eq!(loser.denied_scope, Some(DeniedScope::User));
    assert_eq!(loser.reason, Some(Reason::RateExceeded));
    assert!(
        loser.retry_after_ms > 0 && loser.retry_after_ms <= 500,
        "{loser:?}"
    );
    // One debit of 1,000 (the bucket refills about 17 millitokens per ms meanwhile); two debits
    // would leave it near 2,000 lower.
    let tenant_after_race = tokens(&redis, &tenant_bucket).await.expect("tenant bucket");
    assert!(
        tenant_after_race + 1_000 >= tenant_before_race
            && tenant_after_race + 1_000 <= tenant_before_race + 500,
        "the loser debited nothing: {tenant_before_race} -> {tenant_after_race}"
    );

    // 9. About a second later the bucket has refilled by 2 tokens: the retry is admitted.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let retry = b
        .admit(&request("retry-1", PrincipalType::User, "U-17", "read"))
        .await
        .expect("decision");
    assert!(retry.allowed, "{retry:?}");

    // 10-11. Exports: idempotent, under a cap of 3. A retry of the same decision id (a lost reply)
    // replays the recorded admission: the export budget is debited once.
    let export = |id: &str| request(id, PrincipalType::User, "U-17", "export");
    assert!(a.admit(&export("r-e41")).await.expect("decision").allowed);
    let after_first = tokens(&redis, &export_bucket).await.expect("export bucket");
    assert_eq!(after_first, 990_000);
    assert!(
        a.admit(&export("r-e41")).await.expect("decision").allowed,
        "the retry is admitted"
    );
    assert_eq!(
        tokens(&redis, &export_bucket).await,
        Some(after_first),
        "debited once"
    );

    // 12. Two more exports fill the cap; the fourth is refused though the rate bucket has budget.
    assert!(a.admit(&export("r-e42")).await.expect("decision").allowed);
    assert!(b.admit(&export("r-e43")).await.expect("decision").allowed);
    let fourth = b.admit(&export("r-e44")).await.expect("decision");
    assert!(!fourth.allowed);
    assert_eq!(fourth.reason, Some(Reason::ConcurrencyExceeded));

    // 13. The store is lost: reads fall back to the local bucket (fallback: true); exports fail
    // closed (503 LIMITER_UNAVAILABLE).
    redis.stop();
    let read_during_outage = a
        .admit(&request("outage-read", PrincipalType::User, "U-18", "read"))
        .await
        .expect("decision");
    assert!(
        read_during_outage.allowed && read_during_outage.fallback,
        "{read_during_outage:?}"
    );
    let export_during_outage = a.admit(&export("outage-export")).await.expect("decision");
    assert!(!export_during_outage.allowed);
    assert_eq!(
        export_during_outage.reason,
        Some(Reason::LimiterUnavailable)
    );
    assert_eq!(
        allot_shared::contract::http_status(&export_during_outage),
        503,
        "an outage is never a 429"
    );
}
